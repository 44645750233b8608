"""The `prepare` builders compile for sm_90a without a GPU (TileLang's kernel cache keeps reruns fast).

Checked in the emitted CUDA: K K^T runs on wgmma in k's dtype, the level-2 block products of the inverse run
on bf16 mma (hi/lo splits), and the grid has no y/z dimension that depends on the number of sequences.
"""
import pytest

pytest.importorskip("tilelang")

from flashdelta.kernels import prepare  # noqa: E402

FWD_VARIANTS = [
    # (HV, H, K, BT, k dtype, beta dtype)
    (64, 16, 128, 64, "bfloat16", "float32"),    # TP1 Qwen3-Next-like group of 4
    (4, 4, 64, 64, "float16", "bfloat16"),       # no grouping, K = 64
    (4, 2, 256, 64, "bfloat16", "float16"),      # K = 256
    (6, 2, 128, 64, "bfloat16", "float32"),      # GVA 3 (27B TP2 / TP1: 8/24, 16/48)
]
_WGMMA_TYPE = {"bfloat16": "kBFloat16", "float16": "kFloat16"}


@pytest.mark.parametrize("args", FWD_VARIANTS, ids=lambda a: f"HV{a[0]}-H{a[1]}-K{a[2]}-{a[4]}-beta_{a[5]}")
def test_prepare_fwd_compiles_sm90(args):
    src = prepare._build_prepare_fwd(*args).get_kernel_source()
    wgmma = [line for line in src.splitlines() if "wgmma_ss<" in line]
    assert wgmma and all(_WGMMA_TYPE[args[4]] in line for line in wgmma), "K K^T must run on wgmma"
    mma = [line for line in src.splitlines() if "mma_sync<" in line]
    assert len(mma) >= 6 and all("kBFloat16" in line for line in mma), "level-2 products: bf16 mma"
    assert "blockIdx.z" not in src


def test_prepare_bwd_compiles_sm90():
    src = prepare._build_prepare_bwd(64, 64).get_kernel_source()
    assert "CumSum2D" in src and "blockIdx.y" not in src


def test_prepare_fwd_rejects_unsupported_head_dim():
    with pytest.raises(AssertionError):
        prepare._build_prepare_fwd.get_tir(4, 2, 96, 64, "bfloat16", "float32")


def test_prepare_fwd_profiled_build():
    """profile=True (bench/profile_prepare.py): timer stamps at every phase, one writable timeline output; the
    launcher's build has none of it."""
    args = FWD_VARIANTS[0]
    src = prepare._build_prepare_fwd(*args, 4, 0, True).get_kernel_source()
    assert "int64_t* __restrict__ prof" in src and "const int64_t* __restrict__ prof" not in src
    assert src.count("fd_prof_stamp(prof,") == 9 and src.count("fd_prof_cal(prof,") == 2
    assert "fd_prof" not in prepare._build_prepare_fwd(*args).get_kernel_source()
