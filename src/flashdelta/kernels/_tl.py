"""TileLang plumbing shared by every Hopper kernel module: target, pass configs, output allocation.

Nothing here runs at import time beyond defining names; `tilelang` itself is imported lazily.
"""
from __future__ import annotations

import functools
import inspect
import os

import torch

SM90_TARGET = {"kind": "cuda", "arch": "sm_90a"}

# Kernels are explicitly synchronised with mbarriers / T.sync_threads; TileLang's own race checker
# flags the producer/consumer patterns as races, so it is off for our kernels.
PASS_CONFIGS = {
    "tl.enable_fast_math": True,
    "tl.disable_data_race_check": True,
}


@functools.lru_cache(maxsize=None)
def tilelang():
    """The tilelang module, imported on first use (import flashdelta never imports it)."""
    import tilelang as tl  # noqa: PLC0415

    return tl


def alloc(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """Allocate a kernel output. With FLASHDELTA_POISON=1 (the tests set it) it is filled with NaN
    (integers with -1), so any element a kernel forgets to write fails the comparison."""
    out = torch.empty(shape, dtype=dtype, device=device)
    if os.environ.get("FLASHDELTA_POISON") == "1":
        out.fill_(float("nan") if dtype.is_floating_point else -1)
    return out


def build_with(builder, args: tuple, names: tuple, switches: dict):
    """`builder(*args)` with some of its trailing parameters `names` (the last len(names) entries of `args`)
    replaced by keyword (development variants). All arguments stay positional, so one switch set has one
    compile-cache key however it was spelled. `args` must fill every parameter and `names` must be the
    builder's trailing parameter names (else a switch would silently land on its neighbour)."""
    unknown = set(switches) - set(names)
    if unknown:
        raise TypeError(f"unknown builder switches {sorted(unknown)}; known: {names}")
    params = _params(builder)
    if len(args) != len(params) or params[len(params) - len(names):] != tuple(names):
        name = getattr(getattr(builder, "func", builder), "__name__", "the builder")
        raise TypeError(f"builder arguments out of step with {name}: "
                        f"{len(args)} args for parameters {params}, switches {names}")
    n = len(names)
    values = dict(zip(names, args[-n:]))
    values.update(switches)
    return builder(*args[:-n], *(values[name] for name in names))


_PARAMS: dict = {}


def _params(builder) -> tuple:
    """Parameter names of a `tilelang.jit` builder (its Python function), in order (cached per builder)."""
    key = id(builder)
    if key not in _PARAMS:
        _PARAMS[key] = tuple(inspect.signature(getattr(builder, "func", builder)).parameters)
    return _PARAMS[key]
