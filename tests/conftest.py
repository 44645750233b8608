import ast
import builtins
import fnmatch
import os
import sys
import threading

import pytest
import torch

from flashdelta import toolkit

sys.path.insert(0, os.path.dirname(__file__))  # tests/_helpers.py

# Kernel outputs are allocated through flashdelta.kernels._tl.alloc, which poisons them with NaN when set.
os.environ.setdefault("FLASHDELTA_POISON", "1")


def _serialize_ast_conversions() -> None:
    """The compile tests build kernels in threads, and TileLang's frontend parses and compiles Python ASTs for every
    build (`ast.parse`, `compile()` of AST nodes). CPython 3.11 keeps the recursion depth of those conversions in
    state the threads share, so two at once can fail a build with "AST constructor recursion depth mismatch"; one
    lock around both (re-entrant: ast.parse calls compile) makes them take turns, and nvcc still runs in parallel."""
    lock = threading.RLock()
    real_compile, real_parse = builtins.compile, ast.parse

    def locked_compile(*args, **kwargs):
        with lock:
            return real_compile(*args, **kwargs)

    def locked_parse(*args, **kwargs):
        with lock:
            return real_parse(*args, **kwargs)

    builtins.compile, ast.parse = locked_compile, locked_parse


_serialize_ast_conversions()


def _has_hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


# The CPU tier's kernel compiles: every test in these files, and any test marked `compile` or `sm90_builds`. Without
# the CUDA toolkit they are skipped with one line saying what is missing and how to get it.
COMPILE_FILES = "test_compile_*.py"


def pytest_addoption(parser):
    parser.addoption("--all-builds", action="store_true",
                     help="the compile tier compiles every kernel build of the GPU tier's cases, not only a subset "
                          "that makes every compile-time choice once (tests/_builds.py `covering`)")


def pytest_configure(config):
    config.addinivalue_line("markers", "compile: compiles Hopper kernels (needs the CUDA toolkit's nvcc, no GPU)")
    config.addinivalue_line("markers", "sm90_builds(*rows, ptxas=None): the (label, builder, args) builds the test "
                                       "compiles, compiled ahead in the session's one compile pool (`sm90_kernels`); "
                                       "ptxas: the -D flags of each build's ptxas_report the test reads, run there too")


def _compiles(item) -> bool:
    return fnmatch.fnmatch(item.path.name, COMPILE_FILES) or any(
        item.get_closest_marker(name) is not None for name in ("compile", "sm90_builds"))


def pytest_collection_modifyitems(config, items):
    gpu_dir = os.path.join(os.path.dirname(__file__), "gpu")
    skip = pytest.mark.skip(reason="needs an NVIDIA Hopper (SM90) GPU")
    hopper = _has_hopper()
    no_toolkit = toolkit.missing()
    for item in items:
        if str(item.fspath).startswith(gpu_dir):
            item.add_marker(pytest.mark.gpu)
        if "gpu" in item.keywords and not hopper:
            item.add_marker(skip)
        elif no_toolkit and _compiles(item):
            item.add_marker(pytest.mark.skip(reason=no_toolkit))


@pytest.fixture(scope="session")
def sm90_kernels(request, tmp_path_factory):
    """The session's one compile of SM90 builds: `_builds.build_key` -> kernel (or the exception its build raised)
    of every build that a selected test lists in its `sm90_builds` markers, each once, all in one pool on all cores
    (`_builds.compile_pool`, with the ptxas reports the markers ask for), when the first such test runs; skipped
    tests' builds are left out. `_builds.pooled` reads a build's kernel; a test may also call the builder itself
    (TileLang's in-memory memo returns the pooled kernel)."""
    from _builds import build_key, compile_pool

    rows, reports = [], {}
    for item in request.session.items:
        if item.get_closest_marker("skip") is not None:
            continue
        for mark in item.iter_markers("sm90_builds"):
            rows += mark.args
            if mark.kwargs.get("ptxas") is not None:
                for _, builder, args in mark.args:
                    reports.setdefault(build_key(builder, args), set()).add(tuple(mark.kwargs["ptxas"]))
    return compile_pool(rows, reports, tmp_path_factory.mktemp("sm90-pool"))


@pytest.fixture(autouse=True)
def _sm90_pool(request):
    """A test marked `sm90_builds` runs after the session's compile pool (`sm90_kernels`)."""
    if request.node.get_closest_marker("sm90_builds") is not None:
        request.getfixturevalue("sm90_kernels")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
