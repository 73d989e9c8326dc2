"""A run: a sweep's points into a results directory, each row durable before the next.

:func:`run` selects the points (``--limit``, ``--shard``: :func:`qlabench.sweep.scheduled_points`),
checks each backend's availability and version (:func:`check_backends`, in an entry's own
environment where it has one), refuses a ``--resume`` over rows of another input recipe, measures
the GPU's ceilings, writes the run's metadata (versions, environment, campaign:
:func:`campaign_for`, timeline), and hands the tasks — point x direction x the backends not yet
done — to an :func:`executor`: a supervised worker process (:mod:`qlabench.supervisor`), this
process, or one worker per GPU (heaviest tasks first from one queue). Each task is measured by
:func:`qlabench.measure.measure_task`; every row it sends back is appended to the store at once,
with SIGINT / SIGTERM held until the write is over.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import pyarrow.parquet as pq
import torch

from . import backends as B
from . import metrics
from .config import Sweep, label_version_problem
from .measure import Task, device, device_uuid, uuid_of
from .results import ResultStore, environment, git_sha, load_meta, new_run_id
from .supervisor import (
    InProcess,
    PerEnvironment,
    Supervisor,
    deferred_signals,
    install_sigterm_as_interrupt,
    worker_environment,
)
from .sweep import Point, point_cost, scheduled_points


class RecipeMismatch(Exception):
    """--resume found rows for the same key made from a different input recipe."""


@dataclass
class RunSummary:
    run_id: str
    out_dir: Path
    counts: dict = field(default_factory=dict)
    skipped_done: int = 0
    rows: list = field(default_factory=list)


#: a --resume continues a campaign only within this many hours of its last run's start
CAMPAIGN_HOURS = 24.0


def campaign_for(store: ResultStore, uuids: list[str], resume: bool, sweep_dump: dict | None = None,
                 versions: dict | None = None, now: datetime | None = None) -> str:
    """The measurement campaign a run belongs to. A ``--resume`` continues the campaign of the
    newest earlier run in the directory that was measured on the same device(s), from the same
    sweep, with the same version of every backend both name, and started less than
    ``CAMPAIGN_HOURS`` ago — one sweep spread over several jobs on one GPU stays one campaign.
    Anything else (a new run, another GPU, an edited config, a changed library or kernel, a
    resume days later) starts a new campaign."""
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


def process_started_at() -> float | None:
    """Epoch seconds at which this process started (Linux /proc), else None."""
    try:
        ticks = os.sysconf("SC_CLK_TCK")
        start = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        btime = next(int(ln.split()[1]) for ln in Path("/proc/stat").read_text().splitlines()
                     if ln.startswith("btime "))
        return btime + start / ticks
    except Exception:
        return None


def run(sweep: Sweep, out_dir: str | Path, config_name: str = "", backend_names=None,
        limit: int | None = None, resume: bool = False, progress=None, log=print,
        isolate: bool | None = None, shard: tuple[int, int] | None = None,
        devices: list[str] | None = None, retry_failed: bool = False) -> RunSummary:
    """Run a sweep into ``out_dir``. With ``isolate`` (default: the sweep's ``isolate``), points
    run in a supervised worker process: a crash or a hang costs one row, not the sweep."""
    t_run = time.time()
    tl: dict = {}  # the run's timeline (seconds from the run's start), stored in the metadata
    t_proc = process_started_at()
    if t_proc is not None:
        tl["process_start"] = round(t_proc - t_run, 3)
    if threading.current_thread() is threading.main_thread():
        install_sigterm_as_interrupt()  # SIGTERM ends a run like Ctrl-C: rows kept, metadata written

    store = ResultStore(out_dir)
    pts = scheduled_points(sweep, limit, shard)
    entries = sweep.entries(backend_names)
    names = list(entries)
    isolate = sweep.isolate if isolate is None else isolate
    one_device = not (devices and len(devices) > 1)
    first_device = devices[0] if devices else None  # the one a single-GPU run is pinned to
    warm = [e.name for e in entries.values() if not e.own_environment]
    with contextlib.ExitStack() as started:  # every worker started is closed however the run ends
        early = None  # the worker, started now: it imports its libraries while this process checks
        if isolate and one_device and pts:
            early = default_worker(sweep, store.logs, log, first_device, warm)
            started.callback(early.close)
            early.start()
            tl["worker_started"] = round(time.time() - t_run, 3)
        avail, versions, workers = check_backends(entries)
        tl["backends_checked"] = round(time.time() - t_run, 3)
        execu = None
        if one_device and pts:
            # every worker of its own environment starts now too, before anything is timed
            execu = executor(sweep, store.logs, log, isolate, workers, first_device, default=early,
                             warm=warm)
            started.callback(execu.close)
            execu.start()

        params_json = {n: e.params_json for n, e in entries.items()}
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

        ceilings, ceilings_source = {}, None
        if torch.cuda.is_available() and any(avail[n][0] for n in names):
            ceilings, ceilings_source = metrics.cached_ceilings(int(devices[0]) if devices else 0)
            log(f"ceilings ({ceilings_source}): {ceilings}")
        tl["ceilings_measured"] = round(time.time() - t_run, 3)
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
                "env": environment(), "started_at": datetime.now().isoformat(timespec="milliseconds"),
                "points": len(pts), "device": device(), "ceilings": ceilings,
                "ceilings_source": ceilings_source,
                "campaign_id": campaign_id, "gpu_uuids": uuids}
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
                _run_on_devices(sweep, tasks, devices, store.logs, on_row, progress, log,
                                workers, warm)
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


def check_backends(entries: dict) -> tuple[dict, dict, dict]:
    """(availability, version, worker environment) per label of ``entries`` (label ->
    :class:`~qlabench.config.BackendEntry`). An entry with an environment of its own is checked
    in it (:func:`supervisor.worker_environment`), the others in this process; a label's
    ``@<version>`` suffix must prefix the version found. The environments are asked (each a
    subprocess) while this process checks the others."""
    from concurrent.futures import ThreadPoolExecutor
    got: dict = {}
    own = {n: e for n, e in entries.items() if e.own_environment}
    with ThreadPoolExecutor(max_workers=max(1, len(own))) as pool:
        probes = {n: pool.submit(worker_environment, e) for n, e in own.items()}
        for n, e in entries.items():
            if n in own:
                continue
            try:
                be = B.get(e.name)
            except Exception as err:  # registered, but its module does not import here
                got[n] = (None, (False, f"backend {e.name!r} does not load: "
                                 f"{type(err).__name__}: {str(err)[:200]}"), "unavailable")
                continue
            ok = be.available()
            got[n] = (None, ok, be.version() if ok[0] else "unavailable")
        for n, f in probes.items():
            got[n] = f.result()
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


def fixed_cost(tl: dict) -> dict:
    """A run's fixed cost from its ``timeline_s`` (seconds): ``total`` from process start to the
    first row, less that row's own first call (``compile_s``, its compile), split into
    ``start`` (interpreter, imports, config: process start to the run's start), ``checks``
    (backend checks, in this process and in each entry's environment; the worker imports its
    libraries meanwhile), ``ceilings`` and ``to_first_row`` (metadata, the worker's imports still
    running, the first row's inputs, reference and timing). Empty without a first row."""
    if "first_row" not in tl:
        return {}
    start = -float(tl.get("process_start") or 0.0)
    checks = float(tl.get("backends_checked", 0.0))
    ceil = float(tl.get("ceilings_measured", checks)) - checks
    first = float(tl["first_row"]) - float(tl.get("ceilings_measured", checks))
    compile_s = float(tl.get("first_row_compile_s") or 0.0)
    out = {"start": start, "checks": checks, "ceilings": ceil,
           "to_first_row": max(0.0, first - compile_s), "first_row_compile": compile_s}
    out["total"] = start + checks + ceil + out["to_first_row"]
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
    if not torch.cuda.is_available():
        return [device_uuid()]
    return [uuid_of(int(d)) for d in (devices or [torch.cuda.current_device()])]


def note_timeline(out_dir: str | Path, run_id: str, **seconds: float) -> None:
    """Add entries (e.g. ``figures_s``) to a finished run's ``timeline_s`` metadata."""
    store = ResultStore(out_dir)
    p = store.runs / f"{run_id}.json"
    try:
        meta = json.loads(p.read_text())
    except (OSError, ValueError):
        return
    meta.setdefault("timeline_s", {}).update({k: round(v, 3) for k, v in seconds.items()})
    store.write_meta(run_id, meta)


def _counts_on_disk(store: ResultStore, run_id: str) -> dict:
    """Status counts of this run's rows as stored (the parts are the truth)."""
    counts: dict = {}
    for f in store.parts.glob(f"{run_id}-*.parquet"):
        try:
            st = pq.read_table(f, columns=["status"]).column(0)[0].as_py()
        except Exception:
            continue
        counts[st] = counts.get(st, 0) + 1
    return counts


def _run_on_devices(sweep, tasks, devices, log_dir, on_row, progress, log, workers=None,
                    warm=()) -> None:
    """One supervised worker per GPU (and per entry with an environment of its own), each pinned
    with ``CUDA_VISIBLE_DEVICES``; tasks are taken heaviest first from one queue, so the GPUs
    finish close together."""
    q: queue.Queue = queue.Queue()
    for t in sorted(tasks, key=lambda t: -point_cost(t.point, len(t.backends))):
        q.put(t)
    errors: list[BaseException] = []
    stop = threading.Event()

    def serve(dev: str) -> None:
        sup = executor(sweep, log_dir, log, True, workers or {}, dev, stop, warm=warm)
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
