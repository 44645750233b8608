"""Stage `prepare` forward, the one-shot kernel: a CTA per (chunk slot, key head) does everything for its chunk
(the math is in prepare_common.py; the launcher, prepare.py, picks this kernel or the persistent one).

One warpgroup loads the chunk's keys once, computes `K K^T` with wgmma, writes the chunk-local inclusive cumsum of g
(and the activated beta, in builds with a beta activation: prepare_common.py), and its four warps invert the value heads of the group, one head per warp (rounds of four). With fewer heads per CTA
(`heads_per_cta`, on small grids) the HV / H value heads of a key head are split over CTAs, each repeating the key
tile load and K K^T. A CTA finds its chunk by searching cu_seqlens (kernels/_chunks.py); idle slots exit.

Timeline: `TABLE` (kernels/timeline.py), thread 0 of the CTAs of key head 0 and chunk slots < 64, one entry per phase.
"""
# No `from __future__ import annotations`: TileLang evaluates the prim_func annotations in this scope.
from typing import Optional

import tilelang.language as T
import torch

from . import _chunks, _ptx, _tl, timeline
from .prepare_common import (BF16, BT, F32, GATE_PRELUDE, NW, SUPPORTED_K, beta_load, check_options, gate_load,
                             gate_mode, heads_key, option_args, split_gram)

THREADS = 128              # one warpgroup: the M = 64 wgmma for K K^T
MIN_BLOCKS = 4             # CTAs per SM the registers and shared memory allow (106 registers, 48.6 KB at K = 128)
# With one value head per CTA the inverse needs no workspace beyond the dead key tile (32 KB at K = 128), so the
# registers decide: 5 CTAs per SM at 96 (no spills).
MIN_BLOCKS_ONE_HEAD = 5

TABLE = timeline.Table(
    "prepare_oneshot",
    roles={"c": ("CTA", 0)},
    events={
        "c.found": "chunk slot found (cu_seqlens search)",
        "c.loaded": "key tile, g and beta in shared memory",
        "c.kkt": "K K^T complete",
        "c.split": "K K^T split into the inverse's inputs",
        "c.cumsum": "gate cumsum stored",
        "c.inverse": "warp 0's inverses stored",
    },
    ctas=64, steps=1, value="first token of the chunk")


def min_blocks(H: int, HV: int, heads_per_cta: int) -> int:
    """CTAs per SM a build is sized for (its register bound) for a heads-per-CTA split (0 = all of HV / H)."""
    return MIN_BLOCKS_ONE_HEAD if (heads_per_cta or HV // H) == 1 else MIN_BLOCKS


@_tl.jit(table=TABLE)
def build(H: int, HV: int, K: int, k_dtype: str, beta_dtype: str, heads_per_cta: int, g_dtype: str = F32,
          a_log_dtype: Optional[str] = None, dt_bias_dtype: Optional[str] = None, beta_act: int = 0,
          norms: bool = False):
    """heads_per_cta: value heads each CTA inverts (a divisor of HV / H; 0 = all of its key head's); the build is
    sized for `min_blocks` CTAs per SM. g_dtype, a_log_dtype, dt_bias_dtype, beta_act: the in-kernel activations
    (prepare_common.py; an A_log dtype makes g the raw gate, None drops A_log / dt_bias; beta_act 1 or 2 makes beta
    logits and adds the activated beta's output). norms: also write the squared key norms ``[1, T, H]`` fp32, the
    diagonal of K K^T (context parallelism's warm-up condition reads them instead of k)."""
    # problem config
    assert HV % H == 0 and K in SUPPORTED_K
    check_options(g_dtype, a_log_dtype, dt_bias_dtype, beta_act)
    gate = gate_mode(a_log_dtype, dt_bias_dtype)
    G = heads_per_cta or HV // H    # value heads per CTA
    NG = HV // H // G               # CTAs per (chunk slot, key head)
    assert (HV // H) % G == 0
    GB = 1 << (G - 1).bit_length()  # beta's shared tile: a power-of-two row
    n_tok = T.dynamic("T")
    n_seqs = T.dynamic("N")
    # tiling config: the inverse's 16x16 blocks; the register bound
    B16 = 16
    blocks = min_blocks(H, HV, heads_per_cta)
    prelude = _ptx.WY_INVERSE_PRELUDE + timeline.prelude(TABLE)
    if gate or beta_act:
        prelude += GATE_PRELUDE

    @T.prim_func
    def prepare_fwd_kernel(
        k: T.Tensor((1, n_tok, H, K), k_dtype),
        g: T.Tensor((1, n_tok, HV), g_dtype),
        beta: T.Tensor((1, n_tok, HV), beta_dtype),
        A_log: T.Tensor((HV,), a_log_dtype) if a_log_dtype is not None else None,
        dt_bias: T.Tensor((HV,), dt_bias_dtype) if dt_bias_dtype is not None else None,
        cu_seqlens: T.Tensor((n_seqs + 1,), "int32"),
        g_cumsum: T.Tensor((1, n_tok, HV), F32),
        A: T.Tensor((1, n_tok, HV, BT), k_dtype),
        beta_out: T.Tensor((1, n_tok, HV), F32) if beta_act else None,
        k_norm2: T.Tensor((1, n_tok, H), F32) if norms else None,
    ):
        with T.Kernel(_chunks.num_slots(n_tok, n_seqs, BT), H * NG, threads=THREADS, prelude=prelude) as (i_s, i_y):
            T.annotate_min_blocks_per_sm(blocks)
            tid = T.get_thread_binding()
            i_h = i_y // NG                 # key head
            hv0 = i_y * G                   # first value head: key head i_h owns value heads [i_h, i_h + 1) * G * NG
            mark = timeline.marker(TABLE, i_s, tid, when=i_y == 0)
            mark.start()
            chunk = T.alloc_local((3,), "int32")
            _chunks.find_chunk(cu_seqlens, i_s, n_seqs, n_tok, tid, BT, THREADS, chunk)
            mark(0, "c.found")
            mark.value(chunk[1])
            seq, t0, eos = chunk[0], chunk[1], chunk[2]

            k_shared = T.alloc_shared((BT, K), k_dtype)
            kk_frag = T.alloc_fragment((BT, BT), F32)
            g_shared = T.alloc_shared((BT, G + 1), F32)    # +1: the column scan's strided reads
            beta_shared = T.alloc_shared((BT, GB), F32)
            # K K^T, unscaled (beta scales rows per value head), written once per CTA: the four 16x16 diagonal
            # blocks in fp32 (a pad column keeps the substitution's column reads off one bank), and rows 16..63 x
            # cols 0..47 (the blocks below the diagonal) as bf16 hi/lo, rows padded for conflict-free ldmatrix
            kkd_shared = T.alloc_shared((4, B16, B16 + 1), F32)
            l_hi = T.alloc_shared((BT - B16, _ptx.WY_LP), BF16)
            l_lo = T.alloc_shared((BT - B16, _ptx.WY_LP), BF16)
            # each warp's workspace (level-0 scratch and the output strip): the first NWK in the key tile (dead
            # after K K^T), the rest in ws
            NWS = min(G, NW)                # warps with a head
            NWK = min(NWS, BT * K // (2 * _ptx.WY_WS_FLOATS))
            ws = T.alloc_shared((NWS - NWK, _ptx.WY_WS_FLOATS), F32) if NWK < NWS else k_shared

            if t0 < eos:
                if seq < n_seqs:
                    for i, d in T.Parallel(BT, K):
                        k_shared[i, d] = T.if_then_else(t0 + i < eos, k[0, t0 + i, i_h, d], 0)
                    for i, j in T.Parallel(BT, G):
                        g_shared[i, j] = T.if_then_else(t0 + i < eos, gate_load(g, t0 + i, hv0 + j, A_log, dt_bias, gate), 0)
                        beta_shared[i, j] = T.if_then_else(
                            t0 + i < eos, beta_load(beta, t0 + i, hv0 + j, beta_act), 0)
                    # [BT, K] @ [K, BT] -> [BT, BT]
                    mark(0, "c.loaded")
                    T.gemm(k_shared, k_shared, kk_frag, transpose_B=True, clear_accum=True)
                    mark(0, "c.kkt")
                    split_gram(kk_frag, kkd_shared, l_hi, l_lo)
                    mark(0, "c.split")
                    T.cumsum(g_shared[:, 0:G], dim=0)
                    for i, j in T.Parallel(BT, G):
                        if t0 + i < eos:
                            g_cumsum[0, t0 + i, hv0 + j] = g_shared[i, j]
                            if beta_act:
                                beta_out[0, t0 + i, hv0 + j] = beta_shared[i, j]
                    mark(0, "c.cumsum")
                    # warp w inverts value heads w, w + NW, ... (`_ptx.WY_INVERSE_PRELUDE`); every thread makes the
                    # call (no branch around it: no barrier can diverge), a warp without a head returns at once
                    T.sync_threads()
                    if norms:
                        # the squared key norms: K K^T's diagonal (the CTAs of the key head's first value-head group)
                        if i_y % NG == 0:
                            for i in T.Parallel(BT):
                                if t0 + i < eos:
                                    k_norm2[0, t0 + i, i_h] = kkd_shared[i // B16, i % B16, i % B16]
                    warp = tid // 32
                    for rnd in T.serial(T.ceildiv(G, NW)):
                        j = rnd * NW + warp
                        jc = T.min(j, G - 1)
                        T.call_extern("handle", _ptx.WY_INVERSE[k_dtype], T.address_of(l_hi[0, 0]),
                                      T.address_of(l_lo[0, 0]), T.address_of(kkd_shared[0, 0, 0]),
                                      T.address_of(beta_shared[0, jc]), GB, T.address_of(k_shared[0, 0]), NWK,
                                      T.address_of(ws[0, 0]),    # (the key tile when NWK == NWS: not read)
                                      T.address_of(A[0, T.cast(t0, "int64"), hv0 + jc, 0]),
                                      T.cast(HV * BT, "int64"), eos - t0, j < G, tid)
                    mark(0, "c.inverse")
                else:
                    # padding tail: zeros
                    for i, j in T.Parallel(BT, G):
                        if t0 + i < eos:
                            g_cumsum[0, t0 + i, hv0 + j] = 0
                            if beta_act:
                                beta_out[0, t0 + i, hv0 + j] = 0
                    if G == GB:
                        for i, j, c in T.Parallel(BT, G, BT):
                            if t0 + i < eos:
                                A[0, t0 + i, hv0 + j, c] = 0
                    else:   # TileLang finds no layout for a (64, G, 64) parallel loop with G = 3
                        for j in T.serial(G):
                            for i, c in T.Parallel(BT, BT):
                                if t0 + i < eos:
                                    A[0, t0 + i, hv0 + j, c] = 0
            mark.end()

    return prepare_fwd_kernel


def builder_args(H: int, HV: int, K: int, k_dtype: torch.dtype, beta_dtype: torch.dtype,
                 heads_per_cta: int = 0, options: tuple = (F32, None, None, 0), norms: bool = False) -> tuple:
    """The `build` arguments (its compile-cache key) for one call; heads_per_cta 0 (or HV / H): every value head of
    a key head in one CTA; options: `prepare_common.option_args` (default: g fp32 log decays, beta as given);
    norms: the squared key norms' output (appended only when set: the other builds keep their cache keys)."""
    return (H, HV, K, _tl.TL_DTYPE[k_dtype], _tl.TL_DTYPE[beta_dtype], heads_key(H, HV, heads_per_cta), *options,
            *((True,) if norms else ()))


def launch(k, g, beta, A_log, dt_bias, cu_seqlens, g_cumsum, A, beta_out, *, heads_per_cta: int, beta_act: int,
           k_norm2=None):
    """Builds (or loads) the kernel for these inputs and runs it into g_cumsum, A, beta_out and k_norm2 (checked and
    allocated by the caller, `prepare_common.fwd_outputs`; T > 0; A_log, dt_bias, beta_out, k_norm2 None where
    absent)."""
    H, K, HV = k.shape[2], k.shape[3], g.shape[-1]
    args = builder_args(H, HV, K, k.dtype, beta.dtype, heads_per_cta, option_args(g, A_log, dt_bias, beta_act),
                        norms=k_norm2 is not None)
    tensors = (k, g, beta, A_log, dt_bias, cu_seqlens, g_cumsum, A, beta_out, k_norm2)
    build(*args)(*[x for x in tensors if x is not None])
