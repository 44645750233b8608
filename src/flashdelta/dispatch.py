"""Backend selection: one table from GPU architecture to native kernel set, resolved per stage at call time.

Backends:
- ``torch``: the portable PyTorch chunked path (`flashdelta.portable`), any device, any head dim,
  computing in float32 (float64 for float64 inputs). Every stage.
- ``sm90``: the Hopper TileLang kernels (`flashdelta.kernels.sm90` declares which stages and shapes).

``FLASHDELTA_BACKEND`` (``auto`` | ``torch`` | ``sm90``) forces one. With ``auto`` each stage of a pass
(`stages.FORWARD`, `stages.BACKWARD`) runs on the architecture's native backend where that backend has the stage
and supports the shape, else on the portable path (stages that share a backend-private tensor, `stages.COUPLED`,
move together); the stage contract (docs/stages.md) makes the mix valid. A forced backend that lacks a stage or a
shape raises `UnsupportedError`, never falls back. ``FLASHDELTA_ARCH=sm_90a`` overrides the detected architecture
(for compiling without a GPU). Nothing here touches a GPU at import.
"""
from __future__ import annotations

import functools
import os
from typing import NamedTuple, Optional

import torch

from .stages import BACKWARD, COUPLED, FORWARD, KernelSet

ENV_BACKEND = "FLASHDELTA_BACKEND"
ENV_ARCH = "FLASHDELTA_ARCH"
BACKEND_NAMES = ("auto", "torch", "sm90")
PORTABLE = "torch"


class UnsupportedError(ValueError):
    """The requested backend, architecture or shape has no kernel."""


@functools.lru_cache(maxsize=None)
def _torch_set() -> KernelSet:
    from . import portable  # noqa: PLC0415

    return KernelSet(PORTABLE, dtypes=(torch.bfloat16, torch.float16, torch.float32, torch.float64),
                     l2norm_fwd=portable.l2norm_fwd_compute, prepare_fwd=portable.prepare_fwd,
                     chunk_fwd=portable.chunk_fwd, state_recompute=portable.state_recompute,
                     chunk_bwd=portable.chunk_bwd, chunk_dstate=portable.chunk_dstate, group_sum=portable.group_sum,
                     prepare_bwd=portable.prepare_bwd)


@functools.lru_cache(maxsize=None)
def _sm90_set() -> KernelSet:
    from .kernels import sm90  # noqa: PLC0415

    return sm90.KERNELS


_LOADERS = {PORTABLE: _torch_set, "sm90": _sm90_set}
# Architecture -> native backend (its kernel set: `_LOADERS`). Everything else runs the portable path.
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


class Plan(NamedTuple):
    """Which backend runs each stage of a call. `fallback`: the stages that ``auto`` put on the portable path
    although the device has a native backend, each with the reason (empty when forced or without one)."""
    backends: dict
    native: Optional[str]
    fallback: dict

    def kset(self, stage: str) -> KernelSet:
        """The kernel set that runs `stage`."""
        return load(self.backends[stage])

    def fn(self, stage: str):
        """The launcher of `stage`."""
        return getattr(self.kset(stage), stage)

    def summary(self, stages: tuple) -> str:
        """The backend of these stages: one name, or ``native+torch`` when they are split."""
        names = list(dict.fromkeys(self.backends[s] for s in stages))
        return names[0] if len(names) == 1 else "+".join(sorted(names, key=lambda n: n == PORTABLE))


def plan(device: torch.device, K: int, V: int, dtype: torch.dtype, *, need_bwd: bool) -> Plan:
    """Resolve every stage of the forward (and, with need_bwd, the backward) for one call.

    A forced backend must have every stage and support the shape in each (else `UnsupportedError`); ``auto`` takes
    the native backend of the architecture for each stage it has and supports, and the portable path otherwise.
    """
    stages = tuple(dict.fromkeys(FORWARD + (BACKWARD if need_bwd else ())))
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
        missing = [s for s in stages if not kset.has([s])]
        if missing:
            pass_ = "backward" if kset.has(FORWARD) else "forward"
            raise UnsupportedError(f"{ENV_BACKEND}={forced}: backend {forced!r} has no {pass_} kernels yet for "
                                   f"stage(s) {', '.join(missing)}; unset {ENV_BACKEND} (auto) to run them on the "
                                   f"portable path")
        # every stage that cannot run the shape, each with its reason, in one error
        reasons = [r for r in (kset.unsupported(K, V, dtype, s) for s in stages) if r]
        if reasons:
            raise UnsupportedError(f"{ENV_BACKEND}={forced}: {'; '.join(reasons)}")
        return Plan({s: forced for s in stages}, forced, {})
    native = native_backend(device)
    if native is None:
        return Plan({s: PORTABLE for s in stages}, None, {})
    kset = load(native)
    fallback = {}
    for s in stages:
        if not kset.has([s]):
            fallback[s] = f"no {native} kernels for these stages yet"
        else:
            reason = kset.unsupported(K, V, dtype, s)
            if reason:
                fallback[s] = reason
    for group in COUPLED:
        hit = [s for s in group if s in fallback]
        for s in group:
            if hit and s in stages and s not in fallback:
                fallback[s] = f"{s} shares its backend with {hit[0]} (backend-private tensors between them)"
    return Plan({s: PORTABLE if s in fallback else native for s in stages}, native, fallback)


def resolve(device: torch.device, K: int, V: int, dtype: torch.dtype, *, need_bwd: bool) -> tuple:
    """(forward backend, backward backend) of one call, as names: one backend's name, or ``sm90+torch`` for a pass
    whose stages are split between a native backend and the portable path (`plan` has the per-stage detail)."""
    p = plan(device, K, V, dtype, need_bwd=need_bwd)
    if need_bwd:
        return p.summary(FORWARD), p.summary(BACKWARD)
    forced = requested_backend()
    bwd = forced if forced != "auto" else plan(device, K, V, dtype, need_bwd=True).summary(BACKWARD)
    return p.summary(FORWARD), bwd
