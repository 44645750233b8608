"""A/B timing of fused-forward builder variants (development tool, NOTES-gpu.md).

    source .device/bootstrap.sh; python3 bench/fwd_variants.py [--tokens 8192,32768] [--variants NAME,...]
    python3 bench/fwd_variants.py --compile-only      # CPU: fill TileLang's cache (TILELANG_CACHE_DIR) to carry

Each variant is a set of `fused_fwd.SWITCHES` values (see VARIANTS); all run on the same TP1-like inputs
(bf16, fp32 beta and h0, one sequence; see profile_fwd.make_inputs). Per variant it checks o and the final state
against the launcher's kernel (max abs difference: 0 or rounding-level expected), then times the kernel alone
(CUDA events, median) and prints us per chunk per CTA. With --prepare it also times `prepare_fwd` builds
(PREPARE_VARIANTS; max|do| is then max |A - A_torch|). With --pair it also times prepare_fwd followed by the
fused kernel, both launches captured in one CUDA graph, with prepare's value heads per CTA as the launcher picks
them and with all of a key head's where the launcher splits them (`prepare.pick_heads_per_cta`). PDL (prepare
`pdl` + fused `pdl`) was measured this way in session 5: no gain. --heads picks H/HV. The table is printed last.
"""
from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))

# name -> builder switches; {} is the launcher's kernel
VARIANTS = {
    "default": {},
    "no-early-release": {"early_release": False},
    "split-store": {"split_store": True},
    "pout-triple": {"pout_triple": True},
}
# name -> prepare_fwd builder knobs (`prepare.KNOBS`) over the launcher's
PREPARE_VARIANTS = {
    "prepare": {},
    "mb5": {"min_blocks": 5},
    "mb6": {"min_blocks": 6},
}
H, HV, K, V = 16, 64, 128, 128
SCALE = K ** -0.5


def builder_flags(ff, name):
    import torch

    args = ff.builder_args(H, HV, K, V, torch.bfloat16, torch.float32, torch.float32, SCALE, True, False)
    return args, VARIANTS[name]


def pair_builds(prepare, spec):
    """--pair's prepare builds for a token spec: (name, heads per CTA): the launcher's pick and, where it splits,
    all heads per CTA."""
    L, n = (int(x) for x in spec.split("x")) if "x" in spec else (int(spec), 1)
    G, pick = HV // H, prepare.pick_heads_per_cta(H, HV, L * n)
    return [("launcher", pick)] + ([("all-heads", G)] if pick != G else [])


def main():
    global H, HV
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="8192,32768",
                    help="comma-separated sequence mixes: T (one sequence) or LxN (N sequences of L, L %% 64 == 0)")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--heads", default=f"{H}/{HV}", help="H/HV of the inputs (K = V = 128)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=1,
                    help="time the variants (fused, and prepare ones among themselves) in this many interleaved "
                         "rounds (A B C A B C ...), report the median of the rounds' medians (clock and thermal "
                         "drift then hit every variant alike)")
    ap.add_argument("--prepare", action="store_true", help="also time prepare_fwd")
    ap.add_argument("--prepare-variants", default=",".join(PREPARE_VARIANTS), help="with --prepare: which builds")
    ap.add_argument("--pair", action="store_true",
                    help="also time prepare + fused in one graph: the launcher's heads per CTA and all heads")
    ap.add_argument("--compile-only", action="store_true", help="build every variant (no GPU needed) and exit")
    ap.add_argument("--profiled", action="store_true", help="with --compile-only: also the timeline builds")
    args = ap.parse_args()
    names = args.variants.split(",")
    H, HV = (int(x) for x in args.heads.split("/"))
    prepare_variants = {name: PREPARE_VARIANTS[name] for name in args.prepare_variants.split(",")}

    import time

    from flashdelta.kernels import fused_fwd as ff

    from flashdelta.kernels import prepare

    import torch as _torch

    pargs = prepare.builder_args(H, HV, K, _torch.bfloat16, _torch.float32)
    if args.compile_only:
        if args.pair:
            for tokens in args.tokens.split(","):
                for _, hpc in pair_builds(prepare, tokens):
                    prepare.build_fwd(pargs, heads_per_cta=hpc)
            ff.build(builder_flags(ff, "default")[0])
            print("built the pairs", flush=True)
        if args.prepare:
            for name, knobs in prepare_variants.items():
                prepare.build_fwd(pargs, **knobs)
                print(f"built {name}", flush=True)
        for name in names:
            a, flags = builder_flags(ff, name)
            t0 = time.time()
            ff.build(a, **flags)
            print(f"built {name} in {time.time() - t0:.1f} s", flush=True)
        if args.profiled:  # the timeline builds bench/profile_fwd.py and profile_prepare.py run
            for name in names:
                a, flags = builder_flags(ff, name)
                ff.build(a, **{**flags, "profile": True})
                print(f"built {name} (profiled)", flush=True)
            prepare.build_fwd(pargs, profile=True)
            print("built prepare (profiled)", flush=True)
        return

    import torch

    from profile_fwd import cuda_time, make_inputs

    rows = []
    for spec in args.tokens.split(","):
        L, n = (int(x) for x in spec.split("x")) if "x" in spec else (int(spec), 1)
        assert n == 1 or L % 64 == 0, "equal sequences must be whole chunks (A is built for one flat sequence)"
        T = L * n
        q, k, v, gc, beta, A, h0, cu = make_inputs(T, H, HV)
        if n > 1:   # chunks never cross the boundaries, so the flat sequence's g_cumsum and A serve all n
            cu = torch.arange(n + 1, dtype=torch.int32, device=q.device) * L
            h0 = h0.expand(n, *h0.shape[1:]).contiguous()
        NT = (T + 63) // 64
        o_ref, ht_ref = ff.chunk_fwd(q, k, v, gc, beta, A, h0, cu, scale=SCALE)
        if args.prepare:
            g = torch.zeros_like(gc)
            gc_out, A_out = torch.empty_like(gc), torch.empty_like(A)
            p_runs, p_diffs, p_times = {}, {}, {name: [] for name in prepare_variants}
            for name, knobs in prepare_variants.items():
                kernel = prepare.build_fwd(pargs, **knobs)
                kernel(k, g, beta, cu, gc_out, A_out)
                torch.cuda.synchronize()
                p_diffs[name] = (A_out.float() - A.float()).abs().max().item()   # A from torch (bf16): rounding
                p_runs[name] = functools.partial(kernel, k, g, beta, cu, gc_out, A_out)
            for _ in range(args.rounds):
                for name in prepare_variants:
                    p_times[name].append(cuda_time(p_runs[name], args.reps))
            for name in prepare_variants:
                ms, d_a = statistics.median(p_times[name]), p_diffs[name]
                rows.append((spec, name, ms, ms * 1e3 / NT, d_a, 0.0))
                print(f"{spec} {name}: {ms:.4f} ms, max|dA| {d_a:.3g} (rounds: "
                      f"{' '.join(f'{t:.4f}' for t in p_times[name])})", flush=True)
        if args.pair:
            g = torch.zeros_like(gc)
            gc_out, A_out = torch.empty_like(gc), torch.empty_like(A)
            o, ht = torch.empty_like(o_ref), torch.empty_like(ht_ref)
            o_off = None
            kf = ff.build(builder_flags(ff, "default")[0])
            for pname, hpc in pair_builds(prepare, spec):
                kp = prepare.build_fwd(pargs, heads_per_cta=hpc)

                def pair():
                    kp(k, g, beta, cu, gc_out, A_out)
                    kf(q, k, v, gc_out, beta, A_out, h0, cu, o, ht)

                pair()
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    pair()
                ms = cuda_time(graph.replay, args.reps)
                if o_off is None:   # the split must not change a bit: max|do| is against the first pair
                    o_off = o.clone()
                d_o = (o.float() - o_off.float()).abs().max().item()
                rows.append((spec, f"pair-{pname}", ms, ms * 1e3 / NT, d_o, 0.0))
                print(f"{spec} prepare+fused {pname} (heads per CTA {hpc}): {ms:.4f} ms (graph)", flush=True)
        runs, diffs, times = {}, {}, {name: [] for name in names}
        for name in names:
            a, flags = builder_flags(ff, name)
            kernel = ff.build(a, **flags)
            o, ht = torch.full_like(o_ref, float("nan")), torch.full_like(ht_ref, float("nan"))
            kernel(q, k, v, gc, beta, A, h0, cu, o, ht)
            torch.cuda.synchronize()
            diffs[name] = ((o.float() - o_ref.float()).abs().max().item(), (ht - ht_ref).abs().max().item())
            runs[name] = functools.partial(kernel, q, k, v, gc, beta, A, h0, cu, o, ht)
        for _ in range(args.rounds):
            for name in names:
                times[name].append(cuda_time(runs[name], args.reps))
        for name in names:
            ms, (d_o, d_h) = statistics.median(times[name]), diffs[name]
            rows.append((spec, name, ms, ms * 1e3 / NT, d_o, d_h))
            print(f"{spec} {name}: {ms:.4f} ms, {ms * 1e3 / NT:.3f} us/chunk, max|do| {d_o:.3g} max|dht| {d_h:.3g}"
                  f" (rounds: {' '.join(f'{t:.4f}' for t in times[name])})", flush=True)
    print(f"\n{torch.cuda.get_device_name()} | H={H} HV={HV} K=V={K} bf16, {HV * V // ff.BLOCK_V} CTAs per sequence; "
          "us/chunk = ms / total chunks (per CTA only for one sequence)")
    print(f"{'tokens':>9} {'variant':<16} {'ms':>8} {'us/chunk':>9} {'max|do|':>9} {'max|dht|':>9}")
    for spec, name, ms, us, d_o, d_h in rows:
        print(f"{spec:>9} {name:<16} {ms:>8.4f} {us:>9.3f} {d_o:>9.3g} {d_h:>9.3g}")


if __name__ == "__main__":
    main()
