"""Per-role timelines of the SM90 kernels on a GPU (recorded by kernels/timeline.py).

    source .device/bootstrap.sh; python3 bench/dev/timeline.py [--kernel fused_fwd,prepare_oneshot,prepare_pipe,chunk_bwd]
        [--heads 16/64] [--tokens 8192]
    TILELANG_CACHE_DIR=.cache/tl-ship python3 bench/dev/timeline.py --compile-only    # CPU: the instrumented builds

For each kernel: times the plain launcher (CUDA events, median), runs it again inside a recording (the instrumented
build on the same inputs; its outputs must equal the plain ones bit for bit) and prints, per role, the median time
from the role's previous event to each event over the steady-state steps (the first and last two left out) of the
recorded CTAs, what ended there (from the kernel's table: "wait ..." is a returned wait), the role's period per step
and the share of it spent in waits. Kernels with one step per CTA (prepare_oneshot) get the phase times, the CTA
lifetime and how many recorded CTAs ran at once. Timestamps are %clock64 of the CTA's SM, converted with the clock
rate each CTA measured (clock64 vs %globaltimer). With $OUT set the raw buffers go to $OUT/timeline_<kernel>.pt.

--compile-only builds the instrumented kernels with a fake buffer address (only the compile is checked; the GPU run
records at the real buffer's address, a separate build).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "src"))

FAKE_ADDRESS = 0x7F0000001000


def _median(xs):
    return statistics.median(xs) if xs else float("nan")


def _quant(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else float("nan")


def analyse(table, buf) -> list:
    """Report lines for one recording: `buf` is the int [ctas, steps, entries] list of `table`'s layout."""
    ix = {n: i for i, n in enumerate(table.names)}
    ctas = [b for b in range(table.ctas) if buf[b][0][ix["m.clk0"]] and buf[b][0][ix["m.clk1"]]]
    if not ctas:
        return [f"{table.kernel}: no recorded CTA"]
    rate = {b: (buf[b][0][ix["m.clk1"]] - buf[b][0][ix["m.clk0"]]) / max(1, buf[b][0][ix["m.gt1"]] -
                                                                         buf[b][0][ix["m.gt0"]]) for b in ctas}
    ghz = _median(list(rate.values()))
    lines = [f"{table.kernel}: {len(ctas)} CTAs recorded, clock {ghz:.3f} GHz, {table.value}: "
             f"{[buf[b][0][ix['m.value']] for b in ctas][:8]}"]
    if table.steps == 1:
        return lines + _phases(table, buf, ctas, rate, ix)
    for role, (title, thread) in table.roles.items():
        events = [e for e in table.events if e[0] == role]
        deltas, periods = {}, []
        for b in ctas:
            n = min(table.steps, buf[b][0][ix["m.value"]])     # the CTA's steps (chunks, items)
            lo, hi = 2, n - 2
            recs = sorted((buf[b][s][ix[e]], e, s) for s in range(n) for e in events if buf[b][s][ix[e]])
            for (t0, e0, s0), (t1, e1, s1) in zip(recs, recs[1:]):
                if lo <= s1 < hi:
                    deltas.setdefault((e0, s0 - s1, e1), []).append((t1 - t0) / rate[b])
            first = [t for t, e, s in recs if e == events[0] and lo <= s < hi]
            periods += [(y - x) / rate[b] for x, y in zip(first, first[1:])]
        if not deltas:
            continue
        period = _median(periods)
        rows = sorted(deltas.items(), key=lambda kv: (events.index(kv[0][2]), -len(kv[1])))
        keep = [(k, xs) for k, xs in rows if len(xs) >= max(2, len(periods) // 4)]   # rare orderings left out
        wait = sum(_median(xs) for (_, _, e), xs in keep if table.events[e].startswith("wait"))
        lines.append(f"{title} (thread {thread}): period {period:.0f} ns/step (p10 {_quant(periods, .1):.0f}, "
                     f"p90 {_quant(periods, .9):.0f}), waiting {100 * wait / period:.0f}%")
        lines.append(f"  {'event':12s} {'since':16s} {'median':>7s} {'p10':>7s} {'p90':>7s} {'share':>6s}     n  what")
        for (e0, ds, e1), xs in keep:
            since = f"{e0}[{'s' if ds == 0 else f's{ds:+d}'}]"
            med = _median(xs)
            lines.append(f"  {e1:12s} {since:16s} {med:7.0f} {_quant(xs, .1):7.0f} {_quant(xs, .9):7.0f} "
                         f"{100 * med / period:5.0f}% {len(xs):5d}  {table.events[e1]}")
    return lines


def _phases(table, buf, ctas, rate, ix) -> list:
    """One step per CTA: each phase from the previous one, the CTA lifetime, recorded CTAs alive at once."""
    order = ["m.clk0"] + list(table.events) + ["m.clk1"]
    out = [f"  {'phase':12s} {'median ns':>10s} {'p10':>8s} {'p90':>8s}  what"]
    for a, b in zip(order, order[1:]):
        d = [(buf[c][0][ix[b]] - buf[c][0][ix[a]]) / rate[c] for c in ctas if buf[c][0][ix[a]] and buf[c][0][ix[b]]]
        if d:
            out.append(f"  {b:12s} {_median(d):10.0f} {_quant(d, .1):8.0f} {_quant(d, .9):8.0f}  "
                       f"{table.events.get(b, 'end')}")
    spans = [(buf[c][0][ix["m.gt0"]], buf[c][0][ix["m.gt1"]]) for c in ctas]
    life = [y - x for x, y in spans]
    alive = [sum(1 for x, y in spans if x <= t < y) for t, _ in spans]
    out.append(f"  CTA lifetime {_median(life):.0f} ns (p10 {_quant(life, .1):.0f}, p90 {_quant(life, .9):.0f}); "
               f"recorded CTAs alive at each one's start: median {_median(alive):.0f}, max {max(alive)}")
    return out


def make_inputs(T, H, HV, K=128, V=128, device="cuda"):
    import torch
    import torch.nn.functional as F

    gen = torch.Generator(device=device).manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device)

    q = F.normalize(randn(1, T, H, K), dim=-1).bfloat16()
    k = F.normalize(randn(1, T, H, K), dim=-1).bfloat16()
    v = randn(1, T, HV, V).bfloat16()
    g = F.logsigmoid(randn(1, T, HV)) / 16
    beta = torch.sigmoid(randn(1, T, HV))
    h0 = randn(1, HV, K, V)
    cu = torch.tensor([0, T], dtype=torch.int32, device=device)
    return q, k, v, g, beta, h0, cu


def runners(H, HV, T):
    """kernel name -> (its timeline table, a no-argument call of its launcher returning the outputs)."""
    import torch

    from flashdelta.kernels import chunk_bwd, fused_fwd, prepare, prepare_oneshot, prepare_pipe

    q, k, v, g, beta, h0, cu = make_inputs(T, H, HV)
    gc, A = prepare.prepare_fwd(k, g, beta, cu)
    h = fused_fwd.state_recompute(k, v, gc, beta, A, h0, cu)
    gen = torch.Generator(device="cuda").manual_seed(1)
    do = torch.randn(v.shape, generator=gen, device="cuda").bfloat16()
    dht = torch.randn(h0.shape, generator=gen, device="cuda")
    return {
        "chunk_bwd": (chunk_bwd.TABLE, lambda: chunk_bwd.chunk_bwd(q, k, v, gc, beta, A, h, do, dht, cu,
                                                                   scale=128 ** -0.5)),
        "fused_fwd": (fused_fwd.TABLE, lambda: fused_fwd.chunk_fwd(q, k, v, gc, beta, A, h0, cu, scale=128 ** -0.5)),
        "prepare_oneshot": (prepare_oneshot.TABLE, lambda: prepare.prepare_fwd(k, g, beta, cu, persistent=False)),
        "prepare_pipe": (prepare_pipe.TABLE, lambda: prepare.prepare_fwd(k, g, beta, cu, persistent=True)),
    }


def compile_only(names, H, HV):
    """The instrumented builds of these kernels for the heads, on a fake buffer address (no GPU)."""
    import torch

    from flashdelta.kernels import chunk_bwd, fused_fwd, prepare_oneshot, prepare_pipe, timeline

    b, f = torch.bfloat16, torch.float32
    builds = {"chunk_bwd": (chunk_bwd, chunk_bwd.builder_args(H, HV, 128, 128, b, f, 128 ** -0.5, True, False)),"fused_fwd": (fused_fwd, fused_fwd.builder_args(H, HV, 128, 128, b, f, f, 128 ** -0.5, True, False)),
              "prepare_oneshot": (prepare_oneshot, prepare_oneshot.builder_args(H, HV, 128, b, f)),
              "prepare_pipe": (prepare_pipe, prepare_pipe.builder_args(H, HV, 128, b, f))}
    for name in names:
        module, args = builds[name]
        with timeline.record(module.TABLE, address=FAKE_ADDRESS):
            src = module.build(*args).get_kernel_source()
        print(f"{name}: instrumented build compiles ({src.count('fd_tl_stamp(') - 1} marks)", flush=True)


def cuda_ms(fn, reps):
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
    return _median(xs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kernel", default="fused_fwd,prepare_oneshot,prepare_pipe", help="comma-separated; also chunk_bwd")
    ap.add_argument("--heads", default="16/64", help="H/HV")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--compile-only", action="store_true")
    args = ap.parse_args()
    names = args.kernel.split(",")
    H, HV = (int(x) for x in args.heads.split("/"))
    if args.compile_only:
        compile_only(names, H, HV)
        return 0

    import torch

    from flashdelta.kernels import timeline

    print(f"{torch.cuda.get_device_name()} | H={H} HV={HV} K=V=128 T={args.tokens}", flush=True)
    run = runners(H, HV, args.tokens)
    for name in names:
        table, fn = run[name]
        ms = cuda_ms(fn, args.reps)
        plain = fn()
        with timeline.record(table) as rec:
            ms_rec = cuda_ms(fn, args.reps)        # the recording's buffer keeps the last call's stamps
            out = fn()
            torch.cuda.synchronize()
        same = all(torch.equal(a, b) for a, b in zip(plain, out))
        print(f"\n== {name}: {ms:.4f} ms plain, {ms_rec:.4f} ms recorded ({100 * (ms_rec / ms - 1):+.1f}%); "
              f"outputs equal: {same}")
        buf = rec.buffer.cpu()
        if os.environ.get("OUT"):
            torch.save({"names": table.names, "events": table.events, "buffer": buf},
                       os.path.join(os.environ["OUT"], f"timeline_{name}.pt"))
        print("\n".join(analyse(table, buf.tolist())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
