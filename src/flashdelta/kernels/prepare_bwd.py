"""Stage `prepare` backward: the chunk-local reverse cumsum of dG (the gradient w.r.t. g_cumsum) -> dg, the
gradient w.r.t. g. One CTA per chunk slot (kernels/_chunks.py) scans all HV value heads of its chunk in shared
memory; the padding tail gets zeros.
"""
# No `from __future__ import annotations`: TileLang evaluates the prim_func annotations in this scope.
import tilelang.language as T
import torch

from . import _chunks, _tl

F32 = "float32"
BT = 64
THREADS = 128


@_tl.jit()
def build(HV: int):
    # problem config
    n_tok = T.dynamic("T")
    n_seqs = T.dynamic("N")

    @T.prim_func
    def prepare_bwd_kernel(
        dG: T.Tensor((1, n_tok, HV), F32),
        cu_seqlens: T.Tensor((n_seqs + 1,), "int32"),
        dg: T.Tensor((1, n_tok, HV), F32),
    ):
        with T.Kernel(_chunks.num_slots(n_tok, n_seqs, BT), threads=THREADS) as i_s:
            tid = T.get_thread_binding()
            chunk = T.alloc_local((3,), "int32")
            _chunks.find_chunk(cu_seqlens, i_s, n_seqs, n_tok, tid, BT, THREADS, chunk)
            seq, t0, eos = chunk[0], chunk[1], chunk[2]
            dg_shared = T.alloc_shared((BT, HV + 1), F32)  # +1: the column scan's strided reads
            if t0 < eos:
                if seq < n_seqs:
                    for i, h in T.Parallel(BT, HV):
                        dg_shared[i, h] = T.if_then_else(t0 + i < eos, dG[0, t0 + i, h], 0)
                    T.cumsum(dg_shared[:, 0:HV], dim=0, reverse=True)
                    for i, h in T.Parallel(BT, HV):
                        if t0 + i < eos:
                            dg[0, t0 + i, h] = dg_shared[i, h]
                else:
                    for i, h in T.Parallel(BT, HV):
                        if t0 + i < eos:
                            dg[0, t0 + i, h] = 0

    return prepare_bwd_kernel


def builder_args(HV: int) -> tuple:
    """The `build` arguments (its compile-cache key) for one call."""
    return (HV,)


def launcher_builds(HV: int) -> list:
    """(label, builder, args) of the kernel `prepare_bwd` launches for HV value heads (what `flashdelta.warmup`
    compiles for a backward)."""
    return [(f"prepare_bwd HV={HV}", build, builder_args(HV))]


def prepare_bwd(dG: torch.Tensor, cu_seqlens: torch.Tensor, *, chunk_size: int = 64) -> torch.Tensor:
    """Chunk-local reverse cumsum of the gradient w.r.t. g_cumsum (docs/stages.md `prepare_bwd`).

    Args:
        dG: ``[1, T, HV]`` fp32.
        cu_seqlens: ``[N + 1]`` int32 (int64 is converted on the device).

    Returns:
        dg ``[1, T, HV]`` fp32, the gradient w.r.t. g (0 on padding).
    """
    _, n_tok, HV = dG.shape
    assert chunk_size == BT and dG.dtype == torch.float32
    cu_seqlens = _tl.cu_seqlens_int32(cu_seqlens)
    dg = _tl.alloc((1, n_tok, HV), torch.float32, dG.device)
    if n_tok == 0:
        return dg
    build(*builder_args(HV))(dG.contiguous(), cu_seqlens, dg)
    return dg
