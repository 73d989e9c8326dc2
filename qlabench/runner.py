"""A run: a sweep's points into a results directory, each row durable before the next.

:func:`run` selects the points (``--limit``, ``--shard``: :func:`qlabench.sweep.scheduled_points`)
and starts the supervised worker first thing (:mod:`qlabench.supervisor`): it imports torch and the
backends' libraries and reports each backend's availability and version, while this process —
which never imports a backend's library when the points run in workers — reads the results
directory (``--resume`` refused over rows of another input recipe), the GPU's ceilings (cached per
GPU) and the environment. With that report (:func:`check_backends`; an entry with an environment
of its own is asked in it) the run writes its metadata (versions, environment, campaign:
:func:`campaign_for`, timeline) and hands the tasks — point x direction x the backends not yet
done — to an :func:`executor`: that worker, this process (``isolate: false``), or one worker per
GPU (heaviest tasks first from one queue). Each task is measured by
:func:`qlabench.measure.measure_task`; every row it sends back is appended to the store at once,
with SIGINT / SIGTERM held until the write is over.

This module imports neither torch nor the storage code at module level (the CLI imports it before
the worker starts); :func:`run` imports them once the worker is on its way.
"""

from __future__ import annotations

import contextlib
import json
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from . import metrics
from .config import Sweep, label_version_problem
from .paths import LOGS_DIR
from .supervisor import (
    InProcess,
    PerEnvironment,
    Supervisor,
    check_backend,
    deferred_signals,
    install_sigterm_as_interrupt,
    probe_backends,
    process_started_at,
    worker_environment,
)
from .sweep import Point, point_cost, scheduled_points

__all__ = ["CAMPAIGN_HOURS", "NothingRunnable", "RecipeMismatch", "RunSummary", "campaign_for",
           "check_backends", "check_isolated", "executor", "fixed_cost", "note_timeline",
           "process_started_at", "run"]


class RecipeMismatch(Exception):
    """--resume found rows for the same key made from a different input recipe."""


class NothingRunnable(Exception):
    """No backend of the run can run here, and its results directory already holds rows (a run
    asked to refuse that: :func:`run`'s ``refuse_unrunnable``); nothing was written."""

    def __init__(self, avail: dict):
        self.avail = avail
        super().__init__("; ".join(f"{n}: {r}" for n, (_, r) in avail.items()))


@dataclass
class RunSummary:
    run_id: str
    out_dir: Path
    counts: dict = field(default_factory=dict)
    skipped_done: int = 0
    rows: list = field(default_factory=list)


#: a --resume continues a campaign only within this many hours of its last run's start
CAMPAIGN_HOURS = 24.0


def campaign_for(store, uuids: list[str], resume: bool, sweep_dump: dict | None = None,
                 versions: dict | None = None, now: datetime | None = None) -> str:
    """The measurement campaign a run belongs to. A ``--resume`` continues the campaign of the
    newest earlier run in the directory that was measured on the same device(s), from the same
    sweep, with the same version of every backend both name, and started less than
    ``CAMPAIGN_HOURS`` ago — one sweep spread over several jobs on one GPU stays one campaign.
    Anything else (a new run, another GPU, an edited config, a changed library or kernel, a
    resume days later) starts a new campaign. ``store``: the run's
    :class:`~qlabench.results.ResultStore`."""
    from .results import load_meta, new_run_id
    if resume:
        now = now or datetime.now()
        metas = sorted(load_meta(store.out).values(),
                       key=lambda m: (str(m.get("started_at", "")), str(m.get("run_id", ""))))
        for m in reversed(metas):
            if not m.get("campaign_id") or sorted(m.get("gpu_uuids") or []) != sorted(uuids):
                continue
            if sweep_dump is not None and m.get("sweep") != sweep_dump:
                break
            old = m.get("backend_versions") or {}
            if versions and any(old[b] != v for b, v in versions.items() if b in old):
                break
            try:
                age_h = (now - datetime.fromisoformat(str(m.get("started_at")))).total_seconds() / 3600
            except ValueError:
                break
            if 0 <= age_h < CAMPAIGN_HOURS:
                return m["campaign_id"]
            break
    return "c" + new_run_id()


def run(sweep: Sweep, out_dir: str | Path, config_name: str = "", backend_names=None,
        limit: int | None = None, resume: bool = False, progress=None, log=print,
        isolate: bool | None = None, shard: tuple[int, int] | None = None,
        devices: list[str] | None = None, retry_failed: bool = False,
        refuse_unrunnable: bool = False) -> RunSummary:
    """Run a sweep into ``out_dir``. With ``isolate`` (default: the sweep's ``isolate``), points
    run in a supervised worker process: a crash or a hang costs one row, not the sweep. With
    ``refuse_unrunnable``, a run whose backends cannot run here while ``out_dir`` already holds
    rows raises :class:`NothingRunnable` and writes nothing."""
    t_run = time.time()
    tl: dict = {}  # the run's timeline (seconds from the run's start), stored in the metadata
    t_proc = process_started_at()
    if t_proc is not None:
        tl["process_start"] = round(t_proc - t_run, 3)
    if threading.current_thread() is threading.main_thread():
        install_sigterm_as_interrupt()  # SIGTERM ends a run like Ctrl-C: rows kept, metadata written

    pts = scheduled_points(sweep, limit, shard)
    entries = sweep.entries(backend_names)
    names = list(entries)
    isolate = sweep.isolate if isolate is None else isolate
    one_device = not (devices and len(devices) > 1)
    first_device = devices[0] if devices else None  # the one a single-GPU run is pinned to
    # what the worker of the entries without an environment of their own checks and imports
    warm = list(dict.fromkeys(e.name for e in entries.values() if not e.own_environment))
    logs = Path(out_dir) / LOGS_DIR
    logs_existed = logs.exists()
    with contextlib.ExitStack() as started:  # every worker started is closed however the run ends
        # first thing: the worker (one per GPU), which checks its backends and imports their
        # libraries while this process goes on below
        stop = None if one_device else threading.Event()
        defaults: dict = {}  # device -> its worker
        if pts and (isolate or not one_device):
            for dev in ([first_device] if one_device else devices):
                w = default_worker(sweep, logs, log, dev, warm, stop)
                started.callback(w.close)
                w.start()
                defaults[dev] = w
            tl["worker_started"] = round(time.time() - t_run, 3)
        own = {n: e for n, e in entries.items() if e.own_environment}
        pool = ThreadPoolExecutor(max_workers=max(1, len(own)))
        started.callback(pool.shutdown, wait=False, cancel_futures=True)
        probes = {n: pool.submit(worker_environment, e) for n, e in own.items()}

        import torch

        from .measure import device
        from .results import ResultStore, environment, git_sha, holds_rows, load_meta, new_run_id
        store = ResultStore(out_dir)
        refuse = refuse_unrunnable and holds_rows(out_dir)
        done = store.done_keys(retry_failed) if resume else {}
        if resume:
            store.check_method(sweep.timing.mode, sweep.timing.l2)
            for (pk, direction), rh in store.recipes().items():
                for p in pts:
                    if p.key == pk and rh != p.recipe_hash:
                        raise RecipeMismatch(
                            f"{out_dir}: rows for point {p.describe()} ({direction}) were made from "
                            f"a different input recipe ({rh} vs {p.recipe_hash}: gate, seed, dtype or "
                            "state flags changed); use a new --out directory instead of --resume")
        params_json = {n: e.params_json for n, e in entries.items()}

        ceilings, ceilings_source = {}, None
        if torch.cuda.is_available():
            ceilings, ceilings_source = metrics.cached_ceilings(int(devices[0]) if devices else 0)
        tl["ceilings_measured"] = round(time.time() - t_run, 3)
        env = environment()

        # the checks: the worker's report (of every GPU's worker, the first GPU's), in this
        # process when the points run here, else each backend in an interpreter of its own
        worker_meta = {}
        if defaults:
            first = next(iter(defaults.values()))
            report = first.ready()
            tl["worker_ready"] = round(time.time() - t_run, 3)
            if report is not None:
                found = report["backends"]
                worker_meta = _worker_meta(report, t_run)
            else:
                found = probe_backends(warm, _pin(first_device))
                for w in defaults.values():  # fresh workers import only what did not kill one
                    w.warm = tuple(n for n in warm if found[n][0])
        else:
            found = None if not isolate else probe_backends(warm, _pin(first_device))
        avail, versions, workers = check_backends(entries, found=found, probes=probes)
        tl["backends_checked"] = round(time.time() - t_run, 3)
        runnable = any(avail[n][0] for n in names)
        if not runnable:
            ceilings, ceilings_source = {}, None
        elif ceilings_source:
            log(f"ceilings ({ceilings_source}): {ceilings}")
        if refuse and not runnable:
            started.close()
            for w in defaults.values():
                for f in w.log_paths:
                    f.unlink(missing_ok=True)
            if not logs_existed:
                with contextlib.suppress(OSError):
                    logs.rmdir()
            raise NothingRunnable(avail)
        execu = None
        if one_device and pts:
            # every worker of its own environment starts now, before anything is timed
            execu = executor(sweep, logs, log, isolate, workers, first_device,
                             default=defaults.get(first_device), warm=warm)
            started.callback(execu.close)
            execu.start()

        run_id = new_run_id()
        uuids = _device_uuids(devices)
        campaign_id = campaign_for(store, uuids, resume, sweep.model_dump(mode="json"), versions)
        sha = git_sha(str(Path(__file__).resolve().parent.parent))
        gpu_name = (torch.cuda.get_device_name(int(devices[0]) if devices else 0)
                    if torch.cuda.is_available() else "cpu")
        meta = {"run_id": run_id, "git_sha": sha, "config": config_name,
                "sweep": sweep.model_dump(mode="json"), "backends": names,
                "backend_names": {n: e.name for n, e in entries.items()},
                "environments": {n: {"python": w.python, **w.env} for n, w in workers.items()},
                "backend_versions": versions, "availability": {n: list(a) for n, a in avail.items()},
                "env": env, "started_at": datetime.now().isoformat(timespec="milliseconds"),
                "points": len(pts), "device": device(), "ceilings": ceilings,
                "ceilings_source": ceilings_source,
                "campaign_id": campaign_id, "gpu_uuids": uuids, **worker_meta}
        store.write_meta(run_id, meta)
        ctx = {"run_id": run_id, "sha": sha, "config": config_name, "versions": versions,
               "names": {n: e.name for n, e in entries.items()},
               "params": {n: e.params for n, e in entries.items() if e.params},
               "params_json": params_json,
               "avail": avail, "gpu_name": gpu_name, "campaign_id": campaign_id,
               # what the derived columns use: this run's ceilings, or where their measurement failed
               # the same-GPU runs' median in this directory (what metrics.add_derived recomputes)
               "ceilings": (metrics.run_ceilings(load_meta(out_dir), run_id, gpu_name) or {})
               if ceilings else {}}

        summary = RunSummary(run_id, Path(out_dir))
        lock = threading.Lock()

        def on_row(row: dict) -> None:
            now = round(time.time() - t_run, 3)
            if "first_row" not in tl:
                tl["first_row"] = now
                tl["first_row_compile_s"] = round(float(row.get("compile_s") or 0.0), 3)
            tl["last_row"] = now
            with lock:
                with deferred_signals():
                    store.append(row)
                summary.rows.append(row)
                summary.counts[row["status"]] = summary.counts.get(row["status"], 0) + 1
            lat = row.get("latency_ms")
            log(f"[{row['status']:>11}] {Point.describe_row(row):<36} {row['direction']:<6} "
                f"{row['backend']:<10} " + (f"{lat:9.4f} ms" if lat is not None else " " * 12)
                + (f"  err={row['max_rel_l2']:.2e}" if row.get("max_rel_l2") is not None else "")
                + (f"  [{row['path']}]" if row.get("path") else "")
                + (f"  ({row['reason'][:90]})" if row.get("reason") else ""))

        from .measure import Task
        tasks: list[Task] = []
        for p in pts:
            for direction in sweep.directions:
                todo = []
                for n in names:
                    if (p.key, n, direction, versions[n], params_json[n]) in done:
                        summary.skipped_done += 1
                        continue
                    todo.append(n)
                if todo:
                    tasks.append(Task(p, direction, todo, ctx))
        try:
            if devices and len(devices) > 1:
                _run_on_devices(sweep, tasks, devices, logs, on_row, progress, log,
                                workers, warm, defaults, stop)
            elif execu is not None:
                for t in tasks:
                    if progress is not None:
                        progress(f"{t.point.describe()} {t.direction}")
                    execu.run_task(t, on_row)
        finally:
            meta["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%S")
            tl["finished"] = round(time.time() - t_run, 3)
            meta["timeline_s"] = tl
            meta["counts"] = _counts_on_disk(store, run_id) or summary.counts
            seen = sorted({r.get("gpu_uuid") for r in summary.rows if r.get("gpu_uuid")})
            if seen:  # the devices the rows were measured on (workers pin theirs)
                meta["gpu_uuids"] = seen
            store.write_meta(run_id, meta)
        return summary


def _worker_meta(report: dict, t_run: float) -> dict:
    """The worker's start-up in the run's metadata: ``worker_timeline_s`` (seconds from the
    run's start: its ``process_start``, ``started`` (its log open), ``imported`` (qlabench and
    torch), ``cuda`` (its CUDA context), ``warmed`` (the backends checked and imported)) and
    ``worker_warm_s`` (each backend's seconds)."""
    wt = {k: round(float(v) - t_run, 3) for k, v in (report.get("timeline") or {}).items()
          if isinstance(v, (int, float))}
    return {"worker_timeline_s": wt,
            "worker_warm_s": {k: round(float(v), 3) for k, v in (report.get("warm_s") or {}).items()}}


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
    return check_backends(entries, found=probe_backends(names, _pin(device)))


def fixed_cost(tl: dict) -> dict:
    """A run's fixed cost from its ``timeline_s`` (seconds): ``total`` from process start to the
    first row, less that row's own first call (``compile_s``, its compile), split into
    ``start`` (interpreter, imports, config: process start to the run's start), ``checks``
    (the run's start to ``backends_checked``: the worker started, imported torch and the
    backends' libraries and reported them, or older commits' checks in this process; the
    ceilings are read meanwhile), ``ceilings`` (what the ceilings took after the checks: older
    commits read them after) and ``to_first_row`` (metadata, the workers of their own
    environment, the first row's inputs, reference and timing; at older commits the worker's
    imports still running). Empty without a first row."""
    if "first_row" not in tl:
        return {}
    start = -float(tl.get("process_start") or 0.0)
    checks = float(tl.get("backends_checked", 0.0))
    ceil_end = max(checks, float(tl.get("ceilings_measured", checks)))
    first = float(tl["first_row"]) - ceil_end
    compile_s = float(tl.get("first_row_compile_s") or 0.0)
    out = {"start": start, "checks": checks, "ceilings": ceil_end - checks,
           "to_first_row": max(0.0, first - compile_s), "first_row_compile": compile_s}
    out["total"] = start + checks + out["ceilings"] + out["to_first_row"]
    return {k: round(v, 2) for k, v in out.items()}


def _pin(device: str | None) -> dict | None:
    """The environment that pins a worker to CUDA device ``device``."""
    return {"CUDA_VISIBLE_DEVICES": device, "QLABENCH_GPU_INDEX": device} if device else None


def default_worker(sweep: Sweep, log_dir: Path, log, device: str | None, warm,
                   stop: threading.Event | None = None) -> Supervisor:
    """The supervised worker of the entries without an environment of their own: pinned to
    CUDA device ``device``, importing the backends ``warm`` as it starts."""
    return Supervisor(sweep, log_dir, log=log, env=_pin(device), stop=stop, warm=warm)


def executor(sweep: Sweep, log_dir: Path, log, isolate: bool, workers: dict,
             device: str | None = None, stop: threading.Event | None = None, default=None,
             warm=()):
    """What runs tasks: a supervised worker (``isolate``; ``default`` when one was started
    already, else :func:`default_worker` importing ``warm``) or this process, and a worker of
    its own for each entry in ``workers`` (label -> :class:`supervisor.WorkerEnv`), each
    importing its backend as it starts; ``device``: a CUDA index every worker is pinned to."""
    env = _pin(device)
    if default is None:
        default = default_worker(sweep, log_dir, log, device, warm, stop) if isolate \
            else InProcess(sweep)
    if not workers:
        return default
    return PerEnvironment(default, {n: (lambda w=w, n=n: Supervisor(sweep, log_dir, log=log, env=env,
                                                                 stop=stop, worker=w,
                                                                 warm=(sweep.entries([n])[n].name,)))
                                    for n, w in workers.items()}, stop)


def _device_uuids(devices: list[str] | None) -> list[str]:
    """UUIDs of the devices a run uses (``devices``: CUDA indices, or the current device)."""
    import torch

    from .measure import device_uuid, uuid_of
    if not torch.cuda.is_available():
        return [device_uuid()]
    return [uuid_of(int(d)) for d in (devices or [torch.cuda.current_device()])]


def note_timeline(out_dir: str | Path, run_id: str, **seconds: float) -> None:
    """Add entries (e.g. ``figures_s``) to a finished run's ``timeline_s`` metadata."""
    from .results import ResultStore
    store = ResultStore(out_dir)
    p = store.runs / f"{run_id}.json"
    try:
        meta = json.loads(p.read_text())
    except (OSError, ValueError):
        return
    meta.setdefault("timeline_s", {}).update({k: round(v, 3) for k, v in seconds.items()})
    store.write_meta(run_id, meta)


def _counts_on_disk(store, run_id: str) -> dict:
    """Status counts of this run's rows as stored (the parts are the truth)."""
    import pyarrow.parquet as pq
    counts: dict = {}
    for f in store.parts.glob(f"{run_id}-*.parquet"):
        try:
            st = pq.read_table(f, columns=["status"]).column(0)[0].as_py()
        except Exception:
            continue
        counts[st] = counts.get(st, 0) + 1
    return counts


def _run_on_devices(sweep, tasks, devices, log_dir, on_row, progress, log, workers=None,
                    warm=(), defaults=None, stop: threading.Event | None = None) -> None:
    """One supervised worker per GPU (``defaults``: device -> the one started already, with
    ``stop``) and per entry with an environment of its own, each pinned with
    ``CUDA_VISIBLE_DEVICES``; tasks are taken heaviest first from one queue, so the GPUs finish
    close together."""
    q: queue.Queue = queue.Queue()
    for t in sorted(tasks, key=lambda t: -point_cost(t.point, len(t.backends))):
        q.put(t)
    errors: list[BaseException] = []
    stop = threading.Event() if stop is None else stop
    defaults = defaults or {}

    def serve(dev: str) -> None:
        sup = executor(sweep, log_dir, log, True, workers or {}, dev, stop,
                       default=defaults.get(dev), warm=warm)
        try:
            while not stop.is_set():
                try:
                    t = q.get_nowait()
                except queue.Empty:
                    return
                if progress is not None:
                    progress(f"[gpu {dev}] {t.point.describe()} {t.direction}")
                sup.run_task(t, on_row)
        except BaseException as e:  # surfaced to the caller after the others stop
            errors.append(e)
        finally:
            sup.close()

    threads = [threading.Thread(target=serve, args=(d,), daemon=True) for d in devices]
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
