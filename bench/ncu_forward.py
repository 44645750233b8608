"""Drive the launcher's prepare_fwd and chunk_fwd once each for Nsight Compute (development tool, NOTES-gpu.md).

    source .device/bootstrap.sh; ncu --clock-control none --set full -k regex:"prepare|chunk_fwd" \\
        python3 bench/ncu_forward.py --tokens 32768 --heads 16/64

One warm-up call of each kernel outside the profiled range (compile/load), then one profiled call of each
(cudaProfilerStart/Stop; run ncu with --profile-from-start off).
"""
from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--heads", default="16/64", help="H/HV")
    args = ap.parse_args()
    import torch

    from flashdelta.kernels import fused_fwd, prepare
    from profile_fwd import make_inputs

    H, HV = (int(x) for x in args.heads.split("/"))
    q, k, v, gc, beta, A, h0, cu = make_inputs(args.tokens, H, HV)
    g = torch.nn.functional.logsigmoid(torch.randn_like(gc)) / 16

    def run():
        g_cumsum, A_k = prepare.prepare_fwd(k, g, beta, cu)
        return fused_fwd.chunk_fwd(q, k, v, g_cumsum, beta, A_k, h0, cu, scale=128 ** -0.5)

    run()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    run()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print(f"profiled prepare_fwd + chunk_fwd, H={H} HV={HV} T={args.tokens}")


if __name__ == "__main__":
    main()
