"""bench/precompile.py's build sets compiled by N processes at once, each a shard of one deterministic list: on the
GPU machine's 16 cores a cold cache fills ~10x faster than on the CPU machine's two, so a call can fill it, pack it
into $OUT and hand it to the next calls (bench/dev/tlcache.sh unpack).

    source .device/bootstrap.sh; source bench/dev/tlcache.sh unpack
    python3 bench/dev/precompile_par.py --tests --bwd-grid --jobs 14 [--budget-s 400]

--budget-s stops starting new builds after that many seconds (a build in flight finishes).
"""
import argparse
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "bench"))
sys.path.insert(0, os.path.join(ROOT, "tests"))


def todo(a) -> list:
    import torch
    from precompile import BWD_HEADS, GRID_HEADS

    from flashdelta import precompile

    def heads(names):
        return [tuple(map(int, h.split("/"))) for h in names]

    out = []
    if a.tests:
        from _builds import gpu_tier
        out += gpu_tier()
        out += precompile.variants(heads(["4/8"]), beta_dtype=torch.bfloat16, backward=True, context_parallel="auto")
    if a.bwd_grid:
        out += precompile.variants(heads(BWD_HEADS), beta_dtype=torch.float32, backward=True, context_parallel="auto")
    if a.grid:
        out += precompile.variants(heads(GRID_HEADS), beta_dtype=torch.float32, context_parallel="auto")
    seen, unique = set(), []
    for label, b, args in out:
        if (b.__name__, args) not in seen:
            seen.add((b.__name__, args))
            unique.append((label, b, args))
    return unique


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tests", action="store_true")
    ap.add_argument("--bwd-grid", action="store_true")
    ap.add_argument("--grid", action="store_true")
    ap.add_argument("--jobs", type=int, default=os.cpu_count())
    ap.add_argument("--budget-s", type=float, default=1e9)
    ap.add_argument("--shard", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if not os.environ.get("TILELANG_CACHE_DIR"):
        sys.exit("set TILELANG_CACHE_DIR (bench/dev/tlcache.sh unpack does)")
    if a.shard is None:
        t0 = time.time()
        args = [x for x in sys.argv[1:]]
        procs = [subprocess.Popen([sys.executable, "-u", __file__, *args, "--shard", f"{i}/{a.jobs}"])
                 for i in range(a.jobs)]
        rc = max(p.wait() for p in procs)
        print(f"precompile_par: {a.jobs} shards done in {time.time() - t0:.0f} s", flush=True)
        sys.exit(rc)
    i, n = map(int, a.shard.split("/"))
    t0 = time.time()
    items = todo(a)[i::n]
    for label, b, args in items:
        if time.time() - t0 > a.budget_s:
            print(f"[shard {i}] budget spent, skipped {label}", flush=True)
            continue
        t1 = time.time()
        b(*args)
        print(f"[shard {i}] {label}: {time.time() - t1:.1f} s", flush=True)


if __name__ == "__main__":
    main()
