"""The correctness check against wrong or lazy kernels (tests/cheat_backends.py), through the runner, on the
CPU: each injected bug is `incorrect`, while the same backend without the bug (bf16-sized noise
on the reference's answer) is `ok` on the same layouts — one sequence of one token among them."""

import cheat_backends as CB
import pytest

from qlabench import backends as B
from qlabench import config as C
from qlabench import measure, runner
from qlabench.backends.reference import ReferenceBackend

#: layouts of the kind the issue's review used, scaled to a CPU reference: one long sequence,
#: several equal ones, single tokens beside long ones, lengths of 1 mod 64
LAYOUTS = [[1024], [1, 400, 1, 129, 65]]
CFG = {"name": "adv", "models": [{"name": "m", "h_qk": 1, "h_v": 4, "head_dim": 32}],
       "seqlens": LAYOUTS, "backends": ["faulty"], "isolate": False,
       "reference": {"impl": "chunked", "dtype": "fp64"},
       "timing": {"min_samples": 2, "max_samples": 3, "budget_s": 0.05}}


def _rows(tmp_path, monkeypatch, cls, directions=("fwd",), seqlens=LAYOUTS):
    monkeypatch.setattr(B, "get", lambda n, params=None: cls())
    sw = C.parse({**CFG, "directions": list(directions), "seqlens": seqlens})
    return runner.run(sw, tmp_path, log=lambda m: None).rows


def test_noise_of_a_bf16_kernel_passes_every_output(tmp_path, monkeypatch):
    rows = _rows(tmp_path, monkeypatch, CB.Noisy, ("fwd", "bwd"))
    assert [r["status"] for r in rows] == ["ok"] * len(rows), [r["reason"] for r in rows]


@pytest.mark.parametrize("name,length", [("last-token-zeroed", 32768), ("chunk-scaled", 16384)])
def test_one_wrong_token_or_chunk_in_a_long_sequence_is_incorrect(tmp_path, monkeypatch, name,
                                                                   length):
    """Long enough that the global norm (and the sequence x head figure) let it through: only
    the chunk check stands between it and `ok`."""
    rows = _rows(tmp_path, monkeypatch, CB.CHEATS[name], seqlens=[[length]])
    assert rows[0]["status"] == "incorrect" and "chunk x head" in rows[0]["reason"], rows[0]["reason"]
    assert rows[0]["rel_l2_o"] < C.Thresholds().o


@pytest.mark.parametrize("name,direction", [
    ("last-token-zeroed", "fwd"), ("chunk-scaled", "fwd"), ("head-scaled", "fwd"),
    ("all-scaled", "fwd"), ("last-token-zeroed", "bwd"), ("head-scaled", "bwd")])
def test_subtly_wrong_outputs_are_incorrect(tmp_path, monkeypatch, name, direction):
    rows = _rows(tmp_path, monkeypatch, CB.CHEATS[name], (direction,))
    assert {r["status"] for r in rows} == {"incorrect"}, [(r["layout"], r["reason"]) for r in rows]


def test_a_backend_cannot_change_what_is_checked(tmp_path, monkeypatch):
    """The layout and whether a final state is asked for come from the reference's own copy,
    not from the inputs the backend holds and may rewrite."""
    rows = _rows(tmp_path, monkeypatch, CB.TamperedLayout)
    for r in rows:
        assert r["status"] == "incorrect" and "final_state" in r["reason"], (r["layout"], r["reason"])


@pytest.mark.parametrize("name", ["cached", "hung-on-inputs", "nan-lazy", "mode-lazy"])
def test_lazy_backends_are_caught_on_the_timed_path(tmp_path, monkeypatch, name):
    """Each passes the eager, poisoned checks; the timed path on fresh inputs gives it away."""
    rows = _rows(tmp_path, monkeypatch, CB.CHEATS[name])
    for r in rows:
        assert r["status"] == "incorrect", (r["layout"], r["reason"])
        assert "timed path" in r["reason"] and r["latency_ms"] is None


def test_a_timed_graph_whose_calls_do_the_work_of_one_is_incorrect(tmp_path, monkeypatch):
    """The graph-batch marginal cost below ``MIN_MARGINAL_RATIO`` fails the row (on the CPU the
    timing result is handed in as the GPU path would hand it)."""
    from qlabench import measure, timing

    real = timing.measure_cpu

    def once_in_n(fn, opts):
        tr = real(fn, opts)
        tr.calls_per_sample, tr.marginal_ratio = 20, 0.05
        return tr
    monkeypatch.setattr(timing, "measure_cpu", once_in_n)
    rows = _rows(tmp_path, monkeypatch, CB.Noisy, seqlens=[[64]])
    assert rows[0]["status"] == "incorrect" and "unrolled" in rows[0]["reason"]
    assert rows[0]["marginal_ratio"] == 0.05 < measure.MIN_MARGINAL_RATIO


@pytest.mark.parametrize("name,why", [
    pytest.param("input-watch", "rerun on fresh inputs took", id="input-watch"),
    pytest.param("lazy-after-refresh", "rerun on fresh inputs took", id="lazy-after-refresh")])
@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_work_skipped_by_the_timed_calls_is_incorrect(tmp_path, monkeypatch, name, why, direction):
    """Right on every call the check sees, fresh inputs included: only what the check's rerun
    of the timed path costs, against the timed samples, gives them away (``RERUN_FACTOR`` and
    its floor)."""
    rows = _rows(tmp_path, monkeypatch, CB.CHEATS[name], (direction,))
    for r in rows:
        assert r["status"] == "incorrect" and why in r["reason"], (r["layout"], r["reason"])
        assert r["timed_max_rel_l2"] < C.Thresholds().o and r["latency_ms"] is None


@pytest.mark.parametrize("cls,direction", [(ReferenceBackend, "fwd"), (ReferenceBackend, "bwd"),
                                           (CB.SavedForward, "bwd"), (CB.Noisy, "fwd")])
def test_honest_reruns_and_refreshes_fit_the_timed_samples(tmp_path, monkeypatch, cls, direction):
    rows = _rows(tmp_path, monkeypatch, cls, (direction,))
    for r in rows:
        assert r["status"] == "ok", (r["layout"], r["reason"])
        if any(s in (r["reason"] or "") for s in ("the costs fit the timed samples",
                                                   "own inputs just before it")):
            continue  # the host stalled a set (load beside the test): a later set, re-timed, or
            # the own-input rerun just before it, as slow, fit
        assert r["rerun_ms"] <= measure.RERUN_FACTOR * r["p90_ms"] + measure.RERUN_FLOOR_MS
    if cls is CB.SavedForward:  # a forward: a fraction of the backward it is timed against
        assert all(0 < r["refresh_ms"] < r["p90_ms"] for r in rows), \
            [(r["refresh_ms"], r["p90_ms"]) for r in rows]
    else:
        assert all(r["refresh_ms"] is None for r in rows)


def test_a_host_slowed_after_each_fresh_set_is_not_called_lazy(tmp_path, monkeypatch):
    """A host that slows the next two calls after every fresh set is drawn (the fresh inputs'
    reference leaves a thread pool cold, a clock ramping up): the fresh rerun is far above the
    timed samples on every set, but so is the rerun on the point's own inputs just before it,
    which the rerun is judged against — an honest backend, `ok`."""
    import time

    real = measure.fresh_inputs
    slow = {"calls": 0}

    def drawn(*a, **k):
        slow["calls"] = 2
        return real(*a, **k)

    class Stalled(CB.Noisy):
        def prepare(self, x, direction):
            prep = super().prepare(x, direction)
            inner = prep.fn

            def fn():
                if slow["calls"]:
                    slow["calls"] -= 1
                    time.sleep(0.2)
                return inner()
            prep.fn = fn
            return prep
    monkeypatch.setattr(measure, "fresh_inputs", drawn)
    rows = _rows(tmp_path, monkeypatch, Stalled, seqlens=[[64]])
    r = rows[0]
    assert r["status"] == "ok", r["reason"]
    assert r["rerun_ms"] > measure.RERUN_FACTOR * r["p90_ms"] + measure.RERUN_FLOOR_MS
    assert "fits the rerun on the point's own inputs just before it" in r["reason"], r["reason"]


def test_a_call_after_the_timed_path_check_is_checked(tmp_path, monkeypatch):
    """Wrong only on the calls after the check's rerun: the poisoned eager call after timing is
    what catches it."""
    rows = _rows(tmp_path, monkeypatch, CB.WrongAfterRerun, ("fwd", "bwd"))
    for r in rows:
        assert r["status"] == "incorrect" and "a call after timing was wrong" in r["reason"], \
            (r["layout"], r["reason"])
        assert r["timed_max_rel_l2"] < C.Thresholds().o


def test_costs_that_do_not_fit_are_confirmed_on_a_second_fresh_set(tmp_path, monkeypatch):
    """One slow rerun (a host hiccup) is measured again on other fresh inputs and the row stays
    `ok`, the first figure noted; work done only on the first call after each refresh does not
    fit on either set, and is `incorrect`."""
    import time

    from qlabench.backends.base import Prepared

    class OneSlowRerun(ReferenceBackend):
        def prepare(self, x, direction):
            inner = super().prepare(x, direction)
            state = {"refreshes": 0, "slow": False}

            def refresh():
                state["refreshes"] += 1
                state["slow"] = state["refreshes"] == 1

            def fn():
                if state["slow"]:
                    state["slow"] = False
                    time.sleep(0.3)
                return inner.fn()
            return Prepared(fn=fn, graph_safe=False, refresh=refresh)

    rows = _rows(tmp_path / "a", monkeypatch, OneSlowRerun, seqlens=[[64]])
    assert rows[0]["status"] == "ok", rows[0]["reason"]
    assert "rerun on fresh inputs took" in rows[0]["reason"] and "costs fit" in rows[0]["reason"]
    rows = _rows(tmp_path / "b", monkeypatch, CB.LazyAfterRefresh, seqlens=[[1024]])
    assert rows[0]["status"] == "incorrect", rows[0]["reason"]
    assert f"on {measure.FRESH_SETS} sets of fresh inputs" in rows[0]["reason"]


@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_an_answer_precomputed_for_the_timed_inputs_is_incorrect(tmp_path, monkeypatch, direction):
    """Right and at full cost on any inputs but the point's own, whose answer it computed in
    prepare: the point's own inputs, re-timed before each further fresh set, stay cheap, so no
    set fits. (One sequence long enough that an honest call is far above the copy's cost.)"""
    rows = _rows(tmp_path, monkeypatch, CB.OwnInputsPrecomputed, (direction,), seqlens=[[2048]])
    assert rows[0]["status"] == "incorrect", rows[0]["reason"]
    assert f"on {measure.FRESH_SETS} sets of fresh inputs" in rows[0]["reason"]


def test_lazy_until_its_inputs_change_is_timed_at_its_honest_cost(tmp_path, monkeypatch):
    """Lazy through the timed samples, honest from the check's first fresh set on: that set does
    not fit, the point's own inputs are timed again before the next one, and the row keeps the
    new samples — its latency is an honest call's, not the lazy one's. (One sequence long enough
    that an honest call is far above the copy's cost on a loaded host.)"""
    honest = _rows(tmp_path / "a", monkeypatch, ReferenceBackend, seqlens=[[2048]])[0]
    row = _rows(tmp_path / "b", monkeypatch, CB.WatchThenHonest, seqlens=[[2048]])[0]
    assert row["status"] == "ok" and "re-timed on the point's own inputs" in row["reason"], row["reason"]
    assert row["latency_ms"] > 0.3 * honest["latency_ms"], (row["latency_ms"], honest["latency_ms"])


def test_a_machine_slowed_from_the_check_on_moves_both_sides(tmp_path, monkeypatch):
    """Every call from the first fresh set on costs 1 s more (load beside the run): the point's
    own inputs are timed again before the second set, whose costs fit the new samples, so the
    row stays `ok` (held against the first samples it would be `incorrect`)."""
    import time

    from qlabench.backends.base import Prepared

    class LoadedFromTheCheck(ReferenceBackend):
        def prepare(self, x, direction):
            inner = super().prepare(x, direction)
            loaded = [False]

            def refresh():
                loaded[0] = True

            def fn():
                if loaded[0]:
                    time.sleep(1.0)
                return inner.fn()
            return Prepared(fn=fn, graph_safe=False, refresh=refresh)

    rows = _rows(tmp_path / "a", monkeypatch, LoadedFromTheCheck, seqlens=[[64]])
    assert rows[0]["status"] == "ok", rows[0]["reason"]
    assert "costs fit" in rows[0]["reason"] and rows[0]["p90_ms"] > 1000.0
