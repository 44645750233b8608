"""Where the SM90 backward's time goes: each stage of `stages.BACKWARD` timed on its own (CUDA-graph replay medians,
the benchmark's runner), on the benchmark's inputs, plus the portable `prepare_bwd` for comparison and the whole
forward + backward through the public API, as the benchmark calls it and with ``use_qk_l2norm_in_kernel=True``
(the models' call: the q/k normalisation and its backward, fused into the group sum, on top).

    source .device/bootstrap.sh; python3 bench/dev/bwd_stages.py --heads 16/32 --seqlens 1x8192 8192x4
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

import providers  # noqa: E402
import shapes  # noqa: E402
import timing  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", nargs="+", default=["16/32"])
    ap.add_argument("--seqlens", nargs="+", default=["1x8192"])
    args = ap.parse_args()
    from flashdelta import portable
    from flashdelta.kernels import chunk_bwd, fused_fwd, prepare, prepare_bwd, sm90

    stream = torch.cuda.Stream()
    print(f"{'heads':>6} {'seqlens':>10} " + " ".join(f"{n:>12}" for n in NAMES) + "  (ms)")
    for hh in args.heads:
        h, hv = map(int, hh.split("/"))
        for sl in args.seqlens:
            seqlens = shapes.parse_seqlens(sl)
            inp = providers.make_inputs(seqlens, h, hv, seed=0, requires_grad=True)
            q, k, v = inp.q.detach(), inp.k.detach(), inp.v.detach()
            g, beta, h0, cu = inp.g.detach(), inp.beta.detach(), inp.h0.detach(), inp.cu
            scale = q.shape[-1] ** -0.5
            g_cumsum, A = prepare.prepare_fwd(k, g, beta, cu)
            hs = fused_fwd.state_recompute(k, v, g_cumsum, beta, A, h0, cu)
            do, dht = inp.do, inp.dht
            res = chunk_bwd.chunk_bwd(q, k, v, g_cumsum, beta, A, hs, do, dht, cu, scale=scale)
            dG = res[4]

            def api(l2norm=False):
                from flashdelta import chunk_gated_delta_rule
                o, ht = chunk_gated_delta_rule(inp.q, inp.k, inp.v, inp.g, inp.beta, initial_state=inp.h0,
                                               output_final_state=True, cu_seqlens=cu,
                                               use_qk_l2norm_in_kernel=l2norm)
                return torch.autograd.grad((o, ht), inp.leaves(), (do, dht))

            steps = {
                "prepare_fwd": lambda: prepare.prepare_fwd(k, g, beta, cu),
                "state_recomp": lambda: fused_fwd.state_recompute(k, v, g_cumsum, beta, A, h0, cu),
                "chunk_bwd": lambda: chunk_bwd.chunk_bwd(q, k, v, g_cumsum, beta, A, hs, do, dht, cu, scale=scale),
                "group_sum": lambda: sm90.KERNELS.group_sum(res[0], h),
                "prepare_bwd": lambda: prepare_bwd.prepare_bwd(dG, cu),
                "portable_pbwd": lambda: portable.prepare_bwd(dG, cu),
                "fwd+bwd(api)": api,
                "fwd+bwd(l2)": lambda: api(True),
            }
            runners = {}
            for name, fn in steps.items():
                try:
                    runners[name] = timing.make_runner(fn, stream=stream)
                except Exception as exc:  # noqa: BLE001
                    print(f"  {name}: {type(exc).__name__}: {exc}")
            timed = timing.time_runners(runners, stream=stream, flush=None)
            print(f"{hh:>6} {sl:>10} " + " ".join(f"{timed[n].ms:12.4f}" if n in timed else f"{'-':>12}"
                                                  for n in NAMES), flush=True)


NAMES = ("prepare_fwd", "state_recomp", "chunk_bwd", "group_sum", "prepare_bwd", "portable_pbwd", "fwd+bwd(api)",
         "fwd+bwd(l2)")

if __name__ == "__main__":
    main()
