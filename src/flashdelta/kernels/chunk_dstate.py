"""Start gradients of a reverse chunk walk (Hopper, TileLang): the state gradient dS that each sequence's walk
reaches at its first chunk when it starts from a zero end gradient, i.e. `chunk_bwd`'s ``dh0`` with ``dht = 0``,
without the rest of the backward. Context parallelism's backward needs it per partition (F_p, docs/algorithm.md
§4.3) before it can give every partition its end gradient.

Per chunk c (C = BT = 64; ``G`` the chunk-local gate cumsum; rows past the sequence end zeroed in q, k, dO and A,
with ``G[len - 1]`` and beta = 0, so they are inert), the dS chain of `chunk_bwd` and nothing else:

    Pg = scale Gamma o Q K^T,  Ag = A o Gamma o beta_j
    dVd = R o (K dS1) + Pg^T dO;  dv = Ag^T dVd;  dU = -D dv
    dS0 = e_L dS1 + scale Q^T D dO + K^T dU

Six GEMMs per chunk against `chunk_bwd`'s nineteen, and neither the states (h) nor v: F depends on dO and the
chunk maps only. The arithmetic is `chunk_bwd`'s: the same bf16/fp16 operands (dS1, Pg, Ag, dVd, dU, scale D dO)
rounded from the same fp32 expressions, and the same accumulation sequence per element (each GEMM's k16 steps in
order; Y = Pg^T dO from a cleared accumulator, then dVd = R o (K dS1) + Y; dS0's Q term before its dU term). So F
is bit for bit the dh0 of a `chunk_bwd` launch with a zero dht, as far as a wgmma k16 step sums its products the
same way in both kernels' instruction shapes. The roundings alone would not do: each bf16 rounding of the chain
turns an fp32 difference of an ulp into a rounding-sized one that feeds the next chunk, so another summation order
puts the two ~1e-3 apart (relative L2) after a few dozen chunks (docs/dev/chunk_bwd.md).

Context parallelism's backward warm-up (docs/algorithm.md §4.4) launches builds with `chunk_take`: each (sequence,
value head) walks only its first ``take[n, hv]`` chunks, from a zero gradient at the end of chunk take - 1 (the start
gradient of a prefix window); the chunk count moves and the CTAs take their (sequence, head) items longest walk
first (`item_order`), nothing else changes, and the builds without the flag are the same code as before it
existed.

One CTA (two warpgroups) per (sequence, value head), all of V in the CTA, ``dS^T [V, K]`` fp32 in registers.
q, k, dO and A arrive by TMA into a two-slot ring, the next chunk's tiles issued when the current chunk starts;
the gates load into registers one chunk early. Output ``dh0 [N, HV, K, V]`` fp32 (K-first). CTA x index =
(sequence, value head), sequence slowest.
"""
# No `from __future__ import annotations`: TileLang evaluates the prim_func annotations in this scope.
import tilelang.language as T
import torch

from . import _tl, item_order
from .chunk_bwd import BT, DTYPES, HEAD_DIMS, LOG2E, fetch_gates

THREADS = 256
NS = 2          # ring slots of q, k, dO, A


@_tl.jit()
def build(H: int, HV: int, K: int, V: int, dtype: str, beta_dtype: str, scale: float, chunk_take: bool = False):
    """The kernel for one compile-time configuration; T (tokens) and N (sequences) are dynamic. chunk_take: a
    ``take [N, HV]`` int32 input; the CTA of (sequence n, value head hv) walks chunks ``take[n, hv] - 1`` down to 0
    (take clamped to [0, NT_n]) from a zero gradient, so dh0 is the start gradient of the sequence's first ``take``
    chunks (0 where take <= 0), and the CTAs take their (sequence, head) items in the ``order [N HV]`` of
    `item_order` (the largest take first: a few fallback heads walk whole partitions, most a short window).
    Without it the kernel is unchanged."""
    G = HV // H
    acc = "float32"
    assert HV % H == 0 and (K, V) in HEAD_DIMS
    T_ = T.dynamic("T")
    N_ = T.dynamic("N")
    # without chunk_take `take` is no kernel parameter (a non-tensor annotation is a plain Python value to TileLang)
    take_t = T.Tensor((N_, HV), "int32") if chunk_take else None
    order_t = T.Tensor((N_ * HV,), "int32") if chunk_take else None     # `item_order`: the longest walk first

    def walk_chunks(bos, eos, take, i_n, i_hv):
        # the chunks walked: with chunk_take, the first take[n, hv] (clamped, so that a take past the end walks the
        # whole sequence and a negative one nothing); else every chunk of the sequence
        if not chunk_take:
            return T.ceildiv(eos - bos, BT)
        return T.min(T.max(take[i_n, i_hv], 0), T.ceildiv(eos - bos, BT))

    @T.macro
    def issue(c, st, bos, i_h, i_hv, tx, q, k, do, A, q_s, k_s, do_s, a_s, full):
        # one warp issues the TMA copies of chunk c's tiles into ring slot st
        t0 = bos + c * BT
        if tx < 32:
            T.tma_copy(q[0, t0:t0 + BT, i_h, 0:K], q_s[st, :, :], barrier=full[st])
            T.tma_copy(k[0, t0:t0 + BT, i_h, 0:K], k_s[st, :, :], barrier=full[st])
            T.tma_copy(do[0, t0:t0 + BT, i_hv, 0:V], do_s[st, :, :], barrier=full[st])
            T.tma_copy(A[0, t0:t0 + BT, i_hv, 0:BT], a_s[st, :, :], barrier=full[st])
            T.barrier_arrive(full[st])

    @T.prim_func
    def chunk_dstate_kernel(
        q: T.Tensor((1, T_, H, K), dtype),
        k: T.Tensor((1, T_, H, K), dtype),
        g: T.Tensor((1, T_, HV), acc),
        beta: T.Tensor((1, T_, HV), beta_dtype),
        A: T.Tensor((1, T_, HV, BT), dtype),
        do: T.Tensor((1, T_, HV, V), dtype),
        cu_seqlens: T.Tensor((N_ + 1,), "int32"),
        dh0: T.Tensor((N_, HV, K, V), acc),
        take: take_t,
        order: order_t,
    ):
        with T.Kernel(N_ * HV, threads=THREADS) as bx:
            if chunk_take:
                i_n = order[bx] // HV
                i_hv = order[bx] % HV
            else:
                i_n = bx // HV
                i_hv = bx % HV
            i_h = i_hv // G
            tx = T.get_thread_binding()

            q_s = T.alloc_shared((NS, BT, K), dtype)
            k_s = T.alloc_shared((NS, BT, K), dtype)
            do_s = T.alloc_shared((NS, BT, V), dtype)       # dO, then scale D dO in place
            a_s = T.alloc_shared((NS, BT, BT), dtype)
            ds_s = T.alloc_shared((V, K), dtype)            # dS1^T
            dvd_s = T.alloc_shared((BT, V), dtype)          # dVd, then dU
            ag_s = T.alloc_shared((BT, BT), dtype)
            pg_s = T.alloc_shared((BT, BT), dtype)
            g_s = T.alloc_shared((BT,), acc)
            b_s = T.alloc_shared((BT,), acc)
            gn_s = T.alloc_shared((BT,), acc)               # the next chunk's G and beta
            bn_s = T.alloc_shared((BT,), acc)
            eg_s = T.alloc_shared((BT,), acc)               # exp(G)
            r_s = T.alloc_shared((BT,), acc)                # exp(G_last - G)
            full = T.alloc_barrier([32] * NS)

            ds_f = T.alloc_fragment((V, K), acc)            # dS^T, carried across chunks
            p_f = T.alloc_fragment((BT, BT), acc)
            dvd_f = T.alloc_fragment((BT, V), acc)
            dv_f = T.alloc_fragment((BT, V), acc)            # Y = Pg^T dO, then dv
            du_f = T.alloc_fragment((BT, V), dtype)
            dod_f = T.alloc_fragment((BT, V), dtype)
            gl = T.alloc_local((2,), acc)

            bos = cu_seqlens[i_n]
            eos = cu_seqlens[i_n + 1]
            NT = walk_chunks(bos, eos, take, i_n, i_hv)
            T.clear(ds_f)
            if NT > 0:
                issue(NT - 1, 0, bos, i_h, i_hv, tx, q, k, do, A, q_s, k_s, do_s, a_s, full)
                fetch_gates(NT - 1, bos, eos, i_hv, tx, g, beta, gl)
                if tx < BT:
                    gn_s[tx] = gl[0]
                    bn_s[tx] = gl[1]
            for cc in T.serial(NT):
                c = NT - 1 - cc
                st = cc % NS
                ln = T.min(eos - (bos + c * BT), BT)
                T.sync_threads()
                if c > 0:
                    # the next chunk's tiles go to the other slot (its last reader, the chunk before, is done)
                    issue(c - 1, (cc + 1) % NS, bos, i_h, i_hv, tx, q, k, do, A, q_s, k_s, do_s, a_s, full)
                    fetch_gates(c - 1, bos, eos, i_hv, tx, g, beta, gl)
                for i in T.Parallel(BT):
                    g_s[i] = gn_s[i]
                    b_s[i] = bn_s[i]
                    eg_s[i] = T.exp2(gn_s[i] * LOG2E)
                    r_s[i] = T.exp2((gn_s[BT - 1] - gn_s[i]) * LOG2E)
                T.copy(ds_f, ds_s)                                                      # dS1 as a GEMM operand
                T.barrier_wait(full[st], (cc // NS) % 2)
                if ln < BT:
                    for i, j in T.Parallel(BT, K):
                        if i >= ln:
                            q_s[st, i, j] = T.cast(0, dtype)
                            k_s[st, i, j] = T.cast(0, dtype)
                    for i, j in T.Parallel(BT, V):
                        if i >= ln:
                            do_s[st, i, j] = T.cast(0, dtype)
                    for i, j in T.Parallel(BT, BT):
                        if i >= ln:
                            a_s[st, i, j] = T.cast(0, dtype)
                T.sync_threads()

                T.wgmma_gemm(q_s[st, :, :], k_s[st, :, :], p_f, transpose_B=True, clear_accum=True)   # Q K^T
                T.wgmma_gemm(k_s[st, :, :], ds_s, dvd_f, transpose_B=True, clear_accum=True)          # K dS1
                T.wait_wgmma(0)
                for i, j in T.Parallel(BT, BT):
                    # Gamma_ij = exp(G_i - G_j) for i >= j, exactly 0 above the diagonal
                    gam = T.exp2(T.Select(i >= j, (g_s[i] - g_s[j]) * LOG2E, -T.infinity(acc)))
                    pg_s[i, j] = T.cast(p_f[i, j] * gam * scale, dtype)
                    ag_s[i, j] = T.cast(T.cast(a_s[st, i, j], acc) * gam * b_s[j], dtype)
                T.gemm(pg_s, do_s[st, :, :], dv_f, transpose_A=True, clear_accum=True)  # Y = Pg^T dO
                for i, j in T.Parallel(BT, V):
                    dvd_f[i, j] = dvd_f[i, j] * r_s[i] + dv_f[i, j]                     # dVd = R o (K dS1) + Y
                T.copy(dvd_f, dvd_s)
                T.gemm(ag_s, dvd_s, dv_f, transpose_A=True, clear_accum=True)          # dv = Ag^T dVd
                for i, j in T.Parallel(BT, V):
                    du_f[i, j] = T.cast(-eg_s[i] * dv_f[i, j], dtype)                   # dU = -D dv
                for i, j in T.Parallel(BT, V):
                    dod_f[i, j] = T.cast(T.cast(do_s[st, i, j], acc) * (eg_s[i] * scale), dtype)
                for i, j in T.Parallel(V, K):
                    ds_f[i, j] = ds_f[i, j] * eg_s[BT - 1]
                T.sync_threads()
                T.copy(du_f, dvd_s)
                T.copy(dod_f, do_s[st, :, :])
                T.wgmma_gemm(do_s[st, :, :], q_s[st, :, :], ds_f, transpose_A=True)    # dS0^T += (scale D dO)^T Q
                T.wgmma_gemm(dvd_s, k_s[st, :, :], ds_f, transpose_A=True)             # dS0^T += dU^T K
                T.wait_wgmma(0)
                if c > 0:
                    if tx < BT:
                        gn_s[tx] = gl[0]
                        bn_s[tx] = gl[1]

            n64 = T.cast(i_n, "int64")
            for i, j in T.Parallel(V, K):
                dh0[n64, i_hv, j, i] = ds_f[i, j]

    return chunk_dstate_kernel


def builder_args(H: int, HV: int, K: int, V: int, dtype: torch.dtype, beta_dtype: torch.dtype, scale: float) -> tuple:
    """The `build` arguments (its compile-cache key) for one call without `chunk_take` (append True for the build
    with it)."""
    return (H, HV, K, V, _tl.TL_DTYPE[dtype], _tl.TL_DTYPE[beta_dtype], float(scale))


def launcher_builds(H: int, HV: int, K: int, V: int, dtype: torch.dtype, beta_dtype: torch.dtype,
                    scale: float, chunk_take=(False,)) -> list:
    """(label, builder, args) of the kernels `chunk_dstate` launches for these heads, dims and dtypes; `chunk_take`
    (True: the build with the per-(sequence, head) chunk limit, which only context parallelism's backward warm-up
    launches, `cp.builds`)."""
    label = f"chunk_dstate H={H} HV={HV} K={K} V={V}"
    args = builder_args(H, HV, K, V, dtype, beta_dtype, scale)
    return [(label + " take", build, args + (True,)) if take else (label, build, args) for take in chunk_take]


def chunk_dstate(q, k, g_cumsum, beta, A, do, cu_seqlens, *, scale, chunk_size=64, chunk_take=None):
    """Each sequence's start gradient from a zero end gradient (what `chunk_bwd` returns as dh0 with dht = 0).

    Args:
        q, k: ``[1, T, H, K]`` bf16/fp16; do: ``[1, T, HV, V]`` (cast to q's dtype); (K, V) in `HEAD_DIMS`.
        g_cumsum: ``[1, T, HV]`` fp32; beta: ``[1, T, HV]`` bf16, fp16 or fp32; A: ``[1, T, HV, BT]`` (q's dtype).
        cu_seqlens: ``[N + 1]`` int32 (int64 is converted on the device).
        chunk_take: None, or ``[N, HV]`` int32 (other integer dtypes are converted on the device): sequence n's
            value head hv walks only its first ``chunk_take[n, hv]`` chunks (clamped to [0, its chunk count]), from
            a zero gradient at the end of the last of them (context parallelism's backward warm-up,
            `flashdelta.cp`).

    Returns:
        ``[N, HV, K, V]`` fp32 (K-first). One launch of N * HV CTAs; no host synchronisation.
    """
    _, T_, H, K = q.shape
    HV, V = do.shape[2], do.shape[3]
    N = cu_seqlens.shape[0] - 1
    assert chunk_size == BT and (K, V) in HEAD_DIMS and HV % H == 0
    assert q.dtype == k.dtype and q.dtype in DTYPES and g_cumsum.dtype == torch.float32
    if chunk_take is not None:
        assert tuple(chunk_take.shape) == (N, HV) and not chunk_take.dtype.is_floating_point, \
            "chunk_take: integer [N, HV]"
        chunk_take = chunk_take.to(torch.int32).contiguous()
    out = _tl.alloc((N, HV, K, V), torch.float32, q.device)
    if T_ == 0 or N == 0:
        return out.zero_()
    args = builder_args(H, HV, K, V, q.dtype, beta.dtype, scale)
    tensors = (q.contiguous(), k.contiguous(), g_cumsum.contiguous(), beta.contiguous(), A.to(q.dtype).contiguous(),
               do.to(q.dtype).contiguous(), _tl.cu_seqlens_int32(cu_seqlens), out)
    if chunk_take is None:
        build(*args)(*tensors)
    else:
        build(*args, True)(*tensors, chunk_take, item_order.order(chunk_take, 1, descending=True, tail=False))
    return out
