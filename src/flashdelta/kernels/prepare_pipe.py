"""Stage `prepare` forward, the persistent pipelined kernel: the same results as the one-shot kernel
(prepare_oneshot.py; the math is in prepare_common.py), organised for throughput. The launcher (prepare.py) takes it
where `prepare.use_pipe`.

The one-shot CTAs (one per chunk slot and key head) run load -> K K^T -> split -> cumsum -> inverse one after the
other, so each CTA spends about a third of its life waiting for its key tile. Here a grid of `blocks` CTAs per SM walks
the work items (chunk slot, key head, value-head group) round robin, and each CTA splits the roles:

- producer warp (after the consumers): finds the item's chunk (a 32-way search of cu_seqlens), TMA-loads the key tile
  into a 2-slot ring, writes beta (0 past the sequence end; activated, and stored to the activated beta's output, in
  builds with a beta activation) next to it and hands the slot over; with 4+ value
  heads per item it then writes the chunk-local cumsum of g straight to g_cumsum (a shuffle scan, all value heads'
  loads at once), which nothing on the chip waits for. The loads of the next items run under the current items'
  inverses.
- consumer warpgroup: zeroes key rows past the sequence end, K K^T on wgmma, the split into the inverse's inputs,
  then each warp inverts one value head (`_ptx.WY_INVERSE_PRELUDE`); with fewer value heads than warps, warp G does
  the gate cumsum meanwhile (off the producer's serial chain). The first `NWK` warps' workspaces live in the slot's
  dead key tile, so a slot is released after the inverse.

Barriers: full[s] (32 arrivals of the producer warp + the TMA bytes), empty[s] (128 arrivals of the consumer
warpgroup); slot s = i % NS for the CTA's i-th item (NS = 2), parity (i // NS) % 2. Every item is published, idle
ones (a slot past its sequence's last chunk) with kind 0, so both roles walk the same list. docs/fused_fwd.md
("The prepare kernel") has what was measured and tried.

Timeline: `TABLE` (kernels/timeline.py), consumer thread 0 and producer lane 0 of the first CTAs, per item.
"""
# No `from __future__ import annotations`: TileLang evaluates the prim_func annotations in this scope.
from typing import Optional

import tilelang.language as T
import torch

from . import _chunks, _ptx, _tl, timeline
from .prepare_common import (BF16, BT, F32, GATE_PRELUDE, NW, SUPPORTED_K, beta_load, check_options, gate_cumsum,
                             gate_mode, heads_key, option_args, split_gram)

CONSUMERS = 128             # threads of a consumer warpgroup (K K^T on wgmma, one value head per warp in the inverse)
SMEM_PER_SM = 227 * 1024    # usable shared memory per SM (H100/H200), less 1 KB reserved per CTA below
MAX_BLOCKS = 4
THREADS = CONSUMERS + 32     # the consumer warpgroup and the producer warp
MIN_REGS = 96               # registers per thread a build may be squeezed to (ptxas: the inverse spills a little here)
IDLE, REAL, PAD = 0, 1, 2   # item kinds (meta_s[s, 2])
NS = 2                      # key-tile ring slots: the item being inverted and the next one loading

TABLE = timeline.Table(
    "prepare_pipe",
    roles={"c": ("consumer WG", 0), "p": ("producer warp", CONSUMERS)},
    events={
        "c.full": "wait full (producer/TMA)",
        "c.kkt": "K K^T complete (ragged rows zeroed)",
        "c.split": "K K^T split into the inverse's inputs",
        "c.released": "warp 0's inverses stored, slot released",
        "p.found": "item's chunk found (cu_seqlens search)",
        "p.empty": "wait empty (consumer WG)",
        "p.handed": "key tile TMA issued, beta and meta written, full arrived",
        "p.cumsum": "gate cumsum stored (items the producer does it for)",
    },
    ctas=4, steps=64, value="items of the CTA")


def _layout(K: int, G: int, k_bytes: int = 2) -> dict:
    """Shared-memory plan of one CTA: bytes per buffer, the warps whose workspace lives in the key tile (NWK)."""
    NWS = min(G, NW)
    NWK = min(NWS, 64 * K * k_bytes // (4 * _ptx.WY_WS_FLOATS))
    GB = 1 << (G - 1).bit_length()
    parts = {
        "k": NS * 64 * K * k_bytes,
        "beta": NS * 64 * GB * 4,
        "meta": NS * 4 * 4,
        "kkd": 4 * 16 * 17 * 4,
        "l": 2 * 48 * _ptx.WY_LP * 2,
        "ws": (NWS - NWK) * _ptx.WY_WS_FLOATS * 4,
    }
    return {"bytes": sum(parts.values()), "NWS": NWS, "NWK": NWK, "GB": GB, **parts}


def blocks_per_sm(K: int, G: int) -> int:
    """CTAs per SM the shared memory and `MIN_REGS` registers per thread allow (at most `MAX_BLOCKS`)."""
    by_regs = 65536 // (THREADS * MIN_REGS)
    return max(1, min(MAX_BLOCKS, by_regs, SMEM_PER_SM // (_layout(K, G)["bytes"] + 1024)))


@_tl.jit(pass_configs=_tl.WS_PASS_CONFIGS, table=TABLE)
def build(H: int, HV: int, K: int, k_dtype: str, beta_dtype: str, heads_per_cta: int, g_dtype: str,
          a_log_dtype: Optional[str], dt_bias_dtype: Optional[str], beta_act: int, num_sms: int, norms: bool = False):
    """heads_per_cta, the in-kernel activations (g_dtype .. beta_act) and norms (the squared key norms' output) as
    in `prepare_oneshot.build` (0 = all HV / H of a key head); num_sms (as in the builds before the activations): the
    grid is `num_sms * blocks_per_sm(...)` CTAs (fewer when there are fewer items)."""
    # problem config
    assert HV % H == 0 and K in SUPPORTED_K
    check_options(g_dtype, a_log_dtype, dt_bias_dtype, beta_act)
    gate = gate_mode(a_log_dtype, dt_bias_dtype)
    G = heads_per_cta or HV // H    # value heads per item
    NG = HV // H // G               # items per (chunk slot, key head)
    assert (HV // H) % G == 0
    NY = H * NG
    lay = _layout(K, G)
    GB, NWS, NWK = lay["GB"], lay["NWS"], lay["NWK"]
    blocks = blocks_per_sm(K, G)
    NC = num_sms * blocks           # CTAs of a full grid
    n_tok = T.dynamic("T")
    n_seqs = T.dynamic("N")
    B16 = 16

    @T.prim_func
    def prepare_fwd_pipe_kernel(
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
        n_items = _chunks.num_slots(n_tok, n_seqs, BT) * NY
        prelude = _ptx.WY_INVERSE_PRELUDE + _ptx.PRODUCER_PRELUDE + timeline.prelude(TABLE)
        if gate or beta_act:
            prelude += GATE_PRELUDE
        with T.Kernel(T.min(n_items, NC), threads=THREADS, prelude=prelude) as bx:
            T.annotate_min_blocks_per_sm(blocks)
            tx = T.get_thread_binding()
            n_my = T.ceildiv(n_items - bx, NC)      # this CTA's items: bx, bx + NC, ...
            mark = timeline.marker(TABLE, bx, tx)

            k_s = T.alloc_shared((NS, BT, K), k_dtype)
            beta_s = T.alloc_shared((NS, BT, GB), F32)
            meta_s = T.alloc_shared((NS, 4), "int32")      # t0, eos - t0, kind
            # the inverse's inputs as in the one-shot kernel: K K^T's diagonal blocks in fp32 and its lower blocks as bf16
            # hi/lo (unscaled; beta scales rows per value head), and the workspaces of the warps beyond the NWK that
            # use the item's dead key tile
            kkd_shared = T.alloc_shared((4, B16, B16 + 1), F32)
            l_hi = T.alloc_shared((BT - B16, _ptx.WY_LP), BF16)
            l_lo = T.alloc_shared((BT - B16, _ptx.WY_LP), BF16)
            ws = T.alloc_shared((NWS - NWK, _ptx.WY_WS_FLOATS), F32) if NWK < NWS else None
            full = T.alloc_barrier([32] * NS)
            empty = T.alloc_barrier([CONSUMERS] * NS)

            if tx < CONSUMERS:
                # ================= consumer warpgroup =================
                kk_frag = T.alloc_fragment((BT, BT), F32)
                mark.start()
                mark.value(n_my)
                for i in T.serial(n_my):
                    it = bx + i * NC
                    hv0 = (it % NY) * G
                    s = i % NS
                    T.barrier_wait(full[s], (i // NS) % 2)
                    mark(i, "c.full")
                    t0 = meta_s[s, 0]
                    ln = meta_s[s, 1]
                    kind = meta_s[s, 2]
                    if kind == REAL:
                        if ln < BT:
                            # rows past the end (next sequence, padding tail: maybe NaN) must not reach K K^T
                            for r, d in T.Parallel(BT, K):
                                if r >= ln:
                                    k_s[s, r, d] = T.cast(0, k_dtype)
                            T.fence_proxy_async()
                        # also: every warp has finished the previous item's inverse (kkd, l_hi, l_lo are free)
                        T.sync_threads(1, CONSUMERS)
                        T.wgmma_gemm(k_s[s, :, :], k_s[s, :, :], kk_frag, transpose_B=True, clear_accum=True)
                        T.wait_wgmma(0)
                        mark(i, "c.kkt")
                        split_gram(kk_frag, kkd_shared, l_hi, l_lo)
                        T.sync_threads(1, CONSUMERS)
                        mark(i, "c.split")
                        if norms:
                            # the squared key norms: K K^T's diagonal (the key head's first value-head group)
                            if (it % NY) % NG == 0:
                                for r in T.Parallel(BT):
                                    if r < ln:
                                        k_norm2[0, T.cast(t0 + r, "int64"), (it % NY) // NG] = \
                                            kkd_shared[r // B16, r % B16, r % B16]
                        warp = tx // 32
                        if G < NW:
                            # a warp without a value head does the gate cumsum (under the others' inverses)
                            if warp == G:
                                gate_cumsum(G, g, g_cumsum, t0, hv0, HV, ln, False, tx % 32, A_log, dt_bias, gate)
                        for rnd in T.serial(T.ceildiv(G, NW)):
                            j = rnd * NW + warp
                            jc = T.min(j, G - 1)
                            T.call_extern("handle", _ptx.WY_INVERSE[k_dtype], T.address_of(l_hi[0, 0]),
                                          T.address_of(l_lo[0, 0]), T.address_of(kkd_shared[0, 0, 0]),
                                          T.address_of(beta_s[s, 0, jc]), GB, T.address_of(k_s[s, 0, 0]), NWK,
                                          T.address_of(ws[0, 0]) if ws is not None else T.address_of(k_s[s, 0, 0]),
                                          T.address_of(A[0, T.cast(t0, "int64"), hv0 + jc, 0]),
                                          T.cast(HV * BT, "int64"), ln, j < G, tx)
                    elif kind == PAD:
                        # padding tail [cu_seqlens[N], T): A = 0 (and g_cumsum = 0, by the producer)
                        for j in T.serial(G):
                            for r, c in T.Parallel(BT, BT):
                                if r < ln:
                                    A[0, T.cast(t0 + r, "int64"), hv0 + j, c] = T.cast(0, k_dtype)
                    # the slot (key tile, workspaces written by the generic proxy) goes back to the TMA
                    T.fence_proxy_async()
                    T.barrier_arrive(empty[s])
                    mark(i, "c.released")
                mark.end()
            else:
                # ================= producer warp =================
                lane = tx - CONSUMERS
                for i in T.serial(n_my):
                    it = bx + i * NC
                    i_s = it // NY
                    i_h = (it % NY) // NG
                    hv0 = (it % NY) * G
                    s = i % NS
                    seq = T.call_extern("int32", "fd_find_seq", T.address_of(cu_seqlens[0]), i_s, n_seqs, BT, lane)
                    bos = cu_seqlens[seq]
                    t0 = bos + (i_s - bos // BT - seq) * BT
                    eos = T.if_then_else(seq < n_seqs, cu_seqlens[T.min(seq + 1, n_seqs)], n_tok)
                    mark(i, "p.found")
                    T.barrier_wait(empty[s], ((i // NS) % 2) ^ 1)
                    mark(i, "p.empty")
                    if (t0 < eos) & (seq < n_seqs):
                        T.tma_copy(k[0, t0:t0 + BT, i_h, 0:K], k_s[s, :, :], barrier=full[s])
                        for r, j in T.Parallel(BT, G):
                            tt = T.cast(T.min(t0 + r, eos - 1), "int64")
                            beta_s[s, r, j] = T.Select(t0 + r < eos, beta_load(beta, tt, hv0 + j, beta_act), 0.0)
                            if beta_act:
                                if t0 + r < eos:
                                    beta_out[0, tt, hv0 + j] = beta_s[s, r, j]      # (this thread's own store)
                    if beta_act:
                        if (t0 < eos) & (seq == n_seqs):
                            # padding tail: the activated beta is 0 there (g_cumsum's zeros: the cumsum below)
                            for r, j in T.Parallel(BT, G):
                                if t0 + r < eos:
                                    beta_out[0, T.cast(t0 + r, "int64"), hv0 + j] = 0.0
                    if lane == 0:
                        meta_s[s, 0] = t0
                        meta_s[s, 1] = eos - t0
                        meta_s[s, 2] = T.if_then_else(t0 < eos, T.if_then_else(seq < n_seqs, REAL, PAD), IDLE)
                    T.barrier_arrive(full[s])
                    mark(i, "p.handed")
                    # the gate cumsum goes straight to g_cumsum, after the hand-off (nothing on the chip waits for
                    # it); with fewer value heads than consumer warps a consumer warp does it for real chunks
                    if (t0 < eos) & ((G >= NW) | (seq == n_seqs)):
                        gate_cumsum(G, g, g_cumsum, t0, hv0, HV, eos - t0, seq == n_seqs, lane, A_log, dt_bias, gate)
                        mark(i, "p.cumsum")

    return prepare_fwd_pipe_kernel


def builder_args(H: int, HV: int, K: int, k_dtype: torch.dtype, beta_dtype: torch.dtype, heads_per_cta: int = 0,
                 num_sms: int = _tl.DEFAULT_NUM_SMS, options: tuple = (F32, None, None, 0), norms: bool = False) -> tuple:
    """The `build` arguments (its compile-cache key) for one call; num_sms: the GPU's SM count (the grid); options:
    `prepare_common.option_args` (default: g fp32 log decays, beta as given); norms as in
    `prepare_oneshot.builder_args`."""
    return (H, HV, K, _tl.TL_DTYPE[k_dtype], _tl.TL_DTYPE[beta_dtype], heads_key(H, HV, heads_per_cta), *options,
            int(num_sms), *((True,) if norms else ()))


def launch(k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, A_log, dt_bias, cu_seqlens: torch.Tensor,
           g_cumsum: torch.Tensor, A: torch.Tensor, beta_out, *, num_sms: int, heads_per_cta: int = 0,
           beta_act: int = 0, k_norm2=None):
    """Builds (or loads) the persistent kernel for these inputs and runs it into g_cumsum, A, beta_out and k_norm2
    (checked and allocated by the caller, `prepare_common.fwd_outputs`; T > 0; A_log, dt_bias, beta_out, k_norm2
    None where absent)."""
    H, K, HV = k.shape[2], k.shape[3], g.shape[-1]
    args = builder_args(H, HV, K, k.dtype, beta.dtype, heads_per_cta, num_sms, option_args(g, A_log, dt_bias, beta_act),
                        norms=k_norm2 is not None)
    tensors = (k, g, beta, A_log, dt_bias, cu_seqlens, g_cumsum, A, beta_out, k_norm2)
    build(*args)(*[x for x in tensors if x is not None])
