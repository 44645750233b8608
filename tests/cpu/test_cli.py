"""`flashdelta check` and `flashdelta warmup` argument handling, on the CPU (portable backend); the command line
reads like a finished tool: usage, --version, described options, one-line errors for what the machine lacks."""
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
    H100 PCIe must say so), float64 beta builds the fp32 kernels the forward runs."""
    from flashdelta.precompile import variants

    for n in (78, 114, 132):
        pipe = [a for label, _, a in variants([(16, 16)], num_sms=n) if "persistent" in label]
        assert len(pipe) == 1 and pipe[0][-1] == n
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
