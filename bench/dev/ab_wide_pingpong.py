"""The wide forward's ping-pong (the state warpgroups issue their Y GEMMs in turn) against the same build without it
and the default build: interleaved CUDA-graph medians of the fused kernel alone on bench/dev/ab_fused_fwd.py's inputs,
and whether the three agree bit for bit. The build without the turns is a copy of kernels/fused_fwd_wide.py from
before them, given by path and loaded as a module of flashdelta.kernels:

    git show 3973126:src/flashdelta/kernels/fused_fwd_wide.py > .cache/fused_fwd_wide_nopp.py
    TILELANG_CACHE_DIR=.cache/tl-ship python3 bench/dev/ab_wide_pingpong.py --nopp .cache/fused_fwd_wide_nopp.py \
        --precompile                                                   # CPU machine
    source .device/bootstrap.sh; python3 -u bench/dev/ab_wide_pingpong.py --nopp .cache/fused_fwd_wide_nopp.py
"""
import importlib.util
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]
import torch  # noqa: E402

import flashdelta.kernels as K  # noqa: E402
from flashdelta.kernels import fused_fwd, fused_fwd_wide  # noqa: E402

NOPP = sys.argv[sys.argv.index("--nopp") + 1]
spec = importlib.util.spec_from_file_location("flashdelta.kernels.fused_fwd_wide_nopp", NOPP)
nopp = importlib.util.module_from_spec(spec)
nopp.__package__ = "flashdelta.kernels"
sys.modules[spec.name] = nopp
spec.loader.exec_module(nopp)
ROWS = ("16/64:8192x4", "16/64:1024x8", "16/32:8192x4", "16/64:1x32768", "16/32:2048x4")


def wide_with(mod):
    def run(*a, **kw):
        K.fused_fwd_wide = mod
        try:
            return fused_fwd.chunk_fwd(*a, wide=True, **kw)
        finally:
            K.fused_fwd_wide = fused_fwd_wide
    return run


if "--precompile" in sys.argv:
    for row in ROWS:
        h, hv = map(int, row.split(":")[0].split("/"))
        args = fused_fwd.builder_args(h, hv, 128, 128, torch.bfloat16, torch.float32, torch.float32, 128 ** -0.5,
                                      True, False)
        nopp.build(*args)
        fused_fwd_wide.build(*args)
        fused_fwd.build(*args)
        print("compiled", row, flush=True)
    sys.exit(0)

import timing  # noqa: E402
from ab_fused_fwd import fwd_row  # noqa: E402

stream = torch.cuda.Stream()
print(f"{'heads':>6} {'seqlens':>12} {'default':>9} {'wide pp':>9} {'wide':>9} {'pp/wide':>8} {'pp/def':>7}  outputs")
for row in ROWS:
    hh, sl, inp, scale, g_cumsum, A, _ = fwd_row(row)
    q, k, v, beta, h0, cu = inp.q, inp.k, inp.v, inp.beta, inp.h0, inp.cu
    calls = {"default": lambda: fused_fwd.chunk_fwd(q, k, v, g_cumsum, beta, A, h0, cu, scale=scale),
             "pp": lambda: wide_with(fused_fwd_wide)(q, k, v, g_cumsum, beta, A, h0, cu, scale=scale),
             "nopp": lambda: wide_with(nopp)(q, k, v, g_cumsum, beta, A, h0, cu, scale=scale)}
    outs = {n: f() for n, f in calls.items()}
    torch.cuda.synchronize()
    same = all(torch.equal(outs["pp"][i], outs[n][i]) for n in ("default", "nopp") for i in (0, 1))
    t = timing.time_runners({n: timing.make_runner(f, stream=stream) for n, f in calls.items()}, stream=stream,
                            flush=None)
    d, p, w = t["default"].ms, t["pp"].ms, t["nopp"].ms
    print(f"{hh:>6} {sl:>12} {d:9.4f} {p:9.4f} {w:9.4f} {p / w:8.3f} {p / d:7.3f}  "
          f"{'bitwise' if same else 'DIFFER'}", flush=True)
