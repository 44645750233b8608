"""The fused forward builder compiles for SM90 without a GPU, and the emitted CUDA is the warp-specialized kernel
(register-A wgmma, TMA loads on mbarriers, setmaxnreg, async-proxy fences). A few variants keep this short; the
GVA ratios of the benchmark grid that no other test builds (3: 8/24, 16/48) compile here too."""
import pytest

pytest.importorskip("tilelang")

from flashdelta.kernels import fused_fwd  # noqa: E402

import torch  # noqa: E402
from _helpers import divergent_syncs  # noqa: E402

SCALE = 128 ** -0.5

# builder_args(H, HV, K, V, dtype, beta dtype, h0 dtype, scale, has_initial_state, state_v_first): exactly the
# compile keys the launcher uses.
VARIANTS = {
    "bf16-gva2-h0": fused_fwd.builder_args(2, 4, 128, 128, torch.bfloat16, torch.bfloat16, torch.float32, SCALE,
                                           True, False),
    "fp16-noh0-vfirst": fused_fwd.builder_args(4, 4, 128, 128, torch.float16, torch.float32, torch.float32, SCALE,
                                               False, True),
    "bf16-gva3-h0-v256": fused_fwd.builder_args(2, 6, 128, 256, torch.bfloat16, torch.float32, torch.float32, SCALE,
                                                True, False),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_compiles_warp_specialized(name):
    kernel = fused_fwd._build_chunk_fwd(*VARIANTS[name])
    src = kernel.get_kernel_source()
    assert "wgmma_rs" in src and "wgmma_ss" in src            # state GEMMs take S^T / Vd^T from registers
    assert "warpgroup_reg_alloc" in src and "warpgroup_reg_dealloc" in src   # setmaxnreg
    assert "tma_load" in src and "expect_transaction" in src  # producer: TMA on mbarriers
    assert "fence_proxy_async" in src
    # role branches synchronise only through mbarriers: the one block-wide barrier follows mbarrier init
    assert src.count("__syncthreads()") == 1


def test_warmup_builds_the_launcher_variants():
    import flashdelta
    from flashdelta.kernels.warmup import variants

    todo = variants([(2, 4)], dtype=torch.bfloat16, beta_dtype=torch.bfloat16, initial_state=(True,))
    # prepare_fwd once per heads-per-CTA split the launcher may pick (all of them for HV / H = 2: one warp each)
    assert [label.split()[0] for label, _, _ in todo] == ["l2norm_fwd", "prepare_fwd", "chunk_fwd"]
    assert todo[2][2] == VARIANTS["bf16-gva2-h0"]  # the same cache key as a real call
    assert [label.split()[0] for label, _, _ in variants([(1, 8)], initial_state=(True,))].count("prepare_fwd") == 2
    seconds = flashdelta.warmup([(2, 4)], dtype=torch.bfloat16, beta_dtype=torch.bfloat16, initial_state=(True,),
                                progress=False)
    assert seconds >= 0


def test_profiled_variant_reads_timers():
    """profile=True (the chunk_fwd_profiled development build) compiles, and only it reads the SM clock: one
    predicated %clock64 stamp per role event, %globaltimer for the cycle -> ns calibration, the extra output."""
    kernel = fused_fwd.build(VARIANTS["bf16-gva2-h0"], profile=True)
    src = kernel.get_kernel_source()
    assert "%%clock64" in src and "%%globaltimer" in src
    assert "int64_t* __restrict__ prof" in src                    # the timeline output, writable
    roles = [e for e in fused_fwd.PROF_EVENTS if not e.startswith("m.")]
    assert src.count("fd_prof_stamp(prof,") >= len(roles)        # every role event stamped at least once
    assert src.count("fd_prof_cal(prof,") == 2
    assert src.count("__syncthreads()") == 1                     # still no block-wide barrier in the roles
    plain = fused_fwd._build_chunk_fwd(*VARIANTS["bf16-gva2-h0"]).get_kernel_source()
    assert "fd_prof" not in plain and "clock64" not in plain


@pytest.mark.parametrize("K,dtype", [(128, torch.bfloat16), (64, torch.float16), (256, torch.bfloat16)])
def test_l2norm_compiles(K, dtype):
    """The q/k normalisation kernel: 16-byte vector loads/stores, a 64-bit row index, a cross-thread row sum."""
    from flashdelta.kernels import l2norm

    src = l2norm._build_l2norm_fwd(*l2norm.builder_args(K, dtype)).get_kernel_source()
    assert "uint4" in src and "int64_t" in src and "AllReduce" in src and "rsqrtf" in src
    assert not divergent_syncs(src)


def test_state_warpgroup_forms_w_s0():
    """W S0 is formed in the state warpgroup (Y = S0^T K^T, then Vd^T += Y Ae^T): the prep warpgroup stores the
    64 x 64 Ae; no 64 x K Xn buffer exists. The store warp copies o rows with the PTX row loop."""
    src = fused_fwd._build_chunk_fwd(*VARIANTS["bf16-gva2-h0"]).get_kernel_source()
    assert "ae_s" in src and "y_f" in src and "xn_s" not in src
    assert "fd_store_rows(" in src and "cp.async.bulk" not in src


def test_split_store_switch():
    """split_store=True (`fused_fwd.SPLIT_STORE`): two store warps share each chunk's o rows (o_empty counts both);
    the launcher's build keeps one until measured."""
    on = fused_fwd.build(VARIANTS["bf16-gva2-h0"], split_store=True).get_kernel_source()
    assert on.count("fd_store_rows((") == 2 and "o_empty[0].init(64)" in on
    default = fused_fwd._build_chunk_fwd(*VARIANTS["bf16-gva2-h0"]).get_kernel_source()
    assert (default.count("fd_store_rows((") == 2) == fused_fwd.SPLIT_STORE


def test_pout_triple_switch():
    """pout_triple=True (`fused_fwd.POUT_TRIPLE`): three buffers for the prep warpgroup's products (ae_s, pg_s,
    r_s, dq_s, el_s) with prep_done / pout_empty to match; the launcher's build keeps two until measured."""
    src = fused_fwd.build(VARIANTS["bf16-gva2-h0"], pout_triple=True).get_kernel_source()
    assert "prep_done[2].init(128)" in src and "pout_empty[2].init(128)" in src and "prep_done[(c_1 % 3)]" in src
    default = fused_fwd._build_chunk_fwd(*VARIANTS["bf16-gva2-h0"]).get_kernel_source()
    assert ("prep_done[2]" in default) == fused_fwd.POUT_TRIPLE


def test_build_with_rejects_out_of_step_arguments():
    """A switch list or argument tuple that does not line up with the builder's parameters raises instead of
    shifting every switch onto its neighbour (session 9 hit this while adding a switch)."""
    from flashdelta.kernels import _tl

    args = VARIANTS["bf16-gva2-h0"]
    for bad_args, names in ((args[:-1], fused_fwd.SWITCHES), (args, fused_fwd.SWITCHES[:-1]),
                            (args, fused_fwd.SWITCHES[::-1])):
        with pytest.raises(TypeError, match="out of step with _build_chunk_fwd"):
            _tl.build_with(fused_fwd._build_chunk_fwd, bad_args, names, {})


def test_pdl_sync_switch():
    """pdl=True (`fused_fwd.PDL_SYNC`): every thread waits for the previous grid right after the barrier setup,
    before any global read; off in the launcher's build until measured."""
    on = fused_fwd.build(VARIANTS["bf16-gva2-h0"], pdl=True).get_kernel_source()
    assert on.count("cudaGridDependencySynchronize()") == 1
    body = on[on.index("cudaGridDependencySynchronize()"):]
    head = on[on.index("__global__"):on.index("cudaGridDependencySynchronize()")]
    assert "cu_seqlens[" not in head and "h0[" not in head and "cu_seqlens[" in body
    default = fused_fwd._build_chunk_fwd(*VARIANTS["bf16-gva2-h0"]).get_kernel_source()
    assert ("cudaGridDependencySynchronize" in default) == fused_fwd.PDL_SYNC
