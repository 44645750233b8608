"""Stage `group_sum` (SM90 TileLang): the GVA group sum of the per-value-head dq or dk, with the l2norm backward
fused in (docs/stages.md).

    s[r]   = sum over g of dx[r, g]                (fp32; row r: a token of a key head; g: its G = HV / H value heads)
    out[r] = s[r]                                  without y
    out[r] = (s[r] - (s[r] . y[r]) y[r]) rstd[r]   with y = x rstd, the q/k normalisation's output: its backward

in the output's dtype (the caller passes q's: what autograd returns). One memory-bound pass: G rows of chunk_bwd's
gradient, y and rstd in, one row out, where torch made a reduction over the group, a cast and, with the l2norm,
five element-wise fp32 passes (docs/dev/chunk_bwd.md). The group is summed in a fixed order (value head 0 first),
so the result is deterministic. A CTA per 32 rows (`l2norm_fwd`'s layout, half its rows: fewer registers with the
l2norm's three row tiles); the row index is 64-bit, so tensors past 2^31
elements work. The portable twin is `portable.group_sum`, the float64 one `reference.chunked.group_sum`.
"""
# No `from __future__ import annotations`: TileLang evaluates the prim_func annotations in this scope.
from typing import Optional

import tilelang.language as T
import torch

from . import _tl

F32 = "float32"
BR = 32                    # rows per CTA (32 fp32 values of a K = 128 row set per thread)
THREADS = 128
DTYPES = (torch.bfloat16, torch.float16, torch.float32)      # dx, y and the output


@_tl.jit()
def build(G: int, K: int, dx_dtype: str, y_dtype: Optional[str], out_dtype: str):
    """The kernel for G value heads per key head, rows of K; y_dtype None: the group sum alone."""
    # problem config
    R = T.dynamic("R")
    l2 = y_dtype is not None

    @T.prim_func
    def group_sum_kernel(
        dx: T.Tensor((R, G, K), dx_dtype),
        y: T.Tensor((R, K), y_dtype) if l2 else None,
        rstd: T.Tensor((R,), F32) if l2 else None,
        out: T.Tensor((R, K), out_dtype),
    ):
        with T.Kernel(T.ceildiv(R, BR), threads=THREADS) as bx:
            s = T.alloc_fragment((BR, K), F32)
            r0 = T.cast(bx, "int64") * BR
            for i, j in T.Parallel(BR, K):
                s[i, j] = T.if_then_else(r0 + i < R, T.cast(dx[r0 + i, 0, j], F32), 0.0)
            if G > 1:
                for g in T.unroll(G - 1):
                    for i, j in T.Parallel(BR, K):
                        s[i, j] = s[i, j] + T.if_then_else(r0 + i < R, T.cast(dx[r0 + i, g + 1, j], F32), 0.0)
            if l2:
                yf = T.alloc_fragment((BR, K), F32)
                p = T.alloc_fragment((BR, K), F32)
                d = T.alloc_fragment((BR,), F32)
                for i, j in T.Parallel(BR, K):
                    yf[i, j] = T.if_then_else(r0 + i < R, T.cast(y[r0 + i, j], F32), 0.0)
                for i, j in T.Parallel(BR, K):
                    p[i, j] = s[i, j] * yf[i, j]
                T.reduce_sum(p, d, dim=1)                                     # s . y per row
                for i, j in T.Parallel(BR, K):
                    s[i, j] = (s[i, j] - d[i] * yf[i, j]) * T.if_then_else(r0 + i < R, rstd[r0 + i], 0.0)
            for i, j in T.Parallel(BR, K):
                if r0 + i < R:
                    out[r0 + i, j] = T.cast(s[i, j], out_dtype)

    return group_sum_kernel


def builder_args(G: int, K: int, dx_dtype: torch.dtype, y_dtype: Optional[torch.dtype],
                 out_dtype: torch.dtype) -> tuple:
    """The `build` arguments (its compile-cache key); y_dtype None without the l2norm backward."""
    return (G, K, _tl.TL_DTYPE[dx_dtype], None if y_dtype is None else _tl.TL_DTYPE[y_dtype], _tl.TL_DTYPE[out_dtype])


def launcher_builds(H: int, HV: int, K: int, dtype: torch.dtype, qk_l2norm: bool,
                    dx_dtype: Optional[torch.dtype] = None) -> list:
    """(label, builder, args) of what the SM90 backward launches for dq and dk of (H, HV) heads with q in `dtype` (the
    normalised q/k's and the result's dtype) and chunk_bwd's gradient in dx_dtype (default `dtype`; fp32 where the
    portable chunk_bwd runs): the group sum alone (none where chunk_bwd's output is the result) and, with qk_l2norm,
    the one with the l2norm backward too."""
    G = HV // H
    dx_dtype = dtype if dx_dtype is None else dx_dtype
    out = []
    for l2 in (False, True) if qk_l2norm else (False,):
        if G > 1 or l2 or dx_dtype != dtype:
            out.append((f"group_sum G={G} K={K} dx={str(dx_dtype)[6:]} l2norm={l2}", build,
                        builder_args(G, K, dx_dtype, dtype if l2 else None, dtype)))
    return out


def group_sum(dx: torch.Tensor, H: int, *, y: Optional[torch.Tensor] = None, rstd: Optional[torch.Tensor] = None,
              out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """The sum over each key head's value heads, then with (y, rstd) the l2norm backward through it.

    Args:
        dx: ``[1, T, HV, K]`` per value head (chunk_bwd's dq or dk), bf16, fp16 or fp32; H: key heads, dividing HV.
        y, rstd: the normalised q or k ``[1, T, H, K]`` and its rstd ``[1, T, H, 1]`` (`l2norm_fwd`), or both None.
        out_dtype: the result's dtype (default dx's).

    Returns:
        ``[1, T, H, K]`` in out_dtype, accumulated in fp32 and rounded once; dx itself at HV == H with neither y nor a
        new dtype. No host synchronisation.
    """
    _, T_, HV, K = dx.shape
    out_dtype = dx.dtype if out_dtype is None else out_dtype
    assert HV % H == 0 and dx.dtype in DTYPES and out_dtype in DTYPES and (y is None) == (rstd is None)
    G = HV // H
    if G == 1 and y is None and out_dtype == dx.dtype:
        return dx
    R = T_ * H
    out = _tl.alloc((1, T_, H, K), out_dtype, dx.device)
    if R == 0:
        return out
    tensors = [dx.contiguous().view(R, G, K)]
    if y is not None:
        assert y.dtype in DTYPES and y.shape[-1] == K and y.numel() == R * K and rstd.numel() == R
        tensors += [y.reshape(R, K).contiguous(), rstd.reshape(R).float().contiguous()]
    build(*builder_args(G, K, dx.dtype, None if y is None else y.dtype, out_dtype))(*tensors, out.view(R, K))
    return out
