"""The wide fused forward (`chunk_fwd(wide=True)`, kernels/fused_fwd_wide.py) on the CPU: the build lists name it beside
the default build (the API picks it where `cp_model.wide_pays` says), its builds compile for sm_90a and pass the hang checks, its
setmaxnreg targets fill the launch's registers exactly (2 state warpgroups x 192 + prep 96 + producers 32 = 4 x 128),
its shared memory fits one CTA per SM, and ptxas compiles every role at its budget without spills (each role checked
alone, the others' budgets raised, so that a spill names its role). Two builds (~15 s each) compile in the session's
one compile pool (tests/conftest.py `sm90_kernels`) with the ptxas runs of the builds as built; the three runs of the
roles alone (~7 s each) follow in the test."""
import concurrent.futures
import re

import pytest
import torch

pytest.importorskip("tilelang")

from flashdelta import precompile  # noqa: E402
from flashdelta.kernels import fused_fwd, fused_fwd_wide, sm90  # noqa: E402

SCALE = 128 ** -0.5
BUILDS = {   # the benchmark's heads in bf16 K-first with h0; fp16, V-first, no h0 (the other code paths)
    "bf16-h0": fused_fwd.builder_args(16, 64, 128, 128, torch.bfloat16, torch.float32, torch.float32, SCALE, True,
                                      False),
    "fp16-noh0-vfirst": fused_fwd.builder_args(4, 4, 128, 128, torch.float16, torch.float16, torch.float32, SCALE,
                                               False, True),
}
# each role's setmaxnreg statement in the generated CUDA (state: one per warpgroup)
ROLE_REGS = {"state": f"tl::warpgroup_reg_alloc<{fused_fwd_wide.REGS['state']}>();",
             "prep": f"tl::warpgroup_reg_dealloc<{fused_fwd_wide.REGS['prep']}>();",
             "producer": f"tl::warpgroup_reg_dealloc<{fused_fwd_wide.REGS['producer']}>();"}
NO_SPILLS = "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads"


ROWS = [(name, fused_fwd_wide.build, args) for name, args in BUILDS.items()]


@pytest.fixture(scope="module")
def kernels(sm90_kernels):
    """name -> the compiled build, from the session's one compile pool (tests/conftest.py `sm90_kernels`: the tests
    that take this fixture list `ROWS` in their `sm90_builds` markers)."""
    from _builds import pooled

    return {name: pooled(sm90_kernels, row) for name, row in zip(BUILDS, ROWS)}


def test_wide_builds_are_listed_beside_the_default():
    """`launcher_builds(wide=True)` lists the wide builds under the default builds' arguments (their own builder);
    the default list holds none of them; the SM90 forward's builds and `precompile.variants` (what `flashdelta
    warmup` compiles) list both, as the API may pick either (`cp_model.wide_pays`); the wide builder refuses other
    head dims and the training forward's options."""
    args = BUILDS["bf16-h0"]
    lb = fused_fwd.launcher_builds(16, 64, 128, 128, torch.bfloat16, torch.float32, torch.float32, SCALE,
                                   initial_state=(True,), wide=True)
    assert [(b, a) for _, b, a in lb] == [(fused_fwd_wide.build, args)] and lb[0][0].endswith(" wide")
    assert [(b, a) for _, b, a in fused_fwd.launcher_builds(16, 64, 128, 128, torch.bfloat16, torch.float32,
                                                            torch.float32, SCALE, initial_state=(True,))] == \
        [(fused_fwd.build, args)]
    fwd = sm90.forward_builds([(16, 64)], head_dim=(128, 128), dtype=torch.bfloat16, beta_dtype=torch.float32,
                              h0_dtype=torch.float32, scale=SCALE, initial_state=(True,))
    assert [(b, a) for _, b, a in fwd if a == args] == [(fused_fwd.build, args), (fused_fwd_wide.build, args)]
    listed = precompile.variants([(16, 64)], backward=True, num_sms=132)
    assert sum(b is fused_fwd_wide.build for _, b, _ in listed) == 2          # with and without an initial state
    assert not any(b is fused_fwd_wide.build for _, b, _ in precompile.variants([(2, 4)], head_dim=(64, 64)))
    with pytest.raises(AssertionError, match="wide"):
        fused_fwd.launcher_builds(2, 4, 64, 64, torch.bfloat16, torch.float32, torch.float32, SCALE, wide=True)
    with pytest.raises(AssertionError, match="wide"):
        fused_fwd.launcher_builds(2, 4, 128, 128, torch.bfloat16, torch.float32, torch.float32, SCALE,
                                  save_states=True, wide=True)


def _budget(src: str) -> dict:
    """role -> how many times its setmaxnreg statement appears in the CUDA source."""
    return {role: src.count(stmt) for role, stmt in ROLE_REGS.items()}


@pytest.mark.sm90_builds(*ROWS)
def test_wide_builds_compile(kernels):
    """512 threads, one CTA per SM; the roles' setmaxnreg targets (two state warpgroups) sum to the launch's 4 x 128;
    no block-wide barrier past the set-up; shared memory within a CTA's 227 KB; the hang checks pass."""
    from _builds import REGS_PER_SM, dyn_smem_bytes, hang_checks

    regs = fused_fwd_wide.REGS
    assert 2 * regs["state"] + regs["prep"] + regs["producer"] == 4 * (REGS_PER_SM // fused_fwd_wide.THREADS)
    for name, k in kernels.items():
        src, host = k.get_kernel_source(), k.get_host_source()
        assert hang_checks(src, host) == [], name
        assert "__launch_bounds__(512, 1)" in src, name
        assert _budget(src) == {"state": 2, "prep": 1, "producer": 1}, (name, _budget(src))
        assert sorted(int(n) for n in re.findall(r"warpgroup_reg_(?:de)?alloc<(\d+)>", src)) == \
            sorted([regs["state"]] * 2 + [regs["prep"], regs["producer"]]), name
        smem = dyn_smem_bytes(host)
        assert 210 * 1024 <= smem <= 232448, (name, smem)
        # each state warpgroup syncs its own rows of the S0^T tile (named barriers 2 and 3), the prep warpgroup its
        # zeroed rows (1)
        assert {int(i) for i in re.findall(r"__sync_thread_partial\((\d+), 128\)", src)} == {1, 2, 3}, name
        print(f"{name}: {smem} B dynamic shared memory ({smem / 1024:.1f} KB)")


def _raised(src: str, role: str) -> str:
    """The source with every role but `role` at 240 registers (a spill left is then `role`'s)."""
    for other, stmt in ROLE_REGS.items():
        if other != role:
            src = src.replace(stmt, "tl::warpgroup_reg_alloc<240>();")
    return src


@pytest.mark.sm90_builds(*ROWS, ptxas=())
def test_wide_ptxas_no_spills_per_role(kernels, tmp_path):
    """ptxas: the launch at 128 registers a thread, no spills as built; and each role alone at its budget (the others
    raised) without spills, so that a regression names the role that spills."""
    from _builds import ptxas_report

    src = kernels["bf16-h0"].get_kernel_source()
    todo = {"as built": src, **{f"{role} at {fused_fwd_wide.REGS[role]}": _raised(src, role) for role in ROLE_REGS}}
    other = kernels["fp16-noh0-vfirst"].get_kernel_source()
    todo["fp16-noh0-vfirst as built"] = other

    def report(item):
        name, s = item
        return name, ptxas_report(s, tmp_path, re.sub(r"\W", "_", name))

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        reports = dict(pool.map(report, todo.items()))
    for name, rep in reports.items():
        line = " ".join(ln.strip() for ln in rep.splitlines() if "spill loads" in ln or "Used" in ln)
        print(f"{name}: {line}")
        assert NO_SPILLS in rep, f"{name}: {line}"
        if "as built" in name:
            assert re.search(r"Used 128 registers", rep), f"{name}: {line}"


def test_wide_launcher_hands_the_wide_kernel_its_tensors(monkeypatch):
    """`chunk_fwd(wide=True)` (CPU tensors, the kernel replaced by a recorder): the wide builder with the default
    build's arguments, one CTA per (sequence, value head) in `seq_order` over HV CTAs per sequence, o and the final
    state allocated as the default build's and returned as they are; the other options are refused."""
    calls = []

    def fake_build(*args):
        def kernel(*tensors):
            calls.append((args, tensors))
        return kernel

    monkeypatch.setattr(fused_fwd_wide, "build", fake_build)
    T_, H, HV, K, V = 200, 2, 4, 128, 128
    q = torch.zeros(1, T_, H, K, dtype=torch.bfloat16)
    v = torch.zeros(1, T_, HV, V, dtype=torch.bfloat16)
    g = torch.zeros(1, T_, HV)
    beta = torch.zeros(1, T_, HV, dtype=torch.bfloat16)
    A = torch.zeros(1, T_, HV, 64, dtype=torch.bfloat16)
    h0 = torch.zeros(3, HV, K, V)
    cu = torch.tensor([0, 70, 70, 190], dtype=torch.int32)
    o, ht = fused_fwd.chunk_fwd(q, q, v, g, beta, A, h0, cu, scale=SCALE, wide=True)
    (args, tensors), = calls
    assert args == fused_fwd.builder_args(H, HV, K, V, torch.bfloat16, torch.bfloat16, torch.float32, SCALE, True,
                                          False)
    assert len(tensors) == 11 and tensors[-2] is o and tensors[-1] is ht
    assert tuple(o.shape) == (1, T_, HV, V) and tuple(ht.shape) == (3, HV, K, V)
    assert tensors[8].tolist() == [0, 1, 2, 3], "seq_order over N + 1 items (one wave: the identity)"
    with pytest.raises(AssertionError, match="wide"):
        fused_fwd.chunk_fwd(q, q, v, g, beta, A, h0, cu, scale=SCALE, save_states=True, wide=True)
    with pytest.raises(AssertionError, match="wide"):
        fused_fwd.chunk_fwd(q[..., :64], q[..., :64], v[..., :64], g, beta, A, None, cu, scale=SCALE, wide=True)
