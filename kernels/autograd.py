"""Backward of the TileLang GDN chunked prefill, and a trainable autograd entry point.

    chunk_gdn(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
              cu_seqlens=None) -> (o, final_state or None)          # differentiable
    chunk_gdn_bwd(...)  -> dq, dk, dv, dg, dbeta, dh0                # low level

Backward kernel sequence (FLA-style; every GEMM on wgmma), with the default variant:

    bwd_h_ws      (V block, segment, v-head)   recompute h per chunk (bf16) and v_new      [side stream]
    bwd_pw        (chunk slot, qk head)        Pᵀ and W' per v-head of the GVA group
    bwd_dhu_ws    (V block, segment, v-head)   reverse: dh per chunk, dv_new, dh0
    bwd_dqkwg_ws  persistent                   dq, dk (P and state parts), dw, dg (partial)
    bwd_wy_ws     persistent                   through w, u, A: dk, dv, dβ, dg (+ in-chunk reverse cumsum)

(long sequences split into segments add seg_state + fixup before bwd_h and a first bwd_dhu pass +
the reverse fix-up before the second. The persistent forms need ``bwd_grp=1`` and ``bwd_bf16=1``
(dqkwg_ws also ``bwd_rsum=1``), and wy_ws needs Hv > Hqk; otherwise, or with ``bwd_dqkwg_ws=0`` /
``bwd_wy_ws=0``, the one-CTA-per-item group forms run; ``bwd_grp=0`` runs the per-v-head forms with
the GVA group sums in torch.) dq and dk come out
summed over each GVA group. The forward's prep outputs (g cumsum and A·diag(β), chunk-slot layout)
are saved by :class:`ChunkGDNFunction`; A itself is rebuilt inside wy as A = I − A_β M. Per-chunk
states are recomputed, never saved.
Nothing here imports ``qlabench``.
"""

import contextlib
import math

import torch

from ._common import (
    CHUNK,
    HEAD_DIM,
    bwd_ws_forms,
    check_seqlens,
    chunk_table,
    default_cu_seqlens,
    parse_variant,
    segment_table,
)
from .bwd_dhu import run_bwd_dhu
from .bwd_dhu_ws import run_bwd_dhu_ws
from .bwd_dqkwg import run_bwd_dqkwg
from .bwd_dqkwg_ws import run_bwd_dqkwg_ws
from .bwd_h import run_bwd_h
from .bwd_h_ws import run_bwd_h_ws
from .bwd_wy import run_bwd_wy
from .bwd_wy_ws import run_bwd_wy_ws

__all__ = ["chunk_gdn_bwd", "chunk_gdn", "ChunkGDNFunction"]


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def _group_sum(x_v, h_qk, dtype):
    """Sum per-v-head gradients over each GVA group into ``dtype`` in one pass (the reduction
    accumulates in fp32 and rounds once: no fp32 intermediate tensor and no separate cast)."""
    _, T, h_v, d = x_v.shape
    G = h_v // h_qk
    if G == 1:
        return x_v.to(dtype)
    x = x_v.view(1, T, h_qk, G, d)
    if x_v.dtype == dtype:  # e.g. bf16 partials to a bf16 gradient: fp32 accumulation inside
        return x.sum(3)
    return x.sum(3, dtype=torch.float32).to(dtype)  # (sum(dtype=) would cast the operand first)


_SIDE_STREAMS = {}


def _side_stream(dev):
    """The second stream of the backward's state chain on this device (None off CUDA)."""
    if dev.type != "cuda":
        return None
    idx = dev.index if dev.index is not None else torch.cuda.current_device()
    if idx not in _SIDE_STREAMS:
        _SIDE_STREAMS[idx] = torch.cuda.Stream(device=idx)
    return _SIDE_STREAMS[idx]


def _dhu_stages(var, T, N, h_v, block_v, split_tokens, seqlens, dev) -> dict:
    """bwd_dhu's loop pipelining for this call: bwd_stages=2 / 0 as asked; auto = 2 (TMA loads, two
    CTAs per SM) where the bwd_dhu CTAs fit two per SM, else 0 (three per SM hide more)."""
    if var["bwd_stages"] == "0" or var["rowexp"] != "1":
        return {}
    if var["bwd_stages"] == "2":
        return {"stages": 2}
    from . import _lens_of, _num_sms

    lens = _lens_of(T, N, seqlens)
    seg = split_tokens or max(lens, default=0) or 1
    ctas = sum(max(1, math.ceil(ln / seg)) for ln in lens) * h_v * (HEAD_DIM // block_v)
    return {"stages": 2} if ctas <= 2 * _num_sms(dev) else {}


def chunk_gdn_bwd(
    q,
    k,
    v,
    g,
    beta,
    do,
    dht=None,
    scale=None,
    initial_state=None,
    cu_seqlens=None,
    gcs=None,
    a_beta=None,
    ctab=None,
    block_v=32,
    target=None,
    return_intermediates=False,
    variant=None,
    split_tokens=None,
    seqlens=None,
):
    """Gradients of the GDN chunked prefill (FLA conventions).

    Args:
        q, k [1,T,Hqk,128] bf16; v [1,T,Hv,128] bf16; g (raw, natural log), beta [1,T,Hv];
        do [1,T,Hv,128] (cast to bf16); dht [N,Hv,128,128] (d final state) or None;
        scale (default 128**-0.5); initial_state h0 [N,Hv,128,128] or None; cu_seqlens [N+1] or None.
        gcs [Hv,NCS*64] fp32, a_beta [Hv,NCS*64,64] bf16, ctab int32 [NCS,4]: the forward's
            prep outputs (``chunk_gdn_fwd_lowlevel``); recomputed (prep kernel) when None.
        block_v: V columns per CTA of bwd_h / bwd_dhu (32 or 64; 32 measured faster on the H200:
            16/32 1x32768 bwd 13.2 vs 15.9 ms, 4/8 8-way 32768 3.85 vs 4.64 ms — twice the CTAs
            for these serial chains).
        variant: ``_common.parse_variant`` spec (over $QLABENCH_GDN_VARIANT): ``prep`` picks the
            recomputed prep's solve, ``bwd_ws=1`` the warp-specialised bwd_h (bwd_h_ws.py),
            ``rowexp=1`` bwd_dhu's per-row exps.
        split_tokens: the chains (bwd_h, bwd_dhu) walk segments of this many tokens (a multiple
            of 64) instead of whole sequences: None = automatic (``plan_bwd_split``, needs
            bwd_ws=1), 0 = never. Segment start states come from the forward's seg_state + fixup;
            segment-end gradients from a first bwd_dhu pass (split="seg") and the reverse fix-up.
        seqlens: host sequence lengths (ints), only to plan the split exactly for unequal sequences.
    Returns:
        dq, dk [1,T,Hqk,128] (q.dtype, summed over each GVA group), dv [1,T,Hv,128] (v.dtype),
        dg [1,T,Hv] fp32 (for the raw g), dbeta [1,T,Hv] fp32, dh0 [N,Hv,128,128] fp32 or None.
        With ``return_intermediates`` a dict with those and every stage's output (dq_v, dk_part, dk_v
        are [1,T,Hqk,128], summed over each GVA group, under the default ``bwd_grp=1``; per v-head
        [1,T,Hv,128] with ``bwd_grp=0``).
    """
    if q.dim() != 4 or q.shape[0] != 1 or q.shape[3] != HEAD_DIM:
        raise ValueError(f"q must be [1, T, Hqk, {HEAD_DIM}], got {tuple(q.shape)}")
    _, T, h_qk, _ = q.shape
    h_v = v.shape[2]
    if h_v % h_qk:
        raise ValueError(f"Hv={h_v} must be a multiple of Hqk={h_qk}")
    dev = q.device
    var = parse_variant(variant)
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
    if split_tokens is None and var["bwd_split"] != "auto":
        split_tokens = int(var["bwd_split"])
    if split_tokens is None:
        from . import _num_sms, plan_bwd_split

        split_tokens = plan_bwd_split(T, N, h_v, _num_sms(dev), block_v, seqlens) if var["bwd_ws"] == "1" else 0
    split_tokens = int(split_tokens)
    if split_tokens and (split_tokens % CHUNK or split_tokens < 0):
        raise ValueError(f"split_tokens={split_tokens} must be a multiple of {CHUNK} (or 0 / None)")
    if split_tokens and var["bwd_ws"] != "1":
        raise ValueError("split_tokens needs the warp-specialised bwd_h (variant bwd_ws=1)")
    seg_tokens = split_tokens if split_tokens else _round_up(max(T, 1), CHUNK)
    if var["tables"] == "tl" and dev.type == "cuda":  # chunk and segment tables in one launch
        from .tables import run_tables

        ctab_new, cu_chunks, stab, cu_segs = run_tables(cu, T, N, seg_tokens, bool(split_tokens), target=target)
    else:
        ctab_new, cu_chunks = chunk_table(cu, T, N)
        stab, cu_segs = segment_table(cu, cu_chunks, T, N, seg_tokens, split=bool(split_tokens))
    cu_segs = cu_segs.to(torch.int32)
    if ctab is None or tuple(ctab.shape) != (ncs, 4):
        ctab = ctab_new
    if (
        gcs is None
        or a_beta is None
        or tuple(gcs.shape) != (h_v, ncs * CHUNK)
        or tuple(a_beta.shape) != (h_v, ncs * CHUNK, CHUNK)
    ):
        from .prep import run_prep

        gcs, a_beta = run_prep(k, g, beta, ctab, method=var["prep"], target=target)
    dh0 = None
    if h0 is not None:
        dh0 = torch.empty(N, h_v, HEAD_DIM, HEAD_DIM, device=dev, dtype=torch.float32)
    dhu_kw = {"rowexp": True} if var["rowexp"] == "1" else {}
    if var["bwd_stages"] == "2" and var["rowexp"] != "1":
        raise ValueError("GDN variant bwd_stages=2 needs rowexp=1")
    dhu = run_bwd_dhu
    dhu_ws = var["bwd_dhu_ws"] == "1" and block_v == 32  # the warp-specialised reverse chain (bwd_dhu_ws.py)
    if not dhu_ws:  # bwd_dhu's loop form (bwd_dhu_ws has one)
        dhu_kw.update(_dhu_stages(var, T, N, h_v, block_v, split_tokens, seqlens, dev))
    # every buffer is allocated here, on the calling stream, before the chains fork
    bf = dict(device=dev, dtype=torch.bfloat16)
    h_all = torch.empty(h_v, ncs, HEAD_DIM, HEAD_DIM, **bf)
    vnew = torch.empty(h_v, ncs * CHUNK, HEAD_DIM, **bf)
    dh_all = torch.empty(h_v, ncs, HEAD_DIM, HEAD_DIM, **bf)
    dvnew = torch.empty(h_v, ncs * CHUNK, HEAD_DIM, **bf)
    # bwd_h (state recompute) and bwd_dhu (reverse gradient chain) do not depend on each other:
    # with bwd_streams=1 the state side runs on a second stream (joined before dqkwg)
    side = _side_stream(dev) if var["bwd_streams"] == "1" else None
    main = torch.cuda.current_stream(dev) if side is not None else None
    on_side = torch.cuda.stream(side) if side is not None else contextlib.nullcontext()
    if side is not None:
        side.wait_stream(main)
    split_out = {}
    try:  # the join also runs when a launch raises, before any buffer here can be freed
        if dhu_ws:  # its Pᵀ / W' on the main stream, after the fork: the state side does not wait for them
            from .bwd_pw import run_bwd_pw

            pt_all, w_all = run_bwd_pw(q, k, gcs, a_beta, ctab, scale, target=target)
            dhu, dhu_kw = run_bwd_dhu_ws, {"pt": pt_all, "w": w_all}
        if split_tokens:
            from .fixup import run_fixup, run_rfixup
            from .seg_state import run_seg_state

            ns = stab.shape[0]
            f32 = dict(device=dev, dtype=torch.float32)
            e_end = torch.empty(ns, h_v, HEAD_DIM, HEAD_DIM, **f32)
            m_tr = torch.empty(ns, h_v, HEAD_DIM, HEAD_DIM, **bf)
            h_start = torch.empty(ns, h_v, HEAD_DIM, HEAD_DIM, **f32)
            f_start = torch.empty(ns, h_v, HEAD_DIM, HEAD_DIM, **f32)
            d_end = torch.empty(ns, h_v, HEAD_DIM, HEAD_DIM, **f32)
            m_ready = torch.cuda.Event() if side is not None else None
            with on_side:  # segment maps and start states, then h per chunk
                run_seg_state(k, v, gcs, a_beta, stab, e_end, m_tr, num_stages=var["stages"], target=target,
                              fastmath=var["fastmath"] == "1", rowexp=var["rowexp"] == "1")  # fmt: skip
                if m_ready is not None:
                    m_ready.record(side)
                run_fixup(m_tr, e_end, cu_segs, h0, h_start, target=target)
                run_bwd_h_ws(k, v, gcs, a_beta, stab, h_start, h_all, vnew, block_v=block_v, target=target)
            # pass 1 needs no segment map; the reverse fix-up does
            dhu(q, k, gcs, a_beta, do, dht, stab, scale, f_start, dh_all, dvnew, block_v=block_v,
                target=target, split="seg", **dhu_kw)  # fmt: skip
            if m_ready is not None:
                main.wait_event(m_ready)
            run_rfixup(m_tr, f_start, cu_segs, dht, d_end, target=target)
            dh_all, dvnew, dh0 = dhu(
                q, k, gcs, a_beta, do, d_end, stab, scale, dh0, dh_all=dh_all, dvnew=dvnew, block_v=block_v,
                target=target, split="carry", **dhu_kw,
            )  # fmt: skip
            split_out = dict(cu_segs=cu_segs, h_start=h_start, f_start=f_start, d_end=d_end)
        else:
            with on_side:
                if var["bwd_ws"] == "1":
                    run_bwd_h_ws(k, v, gcs, a_beta, stab, h0, h_all, vnew, block_v=block_v, target=target)
                else:
                    run_bwd_h(k, v, gcs, a_beta, stab, h0, h_all, vnew, block_v=block_v, target=target)
            dh_all, dvnew, dh0 = dhu(
                q, k, gcs, a_beta, do, dht, stab, scale, dh0, dh_all, dvnew, block_v=block_v, target=target, **dhu_kw
            )
    finally:
        if side is not None:
            main.wait_stream(side)
    nthr = int(var["bwd_threads"])
    grp = var["bwd_grp"] == "1"  # dq, dk summed over each GVA group inside the kernels
    dq_ws, wy_ws = bwd_ws_forms(var, h_qk, h_v)  # the persistent warp-specialised forms
    if dq_ws:
        dq_v, dk_v, dw, dg_part = run_bwd_dqkwg_ws(q, k, do, gcs, ctab, h_all, dh_all, vnew, dvnew, scale, target=target)
    else:
        dq_v, dk_v, dw, dg_part = run_bwd_dqkwg(
            q, k, do, gcs, ctab, h_all, dh_all, vnew, dvnew, scale, target=target, threads=nthr,
            rsum=var["bwd_rsum"] == "1", bf16_out=var["bwd_bf16"] == "1", grp=grp,
        )  # fmt: skip
    dk_part = dk_v.clone() if return_intermediates else None
    if wy_ws:
        dk_v, dv, dg, dbeta = run_bwd_wy_ws(k, v, beta, gcs, a_beta, ctab, dw, dvnew, dg_part, dk_v, target=target)
    else:
        dk_v, dv, dg, dbeta = run_bwd_wy(
            k, v, beta, gcs, a_beta, ctab, dw, dvnew, dg_part, dk_v, target=target, threads=nthr, grp=grp
        )
    dq = dq_v.to(q.dtype) if grp else _group_sum(dq_v, h_qk, q.dtype)
    dk = dk_v.to(k.dtype) if grp else _group_sum(dk_v, h_qk, k.dtype)
    dv = dv.to(v.dtype)
    if not return_intermediates:
        return dq, dk, dv, dg, dbeta, dh0
    return dict(
        dq=dq, dk=dk, dv=dv, dg=dg, dbeta=dbeta, dh0=dh0,
        ctab=ctab, stab=stab, gcs=gcs, a_beta=a_beta, h_all=h_all, vnew=vnew, dh_all=dh_all, dvnew=dvnew,
        dq_v=dq_v, dk_part=dk_part, dw=dw, dg_part=dg_part, dk_v=dk_v, split_tokens=split_tokens, **split_out,
    )  # fmt: skip


class ChunkGDNFunction(torch.autograd.Function):
    """Autograd wrapper: forward = ``chunk_gdn_fwd_lowlevel``; backward = :func:`chunk_gdn_bwd`.

    Saves q, k, v, g, β, the forward's g cumsum, A·diag(β) and chunk table, h0 and cu_seqlens;
    recomputes the per-chunk states in the backward. ``seqlens`` (host ints or None) only plans
    both passes' sequence splits.
    apply(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, seqlens) -> (o, ht).
    """

    @staticmethod
    def forward(ctx, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, seqlens=None):
        from . import chunk_gdn_fwd_lowlevel

        r = chunk_gdn_fwd_lowlevel(
            q, k, v, g, beta, scale=scale, initial_state=initial_state,
            output_final_state=output_final_state, cu_seqlens=cu_seqlens, seqlens=seqlens,
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
