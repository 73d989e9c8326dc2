"""Fault-injection suite: each fault gives the right status, other rows are intact, and a
``kill -9`` of the run followed by ``--resume`` completes it with no duplicate rows."""

import os
import signal
import subprocess
import sys
import time

import pytest
import yaml

from qlabench import config as C
from qlabench import results, runner

BASE = {"name": "faults", "models": [{"name": "m", "h_qk": 1, "h_v": 2, "head_dim": 8}],
        "seqlens": [[5], [6], [7], [8], [9], [10], [11], [12]],
        "directions": ["fwd"], "backends": ["faulty", "reference"],
        "reference": {"impl": "chunked", "dtype": "fp64"},
        "timing": {"min_samples": 2, "max_samples": 3, "budget_s": 0.05},
        "row_timeout_s": 20}


def test_each_fault_gives_its_status_and_nothing_else_is_lost(tmp_path, monkeypatch):
    monkeypatch.setenv("QLABENCH_FAULTS", "crash@1,hang@2,oom@3,wrong@4,raise@5,abort@6")
    s = C.parse({**BASE, "row_timeout_s": 8})
    runner.run(s, tmp_path, log=lambda m: None)
    df = results.load(tmp_path)
    assert len(df) == 16 and not df.duplicated(["point_key", "backend"]).any()
    f = df[df.backend == "faulty"].set_index("point_index")["status"].to_dict()
    assert f == {0: "ok", 1: "crashed", 2: "timeout", 3: "oom", 4: "incorrect", 5: "crashed",
                 6: "crashed", 7: "ok"}
    # the reference rows of every point, faulty neighbours included, are intact
    assert set(df[df.backend == "reference"]["status"]) == {"ok"}
    crashed = df[(df.backend == "faulty") & (df.point_index == 1)].iloc[0]
    assert "signal 11" in crashed["reason"] and "Segmentation fault" in crashed["reason"]
    assert "row_timeout_s" in df[(df.backend == "faulty") & (df.point_index == 2)].iloc[0]["reason"]
    assert df[df.status == "incorrect"]["latency_ms"].isna().all()


def test_in_process_exceptions_without_isolation(tmp_path, monkeypatch):
    monkeypatch.setenv("QLABENCH_FAULTS", "oom@0,raise@1,wrong@2")
    s = C.parse({**BASE, "seqlens": [[5], [6], [7]], "isolate": False})
    runner.run(s, tmp_path, log=lambda m: None)
    df = results.load(tmp_path)
    f = df[df.backend == "faulty"].set_index("point_index")["status"].to_dict()
    assert f == {0: "oom", 1: "crashed", 2: "incorrect"}


def test_inputs_rebuilt_after_a_row_never_replace_its_outcome(tmp_path, monkeypatch):
    """When restoring the point's inputs for the next backend fails (e.g. out of memory), the row
    keeps what its backend gave (its own error, or its measurement), and the next backend
    starts from inputs built anew."""
    import torch

    from qlabench import measure

    def refill(x, fresh):
        raise torch.OutOfMemoryError("CUDA out of memory (injected into refill)")

    monkeypatch.setattr(measure, "refill", refill)
    monkeypatch.setenv("QLABENCH_FAULTS", "raise@0")
    s = C.parse({**BASE, "seqlens": [[5], [6]], "isolate": False})
    runner.run(s, tmp_path, log=lambda m: None)
    df = results.load(tmp_path).set_index(["point_index", "backend"])
    assert df.loc[(0, "faulty"), "status"] == "crashed"
    assert "refill" not in df.loc[(0, "faulty"), "reason"]
    assert df.loc[(1, "faulty"), "status"] == "ok"
    assert (df.xs("reference", level="backend")["status"] == "ok").all()


def test_kill_9_then_resume_completes_without_duplicates(tmp_path):
    cfg = {**BASE, "backends": ["reference"], "seqlens": [[200 + i] for i in range(12)],
           "reference": {"impl": "recurrent", "dtype": "fp64"},
           "timing": {"min_samples": 3, "max_samples": 5, "budget_s": 0.3}}
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump(cfg))
    out = tmp_path / "out"
    proc = subprocess.Popen(_run_cmd(p, out), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    _wait_for_rows(out, 3)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    first = len(results.load(out))
    assert 3 <= first < 12, first
    r = subprocess.run(_run_cmd(p, out, "--resume"), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    df = results.load(out)
    assert len(df) == 12 and not df.duplicated(["point_key", "backend", "direction"]).any()
    assert set(df["status"]) == {"ok"}


def _run_cmd(config, out, *extra: str) -> list[str]:
    """``qlabench run CONFIG --out OUT --no-plot EXTRA...`` as a subprocess's argv."""
    return [sys.executable, "-m", "qlabench.cli", "run", str(config), "--out", str(out), "--no-plot",
            *extra]


def _wait_for_rows(out, n: int, within_s: float = 120) -> None:
    """Until ``out`` holds ``n`` row files (or ``within_s`` passed)."""
    t0 = time.time()
    while time.time() - t0 < within_s:
        if (out / "parts").exists() and len(list((out / "parts").glob("*.parquet"))) >= n:
            return
        time.sleep(0.2)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_sigint_sigterm_exit_cleanly_and_keep_rows(tmp_path, sig):
    # enough points that the run cannot finish between the poll that sees two rows and the signal
    cfg = {**BASE, "backends": ["reference"], "seqlens": [[200 + i] for i in range(80)],
           "reference": {"impl": "recurrent", "dtype": "fp64"}}
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump(cfg))
    out = tmp_path / "out"
    proc = subprocess.Popen(_run_cmd(p, out), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    _wait_for_rows(out, 2)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-1500:]
    assert "interrupted" in err and "Traceback" not in err
    df = results.load(out)
    assert len(df) >= 2 and set(df["status"]) == {"ok"}
    assert not list((out / "parts").glob(".*.tmp"))


def test_an_interrupt_names_the_row_in_flight_and_where_it_stands(tmp_path):
    """A run stopped while a backend has given no row (a hang short of row_timeout_s, cut by a
    job's deadline) says which backend, on which point, for how long, and its worker's stack."""
    cfg = {**BASE, "seqlens": [[5], [6]], "row_timeout_s": 120}
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump(cfg))
    out = tmp_path / "out"
    env = {**os.environ, "QLABENCH_FAULTS": "hang@1"}
    proc = subprocess.Popen(_run_cmd(p, out), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
    _wait_for_rows(out, 2)  # point 0's two rows are in: point 1's faulty row hangs
    time.sleep(3.0)
    proc.send_signal(signal.SIGINT)
    so, se = proc.communicate(timeout=60)
    assert proc.returncode == 130, se[-1500:]
    line = next((ln for ln in so.splitlines() if ln.startswith("interrupted with")), "")
    assert line.startswith("interrupted with faulty in flight on "), so[-1500:]
    ran_s = float(line.split(" for ")[1].split(" s ")[0])
    assert 3 <= ran_s < 60, line
    assert "faulty_backend.py" in line.split("| stack:")[1], line
    assert len(results.load(out)) == 2


def test_row_timeout_from_the_command_line(tmp_path):
    """--row-timeout-s overrides the config's: a hang past it is a `timeout` row that names it, and
    the run goes on; a value below 1 s is refused with exit 2."""
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump({**BASE, "seqlens": [[5], [6], [7]], "row_timeout_s": 600}))
    out = tmp_path / "out"
    cmd = _run_cmd(p, out)
    env = {**os.environ, "QLABENCH_FAULTS": "hang@1"}
    r = subprocess.run(cmd + ["--row-timeout-s", "0"], capture_output=True, text=True, env=env)
    assert r.returncode == 2 and "--row-timeout-s" in r.stderr and not out.exists()
    r = subprocess.run(cmd + ["--row-timeout-s", "5"], capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-1500:]
    df = results.load(out)
    f = df[df.backend == "faulty"].set_index("point_index")
    assert f["status"].to_dict() == {0: "ok", 1: "timeout", 2: "ok"}
    assert "row_timeout_s=5" in f.loc[1, "reason"]


def test_a_backend_that_keeps_timing_out_is_skipped_for_the_rest_of_the_run(tmp_path):
    """Two `timeout` rows in a row (the default max_timeouts) and the backend's remaining rows are
    `skipped`, naming why, while the other backends go on; a row that ends otherwise resets the
    count; `--resume` measures the skipped rows."""
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump({**BASE, "seqlens": [[5 + i] for i in range(7)]}))
    out = tmp_path / "out"
    cmd = _run_cmd(p, out, "--row-timeout-s", "6")
    env = {**os.environ, "QLABENCH_FAULTS": "hang@1,hang@3,hang@4"}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-1500:]
    df = results.load(out)
    f = df[df.backend == "faulty"].set_index("point_index")
    assert f["status"].to_dict() == {0: "ok", 1: "timeout", 2: "ok", 3: "timeout", 4: "timeout",
                                     5: "skipped", 6: "skipped"}
    assert "faulty timed out on its last 2 rows" in f.loc[5, "reason"]
    assert set(df[df.backend == "reference"]["status"]) == {"ok"}
    r = subprocess.run(cmd + ["--resume"], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "QLABENCH_FAULTS": ""})
    assert r.returncode == 0, r.stderr[-1500:]
    f = results.load(out, latest=True)
    f = f[f.backend == "faulty"].set_index("point_index")["status"].to_dict()
    assert f == {0: "ok", 1: "timeout", 2: "ok", 3: "timeout", 4: "timeout", 5: "ok", 6: "ok"}


def test_a_crash_reason_names_where_in_whole_frames():
    """The reason of a crashed row: the exception, then whole ``file:line function`` frames,
    innermost first — never a traceback cut mid-line."""
    from qlabench.measure import crash_reason

    def inner():
        raise ValueError("x" * 500)

    try:
        inner()
    except ValueError as e:
        r = crash_reason(e)
    head, where = r.split(" | at ")
    assert head == "ValueError: " + "x" * 300
    assert where.startswith("test_faults.py:") and where.split(" < ")[0].endswith(" inner")


def test_a_rewritten_layout_is_told_from_the_points_own(tiny_point):
    """What refill does not restore (cu_seqlens' values, a field that is not a tensor, a tensor
    replaced by None) is compared with the point's own inputs before the next backend."""
    from qlabench.measure import _same_layout
    from qlabench.workloads import make

    own = make(tiny_point, with_grads=True)
    assert _same_layout(make(tiny_point, with_grads=True), own)
    for rewrite in (lambda x: x.cu_seqlens.__setitem__(slice(1, -1), x.cu_seqlens[-1]),
                    lambda x: setattr(x, "output_final_state", not x.output_final_state),
                    lambda x: setattr(x, "h0", None)):
        x = make(tiny_point, with_grads=True)
        rewrite(x)
        assert not _same_layout(x, own)
