"""The SM90 kernel set: which stages the Hopper kernels implement, their limits, and every kernel build a pass
launches for given heads, dims, dtypes and options (`forward_builds`, `backward_builds`, read off the launchers' own
`launcher_builds` tables: what `flashdelta.precompile` compiles and the CPU test tier checks), and the decode
kernel's builds (`decode_builds`).
"""
from __future__ import annotations

from typing import Iterable, Optional

import torch

from ..stages import ANY, KernelSet, Stage
from . import (chunk_bwd, chunk_dstate, decode, fused_fwd, fused_fwd_wide, group_sum, l2norm, prepare, prepare_bwd,
               prepare_common)

# (K, V) head dims the whole SM90 forward handles; others raise (forced backend) or run the portable path.
HEAD_DIMS = tuple(kv for kv in fused_fwd.HEAD_DIMS if kv[0] in prepare_common.SUPPORTED_K)
DTYPES = fused_fwd.DTYPES


# beta / initial-state dtypes the launchers take (float64 goes in as fp32)
PARAM_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

KERNELS = KernelSet(
    "sm90", head_dims=HEAD_DIMS, dtypes=DTYPES, param_dtypes=PARAM_DTYPES,
    l2norm_fwd=l2norm.l2norm_fwd,
    prepare_fwd=prepare.prepare_fwd,
    chunk_fwd=fused_fwd.chunk_fwd,
    state_recompute=Stage(fused_fwd.state_recompute, head_dims=chunk_bwd.HEAD_DIMS),   # for chunk_bwd only
    chunk_bwd=Stage(chunk_bwd.chunk_bwd, head_dims=chunk_bwd.HEAD_DIMS),
    chunk_dstate=Stage(chunk_dstate.chunk_dstate, head_dims=chunk_bwd.HEAD_DIMS),     # CP's backward
    group_sum=group_sum.group_sum,
    prepare_bwd=Stage(prepare_bwd.prepare_bwd, head_dims=ANY),     # per value head and token: any K, V
)


def stage_beta_dtype(beta_dtype: torch.dtype, beta_act: int) -> torch.dtype:
    """The beta dtype of the stages after `prepare_fwd`: with a beta activation (beta_act 1 or 2) the activated beta
    it writes (fp32), else beta as the forward passes it."""
    return torch.float32 if beta_act else beta_dtype


def forward_builds(heads: Iterable[tuple], *, head_dim: tuple, dtype: torch.dtype, beta_dtype: torch.dtype,
                   h0_dtype: torch.dtype, scale: float, initial_state: tuple = (False, True),
                   state_v_first: tuple = (False,), qk_l2norm: bool = True, num_sms: Optional[int] = None,
                   g_dtype: torch.dtype = torch.float32, a_log_dtype: Optional[torch.dtype] = None,
                   dt_bias_dtype: Optional[torch.dtype] = None, beta_act: int = 0) -> list:
    """(label, builder, args) of every kernel the SM90 forward launches for these (H, HV) pairs: the q/k
    normalisation (with qk_l2norm), each build `prepare_fwd` may pick, and the fused kernel with and without an
    initial state in each state layout (at K = V = 128 also its wide builds, `cp_model.wide_pays`). beta_dtype /
    h0_dtype as the forward passes them (`KERNELS.param_dtype`).
    num_sms: the target GPU's SM count (the persistent prepare kernel's grid; None: this machine's GPU, else 132).
    g_dtype, a_log_dtype, dt_bias_dtype, beta_act: `prepare_fwd`'s in-kernel gate and beta activation
    (`prepare.launcher_builds`: an A_log dtype makes g the raw gate in g_dtype, fp32 otherwise; dt_bias None: no
    bias); with beta_act the fused kernel reads the activated beta in fp32 (`stage_beta_dtype`)."""
    K, V = head_dim
    out = l2norm.launcher_builds(K, dtype) if qk_l2norm else []
    gate = dict(g_dtype=g_dtype, a_log_dtype=a_log_dtype, dt_bias_dtype=dt_bias_dtype, beta_act=beta_act)
    chunk_beta = stage_beta_dtype(beta_dtype, beta_act)
    for H, HV in heads:
        out += prepare.launcher_builds(H, HV, K, dtype, beta_dtype, num_sms, **gate)
        out += fused_fwd.launcher_builds(H, HV, K, V, dtype, chunk_beta, h0_dtype, scale, initial_state, state_v_first)
        if (K, V) in fused_fwd_wide.HEAD_DIMS:      # the unsplit inference forward's pick where its CTAs fill waves
            out += fused_fwd.launcher_builds(H, HV, K, V, dtype, chunk_beta, h0_dtype, scale, initial_state,
                                             state_v_first, wide=True)
    return out


def starts_builds(heads: Iterable[tuple], *, head_dim: tuple, dtype: torch.dtype, beta_dtype: torch.dtype,
                  h0_dtype: torch.dtype, scale: float, initial_state: tuple = (False, True),
                  state_v_first: tuple = (False,), beta_act: int = 0) -> list:
    """(label, builder, args) of the training forward's builds that also save the backward's partition start
    states (`fused_fwd.chunk_fwd(partition_starts=...)`, where context parallelism splits the backward alone),
    options as in `forward_builds`."""
    K, V = head_dim
    chunk_beta = stage_beta_dtype(beta_dtype, beta_act)
    return [b for H, HV in heads
            for b in fused_fwd.launcher_builds(H, HV, K, V, dtype, chunk_beta, h0_dtype, scale, initial_state,
                                               state_v_first, partition_starts=True)]


def backward_builds(heads: Iterable[tuple], *, head_dim: tuple, dtype: torch.dtype, beta_dtype: torch.dtype,
                    h0_dtype: torch.dtype, scale: float, initial_state: tuple = (False, True),
                    state_v_first: tuple = (False,), qk_l2norm: bool = True, beta_act: int = 0) -> list:
    """(label, builder, args) of every SM90 kernel the backward launches beyond the forward's (the stages of
    `KERNELS` in `stages.BACKWARD` that the forward does not run; its recompute of `prepare_fwd` takes the forward's
    builds), options as in `forward_builds`; the training forward that saves the chunk states for chunk_bwd
    (`fused_fwd.chunk_fwd(save_states=True)`) and the state recompute that replaces it where it does not; chunk_bwd
    with and without the final state's gradient; none of these where their head dims are not supported (they run on
    the portable path). With beta_act they read the activated beta in fp32."""
    K, V = head_dim
    beta_dtype = stage_beta_dtype(beta_dtype, beta_act)
    out = []
    for H, HV in heads:
        if (K, V) in chunk_bwd.HEAD_DIMS:
            out += fused_fwd.launcher_builds(H, HV, K, V, dtype, beta_dtype, h0_dtype, scale, initial_state,
                                             state_v_first, save_states=True)
            out += fused_fwd.state_recompute_builds(H, HV, K, V, dtype, beta_dtype, h0_dtype, initial_state,
                                                    state_v_first)
            # with and without the final state's gradient: autograd passes None for it where the loss does not use
            # the final state (`autograd._setup_context`: no materialised zeros), the usual training call
            out += chunk_bwd.launcher_builds(H, HV, K, V, dtype, beta_dtype, scale, (False, True), state_v_first)
            out += chunk_dstate.launcher_builds(H, HV, K, V, dtype, beta_dtype, scale)
        # dq and dk from chunk_bwd in q's dtype (summed per key head where it adds the group itself), from the
        # portable chunk_bwd in fp32
        native = (K, V) in chunk_bwd.HEAD_DIMS
        dx_dtype = dtype if native else torch.float32
        out += group_sum.launcher_builds(H, H if native and chunk_bwd.group_add(H, HV) else HV, K, dtype, qk_l2norm,
                                         dx_dtype)
    return out + [b for HV in dict.fromkeys(HV for _, HV in heads) for b in prepare_bwd.launcher_builds(HV)]


def decode_builds(heads: Iterable[tuple], *, head_dim: tuple, dtype: torch.dtype, beta_dtype: torch.dtype,
                  h0_dtype: torch.dtype, scale: float, initial_state: tuple = (True,), state_v_first: tuple = (False,),
                  qk_l2norm: bool = True, varlen: tuple = (False, True), g_dtype: torch.dtype = torch.float32,
                  gate: Optional[tuple] = None, beta_act: int = 0) -> list:
    """(label, builder, args) of the decode kernel (`kernels.decode`, `fused_recurrent_gated_delta_rule`) for these
    (H, HV) pairs: g in g_dtype (fp32 by default), the final state written, dense and varlen input; gate ``(A_log
    dtype, dt_bias dtype or None)`` and beta_act the in-kernel gate and beta activation (`decode.launcher_builds`);
    none where the kernel lacks the head dims or dtype (the portable path runs those calls)."""
    K, V = head_dim
    if decode.unsupported(K, V, dtype, dtype) is not None:
        return []
    return [b for H, HV in heads
            for b in decode.launcher_builds(H, HV, K, V, dtype, beta_dtype=beta_dtype, scale=scale, h0_dtype=h0_dtype,
                                            qk_l2norm=qk_l2norm, initial_state=initial_state,
                                            state_v_first=state_v_first, varlen=varlen, g_dtype=g_dtype, gate=gate,
                                            beta_act=beta_act)]
