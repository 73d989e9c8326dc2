"""``qlabench report RESULTS... --out site/``: a static HTML dashboard over stored rows (no server,
no JavaScript; PNGs written beside the page under ``img/``).

Rows of all given results directories are grouped by (results directory, GPU). Per group:

- status counts per backend and the latest row per key (:func:`qlabench.analysis.newest`), each
  row's speedup over the baseline (``--baseline``, FLA by default: :func:`qlabench.analysis.speedups`)
  on its point with the pair's tag (:func:`qlabench.analysis.pairing`), and
  per direction and backend the geomean speedup with :func:`qlabench.analysis.pairing_label` (do
  its rows share GPU and campaign; how many are throttled);
- per point (:meth:`qlabench.analysis.Analysis.points`): the winner (fastest ``ok`` backend label), its
  latency (p10–p90), the runner-up and the margin, the winner's speedup over the baseline, correctness (the
  winner's ``max_rel_l2``; how many backends are ``incorrect`` there), in the one layout order of
  :func:`qlabench.analysis.layout_order`;
- figures of the latest rows (:func:`qlabench.plots.run_figures`): the winner map and the speedup
  over the baseline per model first, then grouped latency bars, roofline, SM utilisation, backward latency
  vs total tokens; every figure at most :data:`qlabench.plots.MAX_WIDTH_PX` wide;
- when the group holds several runs, two history views, every key's measurements ordered by run
  start and each judged against the previous measurement of the same key with
  :func:`qlabench.compare.judge` (same threshold and test as ``qlabench compare``): **library
  regressions** (backends whose class's ``kind`` is ``library``: FLA, FlashInfer under any label,
  FlashQLA, outside packages; the page's banner counts these only) and the **in-repo kernel
  history** (the TileLang kernels of ``kernels/``: their version-to-version changes, no banner);
- every run's environment (``_runs/<run_id>.json``) and relative links to its Parquet parts.

Each group's numbers come from one :class:`qlabench.analysis.Analysis` (newest rows, speedups,
winners per direction: each computed once) handed to every table and figure of its section.
Like every view here, it only reads the rows (Parquet is the truth, the site is derived).
"""

from __future__ import annotations

import html
import json
import os
import re
import time
from pathlib import Path
from urllib.parse import quote

import numpy as np
import pandas as pd

from . import analysis, plots, results
from . import compare as Q

CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px auto;max-width:1500px;
     padding:0 16px;color:#222}
h1{font-size:1.5em} h2{border-bottom:2px solid #ddd;padding-bottom:4px;margin-top:2em}
h3{margin-top:1.4em}
table{border-collapse:collapse;font-size:12px;margin:8px 0}
th,td{border:1px solid #ddd;padding:3px 7px;text-align:left;vertical-align:top}
th{background:#f4f4f4} td.num{text-align:right;font-variant-numeric:tabular-nums}
img{max-width:100%;height:auto;border:1px solid #eee;margin:6px 0}
td.bad{background:#fde7ea}
.slower{color:#b00020;font-weight:600} .faster{color:#0a7d27;font-weight:600}
.incomparable{color:#8a6d00}
.banner{padding:8px 12px;border-radius:4px;margin:10px 0}
.bad{background:#fde7ea;border:1px solid #f3a0ad} .good{background:#e6f6ea;border:1px solid #9fd8ad}
.muted{color:#777;font-size:12px} nav a{margin-right:14px} details{margin:6px 0}
pre{background:#f7f7f7;padding:8px;font-size:11px;overflow-x:auto}
"""


def _e(x) -> str:
    if x is None or (isinstance(x, float) and not np.isfinite(x)):
        return ""
    return html.escape(str(x))


def _slug(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", s).strip("_") or "x"


def _href(target: Path, site: Path) -> str:
    return quote(os.path.relpath(Path(target).resolve(), Path(site).resolve()).replace(os.sep, "/"))


def _table(df: pd.DataFrame, num: tuple = (), fmt: dict | None = None, cls_col: str | None = None,
           raw: tuple = ()) -> str:
    """HTML table of ``df``; ``num`` columns right-aligned, ``fmt`` column -> format spec,
    ``cls_col``: column whose value becomes the cell's CSS class; ``raw`` columns are HTML."""
    fmt = fmt or {}
    head = "".join(f"<th>{_e(c)}</th>" for c in df.columns)
    body = []
    for r in df.itertuples(index=False):
        cells = []
        for c, v in zip(df.columns, r):
            if c in raw:
                text = v or ""
            elif c in fmt and v is not None and not (isinstance(v, float) and not np.isfinite(v)):
                text = _e(format(v, fmt[c]))
            else:
                text = _e(v)
            attrs = ' class="num"' if c in num else ""
            if cls_col and c == cls_col:
                attrs = f' class="{_e(v)}"'
            cells.append(f"<td{attrs}>{text}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def load_dirs(dirs: list[Path]) -> tuple[pd.DataFrame, dict[str, dict], list[str]]:
    """Pooled rows (column ``_src``: the directory; :func:`qlabench.analysis.read_rows`) and
    metadata {run_id: meta + ``_src``}; notes for directories without rows and for rows set
    aside. :class:`qlabench.analysis.BadInput` on a missing or unreadable path or rows that
    lack the columns the views read."""
    frames, metas, notes = [], {}, []
    for d in dirs:
        d = Path(d)
        df = analysis.read_rows(d, notes)
        if df.empty:
            notes.append(f"{d}: no result rows")
            continue
        df = df.assign(_src=str(d))
        frames.append(df)
        for rid, m in results.load_meta(d if d.is_dir() else d.parent).items():
            if isinstance(m, dict):  # a metadata file that is not a JSON object says nothing
                metas.setdefault(rid, {**m, "_src": str(d)})
    if not frames:
        raise Q.BadInput(f"{', '.join(map(str, dirs))}: no result rows to report")
    df = pd.concat(frames, ignore_index=True)
    df = df.drop_duplicates(["run_id", *results.KEY], keep="first")
    return df, metas, notes


def run_order(df: pd.DataFrame, metas: dict) -> pd.DataFrame:
    """One row per run: run_id, started_at, git_sha, rows, run_pos (0 = oldest), run_label."""
    if "_src" not in df.columns:
        df = df.assign(_src="")
    g = df.groupby("run_id", sort=False).agg(started_at=("started_at", "min"),
                                              git_sha=("git_sha", "first"), rows=("status", "size"),
                                              src=("_src", "first")).reset_index()
    g["started_at"] = [metas.get(r, {}).get("started_at") or s
                       for r, s in zip(g["run_id"], g["started_at"])]
    g = g.sort_values(["started_at", "run_id"], kind="stable").reset_index(drop=True)
    g["run_pos"] = np.arange(len(g))
    g["run_label"] = [f"{(s or '')[5:16].replace('T', ' ')} {(sha or '')[:7]}"
                      for s, sha in zip(g["started_at"], g["git_sha"])]
    return g


_NO_PAIR = {**dict.fromkeys(analysis.PAIR_FIELDS, False), "pairing": ""}


def history(df: pd.DataFrame, runs: pd.DataFrame, threshold: float = 0.05,
            alpha: float = 0.01) -> pd.DataFrame:
    """Every (run, key) row ordered by run start, judged against the previous measurement of the
    same key (``verdict``/``ratio``/``p_value`` and the two rows' :func:`qlabench.analysis.pairing`
    columns; empty for a key's first measurement)."""
    pos = runs.set_index("run_id")
    h = df.assign(run_pos=df["run_id"].map(pos["run_pos"]),
                  run_label=df["run_id"].map(pos["run_label"]))
    h = h.sort_values(["run_pos"], kind="stable")
    verdict, ratio, pval, reason, prev_run, order, tag = [], [], [], [], [], [], []
    recs_all = h.to_dict("records")  # every row a dict once, judged and paired as dicts
    labels = h.index
    for _, g in h[results.KEY].reset_index(drop=True).groupby(results.KEY, sort=False):
        order += list(labels[g.index])
        recs = [recs_all[i] for i in g.index]
        for i, r in enumerate(recs):
            if i == 0:
                verdict.append("")
                ratio.append(None)
                pval.append(None)
                reason.append("")
                prev_run.append(None)
                tag.append(_NO_PAIR)
                continue
            j = Q.judge(recs[i - 1], r, threshold, alpha, ci=False)
            verdict.append(j["verdict"])
            ratio.append(j["ratio"])
            pval.append(j["p_value"])
            reason.append(j["reason"])
            prev_run.append(recs[i - 1]["run_id"])
            tag.append(analysis.pair(recs[i - 1], r))
    out = h.loc[order, ["run_id", "run_pos", "run_label", "git_sha", *results.KEY, "model", "tp",
                        "layout", "point_index", "status", "latency_ms"]
                   + [c for c in ("num_seqs", "total_tokens", "seqlens") if c in h]].copy()
    out["backend_name"] = results.backend_names(h.loc[order])
    out["verdict"], out["ratio"], out["p_value"] = verdict, ratio, pval
    out["reason"], out["prev_run_id"] = reason, prev_run
    for c in _NO_PAIR:
        out[c] = [t[c] for t in tag]
    return out.reset_index(drop=True)


def _status_table(latest: pd.DataFrame) -> str:
    t = latest.pivot_table(index="backend", columns="status", values="point_key",
                           aggfunc="count", fill_value=0)
    t = t.reindex(columns=[s for s in results.STATUSES if s in t.columns])
    t = t.reset_index()
    return _table(t, num=tuple(c for c in t.columns if c != "backend"))


def _bname(baseline: str) -> str:
    """The baseline as headings name it: ``FLA`` for ``fla``, else the label."""
    return "FLA" if baseline == "fla" else baseline


def vs_baseline(latest: pd.DataFrame, baseline: str = analysis.BASELINE) -> pd.DataFrame:
    """Per latest row: ``speedup`` = the ``baseline`` label's latency / this row's on the same
    point and direction (ok rows both: :func:`qlabench.analysis.speedups`), and the pair's
    :func:`qlabench.analysis.pairing` columns (NaN / "" without a pair)."""
    return _with_speedups(latest, analysis.speedups(latest, baseline))


def _with_speedups(latest: pd.DataFrame, sp: pd.DataFrame) -> pd.DataFrame:
    """``latest`` with the columns of :func:`vs_baseline` from ``sp`` (:func:`qlabench.analysis.speedups`
    of these rows: index labels of ``latest``)."""
    d = latest.copy()
    d["speedup"] = np.nan
    d["pairing"] = ""
    if len(sp):
        d.loc[sp.index, "speedup"] = sp["speedup"]
        for c in analysis.PAIR_FIELDS:
            d.loc[sp.index, c] = sp[c]
    return d


def _latest_table(an: analysis.Analysis) -> str:
    baseline = an.baseline
    d = _with_speedups(_ordered(an.rows), an.speedups)
    vs = f"speedup vs {baseline}"
    cols = {"model": "model", "tp": "h_qk/h_v", "layout": "layout", "direction": "dir",
            "backend": "backend", "backend_version": "version", "path": "path", "status": "status",
            "latency_ms": "latency_ms",
            "p10_ms": "p10_ms", "p90_ms": "p90_ms", "n_samples": "n", "speedup": vs,
            "pairing": f"pairing (vs {baseline})", "tflops": "tflops", "timing_mode": "timing",
            "reason": "reason"}
    d = d[[c for c in cols if c in d.columns]].rename(columns=cols)
    return _table(d, num=("latency_ms", "p10_ms", "p90_ms", "n", vs, "tflops"),
                  fmt={"latency_ms": ".4f", "p10_ms": ".4f", "p90_ms": ".4f",
                       vs: ".2f", "tflops": ".1f"})


def _pairing_lines(an: analysis.Analysis) -> str:
    """One line per (direction, backend): geomean speedup over the baseline and the pairs'
    label."""
    baseline = an.baseline
    d = _with_speedups(an.rows, an.speedups)
    d = d[d["speedup"].notna()]
    bn = _e(_bname(baseline))
    if d.empty:
        return ""
    items = []
    for (di, b), g in d.groupby(["direction", "backend"], sort=True):
        gm = float(np.exp(np.log(g["speedup"].astype(float)).mean()))
        items.append(f"<li>{_e(di)} {_e(b)}: geomean {gm:.2f}× {bn} over {len(g)} points — "
                     f"{_e(analysis.pairing_label(g))}</li>")
    return (f"<h3>speedup over {bn} (latest rows)</h3><p class='muted'>pairs: whether the two rows "
            "of each ratio share GPU (<code>gpu_uuid</code>) and measurement campaign "
            "(<code>campaign_id</code>; unknown on rows written before these columns) and "
            f"whether one is throttled</p><ul>{''.join(items)}</ul>")


def _env_rows(meta: dict) -> pd.DataFrame:
    flat = {}
    for k in ("run_id", "git_sha", "config", "started_at", "finished_at", "points", "device"):
        if k in meta:
            flat[k] = meta[k]
    for k in ("counts", "backend_versions", "env"):
        v = meta.get(k)
        if isinstance(v, dict):
            for kk, vv in v.items():
                flat[f"{k}.{kk}" if k != "env" else kk] = vv
    for k, v in (meta.get("availability") or {}).items():
        if isinstance(v, list) and len(v) == 2 and not v[0]:
            flat[f"unavailable.{k}"] = v[1]
    return pd.DataFrame({"field": list(flat),
                         "value": [json.dumps(v) if isinstance(v, dict | list) else v
                                   for v in flat.values()]})


def _runs_section(runs: pd.DataFrame, df: pd.DataFrame, metas: dict, site: Path) -> str:
    parts = []
    for r in runs.sort_values("run_pos", ascending=False).itertuples():
        sub = df[df["run_id"] == r.run_id]
        counts = ", ".join(f"{n} {s}" for s, n in sub["status"].value_counts().items())
        src = Path(r.src)
        pdir = src / "parts" if (src / "parts").is_dir() else src
        files = sorted(pdir.glob(f"{r.run_id}-*.parquet")) if pdir.is_dir() else [src]
        if not files and pdir.is_dir():  # a compacted run: its rows are in the shared file(s)
            files = [f for f in sorted(pdir.glob("*.parquet")) if not f.name.startswith((".", "_"))
                     and not f.name.startswith(tuple(runs["run_id"].astype(str)))]
        links = "".join(f'<li><a href="{_href(f, site)}">{_e(f.name)}</a></li>' for f in files)
        meta = metas.get(r.run_id)
        mfile = src / results.RUNS_DIR / f"{r.run_id}.json"
        env = _table(_env_rows(meta)) if meta else \
            "<p class='muted'>no _runs/*.json for this run</p>"
        open_ = " open" if r.run_pos == runs["run_pos"].max() else ""
        parts.append(
            f"<details{open_}><summary><b>{_e(r.run_id)}</b> — started {_e(r.started_at)}, "
            f"git {_e(r.git_sha)}, {r.rows} rows ({_e(counts)}), from {_e(r.src)}</summary>"
            f"<h4>environment</h4>{env}"
            + (f'<p><a href="{_href(mfile, site)}">{_e(mfile.parent.name)}/{_e(mfile.name)}</a> · '
               if mfile.exists()
               else "<p>")
            + f'<a href="{_href(pdir, site)}/">parts folder</a></p>'
            f"<details><summary>{len(files)} Parquet part(s) of this run</summary><ul>{links}</ul>"
            "</details></details>")
    return "".join(parts)


def _ordered(df: pd.DataFrame) -> pd.DataFrame:
    """Rows by direction, then model, layout (:func:`qlabench.analysis.layout_order`) and backend."""
    dirs = {"fwd": 0, "bwd": 1, "fwdbwd": 2}
    parts = [plots.sort_layouts(g) for _, g in sorted(df.groupby("direction", sort=False),
                                                      key=lambda kv: dirs.get(kv[0], 9))]
    return pd.concat(parts) if parts else df


def is_library(hist: pd.DataFrame) -> pd.Series:
    """True for rows of a backend library (its class's ``kind``, by ``backend_name``): latency
    changes of these between runs are regressions a user should hear about; the in-repo kernels'
    go to the in-repo kernel history."""
    from . import backends
    kinds = backends.kinds()
    return results.backend_names(hist).map(lambda b: kinds.get(b, "library") == "library")


def _history_section(hist: pd.DataFrame, img_dir: Path, site: Path, anchor: str, kind: str) -> str:
    """``kind`` ``library``: the library regressions; ``in-repo``: the in-repo kernel history."""
    if hist.empty or hist["run_pos"].nunique() < 2 or not hist["verdict"].ne("").any() \
            or not hist["latency_ms"].notna().any():  # never measured (e.g. unavailable only)
        return ""
    names = ", ".join(sorted(set(results.backend_names(hist))))
    if kind == "library":
        out = [f'<h3 id="{anchor}">Library regressions ({_e(names)})</h3>',
               "<p class='muted'>Backend libraries' latency across runs: each point's latency "
               "relative to its first measurement, one line per point; each measurement judged "
               "against the previous one of the same point with the rules of <code>qlabench "
               "compare</code>. ▼ red: slower, ▲ green: faster.</p>"]
        fig, alt = "history_libraries.png", "library latency history"
    else:
        out = [f'<h3 id="{anchor}">In-repo kernel history ({_e(names)})</h3>',
               "<p class='muted'>The in-repo kernels' own version-to-version changes (kernel "
               "development, not a library regression): each point's latency relative to its "
               "first measurement, judged like the libraries'. ▼ red: slower, ▲ green: "
               "faster.</p>"]
        fig, alt = "history_in_repo.png", "in-repo kernel history"
    p = plots.history_figure(hist, img_dir / fig, title=alt)
    if p:
        out.append(_img(p, site, alt, f"{anchor}-figure", "history"))
    judged = hist[hist["verdict"] != ""]
    steps = judged.groupby(["run_label", "verdict"]).size().unstack(fill_value=0).reset_index()
    out.append("<h4>verdicts per run (vs the previous measurement of each point)</h4>")
    out.append(_table(steps, num=tuple(c for c in steps.columns if c != "run_label")))
    out.append(f"<p class='muted'>pairs judged: {_e(analysis.pairing_label(judged))}</p>")
    reg = judged[judged["verdict"] == "slower"]
    word = "regression(s)" if kind == "library" else "slower step(s)"
    if len(reg):
        t = _ordered(reg)[["run_label", "model", "tp", "layout", "backend", "direction",
                           "latency_ms", "ratio", "p_value", "pairing", "prev_run_id",
                           "run_id"]].rename(
            columns={"run_label": "run", "tp": "h_qk/h_v", "ratio": "vs previous"})
        cls = "slower" if kind == "library" else ""
        out.append(f"<h4 class='{cls}'>{len(reg)} {word}</h4>")
        out.append(_table(t, num=("latency_ms", "vs previous", "p_value"),
                          fmt={"latency_ms": ".4f", "vs previous": ".3f", "p_value": ".2g"}))
    else:
        out.append(f"<p class='faster'>no {word} between consecutive measurements</p>")
    return "".join(out)


def _img(p: Path, site: Path, alt: str, id_: str, cls: str) -> str:
    """An ``<img>`` with its pixel size (the PNG's; CSS shrinks it to the page, never wider)."""
    from PIL import Image
    with Image.open(p) as im:
        w, h = im.size
    return (f'<p><img id="{_e(id_)}" class="fig {cls}" src="{_href(p, site)}" alt="{_e(alt)}" '
            f'width="{w}" height="{h}" loading="eager"></p>')


def _winners_section(an: analysis.Analysis, slug: str) -> str:
    """Per direction: the winner table of :meth:`qlabench.analysis.Analysis.points`."""
    out = []
    for d in ("fwd", "bwd", "fwdbwd"):
        if not (an.rows["direction"] == d).any():
            continue
        w = an.points(d)
        vs = f"vs {an.baseline}"
        if w.empty:
            continue
        n_won = int(w["winner"].notna().sum())
        inc = int((w["n_incorrect"] > 0).sum())
        counts = w["winner"].value_counts()
        tally = ", ".join(f"{_e(b)} {n}" for b, n in counts.items())
        t = pd.DataFrame({
            "model": w["model"], "h_qk/h_v": w["tp"], "layout": w["layout"],
            "winner": w["winner"].fillna("— (no ok row)"),
            "latency_ms (p10–p90)": [
                "" if not np.isfinite(m) else f"{m:.4f}" + (
                    f" ({lo:.4f}–{hi:.4f})" if np.isfinite(lo) and np.isfinite(hi) else "")
                for m, lo, hi in zip(w["winner_ms"].astype(float), w["winner_p10_ms"].astype(float),
                                     w["winner_p90_ms"].astype(float))],
            "runner-up": w["runner_up"].fillna(""),
            "margin": [_margin(m, o) for m, o in zip(w["margin"].astype(float), w["tie"])],
            vs: w["speedup"].astype(float),
            "winner max_rel_l2": w["winner_max_rel_l2"].astype(float),
            "incorrect backends": w["n_incorrect"].astype(int),
            "ok / backends": [f"{a} / {b}" for a, b in zip(w["n_ok"], w["n_backends"])],
        })
        out.append(f'<h4 id="{slug}-winners-{d}">{_e(d)}: winner per point</h4>'
                   f"<p>{n_won} of {len(w)} points have a winner ({tally}); "
                   + (f"<span class='slower'>{inc} point(s) with an incorrect backend</span>"
                      if inc else "no incorrect backend at any point")
                   + ". margin: runner-up median / winner median − 1; ≈: a tie (the two labels' samples "
                   "are not told apart: the rule of <code>qlabench summary</code>).</p>")
        out.append(_table(t, num=(vs, "winner max_rel_l2", "incorrect backends", "margin"),
                          fmt={vs: ".2f", "winner max_rel_l2": ".2e"}))
    if not out:
        return ""
    return (f'<h3 id="{slug}-winners">Who wins (latest rows)</h3>'
            f"<details open><summary>winner, margin and correctness per point</summary>"
            f"{''.join(out)}</details>")


def _margin(m: float, tie) -> str:
    if not np.isfinite(m):
        return ""
    return f"{'≈ ' if tie is True else ''}+{(m - 1) * 100:.1f}%"


def build(dirs: list[Path], out: Path, threshold: float = 0.05, alpha: float = 0.01,
          baseline: str | None = None, notes: list[str] | None = None) -> Path:
    """Write ``out/index.html`` (+ ``out/img/<section>/*.png``); returns the page's path.
    ``baseline``: the label speedups are over (:class:`qlabench.analysis.UnknownBaseline` when no
    row carries it); None: ``fla``, its speedups blank where it has no rows. The page's notes
    (:func:`load_dirs`) are also appended to ``notes``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    df, metas, page_notes = load_dirs(dirs)
    if notes is not None:
        notes.extend(page_notes)
    baseline = analysis.BASELINE if baseline is None else analysis.require_baseline(df, baseline)
    # one section per results directory (a kept run may accumulate rows from several configs,
    # e.g. a quick subset first, then the full sweep with --resume)
    df["_config"] = [Path(s).name for s in df["_src"]]
    df["_gpu"] = df["gpu_name"].fillna("unknown GPU")
    sections, nav, banners = [], [], []
    for (cfg, gpu), g in df.groupby(["_config", "_gpu"], sort=True):
        slug = _slug(f"{cfg}-{gpu}")
        img = out / "img" / slug
        runs = run_order(g, metas)
        an = analysis.Analysis(g, baseline)  # every table and figure below reads this one
        lat = an.rows
        figs = plots.run_figures(lat, Path(g["_src"].iloc[0]), baseline=baseline, metas=metas,
                                 fig_dir=img, an=an)
        body = [f'<h2 id="{slug}">{_e(cfg)} — {_e(gpu)}</h2>',
                f"<p>{len(runs)} run(s), {len(g)} rows, {len(lat)} distinct point × backend × "
                f"direction keys; latest run {_e(runs['run_id'].iloc[-1])} "
                f"({_e(runs['started_at'].iloc[-1])}).</p>",
                "<h3>status of the latest row per key</h3>", _status_table(lat),
                _pairing_lines(an), _winners_section(an, slug)]
        first = [p for p in figs if p.stem.split("_")[0] in ("winner", "speedup")]
        rest = [p for p in figs if p not in first]
        bn = _bname(baseline)
        kinds = {"winner": ("winner-map", "winner map"), "speedup": ("speedup", f"speedup over {bn}")}
        if first:
            body.append(f'<h3 id="{slug}-figures">Winner map and speedup over {_e(bn)} (latest rows)</h3>')
            for p in first:
                cls, what = kinds[p.stem.split("_")[0]]
                body.append(_img(p, out, f"{what} ({p.stem.rsplit('_', 1)[-1]})",
                                 f"{slug}-{p.stem}", cls))
        if rest:
            body.append(f'<h3 id="{slug}-more-figures">Latency, roofline, utilisation (latest '
                        "rows)</h3>")
            body += [_img(p, out, p.stem, f"{slug}-{p.stem}", "more") for p in rest]
        if not figs:
            body.append("<p class='muted'>no ok rows with a latency: nothing to plot</p>")
        body.append(f"<details><summary>latest rows ({len(lat)})</summary>{_latest_table(an)}"
                    "</details>")
        if len(runs) > 1:
            hist = history(g, runs, threshold, alpha)
            lib = is_library(hist)
            body.append(_history_section(hist[lib], img, out, f"{slug}-history", "library"))
            body.append(_history_section(hist[~lib], img, out, f"{slug}-kernel-history", "in-repo"))
            last = hist[lib & (hist["run_pos"] == runs["run_pos"].max())
                        & (hist["verdict"] == "slower")]
            if len(last):
                banners.append(f"<div class='banner bad'><b>{_e(cfg)} on {_e(gpu)}</b>: latest run "
                               f"has {len(last)} library regression(s) "
                               f"({_e(', '.join(sorted(set(last['backend']))))}) vs the previous "
                               f'measurement — <a href="#{slug}-history">library regressions</a>'
                               "</div>")
        body.append(f'<h3 id="{slug}-runs">Runs and environment</h3>')
        body.append(_runs_section(runs, g, metas, out))
        sections.append("".join(body))
        nav.append(f'<a href="#{slug}">{_e(cfg)} ({_e(gpu)})</a>')
    if not banners:
        banners.append("<div class='banner good'>latest run of each config: no library "
                       "regression vs the previous measurement of any point (the in-repo kernels' "
                       "own changes are in each section's in-repo kernel history)</div>")
    src = ", ".join(f'<a href="{_href(Path(d), out)}/">{_e(d)}</a>' for d in dirs)
    page = (
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
        "<meta name='viewport' content='width=device-width, initial-scale=1'>"
        "<link rel='icon' href='data:,'>"
        f"<title>qlabench dashboard</title><style>{CSS}</style></head><body>"
        "<h1>qlabench — Gated DeltaNet kernel benchmarks</h1>"
        f"<p class='muted'>generated {_e(time.strftime('%Y-%m-%d %H:%M:%S'))} from {src}; "
        f"history verdicts: threshold {threshold:.0%}, two-sided Mann–Whitney U at alpha "
        f"{alpha:g}</p><nav>{''.join(nav)}</nav>{''.join(banners)}"
        + "".join(f"<p class='muted'>note: {_e(n)}</p>" for n in page_notes)
        + "".join(sections) + "</body></html>")
    index = out / "index.html"
    index.write_text(page, encoding="utf-8")
    return index


def report_cmd(results_dirs: list[Path], out: Path, baseline: str | None = None) -> int:
    """``qlabench report``: 0 on success, 2 on bad input (message names the path, or the
    ``--baseline`` label without rows and the labels present)."""
    from rich.console import Console

    err = Console(stderr=True, soft_wrap=True)
    notes: list[str] = []
    try:
        index = build(list(results_dirs), Path(out), baseline=baseline, notes=notes)
    except Q.BadInput as e:
        err.print(f"error: {analysis.with_notes(e, notes)}", highlight=False, markup=False)
        return 2
    con = Console(soft_wrap=True)
    for n in notes:
        con.print(f"note: {n}", highlight=False, markup=False)
    con.print(f"wrote {index} (open it in a browser; no server needed)", highlight=False,
              markup=False)
    return 0
