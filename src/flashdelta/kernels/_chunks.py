"""Chunk slots: the host-sync-free map from a CTA's slot index to (sequence, chunk) that every one-CTA-per-chunk
kernel uses (prepare forward and backward).

Chunks are aligned to sequence starts. Chunk `c` of sequence `n` (tokens `[bos, eos)`) owns slot
`bos // BT + n + c`. These slot numbers increase strictly along the token axis and stay below `T // BT + N + 1`
(the grid size), so a CTA finds its sequence by searching `cu_seqlens` for the last `n` with
`cu_seqlens[n] // BT + n <= slot` (`threads`-way per step: one step for up to threads - 1 sequences); slots that
fall past a sequence's last chunk are idle. The padding tail `[cu_seqlens[-1], T)` is sequence `N`, whose chunks
write zeros.
"""
# No `from __future__ import annotations`: TileLang evaluates the macro annotations in this scope.
import tilelang.language as T


def num_slots(n_tok, n_seqs, BT: int):
    """Chunk slots (the grid size) for T tokens and N sequences: every chunk, the padding tail's, and idle ones."""
    return n_tok // BT + n_seqs + 1


@T.macro
def find_chunk(cu_seqlens, i_s, n_seqs, n_tok, tid, BT: int, threads: int, chunk):
    """Fills `chunk` (a local int32[3]) for chunk slot `i_s` with the sequence (0..N; N = padding tail), the
    chunk's first token and its sequence's end; the slot is idle when `chunk[1] >= chunk[2]`. Every one of the
    CTA's `threads` threads takes part (a block-wide count per step)."""
    width = T.alloc_var("int32", init=n_seqs + 1)
    chunk[0] = 0
    while width > 1:
        stride = T.ceildiv(width, threads)
        idx = chunk[0] + tid * stride
        # slots of sequence n start at cu_seqlens[n] // BT + n, strictly increasing in n
        cnt = T.syncthreads_count(idx < chunk[0] + width and cu_seqlens[idx] // BT + idx <= i_s)
        chunk[0] = chunk[0] + (cnt - 1) * stride
        width = T.min(stride, width - (cnt - 1) * stride)
    bos = cu_seqlens[chunk[0]]
    chunk[1] = bos + (i_s - bos // BT - chunk[0]) * BT
    chunk[2] = T.if_then_else(chunk[0] < n_seqs, cu_seqlens[chunk[0] + 1], n_tok)
