"""Stage `chunk_fwd` on a Hopper GPU: `kernels.fused_fwd.chunk_fwd` against its float64 twin.

The kernel is tested on its own: g_cumsum and A come from the float64 `reference.chunked.prepare_fwd` (A rounded
to the input dtype, as the prepare kernel stores it), and the reference and the baseline (the portable path with
GEMM operands rounded to the input dtype) consume exactly the inputs the kernel gets. Outputs are NaN-poisoned
(conftest): o on the padding tail must be exactly 0, and an empty sequence's final state is its initial state.
"""
import pytest
import torch
from _helpers import Case, assert_close, make_inputs
from cases import FWD_BIG, FWD_CASES, FWD_DET, FWD_GRAPH, FWD_MANY_SEQS

from flashdelta import portable
from flashdelta.kernels import fused_fwd
from flashdelta.reference import chunked as ref


def _inputs(case):
    c = Case(case.name, case.seqlens, H=case.H, HV=case.HV, K=case.K, V=case.V, pad=case.pad, h0=case.h0,
             state_v_first=case.state_v_first, gate=case.gate)
    x = make_inputs(c, dtype=case.dtype, device="cuda")
    beta = x["beta"].to(case.beta_dtype)
    h0 = x["initial_state"].to(case.h0_dtype) if case.h0 else None
    g_cumsum, A = ref.prepare_fwd(x["k"], x["g"], beta, x["cu_seqlens"])
    return dict(q=x["q"], k=x["k"], v=x["v"], g_cumsum=g_cumsum.float(), beta=beta, A=A.to(case.dtype),
                initial_state=h0, cu_seqlens=x["cu_seqlens"], scale=case.K ** -0.5,
                state_v_first=case.state_v_first)


def _run(x):
    return fused_fwd.chunk_fwd(x["q"], x["k"], x["v"], x["g_cumsum"], x["beta"], x["A"], x["initial_state"],
                               x["cu_seqlens"], scale=x["scale"], state_v_first=x["state_v_first"])


def _check(case, x, o, ht):
    args = (x["q"], x["k"], x["v"], x["g_cumsum"], x["beta"], x["A"], x["initial_state"], x["cu_seqlens"])
    kw = dict(scale=x["scale"], state_v_first=case.state_v_first)
    ro, rh = ref.chunk_fwd(*args, **kw)
    bo, bh = portable.chunk_fwd(*args, **kw, compute_dtype=torch.float32, operand_dtype=case.dtype)
    end = int(x["cu_seqlens"][-1])
    assert o.dtype == case.dtype and ht.dtype == torch.float32
    if end:
        assert_close("o", o[:, :end], ro[:, :end], baseline=bo[:, :end])
    assert torch.equal(o[:, end:], torch.zeros_like(o[:, end:])), "o on the padding tail must be 0"
    assert_close("ht", ht, rh, baseline=bh)
    lens = torch.diff(x["cu_seqlens"])
    empty = lens == 0
    if empty.any():
        want = x["initial_state"][empty].float() if case.h0 else torch.zeros_like(ht[empty])
        assert torch.equal(ht[empty], want), "an empty sequence's final state is its initial state"


@pytest.mark.parametrize("case", FWD_CASES, ids=str)
def test_chunk_fwd(case):
    x = _inputs(case)
    o, ht = _run(x)
    _check(case, x, o, ht)


def check_many_sequences(run):
    """70k sequences through `run` (a chunk_fwd launch of an `_inputs` dict): more than a grid y/z dimension holds
    (the sequence index lives in grid x). The float64 reference over all of them does not fit in memory, so a sample
    (every 7th sequence past index 65,529, plus the first 50) is checked: the full launch must match, bit for bit, the
    same launch on the sample alone, and that run must match the reference."""
    x = _inputs(FWD_MANY_SEQS)
    o, ht = run(x)
    cu = x["cu_seqlens"].tolist()
    assert torch.isfinite(o).all() and torch.isfinite(ht).all()
    assert torch.equal(o[:, cu[-1]:], torch.zeros_like(o[:, cu[-1]:]))
    pick = list(range(50)) + list(range(65530, 70000, 7))
    tok = torch.cat([torch.arange(cu[n], cu[n + 1]) for n in pick]).to(o.device)
    sub_cu = torch.tensor([0] + [cu[n + 1] - cu[n] for n in pick], device=o.device).cumsum(0).to(torch.int32)
    sub = dict(x, cu_seqlens=sub_cu, **{name: x[name][:, tok] for name in ("q", "k", "v", "g_cumsum", "beta", "A")})
    so, sh = run(sub)
    assert torch.equal(so, o[:, tok]) and torch.equal(sh, ht[pick])
    args = (sub["q"], sub["k"], sub["v"], sub["g_cumsum"], sub["beta"], sub["A"], None, sub_cu)
    ro, rh = ref.chunk_fwd(*args, scale=x["scale"])
    bo, bh = portable.chunk_fwd(*args, scale=x["scale"], compute_dtype=torch.float32, operand_dtype=torch.bfloat16)
    assert_close("o", so, ro, baseline=bo)
    assert_close("ht", sh, rh, baseline=bh)


def test_chunk_fwd_many_sequences():
    check_many_sequences(_run)


def test_chunk_fwd_deterministic():
    x = _inputs(FWD_DET)
    o1, h1 = _run(x)
    o2, h2 = _run(x)
    assert torch.equal(o1, o2) and torch.equal(h1, h2)


def check_graph_capturable(run):
    """No host synchronisation: `run` records into a CUDA graph and replays to the same result."""
    x = _inputs(FWD_GRAPH)
    o_ref, h_ref = run(x)
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        run(x)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o, ht = run(x)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(o, o_ref) and torch.equal(ht, h_ref)


def test_chunk_fwd_graph_capturable():
    check_graph_capturable(_run)


@pytest.mark.bigmem
def test_offsets_past_2_31_elements():
    """A sequence whose o rows start at element 2^31 (o, v: [1, T, 64, 128]): the 64-bit offsets of the prepare
    and fused kernels. Its outputs from the big launch must equal, bit for bit, a launch on that sequence alone."""
    from flashdelta.kernels import prepare

    H, HV, K, V = FWD_BIG.H, FWD_BIG.HV, FWD_BIG.K, FWD_BIG.V
    T0, T1 = 2 ** 31 // (HV * V), 3000          # sequence 1 starts exactly at o element 2^31
    T = T0 + T1
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device="cuda")

    q = torch.nn.functional.normalize(randn(1, T, H, K), dim=-1).to(FWD_BIG.dtype)
    k = torch.nn.functional.normalize(randn(1, T, H, K), dim=-1).to(FWD_BIG.dtype)
    v = randn(1, T, HV, V).to(FWD_BIG.dtype)
    g = torch.nn.functional.logsigmoid(randn(1, T, HV)) / 16
    beta = torch.sigmoid(randn(1, T, HV)).to(FWD_BIG.beta_dtype)
    h0 = randn(2, HV, K, V).to(FWD_BIG.h0_dtype)
    cu = torch.tensor([0, T0, T], dtype=torch.int32, device="cuda")
    assert v.numel() > 2 ** 31 and T0 * HV * V == 2 ** 31

    def run(q, k, v, g, beta, h0, cu):
        g_cumsum, A = prepare.prepare_fwd(k, g, beta, cu)
        o, ht = fused_fwd.chunk_fwd(q, k, v, g_cumsum, beta, A, h0, cu, scale=K ** -0.5)
        return g_cumsum, A, o, ht

    gc_big, A_big, o_big, ht_big = run(q, k, v, g, beta, h0, cu)
    sl = slice(T0, T)
    cu1 = torch.tensor([0, T1], dtype=torch.int32, device="cuda")
    gc_1, A_1, o_1, ht_1 = run(q[:, sl].contiguous(), k[:, sl].contiguous(), v[:, sl].contiguous(),
                               g[:, sl].contiguous(), beta[:, sl].contiguous(), h0[1:].contiguous(), cu1)
    assert torch.equal(gc_big[:, sl], gc_1) and torch.equal(A_big[:, sl], A_1)
    assert torch.equal(o_big[:, sl], o_1) and torch.equal(ht_big[1:], ht_1)
    assert torch.isfinite(o_big[:, :T0]).all()


def test_chunk_fwd_converts_a():
    """The stage contract (docs/stages.md): A in another float dtype (the portable prepare's fp32) is converted to q's
    dtype, with the same results."""
    x = _inputs(FWD_GRAPH)
    o, ht = _run(x)
    o2, ht2 = _run(dict(x, A=x["A"].float()))
    assert torch.equal(o, o2) and torch.equal(ht, ht2)
