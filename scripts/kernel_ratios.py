"""Speed ratios of the in-repo TileLang kernels against the libraries, from a results directory.

    python scripts/kernel_ratios.py results/h200_fwd [--direction fwd] [--chain DIR[,RERUN...]]...

Per model (h_qk/h_v): geomean of each library's latency / tilelang's (every backend label that is
not a `tilelang` one: FLA, FlashQLA, FlashInfer and any labelled version such as
`flashinfer@0.7.4`) and of the best library's (the fastest of them at the point), >1 = tilelang
faster; the worst point, and the counts — only over points where tilelang and the compared backend
are both `ok` (latest row per key). Every ratio pairs two rows: a cell marked `*` holds a pair
whose rows are not known to share GPU and campaign, or a throttled row; the lines under the table
give `analysis.pairing_label` per column.

``--chain DIR`` (repeatable, in order): a run of `tilelang` against `tilelang@prev` (a later
version of the kernels against the one before it); each point's tilelang latency is multiplied by
that run's tilelang / tilelang@prev (a run that covers only some points leaves the others as they
were). ``DIR,RERUN`` takes RERUN's ratio where it has the point (a re-run of that comparison). The
chained latencies belong to no one run: their ratios are marked cross-GPU and cross-campaign.
"""
import argparse
import math

import pandas as pd

from qlabench import analysis, results

LIBS = ("fla", "flashqla", "flashinfer")  # first, in this order; other labels after them


def library_labels(backends) -> list[str]:
    """The library backend labels among ``backends``: every one not starting with ``tilelang``."""
    found = {b for b in backends if not str(b).startswith("tilelang")}
    return [b for b in LIBS if b in found] + sorted(found - set(LIBS))


def _ok(d: str) -> pd.DataFrame:
    df = results.latest(results.load(d))
    return df[(df.status == "ok") & df.latency_ms.notna()]


def step_ratio(spec: str) -> pd.Series:
    """tilelang / tilelang@prev latency per point_key of ``DIR[,RERUN...]`` (later dirs override)."""
    out = None
    for d in spec.split(","):
        df = _ok(d)
        piv = df.pivot_table(index="point_key", columns="backend", values="latency_ms", aggfunc="median")
        if not {"tilelang", "tilelang@prev"} <= set(piv.columns):
            raise SystemExit(f"--chain {d}: needs tilelang and tilelang@prev rows")
        r = (piv["tilelang"] / piv["tilelang@prev"]).dropna()
        out = r if out is None else r.combine_first(out)
    return out


def chain(df: pd.DataFrame, specs: list[str]) -> pd.DataFrame:
    """``df`` with each tilelang row's latency times the product of the steps' ratios at its point,
    its gpu_uuid / campaign_id replaced (the value is no one run's)."""
    til = df.backend == "tilelang"
    factor = pd.Series(1.0, index=df.index)
    for spec in specs:
        r = step_ratio(spec)
        hit = df.point_key[til].isin(r.index)
        print(f"- chain step {spec}: {int(hit.sum())} of {int(til.sum())} tilelang points, "
              f"geomean {geomean(r[r.index.isin(df.point_key[til])]):.4f}")
        factor[til] = factor[til] * df.point_key[til].map(r).fillna(1.0)
    df = df.copy()
    df.loc[til, "latency_ms"] = df.loc[til, "latency_ms"] * factor[til]
    df.loc[til, "gpu_uuid"] = "chained"
    df.loc[til, "campaign_id"] = f"chained: {len(specs)} steps"
    return df


def geomean(xs):
    xs = [x for x in xs if x and x > 0 and math.isfinite(x)]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def ratios(dd: pd.DataFrame, libs: list[str]) -> pd.DataFrame:
    """One row per (point, compared column): lib latency / tilelang latency and the pair's
    ``analysis.pairing``; column ``vs`` is the library or ``best`` (the fastest library there)."""
    til = dd[dd.backend == "tilelang"].set_index("point_key")
    out = []
    for pk, g in dd[dd.backend.isin(libs)].groupby("point_key", sort=False):
        if pk not in til.index:
            continue
        t = til.loc[pk]
        best = g.loc[g.latency_ms.idxmin()]
        for vs, r in [*((r.backend, r) for r in g.itertuples(index=False)), ("best", best)]:
            r = r._asdict() if hasattr(r, "_asdict") else r.to_dict()
            out.append({"point_key": pk, "h_qk": t.h_qk, "h_v": t.h_v, "layout": t.layout, "vs": vs,
                        "ratio": r["latency_ms"] / t.latency_ms,
                        **analysis.pair(r, {**t.to_dict(), "point_key": pk})})
    return pd.DataFrame(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--direction", default=None)
    ap.add_argument("--chain", action="append", default=[], metavar="DIR[,RERUN...]")
    a = ap.parse_args()
    df = _ok(a.dir)
    if a.direction:
        df = df[df.direction == a.direction]
    if a.chain:
        df = chain(df, a.chain)
    libs = library_labels(set(df.backend))
    for d, dd in df.groupby("direction"):
        if "tilelang" not in set(dd.backend):
            print(f"{d}: no tilelang rows")
            continue
        rt = ratios(dd, libs)
        cols = libs + ["best"]
        modes = set(dd.timing_mode)
        what = f"tilelang chained through {len(a.chain)} runs (cross-campaign)" if a.chain else "tilelang"
        print(f"\n{d} ({a.dir}; timing {', '.join(sorted(modes))}): library latency / {what} latency\n")
        print("| h_qk/h_v | points | " + " | ".join(f"vs {c}" for c in cols) + " | worst vs best (layout) |")
        print("|---" * (len(cols) + 3) + "|")

        def cell(g):
            mark = "*" if g.pairing.astype(bool).any() else ""
            return f"{geomean(g.ratio):.2f}×{mark} ({len(g)})"

        for (hq, hv), g in rt.groupby(["h_qk", "h_v"]):
            cells = [cell(g[g.vs == c]) for c in cols]
            b = g[g.vs == "best"]
            worst = f"{b.ratio.min():.2f}× ({b.loc[b.ratio.idxmin(), 'layout']})" if len(b) else "-"
            print(f"| {hq}/{hv} | {b.point_key.nunique()} | " + " | ".join(cells) + f" | {worst} |")
        print(f"| all | {rt[rt.vs == 'best'].point_key.nunique()} | "
              + " | ".join(cell(rt[rt.vs == c]) for c in cols) + " | |")
        print()
        for c in cols:
            print(f"- vs {c}: {analysis.pairing_label(rt[rt.vs == c])}")
        if rt.pairing.astype(bool).any():
            print("- *: the cell holds pairs whose rows are not known to share GPU and campaign, "
                  "or a throttled row")


if __name__ == "__main__":
    main()
