"""`flashdelta check` and `flashdelta warmup` argument handling, on the CPU (portable backend)."""
import pytest
import torch

from flashdelta import cli, dispatch

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
