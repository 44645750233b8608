"""Stage `chunk_fwd` with ``wide=True`` on a Hopper GPU: the one-CTA-per-(sequence, value head) build
(kernels/fused_fwd_wide.py) against the float64 twin on every K = V = 128 case of the forward's case table, and run to
run bit for bit.

Inputs and checks are tests/gpu/test_fwd.py's (g_cumsum and A from the float64 prepare, NaN-poisoned outputs, o on the
padding tail exactly 0, an empty sequence's final state its initial state); only the build differs. The public API picks
the wide build only where the sequences and heads fill whole waves (`cp_model.wide_pays`), which no other GPU test's
shapes do: these launches and `test_api_picks_the_wide_build_where_it_pays` are the ones that run it.
"""
import pytest
import torch
from cases import FWD_CASES, FWD_DET, FWD_GRAPH, FWD_MANY_SEQS
from test_fwd import _check, _inputs, check_graph_capturable, check_many_sequences

from flashdelta.kernels import fused_fwd, fused_fwd_wide

WIDE_CASES = [c for c in FWD_CASES + [FWD_DET, FWD_GRAPH] if (c.K, c.V) in fused_fwd_wide.HEAD_DIMS]


# the API's pick: B sequences of T tokens at heads H / HV, no gradient, where `cp_model.wide_pays` takes the wide build
PICK = dict(B=8, T=1024, H=16, HV=16)


def builds() -> list:
    """(label, builder, args) of the wide builds these tests launch (the h0 dtype as the launcher passes it), and the
    forward's builds of the API call that picks it (`PICK`)."""
    from flashdelta.precompile import variants

    out = {}
    for c in WIDE_CASES + [FWD_MANY_SEQS]:
        h0_dtype = c.h0_dtype if c.h0 else torch.float32
        for label, b, a in fused_fwd.launcher_builds(c.H, c.HV, c.K, c.V, c.dtype, c.beta_dtype, h0_dtype,
                                                     c.K ** -0.5, (c.h0,), (c.state_v_first,), wide=True):
            out.setdefault((b.__name__, a), (f"{c.name}: {label}", b, a))
    for label, b, a in variants([(PICK["H"], PICK["HV"])], dtype=torch.bfloat16, beta_dtype=torch.bfloat16,
                                initial_state=(False,), qk_l2norm=False, num_sms=132, context_parallel=False):
        out.setdefault((b.__name__, a), (f"api pick: {label}", b, a))
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


def test_api_picks_the_wide_build_where_it_pays(monkeypatch):
    """The public API, no gradient, dense input where `cp_model.wide_pays` predicts the wide build faster (8
    sequences of 1k tokens at 16 value heads: 128 CTAs instead of 256 on 132 SMs): the launch runs the wide build,
    and o and the final state equal, bit for bit, the same call with the pick turned off."""
    import flashdelta
    from flashdelta import cp_model

    B, T, H, HV = PICK["B"], PICK["T"], PICK["H"], PICK["HV"]
    assert cp_model.wide_pays(T=B * T, N=B, HV=HV, K=128, V=128, sms=torch.cuda.get_device_properties(0)
                              .multi_processor_count, seq_len=T)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k = (torch.nn.functional.normalize(torch.randn(B, T, H, 128, device="cuda", generator=gen), dim=-1)
            .to(torch.bfloat16) for _ in range(2))
    v = torch.randn(B, T, HV, 128, device="cuda", generator=gen).to(torch.bfloat16)
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, HV, device="cuda", generator=gen)) / 16
    beta = torch.rand(B, T, HV, device="cuda", generator=gen).to(torch.bfloat16)
    calls = []
    real = fused_fwd_wide.build

    def spy(*args):
        calls.append(args)
        return real(*args)

    monkeypatch.setattr(fused_fwd_wide, "build", spy)
    o, ht = flashdelta.chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True)
    assert len(calls) == 1, "the wide build runs"
    monkeypatch.setattr(cp_model, "WIDE_MARGIN", 0.0)
    o2, ht2 = flashdelta.chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True)
    assert len(calls) == 1, "no wide build with the pick off"
    assert torch.equal(o, o2) and torch.equal(ht, ht2)
