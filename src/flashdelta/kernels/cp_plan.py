"""Context parallelism's partition plan in one launch (TileLang): what `cp.make_plan` computes with ~26 small torch
kernels (docs/dev/cp.md, "Launches per CP forward"), from cu_seqlens on the device, into buffers sized from host
integers (P partition slots, J scan steps), so CUDA graphs capture it and replay it with new lengths.

Every sequence n of ``len_n`` tokens is cut into ``np_n = max(ceil(len_n / W), 1)`` partitions of W = 64 L tokens
(the last takes the remainder; an empty sequence gives one empty partition); sequence n's partitions are the slots
``[ps_n, ps_n + np_n)``, ``ps_n`` the exclusive prefix sum of np. Outputs (`cp.CPPlan`'s device tensors):
``part_cu [P + 1]`` int32 (slot s of sequence n, position j: ``cu_seqlens[n] + j W``; unused slots and the end:
``cu_seqlens[N]``), ``seq [P]`` int64 (unused slots: N - 1), ``pos [P]`` int64 (unused: 0), ``first [P]`` (pos == 0,
as uint8), ``last_index [N]`` int64 (``ps_n + np_n - 1``), ``step_index [J, N]`` int64 (``ps_n + j`` for
``j < np_n``, else P) and ``scan_cu [N + 1]`` int32 (0, then ``ps_n + np_n``: the scan kernel's offsets).

One CTA of `THREADS` threads: thread t takes sequences ``[t m, t m + m)``, m = ceil(N / THREADS): it adds their
partition counts, thread 0 turns the THREADS sums into exclusive offsets in shared memory, and every thread walks
its sequences again writing their slots; then the unused slots. int32 arithmetic throughout (token counts and slot
counts are below 2^31); the float64 twin is `reference.cp.partition`, the portable path `cp.make_plan`'s torch ops.
"""
# No `from __future__ import annotations`: TileLang evaluates the prim_func annotations in this scope.
import tilelang.language as T
import torch

from . import _tl

BT = 64
THREADS = 256
I32, I64 = "int32", "int64"


@_tl.jit()
def build():
    """The kernel; N (sequences), P (slots), J (scan steps) and W (tokens per partition) are dynamic."""
    N_ = T.dynamic("N")
    P_ = T.dynamic("P")
    J_ = T.dynamic("J")

    @T.prim_func
    def cp_plan_kernel(
        cu_seqlens: T.Tensor((N_ + 1,), I32),
        part_cu: T.Tensor((P_ + 1,), I32),
        seq: T.Tensor((P_,), I64),
        pos: T.Tensor((P_,), I64),
        first: T.Tensor((P_,), "uint8"),
        last_index: T.Tensor((N_,), I64),
        step_index: T.Tensor((J_, N_), I64),
        scan_cu: T.Tensor((N_ + 1,), I32),
        W: T.int32,
    ):
        with T.Kernel(1, threads=THREADS) as _:
            tx = T.get_thread_binding()
            offs = T.alloc_shared((THREADS + 1,), I32)     # thread t's first slot; [THREADS]: the slots used
            run = T.alloc_local((1,), I32)
            m = T.ceildiv(N_, THREADS)
            run[0] = 0
            for i in T.serial(m):
                n = tx * m + i
                if n < N_:
                    run[0] = run[0] + T.max(T.ceildiv(cu_seqlens[n + 1] - cu_seqlens[n], W), 1)
            offs[tx] = run[0]
            T.sync_threads()
            if tx == 0:
                run[0] = 0
                for t in T.serial(THREADS):
                    c = offs[t]
                    offs[t] = run[0]
                    run[0] = run[0] + c
                offs[THREADS] = run[0]
            T.sync_threads()
            run[0] = offs[tx]
            for i in T.serial(m):
                n = tx * m + i
                if n < N_:
                    bos = cu_seqlens[n]
                    np_ = T.max(T.ceildiv(cu_seqlens[n + 1] - bos, W), 1)
                    ps = run[0]
                    last_index[n] = T.cast(ps + np_ - 1, I64)
                    scan_cu[n + 1] = ps + np_
                    for j in T.serial(J_):
                        step_index[j, n] = T.cast(T.if_then_else(j < np_, ps + j, P_), I64)
                    for j in T.serial(np_):
                        seq[ps + j] = T.cast(n, I64)
                        pos[ps + j] = T.cast(j, I64)
                        first[ps + j] = T.cast(T.if_then_else(j == 0, 1, 0), "uint8")
                        part_cu[ps + j] = bos + j * W
                    run[0] = ps + np_
            end = cu_seqlens[N_]
            for i in T.serial(T.ceildiv(P_ + 1, THREADS)):
                s = i * THREADS + tx
                if s >= offs[THREADS]:
                    if s < P_:
                        seq[s] = T.cast(N_ - 1, I64)
                        pos[s] = T.cast(0, I64)
                        first[s] = T.cast(1, "uint8")
                        part_cu[s] = end
                if s == P_:
                    part_cu[s] = end
            if tx == 0:
                scan_cu[0] = 0

    return cp_plan_kernel


def builder_args() -> tuple:
    """The `build` arguments (its compile-cache key): none, one build serves every plan."""
    return ()


def launcher_builds() -> list:
    """(label, builder, args) of the plan kernel."""
    return [("cp_plan", build, builder_args())]


def plan_tensors(cu_seqlens: torch.Tensor, L: int, P: int, J: int) -> tuple:
    """``(part_cu, seq, pos, first, last_index, step_index, scan_cu)`` of L-chunk partitions of the sequences of
    `cu_seqlens` (``[N + 1]`` int32 on the GPU, N >= 1), in P slots and J scan steps (`cp.bounds`); ``first`` bool.
    One launch, no host synchronisation."""
    N = cu_seqlens.shape[0] - 1
    assert N >= 1 and cu_seqlens.dtype == torch.int32 and P >= N and J >= 1
    dev = cu_seqlens.device
    part_cu = torch.empty(P + 1, dtype=torch.int32, device=dev)
    seq = torch.empty(P, dtype=torch.int64, device=dev)
    pos = torch.empty(P, dtype=torch.int64, device=dev)
    first = torch.empty(P, dtype=torch.uint8, device=dev)
    last_index = torch.empty(N, dtype=torch.int64, device=dev)
    step_index = torch.empty(J, N, dtype=torch.int64, device=dev)
    scan_cu = torch.empty(N + 1, dtype=torch.int32, device=dev)
    build(*builder_args())(cu_seqlens.contiguous(), part_cu, seq, pos, first, last_index, step_index, scan_cu, L * BT)
    return part_cu, seq, pos, first.view(torch.bool), last_index, step_index, scan_cu
