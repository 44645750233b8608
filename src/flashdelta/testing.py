"""Input generators shared by the tests, `flashdelta check` and the benchmarks (gates as the models make them)."""
from __future__ import annotations

import torch


def model_gate(T: int, HV: int, *, generator: torch.Generator) -> torch.Tensor:
    """`g = -exp(A_log) * softplus(a + dt_bias)` with exp(A_log) spread over [0, 16]: head 0 never decays,
    the last head decays very hard (docs/numerics.md, "Test gates like the models'"). Shape [T, HV], float64."""
    a_exp = torch.linspace(0.0, 16.0, HV, dtype=torch.float64)
    a = torch.randn(T, HV, generator=generator, dtype=torch.float64) * 0.5
    dt_bias = torch.randn(HV, generator=generator, dtype=torch.float64) * 0.5 - 1.0
    g = -a_exp * torch.nn.functional.softplus(a + dt_bias)
    if HV > 2:
        g[:, 1] = -1e-4 * torch.rand(T, generator=generator, dtype=torch.float64)  # tiny negatives
    return g


def bench_gate(T: int, HV: int, *, generator: torch.Generator) -> torch.Tensor:
    """FlashQLA's benchmark gate: logsigmoid(randn)/16 on 75% of heads, 0 on the rest."""
    g = torch.nn.functional.logsigmoid(torch.randn(T, HV, generator=generator, dtype=torch.float64)) / 16
    g[:, : HV // 4] = 0.0
    return g
