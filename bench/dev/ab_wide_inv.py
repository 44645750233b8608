"""A/B of prepare inside the wide build with the WY inverse on the prep warpgroup's four warps
(bench/dev/fused_fwd_wide_inv.py, docs/dev/fused_fwd.md item 0c) against prepare + the default build and prepare + the
wide build, on the benchmark's inputs (raw gate, fp32 beta, h0), in one process: CUDA-graph medians interleaved, and
each variant's o and final state against prepare + default (max |d| and relative L2; the variant's A is its own
inverse's, so a few bf16 roundings of A differ from prepare's and the outputs are close, not bitwise). Three builds of
the variant: `inv4` (K K^T, the inverse, then Q K^T), `inv4qk` (Q K^T issued with K K^T, under the inverse) and
`inv4er` (that, and the state warpgroups free chunk c's slot and prep buffers before they wait for chunk c + 1's
prep: `early_release`).

    TILELANG_CACHE_DIR=.cache/tl-ship python3 bench/dev/ab_wide_inv.py --precompile     # CPU machine
    source .device/bootstrap.sh; python3 bench/dev/ab_wide_inv.py [--rows 16/64:8192x4 ...]

Prediction (item 0c, H100, 16/64 8192x4; prepare + default 1.208 ms, prepare + wide 1.140, the one-warp variant
1.656): inv4 ~1.32 ms (1.27-1.38; period ~5.1 us a chunk: the wide build's 3.65 plus ~1.5 us of K K^T, split and
inverse on the prep chain, which with two slots and two prep buffers sets the period), inv4qk ~0.05 ms below it,
inv4er ~1.10 ms (1.05-1.15; period ~4.3 us). Refuted if inv4 <= 1.20 ms or >= 1.45, or inv4er is not >= 0.08 ms below
inv4qk.
"""
import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, ".."), HERE]

import torch  # noqa: E402

ROWS = ("16/64:8192x4", "16/64:1024x8", "16/32:8192x4", "16/16:4096x8", "16/64:1x32768")
VARIANTS = {"inv4": (False, False), "inv4qk": (True, False), "inv4er": (True, True)}   # -> (qk_first, early_release)


def _args(h: int, hv: int) -> tuple:
    from flashdelta.kernels import fused_fwd

    return fused_fwd.builder_args(h, hv, 128, 128, torch.bfloat16, torch.float32, torch.float32, 128 ** -0.5, True,
                                  False)


def precompile(rows) -> int:
    """Every build the GPU run loads, for the rows' heads (no GPU): the variant's three, the default and the wide
    fused forward, and prepare's."""
    import fused_fwd_wide_inv as inv
    from flashdelta.kernels import fused_fwd, fused_fwd_wide, prepare

    for hh in sorted({r.split(":")[0] for r in rows}):
        h, hv = map(int, hh.split("/"))
        for opts in VARIANTS.values():
            inv.build(*_args(h, hv), *opts)
        for b in (fused_fwd.build, fused_fwd_wide.build):
            b(*_args(h, hv))
        for _, b, a in prepare.launcher_builds(h, hv, 128, torch.bfloat16, torch.float32):
            b(*a)
        print("compiled", hh, flush=True)
    return 0


def _diff(x, y) -> str:
    """x against the reference y: bitwise, else the largest absolute difference and the relative L2 norm."""
    if torch.equal(x, y):
        return "bitwise"
    d = x.double() - y.double()
    return f"max|d| {d.abs().max().item():.1e} relL2 {(d.norm() / y.double().norm()).item():.1e}"


def run(rows) -> int:
    import fused_fwd_wide_inv as inv
    import timing
    from ab_chunk_bwd import row_inputs
    from flashdelta.kernels import fused_fwd, prepare

    stream = torch.cuda.Stream()
    names = ("def", "wide", *VARIANTS)
    ratios = [(v, b) for v in VARIANTS for b in ("def", "wide")]
    print(f"{'heads':>6} {'seqlens':>12} " + " ".join(f"{n:>9}" for n in names) + " " +
          " ".join(f"{f'{v}/{b}':>11}" for v, b in ratios) + "  outputs against prep+def (o; ht)", flush=True)
    for row in rows:
        hh, sl, inp = row_inputs(row, requires_grad=False)
        q, k, v, g, beta, h0, cu = inp.q, inp.k, inp.v, inp.g, inp.beta, inp.h0, inp.cu
        scale = q.shape[-1] ** -0.5

        def with_prepare(wide):
            def f():
                g_cumsum, A = prepare.prepare_fwd(k, g, beta, cu)[:2]
                return fused_fwd.chunk_fwd(q, k, v, g_cumsum, beta, A, h0, cu, scale=scale, wide=wide)
            return f

        def variant(qk, er):
            return lambda: inv.chunk_fwd_inv(q, k, v, g, beta, h0, cu, scale=scale, qk_first=qk, early_release=er)

        calls = {"def": with_prepare(False), "wide": with_prepare(True),
                 **{n: variant(*opts) for n, opts in VARIANTS.items()}}
        outs = {n: f() for n, f in calls.items()}
        torch.cuda.synchronize()
        same = " | ".join(f"{n}: o {_diff(outs[n][0], outs['def'][0])}; ht {_diff(outs[n][1], outs['def'][1])}"
                          for n in names[1:])
        t = timing.time_runners({n: timing.make_runner(f, stream=stream) for n, f in calls.items()}, stream=stream,
                                flush=None)
        ms = {n: t[n].ms for n in names}
        print(f"{hh:>6} {sl:>12} " + " ".join(f"{ms[n]:9.4f}" for n in names) + " " +
              " ".join(f"{ms[v] / ms[b]:11.3f}" for v, b in ratios) + f"  {same}", flush=True)
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
