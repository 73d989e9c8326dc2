"""The baseline of every speedup is a parameter (``--baseline LABEL``, default ``fla``): a
non-FLA label gives its own ratios in every view's computation (:mod:`qlabench.analysis`), and
a label without rows exits 2 with one error line naming it and the labels present."""

from __future__ import annotations

import pytest
import synth_results as S
from typer.testing import CliRunner

from qlabench import analysis, plots, report, reproduce, results, summary
from qlabench.cli import app

ONE = dict(models=[("2B TP1", 16, 16)], layouts=[[4096]], n_samples=9, noise=0.0)


@pytest.fixture
def d(tmp_path):
    # noise 0: every label's latency is exactly its synthetic factor (fla 1.0, flashqla 0.7,
    # tilelang 0.8) times the point's base
    return S.write_run(tmp_path / "r", **ONE)


def _ms(b: str) -> float:
    return S.base_latency_ms(16, [4096], b)


def test_a_non_fla_baseline_gives_its_ratios(d, tmp_path):
    lat = analysis.load_newest(d)
    want = {"fla": _ms("tilelang") / _ms("fla"), "flashqla": _ms("tilelang") / _ms("flashqla")}
    assert want["fla"] == pytest.approx(0.8) and want["flashqla"] == pytest.approx(0.8 / 0.7)

    sp = analysis.speedups(lat, "tilelang")
    got = dict(zip(lat.loc[sp.index, "backend"], sp["speedup"]))
    assert got == pytest.approx(want)
    assert set(sp["pairing"]) == {"cross-GPU, cross-campaign"}  # synthetic rows: no gpu_uuid

    table = plots.speedup_table(lat, "tilelang", "fwd")
    assert dict(zip(table["backend"], table["speedup"])) == pytest.approx(want)

    pt = analysis.point_table(lat, "tilelang").iloc[0]
    assert pt["winner"] == "flashqla" and pt["baseline"] == "tilelang"
    assert pt["speedup"] == pytest.approx(want["flashqla"])

    vs = report.vs_baseline(lat, "tilelang").set_index("backend")["speedup"]
    assert vs["fla"] == pytest.approx(want["fla"]) and vs["flashqla"] == pytest.approx(want["flashqla"])
    assert vs.isna()["tilelang"]  # the baseline's own row has no ratio

    assert analysis.speedup(_ms("tilelang"), _ms("fla")) == pytest.approx(0.8)
    assert analysis.speedup(None, 1.0) != analysis.speedup(None, 1.0)  # NaN without a value

    # the dashboard over the same rows, speedups over tilelang
    index = report.build([d], tmp_path / "site", baseline="tilelang")
    page = index.read_text()
    assert "speedup vs tilelang" in page and "geomean 0.80× tilelang" in page
    assert "speedup vs fla" not in page


def test_the_default_baseline_is_fla(d):
    lat = analysis.load_newest(d)
    assert summary.point_table(lat).iloc[0]["speedup"] == pytest.approx(1 / 0.7)
    assert report.vs_baseline(lat, "fla").set_index("backend")["speedup"]["tilelang"] == pytest.approx(1 / 0.8)


def test_require_baseline_names_the_labels(d):
    lat = results.load(d, latest=True)
    assert analysis.require_baseline(lat, "tilelang") == "tilelang"
    with pytest.raises(analysis.UnknownBaseline) as e:
        analysis.require_baseline(lat, "nope")
    assert str(e.value) == "--baseline 'nope': no rows of that label; labels present: fla, flashqla, tilelang (or best-library)"


@pytest.mark.parametrize("view", ["summary", "report", "reproduce"])
def test_an_unknown_baseline_exits_2(d, tmp_path, view):
    args = {"summary": ["summary", str(d)],
            "report": ["report", str(d), "--out", str(tmp_path / "site")],
            "reproduce": ["reproduce", "flashqla-h200", "--direction", "fwd", "--from", str(d),
                          "--out", str(tmp_path / "rep")]}[view]
    r = CliRunner().invoke(app, [*args, "--baseline", "nope"])
    assert r.exit_code == 2, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert "'nope'" in lines[0] and "labels present: fla, flashqla, tilelang" in lines[0]
    if view == "report":
        assert not (tmp_path / "site" / "index.html").exists()


def test_a_known_baseline_runs(d, tmp_path):
    r = CliRunner().invoke(app, ["summary", str(d), "--baseline", "tilelang"])
    assert r.exit_code == 0, r.stderr
    assert "× tilelang" in r.stdout and "0.80× over tilelang" in r.stdout
    # reproduce: the extra speedup of the in-repo kernel is over the label asked for
    pub = reproduce.load_published("flashqla-h200", "fwd")
    rows = reproduce.measured_rows(d, "fwd")
    t = reproduce.side_by_side(pub, rows, extra_baseline="flashqla")
    assert "tilelang_vs_flashqla" in t.columns and "tilelang_vs_fla" not in t.columns
    assert t.attrs["extra_baseline"] == "flashqla"


TWO = dict(models=[("2B TP1", 16, 16), ("27B TP2", 8, 24)], layouts=[[4096], [2048, 2048]], n_samples=9,
           noise=0.0, backends=("fla", "flashqla", "tilelang", "reference"),
           scale={"reference": 0.1})  # the reference fastest of all: not a library, never the baseline


def test_best_library_is_per_point_the_fastest_library_row(tmp_path):
    lat = analysis.load_newest(S.write_run(tmp_path / "r", **TWO))
    assert analysis.library_labels(lat) == {"fla", "flashqla"}
    assert analysis.require_baseline(lat, analysis.BEST_LIBRARY) == analysis.BEST_LIBRARY
    sp = analysis.speedups(lat, analysis.BEST_LIBRARY)
    got = dict(zip(zip(lat.loc[sp.index, "point_key"], lat.loc[sp.index, "backend"]), sp["speedup"]))
    for (_, label), v in got.items():  # flashqla (0.7) is every point's fastest library
        want = {"fla": 0.7 / 1.0, "flashqla": 1.0, "tilelang": 0.7 / 0.8, "reference": 0.7 / 0.1}[label]
        assert v == pytest.approx(want), label
    pt = analysis.point_table(lat, analysis.BEST_LIBRARY)
    assert set(pt["winner"]) == {"reference"} and pt["speedup"].to_numpy() == pytest.approx([7.0] * 4)
    assert set(pt["baseline"]) == {analysis.BEST_LIBRARY}


def test_best_library_footer_over_the_whole_run_and_no_library_exits_2(tmp_path):
    d = S.write_run(tmp_path / "r", **TWO)
    r = CliRunner().invoke(app, ["summary", str(d), "--baseline", "best-library"])
    assert r.exit_code == 0, r.output
    whole = [ln for ln in r.output.splitlines() if ln.startswith("all 2 models, fwd, 4 points")]
    assert whole and f"tilelang: {0.7 / 0.8:.2f}× over best-library (4 pts)" in " ".join(r.output.split()), r.output
    ours = S.write_run(tmp_path / "ours", **{**TWO, "backends": ("tilelang", "reference")})
    r = CliRunner().invoke(app, ["summary", str(ours), "--baseline", "best-library"])
    assert r.exit_code == 2 and "no rows of a library backend" in r.output


def test_best_library_draws_the_speedup_figure_and_reproduce_refuses_it(tmp_path):
    d = S.write_run(tmp_path / "r", **TWO)
    lat = analysis.load_newest(d)
    t = plots.speedup_table(lat, analysis.BEST_LIBRARY, "fwd")
    assert set(t["backend"]) == {"fla", "flashqla", "tilelang", "reference"}
    index = report.build([d], tmp_path / "site", baseline=analysis.BEST_LIBRARY)
    assert "speedup vs best-library" in index.read_text()
    r = CliRunner().invoke(app, ["reproduce", "flashqla-h200", "--direction", "fwd", "--from", str(d),
                                 "--out", str(tmp_path / "rep"), "--baseline", "best-library"])
    assert r.exit_code == 2 and "× best" in r.stderr
