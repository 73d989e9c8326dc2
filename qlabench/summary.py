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
  winner vs baseline ("" when both rows share GPU and campaign; else ``cross-GPU``,
  ``cross-campaign``, ``throttled``).

**Tie rule** (:func:`qlabench.analysis.is_tie`): the two sample lists are distinguishable only when the median
ratio exceeds ``1 + threshold`` (a practical floor, 1% by default) **and** a two-sided
Mann–Whitney U test on them gives p < ``alpha`` (0.01) — the same two gates as
:mod:`qlabench.compare`. Everything else is a tie, including pairs with too few samples for the
test to ever reach ``alpha`` (:func:`qlabench.analysis.min_two_sided_p`): what cannot be told apart
is reported as such, not as a win.

Per model (and direction) a footer (:func:`qlabench.analysis.model_footer`): for each label, the geomean speedup over
the baseline on the points where both are ``ok``, the points it wins and how many of those wins
are ties.
"""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from . import analysis
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


def print_summary(df: pd.DataFrame, console=None, baseline: str = BASELINE,
                  alpha: float = ALPHA, threshold: float = THRESHOLD) -> pd.DataFrame:
    """Print one table per model and direction (plus its footer) for latest rows ``df``;
    returns the :func:`point_table`."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console(soft_wrap=True, width=200)
    table = point_table(df, baseline, alpha, threshold)
    base = resolve_baseline(df, baseline)
    bname = base or baseline
    for (direction, hq, hv, model), t in table.groupby(["direction", "h_qk", "h_v", "model"],
                                                       sort=False, dropna=False):
        tab = Table(title=f"{model} ({hq}/{hv}) {direction}: fastest correct backend per layout "
                    f"(tie: not distinguishable, Mann–Whitney p ≥ {alpha:g} or ≤ {threshold:.0%})")
        for c, j in (("layout", "left"), ("winner", "left"), ("ms", "right"),
                     ("p10–p90 ms", "right"), ("runner-up", "left"), ("ms ", "right"),
                     ("margin", "right"), ("tie", "left"), (f"× {bname}", "right"),
                     ("max_rel_l2", "right"), ("ok", "right"), ("bad", "left"),
                     ("pairing", "left")):
            tab.add_column(c, justify=j)
        for r in t.to_dict("records"):
            bad = ", ".join(w for w in (f"{r['n_incorrect']} incorrect" if r["n_incorrect"] else "",
                                        f"{r['n_failed']} failed" if r["n_failed"] else "") if w)
            tags = [f"vs runner-up: {_s(r['pairing'])}" if _s(r["pairing"]) else "",
                    f"vs {bname}: {_s(r['baseline_pairing'])}" if _s(r["baseline_pairing"]) else ""]
            if _missing(r["winner"]):
                tab.add_row(_s(r["layout"]), "[red]no ok row[/red]", "", "", "", "", "", "", "",
                            "", f"0/{r['n_backends']}", bad, "")
                continue
            p10, p90 = _f(r["winner_p10_ms"], ".4f"), _f(r["winner_p90_ms"], ".4f")
            tab.add_row(_s(r["layout"]), _s(r["winner"]), _f(r["winner_ms"], ".4f"),
                        f"{p10}–{p90}" if p10 and p90 else "",
                        _s(r["runner_up"]), _f(r["runner_up_ms"], ".4f"),
                        _f(r["margin"], ".3f", "×"),
                        "[yellow]tie[/yellow]" if r["tie"] else "",
                        _f(r["speedup"], ".2f", "×"),
                        _f(r["winner_max_rel_l2"], ".1e"), f"{r['n_ok']}/{r['n_backends']}", bad,
                        "; ".join(x for x in tags if x))
        console.print(tab)
        rows = df[(df["model"] == model) & (df["direction"] == direction)]
        foot = model_footer(rows, t, base)
        parts = []
        for f in foot.to_dict("records"):
            gm = _f(f["geomean_speedup"], ".2f", "×")
            sp = f"{gm} over {bname} ({f['points']} pts)" if gm and f["backend"] != base else ""
            w = f"{f['wins']} win{'s' * (f['wins'] != 1)}" + (f" ({f['tied_wins']} tie)" if f["tied_wins"] else "")
            parts.append(f"{f['backend']}: " + ", ".join(x for x in (sp, w) if x))
        console.print(f"{model} ({hq}/{hv}) {direction}, {len(t)} points — " + "; ".join(parts),
                      highlight=False, markup=False)
        if base is None:
            console.print(f"(no rows of baseline {baseline!r}: speedups left blank)",
                          highlight=False, markup=False)
    return table


def load_latest(path: Path) -> pd.DataFrame:
    """Latest rows of a results directory; :class:`BadInput` when missing or empty."""
    from .compare import load_side
    return analysis.newest(load_side(Path(path)))


def summary_cmd(path: Path, model: str | None = None, direction: str | None = None,
                baseline: str | None = None, alpha: float = ALPHA, threshold: float = THRESHOLD,
                console=None) -> int:
    """``qlabench summary DIR``: tables on stdout; exit 2 (message on stderr) on bad input,
    including a ``baseline`` label without rows (None: ``fla`` when present, else no speedups)."""
    import sys

    from rich.console import Console

    console = console or Console(soft_wrap=True, width=None if sys.stdout.isatty() else 200)
    err = Console(stderr=True, soft_wrap=True)
    try:
        df = load_latest(path)
        if baseline is not None:  # a label asked for must have rows (the default may lack them)
            require_baseline(df, baseline)
        if direction is not None:
            have = sorted(set(df["direction"].dropna()))
            if direction not in have:
                raise BadInput(f"--direction {direction!r}: {path} has rows for {', '.join(have)}")
            df = df[df["direction"] == direction]
        if model is not None:
            df = select_model(df, model)
        if not (df["status"] == "ok").any():
            raise BadInput(f"{path}: no ok rows to summarise (statuses: "
                           f"{', '.join(f'{k} {v}' for k, v in df['status'].value_counts().items())})")
    except BadInput as e:
        err.print(f"error: {e}", highlight=False, markup=False)
        return 2
    print_summary(df, console, baseline or BASELINE, alpha, threshold)
    return 0


def print_run_summary(df: pd.DataFrame, console=None) -> None:
    """The end of ``qlabench run``: :func:`print_summary` over the output directory's latest rows,
    or one line when none of them is ``ok``."""
    import sys

    from rich.console import Console

    console = console or Console(soft_wrap=True, width=None if sys.stdout.isatty() else 200)
    if df.empty or not (df["status"] == "ok").any():
        console.print("summary: no ok rows (nothing to rank)", highlight=False, markup=False)
        return
    print_summary(df, console)
