"""The measurement of one task (a point x direction and its backends), in a worker or in process.

For each backend of a :class:`Task`: its availability and support, then (the inputs and the
reference built once, lazily, for the task) :func:`measure_backend` — prepare, the correctness
check (:mod:`qlabench.correctness`), timing, the timed path checked on fresh inputs (every call of one
more replay or timed-style call, and its cost against the timed samples) and one more eager call, kernel breakdown and derived metrics
against the run's ceilings — and one row each, sent through ``emit``. An exception costs that
backend's row, not the task: ``unsupported`` where the backend says the library refused the
configuration (:meth:`Backend.refusal <qlabench.backends.base.Backend.refusal>`), else ``oom`` /
``crashed``. A row's
identity (:func:`base_row`) includes the device it was measured on (:func:`device_uuid`).
"""

from __future__ import annotations

import gc
import os
import random
import sys
import time
import traceback
from dataclasses import fields

import torch

from . import backends as B
from . import metrics, timing
from .config import Sweep
from .correctness import check_outputs, check_timed_path, checked_call, reference_outputs, refill
from .rows import identity, merge, noted, outcome
from .sweep import Point, Task
from .workloads import Inputs, make


def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


def _gpu_index() -> int | None:
    """Physical GPU index of this process (a worker pinned by ``CUDA_VISIBLE_DEVICES``)."""
    pinned = os.environ.get("QLABENCH_GPU_INDEX")
    if pinned is not None:
        return int(pinned)
    return torch.cuda.current_device() if torch.cuda.is_available() else None


_UUIDS: dict = {}


def device_uuid() -> str:
    """This process's device: the CUDA device's UUID (``GPU-…``, as ``nvidia-smi -L`` prints it),
    or ``cpu:<hostname>``. Rows pair as "same GPU" only when these are equal."""
    if not torch.cuda.is_available():
        import socket
        return f"cpu:{socket.gethostname()}"
    return uuid_of(torch.cuda.current_device())


def uuid_of(i: int) -> str:
    if i not in _UUIDS:
        u = str(getattr(torch.cuda.get_device_properties(i), "uuid", "") or "")
        _UUIDS[i] = u if u.startswith("GPU-") else (f"GPU-{u}" if u else f"cuda:{i}:unknown")
    return _UUIDS[i]


def base_row(run_id: str, sha: str, cfg: str, p: Point, direction: str, be_name: str,
             be_version: str, gpu_name: str, campaign_id: str | None = None,
             be_lib: str | None = None, be_params: str = "{}") -> dict:
    """The identity of a row (:func:`qlabench.rows.identity`) measured by this process, on its
    device; ``be_name`` is the backend entry's label, ``be_lib`` its registry name (default: the
    label), ``be_params`` its non-default parameters (JSON)."""
    return identity(run_id, sha, cfg, p, direction, be_name, be_version, gpu_name, _gpu_index(),
                    device_uuid(), campaign_id, be_lib, be_params)


#: the timed graph's unrolled calls must each cost at least this share of the mean per-call
#: time (``timing.TimingResult.marginal_ratio``); n calls doing the work of one give ~0, and a
#: first call slowed by a cold L2 or the graph's launch moves an honest ratio by a few percent
MIN_MARGINAL_RATIO = 0.5
#: the check's rerun of the timed path on fresh inputs is one more sample, timed as the samples
#: were (:attr:`timing.TimingResult.rerun`); it may cost up to RERUN_FACTOR x the larger of the
#: timed p90 and a rerun on the point's own inputs just before it, per call, plus RERUN_FLOOR_MS
#: per rerun (one graph launch or eager call: launch latency, a host
#: thread descheduled, a clock still ramping up after the host-side check), before the row is
#: ``incorrect``: timed calls that skip work a call on unseen inputs does (an answer cached
#: against a fingerprint of the inputs) are cheaper than the rerun by the work skipped. An
#: honest rerun costs one sample (up to 3x covers a GPU clock drop of 1.4x and a loaded CPU
#: host's jitter with room to spare); chosen, not derived: docs/correctness.md
RERUN_FACTOR = 3.0
RERUN_FLOOR_MS = 1.0
#: ``Prepared.refresh`` (one eager call after fresh inputs are written, outside timing) is timed
#: and recorded (``refresh_ms``), not judged: an eager refresh's time holds host work honest
#: backends do outside the timed call by design (planning, launches, host syncs) — on the H200 the
#: forward FLA, FlashQLA and ours re-derive for a backward of 64 short sequences took 2.3-10 ms
#: against a graph-timed p90 of 0.3-0.8 ms —, so no bound on it separates work moved into refresh
#: from an honest refresh
#: sets of fresh inputs a rerun that does not fit is measured on before the row is ``incorrect``,
#: the point's own inputs re-timed before each further set (an honest rerun stalled by the host
#: rarely stalls three times; skipped work never fits)
FRESH_SETS = 3


def timed_path_costs(chk, p90_ms: float, own_ms: float | None = None) -> str:
    """Why the cost of the timed path's rerun (:class:`correctness.TimedPathCheck`) does not fit
    the timed path's cost on the point's own inputs, or "" where it does: above ``RERUN_FACTOR``
    x the larger of the timed samples' p90 and ``own_ms`` (the path rerun on its own inputs just
    before the fresh set, ms per call) + ``RERUN_FLOOR_MS`` / its calls per call."""
    if chk.rerun_ms is None or not chk.calls:
        return ""
    base = max(p90_ms, own_ms or 0.0)
    lim = RERUN_FACTOR * base + RERUN_FLOOR_MS / chk.calls
    if chk.rerun_ms <= lim:
        return ""
    over = f"the timed p90 ({p90_ms:.3g} ms)" if own_ms is None else (
        f"the larger of the timed p90 ({p90_ms:.3g} ms) and the rerun on the point's own inputs "
        f"just before ({own_ms:.3g} ms)")
    return (f"the timed path's rerun on fresh inputs took {chk.rerun_ms:.3g} ms per call, above "
            f"{RERUN_FACTOR:g}x {over} + {RERUN_FLOOR_MS:g} ms / {chk.calls} calls = {lim:.3g} ms: "
            "the timed calls skipped work a call on inputs it has not seen does (an answer cached "
            "against the inputs?)")


def fresh_inputs(p: Point, direction: str, device: str, seed: int) -> Inputs:
    """Inputs of ``p`` drawn from another seed: the values the timed path is checked on."""
    return make(p, device, with_grads=direction != "fwd", seed=seed)


def correctness_fields(outs: dict, ref: dict, x: Inputs, direction: str,
                       sweep: Sweep) -> tuple[dict, list[str]]:
    """The correctness figures of one call's outputs (:func:`correctness.check_outputs`): each
    output's ``rel_l2_*``, ``max_abs_*``, ``local_rel_l2_*``, the worst (``max_rel_l2``,
    ``worst_block_rel_l2``); and the problems found."""
    figures: dict = {}
    worst, worst_loc, bad = check_outputs(outs, ref, x, direction, sweep, figures)
    return {**figures, "max_rel_l2": worst, "worst_block_rel_l2": worst_loc}, bad


def clock_fields(before: dict, after: dict) -> dict:
    """The SM clock around a timing (:func:`metrics.clocks` before and after) and whether the
    GPU was throttled during it."""
    return {"sm_clock_mhz_before": before.get("sm_clock_mhz"),
            "sm_clock_mhz_after": after.get("sm_clock_mhz"),
            "throttled": metrics.throttled(before.get("throttle_reasons"))
            or metrics.throttled(after.get("throttle_reasons"))}


def timing_fields(tr: timing.TimingResult) -> dict:
    """A timing's fields: its statistics, samples, mode and how it stopped."""
    st = tr.stats()
    return dict(latency_ms=st["latency_ms"], p10_ms=st["p10_ms"], p90_ms=st["p90_ms"],
                iqr_ms=st["iqr_ms"], mean_ms=st["mean_ms"], rse=st["rse"],
                samples_ms=tr.samples_ms, n_samples=tr.n_samples, timing_mode=tr.timing_mode,
                timing_fallback=tr.fallback_reason, stop_reason=tr.stop_reason,
                calls_per_sample=tr.calls_per_sample, l2=tr.l2, marginal_ratio=tr.marginal_ratio)


def kernel_fields(be: B.Backend, prep, reason: str, dispatched: bool = False) -> dict:
    """The kernels one call launches (:func:`qlabench.profile.kernel_breakdown`): the top one,
    its CTAs, the kernels per call, and, unless the library's dispatch named the route
    (``dispatched``, :func:`dispatch_fields`), the path the backend names from the kernels.
    Profiling is a bonus: where it fails, ``reason`` (the row's so far) says so, and what was
    found before is kept."""
    out: dict = {}
    try:
        from .profile import kernel_breakdown, stored_kernels
        kb = kernel_breakdown(prep.fn)
        if kb:
            top = kb[0]
            out["top_kernel"] = top["name"][:200]
            out["ctas"] = top.get("ctas")
            sms = torch.cuda.get_device_properties(0).multi_processor_count
            out["ctas_per_sm"] = (top["ctas"] / sms) if top.get("ctas") else None
            out["kernels_per_call"] = sum(k["calls"] for k in kb)
            out["kernels"] = stored_kernels(kb)
            if not dispatched:
                out["path"] = be.path([k["name"] for k in kb])
    except Exception as e:  # never fails a row
        out["reason"] = (reason or "") + f" profile failed: {type(e).__name__}"
    return out


def dispatch_fields(route) -> dict:
    """The row's ``path`` as the library's dispatch chose it (``route()`` of
    :meth:`Backend.dispatch_route <qlabench.backends.base.Backend.dispatch_route>`); nothing
    where the library has no dispatch to ask."""
    path = route()
    return {} if path is None else {"path": path}


def derived_fields(direction: str, latency_ms: float | None, x: Inputs, dtype: str,
                   ceilings: dict, gpu: bool) -> dict:
    """The derived metrics (:func:`metrics.derive`) against the run's ``ceilings``; no roofline
    for a CPU timing (the roofline is the GPU's)."""
    c = ceilings or {}
    out = metrics.derive(direction, latency_ms, x.T, x.h_qk, x.h_v, x.N, x.q.shape[-1], dtype,
                         c.get("matmul_tflops"), c.get("copy_gbps"), x.h0 is not None,
                         x.output_final_state)
    if not gpu:
        out.update(roofline_ms=None, pct_roofline=None)
    return out


def measure_backend(be: B.Backend, x: Inputs, direction: str, ref: dict, sweep: Sweep,
                    row: dict, expected_out_bytes: int, ceilings: dict,
                    fresh=None, parts: list | None = None, own=None) -> dict:
    """Prepare, check, time one backend on one point × direction, then check the timed path on
    fresh inputs (:func:`correctness.check_timed_path`; its rerun held against the timed samples,
    :func:`timed_path_costs`) and one more eager call. ``fresh()``: (fresh
    inputs of the point, their reference, their seed) — a new seed, recorded as ``check_seed``;
    None: no check of the timed path (unit use only). ``own()``: the point's own inputs again
    (the values the samples are timed on), written back to re-time the path before a further
    fresh set where one does not fit. ``ceilings``: the run's measured GPU
    ceilings (``matmul_tflops``, ``copy_gbps``; empty: no roofline), which the derived columns
    use. Returns the row: ``row`` (its identity) and the steps' fields (correctness figures,
    timing, kernels, derived metrics, outcome: :mod:`qlabench.rows`), merged at the end; each
    step's fields are appended to ``parts`` as they come (what a row that raised keeps).
    ``x`` holds the fresh values afterwards."""
    t_wall = time.perf_counter()
    steps = [] if parts is None else parts

    def failed(reason: str) -> dict:
        return merge(row, *steps, outcome("incorrect", reason, latency_ms=None,
                                          wall_s=time.perf_counter() - t_wall))

    prep = be.prepare(x, direction)
    with be.dispatch_route() as route:  # the route the library's dispatch takes, also on a raise
        try:
            outs, compile_s = checked_call(be, prep, x, direction, expected_out_bytes)
        finally:
            dispatched = dispatch_fields(route)
            steps.append(dispatched)
    steps.append({"compile_s": compile_s})
    figures, bad = correctness_fields(outs, ref, x, direction, sweep)
    del outs
    steps.append(figures)
    if bad:
        return failed("; ".join(bad))

    gpu = torch.cuda.is_available() and sweep.timing.mode != "cpu"
    graph = None

    def time_it():
        """Time the path on the values in ``x``'s buffers; its fields into ``steps``."""
        nonlocal graph
        if gpu:
            for attempt in range(2):  # a throttled measurement is re-measured once
                c0 = metrics.clocks()
                tr, graph = timing.measure_gpu(prep.fn, sweep.timing, prep.graph_safe)
                clocks = clock_fields(c0, metrics.clocks())
                steps.append(clocks)
                if not clocks["throttled"]:
                    break
                if attempt == 0:
                    steps.append({"reason": "throttled (NVML clock-event reasons); re-measured once"})
        else:
            tr = timing.measure_cpu(prep.fn, sweep.timing.model_copy(update={"mode": "cpu"}))
        timed = timing_fields(tr)
        steps.append(timed)
        if tr.marginal_ratio is not None and not tr.marginal_ratio >= MIN_MARGINAL_RATIO:
            return tr, timed, (f"the {tr.calls_per_sample} calls unrolled in the timed graph "
                               f"cost about as much as one (marginal cost {tr.marginal_ratio:.2f} "
                               f"of the mean, below {MIN_MARGINAL_RATIO}): the latency would not "
                               "be one call's")
        return tr, timed, ""

    tr, timed, why = time_it()
    if why:
        return failed(why)
    if fresh is not None:  # what the timed path computes, on inputs it has not seen
        seeds, first = [], ""
        for attempt in range(FRESH_SETS):  # a cost that does not fit is confirmed on more sets
            x2, ref, seed = fresh()
            seeds.append(seed)
            # the path once more on the point's own inputs, right before the fresh set: what a
            # call costs on a host and GPU in the state the fresh rerun finds them (after the
            # fresh inputs' reference, a cold thread pool, a clock ramping up); timed calls that
            # skip work on those inputs skip it here too
            _, own_ms = tr.rerun()
            chk = check_timed_path(be, prep, tr.rerun, x, x2, direction, ref, sweep,
                                   clock=lambda f, mode=tr.timing_mode: timing.once_ms(f, mode))
            del x2
            steps.append({"check_seed": seed, "timed_max_rel_l2": chk.worst,
                          "rerun_ms": chk.rerun_ms, "refresh_ms": chk.refresh_ms})
            if chk.bad:
                return failed(f"the timed path ({tr.timing_mode}) on fresh inputs differs "
                              "from their reference (another path when timed, or an answer "
                              "cached from the checked inputs?): " + "; ".join(chk.bad))
            slow = timed_path_costs(chk, timed["p90_ms"], own_ms)
            if not slow:
                if timed_path_costs(chk, timed["p90_ms"]):  # what a reader of rerun_ms and p90_ms needs
                    steps.append({"reason": noted(merge(row, *steps).get("reason"), (
                        f"the rerun on fresh inputs of seed {seed} ({chk.rerun_ms:.3g} ms per "
                        f"call) fits the rerun on the point's own inputs just before it "
                        f"({own_ms:.3g} ms), not the timed p90 ({timed['p90_ms']:.3g} ms)"))})
                break
            if attempt == FRESH_SETS - 1:
                return failed(f"{slow} (on {FRESH_SETS} sets of fresh inputs, seeds "
                              f"{', '.join(map(str, seeds))}, the point's own inputs re-timed "
                              "before each further set)")
            first = first or slow
            # the inputs the samples were timed on back in their buffers, and the timing again
            # (the row keeps the new samples): timed calls that skip work on those inputs are as
            # cheap as before, and the next set does not fit either; a machine slowed by load
            # since the samples, or a backend that computes once it has seen other inputs, is
            # timed at what it costs now
            refill(x, own())
            if prep.refresh is not None:
                prep.refresh()
            tr, timed, why = time_it()
            if why:
                return failed(why)
        if len(seeds) > 1:  # a host hiccup: a later set's cost fits the new samples
            steps.append({"reason": noted(merge(row, *steps).get("reason"), (
                f"on fresh inputs of seed {seeds[0]}: {first}; re-timed on the point's own "
                f"inputs, on seed {seeds[-1]} the costs fit the timed samples"))})
    tr.rerun = None
    # one more eager call, poisoned (races, state carried between calls)
    outs, _ = checked_call(be, prep, x, direction, expected_out_bytes)
    _, _, bad2 = check_outputs(outs, ref, x, direction, sweep)
    del outs
    if bad2:
        return failed("a call after timing was wrong (race or state carried between "
                      "calls?): " + "; ".join(bad2))
    if gpu and sweep.timing.gpm:
        replay = graph.replay if graph is not None else prep.fn
        steps.append(metrics.gpm_sample(replay))
    if gpu:
        steps.append(kernel_fields(be, prep, merge(row, *steps).get("reason"), bool(dispatched)))
    steps.append(derived_fields(direction, timed["latency_ms"], x, row["dtype"], ceilings, gpu))
    return merge(row, *steps, outcome("ok", wall_s=time.perf_counter() - t_wall))


def crash_reason(e: BaseException, frames: int = 4) -> str:
    """A crashed row's ``reason``: the exception and message (300 characters at most), then
    where it was raised, innermost frame first, as whole ``file:line function`` items (never a
    traceback cut mid-line)."""
    tb = traceback.extract_tb(e.__traceback__)[-frames:]
    where = " < ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in reversed(tb))
    return f"{type(e).__name__}: {str(e)[:300]}" + (f" | at {where}" if where else "")


def row_for(task: Task, backend: str) -> dict:
    c = task.ctx
    return base_row(c["run_id"], c["sha"], c["config"], task.point, task.direction, backend,
                    c["versions"][backend], c["gpu_name"], c.get("campaign_id"),
                    c.get("names", {}).get(backend), c.get("params_json", {}).get(backend, "{}"))


def _log_seconds(what: str, t0: float) -> None:
    """``--- <what>: <s> s`` on stderr (the worker's log), the device's queued work included."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    print(f"--- {what}: {time.perf_counter() - t0:.2f} s", file=sys.stderr, flush=True)


def _same_layout(x: Inputs, own: Inputs) -> bool:
    """What :func:`refill` does not restore is as the point made it: ``cu_seqlens``' values,
    every other tensor field a tensor of its shape, the fields that are not tensors
    (``output_final_state``, ...) equal."""
    for f in fields(Inputs):
        a, b = getattr(x, f.name), getattr(own, f.name)
        if isinstance(b, torch.Tensor):
            if not isinstance(a, torch.Tensor) or a.shape != b.shape \
                    or (f.name == "cu_seqlens" and not torch.equal(a, b)):
                return False
        elif isinstance(a, torch.Tensor) or a != b:
            return False
    return True


def measure_task(sweep: Sweep, task: Task, emit) -> None:
    """Measure every backend of ``task``; ``emit(kind, payload)`` gets ("start", backend) before
    each backend and ("row", row) after it. Runs in the worker (or in-process)."""
    p, direction = task.point, task.direction
    dev = device()
    x = ref = None
    ceilings = task.ctx.get("ceilings") or {}
    for n in task.backends:
        emit("start", n)
        row = row_for(task, n)
        ok, why = task.ctx["avail"][n]
        status = "unavailable"
        if ok:
            try:
                be = B.get(task.ctx.get("names", {}).get(n, n), task.ctx.get("params", {}).get(n))
            except Exception as e:  # the backend's module does not load in this worker
                ok, why = False, f"backend does not load: {type(e).__name__}: {str(e)[:200]}"
        if ok:
            ok, why = be.supports(p, direction)
            status = "unsupported"
        if not ok:
            row = merge(row, outcome(status, why))
        else:
            parts: list = []  # the fields measured so far: what a backend that raised keeps
            raised = False
            try:
                if x is None:
                    t_ref = time.perf_counter()
                    x = make(p, dev, with_grads=direction != "fwd")
                    ref = reference_outputs(x, direction, sweep.reference.impl,
                                            sweep.reference.dtype)
                    _log_seconds("the point's inputs and reference", t_ref)
                out_bytes = (x.v.numel() * 2 + (x.h0.numel() * 4 if x.h0 is not None else 0)) \
                    * (1 if direction == "fwd" else 3)

                def fresh():
                    t_ref = time.perf_counter()
                    seed = random.SystemRandom().randrange(1, 2 ** 31)
                    x2 = fresh_inputs(p, direction, dev, seed)
                    ref2 = reference_outputs(x2, direction, sweep.reference.impl,
                                             sweep.reference.dtype)
                    _log_seconds("fresh inputs and their reference", t_ref)
                    return x2, ref2, seed
                def own():
                    return make(p, dev, with_grads=direction != "fwd")
                try:
                    row = measure_backend(be, x, direction, ref, sweep, row, out_bytes,
                                          ceilings, fresh, parts, own)
                finally:  # the next backend starts from the point's own inputs
                    try:
                        mine = own()
                        if _same_layout(x, mine):
                            refill(x, mine)
                        else:  # the backend rewrote the layout: the point's inputs made anew
                            x = mine
                        mine = None
                    except Exception as e:  # never in place of the row's own outcome
                        print(f"--- the point's inputs not restored ({crash_reason(e, 2)}): "
                              "rebuilt for the next backend", file=sys.stderr, flush=True)
                        x = ref = mine = None
            except Exception as e:
                raised = True
                status = "oom" if _is_oom(e) else "crashed"
                refused = None if status == "oom" else be.refusal(e)
                if refused is not None:  # the library's own "not this configuration"
                    row = merge(row, *parts, outcome("unsupported", refused))
                else:
                    row = merge(row, *parts, outcome(status, crash_reason(e)))
                if status == "oom" or ref is None:
                    x = ref = None  # free what we hold (or what has no reference); rebuilt next
            if raised and torch.cuda.is_available():  # past the handler: its traceback's frames gone
                gc.collect()
                torch.cuda.empty_cache()
        emit("row", row)
    del x, ref
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
