"""Fused chunked GDN forward (Hopper, TileLang): o and the final state in one launch.

docs/fused_fwd.md has the barrier table, the per-chunk cost model and what has been measured.

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
shared-memory round trip. (Earlier builds had the prep warpgroup form Xn = Ae K and the state warpgroup
S0^T Xn^T: one GEMM fewer on the chain, a 64 x 128 x 64 GEMM more in the prep; measured within 1%.) Warp roles
(384 threads):

- WG0 "state"   (240 regs): the chain above, software-pipelined (chunk c+1's V^T Ag^T and the S -> bf16
  conversion run under chunk c's tail, chunk c's o staging under chunk c+1's last Vd GEMM), then O^T -> o_shared
  for the store warp (packed conversion and stmatrix.trans; rows padded).
- WG1 "prep"    (224 regs): Q K^T, Gamma, Pg, Ag (in place over the A tile), Ae, and the per-row scalars R,
  scale*exp(G), exp(G_last); runs up to two chunks ahead of WG0 (three product buffers). Branch-free
  element-wise code (`T.Select`).
- WG2 producer  (40 regs): warp 0 TMA-loads q, k, v, A into a 3-stage ring; warp 2 gathers g, beta into the same
  slot (rows past the sequence end get g[eos-1] and beta = 0); warp 1 stores o rows with a 16-byte PTX loop
  (with the `split_store` switch warp 3 takes rows 32-63).

Ragged chunks take the same path: TMA loads all 64 rows, the prep warpgroup zeroes q/k/v/A rows past the end
(beta is 0 there), so nothing from the next sequence or the padding tail (even NaN) reaches a result. Every
shared-memory write by ordinary stores that wgmma or TMA reads next is followed by fence.proxy.async.
CTA x index = (sequence, value head, V slice) flattened, sequence slowest, so >65,535 sequences work and CTAs
that share a key head run together; the extra sequence index N zero-fills o on the padding tail [cu[N], T).
Global offsets that can pass 2^31 elements (o, g, beta, states) are computed in int64; TMA uses tensor maps.

Development tool: `chunk_fwd_profiled` runs a separately compiled variant (builder `profile=True`) in which one thread
per role records %clock64 at the events in `PROF_EVENTS`; bench/profile_fwd.py prints the per-role timeline.
"""

import tilelang
import tilelang.language as T
import torch

from . import _ptx, _tl
from ._fwd_timeline import PROF_CHUNKS, PROF_CTAS, PROF_EVENTS, PROF_INDEX, marker

BT_DEFAULT = 64
NUM_STAGES = 3          # q/k/v/A/g/beta ring depth
# (K, V) pairs this kernel supports (each run on an H200 in tests/gpu/test_fwd.py). K <= 128 keeps S^T [64, K] in
# the state warpgroup's registers; V is split into V / 64 CTAs.
HEAD_DIMS = ((128, 128), (64, 64), (128, 256))
# One state warpgroup owns 64 value columns (wgmma M = 64); two would need 2 x ~216 + prep + producer > 512
# registers per thread slot, so BV is fixed and every grid splits V into V / 64 CTAs.
BLOCK_V = 64
OVERLAP = True          # software-pipelined state warpgroup (False: the plain per-chunk order, kept for A/B tests)
# Free the v/A/g/beta part of a ring slot as soon as the chunk's Vd GEMMs complete (q/k stay until the chunk ends),
# so the producer starts the DRAM-bound loads one chunk earlier.
EARLY_RELEASE = True
# Programmatic dependent launch (off until measured on a GPU): every thread waits in T.pdl_sync (griddepcontrol.wait)
# right after the prologue, so the launch and barrier setup overlap the previous kernel's tail (prepare_fwd with its
# PDL_TRIGGER). Nothing is read before the wait: a kernel launched in between (a dtype conversion, a .contiguous()
# copy) is then the one waited for. TileLang's tvm_ffi launcher sets the programmatic attribute for kernels with a
# pdl_sync (bench/probe_pdl.py, NOTES-gpu.md session 4).
PDL_SYNC = False
# o leaves shared memory through two store warps (rows 0-31 by the store warp, rows 32-63 by the producer's otherwise
# idle fourth warp) instead of one. Session 8's timelines: one warp needs 1.5-1.7 us per chunk for 64 rows, 88% of
# the period; in the work-items build (branch exp/fwd-work-items) it became the pacer and the split removed the
# state WG's 0.4 us/chunk o_empty wait. Off until measured on this kernel.
SPLIT_STORE = False
# Three buffers for the prep warpgroup's products (Ae, Pg, R, dq, e_L) instead of two, so the prep warpgroup can run
# two chunks ahead of the state warpgroup: with two, it gets a buffer back only when the state warpgroup finishes
# the chunk two before, one state period ahead of the need. Session 9 (same-process A/B, bit-identical): -5.1% at
# 2/8 1x32768 and -5.8% at 1x4096 (16 CTAs, latency-bound), +-0.4% at 16/64 except -1.6% at 1024x8. 219 KB of
# shared memory.
POUT_TRIPLE = True
# The builder's trailing switches, in its positional order: `builder_args` ends with the launcher's values and
# `build` overrides them by name (always passing all of them positionally, so a switch set has one cache key).
SWITCHES = ("overlap", "early_release", "profile", "pdl", "split_store", "pout_triple")

# Every cross-role hand-off is an mbarrier; the only intra-warpgroup barrier is written out explicitly. TileLang's
# automatic syncs would land inside per-element loops (it cannot prove in-place updates are thread-private).
_PASS_CONFIGS = {**_tl.PASS_CONFIGS, "tl.disable_shared_memory_reuse": True, "tl.disable_thread_storage_sync": True}

_TORCH_TO_TL = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}

LOG2E = 1.4426950408889634


@tilelang.jit(target=_tl.SM90_TARGET, pass_configs=_PASS_CONFIGS)
def _build_chunk_fwd(H: int, HV: int, K: int, V: int, BV: int, BT: int, dtype: str, beta_dtype: str,
                     h0_dtype: str, scale: float, has_initial_state: bool, state_v_first: bool,
                     store_final_state: bool, overlap: bool = True, early_release: bool = False,
                     profile: bool = False, pdl: bool = False, split_store: bool = False,
                     pout_triple: bool = False):
    """The kernel for one compile-time configuration; T (tokens) and N (sequences) are dynamic.

    pdl: see `PDL_SYNC`; split_store: see `SPLIT_STORE`; pout_triple: see `POUT_TRIPLE`. profile=True adds the
    output ``prof`` (see `PROF_EVENTS`); with False the kernel is the uninstrumented one.
    """
    # problem config
    G = HV // H
    NV = V // BV
    acc = "float32"
    # tiling config
    NS = NUM_STAGES
    NO = 2                          # o staging buffers (three measured in session 9: no gain)
    NP = 3 if pout_triple else 2    # buffers of the prep warpgroup's products
    THREADS = 384
    assert BT == 64 and BV == 64 and K in (64, 128) and V % BV == 0 and HV % H == 0

    O_LD = BV + 8   # o_s row length in elements (padded: conflict-free transposed writes)
    T_ = T.dynamic("T")
    N_ = T.dynamic("N")
    state_shape = (N_, HV, V, K) if state_v_first else (N_, HV, K, V)
    # profile=False: `prof` is no kernel parameter (a non-tensor annotation is a plain Python value to TileLang)
    prof_t = T.Tensor((PROF_CTAS, PROF_CHUNKS, len(PROF_EVENTS)), "int64") if profile else None

    @T.macro
    def finish_chunk(st, pb, s_f, sb_f, vd_f, vdr_f, vdb_f, o_f, q_s, k_s, pg_s, r_s, dq_s, on_o1):
        # on entry: Vd^T = V^T Ag^T + Y Ae^T complete in vd_f, sb_f = bf16(S0^T), s_f = e_L S0^T, no wgmma pending
        T.wgmma_gemm(sb_f, q_s[st, :, :], o_f, transpose_B=True, clear_accum=True)   # O^T = S0^T Q^T
        for i, j in T.Parallel(BV, BT):
            vdr_f[i, j] = T.cast(vd_f[i, j] * r_s[pb, j], dtype)
            vdb_f[i, j] = T.cast(vd_f[i, j], dtype)
        T.wgmma_gemm(vdr_f, k_s[st, :, :], s_f)                               # S1^T = e_L S0^T + (Vd^T R) K
        T.wait_wgmma(1)
        on_o1()
        for i, j in T.Parallel(BV, BT):
            o_f[i, j] = o_f[i, j] * dq_s[pb, j]
        T.wgmma_gemm(vdb_f, pg_s[pb, :, :], o_f, transpose_B=True)            # O^T += Vd^T Pg^T

    @T.macro
    def scale_state(s_f, el_s, pb):
        el = el_s[pb, 0]
        for i, j in T.Parallel(BV, K):
            s_f[i, j] = s_f[i, j] * el

    @T.macro
    def issue_ws(st, pb, s_f, sb_f, vd_f, y_f, yb_f, k_s, ae_s, el_s):
        # Vd^T += (W S0)^T with W = Ae K, Ae = -diag(exp G) (A o beta_j), as Y = S0^T K^T then Y Ae^T; then
        # s_f <- e_L S0^T (S1's first term, under the Y GEMM). On entry S0^T is in s_f and at most the V^T Ag^T group
        # is pending; on exit the Y Ae^T group is pending.
        T.copy(s_f, sb_f)
        T.wgmma_gemm(sb_f, k_s[st, :, :], y_f, transpose_B=True, clear_accum=True)   # Y = S0^T K^T
        scale_state(s_f, el_s, pb)
        T.wait_wgmma(0)
        T.copy(y_f, yb_f)
        T.wgmma_gemm(yb_f, ae_s[pb, :, :], vd_f, transpose_B=True)                   # Vd^T += Y Ae^T

    @T.macro
    def stage_o(pb, o_f, o_s, tx):
        # O^T -> o_s[pb] (packed conversion + stmatrix.trans: 16 cvt and 4 stmatrix per thread)
        T.call_extern("handle", _ptx.STAGE_O[dtype], o_f.data, o_s.data, pb * (BT * O_LD), O_LD, tx)

    @T.macro
    def store_o_rows(o, o_s, o_full, o_empty, NT, bos, eos, i_hv, v0, half, lane, mark):
        # A store warp: o_s rows -> o for rows < ln only (the next sequence or the padding tail follows), by the
        # 16-byte PTX row loop; all 64 rows, or with split_store rows [32 half, 32 half + 32)
        for c in T.serial(NT):
            pb = c % NO
            t0 = bos + c * BT
            ln = T.min(eos - t0, BT)
            mark(c, "w.begin")
            T.barrier_wait(o_full[pb], (c // NO) % 2)
            mark(c, "w.o_full")
            row0 = 32 * half
            rows = T.max(T.min(ln - row0, 32), 0) if split_store else ln
            T.call_extern("handle", "fd_store_rows",
                          T.address_of(o[0, T.cast(t0 + row0 if half else t0, "int64"), i_hv, v0]),
                          T.address_of(o_s[pb, row0, 0]), rows, HV * V * 2, O_LD * 2, lane)
            T.barrier_arrive(o_empty[pb])
            mark(c, "w.stored")

    @T.macro
    def release_and_store_o(c, o_f, o_s, empty, pout_empty, o_empty, o_full, mark, tx):
        # chunk c's GEMMs have completed: free its ring slot and prep buffers, stage O^T for the store warp
        T.barrier_arrive(empty[c % NS])
        T.barrier_arrive(pout_empty[c % NP])
        mark(c, "s.released")
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
            mark(c, "p.begin")
            wait_inputs(c, st, ln, full, q_s, k_s, v_s, a_s)
            mark(c, "p.full")
            # P = Q K^T   [BT, K] @ [K, BT]; the A tile and the gate values load under it
            T.wgmma_gemm(q_s[st, :, :], k_s[st, :, :], p_f, transpose_B=True, clear_accum=True)
            T.copy(a_s[st, :, :], a_f)
            load_gates(st, g_s, b_s, gi_f, gj_f, bj_f, ei_f)
            mark(c, "p.qk_issued")
            T.barrier_wait(pout_empty[pb], ((c // NP) % 2) ^ 1)
            mark(c, "p.pout")
            T.wait_wgmma(0)
            mark(c, "p.qk_done")
            # Branch-free element-wise pass, fp32 results then packed conversions. Gamma is exactly 0 above the
            # diagonal (ex2(-inf)); A o beta needs no mask: A is unit lower triangular with exact zeros above the
            # diagonal (prepare_fwd), its rows past the sequence end were zeroed, and beta = 0 on columns past the
            # end. Ae's row factor -exp(G_i) is applied here.
            for i, j in T.Parallel(BT, BT):
                gam = T.exp2(T.Select(i >= j, gi_f[i] - gj_f[j], -T.infinity(acc)))
                ab = T.cast(a_f[i, j], acc) * bj_f[j]
                ag32_f[i, j] = ab * gam
                ab32_f[i, j] = ab * ei_f[i]
                p_f[i, j] = p_f[i, j] * gam * scale
            T.copy(ab32_f, ab_f)
            T.copy(ag32_f, ag_f)
            T.copy(p_f, pgb_f)
            mark(c, "p.ew_done")
            T.copy(ab_f, ae_s[pb, :, :])
            T.copy(ag_f, a_s[st, :, :])
            T.copy(pgb_f, pg_s[pb, :, :])
            row_scalars(st, pb, ln, g_s, r_s, dq_s, el_s)
            mark(c, "p.stored")
            T.fence_proxy_async()
            T.barrier_arrive(prep_done[pb])
            mark(c, "p.done")

    @T.prim_func
    def chunk_fwd_kernel(
        q: T.Tensor((1, T_, H, K), dtype),
        k: T.Tensor((1, T_, H, K), dtype),
        v: T.Tensor((1, T_, HV, V), dtype),
        g: T.Tensor((1, T_, HV), acc),
        beta: T.Tensor((1, T_, HV), beta_dtype),
        A: T.Tensor((1, T_, HV, BT), dtype),
        h0: T.Tensor(state_shape, h0_dtype),
        cu_seqlens: T.Tensor((N_ + 1,), "int32"),
        o: T.Tensor((1, T_, HV, V), dtype),
        ht: T.Tensor(state_shape, acc),
        prof: prof_t,
    ):
        prelude = _ptx.STAGE_O_PRELUDE + _ptx.STORE_ROWS_PRELUDE + (_ptx.PROF_PRELUDE if profile else "")
        with T.Kernel((N_ + 1) * (HV * NV), threads=THREADS, prelude=prelude) as bx:
            i_n = bx // (HV * NV)
            i_hv = (bx // NV) % HV
            i_v = bx % NV
            i_h = i_hv // G
            v0 = i_v * BV

            # ---- shared memory: input ring, prep outputs, o staging ----
            q_s = T.alloc_shared((NS, BT, K), dtype)
            k_s = T.alloc_shared((NS, BT, K), dtype)
            v_s = T.alloc_shared((NS, BT, BV), dtype)
            a_s = T.alloc_shared((NS, BT, BT), dtype)      # A, then Ag in place
            g_s = T.alloc_shared((NS, BT), acc)
            b_s = T.alloc_shared((NS, BT), acc)
            ae_s = T.alloc_shared((NP, BT, BT), dtype)      # Ae = -diag(exp G) (A o beta_j)
            pg_s = T.alloc_shared((NP, BT, BT), dtype)
            r_s = T.alloc_shared((NP, BT), acc)             # exp(G_last - G_t), 0 past the end
            dq_s = T.alloc_shared((NP, BT), acc)            # scale * exp(G_t)
            el_s = T.alloc_shared((NP, 1), acc)             # exp(G_last)
            o_s = T.alloc_shared((NO, BT, O_LD), dtype)    # o staging

            full = T.alloc_barrier([64] * NS)        # load warp (32 arrivals + TMA bytes) and gate warp (32)
            empty = T.alloc_barrier([128] * NS)      # state WG releases the ring slot (q/k part if early_release)
            empty_va = T.alloc_barrier([128] * NS)   # state WG releases v/A/g/beta of a slot (early_release)
            prep_done = T.alloc_barrier([128] * NP)
            pout_empty = T.alloc_barrier([128] * NP)  # state WG releases ae/pg/r/dq
            o_full = T.alloc_barrier([128] * NO)
            o_empty = T.alloc_barrier([64 if split_store else 32] * NO)   # the store warp(s)

            tx = T.get_thread_binding()
            if pdl:
                T.pdl_sync()
            mark = marker(profile, prof, bx, tx)

            if i_n == N_:
                # padding tail [cu_seqlens[N], T): o = 0 for this (head, V slice)
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
                bos = cu_seqlens[i_n]
                eos = cu_seqlens[i_n + 1]
                NT = T.ceildiv(eos - bos, BT)
                n64 = T.cast(i_n, "int64")

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
                    mark.cal("m.clk0")
                    if profile:
                        # an ordinary TIR store, so TileLang passes `prof` as a writable pointer
                        if (tx == 0) & (bx < PROF_CTAS):
                            prof[bx, 0, PROF_INDEX["m.nt"]] = T.cast(NT, "int64")
                    if has_initial_state:
                        if state_v_first:
                            for i, j in T.Parallel(BV, K):
                                s_f[i, j] = T.cast(h0[n64, i_hv, v0 + i, j], acc)
                        else:
                            for i, j in T.Parallel(BV, K):
                                s_f[i, j] = T.cast(h0[n64, i_hv, j, v0 + i], acc)
                    else:
                        T.clear(s_f)
                    if overlap:
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
                            issue_ws(0, 0, s_f, sb_f, vd_f, y_f, yb_f, k_s, ae_s, el_s)
                            mark(0, "s.vd_issued")
                            T.wait_wgmma(0)
                            mark(0, "s.vd_done")
                            if early_release:
                                T.barrier_arrive(empty_va[0])
                            for c in T.serial(NT - 1):
                                st1 = (c + 1) % NS
                                pb1 = (c + 1) % NP
                                mark(c, "s.fin_begin")
                                finish_chunk(c % NS, c % NP, s_f, sb_f, vd_f, vdr_f, vdb_f, o_f, q_s, k_s, pg_s, r_s,
                                             dq_s, mark.later(c, "s.fin_o1"))
                                mark(c, "s.fin_end")
                                T.barrier_wait(full[st1], ((c + 1) // NS) % 2)
                                mark(c + 1, "s.full")
                                T.barrier_wait(prep_done[pb1], ((c + 1) // NP) % 2)
                                mark(c + 1, "s.prep")
                                T.wgmma_gemm(v_s[st1, :, :], a_s[st1, :, :], vd_f, transpose_A=True,
                                             transpose_B=True, clear_accum=True)
                                T.wait_wgmma(1)
                                mark(c, "s.tail")
                                issue_ws(st1, pb1, s_f, sb_f, vd_f, y_f, yb_f, k_s, ae_s, el_s)
                                mark(c + 1, "s.vd_issued")
                                release_and_store_o(c, o_f, o_s, empty, pout_empty, o_empty, o_full, mark, tx)
                                T.wait_wgmma(0)
                                mark(c + 1, "s.vd_done")
                                if early_release:
                                    T.barrier_arrive(empty_va[st1])
                            mark(NT - 1, "s.fin_begin")
                            finish_chunk((NT - 1) % NS, (NT - 1) % NP, s_f, sb_f, vd_f, vdr_f, vdb_f, o_f, q_s, k_s,
                                         pg_s, r_s, dq_s, mark.later(NT - 1, "s.fin_o1"))
                            mark(NT - 1, "s.fin_end")
                            T.wait_wgmma(0)
                            mark(NT - 1, "s.tail")
                            release_and_store_o(NT - 1, o_f, o_s, empty, pout_empty, o_empty, o_full, mark, tx)
                    else:
                        for c in T.serial(NT):
                            st = c % NS
                            pb = c % NP
                            T.barrier_wait(full[st], (c // NS) % 2)
                            mark(c, "s.full")
                            T.barrier_wait(prep_done[pb], (c // NP) % 2)
                            mark(c, "s.prep")
                            # Vd^T = V^T Ag^T + (W S0)^T ; O^T = S0^T Q^T
                            T.wgmma_gemm(v_s[st, :, :], a_s[st, :, :], vd_f, transpose_A=True, transpose_B=True,
                                         clear_accum=True)
                            issue_ws(st, pb, s_f, sb_f, vd_f, y_f, yb_f, k_s, ae_s, el_s)
                            T.wgmma_gemm(sb_f, q_s[st, :, :], o_f, transpose_B=True, clear_accum=True)
                            mark(c, "s.vd_issued")
                            T.wait_wgmma(1)
                            mark(c, "s.vd_done")
                            if early_release:
                                T.barrier_arrive(empty_va[st])
                            for i, j in T.Parallel(BV, BT):
                                vdr_f[i, j] = T.cast(vd_f[i, j] * r_s[pb, j], dtype)
                                vdb_f[i, j] = T.cast(vd_f[i, j], dtype)
                            # S1^T = e_L S0^T + (Vd^T R) K   [BV, BT] @ [BT, K]
                            mark(c, "s.fin_begin")   # plain order: O^T = S0^T Q^T was issued with the Vd GEMMs
                            T.wgmma_gemm(vdr_f, k_s[st, :, :], s_f)
                            T.wait_wgmma(1)
                            mark(c, "s.fin_o1")
                            for i, j in T.Parallel(BV, BT):
                                o_f[i, j] = o_f[i, j] * dq_s[pb, j]
                            # O^T += Vd^T Pg^T   [BV, BT] @ [BT, BT]
                            T.wgmma_gemm(vdb_f, pg_s[pb, :, :], o_f, transpose_B=True)
                            mark(c, "s.fin_end")
                            T.wait_wgmma(0)
                            mark(c, "s.tail")
                            release_and_store_o(c, o_f, o_s, empty, pout_empty, o_empty, o_full, mark, tx)
                    if store_final_state:
                        if state_v_first:
                            for i, j in T.Parallel(BV, K):
                                ht[n64, i_hv, v0 + i, j] = s_f[i, j]
                        else:
                            for i, j in T.Parallel(BV, K):
                                ht[n64, i_hv, j, v0 + i] = s_f[i, j]
                    mark.cal("m.clk1")
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
                        for c in T.serial(NT):
                            st = c % NS
                            t0 = bos + c * BT
                            mark(c, "l.begin")
                            if early_release:
                                T.barrier_wait(empty_va[st], ((c // NS) % 2) ^ 1)
                            else:
                                T.barrier_wait(empty[st], ((c // NS) % 2) ^ 1)
                            mark(c, "l.empty")
                            T.tma_copy(v[0, t0:t0 + BT, i_hv, v0:v0 + BV], v_s[st, :, :], barrier=full[st])
                            T.tma_copy(A[0, t0:t0 + BT, i_hv, 0:BT], a_s[st, :, :], barrier=full[st])
                            mark(c, "l.va_issued")
                            if early_release:
                                T.barrier_wait(empty[st], ((c // NS) % 2) ^ 1)
                            mark(c, "l.qk_slot")
                            T.tma_copy(q[0, t0:t0 + BT, i_h, 0:K], q_s[st, :, :], barrier=full[st])
                            T.tma_copy(k[0, t0:t0 + BT, i_h, 0:K], k_s[st, :, :], barrier=full[st])
                            T.barrier_arrive(full[st])
                            mark(c, "l.issued")
                    elif tx < 320:
                        store_o_rows(o, o_s, o_full, o_empty, NT, bos, eos, i_hv, v0, 0, tx - 288, mark)
                    elif tx < 352:
                        # gate warp: g and beta rows by plain loads (a 64 x 1 column is below TMA's 16-byte box
                        # minimum); rows past the sequence end get g[eos - 1] and beta = 0
                        for c in T.serial(NT):
                            st = c % NS
                            t0 = bos + c * BT
                            if early_release:
                                T.barrier_wait(empty_va[st], ((c // NS) % 2) ^ 1)
                            else:
                                T.barrier_wait(empty[st], ((c // NS) % 2) ^ 1)
                            for t in T.Parallel(BT):
                                tt = T.cast(T.min(t0 + t, eos - 1), "int64")
                                g_s[st, t] = g[0, tt, i_hv]
                                b_s[st, t] = T.Select(t0 + t < eos, T.cast(beta[0, tt, i_hv], acc), 0.0)
                            T.barrier_arrive(full[st])
                    elif split_store:
                        store_o_rows(o, o_s, o_full, o_empty, NT, bos, eos, i_hv, v0, 1, tx - 352, mark)

    return chunk_fwd_kernel


def builder_args(H: int, HV: int, K: int, V: int, dtype: torch.dtype, beta_dtype: torch.dtype,
                 h0_dtype: torch.dtype, scale: float, has_initial_state: bool, state_v_first: bool) -> tuple:
    """The `_build_chunk_fwd` arguments (its compile-cache key) for one call; shared with `warmup`. The last
    `len(SWITCHES)` entries are the launcher's switch values."""
    return (H, HV, K, V, BLOCK_V, BT_DEFAULT, _TORCH_TO_TL[dtype], _TORCH_TO_TL[beta_dtype], _TORCH_TO_TL[h0_dtype],
            float(scale), bool(has_initial_state), bool(state_v_first), True, OVERLAP, EARLY_RELEASE, False,
            PDL_SYNC, SPLIT_STORE, POUT_TRIPLE)


def build(args: tuple, **switches):
    """The kernel for `builder_args(...)` with some `SWITCHES` replaced by name (development variants)."""
    return _tl.build_with(_build_chunk_fwd, args, SWITCHES, {name: bool(flag) for name, flag in switches.items()})


def chunk_fwd(q, k, v, g_cumsum, beta, A, initial_state, cu_seqlens, *, scale, state_v_first=False,
              chunk_size=64):
    """Fused forward (docs/stages.md `chunk_fwd`).

    Args:
        q, k: ``[1, T, H, K]`` bf16/fp16; v: ``[1, T, HV, V]`` (same dtype); (K, V) in `HEAD_DIMS`.
        g_cumsum: ``[1, T, HV]`` fp32 chunk-local cumsum; beta: ``[1, T, HV]`` bf16, fp16 or fp32.
        A: ``[1, T, HV, BT]`` in q's dtype (ungated WY inverse, from `prepare_fwd`).
        initial_state: ``[N, HV, K, V]`` (``[N, HV, V, K]`` with state_v_first), fp32, bf16 or fp16, or None.
        cu_seqlens: ``[N + 1]`` int32 (int64 is converted on the device).

    Returns:
        o ``[1, T, HV, V]`` in v.dtype (0 on the padding tail) and the final state fp32 in the layout of
        `state_v_first`. One launch of (N + 1) * HV * V / 64 CTAs; no host synchronisation.
    """
    o, ht, _ = _chunk_fwd(q, k, v, g_cumsum, beta, A, initial_state, cu_seqlens, scale=scale,
                          state_v_first=state_v_first, chunk_size=chunk_size, variant=None)
    return o, ht


def chunk_fwd_profiled(q, k, v, g_cumsum, beta, A, initial_state, cu_seqlens, *, scale, state_v_first=False,
                       chunk_size=64, **flags):
    """Development tool: `chunk_fwd` with the per-role timeline compiled in (not part of the public API).

    Same arguments and results as `chunk_fwd`, plus ``timeline``: int64 ``[PROF_CTAS, PROF_CHUNKS,
    len(PROF_EVENTS)]`` on q's device, zero-filled, where CTA ``b < PROF_CTAS`` (grid index: sequence-major, then
    value head, then V slice) wrote the SM cycle counter (%clock64) of each `PROF_EVENTS` event of its chunks
    ``c < PROF_CHUNKS``; row 0 also holds the "m." entries (clock64/globaltimer pairs at the state warpgroup's
    start and end, and NT). One designated thread per role records, so the cost is a predicate per event
    elsewhere; the profiled kernel is a separate compile (`profile=True` in the builder), the plain kernel is
    untouched. ``flags`` override other `SWITCHES` (overlap, early_release; default: the launcher's).
    bench/profile_fwd.py turns the timeline into per-role tables.
    """
    return _chunk_fwd(q, k, v, g_cumsum, beta, A, initial_state, cu_seqlens, scale=scale,
                      state_v_first=state_v_first, chunk_size=chunk_size, variant={**flags, "profile": True})


def chunk_fwd_variant(q, k, v, g_cumsum, beta, A, initial_state, cu_seqlens, *, scale, state_v_first=False,
                      chunk_size=64, **flags):
    """Development tool: `chunk_fwd` built with other `SWITCHES` values (overlap, early_release), for
    A/B runs (bench/fwd_variants.py, tests/gpu/test_fwd.py). Returns (o, final_state)."""
    o, ht, _ = _chunk_fwd(q, k, v, g_cumsum, beta, A, initial_state, cu_seqlens, scale=scale,
                          state_v_first=state_v_first, chunk_size=chunk_size, variant=dict(flags))
    return o, ht


def _chunk_fwd(q, k, v, g_cumsum, beta, A, initial_state, cu_seqlens, *, scale, state_v_first, chunk_size,
               variant):
    """`chunk_fwd`'s body; variant None = the launcher's kernel, else a dict of builder switches (profile=True adds
    the timeline output)."""
    B, T_, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = cu_seqlens.shape[0] - 1
    assert B == 1 and chunk_size == BT_DEFAULT, "flat varlen input with 64-token chunks"
    assert (K, V) in HEAD_DIMS, f"head dims (K={K}, V={V}) unsupported; supported {HEAD_DIMS}"
    assert q.dtype == k.dtype == v.dtype == A.dtype and q.dtype in (torch.bfloat16, torch.float16)
    assert HV % H == 0 and g_cumsum.dtype == torch.float32
    dev = q.device
    state_shape = (N, HV, V, K) if state_v_first else (N, HV, K, V)
    o = _tl.alloc((1, T_, HV, V), v.dtype, dev)
    ht = _tl.alloc(state_shape, torch.float32, dev)
    prof = None
    if variant is not None and variant.get("profile"):
        prof = torch.zeros((PROF_CTAS, PROF_CHUNKS, len(PROF_EVENTS)), dtype=torch.int64, device=dev)
    if T_ == 0:  # no tokens: every sequence is empty (a TMA descriptor cannot describe an empty tensor)
        if initial_state is None:
            ht.zero_()
        else:
            ht.copy_(initial_state)
        return o, ht, prof
    cu_seqlens = cu_seqlens.to(torch.int32).contiguous()      # no copy when it already is
    h0 = initial_state if initial_state is not None else ht
    args = builder_args(H, HV, K, V, q.dtype, beta.dtype, h0.dtype, scale, initial_state is not None, state_v_first)
    tensors = (q.contiguous(), k.contiguous(), v.contiguous(), g_cumsum.contiguous(), beta.contiguous(),
               A.contiguous(), h0.contiguous(), cu_seqlens, o, ht)
    kernel = build(args, **(variant or {}))
    kernel(*tensors, prof) if prof is not None else kernel(*tensors)
    return o, ht, prof
