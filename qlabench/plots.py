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


def latency_figure(df: pd.DataFrame, out: str | Path, direction: str | None = None,
                   title: str = "") -> Path | None:
    """Grouped bars: one panel per model/TP, one group per layout, one bar per backend; the
    fastest ok backend's speedup over FLA (or the slowest) labelled above each group."""
    ok = df[(df["status"] == "ok") & df["latency_ms"].notna()]
    if direction:
        ok = ok[ok["direction"] == direction]
    if ok.empty:
        return None
    models = list(dict.fromkeys(ok.sort_values("point_index")["model"]))
    backends = [b for b in BACKEND_COLORS if b in set(ok["backend"])] + \
        sorted(set(ok["backend"]) - set(BACKEND_COLORS))
    ncol = min(3, len(models))
    nrow = int(np.ceil(len(models) / ncol))
    fig, axes = plt.subplots(nrow, ncol, figsize=(6.5 * ncol, 3.6 * nrow), squeeze=False)
    for ax, m in zip(axes.flat, models):
        sub = ok[ok["model"] == m]
        layouts = list(dict.fromkeys(sub.sort_values("point_index")["layout"]))
        x = np.arange(len(layouts))
        w = 0.8 / max(1, len(backends))
        for i, b in enumerate(backends):
            vals = [sub[(sub["layout"] == lay) & (sub["backend"] == b)]["latency_ms"].median()
                    for lay in layouts]
            ax.bar(x + (i - (len(backends) - 1) / 2) * w, vals, w, label=b,
                   color=BACKEND_COLORS.get(b))
        base = "fla" if "fla" in backends else None
        if base and len(backends) > 1:
            for j, lay in enumerate(layouts):
                s = sub[sub["layout"] == lay].set_index("backend")["latency_ms"]
                if base in s and len(s) > 1:
                    best = s.drop(base).min()
                    if best and best > 0:
                        ax.text(x[j], s.max() * 1.02, f"{s[base] / best:.2f}x", ha="center",
                                fontsize=7)
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
    fig.suptitle(title or f"GDN {direction or ''} latency on {gpu} (timing: {modes})", fontsize=11)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def run_figures(df: pd.DataFrame, out_dir: str | Path, run_id: str | None = None) -> list[Path]:
    made = []
    sub = df if run_id is None else df[df["run_id"] == run_id]
    for d in ("fwd", "bwd", "fwdbwd"):
        if (sub["direction"] == d).any():
            p = latency_figure(sub, Path(out_dir) / f"latency_{d}.png", d)
            if p:
                made.append(p)
    return made
