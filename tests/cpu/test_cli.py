"""`flashdelta check` and `flashdelta warmup` argument handling, on the CPU (portable backend); the command line
reads like a finished tool: usage, --version, described options, one-line errors for what the machine lacks."""
import functools
import logging
import os
import subprocess
import sys

import pytest
import torch

import flashdelta
from flashdelta import cli, dispatch

SRC = os.path.join(os.path.dirname(__file__), "..", "..", "src")

SMALL = ["check", "--device", "cpu", "--seqs", "2", "--tokens", "100", "--heads-qk", "2", "--heads-v", "4",
         "--head-dim", "32"]


def test_check_passes_and_prints_the_table(capsys):
    assert cli.main(SMALL) == 0
    out = capsys.readouterr().out
    assert "backend: forward=torch, backward=torch" in out
    for name in ("o", "ht", "dq", "dk", "dv", "dg", "dbeta", "dh0"):
        assert f"\n{name} " in out
    assert out.rstrip().endswith("result: ok")


def test_check_with_l2norm(capsys):
    assert cli.main(SMALL + ["--l2norm"]) == 0
    out = capsys.readouterr().out
    assert "q/k l2norm in the kernel" in out and out.rstrip().endswith("result: ok")


def test_check_exits_nonzero_on_a_wrong_result(monkeypatch, capsys):
    # perturb the backend's forward only (the float64 reference is built on the same portable code)
    kset = dispatch.load("torch")

    def off_by_a_bit(*args, **kwargs):
        o, ht = kset.chunk_fwd(*args, **kwargs)
        return o * 1.05, ht

    monkeypatch.setitem(dispatch._LOADERS, "torch", lambda: kset._replace(chunk_fwd=off_by_a_bit))
    assert cli.main(SMALL) == 1
    out = capsys.readouterr().out
    assert "MISMATCH" in out.splitlines()[-1]


@pytest.mark.parametrize("heads", ["16", "16/60", "0/8", "a/b"])
def test_warmup_rejects_bad_heads(heads):
    with pytest.raises(SystemExit):
        cli.main(["warmup", "--heads", heads])


def test_warmup_dtype_argument():
    assert cli._dtype("fp16") is torch.float16
    with pytest.raises(Exception, match="dtype must be one of"):
        cli._dtype("int8")


@pytest.mark.parametrize("argv,msg", [
    (["--head-dim", "96"], "head_dim"),
    (["--dtype", "fp32"], "dtype"),
    (["--num-sms", "0"], "num_sms"),
])
def test_warmup_rejects_what_has_no_kernel(argv, msg, capsys):
    """Clear errors before any compile (not a builder's assertion)."""
    assert cli.main(["warmup", "--heads", "2/8", *argv]) == 2
    assert msg in capsys.readouterr().err


@pytest.mark.parametrize("kwargs,exc,msg", [
    (dict(head_dim=(128, 96)), ValueError, "head_dim"),
    (dict(dtype=torch.float32), TypeError, "dtype"),
    (dict(beta_dtype=torch.int32), TypeError, "beta_dtype"),
    (dict(scale=float("nan")), ValueError, "scale"),
    (dict(num_sms=-1), ValueError, "num_sms"),
])
def test_warmup_function_rejects_bad_arguments(kwargs, exc, msg):
    import flashdelta

    with pytest.raises(exc, match=msg):
        flashdelta.warmup([(2, 8)], progress=False, **kwargs)
    with pytest.raises(ValueError, match="heads"):
        flashdelta.warmup([(2, 7)], progress=False)


def test_warmup_num_sms_sizes_the_persistent_prepare():
    """The persistent prepare build's grid is the target GPU's SM count (a cache built on a CPU for an H20 or
    H100 PCIe must say so), its build with the squared key norms too (listed where CP may split, as at 16/16: the
    norms flag after the SM count); float64 beta builds the fp32 kernels the forward runs."""
    from flashdelta.precompile import variants

    for n in (78, 114, 132):
        pipe = [(label, a) for label, _, a in variants([(16, 16)], num_sms=n) if "persistent" in label]
        assert [a[10:] for label, a in pipe if not label.endswith(" norms")] == [(n,)]
        assert all(a[10:] == (n, True) for label, a in pipe if label.endswith(" norms"))
        assert len(pipe) == 2 or n != 132
    assert variants([(2, 8)], beta_dtype=torch.float64) == variants([(2, 8)], beta_dtype=torch.float32)


def test_bare_command_prints_the_usage_and_the_commands(capsys):
    assert cli.main([]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: flashdelta") and "arguments are required" not in err
    for command in ("check", "warmup"):
        assert f"    {command} " in err


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"flashdelta {flashdelta.__version__}"


@pytest.mark.parametrize("command", ["check", "warmup"])
def test_every_option_is_described(command, capsys):
    sub = next(a for a in cli._parser()._actions if a.dest == "cmd").choices[command]
    options = [a for a in sub._actions if a.option_strings and a.dest != "help"]
    assert options and all(a.help for a in options), [a.dest for a in options if not a.help]
    with pytest.raises(SystemExit):
        cli.main([command, "--help"])
    out = capsys.readouterr().out
    for a in options:
        assert a.option_strings[0] in out


def test_check_cuda_without_a_gpu_says_so_in_one_line(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["check", "--device", "cuda"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("flashdelta check: no CUDA device: "), err


@pytest.mark.parametrize("argv,msg", [
    (["--device", "tpu9"], "--device takes cpu or cuda"),
    (["--tokens", "0"], "positive integer"),
])
def test_check_rejects_bad_options(argv, msg, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["check", *argv])
    assert e.value.code == 2 and msg in capsys.readouterr().err


def test_check_heads_must_be_a_multiple(capsys):
    assert cli.main(["check", "--heads-qk", "3", "--heads-v", "4"]) == 2
    assert "--heads-v 4 must be a multiple of --heads-qk 3" in capsys.readouterr().err


def _without_toolkit() -> dict:
    """This process's environment with the CUDA toolkit hidden: CUDA_HOME points nowhere, no nvcc on PATH."""
    path = [d for d in os.environ.get("PATH", "").split(os.pathsep)
            if d and not os.access(os.path.join(d, "nvcc"), os.X_OK)]
    env = {k: v for k, v in os.environ.items() if k != "CUDA_PATH"}
    env.update(CUDA_HOME="/nonexistent", PATH=os.pathsep.join(path),
               PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return env


def test_warmup_without_the_toolkit_says_so_in_one_line():
    pytest.importorskip("tilelang")
    out = subprocess.run([sys.executable, "-m", "flashdelta.cli", "warmup", "--heads", "2/8"], capture_output=True,
                         text=True, env=_without_toolkit())
    err = out.stderr.strip().splitlines()
    assert out.returncode == 1 and len(err) == 1, out.stderr
    assert err[0].startswith("flashdelta warmup: ") and "nvcc" in err[0] and "CUDA_HOME=/nonexistent" in err[0]


def test_warmup_says_per_build_whether_it_compiled(monkeypatch, tmp_path, capsys):
    """One line per build, "compiled" when it added an entry to TileLang's cache, "cached" when it did not; TileLang's
    INFO log lines (one per compile) stay out of the progress."""
    pytest.importorskip("tilelang")
    from flashdelta import precompile, toolkit

    log = logging.getLogger("tilelang.jit.kernel")

    def compiles(name):
        log.info("TileLang begins to compile kernel %s", name)
        (tmp_path / "cache" / name).mkdir(parents=True)

    todo = [("first K=128", compiles, ("a",)), ("second K=128", lambda: None, ()), ("third", compiles, ("b",))]
    monkeypatch.setattr(precompile, "variants", lambda heads, **kw: todo)
    monkeypatch.setattr(toolkit, "missing", lambda: None)
    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path / "cache"))
    assert cli.main(["warmup", "--heads", "2/8"]) == 0
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert lines[0] == f"flashdelta warmup: 3 SM90 kernel builds, TileLang cache {tmp_path / 'cache'}"
    assert [line.split(" (")[0] for line in lines[1:]] == [
        "[1/3] first K=128: compiled", "[2/3] second K=128: cached", "[3/3] third: compiled"]
    assert "TileLang begins" not in out + err and "compiling" not in err
    assert out.strip().endswith("2 compiled, 1 already cached")
    assert logging.getLogger("tilelang").level == logging.INFO  # restored


@pytest.mark.compile
def test_warmup_real_build_prints_no_tilelang_log(monkeypatch, capsys):
    """The first build of `flashdelta warmup --heads 2/8` (the q/k l2norm) compiled for real into the test run's
    TileLang cache, twice: the second time it is cached; no TileLang log line either time."""
    pytest.importorskip("tilelang")
    from flashdelta import precompile

    variants = precompile.variants
    monkeypatch.setattr(precompile, "variants", lambda heads, **kw: variants(heads, **kw)[:1])
    for status in (("compiled", "cached"), ("cached",)):
        assert cli.main(["warmup", "--heads", "2/8"]) == 0
        out, err = capsys.readouterr()
        assert "[TileLang:" not in out + err, out + err
        assert err.splitlines()[1].split(": ")[-1].split(" (")[0] in status, err


# ------------------------------------------------------------------------- warmup: the operator's options, CP

BF16, F32 = torch.bfloat16, torch.float32
SCALE = 128 ** -0.5


def _keys(todo) -> set:
    return {(b.__name__, a) for _, b, a in todo}


def test_warmup_gate_options_are_the_builds_the_forward_launches():
    """With the in-kernel gate and beta activation, `variants` lists prepare's builds with the options (raw gate in
    its dtype, A_log's, dt_bias' or none, beta_act) and the fused forward and backward builds reading the activated
    beta in fp32; without them the builds are today's, and the gate's dtypes count only with the option."""
    pytest.importorskip("tilelang")
    from flashdelta.kernels import fused_fwd, prepare, sm90
    from flashdelta.precompile import variants

    kw = dict(beta_dtype=BF16, num_sms=132, context_parallel=False, backward=True)
    plain = variants([(2, 8)], **kw)
    assert plain == variants([(2, 8)], **kw, g_dtype=BF16, a_log_dtype=BF16, dt_bias_dtype=None)
    assert [a for label, _, a in plain if label.startswith("prepare_fwd")] == [
        a for _, _, a in prepare.launcher_builds(2, 8, 128, BF16, BF16, num_sms=132)]
    gated = variants([(2, 8)], **kw, use_gate_in_kernel=True, g_dtype=BF16, dt_bias_dtype=None,
                     use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True)
    assert [x for x in gated if x[0].startswith("prepare_fwd")] == prepare.launcher_builds(
        2, 8, 128, BF16, BF16, num_sms=132, g_dtype=BF16, a_log_dtype=F32, dt_bias_dtype=None, beta_act=2)
    # the forward's fused builds (the default and the wide ones), then the training forward's that save the
    # backward's states (fp32 beta gated)
    def fused_builds(beta):
        return sum((fused_fwd.launcher_builds(2, 8, 128, 128, BF16, beta, F32, SCALE, **opt)
                    for opt in ({}, dict(wide=True), dict(save_states=True))), [])

    assert [x for x in gated if x[0].startswith("chunk_fwd")] == fused_builds(F32)
    assert [x for x in plain if x[0].startswith("chunk_fwd")] == fused_builds(BF16)
    backward = sm90.backward_builds([(2, 8)], head_dim=(128, 128), dtype=BF16, beta_dtype=F32, h0_dtype=F32,
                                    scale=SCALE)
    assert _keys(backward) <= _keys(gated) and not _keys(backward) <= _keys(plain)
    # float64 gate parameters go into the fp32 kernels; the beta sigmoid alone leaves the gate out
    gate = dict(use_gate_in_kernel=True, dt_bias_dtype=F32)
    assert variants([(2, 8)], **kw, **gate, g_dtype=torch.float64, a_log_dtype=torch.float64) == \
        variants([(2, 8)], **kw, **gate, g_dtype=F32, a_log_dtype=F32)
    sig = [a for label, _, a in variants([(2, 8)], **kw, use_beta_sigmoid_in_kernel=True) if "prepare_fwd" in label]
    assert sig and all(a[6:10] == ("float32", None, None, 1) for a in sig)
    # decode takes the same options (its own kernel activates them, beta's logits in their dtype)
    dec = [a for label, _, a in variants([(2, 8)], **dict(kw, decode=True), **gate, g_dtype=BF16,
                                         use_beta_sigmoid_in_kernel=True) if label.startswith("decode")]
    assert dec and dec == [a for _, _, a in sm90.decode_builds(
        [(2, 8)], head_dim=(128, 128), dtype=BF16, beta_dtype=BF16, h0_dtype=F32, scale=SCALE,
        initial_state=(False, True), g_dtype=BF16, gate=(F32, F32), beta_act=1)]


def test_warmup_cli_passes_the_operator_options(monkeypatch, tmp_path, capsys):
    """`flashdelta warmup`'s options reach `variants` as the API's keywords; the defaults are today's builds (no
    in-kernel options, CP as FLASHDELTA_CP says); a combination the operator rejects exits 2 naming it."""
    pytest.importorskip("tilelang")
    from flashdelta import precompile, toolkit

    seen = []
    monkeypatch.setattr(precompile, "variants", lambda heads, **kw: seen.append(kw) or [])
    monkeypatch.setattr(toolkit, "missing", lambda: None)
    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path / "cache"))
    assert cli.main(["warmup", "--heads", "2/8"]) == 0
    assert cli.main(["warmup", "--heads", "2/8", "--use-gate-in-kernel", "--g-dtype", "bf16", "--a-log-dtype",
                     "fp16", "--dt-bias-dtype", "none", "--use-beta-sigmoid-in-kernel", "--allow-neg-eigval",
                     "--context-parallel", "off"]) == 0
    opts = ("use_gate_in_kernel", "g_dtype", "a_log_dtype", "dt_bias_dtype", "use_beta_sigmoid_in_kernel",
            "allow_neg_eigval", "context_parallel")
    assert [tuple(kw[n] for n in opts) for kw in seen] == [
        (False, F32, F32, F32, False, False, None), (True, BF16, torch.float16, None, True, True, False)]
    monkeypatch.undo()
    capsys.readouterr()
    assert cli.main(["warmup", "--heads", "2/8", "--allow-neg-eigval"]) == 2
    assert "allow_neg_eigval" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["warmup", "--heads", "2/8", "--dt-bias-dtype", "int8"])
    with pytest.raises(SystemExit):
        cli.main(["warmup", "--heads", "2/8", "--context-parallel", "maybe"])


@pytest.mark.parametrize("kwargs,exc,msg", [
    (dict(use_gate_in_kernel=1), TypeError, "use_gate_in_kernel"),
    (dict(allow_neg_eigval=True), ValueError, "allow_neg_eigval"),
    (dict(g_dtype=torch.int32), TypeError, "g_dtype"),
    (dict(a_log_dtype=None), TypeError, "a_log_dtype"),
    (dict(dt_bias_dtype="fp32"), TypeError, "dt_bias_dtype"),
    (dict(context_parallel=0.5), TypeError, "context_parallel"),
    (dict(context_parallel=0), ValueError, "context_parallel"),
])
def test_warmup_function_rejects_bad_options(kwargs, exc, msg):
    pytest.importorskip("tilelang")
    with pytest.raises(exc, match=msg):
        flashdelta.warmup([(2, 8)], progress=False, **kwargs)


def test_warmup_lists_the_cp_builds_where_cp_may_split(monkeypatch):
    """Context parallelism's builds (`cp.builds`) where a call may split: under auto for the heads whose cost model
    splits one long sequence (2/8's forward; 16/64's backward only, without the forward's chunk_skip (the warm-up's
    passes and the overlapped output pass), windows and work-order builds), for every head config when forced, none when off; FLASHDELTA_CP and FLASHDELTA_CP_WARMUP count as at a
    call; with the beta sigmoid CP's builds read fp32 beta."""
    pytest.importorskip("tilelang")
    from flashdelta import cp
    from flashdelta.kernels import cp_windows, fused_fwd, item_order
    from flashdelta.precompile import cp_passes, variants

    monkeypatch.delenv(cp.ENV_CP, raising=False)
    monkeypatch.delenv(cp.ENV_WARMUP, raising=False)
    few = variants([(2, 8)], num_sms=132)
    assert _keys(cp.builds(2, 8, 128, 128, BF16, F32, SCALE)) <= _keys(few)
    assert len(few) == len(_keys(few)), "each build once"
    assert variants([(16, 64)], num_sms=132) == variants([(16, 64)], num_sms=132, context_parallel=False)
    bwd = variants([(16, 64)], num_sms=132, backward=True)
    fwd = functools.partial(fused_fwd.launcher_builds, 16, 64, 128, 128, BF16, F32, F32, SCALE)
    skip = _keys(fwd(initial_state=(False,), chunk_skip=(True,), transitions=True)
                 + fwd(initial_state=(False,), chunk_skip=(True,), states_only=True)       # the overlapped output
                 + fwd(initial_state=(True,), chunk_skip=(True,))                          # pass (`cp._output_
                 + fwd(initial_state=(True,), chunk_skip=(True,), save_states=True, state_seqs=True)  # overlapped`)
                 + cp_windows.launcher_builds(16, 64, 128, BF16, F32)
                 + item_order.launcher_builds(descending=(False,)))
    assert skip and not skip & _keys(bwd)
    assert _keys(cp.builds(16, 64, 128, 128, BF16, F32, SCALE, backward=True)) - skip <= _keys(bwd)
    assert _keys(cp.builds(16, 64, 128, 128, BF16, F32, SCALE)) <= _keys(variants([(16, 64)], num_sms=132,
                                                                                  context_parallel=True))
    sig = variants([(2, 8)], num_sms=132, beta_dtype=BF16, use_beta_sigmoid_in_kernel=True)
    assert _keys(cp.builds(2, 8, 128, 128, BF16, F32, SCALE)) <= _keys(sig)
    monkeypatch.setenv(cp.ENV_CP, "0")
    assert variants([(2, 8)], num_sms=132) == variants([(2, 8)], num_sms=132, context_parallel=False)
    assert _keys(cp.builds(2, 8, 128, 128, BF16, F32, SCALE)) <= _keys(variants([(2, 8)], num_sms=132,
                                                                                context_parallel="auto"))
    # the forward's cost model with the warm-up where FLASHDELTA_CP_WARMUP gives it to q's dtype
    asked = []
    monkeypatch.setattr(cp, "choose", lambda **kw: asked.append(kw["warmup"]) or 0)
    assert cp_passes("auto", 16, 128, 128, BF16, sms=132, backward=False) == (False, False)
    monkeypatch.setenv(cp.ENV_WARMUP, "0")
    cp_passes("auto", 16, 128, 128, BF16, sms=132, backward=False)
    n = len(asked) // 2
    assert n > 0 and asked == [True] * n + [False] * n


def test_cp_builds_follow_the_benchmark_grid():
    """`flashdelta warmup` under auto (bench/precompile.py --grid) lists CP's forward builds for every grid head
    config with a row the cost model splits (bench/shapes.py), and its backward builds wherever a backward row
    splits; it may list more (a sequence longer than the grid's may split: `precompile._may_split`), never less,
    and nothing for heads whose model splits no single sequence up to `precompile.LONGEST_SEQ` tokens."""
    pytest.importorskip("tilelang")
    from flashdelta import cp
    from flashdelta.precompile import LONGEST_SEQ, cp_passes

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
    import shapes

    warm = cp.warmup_threshold(cp.parse_warmup(None), BF16) is not None
    for H, HV, _ in shapes.FWD_HEADS + shapes.BWD_HEADS:
        kw = dict(HV=HV, K=128, V=128, sms=132)
        rows = [dict(T=sum(s), N=len(s), lengths=list(s)) for s in shapes.FWD_SEQLENS]
        fwd = any(cp.choose(**r, **kw, warmup=warm) for r in rows)
        bwd = any(cp.choose_bwd(**r, **kw) for r in rows)
        listed = cp_passes("auto", HV, 128, 128, BF16, sms=132, backward=True)
        assert (fwd <= listed[0]) and (bwd <= listed[1]), (H, HV, listed)
        lengths = [2 ** e for e in range(14, LONGEST_SEQ.bit_length())]
        assert listed[0] <= any(cp.choose(T=n, N=1, seq_len=n, **kw, warmup=warm) for n in lengths), (H, HV)


def _option_builds() -> list:
    """Of the builds `variants` lists with the in-kernel gate, the beta sigmoid and CP, one of each kind these options
    add: prepare with the raw gate and the beta sigmoid, the fused forward with fp32 beta and CP's E pass with
    chunk_skip (states only); none without TileLang."""
    import importlib.util

    if importlib.util.find_spec("tilelang") is None:
        return []
    from flashdelta.precompile import variants

    todo = variants([(2, 8)], beta_dtype=BF16, num_sms=132, use_gate_in_kernel=True, g_dtype=BF16,
                    use_beta_sigmoid_in_kernel=True, context_parallel=True)
    return [next(x for x in todo if x[0].startswith("prepare_fwd")),
            next(x for x in todo if x[0].startswith("chunk_fwd")),
            next(x for x in todo if x[0].startswith("cp ") and x[0].endswith("skip states transitions"))]


def pytest_generate_tests(metafunc):
    if metafunc.function.__name__ == "test_warmup_option_builds_compile":
        from _builds import build_params

        metafunc.parametrize("sm90_build", build_params(_option_builds()))


@pytest.mark.compile
def test_warmup_option_builds_compile(sm90_build, sm90_kernels):
    """Each build of `_option_builds` compiles for sm_90a and passes the hang checks, and the prepare build calls
    both activations (the gate's and beta's). They compile in the session's one compile pool (tests/conftest.py
    `sm90_kernels`) with the compile tier's builds."""
    from _builds import hang_checks, pooled

    label = sm90_build[0]
    kernel = pooled(sm90_kernels, sm90_build)
    src = kernel.get_kernel_source()
    assert hang_checks(src, kernel.get_host_source()) == [], label
    if label.startswith("prepare_fwd"):
        body = src.split('extern "C" __global__')[-1]
        assert "fd_gdn_gate" in body and "fd_beta_act(" in body
