"""Context parallelism's `chunk_take` builds of `chunk_dstate` (the backward warm-up's F pass, docs/algorithm.md §4.4)
on the CPU: listed under their own cache keys where CP lists its builds (`cp.builds` with the backward, beside the
exact pass's default build, whose arguments are unchanged), they compile for sm_90a, pass the hang checks, read
`take [N, HV]` int32, and ptxas keeps the default build's budget (no spills, no stack frame). The two builds (~8 s
each): K = V = 128 bf16 with fp32 beta at 2/8 (the benchmark rows' dims) and K = V = 64 fp16 with fp16 beta at 16/32.
And the plan kernel (`kernels.cp_plan`): listed, compiled, checked. tests/gpu/test_cp_gpu.py runs them on the GPU.
This file's builds and their ptxas reports run in the session's one compile pool (tests/conftest.py `sm90_kernels`)."""
import functools
import re

import pytest
import torch

pytest.importorskip("tilelang")

from _builds import build_params, build_rows, hang_checks, pooled, ptxas_report  # noqa: E402

from flashdelta import cp  # noqa: E402
from flashdelta.kernels import chunk_dstate, cp_plan, cp_windows, fused_fwd, item_order  # noqa: E402

pytestmark = pytest.mark.compile

TAKE_BUILDS = {
    "128-bf16": chunk_dstate.builder_args(2, 8, 128, 128, torch.bfloat16, torch.float32, 128 ** -0.5) + (True,),
    "64-fp16": chunk_dstate.builder_args(16, 32, 64, 64, torch.float16, torch.float16, 0.125) + (True,),
}


def test_take_builds_are_listed_where_cp_lists_its_builds():
    lb = chunk_dstate.launcher_builds(2, 8, 128, 128, torch.bfloat16, torch.float32, 128 ** -0.5,
                                      chunk_take=(False, True))
    default = chunk_dstate.builder_args(2, 8, 128, 128, torch.bfloat16, torch.float32, 128 ** -0.5)
    assert [a for _, _, a in lb] == [default, TAKE_BUILDS["128-bf16"]] and lb[1][0].endswith(" take")
    assert chunk_dstate.launcher_builds(2, 8, 128, 128, torch.bfloat16, torch.float32, 128 ** -0.5) == lb[:1], \
        "the default list is the build without the flag"
    keys = {(b.__name__, a) for _, b, a in cp.builds(2, 8, 128, 128, torch.bfloat16, torch.float32, 128 ** -0.5,
                                                     backward=True)}
    name = chunk_dstate.build.__name__
    assert (name, default) in keys and (name, TAKE_BUILDS["128-bf16"]) in keys
    fwd_only = {a for _, _, a in cp.builds(2, 8, 128, 128, torch.bfloat16, torch.float32, 128 ** -0.5)}
    assert TAKE_BUILDS["128-bf16"] not in fwd_only, "the forward alone launches no chunk_dstate"


@pytest.mark.parametrize("sm90_build", build_params(build_rows(chunk_dstate.build, TAKE_BUILDS), ptxas=()))
def test_take_build_compiles_within_budget(sm90_build, sm90_kernels, tmp_path):
    name = sm90_build[0]
    kernel = pooled(sm90_kernels, sm90_build)
    src = kernel.get_kernel_source()
    assert hang_checks(src, kernel.get_host_source()) == []
    sig = src[src.index("chunk_dstate_kernel_kernel("):].split(")", 1)[0]
    assert "const int* __restrict__ take" in sig
    assert re.search(r"= take\[\(\(\(\(int64_t\)i_n\) \* \(int64_t\)\d+\) \+ \(\(int64_t\)i_hv\)\)\];", src), \
        "the walk's chunk count comes from take"
    assert "const int* __restrict__ order" in sig and "order[((int64_t)((int)blockIdx.x))]" in src, \
        "the CTA's (sequence, head) item from the item order (`kernels.item_order`)"
    report = ptxas_report(src, tmp_path, name)
    assert "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" in report, report
    regs = [int(n) for n in re.findall(r"Used (\d+) registers", report)]
    assert regs and max(regs) <= 255, report


@pytest.mark.sm90_builds(("cp_plan", cp_plan.build, cp_plan.builder_args()), ptxas=())
def test_plan_kernel_compiles_and_is_listed(tmp_path):
    """`kernels.cp_plan` (the SM90 path's plan, one build for every L): listed in `cp.builds`, compiles for sm_90a,
    passes the hang checks, uses no tensor cores and keeps its counters in registers (no spills, no stack)."""
    keys = {(b.__name__, a) for _, b, a in cp.builds(2, 8, 128, 128, torch.bfloat16, torch.float32, 128 ** -0.5)}
    assert (cp_plan.build.__name__, cp_plan.builder_args()) in keys
    kernel = cp_plan.build(*cp_plan.builder_args())
    src = kernel.get_kernel_source()
    assert hang_checks(src, kernel.get_host_source()) == []
    assert src.count("__syncthreads()") == 2 and "wgmma" not in src
    report = ptxas_report(src, tmp_path, "cp_plan")
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    assert spills and all(s == ("0", "0") for s in spills), report
    assert re.search(r"\b0 bytes stack frame", report), report


# the overlapped forward's fused-forward builds (`cp._output_overlapped`) at the benchmark rows' dims (2/8, bf16, fp32
# beta): the windows' E pass alone (states only, chunk_skip, no h0), the output pass over a chunk_skip (fp32 h0) and
# the training forward's, which also saves the chunk states over the sequences (save_states, state_seqs)
OVERLAP_BUILDS = {
    "e-pass": fused_fwd.builder_args(2, 8, 128, 128, torch.bfloat16, torch.float32, torch.float32, 128 ** -0.5, False,
                                     False) + fused_fwd._flags(False, True, False, True),
    "output-skip": fused_fwd.builder_args(2, 8, 128, 128, torch.bfloat16, torch.float32, torch.float32, 128 ** -0.5,
                                          True, False) + fused_fwd._flags(False, True, False, False),
    "output-skip-save-states": fused_fwd.builder_args(2, 8, 128, 128, torch.bfloat16, torch.float32, torch.float32,
                                                      128 ** -0.5, True, False)
    + fused_fwd._flags(True, True, False, False, state_seqs=True),
}


def test_overlap_builds_are_listed_where_cp_lists_its_builds():
    keys = {(b.__name__, a) for _, b, a in cp.builds(2, 8, 128, 128, torch.bfloat16, torch.float32, 128 ** -0.5,
                                                     backward=True)}
    assert all((fused_fwd.build.__name__, a) in keys for a in OVERLAP_BUILDS.values())


@pytest.mark.parametrize("sm90_build", build_params(build_rows(fused_fwd.build, OVERLAP_BUILDS)))
def test_overlap_builds_compile_and_pass_the_checks(sm90_build, sm90_kernels):
    """Both compile for sm_90a, pass the hang checks and read the per-(sequence, head) skip."""
    kernel = pooled(sm90_kernels, sm90_build)
    src = kernel.get_kernel_source()
    assert hang_checks(src, kernel.get_host_source()) == []
    sig = src[src.index("chunk_fwd_kernel_kernel("):].split(")", 1)[0]
    assert "const int* __restrict__ skip" in sig


WINDOWS_BUILDS = {
    # (H, HV, K, k dtype, beta dtype, keys_normalized[, backward[, norms]]): the benchmark rows' heads, GVA 1 with
    # fp16, float64 beta, the backward's, the builds reading prepare's key norms
    "2-8-128-bf16-fp32": (2, 8, 128, torch.bfloat16, torch.float32, False),
    "2-8-128-bf16-fp32-normalized": (2, 8, 128, torch.bfloat16, torch.float32, True),
    "16-16-64-fp16-fp16": (16, 16, 64, torch.float16, torch.float16, False),
    "1-4-256-bf16-fp64": (1, 4, 256, torch.bfloat16, torch.float64, False),
    "2-8-128-bf16-fp32-bwd": (2, 8, 128, torch.bfloat16, torch.float32, False, True),
    "16-16-64-fp16-fp16-normalized-bwd": (16, 16, 64, torch.float16, torch.float16, True, True),
    "2-8-128-bf16-fp32-norms": (2, 8, 128, torch.bfloat16, torch.float32, False, False, True),
    "1-4-256-bf16-fp64-norms-bwd": (1, 4, 256, torch.bfloat16, torch.float64, False, True, True),
}


def test_windows_builds_are_listed_where_cp_lists_its_builds():
    """`kernels.cp_windows` (the SM90 path's warm-up decisions): both keys_normalized builds of the forward's and the
    one reading prepare's key norms in `cp.builds`, the backward's too with the backward, none where it does not take
    the heads."""
    args = functools.partial(cp_windows.builder_args, 2, 8, 128, torch.bfloat16, torch.float32)
    fwd = {a for _, b, a in cp.builds(2, 8, 128, 128, torch.bfloat16, torch.float32, 128 ** -0.5)
           if b is cp_windows.build}
    both = {a for _, b, a in cp.builds(2, 8, 128, 128, torch.bfloat16, torch.float32, 128 ** -0.5, backward=True)
            if b is cp_windows.build}
    assert fwd == {args(False), args(True), args(False, False, True)}
    assert both == fwd | {args(False, True), args(True, True), args(False, True, True)}
    assert cp_windows.launcher_builds(2, 8, 96, torch.bfloat16, torch.float32) == []
    assert cp_windows.unsupported(2, 8, 128, torch.float32, torch.float32) is not None
    assert cp_windows.unsupported(3, 8, 128, torch.bfloat16, torch.float32) is not None


@pytest.mark.parametrize("sm90_build", build_params(build_rows(
    cp_windows.build, {n: cp_windows.builder_args(*a) for n, a in WINDOWS_BUILDS.items()}), ptxas=()))
def test_windows_kernel_compiles_and_passes_the_checks(sm90_build, sm90_kernels, tmp_path):
    """Each windows build compiles for sm_90a, passes the hang checks, takes the plan's buffers and two float64
    scalars, uses no tensor cores, reads k only without keys_normalized and without prepare's norms (through the TMA
    pipeline; the norms builds read ``k_norm2`` instead), and keeps its state in registers (no spills, no stack)."""
    name = sm90_build[0]
    kernel = pooled(sm90_kernels, sm90_build)
    src = kernel.get_kernel_source()
    assert hang_checks(src, kernel.get_host_source()) == []
    sig = src[src.index("cp_windows_kernel_kernel("):].split(")", 1)[0]
    assert "double limit" in sig and "double threshold" in sig and "double* __restrict__ sums" in sig
    assert "wgmma" not in src and "setmaxnreg" not in src
    body = src[src.index("{", src.index("__launch_bounds__")):]
    reads_k = re.search(r"(?<![\w.])k\[|\(k \+|\bk_desc\b", body) is not None      # a load or its TMA
    norms = len(WINDOWS_BUILDS[name]) > 7
    assert reads_k != (WINDOWS_BUILDS[name][5] or norms), "k is read exactly without keys_normalized or the norms"
    assert ("k_norm2" in sig) == norms
    backward = len(WINDOWS_BUILDS[name]) > 6 and WINDOWS_BUILDS[name][6]
    assert ("skip_m" in sig) != backward and "int* __restrict__ chunks" in sig
    report = ptxas_report(src, tmp_path, name)
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    assert spills and all(s == ("0", "0") for s in spills), report
    assert re.search(r"\b0 bytes stack frame", report), report


@pytest.mark.parametrize("keys,ctas,descending,tail,want", [
    # CP's M / E pass skips (smallest first), 2 CTAs per item: the whole walks (0), then the windows, the skipped
    # items (1 << 30) and the padding tail's items last
    ([[1 << 30, 0, 28], [29, 0, 1 << 30]], 40, False, True, [1, 4, 2, 3, 0, 5, 6, 7, 8]),
    # chunk_dstate's takes (largest first), no tail: fallback heads (1 << 30), then the windows, then none (0)
    ([[0, 0, 0], [3, 1 << 30, 2], [1 << 30, 4, 3]], 20, True, False, [4, 6, 7, 3, 8, 5, 0, 1, 2]),
    ([[3, 0], [0, 3]], 33, True, False, [0, 1, 2, 3]),      # one wave (4 x 33 CTAs <= 132 SMs): the identity
])
def test_item_order_twin(keys, ctas, descending, tail, want):
    """The order CP's per-(sequence, head) passes take their work items in: the kernel's torch twin
    (`kernels.item_order.reference_order`, a stable sort of the keys clamped to one byte), and the launcher's
    identity where every CTA fits in one wave (no launch)."""
    from flashdelta.kernels import item_order as io

    keys = torch.tensor(keys, dtype=torch.int32)
    if len(keys) * keys.shape[1] * ctas <= 132:
        got = io.order(keys, ctas, descending=descending, tail=tail)
        assert got.dtype == torch.int32
    else:
        got = io.reference_order(keys, descending=descending, tail=tail)
    assert got.tolist() == want


@pytest.mark.sm90_builds(*[(f"item_order descending={d}", item_order.build, item_order.builder_args(d))
                           for d in (False, True)], ptxas=())
def test_item_order_kernel_compiles_and_is_listed(tmp_path):
    """`kernels.item_order` (both directions): listed in `cp.builds` where its passes' builds are, compiles for
    sm_90a, passes the hang checks, claims each position with one returning atomic (the store's bounds check reads
    the claimed register, not a second atomic), no spills and no stack."""
    fwd = {(b.__name__, a) for _, b, a in cp.builds(2, 8, 128, 128, torch.bfloat16, torch.float32, 128 ** -0.5)}
    both = {(b.__name__, a) for _, b, a in cp.builds(2, 8, 128, 128, torch.bfloat16, torch.float32, 128 ** -0.5,
                                                     backward=True)}
    name = item_order.build.__name__
    assert (name, item_order.builder_args(False)) in fwd and (name, item_order.builder_args(True)) not in fwd
    assert {(name, item_order.builder_args(d)) for d in (False, True)} <= both
    for descending in (False, True):
        kernel = item_order.build(*item_order.builder_args(descending))
        src = kernel.get_kernel_source()
        assert hang_checks(src, kernel.get_host_source()) == []
        assert src.count("AtomicAddRet(") == 1 and src.count("AtomicAdd(") == 1, "one counting, one claiming atomic"
        assert ("255 - max(min(" in src) == descending
        report = ptxas_report(src, tmp_path, f"item_order{int(descending)}")
        spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
        assert spills and all(s == ("0", "0") for s in spills), report
        assert re.search(r"\b0 bytes stack frame", report), report
