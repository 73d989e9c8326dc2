from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

from qlabench import config as C
from qlabench import results, runner
from qlabench.cli import app

CFG = {"name": "t", "models": [{"name": "m", "h_qk": 1, "h_v": 2, "head_dim": 16}],
       "seqlens": [[17], [5, 9]], "directions": ["fwd"], "backends": ["reference"],
       "reference": {"impl": "recurrent", "dtype": "fp64"},
       "timing": {"min_samples": 2, "max_samples": 3, "budget_s": 0.1}}


def test_parquet_round_trip(tmp_path):
    s = C.parse(CFG)
    runner.run(s, tmp_path, log=lambda m: None)
    df = pd.read_parquet(tmp_path / "parts")
    assert len(df) == 2 and set(df["status"]) == {"ok"}
    r = df.sort_values("point_index").iloc[1]
    assert list(r["seqlens"]) == [5, 9] and r["num_seqs"] == 2 and r["total_tokens"] == 14
    assert len(r["samples_ms"]) == r["n_samples"] >= 2
    assert r["latency_ms"] > 0 and r["rel_l2_o"] < 1e-5 and r["rel_l2_final_state"] < 1e-5
    assert r["timing_mode"] == "cpu"
    assert list(df.columns) == results.COLUMNS
    meta = results.load_meta(tmp_path)
    assert len(meta) == 1 and next(iter(meta.values()))["env"]["torch"]
    # the run's timeline (where a run's wall time goes: start-up, the worker and its checks while
    # this process reads the ceilings, rows), in order
    tl = next(iter(meta.values()))["timeline_s"]
    assert tl.get("process_start", 0) <= 0 <= tl["worker_started"] <= tl["ceilings_measured"]
    assert tl["worker_started"] <= tl["first_ready"] <= tl["first_row"]
    assert abs(tl["first_ready"] - tl["backends_checked"]) < 0.05  # one backend: its check is all
    assert tl["first_row"] <= tl["last_row"] <= tl["finished"]
    run_id = next(iter(meta))
    runner.note_timeline(tmp_path, run_id, figures_s=1.25)
    assert results.load_meta(tmp_path)[run_id]["timeline_s"]["figures_s"] == 1.25


def test_resume_skips_done_and_adding_backend_keeps_rows(tmp_path):
    s = C.parse(CFG)
    runner.run(s, tmp_path, log=lambda m: None)
    summ = runner.run(s, tmp_path, resume=True, log=lambda m: None)
    assert summ.skipped_done == 2 and not summ.rows
    s2 = C.parse({**CFG, "backends": ["reference", "fla"]})
    summ = runner.run(s2, tmp_path, resume=True, log=lambda m: None)
    assert summ.skipped_done == 2 and {r["backend"] for r in summ.rows} == {"fla"}
    df = results.load(tmp_path)
    assert len(df) == 4 and not df.duplicated(["point_key", "backend", "direction"]).any()


def test_unavailable_rows_are_retried_on_resume(tmp_path, monkeypatch):
    from qlabench.backends.reference import ReferenceBackend

    s = C.parse({**CFG, "isolate": False})  # the patched availability lives in this process
    monkeypatch.setattr(ReferenceBackend, "available", lambda self: (False, "library not here"))
    first = runner.run(s, tmp_path, log=lambda m: None)
    assert [r["status"] for r in first.rows] == ["unavailable"] * 2
    again = runner.run(s, tmp_path, resume=True, log=lambda m: None)
    assert again.skipped_done == 0 and len(again.rows) == 2
    assert all(r["status"] == "unavailable" and r["reason"] == "library not here"
               for r in again.rows)
    monkeypatch.undo()  # the library is there now: the resume measures both points
    last = runner.run(s, tmp_path, resume=True, log=lambda m: None)
    assert last.skipped_done == 0 and [r["status"] for r in last.rows] == ["ok"] * 2
    assert set(results.latest(results.load(tmp_path))["status"]) == {"ok"}


def test_resume_does_not_measure_incorrect_rows_again(tmp_path, monkeypatch):
    """An `incorrect` row is a finished result: a --resume (with --retry-failed too) keeps it,
    even where the backend would now pass."""
    from qlabench.backends.reference import ReferenceBackend

    orig = ReferenceBackend.outputs_to_canonical

    def wrong(self, raw, x, d):
        out = orig(self, raw, x, d)
        out["o"] = out["o"] * 1.1
        return out

    s = C.parse({**CFG, "isolate": False})  # the patched backend lives in this process
    monkeypatch.setattr(ReferenceBackend, "outputs_to_canonical", wrong)
    first = runner.run(s, tmp_path, log=lambda m: None)
    assert [r["status"] for r in first.rows] == ["incorrect"] * 2
    monkeypatch.undo()  # the backend passes now
    for retry_failed in (False, True):
        again = runner.run(s, tmp_path, resume=True, retry_failed=retry_failed, log=lambda m: None)
        assert again.skipped_done == 2 and not again.rows
    assert list(results.latest(results.load(tmp_path))["status"]) == ["incorrect"] * 2


def test_resume_measures_rows_of_another_backend_version_again(tmp_path):
    """The resume key holds the backend version: rows stored under another version of the
    label are measured again, the run's own are not."""
    from synth_results import restamp

    s = C.parse({**CFG, "isolate": False})
    runner.run(s, tmp_path, log=lambda m: None)
    restamp(tmp_path, backend_version="0.0-older")
    again = runner.run(s, tmp_path, resume=True, log=lambda m: None)
    assert again.skipped_done == 0 and [r["status"] for r in again.rows] == ["ok"] * 2
    assert all(r["backend_version"] != "0.0-older" for r in again.rows)
    last = runner.run(s, tmp_path, resume=True, log=lambda m: None)
    assert last.skipped_done == 2 and not last.rows


def test_resume_refuses_changed_recipe(tmp_path):
    runner.run(C.parse(CFG), tmp_path, log=lambda m: None)
    changed = C.parse({**CFG, "gate": {"zero_frac": 0.5, "seed": 0}})
    with pytest.raises(runner.RecipeMismatch):
        runner.run(changed, tmp_path, resume=True, log=lambda m: None)


def test_incorrect_backend_gets_no_latency(tmp_path, monkeypatch):
    from qlabench.backends.reference import ReferenceBackend

    orig = ReferenceBackend.outputs_to_canonical

    def wrong(self, raw, x, d):
        out = orig(self, raw, x, d)
        out["o"] = out["o"] * 1.1
        return out

    monkeypatch.setattr(ReferenceBackend, "outputs_to_canonical", wrong)
    runner.run(C.parse({**CFG, "isolate": False}), tmp_path, log=lambda m: None)  # patch lives here
    df = results.load(tmp_path)
    assert set(df["status"]) == {"incorrect"} and df["latency_ms"].isna().all()
    assert df["reason"].str.contains("o rel_l2").all()


ROOT = Path(__file__).resolve().parents[1]


def test_cli_smoke_writes_rows_and_png(tmp_path):
    r = CliRunner().invoke(app, ["run", str(ROOT / "configs/smoke.yaml"), "--out", str(tmp_path),
                                 "--limit", "2"])
    assert r.exit_code == 0, r.output
    df = results.load(tmp_path)
    ok = df[df["status"] == "ok"]
    assert len(ok) >= 4 and ok["latency_ms"].notna().all() and ok["max_rel_l2"].notna().all()
    assert (tmp_path / "_figures" / "latency_fwd.png").stat().st_size > 10_000


def test_cli_gpu_sweep_on_cpu_gives_unavailable_rows(tmp_path):
    import torch
    if torch.cuda.is_available():
        pytest.skip("has a GPU")
    r = CliRunner().invoke(app, ["run", str(ROOT / "configs/h200_fwd.yaml"), "--out",
                                 str(tmp_path), "--limit", "2"])
    assert r.exit_code == 0, r.output
    df = results.load(tmp_path)
    labels = list(C.load(ROOT / "configs/h200_fwd.yaml").entries())
    assert len(df) == 2 * len(labels) and set(df["status"]) == {"unavailable"}
    assert sorted(set(df["backend"])) == sorted(labels)
    assert df["reason"].str.len().gt(10).all()
    assert "Traceback" not in r.output


def test_dry_run_writes_nothing(tmp_path):
    r = CliRunner().invoke(app, ["run", str(ROOT / "configs/smoke.yaml"), "--out",
                                 str(tmp_path / "o"), "--dry-run"])
    assert r.exit_code == 0 and not (tmp_path / "o").exists()


def test_compact_keeps_every_row_and_resume_keys(tmp_path):
    """`qlabench compact`: many one-row parts -> one file; same rows, same done keys, same latest()."""
    from synth_results import write_run

    from qlabench import results as R

    d = tmp_path / "run"
    write_run(d)
    before = R.load(d)
    keys = R.ResultStore(d).done_keys()
    n_files = len(list((d / "parts").glob("*.parquet")))
    assert n_files > 2
    c = R.compact(d)
    files = list((d / "parts").glob("*.parquet"))
    assert len(files) == 1 and c["rows"] == len(before) == n_files
    after = R.load(d)
    cols = ["point_key", "backend", "direction", "latency_ms", "status"]
    key = ["point_key", "backend", "direction", "started_at"]
    assert before.sort_values(key)[cols].reset_index(drop=True).equals(after.sort_values(key)[cols].reset_index(drop=True))
    assert R.ResultStore(d).done_keys() == keys
    assert len(R.latest(after)) == len(R.latest(before))
    assert R.compact(d)["rows"] == 0  # nothing left to fold


def test_merge_reads_compacted_dirs(tmp_path):
    """merge works on compacted inputs (it used to copy part files by name and copied none), and
    merging again writes nothing twice."""
    from synth_results import write_run

    from qlabench import results as R

    a = tmp_path / "a"
    write_run(a)
    n = len(R.latest(R.load(a)))
    R.compact(a)
    c = R.merge(tmp_path / "m", [a])
    assert c["copied"] == n and len(R.latest(R.load(tmp_path / "m"))) == n
    assert R.merge(tmp_path / "m", [a], force=True)["copied"] == 0
    assert len(R.load(tmp_path / "m")) == n
