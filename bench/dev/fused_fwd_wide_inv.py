"""A/B variant of kernels/fused_fwd_wide.py (not shipped; docs/dev/fused_fwd.md items 0b, 0c): the wide build with
prepare inside it and the WY inverse spread over the prep warpgroup's four warps. No A input, no prepare launch.
`chunk_fwd_inv(q, k, v, g, beta, h0, cu_seqlens, scale, qk_first=False)`: g is the raw gate (log decay, fp32), beta as
given, bf16 or fp16; plain forward only. bench/dev/ab_wide_inv.py times it against prepare + the default and the wide
builds; bench/dev/wy_inverse_wg_emu.py checks the inverse's fragment code on the CPU.

Roles as in the wide build, except:
- the gate warp reads the raw gate and writes the chunk-local cumsum into the ring slot itself (`fd_gate_cumsum_rows`,
  prepare's gate floor and scan); the load warp loads v, q and k (no A);
- the prep warpgroup, per chunk: waits `full` and `pout_empty`; K K^T (SS wgmma on the ring's k tile); splits it
  (`fd_split_gram_wg`: the fp32 diagonal blocks into kkd, L's bf16 hi/lo rows into ae_s[pb] and pg_s[pb], which the
  pass overwrites later); all four warps invert (`fd_wy_inverse_wg`, below) into the ring slot's A tile; a 128-thread
  barrier; Q K^T (with `qk_first`: issued with K K^T, so that it runs under the inverse); the pass as in the wide build.

Barriers: the mbarriers and their counts are the wide build's (`full` 64: the load warp's 32 with the TMA bytes of v,
q and k, and the gate warp's 32). Named barriers: 1 (the prep warpgroup's 128 threads: the ragged zeroing, the D_b
publication inside the inverse, the end of the inverse), 2 and 3 (each state warpgroup's S0^T tile), and inside the
inverse 4, 5, 6 (64 threads: one producer warp arrives, warp 3 syncs; each used once per chunk, and a producer's next
arrival follows the 128-thread barriers that warp 3 passes first). An arrive synchronizes with the sync of the same
barrier (PTX memory model), which publishes the exchange's shared-memory stores.

Registers: 2 x 192 + 96 + 32 = 512, the wide build's budget (the prep warpgroup compiles without spills down to 88);
with qk_first 2 x 176 + 128 + 32 (Q K^T's 32 accumulators live across the inverse; the prep spills at 120).
Shared memory: the wide build's 218,112 B plus the 5,120 B level-0 tile kkd ([4][16][20] fp32, D_b^T written over
it): 223,232 B of the 232,448 a CTA may use. The inverse's other scratch lives in the prep-product buffer it is about
to fill: L's hi/lo rows (5,376 B each) and three 1 KB exchanges after them in ae_s[pb] and pg_s[pb].
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
REGS = {"state": 192, "prep": 96, "producer": 32}   # the wide build's budget: the inverse fits 96 (88 without spills)
REGS_QK = {"state": 176, "prep": 128, "producer": 32}   # qk_first: P (32 registers) live across the inverse: 120 spills
KD_P = 20               # row pitch (floats) of the level-0 tile kkd [4][16][KD_P]: 16-byte rows


# The gate warp's chunk-local cumsum of one value head's raw gate: rows [0, rows) of g (row pitch g_pitch floats),
# the gate floor applied as prepare applies it, 0 past `rows`, so rows >= rows carry the last row's cumsum (what the
# wide build's gate warp read from prepare's g_cumsum there).
# The prep warpgroup's split of K K^T (a [64, 64] wgmma accumulator, register 4 n + 2 h + e at row 16 warp + 8 h +
# lane / 4, column 8 n + 2 (lane % 4) + e): warp w's diagonal block transposed into kkd[w] ([4][16][KD_P] fp32,
# kkd[w][c][r] = L[16 w + r][16 w + c]: the level-0 substitution reads a column of L as a 16-byte aligned row, and these
# stores are conflict-free), the blocks below the diagonal (rows 16..63, cols 0..47) as bf16 hi/lo into lhi/llo
# [48][WY_LP] (prepare_common.split_gram's values; bf16 in fp16 builds too, as prepare's).
#
# fd_wy_inverse_wg<kHalf>: the prep warpgroup's four warps invert M = I + strictly_lower(diag(beta) L) together, with
# fd_wy_inverse_warp's arithmetic (fp32 level 0, then 16x16 products on mma.m16n8k16 with bf16 hi/lo splits, 3 passes,
# fp32 accumulate) and its result into the ring slot's A tile. 16x16 blocks: D_b = M_bb^-1, D'_b = -D_b diag(beta_b),
# L_im the blocks of L below the diagonal; A_ij = D'_i sum_{m=j}^{i-1} L_im A_mj (i > j), A_jj = D_j. Products run on
# transposes U_ij = A_ij^T as in fd_wy_inverse_warp, so that an accumulator pair is the next product's A operand; an
# accumulator P also serves as the B operand of P^T (its register pairs are that fragment), which warp 2 uses to form
# A32 the other way round, so that its accumulator gives warp 3 the B operand it needs (W32^T, below).
#   Level 0: warp w forms D_w (one column per lane, lanes 16..31 repeat 0..15), with the same fmaf order as the one-warp
#   code, and writes D_w^T over its own kkd block; one 128-thread barrier publishes the four.
#   Level 1: the three column blocks' chains of the block substitution are 6, 4 and 2 products deep (A30 waits on A20
#   on A10). With Y_i = L_i0 D0 + L_i1 A10 (so A20 = D'2 Y2) and the block-2-to-3 propagator W32 = D'3 L32 D'2 =
#   -A32 diag(beta_2) (A32 = D'3 L32 D2), A30 = D'3 (Y3 + L32 A20) = D'3 Y3 + W32 Y2: column 0 becomes four products
#   deep (A10: 2, Y2 and Y3: 1, A20 and A30: 1) and splits over two warps:
#     warp 0: L10 D0 -> A10 = D'1 (.) -> Y2 = L20 D0 + L21 A10 -> A20 = D'2 Y2   (5 products; sends A10, Y2)
#     warp 3: L30 D0; Y3 = (.) + L31 A10 -> A30 = D'3 Y3 + W32 Y2                 (4 products; receives A10, Y2, W32)
#     warp 1: L21 D1 -> A21 = D'2 (.); L31 D1 + L32 A21 -> A31 = D'3 (.)           (5 products, 4 deep, no exchange)
#     warp 2: L32 D2 -> A32 = D'3 (.) (natural orientation: its accumulator, columns scaled by -beta_2, is the B
#             operand W32^T that warp 3 needs); the six zero blocks above the diagonal   (2 products; sends W32)
#   A product is 6 mma (two n8 halves x hi*hi, hi*lo, lo*hi, in three accumulator chains so that they issue back to
#   back): the busiest warps issue 30 mma (warp 3: 24, warp 2: 12) where fd_wy_inverse_warp's one warp issues 96
#   (16 products), and the critical path is level 0, four products and one exchange (warp 0's A10 to warp 3: its
#   Y2 and warp 2's W32 arrive before warp 3 needs them), against the one warp's level 0 over two blocks per lane and
#   six dependent products (A10 -> A20 -> A30) behind the rest of its 96 mma. An exchange is the A (or B) fragment's 8
#   registers per lane through shared memory (2 x 16 bytes a lane, conflict-free) and a 64-thread named barrier (4:
#   A10, 5: Y2, 6: W32; the producer warp arrives, the consumer syncs). Blocks go to the tile by stmatrix (.trans
#   for U) straight into its 128-byte swizzle: 16-byte chunk c of row r at c ^ (r & 7).
#   lhi, llo: L's hi/lo rows (the split's); the 2 KB after lhi's 48 rows and the 1 KB after llo's hold the exchanges.
#   kkd: the split's transposed diagonal blocks, overwritten with D_b^T.  beta: the chunk's 64 betas (0 past the end:
#   A is the identity there).  a_tile: the [64][64] 16-bit tile.  tp: the thread's index in the warpgroup.
#   The caller publishes a_tile (a 128-thread barrier) before reading it, and before overwriting lhi/llo/kkd.
INV_PRELUDE = _ptx.PRODUCER_PRELUDE + _ptx.WY_INVERSE_PRELUDE[len(_ptx.PACK2_PRELUDE):] + r"""
constexpr int kFdKdP = """ + str(KD_P) + r""";       // kkd row pitch (floats): 16-byte rows, conflict-free
constexpr int kFdXch = 48 * """ + str(_ptx.WY_LP) + r""" * 2;   // byte offset of the exchanges after lhi / llo
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
        if ((c >> 4) == w) kkd[w * 16 * kFdKdP + (c & 15) * kFdKdP + (i & 15)] = x;
        if ((c >> 4) < w) {
          const unsigned hp = fd_pack2<false>(x, 0.f) & 0xffffu;
          const float hf = __uint_as_float(hp << 16);
          lhi[(i - 16) * """ + str(_ptx.WY_LP) + r""" + c] = (unsigned short)hp;
          llo[(i - 16) * """ + str(_ptx.WY_LP) + r""" + c] = (unsigned short)(fd_pack2<false>(x - hf, 0.f) & 0xffffu);
        }
      }
    }
  }
}
// three accumulator chains of 16x16 products (hi*hi, hi*lo, lo*hi): their mma issue back to back
struct FdWyP { float hh[2][4], hl[2][4], lh[2][4]; };
__device__ __forceinline__ void fd_wy_p_init(FdWyP& s, const float (&init)[2][4]) {
  #pragma unroll
  for (int t = 0; t < 2; ++t) {
    #pragma unroll
    for (int r = 0; r < 4; ++r) { s.hh[t][r] = init[t][r]; s.hl[t][r] = 0.f; s.lh[t][r] = 0.f; }
  }
}
__device__ __forceinline__ void fd_wy_p_zero(FdWyP& s) {
  #pragma unroll
  for (int t = 0; t < 2; ++t) {
    #pragma unroll
    for (int r = 0; r < 4; ++r) { s.hh[t][r] = 0.f; s.hl[t][r] = 0.f; s.lh[t][r] = 0.f; }
  }
}
// s += a @ b
__device__ __forceinline__ void fd_wy_p_add(FdWyP& s, const FdWyA& a, const FdWyB& b) {
  #pragma unroll
  for (int t = 0; t < 2; ++t) {
    fd_wy_mma(s.hh[t], a.hi, b.hi[t][0], b.hi[t][1]);
    fd_wy_mma(s.hl[t], a.hi, b.lo[t][0], b.lo[t][1]);
    fd_wy_mma(s.lh[t], a.lo, b.hi[t][0], b.hi[t][1]);
  }
}
__device__ __forceinline__ void fd_wy_p_sum(float (&p)[2][4], const FdWyP& s) {
  #pragma unroll
  for (int t = 0; t < 2; ++t) {
    #pragma unroll
    for (int r = 0; r < 4; ++r) p[t][r] = s.hh[t][r] + (s.hl[t][r] + s.lh[t][r]);
  }
}
// p = a @ b (+ init)
__device__ __forceinline__ void fd_wy_prod(float (&p)[2][4], const FdWyA& a, const FdWyB& b) {
  FdWyP s;
  fd_wy_p_zero(s);
  fd_wy_p_add(s, a, b);
  fd_wy_p_sum(p, s);
}
__device__ __forceinline__ void fd_wy_prod(float (&p)[2][4], const FdWyA& a, const FdWyB& b,
                                           const float (&init)[2][4]) {
  FdWyP s;
  fd_wy_p_init(s, init);
  fd_wy_p_add(s, a, b);
  fd_wy_p_sum(p, s);
}
// U_ii = D_i^T as an accumulator pair (row g, column 8 t + 2 q + e) from the level-0 scratch sc[c][r] = D_i[r][c]
__device__ __forceinline__ void fd_wy_d_acc(float (&d)[2][4], const float* sc, int lane) {
  const int g = lane >> 2, q = lane & 3;
  #pragma unroll
  for (int t = 0; t < 2; ++t) {
    d[t][0] = sc[g * kFdKdP + 8 * t + 2 * q];
    d[t][1] = sc[g * kFdKdP + 8 * t + 2 * q + 1];
    d[t][2] = sc[(g + 8) * kFdKdP + 8 * t + 2 * q];
    d[t][3] = sc[(g + 8) * kFdKdP + 8 * t + 2 * q + 1];
  }
}
// B operand (D'_i)^T: B[k][n] = -beta_k D_i[n][k] = -beta_k sc[k][n] (k = 8 h + 2 q + e, n = 8 t + g)
__device__ __forceinline__ FdWyB fd_wy_db(const float* sc, const float* be, int lane) {
  const int g = lane >> 2, q = lane & 3;
  FdWyB b;
  #pragma unroll
  for (int t = 0; t < 2; ++t) {
    #pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int k0 = 8 * h + 2 * q;
      fd_wy_split2(-be[k0] * sc[k0 * kFdKdP + 8 * t + g], -be[k0 + 1] * sc[(k0 + 1) * kFdKdP + 8 * t + g],
                   b.hi[t][h], b.lo[t][h]);
    }
  }
  return b;
}
// A operand D'_i: A[r][k] = -beta_k D_i[r][k] = -beta_k sc[k][r]
// (register p: row g + 8 (p & 1), k = 2 q + 8 (p >> 1) + e)
__device__ __forceinline__ FdWyA fd_wy_da(const float* sc, const float* be, int lane) {
  const int g = lane >> 2, q = lane & 3;
  FdWyA a;
  #pragma unroll
  for (int p = 0; p < 4; ++p) {
    const int r = g + 8 * (p & 1), k0 = 2 * q + 8 * (p >> 1);
    fd_wy_split2(-be[k0] * sc[k0 * kFdKdP + r], -be[k0 + 1] * sc[(k0 + 1) * kFdKdP + r], a.hi[p], a.lo[p]);
  }
  return a;
}
// the accumulator pair of P as the B operand of P^T: B[k][n] = P[n][k], k = 8 h + 2 q + e, n = 8 t + g, which is
// register pair (2 t, 2 t + 1) of P's n8 half h
__device__ __forceinline__ FdWyB fd_wy_as_bt(const float (&p)[2][4]) {
  FdWyB b;
  #pragma unroll
  for (int t = 0; t < 2; ++t) {
    #pragma unroll
    for (int h = 0; h < 2; ++h) fd_wy_split2(p[h][2 * t], p[h][2 * t + 1], b.hi[t][h], b.lo[t][h]);
  }
  return b;
}
// 8 registers per lane through shared memory (x: 1 KB), lane-major 16-byte pieces: conflict-free
__device__ __forceinline__ void fd_wy_put(void* x, const unsigned* hi, const unsigned* lo, int lane) {
  uint4* p = static_cast<uint4*>(x);
  p[lane] = make_uint4(hi[0], hi[1], hi[2], hi[3]);
  p[32 + lane] = make_uint4(lo[0], lo[1], lo[2], lo[3]);
}
__device__ __forceinline__ void fd_wy_get(const void* x, unsigned* hi, unsigned* lo, int lane) {
  const uint4* p = static_cast<const uint4*>(x);
  const uint4 a = p[lane], b = p[32 + lane];
  hi[0] = a.x; hi[1] = a.y; hi[2] = a.z; hi[3] = a.w;
  lo[0] = b.x; lo[1] = b.y; lo[2] = b.z; lo[3] = b.w;
}
__device__ __forceinline__ void fd_bar_arrive(int id, int n) {
  asm volatile("bar.arrive %0, %1;" :: "r"(id), "r"(n) : "memory");
}
__device__ __forceinline__ void fd_bar_sync(int id, int n) {
  asm volatile("bar.sync %0, %1;" :: "r"(id), "r"(n) : "memory");
}
// the shared address of 16-byte chunk ch of row r of the 128-byte-swizzled [64][64] 16-bit tile
__device__ __forceinline__ unsigned fd_swz(unsigned tile, int r, int ch) {
  return tile + r * 128 + ((ch ^ (r & 7)) << 4);
}
// U (= A_ij^T, an accumulator pair) -> block (i, j) of the tile as A_ij (stmatrix .trans; matrix m = lane / 8 holds
// U rows 8 (m & 1).., U columns 8 (m >> 1)..: A rows 16 i + 8 (m >> 1).., A columns 16 j + 8 (m & 1)..)
template <bool kHalf>
__device__ __forceinline__ void fd_wy_st_t(const float (&u)[2][4], unsigned tile, int i, int j, int lane) {
  const int m = lane >> 3;
  asm volatile("stmatrix.sync.aligned.x4.trans.m8n8.shared.b16 [%0], {%1, %2, %3, %4};"
               :: "r"(fd_swz(tile, 16 * i + 8 * (m >> 1) + (lane & 7), 2 * j + (m & 1))),
                  "r"(fd_pack2<kHalf>(u[0][0], u[0][1])), "r"(fd_pack2<kHalf>(u[0][2], u[0][3])),
                  "r"(fd_pack2<kHalf>(u[1][0], u[1][1])), "r"(fd_pack2<kHalf>(u[1][2], u[1][3]))
               : "memory");
}
// an accumulator pair holding A_ij itself -> block (i, j) (stmatrix; matrix m: rows 8 (m & 1).., columns 8 (m >> 1)..)
template <bool kHalf>
__device__ __forceinline__ void fd_wy_st_n(const float (&a)[2][4], unsigned tile, int i, int j, int lane) {
  const int m = lane >> 3;
  asm volatile("stmatrix.sync.aligned.x4.m8n8.shared.b16 [%0], {%1, %2, %3, %4};"
               :: "r"(fd_swz(tile, 16 * i + 8 * (m & 1) + (lane & 7), 2 * j + (m >> 1))),
                  "r"(fd_pack2<kHalf>(a[0][0], a[0][1])), "r"(fd_pack2<kHalf>(a[0][2], a[0][3])),
                  "r"(fd_pack2<kHalf>(a[1][0], a[1][1])), "r"(fd_pack2<kHalf>(a[1][2], a[1][3]))
               : "memory");
}
template <bool kHalf>
__device__ __forceinline__ void fd_wy_inverse_wg(const void* lhi_p, const void* llo_p, float* kkd, const float* beta,
                                                 void* a_tile, int tp) {
  const int lane = tp & 31, w = (tp >> 5) & 3;
  // level 0: D_w, lane c = column c (right-looking: s accumulates sum_{m<r} L[r][m] x[m], as fd_wy_inverse_warp)
  {
    const int c = lane & 15;
    float* const blk = kkd + w * 16 * kFdKdP;          // blk[m][r] = L[16 w + r][16 w + m]
    float bt[16], s[16], x[16];
    #pragma unroll
    for (int r = 0; r < 4; ++r) {
      const float4 b4 = reinterpret_cast<const float4*>(beta + 16 * w)[r];
      bt[4 * r] = b4.x; bt[4 * r + 1] = b4.y; bt[4 * r + 2] = b4.z; bt[4 * r + 3] = b4.w;
    }
    #pragma unroll
    for (int r = 0; r < 16; ++r) s[r] = 0.f;
    #pragma unroll
    for (int m = 0; m < 16; ++m) {
      const float e = m == c ? 1.f : 0.f;
      x[m] = e - bt[m] * s[m];
      #pragma unroll
      for (int r4 = (m + 1) >> 2; r4 < 4; ++r4) {
        const float4 l4 = reinterpret_cast<const float4*>(blk + m * kFdKdP)[r4];
        const float lv[4] = {l4.x, l4.y, l4.z, l4.w};
        #pragma unroll
        for (int u = 0; u < 4; ++u) {
          if (4 * r4 + u > m) s[4 * r4 + u] = fmaf(lv[u], x[m], s[4 * r4 + u]);
        }
      }
    }
    __syncwarp();
    // D_w^T over the block: blk[c][r] = D_w[r][c]
    if (lane < 16) {
      float4* const d4 = reinterpret_cast<float4*>(blk + c * kFdKdP);
      #pragma unroll
      for (int r = 0; r < 4; ++r) d4[r] = make_float4(x[4 * r], x[4 * r + 1], x[4 * r + 2], x[4 * r + 3]);
    }
  }
  fd_bar_sync(1, 128);
  const unsigned lhi = static_cast<unsigned>(__cvta_generic_to_shared(lhi_p));
  const unsigned llo = static_cast<unsigned>(__cvta_generic_to_shared(llo_p));
  const unsigned tile = static_cast<unsigned>(__cvta_generic_to_shared(a_tile));
  char* const xa = const_cast<char*>(static_cast<const char*>(lhi_p)) + kFdXch;   // A10, Y2
  char* const xb = const_cast<char*>(static_cast<const char*>(llo_p)) + kFdXch;   // W32
  const float* const sc0 = kkd;
  const float* const sc1 = kkd + 16 * kFdKdP;
  const float* const sc2 = kkd + 2 * 16 * kFdKdP;
  const float* const sc3 = kkd + 3 * 16 * kFdKdP;
  float d[2][4];
  if (w == 0) {
    fd_wy_d_acc(d, sc0, lane);
    fd_wy_st_t<kHalf>(d, tile, 0, 0, lane);
    const FdWyA u00 = fd_wy_as_a(d);
    float p1[2][4], p3[2][4], u10[2][4], y2[2][4], u20[2][4];
    fd_wy_prod(p1, u00, fd_wy_load_l(lhi, llo, 1, 0, lane));              // (L10 D0)^T
    fd_wy_prod(p3, u00, fd_wy_load_l(lhi, llo, 2, 0, lane));              // (L20 D0)^T
    fd_wy_prod(u10, fd_wy_as_a(p1), fd_wy_db(sc1, beta + 16, lane));      // A10^T = (D'1 L10 D0)^T
    const FdWyA a10 = fd_wy_as_a(u10);
    fd_wy_put(xa, a10.hi, a10.lo, lane);
    fd_bar_arrive(4, 64);
    fd_wy_st_t<kHalf>(u10, tile, 1, 0, lane);
    fd_wy_prod(y2, a10, fd_wy_load_l(lhi, llo, 2, 1, lane), p3);         // Y2^T = (L20 D0 + L21 A10)^T
    const FdWyA ay2 = fd_wy_as_a(y2);
    fd_wy_put(xa + 1024, ay2.hi, ay2.lo, lane);
    fd_bar_arrive(5, 64);
    fd_wy_prod(u20, ay2, fd_wy_db(sc2, beta + 32, lane));                 // A20^T = (D'2 Y2)^T
    fd_wy_st_t<kHalf>(u20, tile, 2, 0, lane);
  } else if (w == 1) {
    fd_wy_d_acc(d, sc1, lane);
    fd_wy_st_t<kHalf>(d, tile, 1, 1, lane);
    const FdWyA u11 = fd_wy_as_a(d);
    float x21[2][4], x31[2][4], u21[2][4], y31[2][4], u31[2][4];
    fd_wy_prod(x21, u11, fd_wy_load_l(lhi, llo, 2, 1, lane));             // (L21 D1)^T
    fd_wy_prod(x31, u11, fd_wy_load_l(lhi, llo, 3, 1, lane));             // (L31 D1)^T
    fd_wy_prod(u21, fd_wy_as_a(x21), fd_wy_db(sc2, beta + 32, lane));     // A21^T
    fd_wy_st_t<kHalf>(u21, tile, 2, 1, lane);
    fd_wy_prod(y31, fd_wy_as_a(u21), fd_wy_load_l(lhi, llo, 3, 2, lane), x31);   // (L31 D1 + L32 A21)^T
    fd_wy_prod(u31, fd_wy_as_a(y31), fd_wy_db(sc3, beta + 48, lane));     // A31^T
    fd_wy_st_t<kHalf>(u31, tile, 3, 1, lane);
  } else if (w == 2) {
    fd_wy_d_acc(d, sc2, lane);
    fd_wy_st_t<kHalf>(d, tile, 2, 2, lane);
    float x32t[2][4], a32[2][4];
    fd_wy_prod(x32t, fd_wy_as_a(d), fd_wy_load_l(lhi, llo, 3, 2, lane));  // X32^T = (L32 D2)^T
    fd_wy_prod(a32, fd_wy_da(sc3, beta + 48, lane), fd_wy_as_bt(x32t));   // A32 = D'3 X32 (natural orientation)
    // W32 = -A32 diag(beta_2): register r of n8 half t holds column 8 t + 2 q + (r & 1)
    float w32[2][4];
    #pragma unroll
    for (int t = 0; t < 2; ++t) {
      #pragma unroll
      for (int r = 0; r < 4; ++r) w32[t][r] = -beta[32 + 8 * t + 2 * (lane & 3) + (r & 1)] * a32[t][r];
    }
    const FdWyB b32 = fd_wy_as_bt(w32);                                   // B operand W32^T: B[k][n] = W32[n][k]
    fd_wy_put(xb, &b32.hi[0][0], &b32.lo[0][0], lane);
    fd_bar_arrive(6, 64);
    fd_wy_st_n<kHalf>(a32, tile, 3, 2, lane);
    // the blocks above the diagonal are zero: (0, 1..3), (1, 2..3), (2, 3), 16 rows x 2 chunks each
    #pragma unroll
    for (int z = 0; z < 6; ++z) {
      const int i = z < 3 ? 0 : z < 5 ? 1 : 2, j = z < 3 ? z + 1 : z < 5 ? z - 1 : 3;
      const unsigned a = fd_swz(tile, 16 * i + (lane >> 1), 2 * j + (lane & 1));
      asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};" :: "r"(a), "r"(0u) : "memory");
    }
  } else {
    fd_wy_d_acc(d, sc3, lane);
    fd_wy_st_t<kHalf>(d, tile, 3, 3, lane);
    fd_wy_d_acc(d, sc0, lane);
    float p4[2][4], y3[2][4], u30[2][4];
    fd_wy_prod(p4, fd_wy_as_a(d), fd_wy_load_l(lhi, llo, 3, 0, lane));    // (L30 D0)^T
    const FdWyB l31 = fd_wy_load_l(lhi, llo, 3, 1, lane);
    const FdWyB db3 = fd_wy_db(sc3, beta + 48, lane);
    FdWyA a10, ay2;
    FdWyB b32;
    fd_bar_sync(4, 64);
    fd_wy_get(xa, a10.hi, a10.lo, lane);
    fd_wy_prod(y3, a10, l31, p4);                                         // Y3^T = (L30 D0 + L31 A10)^T
    fd_bar_sync(5, 64);
    fd_bar_sync(6, 64);
    fd_wy_get(xa + 1024, ay2.hi, ay2.lo, lane);
    fd_wy_get(xb, &b32.hi[0][0], &b32.lo[0][0], lane);
    FdWyP s;
    fd_wy_p_zero(s);
    fd_wy_p_add(s, fd_wy_as_a(y3), db3);                                  // (D'3 Y3)^T
    fd_wy_p_add(s, ay2, b32);                                             // + (W32 Y2)^T = Y2^T W32^T
    fd_wy_p_sum(u30, s);
    fd_wy_st_t<kHalf>(u30, tile, 3, 0, lane);
  }
}
"""


@_tl.jit(pass_configs=_tl.WS_PASS_CONFIGS)
def build(H: int, HV: int, K: int, V: int, dtype: str, beta_dtype: str, h0_dtype: str, scale: float,
          has_initial_state: bool, state_v_first: bool, qk_first: bool = False, early_release: bool = False):
    """The variant for one compile-time configuration (`fused_fwd.builder_args`); T and N are dynamic. qk_first: the
    prep warpgroup issues Q K^T right after K K^T, so that it runs under the inverse (its accumulator live across it:
    `REGS_QK`), instead of after it. early_release: the state warpgroups free chunk c's ring slot and prep buffers
    once chunk c's GEMMs complete, before they wait for chunk c+1's prep (the wide build frees them after that wait:
    with two slots and two buffers chunk c+2's q/k load and prep then follow chunk c+1's prep_done, so the prep's
    latency and a load round trip sit in every period)."""
    assert dtype in ("bfloat16", "float16")
    regs = REGS_QK if qk_first else REGS
    inverse = f"fd_wy_inverse_wg<{'true' if dtype == 'float16' else 'false'}>"
    G = HV // H
    acc = "float32"
    assert (K, V) in HEAD_DIMS and HV % H == 0
    assert 2 * regs["state"] + regs["prep"] + regs["producer"] <= THREADS // 128 * (65536 // THREADS)
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
        # the back-edge). Chunk c's o staging precedes chunk c+1's Y GEMM, so O^T is not live beside Y. With
        # early_release chunk c's GEMMs drain and its slot and prep buffers are released before the waits for chunk
        # c+1.
        T.set_max_nreg(regs["state"], 1)
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
                if early_release:
                    # chunk c's slot and prep buffers free before chunk c+1's prep is awaited, so that chunk c+2's
                    # q/k load and prep do not wait on chunk c+1's prep (V^T Ag^T no longer runs under c's tail)
                    T.wait_wgmma(0)
                    release_and_store_o(c, h, o_f, o_s, empty, pout_empty, o_empty, o_full, tx)
                T.barrier_wait(full[st1], ((c + 1) // NS) % 2)
                T.barrier_wait(prep_done[pb1], ((c + 1) // NP) % 2)
                T.wgmma_gemm(v_s[st1, :, v0:v0 + BH], a_s[st1, :, :], vd_f, transpose_A=True, transpose_B=True,
                             clear_accum=True)
                if not early_release:
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
                   el_s, p_f, kk_f, gi_f, ei_f, kkd_s, tp):
        st = c % NS
        pb = c % NP
        ln = T.min(eos - (bos + c * BT), BT)
        wait_inputs(c, st, ln, full, q_s, k_s, v_s)
        # A = (I + strictly_lower(diag(beta) K K^T))^-1 into a_s[st]: K K^T, its split into kkd and the hi/lo rows
        # (in ae_s[pb] and pg_s[pb], free once the state warpgroups release them and until the pass below), the four
        # warps' inverse (each warp's level 0 reads only the kkd block it split: no barrier before it), a barrier
        # that publishes A to the pass and frees the hi/lo rows for it, then Q K^T (qk_first: issued with K K^T)
        T.barrier_wait(pout_empty[pb], ((c // NP) % 2) ^ 1)
        T.wgmma_gemm(k_s[st, :, :], k_s[st, :, :], kk_f, transpose_B=True, clear_accum=True)   # K K^T
        if qk_first:
            T.wgmma_gemm(q_s[st, :, :], k_s[st, :, :], p_f, transpose_B=True, clear_accum=True)   # P = Q K^T
            T.wait_wgmma(1)
        else:
            T.wait_wgmma(0)
        T.call_extern("handle", "fd_split_gram_wg", kk_f.data, T.address_of(kkd_s[0, 0, 0]),
                      T.address_of(ae_s[pb, 0, 0]), T.address_of(pg_s[pb, 0, 0]), tp)
        T.call_extern("handle", inverse, T.address_of(ae_s[pb, 0, 0]), T.address_of(pg_s[pb, 0, 0]),
                      T.address_of(kkd_s[0, 0, 0]), T.address_of(b_s[st, 0]), T.address_of(a_s[st, 0, 0]), tp)
        T.sync_threads(1, 128)
        if not qk_first:
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
            kkd_s = T.alloc_shared((4, 16, KD_P), acc)       # K K^T's diagonal blocks, then D_b^T (the inverse)
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
                    T.set_max_nreg(regs["prep"], 0)
                    p_f = T.alloc_fragment((BT, BT), acc)
                    kk_f = T.alloc_fragment((BT, BT), acc)
                    gi_f = T.alloc_fragment((BT,), acc)        # G of the rows this thread owns (log2 domain)
                    ei_f = T.alloc_fragment((BT,), acc)        # -exp(G) of those rows
                    for c in T.serial(NT):
                        prep_chunk(c, bos, eos, full, pout_empty, prep_done, q_s, k_s, v_s, a_s, g_s, b_s, ae_s,
                                   pg_s, r_s, dq_s, el_s, p_f, kk_f, gi_f, ei_f, kkd_s, tx - ST)
                else:
                    # ================= producer warps =================
                    T.set_max_nreg(regs["producer"], 0)
                    if tx < ST + 160:
                        # load warp: v once the slot's v/A part is free, q and k once all of it is (A is the
                        # prep warpgroup's)
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


def chunk_fwd_inv(q, k, v, g, beta, initial_state, cu_seqlens, *, scale, state_v_first=False, qk_first=False,
                  early_release=False):
    """(o, ht) of the plain forward from the raw gate, prepare included (K = V = 128, bf16 or fp16; flat varlen)."""
    from flashdelta.kernels import fused_fwd

    _, T_, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = cu_seqlens.shape[0] - 1
    assert (K, V) in HEAD_DIMS and q.dtype in (torch.bfloat16, torch.float16) and g.dtype == torch.float32
    state_shape = (N, HV, V, K) if state_v_first else (N, HV, K, V)
    o = _tl.alloc((1, T_, HV, V), v.dtype, q.device)
    ht = _tl.alloc(state_shape, torch.float32, q.device)
    cu = _tl.cu_seqlens_int32(cu_seqlens)
    h0 = initial_state if initial_state is not None else ht
    args = fused_fwd.builder_args(H, HV, K, V, q.dtype, beta.dtype, h0.dtype, scale, initial_state is not None,
                                  state_v_first)
    build(*args, bool(qk_first), bool(early_release))(q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(),
                                                      beta.contiguous(), h0.contiguous(), cu, _tl.seq_order(cu, HV),
                                                      o, ht)
    return o, ht
