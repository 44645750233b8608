"""Stage `prepare` forward, the launcher: chunk-local gate cumsum and the ungated WY inverse A by one of two kernels
with bit-identical results (the math, and the in-kernel gate and beta activation they apply on load, are in
prepare_common.py):

- the one-shot kernel (prepare_oneshot.py): a CTA per (chunk slot, key head), its four warps inverting up to four
  value heads at once; on small grids with more than four value heads per key head their heads are split over CTAs
  (`pick_heads_per_cta`);
- the persistent kernel (prepare_pipe.py): CTAs walking work items with a producer warp prefetching the key tiles,
  taken at `PIPE_GVA` value heads per key head when each CTA walks at least `PIPE_MIN_ITEMS` items (`use_pipe`).

`launcher_builds` lists every build `prepare_fwd` may launch for a head configuration (what `flashdelta.warmup`
compiles). docs/fused_fwd.md ("The prepare kernel") has the measurements behind these choices.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import _tl, prepare_oneshot, prepare_pipe
from .prepare_common import BT, G_DTYPES, NW, fwd_outputs

# Where the persistent kernel runs: value heads per key head in PIPE_GVA, and at least PIPE_MIN_ITEMS work items per
# persistent CTA. (H200 grid: GVA 1 -2..-7% and GVA 3 -2..-6% of a row's time where the CTAs walk several items, +1..+3%
# on short single sequences; GVA 2 -1% on long rows, +2..+4.5% on short ones; GVA 4 prepare itself +25..30%.)
PIPE_GVA = (1, 3)
PIPE_MIN_ITEMS = 3


def heads_per_cta_options(H: int, HV: int) -> tuple:
    """The value-heads-per-CTA splits a caller may ask for, most first: HV / H, half of it (if even), 1."""
    G = HV // H
    return tuple(dict.fromkeys(x for x in (G, G // 2 if G % 2 == 0 else G, 1)))


def launcher_heads_per_cta(H: int, HV: int) -> tuple:
    """The values `pick_heads_per_cta` can return for these heads."""
    G = HV // H
    return (G,) if G <= NW else (G, max(h for h in heads_per_cta_options(H, HV) if h <= NW))


def pick_heads_per_cta(H: int, HV: int, n_tok: int, num_sms: int = _tl.DEFAULT_NUM_SMS) -> int:
    """Value heads per CTA of the one-shot kernel for a call. A CTA's warps invert `NW` heads at once, so up to `NW`
    heads cost a CTA no more time than one: all of a key head's (HV / H) whenever they take one round. With more, a
    small grid (the chunks fit one wave of `MIN_BLOCKS` CTAs per SM, where a CTA's lifetime is the kernel's time)
    takes the most heads per CTA (of `heads_per_cta_options`) that need one round; a CTA then repeats the key tile
    load and K K^T."""
    options = launcher_heads_per_cta(H, HV)
    if len(options) == 1:
        return options[0]
    chunks = -(-n_tok // BT)
    return options[1] if chunks * HV // options[1] <= prepare_oneshot.MIN_BLOCKS * num_sms else options[0]


def use_pipe(H: int, HV: int, K: int, n_tok: int, n_seqs: int, num_sms: int) -> bool:
    """Whether `prepare_fwd` takes the persistent kernel for a call (`PIPE_GVA`, `PIPE_MIN_ITEMS`); host shapes
    only."""
    if HV // H not in PIPE_GVA:
        return False
    items = (n_tok // BT + n_seqs + 1) * H
    return items >= PIPE_MIN_ITEMS * num_sms * prepare_pipe.blocks_per_sm(K, HV // H)


def options(g_dtype: torch.dtype = torch.float32, a_log_dtype: Optional[torch.dtype] = None,
            dt_bias_dtype: Optional[torch.dtype] = None, beta_act: int = 0) -> tuple:
    """The builders' option arguments (`prepare_common.option_args`) from dtypes: the gate's, A_log's and dt_bias'
    as the launcher passes them (float64 goes in as fp32; None: absent), and beta_act."""
    name = lambda dt: None if dt is None else _tl.TL_DTYPE[_kernel_dtype(dt)]  # noqa: E731
    return name(g_dtype), name(a_log_dtype), name(dt_bias_dtype), int(beta_act)


def _kernel_dtype(dtype: torch.dtype) -> torch.dtype:
    return dtype if dtype in G_DTYPES else torch.float32


def _label(opts: tuple) -> str:
    g_dtype, a_log_dtype, dt_bias_dtype, beta_act = opts
    gate = "" if a_log_dtype is None else f" gate(g {g_dtype}, A_log {a_log_dtype}, dt_bias {dt_bias_dtype})"
    return gate + (f" beta_act={beta_act}" if beta_act else "")


def launcher_builds(H: int, HV: int, K: int, k_dtype: torch.dtype, beta_dtype: torch.dtype,
                    num_sms: Optional[int] = None, *, g_dtype: torch.dtype = torch.float32,
                    a_log_dtype: Optional[torch.dtype] = None, dt_bias_dtype: Optional[torch.dtype] = None,
                    beta_act: int = 0, norms: bool = False) -> list:
    """(label, builder, args) of every kernel `prepare_fwd` may launch for these heads: the one-shot kernel's
    heads-per-CTA splits and, for `PIPE_GVA`, the persistent kernel. num_sms (the persistent kernel's grid): this
    machine's GPU if there is one, else 132 (H100 SXM, H200). The options as `prepare_fwd` takes them: the gate's
    dtype (fp32 without the in-kernel gate), A_log's and dt_bias' (None: no in-kernel gate, no bias), beta_act;
    norms: the builds that also write the squared key norms (`prepare_fwd(norms=True)`)."""
    opts = options(g_dtype, a_log_dtype, dt_bias_dtype, beta_act)
    label = _label(opts) + (" norms" if norms else "")
    out = [(f"prepare_fwd H={H} HV={HV} K={K} heads/CTA={hpc}{label}", prepare_oneshot.build,
            prepare_oneshot.builder_args(H, HV, K, k_dtype, beta_dtype, hpc, opts, norms=norms))
           for hpc in launcher_heads_per_cta(H, HV)]
    if HV // H in PIPE_GVA:
        num_sms = _tl.num_sms() if num_sms is None else num_sms
        out.append((f"prepare_fwd H={H} HV={HV} K={K} persistent{label}", prepare_pipe.build,
                    prepare_pipe.builder_args(H, HV, K, k_dtype, beta_dtype, num_sms=num_sms, options=opts,
                                              norms=norms)))
    return out


def prepare_fwd(k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, cu_seqlens: torch.Tensor, *,
                chunk_size: int = 64, A_log: Optional[torch.Tensor] = None, dt_bias: Optional[torch.Tensor] = None,
                beta_act: int = 0, persistent: Optional[bool] = None, heads_per_cta: Optional[int] = None,
                norms: bool = False) -> tuple:
    """Chunk-local gate cumsum and the per-chunk WY inverse (docs/stages.md `prepare_fwd`), with the in-kernel gate
    and beta activations.

    Args:
        k: ``[1, T, H, K]`` bf16/fp16, K in (64, 128, 256).
        g: ``[1, T, HV]`` fp32 log decays; with A_log the raw gate, bf16/fp16/fp32.
        beta: ``[1, T, HV]`` any float dtype; with beta_act its logits.
        cu_seqlens: ``[N + 1]`` int32 (int64 is converted on the device).
        A_log, dt_bias: ``[HV]`` any float dtype (float64 goes in as fp32): the in-kernel gate
            ``g = -exp(A_log) * softplus(g + dt_bias)`` (softplus(x) = x above 20), fp32; A_log None: off; dt_bias
            None: no bias.
        beta_act: 1 or 2: beta is ``beta_act * sigmoid(beta)`` (fp32); 0: as given.
        persistent: which kernel (bit-identical results): True the persistent one, False the one-shot one; None the
            launcher's pick (`use_pipe`).
        heads_per_cta: value heads per CTA (one-shot) or work item (persistent), a divisor of HV / H; None: the
            launcher's pick (`pick_heads_per_cta`; all of them for the persistent kernel).
        norms: also return, last, the squared key norms ``[1, T, H]`` fp32 (K K^T's diagonal; unset on the padding
            tail): context parallelism's warm-up condition reads them instead of k (`flashdelta.cp.windows`).

    Returns:
        g_cumsum ``[1, T, HV]`` fp32 (0 on padding), and A ``[1, T, HV, BT]`` in k's dtype: token
        ``chunk_start + i`` holds row i of ``(I + strictly_lower(diag(beta) K K^T))^{-1}``; with beta_act, a third
        tensor: the activated beta ``[1, T, HV]`` fp32 (0 on padding); with norms the key norms last.
    """
    _, n_tok, H, K = k.shape
    HV = g.shape[-1]
    if heads_per_cta is not None and (heads_per_cta < 1 or (HV // H) % heads_per_cta):
        raise ValueError(f"heads_per_cta: must divide HV / H = {HV // H}; got {heads_per_cta}")
    assert dt_bias is None or A_log is not None
    if A_log is not None:       # the raw gate and the gate's parameters as the kernels take them
        g, A_log, dt_bias = (None if x is None else x.to(_kernel_dtype(x.dtype)).contiguous()
                             for x in (g, A_log, dt_bias))
    cu_seqlens, g_cumsum, A, beta_out = fwd_outputs(k, g, beta, cu_seqlens, chunk_size, A_log, beta_act)
    k_norm2 = _tl.alloc((1, n_tok, H), torch.float32, k.device) if norms else None
    out = (g_cumsum, A) + ((beta_out,) if beta_out is not None else ()) + ((k_norm2,) if norms else ())
    if n_tok == 0:
        return out
    num_sms = _tl.num_sms(k.device)
    if persistent is None:
        persistent = heads_per_cta is None and use_pipe(H, HV, K, n_tok, cu_seqlens.shape[0] - 1, num_sms)
    tensors = (k, g, beta, A_log, dt_bias, cu_seqlens, g_cumsum, A, beta_out)
    if persistent:
        prepare_pipe.launch(*tensors, num_sms=num_sms, heads_per_cta=heads_per_cta or 0, beta_act=beta_act,
                            k_norm2=k_norm2)
    else:
        hpc = pick_heads_per_cta(H, HV, n_tok, num_sms) if heads_per_cta is None else heads_per_cta
        prepare_oneshot.launch(*tensors, heads_per_cta=hpc, beta_act=beta_act, k_norm2=k_norm2)
    return out
