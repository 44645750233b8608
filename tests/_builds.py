"""The kernel builds the GPU tier launches, as (label, build) pairs (`build()` compiles or loads one kernel).

tests/cpu/test_compile_tier.py compiles the launcher's builds of every GPU-tier case on the CPU (sm_90a needs no
GPU); bench/precompile.py compiles all of them, development variants included, into a cache carried to the GPU
machine. The case lists stay in the GPU test modules; this module only maps them to builder arguments.
"""
from __future__ import annotations

import importlib.util
import os

import torch

_GPU = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu")


def _gpu_module(name: str):
    spec = importlib.util.spec_from_file_location(f"_tier_{name}", os.path.join(_GPU, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fwd_builds(dev: bool = False) -> list:
    """tests/gpu/test_fwd.py: each case's fused kernel (CASES and the other tests' cases); dev adds the switch
    variants of VARIANT_CASES."""
    from flashdelta.kernels import fused_fwd

    t = _gpu_module("test_fwd")
    out, seen = [], set()
    for c in t.CASES + [t.MANY_SEQS, t.DET, t.GRAPH, t.BIG]:
        args = fused_fwd.builder_args(c.H, c.HV, c.K, c.V, c.dtype, c.beta_dtype, c.h0_dtype, c.K ** -0.5, c.h0,
                                      c.state_v_first)
        if args not in seen:
            seen.add(args)
            out.append((f"chunk_fwd {c.name}", lambda args=args: fused_fwd.build(args)))
        if dev and c in t.VARIANT_CASES:
            out += [(f"chunk_fwd {c.name} {name}", lambda args=args, sw=sw: fused_fwd.build(args, **sw))
                    for name, sw in t.SWITCH_SETS.items()]
    return out


def prepare_builds(dev: bool = False) -> list:
    """tests/gpu/test_prepare.py: what the launcher may build for each case (`prepare.launcher_builds`); dev adds
    every heads-per-CTA split of both kernels and the register-budget knobs of KNOB_CASES."""
    from flashdelta.kernels import prepare, prepare_pipe

    t = _gpu_module("test_prepare")
    todo = {}
    for c in t.CASES:
        for label, builder, args in prepare.launcher_builds(c.H, c.HV, c.K, c.dtype, c.beta_dtype, num_sms=132):
            todo.setdefault((id(builder), args), (f"{c.name}: {label}",
                                                  lambda builder=builder, args=args: builder(*args)))
        if dev:
            for hpc in prepare.heads_per_cta_options(c.H, c.HV):
                a = prepare.builder_args(c.H, c.HV, c.K, c.dtype, c.beta_dtype, hpc)
                todo.setdefault(("one", a), (f"prepare_fwd {a[:3]} heads/CTA {hpc}", lambda a=a: prepare.build_fwd(a)))
                p = prepare_pipe.builder_args(c.H, c.HV, c.K, c.dtype, c.beta_dtype, hpc)
                todo.setdefault(("pipe", p), (f"prepare_fwd_pipe {p[:3]} heads/item {hpc}",
                                              lambda p=p: prepare_pipe._build_prepare_fwd_pipe(*p)))
    if dev:
        for c, knobs in t.KNOB_CASES:
            a = prepare.builder_args(c.H, c.HV, c.K, c.dtype, c.beta_dtype)
            todo.setdefault(("knobs", a, tuple(knobs.items())),
                            (f"prepare_fwd {a[:3]} {knobs}", lambda a=a, kn=knobs: prepare.build_fwd(a, **kn)))
    return list(todo.values())


def e2e_builds() -> list:
    """tests/gpu/test_e2e_gpu.py through the public API: `flashdelta warmup`'s variants of its head configs (both
    state layouts, with and without h0, beta in the input dtype), and the non-default scale's build."""
    from flashdelta.kernels.warmup import variants

    t = _gpu_module("test_e2e_gpu")
    todo = []
    for dtype in dict.fromkeys(d for _, d in t.PAIRS):
        heads = sorted({(c.H, c.HV) for c, d in t.PAIRS if d == dtype})
        todo += [(f"e2e {str(dtype)[6:]}: {label}", b, a) for label, b, a in variants(
            heads, dtype=dtype, beta_dtype=dtype, initial_state=(False, True), state_v_first=(False, True), num_sms=132)]
    todo += [(f"e2e scale {t.OTHER_SCALE}: {label}", b, a) for label, b, a in variants(
        [(2, 8)], dtype=torch.bfloat16, beta_dtype=torch.float32, scale=t.OTHER_SCALE, initial_state=(True,),
        num_sms=132)]
    seen = {}
    for label, builder, args in todo:
        seen.setdefault((id(builder), args), (label, lambda builder=builder, args=args: builder(*args)))
    return list(seen.values())
