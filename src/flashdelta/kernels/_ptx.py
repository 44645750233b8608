"""Inline CUDA/PTX that the TileLang kernels prepend to their source (T.Kernel prelude) and call with
T.call_extern. A prelude precedes TileLang's own includes, so only builtins and inline PTX appear here.
"""
from ..numerics import GATE_FLOOR

# fused_fwd: O^T (the state WG's [BV, BT] fp32 wgmma accumulator, 32 values per thread) -> o_s[t, v] as
# bf16/fp16, transposed by stmatrix. Thread tx of the warpgroup holds O^T[v, t] for v = 16 warp + 8 h + lane / 4,
# t = 8 n + 2 (lane % 4) + e at register 4 n + 2 h + e (the wgmma m64 accumulator layout); register pairs (e = 0, 1)
# are one packed conversion, and each 8x8 (v, t) block is one stmatrix .trans matrix whose rows land on o_s rows t.
# o_s rows are `ld` elements apart (padded: the transposed writes are conflict-free).
# fd_pack2<kHalf>(lo, hi): two fp32 values as one packed bf16x2 (fp16x2) register, `lo` in the low half.
PACK2_PRELUDE = r"""
template <bool kHalf>
__device__ __forceinline__ unsigned fd_pack2(float lo, float hi) {
  unsigned r;  // (the prelude precedes TileLang's includes: PTX, not cuda_bf16.h)
  if constexpr (kHalf) {
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  } else {
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  }
  return r;
}
"""
STAGE_O_PRELUDE = PACK2_PRELUDE[:-1] + r"""
template <bool kHalf>
__device__ __forceinline__ void fd_stage_o_trans(const float* o_f, void* o_s, int off, int ld, int tx) {
  const int lane = tx & 31, m = lane >> 3;
  const unsigned base = static_cast<unsigned>(__cvta_generic_to_shared(o_s)) +
      2u * (off + (lane & 7) * ld + (tx >> 5) * 16 + (m & 1) * 8 + (m >> 1) * 8 * ld);
  #pragma unroll
  for (int n = 0; n < 8; n += 2) {
    unsigned r[4];
    #pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int i = (n + (q >> 1)) * 4 + (q & 1) * 2;
      r[q] = fd_pack2<kHalf>(o_f[i], o_f[i + 1]);
    }
    asm volatile("stmatrix.sync.aligned.x4.trans.m8n8.shared.b16 [%0], {%1, %2, %3, %4};\n"
                 :: "r"(base + 2u * n * 8 * ld), "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3]) : "memory");
  }
}
"""
STAGE_O = {"bfloat16": "fd_stage_o_trans<false>", "float16": "fd_stage_o_trans<true>"}

# chunk_bwd: column sums of a [64, 64] fp32 wgmma accumulator held by one warpgroup (32 values per thread in the
# layout above: register 4 n + 2 h + e holds row 16 warp + 8 h + lane / 4, column 8 n + 2 (lane % 4) + e). Each
# thread adds its two rows, the 8 lanes that share a column (lane bits 2..4) add by shuffles, and lanes 0..3 of warp w
# write the warp's 64 sums to part[w][0:64] (fp32 shared, generic address). The caller adds part[0..3] in order, so the
# result does not depend on timing.
COLSUM_PRELUDE = r"""
__device__ __forceinline__ void fd_colsum64_part(const float* x, void* part_v, int tx) {
  float* const part = static_cast<float*>(part_v);
  const int lane = tx & 31, w = (tx >> 5) & 3;
  float s[16];
  #pragma unroll
  for (int n = 0; n < 8; ++n) {
    s[2 * n] = x[4 * n] + x[4 * n + 2];
    s[2 * n + 1] = x[4 * n + 1] + x[4 * n + 3];
  }
  #pragma unroll
  for (int i = 0; i < 16; ++i) {
    s[i] += __shfl_xor_sync(0xffffffffu, s[i], 4);
    s[i] += __shfl_xor_sync(0xffffffffu, s[i], 8);
    s[i] += __shfl_xor_sync(0xffffffffu, s[i], 16);
  }
  if (lane < 4) {
    #pragma unroll
    for (int n = 0; n < 8; ++n) {
      part[w * 64 + 8 * n + 2 * lane] = s[2 * n];
      part[w * 64 + 8 * n + 2 * lane + 1] = s[2 * n + 1];
    }
  }
}
"""

# chunk_bwd: row sums of one warpgroup's [64, N] fp32 wgmma accumulator (N / 2 values per thread in the layout above;
# a warpgroup of a multi-warpgroup product holds its own N columns, the same layout). Each thread adds its values of
# rows 16 warp + 8 h + lane / 4 (h = 0, 1) in register order, the quad's four lanes (lane bits 0..1) add by shuffles,
# and lane 0 of each quad writes part[row] (fp32 shared, generic address): the warpgroup's part of the 64 row sums.
# The caller adds the warpgroups' parts in a fixed order.
ROWSUM_PRELUDE = r"""
template <int N>
__device__ __forceinline__ void fd_rowsum64_part(const float* x, void* part_v, int tx) {
  float* const part = static_cast<float*>(part_v);
  const int lane = tx & 31, r0 = 16 * ((tx >> 5) & 3) + (lane >> 2);
  float s0 = 0.f, s1 = 0.f;
  #pragma unroll
  for (int n = 0; n < N / 8; ++n) {
    s0 += x[4 * n] + x[4 * n + 1];
    s1 += x[4 * n + 2] + x[4 * n + 3];
  }
  s0 += __shfl_xor_sync(0xffffffffu, s0, 1);
  s1 += __shfl_xor_sync(0xffffffffu, s1, 1);
  s0 += __shfl_xor_sync(0xffffffffu, s0, 2);
  s1 += __shfl_xor_sync(0xffffffffu, s1, 2);
  if ((lane & 3) == 0) {
    part[r0] = s0;
    part[r0 + 8] = s1;
  }
}
"""

# chunk_bwd: dv rows from the state warpgroups' dv^T [V, BT] fp32 accumulator (32 values per thread, the layout above
# with the warp index running over all state warps: register 4 n + 2 h + e holds v = 16 warp + 8 h + lane / 4,
# t = 8 n + 2 (lane % 4) + e) to dst[t * pitch + v] (dst: the chunk's first row at the value head) for t < rows, in
# v's dtype. One 64-bit base, 32-bit offsets: the element-wise TileLang store spent ~40 registers on int64 indices.
STORE_DVT_PRELUDE = r"""
template <bool kHalf>
__device__ __forceinline__ void fd_store_dvt(const float* x, void* dst, int pitch, int rows, int tx) {
  unsigned short* const d = static_cast<unsigned short*>(dst);
  const int lane = tx & 31, v0 = 16 * (tx >> 5) + (lane >> 2), t0 = 2 * (lane & 3);
  #pragma unroll
  for (int n = 0; n < 8; ++n) {
    #pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int t = 8 * n + t0 + e;
      if (t < rows) {
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
          unsigned short r;
          if constexpr (kHalf) {
            asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(x[4 * n + 2 * h + e]));
          } else {
            asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(x[4 * n + 2 * h + e]));
          }
          d[t * pitch + v0 + 8 * h] = r;
        }
      }
    }
  }
}
"""
STORE_DVT = {"bfloat16": "fd_store_dvt<false>", "float16": "fd_store_dvt<true>"}

# chunk_bwd: rows [0, rows) of one warpgroup's [64, N] fp32 wgmma accumulator (register 4 n + 2 h + e holds row
# 16 warp + 8 h + lane / 4, column 8 n + 2 (lane % 4) + e) to dst[row * pitch + column], each pair of columns as one
# store: float2 (`fd_store_acc<N, 0>`), or rounded to bf16x2 (`<N, 1>`) or f16x2 (`<N, 2>`) with cvt.rn, or so
# rounded and added into dst (`<N, 3>` bf16x2, `<N, 4>` f16x2: red.global.add.noftz, round to nearest; the GVA
# group sum of two value heads into a zeroed dq or dk, exact in either order: 0 + a + b = round(a + b)) (dst: the
# chunk's first row; a warpgroup of a multi-warpgroup product passes its own first column); one 64-bit base,
# 32-bit offsets.
STORE_ACC_PRELUDE = r"""
template <int N, int kOut>
__device__ __forceinline__ void fd_store_acc(const float* x, void* dst, int pitch, int rows, int tx) {
  const int lane = tx & 31, r0 = 16 * ((tx >> 5) & 3) + (lane >> 2), c0 = 2 * (lane & 3);
  #pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = r0 + 8 * h;
    if (r < rows) {
      #pragma unroll
      for (int n = 0; n < N / 8; ++n) {
        const float a = x[4 * n + 2 * h], b = x[4 * n + 2 * h + 1];
        const int o = r * pitch + 8 * n + c0;
        if constexpr (kOut == 0) {
          *reinterpret_cast<float2*>(static_cast<float*>(dst) + o) = make_float2(a, b);
        } else {
          unsigned p;
          if constexpr (kOut == 1 || kOut == 3) {
            asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(p) : "f"(b), "f"(a));
          } else {
            asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(p) : "f"(b), "f"(a));
          }
          unsigned* const d = reinterpret_cast<unsigned*>(static_cast<unsigned short*>(dst) + o);
          if constexpr (kOut == 3) {
            asm volatile("red.global.add.noftz.bf16x2 [%0], %1;" :: "l"(d), "r"(p) : "memory");
          } else if constexpr (kOut == 4) {
            asm volatile("red.global.add.noftz.f16x2 [%0], %1;" :: "l"(d), "r"(p) : "memory");
          } else {
            *d = p;
          }
        }
      }
    }
  }
}
"""
STORE_ACC = {"float32": 0, "bfloat16": 1, "float16": 2}     # fd_store_acc's kOut per destination dtype
STORE_ACC_ADD = {"bfloat16": 3, "float16": 4}               # kOut that adds into the destination (red.global.add)

# fused_fwd: the store warp's o rows [0, rows) of the staging buffer (128-byte rows, `src_pitch` bytes apart)
# to global rows `dst_pitch` bytes apart: 8 lanes per row, 4 rows per step, one 16-byte load and store per lane and
# step, addresses by adds. (The TileLang loop it replaces spent its time on 64-bit index arithmetic and bounds
# predicates; one cp.async.bulk per row was much slower, ~43 ns per copy; a TMA tensor store per chunk was 1% slower
# than this loop: docs/fused_fwd.md, "Tried".)
STORE_ROWS_PRELUDE = r"""
__device__ __forceinline__ void fd_store_rows(void* dst, const void* src, int rows, long long dst_pitch,
                                              int src_pitch, int lane) {
  const int c = lane & 7;
  const unsigned s0 = static_cast<unsigned>(__cvta_generic_to_shared(src));
  char* const d0 = static_cast<char*>(dst) + c * 16;
  #pragma unroll 2
  for (int r = lane >> 3; r < rows; r += 4) {
    const unsigned s = s0 + r * src_pitch + c * 16;
    unsigned x0, x1, x2, x3;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(x0), "=r"(x1), "=r"(x2), "=r"(x3) : "r"(s)
                 : "memory");
    asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" :: "l"(d0 + r * dst_pitch), "r"(x0), "r"(x1), "r"(x2),
                 "r"(x3) : "memory");
  }
}
"""

# prepare_fwd: one warp inverts one value head's unit lower triangular 64x64 matrix
#   M = I + strictly_lower(diag(beta) L),  L = K K^T (symmetric, fp32 accumulated, unscaled),
# with no CTA barrier. 16x16 blocks: level 0, the diagonal blocks D_b = M_bb^{-1} by right-looking forward
# substitution (fp32; lane = one column of blocks hb and 2 + hb); then, row block by row block, the transposed
# block substitution U_ij = A_ij^T = (sum_{m=j}^{i-1} U_mj L_mi) (-D_i diag(beta_i))^T on mma.m16n8k16 with bf16
# hi/lo splits of both operands (hi*hi + hi*lo + lo*hi, fp32 accumulate, ~1e-6 relative). Working with the
# transposes keeps every intermediate in registers: an mma accumulator pair is the next product's A operand, L's
# symmetry turns L_mi into an ldmatrix of the stored lower block (i, m), and (D_i diag)^T as a B operand is read
# from the level-0 scratch (held transposed). Each finished row block of A goes through a 16-row strip
# (stmatrix.trans of U) to global memory.
#   lhi, llo: 16-bit [48][WY_LP]: rows 16..63, cols 0..47 of L as bf16 hi/lo (only the blocks i > m are read).
#   kkd: fp32 [4][16][17]: L's diagonal blocks.  beta + i * beta_stride: beta of row i (0 past the end).
#   ws_a, ws_b: the warps' workspaces, WY_WS_FLOATS floats each (16-byte aligned): warp w < n_a uses the w-th of
#   ws_a, the others the (w - n_a)-th of ws_b (the kernel hosts ws_a in the dead key tile). A workspace holds the
#   D_b^T scratch fp32 [4][16][20], then the strip [16][72] in A's dtype.
#   a_out: the global A row of the chunk's first token for this value head; rows are a_pitch elements apart; rows
#   >= `rows` are not written.  active: false = the warp has no head (it returns).  tid: the thread's CTA index.
# Measured: prepare 0.31 -> 0.19 ms at 16/64 1x32k against the CTA-wide levels it replaced; reading level 0's blocks
# by 16-byte rows instead of elements made no difference (docs/fused_fwd.md, "The prepare kernel").
WY_LP = 56
WY_WS_FLOATS = 4 * 16 * 20 + 16 * 72 // 2
WY_INVERSE_PRELUDE = PACK2_PRELUDE + r"""
constexpr int kFdWyWs = """ + str(WY_WS_FLOATS) + r""";
// hi/lo bf16 pairs of (x0, x1): x = hi + lo to ~16 significant bits
__device__ __forceinline__ void fd_wy_split2(float x0, float x1, unsigned& hi, unsigned& lo) {
  hi = fd_pack2<false>(x0, x1);
  lo = fd_pack2<false>(x0 - __uint_as_float(hi << 16), x1 - __uint_as_float(hi & 0xffff0000u));
}
__device__ __forceinline__ void fd_wy_mma(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// A 16x16 operand in hi/lo parts: the A fragment (4 registers), or the B fragments of both n8 halves ([t][2])
struct FdWyA { unsigned hi[4], lo[4]; };
struct FdWyB { unsigned hi[2][2], lo[2][2]; };
// acc (two n8 accumulators of a 16x16 product) += a @ b, hi*hi + hi*lo + lo*hi
__device__ __forceinline__ void fd_wy_mma3(float (&acc)[2][4], const FdWyA& a, const FdWyB& b) {
  #pragma unroll
  for (int t = 0; t < 2; ++t) {
    fd_wy_mma(acc[t], a.hi, b.hi[t][0], b.hi[t][1]);
    fd_wy_mma(acc[t], a.hi, b.lo[t][0], b.lo[t][1]);
    fd_wy_mma(acc[t], a.lo, b.hi[t][0], b.hi[t][1]);
  }
}
// an accumulator pair as the next product's A operand (the m16n8 accumulator layout of two n8 halves is the
// m16k16 A layout)
__device__ __forceinline__ FdWyA fd_wy_as_a(const float (&acc)[2][4]) {
  FdWyA a;
  fd_wy_split2(acc[0][0], acc[0][1], a.hi[0], a.lo[0]);
  fd_wy_split2(acc[0][2], acc[0][3], a.hi[1], a.lo[1]);
  fd_wy_split2(acc[1][0], acc[1][1], a.hi[2], a.lo[2]);
  fd_wy_split2(acc[1][2], acc[1][3], a.hi[3], a.lo[3]);
  return a;
}
__device__ __forceinline__ void fd_wy_ldsm4(unsigned (&r)[4], unsigned addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr) : "memory");
}
// B fragments of L_mi (k = block m, n = block i) = rows of the stored lower block (i, m): L is symmetric
__device__ __forceinline__ FdWyB fd_wy_load_l(unsigned lhi, unsigned llo, int i, int m, int lane) {
  const int mi = lane >> 3;
  const unsigned off = 2u * ((16 * (i - 1) + 8 * (mi >> 1) + (lane & 7)) * """ + str(WY_LP) + r""" + 16 * m + 8 * (mi & 1));
  unsigned h[4], l[4];
  fd_wy_ldsm4(h, lhi + off);
  fd_wy_ldsm4(l, llo + off);
  FdWyB b;
  #pragma unroll
  for (int t = 0; t < 2; ++t) {
    b.hi[t][0] = h[2 * t]; b.hi[t][1] = h[2 * t + 1];
    b.lo[t][0] = l[2 * t]; b.lo[t][1] = l[2 * t + 1];
  }
  return b;
}
// U (16x16, two accumulators) -> strip rows [0, 16) x cols [16 j, 16 j + 16) as A = U^T (stmatrix .trans)
template <bool kHalf>
__device__ __forceinline__ void fd_wy_store_t(const float (&u)[2][4], unsigned strip, int j, int lane) {
  const int mi = lane >> 3;
  const unsigned addr = strip + 2u * ((8 * (mi >> 1) + (lane & 7)) * 72 + 16 * j + 8 * (mi & 1));
  asm volatile("stmatrix.sync.aligned.x4.trans.m8n8.shared.b16 [%0], {%1, %2, %3, %4};"
               :: "r"(addr), "r"(fd_pack2<kHalf>(u[0][0], u[0][1])), "r"(fd_pack2<kHalf>(u[0][2], u[0][3])),
                  "r"(fd_pack2<kHalf>(u[1][0], u[1][1])), "r"(fd_pack2<kHalf>(u[1][2], u[1][3]))
               : "memory");
}
template <bool kHalf>
__device__ __forceinline__ void fd_wy_inverse_warp(const void* lhi_p, const void* llo_p, const float* kkd,
                                                   const float* beta, int beta_stride, void* ws_a, int n_a,
                                                   void* ws_b, void* a_out, long long a_pitch, int rows,
                                                   bool active, int tid) {
  if (!active) return;
  const int lane = tid & 31, warp = tid >> 5;
  float* const ws = warp < n_a ? static_cast<float*>(ws_a) + warp * kFdWyWs
                               : static_cast<float*>(ws_b) + (warp - n_a) * kFdWyWs;
  constexpr int SP = 20;                       // scratch row length (floats): conflict-free row writes, column reads
  const int g = lane >> 2, q = lane & 3;
  // level 0: lane owns column c of D_hb and of D_{2+hb}; s accumulates sum_{m<r} L[r][m] x[m] (right-looking)
  {
    const int c = lane & 15, hb = lane >> 4;
    const float* l0 = kkd + hb * 16 * 17;
    const float* l1 = kkd + (2 + hb) * 16 * 17;
    const float* be0 = beta + (16 * hb) * beta_stride;
    const float* be1 = beta + (16 * (2 + hb)) * beta_stride;
    float s0[16], s1[16], x0[16], x1[16];
    #pragma unroll
    for (int r = 0; r < 16; ++r) { s0[r] = 0.f; s1[r] = 0.f; }
    #pragma unroll
    for (int m = 0; m < 16; ++m) {
      const float e = m == c ? 1.f : 0.f;
      x0[m] = e - be0[m * beta_stride] * s0[m];
      x1[m] = e - be1[m * beta_stride] * s1[m];
      #pragma unroll
      for (int r = m + 1; r < 16; ++r) {
        s0[r] = fmaf(l0[r * 17 + m], x0[m], s0[r]);
        s1[r] = fmaf(l1[r * 17 + m], x1[m], s1[r]);
      }
    }
    // scratch[b][c][r] = D_b[r][c] (D_b^T)
    float4* w0 = reinterpret_cast<float4*>(ws + (hb * 16 + c) * SP);
    float4* w1 = reinterpret_cast<float4*>(ws + ((2 + hb) * 16 + c) * SP);
    #pragma unroll
    for (int r = 0; r < 4; ++r) {
      w0[r] = make_float4(x0[4 * r], x0[4 * r + 1], x0[4 * r + 2], x0[4 * r + 3]);
      w1[r] = make_float4(x1[4 * r], x1[4 * r + 1], x1[4 * r + 2], x1[4 * r + 3]);
    }
  }
  __syncwarp();
  const unsigned lhi = static_cast<unsigned>(__cvta_generic_to_shared(lhi_p));
  const unsigned llo = static_cast<unsigned>(__cvta_generic_to_shared(llo_p));
  const unsigned strip = static_cast<unsigned>(__cvta_generic_to_shared(ws + 4 * 16 * SP));
  FdWyA U[4][3];                               // U[m][j] = A_mj^T, hi/lo A fragments (j < 3, m < 3)
  #pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float* sc = ws + i * 16 * SP;        // D_i^T
    // diagonal block: U_ii = D_i^T
    float d[2][4];
    #pragma unroll
    for (int t = 0; t < 2; ++t) {
      d[t][0] = sc[g * SP + 8 * t + 2 * q];
      d[t][1] = sc[g * SP + 8 * t + 2 * q + 1];
      d[t][2] = sc[(g + 8) * SP + 8 * t + 2 * q];
      d[t][3] = sc[(g + 8) * SP + 8 * t + 2 * q + 1];
    }
    if (i < 3) U[i][i] = fd_wy_as_a(d);
    fd_wy_store_t<kHalf>(d, strip, i, lane);
    if (i > 0) {
      // B operand (-D_i diag(beta_i))^T: B[k][n] = -beta_k D_i[n][k] = -beta_k sc[k][n], n = 8 t + g
      FdWyB db;
      #pragma unroll
      for (int t = 0; t < 2; ++t) {
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int k0 = 8 * h + 2 * q;
          const float v0 = -beta[(16 * i + k0) * beta_stride] * sc[k0 * SP + 8 * t + g];
          const float v1 = -beta[(16 * i + k0 + 1) * beta_stride] * sc[(k0 + 1) * SP + 8 * t + g];
          fd_wy_split2(v0, v1, db.hi[t][h], db.lo[t][h]);
        }
      }
      FdWyB lb[3];
      #pragma unroll
      for (int m = 0; m < i; ++m) lb[m] = fd_wy_load_l(lhi, llo, i, m, lane);
      #pragma unroll
      for (int j = 0; j < i; ++j) {
        float s[2][4] = {};
        #pragma unroll
        for (int m = j; m < i; ++m) fd_wy_mma3(s, U[m][j], lb[m]);
        float u[2][4] = {};
        fd_wy_mma3(u, fd_wy_as_a(s), db);
        if (i < 3) U[i][j] = fd_wy_as_a(u);
        fd_wy_store_t<kHalf>(u, strip, j, lane);
      }
    }
    // the strip's blocks right of the diagonal are zero
    if (i < 3) {
      const int per_row = 2 * (3 - i);         // 16-byte pieces per strip row right of block i
      #pragma unroll
      for (int z = lane; z < 16 * per_row; z += 32) {
        *reinterpret_cast<uint4*>(reinterpret_cast<char*>(ws + 4 * 16 * SP) + (z / per_row) * 144 +
                                  32 * (i + 1) + 16 * (z % per_row)) = make_uint4(0u, 0u, 0u, 0u);
      }
    }
    __syncwarp();
    // rows 16 i .. 16 i + 15 to global: 8 lanes per 128-byte row, 4 rows per step
    #pragma unroll
    for (int r = lane >> 3; r < 16; r += 4) {
      if (16 * i + r < rows) {
        const uint4 x = *reinterpret_cast<const uint4*>(reinterpret_cast<const char*>(ws + 4 * 16 * SP) +
                                                        r * 144 + (lane & 7) * 16);
        *reinterpret_cast<uint4*>(static_cast<char*>(a_out) + 2 * ((16 * i + r) * a_pitch) + (lane & 7) * 16) = x;
      }
    }
    __syncwarp();
  }
}
"""
WY_INVERSE = {"bfloat16": "fd_wy_inverse_warp<false>", "float16": "fd_wy_inverse_warp<true>"}

# prepare_fwd's producer warp (the persistent kernel, `prepare_pipe`): whole-warp helpers, every lane calls them.
# fd_find_seq: the last sequence n in [0, n_seqs] with cu[n] / bt + n <= slot (the chunk-slot numbering of
# kernels/_chunks.py), by a 32-way search per step (one step for up to 31 sequences).
# fd_gate_cumsum<G>: the inclusive cumsums of G adjacent value heads' gate columns over a chunk, rows [0, rows) read
# from g and written to gc (rows `pitch` floats apart), two rows per lane and a shuffle scan; zeros when `zero`.
# Gates below numerics.GATE_FLOOR count as the floor (docs/numerics.md; NaN stays NaN).
PRODUCER_PRELUDE = r"""
__device__ __forceinline__ int fd_find_seq(const int* cu, int slot, int n_seqs, int bt, int lane) {
  int lo = 0, width = n_seqs + 1;
  while (width > 1) {
    const int stride = (width + 31) >> 5;
    const int idx = lo + lane * stride;
    const bool ok = idx < lo + width && cu[idx] / bt + idx <= slot;
    const int cnt = __popc(__ballot_sync(0xffffffffu, ok));
    lo += (cnt - 1) * stride;
    width = min(stride, width - (cnt - 1) * stride);
  }
  return lo;
}
__device__ __forceinline__ float fd_gate_floor(float x) { return x < """ + f"{GATE_FLOOR!r}f" + r""" ? """ + f"{GATE_FLOOR!r}f" + r""" : x; }
// the inclusive cumsum over rows [0, 64) of G columns held two rows per lane (x0: row lane, x1: row lane + 32) by a
// shuffle scan, rows [0, rows) written to gc (rows `pitch` floats apart)
template <int G>
__device__ __forceinline__ void fd_scan64_store(float (&x0)[G], float (&x1)[G], float* gc, long long pitch, int rows,
                                                int lane) {
  #pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    #pragma unroll
    for (int j = 0; j < G; ++j) {
      const float y0 = __shfl_up_sync(0xffffffffu, x0[j], d);
      const float y1 = __shfl_up_sync(0xffffffffu, x1[j], d);
      if (lane >= d) { x0[j] += y0; x1[j] += y1; }
    }
  }
  #pragma unroll
  for (int j = 0; j < G; ++j) {
    x1[j] += __shfl_sync(0xffffffffu, x0[j], 31);
    if (lane < rows) gc[lane * pitch + j] = x0[j];
    if (lane + 32 < rows) gc[(lane + 32) * pitch + j] = x1[j];
  }
}
// the G value heads of an item at once (g, gc point at head 0; heads are adjacent): every load issued first
template <int G>
__device__ __forceinline__ void fd_gate_cumsum(const float* g, float* gc, long long pitch, int rows, bool zero,
                                               int lane) {
  float x0[G], x1[G];
  #pragma unroll
  for (int j = 0; j < G; ++j) {
    x0[j] = !zero && lane < rows ? fd_gate_floor(g[lane * pitch + j]) : 0.f;
    x1[j] = !zero && lane + 32 < rows ? fd_gate_floor(g[(lane + 32) * pitch + j]) : 0.f;
  }
  fd_scan64_store<G>(x0, x1, gc, pitch, rows, lane);
}
"""
