"""A/B variant of kernels/fused_fwd_wide.py (not shipped; docs/dev/fused_fwd.md item 0b): the wide build with prepare
inside it. The gate warp reads the raw gate and writes the chunk-local cumsum itself; the prep warpgroup forms K K^T,
splits it (C++, the wgmma accumulator layout) into the fp32 diagonal blocks and L's bf16 hi/lo rows, which live in
the prep-product buffer it is about to fill, and its warp 0 inverts I + strictly_lower(diag(beta) K K^T) with
`_ptx.WY_INVERSE_PRELUDE`'s per-warp inverse, writing A's rows straight into the ring slot's A tile in its 128-byte
swizzle; then Q K^T and the pass as in the wide build. No A input, no prepare launch. `chunk_fwd_inv(q, k, v, g, beta,
h0, cu_seqlens, scale)`: g is the raw gate (log decay, fp32), beta as given; plain forward only.
bench/dev/ab_wide_inv.py times it against prepare + the default and the wide builds.
"""
# No `from __future__ import annotations`: TileLang evaluates the prim_func annotations in this scope.
import tilelang.language as T

import torch

from flashdelta.kernels import _ptx, _tl

BT = 64                 # chunk size (the default build's)
LOG2E = 1.4426950408889634
HEAD_DIMS = ((128, 128),)
NS = 2                  # input ring slots (q/k/v/A/g/beta)
NP = 2                  # prep-product buffers (ae, pg, row scalars)
NO = 2                  # o staging buffers, each holding both V halves
THREADS = 512
ST = 256                # state threads: two warpgroups, one 64-row half of S^T each
# setmaxnreg targets: 2 x state + prep + producers <= 4 x 128 (the launch's registers per thread slot)
REGS = {"state": 176, "prep": 128, "producer": 32}   # the inverse needs the prep warpgroup at 128


# The gate warp's chunk-local cumsum of one value head's raw gate: rows [0, rows) of g (row pitch g_pitch floats),
# the gate floor applied as prepare applies it, 0 past `rows`, so rows >= rows carry the last row's cumsum (what the
# wide build's gate warp read from prepare's g_cumsum there).
# The prep warpgroup's split of K K^T (a [64, 64] wgmma accumulator, register 4 n + 2 h + e at row 16 warp + 8 h +
# lane / 4, column 8 n + 2 (lane % 4) + e): the fp32 diagonal blocks into kkd [4][16][17], the blocks below the
# diagonal (rows 16..63, cols 0..47) as bf16 hi/lo into lhi/llo [48][WY_LP] (prepare_common.split_gram's values).
# The inverse's output: `fd_wy_inverse_warp` with its row stores into a 128-byte-swizzled [64][64] shared tile
# (16-byte chunk c of row r at c ^ (r & 7)) instead of a global row pitch (fd_pack2 comes with STAGE_O_PRELUDE).
INV_PRELUDE = _ptx.PRODUCER_PRELUDE + _ptx.WY_INVERSE_PRELUDE[len(_ptx.PACK2_PRELUDE):].replace(
    "fd_wy_inverse_warp", "fd_wy_inverse_swz").replace(
    "*reinterpret_cast<uint4*>(static_cast<char*>(a_out) + 2 * ((16 * i + r) * a_pitch) + (lane & 7) * 16) = x;",
    "*reinterpret_cast<uint4*>(static_cast<char*>(a_out) + (16 * i + r) * 128 + "
    "(((lane & 7) ^ ((16 * i + r) & 7)) * 16)) = x;") + r"""
__device__ __forceinline__ void fd_gate_cumsum_rows(const float* g, long long g_pitch, float* gs, int rows, int lane) {
  float x0[1], x1[1];
  x0[0] = lane < rows ? fd_gate_floor(g[lane * g_pitch]) : 0.f;
  x1[0] = lane + 32 < rows ? fd_gate_floor(g[(lane + 32) * g_pitch]) : 0.f;
  fd_scan64_store<1>(x0, x1, gs, 1, 64, lane);
}
__device__ __forceinline__ void fd_split_gram_wg(const float* kk, float* kkd, void* lhi_v, void* llo_v, int tx) {
  unsigned short* lhi = static_cast<unsigned short*>(lhi_v);
  unsigned short* llo = static_cast<unsigned short*>(llo_v);
  const int lane = tx & 31, w = (tx >> 5) & 3;
  #pragma unroll
  for (int n = 0; n < 8; ++n) {
    #pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int i = 16 * w + 8 * h + (lane >> 2);
      #pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int c = 8 * n + 2 * (lane & 3) + e;
        const float x = kk[4 * n + 2 * h + e];
        if ((c >> 4) == w) kkd[w * 16 * 17 + (i & 15) * 17 + (c & 15)] = x;
        if ((c >> 4) < w) {
          const unsigned hp = fd_pack2<false>(x, 0.f) & 0xffffu;     // bf16 builds only
          const float hf = __uint_as_float(hp << 16);
          lhi[(i - 16) * """ + str(_ptx.WY_LP) + r""" + c] = (unsigned short)hp;
          llo[(i - 16) * """ + str(_ptx.WY_LP) + r""" + c] = (unsigned short)(fd_pack2<false>(x - hf, 0.f) & 0xffffu);
        }
      }
    }
  }
}
"""


@_tl.jit(pass_configs=_tl.WS_PASS_CONFIGS)
def build(H: int, HV: int, K: int, V: int, dtype: str, beta_dtype: str, h0_dtype: str, scale: float,
          has_initial_state: bool, state_v_first: bool):
    """The variant for one compile-time configuration (`fused_fwd.builder_args`, bf16 only); T and N are dynamic."""
    assert dtype == "bfloat16", "the variant's split packs bf16"
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
    def wait_inputs(c, st, ln, full, q_s, k_s, v_s):
        # prep WG: chunk c's ring slot is loaded; rows past the sequence end are zeroed in q, k and v (k's zero rows
        # and beta = 0 there make L zero there, so A is the identity on them and A o beta_j zeroes it)
        T.barrier_wait(full[st], (c // NS) % 2)
        if ln < BT:
            for i, j in T.Parallel(BT, K):
                if i >= ln:
                    q_s[st, i, j] = T.cast(0, dtype)
                    k_s[st, i, j] = T.cast(0, dtype)
            for i, j in T.Parallel(BT, V):
                if i >= ln:
                    v_s[st, i, j] = T.cast(0, dtype)
            T.fence_proxy_async()
            T.sync_threads(1, 128)

    @T.macro
    def prep_chunk(c, bos, eos, full, pout_empty, prep_done, q_s, k_s, v_s, a_s, g_s, b_s, ae_s, pg_s, r_s, dq_s,
                   el_s, p_f, kk_f, gi_f, ei_f, kkd_s, ws_s, tp):
        st = c % NS
        pb = c % NP
        ln = T.min(eos - (bos + c * BT), BT)
        wait_inputs(c, st, ln, full, q_s, k_s, v_s)
        # A = (I + strictly_lower(diag(beta) K K^T))^-1 into a_s[st]: K K^T, its split into kkd and the hi/lo rows
        # (in ae_s[pb] and pg_s[pb], free once the state warpgroups release them and until the pass below), warp 0's
        # inverse, then Q K^T
        T.barrier_wait(pout_empty[pb], ((c // NP) % 2) ^ 1)
        T.wgmma_gemm(k_s[st, :, :], k_s[st, :, :], kk_f, transpose_B=True, clear_accum=True)   # K K^T
        T.wait_wgmma(0)
        T.call_extern("handle", "fd_split_gram_wg", kk_f.data, T.address_of(kkd_s[0, 0, 0]),
                      T.address_of(ae_s[pb, 0, 0]), T.address_of(pg_s[pb, 0, 0]), tp)
        T.sync_threads(1, 128)
        T.call_extern("handle", "fd_wy_inverse_swz<false>", T.address_of(ae_s[pb, 0, 0]),
                      T.address_of(pg_s[pb, 0, 0]), T.address_of(kkd_s[0, 0, 0]), T.address_of(b_s[st, 0]), 1,
                      T.address_of(ws_s[0]), 1, T.address_of(ws_s[0]), T.address_of(a_s[st, 0, 0]),
                      T.cast(BT, "int64"), BT, tp < 32, tp)
        T.sync_threads(1, 128)
        T.wgmma_gemm(q_s[st, :, :], k_s[st, :, :], p_f, transpose_B=True, clear_accum=True)   # P = Q K^T
        for i in T.Parallel(BT):
            gi_f[i] = g_s[st, i] * LOG2E
            ei_f[i] = -T.exp2(gi_f[i])
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
        h0: T.Tensor(state_shape, h0_dtype),
        cu_seqlens: T.Tensor((N_ + 1,), "int32"),
        seq_order: T.Tensor((N_ + 1,), "int32"),
        o: T.Tensor((1, T_, HV, V), dtype),
        ht: T.Tensor(state_shape, acc),
    ):
        prelude = _ptx.STAGE_O_PRELUDE + _ptx.STORE_ROWS_PRELUDE + INV_PRELUDE
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
            kkd_s = T.alloc_shared((4, 16, 17), acc)          # K K^T's diagonal blocks (the inverse's level 0)
            ws_s = T.alloc_shared((_ptx.WY_WS_FLOATS,), acc)  # the inverting warp's workspace
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
                    kk_f = T.alloc_fragment((BT, BT), acc)
                    gi_f = T.alloc_fragment((BT,), acc)        # G of the rows this thread owns (log2 domain)
                    ei_f = T.alloc_fragment((BT,), acc)        # -exp(G) of those rows
                    for c in T.serial(NT):
                        prep_chunk(c, bos, eos, full, pout_empty, prep_done, q_s, k_s, v_s, a_s, g_s, b_s, ae_s,
                                   pg_s, r_s, dq_s, el_s, p_f, kk_f, gi_f, ei_f, kkd_s, ws_s, tx - ST)
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
                            T.call_extern("handle", "fd_gate_cumsum_rows",
                                          T.address_of(g[0, T.cast(t0, "int64"), i_hv]), T.cast(HV, "int64"),
                                          T.address_of(g_s[st, 0]), T.min(eos - t0, BT), tx % 32)
                            for t in T.Parallel(BT):
                                tt = T.cast(T.min(t0 + t, eos - 1), "int64")
                                b_s[st, t] = T.Select(t0 + t < eos, T.cast(beta[0, tt, i_hv], acc), 0.0)
                            T.barrier_arrive(full[st])

    return chunk_fwd_wide_kernel


def chunk_fwd_inv(q, k, v, g, beta, initial_state, cu_seqlens, *, scale, state_v_first=False):
    """(o, ht) of the plain forward from the raw gate, prepare included (K = V = 128, bf16; flat varlen)."""
    from flashdelta.kernels import fused_fwd

    _, T_, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = cu_seqlens.shape[0] - 1
    assert (K, V) in HEAD_DIMS and q.dtype == torch.bfloat16 and g.dtype == torch.float32
    state_shape = (N, HV, V, K) if state_v_first else (N, HV, K, V)
    o = _tl.alloc((1, T_, HV, V), v.dtype, q.device)
    ht = _tl.alloc(state_shape, torch.float32, q.device)
    cu = _tl.cu_seqlens_int32(cu_seqlens)
    h0 = initial_state if initial_state is not None else ht
    args = fused_fwd.builder_args(H, HV, K, V, q.dtype, beta.dtype, h0.dtype, scale, initial_state is not None,
                                  state_v_first)
    build(*args)(q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous(), h0.contiguous(),
                 cu, _tl.seq_order(cu, HV), o, ht)
    return o, ht
