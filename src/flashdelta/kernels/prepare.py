"""Stage `prepare`: chunk-local gate cumsum and the ungated WY inverse (forward), reverse gate cumsum (backward).

Forward, one launch: a CTA per (chunk slot, key head) loads the chunk's keys once, computes `K K^T` with
wgmma (fp32 accumulate) and, for each of the `HV / H` value heads of the group (on small grids the launcher
splits them over 2 or HV / H CTAs, `pick_heads_per_cta`, each repeating the load and K K^T),

    A = (I + strictly_lower(diag(beta) K K^T))^{-1}                    # [BT, BT], BT = 64

by blocks. K K^T is kept in shared memory unscaled, once per CTA; beta scales rows on the fly.
  - level 0: the four 16x16 diagonal blocks `D_b` by forward substitution (fp32, one column per thread);
  - level 1: the lower-left 16x16 block of each 32x32 half, `-D_2p+1 diag(beta) K21_p D_2p`, both halves in
    one stacked [32, 16] @ [16, 32] product pair on mma;
  - level 2: the lower-left 32x32 block, `-D2^{-1} diag(beta) C D1^{-1}`, two [32, 32] products on mma.
The tensor-core products run on bf16 hi/lo splits of the fp32 operands (hi*hi + hi*lo + lo*hi, ~1e-6
relative), far below the rounding of the stored A: measured A error equals the bf16 (fp16) rounding of the
float64 inverse. The same CTA writes the chunk-local inclusive cumsum of g for those value heads.

Chunks are aligned to sequence starts. Chunk slots map to (sequence, chunk) on the device, without host
synchronisation: chunk `c` of sequence `n` (tokens `[bos, eos)`) owns slot `bos // BT + n + c`. These slot
numbers increase strictly along the token axis and stay below `T // BT + N + 1`, so a CTA finds its sequence
by searching `cu_seqlens` for the last `n` with `cu_seqlens[n] // BT + n <= slot` (128-way per step, one
step for up to 127 sequences); slots that fall past a sequence's last chunk exit. The padding tail
`[cu_seqlens[-1], T)` is treated as sequence `N`, whose chunks write zeros to `g_cumsum` and `A`.
"""
# No `from __future__ import annotations`: TileLang evaluates the prim_func annotations in this scope.
import functools
from typing import Optional

import tilelang
import tilelang.language as T
import torch

from . import _ptx, _tl

F32 = "float32"
BF16 = "bfloat16"
THREADS = 128              # one warpgroup: the M = 64 wgmma for K K^T
SUPPORTED_K = (64, 128, 256)
A_IN_K = True              # the launcher's build: A assembled in the key tile (see _build_prepare_fwd)
MIN_BLOCKS = 4             # CTAs per SM the registers must allow (5 fit in shared memory, measured slower)
# Let the next kernel on the stream launch as soon as every CTA of this one has started (programmatic dependent
# launch; the fused forward waits for this kernel's completion in T.pdl_sync before reading anything). Off until
# measured on a GPU, with fused_fwd.PDL_SYNC.
PDL_TRIGGER = False
# Level 0 in two steps (off until measured on a GPU): warps 0-1 run the forward substitutions into an fp32 shared
# tile, then all four warps split it into the bf16 hi/lo tiles with packed stores. ncu (NOTES-gpu.md session 5):
# level 0 is a third of the kernel's instructions, mostly the 64 scalar hi/lo stores per thread, while warps 2-3 wait
# at the barrier after it.
L0_SPLIT = False
# Each warp inverts one value head on its own (`_ptx.WY_INVERSE_PRELUDE`: level 0 by substitution, then a block
# substitution on mma.sync with hi/lo splits, no CTA barrier), four heads at a time, instead of the CTA walking the
# heads one after another through barrier-separated levels (ncu, NOTES-gpu.md session 5: barriers and shared-memory
# round trips bound the level phases). Off until measured on a GPU.
WARP_INVERSE = False
# the builder's trailing parameters, in order: `builder_args` ends with the launcher's values, `build_fwd` overrides
KNOBS = ("heads_per_cta", "min_blocks", "skip", "profile", "a_in_k", "pdl", "l0_split", "warp_inverse")
# profile=True builds (development): sampled CTAs and their phase-end events (thread 0, %clock64); "m." entries are
# clock64/globaltimer pairs at the CTA's start and end; "h." events repeat for value heads j < PROF_HEADS
PROF_SLOTS = 64
PROF_HEADS = 4
HEAD_EVENTS = ("h.l0", "h.l1", "h.l2", "h.stored")
PROF_EVENTS = ("m.clk0", "m.gt0", "m.clk1", "m.gt1", "m.t0", "found", "loaded", "kkt", "split", "cumsum") + \
    HEAD_EVENTS + tuple(f"h{j}.{e[2:]}" for j in range(1, PROF_HEADS) for e in HEAD_EVENTS)
PROF_INDEX = {name: i for i, name in enumerate(PROF_EVENTS)}


def _hi(x):
    """bf16 part of an fp32 value (round to nearest)."""
    return T.cast(x, BF16)


def _lo(x):
    """bf16 rounding of what `_hi` leaves: hi + lo carries ~16 significant bits."""
    return T.cast(x - T.cast(T.cast(x, BF16), F32), BF16)


@T.macro
def _gemm_hilo(a_hi, a_lo, b_hi, b_lo, out):
    """out = a @ b on bf16 mma from hi/lo splits: hi*hi + hi*lo + lo*hi (fp32 accumulate, ~1e-6 relative)."""
    T.gemm(a_hi, b_hi, out, clear_accum=True)
    T.gemm(a_hi, b_lo, out)
    T.gemm(a_lo, b_hi, out)


_TORCH_TO_TL = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32",
                torch.float64: "float64"}


@T.macro
def _find_chunk(cu_seqlens, i_s, n_seqs, n_tok, tid, BT: int, chunk):
    """Fills `chunk` (a local int32[3]) for chunk slot `i_s` with the sequence (0..N; N = padding tail), the
    chunk's first token and its sequence's end; the slot is idle when `chunk[1] >= chunk[2]`."""
    width = T.alloc_var("int32", init=n_seqs + 1)
    chunk[0] = 0
    while width > 1:
        stride = T.ceildiv(width, THREADS)
        idx = chunk[0] + tid * stride
        # slots of sequence n start at cu_seqlens[n] // BT + n, strictly increasing in n
        cnt = T.syncthreads_count(idx < chunk[0] + width and cu_seqlens[idx] // BT + idx <= i_s)
        chunk[0] = chunk[0] + (cnt - 1) * stride
        width = T.min(stride, width - (cnt - 1) * stride)
    bos = cu_seqlens[chunk[0]]
    chunk[1] = bos + (i_s - bos // BT - chunk[0]) * BT
    chunk[2] = T.if_then_else(chunk[0] < n_seqs, cu_seqlens[chunk[0] + 1], n_tok)


@tilelang.jit(target=_tl.SM90_TARGET, pass_configs=_tl.PASS_CONFIGS)
def _build_prepare_fwd(HV: int, H: int, K: int, BT: int = 64, k_dtype: str = BF16, beta_dtype: str = F32,
                       heads_per_cta: int = 0, min_blocks: int = 4, skip: int = 0, profile: bool = False,
                       a_in_k: bool = False, pdl: bool = False, l0_split: bool = False,
                       warp_inverse: bool = False):
    """heads_per_cta: value heads each CTA inverts (a divisor of HV / H; 0 = all of its key head's). Fewer give
    more, shorter CTAs (each loads the key tile and forms K K^T itself): the launcher takes them when the grid is
    small (`pick_heads_per_cta`).
    a_in_k=True assembles each value head's A tile in the key tile's shared memory (dead after K K^T): ~9 KB
    less per CTA, and A's fragment-order writes and row reads go through the key tile's wgmma swizzle (measured
    7% faster at TP1 32k; NOTES-gpu.md). pdl: see `PDL_TRIGGER`; l0_split: see `L0_SPLIT`; warp_inverse: see
    `WARP_INVERSE` (a_in_k, l0_split and skip do not apply to it). `min_blocks` bounds the
    registers (5 CTAs per SM fit then; slower).
    skip > 0 is a timing experiment only (bench/fwd_variants.py --prepare): it leaves out the last `skip`
    levels of the inverse (3: all of them), so A is wrong. profile=True adds the output
    ``prof [PROF_SLOTS, len(PROF_EVENTS)]`` int64: thread 0 of the CTAs (chunk slot < PROF_SLOTS, key head 0)
    writes %clock64 at each `PROF_EVENTS` phase end (bench/profile_prepare.py reads it)."""
    # problem config
    assert BT == 64 and HV % H == 0 and K in SUPPORTED_K
    G = heads_per_cta or HV // H    # value heads per CTA
    NG = HV // H // G               # CTAs per (chunk slot, key head)
    assert (HV // H) % G == 0
    # beta's shared tile has a power-of-two row (nvcc 13.0's front end crashes on the level-2 code for G = 3)
    GB = 1 << (G - 1).bit_length()
    NW = THREADS // 32              # warp_inverse: value heads inverted at once, one per warp
    n_tok = T.dynamic("T")
    n_seqs = T.dynamic("N")
    # tiling config: 16-row diagonal blocks, 32-row halves; min_blocks CTAs per SM bounds the registers
    B16, B32 = 16, 32

    prof_t = T.Tensor((PROF_SLOTS, len(PROF_EVENTS)), "int64") if profile else None
    prelude = ((_ptx.WY_INVERSE_PRELUDE if warp_inverse else "") + (_ptx.PROF_PRELUDE if profile else "")) or None

    def stamper(prof, i_s, i_h, tid):
        """stamp(event) -> the timer call (profile=True) or None (nothing reaches the kernel)."""
        def stamp(ev, head=None, cal=False):
            if not profile:
                return None
            on = (tid == 0) & (i_h == 0) & (i_s < PROF_SLOTS)
            idx = T.min(i_s, PROF_SLOTS - 1) * len(PROF_EVENTS) + PROF_INDEX[ev]
            if head is not None:   # per value head j < PROF_HEADS: events h.* repeat every len(HEAD_EVENTS)
                on = on & (head < PROF_HEADS)
                idx = idx + T.min(head, PROF_HEADS - 1) * len(HEAD_EVENTS)
            return T.call_extern("handle", "fd_prof_cal" if cal else "fd_prof_stamp", prof.data, idx, on)
        return stamp

    @T.prim_func
    def prepare_fwd_kernel(
        k: T.Tensor((1, n_tok, H, K), k_dtype),
        g: T.Tensor((1, n_tok, HV), F32),
        beta: T.Tensor((1, n_tok, HV), beta_dtype),
        cu_seqlens: T.Tensor((n_seqs + 1,), "int32"),
        g_cumsum: T.Tensor((1, n_tok, HV), F32),
        A: T.Tensor((1, n_tok, HV, BT), k_dtype),
        prof: prof_t,
    ):
        with T.Kernel(n_tok // BT + n_seqs + 1, H * NG, threads=THREADS, prelude=prelude) as (i_s, i_y):
            T.annotate_min_blocks_per_sm(min_blocks)
            if pdl:
                T.pdl_trigger()
            tid = T.get_thread_binding()
            i_h = i_y // NG                 # key head
            hv0 = i_y * G                   # first value head: key head i_h owns value heads [i_h, i_h + 1) * G * NG
            stamp = stamper(prof, i_s, i_y, tid)
            stamp("m.clk0", cal=True)
            chunk = T.alloc_local((3,), "int32")
            _find_chunk(cu_seqlens, i_s, n_seqs, n_tok, tid, BT, chunk)
            stamp("found")
            if profile:
                # an ordinary TIR store, so TileLang passes `prof` as a writable pointer; the chunk's first token
                if (tid == 0) & (i_y == 0) & (i_s < PROF_SLOTS):
                    prof[i_s, PROF_INDEX["m.t0"]] = T.cast(chunk[1], "int64")
            seq, t0, eos = chunk[0], chunk[1], chunk[2]

            k_shared = T.alloc_shared((BT, K), k_dtype)
            kk_frag = T.alloc_fragment((BT, BT), F32)
            g_shared = T.alloc_shared((BT, G + 1), F32)    # +1: the column scan's strided reads
            beta_shared = T.alloc_shared((BT, GB), F32)
            # K K^T pieces, unscaled (beta scales rows per value head), written once per CTA:
            # the four 16x16 diagonal blocks (fp32; a pad column keeps 16-row column reads off one bank),
            # the two level-1 blocks stacked, rows 16:32 x cols 0:16 over rows 48:64 x cols 32:48, and the
            # level-2 block rows 32:64 x cols 0:32, both as bf16 hi/lo
            kkd_shared = T.alloc_shared((4, B16, B16 + 1), F32)
            if warp_inverse:
                # rows 16..63, cols 0..47 of K K^T as bf16 hi/lo (the blocks below the diagonal), rows padded for
                # conflict-free ldmatrix; each warp's workspace (level-0 scratch and the output strip)
                l_hi = T.alloc_shared((BT - B16, _ptx.WY_LP), BF16)
                l_lo = T.alloc_shared((BT - B16, _ptx.WY_LP), BF16)
                # the first NWK workspaces live in the key tile (dead after K K^T), the rest in ws
                NWK = min(NW, BT * K // (2 * _ptx.WY_WS_FLOATS))
                ws = T.alloc_shared((NW - NWK, _ptx.WY_WS_FLOATS), F32) if NWK < NW else k_shared
            if not warp_inverse:  # the CTA-wide levels' buffers
                k1_hi = T.alloc_shared((B32, B16), BF16)
                k1_lo = T.alloc_shared((B32, B16), BF16)
                c_hi = T.alloc_shared((B32, B32), BF16)
                c_lo = T.alloc_shared((B32, B32), BF16)
                # per value head, bf16 hi/lo: the 16x16 diagonal inverses D_0|D_2 side by side and D_1 over D_3,
                # the two 32x32 diagonal inverses, and the scaled products feeding the next level
                de_hi = T.alloc_shared((B16, B32), BF16)
                de_lo = T.alloc_shared((B16, B32), BF16)
                do_hi = T.alloc_shared((B32, B16), BF16)
                do_lo = T.alloc_shared((B32, B16), BF16)
                d1_hi = T.alloc_shared((B32, B32), BF16)
                d1_lo = T.alloc_shared((B32, B32), BF16)
                d2_hi = T.alloc_shared((B32, B32), BF16)
                d2_lo = T.alloc_shared((B32, B32), BF16)
                y1_frag = T.alloc_fragment((B32, B32), F32)
                x1_frag = T.alloc_fragment((B32, B32), F32)
                y_frag = T.alloc_fragment((B32, B32), F32)
                z_frag = T.alloc_fragment((B32, B32), F32)
                # A's tile: the first BT columns of the key tile (K >= BT; its wgmma swizzle keeps fragment-order row
                # writes off one bank), or its own buffer (+8: the same for a plain row-major tile)
                a_shared = k_shared if a_in_k else T.alloc_shared((BT, BT + 8), k_dtype)
                x_local = T.alloc_local((B16,), F32)
                # l0_split: the four 16x16 diagonal inverses in fp32, between the substitution and the hi/lo split
                x0_shared = T.alloc_shared((4, B16, B16), F32) if l0_split else None

            if t0 < eos:
                if seq < n_seqs:
                    for i, d in T.Parallel(BT, K):
                        k_shared[i, d] = T.if_then_else(t0 + i < eos, k[0, t0 + i, i_h, d], 0)
                    for i, j in T.Parallel(BT, G):
                        g_shared[i, j] = T.if_then_else(t0 + i < eos, g[0, t0 + i, hv0 + j], 0)
                        beta_shared[i, j] = T.if_then_else(
                            t0 + i < eos, T.cast(beta[0, t0 + i, hv0 + j], F32), 0)
                    if not warp_inverse:
                        for i, c in T.Parallel(B32, B32):
                            # the upper-right 16x16 block of D2 stays zero for every value head
                            d2_hi[i, c] = 0
                            d2_lo[i, c] = 0
                    # [BT, K] @ [K, BT] -> [BT, BT]
                    stamp("loaded")
                    T.gemm(k_shared, k_shared, kk_frag, transpose_B=True, clear_accum=True)
                    stamp("kkt")
                    if warp_inverse:
                        for i, c in T.Parallel(BT, BT):
                            if i // B16 == c // B16:
                                kkd_shared[i // B16, i % B16, c % B16] = kk_frag[i, c]
                            if c // B16 < i // B16:
                                l_hi[i - B16, c] = _hi(kk_frag[i, c])
                                l_lo[i - B16, c] = _lo(kk_frag[i, c])
                    else:
                        for i, c in T.Parallel(BT, BT):
                            if i // B16 == c // B16:
                                kkd_shared[i // B16, i % B16, c % B16] = kk_frag[i, c]
                            if i // B16 == c // B16 + 1 and (i // B16) % 2 == 1:
                                k1_hi[(i // B32) * B16 + i % B16, c % B16] = _hi(kk_frag[i, c])
                                k1_lo[(i // B32) * B16 + i % B16, c % B16] = _lo(kk_frag[i, c])
                            if i >= B32 and c < B32:
                                c_hi[i - B32, c] = _hi(kk_frag[i, c])
                                c_lo[i - B32, c] = _lo(kk_frag[i, c])
                    stamp("split")
                    T.cumsum(g_shared[:, 0:G], dim=0)
                    for i, j in T.Parallel(BT, G):
                        if t0 + i < eos:
                            g_cumsum[0, t0 + i, hv0 + j] = g_shared[i, j]
                    stamp("cumsum")

                    if warp_inverse:
                        # warp w inverts value heads w, w + NW, ... of this CTA (see `WARP_INVERSE`); every thread
                        # makes the call (no branch around it), a warp without a head returns at once
                        T.sync_threads()
                        warp = tid // 32
                        for rnd in T.serial(T.ceildiv(G, NW)):
                            j = rnd * NW + warp
                            jc = T.min(j, G - 1)
                            T.call_extern("handle", _ptx.WY_INVERSE[k_dtype], T.address_of(l_hi[0, 0]),
                                          T.address_of(l_lo[0, 0]), T.address_of(kkd_shared[0, 0, 0]),
                                          T.address_of(beta_shared[0, jc]), GB, T.address_of(k_shared[0, 0]), NWK,
                                          T.address_of(ws[0, 0]),   # (k_shared when NWK == NW: unused)
                                          T.address_of(A[0, T.cast(t0, "int64"), hv0 + jc, 0]),
                                          T.cast(HV * BT, "int64"), eos - t0, j < G, tid)
                        stamp("h.stored", 0)
                    else:
                        for j in T.serial(G):
                            if skip < 3:
                                # level 0: D_b = (I + strictly_lower(beta K K^T)_bb)^{-1}, one column per thread
                                if tid < 4 * B16:
                                    blk = tid // B16
                                    col = tid % B16
                                    for r in T.unroll(B16):
                                        x_local[r] = 0
                                        for m in T.unroll(r):
                                            x_local[r] = x_local[r] + kkd_shared[blk, r, m] * x_local[m]
                                        x_local[r] = T.if_then_else(r == col, T.float32(1), T.float32(0)) - \
                                            beta_shared[blk * B16 + r, j] * x_local[r]
                                    if l0_split:
                                        for r in T.unroll(B16):
                                            x0_shared[blk, r, col] = x_local[r]
                                    else:
                                        off = (blk % 2) * B16
                                        if blk < 2:
                                            for r in T.unroll(B16):
                                                d1_hi[off + r, off + col] = _hi(x_local[r])
                                                d1_lo[off + r, off + col] = _lo(x_local[r])
                                            if blk == 1:
                                                # upper-right block of D1: zero again (the level-2 product reuses D1)
                                                for r in T.unroll(B16):
                                                    d1_hi[r, B16 + col] = 0
                                                    d1_lo[r, B16 + col] = 0
                                        else:
                                            for r in T.unroll(B16):
                                                d2_hi[off + r, off + col] = _hi(x_local[r])
                                                d2_lo[off + r, off + col] = _lo(x_local[r])
                                        if blk % 2 == 0:
                                            for r in T.unroll(B16):
                                                de_hi[r, (blk // 2) * B16 + col] = _hi(x_local[r])
                                                de_lo[r, (blk // 2) * B16 + col] = _lo(x_local[r])
                                        else:
                                            for r in T.unroll(B16):
                                                do_hi[(blk // 2) * B16 + r, col] = _hi(x_local[r])
                                                do_lo[(blk // 2) * B16 + r, col] = _lo(x_local[r])
                                if l0_split:
                                    # all four warps: hi/lo of D_0..D_3 into D1 / D2 (diagonal blocks; D1's upper-right
                                    # block zeroed again: level 2 overwrites D1) and the level-1 operands
                                    # D_0 | D_2 (de) and D_1 over D_3 (do)
                                    for r, c in T.Parallel(B16, B16):
                                        x_0 = x0_shared[0, r, c]
                                        x_1 = x0_shared[1, r, c]
                                        x_2 = x0_shared[2, r, c]
                                        x_3 = x0_shared[3, r, c]
                                        d1_hi[r, c] = _hi(x_0)
                                        d1_lo[r, c] = _lo(x_0)
                                        d1_hi[r, B16 + c] = 0
                                        d1_lo[r, B16 + c] = 0
                                        d1_hi[B16 + r, B16 + c] = _hi(x_1)
                                        d1_lo[B16 + r, B16 + c] = _lo(x_1)
                                        d2_hi[r, c] = _hi(x_2)
                                        d2_lo[r, c] = _lo(x_2)
                                        d2_hi[B16 + r, B16 + c] = _hi(x_3)
                                        d2_lo[B16 + r, B16 + c] = _lo(x_3)
                                        de_hi[r, c] = _hi(x_0)
                                        de_lo[r, c] = _lo(x_0)
                                        de_hi[r, B16 + c] = _hi(x_2)
                                        de_lo[r, B16 + c] = _lo(x_2)
                                        do_hi[r, c] = _hi(x_1)
                                        do_lo[r, c] = _lo(x_1)
                                        do_hi[B16 + r, c] = _hi(x_3)
                                        do_lo[B16 + r, c] = _lo(x_3)
                            stamp("h.l0", j)
                            if skip < 2:
                                # level 1, both 32x32 halves at once; only the diagonal 16x16 blocks of the
                                # [32, 16] @ [16, 32] products are used (rows 16:32 of half p are chunk rows
                                # 32 p + 16 + i):  Y_p = diag(beta) K21_p D_2p,  X_p = -D_2p+1 Y_p
                                _gemm_hilo(k1_hi, k1_lo, de_hi, de_lo, y1_frag)
                                for i, c in T.Parallel(B32, B32):
                                    if i // B16 == c // B16:
                                        # Y_0 | Y_1 side by side, in place of D_0 | D_2
                                        y_val = y1_frag[i, c] * beta_shared[i + B16 + (i // B16) * B16, j]
                                        de_hi[i % B16, c] = _hi(y_val)
                                        de_lo[i % B16, c] = _lo(y_val)
                                _gemm_hilo(do_hi, do_lo, de_hi, de_lo, x1_frag)
                                for i, c in T.Parallel(B32, B32):
                                    if i // B16 == c // B16:
                                        if i < B16:
                                            d1_hi[B16 + i, c] = _hi(-x1_frag[i, c])
                                            d1_lo[B16 + i, c] = _lo(-x1_frag[i, c])
                                        else:
                                            d2_hi[i, c - B16] = _hi(-x1_frag[i, c])
                                            d2_lo[i, c - B16] = _lo(-x1_frag[i, c])

                            stamp("h.l1", j)
                            if skip < 1:
                                # level 2: lower-left 32x32 block, -D2^{-1} diag(beta) C D1^{-1}
                                # [32, 32] @ [32, 32] -> [32, 32], three times each
                                _gemm_hilo(c_hi, c_lo, d1_hi, d1_lo, y_frag)
                                for i, c in T.Parallel(B32, B32):
                                    a_shared[i, c] = T.cast(T.cast(d1_hi[i, c], F32) + T.cast(d1_lo[i, c], F32), k_dtype)
                                    a_shared[i, B32 + c] = 0
                                    a_shared[B32 + i, B32 + c] = T.cast(
                                        T.cast(d2_hi[i, c], F32) + T.cast(d2_lo[i, c], F32), k_dtype)
                                for i, c in T.Parallel(B32, B32):
                                    # diag(beta) C D1^{-1}, in place of D1^{-1}
                                    y_val = y_frag[i, c] * beta_shared[B32 + i, j]
                                    d1_hi[i, c] = _hi(y_val)
                                    d1_lo[i, c] = _lo(y_val)
                                _gemm_hilo(d2_hi, d2_lo, d1_hi, d1_lo, z_frag)
                                for i, c in T.Parallel(B32, B32):
                                    a_shared[B32 + i, c] = -z_frag[i, c]
                            stamp("h.l2", j)
                            for i, c in T.Parallel(BT, BT):
                                if t0 + i < eos:
                                    A[0, t0 + i, hv0 + j, c] = a_shared[i, c]
                            stamp("h.stored", j)
                else:
                    # padding tail: zeros
                    for i, j in T.Parallel(BT, G):
                        if t0 + i < eos:
                            g_cumsum[0, t0 + i, hv0 + j] = 0
                    if G == GB:
                        for i, j, c in T.Parallel(BT, G, BT):
                            if t0 + i < eos:
                                A[0, t0 + i, hv0 + j, c] = 0
                    else:   # TileLang finds no layout for a (64, G, 64) parallel loop with G = 3
                        for j in T.serial(G):
                            for i, c in T.Parallel(BT, BT):
                                if t0 + i < eos:
                                    A[0, t0 + i, hv0 + j, c] = 0
            stamp("m.clk1", cal=True)

    return prepare_fwd_kernel


@tilelang.jit(target=_tl.SM90_TARGET, pass_configs=_tl.PASS_CONFIGS)
def _build_prepare_bwd(HV: int, BT: int = 64):
    # problem config
    assert BT == 64
    n_tok = T.dynamic("T")
    n_seqs = T.dynamic("N")

    @T.prim_func
    def prepare_bwd_kernel(
        dG: T.Tensor((1, n_tok, HV), F32),
        cu_seqlens: T.Tensor((n_seqs + 1,), "int32"),
        dg: T.Tensor((1, n_tok, HV), F32),
    ):
        with T.Kernel(n_tok // BT + n_seqs + 1, threads=THREADS) as i_s:
            tid = T.get_thread_binding()
            chunk = T.alloc_local((3,), "int32")
            _find_chunk(cu_seqlens, i_s, n_seqs, n_tok, tid, BT, chunk)
            seq, t0, eos = chunk[0], chunk[1], chunk[2]
            dg_shared = T.alloc_shared((BT, HV + 1), F32)  # +1: the column scan's strided reads
            if t0 < eos:
                if seq < n_seqs:
                    for i, h in T.Parallel(BT, HV):
                        dg_shared[i, h] = T.if_then_else(t0 + i < eos, dG[0, t0 + i, h], 0)
                    T.cumsum(dg_shared[:, 0:HV], dim=0, reverse=True)
                    for i, h in T.Parallel(BT, HV):
                        if t0 + i < eos:
                            dg[0, t0 + i, h] = dg_shared[i, h]
                else:
                    for i, h in T.Parallel(BT, HV):
                        if t0 + i < eos:
                            dg[0, t0 + i, h] = 0

    return prepare_bwd_kernel


def _check_cu_seqlens(cu_seqlens: torch.Tensor) -> torch.Tensor:
    return cu_seqlens if cu_seqlens.dtype == torch.int32 else cu_seqlens.to(torch.int32)


def builder_args(H: int, HV: int, K: int, k_dtype: torch.dtype, beta_dtype: torch.dtype,
                 heads_per_cta: int = 0) -> tuple:
    """The `_build_prepare_fwd` arguments (its compile-cache key) for one call; shared with `warmup`.
    heads_per_cta 0 (or HV / H): every value head of a key head in one CTA."""
    return (HV, H, K, 64, _TORCH_TO_TL[k_dtype], _TORCH_TO_TL[beta_dtype], _hpc_key(H, HV, heads_per_cta),
            MIN_BLOCKS, 0, False, A_IN_K, PDL_TRIGGER, L0_SPLIT, WARP_INVERSE)


def _hpc_key(H: int, HV: int, heads_per_cta: int) -> int:
    """The builder's `heads_per_cta` for a split: 0 for all of a key head's value heads (one cache key for both
    spellings)."""
    return 0 if heads_per_cta in (0, HV // H) else int(heads_per_cta)


def heads_per_cta_options(H: int, HV: int) -> tuple:
    """The value-heads-per-CTA splits the launcher may take, most first: HV / H, half of it (if even), 1."""
    G = HV // H
    return tuple(dict.fromkeys(x for x in (G, G // 2 if G % 2 == 0 else G, 1)))


def pick_heads_per_cta(H: int, HV: int, n_tok: int, num_sms: int = 132, chunk_size: int = 64) -> int:
    """Value heads per CTA for a call: the fewest (of `heads_per_cta_options`) that still fit the grid's chunks in
    one wave of `MIN_BLOCKS` CTAs per SM. A CTA inverts its heads one after another, so on a small grid (short
    sequences, few heads: a wave or less) its lifetime is the kernel's time; splitting the heads over more CTAs
    shortens it (each CTA repeats the key tile load and K K^T). Measured: NOTES-gpu.md session 5."""
    chunks = -(-n_tok // chunk_size)
    capacity = MIN_BLOCKS * num_sms
    for hpc in reversed(heads_per_cta_options(H, HV)):
        if chunks * HV // hpc <= capacity:
            return hpc
    return HV // H


def build_fwd(args: tuple, **knobs):
    """The kernel for `builder_args(...)` with some `KNOBS` replaced by name (development variants)."""
    if "heads_per_cta" in knobs:
        knobs = dict(knobs, heads_per_cta=_hpc_key(args[1], args[0], knobs["heads_per_cta"]))
    return _tl.build_with(_build_prepare_fwd, args, KNOBS, knobs)


def prepare_fwd(k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, cu_seqlens: torch.Tensor, *,
                chunk_size: int = 64, heads_per_cta: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunk-local gate cumsum and the per-chunk WY inverse.

    Args:
        k: ``[1, T, H, K]`` bf16/fp16, K in (64, 128, 256).
        g: ``[1, T, HV]`` fp32 log decays.
        beta: ``[1, T, HV]`` any float dtype.
        cu_seqlens: ``[N + 1]`` int32 (int64 is converted on the device).
        heads_per_cta: value heads per CTA, a divisor of HV / H; None: `pick_heads_per_cta(...)` for this call.

    Returns:
        g_cumsum ``[1, T, HV]`` fp32 (0 on padding), and A ``[1, T, HV, BT]`` in k's dtype: token
        ``chunk_start + i`` holds row i of ``(I + strictly_lower(diag(beta) K K^T))^{-1}``.
    """
    _, n_tok, H, K = k.shape
    HV = g.shape[-1]
    assert chunk_size == 64 and K in SUPPORTED_K and HV % H == 0
    assert k.dtype in (torch.bfloat16, torch.float16) and g.dtype == torch.float32
    assert k.is_contiguous() and g.is_contiguous() and beta.is_contiguous()
    cu_seqlens = _check_cu_seqlens(cu_seqlens)
    g_cumsum = _tl.alloc((1, n_tok, HV), torch.float32, k.device)
    A = _tl.alloc((1, n_tok, HV, chunk_size), k.dtype, k.device)
    if n_tok == 0:
        return g_cumsum, A
    if heads_per_cta is None:
        heads_per_cta = pick_heads_per_cta(H, HV, n_tok, _num_sms(k.device), chunk_size)
    elif heads_per_cta < 1 or (HV // H) % heads_per_cta:
        raise ValueError(f"heads_per_cta: must divide HV / H = {HV // H}; got {heads_per_cta}")
    kernel = _build_prepare_fwd(*builder_args(H, HV, K, k.dtype, beta.dtype, heads_per_cta))
    kernel(k, g, beta, cu_seqlens, g_cumsum, A)
    return g_cumsum, A


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def prepare_fwd_profiled(k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, cu_seqlens: torch.Tensor, *,
                         skip: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Development tool: `prepare_fwd` built with the phase timeline (not part of the public API).

    Returns ``(g_cumsum, A, timeline)``; timeline is int64 ``[PROF_SLOTS, len(PROF_EVENTS)]`` (zero where not
    written): thread 0 of the CTAs of key head 0 and chunk slots ``< PROF_SLOTS`` records %clock64 at each phase
    end of `PROF_EVENTS`, a clock64/globaltimer pair at its start and end, and its chunk's first token.
    bench/profile_prepare.py prints it.
    """
    _, n_tok, H, K = k.shape
    HV = g.shape[-1]
    cu_seqlens = _check_cu_seqlens(cu_seqlens)
    g_cumsum = _tl.alloc((1, n_tok, HV), torch.float32, k.device)
    A = _tl.alloc((1, n_tok, HV, 64), k.dtype, k.device)
    prof = torch.zeros((PROF_SLOTS, len(PROF_EVENTS)), dtype=torch.int64, device=k.device)
    kernel = build_fwd(builder_args(H, HV, K, k.dtype, beta.dtype), skip=skip, profile=True)
    kernel(k, g, beta, cu_seqlens, g_cumsum, A, prof)
    return g_cumsum, A, prof


def prepare_bwd(dG: torch.Tensor, cu_seqlens: torch.Tensor, *, chunk_size: int = 64) -> torch.Tensor:
    """Chunk-local reverse cumsum of the gradient w.r.t. g_cumsum.

    Args:
        dG: ``[1, T, HV]`` fp32.
        cu_seqlens: ``[N + 1]`` int32.

    Returns:
        dg ``[1, T, HV]`` fp32, the gradient w.r.t. g (0 on padding).
    """
    _, n_tok, HV = dG.shape
    assert chunk_size == 64 and dG.dtype == torch.float32 and dG.is_contiguous()
    cu_seqlens = _check_cu_seqlens(cu_seqlens)
    dg = _tl.alloc((1, n_tok, HV), torch.float32, dG.device)
    if n_tok == 0:
        return dg
    _build_prepare_bwd(HV, chunk_size)(dG, cu_seqlens, dg)
    return dg
