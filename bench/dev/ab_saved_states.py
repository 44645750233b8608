"""The backward's chunk states: saved by the training forward, or recomputed by the backward (issue 17, item 1).
Times, interleaved in one process with CUDA graphs, per row: the forward `chunk_fwd` as shipped, the same forward
writing every chunk's state (`chunk_fwd(save_states=True)`, the full build with its state output) and the backward's
`state_recompute`; checks that the saving forward's o is the forward's and its states are the recompute's (bitwise,
on the slots a chunk owns). A training step pays `fwd + recompute` one way and `fwd_save` the other, which also
holds the states (T / 64 + N + 1 slots of HV x V x K in q's dtype) from the forward to the backward.

    source .device/bootstrap.sh; python3 bench/dev/ab_saved_states.py [--rows 16/32:1x8192 ...] [--precompile]

--precompile (CPU machine, TILELANG_CACHE_DIR set) compiles the three builds for the rows' heads and exits.
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from ab_chunk_bwd import outputs_and_times, setup  # noqa: E402
from ab_fused_fwd import fwd_row  # noqa: E402

ROWS = ("16/32:6413+6673+10954+8728", "16/32:1x8192", "16/64:8192x4", "16/64:1024x8", "2/8:1x32768",
        "2/4:1x8192")
MODES = ("fwd", "fwd_save", "recompute")


def _builds(m, h: int, hv: int) -> list:
    dims = (h, hv, 128, 128, torch.bfloat16, torch.float32, torch.float32)
    return (m.state_recompute_builds(*dims, initial_state=(True,))
            + [b for save in (False, True)
               for b in m.launcher_builds(*dims, 128 ** -0.5, initial_state=(True,), save_states=save)])


def main():
    args, mods = setup(__doc__, "fused_fwd", ROWS)
    m = mods["shipped"]
    if args.precompile:
        for row in args.rows:
            h, hv = map(int, row.split(":")[0].split("/"))
            for label, b, a in _builds(m, h, hv):
                b(*a)
                print(label, flush=True)
        return
    stream = torch.cuda.Stream()
    print(f"{'heads':>6} {'seqlens':>28} " + " ".join(f"{n + ' ms':>13}" for n in MODES)
          + "  fwd+rec / fwd_save  states MB  checks", flush=True)
    for row in args.rows:
        hh, sl, inp, scale, g_cumsum, A, owned = fwd_row(row)
        q, k, v, beta, h0, cu = inp.q, inp.k, inp.v, inp.beta, inp.h0, inp.cu
        calls = {
            "fwd": lambda: m.chunk_fwd(q, k, v, g_cumsum, beta, A, h0, cu, scale=scale),
            "fwd_save": lambda: m.chunk_fwd(q, k, v, g_cumsum, beta, A, h0, cu, scale=scale, save_states=True),
            "recompute": lambda: m.state_recompute(k, v, g_cumsum, beta, A, h0, cu),
        }
        outs, ms = outputs_and_times({n: n for n in MODES}, lambda n: calls[n], stream)
        o_ok = torch.equal(outs["fwd_save"][0], outs["fwd"][0]) and torch.equal(outs["fwd_save"][1], outs["fwd"][1])
        h_ok = torch.equal(outs["fwd_save"][2][owned], outs["recompute"][owned])
        mb = outs["recompute"].numel() * outs["recompute"].element_size() / 1e6
        print(f"{hh:>6} {sl:>28} " + " ".join(f"{ms[n]:13.4f}" for n in MODES)
              + f"  {(ms['fwd'] + ms['recompute']) / ms['fwd_save']:18.3f}  {mb:9.1f}"
              + f"  o {'bitwise' if o_ok else 'DIFFERS'}, states {'bitwise' if h_ok else 'DIFFER'}", flush=True)


if __name__ == "__main__":
    main()
