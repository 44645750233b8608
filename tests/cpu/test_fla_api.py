"""FLA 0.6.0 API parity: the signatures of `chunk_gated_delta_rule` and `fused_recurrent_gated_delta_rule`, FLA's
arguments (in-kernel gate, beta logits, chunk_size, chunk_indices, the deprecated and removed names, cp_context),
their errors and warnings, and the decode path's validation and gradients."""
from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from _helpers import assert_close

import flashdelta
from flashdelta import (UnsupportedError, chunk_gated_delta_rule, chunk_gdn, fused_recurrent_gated_delta_rule,
                        fused_recurrent_gdn)
from flashdelta.api import chunk_indices_of
from flashdelta.gates import beta_sigmoid, gdn_gate
from flashdelta.reference import recurrent_gated_delta_rule

# FLA 0.6.0's parameters in order (fla/ops/gated_delta_rule/chunk.py, fused_recurrent.py), with their defaults;
# the keyword arguments FLA reads from **kwargs follow (keyword-only here).
FLA_CHUNK = [("q", inspect.Parameter.empty), ("k", inspect.Parameter.empty), ("v", inspect.Parameter.empty),
             ("g", inspect.Parameter.empty), ("beta", inspect.Parameter.empty), ("scale", None),
             ("initial_state", None), ("output_final_state", False), ("use_qk_l2norm_in_kernel", False),
             ("use_beta_sigmoid_in_kernel", False), ("allow_neg_eigval", False), ("state_v_first", False),
             ("cu_seqlens", None), ("cu_seqlens_cpu", None), ("chunk_indices", None), ("cp_context", None)]
FLA_CHUNK_KWARGS = {"use_gate_in_kernel": False, "A_log": None, "dt_bias": None, "chunk_size": 64}
FLA_RECURRENT = [("q", inspect.Parameter.empty), ("k", inspect.Parameter.empty), ("v", inspect.Parameter.empty),
                 ("g", None), ("gk", None), ("gv", None), ("beta", None), ("scale", None), ("initial_state", None),
                 ("output_final_state", False), ("use_qk_l2norm_in_kernel", False), ("use_gate_in_kernel", False),
                 ("A_log", None), ("dt_bias", None), ("use_beta_sigmoid_in_kernel", False),
                 ("allow_neg_eigval", False), ("state_v_first", False), ("cu_seqlens", None)]


def _x(B=1, T=70, H=2, HV=4, K=16, V=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return dict(q=F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1),
                k=F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1),
                v=torch.randn(B, T, HV, V, generator=gen), g=-torch.rand(B, T, HV, generator=gen),
                beta=torch.rand(B, T, HV, generator=gen))


CU = torch.tensor([0, 3, 3, 70], dtype=torch.int32)


@pytest.mark.parametrize("fn,fla,kwonly", [(chunk_gated_delta_rule, FLA_CHUNK, FLA_CHUNK_KWARGS),
                                           (fused_recurrent_gated_delta_rule, FLA_RECURRENT, {})],
                         ids=["chunk", "fused_recurrent"])
def test_signature_matches_fla(fn, fla, kwonly):
    params = list(inspect.signature(fn).parameters.values())
    positional = [(p.name, p.default) for p in params if p.kind == p.POSITIONAL_OR_KEYWORD]
    assert positional == fla
    named = {p.name: p.default for p in params if p.kind == p.KEYWORD_ONLY}
    assert {n: named[n] for n in kwonly} == kwonly
    assert "transpose_state_layout" in named


@pytest.mark.parametrize("fn", [chunk_gated_delta_rule, fused_recurrent_gated_delta_rule], ids=["chunk", "recurrent"])
def test_docstring_args_match_signature(fn):
    documented = re.findall(r"^\s{8}(\w+):", fn.__doc__, flags=re.M)
    assert documented == list(inspect.signature(fn).parameters)


def test_aliases_and_exports():
    assert chunk_gdn is chunk_gated_delta_rule and fused_recurrent_gdn is fused_recurrent_gated_delta_rule
    assert {"chunk_gdn", "fused_recurrent_gated_delta_rule", "fused_recurrent_gdn"} <= set(flashdelta.__all__)


def test_flashdelta_works_without_fla():
    """FLA is optional: `import flashdelta` does not import it, and without it `flashdelta.fla_backend` says what
    to install."""
    src = os.path.join(os.path.dirname(__file__), "..", "..", "src")
    code = ("import sys; sys.modules['fla'] = None; import flashdelta, torch; x = torch.rand(1, 3, 1, 4); "
            "flashdelta.chunk_gated_delta_rule(x, x, x, -torch.rand(1, 3, 1), torch.rand(1, 3, 1))\n"
            "try:\n    import flashdelta.fla_backend\nexcept ImportError as e:\n    print('no fla:', e)")
    env = dict(os.environ, PYTHONPATH=src + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert "no fla: flashdelta.fla_backend needs FLA 0.6.0 (pip install fla-core" in out.stdout, out.stdout
    out = subprocess.run([sys.executable, "-c", "import sys, flashdelta; print('fla' in sys.modules)"],
                         capture_output=True, text=True, env=env)
    assert out.stdout.strip() == "False", out.stderr


def test_fla_style_call_with_every_positional_argument():
    """FLA's positional order, every argument given: beta logits, 2 * sigmoid, V-first state, varlen with the host
    copy and the chunk indices; against the float64 recurrence."""
    x = _x()
    h0 = torch.randn(3, 4, 8, 16)
    ci = chunk_indices_of(CU, 64).to(torch.int32)
    o, ht = chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], 0.3, h0, True, False, True, True, True,
                                   CU, CU.long(), ci, None)
    ref_o, ref_ht = recurrent_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], 2 * torch.sigmoid(x["beta"].double()),
                                               0.3, h0, cu_seqlens=CU, state_v_first=True)
    assert_close("o", o, ref_o, tol=1e-5)
    assert_close("ht", ht, ref_ht, tol=1e-5)
    # the same call by keyword gives the same bits
    o2, ht2 = chunk_gated_delta_rule(**x, scale=0.3, initial_state=h0, output_final_state=True,
                                     use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True, state_v_first=True,
                                     cu_seqlens=CU, cu_seqlens_cpu=CU.long(), chunk_indices=ci)
    assert torch.equal(o, o2) and torch.equal(ht, ht2)


def test_fused_recurrent_call_with_every_positional_argument():
    x = _x(T=5)
    gk, gv = -torch.rand(1, 5, 4, 16), -torch.rand(1, 5, 4, 8)
    A_log, dt_bias = torch.randn(4), torch.randn(4)
    cu = torch.tensor([0, 2, 5])
    h0 = torch.randn(2, 4, 8, 16)
    o, ht = fused_recurrent_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], gk, gv, x["beta"], 0.5, h0, True, True,
                                             True, A_log, dt_bias, True, False, True, cu)
    ref_o, ref_ht = recurrent_gated_delta_rule(x["q"], x["k"], x["v"], gdn_gate(x["g"].double(), A_log, dt_bias),
                                               torch.sigmoid(x["beta"].double()), 0.5, h0,
                                               use_qk_l2norm_in_kernel=True, cu_seqlens=cu, state_v_first=True, gk=gk,
                                               gv=gv)
    assert_close("o", o, ref_o, tol=1e-5)
    assert_close("ht", ht, ref_ht, tol=1e-5)


@pytest.mark.parametrize("fn", [chunk_gated_delta_rule, fused_recurrent_gated_delta_rule], ids=["chunk", "recurrent"])
def test_unknown_keyword_raises_type_error_naming_it(fn):
    with pytest.raises(TypeError, match="use_gate_in_kernal"):
        fn(**_x(), use_gate_in_kernal=True)


def test_gate_transforms():
    """gdn_gate and beta_sigmoid in fp32 (float64 for float64), with FLA's softplus threshold (x above 20)."""
    g = torch.tensor([[-30.0, 0.0, 19.0, 25.0]])
    A_log, dt_bias = torch.tensor([0.0, 1.0, -1.0, 2.0]), torch.tensor([0.0, 0.5, 0.5, 0.0])
    want = -A_log.double().exp() * F.softplus(g.double() + dt_bias.double())
    assert gdn_gate(g, A_log, dt_bias).dtype == torch.float32
    assert gdn_gate(g.double(), A_log, dt_bias).dtype == torch.float64
    assert_close("g_cumsum", gdn_gate(g.bfloat16(), A_log, dt_bias), -A_log.exp() * F.softplus(
        g.bfloat16().float() + dt_bias))
    assert_close("g_cumsum", gdn_gate(g, A_log, dt_bias), want)
    assert gdn_gate(g, A_log)[0, 3] == -A_log[3].exp() * 25.0    # softplus(25) is 25 exactly
    b = torch.tensor([-3.0, 0.0, 3.0], dtype=torch.bfloat16)
    assert beta_sigmoid(b).dtype == torch.float32
    assert torch.equal(beta_sigmoid(b, True), 2 * torch.sigmoid(b.float()))


def test_gate_in_kernel_gradients_float64():
    """gradcheck through the public call with the in-kernel gate and beta logits: float64 end to end."""
    x = {n: t.double() for n, t in _x(T=9, K=4, V=3).items()}
    x["g"] = torch.randn(1, 9, 4, dtype=torch.float64)
    A_log, dt_bias = torch.randn(4, dtype=torch.float64), torch.randn(4, dtype=torch.float64)
    h0 = torch.randn(1, 4, 4, 3, dtype=torch.float64)
    leaves = [t.requires_grad_(True) for t in (x["q"], x["k"], x["v"], x["g"], x["beta"], A_log, dt_bias, h0)]

    def f(q, k, v, g, beta, A_log, dt_bias, h0):
        o, ht = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                       use_beta_sigmoid_in_kernel=True, use_gate_in_kernel=True, A_log=A_log,
                                       dt_bias=dt_bias)
        return o, ht

    assert torch.autograd.gradcheck(f, leaves, fast_mode=True, atol=1e-7, rtol=1e-5)


def test_a_log_ignored_without_the_in_kernel_gate():
    """As in FLA, A_log and dt_bias do nothing unless use_gate_in_kernel=True (they are not even validated)."""
    x = _x()
    o, _ = chunk_gated_delta_rule(**x)
    o2, _ = chunk_gated_delta_rule(**x, A_log="not a tensor", dt_bias=torch.ones(4))
    assert torch.equal(o, o2)


def test_transpose_state_layout_is_a_deprecated_alias():
    x = _x()
    h0 = torch.randn(1, 4, 8, 16)
    o, ht = chunk_gated_delta_rule(**x, initial_state=h0, output_final_state=True, state_v_first=True)
    with pytest.warns(DeprecationWarning, match="`transpose_state_layout` is deprecated and renamed to "
                                                "`state_v_first`") as rec:
        o2, ht2 = chunk_gated_delta_rule(**x, initial_state=h0, output_final_state=True, transpose_state_layout=True)
    assert torch.equal(o, o2) and torch.equal(ht, ht2) and rec[0].filename == __file__
    with pytest.raises(ValueError, match="Cannot pass both `state_v_first` and the deprecated"):
        chunk_gated_delta_rule(**x, state_v_first=True, transpose_state_layout=True)
    with pytest.raises(TypeError, match="state_v_first must be a bool"), pytest.warns(DeprecationWarning):
        chunk_gated_delta_rule(**x, transpose_state_layout="yes")
    with pytest.warns(DeprecationWarning, match="transpose_state_layout") as rec:
        fused_recurrent_gated_delta_rule(**x, transpose_state_layout=False)
    assert rec[0].filename == __file__


def test_head_first_raises_flas_error():
    for value in (True, False):
        with pytest.raises(DeprecationWarning, match=r"head_first has been removed. Inputs must be in "
                                                     r"`\[B, T, H, ...\]` format."):
            chunk_gated_delta_rule(**_x(), head_first=value)


def test_cp_context_is_not_supported_yet():
    with pytest.raises(UnsupportedError, match="cp_context: context parallelism across GPUs"):
        chunk_gated_delta_rule(**_x(), cp_context=object())


def test_chunk_size():
    """FLA's chunk sizes are accepted and change nothing (flashdelta computes in chunks of 64); others raise FLA's
    error."""
    x = _x()
    o, _ = chunk_gated_delta_rule(**x)
    for cs in (16, 32, 64):
        assert torch.equal(chunk_gated_delta_rule(**x, chunk_size=cs)[0], o)
    for cs in (128, 8, True, "64"):
        with pytest.raises(ValueError, match=r"`chunk_size` must be 16, 32, or 64 for Gated Delta Rule, got"):
            chunk_gated_delta_rule(**x, chunk_size=cs)


def test_chunk_indices_checked_against_cu_seqlens():
    x = _x()
    o, _ = chunk_gated_delta_rule(**x, cu_seqlens=CU)
    for cs in (16, 64):
        ci = chunk_indices_of(CU, cs)
        assert ci.tolist() == ([[0, 0], [2, 0], [2, 1], [2, 2], [2, 3], [2, 4]] if cs == 16 else [[0, 0], [2, 0],
                                                                                                 [2, 1]])
        o2, _ = chunk_gated_delta_rule(**x, cu_seqlens=CU, chunk_indices=ci, chunk_size=cs)
        assert torch.equal(o, o2)
        o3, _ = chunk_gated_delta_rule(**x, cu_seqlens=CU, cu_seqlens_cpu=CU.long(), chunk_indices=ci.int(),
                                       chunk_size=cs)
        assert torch.equal(o, o3)
    with pytest.raises(ValueError, match=r"chunk_indices has 6 rows, but cu_seqlens has NT=3 chunks of "
                                         r"chunk_size=64"):
        chunk_gated_delta_rule(**x, cu_seqlens=CU, chunk_indices=chunk_indices_of(CU, 16))
    bad = chunk_indices_of(CU, 64)
    bad[1, 0] = 1
    with pytest.raises(ValueError, match=r"chunk_indices\[1\]=\[1, 0\] does not match cu_seqlens at chunk_size=64, "
                                         r"which gives \[2, 0\]"):
        chunk_gated_delta_rule(**x, cu_seqlens=CU, chunk_indices=bad)
    good = chunk_indices_of(CU, 64)
    chunk_gated_delta_rule(**x, cu_seqlens=CU, chunk_indices=good)
    good[1, 0] = 1          # changed in place after a check: seen (version counter)
    with pytest.raises(ValueError, match=r"does not match cu_seqlens"):
        chunk_gated_delta_rule(**x, cu_seqlens=CU, chunk_indices=good)
    cu2 = torch.tensor([0, 3, 70, 70], dtype=torch.int32)   # same chunk count, other sequences
    with pytest.raises(ValueError, match=r"chunk_indices\[1\]=\[2, 0\] does not match"):
        chunk_gated_delta_rule(**x, cu_seqlens=cu2, chunk_indices=chunk_indices_of(CU, 64))


BAD_CHUNK_INDICES = [
    ("float", torch.zeros(3, 2), TypeError, r"chunk_indices has dtype torch.float32"),
    ("1d", torch.zeros(6, dtype=torch.long), ValueError, r"chunk_indices must have 2 dimensions"),
    ("3-columns", torch.zeros(3, 3, dtype=torch.long), ValueError, r"chunk_indices must be \[NT, 2\]"),
    ("meta", torch.zeros(3, 2, dtype=torch.long, device="meta"), ValueError, r"chunk_indices is on meta"),
    ("list", [[0, 0]], TypeError, r"chunk_indices must be a torch.Tensor"),
]


@pytest.mark.parametrize("ci,exc,msg", [c[1:] for c in BAD_CHUNK_INDICES], ids=[c[0] for c in BAD_CHUNK_INDICES])
def test_bad_chunk_indices_raise(ci, exc, msg):
    with pytest.raises(exc, match=msg):
        chunk_gated_delta_rule(**_x(), cu_seqlens=CU, chunk_indices=ci)


def test_chunk_indices_without_cu_seqlens():
    with pytest.raises(ValueError, match="chunk_indices is given without cu_seqlens"):
        chunk_gated_delta_rule(**_x(), chunk_indices=chunk_indices_of(CU, 64))


def _gate(HV=4, **over):
    kw = dict(use_gate_in_kernel=True, A_log=torch.randn(HV), dt_bias=torch.randn(HV))
    kw.update(over)
    return kw


# (id, keyword overrides of a valid in-kernel-gate call, exception, message)
BAD_NEW_ARGS = [
    ("A_log-missing", _gate(A_log=None), ValueError, r"A_log must be provided when use_gate_in_kernel=True"),
    ("A_log-shape", _gate(A_log=torch.zeros(2)), ValueError, r"A_log must be \[HV\]=\(4,\)"),
    ("A_log-2d", _gate(A_log=torch.zeros(4, 1)), ValueError, r"A_log must have 1 dimensions"),
    ("A_log-int", _gate(A_log=torch.zeros(4, dtype=torch.int32)), TypeError, r"A_log has dtype torch.int32"),
    ("A_log-meta", _gate(A_log=torch.zeros(4, device="meta")), ValueError, r"A_log is on meta"),
    ("dt_bias-shape", _gate(dt_bias=torch.zeros(3)), ValueError, r"dt_bias must be \[HV\]=\(4,\)"),
    ("dt_bias-list", _gate(dt_bias=[0.0] * 4), TypeError, r"dt_bias must be a torch.Tensor"),
    ("gate-flag-int", _gate(use_gate_in_kernel=1), TypeError, r"use_gate_in_kernel must be a bool"),
    ("sigmoid-flag", dict(use_beta_sigmoid_in_kernel="yes"), TypeError, r"use_beta_sigmoid_in_kernel must be a bool"),
    ("neg-eigval-alone", dict(allow_neg_eigval=True), ValueError,
     r"`allow_neg_eigval=True` requires `use_beta_sigmoid_in_kernel=True`"),
    ("neg-eigval-int", dict(allow_neg_eigval=1, use_beta_sigmoid_in_kernel=True), TypeError,
     r"allow_neg_eigval must be a bool"),
]


@pytest.mark.parametrize("fn", [chunk_gated_delta_rule, fused_recurrent_gated_delta_rule], ids=["chunk", "recurrent"])
@pytest.mark.parametrize("over,exc,msg", [c[1:] for c in BAD_NEW_ARGS], ids=[c[0] for c in BAD_NEW_ARGS])
def test_bad_new_arguments_raise(fn, over, exc, msg):
    with pytest.raises(exc, match=msg):
        fn(**_x(), **over)


# ---------------------------------------------------------------------------------------------- decode

# (id, overrides of a valid fused_recurrent call, exception, message)
BAD_RECURRENT = [
    ("q-3d", lambda x: x.update(q=x["q"][0]), ValueError, r"q must have 4 dimensions"),
    ("q-int", lambda x: x.update(q=x["q"].int()), TypeError, r"q has dtype torch.int32"),
    ("k-dtype", lambda x: x.update(k=x["k"].double()), TypeError, r"q and k must share one dtype"),
    ("k-shape", lambda x: x.update(k=x["k"][:, :, :1]), ValueError, r"k must have q's shape"),
    ("v-T", lambda x: x.update(v=x["v"][:, :5]), ValueError, r"v must be \[B, T, HV, V\]"),
    ("gva", lambda x: x.update(v=x["v"][:, :, :3], g=None, beta=None), ValueError, r"HV=3 .* multiple of .* H=2"),
    ("g-shape", lambda x: x.update(g=x["g"][..., :2]), ValueError, r"g must be \[B, T, HV\]=\(1, 70, 4\)"),
    ("g-list", lambda x: x.update(g=[0.0]), TypeError, r"g must be a torch.Tensor or None"),
    ("gk-shape", lambda x: x.update(gk=torch.zeros(1, 70, 4, 8)), ValueError, r"gk must be \[B, T, HV, K\]"),
    ("gv-int", lambda x: x.update(gv=torch.zeros(1, 70, 4, 8, dtype=torch.long)), TypeError, r"gv has dtype"),
    ("beta-shape", lambda x: x.update(beta=x["beta"][..., None]), ValueError,
     r"beta must be \[B, T, HV\]=\(1, 70, 4\) or \[B, T, HV, V\]=\(1, 70, 4, 8\)"),
    ("scale-str", lambda x: x.update(scale="1"), TypeError, r"scale must be a finite real"),
    ("flag", lambda x: x.update(output_final_state=None), TypeError, r"output_final_state must be a bool"),
    ("h0-shape", lambda x: x.update(initial_state=torch.zeros(1, 4, 8, 16)), ValueError,
     r"initial_state must be \[N, HV, K, V\]=\(1, 4, 16, 8\)"),
    ("cu-batch", lambda x: x.update({n: torch.cat([x[n], x[n]]) for n in ("q", "k", "v", "g", "beta")},
                                    cu_seqlens=torch.tensor([0, 70])), ValueError, r"needs batch size 1"),
    ("cu-overflow", lambda x: x.update(cu_seqlens=torch.tensor([0, 71])), ValueError,
     r"cu_seqlens\[-1\]=71 exceeds the token count T=70"),
    ("cu-h0", lambda x: x.update(cu_seqlens=CU, initial_state=torch.zeros(1, 4, 16, 8)), ValueError, r"N=3"),
    ("gate-no-g", lambda x: x.update(g=None, use_gate_in_kernel=True, A_log=torch.zeros(4)), ValueError,
     r"g \(the raw gate\) must be provided"),
    ("device", lambda x: x.update(gk=torch.zeros(1, 70, 4, 16, device="meta")), ValueError, r"one device"),
    ("both-layouts", lambda x: x.update(state_v_first=True, transpose_state_layout=False), ValueError,
     r"Cannot pass both"),
]


@pytest.mark.parametrize("mutate,exc,msg", [c[1:] for c in BAD_RECURRENT], ids=[c[0] for c in BAD_RECURRENT])
def test_fused_recurrent_bad_input_raises(mutate, exc, msg):
    x = _x()
    mutate(x)
    with pytest.raises(exc, match=msg):
        fused_recurrent_gated_delta_rule(**x)


def test_fused_recurrent_decode_steps_continue_a_prefill():
    """Prefill with the chunked operator, then decode token by token, varlen, from the state in V-first layout: the
    same outputs and state as the float64 recurrence over the whole sequences; o in v's dtype."""
    x = {n: t.to(torch.bfloat16) if n in ("q", "k", "v") else t for n, t in _x(T=70).items()}
    cu_all = [0, 30, 31, 70]
    pre, steps = [0, 27, 27, 63], 3     # each sequence's prefill length, then 3 decode steps (1 token each)
    lens = [cu_all[i + 1] - cu_all[i] for i in range(3)]
    assert [lens[i] - (pre[i + 1] - pre[i]) for i in range(3)] == [3, 1, 3]
    take = lambda idx: {n: t[:, idx] for n, t in x.items()}  # noqa: E731
    pre_idx = [t for i in range(3) for t in range(cu_all[i], cu_all[i] + pre[i + 1] - pre[i])]
    _, h = chunk_gated_delta_rule(**take(pre_idx), cu_seqlens=torch.tensor(pre), output_final_state=True,
                                  state_v_first=True)
    outs = {}
    for s in range(steps):
        live = [i for i in range(3) if pre[i + 1] - pre[i] + s < lens[i]]
        idx = [cu_all[i] + pre[i + 1] - pre[i] + s for i in live]
        o, h_live = fused_recurrent_gated_delta_rule(**take(idx), cu_seqlens=torch.arange(len(live) + 1),
                                                     initial_state=h[live], output_final_state=True,
                                                     state_v_first=True)
        assert o.dtype == torch.bfloat16 and h_live.dtype == torch.float32
        h = h.clone()
        h[live] = h_live
        outs.update({t: o[0, j] for j, t in enumerate(idx)})
    ref_o, ref_ht = recurrent_gated_delta_rule(**x, cu_seqlens=torch.tensor(cu_all), state_v_first=True)
    decoded = sorted(outs)
    assert_close("o", torch.stack([outs[t] for t in decoded]), ref_o[0, decoded])
    assert_close("ht", h, ref_ht)


def test_fused_recurrent_gradients_match_the_reference():
    """The decode path is differentiable (autograd through its PyTorch ops): every input's gradient against the
    float64 recurrence's, varlen with a ragged batch, per-channel gates and beta."""
    x = _x(T=20)
    x["gk"], x["gv"] = -torch.rand(1, 20, 4, 16), -torch.rand(1, 20, 4, 8)
    x["beta"] = torch.rand(1, 20, 4, 8)
    x["initial_state"] = torch.randn(3, 4, 16, 8)
    cu = torch.tensor([0, 1, 12, 19])
    do, dht = torch.randn(1, 20, 4, 8), torch.randn(3, 4, 16, 8)
    grads = []
    for fn in (fused_recurrent_gated_delta_rule, recurrent_gated_delta_rule):
        leaves = {n: t.clone().requires_grad_(True) for n, t in x.items()}
        if fn is recurrent_gated_delta_rule:
            o, ht = fn(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"],
                       initial_state=leaves["initial_state"], cu_seqlens=cu, gk=leaves["gk"], gv=leaves["gv"])
        else:
            o, ht = fn(**leaves, cu_seqlens=cu, output_final_state=True)
        grads.append(torch.autograd.grad((o * do.to(o.dtype)).sum() + (ht * dht.to(ht.dtype)).sum(),
                                         list(leaves.values())))
        assert o[0, 19:].abs().max() == 0              # the padding token
    for name, a, b in zip(x, *grads):
        assert_close("dg" if name in ("g", "gk", "gv", "beta") else "dq", a, b, tol=1e-5)


def test_fused_recurrent_dense_traces_with_torch_compile():
    """Dense decode reads nothing on the host: torch.compile(fullgraph=True) traces it."""
    torch._dynamo.reset()
    x = _x(B=3, T=1)
    h0 = torch.randn(3, 4, 16, 8)

    def step(q, k, v, g, beta, h0):
        return fused_recurrent_gated_delta_rule(q, k, v, g, beta=beta, initial_state=h0, output_final_state=True,
                                                use_qk_l2norm_in_kernel=True)

    o, ht = torch.compile(step, fullgraph=True, backend="aot_eager")(**x, h0=h0)
    o_ref, ht_ref = step(**x, h0=h0)
    assert_close("o", o, o_ref, tol=1e-6)
    assert_close("ht", ht, ht_ref, tol=1e-6)
    torch._dynamo.reset()


def test_fused_recurrent_does_not_alias_the_initial_state():
    x = _x(T=0)
    h0 = torch.randn(1, 4, 16, 8)
    o, ht = fused_recurrent_gated_delta_rule(**x, initial_state=h0, output_final_state=True)
    assert o.shape == (1, 0, 4, 8) and torch.equal(ht, h0) and ht.data_ptr() != h0.data_ptr()
    _, ht = fused_recurrent_gated_delta_rule(**_x(T=3), output_final_state=False)
    assert ht is None
