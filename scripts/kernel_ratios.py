"""Speed ratios of the in-repo TileLang kernels against the libraries, from a results directory.

    python scripts/kernel_ratios.py results/h200_fwd [--direction fwd]

Per model (h_qk/h_v): geomean of FLA/tilelang, FlashQLA/tilelang, FlashInfer/tilelang and
best-library/tilelang latency ratios (>1 = tilelang faster), the worst point, and the counts —
only over points where tilelang and the compared backend are both `ok` (latest row per key).
Every ratio pairs two rows: a cell marked `*` holds a pair whose rows are not known to share GPU
and campaign, or a throttled row; the lines under the table give `results.pairing_label` per column.
"""
import argparse
import math

import pandas as pd

from qlabench import results

LIBS = ("fla", "flashqla", "flashinfer")


def geomean(xs):
    xs = [x for x in xs if x and x > 0 and math.isfinite(x)]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def ratios(dd: pd.DataFrame, libs: list[str]) -> pd.DataFrame:
    """One row per (point, compared column): lib latency / tilelang latency and the pair's
    ``results.pairing``; column ``vs`` is the library or ``best`` (the fastest library there)."""
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
                        **results.pair(r, {**t.to_dict(), "point_key": pk})})
    return pd.DataFrame(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--direction", default=None)
    a = ap.parse_args()
    df = results.latest(results.load(a.dir))
    if a.direction:
        df = df[df.direction == a.direction]
    df = df[(df.status == "ok") & df.latency_ms.notna()]
    libs = [b for b in LIBS if b in set(df.backend)]
    for d, dd in df.groupby("direction"):
        if "tilelang" not in set(dd.backend):
            print(f"{d}: no tilelang rows")
            continue
        rt = ratios(dd, libs)
        cols = libs + ["best"]
        modes = set(dd.timing_mode)
        print(f"\n{d} ({a.dir}; timing {', '.join(sorted(modes))}): library latency / tilelang latency\n")
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
            print(f"- vs {c}: {results.pairing_label(rt[rt.vs == c])}")
        if rt.pairing.astype(bool).any():
            print("- *: the cell holds pairs whose rows are not known to share GPU and campaign, "
                  "or a throttled row")


if __name__ == "__main__":
    main()
