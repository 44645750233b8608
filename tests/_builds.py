"""The kernel builds of the GPU tier, from its case tables (tests/cases.py), and the checks every build must pass.

`shipped()`: every build the launchers pick for the GPU tier's cases (the stage tests' launcher calls and the public
API's forward and backward): what the CPU tier compiles (tests/cpu/test_compile_tier.py: by default its `covering`
subset, each compile-time choice once; all with `pytest --all-builds`). `gpu_tier()`: those, the
builds the GPU tests ask for through launcher arguments (prepare's persistent kernel and heads-per-CTA splits on
every case), the decode kernel's (tests/gpu/test_decode.py) and those of the Hugging Face test's GPU run
(tests/cpu/test_hf_qwen3_next.py through bench/dev/hf_gpu.sh), which bench/precompile.py --tests compiles into a
cache for the GPU machine.

`hang_checks(src, host)`: properties of the generated CUDA whose violation hangs or fails the launch on the GPU.
"""
from __future__ import annotations

import re

import torch

import cases

NUM_SMS = 132      # the GPU tier's H200


def _add(out: dict, label: str, builder, args: tuple) -> None:
    out.setdefault((builder.__name__, args), (label, builder, args))


# `flashdelta.precompile.variants` lists the wide forward builds wherever K = V = 128 (the API picks them where the
# sequences and heads fill whole waves, `cp_model.wide_pays`); no test case that takes its builds from it has such a
# shape, so they are left out of those lists (tests/gpu/test_fwd_wide.py lists the ones it launches)
WIDE_BUILDER = "fused_fwd_wide.build"


def _variants(heads: list, **kw) -> list:
    """`flashdelta.precompile.variants` less the wide forward builds (`WIDE_BUILDER`)."""
    from flashdelta.precompile import variants

    return [(label, b, a) for label, b, a in variants(heads, **kw) if b.__name__ != WIDE_BUILDER]


def _stage_builds(forced: bool) -> dict:
    from flashdelta.kernels import (chunk_bwd, chunk_dstate, fused_fwd, group_sum, l2norm, prepare, prepare_bwd,
                                    prepare_oneshot, prepare_pipe)

    out: dict = {}
    for c in cases.FWD_ALL:
        h0_dtype = c.h0_dtype if c.h0 else torch.float32      # without h0 the kernel reads the fp32 output
        for label, b, a in fused_fwd.launcher_builds(c.H, c.HV, c.K, c.V, c.dtype, c.beta_dtype, h0_dtype,
                                                     c.K ** -0.5, (c.h0,), (c.state_v_first,)):
            _add(out, f"{c.name}: {label}", b, a)
    big = cases.FWD_BIG
    prep = [(c.name, c.H, c.HV, c.K, c.dtype, c.beta_dtype) for c in cases.PREP_CASES + [cases.PREP_BIG]]
    prep.append((big.name, big.H, big.HV, big.K, big.dtype, big.beta_dtype))
    for name, H, HV, K, dtype, beta_dtype in prep:
        for label, b, a in prepare.launcher_builds(H, HV, K, dtype, beta_dtype, num_sms=NUM_SMS):
            _add(out, f"{name}: {label}", b, a)
    if forced:
        for c in cases.PREP_CASES:       # test_prepare_fwd_persistent: the persistent kernel, every split, the one-shot
            for hpc in prepare.heads_per_cta_options(c.H, c.HV):
                a = prepare_pipe.builder_args(c.H, c.HV, c.K, c.dtype, c.beta_dtype, hpc, NUM_SMS)
                _add(out, f"{c.name}: prepare_fwd persistent heads/item={hpc}", prepare_pipe.build, a)
            a = prepare_oneshot.builder_args(c.H, c.HV, c.K, c.dtype, c.beta_dtype)
            _add(out, f"{c.name}: prepare_fwd one-shot", prepare_oneshot.build, a)
        for c in cases.PREP_SPLIT_CASES:
            for hpc in prepare.heads_per_cta_options(c.H, c.HV):
                a = prepare_oneshot.builder_args(c.H, c.HV, c.K, c.dtype, c.beta_dtype, hpc)
                _add(out, f"{c.name}: prepare_fwd heads/CTA={hpc}", prepare_oneshot.build, a)
    for c in cases.BWD_CASES + [cases.BWD_MANY_SEQS, cases.BWD_BIG, cases.BWD_BIG_GVA2]:
        if (c.K, c.V) not in chunk_bwd.HEAD_DIMS:
            continue
        for label, b, a in chunk_bwd.launcher_builds(c.H, c.HV, c.K, c.V, c.dtype, c.beta_dtype, c.K ** -0.5,
                                                     (c.dht,), (c.state_v_first,)):
            _add(out, f"{c.name}: {label}", b, a)
        for label, b, a in fused_fwd.state_recompute_builds(c.H, c.HV, c.K, c.V, c.dtype, c.beta_dtype, torch.float32,
                                                            (c.h0,), (c.state_v_first,)):
            _add(out, f"{c.name}: {label}", b, a)
    for c in cases.DSTATE_CASES:
        for label, b, a in chunk_dstate.launcher_builds(c.H, c.HV, c.K, c.V, c.dtype, c.beta_dtype, c.K ** -0.5):
            _add(out, f"{c.name}: {label}", b, a)
    for c in cases.PREP_BWD_CASES:
        for label, b, a in prepare_bwd.launcher_builds(c.HV):
            _add(out, f"{c.name}: {label}", b, a)
    for _, K, dtype in [c[:3] for c in cases.L2NORM_CASES] + [cases.L2NORM_BIG]:
        for label, b, a in l2norm.launcher_builds(K, dtype):
            _add(out, f"{label} {str(dtype)[6:]}", b, a)         # the label alone names no dtype
    for name, _, H, HV, K, dx_dtype, l2, out_dtype in cases.GROUP_SUM_CASES:
        a = group_sum.builder_args(HV // H, K, dx_dtype, out_dtype if l2 else None, out_dtype)
        _add(out, f"{name}: group_sum", group_sum.build, a)
    for c in (cases.BWD_BIG, cases.BWD_BIG_GVA2):   # test_chunk_bwd_offsets_past_2_31_elements: the group sums
        HVq = c.H if chunk_bwd.group_add(c.H, c.HV) else c.HV       # dq's heads as chunk_bwd returns it
        for label, b, a in l2norm.launcher_builds(c.K, c.dtype) + group_sum.launcher_builds(c.H, HVq, c.K, c.dtype,
                                                                                            True):
            _add(out, f"{c.name}: {label}", b, a)
    return out


def _e2e_builds() -> dict:
    """What the public API launches for tests/gpu/test_e2e_gpu.py (`flashdelta.precompile.variants`, the list
    `flashdelta warmup` compiles), per case exactly its layout and initial state; without context parallelism's
    builds (the CP tests list theirs, `_cp_builds`) and the wide forward's (`_variants`)."""
    todo = [(c, dt, {}) for c, dt in cases.E2E_PAIRS]
    todo += [(cases.E2E_L2NORM, torch.bfloat16, dict(qk_l2norm=True)),
             (cases.E2E_SCALE_FP64, torch.bfloat16, dict(beta_dtype=torch.float64, h0_dtype=torch.float64,
                                                          scale=cases.E2E_OTHER_SCALE)),
             (cases.E2E_GRAPH, torch.bfloat16, {}),
             (cases.E2E_BWD, torch.bfloat16, dict(backward=True)),
             (cases.BWD_GRAPH, torch.bfloat16, dict(backward=True)),
             (cases.BWD_MODEL, torch.bfloat16, dict(backward=True, qk_l2norm=True)),
             *[(c, dt, dict(backward=True, qk_l2norm=l2)) for c, dt, l2 in cases.BWD_E2E_PAIRS
               + cases.BWD_E2E_NO_DHT + cases.BWD_E2E_DET],
             *[(c, torch.bfloat16, dict(backward=True)) for c in cases.BWD_COMPILE],
             (cases.E2E_L2NORM, torch.bfloat16, dict(backward=True, qk_l2norm=True)),
             (cases.E2E_ORDER, torch.bfloat16, dict(backward=True, qk_l2norm=True)),
             (cases.E2E_GATE_FLOOR, torch.bfloat16, {})]
    out: dict = {}
    for c, dtype, kw in todo:
        kw = dict(dict(beta_dtype=dtype, qk_l2norm=False), **kw)
        for label, b, a in _variants([(c.H, c.HV)], head_dim=(c.K, c.V), dtype=dtype, initial_state=(c.h0,),
                                     state_v_first=(c.state_v_first,), num_sms=NUM_SMS, context_parallel=False, **kw):
            _add(out, f"e2e {c.name}-{str(dtype)[6:]}: {label}", b, a)
    return out


def _gpu_test_module(stem: str):
    """tests/gpu/<stem>.py imported as a module (its build tables), once."""
    import importlib.util
    import os
    import sys

    name = f"gpu_{stem}"
    mod = sys.modules.get(name)
    if mod is None:
        gpu = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu")
        if gpu not in sys.path:             # its imports of sibling test modules, as pytest's collection allows
            sys.path.append(gpu)
        path = os.path.join(gpu, f"{stem}.py")
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod            # (a dataclass in it looks its module up)
        spec.loader.exec_module(mod)
    return mod


def _decode_builds() -> dict:
    """The decode kernel's builds of tests/gpu/test_decode.py: its case table and the cases its other tests make
    (`recorded_builds`: the public function's launches, found on the CPU)."""
    from flashdelta.kernels import decode

    mod = _gpu_test_module("test_decode")
    Case = mod.DecodeCase
    extra = [Case("chain", B=3, T=4, gate="bias", beta_act=1), Case("graph", seqlens=(1, 0, 2, 1), pad=1),
             Case("big", B=2, H=1, HV=1)]
    out: dict = {}
    for case, args in mod.recorded_builds(mod.CASES + extra):
        _add(out, f"decode {case}", decode.build, args)
    return out


def _hf_builds() -> dict:
    """The SM90 builds of the Hugging Face test on the GPU: its tiny Qwen3-Next's GDN layers (H=2, HV=4, K=V=128,
    bf16 with bf16 beta, q/k l2norm), prefill with and without the cache's state, the training step's backward and the
    decode steps (`_variants`, as bench/dev/hf_gpu.sh precompile less the wide builds its shapes never pick)."""
    out: dict = {}
    for label, b, a in _variants([(2, 4)], head_dim=(128, 128), dtype=torch.bfloat16, beta_dtype=torch.bfloat16,
                                 num_sms=NUM_SMS, backward=True, decode=True, context_parallel=False):
        _add(out, f"hf qwen3-next: {label}", b, a)
    return out


def shipped() -> list:
    """(label, builder, args) of every build the launchers pick for the GPU tier's cases, each once."""
    out = _stage_builds(forced=False)
    for key, value in _e2e_builds().items():
        out.setdefault(key, value)
    return list(out.values())


def compile_choices(builder, args: tuple) -> set:
    """The compile-time choices a build makes: its builder, every argument's value except the head counts (H and HV
    set the grid and the strides, not the code), the GVA group size HV / H and the pair of head dims."""
    import inspect

    names = list(inspect.signature(builder.impl.func.orig_func).parameters)
    named = dict(zip(names, args))
    out = {(builder.__name__,)}
    if "H" in named and "HV" in named:
        out.add((builder.__name__, "G", named["HV"] // named["H"]))
    if "K" in named and "V" in named:
        out.add((builder.__name__, "K, V", named["K"], named["V"]))
    out.update((builder.__name__, name, repr(value)) for name, value in named.items() if name not in ("H", "HV"))
    return out


def covering(builds: list) -> list:
    """A subset of `builds` ((label, builder, args) rows) that makes every compile-time choice (`compile_choices`) the
    whole list makes: greedily the build with the most choices not yet made, the first such in list order. The CPU
    tier compiles it by default (each code path of every builder at least once: a few minutes on two cores instead of
    the whole list's ~15); `pytest --all-builds` and bench/precompile.py --tests compile and check every build."""
    choices = [compile_choices(builder, args) for _, builder, args in builds]
    todo = set().union(*choices)
    picked = []
    while todo:
        best = max(range(len(builds)), key=lambda i: (len(choices[i] & todo), -i))
        picked.append(best)
        todo -= choices[best]
    return [builds[i] for i in sorted(picked)]


def _cp_builds() -> dict:
    """The builds of the GPU test files that list their own (their `builds`): the context-parallel tests
    (tests/gpu/test_cp_gpu.py, test_cp_scan.py), the in-kernel gate's (test_prepare.py, test_e2e_gpu.py) and the wide
    forward's (test_fwd_wide.py)."""
    out: dict = {}
    for stem in ("test_cp_gpu", "test_cp_scan", "test_prepare", "test_e2e_gpu", "test_fwd_wide"):
        for label, b, a in _gpu_test_module(stem).builds():
            if stem == "test_fwd_wide" or b.__name__ != WIDE_BUILDER:     # the CP tests' shapes never pick it
                _add(out, label, b, a)
    return out


def gpu_tier() -> list:
    """`shipped()` and the builds the GPU tests ask for through launcher arguments."""
    out = _stage_builds(forced=True)
    for extra in (_e2e_builds(), _decode_builds(), _hf_builds(), _cp_builds()):
        for key, value in extra.items():
            out.setdefault(key, value)
    return list(out.values())


SMEM_PER_SM = 228 * 1024        # H100 / H200, of which 1 KB is reserved per CTA
REGS_PER_SM = 65536


def dyn_smem_bytes(host_src: str) -> int:
    """The dynamic shared memory a kernel launches with: the launch's last argument in TileLang's host code (grid
    x, y, z, block x, y, z, then the bytes)."""
    sizes = re.findall(r"\[\d+\]\.v_int64\) = \(\(int64_t\)(\d+)\);\s*\(\(\(TVMFFIAny\*\)stack_ffi_any\)\[\d+\]"
                       r"\.type_index\) = 0;", host_src)
    assert sizes, "no kernel launch found in the host source"
    return int(sizes[-1])


def hang_checks(src: str, host_src: str) -> list:
    """What in a build's generated CUDA would hang it or fail its launch on the GPU (empty: nothing):

    - a block-wide barrier under a thread-dependent branch (`divergent_syncs`);
    - warp-specialized kernels (setmaxnreg): any block-wide barrier past the one after the mbarrier init (the roles
      synchronise through mbarriers), or setmaxnreg budgets that add up to more registers than the launch holds, or
      an increase that no decrease pays for (a setmaxnreg.inc that never returns);
    - more shared memory per CTA than the CTAs per SM the build is sized for (`__launch_bounds__`) can have.
    """
    from _helpers import divergent_syncs

    bad = [f"__syncthreads() under a thread-dependent branch at line {n}" for n in divergent_syncs(src)]
    bounds = re.search(r"__launch_bounds__\((\d+)(?:, (\d+))?\)", src)
    threads, blocks = int(bounds.group(1)), int(bounds.group(2) or 1)
    ups = [int(n) for n in re.findall(r"warpgroup_reg_alloc<(\d+)>", src)]
    downs = [int(n) for n in re.findall(r"warpgroup_reg_dealloc<(\d+)>", src)]
    regs = ups + downs
    if regs:
        if src.count("__syncthreads()") != 1:
            bad.append(f"{src.count('__syncthreads()')} block-wide barriers in a warp-specialized kernel (1 expected)")
        cap = REGS_PER_SM // (threads * blocks) // 8 * 8       # registers per thread at launch
        if sum(regs) > threads // 128 * cap:
            bad.append(f"setmaxnreg budgets {regs} exceed {threads // 128} warpgroups x {cap} registers")
        # the registers an increase takes come only from what decreases give back (the CTA's pool is its launch
        # allocation), so a budget above the launch's needs one below it
        if any(n > cap for n in ups) and not any(n < cap for n in downs):
            bad.append(f"setmaxnreg increases {ups} above the launch's {cap} registers, but no decrease below it")
    smem = dyn_smem_bytes(host_src)
    if (smem + 1024) * blocks > SMEM_PER_SM:
        bad.append(f"{smem} B of shared memory per CTA do not fit {blocks} CTAs per SM")
    return bad


# Builders whose builds compile longest here (7-30 s each with both cores busy, the others' 2-6 s): `compile_pool`
# starts them first, so that the pool ends on short builds with both cores still busy.
SLOW_FIRST = ("fused_fwd_wide.build", "chunk_bwd.build", "prepare_pipe.build", "fused_fwd.build", "chunk_dstate.build")


def build_key(builder, args: tuple) -> tuple:
    """A build's identity: its builder's name and arguments (what TileLang's memo and cache key it by)."""
    return builder.__name__, args


def build_rows(builder, builds: dict) -> list:
    """(label, builder, args) rows of a ``label: args`` table of one builder."""
    return [(label, builder, args) for label, args in builds.items()]


def build_params(rows: list, ptxas=None) -> list:
    """`pytest.param`s of (label, builder, args) rows for a test's `sm90_build` parameter, each with its label as id
    and marked `sm90_builds` (compiled in the session's compile pool; `ptxas`: as that marker's)."""
    import pytest

    return [pytest.param(row, id=row[0], marks=pytest.mark.sm90_builds(row, ptxas=ptxas)) for row in rows]


def compile_pool(rows, reports: dict, tmp_path) -> dict:
    """`build_key` -> the compiled kernel (or the exception its build raised) of each (label, builder, args) row, each
    build once, all in one pool on all cores (TileLang's lowering releases the GIL and nvcc runs as a subprocess),
    the slowest builders first (`SLOW_FIRST`). `reports`: `build_key` -> the -D flag tuples of the `ptxas_report`s
    that tests read of that build, run in the same pool after its compile (in tmp_path)."""
    import concurrent.futures
    import os
    import subprocess

    todo = {}
    for _, builder, args in rows:
        todo.setdefault(build_key(builder, args), (builder, args))
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    order = sorted(todo, key=lambda key: rank.get(key[0], len(rank)))

    def compile_one(i, key):
        builder, args = todo[key]
        kernel = builder(*args)
        for j, defines in enumerate(sorted(reports.get(key, ()))):
            try:
                ptxas_report(kernel.get_kernel_source(), tmp_path, f"{key[0]}-{i}-{j}", defines)
            except subprocess.CalledProcessError:
                pass            # the test's own call runs it again and fails there
        return kernel

    workers = max(1, min(len(order), len(os.sched_getaffinity(0))))
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        futures = {key: pool.submit(compile_one, i, key) for i, key in enumerate(order)}
        return {key: f.exception() or f.result() for key, f in futures.items()}


def pooled(kernels: dict, row: tuple):
    """The kernel `compile_pool` compiled for a (label, builder, args) row; its build's exception is raised here."""
    _, builder, args = row
    kernel = kernels[build_key(builder, args)]
    if isinstance(kernel, BaseException):
        raise kernel
    return kernel


_PTXAS: dict = {}      # (CUDA source, defines) -> ptxas_report's report


def ptxas_report(src: str, tmp_path, name: str, defines: tuple = ()) -> str:
    """ptxas' resource lines for a build's generated CUDA, compiled the way TileLang compiles it (sm_90a, fast math;
    `defines`: extra -D flags), in tmp_path/<name>.cu. Each source's report runs once per session (the compile pool
    runs those its tests declare ahead, `compile_pool`)."""
    import subprocess

    from tilelang.env import env as tl_env

    from flashdelta import toolkit

    key = (src, tuple(defines))
    if key not in _PTXAS:
        cu = tmp_path / f"{name}.cu"
        cu.write_text(src)
        cmd = [toolkit.nvcc(), "-arch=sm_90a", "-cubin", "-o", str(tmp_path / f"{name}.cubin"), "-std=c++17", "-O3",
               "--use_fast_math", *(f"-D{d}" for d in defines), f"-I{tl_env.TILELANG_TEMPLATE_PATH}",
               f"-I{tl_env.CUTLASS_INCLUDE_DIR}", "-Xptxas", "-v", str(cu)]
        res = subprocess.run(cmd, capture_output=True, text=True, check=True)
        _PTXAS[key] = res.stdout + res.stderr
    return _PTXAS[key]
