"""The wide fused forward (`fused_fwd.chunk_fwd(wide=True)`): one CTA of 512 threads per (sequence, value head) at
K = V = 128, so that each chunk's K-side products are formed once for all of V instead of once per 64-column V slice.

The launcher's default stays the 64-column build (kernels/fused_fwd.py, whose docstring has the per-chunk math and
notation). This one's outputs equal it bit for bit; it is faster where its CTAs fill whole waves and the sequences
are short, ~1.9x slower where the default's CTAs fill one wave, so the public API picks it for the unsplit inference
forward where `cp_model.wide_pays` predicts it faster from the host lengths. docs/dev/fused_fwd.md, "What to try
next" item 0, has the design, its ptxas budgets and the measured outcome; bench/dev/fused_fwd_wide_protocol.py models
its barrier protocol.

Roles (512 threads; setmaxnreg targets sum to 2 x 192 + 96 + 32 = 512 = 4 x the launch's 128 per thread slot):

- WG0, WG1 "state" (threads 0-127 and 128-255, 192 regs each): S^T [128, K] in fp32 registers, one 64-row half
  (V half) per warpgroup: the default build's state chain on that half, software-pipelined the same way. Each
  warpgroup is its own 128-thread branch of one macro, so its row offset is a constant: as one 256-thread role with
  FullRow GEMMs, ptxas treats the offset (threadIdx.x >> 7) as per-thread and keeps the SS GEMMs' descriptors in
  registers, which spilled at 192. To fit 192 registers bf16(S0^T) lives in a 16 KB shared tile per warpgroup
  (stmatrix, a proxy fence and the warpgroup's own named barrier) instead of a register fragment, so Y = S0^T K^T and
  O^T = S0^T Q^T are SS GEMMs. Each warpgroup stages its O^T half for its own store warp.
- WG2 "prep" (threads 256-383, 96 regs): Q K^T, Gamma, Pg, Ag (in place over A), Ae and the row scalars, once per
  chunk for both state warpgroups. Its element-wise pass reads A, G_j and beta_j from the ring slot and writes Ag, Ae
  and Pg as bf16 straight into their shared tiles (no fp32 tiles, no bf16 fragments).
- WG3 producers (32 regs): warp 0 TMA-loads v, A (then q, k) into a 2-slot ring; warps 1 and 2 store the o rows of
  V half 0 and 1 (16-byte PTX row loop); warp 3 gathers g and beta.

Barriers (slot s = c % 2, parity (c // 2) % 2; producers wait the "empty" side with the parity flipped):

| barrier        | count          | arrived by                          | waited by          |
| full[2]        | 64 + TMA bytes | load warp, gate warp                | prep, state        |
| empty_va[2]    | 256            | state WGs after their Vd GEMMs      | load, gate warps   |
| empty[2]       | 256            | state WGs after the chunk           | load warp (q, k)   |
| prep_done[2]   | 128            | prep WG                             | state WGs          |
| pout_empty[2]  | 256            | state WGs after the chunk           | prep WG            |
| o_full[2 x 2]  | 128            | state WG h                          | store warp h       |
| o_empty[2 x 2] | 32             | store warp h                        | state WG h         |

The loads are the producer warps' alone: no role that a state warpgroup waits on waits, before its arrival, for a
slot that the state warpgroups free only later (the hang of an earlier two-state-warpgroup design, whose prep
warpgroup loaded chunk c + 1's q/k before arriving on chunk c's prep_done).

Only plain `chunk_fwd` (no context-parallel or saved-state options). The arithmetic is the default build's: the same
GEMM shapes on the same bf16 operands (S0^T read from shared memory instead of registers) and the same fp32 products
rounded once; the compiler may still contract the prep pass's gate differences differently, so the outputs are
close to the default build's, not promised bit for bit (bench/dev/ab_fused_fwd.py --wide reports the difference).
"""
# No `from __future__ import annotations`: TileLang evaluates the prim_func annotations in this scope.
import tilelang.language as T

from . import _ptx, _tl

BT = 64                 # chunk size (the default build's)
LOG2E = 1.4426950408889634
HEAD_DIMS = ((128, 128),)
NS = 2                  # input ring slots (q/k/v/A/g/beta)
NP = 2                  # prep-product buffers (ae, pg, row scalars)
NO = 2                  # o staging buffers, each holding both V halves
THREADS = 512
ST = 256                # state threads: two warpgroups, one 64-row half of S^T each
# setmaxnreg targets: 2 x state + prep + producers <= 4 x 128 (the launch's registers per thread slot)
REGS = {"state": 192, "prep": 96, "producer": 32}


@_tl.jit(pass_configs=_tl.WS_PASS_CONFIGS)
def build(H: int, HV: int, K: int, V: int, dtype: str, beta_dtype: str, h0_dtype: str, scale: float,
          has_initial_state: bool, state_v_first: bool):
    """The wide kernel for one compile-time configuration (`fused_fwd.builder_args`); T and N are dynamic."""
    G = HV // H
    acc = "float32"
    assert (K, V) in HEAD_DIMS and HV % H == 0
    assert 2 * REGS["state"] + REGS["prep"] + REGS["producer"] <= THREADS // 128 * (65536 // THREADS)
    O_LD = V + 8            # o_s row length in elements (padded: conflict-free transposed writes)
    T_ = T.dynamic("T")
    N_ = T.dynamic("N")
    state_shape = (N_, HV, V, K) if state_v_first else (N_, HV, K, V)

    BH = V // 2             # value rows of S^T per state warpgroup

    @T.macro
    def issue_ws(st, pb, h, s_f, sb_s, vd_f, y_f, yb_f, k_s, ae_s, el_s):
        # Vd^T += Y Ae^T with Y = S0^T K^T (SS: bf16(S0^T) through this warpgroup's tile sb_s by stmatrix, published
        # to its wgmma by a proxy fence and its own named barrier; the previous chunk's O GEMM, the tile's last
        # reader, has completed), then s_f <- e_L S0^T under the Y GEMM. On entry at most the V^T Ag^T group is
        # pending; on exit the Y Ae^T group is.
        T.copy(s_f, sb_s)
        T.fence_proxy_async()
        T.sync_threads(2 + h, 128)
        T.wgmma_gemm(sb_s, k_s[st, :, :], y_f, transpose_B=True, clear_accum=True)
        el = el_s[pb, 0]
        for i, j in T.Parallel(BH, K):
            s_f[i, j] = s_f[i, j] * el
        T.wait_wgmma(0)
        T.copy(y_f, yb_f)
        T.wgmma_gemm(yb_f, ae_s[pb, :, :], vd_f, transpose_B=True)                   # Vd^T += Y Ae^T

    @T.macro
    def finish_chunk(st, pb, h, s_f, sb_s, vd_f, vdr_f, vdb_f, o_f, q_s, k_s, pg_s, r_s, dq_s):
        # on entry: Vd^T complete in vd_f, sb_s = bf16(S0^T), s_f = e_L S0^T, no wgmma pending
        T.wgmma_gemm(sb_s, q_s[st, :, :], o_f, transpose_B=True, clear_accum=True)     # O^T = S0^T Q^T
        for i, j in T.Parallel(BH, BT):
            vdr_f[i, j] = T.cast(vd_f[i, j] * r_s[pb, j], dtype)
            vdb_f[i, j] = T.cast(vd_f[i, j], dtype)
        T.wgmma_gemm(vdr_f, k_s[st, :, :], s_f)                           # S1^T = e_L S0^T + (Vd^T R) K
        T.wait_wgmma(1)
        for i, j in T.Parallel(BH, BT):
            o_f[i, j] = o_f[i, j] * dq_s[pb, j]
        T.wgmma_gemm(vdb_f, pg_s[pb, :, :], o_f, transpose_B=True)        # O^T += Vd^T Pg^T

    @T.macro
    def release_and_store_o(c, h, o_f, o_s, empty, pout_empty, o_empty, o_full, tx):
        # chunk c's GEMMs have completed: free its ring slot's q/k and its prep buffers, stage this warpgroup's O^T
        # half for its store warp (fd_stage_o_trans puts warp w of the CTA at column 16 w: warpgroup h's rows land
        # in columns 64 h..)
        T.barrier_arrive(empty[c % NS])
        T.barrier_arrive(pout_empty[c % NP])
        T.barrier_wait(o_empty[(c % NO) * 2 + h], ((c // NO) % 2) ^ 1)
        T.call_extern("handle", _ptx.STAGE_O[dtype], o_f.data, o_s.data, (c % NO) * (BT * O_LD), O_LD, tx)
        T.barrier_arrive(o_full[(c % NO) * 2 + h])

    @T.macro
    def state_wg(h, NT, n64, i_hv, h0, ht, full, prep_done, empty, empty_va, pout_empty, o_empty, o_full, q_s, k_s,
                 v_s, a_s, ae_s, pg_s, r_s, dq_s, el_s, o_s, sb_s, tx):
        # state warpgroup h: value rows [64 h, 64 h + 64) of S^T (fp32 registers) through the default build's state
        # chain, software-pipelined the same way (chunk c+1's V^T Ag^T under chunk c's tail; no wgmma pending across
        # the back-edge). Chunk c's o staging precedes chunk c+1's Y GEMM, so O^T is not live beside Y.
        T.set_max_nreg(REGS["state"], 1)
        v0 = h * BH
        s_f = T.alloc_fragment((BH, K), acc)        # S^T
        vd_f = T.alloc_fragment((BH, BT), acc)      # Vd^T
        vdr_f = T.alloc_fragment((BH, BT), dtype)
        vdb_f = T.alloc_fragment((BH, BT), dtype)
        o_f = T.alloc_fragment((BH, BT), acc)       # O^T
        y_f = T.alloc_fragment((BH, BT), acc)       # Y = S0^T K^T
        yb_f = T.alloc_fragment((BH, BT), dtype)
        if has_initial_state:
            if state_v_first:
                for i, j in T.Parallel(BH, K):
                    s_f[i, j] = T.cast(h0[n64, i_hv, v0 + i, j], acc)
            else:
                for i, j in T.Parallel(BH, K):
                    s_f[i, j] = T.cast(h0[n64, i_hv, j, v0 + i], acc)
        else:
            T.clear(s_f)
        if NT > 0:
            T.barrier_wait(full[0], 0)
            T.barrier_wait(prep_done[0], 0)
            T.wgmma_gemm(v_s[0, :, v0:v0 + BH], a_s[0, :, :], vd_f, transpose_A=True, transpose_B=True,
                         clear_accum=True)
            issue_ws(0, 0, h, s_f, sb_s, vd_f, y_f, yb_f, k_s, ae_s, el_s)
            T.wait_wgmma(0)
            T.barrier_arrive(empty_va[0])
            for c in T.serial(NT - 1):
                st1 = (c + 1) % NS
                pb1 = (c + 1) % NP
                finish_chunk(c % NS, c % NP, h, s_f, sb_s, vd_f, vdr_f, vdb_f, o_f, q_s, k_s, pg_s, r_s, dq_s)
                T.barrier_wait(full[st1], ((c + 1) // NS) % 2)
                T.barrier_wait(prep_done[pb1], ((c + 1) // NP) % 2)
                T.wgmma_gemm(v_s[st1, :, v0:v0 + BH], a_s[st1, :, :], vd_f, transpose_A=True, transpose_B=True,
                             clear_accum=True)
                T.wait_wgmma(1)
                release_and_store_o(c, h, o_f, o_s, empty, pout_empty, o_empty, o_full, tx)
                issue_ws(st1, pb1, h, s_f, sb_s, vd_f, y_f, yb_f, k_s, ae_s, el_s)
                T.wait_wgmma(0)
                T.barrier_arrive(empty_va[st1])
            finish_chunk((NT - 1) % NS, (NT - 1) % NP, h, s_f, sb_s, vd_f, vdr_f, vdb_f, o_f, q_s, k_s, pg_s, r_s,
                         dq_s)
            T.wait_wgmma(0)
            release_and_store_o(NT - 1, h, o_f, o_s, empty, pout_empty, o_empty, o_full, tx)
        if state_v_first:
            for i, j in T.Parallel(BH, K):
                ht[n64, i_hv, v0 + i, j] = s_f[i, j]
        else:
            for i, j in T.Parallel(BH, K):
                ht[n64, i_hv, j, v0 + i] = s_f[i, j]

    @T.macro
    def wait_inputs(c, st, ln, full, q_s, k_s, v_s, a_s):
        # prep WG: chunk c's ring slot is loaded; rows past the sequence end are zeroed in q, k, v and A
        T.barrier_wait(full[st], (c // NS) % 2)
        if ln < BT:
            for i, j in T.Parallel(BT, K):
                if i >= ln:
                    q_s[st, i, j] = T.cast(0, dtype)
                    k_s[st, i, j] = T.cast(0, dtype)
            for i, j in T.Parallel(BT, V):
                if i >= ln:
                    v_s[st, i, j] = T.cast(0, dtype)
            for i, j in T.Parallel(BT, BT):
                if i >= ln:
                    a_s[st, i, j] = T.cast(0, dtype)
            T.fence_proxy_async()
            T.sync_threads(1, 128)

    @T.macro
    def prep_chunk(c, bos, eos, full, pout_empty, prep_done, q_s, k_s, v_s, a_s, g_s, b_s, ae_s, pg_s, r_s, dq_s,
                   el_s, p_f, gi_f, ei_f):
        st = c % NS
        pb = c % NP
        ln = T.min(eos - (bos + c * BT), BT)
        wait_inputs(c, st, ln, full, q_s, k_s, v_s, a_s)
        T.wgmma_gemm(q_s[st, :, :], k_s[st, :, :], p_f, transpose_B=True, clear_accum=True)   # P = Q K^T
        for i in T.Parallel(BT):
            gi_f[i] = g_s[st, i] * LOG2E
            ei_f[i] = -T.exp2(gi_f[i])
        T.barrier_wait(pout_empty[pb], ((c // NP) % 2) ^ 1)
        T.wait_wgmma(0)
        # Branch-free element-wise pass straight to the bf16 tiles (as the default build's, which rounds the same
        # fp32 values): Gamma is exactly 0 above the diagonal; A o beta needs no mask (A unit lower triangular,
        # ragged rows zeroed, beta = 0 past the end). Ag goes in place over A: each element is read and written by
        # the same thread.
        for i, j in T.Parallel(BT, BT):
            gam = T.exp2(T.Select(i >= j, gi_f[i] - g_s[st, j] * LOG2E, -T.infinity(acc)))
            ab = T.cast(a_s[st, i, j], acc) * b_s[st, j]
            a_s[st, i, j] = T.cast(ab * gam, dtype)
            ae_s[pb, i, j] = T.cast(ab * ei_f[i], dtype)
            pg_s[pb, i, j] = T.cast(p_f[i, j] * gam * scale, dtype)
        # R = exp(G_last - G_t) (0 past the end), scale * exp(G_t), exp(G_last)
        for t in T.Parallel(BT):
            r_s[pb, t] = T.Select(t < ln, T.exp2((g_s[st, BT - 1] - g_s[st, t]) * LOG2E), 0.0)
            dq_s[pb, t] = T.exp2(g_s[st, t] * LOG2E) * scale
        el_s[pb, 0] = T.exp2(g_s[st, BT - 1] * LOG2E)
        T.fence_proxy_async()
        T.barrier_arrive(prep_done[pb])

    @T.prim_func
    def chunk_fwd_wide_kernel(
        q: T.Tensor((1, T_, H, K), dtype),
        k: T.Tensor((1, T_, H, K), dtype),
        v: T.Tensor((1, T_, HV, V), dtype),
        g: T.Tensor((1, T_, HV), acc),
        beta: T.Tensor((1, T_, HV), beta_dtype),
        A: T.Tensor((1, T_, HV, BT), dtype),
        h0: T.Tensor(state_shape, h0_dtype),
        cu_seqlens: T.Tensor((N_ + 1,), "int32"),
        seq_order: T.Tensor((N_ + 1,), "int32"),
        o: T.Tensor((1, T_, HV, V), dtype),
        ht: T.Tensor(state_shape, acc),
    ):
        prelude = _ptx.STAGE_O_PRELUDE + _ptx.STORE_ROWS_PRELUDE
        with T.Kernel((N_ + 1) * HV, threads=THREADS, prelude=prelude) as bx:
            i_n = seq_order[bx // HV]                    # longest sequence first (`_tl.seq_order`)
            i_hv = bx % HV
            i_h = i_hv // G

            # ---- shared memory: 2-slot input ring, two prep-product buffers, o staging, bf16(S0^T) ----
            q_s = T.alloc_shared((NS, BT, K), dtype)
            k_s = T.alloc_shared((NS, BT, K), dtype)
            v_s = T.alloc_shared((NS, BT, V), dtype)
            a_s = T.alloc_shared((NS, BT, BT), dtype)      # A, then Ag in place
            g_s = T.alloc_shared((NS, BT), acc)
            b_s = T.alloc_shared((NS, BT), acc)
            ae_s = T.alloc_shared((NP, BT, BT), dtype)      # Ae = -diag(exp G) (A o beta_j)
            pg_s = T.alloc_shared((NP, BT, BT), dtype)
            r_s = T.alloc_shared((NP, BT), acc)             # exp(G_last - G_t), 0 past the end
            dq_s = T.alloc_shared((NP, BT), acc)            # scale * exp(G_t)
            el_s = T.alloc_shared((NP, 1), acc)             # exp(G_last)
            o_s = T.alloc_shared((NO, BT, O_LD), dtype)     # o staging, V halves side by side
            # bf16(S0^T) per state warpgroup (its V half), the A operand of its Y and O GEMMs: 2 x 16 KB
            sb0_s = T.alloc_shared((V // 2, K), dtype)
            sb1_s = T.alloc_shared((V // 2, K), dtype)

            full = T.alloc_barrier([64] * NS)             # load warp (32 arrivals + TMA bytes) and gate warp (32)
            empty = T.alloc_barrier([ST] * NS)            # state WGs release the q/k part of a ring slot
            empty_va = T.alloc_barrier([ST] * NS)         # state WGs release v/A/g/beta (after the Vd GEMMs)
            prep_done = T.alloc_barrier([128] * NP)
            pout_empty = T.alloc_barrier([ST] * NP)       # state WGs release ae/pg/r/dq/el
            o_full = T.alloc_barrier([128] * (2 * NO))    # [buffer * 2 + V half]: that half's state WG
            o_empty = T.alloc_barrier([32] * (2 * NO))    # that half's store warp

            tx = T.get_thread_binding()

            if i_n == N_:
                # padding tail [cu_seqlens[N], T): o = 0 for this head
                tb = cu_seqlens[N_]
                VEC = 8
                per_row = V // VEC
                for it in T.serial(T.ceildiv((T_ - tb) * per_row, THREADS)):
                    e = it * THREADS + tx
                    row = tb + e // per_row
                    if row < T_:
                        for u in T.vectorized(VEC):
                            o[0, T.cast(row, "int64"), i_hv, (e % per_row) * VEC + u] = T.cast(0, dtype)
            else:
                bos = cu_seqlens[i_n]
                eos = cu_seqlens[i_n + 1]
                NT = T.ceildiv(eos - bos, BT)
                n64 = T.cast(i_n, "int64")

                if tx < 128:
                    # ================= state warpgroups, one V half each =================
                    state_wg(0, NT, n64, i_hv, h0, ht, full, prep_done, empty, empty_va, pout_empty, o_empty, o_full,
                             q_s, k_s, v_s, a_s, ae_s, pg_s, r_s, dq_s, el_s, o_s, sb0_s, tx)
                elif tx < ST:
                    state_wg(1, NT, n64, i_hv, h0, ht, full, prep_done, empty, empty_va, pout_empty, o_empty, o_full,
                             q_s, k_s, v_s, a_s, ae_s, pg_s, r_s, dq_s, el_s, o_s, sb1_s, tx)
                elif tx < ST + 128:
                    # ================= prep warpgroup: each chunk's K-side products, once for all of V =========
                    T.set_max_nreg(REGS["prep"], 0)
                    p_f = T.alloc_fragment((BT, BT), acc)
                    gi_f = T.alloc_fragment((BT,), acc)        # G of the rows this thread owns (log2 domain)
                    ei_f = T.alloc_fragment((BT,), acc)        # -exp(G) of those rows
                    for c in T.serial(NT):
                        prep_chunk(c, bos, eos, full, pout_empty, prep_done, q_s, k_s, v_s, a_s, g_s, b_s, ae_s,
                                   pg_s, r_s, dq_s, el_s, p_f, gi_f, ei_f)
                else:
                    # ================= producer warps =================
                    T.set_max_nreg(REGS["producer"], 0)
                    if tx < ST + 160:
                        # load warp: v and A once the slot's v/A part is free, q and k once all of it is
                        for c in T.serial(NT):
                            st = c % NS
                            t0 = bos + c * BT
                            T.barrier_wait(empty_va[st], ((c // NS) % 2) ^ 1)
                            T.tma_copy(v[0, t0:t0 + BT, i_hv, 0:V], v_s[st, :, :], barrier=full[st])
                            T.tma_copy(A[0, t0:t0 + BT, i_hv, 0:BT], a_s[st, :, :], barrier=full[st])
                            T.barrier_wait(empty[st], ((c // NS) % 2) ^ 1)
                            T.tma_copy(q[0, t0:t0 + BT, i_h, 0:K], q_s[st, :, :], barrier=full[st])
                            T.tma_copy(k[0, t0:t0 + BT, i_h, 0:K], k_s[st, :, :], barrier=full[st])
                            T.barrier_arrive(full[st])
                    elif tx < ST + 224:
                        # store warps: o rows < len of V half h (the next sequence or the padding tail follows)
                        h = (tx - (ST + 160)) // 32
                        for c in T.serial(NT):
                            pb = c % NO
                            t0 = bos + c * BT
                            T.barrier_wait(o_full[pb * 2 + h], (c // NO) % 2)
                            T.call_extern("handle", "fd_store_rows",
                                          T.address_of(o[0, T.cast(t0, "int64"), i_hv, h * 64]),
                                          T.address_of(o_s[pb, 0, h * 64]), T.min(eos - t0, BT), HV * V * 2,
                                          O_LD * 2, tx % 32)
                            T.barrier_arrive(o_empty[pb * 2 + h])
                    else:
                        # gate warp: g and beta rows by plain loads; rows past the end get g[eos - 1] and beta = 0
                        for c in T.serial(NT):
                            st = c % NS
                            t0 = bos + c * BT
                            T.barrier_wait(empty_va[st], ((c // NS) % 2) ^ 1)
                            for t in T.Parallel(BT):
                                tt = T.cast(T.min(t0 + t, eos - 1), "int64")
                                g_s[st, t] = g[0, tt, i_hv]
                                b_s[st, t] = T.Select(t0 + t < eos, T.cast(beta[0, tt, i_hv], acc), 0.0)
                            T.barrier_arrive(full[st])

    return chunk_fwd_wide_kernel
