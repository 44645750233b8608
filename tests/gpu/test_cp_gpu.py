"""CP (`flashdelta.cp`) on the sm90 backend, through the public API.

Forward: CP on vs off against the float64 reference (with the bf16 PyTorch baseline), the plan against the
reference's partition and the plan kernel against the torch plan, the automatic choice on a long sequence, CUDA-graph capture replayed with new lengths. The
gate-driven warm-up: the fused forward's `chunk_skip` builds against the float64 twin, CP's summary builds against the full pass, the
windows on the GPU against the reference's, warm-up on vs the exact path vs serial vs float64 on benchmark gates
(4-chunk windows, a quarter of the heads exactly 0), and a graph with the warm-up replayed with new lengths.
Backward: every gradient with the backward split against float64 autograd of the recurrence (no less accurate than the
serial backward) and against CP off; the automatic choice splitting the backward alone (16/32 1x8192, exact end
gradients there: the warm-up would shorten no wave); one CUDA graph of forward + backward with CP replayed with new
lengths, and one with the automatic decision taken under capture from cu_seqlens_cpu. The backward's warm-up
(`FLASHDELTA_CP_WARMUP=1`): chunk_dstate's `chunk_take` builds against the float64 twin, the backward's windows on the
GPU against the reference's, every gradient with it on vs the exact path vs serial vs float64 on benchmark gates, and
one graph of forward + backward with it replayed with new lengths and gates. The windows kernel (`kernels.cp_windows`,
both directions) against the torch windows, bit for bit, on edge cases.

Builds: `builds()` lists every kernel these tests launch (CP's own, `cp.builds`, and the serial passes they are
compared with, `flashdelta.precompile.variants`); compile them on the CPU machine with

    TILELANG_CACHE_DIR=.cache/tl-ship python3 bench/precompile.py --tests      # the GPU tier (tests/_builds.py)
"""
import pytest
import torch
from _helpers import Case, assert_close, make_inputs, split_backward_only

from flashdelta import chunk_gated_delta_rule, cp, portable
from flashdelta.reference import cp as rcp
from flashdelta.reference.chunked import chunked_fwd


def _variants(case, backward: bool):
    """The serial passes' builds for `case` (bf16 with bf16 beta, fp32 h0, its layout and initial state) and CP's."""
    from flashdelta.precompile import variants

    K, V = case.K, case.V
    out = variants([(case.H, case.HV)], head_dim=(K, V), beta_dtype=torch.bfloat16, qk_l2norm=False,
                   initial_state=(case.h0,), state_v_first=(case.state_v_first,), backward=backward, num_sms=132)
    return out + cp.builds(case.H, case.HV, K, V, torch.bfloat16, torch.bfloat16, K ** -0.5, backward=backward)


def builds() -> list:
    """(label, builder, args) of every SM90 build this file launches, without duplicates."""
    todo = [(c, False) for c, _ in CASES] + [(c, True) for c, _ in BWD_CASES]
    todo += [(c, False) for c, _ in WARM_CASES] + [(SKIP_CASE, False), (WARM_GRAPH, False)]
    todo += [(AUTO_FWD, False), (GRAPH, False), (AUTO_BWD, True), (BWD_GRAPH, True), (AUTO_GRAPH, True)]
    todo += [(c, True) for c in STARTS_CASES]
    todo += [(c, True) for c, _ in BWD_WARM_CASES] + [(TAKE_CASE, True), (BWD_WARM_GRAPH, True)]
    out = {}
    for case, backward in todo:
        for label, b, a in _variants(case, backward):
            out.setdefault((b.__name__, a), (f"{case.name}: {label}", b, a))
    from flashdelta.kernels import cp_windows

    for n, (_, _, H, HV, K, dtype, beta_dtype, _) in enumerate(WINDOWS_KERNEL_CASES):
        for label, b, a in cp_windows.launcher_builds(H, HV, K, dtype, beta_dtype, backward=(False, True)):
            out.setdefault((b.__name__, a), (f"windows kernel {n}: {label}", b, a))
    return list(out.values())


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


PLAN_CASES = [
    # (sequence lengths, T (tokens of the flat input; >= their sum), L, dense)
    ((32768,), 32768, 64, False),
    ((3000, 1, 700, 0, 130, 64), 3900, 4, False),          # empty and 1-token sequences, a padding tail
    ((0,), 100, 2, False),                                 # one empty sequence
    ((0, 0, 0), 0, 1, False),
    ((128 * 64, 64, 5000), 13256, 128, False),             # an exact multiple of the partition
    ((2048, 2048), 4096, 8, True),                          # dense
    (tuple([37] * 700 + [70000]), 95900, 16, False),       # many short sequences and one long (3 per thread)
]


@pytest.mark.parametrize("lengths,T,L,dense", PLAN_CASES, ids=[f"{len(c[0])}seq-L{c[2]}" for c in PLAN_CASES])
def test_plan_kernel_matches_the_torch_plan(lengths, T, L, dense):
    """`kernels.cp_plan` (the plan of the SM90 path) gives exactly the torch ops' plan, every field and slot."""
    from flashdelta.kernels import sm90

    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    seq_len = lengths[0] if dense else None
    got = cp.make_plan(cu, T, L, seq_len=seq_len, kset=sm90.KERNELS)
    want = cp.make_plan(cu, T, L, seq_len=seq_len)
    torch.cuda.synchronize()
    assert (got.P, got.J, got.N, got.regular) == (want.P, want.J, want.N, want.regular)
    for name in ("cu", "seq", "pos", "first", "last_index", "step_index"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), name
    assert want.scan_cu is None and torch.equal(cp._part_cu(got), cp._part_cu(want))


WINDOWS_KERNEL_CASES = [
    # (sequence lengths before the last one, pad tokens, H, HV, K, k dtype, beta dtype, L): GVA 4 and 1, every beta
    # dtype; the last sequence has 4 L chunks and 100 tokens (four inner partitions and a ragged last one)
    ((5000, 1, 700, 0, 130), 7, 2, 8, 128, torch.bfloat16, torch.float32, 8),
    ((5000, 1, 700, 0, 130), 7, 2, 8, 128, torch.bfloat16, torch.float32, 64),
    ((9000, 64 * 32 * 3), 0, 4, 4, 64, torch.float16, torch.float16, 32),
    ((3000, 64 * 8 * 5, 17), 3, 1, 4, 256, torch.bfloat16, torch.bfloat16, 8),
    ((), 0, 2, 8, 128, torch.bfloat16, torch.float64, 32),
]


def _windows_inputs(before, pad, H, HV, K, dtype, beta_dtype, L):
    """g_cumsum (head 0 never decays, head 1 decays by ~20 per chunk, the others by 0.5-4), l2-normalised keys,
    beta in [0, 1], then violations in the last sequence's inner partitions: beta x ||k||^2 > 2 through the key (key
    head 0, its first partition), beta > 2 (head 2, the same), beta < 0 (head 3 % HV, its second), NaN beta (the
    last head, its third partition's last token), beta at the keys_normalized bound and one ulp above it (head 1, the
    third and fourth partitions), and violations in sequences' last partitions (the forward ignores
    them, the backward checks the ragged last one of the last sequence), on the token after sequence 0 and on the
    padding (past every partition's end: never checked)."""
    gen = torch.Generator().manual_seed(11)
    lengths = (*before, 4 * 64 * L + 100)
    N, T = len(lengths), sum(lengths) + pad
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    rate = -torch.rand(HV, generator=gen, dtype=torch.float64) * 3.5 - 0.5
    rate[0], rate[1 % HV] = 0.0, -20.0
    g = (rate * (0.5 + torch.rand(T, HV, generator=gen, dtype=torch.float64))).float()[None]
    k = torch.randn(T, H, K, generator=gen)
    k = (k / k.norm(dim=-1, keepdim=True)).to(dtype)
    beta = torch.rand(T, HV, generator=gen).to(torch.float64)
    W, s = 64 * L, int(cu[N - 1])
    k[s + 70, 0] *= 2                                 # ||k||^2 ~ 4: beta ~ 0.5 x 4 > 2 unless beta is small
    beta[s + 70, : HV // H] = 0.75
    beta[s + 5, 2 % HV] = 2.5
    beta[s + W + 100, 3 % HV] = -0.25
    beta[s + 3 * W - 1, HV - 1] = float("nan")
    assert s + 4 * W < int(cu[N])
    # with keys_normalized beta meets the bound rounded to its dtype: exactly at it passes, one ulp above fails (the
    # keys there are short, so beta x ||k||^2 ~ 0.5 passes without keys_normalized)
    at = float(torch.tensor(cp.CONTRACTION_LIMIT / cp.NORMALIZED_KEY_NORM2, dtype=beta_dtype))
    kh = (1 % HV) // (HV // H)
    k[s + 2 * W + 10, kh] *= 0.5
    k[s + 3 * W + 10, kh] *= 0.5
    beta[s + 2 * W + 10, 1 % HV] = at
    beta[s + 3 * W + 10, 1 % HV] = at + torch.finfo(beta_dtype).eps
    beta[int(cu[N]) - 1, :] = 5.0                     # the last partition of the last sequence: not checked
    beta[int(cu[1]) - 1, 1 % HV] = -1.0               # sequence 0's last token (its last partition)
    beta[min(int(cu[1]), T - 1), 2 % HV] = -1.0        # the token after sequence 0 (another partition's)
    beta[int(cu[N]):, :] = -3.0                       # padding tokens: no partition's
    return g.cuda(), k[None].cuda(), beta.to(beta_dtype)[None].cuda(), cu.cuda(), T


def _sequential_suffix(g_cumsum, plan):
    """`Windows.suffix` by an explicit loop on the CPU: chunk L - 1 - j's last gate (the token clamped to T - 1),
    added one float64 addition after the other from 0."""
    g = g_cumsum[0].cpu().double()
    T = g.shape[0]
    cu = plan.cu.cpu().to(torch.int64)
    out = torch.empty(plan.P, plan.L, g.shape[1], dtype=torch.float64)
    run = torch.zeros(plan.P, g.shape[1], dtype=torch.float64)
    for j in range(plan.L):
        run = run + g[torch.clamp_max(cu[:-1] + 64 * (plan.L - j) - 1, T - 1)]
        out[:, j] = run
    return out


def _kernel_and_torch(decide, i, normalized, fields):
    """`decide` (`cp.windows` or `cp.grad_windows`) of case i with the SM90 kernel set (the kernel) and without
    (the torch ops) on the kernel's plan, `fields` compared bit for bit: ``(kernel's, torch's, plan, g_cumsum, the
    kernel set's exact path)``."""
    from flashdelta.kernels import sm90

    before, pad, H, HV, K, dtype, beta_dtype, L = WINDOWS_KERNEL_CASES[i]
    g_cumsum, k, beta, cu, T = _windows_inputs(before, pad, H, HV, K, dtype, beta_dtype, L)
    plan = cp.make_plan(cu, T, L, kset=sm90.KERNELS)
    thr = cp.WARMUP_THRESHOLD
    got = decide(g_cumsum, k, beta, plan, thr, keys_normalized=normalized, kset=sm90.KERNELS)
    want = decide(g_cumsum, k, beta, plan, thr, keys_normalized=normalized)
    torch.cuda.synchronize()
    for name in fields:
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), name
    assert got.threshold == want.threshold
    exact = decide(g_cumsum, k, beta, plan, None, keys_normalized=normalized, kset=sm90.KERNELS)
    return got, want, plan, g_cumsum, exact


@pytest.mark.parametrize("i", range(len(WINDOWS_KERNEL_CASES)))
@pytest.mark.parametrize("normalized", [False, True])
def test_windows_kernel_matches_the_torch_windows(i, normalized):
    """`kernels.cp_windows` (the SM90 path of `cp.windows` on the warm-up path) gives the torch ops' decision bit
    for bit (skip_e, skip_m, fallback on every slot), and suffix sums equal to an explicit sequential float64 sum;
    the violations reach exactly the heads and partitions they should; the exact path (no threshold) is unchanged."""
    got, want, plan, g_cumsum, exact = _kernel_and_torch(cp.windows, i, normalized, ("skip_e", "skip_m", "fallback"))
    before, _, H, HV, *_, L = WINDOWS_KERNEL_CASES[i]
    assert got.suffix.dtype == torch.float64
    ref = _sequential_suffix(g_cumsum, plan)
    assert torch.equal(got.suffix.cpu(), ref), "suffix: the sequential float64 sum"
    print(f"case {i}: torch's cumsum equals the sequential sum: {torch.equal(want.suffix.cpu(), ref)}")
    assert torch.equal(got.n(L), want.n(L))
    # the edge cases decide as built: head 0 falls back on every inner partition, the violations fall back
    inner = ~plan.first.roll(-1).cpu()
    fb = got.fallback.cpu()
    assert bool(fb[inner, 0].all()) and not bool(fb[~inner].any())
    assert bool(((got.n(L).cpu() < L) & ~fb)[inner].any()), "the case must truncate"
    s = int(plan.last_index[-2]) + 1 if before else 0                                 # the last sequence's first slot
    G = HV // H
    assert bool(fb[s, 2 % HV]) and bool(fb[s + 1, 3 % HV]) and bool(fb[s + 2, HV - 1])
    if not normalized:
        assert bool(fb[s, :G].all()), "the long key falls back its key head's value heads"
    assert not bool(fb[s + 2, 1 % HV]) and bool(fb[s + 3, 1 % HV]) == normalized, "the bound in beta's dtype"
    assert exact.suffix is None and torch.equal(exact.fallback.cpu(), inner[:, None].expand(plan.P, HV))


@pytest.mark.parametrize("i", range(len(WINDOWS_KERNEL_CASES)))
@pytest.mark.parametrize("fn", [cp.windows, cp.grad_windows], ids=["fwd", "bwd"])
def test_windows_kernel_with_key_norms(i, fn):
    """The windows kernels reading prepare's squared key norms (`k_norm2`, `prepare_fwd(norms=True)`) in place of k
    decide as they do reading k on these cases (the same violations: the long key, beta past the bound), and as the
    torch path given the same norms, bit for bit."""
    from flashdelta.kernels import prepare, sm90

    before, pad, H, HV, K, dtype, beta_dtype, L = WINDOWS_KERNEL_CASES[i]
    g_cumsum, k, beta, cu, T = _windows_inputs(before, pad, H, HV, K, dtype, beta_dtype, L)
    plan = cp.make_plan(cu, T, L, kset=sm90.KERNELS)
    k_norm2 = prepare.prepare_fwd(k, torch.zeros_like(g_cumsum), beta.float(), cu, norms=True)[-1]
    thr = cp.WARMUP_THRESHOLD
    got = fn(g_cumsum, k, beta, plan, thr, kset=sm90.KERNELS, k_norm2=k_norm2)
    from_k = fn(g_cumsum, k, beta, plan, thr, kset=sm90.KERNELS)
    torch_norms = fn(g_cumsum, k, beta, plan, thr, k_norm2=k_norm2)
    torch.cuda.synchronize()
    for name in ("fallback", "skip_e", "skip_m", "take"):
        if hasattr(got, name):
            a = getattr(got, name)
            assert torch.equal(a, getattr(from_k, name)) and torch.equal(a, getattr(torch_norms, name)), name


def _sequential_prefix(g_cumsum, plan):
    """`GradWindows.prefix` by an explicit loop on the CPU: chunk j's last gate in the partition (the token clamped
    to [0, T - 1]), 0 for chunks past its end, added one float64 addition after the other from 0."""
    g = g_cumsum[0].cpu().double()
    T = g.shape[0]
    cu = plan.cu.cpu().to(torch.int64)
    bos, eos = cu[:-1], cu[1:]
    out = torch.empty(plan.P, plan.L, g.shape[1], dtype=torch.float64)
    run = torch.zeros(plan.P, g.shape[1], dtype=torch.float64)
    for j in range(plan.L):
        start = bos + 64 * j
        last = torch.clamp(torch.minimum(start + 63, eos - 1), 0, T - 1)
        run = run + torch.where((start < eos)[:, None], g[last], 0.0)
        out[:, j] = run
    return out


@pytest.mark.parametrize("i", range(len(WINDOWS_KERNEL_CASES)))
@pytest.mark.parametrize("normalized", [False, True])
def test_grad_windows_kernel_matches_the_torch_grad_windows(i, normalized):
    """The backward's windows kernel (`kernels.cp_windows`, `backward`) gives `cp.grad_windows`'s torch decision bit
    for bit (take, fallback on every slot), and prefix sums equal to an explicit sequential float64 sum; a
    sequence's first partition never decides, the ragged last one does over its own tokens only."""
    got, want, plan, g_cumsum, exact = _kernel_and_torch(cp.grad_windows, i, normalized, ("take", "fallback"))
    before, _, H, HV, *_, L = WINDOWS_KERNEL_CASES[i]
    assert got.prefix.dtype == torch.float64
    ref = _sequential_prefix(g_cumsum, plan)
    assert torch.equal(got.prefix.cpu(), ref), "prefix: the sequential float64 sum"
    print(f"case {i}: torch's cumsum equals the sequential sum: {torch.equal(want.prefix.cpu(), ref)}")
    assert torch.equal(got.n(plan), want.n(plan))
    cont = ~plan.first.cpu()
    fb = got.fallback.cpu()
    assert bool(fb[cont, 0].all()) and not bool(fb[~cont].any())
    assert bool(((got.take.cpu() < cp.TAKE_ALL) & ~fb)[cont].any()), "the case must truncate"
    s = int(plan.last_index[-2]) + 1 if before else 0                                 # the last sequence's first slot
    assert bool(fb[s + 1, 3 % HV]) and bool(fb[s + 2, HV - 1]) and bool(fb[s + 4].all())
    assert not bool(fb[s + 2, 1 % HV]) and bool(fb[s + 3, 1 % HV]) == normalized, "the bound in beta's dtype"
    assert exact.prefix is None and torch.equal(exact.fallback.cpu(), cont[:, None].expand(plan.P, HV))


# (N, HV, descending, tail, key range): the warm-up passes' shapes (16 partitions at 2/8, 256 at 16/32: 8192 items,
# eight of the kernel's thread rounds), keys past 255 (SKIP_ALL / TAKE_ALL) and negative ones
ORDER_CASES = [(16, 8, False, True, 40), (17, 8, True, False, 1 << 30), (256, 32, True, False, 300),
               (255, 32, False, True, 3), (1, 200, False, True, 256), (40, 4, True, True, -5)]


@pytest.mark.parametrize("N,HV,descending,tail,hi", ORDER_CASES, ids=[f"{c[0]}x{c[1]}" for c in ORDER_CASES])
def test_item_order_kernel_sorts_the_buckets(N, HV, descending, tail, hi):
    """`kernels.item_order` (the warm-up passes' work order): a permutation of the items whose clamped keys run as
    the stable sort's (`reference_order`; ties may come in any order), the padding tail's items last in place."""
    from flashdelta.kernels import item_order as io

    gen = torch.Generator().manual_seed(N * HV)
    lo = min(hi, 0)
    keys = torch.randint(lo, max(abs(hi), 1) + 1, (N, HV), generator=gen, dtype=torch.int32)
    keys[0, 0] = 1 << 30
    got = io.order(keys.cuda(), 132, descending=descending, tail=tail).cpu()
    want = io.reference_order(keys, descending=descending, tail=tail)
    assert got.dtype == torch.int32 and got.shape == want.shape
    assert torch.equal(torch.sort(got).values, torch.arange(want.numel(), dtype=torch.int32)), "a permutation"
    n = N * HV
    bucket = torch.clamp(keys.reshape(-1).long(), 0, 255)
    assert torch.equal(bucket[got[:n].long()], bucket[want[:n]]), "the items by bucket"
    assert torch.equal(got[n:].long(), want[n:]), "the tail's items last, in place"


AUTO_FWD = Case("cp-auto", (32768,), H=2, HV=8, K=128, V=128)
GRAPH = Case("cp-graph", (3000, 1, 2000), H=2, HV=8, K=128, V=128, pad=11)


def test_auto_splits_a_long_sequence_on_few_heads(monkeypatch):
    """2/8 1x32768: auto splits at the L the cost model picks, takes the warm-up exactly where the model says it
    pays (`cp_model.warmup_pays`), and agrees with the serial path."""
    from flashdelta import cp_model

    monkeypatch.delenv(cp.ENV_CP, raising=False)
    monkeypatch.delenv(cp.ENV_WARMUP, raising=False)
    x = make_inputs(AUTO_FWD, dtype=torch.bfloat16, device="cuda")
    calls = []
    real = cp.cp_chunk_fwd
    monkeypatch.setattr(cp, "cp_chunk_fwd", lambda *a, **kw: calls.append((kw["plan"], a[0])) or real(*a, **kw))
    with torch.no_grad():
        o, ht = chunk_gated_delta_rule(**x, output_final_state=True)
        o0, ht0 = chunk_gated_delta_rule(**x, output_final_state=True, context_parallel=False)
    sms = cp.num_sms(x["q"].device)
    T, (HV, K, V) = AUTO_FWD.seqlens[0], (AUTO_FWD.HV, AUTO_FWD.K, AUTO_FWD.V)
    L = cp_model.choose(T=T, N=1, HV=HV, K=K, V=V, sms=sms, lengths=[T], warmup=True)
    assert len(calls) == 1 and calls[0][0].L == L > 0, ([c[0].L for c in calls], L)
    plan = calls[0][0]
    P = min(plan.P, plan.N * plan.J)
    pays = cp_model.warmup_pays(inner=P - plan.N, HV=HV, K=K, V=V, L=plan.L, sms=sms)
    assert cp._threshold(plan, calls[0][1], HV, K, V) == (cp.WARMUP_THRESHOLD if pays else None)
    assert_close("o", o, o0, tol=2e-2)
    assert_close("ht", ht, ht0, tol=2e-2)


def _capture(fn):
    """(graph, outputs): `fn` called once on a side stream (the warm-up), then captured there."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s):
        fn()
        with torch.cuda.graph(graph, stream=s):
            out = fn()
    torch.cuda.current_stream().wait_stream(s)
    return graph, out


def test_cp_graph_replays_with_new_lengths(monkeypatch):
    """The plan lives on the device: a graph captured with CP replays with other lengths (same N and T) and
    gives what an eager call with those lengths gives."""
    monkeypatch.setenv("FLASHDELTA_BACKEND", "sm90")
    x = make_inputs(GRAPH, dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():
        graph, (o_g, ht_g) = _capture(lambda: chunk_gated_delta_rule(**x, output_final_state=True, context_parallel=4))
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


# ----------------------------------------------------------------------------------------- the warm-up

SKIP_CASE = Case("cp-chunk-skip", (700, 1, 300, 0, 1300), H=2, HV=8, K=128, V=128, pad=5)


def _flat_inputs(x):
    B, T = x["q"].shape[:2]
    cu = x["cu_seqlens"] if x["cu_seqlens"] is not None else torch.arange(B + 1, dtype=torch.int32,
                                                                           device="cuda") * T
    flat = lambda t: t.reshape(1, B * T, *t.shape[2:])  # noqa: E731
    return flat(x["q"]), flat(x["k"]), flat(x["v"]), flat(x["g"]), flat(x["beta"]), cu


def test_summary_builds_equal_the_full_pass():
    """CP's summary builds (`zero_values`: no v read; `states_only`: no o; `transitions`: M and E in one launch)
    give bit for bit the final states the full pass gives a zero v tensor (M, from the identity) or v (E, from
    zero), with and without `chunk_skip` (with `transitions`, M's own skips), over ragged partitions; the full pass's
    o is unchanged by the flags' existence."""
    from flashdelta.kernels import fused_fwd, prepare

    x = make_inputs(SKIP_CASE, dtype=torch.bfloat16, device="cuda")
    q, k, v, g, beta, cu = _flat_inputs(x)
    g_cumsum, A = prepare.prepare_fwd(k, g, beta, cu)
    N, HV, K = cu.shape[0] - 1, SKIP_CASE.HV, SKIP_CASE.K
    eye = torch.eye(K, device="cuda").expand(N, HV, K, K).contiguous()
    zeros = v.new_zeros(1, v.shape[1], HV, K)
    nan = torch.full_like(zeros, float("nan"))
    skip = torch.randint(0, 14, (N, HV), generator=torch.Generator().manual_seed(3), dtype=torch.int32).cuda()
    for chunk_skip in (None, skip):
        kw = dict(scale=K ** -0.5, chunk_skip=chunk_skip)
        _, m0 = fused_fwd.chunk_fwd(q, k, zeros, g_cumsum, beta, A, eye, cu, **kw)
        for states_only in (False, True):
            o1, m1 = fused_fwd.chunk_fwd(q, k, nan, g_cumsum, beta, A, eye, cu, zero_values=True,
                                         states_only=states_only, **kw)
            assert torch.equal(m0, m1), ("M", states_only)
            assert (o1 is None) == states_only
        _, e0 = fused_fwd.chunk_fwd(q, k, v, g_cumsum, beta, A, None, cu, **kw)
        o2, e1 = fused_fwd.chunk_fwd(q, k, v, g_cumsum, beta, A, None, cu, states_only=True, **kw)
        assert o2 is None and torch.equal(e0, e1), "E"
        # M and E in one launch (`transitions`): the same walks; with the skips, M walks its own (here: other
        # chunks than E's, and none at all on some heads, whose M is then 0)
        skip_m = None if chunk_skip is None else torch.where(skip % 3 == 0, cp.SKIP_ALL, 13 - skip)
        o3, e2, m2 = fused_fwd.chunk_fwd(q, k, v, g_cumsum, beta, A, None, cu, states_only=True, transitions=True,
                                         transition_skip=skip_m, **kw)
        assert o3 is None and torch.equal(e2, e0), "E with transitions"
        if skip_m is None:
            assert torch.equal(m2, m0), "M with transitions"
        else:
            lens = (cu[1:] - cu[:-1])[:, None]
            walks = ((torch.clamp(skip_m.long(), min=0) * 64 < lens) | (lens == 0))[:, :, None, None]
            _, m3 = fused_fwd.chunk_fwd(q, k, zeros, g_cumsum, beta, A, torch.where(walks, eye, 0.0), cu,
                                        scale=K ** -0.5, chunk_skip=skip_m)
            assert torch.equal(m2, m3), "M with transitions and its own skips"
            assert (m2[~walks.expand_as(m2)] == 0).all()


def test_chunk_skip_kernel_matches_the_float64_twin():
    """The SM90 fused forward's `chunk_skip` builds (CP's M and E passes: with and without an initial state): the
    final state of each (sequence, head) walk from its skip on, and o on the walked chunks, against the float64
    twin of the stage with the same skips (bf16 PyTorch baseline); skips of 0, inside, past the end, negative."""
    from flashdelta.kernels import fused_fwd, prepare
    from flashdelta.reference import chunked as ref

    x = make_inputs(SKIP_CASE, dtype=torch.bfloat16, device="cuda")
    q, k, v, g, beta, cu = _flat_inputs(x)
    g_cumsum, A = prepare.prepare_fwd(k, g, beta, cu)
    N, HV = cu.shape[0] - 1, SKIP_CASE.HV
    gen = torch.Generator().manual_seed(7)
    skip = torch.randint(-2, 14, (N, HV), generator=gen, dtype=torch.int32)
    skip[0, 0], skip[4, 1], skip[4, 2] = cp.SKIP_ALL, 0, 3
    scale = SKIP_CASE.K ** -0.5
    cu_h = cu.tolist()
    walked = torch.zeros(1, q.shape[1], HV, 1, dtype=torch.bool)
    for n in range(N):
        for h in range(HV):
            start = min(cu_h[n] + max(int(skip[n, h]), 0) * 64, cu_h[n + 1])
            walked[0, start:cu_h[n + 1], h] = True
    for h0 in (x["initial_state"], None):
        o, ht = fused_fwd.chunk_fwd(q, k, v, g_cumsum, beta, A, h0, cu, scale=scale, chunk_skip=skip.cuda())
        args = [t.cpu() if t is not None else None for t in (q, k, v, g_cumsum, beta, A, h0)]
        o_ref, ht_ref = ref.chunk_fwd(*args, cu.cpu(), scale=scale, chunk_skip=skip)
        o_pt, ht_pt = portable.chunk_fwd(*args, cu.cpu(), scale=scale, chunk_skip=skip, compute_dtype=torch.float32,
                                         operand_dtype=torch.bfloat16)
        assert_close("ht", ht, ht_ref, baseline=ht_pt)
        assert torch.equal(ht[0, 0].cpu(), h0[0, 0].cpu() if h0 is not None else torch.zeros_like(ht_ref[0, 0]))
        mask = lambda t: torch.where(walked, t.detach().cpu().double(), 0.0)  # noqa: E731
        assert_close("o", mask(o), mask(o_ref), baseline=mask(o_pt))


WARM_CASES = [
    # (case, partition chunks): benchmark gates (~ -3.2 per chunk: 4-chunk windows at -10; heads 0, 1 exactly 0)
    (Case("cp-warm-bench-edges", (5000, 1, 700, 0, 130, 64), H=2, HV=8, K=128, V=128, gate="bench", pad=7), 8),
    (Case("cp-warm-bench-dense-vfirst", (4096, 4096), H=2, HV=8, K=128, V=128, varlen=False, state_v_first=True,
          gate="bench"), 16),
    (Case("cp-warm-model-noh0", (6000, 300), H=2, HV=8, K=128, V=128, h0=False), 12),
    (Case("cp-warm-bench-v256", (3000, 200), H=2, HV=8, K=128, V=256, gate="bench"), 6),
]


@pytest.mark.parametrize("case,L", WARM_CASES, ids=[c[0].name for c in WARM_CASES])
def test_cp_warmup_matches_reference_exact_and_serial(case, L, monkeypatch):
    """bf16 with the warm-up on (FLASHDELTA_CP_WARMUP=1: at these sizes `auto` finds it no faster): the windows on
    the GPU are the reference's (the never-decaying heads fall back, the others truncate), CP is no less accurate
    than serial against float64, and it agrees with the exact path (FLASHDELTA_CP_WARMUP=0) far inside the bf16
    tolerances (the truncation is <= e^-10 of the state)."""
    monkeypatch.setenv("FLASHDELTA_BACKEND", "sm90")
    x = make_inputs(case, dtype=torch.bfloat16, device="cuda")
    plans = []
    real = cp.cp_chunk_fwd
    monkeypatch.setattr(cp, "cp_chunk_fwd", lambda *a, **kw: plans.append(kw["plan"]) or real(*a, **kw))
    with torch.no_grad():
        o0, ht0 = chunk_gated_delta_rule(**x, output_final_state=True, context_parallel=False)
        monkeypatch.setenv(cp.ENV_WARMUP, "1")
        o1, ht1 = chunk_gated_delta_rule(**x, output_final_state=True, context_parallel=L)
        monkeypatch.setenv(cp.ENV_WARMUP, "0")
        o2, ht2 = chunk_gated_delta_rule(**x, output_final_state=True, context_parallel=L)
    assert [p.warmup for p in plans] == ["on", "off"]
    # the windows the call used, against the reference's on the same gates
    from flashdelta.kernels import prepare

    q, k, v, g, beta, cu = _flat_inputs(x)
    g_cumsum, _ = prepare.prepare_fwd(k, g, beta, cu)
    win = cp.windows(g_cumsum, k, beta, plans[0], cp.WARMUP_THRESHOLD)
    parts = rcp.partition(cu.cpu(), L)
    want = rcp.warmup_chunks(g_cumsum.cpu().double(), parts, threshold=cp.WARMUP_THRESHOLD, direction="fwd")
    assert torch.equal(win.n(L)[:parts.P].cpu(), want.n) and torch.equal(win.fallback[:parts.P].cpu(), want.fallback)
    inner = [p for p in range(parts.P) if not parts.last[p]]
    assert bool(want.fallback[inner, 0].all()), "head 0 never decays (both gate kinds): the exact path"
    assert bool(((want.n[inner] < L) & ~want.fallback[inner]).any()), "the case must truncate"
    o_ref, ht_ref, o_pt, ht_pt = _reference(x)
    err_o = assert_close("o", o1, o_ref, baseline=o_pt)
    err_ht = assert_close("ht", ht1, ht_ref, baseline=ht_pt)
    ser_o, ser_ht = assert_close("o", o0, o_ref), assert_close("ht", ht0, ht_ref)
    exact_o = assert_close("o", o2, o_ref)
    print(f"{case.name}: warm-up err o {err_o:.3e} ht {err_ht:.3e}; exact CP o {exact_o:.3e}; serial o {ser_o:.3e} "
          f"ht {ser_ht:.3e}; windows {want.n[inner][~want.fallback[inner]].float().mean():.2f} chunks, fallback "
          f"{want.fallback[inner].float().mean():.2f}")
    assert err_o <= 1.5 * ser_o + 1e-4 and err_ht <= 1.5 * ser_ht + 1e-4, "CP no less accurate than serial"
    assert_close("o", o1, o2, tol=1e-3)
    assert_close("ht", ht1, ht2, tol=1e-3)
    if case.pad:
        assert torch.all(o1[:, -case.pad:] == 0)


@pytest.mark.parametrize("case,L", WARM_CASES, ids=[c[0].name for c in WARM_CASES])
def test_overlapped_output_pass_equals_one_launch(case, L, monkeypatch):
    """The warm-up forward's output pass in two launches beside each other (`cp._output_overlapped`: the exact
    heads' summaries, masked scan and output pass on the side stream, the warm-up heads' window E pass and output
    pass on the current one, into one o) gives the one-launch path's o and final state bit for bit: the same
    kernels' state chain, and the scan's step for a warm-up head is E_p + 0."""
    monkeypatch.setenv("FLASHDELTA_BACKEND", "sm90")
    monkeypatch.setenv(cp.ENV_WARMUP, "1")
    x = make_inputs(case, dtype=torch.bfloat16, device="cuda")
    calls, real = [], cp._output_overlapped
    monkeypatch.setattr(cp, "_output_overlapped", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    with torch.no_grad():
        o1, ht1 = chunk_gated_delta_rule(**x, output_final_state=True, context_parallel=L)
        assert calls, "the warm-up forward takes the overlapped output pass"
        monkeypatch.setattr(cp, "_overlaps", lambda *a: False)
        o0, ht0 = chunk_gated_delta_rule(**x, output_final_state=True, context_parallel=L)
    assert len(calls) == 1
    assert torch.equal(o1, o0), f"o: max diff {float((o1.float() - o0.float()).abs().max()):.3g}"
    assert torch.equal(ht1, ht0), f"ht: max diff {float((ht1 - ht0).abs().max()):.3g}"


@pytest.mark.parametrize("case,L", WARM_CASES[:2], ids=[c[0].name for c in WARM_CASES[:2]])
def test_overlapped_training_forward_equals_one_launch(case, L, monkeypatch):
    """The training forward's overlapped output pass (`cp._output_overlapped(save_states=True)`: both output
    launches write their chunks' states into one tensor, `chunk_fwd(states_out=...)`) saves the states the one-launch
    pass saves: o, the final state and every gradient (the backward reads the saved states) bit for bit."""
    monkeypatch.setenv("FLASHDELTA_BACKEND", "sm90")
    monkeypatch.setenv("FLASHDELTA_SAVE_STATES", "1")
    monkeypatch.setenv(cp.ENV_WARMUP, "1")
    x = make_inputs(case, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    names = [n for n in GRAD_INPUTS if x.get(n) is not None]
    leaves = [x[n] for n in names]
    gen = torch.Generator(device="cuda").manual_seed(3)
    do = torch.randn(x["v"].shape, generator=gen, device="cuda").bfloat16()
    calls, real = [], cp._output_overlapped
    monkeypatch.setattr(cp, "_output_overlapped", lambda *a, **kw: calls.append(kw["save_states"]) or real(*a, **kw))
    runs = []
    for overlap in (True, False):
        if not overlap:
            monkeypatch.setattr(cp, "_overlaps", lambda *a: False)
        o, ht = chunk_gated_delta_rule(**x, output_final_state=True, context_parallel=L)
        runs.append((o, ht) + torch.autograd.grad((o, ht), leaves, (do, torch.ones_like(ht))))
    assert calls == [True], "the training forward takes the overlapped output pass once, saving the states"
    for name, a, b in zip(("o", "ht", *names), runs[0], runs[1]):
        assert torch.equal(a, b), f"{name}: max diff {float((a.float() - b.float()).abs().max()):.3g}"


WARM_GRAPH = Case("cp-warm-graph", (3000, 1, 2000), H=2, HV=8, K=128, V=128, pad=11, gate="bench")


def test_cp_warmup_graph_replays_with_new_lengths(monkeypatch):
    """The windows live on the device: a graph captured with the warm-up (benchmark gates, 8-chunk partitions)
    replays with other lengths and gates (same N and T) and gives what an eager call gives."""
    monkeypatch.setenv("FLASHDELTA_BACKEND", "sm90")
    monkeypatch.setenv(cp.ENV_WARMUP, "1")
    x = make_inputs(WARM_GRAPH, dtype=torch.bfloat16, device="cuda")
    other = make_inputs(WARM_GRAPH, dtype=torch.bfloat16, device="cuda", seed=1)
    with torch.no_grad():
        graph, (o_g, ht_g) = _capture(lambda: chunk_gated_delta_rule(**x, output_final_state=True, context_parallel=8))
        for cu, gates in (([0, 10, 4000, 5001], x["g"]), ([0, 2500, 2600, 4900], other["g"] * 0.5),
                          ([0, 0, 5001, 5001], other["g"] * 3.0)):
            x["cu_seqlens"].copy_(torch.tensor(cu, dtype=torch.int32))
            x["g"].copy_(gates.clone())
            graph.replay()
            torch.cuda.synchronize()
            o_e, ht_e = chunk_gated_delta_rule(**x, output_final_state=True, context_parallel=8)
            o_s, ht_s = chunk_gated_delta_rule(**x, output_final_state=True, context_parallel=False)
            assert torch.equal(o_g, o_e) and torch.equal(ht_g, ht_e), cu
            assert_close("o", o_g, o_s, tol=2e-2)
            assert_close("ht", ht_g, ht_s, tol=2e-2)


# ----------------------------------------------------------------------------------------- backward

BWD_CASES = [
    # (case, partition chunks); dht present in the even rows, absent (autograd's zeros) in the odd ones
    (Case("cp-bwd-edges", (2000, 1, 700, 0, 130, 64), H=2, HV=8, K=128, V=128, pad=7), 4),
    (Case("cp-bwd-bench-vfirst-noh0", (1500, 900), H=2, HV=8, K=128, V=128, state_v_first=True, h0=False,
          gate="bench"), 3),
    (Case("cp-bwd-dense-zero-gate", (1024, 1024), H=4, HV=4, K=128, V=128, varlen=False, gate="zero"), 4),
    (Case("cp-bwd-k64-short", (1200, 3, 40), H=2, HV=4, K=64, V=64), 5),
]
GRAD_INPUTS = ("q", "k", "v", "g", "beta", "initial_state")
GRAD_NAMES = {"q": "dq", "k": "dk", "v": "dv", "g": "dg", "beta": "dbeta", "initial_state": "dh0"}


def _loss_grads(x, o, ht, do, dht):
    acc = torch.float64 if o.dtype == torch.float64 else torch.float32
    loss = (o.to(acc) * do.to(acc)).sum()
    if dht is not None:
        loss = loss + (ht.to(acc) * dht.to(acc)).sum()
    names = [n for n in GRAD_INPUTS if x[n] is not None]
    return dict(zip(names, torch.autograd.grad(loss, [x[n] for n in names])))


def _cp_grads(x, cpv, do, dht):
    x = {n: (t.detach().requires_grad_(True) if torch.is_tensor(t) and t.is_floating_point() else t)
         for n, t in x.items()}
    o, ht = chunk_gated_delta_rule(**x, output_final_state=True, context_parallel=cpv)
    return o, _loss_grads(x, o, ht, do, dht)


def _bwd_inputs(case, with_dht: bool):
    """(inputs, do, dht or None) of a backward case, bf16 on the GPU."""
    x = make_inputs(case, dtype=torch.bfloat16, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(3)
    do = torch.randn(x["v"].shape, generator=gen, device="cuda").bfloat16()
    N = len(case.seqlens)
    shape = (N, case.HV, case.V, case.K) if case.state_v_first else (N, case.HV, case.K, case.V)
    return x, do, torch.randn(shape, generator=gen, device="cuda") if with_dht else None


# what the forward saves for the split backward, per mode: (partition start states, chunk states)
SAVED_BY_MODE = {"fwd_split": (False, True), "fwd_split_recompute": (False, False), "fwd_serial": (False, True),
                 "fwd_serial_starts": (True, False)}


@pytest.mark.parametrize("mode", list(SAVED_BY_MODE))
@pytest.mark.parametrize("i", range(len(BWD_CASES)), ids=[c.name for c, _ in BWD_CASES])
def test_cp_backward_matches_recurrence_and_serial(i, mode, monkeypatch):
    """With the forward split too (its output pass saves every chunk state over the whole sequences,
    `cp.cp_chunk_fwd(save_states=True)`, and chunk_bwd reads them over the partitions: `h_seqs`), the same under
    FLASHDELTA_SAVE_STATES=0 (the backward computes its partitions' start states and recomputes the chunk states),
    with the forward serial (it saves every chunk state, `chunk_fwd(save_states=True)`), and with the forward serial
    under FLASHDELTA_SAVE_STATES=0 (it saves the partitions' start states, `chunk_fwd(partition_starts=...)`, and the
    backward recomputes the chunk states from them)."""
    from flashdelta.reference.recurrent import recurrent_gated_delta_rule

    case, L = BWD_CASES[i]
    monkeypatch.setenv("FLASHDELTA_BACKEND", "sm90")
    monkeypatch.setenv("FLASHDELTA_SAVE_STATES", "1" if SAVED_BY_MODE[mode][1] else "0")
    x, do, dht = _bwd_inputs(case, with_dht=i % 2 == 0)
    _, ser = _cp_grads(x, False, do, dht)
    calls = []
    if mode.startswith("fwd_split"):
        real = cp.cp_chunk_bwd
        monkeypatch.setattr(cp, "cp_chunk_bwd", lambda *a, **kw: calls.append(
            (kw["plan"].L, kw.get("starts"), kw.get("states"))) or real(*a, **kw))
    else:
        calls = split_backward_only(monkeypatch)
    o, got = _cp_grads(x, L, do, dht)
    assert [c[0] for c in calls] == [L], "the backward split"
    _, starts, states = calls[0]
    assert (starts is not None, states is not None) == SAVED_BY_MODE[mode], "what the forward saved"
    x64 = {n: (t.detach().double().requires_grad_(True) if torch.is_tensor(t) and t.is_floating_point() else t)
           for n, t in x.items()}
    o_ref, ht_ref = recurrent_gated_delta_rule(**x64, output_final_state=True)
    want = _loss_grads(x64, o_ref, ht_ref, do, dht)
    for n in got:
        name = GRAD_NAMES[n]
        assert got[n].dtype == x[n].dtype, f"{name} must come back in {n}'s dtype"
        err = assert_close(name, got[n], want[n])
        err_ser = assert_close(name, ser[n], want[n])
        print(f"{case.name} {name}: CP {err:.3e} serial {err_ser:.3e}")
        assert err <= 1.5 * err_ser + 1e-4, f"{name}: CP no less accurate than serial"
        assert_close(name, got[n], ser[n], tol=2e-2)
    if case.pad:
        for n in ("q", "k", "v", "g", "beta"):
            assert torch.all(got[n][:, -case.pad:] == 0), f"{GRAD_NAMES[n]} on the padding tail must be 0"


SIDE_CASES = [(BWD_CASES[0][0], 4), (Case("cp-bwd-side-warm", (3000, 1, 2000), H=2, HV=8, K=128, V=128, pad=11,
                                             gate="bench"), 4)]


@pytest.mark.parametrize("mode", ["fwd_split", "fwd_serial"])
@pytest.mark.parametrize("i", range(len(SIDE_CASES)), ids=[c.name for c, _ in SIDE_CASES])
def test_side_stream_backward_equals_one_stream(i, mode, monkeypatch):
    """chunk_dstate on the side stream beside the M pass (`streams.fork` in `cp.cp_chunk_bwd`) gives the gradients
    of the same backward on one stream bit for bit (the same kernels on disjoint outputs; a missing join would let
    the reverse scan read F before chunk_dstate wrote it), exact and with the warm-up's windows."""
    from flashdelta import streams

    case, L = SIDE_CASES[i]
    monkeypatch.setenv("FLASHDELTA_BACKEND", "sm90")
    if mode == "fwd_serial":
        split_backward_only(monkeypatch)
    x, do, dht = _bwd_inputs(case, with_dht=True)
    forks, fork = [], streams.fork
    monkeypatch.setattr(streams, "fork", lambda device, **kw: forks.append(fork(device, **kw)) or forks[-1])
    _, side = _cp_grads(x, L, do, dht)
    assert forks and all(s is not None for s in forks), "the backward forks the side stream"
    monkeypatch.setattr(streams, "fork", lambda device, **kw: None)
    _, one = _cp_grads(x, L, do, dht)
    for n in one:
        assert torch.equal(side[n], one[n]), f"{GRAD_NAMES[n]}: side stream vs one stream"


AUTO_BWD = Case("cp-auto-bwd", (8192,), H=16, HV=32, K=128, V=128)


def test_auto_splits_the_backward_alone(monkeypatch):
    """16/32 1x8192: the forward fills 64 CTAs and stays serial (and saves every chunk state, which the split
    backward reads); the backward (32 CTAs of 128 chunks, ~11 us each) splits."""
    monkeypatch.delenv(cp.ENV_CP, raising=False)
    monkeypatch.delenv("FLASHDELTA_BACKEND", raising=False)
    x = make_inputs(AUTO_BWD, dtype=torch.bfloat16, device="cuda")
    fwd, bwd = [], []
    real_f, real_b = cp.cp_chunk_fwd, cp.cp_chunk_bwd
    monkeypatch.setattr(cp, "cp_chunk_fwd", lambda *a, **kw: fwd.append(kw["plan"].L) or real_f(*a, **kw))
    monkeypatch.setattr(cp, "cp_chunk_bwd", lambda *a, **kw: bwd.append(kw["plan"].L) or real_b(*a, **kw))
    gen = torch.Generator(device="cuda").manual_seed(3)
    do = torch.randn(x["v"].shape, generator=gen, device="cuda").bfloat16()
    plans = []
    monkeypatch.setattr(cp, "cp_chunk_bwd", lambda *a, **kw: bwd.append(kw["plan"].L) or plans.append(
        (kw["plan"], kw.get("starts"), kw.get("states"))) or real_b(*a, **kw))
    monkeypatch.delenv("FLASHDELTA_SAVE_STATES", raising=False)
    _, auto = _cp_grads(x, None, do, None)
    assert fwd == [] and len(bwd) == 1 and bwd[0] > 0, (fwd, bwd)
    plan, starts, states = plans[0]
    assert plan.warmup == "auto"
    T, N = sum(AUTO_BWD.seqlens), len(AUTO_BWD.seqlens)
    assert starts is None and states is not None and states.shape == (T // 64 + N + 1, AUTO_BWD.HV, AUTO_BWD.V,
                                                                       AUTO_BWD.K), "the serial forward's chunk states"
    _, off = _cp_grads(x, False, do, None)
    for n in auto:
        assert_close(GRAD_NAMES[n], auto[n], off[n], tol=2e-2)


STARTS_CASES = [Case("cp-starts-one", (2000,), H=2, HV=8, K=128, V=128),
                Case("cp-starts-varlen", (700, 1, 0, 300, 1300), H=2, HV=8, K=128, V=128, pad=5, h0=False)]


@pytest.mark.parametrize("case", STARTS_CASES, ids=[c.name for c in STARTS_CASES])
def test_partition_starts_kernel(case):
    """`chunk_fwd(partition_starts=(L, slot, P))` on the SM90 kernel: o and the final state bit for bit the plain
    build's; each partition start state bit for bit the final state of the same walk cut at that chunk (one
    sequence: cu_seqlens ending there, the rest a padding tail), and against the float64 twin's (portable,
    float64) at fp32 state rounding; slots no sequence owns are 0; the initial state (or 0) at each first slot,
    an empty sequence's included."""
    from flashdelta.kernels import fused_fwd, prepare

    x = make_inputs(case, dtype=torch.bfloat16, device="cuda")
    q, k, v, g, beta, cu = _flat_inputs(x)
    h0 = x["initial_state"]
    g_cumsum, A = prepare.prepare_fwd(k, g, beta, cu)
    L = 3
    plan = cp.make_plan(cu, q.shape[1], L)
    kw = dict(scale=case.K ** -0.5)
    o0, ht0 = fused_fwd.chunk_fwd(q, k, v, g_cumsum, beta, A, h0, cu, **kw)
    o, ht, starts = fused_fwd.chunk_fwd(q, k, v, g_cumsum, beta, A, h0, cu, partition_starts=(L, plan.first_index,
                                                                                               plan.P), **kw)
    assert torch.equal(o, o0) and torch.equal(ht, ht0)
    parts = rcp.partition(cu, L)
    used = len(parts.seq)
    assert not starts[used:].any()
    if len(case.seqlens) == 1:
        for j in range(used):
            cut = torch.tensor([0, j * L * 64], dtype=torch.int32, device="cuda")
            _, hj = fused_fwd.chunk_fwd(q, k, v, g_cumsum, beta, A, h0, cut, **kw)
            assert torch.equal(starts[j], hj[0]), j
    f64 = {n: t.double() for n, t in dict(q=q, k=k, v=v, beta=beta).items()}
    _, _, want = portable.chunk_fwd(f64["q"], f64["k"], f64["v"], g_cumsum.double(), f64["beta"], A.double(),
                                    None if h0 is None else h0.double(), cu, partition_starts=(L, plan.first_index,
                                                                                              plan.P), **kw)
    assert_close("starts", starts[:used], want[:used].float(), tol=2e-2)


@pytest.mark.parametrize("case", STARTS_CASES, ids=[c.name for c in STARTS_CASES])
def test_output_pass_saves_the_states_over_the_sequences(case):
    """`chunk_fwd(save_states=True, state_seqs=(plan.seq, plan.N))` over CP's partitions (the split training
    forward's output pass): o and the final states bit for bit the plain output pass's, and every chunk's state bit
    for bit what `state_recompute` over the partitions writes for it, at the slot `state_recompute` over the whole
    sequences uses (partition p of sequence n: its chunk c at ``cu[p] // 64 + n + c``, not ``+ p + c``)."""
    from flashdelta.kernels import fused_fwd, prepare

    x = make_inputs(case, dtype=torch.bfloat16, device="cuda")
    q, k, v, g, beta, cu = _flat_inputs(x)
    g_cumsum, A = prepare.prepare_fwd(k, g, beta, cu)
    plan = cp.make_plan(cu, q.shape[1], 3)
    HV, K, V = case.HV, case.K, case.V
    H = torch.randn(plan.P, HV, K, V, generator=torch.Generator(device="cuda").manual_seed(11), device="cuda")
    kw = dict(scale=K ** -0.5)
    o0, ht0 = fused_fwd.chunk_fwd(q, k, v, g_cumsum, beta, A, H, plan.cu, **kw)
    o, ht, hs = fused_fwd.chunk_fwd(q, k, v, g_cumsum, beta, A, H, plan.cu, save_states=True,
                                    state_seqs=(plan.seq, plan.N), **kw)
    assert torch.equal(o, o0) and torch.equal(ht, ht0)
    N = cu.shape[0] - 1
    assert tuple(hs.shape) == (q.shape[1] // 64 + N + 1, HV, V, K)
    want = fused_fwd.state_recompute(k, v, g_cumsum, beta, A, H, plan.cu)
    cu_p, seq = plan.cu.tolist(), plan.seq.tolist()
    chunks = 0
    for p in range(plan.P):
        for c in range(-(-(cu_p[p + 1] - cu_p[p]) // 64)):
            assert torch.equal(hs[cu_p[p] // 64 + seq[p] + c], want[cu_p[p] // 64 + p + c]), (p, c)
            chunks += 1
    assert chunks == sum(-(-n // 64) for n in case.seqlens), "every chunk of every sequence, once"


BWD_GRAPH = Case("cp-bwd-graph", (3000, 1, 2000), H=2, HV=8, K=128, V=128, pad=11)
BWD_WARM_GRAPH = Case("cp-bwd-warm-graph", (3000, 1, 2000), H=2, HV=8, K=128, V=128, pad=11, gate="bench")


@pytest.mark.parametrize("warm,fwd_split,save_states", [(False, True, "1"), (False, True, "0"), (True, True, "1"),
                                                        (False, False, "1"), (False, False, "0")],
                         ids=["exact", "exact-recompute", "warmup", "exact-fwd-serial", "exact-fwd-serial-starts"])
def test_cp_forward_backward_graph_replays_with_new_lengths(warm, fwd_split, save_states, monkeypatch):
    """Forward + backward with CP in both passes captured in one CUDA graph (no host synchronisation), replayed
    with new lengths (same N and T): the gradients equal an eager step's with those lengths, and CP off's to
    rounding. With the warm-up on in both passes (FLASHDELTA_CP_WARMUP=1, benchmark gates: the backward's windows
    on the device) the replays also take new gates. The forward, split or serial (`fwd_split` False), saves every
    chunk state inside the graph; with FLASHDELTA_SAVE_STATES=0 the split one saves nothing (the backward computes
    its start states and recomputes the chunk states) and the serial one the backward's partition start states (its
    plan kernel and start-state stores)."""
    monkeypatch.setenv("FLASHDELTA_BACKEND", "sm90")
    monkeypatch.setenv("FLASHDELTA_SAVE_STATES", save_states)
    monkeypatch.setenv(cp.ENV_WARMUP, "1" if warm else "auto")
    case = BWD_WARM_GRAPH if warm else BWD_GRAPH
    x = make_inputs(case, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    other = make_inputs(case, dtype=torch.bfloat16, device="cuda", seed=1)
    leaves = [x[n] for n in GRAD_INPUTS]
    gen = torch.Generator(device="cuda").manual_seed(5)
    do = torch.randn(x["v"].shape, generator=gen, device="cuda").bfloat16()
    calls = []
    if fwd_split:
        real = cp.cp_chunk_bwd
        monkeypatch.setattr(cp, "cp_chunk_bwd", lambda *a, **kw: calls.append((kw["plan"].L, kw["plan"].warmup))
                            or real(*a, **kw))
    else:
        starts = split_backward_only(monkeypatch)

    def step(cpv=4):
        o, ht = chunk_gated_delta_rule(**x, output_final_state=True, context_parallel=cpv)
        return (o,) + torch.autograd.grad((o, ht), leaves, (do, torch.ones_like(ht)))

    graph, g_graph = _capture(step)
    if fwd_split:
        assert calls == [(4, "on" if warm else "auto")] * 2
    else:
        saved = [t[1 if save_states == "0" else 2] for t in starts]
        assert [t[0] for t in starts] == [4, 4] and all(t is not None for t in saved), "what the forward saved"
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(g_graph, step()))
    gates = (x["g"].detach().clone(), other["g"] * 0.5, other["g"] * 3.0) if warm else (x["g"].detach().clone(),) * 3
    for cu, g in zip(([0, 10, 4000, 5001], [0, 0, 5001, 5001], [0, 2500, 2600, 4900]), gates):   # same N and T
        with torch.no_grad():
            x["cu_seqlens"].copy_(torch.tensor(cu, dtype=torch.int32))
            x["g"].copy_(g)
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(g_graph, step())), cu
        for name, a, b in zip(("o",) + tuple(GRAD_NAMES[n] for n in GRAD_INPUTS), g_graph, step(False)):
            assert_close(name, a, b, tol=2e-2)


AUTO_GRAPH = Case("cp-auto-graph", (20000, 1, 12000), H=2, HV=8, K=128, V=128, pad=11)


def test_auto_graph_from_host_lengths_replays_with_new_lengths(monkeypatch):
    """``context_parallel=None`` with ``cu_seqlens_cpu`` under CUDA-graph capture: the automatic decision comes from
    the host copy's lengths, no device value read (both passes split here, where lengths taken as equal would leave
    the forward serial); forward and backward captured in one graph replay with new lengths (same N and T; the
    plan's buffers are sized from T, N and the captured L, the host copy is not read again) and equal an eager step
    with the captured decision, and CP off's to rounding."""
    monkeypatch.setenv("FLASHDELTA_BACKEND", "sm90")
    monkeypatch.delenv(cp.ENV_CP, raising=False)
    monkeypatch.delenv(cp.ENV_WARMUP, raising=False)
    x = make_inputs(AUTO_GRAPH, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    x["cu_seqlens_cpu"] = x["cu_seqlens"].cpu()
    leaves = [x[n] for n in GRAD_INPUTS]
    gen = torch.Generator(device="cuda").manual_seed(5)
    do = torch.randn(x["v"].shape, generator=gen, device="cuda").bfloat16()
    codes, fwd, bwd = [], [], []
    real_decide, real_f, real_b = cp.decide, cp.cp_chunk_fwd, cp.cp_chunk_bwd
    monkeypatch.setattr(cp, "decide", lambda *a, **kw: codes.append(real_decide(*a, **kw)) or codes[-1])
    monkeypatch.setattr(cp, "cp_chunk_fwd", lambda *a, **kw: fwd.append(kw["plan"].L) or real_f(*a, **kw))
    monkeypatch.setattr(cp, "cp_chunk_bwd", lambda *a, **kw: bwd.append(kw["plan"].L) or real_b(*a, **kw))

    def step(cpv=None):
        o, ht = chunk_gated_delta_rule(**x, output_final_state=True, context_parallel=cpv)
        return (o,) + torch.autograd.grad((o, ht), leaves, (do, torch.ones_like(ht)))

    graph, g_graph = _capture(step)                     # a call on the side stream, then the capture
    kw = dict(T=x["q"].shape[1], N=len(AUTO_GRAPH.seqlens), HV=AUTO_GRAPH.HV, K=AUTO_GRAPH.K, V=AUTO_GRAPH.V,
              sms=cp.num_sms(x["q"].device))
    want = cp.auto_lengths(**kw, lengths=list(AUTO_GRAPH.seqlens))
    assert min(want) > 0 and cp.auto_lengths(**kw)[0] == 0, "the host lengths decide"
    assert codes == [cp.encode(*want)] * 2 and fwd == [want[0]] * 2 and bwd == [want[1]] * 2, (codes, fwd, bwd)
    monkeypatch.setattr(cp, "decide", lambda *a, **kw: codes[0])    # the eager steps take the captured decision
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(g_graph, step()))
    for cu in ([0, 10, 20000, 32001], [0, 0, 32001, 32001], [0, 16000, 16100, 31000]):   # same N and T
        with torch.no_grad():
            x["cu_seqlens"].copy_(torch.tensor(cu, dtype=torch.int32))
        x["cu_seqlens_cpu"] = torch.tensor(cu, dtype=torch.int32)        # the eager steps' (the graph reads none)
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(g_graph, step())), cu
        for name, a, b in zip(("o",) + tuple(GRAD_NAMES[n] for n in GRAD_INPUTS), g_graph, step(False)):
            assert_close(name, a, b, tol=2e-2)


# ----------------------------------------------------------------------------------------- the backward's warm-up

TAKE_CASE = Case("cp-chunk-take", (700, 1, 300, 0, 1300), H=2, HV=8, K=128, V=128, pad=5)


def test_chunk_take_kernel_matches_the_float64_twin():
    """The SM90 chunk_dstate's `chunk_take` build (the backward warm-up's F pass): the start gradient of each
    (sequence, head) walk over its first `take` chunks against the float64 twin with the same takes (bf16 PyTorch
    baseline); takes of 0, inside, past the end, negative, `TAKE_ALL`; the default build gives the whole walk."""
    from flashdelta.kernels import chunk_dstate as cds
    from flashdelta.kernels import prepare
    from flashdelta.reference import chunked as ref

    x = make_inputs(TAKE_CASE, dtype=torch.bfloat16, device="cuda")
    q, k, v, g, beta, cu = _flat_inputs(x)
    g_cumsum, A = prepare.prepare_fwd(k, g, beta, cu)
    gen = torch.Generator(device="cuda").manual_seed(9)
    do = torch.randn(v.shape, generator=gen, device="cuda").bfloat16()
    N, HV = cu.shape[0] - 1, TAKE_CASE.HV
    take = torch.randint(-2, 24, (N, HV), generator=torch.Generator().manual_seed(7), dtype=torch.int32)
    take[0, 0], take[4, 1], take[4, 2], take[2, 3] = cp.TAKE_ALL, 0, 3, 1
    scale = TAKE_CASE.K ** -0.5
    got = cds.chunk_dstate(q, k, g_cumsum, beta, A, do, cu, scale=scale, chunk_take=take.cuda())
    args = [t.cpu() for t in (q, k, g_cumsum, beta, A, do)]
    want = ref.chunk_dstate(*args, cu.cpu(), scale=scale, chunk_take=take)
    base = portable.chunk_dstate(*args, cu.cpu(), scale=scale, chunk_take=take, compute_dtype=torch.float32,
                                 operand_dtype=torch.bfloat16)
    assert_close("dh0", got, want, baseline=base)
    assert torch.equal(got[4, 1].cpu(), torch.zeros_like(got[4, 1].cpu())), "take 0: nothing walked"
    whole = cds.chunk_dstate(q, k, g_cumsum, beta, A, do, cu, scale=scale)
    assert_close("dh0", got[0, 0], whole[0, 0], tol=1e-6)         # TAKE_ALL: the default build's walk


BWD_WARM_CASES = [
    # (case, partition chunks): benchmark gates (~ -3.2 per chunk: 4-chunk windows at -10; heads 0, 1 exactly 0);
    # dht present in the even rows, absent in the odd ones
    (Case("cp-bwd-warm-bench-edges", (5000, 1, 700, 0, 130, 64), H=2, HV=8, K=128, V=128, gate="bench", pad=7), 8),
    (Case("cp-bwd-warm-bench-dense-vfirst-noh0", (3072, 3072), H=2, HV=8, K=128, V=128, varlen=False,
          state_v_first=True, h0=False, gate="bench"), 12),
    (Case("cp-bwd-warm-model", (6000, 300), H=2, HV=8, K=128, V=128), 12),
    (Case("cp-bwd-warm-bench-k64", (3000, 200), H=2, HV=4, K=64, V=64, gate="bench"), 6),
]


@pytest.mark.parametrize("i", range(len(BWD_WARM_CASES)), ids=[c.name for c, _ in BWD_WARM_CASES])
def test_cp_backward_warmup_matches_recurrence_exact_and_serial(i, monkeypatch):
    """bf16 with the warm-up on in both passes (FLASHDELTA_CP_WARMUP=1): the backward's windows on the GPU are the
    reference's (the never-decaying heads fall back, the others truncate), every gradient is no less accurate than
    the serial backward's against float64 autograd of the recurrence, and it agrees with the exact path
    (FLASHDELTA_CP_WARMUP=0) far inside the bf16 tolerances (the truncation is <= e^-10 of the gradient)."""
    from flashdelta.kernels import prepare
    from flashdelta.reference.recurrent import recurrent_gated_delta_rule

    case, L = BWD_WARM_CASES[i]
    monkeypatch.setenv("FLASHDELTA_BACKEND", "sm90")
    x, do, dht = _bwd_inputs(case, with_dht=i % 2 == 0)
    plans = []
    real = cp.cp_chunk_bwd
    monkeypatch.setattr(cp, "cp_chunk_bwd", lambda *a, **kw: plans.append(kw["plan"]) or real(*a, **kw))
    _, ser = _cp_grads(x, False, do, dht)
    monkeypatch.setenv(cp.ENV_WARMUP, "1")
    _, warm = _cp_grads(x, L, do, dht)
    monkeypatch.setenv(cp.ENV_WARMUP, "0")
    _, exact = _cp_grads(x, L, do, dht)
    assert [p.warmup for p in plans] == ["on", "off"]
    q, k, v, g, beta, cu = _flat_inputs(x)
    g_cumsum, _ = prepare.prepare_fwd(k, g, beta, cu)
    win = cp.grad_windows(g_cumsum, k, beta, plans[0], cp.WARMUP_THRESHOLD)
    parts = rcp.partition(cu.cpu(), L)
    want_win = rcp.warmup_chunks(g_cumsum.cpu().double(), parts, threshold=cp.WARMUP_THRESHOLD, direction="bwd")
    assert torch.equal(win.n(plans[0])[:parts.P].cpu(), want_win.n)
    assert torch.equal(win.fallback[:parts.P].cpu(), want_win.fallback)
    cont = [p for p in range(parts.P) if not parts.first[p]]
    assert bool(want_win.fallback[cont, 0].all()), "head 0 never decays (both gate kinds): the exact path"
    assert bool(((want_win.n[cont] < L) & ~want_win.fallback[cont]).any()), "the case must truncate"
    x64 = {n: (t.detach().double().requires_grad_(True) if torch.is_tensor(t) and t.is_floating_point() else t)
           for n, t in x.items()}
    o_ref, ht_ref = recurrent_gated_delta_rule(**x64, output_final_state=True)
    want = _loss_grads(x64, o_ref, ht_ref, do, dht)
    for n in warm:
        name = GRAD_NAMES[n]
        err, err_ser = assert_close(name, warm[n], want[n]), assert_close(name, ser[n], want[n])
        err_exact = assert_close(name, exact[n], want[n])
        print(f"{case.name} {name}: warm-up {err:.3e} exact CP {err_exact:.3e} serial {err_ser:.3e}")
        assert err <= 1.5 * err_ser + 1e-4, f"{name}: CP with the warm-up no less accurate than serial"
        assert_close(name, warm[n], exact[n], tol=1e-3)
    if case.pad:
        for n in ("q", "k", "v", "g", "beta"):
            assert torch.all(warm[n][:, -case.pad:] == 0), f"{GRAD_NAMES[n]} on the padding tail must be 0"
