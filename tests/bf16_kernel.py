"""A correct bf16 chunked GDN kernel emulated on the CPU, for the correctness check's tests: the chunked
reference with every intermediate a chunked kernel keeps in bf16 between its GEMMs (the WY
factors, the state, v_new, the attention tile, the outputs) rounded to bf16, forward and
backward (the gradients through those intermediates rounded likewise). Its errors have the size
and the distribution of the libraries' on the H200 (global ~5e-3 on every gradient)."""
from __future__ import annotations

import contextlib

import torch

import qlabench.backends.reference as R


class _RoundBF16(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a):
        return a.to(torch.bfloat16).to(a.dtype)

    @staticmethod
    def backward(ctx, g):
        return g.to(torch.bfloat16).to(g.dtype)


rb = _RoundBF16.apply


def _chunked_seq_bf16(q, k, v, g, beta, S, scale, chunk):
    outs = []
    for s in range(0, q.shape[0], chunk):
        e = min(s + chunk, q.shape[0])
        c = e - s
        qc, kc, vc = (t[s:e].transpose(0, 1) for t in (q, k, v))
        gc = g[s:e].transpose(0, 1).cumsum(-1)
        bc = beta[s:e].transpose(0, 1)
        diff = gc[:, :, None] - gc[:, None, :]
        incl = torch.ones(c, c, dtype=torch.bool).tril()
        gamma = torch.where(incl, diff, torch.full_like(diff, float("-inf"))).exp()
        strict = torch.ones(c, c, dtype=torch.bool).tril(-1)
        Lm = torch.where(strict, bc[:, :, None] * gamma * (kc @ kc.transpose(-1, -2)),
                         torch.zeros_like(gamma))
        eye = torch.eye(c, dtype=q.dtype).expand_as(Lm)
        A = rb(torch.linalg.solve_triangular(eye + Lm, eye, upper=False, unitriangular=True))
        w = rb(A @ rb((bc * gc.exp())[..., None] * kc))
        u = rb(A @ rb(bc[..., None] * vc))
        Sb = rb(S)
        v_new = rb(u - w @ Sb)
        o = scale * ((gc.exp()[..., None] * qc) @ Sb
                     + rb((qc @ kc.transpose(-1, -2)) * gamma) @ v_new)
        outs.append(rb(o).transpose(0, 1))
        g_last = gc[:, -1]
        S = g_last.exp()[:, None, None] * S + kc.transpose(-1, -2) @ rb(
            (g_last[:, None] - gc).exp()[..., None] * v_new)
    return torch.cat(outs, 0), S


@contextlib.contextmanager
def _emulated():
    orig = R._chunked_seq
    R._chunked_seq = _chunked_seq_bf16
    try:
        yield
    finally:
        R._chunked_seq = orig


def bwd(x) -> dict[str, torch.Tensor]:
    """The emulated kernel's gradients of ``x`` (workloads.Inputs with grads), canonical names;
    the fp32 state operands (h0, the final-state gradient, beta) read as bf16, as kernels do."""
    def bf(t):
        return None if t is None else t.to(torch.bfloat16).float()
    with _emulated():
        return R.gdn_chunked_grads(x.q, x.k, x.v, x.g, bf(x.beta), x.scale, bf(x.h0),
                                   x.cu_seqlens, x.do, bf(x.dht))


def fwd(x) -> dict[str, torch.Tensor]:
    """The emulated kernel's forward outputs of ``x``."""
    def bf(t):
        return None if t is None else t.to(torch.bfloat16).float()
    with _emulated(), torch.no_grad():
        o, ht = R.gdn_chunked(x.q, x.k, x.v, x.g, bf(x.beta), x.scale, bf(x.h0), x.cu_seqlens)
    return {"o": o, "final_state": ht}
