"""flashdelta: fused Hopper kernels for Gated DeltaNet chunked prefill, with a float64 reference.

`import flashdelta` touches no GPU and does not import TileLang.
"""
from .api import chunk_gated_delta_rule, warmup
from .dispatch import UnsupportedError

__version__ = "0.1.0.dev0"

__all__ = ["UnsupportedError", "__version__", "chunk_gated_delta_rule", "warmup"]
