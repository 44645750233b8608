"""The fused forward builder compiles for SM90 without a GPU, and the emitted CUDA is the warp-specialized kernel
(register-A wgmma, TMA loads on mbarriers, setmaxnreg, async-proxy fences). Two variants keep this under a minute."""
import pytest

pytest.importorskip("tilelang")

from flashdelta.kernels import fused_fwd  # noqa: E402

SCALE = 128 ** -0.5

# (H, HV, K, V, BV, BT, dtype, beta dtype, h0 dtype, scale, has_initial_state, state_v_first, store_final_state)
VARIANTS = {
    "bf16-gva2-h0": (2, 4, 128, 128, 64, 64, "bfloat16", "bfloat16", "float32", SCALE, True, False, True),
    "fp16-noh0-vfirst": (4, 4, 128, 128, 64, 64, "float16", "float32", "float32", SCALE, False, True, True),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_compiles_warp_specialized(name):
    kernel = fused_fwd._build_chunk_fwd(*VARIANTS[name], fused_fwd.OVERLAP)
    src = kernel.get_kernel_source()
    assert "wgmma_rs" in src and "wgmma_ss" in src            # state GEMMs take S^T / Vd^T from registers
    assert "warpgroup_reg_alloc" in src and "warpgroup_reg_dealloc" in src   # setmaxnreg
    assert "tma_load" in src and "expect_transaction" in src  # producer: TMA on mbarriers
    assert "fence_proxy_async" in src
    # role branches synchronise only through mbarriers: the one block-wide barrier follows mbarrier init
    assert src.count("__syncthreads()") == 1
