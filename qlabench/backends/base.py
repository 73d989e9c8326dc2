"""The one small interface every backend implements.

A backend converts canonical inputs (``workloads.Inputs``, FLA's conventions) to its library's
conventions once, outside the timed region (``prepare``), and its outputs back
(``outputs_to_canonical``). It never times itself and never reads YAML.

Canonical outputs by direction:

- ``fwd``: ``o`` [1,T,H_v,V], ``final_state`` [N,H_v,K,V] (K x V layout)
- ``bwd`` / ``fwdbwd``: ``dq``, ``dk`` [1,T,H_qk,K]; ``dv`` [1,T,H_v,V]; ``dg``, ``dbeta`` [1,T,H_v]
  (``dg`` for the raw g); ``dh0`` [N,H_v,K,V]
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass
class Prepared:
    """A ready-to-call operation. ``fn()`` runs one call (graph-capturable where the library
    allows) and returns the library's raw outputs. ``graph_safe`` False forces events timing.
    ``outputs``: buffers ``fn`` writes that the backend allocated once in ``prepare`` (the runner
    fills them with NaN before every checked call, as it does with what ``fn`` allocates)."""

    fn: Callable[[], Any]
    graph_safe: bool = True
    notes: str = ""
    outputs: tuple = ()


class Unsupported(Exception):
    """Raised by ``prepare`` when a point turns out to be outside what the library takes."""


class Backend:
    name: str = "?"
    directions: tuple[str, ...] = ("fwd",)
    #: the Python module whose presence makes the backend available
    module: str | None = None
    needs_cuda: bool = True

    def version(self) -> str:
        if self.module is None:
            return "n/a"
        try:
            from importlib.metadata import version
            dist = {"fla": "flash-linear-attention", "flash_qla": "flash-qla",
                    "flashinfer": "flashinfer-python", "qlabench_kernels": "qlabench"}
            return version(dist.get(self.module, self.module))
        except Exception:
            return "unknown"

    def available(self) -> tuple[bool, str]:
        """(ok, reason): library importable and a GPU present."""
        if self.needs_cuda:
            import torch
            if not torch.cuda.is_available():
                return False, "no CUDA device (torch.cuda.is_available() is False)"
        if self.module is not None:
            try:
                importlib.import_module(self.module)
            except Exception as e:  # ImportError and friends at import time
                return False, f"cannot import {self.module}: {type(e).__name__}: {str(e)[:200]}"
        return True, ""

    def supports(self, point, direction: str) -> tuple[bool, str]:
        """(ok, reason) for a point × direction, from the library's documented constraints."""
        if direction not in self.directions:
            return False, f"{self.name} has no {direction} pass"
        return True, ""

    def prepare(self, inputs, direction: str) -> Prepared:  # pragma: no cover - interface
        raise NotImplementedError

    def outputs_to_canonical(self, raw, inputs, direction: str) -> dict:  # pragma: no cover
        raise NotImplementedError

    def path(self, names: list[str]) -> str:
        """A short label of the route one call took, from the kernel names the profiler saw
        (most time first); the row's ``path`` column. Backends name their own routes."""
        from ..profile import generic_path
        return generic_path(names)
