"""Inputs of the in-kernel gate and beta activation (`use_gate_in_kernel`, `use_beta_sigmoid_in_kernel`), shared by
the CPU tests (tests/cpu/test_gate_in_kernel.py) and the GPU tests (tests/gpu/test_prepare.py, test_e2e_gpu.py).

The raw gate is the models' projection before the activation: `model_gate`'s decays from it span no decay to a very
hard one across the heads, and a few tokens sit where the activation has edges: above softplus' threshold (x > 20,
where softplus is linear and the decay hits the gate floor), and far below it (softplus ~ 1e-17).
"""
from __future__ import annotations

import torch

from flashdelta.gates import beta_activation, gdn_gate


def gate_params(HV: int, *, generator: torch.Generator) -> tuple:
    """(A_log, dt_bias) ``[HV]`` float64: exp(A_log) spread over [0.05, 16] across the heads, dt_bias ~ N(-1, 0.5)."""
    A_log = torch.linspace(0.05, 16.0, HV, dtype=torch.float64).log()
    dt_bias = torch.randn(HV, generator=generator, dtype=torch.float64) * 0.5 - 1.0
    return A_log, dt_bias


def raw_gate(B: int, T: int, HV: int, *, generator: torch.Generator) -> torch.Tensor:
    """The raw gate ``[B, T, HV]`` float64: N(0, 0.5), with every 37th token at 25 (above the threshold) and every
    41st at -40 on the first heads."""
    a = torch.randn(B, T, HV, generator=generator, dtype=torch.float64) * 0.5
    a[:, ::37, : max(1, HV // 2)] = 25.0
    a[:, 5::41, :2] = -40.0
    return a


def beta_logits(B: int, T: int, HV: int, *, generator: torch.Generator) -> torch.Tensor:
    """beta's logits ``[B, T, HV]`` float64, N(0, 2)."""
    return torch.randn(B, T, HV, generator=generator, dtype=torch.float64) * 2.0


def activated(g_raw, logits, A_log, dt_bias, beta_act: int) -> tuple:
    """(g, beta) in float64 from the raw inputs: what the operator uses (`flashdelta.gates` at float64)."""
    g = gdn_gate(g_raw.double(), A_log.double(), None if dt_bias is None else dt_bias.double())
    beta = beta_activation(logits.double(), beta_act) if beta_act else logits.double()
    return g, beta
