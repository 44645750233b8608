"""Inline CUDA/PTX that the TileLang kernels prepend to their source (T.Kernel prelude) and call with
T.call_extern. A prelude precedes TileLang's own includes, so only builtins and inline PTX appear here.
"""

# Development timelines (fused_fwd / prepare `profile=True` builds): prepended to the kernel source (T.Kernel prelude)
# only when profiling. forceinline, so no call boundary sits between wgmma instructions; "memory" clobbers keep
# shared/global accesses from moving across a timer read. fd_prof_stamp writes %clock64 (the SM's cycle counter)
# to buf[idx] when `on`; fd_prof_cal writes a %clock64/%globaltimer pair (cycles -> ns) to buf[idx], buf[idx + 1].
PROF_PRELUDE = r"""
__device__ __forceinline__ void fd_prof_stamp(void* buf, int idx, bool on) {
  if (on) {
    long long t;
    asm volatile("mov.u64 %0, %%clock64;" : "=l"(t) :: "memory");
    static_cast<long long*>(buf)[idx] = t;
  }
}
__device__ __forceinline__ void fd_prof_cal(void* buf, int idx, bool on) {
  if (on) {
    long long t, g;
    asm volatile("mov.u64 %0, %%clock64;" : "=l"(t) :: "memory");
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(g) :: "memory");
    static_cast<long long*>(buf)[idx] = t;
    static_cast<long long*>(buf)[idx + 1] = g;
  }
}
"""


# Always prepended: O^T (the state WG's [BV, BT] fp32 wgmma accumulator, 32 values per thread) -> o_s[t, v] as
# bf16/fp16, transposed by stmatrix. Thread tx of the warpgroup holds O^T[v, t] for v = 16 warp + 8 h + lane / 4,
# t = 8 n + 2 (lane % 4) + e at register 4 n + 2 h + e (the wgmma m64 accumulator layout); register pairs (e = 0, 1)
# are one packed conversion, and each 8x8 (v, t) block is one stmatrix .trans matrix whose rows land on o_s rows t.
# o_s rows are `ld` elements apart (padded: the transposed writes are conflict-free).
STAGE_O_PRELUDE = r"""
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

# Always prepended: the store warp's o rows [0, rows) of the staging buffer (128-byte rows, `src_pitch` bytes apart)
# to global rows `dst_pitch` bytes apart: 8 lanes per row, 4 rows per step, one 16-byte load and store per lane and
# step, addresses by adds. (The TileLang loop it replaces spent its time on 64-bit index arithmetic and bounds
# predicates; one cp.async.bulk per row was much slower, ~43 ns per copy; a TMA tensor store per chunk was 1% slower
# than this loop: NOTES-gpu.md session 4.)
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

# Prepended with the fused kernel's `prefetch` switch: the load warp asks L2 for the 128-byte lines of the next
# chunk's q/k tile rows [0, rows) (`row_bytes` each, `pitch` bytes apart) a loop iteration before its TMA copies, so the
# copies that follow hit L2 (NOTES-gpu.md session 5: the prep warpgroup waits on the q/k loads in the plain build).
# Rows past the tensor's end are never touched (the caller clamps `rows`).
PREFETCH_ROWS_PRELUDE = r"""
__device__ __forceinline__ void fd_prefetch_rows(const void* base, int rows, long long pitch, int row_bytes,
                                                 int lane) {
  const int lines = (row_bytes + 127) >> 7;
  const char* const p = static_cast<const char*>(base);
  for (int i = lane; i < rows * lines; i += 32) {
    asm volatile("prefetch.global.L2 [%0];" :: "l"(p + (i / lines) * pitch + (i % lines) * 128));
  }
}
"""
