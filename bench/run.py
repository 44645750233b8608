#!/usr/bin/env python3
"""Benchmark flashdelta against its peers: correctness gate, then CUDA-graph timing, CSV, table, chart.

    python bench/run.py --suite fwd|bwd|fwdbwd[,...] [--quick] [--providers flashdelta,fla,flashqla,flashinfer]
                        [--filter REGEX] [--out bench/results/<gpu>/<date>_<commit>.csv]
    python bench/run.py --suite fwd --dry-run      # list the cases and their roofline floors (no GPU)
    python bench/run.py --suite fwd --quick --fake # exercise CSV, table and chart with fake timings (no GPU)

See bench/README.md for the columns and how to run it on the GPU machine.
"""
from __future__ import annotations

import os

# FLA reads this on every call, but set it before anything can import fla: without it FLA dispatches its
# public chunk_gated_delta_rule to FlashQLA whenever flash_qla is installed (docs/performance.md).
os.environ["FLA_FLASH_QLA"] = "0"

import argparse  # noqa: E402
import datetime  # noqa: E402
import platform  # noqa: E402
import random  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import zlib  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
if os.path.isdir(os.path.join(ROOT, "src", "flashdelta")):
    sys.path.insert(1, os.path.join(ROOT, "src"))   # time the checkout whose commit the header names

import report  # noqa: E402
import shapes  # noqa: E402
import timing  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", default="fwd", help="fwd, bwd, fwdbwd, or a comma-separated list")
    ap.add_argument("--quick", action="store_true", help="the small smoke subset of each suite")
    ap.add_argument("--providers", default="flashdelta,fla,flashqla",
                    help="comma list from providers.REGISTRY: flashdelta, fla, flashqla, flashinfer")
    ap.add_argument("--filter", default=None, help="regex searched in case names, e.g. 'h16v64/1x32768'")
    ap.add_argument("--out", default=None, help="CSV path (default bench/results/<gpu>/<date>_<commit>.csv)")
    ap.add_argument("--subject", default="flashdelta", help="provider the speedups are computed for")
    ap.add_argument("--dry-run", action="store_true", help="list cases and floors; touch no GPU")
    ap.add_argument("--fake", action="store_true", help="fake timings through CSV, table and chart; no GPU")
    ap.add_argument("--no-gate", action="store_true", help="skip the correctness gate (rows say so)")
    ap.add_argument("--gate-tokens", type=int, default=shapes.GATE_MAX_TOKENS)
    ap.add_argument("--warmup", type=int, default=2, help="eager calls before capture (after the gate calls)")
    ap.add_argument("--budget-ms", type=float, default=300.0, help="timed GPU time per (case, provider)")
    ap.add_argument("--rounds", type=int, default=4, help="interleaved rounds over the providers")
    ap.add_argument("--min-reps", type=int, default=10)
    ap.add_argument("--max-reps", type=int, default=200)
    ap.add_argument("--flush-mb", type=int, default=256, help="L2 flush buffer before each sample (0: off)")
    ap.add_argument("--peak-tflops", type=float, default=timing.PEAK_TFLOPS)
    ap.add_argument("--peak-tbps", type=float, default=timing.PEAK_TBPS)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-chart", action="store_true")
    ap.add_argument("--max-minutes", type=float, default=None,
                    help="start no new case after this many minutes (the CSV keeps what was measured)")
    args = ap.parse_args(argv)
    args.suites = [s.strip() for s in args.suite.split(",") if s.strip()]
    for s in args.suites:
        if s not in shapes.SUITES:
            ap.error(f"unknown suite {s!r}; expected one of {shapes.SUITES}")
    args.provider_names = [p.strip() for p in args.providers.split(",") if p.strip()]
    return args


def all_cases(args) -> list:
    out = []
    for s in args.suites:
        out += shapes.cases(s, quick=args.quick, pattern=args.filter)
    return out


def case_seed(args, case) -> int:
    return args.seed + zlib.crc32(case.name.encode()) % 1_000_000


def base_row(case, args) -> dict:
    return dict(suite=case.suite, case=case.name, model=case.model, h=case.h, hv=case.hv, k=case.k, v=case.v,
                seqlens=case.seqlens_str, n_seqs=case.n_seqs, tokens=case.tokens, split_seed=case.split_seed,
                seed=case_seed(args, case))


def case_roofline(case, args):
    return timing.roofline(case.suite, case.tokens, case.h, case.hv, case.n_seqs, case.k, case.v,
                           peak_tflops=args.peak_tflops, peak_tbps=args.peak_tbps)


# ----------------------------------------------------------------------------------------------------------
# environment header
# ----------------------------------------------------------------------------------------------------------

def _git(*cmd) -> str:
    try:
        return subprocess.run(["git", "-C", ROOT, *cmd], capture_output=True, text=True, timeout=10,
                              check=True).stdout.strip()
    except Exception:  # noqa: BLE001
        return ""


def flashdelta_commit() -> str:
    env = os.environ.get("FLASHDELTA_COMMIT")
    if env:
        return env
    head = _git("rev-parse", "HEAD")
    if head and _git("status", "--porcelain", "--", "src"):
        head += "+dirty(src)"
    return head or "unknown"


def driver_version() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=True).stdout
        return out.strip().splitlines()[0]
    except Exception:  # noqa: BLE001
        return ""


def environment(args, provs: dict, *, gpu: str, sms, fake: bool = False) -> dict:
    import providers as P

    loaded = {name: (prov.load() if not fake else None) for name, prov in provs.items()}  # sets FLA_* env
    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "gpu": gpu, "sm_count": sms, "driver": driver_version() if not fake else "",
        "cuda": _torch_attr("version.cuda"), "torch": _torch_attr("__version__"),
        "triton": P.dist_version("triton"), "tilelang": P.dist_version("tilelang"),
        "fla": P.dist_version("fla-core"), "flash_qla": P.dist_version("flash-qla"),
        "flashdelta": P.dist_version(None, "flashdelta"), "flashdelta_commit": flashdelta_commit(),
        "python": platform.python_version(),
        "suites": ",".join(args.suites) + (" (quick)" if args.quick else "")
                  + (f" filter={args.filter}" if args.filter else ""),
        "providers": ",".join(args.provider_names),
        "inputs": "q,k bf16 randn l2-normalised; v bf16 randn; g fp32 logsigmoid(randn)/16 with g=0 on a seeded "
                  "random 25% of heads; beta fp32 sigmoid(randn); h0 fp32 randn; output_final_state=True; "
                  "varlen cu_seqlens int32, B=1; bwd: do bf16 randn, dht fp32 randn/8; scale K^-0.5",
        "flop_model": f"{timing.FLOP_MODEL}: fwd {timing.fwd_flops_per_token_head()} / bwd "
                      f"{timing.bwd_flops_per_token_head()} FLOP per token per v-head (C=64, K=V=128)",
        "byte_model": "q,k,v,g,beta,h0 read once; o,ht written (fwd); do,dht read, 6 grads written (bwd)",
        "ceilings": f"{args.peak_tflops} TFLOP/s bf16 dense, {args.peak_tbps} TB/s",
        "timing": f"CUDA-graph replay after {args.warmup} eager warm-ups (plus the gate calls), "
                  f"~{args.budget_ms:g} ms per provider in {args.rounds} interleaved rounds, "
                  f"{args.min_reps}-{args.max_reps} samples, median and p20/p80 of per-replay CUDA events, "
                  f"L2 flush {args.flush_mb} MB before each sample; bwd: the forward runs once outside the "
                  f"graph, the graph replays torch.autograd.grad(retain_graph=True)",
        "gate": "off (--no-gate)" if args.no_gate else
                f"float64 recurrence (flashdelta.reference) on <= {args.gate_tokens} tokens, rel L2 <= 1e-2 "
                f"(2e-2 dg, dbeta); full size: pairwise rel L2 <= 2x that",
        "env": " ".join(f"{k}={os.environ.get(k, '')}" for k in
                        ("FLA_FLASH_QLA", "FLA_INTRACARD_CP", "FLASHDELTA_BACKEND")),
        "command": " ".join([os.path.relpath(sys.argv[0], ROOT) if sys.argv else "run.py"] + sys.argv[1:]),
    }
    for name, prov in provs.items():
        status = loaded[name]
        env[f"provider.{name}"] = (f"unavailable: {status}" if status else
                                   "; ".join([f"version {prov.version()}"] + list(prov.notes)))
    if fake:
        env["FAKE"] = "synthetic timings from --fake; not a measurement"
    return env


def _torch_attr(path: str) -> str:
    try:
        import torch
        obj = torch
        for part in path.split("."):
            obj = getattr(obj, part)
        return str(obj)
    except Exception:  # noqa: BLE001
        return ""


def gpu_slug(name: str) -> str:
    s = name.lower().replace("nvidia", "")
    s = "".join(c if c.isalnum() else "-" for c in s).strip("-")
    while "--" in s:
        s = s.replace("--", "-")
    return s or "unknown-gpu"


def default_out(gpu: str, fake: bool) -> str:
    date = datetime.date.today().isoformat()
    commit = flashdelta_commit()[:7]
    if fake:
        return os.path.join(tempfile.gettempdir(), "flashdelta-bench-fake", f"{date}_{commit}.csv")
    return os.path.join(HERE, "results", gpu_slug(gpu), f"{date}_{commit}.csv")


# ----------------------------------------------------------------------------------------------------------
# modes without a GPU
# ----------------------------------------------------------------------------------------------------------

def dry_run(cases: list, args) -> None:
    print(f"{len(cases)} cases")
    head = ("case", "model", "tokens", "GFLOP", "MB", "compute floor ms", "memory floor ms", "gate seqlens")
    print("  ".join(head))
    for c in cases:
        rf = case_roofline(c, args)
        print(f"{c.name:34s} {c.model:16s} {c.tokens:6d} {rf.flops / 1e9:9.1f} {rf.bytes / 1e6:9.1f} "
              f"{rf.compute_ms:8.3f} {rf.memory_ms:8.3f}  {shapes.format_seqlens(c.gate_seqlens(args.gate_tokens))}"
              + (f"  split_seed={c.split_seed}" if c.split_seed is not None else ""))


FAKE_FACTORS = {"fla": 4.0, "flashqla": 2.0, "flashinfer": 1.4, "flashdelta": 1.6}


def fake_rows(cases: list, args, provs: dict = None) -> list:
    """Synthetic rows (provider time = floor x a per-provider factor x noise) to exercise the writers; a provider
    that does not run a suite gets its ``unsupported`` row, as in a real run."""
    rng = random.Random(args.seed)
    rows = []
    for case in cases:
        rf = case_roofline(case, args)
        for p in args.provider_names:
            why = provs[p].supports(case.suite) if provs and p in provs else None
            if why:
                rows.append(dict(base_row(case, args), provider=p, status="unsupported", note=why))
                continue
            ms = rf.floor_ms * FAKE_FACTORS.get(p, 3.0) * rng.uniform(0.8, 1.25)
            rows.append(dict(base_row(case, args), provider=p, status="ok", ms=ms, p20=ms * 0.98, p80=ms * 1.03,
                             reps=50, cp=1, peak_mb=rng.uniform(100, 900), tflops=rf.tflops(ms), tbps=rf.tbps(ms), floor_ms=rf.floor_ms,
                             floor_frac=rf.floor_frac(ms), timing="fake", gate_err=rng.uniform(1e-3, 5e-3),
                             gate_detail="fake", gate_seqlens=shapes.format_seqlens(case.gate_seqlens()),
                             full_err=rng.uniform(1e-3, 5e-3), full_ref="fake", note="fake"))
    return rows


# ----------------------------------------------------------------------------------------------------------
# the GPU run
# ----------------------------------------------------------------------------------------------------------

class Broken(RuntimeError):
    """The CUDA context is unusable (a sticky error): stop measuring."""


def _err(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return " ".join(text.split())[:400]


def _check_cuda() -> None:
    import torch
    try:
        torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001
        raise Broken(_err(exc)) from exc


def make_step(prov, inp, suite: str, stream):
    """The callable a CUDA graph captures: forward (no grad), backward only, or forward + backward."""
    import torch
    from providers import backward_fn

    if suite == "fwd":
        def step():
            with torch.no_grad():
                return prov.forward(inp)
        return step
    if suite == "bwd":
        with torch.cuda.stream(stream):          # autograd replays backward ops on their forward's stream
            outs = prov.forward(inp)

        def step():
            return backward_fn(prov, inp, outs)
        return step

    def step():
        return backward_fn(prov, inp, prov.forward(inp))
    return step


def peak_mb(prov, inp, grads: bool, stream) -> float:
    """MiB allocated at the peak of one eager forward (+ backward with `grads`) above what was allocated before it:
    saved activations, workspaces and outputs (gradients included)."""
    import torch
    from providers import backward_fn

    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with torch.cuda.stream(stream):
        if grads:
            res = backward_fn(prov, inp, prov.forward(inp))
        else:
            with torch.no_grad():
                res = prov.forward(inp)
    stream.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del res
    return peak / 2 ** 20


def run_case(case, provs: dict, args, stream, flush) -> list:
    import torch
    import gate
    import providers as P

    grads = case.suite != "fwd"
    names = gate.ALL_NAMES if grads else gate.FWD_NAMES
    seed = case_seed(args, case)
    rows = {p: dict(base_row(case, args), provider=p, note="") for p in provs}

    def fail(p, status, note):
        rows[p]["status"] = status
        rows[p]["note"] = (rows[p]["note"] + " | " if rows[p]["note"] else "") + note

    active = []
    for p, prov in provs.items():
        err = prov.load()
        if err:
            fail(p, "unavailable", err)
        elif prov.supports(case.suite):
            fail(p, "unsupported", prov.supports(case.suite))
        else:
            active.append(p)

    # 1. small-T gate against the float64 recurrence
    gate_seq = case.gate_seqlens(args.gate_tokens)
    if not args.no_gate and active:
        small = P.make_inputs(gate_seq, case.h, case.hv, case.k, case.v, seed=seed, requires_grad=grads)
        ref = gate.reference(small, grads=grads)
        for p in active:
            rows[p]["gate_seqlens"] = shapes.format_seqlens(gate_seq)
            try:
                provs[p].prepare(small)
                outs = gate.results(provs[p], small, grads=grads)
                bad_call = provs[p].check_call()
                worst, detail, ok = gate.compare(outs, ref, names)
                rows[p].update(gate_err=worst, gate_detail=detail)
                if bad_call:
                    fail(p, "error", bad_call)
                elif not ok:
                    fail(p, "gate_fail", f"small-T gate failed: {detail}")
                del outs
            except Exception as exc:  # noqa: BLE001
                _check_cuda()
                fail(p, "error", f"gate call: {_err(exc)}")
        del small, ref
    elif args.no_gate:
        for p in active:
            rows[p]["note"] += "gate skipped (--no-gate); "
    passed = [p for p in active if "status" not in rows[p]]

    # 2. full size: one eager call each (compiles/autotunes), pairwise cross-check
    inp = P.make_inputs(case.seqlens, case.h, case.hv, case.k, case.v, seed=seed + 1, requires_grad=grads)
    full = {}
    for p in passed:
        try:
            provs[p].prepare(inp)
            with torch.cuda.stream(stream):
                full[p] = gate.results(provs[p], inp, grads=grads)
            stream.synchronize()
        except Exception as exc:  # noqa: BLE001
            _check_cuda()
            fail(p, "error", f"full-size call: {_err(exc)}")
    for p, (status, err, ref_p) in gate.full_size_verdicts(full, names).items():
        rows[p].update(full_err=err, full_ref=ref_p)
        if status == "fail":
            fail(p, "full_fail", f"full size disagrees with the other providers (vs {ref_p}: {err:.2e})")
        elif status == "mismatch":
            rows[p]["note"] += f"full-size MISMATCH vs {ref_p} ({err:.2e}): no majority, still timed; "
            rows[p]["mismatch"] = True
    del full
    to_time = [p for p in passed if "status" not in rows[p]]

    # 3. peak memory of one eager step above what the inputs hold, then capture and time
    for p in to_time:
        try:
            rows[p]["peak_mb"] = peak_mb(provs[p], inp, grads, stream)
        except Exception as exc:  # noqa: BLE001
            _check_cuda()
            rows[p]["note"] += f"peak memory: {_err(exc)}; "
    runners = {}
    for p in to_time:
        try:
            step = make_step(provs[p], inp, case.suite, stream)
            runners[p] = timing.make_runner(step, stream=stream, warmup=args.warmup)
            rows[p]["cp"] = provs[p].cp_partitions(inp, train=grads)
        except Exception as exc:  # noqa: BLE001
            _check_cuda()
            runners.pop(p, None)
            fail(p, "error", f"timing setup: {_err(exc)}")
    if runners:
        timed = timing.time_runners(runners, stream=stream, budget_ms=args.budget_ms, min_reps=args.min_reps,
                                    max_reps=args.max_reps, rounds=args.rounds, flush=flush)
        rf = case_roofline(case, args)
        for p, t in timed.items():
            rows[p].update(status="mismatch" if rows[p].pop("mismatch", False) else "ok", ms=t.ms, p20=t.p20,
                           p80=t.p80, reps=len(t.samples), timing=t.method, tflops=rf.tflops(t.ms),
                           tbps=rf.tbps(t.ms), floor_ms=rf.floor_ms, floor_frac=rf.floor_frac(t.ms))
            if t.note:
                rows[p]["note"] += t.note
    del runners, inp
    torch.cuda.empty_cache()
    for r in rows.values():
        r.pop("mismatch", None)
        r.setdefault("status", "error")
    return list(rows.values())


def main(argv=None) -> int:
    args = parse_args(argv)
    cases = all_cases(args)
    if args.dry_run:
        dry_run(cases, args)
        return 0
    if not cases:
        print("no cases match")
        return 1

    import providers as P
    provs = P.get(args.provider_names)
    if args.fake:
        gpu, sms = "fake (no GPU)", ""
    else:
        import torch
        if not torch.cuda.is_available():
            print("no CUDA device: use --dry-run or --fake on a machine without a GPU")
            return 2
        gpu = torch.cuda.get_device_name()
        sms = torch.cuda.get_device_properties(0).multi_processor_count
    env = environment(args, provs, gpu=gpu, sms=sms, fake=args.fake)
    out = args.out or default_out(gpu, args.fake)
    for k, v in env.items():
        print(f"{k}: {v}")
    writer = report.CsvWriter(out, env)
    print(f"writing {out}")

    done = []

    def emit(row):
        writer.row(row)
        done.append({k: report.fmt(row.get(k)) for k in report.COLUMNS})
        r = done[-1]
        print(f"  {r['case']:34s} {r['provider']:10s} {r['status']:11s} "
              + (f"{float(r['ms']):8.3f} ms [{float(r['p20']):.3f}, {float(r['p80']):.3f}] {r['timing']}"
                 f" cp={r['cp'] or '?'} {float(r['tflops']):6.1f} TFLOP/s floor {float(r['floor_frac']):.2f}"
                 if r["ms"] else "")
              + (f" gate {r['gate_err']}" if r["gate_err"] else "")
              + (f"  {r['note']}" if r["note"] else ""), flush=True)

    rc = 0
    if args.fake:
        for row in fake_rows(cases, args, provs):
            emit(row)
    else:
        import torch
        stream = torch.cuda.Stream()
        flush = timing.L2Flush(args.flush_mb)
        t0 = time.monotonic()
        for i, case in enumerate(cases):
            if args.max_minutes is not None and time.monotonic() - t0 > 60 * args.max_minutes:
                print(f"--max-minutes {args.max_minutes:g} reached: {len(cases) - i} case(s) not run")
                writer.f.write(f"# stopped: --max-minutes reached, {len(cases) - i} case(s) not run\n")
                break
            print(f"[{i + 1}/{len(cases)}] {case.name} ({case.model})  t={time.monotonic() - t0:.0f}s", flush=True)
            try:
                for row in run_case(case, provs, args, stream, flush):
                    emit(row)
            except Broken as exc:
                print(f"CUDA context broken, stopping: {exc}")
                for p in provs:
                    emit(dict(base_row(case, args), provider=p, status="error", note=f"CUDA broken: {exc}"))
                rc = 3
                break
        fla = provs.get("fla")
        if fla is not None and not fla.load():
            log = sorted(set(fla.dispatch_log()))
            writer.f.write(f"# fla_dispatch: {' | '.join(log) if log else 'Triton (no backend taken)'}\n")
            print("fla dispatch log:", *(log or ["(none: every FLA op ran its Triton default)"]), sep="\n  ")
    writer.close()
    print()
    print(report.format_table(done, args.subject))
    if not args.no_chart:
        png = report.chart(done, os.path.splitext(out)[0] + ".png", args.subject, title=gpu)
        if png:
            print(f"chart: {png}")
    print(f"csv: {out}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
