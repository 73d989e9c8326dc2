"""Row schema and durable storage: one Parquet part per finished row, written atomically.

Layout of an output directory (every path that is not rows starts with ``_`` — pyarrow's dataset
discovery skips names starting with ``_`` or ``.`` and tries to read every other file as Parquet)::

    OUT/parts/<run_id>-<n>-<backend>-<direction>.parquet   one row each (the truth)
    OUT/parts/rows.parquet (or compact-*.parquet)           a kept run's rows in one file
    OUT/_runs/<run_id>.json                                 run metadata + environment
    OUT/_logs/, OUT/_figures/, OUT/_shards/, OUT/_notes/    worker logs, figures, submit shards,
                                                            kept notes (README, logs, verdicts)

``pandas.read_parquet(OUT)`` and :func:`load` read every stored row of every run in it, one-row
parts and compacted files alike (``--resume`` adds parts beside them); ``load(OUT, latest=True)``
gives one row per key. Rows are read as stored (nothing is derived on load; a column a part
lacks is null in its rows); :func:`read_rows`, what the views, ``merge``, ``compact`` and
``run --resume`` read with, refuses rows without :data:`REQUIRED_COLUMNS`. The columns are
documented in
``docs/schema.md``, generated from :data:`SCHEMA` and :data:`FIELDS`
(``python -m qlabench.results --schema-md docs/schema.md``).

Resume key (:func:`resume_key`): (point key, backend, direction, backend version, backend
parameters), ``backend`` being the entry's label (``flashinfer@0.7.4``; a plain entry's label is
its name). ``backend_name`` is the registry name (``flashinfer``). One directory holds one sweep: :func:`owners` says which sweep, input recipe and GPU
its rows are of, and :func:`qlabench.runner.run` refuses to add rows of another.
"""

from __future__ import annotations

import json
import os
import platform
import re
import socket
import subprocess
import time
import uuid
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

# the directories of a results directory (see the module docstring); the error of unreadable rows
from .paths import FIGURES_DIR, LOGS_DIR, PARTS_DIR, RUNS_DIR, SHARDS_DIR, RowsError  # noqa: F401

STATUSES = ("ok", "unavailable", "unsupported", "incorrect", "oom", "crashed", "timeout",
            "skipped")
#: statuses a resume re-tries (the library or device may be there now; a backend skipped after
#: its timeouts never ran those rows)
RETRY_STATUSES = ("unavailable", "skipped")
#: statuses ``--retry-failed`` runs again (a fixed kernel, a longer timeout, a bigger GPU)
FAILED_STATUSES = ("crashed", "timeout", "oom")
OUTPUTS = ("o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dh0")

_f, _i, _s, _b = pa.float64(), pa.int64(), pa.string(), pa.bool_()
SCHEMA = pa.schema(
    [
        # identity
        ("run_id", _s), ("git_sha", _s), ("config", _s), ("point_index", _i), ("point_key", _s),
        ("recipe_hash", _s), ("model", _s), ("tp", _s), ("tp_degree", _i), ("h_qk", _i), ("h_v", _i),
        ("head_dim", _i), ("seqlens", pa.list_(_i)), ("layout", _s), ("total_tokens", _i),
        ("num_seqs", _i), ("dtype", _s), ("gate_recipe", _s), ("gate_zero_frac", _f),
        ("initial_state", _b), ("output_final_state", _b),
        ("direction", _s), ("backend", _s), ("backend_version", _s),
        # ``backend`` is the entry's label (the identity); ``backend_name`` the registry name
        ("backend_name", _s), ("backend_params", _s),
        ("gpu_name", _s), ("gpu_index", _i), ("gpu_uuid", _s), ("campaign_id", _s),
        ("started_at", _s),
        # outcome
        ("status", _s), ("reason", _s),
        # timing
        ("latency_ms", _f), ("p10_ms", _f), ("p90_ms", _f), ("iqr_ms", _f), ("mean_ms", _f),
        ("rse", _f), ("samples_ms", pa.list_(_f)), ("n_samples", _i), ("timing_mode", _s),
        ("timing_fallback", _s), ("stop_reason", _s), ("calls_per_sample", _i), ("l2", _s),
        ("compile_s", _f), ("wall_s", _f),
        ("sm_clock_mhz_before", _f), ("sm_clock_mhz_after", _f), ("throttled", _b),
        # correctness (per output)
        *[(f"rel_l2_{o}", _f) for o in OUTPUTS],
        *[(f"max_abs_{o}", _f) for o in OUTPUTS],
        # worst 64-token chunk x head (token outputs) or sequence x head (final_state, dh0)
        *[(f"local_rel_l2_{o}", _f) for o in OUTPUTS],
        ("max_rel_l2", _f), ("worst_block_rel_l2", _f),
        # the timed path on fresh inputs (seed ``check_seed``) vs their reference, its time and
        # the backend's refresh's; the marginal cost of an unrolled call of the timed graph
        ("timed_max_rel_l2", _f), ("check_seed", _i), ("rerun_ms", _f), ("refresh_ms", _f),
        ("marginal_ratio", _f),
        # derived
        ("flops", _f), ("min_bytes", _f), ("intensity_flop_per_byte", _f), ("roofline_ms", _f),
        ("tflops", _f), ("gbps", _f), ("pct_roofline", _f),
        ("sm_util_pct", _f), ("sm_occupancy_pct", _f), ("tensor_util_pct", _f),
        ("dram_bw_util_pct", _f), ("gpm_window_ms", _f), ("gpm_reason", _s),
        ("ctas", _i), ("ctas_per_sm", _f), ("kernels_per_call", _i), ("top_kernel", _s),
        # every kernel one call launched (JSON list by time: name, calls, share_pct, grid, block,
        # regs_per_thread, smem_bytes) and the backend's short label of that route
        ("kernels", _s), ("path", _s),
    ]
)
COLUMNS = [f.name for f in SCHEMA]

_LOCAL = "worst (64-token chunk x head) RMS error in units of the larger of the (sequence x " \
         "head)'s and the head's reference RMS and of the chunk's bf16-rounding sensitivity for " \
         "o, dq, dk, dv, dg, dbeta (`qlabench/correctness.py`); " \
         "worst (sequence x head) relative L2 error for final_state, dh0"
#: column -> (unit, meaning); ``docs/schema.md`` is generated from this and :data:`SCHEMA`
FIELDS: dict[str, tuple[str, str]] = {
    "run_id": ("", "the run that wrote the row: `<YYYYmmddTHHMMSS>-<6 hex>` (its metadata: "
               "`_runs/<run_id>.json`)"),
    "git_sha": ("", "qlabench commit of the run (`-dirty`: uncommitted changes to tracked files)"),
    "config": ("", "the sweep YAML the run was started with, as given on the command line"),
    "point_index": ("", "the point's position in its sweep (models-major, layouts-minor)"),
    "point_key": ("", "identity of the point: `h_qk/h_v/d<head_dim>|<seqlens space-separated>|"
                  "<dtype>`, plus `|gate=<recipe>` for a gate recipe other than `published`; "
                  "with `backend` and `direction` the key of a row (`results.KEY`)"),
    "recipe_hash": ("", "hash of everything that defines the inputs (lengths, heads, dtype, gate "
                    "and seeds, state flags); rows of one key and two hashes are never mixed"),
    "model": ("", "model / head-configuration name (`397B/122B TP8`, `35B/9B/4B TP2`, or a custom "
              "name)"),
    "tp": ("", "head-configuration label `h_qk/h_v` (e.g. `2/8`); kept under this name for "
           "compatibility — it is not a TP degree (see `tp_degree`)"),
    "tp_degree": ("", "tensor-parallel degree the model name states (`397B/122B TP8` -> 8); null "
                  "where the name states none (`Sym h32`, a custom name)"),
    "h_qk": ("heads", "query/key heads"),
    "h_v": ("heads", "value heads (a multiple of `h_qk`; v-head j reads q/k head j // (h_v/h_qk))"),
    "head_dim": ("", "head dimension K = V"),
    "seqlens": ("tokens", "the sequence lengths of the varlen batch, in order"),
    "layout": ("", "layout label, count first: `1x32768` (one sequence), `4x8192` (four of 8192), "
               "`2x[28672,4096]` (unequal lengths, in order), `8x~4096s42` (random split of "
               "8 x 4096 tokens, seed 42); unique per point"),
    "total_tokens": ("tokens", "sum of `seqlens`"),
    "num_seqs": ("", "number of sequences"),
    "dtype": ("", "dtype of the q, k, v inputs: `bf16` or `fp16`"),
    "gate_recipe": ("", "gate recipe and its parameters: `zero<frac>/seed<n>` (published) or "
                    "`<recipe>:<params>/seed<n>`"),
    "gate_zero_frac": ("fraction", "share of v-heads with g = 0 (no decay), published recipe"),
    "initial_state": ("", "whether an initial state h0 is passed"),
    "output_final_state": ("", "whether the final state is returned"),
    "direction": ("", "`fwd` (forward), `bwd` (backward pass) or `fwdbwd` (both)"),
    "backend": ("", "the backend entry's label (`flashinfer@0.7.4`; a plain entry's label is its "
                "name): the identity in keys, compare, report, figures"),
    "backend_version": ("", "version of the library imported where the entry ran (`unavailable` "
                        "when it did not import); for the in-repo kernels (`tilelang`) `src-` and a "
                        "hash of their code (syntax trees without docstrings: comments do not count) "
                        "and of the cost table that planned them"),
    "backend_name": ("", "registry name of the library (`reference`, `fla`, `flashinfer`, "
                     "`flashqla`, `tilelang`); where it is null or absent the views use `backend`"),
    "backend_params": ("", "the entry's backend parameters (YAML `params:`) that differ from the "
                       "backend's defaults, as sorted JSON (`{}`: defaults); a resume re-measures "
                       "a key whose parameters changed"),
    "gpu_name": ("", "device name (`cpu` without CUDA)"),
    "gpu_index": ("", "CUDA device index the row ran on (after `CUDA_VISIBLE_DEVICES`)"),
    "gpu_uuid": ("", "the GPU's UUID; ratios pair rows of one GPU"),
    "campaign_id": ("", "measurement campaign (a run and its `--resume` continuations on the same "
                    "GPUs); ratios pair rows of one campaign"),
    "started_at": ("ISO 8601, local time", "when the row's measurement started"),
    "status": ("", "`ok`, `unavailable` (library or device missing; a resume retries it), "
               "`unsupported` (the backend cannot run this point, or the library refused it "
               "for its version or platform: the library's message in `reason`), `incorrect` "
               "(checked against "
               "the reference and wrong), `oom`, `crashed`, `timeout`, `skipped` (not run: the "
               "backend's previous `max_timeouts` rows of the run all timed out; a resume "
               "runs it)"),
    "reason": ("", "why the status, in words (empty for a clean `ok`)"),
    "latency_ms": ("ms per call", "median of `samples_ms`"),
    "p10_ms": ("ms per call", "10th percentile of `samples_ms` (inclusive method)"),
    "p90_ms": ("ms per call", "90th percentile of `samples_ms`"),
    "iqr_ms": ("ms per call", "75th minus 25th percentile of `samples_ms`"),
    "mean_ms": ("ms per call", "mean of `samples_ms`"),
    "rse": ("fraction", "relative standard error of the mean of `samples_ms`: stdev / sqrt(n) / "
            "mean (0.005 = 0.5%); the stopping rule's target is `timing.rse_target`"),
    "samples_ms": ("ms per call", "every sample, in order. `graph-batch`: one sample per CUDA-graph "
                   "replay, the replay's time divided by the `calls_per_sample` calls unrolled in "
                   "it (the mean of those calls); `graph-single` and `events`: one call each; "
                   "`cpu`: wall clock of one synchronous call"),
    "n_samples": ("", "number of samples"),
    "timing_mode": ("", "`graph-batch`, `graph-single`, `events` or `cpu` (rows of different modes "
                    "are never compared)"),
    "timing_fallback": ("", "why a graph mode fell back to `events` (empty otherwise)"),
    "stop_reason": ("", "why sampling stopped: `rse` (target reached), `budget`, `max_samples`"),
    "calls_per_sample": ("calls", "calls per sample: calls unrolled in one graph replay "
                         "(`graph-batch`), else 1"),
    "l2": ("", "`warm` (L2 flushed before each replay, outside the graph) or `cold` (flushed "
           "before every call inside the graph, flush time subtracted); `n/a` on CPU"),
    "compile_s": ("s", "wall time of the first call (the one checked against the reference): "
                  "JIT compile, autotune, first launch; never part of latency"),
    "wall_s": ("s", "wall time of the row: prepare, compile, check, timing, profile"),
    "sm_clock_mhz_before": ("MHz", "SM clock (NVML) just before timing"),
    "sm_clock_mhz_after": ("MHz", "SM clock (NVML) just after timing"),
    "throttled": ("", "NVML reported a clock-event (throttle) reason around the timing; such a row "
                  "is re-measured once and stays marked if still throttled"),
    **{f"rel_l2_{o}": ("ratio", f"relative L2 error of `{o}`: ||out - ref|| / ||ref|| against the "
                       "reference (the config's `reference`; chunked fp32 by default; null: not "
                       "an output of this direction)") for o in OUTPUTS},
    **{f"max_abs_{o}": ("same unit as the output", f"largest absolute error of `{o}`")
       for o in OUTPUTS},
    **{f"local_rel_l2_{o}": ("ratio", f"relative L2 error of `{o}`, {_LOCAL}") for o in OUTPUTS},
    "max_rel_l2": ("ratio", "largest `rel_l2_*` of the row"),
    "worst_block_rel_l2": ("ratio", "largest `local_rel_l2_*` of the row"),
    "timed_max_rel_l2": ("ratio", "largest relative L2 error of the timed path's own outputs, every "
                         "call of one more graph replay or timed-style call, on fresh inputs "
                         "(seed `check_seed`) against their reference"),
    "check_seed": ("", "seed of the fresh inputs the timed path was checked on"),
    "rerun_ms": ("ms per call", "the timed path's rerun on the fresh inputs, one more sample timed "
                 "as the samples were; the gate fails it above `RERUN_FACTOR` x the larger of "
                 "`p90_ms` and a rerun on the point's own inputs just before it (named in "
                 "`reason` where it decides) + `RERUN_FLOOR_MS` per rerun "
                 "(`qlabench/measure.py`, docs/correctness.md)"),
    "refresh_ms": ("ms", "the backend's `Prepared.refresh` after the fresh inputs were written "
                   "(one eager call, timed with the timing mode's clock; null: no refresh); "
                   "recorded, not judged (docs/correctness.md)"),
    "marginal_ratio": ("ratio", "graph-batch: marginal cost of one unrolled call of the timed "
                       "graph over the mean per-call time (about 1; near 0 when the calls do "
                       "the work of one, which the gate fails below 0.5)"),
    "flops": ("FLOP per call", "FLOP model of the chunked algorithm (`qlabench/metrics.py`)"),
    "min_bytes": ("bytes per call", "minimum HBM traffic: every input read and output written once"),
    "intensity_flop_per_byte": ("FLOP/byte", "`flops / min_bytes`"),
    "roofline_ms": ("ms per call", "roofline bound: max(flops / peak FLOP/s, min_bytes / peak "
                    "bandwidth), with the run's measured ceilings (null on CPU)"),
    "tflops": ("TFLOP/s", "`flops / latency_ms`"),
    "gbps": ("GB/s (1e9 bytes/s)", "`min_bytes / latency_ms`: the bandwidth the minimum traffic "
             "would need, not measured traffic"),
    "pct_roofline": ("%", "`100 x roofline_ms / latency_ms`"),
    "sm_util_pct": ("%", "NVML GPM SM activity during replays of the timed graph"),
    "sm_occupancy_pct": ("%", "NVML GPM SM occupancy (resident warps / maximum)"),
    "tensor_util_pct": ("%", "NVML GPM tensor-core activity"),
    "dram_bw_util_pct": ("%", "NVML GPM DRAM bandwidth utilisation"),
    "gpm_window_ms": ("ms", "length of the GPM sampling window"),
    "gpm_reason": ("", "why the GPM columns are empty (no GPM support, disabled, ...)"),
    "ctas": ("CTAs", "grid size (blocks) of the kernel with the most time in one eager call"),
    "ctas_per_sm": ("CTAs per SM", "`ctas / SM count`"),
    "kernels_per_call": ("launches", "kernel launches of one eager call"),
    "top_kernel": ("", "name of the kernel with the most time (first 200 characters)"),
    "kernels": ("JSON", "every kernel one eager call launched, by time: list of {name, calls, "
                "share_pct, grid, block, regs_per_thread, smem_bytes}"),
    "path": ("", "the route one call took. FLA: as its own backend dispatch chose it, "
             "`triton` plus `+<backend>:<op>` for each op sent elsewhere "
             "(`triton+tilelang:chunk_bwd_dqkwg`), `unknown` where fla has no dispatch to ask; "
             "also on a row that failed in its first call. Others: the backend's short name of "
             "the route those kernels form: FlashInfer `flat` (CUTLASS) / `cp` / `fused`, "
             "FlashQLA `cp` / `fused`, TileLang `split` / `direct`"),
}


def new_run_id() -> str:
    return time.strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:6]


def git_sha(cwd: str | None = None) -> str:
    """``$QLABENCH_GIT_SHA`` when set (the caller names the commit it shipped: a tree copied onto
    another checkout, or a ``git archive`` tree); else the checkout's commit (``-dirty`` with
    uncommitted changes to tracked files); else ``unknown``."""
    if os.environ.get("QLABENCH_GIT_SHA"):
        return os.environ["QLABENCH_GIT_SHA"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=cwd or os.getcwd(),
                             capture_output=True, text=True, timeout=5)
        sha = out.stdout.strip()
        if out.returncode or not sha:
            return "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=cwd or os.getcwd(), capture_output=True, text=True, timeout=5)
        return sha + ("-dirty" if dirty.stdout.strip() else "")
    except Exception:
        return "unknown"


def environment() -> dict:
    """Versions and machine facts for the run metadata."""
    env: dict = {"hostname": socket.gethostname(), "python": platform.python_version(),
                 "platform": platform.platform()}
    try:
        import torch
        env["torch"] = torch.__version__
        env["cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            env.update(gpu_name=p.name, sm_count=p.multi_processor_count,
                       gpu_mem_gib=round(p.total_memory / 2**30, 1),
                       gpu_count=torch.cuda.device_count())
    except Exception as e:
        env["torch"] = f"error: {e}"
    from importlib.metadata import PackageNotFoundError, version

    from . import backends
    dists = ["triton", "tilelang", "nvidia-ml-py", "pydantic", "pandas", "pyarrow"]
    for name in backends.names():  # each registered backend's distribution
        try:
            dists.append(backends.backend_class(name).distribution)
        except Exception:
            continue
    for dist in dict.fromkeys(d for d in dists if d):
        try:
            env[dist] = version(dist)
        except PackageNotFoundError:
            env[dist] = None
    try:
        import pynvml
        pynvml.nvmlInit()
        env["driver"] = pynvml.nvmlSystemGetDriverVersion()
    except Exception:
        env["driver"] = None
    return env


def resume_key(point_key: str, backend: str, direction: str, backend_version: str,
               backend_params: str) -> tuple:
    """What ``--resume`` matches a row to measure against the finished rows stored: point,
    backend label, direction, backend version and parameters (JSON) — another version or other
    parameters of a label are measured again."""
    return (point_key, backend, direction, backend_version, backend_params)


class ResultStore:
    def __init__(self, out_dir: str | Path):
        self.out = Path(out_dir)
        self.parts = self.out / PARTS_DIR
        self.runs = self.out / RUNS_DIR
        self.logs = self.out / LOGS_DIR

    def ensure(self) -> None:
        self.parts.mkdir(parents=True, exist_ok=True)
        self.runs.mkdir(parents=True, exist_ok=True)

    def write_meta(self, run_id: str, meta: dict) -> Path:
        self.ensure()
        p = self.runs / f"{run_id}.json"
        tmp = p.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(meta, indent=1, default=str))
        os.replace(tmp, p)
        return p

    def append(self, row: dict) -> Path:
        """Write one row durably: temp file, fsync, atomic rename."""
        self.ensure()
        full = {c: row.get(c) for c in COLUMNS}
        if full["tp_degree"] is None:
            from .sweep import tp_degree
            full["tp_degree"] = tp_degree(full["model"])
        table = pa.Table.from_pylist([full], schema=SCHEMA)
        name = (f"{row['run_id']}-{row['point_index']:04d}-{row['backend']}-"
                f"{row['direction']}.parquet")
        p = self.parts / name
        tmp = self.parts / f".{name}.tmp"
        with open(tmp, "wb") as fh:
            pq.write_table(table, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, p)
        return p

    def load(self) -> pd.DataFrame:
        return load(self.out)

    def done_keys(self, retry_failed: bool = False) -> dict[tuple, str]:
        """:func:`resume_key` -> recipe_hash of the finished rows: every status but
        :data:`RETRY_STATUSES` (an ``incorrect`` row is a finished result), and with
        ``retry_failed`` but :data:`FAILED_STATUSES` too (crashed / timeout / oom run again).
        :class:`RowsError` as :func:`read_rows` gives it (rows of an older schema, a corrupt
        part)."""
        df = read_rows(self.out) if self.out.exists() else pd.DataFrame()
        if df.empty:
            return {}
        retry = RETRY_STATUSES + (FAILED_STATUSES if retry_failed else ())
        df = df[~df["status"].isin(retry)]
        return {resume_key(r.point_key, r.backend, r.direction, r.backend_version,
                           r.backend_params): r.recipe_hash for r in df.itertuples()}


def compact(path: str | Path) -> dict:
    """Fold a results directory's one-row part files into one Parquet file (``compact-<ts>.parquet``,
    every row kept, history included) — a kept run of ~600 rows goes from ~14 MB of small files
    to ~0.2 MB. Safe to interrupt: the new file is written and renamed into place before any old
    part is removed; a row present twice (old part + compact file of an interrupted compact) is
    the same row, which ``latest`` and ``done_keys`` treat as one and the next compact stores once."""
    parts_dir = Path(path) / PARTS_DIR
    files = _part_files(parts_dir)
    if len(files) < 2:
        return {"files": len(files), "rows": 0}
    df = read_rows(path)
    df = df.drop_duplicates(subset=ROW_IDENTITY)  # a row stored twice (interrupted compact) once
    name = _write_rows_file(parts_dir, "compact", df)
    for f in files:
        f.unlink()
    return {"files": len(files), "rows": len(df), "file": name}


def _part_files(parts_dir: Path) -> list[Path]:
    return sorted(f for f in parts_dir.glob("*.parquet") if not f.name.startswith((".", "_"))
                  and f.is_file())


def holds_rows(path: str | Path) -> bool:
    """Whether a results directory holds at least one stored row file."""
    return bool(_part_files(Path(path) / PARTS_DIR))


#: what a stored row says about the sweep, input recipe, GPU and timing method it belongs to
#: (:func:`owners`)
OWNER_COLUMNS = ("run_id", "config", "point_key", "direction", "recipe_hash", "gate_recipe",
                 "gpu_name", "status", "timing_mode", "l2")
#: timing modes that say nothing of a directory's method: ``events`` is also the per-row fallback
#: of a graph mode (a call that cannot be captured), ``cpu`` every row of a run without a GPU
FALLBACK_MODES = ("events", "cpu")


def timed_methods(df: pd.DataFrame) -> pd.DataFrame:
    """The ``ok`` rows of ``df`` whose ``timing_mode`` sets a method (known, not one of
    :data:`FALLBACK_MODES`); empty when ``df`` has no such column."""
    if df.empty or not {"status", "timing_mode", "l2"} <= set(df.columns):
        return df.iloc[:0]
    return df[(df["status"] == "ok") & df["timing_mode"].notna()
              & ~df["timing_mode"].isin(FALLBACK_MODES)]


def other_method(df: pd.DataFrame, mode: str, l2: str) -> pd.DataFrame:
    """The rows of ``df`` (:func:`timed_methods`) timed with another method than a run of
    ``mode``/``l2`` times with: another mode or l2; every one of them for a run in a
    :data:`FALLBACK_MODES` mode."""
    t = timed_methods(df)
    if mode in FALLBACK_MODES:
        return t
    return t[(t["timing_mode"] != mode) | (t["l2"] != l2)]


def method_counts(df: pd.DataFrame) -> dict[str, int]:
    """``"timing_mode=M, l2=L"`` -> number of rows, over :func:`timed_methods` of ``df``."""
    t = timed_methods(df)
    return {f"timing_mode={m}, l2={c}": int(n) for (m, c), n in
            t.groupby(["timing_mode", "l2"], dropna=False).size().items()}


def owners(path: str | Path) -> pd.DataFrame:
    """Per stored row of a results directory: :data:`OWNER_COLUMNS` (null where a row lacks one),
    ``sweep``, the sweep's name from its run's metadata (``sweep.name`` in
    ``_runs/<run_id>.json``), else the stem of its ``config`` where that names a YAML file, else
    null, and ``judged_by`` (:func:`judged_by` of its run's sweep; null without metadata).
    Reads only these columns (thousands of one-row parts in about a second); no rows: an empty
    frame with these columns."""
    import pyarrow.dataset as ds
    cols = list(OWNER_COLUMNS)
    files = _part_files(Path(path) / PARTS_DIR)
    if not files:
        return pd.DataFrame(columns=[*cols, "sweep", "judged_by"])
    try:
        df = ds.dataset([str(f) for f in files], format="parquet",
                        schema=pa.schema([SCHEMA.field(c) for c in cols])).to_table().to_pandas()
    except (pa.ArrowInvalid, pa.ArrowTypeError, NotImplementedError):  # a part of another schema
        df = load(path).reindex(columns=cols)
    meta = {rid: m for rid, m in load_meta(path).items() if isinstance(m, dict)}
    names = {rid: (m.get("sweep") or {}).get("name") for rid, m in meta.items()}
    judges = {rid: judged_by(m["sweep"]) for rid, m in meta.items() if isinstance(m.get("sweep"), dict)}

    def sweep_of(run_id, config):
        name = names.get(run_id)
        if name:
            return str(name)
        c = str(config or "")
        return Path(c).stem if c.endswith((".yaml", ".yml")) else None

    df["sweep"] = [sweep_of(r, c) for r, c in zip(df["run_id"], df["config"])]
    df["judged_by"] = [judges.get(r) for r in df["run_id"]]
    return df


def judged_by(sweep: dict) -> str | None:
    """What a run's verdicts were judged by, from its sweep (as dumped into its metadata): the
    correctness limits (``thresholds``) and the reference (``reference``), as canonical JSON;
    None where the dump has neither."""
    part = {k: sweep[k] for k in ("thresholds", "reference") if k in sweep}
    return json.dumps(part, sort_keys=True) if part else None


def load(path: str | Path, latest: bool = False) -> pd.DataFrame:
    """The rows under a results directory (its ``parts/*.parquet``, one-row parts or a compacted
    ``rows.parquet``; every other file under it is ignored) or of a single Parquet file, as
    stored (``docs/schema.md``). With ``latest``: one row per key
    (point, backend label, direction), as :func:`latest` picks it — the documented way to get
    "the" result of each point. :class:`RowsError` naming the file for a part that is not
    readable Parquet or whose column types clash with another part's."""
    df = _frame(_tables(Path(path)))
    return globals()["latest"](df) if latest else df


#: columns the views (summary, recommend, report, reproduce, compare), ``merge``, ``compact`` and
#: ``run --resume`` read: rows without one of them are refused (:func:`read_rows`)
REQUIRED_COLUMNS = ("run_id", "git_sha", "point_index", "point_key", "recipe_hash", "model", "tp",
                    "h_qk", "h_v", "head_dim", "seqlens", "layout", "total_tokens", "num_seqs",
                    "direction", "backend", "backend_version", "backend_params", "gpu_name",
                    "started_at", "status", "reason", "latency_ms", "samples_ms", "timing_mode")


def _tables(p: Path) -> list[tuple[Path, pa.Table]]:
    """(file, table) of every stored row file of a results directory, or of one Parquet file."""
    if p.is_file():
        files = [p]
    else:
        files = _part_files(p / PARTS_DIR if (p / PARTS_DIR).is_dir() else p)
    out = []
    for f in files:
        try:
            out.append((f, pq.read_table(f)))
        except (OSError, pa.ArrowException) as e:
            why = str(e).splitlines()[0] if str(e) else type(e).__name__
            why = re.sub(r"^Could not open Parquet input source '.*?': ", "", why)
            raise RowsError(f"{f}: not a readable Parquet file ({why[:120]})") from None
    return out


def _frame(tables: list[tuple[Path, pa.Table]]) -> pd.DataFrame:
    """The rows of :func:`_tables` as one frame (columns a part lacks are null in its rows);
    :class:`RowsError` naming a part whose column type differs from an earlier part's."""
    if not tables:
        return pd.DataFrame(columns=COLUMNS)
    try:
        return pa.concat_tables([t for _, t in tables], promote_options="default").to_pandas()
    except (pa.ArrowTypeError, pa.ArrowInvalid):
        seen: dict[str, tuple[Path, pa.DataType]] = {}
        for f, t in tables:
            for field in t.schema:
                if pa.types.is_null(field.type):
                    continue
                first = seen.setdefault(field.name, (f, field.type))
                if first[1] != field.type:
                    raise RowsError(f"{f}: column {field.name} is {field.type}, in {first[0]} "
                                    f"{first[1]}; its rows cannot be read with the others") from None
        raise


def read_rows(path: str | Path) -> pd.DataFrame:
    """The rows of a results directory or Parquet file (:func:`load`) for a command that reads
    them (a view, ``merge``, ``compact``, ``run --resume``). :class:`RowsError`, one line: the
    path missing, a part not readable Parquet or of clashing column types (naming the file), or
    rows that lack :data:`REQUIRED_COLUMNS` (a part written before one of them existed)."""
    p = Path(path)
    if not p.exists():
        raise RowsError(f"{p}: no such file or directory")
    tables = _tables(p)
    short = [(f, [c for c in REQUIRED_COLUMNS if c not in t.column_names]) for f, t in tables]
    short = [(f, cols) for f, cols in short if cols]
    if short:
        lack = [c for c in REQUIRED_COLUMNS if any(c in cols for _, cols in short)]
        shown = ", ".join(lack[:8]) + (f" and {len(lack) - 8} more" if len(lack) > 8 else "")
        where = "" if len(short) == len(tables) else \
            f"{len(short)} of {len(tables)} files, e.g. {short[0][0].name}; "
        raise RowsError(f"{p}: rows lack columns {shown} ({where}written by an older qlabench? "
                        "re-run the sweep into a new directory, or add the columns to its rows)")
    return _frame(tables)


def backend_names(df: pd.DataFrame) -> pd.Series:
    """The registry name (library) of each row: ``backend_name``, else its ``backend``."""
    if "backend_name" not in df.columns:
        return df["backend"].copy()
    return df["backend_name"].where(df["backend_name"].notna() & (df["backend_name"] != ""),
                                    df["backend"])


def meta_files(path: str | Path) -> list[Path]:
    """The run metadata files of a results directory (``_runs/*.json``)."""
    return sorted((Path(path) / RUNS_DIR).glob("*.json"))


def load_meta(path: str | Path) -> dict[str, dict]:
    """run_id -> run metadata of a results directory."""
    out = {}
    for f in meta_files(path):
        try:
            out[f.stem] = json.loads(f.read_text())
        except Exception:
            continue
    return out


KEY = ["point_key", "backend", "direction"]


def latest(df: pd.DataFrame) -> pd.DataFrame:
    """One row per (point, backend label, direction): the most recent row, preferring any finished row
    over a retry-status one (an ``unavailable`` row from a host missing a library must not hide a
    kept ``ok`` row)."""
    if df.empty:
        return df
    d = df.assign(_retry=df["status"].isin(RETRY_STATUSES)).sort_values(
        ["_retry", "started_at", "run_id"], ascending=[False, True, True])
    return d.drop_duplicates(KEY, keep="last").drop(columns="_retry").sort_values(
        ["point_index", "backend", "direction"])


class MergeError(Exception):
    pass


#: identity of a stored row (the same measurement stored twice has the same identity)
ROW_IDENTITY = ["run_id", "point_index", "backend", "direction", "started_at"]


def _write_rows_file(parts_dir: Path, prefix: str, df: pd.DataFrame) -> str:
    """Write rows as one Parquet file in ``parts_dir`` (temp file, fsync, atomic rename);
    :class:`RowsError` when a column's values do not fit its type in :data:`SCHEMA`."""
    try:
        table = pa.Table.from_pandas(df.reindex(columns=COLUMNS), schema=SCHEMA,
                                     preserve_index=False)
    except (pa.ArrowTypeError, pa.ArrowInvalid, ValueError) as e:
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise RowsError(f"{parts_dir}: rows do not fit the row schema ({why[:120]})") from None
    name = f"{prefix}-{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{uuid.uuid4().hex[:6]}.parquet"
    tmp = parts_dir / f".{name}.tmp"
    with open(tmp, "wb") as fh:
        pq.write_table(table, fh, compression="zstd")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, parts_dir / name)
    return name


def merge(out_dir: str | Path, inputs: list[str | Path], force: bool = False,
          mix_sweeps: bool = False) -> dict:
    """Merge shard/run directories into ``out_dir``: every run's metadata, and for each row key
    (point, backend, direction) the newest row, written as one Parquet file (rows already in
    ``out_dir`` are not written again; works on compacted inputs). Refuses inputs whose rows for
    one point were made from different input recipes, an ``out_dir`` that already holds rows
    unless ``force`` (a slip must not add rows to a kept run), and rows (of the inputs and
    ``out_dir``) of more than one sweep (:func:`owners`) or timing method
    (:func:`method_counts`) unless ``mix_sweeps``. Returns counts."""
    import shutil
    have = read_rows(out_dir) if Path(out_dir).exists() else pd.DataFrame()
    if len(have) and not force:
        raise MergeError(f"{out_dir} already holds {len(have)} rows; merge into a new or empty "
                         "directory, or pass --force to add the inputs' rows to it")
    frames, sweeps = [], {}
    for d in inputs:
        d = Path(d)
        if not (d / "parts").is_dir():
            raise MergeError(f"{d}: not a results directory (no parts/)")
        df = read_rows(d)
        if not df.empty:
            frames.append(df)
    if not frames:
        raise MergeError("no rows in any input")
    for d in [*inputs, *([out_dir] if len(have) else [])]:
        for name in owners(d)["sweep"].dropna().unique():
            sweeps.setdefault(str(name), []).append(str(d))
    allrows = pd.concat(frames, ignore_index=True).drop_duplicates(subset=ROW_IDENTITY)
    methods = method_counts(pd.concat([allrows, have], ignore_index=True))
    if not mix_sweeps and (len(sweeps) > 1 or len(methods) > 1):
        what = "; ".join(
            ([f"rows of {len(sweeps)} sweeps: " + ", ".join(
                f"'{n}' ({', '.join(ds)})" for n, ds in sorted(sweeps.items()))]
             if len(sweeps) > 1 else [])
            + ([f"rows timed {len(methods)} ways: " + ", ".join(
                f"{m} ({n} rows)" for m, n in methods.items())] if len(methods) > 1 else []))
        raise MergeError(f"{what}; one directory holds one sweep timed one way: merge them "
                         "into separate directories, or pass --mix-sweeps to merge them anyway")
    rec = allrows.groupby(["point_key", "direction"])["recipe_hash"].nunique()
    bad = rec[rec > 1]
    if len(bad):
        k = bad.index[0]
        raise MergeError(f"point {k[0]} ({k[1]}) has rows from {int(bad.iloc[0])} different input "
                         "recipes; merge only runs of one recipe")
    keep = latest(allrows)
    store = ResultStore(out_dir)
    store.ensure()
    if not have.empty:
        ids = set(map(tuple, have[ROW_IDENTITY].astype(str).values.tolist()))
        new = keep[[tuple(r) not in ids for r in keep[ROW_IDENTITY].astype(str).values.tolist()]]
    else:
        new = keep
    if len(new):
        _write_rows_file(store.parts, "merge", new)
    for d in inputs:
        for f in meta_files(d):
            if not (store.runs / f.name).exists():
                shutil.copy2(f, store.runs / f.name)
    return {"rows": len(keep), "copied": len(new), "dropped_older": len(allrows) - len(keep)}


def _type_name(t: pa.DataType) -> str:
    if pa.types.is_list(t):
        return f"list<{_type_name(t.value_type)}>"
    return {"double": "float64", "int64": "int64", "string": "string", "bool": "bool"}.get(str(t),
                                                                                         str(t))


def schema_markdown() -> str:
    """``docs/schema.md``: every column of :data:`SCHEMA` with its type, unit and meaning."""
    lines = [
        "# Row schema",
        "",
        "<!-- generated by `python -m qlabench.results --schema-md docs/schema.md` from",
        "     qlabench/results.py (SCHEMA, FIELDS); tests/test_schema.py fails when they differ -->",
        "",
        "One row per point × backend label × direction, one Parquet part per row under",
        "`OUT/parts/`. Everything else in a results directory lives under names starting with `_`",
        "(`_runs/<run_id>.json` run metadata, `_logs/`, `_figures/`, `_shards/`, `_notes/`), which",
        "pyarrow's dataset discovery skips, so `pandas.read_parquet(OUT)` reads the rows as stored.",
        "`qlabench.results.load(OUT)` reads them as stored: nothing is derived on load, and a",
        "column a part lacks (a part written before the column existed) is null in its rows.",
        "`qlabench.results.load(OUT, latest=True)` gives one row per key (`point_key`, `backend`,",
        "`direction`): the newest, a finished row preferred over an `unavailable` one.",
        "The views, `merge`, `compact` and `run --resume` refuse rows that lack one of the",
        "columns they read (`qlabench.results.REQUIRED_COLUMNS`: " + ", ".join(
            f"`{c}`" for c in REQUIRED_COLUMNS) + "):",
        "one error line naming the directory and the columns, exit 2.",
        "",
        "Null means not measured or not applicable (a non-`ok` row has no timing).",
        "",
        "| column | type | unit | meaning |",
        "|---|---|---|---|",
    ]
    for f in SCHEMA:
        unit, meaning = FIELDS[f.name]
        lines.append(f"| `{f.name}` | {_type_name(f.type)} | {unit} | "
                     f"{meaning.replace('|', chr(92) + '|')} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    import argparse
    ap = argparse.ArgumentParser(prog="python -m qlabench.results",
                                 description="Row schema of qlabench results.")
    ap.add_argument("--schema-md", metavar="PATH", help="write the schema as Markdown ('-': stdout)")
    a = ap.parse_args(argv)
    if not a.schema_md:
        ap.print_help()
        return 2
    text = schema_markdown()
    if a.schema_md == "-":
        print(text, end="")
    else:
        Path(a.schema_md).write_text(text)
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
