"""Backward driver: :func:`chunk_gdn_bwd`, the gradients of the chunked prefill (FLA-style, every
GEMM on wgmma):

    bwd_h     (64-column V block, segment, v-head)  recompute h per chunk (bf16) and v_new   [side stream]
    bwd_dhu   (segment, v-head)           reverse: Pᵀ, W' and dh per chunk, dv_new, dh0
    bwd_dqkwy persistent                  dq, dk, dv, dg, dβ: the state terms, then through w, u and A

Long sequences split into segments (:func:`plan.plan_bwd_split`) add seg_state + fixup before
bwd_h (segment start states) and a first bwd_dhu pass + the reverse fix-up before the second
(segment-end gradients). The state side (seg_state, fixup, bwd_h) runs on a second CUDA stream,
concurrent with bwd_dhu, which does not depend on it. dq and dk come out summed over each
GVA group. The forward's prep outputs (g cumsum and A·diag(β), chunk-slot layout) are reused; A
itself is rebuilt inside bwd_dqkwy as A = I − A_β M. Per-chunk states are recomputed, never saved.
"""

import contextlib

import torch

from ._common import CHUNK, HEAD_DIM, check_seqlens, chunk_table, default_cu_seqlens, segment_table
from .bwd_dhu import run_bwd_dhu
from .bwd_dqkwy import run_bwd_dqkwy
from .bwd_h import run_bwd_h
from .calibration import for_device
from .fixup import run_fixup
from .plan import plan_bwd_split, sm_count
from .prep import run_prep
from .seg_state import run_seg_state
from .tables import run_tables

__all__ = ["chunk_gdn_bwd"]

_SIDE_STREAMS = {}


def _side_stream(dev):
    """The second stream of the backward's state chain on this device (None off CUDA)."""
    if dev.type != "cuda":
        return None
    idx = dev.index if dev.index is not None else torch.cuda.current_device()
    if idx not in _SIDE_STREAMS:
        _SIDE_STREAMS[idx] = torch.cuda.Stream(device=idx)
    return _SIDE_STREAMS[idx]


def chunk_gdn_bwd(
    q, k, v, g, beta, do, dht=None, scale=None, initial_state=None, cu_seqlens=None, gcs=None, a_beta=None,
    ctab=None, target=None, return_intermediates=False, split_tokens=None, seqlens=None, streams=True,
):  # fmt: skip
    """Gradients of the GDN chunked prefill (FLA conventions).

    Args:
        q, k [1,T,Hqk,128] bf16; v [1,T,Hv,128] bf16; g (raw, natural log), beta [1,T,Hv];
        do [1,T,Hv,128] (cast to bf16); dht [N,Hv,128,128] (d final state) or None;
        scale (default 128**-0.5); initial_state h0 [N,Hv,128,128] or None; cu_seqlens [N+1] or None.
        gcs [Hv,NCS*64] fp32, a_beta [Hv,NCS*64,64] bf16, ctab int32 [NCS,4]: the forward's
            prep outputs (``chunk_gdn_fwd_lowlevel``); recomputed (prep kernel) when None.
        split_tokens: the chains (bwd_h, bwd_dhu) walk segments of this many tokens (a multiple
            of 64) instead of whole sequences: None = planned (:func:`plan.plan_bwd_split`), 0 = never.
        seqlens: host sequence lengths (ints), only to plan the split exactly for unequal sequences.
        streams: run the state side (seg_state, fixup, bwd_h) on a second CUDA stream.
    Returns:
        dq, dk [1,T,Hqk,128] (q.dtype, summed over each GVA group), dv [1,T,Hv,128] (v.dtype),
        dg [1,T,Hv] fp32 (for the raw g), dbeta [1,T,Hv] fp32, dh0 [N,Hv,128,128] fp32 or None.
        With ``return_intermediates`` a dict with those and the chains' outputs (h_all, vnew,
        dh_all, dvnew, the tables and prep's outputs; the split's segment states and gradients).
    """
    if q.dim() != 4 or q.shape[0] != 1 or q.shape[3] != HEAD_DIM:
        raise ValueError(f"q must be [1, T, Hqk, {HEAD_DIM}], got {tuple(q.shape)}")
    _, T, h_qk, _ = q.shape
    h_v = v.shape[2]
    if h_v % h_qk:
        raise ValueError(f"Hv={h_v} must be a multiple of Hqk={h_qk}")
    dev = q.device
    scale = HEAD_DIM**-0.5 if scale is None else float(scale)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    g = g.float().contiguous()
    beta = beta.float().contiguous()
    do = do.to(torch.bfloat16).contiguous()
    dht = None if dht is None else dht.float().contiguous()
    h0 = None if initial_state is None else initial_state.float().contiguous()
    cu = default_cu_seqlens(T, dev) if cu_seqlens is None else cu_seqlens.to(device=dev, dtype=torch.int64)
    N = cu.numel() - 1
    ncs = T // CHUNK + N  # chunk slots (chunk_table's rows)
    seqlens = check_seqlens(seqlens, N, T)
    if split_tokens is None:
        split_tokens = plan_bwd_split(T, N, h_v, sm_count(dev), seqlens, costs=for_device(dev).bwd)
    split_tokens = int(split_tokens)
    if split_tokens and (split_tokens % CHUNK or split_tokens < 0):
        raise ValueError(f"split_tokens={split_tokens} must be a multiple of {CHUNK} (or 0 / None)")
    seg_tokens = split_tokens if split_tokens else (max(T, 1) + CHUNK - 1) // CHUNK * CHUNK
    if dev.type == "cuda":  # chunk and segment tables in one launch
        ctab_new, cu_chunks, stab, cu_segs, _ = run_tables(cu, T, N, seg_tokens, bool(split_tokens), target=target)
    else:  # the same tables by torch ops (the CPU tests run this driver with emulated kernels)
        ctab_new, cu_chunks = chunk_table(cu, T, N)
        stab, cu_segs = segment_table(cu, cu_chunks, T, N, seg_tokens, split=bool(split_tokens))
    cu_segs = cu_segs.to(torch.int32)
    if ctab is None or tuple(ctab.shape) != (ncs, 4):
        ctab = ctab_new
    prep_shapes = ((h_v, ncs * CHUNK), (h_v, ncs * CHUNK, CHUNK))
    if gcs is None or a_beta is None or (tuple(gcs.shape), tuple(a_beta.shape)) != prep_shapes:
        gcs, a_beta, _ = run_prep(q, k, g, beta, ctab, scale, target=target)
    dh0 = None if h0 is None else torch.empty(N, h_v, HEAD_DIM, HEAD_DIM, device=dev, dtype=torch.float32)
    # every buffer the two chains share is allocated here, on the calling stream, before they fork:
    # whatever the calling stream does to a new buffer (a NaN fill under PoisonAllocations, say) is then
    # ordered before the state side's writes (e_end, m_tr, h_start, h_all, vnew)
    bf = dict(device=dev, dtype=torch.bfloat16)
    h_all = torch.empty(h_v, ncs, HEAD_DIM, HEAD_DIM, **bf)
    vnew = torch.empty(h_v, ncs * CHUNK, HEAD_DIM, **bf)
    dh_all = torch.empty(h_v, ncs, HEAD_DIM, HEAD_DIM, **bf)
    dvnew = torch.empty(h_v, ncs * CHUNK, HEAD_DIM, **bf)
    if split_tokens:  # segment states and their gradients (split path)
        ns = stab.shape[0]
        f32 = dict(device=dev, dtype=torch.float32)
        e_end = torch.empty(ns, h_v, HEAD_DIM, HEAD_DIM, **f32)
        m_tr = torch.empty(ns, h_v, HEAD_DIM, HEAD_DIM, **bf)
        h_start = torch.empty(ns, h_v, HEAD_DIM, HEAD_DIM, **f32)
        f_start = torch.empty(ns, h_v, HEAD_DIM, HEAD_DIM, **f32)
        d_end = torch.empty(ns, h_v, HEAD_DIM, HEAD_DIM, **f32)
    # bwd_h (state recompute) and bwd_dhu (reverse gradient chain) do not depend on each other:
    # the state side runs on a second stream (joined before dqkwy)
    side = _side_stream(dev) if streams else None
    main = torch.cuda.current_stream(dev) if side is not None else None
    on_side = torch.cuda.stream(side) if side is not None else contextlib.nullcontext()
    if side is not None:
        side.wait_stream(main)
    split_out = {}
    try:  # the join also runs when a launch raises, before any buffer here can be freed
        if split_tokens:
            m_ready = torch.cuda.Event() if side is not None else None
            with on_side:  # segment maps and start states, then h per chunk
                run_seg_state(k, v, gcs, a_beta, stab, cu_segs, e_end, m_tr, target=target)
                if m_ready is not None:
                    m_ready.record(side)
                run_fixup(m_tr, e_end, cu_segs, h0, h_start, target=target)
                run_bwd_h(k, v, gcs, a_beta, stab, h_start, h_all, vnew, target=target)
            # pass 1 needs no segment map; the reverse fix-up does
            run_bwd_dhu(q, k, gcs, a_beta, do, dht, stab, scale, f_start, dh_all, dvnew,
                        target=target, split="seg")  # fmt: skip
            if m_ready is not None:
                main.wait_event(m_ready)
            run_fixup(m_tr, f_start, cu_segs, dht, d_end, reverse=True, target=target)
            dh_all, dvnew, dh0 = run_bwd_dhu(
                q, k, gcs, a_beta, do, d_end, stab, scale, dh0, dh_all, dvnew, target=target, split="carry",
            )  # fmt: skip
            split_out = dict(cu_segs=cu_segs, h_start=h_start, f_start=f_start, d_end=d_end)
        else:
            with on_side:
                run_bwd_h(k, v, gcs, a_beta, stab, h0, h_all, vnew, target=target)
            dh_all, dvnew, dh0 = run_bwd_dhu(q, k, gcs, a_beta, do, dht, stab, scale, dh0, dh_all, dvnew, target=target)
    finally:
        if side is not None:
            main.wait_stream(side)
    dq, dk, dv, dg, dbeta = run_bwd_dqkwy(q, k, v, beta, do, gcs, a_beta, ctab, h_all, dh_all, vnew, dvnew, scale,
                                          target=target)  # fmt: skip
    dq, dk, dv = dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
    if not return_intermediates:
        return dq, dk, dv, dg, dbeta, dh0
    return dict(
        dq=dq, dk=dk, dv=dv, dg=dg, dbeta=dbeta, dh0=dh0,
        ctab=ctab, stab=stab, gcs=gcs, a_beta=a_beta, h_all=h_all, vnew=vnew, dh_all=dh_all, dvnew=dvnew,
        split_tokens=split_tokens, **split_out,
    )  # fmt: skip
