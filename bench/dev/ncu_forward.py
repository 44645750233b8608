"""Drive the launchers' prepare_fwd and chunk_fwd once each for Nsight Compute.

    source .device/bootstrap.sh; ncu --clock-control none --profile-from-start off --set full \\
        -k regex:"prepare|chunk_fwd" -o /tmp/fwd python3 bench/dev/ncu_forward.py --tokens 32768 --heads 16/64

One warm-up call of each kernel outside the profiled range (compile/load), then one profiled call of each
(cudaProfilerStart/Stop; run ncu with --profile-from-start off).
"""
from __future__ import annotations

import argparse
import os
import sys

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, BENCH)
sys.path.insert(0, os.path.join(os.path.dirname(BENCH), "src"))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--heads", default="16/64", help="H/HV")
    args = ap.parse_args()
    import torch

    from flashdelta.kernels import fused_fwd, prepare
    from providers import make_inputs

    H, HV = (int(x) for x in args.heads.split("/"))
    x = make_inputs((args.tokens,), H, HV, seed=0)       # the benchmark's inputs (bench/README.md)

    def run():
        g_cumsum, A = prepare.prepare_fwd(x.k, x.g, x.beta, x.cu)
        return fused_fwd.chunk_fwd(x.q, x.k, x.v, g_cumsum, x.beta, A, x.h0, x.cu, scale=x.scale)

    run()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    run()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print(f"profiled prepare_fwd + chunk_fwd, H={H} HV={HV} T={args.tokens}")


if __name__ == "__main__":
    main()
