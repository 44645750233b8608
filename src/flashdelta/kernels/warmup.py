"""Compile every SM90 kernel variant a model needs ahead of time, into TileLang's persistent cache.

Compilation needs no GPU (the target is fixed to sm_90a), so a cache can be built on a CPU machine and
shipped; TileLang keys it by the builder arguments and stores it under ``TILELANG_CACHE_DIR``
(default ``~/.tilelang/cache``).
"""
from __future__ import annotations

import sys
import time
from typing import Iterable, Optional

import torch

from . import fused_fwd, l2norm, prepare


def variants(heads: Iterable[tuple], *, head_dim: tuple = (128, 128), dtype=torch.bfloat16,
             beta_dtype=torch.float32, h0_dtype=torch.float32, scale: Optional[float] = None,
             initial_state: tuple = (False, True), state_v_first: tuple = (False,), qk_l2norm: bool = True) -> list:
    """(label, builder, args) for every kernel the forward of these head configs launches (with qk_l2norm, the
    q/k normalisation of ``use_qk_l2norm_in_kernel=True`` too)."""
    K, V = head_dim
    scale = K ** -0.5 if scale is None else float(scale)
    out = []
    if qk_l2norm:
        out.append((f"l2norm_fwd K={K}", l2norm._build_l2norm_fwd, l2norm.builder_args(K, dtype)))
    for H, HV in heads:
        out += prepare.launcher_builds(H, HV, K, dtype, beta_dtype)   # the launcher picks one per call
        for has_h0 in initial_state:
            for vfirst in state_v_first:
                out.append((f"chunk_fwd H={H} HV={HV} K={K} V={V} h0={has_h0} v_first={vfirst}",
                            fused_fwd._build_chunk_fwd,
                            fused_fwd.builder_args(H, HV, K, V, dtype, beta_dtype, h0_dtype, scale, has_h0, vfirst)))
    return out


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
