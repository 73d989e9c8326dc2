"""A correct bf16 chunked GDN kernel emulated on the CPU, for the correctness check's tests: the
chunked reference with every intermediate a chunked kernel keeps in bf16 between its GEMMs rounded
to bf16 (its ``store`` hook), in the forward pass and in the gradients through it, and the fp32
state operands read as bf16. Its errors have the size and the distribution of the libraries' on
the H200 (global ~5e-3 on every gradient)."""
from __future__ import annotations

import torch

import qlabench.backends.reference as R


class _RoundBF16(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a):
        return a.to(torch.bfloat16).to(a.dtype)

    @staticmethod
    def backward(ctx, g):
        return g.to(torch.bfloat16).to(g.dtype)


def _bf(t):
    return None if t is None else t.to(torch.bfloat16).float()


def bwd(x) -> dict[str, torch.Tensor]:
    """The emulated kernel's gradients of ``x`` (workloads.Inputs with grads), canonical names."""
    return R.gdn_chunked_grads(x.q, x.k, x.v, x.g, _bf(x.beta), x.scale, _bf(x.h0),
                               x.cu_seqlens, x.do, _bf(x.dht), store=_RoundBF16.apply)

