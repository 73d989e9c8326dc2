"""The ``qlabench`` command: run | list | validate | submit | merge | compact (measure, schedule,
combine), summary | compare | recommend | choose | report | reproduce (read stored rows), profile,
precompile (the in-repo kernels into a TileLang cache, offline)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from . import config as C

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Benchmark Gated DeltaNet chunked-prefill kernels: sweeps -> Parquet rows.")
console = Console(soft_wrap=True)
err = Console(stderr=True, soft_wrap=True)
#: ``--wide`` of the views that print tables (:mod:`qlabench.render`)
WIDE = typer.Option(False, "--wide", help="every column at its natural width, whatever the "
                    "terminal's width (piped output is wide unless $COLUMNS is set)")


def _load(path: Path) -> C.Sweep:
    try:
        return C.load(path)
    except C.ConfigError as e:
        err.print(f"[red]error:[/red] {e}", markup=True, highlight=False)
        raise typer.Exit(2) from None


def _out(path: Path, kind: str) -> Path:
    """``--out`` checked before anything is computed (:func:`qlabench.paths.check_out`: ``kind``
    ``dir`` or ``file``); one error line and exit 2 when it cannot be written so."""
    from .paths import OutPathError, check_out
    try:
        return check_out(path, kind)
    except OutPathError as e:
        err.print(f"error: {e}", highlight=False, markup=False)
        raise typer.Exit(2) from None


def _writing(fn, *args, **kwargs) -> int:
    """``fn(*args, **kwargs)`` (a command's body, returning its exit code), with an OSError it
    raises (a disk full, a path gone since it was checked) as one error line and exit 2."""
    try:
        return fn(*args, **kwargs)
    except OSError as e:
        _os_error(e)


def _os_error(e: OSError):
    """One error line naming the file and the reason of ``e``; exit 2."""
    what = f"{e.filename}: {e.strerror}" if e.filename and e.strerror else str(e)
    err.print(f"error: {what}", highlight=False, markup=False)
    raise typer.Exit(2) from None


def _tie_rule(alpha: float, threshold: float, direction: str | None = None) -> None:
    """``--alpha``, ``--threshold`` (and ``--direction`` when given) checked as compare checks
    them (:func:`qlabench.analysis.check_tie_rule`, :func:`qlabench.analysis.check_direction`);
    one error line and exit 2 otherwise."""
    from .analysis import BadInput, check_direction, check_tie_rule
    try:
        check_tie_rule(alpha, threshold)
        if direction is not None:
            check_direction(direction)
    except BadInput as e:
        err.print(f"error: {e}", highlight=False, markup=False)
        raise typer.Exit(2) from None


def _backend_list(arg: str | None, sweep: C.Sweep) -> list[str]:
    """Labels to run: the sweep's, or ``--backends`` (labels of the sweep or registry names)."""
    labels = list(sweep.entries())
    if not arg:
        return labels
    names = [b.strip() for b in arg.split(",") if b.strip()]
    if not names:
        err.print(f"error: --backends {arg!r}: no backend named (a comma list of labels)", highlight=False)
        raise typer.Exit(2)
    from . import backends
    known = backends.names()
    bad = [b for b in names if b not in known and b not in labels]
    if bad:
        err.print(f"error: --backends: unknown backend(s) {', '.join(bad)}; known: "
                  f"{', '.join(dict.fromkeys([*labels, *known]))}", highlight=False)
        raise typer.Exit(2)
    return names


def _parse_shard(shard: str | None) -> tuple[int, int] | None:
    if not shard:
        return None
    try:
        i, n = (int(x) for x in shard.split("/"))
        if not (n >= 1 and 0 <= i < n):
            raise ValueError
    except ValueError:
        err.print(f"error: --shard {shard!r}: expected i/n with 0 <= i < n, e.g. 0/4", highlight=False)
        raise typer.Exit(2) from None
    return i, n


def _parse_gpus(gpus: str | None) -> list[str] | None:
    if not gpus:
        return None
    import os

    import torch
    n = torch.cuda.device_count()
    fake = os.environ.get("QLABENCH_FAKE_GPUS")  # tests: pretend to have N GPUs (CPU workers)
    if fake:
        n = int(fake)
    if n == 0:
        err.print("error: --gpus: no CUDA device is visible", highlight=False)
        raise typer.Exit(2)
    if gpus == "all":
        return [str(i) for i in range(n)]
    try:
        idx = [int(x) for x in gpus.split(",") if x.strip()]
    except ValueError:
        idx = [-1]
    bad = [i for i in idx if not 0 <= i < n]
    if bad or not idx or len(set(idx)) != len(idx):
        err.print(f"error: --gpus {gpus!r}: expected 'all' or distinct indices in 0..{n - 1}", highlight=False)
        raise typer.Exit(2)
    return [str(i) for i in idx]


@app.command()
def merge(
    inputs: list[Path] = typer.Argument(..., help="shard or run directories to merge"),
    out: Path = typer.Option(..., "--out", help="merged results directory (created; refused when "
                             "it already holds rows, unless --force)"),
    force: bool = typer.Option(False, "--force", help="add the inputs' rows to an --out that "
                               "already holds rows"),
    mix_sweeps: bool = typer.Option(False, "--mix-sweeps", help="merge rows of several sweeps "
                                    "or timing methods into one directory (refused otherwise, "
                                    "exit 2)"),
):
    """Merge shard outputs (or several runs) into one results directory: newest row per key.
    Rows of more than one sweep or timing method (the --out's own included) are refused (exit 2)
    unless --mix-sweeps."""
    _out(out, "dir")
    from .results import MergeError, RowsError
    from .results import merge as do_merge
    try:
        c = _writing(do_merge, out, inputs, force=force, mix_sweeps=mix_sweeps)
    except (MergeError, RowsError) as e:
        err.print(f"error: {e}", highlight=False)
        raise typer.Exit(2) from None
    console.print(f"merged {len(inputs)} dirs -> {out}: {c['rows']} rows "
                  f"({c['copied']} copied, {c['dropped_older']} older duplicates dropped)")


@app.command()
def compact(dirs: list[Path] = typer.Argument(..., help="results directories")):
    """Fold each results directory's one-row part files into one Parquet file (all rows kept).
    A directory that is not one, a part that is not readable Parquet, or rows that lack the
    columns the views read: one error line, exit 2 (that directory is left as it was)."""
    from .results import RowsError
    from .results import compact as do_compact
    for d in dirs:
        if not (d / "parts").is_dir():
            err.print(f"error: {d}: no parts/ directory (not a results directory)", highlight=False)
            raise typer.Exit(2)
        try:
            c = _writing(do_compact, d)
        except RowsError as e:
            err.print(f"error: {e}", highlight=False, markup=False)
            raise typer.Exit(2) from None
        console.print(f"{d}: {c['files']} part files -> {c.get('file', 'unchanged')} ({c['rows']} rows)")


@app.command()
def submit(
    config: Path = typer.Argument(..., help="sweep YAML"),
    shards: int = typer.Option(..., "--shards", min=1, help="number of shards (one job each)"),
    out: Path = typer.Option(..., "--out", help="results directory; shards write OUT/_shards/shard-i, "
                             "merged into OUT"),
    executor: str = typer.Option("slurm", "--executor", help="slurm (needs Slurm: fails without "
                                 "it) | local | debug (submitit executors)"),
    partition: str | None = typer.Option(None, "--partition", help="Slurm partition"),
    timeout_min: int = typer.Option(240, "--timeout-min", help="per-job time limit (minutes)"),
    resume: bool = typer.Option(True, "--resume/--no-resume", help="shards skip rows already present"),
):
    """Run a sweep as a Slurm job array (one GPU per job) through submitit, then merge."""
    from .cluster import submit_sweep
    s = _load(config)
    _out(out, "dir")
    raise typer.Exit(_writing(submit_sweep, s, config, shards, out, executor, partition,
                              timeout_min, resume, console, err))


@app.command()
def validate(config: Path = typer.Argument(..., help="sweep YAML")):
    """Check a sweep config; print the number of points and rows."""
    from .sweep import points
    s = _load(config)
    pts = points(s)
    console.print(f"{config}: ok — {len(pts)} points × {len(s.backends)} backends × "
                  f"{len(s.directions)} directions = {len(pts) * len(s.backends) * len(s.directions)} rows")


@app.command("list")
def list_points(config: Path = typer.Argument(..., help="sweep YAML"), wide: bool = WIDE):
    """Print the points a sweep expands to; the table fits the terminal (a long layout label reads
    as count x mean length, the lengths wrap; where they are left out the full labels follow)."""
    from . import render
    from .sweep import points
    s = _load(config)
    pts = points(s)
    width = render.terminal_width(wide)
    con = render.console(width)
    cells = render.layout_cells([(p.layout_label, len(p.seqlens), p.total_tokens) for p in pts])
    cols = [render.Column("#", "right"), render.Column("model"), render.Column("h_qk/h_v"),
            render.Column("layout"), render.Column("seqlens", wrap=True, drop=1),
            render.Column("tokens", "right"), render.Column("gate", same=True)]
    f = render.table(con, cols, [[str(p.index), p.model, p.tp_label, c, " ".join(map(str, p.seqlens)),
                                  str(p.total_tokens), p.gate_recipe] for c, p in zip(cells, pts)],
                     width, title=f"{s.name}: {len(pts)} points", what="point")
    if "seqlens" in f.dropped:  # the lengths are not in the table: the shortened labels in full
        for note in render.layout_notes(cells, [p.layout_label for p in pts]):
            render.line(con, f"layout {note}", width)


def _unrunnable_into_kept(config: Path, out_dir: Path, e) -> None:
    """The config's default output directory already holds rows and no backend of the run can
    run here (``runner.NothingRunnable``): say so (exit 2); nothing was written. An explicit
    ``--out`` is obeyed."""
    err.print(f"error: no backend of {config} can run on this machine ({e}). {out_dir} (the "
              "config's `out`) already holds rows, so nothing was written there. Pass --out "
              f"{out_dir} to add `unavailable` rows to it anyway, or --out a new directory.",
              highlight=False)
    raise typer.Exit(2)


@app.command()
def run(
    config: Path = typer.Argument(..., help="sweep YAML (e.g. configs/smoke.yaml)"),
    out: Path | None = typer.Option(None, "--out", help="output directory (default: the config's "
                                    "`out`, under runs/; kept runs are written with an explicit "
                                    "--out results/...)"),
    backends: str | None = typer.Option(None, "--backends", help="comma list overriding the config's backends"),
    direction: str | None = typer.Option(None, "--direction", help="only this one of the config's "
                                         "directions (fwd, bwd or fwdbwd)"),
    limit: int | None = typer.Option(None, "--limit", min=1, help="only the first N points"),
    resume: bool = typer.Option(False, "--resume", help="skip rows already in --out (same key, backend version and parameters)"),
    dry_run: bool = typer.Option(False, "--dry-run", help="print the plan; write nothing"),
    plot: bool = typer.Option(True, "--plot/--no-plot", help="write latency PNGs into --out"),
    gpus: str | None = typer.Option(None, "--gpus", help="'all' or a comma list of GPU indices: one "
                                    "worker per GPU, heaviest points first"),
    shard: str | None = typer.Option(None, "--shard", help="i/n: run only shard i of n (0-based, "
                                     "deterministic); combine shard outputs with `qlabench merge`"),
    retry_failed: bool = typer.Option(False, "--retry-failed", help="with --resume, also re-run "
                                      "crashed / timeout / oom rows"),
    append_other: bool = typer.Option(False, "--append-other", help="add this run's rows to an "
                                      "--out that holds rows of another sweep, input recipe, "
                                      "GPU or timing method (refused otherwise, exit 2; a "
                                      "--resume over rows of another input recipe or timing "
                                      "method stays refused)"),
    row_timeout_s: float | None = typer.Option(None, "--row-timeout-s", min=1, help="a row taking "
                                               "longer is killed and written as `timeout` (default: "
                                               "the config's row_timeout_s); a job with a deadline "
                                               "sets it below what is left"),
    max_timeouts: int | None = typer.Option(None, "--max-timeouts", min=0, help="a backend whose "
                                            "last N rows were all `timeout` is skipped for the "
                                            "rest of the run (default: the config's "
                                            "max_timeouts, 2; 0: never)"),
):
    """Run a sweep: every backend checked against the reference, then timed; one Parquet row each.
    An --out holding rows of another sweep, input recipe, GPU or timing method (timing mode,
    l2) is refused (exit 2) unless --append-other."""
    s = _load(config)
    if direction is not None:
        if direction not in s.directions:
            err.print(f"error: --direction {direction!r}: {config} runs {' | '.join(s.directions)}",
                      highlight=False, markup=False)
            raise typer.Exit(2)
        s = s.model_copy(update={"directions": [direction]})
    limits = {"row_timeout_s": row_timeout_s, "max_timeouts": max_timeouts}
    s = s.model_copy(update={k: v for k, v in limits.items() if v is not None})
    from . import runner
    try:
        runner.early_rows(1)
    except ValueError as e:
        err.print(f"error: {e}", highlight=False)
        raise typer.Exit(2) from None
    names = _backend_list(backends, s)
    shard_t = _parse_shard(shard)
    devices = _parse_gpus(gpus)
    from .sweep import scheduled_points
    pts = scheduled_points(s, limit, shard_t)  # what runner.run measures, for the plan and the bar
    out_dir = out or Path(s.out.format(name=s.name))
    if dry_run:
        t = Table(title=f"plan: {len(pts)} points × {names} × {s.directions} -> {out_dir}")
        for c in ("backend", "available", "version", "reason"):
            t.add_column(c)
        avail, versions, _ = runner.check_isolated(s.entries(names), devices[0] if devices else None)
        for n, (ok, why) in avail.items():
            t.add_row(n, "yes" if ok else "no", versions[n], why)
        console.print(t)
        return
    _out(out_dir, "dir")
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from .paths import RowsError
    total = len(pts) * len(s.directions)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console, transient=not sys.stdout.isatty(),
                  disable=not sys.stdout.isatty()) as prog:
        task = prog.add_task("starting", total=total)
        state = {"n": 0}

        def progress(desc):
            if state["n"]:
                prog.advance(task)
            state["n"] += 1
            prog.update(task, description=desc)

        try:
            summary = runner.run(s, out_dir, config_name=str(config), backend_names=names,
                                 limit=limit, resume=resume, progress=progress,
                                 shard=shard_t, devices=devices, retry_failed=retry_failed,
                                 refuse_unrunnable=out is None, append_other=append_other,
                                 log=(lambda m: prog.console.print(m, highlight=False, markup=False))
                                 if sys.stdout.isatty() else (lambda m: print(m, flush=True)))
        except runner.NothingRunnable as e:
            _unrunnable_into_kept(config, out_dir, e)
        except (runner.OtherRows, RowsError) as e:
            err.print(f"error: {e}", highlight=False, markup=False)
            raise typer.Exit(2) from None
        except OSError as e:
            _os_error(e)
        except KeyboardInterrupt:
            from . import plots, results
            err.print("interrupted: every finished row is saved; rerun with --resume to go on",
                      highlight=False)
            df = results.latest(results.load(out_dir))
            if plot and not df.empty:
                plots.run_figures(df, out_dir)
            raise typer.Exit(130) from None
        prog.update(task, completed=total)
    from . import plots, results
    if summary.counts and set(summary.counts) == {"unavailable"}:
        err.print(f"note: no backend of this run can run on this machine: all "
                  f"{summary.counts['unavailable']} rows it wrote are `unavailable` (the reason is "
                  "in each row)", highlight=False)
    t_fig = time.time()
    df = results.latest(results.load(out_dir))
    made = plots.run_figures(df, out_dir) if plot else []
    runner.note_timeline(out_dir, summary.run_id, figures_s=time.time() - t_fig)
    console.print(f"run {summary.run_id}: {summary.counts or 'nothing new'}"
                  + (f", {summary.skipped_done} rows already done" if summary.skipped_done else "")
                  + f" -> {out_dir}/parts" + (f"; figures: {', '.join(str(m) for m in made)}" if made else ""))
    meta = results.load_meta(out_dir).get(summary.run_id, {})
    fc = runner.fixed_cost(meta.get("timeline_s") or {})
    if fc:
        console.print(f"fixed cost {fc['total']:.1f} s to the first row (start {fc['start']:.1f}, "
                      f"backend checks {fc['checks']:.1f}, ceilings {fc['ceilings']:.1f}, then "
                      f"{fc['to_first_row']:.1f}; the first row's own first call "
                      f"{fc['first_row_compile']:.1f} s not counted)"
                      + (f"; every backend checked at {fc['all_checked']:.1f} s"
                         if "all_checked" in fc else ""), highlight=False)
    from .summary import print_run_summary
    print_run_summary(df)


@app.command()
def compare(
    base: Path = typer.Argument(..., help="baseline results directory (or Parquet file)"),
    new: Path | None = typer.Argument(None, help="new results directory (or Parquet file); with "
                                      "--base-backend/--new-backend it defaults to BASE"),
    threshold: float = typer.Option(0.05, "--threshold", help="relative slowdown that counts (0.05 = 5%)"),
    alpha: float = typer.Option(0.01, "--alpha", help="significance level of the test on samples"),
    out: Path | None = typer.Option(None, "--out", help="write the verdicts here (.json or .csv)"),
    base_backend: str | None = typer.Option(None, "--base-backend", help="compare two backend "
                                            "labels: this one's rows in BASE (e.g. flashinfer@0.6.13)"),
    new_backend: str | None = typer.Option(None, "--new-backend", help="... against this one's "
                                           "rows in NEW (e.g. flashinfer@0.7.4), per point"),
    allow_incomparable: bool = typer.Option(False, "--allow-incomparable", help="pairs whose rows "
                                            "differ in timing method, GPU model or input recipe "
                                            "stay unjudged without exit 3; the exit code is the "
                                            "other pairs' (0 or 1)"),
    wide: bool = WIDE,
):
    """Compare two runs row by row, or two backend labels point by point (BASE, then NEW).

    \b
    Exit codes (the first that applies):
      2  bad input: a path missing, unreadable or without rows, required columns missing, no key
         in common, a backend label of BASE without rows in NEW (pair labels with
         --base-backend/--new-backend), a --base-backend/--new-backend label without rows,
         every pair the same stored row, bad --out / --threshold / --alpha
      3  method, GPU or recipe differ from the baseline: some pair's rows differ in timing_mode,
         l2, gpu_name, recipe_hash or gate_recipe (incomparable; not with --allow-incomparable)
      1  a row is slower (beyond --threshold and Mann-Whitney p < --alpha) or broken (ok in BASE,
         not ok or missing in NEW)
      0  otherwise
    """
    from .compare import compare_cmd
    if out is not None:
        _out(out, "file")
    if (base_backend is None) != (new_backend is None):
        err.print("error: --base-backend and --new-backend go together", highlight=False)
        raise typer.Exit(2)
    if new is None and base_backend is None:
        err.print("error: NEW is missing (or give --base-backend and --new-backend to compare two "
                  "labels inside BASE)", highlight=False)
        raise typer.Exit(2)
    raise typer.Exit(_writing(compare_cmd, base, new if new is not None else base,
                              threshold=threshold, alpha=alpha, out=out, base_backend=base_backend,
                              new_backend=new_backend, allow_incomparable=allow_incomparable,
                              wide=wide))


@app.command()
def summary(
    results_dir: Path = typer.Argument(..., help="results directory (e.g. results/h200_fwd)"),
    model: str | None = typer.Option(None, "--model", help="model name or h_qk/h_v, e.g. 16/64"),
    direction: str | None = typer.Option(None, "--direction", help="fwd | bwd | fwdbwd (default: all)"),
    baseline: str | None = typer.Option(None, "--baseline", show_default="fla",
                                        help="backend label the speedup is over, or best-library (per point the fastest "
                                             "library row); a label with no rows: exit 2"),
    alpha: float = typer.Option(0.01, "--alpha", help="significance level of the tie test"),
    threshold: float = typer.Option(0.01, "--threshold", help="differences up to this are ties (0.01 = 1%)"),
    wide: bool = WIDE,
):
    """Per point: the fastest correct backend, its latency and spread (p10-p90), runner-up,
    margin, tie, speedup over the baseline and correctness; per model: geomean speedups and wins.
    Tables fit the terminal: columns left out in a narrow one are named under the table.

    Exit codes: 0 tables printed; 2 bad input (one error line on stderr: a path missing or
    unreadable, rows lacking columns the views read, no rows, no ok row, an unknown --model,
    --direction or --baseline). Rows with a null key column and ok rows without a finite
    latency > 0 are set aside (one note line says how many)."""
    _tie_rule(alpha, threshold, direction)
    from .summary import summary_cmd
    raise typer.Exit(summary_cmd(results_dir, model, direction, baseline, alpha, threshold,
                                 wide=wide))


@app.command()
def recommend(
    results_dir: Path = typer.Argument(..., help="results directory (e.g. results/h200_fwd)"),
    out: Path = typer.Option(Path("runs/dispatch.json"), "--out", help="dispatch table JSON (docs/dispatch.md)"),
    direction: str = typer.Option("fwd", "--direction", help="fwd | bwd | fwdbwd"),
    backends: str | None = typer.Option(None, "--backends", help="comma list of labels to choose "
                                        "from (default: every label in the rows)"),
    alpha: float = typer.Option(0.01, "--alpha", help="significance level of the tie test"),
    threshold: float = typer.Option(0.01, "--threshold", help="differences up to this are ties (0.01 = 1%)"),
    check: list[Path] = typer.Option([], "--check", help="another results directory of the same GPU: "
                                     "the table is also judged on its points (repeatable)"),
    wide: bool = WIDE,
):
    """Dispatch table: per batch shape and head config, the fastest correct backend, judged held
    out twice (leave one layout out per model; leave one head config out) and on each --check
    directory (accuracy and geomean regret printed and stored).

    Exit codes: 0 table written; 2 bad input (one error line on stderr: a path missing or
    unreadable, rows lacking columns the views read, no ok row of --direction, a --backends label without rows, a --check directory
    without ok rows of --direction or measured on another GPU)."""
    _tie_rule(alpha, threshold, direction)
    _out(out, "file")
    from .dispatch import recommend_cmd
    raise typer.Exit(_writing(recommend_cmd, results_dir, out, direction, backends, alpha,
                              threshold, check, wide=wide))


@app.command()
def choose(
    table: Path = typer.Argument(..., help="dispatch table JSON written by `qlabench recommend`"),
    heads: str = typer.Option(..., "--heads", help="head config H_QK/H_V, e.g. 16/64"),
    seqlens: str = typer.Option(..., "--seqlens", help="comma-separated sequence lengths of the batch, "
                                "e.g. 4096,4096"),
    fallback: bool = typer.Option(True, "--fallback/--no-fallback", help="answer from the bucket over "
                                  "all head configs where the head config has no measured point"),
):
    """The backend a dispatch table names for one batch, and why (first line: the label).

    Exit codes: 0 a backend named; 1 the table names none (the reason says why); 2 bad input
    (one error line on stderr: a table missing or not a dispatch table, an impossible head
    config, empty or non-positive lengths)."""
    from .dispatch import choose_cmd
    raise typer.Exit(choose_cmd(table, heads, seqlens, fallback))


@app.command()
def report(
    results_dirs: list[Path] = typer.Argument(..., help="one or more results directories"),
    out: Path = typer.Option(Path("site"), "--out", help="output folder for the static HTML dashboard"),
    baseline: str | None = typer.Option(None, "--baseline", show_default="fla",
                                        help="backend label speedups are over, or best-library (per point the fastest "
                                             "library row); a label with no rows: exit 2"),
):
    """Static HTML dashboard (no server) over one or more results directories.

    Exit codes: 0 page written; 2 bad input (one error line on stderr: a path missing or
    unreadable, rows lacking columns the views read, no rows in any directory, a --baseline
    label without rows)."""
    _out(out, "dir")
    from .report import report_cmd
    raise typer.Exit(_writing(report_cmd, results_dirs, out, baseline))


@app.command()
def reproduce(
    name: str = typer.Argument("flashqla-h200", help="published table set (configs/published/NAME)"),
    direction: str = typer.Option("fwd", "--direction", help="fwd | bwd"),
    from_: Path | None = typer.Option(None, "--from", help="results directory measured by `qlabench run` "
                                      "of the set's sweep (needed: reproduce only reads rows)"),
    out: Path = typer.Option(Path("runs/reproduce"), "--out", help="where to write the side-by-side table and figure"),
    baseline: str | None = typer.Option(None, "--baseline", show_default="fla",
                                        help="backend label the in-repo kernel's extra speedup is over "
                                        "(the published speedup keeps the set's own baseline; a label "
                                        "with no rows: exit 2)"),
    wide: bool = WIDE,
):
    """Published speedup table vs measured rows (--from), side by side, with a summary; the
    terminal tables fit the terminal (the columns left out are named under each table).

    Exit codes: 0 report written (whatever the agreement); 2 bad input (one error line on
    stderr: an unknown set or --direction, no --from, --from missing, unreadable or without rows
    of that direction, a --baseline label without rows)."""
    _out(out, "dir")
    from .reproduce import reproduce_cmd
    raise typer.Exit(_writing(reproduce_cmd, name, direction, from_, out, baseline=baseline,
                              wide=wide))


@app.command("profile")
def profile_cmd(
    config: Path = typer.Argument(..., help="sweep YAML"),
    point: str = typer.Option("0", "--point", help="point index, or a layout label such as 1x32768 "
                              "(with --model to disambiguate)"),
    model: str | None = typer.Option(None, "--model", help="model name or h_qk/h_v, e.g. 2/8"),
    backend: str = typer.Option(..., "--backend", help="backend to profile"),
    direction: str = typer.Option("fwd", "--direction", help="fwd | bwd | fwdbwd"),
    ncu: bool = typer.Option(False, "--ncu", help="also run Nsight Compute (needs `ncu` on PATH)"),
    ncu_set: str | None = typer.Option(None, "--ncu-set", help="with --ncu: an ncu section set "
                                       "(e.g. full) instead of the headline metrics; saves the "
                                       "details page as text"),
    ncu_kernel: str | None = typer.Option(None, "--ncu-kernel", help="with --ncu: only kernels whose "
                                          "name matches this regex"),
    out: Path = typer.Option(Path("runs/profile"), "--out", help="where to save the table / ncu report"),
):
    """Kernel breakdown of one backend on one point (torch.profiler; optional Nsight Compute)."""
    from .profiling_cli import profile_main
    s = _load(config)
    _out(out, "dir")
    raise typer.Exit(_writing(profile_main, s, config, point, model, backend, direction, ncu, out,
                              console, err, ncu_set=ncu_set, ncu_kernel=ncu_kernel))


@app.command()
def precompile(
    targets: list[str] = typer.Argument(..., metavar="CONFIG", help="sweep YAMLs, or named sets: "
                                        "tests | fwd_sweep | bwd_sweep | sweep | all"),
    jobs: int = typer.Option(1, "--jobs", help="head configs compiled at a time (worker processes)"),
):
    """Compile the in-repo TileLang kernels the sweeps need (sm_90a, offline: nvcc, no GPU) into
    $TILELANG_CACHE_DIR."""
    from .precompile import NAMED, precompile_targets
    for t in targets:  # every YAML checked before anything compiles
        if t not in NAMED:
            _load(Path(t))
    raise typer.Exit(precompile_targets(targets, jobs, echo=lambda line: console.print(line, highlight=False)))


def main():  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    app()
