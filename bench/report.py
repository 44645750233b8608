"""Long-format CSV (environment header as ``#`` lines), the summary table and the speedup chart.

Also a small CLI to re-render a saved CSV without a GPU::

    python bench/report.py bench/results/h200/2026-11-29_abc1234.csv [--subject flashdelta] [--png out.png]
"""
from __future__ import annotations

import argparse
import csv
import io
import math
import os
import sys
from collections import OrderedDict

COLUMNS = (
    "suite", "case", "model", "h", "hv", "k", "v", "seqlens", "n_seqs", "tokens", "split_seed",
    "provider", "status", "ms", "p20", "p80", "reps", "cp", "peak_mb", "tflops", "tbps", "floor_ms", "floor_frac",
    "timing", "gate_err", "gate_detail", "gate_seqlens", "full_err", "full_ref", "seed", "note",
)
# speedup targets drawn on the chart (the project's goals; docs/performance.md)
TARGETS = {"flashqla": 1.2, "fla": 2.0}
COLORS = {"fla": "#1f77b4", "flashqla": "#d62728", "flashdelta": "#2ca02c"}


class CsvWriter:
    """Writes the header once, then one row at a time (flushed, so a killed run keeps what it measured)."""

    def __init__(self, path: str, env: dict):
        self.path = path
        d = os.path.dirname(path)
        if d:
            os.makedirs(d, exist_ok=True)
        self.f = open(path, "w", newline="")
        for key, val in env.items():
            self.f.write(f"# {key}: {val}\n")
        self.w = csv.DictWriter(self.f, fieldnames=COLUMNS, extrasaction="ignore")
        self.w.writeheader()
        self.f.flush()

    def row(self, row: dict) -> None:
        self.w.writerow({k: fmt(row.get(k)) for k in COLUMNS})
        self.f.flush()

    def close(self) -> None:
        self.f.close()


def fmt(x) -> str:
    if x is None:
        return ""
    if isinstance(x, float):
        if math.isnan(x):
            return ""
        if math.isinf(x):
            return "inf"
        return f"{x:.6g}"
    return str(x)


def read_csv(path: str) -> tuple[dict, list]:
    """(environment header dict, rows as dicts of strings)."""
    env, lines = OrderedDict(), []
    with open(path) as f:
        for line in f:
            if line.startswith("#"):
                key, _, val = line[1:].strip().partition(":")
                env[key.strip()] = val.strip()
            else:
                lines.append(line)
    return env, list(csv.DictReader(io.StringIO("".join(lines))))


def _ms(row) -> float | None:
    try:
        v = float(row.get("ms") or "nan")
    except ValueError:
        return None
    return None if math.isnan(v) else v


def speedup_table(rows: list, subject: str) -> tuple[list, list, list]:
    """Pivot the long rows: (providers, peers, [(suite, case, {provider: row}, {peer: speedup})]).

    Speedup vs a peer = peer ms / subject ms (> 1: the subject is faster). Only timed rows count.
    """
    cases = OrderedDict()
    providers = []
    for r in rows:
        key = (r["suite"], r["case"])
        cases.setdefault(key, OrderedDict())[r["provider"]] = r
        if r["provider"] not in providers:
            providers.append(r["provider"])
    peers = [p for p in providers if p != subject]
    out = []
    for (suite, case), by in cases.items():
        sp = {}
        s_ms = _ms(by[subject]) if subject in by else None
        for p in peers:
            p_ms = _ms(by[p]) if p in by else None
            sp[p] = (p_ms / s_ms) if (s_ms and p_ms) else None
        out.append((suite, case, by, sp))
    return providers, peers, out


def format_table(rows: list, subject: str = "flashdelta") -> str:
    providers, peers, table = speedup_table(rows, subject)
    have_subject = subject in providers
    head = ["case"] + [f"{p} ms" for p in providers]
    if have_subject:
        head += [f"{subject}/{p}" for p in peers]
    body = []
    for suite, case, by, sp in table:
        line = [case]
        for p in providers:
            r = by.get(p)
            if r is None:
                line.append("-")
            elif _ms(r) is not None:
                cp = r.get("cp") or ""
                flag = "" if r.get("timing") in ("cudagraph", "", None) else "*"
                line.append(f"{_ms(r):.3f}{flag}" + (f" cp{cp}" if cp and cp != "1" else ""))
            else:
                line.append(r.get("status") or "?")
        if have_subject:
            line += [f"{sp[p]:.2f}x" if sp[p] else "-" for p in peers]
        body.append(line)
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)] if body else [len(h) for h in head]
    out = ["  ".join(str(x).ljust(w) for x, w in zip(head, widths)),
           "  ".join("-" * w for w in widths)]
    out += ["  ".join(str(x).ljust(w) for x, w in zip(line, widths)) for line in body]
    if have_subject:
        for p in peers:
            xs = [sp[p] for _, _, _, sp in table if sp[p]]
            if xs:
                gm = math.exp(sum(math.log(x) for x in xs) / len(xs))
                out.append(f"geomean {subject}/{p}: {gm:.2f}x over {len(xs)} cases "
                           f"(min {min(xs):.2f}x, max {max(xs):.2f}x)")
    out.append("(* = timed with events, not a CUDA graph; cpN = N intra-card CP partitions; "
               "speedup = peer ms / subject ms)")
    if have_subject:
        out += target_lines(table, peers)
    return "\n".join(out)


def _ratio(x: float, target: float) -> str:
    """x with two decimals, or three where two would round a miss up to the target (1.1996 -> "1.200")."""
    return f"{x:.2f}" if round(x, 2) < target else f"{x:.3f}"


def target_lines(table: list, peers: list, reference: str = "flashqla") -> list:
    """The issue's forward targets, counted twice: over the rows where `reference` ran without splitting
    sequences (its measured cp = 1), and over the rows where the issue's statement of FlashQLA's rule does not
    split (`shapes.flashqla_rule_splits`; rows without seqlens/hv are left out of that count). For each peer in
    TARGETS: how many of those rows reach its speedup and which do not."""
    import shapes  # noqa: PLC0415 (bench-local module)

    def measured_whole(by):
        return reference in by and _ms(by[reference]) is not None and (by[reference].get("cp") or "1") == "1"

    def rule_whole(by):
        r = next((r for r in by.values() if r.get("seqlens") and r.get("hv")), None)
        return r is not None and not shapes.flashqla_rule_splits(int(r["hv"]), shapes.parse_seqlens(r["seqlens"]))

    out = []
    for label, keep in ((f"where {reference} does not split", measured_whole),
                        (f"where the issue's {reference} rule does not split", rule_whole)):
        whole = [(case, sp) for _, case, by, sp in table if keep(by)]
        for p in peers:
            if p not in TARGETS:
                continue
            got = [(case, sp[p]) for case, sp in whole if sp.get(p)]
            if not got:
                continue
            miss = [f"{case} {_ratio(x, TARGETS[p])}x" for case, x in got if x < TARGETS[p]]
            out.append(f"target >= {TARGETS[p]}x vs {p} on rows {label}: "
                       f"{len(got) - len(miss)}/{len(got)} met" + (f"; missed: {', '.join(miss)}" if miss else ""))
    return out


def chart(rows: list, path: str, subject: str = "flashdelta", title: str = "") -> str | None:
    """Speedup of `subject` vs each peer per case, one panel per suite. Returns the path, or None (message
    printed) when matplotlib is missing or nothing was timed for the subject."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("chart skipped: matplotlib is not importable (pip install matplotlib)")
        return None
    providers, peers, table = speedup_table(rows, subject)
    if subject not in providers or not any(v for *_, sp in table for v in sp.values()):
        print(f"chart skipped: no timed rows with speedups for subject {subject!r}")
        return None
    suites = list(OrderedDict.fromkeys(s for s, *_ in table))
    most = max(sum(1 for t in table if t[0] == s) for s in suites)
    width_in = min(28.0, max(8.0, 0.14 * most * max(1, len(peers))))
    fig, axes = plt.subplots(len(suites), 1, squeeze=False, figsize=(width_in, 5.0 * len(suites)))
    for ax, suite in zip(axes[:, 0], suites):
        items = [t for t in table if t[0] == suite]
        n, width = len(items), 0.8 / max(1, len(peers))
        for j, p in enumerate(peers):
            xs = [i + (j - (len(peers) - 1) / 2) * width for i in range(n)]
            ys = [sp[p] if sp[p] else 0.0 for *_, sp in items]
            ax.bar(xs, ys, width=width, label=f"vs {p}", color=COLORS.get(p))
        ax.axhline(1.0, color="black", linewidth=1.0)
        for p in peers:
            if p in TARGETS:
                ax.axhline(TARGETS[p], color=COLORS.get(p), linestyle="--", linewidth=1.0,
                           label=f"target vs {p} ({TARGETS[p]:g}x)")
        ax.set_xticks(range(n))
        ax.set_xticklabels([case.split("/", 1)[1] for _, case, *_ in items], rotation=90, fontsize=6 if n > 40 else 7)
        ax.set_ylabel(f"{subject} speedup (x)")
        ax.set_title(f"{suite}" + (f" - {title}" if title else ""))
        ax.legend(fontsize=7, loc="upper right")
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    d = os.path.dirname(path)
    if d:
        os.makedirs(d, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Re-render the table and chart of bench CSVs (merged in order).")
    ap.add_argument("csv", nargs="+")
    ap.add_argument("--subject", default="flashdelta")
    ap.add_argument("--png", default=None, help="chart path (default: the CSV path with .png)")
    args = ap.parse_args(argv)
    env, rows = read_csv(args.csv[0])
    for path in args.csv[1:]:
        more_env, more = read_csv(path)
        if more_env.get("gpu") != env.get("gpu"):
            print(f"warning: {path} was measured on {more_env.get('gpu')!r}, not {env.get('gpu')!r}")
        rows += more
    for k, v in env.items():
        print(f"{k}: {v}")
    print(format_table(rows, args.subject))
    png = chart(rows, args.png or os.path.splitext(args.csv[0])[0] + ".png", args.subject,
                title=env.get("gpu", ""))
    if png:
        print(f"chart: {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
