"""flashdelta: fused Hopper kernels for Gated DeltaNet chunked prefill, a token-by-token decode path, and a float64
reference.

`import flashdelta` touches no GPU and does not import TileLang.
"""
from .api import chunk_gated_delta_rule, chunk_gdn, warmup
from .dispatch import UnsupportedError
from .recurrent import fused_recurrent_gated_delta_rule, fused_recurrent_gdn

__version__ = "0.1.0.dev0"

__all__ = ["UnsupportedError", "__version__", "chunk_gated_delta_rule", "chunk_gdn", "fused_recurrent_gated_delta_rule",
           "fused_recurrent_gdn", "warmup"]
