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

The in-kernel activations (docs/stages.md `prepare_fwd`): builds with an A_log dtype read the raw gate (bf16, fp16 or
fp32) and compute ``g = -exp(A_log) softplus(g + dt_bias)`` in fp32 as they load it (`GATE_PRELUDE`'s `fd_gdn_gate`,
softplus linear above `gates.SOFTPLUS_THRESHOLD`), then floor it; builds with a beta activation (`beta_act` 1 or 2)
read logits and compute ``beta_act * sigmoid(x)`` (`fd_beta_act`), and store the activated beta (fp32) for the
stages after them. Both kernels call the same device functions, so their results stay bit-identical.
"""
# No `from __future__ import annotations`: TileLang evaluates the macro annotations in this scope.
import tilelang.language as T
import torch

from ..gates import BETA_ACTS, SOFTPLUS_THRESHOLD
from ..numerics import GATE_FLOOR
from . import _tl

F32 = "float32"
BF16 = "bfloat16"
BT = 64
SUPPORTED_K = (64, 128, 256)
DTYPES = (torch.bfloat16, torch.float16)   # k and A
NW = 4                     # value heads inverted at once, one per warp of a 128-thread warpgroup


G_DTYPES = (torch.bfloat16, torch.float16, torch.float32)   # the raw gate, beta, A_log and dt_bias of the options

_FLOOR = f"{GATE_FLOOR!r}f"
GATE_PRELUDE = r"""
// prepare_fwd's in-kernel activations (fp32): the Gated DeltaNet gate from the raw gate, floored, and beta's sigmoid
__device__ __forceinline__ float fd_gdn_gate(float g, float a_log, float bias) {
  const float x = g + bias;
  const float y = -expf(a_log) * (x > """ + f"{SOFTPLUS_THRESHOLD!r}f" + r""" ? x : log1pf(expf(x)));
  return y < """ + _FLOOR + " ? " + _FLOOR + r""" : y;
}
__device__ __forceinline__ float fd_beta_act(float x, float act) { return act / (1.f + expf(-x)); }
// the persistent kernel's gate cumsum of G adjacent value heads (as _ptx's fd_gate_cumsum) from the raw gate:
// every load issued first, fd_gdn_gate on each, then _ptx's fd_scan64_store (zero: all 0)
template <int G, bool BIAS, typename TG, typename TA, typename TB>
__device__ __forceinline__ void fd_gdn_gate_cumsum(const TG* g, float* gc, long long pitch, int rows, bool zero,
                                                   int lane, const TA* a_log, const TB* dt_bias) {
  float x0[G], x1[G];
  #pragma unroll
  for (int j = 0; j < G; ++j) {
    const float a = static_cast<float>(a_log[j]);
    const float b = BIAS ? static_cast<float>(dt_bias[j]) : 0.f;
    x0[j] = !zero && lane < rows ? fd_gdn_gate(static_cast<float>(g[lane * pitch + j]), a, b) : 0.f;
    x1[j] = !zero && lane + 32 < rows ? fd_gdn_gate(static_cast<float>(g[(lane + 32) * pitch + j]), a, b) : 0.f;
  }
  fd_scan64_store<G>(x0, x1, gc, pitch, rows, lane);
}
"""


def floor_gate(x):
    """An fp32 gate value, `GATE_FLOOR` where it is below (docs/numerics.md)."""
    return T.Select(x < T.float32(GATE_FLOOR), T.float32(GATE_FLOOR), x)


def gate_mode(a_log_dtype, dt_bias_dtype) -> int:
    """A build's in-kernel gate from its option arguments: 0 none (g is the log decay), 1 with A_log, 2 with A_log and
    dt_bias. (Inside a prim_func an absent buffer is not None, so the kernels branch on this.)"""
    return 0 if a_log_dtype is None else 1 if dt_bias_dtype is None else 2


def gate_load(g, t, hv, A_log, dt_bias, gate: int):
    """The floored fp32 log decay of token t, value head hv: g's value (gate 0), or `fd_gdn_gate` of the raw gate
    (`gate_mode`)."""
    if gate == 0:
        return floor_gate(g[0, t, hv])
    bias = T.cast(dt_bias[hv], F32) if gate == 2 else T.float32(0)
    return T.call_extern(F32, "fd_gdn_gate", T.cast(g[0, t, hv], F32), T.cast(A_log[hv], F32), bias)


def beta_load(beta, t, hv, beta_act: int):
    """beta of token t, value head hv in fp32: as given (beta_act 0), or `fd_beta_act` of the logit."""
    x = T.cast(beta[0, t, hv], F32)
    return x if beta_act == 0 else T.call_extern(F32, "fd_beta_act", x, T.float32(beta_act))


def gate_cumsum(G: int, g, g_cumsum, t0, hv0, HV: int, rows, zero, lane, A_log, dt_bias, gate: int):
    """The persistent kernel's whole-warp gate cumsum call for G value heads from hv0 over rows [t0, t0 + rows):
    `_ptx`'s fd_gate_cumsum, or with the in-kernel gate (`gate_mode`) `fd_gdn_gate_cumsum`."""
    t = T.cast(t0, "int64")
    if gate == 0:
        return T.call_extern("handle", f"fd_gate_cumsum<{G}>", T.address_of(g[0, t, hv0]),
                             T.address_of(g_cumsum[0, t, hv0]), T.cast(HV, "int64"), rows, zero, lane)
    bias = dt_bias if gate == 2 else A_log        # (not read without dt_bias)
    return T.call_extern("handle", f"fd_gdn_gate_cumsum<{G}, {'true' if gate == 2 else 'false'}>",
                         T.address_of(g[0, t, hv0]), T.address_of(g_cumsum[0, t, hv0]), T.cast(HV, "int64"), rows,
                         zero, lane, T.address_of(A_log[hv0]), T.address_of(bias[hv0]))


def option_args(g: torch.Tensor, A_log, dt_bias, beta_act: int) -> tuple:
    """The builders' option arguments (compile-cache key) of a call: the gate's dtype, A_log's and dt_bias' (None:
    absent), beta_act."""
    name = lambda x: None if x is None else _tl.TL_DTYPE[x.dtype]  # noqa: E731
    return name(g), name(A_log), name(dt_bias), int(beta_act)


def check_options(g_dtype: str, a_log_dtype, dt_bias_dtype, beta_act: int) -> None:
    """A build's option arguments: the raw gate only with the in-kernel gate, dt_bias only with A_log."""
    assert beta_act in BETA_ACTS and (dt_bias_dtype is None or a_log_dtype is not None)
    assert g_dtype == F32 or a_log_dtype is not None, "a pre-activated gate is fp32"


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
                chunk_size: int, A_log=None, beta_act: int = 0) -> tuple:
    """Checks `prepare_fwd`'s inputs (either kernel); returns cu_seqlens as int32 and the allocated g_cumsum, A and
    (with beta_act) the activated beta, else None."""
    _, n_tok, H, K = k.shape
    HV = g.shape[-1]
    assert chunk_size == BT and K in SUPPORTED_K and HV % H == 0 and beta_act in BETA_ACTS
    assert k.dtype in DTYPES and (g.dtype == torch.float32 or (A_log is not None and g.dtype in G_DTYPES))
    assert k.is_contiguous() and g.is_contiguous() and beta.is_contiguous()
    g_cumsum = _tl.alloc((1, n_tok, HV), torch.float32, k.device)
    A = _tl.alloc((1, n_tok, HV, chunk_size), k.dtype, k.device)
    beta_out = _tl.alloc((1, n_tok, HV), torch.float32, k.device) if beta_act else None
    return _tl.cu_seqlens_int32(cu_seqlens), g_cumsum, A, beta_out
