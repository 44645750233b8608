"""Stages `state_recompute` and `chunk_bwd` on a Hopper GPU against their float64 twins.

`chunk_bwd` is tested on its own first: g_cumsum, A and the per-chunk states come from the float64 reference. A is
rounded as the SM90 prepare stores it (the input dtype) for the reference, the baseline (the portable path with GEMM
operands rounded to the input dtype) and the kernel alike; the kernel gets the states rounded as the SM90 state
recompute stores them (the input dtype, `slot_states`), the reference and the baseline get them in float64 (the
baseline rounds them as a GEMM operand). Outputs are NaN-poisoned (conftest): every gradient on the padding tail must
be exactly 0. The public API's backward on the sm90 backend follows (end to end).
"""
import copy

import cases
import pytest
import torch
from _helpers import Case, assert_close, make_inputs

from flashdelta import portable
from flashdelta.kernels import chunk_bwd as cb
from flashdelta.kernels import chunk_dstate as cds
from flashdelta.reference import chunked as ref

BT = 64


def _slots(cu):
    """(slot, global chunk) pairs: chunk c of sequence n at slot cu[n] // BT + n + c (docs/stages.md)."""
    cu = cu.tolist()
    out, g = [], 0
    for n in range(len(cu) - 1):
        for c in range(-(-(cu[n + 1] - cu[n]) // BT)):
            out.append((cu[n] // BT + n + c, g))
            g += 1
    return out


def slot_states(h, cu, T, state_v_first, dtype):
    """Per-chunk states [NT, HV, K, V] (state layout; global chunk order) -> the SM90 layout [T // BT + N + 1, HV, V,
    K] (transposed states at their chunk slots)."""
    hv_first = h if state_v_first else h.transpose(-1, -2)
    out = torch.zeros((T // BT + cu.shape[0],) + tuple(hv_first.shape[1:]), dtype=dtype, device=h.device)
    for slot, g in _slots(cu):
        out[slot] = hv_first[g].to(dtype)
    return out


def _inputs(case, seed=0):
    c = Case(case.name, case.seqlens, H=case.H, HV=case.HV, K=case.K, V=case.V, pad=case.pad, h0=case.h0,
             state_v_first=case.state_v_first, gate=case.gate)
    x = make_inputs(c, dtype=case.dtype, device="cuda", seed=seed)
    beta = x["beta"].to(case.beta_dtype)
    cu = x["cu_seqlens"]
    g_cumsum, A = ref.prepare_fwd(x["k"], x["g"], beta, cu)
    A = A.to(case.dtype)
    g_cumsum = g_cumsum.float()
    h = ref.state_recompute(x["k"], x["v"], g_cumsum, beta, A, x["initial_state"], cu,
                            state_v_first=case.state_v_first)
    gen = torch.Generator(device="cuda").manual_seed(seed + 1)
    T = x["q"].shape[1]
    do = torch.randn(1, T, case.HV, case.V, generator=gen, device="cuda").to(case.dtype)
    N = cu.shape[0] - 1
    shape = (N, case.HV, case.V, case.K) if case.state_v_first else (N, case.HV, case.K, case.V)
    dht = torch.randn(shape, generator=gen, device="cuda") if case.dht else None
    return dict(q=x["q"], k=x["k"], v=x["v"], g_cumsum=g_cumsum, beta=beta, A=A, h=h, do=do, dht=dht, cu_seqlens=cu,
                initial_state=x["initial_state"],
                scale=case.K ** -0.5, state_v_first=case.state_v_first)


def _run(case, x):
    h = slot_states(x["h"], x["cu_seqlens"], x["q"].shape[1], case.state_v_first, case.dtype)
    return cb.chunk_bwd(x["q"], x["k"], x["v"], x["g_cumsum"], x["beta"], x["A"], h, x["do"], x["dht"],
                        x["cu_seqlens"], scale=x["scale"], state_v_first=case.state_v_first)


NAMES = ("dq", "dk", "dv", "dbeta", "dg", "dh0")


def _as_returned(case, grads):
    """A reference's (dq, dk per value head, ...) as the SM90 chunk_bwd returns them for these heads: dq and dk summed
    per key head where it adds the group itself (`chunk_bwd.group_add`)."""
    if not cb.group_add(case.H, case.HV):
        return tuple(grads)
    dq, dk, *rest = grads
    return (portable.group_sum(dq, case.H), portable.group_sum(dk, case.H), *rest)


@pytest.mark.parametrize("case", cases.BWD_CASES, ids=str)
def test_chunk_bwd(case):
    x = _inputs(case)
    got = _run(case, x)
    args = (x["q"], x["k"], x["v"], x["g_cumsum"], x["beta"], x["A"], x["h"], x["do"], x["dht"], x["cu_seqlens"])
    kw = dict(scale=x["scale"], state_v_first=case.state_v_first)
    want = _as_returned(case, ref.chunk_bwd(*args, **kw))
    base = _as_returned(case, portable.chunk_bwd(*args, **kw, compute_dtype=torch.float32, operand_dtype=case.dtype))
    end = int(x["cu_seqlens"][-1])
    # dq, dk (per value head, or per key head where chunk_bwd sums the group) and dv in the input dtype; dbeta, dG
    # and dh0 fp32
    assert all(t.dtype == (case.dtype if i < 3 else torch.float32) for i, t in enumerate(got))
    for name, o, r, b in zip(NAMES, got, want, base):
        if name == "dh0":
            assert_close(name, o, r, baseline=b)
            continue
        if end:
            assert_close(name, o[:, :end], r[:, :end], baseline=b[:, :end])
        assert torch.equal(o[:, end:], torch.zeros_like(o[:, end:])), f"{name} on the padding tail must be 0"


@pytest.mark.parametrize("case", cases.DSTATE_CASES, ids=str)
def test_chunk_dstate(case):
    """The start gradients from a zero end gradient (CP's F) equal the float64 chunk_bwd's dh0 with dht = 0 within
    the tolerance rule, and the SM90 chunk_bwd's own dh0 with a zero dht: the same roundings and the same
    accumulation order, so bit for bit as far as the tensor cores sum a k16 step alike in both kernels' shapes. A
    different summation order alone would put them ~1e-3 apart here (the bf16 chain amplifies it,
    docs/dev/chunk_bwd.md), so the tolerance is far below that."""
    x = _inputs(case)
    got = cds.chunk_dstate(x["q"], x["k"], x["g_cumsum"], x["beta"], x["A"], x["do"], x["cu_seqlens"],
                           scale=x["scale"])
    N = x["cu_seqlens"].shape[0] - 1
    zero = torch.zeros(N, case.HV, case.K, case.V, device="cuda")
    args = (x["q"], x["k"], x["v"], x["g_cumsum"], x["beta"], x["A"], x["h"], x["do"], zero, x["cu_seqlens"])
    want = ref.chunk_bwd(*args, scale=x["scale"])[5]
    base = portable.chunk_bwd(*args, scale=x["scale"], compute_dtype=torch.float32, operand_dtype=case.dtype)[5]
    assert got.dtype == torch.float32 and got.shape == (N, case.HV, case.K, case.V)
    assert_close("dh0", got, want, baseline=base)
    own = _run(case, dict(x, dht=zero if case.dht else None))[5]    # same operands and order: equal
    assert_close("dh0", got, own.double(), tol=1e-5)


@pytest.mark.parametrize("case", [c for c in cases.BWD_CASES if (c.K, c.V) in cb.HEAD_DIMS], ids=str)
def test_state_recompute(case):
    """The fused forward's state output: the state entering every chunk at its slot, in the input dtype (the value
    the forward's GEMMs read), against the float64 reference; the baseline (portable, fp32) is rounded the same way."""
    from flashdelta.kernels import fused_fwd

    x = _inputs(case)
    h = fused_fwd.state_recompute(x["k"], x["v"], x["g_cumsum"], x["beta"], x["A"], x["initial_state"],
                                  x["cu_seqlens"], state_v_first=case.state_v_first)
    assert h.dtype == case.dtype
    assert h.shape == (x["q"].shape[1] // BT + x["cu_seqlens"].shape[0], case.HV, case.V, case.K)
    pairs = _slots(x["cu_seqlens"])
    if not pairs:
        return
    got = h[[s for s, _ in pairs]]
    want = x["h"] if case.state_v_first else x["h"].transpose(-1, -2)
    args = (x["k"], x["v"], x["g_cumsum"], x["beta"], x["A"], x["initial_state"], x["cu_seqlens"])
    base = portable.state_recompute(*args, state_v_first=case.state_v_first, compute_dtype=torch.float32,
                                    operand_dtype=case.dtype)
    base = (base if case.state_v_first else base.transpose(-1, -2)).to(case.dtype)
    assert_close("h", got, want[[g for _, g in pairs]], baseline=base[[g for _, g in pairs]])
    # the states-only build's state chain is the full forward's: its final state is chunk_fwd's bit for bit
    _, ht, _ = fused_fwd._launch(x["k"], x["k"], x["v"], x["g_cumsum"], x["beta"], x["A"], x["initial_state"],
                                 x["cu_seqlens"], scale=1.0, state_v_first=case.state_v_first, chunk_size=BT,
                                 save_states=True, states_only=True)
    _, ht_fwd = fused_fwd.chunk_fwd(x["q"], x["k"], x["v"], x["g_cumsum"], x["beta"], x["A"], x["initial_state"],
                                    x["cu_seqlens"], scale=x["scale"], state_v_first=case.state_v_first)
    assert torch.equal(ht, ht_fwd), "state_recompute's state chain differs from the forward's"


@pytest.mark.parametrize("case", cases.BWD_DET_CASES, ids=str)
def test_chunk_bwd_deterministic(case):
    x = _inputs(case)
    a, b = _run(case, x), _run(case, x)
    assert all(torch.equal(s, t) for s, t in zip(a, b))


@pytest.mark.parametrize("case", [c for c in cases.BWD_DET_CASES if cb.group_add(c.H, c.HV)], ids=str)
def test_chunk_bwd_into_given_buffers(case):
    """`dqk` (context parallelism's backward zeroes dq and dk on its side stream): chunk_bwd adds into the given
    zeroed buffers, returns them, and the gradients equal those of its own zero fill bit for bit; a pair of the wrong
    shape, dtype or layout, or one given where the kernel writes dq and dk per value head, is refused."""
    x = _inputs(case)
    want = _run(case, x)
    h = slot_states(x["h"], x["cu_seqlens"], x["q"].shape[1], case.state_v_first, case.dtype)
    args = (x["q"], x["k"], x["v"], x["g_cumsum"], x["beta"], x["A"], h, x["do"], x["dht"], x["cu_seqlens"])
    kw = dict(scale=x["scale"], state_v_first=case.state_v_first)
    dq, dk = torch.zeros_like(want[0]), torch.zeros_like(want[1])
    got = cb.chunk_bwd(*args, **kw, dqk=(dq, dk))
    assert got[0] is dq and got[1] is dk, "chunk_bwd returns the buffers it was given"
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    bad = [((dq[:, 1:].contiguous(), dk), ValueError), ((dq.float(), dk), ValueError),
           ((dq.transpose(2, 3).contiguous().transpose(2, 3), dk), ValueError), ((dq, None), TypeError),
           (dq, TypeError)]
    for dqk, err in bad:
        with pytest.raises(err, match="dqk"):
            cb.chunk_bwd(*args, **kw, dqk=dqk)
    q1 = x["q"].repeat_interleave(2, dim=2)          # one key head per value head: per-value-head outputs
    with pytest.raises(ValueError, match="dqk"):
        cb.chunk_bwd(q1, x["k"].repeat_interleave(2, dim=2), *args[2:], **kw,
                     dqk=(torch.zeros_like(q1), torch.zeros_like(q1)))


def _sm90_chain(q, k, v, g, beta, h0, do, dht, cu, scale):
    """The SM90 backward's stages on flat inputs: prepare, state recompute, chunk_bwd (dq, dk per value head)."""
    from flashdelta.kernels import fused_fwd, prepare

    g_cumsum, A = prepare.prepare_fwd(k, g, beta, cu)
    hs = fused_fwd.state_recompute(k, v, g_cumsum, beta, A, h0, cu)
    return cb.chunk_bwd(q, k, v, g_cumsum, beta, A, hs, do, dht, cu, scale=scale)


def _random_inputs(T, N, case, seed, do_is_v=False):
    """q, k, v, g, beta, h0, do, dht of T tokens in N sequences; with do_is_v, do is v itself (chunk_bwd reads both
    and writes neither: one tensor of [1, T, HV, V] less where memory is tight)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device="cuda")

    q = torch.nn.functional.normalize(randn(1, T, case.H, case.K), dim=-1).to(case.dtype)
    k = torch.nn.functional.normalize(randn(1, T, case.H, case.K), dim=-1).to(case.dtype)
    v = randn(1, T, case.HV, case.V).to(case.dtype)
    g = torch.nn.functional.logsigmoid(randn(1, T, case.HV)) / 16
    beta = torch.sigmoid(randn(1, T, case.HV)).to(case.beta_dtype)
    h0 = randn(N, case.HV, case.K, case.V)
    do = v if do_is_v else randn(1, T, case.HV, case.V).to(case.dtype)
    dht = randn(N, case.HV, case.K, case.V)
    return q, k, v, g, beta, h0, do, dht


def _sub(xs, tok, pick):
    """The inputs of the sequences `pick` alone (tokens `tok`), in `_random_inputs` order."""
    q, k, v, g, beta, h0, do, dht = xs
    return (q[:, tok].contiguous(), k[:, tok].contiguous(), v[:, tok].contiguous(), g[:, tok].contiguous(),
            beta[:, tok].contiguous(), h0[pick].contiguous(), do[:, tok].contiguous(), dht[pick].contiguous())


def test_chunk_bwd_many_sequences():
    """70k sequences (more than a grid y/z dimension holds): the full launch's gradients of a sample of sequences (the
    first 50 and every 7th past index 65,529) equal, bit for bit, the chain run on the sample alone, and that run
    matches the float64 reference."""
    case = cases.BWD_MANY_SEQS
    cu = [0]
    for n in case.seqlens:
        cu.append(cu[-1] + n)
    T, N = cu[-1], len(case.seqlens)
    xs = _random_inputs(T, N, case, seed=11)
    cu_t = torch.tensor(cu, dtype=torch.int32, device="cuda")
    scale = case.K ** -0.5
    full = _sm90_chain(*xs, cu_t, scale)
    assert all(torch.isfinite(t).all() for t in full)
    pick = list(range(50)) + list(range(65530, N, 7))
    tok = torch.cat([torch.arange(cu[n], cu[n + 1]) for n in pick]).to("cuda")
    sub_cu = torch.tensor([0] + [cu[n + 1] - cu[n] for n in pick], device="cuda").cumsum(0).to(torch.int32)
    sub = _sub(xs, tok, pick)
    part = _sm90_chain(*sub, sub_cu, scale)
    for name, a, b in zip(NAMES, full, part):
        want = a[pick] if name == "dh0" else a[:, tok]
        assert torch.equal(want, b), f"{name}: the full launch differs from the sample's own"
    q, k, v, g, beta, h0, do, dht = sub
    g_cumsum, A = ref.prepare_fwd(k, g, beta, sub_cu)
    h = ref.state_recompute(k, v, g_cumsum, beta, A, h0, sub_cu)
    want = ref.chunk_bwd(q, k, v, g_cumsum, beta, A, h, do, dht, sub_cu, scale=scale)
    for name, a, r in zip(NAMES, part, want):
        assert_close(name, a, r)


@pytest.mark.bigmem
@pytest.mark.parametrize("case", [cases.BWD_BIG, cases.BWD_BIG_GVA2], ids=str)
def test_chunk_bwd_offsets_past_2_31_elements(case):
    """A sequence whose dq/dk rows start at element 2^31 and whose states sit past 2^31 elements of h: its gradients
    from the big launch equal, bit for bit, a launch on that sequence alone. dq and dk are [1, T, HV, K] per value
    head, or [1, T, H, K] where chunk_bwd adds a key head's two value heads into them (`group_add`: its TMA
    reduce-add and red.global.add past 2^31). Then the group sums as the backward runs them (dq with the l2norm
    backward, dk without; `group_sum` reads the rows past 2^31) equal those of the sequence alone too. Peak memory
    ~35 GB (GVA 4, K = V = 128) and ~53 GB (GVA 2, K = V = 64, do aliasing v)."""
    from flashdelta.kernels import group_sum, l2norm

    add = cb.group_add(case.H, case.HV)
    T0 = 2 ** 31 // ((case.H if add else case.HV) * case.K)      # sequence 1 starts exactly at dq element 2^31
    T1 = 3000
    xs = _random_inputs(T0 + T1, 2, case, seed=13, do_is_v=add)
    cu = torch.tensor([0, T0, T0 + T1], dtype=torch.int32, device="cuda")
    scale = case.K ** -0.5
    big = _sm90_chain(*xs, cu, scale)
    assert big[0].numel() > 2 ** 31
    tok = torch.arange(T0, T0 + T1, device="cuda")
    one = _sm90_chain(*_sub(xs, tok, [1]), torch.tensor([0, T1], dtype=torch.int32, device="cuda"), scale)
    for name, a, b in zip(NAMES, big, one):
        assert torch.equal(a[1:] if name == "dh0" else a[:, T0:], b), f"{name}: offsets past 2^31 elements"
    assert all(torch.isfinite(t[:, :T0]).all() for t in big[:5])
    y, rstd = l2norm.l2norm_fwd(xs[0])          # the normalised q, as the forward saves it
    dq = group_sum.group_sum(big[0], case.H, y=y, rstd=rstd, out_dtype=case.dtype)
    dk = group_sum.group_sum(big[1], case.H, out_dtype=case.dtype)
    dq1 = group_sum.group_sum(one[0], case.H, y=y[:, T0:].contiguous(), rstd=rstd[:, T0:].contiguous(),
                              out_dtype=case.dtype)
    assert torch.equal(dq[:, T0:], dq1), "dq's group sum with the l2norm backward: offsets past 2^31 elements"
    assert torch.equal(dk[:, T0:], group_sum.group_sum(one[1], case.H, out_dtype=case.dtype)), \
        "dk's group sum: offsets past 2^31 elements"


# ---------------------------------------------------------------------------------------------- end to end

def _grads(x, o, ht, do, dht):
    """Backward of (o * do).sum() + (ht * dht).sum() (the first term alone where dht is None): the input gradients by
    name."""
    acc = torch.float64 if o.dtype == torch.float64 else torch.float32
    loss = (o.to(acc) * do.to(acc)).sum()
    if dht is not None:
        loss = loss + (ht.to(acc) * dht.to(acc)).sum()
    loss.backward()
    return {n: x[n].grad for n in GRAD_INPUTS if x[n] is not None}


GRAD_INPUTS = ("q", "k", "v", "g", "beta", "initial_state")
GRAD_NAMES = {"q": "dq", "k": "dk", "v": "dv", "g": "dg", "beta": "dbeta", "initial_state": "dh0"}


def _e2e_ids(pairs):
    return [f"{c}-{str(d)[6:]}{'-l2norm' if n else ''}" for c, d, n in pairs]


def _e2e_inputs(case, dtype, l2norm):
    x = make_inputs(case, dtype=dtype, device="cuda", requires_grad=True)
    if l2norm:
        with torch.no_grad():
            x["q"].mul_(3)
            x["k"].mul_(0.5)
    return x


def _check_backward(case, dtype, l2norm, final_state, **kw):
    """Every gradient through the public API (on the backend the caller forces; `kw`: more of its keywords) against
    float64 autograd of the recurrence; with final_state the loss uses the final state too, else o alone (dht
    None)."""
    from flashdelta import chunk_gated_delta_rule
    from flashdelta.reference.recurrent import recurrent_gated_delta_rule

    x = _e2e_inputs(case, dtype, l2norm)
    o, ht = chunk_gated_delta_rule(**x, output_final_state=final_state, use_qk_l2norm_in_kernel=l2norm, **kw)
    gen = torch.Generator(device="cuda").manual_seed(3)
    do = torch.randn(o.shape, generator=gen, device="cuda").to(dtype)
    dht = torch.randn(ht.shape, generator=gen, device="cuda") if final_state else None
    got = _grads(x, o, ht, do, dht)
    x64 = {n: (t.detach().double().requires_grad_(True) if torch.is_tensor(t) and t.is_floating_point() else t)
           for n, t in x.items()}
    o_ref, ht_ref = recurrent_gated_delta_rule(**x64, output_final_state=final_state,
                                               use_qk_l2norm_in_kernel=l2norm)
    want = _grads(x64, o_ref, ht_ref, do, dht)
    assert_close("o", o, o_ref)
    for n in got:
        assert got[n].dtype == x[n].dtype, f"{GRAD_NAMES[n]} must come back in {n}'s dtype"
        assert_close(GRAD_NAMES[n], got[n], want[n])
    if case.pad:
        for n in ("q", "k", "v", "g", "beta"):
            assert torch.all(got[n][:, -case.pad:] == 0), f"{GRAD_NAMES[n]} on the padding tail must be 0"


@pytest.mark.parametrize("case,dtype,l2norm", cases.BWD_E2E_PAIRS, ids=_e2e_ids(cases.BWD_E2E_PAIRS))
def test_sm90_backward_matches_recurrence(case, dtype, l2norm, monkeypatch):
    """Every gradient through the public API on the sm90 backend against float64 autograd of the recurrence."""
    monkeypatch.setenv("FLASHDELTA_BACKEND", "sm90")
    _check_backward(case, dtype, l2norm, final_state=True)


@pytest.mark.parametrize("case,dtype,l2norm", cases.BWD_E2E_NO_DHT, ids=_e2e_ids(cases.BWD_E2E_NO_DHT))
def test_sm90_backward_final_state_unused(case, dtype, l2norm, monkeypatch):
    """The loss uses o alone (output_final_state=False, the usual training call): chunk_bwd runs its build without
    a final-state gradient (autograd passes dht None), and every gradient matches float64 autograd of the
    recurrence. Context parallelism off: a split backward gives chunk_bwd every partition's end gradient instead."""
    monkeypatch.setenv("FLASHDELTA_BACKEND", "sm90")
    has_dht = []
    real = cb.builder_args

    def spy(*args):
        has_dht.append(args[7])
        return real(*args)

    monkeypatch.setattr(cb, "builder_args", spy)
    _check_backward(case, dtype, l2norm, final_state=False, context_parallel=False)
    assert has_dht and not any(has_dht), f"chunk_bwd's builds: has_dht {has_dht}"


@pytest.mark.parametrize("case,dtype,l2norm", cases.BWD_E2E_DET, ids=_e2e_ids(cases.BWD_E2E_DET))
def test_sm90_backward_deterministic(case, dtype, l2norm, monkeypatch):
    """Forward + backward twice through the public API with the l2norm in the kernel (its backward in group_sum):
    every gradient bitwise equal."""
    from flashdelta import chunk_gated_delta_rule

    monkeypatch.setenv("FLASHDELTA_BACKEND", "sm90")
    x = _e2e_inputs(case, dtype, l2norm)
    leaves = [x[n] for n in GRAD_INPUTS if x[n] is not None]
    gen = torch.Generator(device="cuda").manual_seed(5)
    do = torch.randn(x["v"].shape, generator=gen, device="cuda").to(dtype)

    def step():
        o, ht = chunk_gated_delta_rule(**x, output_final_state=True, use_qk_l2norm_in_kernel=l2norm)
        return torch.autograd.grad((o, ht), leaves, (do, torch.ones_like(ht)))

    a, b = step(), step()
    for n, s, t in zip([n for n in GRAD_INPUTS if x[n] is not None], a, b):
        assert torch.equal(s, t), f"{GRAD_NAMES[n]} differs between two runs"


def test_sm90_backward_deterministic_and_graph_capturable(monkeypatch):
    """Forward + backward twice: bitwise equal gradients; then the whole step captured in one CUDA graph (no host
    synchronisation) and replayed on new inputs of the same shapes, then with new sequence lengths."""
    from flashdelta import chunk_gated_delta_rule

    monkeypatch.setenv("FLASHDELTA_BACKEND", "sm90")
    case = cases.BWD_GRAPH
    x = make_inputs(case, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    leaves = [x[n] for n in GRAD_INPUTS]
    gen = torch.Generator(device="cuda").manual_seed(5)
    do = torch.randn(x["v"].shape, generator=gen, device="cuda").bfloat16()

    def step():
        o, ht = chunk_gated_delta_rule(**x, output_final_state=True)
        return torch.autograd.grad((o, ht), leaves, (do, torch.ones_like(ht)))

    g1, g2 = step(), step()
    assert all(torch.equal(a, b) for a, b in zip(g1, g2))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s):
        step()
        with torch.cuda.graph(graph, stream=s):
            g_graph = step()
    torch.cuda.current_stream().wait_stream(s)
    x2 = make_inputs(case, dtype=torch.bfloat16, device="cuda", seed=9)
    with torch.no_grad():
        for n in GRAD_INPUTS:
            x[n].copy_(x2[n])
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(g_graph, step()))
    # new sequence lengths within the captured bounds (same T and N): the kernels read cu_seqlens on the device
    cu = x["cu_seqlens"]
    cu.copy_(torch.tensor([0, 100, 4000, int(cu[-1])], dtype=cu.dtype, device=cu.device))
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(g_graph, step()))


def test_sm90_backward_compile_and_checkpoint(monkeypatch):
    """torch.compile(fullgraph=True, dynamic=True) over forward + backward with two lengths, and
    torch.utils.checkpoint (bitwise the eager gradients). With CP off the compiled call runs the eager kernels and
    gives their gradients. Under the automatic decision a compiled call settles CP inside the ops on concrete shapes
    and saves no partition starts (`autograd._starts_every`), so where eager splits the backward from the forward's
    saved starts (T = 1000 here: two-chunk partitions) the two run different exact CP paths, ~3e-3 apart at bf16
    (relative L2, measured): there each is checked against float64 autograd of the recurrence."""
    from flashdelta import chunk_gated_delta_rule
    from flashdelta.reference.recurrent import recurrent_gated_delta_rule

    monkeypatch.setenv("FLASHDELTA_BACKEND", "sm90")

    def make_loss(fn, **kw):
        def loss(q, k, v, g, beta, h0):
            o, ht = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, **kw)
            return o.to(torch.float64 if o.dtype == torch.float64 else torch.float32).square().sum() + ht.sum()
        return loss

    for cp_arg in (False, None):
        loss = make_loss(chunk_gated_delta_rule, context_parallel=cp_arg)
        compiled = torch.compile(loss, fullgraph=True, dynamic=True)
        for case in cases.BWD_COMPILE:
            x = make_inputs(case, dtype=torch.bfloat16, device="cuda", requires_grad=True)
            args = [x[n] for n in GRAD_INPUTS]
            eager = torch.autograd.grad(loss(*args), args)
            comp = torch.autograd.grad(compiled(*args), args)
            ckpt = torch.autograd.grad(torch.utils.checkpoint.checkpoint(loss, *args, use_reentrant=False), args)
            a64 = [t.detach().double().requires_grad_(True) for t in args]
            want = torch.autograd.grad(make_loss(recurrent_gated_delta_rule)(*a64), a64) if cp_arg is None else None
            for i, (n, a, b, c) in enumerate(zip(GRAD_INPUTS, eager, comp, ckpt)):
                assert torch.equal(a, c), f"checkpoint changed {GRAD_NAMES[n]}"
                assert b.dtype == a.dtype
                if cp_arg is False:
                    assert torch.equal(b, a), f"compiled {GRAD_NAMES[n]} differs from eager with CP off"
                else:
                    assert_close(GRAD_NAMES[n], a, want[i])
                    assert_close(GRAD_NAMES[n], b, want[i])


def test_two_layer_model_trains_like_portable(monkeypatch):
    """A two-layer GDN model (projections, SiLU, loss on the output): five Adam steps on sm90 and on the portable
    backend from the same weights give the same losses (relative 1e-2) and both decrease."""
    from flashdelta import chunk_gated_delta_rule

    torch.manual_seed(0)
    c = cases.BWD_MODEL
    D, H, HV, K, V, T = 256, c.H, c.HV, c.K, c.V, c.seqlens[0]

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qk = torch.nn.Linear(D, 2 * H * K, bias=False)
            self.vgb = torch.nn.Linear(D, HV * V + 2 * HV, bias=False)
            self.out = torch.nn.Linear(HV * V, D, bias=False)

        def forward(self, x):
            q, k = self.qk(x).view(1, T, 2, H, K).unbind(2)
            vgb = self.vgb(x)
            v = vgb[..., :HV * V].view(1, T, HV, V)
            g = -torch.nn.functional.softplus(vgb[..., HV * V:HV * V + HV].float())
            beta = torch.sigmoid(vgb[..., HV * V + HV:])
            o, _ = chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
            return x + self.out(torch.nn.functional.silu(o.reshape(1, T, HV * V)))

    base = torch.nn.Sequential(Layer(), Layer()).cuda().bfloat16()
    x = torch.randn(1, T, D, device="cuda").bfloat16()
    target = torch.randn(1, T, D, device="cuda").bfloat16()
    losses = {}
    for backend in ("sm90", "torch"):
        monkeypatch.setenv("FLASHDELTA_BACKEND", backend)
        model = copy.deepcopy(base)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        losses[backend] = []
        for _ in range(5):
            opt.zero_grad()
            loss = (model(x).float() - target.float()).square().sum(-1).mean()
            loss.backward()
            opt.step()
            losses[backend].append(loss.item())
    a, b = torch.tensor(losses["sm90"]), torch.tensor(losses["torch"])
    assert a[-1] < a[0] and b[-1] < b[0], losses
    assert ((a - b).abs() / b.abs()).max() < 1e-2, losses
