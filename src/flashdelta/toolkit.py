"""The CUDA toolkit TileLang compiles the Hopper kernels with, and one line saying what is missing when it is not there.

TileLang runs ``<CUDA home>/bin/nvcc`` (compiling needs no GPU). It takes the CUDA home from ``CUDA_HOME`` or
``CUDA_PATH`` when one is set (as given, even if nothing is there), else from the first ``nvcc`` on ``PATH`` (the
directory above its ``bin/``, or above the real file's ``bin/`` when the visible one has no ``include/cuda_runtime.h``
next to it), else ``/usr/local/cuda``. `cuda_home` follows the same order, so `missing` says no exactly when a
compile would fail for want of nvcc. Nothing here imports TileLang or touches a GPU.
"""
from __future__ import annotations

import os
import shutil
from typing import Optional

__all__ = ["DEFAULT_HOME", "ToolkitMissingError", "cuda_home", "missing", "nvcc", "require"]

DEFAULT_HOME = "/usr/local/cuda"
INSTALL = ("install the CUDA toolkit, 12.x or newer (https://developer.nvidia.com/cuda-downloads; no GPU needed), "
           "then set CUDA_HOME to it or put its bin/ on PATH")


class ToolkitMissingError(RuntimeError):
    """The CUDA toolkit's nvcc, which TileLang compiles the Hopper kernels with, is not there."""


def _env_home() -> Optional[tuple]:
    for var in ("CUDA_HOME", "CUDA_PATH"):
        value = os.environ.get(var)
        if value:
            return var, value
    return None


def cuda_home() -> Optional[str]:
    """The CUDA home TileLang would use, or None when it finds none."""
    env = _env_home()
    if env is not None:
        return env[1]
    on_path = shutil.which("nvcc")
    if on_path is not None:
        home = os.path.dirname(os.path.dirname(on_path))
        if os.path.exists(os.path.join(home, "include", "cuda_runtime.h")):
            return home
        return os.path.dirname(os.path.dirname(os.path.realpath(on_path)))
    return DEFAULT_HOME if os.path.exists(DEFAULT_HOME) else None


def nvcc() -> Optional[str]:
    """Path of the nvcc TileLang would run, or None when there is none."""
    home = cuda_home()
    if home is None:
        return None
    path = os.path.join(home, "bin", "nvcc")
    return path if os.path.isfile(path) and os.access(path, os.X_OK) else None


def missing() -> Optional[str]:
    """None when nvcc is there; else one line saying what is missing and how to get it."""
    if nvcc() is not None:
        return None
    env = _env_home()
    if env is not None:
        where = f"{env[0]}={env[1]} has no bin/nvcc"
    elif shutil.which("nvcc") is not None:
        where = f"the nvcc on PATH has no toolkit around it (looked in {cuda_home()})"
    else:
        where = f"no nvcc on PATH, CUDA_HOME and CUDA_PATH unset, no {DEFAULT_HOME}"
    return f"the CUDA toolkit's nvcc, which compiles the Hopper kernels, is missing ({where}): {INSTALL}"


def require() -> str:
    """Path of nvcc; raises `ToolkitMissingError` with the one-line message of `missing` when there is none."""
    path = nvcc()
    if path is None:
        raise ToolkitMissingError(missing())
    return path
