"""Context parallelism (CP) inside one GPU: the exact forward through chunk-aligned partitions (docs/dev/cp.md).

One long sequence on few heads leaves most SMs idle: the recurrence is serial along the sequence and the forward
runs one CTA per (sequence, value head, V slice). CP cuts every sequence into partitions of `L` chunks, runs them
in parallel and gives each its exact start state (docs/algorithm.md §4.3), in three steps built on the stage
launchers:

1. **Summary passes.** The recurrence acts on each value column of the state independently (column j of S evolves
   with column j of v; K, g, beta, A are shared), so `chunk_fwd` over the partitions (each run as a sequence of its
   own) gives, with values v from a zero start, each partition's end state E_p as its final state, and with zero
   values from the identity ``I`` (``[P, HV, K, K]``, K-first), its transition M_p (``S -> M_p S``). These are the two
   column blocks of one augmented run (values ``[0 | v]`` from ``[I | 0]`` ends in ``[M_p | E_p]``), launched
   apart: the kernel splits V into 64-column CTAs anyway, so the CTA work is the same, no ``[0 | v]`` copy is made
   and no build of value width K + V is needed. Their o is discarded.
2. **Scan** (fp32; float64 for float64 inputs): ``S_{p+1} = M_p S_p + E_p`` over each sequence's partitions, from
   the sequence's initial state; torch ops, either serial (one step per partition index, batched over sequences)
   or log-depth (segmented doubling over the composed pairs), whichever `scan_cost` predicts cheaper.
3. **Output pass.** `chunk_fwd` over the partitions from those start states gives o; the last partition of each
   sequence holds its final state.

The partition plan (`CPPlan`) is computed on the device from cu_seqlens into buffers whose sizes depend only on
host information (T, N, L), so CUDA graphs capture it and replay it with new lengths within the captured shapes;
nothing here reads device data on the host. The backward runs serially (whole sequences) and is exact; CP in the
backward and the gate-driven warm-up (docs/algorithm.md §4.4) are not implemented yet (docs/dev/cp.md).

The decision (`decide`): `context_parallel` argument, else ``FLASHDELTA_CP``, else the cost model (`predict`) on
the native backend. The states in the CP path are always K-first (``[.., K, V]``); a V-first caller's initial and
final states (N of them) are transposed at the boundary.
"""
from __future__ import annotations

import functools
import math
import os
from typing import NamedTuple, Optional

import torch

__all__ = ["CPPlan", "CP_AUTO", "CP_ON", "ENV_CP", "bounds", "builds", "choose", "cp_chunk_fwd", "decide",
           "make_plan", "num_sms", "parse_request", "predict", "resolve_code", "scan_cost", "scan_log", "scan_serial",
           "scan_states", "summaries", "supported"]

Tensor = torch.Tensor

ENV_CP = "FLASHDELTA_CP"
BT = 64                         # chunk size of every stage

# Codes `decide` hands the forward (`autograd`): 0 serial, L > 0 CP with partitions of L chunks, or (where the
# decision is taken inside a traced graph, with only shapes known) one of these two, resolved by `resolve_code`.
CP_AUTO = -1                    # the cost model, from shapes alone
CP_ON = -2                      # CP with the cost model's best L, from shapes alone

# ---- cost model constants (microseconds on an H200, 132 SMs, bf16, K = V = 128); `bench/dev/fit_cp.py` refits
# them. Starting values from docs/dev/fused_fwd.md: the fused forward takes `items x (chunks x c + o)` on the
# busiest SM, c = 1.670 us per chunk at full occupancy (power-capped clock), ~1.39 us with 16 CTAs (2/8 1x32768:
# 0.712 ms for 512 chunks, prepare included), o = 4.9 us per CTA, ~9 us fixed per launch.
CHUNK_US_FULL = 1.67            # per chunk and CTA, every SM busy
CHUNK_US_IDLE = 1.39            # per chunk and CTA, few CTAs (higher clock)
ITEM_US = 4.9                   # per CTA: start, pipeline fill, drain
LAUNCH_US = 9.0                 # per fused launch, fixed
SCAN_STEP_US = 6.0              # one step of the serial scan (a gather and a batched GEMM, few launches)
SCAN_LEVEL_US = 12.0            # one level of the log-depth scan, launches
SCAN_TFLOPS = 25.0              # fp32 batched-GEMM rate of the log-depth scan (TFLOP/s)
HBM_GBPS = 3500.0               # write rate of the M pass's zero values (GB/s)
MARGIN = 0.9                    # split only where the predicted CP time is below MARGIN x the serial time
MIN_SEQ_CHUNKS = 32             # auto: no split of a batch whose longest sequence has fewer chunks (2048 tokens)
CANDIDATE_L = (8, 16, 32, 64, 128, 256)      # partition lengths (chunks) the model tries


# ------------------------------------------------------------------------------------------------ request

def parse_request(context_parallel) -> object:
    """The caller's request as ``"auto"``, ``"off"``, ``"on"`` or a partition length in chunks (int >= 1).

    `context_parallel`: None (``FLASHDELTA_CP``, default auto), False (off), True (on, the cost model's partition
    length), or an int >= 1 (on, partitions of that many 64-token chunks). ``FLASHDELTA_CP``: ``auto``, ``0`` /
    ``off``, ``1`` / ``on``, or an int >= 2 (partition chunks).
    """
    if context_parallel is None:
        raw = os.environ.get(ENV_CP, "auto").strip().lower() or "auto"
        if raw in ("auto",):
            return "auto"
        if raw in ("0", "off", "false"):
            return "off"
        if raw in ("1", "on", "true"):
            return "on"
        if raw.isdigit() and int(raw) >= 2:
            return int(raw)
        raise ValueError(f"{ENV_CP}={raw!r}: expected auto, 0 (off), 1 (on) or a partition length in chunks >= 2")
    if isinstance(context_parallel, bool):
        return "on" if context_parallel else "off"
    if isinstance(context_parallel, int):
        if context_parallel < 1:
            raise ValueError(f"context_parallel: a partition length must be >= 1 chunk, got {context_parallel} "
                             f"(False turns CP off)")
        return int(context_parallel)
    raise TypeError(f"context_parallel must be None, a bool or an int (partition chunks), got {context_parallel!r} "
                    f"({type(context_parallel).__name__})")


def supported(kset, K: int, V: int, dtype: torch.dtype) -> bool:
    """Whether `kset`'s chunk_fwd runs every CP pass: value width V (E and output passes) and K (M pass)."""
    return kset.has(["chunk_fwd"]) and kset.unsupported(K, K, dtype, "chunk_fwd") is None \
        and kset.unsupported(K, V, dtype, "chunk_fwd") is None


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """SM count of a CUDA device (132 for anything else: an H100 SXM / H200)."""
    if device.type != "cuda":
        return 132
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


# ------------------------------------------------------------------------------------------------ cost model

def _pass_us(items: list, sms: int) -> float:
    """One fused launch over `items` = [(chunks, count)] CTAs: ``ceil(work / (SMs x longest)) x longest`` (exact
    for equal items, at most one longest item pessimistic otherwise), the per-chunk time interpolated between the
    few-CTA and the full-occupancy clock."""
    n = sum(c for _, c in items)
    if n == 0:
        return LAUNCH_US
    c = CHUNK_US_IDLE + (CHUNK_US_FULL - CHUNK_US_IDLE) * min(1.0, n / sms)
    longest = max(ch for ch, cnt in items if cnt) * c + ITEM_US
    work = sum(cnt * (ch * c + ITEM_US) for ch, cnt in items)
    return LAUNCH_US + math.ceil(work / (sms * longest) - 1e-9) * longest


def bounds(T: int, N: int, L: int, seq_len: Optional[int] = None) -> tuple:
    """(P, J): partition slots and scan steps for L-chunk partitions, from host information only. Dense input
    (`seq_len`: every sequence has that many tokens): exact. Varlen: ``P = N + T // (64 L)`` bounds
    ``sum max(1, ceil(len_n / (64 L)))`` and ``J = ceil(T / (64 L))`` bounds the partitions of one sequence."""
    W = L * BT
    if seq_len is not None:
        J = max(1, -(-seq_len // W))
        return N * J, J
    return N + T // W, max(1, -(-T // W))


def scan_cost(P: int, J: int, HV: int, K: int, V: int) -> tuple:
    """(microseconds, method) of the cheaper scan: ``"serial"`` (J steps) or ``"log"`` (ceil(log2 J) levels of
    batched [K, K] x [K, K + V] GEMMs over every partition)."""
    serial = J * SCAN_STEP_US
    levels = max(0, math.ceil(math.log2(J))) if J > 1 else 0
    log = levels * (SCAN_LEVEL_US + 2.0 * P * HV * K * K * (K + V) / (SCAN_TFLOPS * 1e6))
    return (serial, "serial") if serial <= log else (log, "log")


def _seq_chunks(T: int, N: int, lengths) -> list:
    """Chunks per sequence: from the host lengths, else N equal sequences of T / N tokens (the case where a
    split gains least, so the decision stays conservative)."""
    if lengths is not None:
        return [-(-int(n) // BT) for n in lengths]
    return [-(-(T // max(N, 1)) // BT)] * N


def predict(*, T: int, N: int, HV: int, K: int, V: int, L: int, sms: int, lengths=None,
            seq_len: Optional[int] = None) -> dict:
    """Predicted microseconds of the serial forward's fused pass and of CP's passes with L-chunk partitions."""
    chunks = _seq_chunks(T, N, lengths if seq_len is None else [seq_len] * N)
    NV, NK = max(1, V // 64), max(1, K // 64)
    serial = _pass_us([(c, HV * NV) for c in chunks], sms)
    parts = {}
    for c in chunks:
        full, rem = divmod(c, L)
        parts[L] = parts.get(L, 0) + full
        if rem or c == 0:
            parts[rem] = parts.get(rem, 0) + 1
    P, J = bounds(T, N, L, seq_len)
    m = _pass_us([(ch, n * HV * NK) for ch, n in parts.items()], sms)
    e = _pass_us([(ch, n * HV * NV) for ch, n in parts.items()], sms)
    scan_us, scan = scan_cost(P, J, HV, K, V)
    zeros = T * HV * K * 2 / (HBM_GBPS * 1e3)
    return dict(serial=serial, cp=m + 2 * e + scan_us + zeros, m=m, e=e, out=e, scan=scan_us, scan_method=scan,
                zeros=zeros, P=P, J=J)


def choose(*, T: int, N: int, HV: int, K: int, V: int, sms: int, lengths=None, seq_len: Optional[int] = None,
           force: bool = False) -> int:
    """The partition length (chunks) the cost model picks, or 0 (serial). `force`: the best L even where the
    model prefers the serial path (0 only when no sequence is long enough to cut)."""
    chunks = _seq_chunks(T, N, lengths if seq_len is None else [seq_len] * N)
    longest = max(chunks, default=0)
    best, best_us, serial = 0, math.inf, None
    for L in CANDIDATE_L:
        if L >= longest:
            break
        p = predict(T=T, N=N, HV=HV, K=K, V=V, L=L, sms=sms, lengths=lengths, seq_len=seq_len)
        serial = p["serial"]
        if p["cp"] < best_us:
            best, best_us = L, p["cp"]
    if best == 0 or force:
        return best
    if longest < MIN_SEQ_CHUNKS or best_us >= MARGIN * serial:
        return 0
    return best


def decide(request, *, kset, device: torch.device, dtype: torch.dtype, B: int, T: int, HV: int, K: int, V: int,
           varlen: bool, N: int, lengths=None, traced: bool = False) -> int:
    """The CP code for one call: 0 (serial), L > 0, or, where `traced` (torch.compile: shapes may be symbolic and
    the kernel set is resolved inside the op), `CP_AUTO` / `CP_ON` for `resolve_code` to settle on concrete shapes.

    `request` from `parse_request`; `kset` the kernel set running chunk_fwd (unused when traced). CP needs a
    chunk_fwd that runs the value widths V and K (`supported`; else serial). ``auto`` splits only on a native
    (GPU) backend where the model predicts a gain; ``on`` and an explicit L split on any backend. `lengths`: the
    host sequence lengths where known (cu_seqlens_cpu or the validated copy of cu_seqlens); they steer the choice
    of L, never a buffer size.
    """
    if request == "off":
        return 0
    if traced:
        return request if isinstance(request, int) else (CP_ON if request == "on" else CP_AUTO)
    if not supported(kset, K, V, dtype):
        return 0
    if isinstance(request, int):
        return request
    if request == "auto" and (device.type != "cuda" or kset.name == "torch"):
        return 0
    return choose(T=B * T, N=N, HV=HV, K=K, V=V, sms=num_sms(device), lengths=lengths if varlen else None,
                  seq_len=None if varlen else T, force=(request == "on"))


def resolve_code(code: int, *, kset, device: torch.device, dtype: torch.dtype, B: int, T: int, HV: int, K: int,
                 V: int, N: int, varlen: bool) -> int:
    """A code from `decide` as a partition length with concrete shapes: 0 (serial) where CP cannot or, under
    `CP_AUTO`, should not run."""
    if code == 0 or not supported(kset, K, V, dtype):
        return 0
    if code > 0:
        return code
    if code == CP_AUTO and (device.type != "cuda" or kset.name == "torch"):
        return 0
    return choose(T=B * T, N=N, HV=HV, K=K, V=V, sms=num_sms(device), seq_len=None if varlen else T,
                  force=(code == CP_ON))


# ------------------------------------------------------------------------------------------------ plan

class CPPlan(NamedTuple):
    """Partitions of a flat varlen batch, on the device, in buffers sized from host information (`bounds`).

    Host ints: ``L`` (chunks per partition), ``P`` (partition slots), ``J`` (most partitions of one sequence:
    serial scan steps), ``N`` (sequences), ``regular`` (dense input: every sequence has J partitions, partition j
    of sequence n is slot ``n * J + j``). Device tensors: ``cu [P + 1]`` int32 partition boundaries (slots past
    the last partition are empty, at ``cu_seqlens[N]``), ``seq [P]`` int64 each slot's sequence (clamped to N - 1
    on unused slots), ``pos [P]`` int64 its index within the sequence (0 on unused slots), ``first [P]`` bool
    (starts its sequence, or unused), ``last_index [N]`` int64 each sequence's last partition, ``step_index [J, N]``
    int64 partition j of sequence n, or P where it has none (the scan's padding slot).
    """
    L: int
    P: int
    J: int
    N: int
    regular: bool
    cu: Tensor
    seq: Tensor
    pos: Tensor
    first: Tensor
    last_index: Tensor
    step_index: Tensor


def make_plan(cu_seqlens: Tensor, T: int, L: int, *, seq_len: Optional[int] = None,
              chunk_size: int = BT) -> CPPlan:
    """Cut every sequence into partitions of L chunks (the last takes the remainder; an empty sequence gives one
    empty partition), as `reference.cp.partition` does, on cu_seqlens' device with torch ops only (no host
    synchronisation). `T`: tokens of the flat input; `seq_len`: dense input (all sequences this long)."""
    if L < 1:
        raise ValueError(f"L: partitions need >= 1 chunk, got {L}")
    if chunk_size != BT:
        raise ValueError(f"chunk_size: CP runs 64-token chunks, got {chunk_size}")
    dev = cu_seqlens.device
    N = cu_seqlens.shape[0] - 1
    W = L * BT
    P, J = bounds(T, N, L, seq_len)
    cu = cu_seqlens.to(torch.int64)
    lens = cu[1:] - cu[:-1]
    nparts = torch.clamp_min(torch.div(lens + (W - 1), W, rounding_mode="floor"), 1)            # [N]
    incl = torch.cumsum(nparts, 0)
    pstart = incl - nparts
    slots = torch.arange(P, device=dev)
    seq = torch.searchsorted(incl, slots, right=True)                                           # N: unused slot
    used = seq < N
    seq = torch.clamp_max(seq, N - 1)
    pos = slots - pstart[seq]
    start = torch.where(used, cu[seq] + pos * W, cu[N])
    part_cu = torch.cat([start, cu[N:]]).to(torch.int32)
    pos = torch.where(used, pos, 0)
    first = pos == 0
    last_index = incl - 1
    steps = torch.arange(J, device=dev)[:, None]
    step_index = torch.where(steps < nparts[None, :], pstart[None, :] + steps, P)
    return CPPlan(L=int(L), P=P, J=J, N=N, regular=seq_len is not None, cu=part_cu, seq=seq, pos=pos, first=first,
                  last_index=last_index, step_index=step_index)


# ------------------------------------------------------------------------------------------------ scan

def _h0(initial_state: Optional[Tensor], N: int, HV: int, K: int, V: int, dtype, device) -> Tensor:
    if initial_state is None:
        return torch.zeros(N, HV, K, V, dtype=dtype, device=device)
    return initial_state.to(dtype)


def scan_serial(M: Tensor, E: Tensor, plan: CPPlan, h0: Optional[Tensor]) -> Tensor:
    """Start states ``[P, HV, K, V]`` of every partition from the transitions ``M [P, HV, K, K]``, the end states
    from zero ``E [P, HV, K, V]`` and the sequences' initial states ``h0 [N, HV, K, V]`` (K-first; None: zeros):
    ``S_{j+1} = M_j S_j + E_j``, one step per partition index j, batched over sequences. Dense input: strided
    views (one sequence: one batched GEMM per step, written in place). Varlen: a gather of step j's partitions;
    sequences without a j-th one take the padding slot P, the identity map."""
    P, HV, K, V = E.shape
    N, J = plan.N, plan.J
    S = _h0(h0, N, HV, K, V, E.dtype, E.device)
    if plan.regular:
        Mr, Er = M.view(N, J, HV, K, K), E.view(N, J, HV, K, V)
        H = torch.empty(N, J, HV, K, V, dtype=E.dtype, device=E.device)
        H[:, 0] = S
        for j in range(J - 1):
            if N == 1:
                torch.baddbmm(Er[0, j], Mr[0, j], H[0, j], out=H[0, j + 1])
            else:
                H[:, j + 1] = torch.matmul(Mr[:, j], H[:, j]) + Er[:, j]
        return H.view(P, HV, K, V)
    eye = torch.eye(K, dtype=M.dtype, device=M.device).expand(1, HV, K, K)
    Mp = torch.cat([M, eye])                                     # slot P: the identity map (no partition)
    Ep = torch.cat([E, E.new_zeros(1, HV, K, V)])
    H = torch.empty(P + 1, HV, K, V, dtype=E.dtype, device=E.device)
    for j in range(J):
        idx = plan.step_index[j]
        H.index_copy_(0, idx, S)                                 # several sequences may write slot P: discarded
        if j + 1 < J:
            S = torch.baddbmm(Ep.index_select(0, idx).view(N * HV, K, V), Mp.index_select(0, idx).view(N * HV, K, K),
                              S.view(N * HV, K, V)).view(N, HV, K, V)
    return H[:P]


def scan_log(M: Tensor, E: Tensor, plan: CPPlan, h0: Optional[Tensor]) -> Tensor:
    """`scan_serial`'s result by a segmented doubling scan over the partition slots: level d composes each pair
    with the one d slots earlier in the same sequence, ``(M, E) o (M', E') = (M M', M E' + E)``, as one batched
    GEMM of M with ``[M' | E']``; ceil(log2 J) levels (the last one without the M part)."""
    P, HV, K, V = E.shape
    if h0 is not None:          # fold each sequence's initial state into its first partition: E += M h0
        E = torch.where(plan.first[:, None, None, None], torch.baddbmm(
            E.view(P * HV, K, V), M.view(P * HV, K, K), h0.to(E.dtype).index_select(0, plan.seq).view(P * HV, K, V)
        ).view(P, HV, K, V), E)
    X = torch.cat([M, E], -1)                                    # [P, HV, K, K + V]
    d = 1
    while d < plan.J:
        take = (plan.pos[d:] >= d)[:, None, None, None]
        if 2 * d < plan.J:
            Y = torch.matmul(X[d:, :, :, :K], X[:-d])
            Y[..., K:] += X[d:, :, :, K:]
            X = torch.cat([X[:d], torch.where(take, Y, X[d:])])
        else:
            Ed = torch.baddbmm(X[d:, :, :, K:].reshape(-1, K, V), X[d:, :, :, :K].reshape(-1, K, K),
                               X[:-d, :, :, K:].reshape(-1, K, V)).view(P - d, HV, K, V)
            X = torch.cat([X[:d, :, :, K:], torch.where(take, Ed, X[d:, :, :, K:])])
            break
        d *= 2
    end = X[..., K:] if X.shape[-1] == K + V else X              # end state of every partition
    start = _h0(h0, plan.N, HV, K, V, E.dtype, E.device).index_select(0, plan.seq)
    prev = torch.cat([start[:1], end[:-1]])
    return torch.where(plan.first[:, None, None, None], start, prev)


def scan_states(M: Tensor, E: Tensor, plan: CPPlan, h0: Optional[Tensor], method: Optional[str] = None) -> Tensor:
    """Every partition's start state (K-first), by `method` (``"serial"`` / ``"log"``; None: `scan_cost`'s)."""
    if method is None:
        method = scan_cost(plan.P, plan.J, E.shape[1], E.shape[2], E.shape[3])[1]
    if method == "serial":
        return scan_serial(M, E, plan, h0)
    if method == "log":
        return scan_log(M, E, plan, h0)
    raise ValueError(f"method: {method!r}, expected 'serial' or 'log'")


# ------------------------------------------------------------------------------------------------ forward

def summaries(q, k, v, g_cumsum, beta, A, plan: CPPlan, *, scale: float, chunk_fwd, state_dtype) -> tuple:
    """``(M [P, HV, K, K], E [P, HV, K, V])`` (K-first) of every partition, by two `chunk_fwd` launches over the
    partitions: zero values from the identity (M), v from zero (E). Their o is discarded."""
    T, HV = v.shape[1], v.shape[2]
    K = k.shape[-1]
    eye = torch.eye(K, dtype=state_dtype, device=v.device).expand(plan.P, HV, K, K).contiguous()
    _, M = chunk_fwd(q, k, v.new_zeros(1, T, HV, K), g_cumsum, beta, A, eye, plan.cu, scale=scale,
                     state_v_first=False)
    _, E = chunk_fwd(q, k, v, g_cumsum, beta, A, None, plan.cu, scale=scale, state_v_first=False)
    return M, E


def cp_chunk_fwd(q, k, v, g_cumsum, beta, A, initial_state, cu_seqlens, *, scale, state_v_first=False,
                 chunk_size=BT, plan: CPPlan, backends, scan: Optional[str] = None):
    """The `chunk_fwd` stage (docs/stages.md) through the partitions of `plan` (`make_plan` of the same
    cu_seqlens), exact: ``(o [1, T, HV, V], final_state [N, HV, K, V] or [N, HV, V, K])``.

    `backends`: the call's `dispatch.Plan`; every launch goes to its chunk_fwd launcher, which must run the value
    widths V and K (`supported`). beta and the initial state as that launcher takes them. States are fp32 (float64
    for float64 q). `scan`: ``"serial"``, ``"log"`` or None (`scan_cost`'s choice). Launches: three `chunk_fwd`
    (M, E, output), the zero values, the identity, the scan (`scan_serial`: J - 1 batched GEMMs for one dense
    sequence; varlen: about four small kernels per step), the final-state gather.
    """
    if chunk_size != BT:
        raise ValueError(f"chunk_size: CP runs 64-token chunks, got {chunk_size}")
    del cu_seqlens                                                # the plan holds the partition boundaries
    launch = backends.fn("chunk_fwd")
    sd = backends.kset("chunk_fwd").param_dtype(torch.float64 if q.dtype == torch.float64 else torch.float32)
    M, E = summaries(q, k, v, g_cumsum, beta, A, plan, scale=scale, chunk_fwd=launch, state_dtype=sd)
    h0 = initial_state
    if h0 is not None:
        h0 = (h0.transpose(-1, -2) if state_v_first else h0).to(E.dtype)
    H = scan_states(M, E, plan, h0, scan)
    o, ht = launch(q, k, v, g_cumsum, beta, A, H, plan.cu, scale=scale, state_v_first=False)
    final = ht.index_select(0, plan.last_index)
    if state_v_first:
        final = final.transpose(-1, -2).contiguous()
    return o, final


def builds(H: int, HV: int, K: int, V: int, dtype: torch.dtype, beta_dtype: torch.dtype, scale: float) -> list:
    """(label, builder, args) of the SM90 fused-forward builds the CP forward launches: value width V without an
    initial state (E pass) and with an fp32 one (output pass), width K with one (M pass), all K-first. At K = V
    these are the serial forward's default builds (`flashdelta warmup` compiles them)."""
    from .kernels import fused_fwd  # noqa: PLC0415 - TileLang only where SM90 builds are listed

    todo = fused_fwd.launcher_builds(H, HV, K, V, dtype, beta_dtype, torch.float32, scale, initial_state=(False, True))
    if K != V:
        todo += fused_fwd.launcher_builds(H, HV, K, K, dtype, beta_dtype, torch.float32, scale, initial_state=(True,))
    return [(f"cp {label}", b, args) for label, b, args in todo]
