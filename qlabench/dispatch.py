"""A dispatch table an engine can load: per head config and shape bucket, the backend to call.

``qlabench recommend DIR --out dispatch.json`` builds it from :func:`qlabench.results.latest` rows
(``ok`` rows only, one direction); :func:`load` reads it back and
``load(path).choose(h_qk, h_v, seqlens)`` answers for one batch. The format is in
``docs/dispatch.md``.

**Buckets** (:func:`build`). Each point is described by :data:`FEATURES` of its batch:
``num_seqs``, ``max_len`` (longest sequence), ``total_tokens``, ``seq_heads`` (h_v × num_seqs)
and ``h_v``. The points of every head config are split together, CART-style, into axis-aligned
buckets: a node's choice is the label with the least total log-regret over its points
(``log(latency / best latency)``, :data:`MISSING_PENALTY` where the label has no ``ok`` row); a
node is split at the threshold (geometric midpoint of two neighbouring values of one feature,
rounded up) that lowers that total most, if it lowers it by at least :data:`MIN_GAIN` (≥ 2%
latency summed over its points), leaves each side :data:`MIN_POINTS` points and the depth stays
≤ :data:`MAX_DEPTH`. Ties between splits go to the earlier feature, then the smaller threshold;
between labels, to the one with more ``ok`` points, then the name — the same rows give the same
table. Bounds are half-open ``[lo, hi)``, ``null`` meaning unbounded. Per measured head config
the table lists the buckets that hold its batches, with bounds over :data:`SHAPE` only
(``seq_heads`` and ``h_v`` folded in, :func:`_project`) and that head config's own evidence.

**Choosing** (:meth:`Dispatch.choose`): a measured head config answers from its own buckets; an
unseen one from the bucket over all head configs whose bounds hold the batch (the reason names
the nearest measured head config: closest ``h_v / h_qk`` ratio, then closest ``h_v``); with
``fallback=False`` the answer is ``backend=None`` with the reason.

**Judging** (:func:`leave_one_out`): per model and layout (point), the table is rebuilt without
that model's row of the layout and asked to choose for it. The choice is *right* when it is the
point's winner or a tie with it (:func:`qlabench.analysis.is_tie` on the two rows' samples);
``regret`` = chosen latency / best latency (a choice without an ``ok`` row at the held-out point
is wrong and counts the slowest ``ok`` latency there). Reported: the fraction right (goal ≥ 90%)
and the geomean regret (goal ≤ 1.03).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from . import analysis
from .analysis import ALPHA, THRESHOLD, BadInput, is_tie, value

FORMAT = "qlabench-dispatch"
VERSION = 1
FEATURES = ("num_seqs", "max_len", "total_tokens", "seq_heads", "h_v")
#: the shape features of a head config's own buckets
SHAPE = ("num_seqs", "max_len", "total_tokens")
MIN_POINTS = 2
MAX_DEPTH = 4
MIN_GAIN = math.log(1.02)
MISSING_PENALTY = math.log(4.0)
GOAL_ACCURACY = 0.90
GOAL_REGRET = 1.03


def features(seqlens: Sequence[int], h_v: int) -> dict[str, int]:
    """:data:`FEATURES` of a batch: ``num_seqs``, ``max_len``, ``total_tokens``, ``seq_heads``
    (= h_v × num_seqs, the independent (sequence, v-head) recurrences) and ``h_v``."""
    s = [int(x) for x in seqlens]
    if not s or min(s) < 0:
        raise ValueError(f"seqlens {list(seqlens)!r}: need at least one length >= 0")
    return {"num_seqs": len(s), "max_len": max(s), "total_tokens": sum(s),
            "seq_heads": int(h_v) * len(s), "h_v": int(h_v)}


# --------------------------------------------------------------------------- points from rows


def points_of(df: pd.DataFrame) -> list[dict]:
    """One dict per (point_key, direction) of latest rows ``df`` that has an ``ok`` row:
    identity, features, ``latency_ms`` and ``rows`` (the ok rows) per label, ``winner``."""
    out = []
    for (pk, d), g in df.groupby(["point_key", "direction"], sort=True):
        ok = [r for r in g.to_dict("records")
              if r["status"] == "ok" and value(r, "latency_ms") is not None]
        if not ok:
            continue
        ok.sort(key=lambda r: (r["latency_ms"], r["backend"]))
        r0 = ok[0]
        sl = [int(x) for x in r0["seqlens"]]
        out.append({"point_key": pk, "direction": d, "model": r0["model"], "layout": r0["layout"],
                    "h_qk": int(r0["h_qk"]), "h_v": int(r0["h_v"]), "seqlens": sl,
                    **features(sl, int(r0["h_v"])), "latency_ms": {r["backend"]: float(r["latency_ms"]) for r in ok},
                    "rows": {r["backend"]: r for r in ok}, "winner": r0["backend"],
                    "best_ms": float(r0["latency_ms"]),
                    "log_regret": {r["backend"]: math.log(r["latency_ms"] / r0["latency_ms"])
                                   for r in ok}})
    return out


# --------------------------------------------------------------------------- building


def _cost(pts: list[dict], label: str) -> float:
    return sum(p["log_regret"].get(label, MISSING_PENALTY) for p in pts)


def _ranked(pts: list[dict]) -> list[tuple[float, str]]:
    labels = sorted({b for p in pts for b in p["latency_ms"]})
    n_ok = {b: sum(b in p["latency_ms"] for p in pts) for b in labels}
    return sorted(((_cost(pts, b), b) for b in labels), key=lambda cb: (round(cb[0], 12), -n_ok[cb[1]], cb[1]))


def _geomean(xs: Iterable[float]) -> float | None:
    xs = list(xs)
    return float(math.exp(sum(math.log(x) for x in xs) / len(xs))) if xs else None


def _best_split(pts: list[dict]):
    base = _ranked(pts)[0][0]
    best = None
    for f in FEATURES:
        vals = sorted({p[f] for p in pts})
        for a, b in zip(vals, vals[1:]):
            t = int(math.ceil(math.sqrt(a * b))) if a > 0 else b
            left = [p for p in pts if p[f] < t]
            right = [p for p in pts if p[f] >= t]
            if len(left) < MIN_POINTS or len(right) < MIN_POINTS:
                continue
            gain = base - _ranked(left)[0][0] - _ranked(right)[0][0]
            if best is None or gain > best[0] + 1e-12:
                best = (gain, f, t, left, right)
    return best


def _leaves(pts: list[dict], bounds: dict, depth: int) -> list[tuple[dict, list[dict]]]:
    s = _best_split(pts) if depth < MAX_DEPTH else None
    if s is None or s[0] < MIN_GAIN:
        return [(bounds, pts)]
    _, f, t, left, right = s
    lo, hi = bounds[f]
    return (_leaves(left, {**bounds, f: [lo, t]}, depth + 1)
            + _leaves(right, {**bounds, f: [t, hi]}, depth + 1))


def _bucket(bounds: dict, pts: list[dict], alpha: float, threshold: float,
            judge: bool = True) -> dict:
    ranked = _ranked(pts)
    choice = ranked[0][1]
    runner = ranked[1][1] if len(ranked) > 1 else None
    margin = _geomean(p["latency_ms"][runner] / p["latency_ms"][choice] for p in pts
                      if runner in p["latency_ms"] and choice in p["latency_ms"]) if runner else None
    ev = []
    for p in sorted(pts, key=lambda p: (p["num_seqs"], p["total_tokens"], p["point_key"])):
        right = choice in p["rows"] and (choice == p["winner"] or judge and is_tie(
            p["rows"][choice], p["rows"][p["winner"]], alpha, threshold))
        pr = (analysis.pair(p["rows"][choice], p["rows"][p["winner"]])["pairing"]
              if judge and choice in p["rows"] and choice != p["winner"] else "")
        ev.append({"point_key": p["point_key"], "model": p["model"], "h_qk": p["h_qk"],
                   "h_v": p["h_v"], "layout": p["layout"],
                   "seqlens": p["seqlens"], "winner": p["winner"],
                   "choice_ms": p["latency_ms"].get(choice), "best_ms": p["best_ms"],
                   "choice_is_winner_or_tie": bool(right), "pairing": pr,
                   "latency_ms": {b: round(v, 6) for b, v in sorted(p["latency_ms"].items())}})
    return {"bounds": {f: list(bounds[f]) for f in FEATURES}, "choice": choice,
            "runner_up": runner, "margin": margin,
            "regret": _geomean(p["latency_ms"].get(choice, max(p["latency_ms"].values()))
                               / p["best_ms"] for p in pts),
            "points": len(pts), "winner_or_tie": sum(e["choice_is_winner_or_tie"] for e in ev),
            "evidence": ev}


def _project(bounds: Mapping, h_v: int) -> dict | None:
    """A bucket's bounds for one head config: ``h_v`` fixed, ``seq_heads`` folded into
    ``num_seqs`` (h_v × num_seqs in [lo, hi) ⇔ num_seqs in [⌈lo/h_v⌉, ⌈hi/h_v⌉)); None when the
    bucket holds no batch of that head config."""
    lo, hi = bounds["h_v"]
    if (lo is not None and h_v < lo) or (hi is not None and h_v >= hi):
        return None
    n_lo, n_hi = bounds["num_seqs"]
    s_lo, s_hi = bounds["seq_heads"]
    los = [x for x in (n_lo, -(-s_lo // h_v) if s_lo is not None else None, 1) if x is not None]
    his = [x for x in (n_hi, -(-s_hi // h_v) if s_hi is not None else None) if x is not None]
    n_lo, n_hi = max(los), (min(his) if his else None)
    if n_hi is not None and n_hi <= n_lo:
        return None
    out = {f: list(bounds[f]) for f in SHAPE}
    out["num_seqs"] = [None if n_lo <= 1 else n_lo, n_hi]
    return out


def build(pts: list[dict], alpha: float = ALPHA, threshold: float = THRESHOLD,
          judge: bool = True) -> dict:
    """The table over points of one direction: ``buckets`` (the tree's leaves over every head
    config, bounds over :data:`FEATURES`) and ``head_configs`` (per measured head config, the
    buckets that hold its batches, bounds over :data:`SHAPE`, with its own evidence).
    ``judge=False`` skips the tie test in the evidence (``choice_is_winner_or_tie`` then means
    "is the winner"; the held-out loop only needs the choices)."""
    leaves = _leaves(pts, {f: [None, None] for f in FEATURES}, 0)
    buckets = []
    for i, (bd, lp) in enumerate(leaves):
        b = _bucket(bd, lp, alpha, threshold, judge)
        b["id"] = i
        b["head_configs"] = sorted({f"{p['h_qk']}/{p['h_v']}" for p in lp},
                                   key=lambda t: tuple(map(int, t.split("/"))))
        buckets.append(b)
    heads: dict[tuple[int, int], list[dict]] = {}
    for p in pts:
        heads.setdefault((p["h_qk"], p["h_v"]), []).append(p)
    out = []
    for (hq, hv) in sorted(heads):
        hp = heads[(hq, hv)]
        mine = []
        for b in buckets:
            pb = _project(b["bounds"], hv)
            if pb is None:
                continue
            ev = [e for e in b["evidence"] if (e["h_qk"], e["h_v"]) == (hq, hv)]
            mine.append({"bucket": b["id"], "bounds": pb, "choice": b["choice"],
                         "runner_up": b["runner_up"], "margin": b["margin"],
                         "points": len(ev), "winner_or_tie": sum(e["choice_is_winner_or_tie"]
                                                                 for e in ev),
                         "evidence": ev})
        out.append({"h_qk": hq, "h_v": hv, "models": sorted({p["model"] for p in hp}),
                    "points": len(hp), "buckets": mine})
    return {"buckets": buckets, "head_configs": out}


# --------------------------------------------------------------------------- choosing


@dataclass(frozen=True)
class Choice:
    """A dispatch answer: ``backend`` (a label, or None), why, and where it came from
    (``exact``: the head config was measured; ``bucket``: the id in ``buckets``)."""
    backend: str | None
    reason: str
    head_config: tuple[int, int] | None = None
    exact: bool = False
    bucket: int | None = None
    margin: float | None = None

    def __str__(self) -> str:
        return self.backend or ""


def _in(bounds: Mapping, feats: Mapping) -> bool:
    for f, (lo, hi) in bounds.items():
        v = feats[f]
        if (lo is not None and v < lo) or (hi is not None and v >= hi):
            return False
    return True


def _fmt_bounds(bounds: Mapping) -> str:
    parts = []
    for f, (lo, hi) in bounds.items():
        if lo is None and hi is None:
            continue
        parts.append(f"{lo} <= {f} < {hi}" if lo is not None and hi is not None
                     else (f"{f} >= {lo}" if lo is not None else f"{f} < {hi}"))
    return ", ".join(parts) or "all shapes"


class Dispatch:
    """A loaded dispatch table (the JSON of ``docs/dispatch.md`` as ``data``)."""

    def __init__(self, data: dict):
        if data.get("format") != FORMAT or data.get("version") != VERSION:
            raise ValueError(f"not a {FORMAT} version {VERSION} table (format "
                             f"{data.get('format')!r}, version {data.get('version')!r})")
        self.data = data
        self.buckets = data["buckets"]
        self.heads = {(int(h["h_qk"]), int(h["h_v"])): h for h in data["head_configs"]}

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
        query/key heads and h_v value heads. A measured head config answers from its own
        buckets; another one (with ``fallback``) from the bucket whose bounds hold it, the
        reason naming the nearest measured head config; ``fallback=False`` gives None."""
        if h_qk < 1 or h_v < 1:
            raise ValueError(f"h_qk={h_qk}, h_v={h_v}: head counts must be >= 1")
        feats = features(seqlens, h_v)
        exact = (h_qk, h_v) in self.heads
        why = ""
        if exact:
            for b in self.heads[(h_qk, h_v)]["buckets"]:
                if _in(b["bounds"], feats):
                    return self._answer(b["bucket"], (h_qk, h_v), True, "")
            return Choice(None, f"{h_qk}/{h_v}: no bucket holds {feats}")  # not for built tables
        near = self.nearest(h_qk, h_v)
        if near is None:
            return Choice(None, "the table has no head configs")
        if not fallback:
            return Choice(None, f"{h_qk}/{h_v} was not measured (nearest measured head config: "
                                f"{near[0]}/{near[1]}); fallback off")
        why = (f"{h_qk}/{h_v} was not measured (nearest measured: {near[0]}/{near[1]}); "
               "answered from the bucket bounds over all head configs: ")
        for b in self.buckets:
            if _in(b["bounds"], feats):
                return self._answer(b["id"], (h_qk, h_v), False, why)
        return Choice(None, f"{h_qk}/{h_v}: no bucket holds {feats}")

    def _answer(self, i: int, key: tuple[int, int], exact: bool, why: str) -> Choice:
        b = self.buckets[i]
        m = b.get("margin")
        return Choice(b["choice"], why + f"bucket {i} ({_fmt_bounds(b['bounds'])}): "
                      f"{b['choice']}" + (f", {m:.3f}x ahead of {b['runner_up']}" if m else "")
                      + f" on {b['points']} measured point(s)", key, exact, i, m)


def load(path: str | Path) -> Dispatch:
    """Read a dispatch table written by ``qlabench recommend``."""
    return Dispatch(json.loads(Path(path).read_text()))


# --------------------------------------------------------------------------- judging


def leave_one_out(pts: list[dict], alpha: float = ALPHA, threshold: float = THRESHOLD) -> dict:
    """Leave-one-layout-out per model over points of one direction (module doc)."""
    per_model: dict[str, dict] = {}
    misses, logs, n_right = [], [], 0
    order = sorted(pts, key=lambda p: (p["h_qk"], p["h_v"], p["model"], p["num_seqs"],
                                       p["total_tokens"], p["point_key"]))
    for p in order:
        rest = [q for q in pts if not (q["point_key"] == p["point_key"] and q["model"] == p["model"])]
        if rest:
            d = Dispatch({"format": FORMAT, "version": VERSION, **build(rest, alpha, threshold, judge=False)})
            ch = d.choose(p["h_qk"], p["h_v"], p["seqlens"]).backend
        else:
            ch = None
        if ch in p["rows"]:
            regret = p["latency_ms"][ch] / p["best_ms"]
            right = ch == p["winner"] or is_tie(p["rows"][ch], p["rows"][p["winner"]], alpha,
                                                threshold)
        else:
            regret, right = max(p["latency_ms"].values()) / p["best_ms"], False
        n_right += right
        logs.append(math.log(regret))
        m = per_model.setdefault(p["model"], {"model": p["model"], "h_qk": p["h_qk"],
                                              "h_v": p["h_v"], "points": 0, "right": 0, "_l": []})
        m["points"] += 1
        m["right"] += right
        m["_l"].append(math.log(regret))
        if not right:
            misses.append({"model": p["model"], "layout": p["layout"], "point_key": p["point_key"],
                           "chosen": ch, "winner": p["winner"], "regret": regret})
    n = len(pts)
    models = []
    for m in per_model.values():
        m["accuracy"] = m["right"] / m["points"]
        m["geomean_regret"] = float(math.exp(np.mean(m.pop("_l"))))
        models.append(m)
    acc = n_right / n if n else None
    reg = float(math.exp(np.mean(logs))) if n else None
    return {"method": "leave-one-layout-out per model: the table rebuilt without that model's "
                      "row of the layout, then asked to choose for it; right = the point's "
                      "winner or a tie with it",
            "points": n, "right": int(n_right), "accuracy": acc, "geomean_regret": reg,
            "max_regret": float(math.exp(max(logs))) if n else None,
            "goal": {"accuracy": GOAL_ACCURACY, "geomean_regret": GOAL_REGRET},
            "meets_goal": bool(n and acc >= GOAL_ACCURACY and reg <= GOAL_REGRET),
            "per_model": models, "misses": misses}


# --------------------------------------------------------------------------- the command


def source_of(df: pd.DataFrame, path: Path) -> dict:
    """Where the rows came from: directory, runs, campaigns, GPUs, labels and their versions."""
    def uniq(c):
        return sorted({str(v) for v in df[c].dropna() if str(v)}) if c in df.columns else []
    labels = {}
    for b, g in df.groupby("backend"):
        labels[b] = {"backend_name": str(g["backend_name"].iloc[0]) if "backend_name" in g else b,
                     "versions": sorted({str(v) for v in g["backend_version"].dropna()})}
    return {"dir": str(path), "rows": int(len(df)), "run_ids": uniq("run_id"),
            "campaign_ids": uniq("campaign_id"), "gpus": uniq("gpu_name"),
            "gpu_uuids": uniq("gpu_uuid"), "dtypes": uniq("dtype"),
            "head_dims": sorted({int(v) for v in df["head_dim"].dropna()}),
            "gate_recipes": uniq("gate_recipe"), "backends": labels}


def recommend(df: pd.DataFrame, path: Path, direction: str = "fwd", alpha: float = ALPHA,
              threshold: float = THRESHOLD) -> dict:
    """The dispatch table (a JSON-ready dict) over latest rows ``df`` of one direction."""
    ok = df[(df["direction"] == direction) & (df["status"] == "ok")]
    pts = points_of(ok)
    if not pts:
        raise BadInput(f"{path}: no ok {direction} rows to recommend from")
    return {"format": FORMAT, "version": VERSION, "direction": direction,
            "created_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "source": source_of(ok, path),
            "rule": {"features": list(FEATURES), "bounds": "[lo, hi), null = unbounded",
                     "choice": "least total log-regret over the bucket's points",
                     "min_points": MIN_POINTS, "max_depth": MAX_DEPTH,
                     "min_gain_pct": round((math.exp(MIN_GAIN) - 1) * 100, 3),
                     "tie": {"alpha": alpha, "threshold": threshold,
                             "test": "two-sided Mann-Whitney U on samples_ms"},
                     "fallback": "unseen head config: the bucket whose bounds (over every "
                                 "feature, h_v included) hold the batch"},
            **build(pts, alpha, threshold),
            "held_out": leave_one_out(pts, alpha, threshold)}


def print_table(table: dict, console) -> None:
    from rich.table import Table

    t = Table(title=f"dispatch ({table['direction']}) from {table['source']['dir']}: "
              "per head config, the buckets that hold its batches")
    for c, j in (("h_qk/h_v", "left"), ("bucket", "right"), ("shapes", "left"),
                 ("choice", "left"), ("runner-up", "left"), ("margin", "right"),
                 ("winner/tie", "right")):
        t.add_column(c, justify=j)
    for h in table["head_configs"]:
        for i, b in enumerate(h["buckets"]):
            t.add_row(f"{h['h_qk']}/{h['h_v']}" if i == 0 else "", str(b["bucket"]),
                      _fmt_bounds(b["bounds"]), b["choice"], b["runner_up"] or "",
                      f"{b['margin']:.3f}×" if b["margin"] else "",
                      f"{b['winner_or_tie']}/{b['points']}")
    console.print(t)
    ho = table["held_out"]
    console.print(f"held out (leave-one-layout-out per model, {ho['points']} points): "
                  f"{ho['right']}/{ho['points']} = {ho['accuracy']:.1%} winner or tie "
                  f"(goal >= {GOAL_ACCURACY:.0%}), geomean regret {ho['geomean_regret']:.4f}× "
                  f"(goal <= {GOAL_REGRET:.2f}), worst {ho['max_regret']:.3f}×"
                  + ("" if ho["meets_goal"] else "  [below goal]"), highlight=False, markup=False)
    for m in ho["misses"]:
        console.print(f"  miss: {m['model']} {m['layout']}: chose {m['chosen']}, winner "
                      f"{m['winner']} ({m['regret']:.3f}×)", highlight=False, markup=False)


def recommend_cmd(path: Path, out: Path, direction: str = "fwd", backends: str | None = None,
                  alpha: float = ALPHA, threshold: float = THRESHOLD) -> int:
    """``qlabench recommend DIR --out FILE``: table and held-out figures on stdout, JSON at
    ``out``; exit 2 with a message on bad input (missing/empty dir, no ok rows)."""
    import sys

    from rich.console import Console

    from .summary import load_latest
    console = Console(soft_wrap=True, width=None if sys.stdout.isatty() else 200)
    err = Console(stderr=True, soft_wrap=True)
    try:
        df = load_latest(path)
        if backends:
            want = [b.strip() for b in backends.split(",") if b.strip()]
            bad = [b for b in want if b not in set(df["backend"])]
            if bad:
                raise BadInput(f"--backends: {', '.join(bad)} not in {path} (it holds "
                               f"{', '.join(sorted(set(df['backend'].dropna())))})")
            df = df[df["backend"].isin(want)]
        table = recommend(df, Path(path), direction, alpha, threshold)
    except BadInput as e:
        err.print(f"error: {e}", highlight=False, markup=False)
        return 2
    print_table(table, console)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(table, indent=1, default=_json_default))
    console.print(f"wrote {out}", highlight=False, markup=False)
    return 0


def _json_default(o):
    if isinstance(o, np.integer):
        return int(o)
    if isinstance(o, np.floating):
        return float(o)
    if isinstance(o, np.bool_):
        return bool(o)
    raise TypeError(f"{type(o).__name__} is not JSON serialisable")
