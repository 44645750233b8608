"""Probe (development, NOTES-gpu.md session 8): the SM clock and power while the fused forward runs, by CTA count.

    source .device/bootstrap.sh; python3 -u bench/probe_clocks.py [--heads 16/64,8/32,2/8] [--seconds 3]

The fused kernel's chunk period is ~1.58 us with 64 CTAs and ~1.70-1.73 us with 128 (one CTA per SM either way).
If the GPU lowers its clock under the heavier load (power or thermal limits), the period follows the clock. For
each head config (one 32k-token sequence: 2 HV CTAs) this runs the launcher's fused kernel back to back for
`--seconds` while `nvidia-smi` samples clocks, power and throttle reasons every 50 ms, and prints per config: the
kernel's median time, its period per chunk, and the samples' median SM clock, power and throttle reasons.
--modules compares builds from other modules of `flashdelta.kernels` with fused_fwd's builder interface (session 9:
the work-items experiment's `_fused_fwd_wiu`, whose kernels take the CTA count as their last argument).
"""
from __future__ import annotations

import argparse
import importlib
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))

QUERY = "timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--heads", default="16/64,8/32,2/8")
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--modules", default="fused_fwd", help="comma-separated modules of flashdelta.kernels")
    args = ap.parse_args()

    import torch

    from profile_fwd import make_inputs

    smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits", "-lms", "50"],
                           stdout=subprocess.PIPE, text=True)
    windows, results = [], []
    for spec, mod_name in [(s, m) for s in args.heads.split(",") for m in args.modules.split(",")]:
        H, HV = (int(x) for x in spec.split("/"))
        ff = importlib.import_module(f"flashdelta.kernels.{mod_name}")
        q, k, v, gc, beta, A, h0, cu = make_inputs(args.tokens, H, HV)
        build = ff.build(ff.builder_args(H, HV, 128, 128, q.dtype, beta.dtype, h0.dtype, 128 ** -0.5, True, False))
        extra = (ff.grid_ctas(1, HV, 128, q.device),) if mod_name != "fused_fwd" else ()

        def kern(*a, build=build, extra=extra):
            build(*a, *extra)

        o = torch.empty_like(v)
        ht = torch.empty_like(h0)
        kern(q, k, v, gc, beta, A, h0, cu, o, ht)
        torch.cuda.synchronize()
        time.sleep(1.0)                                # let the clock settle between configs
        t_start, times = time.time(), []
        while time.time() - t_start < args.seconds:
            evs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(20)]
            for a, b in evs:
                a.record()
                kern(q, k, v, gc, beta, A, h0, cu, o, ht)
                b.record()
            torch.cuda.synchronize()
            times += [a.elapsed_time(b) for a, b in evs]
        spec = f"{spec} {mod_name}" if mod_name != "fused_fwd" else spec
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
