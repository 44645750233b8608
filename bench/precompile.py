"""Compile on the CPU machine what a GPU call will need, into TileLang's cache (TILELANG_CACHE_DIR), so the call
loads kernels instead of compiling them (~3-8 s of device time each):

    TILELANG_CACHE_DIR=.cache/tl-ship python3 bench/precompile.py [--tests] [--grid]
    bash bench/dev/tlcache.sh pack        # then carry .cache/tl-ship.tar.xz (bench/dev/tlcache.sh unpack there)

--tests: every kernel build the GPU tier launches (tests/_builds.py `gpu_tier`, from the case tables in
tests/cases.py: the stage tests, with the builds they ask for through launcher arguments, and the public-API tests),
each checked as the CPU compile tier checks its subset (`hang_checks`; a failing build fails the script),
and `flashdelta check`'s (its defaults: heads 4/8, bf16, the backward; bench/dev/gpu_session.sh runs it);
--grid: `flashdelta warmup` of the benchmark grid's eight head configs (fp32 beta, with and without h0), with context
parallelism's builds for the heads whose rows its cost model may split (`--context-parallel auto`: 2/8, 4/16, 16/16);
--bwd-grid: the same with the backward's kernels for the backward grid's six head configs (the backward's cost model
splits rows of all six).
Timeline recordings (bench/dev/timeline.py) build their instrumented kernels on the GPU machine: the buffer address
is part of the build.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
GRID_HEADS = ("2/8", "4/16", "8/32", "16/64", "16/32", "8/24", "16/48", "16/16")
BWD_HEADS = ("16/32", "8/16", "4/8", "2/4", "16/64", "16/16")


def tests():
    sys.path.insert(0, os.path.join(ROOT, "tests"))     # the case tables and their builds
    from _builds import gpu_tier, hang_checks

    failed = []
    for label, builder, args in gpu_tier():
        t0 = time.time()
        kernel = builder(*args)
        findings = hang_checks(kernel.get_kernel_source(), kernel.get_host_source())
        print(f"{label}: {time.time() - t0:.1f} s{''.join(f'; HANG CHECK: {f}' for f in findings)}", flush=True)
        failed += [label] if findings else []
    if failed:
        sys.exit(f"{len(failed)} builds fail the hang checks: {failed}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tests", action="store_true")
    ap.add_argument("--grid", action="store_true")
    ap.add_argument("--bwd-grid", action="store_true", help="the backward grid's heads, forward and backward kernels")
    a = ap.parse_args()
    if not os.environ.get("TILELANG_CACHE_DIR"):
        sys.exit("set TILELANG_CACHE_DIR (e.g. .cache/tl-ship) so the kernels land where they can be carried")
    if a.grid:
        heads = [x for h in GRID_HEADS for x in ("--heads", h)]
        subprocess.run([sys.executable, "-m", "flashdelta.cli", "warmup", *heads, "--beta-dtype", "fp32",
                        "--context-parallel", "auto"], check=True)
    if a.bwd_grid:
        heads = [x for h in BWD_HEADS for x in ("--heads", h)]
        subprocess.run([sys.executable, "-m", "flashdelta.cli", "warmup", *heads, "--beta-dtype", "fp32", "--backward",
                        "--context-parallel", "auto"], check=True)
    if a.tests:
        tests()
        subprocess.run([sys.executable, "-m", "flashdelta.cli", "warmup", "--heads", "4/8", "--beta-dtype", "bf16",
                        "--backward", "--context-parallel", "auto"], check=True)


if __name__ == "__main__":
    main()
