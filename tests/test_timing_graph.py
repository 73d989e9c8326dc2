"""The graph path of ``timing.measure_gpu`` on the CPU: CUDA graphs, events and the device replaced
by fakes (a graph whose replay runs its captured body again, events reading a fake clock that
each call advances), so that what the timed graph hands the correctness check — the outputs of
every unrolled call of one more replay, and that replay's time — is checked without a GPU."""

import pytest
import torch
from fake_cuda import FakeEvent

from qlabench import config as C
from qlabench import correctness, timing
from qlabench.backends.base import Prepared
from qlabench.backends.reference import ReferenceBackend

N_CALLS, PER_CALL_MS = 6, 0.25


class ReplayingGraph:
    """A captured graph whose replay runs the captured body again (the body's Python re-runs:
    ``captured`` gets each replay's outputs, as a real replay rewrites the captured tensors)."""

    def __init__(self, body):
        self.body = body

    def replay(self):
        self.body()


@pytest.fixture
def fake_gpu(monkeypatch):
    """measure_gpu's device parts replaced: the fake clock (ms) that events read and calls
    advance is returned."""
    clock = [0.0]

    class NoFlush:
        def __call__(self):
            pass

    def capture(body):
        body()  # the warm-up on the side stream
        return ReplayingGraph(body)

    monkeypatch.setattr(timing, "_events", lambda: (FakeEvent(clock), FakeEvent(clock)))
    monkeypatch.setattr(timing, "_synchronize", lambda: None)
    monkeypatch.setattr(timing, "_capture", capture)
    monkeypatch.setattr(timing, "_Flusher", NoFlush)
    monkeypatch.setattr(timing, "estimate_call_ms", lambda fn: PER_CALL_MS)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    return clock


OPTS = C.Timing(mode="graph-batch", calls_per_graph=N_CALLS, warmup=1, min_samples=3,
                max_samples=3)


def test_rerun_replays_the_graph_and_returns_every_unrolled_call(fake_gpu):
    calls = [0]

    def fn():
        calls[0] += 1
        fake_gpu[0] += PER_CALL_MS
        return (torch.tensor(calls[0]),)

    tr, _ = timing.measure_gpu(fn, OPTS)
    assert tr.timing_mode == "graph-batch" and tr.calls_per_sample == N_CALLS
    assert tr.samples_ms == [pytest.approx(PER_CALL_MS)] * 3
    before = calls[0]
    outs, ms = tr.rerun()
    assert [int(o[0]) for o in outs] == list(range(before + 1, before + N_CALLS + 1))
    assert ms == pytest.approx(PER_CALL_MS)


def test_rerun_of_a_cold_l2_graph_subtracts_the_flushes_as_the_samples_do(fake_gpu, monkeypatch):
    flush_ms = 0.5

    class Flush:
        def __call__(self):
            fake_gpu[0] += flush_ms
    monkeypatch.setattr(timing, "_Flusher", Flush)

    def fn():
        fake_gpu[0] += PER_CALL_MS
        return (torch.zeros(1),)

    tr, _ = timing.measure_gpu(fn, OPTS.model_copy(update={"l2": "cold"}))
    outs, ms = tr.rerun()
    assert len(outs) == N_CALLS and tr.samples_ms == [pytest.approx(PER_CALL_MS)] * 3
    assert ms == pytest.approx(PER_CALL_MS)


class OneCallWrong(ReferenceBackend):
    """Each call allocates its outputs; call number ``wrong_call`` (counted from the first) has
    o 10% off, every other call is right."""

    calls = 0
    wrong_call = None

    def prepare(self, x, direction):
        inner = super().prepare(x, direction)

        def fn():
            o, ht = inner.fn()
            self.calls += 1
            return (o * 1.1 if self.calls == self.wrong_call else o), ht
        return Prepared(fn=fn)


def test_the_timed_path_check_sees_every_unrolled_call_of_the_graph(fake_gpu):
    """A graph whose first unrolled call is wrong and whose last is right: the check of the
    timed path fails it because the rerun hands over all n calls' outputs, not the last."""
    from qlabench.sweep import points
    from qlabench.workloads import make
    sw = C.parse({"name": "g", "models": [{"name": "m", "h_qk": 1, "h_v": 2, "head_dim": 16}],
                  "seqlens": [[9, 40]], "backends": ["reference"], "directions": ["fwd"]})
    p = points(sw)[0]
    x = make(p)
    be = OneCallWrong()
    prep = be.prepare(x, "fwd")
    tr, _ = timing.measure_gpu(prep.fn, OPTS)
    be.wrong_call = be.calls + 1  # the first call unrolled in the next replay
    fresh = make(p, seed=777)
    ref = correctness.reference_outputs(fresh, "fwd", "chunked", "fp64")
    chk = correctness.check_timed_path(be, prep, tr.rerun, x, fresh, "fwd", ref, sw)
    assert chk.calls == N_CALLS
    assert chk.bad and chk.bad[0].startswith(f"call 1 of {N_CALLS}: o rel_l2="), chk.bad
