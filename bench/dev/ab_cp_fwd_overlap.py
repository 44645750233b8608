"""A/B of the CP forward's overlapped output pass (`cp._output_overlapped`: the exact heads' summaries, scan and
output pass on the side stream beside the warm-up heads' window E pass and output pass): ``one``, the one-launch
output pass after the scan (`cp._overlaps` patched to False while that variant's CUDA graph is captured), against
``overlap``, the shipped code. On the benchmark's forward inputs through the public API (`cu_seqlens_cpu` given, so
the CP decision, L and the warm-up, is the benchmark's): CUDA-graph medians interleaved in one process, whether o and
the final state are bitwise equal, and which L the call used. --train: the training forward (inputs that require
grad: the output pass also saves the chunk states for the backward, `states_out`), the forward alone timed.

    source .device/bootstrap.sh; python3 bench/dev/ab_cp_fwd_overlap.py [--rows 2/8:1x32768 ...] [--train]

Compiles nothing of its own beyond the forward grid's builds (bench/precompile.py --grid / --tests: cp.builds).
"""
import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, ".."), HERE]

import torch  # noqa: E402

# the forward grid's rows where the automatic choice splits with the warm-up (the others take no overlapped path)
ROWS = ("2/8:1x32768", "4/16:1x32768", "16/16:1x32768", "2/8:16384x2", "4/16:1x16384")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", nargs="+", default=list(ROWS), help="H/HV:seqlens")
    ap.add_argument("--train", action="store_true", help="the training forward (saving the chunk states)")
    a = ap.parse_args()
    os.environ.setdefault("FLASHDELTA_BACKEND", "sm90")
    import timing
    from ab_chunk_bwd import patched_runners, row_inputs

    from flashdelta import chunk_gated_delta_rule, cp

    overlaps = cp._overlaps
    variants = {"one": lambda *args: False, "overlap": overlaps}
    stream = torch.cuda.Stream()
    print(f"{'heads':>6} {'seqlens':>14} {'L':>4} {'overlapped':>10} {'one ms':>9} {'overlap ms':>11} {'ratio':>7}  "
          f"outputs", flush=True)
    for row in a.rows:
        hh, sl, inp = row_inputs(row, requires_grad=a.train)
        used = []

        def run():
            with torch.set_grad_enabled(a.train):
                o, ht = chunk_gated_delta_rule(inp.q, inp.k, inp.v, inp.g, inp.beta, scale=inp.scale,
                                               initial_state=inp.h0, output_final_state=True, cu_seqlens=inp.cu,
                                               cu_seqlens_cpu=inp.cu_host)
            return o.detach(), ht.detach()

        real_fwd, real_over = cp.cp_chunk_fwd, cp._output_overlapped
        cp.cp_chunk_fwd = lambda *args, **kw: used.append(("L", kw["plan"].L)) or real_fwd(*args, **kw)
        cp._output_overlapped = lambda *args, **kw: used.append(("overlap", 1)) or real_over(*args, **kw)
        def patch(pred):
            cp._overlaps = pred
            return lambda: setattr(cp, "_overlaps", overlaps)

        try:
            outs, runners = patched_runners(run, variants, patch, stream)
        finally:
            cp.cp_chunk_fwd, cp._output_overlapped = real_fwd, real_over
        t = timing.time_runners(runners, stream=stream, flush=None)
        same = all(torch.equal(x, y) for x, y in zip(outs["one"], outs["overlap"]))
        L = max((v for k, v in used if k == "L"), default=0)
        over = any(k == "overlap" for k, _ in used)
        one, ov = t["one"].ms, t["overlap"].ms
        print(f"{hh:>6} {sl:>14} {L:>4} {str(over):>10} {one:9.4f} {ov:11.4f} {ov / one:7.3f}  "
              f"{'bitwise' if same else 'DIFFER'}", flush=True)
        del runners, outs, inp
    return 0


if __name__ == "__main__":
    sys.exit(main())
