"""The `prepare` launcher's choices on the CPU: which kernel and heads-per-CTA split it picks, and that what it may
pick is what `launcher_builds` lists (what `flashdelta warmup` compiles and the CPU tier checks)."""
import pytest
import torch

pytest.importorskip("tilelang")

from flashdelta.kernels import prepare, prepare_oneshot, prepare_pipe  # noqa: E402


def test_pick_heads_per_cta():
    """Up to four value heads per key head (one per warp) always share a CTA; more are split over CTAs (the most
    that take one round) only while the chunks still fit one wave of MIN_BLOCKS CTAs per SM (132 SMs)."""
    pick = prepare.pick_heads_per_cta
    assert prepare.heads_per_cta_options(16, 64) == (4, 2, 1)
    assert prepare.heads_per_cta_options(8, 24) == (3, 1)
    assert prepare.heads_per_cta_options(16, 16) == (1,)
    assert prepare.heads_per_cta_options(1, 8) == (8, 4, 1)
    assert pick(2, 8, 2048) == 4 and pick(4, 16, 2048) == 4 and pick(8, 32, 2048) == 4
    assert pick(16, 64, 32768) == 4 and pick(8, 24, 2048) == 3 and pick(16, 16, 2048) == 1
    assert pick(1, 8, 2048) == 4                                  # 32 chunks x 2 CTAs: one wave, one round each
    assert pick(1, 8, 1 << 20) == 8                               # past a wave: one CTA per key head
    assert pick(1, 8, 2048, num_sms=8) == 8                       # a smaller GPU: the split no longer fits a wave
    for H, HV in ((16, 64), (8, 24), (16, 16), (1, 8), (1, 6)):
        picks = {pick(H, HV, n, num_sms=m) for n in (1, 64, 2048, 1 << 16, 1 << 22) for m in (8, 132)}
        assert picks <= set(prepare.launcher_heads_per_cta(H, HV)), (H, HV)


def test_launcher_builds_and_use_pipe():
    """The one-shot kernel's heads-per-CTA splits and, for PIPE_GVA, the persistent kernel; and where the launcher
    takes the latter (`use_pipe`)."""
    for H, HV in ((16, 16), (8, 24), (2, 6), (16, 32), (16, 64), (1, 8)):
        builds = prepare.launcher_builds(H, HV, 128, torch.bfloat16, torch.float32, num_sms=132)
        one_shot = [(prepare_oneshot.build, prepare_oneshot.builder_args(H, HV, 128, torch.bfloat16, torch.float32, h))
                    for h in prepare.launcher_heads_per_cta(H, HV)]
        pipe = [(prepare_pipe.build, prepare_pipe.builder_args(H, HV, 128, torch.bfloat16, torch.float32,
                                                               num_sms=132))]
        assert [b[1:] for b in builds] == one_shot + (pipe if HV // H in prepare.PIPE_GVA else [])
    use = prepare.use_pipe
    assert use(16, 16, 128, 32768, 1, 132) and use(16, 48, 128, 4096 * 8, 8, 132) and use(16, 16, 128, 1024 * 8, 8, 132)
    assert not use(16, 48, 128, 4096, 1, 132)                      # ~2.7 items per CTA: the one-shot kernel
    assert not use(16, 32, 128, 32768, 1, 132) and not use(16, 64, 128, 32768, 1, 132)   # GVA 2, 4
    assert use(16, 16, 128, 8192, 1, 132) and not use(16, 16, 128, 8192, 1, 1000)        # grid size matters


def test_builder_args():
    """All of a key head's value heads have one compile key however spelled; the one-shot build is sized for 5 CTAs
    per SM with one value head per CTA, else 4; the persistent build's grid is the SM count."""
    for H, HV in ((16, 64), (2, 6), (1, 8)):
        assert prepare_oneshot.builder_args(H, HV, 128, torch.bfloat16, torch.float32, HV // H) == \
            prepare_oneshot.builder_args(H, HV, 128, torch.bfloat16, torch.float32)
        assert prepare_pipe.builder_args(H, HV, 128, torch.bfloat16, torch.float32, HV // H) == \
            prepare_pipe.builder_args(H, HV, 128, torch.bfloat16, torch.float32)
    assert prepare_oneshot.min_blocks(16, 16, 0) == prepare_oneshot.min_blocks(16, 64, 1) == 5
    assert prepare_oneshot.min_blocks(16, 64, 0) == prepare_oneshot.min_blocks(16, 64, 2) == 4
    assert prepare_pipe.builder_args(16, 16, 128, torch.bfloat16, torch.float32, num_sms=78)[6] == 78
    assert prepare_pipe.blocks_per_sm(128, 1) == 4 and prepare_pipe.blocks_per_sm(128, 3) == 3


def test_prepare_fwd_rejects_unsupported_head_dim():
    with pytest.raises(AssertionError):
        prepare_oneshot.build.get_tir(2, 4, 96, "bfloat16", "float32", 0)


def test_prepare_fwd_checks_heads_per_cta():
    k = torch.zeros(1, 64, 2, 128, dtype=torch.bfloat16)
    g = torch.zeros(1, 64, 4)
    with pytest.raises(ValueError, match="heads_per_cta"):
        prepare.prepare_fwd(k, g, g, torch.tensor([0, 64], dtype=torch.int32), heads_per_cta=3)
