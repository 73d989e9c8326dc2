"""Test-only backend that misbehaves on demand (fault-injection suite); registered by
``conftest.py`` through ``$QLABENCH_BACKENDS`` (``faulty=faulty_backend:FaultyBackend``).

It computes the reference's answer, except on the points named in ``QLABENCH_FAULTS``:
``"crash@1,hang@2,oom@3,wrong@4,raise@5,abort@6"`` maps point index -> fault:

- ``crash``: segmentation fault (the process dies)      -> ``crashed``
- ``abort``: ``os.abort()``                             -> ``crashed``
- ``hang``: sleeps forever                               -> ``timeout``
- ``oom``: raises ``torch.OutOfMemoryError``             -> ``oom``
- ``raise``: raises ``RuntimeError``                     -> ``crashed`` (in-process exception)
- ``wrong``: returns o × 1.5                             -> ``incorrect``
"""

from __future__ import annotations

import ctypes
import os
import time

import torch
from pydantic import BaseModel, ConfigDict

from qlabench.backends.base import Prepared
from qlabench.backends.reference import ReferenceBackend


def faults() -> dict[int, str]:
    spec = os.environ.get("QLABENCH_FAULTS", "")
    out = {}
    for part in filter(None, (s.strip() for s in spec.split(","))):
        kind, _, idx = part.partition("@")
        out[int(idx)] = kind
    return out


class FaultyParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    #: multiplies o (fwd) or dv (bwd): 1.0 is the reference's answer
    o_scale: float = 1.0


class FaultyBackend(ReferenceBackend):
    name = "faulty"
    needs_cuda = False
    color = "#8c564b"
    Params = FaultyParams

    def version(self) -> str:
        return "test"

    def prepare(self, x, direction):
        prep = super().prepare(x, direction)
        kind = faults().get(x.point_index)
        return self._wrap(prep, kind)

    def _wrap(self, prep, kind):
        if kind is None or kind == "wrong":
            return prep

        def fn():
            if kind == "crash":
                ctypes.string_at(0)
            if kind == "abort":
                os.abort()
            if kind == "hang":
                while True:
                    time.sleep(1)
            if kind == "oom":
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 TiB (injected)")
            if kind == "raise":
                raise RuntimeError("injected failure")
            return prep.fn()
        return Prepared(fn=fn)

    def outputs_to_canonical(self, raw, x, direction):
        out = super().outputs_to_canonical(raw, x, direction)
        scale = (1.5 if faults().get(x.point_index) == "wrong" else 1.0) * self.params.o_scale
        if scale != 1.0:
            key = "o" if "o" in out else "dv"
            out[key] = out[key] * scale
        return out
