"""Context parallelism (CP) inside one GPU: the forward through chunk-aligned partitions (docs/dev/cp.md).

One long sequence on few heads leaves most SMs idle: the recurrence is serial along the sequence and the forward
runs one CTA per (sequence, value head, V slice). CP cuts every sequence into partitions of `L` chunks, runs them
in parallel and gives each its start state (exact, docs/algorithm.md §4.3, or by the gate-driven warm-up where it
is provably harmless, §4.4), in four steps built on the stage launchers:

1. **Windows** (`windows`): per partition that is not its sequence's last and value head, the shortest suffix of
   its chunks whose summed log decay reaches the warm-up threshold (`WARMUP_THRESHOLD`, -10: the dropped part is
   <= e^-10 of the state entering the window) where the norm bound's condition holds; heads without one (a
   never-decaying head, g = 0) fall back to the exact path. Exact CP (no threshold): every head falls back.
2. **Summary passes.** The recurrence acts on each value column of the state independently (column j of S evolves
   with column j of v; K, g, beta, A are shared), so `chunk_fwd` over the partitions (each run as a sequence of its
   own) gives, with values v from a zero start, each partition's end state E_p as its final state, and with zero
   values from the identity ``I`` (``[P, HV, K, K]``, K-first), its transition M_p (``S -> M_p S``). These are the two
   column blocks of one augmented run (values ``[0 | v]`` from ``[I | 0]`` ends in ``[M_p | E_p]``), run as separate
   CTAs of one launch (`summaries`: ``chunk_fwd(states_only=True, transitions=True)``): the kernel splits V into
   64-column CTAs anyway, so the CTA work is the same, no ``[0 | v]`` copy is made and no build of value width K + V
   is needed; no o is computed. With the windows (a start chunk per (partition, head): `chunk_skip` for the E walks,
   `transition_skip` for the M walks) the E walks cover each warm-up head's window only and the M walks only the
   fallback heads; a warm-up head's M is 0 and a sequence's last partition walks nothing (the scan reads no summary
   of it).
3. **Scan** (fp32; float64 for float64 inputs): ``S_{p+1} = M_p S_p + E_p`` over each sequence's partitions, from
   the sequence's initial state (the TileLang scan kernel on SM90, else torch ops: serial or log-depth, whichever
   `scan_cost` predicts cheaper); on a warm-up head ``S_{p+1} = E_window``.
4. **Output pass.** `chunk_fwd` over the partitions from those start states gives o; the last partition of each
   sequence holds its final state.

The partition plan (`CPPlan`) and the windows are computed on the device from cu_seqlens and the gates into
buffers whose sizes depend only on host information (T, N, L), so CUDA graphs capture them and replay them with new
lengths within the captured shapes; nothing here reads device data on the host.

The backward (`cp_chunk_bwd`) runs on the same kind of plan: the start states as above (M, E, scan; exact for
every head), then `state_recompute` over the partitions from them; `chunk_dstate` over the partitions that are
not their sequence's first (the dS chain of `chunk_bwd` from a zero end gradient; the first ones' CTAs exit at
once) gives their start gradients F_p (`_start_grads`); the reverse scan
``dS_end[p] = M_{p+1}^T dS_end[p+1] + F_{p+1}`` from each sequence's dht (`scan_grads`) gives every partition's
end gradient; a second `chunk_bwd` from those gives dq, dk, dv, dbeta, dG for the whole sequences and the
sequences' dh0 (their first partitions'). Its warm-up mirrors the forward's (docs/algorithm.md §4.4,
`grad_windows`): per partition that is not its sequence's first and value head, the shortest prefix of its chunks
whose summed log decay reaches the threshold; chunk_dstate walks only that prefix (`chunk_take`) and the head's M^T
is zeroed for the reverse scan, so the end gradient of the partition before is the prefix's F alone; heads without
such a prefix keep ``F_{p+1} + M_{p+1}^T dS_end[p+1]``.

The decision (`decide`): `context_parallel` argument, else ``FLASHDELTA_CP``, else the cost models
(`cp_model.predict` for the forward, with or without the warm-up; `cp_model.predict_bwd` for the backward) on the
native backend. One code carries both passes' partition lengths (`encode`): the forward op takes it as an input and
hands it to the backward through autograd's context, so the backward splits by the decision taken at the call (host
lengths), never by reading device data. The warm-up request travels in the plan (`make_plan(warmup=...)`, else
``FLASHDELTA_CP_WARMUP``; `auto`: on for bf16 / fp16 inputs, `warmup_threshold`). The states in the CP path are
always K-first (``[.., K, V]``); a V-first caller's initial and final states and their gradients (N of them) are
transposed at the boundary.
"""
from __future__ import annotations

import functools
import os
from typing import NamedTuple, Optional

import torch

from . import cp_model, streams
from .cp_model import (CANDIDATE_L, CANDIDATE_L_BWD, ENV_WARMUP, MARGIN, MIN_SEQ_CHUNKS,  # noqa: F401 - re-exported
                       MIN_SEQ_CHUNKS_BWD, WARMUP_DTYPES, WARMUP_THRESHOLD, WORST_MARGIN, _kernel_dims, bounds, choose,
                       choose_bwd, parse_warmup, predict, predict_bwd, scan_cost, warmup_threshold, wide_pays)
from .numerics import accum_dtype

__all__ = ["CPPlan", "CP_AUTO", "CP_ON", "ENV_CP", "ENV_WARMUP", "GradWindows", "Windows", "auto_lengths", "bounds",
           "builds", "choose", "choose_bwd", "cp_chunk_bwd", "cp_chunk_fwd", "decide", "decode", "encode",
           "grad_windows", "make_plan", "num_sms", "parse_request", "parse_warmup", "predict", "predict_bwd",
           "resolve_code", "scan_cost", "scan_grads", "scan_log", "scan_serial", "scan_states", "summaries",
           "supported", "supported_bwd", "warmup_threshold", "wide", "wide_pays", "windows", "with_wide"]

Tensor = torch.Tensor

ENV_CP = "FLASHDELTA_CP"
BT = cp_model.BT                # chunk size of every stage
# a chunk_skip past any partition's end: the CTA walks no chunk (its final state is its initial state)
SKIP_ALL = 1 << 30
# a chunk_take past any partition's end: the CTA walks every chunk of it (the exact path's F)
TAKE_ALL = 1 << 30
# b ||k||^2 of every token of a warm-up window must lie in [0, CONTRACTION_LIMIT]: then each factor I - b k k^T of
# the window's transition has norm <= 1 and ||M_w|| <= exp(summed log decay) (docs/algorithm.md §4.2)
CONTRACTION_LIMIT = 2.0
# ||k||^2 of an l2-normalised key rounded to bf16 (each element within 2^-9 relative: (1 + 2^-9)^2 < 1.004), the
# bound `windows(keys_normalized=True)` takes instead of reading k
NORMALIZED_KEY_NORM2 = 1.004

# Codes `decide` hands the forward op (`autograd`), which hands them to the backward op: ``encode(L_fwd, L_bwd)``
# (each 0 for serial or a partition length in chunks), or (where the decision is taken inside a traced graph, with
# only shapes known) one of these two, resolved per pass by `resolve_code`.
CP_AUTO = -1                    # the cost models, from shapes alone
CP_ON = -2                      # CP with each cost model's best L, from shapes alone
_BWD = 1 << 24                  # code = L_fwd + _BWD * L_bwd; partition lengths stay below it
# set on a code (`with_wide`) where the unsplit inference forward runs the wide build (`cp_model.wide_pays`)
_WIDE = 1 << 48

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
        if raw.isascii() and raw.isdigit() and 2 <= int(raw) < _BWD:  # isdigit() alone takes "²" (int() raises)
            return int(raw)
        raise ValueError(f"{ENV_CP}={raw!r}: expected auto, 0 (off), 1 (on) or a partition length in chunks >= 2")
    if isinstance(context_parallel, bool):
        return "on" if context_parallel else "off"
    if isinstance(context_parallel, int):
        if context_parallel < 1:
            raise ValueError(f"context_parallel: a partition length must be >= 1 chunk, got {context_parallel} "
                             f"(False turns CP off)")
        if context_parallel >= _BWD:
            raise ValueError(f"context_parallel: a partition length must be < {_BWD} chunks, got {context_parallel}")
        return int(context_parallel)
    raise TypeError(f"context_parallel must be None, a bool or an int (partition chunks), got {context_parallel!r} "
                    f"({type(context_parallel).__name__})")


def supported(kset, K: int, V: int, dtype: torch.dtype) -> bool:
    """Whether `kset`'s chunk_fwd runs every CP pass: value width V (E and output passes) and K (M pass)."""
    return kset.has(["chunk_fwd"]) and kset.unsupported(K, K, dtype, "chunk_fwd") is None \
        and kset.unsupported(K, V, dtype, "chunk_fwd") is None


def supported_bwd(kset, K: int, V: int, dtype: torch.dtype) -> bool:
    """Whether `kset` runs the backward's partition stages natively: state_recompute and chunk_bwd at (K, V) (the
    summary passes need `supported`'s chunk_fwd as well)."""
    return kset.has(["state_recompute", "chunk_bwd"]) and kset.unsupported(K, V, dtype, "chunk_bwd") is None \
        and kset.unsupported(K, V, dtype, "state_recompute") is None


def encode(fwd: int, bwd: int) -> int:
    """One code for both passes: partition lengths (chunks; 0: serial) of the forward and of the backward."""
    if not (0 <= fwd < _BWD and 0 <= bwd < _BWD):
        raise ValueError(f"partition lengths must be in [0, {_BWD}), got forward {fwd}, backward {bwd}")
    return int(fwd) + _BWD * int(bwd)


def decode(code: int) -> tuple:
    """(forward L, backward L) of a code >= 0 from `encode` (`with_wide`'s flag aside)."""
    if code < 0:
        raise ValueError(f"code: {code} is resolved by resolve_code, not decoded")
    code %= _WIDE
    return code % _BWD, code // _BWD


def with_wide(code: int) -> int:
    """`code` (a serial forward's: forward L 0) with the flag that makes the forward run the wide build."""
    if code < 0 or decode(code)[0]:
        raise ValueError(f"code: {code} has no serial forward to run wide")
    return code | _WIDE


def wide(code: int) -> bool:
    """Whether `code` carries `with_wide`'s flag."""
    return code >= 0 and bool(code & _WIDE)


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """SM count of a CUDA device (132 for anything else: an H100 SXM / H200)."""
    if device.type != "cuda":
        return 132
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def _native(kset, device: torch.device) -> bool:
    return device.type == "cuda" and kset.name != "torch"


def _sm90(x: Tensor, kset) -> bool:
    """Whether CP's own TileLang kernels (the plan, the scan, the warm-up windows) may take a call whose pass runs on
    `kset`: `x` on the GPU and the SM90 kernel set."""
    return x.is_cuda and kset is not None and kset.name == "sm90"


def decide(request, *, kset, device: torch.device, dtype: torch.dtype, B: int, T: int, HV: int, K: int, V: int,
           varlen: bool, N: int, lengths=None, traced: bool = False) -> int:
    """The CP code for one call, both passes: ``encode(L_fwd, L_bwd)`` (0: serial), or, where `traced`
    (torch.compile: shapes may be symbolic and the kernel set is resolved inside the ops), `CP_AUTO` / `CP_ON`
    for `resolve_code` to settle per pass on concrete shapes.

    `request` from `parse_request`; `kset` the kernel set running chunk_fwd (unused when traced). CP needs a
    chunk_fwd that runs the value widths V and K (`supported`; else serial in both passes). ``auto`` splits each
    pass by its own cost model (`choose`, `choose_bwd`), the forward only on a native backend, the backward only
    where that backend also runs state_recompute and chunk_bwd (`supported_bwd`); ``on`` splits both at each
    model's best L and an explicit L both at L, on any backend. The backward's choice differs from the forward's
    where the serial backward leaves SMs idle but the forward does not (chunk_bwd takes ~15x the forward's time
    per chunk, one CTA per (sequence, value head)), so it is taken separately and travels in the same code.
    `lengths`: the host sequence lengths where known (cu_seqlens_cpu or the validated copy of cu_seqlens); they
    steer the choice of L, never a buffer size.
    """
    if request == "off":
        return 0
    if traced:
        return encode(request, request) if isinstance(request, int) else (CP_ON if request == "on" else CP_AUTO)
    if not supported(kset, K, V, dtype):
        return 0
    if isinstance(request, int):
        return encode(request, request)
    force = request == "on"
    if not force and not _native(kset, device):
        return 0
    kw = dict(T=B * T, N=N, HV=HV, K=K, V=V, sms=num_sms(device), lengths=lengths if varlen else None,
              seq_len=None if varlen else T, force=force)
    warm = warmup_threshold(parse_warmup(None), dtype) is not None
    return encode(*auto_lengths(**kw, warmup=warm, backward=force or supported_bwd(kset, K, V, dtype)))


def auto_lengths(*, T: int, N: int, HV: int, K: int, V: int, sms: int, lengths=None, seq_len: Optional[int] = None,
                 force: bool = False, warmup: Optional[bool] = None, backward: bool = True) -> tuple:
    """(forward L, backward L) of `decide`'s cost models (0: serial; `backward` False: the backward stays serial).
    The training forward, split or not, saves every chunk state (`ENV_SAVE_STATES`, default on: no state_recompute,
    serial or over the partitions, no E pass, no forward scan), else, unsplit, the partition start states of a split
    backward (no E pass, no forward scan): the backward's model counts either."""
    kw = dict(T=T, N=N, HV=HV, K=K, V=V, sms=sms, lengths=lengths, seq_len=seq_len, force=force, warmup=warmup)
    fwd = choose(**kw)
    if not backward:
        return fwd, 0
    return fwd, choose_bwd(**kw, starts_saved=fwd == 0, states_saved=cp_model.save_states_enabled())


def resolve_code(code: int, *, kset, device: torch.device, dtype: torch.dtype, B: int, T: int, HV: int, K: int,
                 V: int, N: int, varlen: bool, backward: bool = False, bwd_kset=None) -> int:
    """One pass's partition length from a code of `decide`, with concrete shapes: the forward's, or with
    `backward` the backward's; 0 (serial) where CP cannot or, under `CP_AUTO`, should not run. `kset`: the kernel
    set running chunk_fwd (the summary passes); `bwd_kset`: the one running chunk_bwd (`CP_AUTO` in the backward
    splits only where it is native, `supported_bwd`)."""
    if code == 0 or not supported(kset, K, V, dtype):
        return 0
    if code > 0:
        return decode(code)[1 if backward else 0]
    force = code == CP_ON
    if not force and not _native(kset, device):
        return 0
    kw = dict(T=B * T, N=N, HV=HV, K=K, V=V, sms=num_sms(device), seq_len=None if varlen else T, force=force,
              warmup=warmup_threshold(parse_warmup(None), dtype) is not None)
    if not backward:
        return choose(**kw)
    if not force and not (bwd_kset is not None and _native(bwd_kset, device) and supported_bwd(bwd_kset, K, V, dtype)):
        return 0
    return choose_bwd(**kw)


# ------------------------------------------------------------------------------------------------ plan

class CPPlan(NamedTuple):
    """Partitions of a flat varlen batch, on the device, in buffers sized from host information (`bounds`).

    Host ints: ``L`` (chunks per partition), ``P`` (partition slots), ``J`` (most partitions of one sequence:
    serial scan steps), ``N`` (sequences), ``regular`` (dense input: every sequence has J partitions, partition j
    of sequence n is slot ``n * J + j``). Device tensors: ``cu [P + 1]`` int32 partition boundaries (slots past
    the last partition are empty, at ``cu_seqlens[N]``), ``seq [P]`` int64 each slot's sequence (clamped to N - 1
    on unused slots), ``pos [P]`` int64 its index within the sequence (0 on unused slots), ``first [P]`` bool
    (starts its sequence, or unused), ``last_index [N]`` int64 each sequence's last partition, ``step_index [J, N]``
    int64 partition j of sequence n, or P where it has none (the scan's padding slot). ``warmup``: the pass's
    warm-up request (`parse_warmup`: ``"auto"``, ``"on"``, ``"off"`` or a threshold), settled per call from q's
    dtype and, under ``auto``, each pass's cost model (`cp_chunk_fwd`, `cp_chunk_bwd`). ``scan_cu`` (the plan
    kernel's; None: computed when needed): the scan kernel's ``[N + 1]`` int32 offsets (`_part_cu`).
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
    warmup: object = "auto"
    scan_cu: Optional[Tensor] = None

    @property
    def first_index(self) -> Tensor:
        """``[N]`` int64: each sequence's first partition (its initial state's and its dh0's slot)."""
        return torch.cat([self.last_index[:1] * 0, self.last_index[:-1] + 1])


def make_plan(cu_seqlens: Tensor, T: int, L: int, *, seq_len: Optional[int] = None, chunk_size: int = BT,
              warmup=None, kset=None) -> CPPlan:
    """Cut every sequence into partitions of L chunks (the last takes the remainder; an empty sequence gives one
    empty partition), as `reference.cp.partition` does, on cu_seqlens' device without host synchronisation: one
    launch of `kernels.cp_plan` where the CP passes run on the SM90 kernel set `kset` (a CUDA cu_seqlens), else
    torch ops. `T`: tokens of the flat input; `seq_len`: dense input (all sequences this long). `warmup`: the
    warm-up request of the pass the plan serves (`parse_warmup`; None: ``FLASHDELTA_CP_WARMUP``, default auto)."""
    warmup = parse_warmup(warmup)
    if L < 1:
        raise ValueError(f"L: partitions need >= 1 chunk, got {L}")
    if chunk_size != BT:
        raise ValueError(f"chunk_size: CP runs 64-token chunks, got {chunk_size}")
    dev = cu_seqlens.device
    N = cu_seqlens.shape[0] - 1
    W = L * BT
    P, J = bounds(T, N, L, seq_len)
    if N >= 1 and _sm90(cu_seqlens, kset):
        from .kernels import cp_plan  # noqa: PLC0415 - TileLang only where the kernel runs

        part_cu, seq, pos, first, last_index, step_index, scan_cu = cp_plan.plan_tensors(
            cu_seqlens.to(torch.int32), L, P, J)
        return CPPlan(L=int(L), P=P, J=J, N=N, regular=seq_len is not None, cu=part_cu, seq=seq, pos=pos,
                      first=first, last_index=last_index, step_index=step_index, warmup=warmup, scan_cu=scan_cu)
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
                  last_index=last_index, step_index=step_index, warmup=warmup)


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


def _kernel_scan(x: Tensor, kset) -> bool:
    """Whether the TileLang scan (`kernels.cp_scan`) runs a scan over `x` ``[P, HV, K, V]`` for a call whose
    chunk_fwd runs on `kset`: fp32, the SM90 kernel set, head dims it takes. Elsewhere (the portable path, CPU,
    float64) the torch scans run."""
    return x.dtype == torch.float32 and _sm90(x, kset) and _kernel_dims(x.shape[2], x.shape[3])


def _part_cu(plan: CPPlan) -> Tensor:
    """``[N + 1]`` int32: 0, then each sequence's last slot + 1 (the scan kernel's offsets; the plan kernel's own)."""
    if plan.scan_cu is not None:
        return plan.scan_cu
    return torch.cat([plan.last_index.new_zeros(1), plan.last_index + 1]).to(torch.int32)


def scan_states(M: Tensor, E: Tensor, plan: CPPlan, h0: Optional[Tensor], method: Optional[str] = None, *,
                heads: Optional[Tensor] = None) -> Tensor:
    """Every partition's start state (K-first), by `method` (``"kernel"`` / ``"serial"`` / ``"log"``; None: the
    cheaper torch scan by `scan_cost`; the CP passes pass ``"kernel"`` where `_kernel_scan` holds). The kernel
    zero-fills unused slots. `heads` (``[HV]`` bool, or None: all): the value heads whose states the caller reads;
    the kernel walks only those (the others' states are then undefined), the torch scans all."""
    if method is None:
        method = scan_cost(plan.P, plan.J, E.shape[1], E.shape[2], E.shape[3])[1]
    if method == "kernel":
        from .kernels import cp_scan  # noqa: PLC0415 - TileLang only where the kernel runs

        return cp_scan.scan_fwd(M.contiguous(), E, h0, _part_cu(plan), heads=heads)
    if method == "serial":
        return scan_serial(M, E, plan, h0)
    if method == "log":
        return scan_log(M, E, plan, h0)
    raise ValueError(f"method: {method!r}, expected 'kernel', 'serial' or 'log'")


# ------------------------------------------------------------------------------------------------ forward

class Windows(NamedTuple):
    """The forward's warm-up decision (`windows`), per partition slot and value head (``[P, HV]``, on the device):
    ``skip_e`` / ``skip_m`` int32, the E and M passes' `chunk_skip` (`SKIP_ALL`: no chunk); ``fallback`` bool, the
    heads on the exact path (``S_{p+1} = M_p S_p + E_p``; the M pass walks only these); ``suffix`` (None on the
    exact path) float64 ``[P, L, HV]``, the summed G_last of each partition's last j + 1 chunks (j = 0: the last
    chunk; read only on partitions that are not their sequence's last, which have L chunks). Host: ``threshold``
    (None: the exact path for every head). `n` and `log_decay` give the window lengths and the bound's exponents."""
    skip_e: Tensor
    skip_m: Tensor
    fallback: Tensor
    suffix: Optional[Tensor]
    threshold: Optional[float]

    def n(self, L: int) -> Tensor:
        """``[P, HV]`` int64: the chunks the E pass walks (the window; L on fallback heads; 0 where it walks none)."""
        return torch.where(self.skip_e < SKIP_ALL, L - self.skip_e.to(torch.int64), 0)

    def log_decay(self, L: int) -> Tensor:
        """``[P, HV]`` float64: the summed G_last of the chunks the E pass walks (0 where it walks none): a warm-up
        head's dropped part is <= exp(this) x the state entering its window (docs/algorithm.md §4.4)."""
        n = self.n(L)
        return torch.where(n > 0, self.suffix.gather(1, torch.clamp_min(n - 1, 0)[:, None]).squeeze(1), 0.0)


def _contracting(k: Tensor, beta: Tensor, toks: Tensor, P: int, keys_normalized: bool,
                 inside: Optional[Tensor] = None, k_norm2: Optional[Tensor] = None) -> Tensor:
    """``[P, HV]`` bool: whether every token of each partition (`toks`, ``[P x n]`` token indices, n per partition;
    `inside` ``[P x n, 1]``: which of them count, None: all) has ``0 <= beta ||k||^2 <= CONTRACTION_LIMIT`` (the norm
    bound's condition, docs/algorithm.md §4.2; NaN: no). `keys_normalized`: ``||k||^2 <= NORMALIZED_KEY_NORM2``
    taken for granted, beta alone is read; else the key norms: `k_norm2` (prepare's ``[1, T, H]``, K K^T's
    diagonal) where given, else one read of k."""
    HV = beta.shape[-1]
    b = beta[0].index_select(0, toks)                                                            # [P n, HV]
    limit = CONTRACTION_LIMIT
    if keys_normalized:
        limit = CONTRACTION_LIMIT / NORMALIZED_KEY_NORM2
    else:
        H = k.shape[2]
        if k_norm2 is not None:
            n2 = k_norm2[0].index_select(0, toks).to(torch.promote_types(k.dtype, torch.float32))   # [P n, H]
        else:
            nk = torch.linalg.vector_norm(k[0], dim=-1, dtype=torch.promote_types(k.dtype, torch.float32))  # [T, H]
            n2 = nk.index_select(0, toks).square()
        b = (b.view(-1, H, HV // H) * n2[..., None]).view(-1, HV)
    if inside is not None:
        b = torch.where(inside, b, b.new_zeros(()))
    lo, hi = torch.aminmax(b.view(P, -1, HV), dim=1)
    return (lo >= 0) & (hi <= limit)


def _kernel_windows(g_cumsum: Tensor, k: Tensor, beta: Tensor, kset) -> bool:
    """Whether the TileLang windows kernel (`kernels.cp_windows`) takes a warm-up decision (`windows`,
    `grad_windows`) for a call whose pass runs on `kset`: CUDA tensors on the SM90 kernel set, fp32 gates, the heads
    and dtypes it takes. Elsewhere (the portable path, CPU) the torch ops run."""
    if not (g_cumsum.dtype == torch.float32 and _sm90(g_cumsum, kset)):
        return False
    from .kernels import cp_windows  # noqa: PLC0415 - TileLang only where the kernel runs

    return cp_windows.unsupported(k.shape[2], beta.shape[-1], k.shape[-1], k.dtype, beta.dtype) is None


def _limit(beta: Tensor, keys_normalized: bool) -> float:
    """The contraction bound as `_contracting` compares it (a host float): with `keys_normalized` beta is compared
    in its own dtype, so the scalar rounds to it; else the products (fp32 or float64) against 2 exactly."""
    if keys_normalized:
        return float(torch.tensor(CONTRACTION_LIMIT / NORMALIZED_KEY_NORM2, dtype=beta.dtype))
    return CONTRACTION_LIMIT


def windows(g_cumsum: Tensor, k: Tensor, beta: Tensor, plan: CPPlan, threshold: Optional[float], *,
            keys_normalized: bool = False, kset=None, k_norm2: Optional[Tensor] = None) -> Windows:
    """Per partition (not its sequence's last) and value head, the shortest suffix of its chunks whose summed log
    decay (the chunks' G_last from `g_cumsum`, added from the last chunk back) is ``<= threshold``, where every
    token of the partition has ``0 <= beta ||k||^2 <= CONTRACTION_LIMIT`` (the bound's condition, docs/algorithm.md
    §4.2): the E pass walks only that suffix from zero and the head's M is 0, so the scan gives ``S_{p+1} =
    E_window``. A head without such a suffix falls back to the exact path (E and M over the whole partition). A
    sequence's last partition needs neither (the scan reads no summary of it): both passes skip all of it.
    `threshold` None: every head falls back (the exact path); neither the gates nor the keys are read.
    `keys_normalized`: the caller l2-normalised k (``||k||^2 <= NORMALIZED_KEY_NORM2`` in bf16), so only beta is
    read for the condition. `k_norm2` (keys not normalised): prepare's squared key norms ``[1, T, H]`` fp32
    (`prepare_fwd(norms=True)`), read in place of k.

    On the device, into buffers sized from host ints (``[P, L]`` chunks, ``[P, 64 L]`` tokens: partitions that are
    not their sequence's last have exactly L full chunks): no host synchronisation, so CUDA graphs capture it and
    replay it with new lengths. `kset`: the kernel set running chunk_fwd; on the SM90 set with CUDA tensors the
    warm-up path is one launch of `kernels.cp_windows` (`_kernel_windows`), elsewhere ~25 small torch kernels with
    `keys_normalized`, ~30 without (the key norms: one read of k).
    """
    dev = g_cumsum.device
    T, HV = g_cumsum.shape[1], g_cumsum.shape[2]
    P, L = plan.P, plan.L
    k_norm2 = None if keys_normalized else k_norm2         # normalised keys: beta alone is read
    if threshold is not None and T > 0 and _kernel_windows(g_cumsum, k, beta, kset):
        from .kernels import cp_windows  # noqa: PLC0415 - TileLang only where the kernel runs

        skip_e, skip_m, fallback, suffix = cp_windows.windows_tensors(g_cumsum, k, beta, plan.cu, plan.first, L,
                                                                      threshold, _limit(beta, keys_normalized),
                                                                      keys_normalized, k_norm2=k_norm2)
        return Windows(skip_e=skip_e, skip_m=skip_m, fallback=fallback, suffix=suffix, threshold=float(threshold))
    inner = ~plan.first.roll(-1)[:, None]                 # [P, 1]: slot p + 1 continues p's sequence (0 starts one)
    none = torch.full((P, HV), SKIP_ALL, dtype=torch.int32, device=dev)
    walk = torch.where(inner, 0, none)                    # the exact path: every chunk of inner partitions
    if threshold is None or T == 0:
        fb = inner.expand(P, HV)
        return Windows(skip_e=walk, skip_m=walk, fallback=fb, suffix=None, threshold=None)
    # the partition's tokens, last first: chunk L - 1 - j's last token at [p, 64 j]; one gather serves the gates
    # (G_last along j, summed by one cumsum: suffix sums) and the contraction condition (every token)
    toks = torch.clamp_max(plan.cu[:-1, None] + torch.arange(L * BT - 1, -1, -1, device=dev), T - 1).view(-1)
    G = g_cumsum[0].index_select(0, toks).view(P, L, BT, HV)[:, :, 0]
    suffix = torch.cumsum(G, 1, dtype=torch.float64)                                            # [P, L, HV]
    ok = suffix <= threshold
    any_ok, first = ok.to(torch.uint8).max(1)             # the first j that reaches (a window of j + 1 chunks)
    reach = (any_ok > 0) & _contracting(k, beta, toks, P, keys_normalized, k_norm2=k_norm2) & inner
    fallback = inner ^ reach
    skip_e = torch.where(reach, (L - 1 - first).to(torch.int32), walk)
    return Windows(skip_e=skip_e, skip_m=torch.where(fallback, 0, none), fallback=fallback, suffix=suffix,
                   threshold=float(threshold))


def summaries(q, k, v, g_cumsum, beta, A, plan: CPPlan, *, scale: float, chunk_fwd,
              windows: Optional[Windows] = None) -> tuple:
    """``(M [P, HV, K, K], E [P, HV, K, V])`` (K-first) of every partition, by one `chunk_fwd` launch over the
    partitions with `transitions` (zero values from the identity: M; v from zero: E; no o), so that the M and the E
    walks share one wave.

    With `windows` (`windows`): the E walks cover each head's window (its `chunk_skip`), the M walks only the
    fallback heads' partitions; the other heads' M is 0 (no chunk walked) and a sequence's last partition has
    E = M = 0, so `scan_states` gives the warm-up's start states. The states are the launcher's (fp32; float64
    for float64 inputs on the portable path)."""
    kw = dict(scale=scale, state_v_first=False, states_only=True, transitions=True)
    if windows is None:
        _, E, M = chunk_fwd(q, k, v, g_cumsum, beta, A, None, plan.cu, **kw)
    else:
        _, E, M = chunk_fwd(q, k, v, g_cumsum, beta, A, None, plan.cu, chunk_skip=windows.skip_e,
                            transition_skip=windows.skip_m, **kw)
    return M, E


def _transitions(q, k, zeros, g_cumsum, beta, A, plan: CPPlan, walk: Tensor, skip: Tensor, *, scale: float, chunk_fwd,
                 state_dtype) -> Tensor:
    """``M [P, HV, K, K]`` (K-first) of the (partition, head)s in `walk` (``[P, HV]`` bool), by one `chunk_fwd`
    launch with zero values from the identity whose CTAs start at chunk `skip` (``[P, HV]`` int32: 0 where `walk`,
    `SKIP_ALL` elsewhere, or later chunks); the others' M is 0 (a zero start, no chunk walked). `zeros`: the
    ``[1, T, HV, K]`` placeholder of the zero values (never read)."""
    K = k.shape[-1]
    # [P, HV, K, K]: I where walked, else 0, as a fill and a diagonal write (`eye * walk` broadcast one unvectorized
    # multiply over the whole tensor: 11-20 us on an H100 where the fill takes a few)
    start = torch.zeros((*walk.shape, K, K), dtype=state_dtype, device=k.device)
    start.diagonal(dim1=-2, dim2=-1).copy_(walk[:, :, None].expand(*walk.shape, K))
    return chunk_fwd(q, k, zeros, g_cumsum, beta, A, start, plan.cu, scale=scale, state_v_first=False,
                     chunk_skip=skip, zero_values=True, states_only=True)[1]


def _threshold(plan: CPPlan, q: Tensor, HV: int, K: int, V: int, *, backward: bool = False) -> Optional[float]:
    """The warm-up threshold of one call (None: the exact path): `warmup_threshold` of the plan's request at q's
    dtype; under ``auto`` only where the pass's model predicts the warm-up faster at the plan's L, for ``min(P, N J)
    - N`` partitions that are not their sequence's last (forward, `cp_model.warmup_pays`) or first (`backward`,
    `cp_model.warmup_pays_bwd`), host ints: exact for dense input and one sequence, the most the tokens allow for
    varlen."""
    thr = warmup_threshold(plan.warmup, q.dtype)
    if thr is None or plan.warmup != "auto":
        return thr
    sms = num_sms(q.device)
    P = min(plan.P, plan.N * plan.J)            # partitions: at most P slots, at most J per sequence
    if backward:
        pays = cp_model.warmup_pays_bwd(cont={plan.L: P - plan.N}, HV=HV, sms=sms)
    else:
        pays = cp_model.warmup_pays(inner=P - plan.N, HV=HV, K=K, V=V, L=plan.L, sms=sms)
    return thr if pays else None


def _overlaps(win: Windows, q: Tensor, kset) -> bool:
    """Whether the forward runs its output pass in two launches beside each other (`_output_overlapped`): with the
    warm-up (its heads' start states need no scan), on the SM90 kernel set (a side stream on the device)."""
    return win.threshold is not None and _sm90(q, kset)


def _output_overlapped(q, k, v, g_cumsum, beta, A, h0: Optional[Tensor], plan: CPPlan, win: Windows, *, scale: float,
                       chunk_fwd, scan: Optional[str], kset, save_states: bool = False) -> tuple:
    """The forward's summaries, scan and output pass with the warm-up heads off the scan's path: ``(o, final
    [N, HV, K, V])``, and with `save_states` the chunk states third (`cp_chunk_fwd`), the same values as the
    one-launch output pass over `scan_states`.

    A (partition, head) needs the scan only where the partition before walked the exact path (``win.fallback``);
    the others start from h0 (a sequence's first partition) or from the window of the partition before (its E from
    a zero start, the scan's ``M_p = 0`` step). So on the urgent side stream (`flashdelta.streams`, above the
    default priority) run the critical path: the M and E passes (`summaries`), the scan of the heads that need it,
    and the output pass of those (partition, head)s; and beside it on the current stream: the windows' E pass alone (the
    fallback heads skipped: a few chunks a CTA), their start states (one shift by a slot), and the output pass of the
    other (partition, head)s, into the same o (`chunk_fwd(out=...)`, complementary `chunk_skip`s) and, with
    `save_states`, the same chunk states (`states_out`). The final states are taken from the launch that walked each
    sequence's last partition."""
    HV = v.shape[2]
    exact = torch.cat([win.fallback.new_zeros(1, HV), win.fallback[:-1]]) & ~plan.first[:, None]   # [P, HV]
    scanned = exact.any(0)                              # [HV]: the heads the scan walks
    none = torch.full_like(win.skip_e, SKIP_ALL)
    zero = torch.zeros_like(win.skip_e)
    # the summaries walk E only for the scanned heads: the others' windows are the current stream's E pass
    win_scanned = win._replace(skip_e=torch.where(scanned, win.skip_e, none))
    from .kernels import _tl  # noqa: PLC0415 - no TileLang: the launchers' output allocation (NaN under the tests)

    o = _tl.alloc(v.shape, v.dtype, v.device)           # before the fork: both streams write it (and the states)
    kw = dict(scale=scale, state_v_first=False)
    out_kw = dict(out=o)
    if save_states:
        hs = _tl.alloc((q.shape[1] // BT + plan.N + 1, HV, v.shape[3], k.shape[3]), q.dtype, q.device)
        out_kw.update(save_states=True, state_seqs=(plan.seq, plan.N), states_out=hs)
    side = streams.fork(q.device, urgent=True)
    with streams.on(side):
        M, E = summaries(q, k, v, g_cumsum, beta, A, plan, scale=scale, chunk_fwd=chunk_fwd, windows=win_scanned)
        H = scan_states(M, E, plan, h0, scan or ("kernel" if _kernel_scan(E, kset) else None), heads=scanned)
        _, ht_exact, *_ = chunk_fwd(q, k, v, g_cumsum, beta, A, H, plan.cu,
                                    chunk_skip=torch.where(exact, zero, none), **out_kw, **kw)
    _, E_win = chunk_fwd(q, k, v, g_cumsum, beta, A, None, plan.cu, chunk_skip=torch.where(win.fallback, none,
                                                                                            win.skip_e),
                         states_only=True, **kw)
    start = E_win.roll(1, 0)                            # slot p starts from the window of slot p - 1
    del E_win
    h_first = h0.index_select(0, plan.seq) if h0 is not None else start.new_zeros(())
    torch.where(plan.first[:, None, None, None], h_first, start, out=start)
    _, ht_warm, *_ = chunk_fwd(q, k, v, g_cumsum, beta, A, start, plan.cu,
                               chunk_skip=torch.where(exact, none, zero), **out_kw, **kw)
    streams.join(side)
    last = plan.last_index
    final = torch.where(exact.index_select(0, last)[:, :, None, None], ht_exact.index_select(0, last),
                        ht_warm.index_select(0, last))
    return (o, final, hs) if save_states else (o, final)


def cp_chunk_fwd(q, k, v, g_cumsum, beta, A, initial_state, cu_seqlens, *, scale, state_v_first=False,
                 chunk_size=BT, plan: CPPlan, backends, scan: Optional[str] = None, keys_normalized: bool = False,
                 save_states: bool = False, k_norm2: Optional[Tensor] = None):
    """The `chunk_fwd` stage (docs/stages.md) through the partitions of `plan` (`make_plan` of the same
    cu_seqlens): ``(o [1, T, HV, V], final_state [N, HV, K, V] or [N, HV, V, K])``, exact, or with the gate-driven
    warm-up where `plan.warmup` asks for it at q's dtype (`warmup_threshold`; ``auto``: also where the cost model
    predicts it faster, `_threshold`): heads whose window reaches the threshold take their start state from it
    (error <= exp(threshold) x the state entering the window, docs/algorithm.md §4.4), the others the exact path.

    `backends`: the call's `dispatch.Plan`; every launch goes to its chunk_fwd launcher, which must run the value
    widths V and K (`supported`) and take `chunk_skip`. beta and the initial state as that launcher takes them.
    States are fp32 (float64 for float64 q). `scan`: ``"kernel"``, ``"serial"``, ``"log"`` or None (the scan kernel
    where `_kernel_scan` holds, else `scan_cost`'s choice). `keys_normalized`: k is l2-normalised (the API's
    ``use_qk_l2norm_in_kernel``), so the warm-up's condition reads beta only (`windows`); else `k_norm2`, prepare's
    squared key norms, where given, is read in place of k (`windows`). Launches: the windows (one
    `kernels.cp_windows` launch on the SM90 path with the warm-up, else small torch kernels), two `chunk_fwd` (M and E
    in one, `summaries`; the output pass), the scan (one `kernels.cp_scan` launch; the torch scans: J - 1 batched
    GEMMs for one dense sequence, about four small kernels per step for varlen), the final-state gather. With the
    warm-up on the SM90 path (`_overlaps`) the output pass runs in two launches beside the M pass and the scan
    (`_output_overlapped`: also the windows' E pass alone, the warm-up start states' shift and the final-state select).

    `save_states` (a native chunk_fwd only: `chunk_fwd(save_states=True)`): the output pass also writes the state
    entering every chunk over the whole sequences (`state_seqs`: the layout `state_recompute` over cu_seqlens gives),
    returned third, for the backward's chunk_bwd, split or not (`cp_chunk_bwd`'s `states`). They are the states the
    forward used: on the warm-up path within its bound of the exact ones.
    """
    if chunk_size != BT:
        raise ValueError(f"chunk_size: CP runs 64-token chunks, got {chunk_size}")
    del cu_seqlens                                                # the plan holds the partition boundaries
    launch = backends.fn("chunk_fwd")
    kset = backends.kset("chunk_fwd")
    win = windows(g_cumsum, k, beta, plan, _threshold(plan, q, v.shape[2], k.shape[-1], v.shape[-1]),
                  keys_normalized=keys_normalized, kset=kset, k_norm2=k_norm2)
    h0 = initial_state
    if h0 is not None:
        h0 = (h0.transpose(-1, -2) if state_v_first else h0).to(accum_dtype(q.dtype))
    if _overlaps(win, q, kset):
        o, final, *saved = _output_overlapped(q, k, v, g_cumsum, beta, A, h0, plan, win, scale=scale,
                                              chunk_fwd=launch, scan=scan, kset=kset, save_states=save_states)
        states = saved[0] if save_states else None
    else:
        M, E = summaries(q, k, v, g_cumsum, beta, A, plan, scale=scale, chunk_fwd=launch, windows=win)
        scan = scan or ("kernel" if _kernel_scan(E, kset) else None)
        H = scan_states(M, E, plan, h0, scan)
        if save_states:
            o, ht, states = launch(q, k, v, g_cumsum, beta, A, H, plan.cu, scale=scale, state_v_first=False,
                                   save_states=True, state_seqs=(plan.seq, plan.N))
        else:
            o, ht = launch(q, k, v, g_cumsum, beta, A, H, plan.cu, scale=scale, state_v_first=False)
        final = ht.index_select(0, plan.last_index)
    if state_v_first:
        final = final.transpose(-1, -2).contiguous()
    return (o, final, states) if save_states else (o, final)


# ------------------------------------------------------------------------------------------------ backward

class GradWindows(NamedTuple):
    """The backward's warm-up decision (`grad_windows`), per partition slot and value head (``[P, HV]``, on the
    device): ``take`` int32, chunk_dstate's `chunk_take` (a warm-up head: its window's chunks; a fallback head:
    `TAKE_ALL`; 0 on a sequence's first partition and on unused slots, whose F the reverse scan never reads);
    ``fallback`` bool, the heads on the exact path (the end gradient of the partition before is ``F + M^T dS_end``;
    the reverse scan reads M only there); ``prefix`` (None on the exact path) float64 ``[P, L, HV]``, the summed
    G_last of each partition's first j + 1 chunks (chunks past a ragged partition's end add 0). Host: ``threshold``
    (None: the exact path for every head). `n` and `log_decay` give the window lengths and the bound's exponents."""
    take: Tensor
    fallback: Tensor
    prefix: Optional[Tensor]
    threshold: Optional[float]

    def n(self, plan: CPPlan) -> Tensor:
        """``[P, HV]`` int64: the chunks chunk_dstate walks (the window; every chunk of the partition on fallback
        heads; 0 where it walks none)."""
        nch = torch.div(plan.cu[1:] - plan.cu[:-1] + (BT - 1), BT, rounding_mode="floor").to(torch.int64)
        return torch.minimum(self.take.to(torch.int64), nch[:, None])

    def log_decay(self, plan: CPPlan) -> Tensor:
        """``[P, HV]`` float64: the summed G_last of the chunks chunk_dstate walks (0 where it walks none): a warm-up
        head's dropped part is <= exp(this) x the gradient at its window's end (docs/algorithm.md §4.4)."""
        n = self.n(plan)
        return torch.where(n > 0, self.prefix.gather(1, torch.clamp_min(n - 1, 0)[:, None]).squeeze(1), 0.0)


def grad_windows(g_cumsum: Tensor, k: Tensor, beta: Tensor, plan: CPPlan, threshold: Optional[float], *,
                 keys_normalized: bool = False, kset=None, k_norm2: Optional[Tensor] = None) -> GradWindows:
    """The backward's mirror of `windows`: per partition that is not its sequence's first and value head, the
    shortest prefix of its chunks whose summed log decay (the chunks' G_last, added from the first chunk on) is
    ``<= threshold``, where every token of the partition has ``0 <= beta ||k||^2 <= CONTRACTION_LIMIT`` (the bound's
    condition, docs/algorithm.md §4.2): chunk_dstate walks only that prefix from a zero gradient (its F_w) and the
    head's M^T is zeroed for the reverse scan, so the end gradient of the partition before is F_w. A head without
    such a prefix falls back to the exact path (F over the whole partition, through M^T). A sequence's first
    partition needs neither (the reverse scan reads no F of it): chunk_dstate walks nothing of it. `threshold`
    None: every head falls back; neither the gates nor the keys are read. `keys_normalized` and `k_norm2` as in
    `windows`.

    The partition that is not its sequence's first may be its last, ragged one: chunk j's G_last is the gate at
    ``min(start + 64 j + 63, end - 1)`` and chunks past the end add nothing; tokens past the end are not checked. On
    the device, into buffers sized from host ints (``[P, L]`` chunks, ``[P, 64 L]`` tokens): no host
    synchronisation, so CUDA graphs capture it and replay it with new lengths. `kset`: the kernel set running
    chunk_dstate; on the SM90 set with CUDA tensors the warm-up path is one launch of `kernels.cp_windows`
    (`_kernel_windows`), elsewhere torch ops.
    """
    dev = g_cumsum.device
    T, HV = g_cumsum.shape[1], g_cumsum.shape[2]
    P, L = plan.P, plan.L
    k_norm2 = None if keys_normalized else k_norm2         # normalised keys: beta alone is read
    if threshold is not None and T > 0 and _kernel_windows(g_cumsum, k, beta, kset):
        from .kernels import cp_windows  # noqa: PLC0415 - TileLang only where the kernel runs

        take, fallback, prefix = cp_windows.windows_tensors(g_cumsum, k, beta, plan.cu, plan.first, L, threshold,
                                                            _limit(beta, keys_normalized), keys_normalized,
                                                            backward=True, k_norm2=k_norm2)
        return GradWindows(take=take, fallback=fallback, prefix=prefix, threshold=float(threshold))
    cont = ~plan.first[:, None]                           # [P, 1]: continues its sequence (neither first nor unused)
    every = torch.where(cont, TAKE_ALL, torch.zeros((P, HV), dtype=torch.int32, device=dev))
    if threshold is None or T == 0:
        return GradWindows(take=every, fallback=cont.expand(P, HV), prefix=None, threshold=None)
    bos, eos = plan.cu[:-1, None].to(torch.int64), plan.cu[1:, None].to(torch.int64)
    starts = bos + BT * torch.arange(L, device=dev)                                            # [P, L] chunk starts
    last = torch.clamp(torch.minimum(starts + (BT - 1), eos - 1), 0, T - 1)
    G = g_cumsum[0].index_select(0, last.view(-1)).view(P, L, HV)
    G = torch.where((starts < eos)[..., None], G, G.new_zeros(()))
    prefix = torch.cumsum(G, 1, dtype=torch.float64)                                            # [P, L, HV]
    ok = prefix <= threshold
    toks = bos + torch.arange(L * BT, device=dev)                                               # [P, 64 L]
    inside = (toks < eos).view(-1, 1)                     # tokens past the partition's end are not its own
    toks = torch.clamp_max(toks, T - 1).view(-1)
    any_ok, first = ok.to(torch.uint8).max(1)             # the first j that reaches (a window of j + 1 chunks)
    reach = (any_ok > 0) & _contracting(k, beta, toks, P, keys_normalized, inside, k_norm2) & cont
    take = torch.where(reach, (first + 1).to(torch.int32), every)
    return GradWindows(take=take, fallback=cont & ~reach, prefix=prefix, threshold=float(threshold))


def _reversed(plan: CPPlan) -> CPPlan:
    """The plan's slots in reverse order, as `scan_log` reads them (``seq``, ``pos``, ``first``): each sequence's
    partitions are still contiguous, last one first; unused slots (now in front) start sequences of their own."""
    slots = torch.arange(plan.P, device=plan.seq.device)
    used = slots <= plan.last_index[-1]
    pos = torch.where(used, plan.last_index[plan.seq] - slots, 0).flip(0)
    return plan._replace(seq=plan.seq.flip(0), pos=pos, first=pos == 0)


def _grads_serial(M: Tensor, F: Tensor, plan: CPPlan, dT: Tensor) -> Tensor:
    """`scan_grads` one step per partition index, last first (mirrors `scan_serial`; the padding slot P is the
    identity map with F = 0, so a sequence without a j-th partition keeps its dht until its last one)."""
    P, HV, K, V = F.shape
    N, J = plan.N, plan.J
    if plan.regular:
        Mr, Fr = M.view(N, J, HV, K, K), F.view(N, J, HV, K, V)
        D = torch.empty(N, J, HV, K, V, dtype=F.dtype, device=F.device)
        D[:, J - 1] = dT
        for j in range(J - 1, 0, -1):
            if N == 1:
                torch.baddbmm(Fr[0, j], Mr[0, j].transpose(-1, -2), D[0, j], out=D[0, j - 1])
            else:
                D[:, j - 1] = torch.matmul(Mr[:, j].transpose(-1, -2), D[:, j]) + Fr[:, j]
        return D.view(P, HV, K, V)
    eye = torch.eye(K, dtype=M.dtype, device=M.device).expand(1, HV, K, K)
    Mp = torch.cat([M, eye])
    Fp = torch.cat([F, F.new_zeros(1, HV, K, V)])
    D = torch.empty(P + 1, HV, K, V, dtype=F.dtype, device=F.device)
    S = dT
    for j in range(J - 1, -1, -1):
        idx = plan.step_index[j]
        D.index_copy_(0, idx, S)                                 # several sequences may write slot P: discarded
        if j > 0:
            S = torch.baddbmm(Fp.index_select(0, idx).view(N * HV, K, V),
                              Mp.index_select(0, idx).view(N * HV, K, K).transpose(-1, -2),
                              S.reshape(N * HV, K, V)).view(N, HV, K, V)
    return D[:P]


def scan_grads(M: Tensor, F: Tensor, plan: CPPlan, dht: Optional[Tensor], method: Optional[str] = None) -> Tensor:
    """Every partition's end gradient ``[P, HV, K, V]`` (K-first) from the transitions ``M [P, HV, K, K]``, the
    start gradients from a zero end gradient ``F [P, HV, K, V]`` and the sequences' final-state gradients ``dht
    [N, HV, K, V]`` (None: zeros): ``dS_end[p] = M_{p+1}^T dS_end[p+1] + F_{p+1}``, ``dS_end`` of a sequence's
    last partition = its dht (docs/algorithm.md §4.3, `reference.cp.scan_grads`). `method` as in `scan_states`:
    ``"serial"`` (J steps, last first) or ``"log"`` (`scan_log` over the reversed slots with ``(M^T, F)``)."""
    P, HV, K, V = F.shape
    if method is None:
        method = scan_cost(P, plan.J, HV, K, V)[1]
    if method == "kernel":
        from .kernels import cp_scan  # noqa: PLC0415 - TileLang only where the kernel runs

        return cp_scan.scan_bwd(M.contiguous(), F.contiguous(), dht, _part_cu(plan))     # dht None: no zeros filled
    dT = _h0(dht, plan.N, HV, K, V, F.dtype, F.device)
    if method == "serial":
        return _grads_serial(M, F, plan, dT)
    if method == "log":
        return scan_log(M.flip(0).transpose(-1, -2), F.flip(0), _reversed(plan), dT).flip(0)
    raise ValueError(f"method: {method!r}, expected 'kernel', 'serial' or 'log'")


def _as_param(x: Optional[Tensor], kset) -> Optional[Tensor]:
    """beta or a state as `kset`'s launchers take it (`KernelSet.param_dtype`)."""
    return None if x is None else x.to(kset.param_dtype(x.dtype)).contiguous()


def _start_grads(chunk_dstate, q, k, g_cumsum, beta, A, do, plan: CPPlan, *, scale: float,
                 take: Optional[Tensor] = None) -> Tensor:
    """``F [P, HV, K, V]`` (K-first): each partition's start gradient from a zero end gradient, by the
    `chunk_dstate` stage over the partitions (chunk_bwd's dh0 with dht = 0: only the dS chain, neither v nor the
    states); with `take` (`GradWindows.take`) each (partition, head) over its first ``take`` chunks only: the
    warm-up's window, the whole partition on the exact path, none (F = 0) on a sequence's first partition, whose F
    the reverse scan never reads. `chunk_bwd` over the partitions with a zero dht gives the exact F at the cost of a
    whole backward."""
    if take is None:
        return chunk_dstate(q, k, g_cumsum, beta, A, do, plan.cu, scale=scale)
    return chunk_dstate(q, k, g_cumsum, beta, A, do, plan.cu, scale=scale, chunk_take=take)


def _dqk_buffers(q: Tensor, HV: int, kset) -> Optional[tuple]:
    """Uninitialised dq and dk (``[1, T, H, K]`` in q's dtype, on the current stream) where the SM90 chunk_bwd adds each
    key head's two value heads into zeroed buffers (`kernels.chunk_bwd.group_add`: 67 MB at 16/32 and 8192 tokens),
    for the caller to zero beside other work and hand to chunk_bwd as ``dqk``; None elsewhere (the launcher allocates
    its own outputs)."""
    if not _sm90(q, kset):
        return None
    from .kernels import chunk_bwd  # noqa: PLC0415 - TileLang only where the kernel runs

    if not chunk_bwd.group_add(q.shape[2], HV):
        return None
    return tuple(torch.empty((1, *q.shape[1:]), dtype=q.dtype, device=q.device) for _ in range(2))


def cp_chunk_bwd(q, k, v, g_cumsum, beta, A, initial_state, do, dht, cu_seqlens, *, scale, state_v_first=False,
                 chunk_size=BT, plan: CPPlan, backends, scan: Optional[str] = None, keys_normalized: bool = False,
                 starts: Optional[Tensor] = None, states: Optional[Tensor] = None, k_norm2: Optional[Tensor] = None):
    """The `state_recompute` and `chunk_bwd` stages (docs/stages.md) through the partitions of `plan`
    (`make_plan` of the same cu_seqlens): what `chunk_bwd` returns for the whole sequences, ``(dq, dk
    [1, T, HV, K] per value head, dv [1, T, HV, V], dbeta, dG [1, T, HV], dh0 [N, HV, K, V] or [N, HV, V, K])``,
    exact, or with the gate-driven warm-up of the end gradients where `plan.warmup` asks for it at q's dtype
    (``auto``: also where `cp_model.warmup_pays_bwd` predicts it faster, `_threshold`): heads whose prefix window
    reaches the threshold take the end gradient of the partition before from it (error <= exp(threshold) x the
    gradient at the window's end, docs/algorithm.md §4.4), the others the exact path. The start states are exact.

    `backends`: the call's `dispatch.Plan` (chunk_fwd for the summary passes, chunk_dstate for F; state_recompute
    and chunk_bwd from one kernel set). beta, the initial state (``[N, HV, ..]`` per `state_v_first`, or None)
    and dht (the same, or None: zeros) as the API hands them on; each launcher gets them in the dtype it takes.
    `scan` as in `cp_chunk_fwd`, for both scans; `keys_normalized` and `k_norm2` as in `cp_chunk_fwd` (`grad_windows`).
    Steps:
    (M, E) by one chunk_fwd launch (`summaries`) and the scan give every partition's start state; state_recompute
    over the partitions from them; chunk_dstate gives F (`_start_grads`; none of a sequence's first partition, whose
    F the reverse scan never reads; with the warm-up over each head's window, `grad_windows`, whose heads' M is then
    zeroed); the reverse scan (`scan_grads`) gives every partition's end gradient; chunk_bwd from those gives the
    gradients (partitions are chunk-aligned, so each chunk sees exactly its serial dS and S) and, on each sequence's
    first partition, its dh0. chunk_dstate needs neither M nor the start states: on a CUDA device it runs on the side
    stream (`streams.fork`) beside the M pass (and the E pass, scan and recompute), joined before the reverse scan,
    and so does the zero fill of dq and dk where the SM90 chunk_bwd adds into them (`_dqk_buffers`).
    No host synchronisation.

    `starts` (``[P, HV, K, V]``, the start state of every partition of `plan`, K-first: the training forward's
    `chunk_fwd(partition_starts=...)` output where the forward ran unsplit) replaces the E pass and the forward scan;
    the M pass then walks only the partitions and heads whose M the reverse scan reads (the fallback heads of
    partitions that are not their sequence's first, `GradWindows.fallback`). `states` (stage ``h`` of the chunk_bwd
    kernel set over the whole sequences: the training forward's `chunk_fwd(save_states=True)` output where it ran
    unsplit, K-first) replaces the start states and the state_recompute over the partitions as well: chunk_bwd reads
    every chunk's state from it (`h_seqs`, docs/stages.md), and the M pass is the one `starts` runs.
    """
    if chunk_size != BT:
        raise ValueError(f"chunk_size: CP runs 64-token chunks, got {chunk_size}")
    del cu_seqlens                                                # the plan holds the partition boundaries
    fks, bks = backends.kset("chunk_fwd"), backends.kset("chunk_bwd")
    sd = fks.param_dtype(accum_dtype(q.dtype))
    tr = (lambda x: x.transpose(-1, -2)) if state_v_first else (lambda x: x)  # noqa: E731
    dks = backends.kset("chunk_dstate")
    thr = _threshold(plan, q, v.shape[2], k.shape[-1], v.shape[-1], backward=True)
    if starts is not None and states is None and tuple(starts.shape) != (plan.P, v.shape[2], k.shape[-1], v.shape[-1]):
        raise ValueError(f"starts: [P, HV, K, V] = {[plan.P, v.shape[2], k.shape[-1], v.shape[-1]]} for this plan, "
                         f"got {list(starts.shape)}")
    win = grad_windows(g_cumsum, k, beta, plan, thr, keys_normalized=keys_normalized, kset=dks, k_norm2=k_norm2)
    # F depends on neither the start states nor M: chunk_dstate runs on the side stream beside the M pass (and the
    # E pass, scan and recompute without saved states), each filling the SMs the other leaves idle; the zero fill of
    # chunk_bwd's dq and dk goes there too (bandwidth beside compute-bound passes, off the chain). They are allocated
    # on the current stream, before the fork: their blocks stay in its pool, and the fill waits for its earlier work
    dqk = _dqk_buffers(q, v.shape[2], bks)
    side = streams.fork(q.device)
    try:
        with streams.on(side):
            Fp = _start_grads(dks.chunk_dstate, q, k, g_cumsum, _as_param(beta, dks), A, do, plan, scale=scale,
                              take=win.take)
            for t in dqk or ():
                t.zero_()
        if starts is None and states is None:
            M, E = summaries(q, k, v, g_cumsum, _as_param(beta, fks), A, plan, scale=scale,
                             chunk_fwd=fks.chunk_fwd)
            h0 = None if initial_state is None else tr(initial_state).to(E.dtype)
            scan = scan or ("kernel" if _kernel_scan(E, fks) else None)
            H = scan_states(M, E, plan, h0, scan)
            del E
            if thr is not None:     # a warm-up head's end gradient of the partition before is its window's F alone
                M.masked_fill_(~win.fallback[:, :, None, None], 0)
        else:
            H = starts
            skip = torch.where(win.fallback, 0, SKIP_ALL).to(torch.int32)
            # the M pass's values ([T, HV, K], never read) live only through its launch: a name would keep them
            # alive under chunk_bwd, the backward's peak (+64 MB at 16/32 and 8192 tokens)
            M = _transitions(q, k, v.new_empty(1, v.shape[1], v.shape[2], k.shape[-1]), g_cumsum,
                             _as_param(beta, fks), A, plan, win.fallback, skip, scale=scale, chunk_fwd=fks.chunk_fwd,
                             state_dtype=sd)
            scan = scan or ("kernel" if _kernel_scan(M, fks) else None)
        b = _as_param(beta, bks)
        if states is None:
            h = bks.state_recompute(k, v, g_cumsum, b, A, _as_param(H, bks), plan.cu, state_v_first=False)
            h_seqs = None
        else:
            h, h_seqs = states, plan.seq
    finally:     # also on an error: nothing the side stream reads may be freed under it
        streams.join(side)
    dT = None if dht is None else tr(dht).to(M.dtype)
    dS = scan_grads(M, Fp.to(M.dtype), plan, dT, scan)
    del M, H, Fp                                                  # only dS goes on: less memory under chunk_bwd
    extra = {} if dqk is None else {"dqk": dqk}
    dq, dk, dv, dbeta, dG, dh0p = bks.chunk_bwd(q, k, v, g_cumsum, b, A, h, do, dS, plan.cu, scale=scale,
                                                state_v_first=False, h_seqs=h_seqs, **extra)
    dh0 = dh0p.index_select(0, plan.first_index)
    if state_v_first:
        dh0 = dh0.transpose(-1, -2).contiguous()
    return dq, dk, dv, dbeta, dG, dh0


def builds(H: int, HV: int, K: int, V: int, dtype: torch.dtype, beta_dtype: torch.dtype, scale: float, *,
           backward: bool = False, forward: bool = True) -> list:
    """(label, builder, args) of the SM90 builds CP launches, each once: the forward's M and E passes (the fused
    forward at value width V without an initial state, with `chunk_skip` and `transitions`: one launch) and its
    output pass (width V with an fp32 initial state, the serial pass's build at K = V), all K-first; with
    `backward`, also the backward's summary passes (the same without `chunk_skip`), the M pass alone over the
    fallback heads where the forward saved the partition starts (width K from the identity, zero values, with
    `chunk_skip`), the training forward's output pass that saves the chunk states (`save_states`, `state_seqs`),
    chunk_bwd (with dht) on the forward's saved chunk states (`h_seqs`) and, for
    `FLASHDELTA_SAVE_STATES=0`, state_recompute (fp32 start states) and chunk_bwd on its states, K-first, and
    chunk_dstate with and without `chunk_take` (the exact F and the warm-up's windows), where chunk_bwd supports
    (K, V). A V-first
    caller's serial path uses its own V-first builds, CP these. The scan kernel's builds (`kernels.cp_scan`: with
    and without h0 / dht, both V tiles) where it takes (K, V). The plan kernel (`kernels.cp_plan`, one build for
    every plan), the forward warm-up's windows kernel (`kernels.cp_windows`, with and without keys_normalized; with
    `backward`, also the backward's) where it takes the heads and dtypes, and the work order of the `chunk_skip`
    passes (`kernels.item_order`, ascending) and of chunk_dstate's `chunk_take` (descending). `forward` False (a
    backward that splits beside a forward that does not): without the builds only the split forward launches (its
    warm-up windows and their M and E passes, the overlapped output pass, the ascending work order)."""
    from .kernels import (chunk_bwd, chunk_dstate, cp_plan, cp_scan,  # noqa: PLC0415 - TileLang only where listed
                          cp_windows, fused_fwd, item_order)

    fwd = functools.partial(fused_fwd.launcher_builds, H, HV, K)
    directions = (False,) * forward + (True,) * backward
    todo = cp_plan.launcher_builds()
    todo += cp_windows.launcher_builds(H, HV, K, dtype, beta_dtype, backward=directions)
    if forward:
        todo += fwd(V, dtype, beta_dtype, torch.float32, scale, initial_state=(False,), chunk_skip=(True,),
                    transitions=True)
    todo += fwd(V, dtype, beta_dtype, torch.float32, scale, initial_state=(True,))
    if forward:
        # the warm-up's output pass in two launches (`_output_overlapped`): the windows' E pass alone, the output
        # passes over complementary skips (the training forward's: saving the chunk states, below)
        todo += fwd(V, dtype, beta_dtype, torch.float32, scale, initial_state=(False,), chunk_skip=(True,),
                    states_only=True)
        todo += fwd(V, dtype, beta_dtype, torch.float32, scale, initial_state=(True,), chunk_skip=(True,))
        todo += item_order.launcher_builds(descending=(False,))
    if backward:
        todo += fwd(V, dtype, beta_dtype, torch.float32, scale, initial_state=(False,), transitions=True)
        todo += fwd(K, dtype, beta_dtype, torch.float32, scale, initial_state=(True,), chunk_skip=(True,),
                    zero_values=True, states_only=True)
    if backward and (K, V) in chunk_bwd.HEAD_DIMS:
        # the training forward's output pass saving the chunk states over the whole sequences (`state_seqs`)
        todo += fwd(V, dtype, beta_dtype, torch.float32, scale, initial_state=(True,),
                    chunk_skip=(False, True) if forward else (False,), save_states=True, state_seqs=True)
        todo += fused_fwd.state_recompute_builds(H, HV, K, V, dtype, beta_dtype, torch.float32, initial_state=(True,))
        todo += chunk_bwd.launcher_builds(H, HV, K, V, dtype, beta_dtype, scale, dht=(True,), h_seqs=(True, False))
        todo += chunk_dstate.launcher_builds(H, HV, K, V, dtype, beta_dtype, scale, chunk_take=(False, True))
        todo += item_order.launcher_builds(descending=(True,))
    if cp_scan.unsupported(K, V) is None:           # the scans (every V tile: the tile depends on N)
        todo += cp_scan.launcher_builds(HV, K, V, backward=backward and (K, V) in chunk_bwd.HEAD_DIMS,
                                        heads=(False, True))
    out = {}
    for label, b, args in todo:
        out.setdefault((b.__name__, args), (f"cp {label}", b, args))
    return list(out.values())
