"""Fused chunked GDN forward (Hopper, TileLang): o and the final state in one launch.

docs/fused_fwd.md has the barrier table, the per-chunk cost model and what has been tried.

One CTA walks every chunk of one (sequence, value head, V slice) with the state in fp32 registers. Per chunk
(docs/stages.md notation, C = BT = 64, S0 the state entering the chunk, the state held transposed as
``S^T [BV, K]`` so that it is the register A operand of every GEMM that reads it):

    Ag  = (A o Gamma) diag(beta)                         state-independent, "prep" warpgroup
    Ae  = -diag(exp G) (A o beta_j)                      state-independent, "prep"
    Pg  = scale * Gamma o (Q K^T)                        state-independent, "prep"
    Y    = S0^T K^T                                      "state" warpgroup
    Vd^T = V^T Ag^T + Y Ae^T                             = (Ag (V - D K S0))^T, "state"
    O^T  = diag-scaled (S0^T Q^T) + Vd^T Pg^T            "state"
    S1^T = exp(G_last) S0^T + (Vd^T diag(R)) K           "state"

The serial chain S0 -> Y -> Vd -> S1 is three register-A wgmma groups and fp32->bf16 conversions: no
shared-memory round trip. Warp roles (384 threads):

- WG0 "state"   (240 regs): the chain above, software-pipelined (chunk c+1's V^T Ag^T and the S -> bf16
  conversion run under chunk c's tail, chunk c's o staging under chunk c+1's last Vd GEMM), then O^T -> o_shared
  for the store warp (packed conversion and stmatrix.trans; rows padded).
- WG1 "prep"    (224 regs): Q K^T, Gamma, Pg, Ag (in place over the A tile), Ae, and the per-row scalars R,
  scale*exp(G), exp(G_last); runs up to two chunks ahead of WG0 (three product buffers). Branch-free
  element-wise code (`T.Select`).
- WG2 producer  (40 regs): warp 0 TMA-loads q, k, v, A into a 3-stage ring; warp 2 gathers g, beta into the same
  slot (rows past the sequence end get g[eos-1] and beta = 0); warp 1 stores o rows with a 16-byte PTX loop.
  A ring slot's v/A/g/beta part is released as soon as the chunk's Vd GEMMs complete (q/k when the chunk ends), so
  the producer starts the DRAM-bound loads one chunk earlier.

Context parallelism's internal passes (`flashdelta.cp`) launch builds with `chunk_skip`: each (sequence, value
head) starts its walk at a chunk given per CTA pair on the device (the warm-up windows, docs/algorithm.md §4.4); the
start token moves and the CTAs take their (sequence, head) items longest walk first (`item_order`: a few heads
walk whole partitions, most a few chunks), nothing else changes, and the builds without the flag are the same code
as before it existed.

Ragged chunks take the same path: TMA loads all 64 rows, the prep warpgroup zeroes q/k/v/A rows past the end
(beta is 0 there), so nothing from the next sequence or the padding tail (even NaN) reaches a result. Every
shared-memory write by ordinary stores that wgmma or TMA reads next is followed by fence.proxy.async.
CTA x index = (sequence rank, value head, V slice) flattened, rank slowest, so >65,535 sequences work and CTAs
that share a key head run together; rank i is sequence ``seq_order[i]`` (`_tl.seq_order`: longest first where the
grid takes more than one wave), and the last, N, zero-fills o on the padding tail [cu[N], T).
Global offsets that can pass 2^31 elements (o, g, beta, states) are computed in int64; TMA uses tensor maps.

Timeline: `TABLE` (kernels/timeline.py), one thread per role; bench/dev/timeline.py prints it.
"""
# No `from __future__ import annotations`: TileLang evaluates the prim_func annotations in this scope.
import math

import tilelang.language as T
import torch

from . import _ptx, _tl, item_order, timeline

BT = 64                 # chunk size
NUM_STAGES = 3          # q/k/v/A/g/beta ring depth
# (K, V) pairs this kernel supports (each run on an H200 in tests/gpu/test_fwd.py). K <= 128 keeps S^T [64, K] in
# the state warpgroup's registers; V is split into V / 64 CTAs.
HEAD_DIMS = ((128, 128), (64, 64), (128, 256))
# One state warpgroup owns 64 value columns (wgmma M = 64); two would need 2 x ~216 + prep + producer > 512
# registers per thread slot, so BV is fixed and every grid splits V into V / 64 CTAs.
BV = 64
DTYPES = (torch.bfloat16, torch.float16)   # q, k, v, A, o

LOG2E = 1.4426950408889634

TABLE = timeline.Table(
    "fused_fwd",
    roles={"s": ("state WG", 0), "p": ("prep WG", 128), "l": ("load warp", 256), "w": ("store warp", 288),
           "g": ("gate warp", 320)},
    events={
        "s.full": "wait full (producer/TMA)",
        "s.prep": "wait prep_done (prep WG)",
        "s.vd_done": "Vd^T = V^T Ag^T + Y Ae^T complete (S0 -> bf16, Y, e_L scaling on the way)",
        "s.tail": "S1 and O^T of chunk c complete (recorded in chunk c+1's iteration)",
        "s.o_empty": "wait o_empty (store warp)",
        "s.o_staged": "O^T staged in o_s, o_full arrived",
        "p.full": "wait full (producer/TMA), ragged rows zeroed",
        "p.pout": "wait pout_empty (state WG); Q K^T issued, A and gates to registers",
        "p.qk_done": "Q K^T complete",
        "p.done": "Gamma, Pg, Ag, Ae, row scalars stored, prep_done arrived",
        "l.empty": "wait empty_va (state WG)",
        "l.qk_slot": "wait empty (state WG); v and A TMA issued",
        "l.issued": "q and k TMA issued, full arrived",
        "g.empty": "wait empty_va (state WG)",
        "g.loaded": "g and beta stored, full arrived",
        "w.o_full": "wait o_full (state WG)",
        "w.stored": "o rows stored, o_empty arrived",
    },
    ctas=2, steps=128, value="NT")


@_tl.jit(pass_configs=_tl.WS_PASS_CONFIGS, table=TABLE)
def build(H: int, HV: int, K: int, V: int, dtype: str, beta_dtype: str, h0_dtype: str, scale: float,
          has_initial_state: bool, state_v_first: bool, save_states: bool = False, chunk_skip: bool = False,
          zero_v: bool = False, states_only: bool = False, save_starts: bool = False, transitions: bool = False,
          state_seqs: bool = False):
    """The kernel for one compile-time configuration; T (tokens) and N (sequences) are dynamic. save_states: also
    write the state entering every chunk, ``S0^T`` in q's dtype (the value the chunk's GEMMs read) to
    ``hs [slots, HV, V, K]`` at the chunk's slot (`_chunks`: chunk c of sequence n is slot ``bos // BT + n + c``), for
    the backward, staged in shared memory and written by TMA stores under the chunk's first GEMM (`save_state`).
    chunk_skip: a ``skip [N, HV]`` int32 input; the CTAs of (sequence n, value head hv) start their walk at chunk
    ``skip[n, hv]`` (clamped to [0, NT_n]) from the initial state (or zero), so the final state is the state after
    the last chunk of a walk over the sequence's last ``NT_n - skip`` chunks; o of the skipped chunks is not
    written (context parallelism's warm-up windows, docs/algorithm.md §4.4); ``seq_order`` is then the
    ``[(N + 1) HV]`` item order of `item_order` (smallest skip first). zero_v: the values are zero (context
    parallelism's M pass): no v is read (``v`` is a ``[1, 1, 1, V]`` placeholder) and the ring's v tiles are zeroed
    once. states_only: only the final state (context parallelism's M and E passes, whose o is discarded): no o is
    computed or written (``o`` is a ``[1, 1, 1, V]`` placeholder), so no Q K^T, Pg or O^T GEMMs, no q loads and no q,
    Pg or o tiles in shared memory. save_starts: also write the fp32 state entering chunk c of sequence n wherever
    ``c % every == 0`` (and sequence n's initial state, also for an empty sequence) to ``starts [P, HV, K, V]`` at
    slot ``slot[n] + c // every``: the start state of every partition of `every` chunks (context parallelism's
    backward, which then needs no summary passes for its start states), by per-thread stores once per partition.
    transitions: context parallelism's M and E passes in one launch (with states_only, no initial state): besides
    the ``V / 64`` CTAs per (sequence, value head) of the walk of v from zero (E, to ``ht``), ``K / 64`` CTAs walk
    zero values (no v read) from the identity to ``hm [N, HV, K, K]`` (M), all K-first; with chunk_skip the M CTAs
    start at ``skip_m [N, HV]`` and the E CTAs at ``skip``, and an M walk that skips every chunk of a non-empty
    sequence gives M = 0 (a head whose start state comes from its warm-up window; an empty sequence's M is the
    identity). Both kinds of work item share one wave and one item order. state_seqs (with save_states): the states
    go to the slots of other sequences than cu_seqlens' items (context parallelism's output pass saving them over
    the whole sequences its partitions are chunk-aligned pieces of): item n's first chunk is slot
    ``cu_seqlens[n] // BT + h_seq[n]``, its sequence's slot of that chunk (an extra int32 ``h_seq [N]``).
    Without these flags the kernel is unchanged."""
    # problem config
    G = HV // H
    NV = V // BV
    # with transitions a (sequence, value head) has NK = K / 64 M slices, then NV E slices, taken in work items of
    # IC = gcd(NK, NV) CTAs (IPH items per head) so that one item order covers both kinds
    NK = K // BV
    NC = NK + NV if transitions else NV
    IC = math.gcd(NK, NV) if transitions else NV
    IPH = NC // IC
    acc = "float32"
    # tiling config
    NS = NUM_STAGES
    NO = 2                          # o staging buffers
    # buffers of the prep warpgroup's products: it runs up to two chunks ahead; the full build with its state output
    # has room for two only (the S0^T staging tile takes the third's 16 KB of shared memory)
    NP = 2 if save_states and not states_only else 3
    THREADS = 384
    assert K in (64, 128) and V % BV == 0 and HV % H == 0 

    O_LD = BV + 8   # o_s row length in elements (padded: conflict-free transposed writes)
    T_ = T.dynamic("T")
    N_ = T.dynamic("N")
    state_shape = (N_, HV, V, K) if state_v_first else (N_, HV, K, V)
    # without save_states `hs` is no kernel parameter (a non-tensor annotation is a plain Python value to TileLang)
    hs_t = T.Tensor((T.dynamic("S"), HV, V, K), dtype) if save_states else None
    assert not state_seqs or save_states, "state_seqs: with save_states"
    h_seq_t = T.Tensor((N_,), "int32") if state_seqs else None
    skip_t = T.Tensor((N_, HV), "int32") if chunk_skip else None
    # with chunk_skip the CTAs take (sequence, value head) items in `item_order` (the longest walk first),
    # else sequences in `_tl.seq_order`
    order_t = T.Tensor(((N_ + 1) * HV * IPH,), "int32") if chunk_skip else T.Tensor((N_ + 1,), "int32")
    v_t = T.Tensor((1, 1, 1, V), dtype) if zero_v else T.Tensor((1, T_, HV, V), dtype)
    o_t = T.Tensor((1, 1, 1, V), dtype) if states_only else T.Tensor((1, T_, HV, V), dtype)
    assert not (save_starts and (save_states or chunk_skip or zero_v or states_only)), "save_starts: chunk_fwd only"
    assert not transitions or (states_only and not (has_initial_state or state_v_first or zero_v or save_states
                                                    or save_starts)), "transitions: states_only, K-first, no h0"
    hm_t = T.Tensor((N_, HV, K, K), acc) if transitions else None
    skipm_t = T.Tensor((N_, HV), "int32") if transitions and chunk_skip else None
    starts_t = T.Tensor((T.dynamic("P"), HV, K, V), acc) if save_starts else None
    slot_t = T.Tensor((N_,), "int32") if save_starts else None
    every_t = T.int32 if save_starts else None

    def walk_start(bos, eos, skip, skip_m, is_m, i_n, i_hv):
        # the first token of the walk: with chunk_skip, skip[n, hv] chunks in (skip_m[n, hv] for an M slice;
        # clamped, so that no product overflows and a skip past the end gives an empty walk); else the sequence start
        if not chunk_skip:
            return bos
        if transitions:
            sk = T.if_then_else(is_m, skip_m[i_n, i_hv], skip[i_n, i_hv])
        else:
            sk = skip[i_n, i_hv]
        c0 = T.min(T.max(sk, 0), T.ceildiv(eos - bos, BT))
        return T.min(bos + c0 * BT, eos)

    @T.macro
    def finish_chunk(st, pb, s_f, sb_f, vd_f, vdr_f, vdb_f, o_f, q_s, k_s, pg_s, r_s, dq_s):
        # on entry: Vd^T = V^T Ag^T + Y Ae^T complete in vd_f, sb_f = bf16(S0^T), s_f = e_L S0^T, no wgmma pending
        if states_only:
            for i, j in T.Parallel(BV, BT):
                vdr_f[i, j] = T.cast(vd_f[i, j] * r_s[pb, j], dtype)
            T.wgmma_gemm(vdr_f, k_s[st, :, :], s_f)                           # S1^T = e_L S0^T + (Vd^T R) K
        else:
            T.wgmma_gemm(sb_f, q_s[st, :, :], o_f, transpose_B=True, clear_accum=True)   # O^T = S0^T Q^T
            for i, j in T.Parallel(BV, BT):
                vdr_f[i, j] = T.cast(vd_f[i, j] * r_s[pb, j], dtype)
                vdb_f[i, j] = T.cast(vd_f[i, j], dtype)
            T.wgmma_gemm(vdr_f, k_s[st, :, :], s_f)                           # S1^T = e_L S0^T + (Vd^T R) K
            T.wait_wgmma(1)
            for i, j in T.Parallel(BV, BT):
                o_f[i, j] = o_f[i, j] * dq_s[pb, j]
            T.wgmma_gemm(vdb_f, pg_s[pb, :, :], o_f, transpose_B=True)        # O^T += Vd^T Pg^T

    @T.macro
    def zero_v_tiles(v_s):
        # zero values: every slot's v tile is zero for the whole walk (the first arrival on full publishes it; the
        # prep warpgroup's ragged-row zeroing keeps it zero)
        for s_, i, j in T.Parallel(NS, BT, BV):
            v_s[s_, i, j] = T.cast(0, dtype)
        T.fence_proxy_async()

    @T.macro
    def load_v(v, v_s, full, st, t0, i_hv, v0):
        T.tma_copy(v[0, t0:t0 + BT, i_hv, v0:v0 + BV], v_s[st, :, :], barrier=full[st])

    @T.macro
    def save_start(s_f, starts, p, i_hv, v0):
        # the fp32 state entering a partition's first chunk -> starts[p] (K-first, as the final state is stored)
        for i, j in T.Parallel(BV, K):
            starts[T.cast(p, "int64"), i_hv, j, v0 + i] = s_f[i, j]

    @T.macro
    def scale_state(s_f, el_s, pb):
        el = el_s[pb, 0]
        for i, j in T.Parallel(BV, K):
            s_f[i, j] = s_f[i, j] * el

    @T.macro
    def save_state(sb_f, hs_s, hs, slot, i_hv, v0, tx):
        # S0^T (as the GEMMs read it) -> hs[slot] through hs_s by TMA stores that thread 0 issues; it waits for the
        # previous chunk's stores to have read hs_s before the tile is written again (per-thread stores of the
        # fragment stall the state chain behind them)
        if tx == 0:
            T.tma_store_wait(0)
        T.sync_threads(2, 128)
        T.copy(sb_f, hs_s)
        T.fence_proxy_async()
        T.sync_threads(2, 128)
        for w in range(K // 64):
            # one TMA store per 64 columns (a 128-byte-swizzled box is at most 64 two-byte columns wide)
            T.tma_copy(hs_s[:, w * 64:(w + 1) * 64], hs[T.cast(slot, "int64"), i_hv, v0:v0 + BV, w * 64:(w + 1) * 64])

    @T.macro
    def issue_ws(st, pb, s_f, sb_f, vd_f, y_f, yb_f, k_s, ae_s, el_s, hs_s, hs, slot, i_hv, v0, tx):
        # Vd^T += (W S0)^T with W = Ae K, Ae = -diag(exp G) (A o beta_j), as Y = S0^T K^T then Y Ae^T; then
        # s_f <- e_L S0^T (S1's first term, under the Y GEMM). On entry S0^T is in s_f and at most the V^T Ag^T group
        # is pending; on exit the Y Ae^T group is pending. With save_states S0^T (as the GEMMs read it) also goes to
        # hs[slot] (`save_state`, under the Y GEMM).
        T.copy(s_f, sb_f)
        T.wgmma_gemm(sb_f, k_s[st, :, :], y_f, transpose_B=True, clear_accum=True)   # Y = S0^T K^T
        if save_states:
            save_state(sb_f, hs_s, hs, slot, i_hv, v0, tx)
        scale_state(s_f, el_s, pb)
        T.wait_wgmma(0)
        T.copy(y_f, yb_f)
        T.wgmma_gemm(yb_f, ae_s[pb, :, :], vd_f, transpose_B=True)                   # Vd^T += Y Ae^T

    @T.macro
    def stage_o(pb, o_f, o_s, tx):
        # O^T -> o_s[pb] (packed conversion + stmatrix.trans: 16 cvt and 4 stmatrix per thread)
        T.call_extern("handle", _ptx.STAGE_O[dtype], o_f.data, o_s.data, pb * (BT * O_LD), O_LD, tx)

    @T.macro
    def store_o_rows(o, o_s, o_full, o_empty, NT, bos, eos, i_hv, v0, lane, mark):
        # the store warp: o_s rows -> o for rows < ln only (the next sequence or the padding tail follows), by the
        # 16-byte PTX row loop
        for c in T.serial(NT):
            pb = c % NO
            t0 = bos + c * BT
            ln = T.min(eos - t0, BT)
            T.barrier_wait(o_full[pb], (c // NO) % 2)
            mark(c, "w.o_full")
            T.call_extern("handle", "fd_store_rows", T.address_of(o[0, T.cast(t0, "int64"), i_hv, v0]),
                          T.address_of(o_s[pb, 0, 0]), ln, HV * V * 2, O_LD * 2, lane)
            T.barrier_arrive(o_empty[pb])
            mark(c, "w.stored")

    @T.macro
    def release_and_store_o(c, o_f, o_s, empty, pout_empty, o_empty, o_full, mark, tx):
        # chunk c's GEMMs have completed: free its ring slot and prep buffers, stage O^T for the store warp
        T.barrier_arrive(empty[c % NS])
        T.barrier_arrive(pout_empty[c % NP])
        if not states_only:
            T.barrier_wait(o_empty[c % NO], ((c // NO) % 2) ^ 1)
            mark(c, "s.o_empty")
            stage_o(c % NO, o_f, o_s, tx)
            T.barrier_arrive(o_full[c % NO])
            mark(c, "s.o_staged")

    @T.macro
    def wait_inputs(c, st, ln, full, q_s, k_s, v_s, a_s):
        # prep WG: chunk c's ring slot is loaded; rows past the sequence end (another sequence's or padding data)
        # are zeroed in q, k, v and A
        T.barrier_wait(full[st], (c // NS) % 2)
        if ln < BT:
            for i, j in T.Parallel(BT, K):
                if i >= ln:
                    if not states_only:
                        q_s[st, i, j] = T.cast(0, dtype)
                    k_s[st, i, j] = T.cast(0, dtype)
            for i, j in T.Parallel(BT, BV):
                if i >= ln:
                    v_s[st, i, j] = T.cast(0, dtype)
            for i, j in T.Parallel(BT, BT):
                if i >= ln:
                    a_s[st, i, j] = T.cast(0, dtype)
            T.fence_proxy_async()
            T.sync_threads(1, 128)

    @T.macro
    def load_gates(st, g_s, b_s, gi_f, gj_f, bj_f, ei_f):
        # gates in the log2 domain (each exp is one ex2): G of this thread's rows and columns, beta of its columns,
        # -exp(G) of its rows
        for i in T.Parallel(BT):
            gi_f[i] = g_s[st, i] * LOG2E
            ei_f[i] = -T.exp2(gi_f[i])
        for j in T.Parallel(BT):
            gj_f[j] = g_s[st, j] * LOG2E
            bj_f[j] = b_s[st, j]

    @T.macro
    def row_scalars(st, pb, ln, g_s, r_s, dq_s, el_s):
        # R = exp(G_last - G_t) (0 past the end), scale * exp(G_t), exp(G_last)
        for t in T.Parallel(BT):
            r_s[pb, t] = T.Select(t < ln, T.exp2((g_s[st, BT - 1] - g_s[st, t]) * LOG2E), 0.0)
            dq_s[pb, t] = T.exp2(g_s[st, t] * LOG2E) * scale
        el_s[pb, 0] = T.exp2(g_s[st, BT - 1] * LOG2E)

    @T.macro
    def prep_loop(NT, bos, eos, mark, full, pout_empty, prep_done, q_s, k_s, v_s, a_s, g_s, b_s, ae_s, pg_s,
                  r_s, dq_s, el_s, p_f, a_f, ab_f, ag_f, pgb_f, ag32_f, ab32_f, gi_f, gj_f, bj_f, ei_f):
        # The prep warpgroup, up to NP - 1 chunks ahead of the state warpgroup: Pg, Ag, Ae and the row scalars.
        for c in T.serial(NT):
            st = c % NS
            pb = c % NP
            ln = T.min(eos - (bos + c * BT), BT)
            wait_inputs(c, st, ln, full, q_s, k_s, v_s, a_s)
            mark(c, "p.full")
            # P = Q K^T   [BT, K] @ [K, BT]; the A tile and the gate values load under it
            if not states_only:
                T.wgmma_gemm(q_s[st, :, :], k_s[st, :, :], p_f, transpose_B=True, clear_accum=True)
            T.copy(a_s[st, :, :], a_f)
            load_gates(st, g_s, b_s, gi_f, gj_f, bj_f, ei_f)
            T.barrier_wait(pout_empty[pb], ((c // NP) % 2) ^ 1)
            mark(c, "p.pout")
            T.wait_wgmma(0)
            mark(c, "p.qk_done")
            # Branch-free element-wise pass, fp32 results then packed conversions. Gamma is exactly 0 above the
            # diagonal (ex2(-inf)); A o beta needs no mask: A is unit lower triangular with exact zeros above the
            # diagonal (prepare_fwd), its rows past the sequence end were zeroed, and beta = 0 on columns past the
            # end. Ae's row factor -exp(G_i) is applied here.
            if states_only:
                for i, j in T.Parallel(BT, BT):
                    gam = T.exp2(T.Select(i >= j, gi_f[i] - gj_f[j], -T.infinity(acc)))
                    ab = T.cast(a_f[i, j], acc) * bj_f[j]
                    ag32_f[i, j] = ab * gam
                    ab32_f[i, j] = ab * ei_f[i]
            else:
                for i, j in T.Parallel(BT, BT):
                    gam = T.exp2(T.Select(i >= j, gi_f[i] - gj_f[j], -T.infinity(acc)))
                    ab = T.cast(a_f[i, j], acc) * bj_f[j]
                    ag32_f[i, j] = ab * gam
                    ab32_f[i, j] = ab * ei_f[i]
                    p_f[i, j] = p_f[i, j] * gam * scale
            T.copy(ab32_f, ab_f)
            T.copy(ag32_f, ag_f)
            if not states_only:
                T.copy(p_f, pgb_f)
            T.copy(ab_f, ae_s[pb, :, :])
            T.copy(ag_f, a_s[st, :, :])
            if not states_only:
                T.copy(pgb_f, pg_s[pb, :, :])
            row_scalars(st, pb, ln, g_s, r_s, dq_s, el_s)
            T.fence_proxy_async()
            T.barrier_arrive(prep_done[pb])
            mark(c, "p.done")

    @T.prim_func
    def chunk_fwd_kernel(
        q: T.Tensor((1, T_, H, K), dtype),
        k: T.Tensor((1, T_, H, K), dtype),
        v: v_t,
        g: T.Tensor((1, T_, HV), acc),
        beta: T.Tensor((1, T_, HV), beta_dtype),
        A: T.Tensor((1, T_, HV, BT), dtype),
        h0: T.Tensor(state_shape, h0_dtype),
        cu_seqlens: T.Tensor((N_ + 1,), "int32"),
        seq_order: order_t,
        o: o_t,
        ht: T.Tensor(state_shape, acc),
        hs: hs_t,
        h_seq: h_seq_t,
        skip: skip_t,
        starts: starts_t,
        slot: slot_t,
        every: every_t,
        hm: hm_t,
        skip_m: skipm_t,
    ):
        prelude = _ptx.STAGE_O_PRELUDE + _ptx.STORE_ROWS_PRELUDE + timeline.prelude(TABLE)
        with T.Kernel((N_ + 1) * (HV * NC), threads=THREADS, prelude=prelude) as bx:
            if chunk_skip:
                item = seq_order[bx // IC]               # longest walk first (`item_order`)
                i_n = item // (HV * IPH)
                i_hv = (item // IPH) % HV
                i_v = (item % IPH) * IC + bx % IC
            else:
                i_n = seq_order[bx // (HV * NC)]         # longest sequence first (`_tl.seq_order`)
                i_hv = (bx // NC) % HV
                i_v = bx % NC
            i_h = i_hv // G
            # with transitions slices [0, NK) walk M (state columns v0 of K), the rest E (value columns v0 of V)
            is_m = i_v < NK if transitions else False
            v0 = T.if_then_else(is_m, i_v, i_v - NK) * BV if transitions else i_v * BV

            # ---- shared memory: input ring, prep outputs, o staging ----
            # states_only reads no q, forms no Pg and stages no o: those tiles are not allocated (None)
            q_s = None if states_only else T.alloc_shared((NS, BT, K), dtype)
            k_s = T.alloc_shared((NS, BT, K), dtype)
            v_s = T.alloc_shared((NS, BT, BV), dtype)
            a_s = T.alloc_shared((NS, BT, BT), dtype)      # A, then Ag in place
            g_s = T.alloc_shared((NS, BT), acc)
            b_s = T.alloc_shared((NS, BT), acc)
            ae_s = T.alloc_shared((NP, BT, BT), dtype)      # Ae = -diag(exp G) (A o beta_j)
            pg_s = None if states_only else T.alloc_shared((NP, BT, BT), dtype)
            r_s = T.alloc_shared((NP, BT), acc)             # exp(G_last - G_t), 0 past the end
            dq_s = T.alloc_shared((NP, BT), acc)            # scale * exp(G_t)
            el_s = T.alloc_shared((NP, 1), acc)             # exp(G_last)
            o_s = None if states_only else T.alloc_shared((NO, BT, O_LD), dtype)    # o staging
            hs_s = T.alloc_shared((BV, K), dtype) if save_states else None        # S0^T staging (save_states)

            full = T.alloc_barrier([64] * NS)        # load warp (32 arrivals + TMA bytes) and gate warp (32)
            empty = T.alloc_barrier([128] * NS)      # state WG releases the q/k part of a ring slot
            empty_va = T.alloc_barrier([128] * NS)   # state WG releases v/A/g/beta of a slot (after the Vd GEMMs)
            prep_done = T.alloc_barrier([128] * NP)
            pout_empty = T.alloc_barrier([128] * NP)  # state WG releases ae/pg/r/dq
            o_full = T.alloc_barrier([128] * NO)
            o_empty = T.alloc_barrier([32] * NO)     # the store warp

            tx = T.get_thread_binding()
            mark = timeline.marker(TABLE, bx, tx)

            if i_n == N_:
                # padding tail [cu_seqlens[N], T): o = 0 for this (head, V slice); nothing with states_only
                if states_only:
                    tb = T_
                else:
                    tb = cu_seqlens[N_]
                VEC = 8
                per_row = BV // VEC
                for it in T.serial(T.ceildiv((T_ - tb) * per_row, THREADS)):
                    e = it * THREADS + tx
                    row = tb + e // per_row
                    if row < T_:
                        for u in T.vectorized(VEC):
                            o[0, T.cast(row, "int64"), i_hv, v0 + (e % per_row) * VEC + u] = T.cast(0, dtype)
            else:
                bos = walk_start(cu_seqlens[i_n], cu_seqlens[i_n + 1], skip, skip_m, is_m, i_n, i_hv)
                eos = cu_seqlens[i_n + 1]
                NT = T.ceildiv(eos - bos, BT)
                n64 = T.cast(i_n, "int64")
                # chunk slot of the first chunk (save_states): in cu_seqlens' items, or their sequences' (state_seqs)
                slot0 = bos // BT + (h_seq[i_n] if state_seqs else i_n)

                if tx < 128:
                    # ================= state warpgroup =================
                    T.set_max_nreg(240, 1)
                    s_f = T.alloc_fragment((BV, K), acc)        # S^T
                    sb_f = T.alloc_fragment((BV, K), dtype)
                    vd_f = T.alloc_fragment((BV, BT), acc)      # Vd^T
                    vdr_f = T.alloc_fragment((BV, BT), dtype)
                    vdb_f = T.alloc_fragment((BV, BT), dtype)
                    o_f = T.alloc_fragment((BV, BT), acc)       # O^T
                    y_f = T.alloc_fragment((BV, BT), acc)       # Y = S0^T K^T
                    yb_f = T.alloc_fragment((BV, BT), dtype)
                    mark.start()
                    mark.value(NT)
                    if has_initial_state:
                        if state_v_first:
                            for i, j in T.Parallel(BV, K):
                                s_f[i, j] = T.cast(h0[n64, i_hv, v0 + i, j], acc)
                        else:
                            for i, j in T.Parallel(BV, K):
                                s_f[i, j] = T.cast(h0[n64, i_hv, j, v0 + i], acc)
                    elif transitions:
                        # M: the identity's columns v0.. (S^T [i, j] = I[j, v0 + i]); 0 where the skip passes
                        # every chunk of a non-empty sequence (a warm-up head's M)
                        ident = T.if_then_else(T.And(is_m, T.Or(NT > 0, eos == cu_seqlens[i_n])), 1.0, 0.0)
                        for i, j in T.Parallel(BV, K):
                            s_f[i, j] = T.Select(j == v0 + i, ident, 0.0)
                    else:
                        T.clear(s_f)
                    if save_starts:
                        save_start(s_f, starts, slot[i_n], i_hv, v0)
                    # Software-pipelined: chunk c+1's V^T Ag^T runs under chunk c's tail, and chunk c's o staging
                    # under chunk c+1's Y Ae^T. No wgmma is pending across the loop back-edge and none is issued
                    # conditionally (ptxas would serialize every wgmma).
                    if NT > 0:
                        T.barrier_wait(full[0], 0)
                        mark(0, "s.full")
                        T.barrier_wait(prep_done[0], 0)
                        mark(0, "s.prep")
                        T.wgmma_gemm(v_s[0, :, :], a_s[0, :, :], vd_f, transpose_A=True, transpose_B=True,
                                     clear_accum=True)
                        issue_ws(0, 0, s_f, sb_f, vd_f, y_f, yb_f, k_s, ae_s, el_s, hs_s, hs, slot0, i_hv, v0, tx)
                        T.wait_wgmma(0)
                        mark(0, "s.vd_done")
                        T.barrier_arrive(empty_va[0])
                        for c in T.serial(NT - 1):
                            st1 = (c + 1) % NS
                            pb1 = (c + 1) % NP
                            finish_chunk(c % NS, c % NP, s_f, sb_f, vd_f, vdr_f, vdb_f, o_f, q_s, k_s, pg_s, r_s,
                                         dq_s)
                            T.barrier_wait(full[st1], ((c + 1) // NS) % 2)
                            mark(c + 1, "s.full")
                            T.barrier_wait(prep_done[pb1], ((c + 1) // NP) % 2)
                            mark(c + 1, "s.prep")
                            T.wgmma_gemm(v_s[st1, :, :], a_s[st1, :, :], vd_f, transpose_A=True,
                                         transpose_B=True, clear_accum=True)
                            T.wait_wgmma(1)
                            mark(c, "s.tail")
                            if save_starts:
                                if (c + 1) % every == 0:
                                    save_start(s_f, starts, slot[i_n] + (c + 1) // every, i_hv, v0)
                            issue_ws(st1, pb1, s_f, sb_f, vd_f, y_f, yb_f, k_s, ae_s, el_s, hs_s, hs, slot0 + c + 1,
                                     i_hv, v0, tx)
                            release_and_store_o(c, o_f, o_s, empty, pout_empty, o_empty, o_full, mark, tx)
                            T.wait_wgmma(0)
                            mark(c + 1, "s.vd_done")
                            T.barrier_arrive(empty_va[st1])
                        finish_chunk((NT - 1) % NS, (NT - 1) % NP, s_f, sb_f, vd_f, vdr_f, vdb_f, o_f, q_s, k_s,
                                     pg_s, r_s, dq_s)
                        T.wait_wgmma(0)
                        mark(NT - 1, "s.tail")
                        release_and_store_o(NT - 1, o_f, o_s, empty, pout_empty, o_empty, o_full, mark, tx)
                    if state_v_first:
                        for i, j in T.Parallel(BV, K):
                            ht[n64, i_hv, v0 + i, j] = s_f[i, j]
                    elif transitions:
                        if is_m:
                            for i, j in T.Parallel(BV, K):
                                hm[n64, i_hv, j, v0 + i] = s_f[i, j]
                        else:
                            for i, j in T.Parallel(BV, K):
                                ht[n64, i_hv, j, v0 + i] = s_f[i, j]
                    else:
                        for i, j in T.Parallel(BV, K):
                            ht[n64, i_hv, j, v0 + i] = s_f[i, j]
                    if save_states:
                        if tx == 0:
                            T.tma_store_wait(0)     # the last state's stores have read hs_s before the CTA exits
                    mark.end()
                elif tx < 256:
                    # ================= prep warpgroup (state-independent work) =================
                    T.set_max_nreg(224, 1)
                    p_f = T.alloc_fragment((BT, BT), acc)
                    ab_f = T.alloc_fragment((BT, BT), dtype)
                    a_f = T.alloc_fragment((BT, BT), dtype)
                    ag_f = T.alloc_fragment((BT, BT), dtype)
                    pgb_f = T.alloc_fragment((BT, BT), dtype)
                    ag32_f = T.alloc_fragment((BT, BT), acc)
                    ab32_f = T.alloc_fragment((BT, BT), acc)
                    gi_f = T.alloc_fragment((BT,), acc)        # G of the rows this thread owns
                    gj_f = T.alloc_fragment((BT,), acc)        # G of the columns this thread owns
                    bj_f = T.alloc_fragment((BT,), acc)
                    ei_f = T.alloc_fragment((BT,), acc)        # -exp(G) of the rows of Ae
                    prep_loop(NT, bos, eos, mark, full, pout_empty, prep_done, q_s, k_s, v_s, a_s, g_s, b_s, ae_s,
                              pg_s, r_s, dq_s, el_s, p_f, a_f, ab_f, ag_f, pgb_f, ag32_f, ab32_f, gi_f, gj_f, bj_f,
                              ei_f)
                else:
                    # ================= producer warpgroup =================
                    T.set_max_nreg(40, 0)
                    if tx < 288:
                        # load warp: v and A once the slot's v/A part is free, q and k once all of it is
                        if zero_v:
                            zero_v_tiles(v_s)
                        elif transitions:
                            if is_m:            # an M slice: zero values
                                zero_v_tiles(v_s)
                        for c in T.serial(NT):
                            st = c % NS
                            t0 = bos + c * BT
                            T.barrier_wait(empty_va[st], ((c // NS) % 2) ^ 1)
                            mark(c, "l.empty")
                            if transitions:
                                if i_v >= NK:       # an E slice
                                    load_v(v, v_s, full, st, t0, i_hv, v0)
                            elif not zero_v:
                                load_v(v, v_s, full, st, t0, i_hv, v0)
                            T.tma_copy(A[0, t0:t0 + BT, i_hv, 0:BT], a_s[st, :, :], barrier=full[st])
                            T.barrier_wait(empty[st], ((c // NS) % 2) ^ 1)
                            mark(c, "l.qk_slot")
                            if not states_only:
                                T.tma_copy(q[0, t0:t0 + BT, i_h, 0:K], q_s[st, :, :], barrier=full[st])
                            T.tma_copy(k[0, t0:t0 + BT, i_h, 0:K], k_s[st, :, :], barrier=full[st])
                            T.barrier_arrive(full[st])
                            mark(c, "l.issued")
                    elif tx < 320:
                        if not states_only:
                            store_o_rows(o, o_s, o_full, o_empty, NT, bos, eos, i_hv, v0, tx - 288, mark)
                    elif tx < 352:
                        # gate warp: g and beta rows by plain loads (a 64 x 1 column is below TMA's 16-byte box
                        # minimum); rows past the sequence end get g[eos - 1] and beta = 0
                        for c in T.serial(NT):
                            st = c % NS
                            t0 = bos + c * BT
                            T.barrier_wait(empty_va[st], ((c // NS) % 2) ^ 1)
                            mark(c, "g.empty")
                            for t in T.Parallel(BT):
                                tt = T.cast(T.min(t0 + t, eos - 1), "int64")
                                g_s[st, t] = g[0, tt, i_hv]
                                b_s[st, t] = T.Select(t0 + t < eos, T.cast(beta[0, tt, i_hv], acc), 0.0)
                            T.barrier_arrive(full[st])
                            mark(c, "g.loaded")

    return chunk_fwd_kernel


def builder_args(H: int, HV: int, K: int, V: int, dtype: torch.dtype, beta_dtype: torch.dtype,
                 h0_dtype: torch.dtype, scale: float, has_initial_state: bool, state_v_first: bool) -> tuple:
    """The `build` arguments (its compile-cache key) for one call."""
    return (H, HV, K, V, _tl.TL_DTYPE[dtype], _tl.TL_DTYPE[beta_dtype], _tl.TL_DTYPE[h0_dtype], float(scale),
            bool(has_initial_state), bool(state_v_first))


def launcher_builds(H: int, HV: int, K: int, V: int, dtype: torch.dtype, beta_dtype: torch.dtype,
                    h0_dtype: torch.dtype, scale: float, initial_state=(False, True), state_v_first=(False,),
                    chunk_skip=(False,), zero_values=False, states_only=False, partition_starts=False,
                    transitions=False, save_states=False, state_seqs=False, wide=False) -> list:
    """(label, builder, args) of every kernel `chunk_fwd` launches for these heads, dims and dtypes, with and without
    an initial state and in the given state layouts (what `flashdelta.warmup` compiles); `chunk_skip` (True: the
    builds with the per-(sequence, head) start chunk), `zero_values` (the zero-value builds), `states_only` (no o),
    `partition_starts` (the training forward's partition start states) and `transitions` (the M and E passes in one
    launch, states_only implied) are what only context parallelism launches (`cp.builds`); `save_states` the training
    forward that saves the backward's chunk states, with `state_seqs` over the sequences of context parallelism's
    partitions (its output pass). `wide`: the opt-in one-CTA-per-(sequence, value head) builds instead
    (`chunk_fwd(wide=True)`, kernels/fused_fwd_wide.py; K = V = 128, none of the other options)."""
    if wide:
        from . import fused_fwd_wide

        assert (K, V) in fused_fwd_wide.HEAD_DIMS and not (any(chunk_skip) or zero_values or states_only
                                                           or partition_starts or transitions or save_states
                                                           or state_seqs), "wide: plain chunk_fwd at K = V = 128"
        return [(f"chunk_fwd H={H} HV={HV} K={K} V={V} h0={has_h0} v_first={vfirst} wide", fused_fwd_wide.build,
                 builder_args(H, HV, K, V, dtype, beta_dtype, h0_dtype, scale, has_h0, vfirst))
                for has_h0 in initial_state for vfirst in state_v_first]
    out = []
    for has_h0 in initial_state:
        for vfirst in state_v_first:
            args = builder_args(H, HV, K, V, dtype, beta_dtype, h0_dtype, scale, has_h0, vfirst)
            label = f"chunk_fwd H={H} HV={HV} K={K} V={V} h0={has_h0} v_first={vfirst}"
            for skip in chunk_skip:
                flags = _flags(save_states, skip, zero_values, states_only or transitions, partition_starts,
                               transitions, state_seqs)
                out.append((label + (" save_states" if save_states else "") + (" skip" if skip else "")
                            + (" zero_v" if zero_values else "")
                            + (" states" if states_only or transitions else "")
                            + (" starts" if partition_starts else "") + (" transitions" if transitions else "")
                            + (" state_seqs" if state_seqs else ""),
                            build, args + flags))
    return out


def _flags(save_states: bool, chunk_skip: bool, zero_v: bool, states_only: bool, save_starts: bool = False,
           transitions: bool = False, state_seqs: bool = False) -> tuple:
    """The trailing `build` arguments of these flags, as short as the defaults allow (the default builds keep the
    cache keys they had before the flags existed)."""
    flags = (save_states, chunk_skip, zero_v, states_only, save_starts, transitions, state_seqs)
    while flags and not flags[-1]:
        flags = flags[:-1]
    return flags


def state_recompute_builds(H: int, HV: int, K: int, V: int, dtype: torch.dtype, beta_dtype: torch.dtype,
                           h0_dtype: torch.dtype, initial_state=(False, True), state_v_first=(False,)) -> list:
    """(label, builder, args) of every kernel `state_recompute` launches (the fused forward writing its states)."""
    return [(f"state_recompute H={H} HV={HV} K={K} V={V} h0={has_h0} v_first={vfirst}", build,
             builder_args(H, HV, K, V, dtype, beta_dtype, h0_dtype, 1.0, has_h0, vfirst)
             + _flags(True, False, False, True))
            for has_h0 in initial_state for vfirst in state_v_first]


def chunk_fwd(q, k, v, g_cumsum, beta, A, initial_state, cu_seqlens, *, scale, state_v_first=False,
              chunk_size=64, chunk_skip=None, zero_values=False, states_only=False, partition_starts=None,
              transitions=False, transition_skip=None, save_states=False, state_seqs=None, wide=False, out=None,
              states_out=None):
    """Fused forward (docs/stages.md `chunk_fwd`).

    Args:
        q, k: ``[1, T, H, K]`` bf16/fp16; v: ``[1, T, HV, V]`` (same dtype); (K, V) in `HEAD_DIMS`.
        g_cumsum: ``[1, T, HV]`` fp32 chunk-local cumsum; beta: ``[1, T, HV]`` bf16, fp16 or fp32.
        A: ``[1, T, HV, BT]`` (ungated WY inverse, from `prepare_fwd`), in q's dtype (another float dtype, such as
            the portable path's fp32, is converted).
        initial_state: ``[N, HV, K, V]`` (``[N, HV, V, K]`` with state_v_first), fp32, bf16 or fp16, or None.
        cu_seqlens: ``[N + 1]`` int32 (int64 is converted on the device).
        chunk_skip: None, or ``[N, HV]`` int32 (other integer dtypes are converted on the device): sequence n's
            value head hv starts at its chunk ``chunk_skip[n, hv]`` (clamped to [0, its chunk count]) from its
            initial state. For context parallelism's internal passes only (`flashdelta.cp`): o on the skipped
            chunks is unspecified, and the final state is the state after the sequence's last chunk.
        zero_values: the values are taken to be zero and v is not read (only its shape counts): context
            parallelism's M pass, without a zero tensor to fill and read.
        states_only: only the final state is computed (o is returned as None): context parallelism's M and E
            passes.
        partition_starts: None, or ``(L, slot, P)``: also return the fp32 state entering every L-th chunk of each
            sequence (and its initial state), K-first, in ``[P, HV, K, V]`` at slot ``slot[n] + c // L`` (``slot``
            ``[N]`` int32): the start states of context parallelism's partitions of L chunks (`flashdelta.cp`,
            ``slot`` its plan's first partition of each sequence). Slots no sequence owns are 0. Not with the
            other context-parallel options.
        transitions: with states_only, no initial state and K-first states: also return third each sequence's
            transition ``M [N, HV, K, K]`` fp32 (the walk of zero values from the identity), from the same launch
            (context parallelism's M and E passes, whose work items then share one wave). transition_skip: with
            chunk_skip (and only then), ``[N, HV]`` integer, the M walks' start chunks as chunk_skip gives the E
            walks'; where it skips every chunk of a non-empty sequence M = 0 (not the identity).
        save_states: also return third the state entering every chunk, as `state_recompute` returns it (the
            training forward saving the backward's states). With chunk_skip only the chunks walked write theirs;
            not with the other context-parallel options.
        state_seqs: with save_states, None, or ``(seq, N_seq)``: cu_seqlens' items are chunk-aligned pieces of
            ``N_seq`` sequences (context parallelism's partitions; ``seq [N]`` integer, each item's sequence), and
            the states go where `state_recompute` over those sequences puts them, in one ``h [T // BT + N_seq + 1,
            HV, V, K]`` (the output pass of a split forward saving the backward's states).
        wide: at K = V = 128 only, without the options above: one CTA of 512 threads per (sequence, value head)
            (kernels/fused_fwd_wide.py: two state warpgroups, one V half each, sharing one prep warpgroup), same
            results bit for bit; the API's pick where its CTAs fill whole waves (`cp_model.wide_pays`).
        out: None, or the ``[1, T, HV, V]`` contiguous tensor in v.dtype that o is written into (returned as o); not
            with states_only. With chunk_skip only the chunks walked (and the padding tail's zeros) are written, so
            two launches over complementary skips fill one o (context parallelism's output pass, `flashdelta.cp`).
        states_out: with save_states, None, or the contiguous tensor in q's dtype, of the shape save_states returns,
            that the chunk states are written into (returned third); with chunk_skip two launches over
            complementary skips fill it, as `out` does o.

    Returns:
        o ``[1, T, HV, V]`` in v.dtype (0 on the padding tail) and the final state fp32 in the layout of
        `state_v_first`; with partition_starts the start states third; with transitions M third (o None); with
        save_states the chunk states third. One
        launch of (N + 1) * HV * V / 64 CTAs ((N + 1) * HV * (K + V) / 64 with transitions); no host
        synchronisation.
    """
    # (`_launch` rejects save_states with the other context-parallel options; states_only is state_recompute's)
    assert not (save_states and states_only), "save_states: not with states_only (state_recompute)"
    o, ht, third = _launch(q, k, v, g_cumsum, beta, A, initial_state, cu_seqlens, scale=scale,
                           state_v_first=state_v_first, chunk_size=chunk_size, save_states=save_states,
                           chunk_skip=chunk_skip, zero_values=zero_values, states_only=states_only,
                           partition_starts=partition_starts, transitions=transitions,
                           transition_skip=transition_skip, state_seqs=state_seqs, wide=wide, out=out,
                           states_out=states_out)
    return (o, ht) if partition_starts is None and not transitions and not save_states else (o, ht, third)


def state_recompute(k, v, g_cumsum, beta, A, initial_state, cu_seqlens, *, state_v_first=False, chunk_size=64):
    """The state entering every chunk, for `chunk_bwd` (docs/stages.md `state_recompute`; the SM90 layout is private
    to the SM90 backward): ``h [T // BT + N + 1, HV, V, K]`` in q's dtype, the transposed state ``S0^T`` of
    chunk c of sequence n at slot ``cu_seqlens[n] // BT + n + c`` (slots no chunk owns are not written). Runs the
    fused forward's states-only build with its state output on (no q, no Q K^T, Pg or O GEMMs, no o): its states
    are the full build's bit for bit, because the state chain is the same code."""
    _, _, h = _launch(k, k, v, g_cumsum, beta, A, initial_state, cu_seqlens, scale=1.0, state_v_first=state_v_first,
                      chunk_size=chunk_size, save_states=True, states_only=True)
    return h


def _launch(q, k, v, g_cumsum, beta, A, initial_state, cu_seqlens, *, scale, state_v_first, chunk_size,
            save_states, chunk_skip=None, zero_values=False, states_only=False, partition_starts=None,
            transitions=False, transition_skip=None, state_seqs=None, wide=False, out=None, states_out=None):
    """Both launchers' body: (o, ht, None), (o, ht, hs) with save_states, (o, ht, starts) with partition_starts,
    or (None, ht, M) with transitions; `chunk_skip`, `zero_values`, `states_only` (o None), `partition_starts`,
    `transitions`, `transition_skip`, `state_seqs`, `wide`, `out` and `states_out` as `chunk_fwd` takes them (`zero_values` not
    with save_states)."""
    B, T_, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = cu_seqlens.shape[0] - 1
    assert B == 1 and chunk_size == BT, "flat varlen input with 64-token chunks"
    assert (K, V) in HEAD_DIMS, f"head dims (K={K}, V={V}) unsupported; supported {HEAD_DIMS}"
    assert q.dtype == k.dtype == v.dtype and q.dtype in DTYPES
    assert HV % H == 0 and g_cumsum.dtype == torch.float32
    if wide:
        from . import fused_fwd_wide

        assert (K, V) in fused_fwd_wide.HEAD_DIMS, f"wide: head dims {fused_fwd_wide.HEAD_DIMS} only"
        assert not (save_states or chunk_skip is not None or zero_values or states_only or transitions
                    or partition_starts is not None), "wide: plain chunk_fwd only"
    A = A.to(q.dtype)                                           # no copy when it already is
    dev = q.device
    state_shape = (N, HV, V, K) if state_v_first else (N, HV, K, V)
    if out is not None:
        assert not states_only and tuple(out.shape) == (1, T_, HV, V) and out.dtype == v.dtype \
            and out.device == dev and out.is_contiguous(), "out: a contiguous [1, T, HV, V] tensor like v"
    o = None if states_only else out if out is not None else _tl.alloc((1, T_, HV, V), v.dtype, dev)
    ht = _tl.alloc(state_shape, torch.float32, dev)
    hs = h_seq = None
    if save_states:
        n_seq = N
        if state_seqs is not None:
            h_seq, n_seq = state_seqs
            assert tuple(h_seq.shape) == (N,) and not h_seq.dtype.is_floating_point and n_seq >= 1, \
                "state_seqs: (seq [N] integer, N_seq >= 1)"
            h_seq = h_seq.to(torch.int32).contiguous()
        hs_shape = (T_ // BT + n_seq + 1, HV, V, K)
        if states_out is not None:
            assert tuple(states_out.shape) == hs_shape and states_out.dtype == q.dtype and states_out.device == dev \
                and states_out.is_contiguous(), f"states_out: a contiguous {list(hs_shape)} tensor in q's dtype"
        hs = states_out if states_out is not None else _tl.alloc(hs_shape, q.dtype, dev)
    else:
        assert state_seqs is None and states_out is None, "state_seqs, states_out: with save_states"
    if chunk_skip is not None:
        assert tuple(chunk_skip.shape) == (N, HV) and not chunk_skip.dtype.is_floating_point, \
            "chunk_skip: integer [N, HV]"
        chunk_skip = chunk_skip.to(torch.int32).contiguous()
    hm = None
    if transitions:
        assert states_only and initial_state is None and not (state_v_first or zero_values or save_states
                                                              or partition_starts is not None), \
            "transitions: states_only, K-first, no initial state"
        assert (transition_skip is None) == (chunk_skip is None), "transition_skip: exactly with chunk_skip"
        hm = _tl.alloc((N, HV, K, K), torch.float32, dev)
        if transition_skip is not None:
            assert tuple(transition_skip.shape) == (N, HV) and not transition_skip.dtype.is_floating_point, \
                "transition_skip: integer [N, HV]"
            transition_skip = transition_skip.to(torch.int32).contiguous()
    else:
        assert transition_skip is None, "transition_skip: with transitions"
    starts = None
    if partition_starts is not None:
        L, slot, P = partition_starts
        assert not (save_states or chunk_skip is not None or zero_values or states_only) and L >= 1, \
            "partition_starts: chunk_fwd alone, L >= 1"
        assert tuple(slot.shape) == (N,) and not slot.dtype.is_floating_point, "partition_starts: slot [N] integer"
        starts = torch.zeros(P, HV, K, V, dtype=torch.float32, device=dev)
        slot = slot.to(torch.int32).contiguous()
    if T_ == 0:  # no tokens: every sequence is empty (a TMA descriptor cannot describe an empty tensor)
        if initial_state is None:
            ht.zero_()
        else:
            ht.copy_(initial_state)
        if starts is not None and N:
            starts.index_copy_(0, slot.long(), ht.transpose(-1, -2) if state_v_first else ht)
        if hm is not None:      # every sequence is empty: M = I
            return o, ht, hm.copy_(torch.eye(K, device=dev).expand(N, HV, K, K))
        return o, ht, (hs if hs is not None else starts)
    cu_seqlens = _tl.cu_seqlens_int32(cu_seqlens)
    h0 = initial_state if initial_state is not None else ht
    args = builder_args(H, HV, K, V, q.dtype, beta.dtype, h0.dtype, scale, initial_state is not None, state_v_first)
    assert not (zero_values and save_states), "zero_values: chunk_fwd only"
    vt = v.new_empty(1, 1, 1, V) if zero_values else v.contiguous()     # zero values: a placeholder, never read
    ot = v.new_empty(1, 1, 1, V) if states_only else o                   # states only: a placeholder, never written
    NK = K // BV if transitions else 0
    if wide:
        # one CTA per (sequence, value head), the same inputs and outputs
        fused_fwd_wide.build(*args)(q.contiguous(), k.contiguous(), v.contiguous(), g_cumsum.contiguous(),
                                    beta.contiguous(), A.contiguous(), h0.contiguous(), cu_seqlens,
                                    _tl.seq_order(cu_seqlens, HV), o, ht)
        return o, ht, None
    if chunk_skip is None:
        order = _tl.seq_order(cu_seqlens, HV * (NK + V // BV))
    elif transitions:
        # items of IC CTAs: per (sequence, head) NK / IC of M, then V / BV / IC of E, keyed by their walks' skips
        ic = math.gcd(NK, V // BV)
        keys = torch.cat([transition_skip[:, :, None].expand(N, HV, NK // ic),
                          chunk_skip[:, :, None].expand(N, HV, V // BV // ic)], 2).view(N, -1)
        order = item_order.order(keys, ic, descending=False, tail=True)
    else:
        order = item_order.order(chunk_skip, V // BV, descending=False, tail=True)
    tensors = (q.contiguous(), k.contiguous(), vt, g_cumsum.contiguous(), beta.contiguous(), A.contiguous(),
               h0.contiguous(), cu_seqlens, order, ot, ht)
    extra = (hs,) if hs is not None else ()
    if h_seq is not None:
        extra += (h_seq,)
    if chunk_skip is not None:
        extra += (chunk_skip,)
    if starts is not None:
        extra += (starts, slot, int(partition_starts[0]))
    if hm is not None:
        extra += (hm,) + ((transition_skip,) if transition_skip is not None else ())
    build(*args, *_flags(save_states, chunk_skip is not None, zero_values, states_only,
                         starts is not None, transitions, h_seq is not None))(*tensors, *extra)
    if hm is not None:
        return o, ht, hm
    return o, ht, (hs if hs is not None else starts)
