"""Context parallelism's cost model (docs/dev/cp.md, "Cost model"): predicted H200 times of the serial forward and
backward and of their CP passes, the partition length each pass picks (`choose`, `choose_bwd`), whether the unsplit
forward runs the wide build (`wide_pays`), and the warm-up request the model and the plan share (`parse_warmup`,
`warmup_threshold`).

The constants are microseconds on an H200 (132 SMs, bf16, K = V = 128). ``bench/dev/fit_cp.py`` fitted the
forward's launch, chunk and item constants, `SUMMARY_CHUNK_FACTOR` and `WARMUP_US`, and with ``--bwd`` the
backward's chunk_bwd constants, `RECOMPUTE_FACTOR`, `START_GRAD_FACTOR` and `WARMUP_BWD_US` (each comment names its
run); the scans' constants are predictions (the measured ones are beside them), `BWD_FIXED_US` a guess, and
`WARMUP_FALLBACK` / `WARMUP_CHUNKS` properties of the benchmark's gates. `flashdelta.cp` re-exports every public
name here; set a constant on this module (as fit_cp.py does) to change what the model predicts.
"""
from __future__ import annotations

import bisect
import functools
import math
import os
from typing import Optional

import torch

BT = 64                         # chunk size of every stage

# ---- the gate-driven warm-up (docs/algorithm.md §4.4), shared by the plan (`flashdelta.cp`) and the model
ENV_WARMUP = "FLASHDELTA_CP_WARMUP"
# a window's summed log decay must reach this: the dropped part is <= e^-10 = 4.5e-5 of the state entering it,
# ~1/86 of bf16's unit roundoff (2^-8) and ~1/1000 of the bf16 tolerances (docs/numerics.md)
WARMUP_THRESHOLD = -10.0
# `auto` warms up where q is one of these (the SM90 kernels' inputs, rounded to 2^-8 or 2^-11 already); fp32 and
# float64 calls ask for more than a truncation at e^-10 gives and stay exact unless the request says otherwise
WARMUP_DTYPES = (torch.bfloat16, torch.float16)

# ---- the training forward's saved chunk states (`autograd._saves_states`): where one native backend runs both passes
# and the CP code is decided on the host, the forward (split or not) writes the state entering every chunk and the
# backward reads it instead of running state_recompute; 0 keeps the recompute (less memory held from the forward to
# the backward)
ENV_SAVE_STATES = "FLASHDELTA_SAVE_STATES"


def save_states_enabled() -> bool:
    """`ENV_SAVE_STATES`, validated: whether the training forward may save the backward's chunk states."""
    raw = os.environ.get(ENV_SAVE_STATES, "1")
    if raw not in ("0", "1"):
        raise ValueError(f"{ENV_SAVE_STATES}={raw!r}: expected 1 (the training forward saves the backward's chunk "
                         f"states, the default) or 0 (the backward recomputes them: less memory held between the "
                         f"passes)")
    return raw == "1"


# ---- cost model constants (microseconds on an H200, 132 SMs, bf16, K = V = 128); `bench/dev/fit_cp.py` refits
# them. The fused forward takes `items x (chunks x c + o)` on the busiest SM; the values are bench/dev/fit_cp.py's
# least-squares fit on the H200 (heads 2/8 and 4/16, 1x32768 .. 4096x8, partition lengths 16-128:
# bench/results/h200/2026-12-01_7675643_fit_cp_fwd_torch_scan.txt, on the wave model the list schedule replaced,
# which leaves the forward grid's choices as they were).
CHUNK_US_FULL = 1.45            # per chunk and CTA, every SM busy
CHUNK_US_IDLE = 1.29            # per chunk and CTA, few CTAs (higher clock)
ITEM_US = 5.2                   # per CTA: start, pipeline fill, drain
LAUNCH_US = 5.2                 # per fused launch, fixed
# The wide forward build (`fused_fwd.chunk_fwd(wide=True)`: one CTA per (sequence, value head) for all of V = 128,
# where the default runs V / 64 CTAs): `WIDE_CHUNK_FACTOR` x the default CTA's time per chunk, `WIDE_ITEM_US` per CTA.
# Least squares on the log of wide / default over 15 rows (16/16 .. 16/64, 1k-32k tokens, 64-512 (sequence, value
# head) items; H100 80GB at 4949364, bench/results/h100/2026-12-07_4949364_wide_ab.txt): every ratio within 8%, the
# ones the model puts below `WIDE_MARGIN` all measured below 0.98. The unsplit inference forward takes the wide build
# where the model predicts it `WIDE_MARGIN` x the default's time or less (`wide_pays`).
WIDE_CHUNK_FACTOR = 2.0
WIDE_ITEM_US = 3.5
WIDE_MARGIN = 0.95
WIDE_HEAD_DIMS = ((128, 128),)  # kernels.fused_fwd_wide.HEAD_DIMS (tests/cpu/test_wide_pick.py checks they agree)
# The scans' constants are the predictions written before they ran. The scan kernel measured 13.56 us + 3.333 us a
# step (2/8 and 4/16 1x32768, L = 32 and 64: bench/results/h200/2026-12-01_af450ef_fit_cp_fwd.txt; ~3.3 a step
# since); those values move 18 of the benchmark grids' 144 rows (forward and backward) to partition lengths no run
# has timed, so these stay until a run times both. The torch scans (where the kernel does not take (K, V)) measured
# 17-31 us a step (..._6e8f4d3_fit_cp_fwd.txt, ..._7675643_fit_cp_fwd_torch_scan.txt).
SCAN_STEP_US = 6.0              # one step of the serial scan (a gather and a batched GEMM, few launches)
SCAN_LEVEL_US = 12.0            # one level of the log-depth scan, launches
SCAN_KERNEL_US = 5.0            # the scan kernel (`kernels.cp_scan`): launch, first M load, part offsets
SCAN_KERNEL_STEP_US = 1.5       # one of its steps (16-column tiles; ~2.5 with 32-column tiles, `_kernel_step_us`)
# the 8-column tile's step over the 16-column one's (256 threads; H200, 2/8 1x32768 at 8-32 steps, cp_scan_bench.py:
# forward 0.77-0.83, backward 0.94-0.95; bench/results/h200/2026-12-06_1b03d7c_chunk_bwd_wait_and_scan_ab.txt)
SCAN_KERNEL_BV8 = 0.85
SCAN_TFLOPS = 25.0              # fp32 batched-GEMM rate of the log-depth scan (TFLOP/s)
# the M and E passes run states-only builds (no Q K^T, Pg, O^T, q loads or o stores: `chunk_fwd(states_only=True)`):
# their per-chunk time over the full pass's, measured on the H200 by bench/dev/fit_cp.py (2/8 and 4/16 1x32768,
# L = 32 and 64: 0.88-0.89; bench/results/h200/2026-12-01_af450ef_fit_cp_fwd.txt)
SUMMARY_CHUNK_FACTOR = 0.89
MARGIN = 0.9                    # split only where the predicted CP time is below MARGIN x the serial time
# with the warm-up the expected CP time assumes this share of the value heads falls back to the exact path (whole
# partitions in the M and E passes: the benchmark gates' g = 0 heads) and the rest needs WARMUP_CHUNKS chunks (-3.2
# per chunk under the benchmark gates: 4 chunks to -10); the split must also not be slower than serial where every
# head falls back (`cp_worst`, the exact path's time): the decision knows no gate before the call
WARMUP_FALLBACK = 0.25
WARMUP_CHUNKS = 4
# the warm-up's cost beyond its shortened M and E passes: its decision, one launch of `kernels.cp_windows` on the
# SM90 path. Fitted on the H200 by bench/dev/fit_cp.py (the kernel 24-43 us at 2/8 and 4/16 1x32768, L = 32 and 64,
# against the torch windows' 148-202; bench/results/h200/2026-12-01_af450ef_fit_cp_fwd.txt). There 4/16 1x32768
# ran 515 us with the warm-up at L = 32 against 619 exact at L = 128 and 748 serial.
WARMUP_US = 33.4
# the backward warm-up's cost beyond its shortened F pass: its decision (`cp.grad_windows`, one launch of
# `kernels.cp_windows` on the SM90 path) and the zeroing of the warm-up heads' M. The kernel measured 40.05 us on
# average over the 16/32 backward rows (bench/results/h200/2026-12-03_03173fe_fit_cp_bwd.txt; 31.45 over the 6e0ab3e
# run's rows)
WARMUP_BWD_US = 40.0
# split only where `cp_worst` is at most this x the serial time: where no gate decays at all (no model's gates) a
# split may lose up to 5%, so that rows where only the warm-up makes CP pay (4/16 1x32768) are split
WORST_MARGIN = 1.05
# auto: no split of a forward whose longest sequence has fewer chunks; at 2/8 1x8192 (128 chunks) the model's L = 16
# measured 2.5% slower than serial on the H200 (fixed costs of the three passes), at 2/8 1x32768 L = 64 1.66x faster
MIN_SEQ_CHUNKS = 256
CANDIDATE_L = (8, 16, 32, 64, 128, 256)      # partition lengths (chunks) the model tries

# ---- backward (`predict_bwd`). chunk_bwd runs one CTA per (sequence or partition, value head) with all of V and
# ~220 KB of shared memory (one CTA per SM), latency-bound: the same time per chunk at any occupancy
# (docs/dev/chunk_bwd.md). state_recompute is the fused forward with its state output on. The values are
# bench/dev/fit_cp.py --bwd's fit on the H200 (16/32, the backward grid's 8k and 32k rows, partition lengths 12-128:
# bench/results/h200/2026-12-03_03173fe_fit_cp_bwd.txt).
BWD_CHUNK_US = 10.7             # chunk_bwd per chunk and CTA, any occupancy
BWD_ITEM_US = 3.8               # chunk_bwd per CTA: dht load, pipeline fill, dh0 store
BWD_LAUNCH_US = 32.3            # chunk_bwd per launch, fixed
BWD_CTAS_PER_SM = 1             # chunk_bwd CTAs resident per SM (shared memory)
RECOMPUTE_FACTOR = 1.14         # state_recompute's time over the forward pass model's
# what writing the chunk states (bf16 S0^T, K V 2 bytes per chunk and value head) adds to the unsplit training
# forward (`ENV_SAVE_STATES`): at least SAVE_STATES_FACTOR of the forward pass model's time, or the bytes at
# SAVE_STATES_TBPS where that takes longer. Measured on an H100 (bench/results/h100/2026-12-05_74bc452_saved_states_ab
# .txt, us added / MB): 16/32 1x8192 +42 / 136, 6413+6673+10954+8728 +201 / 542, 16/64 8192x4 +371 / 1084, 1024x8
# +79 / 287 (bandwidth: 3.0 TB/s gives 45, 181, 361, 96), 2/8 1x32768 +108 / 135, 2/4 1x8192 +28 / 17 (few CTAs:
# 16% of the forward)
SAVE_STATES_FACTOR = 0.16
SAVE_STATES_TBPS = 3.0
START_GRAD_FACTOR = 0.44        # chunk_dstate (F) over chunk_bwd per CTA: 6 of its 19 GEMMs, no states
BWD_FIXED_US = 30.0             # CP backward's small kernels: plan, zero gradients, gathers (a guess)
MIN_SEQ_CHUNKS_BWD = 16         # auto: no split of a backward whose longest sequence has fewer chunks (1024 tokens)
# the backward's time per chunk is ~15x the forward's, so it pays to cut finer and to fill the SMs' one wave
CANDIDATE_L_BWD = (2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)


# ------------------------------------------------------------------------------------------------ cost model

def _launch_us(items: list, slots: int, idle: float, full: float, item: float, launch: float) -> float:
    """One launch over `items` = [(chunks, count)] CTAs on `slots` resident CTAs, longest first (the kernels order
    their work items by length, `kernels._tl.seq_order`): the makespan of list scheduling (each CTA starts on the
    first slot to free up), the per-chunk time interpolated between `idle` (few CTAs) and `full` (every slot busy)."""
    n = sum(c for _, c in items)
    if n == 0:
        return launch
    c = idle + (full - idle) * min(1.0, n / slots)
    return launch + _makespan(tuple(sorted(((ch * c + item, cnt) for ch, cnt in items if cnt), reverse=True)), slots)


def _makespan(jobs: tuple, slots: int) -> float:
    """Longest-first list scheduling of `jobs` = ((duration, count), ...) on `slots` machines (each job starts on
    the first to free up): the last finish time (`_schedule`)."""
    return _schedule(tuple((d, 0, cnt) for d, cnt in jobs), slots)[0]


@functools.lru_cache(maxsize=4096)
def _schedule(jobs: tuple, slots: int) -> tuple:
    """Longest-first list scheduling of `jobs` = ((duration, chunks, count), ...) on `slots` machines: (finish time,
    chunks, items) of the slot that finishes last (its chunks and items are the rows bench/dev/fit_cp.py fits; slots
    that tie in time are interchangeable). The slots' finish times are kept sorted; the j slots that free up before
    the first one could finish a job of this group each take one next, so a group goes in batches of j (whole rounds
    at once where j is every slot), not job by job. Cached: the candidates of one decision share their serial passes,
    and the layers of a model step share their lengths."""
    t = [(0.0, 0, 0)] * min(slots, sum(cnt for *_, cnt in jobs))
    for d, ch, cnt in sorted(jobs, reverse=True):
        while cnt:
            j = bisect.bisect_left(t, (t[0][0] + d,))
            if j == len(t) and cnt >= j:
                rounds = cnt // j
                t = [(x + rounds * d, c + rounds * ch, n + rounds) for x, c, n in t]
                cnt -= rounds * j
                continue
            k = min(j, cnt)
            t = sorted(t[k:] + [(x + d, c + ch, n + 1) for x, c, n in t[:k]])   # two sorted runs: a linear merge
            cnt -= k
    return t[-1] if t else (0.0, 0, 0)


def _launch_terms(items: list, slots: int, idle: float, full: float, item: float) -> tuple:
    """(occupancy, chunks, items) of `_launch_us`'s schedule at these constants: the launch takes ``launch + chunks x c
    + items x item`` with ``c = idle + (full - idle) x occupancy`` (the chunks and items of the slot that finishes
    last), linear in the constants for this schedule: the rows bench/dev/fit_cp.py fits them to."""
    n = sum(c for _, c in items)
    if n == 0:
        return 0.0, 0, 0
    occ = min(1.0, n / slots)
    c = idle + (full - idle) * occ
    return (occ,) + _schedule(tuple((ch * c + item, ch, cnt) for ch, cnt in items if cnt), slots)[1:]


def _pass_us(items: list, sms: int) -> float:
    """One fused-forward launch over `items` = [(chunks, count)] CTAs (`_launch_us`, one CTA per SM at a time)."""
    return _launch_us(items, sms, CHUNK_US_IDLE, CHUNK_US_FULL, ITEM_US, LAUNCH_US)


def _wide_pass_us(items: list, sms: int) -> float:
    """One wide fused-forward launch over `items` = [(chunks, count)] CTAs (`_launch_us` at `WIDE_CHUNK_FACTOR` of
    the per-chunk time and `WIDE_ITEM_US` per CTA, one CTA per SM at a time)."""
    f = WIDE_CHUNK_FACTOR
    return _launch_us(items, sms, CHUNK_US_IDLE * f, CHUNK_US_FULL * f, WIDE_ITEM_US, LAUNCH_US)


def wide_pays(*, T: int, N: int, HV: int, K: int, V: int, sms: int, lengths=None,
              seq_len: Optional[int] = None) -> bool:
    """Whether the unsplit forward's wide build (one CTA per (sequence, value head)) is predicted at most
    `WIDE_MARGIN` x the default build's time (V / 64 CTAs per (sequence, value head)) for N sequences of T tokens in
    all (`lengths`: the host lengths; `seq_len`: N equal ones, dense input). Where the CTAs of either build leave SMs
    idle the default wins (~1.9x at one wave); where the wide build's CTAs fill whole waves and the default's leave
    a partial one, or the sequences are short (one start, fill and drain instead of two), the wide build does."""
    if (K, V) not in WIDE_HEAD_DIMS or N * T == 0:
        return False
    chunks = _seq_chunks(T, N, lengths if seq_len is None else [seq_len] * N)
    default = _pass_us([(c, HV * (V // 64)) for c in chunks], sms)
    return _wide_pass_us([(c, HV) for c in chunks], sms) <= WIDE_MARGIN * default


def _summary_pass_us(items: list, sms: int) -> float:
    """One states-only fused-forward launch (CP's M or E pass) over `items`: `_pass_us` at `SUMMARY_CHUNK_FACTOR`
    of the per-chunk time."""
    f = SUMMARY_CHUNK_FACTOR
    return _launch_us(items, sms, CHUNK_US_IDLE * f, CHUNK_US_FULL * f, ITEM_US, LAUNCH_US)


def _bwd_pass_us(items: list, sms: int) -> float:
    """One chunk_bwd launch over `items` = [(chunks, count)] CTAs (one per (sequence or partition, value head))."""
    return _launch_us(items, sms * BWD_CTAS_PER_SM, BWD_CHUNK_US, BWD_CHUNK_US, BWD_ITEM_US, BWD_LAUNCH_US)


def _parts(chunks: list, L: int) -> dict:
    """{chunks: count} of the partitions of sequences of `chunks` chunks cut every L chunks."""
    parts = {}
    for c in chunks:
        full, rem = divmod(c, L)
        if full:
            parts[L] = parts.get(L, 0) + full
        if rem or c == 0:
            parts[rem] = parts.get(rem, 0) + 1
    return parts


def bounds(T: int, N: int, L: int, seq_len: Optional[int] = None) -> tuple:
    """(P, J): partition slots and scan steps for L-chunk partitions, from host information only. Dense input
    (`seq_len`: every sequence has that many tokens): exact. Varlen: ``P = N + T // (64 L)`` bounds
    ``sum max(1, ceil(len_n / (64 L)))`` and ``J = ceil(T / (64 L))`` bounds the partitions of one sequence."""
    W = L * BT
    if seq_len is not None:
        J = max(1, -(-seq_len // W))
        return N * J, J
    return N + T // W, max(1, -(-T // W))


def _kernel_step_us(N: int, HV: int, V: int, K: int = 128) -> float:
    """One step of the scan kernel: its V tile (`kernels.cp_scan.choose_bv`'s rule) sets the FMAs per step; the
    8-column tile's step is `SCAN_KERNEL_BV8` of the 16-column one's."""
    if K == 128 and N * HV * (V // 8) <= 132:
        return SCAN_KERNEL_STEP_US * SCAN_KERNEL_BV8
    return SCAN_KERNEL_STEP_US * (1.0 if V % 32 or N * HV * (V // 16) <= 132 else 5.0 / 3.0)


def scan_cost(P: int, J: int, HV: int, K: int, V: int, *, kernel: bool = False, N: int = 1) -> tuple:
    """(microseconds, method) of the cheapest scan: ``"kernel"`` (with `kernel`: the TileLang scan, J - 1 steps in
    one launch over N sequences), ``"serial"`` (J steps) or ``"log"`` (ceil(log2 J) levels of batched
    [K, K] x [K, K + V] GEMMs over every partition)."""
    if kernel:
        return SCAN_KERNEL_US + max(J - 1, 0) * _kernel_step_us(N, HV, V, K), "kernel"
    serial = J * SCAN_STEP_US
    levels = max(0, math.ceil(math.log2(J))) if J > 1 else 0
    log = levels * (SCAN_LEVEL_US + 2.0 * P * HV * K * K * (K + V) / (SCAN_TFLOPS * 1e6))
    return (serial, "serial") if serial <= log else (log, "log")


def _seq_chunks(T: int, N: int, lengths) -> list:
    """Chunks per sequence: from the host lengths, else N equal sequences of T / N tokens (the case where a
    split gains least, so the decision stays conservative)."""
    if lengths is not None:
        return [-(-int(n) // BT) for n in lengths]
    return [-(-(T // max(N, 1)) // BT)] * N


def _inner(chunks: list, L: int) -> int:
    """How many partitions of sequences of `chunks` chunks cut every L chunks are not their sequence's last (each
    of L chunks): the ones whose end state and transition the scan reads."""
    return sum(max(0, -(-c // L) - 1) for c in chunks)


def _first_parts(chunks: list, L: int) -> dict:
    """{chunks: count} of the partitions that are not their sequence's first, of sequences of `chunks` chunks cut
    every L chunks: the ones whose start gradient F the reverse scan reads."""
    parts = {}
    for c in chunks:
        full, rem = divmod(c, L)
        if full > 1:
            parts[L] = parts.get(L, 0) + full - 1
        if full and rem:
            parts[rem] = parts.get(rem, 0) + 1
    return parts


def _fallback_heads(HV: int) -> int:
    """The value heads the warm-up's expected time assumes fall back to the exact path: `WARMUP_FALLBACK` of HV,
    at least one."""
    return min(HV, max(1, math.ceil(WARMUP_FALLBACK * HV)))


def _start_us(cont: dict, HV: int, sms: int, warmup: bool = False) -> float:
    """chunk_dstate's microseconds, `START_GRAD_FACTOR` of a chunk_bwd launch over the CTAs (one per partition and
    value head) of the partitions that are not their sequence's first (`cont`, {chunks: count}; the others' CTAs
    exit at once): exact (every head walks its whole partition) or with the `warmup` expected (`WARMUP_FALLBACK` of
    the heads walk whole partitions, the rest `WARMUP_CHUNKS` chunks)."""
    hf = _fallback_heads(HV) if warmup else HV
    items = [(ch, n * hf) for ch, n in cont.items()]
    if warmup:
        items += [(min(WARMUP_CHUNKS, ch), n * (HV - hf)) for ch, n in cont.items()]
    items = [(ch, n) for ch, n in items if n > 0]
    if not items:
        return START_GRAD_FACTOR * BWD_LAUNCH_US
    return START_GRAD_FACTOR * _bwd_pass_us(items, sms)


def warmup_pays_bwd(*, cont: dict, HV: int, sms: int) -> bool:
    """Whether the backward's warm-up (chunk_dstate over the windows, its decision `WARMUP_BWD_US`) beats the exact
    F pass, for the partitions `cont` ({chunks: count}) that are not their sequence's first: where the exact F pass
    is one wave anyway and some head falls back (its CTA walks a whole partition) the windows shorten nothing."""
    return _start_us(cont, HV, sms, warmup=True) + WARMUP_BWD_US < _start_us(cont, HV, sms)


def _summary_us(inner: int, HV: int, K: int, V: int, L: int, sms: int, warmup: bool) -> tuple:
    """(M pass, E pass) microseconds over `inner` partitions of L chunks: exact (every head walks every chunk of
    both) or, with `warmup`, expected (`WARMUP_FALLBACK` of the heads walk both, the rest `WARMUP_CHUNKS` chunks
    of the E pass)."""
    NV, NK = max(1, V // 64), max(1, K // 64)
    if not warmup:
        return _summary_pass_us([(L, inner * HV * NK)], sms), _summary_pass_us([(L, inner * HV * NV)], sms)
    hf = _fallback_heads(HV)
    return _summary_pass_us([(L, inner * hf * NK)], sms), _summary_pass_us(
        [(L, inner * hf * NV), (min(WARMUP_CHUNKS, L), inner * (HV - hf) * NV)], sms)


def warmup_pays(*, inner: int, HV: int, K: int, V: int, L: int, sms: int) -> bool:
    """Whether the warm-up's expected M and E passes plus its decision (`WARMUP_US`) beat the exact path's, for
    `inner` partitions of L chunks (not their sequences' last): where every pass is one wave anyway (few heads)
    the windows shorten no launch and the exact path is faster."""
    return sum(_summary_us(inner, HV, K, V, L, sms, True)) + WARMUP_US < sum(_summary_us(inner, HV, K, V, L, sms,
                                                                                      False))


def predict(*, T: int, N: int, HV: int, K: int, V: int, L: int, sms: int, lengths=None,
            seq_len: Optional[int] = None, warmup: Optional[bool] = None) -> dict:
    """Predicted microseconds of the serial forward's fused pass and of CP's passes with L-chunk partitions.

    The M and E passes walk only partitions that are not their sequence's last (the scan reads no other; the others'
    CTAs exit at once). `warmup` (None: what `FLASHDELTA_CP_WARMUP` gives bf16 inputs, `warmup_threshold`): the
    warm-up may run; it runs where `warmup_pays` (``warmup`` in the result), and then ``cp`` is its expected time
    and ``cp_worst`` the same launches where every head falls back (the exact path's time plus `WARMUP_US`).
    Otherwise both are the exact path's time. On the SM90 path the warm-up heads' output pass runs beside the exact
    heads' M pass and scan (`cp._output_overlapped`); the model still adds the passes in series (an upper bound)
    until bench/dev/fit_cp.py has timed the overlap."""
    if warmup is None:
        warmup = warmup_threshold(parse_warmup(None), torch.bfloat16) is not None
    chunks = _seq_chunks(T, N, lengths if seq_len is None else [seq_len] * N)
    NV = max(1, V // 64)
    serial = _pass_us([(c, HV * NV) for c in chunks], sms)
    parts = _parts(chunks, L)
    inner = _inner(chunks, L)
    P, J = bounds(T, N, L, seq_len)
    exact = sum(_summary_us(inner, HV, K, V, L, sms, False))
    out = _pass_us([(ch, n * HV * NV) for ch, n in parts.items()], sms)
    scan_us, scan = scan_cost(P, J, HV, K, V, kernel=_kernel_dims(K, V), N=N)
    warm = bool(warmup) and warmup_pays(inner=inner, HV=HV, K=K, V=V, L=L, sms=sms)
    m, e = _summary_us(inner, HV, K, V, L, sms, warm)
    fixed = WARMUP_US if warm else 0.0
    rest = out + scan_us + fixed
    return dict(serial=serial, cp=m + e + rest, cp_worst=exact + rest, warmup=warm, m=m, e=e, warmup_us=fixed,
                out=out, scan=scan_us, scan_method=scan, P=P, J=J)


def predict_bwd(*, T: int, N: int, HV: int, K: int, V: int, L: int, sms: int, lengths=None,
                seq_len: Optional[int] = None, warmup: Optional[bool] = None, starts_saved: bool = False,
                states_saved: bool = False) -> dict:
    """Predicted microseconds of the serial backward's partition-dependent stages (state_recompute + chunk_bwd over
    whole sequences) and of CP's with L-chunk partitions: the M and E passes, the scan, state_recompute over the
    partitions, chunk_dstate (`START_GRAD_FACTOR` of a chunk_bwd), the reverse scan, the second
    chunk_bwd and the small kernels (`BWD_FIXED_US`). prepare_fwd, group_sum and prepare_bwd run the same either
    way and are left out.

    `warmup` (None: what `FLASHDELTA_CP_WARMUP` gives bf16 inputs): the end gradients' warm-up may run; it runs
    where `warmup_pays_bwd` (``warmup`` in the result), and then ``cp`` is its expected time (chunk_dstate over the
    windows, ``start``, plus `WARMUP_BWD_US`) and ``cp_worst`` the exact F pass plus `WARMUP_BWD_US` (every head
    falls back). Otherwise both are the exact path's time. `starts_saved`: the unsplit forward saved the
    partitions' start states (`cp.cp_chunk_bwd`'s `starts`): no E pass and no forward scan, and the M pass walks
    only the partitions that are not their sequence's first, with the warm-up only its fallback heads
    (`WARMUP_FALLBACK`). `states_saved`: the forward (split or not) saves every chunk state instead (`ENV_SAVE_STATES`),
    for the price of its state stores (`save_states_us`, in both paths' times): neither the serial backward nor CP's
    runs a state_recompute (on the backward grid's rows with an unsplit forward the stores cost 0.27-0.91x CP's
    recompute over the partitions, and 0.14-0.42x the serial recompute)."""
    if warmup is None:
        warmup = warmup_threshold(parse_warmup(None), torch.bfloat16) is not None
    chunks = _seq_chunks(T, N, lengths if seq_len is None else [seq_len] * N)
    NV, NK = max(1, V // 64), max(1, K // 64)
    whole = [(c, 1) for c in chunks]
    fwd_pass = _pass_us([(c, n * HV * NV) for c, n in whole], sms)
    save = save_states_us(T=T, HV=HV, K=K, V=V, fwd_us=fwd_pass) if states_saved else None
    serial_states = save if states_saved else RECOMPUTE_FACTOR * fwd_pass
    serial_bwd = _bwd_pass_us([(c, n * HV) for c, n in whole], sms)
    parts = _parts(chunks, L).items()
    P, J = bounds(T, N, L, seq_len)
    scan_us, scan = scan_cost(P, J, HV, K, V, kernel=_kernel_dims(K, V), N=N)
    states = save if states_saved else RECOMPUTE_FACTOR * _pass_us([(ch, n * HV * NV) for ch, n in parts], sms)
    bwd = _bwd_pass_us([(ch, n * HV) for ch, n in parts], sms)
    cont = _first_parts(chunks, L)
    exact = _start_us(cont, HV, sms)
    warm = bool(warmup) and warmup_pays_bwd(cont=cont, HV=HV, sms=sms)
    start = _start_us(cont, HV, sms, warmup=True) if warm else exact
    fixed = WARMUP_BWD_US if warm else 0.0
    if starts_saved or states_saved:
        hf = _fallback_heads(HV)
        m_exact = _summary_pass_us([(ch, n * HV * NK) for ch, n in cont.items()], sms)
        m = _summary_pass_us([(ch, n * hf * NK) for ch, n in cont.items()], sms) if warm else m_exact
        e, scans = 0.0, scan_us
    else:
        m = m_exact = _summary_pass_us([(ch, n * HV * NK) for ch, n in parts], sms)
        e, scans = _summary_pass_us([(ch, n * HV * NV) for ch, n in parts], sms), 2 * scan_us
    rest = e + scans + states + bwd + BWD_FIXED_US + fixed
    return dict(serial=serial_states + serial_bwd, serial_states=serial_states, serial_bwd=serial_bwd,
                cp=rest + m + start, cp_worst=rest + m_exact + exact, warmup=warm, warmup_us=fixed, m=m, e=e,
                scan=scan_us, scan_method=scan, states=states, start=start, start_exact=exact, bwd=bwd, P=P, J=J,
                starts_saved=bool(starts_saved), states_saved=bool(states_saved))


def save_states_us(*, T: int, HV: int, K: int, V: int, fwd_us: float) -> float:
    """What saving every chunk state adds to a forward of `fwd_us` over T tokens (the constants'
    comment): ``max(SAVE_STATES_FACTOR x fwd_us, bytes / SAVE_STATES_TBPS)``."""
    return max(SAVE_STATES_FACTOR * fwd_us, T / BT * HV * K * V * 2 / (SAVE_STATES_TBPS * 1e6))


def _best(model, candidates, min_chunks: int, *, T: int, N: int, HV: int, K: int, V: int, sms: int, lengths,
          seq_len: Optional[int], force: bool, **kw) -> int:
    """The L among `candidates` that `model` (`predict` / `predict_bwd`) predicts fastest (``cp``) among those whose
    ``cp_worst`` (where the model has one) is at most WORST_MARGIN x the serial time, or 0 (serial) where it is not
    below MARGIN x the serial time or the longest sequence has fewer than `min_chunks` chunks. `force`: the fastest
    L regardless (0 only when no sequence is long enough to cut)."""
    chunks = _seq_chunks(T, N, lengths if seq_len is None else [seq_len] * N)
    longest = max(chunks, default=0)
    best, best_us, serial = 0, math.inf, None
    for L in candidates:
        if L >= longest:
            break
        p = model(T=T, N=N, HV=HV, K=K, V=V, L=L, sms=sms, lengths=lengths, seq_len=seq_len, **kw)
        serial = p["serial"]
        if not force and p.get("cp_worst", p["cp"]) > WORST_MARGIN * serial:
            continue
        if p["cp"] < best_us:
            best, best_us = L, p["cp"]
    if best == 0 or force:
        return best
    if longest < min_chunks or best_us >= MARGIN * serial:
        return 0
    return best


def choose_bwd(*, T: int, N: int, HV: int, K: int, V: int, sms: int, lengths=None, seq_len: Optional[int] = None,
               force: bool = False, warmup: Optional[bool] = None, starts_saved: bool = False,
               states_saved: bool = False) -> int:
    """The backward's partition length (chunks) by `predict_bwd` over `CANDIDATE_L_BWD`, or 0 (serial); `force`
    as in `choose`, `warmup`, `starts_saved` and `states_saved` as `predict_bwd` takes them."""
    return _best(predict_bwd, CANDIDATE_L_BWD, MIN_SEQ_CHUNKS_BWD, T=T, N=N, HV=HV, K=K, V=V, sms=sms,
                 lengths=lengths, seq_len=seq_len, force=force, warmup=warmup, starts_saved=starts_saved,
                 states_saved=states_saved)


def choose(*, T: int, N: int, HV: int, K: int, V: int, sms: int, lengths=None, seq_len: Optional[int] = None,
           force: bool = False, warmup: Optional[bool] = None) -> int:
    """The partition length (chunks) the cost model picks, or 0 (serial). `force`: the best L even where the
    model prefers the serial path (0 only when no sequence is long enough to cut). `warmup` as `predict` takes it."""
    return _best(predict, CANDIDATE_L, MIN_SEQ_CHUNKS, T=T, N=N, HV=HV, K=K, V=V, sms=sms, lengths=lengths,
                 seq_len=seq_len, force=force, warmup=warmup)


def _kernel_dims(K: int, V: int) -> bool:
    """Whether the scan kernel's head dims include (K, V) (K in (64, 128), V a multiple of 16 up to 1024)."""
    return K in (64, 128) and V % 16 == 0 and V <= 1024



# ------------------------------------------------------------------------------------------------ warm-up request

def parse_warmup(warmup) -> object:
    """The warm-up request as ``"auto"``, ``"off"``, ``"on"`` or a threshold (a float < 0).

    `warmup`: None (``FLASHDELTA_CP_WARMUP``, default auto), False / ``"off"``, True / ``"on"`` (at
    `WARMUP_THRESHOLD`), ``"auto"``, or a negative number (on, windows down to that summed log decay).
    ``FLASHDELTA_CP_WARMUP``: ``auto``, ``0`` / ``off``, ``1`` / ``on``, or a negative number."""
    if warmup is None:
        raw = os.environ.get(ENV_WARMUP, "auto").strip().lower() or "auto"
        if raw in ("auto", "off", "on"):
            return raw
        if raw in ("0", "false"):
            return "off"
        if raw in ("1", "true"):
            return "on"
        try:
            thr = float(raw)
        except ValueError:
            thr = math.nan
        if not thr < 0:
            raise ValueError(f"{ENV_WARMUP}={raw!r}: expected auto, 0 (off), 1 (on) or a negative threshold")
        return thr
    if isinstance(warmup, bool):
        return "on" if warmup else "off"
    if isinstance(warmup, str) and warmup in ("auto", "off", "on"):
        return warmup
    if isinstance(warmup, (int, float)) and not isinstance(warmup, bool):
        if not warmup < 0:
            raise ValueError(f"warmup: a threshold must be a negative summed log decay, got {warmup}")
        return float(warmup)
    raise TypeError(f"warmup must be None, a bool, 'auto' / 'on' / 'off' or a negative float, got {warmup!r}")


def warmup_threshold(request, dtype: torch.dtype) -> Optional[float]:
    """The threshold the warm-up uses for a call whose q has `dtype` (None: the exact path for every head), from a
    `parse_warmup` request: ``auto`` warms up at `WARMUP_THRESHOLD` where dtype is in `WARMUP_DTYPES`."""
    if request == "off":
        return None
    if request == "auto":
        return WARMUP_THRESHOLD if dtype in WARMUP_DTYPES else None
    if request == "on":
        return WARMUP_THRESHOLD
    return float(request)
