"""Run-time planners of the kernels: the forward's V block and sequence split, the backward's split.

Host values only (shapes and, optionally, host sequence lengths): no device synchronisation.
The cost models count chunk steps per CTA under longest-first scheduling of the grid on the SMs,
priced per step by the GPU model's cost table (:mod:`.calibration`, docs/kernels.md "Planners").
"""

import functools
import heapq
import math

import torch

from ._common import CHUNK, HEAD_DIM
from .calibration import default_table

__all__ = ["sm_count", "split_cost", "prep_cost", "prep_slices", "plan_fwd", "plan_split", "plan_lpt", "bwd_split_cost",
           "plan_bwd_split", "fwd_candidates", "bwd_candidates"]  # fmt: skip

_SM_COUNT = {}


def sm_count(device) -> int:
    """Streaming multiprocessors of ``device`` (the default cost table's GPU's, off CUDA); cached per device."""
    if device.type != "cuda":
        return default_table().sms
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def _fwd(costs):
    return default_table().fwd if costs is None else costs


def _bwd(costs):
    return default_table().bwd if costs is None else costs


#: fwd_o's and seg_state's CTAs resident per SM (256 threads at 128 registers; fwd_o 98 KB of shared
#: memory); grids of more CTAs than SMs are scheduled on this many slots per SM
PAIRED_CTAS_PER_SM = 2
_SPLIT_CANDIDATES = (256, 512, 1024, 2048, 4096, 8192, 16384)


def _lpt_loads(groups, slots: int) -> list:
    """Per-slot loads, largest first, of longest-processing-time-first list scheduling of
    ``groups`` = [(duration, count)] on ``slots`` identical slots (what a grid of CTAs does on the SMs)."""
    heap, top = [0.0] * slots, 0.0  # a min-heap of the loads, and their maximum
    for dur, cnt in sorted(groups, reverse=True):
        # cnt jobs of equal length, one by one onto the least-loaded slot; while the loads lie
        # within one job of each other, the next ``slots`` jobs go one to each slot (a slot that
        # takes one is then at least as loaded as every other), so whole rounds go at once
        while cnt:
            if cnt >= slots and top - heap[0] <= dur:
                rounds, cnt = divmod(cnt, slots)
                heap = [t + rounds * dur for t in heap]
                top += rounds * dur
                continue
            top = max(top, heapq.heapreplace(heap, heap[0] + dur) + dur)
            cnt -= 1
    return sorted(heap, reverse=True)


def _lpt_makespan(groups, slots: int) -> float:
    """Makespan of :func:`_lpt_loads`' schedule."""
    return _lpt_loads(groups, slots)[0] if groups else 0.0


def prep_cost(lens, h_v: int, num_sms: int = 132, h_qk=None, costs=None) -> float:
    """prep's estimated time over the SMs: every chunk of every v-head (``costs.prep``), plus every
    chunk of every q/k head (``costs.prep_qk``: its loads and gate tables, shared by the group's G
    v-heads; ``h_qk`` None: G = 1), plus one kernel's fixed cost."""
    c = _fwd(costs)
    h_qk = h_v if h_qk is None else h_qk
    chunks = sum(math.ceil(ln / CHUNK) for ln in lens)
    return chunks * (h_v * c.prep + h_qk * c.prep_qk) / num_sms + c.kernel


#: prep's CTAs resident per SM (kernels/prep.py compiles with it as its MIN_BLOCKS)
PREP_CTAS_PER_SM = 4
#: the share of one round of prep CTAs (PREP_CTAS_PER_SM per SM) that a slicing must launch
PREP_ROUND = 0.6


def prep_slices(h_qk: int, h_v: int, ncs: int, num_sms: int = 132) -> int:
    """Over how many CTAs prep spreads each q/k head's G v-heads: the fewest (a divisor of G) that
    launch at least ``PREP_ROUND`` of one round of CTAs on the SMs. Each CTA walks G / slices
    v-heads one after the other, sharing the chunk's q / k loads; that pays while the SMs stay busy."""
    G = h_v // h_qk
    for d in range(1, G + 1):
        if G % d == 0 and h_qk * d * ncs >= PREP_ROUND * PREP_CTAS_PER_SM * num_sms:
            return d
    return G


def _runs_prep(seg: int, block_v: int) -> bool:
    """Whether a path runs prep: every one but the unsplit fused kernel (forward.py)."""
    return bool(seg) or block_v != HEAD_DIM


def _few_weight(n_ctas: int, num_sms: int) -> float:
    """The full-round step's weight in :func:`_few_step`: 0 up to ``num_sms / 8`` CTAs, 1 from
    ``num_sms``, linear between."""
    lo = num_sms / 8
    return min(1.0, max(0.0, (n_ctas - lo) / (num_sms - lo)))


def _few_step(n_ctas: int, num_sms: int, full: float, few: float) -> float:
    """The chunk step of a grid of at most one CTA per SM: ``few`` up to ``num_sms / 8`` CTAs,
    ``full`` at ``num_sms``, linear between (less contention for memory with fewer CTAs)."""
    return few + (full - few) * _few_weight(n_ctas, num_sms)


def _paired_makespan(groups, num_sms: int, c, stage: str = "fwd_o") -> float:
    """A two-CTAs-per-SM kernel's grid [(chunks, CTAs)] on the SMs, priced by the ``stage``'s costs
    (fwd_o or seg_state: ``stage``, ``stage_alone``, ``stage_few``, ``cta_stage``): at most one CTA
    per SM, longest-first at its step alone (:func:`_few_step`); more, two slots per SM at the
    shared step, each SM pairing a heavily loaded slot with a lightly loaded one (the block
    scheduler spreads a partial round over the SMs), the part of the heavier slot's load that runs
    with no partner at the step alone. A CTA's overhead is its cost alone (beside another, scaled
    as the step)."""
    pair, alone, few, cta = (getattr(c, n) for n in (stage, f"{stage}_alone", f"{stage}_few", f"cta_{stage}"))
    n = sum(k for _, k in groups)
    if n <= num_sms:
        step = _few_step(n, num_sms, alone, few)
        return _lpt_makespan([(ch * step + cta, k) for ch, k in groups], num_sms)
    ratio = alone / pair  # a CTA's time alone over its time beside another
    loads = _lpt_loads([(ch * pair + cta / ratio, k) for ch, k in groups], num_sms * PAIRED_CTAS_PER_SM)
    last = len(loads) - 1
    return max(loads[last - i] + (loads[i] - loads[last - i]) * ratio for i in range(num_sms))


def _seg_chunks(ln: int, seg: int) -> list:
    """The chunk counts of a ``ln``-token sequence's segments in slot order (none for an empty one)."""
    if ln <= 0:
        return []
    return [math.ceil((min(seg, ln - i * seg) if seg else ln) / CHUNK) for i in range(math.ceil(ln / seg) if seg else 1)]


def fwd_grids(lens, h_v: int, seg: int, block_v: int) -> tuple:
    """{chunks: CTAs} of the final kernel (128 / block_v per segment) and seg_state; the fix-up's serial steps."""
    fwd, seg_state, serial = {}, {}, 0
    for ln in lens:
        chunks = _seg_chunks(ln, seg)
        for i, ch in enumerate(chunks):
            fwd[ch] = fwd.get(ch, 0) + h_v * (HEAD_DIM // block_v)
            if i < len(chunks) - 1:
                seg_state[ch] = seg_state.get(ch, 0) + h_v * 4
        serial = max(serial, len(chunks) - 1)
    return fwd, seg_state, serial


def _final_cost(lens, h_v: int, seg: int, num_sms: int, block_v: int, c) -> float:
    """The forward less prep: the final kernel's CTAs longest-first on the SMs and its fixed cost; when split,
    seg_state's, the serial fix-up and the split path's fixed cost (``launch``: their kernels, the tables)."""
    fwd, seg_state, serial = fwd_grids(lens, h_v, seg, block_v)
    if block_v == HEAD_DIM:
        step = _few_step(sum(fwd.values()), num_sms, c.fused, c.fused_few)
        cost = _lpt_makespan([(ch * step + c.cta_fused, k) for ch, k in fwd.items()], num_sms)
    else:
        cost = _paired_makespan(list(fwd.items()), num_sms, c)
    cost += c.kernel
    if seg:
        cost += _paired_makespan(list(seg_state.items()), num_sms, c, "seg_state") + serial * c.fixup + c.launch
    return cost


def split_cost(lens, h_v: int, seg: int, num_sms: int = 132, block_v: int = 64, h_qk=None, costs=None) -> float:
    """Estimated time (the cost table's unit) of the forward for sequences of ``lens`` tokens cut
    into ``seg``-token segments (0 = unsplit): the final kernel's CTAs (``block_v`` 64: fwd_o, 128 /
    bv CTAs of bv columns per segment and v-head; 128: the fused kernel, one) longest-first on the
    SMs, prep (:func:`prep_cost`; every path but the unsplit fused one runs it), and when split
    seg_state's non-last segments, the serial fix-up and the split path's fixed cost."""
    c = _fwd(costs)
    prep = prep_cost(lens, h_v, num_sms, h_qk, c) if _runs_prep(seg, block_v) else 0.0
    return _final_cost(lens, h_v, seg, num_sms, block_v, c) + prep


def fwd_candidates(lens, num_sms: int = 132, blocks=(128, 64)) -> list:
    """The (block_v, segment tokens) pairs :func:`plan_fwd` rates for ``lens``: every block x
    unsplit and every segment length shorter than the longest sequence."""
    longest = max(lens, default=0)
    return [(bv, seg) for bv in blocks for seg in (0, *_SPLIT_CANDIDATES) if not seg or seg < longest]


@functools.lru_cache(maxsize=4096)
def _plan_lens(lens: tuple, h_v: int, num_sms: int, blocks: tuple, h_qk, c) -> tuple:
    prep = prep_cost(lens, h_v, num_sms, h_qk, c)
    best, best_cost, best_final = (blocks[0], 0), None, None
    for bv, seg in fwd_candidates(lens, num_sms, blocks):
        final = _final_cost(lens, h_v, seg, num_sms, bv, c)
        cost = final + (prep if _runs_prep(seg, bv) else 0.0)
        # change only for a clear gain: 1% of the final kernels' part (prep, the same for every
        # candidate that runs it, does not widen the margin)
        if best_cost is None or cost < best_cost - 0.01 * best_final:
            best, best_cost, best_final = (bv, seg), cost, final
    return best


#: what the longest-first order of the final kernel's CTAs must gain by the model: on grids where it
#: gains little, the order itself measured 4–5% slower (H100, serving layouts of 8/24 and 16/32)
LPT_MARGIN = 0.10


@functools.lru_cache(maxsize=4096)
def _lpt_pays(lens: tuple, h_v: int, seg: int, block_v: int, num_sms: int, c) -> bool:
    fwd = fwd_grids(lens, h_v, seg, block_v)[0]
    if block_v == HEAD_DIM:
        slots, step, cta = num_sms, c.fused, c.cta_fused
    elif sum(fwd.values()) > num_sms:  # fwd_o's CTAs two to an SM
        slots, step, cta = num_sms * PAIRED_CTAS_PER_SM, c.fwd_o, c.cta_fwd_o
    else:
        slots, step, cta = num_sms, c.fwd_o_alone, c.cta_fwd_o
    total = sum((ch * step + cta) * k for ch, k in fwd.items())
    # list scheduling in any order ends by total / slots + its longest CTA
    if sum(fwd.values()) <= slots or max(fwd) * step + cta <= LPT_MARGIN * total / slots:
        return False
    heap = [0.0] * slots  # the block scheduler's launch order: segment slots in order, each one's CTAs together
    for ch in (ch for ln in lens for ch in _seg_chunks(ln, seg)):
        for _ in range(h_v * (HEAD_DIM // block_v)):
            heapq.heapreplace(heap, heap[0] + ch * step + cta)
    return max(heap) > (1 + LPT_MARGIN) * _lpt_makespan([(ch * step + cta, k) for ch, k in fwd.items()], slots)


def plan_lpt(T: int, N: int, h_v: int, seg: int, block_v: int, num_sms: int = 132, seqlens=None, costs=None) -> bool:
    """Whether the final kernel takes its CTAs longest first (``tables``' stab_lpt): when the cost
    model's schedule of them in launch order is ``LPT_MARGIN`` longer than longest first. Without
    ``seqlens`` the sequences count as equal, and the order is kept."""
    lens = _lens_of(T, N, seqlens)
    return bool(lens) and _lpt_pays(lens, h_v, seg, block_v, num_sms, _fwd(costs))


def bwd_split_cost(lens, h_v: int, seg: int, num_sms: int = 132, costs=None) -> float:
    """Estimated time (the cost table's unit) of the backward's chains for sequences of ``lens``
    tokens cut into ``seg``-token segments (0 = unsplit): bwd_h and bwd_dhu (two passes when split:
    pass 1 on every segment but the first of its sequence), plus seg_state and the two fix-ups when
    split."""
    c = _bwd(costs)
    every, not_last, serial = fwd_grids(lens, h_v, seg, HEAD_DIM)  # one CTA per segment and v-head
    chains = _lpt_makespan(list(every.items()), num_sms)
    if not seg:
        return chains * (c.dhu + c.bwd_h)
    not_first = dict(every)  # pass 1 of bwd_dhu: every segment but each sequence's first
    for ln in lens:
        if ln > 0:
            not_first[math.ceil(min(seg, ln) / CHUNK)] -= h_v
    return (
        (chains + _lpt_makespan(list(not_first.items()), num_sms)) * c.dhu
        + chains * c.bwd_h
        + _lpt_makespan(list(not_last.items()), 2 * num_sms) * c.seg_state
        + 2 * serial * c.fixup
        + c.launch
    )


def bwd_candidates(lens) -> list:
    """The segment lengths :func:`plan_bwd_split` rates for ``lens`` (0 = unsplit): unsplit and
    every 512 .. 16384-token length shorter than the longest sequence; unsplit alone when no
    sequence is longer than 512 tokens."""
    longest = max(lens, default=0)
    if longest <= 512:
        return [0]
    return [0, *(s for s in _SPLIT_CANDIDATES[1:] if s < longest)]


@functools.lru_cache(maxsize=4096)
def _plan_bwd_lens(lens: tuple, h_v: int, num_sms: int, c) -> int:
    best, best_cost = 0, None
    for seg in bwd_candidates(lens):
        cost = bwd_split_cost(lens, h_v, seg, num_sms, c)
        if best_cost is None or cost < best_cost * 0.95:  # split only for a clear gain
            best, best_cost = seg, cost
    return best


def plan_bwd_split(T: int, N: int, h_v: int, num_sms: int = 132, seqlens=None, costs=None) -> int:
    """Segment length in tokens for the backward's sequence split (0 = unsplit), by
    :func:`bwd_split_cost` over 512..16384-token segments; host values only. ``costs``: a
    :class:`.calibration.BwdCosts` (default: the default GPU's table)."""
    lens = _lens_of(T, N, seqlens)
    if not lens or max(lens) <= 512:
        return 0
    return _plan_bwd_lens(lens, h_v, num_sms, _bwd(costs))


def _lens_of(T, N, seqlens):
    if seqlens is not None:
        return tuple(int(x) for x in seqlens)
    return (T // max(N, 1),) * max(N, 1) if T else ()


def plan_fwd(
    T: int, N: int, h_v: int, num_sms: int = 132, seqlens=None, blocks=(128, 64), h_qk=None, costs=None
) -> tuple:
    """(block_v, segment length) of the forward: the pair of
    ``blocks`` x {unsplit, 256..16384-token segments} that :func:`split_cost` rates fastest.
    block_v 128 is the fused kernel (no prep when unsplit, one CTA per segment and v-head); 64 is
    fwd_o after prep (two CTAs per segment and v-head, two per SM). ``costs``: a
    :class:`.calibration.FwdCosts` (default: the default GPU's table)."""
    lens = _lens_of(T, N, seqlens)
    if not lens:
        return (blocks[0], 0)
    return _plan_lens(lens, h_v, num_sms, tuple(blocks), h_qk, _fwd(costs))  # no split candidate for sequences <= 256


def plan_split(
    T: int, N: int, h_v: int, num_sms: int = 132, block_v: int = 64, seqlens=None, h_qk=None, costs=None
) -> int:
    """Segment length in tokens for sequence splitting, or 0 for no splitting.

    Chosen by a cost model of the split path (:func:`split_cost`: longest-first scheduling of the
    final kernel's (``block_v``: fwd_o or the fused kernel) and seg_state's CTAs over the SMs, prep,
    the serial fix-up), over segment lengths of
    256..16384 tokens. ``seqlens`` (host ints, e.g. from the layout the caller already knows)
    makes the plan exact for unequal sequences; without it the N sequences are taken as equal
    (T / N tokens each). Host values only: no device sync.
    """
    lens = _lens_of(T, N, seqlens)
    if not lens or max(lens) <= 256:
        return 0
    return _plan_lens(lens, h_v, num_sms, (block_v,), h_qk, _fwd(costs))[1]
