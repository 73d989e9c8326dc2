import re
from collections import Counter
from pathlib import Path
from urllib.parse import unquote

import pytest
import synth_results as S
from typer.testing import CliRunner

from qlabench import analysis, plots, report, results
from qlabench.cli import app

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """Three runs of one config (fwd + bwd; tilelang unavailable): the second makes FLA 10%
    slower, the third makes FlashQLA 10% slower; report rendered once."""
    tmp = tmp_path_factory.mktemp("rep")
    res = S.write_run(tmp / "results" / "synth", directions=("fwd", "bwd"),
                      status={"tilelang": "unavailable"})
    S.copy_scaled(res, res, {"fla": 1.10}, run_id="20250102T000000-bbbbbb",
                  started_at="2025-01-02T00:00:00", git_sha="def456")
    S.copy_scaled(res, res, {"flashqla": 1.10}, run_id="20250103T000000-cccccc",
                  started_at="2025-01-03T00:00:00", git_sha="987fff")
    out = tmp / "site"
    rc = report.report_cmd([res], out)
    assert rc == 0
    return out


def _links(page: str, attr: str) -> list[str]:
    return [unquote(u) for u in re.findall(rf'{attr}="([^"#]+)"', page)]


def test_page_has_figures_history_env_and_parquet_links(site):
    page = (site / "index.html").read_text()
    imgs = _links(page, "src")
    names = {Path(i).name for i in imgs}
    assert {"winner_fwd.png", "winner_bwd.png", "speedup_fwd.png", "speedup_bwd.png",
            "latency_fwd.png", "latency_bwd.png", "latency_vs_tokens_bwd.png",
            "history_libraries.png"} <= names
    assert "history_in_repo.png" not in names  # tilelang has no ok rows here: no kernel history
    for i in imgs:  # every image is beside the page and is a real PNG
        p = site / i
        assert p.is_file() and p.read_bytes()[:4] == b"\x89PNG" and p.stat().st_size > 5000, i
    hrefs = _links(page, "href")
    parts = [h for h in hrefs if h.endswith(".parquet")]
    assert len(parts) == 3 * 48  # every part of every run, linked relatively
    assert all(not h.startswith("/") and (site / h).is_file() for h in parts)
    assert any(h.endswith(".json") and (site / h).is_file() for h in hrefs)
    # history: the FLA step (run 2) and the FlashQLA step (run 3) are the library regressions
    assert "32 regression(s)</h4>" in page  # FLA's step (run 2) and FlashQLA's (run 3), fwd + bwd
    assert "latest run has 16 library regression(s) (flashqla)" in page
    assert "In-repo kernel history" not in page
    # the winner per point: flashqla (0.7x FLA) everywhere, 10% slower in the latest run
    assert "fwd: winner per point" in page and "bwd: winner per point" in page
    assert "8 of 8 points have a winner (flashqla 8)" in page
    assert "no incorrect backend at any point" in page
    assert "synth-host" in page and "580.00" in page  # environment from runs/*.json
    assert "unavailable" in page


def test_single_run_has_no_history(tmp_path):
    res = S.write_run(tmp_path / "one")
    assert report.report_cmd([res], tmp_path / "site") == 0
    page = (tmp_path / "site" / "index.html").read_text()
    assert "Library regressions" not in page and "In-repo kernel history" not in page
    assert "latency_fwd.png" in page and "winner_fwd.png" in page


def test_bad_inputs_exit_2(tmp_path):
    (tmp_path / "empty" / "parts").mkdir(parents=True)
    r = CliRunner().invoke(app, ["report", str(tmp_path / "missing"), "--out", str(tmp_path / "s")])
    assert r.exit_code == 2 and "missing" in r.output and "Traceback" not in r.output
    assert report.report_cmd([tmp_path / "empty"], tmp_path / "s") == 2


def test_in_repo_kernel_history_is_apart_from_library_regressions(tmp_path):
    """tilelang (the in-repo kernels) 10% slower in the latest run: its own section, no alarm;
    FLA unchanged: the banner says no library regression."""
    res = S.write_run(tmp_path / "results" / "k")
    S.copy_scaled(res, res, {"tilelang": 1.10}, run_id="20250102T000000-bbbbbb",
                  started_at="2025-01-02T00:00:00", git_sha="def456")
    assert report.report_cmd([res], tmp_path / "site") == 0
    page = (tmp_path / "site" / "index.html").read_text()
    assert "In-repo kernel history (tilelang)" in page and "8 slower step(s)" in page
    assert "Library regressions (fla, flashqla)" in page
    assert "no regression(s) between consecutive measurements" in page
    assert "banner bad" not in page and "no library regression" in page
    assert "history_in_repo.png" in page and "history_libraries.png" in page


def test_winner_table_counts_incorrect_backends(tmp_path):
    res = S.write_run(tmp_path / "r", status={"tilelang": "incorrect"})
    lat = results.latest(results.load(res))
    lat.loc[lat["backend"] == "flashqla", "max_rel_l2"] = 3e-3
    w = analysis.Analysis(lat).points("fwd")
    assert len(w) == 8 and set(w["winner"]) == {"flashqla"} and set(w["runner_up"]) == {"fla"}
    assert (w["n_incorrect"] == 1).all() and (w["n_ok"] == 2).all()
    assert w["margin"].between(1 / 0.7 - 0.05, 1 / 0.7 + 0.05).all()
    assert (w["winner_max_rel_l2"] == 3e-3).all() and not w["tie"].any()
    assert report.report_cmd([res], tmp_path / "site") == 0
    page = (tmp_path / "site" / "index.html").read_text()
    assert "8 point(s) with an incorrect backend" in page


def test_each_section_is_analysed_once(tmp_path, monkeypatch):
    """A report's cost follows its rows, not the number of tables and figures showing them: per
    results directory the rows are read once, the speedups over the baseline computed once and
    each direction's point table (winners and Mann–Whitney ties) once, shared by the winner
    table, the winner map, the speedup figure, the latest-rows table and the geomean lines."""
    a = S.write_run(tmp_path / "results" / "a", directions=("fwd", "bwd"))
    S.copy_scaled(a, a, {"fla": 1.10})  # a second run: the history is drawn too
    b = S.write_run(tmp_path / "results" / "b", run_id="20250105T000000-dddddd")  # forward only
    calls = Counter()

    def count(module, name):
        f = getattr(module, name)

        def counted(*args, **kwargs):
            calls[name] += 1
            return f(*args, **kwargs)
        monkeypatch.setattr(module, name, counted)

    count(results, "read_rows")
    count(analysis, "speedups")
    count(analysis, "point_table")
    assert report.report_cmd([a, b], tmp_path / "site") == 0
    page = (tmp_path / "site" / "index.html").read_text()
    assert "winner_fwd.png" in page and "winner_bwd.png" in page and "speedup_fwd.png" in page
    assert "Library regressions" in page
    assert calls == {"read_rows": 2, "speedups": 2, "point_table": 3}  # a: fwd, bwd; b: fwd


def _fixtures():
    return sorted(p for p in (ROOT / "tests" / "fixtures" / "results").glob("*")
                  if (p / "parts").is_dir())


@pytest.mark.parametrize("res", _fixtures(), ids=lambda p: p.name)
def test_kept_runs_have_figures(res, tmp_path):
    df = results.latest(results.load(res))
    ok = df[df["status"] == "ok"]
    made = plots.run_figures(df, tmp_path)
    assert bool(made) == bool(len(ok)), (res, made)
