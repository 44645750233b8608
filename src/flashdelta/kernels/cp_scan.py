"""Context parallelism's scan over partitions (Hopper, TileLang): every partition's start state in the forward, every
partition's end gradient in the backward (docs/algorithm.md §4.3, docs/dev/cp.md).

Per sequence n, its partitions are the consecutive slots ``part_cu[n] .. part_cu[n + 1] - 1`` (`part_offsets` derives
``part_cu [N + 1]`` from a `flashdelta.cp.CPPlan` on the device). The forward (`scan_fwd`) walks them first to last::

    H[first] = h0[n] (0 without h0),   H[p + 1] = M_p H[p] + E_p,   final[n] = M_last H[last] + E_last

and the backward (`scan_bwd`) last to first with the transposed transitions (`reference.cp.scan_grads`)::

    D[last] = dht[n] (0 without dht),  D[p - 1] = M_p^T D[p] + F_p,   dh0[n] = M_first^T D[first] + F_first

All states are K-first ``[.., K, V]`` fp32; ``M [P, HV, K, K]`` acts on the K index (``S -> M S``). The products run on
tensor cores in 3xTF32: every fp32 operand x is split into ``hi = tf32(x)`` (rounded to nearest) and ``lo = x - hi``,
and ``M S = M_hi S_hi + M_hi S_lo + M_lo S_hi`` (mma.sync m16n8k8, fp32 accumulation). Against the fp32 serial scan
(`flashdelta.cp.scan_serial`, the portable twin) the result's relative L2 error is 3.7e-6 at 8 partitions and 7.1e-6
at 32 (H100; the FMA kernel this replaces: 4-5e-7), growing about as the square root of the partitions: the tensor
cores' accumulation truncates, and the dropped ``M_lo S_lo`` adds ~2^-21 a product. That is ~500x below the bf16
rounding the output pass applies to these states; the GPU tests hold the scan to 1e-5 against float64 (up to 32
partitions). A single TF32 product (10-bit mantissa) would put ~1e-3 into every start state, compounding over the
partitions. The build uses the project's fast-math pass config: fp32 denormals flush to zero.

One CTA (K / 16 warps: 256 threads at K = 128, 128 at K = 64) per (sequence, value head, V tile of `BV` columns),
walking the sequence's partitions serially. Warp w owns output rows ``16 w .. 16 w + 15`` (TileLang's `FullRow`
warp policy): its share of M (or M^T) is an mma A operand in registers, one k chunk of 64 at a time (16 x 64 / 32 = 32
fp32 values a thread, hi and lo), the state is the B operand in shared memory, split once per step into ``S_hi^T`` and
``S_lo^T`` ``[BV, K]`` (K-major, what a tf32 B operand takes) by the warps that produced it. M_p (64 KB at K = 128,
read by the V / BV tiles of one head: L2-resident) and the bias tile (E_p or F_p, ``[K, BV]``) are streamed by
cp.async into a second shared buffer one step ahead, so step p's loads run under step p - 1's products. M's shared
rows are padded so that the A operand's reads are conflict-free: lane (g, t) of a warp reads row g, column t of its
16 x 8 block (forward: a padding of 4 floats puts the rows 4 banks apart) or row t, column g (backward, M^T: 8 floats,
8 banks apart).

Why tensor cores: the FMA kernel this replaces (each thread a TM x 4 block of the product, the state re-read from
shared memory by every row group) moved ~0.5 MB through shared memory per step and CTA. Measured (H100, kernel only,
cp_scan_bench.py, 32 partitions; docs/dev/cp.md): the backward's step 2.7-2.8 -> 1.9 us at 8-column tiles (2/4 and
2/8 heads: 84-88 -> 58-60 us a scan), 3.0 -> 2.3 at 16 (4/16), 4.5 -> 3.5 at 32 (8/32); the forward's 3.2 -> 2.8 at
16 columns and 5.0 -> 3.8 at 32, but unchanged at 8 (~2.5-2.6 us: something other than the products bounds it there).

Without `store_final` the last partition's product is skipped (the caller's output pass gives the final state), so
a sequence of J partitions runs J - 1 steps.

With a head mask (`scan_fwd(heads=...)`, the `has_heads` builds) the CTAs of a value head whose entry is 0 exit
before their first load: context parallelism's overlapped forward scans only the heads whose start states need the
scan, so the others' CTAs hold no SM while the warm-up heads' output pass runs beside the scan.

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
U32 = "uint32"
SUPPORTED_K = (64, 128)
BV_OPTIONS = (8, 16, 32)   # value columns per CTA (8: K = 128 only)
MAX_V = 1024            # V is split into V / BV CTAs: any multiple of BV up to this


def threads(K: int) -> int:
    """Threads per CTA: one warp per 16 output rows (TileLang's mma tile)."""
    return 2 * K


def m_pad(reverse: bool) -> int:
    """Floats of padding per shared row of M: the A operand's reads conflict-free (the module docstring)."""
    return 8 if reverse else 4


def x_stride(BV: int) -> int:
    """Row length (floats) of the bias tile in shared memory: 8 banks apart (mod 32), so the accumulator's 8-byte
    reads (lane (g, t): row g, columns 2 t and 2 t + 1) are conflict-free per half-warp."""
    return BV + (8 - BV) % 32


def unsupported(K: int, V: int, BV: int = 16) -> Optional[str]:
    """Why the kernel cannot run these head dims (None: it can)."""
    if K not in SUPPORTED_K:
        return f"K={K} (the scan kernel runs K in {SUPPORTED_K})"
    if BV not in BV_OPTIONS or (BV == 8 and K != 128):
        return f"BV={BV} (the scan kernel's V tiles are {BV_OPTIONS}, 8 at K = 128 only)"
    if V % BV or V > MAX_V:
        return f"V={V} (the scan kernel runs multiples of {BV} up to {MAX_V})"
    return None


# Every barrier is written out (two per step); TileLang's automatic ones would add more between the prefetch into one
# shared buffer and the reads of the other.
PASS_CONFIGS = {**_tl.PASS_CONFIGS, "tl.disable_thread_storage_sync": True}


def _tf32_hi(x):
    """x rounded to tf32 (10-bit mantissa, nearest, ties away from zero), as fp32: the high part of the 3xTF32 split;
    ``x - hi`` is exact in fp32."""
    bits = T.reinterpret(x, U32)
    return T.reinterpret(T.bitwise_and(bits + T.uint32(0x1000), T.uint32(0xFFFFE000)), F32)


@_tl.jit(pass_configs=PASS_CONFIGS)
def build(HV: int, K: int, V: int, BV: int, reverse: bool, has_init: bool, store_final: bool,
          has_heads: bool = False):
    """The kernel for one compile-time configuration; P (partition slots) and N (sequences) are dynamic.

    reverse: the backward walk (last slot first, ``M^T``); has_init: read the start value (h0 / dht; else 0);
    store_final: also run the first / last partition's product and write it (final state / dh0); has_heads: an
    ``[HV]`` int32 input, the CTAs of a value head whose entry is 0 exit at once (its slots of H are not written)."""
    # problem config
    assert unsupported(K, V, BV) is None, unsupported(K, V, BV)
    NV = V // BV
    P_ = T.dynamic("P")
    N_ = T.dynamic("N")
    # tiling config
    THREADS = threads(K)
    MP = K + m_pad(reverse)          # M's shared row
    XS = x_stride(BV)                # the bias tile's shared row
    KC = 64                          # the products' k chunk: A operands of [K, KC] (hi and lo: 64 registers a thread)
    NKC = K // KC

    def slot(p0, p1, j):
        # the j-th slot walked (int64): first to last, or last to first
        return T.cast(p1 - 1 - j if reverse else p0 + j, "int64")

    def opt(shape, on):
        return T.Tensor(shape, F32) if on else None

    @T.macro
    def prefetch(M, X, M_s, X_s, slot64, i_hv, v0, buf):
        # M_p and the bias tile of slot p into shared buffer `buf` (cp.async; waited for at the next barrier)
        T.async_copy(M[slot64, i_hv, 0:K, 0:K], M_s[buf, 0:K, 0:K])
        T.async_copy(X[slot64, i_hv, 0:K, v0:v0 + BV], X_s[buf, 0:K, 0:BV])

    @T.macro
    def put_state(acc, s_hi, s_lo):
        # the state as the next step's B operand: S^T in k chunks [NKC, BV, KC], split into tf32 hi and lo
        for i, c in T.Parallel(K, BV):
            s_hi[i // KC, c, i % KC] = _tf32_hi(acc[i, c])
            s_lo[i // KC, c, i % KC] = acc[i, c] - _tf32_hi(acc[i, c])

    @T.prim_func
    def cp_scan_kernel(
        M: T.Tensor((P_, HV, K, K), F32),
        X: T.Tensor((P_, HV, K, V), F32),
        init: opt((N_, HV, K, V), has_init),
        part_cu: T.Tensor((N_ + 1,), "int32"),
        H: T.Tensor((P_, HV, K, V), F32),
        final: opt((N_, HV, K, V), store_final),
        heads: T.Tensor((HV,), "int32") if has_heads else None,
    ):
        with T.Kernel((N_ + 1) * HV * NV, threads=THREADS) as bx:
            i_n = bx // (HV * NV)
            i_hv = (bx // NV) % HV
            v0 = (bx % NV) * BV
            M_s = T.alloc_shared((2, K, MP), F32)
            X_s = T.alloc_shared((2, K, XS), F32)
            s_hi = T.alloc_shared((NKC, BV, KC), F32)
            s_lo = T.alloc_shared((NKC, BV, KC), F32)
            a_hi = T.alloc_fragment((K, KC), F32)
            a_lo = T.alloc_fragment((K, KC), F32)
            acc = T.alloc_fragment((K, BV), F32)
            rng = T.alloc_local((2,), "int32")
            rng[0] = T.min(T.max(part_cu[T.min(i_n, N_)], 0), P_)
            rng[1] = T.min(T.max(part_cu[T.min(i_n + 1, N_)], rng[0]), P_)
            p0, p1 = rng[0], rng[1]
            n64 = T.cast(i_n, "int64")

            # a head of `heads` that no partition needs: nothing to walk
            live = (i_n < N_) & (heads[i_hv] != 0) if has_heads else i_n < N_
            if live:
                cnt = p1 - p0
                nmul = T.if_then_else(cnt > 0, cnt if store_final else cnt - 1, 0)

                # ---- the start value: the accumulator, the split state, H of the first slot walked ----
                for i, c in T.Parallel(K, BV):
                    if has_init:
                        acc[i, c] = init[n64, i_hv, i, v0 + c]
                    else:
                        acc[i, c] = 0.0
                put_state(acc, s_hi, s_lo)
                if cnt > 0:
                    for i, c in T.Parallel(K, BV):
                        H[slot(p0, p1, 0), i_hv, i, v0 + c] = acc[i, c]
                if nmul > 0:
                    prefetch(M, X, M_s, X_s, slot(p0, p1, 0), i_hv, v0, 0)
                for j in T.serial(nmul):
                    b = j % 2
                    T.ptx_wait_group(0)
                    T.sync_threads()             # step j's loads and the state split at step j - 1 are visible
                    if j + 1 < nmul:
                        prefetch(M, X, M_s, X_s, slot(p0, p1, j + 1), i_hv, v0, 1 - b)
                    for i, c in T.Parallel(K, BV):
                        acc[i, c] = X_s[b, i, c]
                    # acc += M S in 3xTF32 (the module docstring), k chunk by k chunk: [K, KC] @ [KC, BV], B given
                    # as S^T [BV, KC]
                    for kc in T.unroll(NKC):
                        for i, k in T.Parallel(K, KC):
                            if reverse:
                                a_hi[i, k] = _tf32_hi(M_s[b, kc * KC + k, i])
                                a_lo[i, k] = M_s[b, kc * KC + k, i] - a_hi[i, k]
                            else:
                                a_hi[i, k] = _tf32_hi(M_s[b, i, kc * KC + k])
                                a_lo[i, k] = M_s[b, i, kc * KC + k] - a_hi[i, k]
                        T.gemm(a_hi, s_hi[kc, :, :], acc, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                        T.gemm(a_hi, s_lo[kc, :, :], acc, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                        T.gemm(a_lo, s_hi[kc, :, :], acc, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                    T.sync_threads()             # every warp has read the state before it is overwritten
                    put_state(acc, s_hi, s_lo)
                    if j + 1 < cnt:
                        for i, c in T.Parallel(K, BV):
                            H[slot(p0, p1, j + 1), i_hv, i, v0 + c] = acc[i, c]
                if store_final:
                    for i, c in T.Parallel(K, BV):
                        final[n64, i_hv, i, v0 + c] = acc[i, c]
            else:
                if i_n == N_:
                    # ---- the padding row: zeros in every unused slot ----
                    for p in T.serial(P_ - p1):
                        for i, c in T.Parallel(K, BV):
                            H[T.cast(p1 + p, "int64"), i_hv, i, v0 + c] = 0.0

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


def builder_args(HV: int, K: int, V: int, BV: int, *, reverse: bool, has_init: bool, store_final: bool,
                 has_heads: bool = False) -> tuple:
    """The `build` arguments (its compile-cache key) for one call (without `has_heads` the key it had before)."""
    return (int(HV), int(K), int(V), int(BV), bool(reverse), bool(has_init), bool(store_final)) + \
        ((True,) if has_heads else ())


def launcher_builds(HV: int, K: int, V: int, *, N: Optional[int] = None, num_sms: int = _tl.DEFAULT_NUM_SMS,
                    backward: bool = False, init=(False, True), store_final=(False,), heads=(False,)) -> list:
    """(label, builder, args) of the scan kernels CP launches for HV value heads and head dims (K, V): the forward
    scan (`scan_fwd`), with `backward` also the reverse one (`scan_bwd`), with and without the start value (h0 /
    dht) per `init`, at the V tile `choose_bv` picks for N sequences (every tile it can pick where N is None);
    `heads` (True: the forward's builds with the per-head mask, `scan_fwd(heads=...)`)."""
    if N is None:
        tiles = [bv for bv in BV_OPTIONS if unsupported(K, V, bv) is None]
    else:
        tiles = [choose_bv(N, HV, V, num_sms, K)]
    out = []
    for reverse in ((False, True) if backward else (False,)):
        for has_init in init:
            for store in store_final:
                for BV in tiles:
                    for mask in heads if not reverse else (False,):
                        label = (f"cp_scan {'bwd' if reverse else 'fwd'} HV={HV} K={K} V={V} BV={BV} "
                                 f"init={has_init} final={store}" + (" heads" if mask else ""))
                        out.append((label, build, builder_args(HV, K, V, BV, reverse=reverse, has_init=has_init,
                                                               store_final=store, has_heads=mask)))
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


def _scan(M, X, init, part_cu, *, reverse: bool, final: bool, names: tuple, bv: Optional[int],
          heads: Optional[torch.Tensor] = None):
    P, N, HV, K, V, BV = _check(M, X, init, part_cu, names, bv)
    if heads is not None and (tuple(heads.shape) != (HV,) or heads.is_floating_point() or heads.device != X.device):
        raise ValueError(f"heads: a bool or integer [HV] = [{HV}] tensor on {X.device}, got {heads.dtype} "
                         f"{tuple(heads.shape)} on {heads.device}")
    out = _tl.alloc((P, HV, K, V), torch.float32, X.device)
    last = _tl.alloc((N, HV, K, V), torch.float32, X.device) if final else None
    if P == 0:
        return (out, last.zero_() if init is None else last.copy_(init)) if final else out
    args = builder_args(HV, K, V, BV, reverse=reverse, has_init=init is not None, store_final=final,
                        has_heads=heads is not None)
    init = init.contiguous() if init is not None else None
    heads = heads.to(torch.int32).contiguous() if heads is not None else None
    tensors = [M.contiguous(), X.contiguous(), init, part_cu.to(torch.int32).contiguous(), out, last, heads]
    build(*args)(*[t for t in tensors if t is not None])
    return (out, last) if final else out


def scan_fwd(M: torch.Tensor, E: torch.Tensor, h0: Optional[torch.Tensor], part_cu: torch.Tensor, *,
             final: bool = False, bv: Optional[int] = None, heads: Optional[torch.Tensor] = None):
    """Every partition's start state, in one launch (`flashdelta.cp.scan_serial`'s result).

    Args:
        M: ``[P, HV, K, K]`` fp32, each slot's transition (``S -> M S``); E: ``[P, HV, K, V]`` fp32, each slot's end
            state from a zero start. K in (64, 128); V a multiple of the V tile (8, 16 or 32, `choose_bv`) up to 1024.
        h0: ``[N, HV, K, V]`` fp32, the sequences' initial states, or None (zeros).
        part_cu: ``[N + 1]`` int32 (int64 is converted on the device): sequence n's partitions are the slots
            ``part_cu[n] .. part_cu[n + 1] - 1`` (`part_offsets`); slots past ``part_cu[N]`` are unused.
        final: also return each sequence's final state ``M_last H[last] + E_last`` (one more step per sequence).
        bv: the V tile (8 at K = 128, 16 or 32); None: `choose_bv`'s.
        heads: None, or ``[HV]`` bool or integer on E's device: only the value heads where it is nonzero are
            walked; the others' slots of H (and of the final state) are not written. Context parallelism's forward
            scans only the heads whose start states need it, and the CTAs of the others leave their SMs at once.

    Returns:
        H ``[P, HV, K, V]`` fp32 (K-first): ``H[first] = h0[n]``, ``H[p + 1] = M_p H[p] + E_p``; 0 on unused slots.
        With `final`: ``(H, final_state [N, HV, K, V])``. One launch of (N + 1) x HV x V / BV CTAs; no host
        synchronisation; M and E of unused slots are never read.
    """
    return _scan(M, E, h0, part_cu, reverse=False, final=final, names=("M", "E", "h0"), bv=bv, heads=heads)


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
