"""A run's fixed cost: the worker starts (and imports its backends) before the parent checks
them, and the phases come out of the run's timeline."""

import json

from qlabench import config as C
from qlabench import runner

SWEEP = {"name": "fc", "models": [{"name": "m", "h_qk": 1, "h_v": 2, "head_dim": 8}],
         "seqlens": [[5], [9]], "directions": ["fwd"], "backends": ["reference"],
         "reference": {"impl": "chunked", "dtype": "fp64"},
         "timing": {"min_samples": 3, "max_samples": 5, "budget_s": 0.05}}


def test_the_worker_starts_first_and_warms_its_backends(tmp_path):
    s = runner.run(C.parse(SWEEP), tmp_path / "r", log=lambda *a, **k: None, isolate=True)
    assert s.counts == {"ok": 2}
    meta = json.loads(next((tmp_path / "r" / "_runs").glob("*.json")).read_text())
    tl = meta["timeline_s"]
    assert tl["worker_started"] <= tl["backends_checked"] <= tl["first_row"] <= tl["last_row"]
    log = next((tmp_path / "r" / "_logs").glob("worker-*.log")).read_text()
    assert log.index("--- warm reference") < log.index("--- task")
    fc = runner.fixed_cost(tl)
    assert set(fc) == {"start", "checks", "ceilings", "to_first_row", "first_row_compile", "total"}
    assert abs(fc["total"] - (fc["start"] + fc["checks"] + fc["ceilings"] + fc["to_first_row"])) < 0.05
    assert fc["first_row_compile"] == round(tl["first_row_compile_s"], 2)


def test_fixed_cost_phases_from_a_timeline():
    tl = {"process_start": -4.0, "worker_started": 0.01, "backends_checked": 15.0,
          "ceilings_measured": 15.5, "first_row": 30.0, "first_row_compile_s": 6.0}
    assert runner.fixed_cost(tl) == {"start": 4.0, "checks": 15.0, "ceilings": 0.5,
                                     "to_first_row": 8.5, "first_row_compile": 6.0, "total": 28.0}
    assert runner.fixed_cost({"process_start": -1.0}) == {}


def test_a_run_of_no_points_starts_no_worker(tmp_path):
    sw = C.parse(SWEEP)
    runner.run(sw, tmp_path / "r", log=lambda *a, **k: None, isolate=True)
    n_logs = len(list((tmp_path / "r" / "_logs").glob("worker-*.log")))
    s = runner.run(sw, tmp_path / "r", log=lambda *a, **k: None, isolate=True, limit=0)
    assert s.counts == {} and len(list((tmp_path / "r" / "_logs").glob("worker-*.log"))) == n_logs
