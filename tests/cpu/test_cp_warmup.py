"""The gate-driven warm-up of the device-side CP forward (`flashdelta.cp.windows`) and backward (`grad_windows`),
docs/algorithm.md §4.4, on the portable backend, on the CPU.

- the windows equal the float64 reference's `warmup_chunks` (window lengths, fallback heads, summed log decays) on
  ragged partition edges, sequences shorter than a partition, an empty one, many short with one long, dense input,
  benchmark gates (a quarter of the heads exactly 0), model gates, all-zero gates; a sequence's last partition walks
  nothing in either pass; the contraction condition (``0 <= beta ||k||^2 <= 2``) sends a partition's heads to the
  exact path where one token breaks it; padding garbage changes nothing; the windows trace on meta tensors (no
  device value read on the host: CUDA graphs capture them);
- without a threshold (the exact path) the forward's windows walk every partition that is not its sequence's last
  whole and nothing else, the backward's every one that is not its sequence's first;
- `chunk_skip` in the portable chunk_fwd walks exactly the chunks from the skip on;
- the summary passes with the windows and the scan give the reference's warm-up start states (float64, 1e-12);
- at head dim 128 the truncation at every partition boundary is within the documented bound (exp(window log decay)
  x the state entering the window, compounded through fallback partitions) and the bound is tight (err / bound
  >= 0.3), warm-up on vs exact CP vs serial;
- through the public API: warm-up on equals the reference warm-up driver (float64, 1e-12) and stays within the bound
  of serial; a never-decaying head falls back and stays exact to fp32 rounding;
- the request (argument of `make_plan`, FLASHDELTA_CP_WARMUP, the dtype rule of ``auto``; a bad variable raises at
  the call, before any kernel, with CP off too) and the cost model with the warm-up (expected and worst case).

The backward's warm-up of the end gradients (`flashdelta.cp.grad_windows`):

- its windows (prefixes of the partitions that are not their sequence's first) equal the reference's
  `warmup_chunks(direction="bwd")` on the same kinds of cases and on a ragged last partition whose window ends at its
  ragged last chunk; a sequence's first partition walks nothing; the contraction condition sends a partition's heads to
  the exact path where one of its tokens breaks it and only then (the next sequence's tokens, the padding tail, even
  NaN, change nothing); the windows trace on meta tensors;
- `chunk_take` in the portable chunk_dstate (and its float64 twin) gives the start gradient of exactly the first
  chunks;
- the F pass over the windows with the warm-up heads' M zeroed and both torch reverse scans give the reference's
  warm-up end gradients (float64, 1e-12); `cp_chunk_bwd` with the warm-up equals the reference composite (exact start
  states, warm-up end gradients, chunk_bwd) in every gradient (1e-12), h0 and dht present and absent;
- at head dim 128 the truncation at every partition boundary is within the documented bound (exp(window log decay) x
  the gradient at the window's end, compounded through fallback partitions), warm-up on vs exact CP vs serial, and the
  bound is tight (err / bound >= 0.3);
- through the public API: the backward's request is the plan's (FLASHDELTA_CP_WARMUP, shared with the forward), every
  gradient with the warm-up on stays within ~exp(threshold) of serial; a never-decaying head falls back and the
  gradients stay exact to fp32 rounding; all-zero gates likewise;
- the cost model with the backward's warm-up (expected and worst case, where it pays and where it does not).
"""
from __future__ import annotations

import math

import pytest
import torch

from _helpers import Case, assert_close, make_inputs
from flashdelta import chunk_gated_delta_rule, cp, dispatch, portable
from flashdelta.reference import chunked as ref
from flashdelta.reference import cp as rcp

F64 = torch.float64


def _flat(x, name):
    t = x[name]
    return None if t is None else t.reshape(1, -1, *t.shape[2:])


def _stage_inputs(case: Case, dtype=F64, seed=0):
    x = make_inputs(case, dtype=dtype, seed=seed)
    if dtype == F64:
        x = {n: (t.to(F64) if torch.is_tensor(t) and t.is_floating_point() else t) for n, t in x.items()}
    q, k, v, g, beta = (_flat(x, n) for n in ("q", "k", "v", "g", "beta"))
    cu = x["cu_seqlens"]
    seq_len = None
    if cu is None:
        B, T = x["q"].shape[:2]
        cu, seq_len = torch.arange(B + 1, dtype=torch.int32) * T, T
    g_cumsum, A = portable.prepare_fwd(k, g, beta, cu)
    return x, q, k, v, g_cumsum, beta, A, cu, seq_len


# ----------------------------------------------------------------------------------------- the windows

WINDOW_CASES = [
    # (case, partition chunks, threshold)
    # benchmark gates (~ -3.2 per chunk: 4-chunk windows; heads 0, 1 exactly 0), ragged edges, an empty sequence,
    # one shorter than a partition, padding
    (Case("bench_edges", (1100, 1, 700, 0, 130, 2000), H=1, HV=8, K=16, V=8, gate="bench", pad=5), 6, -10.0),
    # model gates (head 0 never decays, head 1 barely), many short sequences with one long, GVA 2
    (Case("model_short_long", (3, 70, 2, 64, 2500, 64, 1, 40), H=2, HV=4, K=16, V=16), 4, -10.0),
    # dense, a lower threshold: the windows are shorter than the partitions but longer than one chunk
    (Case("bench_dense", (1536, 1536), H=1, HV=4, K=16, V=8, gate="bench", varlen=False), 8, -4.0),
    # every gate exactly 0: every head of every partition falls back
    (Case("zero_gates", (900, 300), H=1, HV=2, K=8, V=8, gate="zero"), 3, -10.0),
]
WINDOW_IDS = [c[0].name for c in WINDOW_CASES]


@pytest.mark.parametrize("case,L,thr", WINDOW_CASES, ids=WINDOW_IDS)
def test_windows_equal_the_reference(case, L, thr):
    x, q, k, v, g_cumsum, beta, A, cu, seq_len = _stage_inputs(case)
    plan = cp.make_plan(cu, q.shape[1], L, seq_len=seq_len)
    parts = rcp.partition(cu, L)
    want = rcp.warmup_chunks(g_cumsum, parts, threshold=thr, direction="fwd")
    win = cp.windows(g_cumsum, k, beta, plan, thr)
    used = slice(0, parts.P)
    assert win.skip_e.dtype == win.skip_m.dtype == torch.int32 and win.skip_e.shape == (plan.P, case.HV)
    assert torch.equal(win.n(L)[used], want.n) and torch.equal(win.fallback[used], want.fallback)
    assert_close("log_decay", win.log_decay(L)[used], want.log_decay, tol=1e-12)
    for p in range(parts.P):
        if parts.last[p]:                               # the scan reads no summary of it: nothing walked
            assert bool((win.skip_e[p] == cp.SKIP_ALL).all() and (win.skip_m[p] == cp.SKIP_ALL).all())
    fb, warm = win.fallback[used], ~win.fallback[used] & (win.n(L)[used] > 0)
    assert bool((win.skip_m[used][fb] == 0).all() and (win.skip_e[used][fb] == 0).all())
    assert bool((win.skip_m[used][warm] == cp.SKIP_ALL).all())
    assert bool((win.skip_e[parts.P:] == cp.SKIP_ALL).all() and (win.skip_m[parts.P:] == cp.SKIP_ALL).all())
    inner = [p for p in range(parts.P) if not parts.last[p]]
    if case.gate == "zero":
        assert bool(win.fallback[inner].all())
    else:                   # the case exercises both paths; the never-decaying head always falls back
        assert bool(win.fallback[inner, 0].all()) and bool(warm.any())
    if case.name == "bench_dense":
        assert bool((win.n(L)[inner][:, 1:] > 1).all()) and bool((win.n(L)[inner][:, 1:] < L).all())


@pytest.mark.parametrize("case,L,thr", WINDOW_CASES, ids=WINDOW_IDS)
def test_exact_windows_walk_every_inner_partition(case, L, thr):
    """Without a threshold (the exact path) every head falls back: the forward's M and E passes walk every chunk of
    each partition that is not its sequence's last and nothing of the last ones and of the unused slots; the
    backward's F pass every chunk of each partition that is not its sequence's first and nothing of the first ones
    and of the unused slots. No gate is summed (suffix / prefix None)."""
    x, q, k, v, g_cumsum, beta, A, cu, seq_len = _stage_inputs(case)
    plan = cp.make_plan(cu, q.shape[1], L, seq_len=seq_len)
    parts = rcp.partition(cu, L)
    used = parts.P
    inner = torch.zeros(plan.P, dtype=torch.bool)
    inner[:used] = ~torch.as_tensor(parts.last, dtype=torch.bool)
    cont = torch.zeros(plan.P, dtype=torch.bool)
    cont[:used] = ~torch.as_tensor(parts.first, dtype=torch.bool)
    assert bool(inner.any()) and bool(cont.any())
    win = cp.windows(g_cumsum, k, beta, plan, None)
    assert win.suffix is None and win.threshold is None
    for skip in (win.skip_e, win.skip_m):
        assert skip.dtype == torch.int32 and skip.shape == (plan.P, case.HV)
        assert bool((skip[inner] == 0).all()) and bool((skip[~inner] == cp.SKIP_ALL).all())
    assert torch.equal(win.fallback, inner[:, None].expand(plan.P, case.HV))
    gw = cp.grad_windows(g_cumsum, k, beta, plan, None)
    assert gw.prefix is None and gw.threshold is None and gw.take.dtype == torch.int32
    assert bool((gw.take[cont] == cp.TAKE_ALL).all()) and bool((gw.take[~cont] == 0).all())
    assert torch.equal(gw.fallback, cont[:, None].expand(plan.P, case.HV))


# per pass: the window function, its fields compared, two partitions of the first sequence (the forward's inner ones,
# the backward's second and third, the last one ragged), a token of the first (outside its window) and of the second
CONTRACTION = {
    "fwd": (cp.windows, 3, 0, 1, lambda cu, a, b: (int(cu[a]) + 10, int(cu[b + 1]) - 3)),
    "bwd": (cp.grad_windows, 2, 1, 2, lambda cu, a, b: (int(cu[a + 1]) - 5, int(cu[b]) + 3)),
}


@pytest.mark.parametrize("which", list(CONTRACTION))
def test_windows_contraction_condition(which):
    """A token with beta ||k||^2 outside [0, 2] (the norm bound's condition, docs/algorithm.md §4.2) sends its
    partition's head to the exact path (the whole partition counts, not only the window); with `keys_normalized`
    only beta is read (the caller vouches for k); garbage on the padding tail changes nothing; the backward's ragged
    last partition does not read the next sequence's tokens."""
    fn, fields, p_a, p_b, tokens = CONTRACTION[which]
    case, L, thr = WINDOW_CASES[0]
    x, q, k, v, g_cumsum, beta, A, cu, _ = _stage_inputs(case)
    plan = cp.make_plan(cu, q.shape[1], L)
    base = fn(g_cumsum, k, beta, plan, thr)
    h = 5                                                    # a decaying head
    assert not bool(base.fallback[p_a, h]) and not bool(base.fallback[p_b, h])
    t_a, t_b = tokens(plan.cu, p_a, p_b)
    beta2 = beta.clone()
    beta2[0, t_a, h] = 2.5                                   # b ||k||^2 = 2.5 > 2
    k2 = k.clone()
    k2[0, t_b, 0] *= 2.0                                     # ||k||^2 = 4: b ||k||^2 > 2 where b > 0.5
    beta2[0, t_b, :] = 0.9
    win = fn(g_cumsum, k2, beta2, plan, thr)
    changed = win.fallback != base.fallback
    assert bool(win.fallback[p_a, h]) and bool(win.fallback[p_b].all()), "every head of p_b reads k2[t_b]"
    assert set(map(tuple, changed.nonzero().tolist())) <= {(p_a, h)} | {(p_b, j) for j in range(case.HV)}
    normed = fn(g_cumsum, k2, beta2, plan, thr, keys_normalized=True)
    assert bool(normed.fallback[p_a, h]) and torch.equal(normed.fallback[p_b], base.fallback[p_b])
    beta3 = beta.clone()
    beta3[0, t_b, 2] = -0.5                                  # a negative write strength expands the state
    assert bool(fn(g_cumsum, k, beta3, plan, thr).fallback[p_b, 2])
    # the padding tail (tokens >= cu[N]) is never read
    pad = slice(int(cu[-1]), None)
    g3, beta4, k4 = g_cumsum.clone(), beta.clone(), k.clone()
    g3[0, pad], beta4[0, pad], k4[0, pad] = -1e4, float("nan"), float("nan")
    for a, b in zip(fn(g3, k4, beta4, plan, thr)[:fields], base[:fields]):
        assert torch.equal(a, b)
    if which == "bwd":      # the tokens right after the ragged p_b (sequence 1's only token, sequence 2's first)
        beta4[0, int(plan.cu[p_b + 1]):int(plan.cu[p_b + 1]) + 40] = 7.0
        got = fn(g3, k4, beta4, plan, thr)
        assert torch.equal(got.take[:p_b + 1], base.take[:p_b + 1])
        assert torch.equal(got.fallback[:p_b + 1], base.fallback[:p_b + 1])


@pytest.mark.parametrize("which", list(CONTRACTION))
def test_windows_read_prepares_key_norms(which):
    """With prepare's squared key norms (`prepare_fwd(norms=True)`: K K^T's diagonal, the portable twin's sum of
    squares) in place of k the warm-up decides as it does reading k, on the base case and with the contraction
    condition broken by a long key and by beta (the norms recomputed from the changed k)."""
    fn, fields, p_a, p_b, tokens = CONTRACTION[which]
    case, L, thr = WINDOW_CASES[0]
    x, q, k, v, g_cumsum, beta, A, cu, _ = _stage_inputs(case)
    plan = cp.make_plan(cu, q.shape[1], L)
    t_a, t_b = tokens(plan.cu, p_a, p_b)
    k2, beta2 = k.clone(), beta.clone()
    k2[0, t_b, 0] *= 2.0
    beta2[0, t_b, :] = 0.9
    beta2[0, t_a, 5] = 2.5
    for kk, bb in ((k, beta), (k2, beta2)):
        norms = portable.prepare_fwd(kk, x["g"].reshape(1, -1, case.HV), bb, cu, norms=True)[-1]
        assert norms.shape == (1, kk.shape[1], case.H)
        assert torch.equal(norms[0, :int(cu[-1])], kk[0, :int(cu[-1])].square().sum(-1))
        got, want = fn(g_cumsum, kk, bb, plan, thr, k_norm2=norms), fn(g_cumsum, kk, bb, plan, thr)
        for a, b in zip(got[:fields], want[:fields]):
            assert torch.equal(a, b)
    assert bool(got.fallback[p_b].all()), "the long key reaches every head of p_b through the norms"
    inner = want.fallback | (fn(g_cumsum, kk, bb, plan, None).fallback)
    loud = fn(g_cumsum, kk, bb, plan, thr, k_norm2=norms * 100.0)       # the norms, not k, decide
    assert torch.equal(loud.fallback, fn(g_cumsum, kk, bb, plan, None).fallback) and bool(inner.any())


def test_windows_need_no_device_values():
    """The windows trace on meta tensors (a data-dependent op, `.item()` or a host read would raise there): CUDA
    graphs capture them and replay them with new lengths."""
    meta = dict(device="meta")
    plan = cp.make_plan(torch.empty(6, dtype=torch.int32, **meta), 3000, 4)
    g = torch.empty(1, 3000, 8, **meta)
    k = torch.empty(1, 3000, 2, 64, dtype=torch.bfloat16, **meta)
    beta = torch.empty(1, 3000, 8, dtype=torch.bfloat16, **meta)
    for normed in (False, True):
        win = cp.windows(g, k, beta, plan, -10.0, keys_normalized=normed)
        assert win.skip_e.shape == win.skip_m.shape == (plan.P, 8) and win.suffix.shape == (plan.P, 4, 8)


def test_chunk_skip_walks_the_chunks_from_the_skip():
    """The portable chunk_fwd with `chunk_skip` (and its float64 twin) ends where a walk over the chunks from the
    skip on ends: skips past the end leave the initial state, negative ones walk everything."""
    case = Case("skip", (700, 1, 300, 0, 130), H=1, HV=3, K=16, V=8, pad=4)
    x, q, k, v, g_cumsum, beta, A, cu, _ = _stage_inputs(case)
    h0 = x["initial_state"]
    skip = torch.tensor([[2, 0, 11], [1, 0, 5], [-3, 4, 1], [0, 2, 7], [1, 3, 0]], dtype=torch.int32)
    _, ht = ref.chunk_fwd(q, k, v, g_cumsum, beta, A, h0, cu, scale=0.25, chunk_skip=skip)
    for n in range(len(cu) - 1):
        bos, eos = int(cu[n]), int(cu[n + 1])
        for h in range(case.HV):
            start = min(bos + max(int(skip[n, h]), 0) * 64, eos)
            sl = slice(start, eos)
            one = torch.tensor([0, eos - start], dtype=torch.int32)
            _, want = ref.chunk_fwd(q[:, sl], k[:, sl], v[:, sl, h:h + 1], g_cumsum[:, sl, h:h + 1],
                                    beta[:, sl, h:h + 1], A[:, sl, h:h + 1], h0[n:n + 1, h:h + 1], one, scale=0.25)
            assert_close("ht", ht[n, h], want[0, 0], tol=1e-13)
    with pytest.raises(ValueError, match="chunk_skip"):
        portable.chunk_fwd(q, k, v, g_cumsum, beta, A, h0, cu, scale=0.25, chunk_skip=skip[:2])


# ----------------------------------------------------------------------------------------- start states

@pytest.mark.parametrize("case,L,thr", WINDOW_CASES, ids=WINDOW_IDS)
def test_warmup_start_states_equal_the_reference(case, L, thr):
    """The summary passes over the windows (E over each head's window, M over the fallback heads only, 0 elsewhere)
    and both torch scans give the float64 reference's warm-up start states."""
    x, q, k, v, g_cumsum, beta, A, cu, seq_len = _stage_inputs(case)
    plan = cp.make_plan(cu, q.shape[1], L, seq_len=seq_len)
    parts = rcp.partition(cu, L)
    win = cp.windows(g_cumsum, k, beta, plan, thr)
    M, E = cp.summaries(q, k, v, g_cumsum, beta, A, plan, scale=0.25, chunk_fwd=portable.chunk_fwd,
                        windows=win)
    plan_ref = rcp.warmup_chunks(g_cumsum, parts, threshold=thr, direction="fwd")
    for h0 in (x["initial_state"], None):
        want, _ = rcp.warmup_states(k, v, g_cumsum, beta, A, h0, parts, plan_ref)
        for method in ("serial", "log"):
            assert_close("h", cp.scan_states(M, E, plan, h0, method)[:parts.P], want, tol=1e-12)


def test_out_fills_one_o_from_complementary_skips():
    """`chunk_fwd(out=...)` (portable): two calls over complementary `chunk_skip`s (each (sequence, head) walked
    whole by one of them, from the same initial state) fill one o, equal to one call without skips; each call
    writes only its walked chunks and the padding tail (a NaN-filled o keeps NaN nowhere)."""
    case = Case("out_skips", (300, 1, 700, 0, 130), H=1, HV=4, K=16, V=8, gate="bench", pad=7)
    x, q, k, v, g_cumsum, beta, A, cu, _ = _stage_inputs(case)
    h0 = x["initial_state"]
    N = len(cu) - 1
    kw = dict(scale=0.25)
    o_one, ht_one = portable.chunk_fwd(q, k, v, g_cumsum, beta, A, h0, cu, **kw)
    mine = torch.rand(N, case.HV, generator=torch.Generator().manual_seed(1)) < 0.5
    skip = torch.where(mine, 0, cp.SKIP_ALL).to(torch.int32)
    o = torch.full_like(v, float("nan"))
    o_a, ht_a = portable.chunk_fwd(q, k, v, g_cumsum, beta, A, h0, cu, chunk_skip=skip, out=o, **kw)
    assert o_a is o and bool(o[0, -case.pad:].eq(0).all())
    o_b, ht_b = portable.chunk_fwd(q, k, v, g_cumsum, beta, A, h0, cu, chunk_skip=cp.SKIP_ALL - skip, out=o, **kw)
    assert o_b is o and not bool(o.isnan().any())
    assert_close("o", o, o_one, tol=1e-13)
    assert_close("ht", torch.where(mine[..., None, None], ht_a, ht_b), ht_one, tol=1e-13)
    with pytest.raises(ValueError, match="out"):
        portable.chunk_fwd(q, k, v, g_cumsum, beta, A, h0, cu, out=o[:, :-1], **kw)
    with pytest.raises(ValueError, match="out"):
        portable.chunk_fwd(q, k, v, g_cumsum, beta, A, h0, cu, states_only=True, out=o, **kw)


@pytest.mark.parametrize("case,L,thr", WINDOW_CASES, ids=WINDOW_IDS)
def test_overlapped_output_pass_equals_one_launch(case, L, thr, monkeypatch):
    """The forward's output pass in two launches (`cp._output_overlapped`: the exact heads' summaries, scan and
    output pass beside the warm-up heads' window E pass and output pass, into one o) gives the one-launch output
    pass's o and final states (float64, portable launchers, the side stream inline on the CPU), h0 present and
    absent, both state layouts; where no head falls back or every head does too (the zero-gate case)."""
    x, q, k, v, g_cumsum, beta, A, cu, seq_len = _stage_inputs(case)
    plan = cp.make_plan(cu, q.shape[1], L, seq_len=seq_len, warmup=thr)
    backends = dispatch.plan(torch.device("cpu"), case.K, case.V, F64, need_bwd=False)
    for h0, v_first in ((x["initial_state"], False), (None, False), (x["initial_state"], True)):
        if h0 is not None and v_first:
            h0 = h0.transpose(-1, -2).contiguous()
        runs = []
        for overlap in (False, True):
            monkeypatch.setattr(cp, "_overlaps", lambda *a, on=overlap: on)
            monkeypatch.setenv("FLASHDELTA_POISON", "1")
            runs.append(cp.cp_chunk_fwd(q, k, v, g_cumsum, beta, A, h0, cu, scale=0.25, state_v_first=v_first,
                                        plan=plan, backends=backends))
        (o0, ht0), (o1, ht1) = runs
        assert not bool(o1.isnan().any()) and not bool(ht1.isnan().any())
        assert_close("o", o1, o0, tol=1e-13)
        assert_close("final", ht1, ht0, tol=1e-13)


class _SavingBackends:
    """The portable launchers, with chunk_fwd given the SM90 launcher's `save_states` (`state_seqs`, `states_out`,
    with `chunk_skip`): the state entering every chunk walked, in q's dtype, V-first, at the native slots (item n's
    chunk c at ``cu[n] // 64 + seq[n] + c``; docs/stages.md), the other slots untouched (NaN-poisoned when allocated
    here). Built from `portable.state_recompute`, so it takes skips of 0 or of every chunk only (what the CP output
    passes launch)."""

    def __init__(self, backends):
        self.backends = backends

    def kset(self, name):
        return self.backends.kset(name)

    def fn(self, name):
        return self.chunk_fwd if name == "chunk_fwd" else self.backends.fn(name)

    @staticmethod
    def chunk_fwd(q, k, v, g_cumsum, beta, A, h0, cu, *, save_states=False, state_seqs=None, states_out=None,
                  chunk_skip=None, **kw):
        out = portable.chunk_fwd(q, k, v, g_cumsum, beta, A, h0, cu, chunk_skip=chunk_skip, **kw)
        if not save_states:
            return out
        T, HV, K, V = q.shape[1], v.shape[2], k.shape[3], v.shape[3]
        seq, n_seq = state_seqs
        hs = states_out if states_out is not None else q.new_full((T // 64 + n_seq + 1, HV, V, K), math.nan)
        h = portable.state_recompute(k, v, g_cumsum, beta, A, h0, cu, state_v_first=kw.get("state_v_first", False))
        g = 0
        for n in range(cu.shape[0] - 1):
            nt = -(-(int(cu[n + 1]) - int(cu[n])) // 64)
            skip = torch.zeros(HV, dtype=torch.long) if chunk_skip is None else chunk_skip[n].long()
            assert bool(((skip == 0) | (skip >= nt)).all()), "skips of 0 or of every chunk only"
            for c in range(nt):
                walked = skip <= c
                slot = int(cu[n]) // 64 + int(seq[n]) + c
                hs[slot, walked] = h[g + c, walked].transpose(-1, -2).to(hs.dtype)
            g += nt
        return (*out, hs)


@pytest.mark.parametrize("case,L,thr", WINDOW_CASES[:2], ids=WINDOW_IDS[:2])
def test_overlapped_output_pass_saves_the_one_launch_states(case, L, thr, monkeypatch):
    """The training forward's overlapped output pass (`save_states`: both launches write their chunks' states into one
    tensor, `states_out`) saves the states the one-launch output pass saves, slot for slot (the unwritten slots of
    both NaN), and the same o and final states (float64, portable launchers with the SM90 launcher's state output)."""
    x, q, k, v, g_cumsum, beta, A, cu, seq_len = _stage_inputs(case)
    plan = cp.make_plan(cu, q.shape[1], L, seq_len=seq_len, warmup=thr)
    backends = _SavingBackends(dispatch.plan(torch.device("cpu"), case.K, case.V, F64, need_bwd=False))
    monkeypatch.setenv("FLASHDELTA_POISON", "1")
    runs = []
    for overlap in (False, True):
        monkeypatch.setattr(cp, "_overlaps", lambda *a, on=overlap: on)
        runs.append(cp.cp_chunk_fwd(q, k, v, g_cumsum, beta, A, x["initial_state"], cu, scale=0.25, plan=plan,
                                    backends=backends, save_states=True))
    (o0, ht0, hs0), (o1, ht1, hs1) = runs
    assert_close("o", o1, o0, tol=1e-13)
    assert_close("final", ht1, ht0, tol=1e-13)
    written = ~hs0.isnan()
    assert bool((written == ~hs1.isnan()).all()), "the same slots written"
    assert int(written.sum()) > 0
    assert_close("states", hs1[written], hs0[written], tol=1e-13)


def test_overlapped_output_pass_with_a_head_on_both_paths(monkeypatch):
    """One token outside the contraction bound sends a decaying head's first partition to the exact path while its
    later partitions warm up: the overlapped output pass's scan walks that head through partitions of both kinds,
    and its two output launches split the head's partitions; o and the final state equal the one-launch path's."""
    case, L, thr = WINDOW_CASES[0]
    x, q, k, v, g_cumsum, beta, A, cu, _ = _stage_inputs(case)
    plan = cp.make_plan(cu, q.shape[1], L, warmup=thr)
    h = 5                                                    # a decaying head
    beta = beta.clone()
    beta[0, int(plan.cu[0]) + 10, h] = 2.5                   # b ||k||^2 > 2 in partition 0
    win = cp.windows(g_cumsum, k, beta, plan, thr)
    assert bool(win.fallback[0, h]) and not bool(win.fallback[1, h]), "head 5: partition 0 exact, 1 warm"
    backends = dispatch.plan(torch.device("cpu"), case.K, case.V, F64, need_bwd=False)
    monkeypatch.setenv("FLASHDELTA_POISON", "1")
    runs = []
    for overlap in (False, True):
        monkeypatch.setattr(cp, "_overlaps", lambda *a, on=overlap: on)
        runs.append(cp.cp_chunk_fwd(q, k, v, g_cumsum, beta, A, x["initial_state"], cu, scale=0.25, plan=plan,
                                    backends=backends))
    (o0, ht0), (o1, ht1) = runs
    assert_close("o", o1, o0, tol=1e-13)
    assert_close("final", ht1, ht0, tol=1e-13)


# (case, partition chunks, threshold, minimum tightness err / bound over the boundaries)
BOUND_CASES = [
    # head dim 128, benchmark gates: the realistic setting; a threshold where the truncation is far above rounding
    (Case("bound_bench_K128", (1152, 200), H=1, HV=4, K=128, V=64, gate="bench"), 6, -4.0, 0.3),
    # the default threshold on model gates at head dim 64: truncation far below fp32 rounding, bound holds
    (Case("bound_model_K64", (900, 250), H=2, HV=4, K=64, V=32), 3, -10.0, 0.0),
]


@pytest.mark.parametrize("case,L,thr,tight", BOUND_CASES, ids=[c[0].name for c in BOUND_CASES])
def test_warmup_within_the_bound(case, L, thr, tight):
    """Warm-up on vs exact CP vs serial (float64): at every partition boundary each head's start-state error is
    within exp(window log decay) x ||state entering its window|| (compounded through fallback partitions,
    docs/algorithm.md §4.4), the exact CP start states equal the serial states, and the bound is tight."""
    x, q, k, v, g_cumsum, beta, A, cu, _ = _stage_inputs(case)
    h0 = x["initial_state"]
    plan = cp.make_plan(cu, q.shape[1], L)
    parts = rcp.partition(cu, L)
    win = cp.windows(g_cumsum, k, beta, plan, thr)
    kw = dict(scale=case.K ** -0.5, chunk_fwd=portable.chunk_fwd)
    warm = cp.scan_states(*cp.summaries(q, k, v, g_cumsum, beta, A, plan, windows=win, **kw), plan, h0)
    exact = cp.scan_states(*cp.summaries(q, k, v, g_cumsum, beta, A, plan, **kw), plan, h0)
    states = ref.state_recompute(k, v, g_cumsum, beta, A, h0, cu)        # [NT, HV, K, V]: serial truth
    n, decay = win.n(L), torch.exp(win.log_decay(L))
    assert bool((~win.fallback[:parts.P] & (n[:parts.P] > 0)).any()), "the case must truncate"
    ratios, bound = [], None
    for p in range(parts.P):
        truth = states[parts.chunk_start[p]]
        assert_close("exact", exact[p], truth, tol=1e-12)
        if parts.first[p]:
            bound = torch.zeros(case.HV, dtype=F64)
        err = (warm[p] - truth).flatten(1).norm(dim=1)
        assert bool((err <= bound * (1 + 1e-9) + 1e-13).all()), f"partition {p}: error {err} > bound {bound}"
        ratios += [float(e / b) for e, b in zip(err, bound) if b > 1e-12]
        if parts.last[p]:
            continue
        ws = parts.chunk_start[p] + parts.nchunks[p] - n[p]                 # each head's window start (chunk)
        entering = torch.stack([states[int(ws[i]), i] for i in range(case.HV)]).flatten(1).norm(dim=1)
        bound = torch.where(win.fallback[p], decay[p] * bound, decay[p] * entering)
    print(f"{case.name}: err/bound max {max(ratios, default=0):.3f}")
    assert max(ratios, default=0.0) >= tight, f"bound not tight: max err/bound {max(ratios, default=0):.3g}"


# ----------------------------------------------------------------------------------------- through the API

API_CASES = [
    # (case, partition chunks, threshold)
    (Case("api_bench_edges_h0", (1300, 1, 700, 0, 130), H=1, HV=8, K=16, V=8, gate="bench", pad=5), 6, -4.0),
    (Case("api_bench_short_long_noh0", (3, 0, 70, 2, 1500, 64), H=1, HV=4, K=16, V=16, gate="bench", h0=False),
     5, -5.0),
    (Case("api_bench_dense_vfirst", (1024, 1024), H=2, HV=4, K=8, V=16, varlen=False, state_v_first=True,
          gate="bench"), 6, -4.0),
]


def _api(x, **kw):
    return chunk_gated_delta_rule(**x, output_final_state=True, **kw)


@pytest.mark.parametrize("case,L,thr", API_CASES, ids=[c[0].name for c in API_CASES])
def test_api_warmup_equals_the_reference_driver(case, L, thr, monkeypatch):
    """float64 through the public API with the warm-up on (FLASHDELTA_CP_WARMUP = the threshold) equals the
    reference warm-up driver, and differs from serial by at most ~exp(threshold)."""
    x, q, k, v, g_cumsum, beta, A, cu, _ = _stage_inputs(case)
    monkeypatch.setenv(cp.ENV_WARMUP, str(thr))
    calls = []
    real = cp.cp_chunk_fwd
    monkeypatch.setattr(cp, "cp_chunk_fwd", lambda *a, **kw: calls.append(kw["plan"].warmup) or real(*a, **kw))
    o, ht = _api(x, context_parallel=L)
    assert calls == [thr]
    o_ref, ht_ref = rcp.cp_fwd(q, k, v, g_cumsum, beta, A, x["initial_state"], cu, state_v_first=case.state_v_first,
                               partition_chunks=L, mode="warmup", threshold=thr)
    assert_close("o", o.reshape(o_ref.shape), o_ref, tol=1e-12)
    assert_close("ht", ht, ht_ref, tol=1e-12)
    o0, ht0 = _api(x, context_parallel=False)
    err = assert_close("o", o, o0, tol=math.exp(thr))
    assert err > 1e-12, "the warm-up really truncated"
    assert_close("ht", ht, ht0, tol=math.exp(thr))


NEVER_DECAYING = [
    (Case("model_h0_ragged", (700, 1, 1300), H=2, HV=4, K=16, V=8, pad=5), 3),
    (Case("zero_gates", (900, 300), H=1, HV=2, K=8, V=8, gate="zero"), 3),
]


@pytest.mark.parametrize("case,L", NEVER_DECAYING, ids=[c[0].name for c in NEVER_DECAYING])
def test_api_never_decaying_head_stays_exact(case, L, monkeypatch):
    """Model gates (head 0: g = 0, head 1: ~-1e-4 per token) with the warm-up on in fp32: the slow heads fall back,
    the fast ones truncate far below rounding, so CP equals CP off to fp32 rounding; all-zero gates likewise."""
    x = make_inputs(case, dtype=torch.float32)
    _, q, k, _, g_cumsum, beta, _, cu, _ = _stage_inputs(case, dtype=torch.float32)
    win = cp.windows(g_cumsum, k, beta, cp.make_plan(cu, q.shape[1], L), cp.WARMUP_THRESHOLD)
    inner = win.n(L).sum(1) > 0
    assert bool(inner.any()) and bool(win.fallback[inner, 0].all()), "the never-decaying head falls back"
    o0, ht0 = _api(x, context_parallel=False)
    monkeypatch.setenv(cp.ENV_WARMUP, "on")
    o1, ht1 = _api(x, context_parallel=L)
    assert_close("o", o1, o0, tol=1e-5)
    assert_close("ht", ht1, ht0, tol=1e-5)


# ----------------------------------------------------------------------------------------- request and model

def test_warmup_request(monkeypatch):
    monkeypatch.delenv(cp.ENV_WARMUP, raising=False)
    assert cp.parse_warmup(None) == "auto"
    assert (cp.parse_warmup(False), cp.parse_warmup(True), cp.parse_warmup(-6), cp.parse_warmup("off")) == \
        ("off", "on", -6.0, "off")
    for raw, want in (("0", "off"), ("off", "off"), ("1", "on"), ("auto", "auto"), ("-16", -16.0), ("-7.5", -7.5)):
        monkeypatch.setenv(cp.ENV_WARMUP, raw)
        assert cp.parse_warmup(None) == want
    for bad in ("sometimes", "3", "nan"):
        monkeypatch.setenv(cp.ENV_WARMUP, bad)
        with pytest.raises(ValueError, match=cp.ENV_WARMUP):
            cp.parse_warmup(None)
    with pytest.raises(ValueError, match="warmup"):
        cp.parse_warmup(0.5)
    with pytest.raises(TypeError, match="warmup"):
        cp.parse_warmup([1])
    # auto: the kernels' dtypes warm up at -10, fp32 and float64 stay exact; on: every dtype; a threshold: as given
    assert cp.warmup_threshold("auto", torch.bfloat16) == cp.warmup_threshold("auto", torch.float16) == -10.0
    assert cp.warmup_threshold("auto", torch.float32) is None and cp.warmup_threshold("auto", F64) is None
    assert cp.warmup_threshold("on", F64) == -10.0 and cp.warmup_threshold(-16.0, torch.float32) == -16.0
    assert cp.warmup_threshold("off", torch.bfloat16) is None
    # the plan carries the request: the argument, else the variable (read when the plan is made)
    cu = torch.tensor([0, 700], dtype=torch.int32)
    monkeypatch.setenv(cp.ENV_WARMUP, "off")
    assert cp.make_plan(cu, 700, 2).warmup == "off" and cp.make_plan(cu, 700, 2, warmup=-12).warmup == -12.0
    monkeypatch.delenv(cp.ENV_WARMUP)
    assert cp.make_plan(cu, 700, 2).warmup == "auto"
    # auto also asks the cost model at the plan's L: 4/16 and 2/8 1x32768 in 32-chunk partitions warm up (the
    # shortened M and E passes save more than the windows kernel's measured cost), 8-chunk partitions of 5000 tokens
    # do not (one wave either way)
    q = torch.empty(1, 32768, 2, 128, dtype=torch.bfloat16, device="meta")
    big = cp.make_plan(torch.empty(2, dtype=torch.int32, device="meta"), 32768, 32)
    small = cp.make_plan(torch.empty(2, dtype=torch.int32, device="meta"), 5000, 8)
    assert cp._threshold(big, q, 16, 128, 128) == cp.WARMUP_THRESHOLD
    assert cp._threshold(big, q.float(), 16, 128, 128) is None, "fp32: exact under auto"
    assert cp._threshold(big, q, 8, 128, 128) == cp.WARMUP_THRESHOLD
    assert cp._threshold(small, q, 8, 128, 128) is None
    assert cp._threshold(small._replace(warmup="on"), q, 8, 128, 128) == cp.WARMUP_THRESHOLD
    assert cp._threshold(big._replace(warmup=-16.0), q.float(), 8, 128, 128) == -16.0
    assert cp._threshold(big._replace(warmup="off"), q, 8, 128, 128) is None


@pytest.mark.parametrize("cpv", [False, None, True, 3], ids=["off", "auto", "on", "L3"])
def test_bad_warmup_variable_raises_at_the_call(cpv, monkeypatch):
    """A bad FLASHDELTA_CP_WARMUP raises ValueError naming it at the call, before any kernel runs, whatever
    ``context_parallel`` says: with CP off and under ``auto`` on the CPU (serial) too, where no plan reads it."""
    from flashdelta import api

    x = make_inputs(Case("bad_env", (300,), H=1, HV=2, K=8, V=8), dtype=torch.float32)
    ran = []
    monkeypatch.setattr(api, "forward", lambda *a: ran.append(a))
    monkeypatch.delenv(cp.ENV_CP, raising=False)
    monkeypatch.setenv(cp.ENV_WARMUP, "sometimes")
    with pytest.raises(ValueError, match=cp.ENV_WARMUP):
        chunk_gated_delta_rule(**x, context_parallel=cpv)
    assert ran == [], "nothing ran before the check"


def test_cost_model_with_the_warmup():
    """The expected CP time with the warm-up is below the exact path's, which (plus the warm-up's cost) is its worst
    case (every head falls back); the warm-up runs only where it shortens the passes by more than its measured cost
    (not where every pass is one wave anyway); a split is taken only where even the worst case is at most
    WORST_MARGIN x serial. On the H200 rows the model is fitted to (2/8 and 4/16 1x32768) the warm-up is taken."""
    kw = dict(T=32768, N=1, HV=16, K=128, V=128, sms=132, lengths=[32768])
    pays = []
    for L in cp.CANDIDATE_L[:5]:
        w, e = cp.predict(L=L, warmup=True, **kw), cp.predict(L=L, warmup=False, **kw)
        assert not e["warmup"] and e["cp"] == e["cp_worst"] and w["out"] == e["out"]
        pays.append(w["warmup"])
        if w["warmup"]:
            assert w["cp"] < e["cp"] < w["cp_worst"]
            assert w["cp_worst"] == pytest.approx(e["cp"] + cp.cp_model.WARMUP_US)
            assert w["m"] < e["m"] and w["e"] <= e["e"]
        else:
            assert w["cp"] == e["cp"]
        inner = -(-32768 // (64 * L)) - 1
        assert w["warmup"] == cp.cp_model.warmup_pays(inner=inner, HV=16, K=128, V=128, L=L, sms=132)
    assert pays == [True, True, True, True, False], "L = 128: one wave of the passes either way at 4/16"
    # 4/16 and 2/8 split with the warm-up at a shorter L than exactly (the windows' smaller waves pay; the H200
    # measured 4/16 at 515 us with it at L = 32 against 619 exactly at L = 128), and the worst case (every head
    # falling back) stays within WORST_MARGIN x serial
    for hv in (16, 8):
        d = dict(kw, HV=hv)
        Lw, Le = cp.choose(warmup=True, **d), cp.choose(warmup=False, **d)
        assert 0 < Lw < Le and cp.predict(L=Lw, warmup=True, **d)["warmup"]
        assert not cp.predict(L=Le, warmup=False, **d)["warmup"]
        assert cp.predict(L=Lw, warmup=True, **d)["cp_worst"] <= cp.WORST_MARGIN * cp.predict(L=Lw, **d)["serial"]
    few = dict(kw, HV=8)
    Lw = cp.choose(warmup=True, **few)
    # 2/4: every pass of the exact path is one wave already: the warm-up would only add its cost
    two = dict(kw, HV=4)
    assert not cp.predict(L=cp.choose(warmup=True, **two), warmup=True, **two)["warmup"]
    assert cp.choose(warmup=True, **two) == cp.choose(warmup=False, **two)
    assert cp.choose(warmup=True, **dict(kw, HV=32)) == 0
    # the default follows FLASHDELTA_CP_WARMUP at bf16 (auto: on where the model says it pays)
    assert cp.choose(**few) == Lw


def _do(v, seed=1):
    return torch.randn(v.shape, generator=torch.Generator().manual_seed(seed), dtype=v.dtype)


# ----------------------------------------------------------------------------------------- backward: windows

GRAD_WINDOW_CASES = WINDOW_CASES + [
    # (bench_edges: 1100 tokens are 18 chunks, the last of 12 tokens: at L = 6 a ragged third partition)
    # a ragged last partition whose window needs its ragged last chunk (3 chunks of 64, 64, 20 tokens; the decaying
    # heads' sums are ~-6.0 to -6.6 after two, ~-6.9 to -7.7 after three), after a first partition of 4
    (Case("bench_ragged_tail", (404,), H=1, HV=4, K=8, V=8, gate="bench"), 4, -6.8),
]
GRAD_WINDOW_IDS = [c[0].name for c in GRAD_WINDOW_CASES]


@pytest.mark.parametrize("case,L,thr", GRAD_WINDOW_CASES, ids=GRAD_WINDOW_IDS)
def test_grad_windows_equal_the_reference(case, L, thr):
    x, q, k, v, g_cumsum, beta, A, cu, seq_len = _stage_inputs(case)
    plan = cp.make_plan(cu, q.shape[1], L, seq_len=seq_len)
    parts = rcp.partition(cu, L)
    want = rcp.warmup_chunks(g_cumsum, parts, threshold=thr, direction="bwd")
    win = cp.grad_windows(g_cumsum, k, beta, plan, thr)
    used = slice(0, parts.P)
    assert win.take.dtype == torch.int32 and win.take.shape == (plan.P, case.HV)
    assert torch.equal(win.n(plan)[used], want.n) and torch.equal(win.fallback[used], want.fallback)
    assert_close("log_decay", win.log_decay(plan)[used], want.log_decay, tol=1e-12)
    first = [p for p in range(parts.P) if parts.first[p]]
    cont = [p for p in range(parts.P) if not parts.first[p]]
    assert bool((win.take[first] == 0).all()), "the reverse scan reads no F of a first partition: nothing walked"
    assert bool((win.take[parts.P:] == 0).all()) and not bool(win.fallback[parts.P:].any()), "unused slots"
    fb = win.fallback[used]
    assert bool((win.take[used][fb] == cp.TAKE_ALL).all())
    if case.gate == "zero":
        assert bool(win.fallback[cont].all())
    else:                   # the case exercises both paths; the never-decaying head always falls back
        assert bool(win.fallback[cont, 0].all()) and bool((~win.fallback[cont] & (win.n(plan)[cont] > 0)).any())
    if case.name == "bench_dense":
        assert bool((win.n(plan)[cont][:, 1:] > 1).all()) and bool((win.n(plan)[cont][:, 1:] < L).all())
    if case.name == "bench_ragged_tail":
        assert parts.nchunks == (4, 3) and bool((~win.fallback[1, 1:]).all() and (win.n(plan)[1, 1:] == 3).all()), \
            "the window ends at the ragged last chunk"


def test_grad_windows_need_no_device_values():
    """The windows trace on meta tensors (a data-dependent op, `.item()` or a host read would raise there)."""
    meta = dict(device="meta")
    plan = cp.make_plan(torch.empty(6, dtype=torch.int32, **meta), 3000, 4)
    g = torch.empty(1, 3000, 8, **meta)
    k = torch.empty(1, 3000, 2, 64, dtype=torch.bfloat16, **meta)
    beta = torch.empty(1, 3000, 8, dtype=torch.bfloat16, **meta)
    for normed in (False, True):
        win = cp.grad_windows(g, k, beta, plan, -10.0, keys_normalized=normed)
        assert win.take.shape == win.fallback.shape == (plan.P, 8) and win.prefix.shape == (plan.P, 4, 8)
    exact = cp.grad_windows(g, k, beta, plan, None)
    assert exact.prefix is None and exact.take.shape == (plan.P, 8)


def test_chunk_take_walks_the_first_chunks():
    """The portable chunk_dstate with `chunk_take` (and its float64 twin) gives the start gradient of a walk over the
    first chunks only, from a zero gradient at their end: takes past the end walk everything, 0 and negative ones
    nothing; without it, the stage as before."""
    case = Case("take", (700, 1, 300, 0, 130), H=1, HV=3, K=16, V=8, pad=4)
    x, q, k, v, g_cumsum, beta, A, cu, _ = _stage_inputs(case)
    do = _do(v)
    take = torch.tensor([[2, 0, 11], [1, 5, 0], [-3, 4, 1], [0, 2, 7], [1, 3, 2]], dtype=torch.int32)
    got = ref.chunk_dstate(q, k, g_cumsum, beta, A, do, cu, scale=0.25, chunk_take=take)
    for n in range(len(cu) - 1):
        bos, eos = int(cu[n]), int(cu[n + 1])
        for h in range(case.HV):
            end = min(bos + max(int(take[n, h]), 0) * 64, eos)
            sl = slice(bos, end)
            one = torch.tensor([0, end - bos], dtype=torch.int32)
            want = ref.chunk_dstate(q[:, sl], k[:, sl], g_cumsum[:, sl, h:h + 1], beta[:, sl, h:h + 1],
                                    A[:, sl, h:h + 1], do[:, sl, h:h + 1], one, scale=0.25)
            assert_close("dh0", got[n, h], want[0, 0], tol=1e-13)
    everything = torch.full_like(take, 1 << 20)
    assert torch.equal(ref.chunk_dstate(q, k, g_cumsum, beta, A, do, cu, scale=0.25, chunk_take=everything),
                       ref.chunk_dstate(q, k, g_cumsum, beta, A, do, cu, scale=0.25))
    with pytest.raises(ValueError, match="chunk_take"):
        portable.chunk_dstate(q, k, g_cumsum, beta, A, do, cu, scale=0.25, chunk_take=take[:2])
    with pytest.raises(ValueError, match="chunk_take"):
        portable.chunk_dstate(q, k, g_cumsum, beta, A, do, cu, scale=0.25, chunk_take=take.float())


# ----------------------------------------------------------------------------------------- backward: end gradients

def _warm_end_grads(q, k, v, g_cumsum, beta, A, do, dht, plan, win, method, scale=0.25):
    """The device path's end gradients with the warm-up: F over the windows, the warm-up heads' M zeroed, the scan."""
    M, _ = cp.summaries(q, k, v, g_cumsum, beta, A, plan, scale=scale, chunk_fwd=portable.chunk_fwd)
    F = cp._start_grads(portable.chunk_dstate, q, k, g_cumsum, beta, A, do, plan, scale=scale, take=win.take)
    M = M.masked_fill(~win.fallback[:, :, None, None], 0)
    return cp.scan_grads(M, F, plan, dht, method)


@pytest.mark.parametrize("case,L,thr", GRAD_WINDOW_CASES, ids=GRAD_WINDOW_IDS)
def test_warmup_end_grads_equal_the_reference(case, L, thr):
    """F over the windows (each warm-up head's prefix, the fallback heads' whole partition, nothing on first
    partitions), M^T only on fallback heads, and both torch reverse scans give the float64 reference's warm-up end
    gradients."""
    x, q, k, v, g_cumsum, beta, A, cu, seq_len = _stage_inputs(case)
    plan = cp.make_plan(cu, q.shape[1], L, seq_len=seq_len)
    parts = rcp.partition(cu, L)
    win = cp.grad_windows(g_cumsum, k, beta, plan, thr)
    plan_ref = rcp.warmup_chunks(g_cumsum, parts, threshold=thr, direction="bwd")
    do = _do(v)
    N = len(cu) - 1
    for dht in (torch.randn(N, case.HV, case.K, case.V, generator=torch.Generator().manual_seed(2), dtype=F64), None):
        want, _ = rcp.warmup_grads(q, k, v, g_cumsum, beta, A, do, dht, parts, plan_ref, scale=0.25)
        for method in ("serial", "log"):
            got = _warm_end_grads(q, k, v, g_cumsum, beta, A, do, dht, plan, win, method)
            assert_close("dS", got[:parts.P], want, tol=1e-12)


def _backends():
    return dispatch.plan(torch.device("cpu"), 16, 16, F64, need_bwd=True)


BWD_STAGE_CASES = [GRAD_WINDOW_CASES[0], GRAD_WINDOW_CASES[1], GRAD_WINDOW_CASES[2]]


@pytest.mark.parametrize("case,L,thr", BWD_STAGE_CASES, ids=[c[0].name for c in BWD_STAGE_CASES])
def test_cp_chunk_bwd_warmup_equals_the_reference_composite(case, L, thr):
    """`cp_chunk_bwd` with the warm-up (the plan's threshold) equals, in every output, the float64 composite of exact
    start states, the reference's warm-up end gradients and chunk_bwd over the partitions; with the warm-up off it
    equals serial chunk_bwd; h0 and dht present and absent. (Model gates' decaying heads lose less than float64
    rounding: exp(-200) per chunk and less.)"""
    x, q, k, v, g_cumsum, beta, A, cu, seq_len = _stage_inputs(case)
    do = _do(v)
    N = len(cu) - 1
    parts = rcp.partition(cu, L)
    cu_p = parts.cu_tensor()
    E, M = rcp.partition_summaries(k, v, g_cumsum, beta, A, parts)
    plan_ref = rcp.warmup_chunks(g_cumsum, parts, threshold=thr, direction="bwd")
    names = ("dq", "dk", "dv", "dbeta", "dg", "dh0")
    for h0, dht in ((x["initial_state"], torch.randn(N, case.HV, case.K, case.V, dtype=F64)), (None, None)):
        h0p, _ = rcp.scan_states(E, M, parts, h0)
        h = ref.state_recompute(k, v, g_cumsum, beta, A, h0p, cu_p)
        dhtp, _ = rcp.warmup_grads(q, k, v, g_cumsum, beta, A, do, dht, parts, plan_ref, scale=0.25)
        want = list(ref.chunk_bwd(q, k, v, g_cumsum, beta, A, h, do, dhtp, cu_p, scale=0.25))
        want[5] = want[5][parts.first_of()]
        kw = dict(scale=0.25, backends=_backends())
        got = cp.cp_chunk_bwd(q, k, v, g_cumsum, beta, A, h0, do, dht, cu, **kw,
                              plan=cp.make_plan(cu, q.shape[1], L, seq_len=seq_len, warmup=thr))
        for name, a, b in zip(names, got, want):
            assert_close(name, a, b, tol=1e-12)
        exact = cp.cp_chunk_bwd(q, k, v, g_cumsum, beta, A, h0, do, dht, cu, **kw,
                                plan=cp.make_plan(cu, q.shape[1], L, seq_len=seq_len, warmup="off"))
        serial = ref.chunk_bwd(q, k, v, g_cumsum, beta, A, ref.state_recompute(k, v, g_cumsum, beta, A, h0, cu), do,
                               dht, cu, scale=0.25)
        for name, a, b in zip(names, exact, serial):
            assert_close(name, a, b, tol=1e-12)
        # the chunk states of the forward over the whole sequences (the training forward's saved h) in place of the
        # start states and the recompute over the partitions: the same gradients, exact and with the warm-up
        h_seq = ref.state_recompute(k, v, g_cumsum, beta, A, h0, cu)
        for warmup, want_s in ((thr, got), ("off", serial)):
            saved = cp.cp_chunk_bwd(q, k, v, g_cumsum, beta, A, h0, do, dht, cu, **kw, states=h_seq,
                                    plan=cp.make_plan(cu, q.shape[1], L, seq_len=seq_len, warmup=warmup))
            for name, a, b in zip(names, saved, want_s):
                assert_close(name, a, b, tol=1e-12)
        if case.gate == "bench":    # (model gates' decaying heads truncate below float64 rounding)
            assert max(float((a - b).abs().max()) for a, b in zip(got, exact)) > 1e-12, "the warm-up truncated"


def _true_end_grads(q, k, v, g_cumsum, beta, A, do, dht, cu):
    """``[NT, HV, K, V]`` float64: the serial gradient w.r.t. the state after every chunk (walking each sequence's
    chunk maps back from its dht, `reference.cp.chunk_summaries`)."""
    cs = rcp.chunk_summaries(q, k, v, g_cumsum, beta, A, do, cu, scale=0.25)
    lay = portable.chunk_layout(cu, q.shape[1], 64, q.device)
    out = torch.zeros_like(cs.F)
    for n in range(lay.N):
        d = dht[n]
        for c in reversed(range(lay.chunk_offsets[n], lay.chunk_offsets[n + 1])):
            out[c] = d
            d = cs.M[c].transpose(-1, -2) @ d + cs.F[c]
    return out


@pytest.mark.parametrize("case,L,thr,tight", BOUND_CASES, ids=[c[0].name for c in BOUND_CASES])
def test_warmup_end_grads_within_the_bound(case, L, thr, tight):
    """Warm-up on vs exact CP vs serial (float64): at every partition boundary each head's end-gradient error is
    within exp(window log decay) x ||gradient at its window's end|| (compounded through fallback partitions,
    docs/algorithm.md §4.4), the exact CP end gradients equal the serial ones, and the bound is tight."""
    x, q, k, v, g_cumsum, beta, A, cu, _ = _stage_inputs(case)
    do = _do(v)
    N = len(cu) - 1
    dht = torch.randn(N, case.HV, case.K, case.V, generator=torch.Generator().manual_seed(4), dtype=F64)
    plan = cp.make_plan(cu, q.shape[1], L)
    parts = rcp.partition(cu, L)
    win = cp.grad_windows(g_cumsum, k, beta, plan, thr)
    warm = _warm_end_grads(q, k, v, g_cumsum, beta, A, do, dht, plan, win, "serial")
    exact = _warm_end_grads(q, k, v, g_cumsum, beta, A, do, dht, plan, cp.grad_windows(g_cumsum, k, beta, plan, None),
                            "serial")
    truth = _true_end_grads(q, k, v, g_cumsum, beta, A, do, dht, cu)
    n, decay = win.n(plan), torch.exp(win.log_decay(plan))
    assert bool((~win.fallback[:parts.P] & (n[:parts.P] > 0)).any()), "the case must truncate"
    ratios, bound = [], None
    for p in reversed(range(parts.P)):
        want = truth[parts.chunk_start[p] + parts.nchunks[p] - 1]
        assert_close("exact", exact[p], want, tol=1e-12)
        if parts.last[p]:
            bound = torch.zeros(case.HV, dtype=F64)
        err = (warm[p] - want).flatten(1).norm(dim=1)
        assert bool((err <= bound * (1 + 1e-9) + 1e-13).all()), f"partition {p}: error {err} > bound {bound}"
        ratios += [float(e / b) for e, b in zip(err, bound) if b > 1e-12]
        if parts.first[p]:
            continue
        we = parts.chunk_start[p] + n[p] - 1                                  # each head's window end (chunk)
        leaving = torch.stack([truth[int(we[i]), i] for i in range(case.HV)]).flatten(1).norm(dim=1)
        bound = torch.where(win.fallback[p], decay[p] * bound, decay[p] * leaving)
    print(f"{case.name}: err/bound max {max(ratios, default=0):.3f}")
    assert max(ratios, default=0.0) >= tight, f"bound not tight: max err/bound {max(ratios, default=0):.3g}"


# ----------------------------------------------------------------------------------------- backward: through the API

BWD_GRAD_NAMES = ("q", "k", "v", "g", "beta", "initial_state")


def _grads(x, cpv, seed=3):
    """o, the final state and every gradient (dht present) through the public API."""
    x = {n: (t.detach().requires_grad_(True) if torch.is_tensor(t) and t.is_floating_point() else t)
         for n, t in x.items()}
    o, ht = chunk_gated_delta_rule(**x, output_final_state=True, context_parallel=cpv)
    gen = torch.Generator().manual_seed(seed)
    do = torch.randn(o.shape, generator=gen, dtype=o.dtype)
    dht = torch.randn(ht.shape, generator=gen, dtype=ht.dtype)
    leaves = [x[n] for n in BWD_GRAD_NAMES if x[n] is not None]
    return dict(zip([n for n in BWD_GRAD_NAMES if x[n] is not None],
                    torch.autograd.grad((o, ht), leaves, (do, dht))))


@pytest.mark.parametrize("case,L,thr", API_CASES, ids=[c[0].name for c in API_CASES])
def test_api_warmup_gradients_within_the_threshold(case, L, thr, monkeypatch):
    """float64 through the public API with the warm-up on (FLASHDELTA_CP_WARMUP = the threshold, the request the
    forward's plan and the backward's share): every gradient differs from serial by at most ~exp(threshold) and
    really truncates; with the warm-up off they equal serial to 1e-12. Both passes' warm-up conditions read prepare's
    squared key norms (the forward's, saved for the backward) in place of k."""
    x = make_inputs(case, dtype=torch.float32)
    x = {n: (t.to(F64) if torch.is_tensor(t) and t.is_floating_point() else t) for n, t in x.items()}
    calls, norms = [], []
    for tag in ("fwd", "bwd"):
        real = getattr(cp, f"cp_chunk_{tag}")
        monkeypatch.setattr(cp, f"cp_chunk_{tag}", lambda *a, tag=tag, real=real, **kw: calls.append(
            (tag, kw["plan"].warmup)) or norms.append(kw.get("k_norm2")) or real(*a, **kw))
    ser = _grads(x, False)
    monkeypatch.setenv(cp.ENV_WARMUP, str(thr))
    warm = _grads(x, L)
    assert calls == [("fwd", thr), ("bwd", thr)]
    k = x["k"].reshape(1, -1, *x["k"].shape[2:])
    n_tok = int(x["cu_seqlens"][-1]) if x["cu_seqlens"] is not None else k.shape[1]
    assert norms[0] is norms[1] and torch.equal(norms[0][0, :n_tok], k[0, :n_tok].square().sum(-1))
    monkeypatch.setenv(cp.ENV_WARMUP, "0")
    exact = _grads(x, L)
    worst = 0.0
    for n in ser:
        worst = max(worst, assert_close("d" + n, warm[n], ser[n], tol=math.exp(thr)))
        assert_close("d" + n, exact[n], ser[n], tol=1e-12)
    assert worst > 1e-12, "the warm-up really truncated"


@pytest.mark.parametrize("case,L", NEVER_DECAYING, ids=[c[0].name for c in NEVER_DECAYING])
def test_api_never_decaying_head_keeps_exact_gradients(case, L, monkeypatch):
    """Model gates (head 0: g = 0, head 1: ~-1e-4 per token) with the warm-up on in fp32: the slow heads fall back, the
    fast ones truncate far below rounding, so every gradient with CP equals CP off to fp32 rounding; all-zero gates
    (every head falls back) likewise."""
    x = make_inputs(case, dtype=torch.float32)
    _, q, k, _, g_cumsum, beta, _, cu, _ = _stage_inputs(case, dtype=torch.float32)
    plan = cp.make_plan(cu, q.shape[1], L)
    win = cp.grad_windows(g_cumsum, k, beta, plan, cp.WARMUP_THRESHOLD)
    cont = ~plan.first
    assert bool(cont.any()) and bool(win.fallback[cont, 0].all()), "the never-decaying head falls back"
    if case.gate == "zero":
        assert bool(win.fallback[cont].all())
    else:
        assert bool((~win.fallback[cont]).any()), "the decaying heads warm up"
    ser = _grads(x, False)
    monkeypatch.setenv(cp.ENV_WARMUP, "on")
    got = _grads(x, L)
    for n in ser:
        assert_close("d" + n, got[n], ser[n], tol=2e-6)


# ----------------------------------------------------------------------------------------- backward: request and model

def test_backward_threshold_follows_the_plan(monkeypatch):
    """The backward asks the plan's request (the forward's): ``auto`` warms up bf16 only where
    `cp_model.warmup_pays_bwd` at the plan's L, ``on`` and a threshold everywhere, ``off`` never; fp32 under auto
    stays exact."""
    monkeypatch.delenv(cp.ENV_WARMUP, raising=False)
    cu = torch.empty(2, dtype=torch.int32, device="meta")
    q = torch.empty(1, 32768, 16, 128, dtype=torch.bfloat16, device="meta")
    wide = cp.make_plan(cu, 32768, 64)                # 16/32 1x32768 at L = 64: 8 partitions x 32 heads, two waves
    one_wave = cp.make_plan(cu, 8192, 32)             # 16/32 1x8192 at L = 32: 4 x 32 CTAs, one wave
    assert cp._threshold(wide, q, 32, 128, 128, backward=True) == cp.WARMUP_THRESHOLD
    assert cp._threshold(wide, q.float(), 32, 128, 128, backward=True) is None, "fp32: exact under auto"
    assert cp._threshold(one_wave, q, 32, 128, 128, backward=True) is None
    assert cp._threshold(one_wave._replace(warmup="on"), q, 32, 128, 128, backward=True) == cp.WARMUP_THRESHOLD
    assert cp._threshold(wide._replace(warmup=-16.0), q.float(), 32, 128, 128, backward=True) == -16.0
    assert cp._threshold(wide._replace(warmup="off"), q, 32, 128, 128, backward=True) is None
    monkeypatch.setenv(cp.ENV_WARMUP, "off")
    assert cp.make_plan(cu, 32768, 64).warmup == "off"


def test_cost_model_with_the_backward_warmup():
    """The backward's expected time with the warm-up is below the exact path's, which (plus the decision) is its
    worst case; the warm-up runs only where it shortens the F pass: not at 16/32 or 2/4 1x8192 (one wave, bounded
    by a fallback head's whole partition), but at 16/32 1x32768, which then splits finer; the worst case stays
    within WORST_MARGIN x serial."""
    kw = dict(N=1, K=128, V=128, sms=132)
    for HV, T in ((32, 8192), (4, 8192)):
        row = dict(kw, T=T, HV=HV, lengths=[T])
        L = cp.choose_bwd(warmup=True, **row)
        assert L == cp.choose_bwd(warmup=False, **row) > 0
        p = cp.predict_bwd(L=L, warmup=True, **row)
        assert not p["warmup"] and p["cp"] == p["cp_worst"] == cp.predict_bwd(L=L, warmup=False, **row)["cp"]
    row = dict(kw, T=32768, HV=32, lengths=[32768])
    Lw, Le = cp.choose_bwd(warmup=True, **row), cp.choose_bwd(warmup=False, **row)
    assert 0 < Lw < Le, (Lw, Le)
    w, e = cp.predict_bwd(L=Lw, warmup=True, **row), cp.predict_bwd(L=Lw, warmup=False, **row)
    assert w["warmup"] and w["start"] < w["start_exact"] == e["start"]
    assert w["cp"] < e["cp"] < w["cp_worst"] == pytest.approx(e["cp"] + cp.cp_model.WARMUP_BWD_US)
    assert w["cp"] < cp.predict_bwd(L=Le, warmup=False, **row)["cp"]
    assert w["cp_worst"] <= cp.WORST_MARGIN * w["serial"]
    # the first partition walks nothing: one long partition and a short one, the long one first
    parts, cont = cp.cp_model._parts([128], 96), cp.cp_model._first_parts([128], 96)
    assert parts == {96: 1, 32: 1} and cont == {32: 1}
    assert cp.cp_model._first_parts([5, 0, 64, 200], 64) == {64: 2, 8: 1}
    # the default follows FLASHDELTA_CP_WARMUP at bf16 (auto: on)
    assert cp.choose_bwd(**row) == Lw


def test_cp_chunk_bwd_rejects_starts_of_another_plan():
    """Start states whose shape is not the plan's ``[P, HV, K, V]`` raise a ValueError naming `starts`, before any
    pass runs."""
    case, L, _ = BWD_STAGE_CASES[0]
    x, q, k, v, g_cumsum, beta, A, cu, seq_len = _stage_inputs(case)
    plan = cp.make_plan(cu, q.shape[1], L, seq_len=seq_len, warmup="off")
    bad = torch.zeros(plan.P + 1, case.HV, case.K, case.V, dtype=F64)
    with pytest.raises(ValueError, match="starts"):
        cp.cp_chunk_bwd(q, k, v, g_cumsum, beta, A, None, _do(v), None, cu, scale=0.25, backends=_backends(),
                        plan=plan, starts=bad)
