"""Stage `l2norm_fwd`: per-row L2 normalisation of q or k in one memory-bound pass (SM90 TileLang).

    y = x * rsqrt(sum(x^2) + 1e-6)      over the last dim, fp32 math, y in x's dtype; rstd fp32 for the backward

One launch per tensor, a CTA per 64 rows (row = one token of one head); the row index is 64-bit so tensors past
2^31 elements work. Same contract as `portable.l2norm_fwd`; the float64 twin is `reference.chunked.l2norm_fwd`
(docs/stages.md).
"""
# No `from __future__ import annotations`: TileLang evaluates the prim_func annotations in this scope.
import tilelang.language as T
import torch

from . import _tl
from ..portable import L2NORM_EPS

F32 = "float32"
BR = 64                    # rows per CTA
THREADS = 128
DTYPES = (torch.bfloat16, torch.float16)


@_tl.jit()
def build(K: int, dtype: str):
    # problem config
    R = T.dynamic("R")

    @T.prim_func
    def l2norm_fwd_kernel(
        x: T.Tensor((R, K), dtype),
        y: T.Tensor((R, K), dtype),
        rstd: T.Tensor((R,), F32),
    ):
        with T.Kernel(T.ceildiv(R, BR), threads=THREADS) as bx:
            xf = T.alloc_fragment((BR, K), F32)
            sq = T.alloc_fragment((BR, K), F32)
            ss = T.alloc_fragment((BR,), F32)
            r0 = T.cast(bx, "int64") * BR
            for i, j in T.Parallel(BR, K):
                xf[i, j] = T.if_then_else(r0 + i < R, T.cast(x[r0 + i, j], F32), 0.0)
            for i, j in T.Parallel(BR, K):
                sq[i, j] = xf[i, j] * xf[i, j]
            T.reduce_sum(sq, ss, dim=1)
            for i in T.Parallel(BR):
                ss[i] = T.rsqrt(ss[i] + L2NORM_EPS)
            for i, j in T.Parallel(BR, K):
                if r0 + i < R:
                    y[r0 + i, j] = T.cast(xf[i, j] * ss[i], dtype)
            for i in T.Parallel(BR):
                if r0 + i < R:
                    rstd[r0 + i] = ss[i]

    return l2norm_fwd_kernel


def builder_args(K: int, dtype: torch.dtype) -> tuple:
    """The `build` arguments (its compile-cache key)."""
    return (K, _tl.TL_DTYPE[dtype])


def launcher_builds(K: int, dtype: torch.dtype) -> list:
    """(label, builder, args) of the kernel `l2norm_fwd` launches for rows of K elements in `dtype` (what
    `flashdelta.warmup` compiles)."""
    return [(f"l2norm_fwd K={K}", build, builder_args(K, dtype))]


def l2norm_fwd(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x * rsqrt(sum(x^2) + 1e-6), rstd)`` over the last dim.

    Args:
        x: ``[..., K]`` bf16/fp16, any K the fragment layout accepts (the forward uses 64, 128, 256).

    Returns:
        y in x's dtype and shape, rstd fp32 of shape ``[..., 1]`` (as `portable.l2norm_fwd`).
    """
    assert x.dtype in DTYPES, f"l2norm_fwd takes bf16/fp16, got {x.dtype}"
    K = x.shape[-1]
    rows = x.reshape(-1, K).contiguous()
    y = _tl.alloc(rows.shape, x.dtype, x.device)
    rstd = _tl.alloc((rows.shape[0],), torch.float32, x.device)
    if rows.shape[0] > 0:
        build(*builder_args(K, x.dtype))(rows, y, rstd)
    return y.view(x.shape), rstd.view(*x.shape[:-1], 1)
