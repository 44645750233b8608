"""Compile on the CPU machine what a GPU call will need, into TileLang's cache (TILELANG_CACHE_DIR), so the call
loads kernels instead of compiling them (~8-20 s of device time each):

    TILELANG_CACHE_DIR=.cache/tl-ship python3 bench/precompile.py [--tests] [--grid] [--variants]
    bash bench/tlcache.sh pack        # then carry .cache/tl-ship.tar.xz (bench/tlcache.sh unpack there)

--tests: the kernels of tests/gpu/test_fwd.py (with the switch variants) and tests/gpu/test_prepare.py;
--grid: `flashdelta warmup` of the benchmark grid's eight head configs (fp32 beta, with and without h0);
--e2e: the kernels tests/gpu/test_e2e_gpu.py reaches through the public API (its head configs, input dtypes as
beta's, fp32 h0, both state layouts, the q/k l2norm kernel);
--variants: bench/fwd_variants.py's builds and the timeline builds (profile_fwd.py, profile_prepare.py).
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


def _timed(label, fn):
    t0 = time.time()
    fn()
    print(f"{label}: {time.time() - t0:.1f} s", flush=True)


def _test_modules():
    """Make tests/ and tests/gpu/ importable (the case lists live there)."""
    sys.path[:0] = [os.path.join(ROOT, "tests"), os.path.join(ROOT, "tests", "gpu")]


def tests():
    _test_modules()
    from _builds import fwd_builds, prepare_builds

    for label, build in fwd_builds(dev=True) + prepare_builds(dev=True):
        _timed(label, build)


def e2e():
    _test_modules()
    from _builds import e2e_builds

    for label, build in e2e_builds():
        _timed(label, build)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tests", action="store_true")
    ap.add_argument("--grid", action="store_true")
    ap.add_argument("--e2e", action="store_true")
    ap.add_argument("--variants", action="store_true")
    a = ap.parse_args()
    if not os.environ.get("TILELANG_CACHE_DIR"):
        sys.exit("set TILELANG_CACHE_DIR (e.g. .cache/tl-ship) so the kernels land where they can be carried")
    if a.variants:
        subprocess.run([sys.executable, os.path.join(HERE, "fwd_variants.py"), "--compile-only", "--prepare",
                        "--pair", "--profiled"], check=True)
    if a.grid:
        heads = [x for h in GRID_HEADS for x in ("--heads", h)]
        subprocess.run([sys.executable, "-m", "flashdelta.cli", "warmup", *heads, "--beta-dtype", "fp32"], check=True)
    if a.tests:
        tests()
    if a.e2e:
        e2e()


if __name__ == "__main__":
    main()
