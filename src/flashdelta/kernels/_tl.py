"""TileLang plumbing shared by every Hopper kernel module: target, pass configs, dtype names, the `jit` builder
decorator, output allocation, cu_seqlens as the kernels take it, the order in which per-sequence kernels take the sequences, the
SM count.

`tilelang` itself is imported on first use (by the first `jit` decoration, i.e. when a kernel module is imported).
"""
from __future__ import annotations

import functools
import os
from typing import Optional

import torch

from . import timeline

SM90_TARGET = {"kind": "cuda", "arch": "sm_90a"}

# Kernels are explicitly synchronised with mbarriers / T.sync_threads; TileLang's own race checker
# flags the producer/consumer patterns as races, so it is off for our kernels.
PASS_CONFIGS = {
    "tl.enable_fast_math": True,
    "tl.disable_data_race_check": True,
}
# Warp-specialized kernels (fused_fwd, prepare_pipe): every cross-role hand-off is an mbarrier and every
# intra-warpgroup barrier is written out. TileLang's automatic syncs would land inside per-element loops or put a
# __syncthreads (all threads) where it cannot prove a buffer is thread-private, and shared-memory reuse would
# alias buffers that different roles own at the same time.
WS_PASS_CONFIGS = {**PASS_CONFIGS, "tl.disable_shared_memory_reuse": True, "tl.disable_thread_storage_sync": True}

# torch dtype -> TileLang dtype name (builder arguments are these strings)
TL_DTYPE = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32",
            torch.float64: "float64"}

# SM count a build is sized for when the machine has no GPU (H100 SXM, H200)
DEFAULT_NUM_SMS = 132


@functools.lru_cache(maxsize=None)
def tilelang():
    """The tilelang module, imported on first use (import flashdelta never imports it)."""
    import tilelang as tl  # noqa: PLC0415

    return tl


class Builder:
    """A `tilelang.jit` builder of one kernel module: calling it returns the compiled kernel for its arguments (the
    in-memory memo, then TileLang's disk cache keyed by the kernel's TIR). Inside `timeline.record(table)` for this
    builder's table it returns the instrumented build instead, compiled once per recording and arguments and never
    memoised with the plain builds."""

    def __init__(self, impl, table: Optional[timeline.Table]):
        self.impl, self.table = impl, table
        fn = impl.func.orig_func
        self.__name__ = f"{fn.__module__.rsplit('.', 1)[-1]}.{fn.__name__}"     # e.g. "fused_fwd.build"
        self.__doc__ = fn.__doc__

    def __call__(self, *args):
        rec = timeline.active(self.table)
        if rec is None:
            return self.impl(*args)
        key = (self.__name__, args)
        if key not in rec.kernels:
            # traced now (TileLang memoises a builder's TIR per arguments; this trace sees the recording), compiled
            # with the builder's settings; TileLang's disk cache keys it by this TIR
            impl = self.impl
            with impl._get_frontend_target_context():
                prim = impl.func.orig_func(*args)
            rec.kernels[key] = tilelang().compile(
                prim, out_idx=impl.out_idx, execution_backend=impl.execution_backend, target=impl.target,
                target_host=impl.target_host, verbose=impl.verbose, pass_configs=impl.pass_configs,
                compile_flags=impl.compile_flags)
        return rec.kernels[key]

    def get_tir(self, *args):
        """The kernel's TIR for these arguments (no compile)."""
        return self.impl.get_tir(*args)

    def __repr__(self) -> str:
        return f"<kernel builder {self.__name__}>"


def jit(*, pass_configs: dict = PASS_CONFIGS, table: Optional[timeline.Table] = None):
    """Decorator: the SM90 `tilelang.jit` builder (`Builder`) of a kernel module; `table` is the kernel's timeline
    event table (kernels/timeline.py), None for kernels without one."""
    def wrap(fn):
        return Builder(tilelang().jit(target=SM90_TARGET, pass_configs=pass_configs)(fn), table)
    return wrap


def alloc(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """Allocate a kernel output. With FLASHDELTA_POISON=1 (the tests set it) it is filled with NaN
    (integers with -1), so any element a kernel forgets to write fails the comparison."""
    out = torch.empty(shape, dtype=dtype, device=device)
    if os.environ.get("FLASHDELTA_POISON") == "1":
        out.fill_(float("nan") if dtype.is_floating_point else -1)
    return out


def cu_seqlens_int32(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """cu_seqlens as every kernel takes it: int32, contiguous (no copy when it already is; int64 is converted on
    its device)."""
    return cu_seqlens.to(torch.int32).contiguous()


def seq_order(cu_seqlens: torch.Tensor, ctas_per_seq: int) -> torch.Tensor:
    """The order in which a kernel with `ctas_per_seq` CTAs per sequence (and one work item past the last sequence,
    the padding tail) takes the sequences: int32 ``[N + 1]``, the work item of its CTAs ``[i * ctas_per_seq, (i + 1) *
    ctas_per_seq)`` is sequence ``order[i]``, the longest sequence first (ties by index) and N, the padding tail, last.

    The GPU starts CTAs in index order as SMs free up, so longest first is LPT list scheduling: at heads 16/32 with
    eight sequences of 499 to 9873 tokens the longest sequence's 32 CTAs start in the first wave instead of the second
    (`chunk_bwd`'s makespan 214 -> 157 chunk periods: docs/dev/chunk_bwd.md, "Longest sequence first"). Where every
    sequence's CTAs fit in one wave (or N <= 1) the order is the identity: the sequences all start at once and the
    padding tail's CTAs, last in either order, take the SMs that free first (context parallelism's plans, whose slot
    count is a bound, land there: 2/4 heads at 1x8192 tokens in 32 partitions were 33 slots x 4 CTAs on 132 SMs, a
    sort for nothing). Computed on the device, no host synchronisation."""
    N = cu_seqlens.shape[0] - 1
    dev = cu_seqlens.device
    if N <= 1 or N * ctas_per_seq <= num_sms(dev if dev.type == "cuda" else None):
        return torch.arange(N + 1, dtype=torch.int32, device=dev)
    keys = cu_seqlens.new_full((N + 1,), -1)          # the padding tail's item sorts last
    torch.sub(cu_seqlens[1:], cu_seqlens[:-1], out=keys[:N])
    return torch.argsort(keys, descending=True, stable=True).to(torch.int32)


def num_sms(device: Optional[torch.device] = None) -> int:
    """SM count of `device` (a CUDA device); None: this machine's current GPU, else `DEFAULT_NUM_SMS`."""
    if device is None:
        if not torch.cuda.is_available():
            return DEFAULT_NUM_SMS
        device = torch.device("cuda", torch.cuda.current_device())
    return _num_sms(torch.device(device))


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count
