"""End to end on CPU: the public API (portable backend) against the token-by-token float64 recurrence,
forward and every gradient; torch.compile(fullgraph=True); gradcheck; edge cases of the contract."""
import math

import pytest
import torch
from _helpers import Case, assert_close, make_inputs

from flashdelta import chunk_gated_delta_rule
from flashdelta.reference.recurrent import recurrent_gated_delta_rule

# fp32 compute on bf16-valued inputs: errors vs float64 are fp32 rounding, far below this bound.
FP32_TOL = 2e-5

CASES = [
    Case("T1", (1,)),
    Case("T63", (63,)),
    Case("T64-noh0", (64,), h0=False),
    Case("T65-vfirst", (65,), state_v_first=True),
    Case("T200-gva1", (200,), H=4, HV=4),
    Case("dense-B3-T70", (70, 70, 70), varlen=False),
    Case("dense-B2-gva4-vfirst", (130, 130), H=1, HV=4, varlen=False, state_v_first=True),
    Case("varlen-empty-one-pad", (0, 1, 100, 0, 64), pad=7),
    Case("varlen-KneV", (33, 97), K=16, V=48, HV=8),
    Case("varlen-bench-gate", (129, 40), gate="bench"),
    Case("varlen-zero-gate-noh0", (90, 38), gate="zero", h0=False),
]


def _loss_weights(o, ht, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(o.shape, generator=gen, dtype=torch.float64), torch.randn(ht.shape, generator=gen,
                                                                                 dtype=torch.float64)


@pytest.mark.parametrize("l2norm", [False, True], ids=["plain", "l2norm"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_public_api_matches_recurrence(case, l2norm):
    x = make_inputs(case, dtype=torch.bfloat16, requires_grad=True)
    o, ht = chunk_gated_delta_rule(**x, output_final_state=True, use_qk_l2norm_in_kernel=l2norm)
    assert o.dtype == torch.bfloat16 and ht.dtype == torch.float32
    x64 = {n: (t.detach().double().requires_grad_(True) if torch.is_tensor(t) and t.is_floating_point() else t)
           for n, t in x.items()}
    o_ref, ht_ref = recurrent_gated_delta_rule(**x64, output_final_state=True, use_qk_l2norm_in_kernel=l2norm)
    do, dht = _loss_weights(o_ref, ht_ref)
    do = do.to(o.dtype).double()  # o is bf16, so the gradient reaching the op is bf16 too
    ((o.double() * do).sum() + (ht.double() * dht).sum()).backward()
    ((o_ref * do).sum() + (ht_ref * dht).sum()).backward()
    # o is returned in bf16, so its error is bf16 output rounding (~2e-3), not compute error
    assert_close("o", o, o_ref, tol=4e-3)
    assert_close("ht", ht, ht_ref, tol=FP32_TOL)
    for name in ("q", "k", "v", "g", "beta", "initial_state"):
        if x[name] is None:
            continue
        tname = {"initial_state": "dh0"}.get(name, "d" + name)
        # gradients come back in the input dtype (bf16 for q/k/v/beta): compare to the rounded reference
        ref = x64[name].grad.to(x[name].dtype)
        assert_close(tname, x[name].grad, ref, tol=1e-2 if x[name].dtype == torch.bfloat16 else FP32_TOL)
    if case.pad:
        assert torch.all(o[:, -case.pad:] == 0)
        assert torch.all(x["v"].grad[:, -case.pad:] == 0) and torch.all(x["g"].grad[:, -case.pad:] == 0)


def test_float64_inputs_are_exact():
    case = Case("f64", (70, 0, 5), HV=4)
    x = make_inputs(case, dtype=torch.float64)
    x["g"] = x["g"].double()
    o, ht = chunk_gated_delta_rule(**x, output_final_state=True)
    o_ref, ht_ref = recurrent_gated_delta_rule(**x, output_final_state=True)
    assert o.dtype == torch.float64
    assert_close("o", o, o_ref, tol=1e-10)
    assert_close("ht", ht, ht_ref, tol=1e-6)  # final state is float32 by contract


def test_empty_sequence_keeps_state_and_zero_tokens():
    x = make_inputs(Case("empty", (0, 0), pad=0), dtype=torch.float32)
    o, ht = chunk_gated_delta_rule(**x, output_final_state=True)
    assert o.shape == (1, 0, 4, 32)
    assert torch.equal(ht, x["initial_state"])


@pytest.mark.parametrize("case", [Case("gc-T5", (5,), H=1, HV=2, K=4, V=3),
                                  Case("gc-varlen", (66, 2), H=1, HV=2, K=4, V=4, pad=2, state_v_first=True)],
                         ids=str)
def test_gradcheck_float64(case):
    x = make_inputs(case, dtype=torch.float64, requires_grad=True)
    for n in ("g", "initial_state"):
        x[n] = x[n].detach().double().requires_grad_(True)
    names = ["q", "k", "v", "g", "beta", "initial_state"]

    def f(*tensors):
        kw = dict(x, **dict(zip(names, tensors)))
        o, ht = chunk_gated_delta_rule(**kw, output_final_state=True, use_qk_l2norm_in_kernel=True)
        return o, ht

    assert torch.autograd.gradcheck(f, tuple(x[n] for n in names), fast_mode=True, atol=1e-7, rtol=1e-5)


def test_torch_compile_fullgraph_cpu():
    """Inductor, fullgraph, dynamic shapes: one graph serves two lengths, and matches eager (fwd + grads)."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()    # reset() keeps them: the count below is this test's graphs alone

    def f(q, k, v, g, beta, h0):
        o, ht = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                       use_qk_l2norm_in_kernel=True)
        return (o * o).sum() + ht.square().sum()

    compiled = torch.compile(f, fullgraph=True, dynamic=True)
    for T in (40, 70):
        x = make_inputs(Case("compile", (T, T), varlen=False, H=2, HV=4, K=16, V=16), dtype=torch.float32,
                        requires_grad=True)
        args = [x[n] for n in ("q", "k", "v", "g", "beta", "initial_state")]
        loss_c = compiled(*args)
        grads_c = torch.autograd.grad(loss_c, args)
        loss_e = f(*args)
        grads_e = torch.autograd.grad(loss_e, args)
        torch.testing.assert_close(loss_c, loss_e)
        for gc, ge in zip(grads_c, grads_e):
            torch.testing.assert_close(gc, ge)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1  # no recompilation for the new length


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["nonreentrant", "reentrant"])
def test_checkpoint_gradients_equal_eager(use_reentrant):
    """torch.utils.checkpoint over the op on the portable path: the forward runs again in the backward, and every
    gradient equals the eager one bit for bit."""
    case = Case("ckpt", (100, 0, 37), H=2, HV=4, K=16, V=16, pad=3)

    def loss(q, k, v, g, beta, h0):
        o, ht = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                       cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
        return o.square().sum() + ht.sum()

    x = make_inputs(case, dtype=torch.float32)
    cu = x["cu_seqlens"]

    def grads(run):
        """The leaves' .grad after run(*leaves).backward() (the reentrant checkpoint takes no autograd.grad)."""
        args = [x[n].clone().requires_grad_(True) for n in ("q", "k", "v", "g", "beta", "initial_state")]
        run(*args).backward()
        return [a.grad for a in args]

    eager = grads(loss)
    ckpt = grads(lambda *a: torch.utils.checkpoint.checkpoint(loss, *a, use_reentrant=use_reentrant))
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), eager, ckpt):
        assert torch.equal(a, b), f"checkpoint changed {name}"
        assert a.abs().sum() > 0, f"{name} is zero: the check would be empty"


def test_only_final_state_used_in_loss():
    x = make_inputs(Case("ht-only", (70,)), dtype=torch.float32, requires_grad=True)
    _, ht = chunk_gated_delta_rule(**x, output_final_state=True)
    ht.sum().backward()
    assert x["q"].grad is not None and torch.all(x["q"].grad == 0)  # q only reaches o
    assert x["k"].grad.abs().sum() > 0


# Gates below numerics.GATE_FLOOR (-inf: a full state reset, or a huge finite one) at these tokens of head 0, the
# other gates in [-0.22, -0.02] (a huge gate in the fp32 cumsum would absorb them); the input is two sequences of
# 130 and 70 tokens (chunks [0, 64), [64, 128), [128, 130), then the second sequence).
GATE_RESETS = {
    "first": [0], "mid-chunk": [30], "chunk-end": [63], "whole-chunk": list(range(64, 128)),
    "second-seq-first": [130], "several": [0, 30, 63, 100, 129, 131, 199],
}
GATE_VALUES = {"-inf": -math.inf, "-1e30": -1e30, "-1e4": -1e4}


def _reset_inputs(where, value, dtype, *, varlen=True):
    case = Case("reset", (130, 70) if varlen else (130, 130), H=1, HV=2, K=16, V=16, varlen=varlen)
    x = make_inputs(case, dtype=dtype)
    gen = torch.Generator().manual_seed(2)
    g = -0.02 - 0.2 * torch.rand(x["g"].shape, generator=gen, dtype=torch.float64)  # every token decays
    g[..., [t for t in GATE_RESETS[where] if t < g.shape[1]], 0] = value
    x["g"] = g.to(torch.float64 if dtype == torch.float64 else torch.float32)
    return x


def _with_grads(x):
    return {n: (t.detach().clone().requires_grad_(True) if torch.is_tensor(t) and t.is_floating_point() else t)
            for n, t in x.items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("value", list(GATE_VALUES))
@pytest.mark.parametrize("where", list(GATE_RESETS))
def test_gate_floor_matches_recurrence(where, value, dtype):
    """-inf and very large negative gates reset the state: o, the final state and every gradient are finite and
    match the float64 recurrence (whose autograd is finite there: d exp(g) / dg = 0)."""
    x = _with_grads(_reset_inputs(where, GATE_VALUES[value], dtype))
    o, ht = chunk_gated_delta_rule(**x, output_final_state=True)
    x64 = {n: (t.detach().double().requires_grad_(True) if torch.is_tensor(t) and t.is_floating_point() else t)
           for n, t in x.items()}
    o_ref, ht_ref = recurrent_gated_delta_rule(**x64, output_final_state=True)
    do, dht = _loss_weights(o_ref, ht_ref)
    do = do.to(o.dtype).double()
    ((o.double() * do).sum() + (ht.double() * dht).sum()).backward()
    ((o_ref * do).sum() + (ht_ref * dht).sum()).backward()
    tol = {torch.float64: 1e-10, torch.float32: FP32_TOL, torch.bfloat16: 4e-3}[dtype]
    assert torch.isfinite(o).all() and torch.isfinite(ht).all()
    assert_close("o", o, o_ref, tol=tol)
    assert_close("ht", ht, ht_ref, tol=1e-6 if dtype == torch.float64 else FP32_TOL)
    for name in ("q", "k", "v", "g", "beta", "initial_state"):
        grad, ref = x[name].grad, x64[name].grad
        assert torch.isfinite(grad).all() and torch.isfinite(ref).all(), name
        tname = {"initial_state": "dh0"}.get(name, "d" + name)
        gtol = 1e-2 if x[name].dtype == torch.bfloat16 else (FP32_TOL if x[name].dtype == torch.float32 else 1e-10)
        assert_close(tname, grad, ref.to(x[name].dtype), tol=gtol)


def test_gate_floor_dense_and_nan_gates_stay_nan():
    """Dense input (two rows of 130 tokens, the tokens of "several" below 130 reset in each): the floor acts per
    batch row. A NaN gate is not a floor case: it stays NaN."""
    x = _reset_inputs("several", -math.inf, torch.float32, varlen=False)
    o, ht = chunk_gated_delta_rule(**x, output_final_state=True)
    x64 = {n: (t.double() if torch.is_tensor(t) and t.is_floating_point() else t) for n, t in x.items()}
    o_ref, ht_ref = recurrent_gated_delta_rule(**x64, output_final_state=True)
    assert_close("o", o, o_ref, tol=FP32_TOL)
    assert_close("ht", ht, ht_ref, tol=FP32_TOL)
    x["g"][0, 5, 1] = math.nan
    o, _ = chunk_gated_delta_rule(**x)
    assert torch.isnan(o[0, 5:64, 1]).all() and torch.isfinite(o[1]).all()
