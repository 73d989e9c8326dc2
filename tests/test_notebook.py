"""notebooks/analysis.ipynb executes headless (nbclient, kernel python3) on a synthetic run and on
rows cut from the kept backward sweep (tests/fixtures/results/h200_bwd)."""

import shutil
from pathlib import Path

import pytest
import synth_results as S

ROOT = Path(__file__).resolve().parents[1]
NB = ROOT / "notebooks" / "analysis.ipynb"

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel", reason="ipykernel missing: cannot start a python3 kernel")


def _execute(tmp_path: Path, results_dir: Path, monkeypatch) -> tuple[str, int]:
    """Run a temp copy of the notebook with QLABENCH_RESULTS=results_dir; (all text output,
    number of PNG outputs). nbclient raises CellExecutionError on any cell error."""
    nb_path = tmp_path / "analysis.ipynb"
    shutil.copy(NB, nb_path)
    monkeypatch.setenv("QLABENCH_RESULTS", str(results_dir))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = nbformat.read(nb_path, as_version=4)
    nbclient.NotebookClient(nb, timeout=360, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    text, pngs = [], 0
    for c in nb.cells:
        for o in c.get("outputs", []):
            assert o.get("output_type") != "error", o
            text.append(o.get("text", ""))
            data = o.get("data", {})
            text.append(data.get("text/plain", ""))
            text.append(data.get("text/markdown", ""))
            pngs += "image/png" in data
    return "\n".join(text), pngs


def test_notebook_draws_figures_for_a_tiny_run(tmp_path, monkeypatch):
    res = tmp_path / "results"
    run = S.write_run(res / "h200_fwd", models=S.MODELS[:1], layouts=S.LAYOUTS[:2],
                      directions=("fwd", "bwd"), n_samples=20)
    S.copy_scaled(run, run, {"fla": 1.1})  # a second run: the history section draws
    text, pngs = _execute(tmp_path, res, monkeypatch)
    assert "h200_fwd: 24 rows, 2 run(s)" in text
    # latency fwd/bwd, speedup fwd/bwd, bwd latency vs tokens, history
    assert pngs >= 6, text  # latency, speedup, roofline, SM util, backward, history ...
    assert "slower" in text


def test_notebook_on_committed_results(tmp_path, monkeypatch):
    """CI's run on real rows: measured H200 rows cut from the kept backward sweep
    (tests/fixtures/results/h200_bwd: 4 head configs x 2 layouts, several runs, so the history
    section draws too), or an empty folder when it is not there (the notebook says so).
    The notebook's code is the same for every run directory; one keeps this test near 30 s."""
    src = ROOT / "tests" / "fixtures" / "results" / "h200_bwd"
    res = tmp_path / "results"
    if any(src.glob("parts/*.parquet")):
        shutil.copytree(src, res / "h200_bwd")
        from qlabench import results as R

        df = R.load(res / "h200_bwd")
        text, pngs = _execute(tmp_path, res, monkeypatch)
        assert f"h200_bwd: {len(df)} rows, {df['run_id'].nunique()} run(s)" in text, text
        assert df["run_id"].nunique() >= 2 and pngs >= 6, (pngs, text)  # the run's figures and its history
        assert "no FLA baseline rows" not in text
    else:
        (res / "empty_run" / "parts").mkdir(parents=True)
        text, pngs = _execute(tmp_path, res, monkeypatch)
        assert pngs == 0 and ("no result rows under" in text or "nothing to plot" in text), text
