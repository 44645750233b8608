"""A/B of chunk_bwd variants on the benchmark's inputs: each variant's outputs (dq and dk summed per key head by
group_sum, as the backward hands them on) against the shipped kernel's (relative L2 difference per gradient) and
CUDA-graph medians of chunk_bwd and those group sums, the variants interleaved in one process. A variant is a copy of
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
    """The kernel module at `path`, as flashdelta.kernels._ab_<name> (its relative imports resolve there)."""
    spec = importlib.util.spec_from_file_location(f"flashdelta.kernels._ab_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def setup(doc: str, kernel: str, rows, flags: dict | None = None) -> tuple:
    """(args, {name: module}) of an A/B script over copies of kernels/<kernel>.py: the shipped module first.
    `flags`: the script's own on/off options, {"--name": help}. --rows defaults to `rows` (None: no default; the
    script picks by its flags)."""
    import importlib

    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", action="append", default=[], help=f"NAME=PATH of a {kernel}.py copy")
    ap.add_argument("--rows", nargs="+", default=None if rows is None else list(rows), help="H/HV:seqlens")
    ap.add_argument("--precompile", action="store_true")
    for flag, help_ in (flags or {}).items():
        ap.add_argument(flag, action="store_true", help=help_)
    args = ap.parse_args()
    mods = {"shipped": importlib.import_module(f"flashdelta.kernels.{kernel}")}
    for spec in args.variant:
        name, path = spec.split("=", 1)
        mods[name] = load_variant(name, path)
    return args, mods


def precompile(rows, mods: dict, builds) -> None:
    """Compile `builds(module, H, HV)` (a list of (label, builder, args)) of every module for every row's heads."""
    for row in rows:
        h, hv = map(int, row.split(":")[0].split("/"))
        for name, m in mods.items():
            for label, b, a in builds(m, h, hv):
                b(*a)
                print(f"{name}: {label}", flush=True)


def row_inputs(row: str, requires_grad: bool) -> tuple:
    """(heads, seqlens, the benchmark's inputs) of one --rows entry."""
    import providers
    import shapes

    hh, sl = row.split(":")
    h, hv = map(int, hh.split("/"))
    return hh, sl, providers.make_inputs(shapes.parse_seqlens(sl), h, hv, seed=0, requires_grad=requires_grad)


def patched_runners(run, variants: dict, patch, stream) -> tuple:
    """({name: run's outputs cloned}, {name: CUDA-graph runner of run}) under each variant: `patch(value)` puts variant
    `value` in place and returns a callable that restores the shipped code, called once its graph is captured."""
    import timing

    outs, runners = {}, {}
    for name, value in variants.items():
        restore = patch(value)
        try:
            with torch.cuda.stream(stream):
                outs[name] = [x.clone() for x in run()]
            stream.synchronize()
            runners[name] = timing.make_runner(run, stream=stream, allow_eager=False)
        finally:
            restore()
    return outs, runners


def outputs_and_times(mods: dict, call, stream) -> tuple:
    """({name: call(module)()}, {name: CUDA-graph median ms}), the modules interleaved (`timing.time_runners`)."""
    import timing

    outs = {n: call(m)() for n, m in mods.items()}
    torch.cuda.synchronize()
    t = timing.time_runners({n: timing.make_runner(call(m), stream=stream) for n, m in mods.items()},
                            stream=stream, flush=None)
    return outs, {n: t[n].ms for n in mods}


def main():
    args, mods = setup(__doc__, "chunk_bwd", ROWS)
    if args.precompile:
        precompile(args.rows, mods, lambda m, h, hv: m.launcher_builds(h, hv, 128, 128, torch.bfloat16, torch.float32,
                                                                       128 ** -0.5, dht=(True,)))
        return
    from flashdelta.kernels import fused_fwd, group_sum, prepare

    stream = torch.cuda.Stream()
    names = list(mods)
    print(f"{'heads':>6} {'seqlens':>28} " + " ".join(f"{n + ' ms':>12}" for n in names)
          + "  rel diff vs shipped: dq dk dv db dg dh0", flush=True)
    for row in args.rows:
        hh, sl, inp = row_inputs(row, requires_grad=True)
        q, k, v = inp.q.detach(), inp.k.detach(), inp.v.detach()
        g, beta, h0, cu = inp.g.detach(), inp.beta.detach(), inp.h0.detach(), inp.cu
        scale = q.shape[-1] ** -0.5
        g_cumsum, A = prepare.prepare_fwd(k, g, beta, cu)[:2]
        hs = fused_fwd.state_recompute(k, v, g_cumsum, beta, A, h0, cu)
        do, dht = inp.do, inp.dht

        def call(m):
            # dq and dk per key head, as the backward hands them on: group_sum after a variant that returns them per
            # value head (a no-op after one that sums the group itself)
            def run():
                dq, dk, *rest = m.chunk_bwd(q, k, v, g_cumsum, beta, A, hs, do, dht, cu, scale=scale)
                return (group_sum.group_sum(dq, q.shape[2]), group_sum.group_sum(dk, q.shape[2]), *rest)
            return run

        outs, ms = outputs_and_times(mods, call, stream)
        diffs = {}
        for n in names[1:]:
            diffs[n] = [((x.float() - y.float()).norm() / y.float().norm().clamp_min(1e-30)).item()
                        for x, y in zip(outs[n], outs["shipped"])]
        line = f"{hh:>6} {sl:>28} " + " ".join(f"{ms[n]:12.4f}" for n in names)
        for n in names[1:]:
            line += f"  {n}: " + " ".join(f"{d:.1e}" for d in diffs[n])
        print(line, flush=True)


if __name__ == "__main__":
    main()
