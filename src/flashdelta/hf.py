"""Hugging Face transformers models on flashdelta: the Gated DeltaNet layers of Qwen3-Next (transformers 5.x, whose
modeling module calls its module-level ``torch_chunk_gated_delta_rule`` for prefill and training and
``torch_recurrent_gated_delta_rule`` for one-token decode steps).

    from transformers.models.qwen3_next import modeling_qwen3_next
    import flashdelta.hf
    flashdelta.hf.patch(modeling_qwen3_next)     # every Qwen3-Next model now runs its GDN layers on flashdelta

`patch` points those two names at `flashdelta.chunk_gated_delta_rule` and `flashdelta.fused_recurrent_gated_delta_rule`
(same calling convention: q, k, v positionally, FLA's keywords), dropping the keyword arguments transformers passes
that they do not take (``use_cache``, ``output_router_logits``, ...), as transformers' own wrapper does. Nothing here
imports transformers.
"""
from __future__ import annotations

import functools
import inspect
from types import ModuleType
from typing import Optional

from .api import chunk_gated_delta_rule
from .recurrent import fused_recurrent_gated_delta_rule

__all__ = ["NAMES", "patch", "unpatch"]

# the module-level names a transformers GDN modeling module calls, and the flashdelta function for each
NAMES = {"torch_chunk_gated_delta_rule": chunk_gated_delta_rule,
         "torch_recurrent_gated_delta_rule": fused_recurrent_gated_delta_rule}


def _taking_known_keywords(fn):
    """`fn`, dropping the keyword arguments it has no parameter for."""
    names = frozenset(inspect.signature(fn).parameters)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        return fn(*args, **{k: v for k, v in kwargs.items() if k in names})

    return call


def patch(module: ModuleType, functions: Optional[dict] = None) -> dict:
    """Route `module`'s GDN calls (a transformers modeling module such as ``modeling_qwen3_next``) to flashdelta, or
    to `functions` (``{name: function}`` for names of `NAMES`, e.g. the float64 reference for both).
    Returns the functions it replaced, by name (`unpatch` puts them back); patching twice keeps the first originals.
    Raises TypeError for a module that has neither name."""
    if not isinstance(module, ModuleType):
        raise TypeError(f"module must be a Python module (e.g. transformers.models.qwen3_next.modeling_qwen3_next), "
                        f"got {type(module).__name__}")
    found = [n for n in NAMES if hasattr(module, n)]
    if not found:
        raise TypeError(f"module {module.__name__} has none of {sorted(NAMES)}: not a transformers Gated DeltaNet "
                        f"modeling module this version of flashdelta knows")
    originals = {}
    for name in found:
        current = getattr(module, name)
        originals[name] = getattr(current, "flashdelta_original", current)
        call = _taking_known_keywords((functions or NAMES)[name])
        call.flashdelta_original = originals[name]
        setattr(module, name, call)
    return originals


def unpatch(module: ModuleType, originals: dict) -> None:
    """Put back the functions `patch` returned."""
    for name, fn in originals.items():
        setattr(module, name, fn)
