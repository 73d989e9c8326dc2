"""qlabench_kernels: in-repo TileLang Gated DeltaNet (GDN) chunked-prefill kernels for Hopper (sm_90a).

    chunk_gdn_fwd(q, k, v, g, beta, ...) -> (o, final_state)            forward.py
    chunk_gdn_bwd(q, k, v, g, beta, do, ...) -> (dq, dk, dv, dg, dβ, dh0)  backward.py
    chunk_gdn(...)                        differentiable (autograd.py)

FLA's conventions; the kernels, their data flow and limits: docs/kernels.md. Nothing here imports
``qlabench``.
"""

from .autograd import ChunkGDNFunction, chunk_gdn
from .backward import chunk_gdn_bwd
from .forward import chunk_gdn_fwd, chunk_gdn_fwd_lowlevel
from .plan import bwd_split_cost, plan_bwd_split, plan_fwd, plan_split, prep_cost, split_cost

__all__ = [
    "chunk_gdn_fwd", "chunk_gdn_fwd_lowlevel", "chunk_gdn_bwd", "chunk_gdn", "ChunkGDNFunction",
    "plan_fwd", "plan_split", "split_cost", "prep_cost", "plan_bwd_split", "bwd_split_cost",
]  # fmt: skip
