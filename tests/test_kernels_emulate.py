"""CPU tests of the forward kernels' algorithms (tools/kernels/emulate.py mirrors them), no GPU.

- tables: the one-launch table builder's algorithm (block scan + binary search, blocks of 512
  sequences) gives exactly the torch builders' tables, incl. empty sequences, N > 512 and the
  unsplit case.
- prep: its mirror (the fused kernel's aux per chunk slot) against the exact solve and P, mild
  and strong decay, zero past each sequence's end.
- fwd_o: its mbarrier protocol (tools/kernels/ws_protocol.py) and its algebra.
- fwd_fused: its mbarrier protocol (tools/kernels/fused_protocol.py), its algebra and fp16 inverse.
"""

import importlib

import pytest
import qlabench_kernels
import torch
from qlabench_tools.kernels import dqkwy_protocol, emulate, fused_protocol, ws_protocol


def _cu(lens):
    return torch.tensor([0, *torch.cumsum(torch.tensor(lens, dtype=torch.int64), 0).tolist()], dtype=torch.int64)


LAYOUTS = [
    [32768],
    [1, 63, 64, 65, 1000, 4097],
    [0, 5, 0, 0, 700, 64, 2000, 0],
    [8] * 1024,
    [0] * 3 + [130] * 600 + [0],  # N > 512 (two blocks), empty sequences at both ends
    [0],
    [64] * 7,
]


@pytest.mark.parametrize("lens", LAYOUTS, ids=lambda x: f"N{len(x)}")
@pytest.mark.parametrize("seg", [None, 64, 1024])
def test_tl_tables_algorithm_equals_torch_tables(lens, seg):
    common = importlib.import_module("qlabench_kernels._common")
    emu = emulate
    cu = _cu(lens)
    T, N = int(cu[-1]), len(lens)
    split = seg is not None
    seg_t = seg if split else max(64, (max(T, 1) + 63) // 64 * 64)
    ctab, cu_chunks = common.chunk_table(cu, T, N)
    stab, cu_segs = common.segment_table(cu, cu_chunks, T, N, seg_t, split=split)
    c2, cc2, s2, cs2 = emu.emu_tables_tl(cu, T, N, seg_t, split)
    assert torch.equal(ctab, c2)
    assert torch.equal(stab, s2)
    assert torch.equal(cu_chunks.int(), cc2)
    assert torch.equal(cu_segs.int(), cs2)


@pytest.mark.parametrize("lens", [*LAYOUTS, [(i * 37) % 2300 for i in range(700)]], ids=lambda x: f"N{len(x)}")
@pytest.mark.parametrize("seg", [None, 64, 1024])
def test_tl_longest_first_order_equals_torch_order(lens, seg):
    """tables.py's longest-first rows (warp match groups, counts across warps) are lpt_order's."""
    common = importlib.import_module("qlabench_kernels._common")
    cu = _cu(lens)
    T, N = int(cu[-1]), len(lens)
    seg_t = seg if seg else max(64, (max(T, 1) + 63) // 64 * 64)
    _, cu_chunks = common.chunk_table(cu, T, N)
    stab, _ = common.segment_table(cu, cu_chunks, T, N, seg_t, split=seg is not None)
    assert torch.equal(emulate.emu_lpt_tl(stab), common.lpt_order(stab))
    assert torch.equal(emulate.emu_lpt_tl(stab, nt=64), common.lpt_order(stab))


@pytest.mark.parametrize("lens", LAYOUTS, ids=lambda x: f"N{len(x)}")
@pytest.mark.parametrize("seg", [64, 128, 1024])
def test_seg_state_grid_walks_every_non_last_segment_once_in_slot_order(lens, seg):
    """seg_state's grid rows (the kernel's binary search over cu_segs, mirrored) are the non-last
    segments' slots in order, then nothing: the CTAs that work come first in launch order."""
    common = importlib.import_module("qlabench_kernels._common")
    cu = _cu(lens)
    T, N = int(cu[-1]), len(lens)
    _, cu_chunks = common.chunk_table(cu, T, N)
    stab, cu_segs = common.segment_table(cu, cu_chunks, T, N, seg, split=True)
    slots = emulate.seg_state_slots(cu_segs, stab.shape[0])
    working = [s for s, row in enumerate(stab.tolist()) if row[2] >= 0 and row[5] == 0]
    assert slots[: len(working)] == working and set(slots[len(working) :]) <= {None}
    assert len(slots) == max(stab.shape[0] - N, 1)


@pytest.mark.parametrize("strong", [False, True], ids=["mild", "strong-decay"])
def test_prep_mirror_matches_exact_solve(strong):
    """prep (its mirror: the fused kernel's aux per chunk slot) on a varlen batch with partial
    chunks and an unused slot: A_β against the fp64 solve (I + L)⁻¹ diag β and P against scale·Γ⊙QKᵀ,
    both within what bf16 storage allows, zero past each sequence's end; gcs the chunk-local cumsum.
    ``strong``: gates whose chunks exceed the factored-gating bound take the per-element path."""
    emu = emulate
    common = importlib.import_module("qlabench_kernels._common")
    lens = [1, 63, 130, 700]
    x = emu.make_inputs(lens, 2, 4, seed=3)
    if strong:
        x["g"] = x["g"] * 100.0  # ~5 nats per token: full chunks exceed the bound (per element)
    T, N = x["q"].shape[1], len(lens)
    ctab, _ = common.chunk_table(x["cu"].long(), T, N)
    scale = 128**-0.5
    gcs, a_beta, p = emu.emu_prep(x["k"], x["g"], x["beta"], ctab, q=x["q"], scale=scale)
    checked = 0
    for c in range(ctab.shape[0]):
        bos, eos, seq = (int(t) for t in ctab[c, :3])
        if seq < 0:
            assert bool((a_beta[:, c * 64 : c * 64 + 64] == 0).all()) and bool((p[:, c * 64 : c * 64 + 64] == 0).all())
            continue
        ln = eos - bos
        for hv in range(4):
            hk = hv // 2
            kc = x["k"][0, bos:eos, hk].double()
            qc = x["q"][0, bos:eos, hk].double()
            gc = torch.cumsum(x["g"][0, bos:eos, hv].double(), 0)
            bc = x["beta"][0, bos:eos, hv].double()
            assert torch.allclose(gcs[hv, c * 64 : c * 64 + ln].double(), gc, rtol=1e-5, atol=1e-4)
            gam = torch.exp((gc[:, None] - gc[None, :]).clamp(max=0))
            L = torch.tril(bc[:, None] * gam * (kc @ kc.T), -1)
            eye = torch.eye(ln, dtype=torch.float64)
            ref_a = torch.linalg.solve_triangular(eye + L, eye, upper=False) * bc[None, :]
            ref_p = torch.tril(scale * gam * (qc @ kc.T))
            got_a = a_beta[hv, c * 64 : c * 64 + 64].double()
            got_p = p[hv, c * 64 : c * 64 + 64].double()
            assert emu.rel_l2(got_a[:ln, :ln], ref_a) < 6e-3, (c, hv)
            assert emu.rel_l2(got_p[:ln, :ln], ref_p) < 6e-3, (c, hv)
            for got in (got_a, got_p):
                assert bool((got[ln:] == 0).all()) and bool((got[:, ln:] == 0).all())
            checked += 1
    assert checked == 4 * sum((n + 63) // 64 for n in lens)


def test_fwd_o_ws_barrier_protocol():
    """The mbarrier protocol of fwd_o.py (modelled in tools/kernels/ws_protocol.py) never deadlocks,
    never passes a parity wait at the wrong phase and never lets a read see another chunk's data, over
    random skewed interleavings; dropping a needed wait is caught."""
    wsp = ws_protocol
    assert wsp.check(seeds=100)
    waits = [("state", "full"), ("state", "q_full"), ("prod", "empty"), ("prod", "q_empty"), ("tab", "empty"),
             ("st", "o_staged")]  # fmt: skip
    for role, bar in waits:
        with pytest.raises(AssertionError):
            wsp.check(seeds=100, mutate=wsp.drop_ops(role, lambda op, b=bar: op[0] == "wait" and op[1] == b))

    def arrive_before_o(progs):  # the store warp frees the stage before it has read o out of it
        ops = progs["st"]
        for i in [i for i, op in enumerate(ops) if op[:2] == ("arrive", "empty")]:
            ops[i - 1 : i + 1] = [ops[i], ops[i - 1]]

    with pytest.raises(AssertionError):
        wsp.check(seeds=100, mutate=arrive_before_o)


def test_bwd_dqkwy_barrier_protocol():
    """bwd_dqkwy's protocol (modelled in tools/kernels/dqkwy_protocol.py with the kernel's barriers
    and counts) never deadlocks, never passes a parity wait at the wrong phase and never lets a read
    see another tile's or item's buffer (dv staged in v's included), for GVA groups of 1..4 v-heads;
    dropping any role's waits on any one barrier is caught but one that an earlier wait implies."""
    dqkwy = importlib.import_module("qlabench_kernels.bwd_dqkwy")
    dp = dqkwy_protocol
    src = open(dqkwy.__file__).read()
    counts = {"full_a": 32, "empty_a": 256, "full_u": 32, "empty_u": 256, "full_q": 32, "empty_q": 256, "full_k": 32,
              "empty_k": 256, "full_v": 32, "empty_v": 288, "dv_ready": 256}  # fmt: skip
    assert all(f"{b} = T.alloc_barrier({n})" in src for b, n in counts.items())
    assert dp.check(groups=(1, 2, 3, 4), seeds=40)
    assert len(dp.waits()) == 11
    # the producer's wait on empty_q is implied by its wait on empty_u just before (the consumers arrive
    # on empty_u after phase A's last read of q): dropping it alone passes; every other drop fails
    implied = ("prod", "empty_q", 0)
    dp.check(groups=(1, 2, 3), items=(2, 3, 5), seeds=40, drop=implied)
    for drop in dp.waits():
        if drop != implied:
            with pytest.raises(AssertionError):
                dp.check(groups=(1, 2, 3), items=(2, 3, 5), seeds=40, drop=drop)


def test_fwd_fused_barrier_protocol():
    """The fused forward's protocol (modelled in tools/kernels/fused_protocol.py with the kernel's
    stage count and barrier counts) never deadlocks, never passes a parity wait at the wrong phase and
    never lets a read see another chunk's stage or ring slot, for 1..7 chunks; dropping any one wait of
    any role is caught (the state warpgroups' turns included), except the state warpgroups' waits on
    full and t_ready: aux arrives on t_ready only after its own wait on the same full phase, and a
    warpgroup's turns that read the stage and the ring follow a turn of the other warpgroup, which
    waited on both (kept in the kernel: passing try_waits)."""
    fused = importlib.import_module("qlabench_kernels.fwd_fused")
    fp = fused_protocol
    src = open(fused.__file__).read()
    assert fused.NST == fp.NST and all(f"{b} = T.alloc_barrier([{n}" in src for b, n in fp.COUNTS.items())
    assert fp.check(seeds=100)
    assert len(fp.waits()) == 12
    for role, bar in fp.waits():
        if role in ("wg0", "wg1") and bar in ("full", "t_ready"):
            assert fp.check(seeds=30, mutate=fp.drop_wait(role, bar))
        else:
            with pytest.raises(AssertionError):
                fp.check(seeds=100, mutate=fp.drop_wait(role, bar))
    # without the turns one warpgroup's o overwrites the Q the other still reads; both warpgroups'
    # full and t_ready waits dropped together; warp 14's arrive on empty before its read of o (the
    # next Q load lands on the staged o)
    def no_turns(progs):
        for wg in ("wg0", "wg1"):
            progs[wg] = [op for op in progs[wg] if op[1] != "turn"]

    def no_state_waits(progs):
        for wg in ("wg0", "wg1"):
            fp.drop_wait(wg, "t_ready")(progs)
            fp.drop_wait(wg, "full")(progs)

    for mutate in (no_turns, no_state_waits):
        with pytest.raises(AssertionError):
            fp.check(seeds=100, mutate=mutate)

    def empty_first(progs):
        ops = progs["w14"]
        for i in [i for i, op in enumerate(ops) if op[:2] == ("arrive", "empty")]:
            j = max(k for k in range(i) if ops[k][:2] == ("wait", "o_staged"))
            ops.insert(j + 1, ops.pop(i))

    with pytest.raises(AssertionError):
        fp.check(seeds=100, mutate=empty_first)


@pytest.mark.parametrize("split_tokens", [0, 512])
def test_fwd_o_algebra_matches_reference(split_tokens):
    """fwd_o's and seg_state's Vd = A_β bf16(V − e^g ⊙ K S) (V folded in before the cast) and
    O = scale e^g ⊙ Q S + P bf16(Vd): the emulated forward stays at the bf16 operands' error from the
    fp64 token recurrence, on mixed lengths with g = 0 heads, an initial state, split or unsplit, and
    a sign error in the V term is caught."""
    emu = emulate
    x = emu.make_inputs([1, 63, 64, 65, 300], 2, 4, seed=3)
    ref_o, ref_h = emu.reference(x["q"], x["k"], x["v"], x["g"], x["beta"], h0=x["h0"], cu=x["cu"])
    kw = dict(h0=x["h0"], cu=x["cu"], split_tokens=split_tokens)
    r = emu.emu_pipeline(x["q"], x["k"], x["v"], x["g"], x["beta"], **kw)
    errs = (emu.rel_l2(r["o"], ref_o), emu.rel_l2(r["final_state"], ref_h))
    assert max(errs) < 8e-3, errs
    bad = emu.emu_pipeline(x["q"], x["k"], -x["v"], x["g"], x["beta"], **kw)
    assert emu.rel_l2(bad["o"], ref_o) > 0.5


def test_seg_state_warm_up_starts_where_the_gates_decay(monkeypatch):
    """seg_state's warm-up (emulated): on segments of 16 chunks with mild decay (about -1.9 nats a
    chunk) every decaying v-head starts E past the segment's first chunk and stores M = 0, the g = 0
    head walks it all with its exact M; the segments' start states stay within rounding of the
    exact walk's (every warm-up start off) and the output at the bf16 operands' error from the fp64
    recurrence; a warm-up cut at e^-2 instead is caught."""
    from qlabench_kernels import seg_state

    emu = emulate
    x = emu.make_inputs([4096, 1000], 1, 4, seed=5)
    ref_o, ref_h = emu.reference(x["q"], x["k"], x["v"], x["g"], x["beta"], h0=x["h0"], cu=x["cu"])

    def run(thr):
        monkeypatch.setattr(seg_state, "WARMUP_LOG_DECAY", thr)
        return emu.emu_pipeline(x["q"], x["k"], x["v"], x["g"], x["beta"], h0=x["h0"], cu=x["cu"], split_tokens=1024)

    r, exact, cut = run(seg_state.WARMUP_LOG_DECAY), run(float("-inf")), run(-2.0)
    lens = torch.stack([emu.warmup_len(r["gcs"], int(row[3]), 16) for row in r["stab"][:3]])
    assert bool((lens[:, :3] < 16).all()) and bool((lens[:, 3] == 16).all()), lens
    assert float(r["m_tr"][:3, :3].abs().max()) == 0 and float(r["m_tr"][:3, 3].norm(dim=(-2, -1)).min()) > 0.1
    used = exact["h_start"].isfinite().flatten(1).all(1)
    assert emu.rel_l2(r["h_start"][used], exact["h_start"][used]) < 1e-3
    assert max(emu.rel_l2(r["o"], ref_o), emu.rel_l2(r["final_state"], ref_h)) < 8e-3
    assert emu.rel_l2(cut["h_start"][used], exact["h_start"][used]) > 1e-2


def test_seqlens_hint_is_checked():
    pkg = qlabench_kernels
    T, h = 192, 2
    q = torch.zeros(1, T, h, 128, dtype=torch.bfloat16)
    v = torch.zeros(1, T, h, 128, dtype=torch.bfloat16)
    g = torch.zeros(1, T, h)
    cu = torch.tensor([0, 64, 192])
    with pytest.raises(ValueError, match="seqlens"):
        pkg.chunk_gdn_fwd_lowlevel(q, q, v, g, g, cu_seqlens=cu, seqlens=[100, 100])




def test_forward_refuses_more_chunk_slots_than_preps_grid_holds():
    """prep's grid has the chunk slots on gridDim.y (at most 65535): a longer batch is an error that
    says so, before any allocation (meta tensors stand in for 4.2 M tokens)."""
    pkg = qlabench_kernels
    T = 65535 * 64
    q = torch.empty(1, T, 1, 128, dtype=torch.bfloat16, device="meta")
    g = torch.empty(1, T, 1, device="meta")
    with pytest.raises(ValueError, match="chunk slots, at most 65535 per call"):
        pkg.chunk_gdn_fwd_lowlevel(q, q, q, g, g)


@pytest.mark.parametrize("split", [0, 128])
@pytest.mark.parametrize("lens,h_qk,h_v,with_h0", [([300], 2, 4, True), ([64, 130, 7, 200], 1, 3, True), ([400, 90], 2, 2, False)])
def test_fused_algebra_matches_reference(lens, h_qk, h_v, with_h0, split):
    """The fused kernel's algebra (state as Sᵀ, A_β by the fp16 (I − N + N² − N³)D inverse, its bf16
    casts) against the fp64 token recurrence: o and the final state within bf16 error, unsplit and
    from the split path's segment start states (seg_state + fixup, emulated)."""
    from qlabench_kernels._common import chunk_table, segment_table

    emu = emulate
    inp = emu.make_inputs(lens, h_qk, h_v, seed=3, with_h0=with_h0)
    T, N = sum(lens), len(lens)
    cu = inp["cu"].long()
    ctab, cuc = chunk_table(cu, T, N)
    h_init = inp["h0"]
    if split:
        stab = emu.emu_pipeline(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], h0=inp["h0"], cu=cu, split_tokens=split)
        stab, h_init = stab["stab"], stab["h_start"]
    else:
        stab, _ = segment_table(cu, cuc, T, N, (T + 63) // 64 * 64, split=False)
    o, ht = emu.emu_fwd_fused(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], stab, h_init, 128**-0.5, N)
    ro, rh = emu.reference(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], 128**-0.5, inp["h0"], cu)
    assert not torch.isnan(o).any()
    assert emu.rel_l2(o, ro) < 6e-3 and emu.rel_l2(ht, rh) < 6e-3


def test_fused_inverse_beats_bf16_rounding_on_correlated_keys():
    """fp16 operands keep the tensor-core inverse's error below A_β's own bf16 rounding where
    keys are correlated (bf16 operands do not: ~4x that rounding)."""
    emu = emulate
    gen = torch.Generator().manual_seed(0)
    H, C = 8, 64
    base = torch.randn(1, 1, 128, generator=gen)
    kc = torch.nn.functional.normalize(torch.randn(H, C, 128, generator=gen) + 3 * base, dim=-1).to(torch.bfloat16).float()
    gch = torch.cumsum(torch.nn.functional.logsigmoid(torch.randn(H, C, generator=gen) + 3) * 0.1, dim=1)
    bch = torch.sigmoid(torch.randn(H, C, generator=gen) + 2)
    i = torch.arange(C)
    L = torch.where(i[:, None] > i[None], bch[..., :, None] * torch.exp(gch[..., :, None] - gch[..., None, :]) * (kc @ kc.transpose(-1, -2)), 0.0)
    eye = torch.eye(C, dtype=torch.float64)
    exact = torch.linalg.solve_triangular(eye + L.double(), eye.expand(H, C, C).contiguous(), upper=False) * bch.double()[..., None, :]
    got = emu.fused_a_beta(kc, gch, bch)
    own_rounding = emu.rel_l2(exact.to(torch.bfloat16), exact)
    assert emu.rel_l2(got, exact) < 1.5 * own_rounding


def _gates(kind, lens, h_v, seed=0):
    """Per-token log-gates [1, T, h_v] of one kind: "ordinary" (the canonical mild decay, a quarter
    of the heads g = 0), or every whole chunk of every head with g_0 − g_l exactly "under" (139) or
    "over" (141) the factored-gating bound (140), random positive weights spread over rows 1..63."""
    gen = torch.Generator().manual_seed(seed)
    T = sum(lens)
    if kind == "ordinary":
        g = torch.nn.functional.logsigmoid(torch.randn(1, T, h_v, generator=gen) + 3.0) * 0.5
        g[..., h_v - max(1, h_v // 4) :] = 0.0
        return g
    rng = {"under": 139.0, "over": 141.0}[kind]
    assert all(n % 64 == 0 for n in lens)
    w = torch.rand(T // 64, 64, h_v, generator=gen) + 0.5
    w[:, 0] = 0.25  # row 0's gate is outside the range g_0 − g_l
    return (-w / w[:, 1:].sum(1, keepdim=True) * rng).reshape(1, T, h_v)


def _exact_chunk(kc, qc, bch, gr, scale):
    """fp64 L = StrictLower(diag β Γ⊙KKᵀ), A_β = (I + L)⁻¹ diag β and P = scale Γ⊙QKᵀ (i ≥ j), from
    the fp64 cumsum of the gates gr [H, 64]."""
    i = torch.arange(64)
    g = torch.cumsum(gr.double(), dim=1)
    gam = torch.exp(torch.where(i[:, None] >= i[None], g[..., :, None] - g[..., None, :], torch.zeros((), dtype=torch.float64)))
    lo = torch.where(i[:, None] > i[None], bch.double()[..., :, None] * gam * (kc.double() @ kc.double().transpose(-1, -2)), 0.0)
    eye = torch.eye(64, dtype=torch.float64)
    ab = torch.linalg.solve_triangular(eye + lo, eye.expand_as(lo).contiguous(), upper=False) * bch.double()[..., None, :]
    p = torch.where(i[:, None] >= i[None], scale * gam * (qc.double() @ kc.double().transpose(-1, -2)), 0.0)
    return lo, ab, p


def _chunk_inputs(kind, H=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    kc = torch.nn.functional.normalize(torch.randn(H, 64, 128, generator=gen), dim=-1).to(torch.bfloat16).float()
    qc = torch.nn.functional.normalize(torch.randn(H, 64, 128, generator=gen), dim=-1).to(torch.bfloat16).float()
    bch = torch.sigmoid(torch.randn(H, 64, generator=gen))
    gr = _gates(kind, [64], H, seed)[0].T.contiguous()  # [H, 64]
    return kc, qc, bch, gr, torch.cumsum(gr, dim=1)


@pytest.mark.parametrize("kind", ["ordinary", "under", "over"])
def test_fused_factored_gating_matches_per_element(kind):
    """The fused kernel's factored gating (Γ_ij = e^{g_i − m} e^{m − g_j}, the producer's per-row and
    per-column tables, masked elements removed by a select): taken for ordinary gates and for a chunk
    whose range g_0 − g_l is just under the bound (factors near e^{±70}), not just over it (the
    per-element fallback). Where taken, L and P (fp32) are within fp32 error of the fp64 values,
    and A_β (fp16 inverse) and P (bf16), what the kernel stores, as close to them as the
    per-element path's."""
    emu = emulate
    fused = importlib.import_module("qlabench_kernels.fwd_fused")
    assert emu.FACTOR_RANGE == fused.FACTOR_RANGE
    scale = 128**-0.5
    kc, qc, bch, gr, gch = _chunk_inputs(kind)
    lo64, ab64, p64 = _exact_chunk(kc, qc, bch, gr, scale)
    kk, qk = kc @ kc.transpose(-1, -2), qc @ kc.transpose(-1, -2)
    err = {}
    for factored in (True, False):
        lg, pg, flag = emu.fused_gate(kk, qk, gr, gch, bch, scale, factored)
        assert torch.isfinite(lg).all() and torch.isfinite(pg).all()
        ab = emu.fused_a_beta_from_l(lg, bch)
        err[factored] = (emu.rel_l2(lg, lo64), emu.rel_l2(pg, p64), emu.rel_l2(ab, ab64), emu.rel_l2(emu._r(pg), p64))
        if factored:
            assert flag.all() if kind != "over" else not flag.any(), (kind, flag)
    f, e = err[True], err[False]
    # fp32 gating: the factors' exponents g_i − m, m − g_j round to ulp(|g − m|) (≤ ulp(70) near the
    # bound), far below L's fp16 rounding (2.4e-4 relative)
    assert f[0] < 1e-5 and f[1] < 1e-5 and e[0] < 1e-5 and e[1] < 1e-5, err
    assert f[2] < 3e-3 and f[2] < 1.01 * e[2] + 1e-5, err  # A_β: its bf16 rounding (~1.7e-3) dominates
    assert f[3] < 1.01 * e[3] + 1e-5, err


def test_fused_factored_gating_bound_and_fallback():
    """Where the flag is off the per-element path is what keeps the result finite: a 250-nat chunk
    gated by factors anyway (bound removed) gives inf / NaN (factors e^{±125} overflow fp32); a
    positive gate or a NaN gate clears the flag too (the cumsum then is not monotone)."""
    emu = emulate
    scale = 128**-0.5
    kc, qc, bch, gr, gch = _chunk_inputs("over")
    gr, gch = gr * (250 / 141), gch * (250 / 141)
    kk, qk = kc @ kc.transpose(-1, -2), qc @ kc.transpose(-1, -2)
    lg, pg, flag = emu.fused_gate(kk, qk, gr, gch, bch, scale)
    assert not flag.any() and torch.isfinite(lg).all() and torch.isfinite(pg).all()
    lg, pg, flag = emu.fused_gate(kk, qk, gr, gch, bch, scale, bound=float("inf"))
    assert flag.all()
    assert not (torch.isfinite(emu.fused_a_beta_from_l(lg, bch)).all() and torch.isfinite(pg).all())
    kc, qc, bch, gr, gch = _chunk_inputs("ordinary")
    gr[0, 5], gr[1, 7] = 0.01, float("nan")
    flag = emu.fused_gate_tables(gr, torch.cumsum(gr, 1), bch, scale)[0]
    assert not flag[0] and not flag[1] and flag[2:].all()


@pytest.mark.parametrize("kind", ["ordinary", "under", "over"])
def test_fused_factored_forward_matches_reference(kind):
    """The fused kernel's emulated forward with factored gating (where the flag allows it) against
    the fp64 token recurrence: o and the final state as close as with per-element gating
    everywhere, for ordinary gates, chunks just under the bound (factored) and just over it (the
    fallback: both runs then identical)."""
    from qlabench_kernels._common import chunk_table, segment_table

    emu = emulate
    lens = [1, 63, 64, 65, 300] if kind == "ordinary" else [256, 64, 128]
    inp = emu.make_inputs(lens, 2, 4, seed=5)
    inp["g"] = _gates(kind, lens, 4, seed=5)
    T, N = sum(lens), len(lens)
    cu = inp["cu"].long()
    ctab, cuc = chunk_table(cu, T, N)
    stab, _ = segment_table(cu, cuc, T, N, (T + 63) // 64 * 64, split=False)
    args = (inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], stab, inp["h0"], 128**-0.5, N)
    ro, rh = emu.reference(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], 128**-0.5, inp["h0"], cu)
    runs = {}
    for factored in (True, False):
        stats = {}
        o, ht = emu.emu_fwd_fused(*args, factored=factored, stats=stats)
        assert not torch.isnan(o).any() and not torch.isnan(ht).any()
        runs[factored] = (o, ht, stats, emu.rel_l2(o, ro), emu.rel_l2(ht, rh))
    stats = runs[True][2]
    pairs = sum((n + 63) // 64 for n in lens) * 4
    assert stats == ({"factored": 0, "per_element": pairs} if kind == "over" else {"factored": pairs, "per_element": 0})
    (_, _, _, fo, fh), (_, _, _, eo, eh) = runs[True], runs[False]
    assert fo < 6e-3 and fh < 6e-3, (fo, fh)
    assert fo < 1.02 * eo + 1e-5 and fh < 1.02 * eh + 1e-5, (fo, eo, fh, eh)
    if kind == "over":
        assert torch.equal(runs[True][0], runs[False][0])


def test_fused_factored_gating_flushes_only_what_fp16_drops():
    """A row factor β_i e^{g_i − m} below 2^-126 is flushed to 0 (fast math). Under the bound (140
    nats: factors within e^{±70}) that needs β_i < 2.9e-8, and every element of the row is then one
    that L's fp16 store rounds to 0 anyway: L in fp16 matches the per-element path's to its last
    bit on the chunk's last row (g_63 − m = −69.5) for β_63 from 1e-3 down to 1e-12 (one head
    each). With a 160-nat bound the same holds only for β above 6.6e-4: a last row of β = 1e-4
    loses its elements."""
    emu = emulate
    scale = 128**-0.5
    small = torch.tensor([1e-3, 1e-4, 1e-5, 1e-7, 3e-8, 1e-8, 1e-10, 1e-12])
    for rng, bound, ok in ((139.0, 140.0, True), (159.0, 160.0, False)):
        kc, qc, bch, gr, gch = _chunk_inputs("under")
        gr, gch = gr * (rng / 139), gch * (rng / 139)
        bch[:, 63] = small
        kk, qk = kc @ kc.transpose(-1, -2), qc @ kc.transpose(-1, -2)
        lf, _, flag = emu.fused_gate(kk, qk, gr, gch, bch, scale, bound=bound)
        le, _, _ = emu.fused_gate(kk, qk, gr, gch, bch, scale, factored=False)
        assert flag.all()
        l16f, l16e = emu._r16(lf)[:, 63], emu._r16(le)[:, 63]
        # one fp16 ulp of the per-element value (the factored fp32 value differs by ~1e-6 relative)
        ulp = torch.where(l16e.abs() < 2**-14, torch.full_like(l16e, 2**-24), l16e.abs() * 2**-10)
        close = bool(((l16f - l16e).abs() <= ulp).all())
        assert close == ok, (rng, bound, float((l16f - l16e).abs().max()))
