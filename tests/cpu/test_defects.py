"""The test suite on a new user's machine: without the CUDA toolkit the compile tier skips with one line saying what
is missing, and a test run's kernels go to a TileLang cache inside the run, never to the user's ~/.tilelang.
Also `flashdelta.toolkit`, which finds nvcc the way TileLang does."""
import os
import subprocess
import sys

import pytest

from flashdelta import toolkit

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def _env(**changes) -> dict:
    """This process's environment with `changes` (None removes a variable) and this checkout's flashdelta first."""
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for name, value in changes.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env


def _path_without_nvcc() -> str:
    return os.pathsep.join(d for d in os.environ.get("PATH", "").split(os.pathsep)
                           if d and not os.access(os.path.join(d, "nvcc"), os.X_OK))


def _pytest(*args, env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:randomly", *args], cwd=ROOT,
                          capture_output=True, text=True, env=env)


def _fake_toolkit(root, name="cuda"):
    home = root / name
    (home / "bin").mkdir(parents=True)
    (home / "include").mkdir()
    (home / "include" / "cuda_runtime.h").write_text("")
    nvcc = home / "bin" / "nvcc"
    nvcc.write_text("#!/bin/sh\n")
    nvcc.chmod(0o755)
    return home


def test_toolkit_found_like_tilelang(monkeypatch, tmp_path):
    """CUDA_HOME (then CUDA_PATH) as given, else the toolkit around nvcc on PATH, else DEFAULT_HOME."""
    home = _fake_toolkit(tmp_path)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setenv("CUDA_HOME", str(home))
    assert toolkit.nvcc() == str(home / "bin" / "nvcc") and toolkit.missing() is None
    monkeypatch.delenv("CUDA_HOME")
    monkeypatch.setenv("CUDA_PATH", str(home))
    assert toolkit.cuda_home() == str(home)
    monkeypatch.delenv("CUDA_PATH")
    monkeypatch.setenv("PATH", str(home / "bin"))
    assert toolkit.cuda_home() == str(home) and toolkit.require() == str(home / "bin" / "nvcc")
    # a bare nvcc link on PATH: the toolkit around the file it points to
    (tmp_path / "links").mkdir()
    os.symlink(home / "bin" / "nvcc", tmp_path / "links" / "nvcc")
    monkeypatch.setenv("PATH", str(tmp_path / "links"))
    assert toolkit.cuda_home() == str(home)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setattr(toolkit, "DEFAULT_HOME", str(home))
    assert toolkit.nvcc() == str(home / "bin" / "nvcc")


@pytest.mark.parametrize("env,says", [
    (dict(CUDA_HOME="/nonexistent"), "CUDA_HOME=/nonexistent has no bin/nvcc"),
    (dict(CUDA_HOME=None), "no nvcc on PATH, CUDA_HOME and CUDA_PATH unset"),
])
def test_toolkit_missing_is_one_line(monkeypatch, tmp_path, env, says):
    monkeypatch.delenv("CUDA_PATH", raising=False)
    for name, value in env.items():
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(toolkit, "DEFAULT_HOME", str(tmp_path / "no-cuda"))
    msg = toolkit.missing()
    assert msg is not None and "\n" not in msg and says in msg and "install the CUDA toolkit" in msg
    with pytest.raises(toolkit.ToolkitMissingError, match="nvcc"):
        toolkit.require()


def test_compile_tier_skips_without_the_toolkit():
    pytest.importorskip("tilelang")
    out = _pytest("tests/cpu/test_compile_tier.py", "-q", "-rs",
                  env=_env(CUDA_HOME="/nonexistent", CUDA_PATH=None, PATH=_path_without_nvcc()))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    summary = out.stdout.strip().splitlines()[-1]
    assert "skipped" in summary and "passed" not in summary and "failed" not in summary, summary
    assert "CUDA_HOME=/nonexistent has no bin/nvcc" in out.stdout


@pytest.mark.compile
def test_test_runs_keep_kernels_out_of_home(tmp_path):
    """A run that compiles a kernel (and one of bench/) with HOME an empty directory and no TILELANG_CACHE_DIR: the
    kernel lands in the run's pytest cache directory, HOME's .tilelang stays empty."""
    pytest.importorskip("tilelang")
    home, cache = tmp_path / "home", tmp_path / "pytest-cache"
    home.mkdir()
    env = _env(HOME=str(home), TILELANG_CACHE_DIR=None)
    out = _pytest("tests/cpu/test_cli.py::test_warmup_real_build_prints_no_tilelang_log", "-q",
                  "-o", f"cache_dir={cache}", env=env)
    assert out.returncode == 0 and "1 passed" in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]
    kernels = [f for _, _, files in os.walk(cache / "d" / "tilelang") for f in files]
    assert kernels, "nothing compiled into the run's cache"
    home_files = [os.path.join(d, f) for d, _, files in os.walk(home / ".tilelang") for f in files]
    assert home_files == []
    bench_cache = tmp_path / "bench-cache"
    out = _pytest("bench", "-q", "--co", "-o", f"cache_dir={bench_cache}", env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert (bench_cache / "d" / "tilelang").is_dir()  # the repository's conftest.py covers bench/ too
