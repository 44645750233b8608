"""Fit the CP cost model's constants (`flashdelta.cp`) on the GPU and check its choices.

Times, with CUDA-graph replay on the benchmark's inputs (bench/providers.py, bf16, K = V = 128, h0 given):

- per case: the serial fused pass (`chunk_fwd` over whole sequences), and per partition length L the fused pass
  over the partitions (the output pass), the summary passes as CP launches them (E and M with `states_only`, M with
  `zero_values`), the plan (the kernel and the torch ops), the torch and the kernel scans, the warm-up's decision
  (`cp.windows`: the SM90 path's windows kernel and the torch ops) and its E pass (the windows) and M pass (the
  fallback heads) beside the model's `m` / `e`, and the whole forward through the public API with CP off, with
  `context_parallel=L` (the warm-up as `auto` decides at that L) and with the warm-up off
  (``FLASHDELTA_CP_WARMUP=0``: the exact path), and with the automatic choice (cu_seqlens_cpu given);
- a least-squares fit of `CHUNK_US_IDLE`, `CHUNK_US_FULL`, `ITEM_US`, `LAUNCH_US` to the fused passes (the model of
  `cp_model._pass_us` is linear in them on a given schedule: each row is the slot that finishes last in the model's
  own list schedule at the shipped constants, `_pass_row`), of `SCAN_STEP_US` to the serial scans, `SCAN_LEVEL_US` /
  `SCAN_TFLOPS` to the log-depth ones, `SCAN_KERNEL_US` / `SCAN_KERNEL_STEP_US` to the scan kernel's,
  `SUMMARY_CHUNK_FACTOR` to the states-only passes over the full ones and `WARMUP_US` to the decision (the mean over
  the rows; the measured fallback share and window length print beside `WARMUP_FALLBACK` and `WARMUP_CHUNKS`);
- the table of chosen vs best: for each case the API time of CP off, of every L, the best, what the model picks with
  the shipped and with the fitted constants, and the chosen / best ratio; and the CUDA kernels one CP forward
  launches (torch.profiler) for the first case of each head config.

With ``--bwd``, the backward instead (heads 2/8, 4/16, 16/32 at 1x8192 and 1x32768 unless given; h0 and dht
given, fp32 beta):

- per case: the stages whose cost depends on the split, alone: `chunk_bwd` over whole sequences and over the
  partitions of each L (random states and end gradients), `state_recompute` the same, `chunk_dstate` over the
  partitions, the backward warm-up's decision (`cp.grad_windows`: the kernel and the torch ops) and its F pass
  (`chunk_dstate` with the windows' `chunk_take`) beside the model's ``start``; and forward + backward
  (`torch.autograd.grad` of o and the final state) through the public API with CP off and with the automatic
  choice, and through the forward op with the forward's automatic L and the backward at each L (`cp.encode`), the
  warm-up as `auto` decides, off (``FLASHDELTA_CP_WARMUP=0``) and on (``=1``, both passes);
- a least-squares fit of `BWD_LAUNCH_US`, `BWD_CHUNK_US`, `BWD_ITEM_US` to the chunk_bwd passes (the model of
  `cp_model._bwd_pass_us`, rows as in the forward: `_bwd_pass_row`), `RECOMPUTE_FACTOR` (state_recompute over the
  forward pass model), `START_GRAD_FACTOR` (chunk_dstate over chunk_bwd on the same partitions) and `WARMUP_BWD_US`
  (the backward's windows, the mean over the rows; the measured fallback share and window length print beside
  `WARMUP_FALLBACK` and `WARMUP_CHUNKS`);
- the table of chosen vs best (forward + backward time of each backward L, off, auto; the backward's L the model
  picks with the shipped and with the fitted constants, as `cp.decide` asks: ``starts_saved`` and ``states_saved``
  where the forward stays serial) and `cp.predict_bwd`'s prediction (the same) beside each measured L;
  `SAVE_STATES_FACTOR` (the saving forward's extra time over the forward pass model, serial).

    source .device/bootstrap.sh; python3 -u bench/dev/fit_cp.py            # the whole grid (~4-6 min)
    python3 -u bench/dev/fit_cp.py --heads 2/8 --seqlens 1x32768 --L 32 64  # one row
    python3 -u bench/dev/fit_cp.py --bwd                                    # the backward rows (~5-6 min)

Builds: the fused forward at (K, V) = (128, 128) with and without an initial state, K-first (`flashdelta warmup`'s
defaults), and prepare_fwd, for each head config; with --bwd also state_recompute (with an initial state) and
chunk_bwd (with dht), K-first, chunk_dstate and prepare_bwd (`flashdelta warmup --backward`'s defaults); and CP's
own (`cp.builds`: the `chunk_skip` builds of the warm-up's M and E passes, the scan kernel; with --bwd
chunk_dstate's `chunk_take` build of the backward's warm-up). ``--precompile``
compiles exactly the builds of the given mode and heads (on the CPU machine, into ``TILELANG_CACHE_DIR``) and exits:

    TILELANG_CACHE_DIR=.cache/tl-ship python3 bench/dev/fit_cp.py --bwd --precompile
"""
import argparse
import math
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

import providers  # noqa: E402
import shapes  # noqa: E402
import timing  # noqa: E402

HEADS = ["2/8", "4/16", "8/32", "16/64"]
SEQLENS = ["1x32768", "1x8192", "8192x4", "4096x8"]
LS = [16, 32, 64, 128]
BWD_HEADS = ["2/8", "4/16", "16/32"]
BWD_SEQLENS = ["1x8192", "1x32768"]
BWD_LS = [4, 8, 16, 32, 64, 128]


def _items(seqlens, L):
    """[(chunks, count)] of the partitions (L > 0) or the whole sequences (L = 0), per (value head, V slice)."""
    out = {}
    for n in seqlens:
        c = -(-n // 64)
        if L:
            full, rem = divmod(c, L)
            out[L] = out.get(L, 0) + full
            if rem:
                out[rem] = out.get(rem, 0) + 1
        else:
            out[c] = out.get(c, 0) + 1
    return list(out.items())


def _pass_row(items, sms):
    """The coefficients of (LAUNCH_US, CHUNK_US_IDLE, CHUNK_US_FULL, ITEM_US) in `cp_model._pass_us` for these items:
    ``launch + chunks (ci (1 - occ) + cf occ) + n o``, the chunks and the n items of the slot that finishes last in
    the model's list schedule at the shipped constants (`cp_model._launch_terms`): the row times the constants is
    the model's prediction."""
    from flashdelta import cp_model as cp

    occ, chunks, n = cp._launch_terms(items, sms, cp.CHUNK_US_IDLE, cp.CHUNK_US_FULL, cp.ITEM_US)
    return [1.0, chunks * (1 - occ), chunks * occ, n]


def _bwd_pass_row(items, sms):
    """The coefficients of (BWD_LAUNCH_US, BWD_CHUNK_US, BWD_ITEM_US) in `cp_model._bwd_pass_us` for these items:
    ``launch + chunks c + n o`` on the slot that finishes last in the model's schedule at the shipped constants."""
    from flashdelta import cp_model as cp

    _, chunks, n = cp._launch_terms(items, sms * cp.BWD_CTAS_PER_SM, cp.BWD_CHUNK_US, cp.BWD_CHUNK_US,
                                    cp.BWD_ITEM_US)
    return [1.0, chunks, n]


def _start_models(seqlens, HV, L, sms):
    """(exact, expected with the warm-up, whether auto runs it): the model's chunk_dstate pass over the L-chunk
    partitions that are not their sequence's first (`cp_model._start_us`)."""
    from flashdelta import cp_model as cp

    chunks = [-(-n // 64) for n in seqlens]
    cont = cp._first_parts(chunks, L)
    return (cp._start_us(cont, HV, sms), cp._start_us(cont, HV, sms, warmup=True),
            cp.warmup_pays_bwd(cont=cont, HV=HV, sms=sms))


def _lstsq(rows, ys):
    A = torch.tensor(rows, dtype=torch.float64)
    y = torch.tensor(ys, dtype=torch.float64)
    return torch.linalg.lstsq(A, y[:, None]).solution[:, 0].tolist()


def _with_env(name, value, fn):
    """`fn()` with the environment variable `name` set to `value` (read by the call, also while a graph captures it)."""
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        return fn()
    finally:
        if old is None:
            del os.environ[name]
        else:
            os.environ[name] = old


def _count_kernels(fn):
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type.name == "CUDA" and not e.name.startswith("Memcpy")]
    return len(names), names


def _builds(heads, backward):
    from flashdelta import cp
    from flashdelta.precompile import variants

    pairs = [tuple(map(int, hh.split("/"))) for hh in heads]
    out = {}
    todo = variants(pairs, beta_dtype=torch.float32, qk_l2norm=False, backward=backward, num_sms=132)
    for H, HV in pairs:
        todo += cp.builds(H, HV, 128, 128, torch.bfloat16, torch.float32, 128 ** -0.5, backward=backward)
    for label, b, a in todo:
        out.setdefault((b.__name__, a), (label, b, a))
    return list(out.values())


def precompile(heads, backward):
    import time

    for label, b, a in _builds(heads, backward):
        t0 = time.time()
        b(*a)
        print(f"{label}: {time.time() - t0:.1f} s", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", nargs="+", default=None)
    ap.add_argument("--seqlens", nargs="+", default=None)
    ap.add_argument("--L", nargs="+", type=int, default=None)
    ap.add_argument("--bwd", action="store_true", help="the backward rows (forward + backward with CP vs serial)")
    ap.add_argument("--precompile", action="store_true", help="compile this mode's builds (CPU machine) and exit")
    ap.add_argument("--budget-ms", type=float, default=60.0, help="timing budget per runner")
    args = ap.parse_args()
    args.heads = args.heads or (BWD_HEADS if args.bwd else HEADS)
    args.seqlens = args.seqlens or (BWD_SEQLENS if args.bwd else SEQLENS)
    args.L = args.L or (BWD_LS if args.bwd else LS)
    if args.precompile:
        return precompile(args.heads, args.bwd)
    if args.bwd:
        return bwd_main(args)

    from flashdelta import chunk_gated_delta_rule, cp, cp_model
    from flashdelta.kernels import fused_fwd, prepare, sm90

    dev = torch.device("cuda")
    sms = cp.num_sms(dev)
    stream = torch.cuda.Stream()
    flush = timing.L2Flush()
    pass_rows, pass_y, serial_scan, log_scan, summary_ratio, windows_us, table = [], [], [], [], [], [], []
    kernel_scan = []
    print(f"SMs {sms}; shipped constants: " + ", ".join(
        f"{n}={getattr(cp_model, n)}" for n in ("CHUNK_US_IDLE", "CHUNK_US_FULL", "ITEM_US", "LAUNCH_US",
                                                "SCAN_STEP_US", "SCAN_LEVEL_US", "SCAN_TFLOPS", "SUMMARY_CHUNK_FACTOR",
                                                "WARMUP_US",
                                                "WARMUP_FALLBACK", "WARMUP_CHUNKS")))
    for hh in args.heads:
        H, HV = map(int, hh.split("/"))
        counted = False
        for sl in args.seqlens:
            seqlens = shapes.parse_seqlens(sl)
            inp = providers.make_inputs(seqlens, H, HV, seed=0)
            q, k, v, g, beta, h0, cu = inp.q, inp.k, inp.v, inp.g, inp.beta, inp.h0, inp.cu
            T, N = q.shape[1], len(seqlens)
            g_cumsum, A = prepare.prepare_fwd(k, g, beta, cu)
            steps = {"serial_pass": lambda: fused_fwd.chunk_fwd(q, k, v, g_cumsum, beta, A, h0, cu, scale=inp.scale),
                     "api_off": lambda: chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, cu_seqlens=cu,
                                                               output_final_state=True, context_parallel=False),
                     "api_auto": lambda: chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, cu_seqlens=cu,
                                                                cu_seqlens_cpu=inp.cu_host, output_final_state=True)}
            plans, wins = {}, {}
            for L in args.L:
                if L >= -(-max(seqlens) // 64):
                    continue
                plan = plans[L] = cp.make_plan(cu, T, L)
                win = wins[L] = cp.windows(g_cumsum, k, beta, plan, cp.WARMUP_THRESHOLD)
                H0 = torch.randn(plan.P, HV, 128, 128, device=dev)
                M = torch.randn(plan.P, HV, 128, 128, device=dev) * 0.05
                E = torch.randn(plan.P, HV, 128, 128, device=dev)
                I0 = torch.where(win.fallback[:, :, None, None], torch.eye(128, device=dev), 0.0)
                zeros = v.new_zeros(1, T, HV, 128)
                steps[f"pass_L{L}"] = (lambda plan=plan, H0=H0: fused_fwd.chunk_fwd(
                    q, k, v, g_cumsum, beta, A, H0, plan.cu, scale=inp.scale))
                # the summary passes as CP launches them (final states only; the M pass without a v tensor)
                steps[f"pass_states_L{L}"] = (lambda plan=plan: fused_fwd.chunk_fwd(
                    q, k, v, g_cumsum, beta, A, None, plan.cu, scale=inp.scale, states_only=True))
                steps[f"pass_m_states_L{L}"] = (lambda plan=plan, H0=H0, zeros=zeros: fused_fwd.chunk_fwd(
                    q, k, zeros, g_cumsum, beta, A, H0, plan.cu, scale=inp.scale, zero_values=True,
                    states_only=True))
                steps[f"plan_kernel_L{L}"] = lambda L=L: cp.make_plan(cu, T, L, kset=sm90.KERNELS)
                steps[f"plan_torch_L{L}"] = lambda L=L: cp.make_plan(cu, T, L)
                steps[f"scan_serial_L{L}"] = lambda plan=plan, M=M, E=E: cp.scan_serial(M, E, plan, h0)
                steps[f"scan_kernel_L{L}"] = lambda plan=plan, M=M, E=E: cp.scan_states(M, E, plan, h0, "kernel")
                steps[f"scan_log_L{L}"] = lambda plan=plan, M=M, E=E: cp.scan_log(M, E, plan, h0)
                # the warm-up: its decision alone, and the M and E passes over the fallback heads and the windows
                steps[f"windows_L{L}"] = (lambda plan=plan: cp.windows(g_cumsum, k, beta, plan, cp.WARMUP_THRESHOLD,
                                                                      kset=sm90.KERNELS))
                steps[f"windows_torch_L{L}"] = (lambda plan=plan: cp.windows(g_cumsum, k, beta, plan,
                                                                            cp.WARMUP_THRESHOLD))
                steps[f"pass_e_warm_L{L}"] = (lambda plan=plan, win=win: fused_fwd.chunk_fwd(
                    q, k, v, g_cumsum, beta, A, None, plan.cu, scale=inp.scale, chunk_skip=win.skip_e,
                    states_only=True))
                steps[f"pass_m_warm_L{L}"] = (lambda plan=plan, win=win, I0=I0, zeros=zeros: fused_fwd.chunk_fwd(
                    q, k, zeros, g_cumsum, beta, A, I0, plan.cu, scale=inp.scale, chunk_skip=win.skip_m,
                    zero_values=True, states_only=True))
                steps[f"api_L{L}"] = (lambda L=L: chunk_gated_delta_rule(
                    q, k, v, g, beta, initial_state=h0, cu_seqlens=cu, output_final_state=True, context_parallel=L))
                steps[f"api_exact_L{L}"] = (lambda L=L: _with_env(cp.ENV_WARMUP, "off", lambda: chunk_gated_delta_rule(
                    q, k, v, g, beta, initial_state=h0, cu_seqlens=cu, output_final_state=True, context_parallel=L)))
            runners = {}
            for name, fn in steps.items():
                try:
                    runners[name] = timing.make_runner(fn, stream=stream, allow_eager=False)
                except Exception as exc:  # noqa: BLE001 - report and go on with the other steps
                    print(f"  {hh} {sl} {name}: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
            ms = {n: t.ms for n, t in timing.time_runners(runners, stream=stream, budget_ms=args.budget_ms,
                                                          flush=flush).items()}
            us = {n: 1e3 * x for n, x in ms.items()}
            # fit data
            pass_rows.append(_pass_row([(c, n * HV * 2) for c, n in _items(seqlens, 0)], sms))
            pass_y.append(us["serial_pass"])
            for L, plan in plans.items():
                if f"pass_L{L}" in us:
                    pass_rows.append(_pass_row([(c, n * HV * 2) for c, n in _items(seqlens, L)], sms))
                    pass_y.append(us[f"pass_L{L}"])
                    if f"pass_states_L{L}" in us:       # the states-only pass over the same CTAs (E from zero)
                        summary_ratio.append(us[f"pass_states_L{L}"] / us[f"pass_L{L}"])
                if f"scan_serial_L{L}" in us:
                    serial_scan.append((plan.J, us[f"scan_serial_L{L}"]))
                if f"scan_kernel_L{L}" in us:
                    kernel_scan.append((plan.J, cp_model._kernel_step_us(N, HV, 128) / cp_model.SCAN_KERNEL_STEP_US,
                                        us[f"scan_kernel_L{L}"]))
                if f"scan_log_L{L}" in us:
                    levels = math.ceil(math.log2(plan.J)) if plan.J > 1 else 0
                    log_scan.append((levels, levels * 2.0 * plan.P * HV * 128 * 256, us[f"scan_log_L{L}"]))
                if f"windows_L{L}" in us:
                    windows_us.append(us[f"windows_L{L}"])
                p = cp.predict(T=T, N=N, HV=HV, K=128, V=128, L=L, sms=sms, lengths=list(seqlens), warmup=True)
                win = wins[L]
                fb = win.fallback.float().mean().item()
                print(f"  L{L}: full pass {us.get(f'pass_L{L}', float('nan')):.1f} us, states-only E "
                      f"{us.get(f'pass_states_L{L}', float('nan')):.1f}, "
                      f"M {us.get(f'pass_m_states_L{L}', float('nan')):.1f}; "
                      f"plan kernel {us.get(f'plan_kernel_L{L}', float('nan')):.1f} torch "
                      f"{us.get(f'plan_torch_L{L}', float('nan')):.1f}")
                print(f"  L{L}: windows kernel {us.get(f'windows_L{L}', float('nan')):.1f} us, torch "
                      f"{us.get(f'windows_torch_L{L}', float('nan')):.1f} (model {p['warmup_us']:.1f}), "
                      f"fallback share {fb:.2f} (model {cp_model.WARMUP_FALLBACK}), mean window "
                      f"{win.n(L)[~win.fallback & (win.n(L) > 0)].float().mean().item():.2f} chunks (model "
                      f"{cp_model.WARMUP_CHUNKS}); E pass {us.get(f'pass_e_warm_L{L}', float('nan')):.1f} (model "
                      f"{p['e']:.1f}), M pass {us.get(f'pass_m_warm_L{L}', float('nan')):.1f} (model {p['m']:.1f}); "
                      f"API exact {us.get(f'api_exact_L{L}', float('nan')):.1f} warm-up "
                      f"{us.get(f'api_L{L}', float('nan')):.1f} (model {p['cp_worst']:.1f} / {p['cp']:.1f})")
            api = {L: us[f"api_L{L}"] for L in plans if f"api_L{L}" in us}
            best_L = min(api, key=api.get) if api else 0
            best = min([us["api_off"]] + list(api.values()))
            chosen = cp.choose(T=T, N=N, HV=HV, K=128, V=128, sms=sms, lengths=list(seqlens))
            table.append(dict(heads=hh, seqlens=sl, T=T, N=N, HV=HV, lengths=list(seqlens), off=us["api_off"],
                              auto=us["api_auto"], api=api, best=best,
                              best_L=best_L if api and api[best_L] < us["api_off"] else 0, chosen=chosen))
            print(f"{hh:>6} {sl:>10}  off {us['api_off']:8.1f} us  auto(L={chosen}) {us['api_auto']:8.1f}  "
                  + "  ".join(f"L{L} {t:8.1f}" for L, t in api.items())
                  + f"  | serial pass {us['serial_pass']:.1f}, "
                  + ", ".join(f"pass_L{L} {us.get(f'pass_L{L}', float('nan')):.1f} scan {us.get(f'scan_serial_L{L}', float('nan')):.1f}"
                              f"/{us.get(f'scan_log_L{L}', float('nan')):.1f}" for L in plans), flush=True)
            if not counted and plans:
                L = max(plans, key=lambda L: -abs(L - 64))
                n, names = _count_kernels(lambda: chunk_gated_delta_rule(
                    q, k, v, g, beta, initial_state=h0, cu_seqlens=cu, output_final_state=True, context_parallel=L))
                n0, _ = _count_kernels(lambda: chunk_gated_delta_rule(
                    q, k, v, g, beta, initial_state=h0, cu_seqlens=cu, output_final_state=True,
                    context_parallel=False))
                print(f"  kernels per forward at {hh} {sl}: serial {n0}, CP L={L} (J={plans[L].J}) {n}")
                counted = True
            del inp, runners
            torch.cuda.empty_cache()

    # ---- fits
    fit = {}
    if len(pass_rows) >= 4:
        launch, ci, cf, o = _lstsq(pass_rows, pass_y)
        fit.update(LAUNCH_US=launch, CHUNK_US_IDLE=ci, CHUNK_US_FULL=cf, ITEM_US=o)
    if len(serial_scan) >= 2:
        a, step = _lstsq([[1.0, j] for j, _ in serial_scan], [t for _, t in serial_scan])
        fit.update(SCAN_STEP_US=step, scan_serial_fixed_us=a)
    if len(kernel_scan) >= 2:     # SCAN_KERNEL_US + (J - 1) x tile factor x SCAN_KERNEL_STEP_US
        a, step = _lstsq([[1.0, (j - 1) * f] for j, f, _ in kernel_scan], [t for *_, t in kernel_scan])
        fit.update(SCAN_KERNEL_US=a, SCAN_KERNEL_STEP_US=step)
    if len(log_scan) >= 3:
        a, level, per_flop = _lstsq([[1.0, lv, fl] for lv, fl, _ in log_scan], [t for *_, t in log_scan])
        fit.update(SCAN_LEVEL_US=level, SCAN_TFLOPS=(1e-6 / per_flop if per_flop > 0 else float("inf")),
                   scan_log_fixed_us=a)
    if summary_ratio:
        fit.update(SUMMARY_CHUNK_FACTOR=sum(summary_ratio) / len(summary_ratio))
    if windows_us:
        fit.update(WARMUP_US=sum(windows_us) / len(windows_us))
    print("\nfitted constants (paste into src/flashdelta/cp_model.py):")
    for n, x in fit.items():
        print(f"  {n} = {x:.4g}")

    # ---- chosen vs best, with the shipped and the fitted constants
    _chosen_vs_best(cp_model, fit, table, "api",
                    lambda r: cp.choose(T=r["T"], N=r["N"], HV=r["HV"], K=128, V=128, sms=sms, lengths=r["lengths"]))


def _chosen_vs_best(cp, fit, table, times: str, pick, off_over_auto: bool = False) -> None:
    """The chosen-vs-best table: per row the time with CP off, the best over the measured L (``r[times]``: L -> us),
    the L the shipped constants chose, the L `pick(r)` chooses with the fitted constants (set on `cp`, the cost model
    module `flashdelta.cp_model`, for the table, then restored) and its time over the best."""
    shipped = {n: getattr(cp, n) for n in fit if hasattr(cp, n)}
    for n in shipped:
        setattr(cp, n, fit[n])
    extra = f" {'off/auto':>8}" if off_over_auto else ""
    print(f"\n{'heads':>6} {'seqlens':>10} {'off us':>9} {'best us':>9} {'best L':>6} {'ship L':>6} {'fit L':>6} "
          f"{'auto us':>9} {'fit/best':>8}" + extra)
    worst = 1.0
    try:
        for r in table:
            fit_L = pick(r)
            t_fit = r[times].get(fit_L, r["off"]) if fit_L else r["off"]
            worst = max(worst, t_fit / r["best"])
            extra = f" {r['off'] / r['auto']:8.3f}" if off_over_auto else ""
            print(f"{r['heads']:>6} {r['seqlens']:>10} {r['off']:9.1f} {r['best']:9.1f} {r['best_L']:>6} "
                  f"{r['chosen']:>6} {fit_L:>6} {r['auto']:9.1f} {t_fit / r['best']:8.3f}" + extra)
        print(f"worst chosen/best with the fitted constants: {worst:.3f}")
    finally:
        for n, x in shipped.items():
            setattr(cp, n, x)


def bwd_main(args):
    from flashdelta import autograd as fda
    from flashdelta import chunk_gated_delta_rule, cp, cp_model
    from flashdelta.kernels import chunk_bwd as kbwd
    from flashdelta.kernels import chunk_dstate, fused_fwd, prepare, sm90

    dev = torch.device("cuda")
    sms = cp.num_sms(dev)
    stream = torch.cuda.Stream()
    flush = timing.L2Flush()
    bwd_rows, bwd_y, states_model, states_y, dstate_y, dstate_bwd, table = [], [], [], [], [], [], []
    save_model, save_y = [], []      # the saving forward's extra time over the forward pass model
    grad_windows_us = []
    print(f"SMs {sms}; shipped constants: " + ", ".join(
        f"{n}={getattr(cp_model, n)}" for n in ("BWD_CHUNK_US", "BWD_ITEM_US", "BWD_LAUNCH_US", "RECOMPUTE_FACTOR",
                                                "SAVE_STATES_FACTOR",
                                                "START_GRAD_FACTOR", "BWD_FIXED_US", "SCAN_STEP_US",
                                                "WARMUP_BWD_US", "WARMUP_FALLBACK", "WARMUP_CHUNKS")))
    for hh in args.heads:
        H, HV = map(int, hh.split("/"))
        for sl in args.seqlens:
            seqlens = shapes.parse_seqlens(sl)
            inp = providers.make_inputs(seqlens, H, HV, seed=0, requires_grad=True)
            leaves = inp.leaves()
            q, k, v, g, beta, h0 = (x.detach() for x in leaves)
            cu, do, dht, scale = inp.cu, inp.do, inp.dht, inp.scale
            T, N = q.shape[1], len(seqlens)
            kw = dict(T=T, N=N, HV=HV, K=128, V=128, sms=sms, lengths=list(seqlens))
            Lf = cp.choose(**kw)
            # the unsplit forward saves the backward's partition starts (a split backward) or, by default, every
            # chunk state (a serial one), as `cp.auto_lengths` decides
            kwb = dict(kw, starts_saved=Lf == 0, states_saved=Lf == 0 and cp_model.save_states_enabled())
            g_cumsum, A = prepare.prepare_fwd(k, g, beta, cu)
            h_serial = fused_fwd.state_recompute(k, v, g_cumsum, beta, A, h0, cu)

            def fb(code):
                o, ht = fda.forward(*leaves, cu, scale, False, False, True, code)
                return torch.autograd.grad((o, ht), leaves, (do, dht))

            def fb_api(**kw_api):
                ql, kl, vl, gl, bl, hl = leaves
                o, ht = chunk_gated_delta_rule(ql, kl, vl, gl, bl, initial_state=hl, cu_seqlens=cu,
                                               output_final_state=True, **kw_api)
                return torch.autograd.grad((o, ht), leaves, (do, dht))

            steps = {"fb_off": lambda: fb_api(context_parallel=False),
                     "fb_auto": lambda: fb_api(cu_seqlens_cpu=inp.cu_host),
                     "states_serial": lambda: fused_fwd.state_recompute(k, v, g_cumsum, beta, A, h0, cu),
                     "fwd_serial": lambda: fused_fwd.chunk_fwd(q, k, v, g_cumsum, beta, A, h0, cu, scale=scale),
                     "fwd_save_serial": lambda: fused_fwd.chunk_fwd(q, k, v, g_cumsum, beta, A, h0, cu, scale=scale,
                                                                    save_states=True),
                     "bwd_pass_serial": lambda: kbwd.chunk_bwd(q, k, v, g_cumsum, beta, A, h_serial, do, dht, cu,
                                                               scale=scale)}
            plans, gwins = {}, {}
            for L in sorted(set(args.L) | {cp.choose_bwd(**kwb)} - {0}):
                if L >= -(-max(seqlens) // 64):
                    continue
                plan = plans[L] = cp.make_plan(cu, T, L)
                gwin = gwins[L] = cp.grad_windows(g_cumsum, k, beta, plan, cp.WARMUP_THRESHOLD)
                H0 = torch.randn(plan.P, HV, 128, 128, device=dev)
                dS = torch.randn(plan.P, HV, 128, 128, device=dev) / 8
                hp = fused_fwd.state_recompute(k, v, g_cumsum, beta, A, H0, plan.cu)
                steps[f"states_L{L}"] = (lambda plan=plan, H0=H0: fused_fwd.state_recompute(
                    k, v, g_cumsum, beta, A, H0, plan.cu))
                steps[f"bwd_pass_L{L}"] = (lambda plan=plan, hp=hp, dS=dS: kbwd.chunk_bwd(
                    q, k, v, g_cumsum, beta, A, hp, do, dS, plan.cu, scale=scale))
                steps[f"dstate_L{L}"] = (lambda plan=plan: chunk_dstate.chunk_dstate(
                    q, k, g_cumsum, beta, A, do, plan.cu, scale=scale))
                every = cp.grad_windows(g_cumsum, k, beta, plan, None).take      # the exact path's F pass
                steps[f"dstate_cont_L{L}"] = (lambda plan=plan, every=every: chunk_dstate.chunk_dstate(
                    q, k, g_cumsum, beta, A, do, plan.cu, scale=scale, chunk_take=every))
                steps[f"grad_windows_L{L}"] = (lambda plan=plan: cp.grad_windows(
                    g_cumsum, k, beta, plan, cp.WARMUP_THRESHOLD, kset=sm90.KERNELS))
                steps[f"grad_windows_torch_L{L}"] = (lambda plan=plan: cp.grad_windows(
                    g_cumsum, k, beta, plan, cp.WARMUP_THRESHOLD))
                steps[f"dstate_warm_L{L}"] = (lambda plan=plan, gwin=gwin: chunk_dstate.chunk_dstate(
                    q, k, g_cumsum, beta, A, do, plan.cu, scale=scale, chunk_take=gwin.take))
                steps[f"fb_L{L}"] = lambda L=L: fb(cp.encode(Lf, L))
                steps[f"fb_exact_L{L}"] = lambda L=L: _with_env(cp.ENV_WARMUP, "0", lambda: fb(cp.encode(Lf, L)))
                steps[f"fb_warm_L{L}"] = lambda L=L: _with_env(cp.ENV_WARMUP, "1", lambda: fb(cp.encode(Lf, L)))
            runners = {}
            for name, fn in steps.items():
                try:
                    runners[name] = timing.make_runner(fn, stream=stream, allow_eager=False)
                except Exception as exc:  # noqa: BLE001 - report and go on with the other steps
                    print(f"  {hh} {sl} {name}: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
            us = {n: 1e3 * t.ms for n, t in timing.time_runners(runners, stream=stream, budget_ms=args.budget_ms,
                                                                flush=flush).items()}
            whole = [(c, n) for c, n in _items(seqlens, 0)]
            bwd_rows.append(_bwd_pass_row([(c, n * HV) for c, n in whole], sms))
            bwd_y.append(us["bwd_pass_serial"])
            states_model.append(cp_model._pass_us([(c, n * HV * 2) for c, n in whole], sms))
            states_y.append(us["states_serial"])
            if "fwd_serial" in us and "fwd_save_serial" in us:
                save_model.append(states_model[-1])
                save_y.append(us["fwd_save_serial"] - us["fwd_serial"])
            for L in plans:
                items = _items(seqlens, L)
                if f"bwd_pass_L{L}" in us:
                    bwd_rows.append(_bwd_pass_row([(c, n * HV) for c, n in items], sms))
                    bwd_y.append(us[f"bwd_pass_L{L}"])
                if f"dstate_L{L}" in us and f"bwd_pass_L{L}" in us:
                    dstate_y.append(us[f"dstate_L{L}"])
                    dstate_bwd.append(us[f"bwd_pass_L{L}"])
                if f"states_L{L}" in us:
                    states_model.append(cp_model._pass_us([(c, n * HV * 2) for c, n in items], sms))
                    states_y.append(us[f"states_L{L}"])
                if f"grad_windows_L{L}" in us:
                    grad_windows_us.append(us[f"grad_windows_L{L}"])
                gwin, plan = gwins[L], plans[L]
                cont = ~plan.first
                n = gwin.n(plan)
                share = gwin.fallback[cont].float().mean().item()
                window = n[cont[:, None] & ~gwin.fallback].float().mean().item()
                m_exact, m_warm, runs = _start_models(seqlens, HV, L, sms)
                print(f"  L{L}: grad windows kernel {us.get(f'grad_windows_L{L}', float('nan')):.1f} us, torch "
                      f"{us.get(f'grad_windows_torch_L{L}', float('nan')):.1f} (model "
                      f"{cp_model.WARMUP_BWD_US}), fallback share {share:.2f} (model {cp_model.WARMUP_FALLBACK}), "
                      f"mean window {window:.2f} chunks (model {cp_model.WARMUP_CHUNKS}); F pass all partitions "
                      f"{us.get(f'dstate_L{L}', float('nan')):.1f}, exact "
                      f"{us.get(f'dstate_cont_L{L}', float('nan')):.1f} "
                      f"(model {m_exact:.1f}) warm-up "
                      f"{us.get(f'dstate_warm_L{L}', float('nan')):.1f} (model {m_warm:.1f}, "
                      f"{'runs' if runs else 'not run'} under auto); fwd+bwd exact "
                      f"{us.get(f'fb_exact_L{L}', float('nan')):.1f} warm-up "
                      f"{us.get(f'fb_warm_L{L}', float('nan')):.1f}")
            fbt = {L: us[f"fb_L{L}"] for L in plans if f"fb_L{L}" in us}
            best = min([us["fb_off"]] + list(fbt.values()))
            best_L = min(fbt, key=fbt.get) if fbt and min(fbt.values()) < us["fb_off"] else 0
            pred = {L: cp.predict_bwd(L=L, **kwb) for L in plans}
            table.append(dict(heads=hh, seqlens=sl, kw=kw, off=us["fb_off"], auto=us["fb_auto"], fb=fbt, best=best,
                              best_L=best_L, chosen=cp.choose_bwd(**kwb), Lf=Lf, kwb=kwb))
            print(f"{hh:>6} {sl:>10}  fwd+bwd off {us['fb_off']:9.1f} us  auto(fwd L={Lf}, bwd L="
                  f"{cp.choose_bwd(**kwb)}) {us['fb_auto']:9.1f}  "
                  + "  ".join(f"L{L} {t:9.1f}" for L, t in fbt.items()), flush=True)
            ser = cp.predict_bwd(L=1, **kwb)

            def recompute_model(L):       # state_recompute as the model prices it (`predict_bwd` without saved states)
                return cp_model.RECOMPUTE_FACTOR * cp_model._pass_us([(c, n * HV * 2) for c, n in _items(seqlens, L)],
                                                                    sms)
            # the model's `states` is the saving forward's extra time where the states are saved (the default), and
            # its `start` the F pass under the warm-up where that runs: each printed beside what it models
            print(f"{'':>17}  chunk_bwd serial {us['bwd_pass_serial']:.1f} (model {ser['serial_bwd']:.1f}), "
                  f"recompute serial {us['states_serial']:.1f} (model {recompute_model(0):.1f}; states saved: "
                  f"{ser['states_saved']}, saving {ser['serial_states']:.1f}); "
                  + ", ".join(f"L{L}: pass {us.get(f'bwd_pass_L{L}', float('nan')):.1f} (model {pred[L]['bwd']:.1f}) "
                              f"recompute {us.get(f'states_L{L}', float('nan')):.1f} (model {recompute_model(L):.1f}) "
                              f"start {pred[L]['start']:.1f} "
                              f"bwd model {pred[L]['cp']:.1f} vs serial {pred[L]['serial']:.1f}" for L in plans),
                  flush=True)
            del inp, runners, steps, h_serial, plans, gwins
            torch.cuda.empty_cache()

    fit = {}
    if len(bwd_rows) >= 3:
        launch, c, o = _lstsq(bwd_rows, bwd_y)
        fit.update(BWD_LAUNCH_US=launch, BWD_CHUNK_US=c, BWD_ITEM_US=o)
    if states_y:
        fit.update(RECOMPUTE_FACTOR=sum(states_y) / sum(states_model))
    if save_y:
        fit.update(SAVE_STATES_FACTOR=sum(save_y) / sum(save_model))
    if dstate_y:
        fit.update(START_GRAD_FACTOR=sum(dstate_y) / sum(dstate_bwd))
    if grad_windows_us:
        fit.update(WARMUP_BWD_US=sum(grad_windows_us) / len(grad_windows_us))
    print("\nfitted constants (paste into src/flashdelta/cp_model.py):")
    for n, x in fit.items():
        print(f"  {n} = {x:.4g}")
    _chosen_vs_best(cp_model, fit, table, "fb", lambda r: cp.choose_bwd(**r["kwb"]), off_over_auto=True)


if __name__ == "__main__":
    main()
