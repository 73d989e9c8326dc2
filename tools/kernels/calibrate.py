"""The calibration micro-benchmark: the planners' stage costs measured on the GPU, written as the
GPU model's cost table (:mod:`qlabench_kernels.calibration`, ``kernels/cost_tables/<gpu>.json``).

    python -m qlabench_tools.kernels.calibrate [--out kernels/cost_tables/nvidia_h200.json] [--reps 10]
        [--checks CHECKS.json] [--timings TIMINGS.json] [--fwd-only]

Its kernels (heads 1/1 and 1/4): ``qlabench precompile calibration`` fills the cache offline.

:func:`measure_fwd` times each stage alone (CUDA-graph medians) on synthetic batches whose grids
fill the SMs a known number of times: a step cost is the slope between two sequence lengths (so no
fixed cost enters it), at two CTAs per SM, one, and 1/8 of one; a CTA's own overhead and a kernel's
fixed cost come from the same kernel on many short sequences (many rounds of CTAs) against one
round; the split path's remaining fixed cost from the whole forward split and unsplit. Nothing in
it comes from a sweep config. It then checks the table: on further synthetic batches (few and many
(sequence, v-head) pairs, short and long) it times every candidate the planner rates and reports how
far the planner's pick is from the fastest.

The backward's (:func:`measure_bwd`): the whole backward timed at every segment length the planner
rates on synthetic batches (:data:`FIT_BWD`), and its split model's costs fitted to them by
non-negative least squares with one free base per batch (what the split does not change); checked
the same way on other batches (:data:`CHECKS_BWD`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import sys

from qlabench_kernels import plan
from qlabench_kernels.calibration import HEADS, BwdCosts, CostTable, FwdCosts, default_table, load

# --------------------------------------------------------------------------------------

#: the two lengths (tokens per sequence) each slope is taken between
LENGTHS = (1024, 4096)
#: fix-up: one sequence cut into this many 256-token segments (the slope is per serial segment)
FIXUP_SEGMENTS = (8, 64)
#: the many-rounds experiments: sequences of this many tokens (two chunks), this many rounds of CTAs
#: (even: fwd_o's pairs take half as many)
SHORT, ROUNDS = 128, 8
assert ROUNDS % 2 == 0 and ROUNDS > 2
#: an overhead that comes out below 0 by more than this share of the timing it is taken from is a
#: broken measurement, not noise around none
NOISE = 0.05


def experiments(sms: int) -> list[dict]:
    """The stage timings the costs are fitted from: dicts of stage, x (the length or segment count
    the slope is taken over; 0: one timing), heads (h_qk, h_v), seqlens, split (segment tokens,
    0 = unsplit) and block_v. Grids (CTAs):

    - fwd_o:  2 per (sequence, v-head): ``sms`` sequences fill two per SM, ``sms // 2`` one,
      ``sms // 16`` at most 1/8 of one; ``ROUNDS * sms / 2`` short sequences ``ROUNDS / 2`` rounds
      of two per SM;
    - fused:  1 per (sequence, v-head): ``sms`` sequences, one per SM; ``sms // 8``;
      ``ROUNDS * sms`` short sequences, ``ROUNDS`` rounds;
    - prep:   ``sms`` sequences at G = 1 and G = 4 (per-v-head and per-q/k-head parts);
    - seg_state: sequences of 2L cut at L, a non-last segment 4 CTAs: ``sms // 2`` segments (two
      CTAs per SM), ``sms // 4`` (one), ``sms // 32`` (at most 1/8 of one) — the kernel's grid
      walks the non-last segments only —; ``ROUNDS * sms / 4`` short segments ``ROUNDS / 2`` rounds of
      two per SM;
    - fixup:  one sequence of n 256-token segments (n - 1 serial steps);
    - split / unsplit: the whole forward on one 4096-token sequence cut at 1024 and not cut
      (the split path's fixed cost, less what the model prices of it).
    """
    half, few_o, few_f = max(1, sms // 2), max(1, sms // 16), max(1, sms // 8)
    quarter, few_s = _seg_state_grids(sms)
    out = []
    for L in LENGTHS:
        out.append(dict(stage="fwd_o", x=L, heads=(1, 1), seqlens=(L,) * sms, split=0, block_v=64))
        out.append(dict(stage="fwd_o_alone", x=L, heads=(1, 1), seqlens=(L,) * half, split=0, block_v=64))
        out.append(dict(stage="fwd_o_few", x=L, heads=(1, 1), seqlens=(L,) * few_o, split=0, block_v=64))
        out.append(dict(stage="fused", x=L, heads=(1, 1), seqlens=(L,) * sms, split=0, block_v=128))
        out.append(dict(stage="fused_few", x=L, heads=(1, 1), seqlens=(L,) * few_f, split=0, block_v=128))
        for hk in HEADS:
            out.append(dict(stage=f"prep_g{hk[1] // hk[0]}", x=L, heads=hk, seqlens=(L,) * sms, split=0, block_v=64))
        out.append(dict(stage="seg_state", x=L, heads=(1, 1), seqlens=(2 * L,) * half, split=L, block_v=64))
        out.append(dict(stage="seg_state_alone", x=L, heads=(1, 1), seqlens=(2 * L,) * quarter, split=L, block_v=64))
        out.append(dict(stage="seg_state_few", x=L, heads=(1, 1), seqlens=(2 * L,) * few_s, split=L, block_v=64))
    out.append(dict(stage="fwd_o_many", x=0, heads=(1, 1), seqlens=(SHORT,) * (ROUNDS * sms // 2), split=0, block_v=64))
    out.append(dict(stage="fused_many", x=0, heads=(1, 1), seqlens=(SHORT,) * (ROUNDS * sms), split=0, block_v=128))
    out.append(dict(stage="seg_state_many", x=0, heads=(1, 1), seqlens=(2 * SHORT,) * (ROUNDS * sms // 4), split=SHORT,
                    block_v=64))  # fmt: skip
    for n in FIXUP_SEGMENTS:
        out.append(dict(stage="fixup", x=n, heads=(1, 1), seqlens=(256 * n,), split=256, block_v=64))
    out.append(dict(stage="total_split", x=0, heads=(1, 1), seqlens=(4096,), split=1024, block_v=64))
    out.append(dict(stage="total_unsplit", x=0, heads=(1, 1), seqlens=(4096,), split=0, block_v=64))
    return out


def probes(sms: int) -> list[dict]:
    """Timings recorded beside :func:`experiments` (``--timings``) but not fitted: what the model
    does not price yet, for its next form to be fitted offline. fwd_o at heads 1/4 (G v-heads share
    Q and K through L2; the fitted steps are at 1/1, where each CTA reads its own): ``sms // 4``
    sequences (two CTAs per SM) and ``sms // 8`` (about one)."""
    out = []
    for L in LENGTHS:
        out.append(dict(stage="fwd_o_g4", x=L, heads=(1, 4), seqlens=(L,) * max(1, sms // 4), split=0, block_v=64))
        out.append(dict(stage="fwd_o_alone_g4", x=L, heads=(1, 4), seqlens=(L,) * max(1, sms // 8), split=0,
                        block_v=64))  # fmt: skip
    return out


def _seg_state_grids(sms: int) -> tuple:
    """The segments of seg_state's one-per-SM and few-CTA experiments (4 CTAs each); on fewer
    than 8 SMs one segment is both. (On an odd SM count the two-per-SM grid leaves one SM a single
    CTA, whose step is then the slope's if it is the slower.)"""
    return max(1, sms // 4), max(1, sms // 32)


def _key(e: dict) -> tuple:
    return (e["stage"], e["x"])


def _few_and_full(s_a: float, n_a: int, s_b: float, n_b: int, sms: int) -> tuple:
    """(few, full) steps of :func:`plan._few_step` from slopes ``s_a``, ``s_b`` measured on grids of
    ``n_a`` > ``n_b`` CTAs (at most one per SM): its weights are known, so two timings give both."""

    wa, wb = plan._few_weight(n_a, sms), plan._few_weight(n_b, sms)
    if wa == wb:
        raise RuntimeError(f"calibration: grids of {n_a} and {n_b} CTAs on {sms} SMs do not separate the steps")
    d = (s_a - s_b) / (wa - wb)
    few = s_b - d * wb
    return few, few + d


def fit_fwd(times_us: dict, sms: int) -> FwdCosts:
    """The forward's costs (µs) from :func:`experiments`' timings, ``times_us[_key(e)]``. An overhead
    below 0 by at most ``NOISE`` of the timing it comes from (noise around none) is 0; one further
    below, or a step cost that is not positive, is refused (RuntimeError)."""
    L1, L2 = LENGTHS
    dchunks, c1 = (L2 - L1) // 64, L1 // 64

    def slope(stage):
        return (times_us[(stage, L2)] - times_us[(stage, L1)]) / dchunks

    fwd_o, fused, seg_state = slope("fwd_o"), slope("fused"), slope("seg_state")
    few_o, alone = _few_and_full(slope("fwd_o_alone"), 2 * max(1, sms // 2), slope("fwd_o_few"), 2 * max(1, sms // 16), sms)
    few_f, _ = _few_and_full(fused, sms, slope("fused_few"), max(1, sms // 8), sms)
    quarter, few_s = _seg_state_grids(sms)
    if quarter > few_s:
        few_ss, alone_ss = _few_and_full(slope("seg_state_alone"), 4 * quarter, slope("seg_state_few"), 4 * few_s, sms)
    else:
        few_ss = alone_ss = slope("seg_state_alone")
    # prep over ``sms`` sequences: per chunk of one sequence (h_v · prep + h_qk · prep_qk) · sms / sms
    g1, g4 = slope("prep_g1"), slope("prep_g4")  # = prep + prep_qk, 4 prep + prep_qk
    prep = (g4 - g1) / 3
    prep_qk = g1 - prep
    n1, n2 = FIXUP_SEGMENTS
    fixup = (times_us[("fixup", n2)] - times_us[("fixup", n1)]) / (n2 - n1)
    steps = dict(fwd_o=fwd_o, fwd_o_alone=alone, fused=fused, prep=prep, prep_qk=prep_qk, seg_state=seg_state,
                 fixup=fixup, fwd_o_few=few_o, fused_few=few_f, seg_state_alone=alone_ss,
                 seg_state_few=few_ss)  # fmt: skip
    bad = {k: v for k, v in steps.items() if not (v > 0 and math.isfinite(v))}
    if bad:
        raise RuntimeError(f"calibration gave non-positive costs {bad} (timings: {times_us}); re-run on a quiet GPU")

    def overhead(name, raw, source):  # noise around 0 is 0; more below 0 is a broken timing
        if not math.isfinite(raw) or raw < -NOISE * times_us[source]:
            raise RuntimeError(
                f"calibration gave a negative overhead {name} = {raw:.4g} us (from {source}, "
                f"{times_us[source]:.4g} us; timings: {times_us}); re-run on a quiet GPU"
            )
        return max(0.0, raw)

    def per_cta(stage, step, rounds):  # (one round's intercept, a CTA's overhead)
        # one round: kernel + cta + c1 steps; ``rounds`` rounds of two-chunk CTAs: kernel + rounds (2 steps + cta)
        i = times_us[(stage, L1)] - c1 * step
        many = (f"{stage}_many", 0)
        return i, overhead(f"cta_{stage}", (times_us[many] - rounds * (SHORT // 64) * step - i) / (rounds - 1), many)

    i_f, cta_f = per_cta("fused", fused, ROUNDS)
    # fwd_o's and seg_state's rounds are of two CTAs per SM: their overheads in the shared step's time
    i_o, cta_o = per_cta("fwd_o", fwd_o, ROUNDS // 2)
    kernel = overhead("kernel", ((i_f - cta_f) + (i_o - cta_o)) / 2, ("fwd_o", L1))
    _, cta_s = per_cta("seg_state", seg_state, ROUNDS // 2)  # its own fixed cost is the split path's (``launch``)
    vals = dict(steps, launch=0.0, cta_fwd_o=cta_o * alone / fwd_o, cta_fused=cta_f,
                cta_seg_state=cta_s * alone_ss / seg_state,
                kernel=kernel)  # fmt: skip
    partial = FwdCosts(**vals, unit="us")
    measured = times_us[("total_split", 0)] - times_us[("total_unsplit", 0)]
    modelled = plan.split_cost((4096,), 1, 1024, sms, 64, h_qk=1, costs=partial) - plan.split_cost(
        (4096,), 1, 0, sms, 64, h_qk=1, costs=partial
    )
    return dataclasses.replace(partial, launch=overhead("launch", measured - modelled, ("total_split", 0)))


#: the backward's fit batches (h_qk, h_v, seqlens): long single sequences of few heads (where the
#: split pays) to many shorter ones (where it does not); none a check batch's or a sweep config's
FIT_BWD = (
    (1, 1, (8192,)), (1, 1, (32768,)), (1, 4, (16384,)), (1, 1, (4096,) * 4), (1, 4, (6000, 2000, 1000)),
    (1, 1, (2048,) * 16), (1, 1, (24000,) + (700,) * 12),
)  # fmt: skip


def fit_bwd(times_us: dict, sms: int) -> BwdCosts:
    """The backward split model's costs (µs) from whole-backward timings ``times_us[(h_v, lens,
    seg)]``: :func:`plan.bwd_split_cost` is linear in its costs, so the timings are fitted by
    non-negative least squares (relative error) with one free base per batch (the stages the split
    does not change); a batch timed at one segment length only adds nothing and is left out."""
    import numpy as np
    from scipy.optimize import nnls

    names = [f.name for f in dataclasses.fields(BwdCosts) if f.name != "unit"]
    batches = sorted({(h_v, lens) for h_v, lens, _ in times_us}, key=str)
    batches = [b for b in batches if sum(1 for k in times_us if k[:2] == b) > 1]
    A, y = [], []
    for i, (h_v, lens) in enumerate(batches):
        for (hv, ln, seg), t in sorted(times_us.items(), key=str):
            if (hv, ln) != (h_v, lens):
                continue
            unit = [BwdCosts(**{m: float(m == n) for m in names}) for n in names]
            A.append([float(j == i) for j in range(len(batches))]
                     + [plan.bwd_split_cost(lens, h_v, seg, sms, u) for u in unit])  # fmt: skip
            y.append(t)
    if len(y) < len(batches) + len(names):
        raise RuntimeError(f"backward calibration: {len(y)} timings for {len(batches) + len(names)} unknowns")
    A, y = np.array(A), np.array(y)
    x, _ = nnls(A / y[:, None], np.ones_like(y))
    tiny = 1e-9 * float(y.max())  # the solver's round-off around 0
    costs = {n: float(v) if v > tiny else 0.0 for n, v in zip(names, x[len(batches) :])}
    if costs["dhu"] + costs["bwd_h"] <= 0:
        raise RuntimeError(f"backward calibration: the chains' step came out 0 ({costs}); timings {times_us}")
    return BwdCosts(**costs, unit="us")


#: the synthetic batches the table is checked on (h_qk, h_v, seqlens): few and many (sequence,
#: v-head) pairs, short and long, equal and unequal, and a serving-like mix of 64 sequences of 1 to
#: 505 tokens; no sweep config's
CHECKS = (
    (1, 1, (16384,)), (1, 1, (2048,) * 8), (1, 4, (32768,)), (1, 4, (1024,) * 40),
    (1, 4, (12000, 3000, 700, 300)), (1, 1, (8192,) * 96), (1, 4, (512,) * 200),
    (1, 4, tuple(range(1, 513, 8))),
)  # fmt: skip


#: the backward's check batches: one long sequence of few heads to many short ones
CHECKS_BWD = ((1, 1, (16384,)), (1, 4, (32768,)), (1, 1, (2048,) * 8), (1, 4, (12000, 3000, 700, 300)), (1, 1, (4096,) * 64))


def _graph_us(fn, reps: int) -> float:
    """Median µs per call over CUDA-graph replays (calls unrolled in the graph to ~1 ms or more)."""
    from qlabench_tools.kernels.check_fwd import graph_time_ms

    return graph_time_ms(fn, reps, target_s=1e-3, max_inner=50) * 1000.0


def _inputs(h_qk, h_v, seqlens, device, seed=0):
    """Random inputs with g = 0: no warm-up shortens seg_state's walk, so the table prices the
    exact walk that heads whose gates do not decay pay (the planners never see g); no other kernel's
    time depends on g's values."""
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)
    T = sum(seqlens)

    def rn(*s):
        return torch.randn(*s, generator=gen, device=device)

    q = torch.nn.functional.normalize(rn(1, T, h_qk, 128), dim=-1).to(torch.bfloat16)
    k = torch.nn.functional.normalize(rn(1, T, h_qk, 128), dim=-1).to(torch.bfloat16)
    v = rn(1, T, h_v, 128).to(torch.bfloat16)
    g = torch.zeros(1, T, h_v, device=device)
    beta = torch.sigmoid(rn(1, T, h_v))
    h0 = rn(len(seqlens), h_v, 128, 128) * 0.1
    cu = torch.tensor([0, *torch.cumsum(torch.tensor(seqlens), 0).tolist()], dtype=torch.int32, device=device)
    return dict(q=q, k=k, v=v, g=g, beta=beta, h0=h0, cu=cu)


def _time_experiment(e: dict, device, reps: int) -> float:
    from qlabench_kernels.fixup import run_fixup
    from qlabench_kernels.forward import chunk_gdn_fwd_lowlevel
    from qlabench_kernels.fwd_fused import run_fwd_fused
    from qlabench_kernels.fwd_o import run_fwd_o
    from qlabench_kernels.prep import run_prep
    from qlabench_kernels.seg_state import run_seg_state

    h_qk, h_v = e["heads"]
    x = _inputs(h_qk, h_v, list(e["seqlens"]), device)
    sp, bv, st = e["split"], e["block_v"], e["stage"]
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], None, x["h0"], True, x["cu"])
    if st.startswith("total"):
        return _graph_us(lambda: chunk_gdn_fwd_lowlevel(*args, split_tokens=sp, block_v=bv), reps)
    r = chunk_gdn_fwd_lowlevel(*args, split_tokens=sp, block_v=64, save_prep=True)
    scale = 128**-0.5
    if st.startswith("prep"):
        fn = lambda: run_prep(x["q"], x["k"], x["g"], x["beta"], r["ctab"], scale, p_all=r["p_all"])  # noqa: E731
    elif st.startswith("fwd_o"):
        fn = lambda: run_fwd_o(  # noqa: E731
            x["q"], x["k"], x["v"], r["gcs"], r["a_beta"], r["p_all"], r["stab"], x["h0"], scale, r["o"], r["final_state"]
        )  # fmt: skip
    elif st.startswith("fused"):
        fn = lambda: run_fwd_fused(  # noqa: E731
            x["q"], x["k"], x["v"], x["g"], x["beta"], r["stab"], x["h0"], scale, r["o"], r["final_state"]
        )  # fmt: skip
    elif st.startswith("seg_state"):
        fn = lambda: run_seg_state(  # noqa: E731
            x["k"], x["v"], r["gcs"], r["a_beta"], r["stab"], r["cu_segs"].int(), r["e_end"], r["m_tr"]
        )  # fmt: skip
    elif st == "fixup":
        fn = lambda: run_fixup(r["m_tr"], r["e_end"], r["cu_segs"].int(), x["h0"], r["h_start"])  # noqa: E731
    else:
        raise ValueError(f"unknown calibration stage {st!r}")
    return _graph_us(fn, reps)


def _bwd_args(x):
    import torch

    do = torch.randn_like(x["v"])
    dht = torch.randn_like(x["h0"]) * 0.1
    return (x["q"], x["k"], x["v"], x["g"], x["beta"], do, dht), dict(initial_state=x["h0"], cu_seqlens=x["cu"])


def _time_bwd_candidates(h_qk, h_v, lens, device, reps: int) -> dict:
    """{segment length: µs} of the whole backward at every segment length the planner rates."""
    from qlabench_kernels.backward import chunk_gdn_bwd

    x = _inputs(h_qk, h_v, list(lens), device)
    args, kw = _bwd_args(x)
    return {
        seg: _graph_us(lambda seg=seg: chunk_gdn_bwd(*args, **kw, split_tokens=seg), reps)
        for seg in plan.bwd_candidates(lens)
    }


def _cand(c) -> str:
    """A candidate plan as a JSON key: '64,1024' (forward) or '1024' (backward)."""
    return ",".join(map(str, c)) if isinstance(c, tuple) else str(c)


def _check_row(direction, h_qk, h_v, lens, times, pick, best, old, echo) -> dict:
    """One planner-check row (JSON: plans as lists or ints; ``times``: every candidate's µs by
    :func:`_cand`), echoed as one line."""
    js = (lambda c: list(c)) if direction == "fwd" else (lambda c: c)
    row = dict(direction=direction, heads=f"{h_qk}/{h_v}",
               seqlens=f"{len(lens)}x{lens[0]}" if len(set(lens)) == 1 else str(list(lens)),
               pick=js(pick), pick_us=times[pick], best=js(best), best_us=times[best],
               committed=js(old), committed_us=times[old],
               times={_cand(c): t for c, t in times.items()})  # fmt: skip
    echo(f"  check {direction} {row['heads']:5s} {row['seqlens']:28s} pick {pick!s:>11} {times[pick]:9.1f} us  "
         f"best {best!s:>11} {times[best]:9.1f} us  ({times[pick] / times[best]:.3f}x)")  # fmt: skip
    return row


def check_table(fwd: FwdCosts, device, reps: int = 10, echo=print, compare: FwdCosts | None = None) -> list[dict]:
    """On each of :data:`CHECKS`: every candidate (block_v, split) the planner rates, timed whole,
    against the planner's pick under ``fwd`` (and under ``compare``, e.g. the committed table).
    Rows: direction, heads, seqlens, pick, pick_us, best, best_us, committed, committed_us."""
    from qlabench_kernels.forward import chunk_gdn_fwd_lowlevel

    sms = plan.sm_count(device)
    rows = []
    for h_qk, h_v, lens in CHECKS:
        x = _inputs(h_qk, h_v, list(lens), device)
        cands = plan.fwd_candidates(lens, sms)
        times = {}
        for bv, seg in cands:
            fn = lambda bv=bv, seg=seg, x=x: chunk_gdn_fwd_lowlevel(  # noqa: E731
                x["q"], x["k"], x["v"], x["g"], x["beta"], None, x["h0"], True, x["cu"], split_tokens=seg, block_v=bv
            )  # fmt: skip
            times[(bv, seg)] = _graph_us(fn, reps)
        pick = plan.plan_fwd(sum(lens), len(lens), h_v, sms, seqlens=list(lens), h_qk=h_qk, costs=fwd)
        old = plan.plan_fwd(sum(lens), len(lens), h_v, sms, seqlens=list(lens), h_qk=h_qk, costs=compare or fwd)
        best = min(times, key=times.get)
        rows.append(_check_row("fwd", h_qk, h_v, lens, times, pick, best, old, echo))
    return rows


def check_table_bwd(bwd: BwdCosts, device, reps: int = 10, echo=print, compare: BwdCosts | None = None) -> list[dict]:
    """On each of :data:`CHECKS_BWD`: the whole backward at every segment length the planner rates,
    against its pick under ``bwd`` (and under ``compare``); rows as :func:`check_table`'s."""
    sms = plan.sm_count(device)
    rows = []
    for h_qk, h_v, lens in CHECKS_BWD:
        times = _time_bwd_candidates(h_qk, h_v, lens, device, reps)
        pick = plan.plan_bwd_split(sum(lens), len(lens), h_v, sms, seqlens=list(lens), costs=bwd)
        old = plan.plan_bwd_split(sum(lens), len(lens), h_v, sms, seqlens=list(lens), costs=compare or bwd)
        best = min(times, key=times.get)
        rows.append(_check_row("bwd", h_qk, h_v, lens, times, pick, best, old, echo))
    return rows


def _time_all(exps, time_one, device, reps: int, echo) -> dict:
    """{experiment key: µs} of ``time_one(e, device, reps)`` for every experiment, each echoed."""
    times = {}
    for e in exps:
        times[_key(e)] = time_one(e, device, reps)
        echo(f"  {e['stage']:18s} heads {e['heads'][0]}/{e['heads'][1]} {len(e['seqlens'])}x{e['seqlens'][0]:<6d} "
             f"split {e['split']:5d}: {times[_key(e)]:9.1f} us")  # fmt: skip
    return times


def measure_fwd(device=None, reps: int = 10, echo=print, compare=None, record=None) -> tuple[FwdCosts, list[dict]]:
    """Time :func:`experiments` and :func:`probes` on ``device`` (the current CUDA device), fit the
    forward's costs (:func:`fit_fwd`) and check them (:func:`check_table`). ``record`` (a dict): gets
    the timings, ``record['fwd'][stage@x]`` in µs, before the fit (a refused fit keeps them)."""
    import torch

    device = torch.device("cuda") if device is None else torch.device(device)
    sms = plan.sm_count(device)
    times = _time_all(experiments(sms) + probes(sms), _time_experiment, device, reps, echo)
    if record is not None:
        record["fwd"] = {f"{st}@{x}": t for (st, x), t in times.items()}
    fwd = fit_fwd(times, sms)
    echo("  fwd costs (us): " + ", ".join(f"{k} {v:.4g}" for k, v in dataclasses.asdict(fwd).items() if k != "unit"))
    return fwd, check_table(fwd, device, reps, echo, compare)


def measure_bwd(device=None, reps: int = 10, echo=print, compare=None, record=None) -> tuple[BwdCosts, list[dict]]:
    """Time the whole backward at every candidate segment length on :data:`FIT_BWD`, fit the split
    model's costs (:func:`fit_bwd`) and check them (:func:`check_table_bwd`). ``record``: gets the
    timings, ``record['bwd']['h_v|lens|seg']`` in µs, before the fit."""
    import torch

    device = torch.device("cuda") if device is None else torch.device(device)
    sms = plan.sm_count(device)
    times = {}
    for h_qk, h_v, lens in FIT_BWD:
        for seg, t in _time_bwd_candidates(h_qk, h_v, lens, device, reps).items():
            times[(h_v, tuple(lens), seg)] = t
            echo(f"  bwd heads {h_qk}/{h_v} {len(lens)}x{lens[0]:<6d} split {seg:5d}: {t:9.1f} us")
    if record is not None:
        record["bwd"] = {f"{hv}|{','.join(map(str, ls))}|{seg}": t for (hv, ls, seg), t in times.items()}
    bwd = fit_bwd(times, sms)
    echo("  bwd costs (us): " + ", ".join(f"{k} {v:.4g}" for k, v in dataclasses.asdict(bwd).items() if k != "unit"))
    return bwd, check_table_bwd(bwd, device, reps, echo, compare)


def _summary(rows: list[dict], key: str) -> str:
    ratios = [r[f"{key}_us"] / r["best_us"] for r in rows]
    geo = math.exp(sum(math.log(x) for x in ratios) / len(ratios))
    return f"geomean {geo:.4f}x the fastest candidate, worst {max(ratios):.4f}x"


def main(argv=None) -> int:
    import argparse
    import datetime

    import torch

    from qlabench.results import git_sha

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=pathlib.Path, default=None, help="write the table here (default: print only)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--checks", type=pathlib.Path, default=None, help="write the planner check rows here (JSON)")
    ap.add_argument("--timings", type=pathlib.Path, default=None,
                    help="write the timings the fits took and the probes' here (JSON, µs), a refused fit's too")
    ap.add_argument("--fwd-only", action="store_true", help="measure the forward's costs only (keep the backward's)")
    args = ap.parse_args(argv)
    if args.reps < 1:
        print(f"error: --reps {args.reps}: at least 1", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("error: the calibration times kernels on a CUDA GPU; none is visible", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    name = torch.cuda.get_device_name(dev)
    try:
        base = load(name)
    except FileNotFoundError:
        base = default_table()
    except ValueError as e:  # a table this version cannot read: measured anew, compared with the default
        print(f"warning: {e}; comparing with the {default_table().gpu}'s table", file=sys.stderr)
        base = default_table()
    commit = git_sha(str(pathlib.Path(__file__).parent))  # $QLABENCH_GIT_SHA in a `git archive` tree
    uuid = getattr(torch.cuda.get_device_properties(dev), "uuid", "")
    how = f"measured: python -m qlabench_tools.kernels.calibrate on {name} {uuid}, {datetime.date.today()}, commit {commit}"
    src = dict(base.source)
    record = {"gpu": name, "sms": plan.sm_count(dev), "commit": commit}

    def write_timings():
        if args.timings:
            args.timings.parent.mkdir(parents=True, exist_ok=True)
            args.timings.write_text(json.dumps(record, indent=1) + "\n")

    try:
        fwd, checks = measure_fwd(dev, args.reps, compare=base.fwd, record=record)
    except RuntimeError as e:  # the forward's fit refused: no table is written
        write_timings()
        print(f"error: forward not calibrated: {e}", file=sys.stderr)
        return 1
    write_timings()
    src["fwd"] = how

    def write(bwd) -> str:  # the table and checks so far (the forward's first: a cut run keeps them)
        table = CostTable(gpu=name, sms=plan.sm_count(dev), fwd=fwd, bwd=bwd, source=tuple(src.items()))
        text = json.dumps(table.to_json(), indent=2) + "\n"
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(text)
        if args.checks:
            args.checks.write_text(json.dumps(checks, indent=1) + "\n")
        return text

    bwd = base.bwd
    write(bwd)
    if not args.fwd_only:
        try:
            bwd, checks_bwd = measure_bwd(dev, args.reps, compare=base.bwd, record=record)
            src["bwd"] = how
            checks += checks_bwd
        except RuntimeError as e:  # the backward's fit refused: the table keeps its backward costs
            print(f"backward not calibrated: {e}")
        write_timings()
    print(write(bwd))
    for d in ("fwd", "bwd"):
        rows = [r for r in checks if r["direction"] == d]
        if rows:
            print(f"planner check {d} ({len(rows)} batches): measured table {_summary(rows, 'pick')}; "
                  f"committed table {_summary(rows, 'committed')}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
