"""The SM clock, power and throttle reasons while the fused forward runs back to back, by head config.

    source .device/bootstrap.sh; python3 -u bench/dev/probe_clocks.py [--heads 16/64,8/32,2/8] [--seconds 3]

For each head config (one sequence of --tokens tokens: 2 HV CTAs at K = V = 128) this runs the launcher's fused
kernel (`chunk_fwd`, prepare's outputs computed once beforehand) back to back for --seconds while `nvidia-smi`
samples clocks, power and throttle reasons every 50 ms, and prints per config: the kernel's median time, its
period per chunk, and the samples' median SM clock, power and throttle reasons. What it found on the H200 (the
700 W cap at 128 CTAs) is in docs/dev/fused_fwd.md.
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
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--seconds", type=float, default=3.0)
    args = ap.parse_args()

    import torch

    from flashdelta.kernels import fused_fwd, prepare
    from providers import make_inputs

    smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits", "-lms", "50"],
                           stdout=subprocess.PIPE, text=True)
    windows, results = [], []
    for spec in args.heads.split(","):
        H, HV = (int(x) for x in spec.split("/"))
        x = make_inputs((args.tokens,), H, HV, seed=0)
        g_cumsum, A = prepare.prepare_fwd(x.k, x.g, x.beta, x.cu)

        def kern(x=x, g_cumsum=g_cumsum, A=A):
            fused_fwd.chunk_fwd(x.q, x.k, x.v, g_cumsum, x.beta, A, x.h0, x.cu, scale=x.scale)

        kern()
        torch.cuda.synchronize()
        time.sleep(1.0)                                # let the clock settle between configs
        t_start, times = time.time(), []
        while time.time() - t_start < args.seconds:
            evs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(20)]
            for a, b in evs:
                a.record()
                kern()
                b.record()
            torch.cuda.synchronize()
            times += [a.elapsed_time(b) for a, b in evs]
        windows.append((spec, t_start + 0.5, time.time()))   # skip the first half second
        results.append((spec, 2 * HV, statistics.median(times), len(times)))
        print(f"{spec}: {statistics.median(times):.4f} ms over {len(times)} launches", flush=True)
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
    nt = (args.tokens + 63) // 64
    print(f"\n{torch.cuda.get_device_name()} | fused forward, 1x{args.tokens}, back-to-back launches")
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


if __name__ == "__main__":
    main()
