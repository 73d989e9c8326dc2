"""``qlabench reproduce NAME --from RESULTS``: a published table vs measured rows, point by point.

Published tables live in the repository as data, one folder per set::

    configs/published/NAME/fwd.csv          model,seqlens_label,seqlens,h_qk,h_v,<backend>_ms...
    configs/published/NAME/bwd.csv          (seqlens: space-separated ints; '#' lines: provenance)
    configs/published/NAME/provenance.yaml  versions, timing method, input recipe, sweeps, caveats

Measured rows come from ``--from RESULTS``, a results directory written by ``qlabench run`` (of
the set's sweep, ``provenance.sweeps[direction]``; :func:`results.latest` of it). Rows join
published points on ``(h_qk, h_v, tuple(seqlens))``. Per point: published and measured ms per backend, measured /
published, published vs measured speedup (baseline / target, FLA / FlashQLA), and the in-repo
``tilelang`` kernel as an extra measured column (its speedup over FLA and over the best measured
library). A published library measured under further labels (``flashinfer@0.7.4`` beside
``flashinfer``: rows whose ``backend_name`` is that library) gets a column per label, each
against the library's published number; the best measured library is the best of all of them. A row whose status is not ``ok`` shows its status instead of a number; a point with no
row shows ``missing``. Every measured ratio between two rows (the speedup, tilelang vs FLA and vs
the best library) carries its pair's tag (``<ratio>_pairing``, :func:`qlabench.analysis.pairing`: do the
rows share GPU and campaign, is one throttled), and the summary's geomeans their
:func:`qlabench.analysis.pairing_label`. Library versions of the measuring runs (``runs/*.json``) are
compared with the published ones and the differences are printed next to the backends they may
explain.

Writes ``OUT/reproduce_<NAME>_<direction>.{csv,md,png}`` (the figure:
:func:`qlabench.plots.reproduce_figure`). Reads only stored rows, their run metadata and the
published folder: it measures nothing and imports neither the runner nor a backend.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import yaml
from rich.console import Console

from . import analysis, plots, render, results
from .render import Column
from .sweep import layout_label

REPO_ROOT = Path(__file__).resolve().parent.parent
#: where published sets are looked up (tests point this elsewhere)
PUBLISHED_ROOT = REPO_ROOT / "configs" / "published"
EXTRA_BACKEND = "tilelang"
WITHIN = 0.10          # "agrees" = measured within ±10% of published
N_EXTREMES = 5         # worst / best points printed
MISSING = "missing"
DIRECTIONS = ("fwd", "bwd")


class ReproduceError(Exception):
    """A problem the user can fix (unknown set, no rows, ...); the message says what to do."""


# --------------------------------------------------------------------------- published tables


@dataclass
class Published:
    name: str
    direction: str
    folder: Path
    table: pd.DataFrame          # one row per point; column `key` = (h_qk, h_v, seqlens tuple)
    provenance: dict

    @property
    def backends(self) -> list[str]:
        return list(self.provenance["backends"][self.direction])

    @property
    def baseline(self) -> str:
        return self.provenance.get("speedup", {}).get("baseline", "fla")

    @property
    def target(self) -> str:
        return self.provenance.get("speedup", {}).get("target", "flashqla")

    def sweep_path(self) -> Path:
        rel = Path(self.provenance["sweeps"][self.direction])
        if rel.is_absolute():
            return rel
        for base in (REPO_ROOT, self.folder, Path.cwd()):
            if (base / rel).exists():
                return base / rel
        return REPO_ROOT / rel


def available_names(root: Path | None = None) -> list[str]:
    root = Path(root or PUBLISHED_ROOT)
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if (p / "provenance.yaml").is_file())


def parse_seqlens(s) -> tuple[int, ...]:
    """'28672 4096' (published csv) or [28672, 4096] (a row) -> (28672, 4096)."""
    if isinstance(s, str):
        return tuple(int(x) for x in s.split())
    return tuple(int(x) for x in s)


def key_of(h_qk, h_v, seqlens) -> tuple:
    return (int(h_qk), int(h_v), parse_seqlens(seqlens))


def load_published(name: str, direction: str, root: Path | None = None) -> Published:
    root = Path(root or PUBLISHED_ROOT)
    names = available_names(root)
    if name not in names:
        raise ReproduceError(
            f"unknown published set {name!r}: no {root / name / 'provenance.yaml'}; "
            f"known: {', '.join(names) or '(none)'}")
    folder = root / name
    prov = yaml.safe_load((folder / "provenance.yaml").read_text()) or {}
    tables = prov.get("tables", {})
    if direction not in tables:
        raise ReproduceError(
            f"{folder / 'provenance.yaml'}: no {direction!r} table (has: {', '.join(tables) or 'none'}); "
            f"use --direction {'|'.join(tables)}")
    for k in ("backends", "sweeps", "versions"):
        if k not in prov:
            raise ReproduceError(f"{folder / 'provenance.yaml'}: missing field {k!r}")
    path = folder / tables[direction]
    df = pd.read_csv(path, comment="#", dtype={"seqlens": str})
    need = {"seqlens", "h_qk", "h_v", *(f"{b}_ms" for b in prov["backends"][direction])}
    if need - set(df.columns):
        raise ReproduceError(f"{path}: missing columns {sorted(need - set(df.columns))}")
    if "model" not in df.columns:
        df["model"] = [f"{a}/{b}" for a, b in zip(df["h_qk"], df["h_v"])]
    if "seqlens_label" not in df.columns:
        df["seqlens_label"] = df["seqlens"]
    df["key"] = [key_of(a, b, s) for a, b, s in zip(df["h_qk"], df["h_v"], df["seqlens"])]
    dup = df[df["key"].duplicated()]
    if not dup.empty:
        raise ReproduceError(f"{path}: duplicated points {list(dup['seqlens_label'])}")
    return Published(name, direction, folder, df.reset_index(drop=True), prov)


def geomean(x) -> float | None:
    a = np.asarray([v for v in x if v is not None and np.isfinite(v) and v > 0], dtype=float)
    return float(np.exp(np.log(a).mean())) if a.size else None


def published_speedups(pub: Published) -> pd.Series:
    t = pub.table
    return t[f"{pub.baseline}_ms"] / t[f"{pub.target}_ms"]


# --------------------------------------------------------------------------- measured rows


def measured_rows(from_: Path, direction: str, notes: list[str] | None = None) -> pd.DataFrame:
    """Latest row per point × backend of ``direction`` under ``from_``
    (:func:`qlabench.analysis.read_rows`: the rows it sets aside noted in ``notes``); errors say
    what to do."""
    from_ = Path(from_)
    try:
        df = analysis.read_rows(from_, notes)
    except analysis.BadInput as e:
        raise ReproduceError(f"--from {e}") from None
    if df.empty:
        raise ReproduceError(
            f"--from {from_}: no result rows (expected {from_}/parts/*.parquet from `qlabench run`)")
    df = results.latest(df)
    sub = df[df["direction"] == direction]
    if sub.empty:
        have = ", ".join(sorted(set(df["direction"].dropna())))
        raise ReproduceError(
            f"--from {from_}: no {direction} rows (it holds {have or 'no direction'} rows); "
            f"run the {direction} sweep first or pass --direction {have.split(', ')[0] or 'fwd'}")
    return sub


def _select_rows(rows: pd.DataFrame, pub: Published) -> pd.DataFrame:
    """Rows of the published shape (head_dim, dtype) and gate recipe (keys without a
    ``|gate=`` recipe suffix) keyed by join key; last one wins."""
    r = rows[~rows["point_key"].astype(str).str.contains("|gate=", regex=False)].copy() \
        if "point_key" in rows.columns else rows.copy()
    hd = pub.provenance.get("inputs", {}).get("head_dim")
    if hd is not None and "head_dim" in r.columns and r["head_dim"].notna().any():
        r = r[r["head_dim"].isna() | (r["head_dim"] == hd)]
    r["key"] = [key_of(a, b, s) for a, b, s in zip(r["h_qk"], r["h_v"], r["seqlens"])]
    sort = [c for c in ("started_at", "run_id") if c in r.columns]
    if sort:
        r = r.sort_values(sort, na_position="first")
    return r.drop_duplicates(["key", "backend"], keep="last")


# --------------------------------------------------------------------------- side by side


def side_by_side(pub: Published, rows: pd.DataFrame, extra_baseline: str = analysis.BASELINE) -> pd.DataFrame:
    """One row per published point.

    Columns: model, layout (:func:`qlabench.sweep.layout_label`, the label every view shows),
    seqlens_label (the published set's own label), seqlens, h_qk, h_v; per published backend ``b``:
    ``b_pub_ms``, ``b_ms`` (NaN unless ok), ``b_status`` (ok | a row status | missing),
    ``b_ratio`` (measured / published); ``speedup_pub``, ``speedup_ms`` (baseline / target),
    ``speedup_ratio`` (measured / published speedup); when tilelang rows exist: ``tilelang_ms``,
    ``tilelang_status``, ``tilelang_vs_<extra_baseline>`` (``tilelang_vs_fla`` by default),
    ``tilelang_vs_best``, ``best_library``. Every ratio is :func:`qlabench.analysis.speedup`; the
    published speedup keeps the set's own baseline (``pub.baseline``).
    """
    r = _select_rows(rows, pub) if not rows.empty else rows
    by = {}
    if not rows.empty:
        for rec in r.itertuples(index=False):
            by[(rec.key, rec.backend)] = rec
    has_extra = (not rows.empty) and (r["backend"] == EXTRA_BACKEND).any()
    lib_of = library_labels(pub, r)
    bes = list(lib_of) + ([EXTRA_BACKEND] if has_extra else [])
    out = []
    for p in pub.table.itertuples(index=False):
        d = {"model": p.model, "layout": layout_label(p.key[2]), "seqlens_label": p.seqlens_label,
             "seqlens": " ".join(map(str, p.key[2])), "h_qk": p.h_qk, "h_v": p.h_v}
        for b in bes:
            rec = by.get((p.key, b))
            if rec is None:
                status, ms, reason = MISSING, math.nan, ""
            else:
                status = rec.status if isinstance(rec.status, str) and rec.status else "unknown"
                lat = rec.latency_ms
                ms = float(lat) if status == "ok" and lat is not None and np.isfinite(lat) else math.nan
                if status == "ok" and not np.isfinite(ms):
                    status = "ok-no-latency"
                reason = rec.reason if isinstance(rec.reason, str) else ""
            if b in lib_of:
                d[f"{b}_pub_ms"] = float(getattr(p, f"{lib_of[b]}_ms"))
            d[f"{b}_ms"] = ms
            d[f"{b}_status"] = status
            d[f"{b}_reason"] = reason
            if b in lib_of:
                d[f"{b}_ratio"] = ms / d[f"{b}_pub_ms"] if np.isfinite(ms) else math.nan
        base, tgt = pub.baseline, pub.target
        d["speedup_pub"] = d[f"{base}_pub_ms"] / d[f"{tgt}_pub_ms"]
        d["speedup_ms"] = analysis.speedup(d[f"{base}_ms"], d[f"{tgt}_ms"])
        d["speedup_ratio"] = d["speedup_ms"] / d["speedup_pub"]
        d.update(_pair_cols("speedup", by, p.key, base, tgt, np.isfinite(d["speedup_ms"])))
        if has_extra:
            t = d[f"{EXTRA_BACKEND}_ms"]
            eb = extra_baseline
            d[f"{EXTRA_BACKEND}_vs_{eb}"] = analysis.speedup(
                d[f"{eb}_ms"] if f"{eb}_ms" in d else _ok_ms(by.get((p.key, eb))), t)
            libs = {b: d[f"{b}_ms"] for b in lib_of if np.isfinite(d[f"{b}_ms"])}
            best = min(libs, key=libs.get) if libs else ""
            d["best_library"] = best
            d[f"{EXTRA_BACKEND}_vs_best"] = analysis.speedup(libs[best], t) if best else math.nan
            for r, lib in ((f"vs_{eb}", eb), ("vs_best", best)):
                d.update(_pair_cols(f"{EXTRA_BACKEND}_{r}", by, p.key, lib, EXTRA_BACKEND,
                                    np.isfinite(d[f"{EXTRA_BACKEND}_{r}"])))
        out.append(d)
    table = pd.DataFrame(out)
    table.attrs["libraries"] = lib_of  # column -> published library
    table.attrs["extra_baseline"] = extra_baseline
    return table


def _ok_ms(rec) -> float:
    """A row's latency when it is ``ok`` (NaN otherwise or without a row)."""
    if rec is None or rec.status != "ok" or rec.latency_ms is None:
        return math.nan
    return float(rec.latency_ms)


def library_labels(pub: Published, rows: pd.DataFrame) -> dict[str, str]:
    """Measured column -> published library: each published backend, then the other labels of
    rows whose ``backend_name`` is that library (``flashinfer@0.7.4``), in label order."""
    out = {}
    lib = dict(zip(rows["backend"], results.backend_names(rows))) if len(rows) else {}
    for b in pub.backends:
        out[b] = b
        out.update({v: b for v in sorted(lab for lab, n in lib.items() if n == b and lab != b)})
    return out


def _library_columns(names) -> list[str]:
    """The measured library columns among a :func:`side_by_side` table's column names (those
    with a published ms)."""
    return [c[: -len("_pub_ms")] for c in names if c.endswith("_pub_ms")]


#: per measured ratio ``r`` the table carries ``r_pairing`` (:func:`qlabench.analysis.pair_tag`) and these
_PAIR_FLAGS = tuple(f for f in analysis.PAIR_FIELDS if f != "pairing")


def _pair_cols(ratio: str, by: dict, key, a: str, b: str, has: bool) -> dict:
    """The :func:`qlabench.analysis.pairing` of rows ``a`` and ``b`` of a point as ``ratio``-prefixed
    columns; "" / NaN when the ratio has no value."""
    if not has:
        return {f"{ratio}_pairing": "", **{f"{ratio}_{f}": math.nan for f in _PAIR_FLAGS}}
    pr = analysis.pair(by[(key, a)]._asdict(), by[(key, b)]._asdict())
    return {f"{ratio}_pairing": pr["pairing"], **{f"{ratio}_{f}": pr[f] for f in _PAIR_FLAGS}}


def pairing_of(table: pd.DataFrame, ratio: str, value: str | None = None) -> str:
    """:func:`qlabench.analysis.pairing_label` over the points where ratio ``ratio`` (its value in column
    ``value``, default ``ratio``) was measured."""
    t = table[np.isfinite(table[value or ratio].astype(float))]
    cols = {f"{ratio}_{f}": f for f in (*_PAIR_FLAGS, "pairing")}
    return analysis.pairing_label(t[list(cols)].rename(columns=cols).astype(
        {f: bool for f in _PAIR_FLAGS}))


def _stats(x: pd.Series) -> dict:
    v = x[np.isfinite(x)]
    return {"n": int(v.size), "geomean": geomean(v), "min": float(v.min()) if v.size else None,
            "max": float(v.max()) if v.size else None}


def summarize(pub: Published, table: pd.DataFrame) -> dict:
    """Shares within ±10%, geomean/min/max of ratios and speedups, status counts, missing points."""
    s: dict = {"points": len(table), "backends": {}}
    libs = table.attrs.get("libraries", {})
    for b in _library_columns(table.columns) + ([EXTRA_BACKEND] if f"{EXTRA_BACKEND}_status" in table else []):
        st = table[f"{b}_status"]
        counts = st.value_counts().to_dict()
        reasons = {k: next((r for r in table.loc[st == k, f"{b}_reason"] if r), "")
                   for k in counts if k != "ok"}
        e = {"statuses": counts, "reasons": reasons, "ok": int((st == "ok").sum()),
             "library": libs.get(b, b)}
        if f"{b}_ratio" in table:
            ratio = table[f"{b}_ratio"]
            fin = ratio[np.isfinite(ratio)]
            e["ratio"] = _stats(ratio)
            e["within"] = float((np.abs(fin - 1) <= WITHIN + 1e-12).mean()) if fin.size else None
        s["backends"][b] = e
    sp_pub, sp_ms = table["speedup_pub"], table["speedup_ms"]
    both = np.isfinite(sp_ms)
    s["speedup"] = {
        "published": _stats(sp_pub),
        "measured": {**_stats(sp_ms), "pairing": pairing_of(table, "speedup", "speedup_ms")},
        "published_same_points": _stats(sp_pub[both]),
        "within": float((np.abs(table.loc[both, "speedup_ratio"] - 1) <= WITHIN + 1e-12).mean())
        if both.any() else None,
    }
    eb = table.attrs.get("extra_baseline", analysis.BASELINE)
    if f"{EXTRA_BACKEND}_vs_{eb}" in table:
        s["extra"] = {r: {**_stats(table[f"{EXTRA_BACKEND}_{r}"]),
                          "pairing": pairing_of(table, f"{EXTRA_BACKEND}_{r}")}
                      for r in (f"vs_{eb}", "vs_best")}
    bes = _library_columns(table.columns)
    no_row = table[np.all([table[f"{b}_status"] == MISSING for b in bes], axis=0)]
    s["missing_points"] = [f"{m} {lab}" for m, lab in zip(no_row["model"], no_row["layout"])]
    return s


# --------------------------------------------------------------------------- versions & method


def _norm_version(v) -> str:
    v = str(v).strip().lower()
    v = re.sub(r"^v", "", v)
    return re.sub(r"-era$", "", v)


@dataclass
class VersionNote:
    lib: str
    published: str
    measured: list[str]
    explains: list[str]
    note: str = ""

    def line(self) -> str:
        m = ", ".join(self.measured) if self.measured else "unknown"
        return f"{self.lib} {m} vs published {self.published}" + (f": {self.note}" if self.note else "")


@dataclass
class Notes:
    versions: list[VersionNote] = field(default_factory=list)
    method: list[str] = field(default_factory=list)

    def for_backend(self, b: str) -> list[VersionNote]:
        return [n for n in self.versions if b in n.explains]


_BACKEND_LIB = {"fla": "fla", "flashinfer": "flashinfer", "flashqla": "flash-qla"}


def notes_for(pub: Published, rows: pd.DataFrame, meta: dict[str, dict]) -> Notes:
    """Differences between the measuring environment/method and the published ones."""
    prov = pub.provenance
    notes = Notes()
    run_ids = set(rows["run_id"].dropna()) if not rows.empty and "run_id" in rows else set()
    # run metadata as stored: a file that is not a JSON object, or without an ``env`` object,
    # tells nothing about versions
    envs = [m["env"] for rid, m in meta.items() if (not run_ids or rid in run_ids)
            and isinstance(m, dict) and isinstance(m.get("env"), dict)]
    dists = prov.get("dists", {})
    shown = set(pub.backends) | ({EXTRA_BACKEND} if not rows.empty and (rows["backend"] == EXTRA_BACKEND).any()
                                 else set())
    for lib, pv in prov["versions"].items():
        explains = list(prov.get("explains", {}).get(lib, []))
        if explains and not shown & set(explains):
            continue  # e.g. flashinfer on the backward table, which has no flashinfer column
        seen: set[str] = set()
        for env in envs:
            for dname in dists.get(lib, [lib]):
                if env.get(dname):
                    seen.add(str(env[dname]))
                    break
        if not seen and lib in _BACKEND_LIB.values() and not rows.empty:
            be = [b for b, lb in _BACKEND_LIB.items() if lb == lib]
            vs = rows.loc[results.backend_names(rows).isin(be), "backend_version"].dropna()
            seen = {str(v) for v in vs if v not in ("unavailable", "unknown", "n/a")}
        measured = sorted(seen)
        if measured and all(_norm_version(m) == _norm_version(pv) for m in measured):
            continue
        note = prov.get("version_notes", {}).get(lib, "").strip()
        if not measured:
            note = "version not recorded by the measuring run (library not installed there?)"
        notes.versions.append(VersionNote(lib, str(pv), measured, explains, note))
    if rows.empty:
        return notes
    ok = rows[rows["status"] == "ok"]
    want_mode = prov.get("timing", {}).get("qlabench_mode")
    if want_mode and not ok.empty and "timing_mode" in ok:
        off = ok[ok["timing_mode"] != want_mode]
        for (b, m), n in off.groupby(["backend", "timing_mode"]).size().items():
            notes.method.append(f"{b}: {n} rows timed with {m!r} (published method: {want_mode}; "
                                "per-call events include host overhead)")
    gz = prov.get("inputs", {}).get("gate_zero_frac")
    if gz is not None and "gate_zero_frac" in rows:
        other = sorted({float(x) for x in rows["gate_zero_frac"].dropna() if abs(float(x) - gz) > 1e-9})
        if other:
            notes.method.append(f"inputs: gate_zero_frac {other} (published {gz}: 25% of v-heads g = 0); "
                                "FlashQLA's speed depends on it")
    gpu = prov.get("gpu")
    if gpu and "gpu_name" in rows:
        names = sorted({str(x) for x in ok["gpu_name"].dropna()}) if not ok.empty else []
        short = gpu.replace("NVIDIA ", "")
        foreign = [n for n in names if short.lower() not in n.lower()]
        if foreign:
            notes.method.append(f"GPU: measured on {', '.join(foreign)} (published: {gpu})")
    return notes


# --------------------------------------------------------------------------- output


def _fmt(x, nd=3) -> str:
    return f"{x:.{nd}f}" if x is not None and np.isfinite(x) else "–"


def _fx(x) -> str:
    return f"{x:.2f}×" if x is not None and np.isfinite(x) else "–"


def _pct(x) -> str:
    return f"{100 * x:.0f}%" if x is not None else "–"


def _cell(t: pd.Series, b: str, with_pub: bool = True) -> str:
    st = t[f"{b}_status"]
    meas = _fmt(t[f"{b}_ms"]) if st == "ok" else st
    if with_pub and f"{b}_pub_ms" in t:
        r = t[f"{b}_ratio"]
        return f"{_fmt(t[f'{b}_pub_ms'])} → {meas}" + (f" ({r:.2f})" if np.isfinite(r) else "")
    return meas


def extremes(table: pd.DataFrame, n: int = N_EXTREMES) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(worst, best) points by measured / published speedup; by target ratio if no speedups."""
    for col in ("speedup_ratio",):
        v = table[np.isfinite(table[col])]
        if not v.empty:
            v = v.sort_values(col)
            return v.head(n), v.tail(n).iloc[::-1]
    return table.head(0), table.head(0)


def _summary_rows(pub: Published, s: dict, notes: Notes) -> list[list[str]]:
    out = []
    for b, e in s["backends"].items():
        other = ", ".join(f"{k} {v}" for k, v in e["statuses"].items() if k != "ok")
        vn = notes.for_backend(e.get("library", b))
        ver = "; ".join(f"{n.lib} {', '.join(n.measured) or '?'} ≠ {n.published}" for n in vn)
        if "ratio" in e:
            r = e["ratio"]
            out.append([b, f"{e['ok']}/{s['points']}", other or "–", _pct(e["within"]),
                        _fmt(r["geomean"], 2), _fmt(r["min"], 2), _fmt(r["max"], 2), ver or "same"])
        else:
            out.append([b + " (extra)", f"{e['ok']}/{s['points']}", other or "–", "–", "–", "–", "–",
                        ver or "–"])
    return out


SUMMARY_HEAD = ["backend", "ok points", "other statuses", f"within ±{WITHIN:.0%}",
                "measured/published geomean", "min", "max", "versions (measured ≠ published)"]


def _speedup_rows(pub: Published, s: dict, same_points: str | None = None) -> list[list[str]]:
    """The speedup table's rows: published, published on the measured points (``same_points``:
    that row's label, default "published B/T, measured points"), measured, and the in-repo
    kernel's."""
    sp = s["speedup"]
    lab = f"{pub.baseline}/{pub.target}"
    rows = [[f"published {lab}", str(sp["published"]["n"]), _fx(sp["published"]["geomean"]),
             _fx(sp["published"]["min"]), _fx(sp["published"]["max"]), "–"],
            [same_points or f"published {lab}, measured points", str(sp["published_same_points"]["n"]),
             _fx(sp["published_same_points"]["geomean"]), _fx(sp["published_same_points"]["min"]),
             _fx(sp["published_same_points"]["max"]), "–"],
            [f"measured {lab}", str(sp["measured"]["n"]), _fx(sp["measured"]["geomean"]),
             _fx(sp["measured"]["min"]), _fx(sp["measured"]["max"]), sp["measured"]["pairing"]]]
    if "extra" in s:
        eb = next(k for k in s["extra"] if k != "vs_best")[len("vs_"):]
        for k, lab2 in ((f"vs_{eb}", f"measured {eb}/{EXTRA_BACKEND}"),
                        ("vs_best", f"measured best library/{EXTRA_BACKEND}")):
            e = s["extra"][k]
            rows.append([lab2, str(e["n"]), _fx(e["geomean"]), _fx(e["min"]), _fx(e["max"]),
                         e["pairing"]])
    return rows


#: "pairs": whether the two measured rows of each ratio share GPU and campaign, throttled ones
SPEEDUP_HEAD = ["speedup", "points", "geomean", "min", "max", "pairs"]


def _point_head(pub: Published, table: pd.DataFrame) -> list[str]:
    h = ["model", "layout", "h_qk/h_v"] + [f"{b} pub → meas ms (ratio)"
                                           for b in _library_columns(table.columns)]
    h += ["speedup pub", "speedup meas", "pairing"]
    if f"{EXTRA_BACKEND}_status" in table:
        eb = table.attrs.get("extra_baseline", analysis.BASELINE)
        h += [f"{EXTRA_BACKEND} ms", f"{EXTRA_BACKEND} vs {eb}", f"{EXTRA_BACKEND} vs best",
              f"{EXTRA_BACKEND} pairing (vs {eb}; vs best)"]
    return h


def _point_row(pub: Published, t: pd.Series, extra_baseline: str = analysis.BASELINE) -> list[str]:
    r = [str(t["model"]), str(t["layout"]), f"{t['h_qk']}/{t['h_v']}"]
    r += [_cell(t, b) for b in _library_columns(t.index)]
    r += [_fx(t["speedup_pub"]), _fx(t["speedup_ms"]), _tag(t, "speedup", "speedup_ms")]
    if f"{EXTRA_BACKEND}_status" in t:
        vs = f"{EXTRA_BACKEND}_vs_{extra_baseline}"
        r += [_cell(t, EXTRA_BACKEND, with_pub=False), _fx(t[vs]),
              _fx(t[f"{EXTRA_BACKEND}_vs_best"]),
              f"{_tag(t, vs)}; {_tag(t, f'{EXTRA_BACKEND}_vs_best')}"]
    return r


def _tag(t: pd.Series, ratio: str, value: str | None = None) -> str:
    """A point's pair tag for display: "–" without a measured ratio."""
    if not np.isfinite(t[value or ratio]):
        return "–"
    return t[f"{ratio}_pairing"] or "same GPU and campaign"


def _md_table(head: list[str], rows: list[list[str]]) -> str:
    esc = lambda c: str(c).replace("|", "\\|")
    lines = ["| " + " | ".join(map(esc, head)) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(map(esc, r)) + " |" for r in rows]
    return "\n".join(lines)


def figure_title(pub: Published, table: pd.DataFrame) -> str:
    """The reproduction figure's title: the geomean speedups, then the measured pairs' tag."""
    both = table[np.isfinite(table["speedup_ms"])]
    gp, gm = geomean(table["speedup_pub"]), geomean(both["speedup_ms"])
    gs = geomean(both["speedup_pub"])
    head = (f"{pub.name} {pub.direction}: geomean published {_fx(gp)} ({len(table)} points; "
            f"{_fx(gs)} on the {len(both)} measured), measured {_fx(gm)}")
    return f"{head}\nmeasured pairs: {pairing_of(table, 'speedup', 'speedup_ms')}"


def markdown(pub: Published, table: pd.DataFrame, s: dict, notes: Notes, source: str,
             files: dict[str, Path]) -> str:
    prov = pub.provenance
    lines = [f"# Reproduction: {pub.name} ({pub.direction})", "",
             f"Published: {prov.get('source', pub.name)} on {prov.get('gpu', '?')}; "
             f"versions {', '.join(f'{k} {v}' for k, v in prov['versions'].items())}.",
             f"Timing: {prov.get('timing', {}).get('method', '?')}. "
             f"Inputs: {prov.get('inputs', {}).get('recipe', '?')}; "
             f"gate_zero_frac {prov.get('inputs', {}).get('gate_zero_frac', '?')}.",
             f"Measured: {source}.", "", "## Summary", "",
             _md_table(SUMMARY_HEAD, _summary_rows(pub, s, notes)), "",
             _md_table(SPEEDUP_HEAD, _speedup_rows(pub, s)), ""]
    if s["missing_points"]:
        lines += [f"Points with no measured row: {len(s['missing_points'])} "
                  f"({', '.join(s['missing_points'][:10])}{' …' if len(s['missing_points']) > 10 else ''})",
                  ""]
    reasons = [f"- {b} {k}: {r}" for b, e in s["backends"].items() for k, r in e["reasons"].items() if r]
    if reasons:
        lines += ["Not measured:", "", *reasons, ""]
    if notes.versions or notes.method:
        lines += ["## Version and method differences", ""]
        lines += [f"- **{n.lib}** {', '.join(n.measured) or 'unknown'} vs published {n.published} "
                  f"(may explain: {', '.join(n.explains) or '–'}): {n.note}" for n in notes.versions]
        lines += [f"- {m}" for m in notes.method]
        lines.append("")
    cav = prov.get("caveats", {}).get(pub.direction, [])
    if cav:
        lines += ["## Known caveats of the published run", "", *[f"- {c.strip()}" for c in cav], ""]
    worst, best = extremes(table)
    head = _point_head(pub, table)
    eb = table.attrs.get("extra_baseline", analysis.BASELINE)
    if not worst.empty:
        lines += ["## Worst points (measured speedup / published)", "",
                  _md_table(head, [_point_row(pub, t, eb) for _, t in worst.iterrows()]), "",
                  "## Best points", "", _md_table(head, [_point_row(pub, t, eb) for _, t in best.iterrows()]),
                  ""]
    lines += ["## All points", "", "<details><summary>" + f"{len(table)} points</summary>", "",
              _md_table(head, [_point_row(pub, t, eb) for _, t in table.iterrows()]), "", "</details>", ""]
    lines += [f"Files: {', '.join(f'[{k}]({p.name})' for k, p in files.items())}", ""]
    return "\n".join(lines)


# --------------------------------------------------------------------------- the command


@dataclass
class Reproduction:
    pub: Published
    table: pd.DataFrame
    summary: dict
    notes: Notes
    source: str
    files: dict[str, Path] = field(default_factory=dict)


def compare_rows(pub: Published, rows: pd.DataFrame, meta: dict, source: str,
                 extra_baseline: str = analysis.BASELINE) -> Reproduction:
    table = side_by_side(pub, rows, extra_baseline)
    return Reproduction(pub, table, summarize(pub, table), notes_for(pub, rows, meta), source)


def write(rep: Reproduction, out: Path) -> dict[str, Path]:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"reproduce_{rep.pub.name}_{rep.pub.direction}"
    files = {"csv": out / f"{stem}.csv", "markdown": out / f"{stem}.md", "figure": out / f"{stem}.png"}
    rep.table.to_csv(files["csv"], index=False, float_format="%.6g")
    plots.reproduce_figure(rep.table, files["figure"], rep.pub.baseline, rep.pub.target,
                           figure_title(rep.pub, rep.table), extra=EXTRA_BACKEND, within=WITHIN,
                           extra_baseline=rep.table.attrs.get("extra_baseline", analysis.BASELINE))
    files["markdown"].write_text(markdown(rep.pub, rep.table, rep.summary, rep.notes, rep.source, files))
    rep.files = files
    return files


# --------------------------------------------------------------------------- terminal


def _tty_summary_rows(s: dict) -> list[list[str]]:
    """The per-backend table for the terminal: :data:`TTY_SUMMARY` (versions: the notes below)."""
    out = []
    for b, e in s["backends"].items():
        other = ", ".join(f"{k} {v}" for k, v in e["statuses"].items() if k != "ok")
        if "ratio" in e:
            r = e["ratio"]
            out.append([b, f"{e['ok']}/{s['points']}", other, _pct(e["within"]),
                        _fmt(r["geomean"], 2), _fmt(r["min"], 2), _fmt(r["max"], 2)])
        else:
            out.append([f"{b} (extra)", f"{e['ok']}/{s['points']}", other, "–", "–", "–", "–"])
    return out


#: the terminal's per-backend table; ``drop``: the order columns are left out in a narrow one
TTY_SUMMARY = [Column("backend"), Column("ok", "right"), Column("other", omit_empty=True, drop=2),
               Column(f"±{WITHIN:.0%}", "right"), Column("geomean", "right"),
               Column("min", "right", drop=1), Column("max", "right", drop=1)]
#: the terminal's speedup table
TTY_SPEEDUP = [Column("speedup"), Column("points", "right"), Column("geomean", "right"),
               Column("min", "right", drop=1), Column("max", "right", drop=1),
               Column("pairs", wrap=True, min_width=14)]


def tty_point_columns(pub: Published, table: pd.DataFrame) -> list[Column]:
    """The terminal's worst / best point tables: heads, layout, the published and measured
    speedup and their ratio; per measured library its measured / published ms; the in-repo
    kernel's ms and speedups. ``drop`` (narrow terminal): the libraries outside the speedup, the
    in-repo kernel's ms, × best, × baseline, then the ratio of speedups (the tables are ranked by
    it)."""
    libs = _library_columns(table.columns)
    cols = [Column("heads"), Column("layout"), Column("pub", "right"), Column("meas", "right"),
            Column("meas/pub", "right", drop=5)]
    cols += [Column(b, "right", drop=None if b in (pub.baseline, pub.target) else 1) for b in libs]
    if f"{EXTRA_BACKEND}_status" in table:
        eb = table.attrs.get("extra_baseline", analysis.BASELINE)
        cols += [Column(f"{EXTRA_BACKEND} ms", "right", drop=2), Column(f"× {eb}", "right", drop=4),
                 Column("× best", "right", drop=3)]
    return cols


def _tty_ratio(t: pd.Series, b: str) -> str:
    st = t[f"{b}_status"]
    return _fmt(t[f"{b}_ratio"], 2) if st == "ok" else st


def tty_point_row(pub: Published, t: pd.Series, extra_baseline: str = analysis.BASELINE,
                  layout: str | None = None) -> list[str]:
    """A worst / best table row; ``layout``: the layout cell (default: the point's label)."""
    r = [f"{t['h_qk']}/{t['h_v']}", layout or str(t["layout"]), _fx(t["speedup_pub"]),
         _fx(t["speedup_ms"]), _fmt(t["speedup_ratio"], 2)]
    r += [_tty_ratio(t, b) for b in _library_columns(t.index)]
    if f"{EXTRA_BACKEND}_status" in t:
        r += [_cell(t, EXTRA_BACKEND, with_pub=False), _fx(t[f"{EXTRA_BACKEND}_vs_{extra_baseline}"]),
              _fx(t[f"{EXTRA_BACKEND}_vs_best"])]
    return r


def _layout_cells(points: pd.DataFrame) -> list[str]:
    """The layout cells of ``points`` (:func:`qlabench.render.layout_cells`: a long label read as
    count and mean length)."""
    lens = [[int(x) for x in str(s).split()] for s in points["seqlens"]]
    return render.layout_cells([(lab, len(x), sum(x)) for lab, x in zip(points["layout"], lens)])


def _pairing_notes(pub: Published, points: pd.DataFrame, eb: str,
                   cells: list[str] | None = None) -> list[str]:
    """One ``heads layout: ratio tag`` entry per measured ratio of ``points`` whose rows do not
    share GPU and campaign or are throttled (``cells``: the layouts as the table shows them)."""
    out = []
    cells = cells or [str(x) for x in points["layout"]]
    for cell, (_, t) in zip(cells, points.iterrows()):
        tags = [(f"{pub.baseline}/{pub.target}", t["speedup_pairing"], t["speedup_ms"])]
        if f"{EXTRA_BACKEND}_status" in t:
            for r, what in ((f"vs_{eb}", f"{eb}/{EXTRA_BACKEND}"),
                            ("vs_best", f"best/{EXTRA_BACKEND}")):
                tags.append((what, t[f"{EXTRA_BACKEND}_{r}_pairing"], t[f"{EXTRA_BACKEND}_{r}"]))
        bad = [f"{w} {tag}" for w, tag, v in tags if np.isfinite(v) and tag]
        if bad:
            out.append(f"{t['h_qk']}/{t['h_v']} {cell}: {', '.join(bad)}")
    return out


def print_report(rep: Reproduction, console: Console, width: int | None = None) -> None:
    """The reproduction on the terminal, its tables fitted to ``width`` columns (None: every
    column; :mod:`qlabench.render`)."""
    from rich.text import Text

    pub, s, notes = rep.pub, rep.summary, rep.notes
    prov = pub.provenance

    def note(word: str, style: str, text: str) -> None:
        t = Text("  ")
        t.append(word, style=style)
        t.append(f" {text}")
        render.line(console, t, width)

    render.line(console, Text.assemble((f"{pub.name} {pub.direction}", "bold"),
                                       f": {s['points']} published points ({prov.get('gpu', '?')}, "
                                       f"{prov.get('timing', {}).get('statistic', '')} of "
                                       f"{prov.get('timing', {}).get('qlabench_mode', '?')}) vs "
                                       f"{rep.source}"), width)
    render.table(console, TTY_SUMMARY, _tty_summary_rows(s), width, what="backend",
                 title=f"per backend: measured / published ms (points within ±{WITHIN:.0%}; "
                       "geomean, min, max over the points)")
    lab = f"{pub.baseline}/{pub.target}"
    rows = _speedup_rows(pub, s, same_points="  on the measured points")
    render.table(console, TTY_SPEEDUP, rows, width, title="speedups")
    for b, e in s["backends"].items():
        for k, r in e["reasons"].items():
            if k == MISSING:
                continue
            render.line(console, f"  {b}: {e['statuses'][k]} × {k}" + (f" — {r[:160]}" if r else ""),
                        width)
    if s["missing_points"]:
        mp = s["missing_points"]
        render.line(console, f"  missing: {len(mp)} points have no measured row "
                    f"({', '.join(mp[:6])}{' and more' if len(mp) > 6 else ''})", width)
    for n in notes.versions:
        note("version", "yellow", n.line() + (f"  (may explain: {', '.join(n.explains)})"
                                              if n.explains else ""))
    for m in notes.method:
        note("method", "yellow", m)
    for c in prov.get("caveats", {}).get(pub.direction, []):
        note("caveat", "dim", c.strip())
    worst, best = extremes(rep.table)
    cols = tty_point_columns(pub, rep.table)
    eb = rep.table.attrs.get("extra_baseline", analysis.BASELINE)
    legend = (f"pub, meas: {lab} speedup published and measured; meas/pub: their ratio; "
              + ", ".join(c.header for c in cols[5:] if c.header in rep.table.attrs.get("libraries", {}))
              + ": measured / published ms")
    if f"{EXTRA_BACKEND}_status" in rep.table:
        legend += (f"; {EXTRA_BACKEND} ms: the in-repo kernel's latency, × {eb}: {eb} ms / "
                   f"{EXTRA_BACKEND} ms, × best: the best library's ms / {EXTRA_BACKEND} ms")
    if not worst.empty:
        for title, pts in ((f"worst points (measured {lab} speedup / published)", worst),
                           ("best points", best)):
            cells = _layout_cells(pts)
            render.table(console, cols, [tty_point_row(pub, t, eb, c)
                                         for c, (_, t) in zip(cells, pts.iterrows())],
                         width, title=title, what="point")
            tags = _pairing_notes(pub, pts, eb, cells)
            if tags:
                render.line(console, "pairing (rows not sharing GPU and campaign, or throttled): "
                            + "; ".join(tags), width)
            for n in render.layout_notes(cells, list(pts["layout"])):
                render.line(console, f"layout {n}", width)
        render.line(console, legend, width, style="dim")
    if rep.files:
        render.line(console, "wrote " + ", ".join(str(p) for p in rep.files.values()), width)


def _shown(path: Path) -> str:
    """``path`` relative to the repository when it is inside it."""
    try:
        return str(path.relative_to(REPO_ROOT))
    except ValueError:
        return str(path)


def reproduce_cmd(name: str, direction: str, from_: Path | None, out: Path,
                  console: Console | None = None, baseline: str | None = None,
                  wide: bool = False, width: int | None = None) -> int:
    """Compare the published set ``name`` with the rows under ``from_`` (a results directory of
    ``qlabench run``) and write the report into ``out``; the terminal tables fit the terminal
    (``wide``: every column; with a ``console`` given, ``width``). Exit code: 0 report written
    (whatever the agreement), 2 a problem the user must fix (no ``from_`` among them: the
    message names the sweep that measures the set)."""
    err = console or Console(stderr=True, soft_wrap=True)
    if console is None:
        width = render.terminal_width(wide)
        console = render.console(width)
    notes: list[str] = []
    try:
        if direction not in DIRECTIONS:
            raise ReproduceError(f"--direction {direction!r}: use one of {', '.join(DIRECTIONS)}")
        pub = load_published(name, direction)
        if from_ is None:
            raise ReproduceError(
                f"no --from: reproduce only reads measured rows; measure them with `qlabench run "
                f"{_shown(pub.sweep_path())} --out DIR`, then pass --from DIR")
        rows_dir, source = Path(from_), f"rows read from {from_}"
        rows = measured_rows(rows_dir, direction, notes)
        meta = results.load_meta(rows_dir) if rows_dir.is_dir() else {}
        # the in-repo kernel's extra speedup is over ``baseline`` (default fla); a label asked
        # for must have rows of this direction
        if baseline == analysis.BEST_LIBRARY:  # a column of its own already (× best)
            raise ReproduceError(f"--baseline {baseline}: reproduce prints the in-repo kernel against the "
                           "best library in its `× best` column; give a label for the other one")
        extra_baseline = analysis.BASELINE if baseline is None else \
            analysis.resolve_baseline(rows, baseline)
        if extra_baseline is None:  # the labels reproduce takes: no best-library (above)
            raise ReproduceError(f"--baseline {baseline!r}: no {direction} rows of that label in "
                                 f"{from_}; labels present: "
                                 f"{', '.join(sorted(map(str, set(rows['backend'].dropna()))))}")
    except (ReproduceError, analysis.BadInput) as e:
        err.print(f"[red]error:[/red] {analysis.with_notes(e, notes)}", highlight=False)
        return 2
    rep = compare_rows(pub, rows, meta, source, extra_baseline)
    write(rep, out)
    for n in notes:
        render.line(console, f"note: {n}", width)
    print_report(rep, console, width)
    if not any(e["ok"] for e in rep.summary["backends"].values()):
        render.line(console, "no backend measured any point (see the statuses above); the "
                    "published columns are in the CSV", width, style="yellow")
    return 0
