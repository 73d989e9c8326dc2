"""Sweep -> concrete Points.

A **point** is (model: h_qk, h_v, head_dim; the list of sequence lengths; dtype; gate recipe).
A **row** is point × backend × direction. Points are ordered models-major, layouts-minor.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

from .config import Sweep


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
    def layout_label(self) -> str:
        s = self.seqlens
        if len(s) == 1:
            return f"1x{s[0]}"
        if len(set(s)) == 1:
            return f"{s[0]}x{len(s)}"
        if len(s) == 2:
            return f"{s[0]}+{s[1]}"
        return f"{self.total_tokens}/{len(s)}seq"

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
        for lens in sweep.resolved_layouts():
            for gate in sweep.resolved_gates():
                out.append(Point(
                    model=m.name, h_qk=m.h_qk, h_v=m.h_v, head_dim=m.head_dim,
                    seqlens=tuple(int(x) for x in lens), dtype=sweep.dtype, seed=sweep.seed,
                    initial_state=sweep.initial_state, output_final_state=sweep.output_final_state,
                    index=len(out), **_gate_fields(gate),
                ))
    return out
