"""Experiment (development, NOTES-gpu.md session 8): does prepare_fwd's time follow the bytes of A it writes?

    source .device/bootstrap.sh; python3 -u bench/exp_prepare_store.py [--heads 16/64] [--tokens 32768,4096x8]
    python3 bench/exp_prepare_store.py --compile-only      # CPU: fill TileLang's cache to carry

Builds the launcher's prepare_fwd and two timing-only variants whose per-warp inverse stores part of each
128-byte row of A: `lanes` of the 8 lanes that copy a row store (8 = the launcher's kernel, 4 = half the bytes of
A, 0 = none). The variants' A is wrong on purpose; only their time is read. If prepare is paced by HBM writes, half
the bytes should take ~2/3 of the time (A is 2/3 of prepare's traffic at GVA 4); if it is paced by the SM's work,
all three times are equal. This is what a packed A (half the bytes, same work) would buy at most.

The variant kernels are made by replacing the store loop's condition in `_ptx.WY_INVERSE_PRELUDE` for the
duration of one build (the prelude is part of the TIR, so each variant has its own compile-cache entry).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))

STORE_GUARD = "if (16 * i + r < rows) {"
LANES = (8, 4, 0)


def build(lanes: int, H: int, HV: int):
    import torch

    from flashdelta.kernels import _ptx, prepare

    args = prepare.builder_args(H, HV, 128, torch.bfloat16, torch.float32)
    jit = prepare._build_prepare_fwd
    if lanes == 8:
        return prepare.build_fwd(args)
    orig = _ptx.WY_INVERSE_PRELUDE
    assert orig.count(STORE_GUARD) == 1, "the prelude's store loop changed: update STORE_GUARD"
    _ptx.WY_INVERSE_PRELUDE = orig.replace(STORE_GUARD, f"if (16 * i + r < rows && (lane & 7) < {lanes}) {{")
    _forget(jit)
    try:
        return prepare.build_fwd(args)
    finally:
        _ptx.WY_INVERSE_PRELUDE = orig
        _forget(jit)


def _forget(jit):
    """Drop the builder's in-process caches of TIR and kernels (TileLang 0.1.15 internals; its disk cache keys by
    the TIR, prelude included)."""
    jit.func.p1_cache.clear()
    jit._kernel_cache.clear()
    jit._call_form_cache = type(jit._call_form_cache)()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--heads", default="16/64,16/16")
    ap.add_argument("--tokens", default="32768,4096x8")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--compile-only", action="store_true")
    args = ap.parse_args()
    heads = [tuple(int(x) for x in h.split("/")) for h in args.heads.split(",")]
    if args.compile_only:
        for H, HV in heads:
            for lanes in LANES:
                build(lanes, H, HV)
                print(f"built {H}/{HV} lanes {lanes}", flush=True)
        return

    import torch

    from profile_fwd import cuda_time, make_inputs

    rows = []
    for H, HV in heads:
        kernels = {lanes: build(lanes, H, HV) for lanes in LANES}
        for spec in args.tokens.split(","):
            L, n = (int(x) for x in spec.split("x")) if "x" in spec else (int(spec), 1)
            q, k, v, gc, beta, A, h0, cu = make_inputs(L * n, H, HV)
            cu = torch.arange(n + 1, dtype=torch.int32, device=q.device) * L
            g = torch.zeros_like(gc)
            gc_out, A_out = torch.empty_like(gc), torch.empty_like(A)
            times = {lanes: [] for lanes in LANES}
            for _ in range(args.rounds):
                for lanes in LANES:
                    kern = kernels[lanes]
                    times[lanes].append(cuda_time(lambda: kern(k, g, beta, cu, gc_out, A_out), args.reps))
            for lanes in LANES:
                ms = statistics.median(times[lanes])
                rows.append((f"{H}/{HV}", spec, lanes, ms))
                print(f"{H}/{HV} {spec} lanes {lanes}: {ms:.4f} ms (rounds "
                      f"{' '.join(f'{t:.4f}' for t in times[lanes])})", flush=True)
    print(f"\n{torch.cuda.get_device_name()} | prepare_fwd, A bytes stored = lanes / 8")
    print(f"{'heads':>6} {'tokens':>8} {'lanes':>5} {'ms':>8}")
    for heads_s, spec, lanes, ms in rows:
        print(f"{heads_s:>6} {spec:>8} {lanes:>5} {ms:>8.4f}")


if __name__ == "__main__":
    main()
