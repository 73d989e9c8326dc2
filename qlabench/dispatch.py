"""A dispatch table an engine can load: per batch shape and head config, the backend to call.

``qlabench recommend DIR --out dispatch.json`` builds it from :func:`qlabench.results.latest` rows
(``ok`` rows only, one direction); :func:`load` reads it back; ``load(path).choose(h_qk, h_v,
seqlens)`` names the backend for one batch and ``load(path).kernel(h_qk, h_v, cu_seqlens)``
returns it as a call with the canonical GDN signature. The format is in ``docs/dispatch.md``.

**Features** (:func:`features`), in hardware terms, from h_qk, h_v, the sequence lengths and the
GPU's SM count (``sm_count``, from the rows' run metadata): ``num_seqs``; ``waves`` = h_v ×
num_seqs / SMs, the (sequence, v-head) recurrences per SM; ``max_len``, the longest sequence (its
recurrence is the longest serial chain); ``tokens_per_sm`` = total_tokens × h_v / SMs, the
token-heads (work) per SM; ``work_waves`` = total_tokens × h_v / (max_len × SMs), the work in SM
waves of the longest recurrence (how full the SMs are when every recurrence runs whole on one
SM); ``group`` = h_v / h_qk, the v-heads per q/k head. No feature names a head config.

**The tree** (:func:`fit`), CART: grown to :data:`MAX_DEPTH` by Gini impurity over each point's
winner-or-tie labels (a point where two labels tie counts half for each), every split at the
geometric midpoint of two neighbouring values of one feature (a batch at the midpoint goes with
the upper side); each node's choice is the label of least total cost over its points, a label's
cost at a point being 0 when it is the winner or ties with it, else its log-regret
``log(latency / best latency)`` (:data:`MISSING_PENALTY` without an ``ok`` row). It is then
pruned by cost complexity (total cost + α × leaves), α chosen by cross-validation inside the
points it was given: leave one head config out (leave one point out when they hold one head
config), the α of least held-out cost, the smallest on a tie (with few head configs the folds
often cannot tell; a split that lowers no cost is gone at α = 0). Ties between
splits go to the earlier feature, then the smaller threshold; between labels, to the one with
more ``ok`` points, then the name: the same rows give the same table. The leaves are the **buckets** (bounds half-open ``[lo, hi)``
over :data:`FEATURES`, ``null`` unbounded); per measured head config the table lists the buckets
that hold its batches with bounds over :data:`SHAPE` (:func:`_project`) and its own evidence.

**Choosing** (:meth:`Dispatch.choose`): the bucket whose bounds hold the batch. A measured head
config with points of its own in that bucket answers from it (``exact``); a bucket without a point
of the head config (``0/0``), or a head config that was not measured, names no choice of its own:
with ``fallback`` the answer comes from the bucket over all head configs (a bucket without any
point: from its parent node in the tree), and the reason says so; without, ``backend`` is None.

**Judging** (:func:`held_out`), twice: leave one layout out per model (the table rebuilt without
that point, then asked for it) and leave one head config out (rebuilt without any row of it, then
asked for all its points). The choice is *right* when it is the point's winner or a tie with it
(:func:`qlabench.analysis.is_tie` on the two rows' samples); ``regret`` = chosen latency / best
latency (a choice without an ``ok`` row at the point is wrong and counts the slowest ``ok``
latency). Reported: the fraction right (goal ≥ 90%) and the geomean regret (goal ≤ 1.03). A table
is also judged on the points of other results directories (:func:`check`, ``--check``).
"""

from __future__ import annotations

import json
import math
import numbers
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from decimal import ROUND_FLOOR, Decimal
from pathlib import Path

import numpy as np
import pandas as pd

from . import analysis, render
from .analysis import ALPHA, THRESHOLD, BadInput, is_tie, value, with_notes
from .render import Column

FORMAT = "qlabench-dispatch"
VERSION = 2
FEATURES = ("num_seqs", "waves", "max_len", "tokens_per_sm", "work_waves", "group")
FEATURE_DEFS = {
    "num_seqs": "sequences in the batch",
    "waves": "h_v * num_seqs / sm_count: (sequence, v-head) recurrences per SM",
    "max_len": "tokens of the longest sequence (the longest serial recurrence)",
    "tokens_per_sm": "total_tokens * h_v / sm_count: token-heads (work) per SM",
    "work_waves": "total_tokens * h_v / (max_len * sm_count): the work in SM waves of the "
                  "longest recurrence",
    "group": "h_v / h_qk: v-heads per q/k head",
}
#: integer features: their thresholds are whole numbers
INTEGER = ("num_seqs", "max_len")
#: the shape quantities of a head config's own buckets (``fill`` = total_tokens / max_len)
SHAPE = ("num_seqs", "max_len", "total_tokens", "fill")
MAX_DEPTH = 10
MISSING_PENALTY = math.log(4.0)
GOAL_ACCURACY = 0.90
GOAL_REGRET = 1.03
MODES = {"layout": "leave_one_layout_out", "head_config": "leave_one_head_config_out"}


# --------------------------------------------------------------------------- inputs


def _positive_int(name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
        raise ValueError(f"{name}={v!r}: must be a positive integer")
    return int(v)


def check_heads(h_qk, h_v) -> tuple[int, int]:
    """(h_qk, h_v) as ints; ValueError naming the value unless both are positive integers and h_v
    is a multiple of h_qk (v-head j reads q/k head j // (h_v / h_qk))."""
    hq, hv = _positive_int("h_qk", h_qk), _positive_int("h_v", h_v)
    if hv % hq:
        raise ValueError(f"h_v={hv} is not a multiple of h_qk={hq} "
                         "(v-head j reads q/k head j // (h_v/h_qk))")
    return hq, hv


def check_seqlens(seqlens) -> list[int]:
    """The lengths as ints; ValueError naming the value unless there is at least one and each is a
    positive integer."""
    try:
        s = list(seqlens)
    except TypeError:
        raise ValueError(f"seqlens={seqlens!r}: need a list of sequence lengths") from None
    if not s:
        raise ValueError("seqlens=[]: need at least one sequence length")
    for x in s:
        if isinstance(x, bool) or not isinstance(x, numbers.Integral) or x < 1:
            raise ValueError(f"seqlens={s!r}: length {x!r} is not a positive integer")
    return [int(x) for x in s]


def parse_heads(text: str, option: str = "--heads") -> tuple[int, int]:
    """``"H_QK/H_V"`` as :func:`check_heads` returns it; ValueError naming ``option`` and the text
    otherwise."""
    try:
        hq, hv = (int(x) for x in str(text).split("/"))
    except ValueError:
        raise ValueError(f"{option} {text!r}: expected H_QK/H_V, e.g. 16/64") from None
    try:
        return check_heads(hq, hv)
    except ValueError as e:
        raise ValueError(f"{option} {text!r}: {e}") from None


def parse_seqlens(text: str, option: str = "--seqlens") -> list[int]:
    """``"L1,L2,..."`` as :func:`check_seqlens` returns it; ValueError naming ``option`` and the
    text on an empty item, a non-integer or a length below 1."""
    items = [x.strip() for x in str(text).split(",")]
    if any(not x for x in items):
        raise ValueError(f"{option} {text!r}: an empty item; expected comma-separated lengths, "
                         "e.g. 4096,4096")
    try:
        lens = [int(x) for x in items]
    except ValueError:
        raise ValueError(f"{option} {text!r}: expected comma-separated lengths, "
                         "e.g. 4096,4096") from None
    try:
        return check_seqlens(lens)
    except ValueError as e:
        raise ValueError(f"{option} {text!r}: {e}") from None


def features(seqlens: Sequence[int], h_qk: int, h_v: int, sm_count: int | None = None) -> dict:
    """:data:`FEATURES` of a batch (module doc); ``sm_count`` None counts per GPU (1 SM).
    ValueError naming the value on an impossible head config or bad lengths."""
    hq, hv = check_heads(h_qk, h_v)
    s = check_seqlens(seqlens)
    sms = sm_count or 1
    n, total, longest = len(s), sum(s), max(s)
    return {"num_seqs": n, "waves": hv * n / sms, "max_len": longest,
            "tokens_per_sm": total * hv / sms, "work_waves": total * hv / (longest * sms),
            "group": hv / hq}


# --------------------------------------------------------------------------- points from rows


def points_of(df: pd.DataFrame, sm_count: int | None = None, alpha: float = ALPHA,
              threshold: float = THRESHOLD) -> list[dict]:
    """One dict per (point_key, direction) of latest rows ``df`` that has an ``ok`` row:
    identity, features, ``latency_ms`` and ``rows`` (the ok rows) per label, ``winner``,
    ``right`` (the labels that are the winner or tie with it) and ``log_regret`` per label."""
    out = []
    for (pk, d), g in df.groupby(["point_key", "direction"], sort=True):
        ok = [r for r in g.to_dict("records")
              if r["status"] == "ok" and value(r, "latency_ms") is not None]
        if not ok:
            continue
        ok.sort(key=lambda r: (r["latency_ms"], r["backend"]))
        r0 = ok[0]
        sl = [int(x) for x in r0["seqlens"]]
        hq, hv = int(r0["h_qk"]), int(r0["h_v"])
        try:
            feats = features(sl, hq, hv, sm_count)
        except ValueError as e:
            raise BadInput(f"point {pk}: {e}") from None
        rows = {r["backend"]: r for r in ok}
        right = sorted(b for b, r in rows.items()
                       if b == r0["backend"] or is_tie(r, r0, alpha, threshold))
        out.append({"point_key": pk, "direction": d, "model": r0["model"], "layout": r0["layout"],
                    "h_qk": hq, "h_v": hv, "seqlens": sl, "num_seqs": len(sl),
                    "total_tokens": sum(sl), "features": feats,
                    "latency_ms": {b: float(r["latency_ms"]) for b, r in rows.items()},
                    "rows": rows, "winner": r0["backend"], "right": right,
                    "best_ms": float(r0["latency_ms"]),
                    "log_regret": {b: math.log(r["latency_ms"] / r0["latency_ms"])
                                   for b, r in rows.items()}})
    return out


# --------------------------------------------------------------------------- the tree


def _matrices(pts: list[dict], labels: list[str]):
    """X [n, features], Y [n, labels] (winner-or-tie shares), C [n, labels] (cost: 0 for the
    winner and labels that tie with it, else log-regret; :data:`MISSING_PENALTY` without a row)."""
    X = np.array([[p["features"][f] for f in FEATURES] for p in pts], float).reshape(len(pts), -1)
    Y = np.zeros((len(pts), len(labels)))
    C = np.full((len(pts), len(labels)), MISSING_PENALTY)
    col = {b: j for j, b in enumerate(labels)}
    for i, p in enumerate(pts):
        for b in p["right"]:
            Y[i, col[b]] = 1.0 / len(p["right"])
        for b, lr in p["log_regret"].items():
            C[i, col[b]] = 0.0 if b in p["right"] else lr
    ok = np.zeros(C.shape, bool)
    for i, p in enumerate(pts):
        ok[i, [col[b] for b in p["latency_ms"]]] = True
    return X, Y, C, ok


def _gini(S: np.ndarray, n: np.ndarray) -> np.ndarray:
    """n × Gini impurity of label sums ``S`` [..., labels] over ``n`` points."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(n > 0, n - (S ** 2).sum(-1) / n, 0.0)


def _threshold(a: float, b: float, integer: bool):
    """A split value t between neighbours a < b (a < t <= b) at their geometric midpoint m, a
    batch exactly at m going with the upper side (t <= m): ceil(m) for an integer feature, else
    m rounded down to the fewest significant digits that keep t above a."""
    m = math.sqrt(a * b) if a > 0 else (a + b) / 2
    if integer:
        return int(math.ceil(m - 1e-9))
    e = math.floor(math.log10(m))
    for digits in range(2, 17):
        q = Decimal(1).scaleb(e - digits + 1)
        t = float((Decimal(m) / q).to_integral_value(rounding=ROUND_FLOOR) * q)
        if a < t <= b:
            return t
    return float(b)


def _best_split(X: np.ndarray, Y: np.ndarray):
    """(feature index, threshold) of the split that lowers the Gini impurity most; None when
    none lowers it. Ties: the earlier feature, then the smaller threshold."""
    n = len(X)
    total = Y.sum(0)
    base = _gini(total, np.float64(n))
    if base <= 1e-12:
        return None
    order = np.argsort(X, axis=0, kind="stable")                 # [n, F]
    xs = np.take_along_axis(X, order, 0)
    left = np.cumsum(Y[order], 0)[:-1]                           # [n-1, F, L]: first k+1 points
    nl = np.arange(1, n, dtype=float)[:, None]
    gain = base - _gini(left, nl) - _gini(total - left, n - nl)  # [n-1, F]
    gain = np.where(xs[1:] > xs[:-1], gain, -np.inf)
    best = gain.max(0)
    if not best.max() > 1e-12:
        return None
    j = int(np.nonzero(best >= best.max() - 1e-12)[0][0])
    k = int(np.nonzero(gain[:, j] >= best[j] - 1e-12)[0][0])
    return j, _threshold(xs[k, j], xs[k + 1, j], FEATURES[j] in INTEGER)


def _pick(C: np.ndarray, ok: np.ndarray) -> int:
    """The label (column) with the least total cost; ties: more ok points, then the name
    (columns are in name order)."""
    tot = np.round(C.sum(0), 12)
    return int(np.lexsort((np.arange(C.shape[1]), -ok.sum(0), tot))[0])


def _grow(X: np.ndarray, Y: np.ndarray, C: np.ndarray, ok: np.ndarray,
          max_depth: int = MAX_DEPTH) -> list[dict]:
    """The full tree as a node list (root first): each node its ``choice`` (column), ``cost``
    (its choice's total cost), ``n``, ``parent``, and ``feature``/``threshold``/``left``/
    ``right`` when split (left: feature < threshold)."""
    nodes: list[dict] = []

    def node(idx: np.ndarray, depth: int, parent: int | None) -> int:
        i = len(nodes)
        c = _pick(C[idx], ok[idx])
        nodes.append({"choice": c, "cost": float(C[idx, c].sum()), "n": len(idx), "parent": parent})
        split = _best_split(X[idx], Y[idx]) if depth < max_depth and len(idx) > 1 else None
        if split is not None:
            j, t = split
            left = X[idx, j] < t
            nodes[i].update(feature=j, threshold=t)
            nodes[i]["left"] = node(idx[left], depth + 1, i)
            nodes[i]["right"] = node(idx[~left], depth + 1, i)
        return i

    node(np.arange(len(X)), 0, None)
    return nodes


def _collapse_alphas(nodes: list[dict]) -> dict[int, float]:
    """Weakest-link pruning: per split node, the cost-complexity α (cost per extra leaf) at and
    above which it is a leaf. Along any root-to-leaf path these do not increase."""
    live = {i for i, n in enumerate(nodes) if "left" in n}
    out: dict[int, float] = {}
    last = 0.0
    while 0 in live:
        cost = [0.0] * len(nodes)
        leaves = [1] * len(nodes)
        for i in reversed(range(len(nodes))):  # children come after their parent
            n = nodes[i]
            if i in live:
                cost[i] = cost[n["left"]] + cost[n["right"]]
                leaves[i] = leaves[n["left"]] + leaves[n["right"]]
            else:
                cost[i] = n["cost"]
        g = {i: (nodes[i]["cost"] - cost[i]) / (leaves[i] - 1) for i in live}
        low = min(g.values())
        weakest = min(i for i in live if g[i] <= low + 1e-12)
        last = max(last, low)
        stack = [weakest]
        while stack:
            j = stack.pop()
            if j in live:
                out[j] = last
                live.discard(j)
                stack += [nodes[j]["left"], nodes[j]["right"]]
    return out


def _path_costs(nodes: list[dict], collapse: Mapping[int, float], cands: np.ndarray,
                x: np.ndarray, c: np.ndarray) -> np.ndarray:
    """Per pruning strength in ``cands`` (ascending), the cost ``c`` of the choice the tree
    pruned at it makes for features ``x``: node j answers for α in [its collapse α, its
    parent's)."""
    out = np.zeros(len(cands))
    j, prev = 0, len(cands)
    while True:
        split = "left" in nodes[j]
        lo = int(np.searchsorted(cands, collapse.get(j, math.inf), "left")) if split else 0
        out[lo:prev] = c[nodes[j]["choice"]]
        if lo == 0:
            return out
        prev = lo
        n = nodes[j]
        j = n["left"] if x[n["feature"]] < n["threshold"] else n["right"]


def _inner_folds(pts: list[dict]) -> list[np.ndarray]:
    heads = sorted({(p["h_qk"], p["h_v"]) for p in pts})
    if len(heads) > 1:
        return [np.array([i for i, p in enumerate(pts) if (p["h_qk"], p["h_v"]) == h]) for h in heads]
    return [np.array([i]) for i in range(len(pts))]


def fit(pts: list[dict], max_depth: int = MAX_DEPTH) -> dict:
    """The pruned tree over points ``pts`` (module doc): ``labels``, ``alpha`` (the pruning
    strength cross-validation chose) and ``nodes`` (root first; ``choice`` a label, ``feature``
    a name; a leaf has no ``feature``)."""
    labels = sorted({b for p in pts for b in p["latency_ms"]})
    X, Y, C, ok = _matrices(pts, labels)
    full = _grow(X, Y, C, ok, max_depth)
    collapse = _collapse_alphas(full)
    steps = sorted({0.0, *collapse.values()})
    cands = [steps[0]] + [math.sqrt(a * b) if a > 0 else b / 2 for a, b in zip(steps, steps[1:])]
    cands = np.array(cands + [steps[-1] * 2 + 1.0])
    cv = np.zeros(len(cands))
    for held in _inner_folds(pts):
        keep = np.setdiff1d(np.arange(len(pts)), held)
        if not len(keep):
            continue
        t = _grow(X[keep], Y[keep], C[keep], ok[keep], max_depth)
        tc = _collapse_alphas(t)
        for i in held:
            cv += _path_costs(t, tc, cands, X[i], C[i])
    # equal held-out cost: the larger tree (held out on few head configs, the folds often cannot
    # tell; splits that lower no cost are gone at alpha 0 already)
    alpha = float(cands[int(np.argmin(np.round(cv, 9)))])
    return {"labels": labels, "alpha": alpha, "nodes": _prune(full, collapse, alpha, labels)}


def _prune(nodes: list[dict], collapse: Mapping[int, float], alpha: float,
           labels: list[str]) -> list[dict]:
    """The nodes left at ``alpha``, renumbered root first, with labels and feature names."""
    out: list[dict] = []

    def copy(i: int, parent: int | None) -> int:
        n = nodes[i]
        k = len(out)
        out.append({"id": k, "parent": parent, "choice": labels[n["choice"]], "points": n["n"]})
        if "left" in n and collapse.get(i, math.inf) > alpha:
            out[k].update(feature=FEATURES[n["feature"]], threshold=n["threshold"])
            out[k]["left"] = copy(n["left"], k)
            out[k]["right"] = copy(n["right"], k)
        return k

    copy(0, None)
    return out


def leaf(nodes: Sequence[Mapping], feats: Mapping) -> int:
    """The index of the leaf of ``nodes`` whose bounds hold the features ``feats``."""
    i = 0
    while "feature" in nodes[i]:
        n = nodes[i]
        i = n["left"] if feats[n["feature"]] < n["threshold"] else n["right"]
    return i


# --------------------------------------------------------------------------- the table


def _geomean(xs: Iterable[float]) -> float | None:
    xs = list(xs)
    return float(math.exp(sum(math.log(x) for x in xs) / len(xs))) if xs else None


def _head(p: Mapping) -> str:
    return f"{p['h_qk']}/{p['h_v']}"


def _bounds(nodes: Sequence[Mapping], i: int) -> dict:
    b = {f: [None, None] for f in FEATURES}
    while nodes[i]["parent"] is not None:
        par = nodes[nodes[i]["parent"]]
        lo, hi = b[par["feature"]]
        t = par["threshold"]
        if i == par["left"]:
            b[par["feature"]] = [lo, t if hi is None else min(hi, t)]
        else:
            b[par["feature"]] = [t if lo is None else max(lo, t), hi]
        i = nodes[i]["parent"]
    return b


def _evidence(p: dict, choice: str | None) -> dict:
    right = choice in p["right"]
    pr = (analysis.pair(p["rows"][choice], p["rows"][p["winner"]])["pairing"]
          if choice in p["rows"] and choice != p["winner"] else "")
    return {"point_key": p["point_key"], "model": p["model"], "h_qk": p["h_qk"], "h_v": p["h_v"],
            "layout": p["layout"], "seqlens": p["seqlens"], "winner": p["winner"],
            "choice_ms": p["latency_ms"].get(choice), "best_ms": p["best_ms"],
            "choice_is_winner_or_tie": bool(right), "pairing": pr,
            "latency_ms": {b: round(v, 6) for b, v in sorted(p["latency_ms"].items())}}


def _bucket(pts: list[dict], labels: list[str]) -> dict:
    """Choice, runner-up, margin, regret and evidence over a bucket's points (none: no choice)."""
    if not pts:
        return {"choice": None, "runner_up": None, "margin": None, "regret": None, "points": 0,
                "winner_or_tie": 0, "head_configs": [], "evidence": []}
    _, _, C, ok = _matrices(pts, labels)
    tot = np.round(C.sum(0), 12)
    order = [labels[j] for j in np.lexsort((np.arange(len(labels)), -ok.sum(0), tot))]
    choice = order[0]
    runner = order[1] if len(order) > 1 else None
    margin = _geomean(p["latency_ms"][runner] / p["latency_ms"][choice] for p in pts
                      if runner in p["latency_ms"] and choice in p["latency_ms"]) if runner else None
    ev = [_evidence(p, choice)
          for p in sorted(pts, key=lambda p: (p["h_qk"], p["h_v"], p["num_seqs"],
                                              p["total_tokens"], p["point_key"]))]
    return {"choice": choice, "runner_up": runner, "margin": margin,
            "regret": _geomean(p["latency_ms"].get(choice, max(p["latency_ms"].values()))
                               / p["best_ms"] for p in pts),
            "points": len(pts), "winner_or_tie": sum(e["choice_is_winner_or_tie"] for e in ev),
            "head_configs": sorted({_head(p) for p in pts},
                                   key=lambda t: tuple(map(int, t.split("/")))),
            "evidence": ev}


def _project(bounds: Mapping, h_qk: int, h_v: int, sm_count: int | None) -> dict | None:
    """A bucket's bounds for one head config over :data:`SHAPE` (``waves`` folded into
    ``num_seqs``, ``tokens_per_sm`` into ``total_tokens``, ``work_waves`` into ``fill`` =
    total_tokens / max_len, ``group`` checked); None when the bucket holds no batch of it."""
    per = h_v / (sm_count or 1)
    scale = {"num_seqs": ("num_seqs", 1.0), "waves": ("num_seqs", per),
             "max_len": ("max_len", 1.0), "tokens_per_sm": ("total_tokens", per),
             "work_waves": ("fill", per)}
    out = {q: [None, None] for q in SHAPE}
    for f, (lo, hi) in bounds.items():
        if f == "group":
            g = h_v / h_qk
            if (lo is not None and g < lo) or (hi is not None and g >= hi):
                return None
            continue
        q, c = scale[f]
        for side, v in ((0, lo), (1, hi)):
            if v is None:
                continue
            v = v / c
            if q == "fill":
                v = float(f"{v:.4g}")
            else:  # whole numbers: [lo, hi) over the reals is [ceil lo, ceil hi)
                v = int(math.ceil(v - 1e-9))
            cur = out[q][side]
            out[q][side] = v if cur is None else (max(cur, v) if side == 0 else min(cur, v))
    lows = {"num_seqs": 1, "max_len": 1, "total_tokens": 1, "fill": 1.0}
    for q, (lo, hi) in out.items():
        if lo is not None and lo <= lows[q]:
            out[q][0] = lo = None
        if hi is not None and hi <= (lo if lo is not None else lows[q]):
            return None
    return out


def build(pts: list[dict], sm_count: int | None = None) -> dict:
    """The table over points of one direction: ``tree`` (:func:`fit`), ``buckets`` (its leaves,
    bounds over :data:`FEATURES`, choice and evidence over all head configs) and ``head_configs``
    (per measured head config, the buckets that hold its batches, bounds over :data:`SHAPE`, its
    own evidence; a bucket without a point of it names no choice)."""
    tree = fit(pts)
    nodes, labels = tree["nodes"], tree["labels"]
    at: dict[int, list[dict]] = {}
    for p in pts:
        at.setdefault(leaf(nodes, p["features"]), []).append(p)
    buckets = []
    for i, n in enumerate(nodes):
        if "feature" in n:
            continue
        b = {"id": len(buckets), "node": i, "bounds": _bounds(nodes, i),
             **_bucket(at.get(i, []), labels)}
        n["bucket"] = b["id"]
        buckets.append(b)
    heads: dict[tuple[int, int], list[dict]] = {}
    for p in pts:
        heads.setdefault((p["h_qk"], p["h_v"]), []).append(p)
    out = []
    for (hq, hv) in sorted(heads):
        hp = heads[(hq, hv)]
        mine = []
        for b in buckets:
            pb = _project(b["bounds"], hq, hv, sm_count)
            if pb is None:
                continue
            ev = [e for e in b["evidence"] if (e["h_qk"], e["h_v"]) == (hq, hv)]
            entry = {"bucket": b["id"], "bounds": pb, "choice": b["choice"] if ev else None,
                     "runner_up": b["runner_up"] if ev else None,
                     "margin": b["margin"] if ev else None, "points": len(ev),
                     "winner_or_tie": sum(e["choice_is_winner_or_tie"] for e in ev),
                     "evidence": ev}
            if not ev:
                entry["reason"] = (f"no {hq}/{hv} point measured in bucket {b['id']}; over all "
                                   "head configs it chooses "
                                   + (f"{b['choice']} ({b['points']} point(s) of "
                                      f"{', '.join(b['head_configs'])})" if b["choice"]
                                      else "nothing (no point)"))
                entry["fallback"] = b["choice"]
            mine.append(entry)
        out.append({"h_qk": hq, "h_v": hv, "models": sorted({p["model"] for p in hp}),
                    "points": len(hp), "buckets": mine})
    tree_out = {"alpha": tree["alpha"], "labels": labels, "nodes": nodes}
    return {"tree": tree_out, "buckets": buckets, "head_configs": out}


# --------------------------------------------------------------------------- choosing


@dataclass(frozen=True)
class Choice:
    """A dispatch answer: ``backend`` (a label, or None), why, and where it came from
    (``exact``: the head config has measured points in the bucket; ``bucket``: the id in
    ``buckets``)."""
    backend: str | None
    reason: str
    head_config: tuple[int, int] | None = None
    exact: bool = False
    bucket: int | None = None
    margin: float | None = None

    def __str__(self) -> str:
        return self.backend or ""


def _fmt_bounds(bounds: Mapping) -> str:
    def num(v):
        return f"{v:g}" if isinstance(v, float) else str(v)
    parts = []
    for f, (lo, hi) in bounds.items():
        if lo is None and hi is None:
            continue
        parts.append(f"{num(lo)} <= {f} < {num(hi)}" if lo is not None and hi is not None
                     else (f"{f} >= {num(lo)}" if lo is not None else f"{f} < {num(hi)}"))
    return ", ".join(parts) or "all shapes"


class Dispatch:
    """A loaded dispatch table (the JSON of ``docs/dispatch.md`` as ``data``)."""

    def __init__(self, data: dict):
        """ValueError naming what is wrong unless ``data`` is a table of this format and
        version: a JSON object with ``tree.nodes``, ``buckets`` and ``head_configs`` lists."""
        if not isinstance(data, dict):
            raise ValueError(f"not a {FORMAT} table: the JSON holds a {type(data).__name__}, not "
                             "an object; write one with `qlabench recommend`")
        if data.get("format") != FORMAT or data.get("version") != VERSION:
            raise ValueError(f"not a {FORMAT} version {VERSION} table (format "
                             f"{data.get('format')!r}, version {data.get('version')!r}); "
                             "rebuild it with `qlabench recommend`")
        tree = data.get("tree")
        nodes = tree.get("nodes") if isinstance(tree, dict) else None
        for key, v in (("tree.nodes", nodes), ("buckets", data.get("buckets")),
                       ("head_configs", data.get("head_configs"))):
            if not isinstance(v, list):
                raise ValueError(f"a {FORMAT} table without a {key} list; rebuild it with "
                                 "`qlabench recommend`")
        source = data.get("source")
        self.data = data
        self.nodes = nodes
        self.buckets = data["buckets"]
        self.sm_count = source.get("sm_count") if isinstance(source, dict) else None
        try:
            self.heads = {(int(h["h_qk"]), int(h["h_v"])): {b["bucket"]: b for b in h["buckets"]}
                          for h in data["head_configs"]}
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"head_configs: an entry without h_qk, h_v and buckets "
                             f"({type(e).__name__}: {e}); rebuild the table with "
                             "`qlabench recommend`") from None

    @property
    def direction(self) -> str:
        return self.data.get("direction", "fwd")

    def nearest(self, h_qk: int, h_v: int) -> tuple[int, int] | None:
        """The measured head config closest to (h_qk, h_v): h_v/h_qk ratio, then h_v (log)."""
        if not self.heads:
            return None
        r = math.log(h_v / h_qk)
        return min(self.heads, key=lambda k: (round(abs(math.log(k[1] / k[0]) - r), 9),
                                              round(abs(math.log(k[1] / h_v)), 9), k))

    def choose(self, h_qk: int, h_v: int, seqlens: Sequence[int], fallback: bool = True) -> Choice:
        """The backend label for a batch of ``seqlens`` (one length per sequence) on h_qk
        query/key heads and h_v value heads (module doc). ValueError naming the value on an
        impossible head config (not positive integers, h_v not a multiple of h_qk) or on empty or
        non-positive lengths."""
        feats = features(seqlens, h_qk, h_v, self.sm_count)
        key = (int(h_qk), int(h_v))
        i = leaf(self.nodes, feats)
        b = self.buckets[self.nodes[i]["bucket"]]
        where = f"bucket {b['id']} ({_fmt_bounds(b['bounds'])})"
        if key in self.heads:
            own = self.heads[key].get(b["id"])
            if own is not None and own["points"] and own["choice"] is not None:
                m = own.get("margin")
                return Choice(own["choice"], f"{where}: {own['choice']}"
                              + (f", {m:.3f}x ahead of {own['runner_up']}" if m else "")
                              + f" on {own['winner_or_tie']}/{own['points']} of {h_qk}/{h_v}'s "
                              f"measured point(s) (winner or tie)", key, True, b["id"], m)
            why = f"{h_qk}/{h_v} has no measured point in {where}"
        else:
            near = self.nearest(*key)
            why = f"{h_qk}/{h_v} was not measured (nearest measured: {near[0]}/{near[1]})"
        if not fallback:
            return Choice(None, why + "; fallback off", key, False, b["id"])
        j = i
        while self.nodes[j].get("choice") is None and self.nodes[j]["parent"] is not None:
            j = self.nodes[j]["parent"]
        n = self.nodes[j]
        if n.get("choice") is None:
            return Choice(None, why + "; the table names no backend there", key, False, b["id"])
        if j == i:
            m = b.get("margin")
            return Choice(b["choice"], why + f"; answered from {where} over all head configs: "
                          f"{b['choice']}" + (f", {m:.3f}x ahead of {b['runner_up']}" if m else "")
                          + f" on {b['points']} point(s) of {', '.join(b['head_configs'])}",
                          key, False, b["id"], m)
        return Choice(n["choice"], why + f"; {where} has no measured point: answered from its "
                      f"parent node {j} ({n['points']} point(s)): {n['choice']}", key, False, b["id"])

    def kernel(self, h_qk: int, h_v: int, cu_seqlens, fallback: bool = True) -> Kernel:
        """The chosen backend for the batch ``cu_seqlens`` ([0, l1, l1+l2, ...], a tensor or a
        list) as a :class:`Kernel`: a call with the canonical GDN signature. ValueError on bad
        input; LookupError when the table names no backend; :class:`BackendUnavailable` when the
        chosen one cannot run here (the reason)."""
        lens = _lengths(cu_seqlens)
        c = self.choose(h_qk, h_v, lens, fallback)
        if c.backend is None:
            raise LookupError(f"no backend for {h_qk}/{h_v} {lens}: {c.reason}")
        src = self.data.get("source", {}).get("backends", {}).get(c.backend, {})
        return kernel_of(c.backend, h_qk, h_v, cu_seqlens, self.direction,
                         name=src.get("backend_name"), params=src.get("params"), choice=c)


def load(path: str | Path) -> Dispatch:
    """Read a dispatch table written by ``qlabench recommend``: OSError where the file cannot be
    read (a directory, missing), ValueError where it is not JSON or not such a table
    (:class:`Dispatch`)."""
    return Dispatch(json.loads(Path(path).read_text()))


# --------------------------------------------------------------------------- the kernel


class BackendUnavailable(RuntimeError):
    """The chosen backend cannot run here (its library or GPU is missing): the message says why."""


def _lengths(cu_seqlens) -> list[int]:
    cu = cu_seqlens.tolist() if hasattr(cu_seqlens, "tolist") else list(cu_seqlens)
    if (len(cu) < 2 or any(isinstance(x, (list, tuple)) for x in cu) or cu[0] != 0):
        raise ValueError(f"cu_seqlens={cu!r}: need [0, l1, l1+l2, ...] with at least one sequence")
    lens = [b - a for a, b in zip(cu, cu[1:])]
    if any(x < 1 for x in lens):
        raise ValueError(f"cu_seqlens={cu!r}: every sequence needs at least one token "
                         f"(lengths {lens})")
    return check_seqlens(lens)


class Kernel:
    """A backend as one call with the canonical GDN signature (FLA's conventions:
    ``docs/backends.md``):

    ``kernel(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=True,
    cu_seqlens=None, do=None, dht=None)``

    q, k [1, T, H_qk, K]; v [1, T, H_v, V]; g (log-space decay), beta [1, T, H_v] fp32;
    initial_state [N, H_v, K, V] fp32 or None; cu_seqlens [N+1] int64 (default: the batch it was
    chosen for; another layout raises ValueError). A forward table's kernel returns (o [1, T, H_v,
    V], final_state [N, H_v, K, V] or None); a backward one's (``do`` [1, T, H_v, V] and ``dht``
    needed) the gradients dq, dk, dv, dg, dbeta, dh0 as a dict. Each call converts the inputs to
    the library's conventions and its outputs back (``Backend.prepare``,
    ``outputs_to_canonical``), as the harness does before timing."""

    def __init__(self, label: str, backend, h_qk: int, h_v: int, cu_seqlens, direction: str,
                 choice: Choice | None = None):
        self.label, self.backend, self.direction, self.choice = label, backend, direction, choice
        self.h_qk, self.h_v = h_qk, h_v
        self.seqlens = _lengths(cu_seqlens)
        self._cu = cu_seqlens

    def __repr__(self) -> str:
        return (f"Kernel({self.label!r}, backend {self.backend.name!r}, {self.h_qk}/{self.h_v}, "
                f"{self.direction}, seqlens {self.seqlens})")

    def __call__(self, q, k, v, g, beta, scale=None, initial_state=None, output_final_state=True,
                 cu_seqlens=None, do=None, dht=None):
        import torch

        from .workloads import Inputs
        cu = self._cu if cu_seqlens is None else cu_seqlens
        if cu_seqlens is not None and _lengths(cu_seqlens) != self.seqlens:
            raise ValueError(f"cu_seqlens gives lengths {_lengths(cu_seqlens)}; this kernel was "
                             f"chosen for {self.seqlens}: ask the table again for that batch")
        if not isinstance(cu, torch.Tensor):
            cu = torch.tensor(list(cu), dtype=torch.int64, device=q.device)
        T = sum(self.seqlens)
        for name, t, heads in (("q", q, self.h_qk), ("k", k, self.h_qk), ("v", v, self.h_v)):
            if t.dim() != 4 or t.shape[0] != 1 or t.shape[1] != T or t.shape[2] != heads:
                raise ValueError(f"{name} has shape {tuple(t.shape)}: expected [1, {T}, {heads}, "
                                 "head_dim] for this kernel's batch and head config")
        if self.direction != "fwd" and do is None:
            raise ValueError(f"a {self.direction} kernel needs do (the output gradient)")
        x = Inputs(q=q, k=k, v=v, g=g, beta=beta, h0=initial_state, cu_seqlens=cu,
                   scale=q.shape[-1] ** -0.5 if scale is None else float(scale),
                   output_final_state=bool(output_final_state), do=do, dht=dht)
        prepared = self.backend.prepare(x, self.direction)
        out = self.backend.outputs_to_canonical(prepared.fn(), x, self.direction)
        if self.direction == "fwd":
            return out["o"], (out.get("final_state") if output_final_state else None)
        return out


def kernel_of(label: str, h_qk: int, h_v: int, cu_seqlens, direction: str = "fwd",
              name: str | None = None, params: Mapping | None = None,
              choice: Choice | None = None) -> Kernel:
    """Backend ``name`` (default: ``label`` before any ``@``) with ``params`` as a
    :class:`Kernel` for the batch ``cu_seqlens``; its library is imported only now.
    :class:`BackendUnavailable` when it is not registered, cannot run here, or imports another
    version than a label's ``@<version>`` asks for."""
    from . import backends
    check_heads(h_qk, h_v)
    name = name or label.split("@")[0]
    try:
        b = backends.get(name, params)
    except backends.UnknownBackend as e:
        raise BackendUnavailable(f"{label}: {e}") from None
    who = label if label == name else f"{label} ({name})"
    ok, why = b.available()
    if not ok:
        raise BackendUnavailable(f"{who} cannot run here: {why}")
    from .config import label_version_problem
    wrong = label_version_problem(label, b.version())  # flashinfer@0.7.4 where 0.6.13 imports
    if wrong:
        raise BackendUnavailable(f"{who} cannot run here: {wrong} (put that version first on "
                                 "PYTHONPATH, as the table's run did)")
    if direction not in b.directions:
        raise BackendUnavailable(f"{who} has no {direction} pass")
    return Kernel(label, b, int(h_qk), int(h_v), cu_seqlens, direction, choice)


# --------------------------------------------------------------------------- judging


def _judge(p: dict, ch: str | None) -> tuple[bool, float]:
    if ch in p["latency_ms"]:
        return ch in p["right"], p["latency_ms"][ch] / p["best_ms"]
    return False, max(p["latency_ms"].values()) / p["best_ms"]


def _figures(pts: list[dict], chosen: list[str | None], method: str) -> dict:
    """Fraction right, geomean and worst regret, per model, misses of choices for points."""
    per_model: dict[str, dict] = {}
    misses, logs, n_right = [], [], 0
    for p, ch in zip(pts, chosen):
        right, regret = _judge(p, ch)
        n_right += right
        logs.append(math.log(regret))
        m = per_model.setdefault(p["model"], {"model": p["model"], "h_qk": p["h_qk"],
                                              "h_v": p["h_v"], "points": 0, "right": 0, "_l": []})
        m["points"] += 1
        m["right"] += right
        m["_l"].append(math.log(regret))
        if not right:
            misses.append({"model": p["model"], "h_qk": p["h_qk"], "h_v": p["h_v"],
                           "layout": p["layout"], "point_key": p["point_key"], "chosen": ch,
                           "winner": p["winner"], "regret": regret})
    n = len(pts)
    models = []
    for m in per_model.values():
        m["accuracy"] = m["right"] / m["points"]
        m["geomean_regret"] = float(math.exp(np.mean(m.pop("_l"))))
        models.append(m)
    acc = n_right / n if n else None
    reg = float(math.exp(np.mean(logs))) if n else None
    return {"method": method, "points": n, "right": int(n_right), "accuracy": acc,
            "geomean_regret": reg, "max_regret": float(math.exp(max(logs))) if n else None,
            "goal": {"accuracy": GOAL_ACCURACY, "geomean_regret": GOAL_REGRET},
            "meets_goal": bool(n and acc >= GOAL_ACCURACY and reg <= GOAL_REGRET),
            "per_model": models, "misses": misses}


def held_out(pts: list[dict], mode: str = "layout") -> dict:
    """Judge the table on points it was built without (module doc): ``mode`` ``layout`` (leave
    one layout out per model) or ``head_config`` (leave one head config out)."""
    if mode == "layout":
        groups = [[i] for i in range(len(pts))]
        method = ("leave-one-layout-out per model: the table rebuilt without that model's row of "
                  "the layout, then asked to choose for it")
    elif mode == "head_config":
        heads = sorted({(p["h_qk"], p["h_v"]) for p in pts})
        groups = [[i for i, p in enumerate(pts) if (p["h_qk"], p["h_v"]) == h] for h in heads]
        method = ("leave-one-head-config-out: the table rebuilt without any row of that head "
                  "config, then asked to choose for all its points")
    else:
        raise ValueError(f"mode {mode!r}: layout | head_config")
    chosen: list[str | None] = [None] * len(pts)
    for g in groups:
        out = set(g)
        rest = [q for i, q in enumerate(pts) if i not in out]
        if not rest:
            continue
        nodes = fit(rest)["nodes"]
        for i in g:
            chosen[i] = nodes[leaf(nodes, pts[i]["features"])]["choice"]
    return _figures(pts, chosen, method + "; right = the point's winner or a tie with it")


def check(table: Dispatch, pts: list[dict], path: str | Path) -> dict:
    """The table (``choose`` with fallback) judged on the points of another results directory."""
    chosen = [table.choose(p["h_qk"], p["h_v"], p["seqlens"]).backend for p in pts]
    out = _figures(pts, chosen, f"the table asked to choose for every point of {path} with an ok "
                                f"{table.direction} row; right = the point's winner or a tie with it")
    return {"dir": str(path), **out}


# --------------------------------------------------------------------------- the command


def source_of(df: pd.DataFrame, path: Path, sm_count: int | None = None) -> dict:
    """Where the rows came from: directory, runs, campaigns, GPUs (and SM count), labels with their
    library, versions and parameters."""
    def uniq(c):
        return sorted({str(v) for v in df[c].dropna() if str(v)}) if c in df.columns else []
    labels = {}
    for b, g in df.groupby("backend"):
        params = {}
        if "backend_params" in g:
            raw = g["backend_params"].dropna()
            if len(raw):
                v = raw.iloc[0]
                params = json.loads(v) if isinstance(v, str) and v else dict(v or {})
        labels[b] = {"backend_name": str(g["backend_name"].iloc[0]) if "backend_name" in g else b,
                     "versions": sorted({str(v) for v in g["backend_version"].dropna()}),
                     "params": params}
    return {"dir": str(path), "rows": int(len(df)), "run_ids": uniq("run_id"),
            "campaign_ids": uniq("campaign_id"), "gpus": uniq("gpu_name"),
            "gpu_uuids": uniq("gpu_uuid"), "sm_count": sm_count, "dtypes": uniq("dtype"),
            "head_dims": sorted({int(v) for v in df["head_dim"].dropna()}),
            "gate_recipes": uniq("gate_recipe"), "backends": labels}


def sm_count_of(path: Path, run_ids: Iterable[str]) -> int | None:
    """The SM count the run metadata of ``run_ids`` records (``env.sm_count``); None when none
    does; BadInput when they differ."""
    from . import results
    ids, seen = set(run_ids), set()
    for r, m in results.load_meta(path).items():
        env = m.get("env") if isinstance(m, dict) else None
        v = env.get("sm_count") if isinstance(env, dict) else None
        if r in ids and isinstance(v, int) and not isinstance(v, bool) and v > 0:
            seen.add(v)
    if len(seen) > 1:
        raise BadInput(f"{path}: rows from GPUs with different SM counts ({sorted(seen)}): "
                       "one table per GPU")
    return seen.pop() if seen else None


def recommend(df: pd.DataFrame, path: Path, direction: str = "fwd", alpha: float = ALPHA,
              threshold: float = THRESHOLD, sm_count: int | None = None,
              checks: Sequence[tuple[Path, pd.DataFrame]] = ()) -> dict:
    """The dispatch table (a JSON-ready dict) over latest rows ``df`` of one direction, judged
    held out both ways and on the latest rows of each ``checks`` directory."""
    ok = df[(df["direction"] == direction) & (df["status"] == "ok")]
    pts = points_of(ok, sm_count, alpha, threshold)
    if not pts:
        raise BadInput(f"{path}: no ok {direction} rows to recommend from")
    table = {"format": FORMAT, "version": VERSION, "direction": direction,
             "created_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
             "source": source_of(ok, path, sm_count),
             "rule": {"features": list(FEATURES), "feature_defs": FEATURE_DEFS,
                      "bounds": "[lo, hi), null = unbounded",
                      "grow": f"CART to depth {MAX_DEPTH}: the split that lowers the Gini impurity "
                              "of the points' winner-or-tie labels most",
                      "choice": "least total cost over the node's points: 0 for the winner and "
                                "labels that tie with it, else log(latency / best) (log "
                                f"{math.exp(MISSING_PENALTY):g} without an ok row)",
                      "prune": "cost complexity (cost + alpha x leaves), alpha by "
                               "leave-one-head-config-out cross-validation on the points (the "
                               "smallest of least held-out cost)",
                      "alpha": None,
                      "max_depth": MAX_DEPTH,
                      "tie": {"alpha": alpha, "threshold": threshold,
                              "test": "two-sided Mann-Whitney U on samples_ms"},
                      "fallback": "a bucket without a point of the head config (or a head config "
                                  "not measured): the bucket's choice over all head configs; a "
                                  "bucket without any point: its parent node's"},
             **build(pts, sm_count)}
    table["rule"]["alpha"] = table["tree"]["alpha"]
    table["held_out"] = {MODES[m]: held_out(pts, m) for m in MODES}
    d = Dispatch(table)
    table["checks"] = []
    for cpath, cdf in checks:
        cok = cdf[(cdf["direction"] == direction) & (cdf["status"] == "ok")]
        cpts = points_of(cok, sm_count, alpha, threshold)
        if not cpts:
            raise BadInput(f"--check {cpath}: no ok {direction} rows")
        other = sorted(set(cok["gpu_name"].dropna()) - set(table["source"]["gpus"]))
        if other:
            raise BadInput(f"--check {cpath}: rows measured on {', '.join(other)}; the table's "
                           f"on {', '.join(table['source']['gpus'])}")
        table["checks"].append(check(d, cpts, cpath))
    return table


def _line(name: str, f: dict) -> str:
    return (f"{name} ({f['points']} points): {f['right']}/{f['points']} = {f['accuracy']:.1%} "
            f"winner or tie (goal >= {GOAL_ACCURACY:.0%}), geomean regret "
            f"{f['geomean_regret']:.4f}x (goal <= {GOAL_REGRET:.2f}), worst {f['max_regret']:.3f}x"
            + ("" if f["meets_goal"] else "  [below goal]"))


#: the recommend table's columns (:mod:`qlabench.render`): the bounds wrap; runner-up and margin
#: are left out together in a narrow terminal
TABLE_COLUMNS = [Column("h_qk/h_v"), Column("bucket", "right"), Column("shapes", wrap=True, min_width=24),
           Column("choice"), Column("runner-up", drop=1), Column("margin", "right", drop=1),
           Column("winner/tie", "right")]


def print_table(table: dict, console, width: int | None = None) -> None:
    """The table per head config and bucket, fitted to ``width`` columns (None: every column at
    its natural width; :mod:`qlabench.render`), then the held-out and check figures and misses."""
    rows = []
    for h in table["head_configs"]:
        own = [b for b in h["buckets"] if b["points"]]
        empty = [b for b in h["buckets"] if not b["points"]]
        for i, b in enumerate(own):
            rows.append([f"{h['h_qk']}/{h['h_v']}" if i == 0 else "", str(b["bucket"]),
                         _fmt_bounds(b["bounds"]), b["choice"], b["runner_up"] or "",
                         f"{b['margin']:.3f}×" if b["margin"] else "",
                         f"{b['winner_or_tie']}/{b['points']}"])
        if empty:
            rows.append(["" if own else f"{h['h_qk']}/{h['h_v']}", "–",
                         f"bucket{'s' * (len(empty) > 1)} "
                         f"{', '.join(str(b['bucket']) for b in empty)}: no measured point, "
                         "answered from all head configs", "–", "", "", "0/0"])
    render.table(console, TABLE_COLUMNS, rows, width,
                 title=f"dispatch ({table['direction']}) from {table['source']['dir']}: per head "
                       "config, the buckets that hold its batches")

    def say(text: str) -> None:
        render.line(console, text, width)

    ho = table["held_out"]
    for key, name in ((MODES["layout"], "held out, leave-one-layout-out per model"),
                      (MODES["head_config"], "held out, leave-one-head-config-out")):
        say(_line(name, ho[key]))
    for c in table.get("checks", []):
        say(_line(f"check on {c['dir']}", c))
    for key, tag in ((MODES["layout"], "layout"), (MODES["head_config"], "head config")):
        for m in ho[key]["misses"]:
            say(f"  miss ({tag} held out): {m['model']} {m['layout']}: chose "
                f"{m['chosen']}, winner {m['winner']} ({m['regret']:.3f}×)")
    for c in table.get("checks", []):
        for m in c["misses"]:
            say(f"  miss (check {c['dir']}): {m['model']} {m['layout']}: chose "
                f"{m['chosen']}, winner {m['winner']} ({m['regret']:.3f}×)")


def recommend_cmd(path: Path, out: Path, direction: str = "fwd", backends: str | None = None,
                  alpha: float = ALPHA, threshold: float = THRESHOLD,
                  checks: Sequence[Path] = (), wide: bool = False) -> int:
    """``qlabench recommend DIR --out FILE [--check DIR2]``: table and held-out figures on
    stdout fitted to the terminal (:func:`qlabench.render.terminal_width`; ``wide``: every
    column), JSON at ``out``; exit 2 with a message on bad input (missing/empty dir, no ok rows,
    a --backends label without rows, a --check directory without ok rows or of another GPU)."""
    from rich.console import Console

    from .summary import load_latest
    width = render.terminal_width(wide)
    console = render.console(width)
    err = Console(stderr=True, soft_wrap=True)
    notes: list[str] = []
    try:
        df = load_latest(path, notes)
        want = None
        if backends:
            want = [b.strip() for b in backends.split(",") if b.strip()]
            bad = [b for b in want if b not in set(df["backend"])]
            if bad:
                raise BadInput(f"--backends: {', '.join(bad)} not in {path} (it holds "
                               f"{', '.join(sorted(set(df['backend'].dropna())))})")
            df = df[df["backend"].isin(want)]
        used = df[(df["direction"] == direction) & (df["status"] == "ok")]
        sms = sm_count_of(Path(path), set(used["run_id"].dropna()) if "run_id" in used else ())
        cdfs = []
        for c in checks:
            cdf = load_latest(c, notes)
            cdfs.append((Path(c), cdf[cdf["backend"].isin(want)] if want else cdf))
        table = recommend(df, Path(path), direction, alpha, threshold, sms, cdfs)
    except BadInput as e:
        err.print(f"error: {with_notes(e, notes)}", highlight=False, markup=False)
        return 2
    for n in notes:
        render.line(console, f"note: {n}", width)
    print_table(table, console, width)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(table, indent=1, default=_json_default))
    render.line(console, f"wrote {out}", width)
    return 0


def choose_cmd(table_path: Path, heads: str, seqlens: str, fallback: bool = True) -> int:
    """``qlabench choose TABLE --heads H_QK/H_V --seqlens L1,L2,...``: the backend and why on
    stdout; exit 1 when the table names none; exit 2 with one line on bad input."""
    import sys

    from rich.console import Console
    err = Console(stderr=True, soft_wrap=True)
    try:
        try:
            table = load(table_path)
        except FileNotFoundError:
            raise BadInput(f"{table_path}: no such file") from None
        except OSError as e:
            raise BadInput(f"{table_path}: {e.strerror or e}") from None
        except (ValueError, TypeError) as e:
            raise BadInput(f"{table_path}: {e}") from None
        try:
            hq, hv = parse_heads(heads)
            lens = parse_seqlens(seqlens)
        except (ValueError, TypeError) as e:
            raise BadInput(str(e)) from None
        try:
            c = table.choose(hq, hv, lens, fallback)
        except (KeyError, IndexError, TypeError) as e:  # nodes or buckets of another shape
            raise BadInput(f"{table_path}: a malformed tree or bucket ({type(e).__name__}: {e}); "
                           "rebuild it with `qlabench recommend`") from None
    except BadInput as e:
        err.print(f"error: {e}", highlight=False, markup=False)
        return 2
    sys.stdout.write(f"{c.backend or 'none'}\n{c.reason}\n")
    return 0 if c.backend else 1


def _json_default(o):
    if isinstance(o, np.integer):
        return int(o)
    if isinstance(o, np.floating):
        return float(o)
    if isinstance(o, np.bool_):
        return bool(o)
    raise TypeError(f"{type(o).__name__} is not JSON serialisable")
