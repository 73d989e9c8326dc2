"""FLA (flash-linear-attention): its low-level chunked fwd/bwd, each op where FLA dispatches it.

FLA 0.6 routes the high-level ``chunk_gated_delta_rule`` to FlashQLA when ``flash_qla`` is
importable; we set ``FLA_FLASH_QLA=0`` and call ``fla.ops.gated_delta_rule.chunk``'s
``chunk_gated_delta_rule_fwd`` / ``_bwd`` directly. Inside them FLA's backend dispatch
(``fla.backends``) still picks an implementation per op: its Triton kernel unless a registered
backend is available, enabled (its ``FLA_*`` variable) and accepts the call. On Hopper with
Triton >= 3.4 that sends the backward's ``chunk_bwd_dqkwg`` to FLA's TileLang kernel
(``fla.ops.common.backends.tilelang``); with it disabled (``FLA_TILELANG=0``) FLA's Triton
``chunk_bwd_dqkwg`` refuses Triton >= 3.4.0, < 3.7.1 on Hopper (a ``RuntimeError``, :data:`REFUSALS`),
and the row is ``unsupported``. :func:`dispatch_route` records what the dispatch chose in a call:
the row's ``path`` (``triton``, ``triton+tilelang:chunk_bwd_dqkwg``; ``unknown`` where fla has
no such dispatch).

Conventions equal the canonical ones (q, k [1,T,H_qk,K]; v [1,T,H_v,V]; g log-space fp32
[1,T,H_v]; state [N,H_v,K,V] fp32), so no conversion is needed. Varlen: FLA derives chunk
indices from ``cu_seqlens`` with a host sync; ``prepare`` computes them once from the one int64
``cu_seqlens`` tensor and passes them in, so fwd and bwd capture in a CUDA graph.

Low-level returns: fwd ``(g_cumsum (log2 units), o, A, final_state, h0, g_input)``;
bwd ``(dq, dk [1,T,H_qk,K] group-summed, dv, dbeta, dg (raw g), dh0, dA_log, ddt_bias)``.

Importing: the kernels are fla-core's (``fla.ops``). ``import fla`` also imports the
flash-linear-attention distribution's ``fla.layers`` and ``fla.models`` when they are installed
(every layer and model, and transformers), and ``fla.ops`` / ``fla.modules`` import every op and
module of the library in their ``__init__`` (on the H200 host 9–12 s, most of a worker's start).
:func:`import_fla_core` imports fla with the first two hidden (fla's ``__init__`` treats their
absence as "not installed") and ``fla.ops`` / ``fla.modules`` as bare packages (their
``__init__`` not run, their submodules importable), then :data:`OPS` and what it imports; should
that fail, fla is imported as it is. ``available`` imports the module the calls come from, so that
a worker's warm-up leaves nothing for the first row to import.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.machinery
import os
import sys

from .base import Backend, Prepared

CHUNK = 64
#: the flash-linear-attention distribution's packages inside fla, not needed for the kernels
EXTENSION = ("fla.layers", "fla.models")
#: fla's packages whose ``__init__`` imports every op / module of the library
BARE = ("fla.ops", "fla.modules")
#: what ``prepare`` imports
OPS = "fla.ops.gated_delta_rule.chunk"
#: FLA's refusal of a Triton release that miscompiles one of its kernels on a GPU family (0.6.0:
#: gated ``chunk_bwd_dqkwg`` on Hopper with Triton >= 3.4.0 and < 3.7.1)
REFUSALS = ((RuntimeError, r"Triton .+ on .+ GPUs produces incorrect results"),)
#: the path of a call whose ops all ran FLA's own (Triton) implementations
TRITON = "triton"
#: the path where fla has no backend dispatch to ask (another fla version)
UNKNOWN = "unknown"


class _Hidden:
    """A ``sys.meta_path`` finder for which the modules ``names`` do not exist."""

    def __init__(self, names):
        self.names = frozenset(names)

    def find_spec(self, name, path=None, target=None):
        if name in self.names:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


class _BareLoader(importlib.abc.Loader):
    """Makes a package module (its ``__path__`` from the spec) without running its ``__init__``."""

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        pass


class _Bare:
    """A ``sys.meta_path`` finder that finds the packages ``names`` where the path finder does,
    loaded bare (:class:`_BareLoader`)."""

    def __init__(self, names):
        self.names = frozenset(names)

    def find_spec(self, name, path=None, target=None):
        if name not in self.names:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.submodule_search_locations is None:
            return None
        spec.loader = _BareLoader()
        return spec


def _forget_fla() -> None:
    for m in [m for m in sys.modules if m == "fla" or m.startswith("fla.")]:
        del sys.modules[m]


def import_fla_core():
    """:data:`OPS` imported with fla's :data:`EXTENSION` hidden and :data:`BARE` bare (when fla
    is not imported yet); the module ``fla``. Where fla does not take that, fla as it is."""
    if "fla" not in sys.modules:
        finders = [_Hidden(EXTENSION), _Bare(BARE)]
        sys.meta_path[:0] = finders
        try:
            importlib.import_module(OPS)
        except Exception:
            _forget_fla()
        finally:
            for f in finders:
                sys.meta_path.remove(f)
    fla = importlib.import_module("fla")
    importlib.import_module(OPS)
    return fla


def route_label(chosen) -> str:
    """The path of one call: ``triton`` (FLA's default implementations), then
    ``+<backend>:<op>`` for each op FLA's dispatch sent to a registered backend, in call order."""
    return "+".join([TRITON, *dict.fromkeys(f"{b}:{op}" for b, op in chosen)])


@contextlib.contextmanager
def dispatch_route():
    """Around one call: yields a function returning its path (:func:`route_label`) as FLA's own
    backend dispatch chose it. FLA 0.6's dispatch (``fla.backends.BackendRegistry.dispatch``)
    asks each registered backend of an op in priority order whether it is available, enabled and
    accepts the call's arguments, and takes the first one's ``get_implementation(op)``; an op none
    takes runs its default (Triton) function. That method is where a choice shows: it is wrapped
    for the call to record (backend type, op) each time it hands FLA an implementation. Without
    ``fla.backends.BaseBackend.get_implementation`` the path is :data:`UNKNOWN`."""
    try:
        base = importlib.import_module("fla.backends").BaseBackend
        take = base.get_implementation
    except (ImportError, AttributeError):
        yield lambda: UNKNOWN
        return
    chosen: list[tuple[str, str]] = []

    def recording(self, function_name):
        impl = take(self, function_name)
        if impl is not None:
            chosen.append((str(self.backend_type), str(function_name)))
        return impl

    base.get_implementation = recording
    try:
        yield lambda: route_label(chosen)
    finally:
        base.get_implementation = take


class FLABackend(Backend):
    name = "fla"
    directions = ("fwd", "bwd", "fwdbwd")
    module = "fla"
    distribution = "fla-core"  # the kernels' distribution (flash-linear-attention is a shim over it)
    color = "#1f77b4"
    refusals = REFUSALS

    def available(self):
        os.environ["FLA_FLASH_QLA"] = "0"
        return super().available()

    def import_library(self) -> None:
        import_fla_core()

    def supports(self, point, direction):
        ok, why = super().supports(point, direction)
        if not ok:
            return ok, why
        if point.head_dim > 256:
            return False, f"FLA's chunked kernels take head_dim <= 256 (got {point.head_dim})"
        return True, ""

    def prepare(self, x, direction):
        os.environ["FLA_FLASH_QLA"] = "0"
        from fla.ops.gated_delta_rule.chunk import (
            chunk_gated_delta_rule_bwd,
            chunk_gated_delta_rule_fwd,
        )
        from fla.ops.utils import prepare_chunk_indices

        cu = x.cu_seqlens  # the one int64 tensor, reused by every call
        ci = prepare_chunk_indices(cu, CHUNK)

        def fwd():
            return chunk_gated_delta_rule_fwd(
                q=x.q, k=x.k, v=x.v, g=x.g, beta=x.beta, scale=x.scale, initial_state=x.h0,
                output_final_state=x.output_final_state, cu_seqlens=cu, chunk_indices=ci)

        if direction == "fwd":
            return Prepared(fn=fwd)

        def bwd(gc, A):
            return chunk_gated_delta_rule_bwd(
                q=x.q, k=x.k, v=x.v, g=gc, beta=x.beta, A=A, scale=x.scale,
                initial_state=x.h0, do=x.do, dht=x.dht, cu_seqlens=cu, chunk_indices=ci)

        if direction == "bwd":
            gc, _, A, *_ = fwd()  # saved tensors of a forward, outside the timed region

            def refresh():
                gc2, _, A2, *_ = fwd()
                gc.copy_(gc2)
                A.copy_(A2)
            return Prepared(fn=lambda: bwd(gc, A), refresh=refresh)

        def fwdbwd():
            gc, _, A, *_ = fwd()
            return bwd(gc, A)

        return Prepared(fn=fwdbwd)

    def outputs_to_canonical(self, raw, x, direction):
        if direction == "fwd":
            return {"o": raw[1], "final_state": raw[3]}
        dq, dk, dv, db, dg, dh0 = raw[:6]
        return {"dq": dq, "dk": dk, "dv": dv, "dbeta": db, "dg": dg, "dh0": dh0}

    def dispatch_route(self):
        return dispatch_route()
