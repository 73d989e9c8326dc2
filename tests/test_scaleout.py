"""Sharding, merging, multi-worker scheduling and the submitit integration (CPU)."""

import pytest
import yaml
from typer.testing import CliRunner

from qlabench import config as C
from qlabench import results, runner
from qlabench.cli import app
from qlabench.sweep import point_cost, points, scheduled_points, shard_points

CFG = {"name": "so", "models": [{"name": "a", "h_qk": 1, "h_v": 2, "head_dim": 8},
                                {"name": "b", "h_qk": 1, "h_v": 1, "head_dim": 8}],
       "seqlens": [[5], [9], [3, 4], [12]], "directions": ["fwd"], "backends": ["reference"],
       "reference": {"impl": "chunked", "dtype": "fp64"},
       "timing": {"min_samples": 2, "max_samples": 3, "budget_s": 0.05}}


def test_shards_partition_the_points_deterministically():
    pts = points(C.load("configs/h200_fwd.yaml"))
    shards = [shard_points(pts, i, 4) for i in range(4)]
    keys = [p.key for s in shards for p in s]
    assert sorted(keys) == sorted(p.key for p in pts) and len(set(keys)) == len(keys)
    assert [p.key for p in shard_points(pts, 2, 4)] == [p.key for p in shards[2]]
    work = [sum(point_cost(p) for p in s) for s in shards]
    assert max(work) / min(work) < 1.15


def test_shard_runs_then_merge_equal_one_run(tmp_path):
    s = C.parse(CFG)
    for i in range(3):
        runner.run(s, tmp_path / f"s{i}", shard=(i, 3), log=lambda m: None)
    r = CliRunner().invoke(app, ["merge", "--out", str(tmp_path / "m")] + [str(tmp_path / f"s{i}") for i in range(3)])
    assert r.exit_code == 0, r.output
    df = results.load(tmp_path / "m")
    assert len(df) == 8 and not df.duplicated(results.KEY).any() and set(df.status) == {"ok"}
    assert len(results.load_meta(tmp_path / "m")) == 3
    # a shard measures what `qlabench run --shard` plans: the limit first, then the shard
    shard1 = {r.point_key for r in results.load(tmp_path / "s1").itertuples()}
    assert shard1 == {p.key for p in scheduled_points(s, None, (1, 3))}
    assert scheduled_points(s, 5, (1, 3)) == shard_points(points(s)[:5], 1, 3)


def test_merge_refuses_mixed_recipes(tmp_path):
    runner.run(C.parse(CFG), tmp_path / "a", limit=1, log=lambda m: None)
    runner.run(C.parse({**CFG, "seed": 7}), tmp_path / "b", limit=1, log=lambda m: None)
    r = CliRunner().invoke(app, ["merge", "--out", str(tmp_path / "m"), str(tmp_path / "a"), str(tmp_path / "b")])
    assert r.exit_code == 2 and "recipes" in r.output


def test_two_workers_share_the_points(tmp_path):
    runner.run(C.parse(CFG), tmp_path, devices=["0", "1"], log=lambda m: None)
    df = results.load(tmp_path)
    assert len(df) == 8 and not df.duplicated(results.KEY).any()
    assert set(df.gpu_index) == {0, 1}


@pytest.mark.parametrize("arg", ["5/4", "x", "1/0"])
def test_bad_shard_flag(tmp_path, arg):
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump(CFG))
    r = CliRunner().invoke(app, ["run", str(p), "--shard", arg, "--out", str(tmp_path / "o")])
    assert r.exit_code == 2 and "--shard" in r.output


def test_gpus_flag_without_gpus(tmp_path, monkeypatch):
    import torch
    if torch.cuda.is_available():
        pytest.skip("has a GPU")
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump(CFG))
    r = CliRunner().invoke(app, ["run", str(p), "--gpus", "all", "--out", str(tmp_path / "o")])
    assert r.exit_code == 2 and "no CUDA device" in r.output
    monkeypatch.setenv("QLABENCH_FAKE_GPUS", "2")
    r = CliRunner().invoke(app, ["run", str(p), "--gpus", "0,5", "--out", str(tmp_path / "o")])
    assert r.exit_code == 2 and "0..1" in r.output


def test_submitit_local_executor_runs_shards_and_merges(tmp_path, monkeypatch):
    pytest.importorskip("submitit")
    # the two shards run side by side on this machine's cores: one thread each, so their timed
    # calls are not descheduled by each other's thread pools (the gate times a rerun on fresh inputs)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump(CFG))
    r = CliRunner().invoke(app, ["submit", str(p), "--shards", "2", "--executor", "local",
                                 "--out", str(tmp_path / "out"), "--timeout-min", "5"])
    assert r.exit_code == 0, r.output
    df = results.load(tmp_path / "out")
    assert len(df) == 8 and not df.duplicated(results.KEY).any()
    assert set(df.status) == {"ok"}, df.loc[df.status != "ok", ["layout", "status", "reason"]].to_string()


def test_sigint_with_two_workers_keeps_finished_rows(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time
    cfg = {**CFG, "seqlens": [[200 + i] for i in range(10)],
           "reference": {"impl": "recurrent", "dtype": "fp64"}}
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump(cfg))
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "qlabench.cli", "run", str(p), "--out", str(out),
                             "--gpus", "all", "--no-plot"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "QLABENCH_FAKE_GPUS": "2"})
    t0 = time.time()
    while time.time() - t0 < 120:
        if (out / "parts").exists() and len(list((out / "parts").glob("*.parquet"))) >= 2:
            break
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    so, se = proc.communicate(timeout=120)
    assert proc.returncode == 130, se[-1500:]
    df = results.load(out)
    why = f"rows={len(df)} statuses={sorted(set(df['status']))}\nstdout: {so[-1500:]}\nstderr: {se[-1500:]}"
    assert 2 <= len(df) < 20 and set(df["status"]) == {"ok"}, why
    assert not df.duplicated(results.KEY).any(), why
    meta = next(iter(results.load_meta(out).values()))
    # Known race, not yet explained (about 1 run in 10 under load): the last in-flight row can reach
    # the disk after the run metadata counted the stored parts, so the count may be one short.
    # A known issue (README, Status); the rows themselves are all kept (asserted above).
    assert meta.get("finished_at") and len(df) - 1 <= sum(meta["counts"].values()) <= len(df), \
        f"{meta.get('counts')} {why}"
