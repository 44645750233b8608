"""FLA 0.6.0's GDN op tests (``tests/ops/test_gdn.py`` in flash-linear-attention: every case of its ``test_chunk*``
and ``test_fused_recurrent*`` tests), as flashdelta's own cases on the CPU.

Each table below lists FLA's parameters case by case, under FLA's test id, and the sizes run here: where FLA's sizes
are too large for the float64 token loop on the CPU tier, the CPU columns say what runs instead (B at most 2; T
above 130 becomes ``128 + T % 64``, which keeps two full chunks and the same ragged last chunk; varlen lengths are
scaled the same way; the forward-only long prefill case keeps 1024 tokens). The inputs are drawn as FLA's test draws
them (distributions, dtypes, masks, which tensors are normalised outside the operator), and every output and gradient
is compared with the float64 recurrence (`flashdelta.reference.recurrent_gated_delta_rule`, autograd for the
gradients) through `_helpers.assert_close` and `numerics.TOLS`. Where FLA compares two flashdelta calls (an in-kernel
transform against the same transform in PyTorch, one state layout against the other), both go against the float64
recurrence, and the layout pairs must also agree with each other.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _helpers import TOLS, assert_close

from flashdelta import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
from flashdelta.reference import recurrent_gated_delta_rule

f16, f32 = torch.float16, torch.float32


def _cases(fmt: str, rows: list) -> list:
    """pytest params from rows ``(FLA's parameters..., CPU overrides)``: the id is FLA's, plus the CPU sizes where
    they differ from FLA's."""
    out = []
    for *fla, cpu in rows:
        note = "" if not cpu else "-cpu:" + ",".join(f"{k}{v}" for k, v in cpu.items())
        out.append(pytest.param(tuple(fla), cpu, id=fmt.format(*fla) + note))
    return out


def _sized(names: str, fla: tuple, cpu: dict) -> dict:
    p = dict(zip(names.split(), fla))
    p.update(cpu)
    return p


def _gate_f64(g_raw, A_log, dt_bias):
    """The Gated DeltaNet gate in float64, from its raw parts (the reference side of ``use_gate_in_kernel``)."""
    x = g_raw.double() + (dt_bias.double() if dt_bias is not None else 0.0)
    return -A_log.double().exp() * F.softplus(x)


# FLA's tests pass a tensor whose largest absolute error is at most 1e-6 (a reference that is ~0 everywhere has a
# relative error of rounding only: dg under test_chunk's gates of -50 per token, gate_logit_normalizer 0.01).
ATOL = 1e-6


def _compare(out: dict, ref: dict) -> None:
    """assert_close every tensor of `out` against `ref`; gate-parameter gradients take dg's tolerance."""
    for name, x in out.items():
        assert_close(name, x, ref[name], tol=TOLS.get(name, TOLS["dg"]), atol=ATOL)


def _grads(o, ht, do, dht, leaves: dict) -> dict:
    """o, ht and the gradient of ``sum(o * do) + sum(ht * dht)`` to each leaf, by name (``d<name>``)."""
    loss = (o * do.to(o.dtype)).sum() + (ht * dht.to(ht.dtype)).sum()
    grads = torch.autograd.grad(loss, list(leaves.values()))
    return {"o": o, "ht": ht, **{"d" + n: gr for n, gr in zip(leaves, grads)}}


def _leaves(**xs) -> dict:
    return {n: x.detach().clone().requires_grad_(True) for n, x in xs.items() if x is not None}


# ---------------------------------------------------------------------------------------------- test_fused_recurrent

FUSED_RECURRENT = _cases("B{}-T{}-H{}-HV{}-D{}-scale{}-gate_logit_normalizer{}-{}", [
    (1, 63, 1, 1, 64, 1, 1, f32, {}),
    (2, 500, 4, 4, 60, 1, 1, f32, {"T": 180}),
    (2, 1000, 2, 8, 128, 1, 0.1, f32, {"T": 168}),
    (3, 1024, 2, 2, 128, 0.1, 1, f32, {"B": 2, "T": 128}),
    (4, 1024, 3, 3, 128, 1, 10, f32, {"B": 2, "T": 128}),
    (4, 2048, 4, 4, 64, 0.1, 1, f32, {"B": 2, "T": 128}),
    (2, 1024, 4, 4, 128, 1, 0.1, f16, {"T": 128}),
    (2, 1024, 4, 8, 128, 1, 10, f16, {"T": 128}),
])


@pytest.mark.parametrize("fla,cpu", FUSED_RECURRENT)
def test_fused_recurrent(fla, cpu):
    p = _sized("B T H HV D scale gln dtype", fla, cpu)
    B, T, H, HV, D, dtype = p["B"], p["T"], p["H"], p["HV"], p["D"], p["dtype"]
    torch.manual_seed(42)
    q, k = torch.randn(B, T, H, D), torch.randn(B, T, H, D)
    v = torch.randn(B, T, HV, D, dtype=dtype)
    beta = torch.rand(B, T, HV, dtype=dtype).sigmoid()
    g = F.logsigmoid(torch.rand(B, T, HV)) / p["gln"]
    h0 = torch.randn(B, HV, D, D)
    o, ht = fused_recurrent_gated_delta_rule(q=q, k=k, v=v, beta=beta, g=g, scale=p["scale"], initial_state=h0,
                                             use_qk_l2norm_in_kernel=True, output_final_state=True)
    ref_o, ref_ht = recurrent_gated_delta_rule(q, k, v, g, beta, scale=p["scale"], initial_state=h0,
                                               use_qk_l2norm_in_kernel=True)
    assert o.dtype == dtype and ht.dtype == f32
    _compare({"o": o, "ht": ht}, {"o": ref_o, "ht": ref_ht})


# ---------------------------------------------------------------------------------------------- test_chunk

CHUNK = _cases("B{}-T{}-H{}-HV{}-D{}-scale{}-gate_logit_normalizer{}-mask_p{}-use_qk_l2norm_in_kernel{}-{}", [
    (4, 1024, 4, 4, 128, 0.1, 1, 1.0, False, f16, {"B": 2, "T": 128}),
    (2, 75, 4, 4, 64, 1, 0.01, 0, False, f16, {}),
    (2, 500, 3, 3, 60, 1, 1, 0, False, f16, {"T": 180}),
    (2, 1000, 3, 3, 64, 0.1, 1, 0.5, False, f16, {"T": 168}),
    (3, 1024, 4, 4, 100, 1, 0.1, 0, False, f16, {"B": 2, "T": 128}),
    (4, 1024, 4, 4, 128, 0.1, 1, 0, True, f16, {"B": 2, "T": 128}),
    (2, 1500, 4, 4, 128, 0.1, 10, 0, False, f16, {"T": 156}),
    (4, 2048, 8, 8, 64, 0.1, 1, 0, False, f16, {"B": 2, "T": 128}),
    (2, 256, 2, 4, 64, 1, 1, 0, False, f16, {"T": 128}),
    (2, 512, 2, 8, 64, 1, 0.1, 0, True, f16, {"T": 128}),
    (2, 1024, 4, 8, 128, 0.1, 1, 0, False, f16, {"T": 128}),
])


def _chunk_inputs(B, T, H, HV, D, dtype, gln=1.0, mask_p=0.0):
    """test_chunk's inputs: q, k, v uniform in [0, 1), beta = sigmoid(uniform) fp32, g = logsigmoid(uniform) / gln
    with a fraction mask_p zeroed, h0 zeros."""
    q = torch.rand(B, T, H, D, dtype=dtype)
    k = torch.rand(B, T, H, D, dtype=dtype)
    v = torch.rand(B, T, HV, D, dtype=dtype)
    beta = torch.rand(B, T, HV).sigmoid()
    g = F.logsigmoid(torch.rand(B, T, HV)) / gln
    g = g * (torch.rand_like(g) > mask_p)
    return q, k, v, beta, g, torch.zeros(B, HV, D, D)


def _normalized(x, l2norm_in_kernel: bool):
    """q or k as FLA's test passes it: normalised outside the operator unless the operator does it."""
    return x if l2norm_in_kernel else F.normalize(x, p=2, dim=-1)


@pytest.mark.parametrize("fla,cpu", CHUNK)
def test_chunk(fla, cpu):
    p = _sized("B T H HV D scale gln mask_p l2 dtype", fla, cpu)
    torch.manual_seed(42)
    q, k, v, beta, g, h0 = _chunk_inputs(p["B"], p["T"], p["H"], p["HV"], p["D"], p["dtype"], p["gln"], p["mask_p"])
    do, dht = torch.randn_like(v), torch.randn_like(h0)
    lv, l2 = _leaves(q=q, k=k, v=v, beta=beta, g=g, h0=h0), p["l2"]
    o, ht = chunk_gated_delta_rule(q=_normalized(lv["q"], l2), k=_normalized(lv["k"], l2), v=lv["v"], g=lv["g"],
                                   beta=lv["beta"], scale=p["scale"], initial_state=lv["h0"], output_final_state=True,
                                   use_qk_l2norm_in_kernel=l2)
    out = _grads(o, ht, do, dht, lv)
    rv = _leaves(q=q, k=k, v=v, beta=beta, g=g, h0=h0)
    ref_o, ref_ht = recurrent_gated_delta_rule(F.normalize(rv["q"].double(), dim=-1),
                                               F.normalize(rv["k"].double(), dim=-1), rv["v"], rv["g"], rv["beta"],
                                               scale=p["scale"], initial_state=rv["h0"])
    _compare(out, _grads(ref_o, ref_ht, do, dht, rv))


# ---------------------------------------------------------------------------------------------- chunk_size

CHUNK_SIZE = _cases("B{}-T{}-H{}-HV{}-D{}-scale{}-gate{}-{}-chunk{}", [
    (1, 64, 2, 4, 32, 0.1, 1.0, f32, chunk_size, {}) for chunk_size in (16, 32, 64)
])


def _chunk_size_run(q, k, v, beta, g, h0, do, dht, scale, chunk_size):
    lv = _leaves(q=q, k=k, v=v, beta=beta, g=g, h0=h0)
    o, ht = chunk_gated_delta_rule(q=F.normalize(lv["q"], p=2, dim=-1), k=F.normalize(lv["k"], p=2, dim=-1),
                                   v=lv["v"], beta=lv["beta"], g=lv["g"], scale=scale, initial_state=lv["h0"],
                                   output_final_state=True, chunk_size=chunk_size)
    return _grads(o, ht, do, dht, lv)


@pytest.mark.parametrize("fla,cpu", CHUNK_SIZE)
def test_chunk_with_chunk_size(fla, cpu):
    """flashdelta accepts FLA's chunk sizes and always computes in chunks of 64: the same bits for every one."""
    p = _sized("B T H HV D scale gln dtype chunk_size", fla, cpu)
    torch.manual_seed(42)
    B, T, H, HV, D = p["B"], p["T"], p["H"], p["HV"], p["D"]
    q, k, v = torch.rand(B, T, H, D), torch.rand(B, T, H, D), torch.rand(B, T, HV, D)
    beta = torch.rand(B, T, HV).sigmoid()
    g = F.logsigmoid(torch.rand(B, T, HV)) / p["gln"]
    h0 = torch.zeros(B, HV, D, D)
    do, dht = torch.randn_like(v), torch.randn_like(h0)
    out = _chunk_size_run(q, k, v, beta, g, h0, do, dht, p["scale"], p["chunk_size"])
    rv = _leaves(q=q, k=k, v=v, beta=beta, g=g, h0=h0)
    ref_o, ref_ht = recurrent_gated_delta_rule(F.normalize(rv["q"].double(), dim=-1),
                                               F.normalize(rv["k"].double(), dim=-1), rv["v"], rv["g"], rv["beta"],
                                               scale=p["scale"], initial_state=rv["h0"])
    _compare(out, _grads(ref_o, ref_ht, do, dht, rv))
    at64 = _chunk_size_run(q, k, v, beta, g, h0, do, dht, p["scale"], 64)
    assert all(torch.equal(out[n], at64[n]) for n in out)


# ---------------------------------------------------------------------------------------------- beta sigmoid in kernel

CHUNK_BETA_SIGMOID = _cases("B{}-T{}-H{}-HV{}-D{}-scale{}-use_qk_l2norm_in_kernel{}-allow_neg_eigval{}-{}", [
    (2, 500, 4, 4, 64, 1, False, False, f16, {"T": 180}),
    (3, 1024, 4, 4, 128, 0.1, True, True, f16, {"B": 2, "T": 128}),
    (2, 1024, 4, 8, 128, 0.1, False, True, f16, {"T": 128}),
    (4, 2048, 8, 8, 64, 0.1, True, False, f16, {"B": 2, "T": 128}),
])


@pytest.mark.parametrize("fla,cpu", CHUNK_BETA_SIGMOID)
def test_chunk_beta_sigmoid_in_kernel(fla, cpu):
    """beta as logits (``use_beta_sigmoid_in_kernel``, ``allow_neg_eigval``): gradients flow to the logits."""
    p = _sized("B T H HV D scale l2 neg dtype", fla, cpu)
    B, T, H, HV, D, dtype, l2 = p["B"], p["T"], p["H"], p["HV"], p["D"], p["dtype"], p["l2"]
    torch.manual_seed(42)
    q, k, v = (torch.rand(B, T, n, D, dtype=dtype) for n in (H, H, HV))
    beta = torch.randn(B, T, HV)
    g = F.logsigmoid(torch.rand(B, T, HV))
    h0 = torch.zeros(B, HV, D, D)
    do, dht = torch.randn_like(v), torch.randn_like(h0)
    lv = _leaves(q=q, k=k, v=v, beta=beta, g=g, h0=h0)
    o, ht = chunk_gated_delta_rule(q=_normalized(lv["q"], l2), k=_normalized(lv["k"], l2), v=lv["v"], g=lv["g"],
                                   beta=lv["beta"], scale=p["scale"], initial_state=lv["h0"], output_final_state=True,
                                   use_qk_l2norm_in_kernel=l2, use_beta_sigmoid_in_kernel=True,
                                   allow_neg_eigval=p["neg"])
    out = _grads(o, ht, do, dht, lv)
    rv = _leaves(q=q, k=k, v=v, beta=beta, g=g, h0=h0)
    ref_o, ref_ht = recurrent_gated_delta_rule(
        F.normalize(rv["q"].double(), dim=-1), F.normalize(rv["k"].double(), dim=-1), rv["v"], rv["g"],
        rv["beta"].double().sigmoid() * (2 if p["neg"] else 1), scale=p["scale"], initial_state=rv["h0"])
    _compare(out, _grads(ref_o, ref_ht, do, dht, rv))


FUSED_RECURRENT_BETA_SIGMOID = _cases("B{}-T{}-H{}-HV{}-D{}-scale{}-allow_neg_eigval{}-{}", [
    (1, 64, 1, 1, 64, 1, False, f32, {}),
    (2, 512, 2, 4, 64, 0.1, True, f16, {"T": 128}),
    (3, 1000, 2, 8, 128, 1, True, f16, {"B": 2, "T": 168}),
    (4, 1024, 4, 4, 128, 0.1, False, f16, {"B": 2, "T": 128}),
])


@pytest.mark.parametrize("fla,cpu", FUSED_RECURRENT_BETA_SIGMOID)
def test_fused_recurrent_beta_sigmoid_in_kernel(fla, cpu):
    p = _sized("B T H HV D scale neg dtype", fla, cpu)
    B, T, H, HV, D, dtype = p["B"], p["T"], p["H"], p["HV"], p["D"], p["dtype"]
    torch.manual_seed(42)
    q, k, v = (torch.randn(B, T, n, D, dtype=dtype) for n in (H, H, HV))
    beta = torch.randn(B, T, HV, dtype=dtype)
    g = F.logsigmoid(torch.rand(B, T, HV))
    h0 = torch.randn(B, HV, D, D)
    o, ht = fused_recurrent_gated_delta_rule(q=q, k=k, v=v, g=g, beta=beta, scale=p["scale"], initial_state=h0,
                                             output_final_state=True, use_qk_l2norm_in_kernel=True,
                                             use_beta_sigmoid_in_kernel=True, allow_neg_eigval=p["neg"])
    ref_o, ref_ht = recurrent_gated_delta_rule(q, k, v, g, beta.double().sigmoid() * (2 if p["neg"] else 1),
                                               scale=p["scale"], initial_state=h0, use_qk_l2norm_in_kernel=True)
    _compare({"o": o, "ht": ht}, {"o": ref_o, "ht": ref_ht})


# ---------------------------------------------------------------------------------------------- state layouts

CHUNK_STATE_V_FIRST = _cases("B{}-T{}-H{}-D{}-scale{}-gate_logit_normalizer{}-{}", [
    (1, 63, 1, 64, 1, 1, f16, {}),
    (2, 500, 3, 60, 1, 1, f16, {"T": 180}),
    (3, 1024, 4, 128, 0.1, 1, f16, {"B": 2, "T": 128}),
    (4, 2048, 8, 64, 0.1, 1, f16, {"B": 2, "T": 128}),
])


@pytest.mark.parametrize("fla,cpu", CHUNK_STATE_V_FIRST)
def test_chunk_state_v_first(fla, cpu):
    """``[N, HV, V, K]`` states in and out: against the float64 recurrence, and equal to the K-first call."""
    p = _sized("B T H D scale gln dtype", fla, cpu)
    B, T, H, D, dtype = p["B"], p["T"], p["H"], p["D"], p["dtype"]
    torch.manual_seed(42)
    q, k, v = (torch.rand(B, T, H, D, dtype=dtype) for _ in range(3))
    beta = torch.rand(B, T, H, dtype=dtype).sigmoid()
    g = F.logsigmoid(torch.rand(B, T, H)) / p["gln"]
    h0_vk = torch.randn(B, H, D, D)
    do, dht_vk = torch.randn_like(v), torch.randn(B, H, D, D)
    runs = {}
    for v_first in (True, False):
        h0 = h0_vk if v_first else h0_vk.transpose(-1, -2).contiguous()
        dht = dht_vk if v_first else dht_vk.transpose(-1, -2)
        lv = _leaves(q=q, k=k, v=v, beta=beta, g=g, h0=h0)
        o, ht = chunk_gated_delta_rule(q=F.normalize(lv["q"], p=2, dim=-1), k=F.normalize(lv["k"], p=2, dim=-1),
                                       v=lv["v"], g=lv["g"], beta=lv["beta"], scale=p["scale"],
                                       initial_state=lv["h0"], output_final_state=True, state_v_first=v_first)
        runs[v_first] = _grads(o, ht, do, dht, lv)
    rv = _leaves(q=q, k=k, v=v, beta=beta, g=g, h0=h0_vk)
    ref_o, ref_ht = recurrent_gated_delta_rule(F.normalize(rv["q"].double(), dim=-1),
                                               F.normalize(rv["k"].double(), dim=-1), rv["v"], rv["g"], rv["beta"],
                                               scale=p["scale"], initial_state=rv["h0"], state_v_first=True)
    _compare(runs[True], _grads(ref_o, ref_ht, do, dht_vk, rv))
    for n, x in runs[False].items():
        y = runs[True][n].transpose(-1, -2) if n in ("ht", "dh0") else runs[True][n]
        assert_close(n, x, y, tol=1e-5)


FUSED_RECURRENT_STATE_V_FIRST = _cases("B{}-T{}-H{}-HV{}-D{}-scale{}-gate_logit_normalizer{}-{}", [
    (1, 63, 1, 1, 64, 1, 1, f32, {}),
    (2, 500, 4, 4, 60, 1, 1, f32, {"T": 180}),
    (2, 1000, 2, 8, 128, 1, 0.1, f32, {"T": 168}),
    (3, 1024, 2, 2, 128, 0.1, 1, f32, {"B": 2, "T": 128}),
    (4, 2048, 4, 4, 64, 0.1, 1, f32, {"B": 2, "T": 128}),
])


@pytest.mark.parametrize("fla,cpu", FUSED_RECURRENT_STATE_V_FIRST)
def test_fused_recurrent_state_v_first(fla, cpu):
    """Both layouts against the float64 recurrence and each other; FLA's deprecated ``transpose_state_layout``
    warns and gives the V-first result, and passing it with ``state_v_first=True`` raises."""
    p = _sized("B T H HV D scale gln dtype", fla, cpu)
    B, T, H, HV, D = p["B"], p["T"], p["H"], p["HV"], p["D"]
    torch.manual_seed(42)
    q, k = torch.randn(B, T, H, D), torch.randn(B, T, H, D)
    v = torch.randn(B, T, HV, D, dtype=p["dtype"])
    beta = torch.rand(B, T, HV, dtype=p["dtype"]).sigmoid()
    g = F.logsigmoid(torch.rand(B, T, HV)) / p["gln"]
    h0_kv = torch.randn(B, HV, D, D)
    kw = dict(q=q, k=k, v=v, beta=beta, g=g, scale=p["scale"], use_qk_l2norm_in_kernel=True, output_final_state=True)
    o_kv, ht_kv = fused_recurrent_gated_delta_rule(**kw, initial_state=h0_kv, state_v_first=False)
    o_vk, ht_vk = fused_recurrent_gated_delta_rule(**kw, initial_state=h0_kv.transpose(-1, -2).contiguous(),
                                                   state_v_first=True)
    ref_o, ref_ht = recurrent_gated_delta_rule(q, k, v, g, beta, scale=p["scale"], initial_state=h0_kv,
                                               use_qk_l2norm_in_kernel=True)
    _compare({"o": o_kv, "ht": ht_kv}, {"o": ref_o, "ht": ref_ht})
    _compare({"o": o_vk, "ht": ht_vk.transpose(-1, -2)}, {"o": ref_o, "ht": ref_ht})
    assert_close("o", o_vk, o_kv, tol=1e-6)
    assert_close("ht", ht_vk.transpose(-1, -2), ht_kv, tol=1e-6)
    with pytest.warns(DeprecationWarning, match="transpose_state_layout"):
        o_t, ht_t = fused_recurrent_gated_delta_rule(**kw, initial_state=h0_kv.transpose(-1, -2).contiguous(),
                                                     transpose_state_layout=True)
    assert torch.equal(o_t, o_vk) and torch.equal(ht_t, ht_vk)
    with pytest.raises(ValueError, match="Cannot pass both"):
        fused_recurrent_gated_delta_rule(q=q, k=k, v=v, g=g, beta=beta, state_v_first=True,
                                         transpose_state_layout=True)


# ---------------------------------------------------------------------------------------------- gate in kernel

FUSED_RECURRENT_GATE = _cases("B{}-T{}-H{}-HV{}-D{}-scale{}-has_dt_bias{}-{}", [
    (1, 64, 1, 1, 64, 1, False, f32, {}),
    (2, 256, 2, 2, 64, 1, True, f32, {"T": 128}),
    (2, 512, 2, 4, 64, 0.1, True, f16, {"T": 128}),
    (3, 1000, 2, 8, 128, 1, False, f16, {"B": 2, "T": 168}),
    (4, 1024, 4, 4, 128, 0.1, True, f16, {"B": 2, "T": 128}),
])


def _gate_params(HV: int, has_dt_bias: bool, A_log_uniform: bool):
    """A_log = log(uniform(1, 16)) (the fused recurrent tests) or randn (the chunk tests); dt_bias randn or None."""
    A_log = torch.log(torch.empty(HV).uniform_(1, 16)) if A_log_uniform else torch.randn(HV)
    return A_log, (torch.randn(HV) if has_dt_bias else None)


@pytest.mark.parametrize("fla,cpu", FUSED_RECURRENT_GATE)
def test_fused_recurrent_gate_in_kernel(fla, cpu):
    p = _sized("B T H HV D scale bias dtype", fla, cpu)
    B, T, H, HV, D, dtype = p["B"], p["T"], p["H"], p["HV"], p["D"], p["dtype"]
    torch.manual_seed(42)
    q, k, v = (torch.randn(B, T, n, D, dtype=dtype) for n in (H, H, HV))
    beta = torch.rand(B, T, HV, dtype=dtype).sigmoid()
    g_raw = torch.randn(B, T, HV)
    A_log, dt_bias = _gate_params(HV, p["bias"], A_log_uniform=True)
    h0 = torch.randn(B, HV, D, D)
    o, ht = fused_recurrent_gated_delta_rule(q=q, k=k, v=v, g=g_raw, beta=beta, scale=p["scale"], initial_state=h0,
                                             output_final_state=True, use_qk_l2norm_in_kernel=True,
                                             use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias)
    ref_o, ref_ht = recurrent_gated_delta_rule(q, k, v, _gate_f64(g_raw, A_log, dt_bias), beta, scale=p["scale"],
                                               initial_state=h0, use_qk_l2norm_in_kernel=True)
    _compare({"o": o, "ht": ht}, {"o": ref_o, "ht": ref_ht})


FUSED_RECURRENT_GATE_VARLEN = _cases("H{}-HV{}-D{}-has_dt_bias{}-cu_seqlens{}-{}", [
    (2, 2, 64, True, [0, 15, 100, 300], f16, {}),
    (2, 4, 64, False, [0, 256, 500, 1000], f16, {"cu_seqlens": [0, 128, 308, 488]}),
    (4, 4, 128, True, [0, 15, 100, 300, 1200, 2000], f16, {"cu_seqlens": [0, 15, 100, 236, 368, 528]}),
])


@pytest.mark.parametrize("fla,cpu", FUSED_RECURRENT_GATE_VARLEN)
def test_fused_recurrent_gate_in_kernel_varlen(fla, cpu):
    p = _sized("H HV D bias cu_seqlens dtype", fla, cpu)
    H, HV, D, dtype = p["H"], p["HV"], p["D"], p["dtype"]
    torch.manual_seed(42)
    cu = torch.tensor(p["cu_seqlens"], dtype=torch.long)
    T, N = int(cu[-1]), len(cu) - 1
    q, k, v = (torch.randn(1, T, n, D, dtype=dtype) for n in (H, H, HV))
    beta = torch.rand(1, T, HV, dtype=dtype).sigmoid()
    g_raw = torch.randn(1, T, HV)
    A_log, dt_bias = _gate_params(HV, p["bias"], A_log_uniform=True)
    h0 = torch.randn(N, HV, D, D)
    o, ht = fused_recurrent_gated_delta_rule(q=q, k=k, v=v, g=g_raw, beta=beta, initial_state=h0,
                                             output_final_state=True, cu_seqlens=cu, use_qk_l2norm_in_kernel=True,
                                             use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias)
    ref_o, ref_ht = recurrent_gated_delta_rule(q, k, v, _gate_f64(g_raw, A_log, dt_bias), beta, initial_state=h0,
                                               cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
    _compare({"o": o, "ht": ht}, {"o": ref_o, "ht": ref_ht})


CHUNK_GATE = _cases("B{}-T{}-H{}-D{}-scale{}-has_dt_bias{}-use_qk_l2norm{}-{}", [
    (2, 75, 4, 64, 1, True, True, f16, {}),
    (2, 500, 3, 60, 1, False, False, f16, {"T": 180}),
    (2, 1000, 3, 64, 0.1, True, False, f16, {"T": 168}),
    (3, 1024, 4, 100, 1, True, True, f16, {"B": 2, "T": 128}),
    (4, 1024, 4, 128, 0.1, False, True, f16, {"B": 2, "T": 128}),
    (4, 2048, 8, 64, 0.1, True, False, f16, {"B": 2, "T": 128}),
])


def _chunk_gate_case(q, k, v, beta, g_raw, A_log, dt_bias, h0, do, dht, *, scale=None, l2=True, cu=None):
    """flashdelta with ``use_gate_in_kernel`` and the float64 recurrence on the float64 gate, both with gradients
    to the raw gate, A_log and dt_bias."""
    runs = []
    for side in ("flashdelta", "reference"):
        lv = _leaves(q=q, k=k, v=v, beta=beta, g=g_raw, h0=h0, A_log=A_log, dt_bias=dt_bias)
        if side == "flashdelta":
            o, ht = chunk_gated_delta_rule(q=_normalized(lv["q"], l2), k=_normalized(lv["k"], l2), v=lv["v"],
                                           g=lv["g"], beta=lv["beta"], scale=scale, initial_state=lv["h0"],
                                           output_final_state=True, cu_seqlens=cu, use_qk_l2norm_in_kernel=l2,
                                           use_gate_in_kernel=True, A_log=lv["A_log"], dt_bias=lv.get("dt_bias"))
        else:
            o, ht = recurrent_gated_delta_rule(F.normalize(lv["q"].double(), dim=-1),
                                               F.normalize(lv["k"].double(), dim=-1), lv["v"],
                                               _gate_f64(lv["g"], lv["A_log"], lv.get("dt_bias")), lv["beta"],
                                               scale=scale, initial_state=lv["h0"], cu_seqlens=cu)
        runs.append(_grads(o, ht, do, dht, lv))
    _compare(*runs)


@pytest.mark.parametrize("fla,cpu", CHUNK_GATE)
def test_chunk_gate_in_kernel(fla, cpu):
    p = _sized("B T H D scale bias l2 dtype", fla, cpu)
    B, T, H, D, dtype = p["B"], p["T"], p["H"], p["D"], p["dtype"]
    torch.manual_seed(42)
    q, k, v = (torch.rand(B, T, H, D, dtype=dtype) for _ in range(3))
    beta = torch.rand(B, T, H).sigmoid()
    g_raw = torch.randn(B, T, H)
    A_log, dt_bias = _gate_params(H, p["bias"], A_log_uniform=False)
    h0 = torch.zeros(B, H, D, D)
    _chunk_gate_case(q, k, v, beta, g_raw, A_log, dt_bias, h0, torch.randn_like(v), torch.randn_like(h0),
                     scale=p["scale"], l2=p["l2"])


CHUNK_GATE_GQA = _cases("B{}-T{}-Hq{}-H{}-D{}-scale{}-has_dt_bias{}-{}", [
    (2, 256, 2, 4, 64, 1, True, f16, {"T": 128}),
    (2, 512, 1, 4, 64, 0.1, False, f16, {"T": 128}),
    (2, 512, 2, 8, 64, 1, True, f16, {"T": 128}),
    (2, 1024, 4, 8, 128, 0.1, True, f16, {"T": 128}),
])


@pytest.mark.parametrize("fla,cpu", CHUNK_GATE_GQA)
def test_chunk_gate_in_kernel_gqa(fla, cpu):
    """In-kernel gate with more value heads than key heads (FLA's Hq is our H, its H our HV)."""
    p = _sized("B T H HV D scale bias dtype", fla, cpu)
    B, T, H, HV, D, dtype = p["B"], p["T"], p["H"], p["HV"], p["D"], p["dtype"]
    torch.manual_seed(42)
    q, k, v = (torch.rand(B, T, n, D, dtype=dtype) for n in (H, H, HV))
    beta = torch.rand(B, T, HV).sigmoid()
    g_raw = torch.randn(B, T, HV)
    A_log, dt_bias = _gate_params(HV, p["bias"], A_log_uniform=False)
    h0 = torch.zeros(B, HV, D, D)
    _chunk_gate_case(q, k, v, beta, g_raw, A_log, dt_bias, h0, torch.randn_like(v), torch.randn_like(h0),
                     scale=p["scale"], l2=True)


CHUNK_GATE_VARLEN = _cases("H{}-D{}-has_dt_bias{}-cu_seqlens{}-{}", [
    (4, 60, True, [0, 15], f16, {}),
    (4, 64, False, [0, 256, 500, 1000], f16, {"cu_seqlens": [0, 128, 308, 488]}),
    (4, 64, True, [0, 256, 500, 1000], f16, {"cu_seqlens": [0, 128, 308, 488]}),
    (4, 100, True, [0, 15, 100, 300, 1200, 2000], f16, {"cu_seqlens": [0, 15, 100, 236, 368, 528]}),
])


@pytest.mark.parametrize("fla,cpu", CHUNK_GATE_VARLEN)
def test_chunk_gate_in_kernel_varlen(fla, cpu):
    p = _sized("H D bias cu_seqlens dtype", fla, cpu)
    H, D, dtype = p["H"], p["D"], p["dtype"]
    torch.manual_seed(42)
    cu = torch.tensor(p["cu_seqlens"], dtype=torch.long)
    T, N = int(cu[-1]), len(cu) - 1
    q, k, v = (torch.randn(1, T, H, D, dtype=dtype) for _ in range(3))
    beta = torch.rand(1, T, H).sigmoid()
    g_raw = torch.randn(1, T, H)
    A_log, dt_bias = _gate_params(H, p["bias"], A_log_uniform=False)
    h0 = torch.randn(N, H, D, D)
    _chunk_gate_case(q, k, v, beta, g_raw, A_log, dt_bias, h0, torch.randn_like(v), torch.rand_like(h0), l2=True,
                     cu=cu)


# ---------------------------------------------------------------------------------------------- varlen

CHUNK_VARLEN = _cases("H{}-HV{}-D{}-mask_p{}-cu_seqlens{}-{}", [
    (4, 4, 60, 0, [0, 15], f16, {}),
    (4, 4, 64, 0, [0, 256, 500, 1000], f16, {"cu_seqlens": [0, 128, 308, 488]}),
    (4, 4, 64, 0.5, [0, 256, 500, 1000], f16, {"cu_seqlens": [0, 128, 308, 488]}),
    (4, 4, 100, 0, [0, 15, 100, 300, 1200, 2000], f16, {"cu_seqlens": [0, 15, 100, 236, 368, 528]}),
    (2, 4, 64, 0, [0, 256, 500, 1000], f16, {"cu_seqlens": [0, 128, 308, 488]}),
    (2, 8, 64, 0, [0, 256, 500, 1000], f16, {"cu_seqlens": [0, 128, 308, 488]}),
])


def _varlen_inputs(T, N, H, HV, D, dtype, mask_p):
    """test_chunk_varlen's inputs: q, v randn, k normalised, g = logsigmoid(uniform) in the input dtype with a
    fraction mask_p zeroed, beta = sigmoid(uniform) fp32, h0 randn in the input dtype."""
    q = torch.randn(1, T, H, D, dtype=dtype)
    k = F.normalize(torch.randn(1, T, H, D), p=2, dim=-1).to(dtype)
    v = torch.randn(1, T, HV, D, dtype=dtype)
    g = F.logsigmoid(torch.rand(1, T, HV, dtype=dtype))
    g = g * (torch.rand_like(g) > mask_p)
    beta = torch.rand(1, T, HV).sigmoid()
    return q, k, v, g, beta, torch.randn(N, HV, D, D, dtype=dtype)


@pytest.mark.parametrize("fla,cpu", CHUNK_VARLEN)
def test_chunk_varlen(fla, cpu):
    p = _sized("H HV D mask_p cu_seqlens dtype", fla, cpu)
    torch.manual_seed(42)
    cu = torch.tensor(p["cu_seqlens"], dtype=torch.long)
    T, N = int(cu[-1]), len(cu) - 1
    q, k, v, g, beta, h0 = _varlen_inputs(T, N, p["H"], p["HV"], p["D"], p["dtype"], p["mask_p"])
    do, dht = torch.randn_like(v), torch.rand_like(h0)
    lv = _leaves(q=q, k=k, v=v, beta=beta, g=g, h0=h0)
    o, ht = chunk_gated_delta_rule(q=lv["q"], k=lv["k"], v=lv["v"], beta=lv["beta"], g=lv["g"],
                                   initial_state=lv["h0"], output_final_state=True, cu_seqlens=cu)
    out = _grads(o, ht, do, dht, lv)
    rv = _leaves(q=q, k=k, v=v, beta=beta, g=g, h0=h0)
    ref_o, ref_ht = recurrent_gated_delta_rule(rv["q"], rv["k"], rv["v"], rv["g"], rv["beta"], initial_state=rv["h0"],
                                               cu_seqlens=cu)
    _compare(out, _grads(ref_o, ref_ht, do, dht, rv))


CHUNK_VARLEN_PREFILL = _cases("H{}-D{}-mask_p{}-cu_seqlens{}-{}", [
    (4, 60, 0, [0, 8192], f16, {"cu_seqlens": [0, 1024]}),
    (4, 60, 0, [0, 15], f16, {}),
    (4, 64, 0, [0, 256, 500, 1000], f16, {"cu_seqlens": [0, 128, 308, 488]}),
    (4, 64, 0.5, [0, 256, 500, 1000], f16, {"cu_seqlens": [0, 128, 308, 488]}),
    (4, 100, 0, [0, 15, 100, 300, 1200, 2000], f16, {"cu_seqlens": [0, 15, 100, 236, 368, 528]}),
])


@pytest.mark.parametrize("fla,cpu", CHUNK_VARLEN_PREFILL)
def test_chunk_varlen_prefill(fla, cpu):
    """Varlen prefill under ``torch.inference_mode()``, as serving engines call it (inference tensors throughout,
    cu_seqlens included)."""
    p = _sized("H D mask_p cu_seqlens dtype", fla, cpu)
    H, D, dtype = p["H"], p["D"], p["dtype"]
    torch.manual_seed(42)
    with torch.inference_mode():
        cu = torch.tensor(p["cu_seqlens"], dtype=torch.long)
        T, N = int(cu[-1]), len(cu) - 1
        q = torch.randn(1, T, H, D, dtype=dtype)
        k = F.normalize(torch.randn(1, T, H, D), p=2, dim=-1).to(dtype)
        v = torch.randn(1, T, H, D, dtype=dtype)
        g = F.logsigmoid(torch.rand(1, T, H, dtype=dtype))
        g = g * (torch.rand_like(g) > p["mask_p"])
        beta = torch.rand(1, T, H, dtype=dtype).sigmoid()
        h0 = torch.randn(N, H, D, D, dtype=dtype)
        o, ht = chunk_gated_delta_rule(q=q, k=k, v=v, beta=beta, g=g, initial_state=h0, output_final_state=True,
                                       cu_seqlens=cu)
        ref_o, ref_ht = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=h0, cu_seqlens=cu)
    _compare({"o": o, "ht": ht}, {"o": ref_o, "ht": ref_ht})


def test_every_fla_case_is_here():
    """One case per FLA case: 47 of test_chunk*, 25 of test_fused_recurrent*."""
    chunk = [CHUNK, CHUNK_SIZE, CHUNK_BETA_SIGMOID, CHUNK_STATE_V_FIRST, CHUNK_GATE, CHUNK_GATE_GQA,
             CHUNK_GATE_VARLEN, CHUNK_VARLEN, CHUNK_VARLEN_PREFILL]
    recurrent = [FUSED_RECURRENT, FUSED_RECURRENT_BETA_SIGMOID, FUSED_RECURRENT_STATE_V_FIRST, FUSED_RECURRENT_GATE,
                 FUSED_RECURRENT_GATE_VARLEN]
    assert sum(map(len, chunk)) == 47 and sum(map(len, recurrent)) == 25
