"""Compile every SM90 kernel build a model needs ahead of time, into TileLang's persistent cache
(`flashdelta.warmup`, ``flashdelta warmup``).

Compilation needs no GPU (the target is fixed to sm_90a), so a cache can be built on a CPU machine and
shipped; TileLang keys it by the kernel's TIR and stores it under ``TILELANG_CACHE_DIR``
(default ``~/.tilelang/cache``). The list of builds is `kernels.sm90.forward_builds`: what the launchers pick from.
"""
from __future__ import annotations

import math
import sys
import time
from typing import Iterable, Optional

import torch

from .kernels import sm90


def _check(kset, heads: list, head_dim: tuple, dtype, beta_dtype, h0_dtype, scale, num_sms) -> None:
    """The limits the SM90 kernel set declares, as clear errors before any compile (a builder would fail an
    assertion instead)."""
    if kset.head_dims is not None and tuple(head_dim) not in kset.head_dims:
        raise ValueError(f"head_dim: (K, V)={tuple(head_dim)} has no SM90 kernels; supported: {list(kset.head_dims)}")
    if dtype not in kset.dtypes:
        raise TypeError(f"dtype: the SM90 kernels take q/k/v in {list(kset.dtypes)}, got {dtype}")
    for name, dt in (("beta_dtype", beta_dtype), ("h0_dtype", h0_dtype)):
        if not (isinstance(dt, torch.dtype) and dt.is_floating_point):
            raise TypeError(f"{name}: must be a floating-point torch dtype, got {dt}")
    for pair in heads:
        if len(pair) != 2 or not all(isinstance(x, int) and x > 0 for x in pair) or pair[1] % pair[0]:
            raise ValueError(f"heads: each entry must be (H, HV) with HV a positive multiple of H, got {pair!r}")
    if scale is not None and not math.isfinite(float(scale)):
        raise ValueError(f"scale: must be finite, got {scale!r}")
    if num_sms is not None and (not isinstance(num_sms, int) or num_sms <= 0):
        raise ValueError(f"num_sms: must be a positive int, got {num_sms!r}")


def variants(heads: Iterable[tuple], *, head_dim: tuple = (128, 128), dtype=torch.bfloat16,
             beta_dtype=torch.float32, h0_dtype=torch.float32, scale: Optional[float] = None,
             initial_state: tuple = (False, True), state_v_first: tuple = (False,), qk_l2norm: bool = True,
             num_sms: Optional[int] = None, backward: bool = False, decode: bool = False) -> list:
    """(label, builder, args) for every kernel the forward of these head configs launches (with qk_l2norm, the
    q/k normalisation of ``use_qk_l2norm_in_kernel=True`` too; with backward, the SM90 kernels the backward adds).
    beta / h0 dtypes the kernels lack (float64) build the fp32 kernels the forward runs them with. num_sms: the GPU's
    SM count, which sizes the persistent prepare kernel's grid (default: this machine's GPU, else 132 as on H100
    SXM / H200). With decode, the decode kernel's builds too (`fused_recurrent_gated_delta_rule`: dense and varlen,
    with the final state)."""
    kset = sm90.KERNELS
    heads = [tuple(h) for h in heads]
    _check(kset, heads, head_dim, dtype, beta_dtype, h0_dtype, scale, num_sms)
    K = head_dim[0]
    opts = dict(head_dim=tuple(head_dim), dtype=dtype, beta_dtype=kset.param_dtype(beta_dtype),
                h0_dtype=kset.param_dtype(h0_dtype), scale=K ** -0.5 if scale is None else float(scale),
                initial_state=initial_state, state_v_first=state_v_first)
    out = sm90.forward_builds(heads, **opts, qk_l2norm=qk_l2norm, num_sms=num_sms)
    out += sm90.backward_builds(heads, **opts) if backward else []
    return out + (sm90.decode_builds(heads, **opts, qk_l2norm=qk_l2norm) if decode else [])


def warmup(heads: Iterable[tuple], *, progress: bool = True, **kwargs) -> float:
    """Compile the variants of `variants(heads, **kwargs)`; returns the seconds spent. Already-cached
    variants load from disk in well under a second."""
    todo = variants(heads, **kwargs)
    start = time.perf_counter()
    for i, (label, builder, args) in enumerate(todo, 1):
        t0 = time.perf_counter()
        builder(*args)
        if progress:
            done = int(20 * i / len(todo))
            print(f"\r[{'#' * done}{'.' * (20 - done)}] {i}/{len(todo)} {label} ({time.perf_counter() - t0:.1f} s)",
                  end="\n" if i == len(todo) else "", file=sys.stderr, flush=True)
    return time.perf_counter() - start
