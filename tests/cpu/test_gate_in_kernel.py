"""The in-kernel gate and beta activation as options of stage `prepare_fwd` (docs/stages.md): the portable stage and
the public call against the float64 twin and float64 autograd, gradients to the raw gate, A_log, dt_bias and the beta
logits included, and the explicit backward of the activations (`gates.gdn_gate_bwd`, `gates.beta_activation_bwd`)
against autograd of the forward transforms."""
import inspect

import pytest
import torch
from _gates import activated, beta_logits, gate_params, raw_gate
from _helpers import Case, assert_close, make_inputs

from flashdelta import chunk_gated_delta_rule, gates, portable
from flashdelta.reference import chunked as ref
from flashdelta.reference import recurrent_gated_delta_rule

CU = torch.tensor([0, 1, 63, 64, 200, 200, 333], dtype=torch.int32)
PAD = 11
# (g dtype, dt_bias, beta_act)
OPTIONS = [(torch.bfloat16, True, 1), (torch.float32, False, 2), (torch.float16, True, 0), (torch.float32, True, 1)]
OPTION_IDS = ["bf16-bias-sigmoid", "fp32-nobias-negeig", "fp16-bias-nobeta", "fp32-bias-sigmoid"]


def _stage_inputs(H=2, HV=6, K=32, g_dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    T = int(CU[-1]) + PAD
    k = torch.nn.functional.normalize(torch.randn(1, T, H, K, generator=gen, dtype=torch.float64), dim=-1)
    A_log, dt_bias = gate_params(HV, generator=gen)
    return (k.float(), raw_gate(1, T, HV, generator=gen).to(g_dtype), beta_logits(1, T, HV, generator=gen).float(),
            A_log.float(), dt_bias.float())


def test_prepare_fwd_takes_the_options_in_every_backend():
    """One signature per stage (docs/stages.md): the SM90 launcher, the portable stage and the float64 twin."""
    from flashdelta.kernels import prepare

    for fn in (prepare.prepare_fwd, portable.prepare_fwd, ref.prepare_fwd):
        params = inspect.signature(fn).parameters
        assert list(params)[:4] == ["k", "g", "beta", "cu_seqlens"]
        for name, default in (("chunk_size", 64), ("A_log", None), ("dt_bias", None), ("beta_act", 0)):
            assert params[name].default == default and params[name].kind is inspect.Parameter.KEYWORD_ONLY, fn


@pytest.mark.parametrize("g_dtype,bias,beta_act", OPTIONS, ids=OPTION_IDS)
def test_portable_prepare_fwd_with_options(g_dtype, bias, beta_act):
    """The portable stage (fp32) against the float64 twin, and equal to the stage without options on the inputs the
    activations give (the options are the activations, nothing else); the activated beta is 0 on padding."""
    k, g, logits, A_log, dt_bias = _stage_inputs(g_dtype=g_dtype)
    dt_bias = dt_bias if bias else None
    out = portable.prepare_fwd(k, g, logits, CU, A_log=A_log, dt_bias=dt_bias, beta_act=beta_act)
    want = ref.prepare_fwd(k, g, logits, CU, A_log=A_log, dt_bias=dt_bias, beta_act=beta_act)
    assert len(out) == len(want) == (3 if beta_act else 2)
    assert out[0].dtype == torch.float32 and want[0].dtype == torch.float64
    assert_close("g_cumsum", out[0], want[0])
    assert_close("A", out[1], want[1], tol=1e-5)
    g_act, beta = activated(g, logits, A_log, dt_bias, beta_act)
    plain = ref.prepare_fwd(k, g_act, beta, CU)
    assert_close("g_cumsum", want[0], plain[0], tol=1e-12)
    assert_close("A", want[1], plain[1], tol=1e-12)
    if beta_act:
        assert out[2].dtype == torch.float32
        assert_close("beta", out[2], want[2], tol=1e-6)
        assert torch.all(want[2][:, -PAD:] == 0) and torch.all(out[2][:, -PAD:] == 0)
        assert_close("beta", want[2][:, :-PAD], beta[:, :-PAD], tol=1e-14)
    assert torch.all(out[0][:, -PAD:] == 0)
    assert torch.isfinite(out[0]).all()       # gates above softplus' threshold hit the floor, not -inf


def test_gate_floor_applies_after_the_activation():
    """Raw gates whose activation is below numerics.GATE_FLOOR (x above the threshold, exp(A_log) = 16) count as the
    floor, as a given g does."""
    k, g, logits, A_log, _ = _stage_inputs()
    g = torch.full_like(g, 30.0)
    A_log = torch.full_like(A_log, 16.0).log()
    g_cumsum, _ = ref.prepare_fwd(k, g, logits, CU, A_log=A_log)
    first = g_cumsum[0, int(CU[4]):int(CU[4]) + 3]           # a sequence's first tokens: -100, -200, -300
    assert torch.equal(first, torch.tensor([[-100.0], [-200.0], [-300.0]], dtype=torch.float64).expand_as(first))


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("beta_act", [1, 2])
def test_activation_backward_matches_autograd(bias, beta_act):
    """gdn_gate_bwd and beta_activation_bwd against float64 autograd of gdn_gate and beta_activation, with raw gates
    on both sides of softplus' threshold and far below it."""
    gen = torch.Generator().manual_seed(1)
    g = raw_gate(2, 97, 5, generator=gen).requires_grad_(True)
    A_log, dt_bias = (t.requires_grad_(True) for t in gate_params(5, generator=gen))
    dt_bias = dt_bias if bias else None
    logits = beta_logits(2, 97, 5, generator=gen).requires_grad_(True)
    dg = torch.randn(2, 97, 5, generator=gen, dtype=torch.float64)
    dbeta = torch.randn(2, 97, 5, generator=gen, dtype=torch.float64)
    y, b = gates.gdn_gate(g, A_log, dt_bias), gates.beta_activation(logits, beta_act)
    leaves = [x for x in (g, A_log, dt_bias, logits) if x is not None]
    want = torch.autograd.grad((y * dg).sum() + (b * dbeta).sum(), leaves)
    dg_raw, dA_log, ddt_bias = gates.gdn_gate_bwd(dg, g.detach(), A_log.detach(), None if dt_bias is None
                                                  else dt_bias.detach())
    dlogit = gates.beta_activation_bwd(dbeta, b.detach(), beta_act)
    got = [dg_raw, dA_log] + ([ddt_bias] if bias else []) + [dlogit]
    assert ddt_bias is None or bias
    for x, w in zip(got, want):
        assert x.dtype == torch.float64
        torch.testing.assert_close(x, w, rtol=1e-12, atol=1e-14)
    dg32 = gates.gdn_gate_bwd(dg.float(), g.detach().bfloat16(), A_log.detach().float())[0]
    assert dg32.dtype == torch.float32


def _public_inputs(case, dtype, g_dtype, beta_dtype, seed=0):
    x = make_inputs(case, dtype=dtype, seed=seed)
    gen = torch.Generator().manual_seed(seed + 100)
    B, T = x["q"].shape[:2]
    A_log, dt_bias = gate_params(case.HV, generator=gen)
    x["g"] = raw_gate(B, T, case.HV, generator=gen).to(g_dtype)
    x["beta"] = beta_logits(B, T, case.HV, generator=gen).to(beta_dtype)
    return x, A_log, dt_bias


def _reference(x, A_log, dt_bias, beta_act):
    """o, final state and gradients by float64 autograd through the token-by-token recurrence, with the activations
    in float64 (`_gates.activated`)."""
    x64 = {n: (t.detach().double().requires_grad_(True) if torch.is_tensor(t) and t.is_floating_point() else t)
           for n, t in x.items()}
    p64 = [None if t is None else t.detach().double().requires_grad_(True) for t in (A_log, dt_bias)]
    g, beta = activated(x64["g"], x64["beta"], p64[0], p64[1], beta_act)
    o, ht = recurrent_gated_delta_rule(x64["q"], x64["k"], x64["v"], g, beta, initial_state=x64["initial_state"],
                                       cu_seqlens=x64["cu_seqlens"], state_v_first=x64["state_v_first"])
    return o, ht, x64, p64


GRAD_NAMES = (("q", "dq"), ("k", "dk"), ("v", "dv"), ("g", "dg"), ("beta", "dbeta"), ("initial_state", "dh0"))


@pytest.mark.parametrize("g_dtype,bias,beta_act", OPTIONS, ids=OPTION_IDS)
def test_public_call_with_options_matches_float64_autograd(g_dtype, bias, beta_act):
    """chunk_gated_delta_rule on the portable path with use_gate_in_kernel and use_beta_sigmoid_in_kernel /
    allow_neg_eigval: o, the final state and every gradient (raw gate, A_log, dt_bias and the logits included)
    against float64 autograd through the recurrence. fp32 q/k/v (the portable path computes in fp32: the gate
    gradients of the hard-decaying heads carry fp32 rounding of ~1e-5, bf16 / fp16 gradients their own rounding)."""
    case = Case("gate-varlen", (1, 63, 64, 130), H=2, HV=4, K=16, V=8, pad=7)
    x, A_log, dt_bias = _public_inputs(case, torch.float32, g_dtype, torch.bfloat16)
    A_log, dt_bias = A_log.float(), (dt_bias.float() if bias else None)
    x = {n: (t.requires_grad_(True) if torch.is_tensor(t) and t.is_floating_point() else t) for n, t in x.items()}
    params = [None if t is None else t.requires_grad_(True) for t in (A_log, dt_bias)]
    o, ht = chunk_gated_delta_rule(**x, output_final_state=True, use_gate_in_kernel=True, A_log=params[0],
                                   dt_bias=params[1], use_beta_sigmoid_in_kernel=beta_act > 0,
                                   allow_neg_eigval=beta_act == 2)
    o_ref, ht_ref, x64, p64 = _reference(x, params[0], params[1], beta_act)
    gen = torch.Generator().manual_seed(5)
    do, dht = torch.randn(o.shape, generator=gen), torch.randn(ht.shape, generator=gen)
    ((o * do).sum() + (ht * dht).sum()).backward()
    ((o_ref * do.double()).sum() + (ht_ref * dht.double()).sum()).backward()
    assert_close("o", o, o_ref, tol=1e-5)
    assert_close("ht", ht, ht_ref, tol=1e-5)
    for n, name in GRAD_NAMES:
        assert x[n].grad.dtype == x[n].dtype
        assert_close(name, x[n].grad, x64[n].grad, tol=1e-2 if x[n].dtype != torch.float32 else 1e-4)
    for p, p_ref in zip(params, p64):
        if p is not None:       # sums over every token of products with the (fp32) gate: fp32 rounding ~1e-5
            assert p.grad.dtype == p.dtype
            assert_close("dg", p.grad, p_ref.grad, tol=1e-4)
    assert torch.all(x["g"].grad[:, -case.pad:] == 0) and torch.all(x["beta"].grad[:, -case.pad:] == 0)


def test_public_call_float64_end_to_end():
    """float64 inputs: the portable path at float64 equals float64 autograd through the recurrence to ~1e-10,
    dense input, every option on."""
    case = Case("gate-dense", (100, 100), H=1, HV=3, K=8, V=4, varlen=False)
    x, A_log, dt_bias = _public_inputs(case, torch.float64, torch.float64, torch.float64, seed=3)
    x["initial_state"] = x["initial_state"].double()
    x = {n: (t.requires_grad_(True) if torch.is_tensor(t) and t.is_floating_point() else t) for n, t in x.items()}
    A_log, dt_bias = A_log.requires_grad_(True), dt_bias.requires_grad_(True)
    o, ht = chunk_gated_delta_rule(**x, output_final_state=True, use_gate_in_kernel=True, A_log=A_log,
                                   dt_bias=dt_bias, use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True)
    o_ref, ht_ref, x64, p64 = _reference(x, A_log, dt_bias, 2)
    gen = torch.Generator().manual_seed(6)
    do, dht = torch.randn(o.shape, generator=gen, dtype=torch.float64), torch.randn(ht.shape, generator=gen,
                                                                                    dtype=torch.float64)
    ((o * do).sum() + (ht * dht).sum()).backward()
    ((o_ref * do).sum() + (ht_ref * dht).sum()).backward()
    assert_close("o", o, o_ref, tol=1e-10)
    assert_close("ht", ht, ht_ref, tol=1e-10)
    for n, name in GRAD_NAMES:
        assert_close(name, x[n].grad, x64[n].grad, tol=1e-9)
    assert_close("dg", A_log.grad, p64[0].grad, tol=1e-9)
    assert_close("dg", dt_bias.grad, p64[1].grad, tol=1e-9)


def test_options_reach_the_stage_not_gates_before_it(monkeypatch):
    """The public call hands the raw gate, A_log, dt_bias and the logits to stage prepare_fwd with its options (one
    code path per backend: no PyTorch activation before the stages)."""
    from flashdelta import dispatch

    seen = {}
    real = portable.prepare_fwd

    def spy(k, g, beta, cu_seqlens, **kw):
        seen.update(g=g, beta=beta, **kw)
        return real(k, g, beta, cu_seqlens, **kw)

    kset = dispatch.load(dispatch.PORTABLE)._replace(prepare_fwd=spy)
    monkeypatch.setitem(dispatch._LOADERS, dispatch.PORTABLE, lambda: kset)
    case = Case("spy", (70,), H=1, HV=2, K=8, V=4)
    x, A_log, dt_bias = _public_inputs(case, torch.float32, torch.bfloat16, torch.bfloat16)
    with torch.no_grad():
        chunk_gated_delta_rule(**x, use_gate_in_kernel=True, A_log=A_log.float(), dt_bias=dt_bias.float(),
                               use_beta_sigmoid_in_kernel=True)
    assert seen["g"].dtype == torch.bfloat16 and torch.equal(seen["g"][0], x["g"][0])
    assert seen["beta"].dtype == torch.bfloat16 and torch.equal(seen["beta"][0], x["beta"][0])
    assert torch.equal(seen["A_log"], A_log.float()) and torch.equal(seen["dt_bias"], dt_bias.float())
    assert seen["beta_act"] == 1
