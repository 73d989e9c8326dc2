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
    def key(self) -> str:
        """Identity of the point's *shape* (not of its inputs recipe)."""
        return (f"{self.h_qk}/{self.h_v}/d{self.head_dim}|{' '.join(map(str, self.seqlens))}|"
                f"{self.dtype}")

    @property
    def recipe_hash(self) -> str:
        """Hash of everything that defines the inputs; a resume refuses to mix recipes."""
        d = {"seqlens": self.seqlens, "h_qk": self.h_qk, "h_v": self.h_v, "d": self.head_dim,
             "dtype": self.dtype, "gz": self.gate_zero_frac, "gs": self.gate_seed,
             "seed": self.seed, "h0": self.initial_state, "ht": self.output_final_state,
             "recipe": "v1:l2norm-randn,logsigmoid(randn)/16,sigmoid(randn),randn-h0"}
        return hashlib.sha1(json.dumps(d, sort_keys=True).encode()).hexdigest()[:12]

    def describe(self) -> str:
        return f"{self.model} ({self.tp_label}) {self.layout_label}"

    @staticmethod
    def describe_row(row: dict) -> str:
        return f"{row['model']} ({row['tp']}) {row['layout']}"


def points(sweep: Sweep) -> list[Point]:
    out: list[Point] = []
    for m in sweep.resolved_models():
        for lens in sweep.resolved_layouts():
            out.append(Point(
                model=m.name, h_qk=m.h_qk, h_v=m.h_v, head_dim=m.head_dim,
                seqlens=tuple(int(x) for x in lens), dtype=sweep.dtype,
                gate_zero_frac=sweep.gate.zero_frac, gate_seed=sweep.gate.seed, seed=sweep.seed,
                initial_state=sweep.initial_state, output_final_state=sweep.output_final_state,
                index=len(out),
            ))
    return out
