"""Run vs baseline, row by row: ratio of medians, a test on the stored samples, a verdict, an exit code.

Rows are paired by key (point_key × backend × direction), taking the latest row per key on each
side (:func:`qlabench.results.latest`). For each pair:

- ``ratio`` = median(new samples) / median(base samples) (falls back to ``latency_ms`` when a side
  has no samples); > 1 means the new run is slower.
- ``p_value``: **two-sided** Mann–Whitney U on the two sample lists (``scipy.stats.mannwhitneyu``).
  Two-sided, not one-sided ``greater``, because the verdict is symmetric (faster *and* slower are
  reported) and the side to test would otherwise be chosen after looking at the ratio — testing
  ``greater`` only when the ratio is above 1 is a two-sided test at 2·alpha in disguise. Using the
  two-sided p against alpha keeps the stated false-alarm rate for the CI gate.
- ``ratio_lo``/``ratio_hi``: percentile bootstrap interval (level 1 − alpha) of the median ratio,
  resampling each side's samples (seeded, so a report is reproducible). Shown for reading, not used
  in the verdict.

Verdicts: ``slower`` when ratio > 1 + threshold **and** p < alpha; ``faster`` when
ratio < 1 / (1 + threshold) and p < alpha; ``same`` otherwise; ``incomparable`` when the two rows
cannot be compared — the base row is not ``ok``, the rows differ in timing method
(``timing_mode``, ``l2``), GPU model (``gpu_name``) or input recipe (``recipe_hash``,
``gate_recipe``), or there are too few samples for the test to ever reach alpha — with the reason
in the ``reason`` column. The :data:`MUST_MATCH` columns in which a pair's rows differ are listed
in ``differs``: such a ratio measures the change of method, GPU or inputs, not of the code, so any
such pair makes :func:`compare_cmd` exit 3 (a CI gate must not pass a run timed another way or on
another GPU); with ``--allow-incomparable`` those pairs are left unjudged and the exit code is the
other pairs'.

Why both gates: samples within one run are many and tight (graph replays, ~1% spread), so the test
alone flags 1% drifts that come and go between runs (clocks, other tenants); the threshold alone
flags noise on short points with a few wide samples. A regression has to be large *and* clear.

``broken`` when the base row was ``ok`` and the new one is not: any other status (``incorrect``,
``crashed``, ``timeout``, ``oom``, ``unavailable``, ``unsupported``, ...) or no row at all while
the new side measured that point and direction with other backends (a backend that stopped
working or vanished must fail CI, not pass as "incomparable"). Points the new side did not measure
at all (a quick subset against a full sweep) are counted as ``only_base``, not judged. A backend
label of the base side that the new side holds no row of at all (``tilelang@prev`` against a run
of ``tilelang``) is not a label that broke but two runs of different labels:
:func:`missing_labels` finds it and :func:`compare_cmd` exits 2 naming it and the options that pair
two labels, instead of calling every one of its points ``broken``.

``same-row`` when both sides hold the same stored row (same :data:`results.ROW_IDENTITY`: run id,
point index, backend, direction, start time) — e.g. a run directory compared with a copy or a
merge of itself. Such a pair says nothing about repeatability, so it is not judged; its reason
names no run (the run ids are in ``--out``'s ``base_run_id`` / ``new_run_id``). When *every*
compared pair is ``same-row``, :func:`compare_cmd` prints no table: one line on stderr, exit 2
(``--out``, when given, still gets the pairs).

Every pair also carries its :func:`qlabench.analysis.pairing` (``same_gpu``, ``same_campaign``,
``throttled`` and the tag ``pairing``, e.g. "cross-campaign, throttled") and both sides'
``calls_per_sample``. These say how the two rows were measured, not why they differ: the table
shows them in columns of their own (``calls``: ``base→new`` when it changed — the per-call mean
of a graph replay of 8 calls and of 32 calls need not be the same number; ``pairing``), apart
from ``reason``. The summary line gives :func:`qlabench.analysis.pairing_label` over the pairs
that have a ratio.

**Two labels** (``--base-backend A --new-backend B``, e.g. ``flashinfer@0.6.13`` and
``flashinfer@0.7.4``, or ``tilelang@old`` and ``tilelang``; one directory or two): the rows of
label A on the base side and of label B on the new side are paired per point and direction (the
point key without the backend) and judged the same way; the ``backend`` column reads ``A → B``.
Points label B has no row for are ``only_base``, not judged. Rows of one run on one GPU pair
cleanly; anything else carries its ``pairing`` tag (``cross-campaign``, ...).

Exit codes of :func:`compare_cmd` (and of ``qlabench compare``; the first that applies):

- 2: bad input — a path missing, unreadable or without rows, required columns missing, no key in
  common, a backend label of BASE without any row in NEW (:func:`missing_labels`; a label
  BASE's own newest run dropped is not compared: :func:`newest_run`), a
  ``--base-backend`` / ``--new-backend`` label without rows, every pair the same stored row, bad
  ``--out`` / ``--threshold`` / ``--alpha``;
- 3: a pair's rows differ in timing method, GPU model or input recipe (``differs``), unless
  ``--allow-incomparable``; stderr names the columns, how many pairs, an example of each change;
- 1: a row is ``slower`` or ``broken``;
- 0: otherwise.

Codes 2 and 3 come with one ``error: ...`` line on stderr; the table is printed before code 3,
never before code 2.

The table (:func:`print_table`) reads BASE then NEW: the title names BASE → NEW, then per pair
base ms, new ms and new/base. It fits the terminal (:mod:`qlabench.render`): in a narrow one the
columns are left out in this order — model (heads name it too), 99% CI, p, calls, pairing, dir,
then base ms with new ms — and named under the table; heads, layout, backend, new/base, verdict
and reason are always shown; a column left out comes back when it fits beside the others. A
column with one value in every row (dir, backend, calls, pairing) is stated once under the table,
and so are the pairing tags every row carries (``every row: pairing cross-GPU, cross-campaign``;
the column keeps the rest, e.g. ``throttled``). Reasons are numbered under the table (one number
per distinct text; no reason names a run).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pandas as pd

from . import analysis, render, results
from .analysis import BadInput, min_two_sided_p, samples, value  # noqa: F401 (public here too)
from .render import Column

KEY = results.KEY
VERDICTS = ("slower", "broken", "faster", "same", "incomparable", "same-row")
#: columns copied from the rows for display (new side wins, base side fills in)
_INFO = ("model", "tp", "layout", "num_seqs", "total_tokens", "point_index", "h_qk", "h_v")
BOOTSTRAP_N = 1000
#: the pair's :func:`qlabench.analysis.pairing` columns carried into the table
#: columns whose values must agree for two rows to be compared (column -> word in the reason):
#: the timing method, the GPU model and the input recipe. A pair whose rows differ in any of them
#: is ``incomparable`` and lists those columns in ``differs``; :func:`compare_cmd` exits 3 on it.
MUST_MATCH = {"timing_mode": "timing_mode", "l2": "l2", "gpu_name": "gpu",
              "recipe_hash": "input recipe", "gate_recipe": "gate recipe"}


def bootstrap_ratio_ci(a: np.ndarray, b: np.ndarray, level: float, n_boot: int = BOOTSTRAP_N,
                       seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of median(b) / median(a) at ``level`` (e.g. 0.99)."""
    rng = np.random.default_rng(seed)
    ma = np.median(a[rng.integers(0, len(a), (n_boot, len(a)))], axis=1)
    mb = np.median(b[rng.integers(0, len(b), (n_boot, len(b)))], axis=1)
    r = mb / ma
    q = (1 - level) / 2
    return float(np.quantile(r, q)), float(np.quantile(r, 1 - q))


def same_row(base: Mapping, new: Mapping) -> bool:
    """Both mappings are the same stored row (:data:`results.ROW_IDENTITY` equal and known)."""
    ids = [(value(base, c), value(new, c)) for c in results.ROW_IDENTITY]
    return all(a is not None and b is not None and str(a) == str(b) for a, b in ids)


def judge(base: Mapping, new: Mapping | None, threshold: float = 0.05, alpha: float = 0.01,
          ci: bool = True) -> dict:
    """Verdict for one pair of rows (dict-like, the schema's columns); ``new=None``: the new side
    has no row for this key (``broken`` when the base row is ``ok``).

    Returns ``{base_ms, new_ms, ratio, ratio_lo, ratio_hi, p_value, n_base, n_new, verdict,
    reason, differs}``; ``ratio`` is new/base (> 1: slower); ``differs``: the
    :data:`MUST_MATCH` columns both rows carry with different values, comma-separated ("" when
    none, or when a side has no row or both sides hold the same row). ``ci=False`` skips the
    bootstrap interval (it does not enter the verdict; the report's history judges thousands of
    pairs)."""
    from scipy.stats import mannwhitneyu

    out = {"base_ms": value(base, "latency_ms"), "new_ms": value(new or {}, "latency_ms"),
           "ratio": None, "ratio_lo": None, "ratio_hi": None, "p_value": None,
           "n_base": 0, "n_new": 0, "verdict": "incomparable", "reason": "", "differs": ""}
    why = []
    sb = value(base, "status")
    if new is None:
        if sb == "ok":
            out["verdict"] = "broken"
            out["reason"] = "was ok, now missing (no row for it in new)"
        else:
            out["reason"] = f"base status {sb}; no row in new"
        return out
    if same_row(base, new):
        out["verdict"] = "same-row"
        out["reason"] = "the same stored row on both sides"
        return out
    sn = value(new, "status")
    changed = [c for c in MUST_MATCH if value(base, c) is not None and value(new, c) is not None
               and value(base, c) != value(new, c)]
    out["differs"] = ",".join(changed)
    if sb == "ok" and sn != "ok":
        rr = value(new, "reason")
        out["verdict"] = "broken"
        out["reason"] = f"was ok, now {sn or 'without a status'}" + (f" ({str(rr)[:80]})" if rr else "")
        return out
    if sb != "ok" and sb == sn:
        rr = value(new, "reason")
        why.append(f"status {sn} on both sides" + (f" ({str(rr)[:60]})" if rr else ""))
    else:
        for side, r in (("base", base), ("new", new)):
            st = value(r, "status")
            if st != "ok":
                rr = value(r, "reason")
                why.append(f"{side} status {st}" + (f" ({str(rr)[:60]})" if rr else ""))
    why += [f"{MUST_MATCH[c]} {value(base, c)} vs {value(new, c)}" for c in changed]
    if why:
        out["reason"] = "; ".join(why)
        return out
    a, b = samples(base), samples(new)
    out["n_base"], out["n_new"] = len(a), len(b)
    if not len(a) or not len(b) or np.median(a) <= 0:
        out["reason"] = "no latency samples"
        return out
    ratio = float(np.median(b) / np.median(a))
    out["ratio"] = ratio
    if min_two_sided_p(len(a), len(b)) >= alpha:
        out["reason"] = (f"too few samples for a test at alpha={alpha:g} "
                         f"(base {len(a)}, new {len(b)})")
        return out
    p = float(mannwhitneyu(b, a, alternative="two-sided").pvalue)
    out["p_value"] = p
    if ci:
        out["ratio_lo"], out["ratio_hi"] = bootstrap_ratio_ci(a, b, 1 - alpha)
    if p < alpha and ratio > 1 + threshold:
        out["verdict"] = "slower"
    elif p < alpha and ratio < 1 / (1 + threshold):
        out["verdict"] = "faster"
    else:
        out["verdict"] = "same"
        if abs(ratio - 1) > threshold:
            out["reason"] = "beyond threshold but p ≥ alpha"
        elif p < alpha:
            out["reason"] = "significant but within threshold"
    return out


def load_side(path: Path, notes: list[str] | None = None) -> pd.DataFrame:
    """Rows of a results directory or Parquet file (:func:`qlabench.analysis.read_rows`: the
    rows it sets aside noted in ``notes``); :class:`BadInput` with the path on trouble."""
    path = Path(path)
    df = analysis.read_rows(path, notes)
    if df.empty:
        where = path / "parts" if (path / "parts").is_dir() else path
        raise BadInput(f"{path}: no result rows (no *.parquet in {where})")
    return df


def compare_frames(base: pd.DataFrame, new: pd.DataFrame, threshold: float = 0.05,
                   alpha: float = 0.01, base_backend: str | None = None,
                   new_backend: str | None = None) -> tuple[pd.DataFrame, dict]:
    """Pair the latest row per key on each side and judge each pair.

    The new side's row per key is its newest (so a backend that stopped working after an ``ok``
    row of an earlier run in the same directory is seen as it is now); the base side's is
    :func:`results.latest`'s. Judged keys: every key of the new side that the base side has, and
    every base key whose point and direction the new side measured (for some backend) but without
    a row for this backend — ``broken``, also when the new side did not ask for that backend.
    Returns (one row per judged key with the key, info columns, :func:`judge`'s fields, both run
    ids and shas, both ``calls_per_sample`` and the pair's :func:`qlabench.analysis.pairing` columns; a
    summary dict with counts per verdict, ``only_base`` and ``only_new`` key counts, ``pairs``
    (pairs with a ratio), ``pairing`` (:func:`qlabench.analysis.pairing_label` over those),
    ``differs_pairs`` (pairs whose rows differ in a :data:`MUST_MATCH` column), ``differs``
    (column -> that many pairs) and ``differs_example`` (column -> its first change,
    ``"<base> vs <new>"``)).
    With ``base_backend`` and ``new_backend`` (labels) only those labels' rows are paired, per
    point and direction, and the key's backend reads ``"<base> → <new>"``."""
    if base_backend is not None:
        base = base[base["backend"] == base_backend]
        new = new[new["backend"] == new_backend]

    def key(r: dict) -> tuple:
        if base_backend is None:
            return tuple(r[c] for c in KEY)
        return r["point_key"], f"{base_backend} → {new_backend}", r["direction"]

    b = {key(r): r for r in results.latest(base).to_dict("records")}
    newest = new.sort_values(["started_at", "run_id"], kind="stable").drop_duplicates(KEY, keep="last")
    n = {key(r): r for r in newest.to_dict("records")}
    measured = {(k[0], k[2]) for k in n}  # (point_key, direction) the new side has rows for
    keys = [k for k in n if k in b] + [k for k in b if k not in n and (k[0], k[2]) in measured]
    rows = []
    examples: dict[str, str] = {}  # MUST_MATCH column -> its first change, "base vs new"
    for k in keys:
        rb, rn = b[k], n.get(k)
        j = judge(rb, rn, threshold, alpha)
        for c in filter(None, j["differs"].split(",")):
            examples.setdefault(c, f"{value(rb, c)} vs {value(rn, c)}")
        info = {c: (value(rn or {}, c) if value(rn or {}, c) is not None else value(rb, c))
                for c in _INFO}
        pr = analysis.pair(rb, rn or {})
        rows.append({**dict(zip(KEY, k)), **info, **j,
                     "base_backend": value(rb, "backend"), "new_backend": value(rn or {}, "backend"),
                     "base_calls_per_sample": value(rb, "calls_per_sample"),
                     "new_calls_per_sample": value(rn or {}, "calls_per_sample"),
                     **{c: pr[c] for c in analysis.PAIR_FIELDS},
                     "base_run_id": value(rb, "run_id"), "new_run_id": value(rn or {}, "run_id"),
                     "base_sha": value(rb, "git_sha"), "new_sha": value(rn or {}, "git_sha"),
                     "base_version": value(rb, "backend_version"),
                     "new_version": value(rn or {}, "backend_version")})
    cols = [*KEY, *_INFO, "base_backend", "new_backend", "base_ms", "new_ms", "ratio", "ratio_lo", "ratio_hi", "p_value",
            "n_base", "n_new", "verdict", "reason", "differs", "base_calls_per_sample",
            "new_calls_per_sample", *analysis.PAIR_FIELDS,
            "base_run_id", "new_run_id", "base_sha", "new_sha", "base_version", "new_version"]
    df = pd.DataFrame(rows, columns=cols)
    if not df.empty:
        order = {v: i for i, v in enumerate(VERDICTS)}
        df = df.sort_values(["verdict", "point_index", "backend", "direction"],
                            key=lambda s: s.map(order) if s.name == "verdict" else s,
                            kind="stable").reset_index(drop=True)
    summary = {v: int((df["verdict"] == v).sum()) for v in VERDICTS}
    summary["only_base"] = len(set(b) - set(keys))
    summary["only_new"] = len(set(n) - set(b))
    judged = df[df["ratio"].notna()] if not df.empty else df
    summary["pairs"] = len(judged)
    summary["pairing"] = analysis.pairing_label(judged)
    summary["differs_pairs"] = int((df["differs"] != "").sum()) if not df.empty else 0
    summary["differs"] = {c: n for c in MUST_MATCH
                          if (n := sum(c in d.split(",") for d in df["differs"]))}
    summary["differs_example"] = {c: examples[c] for c in summary["differs"]}
    return df, summary


def differs_line(summary: dict, n_pairs: int) -> str:
    """One line on the pairs whose rows differ in timing method, GPU or input recipe (from
    :func:`compare_frames`' summary): how many, in which columns, an example of each."""
    what = "; ".join(f"{c} in {n} (e.g. {summary['differs_example'][c]})"
                     for c, n in summary["differs"].items())
    return (f"method, GPU or recipe differ from the baseline in {summary['differs_pairs']} of "
            f"{n_pairs} pairs: {what}")


def _fmt(x, spec: str) -> str:
    return "" if x is None or (isinstance(x, float) and not np.isfinite(x)) else format(x, spec)


def row_label(r: Mapping) -> str:
    return f"{r['backend']} {r['direction']} {r.get('model') or ''} ({r.get('tp') or ''}) " \
           f"{r.get('layout') or r['point_key']}"


def columns(alpha: float) -> list[Column]:
    """The compare table's columns, BASE before NEW; ``drop``: the order they are left out in a
    narrow terminal (module doc)."""
    return [Column("model", drop=1), Column("heads"), Column("layout"),
            Column("backend", same=True), Column("dir", drop=6, same=True),
            Column("base ms", "right", drop=7), Column("new ms", "right", drop=7),
            Column("new/base", "right"), Column(f"{1 - alpha:.0%} CI", "right", drop=2),
            Column("p", "right", drop=3), Column("calls", "right", drop=4, same=True),
            Column("pairing", drop=5, same=True, parts=", "), Column("verdict"), Column("reason", "right", omit_empty=True)]


def _p(x) -> str:
    """A p-value in two significant digits, the exponent bare (``3.1e-5``)."""
    if x is None or not np.isfinite(x):
        return ""
    return f"{x:.2g}" if x >= 1e-3 else render.sci(x)


def print_table(df: pd.DataFrame, summary: dict, base: Path | str, new: Path | str,
                threshold: float, alpha: float, console=None, max_same: int = 40,
                width: int | None = None) -> None:
    """The verdicts as a table fitted to ``width`` columns (None: every column; module doc), the
    counts, the pairing and one line per regression or improvement. ``base`` and ``new`` name
    the two sides in the title (``BASE → NEW``)."""
    from rich.text import Text

    console = console or render.console(width)
    colors = {"slower": "red", "broken": "bold red", "faster": "green", "same": "",
              "incomparable": "yellow", "same-row": "magenta"}
    shown = df
    hidden = 0
    if len(df) > max_same + 20:
        same = df[df["verdict"] == "same"]
        hidden = max(0, len(same) - max_same)
        shown = df.drop(same.index[max_same:])
    recs = shown.to_dict("records")
    labels = [str(r["layout"] or r["point_key"]) for r in recs]
    cells = render.layout_cells([(lab, r.get("num_seqs"), r.get("total_tokens"))
                                 for lab, r in zip(labels, recs)])
    reasons: dict[str, int] = {}
    rows = []
    for cell, r in zip(cells, recs):
        ci = f"{_fmt(r['ratio_lo'], '.3f')}–{_fmt(r['ratio_hi'], '.3f')}" \
            if r["ratio_lo"] is not None and np.isfinite(r["ratio_lo"]) else ""
        why = str(r["reason"] or "")
        note = str(reasons.setdefault(why, len(reasons) + 1)) if why else ""
        rows.append([str(r["model"] or ""), str(r["tp"] or ""), cell, r["backend"],
                     r["direction"], _fmt(r["base_ms"], ".4f"), _fmt(r["new_ms"], ".4f"),
                     _fmt(r["ratio"], ".3f"), ci, _p(r["p_value"]), _calls(r),
                     str(r["pairing"] or ""), Text(r["verdict"], style=colors[r["verdict"]]),
                     note])
    render.table(console, columns(alpha), rows, width, what="row",
                 title=f"{base} → {new} (threshold {threshold:.0%}, alpha {alpha:g})")
    for why, k in reasons.items():
        render.line(console, f"reason {k}: {why}", width)
    for note in render.layout_notes(cells, labels):
        render.line(console, f"layout {note}", width)
    if hidden:
        render.line(console, f"({hidden} more rows 'same' not shown; --out FILE writes every row)",
                    width)
    extra = [f"{summary['only_base']} keys only in base"] if summary["only_base"] else []
    extra += [f"{summary['only_new']} only in new"] if summary["only_new"] else []
    render.line(console, ", ".join(f"{summary[v]} {v}" for v in VERDICTS)
                + (f" ({', '.join(extra)})" if extra else ""), width)
    render.line(console, f"pairing of the {summary['pairs']} ratios: {summary['pairing']}", width)
    if summary["differs_pairs"]:
        render.line(console, f"incomparable: {differs_line(summary, len(df))}", width)
    for line in version_changes(df):
        render.line(console, line, width)
    for r in df[df["verdict"].isin(["slower", "broken", "faster"])].to_dict("records"):
        what = (f"{r['ratio']:.3f}x (p={r['p_value']:.2g})" if r["verdict"] != "broken"
                else f"broken: {r['reason']}")
        tag = f" [{r['pairing']}]" if r["verdict"] != "broken" and r["pairing"] else ""
        word = "IMPROVEMENT" if r["verdict"] == "faster" else "REGRESSION"
        render.line(console, f"{word} {row_label(r)}: {what}{tag}", width)


def version_changes(df: pd.DataFrame) -> list[str]:
    """One line per backend label whose version differs between the pairs' base and new rows
    (``version LABEL: OLD → NEW (n pairs)``): a ratio across them measures the library's change
    too, which a reader of a regression must see."""
    if df.empty or "base_version" not in df:
        return []
    d = df[df["base_version"].notna() & df["new_version"].notna() & (df["base_version"] != df["new_version"])]
    return [f"version {label}: {a} → {b} ({len(g)} pairs)"
            for (label, a, b), g in d.groupby(["backend", "base_version", "new_version"], sort=True)]


def _calls(r: Mapping) -> str:
    """``calls_per_sample`` of the pair: one number, or ``base→new`` when it changed."""
    a, b = r.get("base_calls_per_sample"), r.get("new_calls_per_sample")
    a, b = (None if x is None or (isinstance(x, float) and not np.isfinite(x)) else int(x)
            for x in (a, b))
    if a is None and b is None:
        return ""
    if a is None or b is None or a == b:
        return str(b if b is not None else a)
    return f"{a}→{b}"


def write_out(df: pd.DataFrame, summary: dict, out: Path, base: Path, new: Path, threshold: float,
              alpha: float) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.suffix.lower() == ".csv":
        df.to_csv(out, index=False)
        return
    recs = json.loads(df.to_json(orient="records"))  # NaN -> null, numpy -> python
    out.write_text(json.dumps({"base": str(base), "new": str(new), "threshold": threshold,
                               "alpha": alpha, "summary": summary, "rows": recs}, indent=1))


def newest_run(df: pd.DataFrame) -> pd.DataFrame:
    """The rows of ``df``'s newest run (its campaign, where the run was one shard of one): the
    run of the row started last."""
    if df.empty or "started_at" not in df or "run_id" not in df:
        return df
    started = pd.to_datetime(df["started_at"], errors="coerce", utc=True)
    if not started.notna().any():
        return df
    last = df.loc[started.idxmax()]
    camp = last.get("campaign_id") if "campaign_id" in df else None
    if isinstance(camp, str) and camp:
        return df[df["campaign_id"] == camp]
    return df[df["run_id"] == last["run_id"]]


def missing_labels(base: pd.DataFrame, new: pd.DataFrame) -> list[str]:
    """Backend labels of ``base`` that ``new`` holds no row of at all, although ``new`` measured
    some of their points and directions with other labels (two runs of different labels, not a
    label that broke)."""
    have = set(new["backend"].dropna())
    measured = set(zip(new["point_key"], new["direction"]))
    return [label for label, g in base.groupby("backend", sort=True)
            if label not in have and not measured.isdisjoint(zip(g["point_key"], g["direction"]))]


def compare_cmd(base: Path, new: Path, threshold: float = 0.05, alpha: float = 0.01,
                out: Path | None = None, base_backend: str | None = None,
                new_backend: str | None = None, allow_incomparable: bool = False,
                wide: bool = False) -> int:
    """``qlabench compare BASE NEW`` (or ``BASE --base-backend A --new-backend B``: two labels):
    table on stdout fitted to the terminal (``wide``: every column), optional ``--out``
    (.json/.csv), an exit code (module doc). ``allow_incomparable``: pairs whose rows differ in
    timing method, GPU or input recipe stay ``incomparable`` (not judged) without exit 3; the
    exit code is that of the other pairs."""
    from rich.console import Console

    width = render.terminal_width(wide)
    console = render.console(width)
    err = Console(stderr=True, soft_wrap=True)
    notes: list[str] = []
    try:
        if out is not None and Path(out).suffix.lower() not in (".json", ".csv"):
            raise BadInput(f"{out}: --out must end in .json or .csv")
        analysis.check_tie_rule(alpha, threshold)
        bdf, ndf = load_side(Path(base), notes), load_side(Path(new), notes)
        if "gate_recipe" in bdf and "gate_recipe" in ndf \
                and pd.concat([bdf["gate_recipe"], ndf["gate_recipe"]]).nunique() > 1:
            bdf, ndf = analysis.by_recipe(bdf, always=True), analysis.by_recipe(ndf, always=True)
        for opt, side, df_, label in (("--base-backend", base, bdf, base_backend),
                                      ("--new-backend", new, ndf, new_backend)):
            if label is not None and not (df_["backend"] == label).any():
                raise BadInput(f"{opt}: no rows of backend {label!r} in {side} (its labels: "
                               f"{', '.join(sorted(set(df_['backend'].dropna())))})")
        if base_backend is None:
            # a baseline that keeps every earlier run (CI's history): a label its newest run no
            # longer measures was dropped from the sweep, and is compared no more
            retired = missing_labels(bdf, newest_run(bdf))
            if retired:
                bdf = bdf[~bdf["backend"].isin(retired)]
                notes.append(f"{base}: label{'s' * (len(retired) > 1)} "
                             f"{', '.join(map(repr, retired))} not in its newest run, not compared")
            miss = missing_labels(bdf, ndf)
            if miss:
                theirs = ", ".join(sorted(set(ndf["backend"].dropna())))
                raise BadInput(
                    f"backend label{'s' * (len(miss) > 1)} {', '.join(map(repr, miss))} of "
                    f"{base} {'have' if len(miss) > 1 else 'has'} no rows in {new} (its labels: "
                    f"{theirs}); to pair two labels pass --base-backend {miss[0]} --new-backend "
                    "LABEL")
        df, summary = compare_frames(bdf, ndf, threshold, alpha, base_backend, new_backend)
        base_arg, new_arg = base, new
        if base_backend is not None:
            base, new = f"{base} ({base_backend})", f"{new} ({new_backend})"
        if df.empty:
            raise BadInput(f"{new}: nothing in common with {base} (no shared point × backend × "
                           "direction key; are they the same config?)")
    except BadInput as e:
        err.print(f"error: {analysis.with_notes(e, notes)}", highlight=False, markup=False)
        return 2
    both = f"{base_arg}: {base_backend}", str(new_backend)  # two labels of one directory
    names = both if base_backend is not None and Path(base_arg) == Path(new_arg) else (base, new)
    if summary["same-row"] == len(df):
        if out is not None:
            write_out(df, summary, Path(out), base, new, threshold, alpha)
        err.print(f"error: every one of the {len(df)} compared pairs is the same stored row on "
                  f"both sides ({new} holds {base}'s rows): nothing was re-measured, so this says "
                  "nothing about repeatability" + (f" (the pairs: {out})" if out is not None else ""),
                  highlight=False, markup=False)
        return 2
    for n in dict.fromkeys(notes):  # one note per path (BASE and NEW may be one directory)
        render.line(console, f"note: {n}", width)
    print_table(df, summary, *names, threshold, alpha, console=console, width=width)
    if out is not None:
        write_out(df, summary, Path(out), base, new, threshold, alpha)
        render.line(console, f"wrote {out}", width)
    failed = summary["slower"] + summary["broken"]
    if summary["differs_pairs"] and not allow_incomparable:
        also = f"; besides, {failed} pairs are slower or broken" if failed else ""
        err.print(f"error: {differs_line(summary, len(df))}{also}. Their ratios measure that "
                  "change, not the code: measure NEW like BASE, or pass --allow-incomparable to "
                  "judge the other pairs only", highlight=False, markup=False)
        return 3
    return 1 if failed else 0

