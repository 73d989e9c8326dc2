"""qlabench_kernels: in-repo TileLang Gated DeltaNet (GDN) chunked-prefill kernels for Hopper.

Public call: :func:`chunk_gdn_fwd` (FLA's conventions). The forward runs

    prep       (per chunk, v-head)           g cumsum, gated K Kᵀ, (I + L)⁻¹ · diag(β)
    [seg_state (per segment, v-head, block)  each segment's end state from 0 and its transition M]
    [fixup     (per sequence, v-head, block) serial start states  h_s+1 = M_s h_s + E_s]
    fwd_o      (per segment, v-head, block)  recurrence over the segment's chunks + output

The bracketed passes run only when long sequences are split across CTAs (exact state
passing; chosen from the shapes, see :func:`plan_split`). Nothing here imports ``qlabench``.
"""

import functools
import math

import torch

from ._common import (
    CHUNK,
    HEAD_DIM,
    VARIANT_CHOICES,
    check_seqlens,
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

__all__ = ["chunk_gdn_fwd", "chunk_gdn_fwd_lowlevel", "plan_split", "plan_fwd", "split_cost", "plan_bwd_split", "bwd_split_cost", "parse_variant", "variant_name", "VARIANT_CHOICES"]

_SM_COUNT = {}


def _num_sms(device) -> int:
    if device.type != "cuda":
        return 132
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


#: Cost model of the split path (relative units, fitted to the H200 split sweeps of 2026-11-30,
#: ``dev/h200_split_sweep_2026-11-30.txt``: 13-21 cases x 4-8 segment lengths in each of four
#: sweeps (default, pprep=1 twice, pprep=1,uw=1); over those 68 rows the model's pick is within
#: 0.3% of the measured best on average, worst 3.7%): fwd_o chunk step per CTA (one CTA per SM),
#: seg_state chunk step per CTA (two CTAs per SM), fixup per segment, the split path's launches.
_SPLIT_COST = {"fwd_o": 2.0, "seg_state": 1.5, "fixup": 3.0, "launch": 10.0}
#: fwd_o's chunk step at block_v 32 relative to 64 (H200, warp-specialised fwd_o before pprep:
#: 16/64 1x32768 fwd_o 2.615 ms with 256 CTAs in two waves vs 1.645 ms with 128: 2.55 vs 3.2 µs)
_BV32_STEP = 0.8
_SPLIT_CANDIDATES = (256, 512, 1024, 2048, 4096, 8192, 16384)


def _lpt_makespan(groups, slots: int) -> float:
    """Makespan of longest-processing-time-first list scheduling of ``groups`` = [(duration, count)]
    on ``slots`` identical slots (what a grid of equal-cost CTAs does on the SMs)."""
    import heapq

    items = sorted(groups, reverse=True)
    if not items:
        return 0.0
    heap = [0.0] * slots
    for dur, cnt in items:
        # cnt jobs of equal length: while every slot is equally loaded, whole rounds over all slots
        # at once (exactly what LPT does then); otherwise one by one onto the least-loaded slot
        if heap[0] == max(heap) and cnt >= slots:
            rounds, cnt = divmod(cnt, slots)
            heap = [t + rounds * dur for t in heap]
        for _ in range(cnt):
            heapq.heappush(heap, heapq.heappop(heap) + dur)
    return max(heap)


def split_cost(lens, h_v: int, seg: int, num_sms: int = 132, block_v: int = 64) -> float:
    """Estimated time (relative units) of fwd_o (+ seg_state + fixup when ``seg`` > 0) for sequences of
    ``lens`` tokens cut into ``seg``-token segments (0 = unsplit); prep and tables do not depend on it."""
    cpb = HEAD_DIM // block_v
    step = _SPLIT_COST["fwd_o"] * (_BV32_STEP if block_v == 32 else 1.0)
    if not seg:
        fwd = [(math.ceil(ln / CHUNK), h_v * cpb) for ln in lens if ln > 0]
        return _lpt_makespan(fwd, num_sms) * step
    fwd, seg_state, serial = {}, {}, 0
    for ln in lens:
        ns = max(1, math.ceil(ln / seg))
        for i in range(ns):
            ch = math.ceil(min(seg, ln - i * seg) / CHUNK)
            fwd[ch] = fwd.get(ch, 0) + h_v * cpb
            if i < ns - 1:
                seg_state[ch] = seg_state.get(ch, 0) + h_v * 4
        serial = max(serial, ns - 1)
    return (
        _lpt_makespan(list(fwd.items()), num_sms) * step
        + _lpt_makespan(list(seg_state.items()), 2 * num_sms) * _SPLIT_COST["seg_state"]
        + serial * _SPLIT_COST["fixup"]
        + _SPLIT_COST["launch"]
    )


@functools.lru_cache(maxsize=4096)
def _plan_lens(lens: tuple, h_v: int, num_sms: int, blocks: tuple) -> tuple:
    longest = max(lens, default=0)
    best, best_cost = (blocks[0], 0), None
    for bv in blocks:
        for seg in (0, *_SPLIT_CANDIDATES):
            if seg and seg >= longest:
                break
            c = split_cost(lens, h_v, seg, num_sms, bv)
            if best_cost is None or c < best_cost * 0.99:  # change only for a clear gain
                best, best_cost = (bv, seg), c
    return best


#: Backward split cost model (µs per chunk step per CTA, H200): bwd_dhu (three CTAs fit per SM at
#: stages=0, two pipelined; counted as two slots per SM), the warp-specialised bwd_h (one per SM),
#: seg_state (two per SM), each fix-up segment (forward and reverse), the split path's extra launches.
_BWD_SPLIT_COST = {"dhu": 6.0, "bwd_h": 1.7, "seg_state": 1.5, "fixup": 3.0, "launch": 20.0}


def bwd_split_cost(lens, h_v: int, seg: int, num_sms: int = 132, block_v: int = 32) -> float:
    """Estimated time (µs-like units) of the backward's chains for sequences of ``lens`` tokens cut
    into ``seg``-token segments (0 = unsplit): bwd_h and bwd_dhu (two passes when split: pass 1 on
    every segment but the first of its sequence), plus seg_state and the two fix-ups when split."""
    cpb = HEAD_DIM // block_v
    c = _BWD_SPLIT_COST
    if not seg:
        items = [(math.ceil(ln / CHUNK), h_v * cpb) for ln in lens if ln > 0]
        return _lpt_makespan(items, 2 * num_sms) * c["dhu"] + _lpt_makespan(items, num_sms) * c["bwd_h"]
    every, not_first, not_last, serial = {}, {}, {}, 0
    for ln in lens:
        ns = max(1, math.ceil(ln / seg))
        for i in range(ns):
            ch = math.ceil(min(seg, ln - i * seg) / CHUNK)
            every[ch] = every.get(ch, 0) + h_v * cpb
            if i > 0:
                not_first[ch] = not_first.get(ch, 0) + h_v * cpb
            if i < ns - 1:
                not_last[ch] = not_last.get(ch, 0) + h_v * 4
        serial = max(serial, ns - 1)
    return (
        (_lpt_makespan(list(every.items()), 2 * num_sms) + _lpt_makespan(list(not_first.items()), 2 * num_sms))
        * c["dhu"]
        + _lpt_makespan(list(every.items()), num_sms) * c["bwd_h"]
        + _lpt_makespan(list(not_last.items()), 2 * num_sms) * c["seg_state"]
        + 2 * serial * c["fixup"]
        + c["launch"]
    )


@functools.lru_cache(maxsize=4096)
def _plan_bwd_lens(lens: tuple, h_v: int, num_sms: int, block_v: int) -> int:
    longest = max(lens, default=0)
    best, best_cost = 0, None
    for seg in (0, *_SPLIT_CANDIDATES[1:]):
        if seg and seg >= longest:
            break
        c = bwd_split_cost(lens, h_v, seg, num_sms, block_v)
        if best_cost is None or c < best_cost * 0.95:  # split only for a clear gain
            best, best_cost = seg, c
    return best


def plan_bwd_split(T: int, N: int, h_v: int, num_sms: int = 132, block_v: int = 32, seqlens=None) -> int:
    """Segment length in tokens for the backward's sequence split (0 = unsplit), by
    :func:`bwd_split_cost` over 512..16384-token segments; host values only."""
    lens = _lens_of(T, N, seqlens)
    if not lens or max(lens) <= 512:
        return 0
    return _plan_bwd_lens(lens, h_v, num_sms, block_v)


def _lens_of(T, N, seqlens):
    if seqlens is not None:
        return tuple(int(x) for x in seqlens)
    return (T // max(N, 1),) * max(N, 1) if T else ()


def plan_fwd(T: int, N: int, h_v: int, num_sms: int = 132, seqlens=None, blocks=(64, 32)) -> tuple:
    """(block_v, segment length) for the warp-specialised forward (variant autobv=1): the pair of
    ``blocks`` x {unsplit, 256..16384-token segments} that :func:`split_cost` rates fastest.
    block_v 32 doubles the fwd_o CTAs at ~0.8x the chunk step, which pays where the heads alone
    do not fill the SMs."""
    lens = _lens_of(T, N, seqlens)
    if not lens or max(lens) <= 256:
        return (blocks[0], 0)
    return _plan_lens(lens, h_v, num_sms, tuple(blocks))


def plan_split(T: int, N: int, h_v: int, num_sms: int = 132, block_v: int = 64, seqlens=None) -> int:
    """Segment length in tokens for sequence splitting, or 0 for no splitting.

    Chosen by a cost model of the split path (:func:`split_cost`: longest-first scheduling of the
    fwd_o and seg_state CTAs over the SMs, plus the serial fix-up), over segment lengths of
    256..16384 tokens. ``seqlens`` (host ints, e.g. from the layout the caller already knows)
    makes the plan exact for unequal sequences; without it the N sequences are taken as equal
    (T / N tokens each). Host values only: no device sync.
    """
    lens = _lens_of(T, N, seqlens)
    if not lens or max(lens) <= 256:
        return 0
    return _plan_lens(lens, h_v, num_sms, (block_v,))[1]


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
    seqlens=None,
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
        seqlens: optional host copy of the sequence lengths (ints; must match cu_seqlens), used
            only to plan the split exactly for unequal sequences (:func:`plan_split`).

    Returns a dict:
        o [1,T,Hv,128] bf16; final_state [N,Hv,128,128] fp32 or None;
        gcs [Hv, NCS*64] fp32 (chunk-local cumsum of g, natural log, chunk-slot rows);
        a_beta [Hv, NCS*64, 64] bf16 (FLA's gated A times diag(β), chunk-slot rows);
        ctab int32 [NCS,4], cu_chunks int64 [N+1] (chunk slots); stab int32 [NS,8] (segments);
        split_tokens (int, 0 = unsplit); variant (dict used); block_v (fwd_o's V block used); and, when split, cu_segs, e_end, m_tr, h_start;
        with pprep=1 p_all [Hv, NCS*64, 64] bf16 (P = scale·Γ⊙QKᵀ per chunk slot).
        (With tables=tl, cu_chunks / cu_segs are int32.)
    """
    var = parse_variant(variant)
    T, N, h_qk, h_v = _validate(q, k, v, g, beta, initial_state, cu_seqlens)
    if var["pprep"] == "1" and T // CHUNK + N > 65535:
        # the P prep's grid has the chunk slots on gridDim.y (at most 65535): beyond ~4.2 M tokens
        # per call the plain prep and fwd_o_ws run instead
        var = dict(var, pprep="0", uw="0")
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
    seqlens = check_seqlens(seqlens, N, T)
    if split_tokens is None and var["autobv"] == "1" and ws:
        bv, split_tokens = plan_fwd(T, N, h_v, _num_sms(dev), seqlens=seqlens, blocks=(bv, 32) if bv != 32 else (32,))
    if split_tokens is None:
        split_tokens = plan_split(T, N, h_v, _num_sms(dev), block_v=bv, seqlens=seqlens)
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
        split_tokens=int(split_tokens or 0), variant=var, block_v=bv,
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
            rowexp=var["rowexp"] == "1", p_all=p_all, uw=var["uw"] == "1",
        )  # fmt: skip
        out.update(cu_segs=cu_segs, e_end=e_end, m_tr=m_tr, h_start=h_start)
    else:
        run_fwd_o(
            q, k, v, gcs, a_beta, stab, h0, scale, o, ht,
            block_v=bv, num_stages=stages, threads=nthr, target=target, fastmath=fm, ws=ws, ws_stages=int(var["ws_stages"]),
            rowexp=var["rowexp"] == "1", p_all=p_all, uw=var["uw"] == "1",
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
    seqlens=None,
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
        seqlens: optional host list of the sequence lengths (what cu_seqlens holds), only for
            planning the sequence split of unequal lengths; without it lengths count as equal.

    Recurrence: S_t = exp(g_t)(I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ,  o_t = S_tᵀ (scale · q_t).

    Returns:
        o [1, T, Hv, 128] bf16, final_state [N, Hv, 128, 128] fp32 (or None).
    """
    r = chunk_gdn_fwd_lowlevel(
        q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, variant=variant, seqlens=seqlens
    )
    return r["o"], r["final_state"]


# --- backward (kernels/bwd_*.py) and the autograd entry point --------------------------------
from .autograd import ChunkGDNFunction, chunk_gdn, chunk_gdn_bwd  # noqa: E402

__all__ += ["chunk_gdn_bwd", "chunk_gdn", "ChunkGDNFunction"]
