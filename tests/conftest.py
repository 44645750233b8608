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


# The CPU tier's kernel compiles: every test in these files, and any test marked `compile`. Without the CUDA
# toolkit they are skipped with one line saying what is missing and how to get it.
COMPILE_FILES = "test_compile_*.py"


def pytest_addoption(parser):
    parser.addoption("--all-builds", action="store_true",
                     help="the compile tier compiles every kernel build of the GPU tier's cases, not only a subset "
                          "that makes every compile-time choice once (tests/_builds.py `covering`)")


def pytest_configure(config):
    config.addinivalue_line("markers", "compile: compiles Hopper kernels (needs the CUDA toolkit's nvcc, no GPU)")


def _compiles(item) -> bool:
    return fnmatch.fnmatch(item.path.name, COMPILE_FILES) or item.get_closest_marker("compile") is not None


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


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
