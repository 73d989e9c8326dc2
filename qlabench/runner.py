"""A run: a sweep's points into a results directory, each row durable before the next.

:func:`run` schedules and stores. It selects the points (``--limit``, ``--shard``:
:func:`qlabench.sweep.scheduled_points`) and hands the sweep to an executor
(:mod:`qlabench.executor`: supervised workers, one per backend library and GPU, or this process
with ``isolate: false``), which starts its workers first thing: each imports torch and its
library and reports its availability and version, while this process reads the results
directory (refused, before any row, when it holds rows of another sweep, input recipe, GPU or
timing method: :func:`other_rows`), the GPU's ceilings (cached per GPU: :mod:`qlabench.host`)
and the environment. Once the first label is available (every label, for a ``--resume``, which needs
every version for its done rows and campaign, and for several GPUs) the run writes its metadata
(versions, environment, campaign: :func:`campaign_for`, timeline; rewritten as later checks come
in) and the executor measures the rows (in sweep order on one GPU, heaviest first over several).
Every row is appended to the store the moment the executor hands it over, with SIGINT / SIGTERM
held until the write is over. Only one row is measured at a time.

This module imports neither torch nor the storage code at module level (the CLI imports it before
the workers start); :func:`run` imports them (:mod:`qlabench.host`, :mod:`qlabench.results`) once
the workers are on their way.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from . import metrics
from .config import Sweep
from .executor import check_backends, check_isolated, early_rows, executor_for
from .paths import LOGS_DIR
from .supervisor import deferred_signals, install_sigterm_as_interrupt, process_started_at
from .sweep import Point, Task, scheduled_points

__all__ = ["CAMPAIGN_HOURS", "NothingRunnable", "OtherRows", "RecipeMismatch", "RunSummary",
           "Task", "campaign_for", "check_backends", "check_isolated", "early_rows", "fixed_cost",
           "note_timeline", "other_rows", "process_started_at", "run"]


class OtherRows(Exception):
    """The results directory holds rows of another sweep, input recipe, GPU or timing method than
    the run's (:func:`other_rows`); nothing was written. ``what``: the kinds that differ, of
    ``sweep``, ``recipe``, ``gpu``, ``method``, ``judge``."""

    def __init__(self, message: str, what=()):
        super().__init__(message)
        self.what = tuple(what)


#: the kinds of :func:`other_rows` that a ``--resume`` is refused over even with
#: ``append_other`` (kind -> what the refusal names)
RESUME_NEVER_MIXES = {"recipe": "input recipes", "method": "timing methods",
                      "judge": "correctness limits or references"}


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
    :func:`qlabench.results.owners`; the run is ``sweep`` (its ``name``, its ``timing`` mode and
    l2; ``config_name``, the YAML as given, only named), its points ``pts`` and the GPU it
    measures on, ``gpu_name`` (``cpu`` without CUDA). Returns kind -> phrase for each kind that
    differs: ``sweep`` (rows of another sweep name), ``gpu`` (rows measured on a GPU of another
    name), ``recipe`` (rows of one of ``pts``' keys with another ``recipe_hash``; the phrase
    names the first such point, both hashes and both gate recipes), ``method`` (``ok`` rows timed
    with another timing mode or l2: :func:`qlabench.results.other_method`), ``judge`` (rows
    whose verdicts were judged under other correctness limits or another reference:
    :func:`qlabench.results.judged_by`). A value a row lacks is not compared."""
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
    from .results import judged_by, method_counts, other_method
    if "judged_by" in held:
        mine_j = judged_by(sweep.model_dump(mode="json"))
        jb = known("judged_by")
        jb = jb[jb["judged_by"] != mine_j]
        if len(jb):
            ours, theirs = json.loads(mine_j), json.loads(jb["judged_by"].iloc[0])
            diff = ", ".join(f"{k} {theirs.get(k)} vs this run's {ours.get(k)}"
                             for k in sorted(set(ours) | set(theirs)) if ours.get(k) != theirs.get(k))
            out["judge"] = (f"{len(jb)} rows judged under other correctness limits or reference "
                            f"(run {jb['run_id'].iloc[0]}: {diff})")
    t = sweep.timing
    theirs = method_counts(other_method(held, t.mode, t.l2))
    if theirs:
        ways = ", ".join(f"{m} ({n} rows)" for m, n in theirs.items())
        out["method"] = f"rows timed with {ways}, not with this run's timing_mode={t.mode}, l2={t.l2}"
    return out


def run(sweep: Sweep, out_dir: str | Path, config_name: str = "", backend_names=None,
        limit: int | None = None, resume: bool = False, progress=None, log=print,
        isolate: bool | None = None, shard: tuple[int, int] | None = None,
        devices: list[str] | None = None, retry_failed: bool = False,
        refuse_unrunnable: bool = False, append_other: bool = False) -> RunSummary:
    """Run a sweep into ``out_dir``. With ``isolate`` (default: the sweep's ``isolate``), points
    run in supervised worker processes, one per backend label (:class:`executor.WorkerPool`): a
    crash or a hang costs one row, not the sweep. An ``out_dir`` that holds rows of another
    sweep, input recipe, GPU or timing method (:func:`other_rows`) raises :class:`OtherRows`
    (:class:`RecipeMismatch` where a recipe differs) before any row, and nothing is written;
    ``append_other`` adds the run's rows to it anyway, except a ``--resume`` over rows of
    another recipe or timing method. With ``refuse_unrunnable``, a run whose backends cannot run
    here while ``out_dir`` already holds rows raises :class:`NothingRunnable` and writes
    nothing."""
    t_run = time.time()
    tl: dict = {}  # the run's timeline (seconds from the run's start), stored in the metadata
    t_proc = process_started_at()
    if t_proc is not None:
        tl["process_start"] = round(t_proc - t_run, 3)
    if threading.current_thread() is threading.main_thread():
        install_sigterm_as_interrupt()  # SIGTERM ends a run like Ctrl-C: rows kept, metadata written
    pts = scheduled_points(sweep, limit, shard)
    entries = sweep.entries(backend_names)
    isolate = sweep.isolate if isolate is None else isolate
    with executor_for(sweep, entries, Path(out_dir) / LOGS_DIR, log, devices, isolate, tl,
                      t_run) as ex:
        if pts:
            ex.start()  # first thing: the workers import their libraries while this goes on
        from . import host, results  # torch and the storage code, once the workers are on their way
        store = results.ResultStore(out_dir)
        gpu_name = host.gpu_name(devices)
        held = results.owners(out_dir)
        _refuse_other_rows(ex, held, sweep, pts, gpu_name, out_dir, config_name, resume,
                           append_other)
        done = store.done_keys(retry_failed) if resume else {}
        ceilings, ceilings_source = host.ceilings(devices)
        tl["ceilings_measured"] = round(time.time() - t_run, 3)
        env = results.environment()
        # a run starts on its first available backend where the host has a core for every
        # worker; a resume and a run over several GPUs wait for every check
        ex.check(wait_all=resume or not ex.one_device or not ex.early)
        runnable = any(a[0] for a in ex.avail.values())
        if not runnable and len(ex.avail) == len(entries):
            ceilings, ceilings_source = {}, None
        elif ceilings_source:
            log(f"ceilings ({ceilings_source}): {ceilings}")
        if refuse_unrunnable and not held.empty and not runnable:
            ex.close()
            ex.discard_logs()
            raise NothingRunnable(ex.avail)

        meta = _run_meta(ex, store, sweep, config_name, resume, devices, len(pts), env,
                         ceilings, ceilings_source)
        store.write_meta(meta["run_id"], meta)
        ctx = _row_context(ex, meta, gpu_name, out_dir)
        summary = RunSummary(meta["run_id"], Path(out_dir))
        order = [(p, d) for p in pts for d in sweep.directions]

        def checked_later(n: str) -> None:  # a check in after the metadata was first written
            meta["environments"].update(ex.environments())
            meta.update(backend_versions={k: ex.versions[k] for k in entries if k in ex.versions},
                        availability={k: list(ex.avail[k]) for k in entries if k in ex.avail},
                        **ex.worker_meta)
            store.write_meta(meta["run_id"], meta)

        try:
            ex.run(order, _todo(order, done, ctx, summary), ctx,
                   _row_writer(store, summary, tl, t_run, log), progress, checked_later)
        finally:
            _finish(store, meta, tl, t_run, summary)
        return summary


def _refuse_other_rows(ex, held, sweep: Sweep, pts: list, gpu_name: str, out_dir, config_name: str,
                       resume: bool, append_other: bool) -> None:
    """Raise :class:`OtherRows` (:class:`RecipeMismatch`) where the results directory holds rows
    of another sweep, recipe, GPU or timing method (:func:`other_rows`) that the run may not add
    to, having closed the executor and removed the logs its workers made. ``append_other`` lifts
    every kind but a ``--resume`` over rows of another recipe or method (the rows it would skip
    are not of this run's inputs or method)."""
    other = {k: v for k, v in other_rows(held, sweep, pts, gpu_name, config_name).items()
             if not append_other or (k in RESUME_NEVER_MIXES and resume)}
    if not other:
        return
    ex.close()
    ex.discard_logs()
    never = [RESUME_NEVER_MIXES[k] for k in other if k in RESUME_NEVER_MIXES] if resume else []
    hint = (f"use a new --out directory (a --resume never mixes {' or '.join(never)})"
            if never else
            "use a new --out directory, or pass --append-other to add this run's rows "
            "to it anyway")
    raise (RecipeMismatch if "recipe" in other else OtherRows)(
        f"{out_dir} holds {'; '.join(other.values())}; {hint}", other)


def _run_meta(ex, store, sweep: Sweep, config_name: str, resume: bool, devices, n_points: int,
              env: dict, ceilings: dict, ceilings_source) -> dict:
    """The run's metadata as first written: a new run id, the campaign it belongs to
    (:func:`campaign_for`), versions, availability and environments of the checks in so far."""
    from . import host, results
    run_id = results.new_run_id()
    uuids = host.device_uuids(devices)
    names = list(ex.entries)
    meta = {"run_id": run_id,
            "git_sha": results.git_sha(str(Path(__file__).resolve().parent.parent)),
            "config": config_name, "sweep": sweep.model_dump(mode="json"), "backends": names,
            "backend_names": {n: e.name for n, e in ex.entries.items()},
            "environments": {}, "backend_versions": ex.versions,
            "availability": {n: list(a) for n, a in ex.avail.items()},
            "env": env, "started_at": datetime.now().isoformat(timespec="milliseconds"),
            "points": n_points, "device": host.device(), "ceilings": ceilings,
            "ceilings_source": ceilings_source,
            "campaign_id": campaign_for(store, uuids, resume, sweep.model_dump(mode="json"),
                                        ex.versions),
            "gpu_uuids": uuids, **ex.worker_meta}
    meta["environments"].update(ex.environments())
    return meta


def _row_context(ex, meta: dict, gpu_name: str, out_dir) -> dict:
    """What every :class:`~qlabench.sweep.Task` of the run carries (``Task.ctx``): the run's
    identity, each label's registry name, parameters, version and availability (the executor's
    dicts, which a label checked later joins), and the ceilings the derived columns use: this
    run's, or where their measurement failed the same-GPU runs' median in this directory (what
    metrics.add_derived recomputes)."""
    from .results import load_meta
    entries = ex.entries
    return {"run_id": meta["run_id"], "sha": meta["git_sha"], "config": meta["config"],
            "versions": ex.versions, "names": {n: e.name for n, e in entries.items()},
            "params": {n: e.params for n, e in entries.items() if e.params},
            "params_json": {n: e.params_json for n, e in entries.items()},
            "avail": ex.avail, "gpu_name": gpu_name, "campaign_id": meta["campaign_id"],
            "ceilings": (metrics.run_ceilings(load_meta(out_dir), meta["run_id"], gpu_name) or {})
            if meta["ceilings"] else {}}


def _todo(order: list, done: dict, ctx: dict, summary: RunSummary):
    """``todo(label)``: the indices of ``order`` the label still measures (a ``--resume``'s done
    rows left out and counted in ``summary.skipped_done``), in sweep order."""
    from .results import resume_key

    def todo(n: str) -> list[int]:
        keep = [i for i, (p, d) in enumerate(order)
                if resume_key(p.key, n, d, ctx["versions"][n], ctx["params_json"][n]) not in done]
        summary.skipped_done += len(order) - len(keep)
        return keep
    return todo


def _row_writer(store, summary: RunSummary, tl: dict, t_run: float, log):
    """``on_row(row)``: the row appended to the store at once (SIGINT / SIGTERM held until the
    write is over), counted, logged, and the timeline's ``first_row`` / ``last_row`` marked."""
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
    return on_row


def _finish(store, meta: dict, tl: dict, t_run: float, summary: RunSummary) -> None:
    """The metadata's last write, however the run ended: finish time, timeline, the status
    counts as stored, the devices the rows were measured on (workers pin theirs)."""
    meta["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    tl["finished"] = round(time.time() - t_run, 3)
    meta["timeline_s"] = tl
    meta["counts"] = _counts_on_disk(store, meta["run_id"]) or summary.counts
    seen = sorted({r.get("gpu_uuid") for r in summary.rows if r.get("gpu_uuid")})
    if seen:
        meta["gpu_uuids"] = seen
    store.write_meta(meta["run_id"], meta)


#: statuses of rows that measured nothing (not a run's first row)
NOT_MEASURED = ("unavailable", "unsupported", "skipped")


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
