"""The order of a run's rows (executor.dispatch_one_gpu, executor.early_rows).
One GPU, one worker per backend label: rows go out in sweep order among the labels checked so far, asked again before
every row, so a label whose library imports slower joins as soon as it
is checked and catches up from its first point; rows measured while other workers were starting
say so; the progress callback advances once per (point, direction); rows may start before every
check only where the host has a core per worker (or ``$QLABENCH_EARLY_ROWS`` says)."""

import os
from types import SimpleNamespace

from qlabench import executor


class FakeLanes:
    """Labels resolved after a number of polls each (0: at once); ``run`` records the order."""

    def __init__(self, after: dict):
        self.after = dict(after)
        self.polls = 0
        self.ran: list = []
        self.lanes = {n: SimpleNamespace(avail=(True, "")) for n in after}

    def poll(self, wait_s=0.0):
        self.polls += 1

    def resolved(self):
        return {n for n, k in self.after.items() if self.polls >= k}

    def starting(self):
        return [n for n in self.after if n not in self.resolved()]

    def run(self, label, task, on_row):
        self.ran.append((label, task.point))
        on_row({"backend": label, "point": task.point, "reason": ""})


def _go(lanes, n_points=6):
    names = list(lanes.after)
    ctx = {"avail": {n: (True, "") for n in names if n in lanes.resolved()}}
    rows, seen, progress = [], [], []

    def on_resolved(n):
        ctx["avail"][n] = (True, "")
        seen.append(n)

    class P(int):
        def describe(self):
            return f"p{int(self)}"

    order = [(P(i), "fwd") for i in range(n_points)]
    executor.dispatch_one_gpu(lanes, order, names, lambda n: list(range(n_points)), on_resolved, ctx,
                     rows.append, progress.append)
    return rows, seen, progress


def test_a_label_checked_later_joins_at_once_and_catches_up_from_its_first_point():
    lanes = FakeLanes({"fast": 0, "slow": 4})  # slow is checked at the 4th poll
    rows, seen, progress = _go(lanes)
    ran = [(n, int(p)) for n, p in lanes.ran]
    first_slow = ran.index(("slow", 0))
    assert first_slow < ran.index(("fast", 5)), ran  # it did not wait for fast's last point
    assert [p for n, p in ran if n == "slow"] == list(range(6))  # from its first point, in order
    assert seen == ["slow"]
    # after slow joins, the earliest pending point goes first whoever it belongs to
    assert ran[first_slow:first_slow + 2] == [("slow", 0), ("slow", 1)]
    # rows measured while slow's worker was starting say so; later ones do not
    assert all("slow were starting" in r["reason"] for r in rows[:first_slow])
    assert not any(r["reason"] for r in rows[first_slow:])
    assert progress == [f"p{i} fwd" for i in range(6)]  # once per (point, direction)


def test_labels_checked_at_once_go_point_by_point_in_config_order():
    lanes = FakeLanes({"a": 0, "b": 0})
    rows, seen, _ = _go(lanes, 3)
    assert [(n, int(p)) for n, p in lanes.ran] == [("a", 0), ("b", 0), ("a", 1), ("b", 1),
                                                    ("a", 2), ("b", 2)]
    assert not any(r["reason"] for r in rows)


def test_early_rows_by_cores_or_environment(monkeypatch):
    monkeypatch.delenv("QLABENCH_EARLY_ROWS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    assert executor.early_rows(3) is True
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert executor.early_rows(2) is False and executor.early_rows(1) is True
    monkeypatch.setenv("QLABENCH_EARLY_ROWS", "1")
    assert executor.early_rows(5) is True
    monkeypatch.setenv("QLABENCH_EARLY_ROWS", "0")
    assert executor.early_rows(1) is False


def test_a_bad_early_rows_value_is_refused(monkeypatch, tmp_path):
    import pytest
    from typer.testing import CliRunner

    from qlabench.cli import app
    monkeypatch.setenv("QLABENCH_EARLY_ROWS", "yes")
    with pytest.raises(ValueError, match="QLABENCH_EARLY_ROWS='yes'"):
        executor.early_rows(2)
    res = CliRunner().invoke(app, ["run", "configs/smoke.yaml", "--out", str(tmp_path / "r")])
    assert res.exit_code == 2 and "QLABENCH_EARLY_ROWS='yes'" in res.output
    assert not (tmp_path / "r").exists()
