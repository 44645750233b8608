"""The benchmark's ``cp`` column for flashdelta (`providers.FlashDelta.cp_partitions`) follows ``FLASHDELTA_CP`` as
the call does: off, a partition length, on (the cost models forced) or auto. CPU only (meta tensors)."""
from __future__ import annotations

import os
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.join(os.path.dirname(HERE), "src"))

import providers  # noqa: E402
from flashdelta import cp  # noqa: E402


def _inputs(h: int, hv: int, seqlens: tuple):
    T = sum(seqlens)
    meta = dict(device="meta")
    return providers.Inputs(q=torch.empty(1, T, h, 128, dtype=torch.bfloat16, **meta),
                            k=torch.empty(1, T, h, 128, dtype=torch.bfloat16, **meta),
                            v=torch.empty(1, T, hv, 128, dtype=torch.bfloat16, **meta), g=None, beta=None, h0=None,
                            cu=None, cu_host=None, seqlens=seqlens, scale=128 ** -0.5)


def _parts(seqlens, L):
    return max(-(-n // (64 * L)) for n in seqlens) if L else 1


ROWS = [(2, 8, (32768,)), (16, 32, (8192,)), (16, 64, (32768,)), (4, 16, (3000, 200, 28000))]


@pytest.mark.parametrize("h,hv,seqlens", ROWS, ids=[f"{h}/{hv} {'+'.join(map(str, s))}" for h, hv, s in ROWS])
def test_cp_column_follows_the_request(h, hv, seqlens, monkeypatch):
    prov = providers.FlashDelta()
    inp = _inputs(h, hv, seqlens)
    kw = dict(T=sum(seqlens), N=len(seqlens), HV=hv, K=128, V=128, sms=132, lengths=list(seqlens))
    monkeypatch.delenv(cp.ENV_WARMUP, raising=False)
    monkeypatch.delenv(cp.ENV_CP, raising=False)
    auto = cp.auto_lengths(**kw)
    assert [prov.cp_partitions(inp, train=t) for t in (False, True)] == [_parts(seqlens, L) for L in auto]
    monkeypatch.setenv(cp.ENV_CP, "0")
    assert prov.cp_partitions(inp, train=False) == prov.cp_partitions(inp, train=True) == 1
    monkeypatch.setenv(cp.ENV_CP, "8")                      # 8 chunks: 512 tokens a partition, both passes
    assert prov.cp_partitions(inp, train=False) == prov.cp_partitions(inp, train=True) == _parts(seqlens, 8)
    monkeypatch.setenv(cp.ENV_CP, "1")
    forced = cp.auto_lengths(**kw, force=True)
    assert min(forced) > 0
    assert [prov.cp_partitions(inp, train=t) for t in (False, True)] == [_parts(seqlens, L) for L in forced]
    monkeypatch.setenv(cp.ENV_CP, "sometimes")
    with pytest.raises(ValueError, match=cp.ENV_CP):
        prov.cp_partitions(inp, train=False)


def test_the_rows_differ_by_request(monkeypatch):
    """The column would have hidden the request: 16/64 1x32768 stays serial under auto in the forward and splits
    when forced or at an explicit length."""
    prov = providers.FlashDelta()
    inp = _inputs(16, 64, (32768,))
    monkeypatch.delenv(cp.ENV_WARMUP, raising=False)
    monkeypatch.delenv(cp.ENV_CP, raising=False)
    assert prov.cp_partitions(inp, train=False) == 1
    monkeypatch.setenv(cp.ENV_CP, "1")
    assert prov.cp_partitions(inp, train=False) > 1
    monkeypatch.setenv(cp.ENV_CP, "64")
    assert prov.cp_partitions(inp, train=False) == 8
