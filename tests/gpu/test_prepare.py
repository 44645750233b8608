"""Stage `prepare` on a Hopper GPU: `kernels.prepare.prepare_fwd` / `prepare_bwd` against their float64 twins.

A is checked against the float64 inverse with the reference rounded to A's dtype as the baseline (the kernel
may add at most as much error again as that rounding), and must be exactly 0 wherever the reference is
(upper triangle, columns past a ragged chunk's end, padding rows). Outputs are NaN-poisoned (conftest), so a
row the kernel forgets fails the non-finite check.
"""
import dataclasses

import pytest
import torch
from _helpers import Case, assert_close, make_inputs, random_lengths

from flashdelta.reference import chunked as ref


@dataclasses.dataclass(frozen=True)
class PrepCase:
    name: str
    seqlens: tuple
    H: int
    HV: int
    K: int = 128
    pad: int = 0
    dtype: torch.dtype = torch.bfloat16      # k
    beta_dtype: torch.dtype = torch.float32
    gate: str = "model"

    def __str__(self):
        return self.name


EDGES = (0, 1, 63, 64, 65, 0, 200, 1, 130, 127, 128, 129)
CASES = [
    PrepCase("tp1-dense-4k", (4096,), H=16, HV=64),
    PrepCase("edges-gva2-pad37", EDGES, H=4, HV=8, pad=37, beta_dtype=torch.bfloat16),
    PrepCase("edges-gva2-fp16", EDGES, H=4, HV=8, pad=37, dtype=torch.float16, beta_dtype=torch.float16),
    PrepCase("gva4-fp16-pad70", (500, 0, 1, 1000, 77), H=4, HV=16, pad=70, dtype=torch.float16,
             beta_dtype=torch.float16),
    PrepCase("gva4-bench-gate", (3000, 1096), H=16, HV=64, gate="bench"),
    PrepCase("gva1-300seqs", random_lengths(300, (0, 1, 2, 5, 63, 64, 65, 100, 150), 1), H=4, HV=4, pad=3),
    PrepCase("gva1-zero-gate", (129, 64), H=4, HV=4, gate="zero"),
    PrepCase("k64-fp16", (100, 64, 3), H=2, HV=4, K=64, pad=9, dtype=torch.float16),
    PrepCase("k256", (100, 64, 3), H=2, HV=4, K=256, pad=9),
    # GVA 3 (27B-style 8/24 and 16/48 layers): beta's padded shared tile, the per-head padding-tail loop
    PrepCase("gva3-edges-pad21", EDGES, H=2, HV=6, pad=21),
    # 70k sequences: three rounds of the in-kernel chunk search, more chunks than a grid y/z dim holds
    PrepCase("70k-seqs", random_lengths(70000, (0, 1, 2, 3), 2), H=1, HV=1, pad=10),
    # GVA 8: more value heads than warps, inverted in two rounds (or split over two CTAs on a small grid)
    PrepCase("gva8-rounds", (300, 64, 1, 129), H=1, HV=8, pad=5),
]


def _inputs(case):
    c = Case(case.name, case.seqlens, H=case.H, HV=case.HV, K=case.K, V=8, pad=case.pad, h0=False,
             gate=case.gate)
    x = make_inputs(c, dtype=case.dtype, device="cuda")
    return x["k"], x["g"], x["beta"].to(case.beta_dtype), x["cu_seqlens"]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_prepare_fwd(case):
    from flashdelta.kernels.prepare import prepare_fwd
    k, g, beta, cu = _inputs(case)
    _check_prepare_fwd(case, prepare_fwd, k, g, beta, cu)


def _check_prepare_fwd(case, fn, k, g, beta, cu):
    """fn's (g_cumsum, A) against the float64 twin, exact zeros where the reference has them, run-to-run bits."""
    g_cumsum, A = fn(k, g, beta, cu)
    torch.cuda.synchronize()
    g_ref, A_ref = ref.prepare_fwd(k, g, beta, cu)
    assert g_cumsum.dtype == torch.float32 and A.dtype == k.dtype
    assert_close("g_cumsum", g_cumsum, g_ref)
    assert_close("A", A, A_ref, baseline=A_ref.to(k.dtype))
    zero = A_ref == 0
    assert torch.all(A[zero] == 0), f"{int((A[zero] != 0).sum())} entries nonzero where the reference is 0"
    if case.pad:
        assert torch.all(g_cumsum[:, -case.pad:] == 0)
    again = fn(k, g, beta, cu)
    assert torch.equal(again[0], g_cumsum) and torch.equal(again[1], A), "run-to-run bits differ"
    return g_cumsum, A


@pytest.mark.parametrize("case", CASES, ids=str)
def test_prepare_fwd_pipe(case):
    """The persistent build on every case (the launcher's where `prepare.use_pipe`): the same checks, A and g_cumsum
    bit-identical to the one-shot kernel's (same K K^T and inverse code; both scans sum in the same order), every
    value-head split giving the same bits."""
    from flashdelta.kernels.prepare import heads_per_cta_options, prepare_fwd
    from flashdelta.kernels.prepare_pipe import prepare_fwd_pipe
    k, g, beta, cu = _inputs(case)
    g_cumsum, A = _check_prepare_fwd(case, prepare_fwd_pipe, k, g, beta, cu)
    one_shot = prepare_fwd(k, g, beta, cu, heads_per_cta=case.HV // case.H)
    assert torch.equal(A, one_shot[1]) and torch.equal(g_cumsum, one_shot[0]), "differs from the one-shot kernel"
    for hpc in heads_per_cta_options(case.H, case.HV)[1:]:
        split = prepare_fwd_pipe(k, g, beta, cu, heads_per_cta=hpc)
        assert torch.equal(split[0], g_cumsum) and torch.equal(split[1], A), f"heads_per_cta={hpc}"


@pytest.mark.parametrize("case", [CASES[1], CASES[3], CASES[9], CASES[11]], ids=str)
def test_prepare_fwd_heads_per_cta(case):
    """Every split of a key head's value heads over CTAs gives the same bits (each head's inverse is computed the
    same way; only which CTA does it changes), and so does the launcher's kernel (the persistent one where
    `prepare.use_pipe`)."""
    from flashdelta.kernels.prepare import heads_per_cta_options, prepare_fwd
    k, g, beta, cu = _inputs(case)
    auto = prepare_fwd(k, g, beta, cu)
    for hpc in heads_per_cta_options(case.H, case.HV):
        g_cumsum, A = prepare_fwd(k, g, beta, cu, heads_per_cta=hpc)
        assert torch.equal(g_cumsum, auto[0]) and torch.equal(A, auto[1]), f"heads_per_cta={hpc}"
    with pytest.raises(ValueError, match="heads_per_cta"):
        prepare_fwd(k, g, beta, cu, heads_per_cta=case.HV // case.H + 1)


# (case, knobs): builds sized for other register budgets must reproduce the launcher's bits (same arithmetic)
KNOB_CASES = [(c, kn) for c in (CASES[1], CASES[5], CASES[7], CASES[8], CASES[9], CASES[11],
                                 PrepCase("tiny-3", (3,), H=2, HV=2))
              for kn in ({"min_blocks": 4}, {"min_blocks": 5}, {"min_blocks": 6})]


@pytest.mark.parametrize("case,knobs", KNOB_CASES, ids=lambda v: str(v) if isinstance(v, PrepCase) else
                         "-".join(f"{a}{b}" for a, b in v.items()))
def test_prepare_fwd_knobs(case, knobs):
    from flashdelta.kernels import _tl, prepare
    k, g, beta, cu = _inputs(case)
    want = prepare.prepare_fwd(k, g, beta, cu)
    H, HV = k.shape[2], g.shape[-1]
    g_cumsum = _tl.alloc(want[0].shape, torch.float32, k.device)
    A = _tl.alloc(want[1].shape, k.dtype, k.device)
    kernel = prepare.build_fwd(prepare.builder_args(H, HV, k.shape[-1], k.dtype, beta.dtype), **knobs)
    kernel(k, g, beta, cu.to(torch.int32), g_cumsum, A)
    torch.cuda.synchronize()
    assert torch.equal(g_cumsum, want[0]) and torch.equal(A, want[1]), f"{knobs}: bits differ from the launcher's"


def test_prepare_fwd_int64_cu_seqlens_and_graph_capture():
    from flashdelta.kernels.prepare import prepare_fwd
    case = CASES[1]
    k, g, beta, cu = _inputs(case)
    g_ref, A_ref = prepare_fwd(k, g, beta, cu)
    cu64 = cu.to(torch.int64)
    prepare_fwd(k, g, beta, cu64)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out, A_out = prepare_fwd(k, g, beta, cu64)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(g_out, g_ref) and torch.equal(A_out, A_ref)


def test_prepare_fwd_offsets_past_2_31_elements():
    """GVA 1 (the persistent kernel): a sequence whose A rows start at element 2^31 ([1, T, 16, 64]); its g_cumsum
    and A from the big launch equal, bit for bit, a launch on that sequence alone (64-bit offsets)."""
    from flashdelta.kernels.prepare import _num_sms, prepare_fwd, use_pipe
    H = HV = 16
    T0, T1 = 2 ** 31 // (HV * 64), 1000          # sequence 1 starts exactly at A element 2^31
    gen = torch.Generator(device="cuda").manual_seed(0)
    k = torch.nn.functional.normalize(torch.randn(1, T0 + T1, H, 128, generator=gen, device="cuda"), dim=-1)
    k = k.bfloat16()
    g = torch.nn.functional.logsigmoid(torch.randn(1, T0 + T1, HV, generator=gen, device="cuda")) / 16
    beta = torch.sigmoid(torch.randn(1, T0 + T1, HV, generator=gen, device="cuda"))
    cu = torch.tensor([0, T0, T0 + T1], dtype=torch.int32, device="cuda")
    assert use_pipe(H, HV, 128, T0 + T1, 2, _num_sms(k.device))
    gc_big, A_big = prepare_fwd(k, g, beta, cu)
    assert A_big.numel() > 2 ** 31 and T0 * HV * 64 == 2 ** 31
    sl = slice(T0, T0 + T1)
    gc_1, A_1 = prepare_fwd(k[:, sl].contiguous(), g[:, sl].contiguous(), beta[:, sl].contiguous(),
                            torch.tensor([0, T1], dtype=torch.int32, device="cuda"))
    torch.cuda.synchronize()
    assert torch.isfinite(A_big[:, sl]).all() and torch.isfinite(gc_big[:, sl]).all()
    assert torch.equal(A_big[:, sl], A_1) and torch.equal(gc_big[:, sl], gc_1)


BWD_CASES = [
    PrepCase("bwd-dense-4k", (4096,), H=16, HV=64),
    PrepCase("bwd-edges-pad37", EDGES, H=4, HV=8, pad=37),
    PrepCase("bwd-70k-seqs", random_lengths(70000, (0, 1, 2, 3, 70), 3), H=1, HV=2, pad=10),
]


@pytest.mark.parametrize("case", BWD_CASES, ids=str)
def test_prepare_bwd(case):
    from flashdelta.kernels.prepare import prepare_bwd
    _, _, _, cu = _inputs(case)
    T = sum(case.seqlens) + case.pad
    dG = torch.randn(1, T, case.HV, device="cuda")
    dg = prepare_bwd(dG, cu)
    torch.cuda.synchronize()
    dg_ref = ref.prepare_bwd(dG, cu)
    assert dg.dtype == torch.float32
    assert_close("dg", dg, dg_ref, tol=1e-5)
    if case.pad:
        assert torch.all(dg[:, -case.pad:] == 0)
