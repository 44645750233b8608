"""A/B of prepare inside the wide build (bench/dev/fused_fwd_wide_inv.py, docs/dev/fused_fwd.md item 0b) against
prepare + the default build and prepare + the wide build, on the benchmark's inputs (raw gate, fp32 beta, h0), in
one process: CUDA-graph medians interleaved, the variant's o and final state against prepare + wide (bitwise, else
the largest absolute difference) and against prepare + default.

    TILELANG_CACHE_DIR=.cache/tl-ship python3 bench/dev/ab_wide_inv.py --precompile     # CPU machine
    source .device/bootstrap.sh; python3 bench/dev/ab_wide_inv.py [--rows 16/64:8192x4 ...]

Prediction (item 0b): the variant at most ~0.9x prepare + default where the (sequence, head) items fill the GPU
(16/64 8192x4 ~1.04 -> ~0.90 ms on the H200); refuted if it is not faster than prepare + default there.
"""
import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, ".."), HERE]

import torch  # noqa: E402

ROWS = ("16/64:8192x4", "16/64:1024x8", "16/32:8192x4", "16/16:4096x8", "16/64:1x32768")


def _args(h: int, hv: int) -> tuple:
    from flashdelta.kernels import fused_fwd

    return fused_fwd.builder_args(h, hv, 128, 128, torch.bfloat16, torch.float32, torch.float32, 128 ** -0.5, True,
                                  False)


def precompile(rows) -> int:
    """The variant's, the default's and the wide builds, and prepare's, for the rows' heads (no GPU)."""
    import fused_fwd_wide_inv as inv
    from flashdelta.kernels import fused_fwd, fused_fwd_wide, prepare

    for hh in sorted({r.split(":")[0] for r in rows}):
        h, hv = map(int, hh.split("/"))
        for b in (inv.build, fused_fwd.build, fused_fwd_wide.build):
            b(*_args(h, hv))
        for _, b, a in prepare.launcher_builds(h, hv, 128, torch.bfloat16, torch.float32):
            b(*a)
        print("compiled", hh, flush=True)
    return 0


def _diff(x, y) -> str:
    if torch.equal(x, y):
        return "bitwise"
    return f"max|d| {(x.float() - y.float()).abs().max().item():.1e}"


def run(rows) -> int:
    import fused_fwd_wide_inv as inv
    import timing
    from ab_chunk_bwd import row_inputs
    from flashdelta.kernels import fused_fwd, prepare

    stream = torch.cuda.Stream()
    print(f"{'heads':>6} {'seqlens':>12} {'prep+def':>9} {'prep+wide':>9} {'inv':>9} {'inv/def':>8} {'inv/wide':>8}"
          "  outputs (vs prep+wide; vs prep+def)", flush=True)
    for row in rows:
        hh, sl, inp = row_inputs(row, requires_grad=False)
        q, k, v, g, beta, h0, cu = inp.q, inp.k, inp.v, inp.g, inp.beta, inp.h0, inp.cu
        scale = q.shape[-1] ** -0.5

        def with_prepare(wide):
            def f():
                g_cumsum, A = prepare.prepare_fwd(k, g, beta, cu)[:2]
                return fused_fwd.chunk_fwd(q, k, v, g_cumsum, beta, A, h0, cu, scale=scale, wide=wide)
            return f

        calls = {"def": with_prepare(False), "wide": with_prepare(True),
                 "inv": lambda: inv.chunk_fwd_inv(q, k, v, g, beta, h0, cu, scale=scale)}
        outs = {n: f() for n, f in calls.items()}
        torch.cuda.synchronize()
        same = "; ".join(f"o {_diff(outs['inv'][0], outs[b][0])}, ht {_diff(outs['inv'][1], outs[b][1])}"
                         for b in ("wide", "def"))
        t = timing.time_runners({n: timing.make_runner(f, stream=stream) for n, f in calls.items()}, stream=stream,
                                flush=None)
        d, w, i = t["def"].ms, t["wide"].ms, t["inv"].ms
        print(f"{hh:>6} {sl:>12} {d:9.4f} {w:9.4f} {i:9.4f} {i / d:8.3f} {i / w:8.3f}  {same}", flush=True)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", nargs="+", default=list(ROWS), help="H/HV:seqlens")
    ap.add_argument("--precompile", action="store_true", help="compile the builds (no GPU) and exit")
    a = ap.parse_args()
    if a.precompile:
        return precompile(a.rows)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (or --precompile)")
    return run(a.rows)


if __name__ == "__main__":
    sys.exit(main())
