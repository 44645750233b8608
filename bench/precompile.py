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
    from test_fwd import CASES as FWD_CASES
    from test_fwd import SWITCH_SETS, VARIANT_CASES
    from test_prepare import CASES as PREP_CASES
    from test_prepare import KNOB_CASES

    from flashdelta.kernels import fused_fwd, prepare

    for c in FWD_CASES:
        args = fused_fwd.builder_args(c.H, c.HV, c.K, c.V, c.dtype, c.beta_dtype, c.h0_dtype, c.K ** -0.5, c.h0,
                                      c.state_v_first)
        _timed(f"chunk_fwd {c.name}", lambda: fused_fwd.build(args))
        if c in VARIANT_CASES:
            for name, switches in SWITCH_SETS.items():
                _timed(f"chunk_fwd {c.name} {name}", lambda: fused_fwd.build(args, **switches))
    # every heads-per-CTA split (test_prepare_fwd_heads_per_cta runs them all; the launcher picks one by size)
    for args in dict.fromkeys(prepare.builder_args(c.H, c.HV, c.K, c.dtype, c.beta_dtype, hpc)
                              for c in PREP_CASES for hpc in prepare.heads_per_cta_options(c.H, c.HV)):
        _timed(f"prepare_fwd {args[:3]} heads/CTA {args[-len(prepare.KNOBS)]}", lambda: prepare.build_fwd(args))
    from flashdelta.kernels import prepare_pipe  # test_prepare_fwd_pipe: every value-head split
    from test_prepare import PIPE_KNOBS
    todo = [prepare_pipe.builder_args(c.H, c.HV, c.K, c.dtype, c.beta_dtype, hpc)
            for c in PREP_CASES for hpc in prepare.heads_per_cta_options(c.H, c.HV)]
    todo += [prepare_pipe.builder_args(c.H, c.HV, c.K, c.dtype, c.beta_dtype, **knobs)
             for c in PREP_CASES for knobs in PIPE_KNOBS]
    for args in dict.fromkeys(todo):
        _timed(f"prepare_fwd_pipe {args[:3]} heads/item {args[-4]} consumers {args[-2]} gate warp {args[-1]}",
               lambda: prepare_pipe._build_prepare_fwd_pipe(*args))
    for c, knobs in KNOB_CASES:     # test_prepare_fwd_knobs
        args = prepare.builder_args(c.H, c.HV, c.K, c.dtype, c.beta_dtype)
        _timed(f"prepare_fwd {args[:3]} {knobs}", lambda: prepare.build_fwd(args, **knobs))


def e2e():
    _test_modules()
    from test_e2e_gpu import PAIRS

    import flashdelta

    for dtype in dict.fromkeys(d for _, d in PAIRS):
        heads = sorted({(c.H, c.HV) for c, d in PAIRS if d == dtype})
        _timed(f"e2e {dtype} heads {heads}", lambda: flashdelta.warmup(
            heads, dtype=dtype, beta_dtype=dtype, initial_state=(False, True), state_v_first=(False, True),
            progress=False))


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
