"""Sweep -> concrete Points, and which of them a run measures in which order.

A **point** is (model: h_qk, h_v, head_dim; the list of sequence lengths; dtype; gate recipe).
A **row** is point × backend × direction. Points are ordered models-major, layouts-minor.
:func:`scheduled_points` is the points one run measures (``--limit``, ``--shard``); shards are
balanced by :func:`point_cost`, which also orders work heaviest first across GPUs.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field

from .config import RandomSplit, Sweep

_TP_RE = re.compile(r"\bTP(\d+)\b")


def tp_degree(model: str | None) -> int | None:
    """The tensor-parallel degree a model name states (``"397B/122B TP8"`` -> 8), else None
    (``Sym h32`` names heads, not a TP setting)."""
    m = _TP_RE.search(str(model or ""))
    return int(m.group(1)) if m else None


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:.2f}".rstrip("0")


def layout_label(seqlens, split_seed: int | None = None) -> str:
    """The one layout label, count first (fwd and bwd alike)::

        1x32768            one sequence of 32768 tokens
        4x8192             four sequences of 8192 tokens
        2x[28672,4096]     sequences of unequal lengths, in order
        8x~4096s42         a random split ({total: 32768, num_seqs: 8, seed: 42}): 8 sequences
                           of 4096 tokens on average (total = count x mean), seed 42

    A random split into one sequence is ``1x<total>`` (no cut, the seed changes nothing)."""
    s = [int(x) for x in seqlens]
    n = len(s)
    if n == 1:
        return f"1x{s[0]}"
    if split_seed is not None:
        return f"{n}x~{_num(sum(s) / n)}s{split_seed}"
    if len(set(s)) == 1:
        return f"{n}x{s[0]}"
    return f"{n}x[{','.join(map(str, s))}]"


_LABEL_RE = re.compile(r"(\d+)x(?:(\d+)|\[([\d,]+)\]|~([\d.]+)s(-?\d+))")


def label_fits(label, seqlens) -> bool:
    """Whether ``label`` is in the :func:`layout_label` scheme and describes ``seqlens``
    (a label stored before the scheme, e.g. ``8192x4`` or ``32768/8seq``, does not)."""
    m = _LABEL_RE.fullmatch(str(label or ""))
    if m is None or seqlens is None:
        return False
    s = [int(x) for x in seqlens]
    n, eq, lst, mean, _ = m.groups()
    if int(n) != len(s) or not s:
        return False
    if eq is not None:
        return all(x == int(eq) for x in s)
    if lst is not None:
        return lst.split(",") == [str(x) for x in s] and len(set(s)) > 1
    return len(s) > 1 and _num(sum(s) / len(s)) == mean


def spec_labels(spec_list) -> dict[tuple, str]:
    """lengths -> label of every layout of a stored sweep's ``seqlens`` (the run metadata's
    ``sweep.seqlens``: lists, ``{count, length}`` and ``{total, num_seqs, seed}``)."""
    out: dict[tuple, str] = {}
    for spec in spec_list or []:
        try:
            if isinstance(spec, dict) and "total" in spec:
                r = RandomSplit.model_validate(spec)
                lens = tuple(r.lengths())
                out[lens] = layout_label(lens, r.seed if r.num_seqs > 1 else None)
            elif isinstance(spec, dict):
                lens = (int(spec["length"]),) * int(spec["count"])
                out[lens] = layout_label(lens)
            else:
                lens = tuple(int(x) for x in spec)
                out[lens] = layout_label(lens)
        except Exception:
            continue
    return out


@dataclass(frozen=True)
class Point:
    model: str
    h_qk: int
    h_v: int
    head_dim: int
    seqlens: tuple[int, ...]
    dtype: str
    gate_zero_frac: float
    gate_seed: int
    seed: int
    initial_state: bool = True
    output_final_state: bool = True
    #: gate recipe (``config.GATE_RECIPES``) and its parameters as sorted (name, value) pairs
    gate_recipe: str = "published"
    gate_params: tuple = ()
    index: int = field(default=0, compare=False)
    #: seed of the random split the lengths came from (``{total, num_seqs, seed}``), else None;
    #: it names the layout (:func:`layout_label`) and is not part of the key (the lengths are)
    split_seed: int | None = field(default=None, compare=False)

    @property
    def total_tokens(self) -> int:
        return sum(self.seqlens)

    @property
    def num_seqs(self) -> int:
        return len(self.seqlens)

    @property
    def tp_label(self) -> str:
        return f"{self.h_qk}/{self.h_v}"

    @property
    def tp_degree(self) -> int | None:
        """The tensor-parallel degree named in the model (``397B/122B TP8`` -> 8), else None."""
        return tp_degree(self.model)

    @property
    def layout_label(self) -> str:
        return layout_label(self.seqlens, self.split_seed)

    @property
    def gate_label(self) -> str:
        """The gate recipe as stored in a row's ``gate_recipe``."""
        if self.gate_recipe == "published":
            return f"zero{self.gate_zero_frac:g}/seed{self.gate_seed}"
        ps = ",".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}"
                      for k, v in self.gate_params)
        return f"{self.gate_recipe}:{ps}/seed{self.gate_seed}"

    @property
    def key(self) -> str:
        """Identity of the point's shape and gate recipe (the published recipe adds nothing, so
        its keys are those of every row measured before other recipes existed); the recipe's
        parameters and seeds are in ``recipe_hash``, which a resume refuses to mix."""
        k = (f"{self.h_qk}/{self.h_v}/d{self.head_dim}|{' '.join(map(str, self.seqlens))}|"
             f"{self.dtype}")
        return k if self.gate_recipe == "published" else f"{k}|gate={self.gate_recipe}"

    @property
    def recipe_hash(self) -> str:
        """Hash of everything that defines the inputs; a resume refuses to mix recipes."""
        d = {"seqlens": self.seqlens, "h_qk": self.h_qk, "h_v": self.h_v, "d": self.head_dim,
             "dtype": self.dtype, "gz": self.gate_zero_frac, "gs": self.gate_seed,
             "seed": self.seed, "h0": self.initial_state, "ht": self.output_final_state,
             "recipe": "v1:l2norm-randn,logsigmoid(randn)/16,sigmoid(randn),randn-h0"}
        if self.gate_recipe != "published":
            d["gate"] = [self.gate_recipe, list(map(list, self.gate_params))]
        return hashlib.sha1(json.dumps(d, sort_keys=True).encode()).hexdigest()[:12]

    def describe(self) -> str:
        g = "" if self.gate_recipe == "published" else f" [{self.gate_recipe}]"
        return f"{self.model} ({self.tp_label}) {self.layout_label}{g}"

    @staticmethod
    def describe_row(row: dict) -> str:
        key = str(row.get("point_key") or "")
        g = f" [{key.split('|gate=', 1)[1]}]" if "|gate=" in key else ""
        return f"{row['model']} ({row['tp']}) {row['layout']}{g}"


def _gate_fields(gate) -> dict:
    params = tuple(sorted((k, tuple(v) if isinstance(v, (list, tuple)) else v)
                          for k, v in gate.model_dump().items() if k not in ("recipe", "seed",
                                                                             "zero_frac")))
    flat = []
    for k, v in params:
        if isinstance(v, tuple):
            flat += [(f"{k}_lo", float(v[0])), (f"{k}_hi", float(v[1]))]
        else:
            flat.append((k, v))
    return {"gate_recipe": gate.recipe, "gate_params": tuple(flat), "gate_seed": gate.seed,
            "gate_zero_frac": getattr(gate, "zero_frac", 0.0)}


def points(sweep: Sweep) -> list[Point]:
    """models × layouts × gate recipes (recipes innermost, so a point's recipes sit together)."""
    out: list[Point] = []
    for m in sweep.resolved_models():
        for spec, lens in zip(sweep.seqlens, sweep.resolved_layouts()):
            seed = spec.seed if isinstance(spec, RandomSplit) and spec.num_seqs > 1 else None
            for gate in sweep.resolved_gates():
                out.append(Point(
                    model=m.name, h_qk=m.h_qk, h_v=m.h_v, head_dim=m.head_dim,
                    seqlens=tuple(int(x) for x in lens), dtype=sweep.dtype, seed=sweep.seed,
                    initial_state=sweep.initial_state, output_final_state=sweep.output_final_state,
                    index=len(out), split_seed=seed, **_gate_fields(gate),
                ))
    return out


def point_cost(p: Point, n_backends: int = 1) -> float:
    """Relative work of a point, for heaviest-first scheduling and balanced shards."""
    return float(p.total_tokens) * p.h_v * max(1, n_backends) + 1e6 * p.num_seqs


def shard_points(pts: list[Point], i: int, n: int) -> list[Point]:
    """Deterministic shard ``i`` of ``n``: points sorted heaviest first, dealt round robin
    (snake order so shards get similar work)."""
    order = sorted(pts, key=lambda p: (-point_cost(p), p.index))
    mine = []
    for rank, p in enumerate(order):
        r, k = divmod(rank, n)
        owner = k if r % 2 == 0 else n - 1 - k
        if owner == i:
            mine.append(p)
    return sorted(mine, key=lambda p: p.index)


def scheduled_points(sweep: Sweep, limit: int | None = None,
                     shard: tuple[int, int] | None = None) -> list[Point]:
    """The points a run of ``sweep`` measures: the first ``limit`` of them, then of those shard
    ``i`` of ``n`` (:func:`shard_points`) when ``shard`` is ``(i, n)``."""
    pts = points(sweep)
    if limit is not None:
        pts = pts[:limit]
    if shard is not None:
        pts = shard_points(pts, *shard)
    return pts


@dataclass
class Task:
    """One point × direction and the backends still to measure on it: what an executor
    (:mod:`qlabench.executor`) hands a worker (:func:`qlabench.measure.measure_task`)."""

    point: Point
    direction: str
    backends: list[str]  # labels
    #: the run's: run_id, sha, config, campaign_id, gpu_name, ceilings (:func:`qlabench.measure.measure_backend`),
    #: and per label: names (registry name), params / params_json, versions, avail
    ctx: dict
