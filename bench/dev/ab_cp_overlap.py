"""A/B of the CP backward's side stream (`flashdelta.streams` in `cp.cp_chunk_bwd`: chunk_dstate beside the M pass,
and the zero fill of chunk_bwd's GVA-2 dq and dk): ``serial``, everything on one stream (`streams.fork` patched to
return None while that variant's CUDA graph is captured); ``side``, chunk_dstate on the side stream but the fill in
chunk_bwd's launcher (`cp._dqk_buffers` patched to return None); ``fill``, the shipped code. On the benchmark's inputs
through the public API (`cu_seqlens_cpu` given, so the CP decision is the benchmark's): CUDA-graph medians of one
backward interleaved in one process, and whether the gradients are bitwise equal (they should be: the same kernels on
disjoint outputs).

    source .device/bootstrap.sh; python3 bench/dev/ab_cp_overlap.py [--rows 2/4:1x8192 ...]

Compiles nothing of its own: the builds are the backward grid's (bench/precompile.py --bwd-grid).
"""
import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, ".."), HERE]

import torch  # noqa: E402

ROWS = ("2/4:1x8192", "2/4:1x32768", "2/4:15837+16931", "4/8:1x8192", "16/32:6195+1997", "16/32:1x8192",
        "16/32:1x32768", "16/16:1x32768", "16/16:1875+1070+3347+456+697+149+457+141")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", nargs="+", default=list(ROWS), help="H/HV:seqlens")
    a = ap.parse_args()
    import timing
    from ab_chunk_bwd import patched_runners, row_inputs
    from profile_bwd import backward_fn

    from flashdelta import cp, streams

    fork, buffers = streams.fork, cp._dqk_buffers
    variants = {"serial": (lambda device, **kw: None, buffers), "side": (fork, lambda *a: None),
                "fill": (fork, buffers)}
    stream = torch.cuda.Stream()
    print(f"{'heads':>6} {'seqlens':>40} {'serial ms':>10} {'side ms':>10} {'fill ms':>10} {'fill/side':>10} "
          f"{'fill/serial':>12}  gradients", flush=True)
    for row in a.rows:
        hh, sl, inp = row_inputs(row, requires_grad=True)
        with torch.cuda.stream(stream):
            run = backward_fn(inp, l2norm=False)
        def patch(fb):
            streams.fork, cp._dqk_buffers = fb

            def restore():
                streams.fork, cp._dqk_buffers = fork, buffers
            return restore

        outs, runners = patched_runners(run, variants, patch, stream)
        t = timing.time_runners(runners, stream=stream, flush=None)
        same = all(torch.equal(x, y) for v in ("side", "fill") for x, y in zip(outs["serial"], outs[v]))
        s, d, f = t["serial"].ms, t["side"].ms, t["fill"].ms
        print(f"{hh:>6} {sl:>40} {s:10.4f} {d:10.4f} {f:10.4f} {f / d:10.3f} {f / s:12.3f}  "
              f"{'bitwise' if same else 'DIFFER'}", flush=True)
        del runners, outs, run, inp
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
