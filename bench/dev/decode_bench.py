"""Decode step time: flashdelta's SM90 decode kernel vs its PyTorch path vs FLA's fused_recurrent_gated_delta_rule,
against the memory floor (docs/dev/decode.md).

One decode step per sequence (T = 1), dense ``[B, 1, H, K]`` bf16 q/k/v (with ``--varlen`` also the varlen form,
``cu_seqlens = arange(B + 1)``), fp32 g, bf16 beta, fp32 state ``[B, HV, K, V]`` in and out, q/k l2norm in the kernel
(Qwen3-Next's call). Each provider is timed as a CUDA-graph replay with the benchmark's runner (bench/timing.py: L2
flushed before each sample, providers interleaved over rounds), after a correctness check of every provider against
the float64 recurrence. The floor is the bytes the step must move (state read + written, q, k, v, o, g, beta) at
`timing.PEAK_TBPS` (the H200's measured bandwidth); the nominal 4.8 TB/s floor is printed as well. The `copy` column
is a device copy of the state (``torch.Tensor.copy_``, the same state bytes read and written) timed the same way:
what this timing method gives a kernel that only moves those bytes.

    source .device/bootstrap.sh; python3 -u bench/dev/decode_bench.py [--batches 1 32 256] [--heads 16/32 2/8]
        [--varlen] [--lanes 1 4] [--out $OUT/decode.csv]
    TILELANG_CACHE_DIR=.cache/tl-ship python3 bench/dev/decode_bench.py --precompile     # on the CPU machine

--precompile compiles (no GPU) every decode build this benchmark and tests/gpu/test_decode.py launch.
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import importlib.util
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.dirname(HERE))               # bench/ (timing)

import torch  # noqa: E402

import timing  # noqa: E402

NOMINAL_TBPS = 4.8
K = V = 128


def parse_heads(s: str) -> tuple:
    h, hv = s.split("/")
    return int(h), int(hv)


def step_bytes(B: int, H: int, HV: int) -> int:
    """Bytes one decode step must move: the fp32 state in and out, bf16 q, k, v, o, fp32 g, bf16 beta."""
    return 2 * B * HV * K * V * 4 + B * (2 * H * K + 2 * HV * V) * 2 + B * HV * (4 + 2)


def inputs(B: int, H: int, HV: int, varlen: bool, seed: int = 0) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, device="cuda", generator=gen)

    x = dict(q=randn(B, 1, H, K).bfloat16(), k=randn(B, 1, H, K).bfloat16(), v=randn(B, 1, HV, V).bfloat16(),
             g=torch.nn.functional.logsigmoid(randn(B, 1, HV) + 2), beta=torch.sigmoid(randn(B, 1, HV)).bfloat16(),
             initial_state=randn(B, HV, K, V) * 0.1)
    if varlen:
        x = {n: t.reshape(1, B, *t.shape[2:]) if n != "initial_state" else t for n, t in x.items()}
        x["cu_seqlens"] = torch.arange(B + 1, device="cuda", dtype=torch.int32)
    return x


@contextlib.contextmanager
def backend(name: str):
    old = os.environ.get("FLASHDELTA_BACKEND")
    os.environ["FLASHDELTA_BACKEND"] = name
    try:
        yield
    finally:
        if old is None:
            del os.environ["FLASHDELTA_BACKEND"]
        else:
            os.environ["FLASHDELTA_BACKEND"] = old


@contextlib.contextmanager
def forced_lanes(n: int):
    """The decode launcher with n lanes per value column instead of its own pick (`decode.lanes_for`)."""
    from flashdelta.kernels import decode

    real = decode.lanes_for
    decode.lanes_for = lambda *args: n
    try:
        yield
    finally:
        decode.lanes_for = real


def providers(use_fla: bool, lanes: tuple = ()) -> dict:
    from flashdelta import fused_recurrent_gated_delta_rule as fd

    def kernel(x):
        with backend("sm90"):
            return fd(**x, output_final_state=True, use_qk_l2norm_in_kernel=True)

    def kernel_lanes(x, n):
        with backend("sm90"), forced_lanes(n):
            return fd(**x, output_final_state=True, use_qk_l2norm_in_kernel=True)

    def portable(x):
        with backend("torch"):
            return fd(**x, output_final_state=True, use_qk_l2norm_in_kernel=True)

    out = {"flashdelta": kernel, "torch": portable}
    for n in lanes:
        out[f"lanes{n}"] = lambda x, n=n: kernel_lanes(x, n)
    if use_fla:
        try:
            os.environ.setdefault("FLA_FLASH_QLA", "0")
            from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fla_fn
        except Exception as exc:  # noqa: BLE001 - FLA is optional here
            print(f"FLA not available ({type(exc).__name__}: {exc}); timing flashdelta only", file=sys.stderr)
        else:
            out["fla"] = lambda x: fla_fn(**x, output_final_state=True, use_qk_l2norm_in_kernel=True)
    return out


def check(fns: dict, x: dict) -> dict:
    """Relative L2 error of each provider's o and final state against the float64 recurrence."""
    from flashdelta.numerics import TOLS, rel_l2
    from flashdelta.reference import recurrent_gated_delta_rule

    f64 = {n: t.double() if t.is_floating_point() else t for n, t in x.items()}
    ro, rh = recurrent_gated_delta_rule(f64["q"], f64["k"], f64["v"], f64["g"], f64["beta"],
                                        initial_state=f64["initial_state"], use_qk_l2norm_in_kernel=True,
                                        cu_seqlens=x.get("cu_seqlens"))
    errs = {}
    for name, fn in fns.items():
        o, ht = fn(x)
        errs[name] = (rel_l2(o, ro), rel_l2(ht, rh))
        if not (errs[name][0] <= TOLS["o"] and errs[name][1] <= TOLS["ht"]):
            raise SystemExit(f"{name}: o error {errs[name][0]:.2e}, state error {errs[name][1]:.2e} over tolerance")
    return errs


def run(args) -> int:
    fns = providers(not args.no_fla, tuple(args.lanes))
    stream = torch.cuda.Stream()
    flush = timing.L2Flush(args.flush_mb)
    rows = []
    names = list(fns) + ["copy"]
    print(f"{'heads':>6} {'B':>4} {'form':>6} {'floor us':>9} " + " ".join(f"{n + ' us':>14}" for n in names)
          + "  flashdelta/floor  flashdelta/copy  fla/flashdelta", flush=True)
    for hh in args.heads:
        H, HV = parse_heads(hh)
        for B in args.batches:
            for varlen in ((False, True) if args.varlen else (False,)):
                small = inputs(min(B, 4), H, HV, varlen, seed=1)
                errs = check(fns, small)
                x = inputs(B, H, HV, varlen)
                runners = {n: timing.make_runner(lambda fn=fn: fn(x), stream=stream) for n, fn in fns.items()}
                dst = torch.empty_like(x["initial_state"])
                runners["copy"] = timing.make_runner(lambda: dst.copy_(x["initial_state"]), stream=stream)
                timed = timing.time_runners(runners, stream=stream, budget_ms=args.budget_ms, flush=flush,
                                            rounds=args.rounds)
                nbytes = step_bytes(B, H, HV)
                floor_us = nbytes / (timing.PEAK_TBPS * 1e12) * 1e6
                us = {n: timed[n].ms * 1e3 for n in names}
                ratio_fla = f"{us['fla'] / us['flashdelta']:14.2f}" if "fla" in us else f"{'-':>14}"
                print(f"{hh:>6} {B:>4} {'varlen' if varlen else 'dense':>6} {floor_us:9.2f} "
                      + " ".join(f"{us[n]:14.2f}" for n in names)
                      + f"  {us['flashdelta'] / floor_us:16.2f}  {us['flashdelta'] / us['copy']:15.2f}{ratio_fla}",
                      flush=True)
                for n in names:
                    rows.append(dict(heads=hh, B=B, form="varlen" if varlen else "dense", provider=n,
                                     us=f"{us[n]:.3f}", p20_us=f"{timed[n].p20 * 1e3:.3f}",
                                     p80_us=f"{timed[n].p80 * 1e3:.3f}", timing=timed[n].method,
                                     floor_us=f"{floor_us:.3f}",
                                     floor_nominal_us=f"{nbytes / (NOMINAL_TBPS * 1e12) * 1e6:.3f}",
                                     bytes=nbytes, err_o=f"{errs[n][0]:.2e}" if n in errs else "",
                                     err_ht=f"{errs[n][1]:.2e}" if n in errs else "",
                                     note=timed[n].note))
    if args.out:
        with open(args.out, "w", newline="") as f:
            f.write(f"# decode_bench commit={os.environ.get('FLASHDELTA_COMMIT', 'unknown')} "
                    f"gpu={torch.cuda.get_device_name()} peak_tbps={timing.PEAK_TBPS}\n")
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
        print(f"wrote {args.out}")
    return 0


def precompile(args) -> int:
    """Compile (no GPU) every decode build of this benchmark and of tests/gpu/test_decode.py."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    spec = importlib.util.spec_from_file_location("gpu_test_decode", os.path.join(ROOT, "tests", "gpu",
                                                                                   "test_decode.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    from flashdelta.kernels import decode, sm90

    todo = {}
    for name, a in mod.recorded_builds():
        todo.setdefault(a, f"test_decode {name}")
    extra = [mod.DecodeCase("chain", B=3, T=4, gate="bias", beta_act=1),
             mod.DecodeCase("graph", seqlens=(1, 0, 2, 1), pad=1), mod.DecodeCase("grad", B=2, T=2,
                                                                                   dtype=torch.float32,
                                                                                   beta_dtype=torch.float32),
             mod.DecodeCase("big", B=3, H=1, HV=1)]
    for name, a in mod.recorded_builds(extra):
        todo.setdefault(a, f"test_decode {name}")
    for hh in args.heads:
        H, HV = parse_heads(hh)
        for label, _, a in sm90.decode_builds([(H, HV)], head_dim=(K, V), dtype=torch.bfloat16,
                                              beta_dtype=torch.bfloat16, h0_dtype=torch.float32, scale=K ** -0.5):
            todo.setdefault(a, f"bench {hh}: {label}")
    t0 = time.time()
    for i, (a, label) in enumerate(todo.items(), 1):
        t = time.time()
        decode.build(*a)
        print(f"[{i}/{len(todo)}] {label}: {time.time() - t:.1f} s", flush=True)
    print(f"{len(todo)} decode builds in {time.time() - t0:.0f} s")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 32, 64, 256])
    ap.add_argument("--heads", nargs="+", default=["16/32", "2/8"], help="H/HV pairs")
    ap.add_argument("--varlen", action="store_true", help="also the varlen form (cu_seqlens = arange(B + 1))")
    ap.add_argument("--no-fla", action="store_true")
    ap.add_argument("--lanes", type=int, nargs="*", default=[],
                    help="also time the kernel with these lanes per value column forced (columns lanesN)")
    ap.add_argument("--budget-ms", type=float, default=200.0)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--flush-mb", type=int, default=256)
    ap.add_argument("--out", default="")
    ap.add_argument("--precompile", action="store_true", help="compile the decode builds (no GPU) and exit")
    args = ap.parse_args()
    if args.precompile:
        return precompile(args)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (or --precompile)")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
