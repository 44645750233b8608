"""Stage `prepare`: chunk-local gate cumsum and the ungated WY inverse (forward), reverse gate cumsum (backward).

Forward, one launch: a CTA per (chunk slot, key head) loads the chunk's keys once, computes `K K^T` with
wgmma (fp32 accumulate), writes the chunk-local inclusive cumsum of g, and its four warps invert the `HV / H`
value heads of the group, one head per warp (rounds of four; on small grids with more than four heads per key
head the launcher splits them over CTAs, `pick_heads_per_cta`, each repeating the load and K K^T):

    A = (I + strictly_lower(diag(beta) K K^T))^{-1}                    # [BT, BT], BT = 64

K K^T is kept in shared memory unscaled, once per CTA; beta scales rows on the fly. The per-warp inverse
(`_ptx.WY_INVERSE_PRELUDE`) needs no CTA barrier: the four 16x16 diagonal blocks by forward substitution (fp32,
a column per lane), then a block substitution over the 16x16 blocks below the diagonal on mma.sync with bf16
hi/lo splits of the fp32 operands (hi*hi + hi*lo + lo*hi, ~1e-6 relative), far below the rounding of the stored A:
measured A error equals the bf16 (fp16) rounding of the float64 inverse. (The CTA-wide build it replaced, three
barrier-separated levels per head with the heads one after another, took 0.31 ms at 16/64 1x32k, this one 0.19:
NOTES-gpu.md session 6.)

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
MIN_BLOCKS = 4             # CTAs per SM the registers and shared memory allow (106 registers, 48.6 KB at K = 128)
# With one value head per CTA the inverse needs no workspace beyond the dead key tile (32 KB at K = 128), so the
# registers decide: 5 CTAs per SM at 96 (no spills). Measured at 16/16 (session 7): 4096x8 0.1047 -> 0.1003 ms,
# 1024x8 0.0376 -> 0.0374; 6 per SM (80 registers, spills) 0.1014.
MIN_BLOCKS_ONE_HEAD = 5
NW = THREADS // 32         # value heads inverted at once, one per warp
# Let the next kernel on the stream launch as soon as every CTA of this one has started (programmatic dependent
# launch; the fused forward waits for this kernel's completion in T.pdl_sync before reading anything). Off until
# measured on a GPU, with fused_fwd.PDL_SYNC.
PDL_TRIGGER = False
# Where `prepare_fwd` runs the persistent build (prepare_pipe.py) instead of the one-shot kernel: value heads per key
# head in PIPE_GVA, and at least PIPE_MIN_ITEMS work items per persistent CTA (`use_pipe`). Session 10's grid (H200):
# GVA 1 -2..-7% and GVA 3 -2..-6% of a row's time where the CTAs walk several items, but +1..+3% on short single
# sequences (one or two items per CTA: nothing to pipeline); GVA 2 -1% on long rows, +2..+4.5% on short ones (there
# the one-shot kernel splits the heads over CTAs); GVA 4 prepare itself +25..30% (its module docstring).
PIPE_GVA = (1, 3)
PIPE_MIN_ITEMS = 3
# the builder's trailing parameters, in order: `builder_args` ends with the launcher's values, `build_fwd` overrides
KNOBS = ("heads_per_cta", "min_blocks", "profile", "pdl")
# profile=True builds (development): sampled CTAs and their phase-end events (thread 0, %clock64); "m." entries are
# clock64/globaltimer pairs at the CTA's start and end
PROF_SLOTS = 64
PROF_EVENTS = ("m.clk0", "m.gt0", "m.clk1", "m.gt1", "m.t0", "found", "loaded", "kkt", "split", "cumsum", "inverse")
PROF_INDEX = {name: i for i, name in enumerate(PROF_EVENTS)}


def _hi(x):
    """bf16 part of an fp32 value (round to nearest)."""
    return T.cast(x, BF16)


def _lo(x):
    """bf16 rounding of what `_hi` leaves: hi + lo carries ~16 significant bits."""
    return T.cast(x - T.cast(T.cast(x, BF16), F32), BF16)


@T.macro
def split_gram(kk_frag, kkd_shared, l_hi, l_lo):
    """K K^T (the [64, 64] fp32 fragment) -> the per-warp inverse's inputs (`_ptx.WY_INVERSE_PRELUDE`): the four
    16x16 diagonal blocks in fp32, the blocks below the diagonal (rows 16..63, cols 0..47) as bf16 hi/lo."""
    for i, c in T.Parallel(64, 64):
        if i // 16 == c // 16:
            kkd_shared[i // 16, i % 16, c % 16] = kk_frag[i, c]
        if c // 16 < i // 16:
            l_hi[i - 16, c] = _hi(kk_frag[i, c])
            l_lo[i - 16, c] = _lo(kk_frag[i, c])


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
                       heads_per_cta: int = 0, min_blocks: int = 4, profile: bool = False, pdl: bool = False):
    """heads_per_cta: value heads each CTA inverts (a divisor of HV / H; 0 = all of its key head's). Fewer give
    more, shorter CTAs (each loads the key tile and forms K K^T itself): the launcher takes them when the grid is
    small and a CTA would need more than one round of `NW` heads (`pick_heads_per_cta`). pdl: see
    `PDL_TRIGGER`. `min_blocks` bounds the registers. profile=True adds the output
    ``prof [PROF_SLOTS, len(PROF_EVENTS)]`` int64: thread 0 of the CTAs (chunk slot < PROF_SLOTS, key head 0)
    writes %clock64 at each `PROF_EVENTS` phase end (bench/profile_prepare.py reads it)."""
    # problem config
    assert BT == 64 and HV % H == 0 and K in SUPPORTED_K
    G = heads_per_cta or HV // H    # value heads per CTA
    NG = HV // H // G               # CTAs per (chunk slot, key head)
    assert (HV // H) % G == 0
    GB = 1 << (G - 1).bit_length()  # beta's shared tile: a power-of-two row
    n_tok = T.dynamic("T")
    n_seqs = T.dynamic("N")
    # tiling config: the inverse's 16x16 blocks; min_blocks CTAs per SM bounds the registers
    B16 = 16

    prof_t = T.Tensor((PROF_SLOTS, len(PROF_EVENTS)), "int64") if profile else None
    prelude = _ptx.WY_INVERSE_PRELUDE + (_ptx.PROF_PRELUDE if profile else "")

    def stamper(prof, i_s, i_h, tid):
        """stamp(event) -> the timer call (profile=True) or None (nothing reaches the kernel)."""
        def stamp(ev, cal=False):
            if not profile:
                return None
            on = (tid == 0) & (i_h == 0) & (i_s < PROF_SLOTS)
            idx = T.min(i_s, PROF_SLOTS - 1) * len(PROF_EVENTS) + PROF_INDEX[ev]
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
            # K K^T, unscaled (beta scales rows per value head), written once per CTA: the four 16x16 diagonal
            # blocks in fp32 (a pad column keeps the substitution's column reads off one bank), and rows 16..63 x
            # cols 0..47 (the blocks below the diagonal) as bf16 hi/lo, rows padded for conflict-free ldmatrix
            kkd_shared = T.alloc_shared((4, B16, B16 + 1), F32)
            l_hi = T.alloc_shared((BT - B16, _ptx.WY_LP), BF16)
            l_lo = T.alloc_shared((BT - B16, _ptx.WY_LP), BF16)
            # each warp's workspace (level-0 scratch and the output strip): the first NWK in the key tile (dead
            # after K K^T), the rest in ws
            NWS = min(G, NW)                # warps with a head
            NWK = min(NWS, BT * K // (2 * _ptx.WY_WS_FLOATS))
            ws = T.alloc_shared((NWS - NWK, _ptx.WY_WS_FLOATS), F32) if NWK < NWS else k_shared

            if t0 < eos:
                if seq < n_seqs:
                    for i, d in T.Parallel(BT, K):
                        k_shared[i, d] = T.if_then_else(t0 + i < eos, k[0, t0 + i, i_h, d], 0)
                    for i, j in T.Parallel(BT, G):
                        g_shared[i, j] = T.if_then_else(t0 + i < eos, g[0, t0 + i, hv0 + j], 0)
                        beta_shared[i, j] = T.if_then_else(
                            t0 + i < eos, T.cast(beta[0, t0 + i, hv0 + j], F32), 0)
                    # [BT, K] @ [K, BT] -> [BT, BT]
                    stamp("loaded")
                    T.gemm(k_shared, k_shared, kk_frag, transpose_B=True, clear_accum=True)
                    stamp("kkt")
                    split_gram(kk_frag, kkd_shared, l_hi, l_lo)
                    stamp("split")
                    T.cumsum(g_shared[:, 0:G], dim=0)
                    for i, j in T.Parallel(BT, G):
                        if t0 + i < eos:
                            g_cumsum[0, t0 + i, hv0 + j] = g_shared[i, j]
                    stamp("cumsum")
                    # warp w inverts value heads w, w + NW, ... (`_ptx.WY_INVERSE_PRELUDE`); every thread makes the
                    # call (no branch around it: no barrier can diverge), a warp without a head returns at once
                    T.sync_threads()
                    warp = tid // 32
                    for rnd in T.serial(T.ceildiv(G, NW)):
                        j = rnd * NW + warp
                        jc = T.min(j, G - 1)
                        T.call_extern("handle", _ptx.WY_INVERSE[k_dtype], T.address_of(l_hi[0, 0]),
                                      T.address_of(l_lo[0, 0]), T.address_of(kkd_shared[0, 0, 0]),
                                      T.address_of(beta_shared[0, jc]), GB, T.address_of(k_shared[0, 0]), NWK,
                                      T.address_of(ws[0, 0]),    # (the key tile when NWK == NWS: not read)
                                      T.address_of(A[0, T.cast(t0, "int64"), hv0 + jc, 0]),
                                      T.cast(HV * BT, "int64"), eos - t0, j < G, tid)
                    stamp("inverse")
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
    return cu_seqlens.to(torch.int32).contiguous()      # no copy when it already is


def builder_args(H: int, HV: int, K: int, k_dtype: torch.dtype, beta_dtype: torch.dtype,
                 heads_per_cta: int = 0) -> tuple:
    """The `_build_prepare_fwd` arguments (its compile-cache key) for one call; shared with `warmup`.
    heads_per_cta 0 (or HV / H): every value head of a key head in one CTA."""
    return (HV, H, K, 64, _TORCH_TO_TL[k_dtype], _TORCH_TO_TL[beta_dtype], _hpc_key(H, HV, heads_per_cta),
            min_blocks_for(H, HV, heads_per_cta), False, PDL_TRIGGER)


def min_blocks_for(H: int, HV: int, heads_per_cta: int = 0) -> int:
    """The builder's `min_blocks` (CTAs per SM it sizes the registers for) for a heads-per-CTA split."""
    return MIN_BLOCKS_ONE_HEAD if (heads_per_cta or HV // H) == 1 else MIN_BLOCKS


def _hpc_key(H: int, HV: int, heads_per_cta: int) -> int:
    """The builder's `heads_per_cta` for a split: 0 for all of a key head's value heads (one cache key for both
    spellings)."""
    return 0 if heads_per_cta in (0, HV // H) else int(heads_per_cta)


def heads_per_cta_options(H: int, HV: int) -> tuple:
    """The value-heads-per-CTA splits the launcher may take, most first: HV / H, half of it (if even), 1."""
    G = HV // H
    return tuple(dict.fromkeys(x for x in (G, G // 2 if G % 2 == 0 else G, 1)))


def use_pipe(H: int, HV: int, K: int, n_tok: int, n_seqs: int, num_sms: int) -> bool:
    """Whether `prepare_fwd` takes the persistent build for a call (`PIPE_GVA`, `PIPE_MIN_ITEMS`); host shapes only."""
    if HV // H not in PIPE_GVA:
        return False
    from . import prepare_pipe  # noqa: PLC0415

    items = (n_tok // 64 + n_seqs + 1) * H
    return items >= PIPE_MIN_ITEMS * num_sms * prepare_pipe.blocks_per_sm(K, HV // H)


def launcher_builds(H: int, HV: int, K: int, k_dtype: torch.dtype, beta_dtype: torch.dtype,
                    num_sms: Optional[int] = None) -> list:
    """(label, builder, args) of every kernel `prepare_fwd` may launch for these heads (what `flashdelta warmup`
    compiles): the one-shot kernel's heads-per-CTA splits and, for `PIPE_GVA`, the persistent build. num_sms (the
    persistent build's grid): this machine's GPU if there is one, else 132 (H100 SXM, H200)."""
    out = [(f"prepare_fwd H={H} HV={HV} K={K} heads/CTA={hpc}", _build_prepare_fwd,
            builder_args(H, HV, K, k_dtype, beta_dtype, hpc)) for hpc in launcher_heads_per_cta(H, HV)]
    if HV // H in PIPE_GVA:
        from . import prepare_pipe  # noqa: PLC0415

        if num_sms is None:
            num_sms = _num_sms(torch.device("cuda")) if torch.cuda.is_available() else 132
        out.append((f"prepare_fwd H={H} HV={HV} K={K} persistent", prepare_pipe._build_prepare_fwd_pipe,
                    prepare_pipe.builder_args(H, HV, K, k_dtype, beta_dtype, num_sms=num_sms)))
    return out


def launcher_heads_per_cta(H: int, HV: int) -> tuple:
    """The values `pick_heads_per_cta` can return for these heads (what `flashdelta warmup` compiles)."""
    G = HV // H
    return (G,) if G <= NW else (G, max(h for h in heads_per_cta_options(H, HV) if h <= NW))


def pick_heads_per_cta(H: int, HV: int, n_tok: int, num_sms: int = 132, chunk_size: int = 64) -> int:
    """Value heads per CTA for a call. A CTA's warps invert `NW` heads at once, so up to `NW` heads cost a CTA no
    more time than one: all of a key head's (HV / H) whenever they take one round. With more, a small grid (the
    chunks fit one wave of `MIN_BLOCKS` CTAs per SM, where a CTA's lifetime is the kernel's time) takes the most
    heads per CTA (of `heads_per_cta_options`) that need one round; a CTA then repeats the key tile load and K K^T.
    (Before the per-warp inverse, splitting down to one head per CTA paid on small grids: NOTES-gpu.md session 5.)"""
    options = launcher_heads_per_cta(H, HV)
    if len(options) == 1:
        return options[0]
    chunks = -(-n_tok // chunk_size)
    return options[1] if chunks * HV // options[1] <= MIN_BLOCKS * num_sms else options[0]


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
        heads_per_cta: value heads per CTA, a divisor of HV / H (the one-shot kernel); None: the launcher's pick:
            the persistent kernel (prepare_pipe.py) where `use_pipe`, else `pick_heads_per_cta(...)`.

    Returns:
        g_cumsum ``[1, T, HV]`` fp32 (0 on padding), and A ``[1, T, HV, BT]`` in k's dtype: token
        ``chunk_start + i`` holds row i of ``(I + strictly_lower(diag(beta) K K^T))^{-1}``.
    """
    cu_seqlens, g_cumsum, A = _fwd_outputs(k, g, beta, cu_seqlens, chunk_size)
    _, n_tok, H, K = k.shape
    HV = g.shape[-1]
    if n_tok == 0:
        return g_cumsum, A
    if heads_per_cta is None:
        num_sms = _num_sms(k.device)
        if use_pipe(H, HV, K, n_tok, cu_seqlens.shape[0] - 1, num_sms):
            from . import prepare_pipe  # noqa: PLC0415

            prepare_pipe.launch(k, g, beta, cu_seqlens, g_cumsum, A, num_sms=num_sms)
            return g_cumsum, A
        heads_per_cta = pick_heads_per_cta(H, HV, n_tok, num_sms, chunk_size)
    elif heads_per_cta < 1 or (HV // H) % heads_per_cta:
        raise ValueError(f"heads_per_cta: must divide HV / H = {HV // H}; got {heads_per_cta}")
    kernel = _build_prepare_fwd(*builder_args(H, HV, K, k.dtype, beta.dtype, heads_per_cta))
    kernel(k, g, beta, cu_seqlens, g_cumsum, A)
    return g_cumsum, A


def _fwd_outputs(k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, cu_seqlens: torch.Tensor,
                 chunk_size: int) -> tuple:
    """Checks `prepare_fwd`'s inputs (either kernel); returns cu_seqlens as int32 and the allocated g_cumsum, A."""
    _, n_tok, H, K = k.shape
    HV = g.shape[-1]
    assert chunk_size == 64 and K in SUPPORTED_K and HV % H == 0
    assert k.dtype in (torch.bfloat16, torch.float16) and g.dtype == torch.float32
    assert k.is_contiguous() and g.is_contiguous() and beta.is_contiguous()
    g_cumsum = _tl.alloc((1, n_tok, HV), torch.float32, k.device)
    A = _tl.alloc((1, n_tok, HV, chunk_size), k.dtype, k.device)
    return _check_cu_seqlens(cu_seqlens), g_cumsum, A


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def prepare_fwd_profiled(k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                         cu_seqlens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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
    kernel = build_fwd(builder_args(H, HV, K, k.dtype, beta.dtype), profile=True)
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
