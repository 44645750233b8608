"""What the SM90 forward launches (`kernels.sm90.forward_builds`, behind `flashdelta.precompile.variants` and
`flashdelta warmup`) and the SM90 kernel set's declared stages and limits, on the CPU; context parallelism's
`chunk_skip` builds of the fused forward compile (~8 s each) within the default build's register budget. The builds
this file compiles, and their ptxas reports, run in the session's one compile pool (tests/conftest.py `sm90_kernels`,
`sm90_builds` markers)."""
import re

import pytest
import torch

pytest.importorskip("tilelang")

from flashdelta import dispatch, precompile, stages  # noqa: E402
from flashdelta.kernels import chunk_bwd, fused_fwd, fused_fwd_wide, l2norm, prepare, prepare_bwd, sm90  # noqa: E402

SCALE = 128 ** -0.5
# the SM90 forward's dims and dtypes at 2/8 (bf16, fp32 beta and h0) for sm90's build lists
OPTS = dict(head_dim=(128, 128), dtype=torch.bfloat16, beta_dtype=torch.float32, h0_dtype=torch.float32, scale=SCALE)


def test_variants_are_the_launchers_builds():
    """One place says what a forward launches: `variants` lists the launchers' own tables, with the compile keys a
    real call uses."""
    todo = precompile.variants([(2, 4)], dtype=torch.bfloat16, beta_dtype=torch.bfloat16, initial_state=(True,),
                               context_parallel=False)
    assert [label.split()[0] for label, _, _ in todo] == ["l2norm_fwd", "prepare_fwd", "chunk_fwd", "chunk_fwd"]
    assert todo[0][1:] == (l2norm.build, l2norm.builder_args(128, torch.bfloat16))
    fused = fused_fwd.builder_args(2, 4, 128, 128, torch.bfloat16, torch.bfloat16, torch.float32, SCALE, True, False)
    assert todo[2][1:] == (fused_fwd.build, fused)
    assert todo[3][1:] == (fused_fwd_wide.build, fused)     # the API's pick where its CTAs fill waves
    want = prepare.launcher_builds(2, 4, 128, torch.bfloat16, torch.bfloat16, num_sms=132)
    assert precompile.variants([(2, 4)], beta_dtype=torch.bfloat16, num_sms=132, qk_l2norm=False)[:1] == want
    # prepare_fwd once per build the launcher may pick: GVA 8 splits its heads on small grids (and, where context
    # parallelism may split, each again with the squared key norms its warm-up condition reads)
    assert [label.split()[0] for label, _, _ in precompile.variants([(1, 8)], initial_state=(True,),
                                                                    context_parallel=False)].count("prepare_fwd") == 2
    labels = [label for label, _, _ in precompile.variants([(1, 8)], initial_state=(True,), context_parallel=True)
              if label.startswith("prepare_fwd")]
    assert len(labels) == 4 and sum(label.endswith(" norms") for label in labels) == 2
    # both layouts and h0 on/off: four fused builds per head config
    assert len([b for _, b, _ in precompile.variants([(2, 8)], state_v_first=(False, True), context_parallel=False)
                if b is fused_fwd.build]) == 4


def test_variants_backward_adds_the_backward_builds():
    fwd = precompile.variants([(2, 8), (4, 8)], context_parallel=False)
    both = precompile.variants([(2, 8), (4, 8)], backward=True, context_parallel=False)
    assert both[:len(fwd)] == fwd
    assert both[-1:] == prepare_bwd.launcher_builds(8)        # one prepare_bwd build per HV
    # chunk_bwd with and without the final state's gradient (dht is None where the loss does not use the final
    # state), at GVA 4 and at GVA 2 (the build that adds the group itself), in warmup's default dtypes
    want = {chunk_bwd.builder_args(H, 8, 128, 128, torch.bfloat16, torch.float32, SCALE, has_dht, False)
            for H in (2, 4) for has_dht in (False, True)}
    assert {a for _, b, a in both if b is chunk_bwd.build} == want
    assert chunk_bwd.group_add(4, 8) and not chunk_bwd.group_add(2, 8)


WARMUP = dict(dtype=torch.bfloat16, beta_dtype=torch.bfloat16, initial_state=(True,), context_parallel=False)


@pytest.mark.sm90_builds(*precompile.variants([(2, 8)], **WARMUP))
def test_warmup_compiles_the_variants():
    seconds = precompile.warmup([(2, 8)], progress=False, **WARMUP)
    assert seconds >= 0


def test_sm90_kernel_set_stages():
    """The SM90 set has the forward and prepare_bwd (any head dims: it works per value head and token), and its
    limits come from the kernels' own tables."""
    kset = dispatch.load("sm90")
    assert kset is sm90.KERNELS and kset.has(stages.FORWARD) and kset.prepare_bwd is prepare_bwd.prepare_bwd
    assert kset.has(["state_recompute"]) == kset.has(["chunk_bwd"])          # stages.COUPLED ship together
    assert set(kset.head_dims) <= set(fused_fwd.HEAD_DIMS) and (128, 128) in kset.head_dims
    assert kset.unsupported(96, 96, torch.bfloat16) and kset.unsupported(96, 96, torch.bfloat16, "prepare_bwd") is None
    assert "prepare_bwd" not in str(kset.unsupported(96, 96, torch.float32, "prepare_bwd"))


def _forward_and_prepare_bwd_only(monkeypatch):
    """The sm90 set with the forward and prepare_bwd only (whatever backward kernels it has besides)."""
    partial = sm90.KERNELS._replace(state_recompute=None, chunk_bwd=None, chunk_dstate=None, group_sum=None)
    monkeypatch.setitem(dispatch._LOADERS, "sm90", lambda: partial)


def test_auto_resolves_each_stage(monkeypatch):
    """auto on a GPU with the sm90 set: every stage it has and supports on sm90, the rest on the portable path (named
    with the reason); a stage with its own limits (prepare_bwd: any head dims) stays native where the set is not."""
    monkeypatch.delenv(dispatch.ENV_BACKEND, raising=False)
    monkeypatch.setattr(dispatch, "native_backend", lambda device: "sm90")
    _forward_and_prepare_bwd_only(monkeypatch)
    cuda = torch.device("cuda")
    plan = dispatch.plan(cuda, 128, 128, torch.bfloat16, need_bwd=True)
    native = {s for s, b in plan.backends.items() if b == "sm90"}
    assert native == {"l2norm_fwd", "prepare_fwd", "chunk_fwd", "prepare_bwd"}
    assert set(plan.fallback) == {"state_recompute", "chunk_bwd", "chunk_dstate", "group_sum"}
    assert plan.fn("prepare_bwd") is prepare_bwd.prepare_bwd and plan.summary(stages.FORWARD) == "sm90"
    assert dispatch.resolve(cuda, 128, 128, torch.bfloat16, need_bwd=True) == ("sm90", "sm90+torch")
    odd = dispatch.plan(cuda, 96, 96, torch.bfloat16, need_bwd=True)
    assert [s for s, b in odd.backends.items() if b == "sm90"] == ["prepare_bwd"]
    assert "K=96" in odd.fallback["chunk_fwd"]
    assert dispatch.plan(cuda, 128, 128, torch.bfloat16, need_bwd=False).fallback == {}


def test_coupled_stages_move_together(monkeypatch):
    """state_recompute without chunk_bwd (h is backend-private): both run on the portable path."""
    monkeypatch.delenv(dispatch.ENV_BACKEND, raising=False)
    monkeypatch.setattr(dispatch, "native_backend", lambda device: "sm90")
    partial = sm90.KERNELS._replace(state_recompute=lambda *a, **k: None, chunk_bwd=None)
    monkeypatch.setitem(dispatch._LOADERS, "sm90", lambda: partial)
    plan = dispatch.plan(torch.device("cuda"), 128, 128, torch.bfloat16, need_bwd=True)
    assert plan.backends["state_recompute"] == plan.backends["chunk_bwd"] == "torch"
    assert "chunk_bwd" in plan.fallback["state_recompute"]


def test_forced_backend_names_the_missing_stages(monkeypatch):
    _forward_and_prepare_bwd_only(monkeypatch)
    monkeypatch.setenv(dispatch.ENV_BACKEND, "sm90")
    monkeypatch.setenv(dispatch.ENV_ARCH, "sm_90a")
    cuda = torch.device("cuda")
    assert set(dispatch.plan(cuda, 128, 128, torch.bfloat16, need_bwd=False).backends.values()) == {"sm90"}
    with pytest.raises(dispatch.UnsupportedError, match="state_recompute, chunk_bwd, chunk_dstate, group_sum"):
        dispatch.plan(cuda, 128, 128, torch.bfloat16, need_bwd=True)
    with pytest.raises(dispatch.UnsupportedError, match="K=96"):
        dispatch.plan(cuda, 96, 96, torch.bfloat16, need_bwd=False)


def test_kernel_set_by_keyword():
    with pytest.raises(TypeError, match="unknown stages"):
        stages.KernelSet("x", dtypes=(torch.float32,), chunk_fwd_v2=print)
    kset = stages.KernelSet("x", dtypes=(torch.bfloat16,), head_dims=((128, 128),), chunk_fwd=print,
                            prepare_bwd=stages.Stage(print, head_dims=((64, 64),)))
    assert kset.chunk_fwd is print and kset.state_recompute is None and not kset.has_fwd()
    assert kset.unsupported(64, 64, torch.bfloat16, "prepare_bwd") is None
    assert "(prepare_bwd)" in kset.unsupported(128, 128, torch.bfloat16, "prepare_bwd")
    assert kset.param_dtype(torch.float64) is torch.float64


# ----------------------------------------------------------------------------------------- CP's chunk_skip builds

SKIP_BUILDS = {   # CP's M pass alone (identity start, zero values, width K) and the M and E passes in one launch
    "M-h0-skip-zero_v-states": fused_fwd.builder_args(2, 8, 128, 128, torch.bfloat16, torch.float32, torch.float32,
                                                      SCALE, True, False) + (False, True, True, True),
    "ME-noh0-skip-states-transitions": fused_fwd.builder_args(2, 8, 128, 128, torch.bfloat16, torch.float32,
                                                              torch.float32, SCALE, False, False)
    + (False, True, False, True, False, True),
}
TRANSITIONS_BUILD = fused_fwd.builder_args(2, 8, 128, 128, torch.bfloat16, torch.float32, torch.float32, SCALE, False,
                                           False) + (False, False, False, True, False, True)


def _build_and_report(row, tmp_path):
    """A (label, builder, args) row's kernel and its ptxas report (`_builds.ptxas_report`), for a thread pool: the
    builds and their reports run on all cores at once."""
    from _builds import ptxas_report

    label, builder, args = row
    kernel = builder(*args)
    return kernel, ptxas_report(kernel.get_kernel_source(), tmp_path, label.replace(" ", "_"))


@pytest.mark.sm90_builds(*[(name, fused_fwd.build, a) for name, a in SKIP_BUILDS.items()],
                         ("transitions", fused_fwd.build, TRANSITIONS_BUILD), ptxas=())
def test_chunk_skip_builds_compile(tmp_path):
    """CP's builds with the per-(sequence, value head) start chunk: `launcher_builds(chunk_skip=(True,))` lists them
    under their own cache keys (the default builds' arguments are unchanged), CP's M and E passes also with
    `states_only` (no o: no q tensor map, no o row stores), the M pass with zero values (`zero_values`: no v tensor
    map) and both in one launch (`transitions`: the M output `hm` and the M walks' `skip_m`; also without the skip,
    the backward's summaries); they compile for sm_90a, pass the hang checks, read `skip [N, HV]` int32, and ptxas
    keeps the default build's budget (no spills, no stack frame)."""
    import concurrent.futures

    from _builds import hang_checks

    lb = fused_fwd.launcher_builds(2, 8, 128, 128, torch.bfloat16, torch.float32, torch.float32, SCALE,
                                   initial_state=(True, False), chunk_skip=(False, True))
    assert [a for _, _, a in lb] == [fused_fwd.builder_args(2, 8, 128, 128, torch.bfloat16, torch.float32,
                                                            torch.float32, SCALE, h0, False) + extra
                                     for h0 in (True, False) for extra in ((), (False, True))]
    assert lb[3][2] == fused_fwd.builder_args(2, 8, 128, 128, torch.bfloat16, torch.float32, torch.float32, SCALE,
                                              False, False) + (False, True)
    lb_m = fused_fwd.launcher_builds(2, 8, 128, 128, torch.bfloat16, torch.float32, torch.float32, SCALE,
                                     initial_state=(True,), chunk_skip=(True,), zero_values=True, states_only=True)
    lb_e = fused_fwd.launcher_builds(2, 8, 128, 128, torch.bfloat16, torch.float32, torch.float32, SCALE,
                                     initial_state=(False,), chunk_skip=(True,), transitions=True)
    assert [a for _, _, a in lb_m + lb_e] == list(SKIP_BUILDS.values())
    assert lb_m[0][0].endswith(" skip zero_v states") and lb_e[0][0].endswith(" skip states transitions")
    assert [a for _, _, a in fused_fwd.launcher_builds(2, 8, 128, 128, torch.bfloat16, torch.float32, torch.float32,
                                                       SCALE, initial_state=(False,), transitions=True)] == \
        [TRANSITIONS_BUILD]
    assert fused_fwd.launcher_builds(2, 8, 128, 128, torch.bfloat16, torch.float32, torch.float32, SCALE) == \
        lb[::2][::-1], "the default list is the builds without the flag"
    todo = {**SKIP_BUILDS, "ME-noh0-states-transitions": TRANSITIONS_BUILD}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        kernels = dict(zip(todo, pool.map(lambda n: _build_and_report((n, fused_fwd.build, todo[n]), tmp_path), todo)))
    for name, (kernel, report) in kernels.items():
        src = kernel.get_kernel_source()
        assert hang_checks(src, kernel.get_host_source()) == [], name
        sig = src[src.index("chunk_fwd_kernel_kernel("):].split(")", 1)[0]
        assert ("float* __restrict__ hm" in sig) == ("transitions" in name), name
        assert "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" in report, report
        if "skip" not in name:
            continue
        assert "const int* __restrict__ skip" in sig, name
        assert ("const int* __restrict__ skip_m" in sig) == ("transitions" in name), name
        assert re.search(r"int item = seq_order\[\(\(\(int64_t\)\(\(int\)blockIdx\.x\)\) >> \(int64_t\)1\)\];", src), \
            f"{name}: the CTA's (sequence, head) item from the item order (`kernels.item_order`)"
        assert ("v_desc" in sig) == ("zero_v" not in name) and "q_desc" not in sig, name
        assert "fd_store_rows" not in src.split("chunk_fwd_kernel_kernel(", 2)[-1], name


@pytest.mark.sm90_builds(*sm90.starts_builds([(2, 8)], **OPTS), ptxas=())
def test_partition_starts_builds_compile(tmp_path):
    """The training forward's builds that save the backward's partition start states (`partition_starts`): listed
    under their own cache keys (`sm90.starts_builds`, and by `precompile.variants` where CP may split the backward),
    they compile for sm_90a, pass the hang checks, take `starts` fp32, `slot` int32 and the scalar `every`, and keep
    the default build's budget (no spills, no stack frame)."""
    import concurrent.futures

    from _builds import hang_checks

    lb = sm90.starts_builds([(2, 8)], **OPTS)
    assert [a for _, _, a in lb] == [fused_fwd.builder_args(2, 8, 128, 128, torch.bfloat16, torch.float32,
                                                            torch.float32, SCALE, h0, False)
                                     + (False, False, False, False, True) for h0 in (False, True)]
    assert all(label.endswith(" starts") for label, _, _ in lb)
    listed = {(b.__name__, a) for _, b, a in precompile.variants([(16, 32)], backward=True, context_parallel="auto",
                                                                 num_sms=132)}
    assert all((b.__name__, a) in listed for _, b, a in sm90.starts_builds([(16, 32)], **OPTS))
    with concurrent.futures.ThreadPoolExecutor(len(lb)) as pool:
        kernels = list(pool.map(lambda x: _build_and_report(x, tmp_path), lb))
    for (label, _, _), (kernel, report) in zip(lb, kernels):
        src = kernel.get_kernel_source()
        assert hang_checks(src, kernel.get_host_source()) == [], label
        sig = src[src.index("chunk_fwd_kernel_kernel("):].split(")", 1)[0]
        assert "float* __restrict__ starts" in sig and "const int* __restrict__ slot" in sig and "int every" in sig
        assert "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" in report, report


@pytest.mark.parametrize("lengths,ctas,want", [
    ((1, 65, 700, 1500, 3000), 32, [4, 3, 2, 1, 0, 5]),      # longest first, the padding tail's item last
    ((10, 10, 0, 30), 100, [3, 0, 1, 2, 4]),                 # ties by index, the empty sequence before the tail
    ((1, 65, 700, 1500, 3000), 2, [0, 1, 2, 3, 4, 5]),       # one wave: the identity
    ((1, 65, 700, 1500), 33, [0, 1, 2, 3, 4]),               # the sequences fill the 132 SMs, the tail follows
    ((1, 65, 700, 1500), 34, [3, 2, 1, 0, 4]),               # one CTA past a wave: longest first
    ((5000,), 64, [0, 1]),
])
def test_seq_order(lengths, ctas, want):
    """The order per-sequence kernels take the sequences in (kernels/_tl.py `seq_order`): int32, N + 1 items."""
    from flashdelta.kernels import _tl

    cu = torch.tensor([0] + list(lengths), dtype=torch.int32).cumsum(0).to(torch.int32)
    got = _tl.seq_order(cu, ctas)
    assert got.dtype == torch.int32 and got.tolist() == want


@pytest.mark.sm90_builds(*[b for b in sm90.backward_builds([(2, 8)], **OPTS) if b[0].startswith("chunk_fwd")],
                         ptxas=())
def test_saved_states_builds_compile(tmp_path):
    """The training forward's builds that save the backward's chunk states (`save_states`): listed with the backward's
    builds (`sm90.backward_builds`, so `precompile.variants` and `flashdelta warmup` compile them), they compile for
    sm_90a, pass the hang checks, write `hs` by TMA, fit a CTA's 232,448 B of shared memory (two prep-product buffers
    instead of three make room for the state's staging tile) and keep the default build's budget."""
    import concurrent.futures

    from _builds import dyn_smem_bytes, hang_checks

    lb = [b for b in sm90.backward_builds([(2, 8)], **OPTS) if b[0].startswith("chunk_fwd")]
    assert [a for _, _, a in lb] == [fused_fwd.builder_args(2, 8, 128, 128, torch.bfloat16, torch.float32,
                                                            torch.float32, SCALE, h0, False) + (True,)
                                     for h0 in (False, True)]
    assert all("save_states" in label for label, _, _ in lb)
    listed = {(b.__name__, a) for _, b, a in precompile.variants([(16, 32)], backward=True, num_sms=132)}
    assert all((b.__name__, a) in listed for _, b, a in sm90.backward_builds([(16, 32)], **OPTS)
               if b is fused_fwd.build)
    with concurrent.futures.ThreadPoolExecutor(len(lb)) as pool:
        kernels = list(pool.map(lambda x: _build_and_report(x, tmp_path), lb))
    for (label, _, _), (kernel, report) in zip(lb, kernels):
        src, host = kernel.get_kernel_source(), kernel.get_host_source()
        assert hang_checks(src, host) == [], label
        sig = src[src.index("chunk_fwd_kernel_kernel("):].split(")", 1)[0]
        assert "hs_desc" in sig and "q_desc" in sig and "bfloat16_t* __restrict__ o" in sig, label
        assert dyn_smem_bytes(host) <= 232448, (label, dyn_smem_bytes(host))
        assert "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" in report, report


STATES_BASE = fused_fwd.builder_args(2, 8, 128, 128, torch.bfloat16, torch.float32, torch.float32, SCALE, True, False)
STATE_SEQS = STATES_BASE + fused_fwd._flags(True, False, False, False, state_seqs=True)
SAVE_STATES = STATES_BASE + fused_fwd._flags(True, False, False, False)


@pytest.mark.sm90_builds(("state_seqs", fused_fwd.build, STATE_SEQS), ("save_states", fused_fwd.build, SAVE_STATES))
def test_state_seqs_build_compiles():
    """Context parallelism's output pass that saves the backward's chunk states over the whole sequences
    (`save_states` with `state_seqs`): listed where CP lists its backward's builds (`cp.builds`), not for a forward
    alone; it compiles for sm_90a, passes the hang checks, takes ``h_seq [N]`` int32, and its CUDA is the plain
    `save_states` build's but for that argument and the first chunk's slot read from it."""
    import difflib

    from _builds import hang_checks

    from flashdelta import cp

    base, seqs, saves = STATES_BASE, STATE_SEQS, SAVE_STATES
    assert seqs == base + (True, False, False, False, False, False, True)
    keys = {(b.__name__, a) for _, b, a in cp.builds(2, 8, 128, 128, torch.bfloat16, torch.float32, SCALE,
                                                     backward=True)}
    assert (fused_fwd.build.__name__, seqs) in keys
    assert seqs not in {a for _, _, a in cp.builds(2, 8, 128, 128, torch.bfloat16, torch.float32, SCALE)}
    kernel, plain = fused_fwd.build(*seqs), fused_fwd.build(*saves)
    src, host = kernel.get_kernel_source(), kernel.get_host_source()
    assert hang_checks(src, host) == []
    sig = src[src.index("chunk_fwd_kernel_kernel("):].split(")", 1)[0]
    assert "int* __restrict__ h_seq" in sig and "hs_desc" in sig, sig
    assert "h_seq[" in src, "the first chunk's slot comes from h_seq"

    def lines(s):
        # the CUDA with TileLang's temporaries numbered alike (one more in the state_seqs build shifts the rest)
        return [re.sub(r"condval_\d+", "condval", ln) for ln in s.splitlines()]

    diff = list(difflib.unified_diff(lines(plain.get_kernel_source()), lines(src), n=0, lineterm=""))
    added = [ln[1:] for ln in diff if ln.startswith("+") and not ln.startswith("+++")]
    removed = [ln[1:] for ln in diff if ln.startswith("-") and not ln.startswith("---")]
    signature = "chunk_fwd_kernel_kernel("
    assert all(signature in ln or "slot" in ln or "h_seq" in ln or "condval" in ln or "(i_n < N)" in ln
               or ln.strip() in ("} else {", "}") for ln in added), added
    assert all(signature in ln or ("tma_store(hs_desc" in ln and "i_n" in ln) for ln in removed), removed
    assert sum("tma_store(hs_desc" in ln and "slot" in ln for ln in added) == 2, "both state stores at h_seq's slot"
