"""Stage `prepare` forward: what its two kernels share (prepare_oneshot.py, prepare_pipe.py; the launcher that picks
one is prepare.py).

Both compute, per chunk and value head, the chunk-local inclusive cumsum of g and the ungated WY inverse

    A = (I + strictly_lower(diag(beta) K K^T))^{-1}                    # [BT, BT], BT = 64

from one `K K^T` per (chunk, key head) on wgmma (fp32 accumulate), kept unscaled in shared memory: beta scales rows on
the fly. The split (`split_gram`) turns it into the inputs of the per-warp inverse (`_ptx.WY_INVERSE_PRELUDE`), which
needs no CTA barrier: the four 16x16 diagonal blocks by forward substitution (fp32, a column per lane), then a block
substitution over the 16x16 blocks below the diagonal on mma.sync with bf16 hi/lo splits of the fp32 operands
(hi*hi + hi*lo + lo*hi, ~1e-6 relative), far below the rounding of the stored A: measured A error equals the bf16
(fp16) rounding of the float64 inverse. A warp inverts one value head, so a 128-thread warpgroup inverts `NW` at once.
Chunks map to CTAs or work items by chunk slot (kernels/_chunks.py); the padding tail writes zeros. Gates below
`numerics.GATE_FLOOR` (-inf included) count as the floor before the cumsum (docs/numerics.md): -inf would make
the fused kernel's gate differences -inf - (-inf) = NaN; NaN gates stay NaN.
"""
# No `from __future__ import annotations`: TileLang evaluates the macro annotations in this scope.
import tilelang.language as T
import torch

from ..numerics import GATE_FLOOR
from . import _tl

F32 = "float32"
BF16 = "bfloat16"
BT = 64
SUPPORTED_K = (64, 128, 256)
DTYPES = (torch.bfloat16, torch.float16)   # k and A
NW = 4                     # value heads inverted at once, one per warp of a 128-thread warpgroup


def floor_gate(x):
    """An fp32 gate value, `GATE_FLOOR` where it is below (docs/numerics.md)."""
    return T.Select(x < T.float32(GATE_FLOOR), T.float32(GATE_FLOOR), x)


def hi(x):
    """bf16 part of an fp32 value (round to nearest)."""
    return T.cast(x, BF16)


def lo(x):
    """bf16 rounding of what `hi` leaves: hi + lo carries ~16 significant bits."""
    return T.cast(x - T.cast(T.cast(x, BF16), F32), BF16)


@T.macro
def split_gram(kk_frag, kkd_shared, l_hi, l_lo):
    """K K^T (the [64, 64] fp32 fragment) -> the per-warp inverse's inputs (`_ptx.WY_INVERSE_PRELUDE`): the four
    16x16 diagonal blocks in fp32, the blocks below the diagonal (rows 16..63, cols 0..47) as bf16 hi/lo."""
    for i, c in T.Parallel(64, 64):
        if i // 16 == c // 16:
            kkd_shared[i // 16, i % 16, c % 16] = kk_frag[i, c]
        if c // 16 < i // 16:
            l_hi[i - 16, c] = hi(kk_frag[i, c])
            l_lo[i - 16, c] = lo(kk_frag[i, c])


def heads_key(H: int, HV: int, heads_per_cta: int) -> int:
    """The builders' `heads_per_cta` for a split of a key head's HV / H value heads: 0 for all of them (one cache key
    for both spellings)."""
    return 0 if heads_per_cta in (0, HV // H) else int(heads_per_cta)


def fwd_outputs(k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, cu_seqlens: torch.Tensor,
                chunk_size: int) -> tuple:
    """Checks `prepare_fwd`'s inputs (either kernel); returns cu_seqlens as int32 and the allocated g_cumsum, A."""
    _, n_tok, H, K = k.shape
    HV = g.shape[-1]
    assert chunk_size == BT and K in SUPPORTED_K and HV % H == 0
    assert k.dtype in DTYPES and g.dtype == torch.float32
    assert k.is_contiguous() and g.is_contiguous() and beta.is_contiguous()
    g_cumsum = _tl.alloc((1, n_tok, HV), torch.float32, k.device)
    A = _tl.alloc((1, n_tok, HV, chunk_size), k.dtype, k.device)
    return _tl.cu_seqlens_int32(cu_seqlens), g_cumsum, A
