"""The `prepare` builders compile for sm_90a without a GPU (TileLang's kernel cache keeps reruns fast).

Checked in the emitted CUDA: K K^T runs on wgmma in k's dtype, then every warp calls the per-warp inverse (no
thread-dependent branch around it) whose block products are bf16 mma.sync, the shared memory fits the CTAs per
SM the build is sized for (`prepare.min_blocks_for`), and the grid has no y/z dimension that depends on the
number of sequences.
"""
import re

import pytest
import torch
from _helpers import divergent_syncs

pytest.importorskip("tilelang")

from flashdelta.kernels import prepare  # noqa: E402

FWD_VARIANTS = [
    # (H, HV, K, k dtype, beta dtype): the launcher's build (`prepare.builder_args`)
    (16, 64, 128, torch.bfloat16, torch.float32),    # TP1 Qwen3-Next-like group of 4
    (4, 4, 64, torch.float16, torch.bfloat16),       # no grouping, K = 64
    (2, 4, 256, torch.bfloat16, torch.float16),      # K = 256
    (2, 6, 128, torch.bfloat16, torch.float32),      # GVA 3 (27B TP2 / TP1: 8/24, 16/48)
    (16, 16, 128, torch.bfloat16, torch.float32),    # one value head per CTA: 5 CTAs per SM
]
_WGMMA_TYPE = {torch.bfloat16: "kBFloat16", torch.float16: "kFloat16"}


def _ids(v):
    return f"H{v[0]}-HV{v[1]}-K{v[2]}-{str(v[3])[6:]}-beta_{str(v[4])[6:]}"


def _check_fwd_source(src, k_dtype, min_blocks=prepare.MIN_BLOCKS):
    assert not divergent_syncs(src), "a __syncthreads() under a thread-dependent branch"
    wgmma = [line for line in src.splitlines() if "wgmma_ss<" in line]
    assert wgmma and all(_WGMMA_TYPE[k_dtype] in line for line in wgmma), "K K^T must run on wgmma"
    kind = "fd_wy_inverse_warp<true>(" if k_dtype == torch.float16 else "fd_wy_inverse_warp<false>("
    calls = [line for line in src.splitlines() if kind in line]
    assert len(calls) == 1, "one per-warp inverse call, reached by every thread"
    assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in src, "block products: bf16 mma"
    # min_blocks CTAs per SM: 228 KB less 1 KB per CTA each; the last buffer (beta's, <= 2 KB) starts 2 KB below
    assert _dyn_smem_end(src) < (228 // min_blocks - 1 - 2) * 1024
    assert "blockIdx.z" not in src


@pytest.mark.parametrize("v", FWD_VARIANTS, ids=_ids)
def test_prepare_fwd_compiles_sm90(v):
    args = prepare.builder_args(*v)
    min_blocks = prepare.MIN_BLOCKS_ONE_HEAD if v[0] == v[1] else prepare.MIN_BLOCKS
    assert args[-len(prepare.KNOBS):] == (0, min_blocks, False, prepare.PDL_TRIGGER)
    src = prepare.build_fwd(args).get_kernel_source()
    _check_fwd_source(src, v[3], min_blocks)
    assert f"__launch_bounds__(128, {min_blocks})" in src


def _dyn_smem_end(src):
    """The highest `buf_dyn_shmem + offset` the kernel addresses (a lower bound of its shared memory)."""
    return max(int(m) for m in re.findall(r"buf_dyn_shmem \+ (\d+)", src))


def test_prepare_fwd_rounds_of_heads():
    """More value heads per key head than warps (GVA 8): the heads are inverted in rounds of four."""
    src = prepare.build_fwd(prepare.builder_args(1, 8, 128, torch.bfloat16, torch.float32)).get_kernel_source()
    _check_fwd_source(src, torch.bfloat16)
    assert "for (int rnd = 0; rnd < 2; ++rnd)" in src
    assert "rnd" not in prepare.build_fwd(prepare.builder_args(*FWD_VARIANTS[0])).get_kernel_source()


def test_prepare_bwd_compiles_sm90():
    src = prepare._build_prepare_bwd(64, 64).get_kernel_source()
    assert "CumSum2D" in src and "blockIdx.y" not in src


def test_prepare_fwd_rejects_unsupported_head_dim():
    with pytest.raises(AssertionError):
        prepare._build_prepare_fwd.get_tir(4, 2, 96, 64, "bfloat16", "float32")


def test_prepare_fwd_profiled_build():
    """profile=True (bench/profile_prepare.py): timer stamps at every phase, one writable timeline output; the
    launcher's build has none of it."""
    args = prepare.builder_args(*FWD_VARIANTS[0])
    src = prepare.build_fwd(args, profile=True).get_kernel_source()
    assert "int64_t* __restrict__ prof" in src and "const int64_t* __restrict__ prof" not in src
    assert src.count("fd_prof_stamp(prof,") == len(prepare.PROF_EVENTS) - 5 and src.count("fd_prof_cal(prof,") == 2
    assert "fd_prof" not in prepare.build_fwd(args).get_kernel_source()


def test_prepare_fwd_pdl_trigger_switch():
    """pdl=True (programmatic dependent launch, `prepare.PDL_TRIGGER`) lets the next kernel launch early; the
    launcher's build has no trigger while the switch is off."""
    args = prepare.builder_args(*FWD_VARIANTS[0])
    on = prepare.build_fwd(args, pdl=True).get_kernel_source()
    assert on.count("cudaTriggerProgrammaticLaunchCompletion()") == 1 and not divergent_syncs(on)
    default = prepare.build_fwd(args).get_kernel_source()
    assert ("cudaTriggerProgrammaticLaunchCompletion" in default) == prepare.PDL_TRIGGER


@pytest.mark.parametrize("H,HV,hpc", [(16, 64, 1), (16, 64, 2), (2, 6, 1), (1, 8, 4)])
def test_prepare_fwd_heads_per_cta_compiles(H, HV, hpc):
    """Fewer value heads per CTA (small grids): HV / H / hpc CTAs per (chunk slot, key head), same checks."""
    args = prepare.builder_args(H, HV, 128, torch.bfloat16, torch.float32, hpc)
    assert args[-len(prepare.KNOBS)] == hpc
    src = prepare.build_fwd(args).get_kernel_source()
    _check_fwd_source(src, torch.bfloat16)
    assert prepare.builder_args(H, HV, 128, torch.bfloat16, torch.float32, HV // H) == \
        prepare.builder_args(H, HV, 128, torch.bfloat16, torch.float32)   # all heads: the default's cache key


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
        assert picks <= set(prepare.launcher_heads_per_cta(H, HV)), (H, HV)   # what warmup compiles


# (H, HV, K, k dtype, beta dtype): the persistent build (prepare_pipe) the launcher takes up to PIPE_MAX_G value heads
# per key head, and two groupings only tests and the A/B take (GVA 4, GVA 8 in rounds)
PIPE_VARIANTS = [
    (16, 16, 128, torch.bfloat16, torch.float32),    # GVA 1 (16/16), 4 CTAs per SM
    (4, 8, 64, torch.float16, torch.bfloat16),       # GVA 2, K = 64
    (2, 6, 128, torch.bfloat16, torch.float32),      # GVA 3 (8/24, 16/48), 3 CTAs per SM
    (2, 4, 256, torch.bfloat16, torch.float16),      # K = 256
    (16, 64, 128, torch.bfloat16, torch.float32),    # GVA 4 (not the launcher's)
    (1, 8, 128, torch.bfloat16, torch.float32),      # GVA 8: two rounds of four heads
]


@pytest.mark.parametrize("v", PIPE_VARIANTS, ids=_ids)
def test_prepare_fwd_pipe_compiles_sm90(v):
    """The persistent build: K K^T on wgmma from a TMA-loaded key tile, one per-warp inverse call, the producer's
    chunk search and gate cumsum, no block-wide barrier past the mbarrier init, a grid of at most num_sms x
    blocks_per_sm CTAs, and shared memory that fits that many CTAs per SM."""
    from flashdelta.kernels import prepare_pipe

    H, HV, K, k_dtype, _ = v
    G = HV // H
    args = prepare_pipe.builder_args(*v, num_sms=132)
    src = prepare_pipe._build_prepare_fwd_pipe(*args).get_kernel_source()
    wgmma = [line for line in src.splitlines() if "wgmma_ss<" in line]
    assert wgmma and all(_WGMMA_TYPE[k_dtype] in line for line in wgmma)
    kind = "fd_wy_inverse_warp<true>(" if k_dtype == torch.float16 else "fd_wy_inverse_warp<false>("
    assert sum(kind in line for line in src.splitlines()) == 1
    assert "tma_load(k_desc" in src and "expect_transaction" in src and "fd_find_seq(" in src
    assert f"fd_gate_cumsum<{G}>(" in src
    assert src.count("__syncthreads()") == 1 and "blockIdx.y" not in src
    blocks = prepare_pipe.blocks_per_sm(K, G)
    assert f"__launch_bounds__(160, {blocks})" in src
    assert _dyn_smem_end(src) < prepare_pipe.SMEM_PER_SM // blocks - 1024
    assert f"/ {132 * blocks})" in src or f"% {132 * blocks})" in src    # the CTA's items stride the grid
    if G > prepare.NW:
        assert "for (int rnd = 0; rnd < 2; ++rnd)" in src


def test_prepare_launcher_builds():
    """What `flashdelta warmup` compiles for prepare: the one-shot kernel's heads-per-CTA splits and, for PIPE_GVA,
    the persistent build; and where the launcher takes the latter (`use_pipe`)."""
    from flashdelta.kernels import prepare_pipe

    for H, HV in ((16, 16), (8, 24), (2, 6), (16, 32), (16, 64)):
        builds = prepare.launcher_builds(H, HV, 128, torch.bfloat16, torch.float32, num_sms=132)
        one_shot = [prepare.builder_args(H, HV, 128, torch.bfloat16, torch.float32, h)
                    for h in prepare.launcher_heads_per_cta(H, HV)]
        pipe = [prepare_pipe.builder_args(H, HV, 128, torch.bfloat16, torch.float32, num_sms=132)]
        assert [b[2] for b in builds] == one_shot + (pipe if HV // H in prepare.PIPE_GVA else [])
        assert builds[-1][1] is (prepare_pipe._build_prepare_fwd_pipe if HV // H in prepare.PIPE_GVA
                                 else prepare._build_prepare_fwd)
    use = prepare.use_pipe
    assert use(16, 16, 128, 32768, 1, 132) and use(16, 48, 128, 4096 * 8, 8, 132) and use(16, 16, 128, 1024 * 8, 8, 132)
    assert not use(16, 48, 128, 4096, 1, 132)                      # ~2.7 items per CTA: the one-shot kernel
    assert not use(16, 32, 128, 32768, 1, 132) and not use(16, 64, 128, 32768, 1, 132)   # GVA 2, 4
    assert use(16, 16, 128, 8192, 1, 132) and not use(16, 16, 128, 8192, 1, 1000)        # grid size matters
