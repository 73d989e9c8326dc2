"""qlabench_kernels: in-repo TileLang Gated DeltaNet (GDN) chunked-prefill kernels for Hopper.

Public call: :func:`chunk_gdn_fwd` (FLA's conventions). The forward runs

    prep       (per chunk, v-head)           g cumsum, gated K Kᵀ, (I + L)⁻¹ · diag(β)
    [seg_state (per segment, v-head, block)  each segment's end state from 0 and its transition M]
    [fixup     (per sequence, v-head, block) serial start states  h_s+1 = M_s h_s + E_s]
    fwd_o      (per segment, v-head, block)  recurrence over the segment's chunks + output

The bracketed passes run only when long sequences are split across CTAs (exact state
passing; chosen from the shapes, see :func:`plan_split`). Nothing here imports ``qlabench``.
"""

import math

import torch

from ._common import (
    CHUNK,
    HEAD_DIM,
    VARIANT_CHOICES,
    chunk_table,
    default_cu_seqlens,
    parse_variant,
    segment_table,
    variant_name,
)
from .fixup import run_fixup
from .fwd_o import run_fwd_o
from .prep import run_prep
from .seg_state import run_seg_state
from .tables import run_tables

__all__ = ["chunk_gdn_fwd", "chunk_gdn_fwd_lowlevel", "plan_split", "parse_variant", "variant_name", "VARIANT_CHOICES"]

_SM_COUNT = {}


def _num_sms(device) -> int:
    if device.type != "cuda":
        return 132
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def plan_split(T: int, N: int, h_v: int, num_sms: int = 132, block_v: int = 64) -> int:
    """Segment length in tokens for sequence splitting, or 0 for no splitting.

    Decided from host-known shapes only (T, N, h_v), so no device sync is needed: splitting
    pays when the unsplit grid (N · h_v · 128/block_v CTAs, each walking a whole sequence)
    fills under half the SMs: for sequences of >= 4096 tokens on average the segment length is
    a power of two (>= 1024 tokens) giving about two CTAs per SM in fwd_o; for 1024..4095
    tokens on average it is 512.
    """
    ctas = N * h_v * (HEAD_DIM // block_v)
    if 2 * ctas > num_sms or T < 1024 * N:
        return 0
    if T < 4096 * N:
        # short sequences (1024..4095 tokens on average): 512-token segments. Measured on the H200
        # (2/8 1x2048, warp-specialised fwd_o): unsplit 0.122 ms, 512 -> 0.081, 1024 -> 0.125.
        return 512
    want_segments = max(1, math.ceil(2 * num_sms / (h_v * (HEAD_DIM // block_v))))
    seg = T / want_segments
    seg = 2 ** round(math.log2(max(seg, 1024)))
    return int(max(1024, seg))


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
    return T, N, h_qk, h_v


def chunk_gdn_fwd_lowlevel(
    q,
    k,
    v,
    g,
    beta,
    scale=None,
    initial_state=None,
    output_final_state=True,
    cu_seqlens=None,
    split_tokens=None,
    target=None,
    o=None,
    final_state=None,
    variant=None,
):
    """Forward with its intermediates.

    Args: as :func:`chunk_gdn_fwd`, plus
        split_tokens: None = automatic (:func:`plan_split`), 0 = never split, or a segment
            length in tokens (a multiple of 64).
        target: TileLang target (default sm_90a).
        o, final_state: optional preallocated outputs ([1,T,Hv,128] bf16, [N,Hv,128,128] fp32),
            e.g. poisoned with NaN by a test to check every element is written.
        variant: speed-experiment knobs, "k=v,k=v" or dict (see ``_common.parse_variant``;
            default: $QLABENCH_GDN_VARIANT, then the verified defaults).

    Returns a dict:
        o [1,T,Hv,128] bf16; final_state [N,Hv,128,128] fp32 or None;
        gcs [Hv, NCS*64] fp32 (chunk-local cumsum of g, natural log, chunk-slot rows);
        a_beta [Hv, NCS*64, 64] bf16 (FLA's gated A times diag(β), chunk-slot rows);
        ctab int32 [NCS,4], cu_chunks int64 [N+1] (chunk slots); stab int32 [NS,8] (segments);
        split_tokens (int, 0 = unsplit); variant (dict used); and, when split, cu_segs, e_end, m_tr, h_start;
        with pprep=1 p_all [Hv, NCS*64, 64] bf16 (P = scale·Γ⊙QKᵀ per chunk slot).
        (With tables=tl, cu_chunks / cu_segs are int32.)
    """
    var = parse_variant(variant)
    T, N, h_qk, h_v = _validate(q, k, v, g, beta, initial_state, cu_seqlens)
    dev = q.device
    if scale is None:
        scale = HEAD_DIM**-0.5
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    g = g.float().contiguous()
    beta = beta.float().contiguous()
    cu = default_cu_seqlens(T, dev) if cu_seqlens is None else cu_seqlens.to(device=dev, dtype=torch.int64)
    h0 = None if initial_state is None else initial_state.float().contiguous()

    bv, nthr, stages = int(var["fwd_bv"]), int(var["fwd_threads"]), var["stages"]
    fm = var["fastmath"] == "1"
    ws = var["fwd_ws"] == "1"
    if split_tokens is None:
        split_tokens = plan_split(T, N, h_v, _num_sms(dev), block_v=bv)
    if split_tokens and split_tokens % CHUNK != 0:
        raise ValueError(f"split_tokens={split_tokens} must be a multiple of {CHUNK} (or 0 / None)")
    seg_tokens = split_tokens if split_tokens else _round_up(max(T, 1), CHUNK)

    if var["tables"] == "tl":
        ctab, cu_chunks, stab, cu_segs = run_tables(cu, T, N, seg_tokens, bool(split_tokens), target=target)
    else:
        ctab, cu_chunks = chunk_table(cu, T, N)
        stab, cu_segs = segment_table(cu, cu_chunks, T, N, seg_tokens, split=bool(split_tokens))
    p_all = None
    if var["pprep"] == "1":  # prep also writes P = scale·Γ⊙QKᵀ; the warp-specialised fwd_o loads it
        gcs, a_beta, p_all = run_prep(k, g, beta, ctab, method=var["prep"], target=target, q=q, scale=scale)
    else:
        gcs, a_beta = run_prep(k, g, beta, ctab, method=var["prep"], target=target)

    if o is None:
        o = torch.empty(1, T, h_v, HEAD_DIM, device=dev, dtype=torch.bfloat16)
    ht = None
    if output_final_state:
        ht = final_state
        if ht is None:
            ht = torch.empty(N, h_v, HEAD_DIM, HEAD_DIM, device=dev, dtype=torch.float32)
    out = dict(
        gcs=gcs, a_beta=a_beta, ctab=ctab, cu_chunks=cu_chunks, stab=stab,
        split_tokens=int(split_tokens or 0), variant=var,
    )  # fmt: skip

    if split_tokens:
        ns = stab.shape[0]
        e_end = torch.empty(ns, h_v, HEAD_DIM, HEAD_DIM, device=dev, dtype=torch.float32)
        m_tr = torch.empty(ns, h_v, HEAD_DIM, HEAD_DIM, device=dev, dtype=torch.bfloat16)
        run_seg_state(
            k, v, gcs, a_beta, stab, e_end, m_tr, num_stages=stages, target=target, fastmath=fm,
            rowexp=var["rowexp"] == "1",
        )  # fmt: skip
        h_start = torch.empty(ns, h_v, HEAD_DIM, HEAD_DIM, device=dev, dtype=torch.float32)
        cu_segs32 = cu_segs if cu_segs.dtype == torch.int32 else cu_segs.to(torch.int32)
        run_fixup(m_tr, e_end, cu_segs32, h0, h_start, target=target)
        run_fwd_o(
            q, k, v, gcs, a_beta, stab, h_start, scale, o, ht,
            block_v=bv, num_stages=stages, threads=nthr, target=target, fastmath=fm, ws=ws, ws_stages=int(var["ws_stages"]),
            rowexp=var["rowexp"] == "1", p_all=p_all,
        )  # fmt: skip
        out.update(cu_segs=cu_segs, e_end=e_end, m_tr=m_tr, h_start=h_start)
    else:
        run_fwd_o(
            q, k, v, gcs, a_beta, stab, h0, scale, o, ht,
            block_v=bv, num_stages=stages, threads=nthr, target=target, fastmath=fm, ws=ws, ws_stages=int(var["ws_stages"]),
            rowexp=var["rowexp"] == "1", p_all=p_all,
        )  # fmt: skip
    out.update(o=o, final_state=ht)
    if p_all is not None:
        out["p_all"] = p_all
    return out


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def chunk_gdn_fwd(
    q,
    k,
    v,
    g,
    beta,
    scale=None,
    initial_state=None,
    output_final_state=True,
    cu_seqlens=None,
    variant=None,
):
    """Gated DeltaNet chunked prefill forward (FLA conventions).

    Args:
        q, k: [1, T, Hqk, 128] bf16, already L2-normalised.
        v: [1, T, Hv, 128] bf16, Hv = m · Hqk; v-head j reads q/k head j // m.
        g: [1, T, Hv] fp32, natural-log decay (g <= 0).
        beta: [1, T, Hv] fp32.
        scale: default 128 ** -0.5.
        initial_state: [N, Hv, 128(K), 128(V)] fp32 or None.
        output_final_state: also return the final states.
        cu_seqlens: int32/int64 [N+1] on the device, or None for one sequence of length T.
        variant: speed-experiment knobs (``_common.parse_variant``), default $QLABENCH_GDN_VARIANT.

    Recurrence: S_t = exp(g_t)(I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ,  o_t = S_tᵀ (scale · q_t).

    Returns:
        o [1, T, Hv, 128] bf16, final_state [N, Hv, 128, 128] fp32 (or None).
    """
    r = chunk_gdn_fwd_lowlevel(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, variant=variant)
    return r["o"], r["final_state"]


# --- backward (kernels/bwd_*.py) and the autograd entry point --------------------------------
from .autograd import ChunkGDNFunction, chunk_gdn, chunk_gdn_bwd  # noqa: E402

__all__ += ["chunk_gdn_bwd", "chunk_gdn", "ChunkGDNFunction"]
