"""Context parallelism's scan over partitions (Hopper, TileLang): every partition's start state in the forward, every
partition's end gradient in the backward (docs/algorithm.md §4.3, docs/dev/cp.md).

Per sequence n, its partitions are the consecutive slots ``part_cu[n] .. part_cu[n + 1] - 1`` (`part_offsets` derives
``part_cu [N + 1]`` from a `flashdelta.cp.CPPlan` on the device). The forward (`scan_fwd`) walks them first to last::

    H[first] = h0[n] (0 without h0),   H[p + 1] = M_p H[p] + E_p,   final[n] = M_last H[last] + E_last

and the backward (`scan_bwd`) last to first with the transposed transitions (`reference.cp.scan_grads`)::

    D[last] = dht[n] (0 without dht),  D[p - 1] = M_p^T D[p] + F_p,   dh0[n] = M_first^T D[first] + F_first

All states are K-first ``[.., K, V]`` fp32; ``M [P, HV, K, K]`` acts on the K index (``S -> M S``). The products are
plain fp32 FMAs, not tensor cores: the contract is an fp32 scan (`flashdelta.cp.scan_serial` in fp32 is the portable
twin), and tf32 operands (10-bit mantissa) would put a ~1e-3 relative error into every start state, compounding over
the partitions, where the bf16 forward's own error budget is spent elsewhere; at these sizes the FMAs cost ~1 us per
step, so nothing is gained by rounding. The build uses the project's fast-math pass config, so the FMAs are
``fma.rn.ftz``: fp32 denormals (below 1.2e-38) flush to zero, far below any state value that matters.

One CTA (`threads`: 128, one warp per SM sub-partition; 256 at BV = 8) per (sequence, value head, V tile of `BV`
columns), walking the sequence's partitions serially. The state tile ``S [K, BV]`` lives in shared memory (two
buffers: step j reads one and writes the other, so one CTA barrier per step suffices); thread t owns TM output rows
of row group ``t // CG`` (RG = THREADS / CG groups) and the 4 columns ``4 (t % CG) ..`` (CG = BV / 4 column
groups), TM x 4 accumulators in registers. M_p (64 KB at K = 128, read by the V / BV tiles of one head:
L2-resident) and the bias tile (E_p or F_p, ``[K, BV]``) are streamed by cp.async into a second shared buffer one
step ahead, so step p's loads run under step p - 1's FMAs. The shared rows are padded by 4 floats (a row of M is 528
bytes: consecutive rows start 4 banks apart), so a warp's 16-byte reads of 8 consecutive rows hit 8 distinct bank
quads. The forward reads rows of M, so its row groups interleave (group g owns rows ``g, g + RG, ..``: a warp reads
8 consecutive rows); groups of TM consecutive rows would put a warp's 8 rows TM apart, 4- or 8-way conflicts at
TM = 4 or 8. The backward reads columns of M (16 bytes: 4 consecutive output rows of one M row), so its groups hold
TM consecutive rows.

Cost per step (K = 128, BV = 16, TM = 4): 2048 FMAs and 256 16-byte shared loads per thread, ~2.4 k issue slots on
one warp per sub-partition, ~1.2 us at 1.98 GHz, plus ~0.2 us of barrier and cp.async wait; the M load is 64 KB per
CTA per step (32 cp.async of 16 bytes per thread), 4 MB per step through L2 at 64 CTAs, under the FMAs. BV = 32
halves the CTAs and doubles the per-step FMAs (~2.3 us). `choose_bv` takes 8 at K = 128 where the grid of 8-column
tiles fits one wave (256 threads, TM = 1: each SM's FMAs a step halve and a second warp per sub-partition covers the
shared loads), else 16 where the 16-column tiles do, else 32. Measured on the H200 (docs/dev/cp.md, "Scan kernel"):
a step takes ~3.3-3.5 us at BV = 16 (2/8) and ~5.5 at BV = 32 (8/32); BV = 8 at 256 threads took 2/8's forward scan
from 107 to 82 us at 32 partitions (the backward's 93 -> 87), while 256 threads at BV = 16 were 10-14% slower than
128 (each warp then re-reads the state block for half the rows). Without `store_final` the last partition's product
is skipped (the caller's output pass gives the final state), so a sequence of J partitions runs J - 1 steps.

Predictions (H200, CUDA graph, K = V = 128): 2/8 1x32768, L = 64 (J = 8): 64 CTAs of 7 steps, ~7 x 1.4 + 2 (first M
load) + ~3 (launch) = ~15 us against ~190 us of torch scan; 2/8 8192x4, L = 64 (J = 2): 128 CTAs (BV = 32) of one
step, ~2.3 + 2 + 3 = ~7 us.

The extra sequence index N zero-fills the unused slots ``part_cu[N] .. P - 1`` of H (the plan's empty partitions at
the end), so no slot of H is left undefined; no kernel reads M or the bias of an unused slot. ``part_cu`` is clamped
to ``[0, P]`` on the device, so malformed offsets cannot make the kernel read or write out of bounds. Slot offsets are
int64, so tensors past 2^31 elements work.
"""
# No `from __future__ import annotations`: TileLang evaluates the prim_func annotations in this scope.
from typing import Optional

import tilelang.language as T
import torch

from . import _tl

F32 = "float32"
SUPPORTED_K = (64, 128)
BV_OPTIONS = (8, 16, 32)   # value columns per CTA (8: K = 128 only)
MAX_V = 1024            # V is split into V / BV CTAs: any multiple of BV up to this
UNROLL = 4              # unroll factor of the k loop (4 k values per iteration)
PAD = 4                 # floats of padding per shared row (16 bytes: no bank conflicts on the 16-byte accesses)


def threads(BV: int) -> int:
    """Threads per CTA: 128 (one warp per SM sub-partition), 256 at BV = 8 (one output row of 4 columns a thread)."""
    return 256 if BV == 8 else 128


def unsupported(K: int, V: int, BV: int = 16) -> Optional[str]:
    """Why the kernel cannot run these head dims (None: it can)."""
    if K not in SUPPORTED_K:
        return f"K={K} (the scan kernel runs K in {SUPPORTED_K})"
    if BV not in BV_OPTIONS or (BV == 8 and K != 128):
        return f"BV={BV} (the scan kernel's V tiles are {BV_OPTIONS}, 8 at K = 128 only)"
    if V % BV or V > MAX_V:
        return f"V={V} (the scan kernel runs multiples of {BV} up to {MAX_V})"
    return None


# Every barrier is written out (one per step); TileLang's automatic ones would add a second per step between the
# prefetch into one shared buffer and the reads of the other.
PASS_CONFIGS = {**_tl.PASS_CONFIGS, "tl.disable_thread_storage_sync": True}


@_tl.jit(pass_configs=PASS_CONFIGS)
def build(HV: int, K: int, V: int, BV: int, reverse: bool, has_init: bool, store_final: bool):
    """The kernel for one compile-time configuration; P (partition slots) and N (sequences) are dynamic.

    reverse: the backward walk (last slot first, ``M^T``); has_init: read the start value (h0 / dht; else 0);
    store_final: also run the first / last partition's product and write it (final state / dh0)."""
    # problem config
    assert unsupported(K, V, BV) is None, unsupported(K, V, BV)
    NV = V // BV
    P_ = T.dynamic("P")
    N_ = T.dynamic("N")
    # tiling config
    THREADS = threads(BV)
    CG = BV // 4                     # column groups of 4
    RG = THREADS // CG               # row groups
    TM = K // RG                     # rows per thread
    VW = min(4, TM)                  # vector width of the backward's M reads (along the output rows)
    assert TM * RG == K and TM >= 1

    def slot(p0, p1, j):
        # the j-th slot walked (int64): first to last, or last to first
        return T.cast(p1 - 1 - j if reverse else p0 + j, "int64")

    def mi(kk, r):
        # mv's index of (k offset kk, row r): the forward reads rows of M (4 k per row), the backward columns
        return kk * TM + r if reverse else r * 4 + kk

    def row(rg, r):
        # the r-th output row of row group rg: the forward interleaves the groups (a warp's 8 groups read 8
        # consecutive rows of M, whose padded rows fall in 8 distinct bank quads); the backward reads M^T along the
        # rows, 4 consecutive rows of one M row per 16-byte read, so its groups hold TM consecutive rows
        return rg * TM + r if reverse else rg + RG * r

    def opt(shape, on):
        return T.Tensor(shape, F32) if on else None

    @T.macro
    def prefetch(M, X, M_s, X_s, slot64, i_hv, v0, buf):
        # M_p and the bias tile of slot p into shared buffer `buf` (cp.async; waited for at the next barrier)
        T.async_copy(M[slot64, i_hv, 0:K, 0:K], M_s[buf, 0:K, 0:K])
        T.async_copy(X[slot64, i_hv, 0:K, v0:v0 + BV], X_s[buf, 0:K, 0:BV])

    @T.prim_func
    def cp_scan_kernel(
        M: T.Tensor((P_, HV, K, K), F32),
        X: T.Tensor((P_, HV, K, V), F32),
        init: opt((N_, HV, K, V), has_init),
        part_cu: T.Tensor((N_ + 1,), "int32"),
        H: T.Tensor((P_, HV, K, V), F32),
        final: opt((N_, HV, K, V), store_final),
    ):
        with T.Kernel((N_ + 1) * HV * NV, threads=THREADS) as bx:
            tx = T.get_thread_binding()
            i_n = bx // (HV * NV)
            i_hv = (bx // NV) % HV
            v0 = (bx % NV) * BV
            rg = tx // CG                    # this thread's row group
            c0 = (tx % CG) * 4               # first column (within the tile)
            M_s = T.alloc_shared((2, K, K + PAD), F32)
            X_s = T.alloc_shared((2, K, BV + PAD), F32)
            S_s = T.alloc_shared((2, K, BV + PAD), F32)
            acc = T.alloc_local((TM * 4,), F32)
            mv = T.alloc_local((TM * 4,), F32)
            sv = T.alloc_local((16,), F32)
            rng = T.alloc_local((2,), "int32")
            rng[0] = T.min(T.max(part_cu[T.min(i_n, N_)], 0), P_)
            rng[1] = T.min(T.max(part_cu[T.min(i_n + 1, N_)], rng[0]), P_)
            p0, p1 = rng[0], rng[1]
            n64 = T.cast(i_n, "int64")

            if i_n < N_:
                cnt = p1 - p0
                nmul = T.if_then_else(cnt > 0, cnt if store_final else cnt - 1, 0)

                # ---- the start value: registers, shared buffer 0, H of the first slot walked ----
                for r in T.unroll(TM):
                    for t in T.vectorized(4):
                        if has_init:
                            acc[r * 4 + t] = init[n64, i_hv, row(rg, r), v0 + c0 + t]
                        else:
                            acc[r * 4 + t] = 0.0
                for r in T.unroll(TM):
                    for t in T.vectorized(4):
                        S_s[0, row(rg, r), c0 + t] = acc[r * 4 + t]
                if cnt > 0:
                    for r in T.unroll(TM):
                        for t in T.vectorized(4):
                            H[slot(p0, p1, 0), i_hv, row(rg, r), v0 + c0 + t] = acc[r * 4 + t]
                if nmul > 0:
                    prefetch(M, X, M_s, X_s, slot(p0, p1, 0), i_hv, v0, 0)
                for j in T.serial(nmul):
                    b = j % 2
                    T.ptx_wait_group(0)
                    T.sync_threads()             # step j's loads and the state written at step j - 1 are visible
                    if j + 1 < nmul:
                        prefetch(M, X, M_s, X_s, slot(p0, p1, j + 1), i_hv, v0, 1 - b)
                    for r in T.unroll(TM):
                        for t in T.vectorized(4):
                            acc[r * 4 + t] = X_s[b, row(rg, r), c0 + t]
                    for kb in T.unroll(K // 4, annotations={"pragma_unroll_factor": UNROLL}):
                        # 4 k values: the thread's TM x 4 block of M (or M^T) and the state's 4 x 4 block
                        if reverse:
                            for kk in T.unroll(4):
                                for r4 in T.unroll(TM // VW):
                                    for t in T.vectorized(VW):
                                        mv[mi(kk, r4 * VW + t)] = M_s[b, kb * 4 + kk, row(rg, r4 * VW + t)]
                        else:
                            for r in T.unroll(TM):
                                for t in T.vectorized(4):
                                    mv[mi(t, r)] = M_s[b, row(rg, r), kb * 4 + t]
                        for kk in T.unroll(4):
                            for t in T.vectorized(4):
                                sv[kk * 4 + t] = S_s[b, kb * 4 + kk, c0 + t]
                        for kk in T.unroll(4):
                            for r in T.unroll(TM):
                                for t in T.unroll(4):
                                    acc[r * 4 + t] = acc[r * 4 + t] + mv[mi(kk, r)] * sv[kk * 4 + t]
                    for r in T.unroll(TM):
                        for t in T.vectorized(4):
                            S_s[1 - b, row(rg, r), c0 + t] = acc[r * 4 + t]
                    if j + 1 < cnt:
                        for r in T.unroll(TM):
                            for t in T.vectorized(4):
                                H[slot(p0, p1, j + 1), i_hv, row(rg, r), v0 + c0 + t] = acc[r * 4 + t]
                if store_final:
                    for r in T.unroll(TM):
                        for t in T.vectorized(4):
                            final[n64, i_hv, row(rg, r), v0 + c0 + t] = acc[r * 4 + t]
            else:
                # ---- the padding row: zeros in every unused slot ----
                for p in T.serial(P_ - p1):
                    for r in T.unroll(TM):
                        for t in T.vectorized(4):
                            H[T.cast(p1 + p, "int64"), i_hv, row(rg, r), v0 + c0 + t] = 0.0

    return cp_scan_kernel


def choose_bv(N: int, HV: int, V: int, num_sms: int = _tl.DEFAULT_NUM_SMS, K: int = 128) -> int:
    """The V tile: at K = 128, 8 columns where the N x HV x V / 8 CTAs of the walk fit one wave (one CTA per SM: ~176
    KB of shared memory); else 16 where the N x HV x V / 16 CTAs do, else 32 (half the CTAs; each step ~2x longer);
    16 where V is not a multiple of 32."""
    if K == 128 and N * HV * (V // 8) <= num_sms:
        return 8
    if V % 32 or N * HV * (V // 16) <= num_sms:
        return 16
    return 32


def builder_args(HV: int, K: int, V: int, BV: int, *, reverse: bool, has_init: bool, store_final: bool) -> tuple:
    """The `build` arguments (its compile-cache key) for one call."""
    return (int(HV), int(K), int(V), int(BV), bool(reverse), bool(has_init), bool(store_final))


def launcher_builds(HV: int, K: int, V: int, *, N: Optional[int] = None, num_sms: int = _tl.DEFAULT_NUM_SMS,
                    backward: bool = False, init=(False, True), store_final=(False,)) -> list:
    """(label, builder, args) of the scan kernels CP launches for HV value heads and head dims (K, V): the forward
    scan (`scan_fwd`), with `backward` also the reverse one (`scan_bwd`), with and without the start value (h0 /
    dht) per `init`, at the V tile `choose_bv` picks for N sequences (every tile it can pick where N is None)."""
    if N is None:
        tiles = [bv for bv in BV_OPTIONS if unsupported(K, V, bv) is None]
    else:
        tiles = [choose_bv(N, HV, V, num_sms, K)]
    out = []
    for reverse in ((False, True) if backward else (False,)):
        for has_init in init:
            for store in store_final:
                for BV in tiles:
                    label = (f"cp_scan {'bwd' if reverse else 'fwd'} HV={HV} K={K} V={V} BV={BV} init={has_init} "
                             f"final={store}")
                    out.append((label, build, builder_args(HV, K, V, BV, reverse=reverse, has_init=has_init,
                                                           store_final=store)))
    return out


def part_offsets(last_index: torch.Tensor) -> torch.Tensor:
    """``part_cu [N + 1]`` int32 from a `flashdelta.cp.CPPlan`'s ``last_index [N]`` (each sequence's last slot): 0,
    then ``last_index + 1``; sequence n's partitions are slots ``part_cu[n] .. part_cu[n + 1] - 1``. On the device,
    no host synchronisation (two small kernels)."""
    return torch.cat([last_index.new_zeros(1), last_index + 1]).to(torch.int32)


def _check(M: torch.Tensor, X: torch.Tensor, init: Optional[torch.Tensor], part_cu: torch.Tensor, names: tuple,
           bv: Optional[int]):
    m, x, i = names
    for name, t in ((m, M), (x, X), (i, init)):
        if t is not None and t.dtype != torch.float32:
            raise TypeError(f"{name}: the scan kernel takes fp32 (the caller converts), got {t.dtype}")
    if X.dim() != 4:
        raise ValueError(f"{x}: expected [P, HV, K, V], got shape {tuple(X.shape)}")
    P, HV, K, V = X.shape
    if tuple(M.shape) != (P, HV, K, K):
        raise ValueError(f"{m}: expected [P, HV, K, K] = {[P, HV, K, K]} to match {x}, got {tuple(M.shape)}")
    if part_cu.dim() != 1 or part_cu.shape[0] < 2 or part_cu.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"part_cu: expected [N + 1] (N >= 1) int32 or int64, got {tuple(part_cu.shape)} "
                         f"{part_cu.dtype}")
    N = part_cu.shape[0] - 1
    if init is not None and tuple(init.shape) != (N, HV, K, V):
        raise ValueError(f"{i}: expected [N, HV, K, V] = {[N, HV, K, V]}, got {tuple(init.shape)}")
    devs = {t.device for t in (M, X, init, part_cu) if t is not None}
    if len(devs) != 1:
        raise ValueError(f"{m}, {x}, {i} and part_cu must be on one device, got {sorted(map(str, devs))}")
    BV = bv if bv is not None else choose_bv(N, HV, V, _tl.num_sms(X.device) if X.is_cuda else _tl.DEFAULT_NUM_SMS,
                                             K)
    why = unsupported(K, V, BV)
    if why is not None:
        raise ValueError(f"{x}: {why}")
    return P, N, HV, K, V, BV


def _scan(M, X, init, part_cu, *, reverse: bool, final: bool, names: tuple, bv: Optional[int]):
    P, N, HV, K, V, BV = _check(M, X, init, part_cu, names, bv)
    out = _tl.alloc((P, HV, K, V), torch.float32, X.device)
    last = _tl.alloc((N, HV, K, V), torch.float32, X.device) if final else None
    if P == 0:
        return (out, last.zero_() if init is None else last.copy_(init)) if final else out
    args = builder_args(HV, K, V, BV, reverse=reverse, has_init=init is not None, store_final=final)
    init = init.contiguous() if init is not None else None
    tensors = [M.contiguous(), X.contiguous(), init, part_cu.to(torch.int32).contiguous(), out, last]
    build(*args)(*[t for t in tensors if t is not None])
    return (out, last) if final else out


def scan_fwd(M: torch.Tensor, E: torch.Tensor, h0: Optional[torch.Tensor], part_cu: torch.Tensor, *,
             final: bool = False, bv: Optional[int] = None):
    """Every partition's start state, in one launch (`flashdelta.cp.scan_serial`'s result).

    Args:
        M: ``[P, HV, K, K]`` fp32, each slot's transition (``S -> M S``); E: ``[P, HV, K, V]`` fp32, each slot's end
            state from a zero start. K in (64, 128); V a multiple of the V tile (8, 16 or 32, `choose_bv`) up to 1024.
        h0: ``[N, HV, K, V]`` fp32, the sequences' initial states, or None (zeros).
        part_cu: ``[N + 1]`` int32 (int64 is converted on the device): sequence n's partitions are the slots
            ``part_cu[n] .. part_cu[n + 1] - 1`` (`part_offsets`); slots past ``part_cu[N]`` are unused.
        final: also return each sequence's final state ``M_last H[last] + E_last`` (one more step per sequence).
        bv: the V tile (8 at K = 128, 16 or 32); None: `choose_bv`'s.

    Returns:
        H ``[P, HV, K, V]`` fp32 (K-first): ``H[first] = h0[n]``, ``H[p + 1] = M_p H[p] + E_p``; 0 on unused slots.
        With `final`: ``(H, final_state [N, HV, K, V])``. One launch of (N + 1) x HV x V / BV CTAs; no host
        synchronisation; M and E of unused slots are never read.
    """
    return _scan(M, E, h0, part_cu, reverse=False, final=final, names=("M", "E", "h0"), bv=bv)


def scan_bwd(M: torch.Tensor, F: torch.Tensor, dht: Optional[torch.Tensor], part_cu: torch.Tensor, *,
             final: bool = False, bv: Optional[int] = None):
    """Every partition's end gradient, in one launch (`flashdelta.cp.scan_grads`' result, `reference.cp.scan_grads`'
    convention).

    Args:
        M: ``[P, HV, K, K]`` fp32, each slot's transition (the walk applies ``M^T``); F: ``[P, HV, K, V]`` fp32, each
            slot's start gradient from a zero end gradient. Head dims as in `scan_fwd`.
        dht: ``[N, HV, K, V]`` fp32, the gradients of the sequences' final states, or None (zeros).
        part_cu: as in `scan_fwd`.
        final: also return each sequence's dh0 ``M_first^T D[first] + F_first`` (one more step per sequence).
        bv: as in `scan_fwd`.

    Returns:
        D ``[P, HV, K, V]`` fp32 (K-first): ``D[last] = dht[n]``, ``D[p - 1] = M_p^T D[p] + F_p``; 0 on unused slots.
        With `final`: ``(D, dh0 [N, HV, K, V])``. One launch, as `scan_fwd`.
    """
    return _scan(M, F, dht, part_cu, reverse=True, final=final, names=("M", "F", "dht"), bv=bv)
