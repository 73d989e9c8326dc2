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

import contextlib
import importlib
import re
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, ValidationError


@dataclass
class Prepared:
    """A ready-to-call operation. ``fn()`` runs one call (graph-capturable where the library
    allows) and returns the library's raw outputs. ``graph_safe`` False forces events timing.
    ``outputs``: buffers ``fn`` writes that the backend allocated once in ``prepare`` (the runner
    fills them with NaN before every checked call, as it does with what ``fn`` allocates).
    ``refresh``: re-derives, in place and outside the timed calls, whatever ``prepare`` computed
    from the input values that ``fn`` reads instead of the inputs themselves (converted copies,
    a forward's saved tensors for a backward); the check of the timed path writes fresh values
    into the canonical input tensors and calls it before running the timed path again, timing
    it: a refresh may cost a fraction of a call (a backward's forward, a dtype conversion), and
    one that costs several timed calls marks the row ``incorrect`` (work moved out of the timed
    call: :func:`qlabench.measure.timed_path_costs`). A backend whose ``fn`` reads only the
    canonical inputs (or views of them) needs none."""

    fn: Callable[[], Any]
    graph_safe: bool = True
    notes: str = ""
    outputs: tuple = ()
    refresh: Callable[[], None] | None = None


class Unsupported(Exception):
    """Raised by ``prepare`` or a call when a point turns out to be outside what the library
    takes: the row is ``unsupported``, its message the reason."""


def cuda_cc() -> tuple[int, int] | None:
    """The compute capability of GPU 0, or None without a CUDA device."""
    import torch
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability(0)


class NoParams(BaseModel):
    """A backend without parameters: any key is unknown."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class BadParams(ValueError):
    """Backend parameters its ``Params`` model rejects; the message names the key."""


class Backend:
    """One library's GDN chunked prefill. Subclasses set the class attributes below and
    implement :meth:`prepare` / :meth:`outputs_to_canonical`; register the class under ``name``
    (:mod:`qlabench.backends`)."""

    name: ClassVar[str] = "?"
    directions: ClassVar[tuple[str, ...]] = ("fwd",)
    #: the Python module whose presence makes the backend available
    module: ClassVar[str | None] = None
    #: the distribution whose version the rows carry (``version()``); None: "n/a"
    distribution: ClassVar[str | None] = None
    #: plot colour of the backend's first label (further labels get shades of it)
    color: ClassVar[str | None] = None
    needs_cuda: ClassVar[bool] = True
    #: "library" (a package users pick between; its regressions are news), "in-repo" (this
    #: repository's kernels: their history is development) or "reference" (the torch reference)
    kind: ClassVar[str] = "library"
    #: the backend's parameters (YAML ``params:``): a pydantic model, unknown keys rejected
    Params: ClassVar[type[BaseModel]] = NoParams
    #: what the library raises when it refuses a configuration for its version or platform
    #: (not a failure of the call): (exception class, regular expression its message matches)
    #: pairs. A row whose call raises one is ``unsupported`` with the library's message as the
    #: reason (:meth:`refusal`); every other exception stays a failure (``crashed``).
    refusals: ClassVar[tuple[tuple[type[BaseException], str], ...]] = ()

    def __init__(self, params: Mapping | None = None):
        self.params = self.validate_params(params)

    @classmethod
    def validate_params(cls, params: Mapping | None) -> BaseModel:
        """``params`` as the backend's ``Params`` model; :class:`BadParams` naming the key."""
        try:
            return cls.Params.model_validate(dict(params or {}))
        except ValidationError as e:
            errs = []
            for err in e.errors():
                key = ".".join(str(x) for x in err["loc"]) or "params"
                msg = "unknown parameter" if err["type"] == "extra_forbidden" else err["msg"]
                known = ", ".join(cls.Params.model_fields) or "none"
                errs.append(f"{key}: {msg} (parameters of {cls.name}: {known})")
            raise BadParams("; ".join(errs)) from None

    def version(self) -> str:
        if self.distribution is None:
            return "n/a"
        try:
            from importlib.metadata import version
            return version(self.distribution)
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
                self.import_library()
            except Exception as e:  # ImportError and friends at import time
                return False, f"cannot import {self.module}: {type(e).__name__}: {str(e)[:200]}"
        return True, ""

    def import_library(self) -> None:
        """Import the library (``module``); a backend imports here whatever else its calls need,
        so that a worker's warm-up (``available``) leaves nothing for its first row to import."""
        importlib.import_module(self.module)

    def supports(self, point, direction: str) -> tuple[bool, str]:
        """(ok, reason) for a point × direction, from the library's documented constraints."""
        if direction not in self.directions:
            return False, f"{self.name} has no {direction} pass"
        return True, ""

    def prepare(self, inputs, direction: str) -> Prepared:  # pragma: no cover - interface
        raise NotImplementedError

    def outputs_to_canonical(self, raw, inputs, direction: str) -> dict:  # pragma: no cover
        raise NotImplementedError

    def refusal(self, exc: BaseException) -> str | None:
        """The ``unsupported`` row's reason when ``exc`` says that the point is outside what the
        library takes (:class:`Unsupported`, or one of :attr:`refusals`); None for any other
        exception."""
        if isinstance(exc, Unsupported):
            return str(exc)
        for cls, pattern in self.refusals:
            if isinstance(exc, cls) and re.search(pattern, str(exc)):
                return (f"{self.name} refuses this configuration: {type(exc).__name__}: "
                        f"{str(exc)[:300]}")
        return None

    def dispatch_route(self) -> AbstractContextManager[Callable[[], str | None]]:
        """A context around one eager call that gives a function returning the route the
        library's own backend dispatch chose in that call (the row's ``path``), filled as far as
        the call got should it raise. None from that function: the library has no dispatch to
        ask, and :meth:`path` names the route from the kernels."""
        return contextlib.nullcontext(lambda: None)

    def path(self, names: list[str]) -> str:
        """A short label of the route one call took, from the kernel names the profiler saw
        (most time first); the row's ``path`` column where :meth:`dispatch_route` gives none.
        Backends name their own routes."""
        from ..profile import generic_path
        return generic_path(names)
