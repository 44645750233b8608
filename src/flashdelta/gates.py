"""The gate and beta transforms that FLA's ``use_gate_in_kernel`` and ``use_beta_sigmoid_in_kernel`` options apply,
in PyTorch, before the stages (docs/stages.md): the stages always take the log decay g and the write strength beta.

Both are plain differentiable torch ops, so autograd carries the gradients to the raw gate, ``A_log``, ``dt_bias`` and
the beta logits, eagerly and under torch.compile. They compute in fp32 (float64 when an input is float64), as the gate
is fp32 end to end (docs/numerics.md).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["beta_sigmoid", "gdn_gate"]


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
    return -torch.exp(A_log.to(dtype)) * F.softplus(x)


def beta_sigmoid(beta: Tensor, allow_neg_eigval: bool = False) -> Tensor:
    """beta from its logits: ``sigmoid(beta)``, or ``2 * sigmoid(beta)`` (in ``(0, 2)``: the state transition may have
    negative eigenvalues) with `allow_neg_eigval`. Returns fp32 (float64 for float64 beta)."""
    y = torch.sigmoid(beta.to(_compute_dtype(beta)))
    return y * 2.0 if allow_neg_eigval else y
