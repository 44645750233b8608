"""The `prepare` launcher's choices on the CPU: which kernel and heads-per-CTA split it picks, and that what it may
pick is what `launcher_builds` lists (what `flashdelta warmup` compiles and the CPU tier checks)."""
import re

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
    assert prepare_pipe.builder_args(16, 16, 128, torch.bfloat16, torch.float32, num_sms=78)[-1] == 78
    assert prepare_pipe.blocks_per_sm(128, 1) == 4 and prepare_pipe.blocks_per_sm(128, 3) == 3


def test_prepare_fwd_rejects_unsupported_head_dim():
    with pytest.raises(AssertionError):
        prepare_oneshot.build.get_tir(2, 4, 96, "bfloat16", "float32", 0)


def test_prepare_fwd_checks_heads_per_cta():
    k = torch.zeros(1, 64, 2, 128, dtype=torch.bfloat16)
    g = torch.zeros(1, 64, 4)
    with pytest.raises(ValueError, match="heads_per_cta"):
        prepare.prepare_fwd(k, g, g, torch.tensor([0, 64], dtype=torch.int32), heads_per_cta=3)


# ------------------------------------------------------------------------------------- the in-kernel activations

def _gate_builds() -> dict:
    """label -> (builder, args) of every prepare build with the in-kernel options that the GPU tests launch
    (tests/gpu/test_prepare.py and test_e2e_gpu.py list them in `builds()`; bench/precompile.py --tests compiles
    them through tests/_builds.py)."""
    from _builds import _gpu_test_module

    out = {}
    for stem in ("test_prepare", "test_e2e_gpu"):
        for label, builder, args in _gpu_test_module(stem).builds():
            if builder in (prepare_oneshot.build, prepare_pipe.build):
                out[label] = (builder, args)
    return out


GATE_BUILDS = _gate_builds()


def pytest_generate_tests(metafunc):
    """The gate builds compiled: every one with --all-builds, else those that make each compile-time choice once
    (tests/_builds.py `covering`); the session's compile pool (tests/conftest.py `sm90_kernels`) compiles them with
    the compile tier's builds."""
    if metafunc.function.__name__ == "test_in_kernel_gate_build_compiles_sm90":
        from _builds import build_params, covering

        rows = [(label, b, a) for label, (b, a) in GATE_BUILDS.items()]
        rows = rows if metafunc.config.getoption("--all-builds") else covering(rows)
        metafunc.parametrize("sm90_build", build_params(rows))


def test_in_kernel_gate_build_compiles_sm90(sm90_build, sm90_kernels):
    """Every prepare build with the in-kernel options compiles for sm_90a, passes the hang checks, and calls the
    activations it was built for (the gate's in the cumsum's load, beta's on load)."""
    from _builds import hang_checks, pooled

    kernel = pooled(sm90_kernels, sm90_build)
    src = kernel.get_kernel_source()
    assert hang_checks(src, kernel.get_host_source()) == []
    _, _, args = sm90_build
    _, a_log_dtype, _, beta_act = args[6:10]       # (both builders' option arguments)
    body = src.split('extern "C" __global__')[-1]                              # the kernel, after the preludes
    assert ("fd_gdn_gate" in body) == (a_log_dtype is not None)
    assert ("fd_beta_act(" in body) == bool(beta_act)


def test_gate_builds_cover_every_option():
    """The GPU tests' gate builds span both kernels, every value-head grouping class and every option."""
    args = [a for b, a in GATE_BUILDS.values()]
    assert {b for b, _ in GATE_BUILDS.values()} == {prepare_oneshot.build, prepare_pipe.build}
    assert {a[1] // a[0] for a in args} >= {1, 2, 3, 4, 8}
    assert {a[6] for a in args} == {"bfloat16", "float16", "float32"}          # the raw gate's dtype
    assert {a[7] for a in args} == {None, "bfloat16", "float32"}               # A_log's
    assert {a[8] for a in args} == {None, "float16", "float32"}                # dt_bias'
    assert {a[9] for a in args} == {0, 1, 2}                                   # beta_act


def test_option_arguments():
    """The launcher's option arguments: the defaults are the builds without options (the same compile key spelled
    either way), float64 parameters build the fp32 kernels the launcher converts them to, launcher_builds labels and
    keys the option builds, and a build refuses a raw gate without A_log or dt_bias without A_log."""
    bf16, f32 = torch.bfloat16, torch.float32
    assert prepare.options() == ("float32", None, None, 0)
    assert prepare_oneshot.builder_args(4, 8, 128, bf16, f32, 2) == \
        prepare_oneshot.builder_args(4, 8, 128, bf16, f32, 2, prepare.options())
    assert prepare.options(torch.float64, torch.float64, torch.float64, 2) == ("float32", "float32", "float32", 2)
    assert prepare.options(bf16, torch.float16, None, 1) == ("bfloat16", "float16", None, 1)
    plain = prepare.launcher_builds(16, 48, 128, bf16, f32, num_sms=132)
    gated = prepare.launcher_builds(16, 48, 128, bf16, f32, num_sms=132, g_dtype=bf16, a_log_dtype=f32, beta_act=1)
    assert [b for _, b, _ in plain] == [b for _, b, _ in gated]
    assert all(a[:6] == p[:6] and a[10:] == p[10:] and a[6:10] == ("bfloat16", "float32", None, 1)
               for (_, _, p), (_, _, a) in zip(plain, gated))
    assert all("gate(g bfloat16, A_log float32, dt_bias None) beta_act=1" in label for label, _, _ in gated)
    with pytest.raises(AssertionError, match="pre-activated"):
        prepare_oneshot.build.get_tir(2, 4, 128, "bfloat16", "float32", 0, "bfloat16", None, None, 0)
    with pytest.raises(AssertionError):
        prepare_pipe.build.get_tir(2, 4, 128, "bfloat16", "float32", 0, "float32", None, "float32", 0, 132)


def test_builds_without_options_carry_no_activation():
    """A build without the options has no activation code at all (its TIR is what it was before the options
    existed); each option adds its own inputs: A_log, dt_bias, and the activated beta's output."""
    bf16, f32 = torch.bfloat16, torch.float32
    plain = prepare_oneshot.build.get_tir(*prepare_oneshot.builder_args(2, 6, 128, bf16, f32)).script()
    assert "fd_gdn_gate" not in plain and "fd_beta_act" not in plain and "A_log" not in plain
    assert "beta_out" not in plain
    full = prepare_pipe.build.get_tir(*prepare_pipe.builder_args(2, 6, 128, bf16, f32, 0, 132,
                                                                 prepare.options(bf16, f32, f32, 2))).script()
    assert all(name in full for name in ("A_log", "dt_bias", "beta_out", "fd_gdn_gate_cumsum<3, true>",
                                         "fd_beta_act"))
    nobias = prepare_pipe.build.get_tir(*prepare_pipe.builder_args(2, 6, 128, bf16, f32, 0, 132,
                                                                   prepare.options(f32, f32, None, 0))).script()
    assert "fd_gdn_gate_cumsum<3, false>" in nobias and "dt_bias" not in nobias and "beta_out" not in nobias
    assert "k_norm2" not in plain and "k_norm2" not in full


def test_norms_builds_write_the_key_norms():
    """The builds with the squared key norms (`norms`): the flag appended to the compile key only when set (the
    other builds keep theirs), listed by `launcher_builds(norms=True)` for both kernels, and each compiles with the
    ``k_norm2`` output written from K K^T's diagonal tile, passing the hang checks."""
    from _builds import hang_checks

    bf16, f32 = torch.bfloat16, torch.float32
    assert prepare_oneshot.builder_args(2, 6, 128, bf16, f32, norms=True) == \
        prepare_oneshot.builder_args(2, 6, 128, bf16, f32) + (True,)
    assert prepare_pipe.builder_args(2, 6, 128, bf16, f32, 0, 132, norms=True)[-2:] == (132, True)
    builds = prepare.launcher_builds(4, 12, 128, bf16, f32, num_sms=132, norms=True)
    assert [b for _, b, _ in builds] == [prepare_oneshot.build, prepare_pipe.build]
    assert all(label.endswith(" norms") and a[-1] is True for label, _, a in builds)
    for _, b, a in builds:
        kernel = b(*a)
        src = kernel.get_kernel_source()
        assert hang_checks(src, kernel.get_host_source()) == []
        assert re.search(r"k_norm2\[.*\] = \(\(float\*\)kkd_shared\)", src), "the diagonal of K K^T"
