"""Stage `chunk_fwd` with ``wide=True`` on a Hopper GPU: the one-CTA-per-(sequence, value head) build
(kernels/fused_fwd_wide.py) against the float64 twin on every K = V = 128 case of the forward's case table, and run to
run bit for bit.

Inputs and checks are tests/gpu/test_fwd.py's (g_cumsum and A from the float64 prepare, NaN-poisoned outputs, o on the
padding tail exactly 0, an empty sequence's final state its initial state); only the build differs. The wide build is
opt-in (no dispatch picks it), so these launches are the only ones that run it.
"""
import pytest
import torch
from cases import FWD_CASES, FWD_DET, FWD_GRAPH, FWD_MANY_SEQS
from test_fwd import _check, _inputs

from flashdelta.kernels import fused_fwd, fused_fwd_wide
from flashdelta.reference import chunked as ref

WIDE_CASES = [c for c in FWD_CASES + [FWD_DET, FWD_GRAPH] if (c.K, c.V) in fused_fwd_wide.HEAD_DIMS]


def builds() -> list:
    """(label, builder, args) of the wide builds these tests launch (the h0 dtype as the launcher passes it)."""
    out = {}
    for c in WIDE_CASES + [FWD_MANY_SEQS]:
        h0_dtype = c.h0_dtype if c.h0 else torch.float32
        for label, b, a in fused_fwd.launcher_builds(c.H, c.HV, c.K, c.V, c.dtype, c.beta_dtype, h0_dtype,
                                                     c.K ** -0.5, (c.h0,), (c.state_v_first,), wide=True):
            out.setdefault(a, (f"{c.name}: {label}", b, a))
    return list(out.values())


def _run(x):
    return fused_fwd.chunk_fwd(x["q"], x["k"], x["v"], x["g_cumsum"], x["beta"], x["A"], x["initial_state"],
                               x["cu_seqlens"], scale=x["scale"], state_v_first=x["state_v_first"], wide=True)


@pytest.mark.parametrize("case", WIDE_CASES, ids=str)
def test_chunk_fwd_wide(case):
    """Against the float64 reference (and the GEMM-precision PyTorch baseline), then a second launch bit for bit."""
    x = _inputs(case)
    o, ht = _run(x)
    _check(case, x, o, ht)
    o2, ht2 = _run(x)
    assert torch.equal(o, o2) and torch.equal(ht, ht2), "run to run"


def test_chunk_fwd_wide_many_sequences():
    """70k sequences (the sequence index past a grid y/z dimension): the full launch bit for bit against the wide
    kernel on a sample of them, and that run against the reference."""
    from _helpers import assert_close

    from flashdelta import portable

    x = _inputs(FWD_MANY_SEQS)
    o, ht = _run(x)
    cu = x["cu_seqlens"].tolist()
    assert torch.isfinite(o).all() and torch.isfinite(ht).all()
    assert torch.equal(o[:, cu[-1]:], torch.zeros_like(o[:, cu[-1]:]))
    pick = list(range(50)) + list(range(65530, 70000, 7))
    tok = torch.cat([torch.arange(cu[n], cu[n + 1]) for n in pick]).to(o.device)
    sub_cu = torch.tensor([0] + [cu[n + 1] - cu[n] for n in pick], device=o.device).cumsum(0).to(torch.int32)
    sub = dict(x, cu_seqlens=sub_cu, **{name: x[name][:, tok] for name in ("q", "k", "v", "g_cumsum", "beta", "A")})
    so, sh = _run(sub)
    assert torch.equal(so, o[:, tok]) and torch.equal(sh, ht[pick])
    args = (sub["q"], sub["k"], sub["v"], sub["g_cumsum"], sub["beta"], sub["A"], None, sub_cu)
    ro, rh = ref.chunk_fwd(*args, scale=x["scale"])
    bo, bh = portable.chunk_fwd(*args, scale=x["scale"], compute_dtype=torch.float32, operand_dtype=torch.bfloat16)
    assert_close("o", so, ro, baseline=bo)
    assert_close("ht", sh, rh, baseline=bh)


def test_chunk_fwd_wide_graph_capturable():
    """No host synchronisation: the wide launch records into a CUDA graph and replays to the same result."""
    x = _inputs(FWD_GRAPH)
    o_ref, h_ref = _run(x)
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        _run(x)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o, ht = _run(x)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(o, o_ref) and torch.equal(ht, h_ref)
