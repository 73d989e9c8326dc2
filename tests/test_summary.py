"""qlabench.summary: winner, runner-up, margin, tie from samples, baseline speedup, bad input."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from qlabench import results, summary
from qlabench.cli import app

HQ, HV = 16, 64
MODEL = "397B/122B TP1"


def row(backend: str, ms: float | None, seqlens=(8192,), status: str = "ok", noise: float = 0.002,
        n: int = 30, seed: int = 0, model: str = MODEL, hq: int = HQ, hv: int = HV,
        point_index: int = 0, campaign: str = "c1", **extra) -> dict:
    """One stored row; ``ms`` the true median, samples lognormal(noise)."""
    sl = [int(x) for x in seqlens]
    r = {"run_id": "20260101T000000-aaaaaa", "git_sha": "abc", "config": "t",
         "point_index": point_index, "point_key": f"{hq}/{hv}/d128|{' '.join(map(str, sl))}|bf16",
         "model": model, "tp": f"{hq}/{hv}", "h_qk": hq, "h_v": hv, "head_dim": 128,
         "seqlens": sl, "layout": f"{len(sl)}x{sl[0]}", "total_tokens": sum(sl),
         "num_seqs": len(sl), "dtype": "bf16", "direction": "fwd", "backend": backend,
         "backend_name": backend.split("@")[0], "backend_version": "1",
         "gpu_name": "NVIDIA H200", "gpu_uuid": "GPU-1", "campaign_id": campaign,
         "started_at": "2026-01-01T00:00:00", "status": status, "reason": "",
         "timing_mode": "graph-batch", "l2": "warm", **extra}
    if status == "ok":
        rng = np.random.default_rng(seed)
        s = ms * rng.lognormal(0.0, noise, n)
        s = s * (ms / np.median(s))  # median exactly ms
        r.update(samples_ms=[float(x) for x in s], n_samples=n, latency_ms=float(np.median(s)),
                 p10_ms=float(np.quantile(s, 0.1)), p90_ms=float(np.quantile(s, 0.9)),
                 max_rel_l2=0.004)
    return r


def write(tmp_path, rows):
    store = results.ResultStore(tmp_path)
    for i, r in enumerate(rows):
        store.append({**r, "started_at": f"2026-01-01T00:00:{i:02d}"})
    return tmp_path


def test_winner_runner_up_margin_speedup_and_correctness(tmp_path):
    d = write(tmp_path, [row("fla", 1.0, seed=1), row("flashinfer", 0.5, seed=2),
                         row("tilelang", 0.6, seed=3), row("flashqla", None, status="incorrect"),
                         row("zz", None, status="crashed"), row("yy", None, status="unavailable")])
    t = summary.point_table(results.latest(results.load(d)))
    assert len(t) == 1
    r = t.iloc[0]
    assert r["winner"] == "flashinfer" and r["runner_up"] == "tilelang"
    assert r["winner_ms"] == pytest.approx(0.5) and r["margin"] == pytest.approx(1.2)
    assert r["speedup"] == pytest.approx(2.0) and r["baseline"] == "fla"
    assert not r["tie"]
    assert r["n_incorrect"] == 1 and r["n_failed"] == 1 and r["n_ok"] == 3 and r["n_backends"] == 6
    assert r["winner_max_rel_l2"] == pytest.approx(0.004)
    assert r["winner_p10_ms"] < 0.5 < r["winner_p90_ms"]
    assert r["pairing"] == "" and r["baseline_pairing"] == ""


def test_baseline_is_a_label_or_a_library(tmp_path):
    d = write(tmp_path, [row("fla@0.6", 1.0, seed=1), row("flashinfer@0.7.4", 0.25, seed=2)])
    df = results.latest(results.load(d))
    assert summary.point_table(df, baseline="fla").iloc[0]["speedup"] == pytest.approx(4.0)
    assert summary.point_table(df, baseline="flashinfer@0.7.4").iloc[0]["speedup"] == pytest.approx(1.0)
    assert summary.point_table(df, baseline="nope").iloc[0]["speedup"] is None


def test_tie_inside_threshold_and_inside_noise_but_not_when_clear():
    rng = np.random.default_rng(0)
    a = 1.0 * rng.lognormal(0, 0.002, 30)
    # 0.5% apart with tight samples: significant, but under the 1% practical threshold -> tie
    assert summary.is_tie(a, 1.005 * rng.lognormal(0, 0.002, 30))
    # 3% apart but each sample list spreads 20% over 5 samples: the test cannot tell -> tie
    wide = [0.8, 0.9, 1.0, 1.1, 1.2]
    assert summary.is_tie(wide, [1.03 * x for x in [1.2, 0.8, 1.0, 1.1, 0.9]])
    # 3% apart, tight samples: not a tie
    assert not summary.is_tie(a, 1.03 * rng.lognormal(0, 0.002, 30))
    # too few samples for the test to reach alpha (2 vs 2): a tie whatever the gap
    assert summary.is_tie([1.0, 1.0001], [2.0, 2.0001])


def test_tie_decided_from_stored_samples(tmp_path):
    two = (8192, 8192)
    d = write(tmp_path, [row("a", 0.500, seed=1), row("b", 0.502, seed=2),   # 0.4%: tie
                         row("a", 0.500, two, seed=3, point_index=1),
                         row("b", 0.540, two, seed=4, point_index=1)])       # 8%, tight: no tie
    t = summary.point_table(results.latest(results.load(d))).set_index("num_seqs")
    assert bool(t.loc[1, "tie"]) is True
    assert bool(t.loc[2, "tie"]) is False and t.loc[2, "margin"] == pytest.approx(1.08)


def test_cross_campaign_pair_is_tagged_and_footer_counts(tmp_path):
    d = write(tmp_path, [row("fla", 1.0, seed=1), row("a", 0.5, seed=2),
                         row("b", 0.6, seed=3, campaign="c2"),
                         row("fla", 2.0, (4096, 4096), seed=4, point_index=1),
                         row("a", 1.0, (4096, 4096), seed=5, point_index=1),
                         row("b", 0.5, (4096, 4096), seed=6, point_index=1, campaign="c2")])
    df = results.latest(results.load(d))
    t = summary.point_table(df).set_index("num_seqs")
    assert t.loc[1, "pairing"] == "cross-campaign" and t.loc[1, "baseline_pairing"] == ""
    assert t.loc[2, "winner"] == "b" and t.loc[2, "baseline_pairing"] == "cross-campaign"
    foot = summary.model_footer(df, summary.point_table(df), "fla").set_index("backend")
    assert foot.loc["a", "wins"] == 1 and foot.loc["b", "wins"] == 1 and foot.loc["fla", "wins"] == 0
    assert foot.loc["a", "geomean_speedup"] == pytest.approx(2.0)
    assert foot.loc["b", "geomean_speedup"] == pytest.approx(np.sqrt(1 / 0.6 * 4.0))


def test_select_model_by_name_or_heads(tmp_path):
    d = write(tmp_path, [row("a", 1.0), row("a", 1.0, model="2B TP1", hq=16, hv=16, point_index=1)])
    df = results.latest(results.load(d))
    assert set(summary.select_model(df, "16/64")["model"]) == {MODEL}
    assert set(summary.select_model(df, "2B TP1")["h_v"]) == {16}
    with pytest.raises(summary.BadInput, match="known: .*2B TP1 \\(16/16\\)"):
        summary.select_model(df, "8/8")


def test_cli_summary_table_and_bad_input(tmp_path):
    d = write(tmp_path / "r", [row("fla", 1.0, seed=1), row("flashinfer", 0.5, seed=2),
                               row("tilelang", 0.501, seed=3)])
    r = CliRunner().invoke(app, ["summary", str(d), "--model", "16/64", "--direction", "fwd"])
    assert r.exit_code == 0, r.output
    assert "flashinfer" in r.output and "tie" in r.output and "2.00×" in r.output
    assert "flashinfer: 2.00× over fla (1 pts), 1 win (1 tie)" in r.output
    r = CliRunner().invoke(app, ["summary", str(d), "--model", "99/99"])
    assert r.exit_code == 2 and "no such model" in r.output and "Traceback" not in r.output
    r = CliRunner().invoke(app, ["summary", str(d), "--direction", "bwd"])
    assert r.exit_code == 2 and "has rows for fwd" in r.output
    (tmp_path / "empty" / "parts").mkdir(parents=True)
    r = CliRunner().invoke(app, ["summary", str(tmp_path / "empty")])
    assert r.exit_code == 2 and "no result rows" in r.output
    r = CliRunner().invoke(app, ["summary", str(tmp_path / "missing")])
    assert r.exit_code == 2 and "no such file or directory" in r.output
    bad = write(tmp_path / "bad", [row("fla", None, status="incorrect")])
    r = CliRunner().invoke(app, ["summary", str(bad)])
    assert r.exit_code == 2 and "no ok rows" in r.output


def test_points_without_runner_up_or_winner_print(tmp_path):
    """One point with two ok labels, one with a single ok label (no runner-up), one with none:
    the table prints blanks for what a point lacks."""
    two = (4096, 4096)
    d = write(tmp_path, [row("fla", 1.0, seed=1), row("a", 0.5, seed=2),
                         row("fla", 2.0, two, seed=3, point_index=1),
                         row("a", None, two, status="crashed", point_index=1),
                         row("fla", None, (1024,), status="incorrect", point_index=2)])
    t = summary.point_table(results.latest(results.load(d))).set_index("num_seqs")
    assert pd.isna(t.loc[2, "runner_up"]) and pd.isna(t.loc[2, "margin"])
    r = CliRunner().invoke(app, ["summary", str(d)])
    assert r.exit_code == 0, r.output
    lines = {ln.split()[0]: ln for ln in r.stdout.splitlines() if ln[:1].isdigit()}
    assert "2.00×" in lines["1x8192"] and "nan" not in r.stdout
    assert "1/2" in lines["2x4096"] and "1 failed" in lines["2x4096"]
    assert "no ok row" in lines["1x1024"]
    assert "3 points — a: 2.00× over fla (1 pts), 1 win; fla: 1 win" in r.stdout


def test_run_summary_without_ok_rows_says_so(tmp_path, capsys):
    d = write(tmp_path, [row("fla", None, status="unavailable")])
    summary.print_run_summary(results.latest(results.load(d)))
    assert "no ok rows" in capsys.readouterr().out


def test_run_prints_the_summary_table(tmp_path):
    from pathlib import Path
    cfg = Path(__file__).resolve().parents[1] / "configs" / "smoke.yaml"
    r = CliRunner().invoke(app, ["run", str(cfg), "--out", str(tmp_path), "--limit", "1",
                                 "--backends", "reference", "--no-plot"])
    assert r.exit_code == 0, r.output
    assert "fastest correct backend per layout" in r.output
    assert "reference: 1 win" in r.output


def test_rows_of_two_gate_recipes_are_two_tables_named_by_recipe(tmp_path):
    """The same layouts under two gate recipes: each recipe its own table (the model reads
    ``<model> [<recipe>]``), never two indistinguishable rows of one table."""
    rows = []
    for i, recipe in enumerate(("zero0.25/seed0", "strong-decay:z0.0/s0")):
        for b, ms in (("fla", 2.0), ("tilelang", 1.0)):
            rows.append(row(b, ms, gate_recipe=recipe, point_key=f"{i}|8192", point_index=i))
    r = CliRunner().invoke(app, ["summary", str(write(tmp_path, rows)), "--wide"])
    assert r.exit_code == 0, r.output
    assert f"{MODEL} [published]" in r.output and f"{MODEL} [strong-decay]" in r.output
    assert r.output.count("fastest correct backend per layout") == 2
