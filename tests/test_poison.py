"""The correctness check's defences, on the CPU: poisoning, the check after timing, the check of
the timed graph's outputs, the per-sequence / per-block gate, and graph-batch arithmetic.

Each test carries its negative control: without the defence, the broken backend would pass."""

import contextlib

import pytest
import torch
from fake_cuda import FakeEvent
from torch.utils._python_dispatch import TorchDispatchMode

from qlabench import backends as B
from qlabench import config as C
from qlabench import correctness, poison, runner, timing
from qlabench.backends.base import Prepared
from qlabench.backends.reference import ReferenceBackend
from qlabench.workloads import cu_seqlens_of

# N=4 sequences x 2 v-heads x 64 x 64 fp32 final state = 128 KiB (a "small" allocation on the GPU)
CFG = {"name": "pz", "models": [{"name": "m", "h_qk": 1, "h_v": 2, "head_dim": 64}],
       "seqlens": [[9, 20, 33, 7]], "backends": ["faulty"], "isolate": False,
       "reference": {"impl": "chunked", "dtype": "fp64"},
       "timing": {"min_samples": 2, "max_samples": 3, "budget_s": 0.05}}
TAIL = 64 * 1024 // 4  # last 64 KiB of fp32 elements


class StaleAllocator(TorchDispatchMode):
    """Below the runner's poisoning, like the device allocator: an ``empty`` of the final
    state's shape comes back holding the previous call's answer (what PyTorch's small pool did
    on the H200, 3 times out of 3)."""

    def __init__(self):
        super().__init__()
        self.answer = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if (self.answer is not None and func.overloadpacket.__name__ in poison._EMPTY
                and isinstance(out, torch.Tensor) and out.shape == self.answer.shape):
            out.copy_(self.answer)
        return out


class SkipsTail(ReferenceBackend):
    """Writes the final state into a fresh ``torch.empty`` but leaves its last 64 KiB unwritten."""

    name = "faulty"

    def __init__(self, stale: StaleAllocator):
        self.stale = stale

    def prepare(self, x, direction):
        inner = super().prepare(x, direction)

        def fn():
            o, ht = inner.fn()
            self.stale.answer = ht.detach().clone()
            st = torch.empty_like(ht)
            st.view(-1)[:-TAIL] = ht.reshape(-1)[:-TAIL]
            return o, st
        return Prepared(fn=fn, graph_safe=False)


def _run(tmp_path, monkeypatch, be, cfg=CFG):
    monkeypatch.setattr(B, "get", lambda n, params=None: be)
    return runner.run(C.parse(cfg), tmp_path, log=lambda m: None).rows


def test_small_output_left_unwritten_is_incorrect(tmp_path, monkeypatch):
    stale = StaleAllocator()
    with stale:
        rows = _run(tmp_path / "a", monkeypatch, SkipsTail(stale))
    assert [r["status"] for r in rows] == ["incorrect"]
    assert "final_state" in rows[0]["reason"]
    # negative control: without the dispatch-level poisoning the stale answer passes
    monkeypatch.setattr(poison, "PoisonAllocations", contextlib.nullcontext)
    stale = StaleAllocator()
    with stale:
        rows = _run(tmp_path / "b", monkeypatch, SkipsTail(stale))
    assert [r["status"] for r in rows] == ["ok"]


def test_poison_mode_fills_every_empty_factory_and_spares_integers():
    with poison.PoisonAllocations() as m:
        ts = [torch.empty(5), torch.empty_like(torch.ones(3, 2)), torch.ones(2).new_empty(4),
              torch.empty_strided((2, 3), (3, 1), dtype=torch.bfloat16)]
        i = torch.empty(4, dtype=torch.int64)
        z = torch.zeros(3)
    assert all(torch.isnan(t.float()).all() for t in ts) and m.filled == 4
    assert not torch.isnan(z).any() and i.dtype == torch.int64


def test_fill_nan_fills_every_floating_point_tensor_and_spares_integers():
    a, b, i = torch.ones(3), torch.ones(2, 2, dtype=torch.bfloat16), torch.arange(3)
    assert poison.fill_nan((a, [b], {"i": i})) == 2
    assert torch.isnan(a).all() and torch.isnan(b.float()).all() and (i == torch.arange(3)).all()


class WrongAfterFirstCall(ReferenceBackend):
    """Right on its first call, then carries state between calls (each later o is off by 10%)."""

    name = "faulty"

    def prepare(self, x, direction):
        inner = super().prepare(x, direction)
        calls = [0]

        def fn():
            o, ht = inner.fn()
            calls[0] += 1
            return (o * 1.1 if calls[0] > 1 else o), ht
        return Prepared(fn=fn, graph_safe=False)


def test_call_after_timing_is_checked(tmp_path, monkeypatch):
    rows = _run(tmp_path, monkeypatch, WrongAfterFirstCall())
    assert rows[0]["status"] == "incorrect" and "timed path" in rows[0]["reason"]
    assert rows[0]["latency_ms"] is None


def _tiny(direction="fwd"):
    from qlabench.sweep import points
    from qlabench.workloads import make
    sw = C.parse({**CFG, "directions": [direction]})
    x = make(points(sw)[0], with_grads=direction != "fwd")
    return sw, x, correctness.reference_outputs(x, direction, "chunked", "fp64")


class HandsBackH0(ReferenceBackend):
    """Raw outputs (o, final_state, h0): like FLA's forward, it returns an input too."""

    def outputs_to_canonical(self, raw, inputs, direction):
        return {"o": raw[0], "final_state": raw[1]}


def test_timed_path_check_runs_on_fresh_inputs_and_checks_every_call():
    from qlabench.sweep import points
    from qlabench.workloads import make
    sw, x, _ = _tiny()
    p = points(sw)[0]
    fresh = make(p, seed=12345)
    ref2 = correctness.reference_outputs(fresh, "fwd", "chunked", "fp64")
    be = HandsBackH0()
    seen = {}

    def rerun():  # the timed path: it computes from the buffers it was timed on
        seen["q"] = x.q.clone()
        good = (ref2["o"].clone(), ref2["final_state"].clone(), x.h0)
        return [good, good], 0.5

    version = x.q._version
    chk = correctness.check_timed_path(be, Prepared(fn=None), rerun, x, fresh, "fwd", ref2, sw)
    assert chk.bad == [] and chk.worst < 1e-6 and (chk.rerun_ms, chk.calls) == (0.5, 2)
    assert torch.equal(seen["q"], fresh.q) and x.q._version == version  # same tensors, new values

    def rerun_second_call_stale():
        return [(ref2["o"], ref2["final_state"], x.h0),
                (ref2["o"] * 0, ref2["final_state"], x.h0)], 0.5

    chk = correctness.check_timed_path(be, Prepared(fn=None), rerun_second_call_stale, x, fresh,
                                       "fwd", ref2, sw)
    assert chk.bad and chk.bad[0].startswith("call 2 of 2")


def test_refresh_is_timed_with_the_clock_given_after_the_fresh_values_are_written():
    from qlabench.sweep import points
    from qlabench.workloads import make
    sw, x, _ = _tiny()
    fresh = make(points(sw)[0], seed=4321)
    ref2 = correctness.reference_outputs(fresh, "fwd", "chunked", "fp64")
    seen = {}

    def refresh():
        seen["q"] = x.q.clone()

    def clock(f):
        return f(), 7.0

    def rerun():
        return [(ref2["o"], ref2["final_state"], x.h0)], 0.5
    prep = Prepared(fn=None, refresh=refresh)
    chk = correctness.check_timed_path(HandsBackH0(), prep, rerun, x, fresh, "fwd", ref2, sw,
                                       clock=clock)
    assert chk.bad == [] and chk.refresh_ms == 7.0 and torch.equal(seen["q"], fresh.q)


def test_state_gate_catches_one_wrong_sequence_the_global_norm_hides():
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(8, 4, 32, 32, generator=g)
    bad = ref + 3e-3 * torch.randn(ref.shape, generator=g)
    bad[5] = bad[5] * 1.02  # one sequence of 8 with a 2% error
    glob = ((bad - ref).norm() / ref.norm()).item()
    lim = C.Thresholds().final_state
    assert glob < lim  # passes the global limit ...
    assert correctness.worst_state_rel_err(bad, ref) > correctness.SEQ_FACTOR * lim  # ... not this one


LOCAL = {**CFG, "models": [{"name": "m", "h_qk": 1, "h_v": 4, "head_dim": 16}],
         "seqlens": [[2000, 40, 30, 30, 30, 30, 30, 30]]}


@pytest.mark.parametrize("name,factor", [("dg", 1.08), ("dbeta", 1.08), ("dh0", 1.03)])
def test_small_gradients_are_gated_locally(name, factor):
    """One (sequence, head) of dg / dbeta / dh0 wrong: the global norm passes, the local gate not."""
    from qlabench.sweep import points
    from qlabench.workloads import make
    sw = C.parse({**LOCAL, "directions": ["bwd"]})
    x = make(points(sw)[0], with_grads=True)
    ref = correctness.reference_outputs(x, "bwd", "chunked", "fp64")
    outs = {k: v.clone() for k, v in ref.items()}
    assert correctness.check_outputs(outs, ref, x, "bwd", sw)[2] == []
    if name == "dh0":
        outs[name][1, 2] *= factor  # sequence 1, head 2
    else:
        outs[name][0, 2000:2040, 2] *= factor  # all of sequence 1, head 2
    row: dict = {}
    _, _, bad = correctness.check_outputs(outs, ref, x, "bwd", sw, row)
    assert row[f"rel_l2_{name}"] < sw.thresholds.get(name)  # passes the global threshold ...
    assert [b for b in bad if b.startswith(f"{name} worst")] == bad and bad  # ... not the local one


class OneStateOff(ReferenceBackend):
    """Right everywhere except one (sequence, head) of the final state, 2.5% too large."""

    name = "faulty"

    def prepare(self, x, direction):
        inner = super().prepare(x, direction)

        def fn():
            o, ht = inner.fn()
            ht = ht.clone()
            ht[5, 1] *= 1.025
            return o, ht
        return Prepared(fn=fn, graph_safe=False)


def test_one_wrong_sequence_state_is_incorrect_through_the_runner(tmp_path, monkeypatch):
    cfg = {**CFG, "seqlens": [[9, 20, 33, 7, 11, 12, 13, 14]]}
    rows = _run(tmp_path, monkeypatch, OneStateOff(), cfg)
    assert rows[0]["status"] == "incorrect" and "final_state worst sequence x head" in rows[0]["reason"]
    assert rows[0]["rel_l2_final_state"] < 8.1e-3 and rows[0]["local_rel_l2_final_state"] > 0.02


class FakeGraph:
    """Replays advance a fake clock by ``n * per_call`` ms."""

    def __init__(self, clock, n, per_call):
        self.clock, self.n, self.per_call = clock, n, per_call

    def replay(self):
        self.clock[0] += self.n * self.per_call


@pytest.fixture
def clock(monkeypatch):
    """A fake clock that CUDA events read and ``FakeGraph`` replays advance."""
    clock = [0.0]

    monkeypatch.setattr(timing, "_events", lambda: (FakeEvent(clock), FakeEvent(clock)))
    monkeypatch.setattr(timing, "_synchronize", lambda: None)
    return clock


def test_graph_batch_sample_is_replay_time_over_calls(clock):
    opts = C.Timing(min_samples=5, max_samples=5)
    samples, why = timing._time_replays(FakeGraph(clock, 40, 0.25), 40, opts, None)
    assert samples == [pytest.approx(0.25)] * 5 and why == "max_samples"
    # cold L2: the flushes' own time (measured in a graph of flushes alone) is subtracted
    samples, _ = timing._time_replays(FakeGraph(clock, 40, 0.25), 40, opts, None, subtract_ms=2.0)
    assert samples == [pytest.approx(0.2)] * 5


def test_calls_per_replay_fills_the_graph_budget():
    t = C.Timing(graph_ms=20.0)
    assert timing.calls_per_replay(0.5, t) == 40
    assert timing.calls_per_replay(50.0, t) == 1 and timing.calls_per_replay(1e-6, t) == 100
    assert timing.calls_per_replay(0.5, C.Timing(calls_per_graph=7)) == 7


def test_block_gate_on_token_outputs_of_rank_three():
    ref = torch.randn(1, 2048, 3)
    out = ref.clone()
    out[0, 1100:1200, 2] = 0
    assert correctness.token_local_err(out, ref, cu_seqlens_of([2048])) > 0.2


class StaleBuffer(ReferenceBackend):
    """Preallocates its outputs and fills them with the right answer in ``prepare`` (a warm-up
    call), then leaves the last token of ``o`` unwritten on every call."""

    def prepare(self, x, direction):
        inner = super().prepare(x, direction)
        o, ht = inner.fn()
        bufs = (o.clone(), ht.clone())

        def fn():
            o2, ht2 = inner.fn()
            bufs[0][0, :-1].copy_(o2[0, :-1])
            bufs[1].copy_(ht2)
            return bufs
        return Prepared(fn=fn, graph_safe=False, outputs=bufs)


def test_checked_call_poisons_preallocated_outputs():
    sw, x, ref = _tiny()
    be = StaleBuffer()
    prep = be.prepare(x, "fwd")
    outs, _ = correctness.checked_call(be, prep, x, "fwd", 0)
    assert torch.isnan(outs["o"][0, -1]).all() and not torch.isnan(outs["o"][0, :-1]).any()
    assert correctness.check_outputs(outs, ref, x, "fwd", sw)[2]


def test_marginal_ratio_tells_n_calls_from_the_work_of_one(clock, monkeypatch):
    launch, per_call, n = 0.01, 0.25, 40
    monkeypatch.setattr(timing, "_capture", lambda body: FakeGraph(clock, 1, per_call + launch))
    opts = C.Timing()
    honest = [(n * per_call + launch) / n] * 10  # n calls each doing its work, one launch
    lazy = [(per_call + launch) / n] * 10  # the n calls do the work of one
    r_honest = timing._marginal_ratio(None, n, honest, opts, lambda: None, False, 0.0)
    r_lazy = timing._marginal_ratio(None, n, lazy, opts, lambda: None, False, 0.0)
    assert r_honest == pytest.approx(1.0, abs=0.05) and r_lazy < 0.05
