"""Where a run's tasks are measured: one interface, given the sweep once.

An executor is made with the sweep, its backend entries and the run's timeline
(:func:`executor_for`), and then:

- :meth:`WorkerPool.start` starts what measures, first thing: each worker imports torch and its
  library while the run reads its results directory and the GPU's ceilings;
- :meth:`WorkerPool.check` waits for the backends' checks (the first available label's, or
  every label's) and holds what they found: ``avail`` (label -> (available, reason)),
  ``versions``, ``worker_meta`` (each worker's timeline and warm-up seconds);
- :meth:`WorkerPool.run` measures the run's (point, direction) x labels and hands each row to
  ``on_row`` the moment it is made (the run stores it before the next: nothing finished is lost
  on Ctrl-C or a crash); :meth:`WorkerPool.submit` measures one :class:`~qlabench.sweep.Task`;
- :meth:`WorkerPool.close` ends everything started, however the run ends.

The implementations: :class:`WorkerPool`, supervised worker processes
(:class:`qlabench.supervisor.Lanes`: one worker per backend library on each GPU of ``--gpus``) —
on one GPU each (point, direction) x label in sweep order among the labels checked so far
(:func:`dispatch_one_gpu`), on several whole tasks heaviest first from one queue
(:func:`share_between_gpus`); :class:`InProcess` (``isolate: false``): the same schedule, the
labels checked and measured in this process (an entry with an environment of its own still
gets its worker). A run with no points checks its backends (:func:`check_backends`) and measures
nothing. Slurm (:mod:`qlabench.cluster`) sits one level up: each of its jobs is a whole run, with
an executor of its own, into a shard directory merged afterwards.

Nothing here imports torch: a worker does, and the run's process only once its workers started.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .config import label_version_problem
from .rows import merge, noted
from .supervisor import Lanes, check_backend, host_cores, probe_backends, worker_environment
from .sweep import Task, point_cost

__all__ = ["InProcess", "WorkerPool", "check_backends", "check_isolated", "dispatch_one_gpu",
           "early_rows", "executor_for", "pin", "share_between_gpus"]


def pin(device: str | None) -> dict | None:
    """The environment that pins a worker to CUDA device ``device``."""
    return {"CUDA_VISIBLE_DEVICES": device, "QLABENCH_GPU_INDEX": device} if device else None


def early_rows(n_workers: int) -> bool:
    """Whether a run's rows may start while other backends' workers still import their
    libraries: ``$QLABENCH_EARLY_ROWS`` 1 / 0, else where this host has a core for every worker
    and one more (a row measured meanwhile then shares the host with none of them)."""
    forced = os.environ.get("QLABENCH_EARLY_ROWS", "").strip()
    if forced not in ("", "0", "1"):
        raise ValueError(f"QLABENCH_EARLY_ROWS={forced!r}: expected 1 (rows start at the first "
                         "backend's check), 0 (after every check) or unset (by this host's cores)")
    if forced:
        return forced == "1"
    return host_cores() > n_workers


class WorkerPool:
    """The run's tasks in supervised workers: one :class:`~qlabench.supervisor.Lanes` per GPU of
    ``devices`` (the current one without), each one worker per backend library (all of this
    environment's libraries in one worker on a host without a core for each: :func:`early_rows`).
    ``timeline``: the run's (seconds from ``t_run``), which the pool marks (``worker_started``,
    ``first_ready``, ``backends_checked``)."""

    isolate = True

    def __init__(self, sweep, entries: dict, log_dir: Path, log, devices: list[str] | None,
                 timeline: dict, t_run: float):
        self.sweep, self.entries, self.log_dir, self.log = sweep, entries, Path(log_dir), log
        self.names = list(entries)
        self.devices = devices
        self.one_device = not (devices and len(devices) > 1)
        self.timeline, self.t_run = timeline, t_run
        # what a refused run keeps of the log directory (a worker's log is named by this
        # process's id: a run in the process of an earlier one appends to the earlier one's log)
        self.earlier_logs = set(self.log_dir.iterdir()) if self.log_dir.is_dir() else None
        self.stop = None if self.one_device else threading.Event()
        self._started = contextlib.ExitStack()  # every worker started is closed however the run ends
        own = {n: e for n, e in entries.items() if e.own_environment}
        pool = ThreadPoolExecutor(max_workers=max(1, len(own)))
        self._started.callback(pool.shutdown, wait=False, cancel_futures=True)
        self.probes = {n: pool.submit(worker_environment, e) for n, e in own.items()}
        # one worker per library where the host has a core for each (and rows may start before
        # every check), else one for every library of this environment
        self.early = early_rows(len({e.name for e in entries.values() if not e.own_environment})
                                + len(own))
        self.lanes: dict = {}  # device -> its Lanes
        self.avail: dict = {}  # label -> (available, reason), in the config's order once checked
        self.versions: dict = {}
        self.worker_meta: dict = {"worker_timeline_s": {}, "worker_warm_s": {}}

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _now(self) -> float:
        return round(time.time() - self.t_run, 3)

    @property
    def _first(self) -> Lanes | None:
        """The lanes whose checks are the run's (the first GPU's)."""
        if not self.lanes:
            return None
        return self.lanes.get(self.devices[0] if self.devices else None)

    def start(self) -> None:
        """One worker per backend label (per GPU), each importing its library now."""
        for dev in ([self.devices[0] if self.devices else None] if self.one_device
                    else self.devices):
            ln = Lanes(self.sweep, self.log_dir, self.log, self.entries, self.probes, pin(dev),
                       self.stop, isolate=self.isolate or not self.one_device,
                       per_library=self.early)
            self._started.callback(ln.close)
            ln.start()
            self.lanes[dev] = ln
        self.timeline["worker_started"] = self._now()

    def _resolve(self, n: str) -> None:
        """Label ``n``'s check is in (its worker's report)."""
        lane = self._first.lanes[n]
        self.avail[n], self.versions[n] = lane.avail, lane.version
        if lane.report:
            self.worker_meta["worker_timeline_s"][n] = {
                k: round(float(v) - self.t_run, 3)
                for k, v in (lane.report.get("timeline") or {}).items() if isinstance(v, (int, float))}
            self.worker_meta["worker_warm_s"][n] = round(float(
                (lane.report.get("warm_s") or {}).get(lane.name, 0.0)), 3)
        if len(self.avail) == len(self.names):
            self.timeline["backends_checked"] = self._now()

    def check(self, wait_all: bool) -> None:
        """Wait for the checks: each label's worker's (of the first GPU; this process's when the
        points run here) until the first label is available, or every label with ``wait_all``
        (and where none is available); without workers (no points), each backend in an
        interpreter of its own."""
        first = self._first
        if first is None:
            names = list(dict.fromkeys(e.name for e in self.entries.values()
                                       if not e.own_environment))
            device = self.devices[0] if self.devices else None
            avail, versions, _ = check_backends(
                self.entries, found=probe_backends(names, pin(device)) if self.isolate else None,
                probes=self.probes)
            self.avail.update(avail)
            self.versions.update(versions)
            self.timeline["backends_checked"] = self.timeline["first_ready"] = self._now()
        else:
            while True:
                for n in sorted(first.resolved() - self.avail.keys()):
                    self._resolve(n)
                if len(self.avail) == len(self.names) or (
                        not wait_all and any(a[0] for a in self.avail.values())):
                    break
                first.poll(0.2)
            self.timeline["first_ready"] = self._now()
        self.avail = {n: self.avail[n] for n in self.names if n in self.avail}

    def environments(self) -> dict:
        """label -> its worker's interpreter and environment, for the entries with one of their
        own whose check is in."""
        out = {}
        for n, f in self.probes.items():
            if f.done() and f.result()[0] is not None:
                w = f.result()[0]
                out[n] = {"python": w.python, **w.env}
        return out

    def submit(self, task: Task, on_row, device: str | None = None) -> None:
        """One task's labels in order, each in its label's worker (of ``device``; the first
        GPU's by default), each row to ``on_row`` as it is made."""
        ln = self.lanes[device] if device is not None else self._first
        for n in task.backends:
            ln.run(n, Task(task.point, task.direction, [n], task.ctx), on_row)

    def run(self, order: list, todo, ctx: dict, on_row, progress=None, on_check=None) -> None:
        """Every (point, direction) of ``order`` x label of the run: ``todo(label)``, the indices
        of ``order`` the label still measures (asked once its version is known); ``ctx``, the
        run's :class:`~qlabench.sweep.Task` context (its ``avail`` this pool's); ``on_check(label)``
        after a label's check came in once the rows started."""
        if not self.one_device:
            per = {n: set(todo(n)) for n in self.names}
            tasks = [Task(p, d, [n for n in self.names if i in per[n]], ctx)
                     for i, (p, d) in enumerate(order) if any(i in per[n] for n in self.names)]
            share_between_gpus(tasks, self.lanes, on_row, progress, self.log, self.stop)
        elif self._first is not None:
            def checked_later(n: str) -> None:
                self._resolve(n)
                if on_check is not None:
                    on_check(n)
            dispatch_one_gpu(self._first, order, self.names, todo, checked_later, ctx, on_row,
                             progress)

    def discard_logs(self) -> None:
        """Remove the logs a refused run's (closed) workers created: those the log directory
        did not hold before the run (the directory too, if the run made it and it is empty)."""
        for ln in self.lanes.values():
            for lane in ln.lanes.values():
                for f in (lane.sup.log_paths if lane.sup else []):
                    if f not in (self.earlier_logs or ()):
                        f.unlink(missing_ok=True)
        if self.earlier_logs is None:
            with contextlib.suppress(OSError):
                self.log_dir.rmdir()

    def close(self) -> None:
        self._started.close()


class InProcess(WorkerPool):
    """``isolate: false``: the labels of this process's environment checked and measured here
    (:class:`qlabench.supervisor.InProcess`), in the one-GPU order of :class:`WorkerPool` — a
    crash costs the run. What tests of the measuring path and
    ``scripts/airgapped/correctness_acceptance.py`` use. Over several GPUs the labels still run
    in workers, one set per GPU."""

    isolate = False


def executor_for(sweep, entries: dict, log_dir: Path, log, devices: list[str] | None,
                 isolate: bool, timeline: dict, t_run: float) -> WorkerPool:
    """The run's executor: :class:`WorkerPool` with ``isolate``, else :class:`InProcess`."""
    return (WorkerPool if isolate else InProcess)(sweep, entries, log_dir, log, devices,
                                                  timeline, t_run)


def dispatch_one_gpu(lanes: Lanes, order: list, names: list, todo, on_resolved, ctx: dict,
                     on_row, progress) -> None:
    """One GPU: each (point, direction) x label of ``order`` in its label's worker, in sweep order
    among the labels resolved so far (asked again before every row); a label resolved later (a
    slower import) catches up from its first point. ``todo(label)``: the indices of ``order``
    the label still measures. A row measured while other labels' workers were still starting
    says so in its ``reason``. ``progress`` is called once per (point, direction)."""
    rank = {n: i for i, n in enumerate(names)}
    pending = {n: deque(todo(n)) for n in names if n in lanes.resolved() and n in ctx["avail"]}
    begun: set = set()
    while True:
        lanes.poll(0.0)
        for n in sorted(lanes.resolved() - pending.keys(), key=rank.get):
            on_resolved(n)
            pending[n] = deque(todo(n))
        heads = [(q[0], rank[n], n) for n, q in pending.items() if q]
        if not heads:
            if len(pending) == len(names):
                return
            lanes.poll(0.2)
            continue
        i, _, n = min(heads)
        pending[n].popleft()
        p, d = order[i]
        if progress is not None and i not in begun:
            progress(f"{p.describe()} {d}")
        begun.add(i)
        others = [m for m in lanes.starting() if m != n]

        def noting(row: dict, others=others) -> None:
            if others:
                note = f"measured while the workers of {', '.join(others)} were starting"
                row = merge(row, {"reason": noted(row.get("reason"), note)})
            on_row(row)

        lanes.run(n, Task(p, d, [n], ctx), noting)


def share_between_gpus(tasks, lanes: dict, on_row, progress, log, stop: threading.Event) -> None:
    """Several GPUs: each GPU's :class:`~qlabench.supervisor.Lanes` (``lanes``: device -> its
    lanes, one worker per label pinned with ``CUDA_VISIBLE_DEVICES``) takes tasks heaviest first
    from one queue, so the GPUs finish close together; a task's labels run in its order, each
    once that GPU's worker for it is resolved."""
    q: queue.Queue = queue.Queue()
    for t in sorted(tasks, key=lambda t: -point_cost(t.point, len(t.backends))):
        q.put(t)
    errors: list[BaseException] = []

    def serve(dev: str) -> None:
        ln = lanes[dev]
        try:
            while not stop.is_set():
                try:
                    t = q.get_nowait()
                except queue.Empty:
                    return
                if progress is not None:
                    progress(f"[gpu {dev}] {t.point.describe()} {t.direction}")
                for n in t.backends:
                    while n not in ln.resolved() and not stop.is_set():
                        ln.poll(0.2)
                    if stop.is_set():
                        return
                    if not t.ctx["avail"][n][0] and ln.lanes[n].avail[0]:  # the run's check said no
                        ln.refuse(n, t.ctx["avail"][n][1])
                    ln.run(n, Task(t.point, t.direction, [n], t.ctx), on_row)
        except BaseException as e:  # surfaced to the caller after the others stop
            errors.append(e)
        finally:
            ln.close()

    threads = [threading.Thread(target=serve, args=(d,), daemon=True) for d in lanes]
    for th in threads:
        th.start()
    try:
        while any(th.is_alive() for th in threads):
            for th in threads:
                th.join(timeout=0.2)
    except KeyboardInterrupt:
        # take no more tasks; each worker finishes the row it is on, then stops (Ctrl-C again
        # to abandon those rows)
        stop.set()
        while not q.empty():
            try:
                q.get_nowait()
            except queue.Empty:
                break
        log("interrupted: finishing the rows in flight on each GPU (Ctrl-C again to abandon them)")
        for th in threads:
            th.join()
        raise
    if errors:
        raise errors[0]


def check_backends(entries: dict, found: dict | None = None,
                   probes: dict | None = None) -> tuple[dict, dict, dict]:
    """(availability, version, worker environment) per label of ``entries`` (label ->
    :class:`~qlabench.config.BackendEntry`); a label's ``@<version>`` suffix must prefix the
    version found. An entry with an environment of its own is checked in it
    (:func:`supervisor.worker_environment`: ``probes``, label -> its future, when already asked;
    else asked now, each in a subprocess, meanwhile the others are checked). The others:
    ``found`` (registry name -> [available, reason, version], as the run's worker reported them
    or :func:`supervisor.probe_backends` found them), or, without it, in this process — which
    imports their libraries (the in-process executor's case: it measures here anyway)."""
    got: dict = {}
    own = {n: e for n, e in entries.items() if e.own_environment}
    pool = None
    if probes is None:
        pool = ThreadPoolExecutor(max_workers=max(1, len(own)))
        probes = {n: pool.submit(worker_environment, e) for n, e in own.items()}
    try:
        for n, e in entries.items():
            if n in own:
                continue
            ok, why, version = found[e.name] if found is not None else check_backend(e.name)
            got[n] = (None, (bool(ok), why), version)
        for n in own:
            got[n] = probes[n].result()
    finally:
        if pool is not None:
            pool.shutdown()
    avail, versions, workers = {}, {}, {}
    for n in entries:
        w, avail[n], versions[n] = got[n]
        if w is not None:
            workers[n] = w
        why = label_version_problem(n, versions[n]) if avail[n][0] else ""
        if why:
            avail[n], versions[n] = (False, why), "unavailable"
            workers.pop(n, None)
    return avail, versions, workers


def check_isolated(entries: dict, device: str | None = None) -> tuple[dict, dict, dict]:
    """:func:`check_backends` with every entry asked in an interpreter of its own (none of the
    backends' libraries is imported here): what ``qlabench run --dry-run`` shows."""
    names = list(dict.fromkeys(e.name for e in entries.values() if not e.own_environment))
    return check_backends(entries, found=probe_backends(names, pin(device)))
