"""Every ratio between two rows says whether they share GPU and campaign and marks throttled rows:
analysis.pairing and its labels, and their use in plots, report, reproduce and kernel_ratios."""

import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import synth_results as S

from qlabench import analysis, plots, report, results

ROOT = Path(__file__).resolve().parents[1]
SAME = {"gpu_uuid": "GPU-aaaa", "campaign_id": "c1"}


def test_pairing_same_different_unknown_and_throttled():
    a = pd.DataFrame({"gpu_uuid": ["G1", "G1", None, "G1"], "campaign_id": ["c1", "c2", "c1", "c1"],
                      "throttled": [False, True, None, False]})
    b = pd.DataFrame({"gpu_uuid": ["G1", "G1", "G1", "G2"], "campaign_id": ["c1", "c1", "c1", "c1"],
                      "throttled": [False, False, False, None]})
    p = analysis.pairing(a, b)
    assert list(p["same_gpu"]) == [True, True, False, False]
    assert list(p["gpu_known"]) == [True, True, False, True]
    assert list(p["same_campaign"]) == [True, False, True, True]
    assert list(p["throttled"]) == [False, True, False, False]
    assert list(p["pairing"]) == ["", "cross-campaign, throttled", "cross-GPU", "cross-GPU"]
    assert analysis.pairing_label(p) == ("cross-GPU: 2 of 4 pairs (1 unknown); "
                                        "cross-campaign: 1 of 4 pairs; throttled: 1")
    assert analysis.pairing_label(p.iloc[:1]) == "same GPU and campaign: 1 pair"
    assert analysis.pairing_label(p.iloc[:0]) == "no pairs"
    # rows written before gpu_uuid / campaign_id existed: unknown, so not shared
    old = analysis.pair({"latency_ms": 1.0}, {"latency_ms": 2.0})
    assert old["pairing"] == "cross-GPU, cross-campaign" and not old["same_gpu"]
    with pytest.raises(ValueError):
        analysis.pairing(a, b.iloc[:2])


def test_rows_timed_by_different_methods_are_tagged_cross_method():
    """timing_mode or l2 known on both sides and different: ``cross-method``, as compare's
    MUST_MATCH judges them; a side without a value is not compared."""
    a = pd.DataFrame({**{c: ["G1"] * 4 for c in ("gpu_uuid",)}, "campaign_id": ["c1"] * 4,
                      "timing_mode": ["graph-batch", "events", "graph-batch", None],
                      "l2": ["warm", "warm", "cold", "warm"]})
    b = a.assign(timing_mode=["graph-batch"] * 4, l2=["warm"] * 4)
    p = analysis.pairing(a, b)
    assert list(p["same_method"]) == [True, False, False, True]
    assert list(p["pairing"]) == ["", "cross-method", "cross-method", ""]
    assert analysis.pairing_label(p) == "cross-method: 2 of 4 pairs"
    assert analysis.pair({"timing_mode": "events", **SAME}, {"timing_mode": "graph-batch",
                                                             **SAME})["pairing"] == "cross-method"
    assert set(analysis.PAIR_FIELDS) >= {"same_method"}


def _mixed(tmp):
    """One run, one GPU and campaign: fla's rows timed with per-call events (its fallback), the
    others in graph-batch."""
    rid, at = "20250101T000000-aaaaaa", "2025-01-01T00:00:00"
    return S.write_rows(tmp / "mixed", S.make_rows(rid, at, backends=("fla",), timing_mode="events",
                                                   extra=SAME)
                        + S.make_rows(rid, at, backends=("flashqla", "tilelang"), extra=SAME, seed=1))


def test_views_say_when_a_ratio_crosses_timing_methods(tmp_path):
    """summary, the speedup table (figures, notebook) and the report tag every ratio over fla:
    its rows were timed by different methods."""
    from typer.testing import CliRunner

    from qlabench.cli import app
    d = _mixed(tmp_path)
    r = CliRunner().invoke(app, ["summary", str(d), "--wide"])
    assert r.exit_code == 0, r.output
    assert r.output.count("pairing: vs fla, cross-method: 1x8192, 1x32768, 2x4096, 8x1024") == 2
    lat = results.latest(results.load(d))
    sp = plots.speedup_table(lat, "fla", "fwd")
    assert len(sp) == 16 and set(sp["pairing"]) == {"cross-method"}
    assert analysis.pairing_label(sp) == "cross-method: 16 of 16 pairs"
    # winner vs runner-up: both graph-batch, a clean pair
    assert set(analysis.point_table(lat)["pairing"]) == {""}
    assert report.report_cmd([d], tmp_path / "site") == 0
    page = (tmp_path / "site" / "index.html").read_text()
    assert "fwd flashqla: geomean 1.43× FLA over 8 points — cross-method: 8 of 8 pairs" in page


def _run(tmp, name="r", throttle=None, **kw):
    d = S.write_run(tmp / name, extra=SAME, **kw)
    if throttle:
        df = results.load(d)
        df.loc[df["backend"] == throttle, "throttled"] = True
        for f in (d / "parts").glob("*.parquet"):
            f.unlink()
        results._write_rows_file(d / "parts", "rows", df)
    return d


def test_speedup_table_and_figures_carry_the_pairing(tmp_path):
    lat = results.latest(results.load(_run(tmp_path, throttle="flashqla")))
    sp = plots.speedup_table(lat, "fla", "fwd")
    assert len(sp) == 16 and set(sp["backend"]) == {"flashqla", "tilelang"}
    assert set(sp.loc[sp["backend"] == "tilelang", "pairing"]) == {""}
    assert set(sp.loc[sp["backend"] == "flashqla", "pairing"]) == {"throttled"}
    assert sp["speedup"].gt(1).all()  # synthetic: both faster than FLA
    assert analysis.pairing_label(sp[sp["backend"] == "flashqla"]) == "throttled: 8"
    assert plots.speedup_heatmap(lat, tmp_path / "s.png") and plots.latency_figure(
        lat, tmp_path / "l.png", "fwd")


def test_report_states_the_pairing_of_its_ratios(tmp_path):
    a = _run(tmp_path, "with_ids", throttle="tilelang")
    b = S.write_run(tmp_path / "without_ids", run_id="r-old")  # no gpu_uuid / campaign_id
    assert report.report_cmd([a, b], tmp_path / "site") == 0
    page = (tmp_path / "site" / "index.html").read_text()
    assert "fwd flashqla: geomean 1.43× FLA over 8 points — same GPU and campaign: 8 pairs" in page
    assert "fwd tilelang: geomean 1.25× FLA over 8 points — throttled: 8" in page
    assert ("fwd flashqla: geomean 1.43× FLA over 8 points — cross-GPU: 8 of 8 pairs (8 unknown); "
            "cross-campaign: 8 of 8 pairs (8 unknown)") in page
    assert "pairing (vs fla)" in page


def test_report_history_pairs_are_labelled(tmp_path):
    d = _run(tmp_path)
    S.copy_scaled(d, d, {"fla": 1.10}, campaign_id="c2")
    page = (report.build([d], tmp_path / "site")).read_text()
    # library regressions (fla, flashqla) and the in-repo kernel history (tilelang), each labelled
    assert "pairs judged: cross-campaign: 16 of 16 pairs" in page
    assert "pairs judged: cross-campaign: 8 of 8 pairs" in page


def test_reproduce_states_the_pairing_of_measured_speedups(tmp_path):
    from test_reproduce import _write_rows

    from qlabench import reproduce as R
    pub = R.load_published("flashqla-h200", "bwd")
    rows_dir = _write_rows(tmp_path / "rows", pub, backends=[*pub.backends, "tilelang"], **SAME)
    rows = R.measured_rows(rows_dir, "bwd")
    rep = R.compare_rows(pub, rows, results.load_meta(rows_dir), "test")
    n = len(pub.table)
    assert set(rep.table["speedup_pairing"]) == {""}
    assert rep.summary["speedup"]["measured"]["pairing"] == f"same GPU and campaign: {n} pairs"
    assert rep.summary["extra"]["vs_fla"]["pairing"] == f"same GPU and campaign: {n} pairs"
    R.write(rep, tmp_path / "out")
    md = (tmp_path / "out" / "reproduce_flashqla-h200_bwd.md").read_text()
    assert f"same GPU and campaign: {n} pairs" in md and "| pairs |" in md
    # the library rows from another campaign, some throttled
    other = _write_rows(tmp_path / "rows2", pub, backends=pub.backends, gpu_uuid="GPU-aaaa",
                        campaign_id="c0", throttled=True)
    _write_rows(other, pub, backends=["tilelang"], run_id="20261201T010000-bbbbbb", **SAME)
    rep = R.compare_rows(pub, R.measured_rows(other, "bwd"), {}, "test")
    assert set(rep.table["speedup_pairing"]) == {"throttled"}  # fla and flashqla: one campaign
    assert set(rep.table["tilelang_vs_fla_pairing"]) == {"cross-campaign, throttled"}
    assert rep.summary["extra"]["vs_best"]["pairing"] == (
        f"cross-campaign: {n} of {n} pairs; throttled: {n}")
    csv = pd.read_csv(R.write(rep, tmp_path / "out2")["csv"])
    assert {"speedup_pairing", "tilelang_vs_fla_pairing", "tilelang_vs_best_pairing"} <= set(csv)


def test_kernel_ratios_script_labels_its_geomeans(tmp_path):
    d = _run(tmp_path, throttle="flashqla")
    out = subprocess.run([sys.executable, str(ROOT / "scripts/kernel_ratios.py"), str(d)],
                         capture_output=True, text=True, timeout=120).stdout
    assert "- vs fla: same GPU and campaign: 8 pairs" in out
    assert "- vs flashqla: throttled: 8" in out
    assert "| all | 8 | 1.25× (8) | 0.87×* (8) |" in out


def test_kernel_ratios_counts_every_library_label_and_chains_versions(tmp_path):
    """A labelled library version (flashinfer@0.7.4) is a library and can be the best; --chain
    multiplies tilelang's latency by a later version's tilelang / tilelang@prev per point and marks
    the chained ratios cross-campaign."""
    # synth_results' base latencies: tilelang 0.8x, every other label 1.0x; no noise
    base = S.write_run(tmp_path / "base", extra=SAME, noise=0.0,
                       backends=("fla", "flashinfer", "flashinfer@0.7.4", "tilelang"),
                       scale={"fla": 2.0, "flashinfer": 1.5, "flashinfer@0.7.4": 0.5, "tilelang": 1.25})
    step = S.write_run(tmp_path / "step", extra=SAME, noise=0.0, backends=("tilelang@prev", "tilelang"),
                       scale={"tilelang": 0.625})

    def run(*args):
        return subprocess.run([sys.executable, str(ROOT / "scripts/kernel_ratios.py"), str(base), *args],
                              capture_output=True, text=True, timeout=120).stdout

    out = run()
    assert "vs flashinfer@0.7.4" in out
    assert "| all | 8 | 2.00× (8) | 1.50× (8) | 0.50× (8) | 0.50× (8) |" in out
    out = run("--chain", str(step))
    assert "chain step" in out and "8 of 8 tilelang points, geomean 0.5000" in out
    assert "| all | 8 | 4.00×* (8) | 3.00×* (8) | 1.00×* (8) | 1.00×* (8) |" in out
    assert "- vs best: cross-GPU: 8 of 8 pairs; cross-campaign: 8 of 8 pairs" in out
