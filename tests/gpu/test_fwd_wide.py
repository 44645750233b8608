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
from test_fwd import _check, _inputs, check_graph_capturable, check_many_sequences

from flashdelta.kernels import fused_fwd, fused_fwd_wide

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
    """70k sequences (the sequence index past a grid y/z dimension), test_fwd.py's check on the wide build."""
    check_many_sequences(_run)


def test_chunk_fwd_wide_graph_capturable():
    """No host synchronisation: the wide launch records into a CUDA graph and replays to the same result."""
    check_graph_capturable(_run)
