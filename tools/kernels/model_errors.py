"""How far the forward planner's model is from the measured latency of each row of a run.

    python -m qlabench_tools.kernels.model_errors DIR --price TABLE [--label LABEL=TABLE ...] [--sms N]

For every ok forward row of the in-repo kernels in DIR (a results directory: a campaign, or step
``tables`` of ``scripts/airgapped/h200_campaign.sh``), the plan its label made
(:func:`qlabench.backends.tilelang.table_plans` under the label's table: parameter ``cost_table``,
or ``--label LABEL=TABLE`` where that file is not here, e.g. a device path; without either the GPU
model's table, or the default GPU's where it has none, as committed at the row's ``git_sha`` (read
from this repository's git history), as the backend planned then) is priced by
the model under ``--price`` (:func:`qlabench_kernels.plan.split_cost`) and set against the row's
latency. Printed: every row; the geomean error per regime (the final kernel, its CTAs and
seg_state's per SM, in rounds of the SMs); and, over the points where two labels' plans differ,
how often the model under ``--price`` orders the two as they measured. A table in relative units
prices up to a scale, so its errors are divided by their geomean. Exit 2 on a directory or table
that cannot be read, or on rows of a commit this repository does not hold.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import pathlib
import subprocess
import sys
from collections import defaultdict


def _rounds(ctas: int, sms: int) -> str:
    """A grid's CTAs per SM as a regime: 0, ≤1, ≤2, >2."""
    if not ctas:
        return "0"
    per = ctas / sms
    return "≤1" if per <= 1 else "≤2" if per <= 2 else ">2"


def grids(lens, h_v: int, seg: int, block_v: int) -> tuple[int, int]:
    """(final kernel CTAs, seg_state CTAs) of a plan (:func:`qlabench_kernels.plan.fwd_grids`)."""
    from qlabench_kernels.plan import fwd_grids

    fwd, seg_state, _ = fwd_grids(lens, h_v, seg, block_v)
    return sum(fwd.values()), sum(seg_state.values())


def _table_at(sha: str, path: pathlib.Path):
    """The cost table at ``path`` as committed at ``sha`` (what a run of that commit planned with),
    or None where the commit has no such file; ValueError where this repository does not hold the
    commit (name the label's table with ``--label``)."""
    from qlabench_kernels import calibration

    root = path.parents[2]
    rel = path.relative_to(root).as_posix()
    have = subprocess.run(["git", "-C", str(root), "cat-file", "-e", f"{sha}^{{commit}}"], capture_output=True)
    if have.returncode:
        raise ValueError(f"rows of commit {sha!r}: this repository does not hold it, so the table they planned "
                         f"with is unknown; name it with --label LABEL=TABLE")  # fmt: skip
    show = subprocess.run(["git", "-C", str(root), "show", f"{sha}:{rel}"], capture_output=True, text=True)
    return calibration.from_json(json.loads(show.stdout), f"{sha}:{rel}") if show.returncode == 0 else None


def _label_table(row, overrides: dict, table_file, committed):
    params = json.loads(row["backend_params"] or "{}")
    if row["backend"] in overrides:
        return table_file(overrides[row["backend"]])
    if params.get("cost_table"):
        return table_file(params["cost_table"])
    return committed(row["gpu_name"], row["git_sha"])


def rows_of(df, price, overrides: dict, sms: int) -> list[dict]:
    """One record per ok forward row of the in-repo kernels: its plan, the model's price, the latency."""
    from qlabench_kernels import calibration, plan

    from qlabench.backends.tilelang import table_plans

    table_file = functools.cache(calibration.from_file)  # each table read once, not per row

    @functools.cache
    def committed(gpu, sha):  # the GPU model's table at the rows' commit, else the default GPU's, as the backend plans
        for path in (calibration.table_path(gpu), calibration.table_path(calibration.default_table().gpu)):
            if (table := _table_at(sha, path)) is not None:
                return table
        raise ValueError(f"rows of commit {sha!r}: it has no cost table; name the table with --label LABEL=TABLE")

    out = []
    ours = df[(df["backend_name"] == "tilelang") & (df["status"] == "ok") & (df["direction"] == "fwd")]
    for _, r in ours.iterrows():
        lens, h_qk, h_v = tuple(int(x) for x in r["seqlens"]), int(r["h_qk"]), int(r["h_v"])
        bv, seg = table_plans(lens, h_qk, h_v, sms, "fwd", _label_table(r, overrides, table_file, committed))["fwd"]
        final, seg_ctas = grids(lens, h_v, seg, bv)
        out.append(dict(point=(r["model"], r["layout"]), heads=f"{h_qk}/{h_v}", layout=r["layout"],
                        label=r["backend"], block_v=bv, seg=seg, ms=float(r["latency_ms"]),
                        model=plan.split_cost(lens, h_v, seg, sms, bv, h_qk=h_qk, costs=price.fwd),
                        regime=("fused" if bv == 128 else "fwd_o", _rounds(final, sms), _rounds(seg_ctas, sms))))  # fmt: skip
    return out


def _geo(xs) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def report(recs: list[dict], relative: bool) -> list[str]:
    """The printed lines: every row, the error per regime, the ordering of differing plans."""
    if not recs:
        return ["no ok forward rows of the in-repo kernels"]
    raw = [r["model"] / (r["ms"] * 1000.0) for r in recs]
    scale = _geo(raw) if relative else 1.0
    for r, e in zip(recs, raw):
        r["err"] = e / scale
    lines = [f"{'heads':6s} {'layout':24s} {'label':14s} {'plan':>11s} {'ms':>9s} {'model/meas':>10s}  regime"]
    for r in sorted(recs, key=lambda r: (r["heads"], r["layout"], r["label"])):
        lines.append(f"{r['heads']:6s} {r['layout'][:24]:24s} {r['label'][:14]:14s} {r['block_v']:>4d},{r['seg']:<6d} "
                     f"{r['ms']:9.4f} {r['err']:10.3f}  {' '.join(r['regime'])}")  # fmt: skip
    by = defaultdict(list)
    for r in recs:
        by[r["regime"]].append(r["err"])
    lines.append("")
    lines.append("regime (final kernel, its CTAs per SM, seg_state's): rows, geomean model/measured, range")
    for k in sorted(by):
        v = by[k]
        lines.append(f"  {k[0]:6s} {k[1]:>3s} {k[2]:>3s}  {len(v):4d}  {_geo(v):.3f}  {min(v):.3f}–{max(v):.3f}")
    pts = defaultdict(list)
    for r in recs:
        pts[r["point"]].append(r)
    pairs = [p for p in pts.values() if len({(r["block_v"], r["seg"]) for r in p}) == 2]
    if pairs:
        right = sum((a["model"] < b["model"]) == (a["ms"] < b["ms"]) for a, b in (p[:2] for p in pairs))
        lines.append(f"points whose two plans differ: {len(pairs)}; the model orders {right} as measured")
    if relative:
        lines.append("(a relative-unit table: errors divided by their geomean)")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir", type=pathlib.Path, help="a results directory")
    ap.add_argument("--price", required=True, type=pathlib.Path, help="the cost table whose model prices the plans")
    ap.add_argument("--label", action="append", default=[], metavar="LABEL=TABLE",
                    help="the table a label planned with, where its cost_table parameter's file is not here")  # fmt: skip
    ap.add_argument("--sms", type=int, default=None, help="SMs the plans were made for (default: the price table's)")
    a = ap.parse_args(argv)
    import pandas as pd
    from qlabench_kernels import calibration

    try:
        price = calibration.from_file(a.price)
        overrides = dict(x.split("=", 1) for x in a.label)
        df = pd.read_parquet(a.dir)
        recs = rows_of(df, price, overrides, a.sms or price.sms)
    except (OSError, ValueError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("\n".join(report(recs, price.fwd.unit != "us")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
