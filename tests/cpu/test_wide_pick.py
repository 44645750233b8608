"""The unsplit inference forward's pick of the wide fused-forward build (one CTA per (sequence, value head) for all
of V = 128, `chunk_fwd(wide=True)`): the cost model (`cp_model.wide_pays`) against the rows the GPU measured, the
flag the API's code carries to the forward op (`cp.with_wide`, `cp.wide`), and the op's launch under it. The wide
build's outputs equal the default build's bit for bit (tests/gpu/test_fwd_wide.py), so the pick changes only time."""
import pytest
import torch
from _helpers import Case, make_inputs

from flashdelta import autograd, cp, cp_model

# (HV, tokens per sequence, sequences, wide / default measured): H = 16, K = V = 128, bf16, the fused kernel alone,
# CUDA-graph medians on an H100 80GB (132 SMs) at 4949364: bench/results/h100/2026-12-07_4949364_wide_ab.txt
MEASURED = [
    (64, 8192, 4, 0.977), (64, 1024, 8, 0.909), (32, 8192, 4, 0.974), (64, 32768, 1, 1.898), (64, 16384, 2, 0.950),
    (64, 4096, 4, 0.965), (32, 1024, 8, 0.940), (32, 4096, 2, 1.840), (16, 8192, 4, 1.734), (32, 8192, 3, 1.028),
    (16, 4096, 6, 0.973), (32, 2048, 4, 0.853), (16, 1024, 8, 0.820), (32, 4096, 5, 1.347), (64, 8192, 1, 1.856),
]


def _pays(HV, seq, N, **kw):
    return cp_model.wide_pays(T=seq * N, N=N, HV=HV, K=128, V=128, sms=132, **kw)


@pytest.mark.parametrize("HV,seq,N,ratio", MEASURED, ids=lambda x: str(x))
def test_wide_pays_only_where_it_measured_faster(HV, seq, N, ratio):
    """Wherever the model picks the wide build it measured faster (by 2% or more); wherever it measured slower the
    model keeps the default, dense (equal lengths from the shapes) and varlen (the host lengths) alike."""
    for kw in (dict(seq_len=seq), dict(lengths=[seq] * N)):
        if _pays(HV, seq, N, **kw):
            assert ratio < 0.98, kw
        if ratio >= 1.0:
            assert not _pays(HV, seq, N, **kw), kw


def test_wide_pays_somewhere_and_follows_the_longest_sequence():
    """The pick is not vacuous (the measured short-sequence rows take it), and one long sequence among short ones,
    whose wide CTAs would each take ~2x a default CTA's time on the critical path, keeps the default."""
    assert sum(_pays(HV, seq, N, seq_len=seq) for HV, seq, N, _ in MEASURED) >= 4
    assert _pays(16, 1024, 64, lengths=[1024] * 64)
    assert not _pays(64, 30000, 1, lengths=[30000])
    assert not cp_model.wide_pays(T=30000 + 8 * 256, N=9, HV=64, K=128, V=128, sms=132, lengths=[30000] + [256] * 8)
    assert not cp_model.wide_pays(T=8 * 1024, N=8, HV=64, K=64, V=64, sms=132, seq_len=1024)    # no wide build
    assert not cp_model.wide_pays(T=0, N=8, HV=64, K=128, V=128, sms=132, seq_len=0)


def test_wide_head_dims_are_the_kernels():
    pytest.importorskip("tilelang")
    from flashdelta.kernels import fused_fwd_wide

    assert cp_model.WIDE_HEAD_DIMS == fused_fwd_wide.HEAD_DIMS


def test_the_code_carries_the_wide_flag():
    for bwd in (0, 5):
        code = cp.with_wide(cp.encode(0, bwd))
        assert cp.wide(code) and not cp.wide(cp.encode(0, bwd))
        assert cp.decode(code) == (0, bwd)
    assert not cp.wide(cp.CP_AUTO) and not cp.wide(cp.CP_ON)
    with pytest.raises(ValueError, match="serial forward"):
        cp.with_wide(cp.encode(8, 0))
    with pytest.raises(ValueError, match="serial forward"):
        cp.with_wide(cp.CP_AUTO)


class _AsSM90:
    """A kernel set that is the portable one under the SM90 set's name, its chunk_fwd recording `wide`."""

    def __init__(self, kset, seen: list):
        self._kset, self._seen, self.name = kset, seen, "sm90"

    def __getattr__(self, attr):
        return getattr(self._kset, attr)

    def chunk_fwd(self, *args, **kw):
        self._seen.append(kw.pop("wide", False))
        return self._kset.chunk_fwd(*args, **kw)


class _Plan:
    def __init__(self, plan, chunk_fwd_set):
        self._plan, self._set = plan, chunk_fwd_set
        self.backends, self.native, self.fallback = plan.backends, plan.native, plan.fallback

    def kset(self, stage):
        return self._set if stage == "chunk_fwd" else self._plan.kset(stage)

    def fn(self, stage):
        return getattr(self.kset(stage), stage)


@pytest.mark.parametrize("wide,need_bwd", [(True, False), (False, False), (True, True)])
def test_the_forward_op_launches_what_the_code_says(wide, need_bwd, monkeypatch):
    """With the flag and no gradient, the unsplit forward launches chunk_fwd(wide=True); without it, or where the
    forward saves for a backward, the default; the outputs are the same."""
    x = make_inputs(Case("dense", (192, 192), H=2, HV=4, K=128, V=128, varlen=False, h0=False), dtype=torch.float32)
    real = autograd._plan
    seen: list = []

    def plan(q, v, need):
        p = real(q, v, need)
        return _Plan(p, _AsSM90(p.kset("chunk_fwd"), seen))

    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], None, None, 128 ** -0.5, False, False, need_bwd)
    want = autograd._chunk_gdn_fwd(*args, 0)[:2]
    monkeypatch.setattr(autograd, "_plan", plan)
    got = autograd._chunk_gdn_fwd(*args, cp.with_wide(0) if wide else 0)[:2]
    assert seen == [wide and not need_bwd]
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
