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


def test_fit_cp_rows_are_the_models_schedule():
    """bench/dev/fit_cp.py fits the CP cost model's launch constants to rows from the shipped model's own list
    schedule (`cp_model._launch_terms`): on ragged mixes of partition lengths a row times the constants is the
    model's prediction (`_pass_us`, `_bwd_pass_us`), and fitting the predictions gives the constants back."""
    import random

    import fit_cp  # (bench/dev)
    from flashdelta import cp_model as m

    rng = random.Random(0)
    mixes = [fit_cp._items(shapes.parse_seqlens(s), L) for s, L in (
        ("1x32768", 0), ("1x32768", 32), ("6413+6673+10954+8728", 128), ("3464+499+3508+1557+7636+2893+3338+9873", 24),
        ("166+182+7147+697", 12), ("15837+16931", 64))]
    mixes += [[(rng.randint(1, 256), rng.randint(1, 300)) for _ in range(rng.randint(1, 4))] for _ in range(40)]
    fwd = (m.LAUNCH_US, m.CHUNK_US_IDLE, m.CHUNK_US_FULL, m.ITEM_US)
    bwd = (m.BWD_LAUNCH_US, m.BWD_CHUNK_US, m.BWD_ITEM_US)
    rows, ys, brows, bys = [], [], [], []
    for items in mixes:
        for hv in (2, 8, 32):
            x = [(ch, n * hv * 2) for ch, n in items]          # (value head, 64-column V slice) CTAs
            rows.append(fit_cp._pass_row(x, 132))
            ys.append(m._pass_us(x, 132))
            assert sum(a * b for a, b in zip(rows[-1], fwd)) == pytest.approx(ys[-1], rel=1e-12), x
            xb = [(ch, n * hv) for ch, n in items]
            brows.append(fit_cp._bwd_pass_row(xb, 132))
            bys.append(m._bwd_pass_us(xb, 132))
            assert sum(a * b for a, b in zip(brows[-1], bwd)) == pytest.approx(bys[-1], rel=1e-12), xb
    assert fit_cp._lstsq(rows, ys) == pytest.approx(fwd, rel=1e-6)
    assert fit_cp._lstsq(brows, bys) == pytest.approx(bwd, rel=1e-6)


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


# ----------------------------------------------------------------------------------------------------------
# the flashinfer provider, against a pure-PyTorch stand-in of FlashInfer's calling convention
# ----------------------------------------------------------------------------------------------------------

def _flashinfer_standin(tmp_path, calls: list):
    """A module shaped like the ahead-of-time FlashInfer build: ``chunk_gated_delta_rule`` checks FlashInfer's
    contract (packed [T, H*, D] inputs, fp32 decay factor and beta [T, HV], fp32 V-first contiguous states,
    int cu_seqlens, a max_seqlen hint) and runs the recurrence in that convention in float64; the two CP host
    heuristics record their arguments."""
    import types

    import torch

    def chunk_gated_delta_rule(q, k, v, g=None, beta=None, scale=None, initial_state=None,
                               output_final_state=False, cu_seqlens=None, max_seqlen=None):
        T, H, K = q.shape
        HV, V = v.shape[1], v.shape[2]
        N = cu_seqlens.numel() - 1
        assert k.shape == (T, H, K) and v.shape[0] == T and HV % H == 0
        assert g.dtype == beta.dtype == initial_state.dtype == torch.float32
        assert g.shape == beta.shape == (T, HV) and initial_state.shape == (N, HV, V, K)
        assert all(t.is_contiguous() for t in (q, k, v, g, beta, initial_state))
        assert cu_seqlens.dtype in (torch.int32, torch.int64) and isinstance(max_seqlen, int)
        calls.append(dict(max_seqlen=max_seqlen, scale=scale))
        rep = HV // H
        qf = q.double().repeat_interleave(rep, dim=1) * scale
        kf = k.double().repeat_interleave(rep, dim=1)
        vf, a, b = v.double(), g.double(), beta.double()
        o = torch.zeros(T, HV, V, dtype=torch.float64)
        states = initial_state.double().clone()             # S[n, h] is V x K
        cu = cu_seqlens.tolist()
        for n in range(N):
            S = states[n]
            for t in range(cu[n], cu[n + 1]):
                S = S * a[t][:, None, None]                                   # decay factor, not its log
                u = b[t][:, None] * (vf[t] - torch.einsum("hvk,hk->hv", S, kf[t]))
                S = S + u[:, :, None] * kf[t][:, None, :]
                o[t] = torch.einsum("hvk,hk->hv", S, qf[t])
            states[n] = S
        o = o.to(q.dtype)
        return (o, states.float()) if output_final_state else o

    def should_use_cp_host(work, sms, name, device_capability=None):
        calls.append(dict(cp=(work, sms, name, device_capability)))
        return 2 * work < sms

    def choose_cp_chunk_len_host(longest, heads, sms, **kw):
        calls.append(dict(chunk=(longest, heads, sms), **kw))
        return 4096

    mod = types.ModuleType("fi_gdn_sm90")
    mod.__file__ = str(tmp_path / "__init__.py")
    (tmp_path / "manifest.json").write_text('{"flashinfer": "0.7.2.post1"}')
    mod.chunk_gated_delta_rule, mod.load, mod._lib = chunk_gated_delta_rule, (lambda: None), {"path": "x/gdn.so"}
    mod.should_use_cp_host, mod.choose_cp_chunk_len_host = should_use_cp_host, choose_cp_chunk_len_host
    return mod


@pytest.fixture
def flashinfer_standin(tmp_path, monkeypatch):
    import providers as P

    calls = []
    monkeypatch.setitem(sys.modules, "flashinfer", None)          # the package path is not taken
    monkeypatch.setitem(sys.modules, "fi_gdn_sm90", _flashinfer_standin(tmp_path, calls))
    prov = P.FlashInfer()
    assert prov.load() is None, prov.load()
    return prov, calls


def test_flashinfer_conversion_passes_the_gate(flashinfer_standin):
    """prepare's converted inputs through FlashInfer's convention give the float64 reference's o and final
    state; the wrong conversions (log gate, K-first h0) fail the same gate."""
    import torch

    import providers as P

    prov, calls = flashinfer_standin
    assert prov.source == "fi_gdn_sm90" and prov.version().startswith("0.7.2.post1")
    assert "gdn.so" in prov.notes[0]
    inp = P.make_inputs((40, 70), 2, 4, 32, 32, seed=5, device="cpu", beta_dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="prepare"):
        prov.forward(inp)
    prov.prepare(inp)
    fi = inp.extras["flashinfer"]
    assert torch.equal(fi["g"], inp.g[0].exp()) and fi["g"].dtype == torch.float32
    assert fi["beta"].dtype == torch.float32 and torch.equal(fi["beta"], inp.beta[0].float())
    assert fi["h0"].shape == (2, 4, 32, 32) and fi["h0"].is_contiguous()
    assert torch.equal(fi["h0"].transpose(-1, -2), inp.h0)
    assert fi["q"].shape == (110, 2, 32) and fi["cu"] is inp.cu and fi["max_seqlen"] == 70
    ref = gate.reference(inp, grads=False)
    outs = gate.results(prov, inp, grads=False)
    assert outs["o"].shape == ref["o"].shape and outs["ht"].shape == ref["ht"].shape
    worst, detail, ok = gate.compare(outs, ref, gate.FWD_NAMES)
    assert ok and worst < 1e-2, detail
    assert calls[-1] == dict(max_seqlen=70, scale=inp.scale)
    for key, wrong in (("g", inp.g[0].contiguous()), ("h0", inp.h0.contiguous())):
        inp.extras["flashinfer"] = dict(fi, **{key: wrong})
        assert not gate.compare(gate.results(prov, inp, grads=False), ref, gate.FWD_NAMES)[2], key


def test_flashinfer_is_forward_only_and_reports_its_cp(flashinfer_standin, monkeypatch):
    import torch

    import providers as P

    prov, calls = flashinfer_standin
    assert prov.supports("fwd") is None
    assert prov.supports("bwd") == prov.supports("fwdbwd") == P.FlashInfer.NO_BACKWARD
    assert all(P.REGISTRY[n]().supports(s) is None for n in ("flashdelta", "fla", "flashqla") for s in shapes.SUITES)
    monkeypatch.setattr(prov, "device_info", lambda device: {"sm_count": 132, "name": "H200", "cc": (9, 0)})

    def inp(h, hv, seqlens):
        x = torch.empty(1, 1, h, 1)
        return P.Inputs(x, x, torch.empty(1, 1, hv, 1), None, None, None, None, None, tuple(seqlens), 1.0)

    calls.clear()
    assert prov.cp_partitions(inp(16, 64, (32768,)), train=False) == 8          # 2 * 64 < 132: 32768 / 4096
    assert calls == [dict(cp=(64, 132, "H200", (9, 0))),
                     dict(chunk=(32768, 64, 132), device_capability=(9, 0), total_seqlen=32768, num_seqs=1,
                          device_name="H200")]
    assert prov.cp_partitions(inp(16, 64, (8192,) * 4), train=False) == 1     # 2 * 256 >= 132: no CP
    assert prov.cp_partitions(inp(2, 8, (4096,) * 8), train=False) == 1       # CP, but 4096 fits one piece
    assert prov.cp_partitions(inp(16, 64, (32768,)), train=True) is None


def test_fake_run_with_four_providers(tmp_path, capsys):
    import run

    out = tmp_path / "r.csv"
    assert run.main(["--suite", "fwd,bwd", "--quick", "--fake", "--no-chart", "--out", str(out),
                     "--providers", "flashdelta,fla,flashqla,flashinfer"]) == 0
    _, rows = report.read_csv(str(out))
    assert len(rows) == 4 * 4
    fi = {r["suite"]: r for r in rows if r["provider"] == "flashinfer"}
    assert fi["fwd"]["status"] == "ok" and fi["fwd"]["ms"]
    assert fi["bwd"]["status"] == "unsupported" and "no SM90 backward" in fi["bwd"]["note"] and not fi["bwd"]["ms"]
    assert "flashdelta/flashinfer" in capsys.readouterr().out
