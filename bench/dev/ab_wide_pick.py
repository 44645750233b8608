"""The wide forward's pick through the public API: `flashdelta.chunk_gated_delta_rule` (no gradient, the benchmark's
inputs and call, `cu_seqlens_cpu` given) with the pick as shipped against the same call with it off
(`cp_model.WIDE_MARGIN = 0`), CUDA-graph medians, interleaved in one process; whether the pick took the wide build
(`cp_model.wide_pays` on the row's lengths) and whether o and the final state are bitwise equal.

    source .device/bootstrap.sh; python3 -u bench/dev/ab_wide_pick.py [--rows 16/64:1024x8 ...]
    TILELANG_CACHE_DIR=.cache/tl-ship python3 bench/dev/ab_wide_pick.py --precompile [--rows ...]   # CPU machine

Default rows: the measured rows the model picks, two it leaves to the default, and varlen rows with one long
sequence among short ones (docs/dev/fused_fwd.md, item 0).
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

ROWS = ("16/64:1024x8", "16/32:1024x8", "16/32:2048x4", "16/16:1024x8", "16/16:4096x6", "16/64:8192x4",
        "16/32:8192x3", "16/64:30000+256+256+256+256+256+256+256+256",
        "16/16:16384+" + "+".join(["1024"] * 16))


def _inputs(row: str):
    import providers
    import shapes

    hh, sl = row.split(":")
    h, hv = map(int, hh.split("/"))
    return hh, sl, h, hv, providers.make_inputs(shapes.parse_seqlens(sl), h, hv, seed=0)


def _call(inp):
    import flashdelta

    return lambda: flashdelta.chunk_gated_delta_rule(inp.q, inp.k, inp.v, inp.g, inp.beta, initial_state=inp.h0,
                                                     output_final_state=True, cu_seqlens=inp.cu,
                                                     cu_seqlens_cpu=inp.cu_host)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", nargs="+", default=list(ROWS), help="H/HV:seqlens")
    ap.add_argument("--precompile", action="store_true")
    args = ap.parse_args()
    from flashdelta import cp_model

    if args.precompile:
        from flashdelta.precompile import variants

        for row in args.rows:
            h, hv = map(int, row.split(":")[0].split("/"))
            for label, b, a in variants([(h, hv)], num_sms=132, qk_l2norm=False, initial_state=(True,),
                                        context_parallel=False):
                b(*a)
                print(f"compiled {label}", flush=True)
        return
    import timing

    stream = torch.cuda.Stream()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    margin = cp_model.WIDE_MARGIN
    print(f"{'heads':>6} {'seqlens':>44} {'pick':>5} {'pick ms':>9} {'off ms':>9} {'pick/off':>8}  outputs", flush=True)
    for row in args.rows:
        hh, sl, h, hv, inp = _inputs(row)
        lengths = (inp.cu_host[1:] - inp.cu_host[:-1]).tolist()
        wide = cp_model.wide_pays(T=sum(lengths), N=len(lengths), HV=hv, K=128, V=128, sms=sms, lengths=lengths)
        runners, outs = {}, {}
        for name, m in (("pick", margin), ("off", 0.0)):
            cp_model.WIDE_MARGIN = m
            outs[name] = _call(inp)()
            runners[name] = timing.make_runner(_call(inp), stream=stream)
        cp_model.WIDE_MARGIN = margin
        t = timing.time_runners(runners, stream=stream, flush=None)
        same = all(torch.equal(a, b) for a, b in zip(outs["pick"], outs["off"]))
        print(f"{hh:>6} {sl:>44} {'wide' if wide else '-':>5} {t['pick'].ms:9.4f} {t['off'].ms:9.4f} "
              f"{t['pick'].ms / t['off'].ms:8.3f}  {'bitwise' if same else 'DIFFER'}", flush=True)


if __name__ == "__main__":
    main()
