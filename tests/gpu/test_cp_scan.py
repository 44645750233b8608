"""CP's scan kernel (`kernels.cp_scan`) on the GPU, against the float64 scans of `reference.cp` (`scan_states`,
`scan_grads`) and the torch scans of `flashdelta.cp` (`scan_serial`, `scan_grads`) in fp32, on plans from
`cp.make_plan`: dense (one and several sequences), varlen with empty, one-partition and many sequences and unused
slots at the end; with and without h0 / dht and the final state; K = V = 128, K = V = 64, V = 256; both V tiles.

Inputs are random fp32 transitions near a contraction (``0.9 I + 0.1 G / sqrt(K)``, G Gaussian) and Gaussian bias
terms, so the scan neither vanishes nor blows up over the partitions; the float64 reference runs on the same fp32
values. The kernel's 3xTF32 products agree with it to 1e-5 relative L2 error (measured 3.7e-6 at 8 partitions, 7.1e-6
at 32 against an fp32 FMA scan: kernels/cp_scan.py). Unused slots must be exactly 0.

Builds: `builds()`; compile them on the CPU machine with

    TILELANG_CACHE_DIR=.cache/tl-ship python3 bench/precompile.py --tests      # the GPU tier (tests/_builds.py)
"""
import dataclasses

import pytest
import torch
from _helpers import assert_close, random_lengths

from flashdelta import cp
from flashdelta.kernels import cp_scan
from flashdelta.reference import cp as rcp

TOL = 1e-5          # the kernel (3xTF32 products, fp32 states) against float64 on the same inputs


@dataclasses.dataclass(frozen=True)
class ScanCase:
    name: str
    seqlens: tuple
    L: int                      # chunks per partition
    HV: int = 8
    K: int = 128
    V: int = 128
    dense: bool = False
    pad: int = 0                # tokens past cu_seqlens[N] (more unused slots)
    init: bool = True           # h0 / dht
    final: bool = False
    bv: int = None              # None: the launcher's choice


CASES = [
    ScanCase("dense-1x32768-L64", (32768,), 64, dense=True),                            # J = 8, one sequence
    ScanCase("dense-4x8192-L64-final", (8192,) * 4, 64, dense=True, final=True),       # J = 2
    ScanCase("dense-1x8192-L4-noinit-bv32", (8192,), 4, dense=True, init=False, bv=32),  # J = 32
    ScanCase("varlen-edges", (3000, 1, 700, 0, 130, 64), 4, pad=7, final=True),
    ScanCase("varlen-edges-noinit", (3000, 1, 700, 0, 130, 64), 4, pad=300, init=False),
    ScanCase("varlen-edges-bv8-noinit", (3000, 1, 700, 0, 130, 64), 4, pad=7, init=False, final=True, bv=8),
    ScanCase("varlen-many", random_lengths(40, (0, 1, 64, 200, 513, 1500, 4000), seed=3), 4, HV=4, final=True),
    ScanCase("k64", (5000, 700), 8, HV=4, K=64, V=64, final=True),
    ScanCase("k64-bv32-noinit", (5000, 700), 8, HV=4, K=64, V=64, init=False, bv=32),
    ScanCase("v256", (6000, 300), 8, HV=2, V=256, final=True),
    ScanCase("v256-bv32", (6000, 300), 8, HV=2, V=256, bv=32),
]


def _plan(case: ScanCase, device):
    cu = torch.tensor([0] + list(torch.tensor(case.seqlens).cumsum(0).tolist()), device=device)
    T = int(cu[-1]) + case.pad
    plan = cp.make_plan(cu, T, case.L, seq_len=case.seqlens[0] if case.dense else None)
    return plan, rcp.partition(cu.cpu(), case.L)


def _inputs(case: ScanCase, P: int, N: int, device, seed: int = 0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    K, V, HV = case.K, case.V, case.HV
    G = torch.randn(P, HV, K, K, generator=gen, dtype=torch.float64)
    M = (0.9 * torch.eye(K, dtype=torch.float64) + 0.1 * G / K ** 0.5).float()
    X = torch.randn(P, HV, K, V, generator=gen, dtype=torch.float64).float()
    init = torch.randn(N, HV, K, V, generator=gen, dtype=torch.float64).float() if case.init else None
    to = (lambda t: None if t is None else t.to(device))  # noqa: E731
    return to(M), to(X), to(init)


def _check_unused(name, out, used):
    assert torch.equal(out[used:], torch.zeros_like(out[used:])), f"{name}: unused slots are not zero"


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_scan_fwd(case):
    plan, parts = _plan(case, "cuda")
    M, E, h0 = _inputs(case, plan.P, plan.N, "cuda")
    part_cu = cp_scan.part_offsets(plan.last_index)
    used = parts.P
    assert int(part_cu[-1]) == used
    out = cp_scan.scan_fwd(M, E, h0, part_cu, final=case.final, bv=case.bv)
    H, final = out if case.final else (out, None)
    ref_h, ref_final = rcp.scan_states(E[:used].double(), M[:used].double(), parts,
                                       None if h0 is None else h0.double())
    assert_close("h", H[:used], ref_h, tol=TOL)
    _check_unused("H", H, used)
    if case.final:
        assert_close("ht", final, ref_final, tol=TOL)
    serial = cp.scan_serial(M, E, plan, h0)
    assert_close("h", H[:used], serial[:used].double(), tol=TOL)


HEADS_CASES = [CASES[0], CASES[3], CASES[5]]


@pytest.mark.parametrize("case", HEADS_CASES, ids=[c.name for c in HEADS_CASES])
def test_scan_fwd_heads_mask(case):
    """`scan_fwd(heads=...)` walks only the masked heads: their states and final states equal the unmasked scan's
    bit for bit; the other heads' slots are not written (a NaN-filled H stays NaN there)."""
    plan, parts = _plan(case, "cuda")
    M, E, h0 = _inputs(case, plan.P, plan.N, "cuda")
    part_cu = cp_scan.part_offsets(plan.last_index)
    heads = torch.arange(case.HV, device="cuda") % 3 == 1
    full = cp_scan.scan_fwd(M, E, h0, part_cu, final=case.final, bv=case.bv)
    some = cp_scan.scan_fwd(M, E, h0, part_cu, final=case.final, bv=case.bv, heads=heads)
    for name, a, b in zip(("H", "final"), full if case.final else (full,), some if case.final else (some,)):
        assert torch.equal(a[:, heads], b[:, heads]), f"{name}: masked heads differ from the full scan"
        assert bool(b[:parts.P, ~heads].isnan().all()), f"{name}: an unmasked head was written"
    with pytest.raises(ValueError, match="heads"):
        cp_scan.scan_fwd(M, E, h0, part_cu, heads=heads[:-1])


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_scan_bwd(case):
    plan, parts = _plan(case, "cuda")
    M, F, dht = _inputs(case, plan.P, plan.N, "cuda", seed=1)
    part_cu = cp_scan.part_offsets(plan.last_index)
    used = parts.P
    out = cp_scan.scan_bwd(M, F, dht, part_cu, final=case.final, bv=case.bv)
    D, dh0 = out if case.final else (out, None)
    ref_d, ref_dh0 = rcp.scan_grads(F[:used].double(), M[:used].double(), parts,
                                    None if dht is None else dht.double())
    assert_close("dh0", D[:used], ref_d, tol=TOL)
    _check_unused("D", D, used)
    if case.final:
        assert_close("dh0", dh0, ref_dh0, tol=TOL)
    torch_scan = cp.scan_grads(M, F, plan, dht, "serial")
    assert_close("dh0", D[:used], torch_scan[:used].double(), tol=TOL)


def test_scan_in_a_cuda_graph_replays_with_new_lengths():
    """The plan, the offsets and the scan captured in one CUDA graph replay with new sequence lengths (same N and
    T): no host synchronisation anywhere on the path."""
    case = ScanCase("graph", (3000, 1000), 4, HV=4, final=True)
    T, N = 4096 + 64, 2
    cu = torch.tensor([0, 3000, 4000], device="cuda")
    M, E, h0 = _inputs(case, cp.bounds(T, N, case.L)[0], N, "cuda")

    def run():
        plan = cp.make_plan(cu, T, case.L)
        return cp_scan.scan_fwd(M, E, h0, cp_scan.part_offsets(plan.last_index), final=True)

    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        H, final = run()
    for lens in ((3000, 1000), (100, 4000), (0, 4096)):
        cu.copy_(torch.tensor([0, lens[0], lens[0] + lens[1]], device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        parts = rcp.partition(cu.cpu(), case.L)
        ref_h, ref_final = rcp.scan_states(E[:parts.P].double(), M[:parts.P].double(), parts, h0.double())
        assert_close("h", H[:parts.P], ref_h, tol=TOL)
        assert_close("ht", final, ref_final, tol=TOL)
        _check_unused("H", H, parts.P)


def builds() -> list:
    """(label, builder, args) of every build this file launches, without duplicates."""
    out = {}
    todo = CASES + [ScanCase("graph", (3000, 1000), 4, HV=4, final=True)]
    for case in todo:
        plan, _ = _plan(case, "cpu")
        bv = case.bv or cp_scan.choose_bv(plan.N, case.HV, case.V, K=case.K)
        for reverse, mask in ((False, False), (True, False)) + (((False, True),) if case in HEADS_CASES else ()):
            a = cp_scan.builder_args(case.HV, case.K, case.V, bv, reverse=reverse, has_init=case.init,
                                     store_final=case.final, has_heads=mask)
            out.setdefault(a, (f"{case.name}: cp_scan reverse={reverse}" + (" heads" if mask else ""),
                               cp_scan.build, a))
    return list(out.values())
