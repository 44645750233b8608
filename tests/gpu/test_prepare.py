"""Stage `prepare` on a Hopper GPU: `kernels.prepare.prepare_fwd` (both kernels) and `kernels.prepare_bwd.prepare_bwd`
against their float64 twins.

A is checked against the float64 inverse with the reference rounded to A's dtype as the baseline (the kernel
may add at most as much error again as that rounding), and must be exactly 0 wherever the reference is
(upper triangle, columns past a ragged chunk's end, padding rows). Outputs are NaN-poisoned (conftest), so a
row the kernel forgets fails the non-finite check.
"""
import pytest
import torch
from _helpers import Case, assert_close, make_inputs
from cases import PREP_BIG, PREP_BWD_CASES, PREP_CASES, PREP_SPLIT_CASES

from flashdelta.kernels import prepare
from flashdelta.kernels.prepare_bwd import prepare_bwd
from flashdelta.reference import chunked as ref


def _inputs(case):
    c = Case(case.name, case.seqlens, H=case.H, HV=case.HV, K=case.K, V=8, pad=case.pad, h0=False,
             gate=case.gate)
    x = make_inputs(c, dtype=case.dtype, device="cuda")
    return x["k"], x["g"], x["beta"].to(case.beta_dtype), x["cu_seqlens"]


@pytest.mark.parametrize("case", PREP_CASES, ids=str)
def test_prepare_fwd(case):
    k, g, beta, cu = _inputs(case)
    _check_prepare_fwd(case, prepare.prepare_fwd, k, g, beta, cu)


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


def _persistent(k, g, beta, cu, heads_per_cta=None):
    return prepare.prepare_fwd(k, g, beta, cu, persistent=True, heads_per_cta=heads_per_cta)


@pytest.mark.parametrize("case", PREP_CASES, ids=str)
def test_prepare_fwd_persistent(case):
    """The persistent kernel on every case (the launcher's where `prepare.use_pipe`): the same checks, A and g_cumsum
    bit-identical to the one-shot kernel's (same K K^T and inverse code; both scans sum in the same order), every
    value-head split giving the same bits."""
    k, g, beta, cu = _inputs(case)
    g_cumsum, A = _check_prepare_fwd(case, _persistent, k, g, beta, cu)
    one_shot = prepare.prepare_fwd(k, g, beta, cu, persistent=False, heads_per_cta=case.HV // case.H)
    assert torch.equal(A, one_shot[1]) and torch.equal(g_cumsum, one_shot[0]), "differs from the one-shot kernel"
    for hpc in prepare.heads_per_cta_options(case.H, case.HV)[1:]:
        split = _persistent(k, g, beta, cu, heads_per_cta=hpc)
        assert torch.equal(split[0], g_cumsum) and torch.equal(split[1], A), f"heads_per_cta={hpc}"


@pytest.mark.parametrize("case", PREP_CASES, ids=str)
def test_prepare_fwd_key_norms(case):
    """`prepare_fwd(norms=True)` (both kernels, every value-head split): the squared key norms (K K^T's diagonal)
    against the float64 sum of squares to fp32 accumulation (1e-6), unwritten on the padding tail; g_cumsum and A
    bit for bit as without them."""
    k, g, beta, cu = _inputs(case)
    plain = prepare.prepare_fwd(k, g, beta, cu)
    n_tok = int(cu[-1])
    want = k[0, :n_tok].double().square().sum(-1)                                   # [T, H]
    for persistent in (False, True):
        for hpc in prepare.heads_per_cta_options(case.H, case.HV):
            got = prepare.prepare_fwd(k, g, beta, cu, persistent=persistent, heads_per_cta=hpc, norms=True)
            torch.cuda.synchronize()
            assert len(got) == 3 and got[2].shape == (1, k.shape[1], case.H) and got[2].dtype == torch.float32
            assert torch.equal(got[0], plain[0]) and torch.equal(got[1], plain[1]), (persistent, hpc)
            assert_close("k_norm2", got[2][0, :n_tok], want, tol=1e-6)


@pytest.mark.parametrize("case", PREP_SPLIT_CASES, ids=str)
def test_prepare_fwd_heads_per_cta(case):
    """Every split of a key head's value heads over CTAs gives the same bits (each head's inverse is computed the
    same way, in builds sized for 4 or 5 CTAs per SM; only which CTA does it changes), and so does the launcher's
    kernel (the persistent one where `prepare.use_pipe`)."""
    k, g, beta, cu = _inputs(case)
    auto = prepare.prepare_fwd(k, g, beta, cu)
    for hpc in prepare.heads_per_cta_options(case.H, case.HV):
        g_cumsum, A = prepare.prepare_fwd(k, g, beta, cu, heads_per_cta=hpc)
        assert torch.equal(g_cumsum, auto[0]) and torch.equal(A, auto[1]), f"heads_per_cta={hpc}"
    with pytest.raises(ValueError, match="heads_per_cta"):
        prepare.prepare_fwd(k, g, beta, cu, heads_per_cta=case.HV // case.H + 1)


def test_prepare_fwd_int64_cu_seqlens_and_graph_capture():
    case = PREP_CASES[1]
    k, g, beta, cu = _inputs(case)
    g_ref, A_ref = prepare.prepare_fwd(k, g, beta, cu)
    cu64 = cu.to(torch.int64)
    prepare.prepare_fwd(k, g, beta, cu64)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out, A_out = prepare.prepare_fwd(k, g, beta, cu64)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(g_out, g_ref) and torch.equal(A_out, A_ref)


@pytest.mark.bigmem
def test_prepare_fwd_offsets_past_2_31_elements():
    """GVA 1 (the persistent kernel): a sequence whose A rows start at element 2^31 ([1, T, 16, 64]); its g_cumsum
    and A from the big launch equal, bit for bit, a launch on that sequence alone (64-bit offsets)."""
    from flashdelta.kernels import _tl

    H, HV = PREP_BIG.H, PREP_BIG.HV
    T0, T1 = 2 ** 31 // (HV * 64), 1000          # sequence 1 starts exactly at A element 2^31
    gen = torch.Generator(device="cuda").manual_seed(0)
    k = torch.nn.functional.normalize(torch.randn(1, T0 + T1, H, 128, generator=gen, device="cuda"), dim=-1)
    k = k.to(PREP_BIG.dtype)
    g = torch.nn.functional.logsigmoid(torch.randn(1, T0 + T1, HV, generator=gen, device="cuda")) / 16
    beta = torch.sigmoid(torch.randn(1, T0 + T1, HV, generator=gen, device="cuda")).to(PREP_BIG.beta_dtype)
    cu = torch.tensor([0, T0, T0 + T1], dtype=torch.int32, device="cuda")
    assert prepare.use_pipe(H, HV, 128, T0 + T1, 2, _tl.num_sms(k.device))
    gc_big, A_big = prepare.prepare_fwd(k, g, beta, cu)
    assert A_big.numel() > 2 ** 31 and T0 * HV * 64 == 2 ** 31
    sl = slice(T0, T0 + T1)
    gc_1, A_1 = prepare.prepare_fwd(k[:, sl].contiguous(), g[:, sl].contiguous(), beta[:, sl].contiguous(),
                                    torch.tensor([0, T1], dtype=torch.int32, device="cuda"))
    torch.cuda.synchronize()
    assert torch.isfinite(A_big[:, sl]).all() and torch.isfinite(gc_big[:, sl]).all()
    assert torch.equal(A_big[:, sl], A_1) and torch.equal(gc_big[:, sl], gc_1)


@pytest.mark.parametrize("case", PREP_BWD_CASES, ids=str)
def test_prepare_bwd(case):
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


@pytest.mark.parametrize("persistent", [False, True], ids=["one-shot", "persistent"])
@pytest.mark.parametrize("case", [PREP_CASES[1], PREP_CASES[5]], ids=str)
def test_prepare_fwd_gate_floor(case, persistent):
    """Gates of -inf (a full state reset) and -1e30 count as numerics.GATE_FLOOR before the cumsum, in both kernels
    (the one-shot kernel as it loads g, the persistent one in fd_gate_cumsum): g_cumsum is finite and matches the
    float64 twin, which floors the same way (docs/numerics.md)."""
    k, g, beta, cu = _inputs(case)
    g = g.clone()
    g[0, 0] = float("-inf")                       # a sequence's first token, every value head
    g[0, 70, :2] = -1e30                          # mid-chunk, some value heads
    g[0, int(cu[3]), :] = float("-inf")           # another sequence's first token
    g_cumsum, A = prepare.prepare_fwd(k, g, beta, cu, persistent=persistent)
    torch.cuda.synchronize()
    g_ref, A_ref = ref.prepare_fwd(k, g, beta, cu)
    assert torch.isfinite(g_cumsum).all() and torch.isfinite(g_ref).all()
    assert_close("g_cumsum", g_cumsum, g_ref)
    assert_close("A", A, A_ref, baseline=A_ref.to(k.dtype))


# ------------------------------------------------------------------------------------- the in-kernel activations

# option sets of the in-kernel gate and beta activation: (raw gate dtype, A_log dtype, dt_bias dtype, beta_act);
# a None A_log dtype: g is the log decay (fp32)
GATE_OPTIONS = {
    "bf16-bias-sigmoid": (torch.bfloat16, torch.float32, torch.float32, 1),
    "fp32-bf16alog-nobias-negeig": (torch.float32, torch.bfloat16, None, 2),
    "fp16-bias-nobeta": (torch.float16, torch.float32, torch.float16, 0),
    "beta-sigmoid-only": (torch.float32, None, None, 1),
}
GATE_CASES = [(PREP_CASES[1], "bf16-bias-sigmoid"), (PREP_CASES[0], "bf16-bias-sigmoid"),
              (PREP_CASES[5], "fp32-bf16alog-nobias-negeig"), (PREP_CASES[9], "bf16-bias-sigmoid"),
              (PREP_CASES[3], "fp16-bias-nobeta"), (PREP_CASES[11], "beta-sigmoid-only"),
              (PREP_CASES[8], "fp32-bf16alog-nobias-negeig")]


def builds() -> list:
    """(label, builder, args) of the in-kernel activation builds this file launches (the launcher's picks and the
    persistent kernel on every case), without duplicates: what bench/precompile.py --tests compiles for it."""
    from flashdelta.kernels import _tl, prepare_pipe

    out = {}
    for case, opt in GATE_CASES:
        g_dtype, a_log_dtype, dt_bias_dtype, beta_act = GATE_OPTIONS[opt]
        kw = dict(g_dtype=g_dtype, a_log_dtype=a_log_dtype, dt_bias_dtype=dt_bias_dtype, beta_act=beta_act)
        todo = prepare.launcher_builds(case.H, case.HV, case.K, case.dtype, case.beta_dtype,
                                       num_sms=_tl.DEFAULT_NUM_SMS, **kw)
        todo.append(("prepare_fwd persistent (forced)", prepare_pipe.build, prepare_pipe.builder_args(
            case.H, case.HV, case.K, case.dtype, case.beta_dtype, 0, _tl.DEFAULT_NUM_SMS, prepare.options(**kw))))
        for label, b, a in todo:
            out.setdefault((b.__name__, a), (f"{case.name} {opt}: {label}", b, a))
    return list(out.values())


def _gate_inputs(case, opt):
    """The stage's inputs with the raw gate and beta's logits (tests/_gates.py) in the option set's dtypes."""
    from _gates import beta_logits, gate_params, raw_gate

    g_dtype, a_log_dtype, dt_bias_dtype, beta_act = GATE_OPTIONS[opt]
    k, g, beta, cu = _inputs(case)
    gen = torch.Generator().manual_seed(11)
    T, HV = g.shape[1], g.shape[2]
    A_log, dt_bias = gate_params(HV, generator=gen)
    if a_log_dtype is not None:
        g = raw_gate(1, T, HV, generator=gen).to(device="cuda", dtype=g_dtype)
    if beta_act:
        beta = beta_logits(1, T, HV, generator=gen).to(device="cuda", dtype=case.beta_dtype)
    opts = dict(A_log=None if a_log_dtype is None else A_log.to(device="cuda", dtype=a_log_dtype),
                dt_bias=None if dt_bias_dtype is None else dt_bias.to(device="cuda", dtype=dt_bias_dtype),
                beta_act=beta_act)
    return k, g, beta, cu, opts


@pytest.mark.parametrize("persistent", [False, True], ids=["one-shot", "persistent"])
@pytest.mark.parametrize("case,opt", GATE_CASES, ids=[f"{c}-{o}" for c, o in GATE_CASES])
def test_prepare_fwd_in_kernel_gate(case, opt, persistent):
    """The raw gate (bf16 / fp16 / fp32), A_log, dt_bias and beta's logits straight into the kernels: g_cumsum, A and
    the activated beta (fp32) against the float64 twin with the same options (which activates in float64), zeros
    where the reference has them (padding, A's upper triangle), run-to-run bits, and both kernels bit-identical (the
    same device functions compute the activations)."""
    k, g, beta, cu, opts = _gate_inputs(case, opt)
    out = prepare.prepare_fwd(k, g, beta, cu, persistent=persistent, **opts)
    torch.cuda.synchronize()
    want = ref.prepare_fwd(k, g, beta, cu, **opts)
    assert len(out) == len(want) == (3 if opts["beta_act"] else 2)
    g_cumsum, A = out[:2]
    assert g_cumsum.dtype == torch.float32 and A.dtype == k.dtype
    assert torch.isfinite(g_cumsum).all()
    assert_close("g_cumsum", g_cumsum, want[0])
    assert_close("A", A, want[1], baseline=want[1].to(k.dtype))
    assert torch.all(A[want[1] == 0] == 0)
    if opts["beta_act"]:
        assert out[2].dtype == torch.float32
        assert_close("beta", out[2], want[2], tol=1e-5)
    if case.pad:
        assert torch.all(g_cumsum[:, -case.pad:] == 0)
        assert not opts["beta_act"] or torch.all(out[2][:, -case.pad:] == 0)
    again = prepare.prepare_fwd(k, g, beta, cu, persistent=persistent, **opts)
    assert all(torch.equal(a, b) for a, b in zip(out, again)), "run-to-run bits differ"
    other = prepare.prepare_fwd(k, g, beta, cu, persistent=not persistent, heads_per_cta=case.HV // case.H, **opts)
    assert all(torch.equal(a, b) for a, b in zip(out, other)), "the two kernels differ"


def test_prepare_fwd_in_kernel_gate_graph_capture():
    """The in-kernel options under CUDA-graph capture (int64 cu_seqlens converted on the device): the eager bits."""
    case, opt = GATE_CASES[0]
    k, g, beta, cu, opts = _gate_inputs(case, opt)
    eager = prepare.prepare_fwd(k, g, beta, cu, **opts)
    cu64 = cu.to(torch.int64)
    prepare.prepare_fwd(k, g, beta, cu64, **opts)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = prepare.prepare_fwd(k, g, beta, cu64, **opts)
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(out, eager))
