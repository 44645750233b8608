"""`flashdelta check` and `flashdelta warmup` argument handling, on the CPU (portable backend); the command line
reads like a finished tool: usage, --version, described options, one-line errors for what the machine lacks."""
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


def _without_toolkit() -> dict:
    """This process's environment with the CUDA toolkit hidden: CUDA_HOME points nowhere, no nvcc on PATH."""
    path = [d for d in os.environ.get("PATH", "").split(os.pathsep) if d and not os.access(os.path.join(d, "nvcc"), os.X_OK)]
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

