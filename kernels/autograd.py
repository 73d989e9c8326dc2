"""The trainable entry point: :class:`ChunkGDNFunction` (forward = ``forward.chunk_gdn_fwd_lowlevel``,
backward = ``backward.chunk_gdn_bwd``) and :func:`chunk_gdn`.

    chunk_gdn(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
              cu_seqlens=None, seqlens=None) -> (o, final_state or None)          # differentiable

The forward's prep outputs (g cumsum, A·diag(β), chunk table) are saved and reused by the
backward; per-chunk states are recomputed. Nothing here imports ``qlabench``.
"""

import torch

from ._common import HEAD_DIM, check_seqlens
from .backward import chunk_gdn_bwd
from .forward import chunk_gdn_fwd_lowlevel

__all__ = ["ChunkGDNFunction", "chunk_gdn"]


class ChunkGDNFunction(torch.autograd.Function):
    """Autograd wrapper: forward = ``chunk_gdn_fwd_lowlevel``; backward = :func:`chunk_gdn_bwd`.

    Saves q, k, v, g, β, the forward's g cumsum, A·diag(β) and chunk table, h0 and cu_seqlens;
    recomputes the per-chunk states in the backward. ``seqlens`` (host ints or None) only plans
    both passes' sequence splits.
    apply(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, seqlens) -> (o, ht).
    """

    @staticmethod
    def forward(ctx, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, seqlens=None):
        r = chunk_gdn_fwd_lowlevel(
            q, k, v, g, beta, scale=scale, initial_state=initial_state,
            output_final_state=output_final_state, cu_seqlens=cu_seqlens, seqlens=seqlens, save_prep=True,
        )  # fmt: skip
        ctx.seqlens = seqlens
        ctx.save_for_backward(q, k, v, g, beta, r.get("gcs"), r.get("a_beta"), r.get("ctab"), initial_state, cu_seqlens)
        ctx.scale = scale
        ctx.dtypes = (g.dtype, beta.dtype, None if initial_state is None else initial_state.dtype)
        o, ht = r["o"], r["final_state"]
        if ht is None:
            return o, None
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g, beta, gcs, a_beta, ctab, h0, cu = ctx.saved_tensors
        if do is None:
            do = torch.zeros(1, q.shape[1], v.shape[2], HEAD_DIM, device=q.device, dtype=torch.bfloat16)
        dq, dk, dv, dg, dbeta, dh0 = chunk_gdn_bwd(
            q, k, v, g, beta, do, dht=dht, scale=ctx.scale, initial_state=h0, cu_seqlens=cu,
            gcs=gcs, a_beta=a_beta, ctab=ctab, seqlens=ctx.seqlens,
        )  # fmt: skip
        g_dt, b_dt, h_dt = ctx.dtypes
        dh0 = None if dh0 is None else dh0.to(h_dt)
        return dq, dk, dv, dg.to(g_dt), dbeta.to(b_dt), None, dh0, None, None, None


def chunk_gdn(
    q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None, seqlens=None
):
    """Differentiable GDN chunked prefill (TileLang forward and backward, FLA conventions).

    Args:
        q, k [1,T,Hqk,128] bf16 (L2-normalised by the caller); v [1,T,Hv,128] bf16;
        g [1,T,Hv] (natural-log decay, g <= 0); beta [1,T,Hv]; scale (default 128**-0.5);
        initial_state [N,Hv,128,128] fp32 or None; output_final_state; cu_seqlens [N+1] or None;
        seqlens: the sequence lengths as host ints (optional; the caller often has them): the
        forward and backward plan their sequence splits from them (else from T / N).
    Returns:
        o [1,T,Hv,128] bf16 and final_state [N,Hv,128,128] fp32 (None unless output_final_state).
        Gradients flow to q, k, v, g, beta and initial_state (dq/dk summed over GVA groups).
    """
    scale = HEAD_DIM**-0.5 if scale is None else float(scale)
    if seqlens is not None:
        n = 1 if cu_seqlens is None else cu_seqlens.numel() - 1
        seqlens = tuple(check_seqlens(seqlens, n, q.shape[1]))
    o, ht = ChunkGDNFunction.apply(
        q, k, v, g, beta, scale, initial_state, bool(output_final_state), cu_seqlens, seqlens
    )  # fmt: skip
    return o, (ht if output_final_state else None)
