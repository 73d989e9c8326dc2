"""Refit the planners' cost models (kernels/plan.py) to a run of their candidates side by side.

    python -m qlabench_tools.kernels.plan_refit fwd DIR [--json OUT]   # a run of configs/h200_fwd_paths.yaml
    python -m qlabench_tools.kernels.plan_refit bwd DIR [--json OUT]   # a run of configs/h200_bwd_splits.yaml

fwd: per point the latency of the fused kernel unsplit (``tl-fused``) and of fwd_o (``tl-bv64``,
with the segment length plan_split picks for it).
Fits, by least squares on log latency over those rows, the ms per model unit and the two constants
that decide between the fused kernel and fwd_o (the fused chunk step, prep's cost per chunk and
v-head; its per-q/k-head part ``prep_qk`` is held, every point priced with its own h_qk); fwd_o's
own constants, which pick its split, stay as they are, so every choice of the refit planner is one
of the measured rows.
bwd: per point the latency at every segment length (``tl-split<S>``, 0 = unsplit). The latency
is a per-point base (the stages the split does not change) plus the split chains' model
(``bwd_split_cost``), linear in its constants: fitted by non-negative least squares.

Both report, per point and as geomeans over the points where both choices are measured rows: the
planner's choice with its constants ("now"), with the refit ones ("new") and the best candidate,
each a row of the same run directory (the ratios pair rows of that directory only: one run, or a
run and its ``--resume``, which may be on another GPU), and the planned label
(``tilelang``) against the "now" row. A choice not measured at a point is None there and counted.
"""

import argparse
import dataclasses
import json
import math
import pathlib
import sys

import numpy as np

SMS = 132  # the H200's


def _plan():
    from qlabench_kernels import plan

    return plan


def _table():
    """The cost table the planners use off the GPU (the H200's), whose constants are refit."""
    from qlabench_kernels import calibration

    return calibration.default_table()


class RefitError(ValueError):
    """A run that cannot be refit (no ok rows, not the candidate labels, too few points)."""


def load(run_dir: pathlib.Path):
    import pandas as pd

    from qlabench.results import load as load_rows

    df = load_rows(run_dir, latest=True)
    df = df[df.status == "ok"].copy()
    if df.empty:
        raise RefitError(f"no ok rows under {run_dir}")
    df["lens"] = df.seqlens.apply(lambda s: tuple(int(x) for x in s))
    df["key"] = df.apply(lambda r: (int(r.h_qk), int(r.h_v), r.lens), axis=1)
    lat = df.pivot_table(index="key", columns="backend", values="latency_ms", aggfunc="median")
    return pd.DataFrame(lat)


def _geo(xs):
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def _ms(lat, key, label):
    """The measured latency of ``label`` at ``key``, or None (no such label, or no ok row there)."""
    if label is None or label not in lat.columns:
        return None
    v = lat.at[key, label]
    return None if v != v else float(v)


def fwd(run_dir, out_json=None):
    plan = _plan()
    lat = load(run_dir)
    need = ["tl-fused", "tl-bv64"]
    missing = [c for c in need if c not in lat.columns]
    if missing:
        raise RefitError(f"{run_dir} has no ok rows of {missing} (a run of configs/h200_fwd_paths.yaml)")
    lat = lat.dropna(subset=need)
    if len(lat) < 3:
        raise RefitError(f"{run_dir}: {len(lat)} points have ok rows of all of {need}; the fit needs 3")
    base = _table().fwd

    def seg_of(key, bv):
        h_qk, h_v, lens = key
        return plan.plan_split(sum(lens), len(lens), h_v, SMS, block_v=bv, seqlens=list(lens), h_qk=h_qk, costs=base)

    segs = {k: seg_of(k, 64) for k in lat.index}

    def model_units(key, label, costs):
        h_qk, h_v, lens = key
        if label == "tl-fused":
            return plan.split_cost(lens, h_v, 0, SMS, 128, h_qk=h_qk, costs=costs)
        return plan.split_cost(lens, h_v, segs[key], SMS, 64, h_qk=h_qk, costs=costs)

    from scipy.optimize import least_squares

    rows = [(k, lab, float(lat.at[k, lab])) for k in lat.index for lab in need]

    def resid(theta):
        u, f, p = np.exp(theta)
        costs = dataclasses.replace(base, fused=f, prep=p)
        return np.array([math.log(u * model_units(k, lab, costs)) - math.log(ms) for k, lab, ms in rows])

    x0 = np.log([1.08e-3, base.fused, base.prep])
    fit = least_squares(resid, x0)
    u, f, p = (float(v) for v in np.exp(fit.x))

    def choice(key, costs):
        h_qk, h_v, lens = key
        bv, seg = plan.plan_fwd(sum(lens), len(lens), h_v, SMS, seqlens=list(lens), h_qk=h_qk, costs=costs)
        if bv == 128:
            return "tl-fused" if seg == 0 else None  # the fused split path: not a candidate here
        return "tl-bv64"

    now = {k: choice(k, base) for k in lat.index}
    fitted = dataclasses.replace(base, fused=f, prep=p)
    new = {k: choice(k, fitted) for k in lat.index}

    per_point = []
    for k in lat.index:
        best = min(need, key=lambda c: lat.at[k, c])
        per_point.append(dict(
            heads=f"{k[0]}/{k[1]}", seqlens=list(k[2]), planned_ms=_ms(lat, k, "tilelang"),
            now=now[k], new=new[k], best=best, **{c: float(lat.at[k, c]) for c in need},
        ))  # fmt: skip
    res = _report("fwd", per_point, dict(ms_per_unit=u, fused=f, prep=p), dict(fused=base.fused, prep=base.prep))
    res["rms_log_error"] = float(np.sqrt(np.mean(fit.fun**2)))
    return _finish(res, out_json)


def bwd(run_dir, out_json=None):
    plan = _plan()
    lat = load(run_dir)
    labels = sorted((c for c in lat.columns if c.startswith("tl-split")), key=lambda c: int(c[len("tl-split") :]))
    if not labels:
        raise RefitError(f"{run_dir} has no ok tl-split<S> rows (a run of configs/h200_bwd_splits.yaml)")
    split_of = {c: int(c[len("tl-split") :]) for c in labels}
    base = _table().bwd
    names = [f.name for f in dataclasses.fields(base) if f.name != "unit"]
    keys = [k for k in lat.index if any(_ms(lat, k, c) is not None for c in labels)]

    def terms(key, seg):
        """bwd_split_cost's makespan factor of each constant (it is linear in them)."""
        _, h_v, lens = key
        out = []
        for n in names:
            unit = dataclasses.replace(base, **{m: float(m == n) for m in names})
            out.append(plan.bwd_split_cost(lens, h_v, seg, SMS, costs=unit))
        return out

    # unknowns: one base per point (µs), then the constants (µs per unit of each term)
    A, b = [], []
    for i, k in enumerate(keys):
        for c in labels:
            ms = _ms(lat, k, c)
            if ms is None:
                continue
            row = [0.0] * len(keys)
            row[i] = 1.0
            A.append(row + terms(k, split_of[c]))
            b.append(ms * 1000.0)
    if len(b) < len(keys) + len(names):
        raise RefitError(f"{run_dir}: {len(b)} rows for {len(keys) + len(names)} unknowns; the fit needs more")
    from scipy.optimize import nnls

    A, b = np.array(A), np.array(b)
    w = 1.0 / b  # relative error: every point counts alike
    x, _ = nnls(A * w[:, None], b * w)
    fitted = {n: float(v) for n, v in zip(names, x[len(keys) :])}
    rel = (A @ x - b) / b

    def choice(key, costs):
        _, h_v, lens = key
        lab = f"tl-split{plan.plan_bwd_split(sum(lens), len(lens), h_v, SMS, seqlens=list(lens), costs=costs)}"
        return lab if _ms(lat, key, lab) is not None else None  # None: a segment length not measured there

    now = {k: choice(k, base) for k in keys}
    refit_costs = dataclasses.replace(base, **fitted)
    new = {k: choice(k, refit_costs) for k in keys}

    per_point = []
    for k in keys:
        have = {c: ms for c in labels if (ms := _ms(lat, k, c)) is not None}
        per_point.append(dict(
            heads=f"{k[0]}/{k[1]}", seqlens=list(k[2]), planned_ms=_ms(lat, k, "tilelang"),
            now=now[k], new=new[k], best=min(have, key=have.get), measured=len(have), **have,
        ))  # fmt: skip
    res = _report("bwd", per_point, fitted, {n: getattr(base, n) for n in names})
    res["rms_rel_error"] = float(np.sqrt(np.mean(rel**2)))
    res["points_missing_candidates"] = sum(p["measured"] < len(labels) for p in per_point)
    return _finish(res, out_json)


def _report(kind, per_point, fitted, before):
    """Geomeans over the points where both choices (now and refit) are measured rows, so the three
    figures pair the same points; the rest are counted."""
    both = [p for p in per_point if p["now"] is not None and p["new"] is not None]
    res = dict(
        kind=kind, points=len(per_point), points_compared=len(both), constants_before=before,
        constants_fitted=fitted,
        geomean_ms=dict(best=_geo([p[p["best"]] for p in both]), now=_geo([p[p["now"]] for p in both]),
                        new=_geo([p[p["new"]] for p in both])),
        changed=sum(p["now"] != p["new"] for p in per_point),
        unmeasured_choices=dict(now=sum(p["now"] is None for p in per_point), new=sum(p["new"] is None for p in per_point)),
        per_point=per_point,
    )  # fmt: skip
    g = res["geomean_ms"]
    res.update(now_over_best=g["now"] / g["best"], new_over_best=g["new"] / g["best"], now_over_new=g["now"] / g["new"])
    planned = [p for p in both if p["planned_ms"] is not None]
    if planned:
        res["planned_over_now"] = _geo([p["planned_ms"] / p[p["now"]] for p in planned])
    return res


def _finish(res, out_json):
    def ms(p, lab):
        return f"{p[lab]:.4f}" if lab is not None else "-"

    print(f"{res['kind']}: {res['points']} points ({res['points_compared']} with both choices measured); "
          f"constants before {res['constants_before']}")  # fmt: skip
    print(f"  fitted {json.dumps({k: round(v, 5) for k, v in res['constants_fitted'].items()})}")
    g = res["geomean_ms"]
    print(f"  geomean ms: best candidate {g['best']:.4f}, planner now {g['now']:.4f} ({res['now_over_best']:.4f}x best), "
          f"refit {g['new']:.4f} ({res['new_over_best']:.4f}x best); choices changed on {res['changed']} points; "
          f"unmeasured choices now/new {res['unmeasured_choices']}")  # fmt: skip
    for p in res["per_point"]:
        if p["now"] != p["new"] or p["now"] != p["best"]:
            print(f"  {p['heads']:6s} {str(p['seqlens'])[:40]:40s} now {p['now']} {ms(p, p['now'])}  "
                  f"new {p['new']} {ms(p, p['new'])}  best {p['best']} {ms(p, p['best'])}")  # fmt: skip
    if out_json:
        pathlib.Path(out_json).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(out_json).write_text(json.dumps(res, indent=1))
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kind", choices=("fwd", "bwd"))
    ap.add_argument("run_dir", type=pathlib.Path)
    ap.add_argument("--json", type=pathlib.Path, default=None, help="write the fit and the per-point choices here")
    args = ap.parse_args(argv)
    if not args.run_dir.is_dir():
        print(f"error: run_dir {args.run_dir}: not a directory", file=sys.stderr)
        return 2
    try:
        (fwd if args.kind == "fwd" else bwd)(args.run_dir, args.json)
    except RefitError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
