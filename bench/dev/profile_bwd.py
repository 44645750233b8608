"""The backward's kernels one by one: a per-kernel GPU time table of one public-API backward (torch.profiler), or
one backward inside cudaProfilerStart/Stop for Nsight Compute.

    source .device/bootstrap.sh; python3 bench/dev/profile_bwd.py --heads 16/32 --seqlens 1x8192 6413+6673+10954+8728
    python3 bench/dev/profile_bwd.py --seqlens 6413+6673+10954+8728 --cp 0:128       # a chosen split
    ncu --clock-control none --section SourceCounters --section WarpStateStats -k regex:chunk_bwd \\
        --profile-from-start off -o /tmp/rep python3 bench/dev/profile_bwd.py --ncu --seqlens 6413+6673+10954+8728

The table: every kernel the backward launches (the forward runs first, outside the profiled region), with its
launches and summed GPU time, in launch order of first appearance; the benchmark's inputs (bench/README.md) and
the public API as the benchmark calls it (`cu_seqlens_cpu` given, so the context-parallel decision is the
benchmark's). Kernel times add up to less than the backward's wall time in a CUDA graph: launch gaps are not in
them. `--ncu`: one warm-up backward, then one inside the profiler range, for `ncu --profile-from-start off`.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

import providers  # noqa: E402
import shapes  # noqa: E402


def backward_fn(inp, l2norm: bool):
    """One forward (not profiled) and a callable that runs its backward (retain_graph: it runs several times)."""
    from flashdelta import chunk_gated_delta_rule

    o, ht = chunk_gated_delta_rule(inp.q, inp.k, inp.v, inp.g, inp.beta, initial_state=inp.h0,
                                   output_final_state=True, cu_seqlens=inp.cu, cu_seqlens_cpu=inp.cu_host,
                                   use_qk_l2norm_in_kernel=l2norm)
    return lambda: torch.autograd.grad((o, ht), inp.leaves(), (inp.do, inp.dht), retain_graph=True)


def kernel_table(run) -> list:
    """[(kernel name, launches, total us)] of one call of `run`, in order of first launch."""
    from torch.profiler import ProfilerActivity, profile

    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    rows = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            n, us = rows.get(ev.name, (0, 0.0))
            rows[ev.name] = (n + 1, us + ev.device_time)
    return [(name, n, us) for name, (n, us) in rows.items()]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", nargs="+", default=["16/32"])
    ap.add_argument("--seqlens", nargs="+", default=["1x8192"])
    ap.add_argument("--l2norm", action="store_true", help="use_qk_l2norm_in_kernel=True")
    ap.add_argument("--ncu", action="store_true", help="one backward inside cudaProfilerStart/Stop")
    ap.add_argument("--cp", default=None, metavar="FWD:BWD",
                    help="partition lengths (chunks, 0: serial) of the forward and the backward instead of the "
                         "automatic decision, e.g. 0:128 (the forward serial saves the backward's partition starts)")
    args = ap.parse_args()
    if args.cp is not None:
        from flashdelta import cp

        code = cp.encode(*map(int, args.cp.split(":")))
        cp.decide = lambda *a, **kw: code
    os.environ.setdefault("FLASHDELTA_BACKEND", "sm90")     # a missing kernel raises (as the benchmark's provider)
    for hh in args.heads:
        h, hv = map(int, hh.split("/"))
        for sl in args.seqlens:
            inp = providers.make_inputs(shapes.parse_seqlens(sl), h, hv, seed=0, requires_grad=True)
            run = backward_fn(inp, args.l2norm)
            if args.ncu:
                run()
                torch.cuda.synchronize()
                torch.cuda.cudart().cudaProfilerStart()
                run()
                torch.cuda.synchronize()
                torch.cuda.cudart().cudaProfilerStop()
                print(f"profiled one backward: heads {hh}, seqlens {sl}")
                continue
            table = kernel_table(run)
            total = sum(us for _, _, us in table)
            print(f"## heads {hh}, seqlens {sl}{', l2norm' if args.l2norm else ''}: {total / 1e3:.3f} ms of kernels")
            for name, n, us in table:
                print(f"  {us / 1e3:8.3f} ms  {n:4d}x  {name[:110]}")


if __name__ == "__main__":
    main()
