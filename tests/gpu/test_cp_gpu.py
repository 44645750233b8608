"""The CP forward (`flashdelta.cp`) on the sm90 backend, through the public API: CP on vs off against the float64
reference (with the bf16 PyTorch baseline), the plan against the reference's partition, gradients unchanged,
the automatic choice on a long sequence, and CUDA-graph capture replayed with new lengths.

Builds (bf16, beta bf16, fp32 states, scale K^-0.5, K-first unless said): the fused forward at H=2, HV=8 for
(K, V) = (128, 128) with and without an initial state, V-first with one (the serial side of the V-first case), and
(128, 256) with and without one; prepare_fwd at 2/8, K = 128.
"""
import pytest
import torch
from _helpers import Case, assert_close, make_inputs

from flashdelta import chunk_gated_delta_rule, cp, portable
from flashdelta.reference import cp as rcp
from flashdelta.reference.chunked import chunked_fwd

CASES = [
    # (case, partition chunks)
    (Case("cp-model-varlen-edges", (3000, 1, 700, 0, 130, 64), H=2, HV=8, K=128, V=128, pad=7), 4),
    (Case("cp-model-noh0", (5000,), H=2, HV=8, K=128, V=128, h0=False), 8),
    (Case("cp-bench-vfirst", (2500, 900), H=2, HV=8, K=128, V=128, state_v_first=True, gate="bench"), 3),
    (Case("cp-dense", (2048, 2048), H=2, HV=8, K=128, V=128, varlen=False), 8),
    (Case("cp-v256", (1500, 200), H=2, HV=8, K=128, V=256), 4),
]


def _reference(x):
    x64 = {n: (t.double() if torch.is_tensor(t) and t.is_floating_point() else t) for n, t in x.items()}
    B, T = x["q"].shape[:2]
    cu = x["cu_seqlens"] if x["cu_seqlens"] is not None else torch.arange(B + 1, device="cuda") * T
    flat = lambda t: t.reshape(1, B * T, *t.shape[2:])  # noqa: E731
    args = (flat(x64["q"]), flat(x64["k"]), flat(x64["v"]), flat(x64["g"]), flat(x64["beta"]), x64["initial_state"],
            cu)
    kw = dict(scale=x["q"].shape[-1] ** -0.5, state_v_first=x["state_v_first"])
    o_ref, ht_ref, _, _ = chunked_fwd(*args, **kw)
    o_pt, ht_pt, _, _ = portable.chunked_fwd(*args, **kw, compute_dtype=torch.float32, operand_dtype=torch.bfloat16)
    return o_ref.reshape(x["v"].shape), ht_ref, o_pt.reshape(x["v"].shape), ht_pt


@pytest.mark.parametrize("case,L", CASES, ids=[c[0].name for c in CASES])
def test_cp_matches_reference_and_serial(case, L, monkeypatch):
    monkeypatch.setenv("FLASHDELTA_BACKEND", "sm90")
    x = make_inputs(case, dtype=torch.bfloat16, device="cuda")
    calls = []
    real = cp.cp_chunk_fwd
    monkeypatch.setattr(cp, "cp_chunk_fwd", lambda *a, **kw: calls.append(kw["plan"]) or real(*a, **kw))
    with torch.no_grad():
        o0, ht0 = chunk_gated_delta_rule(**x, output_final_state=True, context_parallel=False)
        o1, ht1 = chunk_gated_delta_rule(**x, output_final_state=True, context_parallel=L)
    assert len(calls) == 1 and calls[0].L == L, "the CP path ran"
    o_ref, ht_ref, o_pt, ht_pt = _reference(x)
    err_o = assert_close("o", o1, o_ref, baseline=o_pt)
    err_ht = assert_close("ht", ht1, ht_ref, baseline=ht_pt)
    ser_o, ser_ht = assert_close("o", o0, o_ref), assert_close("ht", ht0, ht_ref)
    print(f"{case.name}: CP err o {err_o:.3e} ht {err_ht:.3e}; serial o {ser_o:.3e} ht {ser_ht:.3e}")
    assert err_o <= 1.5 * ser_o + 1e-4 and err_ht <= 1.5 * ser_ht + 1e-4, "CP no less accurate than serial"
    if case.pad:
        assert torch.all(o1[:, -case.pad:] == 0)
    # the plan's used slots are the reference's partitions
    B, T = x["q"].shape[:2]
    cu = x["cu_seqlens"] if case.varlen else torch.arange(B + 1, dtype=torch.int32) * T
    want = rcp.partition(cu.cpu(), L)
    assert calls[0].cu[:want.P + 1].tolist() == list(want.cu_seqlens)


def test_cp_gradients_unchanged(monkeypatch):
    """With gradients the forward still splits (same o to rounding) and the backward is the serial one (auto
    dispatch: the SM90 kernels it has, the portable path for the rest): bitwise the same gradients."""
    monkeypatch.delenv("FLASHDELTA_BACKEND", raising=False)
    case = Case("cp-grad", (1500, 1, 400), H=2, HV=8, K=128, V=128)
    grads = []
    for cpv in (False, 4):
        x = make_inputs(case, dtype=torch.bfloat16, device="cuda", requires_grad=True)
        o, ht = chunk_gated_delta_rule(**x, output_final_state=True, context_parallel=cpv)
        gen = torch.Generator(device="cuda").manual_seed(3)
        do = torch.randn(o.shape, generator=gen, device="cuda").to(o.dtype)
        dht = torch.randn(ht.shape, generator=gen, device="cuda")
        grads.append(torch.autograd.grad((o, ht), [x[n] for n in ("q", "k", "v", "g", "beta", "initial_state")],
                                         (do, dht)) + (o,))
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), grads[0], grads[1]):
        assert torch.equal(a, b), name
    assert_close("o", grads[1][-1], grads[0][-1], tol=2e-2)


def test_auto_splits_a_long_sequence_on_few_heads(monkeypatch):
    monkeypatch.delenv(cp.ENV_CP, raising=False)
    case = Case("cp-auto", (32768,), H=2, HV=8, K=128, V=128)
    x = make_inputs(case, dtype=torch.bfloat16, device="cuda")
    calls = []
    real = cp.cp_chunk_fwd
    monkeypatch.setattr(cp, "cp_chunk_fwd", lambda *a, **kw: calls.append(kw["plan"].L) or real(*a, **kw))
    with torch.no_grad():
        o, ht = chunk_gated_delta_rule(**x, output_final_state=True)
        o0, ht0 = chunk_gated_delta_rule(**x, output_final_state=True, context_parallel=False)
    assert len(calls) == 1 and calls[0] > 0
    assert_close("o", o, o0, tol=2e-2)
    assert_close("ht", ht, ht0, tol=2e-2)


def test_cp_graph_replays_with_new_lengths(monkeypatch):
    """The plan lives on the device: a graph captured with CP replays with other lengths (same N and T) and
    gives what an eager call with those lengths gives."""
    monkeypatch.setenv("FLASHDELTA_BACKEND", "sm90")
    case = Case("cp-graph", (3000, 1, 2000), H=2, HV=8, K=128, V=128, pad=11)
    x = make_inputs(case, dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(s):
            chunk_gated_delta_rule(**x, output_final_state=True, context_parallel=4)       # warm-up
            with torch.cuda.graph(graph, stream=s):
                o_g, ht_g = chunk_gated_delta_rule(**x, output_final_state=True, context_parallel=4)
        torch.cuda.current_stream().wait_stream(s)
        graph.replay()
        torch.cuda.synchronize()
        o_e, ht_e = chunk_gated_delta_rule(**x, output_final_state=True, context_parallel=4)
        assert torch.equal(o_g, o_e) and torch.equal(ht_g, ht_e)
        for cu in ([0, 10, 4000, 5001], [0, 0, 5001, 5001], [0, 2500, 2600, 4900]):   # new lengths, same N and T
            x["cu_seqlens"].copy_(torch.tensor(cu, dtype=torch.int32))
            graph.replay()
            torch.cuda.synchronize()
            o_e, ht_e = chunk_gated_delta_rule(**x, output_final_state=True, context_parallel=4)
            o_s, ht_s = chunk_gated_delta_rule(**x, output_final_state=True, context_parallel=False)
            assert torch.equal(o_g, o_e) and torch.equal(ht_g, ht_e), cu
            assert_close("o", o_g, o_s, tol=2e-2)
            assert_close("ht", ht_g, ht_s, tol=2e-2)
