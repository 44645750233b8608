"""The SM90 decode kernel (`kernels.decode`) on the CPU: a few of its builds compile for sm_90a, pass the hang checks
and keep the state in registers (no ptxas spills); the GPU tier's calls (tests/gpu/test_decode.py) reach the kernel
launcher with the builds `recorded_builds` lists; `sm90.decode_builds` (what `flashdelta.warmup` compiles with
decode) is the launcher's table; and the dispatch picks the kernel only where it can run; under torch.compile a forward-only CUDA call is the custom op
``flashdelta::fused_recurrent_fwd`` (one graph node that launches the kernel), traced without graph breaks.

The compiles are the CI's most expensive part here (~2 s each), so only five builds compile: a model's decode step
(dense, fp32 g, bf16 beta, l2norm, fp32 state), every option at once (varlen, V-first bf16 state, in-kernel gate with
dt_bias, gk, gv, per-channel beta with 2 sigmoid), and the smallest (K = V = 64, fp32, no optional input), the first
two also with four lanes per value column (the K split short grids take); they and their ptxas reports run in the
session's one compile pool (tests/conftest.py `sm90_kernels`).
``python bench/dev/decode_bench.py --precompile`` compiles every build the GPU tier uses.
"""
import importlib.util
import os
import re
import sys
import types

import pytest
import torch

pytest.importorskip("tilelang")

from _builds import build_params, build_rows, hang_checks, pooled, ptxas_report  # noqa: E402

from flashdelta import UnsupportedError, dispatch, fused_recurrent_gated_delta_rule, precompile, recurrent  # noqa: E402
from flashdelta.kernels import decode, sm90  # noqa: E402

_GPU_TEST = os.path.join(os.path.dirname(__file__), "..", "gpu", "test_decode.py")


def _gpu_tier():
    spec = importlib.util.spec_from_file_location("gpu_test_decode", _GPU_TEST)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod            # (its dataclass looks its module up)
    spec.loader.exec_module(mod)
    return mod


GPU = _gpu_tier()
SCALE = 128 ** -0.5
MODEL = decode.builder_args(2, 4, 128, 128, torch.bfloat16, torch.bfloat16, g_dtype=torch.float32,
                            beta_dtype=torch.bfloat16, h0_dtype=torch.float32, varlen=False, scale=SCALE,
                            qk_l2norm=True)
EVERY_OPTION = decode.builder_args(2, 8, 128, 128, torch.bfloat16, torch.bfloat16, g_dtype=torch.float32,
                                   gk_dtype=torch.float32, gv_dtype=torch.bfloat16, beta_dtype=torch.float32,
                                   beta_per_v=True, h0_dtype=torch.bfloat16, state_v_first=True, varlen=True,
                                   scale=SCALE, qk_l2norm=True, a_log_dtype=torch.float32,
                                   dt_bias_dtype=torch.bfloat16, beta_act=2)
SMALLEST = decode.builder_args(2, 4, 64, 64, torch.float32, torch.float32, g_dtype=None, beta_dtype=None,
                               h0_dtype=None, output_final_state=False, varlen=False, scale=64 ** -0.5,
                               qk_l2norm=False)
BUILDS = {"model": MODEL, "every-option": EVERY_OPTION, "smallest": SMALLEST,
          "model-lanes4": MODEL[:-1] + (4,), "every-option-lanes4": EVERY_OPTION[:-1] + (4,)}


PTXAS = ("ENABLE_BF16",)        # the -D flags the ptxas reports of these builds compile with


@pytest.mark.parametrize("sm90_build", build_params(build_rows(decode.build, BUILDS), ptxas=PTXAS))
def test_decode_build_compiles_without_spills(sm90_build, sm90_kernels, tmp_path):
    kernel = pooled(sm90_kernels, sm90_build)
    src = kernel.get_kernel_source()
    assert hang_checks(src, kernel.get_host_source()) == []
    report = ptxas_report(src, tmp_path, "decode", defines=PTXAS)
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    assert spills and all(s == ("0", "0") for s in spills), report
    assert "bytes stack frame" in report and re.search(r"\b0 bytes stack frame", report), report


def test_gpu_tier_calls_reach_the_launcher():
    """Every GPU-tier case reaches the kernel launcher (the public function's wiring: one launch per call, beta
    activation and gate passed through), and the three builds compiled here are among those it launches."""
    recorded = GPU.recorded_builds()
    by_case = {}
    for name, args in recorded:
        by_case.setdefault(name, []).append(args)
    assert set(by_case) == {c.name for c in GPU.CASES}
    # one launch per call, with each of the forced lanes per value column, nothing else differing
    assert all([a[-1] for a in v] == list(GPU.LANES) and len({a[:-1] for a in v}) == 1 for v in by_case.values())
    assert GPU.LANES == decode.LANES
    args = dict((name, a[0]) for name, a in by_case.items())
    assert args["gate-nobias-negeig-channel-vfirst"][-4:-1] == ("float32", None, 2)     # A_log, dt_bias, 2 sigmoid
    assert args["gate-bias-sigmoid-T4"][-4:-1] == ("float32", "bfloat16", 1)
    assert args["decode-nofinal-fp64-params"][9] == "float32" and args["decode-nofinal-fp64-params"][11] == "float32"
    assert args["bare-k64-fp16"][6:12] == (None, None, None, None, False, None)
    assert args["decode-bf16-gva2"] == MODEL


def test_decode_builds_are_the_launchers_table():
    """`sm90.decode_builds` (behind ``precompile.variants(decode=True)``) lists `decode.launcher_builds`, dense and
    varlen, with and without the initial state; none for head dims the kernel lacks."""
    todo = precompile.variants([(2, 4)], dtype=torch.bfloat16, beta_dtype=torch.bfloat16, decode=True)
    dec = [(label, b, a) for label, b, a in todo if b is decode.build]
    assert len(dec) == 8 and {a[14] for _, _, a in dec} == {False, True}                  # varlen off / on
    assert {a[-1] for _, _, a in dec} == set(decode.LANES)                                 # lanes per column
    assert MODEL in [a for _, _, a in dec]
    assert sm90.decode_builds([(2, 4)], head_dim=(128, 256), dtype=torch.bfloat16, beta_dtype=torch.float32,
                              h0_dtype=torch.float32, scale=1.0)
    assert sm90.decode_builds([(2, 4)], head_dim=(256, 256), dtype=torch.bfloat16, beta_dtype=torch.float32,
                              h0_dtype=torch.float32, scale=1.0) == []
    assert not [b for _, b, _ in precompile.variants([(2, 4)]) if b is decode.build]


def test_lanes_per_column_pick():
    """Four lanes per value column where one lane per column gives at most one warp per SM, else one; the launcher
    passes its pick to the build (a decode step of one sequence at 2/8 heads: 32 warps; of 64: 2,048)."""
    assert decode.lanes_for(1, 8, 128, 132) == 4 and decode.lanes_for(1, 32, 128, 132) == 4
    assert decode.lanes_for(2, 32, 128, 132) == 1 and decode.lanes_for(16, 8, 128, 132) == 1
    assert decode.lanes_for(4, 8, 128, 132) == 4 and decode.lanes_for(5, 8, 128, 132) == 1
    one, many = GPU.DecodeCase("one", B=1, H=2, HV=8), GPU.DecodeCase("many", B=64, H=2, HV=8)
    picked = dict(GPU.recorded_builds([one, many], lanes=(None,)))
    assert picked["one"][-1] == 4 and picked["many"][-1] == 1


def test_unsupported():
    assert decode.unsupported(128, 128, torch.bfloat16, torch.bfloat16) is None
    assert decode.unsupported(64, 256, torch.float32, torch.float16) is None
    assert "K=256" in decode.unsupported(256, 128, torch.bfloat16, torch.bfloat16)
    assert "V=48" in decode.unsupported(128, 48, torch.bfloat16, torch.bfloat16)
    assert "float64" in decode.unsupported(128, 128, torch.float64, torch.float64)
    with pytest.raises(AssertionError):
        decode.build.get_tir(*SMALLEST[:2], 96, *SMALLEST[3:])


def _x(**kw):
    x = dict(q=torch.randn(1, 3, 2, 64), k=torch.randn(1, 3, 2, 64), v=torch.randn(1, 3, 4, 64),
             g=-torch.rand(1, 3, 4), beta=torch.rand(1, 3, 4))
    x.update(kw)
    return x


def test_dispatch(monkeypatch):
    """The kernel runs on an SM90 device for forward-only calls of supported shapes; the PyTorch path otherwise
    (torch forced, not SM90, an input requiring grad, unsupported head dims with one warning); a forced sm90 that
    cannot run raises."""
    monkeypatch.delenv(dispatch.ENV_BACKEND, raising=False)
    q, v = torch.zeros(1, 1, 2, 128), torch.zeros(1, 1, 4, 128)
    path = recurrent._kernel_path
    assert not path(q, v, False, (q, v))                                    # CPU, auto
    monkeypatch.setattr(dispatch, "native_backend", lambda device: "sm90")
    assert path(q, v, False, (q, v))
    assert not path(q, v, True, (q, v))                                     # requires grad
    recurrent._warned.clear()
    q32, v32 = torch.zeros(1, 1, 2, 32), torch.zeros(1, 1, 4, 32)
    with pytest.warns(UserWarning, match="K=32"):
        assert not path(q32, v32, False, (q32, v32))
    assert not path(q32, v32, False, (q32, v32))                            # warned once
    monkeypatch.setenv(dispatch.ENV_BACKEND, "torch")
    assert not path(q, v, False, (q, v))
    monkeypatch.setenv(dispatch.ENV_BACKEND, "sm90")
    with pytest.raises(UnsupportedError, match="SM90"):                     # a CPU tensor
        path(q, v, False, (q, v))
    monkeypatch.setenv(dispatch.ENV_ARCH, "sm_90a")
    cuda = torch.device("cuda", 0)                                          # stand-ins for CUDA tensors

    def on_cuda(x):
        return types.SimpleNamespace(device=cuda, shape=x.shape, dtype=x.dtype)

    assert path(on_cuda(q), on_cuda(v), False, ())
    with pytest.raises(UnsupportedError, match="forward only"):
        path(on_cuda(q), on_cuda(v), True, ())
    with pytest.raises(UnsupportedError, match="K=32"):
        path(on_cuda(q32), on_cuda(v32), False, ())


def test_kernel_path_does_not_read_cu_seqlens(monkeypatch):
    """On the kernel path cu_seqlens' values are never read on the host (no device-to-host copy): a malformed one
    reaches the launcher, while the PyTorch path rejects it."""
    bad = torch.tensor([0, 5, 2], dtype=torch.int32)
    seen = []
    monkeypatch.setattr(recurrent, "_kernel_path", lambda *a: True)
    monkeypatch.setattr(decode, "fused_recurrent_fwd", lambda *a, **k: seen.append(a[8]) or (None, None))
    monkeypatch.setattr(torch.Tensor, "cpu", lambda self: pytest.fail("cu_seqlens read on the host"))
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: pytest.fail("cu_seqlens read on the host"))
    monkeypatch.setattr(torch.Tensor, "item", lambda self: pytest.fail("cu_seqlens read on the host"))
    fused_recurrent_gated_delta_rule(**_x(), cu_seqlens=bad)
    assert seen and seen[0] is bad
    monkeypatch.undo()
    with pytest.raises(ValueError, match="non-decreasing"):
        fused_recurrent_gated_delta_rule(**_x(), cu_seqlens=bad)


def _decode_step(q, k, v, g, beta, h0):
    return fused_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=h0, output_final_state=True,
                                            use_qk_l2norm_in_kernel=True)


def _step_inputs(T=1, **kw):
    gen = torch.Generator().manual_seed(0)
    x = dict(q=torch.randn(3, T, 2, 64, generator=gen), k=torch.randn(3, T, 2, 64, generator=gen),
             v=torch.randn(3, T, 4, 64, generator=gen), g=-torch.rand(3, T, 4, generator=gen),
             beta=torch.rand(3, T, 4, generator=gen), h0=torch.randn(3, 4, 64, 64, generator=gen))
    x.update(kw)
    return x


def _graph_ops(fn, x):
    """(outputs, call targets of the graph) of ``torch.compile(fn, fullgraph=True)`` through AOTAutograd (so the fake
    implementation runs), with a backend that records the graph and runs it as it is."""
    from torch._dynamo.backends.common import aot_autograd

    seen = []

    def record(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    out = torch.compile(fn, fullgraph=True, backend=aot_autograd(fw_compiler=record))(**x)
    return out, seen


def test_compile_cpu_traces_the_portable_loop(monkeypatch):
    """On the CPU, torch.compile(fullgraph=True) traces the PyTorch loop (no graph break, no custom op) and gives the
    eager result."""
    monkeypatch.delenv(dispatch.ENV_BACKEND, raising=False)
    x = _step_inputs(T=2)
    (o, ht), ops = _graph_ops(_decode_step, x)
    want_o, want_ht = _decode_step(**x)
    assert not [t for t in ops if "flashdelta" in t] and ops
    assert torch.allclose(o, want_o, atol=1e-6) and torch.allclose(ht, want_ht, atol=1e-6)


def test_compile_cuda_call_is_the_custom_op(monkeypatch):
    """A forward-only call on a CUDA device traces to one ``flashdelta::fused_recurrent_fwd`` node (its fake
    implementation gives the shapes; no PyTorch loop in the graph), which runs the kernel's launcher: shown on the
    CPU with the device decision answering as for CUDA and the launcher replaced by the PyTorch loop. With an input
    that requires grad the loop is traced instead."""
    monkeypatch.delenv(dispatch.ENV_BACKEND, raising=False)
    decide = recurrent._compiled_op
    monkeypatch.setattr(recurrent, "_compiled_op", lambda device, need_grad: decide(torch.device("cuda"), need_grad))
    monkeypatch.setattr(recurrent, "_kernel_path", lambda q, v, need_grad, tensors: not need_grad)
    launches = []

    def launcher(q, k, v, g, gk, gv, beta, h0, cu, **opts):
        launches.append(opts)
        return recurrent._portable(q, k, v, g, gk, gv, beta, h0, None, **opts)

    monkeypatch.setattr(decode, "fused_recurrent_fwd", launcher)
    x = _step_inputs()
    (o, ht), ops = _graph_ops(_decode_step, x)
    assert ops == ["flashdelta.fused_recurrent_fwd.default"] + ["<built-in function getitem>"] * 2
    assert len(launches) == 1 and launches[0]["use_qk_l2norm"] and launches[0]["output_final_state"]
    want_o, want_ht = recurrent._portable(x["q"], x["k"], x["v"], x["g"], None, None, x["beta"], x["h0"], None,
                                          **launches[0])
    assert torch.equal(o, want_o) and torch.equal(ht, want_ht)

    def no_final(q, k, v, g, beta, h0):        # the op returns an empty state, the function None
        return fused_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=h0)[1] is None

    assert torch.compile(no_final, fullgraph=True, backend="aot_eager")(**x)
    launches.clear()
    (o, _), ops = _graph_ops(_decode_step, _step_inputs(q=x["q"].clone().requires_grad_()))
    assert not launches and not [t for t in ops if "flashdelta" in t]


def test_compile_routing():
    """`recurrent._compiled_op`, the decision inside torch.compile: the op on CUDA without grad (whatever the
    architecture says: the op decides on the real tensors when it runs), the PyTorch loop otherwise; a forced sm90 on
    the CPU raises as in eager mode."""
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    env = os.environ.copy()
    try:
        os.environ.pop(dispatch.ENV_BACKEND, None)
        os.environ[dispatch.ENV_ARCH] = "sm_90a"
        assert recurrent._compiled_op(cuda, False)
        assert not recurrent._compiled_op(cuda, True) and not recurrent._compiled_op(cpu, False)
        os.environ[dispatch.ENV_BACKEND] = "torch"
        assert not recurrent._compiled_op(cuda, False)
        os.environ[dispatch.ENV_BACKEND] = "sm90"
        assert recurrent._compiled_op(cuda, False)
        with pytest.raises(UnsupportedError, match="SM90"):
            recurrent._compiled_op(cpu, False)
    finally:
        os.environ.clear()
        os.environ.update(env)


def test_custom_op_fake_shapes():
    """The op's fake implementation: o in v's dtype, the state in either layout (empty without the final state),
    float64 for float64 inputs; checked with torch.library.opcheck on the CPU (the op runs the loop there)."""
    x = _step_inputs(T=2)
    args = (x["q"], x["k"], x["v"], x["g"], None, None, x["beta"], x["h0"], None, None, None)
    for final in (True, False):
        for v_first in (False, True):
            kw = dict(scale=0.125, output_final_state=final, use_qk_l2norm=True, beta_act=0, state_v_first=v_first)
            torch.library.opcheck(recurrent.fused_recurrent_fwd, args, kw,
                                  test_utils=("test_schema", "test_faketensor"))
