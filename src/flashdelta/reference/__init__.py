"""Float64 references, torch only, run anywhere.

- `recurrent`: the token-by-token recurrence, the ground truth (autograd of it is the gradient truth);
- `chunked`: float64 twins of the internal stages (docs/stages.md);
- `cp`: context parallelism (partitions, exact (E, M) scan, gate-driven warm-up) in float64.
"""
from . import chunked, cp, recurrent
from .recurrent import recurrent_gated_delta_rule

__all__ = ["recurrent_gated_delta_rule", "recurrent", "chunked", "cp"]
