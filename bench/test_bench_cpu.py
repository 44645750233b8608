"""CPU checks of the benchmark's own logic (no GPU): ``python -m pytest bench/test_bench_cpu.py``.

pytest's testpaths include bench/, so the package's test command runs these too.
"""
from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.join(ROOT, "src"))
sys.path.insert(2, os.path.join(HERE, "dev"))

import gate  # noqa: E402
import report  # noqa: E402
import ncu_sites  # noqa: E402  (bench/dev)
import shapes  # noqa: E402
import timing  # noqa: E402


def test_grid_sizes_and_names():
    assert len(shapes.cases("fwd")) == 8 * 12
    assert len(shapes.cases("bwd")) == 6 * 2 * 4
    assert len(shapes.cases("fwdbwd")) == 48
    names = [c.name for s in shapes.SUITES for c in shapes.cases(s)]
    assert len(names) == len(set(names))
    for c in shapes.cases("bwd") + shapes.cases("fwd"):
        assert c.tokens in (32768, 16384, 8192, 4096, 2048)
        assert c.hv % c.h == 0
        assert min(c.seqlens) >= shapes.MIN_SPLIT_LEN
        assert shapes.parse_seqlens(c.seqlens_str) == c.seqlens
        g = c.gate_seqlens()
        assert len(g) == c.n_seqs and sum(g) <= shapes.GATE_MAX_TOKENS and min(g) >= 1


def test_random_split_is_seeded_and_exact():
    for total, n in ((8192, 2), (8192, 8), (32768, 4)):
        seed = shapes.split_seed(total, n)
        a = shapes.random_split(total, n, seed)
        assert a == shapes.random_split(total, n, seed)
        assert sum(a) == total and len(a) == n and min(a) >= shapes.MIN_SPLIT_LEN
    bwd = {c.seqlens for c in shapes.cases("bwd") if c.h == 16}
    assert bwd == {c.seqlens for c in shapes.cases("bwd") if c.h == 2}   # same split for every head config


def test_seqlens_format():
    assert shapes.format_seqlens((32768,)) == "1x32768"
    assert shapes.format_seqlens((8192,) * 4) == "8192x4"
    assert shapes.format_seqlens((28672, 4096)) == "28672+4096"
    assert shapes.parse_seqlens("1x32768") == (32768,)


def test_quick_subset():
    for s in shapes.SUITES:
        q = shapes.cases(s, quick=True)
        assert 1 <= len(q) <= 4 and len({(c.h, c.hv) for c in q}) == 1


def test_flop_and_floor_model():
    assert timing.fwd_flops_per_token_head() == 163_840
    assert timing.bwd_flops_per_token_head() == 491_520
    # docs/performance.md: TP1 (16/64) 1x32k: compute floor 0.44 ms, memory floor 0.32 ms
    rf = timing.roofline("fwd", 32768, 16, 64, 1)
    assert abs(rf.compute_ms - 0.435) < 0.005 and abs(rf.memory_ms - 0.318) < 0.005
    assert math.isclose(rf.floor_frac(rf.floor_ms * 2), 0.5)
    assert math.isclose(rf.tflops(rf.compute_ms), timing.PEAK_TFLOPS)


def test_quantile():
    xs = [5, 1, 4, 2, 3]
    assert timing.quantile(xs, 0.5) == 3
    assert timing.quantile(xs, 0.0) == 1 and timing.quantile(xs, 1.0) == 5
    assert math.isclose(timing.quantile(xs, 0.2), 1.8)


def test_full_size_verdicts():
    import torch

    base = torch.randn(64, dtype=torch.float64)
    near = base + 1e-4 * torch.randn(64, dtype=torch.float64)
    far = base + 0.5 * torch.randn(64, dtype=torch.float64)
    three = gate.full_size_verdicts({"a": {"o": base}, "b": {"o": near}, "c": {"o": far}}, ("o",))
    assert three["a"][0] == "ok" and three["b"][0] == "ok" and three["c"][0] == "fail"
    two = gate.full_size_verdicts({"a": {"o": base}, "c": {"o": far}}, ("o",))
    assert two["a"][0] == two["c"][0] == "mismatch"

def test_gate_uses_numerics_and_nan_fails():
    import torch

    from flashdelta import numerics

    assert gate.TOLS is numerics.TOLS
    base = torch.randn(64, dtype=torch.float64)
    nan = base.clone()
    nan[3] = float("nan")
    assert math.isnan(gate.rel_l2(nan, base))
    assert gate.rel_l2(None, base) == math.inf and gate.rel_l2(base[:8], base) == math.inf
    worst, detail, ok = gate.compare({"o": nan, "ht": base}, {"o": base, "ht": base}, ("o", "ht"))
    assert not ok and math.isnan(worst) and "o=nan" in detail
    worst, _, ok = gate.compare({"o": base, "ht": base}, {"o": base, "ht": base}, ("o", "ht"))
    assert ok and worst == 0.0
    # a NaN output at full size is the odd one out against two providers that agree
    v = gate.full_size_verdicts({"a": {"o": base}, "b": {"o": base.clone()}, "c": {"o": nan}}, ("o",))
    assert v["a"][0] == v["b"][0] == "ok" and v["c"][0] == "fail"


@pytest.mark.parametrize("grads", [False, True])
def test_gate_on_cpu_with_the_portable_path(grads, monkeypatch):
    """The gate machinery end to end on CPU: flashdelta's portable path vs the float64 recurrence."""
    pytest.importorskip("flashdelta")
    monkeypatch.setenv("FLASHDELTA_BACKEND", "torch")
    import providers as P

    prov = P.FlashDelta()
    if prov.load():
        pytest.skip(f"flashdelta not importable: {prov.load()}")
    inp = P.make_inputs((40, 70), 2, 4, 32, 32, seed=3, device="cpu", requires_grad=grads)
    ref = gate.reference(inp, grads=grads)
    outs = gate.results(prov, inp, grads=grads)
    names = gate.ALL_NAMES if grads else gate.FWD_NAMES
    worst, detail, ok = gate.compare(outs, ref, names)
    assert ok, detail
    assert worst < 1e-2


def test_csv_roundtrip_table_and_dry_run(tmp_path):
    out = tmp_path / "r.csv"
    cmd = [sys.executable, os.path.join(HERE, "run.py"), "--suite", "fwd,bwd", "--quick", "--fake",
           "--out", str(out), "--no-chart"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    env, rows = report.read_csv(str(out))
    assert env["FAKE"] and "flop_model" in env and "flashdelta_commit" in env
    assert len(rows) == 4 * 3
    assert set(report.COLUMNS) <= set(rows[0])
    table = report.format_table(rows, "flashdelta")
    assert "flashdelta/fla" in table and "geomean" in table
    res = subprocess.run([sys.executable, os.path.join(HERE, "run.py"), "--suite", "fwd", "--dry-run"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and res.stdout.startswith("96 cases")


def test_chart_when_matplotlib_present(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [dict(suite="fwd", case=f"fwd/h2v8/c{i}", provider=p, ms=str(ms), timing="cudagraph", cp="1")
            for i in range(3) for p, ms in (("flashdelta", 1.0), ("fla", 2.5), ("flashqla", 1.3))]
    png = report.chart(rows, str(tmp_path / "c.png"))
    assert png and os.path.getsize(png) > 1000
    assert report.chart(rows, str(tmp_path / "d.png"), subject="nobody") is None


def test_target_lines_count_only_rows_the_reference_runs_whole():
    def rows(case, sub, fla, fqla, cp):
        return [dict(suite="fwd", case=case, provider=p, ms=str(ms), timing="cudagraph", cp=c)
                for p, ms, c in (("flashdelta", sub, "1"), ("fla", fla, "1"), ("flashqla", fqla, cp))]
    data = rows("a", 1.0, 2.5, 1.3, "1") + rows("b", 1.0, 1.5, 1.1, "1") + rows("c", 1.0, 1.0, 0.5, "4")
    _, peers, table = report.speedup_table(data, "flashdelta")
    lines = report.target_lines(table, peers)
    assert lines == ["target >= 2.0x vs fla on rows where flashqla does not split: 1/2 met; missed: b 1.50x",
                     "target >= 1.2x vs flashqla on rows where flashqla does not split: 1/2 met; missed: b 1.10x"]
    assert lines[0] in report.format_table(data, "flashdelta")


def test_target_lines_also_count_by_the_issues_rule():
    def rows(case, hv, seqlens, sub, fla, fqla):
        return [dict(suite="fwd", case=case, provider=p, ms=str(ms), timing="cudagraph", cp="1", hv=str(hv),
                     seqlens=seqlens) for p, ms in (("flashdelta", sub), ("fla", fla), ("flashqla", fqla))]
    # FlashQLA ran all three whole; the rule splits "b" (1 x 8 = 8 <= 40), so only "a" and "c" count there
    data = (rows("a", 64, "1x32768", 1.0, 2.5, 1.5) + rows("b", 8, "1x4096", 1.0, 1.3, 1.3)
            + rows("c", 64, "4096x8", 1.0, 3.0, 1.19965))
    _, peers, table = report.speedup_table(data, "flashdelta")
    lines = report.target_lines(table, peers)
    assert lines == [
        "target >= 2.0x vs fla on rows where flashqla does not split: 2/3 met; missed: b 1.30x",
        "target >= 1.2x vs flashqla on rows where flashqla does not split: 2/3 met; missed: c 1.200x",
        "target >= 2.0x vs fla on rows where the issue's flashqla rule does not split: 2/2 met",
        "target >= 1.2x vs flashqla on rows where the issue's flashqla rule does not split: 1/2 met; missed: c 1.200x"]


@pytest.mark.parametrize("hv, seqlens, splits", [
    (8, (4096,), True),                  # Be = 1: 8 <= 40
    (64, (32768,), False),               # 64 > 56
    (48, (32768,), True),                # 48 <= 56 and the longest has >= 8k tokens
    (48, (4096,), False),                # 48 > 40 and the longest is short
    (24, (8192,) * 4, False),            # Be = 4: 96
    (16, (16384, 16384), True),          # Be = 2: 32 <= 40
    (16, (28672, 4096), True),           # Be = 512 / 448 = 1.14: 18.3
    (16, (0,), False),                   # nothing to split
])
def test_flashqla_rule(hv, seqlens, splits):
    assert shapes.flashqla_rule_splits(hv, seqlens) is splits


def test_ncu_sites_splits_roles_at_setmaxnreg(tmp_path):
    head = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed", "stall_long_sb",
            "stall_wait", "stall_long_sb (Not Issued)"]
    code = [("0x100", "LDC R1, c[0x0][0x28]", 1, 3, 0, 1),
            ("0x110", "USETMAXREG.DEALLOC.CTAPOOL 0x28", 0, 4, 0, 0),
            ("0x120", "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R3+URZ], R2", 5, 8, 5, 0),
            ("0x130", "@!P0 BRA 0x200", 2, 8, 2, 0),
            ("0x140", "USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xf0", 0, 4, 0, 0),
            ("0x150", "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR9], R2", 30, 64, 29, 1),
            ("0x160", "@!P0 BRA 0x210", 1, 64, 1, 0)]
    path = tmp_path / "src.csv"
    lines = ['"Kernel Name","k",', ",".join(f'"{h}"' for h in head)]
    lines += [",".join(f'"{x}"' for x in (a, s_, n, ex, lsb, w, 0)) for a, s_, n, ex, lsb, w in code]
    path.write_text("\n".join(lines) + "\n")
    kernels = ncu_sites.read_kernels(str(path))
    assert len(kernels) == 1 and len(kernels[0][2]) == 7
    out = "\n".join(ncu_sites.summarize(kernels[0], top=2))
    assert "producer 40 regs" in out and "consumer 240 regs" in out
    sites = out.split("top mbarrier wait sites")[1].splitlines()[1:]
    assert "0x00050 consumer 240 regs      samples     31" in sites[0]     # 30 + 1 on its branch
    assert "0x00020 producer 40 regs       samples      7" in sites[1]
