"""Backend selection: one table from GPU architecture to kernel set, resolved at call time.

Backends:
- ``torch``: the portable PyTorch chunked path (`flashdelta.portable`), any device, any head dim,
  computing in float32 (float64 for float64 inputs). Forward and backward.
- ``sm90``: the Hopper TileLang kernels (`flashdelta.kernels`). Forward today; stages it does not have yet
  are ``None`` in its `KernelSet`.

``FLASHDELTA_BACKEND`` (``auto`` | ``torch`` | ``sm90``) forces one. With ``auto`` each pass takes the best
backend that has it; a forced backend that lacks a pass or a shape raises `UnsupportedError`, never falls
back. ``FLASHDELTA_ARCH=sm_90a`` overrides the detected architecture (for compiling without a GPU).
Nothing here touches a GPU at import.
"""
from __future__ import annotations

import functools
import os
from typing import Callable, NamedTuple, Optional

import torch

ENV_BACKEND = "FLASHDELTA_BACKEND"
ENV_ARCH = "FLASHDELTA_ARCH"
BACKEND_NAMES = ("auto", "torch", "sm90")


class UnsupportedError(ValueError):
    """The requested backend, architecture or shape has no kernel."""


class KernelSet(NamedTuple):
    """The stage launchers of one backend (see docs/stages.md); ``None`` where the backend lacks one."""
    name: str
    l2norm_fwd: Callable                # q/k normalisation (use_qk_l2norm_in_kernel): x -> (y, rstd)
    prepare_fwd: Optional[Callable]
    chunk_fwd: Optional[Callable]
    state_recompute: Optional[Callable]
    chunk_bwd: Optional[Callable]
    group_sum: Optional[Callable]
    prepare_bwd: Optional[Callable]
    head_dims: Optional[tuple]          # supported (K, V) pairs; None = any
    dtypes: tuple                       # supported q/k/v dtypes
    param_dtypes: Optional[tuple] = None  # beta / initial_state dtypes the launchers take (others go in as fp32)

    def has_fwd(self) -> bool:
        return self.prepare_fwd is not None and self.chunk_fwd is not None

    def has_bwd(self) -> bool:
        return None not in (self.state_recompute, self.chunk_bwd, self.group_sum, self.prepare_bwd)

    def unsupported(self, K: int, V: int, dtype: torch.dtype) -> Optional[str]:
        """Why this kernel set cannot run (K, V, dtype), or None if it can."""
        if self.head_dims is not None and (K, V) not in self.head_dims:
            return f"head dims (K={K}, V={V}) are not supported by backend {self.name!r} (supported: {list(self.head_dims)})"
        if dtype not in self.dtypes:
            return f"dtype {dtype} is not supported by backend {self.name!r} (supported: {list(self.dtypes)})"
        return None


@functools.lru_cache(maxsize=None)
def _torch_set() -> KernelSet:
    from . import portable  # noqa: PLC0415

    return KernelSet("torch", portable.l2norm_fwd_compute, portable.prepare_fwd, portable.chunk_fwd,
                     portable.state_recompute, portable.chunk_bwd, portable.group_sum, portable.prepare_bwd, None,
                     (torch.bfloat16, torch.float16, torch.float32, torch.float64))


@functools.lru_cache(maxsize=None)
def _sm90_set() -> KernelSet:
    from .kernels import SM90_HEAD_DIMS, chunk_fwd, l2norm_fwd, prepare_fwd  # noqa: PLC0415

    return KernelSet("sm90", l2norm_fwd, prepare_fwd, chunk_fwd, None, None, None, None, SM90_HEAD_DIMS,
                     (torch.bfloat16, torch.float16), (torch.bfloat16, torch.float16, torch.float32))


_LOADERS = {"torch": _torch_set, "sm90": _sm90_set}
# Architecture -> native backend. Everything else runs the portable path.
ARCH_TABLE = {(9, 0): "sm90"}


def current_arch(device: torch.device) -> Optional[tuple]:
    """(major, minor) of `device`, honouring FLASHDELTA_ARCH (e.g. ``sm_90a``); None for CPU."""
    override = os.environ.get(ENV_ARCH)
    if override:
        digits = override.lower().removeprefix("sm_").rstrip("a")
        if not digits.isdigit() or len(digits) < 2:
            raise UnsupportedError(f"{ENV_ARCH}={override!r} is not an architecture like 'sm_90a'")
        return int(digits[:-1]), int(digits[-1])
    if device.type != "cuda":
        return None
    return _cuda_capability(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _cuda_capability(index: int) -> tuple:
    return torch.cuda.get_device_capability(index)


def native_backend(device: torch.device) -> Optional[str]:
    """The architecture's own backend for `device` (None: only the portable path)."""
    return ARCH_TABLE.get(current_arch(device)) if device.type == "cuda" else None


def requested_backend() -> str:
    name = os.environ.get(ENV_BACKEND, "auto").strip().lower() or "auto"
    if name not in BACKEND_NAMES:
        raise UnsupportedError(f"{ENV_BACKEND}={name!r} is not one of {BACKEND_NAMES}")
    return name


def load(name: str) -> KernelSet:
    return _LOADERS[name]()


def resolve(device: torch.device, K: int, V: int, dtype: torch.dtype, *, need_bwd: bool) -> tuple:
    """Pick (forward backend name, backward backend name) for one call.

    Forced backends must support everything asked (else `UnsupportedError`); ``auto`` takes the native
    backend of the architecture for each pass it implements and supports, and the portable path otherwise.
    """
    forced = requested_backend()
    if forced != "auto":
        if forced == "sm90":
            arch = current_arch(device)
            if device.type != "cuda" or arch != (9, 0):
                raise UnsupportedError(f"{ENV_BACKEND}=sm90 needs CUDA tensors on an SM90 (Hopper) GPU; "
                                       f"got device {device} (arch {arch})")
        kset = load(forced)
        reason = kset.unsupported(K, V, dtype)
        if reason:
            raise UnsupportedError(f"{ENV_BACKEND}={forced}: {reason}")
        if not kset.has_fwd() or (need_bwd and not kset.has_bwd()):
            missing = "backward" if kset.has_fwd() else "forward"
            raise UnsupportedError(f"{ENV_BACKEND}={forced}: backend {forced!r} has no {missing} kernels yet; "
                                   f"unset {ENV_BACKEND} (auto) to run that pass on the portable path")
        return forced, forced
    native = native_backend(device)
    if native is None:
        return "torch", "torch"
    kset = load(native)
    if kset.unsupported(K, V, dtype):
        return "torch", "torch"
    return ("torch" if not kset.has_fwd() else native), ("torch" if not kset.has_bwd() else native)
