"""The float64 chunked reference and the portable path against the token-by-token recurrence.

- chunked float64 (reference.chunked) == recurrence to ~1e-10: o, final state and every gradient
  (q, k, v, g, beta, initial_state) against torch.autograd of the recurrence, l2norm on and off;
- each stage's float64 twin against an independent definition (A by explicit inverse, h by prefix runs of
  the recurrence, prepare_bwd by a reverse cumsum, group_sum by a loop);
- gates below the floor (-inf, -1e30, -1e4) keep the chunked reference within ~1e-10 of the recurrence;
- portable fp32 from bf16-valued inputs is within a few 1e-6 of float64; portable with bf16 GEMM operands
  lands in the bf16 regime (errors between ~5e-4 and 1e-2).
"""
from __future__ import annotations

import math

import pytest
import torch

from _helpers import Case, assert_close, make_inputs
from flashdelta import portable
from flashdelta.numerics import GATE_FLOOR
from flashdelta.reference import chunked as ref
from flashdelta.reference import recurrent_gated_delta_rule

F64 = torch.float64
TIGHT = 1e-10

# (case, use_qk_l2norm_in_kernel). Named explicitly; each line exists for a reason.
CASES = [
    (Case("T1", (1,), H=2, HV=2), False),                                   # single token, HV/H = 1
    (Case("T63", (63,), H=2, HV=4), True),                                  # one ragged chunk, HV/H = 2
    (Case("T64_vfirst", (64,), H=1, HV=4, state_v_first=True), False),      # exactly one chunk, HV/H = 4
    (Case("T65_KneV_noh0", (65,), K=32, V=48, h0=False), True),             # full + 1-token chunk, K != V
    (Case("T200", (200,), H=2, HV=4), False),                               # 4 chunks, model gates
    (Case("T200_l2_vfirst", (200,), H=1, HV=2, K=16, V=24, state_v_first=True), True),
    (Case("varlen_pad", (0, 1, 63, 64, 65, 17), H=1, HV=4, K=16, V=24, pad=5), False),  # 0-len, 1-token, tail
    (Case("varlen_pad_l2", (65, 0, 1, 130), H=2, HV=4, K=24, V=16, pad=3, state_v_first=True), True),
    (Case("dense_B3", (65, 65, 65), varlen=False, H=2, HV=2, h0=False, state_v_first=True), True),
    (Case("dense_B2_bench", (96, 96), varlen=False, H=2, HV=8, K=16, V=16, gate="bench"), False),
    (Case("zero_gate", (130,), H=1, HV=2, gate="zero"), False),             # no decay anywhere
]
CASE_IDS = [f"{c.name}{'-l2' if l2 else ''}" for c, l2 in CASES]


def _inputs64(case: Case, seed: int = 0, *, requires_grad=False):
    inp = make_inputs(case, dtype=F64, seed=seed)
    for n in ("q", "k", "v", "g", "beta", "initial_state"):
        if inp[n] is not None:
            inp[n] = inp[n].to(F64).requires_grad_(requires_grad)
    return inp


def _flat(x: torch.Tensor) -> torch.Tensor:
    """[B, T, ...] -> [1, B*T, ...] (the internal flat form)."""
    return x.detach().reshape(1, x.shape[0] * x.shape[1], *x.shape[2:])


def _cu(inp) -> torch.Tensor:
    if inp["cu_seqlens"] is not None:
        return inp["cu_seqlens"]
    B, T = inp["q"].shape[:2]
    return (torch.arange(B + 1) * T).to(torch.int32)


def _chunked(mod, inp, do, dht, *, l2, **kw):
    """Run `mod.chunked_fwd` / `mod.chunked_bwd` on public-form inputs (dense flattened, l2norm outside)."""
    q, k, v, g, beta = (_flat(inp[n]) for n in ("q", "k", "v", "g", "beta"))
    h0 = None if inp["initial_state"] is None else inp["initial_state"].detach()
    cu, svf = _cu(inp), inp["state_v_first"]
    if l2:
        q, rq = portable.l2norm_fwd(q)
        k, rk = portable.l2norm_fwd(k)
    o, ht, gcs, A = mod.chunked_fwd(q, k, v, g, beta, h0, cu, state_v_first=svf, **kw)
    dq, dk, dv, db, dg, dh0 = mod.chunked_bwd(q, k, v, gcs, beta, A, h0, _flat(do), dht, cu, state_v_first=svf,
                                              H=q.shape[2], **kw)
    if l2:
        dq, dk = portable.l2norm_bwd(q, rq, dq), portable.l2norm_bwd(k, rk, dk)
    return dict(o=o, ht=ht, dq=dq, dk=dk, dv=dv, dbeta=db, dg=dg, dh0=dh0)


def _truth(inp, *, l2, seed=1):
    """Recurrence outputs, random cotangents and autograd gradients, all float64, flattened."""
    names = [n for n in ("q", "k", "v", "g", "beta", "initial_state") if inp[n] is not None]
    o, ht = recurrent_gated_delta_rule(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"],
                                       initial_state=inp["initial_state"], use_qk_l2norm_in_kernel=l2,
                                       cu_seqlens=inp["cu_seqlens"], state_v_first=inp["state_v_first"])
    gen = torch.Generator().manual_seed(seed)
    do = torch.randn(o.shape, generator=gen, dtype=F64)
    dht = torch.randn(ht.shape, generator=gen, dtype=F64)
    grads = torch.autograd.grad((o * do).sum() + (ht * dht).sum(), [inp[n] for n in names])
    rename = {"q": "dq", "k": "dk", "v": "dv", "g": "dg", "beta": "dbeta", "initial_state": "dh0"}
    out = dict(o=_flat(o), ht=ht.detach())
    for n, gr in zip(names, grads):
        out[rename[n]] = gr if n == "initial_state" else _flat(gr)
    return out, do, dht


# ----------------------------------------------------------------------------------------- recurrence itself

def _naive(inp):
    """Independent per-head matrix form: S = a (I - b k k^T) S + b k v^T, o = scale S^T q."""
    q, k, v, g, beta = (inp[n].detach() for n in ("q", "k", "v", "g", "beta"))
    B, T, H, K = q.shape
    HV, V = v.shape[2:]
    cu = _cu(inp).tolist() if inp["cu_seqlens"] is not None else None
    segs = [(0, cu[n], cu[n + 1]) for n in range(len(cu) - 1)] if cu else [(b, 0, T) for b in range(B)]
    o = torch.zeros(B, T, HV, V, dtype=F64)
    hts = []
    for n, (b, bos, eos) in enumerate(segs):
        hs = []
        for hv in range(HV):
            hk = hv // (HV // H)
            S = torch.zeros(K, V, dtype=F64)
            if inp["initial_state"] is not None:
                S = inp["initial_state"][n, hv].detach().clone()
                S = S.T if inp["state_v_first"] else S
            for t in range(bos, eos):
                kt = k[b, t, hk]
                S = torch.exp(g[b, t, hv]) * (torch.eye(K, dtype=F64) - beta[b, t, hv] * torch.outer(kt, kt)) @ S \
                    + beta[b, t, hv] * torch.outer(kt, v[b, t, hv])
                o[b, t, hv] = K ** -0.5 * S.T @ q[b, t, hk]
            hs.append(S.T if inp["state_v_first"] else S)
        hts.append(torch.stack(hs))
    return o, torch.stack(hts)


@pytest.mark.parametrize("case", [CASES[1][0], CASES[2][0], CASES[6][0], CASES[8][0]], ids=str)
def test_recurrence_matches_matrix_form(case):
    inp = _inputs64(case)
    o, ht = recurrent_gated_delta_rule(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"],
                                       initial_state=inp["initial_state"], cu_seqlens=inp["cu_seqlens"],
                                       state_v_first=case.state_v_first)
    o_ref, ht_ref = _naive(inp)
    assert o.dtype == F64 and ht.dtype == F64
    assert_close("o", o, o_ref, tol=TIGHT)
    assert_close("ht", ht, ht_ref, tol=TIGHT)
    if case.pad:
        assert torch.count_nonzero(o[:, sum(case.seqlens):]) == 0


# ----------------------------------------------------------------------------------------- chunked vs truth

@pytest.mark.parametrize("case,l2", CASES, ids=CASE_IDS)
def test_chunked_float64_matches_recurrence(case, l2):
    inp = _inputs64(case, requires_grad=True)
    truth, do, dht = _truth(inp, l2=l2)
    got = _chunked(ref, inp, do, dht, l2=l2)
    for name, want in truth.items():
        assert_close(name, got[name], want, tol=TIGHT)
    if inp["initial_state"] is None:
        # dh0 still defined: gradient w.r.t. a zero initial state
        assert got["dh0"].shape == got["ht"].shape
    if case.pad:
        end = sum(case.seqlens)
        for name in ("o", "dq", "dk", "dv", "dbeta", "dg"):
            assert torch.count_nonzero(got[name][:, end:]) == 0, name


# ----------------------------------------------------------------------------------------- stage twins

STAGE_CASES = [
    Case("stage_varlen", (0, 1, 63, 64, 65, 150), H=2, HV=4, K=16, V=24, pad=4),
    Case("stage_vfirst", (129, 40), H=1, HV=2, K=24, V=16, state_v_first=True),
]


@pytest.mark.parametrize("case", STAGE_CASES, ids=str)
def test_prepare_fwd_twin(case):
    inp = _inputs64(case)
    k, g, beta, cu = inp["k"], inp["g"], inp["beta"], inp["cu_seqlens"]
    g_cumsum, A = ref.prepare_fwd(k, g, beta, cu)
    T, HV, BT = k.shape[1], g.shape[-1], 64
    assert g_cumsum.shape == (1, T, HV) and A.shape == (1, T, HV, BT)
    want_g = torch.zeros(1, T, HV, dtype=F64)
    want_A = torch.zeros(1, T, HV, BT, dtype=F64)
    cu = cu.tolist()
    for n in range(len(cu) - 1):
        for s in range(cu[n], cu[n + 1], BT):
            e = min(s + BT, cu[n + 1])
            L = e - s
            want_g[0, s:e] = g[0, s:e].cumsum(0)
            for hv in range(HV):
                kk = k[0, s:e, hv // (HV // case.H)]
                Lm = torch.tril(beta[0, s:e, hv, None] * (kk @ kk.T), -1)
                want_A[0, s:e, hv, :L] = torch.linalg.inv(torch.eye(L, dtype=F64) + Lm)
    assert_close("g_cumsum", g_cumsum, want_g, tol=1e-14)
    assert_close("A", A, want_A, tol=TIGHT)
    assert torch.count_nonzero(A[:, cu[-1]:]) == 0 and torch.count_nonzero(g_cumsum[:, cu[-1]:]) == 0


@pytest.mark.parametrize("case", STAGE_CASES, ids=str)
def test_state_recompute_twin(case):
    """h[chunk] == the state the recurrence reaches at that chunk's start (runs on sequence prefixes)."""
    inp = _inputs64(case)
    q, k, v, g, beta, h0, cu = (inp[n] for n in ("q", "k", "v", "g", "beta", "initial_state", "cu_seqlens"))
    g_cumsum, A = ref.prepare_fwd(k, g, beta, cu)
    h = ref.state_recompute(k, v, g_cumsum, beta, A, h0, cu, state_v_first=case.state_v_first)
    cu = cu.tolist()
    N, BT = len(cu) - 1, 64
    nch = [-(-(cu[n + 1] - cu[n]) // BT) for n in range(N)]
    assert h.shape[0] == sum(nch)
    offs = [sum(nch[:n]) for n in range(N)]
    for c in range(max(nch)):
        # every sequence truncated to its first c chunks; its final state is the state entering chunk c
        pre = torch.tensor([0] + [min(c * BT, cu[n + 1] - cu[n]) for n in range(N)]).cumsum(0)
        idx = torch.cat([torch.arange(cu[n], cu[n] + pre[n + 1] - pre[n]) for n in range(N)]).long()
        _, ht = recurrent_gated_delta_rule(q[:, idx], k[:, idx], v[:, idx], g[:, idx], beta[:, idx],
                                           initial_state=h0, cu_seqlens=pre, state_v_first=case.state_v_first)
        have = [n for n in range(N) if nch[n] > c]
        assert_close("h", h[[offs[n] + c for n in have]], ht[have], tol=TIGHT)


@pytest.mark.parametrize("case", STAGE_CASES, ids=str)
def test_chunk_fwd_and_bwd_twins(case):
    """chunk_fwd == recurrence; chunk_bwd's per-value-head grads group-sum / reverse-cumsum to the truth."""
    inp = _inputs64(case, requires_grad=True)
    truth, do, dht = _truth(inp, l2=False)
    q, k, v, g, beta, h0, cu = (None if inp[n] is None else inp[n].detach()
                                for n in ("q", "k", "v", "g", "beta", "initial_state", "cu_seqlens"))
    svf = case.state_v_first
    g_cumsum, A = ref.prepare_fwd(k, g, beta, cu)
    o, ht = ref.chunk_fwd(q, k, v, g_cumsum, beta, A, h0, cu, scale=case.K ** -0.5, state_v_first=svf)
    assert_close("o", o, truth["o"], tol=TIGHT)
    assert_close("ht", ht, truth["ht"], tol=TIGHT)
    h = ref.state_recompute(k, v, g_cumsum, beta, A, h0, cu, state_v_first=svf)
    dq, dk, dv, db, dG, dh0 = ref.chunk_bwd(q, k, v, g_cumsum, beta, A, h, do, dht, cu, scale=case.K ** -0.5,
                                           state_v_first=svf)
    HV = v.shape[2]
    assert dq.shape == (1, q.shape[1], HV, case.K) and dk.shape == dq.shape
    # group_sum against an explicit loop
    loop = torch.stack([dq[:, :, i * (HV // case.H):(i + 1) * (HV // case.H)].sum(2) for i in range(case.H)], 2)
    assert torch.allclose(ref.group_sum(dq, case.H), loop, rtol=0, atol=1e-14)
    assert_close("dq", ref.group_sum(dq, case.H), truth["dq"], tol=TIGHT)
    assert_close("dk", ref.group_sum(dk, case.H), truth["dk"], tol=TIGHT)
    assert_close("dv", dv, truth["dv"], tol=TIGHT)
    assert_close("dbeta", db, truth["dbeta"], tol=TIGHT)
    assert_close("dh0", dh0, truth["dh0"], tol=TIGHT)
    # prepare_bwd against an explicit chunk-local reverse cumsum
    dg = ref.prepare_bwd(dG, cu)
    want = torch.zeros_like(dG)
    cul = cu.tolist()
    for n in range(len(cul) - 1):
        for s in range(cul[n], cul[n + 1], 64):
            e = min(s + 64, cul[n + 1])
            want[0, s:e] = dG[0, s:e].flip(0).cumsum(0).flip(0)
    assert_close("dg", dg, want, tol=1e-14)
    assert_close("dg", dg, truth["dg"], tol=TIGHT)
    # chunk_dstate: chunk_bwd's dh0 from a zero end gradient, which needs neither v nor the states (K-first)
    zero = torch.zeros_like(dh0)
    F = ref.chunk_bwd(q, k, v, g_cumsum, beta, A, h, do, zero, cu, scale=case.K ** -0.5, state_v_first=svf)[5]
    F = F.transpose(-1, -2) if svf else F
    assert_close("dh0", ref.chunk_dstate(q, k, g_cumsum, beta, A, do, cu, scale=case.K ** -0.5), F, tol=1e-12)


def test_chunk_size_16_matches():
    """The chunk size is a parameter: C=16 gives the same numbers as C=64."""
    case = Case("C16", (0, 100, 37), H=1, HV=2, K=16, V=16, pad=2)
    inp = _inputs64(case, requires_grad=True)
    truth, do, dht = _truth(inp, l2=False)
    got = _chunked(ref, inp, do, dht, l2=False, chunk_size=16)
    for name, want in truth.items():
        assert_close(name, got[name], want, tol=TIGHT)


# ----------------------------------------------------------------------------------------- portable precision

PREC_CASES = [
    Case("prec_model", (300, 200), H=2, HV=4, K=64, V=64, pad=7),
    Case("prec_bench_vfirst", (450,), H=1, HV=4, K=64, V=32, gate="bench", state_v_first=True),
]
GRADS = ("dq", "dk", "dv", "dbeta", "dg", "dh0")


def _bf16_valued(case, seed=3):
    """Inputs whose values are bf16-representable (the kernel's inputs), stored in float32/float64."""
    inp = make_inputs(case, dtype=torch.bfloat16, seed=seed)
    for n in ("q", "k", "v", "beta"):
        inp[n] = inp[n].float()
    return inp


def _cotangents(case, inp, seed=4):
    gen = torch.Generator().manual_seed(seed)
    T = inp["q"].shape[1]
    N = len(case.seqlens)
    do = torch.randn(1, T, case.HV, case.V, generator=gen).bfloat16().float()
    shape = (N, case.HV, case.V, case.K) if case.state_v_first else (N, case.HV, case.K, case.V)
    return do, torch.randn(*shape, generator=gen)


@pytest.mark.parametrize("case", PREC_CASES, ids=str)
def test_portable_fp32_close_to_float64(case):
    inp = _bf16_valued(case)
    do, dht = _cotangents(case, inp)
    want = _chunked(ref, inp, do, dht, l2=False)
    got = _chunked(portable, inp, do, dht, l2=False)
    assert got["o"].dtype == torch.float32 and got["ht"].dtype == torch.float32
    for name in ("o", "ht") + GRADS:
        assert_close(name, got[name], want[name], tol=5e-6)
    end = sum(case.seqlens)
    for name in ("o", "dq", "dk", "dv", "dbeta", "dg"):
        assert torch.count_nonzero(got[name][:, end:]) == 0, name


@pytest.mark.parametrize("case", PREC_CASES, ids=str)
def test_portable_bf16_operands_in_bf16_regime(case):
    inp = _bf16_valued(case)
    do, dht = _cotangents(case, inp)
    want = _chunked(ref, inp, do, dht, l2=False)
    got = _chunked(portable, inp, do, dht, l2=False, operand_dtype=torch.bfloat16)
    for name in ("o", "ht") + GRADS:
        err = assert_close(name, got[name], want[name])          # docs/numerics.md bounds (1e-2 / 2e-2)
        assert err > 5e-4, f"{name}: error {err:.2e} too small for bf16 operands: is the rounding applied?"


def test_portable_dtypes():
    case = Case("dtypes", (70, 10), H=1, HV=2, K=16, V=16, pad=3)
    inp = make_inputs(case, dtype=torch.bfloat16)
    q, k, v, g, beta, h0, cu = (inp[n] for n in ("q", "k", "v", "g", "beta", "initial_state", "cu_seqlens"))
    o, ht, gcs, A = portable.chunked_fwd(q, k, v, g, beta, h0, cu)
    assert o.dtype == torch.bfloat16 and ht.dtype == torch.float32 and gcs.dtype == torch.float32
    _, _, _, A16 = portable.chunked_fwd(q, k, v, g, beta, h0, cu, operand_dtype=torch.bfloat16)
    assert A16.dtype == torch.bfloat16
    h = portable.state_recompute(k, v, gcs, beta, A, h0, cu)
    assert h.dtype == torch.float32 and h.shape == (3, 2, 16, 16)


def test_l2norm_twins():
    """reference.chunked.l2norm_fwd is float64 and equals the recurrence's normalisation; the portable stage keeps
    the input dtype (and normalises 16-bit input in fp32 via l2norm_fwd_compute, the torch backend's entry)."""
    from flashdelta.reference import recurrent

    x = torch.randn(3, 50, 2, 64, generator=torch.Generator().manual_seed(0)) * 4
    x[0, 0] = 0
    y, rstd = ref.l2norm_fwd(x.bfloat16())
    assert y.dtype == torch.float64 and rstd.shape == (3, 50, 2, 1)
    assert torch.equal(y, recurrent._l2norm(x.bfloat16().double()))
    yb, rb = portable.l2norm_fwd(x.bfloat16())
    assert yb.dtype == torch.bfloat16 and rb.dtype == torch.float32
    yc, _ = portable.l2norm_fwd_compute(x.bfloat16())
    assert yc.dtype == torch.float32
    assert assert_close("qk_l2norm", yb, y) < 4e-3


# ----------------------------------------------------------------------------------------- gate floor

@pytest.mark.parametrize("value", [-math.inf, -1e30, -1e4], ids=["-inf", "-1e30", "-1e4"])
@pytest.mark.parametrize("where", [[0], [30], [63], list(range(64, 128)), [0, 30, 63, 100, 129, 131, 199]],
                         ids=["first", "mid-chunk", "chunk-end", "whole-chunk", "several"])
def test_chunked_float64_gate_floor_matches_recurrence(where, value):
    """Gates below numerics.GATE_FLOOR count as the floor (exp(-100) = 3.7e-44): the float64 chunked reference
    stays within TIGHT of the recurrence, whose state is reset exactly (forward and every gradient)."""
    inp = _inputs64(Case("reset", (130, 70), H=1, HV=2, K=16, V=16, pad=3))
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        inp["g"].copy_(-0.02 - 0.2 * torch.rand(inp["g"].shape, generator=gen, dtype=F64))  # every token decays
        inp["g"][0, where, 0] = value
    for n in ("q", "k", "v", "g", "beta", "initial_state"):
        inp[n].requires_grad_(True)
    truth, do, dht = _truth(inp, l2=False)
    got = _chunked(ref, inp, do, dht, l2=False)
    for name, want in truth.items():
        assert torch.isfinite(want).all(), name
        assert_close(name, got[name], want, tol=TIGHT)
    gcs, _ = ref.prepare_fwd(_flat(inp["k"]), _flat(inp["g"]), _flat(inp["beta"]), inp["cu_seqlens"])
    assert gcs[0, where[0], 0] <= GATE_FLOOR and torch.isfinite(gcs).all()
