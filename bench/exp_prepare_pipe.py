"""A/B: `prepare_fwd` one-shot CTAs (prepare.py) vs the persistent pipelined build (prepare_pipe.py).

    source .device/bootstrap.sh; python3 -u bench/exp_prepare_pipe.py [--rows h16v64/1x32768,...] [--rounds 4]
    python3 bench/exp_prepare_pipe.py --compile-only        # CPU: fill TileLang's cache (TILELANG_CACHE_DIR)

Per row (the grid's head configs and sequence splits): the same inputs to the one-shot build and to the persistent
one (`PIPE_VARIANTS`: name -> `prepare_fwd_pipe` keyword arguments); A must be bit-identical and g_cumsum within fp32 rounding (max abs
difference printed); then CUDA-graph medians with an L2 flush, interleaved rounds (bench/timing.py). The table is
printed last.
"""
from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))

ROWS = ("h16v64/1x32768,h16v64/4096x8,h16v64/1024x8,h16v16/1x32768,h16v16/4096x8,h16v16/1024x8,h16v16/1x4096,"
        "h16v32/1x32768,h16v32/4096x8,h16v32/1024x8,h16v48/1x32768,h16v48/4096x8,h16v48/1024x8,h8v24/1x8192,"
        "h8v24/4096x8,h2v8/1x32768,h2v8/1x4096,h4v16/1x4096,h8v32/4096x8")
K = 128
# name -> `prepare_pipe.prepare_fwd_pipe` keyword arguments (all of a key head's value heads per item; the one-shot
# kernel runs with all of them per CTA too). Session 11 measured and removed two more: two consumer warpgroups per
# CTA, with and without a gate warp (NOTES-gpu.md).
PIPE_VARIANTS = {"pipe": {}}


def parse(row):
    """'h16v64/4096x8' -> (16, 64, 4096, 8); the grid writes one sequence as '1x32768'."""
    heads, seqs = row.split("/")
    H, HV = (int(x) for x in heads[1:].split("v"))
    a, b = (int(x) for x in seqs.split("x"))
    L, n = (b, 1) if a == 1 else (a, b)
    return H, HV, L, n


def inputs(H, HV, L, n, seed=0):
    import torch
    import torch.nn.functional as F

    gen = torch.Generator(device="cuda").manual_seed(seed)
    T = L * n
    k = F.normalize(torch.randn(1, T, H, K, generator=gen, device="cuda"), dim=-1).bfloat16()
    g = F.logsigmoid(torch.randn(1, T, HV, generator=gen, device="cuda")) / 16
    beta = torch.sigmoid(torch.randn(1, T, HV, generator=gen, device="cuda"))
    cu = torch.arange(0, T + 1, L, dtype=torch.int32, device="cuda")
    return k, g, beta, cu


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default=ROWS)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--compile-only", action="store_true")
    args = ap.parse_args()
    rows = args.rows.split(",")

    import torch

    from flashdelta.kernels import prepare, prepare_pipe

    if args.compile_only:
        for row in rows:
            H, HV, L, n = parse(row)
            prepare._build_prepare_fwd(*prepare.builder_args(H, HV, K, torch.bfloat16, torch.float32))
            for knobs in PIPE_VARIANTS.values():
                prepare_pipe._build_prepare_fwd_pipe(*prepare_pipe.builder_args(H, HV, K, torch.bfloat16,
                                                                                 torch.float32, **knobs))
            print("compiled", row, flush=True)
        return

    from timing import L2Flush, make_runner, time_runners

    stream = torch.cuda.Stream()
    flush = L2Flush()
    table = []
    for row in rows:
        H, HV, L, n = parse(row)
        k, g, beta, cu = inputs(H, HV, L, n)
        old = prepare.prepare_fwd(k, g, beta, cu)
        fns = {"one-shot": lambda: prepare.prepare_fwd(k, g, beta, cu, heads_per_cta=HV // H)}
        for name, knobs in PIPE_VARIANTS.items():
            fns[name] = lambda knobs=knobs: prepare_pipe.prepare_fwd_pipe(k, g, beta, cu, **knobs)
        checks = []
        for name in PIPE_VARIANTS:
            new = fns[name]()
            torch.cuda.synchronize()
            checks.append(f"{name}: A {'bit-equal' if torch.equal(old[1], new[1]) else 'DIFFERS'}, "
                          f"max|dg| {(old[0] - new[0]).abs().max().item():.1e}")
        runners = {name: make_runner(fn, stream=stream) for name, fn in fns.items()}
        res = time_runners(runners, stream=stream, rounds=args.rounds, flush=flush)
        ms = [res[name].ms for name in fns]
        table.append((row, *ms, "; ".join(checks)))
        print(f"{row:18s} " + " ".join(f"{n} {t:.4f}" for n, t in zip(fns, ms)) + " | " + "; ".join(checks),
              flush=True)
    print("\n| row | one-shot ms | " + " | ".join(f"{n} ms (change)" for n in PIPE_VARIANTS) + " | checks |")
    print("|---|---|" + "---|" * len(PIPE_VARIANTS) + "---|")
    for row, a, *rest in table:
        times, checks = rest[:-1], rest[-1]
        print(f"| {row} | {a:.4f} | " + " | ".join(f"{t:.4f} ({t / a - 1:+.1%})" for t in times) + f" | {checks} |")


if __name__ == "__main__":
    main()
