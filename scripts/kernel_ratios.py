"""Speed ratios of the in-repo TileLang kernels against the libraries, from a results directory.

    python scripts/kernel_ratios.py results/h200_fwd [--direction fwd]

Per model (h_qk/h_v): geomean of FLA/tilelang, FlashQLA/tilelang, FlashInfer/tilelang and
best-library/tilelang latency ratios (>1 = tilelang faster), the worst point, and the counts —
only over points where tilelang and the compared backend are both `ok` (same timing mode).
"""
import argparse
import math

from qlabench import results


def geomean(xs):
    xs = [x for x in xs if x and x > 0 and math.isfinite(x)]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--direction", default=None)
    a = ap.parse_args()
    df = results.latest(results.load(a.dir))
    if a.direction:
        df = df[df.direction == a.direction]
    df = df[df.status == "ok"]
    libs = [b for b in ("fla", "flashqla", "flashinfer") if b in set(df.backend)]
    for d, dd in df.groupby("direction"):
        modes = set(dd.timing_mode)
        pv = dd.pivot_table(index=["h_qk", "h_v", "layout"], columns="backend", values="latency_ms")
        if "tilelang" not in pv:
            print(f"{d}: no tilelang rows")
            continue
        pv["best"] = pv[libs].min(axis=1)
        cols = libs + ["best"]
        print(f"\n{d} ({a.dir}; timing {', '.join(sorted(modes))}): library latency / tilelang latency\n")
        print("| h_qk/h_v | points | " + " | ".join(f"vs {c}" for c in cols) + " | worst vs best (layout) |")
        print("|---" * (len(cols) + 3) + "|")
        allr = {c: [] for c in cols}
        for (hq, hv), g in pv.groupby(level=[0, 1]):
            cells = []
            for c in cols:
                r = (g[c] / g["tilelang"]).dropna()
                allr[c] += r.tolist()
                cells.append(f"{geomean(r):.2f}× ({len(r)})")
            r = (g["best"] / g["tilelang"]).dropna()
            worst = f"{r.min():.2f}× ({r.idxmin()[2]})" if len(r) else "-"
            print(f"| {hq}/{hv} | {g['tilelang'].notna().sum()} | " + " | ".join(cells) + f" | {worst} |")
        print("| all | " + str(int(pv["tilelang"].notna().sum())) + " | "
              + " | ".join(f"{geomean(allr[c]):.2f}× ({len(allr[c])})" for c in cols) + " | |")


if __name__ == "__main__":
    main()
