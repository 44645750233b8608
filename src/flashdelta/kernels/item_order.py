"""The order in which a kernel takes work items of unequal length (TileLang, one launch): a counting sort of
one-byte keys in one CTA, for the passes whose (sequence, value head) items walk different chunk counts
(context parallelism's warm-up passes: `fused_fwd.chunk_fwd` with `chunk_skip`, `chunk_dstate` with `chunk_take`).

The GPU starts CTAs in index order as SMs free up, so taking the longest items first is LPT list scheduling
(chunk_dstate at 16/32 1x32768: 289 us in index order, 206 longest first; docs/dev/cp.md). `order` ``[m]`` int32 is
a permutation of ``[0, m)``: its first n entries are the items ``[0, n)`` by bucket (the key clamped to [0, 255],
ascending or, with `descending`, descending), then the ``m - n`` tail items ``n .. m - 1`` in place (the fused
forward's padding tail). Items of one bucket come in the order their threads win the shared-memory atomics, which
changes from run to run; no kernel's result depends on the order in which it takes its items (each item writes
only its own outputs), so this moves nothing but the schedule.

One CTA of `THREADS` threads: a histogram of the buckets in shared memory (atomic adds), an exclusive scan of the
256 counts (Hillis-Steele, 8 steps), then every item claims the next position of its bucket with an atomic add that
returns the previous count. The torch sort it replaces (`torch.argsort` of the clamped keys) took ~9.5 us a pass for
~300 items at one-byte keys and ~17 us at four-byte keys, plus ~5 small kernels around it; this is one launch.
The torch twin is `reference_order` (a stable sort: the kernel's order equals it up to the order inside a bucket).
"""
# No `from __future__ import annotations`: TileLang evaluates the prim_func annotations in this scope.
import tilelang.language as T
import torch

from . import _tl

THREADS = 1024
BUCKETS = 256
I32 = "int32"


@_tl.jit()
def build(descending: bool):
    """The kernel; n (items sorted) and m (n plus the tail items) are dynamic."""
    n_ = T.dynamic("n")
    m_ = T.dynamic("m")

    def bucket(keys, i):
        # item i's bucket: its key clamped to one byte, reversed when descending
        b = T.max(T.min(keys[i], BUCKETS - 1), 0)
        return (BUCKETS - 1 - b) if descending else b

    @T.prim_func
    def item_order_kernel(keys: T.Tensor((n_,), I32), order: T.Tensor((m_,), I32)):
        with T.Kernel(1, threads=THREADS) as _:
            tx = T.get_thread_binding()
            cursor = T.alloc_shared((BUCKETS,), I32)      # the counts, then each bucket's next free position
            scan = T.alloc_shared((BUCKETS,), I32)
            add = T.alloc_local((1,), I32)
            pos = T.alloc_local((1,), I32)
            step = T.alloc_local((1,), I32)
            if tx < BUCKETS:
                cursor[tx] = 0
            T.sync_threads()
            for it in T.serial(T.ceildiv(n_, THREADS)):
                i = it * THREADS + tx
                if i < n_:
                    T.atomic_add(cursor[bucket(keys, i)], 1)
            T.sync_threads()
            if tx < BUCKETS:
                scan[tx] = cursor[tx]
            step[0] = 1
            T.sync_threads()
            for _s in T.serial(8):                        # inclusive scan: log2(BUCKETS) steps
                add[0] = 0
                if tx < BUCKETS and tx >= step[0]:
                    add[0] = scan[tx - step[0]]
                T.sync_threads()
                if tx < BUCKETS:
                    scan[tx] = scan[tx] + add[0]
                step[0] = step[0] * 2
                T.sync_threads()
            if tx < BUCKETS:
                cursor[tx] = scan[tx] - cursor[tx]
            T.sync_threads()
            for it in T.serial(T.ceildiv(n_, THREADS)):
                i = it * THREADS + tx
                if i < n_:
                    # the claimed position in a register: the store's bounds check must not repeat the atomic
                    pos[0] = T.atomic_add(cursor[bucket(keys, i)], 1, return_prev=True)
                    order[pos[0]] = i
            for it in T.serial(T.ceildiv(m_ - n_, THREADS)):
                j = n_ + it * THREADS + tx
                if j < m_:
                    order[j] = j

    return item_order_kernel


def builder_args(descending: bool) -> tuple:
    """The `build` arguments (its compile-cache key)."""
    return (bool(descending),)


def launcher_builds(descending: tuple = (False, True)) -> list:
    """(label, builder, args) of the order kernel for each direction."""
    return [(f"item_order{' descending' if d else ''}", build, builder_args(d)) for d in descending]


def order(keys: torch.Tensor, ctas_per_item: int, *, descending: bool, tail: bool) -> torch.Tensor:
    """The order in which a kernel whose (sequence, value head) work items walk different chunk counts takes them:
    int32 ``[R HV]`` (R = N, or N + 1 with `tail`), the work item of its CTAs ``[i * ctas_per_item, (i + 1) *
    ctas_per_item)`` is item ``order[i]`` = ``n * HV + hv``, by `keys` (``[N, HV]`` int32 on the GPU, a monotone
    function of the item's walk, clamped to [0, 255]: descending or ascending as said) and, with `tail`, the padding
    tail's HV items (``N * HV + hv``) last. Where every CTA fits in one wave the order is the identity. One launch,
    no host synchronisation."""
    N, HV = keys.shape
    n, m = N * HV, (N + int(tail)) * HV
    dev = keys.device
    if m * ctas_per_item <= _tl.num_sms(dev if dev.type == "cuda" else None) or n == 0:
        return torch.arange(m, dtype=torch.int32, device=dev)
    out = torch.empty(m, dtype=torch.int32, device=dev)
    build(*builder_args(descending))(keys.to(torch.int32).reshape(-1).contiguous(), out)
    return out


def reference_order(keys: torch.Tensor, *, descending: bool, tail: bool) -> torch.Tensor:
    """The torch twin of the kernel's order (any device): the stable sort of the clamped keys, the tail
    items last, int64 ``[(N + tail) HV]``."""
    N, HV = keys.shape
    flat = torch.clamp(keys.reshape(-1).to(torch.int64), 0, BUCKETS - 1)
    by_key = torch.argsort(flat, descending=descending, stable=True)
    return torch.cat([by_key, torch.arange(N * HV, (N + int(tail)) * HV, device=keys.device)])
