"""A/B of chunk_bwd variants on the benchmark's inputs: each variant's outputs against the shipped kernel's (relative
L2 difference per gradient) and CUDA-graph medians, the variants interleaved in one process. A variant is a copy of
kernels/chunk_bwd.py (anywhere on disk, not committed), imported as a module of flashdelta.kernels:

    git show main:src/flashdelta/kernels/chunk_bwd.py > /tmp/chunk_bwd_main.py
    source .device/bootstrap.sh; python3 bench/dev/ab_chunk_bwd.py --variant main=/tmp/chunk_bwd_main.py \\
        [--rows 16/32:1x8192 16/64:8192x4] [--precompile]

--precompile (CPU machine, TILELANG_CACHE_DIR set) compiles every variant's builds for the rows and exits.
"""
import argparse
import importlib.util
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

ROWS = ("16/32:1x8192", "16/32:6413+6673+10954+8728", "16/64:8192x4", "2/4:1x8192", "16/32:512x16")


def load_variant(name, path):
    """The chunk_bwd module at `path`, as flashdelta.kernels._ab_<name> (its relative imports resolve there)."""
    spec = importlib.util.spec_from_file_location(f"flashdelta.kernels._ab_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", action="append", default=[], help="NAME=PATH of a chunk_bwd.py copy")
    ap.add_argument("--rows", nargs="+", default=list(ROWS), help="H/HV:seqlens")
    ap.add_argument("--precompile", action="store_true")
    args = ap.parse_args()
    from flashdelta.kernels import chunk_bwd
    mods = {"shipped": chunk_bwd}
    for spec in args.variant:
        name, path = spec.split("=", 1)
        mods[name] = load_variant(name, path)
    if args.precompile:
        for row in args.rows:
            h, hv = map(int, row.split(":")[0].split("/"))
            for name, m in mods.items():
                for label, b, a in m.launcher_builds(h, hv, 128, 128, torch.bfloat16, torch.float32, 128 ** -0.5,
                                                     dht=(True,)):
                    b(*a)
                    print(f"{name}: {label}", flush=True)
        return
    import providers
    import shapes
    import timing
    from flashdelta.kernels import fused_fwd, prepare

    stream = torch.cuda.Stream()
    names = list(mods)
    print(f"{'heads':>6} {'seqlens':>28} " + " ".join(f"{n + ' ms':>12}" for n in names)
          + "  rel diff vs shipped: dq dk dv db dg dh0", flush=True)
    for row in args.rows:
        hh, sl = row.split(":")
        h, hv = map(int, hh.split("/"))
        inp = providers.make_inputs(shapes.parse_seqlens(sl), h, hv, seed=0, requires_grad=True)
        q, k, v = inp.q.detach(), inp.k.detach(), inp.v.detach()
        g, beta, h0, cu = inp.g.detach(), inp.beta.detach(), inp.h0.detach(), inp.cu
        scale = q.shape[-1] ** -0.5
        g_cumsum, A = prepare.prepare_fwd(k, g, beta, cu)[:2]
        hs = fused_fwd.state_recompute(k, v, g_cumsum, beta, A, h0, cu)
        do, dht = inp.do, inp.dht

        def call(m):
            return lambda: m.chunk_bwd(q, k, v, g_cumsum, beta, A, hs, do, dht, cu, scale=scale)

        outs = {n: call(m)() for n, m in mods.items()}
        torch.cuda.synchronize()
        diffs = {}
        for n in names[1:]:
            diffs[n] = [((x.float() - y.float()).norm() / y.float().norm().clamp_min(1e-30)).item()
                        for x, y in zip(outs[n], outs["shipped"])]
        t = timing.time_runners({n: timing.make_runner(call(m), stream=stream) for n, m in mods.items()},
                                stream=stream, flush=None)
        line = f"{hh:>6} {sl:>28} " + " ".join(f"{t[n].ms:12.4f}" for n in names)
        for n in names[1:]:
            line += f"  {n}: " + " ".join(f"{d:.1e}" for d in diffs[n])
        print(line, flush=True)


if __name__ == "__main__":
    main()
