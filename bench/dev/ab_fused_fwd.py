"""A/B of fused_fwd variants on the benchmark's inputs: the backward's `state_recompute` (the states-only build that
writes every chunk's state) and the forward `chunk_fwd`, each variant's outputs against the shipped kernel's
(bitwise, else the largest absolute difference) and CUDA-graph medians, the variants interleaved in one process. A
variant is a copy of kernels/fused_fwd.py (anywhere on disk, not committed), imported as a module of
flashdelta.kernels:

    git show main:src/flashdelta/kernels/fused_fwd.py > /tmp/fused_fwd_main.py
    source .device/bootstrap.sh; python3 bench/dev/ab_fused_fwd.py --variant main=/tmp/fused_fwd_main.py \\
        [--rows 16/32:6413+6673+10954+8728] [--precompile]

--precompile (CPU machine, TILELANG_CACHE_DIR set) compiles every variant's builds for the rows and exits. Each row
also times the shipped module's `chunk_fwd(wide=True)` (the one-CTA-per-head build, kernels/fused_fwd_wide.py)
against its default build, interleaved, with the outputs compared.

--wide: only that comparison (no variants, no state_recompute), by default at the rows that decide the wide build
(docs/dev/fused_fwd.md, "What to try next" item 0: 16/64 8192x4, 16/64 1024x8, 16/32 8192x4, 16/64 1x32768):

    python3 bench/dev/ab_fused_fwd.py --wide --precompile        # CPU machine, TILELANG_CACHE_DIR set
    source .device/bootstrap.sh; python3 bench/dev/ab_fused_fwd.py --wide

Each line: CUDA-graph medians of the fused kernel alone (prepare_fwd's outputs are inputs), default and wide
interleaved in one process, their ratio, and the wide build's o and final state against the default's. With --wide a
--variant is a copy of kernels/fused_fwd_wide.py: the shipped `chunk_fwd(wide=True)` runs with it in place of the
shipped wide module while its CUDA graph is captured, timed in the same interleaving, its outputs against the
shipped wide build's:

    python3 bench/dev/ab_fused_fwd.py --wide --variant er=/tmp/fused_fwd_wide_er.py [--precompile]
"""
import inspect
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from ab_chunk_bwd import outputs_and_times, precompile, row_inputs, setup  # noqa: E402

ROWS = ("16/32:6413+6673+10954+8728", "16/32:1x8192", "16/64:8192x4", "2/4:1x8192", "16/32:512x16")
WIDE_ROWS = ("16/64:8192x4", "16/64:1024x8", "16/32:8192x4", "16/64:1x32768")


def _diff(x, y) -> str:
    if torch.equal(x, y):
        return "bitwise"
    return f"max|d| {(x.float() - y.float()).abs().max().item():.1e}"


def fwd_row(row: str) -> tuple:
    """(heads, seqlens, inputs, scale, g_cumsum, A, owned) of one --rows entry for the fused forward: the benchmark's
    inputs, prepare_fwd's outputs and the state slots state_recompute writes (chunk c of sequence n:
    cu[n] // 64 + n + c; the others are unset)."""
    from flashdelta.kernels import prepare

    hh, sl, inp = row_inputs(row, requires_grad=False)
    g_cumsum, A = prepare.prepare_fwd(inp.k, inp.g, inp.beta, inp.cu)[:2]
    cl = inp.cu.tolist()
    owned = torch.tensor([b // 64 + n + c for n, (b, e) in enumerate(zip(cl, cl[1:]))
                          for c in range(-(-(e - b) // 64))], device=inp.q.device)
    return hh, sl, inp, inp.q.shape[-1] ** -0.5, g_cumsum, A, owned


def _has_wide(m) -> bool:
    return "wide" in inspect.signature(m.chunk_fwd).parameters


def _builds(m, h: int, hv: int) -> list:
    fwd = [dict(wide=True)] if _has_wide(m) else []
    return (m.state_recompute_builds(h, hv, 128, 128, torch.bfloat16, torch.float32, torch.float32,
                                     initial_state=(True,))
            + [b for kw in [{}] + fwd
               for b in m.launcher_builds(h, hv, 128, 128, torch.bfloat16, torch.float32, torch.float32, 128 ** -0.5,
                                          initial_state=(True,), **kw)])


def _wide_builds(m, h: int, hv: int) -> list:
    """The default and wide forward builds of one row's heads (what --wide launches); for a copy of
    fused_fwd_wide.py (no `launcher_builds`), its build at the shipped wide build's arguments."""
    from flashdelta.kernels import fused_fwd

    wide = fused_fwd.launcher_builds(h, hv, 128, 128, torch.bfloat16, torch.float32, torch.float32, 128 ** -0.5,
                                     initial_state=(True,), wide=True)
    if not hasattr(m, "launcher_builds"):
        return [(f"{label} (variant)", m.build, args) for label, _, args in wide]
    return m.launcher_builds(h, hv, 128, 128, torch.bfloat16, torch.float32, torch.float32, 128 ** -0.5,
                             initial_state=(True,)) + wide


def wide_vs_default(m, hh: str, sl: str, inp, scale, g_cumsum, A, stream, variants=None) -> None:
    """One row: module m's default and wide `chunk_fwd` (and the wide chunk_fwd with each of `variants`, {name:
    fused_fwd_wide copy}, in place of the shipped wide module), interleaved CUDA-graph medians and their outputs
    compared."""
    import timing
    from ab_chunk_bwd import patched_runners

    import flashdelta.kernels as fk
    from flashdelta.kernels import fused_fwd_wide

    q, k, v, beta, h0, cu = inp.q, inp.k, inp.v, inp.beta, inp.h0, inp.cu

    def default():
        return m.chunk_fwd(q, k, v, g_cumsum, beta, A, h0, cu, scale=scale)

    def wide():
        return m.chunk_fwd(q, k, v, g_cumsum, beta, A, h0, cu, scale=scale, wide=True)

    def patch(mod):
        fk.fused_fwd_wide = mod
        return lambda: setattr(fk, "fused_fwd_wide", fused_fwd_wide)

    outs, runners = patched_runners(wide, {"wide": fused_fwd_wide, **(variants or {})}, patch, stream)
    outs["default"] = [x.clone() for x in default()]
    torch.cuda.synchronize()
    runners["default"] = timing.make_runner(default, stream=stream)
    t = timing.time_runners(runners, stream=stream, flush=None)
    line = (f"{hh:>6} {sl:>28} {'default / wide':>16} {t['default'].ms:12.4f} {t['wide'].ms:12.4f}  "
            f"wide/default {t['wide'].ms / t['default'].ms:.3f}  o: {_diff(outs['wide'][0], outs['default'][0])}, "
            f"ht: {_diff(outs['wide'][1], outs['default'][1])}")
    for n in variants or {}:
        line += (f"  | {n} {t[n].ms:.4f} ms, /wide {t[n].ms / t['wide'].ms:.3f}, o: "
                 f"{_diff(outs[n][0], outs['wide'][0])}, ht: {_diff(outs[n][1], outs['wide'][1])}")
    print(line, flush=True)


def main():
    args, mods = setup(__doc__, "fused_fwd", None,
                       flags={"--wide": "only the shipped module's default vs wide chunk_fwd (default rows: the "
                                        "wide build's decision rows)"})
    rows = args.rows or list(WIDE_ROWS if args.wide else ROWS)
    if args.precompile:
        precompile(rows, mods, _wide_builds if args.wide else _builds)
        return
    stream = torch.cuda.Stream()
    names = list(mods)
    if args.wide:
        print(f"{'heads':>6} {'seqlens':>28} {'kernel':>16} {'default ms':>12} {'wide ms':>12}", flush=True)
        for row in rows:
            hh, sl, inp, scale, g_cumsum, A, _ = fwd_row(row)
            wide_vs_default(mods["shipped"], hh, sl, inp, scale, g_cumsum, A, stream,
                            {n: mod for n, mod in mods.items() if n != "shipped"})
        return
    print(f"{'heads':>6} {'seqlens':>28} {'kernel':>16} " + " ".join(f"{n + ' ms':>12}" for n in names)
          + "  vs shipped", flush=True)
    for row in rows:
        hh, sl, inp, scale, g_cumsum, A, owned = fwd_row(row)
        q, k, v, beta, h0, cu = inp.q, inp.k, inp.v, inp.beta, inp.h0, inp.cu
        calls = {
            "state_recompute": lambda m: lambda: m.state_recompute(k, v, g_cumsum, beta, A, h0, cu),
            "chunk_fwd": lambda m: lambda: m.chunk_fwd(q, k, v, g_cumsum, beta, A, h0, cu, scale=scale),
        }
        for kernel, call in calls.items():
            outs, ms = outputs_and_times(mods, call, stream)
            line = f"{hh:>6} {sl:>28} {kernel:>16} " + " ".join(f"{ms[n]:12.4f}" for n in names)
            for n in names[1:]:
                out, ref = outs[n], outs["shipped"]
                out, ref = (out[owned], ref[owned]) if kernel == "state_recompute" else (out[0], ref[0])
                line += f"  {n}: {_diff(out, ref)}"
            print(line, flush=True)
        if _has_wide(mods["shipped"]):
            wide_vs_default(mods["shipped"], hh, sl, inp, scale, g_cumsum, A, stream)


if __name__ == "__main__":
    main()
