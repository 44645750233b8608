"""The gate and beta activations of FLA's ``use_gate_in_kernel`` and ``use_beta_sigmoid_in_kernel`` options, in
PyTorch, and their explicit backward.

The stage `prepare_fwd` takes the options (docs/stages.md): the SM90 prepare kernels compute the activations as they
load g and beta; the portable path and its float64 twin call `gdn_gate` and `beta_activation` here; the token-by-token
recurrence (`flashdelta.recurrent`'s portable loop) uses them too. The backward of the chunked operator computes the
activations' gradients explicitly (`gdn_gate_bwd`, `beta_activation_bwd`, docs/stages.md "The activations'
backward"); the forward functions are also plain differentiable torch ops, so autograd through them is the
reference the tests check the explicit backward against.

Everything computes in fp32 (float64 when an input is float64), as the gate is fp32 end to end (docs/numerics.md).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["BETA_ACTS", "SOFTPLUS_THRESHOLD", "beta_act_code", "beta_activation", "beta_activation_bwd",
           "beta_sigmoid", "gdn_gate", "gdn_gate_bwd"]

SOFTPLUS_THRESHOLD = 20.0   # softplus(x) = x above it (torch's and FLA's threshold)
BETA_ACTS = (0, 1, 2)       # beta as given, sigmoid(beta), 2 * sigmoid(beta)


def _compute_dtype(*xs: Optional[Tensor]) -> torch.dtype:
    dtype = torch.float32
    for x in xs:
        if x is not None:
            dtype = torch.promote_types(dtype, x.dtype)
    return dtype


def gdn_gate(g: Tensor, A_log: Tensor, dt_bias: Optional[Tensor] = None) -> Tensor:
    """The Gated DeltaNet log decay from the raw gate: ``-exp(A_log) * softplus(g + dt_bias)``.

    g ``[..., HV]`` (the model's projection, before activation), A_log and dt_bias ``[HV]``. softplus is
    ``log(1 + exp(x))``, and ``x`` above 20 (torch's and FLA's threshold). Returns fp32 (float64 for float64 inputs).
    """
    dtype = _compute_dtype(g, A_log, dt_bias)
    x = g.to(dtype)
    if dt_bias is not None:
        x = x + dt_bias.to(dtype)
    return -torch.exp(A_log.to(dtype)) * F.softplus(x, threshold=SOFTPLUS_THRESHOLD)


def gdn_gate_bwd(dg: Tensor, g: Tensor, A_log: Tensor, dt_bias: Optional[Tensor] = None) -> tuple:
    """The gradients of `gdn_gate` from dg, the gradient w.r.t. its output (``[..., HV]``; 0 on padding tokens):

        dg_raw   = dg * (-exp(A_log) * sigmoid(g + dt_bias))    (softplus' derivative; 1 above the threshold)
        dA_log   = sum over tokens of dg * gdn_gate(g)
        ddt_bias = sum over tokens of dg_raw

    Returns ``(dg_raw, dA_log, ddt_bias)`` in the compute dtype (fp32; float64 for float64 inputs); ddt_bias is None
    without dt_bias. The gate floor (docs/numerics.md) is not differentiated: as for a pre-activated g, the gradient
    of a floored gate is the gradient of the floor's input.
    """
    dtype = _compute_dtype(dg, g, A_log, dt_bias)
    x = g.to(dtype)
    if dt_bias is not None:
        x = x + dt_bias.to(dtype)
    dg = dg.to(dtype)
    neg_a = -torch.exp(A_log.to(dtype))
    slope = torch.where(x > SOFTPLUS_THRESHOLD, torch.ones((), dtype=dtype, device=x.device), torch.sigmoid(x))
    dg_raw = dg * slope * neg_a
    tokens = tuple(range(dg.dim() - 1))
    dA_log = (dg * F.softplus(x, threshold=SOFTPLUS_THRESHOLD)).sum(tokens) * neg_a
    ddt_bias = dg_raw.sum(tokens) if dt_bias is not None else None
    return dg_raw, dA_log, ddt_bias


def beta_act_code(use_beta_sigmoid_in_kernel: bool, allow_neg_eigval: bool) -> int:
    """The stages' ``beta_act`` of FLA's two flags: 0 (beta as given), 1 (sigmoid), 2 (2 * sigmoid)."""
    return (2 if allow_neg_eigval else 1) if use_beta_sigmoid_in_kernel else 0


def beta_activation(beta: Tensor, beta_act: int) -> Tensor:
    """beta from its logits: ``sigmoid(beta)`` (beta_act 1) or ``2 * sigmoid(beta)`` (beta_act 2: in ``(0, 2)``, the
    state transition may have negative eigenvalues). Returns fp32 (float64 for float64 beta)."""
    if beta_act not in BETA_ACTS[1:]:
        raise ValueError(f"beta_act: must be 1 (sigmoid) or 2 (2 * sigmoid), got {beta_act!r}")
    y = torch.sigmoid(beta.to(_compute_dtype(beta)))
    return y * 2.0 if beta_act == 2 else y


def beta_activation_bwd(dbeta: Tensor, beta: Tensor, beta_act: int) -> Tensor:
    """The gradient w.r.t. the logits from dbeta and the activated beta (`beta_activation`'s output, 0 where the
    logits' gradient is 0): ``dbeta * beta * (1 - beta / beta_act)``, the derivative of ``beta_act * sigmoid``."""
    dtype = _compute_dtype(dbeta, beta)
    b = beta.to(dtype)
    return dbeta.to(dtype) * b * (1.0 - b / float(beta_act))


def beta_sigmoid(beta: Tensor, allow_neg_eigval: bool = False) -> Tensor:
    """`beta_activation` by FLA's flag: ``sigmoid(beta)``, or ``2 * sigmoid(beta)`` with `allow_neg_eigval`."""
    return beta_activation(beta, 2 if allow_neg_eigval else 1)
