"""Stage `prepare` forward, persistent and pipelined: the same results as `prepare._build_prepare_fwd` (g_cumsum
and A; the math and the chunk-slot numbering are in `prepare`'s docstring), organised for throughput.

`prepare`'s one-shot CTAs (one per chunk slot and key head) run load -> K K^T -> split -> cumsum -> inverse one
after the other, so each CTA spends about a third of its life waiting for its key tile (session 7's timeline:
10.5 us, of which 3.4 loading and 0.75 in the cumsum). Here a grid of `blocks` CTAs per SM walks the work items
(chunk slot, key head, value-head group) round robin, and each CTA splits the roles:

- producer warp (after the consumers): finds the item's chunk (a 32-way search of cu_seqlens), TMA-loads the key tile
  into a 2-slot ring, writes beta (0 past the sequence end) next to it and hands the slot over; with 4+ value
  heads per item it then writes the chunk-local cumsum of g straight to g_cumsum (a shuffle scan, all value heads'
  loads at once), which nothing on the chip waits for. The loads of the next items run under the current items'
  inverses.
- consumer warpgroup: zeroes key rows past the sequence end, K K^T on wgmma, the split into the inverse's inputs,
  then each warp inverts one value head (`_ptx.WY_INVERSE_PRELUDE`, as in `prepare`); with fewer value heads
  than warps, warp G does the gate cumsum meanwhile (off the producer's serial chain). The first `NWK` warps'
  workspaces live in the slot's dead key tile, so a slot is released after the inverse.

Barriers: full[s] (32 arrivals of the producer warp + the TMA bytes), empty[s] (128 arrivals of the consumer
warpgroup); slot s = i % NS for the CTA's i-th item (NS = 2), parity (i // NS) % 2. Every item is published, idle
ones (a slot past its sequence's last chunk) with kind 0, so both roles walk the same list.

Measured (NOTES-gpu.md sessions 10-11, A/B against the one-shot kernel, H200): GVA 1 -20..-23%, GVA 2 -6..-8%,
GVA 3 -13..-27% on multi-chunk rows; in the grid GVA 2 gained ~1% on long rows and lost on short ones, so the
launcher (`prepare.prepare_fwd`) takes this build at GVA 1 and 3 with several items per CTA (`prepare.use_pipe`).
At GVA 4 it is 25-30% slower: the one-shot kernel's 4 CTAs x 4 inverting warps per SM beat 3 x 4 here (shared
memory). Where the producer did the gate cumsum before handing the slot over, or at all on its serial chain
(find -> TMA -> beta -> cumsum), it paced the kernel: with fewer value heads than warps a consumer warp without a
head does the cumsum. Tried and removed (session 11, code in 68d9f58): a separate gate warp (no gain at any GVA)
and two consumer warpgroups per CTA (16 inverting warps per SM at GVA 4, 96 registers: 45-57% slower than the
one-shot kernel, with one producer per two warpgroups).
"""
# No `from __future__ import annotations`: TileLang evaluates the prim_func annotations in this scope.
import tilelang
import tilelang.language as T
import torch

from . import _ptx, _tl
from .prepare import BF16, F32, NW, SUPPORTED_K, _TORCH_TO_TL, _hpc_key, split_gram

CONSUMERS = 128             # threads of a consumer warpgroup (K K^T on wgmma, one value head per warp in the inverse)
SMEM_PER_SM = 227 * 1024    # usable shared memory per SM (H100/H200), less 1 KB reserved per CTA below
MAX_BLOCKS = 4
THREADS = CONSUMERS + 32     # the consumer warpgroup and the producer warp
MIN_REGS = 96               # registers per thread a build may be squeezed to (ptxas: the inverse spills a little here)
IDLE, REAL, PAD = 0, 1, 2   # item kinds (meta_s[s, 2])
NS = 2                      # key-tile ring slots: the item being inverted and the next one loading

# TileLang would put __syncthreads (all threads) where it cannot prove a buffer is thread-private; the roles
# synchronise with mbarriers and each consumer warpgroup's named barrier only.
_PASS_CONFIGS = {**_tl.PASS_CONFIGS, "tl.disable_shared_memory_reuse": True, "tl.disable_thread_storage_sync": True}


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


@tilelang.jit(target=_tl.SM90_TARGET, pass_configs=_PASS_CONFIGS)
def _build_prepare_fwd_pipe(HV: int, H: int, K: int, BT: int = 64, k_dtype: str = BF16, beta_dtype: str = F32,
                            heads_per_cta: int = 0, num_sms: int = 132):
    """heads_per_cta as in `prepare._build_prepare_fwd` (0 = all HV / H of a key head); num_sms: the grid is
    `num_sms * blocks_per_sm(...)` CTAs (fewer when there are fewer items)."""
    # problem config
    assert BT == 64 and HV % H == 0 and K in SUPPORTED_K
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
        g: T.Tensor((1, n_tok, HV), F32),
        beta: T.Tensor((1, n_tok, HV), beta_dtype),
        cu_seqlens: T.Tensor((n_seqs + 1,), "int32"),
        g_cumsum: T.Tensor((1, n_tok, HV), F32),
        A: T.Tensor((1, n_tok, HV, BT), k_dtype),
    ):
        n_items = (n_tok // BT + n_seqs + 1) * NY
        prelude = _ptx.WY_INVERSE_PRELUDE + _ptx.PRODUCER_PRELUDE
        with T.Kernel(T.min(n_items, NC), threads=THREADS, prelude=prelude) as bx:
            T.annotate_min_blocks_per_sm(blocks)
            tx = T.get_thread_binding()
            n_my = T.ceildiv(n_items - bx, NC)      # this CTA's items: bx, bx + NC, ...

            k_s = T.alloc_shared((NS, BT, K), k_dtype)
            beta_s = T.alloc_shared((NS, BT, GB), F32)
            meta_s = T.alloc_shared((NS, 4), "int32")      # t0, eos - t0, kind
            # the inverse's inputs as in `prepare`: K K^T's diagonal blocks in fp32 and its lower blocks as bf16
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
                for i in T.serial(n_my):
                    it = bx + i * NC
                    hv0 = (it % NY) * G
                    s = i % NS
                    T.barrier_wait(full[s], (i // NS) % 2)
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
                        split_gram(kk_frag, kkd_shared, l_hi, l_lo)
                        T.sync_threads(1, CONSUMERS)
                        warp = tx // 32
                        if G < NW:
                            # a warp without a value head does the gate cumsum (under the others' inverses)
                            if warp == G:
                                T.call_extern("handle", f"fd_gate_cumsum<{G}>",
                                              T.address_of(g[0, T.cast(t0, "int64"), hv0]),
                                              T.address_of(g_cumsum[0, T.cast(t0, "int64"), hv0]),
                                              T.cast(HV, "int64"), ln, False, tx % 32)
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
                    T.barrier_wait(empty[s], ((i // NS) % 2) ^ 1)
                    if (t0 < eos) & (seq < n_seqs):
                        T.tma_copy(k[0, t0:t0 + BT, i_h, 0:K], k_s[s, :, :], barrier=full[s])
                        for r, j in T.Parallel(BT, G):
                            tt = T.cast(T.min(t0 + r, eos - 1), "int64")
                            beta_s[s, r, j] = T.Select(t0 + r < eos, T.cast(beta[0, tt, hv0 + j], F32), 0.0)
                    if lane == 0:
                        meta_s[s, 0] = t0
                        meta_s[s, 1] = eos - t0
                        meta_s[s, 2] = T.if_then_else(t0 < eos, T.if_then_else(seq < n_seqs, REAL, PAD), IDLE)
                    T.barrier_arrive(full[s])
                    # the gate cumsum goes straight to g_cumsum, after the hand-off (nothing on the chip waits for
                    # it); with fewer value heads than consumer warps a consumer warp does it for real chunks
                    if (t0 < eos) & ((G >= NW) | (seq == n_seqs)):
                        T.call_extern("handle", f"fd_gate_cumsum<{G}>",
                                      T.address_of(g[0, T.cast(t0, "int64"), hv0]),
                                      T.address_of(g_cumsum[0, T.cast(t0, "int64"), hv0]),
                                      T.cast(HV, "int64"), eos - t0, seq == n_seqs, lane)

    return prepare_fwd_pipe_kernel


def builder_args(H: int, HV: int, K: int, k_dtype: torch.dtype, beta_dtype: torch.dtype, heads_per_cta: int = 0,
                 num_sms: int = 132) -> tuple:
    """The `_build_prepare_fwd_pipe` arguments (its compile-cache key) for one call; shared with `warmup`."""
    return (HV, H, K, 64, _TORCH_TO_TL[k_dtype], _TORCH_TO_TL[beta_dtype], _hpc_key(H, HV, heads_per_cta),
            int(num_sms))


def launch(k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, cu_seqlens: torch.Tensor, g_cumsum: torch.Tensor,
           A: torch.Tensor, *, num_sms: int, heads_per_cta: int = 0):
    """Builds (or loads) the persistent kernel for these inputs and runs it into g_cumsum and A (checked and
    allocated by the caller, `prepare._fwd_outputs`; T > 0)."""
    H, K, HV = k.shape[2], k.shape[3], g.shape[-1]
    _build_prepare_fwd_pipe(*builder_args(H, HV, K, k.dtype, beta.dtype, heads_per_cta, num_sms))(
        k, g, beta, cu_seqlens, g_cumsum, A)


def prepare_fwd_pipe(k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, cu_seqlens: torch.Tensor, *,
                     chunk_size: int = 64, heads_per_cta: int = 0) -> tuple:
    """`prepare.prepare_fwd` by the persistent kernel whatever the head grouping and size (the launcher takes it
    where `prepare.use_pipe`): same arguments and results (A bit-identical to the one-shot kernel's).
    heads_per_cta: value heads per work item, a divisor of HV / H (0: all)."""
    from .prepare import _fwd_outputs, _num_sms  # noqa: PLC0415

    HV, H = g.shape[-1], k.shape[2]
    if heads_per_cta and (HV // H) % heads_per_cta:
        raise ValueError(f"heads_per_cta: must divide HV / H = {HV // H}; got {heads_per_cta}")
    cu_seqlens, g_cumsum, A = _fwd_outputs(k, g, beta, cu_seqlens, chunk_size)
    if k.shape[1] > 0:
        launch(k, g, beta, cu_seqlens, g_cumsum, A, num_sms=_num_sms(k.device), heads_per_cta=heads_per_cta)
    return g_cumsum, A
