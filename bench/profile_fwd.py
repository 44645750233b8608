"""Per-role timeline of one CTA of the fused SM90 forward (development tool, NOTES-gpu.md "per-role timeline").

    source .device/bootstrap.sh; python3 bench/profile_fwd.py [--tokens 8192] [--heads 16/64] [--plain-order]

Builds TP1-like inputs (H=16, HV=64, K=V=128, one 8192-token sequence, bf16 q/k/v/A, fp32 g_cumsum/beta/h0; A is
the WY inverse computed with torch), compiles and times the plain `chunk_fwd` and the profiled
`fused_fwd.chunk_fwd_profiled` (CUDA events, median), then reads the timeline of CTAs 0 and 1
(sequence 0, value head 0, both V slices) and prints:

1. per role, for each event: the median time since that role's previous event (ns), over steady-state chunks;
2. per chunk window of each warpgroup, the time split into waits (and on whom) and own work;
3. last, a short summary: us/chunk plain vs profiled, each role's period, and what the state WG waits on.

Timestamps are %clock64 of the CTA's SM (all roles of a CTA share it), converted to ns with the clock rate that
the kernel measured itself (clock64 vs %globaltimer over the state warpgroup's lifetime). With $OUT set the raw
timeline is saved to $OUT/profile_fwd_timeline.pt (events, timeline, GHz) for later analysis.
The analysis functions take a plain [CTAs, chunks, events] int array, so they run on CPU data too.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))

ROLES = {"s": "state WG (thread 0)", "p": "prep WG (thread 128)", "l": "load warp (thread 256)",
         "w": "store warp (thread 288)"}
# what a role is doing in the interval that ends at each event: a wait on another role, a wait on its own
# wgmma (which includes the issue work just before it), or its own work
WAIT_ON = {
    "s.full": "wait full (producer/TMA)", "s.prep": "wait prep_done (prep WG)",
    "s.o_empty": "wait o_empty (store warp)",
    "s.vd_done": "own wgmma", "s.tail": "own wgmma", "s.fin_o1": "own wgmma",
    "p.full": "wait full (producer/TMA)", "p.pout": "wait pout_empty (state WG)",
    "p.qk_done": "own wgmma", "p.ew_done": "element-wise",
    "l.empty": "wait empty (state WG)", "l.qk_slot": "wait empty q/k (state WG)",
    "w.o_full": "wait o_full (state WG)",
}


WHAT = {
    "s.vd_issued": "S -> bf16, Y = S0^T K^T, state scaled, wait, Y -> bf16, Y Ae^T issued",
    "s.fin_begin": "loop top", "s.fin_end": "O scaled by dq, O += Vd Pg^T issued",
    "s.released": "empty/pout_empty arrives", "s.o_staged": "O^T -> o_s (transposed), o_full arrive",
    "p.begin": "loop top", "p.qk_issued": "Q K^T issued, A tile and g/beta to registers",
    "p.stored": "Ae/Ag/Pg/r/dq/e_L stored", "p.done": "fence, prep_done arrive",
    "l.begin": "loop top", "l.va_issued": "v/A TMA issued",
    "l.issued": "q/k TMA issued, full arrive", "w.begin": "loop top", "w.stored": "o rows to global, o_empty arrive",
}


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def quant(xs, q):
    xs = sorted(xs)
    if not xs:
        return float("nan")
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def role_records(tl, events, b, role, chunks):
    """Sorted [(t, event, chunk)] of one role of CTA b over the given chunks (unwritten entries skipped)."""
    recs = []
    for c in chunks:
        for e, name in enumerate(events):
            if name[0] == role and int(tl[b][c][e]) != 0:
                recs.append((int(tl[b][c][e]), name, c))
    recs.sort()
    return recs


def event_deltas(recs):
    """{(prev event, chunk offset, event): [cycles]} from one role's time-sorted records."""
    out = {}
    for (t0, e0, c0), (t1, e1, c1) in zip(recs, recs[1:]):
        out.setdefault((e0, c0 - c1, e1), []).append(t1 - t0)
    return out


def windows(recs, anchor):
    """Split a role's records into windows (anchor(c), anchor(c+1)]; per window {class: cycles}."""
    out = []
    cur = None
    for (t0, e0, _), (t1, e1, c1) in zip(recs, recs[1:]):
        if cur is not None:
            cls = WAIT_ON.get(e1, "own work")
            cur[1][cls] = cur[1].get(cls, 0) + (t1 - t0)
        if e1 == anchor:
            if cur is not None:
                out.append(cur)
            cur = (c1, {})
    return out


def analyse(tl, events, nt, ghz, steady=(2, 2)):
    """Text report (list of lines) and a summary dict for a timeline [CTAs, chunks, events] of clock64 values.

    Statistics pool the steady-state chunks (the first and last `steady` chunks left out) of every profiled CTA.
    """
    lines, summary = [], {}
    n = min(nt, len(tl[0]))
    lo, hi = steady[0], n - steady[1]
    if hi - lo < 4:
        return [f"too few chunks recorded ({n}) for a steady-state window"], summary
    ns = 1.0 / ghz
    ctas = range(len(tl))
    idx = {e: i for i, e in enumerate(events)}
    lines.append(f"chunks {lo}..{hi - 1} of {n} (steady state) of CTAs {list(ctas)}, pooled; clock {ghz:.3f} GHz; "
                 f"'since' = the role's previous event, [c-1] = of the previous chunk")
    for role, title in ROLES.items():
        per_cta = [role_records(tl, events, b, role, range(n)) for b in ctas]
        if all(len(r) < 2 for r in per_cta):
            continue
        deltas, periods, order = {}, [], []
        for recs in per_cta:
            if not recs:
                continue
            for key, xs in event_deltas([r for r in recs if lo <= r[2] < hi]).items():
                deltas.setdefault(key, []).extend(xs)
            first = recs[0][1]   # period: between consecutive occurrences of the role's first event
            ts = [t for t, e, c in recs if e == first and lo <= c < hi]
            periods += [(b_ - a_) * ns for a_, b_ in zip(ts, ts[1:])]
            for t, e, c in recs:
                if lo + 1 <= c < hi - 1 and e not in order:
                    order.append(e)
        period = median(periods)
        summary[role] = period
        lines.append(f"{title}: period {period:.0f} ns/chunk (p10 {quant(periods, .1):.0f}, "
                     f"p90 {quant(periods, .9):.0f})")
        lines.append(f"  {'event':13s} {'since':17s} {'median':>7s} {'p10':>7s} {'p90':>7s} {'share':>6s}     n  what")
        rows = sorted(deltas.items(), key=lambda kv: (order.index(kv[0][2]) if kv[0][2] in order else 99,
                                                      -len(kv[1])))
        for (e0, dc, e1), xs in rows:
            if len(xs) < max(2, len(ctas) * (hi - lo) // 4):  # rare orderings (prologue, jitter) left out
                continue
            since = f"{e0}[{'c' if dc == 0 else f'c{dc:+d}'}]"
            med = median(xs) * ns
            lines.append(f"  {e1:13s} {since:17s} {med:7.0f} {quant(xs, .1) * ns:7.0f} {quant(xs, .9) * ns:7.0f} "
                         f"{100 * med / period:5.0f}% {len(xs):5d}  {WAIT_ON.get(e1, WHAT.get(e1, ''))}")
    # where each warpgroup's period goes, window by window
    for role, anchor in (("s", "s.prep"), ("p", "p.done")):
        wins = []
        for b in ctas:
            wins += [w for w in windows(role_records(tl, events, b, role, range(n)), anchor) if lo <= w[0] < hi]
        if not wins:
            continue
        classes = sorted({k for _, d in wins for k in d}, key=lambda k: -median([d.get(k, 0) for _, d in wins]))
        dominant = {}
        for _, d in wins:
            k = max(d, key=d.get)
            dominant[k] = dominant.get(k, 0) + 1
        lines.append(f"{ROLES[role]}, window {anchor}[c] -> {anchor}[c+1] ({len(wins)} windows):")
        for k in classes:
            xs = [d.get(k, 0) * ns for _, d in wins]
            lines.append(f"  {k:30s} median {median(xs):6.0f} ns  p90 {quant(xs, .9):6.0f}  "
                         f"largest in {dominant.get(k, 0)}/{len(wins)}")
            summary[f"{role}:{k}"] = median(xs)

    def lag(a, da, bb, db):
        xs = []
        for b in ctas:
            for c in range(max(lo, -da, -db), hi):
                ta, tb = int(tl[b][c + da][idx[a]]), int(tl[b][c + db][idx[bb]])
                if ta and tb:
                    xs.append((tb - ta) * ns)
        return xs

    lines.append("hand-offs, median ns (p10..p90); about the wake-up latency when the later role was waiting:")
    for label, xs in (
        ("prep p.done[c] -> state s.prep[c]", lag("p.done", 0, "s.prep", 0)),
        ("state s.released[c-2] -> prep p.pout[c]", lag("s.released", -2, "p.pout", 0)),
        ("load l.issued[c] -> prep p.full[c]", lag("l.issued", 0, "p.full", 0)),
        ("load l.issued[c] -> state s.full[c]", lag("l.issued", 0, "s.full", 0)),
        ("state s.released[c-3] -> load l.empty[c]", lag("s.released", -3, "l.empty", 0)),
        ("state s.o_staged[c] -> store w.o_full[c]", lag("s.o_staged", 0, "w.o_full", 0)),
    ):
        if xs:
            lines.append(f"  {label:42s} {median(xs):7.0f}  ({quant(xs, .1):.0f}..{quant(xs, .9):.0f})")
    # verdict: the warpgroup that waits least on the others sets the pace
    waits = {}
    for role in ("s", "p"):
        if role in summary:
            w = sum(v for k, v in summary.items() if k.startswith(role + ":wait"))
            waits[role] = w / summary[role] if summary[role] else float("nan")
    if len(waits) == 2:
        r = min(waits, key=waits.get)
        other = "p" if r == "s" else "s"
        top = max((k for k in summary if k.startswith(r + ":")), key=lambda k: summary[k])
        summary["verdict"] = (f"pace set by the {ROLES[r].split(' (')[0]} (waits on others {100 * waits[r]:.0f}% of "
                              f"its period vs {100 * waits[other]:.0f}% for the "
                              f"{ROLES[other].split(' (')[0]}); its largest item: {top.split(':', 1)[1]}")
    return lines, summary


def print_summary(summary, ms_plain, ms_prof, nt):
    """The short table printed last."""
    print("\n=== summary (medians over steady-state chunks of the profiled CTAs) ===")
    print(f"{'plain kernel':34s} {ms_plain * 1e3 / nt:7.3f} us/chunk  ({ms_plain * 1e3:.1f} us per call)")
    print(f"{'profiled kernel':34s} {ms_prof * 1e3 / nt:7.3f} us/chunk  ({ms_prof * 1e3:.1f} us per call, "
          f"{100 * (ms_prof / ms_plain - 1):+.1f}% vs plain)")
    for role, title in ROLES.items():
        if role in summary:
            print(f"{title + ' period':34s} {summary[role] / 1e3:7.3f} us/chunk")
            for key in sorted((k for k in summary if k.startswith(role + ":")), key=lambda k: -summary[k]):
                print(f"  {key.split(':', 1)[1]:32s} {summary[key] / 1e3:7.3f} us/chunk")
    if "verdict" in summary:
        print(summary["verdict"])


def make_inputs(T, H, HV, K=128, V=128, seed=0, device="cuda"):
    import torch
    import torch.nn.functional as F

    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32)

    BT = 64
    q = F.normalize(randn(1, T, H, K), dim=-1).bfloat16()
    k = F.normalize(randn(1, T, H, K), dim=-1).bfloat16()
    v = randn(1, T, HV, V).bfloat16()
    g = F.logsigmoid(randn(1, T, HV)) / 16
    beta = torch.sigmoid(randn(1, T, HV))
    h0 = randn(1, HV, K, V)
    cu = torch.tensor([0, T], dtype=torch.int32, device=device)
    NT = (T + BT - 1) // BT
    pad = NT * BT - T
    gp = F.pad(g, (0, 0, 0, pad)).view(NT, BT, HV)
    g_cumsum = gp.cumsum(1).view(1, NT * BT, HV)[:, :T].contiguous()
    # A = (I + strictly_lower(diag(beta) K K^T))^-1 per (chunk, value head), key head hv // (HV / H)
    kc = F.pad(k.float(), (0, 0, 0, 0, 0, pad)).view(NT, BT, H, K).permute(0, 2, 1, 3)       # [NT, H, BT, K]
    kk = (kc @ kc.transpose(-1, -2)).repeat_interleave(HV // H, dim=1)                        # [NT, HV, BT, BT]
    bc = F.pad(beta, (0, 0, 0, pad)).view(NT, BT, HV).permute(0, 2, 1)                       # [NT, HV, BT]
    L = torch.tril(kk * bc[..., None], diagonal=-1)
    eye = torch.eye(BT, device=device).expand_as(L)
    Ainv = torch.linalg.solve_triangular(eye + L, eye, upper=False, unitriangular=True)      # [NT, HV, BT, BT]
    A = Ainv.permute(0, 2, 1, 3).reshape(1, NT * BT, HV, BT)[:, :T].bfloat16().contiguous()
    return q, k, v, g_cumsum, beta, A, h0, cu


def cuda_time(fn, reps):
    import torch

    fn()
    torch.cuda.synchronize()
    xs = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        xs.append(a.elapsed_time(b))
    return median(xs)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--heads", default="16/64", help="H/HV")
    ap.add_argument("--plain-order", action="store_true", help="profile the overlap=False state WG order")
    ap.add_argument("--early-release", type=int, choices=(0, 1), default=None,
                    help="override the launcher's early release (default: fused_fwd.EARLY_RELEASE)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--no-plain", action="store_true", help="skip compiling/timing the uninstrumented kernel")
    args = ap.parse_args()

    import time

    import torch

    from flashdelta.kernels import fused_fwd as ff

    H, HV = (int(x) for x in args.heads.split("/"))
    T = args.tokens
    NT = (T + 63) // 64
    early = ff.EARLY_RELEASE if args.early_release is None else bool(args.early_release)
    print(f"device {torch.cuda.get_device_name()} | H={H} HV={HV} K=V=128 T={T} ({NT} chunks), "
          f"{(HV * 128 // ff.BLOCK_V)} CTAs | overlap={not args.plain_order} early_release={early}", flush=True)
    q, k, v, gc, beta, A, h0, cu = make_inputs(T, H, HV)
    scale = 128 ** -0.5
    kw = dict(scale=scale)
    t0 = time.time()
    if not args.no_plain:
        o_ref, ht_ref = ff.chunk_fwd(q, k, v, gc, beta, A, h0, cu, **kw)
    prof_kw = dict(kw, overlap=not args.plain_order, early_release=early)
    o, ht, tl = ff.chunk_fwd_profiled(q, k, v, gc, beta, A, h0, cu, **prof_kw)
    torch.cuda.synchronize()
    print(f"compiled + first calls in {time.time() - t0:.1f} s", flush=True)

    # time the kernels alone (the launchers also allocate outputs; the profiled one zero-fills its timeline)
    args_plain = ff.builder_args(H, HV, 128, 128, q.dtype, beta.dtype, h0.dtype, scale, True, False)
    k_prof = ff.build(args_plain, overlap=prof_kw["overlap"], early_release=early, profile=True)
    bufs, pbuf = (torch.empty_like(o), torch.empty_like(ht)), torch.zeros_like(tl)
    ms_prof = cuda_time(lambda: k_prof(q, k, v, gc, beta, A, h0, cu, *bufs, pbuf), args.reps)
    ms_plain = float("nan")
    if not args.no_plain:
        k_plain = ff.build(args_plain)
        ms_plain = cuda_time(lambda: k_plain(q, k, v, gc, beta, A, h0, cu, *bufs), args.reps)
        d_o = (o.float() - o_ref.float()).abs().max().item()
        d_h = (ht - ht_ref).abs().max().item()
        print(f"profiled vs plain: max |do| {d_o:.3g}, max |dht| {d_h:.3g} (expect 0 or rounding-level)")
    # one more call for the timeline (a fresh zero-filled buffer per call)
    o, ht, tl = ff.chunk_fwd_profiled(q, k, v, gc, beta, A, h0, cu, **prof_kw)
    torch.cuda.synchronize()
    tl = tl.cpu()
    ev = list(ff.PROF_EVENTS)
    i = {e: n for n, e in enumerate(ev)}
    m = tl[0, 0]
    ghz = float(m[i["m.clk1"]] - m[i["m.clk0"]]) / max(1.0, float(m[i["m.gt1"]] - m[i["m.gt0"]]))
    if not 0.5 < ghz < 3.0:
        print(f"clock calibration implausible ({ghz:.3f} GHz); assuming 1.98 GHz")
        ghz = 1.98
    nt_rec = int(m[i["m.nt"]])
    if os.environ.get("OUT"):
        path = os.path.join(os.environ["OUT"], "profile_fwd_timeline.pt")
        torch.save({"events": ev, "timeline": tl, "ghz": ghz, "nt": nt_rec, "ms_plain": ms_plain,
                    "ms_profiled": ms_prof, "args": vars(args)}, path)
        print(f"saved {path}")
    lines, summary = analyse(tl.tolist(), ev, nt_rec, ghz)
    print("\n".join(lines))

    print_summary(summary, ms_plain, ms_prof, NT)


if __name__ == "__main__":
    main()
