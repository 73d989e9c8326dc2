"""A run's fixed cost by phase, for runs of any commit that records ``timeline_s``.

    python -m qlabench_tools.fixed_cost_report RUN_DIR... [--csv fixed_cost.csv] [--limit-s 10]

Each RUN_DIR is a results directory (``--out`` of one ``qlabench run``; every run in it is
reported). The phases are :func:`qlabench.runner.fixed_cost` over the run's ``timeline_s``
(``_runs/<run_id>.json``), seconds from process start to the first row:

- ``start``: interpreter, imports and config (process start to the run's start);
- ``checks``: the backend checks up to the first available backend's. With one worker per
  backend label (``worker_timeline_s`` per label; the workers import side by side, the run's own
  process reads the ceilings meanwhile) this is that label's worker's start-up, split into
  ``w_spawn`` (the run's start to the worker's process start), ``w_imp`` (its qlabench and torch
  imports, from its process start), ``cuda`` (its CUDA context), ``warm_s`` (its backend checked
  and its library imported) and the report's way back; ``all_chk`` is when the last label's
  check came in (after the first row where a library imports slower). With one worker for every
  backend (``worker_timeline_s`` flat) the same for that worker, ``warm_s`` the sum over its
  backends (``worker_warm_s`` or the worker log's ``--- warm NAME: X s`` lines). Earlier commits
  checked in the run's own process, the worker importing meanwhile (``warm_s`` from its log) or,
  older still, at its first row;
- ``ceilings``: what the GPU's ceilings (measured, or read from the per-GPU cache: ``ceil_src``)
  took after the checks (none when read during them);
- ``to_first_row``: the rest up to the first row, that row's own first call excluded: at the old
  commit the worker's start and its library imports (lazy, at the first row) are in here;
- ``compile``: the first row's own first call (its ``compile_s``), not counted in ``total``.

Where a run's logs hold Python's ``-X importtime`` lines (a run with ``PYTHONPROFILEIMPORTTIME=1``
in its environment, which its worker inherits), the report adds the seconds each top-level
package took to import, in the worker (``_logs/worker-*.log``) and in the run's own process (the
``<run>.log`` that ``scripts/airgapped/h200_fixed_cost.sh`` keeps).

Timelines written before ``first_row_compile_s`` was recorded (the old commit 7a7503c:
``process_start``, ``backends_checked``, ``ceilings_measured``, ``first_row``, ``last_row``,
``finished``, ``figures_s``) get it from the run's rows: the ``compile_s`` of the row that
started first (``started_at``; rows of one worker are measured and sent one at a time), so both
layouts go through the same definition. ``shell.json`` in a RUN_DIR (written by
``scripts/airgapped/h200_fixed_cost.sh``) adds the run's label, commit, exit status and the wall time the
shell measured around the process (``shell.json`` and ``<run>.log`` may also sit in the run
directory's ``_notes/``, as in a committed copy).

Last, where the runs are of two commits or more, the per-point agreement of their ``ok`` rows
(:func:`agreement`): for each backend, the ratio of each point's median latency at the last
commit to that at the first, so a change in how a run starts (rows measured while other
workers still import) shows up if it moves what the rows measure.
"""
from __future__ import annotations

import argparse
import csv
import json
import re
import statistics
import sys
from pathlib import Path

from qlabench.results import PARTS_DIR, load_meta
from qlabench.runner import fixed_cost

PHASES = ("start", "checks", "ceilings", "to_first_row", "first_row_compile", "total")
COLUMNS = ("label", "commit", "run_dir", "run_id", "git_sha", "layout", "rows_ok", "rows",
           "first_row_backend", "ceilings_source", *PHASES, "all_checked", "compile_from", "warm_s",
           "worker_started", "worker_spawn_s", "worker_imports_s", "worker_cuda_s", "worker_ready",
           "run_s", "figures_s", "process_s", "shell_wall_s", "rc", "within_limit")
WARM = re.compile(r"^--- warm (\S+): ([0-9.]+) s", re.M)
IMPORTTIME = re.compile(r"^import time:\s+(\d+) \|\s+(\d+) \|( *)(\S+)", re.M)


def first_row(run_dir: Path, run_id: str) -> dict | None:
    """The row of ``run_id`` that started first (``started_at``, then point index), from one-row
    part files or compacted ones (``qlabench.results.compact``)."""
    import pyarrow.parquet as pq
    best = None
    for f in sorted((run_dir / PARTS_DIR).glob("*.parquet")):
        try:
            rows = pq.read_table(f, columns=["run_id", "started_at", "compile_s", "backend",
                                              "point_index", "status"]).to_pylist()
        except Exception:
            continue
        for r in rows:
            if r.get("run_id") != run_id:
                continue
            k = (str(r.get("started_at") or "~"), int(r.get("point_index") or 0))
            if best is None or k < best[0]:
                best = (k, r)
    return best[1] if best else None


def timeline_of(meta: dict, run_dir: Path) -> tuple[dict, str, dict | None]:
    """(timeline with ``first_row_compile_s``, where that came from, the first row or None)."""
    tl = dict(meta.get("timeline_s") or {})
    row = first_row(run_dir, meta.get("run_id", ""))
    if "first_row_compile_s" in tl:
        return tl, "timeline", row
    if "first_row" not in tl:
        return tl, "", row
    if row is None:
        return tl, "missing", row
    tl["first_row_compile_s"] = float(row.get("compile_s") or 0.0)
    return tl, "rows", row


def worker_warm(run_dir: Path) -> float | None:
    """Seconds the run's worker spent importing its backends as it started (new commits log
    ``--- warm NAME: X s``; None where no worker log says so)."""
    got = []
    for f in sorted((run_dir / "_logs").glob("worker-*.log")):
        try:
            got += [float(s) for _, s in WARM.findall(f.read_text(errors="replace"))]
        except OSError:
            continue
    return round(sum(got), 2) if got else None


def worker_timeline(meta: dict, label: str) -> dict:
    """The ``worker_timeline_s`` of the worker that measured ``label`` (one per label), or the
    run's one worker's."""
    wt = meta.get("worker_timeline_s") or {}
    if wt and all(isinstance(v, dict) for v in wt.values()):
        return wt.get(label) or {}
    return wt


def worker_phases(meta: dict, label: str = "") -> dict:
    """That worker's start-up (:func:`worker_timeline`, seconds from the run's start): spawn (to
    its process start), imports (process start to qlabench and torch imported), cuda (its
    context); empty for runs without it."""
    wt = worker_timeline(meta, label)
    tl = meta.get("timeline_s") or {}
    if not wt:
        return {}
    out = {}
    if "process_start" in wt and "worker_started" in tl:
        out["worker_spawn_s"] = round(wt["process_start"] - tl["worker_started"], 2)
    if "imported" in wt:
        out["worker_imports_s"] = round(wt["imported"] - wt.get("process_start", wt.get("started", 0.0)), 2)
    if "cuda" in wt and "imported" in wt:
        out["worker_cuda_s"] = round(wt["cuda"] - wt["imported"], 2)
    return out


def warm_seconds(meta: dict, label: str) -> float | None:
    """The first row's worker's warm-up: its label's (one worker per label) or the sum over the
    run's one worker's backends."""
    ws = meta.get("worker_warm_s") or {}
    if not ws:
        return None
    wt = meta.get("worker_timeline_s") or {}
    if wt and all(isinstance(v, dict) for v in wt.values()):
        return round(float(ws.get(label, 0.0)), 2) if label in ws else None
    return round(sum(ws.values()), 2)


def import_times(text: str, top: int = 12) -> list[tuple[str, float]]:
    """Seconds per top-level package from ``-X importtime`` lines (each module's own time,
    summed by its first name component), the ``top`` largest."""
    by: dict = {}
    for self_us, _, _, name in IMPORTTIME.findall(text):
        k = name.split(".")[0]
        by[k] = by.get(k, 0.0) + int(self_us) / 1e6
    return sorted(((k, round(v, 2)) for k, v in by.items()), key=lambda kv: -kv[1])[:top]


def run_import_times(run_dir: Path) -> dict:
    """``{"worker": [...], "process": [...]}``: :func:`import_times` of the worker logs and of
    the run's own log (``<run_dir name>.log``), those that hold such lines."""
    out = {}
    texts = {"worker": "".join(f.read_text(errors="replace")
                               for f in sorted((run_dir / "_logs").glob("worker-*.log"))),
             "process": _extra(run_dir, f"{run_dir.name}.log").read_text(errors="replace")
             if _extra(run_dir, f"{run_dir.name}.log").is_file() else ""}
    for k, t in texts.items():
        got = import_times(t)
        if got:
            out[k] = got
    return out


def _extra(run_dir: Path, name: str) -> Path:
    """A file the device job keeps beside a run's results (``shell.json``, ``<run>.log``): in the
    run directory, or in its ``_notes/`` where a committed copy keeps it."""
    p = run_dir / name
    return p if p.exists() else run_dir / "_notes" / name


def report_dir(run_dir: Path, limit_s: float) -> list[dict]:
    """One dict per run in ``run_dir`` (keys: :data:`COLUMNS`)."""
    run_dir = Path(run_dir)
    try:
        shell = json.loads(_extra(run_dir, "shell.json").read_text())
    except (OSError, ValueError):
        shell = {}
    metas = load_meta(run_dir)
    out = []
    for run_id, meta in sorted(metas.items()):
        tl, source, row = timeline_of(meta, run_dir)
        fc = fixed_cost(tl)
        counts = meta.get("counts") or {}
        ps = -float(tl.get("process_start") or 0.0)
        rec = {
            "label": shell.get("label", run_dir.name), "commit": shell.get("commit", ""),
            "run_dir": str(run_dir), "run_id": run_id, "git_sha": meta.get("git_sha", ""),
            "layout": "new" if "worker_started" in tl or "first_row_compile_s" in
            (meta.get("timeline_s") or {}) else "old",
            "rows_ok": counts.get("ok", 0), "rows": sum(counts.values()),
            "first_row_backend": (row or {}).get("backend", ""),
            "ceilings_source": meta.get("ceilings_source") or ("measured" if meta.get("ceilings") else ""),
            **{k: fc.get(k) for k in PHASES}, "compile_from": source,
            "all_checked": fc.get("all_checked"),
            "warm_s": (warm_seconds(meta, (row or {}).get("backend", "")) if meta.get("worker_warm_s")
                       else worker_warm(run_dir) if len(metas) == 1 else None),
            "worker_started": tl.get("worker_started"),
            "worker_ready": tl.get("first_ready", tl.get("worker_ready")),
            **dict.fromkeys(("worker_spawn_s", "worker_imports_s", "worker_cuda_s")),
            **worker_phases(meta, (row or {}).get("backend", "")),
            "run_s": tl.get("finished"), "figures_s": tl.get("figures_s"),
            "process_s": round(ps + float(tl["finished"]) + float(tl.get("figures_s") or 0.0), 2)
            if "finished" in tl else None,
            "shell_wall_s": shell.get("wall_s"), "rc": shell.get("rc"),
            "within_limit": (fc["total"] <= limit_s) if fc else None,
        }
        out.append(rec)
    if not metas:
        out.append({**dict.fromkeys(COLUMNS), "label": shell.get("label", run_dir.name),
                    "commit": shell.get("commit", ""), "run_dir": str(run_dir),
                    "shell_wall_s": shell.get("wall_s"), "rc": shell.get("rc")})
    return out


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "NO"
    if isinstance(v, float):
        return f"{v:.2f}"
    return str(v)


def print_table(recs: list[dict], limit_s: float) -> None:
    cols = [("label", "run"), ("commit", "commit"), ("layout", "tl"), ("rows_ok", "ok"),
            ("start", "start"), ("checks", "checks"), ("ceilings", "ceil"),
            ("ceilings_source", "ceil_src"), ("to_first_row", "to_1st"),
            ("first_row_compile", "compile*"), ("total", "FIXED"), ("first_row_backend", "1st_by"),
            ("all_checked", "all_chk"), ("worker_spawn_s", "w_spawn"),
            ("worker_imports_s", "w_imp"), ("worker_cuda_s", "cuda"), ("warm_s", "warm_s"),
            ("process_s", "process"), ("shell_wall_s", "shell"), ("within_limit", f"<={limit_s:g}s")]
    cells = [[h for _, h in cols]] + [[_fmt(r.get(k)) for k, _ in cols] for r in recs]
    w = [max(len(c[i]) for c in cells) for i in range(len(cols))]
    for j, c in enumerate(cells):
        print("  ".join(s.rjust(w[i]) if i > 1 else s.ljust(w[i]) for i, s in enumerate(c)))
        if j == 0:
            print("  ".join("-" * x for x in w))
    print("seconds. FIXED = start + checks + ceil + to_1st: process start -> first row, that row's "
          "own first call (compile*) not counted; start: interpreter, imports, config; checks: "
          "backend checks up to the first available one (with w_spawn: the start-up and report of "
          "the worker that measured the first row, 1st_by, = w_spawn + w_imp + cuda + warm_s + the "
          "report's way back, the ceilings read meanwhile; all_chk: the last backend's check, "
          "from the run's start; earlier: the checks in the run's process, the worker importing "
          "meanwhile, warm_s); ceil: the "
          "ceilings after the checks; to_1st: metadata, the worker's imports still due (old: all "
          "of them), the first row's inputs, reference and timing; process: process start -> "
          "end of figures (the run's own clock); shell: the wall time the shell measured around "
          "the process.")
    for r in recs:
        if r.get("compile_from") == "rows":
            print(f"{r['label']}: first_row_compile_s not in its timeline (old layout): the "
                  f"compile_s of its first-started row ({r['first_row_backend']})")
        if r.get("total") is None:
            print(f"{r['label']}: no first row recorded (rc {r.get('rc')})")
    for d in dict.fromkeys(Path(r["run_dir"]) for r in recs):
        for where, got in run_import_times(d).items():
            print(f"{d.name}: imports in the {where} (-X importtime, own time per top-level "
                  f"package, s): " + ", ".join(f"{k} {v:.2f}" for k, v in got))
    by: dict = {}
    for r in recs:
        if r.get("total") is not None and not str(r["label"]).endswith(("warmup", "importtime")):
            by.setdefault(r.get("commit") or r["label"], []).append(r["total"])
    for c, xs in by.items():
        print(f"commit {c}: fixed cost {', '.join(f'{x:.2f}' for x in xs)} s "
              f"(median {statistics.median(xs):.2f}; every run <= {limit_s:g} s: "
              f"{'yes' if max(xs) <= limit_s else 'NO'})")
    for line in agreement(recs):
        print(line)


def agreement(recs: list[dict]) -> list[str]:
    """Per backend, each point's median ``ok`` latency at the last commit over that at the first
    (runs labelled ``*warmup`` / ``*importtime`` left out): how many points, the median ratio,
    the range and the largest |ratio - 1|."""
    import pandas as pd

    from qlabench import results as R
    frames = []
    for r in recs:
        if str(r["label"]).endswith(("warmup", "importtime")) or not r.get("run_id"):
            continue
        try:
            df = R.load(r["run_dir"])
        except Exception:
            continue
        if not {"latency_ms", "point_key"} <= set(df.columns):
            continue
        df = df[(df["run_id"] == r["run_id"]) & (df["status"] == "ok") & df["latency_ms"].notna()]
        if len(df):
            frames.append(df.assign(commit=r.get("commit") or r["label"]))
    if not frames:
        return []
    df = pd.concat(frames)
    commits = list(dict.fromkeys(df["commit"]))
    if len(commits) < 2:
        return []
    key = ["point_key", "direction", "backend"]
    med = df.groupby(["commit", *key])["latency_ms"].median().unstack("commit")
    ratio = (med[commits[-1]] / med[commits[0]]).dropna()
    if "path" in df:  # the route a backend took: a kernel change between the commits shows here
        paths = df.groupby(["commit", *key])["path"].agg(
            lambda x: "/".join(sorted({str(v) for v in x}))).unstack("commit")
        moved = (paths[commits[-1]] != paths[commits[0]]).reindex(ratio.index, fill_value=False)
    else:
        moved = pd.Series(False, index=ratio.index)
    out = [f"per-point agreement, median latency at {commits[-1]} / at {commits[0]} (ok rows):"]
    for b, x in ratio.groupby(level="backend"):
        same = x[~moved.loc[x.index]]
        line = (f"  {b}: {len(x)} points, median {x.median():.4f}, range {x.min():.4f}-"
                f"{x.max():.4f}, largest |ratio - 1| {(x - 1).abs().max():.2%}")
        if len(same) < len(x):
            line += (f"; {len(x) - len(same)} took another path at {commits[-1]}, the other "
                     f"{len(same)}: largest |ratio - 1| "
                     + (f"{(same - 1).abs().max():.2%}" if len(same) else "-"))
        out.append(line)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dirs", nargs="+", type=Path)
    ap.add_argument("--csv", type=Path, default=None, help="write the table here")
    ap.add_argument("--limit-s", type=float, default=10.0, help="the acceptance bound (seconds)")
    a = ap.parse_args(argv)
    recs = [r for d in a.run_dirs for r in report_dir(d, a.limit_s)]
    print_table(recs, a.limit_s)
    if a.csv:
        with open(a.csv, "w", newline="") as fh:
            wr = csv.DictWriter(fh, fieldnames=COLUMNS, extrasaction="ignore")
            wr.writeheader()
            wr.writerows(recs)
        print(f"-> {a.csv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
