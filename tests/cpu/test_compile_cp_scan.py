"""CP's scan kernel (`kernels.cp_scan`) on the CPU: four of its builds compile for sm_90a, pass the hang checks,
keep every operand in registers (no ptxas spills, no stack frame) and run their products as tf32 mma.sync, three per
tile (3xTF32); its build table, the V-tile choice, the plan offsets and the launchers' argument checks.

The five builds (~4 s each, compiled with their ptxas reports in the session's one compile pool, tests/conftest.py
`sm90_kernels`): the forward at K = V = 128 with h0 and 16-column tiles, the backward at V = 256 with dht, dh0 and
32-column tiles (the most registers), the forward at K = V = 64 without h0, with the final state, the backward at
K = V = 128 with 8-column tiles (256 threads: 2/8 1x32768's scans), and the forward at 8-column tiles with the head
mask (its CTAs of unmasked heads exit before the first barrier: the barrier count stays two).
tests/gpu/test_cp_scan.py runs them on the GPU.
"""
import re

import pytest
import torch

pytest.importorskip("tilelang")

from _builds import build_params, build_rows, hang_checks, pooled, ptxas_report  # noqa: E402

from flashdelta import cp  # noqa: E402
from flashdelta.kernels import cp_scan  # noqa: E402

BUILDS = {
    "fwd-128-bv16-h0": cp_scan.builder_args(8, 128, 128, 16, reverse=False, has_init=True, store_final=False),
    "bwd-v256-bv32-dht-dh0": cp_scan.builder_args(8, 128, 256, 32, reverse=True, has_init=True, store_final=True),
    "fwd-64-final": cp_scan.builder_args(4, 64, 64, 16, reverse=False, has_init=False, store_final=True),
    "bwd-128-bv8-dht": cp_scan.builder_args(8, 128, 128, 8, reverse=True, has_init=True, store_final=False),
    # the head mask of context parallelism's overlapped forward (`scan_fwd(heads=...)`)
    "fwd-128-bv8-h0-heads": cp_scan.builder_args(8, 128, 128, 8, reverse=False, has_init=True, store_final=False,
                                                 has_heads=True),
}


@pytest.mark.parametrize("sm90_build", build_params(build_rows(cp_scan.build, BUILDS), ptxas=()))
def test_cp_scan_build_compiles_without_spills(sm90_build, sm90_kernels, tmp_path):
    kernel = pooled(sm90_kernels, sm90_build)
    src = kernel.get_kernel_source()
    assert hang_checks(src, kernel.get_host_source()) == []
    K = sm90_build[2][1]
    mmas = re.findall(r"mma_sync<tl::DataType::kTensorFloat32, tl::DataType::kTensorFloat32, "
                      r"tl::DataType::kFloat32, 16, 8, 8,", src)
    # three products (hi hi, hi lo, lo hi), each a k loop of tf32 mma.sync m16n8k8 over the warp's 16 x BV output
    loops = re.findall(r"for \(int ki\w* = 0; ki\w* < (\d+);", src)
    assert loops and len(loops) % 3 == 0, "three products (3xTF32) per k chunk"
    assert mmas and len(mmas) % 3 == 0 and "wgmma" not in src, "the products are tf32 mma.sync m16n8k8"
    assert f"__launch_bounds__({cp_scan.threads(K)}" in src
    assert "cp_async" in src and src.count("__syncthreads()") == 2         # two barriers per step
    assert ("heads[" in src) == (len(sm90_build[2]) > 7), "the head mask is read exactly in its builds"
    report = ptxas_report(src, tmp_path, "cp_scan")
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    assert spills and all(s == ("0", "0") for s in spills), report
    assert re.search(r"\b0 bytes stack frame", report), report
    regs = [int(n) for n in re.findall(r"Used (\d+) registers", report)]
    assert regs and max(regs) <= 65536 // cp_scan.threads(K), report


def test_build_table():
    """`launcher_builds`: forward (and with `backward` the reverse walk) with and without the start value, at the V
    tile `choose_bv` picks (both where N is unknown); head dims outside the kernel's raise."""
    fwd = cp_scan.launcher_builds(8, 128, 128, N=2)
    assert [a for _, _, a in fwd] == [cp_scan.builder_args(8, 128, 128, 16, reverse=False, has_init=h,
                                                           store_final=False) for h in (False, True)]
    assert BUILDS["fwd-128-bv16-h0"] in [a for _, _, a in fwd]
    assert {a[3] for _, _, a in cp_scan.launcher_builds(8, 128, 128, N=1)} == {8}
    both = cp_scan.launcher_builds(8, 128, 128, backward=True)
    assert len(both) == 12 and {a[3] for _, _, a in both} == {8, 16, 32} and {a[4] for _, _, a in both} == {False, True}
    assert {a[3] for _, _, a in cp_scan.launcher_builds(4, 64, 64)} == {16, 32}, "no 8-column tile at K = 64"
    assert all(b is cp_scan.build for _, b, _ in both)
    with pytest.raises(AssertionError):
        cp_scan.build.get_tir(8, 96, 128, 16, False, False, False)


def test_choose_bv_and_unsupported():
    assert cp_scan.choose_bv(1, 8, 128) == 8             # 128 CTAs: one wave of 8-column tiles
    assert cp_scan.choose_bv(1, 16, 128) == 16           # 256 CTAs of 8 columns: 128 of 16
    assert cp_scan.choose_bv(1, 8, 64, K=64) == 16       # no 8-column tile at K = 64
    assert cp_scan.choose_bv(4, 8, 128) == 32            # 256 CTAs of 16 columns: 128 of 32
    assert cp_scan.choose_bv(4, 8, 48) == 16             # V not a multiple of 32
    assert "BV=8" in cp_scan.unsupported(64, 64, 8) and cp_scan.unsupported(128, 128, 8) is None
    assert cp_scan.unsupported(128, 256) is None and cp_scan.unsupported(64, 64, 32) is None
    assert "K=256" in cp_scan.unsupported(256, 128)
    assert "V=40" in cp_scan.unsupported(128, 40)


def test_part_offsets_from_plans():
    """`part_offsets` of `cp.make_plan`'s plans: consecutive slots per sequence, empty sequences with one slot,
    ``part_cu[N]`` the used slots (the rest are the plan's empty partitions)."""
    cu = torch.tensor([0, 3000, 3001, 3701, 3701, 3831, 3895])
    plan = cp.make_plan(cu, 3902, 4)
    part_cu = cp_scan.part_offsets(plan.last_index)
    assert part_cu.dtype == torch.int32 and part_cu.tolist() == [0, 12, 13, 16, 17, 18, 19]
    seq = torch.repeat_interleave(torch.arange(plan.N), part_cu.diff().long())
    assert torch.equal(plan.seq[:19], seq) and plan.P >= 19
    dense = cp.make_plan(torch.arange(3) * 2048, 4096, 8, seq_len=2048)
    assert cp_scan.part_offsets(dense.last_index).tolist() == [0, 4, 8] and dense.P == 8


def test_launcher_argument_checks():
    M, E = torch.zeros(4, 2, 64, 64), torch.zeros(4, 2, 64, 64)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(TypeError, match="E: .*fp32"):
        cp_scan.scan_fwd(M, E.double(), None, cu)
    with pytest.raises(ValueError, match="M: expected"):
        cp_scan.scan_fwd(M[:, :, :32], E, None, cu)
    with pytest.raises(ValueError, match="dht: expected"):
        cp_scan.scan_bwd(M, E, torch.zeros(2, 2, 64, 64), cu)
    with pytest.raises(ValueError, match="part_cu"):
        cp_scan.scan_fwd(M, E, None, cu[:1])
    with pytest.raises(ValueError, match="K=32"):
        cp_scan.scan_fwd(torch.zeros(4, 2, 32, 32), torch.zeros(4, 2, 32, 64), None, cu)
    with pytest.raises(ValueError, match="heads"):
        cp_scan.scan_fwd(M, E, None, cu, heads=torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="heads"):
        cp_scan.scan_fwd(M, E, None, cu, heads=torch.ones(2))


def test_gpu_tier_scan_builds_are_valid():
    """Every scan build the GPU tier asks for (tests/_builds.py `gpu_tier`: the test files' own `builds` lists) is one
    the kernel takes: a V tile its head dims allow (no 8-column tile at K = 64)."""
    from _builds import gpu_tier

    scans = [(label, a) for label, b, a in gpu_tier() if b is cp_scan.build]
    assert scans and any(a[3] == 8 for _, a in scans) and any(a[1] == 64 for _, a in scans)
    for label, (HV, K, V, BV, *_) in scans:
        assert cp_scan.unsupported(K, V, BV) is None, label
