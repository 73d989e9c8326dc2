"""A run: a sweep's points into a results directory, each row durable before the next.

:func:`run` selects the points (``--limit``, ``--shard``: :func:`qlabench.sweep.scheduled_points`)
and starts the workers first thing, one per backend label (:class:`qlabench.supervisor.Lanes`):
each imports torch and its library and reports its availability and version, while this process
— which never imports a backend's library when the points run in workers — reads the results
directory (refused, before any row, when it holds rows of another sweep, input recipe or GPU:
:func:`other_rows`), the GPU's ceilings (cached per GPU) and the environment. Once the first
label is available (every label, for a ``--resume``, which needs every version for its done rows
and campaign, and for several GPUs) the run writes its metadata (versions, environment,
campaign: :func:`campaign_for`, timeline; rewritten as later checks come in) and the rows start:
on one GPU each point x direction x label in sweep order among the labels checked so far, a
label checked later catching up from its first point
(:func:`_dispatch`); on several GPUs whole tasks, heaviest first from one queue
(:func:`_run_on_devices`); with ``isolate: false`` in this process, which then checks the backends
itself. Each row is measured by :func:`qlabench.measure.measure_task`; every row is appended to
the store at once, with SIGINT / SIGTERM held until the write is over. Only one row is measured
at a time.

This module imports neither torch nor the storage code at module level (the CLI imports it before
the workers start); :func:`run` imports them once the workers are on their way.
"""

from __future__ import annotations

import contextlib
import json
import queue
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from . import metrics
from .config import Sweep, label_version_problem
from .paths import LOGS_DIR
from .supervisor import (
    Lanes,
    check_backend,
    deferred_signals,
    host_cores,
    install_sigterm_as_interrupt,
    probe_backends,
    process_started_at,
    worker_environment,
)
from .sweep import Point, point_cost, scheduled_points

__all__ = ["CAMPAIGN_HOURS", "NothingRunnable", "OtherRows", "RecipeMismatch", "RunSummary",
           "campaign_for", "check_backends", "check_isolated", "fixed_cost", "note_timeline",
           "other_rows", "process_started_at", "run"]


class OtherRows(Exception):
    """The results directory holds rows of another sweep, input recipe or GPU than the run's
    (:func:`other_rows`); nothing was written. ``what``: the kinds that differ, of ``sweep``,
    ``recipe``, ``gpu``."""

    def __init__(self, message: str, what=()):
        super().__init__(message)
        self.what = tuple(what)


class RecipeMismatch(OtherRows):
    """Among the rows of another kind: rows of one of the run's point keys made from another
    input recipe (refused for a ``--resume`` even with ``append_other``: its done rows would be
    of the other recipe)."""


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


def other_rows(held, sweep: Sweep, pts: list[Point], gpu_name: str,
               config_name: str = "") -> dict[str, str]:
    """What of a results directory's rows is not of this run: ``held`` is its
    :func:`qlabench.results.owners`; the run is ``sweep`` (its ``name``; ``config_name``, the
    YAML as given, only named), its points ``pts`` and the GPU it measures on, ``gpu_name``
    (``cpu`` without CUDA). Returns kind -> phrase for each kind that differs: ``sweep`` (rows of
    another sweep name), ``gpu`` (rows measured on a GPU of another name), ``recipe`` (rows of
    one of ``pts``' keys with another ``recipe_hash``; the phrase names the first such point, both
    hashes and both gate recipes). A value a row lacks is not compared."""
    out: dict[str, str] = {}
    if held.empty:
        return out

    def known(col: str):
        return held[held[col].notna() & (held[col].astype(str) != "")]

    sw = known("sweep")
    sw = sw[sw["sweep"] != sweep.name]
    if len(sw):
        theirs = []
        for name, g in sw.groupby("sweep", sort=True):
            cfgs = sorted({str(c) for c in g["config"].dropna() if str(c)})
            theirs.append(f"'{name}' ({', '.join([*cfgs, f'{len(g)} rows'])})")
        out["sweep"] = (f"rows of sweep {', '.join(theirs)}, not of this run's sweep "
                        f"'{sweep.name}'" + (f" ({config_name})" if config_name else ""))
    gpus = known("gpu_name")
    gpus = gpus[gpus["gpu_name"] != gpu_name]["gpu_name"].value_counts()
    if len(gpus):
        out["gpu"] = (f"rows measured on {', '.join(f'{k} ({v} rows)' for k, v in gpus.items())}, "
                      f"not on this run's {gpu_name}")
    mine = {p.key: p for p in pts}
    rec = known("recipe_hash")
    rec = rec[rec["point_key"].isin(list(mine))]
    bad = rec[[h != mine[k].recipe_hash for k, h in zip(rec["point_key"], rec["recipe_hash"])]]
    if len(bad):
        r = bad.iloc[0]
        p = mine[r["point_key"]]
        gate = r["gate_recipe"] if isinstance(r["gate_recipe"], str) and r["gate_recipe"] else None
        why = (f"gate recipe {gate} vs this run's {p.gate_label}" if gate != p.gate_label
               else f"the same gate recipe {gate}: the input seed or state flags differ")
        more = bad["point_key"].nunique() - 1
        out["recipe"] = (f"rows for point {p.describe()} ({r['direction']}) made from another "
                         f"input recipe (recipe_hash {r['recipe_hash']} vs this run's "
                         f"{p.recipe_hash}, {why})"
                         + (f", and for {more} more of this run's points" if more else ""))
    return out


def run(sweep: Sweep, out_dir: str | Path, config_name: str = "", backend_names=None,
        limit: int | None = None, resume: bool = False, progress=None, log=print,
        isolate: bool | None = None, shard: tuple[int, int] | None = None,
        devices: list[str] | None = None, retry_failed: bool = False,
        refuse_unrunnable: bool = False, append_other: bool = False) -> RunSummary:
    """Run a sweep into ``out_dir``. With ``isolate`` (default: the sweep's ``isolate``), points
    run in supervised worker processes, one per backend label (:class:`supervisor.Lanes`): a
    crash or a hang costs one row, not the sweep. An ``out_dir`` that holds rows of another
    sweep, input recipe or GPU (:func:`other_rows`) raises :class:`OtherRows`
    (:class:`RecipeMismatch` where a recipe differs) before any row, and nothing is written;
    ``append_other`` adds the run's rows to it anyway, except a ``--resume`` over rows of
    another recipe. With ``refuse_unrunnable``, a run whose backends cannot run here while
    ``out_dir`` already holds rows raises :class:`NothingRunnable` and writes nothing."""
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
    logs = Path(out_dir) / LOGS_DIR
    # what a refused run keeps of the log directory (a worker's log is named by this process's
    # id: a run in the process of an earlier one appends to the earlier one's log)
    earlier_logs = set(logs.iterdir()) if logs.is_dir() else None
    with contextlib.ExitStack() as started:  # every worker started is closed however the run ends
        own = {n: e for n, e in entries.items() if e.own_environment}
        pool = ThreadPoolExecutor(max_workers=max(1, len(own)))
        started.callback(pool.shutdown, wait=False, cancel_futures=True)
        probes = {n: pool.submit(worker_environment, e) for n, e in own.items()}
        # first thing: one worker per backend label (per GPU), each importing its library while
        # the others do and this process goes on below
        stop = None if one_device else threading.Event()
        lanes: dict = {}  # device -> its Lanes
        # one worker per library where the host has a core for each (and rows may start before
        # every check: early_rows), else one for every library of this environment
        n_workers = len({e.name for e in entries.values() if not e.own_environment}) + len(own)
        early = early_rows(n_workers)
        if pts:
            for dev in ([first_device] if one_device else devices):
                ln = Lanes(sweep, logs, log, entries, probes, _pin(dev), stop,
                           isolate=isolate or not one_device, per_library=early)
                started.callback(ln.close)
                ln.start()
                lanes[dev] = ln
            tl["worker_started"] = round(time.time() - t_run, 3)

        import torch

        from .measure import device
        from .results import ResultStore, environment, git_sha, load_meta, new_run_id, owners, resume_key
        store = ResultStore(out_dir)
        gpu_name = (torch.cuda.get_device_name(int(devices[0]) if devices else 0)
                    if torch.cuda.is_available() else "cpu")
        held = owners(out_dir)
        refuse = refuse_unrunnable and not held.empty
        other = {k: v for k, v in other_rows(held, sweep, pts, gpu_name, config_name).items()
                 if not append_other or (k == "recipe" and resume)}
        if other:
            started.close()
            _discard_worker_logs(lanes, logs, earlier_logs)
            hint = ("use a new --out directory (a --resume never mixes input recipes)"
                    if "recipe" in other and resume else
                    "use a new --out directory, or pass --append-other to add this run's rows "
                    "to it anyway")
            raise (RecipeMismatch if "recipe" in other else OtherRows)(
                f"{out_dir} holds {'; '.join(other.values())}; {hint}", other)
        done = store.done_keys(retry_failed) if resume else {}
        if resume:
            store.check_method(sweep.timing.mode, sweep.timing.l2)
        params_json = {n: e.params_json for n, e in entries.items()}

        ceilings, ceilings_source = {}, None
        if torch.cuda.is_available():
            ceilings, ceilings_source = metrics.cached_ceilings(int(devices[0]) if devices else 0)
        tl["ceilings_measured"] = round(time.time() - t_run, 3)
        env = environment()

        # the checks: each label's worker's (of the first GPU; this process's when the points run
        # here), or, with no points to run, each backend in an interpreter of its own
        avail, versions, worker_meta = {}, {}, {"worker_timeline_s": {}, "worker_warm_s": {}}
        first = lanes.get(first_device if one_device else devices[0]) if lanes else None

        def resolve(n: str) -> None:  # label n's check is in
            lane = first.lanes[n]  # its label's version asked for already (Lanes)
            avail[n], versions[n] = lane.avail, lane.version
            if lane.report:
                worker_meta["worker_timeline_s"][n] = {
                    k: round(float(v) - t_run, 3)
                    for k, v in (lane.report.get("timeline") or {}).items() if isinstance(v, (int, float))}
                worker_meta["worker_warm_s"][n] = round(float(
                    (lane.report.get("warm_s") or {}).get(lane.name, 0.0)), 3)
            if len(avail) == len(names):
                tl["backends_checked"] = round(time.time() - t_run, 3)

        if first is not None:
            # a run starts on its first available backend (where the host has a core for every
            # worker: :func:`early_rows`); a resume and a run over several GPUs wait for every
            # check, and a run with none available waits for them all anyway
            wait_all = resume or not one_device or not early
            while True:
                for n in sorted(first.resolved() - avail.keys()):
                    resolve(n)
                if len(avail) == len(names) or (not wait_all and any(a[0] for a in avail.values())):
                    break
                first.poll(0.2)
            tl["first_ready"] = round(time.time() - t_run, 3)
        else:
            a_, v_, _ = check_backends(entries, found=None if not isolate else
                                             probe_backends(list(dict.fromkeys(
                                                 e.name for e in entries.values()
                                                 if not e.own_environment)), _pin(first_device)),
                                             probes=probes)
            avail.update(a_)
            versions.update(v_)
            tl["backends_checked"] = tl["first_ready"] = round(time.time() - t_run, 3)
        avail = {n: avail[n] for n in names if n in avail}  # in the config's order
        runnable = any(a[0] for a in avail.values())
        if not runnable and len(avail) == len(names):
            ceilings, ceilings_source = {}, None
        elif ceilings_source:
            log(f"ceilings ({ceilings_source}): {ceilings}")
        if refuse and not runnable:
            started.close()
            _discard_worker_logs(lanes, logs, earlier_logs)
            raise NothingRunnable(avail)

        run_id = new_run_id()
        uuids = _device_uuids(devices)
        campaign_id = campaign_for(store, uuids, resume, sweep.model_dump(mode="json"), versions)
        sha = git_sha(str(Path(__file__).resolve().parent.parent))
        meta = {"run_id": run_id, "git_sha": sha, "config": config_name,
                "sweep": sweep.model_dump(mode="json"), "backends": names,
                "backend_names": {n: e.name for n, e in entries.items()},
                "environments": {}, "backend_versions": versions,
                "availability": {n: list(a) for n, a in avail.items()},
                "env": env, "started_at": datetime.now().isoformat(timespec="milliseconds"),
                "points": len(pts), "device": device(), "ceilings": ceilings,
                "ceilings_source": ceilings_source,
                "campaign_id": campaign_id, "gpu_uuids": uuids, **worker_meta}

        def note_environments() -> None:
            for n, f in probes.items():
                if f.done() and f.result()[0] is not None:
                    w = f.result()[0]
                    meta["environments"][n] = {"python": w.python, **w.env}

        note_environments()
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
            if "first_row" not in tl and row["status"] not in NOT_MEASURED:
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
        order = [(p, d) for p in pts for d in sweep.directions]

        def todo(n: str) -> list[int]:  # what label n still has to measure, in sweep order
            keep = [i for i, (p, d) in enumerate(order)
                    if resume_key(p.key, n, d, versions[n], params_json[n]) not in done]
            summary.skipped_done += len(order) - len(keep)
            return keep

        def resolved_later(n: str) -> None:  # a check in after the metadata was first written
            resolve(n)
            note_environments()
            meta.update(backend_versions={k: versions[k] for k in names if k in versions},
                        availability={k: list(avail[k]) for k in names if k in avail},
                        **worker_meta)
            store.write_meta(run_id, meta)

        try:
            if not one_device:
                per = {n: set(todo(n)) for n in names}
                tasks = [Task(p, d, [n for n in names if i in per[n]], ctx)
                         for i, (p, d) in enumerate(order) if any(i in per[n] for n in names)]
                _run_on_devices(tasks, lanes, on_row, progress, log, stop)
            elif first is not None:
                _dispatch(first, order, names, todo, resolved_later, ctx, on_row, progress)
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


def _discard_worker_logs(lanes: dict, logs: Path, earlier: set | None) -> None:
    """Remove the logs a refused run's (closed) workers created: ``lanes``, device -> its Lanes;
    ``earlier``, the files ``logs`` held before the run (kept), None where there was no such
    directory (then removed, if left empty)."""
    for ln in lanes.values():
        for lane in ln.lanes.values():
            for f in (lane.sup.log_paths if lane.sup else []):
                if f not in (earlier or ()):
                    f.unlink(missing_ok=True)
    if earlier is None:
        with contextlib.suppress(OSError):
            logs.rmdir()


def _dispatch(lanes: Lanes, order: list, names: list, todo, on_resolved, ctx: dict, on_row,
              progress) -> None:
    """One GPU: each (point, direction) x label of ``order`` in its label's worker, in sweep order
    among the labels resolved so far (asked again before every row); a label resolved later (a
    slower import) catches up from its first point. ``todo(label)``: the indices of ``order``
    the label still measures. A row measured while other labels' workers were still starting
    says so in its ``reason``. ``progress`` is called once per (point, direction)."""
    from .measure import Task
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

        def noted(row: dict, others=others) -> None:
            if others:
                note = f"measured while the workers of {', '.join(others)} were starting"
                row["reason"] = f"{row['reason']}; {note}" if row.get("reason") else note
            on_row(row)

        lanes.run(n, Task(p, d, [n], ctx), noted)


#: statuses of rows that measured nothing (not a run's first row)
NOT_MEASURED = ("unavailable", "unsupported", "skipped")


def early_rows(n_workers: int) -> bool:
    """Whether a run's rows may start while other backends' workers still import their
    libraries: ``$QLABENCH_EARLY_ROWS`` 1 / 0, else where this host has a core for every worker
    and one more (a row measured meanwhile then shares the host with none of them)."""
    import os
    forced = os.environ.get("QLABENCH_EARLY_ROWS", "").strip()
    if forced not in ("", "0", "1"):
        raise ValueError(f"QLABENCH_EARLY_ROWS={forced!r}: expected 1 (rows start at the first "
                         "backend's check), 0 (after every check) or unset (by this host's cores)")
    if forced:
        return forced == "1"
    return host_cores() > n_workers


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
    ``start`` (interpreter, imports, config: process start to the run's start), ``checks`` (the
    run's start to ``first_ready``: the first backend's worker started, imported torch and its
    library and reported; at older commits ``backends_checked``, every check), ``ceilings``
    (what the ceilings took after the checks: older commits read them after) and
    ``to_first_row`` (the metadata, the first row's inputs, reference and timing; at older
    commits the worker's imports still running). ``all_checked``, not part of ``total``: the run's
    start to its last backend's check (``backends_checked``), which may come after the first row.
    Empty without a first row."""
    if "first_row" not in tl:
        return {}
    start = -float(tl.get("process_start") or 0.0)
    checks = float(tl.get("first_ready", tl.get("backends_checked", 0.0)))
    ceil_end = max(checks, float(tl.get("ceilings_measured", checks)))
    first = float(tl["first_row"]) - ceil_end
    compile_s = float(tl.get("first_row_compile_s") or 0.0)
    out = {"start": start, "checks": checks, "ceilings": ceil_end - checks,
           "to_first_row": max(0.0, first - compile_s), "first_row_compile": compile_s}
    out["total"] = start + checks + out["ceilings"] + out["to_first_row"]
    if "backends_checked" in tl:
        out["all_checked"] = float(tl["backends_checked"])
    return {k: round(v, 2) for k, v in out.items()}


def _pin(device: str | None) -> dict | None:
    """The environment that pins a worker to CUDA device ``device``."""
    return {"CUDA_VISIBLE_DEVICES": device, "QLABENCH_GPU_INDEX": device} if device else None


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


def _run_on_devices(tasks, lanes: dict, on_row, progress, log,
                    stop: threading.Event) -> None:
    """Several GPUs: each GPU's :class:`supervisor.Lanes` (``lanes``: device -> its lanes, one
    worker per label pinned with ``CUDA_VISIBLE_DEVICES``) takes tasks heaviest first from one
    queue, so the GPUs finish close together; a task's labels run in its order, each once that
    GPU's worker for it is resolved."""
    from .measure import Task
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
