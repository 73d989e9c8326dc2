"""The one place latency is measured. Backends hand over a callable; this module times it.

Modes (recorded per row in ``timing_mode``; rows of different modes are never compared):

- ``graph-batch`` (default, the published method, like triton's ``do_bench_cudagraph``): ``n``
  calls unrolled in one CUDA graph; each replay gives one sample = replay time / n. With
  ``l2: warm`` the L2 is flushed before each replay (outside the graph), so only the first call
  of a replay starts cold. With ``l2: cold`` a flush is captured *inside* the graph before every
  call, and the time of a graph holding the flushes alone is subtracted.
- ``graph-single``: one call per graph replay; a per-call distribution (adds graph launch
  overhead, visible on kernels under ~150 us).
- ``events``: per-call CUDA events around eager calls (includes host work); a fallback when a
  library cannot be captured, recorded as such.
- ``cpu``: wall clock around synchronous calls (the CPU reference path).

The number of calls unrolled per graph (``calls_per_sample``) is chosen per backend from its
eager time so that a replay lasts ~``graph_ms`` — as the published timer (tilelang/triton
``do_bench`` with the cudagraph backend) does; it is recorded per row, and ``calls_per_graph``
fixes it for every backend when an exactly equal unrolling is wanted.

Stopping rule: at least ``min_samples``; stop once the relative standard error of the mean of
the samples falls below ``rse_target``, or ``budget_s`` or ``max_samples`` is reached. All samples
are kept.

Every mode also hands back ``rerun``: the timed path run once more exactly as it was timed (the
graph replayed; one more call of the sample loop) and timed as a sample is, so the correctness
check can check what the timed calls compute and what they cost on inputs they have not seen.
A graph replay returns the outputs of every one of its n unrolled calls; where a backend writes
into buffers it preallocated (``Prepared.outputs``), those n outputs are the same tensors, so
only the last call's values are really compared there. Graph-batch with more than one call per
replay also measures ``marginal_ratio``, the marginal cost of an unrolled call over the mean:
n calls that do the work of one show it near 0 — the check that covers those aliased calls.
"""

from __future__ import annotations

import contextlib
import gc
import math
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from .config import Timing

L2_FLUSH_BYTES = 256 * 1024 * 1024  # > 5x the H200's 50 MB L2


@dataclass
class TimingResult:
    samples_ms: list[float]
    timing_mode: str
    l2: str
    calls_per_sample: int = 1
    stop_reason: str = ""
    fallback_reason: str = ""
    flush_ms: float | None = None
    #: runs the timed path once more exactly as it was timed (the timed graph replayed, or one
    #: timed-style call), timed as one sample is, and returns (the raw outputs of every call it
    #: made, its time in ms per call) for the check of the timed path
    #: (:func:`qlabench.correctness.check_timed_path`). The outputs of a graph's n calls are the
    #: tensors captured in it: n distinct ones where each call allocates its outputs, the same
    #: preallocated buffers n times where the backend writes into those (then only the last
    #: call's values are there to compare; ``marginal_ratio`` covers the other n - 1)
    rerun: Callable[[], tuple[list, float]] | None = None
    #: graph-batch with n > 1 calls per replay: (replay time - one-call replay time) / (n - 1)
    #: over the mean per-call time. About 1 when each unrolled call does its own work; near 0
    #: when the n calls do the work of one (the per-call latency would be n times too small)
    marginal_ratio: float | None = None

    @property
    def n_samples(self) -> int:
        return len(self.samples_ms)

    def stats(self) -> dict:
        s = sorted(self.samples_ms)
        if not s:
            return {"latency_ms": None, "p10_ms": None, "p90_ms": None, "iqr_ms": None,
                    "mean_ms": None, "rse": None}
        q = statistics.quantiles(s, n=20, method="inclusive") if len(s) > 1 else [s[0]] * 19
        mean = statistics.fmean(s)
        sd = statistics.stdev(s) if len(s) > 1 else 0.0
        return {
            "latency_ms": statistics.median(s),
            "p10_ms": q[1], "p90_ms": q[17], "iqr_ms": q[14] - q[4],
            "mean_ms": mean,
            "rse": (sd / math.sqrt(len(s)) / mean) if mean > 0 else None,
        }


def _rse(samples: list[float]) -> float:
    if len(samples) < 2:
        return float("inf")
    m = statistics.fmean(samples)
    return statistics.stdev(samples) / math.sqrt(len(samples)) / m if m > 0 else float("inf")


def _collect(sample: Callable[[], float], opts: Timing) -> tuple[list[float], str]:
    samples: list[float] = []
    t0 = time.perf_counter()
    while True:
        samples.append(sample())
        n = len(samples)
        if n >= opts.max_samples:
            return samples, "max_samples"
        if n >= opts.min_samples:
            if _rse(samples) < opts.rse_target:
                return samples, "rse"
            if time.perf_counter() - t0 > opts.budget_s:
                return samples, "budget"


@contextlib.contextmanager
def _no_gc() -> Iterator[None]:
    """Python's garbage collector off for a single timed call: a collection pause (tens of ms
    in a large process) inside one call is not the call's cost."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def once_ms(f: Callable[[], Any], mode: str) -> tuple[Any, float]:
    """Run ``f`` once, timed with the clock of timing mode ``mode``: wall clock around the call
    for ``cpu``, CUDA events on the current stream otherwise (the device synchronised before and
    after). Returns (what ``f`` returned, ms)."""
    with _no_gc():
        if mode == "cpu":
            t = time.perf_counter()
            out = f()
            return out, (time.perf_counter() - t) * 1e3
        _synchronize()
        a, b = _events()
        a.record()
        out = f()
        b.record()
        b.synchronize()
        return out, a.elapsed_time(b)


def measure_cpu(fn: Callable, opts: Timing) -> TimingResult:
    for _ in range(opts.warmup):
        fn()
    last: dict = {}

    def one() -> float:
        t = time.perf_counter()
        last["out"] = fn()
        return (time.perf_counter() - t) * 1e3

    samples, why = _collect(one, opts)
    return TimingResult(samples, "cpu", "n/a", 1, why, rerun=_rerun_of(one, last))


def _rerun_of(one: Callable[[], float], last: dict) -> Callable[[], tuple[list, float]]:
    """The ``rerun`` of a sample loop whose ``one()`` times one call and leaves its outputs in
    ``last``: one more sample, its outputs and its ms."""
    last.clear()

    def rerun() -> tuple[list, float]:
        with _no_gc():
            ms = one()
        return [last.pop("out")], ms
    return rerun


# ----------------------------------------------------------------------------- GPU


class _Flusher:
    def __init__(self):
        import torch
        self.buf = torch.empty(L2_FLUSH_BYTES // 4, dtype=torch.int32, device="cuda")

    def __call__(self):
        self.buf.zero_()


def _events():
    import torch
    return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)


def _capture(body: Callable[[], None]):
    """Capture ``body`` into a CUDA graph on a side stream (after a warm-up there)."""
    import torch
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        body()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        body()
    torch.cuda.synchronize()
    return g


def _synchronize() -> None:
    import torch
    torch.cuda.synchronize()


def calls_per_replay(est_ms: float, opts: Timing) -> int:
    """Calls unrolled in one graph-batch replay: ``calls_per_graph`` if set, else enough that a
    replay lasts ~``graph_ms`` (1 to 100)."""
    return opts.calls_per_graph or int(min(100, max(1, round(opts.graph_ms / max(est_ms, 1e-3)))))


def _time_replays(g, n_calls: int, opts: Timing, flush: _Flusher | None,
                  subtract_ms: float = 0.0) -> tuple[list[float], str]:
    """Samples of (replay time − ``subtract_ms``) / ``n_calls``: one per replay, in ms per call."""
    for _ in range(2):
        g.replay()
    _synchronize()

    return _collect(lambda: _replay_ms(g, n_calls, flush, subtract_ms), opts)


def _replay_ms(g, n_calls: int, flush: _Flusher | None, subtract_ms: float = 0.0) -> float:
    """One sample of a graph: (replay time − ``subtract_ms``) / ``n_calls``, in ms per call; the
    L2 flushed first (outside the timed region) when ``flush`` is given."""
    if flush is not None:
        flush()
    a, b = _events()
    a.record()
    g.replay()
    b.record()
    b.synchronize()
    return (a.elapsed_time(b) - subtract_ms) / n_calls


def estimate_call_ms(fn: Callable, reps: int = 3) -> float:
    import torch
    torch.cuda.synchronize()
    a, b = _events()
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / reps


def measure_gpu(fn: Callable, opts: Timing, graph_safe: bool = True) -> tuple[TimingResult, object]:
    """Time ``fn`` on the current CUDA device. Returns the result and the graph used (or None),
    so the caller can replay it for utilisation sampling."""
    import torch

    for _ in range(opts.warmup):
        fn()
    torch.cuda.synchronize()
    est = max(estimate_call_ms(fn), 1e-3)
    mode = opts.mode
    fallback = ""
    flusher = _Flusher()
    if mode in ("graph-batch", "graph-single") and not graph_safe:
        fallback, mode = "backend marks its call as not graph-capturable", "events"

    if mode in ("graph-batch", "graph-single"):
        n = 1 if mode == "graph-single" else calls_per_replay(est, opts)
        cold = opts.l2 == "cold"
        captured: list = []
        try:
            def body():
                captured.clear()
                for _ in range(n):
                    if cold:
                        flusher()
                    captured.append(fn())
            g = _capture(body)
            flush_ms = 0.0
            if cold:
                gf = _capture(lambda: [flusher() for _ in range(n)])
                fl, _ = _time_replays(gf, 1, opts.model_copy(update={"min_samples": 5,
                                                                      "max_samples": 20}), None)
                flush_ms = statistics.median(fl)
            samples, why = _time_replays(g, n, opts, None if cold else flusher, flush_ms)
            marginal = None
            if n > 1:
                marginal = _marginal_ratio(fn, n, samples, opts, flusher, cold, flush_ms)

            def rerun() -> tuple[list, float]:  # one more sample; every unrolled call's outputs
                with _no_gc():
                    ms = _replay_ms(g, n, None if cold else flusher, flush_ms)
                return list(captured), ms

            return TimingResult(samples, mode, opts.l2, n, why,
                                flush_ms=(flush_ms / n if cold else None),
                                rerun=rerun, marginal_ratio=marginal), g
        except Exception as e:  # capture failed: fall back to events, say so
            torch.cuda.synchronize()
            fallback = f"graph capture failed: {type(e).__name__}: {str(e)[:160]}"
            mode = "events"

    last: dict = {}

    def one() -> float:
        if opts.l2 == "cold":
            flusher()
        a, b = _events()
        a.record()
        last["out"] = fn()
        b.record()
        b.synchronize()
        return a.elapsed_time(b)

    samples, why = _collect(one, opts)
    return TimingResult(samples, "events", opts.l2, 1, why, fallback_reason=fallback,
                        rerun=_rerun_of(one, last)), None


#: replays of the one-call graph behind ``marginal_ratio``
MARGINAL_REPLAYS = 5


def _marginal_ratio(fn: Callable, n: int, samples: list[float], opts: Timing,
                    flusher: _Flusher, cold: bool, flush_ms: float) -> float:
    """Marginal cost of an unrolled call over the mean per-call cost: a graph of the same call
    captured as the timed graph was, one call instead of n, is replayed as it was (L2 flushed
    before each replay, or inside the graph and its time subtracted); (n x the timed per-call
    median - the one-call replay's median) / (n - 1), over the per-call median."""
    def body():
        if cold:
            flusher()
        fn()
    g1 = _capture(body)
    one, _ = _time_replays(g1, 1, opts.model_copy(update={
        "min_samples": MARGINAL_REPLAYS, "max_samples": MARGINAL_REPLAYS}),
        None if cold else flusher, flush_ms / n if cold else 0.0)
    del g1
    per_call = statistics.median(samples)
    if per_call <= 0:
        return float("nan")
    return (n * per_call - statistics.median(one)) / (n - 1) / per_call
