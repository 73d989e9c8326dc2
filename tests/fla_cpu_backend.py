"""Test-only: the ``fla`` backend on the CPU (tests/test_fla_backend.py registers it through
``$QLABENCH_BACKENDS``). Everything but the call is the fla backend's: its refusals, its reading
of FLA's backend dispatch (``dispatch_route``), its version. The call returns the reference's
answer and, in a backward, first makes one call of FLA's own dispatched ``chunk_bwd_dqkwg``
(``fla.ops.common.chunk_o``) on small CPU tensors, so that FLA's dispatch (``fla.backends``)
decides that op as in its chunked backward: the test sets up the platform it decides for.

Shapes of that call (GDN's): q, k [1, 64, 1, 16] bf16; v, do, w, dv [1, 64, 2, 16] bf16 (two
v-heads per q/k head); h, dh [1, 1, 2, 16, 16] bf16 (one chunk); g [1, 64, 2] fp32.
"""

from __future__ import annotations

import torch

from qlabench.backends.base import Prepared
from qlabench.backends.fla import FLABackend
from qlabench.backends.reference import ReferenceBackend


def dqkwg_call() -> None:
    """One call of FLA's dispatched ``chunk_bwd_dqkwg`` on GDN-shaped CPU tensors."""
    from fla.ops.common.chunk_o import chunk_bwd_dqkwg
    T, H, HV, D = 64, 1, 2, 16
    qk = torch.zeros(1, T, H, D, dtype=torch.bfloat16)
    vv = torch.zeros(1, T, HV, D, dtype=torch.bfloat16)
    h = torch.zeros(1, 1, HV, D, D, dtype=torch.bfloat16)
    chunk_bwd_dqkwg(q=qk, k=qk, v=vv, do=vv, h=h, dh=h, w=vv, g=torch.zeros(1, T, HV),
                    dv=vv, scale=D ** -0.5)


class FLAOnCPU(FLABackend):
    name = "fla-cpu"
    needs_cuda = False

    def prepare(self, x, direction):
        ref = ReferenceBackend().prepare(x, direction)

        def fn():
            if direction != "fwd":
                dqkwg_call()
            return ref.fn()
        return Prepared(fn=fn, graph_safe=False)

    def outputs_to_canonical(self, raw, x, direction):
        return ReferenceBackend().outputs_to_canonical(raw, x, direction)


class FLAOnCPUNoRefusals(FLAOnCPU):
    """The same call, from a backend that declares no refusals."""

    name = "fla-cpu-norefusals"
    refusals = ()
