"""The analysis layer every view shares (``summary``, ``report``, ``reproduce``, ``recommend``,
``compare``, the figures of :mod:`qlabench.plots`): views only render what these functions
compute.

- **rows a view reads**: :func:`read_rows` (a results path's rows, less those :func:`usable`
  sets aside, with a note saying how many and why);
- **newest rows**: :func:`newest` (one row per point × backend label × direction, as
  :func:`qlabench.results.latest` picks it) and :func:`load_newest`;
- **pairing**: whether the two rows of a ratio share GPU and measurement campaign and whether one
  is throttled — :func:`pairing`, :func:`pair`, :func:`pair_tag`, :func:`pairing_label`;
- **speedups over any baseline label**: :func:`resolve_baseline`, :func:`require_baseline` (an
  unknown label is :class:`UnknownBaseline`), :func:`speedup` (one ratio: baseline latency /
  backend latency) and :func:`speedups` (per point and label, with the pair's columns); the
  baseline :data:`BEST_LIBRARY` is, per point, the fastest ``ok`` row of a library backend
  (:func:`baseline_rows`);
- **winners and ties**: :func:`point_table` (per point the fastest ``ok`` label, runner-up,
  margin, tie, speedup over the baseline), :func:`model_footer`, the Mann–Whitney tie rule
  :func:`is_tie` with :func:`min_two_sided_p`, and the row helpers :func:`samples` /
  :func:`value`;
- **ordering**: :func:`layout_key`, :func:`layout_order`, :func:`model_order`,
  :func:`sort_layouts`; gate recipes kept apart: :func:`recipe_name`, :func:`by_recipe`;
- **one analysis per set of rows**: :class:`Analysis` computes the newest rows, the speedups and
  each direction's point table once and hands them to every table and figure of a view (the
  report draws a results directory's sections from one).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from . import results
from .config import DIRECTIONS

#: the default baseline label of every speedup
BASELINE = "fla"
#: the baseline that is, per point and direction, the fastest ``ok`` row of any library backend
#: (registry kind ``library``: not the in-repo kernels, not the reference)
BEST_LIBRARY = "best-library"
#: the tie rule's significance level and practical floor (median ratio)
ALPHA = 0.01
THRESHOLD = 0.01
FAILED = ("incorrect", *results.FAILED_STATUSES)
#: columns that identify a point of :func:`point_table` (``point_key`` holds seqlens and recipe)
POINT = ["model", "h_qk", "h_v", "layout", "direction", "point_key"]


class BadInput(Exception):
    """Input a user can fix; the message names the path (or the option)."""


class UnknownBaseline(BadInput):
    """A ``--baseline`` label without rows in the data."""


def check_tie_rule(alpha: float, threshold: float) -> None:
    """:class:`BadInput` naming the option unless ``alpha`` is in (0, 1) and ``threshold`` >= 0
    (the options of every view that tests or judges a difference: ``--alpha``, ``--threshold``)."""
    if not (threshold >= 0):
        raise BadInput(f"--threshold {threshold}: must be >= 0 (0.05 = 5%)")
    if not (0 < alpha < 1):
        raise BadInput(f"--alpha {alpha}: must be in (0, 1)")


def check_direction(direction: str, allowed: Sequence[str] = DIRECTIONS) -> str:
    """``direction`` when it is one of ``allowed``, else :class:`BadInput` naming them."""
    if direction not in allowed:
        raise BadInput(f"--direction {direction!r}: use one of {' | '.join(allowed)}")
    return direction


# --------------------------------------------------------------------------- rows


def value(row: Mapping, col: str):
    """``row[col]``, None when absent or NaN."""
    v = row.get(col)
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return None
    return v


def samples(row: Mapping) -> np.ndarray:
    """The finite per-call samples of a row (``samples_ms``), else its median as one sample."""
    s = row.get("samples_ms")
    if s is None or (isinstance(s, float) and math.isnan(s)):
        lat = row.get("latency_ms")
        return np.array([lat], float) if lat is not None and np.isfinite(lat) else np.array([])
    a = np.asarray(list(s), dtype=float)
    return a[np.isfinite(a)]


#: columns a view groups and labels a row by: a row with one of them null is set aside
#: (:func:`usable`)
KEY_COLUMNS = ("point_key", "backend", "direction", "status", "model", "h_qk", "h_v", "layout")


def usable(df: pd.DataFrame) -> tuple[pd.DataFrame, str | None]:
    """The rows of ``df`` a view can use, and a note saying how many were set aside and why (None
    when none was): a row with a null :data:`KEY_COLUMNS` value, and an ``ok`` row whose
    ``latency_ms`` is not a finite number > 0 (nothing to time or rank it by)."""
    if df.empty:
        return df, None
    null = df[[c for c in KEY_COLUMNS if c in df.columns]].isna().any(axis=1)
    lat = pd.to_numeric(df["latency_ms"], errors="coerce") if "latency_ms" in df.columns \
        else pd.Series(np.nan, index=df.index)
    bad_lat = ~null & (df["status"] == "ok") & ~(np.isfinite(lat) & (lat > 0))
    if not (null.any() or bad_lat.any()):
        return df, None
    why = []
    if null.any():
        cols = [c for c in KEY_COLUMNS if c in df.columns and df.loc[null, c].isna().any()]
        why.append(f"{int(null.sum())} with a null {'/'.join(cols)}")
    if bad_lat.any():
        why.append(f"{int(bad_lat.sum())} ok with a latency_ms that is not a finite number > 0")
    n = int(null.sum() + bad_lat.sum())
    return df[~(null | bad_lat)], (f"{n} of {len(df)} row{'s' * (len(df) != 1)} set aside: "
                                   + "; ".join(why))


def read_rows(path: str | Path, notes: list[str] | None = None) -> pd.DataFrame:
    """The rows a view reads from a results directory or Parquet file:
    :func:`qlabench.results.read_rows` (its :class:`qlabench.results.RowsError` as
    :class:`BadInput`, one line naming the path or file), less the rows :func:`usable` sets
    aside; its note, naming ``path``, is appended to ``notes``. No rows stored: an empty frame;
    rows stored but none usable: :class:`BadInput` saying why."""
    try:
        df = results.read_rows(path)
    except results.RowsError as e:
        raise BadInput(str(e)) from None
    kept, note = usable(df)
    if note is None:
        return df
    if kept.empty:
        raise BadInput(f"{path}: no usable rows ({note})")
    if notes is not None:
        notes.append(f"{path}: {note}")
    return kept


def with_notes(message: object, notes: Sequence[str]) -> str:
    """An error line of a view that set rows aside (:func:`read_rows`): ``message`` and the
    notes, which may be why nothing was left to show."""
    return str(message) + (f" (note: {'; '.join(dict.fromkeys(notes))})" if notes else "")


def newest(df: pd.DataFrame) -> pd.DataFrame:
    """One row per (point, backend label, direction): :func:`qlabench.results.latest`; frames
    without ``started_at``/``run_id`` keep the last row per key."""
    if df.empty or {"started_at", "run_id"} <= set(df.columns):
        return results.latest(df)
    return df.drop_duplicates(results.KEY, keep="last")


def load_newest(path: str | Path) -> pd.DataFrame:
    """:func:`newest` rows of a results directory (``results.load(path, latest=True)``)."""
    return results.load(path, latest=True)


# --------------------------------------------------------------------------- pairing

#: columns that say whether two rows can be compared as measured side by side
PAIR_COLUMNS = ("gpu_uuid", "campaign_id", "throttled", "timing_mode", "l2")
#: the timing method of a row: rows of different methods are paired only with a tag saying so
METHOD_COLUMNS = ("timing_mode", "l2")


def known(v) -> bool:
    """A pairing column's value is present (not None, NaN, NA or "")."""
    return v is not None and not (isinstance(v, float) and v != v) and v is not pd.NA and v != ""


def pairing(a: pd.DataFrame, b: pd.DataFrame) -> pd.DataFrame:
    """How the rows of every ratio were measured: ``a.iloc[i]`` is paired with ``b.iloc[i]``.

    Columns (index of ``a``): ``gpu_known`` / ``campaign_known`` (both rows carry ``gpu_uuid`` /
    ``campaign_id``), ``same_gpu`` / ``same_campaign`` (known on both sides and equal; a value
    missing on either side, as on rows written before these columns existed, counts as not
    shared), ``throttled`` (either row's ``throttled`` is true), ``same_method`` (no
    :data:`METHOD_COLUMNS` value known on both sides differs, as ``qlabench compare`` judges
    them: an ``events`` row against a ``graph-batch`` one is not the same method) and
    ``pairing``, the per-pair tag of :func:`pair_tag` ("" for a clean pair). Frames lacking a
    column count it as unknown."""
    if len(a) != len(b):
        raise ValueError(f"pairing: {len(a)} rows vs {len(b)} rows")

    def col(df, c):
        return list(df[c]) if c in df.columns else [None] * len(df)

    tags = [_pair_values(*v) for v in zip(*(col(df, c) for c in PAIR_COLUMNS for df in (a, b)))]
    return pd.DataFrame({c: [t[c] for t in tags] for c in PAIR_FIELDS}, index=a.index)


#: the columns of :func:`pairing` and the keys of :func:`pair`
PAIR_FIELDS = ("gpu_known", "same_gpu", "campaign_known", "same_campaign", "throttled",
               "same_method", "pairing")


def _pair_values(gpu_a, gpu_b, campaign_a, campaign_b, throttled_a, throttled_b, mode_a, mode_b,
                 l2_a, l2_b) -> dict:
    """:data:`PAIR_FIELDS` of one pair from its two rows' :data:`PAIR_COLUMNS` values."""
    out = {}
    for name, u, v in (("gpu", gpu_a, gpu_b), ("campaign", campaign_a, campaign_b)):
        k = known(u) and known(v)
        out[f"{name}_known"] = k
        out[f"same_{name}"] = bool(k and u == v)
    out["throttled"] = (known(throttled_a) and bool(throttled_a)) or \
        (known(throttled_b) and bool(throttled_b))
    out["same_method"] = not any(known(u) and known(v) and u != v
                                 for u, v in ((mode_a, mode_b), (l2_a, l2_b)))
    out["pairing"] = pair_tag(out["same_gpu"], out["same_campaign"], out["throttled"],
                              out["same_method"])
    return out


def pair(a: Mapping, b: Mapping) -> dict:
    """:func:`pairing` of one pair of rows given as dicts (the schema's columns)."""
    return _pair_values(*(r.get(c) for c in PAIR_COLUMNS for r in (a, b)))


#: the words of :func:`pair_tag`, in its order (each at most 12 characters: table cells)
PAIR_WORDS = ("cross-GPU", "cross-campaign", "throttled", "cross-method")


def pair_tag(same_gpu: bool, same_campaign: bool, throttled: bool,
             same_method: bool = True) -> str:
    """Per-pair tag: "" when both rows share GPU, campaign and timing method and neither is
    throttled, else the words that apply of :data:`PAIR_WORDS` (comma-separated)."""
    bad = (not same_gpu, not same_campaign, throttled, not same_method)
    return ", ".join(w for w, b in zip(PAIR_WORDS, bad) if b)


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
    m = int((~p["same_method"].astype(bool)).sum())
    if m:
        parts.append(f"cross-method: {m} of {n} pair{'s' * (n != 1)}")
    return "; ".join(parts) if parts else f"same GPU and campaign: {n} pair{'s' * (n != 1)}"


# --------------------------------------------------------------------------- speedups


def resolve_baseline(df: pd.DataFrame, baseline: str) -> str | None:
    """The label of ``baseline``: itself when rows carry it, else the only label of that library
    (``backend_name``); None when absent."""
    labels = set(df["backend"].dropna()) if "backend" in df.columns else set()
    if baseline in labels:
        return baseline
    if baseline == BEST_LIBRARY:
        return BEST_LIBRARY if library_labels(df) else None
    if "backend_name" in df.columns:
        named = sorted(set(df.loc[df["backend_name"] == baseline, "backend"].dropna()))
        if len(named) == 1:
            return named[0]
    return None


def require_baseline(df: pd.DataFrame, baseline: str) -> str:
    """:func:`resolve_baseline`, or :class:`UnknownBaseline` (one line naming the label and the
    labels present) when no row carries it."""
    got = resolve_baseline(df, baseline)
    if got is None:
        present = sorted(set(df["backend"].dropna())) if "backend" in df.columns else []
        what = "no rows of a library backend" if baseline == BEST_LIBRARY else "no rows of that label"
        raise UnknownBaseline(f"--baseline {baseline!r}: {what}; labels present: "
                              f"{', '.join(map(str, present)) or 'none'} (or {BEST_LIBRARY})")
    return got


def library_labels(df: pd.DataFrame) -> set[str]:
    """The labels of ``df`` whose backend (``backend_name``, else the label) the registry declares
    a library (:func:`qlabench.backends.kinds`); a backend not registered here is not counted."""
    if df.empty or "backend" not in df.columns:
        return set()
    from .backends import kinds

    kind = kinds()
    names = df["backend_name"] if "backend_name" in df.columns else df["backend"]
    pairs = set(zip(df["backend"], names.where(names.notna(), df["backend"])))
    return {label for label, name in pairs if kind.get(name) == "library"}


def baseline_rows(df: pd.DataFrame, baseline: str) -> pd.DataFrame:
    """Per (``point_key``, ``direction``) the ``ok`` row of ``df`` that ``baseline`` means there
    (indexed by those two): the label's (the last one when several), or for :data:`BEST_LIBRARY`
    the fastest ``ok`` row of a library label."""
    ok = df[df["status"] == "ok"]
    if baseline == BEST_LIBRARY:
        lib = ok[ok["backend"].isin(library_labels(df)) & ok["latency_ms"].notna()]
        best = lib.sort_values(["latency_ms", "backend"], kind="stable")
        return best.drop_duplicates(["point_key", "direction"], keep="first").set_index(["point_key", "direction"])
    return ok[ok["backend"] == baseline].drop_duplicates(
        ["point_key", "direction"], keep="last").set_index(["point_key", "direction"])


def speedup(baseline_ms, ms) -> float:
    """One speedup: baseline latency / backend latency (> 1: the backend is faster); NaN when
    either is missing or not finite."""
    try:
        b, m = float(baseline_ms), float(ms)
    except (TypeError, ValueError):
        return math.nan
    return b / m if np.isfinite(b) and np.isfinite(m) else math.nan


def quantile_cols(d: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """(p10, p90) latency of each row; the median where a row has none."""
    med = d["latency_ms"].to_numpy(float)
    lo = d["p10_ms"].to_numpy(float) if "p10_ms" in d else med
    hi = d["p90_ms"].to_numpy(float) if "p90_ms" in d else med
    return np.where(np.isfinite(lo), lo, med), np.where(np.isfinite(hi), hi, med)


def speedups(df: pd.DataFrame, baseline: str = BASELINE) -> pd.DataFrame:
    """Speedup of every ``ok`` row of ``df`` (newest rows) over the ``ok`` row of label
    ``baseline`` on the same point and direction (:func:`baseline_rows`; for
    :data:`BEST_LIBRARY`, the fastest library's, so a library's own speedup is at most 1).

    Index: those rows of ``df`` (not the baseline label's own, not points without a baseline row).
    Columns: ``baseline_ms``, ``speedup`` (baseline latency / row latency), ``speedup_lo`` ..
    ``speedup_hi`` (baseline p10 / row p90 .. baseline p90 / row p10; a row without p10/p90
    contributes its median) and the pair's :func:`pairing` columns."""
    cols = ["baseline_ms", "speedup", "speedup_lo", "speedup_hi", *PAIR_FIELDS]
    if df.empty:
        return pd.DataFrame(columns=cols)
    ok = df["status"] == "ok"
    base = baseline_rows(df, baseline)
    keys = list(zip(df["point_key"], df["direction"]))
    has = np.array([k in base.index for k in keys], dtype=bool) & ok.to_numpy() \
        & (df["backend"] != baseline).to_numpy()
    mine = df[has]
    if mine.empty:
        return pd.DataFrame(columns=cols)
    b = base.loc[[k for k, h in zip(keys, has) if h]].set_axis(mine.index)
    out = pd.DataFrame(index=mine.index)
    out["baseline_ms"] = b["latency_ms"].to_numpy(float)
    out["speedup"] = b["latency_ms"].to_numpy(float) / mine["latency_ms"].to_numpy(float)
    b10, b90 = quantile_cols(b)
    o10, o90 = quantile_cols(mine)
    out["speedup_lo"] = b10 / o90
    out["speedup_hi"] = b90 / o10
    return out.join(pairing(b, mine))


def geomean(x) -> float | None:
    """Geometric mean of the finite positive values of ``x``; None when there are none."""
    a = np.asarray(list(x), float)
    a = a[np.isfinite(a) & (a > 0)]
    return float(np.exp(np.mean(np.log(a)))) if len(a) else None


# --------------------------------------------------------------------------- winners and ties


def min_two_sided_p(n: int, m: int) -> float:
    """Smallest two-sided Mann–Whitney p-value n and m untied samples can give: 2 / C(n+m, n)."""
    if n < 1 or m < 1:
        return 1.0
    return min(1.0, 2.0 / math.comb(n + m, n))


def is_tie(a, b, alpha: float = ALPHA, threshold: float = THRESHOLD) -> bool:
    """True when samples ``a`` (or a row with ``samples_ms``) and ``b`` cannot be told apart: not
    (median ratio beyond ``1 + threshold`` either way and two-sided Mann–Whitney p < ``alpha``).
    Too few samples for the test to reach ``alpha`` → tie."""
    from scipy.stats import mannwhitneyu

    a = samples(a) if isinstance(a, Mapping) else np.asarray(a, float)
    b = samples(b) if isinstance(b, Mapping) else np.asarray(b, float)
    if not len(a) or not len(b):
        return True
    ma, mb = float(np.median(a)), float(np.median(b))
    if ma <= 0 or mb <= 0:
        return True
    ratio = max(ma, mb) / min(ma, mb)
    if ratio <= 1 + threshold:
        return True
    if min_two_sided_p(len(a), len(b)) >= alpha:
        return True
    return not float(mannwhitneyu(a, b, alternative="two-sided").pvalue) < alpha


def sample_quantile(s: np.ndarray, q: float, row: Mapping, col: str) -> float | None:
    """Quantile ``q`` of samples ``s``; the row's stored ``col`` when it has fewer than two."""
    if len(s) > 1:
        return float(np.quantile(s, q))
    return value(row, col)


def point_table(df: pd.DataFrame, baseline: str = BASELINE, alpha: float = ALPHA,
                threshold: float = THRESHOLD) -> pd.DataFrame:
    """One row per point and direction of ``df`` (newest rows): ``winner`` (fastest ``ok`` label)
    with ``winner_ms`` / ``winner_p10_ms`` / ``winner_p90_ms`` / ``winner_max_rel_l2``,
    ``runner_up`` / ``runner_up_ms``, ``margin`` (runner-up / winner), ``tie`` (:func:`is_tie`),
    ``pairing`` (winner vs runner-up), ``baseline`` / ``baseline_ms`` / ``speedup`` (baseline /
    winner, :func:`speedup`) / ``baseline_pairing``, ``n_backends`` / ``n_ok`` / ``n_incorrect``
    / ``n_failed`` and ``latency_ms`` (label -> ms of the ok rows). Points without any ``ok`` row
    keep ``winner`` None."""
    base = resolve_baseline(df, baseline) if len(df) else None
    libs = library_labels(df) if base == BEST_LIBRARY else set()
    out = []
    for keys, recs in _record_groups(df, POINT):
        info = dict(zip(POINT, keys))
        first = recs[0]
        ok = sorted((r for r in recs if r["status"] == "ok" and value(r, "latency_ms") is not None),
                    key=lambda r: (r["latency_ms"], r["backend"]))
        row = {**info, "point_index": value(first, "point_index"),
               "seqlens": [int(x) for x in first["seqlens"]] if first["seqlens"] is not None else [],
               "num_seqs": value(first, "num_seqs"), "total_tokens": value(first, "total_tokens"),
               "n_backends": len(recs), "n_ok": len(ok),
               "n_incorrect": sum(r["status"] == "incorrect" for r in recs),
               "n_failed": sum(r["status"] in results.FAILED_STATUSES for r in recs),
               "winner": None, "winner_ms": None, "winner_p10_ms": None, "winner_p90_ms": None,
               "winner_max_rel_l2": None, "runner_up": None, "runner_up_ms": None,
               "margin": None, "tie": False, "pairing": "", "baseline": base,
               "baseline_ms": None, "speedup": None, "baseline_pairing": "",
               "latency_ms": {r["backend"]: float(r["latency_ms"]) for r in ok}}
        if ok:
            w = ok[0]
            s = samples(w)
            row.update(winner=w["backend"], winner_ms=float(w["latency_ms"]),
                       winner_p10_ms=sample_quantile(s, 0.1, w, "p10_ms"),
                       winner_p90_ms=sample_quantile(s, 0.9, w, "p90_ms"),
                       winner_max_rel_l2=value(w, "max_rel_l2"))
            if len(ok) > 1:
                r2 = ok[1]
                row.update(runner_up=r2["backend"], runner_up_ms=float(r2["latency_ms"]),
                           margin=float(r2["latency_ms"]) / float(w["latency_ms"]),
                           tie=is_tie(w, r2, alpha, threshold),
                           pairing=pair(w, r2)["pairing"])
            b = next((r for r in ok if r["backend"] == base or r["backend"] in libs), None)
            if b is not None:
                row.update(baseline_ms=float(b["latency_ms"]),
                           speedup=speedup(b["latency_ms"], w["latency_ms"]),
                           baseline_pairing=pair(w, b)["pairing"] if b is not w else "")
        out.append(row)
    t = pd.DataFrame(out)
    if not t.empty:
        t = t.sort_values(["direction", "h_qk", "h_v", "model", "num_seqs", "total_tokens",
                           "point_index"], kind="stable").reset_index(drop=True)
    return t


def _record_groups(df: pd.DataFrame, by: list[str]) -> list[tuple[tuple, list[dict]]]:
    """The rows of ``df`` grouped by the columns ``by`` (groups in order of first appearance,
    rows in frame order; a missing value is a key of its own): ``[(key, [row dict, ...]), ...]``.
    Every row becomes a dict once, not once per group."""
    recs = df.to_dict("records")
    keys = df[by].reset_index(drop=True)
    return [(k if isinstance(k, tuple) else (k,), [recs[i] for i in g.index])
            for k, g in keys.groupby(by, sort=False, dropna=False)]


def model_footer(df: pd.DataFrame, table: pd.DataFrame, baseline: str | None) -> pd.DataFrame:
    """Per label over one model's points (``df``: its newest rows, ``table``: its
    :func:`point_table`): ``geomean_speedup`` over the baseline (points where both are ``ok``),
    ``points`` (that many), ``wins`` and ``tied_wins``."""
    rows = []
    ok = df[df["status"] == "ok"]
    lat = ok.pivot_table(index=["point_key", "direction"], columns="backend", values="latency_ms",
                         aggfunc="first")
    if baseline == BEST_LIBRARY:
        libs = [c for c in lat.columns if c in library_labels(df)]
        if libs:
            lat[BEST_LIBRARY] = lat[libs].min(axis=1)
    for label in sorted(set(df["backend"].dropna())):
        gm, n = None, 0
        if baseline is not None and baseline in lat.columns and label in lat.columns:
            both = lat[[baseline, label]].dropna()
            n = len(both)
            if n:
                gm = float(np.exp(np.mean(np.log(both[baseline] / both[label]))))
        won = table[table["winner"] == label]
        rows.append({"backend": label, "geomean_speedup": gm, "points": n,
                     "wins": len(won), "tied_wins": int(won["tie"].sum())})
    return pd.DataFrame(rows)


# --------------------------------------------------------------------------- ordering


def number_or(v, default: float) -> float:
    """``v`` as a float; ``default`` when missing or not a number."""
    try:
        f = float(v)
    except (TypeError, ValueError):
        return default
    return f if np.isfinite(f) else default


def layout_key(num_seqs, total_tokens, seqlens) -> tuple:
    """The one layout order of every figure and table: number of sequences, then total tokens,
    then the sequence lengths in stored order (``1x8192`` < ``1x32768`` < ``4096+4096`` <
    ``8192+24576`` < ``32768/4seq``)."""
    lens = tuple(int(x) for x in seqlens) if np.ndim(seqlens) == 1 else ()
    n = number_or(num_seqs, len(lens))
    t = number_or(total_tokens, sum(lens))
    return (int(n), int(t), lens)


def layout_keys(df: pd.DataFrame) -> list[tuple]:
    """:func:`layout_key` of every row of ``df``."""
    n = df["num_seqs"] if "num_seqs" in df else pd.Series([None] * len(df), index=df.index)
    t = df["total_tokens"] if "total_tokens" in df else pd.Series([None] * len(df), index=df.index)
    s = df["seqlens"] if "seqlens" in df else pd.Series([()] * len(df), index=df.index)
    return [layout_key(a, b, c) for a, b, c in zip(n, t, s)]


def layout_order(df: pd.DataFrame) -> list[str]:
    """The distinct ``layout`` labels of ``df`` in :func:`layout_key` order."""
    if df.empty:
        return []
    k = pd.Series(layout_keys(df), index=df.index)
    first = {}
    for lab, key in zip(df["layout"], k):
        first[lab] = min(first.get(lab, key), key)
    return sorted(first, key=lambda lab: (first[lab], lab))


def model_order(df: pd.DataFrame) -> list[str]:
    """The distinct ``model`` values of ``df`` in sweep order (first ``point_index``)."""
    if df.empty:
        return []
    d = df.sort_values("point_index", kind="stable") if "point_index" in df else df
    return list(dict.fromkeys(d["model"]))


def sort_layouts(df: pd.DataFrame, by_model: bool = True,
                 backend_order: Sequence[str] | None = None) -> pd.DataFrame:
    """``df`` sorted by model (:func:`model_order`, when ``by_model``), then layout
    (:func:`layout_order`), then backend (in ``backend_order``, when given)."""
    if df.empty:
        return df
    lay = {lab: i for i, lab in enumerate(layout_order(df))}
    cols = {"_l": df["layout"].map(lay)}
    if by_model:
        mo = {m: i for i, m in enumerate(model_order(df))}
        cols["_m"] = df["model"].map(mo)
    if "backend" in df and backend_order is not None:
        bo = {b: i for i, b in enumerate(backend_order)}
        cols["_b"] = df["backend"].map(bo)
    keys = [k for k in ("_m", "_l", "_b") if k in cols]
    return df.assign(**cols).sort_values(keys, kind="stable").drop(columns=keys)


# --------------------------------------------------------------------------- gate recipes


def recipe_name(gate_recipe) -> str:
    """``strong-decay:...`` -> ``strong-decay``; the published recipe (``zero0.25/seed0``) ->
    ``published``."""
    s = str(gate_recipe)
    return s.split(":", 1)[0] if ":" in s else "published"


def by_recipe(df: pd.DataFrame, always: bool = False) -> pd.DataFrame:
    """``df`` with ``model`` reading ``<model> [<recipe>]`` (:func:`recipe_name`) when its rows
    hold several gate recipes (or ``always``: two sides of a comparison that do between them),
    so that every view keeps each recipe apart; else ``df`` itself."""
    if "gate_recipe" in df and (always or df["gate_recipe"].nunique() > 1):
        return df.assign(model=[f"{m} [{recipe_name(r)}]"
                                for m, r in zip(df["model"], df["gate_recipe"])])
    return df


# --------------------------------------------------------------------------- one analysis, many views


class Analysis:
    """The analysis of one set of rows that every table and figure drawn from them shares, each
    part computed once, on first use, and kept (views read these frames; they do not modify
    them):

    - :attr:`rows`: the newest row per key (:func:`newest`) of the rows given;
    - :attr:`speedups`: :func:`speedups` of :attr:`rows` over ``baseline`` (index: :attr:`rows`');
    - :meth:`points`: per direction, :func:`point_table` of :attr:`rows` (models labelled by
      recipe, :func:`by_recipe`) with ``tp`` (``h_qk/h_v``), in :func:`sort_layouts` order.
    """

    def __init__(self, rows: pd.DataFrame, baseline: str = BASELINE):
        self.rows = newest(rows)
        self.baseline = baseline
        self._speedups: pd.DataFrame | None = None
        self._points: dict[str | None, pd.DataFrame] = {}

    @property
    def speedups(self) -> pd.DataFrame:
        if self._speedups is None:
            self._speedups = speedups(self.rows, self.baseline)
        return self._speedups

    def points(self, direction: str | None = None) -> pd.DataFrame:
        """One row per point of ``direction`` (None: every direction): :func:`point_table` —
        the fastest ``ok`` label, its p10–p90, the runner-up, ``margin``, ``tie``, ``speedup``
        over the baseline, the correctness counts — plus ``tp``; points of a non-published gate
        recipe carry the recipe in ``model``. Sorted by :func:`model_order`, then
        :func:`layout_order`."""
        if direction not in self._points:
            d = self.rows
            if direction and len(d):
                d = d[d["direction"] == direction]
            t = point_table(by_recipe(d), self.baseline) if len(d) else pd.DataFrame()
            if t.empty:
                t = pd.DataFrame(columns=[*POINT, "tp", "winner", "margin", "tie"])
            else:
                t["tp"] = [f"{int(a)}/{int(b)}" for a, b in zip(t["h_qk"], t["h_v"])]
                t = sort_layouts(t).reset_index(drop=True)
            self._points[direction] = t
        return self._points[direction]
