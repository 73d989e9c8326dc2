"""Who wins each point, by how much, and is it correct: ``qlabench summary DIR`` and the table at
the end of ``qlabench run``.

Input: :func:`qlabench.analysis.newest` rows (one per point × backend label × direction). Per point
(model, h_qk/h_v, layout, direction) — :func:`qlabench.analysis.point_table`:

- ``winner``: the backend label with the lowest median latency (``latency_ms``) among the rows
  with status ``ok`` (checked against the reference before timing); ``winner_ms``,
  ``winner_p10_ms`` / ``winner_p90_ms`` its median and p10–p90 over the stored per-call samples;
- ``runner_up`` / ``runner_up_ms``: the second-fastest ``ok`` label; ``margin`` = runner-up ms /
  winner ms (≥ 1);
- ``tie``: the winner and runner-up are not distinguishable within the noise (:func:`qlabench.analysis.is_tie`);
- ``speedup``: baseline ms / winner ms (baseline: a label, FLA by default; blank when the baseline
  has no ``ok`` row at that point);
- correctness: ``winner_max_rel_l2`` and ``n_incorrect`` / ``n_failed`` (statuses ``incorrect``
  and ``crashed`` / ``timeout`` / ``oom``) over the point's labels; ``n_ok`` of ``n_backends``;
- ``pairing`` / ``baseline_pairing``: :func:`qlabench.analysis.pair_tag` of winner vs runner-up and
  winner vs baseline ("" when both rows share GPU, campaign and timing method; else
  ``cross-GPU``, ``cross-campaign``, ``throttled``, ``cross-method``).

**Tie rule** (:func:`qlabench.analysis.is_tie`): the two sample lists are distinguishable only when the median
ratio exceeds ``1 + threshold`` (a practical floor, 1% by default) **and** a two-sided
Mann–Whitney U test on them gives p < ``alpha`` (0.01) — the same two gates as
:mod:`qlabench.compare`. Everything else is a tie, including pairs with too few samples for the
test to ever reach ``alpha`` (:func:`qlabench.analysis.min_two_sided_p`): what cannot be told apart
is reported as such, not as a win.

Per model (and direction) a footer (:func:`qlabench.analysis.model_footer`): for each label, the geomean speedup over
the baseline on the points where both are ``ok``, the points it wins and how many of those wins
are ties.

On the terminal (:func:`print_summary`, :mod:`qlabench.render`) a table per model and direction:
layout, winner, ms, spread ((p90 − p10) / median of the winner's samples), runner-up, margin,
tie, × baseline, rel_l2, ok, bad (:func:`columns`: the order columns are left out in a narrow
terminal); under it the layouts whose pairs are tagged (``pairing: vs runner-up, throttled:
1x32768, ...``), the full label of each layout shortened in the table, the footer; once at the
end, what each column holds.
"""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from . import analysis, render
from .analysis import (  # noqa: F401 (the summary's names, kept for callers)
    ALPHA,
    BASELINE,
    FAILED,
    POINT,
    THRESHOLD,
    BadInput,
    is_tie,
    model_footer,
    point_table,
    require_baseline,
    resolve_baseline,
)
from .render import Column


def select_model(df: pd.DataFrame, model: str) -> pd.DataFrame:
    """Rows of ``model``: a model name (``397B/122B TP1``) or ``h_qk/h_v`` (``16/64``).
    :class:`BadInput` naming the known ones otherwise."""
    m = model.strip()
    hit = df["model"].astype(str) == m
    if not hit.any():
        heads = df["h_qk"].astype("Int64").astype(str) + "/" + df["h_v"].astype("Int64").astype(str)
        hit = heads == m.replace(" ", "")
    if not hit.any():
        known = (df[["model", "h_qk", "h_v"]].drop_duplicates().sort_values(["h_qk", "h_v"]))
        names = ", ".join(f"{r.model} ({r.h_qk}/{r.h_v})" for r in known.itertuples())
        raise BadInput(f"--model {model!r}: no such model in these rows; known: {names}")
    return df[hit]


def _missing(x) -> bool:
    """A table cell without a value: None, NaN or pandas' NA (a str column of pandas >= 3 holds
    NaN where the records held None)."""
    return x is None or x is pd.NA or (isinstance(x, float) and math.isnan(x))


def _f(x, spec: str, suffix: str = "") -> str:
    """``x`` formatted with ``spec`` plus ``suffix``; "" when missing or not finite."""
    if _missing(x) or (isinstance(x, float) and not math.isfinite(x)):
        return ""
    return format(x, spec) + suffix


def _s(x) -> str:
    """A label cell: "" when missing."""
    return "" if _missing(x) else str(x)


def columns(bname: str) -> list[Column]:
    """The summary table's columns. ``drop``: the order they are left out when the terminal is
    narrower than the table (rel_l2, spread, ok, × baseline, runner-up, margin); layout, winner,
    ms, tie and bad are always shown. ``ok`` with the same count at every layout is stated once
    under the table; ``bad`` is shown when some point has an incorrect or failed row."""
    return [Column("layout"), Column("winner"), Column("ms", "right"),
            Column("spread", "right", drop=2), Column("runner-up", drop=5),
            Column("margin", "right", drop=6), Column("tie"),
            Column(f"× {bname}", "right", drop=4), Column("rel_l2", "right", drop=1),
            Column("ok", "right", drop=3, same=True), Column("bad", same=True)]


def legend(bname: str, alpha: float, threshold: float) -> str:
    """What the summary table's columns hold, printed once under the tables."""
    return (f"ms: the winner's median latency; spread: (p90 − p10) / median of its samples; "
            f"margin: runner-up ms / winner ms; tie: not distinguishable (Mann–Whitney "
            f"p ≥ {alpha:g} or margin ≤ {threshold:.0%}); × {bname}: {bname} ms / winner ms; "
            "rel_l2: the winner's largest ‖out − ref‖ / ‖ref‖; ok: labels with an ok row; bad: "
            "incorrect or failed rows; pairing: rows not sharing GPU, campaign or timing method, or "
            "throttled"
            + ("; best-library: per point the fastest ok row of a library backend"
               if bname == analysis.BEST_LIBRARY else ""))


def _spread(r) -> str:
    lo, hi, med = r["winner_p10_ms"], r["winner_p90_ms"], r["winner_ms"]
    if any(_missing(x) for x in (lo, hi, med)) or not med > 0:
        return ""
    return _f(100 * (hi - lo) / med, ".1f", "%")


def print_summary(df: pd.DataFrame, console=None, baseline: str = BASELINE,
                  alpha: float = ALPHA, threshold: float = THRESHOLD,
                  width: int | None = None) -> pd.DataFrame:
    """Print one table per model and direction (plus its footer) for latest rows ``df``, fitted
    to ``width`` columns (None: every column at its natural width; :mod:`qlabench.render`);
    returns the :func:`point_table`."""
    from rich.text import Text

    console = console or render.console(width)
    table = point_table(df, baseline, alpha, threshold)
    base = resolve_baseline(df, baseline)
    bname = base or baseline
    cols = columns(bname)
    for (direction, hq, hv, model), t in table.groupby(["direction", "h_qk", "h_v", "model"],
                                                       sort=False, dropna=False):
        recs = t.to_dict("records")
        cells = render.layout_cells([(r["layout"], r["num_seqs"], r["total_tokens"]) for r in recs])
        rows, tags = [], {}
        for cell, r in zip(cells, recs):
            bad = ", ".join(w for w in (f"{r['n_incorrect']} incorrect" if r["n_incorrect"] else "",
                                        f"{r['n_failed']} failed" if r["n_failed"] else "") if w)
            for which, tag in (("runner-up", _s(r["pairing"])), (bname, _s(r["baseline_pairing"]))):
                if tag:
                    tags.setdefault((which, tag), []).append(cell)
            ok = f"{r['n_ok']}/{r['n_backends']}"
            if _missing(r["winner"]):
                rows.append([cell, Text("no ok row", style="red"), "", "", "", "", "", "", "",
                             ok, bad])
                continue
            rows.append([cell, _s(r["winner"]), _f(r["winner_ms"], ".4f"), _spread(r),
                         _s(r["runner_up"]), _f(r["margin"], ".2f", "×"),
                         Text("tie", style="yellow") if r["tie"] else "",
                         _f(r["speedup"], ".2f", "×"),
                         "" if _missing(r["winner_max_rel_l2"]) else render.sci(r["winner_max_rel_l2"]),
                         ok, bad])
        render.table(console, cols, rows, width, what="layout",
                     title=f"{model} ({hq}/{hv}) {direction}: fastest correct backend per layout")
        if tags:
            render.line(console, "pairing: " + "; ".join(
                f"vs {which}, {tag}: {', '.join(c)}" for (which, tag), c in tags.items()), width)
        for note in render.layout_notes(cells, [r["layout"] for r in recs]):
            render.line(console, f"layout {note}", width)
        rows_m = df[(df["model"] == model) & (df["direction"] == direction)]
        render.line(console, f"{model} ({hq}/{hv}) {direction}, {len(t)} points — "
                    + _footer(model_footer(rows_m, t, base), base, bname), width)
        if base is None:
            render.line(console, f"(no rows of baseline {baseline!r}: speedups left blank)", width)
    for direction, t in table.groupby("direction", sort=False):
        n_models = t["model"].nunique()
        if n_models > 1:  # the whole run of that direction: every point counts once
            foot = model_footer(df[df["direction"] == direction], t, base)
            render.line(console, f"all {n_models} models, {direction}, {len(t)} points — "
                        + _footer(foot, base, bname), width, style="bold")
    if len(table):
        render.line(console, legend(bname, alpha, threshold), width, style="dim")
    return table


def _footer(foot: pd.DataFrame, base: str | None, bname: str) -> str:
    """One footer line's body: per label its geomean speedup over the baseline and its wins."""
    parts = []
    for f in foot.to_dict("records"):
        gm = _f(f["geomean_speedup"], ".2f", "×")
        sp = f"{gm} over {bname} ({f['points']} pts)" if gm and f["backend"] != base else ""
        w = f"{f['wins']} win{'s' * (f['wins'] != 1)}" + (f" ({f['tied_wins']} tie)" if f["tied_wins"] else "")
        parts.append(f"{f['backend']}: " + ", ".join(x for x in (sp, w) if x))
    return "; ".join(parts)


def load_latest(path: Path, notes: list[str] | None = None) -> pd.DataFrame:
    """Latest rows of a results directory (:func:`qlabench.compare.load_side`: the rows it sets
    aside noted in ``notes``); :class:`BadInput` when missing or empty."""
    from .compare import load_side
    return analysis.newest(load_side(Path(path), notes))


def summary_cmd(path: Path, model: str | None = None, direction: str | None = None,
                baseline: str | None = None, alpha: float = ALPHA, threshold: float = THRESHOLD,
                console=None, wide: bool = False) -> int:
    """``qlabench summary DIR``: tables on stdout, fitted to the terminal
    (:func:`qlabench.render.terminal_width`; ``wide``: every column); exit 2 (message on stderr)
    on bad input, including a ``baseline`` label without rows (None: ``fla`` when present, else
    no speedups)."""
    from rich.console import Console

    width = render.terminal_width(wide)
    console = console or render.console(width)
    err = Console(stderr=True, soft_wrap=True)
    notes: list[str] = []
    try:
        df = load_latest(path, notes)
        if baseline is not None:  # a label asked for must have rows (the default may lack them)
            require_baseline(df, baseline)
        if direction is not None:
            have = sorted(set(df["direction"].dropna()))
            if direction not in have:
                raise BadInput(f"--direction {direction!r}: {path} has rows for {', '.join(have)}")
            df = df[df["direction"] == direction]
        if model is not None:
            df = select_model(df, model)
        df = analysis.by_recipe(df)
        if not (df["status"] == "ok").any():
            raise BadInput(f"{path}: no ok rows to summarise (statuses: "
                           f"{', '.join(f'{k} {v}' for k, v in df['status'].value_counts().items())})")
    except BadInput as e:
        err.print(f"error: {analysis.with_notes(e, notes)}", highlight=False, markup=False)
        return 2
    for n in notes:
        render.line(console, f"note: {n}", width)
    print_summary(df, console, baseline or BASELINE, alpha, threshold, width)
    return 0


def print_run_summary(df: pd.DataFrame, console=None) -> None:
    """The end of ``qlabench run``: :func:`print_summary` over the output directory's latest rows
    (fitted to the terminal), or one line when none of them is ``ok``."""
    width = render.terminal_width()
    console = console or render.console(width)
    if df.empty or not (df["status"] == "ok").any():
        console.print("summary: no ok rows (nothing to rank)", highlight=False, markup=False)
        return
    print_summary(df, console, width=width)
