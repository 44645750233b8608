"""The device-side CP forward and backward (`flashdelta.cp`) on the portable backend, on the CPU.

- the device plan equals the float64 reference's `partition` (ragged edges, empty and short sequences, dense);
- the summary launches (zero values from I; v from 0) give the reference's (M, E); both scans equal
  `scan_states`; the split forward that saves the chunk states hands on what its chunk_fwd returns third;
- CP on vs off through the public API: o and final state agree to fp32 rounding (float64: ~1e-15), model gates
  with a never-decaying head, h0 present / absent, both state layouts, GVA; torch.compile(fullgraph=True) traces it;
- the boundary states (M, E, start states, F, dS) stay fp32 on a bf16 call;
- the CP backward: chunk_dstate over the partitions gives the reference's F, both reverse scans equal
  `scan_grads`; every gradient (dq, dk, dv, dg, dbeta, dh0) with CP on equals CP off to fp32 rounding, on the
  API cases above with dht present and absent (an unused final state's gradient is materialised as zeros), the
  backward really split;
- the request parsing (argument, FLASHDELTA_CP, bad values of either), ``on`` (True or FLASHDELTA_CP=1) splitting
  both passes on the portable path, and the cost models' decisions (forward and backward apart).
"""
from __future__ import annotations

import pytest
import torch

from _helpers import Case, assert_close, make_inputs, split_backward_only
from flashdelta import chunk_gated_delta_rule, cp, cp_model, dispatch, portable
from flashdelta.reference import cp as rcp
from flashdelta.stages import KernelSet, Stage

F64 = torch.float64


def _flat(x, name):
    t = x[name]
    return None if t is None else t.reshape(1, -1, *t.shape[2:])


# ----------------------------------------------------------------------------------------- plan

PLAN_CASES = [
    # (name, cu_seqlens, L, T (buffer tokens, >= cu[-1]))
    ("one_ragged", [0, 700], 3, 700),
    ("exact_multiple", [0, 512], 2, 512),
    ("empty_short_pad", [0, 0, 1, 64, 65, 65, 400], 1, 410),
    ("short_and_long", [0, 5, 9, 40, 1500, 1510, 1600], 4, 1600),
    ("all_empty", [0, 0, 0], 2, 8),
]


@pytest.mark.parametrize("name,cu,L,T", PLAN_CASES, ids=[c[0] for c in PLAN_CASES])
def test_plan_equals_reference_partition(name, cu, L, T):
    cu_t = torch.tensor(cu, dtype=torch.int32)
    plan = cp.make_plan(cu_t, T, L)
    want = rcp.partition(cu, L)
    P, J = cp.bounds(T, len(cu) - 1, L)
    assert (plan.P, plan.J) == (P, J) and want.P <= P and max(
        sum(1 for s in want.seq if s == n) for n in range(want.N)) <= J
    assert plan.cu.dtype == torch.int32 and plan.cu.shape == (P + 1,)
    assert plan.cu[:want.P + 1].tolist() == list(want.cu_seqlens)
    assert bool((plan.cu[want.P:] == cu[-1]).all()), "unused slots are empty, at cu_seqlens[N]"
    assert plan.seq[:want.P].tolist() == list(want.seq)
    assert plan.first[:want.P].tolist() == list(want.first)
    assert plan.last_index.tolist() == want.last_of()
    for n in range(want.N):
        mine = [p for p in range(want.P) if want.seq[p] == n]
        assert plan.step_index[:len(mine), n].tolist() == mine
        assert bool((plan.step_index[len(mine):, n] == P).all())


@pytest.mark.parametrize("name,cu,L,T", PLAN_CASES, ids=[c[0] for c in PLAN_CASES])
def test_partition_chunks_keep_their_sequences_state_slots(name, cu, L, T):
    """The chunk-state slots of the SM90 kernels (chunk c of item n at ``cu[n] // 64 + n + c``, docs/stages.md `h`):
    a partition's chunk, numbered through `h_seq` = the plan's `seq` (`chunk_bwd` `h_seqs` reading the forward's
    states over the partitions: ``cu_p[p] // 64 + seq[p] + c``), lands on the slot its sequence's own chunk has,
    every chunk of every sequence once, at any plan's L and with sequences not starting on a multiple of 64."""
    plan = cp.make_plan(torch.tensor(cu, dtype=torch.int32), T, L)
    cu_p, seq = plan.cu.tolist(), plan.seq.tolist()
    got = sorted(cu_p[p] // 64 + seq[p] + c for p in range(plan.P) for c in range(-(-(cu_p[p + 1] - cu_p[p]) // 64)))
    want = sorted(cu[n] // 64 + n + c for n in range(len(cu) - 1) for c in range(-(-(cu[n + 1] - cu[n]) // 64)))
    assert got == want
    for p in range(plan.P):
        if cu_p[p + 1] == cu_p[p]:
            continue                                  # an empty partition (or unused slot) owns no chunk
        n = seq[p]
        first_chunk = (cu_p[p] - cu[n]) // 64         # the partition's first chunk within its sequence
        assert cu_p[p] == cu[n] + 64 * first_chunk, "partitions are chunk-aligned within their sequence"
        assert cu_p[p] // 64 == cu[n] // 64 + first_chunk


def test_plan_dense_is_exact_and_regular():
    plan = cp.make_plan(torch.arange(4, dtype=torch.int32) * 300, 900, 2, seq_len=300)
    want = rcp.partition([0, 300, 600, 900], 2)
    assert plan.regular and plan.P == want.P == 9 and plan.J == 3
    assert plan.cu.tolist() == list(want.cu_seqlens)


def test_plan_needs_no_device_values():
    """Every buffer size comes from host ints: the plan traces on meta tensors (a data-dependent op, `.item()` or
    a host read would raise there), so CUDA graphs capture it and replay it with new lengths."""
    plan = cp.make_plan(torch.empty(6, dtype=torch.int32, device="meta"), 3000, 4)
    assert plan.cu.shape == (5 + 3000 // 256 + 1,) and plan.step_index.shape == (12, 5)


# ----------------------------------------------------------------------------------------- (M, E) and the scan

def _stage_inputs(case: Case, dtype, seed=0):
    x = make_inputs(case, dtype=dtype, seed=seed)
    if dtype == F64:
        x = {n: (t.to(F64) if torch.is_tensor(t) and t.is_floating_point() else t) for n, t in x.items()}
    q, k, v, g, beta = (_flat(x, n) for n in ("q", "k", "v", "g", "beta"))
    cu = x["cu_seqlens"]
    if cu is None:
        B, T = x["q"].shape[:2]
        cu = torch.arange(B + 1, dtype=torch.int32) * T
    g_cumsum, A = portable.prepare_fwd(k, g, beta, cu)
    return x, q, k, v, g_cumsum, beta, A, cu


SUMMARY_CASE = Case("summ", (700, 0, 130, 64), H=1, HV=4, K=16, V=8, pad=3)


def test_summary_passes_and_scans_match_the_reference():
    x, q, k, v, g_cumsum, beta, A, cu = _stage_inputs(SUMMARY_CASE, F64)
    L = 3
    plan = cp.make_plan(cu, q.shape[1], L)
    parts = rcp.partition(cu, L)
    E, M = rcp.partition_summaries(k, v, g_cumsum, beta, A, parts)
    Md, Ed = cp.summaries(q, k, v, g_cumsum, beta, A, plan, scale=0.25, chunk_fwd=portable.chunk_fwd)
    assert_close("M", Md[:parts.P], M, tol=1e-12)
    assert_close("E", Ed[:parts.P], E, tol=1e-12)
    for h0 in (x["initial_state"], None):
        want, _ = rcp.scan_states(E, M, parts, h0)
        for method in ("serial", "log"):
            assert_close("h", cp.scan_states(Md, Ed, plan, h0, method)[:parts.P], want, tol=1e-12)


@pytest.mark.parametrize("method", ["serial", "log"])
def test_scan_dense_regular(method):
    case = Case("dense", (400, 400, 400), H=2, HV=2, K=8, V=8, varlen=False)
    x, q, k, v, g_cumsum, beta, A, cu = _stage_inputs(case, F64)
    plan = cp.make_plan(cu, q.shape[1], 2, seq_len=400)
    parts = rcp.partition(cu, 2)
    E, M = rcp.partition_summaries(k, v, g_cumsum, beta, A, parts)
    assert_close("h", cp.scan_states(M, E, plan, x["initial_state"], method),
                 rcp.scan_states(E, M, parts, x["initial_state"])[0], tol=1e-12)


def test_split_forward_hands_on_the_states_chunk_fwd_returns_third():
    """`cp_chunk_fwd(save_states=True)` over a kernel set whose chunk_fwd saves the chunk states as the SM90 launcher
    does (``(o, ht, states)`` with `state_seqs`; here the portable chunk_fwd and a marker for the states): it returns
    the plain split forward's o and final states and the launcher's states third, and asks for them over the plan's
    sequences. (On the GPU the split forward once took the states second: the backward read final states as chunk
    states.)"""
    x, q, k, v, g_cumsum, beta, A, cu = _stage_inputs(SUMMARY_CASE, F64)
    plan = cp.make_plan(cu, q.shape[1], 3)
    marker = torch.zeros(1)
    seen = []

    def chunk_fwd(*args, save_states=False, state_seqs=None, **kw):
        out = portable.chunk_fwd(*args, **kw)
        if not save_states:
            return out
        seen.append(state_seqs)
        return out[0], out[1], marker

    kset = dispatch.load(dispatch.PORTABLE)._replace(chunk_fwd=chunk_fwd)

    class Backends:
        def kset(self, stage):
            return kset

        def fn(self, stage):
            return getattr(kset, stage)

    args = (q, k, v, g_cumsum, beta, A, x["initial_state"], cu)
    kw = dict(scale=0.25, plan=plan, backends=Backends())
    o0, ht0 = cp.cp_chunk_fwd(*args, **kw)
    o1, ht1, states = cp.cp_chunk_fwd(*args, save_states=True, **kw)
    assert states is marker
    assert torch.equal(o1, o0) and torch.equal(ht1, ht0)
    assert len(seen) == 1 and seen[0][0] is plan.seq and seen[0][1] == plan.N


# ----------------------------------------------------------------------------------------- CP on vs off

API_CASES = [
    # (case, partition chunks)
    (Case("model_ragged_h0", (700, 1, 130), H=2, HV=4, K=16, V=8, pad=5), 3),       # head 0: g = 0
    (Case("short_mixed_long_noh0", (3, 0, 70, 2, 900, 64), H=1, HV=4, K=16, V=16, h0=False), 2),  # GVA 4
    (Case("vfirst_bench", (520, 200), H=2, HV=2, K=8, V=16, state_v_first=True, gate="bench"), 2),
    (Case("dense_model", (400, 400), H=1, HV=2, K=16, V=8, varlen=False), 2),
]


def _api(x, **kw):
    return chunk_gated_delta_rule(**x, output_final_state=True, **kw)


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("case,L", API_CASES, ids=[c[0].name for c in API_CASES])
def test_cp_on_equals_off(case, L, dtype):
    x = make_inputs(case, dtype=dtype)
    if dtype == F64:
        x = {n: (t.to(F64) if torch.is_tensor(t) and t.is_floating_point() else t) for n, t in x.items()}
    o0, ht0 = _api(x, context_parallel=False)
    o1, ht1 = _api(x, context_parallel=L)
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    assert_close("o", o1, o0, tol=tol)
    assert_close("ht", ht1, ht0, tol=tol)


# ----------------------------------------------------------------------------------------- backward

def test_start_grads_and_reverse_scans_match_the_reference():
    x, q, k, v, g_cumsum, beta, A, cu = _stage_inputs(SUMMARY_CASE, F64)
    L = 3
    plan = cp.make_plan(cu, q.shape[1], L)
    parts = rcp.partition(cu, L)
    do = torch.randn(v.shape, generator=torch.Generator().manual_seed(1), dtype=F64)
    F, M = rcp.grad_summaries(q, k, v, g_cumsum, beta, A, do, parts, scale=0.25)
    Fd = cp._start_grads(portable.chunk_dstate, q, k, g_cumsum, beta, A, do, plan, scale=0.25)
    assert_close("F", Fd[:parts.P], F, tol=1e-12)
    # the exact path's F pass walks no chunk of a sequence's first partition (the reverse scan never reads its F)
    take = cp.grad_windows(g_cumsum, k, beta, plan, None).take
    Fe = cp._start_grads(portable.chunk_dstate, q, k, g_cumsum, beta, A, do, plan, scale=0.25, take=take)[:parts.P]
    first = plan.first[:parts.P]
    assert first.any() and (~first).any() and bool((Fe[first] == 0).all())
    assert_close("F", Fe[~first], F[~first], tol=1e-12)
    Md, _ = cp.summaries(q, k, v, g_cumsum, beta, A, plan, scale=0.25, chunk_fwd=portable.chunk_fwd)
    for dht in (torch.randn(x["initial_state"].shape, dtype=F64), None):
        want, _ = rcp.scan_grads(F, M, parts, dht)
        for method in ("serial", "log"):
            assert_close("dS", cp.scan_grads(Md, Fd, plan, dht, method)[:parts.P], want, tol=1e-12)


@pytest.mark.parametrize("method", ["serial", "log"])
def test_reverse_scan_dense_regular(method):
    plan = cp.make_plan(torch.arange(3, dtype=torch.int32) * 700, 1400, 3, seq_len=700)      # 2 x 4 partitions
    parts = rcp.partition([0, 700, 1400], 3)
    gen = torch.Generator().manual_seed(2)
    M = torch.randn(plan.P, 2, 8, 8, generator=gen, dtype=F64) * 0.3
    F = torch.randn(plan.P, 2, 8, 4, generator=gen, dtype=F64)
    dht = torch.randn(2, 2, 8, 4, generator=gen, dtype=F64)
    assert plan.regular and plan.P == parts.P == 8
    assert_close("dS", cp.scan_grads(M, F, plan, dht, method), rcp.scan_grads(F, M, parts, dht)[0], tol=1e-12)


GRAD_NAMES = ("q", "k", "v", "g", "beta", "initial_state")


def _grads(x, cpv, use_ht, seed=3):
    x = {n: (t.detach().requires_grad_(True) if torch.is_tensor(t) and t.is_floating_point() else t)
         for n, t in x.items()}
    o, ht = _api(x, context_parallel=cpv)
    gen = torch.Generator().manual_seed(seed)
    do = torch.randn(o.shape, generator=gen, dtype=o.dtype)
    leaves = [x[n] for n in GRAD_NAMES if x[n] is not None]
    if use_ht:
        grads = torch.autograd.grad((o, ht), leaves, (do, torch.randn(ht.shape, generator=gen, dtype=ht.dtype)))
    else:                                           # dht: zeros from autograd
        grads = torch.autograd.grad(o, leaves, do)
    return [o, ht] + list(grads)


BWD_CASES = [(c, L, use_ht) for (c, L), use_ht in zip(API_CASES, (True, False, True, False))]


@pytest.mark.parametrize("fwd_split", [True, False], ids=["fwd_split", "fwd_serial"])
@pytest.mark.parametrize("case,L,use_ht", BWD_CASES, ids=[f"{c[0].name}-{'dht' if c[2] else 'nodht'}"
                                                         for c in BWD_CASES])
def test_cp_backward_equals_serial(case, L, use_ht, fwd_split, monkeypatch):
    """Every gradient with the backward split equals the serial backward's to fp32 rounding: ragged partition
    edges, sequences shorter than a partition, an empty one, many short with one long, a never-decaying head
    (model gates' head 0), h0 present / absent, dht present / absent, GVA, both state layouts, dense input; with
    the forward split as well (the backward computes its start states: M, E, the scan) and with the forward serial
    (it saves them, `partition_starts`, and the backward reads them)."""
    x = make_inputs(case, dtype=torch.float32)
    ref = _grads(x, False, use_ht)
    calls = split_backward_only(monkeypatch) if not fwd_split else []
    if fwd_split:
        real = cp.cp_chunk_bwd
        monkeypatch.setattr(cp, "cp_chunk_bwd", lambda *a, **kw: calls.append((kw["plan"].L, kw.get("starts")))
                            or real(*a, **kw))
    got = _grads(x, L, use_ht)
    assert [c[0] for c in calls] == [L], "the backward split"
    assert (calls[0][1] is None) == fwd_split, "the saved start states are used exactly where the forward was serial"
    names = ("o", "ht") + tuple("d" + n for n in GRAD_NAMES if x[n] is not None)
    for name, a, b in zip(names, got, ref):
        assert_close(name, a, b, tol=2e-6)


def test_split_backward_frees_the_m_pass_values(monkeypatch):
    """With saved start states the split backward's M pass takes a never-read values tensor ([1, T, HV, K]); it must be
    freed once the pass is launched, not held through chunk_bwd (the backward's peak memory): by the reverse scan, the
    step before chunk_bwd, nothing refers to it any more."""
    import weakref

    case, L, use_ht = BWD_CASES[0]
    x = make_inputs(case, dtype=torch.float32)
    calls = split_backward_only(monkeypatch)
    refs, alive = [], []
    real_m, real_scan = cp._transitions, cp.scan_grads

    def transitions(q, k, zeros, *a, **kw):
        refs.append(weakref.ref(zeros))
        return real_m(q, k, zeros, *a, **kw)

    def scan_grads(*a, **kw):
        alive.extend(r() is not None for r in refs)
        return real_scan(*a, **kw)

    monkeypatch.setattr(cp, "_transitions", transitions)
    monkeypatch.setattr(cp, "scan_grads", scan_grads)
    _grads(x, L, use_ht)
    assert calls and calls[0][1] is not None, "the backward read the forward's start states"
    assert refs and alive == [False] * len(refs), "the M pass's values outlived its launch"


def test_side_stream_is_cuda_only():
    """`streams.fork` hands out a side stream on CUDA devices only; off CUDA the backward runs chunk_dstate inline
    (the tests above) and `join` of None does nothing."""
    from flashdelta import streams

    assert streams.fork(torch.device("cpu")) is None
    streams.join(None)


@pytest.mark.parametrize("fwd_split", [True, False], ids=["fwd_split", "fwd_serial"])
def test_boundary_states_are_fp32_on_a_bf16_call(fwd_split, monkeypatch):
    """On a bf16 call (the portable path) every boundary state stays fp32 (FlashQLA keeps them in bf16): M, E, the
    initial state and the start states in the forward's and the backward's scans, the serial forward's saved start
    states, and F, dht and the end gradients dS in the reverse scan; o and the gradients come back in bf16."""
    case, L = API_CASES[0]
    x = make_inputs(case, dtype=torch.bfloat16)
    seen = []
    real_s, real_g, real_f = cp.scan_states, cp.scan_grads, cp._start_grads

    def states(M, E, plan, h0, method=None):
        out = real_s(M, E, plan, h0, method)
        seen.append(("scan_states", M.dtype, E.dtype, h0.dtype, out.dtype))
        return out

    def grads(M, F, plan, dht, method=None):
        out = real_g(M, F, plan, dht, method)
        seen.append(("scan_grads", M.dtype, F.dtype, dht.dtype, out.dtype))
        return out

    def start_grads(*a, **kw):
        out = real_f(*a, **kw)
        seen.append(("F", out.dtype))
        return out

    monkeypatch.setattr(cp, "scan_states", states)
    monkeypatch.setattr(cp, "scan_grads", grads)
    monkeypatch.setattr(cp, "_start_grads", start_grads)
    calls = [] if fwd_split else split_backward_only(monkeypatch)
    got = _grads(x, L, True)
    f32 = torch.float32
    # the forward's scan, then the backward's F (chunk_dstate runs first: beside the M pass on a GPU), its scan of
    # the start states and its reverse scan
    scan = [("scan_states", f32, f32, f32, f32)] if fwd_split else []
    want = scan + [("F", f32)] + scan + [("scan_grads", f32, f32, f32, f32)]
    assert seen == want, seen
    assert fwd_split or (len(calls) == 1 and calls[0][1].dtype == f32), "the saved start states"
    assert got[0].dtype == torch.bfloat16 and got[1].dtype == f32
    assert all(t.dtype == x[n].dtype for t, n in zip(got[2:], GRAD_NAMES))


@pytest.mark.parametrize("fwd_split", [True, False], ids=["fwd_split", "fwd_serial"])
def test_cp_backward_float64_exact(fwd_split, monkeypatch):
    """At float64 the CP backward equals the serial one to ~1e-13 (the portable path computes in float64), with
    its start states computed or saved by the forward."""
    case, L = API_CASES[0]
    x = make_inputs(case, dtype=torch.float32)
    x = {n: (t.to(F64) if torch.is_tensor(t) and t.is_floating_point() else t) for n, t in x.items()}
    names = ("o", "ht") + tuple("d" + n for n in GRAD_NAMES)
    ref = _grads(x, False, True)
    calls = [] if fwd_split else split_backward_only(monkeypatch)
    for name, a, b in zip(names, _grads(x, L, True), ref):
        assert_close(name, a, b, tol=1e-12)
    assert fwd_split or (calls and calls[0][1] is not None and calls[0][1].dtype == F64)


def test_partition_starts_match_the_reference_scan():
    """`chunk_fwd(partition_starts=...)` (portable, float64) gives every partition's exact start state: the float64
    reference's `scan_states` over `partition_summaries`, at the plan's slots (ragged edges, empty and short
    sequences, h0 present); slots no sequence owns are 0; o and the final state are unchanged."""
    for case, L in API_CASES[:2]:
        x = make_inputs(case, dtype=torch.float32)
        q, k, v, beta = (_flat(x, n).to(F64) for n in ("q", "k", "v", "beta"))
        cu = x["cu_seqlens"] if x["cu_seqlens"] is not None else torch.tensor([0, q.shape[1]])
        g_cumsum, A = portable.prepare_fwd(k, _flat(x, "g").to(F64), beta, cu)
        h0 = None if x["initial_state"] is None else x["initial_state"].to(F64)
        plan = cp.make_plan(cu, q.shape[1], L)
        o0, ht0 = portable.chunk_fwd(q, k, v, g_cumsum, beta, A, h0, cu, scale=0.3)
        o, ht, starts = portable.chunk_fwd(q, k, v, g_cumsum, beta, A, h0, cu, scale=0.3,
                                           partition_starts=(L, plan.first_index, plan.P))
        assert torch.equal(o, o0) and torch.equal(ht, ht0)
        parts = rcp.partition(cu, L)
        E, M = rcp.partition_summaries(k, v, g_cumsum, beta, A, parts)
        want = rcp.scan_states(E, M, parts, h0)[0]
        assert_close("starts", starts[:want.shape[0]], want, tol=1e-12)
        assert not starts[want.shape[0]:].any()
    with pytest.raises(ValueError, match="partition_starts"):
        portable.chunk_fwd(q, k, v, g_cumsum, beta, A, h0, cu, scale=0.3, partition_starts=(0, plan.first_index, 4))


def test_cp_under_torch_compile_fullgraph():
    torch._dynamo.reset()
    case = Case("compile", (300, 100), H=1, HV=2, K=8, V=8)
    x = make_inputs(case, dtype=torch.float32)
    rest = {n: t for n, t in x.items() if n not in ("q", "k", "v")}

    def f(q, k, v):
        return chunk_gated_delta_rule(q, k, v, **rest, output_final_state=True, context_parallel=2)

    try:
        o, ht = torch.compile(f, fullgraph=True, backend="aot_eager")(x["q"], x["k"], x["v"])
    finally:                        # later tests count their own graphs
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
    o0, ht0 = _api(x, context_parallel=False)
    assert_close("o", o, o0, tol=1e-5)
    assert_close("ht", ht, ht0, tol=1e-5)


# ----------------------------------------------------------------------------------------- decision

def test_request_parsing(monkeypatch):
    monkeypatch.delenv(cp.ENV_CP, raising=False)
    assert cp.parse_request(None) == "auto"
    assert (cp.parse_request(False), cp.parse_request(True), cp.parse_request(1), cp.parse_request(8)) == \
        ("off", "on", 1, 8)
    for raw, want in (("0", "off"), ("off", "off"), ("1", "on"), ("auto", "auto"), ("16", 16)):
        monkeypatch.setenv(cp.ENV_CP, raw)
        assert cp.parse_request(None) == want
    assert cp.parse_request(False) == "off"                    # the argument wins over the variable
    # a partition length in the variable: ASCII digits (isdigit() alone takes "²", which int() rejects), >= 2 (1 is
    # on), below the code's bound
    for bad in ("sometimes", "²", "-2", str(1 << 24)):
        monkeypatch.setenv(cp.ENV_CP, bad)
        with pytest.raises(ValueError, match=cp.ENV_CP):
            cp.parse_request(None)
    assert cp.parse_request(False) == "off" and cp.parse_request((1 << 24) - 1) == (1 << 24) - 1
    with pytest.raises(ValueError, match="context_parallel"):
        cp.parse_request(0)
    with pytest.raises(ValueError, match="context_parallel"):
        cp.parse_request(1 << 24)
    with pytest.raises(TypeError, match="context_parallel"):
        cp.parse_request(2.0)
    with pytest.raises(TypeError, match="context_parallel"):
        cp.parse_request("auto")                              # the variable's word, not the argument's
    monkeypatch.delenv(cp.ENV_CP)
    x = make_inputs(Case("bad", (64,), H=1, HV=1, K=8, V=8), dtype=torch.float32)
    with pytest.raises(ValueError, match="context_parallel"):
        _api(x, context_parallel=-3)


def test_env_turns_cp_on(monkeypatch):
    case = Case("env", (400,), H=1, HV=2, K=8, V=8)
    x = make_inputs(case, dtype=torch.float32)
    o0, ht0 = _api(x)
    calls = []
    real = cp.cp_chunk_fwd
    monkeypatch.setattr(cp, "cp_chunk_fwd", lambda *a, **kw: calls.append(kw["plan"].L) or real(*a, **kw))
    monkeypatch.setenv(cp.ENV_CP, "2")
    o1, ht1 = _api(x)
    assert calls == [2]
    assert_close("o", o1, o0, tol=1e-5)
    monkeypatch.setenv(cp.ENV_CP, "auto")                      # auto on the CPU: serial
    _api(x)
    assert calls == [2]


@pytest.mark.parametrize("how", ["argument", "variable"])
def test_on_splits_on_the_portable_path(how, monkeypatch):
    """``context_parallel=True`` and ``FLASHDELTA_CP=1`` split both passes wherever CP runs, the portable path
    included (``auto`` splits only on a native backend), at the lengths the cost models pick when forced
    (`cp.auto_lengths(force=True)`), and every gradient equals CP off's to fp32 rounding."""
    case = Case("on", (1100, 300), H=1, HV=2, K=8, V=8)
    x = make_inputs(case, dtype=torch.float32)
    monkeypatch.delenv(cp.ENV_CP, raising=False)
    monkeypatch.delenv(cp.ENV_WARMUP, raising=False)
    ref = _grads(x, False, True)
    fwd, bwd = [], []
    real_f, real_b = cp.cp_chunk_fwd, cp.cp_chunk_bwd
    monkeypatch.setattr(cp, "cp_chunk_fwd", lambda *a, **kw: fwd.append(kw["plan"].L) or real_f(*a, **kw))
    monkeypatch.setattr(cp, "cp_chunk_bwd", lambda *a, **kw: bwd.append(kw["plan"].L) or real_b(*a, **kw))
    if how == "variable":
        monkeypatch.setenv(cp.ENV_CP, "1")
    got = _grads(x, True if how == "argument" else None, True)
    want = cp.auto_lengths(T=x["q"].shape[1], N=2, HV=2, K=8, V=8, sms=132, lengths=list(case.seqlens), force=True,
                           warmup=False)
    assert min(want) > 0 and (fwd, bwd) == ([want[0]], [want[1]]), (fwd, bwd, want)
    names = ("o", "ht") + tuple("d" + n for n in GRAD_NAMES)
    for name, a, b in zip(names, got, ref):
        assert_close(name, a, b, tol=2e-6)


def test_makespan_is_longest_first_list_scheduling():
    """`cp_model._makespan` (whole rounds at once) equals a job-by-job longest-first list schedule; the 16/32
    6413+6673+10954+8728 backward at L = 128 (192 CTAs on 132 SMs) finishes at 145 chunk periods, not one wave
    of 128."""
    import heapq
    import random

    def plain(jobs, slots):
        t = [0.0] * slots
        for d in sorted((d for d, n in jobs for _ in range(n)), reverse=True):
            heapq.heapreplace(t, t[0] + d)
        return max(t)

    assert cp.cp_model._makespan(((128, 64), (105, 32), (101, 32), (44, 32), (9, 32)), 132) == 145
    assert cp.cp_model._makespan(((10, 1000),), 132) == 80 and cp.cp_model._makespan(((5, 3),), 132) == 5
    rng = random.Random(0)
    for _ in range(200):
        jobs = [(rng.randint(1, 60), rng.randint(1, 90)) for _ in range(rng.randint(1, 5))]
        slots = rng.randint(1, 40)
        assert cp.cp_model._makespan(tuple(jobs), slots) == plain(jobs, slots), (jobs, slots)


def test_decide_on_the_cost_model(monkeypatch):
    """Few heads on one long sequence split; a full GPU, short sequences or an unsupported width do not. The
    forward's and the backward's partition lengths are chosen apart and travel in one code."""
    bwd_dims = Stage(portable.chunk_bwd, head_dims=((128, 128), (64, 64)))
    ks = KernelSet("sm90", dtypes=(torch.bfloat16,), head_dims=((128, 128), (64, 64), (128, 256)),
                   chunk_fwd=portable.chunk_fwd)
    ks_bwd = ks._replace(chunk_bwd=bwd_dims,
                         state_recompute=Stage(portable.state_recompute, head_dims=bwd_dims.head_dims))
    portable_set = dispatch.load("torch")
    monkeypatch.setattr(cp, "num_sms", lambda device: 132)
    dev = torch.device("cuda", 0)
    kw = dict(kset=ks, device=dev, dtype=torch.bfloat16, K=128, V=128, B=1, varlen=True)
    one = cp.decide("auto", T=32768, HV=8, N=1, lengths=[32768], **kw)
    fwd, bwd = cp.decode(one)
    assert fwd > 0 and 32768 // 64 // fwd >= 4, one
    assert bwd == 0, "no chunk_bwd in the kernel set: the backward stays serial"
    p = cp.predict(T=32768, N=1, HV=8, K=128, V=128, L=fwd, sms=132, lengths=[32768])
    assert p["cp"] < cp.MARGIN * p["serial"]
    assert cp.decide("auto", T=32768, HV=64, N=1, lengths=[32768], **kw) == 0            # 128 CTAs already
    assert cp.decide("auto", T=8192, HV=8, N=8, lengths=[1024] * 8, **kw) == 0           # short sequences
    assert cp.decide("auto", T=32768, HV=8, N=1, traced=True, **kw) == cp.CP_AUTO
    assert cp.decide("on", T=32768, HV=8, N=1, traced=True, **kw) == cp.CP_ON
    assert cp.decide(5, T=32768, HV=8, N=1, traced=True, **kw) == cp.encode(5, 5)
    assert cp.decide("off", T=32768, HV=8, N=1, **kw) == 0
    assert cp.decide(5, T=32768, HV=8, N=1, **kw) == cp.encode(5, 5)
    assert min(cp.decode(cp.decide("on", T=32768, HV=64, N=1, lengths=[32768], **kw))) > 0   # forced: best L
    assert cp.decide(4, T=32768, HV=8, N=1, **dict(kw, K=96, V=96)) == 0             # no kernel for (96, 96)
    assert cp.decide("auto", T=32768, HV=8, N=1, **dict(kw, device=torch.device("cpu"))) == 0
    # varlen without host lengths: the sequences are taken as equal (the conservative case)
    assert cp.decode(cp.decide("auto", T=32768, HV=4, N=2, **kw))[0] > 0
    assert cp.decide("auto", T=32768, HV=8, N=32, **kw) == 0
    assert cp.decide("auto", T=32768, HV=8, N=1, **dict(kw, kset=portable_set)) == 0      # the portable path
    assert cp.decide(3, T=32768, HV=8, N=1, **dict(kw, kset=portable_set)) == cp.encode(3, 3)
    # the backward: chunk_bwd is ~15x the forward per chunk, one CTA per (sequence, value head): 16/32 1x8192
    # splits only the backward, 2/4 1x8192 both, a batch that fills the GPU neither
    kb = dict(kw, kset=ks_bwd)
    fwd, bwd = cp.decode(cp.decide("auto", T=8192, HV=32, N=1, lengths=[8192], **kb))
    assert fwd == 0 and bwd > 0, (fwd, bwd)
    # the unsplit forward saves the start states (`decide` counts on it): no E pass, one scan (measured on the
    # H200: chunk_bwd and the recompute over the whole sequence 1.57 ms)
    ps = cp.predict_bwd(T=8192, N=1, HV=32, K=128, V=128, L=bwd, sms=132, lengths=[8192], starts_saved=True)
    pb = cp.predict_bwd(T=8192, N=1, HV=32, K=128, V=128, L=bwd, sms=132, lengths=[8192])
    assert ps["cp"] < cp.MARGIN * ps["serial"] and ps["serial"] > 1200
    assert ps["e"] == 0 and ps["cp"] < pb["cp"]
    # 2/4 1x8192: the backward splits; the forward's sequence is below MIN_SEQ_CHUNKS (measured: no gain at 8k)
    assert cp.decode(cp.decide("auto", T=8192, HV=4, N=1, lengths=[8192], **kb))[1] > 0
    assert cp.decode(cp.decide("auto", T=8192, HV=4, N=1, lengths=[8192], **kb))[0] == 0
    assert cp.decide("auto", T=32768, HV=32, N=4, lengths=[8192] * 4, **kb) == 0
    # `auto_lengths` (the benchmark's cp column) is the decision itself, both passes
    for T, HV, lengths in ((8192, 32, [8192]), (8192, 4, [8192]), (32768, 8, [32768]), (16384, 8, [12000, 4384])):
        got = cp.auto_lengths(T=T, N=len(lengths), HV=HV, K=128, V=128, sms=132, lengths=lengths)
        assert cp.encode(*got) == cp.decide("auto", T=T, HV=HV, N=len(lengths), lengths=lengths, **kb), (T, HV)
    assert cp.decode(cp.decide("auto", T=8192, HV=32, N=1, lengths=[8192], **dict(kb, K=128, V=256)))[1] == 0
    del kw["varlen"], kb["varlen"]
    assert cp.resolve_code(cp.CP_AUTO, T=32768, HV=8, N=1, varlen=True, **kw) == cp.decode(cp.decide(
        "auto", T=32768, HV=8, N=1, varlen=True, **kw))[0]
    code = cp.decide("auto", T=8192, HV=32, N=1, varlen=True, **kb)
    assert cp.resolve_code(code, T=8192, HV=32, N=1, varlen=True, backward=True, **kb) == cp.decode(code)[1]
    # a traced call (CP_AUTO) saves no start states: its backward takes the model without them
    assert cp.resolve_code(cp.CP_AUTO, T=8192, HV=32, N=1, varlen=True, backward=True, bwd_kset=ks_bwd,
                           **kb) == cp.choose_bwd(T=8192, N=1, HV=32, K=128, V=128, sms=132, lengths=None,
                                                  seq_len=None) > 0
    assert cp.resolve_code(cp.CP_AUTO, T=8192, HV=32, N=1, varlen=True, backward=True, bwd_kset=portable_set,
                           **kb) == 0                                       # chunk_bwd on the portable path
    with pytest.raises(ValueError, match="code"):
        cp.decode(cp.CP_AUTO)


def test_backward_model_prices_the_saved_states(monkeypatch):
    """Where the unsplit forward saves every chunk state (FLASHDELTA_SAVE_STATES, default on), neither the serial
    backward nor CP's runs a state_recompute: both pay the forward's state stores instead (`save_states_us`: a share
    of the forward pass, or the bytes at the stores' rate where that is longer), and the decision follows the
    variable."""
    kw = dict(T=32768, N=1, HV=32, K=128, V=128, sms=132, lengths=[32768])
    saved = cp.predict_bwd(L=32, starts_saved=True, states_saved=True, **kw)
    recompute = cp.predict_bwd(L=32, starts_saved=True, **kw)
    assert saved["serial_bwd"] == recompute["serial_bwd"] and saved["bwd"] == recompute["bwd"]
    assert saved["states"] == saved["serial_states"] < recompute["states"] < recompute["serial_states"]
    assert saved["cp"] == pytest.approx(recompute["cp"] - recompute["states"] + saved["states"])
    # 16/32 6413+6673+10954+8728: 542 MB of states, 181 us at 3 TB/s (measured on an H100: +201 us)
    assert cp_model.save_states_us(T=32768, HV=32, K=128, V=128, fwd_us=500.0) == pytest.approx(
        32768 // 64 * 32 * 128 * 128 * 2 / 3e6)
    assert cp_model.save_states_us(T=8192, HV=4, K=128, V=128, fwd_us=175.0) == pytest.approx(0.16 * 175.0)
    monkeypatch.delenv(cp_model.ENV_SAVE_STATES, raising=False)
    assert cp.auto_lengths(**kw) == (0, cp.choose_bwd(**kw, starts_saved=True, states_saved=True)) != (0, 0)
    monkeypatch.setenv(cp_model.ENV_SAVE_STATES, "0")
    assert cp.auto_lengths(**kw) == (0, cp.choose_bwd(**kw, starts_saved=True))
