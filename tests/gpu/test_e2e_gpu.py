"""End to end on a Hopper GPU through the public API: the sm90 forward against the float64 reference
(with the bf16 PyTorch baseline of the same algorithm), CUDA-graph capture, determinism, and the
auto-dispatched backward."""
import pytest
import torch
from _helpers import Case, assert_close, at_odd_offset, make_inputs
from cases import (E2E_BWD, E2E_CASES, E2E_GATE_FLOOR, E2E_GRAPH, E2E_L2NORM, E2E_ORDER, E2E_OTHER_SCALE,
                   E2E_PAIRS, E2E_SAVED_STATES, E2E_SCALE_FP64)

from flashdelta import autograd, chunk_gated_delta_rule, portable
from flashdelta.reference.chunked import chunked_fwd


def _reference(x, l2norm, scale=None):
    x64 = {n: (t.double() if torch.is_tensor(t) and t.is_floating_point() else t) for n, t in x.items()}
    q, k = x64["q"], x64["k"]
    if l2norm:
        q, k = portable.l2norm_fwd(q)[0], portable.l2norm_fwd(k)[0]
    B, T = q.shape[:2]
    cu = x["cu_seqlens"] if x["cu_seqlens"] is not None else torch.arange(B + 1, device=q.device) * T
    flat = lambda t: t.reshape(1, B * T, *t.shape[2:])  # noqa: E731
    args = (flat(q), flat(k), flat(x64["v"]), flat(x64["g"]), flat(x64["beta"]), x64["initial_state"], cu)
    kw = dict(scale=q.shape[-1] ** -0.5 if scale is None else scale, state_v_first=x["state_v_first"])
    o_ref, ht_ref, _, _ = chunked_fwd(*args, **kw)
    o_pt, ht_pt, _, _ = portable.chunked_fwd(*args, **kw, compute_dtype=torch.float32, operand_dtype=torch.bfloat16)
    return o_ref.reshape(x["v"].shape), ht_ref, o_pt.reshape(x["v"].shape), ht_pt


@pytest.mark.parametrize("case,dtype", E2E_PAIRS, ids=[f"{c}-{str(d)[6:]}" for c, d in E2E_PAIRS])
def test_sm90_forward_matches_reference(case, dtype, monkeypatch):
    monkeypatch.setenv("FLASHDELTA_BACKEND", "sm90")
    x = make_inputs(case, dtype=dtype, device="cuda")
    with torch.no_grad():
        o, ht = chunk_gated_delta_rule(**x, output_final_state=True)
    o_ref, ht_ref, o_pt, ht_pt = _reference(x, False)
    assert_close("o", o, o_ref, baseline=o_pt)
    assert_close("ht", ht, ht_ref, baseline=ht_pt)
    if case.pad:
        assert torch.all(o[:, -case.pad:] == 0)


def test_sm90_l2norm_and_scale(monkeypatch):
    monkeypatch.setenv("FLASHDELTA_BACKEND", "sm90")
    x = make_inputs(E2E_L2NORM, dtype=torch.bfloat16, device="cuda")
    x["q"], x["k"] = x["q"] * 3, x["k"] * 0.5  # not normalised: the kernel path must normalise
    with torch.no_grad():
        o, ht = chunk_gated_delta_rule(**x, output_final_state=True, use_qk_l2norm_in_kernel=True)
    o_ref, ht_ref, o_pt, ht_pt = _reference(x, True)
    assert_close("o", o, o_ref, baseline=o_pt)
    assert_close("ht", ht, ht_ref, baseline=ht_pt)


def test_sm90_scale_and_float64_params(monkeypatch):
    """A non-default scale, and float64 beta / initial state with bf16 q, k, v: the kernels take them as fp32 (their
    compute precision), the final state comes back fp32."""
    monkeypatch.setenv("FLASHDELTA_BACKEND", "sm90")
    case = E2E_SCALE_FP64
    x = make_inputs(case, dtype=torch.bfloat16, device="cuda")
    x["beta"], x["initial_state"] = x["beta"].double(), x["initial_state"].double()
    with torch.no_grad():
        o, ht = chunk_gated_delta_rule(**x, scale=E2E_OTHER_SCALE, output_final_state=True)
    assert o.dtype == torch.bfloat16 and ht.dtype == torch.float32
    o_ref, ht_ref, o_pt, ht_pt = _reference(x, False, scale=E2E_OTHER_SCALE)
    assert_close("o", o, o_ref, baseline=o_pt)
    assert_close("ht", ht, ht_ref, baseline=ht_pt)
    assert torch.all(o[:, -case.pad:] == 0)


def test_sm90_forward_is_deterministic_and_graph_capturable(monkeypatch):
    monkeypatch.setenv("FLASHDELTA_BACKEND", "sm90")
    case = E2E_GRAPH
    x = make_inputs(case, dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():
        o1, ht1 = chunk_gated_delta_rule(**x, output_final_state=True)
        o2, ht2 = chunk_gated_delta_rule(**x, output_final_state=True)
        assert torch.equal(o1, o2) and torch.equal(ht1, ht2)
        graph = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            chunk_gated_delta_rule(**x, output_final_state=True)  # warm-up on the capture stream
            with torch.cuda.graph(graph, stream=s):
                o_g, ht_g = chunk_gated_delta_rule(**x, output_final_state=True)
        torch.cuda.current_stream().wait_stream(s)
        x2 = make_inputs(case, dtype=torch.bfloat16, device="cuda", seed=7)
        for n in ("q", "k", "v", "g", "beta", "initial_state"):
            x[n].copy_(x2[n])
        graph.replay()
        o3, ht3 = chunk_gated_delta_rule(**x, output_final_state=True)
    assert torch.equal(o_g, o3) and torch.equal(ht_g, ht3)


def test_sm90_misaligned_inputs(monkeypatch):
    """Every tensor input as a view at an odd offset (contiguous, not 16-byte aligned): the forward and every gradient
    equal the aligned run's bitwise."""
    monkeypatch.setenv("FLASHDELTA_BACKEND", "sm90")
    x = make_inputs(E2E_GRAPH, dtype=torch.bfloat16, device="cuda")
    names = [n for n in ("q", "k", "v", "g", "beta", "initial_state") if x[n] is not None]
    gen = torch.Generator(device="cuda").manual_seed(5)
    runs = []
    for move in (lambda t: t.clone(), at_odd_offset):
        y = dict(x, **{n: move(x[n]).requires_grad_(True) for n in names})
        assert move is not at_odd_offset or all(y[n].data_ptr() % 16 for n in names)
        o, ht = chunk_gated_delta_rule(**y, output_final_state=True)
        gen.manual_seed(5)
        do = torch.randn(o.shape, generator=gen, device="cuda").bfloat16()
        ((o.float() * do).sum() + ht.sum()).backward()
        runs.append([o, ht] + [y[n].grad for n in names])
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_auto_backward_on_gpu(monkeypatch):
    """Auto dispatch with gradients at V = 256, which the SM90 backward lacks: the sm90 forward, and per stage in the
    backward: sm90 prepare_fwd and prepare_bwd, the portable state_recompute and chunk_bwd (fp32, said once in a
    warning), against the float64 recurrence."""
    from flashdelta.reference.recurrent import recurrent_gated_delta_rule

    monkeypatch.delenv("FLASHDELTA_BACKEND", raising=False)
    monkeypatch.setattr(autograd, "_warned", set())
    case = E2E_BWD
    x = make_inputs(case, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    with pytest.warns(UserWarning, match="portable PyTorch path") as rec:
        o, ht = chunk_gated_delta_rule(**x, output_final_state=True)
    msg = str(rec[0].message)
    assert "chunk_bwd" in msg and "state_recompute" in msg and "prepare_bwd" not in msg and "chunk_fwd" not in msg
    x64 = {n: (t.detach().double().requires_grad_(True) if torch.is_tensor(t) and t.is_floating_point() else t)
           for n, t in x.items()}
    o_ref, ht_ref = recurrent_gated_delta_rule(**x64, output_final_state=True)
    gen = torch.Generator(device="cuda").manual_seed(3)
    do = torch.randn(o.shape, generator=gen, device="cuda").bfloat16()
    dht = torch.randn(ht.shape, generator=gen, device="cuda")
    ((o.float() * do).sum() + (ht * dht).sum()).backward()
    ((o_ref * do.double()).sum() + (ht_ref * dht.double()).sum()).backward()
    assert_close("o", o, o_ref)
    for n, tname in (("q", "dq"), ("k", "dk"), ("v", "dv"), ("g", "dg"), ("beta", "dbeta"),
                     ("initial_state", "dh0")):
        assert_close(tname, x[n].grad, x64[n].grad)
    assert torch.all(x["v"].grad[:, -case.pad:] == 0)


def test_sm90_gate_floor(monkeypatch):
    """The issue's reproduction at the SM90 head dims: g = -inf (a full state reset) at the first token, and g = -1e30
    mid-sequence, through the public API on the sm90 backend. o and the final state are finite and match the float64
    recurrence (gates below numerics.GATE_FLOOR count as the floor: docs/numerics.md)."""
    from flashdelta.reference.recurrent import recurrent_gated_delta_rule

    monkeypatch.setenv("FLASHDELTA_BACKEND", "sm90")
    x = make_inputs(E2E_GATE_FLOOR, dtype=torch.bfloat16, device="cuda")
    x["g"][0, 0] = float("-inf")                 # sequence 0's first token, every value head
    x["g"][0, 150, :3] = -1e30                   # sequence 1, mid-chunk
    x["g"][0, 100, 5] = float("-inf")            # sequence 1's first token, one value head
    with torch.no_grad():
        o, ht = chunk_gated_delta_rule(**x, output_final_state=True)
    assert torch.isfinite(o).all() and torch.isfinite(ht).all()
    x64 = {n: (t.double() if torch.is_tensor(t) and t.is_floating_point() else t) for n, t in x.items()}
    o_ref, ht_ref = recurrent_gated_delta_rule(**x64, output_final_state=True)
    assert_close("o", o, o_ref)
    assert_close("ht", ht, ht_ref)


def test_sm90_varlen_under_inference_mode(monkeypatch):
    """Serving engines run under torch.inference_mode(): varlen calls on the sm90 backend with a CUDA cu_seqlens
    created there (no version counter), with and without its host copy, give the no_grad results."""
    monkeypatch.setenv("FLASHDELTA_BACKEND", "sm90")
    case = E2E_CASES[1]
    x = make_inputs(case, dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():
        o_ref, ht_ref = chunk_gated_delta_rule(**x, output_final_state=True)
    with torch.inference_mode():
        cu = x["cu_seqlens"].clone()
        assert cu.is_inference()
        y = dict(x, cu_seqlens=cu)
        o1, ht1 = chunk_gated_delta_rule(**y, output_final_state=True)
        o2, ht2 = chunk_gated_delta_rule(**y, output_final_state=True, cu_seqlens_cpu=cu.cpu())
    for o, ht in ((o1, ht1), (o2, ht2)):
        assert torch.equal(o, o_ref) and torch.equal(ht, ht_ref)


# ------------------------------------------------------------------------ the in-kernel gate and beta activation

GATE_FWD = Case("gate-in-kernel", (700, 1, 1300, 0, 64), H=2, HV=8, K=128, V=128, pad=9)
# the backward at V = 128 (the SM90 chunk_bwd) and V = 256 (auto dispatch: the portable chunk_bwd)
GATE_BWD = [Case("gate-bwd-v128", (300, 0, 133), H=2, HV=8, K=128, V=128, pad=5),
            Case("gate-bwd-v256", (300, 0, 133), H=2, HV=8, K=128, V=256, pad=5)]
# (raw gate dtype, dt_bias, beta_act); A_log fp32, beta's logits bf16
GATE_E2E_OPTIONS = [(torch.bfloat16, True, 1), (torch.float32, False, 2)]
GATE_E2E_IDS = ["bf16-bias-sigmoid", "fp32-nobias-negeig"]


def builds() -> list:
    """(label, builder, args) of the in-kernel gate tests' SM90 builds (this file's other builds are tests/_builds.py
    `_e2e_builds`'): prepare with the options, and the other kernels of the forward (and backward) with the fp32 beta
    that prepare hands on."""
    from flashdelta.kernels import _tl, prepare
    from flashdelta.precompile import variants

    out = {}
    todo = [(GATE_FWD, o, False) for o in GATE_E2E_OPTIONS] + [(c, GATE_E2E_OPTIONS[0], True) for c in GATE_BWD]
    for case, (g_dtype, bias, beta_act), backward in todo:
        todo_case = prepare.launcher_builds(case.H, case.HV, case.K, torch.bfloat16, torch.bfloat16,
                                            num_sms=_tl.DEFAULT_NUM_SMS, g_dtype=g_dtype, a_log_dtype=torch.float32,
                                            dt_bias_dtype=torch.float32 if bias else None, beta_act=beta_act)
        todo_case += [b for b in variants([(case.H, case.HV)], head_dim=(case.K, case.V), dtype=torch.bfloat16,
                                          beta_dtype=torch.float32, initial_state=(case.h0,),
                                          state_v_first=(case.state_v_first,), qk_l2norm=False,
                                          num_sms=_tl.DEFAULT_NUM_SMS, backward=backward, context_parallel=False)
                      if b[1].__name__ not in ("prepare_oneshot.build", "prepare_pipe.build")]
        for label, b, a in todo_case:
            out.setdefault((b.__name__, a), (f"e2e {case.name}: {label}", b, a))
    return list(out.values())


def _gate_e2e_inputs(case, g_dtype, bias, requires_grad=False):
    """make_inputs' q, k, v, h0 (bf16 / fp32) with the raw gate, beta's logits (bf16) and A_log, dt_bias (fp32)."""
    from _gates import beta_logits, gate_params, raw_gate

    x = make_inputs(case, dtype=torch.bfloat16, device="cuda")
    gen = torch.Generator().manual_seed(100)
    B, T = x["q"].shape[:2]
    A_log, dt_bias = gate_params(case.HV, generator=gen)
    x["g"] = raw_gate(B, T, case.HV, generator=gen).to(device="cuda", dtype=g_dtype)
    x["beta"] = beta_logits(B, T, case.HV, generator=gen).to(device="cuda", dtype=torch.bfloat16)
    p = dict(A_log=A_log.float().cuda(), dt_bias=dt_bias.float().cuda() if bias else None)
    if requires_grad:
        for t in list(x.values()) + list(p.values()):
            if torch.is_tensor(t) and t.is_floating_point():
                t.requires_grad_(True)
    return x, p


@pytest.mark.parametrize("g_dtype,bias,beta_act", GATE_E2E_OPTIONS, ids=GATE_E2E_IDS)
def test_sm90_in_kernel_gate_forward(g_dtype, bias, beta_act, monkeypatch):
    """use_gate_in_kernel (raw gate, A_log, dt_bias) and use_beta_sigmoid_in_kernel / allow_neg_eigval on the sm90
    backend: o and the final state against the float64 reference of the activated inputs (with the bf16 PyTorch
    baseline), run-to-run bits, and a CUDA-graph capture that replays them."""
    from _gates import activated

    monkeypatch.setenv("FLASHDELTA_BACKEND", "sm90")
    x, p = _gate_e2e_inputs(GATE_FWD, g_dtype, bias)
    kw = dict(output_final_state=True, use_gate_in_kernel=True, **p, use_beta_sigmoid_in_kernel=True,
              allow_neg_eigval=beta_act == 2)
    with torch.no_grad():
        o, ht = chunk_gated_delta_rule(**x, **kw)
        o2, ht2 = chunk_gated_delta_rule(**x, **kw)
        assert torch.equal(o, o2) and torch.equal(ht, ht2)
        graph = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s), torch.cuda.graph(graph, stream=s):
            o_g, ht_g = chunk_gated_delta_rule(**x, **kw)
        torch.cuda.current_stream().wait_stream(s)
        graph.replay()
        torch.cuda.synchronize()
    assert torch.equal(o_g, o) and torch.equal(ht_g, ht)
    g, beta = activated(x["g"], x["beta"], p["A_log"], p["dt_bias"], beta_act)
    o_ref, ht_ref, o_pt, ht_pt = _reference(dict(x, g=g, beta=beta), False)
    assert_close("o", o, o_ref, baseline=o_pt)
    assert_close("ht", ht, ht_ref, baseline=ht_pt)
    assert torch.all(o[:, -GATE_FWD.pad:] == 0)


@pytest.mark.filterwarnings("ignore:flashdelta. running the portable PyTorch path")
@pytest.mark.parametrize("case", GATE_BWD, ids=str)
def test_in_kernel_gate_backward_on_gpu(case, monkeypatch):
    """Auto dispatch with gradients: every gradient, the raw gate's, A_log's, dt_bias' and the logits' included,
    against float64 autograd through the recurrence of the activated inputs."""
    from _gates import activated

    from flashdelta.reference.recurrent import recurrent_gated_delta_rule

    monkeypatch.delenv("FLASHDELTA_BACKEND", raising=False)
    g_dtype, bias, beta_act = GATE_E2E_OPTIONS[0]
    x, p = _gate_e2e_inputs(case, g_dtype, bias, requires_grad=True)
    o, ht = chunk_gated_delta_rule(**x, **p, output_final_state=True, use_gate_in_kernel=True,
                                   use_beta_sigmoid_in_kernel=True)
    x64 = {n: (t.detach().double().requires_grad_(True) if torch.is_tensor(t) and t.is_floating_point() else t)
           for n, t in x.items()}
    p64 = {n: t.detach().double().requires_grad_(True) for n, t in p.items()}
    g, beta = activated(x64["g"], x64["beta"], p64["A_log"], p64["dt_bias"], beta_act)
    o_ref, ht_ref = recurrent_gated_delta_rule(x64["q"], x64["k"], x64["v"], g, beta,
                                               initial_state=x64["initial_state"], cu_seqlens=x64["cu_seqlens"],
                                               state_v_first=x64["state_v_first"])
    gen = torch.Generator(device="cuda").manual_seed(3)
    do = torch.randn(o.shape, generator=gen, device="cuda").bfloat16()
    dht = torch.randn(ht.shape, generator=gen, device="cuda")
    ((o.float() * do).sum() + (ht * dht).sum()).backward()
    ((o_ref * do.double()).sum() + (ht_ref * dht.double()).sum()).backward()
    assert_close("o", o, o_ref)
    for n, tname in (("q", "dq"), ("k", "dk"), ("v", "dv"), ("g", "dg"), ("beta", "dbeta"),
                     ("initial_state", "dh0")):
        assert_close(tname, x[n].grad, x64[n].grad)
    for n in ("A_log", "dt_bias"):
        assert p[n].grad.dtype == torch.float32
        assert_close("dg", p[n].grad, p64[n].grad)
    assert torch.all(x["g"].grad[:, -case.pad:] == 0) and torch.all(x["beta"].grad[:, -case.pad:] == 0)


def test_sm90_backward_reuses_the_forwards_l2norm(monkeypatch):
    """With use_qk_l2norm_in_kernel on SM90, autograd keeps the forward's normalised q, k and their rstd in place of
    the inputs, and its g cumsum and A: the backward runs no prepare_fwd, and its gradients are bit for bit those of
    a backward that recomputes the l2norm and prepare_fwd."""
    monkeypatch.setenv("FLASHDELTA_BACKEND", "sm90")
    case = E2E_L2NORM
    x = make_inputs(case, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    x["q"], x["k"] = (x["q"] * 3).detach().requires_grad_(True), (x["k"] * 0.5).detach().requires_grad_(True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        o, ht = chunk_gated_delta_rule(**x, output_final_state=True, use_qk_l2norm_in_kernel=True,
                                       context_parallel=False)      # the reference backward below runs unsplit
    ptrs = {t.data_ptr() for t in saved}
    assert x["q"].data_ptr() not in ptrs and x["k"].data_ptr() not in ptrs, "the raw q and k were saved"
    assert any(tuple(t.shape) == (1, o.shape[0] * o.shape[1], case.H, 1) for t in saved), "no rstd saved"
    calls = []
    real = autograd._prepare
    monkeypatch.setattr(autograd, "_prepare", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    gen = torch.Generator(device="cuda").manual_seed(5)
    do = torch.randn(o.shape, generator=gen, device="cuda").bfloat16()
    dht = torch.randn(ht.shape, generator=gen, device="cuda")
    names = ("q", "k", "v", "g", "beta", "initial_state")
    grads = torch.autograd.grad((o, ht), [x[n] for n in names], (do, dht))
    assert not calls, "the backward ran prepare_fwd again"
    detached = {n: (t.detach() if torch.is_tensor(t) else t) for n, t in x.items()}
    ref = autograd.chunk_gdn_bwd(*(detached[n] for n in names), x["cu_seqlens"], do, dht, case.K ** -0.5, True,
                                 case.state_v_first)
    assert calls, "the reference backward recomputes prepare_fwd"
    for n, got, want in zip(names, grads, ref):
        assert torch.equal(got, want.to(got.dtype)), n


@pytest.mark.parametrize("case", E2E_SAVED_STATES, ids=str)
def test_sm90_saved_states_equal_recompute(case, monkeypatch):
    """The training forward saves the state entering every chunk (the backward then runs no state_recompute); every
    gradient is bit for bit the backward's that recomputes them (FLASHDELTA_SAVE_STATES=0), which saves none."""
    from flashdelta import dispatch
    from flashdelta.kernels import fused_fwd, sm90

    monkeypatch.setenv("FLASHDELTA_BACKEND", "sm90")
    calls = []
    counted = sm90.KERNELS._replace(
        state_recompute=lambda *a, **kw: calls.append(1) or fused_fwd.state_recompute(*a, **kw))
    monkeypatch.setitem(dispatch._LOADERS, "sm90", lambda: counted)
    names = ("q", "k", "v", "g", "beta", "initial_state")
    gen = torch.Generator(device="cuda").manual_seed(7)
    grads, shapes = {}, {}
    for env in ("1", "0"):
        monkeypatch.setenv(autograd.ENV_SAVE_STATES, env)
        calls.clear()
        x = make_inputs(case, dtype=torch.bfloat16, device="cuda", requires_grad=True)
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            o, ht = chunk_gated_delta_rule(**x, output_final_state=True, context_parallel=False)
        shapes[env] = [tuple(t.shape) for t in saved if t.dim() == 4 and t.dtype == torch.bfloat16
                       and t.shape[1:] == (case.HV, case.V, case.K) and t.shape[0] != 1]
        if env == "1":
            do = torch.randn(o.shape, generator=gen, device="cuda").bfloat16()
            dht = torch.randn(ht.shape, generator=gen, device="cuda")
        grads[env] = torch.autograd.grad((o, ht), [x[n] for n in names], (do, dht))
        assert len(calls) == (env == "0"), f"FLASHDELTA_SAVE_STATES={env}: {len(calls)} state recomputes"
    T = x["q"].shape[1]
    assert shapes["1"] == [(T // 64 + len(case.seqlens) + 1, case.HV, case.V, case.K)] and shapes["0"] == []
    for n, a, b in zip(names, grads["1"], grads["0"]):
        assert torch.equal(a, b), n
    if case.pad:
        assert torch.all(grads["1"][2][:, T - case.pad:] == 0)


def test_sm90_sequence_order_is_invisible(monkeypatch):
    """The forward's and the backward's kernels take the sequences longest first where their grids exceed one wave:
    each sequence's output, final state and gradients are bit for bit those of the sequence run alone."""
    monkeypatch.setenv("FLASHDELTA_BACKEND", "sm90")
    from flashdelta.kernels import _tl

    case = E2E_ORDER
    x = make_inputs(case, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    cu = x["cu_seqlens"]
    assert not torch.equal(_tl.seq_order(cu, case.HV)[:-1].cpu(), torch.arange(len(case.seqlens), dtype=torch.int32))
    names = ("q", "k", "v", "g", "beta", "initial_state")
    gen = torch.Generator(device="cuda").manual_seed(3)
    T, N = x["q"].shape[1], len(case.seqlens)
    do = torch.randn(1, T, case.HV, case.V, generator=gen, device="cuda").bfloat16()
    dht = torch.randn(N, case.HV, case.K, case.V, generator=gen, device="cuda")

    def run(inputs, cu_seqlens, do, dht):
        o, ht = chunk_gated_delta_rule(**{**inputs, "cu_seqlens": cu_seqlens}, output_final_state=True,
                                       use_qk_l2norm_in_kernel=True, context_parallel=False)
        return (o, ht) + torch.autograd.grad((o, ht), [inputs[n] for n in names], (do, dht))

    full = run(x, cu, do, dht)
    for n in range(N):
        a, b = int(cu[n]), int(cu[n + 1])
        one = {m: x[m].detach()[:, a:b].clone().requires_grad_(True) for m in names[:-1]}
        one["initial_state"] = x["initial_state"].detach()[n:n + 1].clone().requires_grad_(True)
        one["state_v_first"] = x["state_v_first"]
        cu1 = torch.tensor([0, b - a], dtype=cu.dtype, device="cuda")
        got = run(one, cu1, do[:, a:b], dht[n:n + 1])
        want = (full[0][:, a:b], full[1][n:n + 1]) + tuple(
            full[2 + i][n:n + 1] if m == "initial_state" else full[2 + i][:, a:b] for i, m in enumerate(names))
        for name, w, g in zip(("o", "ht") + names, want, got):
            assert torch.equal(w, g), f"sequence {n}: {name} differs from the sequence run alone"
