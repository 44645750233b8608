"""CP's partition scan: the TileLang kernel (`kernels.cp_scan`) against the torch scans of `flashdelta.cp`
(`scan_serial`, `scan_log`; the backward's `scan_grads` serial and log), per scan (docs/dev/cp.md).

Per head config and J (partitions per sequence): B dense sequences of J partitions (P = B J slots), fp32 M
``[P, HV, K, K]`` near a contraction and Gaussian E / F, K = V = 128; the plan from `cp.make_plan` (dense, L = 64:
only P, J and the slot numbering matter here). Each provider is a CUDA-graph replay (bench/timing.py's runner,
providers interleaved over rounds). The kernel's rows: ``kernel`` (the scan with `part_offsets` from the plan, what
a caller launches today: two small kernels and the scan), ``kernel-only`` (the offsets precomputed). L2 is not
flushed by default: in CP, M and E come straight from the summary passes and are L2-resident (``--flush-mb 256``
flushes). Every provider is checked against `scan_serial` before timing.

    source .device/bootstrap.sh; python3 -u bench/dev/cp_scan_bench.py [--heads 2/8 4/16 8/32] [--J 2 4 8 16 32]
        [--batch 1] [--bwd] [--out $OUT/cp_scan.csv]
    TILELANG_CACHE_DIR=.cache/tl-ship python3 bench/dev/cp_scan_bench.py --precompile     # on the CPU machine

--variant NAME=PATH adds a copy of kernels/cp_scan.py (not committed; its own `choose_bv`) as the provider
``NAME-only`` (offsets precomputed), timed interleaved with the shipped kernel and checked like it. --same-m gives
every slot the same M, so a timing probe that loads M once (what a multicast of M would save) still checks.
"""
from __future__ import annotations

import argparse
import csv
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))               # bench/ (timing)

import torch  # noqa: E402

import timing  # noqa: E402

K = V = 128
L = 64


def parse_heads(s: str) -> tuple:
    h, hv = s.split("/")
    return int(h), int(hv)


def inputs(B: int, J: int, HV: int, seed: int = 0, same_m: bool = False) -> tuple:
    from flashdelta import cp

    T = J * L * 64
    plan = cp.make_plan(torch.arange(B + 1, device="cuda") * T, B * T, L, seq_len=T)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    P = plan.P
    G = torch.randn(P, HV, K, K, device="cuda", generator=gen)
    M = 0.9 * torch.eye(K, device="cuda") + 0.1 * G / K ** 0.5
    if same_m:      # every slot's M the first one's (a probe variant that loads M once is then still correct)
        M = M[:1].expand_as(M)
    E = torch.randn(P, HV, K, V, device="cuda", generator=gen)
    h0 = torch.randn(B, HV, K, V, device="cuda", generator=gen)
    return plan, M.contiguous(), E, h0


def load_variants(specs) -> dict:
    """{name: module} of the --variant copies of kernels/cp_scan.py."""
    from ab_chunk_bwd import load_variant

    return {name: load_variant(name, path) for name, path in (s.split("=", 1) for s in specs)}


def providers(plan, M, E, h0, bwd: bool, variants: dict) -> dict:
    from flashdelta import cp
    from flashdelta.kernels import cp_scan

    part_cu = cp_scan.part_offsets(plan.last_index)
    if bwd:
        fns = {"kernel": lambda: cp_scan.scan_bwd(M, E, h0, cp_scan.part_offsets(plan.last_index)),
               "kernel-only": lambda: cp_scan.scan_bwd(M, E, h0, part_cu),
               "serial": lambda: cp.scan_grads(M, E, plan, h0, "serial"),
               "log": lambda: cp.scan_grads(M, E, plan, h0, "log")}
    else:
        fns = {"kernel": lambda: cp_scan.scan_fwd(M, E, h0, cp_scan.part_offsets(plan.last_index)),
               "kernel-only": lambda: cp_scan.scan_fwd(M, E, h0, part_cu),
               "serial": lambda: cp.scan_serial(M, E, plan, h0),
               "log": lambda: cp.scan_log(M, E, plan, h0)}
    for name, m in variants.items():
        fns[f"{name}-only"] = (lambda m=m: m.scan_bwd(M, E, h0, part_cu)) if bwd else \
            (lambda m=m: m.scan_fwd(M, E, h0, part_cu))
    return fns


def check(fns: dict) -> dict:
    """Relative L2 error of each provider against the torch serial scan (all fp32)."""
    from flashdelta.numerics import rel_l2

    ref = fns["serial"]()
    errs = {n: rel_l2(fn(), ref) for n, fn in fns.items()}
    bad = {n: e for n, e in errs.items() if not e <= 1e-4}
    if bad:
        raise SystemExit(f"providers disagree with scan_serial: {bad}")
    return errs


def run(args) -> int:
    stream = torch.cuda.Stream()
    flush = timing.L2Flush(args.flush_mb)
    rows = []
    variants = load_variants(args.variant)
    names = ["kernel", "kernel-only", "serial", "log"] + [f"{n}-only" for n in variants]
    print(f"{'pass':>4} {'heads':>6} {'B':>3} {'J':>3} " + " ".join(f"{n + ' us':>15}" for n in names)
          + "  serial/kernel  kernel us/step", flush=True)
    for pas in (("fwd", "bwd") if args.bwd else ("fwd",)):
        for hh in args.heads:
            _, HV = parse_heads(hh)
            for J in args.J:
                plan, M, E, h0 = inputs(args.batch, J, HV, same_m=args.same_m)
                fns = providers(plan, M, E, h0, pas == "bwd", variants)
                errs = check(fns)
                runners = {n: timing.make_runner(fn, stream=stream) for n, fn in fns.items()}
                timed = timing.time_runners(runners, stream=stream, budget_ms=args.budget_ms, flush=flush,
                                            rounds=args.rounds)
                us = {n: timed[n].ms * 1e3 for n in names}
                per_step = us["kernel-only"] / max(J - 1, 1)
                print(f"{pas:>4} {hh:>6} {args.batch:>3} {J:>3} " + " ".join(f"{us[n]:15.2f}" for n in names)
                      + f"  {us['serial'] / us['kernel']:13.2f}  {per_step:14.2f}", flush=True)
                for n in names:
                    rows.append(dict(pass_=pas, heads=hh, B=args.batch, J=J, P=plan.P, provider=n,
                                     us=f"{us[n]:.3f}", p20_us=f"{timed[n].p20 * 1e3:.3f}",
                                     p80_us=f"{timed[n].p80 * 1e3:.3f}", timing=timed[n].method,
                                     err=f"{errs[n]:.2e}", note=timed[n].note))
    if args.out:
        with open(args.out, "w", newline="") as f:
            f.write(f"# cp_scan_bench commit={os.environ.get('FLASHDELTA_COMMIT', 'unknown')} "
                    f"gpu={torch.cuda.get_device_name()} flush_mb={args.flush_mb}\n")
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
        print(f"wrote {args.out}")
    return 0


def precompile(args) -> int:
    """Compile (no GPU) every scan build this benchmark launches (both V tiles, with h0 / dht, both walks)."""
    from flashdelta.kernels import cp_scan

    todo = {}
    for mod in [cp_scan, *load_variants(args.variant).values()]:
        for hh in args.heads:
            _, HV = parse_heads(hh)
            for label, b, a in mod.launcher_builds(HV, K, V, N=args.batch, backward=True, init=(True,)):
                todo.setdefault((mod.__name__, a), (f"{mod.__name__.rsplit('.', 1)[-1]}: {label}", b, a))
    t0 = time.time()
    for i, (label, b, a) in enumerate(todo.values(), 1):
        t = time.time()
        b(*a)
        print(f"[{i}/{len(todo)}] {label}: {time.time() - t:.1f} s", flush=True)
    print(f"{len(todo)} scan builds in {time.time() - t0:.0f} s")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--heads", nargs="+", default=["2/8", "4/16", "8/32"], help="H/HV pairs")
    ap.add_argument("--J", type=int, nargs="+", default=[2, 4, 8, 16, 32], help="partitions per sequence")
    ap.add_argument("--batch", type=int, default=1, help="dense sequences")
    ap.add_argument("--bwd", action="store_true", help="also the backward's reverse scan")
    ap.add_argument("--budget-ms", type=float, default=100.0)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--flush-mb", type=int, default=0)
    ap.add_argument("--out", default="")
    ap.add_argument("--precompile", action="store_true", help="compile the scan builds (no GPU) and exit")
    ap.add_argument("--variant", action="append", default=[], help="NAME=PATH of a kernels/cp_scan.py copy")
    ap.add_argument("--same-m", action="store_true", help="every slot's M equal (for probes that load M once)")
    args = ap.parse_args()
    if args.precompile:
        return precompile(args)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (or --precompile)")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
