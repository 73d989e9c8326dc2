"""A run's fixed cost: the workers (one per backend label) start first and check (and import)
their backends while the parent reads the ceilings, and the phases come out of the run's
timeline."""

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
    assert tl["worker_started"] <= tl["first_ready"] <= tl["first_row"]
    assert abs(tl["first_ready"] - tl["backends_checked"]) < 0.05  # one backend: its check is all
    assert tl["first_row"] <= tl["last_row"] and tl["worker_started"] <= tl["ceilings_measured"]
    log = next((tmp_path / "r" / "_logs").glob("worker-*.log")).read_text()
    assert log.index("--- worker imports") < log.index("--- warm reference") < log.index("--- task")
    assert meta["worker_warm_s"].keys() == {"reference"}
    wt = meta["worker_timeline_s"]["reference"]
    assert wt["started"] <= wt["imported"] <= wt["cuda"] <= wt["warmed"] <= tl["first_ready"] + 0.05
    fc = runner.fixed_cost(tl)
    assert set(fc) == {"start", "checks", "ceilings", "to_first_row", "first_row_compile", "total",
                       "all_checked"}
    assert abs(fc["total"] - (fc["start"] + fc["checks"] + fc["ceilings"] + fc["to_first_row"])) < 0.05
    assert fc["first_row_compile"] == round(tl["first_row_compile_s"], 2)


def test_fixed_cost_phases_from_a_timeline():
    tl = {"process_start": -4.0, "worker_started": 0.01, "backends_checked": 15.0,
          "ceilings_measured": 15.5, "first_row": 30.0, "first_row_compile_s": 6.0}
    assert runner.fixed_cost(tl) == {"start": 4.0, "checks": 15.0, "ceilings": 0.5,
                                     "to_first_row": 8.5, "first_row_compile": 6.0, "total": 28.0,
                                     "all_checked": 15.0}
    assert runner.fixed_cost({"process_start": -1.0}) == {}
    # the ceilings read while the workers imported: no phase of their own; the first backend's
    # check starts the rows, the last one's comes after the first row
    tl = {"process_start": -0.6, "worker_started": 0.01, "ceilings_measured": 1.5,
          "first_ready": 6.0, "backends_checked": 14.0, "first_row": 9.0, "first_row_compile_s": 0.5}
    assert runner.fixed_cost(tl) == {"start": 0.6, "checks": 6.0, "ceilings": 0.0,
                                     "to_first_row": 2.5, "first_row_compile": 0.5, "total": 9.1,
                                     "all_checked": 14.0}


def test_a_run_of_no_points_starts_no_worker(tmp_path):
    sw = C.parse(SWEEP)
    runner.run(sw, tmp_path / "r", log=lambda *a, **k: None, isolate=True)
    n_logs = len(list((tmp_path / "r" / "_logs").glob("worker-*.log")))
    s = runner.run(sw, tmp_path / "r", log=lambda *a, **k: None, isolate=True, limit=0)
    assert s.counts == {} and len(list((tmp_path / "r" / "_logs").glob("worker-*.log"))) == n_logs


def test_ceilings_are_cached_per_gpu_key_and_measured_again_when_stale(tmp_path):
    from qlabench import metrics
    calls = []

    def measure(i):
        calls.append(i)
        return {"device_index": i, "matmul_tflops": 700.0 + len(calls), "copy_gbps": 4000.0}

    path = tmp_path / "ceilings.json"
    c, src = metrics.cached_ceilings(0, key="GPU-a|driver 1", measure=measure, path=path, now=1000.0)
    assert src == "measured" and c["matmul_tflops"] == 701.0
    c, src = metrics.cached_ceilings(1, key="GPU-a|driver 1", measure=measure, path=path, now=2000.0)
    assert src == "cache" and c["matmul_tflops"] == 701.0 and c["device_index"] == 1
    # another GPU, driver or clock: a key of its own
    _, src = metrics.cached_ceilings(0, key="GPU-a|driver 2", measure=measure, path=path, now=2000.0)
    assert src == "measured" and len(calls) == 2
    # stale: measured again
    stale = 1000.0 + metrics.CEILINGS_MAX_AGE_H * 3600 + 1
    c, src = metrics.cached_ceilings(0, key="GPU-a|driver 1", measure=measure, path=path, now=stale)
    assert src == "measured" and c["matmul_tflops"] == 703.0
    # without NVML (no key) nothing is cached; a failed measurement is not cached either
    _, src = metrics.cached_ceilings(0, key="", measure=measure, path=tmp_path / "x.json")
    assert src == "measured" and not (tmp_path / "x.json").exists()
    _, src = metrics.cached_ceilings(0, key="GPU-b", measure=lambda i: {"error": "no"}, path=path)
    assert src == "measured" and "GPU-b" not in json.loads(path.read_text())
