"""A correct bf16 chunked GDN kernel emulated on the CPU, for the correctness check's tests: the
chunked reference in 32-token chunks with every intermediate a chunked kernel keeps in bf16 between
its GEMMs rounded to bf16 (its ``store`` hook), in the forward pass and in the gradients through
it, the fp32 state operands read as bf16 and the outputs it returns in bf16 rounded so. Its errors
have the size and the distribution of the libraries' on the H200 (global ~5e-3 on every gradient);
its chunks are not those of the check's own emulated kernel (``correctness.bf16_twin``, 64 tokens)
and it rounds its intermediates on bf16's grid scaled by 1 / GRID (bf16(GRID x) / GRID: the same
size of rounding error, at other places), so the two round differently even on a sequence shorter
than a chunk."""
from __future__ import annotations

import torch

import qlabench.backends.reference as R
from qlabench.correctness import BF16_OUTPUTS

CHUNK = 32
#: not a power of two: bf16(GRID x) / GRID rounds x on a grid shifted against bf16's own
GRID = 1.37


class _RoundShifted(torch.autograd.Function):
    """An intermediate kept in bf16, rounded on the shifted grid; its gradient too."""

    @staticmethod
    def forward(ctx, a):
        return (a * GRID).to(torch.bfloat16).to(a.dtype) / GRID

    @staticmethod
    def backward(ctx, g):
        return (g * GRID).to(torch.bfloat16).to(g.dtype) / GRID


def _bf(t):
    return None if t is None else t.to(torch.bfloat16).to(t.dtype)


def _outputs(out: dict) -> dict[str, torch.Tensor]:
    return {n: (_bf(t) if n in BF16_OUTPUTS else t) for n, t in out.items()}


def fwd(x) -> dict[str, torch.Tensor]:
    """The emulated kernel's outputs of ``x`` (workloads.Inputs), canonical names."""
    o, ht = R.gdn_chunked(x.q, x.k, x.v, x.g, _bf(x.beta), x.scale, _bf(x.h0), x.cu_seqlens,
                          chunk=CHUNK, store=_RoundShifted.apply)
    return _outputs({"o": o, "final_state": ht})


def bwd(x) -> dict[str, torch.Tensor]:
    """The emulated kernel's gradients of ``x`` (workloads.Inputs with grads), canonical names."""
    return _outputs(R.gdn_chunked_grads(x.q, x.k, x.v, x.g, _bf(x.beta), x.scale, _bf(x.h0),
                                        x.cu_seqlens, x.do, _bf(x.dht), chunk=CHUNK,
                                        store=_RoundShifted.apply))
