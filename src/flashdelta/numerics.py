"""Numerical constants shared by every backend, and the error metric and tolerance table shared by the tests,
`flashdelta check` and the benchmark gate (docs/numerics.md).

Relative L2 error `||x - ref|| / ||ref||` against the float64 reference. Bounds are for bf16/fp16 inputs:
1e-2 for o, states and dq/dk/dv/dh0; 2e-2 for the gate-derived gradients dg and dbeta, which sum many
products of exponentials (dg) or pass through the WY inverse (dbeta).
"""
from __future__ import annotations

import math

import torch

# Gates below GATE_FLOOR (-inf included) are treated as GATE_FLOOR, before the chunk-local cumsum, by every
# backend. A gate of -inf (a full state reset) would otherwise make the cumsum differences G_i - G_j of later
# tokens -inf - (-inf) = NaN, and a very large finite one would absorb the later gates of its chunk in the
# fp32 cumsum. exp(-100) = 3.7e-44 is below fp32's smallest normal number (1.2e-38), so the state is reset
# exactly in fp32; at float64 the result deviates from the exact reset by less than 4e-44 relative. NaN gates
# stay NaN (only values < GATE_FLOOR are replaced).
GATE_FLOOR = -100.0

TOLS = {
    "o": 1e-2, "ht": 1e-2, "h": 1e-2, "A": 1e-2, "g_cumsum": 1e-5,
    "qk_l2norm": 1e-2, "rstd": 1e-5,
    "dq": 1e-2, "dk": 1e-2, "dv": 1e-2, "dh0": 1e-2,
    "dg": 2e-2, "dbeta": 2e-2,
}


def accum_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """The dtype states, gates and accumulations take: fp32, or float64 where any of `dtypes` is float64 (the
    float64 twins and gradcheck run the same code at float64)."""
    return torch.float64 if torch.float64 in dtypes else torch.float32


def rel_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    """`||out - ref|| / ||ref||` in float64 (0 when both are all-zero; inf when only ref is); NaN in out -> nan.
    Computed on out's device (a full-size comparison of GPU tensors moves nothing to the host)."""
    out64 = out.detach().double()
    ref64 = ref.detach().to(device=out64.device, dtype=torch.float64)
    den = ref64.norm().item()
    num = (out64 - ref64).norm().item()
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / den
