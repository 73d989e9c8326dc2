"""Row schema and durable storage: one Parquet part per finished row, written atomically.

Layout of an output directory::

    OUT/parts/<run_id>-<n>-<backend>-<direction>.parquet   one row each (the truth)
    OUT/runs/<run_id>.json                                  run metadata + environment
    OUT/*.png                                               derived figures

``pandas.read_parquet(OUT/parts)`` (or :func:`load`) reads every row of every run in it.
Resume key: (point key, backend, direction, backend version), ``backend`` being the entry's
label (``flashinfer@0.7.4``; a plain entry's label is its name, so such keys are the ones stored
before labels existed); a key whose stored rows were made from a different input recipe is
refused instead of mixed. ``backend_name`` is the registry name (``flashinfer``); rows stored
before it existed load with ``backend_name = backend``.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import subprocess
import time
import uuid
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

STATUSES = ("ok", "unavailable", "unsupported", "incorrect", "oom", "crashed", "timeout",
            "skipped")
#: statuses a resume re-tries (the library or device may be there now)
RETRY_STATUSES = ("unavailable",)
#: statuses ``--retry-failed`` runs again (a fixed kernel, a longer timeout, a bigger GPU)
FAILED_STATUSES = ("crashed", "timeout", "oom")
OUTPUTS = ("o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dh0")

_f, _i, _s, _b = pa.float64(), pa.int64(), pa.string(), pa.bool_()
SCHEMA = pa.schema(
    [
        # identity
        ("run_id", _s), ("git_sha", _s), ("config", _s), ("point_index", _i), ("point_key", _s),
        ("recipe_hash", _s), ("model", _s), ("tp", _s), ("h_qk", _i), ("h_v", _i),
        ("head_dim", _i), ("seqlens", pa.list_(_i)), ("layout", _s), ("total_tokens", _i),
        ("num_seqs", _i), ("dtype", _s), ("gate_recipe", _s), ("gate_zero_frac", _f),
        ("initial_state", _b), ("output_final_state", _b),
        ("direction", _s), ("backend", _s), ("backend_version", _s),
        # ``backend`` is the entry's label (the identity); ``backend_name`` the registry name
        ("backend_name", _s),
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
        # worst sequence x head (final_state, dh0) or 1024-token block x head (the others)
        *[(f"local_rel_l2_{o}", _f) for o in OUTPUTS],
        ("max_rel_l2", _f), ("worst_block_rel_l2", _f),
        # the timed path's own outputs (one graph replay, outputs poisoned first) vs the reference
        ("graph_max_rel_l2", _f),
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


def new_run_id() -> str:
    return time.strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:6]


def git_sha(cwd: str | None = None) -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=cwd or os.getcwd(),
                             capture_output=True, text=True, timeout=5)
        sha = out.stdout.strip() or "unknown"
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
    for dist in ("triton", "tilelang", "flash-linear-attention", "fla-core", "flash-qla",
                 "flashinfer-python", "nvidia-ml-py", "pydantic", "pandas", "pyarrow"):
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


class MethodMismatch(Exception):
    """--resume into a directory whose rows were timed with another method."""


class ResultStore:
    def __init__(self, out_dir: str | Path):
        self.out = Path(out_dir)
        self.parts = self.out / "parts"
        self.runs = self.out / "runs"

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
        """(point_key, backend, direction, backend_version) -> recipe_hash of finished rows.
        With ``retry_failed`` also crashed/timeout/oom rows are run again."""
        df = self.load()
        if df.empty:
            return {}
        retry = RETRY_STATUSES + (FAILED_STATUSES if retry_failed else ())
        df = df[~df["status"].isin(retry)]
        return {(r.point_key, r.backend, r.direction, r.backend_version): r.recipe_hash
                for r in df.itertuples()}

    def check_method(self, mode: str, l2: str) -> None:
        """Refuse to resume into a directory whose GPU rows were timed another way."""
        df = self.load()
        if df.empty or "timing_mode" not in df:
            return
        ok = df[(df["status"] == "ok") & ~df["timing_mode"].isin(["events", "cpu"])
                & df["timing_mode"].notna()]
        if mode in ("events", "cpu") or ok.empty:
            return
        other = ok[(ok["timing_mode"] != mode) | (ok["l2"] != l2)]
        if len(other):
            r = other.iloc[0]
            raise MethodMismatch(
                f"{self.out}: {len(other)} rows were timed with timing_mode={r['timing_mode']}, "
                f"l2={r['l2']}; this config asks for {mode}, l2={l2}. Rows timed differently are "
                "never mixed: use a new --out directory instead of --resume")

    def recipes(self) -> dict[tuple, str]:
        """(point_key, direction) -> recipe_hash over all stored rows."""
        df = self.load()
        if df.empty:
            return {}
        return {(r.point_key, r.direction): r.recipe_hash for r in df.itertuples()}


def compact(path: str | Path) -> dict:
    """Fold a results directory's one-row part files into one Parquet file (``compact-<ts>.parquet``,
    every row kept, history included) — a kept run of ~600 rows goes from ~14 MB of small files
    to ~0.2 MB. Safe to interrupt: the new file is written and renamed into place before any old
    part is removed; a row present twice (old part + compact file of an interrupted compact) is
    the same row, which ``latest`` and ``done_keys`` treat as one and the next compact stores once."""
    parts_dir = Path(path) / "parts"
    files = sorted(f for f in parts_dir.glob("*.parquet") if not f.name.startswith("."))
    if len(files) < 2:
        return {"files": len(files), "rows": 0}
    tables = [pq.read_table(f) for f in files]
    df = pa.concat_tables(tables, promote_options="default").to_pandas()
    df = df.drop_duplicates(subset=ROW_IDENTITY)  # a row stored twice (interrupted compact) once
    name = _write_rows_file(parts_dir, "compact", df)
    for f in files:
        f.unlink()
    return {"files": len(files), "rows": len(df), "file": name}


def load(path: str | Path) -> pd.DataFrame:
    """All rows under a results directory (or a single Parquet file)."""
    p = Path(path)
    if p.is_file():
        return _upgrade(pq.read_table(p).to_pandas())
    parts_dir = p / "parts" if (p / "parts").is_dir() else p
    files = sorted(f for f in parts_dir.glob("*.parquet") if not f.name.startswith("."))
    if not files:
        return pd.DataFrame(columns=COLUMNS)
    tables = [pq.read_table(f) for f in files]
    return _upgrade(pa.concat_tables(tables, promote_options="default").to_pandas())


def _upgrade(df: pd.DataFrame) -> pd.DataFrame:
    """Stored rows in today's schema: rows from before labels carry ``backend_name = backend``."""
    if "backend" in df.columns:
        df["backend_name"] = backend_names(df)
    return df


def backend_names(df: pd.DataFrame) -> pd.Series:
    """The registry name (library) of each row: ``backend_name``, else its ``backend``."""
    if "backend_name" not in df.columns:
        return df["backend"].copy()
    return df["backend_name"].where(df["backend_name"].notna() & (df["backend_name"] != ""),
                                    df["backend"])


def load_meta(path: str | Path) -> dict[str, dict]:
    p = Path(path) / "runs"
    out = {}
    for f in sorted(p.glob("*.json")):
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


#: columns that say whether two rows can be compared as measured side by side
PAIR_COLUMNS = ("gpu_uuid", "campaign_id", "throttled")


def _known(v) -> bool:
    return v is not None and not (isinstance(v, float) and v != v) and v is not pd.NA and v != ""


def pairing(a: pd.DataFrame, b: pd.DataFrame) -> pd.DataFrame:
    """How the rows of every ratio were measured: ``a.iloc[i]`` is paired with ``b.iloc[i]``.

    Columns (index of ``a``): ``gpu_known`` / ``campaign_known`` (both rows carry ``gpu_uuid`` /
    ``campaign_id``), ``same_gpu`` / ``same_campaign`` (known on both sides and equal; a value
    missing on either side, as on rows written before these columns existed, counts as not
    shared), ``throttled`` (either row's ``throttled`` is true) and ``pairing``, the per-pair tag
    of :func:`pair_tag` ("" for a clean pair). Frames lacking a column count it as unknown."""
    if len(a) != len(b):
        raise ValueError(f"pairing: {len(a)} rows vs {len(b)} rows")

    def col(df, c):
        return list(df[c]) if c in df.columns else [None] * len(df)

    out = {}
    for c, name in (("gpu_uuid", "gpu"), ("campaign_id", "campaign")):
        x, y = col(a, c), col(b, c)
        known = [_known(u) and _known(v) for u, v in zip(x, y)]
        out[f"{name}_known"] = known
        out[f"same_{name}"] = [k and u == v for k, u, v in zip(known, x, y)]
    out["throttled"] = [(_known(u) and bool(u)) or (_known(v) and bool(v))
                        for u, v in zip(col(a, "throttled"), col(b, "throttled"))]
    p = pd.DataFrame(out, index=a.index)
    p["pairing"] = [pair_tag(g, c, t) for g, c, t in
                    zip(p["same_gpu"], p["same_campaign"], p["throttled"])]
    return p


def pair(a: dict, b: dict) -> dict:
    """:func:`pairing` of one pair of rows given as dicts (the schema's columns)."""
    return pairing(pd.DataFrame([a]), pd.DataFrame([b])).iloc[0].to_dict()


def pair_tag(same_gpu: bool, same_campaign: bool, throttled: bool) -> str:
    """Per-pair tag: "" when both rows share GPU and campaign and neither is throttled, else the
    words that apply of ``cross-GPU``, ``cross-campaign``, ``throttled`` (comma-separated)."""
    words = [w for w, bad in (("cross-GPU", not same_gpu), ("cross-campaign", not same_campaign),
                              ("throttled", throttled)) if bad]
    return ", ".join(words)


def pairing_label(p: pd.DataFrame) -> str:
    """Headline label of a statistic over the pairs of ``p`` (a :func:`pairing` frame), e.g.
    ``cross-campaign: 120 of 171 pairs (120 unknown); throttled: 43`` or
    ``same GPU and campaign: 171 pairs``. "unknown": rows without ``gpu_uuid``/``campaign_id``."""
    n = len(p)
    if not n:
        return "no pairs"
    parts = []
    for name, word in (("gpu", "cross-GPU"), ("campaign", "cross-campaign")):
        k = int((~p[f"same_{name}"].astype(bool)).sum())
        if k:
            unknown = int((~p[f"{name}_known"].astype(bool)).sum())
            parts.append(f"{word}: {k} of {n} pair{'s' * (n != 1)}" + (f" ({unknown} unknown)" if unknown else ""))
    t = int(p["throttled"].astype(bool).sum())
    if t:
        parts.append(f"throttled: {t}")
    return "; ".join(parts) if parts else f"same GPU and campaign: {n} pair{'s' * (n != 1)}"


class MergeError(Exception):
    pass


#: identity of a stored row (the same measurement stored twice has the same identity)
ROW_IDENTITY = ["run_id", "point_index", "backend", "direction", "started_at"]


def _write_rows_file(parts_dir: Path, prefix: str, df: pd.DataFrame) -> str:
    """Write rows as one Parquet file in ``parts_dir`` (temp file, fsync, atomic rename)."""
    table = pa.Table.from_pandas(df.reindex(columns=COLUMNS), schema=SCHEMA, preserve_index=False)
    name = f"{prefix}-{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{uuid.uuid4().hex[:6]}.parquet"
    tmp = parts_dir / f".{name}.tmp"
    with open(tmp, "wb") as fh:
        pq.write_table(table, fh, compression="zstd")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, parts_dir / name)
    return name


def merge(out_dir: str | Path, inputs: list[str | Path]) -> dict:
    """Merge shard/run directories into ``out_dir``: every run's metadata, and for each row key
    (point, backend, direction) the newest row, written as one Parquet file (rows already in
    ``out_dir`` are not written again; works on compacted inputs). Refuses inputs whose rows for
    one point were made from different input recipes. Returns counts."""
    import shutil
    frames = []
    for d in inputs:
        d = Path(d)
        if not (d / "parts").is_dir():
            raise MergeError(f"{d}: not a results directory (no parts/)")
        df = load(d)
        if not df.empty:
            frames.append(df)
    if not frames:
        raise MergeError("no rows in any input")
    allrows = pd.concat(frames, ignore_index=True).drop_duplicates(subset=ROW_IDENTITY)
    rec = allrows.groupby(["point_key", "direction"])["recipe_hash"].nunique()
    bad = rec[rec > 1]
    if len(bad):
        k = bad.index[0]
        raise MergeError(f"point {k[0]} ({k[1]}) has rows from {int(bad.iloc[0])} different input "
                         "recipes; merge only runs of one recipe")
    keep = latest(allrows)
    store = ResultStore(out_dir)
    store.ensure()
    have = load(out_dir)
    if not have.empty:
        ids = set(map(tuple, have[ROW_IDENTITY].astype(str).values.tolist()))
        new = keep[[tuple(r) not in ids for r in keep[ROW_IDENTITY].astype(str).values.tolist()]]
    else:
        new = keep
    if len(new):
        _write_rows_file(store.parts, "merge", new)
    for d in inputs:
        for f in (Path(d) / "runs").glob("*.json"):
            if not (store.runs / f.name).exists():
                shutil.copy2(f, store.runs / f.name)
    return {"rows": len(keep), "copied": len(new), "dropped_older": len(allrows) - len(keep)}
