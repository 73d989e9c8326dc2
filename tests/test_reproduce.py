import io
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from rich.console import Console
from typer.testing import CliRunner

from qlabench import config as C
from qlabench import reproduce as R
from qlabench import results
from qlabench.cli import app
from qlabench.sweep import layout_label, points

ROOT = Path(__file__).resolve().parents[1]
NAME = "flashqla-h200"
H200_ENV = {"torch": "2.9.1+cu128", "fla-core": "0.5.1", "flashinfer-python": "0.6.13",
            "tilelang": "0.1.9", "flash-qla": "0.1.2"}


def _console():
    buf = io.StringIO()
    return Console(file=buf, width=250, soft_wrap=True), buf


def _write_rows(out, pub, factors=None, statuses=None, n_points=None, backends=None, env=None,
                run_id="20261201T000000-abcdef", **overrides):
    """Rows equal to published × factor per backend; statuses[(backend)] overrides status."""
    factors, statuses = factors or {}, statuses or {}
    store = results.ResultStore(out)
    bes = backends or pub.backends
    for i, p in enumerate(pub.table.itertuples(index=False)):
        if n_points is not None and i >= n_points:
            break
        seq = list(p.key[2])
        for b in bes:
            base = getattr(p, f"{b}_ms", None) or p.flashqla_ms
            st, why = statuses.get(b, ("ok", None))
            store.append({**dict(
                run_id=run_id, point_index=i, backend=b, direction=pub.direction, status=st,
                reason=why, latency_ms=base * factors.get(b, 1.0) if st == "ok" else None,
                h_qk=p.h_qk, h_v=p.h_v, head_dim=128, seqlens=seq, layout=layout_label(seq),
                point_key=f"{p.h_qk}/{p.h_v}/d128|{' '.join(map(str, seq))}|bf16",
                started_at="2026-12-01T00:00:00", gpu_name="NVIDIA H200", timing_mode="graph-batch",
                gate_zero_frac=0.25, model=p.model, backend_version="x"), **overrides})
    store.write_meta(run_id, {"run_id": run_id, "env": env or H200_ENV})
    return out


@pytest.fixture(scope="module")
def pub_fwd():
    return R.load_published(NAME, "fwd")


@pytest.fixture(scope="module")
def pub_bwd():
    return R.load_published(NAME, "bwd")


def test_published_tables_are_in_the_repo_and_give_the_published_geomeans(pub_fwd, pub_bwd):
    assert (ROOT / "configs/published" / NAME / "provenance.yaml").is_file()
    assert len(pub_fwd.table) == 171 and len(pub_bwd.table) == 32
    assert R.geomean(R.published_speedups(pub_fwd)) == pytest.approx(2.05, abs=0.01)
    assert R.geomean(R.published_speedups(pub_bwd)) == pytest.approx(1.96, abs=0.01)
    assert pub_fwd.backends == ["fla", "flashinfer", "flashqla"] and pub_bwd.backends == ["fla", "flashqla"]


@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_published_points_are_the_sweep_points(direction):
    pub = R.load_published(NAME, direction)
    sweep = C.load(pub.sweep_path())
    assert pub.sweep_path() == ROOT / f"configs/h200_{direction}.yaml"
    assert {(p.h_qk, p.h_v, p.seqlens) for p in points(sweep)} == set(pub.table["key"])
    prov = pub.provenance
    assert sweep.gate[0].zero_frac == prov["inputs"]["gate_zero_frac"]
    assert sweep.timing.mode == prov["timing"]["qlabench_mode"]


def test_measured_equal_to_published_agrees_everywhere(tmp_path, pub_bwd):
    src = _write_rows(tmp_path / "rows", pub_bwd)
    con, buf = _console()
    assert R.reproduce_cmd(NAME, "bwd", src, tmp_path / "out", console=con) == 0
    rep = R.compare_rows(pub_bwd, R.measured_rows(src, "bwd"), results.load_meta(src), "x")
    t, s = rep.table, rep.summary
    for b in ("fla", "flashqla"):
        assert s["backends"][b]["within"] == 1.0 and s["backends"][b]["ok"] == 32
        assert np.allclose(t[f"{b}_ratio"], 1.0)
    assert np.allclose(t["speedup_ms"], t["speedup_pub"])
    assert s["speedup"]["measured"]["geomean"] == pytest.approx(1.96, abs=0.01)
    assert s["speedup"]["within"] == 1.0 and not s["missing_points"]
    assert not rep.notes.versions and not rep.notes.method  # same versions, same method
    stem = tmp_path / "out" / f"reproduce_{NAME}_bwd"
    for ext in ("csv", "md", "png"):
        assert stem.with_suffix(f".{ext}").stat().st_size > 0
    saved = pd.read_csv(stem.with_suffix(".csv"))
    assert len(saved) == 32 and {"fla_pub_ms", "fla_ms", "fla_ratio", "speedup_pub", "speedup_ms"} <= set(saved)
    assert "within ±10%" in stem.with_suffix(".md").read_text()
    assert "100%" in buf.getvalue()


def test_slower_flashqla_lowers_the_measured_speedup(tmp_path, pub_bwd):
    src = _write_rows(tmp_path / "rows", pub_bwd, factors={"flashqla": 1.2})
    rep = R.compare_rows(pub_bwd, R.measured_rows(src, "bwd"), {}, "x")
    t, s = rep.table, rep.summary
    assert np.allclose(t["flashqla_ratio"], 1.2) and np.allclose(t["speedup_ms"], t["speedup_pub"] / 1.2)
    assert s["backends"]["flashqla"]["within"] == 0.0 and s["backends"]["fla"]["within"] == 1.0
    assert s["speedup"]["measured"]["geomean"] == pytest.approx(s["speedup"]["published"]["geomean"] / 1.2)
    assert s["speedup"]["within"] == 0.0
    worst, best = R.extremes(t)
    assert len(worst) == R.N_EXTREMES and np.allclose(worst["speedup_ratio"], 1 / 1.2)


def test_missing_points_statuses_and_tilelang_column(tmp_path, pub_fwd):
    src = _write_rows(tmp_path / "rows", pub_fwd, n_points=19,
                      backends=["fla", "flashinfer", "flashqla", "tilelang"],
                      factors={"tilelang": 0.5},
                      statuses={"flashinfer": ("unavailable", "no CUDA device (test)")})
    con, buf = _console()
    assert R.reproduce_cmd(NAME, "fwd", src, tmp_path / "out", console=con) == 0
    rep = R.compare_rows(pub_fwd, R.measured_rows(src, "fwd"), {}, "x")
    t, s = rep.table, rep.summary
    assert len(s["missing_points"]) == 171 - 19
    assert (t["fla_status"].iloc[19:] == R.MISSING).all()
    assert s["backends"]["flashinfer"]["statuses"] == {"missing": 152, "unavailable": 19}
    assert s["backends"]["flashinfer"]["within"] is None
    assert t["flashinfer_ms"].isna().all()
    cell = R._cell(t.iloc[0], "flashinfer")
    assert "unavailable" in cell and "1.655" in cell
    # tilelang at half FlashQLA's time: 2x over the best library, fla/tilelang = 2 x published speedup
    head = t.iloc[:19]
    assert np.allclose(head["tilelang_vs_fla"], 2 * head["speedup_pub"])
    assert (head["best_library"] == "flashqla").all() or np.allclose(
        head["tilelang_vs_best"], head[["fla_ms", "flashqla_ms"]].min(axis=1) / head["tilelang_ms"])
    assert s["extra"]["vs_fla"]["n"] == 19
    text = buf.getvalue()
    assert "no CUDA device (test)" in text and "152 points have no measured row" in text
    assert "tilelang" in text
    # layouts read as in every other view (qlabench.sweep.layout_label), count first
    assert list(t["layout"].iloc[:3]) == ["1x32768", "1x16384", "1x8192"]
    assert {"4x2048", "2x[2048,6144]"} <= set(t["layout"])
    md = (tmp_path / "out" / f"reproduce_{NAME}_fwd.md").read_text()
    assert "2x[2048,6144]" in md and "2048+6144" not in md and "2048x4" not in md


def test_version_differences_are_named_next_to_the_backend(tmp_path, pub_bwd):
    env = {k: v for k, v in H200_ENV.items() if k != "flashinfer-python"} | {"flash-qla": "0.1.3"}
    src = _write_rows(tmp_path / "rows", pub_bwd, env=env, factors={"flashqla": 1.3})
    con, buf = _console()
    assert R.reproduce_cmd(NAME, "bwd", src, tmp_path / "out", console=con) == 0
    notes = R.notes_for(pub_bwd, R.measured_rows(src, "bwd"), results.load_meta(src))
    assert [n.lib for n in notes.versions] == ["flash-qla"]  # flashinfer: no column in bwd
    n = notes.versions[0]
    assert n.measured == ["0.1.3"] and n.published == "v0.1.2-era" and "flashqla" in n.explains
    assert "g = 0" in n.note
    text = buf.getvalue()
    assert "flash-qla 0.1.3 vs published v0.1.2-era" in text
    md = (tmp_path / "out" / f"reproduce_{NAME}_bwd.md").read_text()
    assert "flash-qla 0.1.3 ≠ v0.1.2-era" in md  # in the flashqla summary row
    assert "flash-qla" in md and "caveats" in md.lower()


def test_method_differences_are_noted(tmp_path, pub_bwd):
    src = _write_rows(tmp_path / "rows", pub_bwd, n_points=2)
    _write_rows(src, pub_bwd, n_points=1, backends=["fla"], run_id="zz", timing_mode="events",
                gpu_name="NVIDIA A100", gate_zero_frac=0.0, started_at="2026-12-02T00:00:00")
    notes = R.notes_for(pub_bwd, R.measured_rows(src, "bwd"), {})
    text = " ".join(notes.method)
    assert "'events'" in text and "A100" in text and "gate_zero_frac [0.0]" in text


def test_errors_exit_2_with_a_clear_message(tmp_path, pub_bwd):
    runner = CliRunner()
    r = runner.invoke(app, ["reproduce", "nope", "--from", str(tmp_path)])
    assert r.exit_code == 2 and "unknown published set 'nope'" in r.output and NAME in r.output
    (tmp_path / "empty").mkdir()
    r = runner.invoke(app, ["reproduce", NAME, "--from", str(tmp_path / "empty"), "--out", str(tmp_path / "o")])
    assert r.exit_code == 2 and "no result rows" in r.output
    r = runner.invoke(app, ["reproduce", NAME, "--from", str(tmp_path / "absent")])
    assert r.exit_code == 2 and "no such file" in r.output
    src = _write_rows(tmp_path / "rows", pub_bwd, n_points=1)
    r = runner.invoke(app, ["reproduce", NAME, "--direction", "fwd", "--from", str(src)])
    assert r.exit_code == 2 and "no fwd rows" in r.output and "bwd" in r.output
    r = runner.invoke(app, ["reproduce", NAME, "--direction", "up", "--from", str(src)])
    assert r.exit_code == 2 and "--direction" in r.output
    r = runner.invoke(app, ["reproduce", NAME, "--direction", "bwd", "--from", str(src),
                            "--out", str(tmp_path / "o")])
    assert r.exit_code == 0, r.output
    # a --baseline without rows: the message lists only what reproduce takes (no best-library)
    r = runner.invoke(app, ["reproduce", NAME, "--direction", "bwd", "--from", str(src),
                            "--out", str(tmp_path / "o"), "--baseline", "nope"])
    msg = " ".join(r.output.split())
    assert r.exit_code == 2 and "--baseline 'nope'" in msg and "fla, flashqla" in msg
    assert "best-library" not in msg


def test_reproduce_only_reads_rows(tmp_path, pub_fwd):
    """Without --from nothing is measured: exit 2 naming the sweep to run. Rows that could not be
    measured (all `unavailable`) are reported as such, exit 0."""
    r = CliRunner().invoke(app, ["reproduce", NAME, "--out", str(tmp_path / "o")])
    assert r.exit_code == 2 and "--from" in r.output
    assert "qlabench run configs/h200_fwd.yaml" in " ".join(r.output.split())
    assert not (tmp_path / "o").exists()
    src = _write_rows(tmp_path / "rows", pub_fwd, n_points=2, statuses={
        b: ("unavailable", "no CUDA device (test)") for b in pub_fwd.backends})
    con, buf = _console()
    assert R.reproduce_cmd(NAME, "fwd", src, tmp_path / "out", console=con) == 0
    t = pd.read_csv(tmp_path / "out" / f"reproduce_{NAME}_fwd.csv")
    assert (t["fla_status"].iloc[:2] == "unavailable").all() and t["speedup_ms"].isna().all()
    assert (tmp_path / "out" / f"reproduce_{NAME}_fwd.png").stat().st_size > 0
    text = buf.getvalue()
    assert "unavailable" in text and "no backend measured any point" in text


def test_rows_of_other_gate_recipes_are_not_joined(tmp_path, pub_bwd):
    """The published table is the published recipe: a strong-decay row of the same shape, newer,
    must not replace it."""
    d = _write_rows(tmp_path / "rows", pub_bwd)
    _write_rows(d, pub_bwd, factors={"fla": 3.0}, run_id="20261201T010000-bbbbbb",
                started_at="2026-12-01T01:00:00", gate_recipe="strong-decay:floor=1e-06/seed0")
    df = results.load(d)
    strong = df["run_id"] == "20261201T010000-bbbbbb"
    df.loc[strong, "point_key"] = df.loc[strong, "point_key"] + "|gate=strong-decay"
    for f in (d / "parts").glob("*.parquet"):
        f.unlink()
    results._write_rows_file(d / "parts", "rows", df)
    t = R.side_by_side(pub_bwd, R.measured_rows(d, "bwd"))
    assert np.allclose(t["fla_ratio"], 1.0)
