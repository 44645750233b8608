"""A/B of the CP warm-up's windows kernel (`kernels.cp_windows`) against a copy of it, on the benchmark's inputs:
per row, partition length and direction (forward `cp.windows`, backward `cp.grad_windows`), reading k (`norm`
k), beta alone (`keys_normalized`: beta) and prepare's squared key norms in place of k (norms), whether every
output equals the shipped kernel's (they should, bit for bit) and CUDA-graph medians of one launch, the modules
interleaved in one process. Without a variant it times the shipped kernel's three modes. A variant is a copy of kernels/cp_windows.py
(anywhere on disk, not committed), imported as a module of flashdelta.kernels:

    git show a4e98cc:src/flashdelta/kernels/cp_windows.py > /tmp/cp_windows_old.py
    source .device/bootstrap.sh; python3 bench/dev/ab_cp_windows.py --variant old=/tmp/cp_windows_old.py \\
        [--rows 2/8:1x32768 ...] [--L 32] [--precompile]

--precompile (CPU machine, TILELANG_CACHE_DIR set) compiles every module's builds for the rows and exits.
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, ".."), HERE]

import torch  # noqa: E402

ROWS = ("2/8:1x32768", "4/16:1x32768", "16/16:1x32768", "2/4:1x32768")


def main() -> int:
    from ab_chunk_bwd import outputs_and_times, precompile, row_inputs, setup

    args, mods = setup(__doc__, "cp_windows", ROWS)
    L = 32
    if args.precompile:
        precompile(args.rows, mods, lambda m, h, hv: m.launcher_builds(h, hv, 128, torch.bfloat16, torch.float32,
                                                                       backward=(False, True)))
        return 0
    from flashdelta import cp
    from flashdelta.kernels import prepare

    stream = torch.cuda.Stream()
    names = list(mods)
    print(f"{'heads':>6} {'seqlens':>14} {'pass':>4} {'norm':>5} " + " ".join(f"{n + ' us':>12}" for n in names)
          + "  " + " ".join(f"{n}/{names[0]:<8}" for n in names[1:]) + "  outputs", flush=True)
    for row in args.rows:
        hh, sl, inp = row_inputs(row, requires_grad=False)
        k, beta, cu = inp.k, inp.beta, inp.cu
        g_cumsum, _, k_norm2 = prepare.prepare_fwd(k, inp.g, beta, cu, norms=True)
        plan = cp.make_plan(cu, k.shape[1], L)
        for backward in (False, True):
            for mode, normalized, norms in (("k", False, None), ("beta", True, None), ("norms", False, k_norm2)):
                limit = cp._limit(beta, normalized)

                def call(m, backward=backward, normalized=normalized, limit=limit, norms=norms):
                    return lambda: m.windows_tensors(g_cumsum, k, beta, plan.cu, plan.first, L, cp.WARMUP_THRESHOLD,
                                                     limit, normalized, backward=backward, k_norm2=norms)

                outs, ms = outputs_and_times(mods, call, stream)
                same = all(all(torch.equal(a, b) for a, b in zip(outs[names[0]], outs[n])) for n in names[1:])
                us = [1000 * ms[n] for n in names]
                print(f"{hh:>6} {sl:>14} {'bwd' if backward else 'fwd':>4} {mode:>5} "
                      + " ".join(f"{u:12.2f}" for u in us) + "  "
                      + " ".join(f"{u / us[0]:>{len(n) + 9}.3f}" for n, u in zip(names[1:], us[1:]))
                      + f"  {'equal' if same else 'DIFFER'}", flush=True)
        del inp
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
