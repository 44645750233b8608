"""flashdelta registered in FLA's backend registry (`flashdelta.fla_backend`): FLA's own chunk_gated_delta_rule runs
on flashdelta, and the verifier says no, with a reason, to every call flashdelta would not run in full.

Needs FLA 0.6.0 (fla-core, which imports Triton); skipped without it, as in the README's test command. `.ci/run` runs
this file again in a venv that adds FLA and Triton. Without FLA, flashdelta itself still imports and runs
(test_fla_api.py checks that).
"""
from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("fla.backends", reason="needs FLA 0.6.0 (fla-core) and Triton")

import flashdelta  # noqa: E402
from flashdelta import dispatch  # noqa: E402
from flashdelta import fla_backend  # noqa: E402


@pytest.fixture(scope="module")
def fla_chunk():
    fla_backend.register()
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    return chunk_gated_delta_rule


def _x(T=70, H=2, HV=4, K=16, V=8, dtype=torch.float32, grad=False):
    gen = torch.Generator().manual_seed(0)
    x = dict(q=torch.randn(1, T, H, K, generator=gen, dtype=dtype),
             k=F.normalize(torch.randn(1, T, H, K, generator=gen), dim=-1).to(dtype),
             v=torch.randn(1, T, HV, V, generator=gen, dtype=dtype), g=torch.randn(1, T, HV, generator=gen),
             beta=torch.randn(1, T, HV, generator=gen))
    return {n: t.requires_grad_(grad) for n, t in x.items()}


def test_fla_dispatches_to_flashdelta(fla_chunk, caplog):
    """FLA's function, FLA's positional order and keyword arguments: flashdelta's result, bit for bit, and its
    gradients (A_log and dt_bias included)."""
    x = _x(grad=True)
    A_log, dt_bias = torch.randn(4, requires_grad=True), torch.randn(4, requires_grad=True)
    cu = torch.tensor([0, 30, 70])
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], None, None, True, True, True, False, False, cu)
    kw = dict(use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias)
    with caplog.at_level("INFO", logger="fla.backends"):
        o, ht = fla_chunk(*args, **kw)
    o2, ht2 = flashdelta.chunk_gated_delta_rule(*args, **kw)
    assert torch.equal(o, o2) and torch.equal(ht, ht2)
    leaves = list(x.values()) + [A_log, dt_bias]
    g1 = torch.autograd.grad(o.square().sum() + ht.sum(), leaves)
    g2 = torch.autograd.grad(o2.square().sum() + ht2.sum(), leaves)
    assert all(torch.equal(a, b) for a, b in zip(g1, g2))
    assert not any("rejected" in r.getMessage() and "flashdelta" in r.getMessage() for r in caplog.records)


def test_backend_declaration_and_switch(monkeypatch):
    backend = fla_backend.FlashDeltaBackend()
    assert backend.backend_type == "flashdelta" and backend.priority == 2 and backend.is_available()
    monkeypatch.delenv("FLA_FLASHDELTA", raising=False)
    assert backend.is_enabled()
    monkeypatch.setenv("FLA_FLASHDELTA", "0")
    assert not backend.is_enabled()
    assert backend.verify("chunk_gated_delta_rule", **_x()) == (True, None)


# (id, call overrides, reason regex): calls flashdelta does not take as they are, on the CPU
REJECTED = [
    ("cp_context", dict(cp_context=object()), r"cp_context"),
    ("head_first", dict(head_first=False), r"head_first"),
    ("chunk_size", dict(chunk_size=128), r"chunk_size=128 is not one of FLA's"),
    ("unknown-keyword", dict(output_attentions=True), r"unexpected keyword argument 'output_attentions'"),
    ("mixed-dtypes", dict(v=torch.zeros(1, 70, 4, 8, dtype=torch.bfloat16)), r"one dtype for q, k, v"),
    ("not-4d", dict(q=torch.zeros(70, 2, 16)), r"4-D tensors"),
    ("other-device", {n: torch.zeros(s, device="meta") for n, s in
                      (("q", (1, 70, 2, 16)), ("k", (1, 70, 2, 16)), ("v", (1, 70, 4, 8)))},
     r"native kernels for SM90 \(Hopper\) GPUs only; meta"),
]


@pytest.mark.parametrize("over,reason", [c[1:] for c in REJECTED], ids=[c[0] for c in REJECTED])
def test_verifier_rejects_with_a_reason(over, reason):
    ok, why = fla_backend.verify(**dict(_x(), **over))
    assert not ok and why is not None
    assert re.search(reason, why), why


def test_verifier_on_a_hopper_gpu(monkeypatch):
    """On an SM90 device (simulated): calls the SM90 kernels run in full are accepted; a dtype they lack, or a
    backward they lack when an input requires grad, is rejected with the stages and the reason (no silent
    portable-path stages on a GPU)."""
    pytest.importorskip("tilelang")
    monkeypatch.delenv(dispatch.ENV_BACKEND, raising=False)
    monkeypatch.setattr(dispatch, "native_backend", lambda device: "sm90")
    bf16 = dict(K=128, V=128, dtype=torch.bfloat16)
    assert fla_backend.verify(**_x(**bf16)) == (True, None)
    assert fla_backend.verify(**_x(**bf16, grad=True)) == (True, None)
    ok, why = fla_backend.verify(**_x(K=128, V=128))
    assert not ok and "dtype torch.float32 is not supported" in why
    x = _x(K=128, V=256, dtype=torch.bfloat16)
    assert fla_backend.verify(**x) == (True, None)                  # the forward has (128, 256) kernels
    with torch.no_grad():
        assert fla_backend.verify(**_x(K=128, V=256, dtype=torch.bfloat16, grad=True)) == (True, None)
    ok, why = fla_backend.verify(**_x(K=128, V=256, dtype=torch.bfloat16, grad=True))
    assert not ok and "chunk_bwd" in why and "K=128, V=256" in why
    A_log = torch.zeros(4, requires_grad=True)                      # a gradient to A_log needs the backward too
    ok, _ = fla_backend.verify(**x, use_gate_in_kernel=True, A_log=A_log)
    assert not ok
    assert fla_backend.verify(**x, A_log=A_log) == (True, None)     # ignored without the in-kernel gate (as FLA)


def test_verifier_honours_a_forced_backend(monkeypatch):
    monkeypatch.setenv(dispatch.ENV_BACKEND, "sm90")
    ok, why = fla_backend.verify(**_x())
    assert not ok and "needs CUDA tensors on an SM90" in why
    monkeypatch.setenv(dispatch.ENV_BACKEND, "torch")
    x = {n: torch.zeros(t.shape, device="meta") for n, t in _x().items()}
    assert fla_backend.verify(**x) == (True, None)                  # forced portable: runs on any device
