"""A pytest plugin that runs FLA's own GDN op tests (flash-linear-attention's ``tests/ops/test_gdn.py``) with FLA's
``chunk_gated_delta_rule`` and ``fused_recurrent_gated_delta_rule`` replaced by flashdelta's (`bench/dev/fla_tests.sh`
loads it with ``-p fla_swap``).

Every name FLA exports them under (``fla``, ``fla.ops``, ``fla.ops.gated_delta_rule`` and its ``chunk`` /
``fused_recurrent`` modules) points at flashdelta's function before the test file is imported, so its
``from fla.ops.gated_delta_rule import ...`` binds flashdelta's; the collected test modules are checked (and patched)
again. Arguments go through unchanged: the stand-in only counts the call and which backend ran it. FLA's references
(``naive_recurrent_gated_delta_rule``, ``naive_gdn_gate``) and tolerances (``fla.utils.assert_close``) stay FLA's.

``FLA_DISABLE_BACKEND_DISPATCH=1`` is set (unless the caller set it): FLA's test file skips its GVA cases (HV != H)
otherwise, because FLA's TileLang backend lacks them; with the function replaced that skip has no reason.

Without CUDA (a CPU study run: FLA imports with Triton installed, but no Triton kernel runs in these tests), FLA's
``device`` is set to ``cpu`` when the plugin loads, before FLA's conftest and test file read it; flashdelta then
runs its portable path against FLA's PyTorch references.

At the end the plugin prints the calls per function and backend, and the pass / fail / skip counts per test
function.
"""
from __future__ import annotations

import collections
import functools
import os
import sys

import pytest

NAMES = ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule")
MODULES = ("fla", "fla.ops", "fla.ops.gated_delta_rule", "fla.ops.gated_delta_rule.chunk",
           "fla.ops.gated_delta_rule.fused_recurrent")

calls: collections.Counter = collections.Counter()       # (function, backend) -> calls
outcomes: dict = collections.defaultdict(collections.Counter)     # test function -> outcome -> count


def _chunk_backend(args, kwargs) -> str:
    from flashdelta import dispatch

    q = kwargs.get("q", args[0] if args else None)
    v = kwargs.get("v", args[2] if len(args) > 2 else None)
    if q is None or v is None:
        return "?"
    import torch

    tensors = [x for x in list(args) + list(kwargs.values()) if isinstance(x, torch.Tensor)]
    need_bwd = torch.is_grad_enabled() and any(x.requires_grad for x in tensors)
    try:
        fwd, bwd = dispatch.resolve(q.device, q.shape[-1], v.shape[-1], q.dtype, need_bwd=need_bwd)
    except dispatch.UnsupportedError as error:
        return f"unsupported ({error})"
    return f"fwd={fwd} bwd={bwd}" if need_bwd else f"fwd={fwd}"


def _swapped_chunk():
    import flashdelta

    @functools.wraps(flashdelta.chunk_gated_delta_rule)
    def chunk_gated_delta_rule(*args, **kwargs):
        calls[("chunk_gated_delta_rule", _chunk_backend(args, kwargs))] += 1
        return flashdelta.chunk_gated_delta_rule(*args, **kwargs)

    return chunk_gated_delta_rule


def _swapped_recurrent():
    import flashdelta
    from flashdelta import recurrent

    @functools.wraps(flashdelta.fused_recurrent_gated_delta_rule)
    def fused_recurrent_gated_delta_rule(*args, **kwargs):
        seen = []
        path = recurrent._kernel_path

        def spy(*a, **k):
            seen.append(path(*a, **k))
            return seen[-1]

        recurrent._kernel_path = spy
        try:
            return flashdelta.fused_recurrent_gated_delta_rule(*args, **kwargs)
        finally:
            recurrent._kernel_path = path
            calls[("fused_recurrent_gated_delta_rule", "sm90 decode kernel" if seen and seen[0] else "torch")] += 1

    return fused_recurrent_gated_delta_rule


SWAPS: dict = {}


def _cpu_device() -> None:
    """FLA's device for a machine without CUDA: ``cpu`` (FLA picks ``cuda`` from Triton's default target)."""
    import torch

    if torch.cuda.is_available():
        return
    import fla.utils
    import fla.utils.hardware

    for module in (fla.utils, fla.utils.hardware):
        module.device, module.device_torch_lib = "cpu", torch.cpu


_cpu_device()


def _patch(module) -> None:
    for name in NAMES:
        if hasattr(module, name):
            setattr(module, name, SWAPS[name])


def pytest_configure(config):
    os.environ.setdefault("FLA_DISABLE_BACKEND_DISPATCH", "1")
    import importlib

    SWAPS.update(chunk_gated_delta_rule=_swapped_chunk(), fused_recurrent_gated_delta_rule=_swapped_recurrent())
    for name in MODULES:
        _patch(importlib.import_module(name))


def pytest_collection_modifyitems(session, config, items):
    for module in {item.module for item in items if getattr(item, "module", None) is not None}:
        for name in NAMES:
            if hasattr(module, name) and getattr(module, name) is not SWAPS[name]:
                print(f"fla_swap: {module.__name__}.{name} was FLA's; patched", file=sys.stderr)
        _patch(module)


def pytest_runtest_logreport(report):
    if report.when == "call" or (report.when == "setup" and not report.passed):
        func = report.nodeid.split("::")[-1].split("[")[0]
        outcomes[func][report.outcome] += 1


def pytest_terminal_summary(terminalreporter):
    tr = terminalreporter
    tr.section("flashdelta in FLA's GDN tests")
    for (fn, backend), n in sorted(calls.items()):
        tr.write_line(f"{fn:<34} {backend:<40} {n:>5} calls")
    total = collections.Counter()
    for func, c in sorted(outcomes.items()):
        total.update(c)
        tr.write_line(f"{func:<48} " + "  ".join(f"{k} {c[k]}" for k in ("passed", "failed", "skipped") if c[k]))
    tr.write_line("total: " + "  ".join(f"{k} {total[k]}" for k in ("passed", "failed", "skipped")))


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session):
    import flashdelta

    print(f"fla_swap: FLA's {', '.join(NAMES)} -> flashdelta {flashdelta.__file__}", file=sys.stderr)
