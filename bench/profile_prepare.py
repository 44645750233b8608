"""Phase timeline of the SM90 prepare kernel (development tool, NOTES-gpu.md).

    source .device/bootstrap.sh; python3 bench/profile_prepare.py [--tokens 32768] [--heads 16/64]

Times `prepare_fwd` (CUDA events, median), then runs the profiled build (`prepare.prepare_fwd_profiled`) on the
same inputs and prints, over the sampled CTAs (key head 0, chunk slots < PROF_SLOTS), the median time of each phase
(from the previous phase end, ns; "inverse" is warp 0's heads), the CTA lifetime, and how many sampled CTAs
were alive at once. Checks that the profiled build's outputs equal the plain build's.
"""
from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))


def analyse(tl, events):
    from profile_fwd import median, quant

    """Lines of the report from a [CTAs, events] int list (rows with a zero start stamp skipped)."""
    ix = {e: i for i, e in enumerate(events)}
    rows = [r for r in tl if r[ix["m.clk0"]] != 0 and r[ix["m.clk1"]] != 0]
    if not rows:
        return ["no sampled CTA recorded a timeline"]
    ghz = median([(r[ix["m.clk1"]] - r[ix["m.clk0"]]) / max(1, r[ix["m.gt1"]] - r[ix["m.gt0"]]) for r in rows])
    order = ["m.clk0", "found", "loaded", "kkt", "split", "cumsum", "inverse", "m.clk1"]
    out = [f"{len(rows)} sampled CTAs, clock {ghz:.3f} GHz; phase = time since the previous phase end (thread 0)"]
    out.append(f"  {'phase':<12} {'median ns':>10} {'p10':>8} {'p90':>8}")
    for a, b in zip(order, order[1:]):
        d = [(r[ix[b]] - r[ix[a]]) / ghz for r in rows if r[ix[a]] and r[ix[b]]]
        if d:
            out.append(f"  {b:<12} {median(d):>10.0f} {quant(d, 0.1):>8.0f} {quant(d, 0.9):>8.0f}")
    life = [r[ix["m.gt1"]] - r[ix["m.gt0"]] for r in rows]
    out.append(f"  CTA lifetime (globaltimer): median {median(life):.0f} ns, "
               f"p10 {quant(life, 0.1):.0f}, p90 {quant(life, 0.9):.0f}")
    spans = [(r[ix["m.gt0"]], r[ix["m.gt1"]]) for r in rows]
    conc = [sum(1 for a, b in spans if a <= t < b) for t, _ in spans]
    out.append(f"  sampled CTAs alive at each one's start: median {median(conc):.0f}, max {max(conc)}")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--heads", default="16/64", help="H/HV")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()

    import torch

    from flashdelta.kernels import prepare
    from profile_fwd import cuda_time, make_inputs

    H, HV = (int(x) for x in args.heads.split("/"))
    q, k, v, gc, beta, A, h0, cu = make_inputs(args.tokens, H, HV)
    g = torch.nn.functional.logsigmoid(torch.randn_like(gc)) / 16
    gc0, A0 = prepare.prepare_fwd(k, g, beta, cu)
    ms = cuda_time(lambda: prepare.prepare_fwd(k, g, beta, cu), args.reps)
    gc1, A1, tl = prepare.prepare_fwd_profiled(k, g, beta, cu)
    torch.cuda.synchronize()
    same = torch.equal(gc0, gc1) and torch.equal(A0, A1)
    print(f"{torch.cuda.get_device_name()} | prepare_fwd H={H} HV={HV} K=128 T={args.tokens}: {ms:.4f} ms; "
          f"profiled outputs equal the plain build's: {same}")
    if os.environ.get("OUT"):
        torch.save({"events": prepare.PROF_EVENTS, "timeline": tl.cpu()},
                   os.path.join(os.environ["OUT"], "profile_prepare_timeline.pt"))
    print("\n".join(analyse(tl.cpu().tolist(), prepare.PROF_EVENTS)))


if __name__ == "__main__":
    main()
