"""Figures from stored rows only (never imports backends)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

BACKEND_COLORS = {"reference": "#7f7f7f", "fla": "#1f77b4", "flashinfer": "#2ca02c",
                  "flashqla": "#d62728", "tilelang": "#9467bd", "faulty": "#8c564b"}


def palette(df: pd.DataFrame) -> dict[str, str | None]:
    """Backend label -> colour, in :data:`BACKEND_COLORS`' library order (by ``backend_name``;
    a library's plain label first): a library's first label gets its colour, further labels
    of it (``flashinfer@0.7.4`` beside ``flashinfer``) lighter and darker shades of it."""
    from matplotlib.colors import to_hex, to_rgb

    from . import results
    lib = dict(zip(df["backend"], results.backend_names(df))) if len(df) else {}
    libs = list(BACKEND_COLORS)
    order = sorted(lib, key=lambda b: (libs.index(lib[b]) if lib[b] in libs else len(libs),
                                       lib[b], b != lib[b], b))
    out: dict = {}
    seen: dict = {}
    for b in order:
        k = seen[lib[b]] = seen.get(lib[b], -1) + 1
        c = BACKEND_COLORS.get(lib[b])
        if c is not None and k:
            to, t = (1.0 if k % 2 else 0.0), min(0.8, 0.4 * ((k + 1) // 2))  # odd: lighter
            c = to_hex([x + (to - x) * t for x in to_rgb(c)])
        out[b] = c
    return out


def latency_figure(df: pd.DataFrame, out: str | Path, direction: str | None = None,
                   title: str = "") -> Path | None:
    """Grouped bars: one panel per model/TP, one group per layout, one bar per backend; the
    fastest ok backend's speedup over FLA labelled above each group (:data:`PAIR_MARK` when
    the two rows are not known to share GPU and campaign, or one is throttled; the title gives
    ``results.pairing_label`` over the labels)."""
    from . import results
    ok = _ok(df, direction)
    if ok.empty:
        return None
    models = list(dict.fromkeys(ok.sort_values("point_index")["model"]))
    colors = palette(ok)
    backends = list(colors)
    ncol = min(3, len(models))
    nrow = int(np.ceil(len(models) / ncol))
    fig, axes = plt.subplots(nrow, ncol, figsize=(6.5 * ncol, 3.6 * nrow), squeeze=False)
    pairs: list[dict] = []
    for ax, m in zip(axes.flat, models):
        sub = ok[ok["model"] == m]
        layouts = list(dict.fromkeys(sub.sort_values("point_index")["layout"]))
        x = np.arange(len(layouts))
        w = 0.8 / max(1, len(backends))
        for i, b in enumerate(backends):
            vals = [sub[(sub["layout"] == lay) & (sub["backend"] == b)]["latency_ms"].median()
                    for lay in layouts]
            ax.bar(x + (i - (len(backends) - 1) / 2) * w, vals, w, label=b, color=colors[b])
        base = "fla" if "fla" in backends else None
        if base and len(backends) > 1:
            for j, lay in enumerate(layouts):
                at = sub[sub["layout"] == lay]
                b_rows, others = at[at["backend"] == base], at[at["backend"] != base]
                if len(b_rows) and len(others):
                    rb = b_rows.iloc[-1]
                    best = others.loc[others["latency_ms"].idxmin()]
                    if best["latency_ms"] > 0:
                        pr = results.pair(rb.to_dict(), best.to_dict())
                        pairs.append(pr)
                        ax.text(x[j], at["latency_ms"].max() * 1.02,
                                f"{rb['latency_ms'] / best['latency_ms']:.2f}x"
                                + (PAIR_MARK if pr["pairing"] else ""), ha="center", fontsize=7)
            ax.set_ylim(top=sub["latency_ms"].max() * 1.12)  # room for the labels
        hq, hv = sub.iloc[0]["h_qk"], sub.iloc[0]["h_v"]
        ax.set_title(f"{m} (h_qk={hq}, h_v={hv})", fontsize=9)
        ax.set_xticks(x, layouts, rotation=60, fontsize=7, ha="right")
        ax.set_ylabel("latency (ms)")
        ax.grid(axis="y", alpha=0.3)
    for ax in list(axes.flat)[len(models):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    gpu = ok["gpu_name"].iloc[0]
    modes = ",".join(sorted(set(ok["timing_mode"].dropna())))
    note = "; labels: FLA / fastest other" if "fla" in backends and len(backends) > 1 else ""
    if pairs:
        pp = pd.DataFrame(pairs)
        note += f"\nlabels' pairs: {results.pairing_label(pp)}"
        note += f" ({_pair_note(list(pp['pairing']))})" if pp["pairing"].any() else ""
    fig.suptitle(title or f"GDN {direction or ''} latency on {gpu} (timing: {modes}){note}",
                 fontsize=11)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def run_figures(df: pd.DataFrame, out_dir: str | Path, run_id: str | None = None,
                baseline: str = "fla", metas: dict | None = None) -> list[Path]:
    """Every figure a run's rows support: ``latency_<dir>.png`` (grouped bars),
    ``speedup_<dir>.png`` (heatmap vs ``baseline`` when it and another backend have ok rows),
    ``latency_vs_tokens_bwd.png`` (backward latency vs total tokens). Derived roofline columns
    are recomputed with the measured ceilings of ``metas`` (default: ``out_dir``'s run metadata)."""
    from . import metrics, results
    made = []
    sub = df if run_id is None else df[df["run_id"] == run_id]
    out_dir = Path(out_dir)
    if metas is None:
        metas = results.load_meta(out_dir) if out_dir.is_dir() else {}
    if not sub.empty and "gpu_name" in sub:
        gpu = sub[sub["gpu_name"] != "cpu"]
        if not gpu.empty:
            sub = pd.concat([sub[sub["gpu_name"] == "cpu"], metrics.add_derived(gpu, None, metas)])
    for d in ("fwd", "bwd", "fwdbwd"):
        if (sub["direction"] == d).any():
            made.append(latency_figure(sub, out_dir / f"latency_{d}.png", d))
            made.append(speedup_heatmap(sub, out_dir / f"speedup_{d}.png", baseline, d))
            made.append(roofline_figure(sub, out_dir / f"roofline_{d}.png", d, metas=metas))
            made.append(util_vs_latency(sub, out_dir / f"sm_util_{d}.png", d))
    if (sub["direction"] == "bwd").any():
        made.append(latency_vs_tokens(sub, out_dir / "latency_vs_tokens_bwd.png", "bwd"))
    return [p for p in made if p]


def _ok(df: pd.DataFrame, direction: str | None) -> pd.DataFrame:
    """ok rows with a latency (of ``direction``); when they hold several gate recipes, ``model``
    reads ``<model> [<recipe>]`` so that every figure draws each recipe apart."""
    ok = df[(df["status"] == "ok") & df["latency_ms"].notna()]
    ok = ok[ok["direction"] == direction] if direction else ok
    if "gate_recipe" in ok and ok["gate_recipe"].nunique() > 1:
        name = ok["gate_recipe"].map(recipe_name)
        ok = ok.assign(model=[f"{m} [{r}]" for m, r in zip(ok["model"], name)])
    return ok


def recipe_name(gate_recipe) -> str:
    """``strong-decay:...`` -> ``strong-decay``; the published recipe (``zero0.25/seed0``) ->
    ``published``."""
    s = str(gate_recipe)
    return s.split(":", 1)[0] if ":" in s else "published"


def _backends(df: pd.DataFrame) -> list[str]:
    """The backend labels of ``df`` in :func:`palette` order."""
    return list(palette(df))


def _save(fig, out: str | Path) -> Path:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


SPEEDUP_COLUMNS = ["model", "tp", "layout", "point_index", "point_key", "backend", "backend_name",
                   "speedup", "pairing", "same_gpu", "same_campaign", "throttled", "gpu_known",
                   "campaign_known"]
#: marks a number whose two rows are not known to share GPU and campaign, or include a throttled row
PAIR_MARK = "*"


def speedup_table(df: pd.DataFrame, baseline: str = "fla", direction: str = "fwd") -> pd.DataFrame:
    """Long table of baseline latency / backend latency per point and backend (> 1: the backend is
    faster than the baseline), from the latest ok row per key (``results.latest``), with the
    pair's ``results.pairing`` columns (``pairing`` = "" when both rows share GPU and campaign
    and neither is throttled)."""
    from . import results
    ok = _ok(df, direction)
    if ok.empty or baseline not in set(ok["backend"]):
        return pd.DataFrame(columns=SPEEDUP_COLUMNS)
    ok = results.latest(ok) if {"started_at", "run_id"} <= set(ok.columns) else \
        ok.drop_duplicates(results.KEY, keep="last")
    base = ok[ok["backend"] == baseline].set_index("point_key")
    other = ok[(ok["backend"] != baseline) & ok["point_key"].isin(base.index)]
    b = base.loc[other["point_key"]].set_axis(other.index)
    out = other[["model", "tp", "layout", "point_index", "point_key", "backend"]].copy()
    out["backend_name"] = results.backend_names(other)
    out["speedup"] = b["latency_ms"].to_numpy() / other["latency_ms"].to_numpy()
    out = out.join(results.pairing(b, other))
    return out.dropna(subset=["speedup"])[SPEEDUP_COLUMNS].reset_index(drop=True)


def _pair_note(labels: list[str]) -> str:
    return f"{PAIR_MARK}: rows not known to share GPU and campaign, or throttled" \
        if any(labels) else ""


def speedup_heatmap(df: pd.DataFrame, out: str | Path, baseline: str = "fla",
                    direction: str = "fwd", title: str = "") -> Path | None:
    """Heatmap per backend: rows model (h_qk/h_v), columns layout, cell = baseline latency /
    backend latency (green: faster than the baseline, red: slower; colour on a log scale). A cell
    whose two rows are not known to share GPU and campaign, or has a throttled row, carries
    :data:`PAIR_MARK`; each panel's title gives ``results.pairing_label`` over its cells."""
    from . import results
    sp = speedup_table(df, baseline, direction)
    if sp.empty:
        return None
    sp = sp.sort_values("point_index", kind="stable")
    rows = list(dict.fromkeys(zip(sp["model"], sp["tp"])))
    cols = list(dict.fromkeys(sp["layout"]))
    backends = _backends(sp)
    lim = float(np.nanmax(np.abs(np.log2(sp["speedup"].clip(1e-3))))) or 1.0
    lim = min(max(lim, 0.25), 3.0)
    w = max(4.0, 0.55 * len(cols) + 2.5)
    h = max(2.2, 0.38 * len(rows) + 1.4)
    fig, axes = plt.subplots(1, len(backends), figsize=(w * len(backends) + 1.5, h + 0.8),
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
                            fontsize=6.5)
        ax.set_xticks(range(len(cols)), cols, rotation=60, ha="right", fontsize=7)
        ax.set_yticks(range(len(rows)), [f"{m} ({t})" for m, t in rows] if ax is axes.flat[0]
                      else [], fontsize=7)
        ax.set_title(f"{b} vs {baseline}\n{results.pairing_label(sb)}", fontsize=8)
    if im is not None:
        cb = fig.colorbar(im, ax=list(axes.flat), shrink=0.9)
        ticks = sorted({t for t in (-3, -2, -1, -0.5, 0, 0.5, 1, 2, 3) if abs(t) < lim - 0.1}
                       | {-lim, lim})
        cb.set_ticks(ticks, labels=[f"{2 ** t:.2g}x" for t in ticks])
        cb.set_label(f"speedup over {baseline}", fontsize=8)
    ok = _ok(df, direction)
    gpu = ok["gpu_name"].iloc[0] if len(ok) else ""
    note = _pair_note(list(sp["pairing"]))
    fig.suptitle(title or f"GDN {direction} speedup over {baseline} on {gpu}"
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
    ok = ok.sort_values("point_index", kind="stable")
    panels = list(dict.fromkeys(zip(ok["model"], ok["tp"])))
    colors = palette(ok)
    backends = list(colors)
    markers = ["o", "s", "^", "D", "v", "P", "X", "*"]
    nseqs = sorted(set(int(n) for n in ok["num_seqs"].dropna())) or [1]
    ncol = min(4, len(panels))
    nrow = int(np.ceil(len(panels) / ncol))
    fig, axes = plt.subplots(nrow, ncol, figsize=(4.2 * ncol, 3.4 * nrow), squeeze=False)
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
    axes.flat[0].legend(handles, labels, fontsize=6.5)
    gpu = ok["gpu_name"].iloc[0]
    modes = ",".join(sorted(set(ok["timing_mode"].dropna())))
    fig.suptitle(title or f"GDN {direction} latency vs tokens on {gpu} (timing: {modes})",
                 fontsize=10)
    fig.tight_layout()
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
    ncol = min(3, len(panels))
    nrow = int(np.ceil(len(panels) / ncol))
    fig, axes = plt.subplots(nrow, ncol, figsize=(max(5.0, 0.7 * len(labels) + 2) * ncol,
                                                  3.3 * nrow), squeeze=False)
    for ax, (d, b) in zip(axes.flat, panels):
        sub = h[(h["direction"] == d) & (h["backend"] == b)]
        c = colors[b] or "#333333"
        for _, g in sub.groupby("point_key", sort=False):
            g = g.sort_values("run_pos")
            rel = g["latency_ms"] / g["latency_ms"].iloc[0]
            ax.plot(g["run_pos"], rel, "-o", color=c, alpha=0.45, lw=0.9, ms=2.5)
            for v, mk, col in (("slower", "v", "red"), ("faster", "^", "green")):
                sel = (g["verdict"] == v).to_numpy()
                if sel.any():
                    ax.scatter(g["run_pos"][sel], rel[sel], marker=mk, s=40, color=col, zorder=4,
                               label=v)
        ax.axhline(1.0, color="k", lw=0.6)
        ax.set_xticks(labels["run_pos"], labels["run_label"], rotation=45, ha="right", fontsize=6.5)
        ax.set_title(f"{b} {d}", fontsize=9)
        ax.set_ylabel("latency / first run")
        ax.grid(alpha=0.3)
        hs, ls = ax.get_legend_handles_labels()
        if hs:
            uniq = dict(zip(ls, hs))
            ax.legend(uniq.values(), uniq.keys(), fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle(title or "latency history (one line per point)", fontsize=10)
    fig.tight_layout()
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
    fig, ax = plt.subplots(figsize=(7.5, 5))
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
    fig.tight_layout()
    return _save(fig, out)


def util_vs_latency(df: pd.DataFrame, out: str | Path, direction: str | None = None) -> Path | None:
    """SM utilisation (NVML GPM) vs latency, one panel per model: grid fill vs per-CTA work."""
    ok = _ok(df, direction)
    ok = ok[ok["sm_util_pct"].notna()] if "sm_util_pct" in ok else ok.iloc[0:0]
    if ok.empty:
        return None
    models = list(dict.fromkeys(ok.sort_values("point_index")["model"]))
    ncol = min(3, len(models))
    nrow = int(np.ceil(len(models) / ncol))
    fig, axes = plt.subplots(nrow, ncol, figsize=(5 * ncol, 3.6 * nrow), squeeze=False)
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
    axes.flat[0].legend(fontsize=7)
    fig.tight_layout()
    return _save(fig, out)
