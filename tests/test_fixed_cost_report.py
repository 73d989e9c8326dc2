"""qlabench_tools.fixed_cost_report (tools/fixed_cost_report.py): a run's fixed cost by phase from its ``timeline_s``, in the
layout with one worker per backend label (``worker_timeline_s`` per label, ``first_ready``), in
the one where one worker reports the checks (``worker_timeline_s``, ``worker_warm_s``), in the
one before it (``worker_started``, ``first_row_compile_s``: checks in the run's process) and in
the old one (7a7503c: no first-row compile in the timeline; it comes from the row that started
first); ``-X importtime`` lines in a run's logs summed per package."""

import csv
import json
from pathlib import Path

import pytest

from qlabench import results as R

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def rep():
    from qlabench_tools import fixed_cost_report

    return fixed_cost_report


def _run_dir(d: Path, run_id: str, tl: dict, rows=(), shell=None, worker_log=None, **meta) -> Path:
    store = R.ResultStore(d)
    store.write_meta(run_id, {"run_id": run_id, "git_sha": "unknown", "timeline_s": tl,
                              "counts": {"ok": len(rows)}, **meta})
    for i, (backend, started, compile_s) in enumerate(rows):
        store.append({"run_id": run_id, "point_index": i // 3, "backend": backend,
                      "direction": "fwd", "status": "ok", "model": "m", "started_at": started,
                      "compile_s": compile_s})
    if shell is not None:
        (d / "shell.json").write_text(json.dumps(shell))
    if worker_log is not None:
        (d / "_logs").mkdir(parents=True, exist_ok=True)
        (d / "_logs" / "worker-1-1.log").write_text(worker_log)
    return d


# the old commit's keys (7a7503c's campaign run: 35 s to backends_checked, 0.3 s ceilings, +23 s)
OLD_TL = {"process_start": -6.0, "backends_checked": 35.25, "ceilings_measured": 35.5,
          "first_row": 58.0, "last_row": 900.0, "finished": 902.0, "figures_s": 4.0}
# rows in file (point, backend) order; the one that started first is the second file's
OLD_ROWS = [("fla", "2026-12-01T14:18:51.000", 1.0),
            ("flashqla", "2026-12-01T14:18:40.250", 12.5),
            ("tilelang", "2026-12-01T14:18:52.000", 3.0)]
NEW_TL = {"process_start": -4.0, "worker_started": 0.01, "backends_checked": 3.0,
          "ceilings_measured": 3.5, "first_row": 12.0, "first_row_compile_s": 2.5,
          "last_row": 40.0, "finished": 41.0, "figures_s": 2.0}
NEW_ROWS = [("fla", "2026-12-02T10:00:05.000", 7.0), ("flashqla", "2026-12-02T10:00:06.000", 0.1)]
WARM_LOG = ("--- worker 7: python, sys.path []\n--- warm fla: 1.5 s\n--- warm flashqla: 2.25 s\n"
            "--- warm tilelang: 0.5 s\n--- task 1x32768 fwd ['fla']\n")


def test_old_layout_takes_the_first_rows_compile_from_the_rows(rep, tmp_path):
    d = _run_dir(tmp_path / "01_old", "20261201T141756-aaaaaa", OLD_TL, OLD_ROWS,
                 shell={"label": "01_old", "commit": "7a7503c1d757", "wall_s": 70.5, "rc": 0})
    (r,) = rep.report_dir(d, 10.0)
    assert r["layout"] == "old" and r["compile_from"] == "rows"
    assert r["first_row_backend"] == "flashqla" and r["first_row_compile"] == 12.5
    assert (r["start"], r["checks"], r["ceilings"], r["to_first_row"]) == (6.0, 35.25, 0.25, 10.0)
    assert r["total"] == 51.5 and r["within_limit"] is False
    assert r["process_s"] == 6.0 + 902.0 + 4.0 and r["shell_wall_s"] == 70.5
    assert r["commit"] == "7a7503c1d757" and r["label"] == "01_old" and r["warm_s"] is None


def test_old_layout_without_rows_counts_no_compile(rep, tmp_path):
    d = _run_dir(tmp_path / "r", "20261201T141756-bbbbbb", OLD_TL)
    (r,) = rep.report_dir(d, 10.0)
    assert r["compile_from"] == "missing" and r["first_row_compile"] == 0.0
    assert r["to_first_row"] == 22.5 and r["total"] == 64.0


def test_new_layout_uses_the_timelines_own_compile_and_the_workers_imports(rep, tmp_path):
    d = _run_dir(tmp_path / "02_new", "20261202T100000-cccccc", NEW_TL, NEW_ROWS,
                 shell={"label": "02_new", "commit": "6fa4683abcde", "wall_s": 49.0, "rc": 0},
                 worker_log=WARM_LOG, ceilings_source="cache")
    (r,) = rep.report_dir(d, 10.0)
    assert r["layout"] == "new" and r["compile_from"] == "timeline"
    # the timeline's first_row_compile_s wins over the rows' compile_s
    assert r["first_row_compile"] == 2.5
    assert (r["start"], r["checks"], r["ceilings"], r["to_first_row"]) == (4.0, 3.0, 0.5, 6.0)
    assert r["total"] == 13.5 and r["within_limit"] is False
    assert rep.report_dir(d, 14.0)[0]["within_limit"] is True
    assert r["warm_s"] == 4.25 and r["worker_started"] == 0.01 and r["ceilings_source"] == "cache"
    assert r["process_s"] == 47.0


def test_the_report_writes_a_csv_row_per_run(rep, tmp_path, capsys):
    old = _run_dir(tmp_path / "01_old", "20261201T141756-aaaaaa", OLD_TL, OLD_ROWS,
                   shell={"label": "01_old", "commit": "old", "wall_s": 70.5, "rc": 0})
    new = _run_dir(tmp_path / "02_new", "20261202T100000-cccccc", NEW_TL, NEW_ROWS,
                   shell={"label": "02_new", "commit": "new", "wall_s": 49.0, "rc": 0})
    empty = tmp_path / "03_old"
    empty.mkdir()
    (empty / "shell.json").write_text(json.dumps({"label": "03_old", "commit": "old", "wall_s": 1.0,
                                                  "rc": 1}))
    assert rep.main([str(old), str(new), str(empty), "--csv", str(tmp_path / "fc.csv")]) == 0
    got = list(csv.DictReader(open(tmp_path / "fc.csv")))
    assert [g["label"] for g in got] == ["01_old", "02_new", "03_old"]
    assert [g["total"] for g in got] == ["51.5", "13.5", ""]
    text = capsys.readouterr().out
    assert "03_old: no first row recorded (rc 1)" in text
    assert "commit old: fixed cost 51.50 s" in text and "commit new: fixed cost 13.50 s" in text


# the worker checks its backends (worker_timeline_s, worker_warm_s): the ceilings come during them
WORKER_TL = {"process_start": -0.6, "worker_started": 0.02, "ceilings_measured": 2.0,
             "worker_ready": 9.5, "backends_checked": 9.5, "first_row": 12.0,
             "first_row_compile_s": 0.5, "last_row": 30.0, "finished": 30.5}
WORKER_META = {"worker_timeline_s": {"process_start": 0.12, "started": 0.3, "imported": 2.6,
                                     "cuda": 3.1, "warmed": 9.45},
               "worker_warm_s": {"fla": 4.5, "flashqla": 1.75, "tilelang": 0.1}}


def test_worker_layout_splits_the_checks_into_the_workers_start_up(rep, tmp_path):
    d = _run_dir(tmp_path / "02_new", "20261203T100000-dddddd", WORKER_TL, NEW_ROWS,
                 worker_log=WARM_LOG, **WORKER_META)
    (r,) = rep.report_dir(d, 10.0)
    assert (r["start"], r["checks"], r["ceilings"], r["to_first_row"]) == (0.6, 9.5, 0.0, 2.0)
    assert r["total"] == 12.1 and r["worker_ready"] == 9.5
    # the metadata's warm-up seconds win over the log's
    assert r["warm_s"] == 6.35
    assert (r["worker_spawn_s"], r["worker_imports_s"], r["worker_cuda_s"]) == (0.1, 2.48, 0.5)


def test_importtime_lines_are_summed_per_top_level_package(rep, tmp_path, capsys):
    log = ("--- worker 7: python\n"
           "import time: self [us] | cumulative | imported package\n"
           "import time:    250000 |     250000 |   torch._C\n"
           "import time:    500000 |     900000 | torch\n"
           "import time:   1250000 |    1300000 |     fla.ops.utils\n"
           "import time:     50000 |    1350000 |   fla\n")
    d = _run_dir(tmp_path / "05_new_importtime", "20261203T100000-eeeeee", WORKER_TL, NEW_ROWS,
                 worker_log=log, **WORKER_META)
    assert rep.run_import_times(d) == {"worker": [("fla", 1.3), ("torch", 0.75)]}
    rep.print_table(rep.report_dir(d, 10.0), 10.0)
    out = capsys.readouterr().out
    assert "05_new_importtime: imports in the worker" in out and "fla 1.30, torch 0.75" in out
    assert "fixed cost" not in out  # a diagnostic run is no sample of the fixed cost


def test_agreement_pairs_each_points_median_across_commits(rep, tmp_path):
    def runs(d, run_id, commit, lat):
        store = R.ResultStore(d)
        store.write_meta(run_id, {"run_id": run_id, "timeline_s": {}})
        for i, ms in enumerate(lat):
            for b, f in (("fla", 1.0), ("tilelang", 0.5)):
                path = "fused" if (b, i, commit) == ("tilelang", 1, "new") else "direct"
                store.append({"run_id": run_id, "point_key": f"p{i}", "point_index": i,
                              "direction": "fwd", "backend": b, "status": "ok",
                              "latency_ms": ms * f * (0.8 if path == "fused" else 1.0),
                              "model": "m", "path": path})
        store.append({"run_id": run_id, "point_key": "p9", "point_index": 9, "direction": "fwd", "backend": "fla",
                      "status": "crashed", "latency_ms": None, "model": "m"})
        return {"label": d.name, "commit": commit, "run_dir": str(d), "run_id": run_id}

    recs = [runs(tmp_path / "01_old", "20261201T000000-aaaaaa", "old", [1.0, 2.0]),
            runs(tmp_path / "02_new", "20261201T000001-bbbbbb", "new", [1.01, 1.96]),
            runs(tmp_path / "00_old_warmup", "20261201T000002-cccccc", "old", [9.0, 9.0])]
    lines = rep.agreement(recs)
    assert lines[0].startswith("per-point agreement, median latency at new / at old")
    assert "fla: 2 points, median 0.9950, range 0.9800-1.0100, largest |ratio - 1| 2.00%" in lines[1]
    # tilelang's second point took another route at the new commit: a kernel change, set apart
    assert lines[2].startswith("  tilelang: 2 points") and "largest |ratio - 1| 21.60%" in lines[2]
    assert lines[2].endswith("1 took another path at new, the other 1: largest |ratio - 1| 1.00%")
    assert rep.agreement(recs[:1]) == []


def test_per_label_workers_report_the_first_rows_worker(rep, tmp_path):
    tl = {"process_start": -0.5, "worker_started": 0.02, "ceilings_measured": 1.0,
          "first_ready": 5.5, "backends_checked": 13.0, "first_row": 8.0,
          "first_row_compile_s": 0.5, "last_row": 30.0, "finished": 30.5}
    meta = {"worker_timeline_s": {
                "fla": {"process_start": 0.1, "started": 0.2, "imported": 3.5, "cuda": 3.9, "warmed": 8.0},
                "tilelang": {"process_start": 0.12, "started": 0.3, "imported": 3.0, "cuda": 3.4,
                             "warmed": 5.45}},
            "worker_warm_s": {"fla": 4.1, "tilelang": 2.05}}
    rows = [("tilelang", "2026-12-02T10:00:05.000", 0.5), ("fla", "2026-12-02T10:00:06.000", 0.1)]
    d = _run_dir(tmp_path / "02_new", "20261204T100000-ffffff", tl, rows, **meta)
    (r,) = rep.report_dir(d, 10.0)
    assert r["first_row_backend"] == "tilelang" and r["worker_ready"] == 5.5
    assert (r["start"], r["checks"], r["ceilings"], r["to_first_row"]) == (0.5, 5.5, 0.0, 2.0)
    assert r["total"] == 8.0 and r["within_limit"] is True and r["all_checked"] == 13.0
    assert r["warm_s"] == 2.05
    assert (r["worker_spawn_s"], r["worker_imports_s"], r["worker_cuda_s"]) == (0.1, 2.88, 0.4)
