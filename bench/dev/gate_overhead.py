"""What the in-kernel gate and beta sigmoid cost the forward (issue target: at most 3% on the forward grid's TP1 row,
16/64 and one sequence of 32k tokens; docs/dev/prepare.md).

Every variant computes the same operator from the same raw inputs (a model-like raw gate ``a``, A_log and dt_bias
per value head, beta's logits), through the public ``chunk_gated_delta_rule`` on ``FLASHDELTA_BACKEND=sm90``, bf16
q/k/v, fp32 h0, ``output_final_state=True``, varlen with ``cu_seqlens_cpu`` (the benchmark's call, bench/README.md):

- ``off``: the log decay ``g = -exp(A_log) softplus(a + dt_bias)`` and ``beta = sigmoid(logits)`` given in fp32
  (computed once, outside the timed region): the forward grid's inputs;
- ``torch``: the same two activations computed in PyTorch inside the timed region, then the ``off`` call (a separate
  gate computation, as a caller without the in-kernel options runs it);
- ``kernel-<dtype>``: ``use_gate_in_kernel`` and ``use_beta_sigmoid_in_kernel`` with the raw gate in that dtype and
  fp32 logits: the prepare kernel activates both as it loads them;
- ``kernel-gate-only``: ``use_gate_in_kernel`` with the fp32 raw gate, beta given in fp32.

With ``--stages`` the prepare stage alone is timed too (its launcher, with and without the options). Timing is
bench/timing.py's: each variant captured in a CUDA graph, L2 flushed before each replay, variants interleaved over
rounds, medians with p20/p80. Before timing, every variant's o and final state are compared with ``off``'s (relative
L2; the activations differ only by fp32 rounding). The overhead is ``ms / ms(off) - 1``.

    source .device/bootstrap.sh; python3 -u bench/dev/gate_overhead.py [--heads 16/64] [--seqlens 32768]
        [--g-dtypes fp32,bf16] [--stages] [--out $OUT/gate_overhead.csv]
    TILELANG_CACHE_DIR=.cache/tl-ship python3 bench/dev/gate_overhead.py --precompile [--heads ...]   # CPU machine

--precompile compiles (no GPU) every SM90 build the timed calls launch, for a GPU of 132 SMs.
"""
from __future__ import annotations

import argparse
import csv
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))               # bench/ (timing)

import torch  # noqa: E402

import timing  # noqa: E402

K = V = 128
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TARGET = 0.03


def parse_heads(s: str) -> tuple:
    h, hv = s.split("/")
    return int(h), int(hv)


def parse_seqlens(s: str) -> tuple:
    """``32768`` or ``8192x4`` or ``28672+4096``."""
    out = []
    for part in s.split("+"):
        n, _, count = part.partition("x")
        out += [int(n)] * (int(count) if count else 1)
    return tuple(out)


def make_inputs(H: int, HV: int, seqlens: tuple, seed: int = 0) -> dict:
    """q, k (l2-normalised), v bf16, h0 fp32, cu_seqlens (device and host), and the gate's raw parts in fp32: ``a``
    ~ N(0, 0.5) (bf16 values, so every raw-gate dtype holds the same gate), exp(A_log) spread over [0.05, 16] across
    the heads, dt_bias ~ N(-1, 0.5), logits ~ N(0, 2)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    T, N = sum(seqlens), len(seqlens)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device="cuda")

    cu = [0]
    for n in seqlens:
        cu.append(cu[-1] + n)
    return dict(
        q=torch.nn.functional.normalize(randn(1, T, H, K), dim=-1).bfloat16(),
        k=torch.nn.functional.normalize(randn(1, T, H, K), dim=-1).bfloat16(),
        v=randn(1, T, HV, V).bfloat16(), h0=randn(N, HV, K, V),
        a=(randn(1, T, HV) * 0.5).bfloat16().float(), logits=randn(1, T, HV) * 2.0,
        A_log=torch.linspace(0.05, 16.0, HV, device="cuda").log(), dt_bias=randn(HV) * 0.5 - 1.0,
        cu=torch.tensor(cu, dtype=torch.int32, device="cuda"), cu_host=torch.tensor(cu, dtype=torch.int64))


def variants(x: dict, g_dtypes: list) -> dict:
    """name -> a no-argument forward call (`make_inputs`' tensors, captured in the closures)."""
    from flashdelta import chunk_gated_delta_rule
    from flashdelta.gates import beta_sigmoid, gdn_gate

    g_off = gdn_gate(x["a"], x["A_log"], x["dt_bias"])
    beta_off = beta_sigmoid(x["logits"])
    common = dict(scale=K ** -0.5, initial_state=x["h0"], output_final_state=True, cu_seqlens=x["cu"],
                  cu_seqlens_cpu=x["cu_host"])

    def call(g, beta, **kw):
        return lambda: chunk_gated_delta_rule(x["q"], x["k"], x["v"], g, beta, **common, **kw)

    out = {"off": call(g_off, beta_off)}
    out["torch"] = lambda: chunk_gated_delta_rule(x["q"], x["k"], x["v"], gdn_gate(x["a"], x["A_log"], x["dt_bias"]),
                                                  beta_sigmoid(x["logits"]), **common)
    gate = dict(use_gate_in_kernel=True, A_log=x["A_log"], dt_bias=x["dt_bias"])
    for name in g_dtypes:
        out[f"kernel-{name}"] = call(x["a"].to(DTYPES[name]), x["logits"], use_beta_sigmoid_in_kernel=True, **gate)
    out["kernel-gate-only"] = call(x["a"], beta_off, **gate)
    return out


def stage_variants(x: dict, g_dtypes: list) -> dict:
    """name -> a no-argument call of the prepare stage alone (its launcher), without and with the options."""
    from flashdelta.gates import beta_sigmoid, gdn_gate
    from flashdelta.kernels import prepare

    g_off, beta_off = gdn_gate(x["a"], x["A_log"], x["dt_bias"]), beta_sigmoid(x["logits"])
    out = {"prepare-off": lambda: prepare.prepare_fwd(x["k"], g_off, beta_off, x["cu"])}
    for name in g_dtypes:
        a = x["a"].to(DTYPES[name])
        out[f"prepare-kernel-{name}"] = lambda a=a: prepare.prepare_fwd(
            x["k"], a, x["logits"], x["cu"], A_log=x["A_log"], dt_bias=x["dt_bias"], beta_act=1)
    return out


def check(calls: dict) -> dict:
    """Every variant's (o, final state) against ``off``'s: name -> (rel L2 of o, of the final state)."""
    from flashdelta.numerics import rel_l2

    with torch.no_grad():
        o_ref, ht_ref = calls["off"]()
        errs = {}
        for name, fn in calls.items():
            o, ht = fn()
            errs[name] = (rel_l2(o, o_ref), rel_l2(ht, ht_ref))
    return errs


def precompile(heads: list, g_dtypes: list) -> None:
    """Every SM90 build the timed calls launch (132 SMs), into TileLang's cache."""
    from flashdelta.kernels import _tl, prepare
    from flashdelta.precompile import variants as fwd_variants

    todo = {}
    for H, HV in heads:
        builds = fwd_variants([(H, HV)], beta_dtype=torch.float32, initial_state=(True,), qk_l2norm=False,
                              num_sms=_tl.DEFAULT_NUM_SMS)
        for name in g_dtypes + ["fp32"]:
            builds += prepare.launcher_builds(H, HV, K, torch.bfloat16, torch.float32, num_sms=_tl.DEFAULT_NUM_SMS,
                                              g_dtype=DTYPES[name], a_log_dtype=torch.float32,
                                              dt_bias_dtype=torch.float32, beta_act=1)
        builds += prepare.launcher_builds(H, HV, K, torch.bfloat16, torch.float32, num_sms=_tl.DEFAULT_NUM_SMS,
                                          g_dtype=torch.float32, a_log_dtype=torch.float32,
                                          dt_bias_dtype=torch.float32)
        for label, b, a in builds:
            todo.setdefault((b.__name__, a), (label, b, a))
    for label, b, a in todo.values():
        b(*a)
        print(f"compiled {label}", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--heads", nargs="+", default=["16/64"], help="H/HV pairs (default: the TP1 row, 16/64)")
    ap.add_argument("--seqlens", default="32768", help="the row's sequences: 32768, 8192x4, 28672+4096")
    ap.add_argument("--g-dtypes", default="fp32,bf16", help="raw gate dtypes of the in-kernel variants")
    ap.add_argument("--stages", action="store_true", help="also time the prepare stage alone")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--budget-ms", type=float, default=400.0)
    ap.add_argument("--flush-mb", type=int, default=256)
    ap.add_argument("--out", help="CSV of every variant's median, p20, p80 and overhead")
    ap.add_argument("--precompile", action="store_true", help="compile the builds (no GPU) and exit")
    a = ap.parse_args(argv)
    heads = [parse_heads(h) for h in a.heads]
    g_dtypes = [d for d in a.g_dtypes.split(",") if d]
    if any(d not in DTYPES for d in g_dtypes):
        ap.error(f"--g-dtypes: each of {sorted(DTYPES)}, got {a.g_dtypes!r}")
    if a.precompile:
        precompile(heads, g_dtypes)
        return 0
    os.environ["FLASHDELTA_BACKEND"] = "sm90"
    seqlens = parse_seqlens(a.seqlens)
    stream = torch.cuda.Stream()
    flush = timing.L2Flush(a.flush_mb)
    rows, worst = [], 0.0
    for H, HV in heads:
        x = make_inputs(H, HV, seqlens)
        calls = variants(x, g_dtypes)
        errs = check(calls)
        for name, (eo, eh) in errs.items():
            print(f"{H}/{HV} {name}: o rel L2 {eo:.2e}, final state {eh:.2e} vs off", flush=True)
            if not (eo <= 1e-3 and eh <= 1e-3):
                print(f"FAIL: {name} differs from off", flush=True)
                return 1
        timed_calls = dict(calls, **(stage_variants(x, g_dtypes) if a.stages else {}))
        with torch.no_grad():
            runners = {n: timing.make_runner(fn, stream=stream, warmup=3) for n, fn in timed_calls.items()}
            res = timing.time_runners(runners, stream=stream, budget_ms=a.budget_ms, rounds=a.rounds, flush=flush)
        for name, t in res.items():
            base = res["prepare-off" if name.startswith("prepare-") else "off"].ms
            over = t.ms / base - 1.0
            if name.startswith("kernel-"):
                worst = max(worst, over)
            rows.append(dict(heads=f"{H}/{HV}", seqlens=a.seqlens, variant=name, timing=t.method, ms=t.ms,
                             p20=t.p20, p80=t.p80, overhead_pct=100 * over))
            print(f"{H}/{HV} {a.seqlens} {name:>22}: {t.ms:.4f} ms (p20 {t.p20:.4f}, p80 {t.p80:.4f}) "
                  f"{100 * over:+.2f}%{'' if t.method == 'cudagraph' else ' [' + t.method + ']'}", flush=True)
    print(f"in-kernel gate overhead (worst kernel-* variant): {100 * worst:+.2f}% (target <= {100 * TARGET:.0f}%): "
          f"{'met' if worst <= TARGET else 'MISSED'}", flush=True)
    if a.out:
        with open(a.out, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
