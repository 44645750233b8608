"""The public contract: import hygiene, validation of every malformed input, dispatch, signature docs."""
import inspect
import os
import re
import subprocess
import sys

import pytest
import torch
from _helpers import Case, make_inputs

import flashdelta
from flashdelta import UnsupportedError, chunk_gated_delta_rule, dispatch, stages
from flashdelta.autograd import chunk_gdn_fwd

SRC = os.path.join(os.path.dirname(__file__), "..", "..", "src")


def _good(B=1, T=8, H=2, HV=4, K=16, V=8, N=None, varlen=False):
    gen = torch.Generator().manual_seed(0)
    x = dict(
        q=torch.randn(B, T, H, K, generator=gen), k=torch.randn(B, T, H, K, generator=gen),
        v=torch.randn(B, T, HV, V, generator=gen), g=-torch.rand(B, T, HV, generator=gen),
        beta=torch.rand(B, T, HV, generator=gen),
    )
    if varlen:
        x["cu_seqlens"] = torch.tensor([0, 3, T], dtype=torch.int32)
    return x


def _fresh_process(code: str, done: str) -> None:
    """Run `code` in a fresh Python with this checkout's flashdelta; it must exit 0 having printed `done`."""
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0 and done in out.stdout, out.stderr


def test_import_touches_no_gpu_and_no_tilelang():
    _fresh_process("import sys, torch, flashdelta; "
                   "assert 'tilelang' not in sys.modules, 'tilelang imported'; "
                   "assert 'flashdelta.kernels' not in sys.modules; "
                   "assert not torch.cuda.is_initialized(); print('clean')", "clean")


def test_eager_inference_skips_the_custom_op_dispatch():
    """Plain tensors, no gradient, eager: the forward's body runs without the custom op, whose first eager call
    imports torch._dynamo (seconds of a serving process's cold start); same bits as the op. With a gradient the
    op (and its autograd) runs."""
    _fresh_process("import sys, torch, flashdelta; x = [torch.randn(1, 8, 2, 16), torch.randn(1, 8, 2, 16), "
                   "torch.randn(1, 8, 2, 8), -torch.rand(1, 8, 2), torch.rand(1, 8, 2)]; "
                   "flashdelta.chunk_gated_delta_rule(*x, output_final_state=True); "
                   "assert 'torch._dynamo' not in sys.modules, 'custom op dispatched'; print('direct')", "direct")
    x = _good(varlen=True, N=2)
    with torch.no_grad():
        o, ht = chunk_gated_delta_rule(**x, output_final_state=True)
    o_op, ht_op, *saved = chunk_gdn_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], None, x["cu_seqlens"],
                                        16 ** -0.5, False, False, False)
    assert torch.equal(o, o_op) and torch.equal(ht, ht_op)
    assert all(t.numel() == 0 for t in saved), "nothing is saved without need_bwd"
    q = x["q"].clone().requires_grad_(True)
    o, _ = chunk_gated_delta_rule(**dict(x, q=q))
    assert "chunk_gdn_fwd" in o.grad_fn.name()


def test_functorch_and_forward_ad():
    """vmap (functorch-wrapped tensors, which are of type Tensor) goes through the custom op and torch's batching
    fallback: per-sample results. Forward-mode AD raises instead of returning an output without a tangent."""
    x = _good()
    qs = torch.stack([x["q"], x["q"] * 0.5, -x["q"]])
    rest = {n: t for n, t in x.items() if n != "q"}
    o = torch.vmap(lambda q: chunk_gated_delta_rule(q, **rest)[0])(qs)
    assert torch.equal(o, torch.stack([chunk_gated_delta_rule(q, **rest)[0] for q in qs]))
    with pytest.raises(UnsupportedError, match="forward-mode AD"):
        torch.func.jvp(lambda q: chunk_gated_delta_rule(q, **rest)[0], (x["q"],), (torch.ones_like(x["q"]),))


# (id, keyword overrides applied to a valid varlen-free call, exception type, message regex)
BAD_INPUTS = [
    ("q-not-tensor", lambda x: x.update(q=[1.0]), TypeError, r"q must be a torch.Tensor"),
    ("q-3d", lambda x: x.update(q=x["q"][0]), ValueError, r"q must have 4 dimensions"),
    ("q-int", lambda x: x.update(q=x["q"].int()), TypeError, r"q has dtype torch.int32"),
    ("k-shape", lambda x: x.update(k=x["k"][:, :, :1]), ValueError, r"k must have q's shape"),
    ("k-dtype", lambda x: x.update(k=x["k"].double()), TypeError, r"q, k, v must share one dtype"),
    ("v-T", lambda x: x.update(v=x["v"][:, :5]), ValueError, r"v must be \[B, T, HV, V\]"),
    ("gva-not-multiple", lambda x: x.update(v=x["v"][:, :, :3], g=x["g"][..., :3], beta=x["beta"][..., :3]),
     ValueError, r"HV=3 .* multiple of .* H=2"),
    ("g-shape", lambda x: x.update(g=x["g"][..., :2]), ValueError, r"g must be \[B, T, HV\]"),
    ("g-int", lambda x: x.update(g=x["g"].long()), TypeError, r"g has dtype torch.int64"),
    ("beta-shape", lambda x: x.update(beta=x["beta"][:, :4]), ValueError, r"beta must be \[B, T, HV\]"),
    ("scale-str", lambda x: x.update(scale="0.1"), TypeError, r"scale must be a finite real"),
    ("scale-nan", lambda x: x.update(scale=float("nan")), TypeError, r"scale must be a finite real"),
    ("scale-bool", lambda x: x.update(scale=True), TypeError, r"scale must be a finite real"),
    ("flag-int", lambda x: x.update(output_final_state=1), TypeError, r"output_final_state must be a bool"),
    ("l2norm-str", lambda x: x.update(use_qk_l2norm_in_kernel="yes"), TypeError, r"use_qk_l2norm_in_kernel"),
    ("layout-none", lambda x: x.update(state_v_first=None), TypeError, r"state_v_first must be a bool"),
    ("h0-count", lambda x: x.update(initial_state=torch.zeros(2, 4, 16, 8)), ValueError,
     r"initial_state must be \[N, HV, K, V\]=\(1, 4, 16, 8\)"),
    ("h0-layout", lambda x: x.update(initial_state=torch.zeros(1, 4, 8, 16)), ValueError,
     r"initial_state must be \[N, HV, K, V\]"),
    ("h0-int", lambda x: x.update(initial_state=torch.zeros(1, 4, 16, 8, dtype=torch.int32)), TypeError,
     r"initial_state has dtype"),
    ("cu-float", lambda x: x.update(cu_seqlens=torch.tensor([0.0, 8.0])), TypeError, r"cu_seqlens has dtype"),
    ("cu-2d", lambda x: x.update(cu_seqlens=torch.tensor([[0, 8]])), ValueError, r"cu_seqlens must have 1 dim"),
    ("cu-short", lambda x: x.update(cu_seqlens=torch.tensor([0])), ValueError, r"N \+ 1 >= 2 entries"),
    ("cu-start", lambda x: x.update(cu_seqlens=torch.tensor([1, 8])), ValueError, r"cu_seqlens\[0\] must be 0"),
    ("cu-unsorted", lambda x: x.update(cu_seqlens=torch.tensor([0, 5, 3, 8])), ValueError,
     r"non-decreasing; cu_seqlens\[1\]=5 > cu_seqlens\[2\]=3"),
    ("cu-overflow", lambda x: x.update(cu_seqlens=torch.tensor([0, 9])), ValueError,
     r"cu_seqlens\[-1\]=9 exceeds the token count T=8"),
    ("cu-with-batch", lambda x: x.update({n: torch.cat([x[n], x[n]]) for n in ("q", "k", "v", "g", "beta")},
                                         cu_seqlens=torch.tensor([0, 8])), ValueError, r"needs batch size 1"),
    ("cu-h0-count", lambda x: x.update(cu_seqlens=torch.tensor([0, 3, 8]), initial_state=torch.zeros(1, 4, 16, 8)),
     ValueError, r"N=2 sequences"),
    ("meta-device", lambda x: x.update(v=x["v"].to("meta")), ValueError, r"all tensors must be on one device"),
]


@pytest.mark.parametrize("mutate,exc,msg", [c[1:] for c in BAD_INPUTS], ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_raises(mutate, exc, msg):
    x = _good()
    mutate(x)
    with pytest.raises(exc, match=msg):
        chunk_gated_delta_rule(**x)


def test_head_dims_must_be_positive():
    x = _good(K=16)
    x["q"], x["k"] = x["q"][..., :0], x["k"][..., :0]
    with pytest.raises(ValueError, match="head dims must be positive"):
        chunk_gated_delta_rule(**x)


def test_forced_backend_errors(monkeypatch):
    x = _good()
    monkeypatch.setenv(dispatch.ENV_BACKEND, "sm90")
    with pytest.raises(UnsupportedError, match="needs CUDA tensors on an SM90"):
        chunk_gated_delta_rule(**x)
    monkeypatch.setenv(dispatch.ENV_BACKEND, "cuda-magic")
    with pytest.raises(UnsupportedError, match="is not one of"):
        chunk_gated_delta_rule(**x)
    monkeypatch.setenv(dispatch.ENV_BACKEND, "torch")
    o, ht = chunk_gated_delta_rule(**x, output_final_state=True)
    assert o.shape == (1, 8, 4, 8) and ht.shape == (1, 4, 16, 8) and ht.dtype == torch.float32


def test_forced_sm90_names_the_backward_stages_without_the_head_dims(monkeypatch):
    """Forced sm90 (FLASHDELTA_ARCH stands in for the GPU) at head dims its forward has and its backward lacks
    (K = 128, V = 256): a call that needs the backward raises naming each backward stage without them, and only
    those; the forward alone plans every stage on sm90."""
    pytest.importorskip("tilelang")
    monkeypatch.setenv(dispatch.ENV_BACKEND, "sm90")
    monkeypatch.setenv(dispatch.ENV_ARCH, "sm_90a")
    cuda = torch.device("cuda")
    fwd = dispatch.plan(cuda, 128, 256, torch.bfloat16, need_bwd=False)
    assert list(fwd.backends) == list(stages.FORWARD) and set(fwd.backends.values()) == {"sm90"}
    with pytest.raises(UnsupportedError, match="V=256") as err:
        dispatch.plan(cuda, 128, 256, torch.bfloat16, need_bwd=True)
    named = [s for s in stages.STAGES if f"({s})" in str(err.value)]
    assert named == ["state_recompute", "chunk_bwd", "chunk_dstate"], str(err.value)


def test_dispatch_table_and_arch_override(monkeypatch):
    cpu = torch.device("cpu")
    assert dispatch.resolve(cpu, 128, 128, torch.bfloat16, need_bwd=True) == ("torch", "torch")
    monkeypatch.setenv(dispatch.ENV_ARCH, "sm_90a")
    assert dispatch.current_arch(cpu) == (9, 0)
    monkeypatch.setenv(dispatch.ENV_ARCH, "hopper")
    with pytest.raises(UnsupportedError, match="not an architecture"):
        dispatch.current_arch(cpu)
    assert dispatch.ARCH_TABLE[(9, 0)] == "sm90"


def test_sm90_kernel_set_declares_its_limits():
    kset = dispatch.load("sm90")
    assert kset.has_fwd()
    assert kset.unsupported(128, 128, torch.bfloat16) is None
    assert "K=96" in kset.unsupported(96, 128, torch.bfloat16)
    assert "float32" in kset.unsupported(128, 128, torch.float32)


def test_sm90_params_go_in_as_the_launchers_take_them():
    """beta / initial_state dtypes the SM90 launchers lack (float64) go in as fp32; the ones they have are passed
    through untouched, and each of those has a compile key in every forward build (no KeyError at launch)."""
    from flashdelta import autograd
    from flashdelta.precompile import variants

    sm90, portable_set = dispatch.load("sm90"), dispatch.load("torch")
    x = torch.rand(3, dtype=torch.float64)
    assert autograd._param(x, sm90).dtype == torch.float32 and autograd._param(x, portable_set) is x
    for dt in sm90.param_dtypes:
        y = x.to(dt)
        assert autograd._param(y, sm90) is y
        assert variants([(2, 8)], beta_dtype=dt, h0_dtype=dt, scale=0.1)


def test_kernel_inputs_start_16_byte_aligned():
    """A contiguous view at an odd offset into a larger buffer goes to the kernels as an aligned copy (TMA descriptors
    and 16-byte vector loads take aligned bases); an aligned input goes through as it is."""
    from flashdelta import autograd

    sm90 = dispatch.load("sm90")
    x = torch.randn(2, 3, 4, 8).bfloat16()
    buf = torch.empty(x.numel() + 1, dtype=x.dtype)
    odd = buf[1:].view(x.shape)
    odd.copy_(x)
    assert odd.is_contiguous() and odd.data_ptr() % 16
    for y in (autograd._flat(odd), autograd._param(odd, sm90)):
        assert y.data_ptr() % 16 == 0 and torch.equal(y.reshape(x.shape), x)
    assert autograd._param(x, sm90) is x


def test_docstring_args_match_signature():
    sig = inspect.signature(chunk_gated_delta_rule)
    doc = chunk_gated_delta_rule.__doc__
    documented = re.findall(r"^\s{8}(\w+):", doc, flags=re.M)
    assert documented == list(sig.parameters), (documented, list(sig.parameters))


def test_backward_returns_one_gradient_per_input():
    from flashdelta.autograd import _backward

    n_inputs = len(chunk_gdn_fwd._opoverload._schema.arguments)
    x = _good()
    x = {n: t.requires_grad_(True) for n, t in x.items()}
    o, _ = chunk_gated_delta_rule(**x)

    class Ctx:
        saved_tensors = (x["q"], x["k"], x["v"], x["g"], x["beta"], None, None)
        opts = (0.25, False, False)

    grads = _backward(Ctx, torch.ones_like(o), None)
    assert len(grads) == n_inputs == 15


def test_public_exports():
    assert set(flashdelta.__all__) == {"UnsupportedError", "__version__", "chunk_gated_delta_rule", "chunk_gdn",
                                       "fused_recurrent_gated_delta_rule", "fused_recurrent_gdn", "warmup"}


def test_cu_seqlens_values_revalidated_after_in_place_change():
    x = _good(T=8)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    chunk_gated_delta_rule(**x, cu_seqlens=cu)  # validated, then cached by identity and version
    chunk_gated_delta_rule(**x, cu_seqlens=cu)
    cu[1] = 9
    with pytest.raises(ValueError, match=r"non-decreasing"):
        chunk_gated_delta_rule(**x, cu_seqlens=cu)
    x_short = _good(T=5)
    cu2 = torch.tensor([0, 3, 8], dtype=torch.int32)
    chunk_gated_delta_rule(**x, cu_seqlens=cu2)
    with pytest.raises(ValueError, match=r"exceeds the token count T=5"):
        chunk_gated_delta_rule(**x_short, cu_seqlens=cu2)


def test_fallback_warning_points_at_the_caller(monkeypatch):
    """Under auto, a machine with native kernels that runs the portable path says so once, and the warning is
    attributed to the user's line (not to torch's custom-op dispatch)."""
    pytest.importorskip("tilelang")
    from flashdelta import autograd, dispatch

    monkeypatch.setattr(dispatch, "native_backend", lambda device: "sm90")
    monkeypatch.setattr(autograd, "_warned", set())
    monkeypatch.delenv("FLASHDELTA_BACKEND", raising=False)
    x = make_inputs(Case("warn", (70,), H=1, HV=2, K=32, V=32), dtype=torch.bfloat16)
    with pytest.warns(UserWarning, match="running the portable PyTorch path") as rec:
        chunk_gated_delta_rule(**x)
    assert len(rec) == 1 and rec[0].filename == __file__


def test_inference_mode_dense_and_varlen():
    """Serving engines call under torch.inference_mode(): its tensors have no version counter, so cu_seqlens
    made there is validated on every call (never cached by identity: it can change in place). Same results as
    under no_grad, dense and varlen, and an in-place change is seen."""
    x = _good(T=8)
    cu_values = [0, 3, 8]
    with torch.no_grad():
        o_dense, ht_dense = chunk_gated_delta_rule(**x, output_final_state=True)
        o_var, ht_var = chunk_gated_delta_rule(**x, cu_seqlens=torch.tensor(cu_values), output_final_state=True)
    with torch.inference_mode():
        xi = {n: t.clone() for n, t in x.items()}
        o, ht = chunk_gated_delta_rule(**xi, output_final_state=True)
        assert torch.equal(o, o_dense) and torch.equal(ht, ht_dense)
        cu = torch.tensor(cu_values)
        assert cu.is_inference()
        for _ in range(2):
            o, ht = chunk_gated_delta_rule(**xi, cu_seqlens=cu, output_final_state=True)
            assert torch.equal(o, o_var) and torch.equal(ht, ht_var)
        cu[1] = 9
        with pytest.raises(ValueError, match=r"non-decreasing; cu_seqlens\[1\]=9"):
            chunk_gated_delta_rule(**xi, cu_seqlens=cu)
        cu[1] = 3
        o, _ = chunk_gated_delta_rule(**x, cu_seqlens=cu)  # ordinary inputs, an inference cu_seqlens
        assert torch.equal(o, o_var)
    with torch.no_grad():  # an inference tensor outside inference mode: still no version counter
        o, _ = chunk_gated_delta_rule(**x, cu_seqlens=cu)
    assert torch.equal(o, o_var)


class _HostReads(torch.Tensor):
    """A tensor that records every call that copies its values to the host (a device-to-host copy for a GPU
    tensor), by the function's name, in `reads`. Results are plain tensors (only `.cpu()` of a CPU tensor returns
    the tensor itself)."""
    reads: list = []
    READERS = {"cpu", "to", "tolist", "item", "numpy", "__array__", "__index__", "__int__", "__bool__", "copy_"}

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in cls.READERS and any(type(a) is cls for a in args):
            cls.reads.append(name)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


def _no_backend(monkeypatch):
    """The public function's validation only: the backend call returns zeros (the portable backend reads
    cu_seqlens on the host itself)."""
    from flashdelta import api

    monkeypatch.setattr(api, "forward", lambda q, k, v, *rest: (torch.zeros(v.shape), torch.zeros(0)))


def test_cu_seqlens_cpu_avoids_the_device_to_host_copy(monkeypatch):
    _no_backend(monkeypatch)
    x = _good(T=8)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32).as_subclass(_HostReads)
    _HostReads.reads = []
    for _ in range(3):
        chunk_gated_delta_rule(**x, cu_seqlens=cu, cu_seqlens_cpu=torch.tensor([0, 3, 8]))
    assert _HostReads.reads == []
    with torch.inference_mode():
        cu_inf = torch.tensor([0, 3, 8], dtype=torch.int32).as_subclass(_HostReads)
        chunk_gated_delta_rule(**x, cu_seqlens=cu_inf, cu_seqlens_cpu=torch.tensor([0, 3, 8], dtype=torch.int32))
    assert _HostReads.reads == []
    # without the host copy: one read on the first call with a tensor, none while it is unchanged
    chunk_gated_delta_rule(**x, cu_seqlens=cu)
    assert len(_HostReads.reads) == 1
    chunk_gated_delta_rule(**x, cu_seqlens=cu)
    assert len(_HostReads.reads) == 1


def test_cu_seqlens_cpu_avoids_reading_chunk_indices(monkeypatch):
    """FLA's callers pass chunk_indices beside cu_seqlens_cpu (every call of an inference loop): with the host copy
    only its row count is checked, so no call reads it; without it, its values are read once per tensor."""
    from flashdelta.api import chunk_indices_of

    _no_backend(monkeypatch)
    x = _good(T=8)
    host = torch.tensor([0, 3, 8], dtype=torch.int32)
    cu = host.clone().as_subclass(_HostReads)
    _HostReads.reads = []
    with torch.inference_mode():
        ci = chunk_indices_of(host, 64).as_subclass(_HostReads)
        for _ in range(3):
            chunk_gated_delta_rule(**x, cu_seqlens=cu, cu_seqlens_cpu=host, chunk_indices=ci)
    assert _HostReads.reads == []
    with pytest.raises(ValueError, match=r"chunk_indices has 1 rows, but cu_seqlens has NT=2 chunks"):
        chunk_gated_delta_rule(**x, cu_seqlens=cu, cu_seqlens_cpu=host, chunk_indices=ci[:1])
    ci = chunk_indices_of(host, 64).as_subclass(_HostReads)
    for _ in range(2):
        chunk_gated_delta_rule(**x, cu_seqlens=cu, chunk_indices=ci)
    assert _HostReads.reads.count("cpu") == 2      # cu_seqlens once, chunk_indices once (then cached)


BAD_CU_SECLENS_CPU = [
    ("not-tensor", [0, 3, 8], TypeError, r"cu_seqlens_cpu must be a torch.Tensor"),
    ("float", torch.tensor([0.0, 3.0, 8.0]), TypeError, r"cu_seqlens_cpu has dtype torch.float32"),
    ("shape", torch.tensor([0, 8]), ValueError, r"cu_seqlens_cpu must have cu_seqlens' shape \(3,\), got \(2,\)"),
    ("2d", torch.tensor([[0, 3, 8]]), ValueError, r"cu_seqlens_cpu must have 1 dimensions"),
    ("meta", torch.tensor([0, 3, 8], device="meta"), ValueError, r"cu_seqlens_cpu must be on the CPU"),
    ("start", torch.tensor([1, 3, 8]), ValueError, r"cu_seqlens_cpu\[0\] must be 0"),
    ("unsorted", torch.tensor([0, 5, 3]), ValueError, r"cu_seqlens_cpu must be non-decreasing; cu_seqlens_cpu\[1\]=5"),
    ("overflow", torch.tensor([0, 3, 9]), ValueError, r"cu_seqlens_cpu\[-1\]=9 exceeds the token count T=8"),
]


@pytest.mark.parametrize("host,exc,msg", [c[1:] for c in BAD_CU_SECLENS_CPU], ids=[c[0] for c in BAD_CU_SECLENS_CPU])
def test_bad_cu_seqlens_cpu_raises(host, exc, msg):
    x = _good(T=8)
    with pytest.raises(exc, match=msg):
        chunk_gated_delta_rule(**x, cu_seqlens=torch.tensor([0, 3, 8], dtype=torch.int32), cu_seqlens_cpu=host)
    with pytest.raises(ValueError, match=r"cu_seqlens_cpu is given without cu_seqlens"):
        chunk_gated_delta_rule(**x, cu_seqlens_cpu=torch.tensor([0, 8]))


def test_cu_seqlens_cpu_gives_the_same_result():
    x = _good(T=8)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    o, ht = chunk_gated_delta_rule(**x, cu_seqlens=cu, output_final_state=True)
    o2, ht2 = chunk_gated_delta_rule(**x, cu_seqlens=cu, cu_seqlens_cpu=cu.clone().long(), output_final_state=True)
    assert torch.equal(o, o2) and torch.equal(ht, ht2)


def test_cp_warmup_takes_the_normalised_keys(monkeypatch):
    """With ``use_qk_l2norm_in_kernel`` the CP forward tells the warm-up its keys are l2-normalised
    (``cp_chunk_fwd(keys_normalized=True)``: the condition reads beta alone), without it not; the windows, and so o
    and the final state, are bit-identical to the ones that read the key norms."""
    from flashdelta import cp

    case = Case("warmup-l2norm", (1300, 1, 700), H=2, HV=4, K=16, V=8, gate="bench", pad=3)
    x = make_inputs(case, dtype=torch.float32)
    x["q"], x["k"] = x["q"] * 3, x["k"] * 0.5            # unnormalised: the operator normalises them
    monkeypatch.setenv(cp.ENV_WARMUP, "-4")
    real_fwd, real_windows = cp.cp_chunk_fwd, cp.windows
    calls, reached = [], []

    def windows(*args, **kw):
        win = real_windows(*args, **kw)
        reached.append(bool((~win.fallback & (win.skip_e < cp.SKIP_ALL)).any()))
        return win

    def spy(force=None):
        def fwd(*args, **kw):
            calls.append(kw.get("keys_normalized", False))
            if force is not None:
                kw["keys_normalized"] = force
            return real_fwd(*args, **kw)
        return fwd

    monkeypatch.setattr(cp, "windows", windows)
    results = []
    for l2norm, force in ((True, None), (True, False), (False, None)):
        monkeypatch.setattr(cp, "cp_chunk_fwd", spy(force))
        results.append(chunk_gated_delta_rule(**x, output_final_state=True, use_qk_l2norm_in_kernel=l2norm,
                                              context_parallel=5))
    assert calls == [True, True, False] and all(reached), (calls, reached)
    (o, ht), (o_norms, ht_norms) = results[:2]
    assert torch.equal(o, o_norms) and torch.equal(ht, ht_norms)


@pytest.mark.parametrize("gate", ["plain", "in_kernel"])
def test_backward_reuses_the_forwards_prepare(gate, monkeypatch):
    """With a gradient the forward's g cumsum, A and activated beta are saved: the backward runs no prepare_fwd,
    and its gradients are bit for bit those of a backward that recomputes them."""
    from flashdelta import autograd

    calls = []
    real = autograd._prepare
    monkeypatch.setattr(autograd, "_prepare", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    x = _good(varlen=True, N=2)
    kw = {}
    if gate == "in_kernel":
        gen = torch.Generator().manual_seed(1)
        x["beta"] = torch.randn(x["beta"].shape, generator=gen)          # logits
        kw = dict(use_gate_in_kernel=True, A_log=torch.randn(4, generator=gen), dt_bias=torch.randn(4, generator=gen),
                  use_beta_sigmoid_in_kernel=True)
    leaves = {n: t.clone().requires_grad_(True) for n, t in x.items() if n != "cu_seqlens"}
    o, ht = chunk_gated_delta_rule(**dict(x, **leaves), **kw, output_final_state=True)
    assert len(calls) == 1
    (o.square().sum() + ht.sum()).backward()
    assert len(calls) == 1, "the backward ran prepare_fwd again"
    # the same backward recomputing prepare_fwd (the op without the saved tensors)
    gate_args = (kw.get("A_log"), kw.get("dt_bias"), 1 if kw else 0)
    ref = autograd.chunk_gdn_bwd(x["q"], x["k"], x["v"], x["g"], x["beta"], None, x["cu_seqlens"],
                                 2 * o.detach(), torch.ones_like(ht), 16 ** -0.5, False, False, 0, *gate_args)
    assert len(calls) == 2
    for name, want in zip(("q", "k", "v", "g", "beta"), ref):
        assert torch.equal(leaves[name].grad, want), name


def test_saved_states_decision(monkeypatch):
    """The training forward saves the backward's chunk states only where one native backend runs chunk_fwd and
    chunk_bwd, the CP code (if any) is decided on the host (either pass may be split: a split forward saves them from
    its output pass, a split backward reads them too, and then no partition start states are saved) and
    FLASHDELTA_SAVE_STATES allows it; a traced code (decided inside each op) saves none; a bad value of the variable
    raises at the call, naming it."""
    from flashdelta import autograd, cp

    q, v = torch.zeros(1, 4096, 2, 128, dtype=torch.bfloat16), torch.zeros(1, 4096, 4, 128, dtype=torch.bfloat16)
    native = dispatch.Plan(dict.fromkeys(stages.STAGES, "sm90"), "sm90", {})
    mixed = dispatch.Plan(dict(native.backends, chunk_bwd=dispatch.PORTABLE, state_recompute=dispatch.PORTABLE),
                          "sm90", {})
    portable = dispatch.Plan(dict.fromkeys(stages.STAGES, dispatch.PORTABLE), None, {})
    saves = autograd._saves_states
    monkeypatch.delenv(autograd.ENV_SAVE_STATES, raising=False)
    assert saves(0, native) and not saves(0, mixed) and not saves(0, portable)
    assert not saves(cp.CP_AUTO, native) and not saves(cp.CP_ON, native)
    assert saves(cp.encode(4, 4), native) and saves(cp.encode(0, 4), native) and saves(cp.encode(4, 0), native)
    assert not saves(cp.encode(4, 4), mixed) and not saves(cp.encode(4, 4), portable)
    assert autograd._starts_every(cp.encode(0, 4), 1, q, v, False) == 4      # what it saves where states are not
    monkeypatch.setenv(autograd.ENV_SAVE_STATES, "0")
    assert not saves(0, native) and not saves(cp.encode(0, 4), native)
    meta = autograd._saved_meta(q, q, v, False, True, 0, native, states=3)
    assert meta[autograd._SAVED.index("states")] == ((4096 // 64 + 3 + 1, 4, 128, 128), torch.bfloat16)
    for bad in ("yes", "", "2"):
        monkeypatch.setenv(autograd.ENV_SAVE_STATES, bad)
        with pytest.raises(ValueError, match="FLASHDELTA_SAVE_STATES"):
            chunk_gated_delta_rule(q[:, :64].float().requires_grad_(True), q[:, :64].float(), v[:, :64].float(),
                                   torch.zeros(1, 64, 4), torch.ones(1, 64, 4))
