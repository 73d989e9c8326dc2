"""Figures from stored rows. Each backend's colour comes from the backend registry
(:func:`qlabench.backends.colors`), so drawing imports ``qlabench.backends`` (and torch with it);
no library a backend wraps is imported."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from . import analysis, render, results  # noqa: E402


def palette(df: pd.DataFrame) -> dict[str, str | None]:
    """Backend label -> colour, in the registry's order (:func:`qlabench.backends.colors`, by
    ``backend_name``; a library's plain label first): a library's first label gets its class's
    ``color``, further labels of it (``flashinfer@0.7.4`` beside ``flashinfer``) lighter and
    darker shades of it."""
    from matplotlib.colors import to_hex, to_rgb

    from . import backends
    lib = dict(zip(df["backend"], results.backend_names(df))) if len(df) else {}
    colors = backends.colors()
    libs = list(colors)
    order = sorted(lib, key=lambda b: (libs.index(lib[b]) if lib[b] in libs else len(libs),
                                       lib[b], b != lib[b], b))
    out: dict = {}
    seen: dict = {}
    for b in order:
        k = seen[lib[b]] = seen.get(lib[b], -1) + 1
        c = colors.get(lib[b])
        if c is not None and k:
            to, t = (1.0 if k % 2 else 0.0), min(0.8, 0.4 * ((k + 1) // 2))  # odd: lighter
            c = to_hex([x + (to - x) * t for x in to_rgb(c)])
        out[b] = c
    return out


#: figures of a results directory live in this subfolder (:data:`qlabench.results.FIGURES_DIR`):
#: pyarrow's dataset discovery (so ``pd.read_parquet(results_dir)``) skips names starting with
#: ``_`` and tries to read any other file as Parquet
FIGURES_DIR = results.FIGURES_DIR
#: every figure is at most this wide ...
MAX_WIDTH_PX = 2000
#: ... drawn at this resolution ...
DPI = 100
#: ... with no text smaller than this (points; 8 pt at 100 dpi is 11 px)
MIN_FONT_PT = 8.0
#: PNG text keys written into every figure (read back with PIL: ``Image.open(p).text``)
META_DPI, META_MIN_FONT = "qlabench:dpi", "qlabench:min_font_pt"


def figures_dir(results_dir: str | Path) -> Path:
    """Where the figures of a results directory go: ``<results_dir>/_figures``."""
    return Path(results_dir) / FIGURES_DIR


def sort_layouts(df: pd.DataFrame, by_model: bool = True) -> pd.DataFrame:
    """:func:`qlabench.analysis.sort_layouts`: ``df`` sorted by model (when ``by_model``), then
    layout, then backend (:func:`palette` order)."""
    if df.empty:
        return df
    order = list(palette(df)) if "backend" in df else None
    return analysis.sort_layouts(df, by_model, order)


def _panel_label(sub: pd.DataFrame, m: str) -> str:
    r = sub.iloc[0]
    return f"{m} (h_qk={r['h_qk']}, h_v={r['h_v']})" if "h_qk" in sub else str(m)


def layout_ticks(rows: pd.DataFrame, layouts: list[str]) -> list[str]:
    """Axis labels for ``layouts`` (values of ``rows['layout']``): the labels the terminal tables
    show (:func:`qlabench.render.layout_cells`: one longer than
    :data:`qlabench.render.LAYOUT_MAX` characters reads as ``<count>x~<mean length>``)."""
    first = rows.drop_duplicates("layout").set_index("layout")
    if not {"num_seqs", "total_tokens"} <= set(first.columns):
        return [str(lab) for lab in layouts]
    return render.layout_cells([(lab, first.at[lab, "num_seqs"], first.at[lab, "total_tokens"])
                                for lab in layouts])


def _grid(n_panels: int, n_groups: int, n_bars: int, bar_px: float = 14.0,
          panel_h_in: float = 3.0, extra_h_in: float = 0.9) -> tuple[int, int, tuple]:
    """(ncol, nrow, figsize) for panels of ``n_groups`` groups of ``n_bars`` bars: as many
    columns as fit in :data:`MAX_WIDTH_PX` at ``bar_px`` per bar (at most 3)."""
    group_px = n_bars * bar_px + 22
    panel_px = n_groups * group_px + 120
    ncol = int(max(1, min(3, n_panels, MAX_WIDTH_PX // max(panel_px, 1))))
    nrow = int(np.ceil(n_panels / ncol))
    w_px = min(MAX_WIDTH_PX, max(720, ncol * panel_px))
    return ncol, nrow, (w_px / DPI, panel_h_in * nrow + extra_h_in)


def _bars(ok: pd.DataFrame, m: str) -> pd.DataFrame:
    return ok[ok["model"] == m]


def latency_figure(df: pd.DataFrame, out: str | Path, direction: str | None = None,
                   title: str = "") -> Path | None:
    """Grouped bars: one panel per model/TP, one group per layout (:func:`qlabench.analysis.layout_order`), one
    bar per backend label (:func:`palette`), bar = median latency, whisker = p10..p90 of the
    samples; log latency axis."""
    ok = _ok(df, direction)
    if ok.empty:
        return None
    models = analysis.model_order(ok)
    colors = palette(ok)
    backends = list(colors)
    n_groups = max(len(analysis.layout_order(_bars(ok, m))) for m in models)
    ncol, nrow, size = _grid(len(models), n_groups, len(backends))
    fig, axes = plt.subplots(nrow, ncol, figsize=size, squeeze=False, layout="constrained")
    for ax, m in zip(axes.flat, models):
        sub = _bars(ok, m)
        layouts = analysis.layout_order(sub)
        x = np.arange(len(layouts))
        w = 0.8 / max(1, len(backends))
        for i, b in enumerate(backends):
            med, lo, hi = _per_layout(sub[sub["backend"] == b], layouts)
            ax.bar(x + (i - (len(backends) - 1) / 2) * w, med, w, label=b, color=colors[b],
                   yerr=[np.maximum(med - lo, 0), np.maximum(hi - med, 0)],
                   error_kw={"elinewidth": 0.8, "capsize": 1.5, "ecolor": "#333333"})
        ax.set_yscale("log")
        ax.set_title(_panel_label(sub, m), fontsize=10)
        ax.set_xticks(x, layout_ticks(sub, layouts), rotation=45, fontsize=8, ha="right",
                      rotation_mode="anchor")
        ax.tick_params(axis="y", labelsize=8)
        ax.set_xlim(-0.6, len(layouts) - 0.4)
        ax.set_ylabel("latency (ms, log)", fontsize=9)
        ax.grid(axis="y", alpha=0.3, which="both")
    for ax in list(axes.flat)[len(models):]:
        ax.axis("off")
    _legend(fig, axes.flat[0], len(backends))
    gpu = ok["gpu_name"].iloc[0]
    modes = ",".join(sorted(set(ok["timing_mode"].dropna())))
    _title(fig, title or f"GDN {direction or ''} latency on {gpu} (timing: {modes}); "
                 "bar: median, whisker: p10..p90 of the samples", fontsize=11)
    return _save(fig, out)


def _per_layout(rows: pd.DataFrame, layouts: list[str]) -> tuple[np.ndarray, ...]:
    """(median, p10, p90) latency per layout of ``rows`` (NaN where absent; p10/p90 fall back
    to the median on rows without them)."""
    r = rows.drop_duplicates("layout", keep="last").set_index("layout").reindex(layouts)
    med = r["latency_ms"].to_numpy(float)
    lo, hi = analysis.quantile_cols(r) if len(r) else (med, med)
    return med, np.where(np.isfinite(med), lo, np.nan), np.where(np.isfinite(med), hi, np.nan)


def _title(fig, text: str, fontsize: float = 10) -> None:
    """``fig.suptitle`` with each line wrapped to the figure's width (never cut at the edges)."""
    import textwrap
    per_char_px = fontsize * DPI / 72 * 0.56
    width = max(20, int(fig.get_size_inches()[0] * DPI * 0.96 / per_char_px))
    lines = [ln2 for ln in text.split("\n") for ln2 in (textwrap.wrap(ln, width) or [""])]
    fig.suptitle("\n".join(lines), fontsize=fontsize)


def _legend(fig, ax, n: int) -> None:
    """One legend for the figure, below the panels."""
    hs, ls = ax.get_legend_handles_labels()
    if hs:
        fig.legend(hs, ls, loc="outside lower center", ncol=min(n, 6), fontsize=9, frameon=False)


def run_figures(df: pd.DataFrame, out_dir: str | Path, run_id: str | None = None,
                baseline: str = analysis.BASELINE, metas: dict | None = None,
                fig_dir: str | Path | None = None,
                an: analysis.Analysis | None = None) -> list[Path]:
    """Every figure a run's rows support, written to ``fig_dir`` (default
    :func:`figures_dir` of ``out_dir``, the results directory), per direction: ``winner_<dir>``
    (the winner map), ``speedup_<dir>`` (speedup over ``baseline`` per model, with whiskers),
    ``latency_<dir>`` (grouped latency bars), ``roofline_<dir>``, ``sm_util_<dir>``; and
    ``latency_vs_tokens_bwd`` (backward latency vs total tokens). Derived roofline columns are
    recomputed with the measured ceilings of ``metas`` (default: ``out_dir``'s run metadata).
    Winners and speedups come from ``an``, the :class:`qlabench.analysis.Analysis` of these rows
    over ``baseline`` (made here when not given), computed once for every figure."""
    from . import metrics
    made = []
    sub = df if run_id is None else df[df["run_id"] == run_id]
    out_dir = Path(out_dir)
    fdir = Path(fig_dir) if fig_dir is not None else figures_dir(out_dir)
    if metas is None:
        metas = results.load_meta(out_dir) if out_dir.is_dir() else {}
    if not sub.empty and "gpu_name" in sub:
        gpu = sub[sub["gpu_name"] != "cpu"]
        if not gpu.empty:
            sub = pd.concat([sub[sub["gpu_name"] == "cpu"], metrics.add_derived(gpu, None, metas)])
    if an is None:
        an = analysis.Analysis(sub, baseline)
    for d in ("fwd", "bwd", "fwdbwd"):
        if (sub["direction"] == d).any():
            made.append(winner_map(sub, fdir / f"winner_{d}.png", d, baseline, an=an))
            made.append(speedup_figure(sub, fdir / f"speedup_{d}.png", baseline, d, an=an))
            made.append(latency_figure(sub, fdir / f"latency_{d}.png", d))
            made.append(roofline_figure(sub, fdir / f"roofline_{d}.png", d, metas=metas))
            made.append(util_vs_latency(sub, fdir / f"sm_util_{d}.png", d))
    if (sub["direction"] == "bwd").any():
        made.append(latency_vs_tokens(sub, fdir / "latency_vs_tokens_bwd.png", "bwd"))
    return [p for p in made if p]


def _ok(df: pd.DataFrame, direction: str | None) -> pd.DataFrame:
    """ok rows with a latency (of ``direction``); when they hold several gate recipes, ``model``
    reads ``<model> [<recipe>]`` (:func:`qlabench.analysis.by_recipe`) so that every figure
    draws each recipe apart."""
    ok = df[(df["status"] == "ok") & df["latency_ms"].notna()]
    ok = ok[ok["direction"] == direction] if direction else ok
    return analysis.by_recipe(ok)


def _backends(df: pd.DataFrame) -> list[str]:
    """The backend labels of ``df`` in :func:`palette` order."""
    return list(palette(df))


def _save(fig, out: str | Path) -> Path:
    """Write ``fig`` at :data:`DPI`, at most :data:`MAX_WIDTH_PX` wide (a wider figure is
    narrowed), every text at least :data:`MIN_FONT_PT` (smaller ones are raised to it); the PNG
    records both (:data:`META_DPI`, :data:`META_MIN_FONT`). The figure is drawn once: its layout
    engine runs in that draw (``savefig`` would draw it twice, once to lay it out), and the
    pixels go to the PNG as ``savefig`` writes them (:func:`matplotlib.image.imsave`)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.image import imsave
    from matplotlib.text import Text
    w, h = fig.get_size_inches()
    if w * DPI > MAX_WIDTH_PX:
        fig.set_size_inches(MAX_WIDTH_PX / DPI, h)
    # every text made so far (tick labels not yet made take rcParams' sizes, 10 pt by default)
    texts = [t for t in fig.findobj(Text) if t.get_visible() and t.get_text().strip()]
    for t in texts:
        if t.get_fontsize() < MIN_FONT_PT:
            t.set_fontsize(MIN_FONT_PT)
    smallest = min((t.get_fontsize() for t in texts), default=MIN_FONT_PT)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.set_dpi(DPI)
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    imsave(out, canvas.buffer_rgba(), format="png", origin="upper", dpi=DPI,
           metadata={META_DPI: str(DPI), META_MIN_FONT: f"{smallest:g}"})
    plt.close(fig)
    return out


SPEEDUP_COLUMNS = ["model", "tp", "h_qk", "h_v", "layout", "num_seqs", "total_tokens", "seqlens",
                   "point_index", "point_key", "backend", "backend_name",
                   "speedup", "speedup_lo", "speedup_hi", *analysis.PAIR_FIELDS]
#: marks a number whose two rows are not known to share GPU and campaign, include a throttled row
#: or were timed by different methods
PAIR_MARK = "*"


def speedup_table(df: pd.DataFrame, baseline: str = analysis.BASELINE, direction: str = "fwd",
                  an: analysis.Analysis | None = None) -> pd.DataFrame:
    """Long table of :func:`qlabench.analysis.speedups` (baseline latency / backend latency per
    point and backend; > 1: the backend is faster than the baseline) over the ok rows of
    ``direction`` among the newest row per key (:func:`qlabench.analysis.newest`), with the pair's
    :func:`qlabench.analysis.pairing` columns (``pairing`` = "" when both rows share GPU and
    campaign and neither is throttled). ``speedup_lo`` .. ``speedup_hi`` bound it conservatively
    from both rows' sample spread: baseline p10 / backend p90 .. baseline p90 / backend p10 (a
    row without p10/p90 contributes its median). ``an``: the :class:`qlabench.analysis.Analysis`
    of ``df`` over ``baseline`` (made here when not given), whose speedups these are."""
    an = _analysis(df, baseline, an)
    ok = _ok(an.rows, direction)
    if ok.empty or analysis.resolve_baseline(ok, baseline) is None:
        return pd.DataFrame(columns=SPEEDUP_COLUMNS)
    sp = an.speedups[an.speedups.index.isin(ok.index)]
    other = ok.loc[sp.index]
    out = other[[c for c in SPEEDUP_COLUMNS[:11] if c in other.columns]].copy()
    out["backend_name"] = results.backend_names(other)
    out = out.join(sp.drop(columns="baseline_ms"))
    out = out.dropna(subset=["speedup"]).reindex(columns=SPEEDUP_COLUMNS)
    return sort_layouts(out).reset_index(drop=True)


def _analysis(df: pd.DataFrame, baseline: str,
              an: analysis.Analysis | None) -> analysis.Analysis:
    """``an`` (the analysis of ``df`` a caller computed once), else the analysis of ``df``."""
    if an is None:
        return analysis.Analysis(df, baseline)
    if an.baseline != baseline:
        raise ValueError(f"an analysis over {an.baseline!r} given for a figure over {baseline!r}")
    return an


def _pair_note(labels: list[str]) -> str:
    return f"{PAIR_MARK}: rows not known to share GPU, campaign and timing method, or throttled" \
        if any(labels) else ""


def speedup_figure(df: pd.DataFrame, out: str | Path, baseline: str = analysis.BASELINE,
                   direction: str = "fwd", title: str = "",
                   an: analysis.Analysis | None = None) -> Path | None:
    """Speedup over ``baseline`` per model, in the style of FlashQLA's README figure: one panel
    per model/TP, one group of bars per layout (:func:`qlabench.analysis.layout_order`), one bar per backend label
    (:func:`palette`: the labels of one library share its colour family), bar =
    ``baseline`` median / backend median with its value on top, whisker = ``speedup_lo`` ..
    ``speedup_hi`` of :func:`speedup_table` (baseline p10 / backend p90 .. baseline p90 / backend
    p10); a line at 1 (= the baseline). A value whose two rows are not known to share GPU and
    campaign, or has a throttled row, carries :data:`PAIR_MARK`. ``an``: as in
    :func:`speedup_table`."""
    sp = speedup_table(df, baseline, direction, an)
    if sp.empty:
        return None
    models = analysis.model_order(sp)
    colors = palette(sp)
    backends = list(colors)
    n_groups = max(len(analysis.layout_order(sp[sp["model"] == m])) for m in models)
    ncol, nrow, size = _grid(len(models), n_groups, len(backends), bar_px=20.0,
                             panel_h_in=3.1, extra_h_in=1.1)
    fig, axes = plt.subplots(nrow, ncol, figsize=size, squeeze=False, layout="constrained")
    bar_px = size[0] * DPI / ncol / max(1, n_groups) * 0.8 / max(1, len(backends))
    values = bar_px >= 12  # room for a rotated 8 pt number on each bar
    top = float(np.nanmax(sp["speedup_hi"].clip(upper=sp["speedup"].max() * 1.5)))
    for ax, m in zip(axes.flat, models):
        sub = sp[sp["model"] == m]
        layouts = analysis.layout_order(sub)
        x = np.arange(len(layouts))
        w = 0.8 / max(1, len(backends))
        for i, b in enumerate(backends):
            sb = sub[sub["backend"] == b].set_index("layout")
            v = sb["speedup"].reindex(layouts).to_numpy(float)
            lo = sb["speedup_lo"].reindex(layouts).to_numpy(float)
            hi = sb["speedup_hi"].reindex(layouts).to_numpy(float)
            tag = sb["pairing"].reindex(layouts).fillna("").to_numpy()
            xs = x + (i - (len(backends) - 1) / 2) * w
            ax.bar(xs, v, w, label=b, color=colors[b],
                   yerr=[np.maximum(v - lo, 0), np.maximum(hi - v, 0)],
                   error_kw={"elinewidth": 0.8, "capsize": 1.5, "ecolor": "#333333"})
            if values:
                for xx, vv, hh, t in zip(xs, v, hi, tag):
                    if np.isfinite(vv):
                        ax.text(xx, max(vv, hh if np.isfinite(hh) else vv) + top * 0.02,
                                f"{vv:.2f}" + (PAIR_MARK if t else ""), rotation=90,
                                ha="center", va="bottom", fontsize=8)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_ylim(0, top * (1.32 if values else 1.08))
        ax.set_xlim(-0.6, len(layouts) - 0.4)
        ax.set_title(_panel_label(sub, m), fontsize=10)
        ax.set_xticks(x, layout_ticks(sub, layouts), rotation=45, fontsize=8, ha="right",
                      rotation_mode="anchor")
        ax.tick_params(axis="y", labelsize=8)
        ax.set_ylabel(f"speedup over {baseline} (×)", fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    for ax in list(axes.flat)[len(models):]:
        ax.axis("off")
    _legend(fig, axes.flat[0], len(backends))
    ok = _ok(df, direction)
    gpu = ok["gpu_name"].iloc[0] if len(ok) else ""
    note = _pair_note(list(sp["pairing"]))
    _title(fig, title or f"GDN {direction} speedup over {baseline} on {gpu} ({analysis.pairing_label(sp)})"
                 f"\nbar: {baseline} median / backend median (> 1: faster than {baseline}); "
                 f"whisker: {baseline} p10 / backend p90 .. {baseline} p90 / backend p10"
                 + (f"\n{note}" if note else ""), fontsize=10)
    return _save(fig, out)


def winner_map(df: pd.DataFrame, out: str | Path, direction: str = "fwd", baseline: str = analysis.BASELINE,
               title: str = "", an: analysis.Analysis | None = None) -> Path | None:
    """Winner map: rows layouts (:func:`qlabench.analysis.layout_order`, top to bottom), columns models
    (:func:`qlabench.analysis.model_order`); each cell coloured by the fastest ``ok`` backend label
    (:meth:`qlabench.analysis.Analysis.points` of ``an``, the analysis of ``df`` over ``baseline``,
    made here when not given; colours of :func:`palette`), with the label and the margin over the
    runner-up (``+12%``) printed; a hatched cell: a tie with the runner-up (not told apart by
    the stored samples: :func:`qlabench.analysis.is_tie`); grey: no ok row."""
    from matplotlib.colors import to_rgb
    from matplotlib.patches import Patch, Rectangle
    w = _analysis(df, baseline, an).points(direction)
    w = w[w["winner"].notna()] if len(w) else w
    if w.empty:
        return None
    models = analysis.model_order(w)
    layouts = analysis.layout_order(w)
    colors = palette(_ok(df, direction))
    cell_w = min(2.0, max(1.15, (MAX_WIDTH_PX / DPI - 2.0) / max(1, len(models))))
    fig_w = min(MAX_WIDTH_PX / DPI, 2.0 + cell_w * len(models))
    fig_h = 1.9 + 0.36 * len(layouts)
    fig, ax = plt.subplots(figsize=(max(fig_w, 6.0), fig_h), layout="constrained")
    cells = w.set_index(["model", "layout"])
    for j, m in enumerate(models):
        for i, lay in enumerate(layouts):
            key = (m, lay)
            if key not in cells.index:
                ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, color="#eeeeee", lw=0))
                continue
            r = cells.loc[key]
            r = r.iloc[0] if isinstance(r, pd.DataFrame) else r
            c = colors.get(r["winner"]) or "#999999"
            ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, facecolor=c, edgecolor="white",
                                   lw=1.0, hatch="///" if bool(r["tie"]) else None))
            lum = np.dot(to_rgb(c), [0.299, 0.587, 0.114])
            fg = "black" if lum > 0.55 else "white"
            pct = (float(r["margin"]) - 1) * 100 if r["margin"] is not None else np.nan
            mg = "" if not np.isfinite(pct) else f" +{pct:.1f}%" if pct < 10 else f" +{pct:.0f}%"
            ax.text(j, i, f"{r['winner']}{mg}", ha="center", va="center", fontsize=8, color=fg)
    ax.set_xlim(-0.5, len(models) - 0.5)
    ax.set_ylim(len(layouts) - 0.5, -0.5)
    tps = w.drop_duplicates("model").set_index("model")["tp"]
    ax.set_xticks(range(len(models)), [f"{m}\n({tps.get(m)})" for m in models], fontsize=8)
    ax.xaxis.tick_top()
    ax.set_yticks(range(len(layouts)), layout_ticks(w, layouts), fontsize=8)
    ax.set_ylabel("layout (sequences, then tokens)", fontsize=9)
    for sp_ in ax.spines.values():
        sp_.set_visible(False)
    ax.tick_params(length=0)
    won = [b for b in colors if b in set(w["winner"])]
    handles = [Patch(facecolor=colors[b] or "#999999", label=b) for b in won]
    handles.append(Patch(facecolor="white", edgecolor="#555555", hatch="///",
                         label="tie with the runner-up (samples)"))
    fig.legend(handles=handles, loc="outside lower center", ncol=min(len(handles), 5),
               fontsize=8, frameon=False)
    ok = _ok(df, direction)
    gpu = ok["gpu_name"].iloc[0] if len(ok) else ""
    _title(fig, title or f"GDN {direction} winner per point on {gpu}: fastest ok backend, "
                 "+margin = runner-up median / winner median - 1", fontsize=10)
    return _save(fig, out)


def speedup_heatmap(df: pd.DataFrame, out: str | Path, baseline: str = analysis.BASELINE,
                    direction: str = "fwd", title: str = "") -> Path | None:
    """Heatmap per backend (panels stacked): rows model (h_qk/h_v), columns layout
    (:func:`qlabench.analysis.layout_order`), cell = baseline latency /
    backend latency (green: faster than the baseline, red: slower; colour on a log scale). A cell
    whose two rows are not known to share GPU and campaign, or has a throttled row, carries
    :data:`PAIR_MARK`; each panel's title gives ``analysis.pairing_label`` over its cells."""
    sp = speedup_table(df, baseline, direction)
    if sp.empty:
        return None
    rows = [(m, sp.loc[sp["model"] == m, "tp"].iloc[0]) for m in analysis.model_order(sp)]
    cols = analysis.layout_order(sp)
    backends = _backends(sp)
    lim = float(np.nanmax(np.abs(np.log2(sp["speedup"].clip(1e-3))))) or 1.0
    lim = min(max(lim, 0.25), 3.0)
    w = min(MAX_WIDTH_PX / DPI, max(6.0, 0.6 * len(cols) + 3.5))
    h = max(2.4, 0.32 * len(rows) + 1.6)
    fig, axes = plt.subplots(len(backends), 1, figsize=(w, h * len(backends) + 0.8),
                             squeeze=False, layout="constrained")
    im = None
    for ax, b in zip(axes.flat, backends):
        sb = sp[sp["backend"] == b]
        sub = sb.set_index(["model", "tp", "layout"])["speedup"]
        tags = sb.set_index(["model", "tp", "layout"])["pairing"]
        grid = np.full((len(rows), len(cols)), np.nan)
        mark = np.full((len(rows), len(cols)), "", dtype=object)
        for i, (m, t) in enumerate(rows):
            for j, lay in enumerate(cols):
                v = sub.get((m, t, lay))
                if v is not None and np.isfinite(v):
                    grid[i, j] = v
                    mark[i, j] = PAIR_MARK if tags.get((m, t, lay)) else ""
        cmap = plt.get_cmap("RdYlGn").with_extremes(bad="#dddddd")
        im = ax.imshow(np.log2(grid), cmap=cmap, vmin=-lim, vmax=lim, aspect="auto")
        for i in range(len(rows)):
            for j in range(len(cols)):
                if np.isfinite(grid[i, j]):
                    ax.text(j, i, f"{grid[i, j]:.2f}{mark[i, j]}", ha="center", va="center",
                            fontsize=8)
        ax.set_xticks(range(len(cols)), layout_ticks(sp, cols), rotation=45, ha="right",
                      fontsize=8, rotation_mode="anchor")
        ax.set_yticks(range(len(rows)), [f"{m} ({t})" for m, t in rows], fontsize=8)
        ax.set_title(f"{b} vs {baseline} — {analysis.pairing_label(sb)}", fontsize=9)
    if im is not None:
        cb = fig.colorbar(im, ax=list(axes.flat), shrink=0.6)
        ticks = sorted({t for t in (-3, -2, -1, -0.5, 0, 0.5, 1, 2, 3) if abs(t) < lim - 0.1}
                       | {-lim, lim})
        cb.set_ticks(ticks, labels=[f"{2 ** t:.2g}x" for t in ticks])
        cb.set_label(f"speedup over {baseline}", fontsize=9)
        cb.ax.tick_params(labelsize=8)
    ok = _ok(df, direction)
    gpu = ok["gpu_name"].iloc[0] if len(ok) else ""
    note = _pair_note(list(sp["pairing"]))
    _title(fig, title or f"GDN {direction} speedup over {baseline} on {gpu}"
                 + (f"\n{note}" if note else ""), fontsize=10)
    return _save(fig, out)


def latency_vs_tokens(df: pd.DataFrame, out: str | Path, direction: str = "bwd",
                      title: str = "") -> Path | None:
    """Latency vs total tokens (log–log): one panel per model (h_qk/h_v), a line per backend
    through the median over layouts of equal token count, each layout a marker (shape: number of
    sequences)."""
    ok = _ok(df, direction)
    if ok.empty:
        return None
    panels = [(m, ok.loc[ok["model"] == m, "tp"].iloc[0]) for m in analysis.model_order(ok)]
    colors = palette(ok)
    backends = list(colors)
    markers = ["o", "s", "^", "D", "v", "P", "X", "*"]
    nseqs = sorted(set(int(n) for n in ok["num_seqs"].dropna())) or [1]
    ncol = min(4, len(panels))
    nrow = int(np.ceil(len(panels) / ncol))
    fig, axes = plt.subplots(nrow, ncol, figsize=(4.4 * ncol, 3.4 * nrow + 0.5), squeeze=False,
                             layout="constrained")
    for ax, (m, t) in zip(axes.flat, panels):
        sub = ok[(ok["model"] == m) & (ok["tp"] == t)]
        for b in backends:
            sb = sub[sub["backend"] == b]
            if sb.empty:
                continue
            c = colors[b]
            med = sb.groupby("total_tokens")["latency_ms"].median()
            ax.plot(med.index, med.values, "-", color=c, label=b, lw=1.4)
            for k, n in enumerate(nseqs):
                sn = sb[sb["num_seqs"] == n]
                if len(sn):
                    ax.scatter(sn["total_tokens"], sn["latency_ms"], s=14, color=c,
                               marker=markers[k % len(markers)], alpha=0.8, zorder=3)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{m} ({t})", fontsize=9)
        ax.set_xlabel("total tokens")
        ax.set_ylabel("latency (ms)")
        ax.grid(alpha=0.3, which="both")
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    for k, n in enumerate(nseqs):
        handles.append(plt.Line2D([], [], ls="", marker=markers[k % len(markers)], color="k"))
        labels.append(f"{n} seq")
    axes.flat[0].legend(handles, labels, fontsize=8)
    gpu = ok["gpu_name"].iloc[0]
    modes = ",".join(sorted(set(ok["timing_mode"].dropna())))
    _title(fig, title or f"GDN {direction} latency vs tokens on {gpu} (timing: {modes})",
           fontsize=10)
    return _save(fig, out)


def history_figure(hist: pd.DataFrame, out: str | Path, title: str = "") -> Path | None:
    """Latency across runs: one panel per (direction, backend), a line per point, each point's
    latency relative to its first measurement; regressions (verdict ``slower`` vs the previous
    measurement of that key) marked with red triangles, ``faster`` with green ones.

    ``hist`` columns: run_pos (x position), run_label, point_key, layout, model, backend,
    direction, latency_ms, verdict (vs the previous measurement; may be empty)."""
    h = hist[hist["latency_ms"].notna()]
    if h.empty or h["run_pos"].nunique() < 2:
        return None
    dirs = ["fwd", "bwd", "fwdbwd"]
    colors = palette(h)
    order = list(colors)
    panels = sorted(set(zip(h["direction"], h["backend"])),
                    key=lambda p: (dirs.index(p[0]) if p[0] in dirs else 9, order.index(p[1])))
    labels = h.drop_duplicates("run_pos").sort_values("run_pos")
    panel_w = min(MAX_WIDTH_PX / DPI, max(5.0, 0.55 * len(labels) + 2))
    ncol = int(max(1, min(3, len(panels), MAX_WIDTH_PX / DPI // panel_w)))
    nrow = int(np.ceil(len(panels) / ncol))
    fig, axes = plt.subplots(nrow, ncol, figsize=(panel_w * ncol, 3.3 * nrow + 0.5),
                             squeeze=False, layout="constrained")
    lines = h[["direction", "backend", "point_key", "run_pos", "latency_ms", "verdict"]]
    for ax, (d, b) in zip(axes.flat, panels):
        sub = lines[(lines["direction"] == d) & (lines["backend"] == b)]
        c = colors[b] or "#333333"
        for _, g in sub.groupby("point_key", sort=False):
            g = g.sort_values("run_pos")
            x = g["run_pos"].to_numpy()
            lat = g["latency_ms"].to_numpy(float)
            rel = lat / lat[0]
            verdict = g["verdict"].to_numpy()
            ax.plot(x, rel, "-o", color=c, alpha=0.45, lw=0.9, ms=2.5)
            for v, mk, col in (("slower", "v", "red"), ("faster", "^", "green")):
                sel = verdict == v
                if sel.any():
                    ax.scatter(x[sel], rel[sel], marker=mk, s=40, color=col, zorder=4, label=v)
        ax.axhline(1.0, color="k", lw=0.6)
        ax.set_xticks(labels["run_pos"], labels["run_label"], rotation=45, ha="right", fontsize=8,
                      rotation_mode="anchor")
        ax.set_title(f"{b} {d}", fontsize=9)
        ax.set_ylabel("latency / first run")
        ax.grid(alpha=0.3)
        hs, ls = ax.get_legend_handles_labels()
        if hs:
            uniq = dict(zip(ls, hs))
            ax.legend(uniq.values(), uniq.keys(), fontsize=8)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    _title(fig, title or "latency history (one line per point)", fontsize=10)
    return _save(fig, out)


def roofline_figure(df: pd.DataFrame, out: str | Path, direction: str | None = None,
                    ceilings: dict | None = None, metas: dict | None = None) -> Path | None:
    """Achieved TFLOP/s vs arithmetic intensity (FLOP per minimum byte), one marker per backend
    and point, under the roof min(peak, bandwidth × intensity). Derived columns are recomputed
    from stored ones (``metrics.add_derived``), so old runs plot too."""
    from . import metrics
    ok = _ok(df, direction)
    ok = ok[ok["gpu_name"] != "cpu"] if "gpu_name" in ok else ok
    if ok.empty:
        return None
    ok = metrics.add_derived(ok, ceilings, metas)
    c = ceilings or {}
    if not c and metas:  # the roof: the measured ceilings of these rows' runs (median over runs)
        runs = [metrics.run_ceilings(metas, r, g) for r, g in
                ok[["run_id", "gpu_name"]].drop_duplicates().itertuples(index=False)]
        c = metrics.median_ceilings([r for r in runs if r])
    peak = c.get("matmul_tflops") or metrics.H200_PEAK_TFLOPS
    bw = c.get("copy_gbps") or metrics.H200_PEAK_GBPS
    fig, ax = plt.subplots(figsize=(7.5, 5), layout="constrained")
    x = np.logspace(np.log10(max(1.0, ok["intensity_flop_per_byte"].min() / 2)),
                    np.log10(ok["intensity_flop_per_byte"].max() * 2), 100)
    ax.plot(x, np.minimum(peak, bw * x / 1e3), "k-", lw=1.2,
            label=f"roof: {peak:.0f} TFLOP/s, {bw / 1e3:.2f} TB/s")
    for b, c in palette(ok).items():
        s = ok[ok["backend"] == b]
        ax.scatter(s["intensity_flop_per_byte"], s["tflops"], s=18, alpha=0.75, color=c, label=b)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP / minimum byte)")
    ax.set_ylabel("achieved TFLOP/s (FLA-algebra FLOPs)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    ax.set_title(f"GDN {direction or ''} roofline on {ok['gpu_name'].iloc[0]}", fontsize=10)
    return _save(fig, out)


def util_vs_latency(df: pd.DataFrame, out: str | Path, direction: str | None = None) -> Path | None:
    """SM utilisation (NVML GPM) vs latency, one panel per model: grid fill vs per-CTA work."""
    ok = _ok(df, direction)
    ok = ok[ok["sm_util_pct"].notna()] if "sm_util_pct" in ok else ok.iloc[0:0]
    if ok.empty:
        return None
    models = analysis.model_order(ok)
    ncol = min(3, len(models))
    nrow = int(np.ceil(len(models) / ncol))
    fig, axes = plt.subplots(nrow, ncol, figsize=(5 * ncol, 3.6 * nrow), squeeze=False,
                             layout="constrained")
    for ax, m in zip(axes.flat, models):
        sub = ok[ok["model"] == m]
        for b, c in palette(sub).items():
            s = sub[sub["backend"] == b]
            ax.scatter(s["latency_ms"], s["sm_util_pct"], s=20, color=c, label=b)
        ax.set_xscale("log")
        ax.set_xlabel("latency (ms)")
        ax.set_ylabel("SM util (%)")
        ax.set_ylim(0, 105)
        ax.set_title(f"{m} ({sub.iloc[0]['h_qk']}/{sub.iloc[0]['h_v']})", fontsize=9)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(models):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=8)
    return _save(fig, out)


def reproduce_figure(table: pd.DataFrame, out: str | Path, baseline: str, target: str,
                     title: str, extra: str = "tilelang", within: float = 0.10,
                     extra_baseline: str = analysis.BASELINE) -> Path:
    """Published vs measured speedup (``baseline`` / ``target``) per point of a reproduction
    table (:func:`qlabench.reproduce.side_by_side`: ``model``, ``speedup_pub``, ``speedup_ms``,
    ``<extra>_vs_<extra_baseline>``, ``<backend>_status``), one colour per model, the ``extra``
    backend's ``extra_baseline`` / ``extra`` as crosses, y = x and a ±``within`` band; each line of ``title`` wrapped to
    the figure's width."""
    import textwrap

    fig, ax = plt.subplots(figsize=(7.2, 6.4), layout="constrained")
    models = list(dict.fromkeys(table["model"]))
    cmap = plt.get_cmap("tab10")
    both = table[np.isfinite(table["speedup_ms"])]
    for i, m in enumerate(models):
        sub = both[both["model"] == m]
        if not sub.empty:
            ax.scatter(sub["speedup_pub"], sub["speedup_ms"], s=22, color=cmap(i % 10), label=m,
                       edgecolor="black", linewidth=0.3)
    ex = f"{extra}_vs_{extra_baseline}"
    if ex in table and np.isfinite(table[ex]).any():
        e = table[np.isfinite(table[ex])]
        ax.scatter(e["speedup_pub"], e[ex], s=22, marker="x", color="#9467bd",
                   label=f"{extra} ({extra_baseline}/{extra}, measured)")
    lo = 0.9 * float(np.nanmin(np.r_[table["speedup_pub"], both["speedup_ms"], 1.0]))
    hi = 1.1 * float(np.nanmax(np.r_[table["speedup_pub"], both["speedup_ms"],
                                     table[ex] if ex in table else [], 1.0]))
    xs = np.linspace(lo, hi, 50)
    ax.plot(xs, xs, color="black", lw=1, label="y = x")
    ax.fill_between(xs, xs * (1 - within), xs * (1 + within), color="grey", alpha=0.15,
                    label=f"±{within:.0%}")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    lab = f"{baseline} / {target}"
    ax.set_xlabel(f"published speedup ({lab})")
    ax.set_ylabel(f"measured speedup ({lab})")
    ax.set_title("\n".join(w for ln in title.split("\n") for w in textwrap.wrap(ln, 80)),
                 fontsize=9)
    if both.empty:
        ax.text(0.5, 0.5, "no measured speedups\n(" + ", ".join(
            sorted({s for b in (baseline, target) for s in table[f"{b}_status"]} - {"ok"}))
            + ")", transform=ax.transAxes, ha="center", va="center", color="grey")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    return _save(fig, out)
