"""Context parallelism's warm-up decisions in one launch (TileLang): what `cp.windows` (forward) and
`cp.grad_windows` (backward) compute with ~25-30 small torch kernels each on the warm-up path (a threshold), from
g_cumsum, beta and (unless the keys are l2-normalised) k on the device, into buffers sized from host integers (P
partition slots, L chunks per partition), so CUDA graphs capture it and replay it with new lengths.

Per partition slot p and value head h. Forward (`cp.Windows`): ``suffix [P, L, HV]`` float64, the G_last of chunk
``L - 1 - j`` (the gate at token ``min(cu[p] + 64 (L - j) - 1, T - 1)``) summed from j = 0 on; a slot that is not
its sequence's last (``inner``: slot p + 1 exists and does not start a sequence) reaches when some sum is
``<= threshold`` and every token of the partition has ``0 <= beta ||k||^2 <= limit`` (NaN: no; with
`keys_normalized` beta alone against `limit`, the caller's bound rounded to beta's dtype): ``skip_e = L - 1 - j`` (j
the first reaching sum), else ``skip_e = 0`` and ``fallback``; other slots ``skip_e = SKIP_ALL``; ``skip_m`` 0 on
fallback heads, else ``SKIP_ALL``. Backward (`cp.GradWindows`, `backward`): ``prefix [P, L, HV]``, chunk j's G_last
(the gate at ``clamp(min(cu[p] + 64 j + 63, cu[p + 1] - 1), 0, T - 1)``, 0 for chunks past the partition's end)
summed from j = 0 on; a slot that continues its sequence (not ``first``) reaches as above over its own tokens
``[cu[p], cu[p + 1])``: ``take = j + 1``, else ``TAKE_ALL`` and ``fallback``; other slots ``take = 0``. The sums add
one float64 addition after the other from 0 (the order of torch's cumsum over a non-innermost dim), on every slot.

One CTA per (slot, key head) for the key head's HV // H value heads: the gates of `LT` chunks at a time staged in
shared memory, one thread per value head adding them in order; then (slots that decide only) the partition's tokens
in tiles of `TB` tokens, k's rows of a tile brought into shared memory by a TMA pipeline of `NS` stages (TileLang's
warp-specialised `T.Pipelined`: a producer warpgroup issues the loads, `THREADS` consumers check) and beta's three
tiles ahead in registers, so NS - 1 tiles are in flight while one is checked. Loading one tile ahead into registers
instead, a 2048-token partition cost one load round trip per tile: the pipeline took 2/8 and 4/16 1x32768 from
17.9-18.8 to 15.3-16.0 us and 2/4 from 17.9 to 14.1 (H100, forward and backward alike; with `keys_normalized`, which
reads beta alone, within +-1.3 us of the register version; docs/dev/cp.md). The checks: the squared key norms in
fp32 (k read once; their sum order and fast-math rounding may differ from torch's `vector_norm` in the last bits, so
a product within a few ulps of the limit may decide differently), the products ``beta ||k||^2`` in beta's promotion
with fp32 (float64 for float64 beta) and a shared flag per value head. Rows past T come in as zeros from the TMA and
rows past the partition's tokens are not checked.
The `norms` builds read prepare's squared key norms (``k_norm2 [T, H]`` fp32, `prepare_fwd(norms=True)`: K K^T's
diagonal, one accumulation order of the same products) in place of k's tiles, a 256-token tile of them at a time:
the check without the walk over k (at 16/16 1x32768 the whole of k, ~50 us a direction at bandwidth).
The torch code (`cp.windows`, `cp.grad_windows`) stays the exact path and the portable one.
"""
# No `from __future__ import annotations`: TileLang evaluates the prim_func annotations in this scope.
import tilelang.language as T
import torch

from . import _tl

BT = 64
THREADS = 512             # the consumers; the TMA pipeline adds a producer warpgroup
LT = 64                    # chunks per staging tile of the suffix sums
TB = 256                   # tokens per contraction tile (k: 64 KB at K = 128)
NS = 3                     # TMA pipeline stages of k's tiles (beta's tiles: three ahead in registers)
MAX_G = 8                  # value heads per key head (beta in registers: up to 4 values a tile and thread)
SKIP_ALL = 1 << 30         # `cp.SKIP_ALL` and `cp.TAKE_ALL`
K_DTYPES = (torch.bfloat16, torch.float16)
BETA_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
HEAD_DIMS = (64, 128, 256)
F32, F64, I32 = "float32", "float64", "int32"


@_tl.jit()
def build(H: int, HV: int, K: int, dtype: str, beta_dtype: str, keys_normalized: bool, backward: bool = False,
          norms: bool = False):
    """The kernel (`backward`: `cp.grad_windows`'s, else `cp.windows`'s); T (tokens), P (slots) and L (chunks per
    partition) are dynamic. norms: the squared key norms come in as ``k_norm2 [T, H]`` fp32 (prepare's, K K^T's
    diagonal) and k is not read."""
    assert not (norms and keys_normalized), "norms: for keys that are not normalised"
    G = HV // H
    TBK = TB if K <= 128 else TB // 2           # tokens a tile: k's part is at most 64 KB
    CD = F64 if beta_dtype == F64 else F32      # beta x ||k||^2 as torch promotes it
    T_ = T.dynamic("T")
    P_ = T.dynamic("P")
    L_ = T.dynamic("L")

    @T.macro
    def load_beta(beta, dst, bos, tile, n_tok):
        # beta's rows of tile `tile` for this key head's value heads (0 past the partition's tokens)
        kh = T.get_block_binding(1)
        for i, h in T.Parallel(TBK, G):
            dst[i, h] = T.if_then_else(tile * TBK + i < n_tok, beta[T.min(bos + tile * TBK + i, T_ - 1), kh * G + h],
                                       T.cast(0, beta_dtype))

    @T.macro
    def check_tile(beta, b0, b1, b2, b3, ns, bad, bos, it, n_tok, limit):
        # tile it's condition into bad[h]: its beta shifted into b0, tile it + 3's loads issued into b3
        T.copy(b1, b0)
        T.copy(b2, b1)
        T.copy(b3, b2)
        load_beta(beta, b3, bos, it + 3, n_tok)
        for i, h in T.Parallel(TBK, G):
            if it * TBK + i < n_tok:
                if keys_normalized:
                    if not ((T.cast(b0[i, h], F64) >= 0.0) & (T.cast(b0[i, h], F64) <= limit)):
                        bad[h] = 1
                else:
                    if not ((T.cast(b0[i, h], CD) * T.cast(ns[i], CD) >= T.cast(0.0, CD))
                            & (T.cast(b0[i, h], CD) * T.cast(ns[i], CD) <= T.cast(limit, CD))):
                        bad[h] = 1

    @T.prim_func
    def cp_windows_kernel(
        g: T.Tensor((T_, HV), F32),
        k: T.Tensor((T_, H, K), dtype),
        beta: T.Tensor((T_, HV), beta_dtype),
        cu: T.Tensor((P_ + 1,), I32),
        first: T.Tensor((P_,), "uint8"),
        chunks: T.Tensor((P_, HV), I32),
        skip_m: T.Tensor((1,) if backward else (P_, HV), I32),
        fallback: T.Tensor((P_, HV), "uint8"),
        sums: T.Tensor((P_, L_, HV), F64),
        threshold: T.float64,
        limit: T.float64,
        k_norm2: T.Tensor((T_, H), F32) if norms else None,
    ):
        with T.Kernel(P_, H, threads=THREADS) as (p, kh):
            tx = T.get_thread_binding()
            gs = T.alloc_shared((LT, G), F32)
            bad = T.alloc_shared((G,), I32)
            ns = T.alloc_shared((TBK,), F32)
            ks = T.alloc_shared((TBK, K), dtype)
            b0 = T.alloc_fragment((TBK, G), beta_dtype)        # beta of tiles it .. it + 3
            b1 = T.alloc_fragment((TBK, G), beta_dtype)
            b2 = T.alloc_fragment((TBK, G), beta_dtype)
            b3 = T.alloc_fragment((TBK, G), beta_dtype)
            sq = T.alloc_fragment((TBK, K), F32)
            ss = T.alloc_fragment((TBK,), F32)
            run = T.alloc_local((1,), F64)
            hit = T.alloc_local((1,), I32)
            W = L_ * BT
            bos = cu[p]
            eos = cu[p + 1]
            # forward: slot p + 1 continues p's sequence (p is not its last); backward: p continues one (not first)
            if backward:
                live = first[p] == 0
            else:
                live = (p + 1 < P_) & (first[T.min(p + 1, P_ - 1)] == 0)
            n_tok = T.if_then_else(live, (eos - bos) if backward else W, 0)       # the tokens checked
            run[0] = 0.0
            hit[0] = L_                           # the first reaching sum (L: none)
            if tx < G:
                bad[tx] = 0
            for jt in T.serial(T.ceildiv(L_, LT)):
                for j, h in T.Parallel(LT, G):
                    if backward:        # chunk c from the first: its last token in the partition, 0 past its end
                        gs[j, h] = T.if_then_else(
                            (jt * LT + j < L_) & (bos + (jt * LT + j) * BT < eos),
                            g[T.max(T.min(T.min(bos + (jt * LT + j) * BT + BT - 1, eos - 1), T_ - 1), 0), kh * G + h],
                            0.0)
                    else:               # chunk L - 1 - c: from the last chunk back
                        gs[j, h] = T.if_then_else(
                            jt * LT + j < L_, g[T.min(bos + W - 1 - (jt * LT + j) * BT, T_ - 1), kh * G + h], 0.0)
                T.sync_threads()
                if tx < G:
                    for j in T.serial(T.min(LT, L_ - jt * LT)):
                        run[0] = run[0] + T.cast(gs[j, tx], F64)
                        sums[p, jt * LT + j, kh * G + tx] = run[0]
                        if hit[0] == L_ and run[0] <= threshold:
                            hit[0] = jt * LT + j
                T.sync_threads()
            # the partition's tokens, tile by tile: k through the TMA pipeline (zeros past T), beta's few values a
            # thread three tiles ahead in registers (its rows of G values are too narrow for a TMA box); rows past n_tok
            # are not checked
            load_beta(beta, b1, bos, 0, n_tok)
            load_beta(beta, b2, bos, 1, n_tok)
            load_beta(beta, b3, bos, 2, n_tok)
            if keys_normalized:
                for it in T.serial(T.ceildiv(n_tok, TBK)):
                    check_tile(beta, b0, b1, b2, b3, ns, bad, bos, it, n_tok, limit)
                    T.sync_threads()
            elif norms:
                for it in T.serial(T.ceildiv(n_tok, TBK)):
                    for i in T.Parallel(TBK):
                        ns[i] = T.if_then_else(it * TBK + i < n_tok, k_norm2[T.min(bos + it * TBK + i, T_ - 1), kh],
                                               0.0)
                    T.sync_threads()
                    check_tile(beta, b0, b1, b2, b3, ns, bad, bos, it, n_tok, limit)
                    T.sync_threads()
            else:
                for it in T.Pipelined(T.ceildiv(n_tok, TBK), num_stages=NS):
                    T.copy(k[bos + it * TBK:bos + it * TBK + TBK, kh, :], ks)
                    for i, j in T.Parallel(TBK, K):
                        sq[i, j] = T.cast(ks[i, j], F32) * T.cast(ks[i, j], F32)
                    T.reduce_sum(sq, ss, dim=1)
                    for i in T.Parallel(TBK):
                        ns[i] = ss[i]
                    check_tile(beta, b0, b1, b2, b3, ns, bad, bos, it, n_tok, limit)
            T.sync_threads()
            if tx < G:
                reach = live & (hit[0] < L_) & (bad[tx] == 0)
                fb = live & (~reach)
                fallback[p, kh * G + tx] = T.if_then_else(fb, T.cast(1, "uint8"), T.cast(0, "uint8"))
                if backward:            # take: the window's chunks, every chunk (fallback), none (first, unused)
                    chunks[p, kh * G + tx] = T.if_then_else(reach, hit[0] + 1, T.if_then_else(live, SKIP_ALL, 0))
                else:                   # skip_e: the chunks before the window, none (fallback), all (not inner)
                    chunks[p, kh * G + tx] = T.if_then_else(reach, L_ - 1 - hit[0], T.if_then_else(live, 0, SKIP_ALL))
                    skip_m[p, kh * G + tx] = T.if_then_else(fb, 0, SKIP_ALL)

    return cp_windows_kernel


def unsupported(H: int, HV: int, K: int, k_dtype: torch.dtype, beta_dtype: torch.dtype) -> "str | None":
    """Why the kernel does not take these heads / dtypes (None: it does)."""
    if HV % H or HV // H > MAX_G:
        return f"HV={HV}, H={H}: value heads per key head must divide and be <= {MAX_G}"
    if K not in HEAD_DIMS:
        return f"K={K} not in {HEAD_DIMS}"
    if k_dtype not in K_DTYPES:
        return f"k dtype {k_dtype} not in {K_DTYPES}"
    if beta_dtype not in BETA_DTYPES:
        return f"beta dtype {beta_dtype} not in {BETA_DTYPES}"
    return None


def builder_args(H: int, HV: int, K: int, dtype: torch.dtype, beta_dtype: torch.dtype, keys_normalized: bool,
                 backward: bool = False, norms: bool = False) -> tuple:
    """The `build` arguments (its compile-cache key; `norms` appended only when set)."""
    return (H, HV, K, _tl.TL_DTYPE[dtype], _tl.TL_DTYPE[beta_dtype], bool(keys_normalized), bool(backward),
            *((True,) if norms else ()))


def launcher_builds(H: int, HV: int, K: int, dtype: torch.dtype, beta_dtype: torch.dtype,
                    keys_normalized: tuple = (False, True), backward: tuple = (False,), norms: bool = True) -> list:
    """(label, builder, args) of the windows kernel for each `keys_normalized` and direction (`backward`: the
    backward's, `cp.grad_windows`), and with `norms` the builds reading prepare's key norms (keys not normalised);
    none where it does not take the heads or dtypes."""
    if unsupported(H, HV, K, dtype, beta_dtype) is not None:
        return []
    kinds = [(n, False) for n in keys_normalized] + ([(False, True)] if norms and False in keys_normalized else [])
    return [(f"cp_windows{' bwd' if b else ''} {H}/{HV} K={K}{' normalized' if n else ''}{' norms' if m else ''}",
             build, builder_args(H, HV, K, dtype, beta_dtype, n, b, m)) for b in backward for n, m in kinds]


def windows_tensors(g_cumsum: torch.Tensor, k: torch.Tensor, beta: torch.Tensor, cu: torch.Tensor,
                    first: torch.Tensor, L: int, threshold: float, limit: float, keys_normalized: bool,
                    backward: bool = False, k_norm2=None) -> tuple:
    """`cp.windows` on the warm-up path as ``(skip_e, skip_m, fallback, suffix)``, or with `backward`
    `cp.grad_windows` as ``(take, fallback, prefix)``: g_cumsum ``[1, T, HV]`` fp32, k ``[1, T, H, K]``, beta
    ``[1, T, HV]``, the plan's ``cu [P + 1]`` int32 and ``first [P]`` bool, all on the GPU, T >= 1; `limit` the
    contraction bound as the comparison takes it (`cp.windows`); `k_norm2` None, or prepare's squared key norms
    ``[1, T, H]`` fp32 read in place of k (keys not normalised). One launch, no host synchronisation."""
    _, T_, HV = g_cumsum.shape
    H, K = k.shape[2], k.shape[3]
    P = cu.shape[0] - 1
    assert T_ >= 1 and P >= 1 and L >= 1 and unsupported(H, HV, K, k.dtype, beta.dtype) is None
    dev = g_cumsum.device
    chunks = torch.empty(P, HV, dtype=torch.int32, device=dev)
    skip_m = torch.empty((1,) if backward else (P, HV), dtype=torch.int32, device=dev)
    fallback = torch.empty(P, HV, dtype=torch.uint8, device=dev)
    sums = torch.empty(P, L, HV, dtype=torch.float64, device=dev)
    norms = k_norm2 is not None
    kernel = build(*builder_args(H, HV, K, k.dtype, beta.dtype, keys_normalized, backward, norms))
    extra = (k_norm2[0].contiguous(),) if norms else ()
    kernel(g_cumsum[0].contiguous(), k[0].contiguous(), beta[0].contiguous(), cu.contiguous(),
           first.contiguous().view(torch.uint8), chunks, skip_m, fallback, sums, float(threshold), float(limit),
           *extra)
    if backward:
        return chunks, fallback.view(torch.bool), sums
    return chunks, skip_m, fallback.view(torch.bool), sums
