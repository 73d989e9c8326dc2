"""Forward driver: :func:`chunk_gdn_fwd_lowlevel` (with intermediates) and :func:`chunk_gdn_fwd`.

    tables    (one CTA)                        chunk and segment tables from cu_seqlens
    [prep     (q/k head, chunk slot)           g cumsum, P = scale·Γ⊙QKᵀ, A_β = (I + L)⁻¹ diag(β)]
    [seg_state (64-column block, segment, v-head)  each segment's end state from 0 and transition M]
    [fixup    (32-column block, sequence, v-head)  serial start states h_{s+1} = M_s h_s + E_s]
    fwd_fused (segment, v-head)                the whole chunk step fused, full V   (block_v 128)
    or fwd_o  (V block, segment, v-head)       recurrence + output from prep's A_β and P (block_v 64)

seg_state and fixup run only when long sequences are split into segments (exact state passing);
prep runs for fwd_o and for the split path. The split and the final kernel (block_v) are planned
from the shapes (:func:`plan.plan_fwd`).
"""

import torch

from ._common import CHUNK, HEAD_DIM, check_seqlens, default_cu_seqlens
from .calibration import for_device
from .fixup import run_fixup
from .fwd_fused import run_fwd_fused
from .fwd_o import run_fwd_o
from .plan import plan_fwd, plan_lpt, plan_split, sm_count
from .prep import run_prep
from .seg_state import run_seg_state
from .tables import run_tables

__all__ = ["chunk_gdn_fwd", "chunk_gdn_fwd_lowlevel"]

#: prep's grid has the chunk slots on gridDim.z (at most 65535): T // 64 + N must stay below it
MAX_CHUNK_SLOTS = 65535


def _validate(q, k, v, g, beta, initial_state, cu_seqlens):
    if q.dim() != 4 or q.shape[0] != 1:
        raise ValueError(f"q must be [1, T, Hqk, 128] (varlen packing, B = 1), got {tuple(q.shape)}")
    _, T, h_qk, dk = q.shape
    if tuple(k.shape) != tuple(q.shape):
        raise ValueError(f"k shape {tuple(k.shape)} must equal q shape {tuple(q.shape)}")
    if v.dim() != 4 or v.shape[0] != 1 or v.shape[1] != T:
        raise ValueError(f"v must be [1, T={T}, Hv, 128], got {tuple(v.shape)}")
    h_v, dv = v.shape[2], v.shape[3]
    if dk != HEAD_DIM or dv != HEAD_DIM:
        raise ValueError(f"head dims must be K = V = {HEAD_DIM}, got K={dk}, V={dv}")
    if h_v % h_qk != 0:
        raise ValueError(f"Hv={h_v} must be a multiple of Hqk={h_qk}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype != torch.bfloat16:
            raise ValueError(f"{name} must be bfloat16, got {t.dtype}")
    for name, t in (("g", g), ("beta", beta)):
        if tuple(t.shape) != (1, T, h_v):
            raise ValueError(f"{name} must be [1, T={T}, Hv={h_v}], got {tuple(t.shape)}")
    N = 1 if cu_seqlens is None else cu_seqlens.numel() - 1
    if initial_state is not None and tuple(initial_state.shape) != (N, h_v, HEAD_DIM, HEAD_DIM):
        raise ValueError(
            f"initial_state must be [N={N}, Hv={h_v}, 128, 128] (K x V, FLA layout), got {tuple(initial_state.shape)}"
        )
    if T // CHUNK + N > MAX_CHUNK_SLOTS:
        raise ValueError(
            f"T // 64 + N = {T // CHUNK + N} chunk slots, at most {MAX_CHUNK_SLOTS} per call (about 4.19 M tokens): "
            "split the batch"
        )
    return T, N, h_qk, h_v


def chunk_gdn_fwd_lowlevel(
    q, k, v, g, beta, scale=None, initial_state=None, output_final_state=True, cu_seqlens=None,
    split_tokens=None, block_v=None, target=None, o=None, final_state=None, seqlens=None, save_prep=False,
):  # fmt: skip
    """Forward with its intermediates.

    Args: as :func:`chunk_gdn_fwd`, plus
        split_tokens: None = planned (:func:`plan.plan_fwd`), 0 = never split, or a segment length
            in tokens (a multiple of 64).
        block_v: 128 = the fused kernel (full V per CTA), 64 = fwd_o; None = planned
            with the split (64 when split_tokens is given).
        target: TileLang target (default sm_90a).
        o, final_state: optional preallocated outputs ([1,T,Hv,128] bf16, [N,Hv,128,128] fp32),
            e.g. poisoned with NaN by a test to check every element is written.
        seqlens: optional host copy of the sequence lengths (ints; must match cu_seqlens), used
            only to plan the split exactly for unequal sequences.
        save_prep: return prep's outputs (gcs, a_beta), which the backward reuses: the planner
            chooses among fwd_o's paths, and prep runs whatever block_v is (without it the
            unsplit fused path runs no prep and they come back None).

    Returns a dict:
        o [1,T,Hv,128] bf16; final_state [N,Hv,128,128] fp32 or None;
        gcs [Hv, NCS*64] fp32 (chunk-local cumsum of g, natural log, chunk-slot rows);
        a_beta [Hv, NCS*64, 64] bf16 (FLA's gated A times diag(β), chunk-slot rows);
        p_all [Hv, NCS*64, 64] bf16 (P = scale·Γ⊙QKᵀ per chunk slot) — these three are None
        when prep did not run (the fused kernel unsplit);
        ctab int32 [NCS,4], cu_chunks int32 [N+1] (chunk slots); stab int32 [NS,8] (segments);
        split_tokens (int, 0 = unsplit); block_v (128: fused, else fwd_o's V block); and, when split, cu_segs,
        e_end, m_tr, h_start.
    """
    T, N, h_qk, h_v = _validate(q, k, v, g, beta, initial_state, cu_seqlens)
    dev = q.device
    scale = HEAD_DIM**-0.5 if scale is None else scale
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    g = g.float().contiguous()
    beta = beta.float().contiguous()
    cu = default_cu_seqlens(T, dev) if cu_seqlens is None else cu_seqlens.to(device=dev, dtype=torch.int64)
    h0 = None if initial_state is None else initial_state.float().contiguous()

    seqlens = check_seqlens(seqlens, N, T)
    if block_v not in (None, 128, 64):
        raise ValueError(f"block_v={block_v} must be 128 (fused), 64 (fwd_o) or None (planned)")
    if split_tokens is None and block_v is None:
        blocks = (64,) if save_prep else (HEAD_DIM, 64)
        block_v, split_tokens = plan_fwd(
            T, N, h_v, sm_count(dev), seqlens=seqlens, blocks=blocks, h_qk=h_qk, costs=for_device(dev).fwd
        )
    if block_v is None:  # a split given alone: fwd_o (the fused kernel's split path measured slower)
        block_v = 64
    if split_tokens is None:
        split_tokens = plan_split(
            T, N, h_v, sm_count(dev), block_v=block_v, seqlens=seqlens, h_qk=h_qk, costs=for_device(dev).fwd
        )
    if split_tokens and split_tokens % CHUNK != 0:
        raise ValueError(f"split_tokens={split_tokens} must be a multiple of {CHUNK} (or 0 / None)")
    seg_tokens = split_tokens if split_tokens else (max(T, 1) + CHUNK - 1) // CHUNK * CHUNK

    fused = block_v == HEAD_DIM
    # the final kernel's CTAs longest first where launch order would leave a long tail
    lpt = plan_lpt(T, N, h_v, split_tokens or 0, block_v, sm_count(dev), seqlens, for_device(dev).fwd)
    ctab, cu_chunks, stab, cu_segs, stab_lpt = run_tables(cu, T, N, seg_tokens, bool(split_tokens), lpt, target=target)
    gcs = a_beta = p_all = None
    if split_tokens or not fused or save_prep:
        gcs, a_beta, p_all = run_prep(q, k, g, beta, ctab, scale, target=target)

    if o is None:
        o = torch.empty(1, T, h_v, HEAD_DIM, device=dev, dtype=torch.bfloat16)
    ht = final_state if output_final_state else None
    if output_final_state and ht is None:
        ht = torch.empty(N, h_v, HEAD_DIM, HEAD_DIM, device=dev, dtype=torch.float32)
    out = dict(
        gcs=gcs, a_beta=a_beta, p_all=p_all, ctab=ctab, cu_chunks=cu_chunks, stab=stab,
        split_tokens=int(split_tokens or 0), block_v=block_v,
    )  # fmt: skip

    h_init = h0
    if split_tokens:
        ns = stab.shape[0]
        e_end = torch.empty(ns, h_v, HEAD_DIM, HEAD_DIM, device=dev, dtype=torch.float32)
        m_tr = torch.empty(ns, h_v, HEAD_DIM, HEAD_DIM, device=dev, dtype=torch.bfloat16)
        run_seg_state(k, v, gcs, a_beta, stab, cu_segs, e_end, m_tr, target=target)
        h_init = torch.empty(ns, h_v, HEAD_DIM, HEAD_DIM, device=dev, dtype=torch.float32)
        run_fixup(m_tr, e_end, cu_segs, h0, h_init, target=target)
        out.update(cu_segs=cu_segs, e_end=e_end, m_tr=m_tr, h_start=h_init)
    if fused:
        run_fwd_fused(q, k, v, g, beta, stab_lpt, h_init, scale, o, ht, target=target)
    else:
        run_fwd_o(q, k, v, gcs, a_beta, p_all, stab_lpt, h_init, scale, o, ht, target=target)
    out.update(o=o, final_state=ht, stab_lpt=stab_lpt)
    return out


def chunk_gdn_fwd(
    q, k, v, g, beta, scale=None, initial_state=None, output_final_state=True, cu_seqlens=None, seqlens=None
):
    """Gated DeltaNet chunked prefill forward (FLA conventions).

    Args:
        q, k: [1, T, Hqk, 128] bf16, already L2-normalised.
        v: [1, T, Hv, 128] bf16, Hv = G · Hqk; v-head j reads q/k head j // G.
        g: [1, T, Hv] fp32, natural-log decay (g <= 0).
        beta: [1, T, Hv] fp32.
        scale: default 128 ** -0.5.
        initial_state: [N, Hv, 128(K), 128(V)] fp32 or None.
        output_final_state: also return the final states.
        cu_seqlens: int32/int64 [N+1] on the device, or None for one sequence of length T.
        seqlens: optional host list of the sequence lengths (what cu_seqlens holds), only for
            planning the sequence split of unequal lengths; without it lengths count as equal.

    Recurrence: S_t = exp(g_t)(I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ,  o_t = S_tᵀ (scale · q_t).

    Returns:
        o [1, T, Hv, 128] bf16, final_state [N, Hv, 128, 128] fp32 (or None).
    """
    r = chunk_gdn_fwd_lowlevel(
        q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, seqlens=seqlens
    )  # fmt: skip
    return r["o"], r["final_state"]
