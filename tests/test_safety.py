"""Kept runs are written only on purpose: default outputs under runs/, a run with no runnable
backend writes nothing into a directory holding rows, submit without Slurm fails, merge --out."""

from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from qlabench import config as C
from qlabench import results as R
from qlabench.cli import app

ROOT = Path(__file__).resolve().parents[1]
TINY = {"models": [{"name": "a", "h_qk": 1, "h_v": 2, "head_dim": 8}], "seqlens": [[5], [9]],
        "directions": ["fwd"], "reference": {"impl": "chunked", "dtype": "fp64"},
        "timing": {"min_samples": 2, "max_samples": 3, "budget_s": 0.05}}


def _cfg(tmp_path, out, backends, name="t"):
    p = tmp_path / f"{name}.yaml"
    p.write_text(yaml.safe_dump({**TINY, "name": name, "backends": backends, "out": str(out)}))
    return p


def _files(d: Path) -> set:
    return {p.relative_to(d) for p in d.rglob("*")} if d.exists() else set()


@pytest.mark.parametrize("f", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda f: f.name)
def test_default_outputs_are_under_runs(f):
    s = C.load(f)
    assert s.out.format(name=s.name).startswith("runs/"), f"{f.name}: out: {s.out}"


def _no_gpu():
    import torch
    if torch.cuda.is_available():
        pytest.skip("a GPU backend can run here")


def test_unrunnable_run_writes_nothing_into_a_dir_with_rows(tmp_path):
    _no_gpu()
    out = tmp_path / "kept"
    R.ResultStore(out).append({"run_id": "r0", "point_index": 0, "backend": "fla",
                               "direction": "fwd", "status": "ok", "model": "a"})
    before = _files(out)
    cfg = _cfg(tmp_path, out, ["fla", "tilelang"])
    r = CliRunner().invoke(app, ["run", str(cfg), "--no-plot"])
    assert r.exit_code == 2, r.output
    assert "no backend" in r.output and "nothing was written" in r.output and "--out" in r.output
    assert _files(out) == before
    # an explicit --out is obeyed: the unavailable rows go there, and the run says so
    r = CliRunner().invoke(app, ["run", str(cfg), "--no-plot", "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert "no backend of this run can run on this machine" in r.output
    df = R.load(out)
    assert len(df) == 1 + 4 and set(df[df.run_id != "r0"]["status"]) == {"unavailable"}


def test_unrunnable_run_into_a_fresh_default_dir_runs_and_says_so(tmp_path):
    _no_gpu()
    out = tmp_path / "fresh"
    r = CliRunner().invoke(app, ["run", str(_cfg(tmp_path, out, ["fla"])), "--no-plot"])
    assert r.exit_code == 0, r.output
    assert "no backend of this run can run on this machine" in r.output
    assert len(R.load(out)) == 2


def test_a_runnable_backend_writes_into_the_default_dir(tmp_path):
    """configs/smoke.yaml's case on a CPU machine: the reference runs, so a default output that
    already holds rows is written to (a resume of the smoke sweep works)."""
    out = tmp_path / "smoke"
    cfg = _cfg(tmp_path, out, ["reference", "fla"])
    assert CliRunner().invoke(app, ["run", str(cfg), "--no-plot"]).exit_code == 0
    r = CliRunner().invoke(app, ["run", str(cfg), "--no-plot"])
    assert r.exit_code == 0, r.output
    assert "no backend of this run" not in r.output
    assert (R.load(out)["backend"] == "reference").sum() == 4


def test_submit_without_slurm_fails_unless_local(tmp_path, monkeypatch):
    pytest.importorskip("submitit")
    from qlabench import cluster
    monkeypatch.setattr(cluster.shutil, "which", lambda name: None)
    cfg = _cfg(tmp_path, tmp_path / "unused", ["reference"])
    out = tmp_path / "out"
    r = CliRunner().invoke(app, ["submit", str(cfg), "--shards", "2", "--out", str(out)])
    assert r.exit_code == 2, r.output
    assert "Slurm is not available" in r.output and "--executor local" in r.output
    assert "submitted 2 jobs" not in r.output and not R.holds_rows(out)
    r = CliRunner().invoke(app, ["submit", str(cfg), "--shards", "2", "--executor", "local",
                                 "--out", str(out), "--timeout-min", "5"])
    assert r.exit_code == 0, r.output
    assert "submitted 2 jobs (local)" in r.output
    assert len(R.load(out)) == 2 and (out / R.SHARDS_DIR / "shard-0" / "parts").is_dir()
    import pandas as pd
    assert len(pd.read_parquet(out)) == 2  # shards and submitit files sit under _ names


def test_merge_takes_out_as_an_option_and_refuses_a_dir_with_rows(tmp_path):
    from synth_results import write_run
    a, b = tmp_path / "a", tmp_path / "b"
    write_run(a)
    write_run(b, run_id="20250102T000000-bbbbbb", started_at="2025-01-02T00:00:00")
    kept = _files(a)
    # the old form `merge OUT IN...` is now all inputs and no --out: refused, nothing written
    r = CliRunner().invoke(app, ["merge", str(a), str(b)])
    assert r.exit_code == 2 and "--out" in r.output
    assert _files(a) == kept
    m = tmp_path / "m"
    r = CliRunner().invoke(app, ["merge", "--out", str(m), str(a), str(b)])
    assert r.exit_code == 0, r.output
    n = len(R.load(m))
    r = CliRunner().invoke(app, ["merge", "--out", str(a), str(b)])
    assert r.exit_code == 2 and "already holds" in r.output and "--force" in r.output
    assert _files(a) == kept
    r = CliRunner().invoke(app, ["merge", "--out", str(m), "--force", str(b)])
    assert r.exit_code == 0, r.output
    assert len(R.load(m)) == n
    (tmp_path / "empty" / "parts").mkdir(parents=True)
    assert CliRunner().invoke(app, ["merge", "--out", str(tmp_path / "empty"), str(a)]).exit_code == 0
