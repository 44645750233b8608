"""The SM90 decode kernel (`kernels.decode`, behind `fused_recurrent_gated_delta_rule`) on a Hopper GPU.

Every case of `CASES` runs through the public function on the kernel path (checked: the launcher is called) and is
compared with the float64 recurrence (`reference.recurrent`, gates and beta transformed in float64), with the PyTorch
path of the same function (``FLASHDELTA_BACKEND=torch``, fp32) as the baseline of the tolerance helper. Outputs are
NaN-poisoned (conftest): every o row the kernel forgets fails, the padding tail must be exactly 0 and an empty
sequence's final state is its initial state. The cases cover each option of the kernel: in-kernel gate (with and
without dt_bias), beta sigmoid and 2 sigmoid, per-channel beta, gk, gv, q/k l2norm, initial state absent / fp32 /
bf16, final state on and off, both state layouts, GVA 1/2/4, dense T = 1 and T = 4, varlen with 0- and 1-token
sequences and a padding tail, bf16/fp16/fp32, K = V = 64 and 128, V = 256.

`recorded_builds` lists the kernel builds these cases launch, without a GPU (tests/cpu/test_compile_decode.py
compiles some of them on the CPU tier; ``python bench/dev/decode_bench.py --precompile`` compiles all of them into a
TileLang cache for the GPU machine).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import pytest
import torch
import torch.nn.functional as F
from _helpers import assert_close, at_odd_offset

import flashdelta
from flashdelta import UnsupportedError, dispatch, recurrent
from flashdelta.gates import beta_sigmoid, gdn_gate
from flashdelta.reference import recurrent_gated_delta_rule


@dataclasses.dataclass(frozen=True)
class DecodeCase:
    """One call: dense ``[B, T, ..]`` (seqlens None) or varlen (seqlens, B = 1, `pad` tokens after the last)."""
    name: str
    B: int = 1
    T: int = 1
    seqlens: Optional[tuple] = None
    pad: int = 0
    H: int = 2
    HV: int = 4
    K: int = 128
    V: int = 128
    dtype: torch.dtype = torch.bfloat16
    h0: Optional[torch.dtype] = torch.float32      # None: no initial state
    final: bool = True
    v_first: bool = False
    l2norm: bool = True
    g: bool = True
    gate: Optional[str] = None                      # "bias": use_gate_in_kernel with dt_bias, "nobias": without
    beta: Optional[str] = "head"                    # "head" [.., HV], "channel" [.., HV, V], None (ones)
    beta_dtype: torch.dtype = torch.bfloat16
    beta_act: int = 0                               # 1: use_beta_sigmoid_in_kernel, 2: with allow_neg_eigval
    gk: bool = False
    gv: bool = False

    def __str__(self):
        return self.name


LANES = (1, 4)      # lanes per value column of the builds every case runs (kernels/decode.py `LANES`)
CASES = [
    DecodeCase("decode-bf16-gva2", B=4),
    DecodeCase("mtp-T4-gva4", B=3, T=4, H=1, HV=4),
    DecodeCase("decode-fp32-gva1", B=2, H=4, HV=4, dtype=torch.float32, beta_dtype=torch.float32),
    DecodeCase("varlen-vfirst-gva4-pad", seqlens=(0, 1, 3, 1, 0, 4), pad=2, H=2, HV=8, v_first=True),
    DecodeCase("varlen-T1-h0bf16", seqlens=(1,) * 8, h0=torch.bfloat16),
    DecodeCase("gate-bias-sigmoid-T4", B=2, T=4, gate="bias", beta_act=1),
    DecodeCase("gate-nobias-negeig-channel-vfirst", seqlens=(2, 0, 3), pad=1, gate="nobias", beta="channel",
               beta_act=2, beta_dtype=torch.float32, v_first=True),
    DecodeCase("gk-gv-channel", B=2, T=3, gk=True, gv=True, beta="channel", beta_dtype=torch.float32),
    DecodeCase("bare-k64-fp16", B=2, T=2, K=64, V=64, dtype=torch.float16, h0=None, final=False, l2norm=False,
               g=False, beta=None),
    DecodeCase("k128-v256-fp16", B=2, dtype=torch.float16, V=256, beta_dtype=torch.float16),
    DecodeCase("varlen-k64-fp32-vfirst", seqlens=(1, 2, 0), K=64, V=64, dtype=torch.float32,
               beta_dtype=torch.float32, v_first=True, h0=torch.float32, l2norm=False),
    DecodeCase("decode-nofinal-fp64-params", B=4, final=False, beta_dtype=torch.float64, h0=torch.float64),
]


def make(case: DecodeCase, device, seed: int = 0) -> dict:
    """The public function's keyword arguments for `case` (on `device`)."""
    gen = torch.Generator().manual_seed(seed)
    if case.seqlens is None:
        B, T, N = case.B, case.T, case.B
    else:
        B, T, N = 1, sum(case.seqlens) + case.pad, len(case.seqlens)
    H, HV, K, V = case.H, case.HV, case.K, case.V

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q, k = randn(B, T, H, K), randn(B, T, H, K)
    if not case.l2norm:                     # FLA's convention: normalised q, k when the kernel does not normalise
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    x = dict(q=q.to(case.dtype), k=k.to(case.dtype), v=randn(B, T, HV, V).to(case.dtype),
             use_qk_l2norm_in_kernel=case.l2norm, output_final_state=case.final, state_v_first=case.v_first)
    if case.gate is not None:
        x.update(g=randn(B, T, HV).float(), use_gate_in_kernel=True,
                 A_log=torch.log(torch.rand(HV, generator=gen, dtype=torch.float64) * 15 + 1).float())
        if case.gate == "bias":
            x["dt_bias"] = randn(HV).to(torch.bfloat16)
    elif case.g:
        x["g"] = F.logsigmoid(randn(B, T, HV) + 2).float()
    if case.gk:
        x["gk"] = (F.logsigmoid(randn(B, T, HV, K) + 3) * 0.5).float()
    if case.gv:
        x["gv"] = (F.logsigmoid(randn(B, T, HV, V) + 3) * 0.5).to(torch.bfloat16)
    if case.beta is not None:
        shape = (B, T, HV) if case.beta == "head" else (B, T, HV, V)
        b = randn(*shape) if case.beta_act else torch.sigmoid(randn(*shape))
        x["beta"] = b.to(case.beta_dtype)
        if case.beta_act:
            x.update(use_beta_sigmoid_in_kernel=True, allow_neg_eigval=case.beta_act == 2)
    if case.h0 is not None:
        shape = (N, HV, V, K) if case.v_first else (N, HV, K, V)
        x["initial_state"] = randn(*shape).to(case.h0)
    if case.seqlens is not None:
        x["cu_seqlens"] = torch.tensor([0, *torch.tensor(case.seqlens).cumsum(0).tolist()], dtype=torch.int32)
    return {n: t.to(device) if isinstance(t, torch.Tensor) else t for n, t in x.items()}


def reference(case: DecodeCase, x: dict):
    """The float64 recurrence of the call `x` (gates and beta transformed in float64); final state always."""
    f64 = {n: t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t for n, t in x.items()}
    g = f64.get("g")
    if x.get("use_gate_in_kernel"):
        g = gdn_gate(g, f64["A_log"], f64.get("dt_bias"))
    beta = f64.get("beta")
    if beta is None:
        beta = torch.ones(*x["v"].shape[:3], dtype=torch.float64, device=x["v"].device)
    elif x.get("use_beta_sigmoid_in_kernel"):
        beta = beta_sigmoid(beta, x["allow_neg_eigval"])
    return recurrent_gated_delta_rule(f64["q"], f64["k"], f64["v"], g, beta, initial_state=f64.get("initial_state"),
                                      output_final_state=True, use_qk_l2norm_in_kernel=case.l2norm,
                                      cu_seqlens=x.get("cu_seqlens"), state_v_first=case.v_first, gk=f64.get("gk"),
                                      gv=f64.get("gv"))


@pytest.fixture
def spy(monkeypatch):
    """Counts the decode launcher's calls (the kernel path was taken)."""
    from flashdelta.kernels import decode

    calls = []
    real = decode.fused_recurrent_fwd

    def wrapped(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(decode, "fused_recurrent_fwd", wrapped)
    return calls


def _portable(monkeypatch, x):
    monkeypatch.setenv(dispatch.ENV_BACKEND, "torch")
    out = flashdelta.fused_recurrent_gated_delta_rule(**x)
    monkeypatch.delenv(dispatch.ENV_BACKEND)
    return out


@pytest.fixture(params=LANES, ids=lambda n: f"lanes{n}")
def lanes(request, monkeypatch):
    """The kernel's lanes per value column, forced (the launcher's own pick, `decode.lanes_for`, depends on the grid:
    these cases are small enough that it would take the K split for nearly all of them)."""
    from flashdelta.kernels import decode

    monkeypatch.setattr(decode, "lanes_for", lambda *args: request.param)
    return request.param


@pytest.mark.parametrize("case", CASES, ids=str)
def test_decode_matches_reference(case, lanes, spy, monkeypatch):
    monkeypatch.delenv(dispatch.ENV_BACKEND, raising=False)
    x = make(case, "cuda")
    o, ht = flashdelta.fused_recurrent_gated_delta_rule(**x)
    assert spy == [1], "the SM90 kernel path was not taken"
    ref_o, ref_ht = reference(case, x)
    base_o, base_ht = _portable(monkeypatch, x)
    assert o.dtype == x["v"].dtype and o.shape == x["v"].shape
    end = int(x["cu_seqlens"][-1]) if "cu_seqlens" in x else o.shape[1]
    if end:
        assert_close("o", o[:, :end], ref_o[:, :end], baseline=base_o[:, :end], eps=1e-5)
    assert torch.equal(o[:, end:], torch.zeros_like(o[:, end:])), "o on the padding tail must be 0"
    if not case.final:
        assert ht is None
        return
    assert ht.dtype == torch.float32 and ht.shape == ref_ht.shape
    assert_close("ht", ht, ref_ht, baseline=base_ht, eps=1e-5)
    if "cu_seqlens" in x:
        empty = torch.diff(x["cu_seqlens"]) == 0
        if empty.any():
            h0 = x.get("initial_state")
            want = h0[empty].float() if h0 is not None else torch.zeros_like(ht[empty])
            assert torch.equal(ht[empty], want), "an empty sequence's final state is its initial state"


def test_misaligned_inputs(spy):
    """Every tensor input as a view at an odd offset (contiguous, not 16-byte aligned): o and the final state equal
    the aligned call's bitwise, on the kernel path."""
    case = DecodeCase("odd", B=3, T=2, gate="bias", beta_act=1)
    x = make(case, "cuda")
    odd = {n: at_odd_offset(t) if isinstance(t, torch.Tensor) and t.is_floating_point() else t for n, t in x.items()}
    assert all(t.data_ptr() % 16 for t in odd.values() if isinstance(t, torch.Tensor) and t.is_floating_point())
    for a, b in zip(flashdelta.fused_recurrent_gated_delta_rule(**x),
                    flashdelta.fused_recurrent_gated_delta_rule(**odd)):
        assert torch.equal(a, b)
    assert len(spy) == 2


def test_one_call_of_T_tokens_is_T_decode_steps(spy):
    """T = 4 in one call and four T = 1 calls that carry the fp32 state agree to fp32 rounding (the state's round
    trip through fp32 memory is exact and the per-token arithmetic the same, so they should agree bit for bit; the
    bound leaves room for one bf16 rounding step in o)."""
    case = DecodeCase("chain", B=3, T=4, gate="bias", beta_act=1)
    x = make(case, "cuda")
    o, ht = flashdelta.fused_recurrent_gated_delta_rule(**x)
    h = x["initial_state"]
    for t in range(4):
        step = {n: (v[:, t:t + 1] if n in ("q", "k", "v", "g", "beta") else v) for n, v in x.items()}
        o_t, h = flashdelta.fused_recurrent_gated_delta_rule(**dict(step, initial_state=h))
        assert_close("o", o_t, o[:, t:t + 1], tol=1e-3)
    assert_close("ht", h, ht, tol=1e-6)
    assert len(spy) == 5


def test_varlen_step_replays_in_a_cuda_graph(spy):
    """A varlen decode step reads cu_seqlens on the device only: captured once in a CUDA graph, it replays with new
    inputs and new sequence lengths (same N, same T) and matches the eager call on them."""
    case = DecodeCase("graph", seqlens=(1, 0, 2, 1), pad=1, H=2, HV=4)
    x = make(case, "cuda", seed=1)
    static = {n: t.clone() if isinstance(t, torch.Tensor) else t for n, t in x.items()}
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        flashdelta.fused_recurrent_gated_delta_rule(**static)          # compile outside the capture
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        o_g, ht_g = flashdelta.fused_recurrent_gated_delta_rule(**static)
    y = make(case, "cuda", seed=2)
    y["cu_seqlens"] = torch.tensor([0, 2, 2, 3, 4], dtype=torch.int32, device="cuda")   # new lengths (2, 0, 1, 1)
    for n, t in y.items():
        if isinstance(t, torch.Tensor):
            static[n].copy_(t)
    graph.replay()
    torch.cuda.synchronize()
    o, ht = flashdelta.fused_recurrent_gated_delta_rule(**y)
    assert torch.equal(o_g, o) and torch.equal(ht_g, ht)
    ref_o, ref_ht = reference(case, y)
    assert_close("o", o[:, :4], ref_o[:, :4])
    assert_close("ht", ht, ref_ht)


def test_grad_runs_the_pytorch_path(spy, monkeypatch):
    """An input that requires grad: the differentiable PyTorch path (no kernel launch), gradients against the float64
    recurrence's; ``FLASHDELTA_BACKEND=sm90`` raises instead."""
    monkeypatch.delenv(dispatch.ENV_BACKEND, raising=False)
    case = DecodeCase("grad", B=2, T=2, dtype=torch.float32, beta_dtype=torch.float32)
    x = make(case, "cuda")
    x["v"].requires_grad_(True)
    o, ht = flashdelta.fused_recurrent_gated_delta_rule(**x)
    assert spy == [] and o.requires_grad
    (dv,) = torch.autograd.grad(o.sum() + ht.sum(), [x["v"]])
    v64 = x["v"].detach().double().requires_grad_(True)
    ref_o, ref_ht = reference(case, dict(x, v=v64))
    (dv_ref,) = torch.autograd.grad(ref_o.sum() + ref_ht.sum(), [v64])
    assert_close("dv", dv, dv_ref)
    with torch.no_grad():
        flashdelta.fused_recurrent_gated_delta_rule(**x)
    assert spy == [1]                                           # no_grad: the kernel again
    monkeypatch.setenv(dispatch.ENV_BACKEND, "sm90")
    with pytest.raises(UnsupportedError, match="forward only"):
        flashdelta.fused_recurrent_gated_delta_rule(**x)


def test_backend_switch_and_unsupported_head_dims(spy, monkeypatch):
    """torch forces the PyTorch path; an unsupported K falls back under auto with one warning, and raises under sm90."""
    x = make(DecodeCase("switch", B=2), "cuda")
    monkeypatch.setenv(dispatch.ENV_BACKEND, "torch")
    flashdelta.fused_recurrent_gated_delta_rule(**x)
    assert spy == []
    monkeypatch.delenv(dispatch.ENV_BACKEND)
    y = make(DecodeCase("k32", B=2, K=32, V=32), "cuda")
    recurrent._warned.clear()
    with pytest.warns(UserWarning, match=r"portable PyTorch path.*K=32"):
        o, _ = flashdelta.fused_recurrent_gated_delta_rule(**y)
    assert spy == [] and torch.isfinite(o).all()
    monkeypatch.setenv(dispatch.ENV_BACKEND, "sm90")
    with pytest.raises(UnsupportedError, match="K=32"):
        flashdelta.fused_recurrent_gated_delta_rule(**y)


def test_no_tokens():
    """T = 0 (dense) and a varlen batch with no tokens: empty o, the final state is the initial state (fp32)."""
    for case in (DecodeCase("t0", B=3, T=0), DecodeCase("v0", seqlens=(0, 0))):
        x = make(case, "cuda")
        o, ht = flashdelta.fused_recurrent_gated_delta_rule(**x)
        assert o.shape[1] == 0 and torch.equal(ht, x["initial_state"].float())
        assert ht.data_ptr() != x["initial_state"].data_ptr()


@pytest.mark.bigmem
def test_state_past_2_31_elements(lanes):
    """131,073 sequences x 1 head x 128 x 128: the state tensors hold more than 2^31 elements (8 GiB each). The last
    sequences (offsets past 2^31) must match, bit for bit, the kernel run on them alone (the same build), and that
    run the reference."""
    B = (1 << 31) // (128 * 128) + 1
    case = DecodeCase("big", B=B, H=1, HV=1)
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = dict(q=torch.randn(B, 1, 1, 128, device="cuda", generator=gen).bfloat16(),
             k=torch.randn(B, 1, 1, 128, device="cuda", generator=gen).bfloat16(),
             v=torch.randn(B, 1, 1, 128, device="cuda", generator=gen).bfloat16(),
             g=-torch.rand(B, 1, 1, device="cuda", generator=gen),
             beta=torch.rand(B, 1, 1, device="cuda", generator=gen).bfloat16(),
             initial_state=torch.randn(B, 1, 128, 128, device="cuda", generator=gen),
             output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert x["initial_state"].numel() > 2 ** 31
    o, ht = flashdelta.fused_recurrent_gated_delta_rule(**x)
    tail = slice(B - 8, B)
    sub = {n: (t[tail] if isinstance(t, torch.Tensor) else t) for n, t in x.items()}
    o_s, ht_s = flashdelta.fused_recurrent_gated_delta_rule(**sub)
    assert torch.equal(o[tail], o_s) and torch.equal(ht[tail], ht_s)
    ref_o, ref_ht = reference(case, sub)
    assert_close("o", o_s, ref_o)
    assert_close("ht", ht_s, ref_ht)
    assert math.isfinite(float(ht[0].abs().max()))


def recorded_builds(cases=CASES, lanes=LANES) -> list:
    """(case name, `decode.build` arguments) of every launch the cases make with each of `lanes` forced (as the
    `lanes` fixture does; None: the launcher's own pick), found without a GPU: each case's call runs on the CPU with
    the kernel path forced on and the builder replaced by a recorder (which returns a kernel that writes nothing)."""
    from flashdelta.kernels import decode

    out = []
    real_build, real_path, real_lanes = decode.build, recurrent._kernel_path, decode.lanes_for

    def record(*args):
        out.append((name, args))
        return lambda *tensors: None

    try:
        decode.build = record
        recurrent._kernel_path = lambda *a, **k: True
        for n in lanes:
            decode.lanes_for = real_lanes if n is None else (lambda *args, n=n: n)
            for case in cases:
                name = case.name
                flashdelta.fused_recurrent_gated_delta_rule(**make(case, "cpu"))
    finally:
        decode.build, recurrent._kernel_path, decode.lanes_for = real_build, real_path, real_lanes
    return out
