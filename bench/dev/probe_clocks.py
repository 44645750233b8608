"""The SM clock, power and throttle reasons while a forward runs back to back, by head config and what runs.

    source .device/bootstrap.sh; python3 -u bench/dev/probe_clocks.py [--heads 16/64,8/32,2/8] [--seqlens 32768]
        [--what fused,forward,flashinfer] [--seconds 3]

For each head config and sequence lengths (`--seqlens`: "32768" or "8192x4"), each of `--what` runs back to back for
--seconds while `nvidia-smi` samples clocks, power and throttle reasons every 50 ms: `fused` the launcher's fused
kernel alone (`chunk_fwd`, prepare's outputs computed once beforehand), `forward` the public forward (prepare
included), `flashinfer` FlashInfer's SM90 prefill through the benchmark's provider (its conventions converted
once, outside the loop). Printed per row: the median time, the period per chunk and CTA-slot (the time over the
longest sequence's chunks), and the samples' median SM clock, power and throttle reasons. Whether FlashInfer's
forward runs at a higher clock than ours at full occupancy tests the energy-per-chunk reading of the fused
forward's period (docs/dev/fused_fwd.md); what it found on the H200 is there.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, BENCH)
sys.path.insert(0, os.path.join(os.path.dirname(BENCH), "src"))

QUERY = "timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--heads", default="16/64,8/32,2/8")
    ap.add_argument("--seqlens", default="32768", help='one sequence length, or "LENxN" for N sequences')
    ap.add_argument("--what", default="fused", help="comma list of fused, forward, flashinfer")
    ap.add_argument("--seconds", type=float, default=3.0)
    args = ap.parse_args()

    import torch

    from providers import make_inputs

    smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits", "-lms", "50"],
                           stdout=subprocess.PIPE, text=True)
    windows, results = [], []
    length, _, n = args.seqlens.partition("x")
    seqlens = (int(length),) * int(n or 1)
    for spec in args.heads.split(","):
        H, HV = (int(x) for x in spec.split("/"))
        x = make_inputs(seqlens, H, HV, seed=0)
        for what in args.what.split(","):
            kern = _runner(what, x)
            kern()
            torch.cuda.synchronize()
            time.sleep(1.0)                                # let the clock settle between rows
            t_start, times = time.time(), []
            while time.time() - t_start < args.seconds:
                evs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(20)]
                for a, b in evs:
                    a.record()
                    kern()
                    b.record()
                torch.cuda.synchronize()
                times += [a.elapsed_time(b) for a, b in evs]
            label = f"{spec} {what}"
            windows.append((label, t_start + 0.5, time.time()))   # skip the first half second
            results.append((label, 2 * HV * len(seqlens), statistics.median(times), len(times)))
            print(f"{label}: {statistics.median(times):.4f} ms over {len(times)} launches", flush=True)
    smi.terminate()
    lines = smi.communicate()[0].strip().splitlines()
    samples = []
    for line in lines:
        parts = [p.strip() for p in line.split(",")]
        try:
            ts = time.mktime(time.strptime(parts[0].split(".")[0], "%Y/%m/%d %H:%M:%S"))
            samples.append((ts, float(parts[1]), float(parts[2]), float(parts[3]), float(parts[4]), parts[5]))
        except (ValueError, IndexError):
            continue
    nt = (max(seqlens) + 63) // 64
    print(f"\n{torch.cuda.get_device_name()} | {args.seqlens} tokens, back-to-back launches (CTAs: the default "
          "build's 2 per sequence and value head)")
    print(f"{'heads':>20} {'CTAs':>5} {'ms':>8} {'us/chunk':>9} {'SM MHz':>7} {'mem MHz':>8} {'W':>6} {'C':>4}"
          "  throttle")
    for (spec, ctas, ms, _), (_, t0, t1) in zip(results, windows):
        sel = [s for s in samples if t0 - 1 <= s[0] <= t1]
        if not sel:
            print(f"{spec:>20} {ctas:>5} {ms:>8.4f} {ms * 1e3 / nt:>9.3f}  (no nvidia-smi samples)")
            continue
        med = [statistics.median(s[i] for s in sel) for i in (1, 2, 3, 4)]
        reasons = sorted({s[5] for s in sel})
        print(f"{spec:>20} {ctas:>5} {ms:>8.4f} {ms * 1e3 / nt:>9.3f} {med[0]:>7.0f} {med[1]:>8.0f} {med[2]:>6.0f} "
              f"{med[3]:>4.0f}  {' '.join(reasons)}")


def _runner(what: str, x):
    """A no-argument callable running `what` on inputs `x` (one-time conversions done here)."""
    import flashdelta
    from flashdelta.kernels import fused_fwd, prepare
    from providers import get

    if what == "fused":
        g_cumsum, A = prepare.prepare_fwd(x.k, x.g, x.beta, x.cu)
        return lambda: fused_fwd.chunk_fwd(x.q, x.k, x.v, g_cumsum, x.beta, A, x.h0, x.cu, scale=x.scale)
    if what == "forward":
        return lambda: flashdelta.chunk_gated_delta_rule(x.q, x.k, x.v, x.g, x.beta, scale=x.scale, initial_state=x.h0,
                                                         output_final_state=True, cu_seqlens=x.cu,
                                                         cu_seqlens_cpu=x.cu_host)
    if what == "flashinfer":
        fi = get(["flashinfer"])["flashinfer"]
        why = fi.load()
        if why:
            raise SystemExit(f"flashinfer: {why}")
        fi.prepare(x)
        return lambda: fi.forward(x)
    raise SystemExit(f"--what: unknown {what!r}; use fused, forward or flashinfer")


if __name__ == "__main__":
    main()
