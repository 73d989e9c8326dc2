"""Pure-torch emulation of each TileLang kernel's tile-level algorithm (runs on CPU or GPU).

Each function mirrors one kernel: same tables, same chunk-slot layouts, same rounding points
(bf16 where the kernel stages an operand in shared memory for wgmma, fp32 accumulation).
A check feeds a kernel's real inputs to its emulation, so a mismatch points at one stage.
Also holds the token-by-token reference recurrence (fp64) used by the checks.

This is a developer tool, never imported by the kernels themselves.
"""

import torch

C, D = 64, 128
bf16 = torch.bfloat16


def _r(x):
    """Round to bf16 and back to fp32 (what staging an operand in shared memory does)."""
    return x.to(bf16).float()


def reference(q, k, v, g, beta, scale=None, h0=None, cu=None, dtype=torch.float64):
    """Token recurrence per sequence, fp64 by default.

    S_t = e^{g_t}(I − β_t k_t k_tᵀ)S_{t−1} + β_t k_t v_tᵀ,  o_t = S_tᵀ(scale q_t).

    Shapes as chunk_gdn_fwd. Returns o [1,T,Hv,128] (dtype) and ht [N,Hv,128,128] (dtype).
    """
    T, h_qk, h_v = q.shape[1], q.shape[2], v.shape[2]
    G = h_v // h_qk
    scale = D**-0.5 if scale is None else scale
    cu = [0, T] if cu is None else [int(x) for x in cu.tolist()]
    N = len(cu) - 1
    qh = q[0].to(dtype).repeat_interleave(G, dim=1)  # [T, Hv, K]
    kh = k[0].to(dtype).repeat_interleave(G, dim=1)
    vh = v[0].to(dtype)
    gg, bb = g[0].to(dtype), beta[0].to(dtype)
    o = torch.zeros(1, T, h_v, D, dtype=dtype, device=q.device)
    ht = torch.zeros(N, h_v, D, D, dtype=dtype, device=q.device)
    for n in range(N):
        S = torch.zeros(h_v, D, D, dtype=dtype, device=q.device) if h0 is None else h0[n].to(dtype).clone()
        for t in range(cu[n], cu[n + 1]):
            kt, vt, b = kh[t], vh[t], bb[t]  # [Hv,K], [Hv,V], [Hv]
            S = S * torch.exp(gg[t])[:, None, None]
            kS = torch.einsum("hk,hkv->hv", kt, S)
            S = S + torch.einsum("hk,hv->hkv", kt, b[:, None] * (vt - kS))
            o[0, t] = torch.einsum("hk,hkv->hv", qh[t] * scale, S)
        ht[n] = S
    return o, ht


def _gather_rows(x, rows, valid):
    """x [T, H, ...] → [R, 64, H, ...] rows (clamped) with invalid rows zeroed."""
    T = x.shape[0]
    out = x[rows.clamp(0, max(T - 1, 0))]
    shape = valid.shape + (1,) * (out.dim() - 2)
    return out * valid.reshape(shape).to(out.dtype)


def emu_prep(k, g, beta, ctab, q=None, scale=None):
    """Mirror of prep.py: the fused kernel's aux per chunk slot (the gate tables and factored
    gating of :func:`fused_gate`, the fp16 inverse of :func:`fused_a_beta_from_l`). Returns gcs
    [Hv, NCS*64] fp32 and a_beta [Hv, NCS*64, 64] bf16 and with ``q`` also P (same rows, bf16)."""
    h_qk, h_v = k.shape[2], g.shape[2]
    G = h_v // h_qk
    if scale is None:
        scale = k.shape[-1] ** -0.5
    ct = ctab.long()
    ncs = ct.shape[0]
    ar = torch.arange(C, device=k.device)
    bos, ln = ct[:, 0], ct[:, 1] - ct[:, 0]
    rows = bos[:, None] + ar[None]
    valid = ar[None] < ln[:, None]  # [NCS, 64]
    kc = _r(_gather_rows(k[0].float(), rows, valid))  # [NCS, 64, Hqk, K]
    gc = _gather_rows(g[0].float(), rows, valid)  # [NCS, 64, Hv]
    bc = _gather_rows(beta[0].float(), rows, valid)
    gcs = torch.cumsum(gc, dim=1)  # [NCS, 64, Hv]
    kk = torch.einsum("cihk,cjhk->chij", kc, kc).repeat_interleave(G, dim=1)  # [NCS, Hv, 64, 64]
    if q is not None:
        qc = _r(_gather_rows(q[0].float(), rows, valid))
        qk = torch.einsum("cihk,cjhk->chij", qc, kc).repeat_interleave(G, dim=1)
    else:
        qk = torch.zeros_like(kk)
    flat = lambda x: x.permute(0, 2, 1).reshape(ncs * h_v, C)  # noqa: E731  [NCS·Hv, 64]
    gr, gh, bh = flat(gc), flat(gcs), flat(bc)
    lg, pg, _ = fused_gate(kk.reshape(-1, C, C), qk.reshape(-1, C, C), gr, gh, bh, scale)
    a_beta = fused_a_beta_from_l(lg, bh).reshape(ncs, h_v, C, C)
    gcs_out = gcs.permute(2, 0, 1).reshape(h_v, ncs * C).contiguous()
    a_out = a_beta.permute(1, 0, 2, 3).reshape(h_v, ncs * C, C).to(bf16).contiguous()
    if q is None:
        return gcs_out, a_out
    p_out = pg.reshape(ncs, h_v, C, C).permute(1, 0, 2, 3).reshape(h_v, ncs * C, C).to(bf16).contiguous()
    return gcs_out, a_out, p_out


def _chunk_step(S, qc, kc, vc, gch, ab, ln, scale, want_o):
    """One chunk of fwd_o (``want_o``) / seg_state for all heads, with the kernels' algebra and bf16
    roundings. S [H,K,W] fp32; qc,kc [H,64,K]; vc [H,64,W]; gch [H,64]; ab [H,64,64] (bf16 values):
    U = K S from S in bf16; Vd = A_β bf16(V − e^g ⊙ U) (V in registers; seg_state's M half has V = 0);
    V' = bf16(mask · e^{g_l − g} ⊙ Vd), O = scale · e^g ⊙ (Q S) + P bf16(Vd).
    Returns (S_new, o [H,64,W] or None)."""
    s_sh = _r(S)
    eg = torch.exp(gch)[..., None]
    ab = ab.float()
    vd = ab @ _r(vc - eg * (kc @ s_sh))
    glast = gch[:, ln - 1]
    mask = (torch.arange(C, device=S.device) < ln)[None, :, None]
    vp = _r(torch.where(mask, torch.exp(glast[:, None, None] - gch[..., None]) * vd, torch.zeros((), device=S.device)))
    o = None
    if want_o:
        os_ = qc @ s_sh
        p = qc @ kc.transpose(-1, -2)
        causal = torch.tril(torch.ones(C, C, dtype=torch.bool, device=S.device))
        diff = torch.where(causal, gch[..., :, None] - gch[..., None, :], torch.zeros((), device=S.device))
        p_sh = _r(torch.where(causal, scale * torch.exp(diff) * p, torch.zeros((), device=S.device)))
        o = os_ * (scale * eg) + p_sh @ _r(vd)
    S = S * torch.exp(glast)[:, None, None] + kc.transpose(-1, -2) @ vp
    return S, o


def _load_chunk(q, k, v, gcs, a_beta, G, t0, ln, r0, vcols=None):
    """Rows t0..t0+63 (zero past T, like the kernel's guarded loads; rows past ln are kept)."""
    T = k.shape[1]
    rows = torch.arange(t0, t0 + C, device=k.device)
    inb = (rows < T)[:, None, None]
    rr = rows.clamp(max=T - 1)
    kc = (k[0, rr].float() * inb).repeat_interleave(G, dim=1).permute(1, 0, 2)  # [Hv,64,K]
    qc = None if q is None else (q[0, rr].float() * inb).repeat_interleave(G, dim=1).permute(1, 0, 2)
    vc = (v[0, rr].float() * inb).permute(1, 0, 2)  # [Hv,64,V]
    gch = gcs[:, r0 : r0 + C].float()
    ab = a_beta[:, r0 : r0 + C, :]
    return qc, kc, vc, gch, ab


def emu_fwd_o(q, k, v, gcs, a_beta, stab, h_init, scale, N, want_ht=True):
    """Mirror of fwd_o.py. Returns o [1,T,Hv,128] fp32 (unwritten
    rows NaN) and ht [N,Hv,128,128] fp32."""
    T, h_qk, h_v = q.shape[1], q.shape[2], v.shape[2]
    G = h_v // h_qk
    o = torch.full((1, T, h_v, D), float("nan"), device=q.device)
    ht = torch.full((N, h_v, D, D), float("nan"), device=q.device) if want_ht else None
    for row in stab.tolist():
        bos, eos, seq, cslot, irow, is_last = row[:6]
        if seq < 0:
            continue
        S = torch.zeros(h_v, D, D, device=q.device) if h_init is None else h_init[irow].float().clone()
        nch = (eos - bos + C - 1) // C
        for ci in range(nch):
            t0 = bos + ci * C
            ln = min(eos - t0, C)
            qc, kc, vc, gch, ab = _load_chunk(q, k, v, gcs, a_beta, G, t0, ln, (cslot + ci) * C)
            S, oc = _chunk_step(S, qc, kc, vc, gch, ab, ln, scale, True)
            o[0, t0 : t0 + ln] = oc[:, :ln].permute(1, 0, 2)
        if want_ht and is_last == 1:
            ht[seq] = S
    return o, ht


def _r16(x):
    """Round to fp16 and back (the fused kernel's inverse operands)."""
    return x.to(torch.float16).float()


#: the fused kernel's bound on a chunk's gate range for factored gating (fwd_fused.FACTOR_RANGE)
FACTOR_RANGE = 140.0


def _ftz(x):
    """Flush fp32 subnormals to zero (the kernel runs with fast math: ex2.approx.ftz, mul.ftz)."""
    return torch.where(x.abs() < 2.0**-126, torch.zeros((), device=x.device), x)


def fused_gate_tables(gr, gch, bch, scale, bound=FACTOR_RANGE):
    """The producer warp's factored-gating tables per chunk: gr [H,64] the gates (zero past the end),
    gch their cumsum, bch β. Returns (flag [H] bool, β e^{g − m}, scale e^{g − m}, e^{m − g}) with
    m = (g_0 + g_l) / 2; the flag is set where no gate is positive and g_0 − g_l < bound."""
    g0, gl = gch[:, :1], gch[:, -1:]
    flag = (gr <= 0).all(dim=1) & ((g0 - gl)[:, 0] < bound)
    m = (g0 + gl) * 0.5
    e = _ftz(torch.exp(gch - m))
    return flag, _ftz(bch * e), _ftz(scale * e), _ftz(torch.exp(m - gch))


def fused_gate(kk, qk, gr, gch, bch, scale, factored=True, bound=FACTOR_RANGE):
    """The aux warpgroup's gating of K Kᵀ and Q Kᵀ (fp32, before the fp16 / bf16 stores):
    L = StrictLower(diag β · Γ ⊙ K Kᵀ), P = scale · Γ ⊙ Q Kᵀ (i ≥ j). Per chunk (head) with the
    factored flag: Γ_ij = (row_i · e^{m − g_j}) by the producer's tables, the masked part removed by a
    select; otherwise (or ``factored=False``) per element e^{min(g_i − g_j, 0)}.
    Returns (L, P, flag [H])."""
    i = torch.arange(C, device=kk.device)
    z = torch.zeros((), device=kk.device)
    low, causal = i[:, None] > i[None], i[:, None] >= i[None]
    flag, rl, rp, cj = fused_gate_tables(gr, gch, bch, scale, bound)
    if not factored:
        flag = torch.zeros_like(flag)
    gam = torch.exp(torch.clamp(gch[..., :, None] - gch[..., None, :], max=0.0))
    le = torch.where(low, bch[..., :, None] * gam * kk, z)
    pe = torch.where(causal, scale * gam * qk, z)
    lf = torch.where(low, _ftz(rl[..., :, None] * cj[..., None, :]) * kk, z)
    pf = torch.where(causal, _ftz(rp[..., :, None] * cj[..., None, :]) * qk, z)
    f = flag[:, None, None]
    return torch.where(f, lf, le), torch.where(f, pf, pe), flag


def fused_a_beta_from_l(lg, bch):
    """The fused kernel's (and prep's) A_β on tensor cores from the gated L (fp32, [H,64,64]) and β
    (zero past the end): L in fp16; D = blockdiag((I+L_bb)⁻¹) by substitution from it; N = D L with
    its diagonal blocks dropped (N⁴ = 0); R₁ = I − N, Rₖ₊₁ = I − Rₖ N (Rₖ rounded to fp16, the A
    operand from registers); A_β = R₃ Dβ (Dβ = D diag β in fp16). The kernels store −D and −N and take
    Rₖ₊₁ as 1 on the diagonal, else Rₖ(−N): the same values (fp16 negation is exact, the diagonal of
    Rₖ N is exactly 0). Returns [H,64,64] bf16 values."""
    i = torch.arange(C, device=lg.device)
    z = torch.zeros((), device=lg.device)
    eye = torch.eye(C, device=lg.device)
    l16 = _r16(lg)
    blk = i[:, None] // 16 == i[None] // 16
    Dm = solve_blocked_diag(torch.where(blk, l16, z))
    d16, db16 = _r16(Dm), _r16(Dm * bch[..., None, :])
    n = torch.where(i[:, None] // 16 > i[None] // 16, d16 @ l16, z)
    n16 = _r16(n)
    r = _r16(eye - n)
    for _ in range(2):
        r = _r16(eye - r @ n16)
    return _r(torch.where(i[:, None] >= i[None], r @ db16, z))


def fused_a_beta(kc, gch, bch):
    """:func:`fused_a_beta_from_l` with L gated per element: kc [H,64,K] (rows past the end: any
    finite values), gch [H,64] cumsum, bch [H,64] β (zero past the end)."""
    kk = kc @ kc.transpose(-1, -2)
    i = torch.arange(C, device=kc.device)
    z = torch.zeros((), device=kc.device)
    gam = torch.exp(torch.where(i[:, None] > i[None], gch[..., :, None] - gch[..., None, :], z))
    return fused_a_beta_from_l(torch.where(i[:, None] > i[None], bch[..., :, None] * gam * kk, z), bch)


def emu_fwd_fused(q, k, v, g, beta, stab, h_init, scale, N, want_ht=True, factored=True, stats=None):
    """Mirror of fwd_fused.py: the state as Sᵀ, bf16 where the kernel casts an accumulator into a
    wgmma operand; L and P gated as :func:`fused_gate` (``factored=False``: per element everywhere).
    Returns o [1,T,Hv,128] fp32 (unwritten rows NaN) and ht [N,Hv,128,128] fp32 (K x V); ``stats``
    (a dict) counts the (chunk, head) pairs gated by factors and per element."""
    T, h_qk, h_v = q.shape[1], q.shape[2], v.shape[2]
    G = h_v // h_qk
    dev = q.device
    o = torch.full((1, T, h_v, D), float("nan"), device=dev)
    ht = torch.full((N, h_v, D, D), float("nan"), device=dev) if want_ht else None
    i = torch.arange(C, device=dev)
    for row in stab.tolist():
        bos, eos, seq, _, irow, is_last = row[:6]
        if seq < 0:
            continue
        St = torch.zeros(h_v, D, D, device=dev) if h_init is None else h_init[irow].float().transpose(-1, -2).clone()
        for ci in range((eos - bos + C - 1) // C):
            t0 = bos + ci * C
            ln = min(eos - t0, C)
            valid = i < ln
            rows = torch.arange(t0, t0 + C, device=dev)
            inb = (rows < T)[:, None, None]
            rr = rows.clamp(max=T - 1)
            qc = (q[0, rr].float() * inb).repeat_interleave(G, dim=1).permute(1, 0, 2)  # [Hv,64,K]
            kc = (k[0, rr].float() * inb).repeat_interleave(G, dim=1).permute(1, 0, 2)
            vc = (v[0, rr].float() * inb).permute(1, 0, 2)
            gr = torch.where(valid[:, None], g[0, rr].float(), torch.zeros((), device=dev)).T  # [Hv,64]
            br = torch.where(valid[:, None], beta[0, rr].float(), torch.zeros((), device=dev)).T
            gch = torch.cumsum(gr, dim=1)
            eg = torch.exp(gch)
            el = torch.where(valid, torch.exp(gch[:, ln - 1 : ln] - gch), torch.zeros((), device=dev))
            lg, pg, flag = fused_gate(kc @ kc.transpose(-1, -2), qc @ kc.transpose(-1, -2), gr, gch, br, scale, factored)
            if stats is not None:
                stats["factored"] = stats.get("factored", 0) + int(flag.sum())
                stats["per_element"] = stats.get("per_element", 0) + int((~flag).sum())
            ab = fused_a_beta_from_l(lg, br)
            pp = _r(pg)
            sb = _r(St)
            x = sb @ kc.transpose(-1, -2)  # [Hv, V, 64]
            oc = sb @ qc.transpose(-1, -2)
            # Vdᵀ = (Vᵀ − e^g⊙X) A_βᵀ (A from registers, bf16)
            vd = _r(vc.transpose(-1, -2) - eg[:, None, :] * x) @ ab.transpose(-1, -2)
            oc = oc * (scale * eg[:, None, :]) + _r(vd) @ pp.transpose(-1, -2)
            St = St * eg[:, ln - 1, None, None] + _r(el[:, None, :] * vd) @ kc
            o[0, t0 : t0 + ln] = oc[:, :, :ln].permute(2, 0, 1)
        if want_ht and is_last == 1:
            ht[seq] = St.transpose(-1, -2)
    return o, ht


def seg_state_slots(cu_segs, ns: int) -> list:
    """seg_state's grid rows in launch order: the segment slot each walks — non-last segment w of
    all found by the kernel's binary search over ``cu_segs`` —, None past the last of them."""
    cu = [int(x) for x in cu_segs]
    n = len(cu) - 1
    out = []
    for w in range(max(ns - n, 1)):
        if w >= cu[n] - n:
            out.append(None)
            continue
        lo, hi = 0, n
        for _ in range(31):
            if hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if cu[mid] - mid <= w else (lo, mid)
        out.append(w + lo)
    return out


def warmup_len(gcs, cslot: int, n: int, from_first: bool = False):
    """Mirror of seg_state's ``qlb_warmup_len`` for every v-head [Hv]: the fewest chunks at one end of
    a segment's ``n`` (from slot ``cslot``; its last, or its first with ``from_first``) whose total
    log-decay is below ``WARMUP_LOG_DECAY``, n where none are (the same count but for sums within
    rounding of it)."""
    from qlabench_kernels.seg_state import WARMUP_LOG_DECAY

    if n == 0:
        return torch.zeros(gcs.shape[0], dtype=torch.long)
    tot = gcs[:, cslot * C : (cslot + n) * C][:, C - 1 :: C].float().cpu()  # [Hv, n] chunk totals
    hit = (tot if from_first else tot.flip(1)).cumsum(1) < WARMUP_LOG_DECAY
    return torch.where(hit, torch.arange(1, n + 1), n).amin(1)


def emu_seg_state(k, v, gcs, a_beta, stab, cu_segs):
    """Mirror of seg_state.py, over its grid (:func:`seg_state_slots`), its warm-ups included
    (:func:`warmup_len`: E from 0 past one, M = 0). Returns e_end [NS,Hv,K,V] fp32
    and m_tr [NS,Hv,K,K] fp32 (bf16 values); rows of unused / last segments are NaN."""
    h_qk, h_v = k.shape[2], v.shape[2]
    G = h_v // h_qk
    ns = stab.shape[0]
    e_end = torch.full((ns, h_v, D, D), float("nan"), device=k.device)
    m_tr = torch.full((ns, h_v, D, D), float("nan"), device=k.device)
    eye = torch.eye(D, device=k.device)
    rows = stab.tolist()
    for s in seg_state_slots(cu_segs, ns):
        if s is None:
            continue
        bos, eos, seq, cslot, _, is_last = rows[s][:6]
        if seq < 0 or is_last == 1:
            continue
        S = torch.cat([torch.zeros(h_v, D, D, device=k.device), eye.expand(h_v, D, D)], dim=2)
        n = (eos - bos + C - 1) // C
        wst = (n - warmup_len(gcs, cslot, n)).to(k.device)  # E's first chunk
        for ci in range(n):
            S[..., :D][wst == ci] = 0.0
            t0 = bos + ci * C
            ln = min(eos - t0, C)
            _, kc, vc, gch, ab = _load_chunk(None, k, v, gcs, a_beta, G, t0, ln, (cslot + ci) * C)
            vc = torch.cat([vc, torch.zeros_like(vc)], dim=2)
            S, _ = _chunk_step(S, None, kc, vc, gch, ab, ln, 1.0, False)
        e_end[s] = S[..., :D]
        m_tr[s] = _r(S[..., D:]) * (wst == 0)[:, None, None]
    return e_end, m_tr


def emu_fixup(m_tr, e_end, cu_segs, h0):
    """Mirror of fixup.py. Returns h_start [NS,Hv,K,V] fp32 (unused rows NaN)."""
    ns, h_v = e_end.shape[0], e_end.shape[1]
    h_start = torch.full((ns, h_v, D, D), float("nan"), device=e_end.device)
    cs = [int(x) for x in cu_segs.tolist()]
    for n in range(len(cs) - 1):
        H = torch.zeros(h_v, D, D, device=e_end.device) if h0 is None else h0[n].float().clone()
        for s in range(cs[n], cs[n + 1]):
            h_start[s] = H
            if s < cs[n + 1] - 1:
                H = e_end[s] + m_tr[s].float() @ _r(H)
    return h_start


def emu_pipeline(q, k, v, g, beta, scale=None, h0=None, cu=None, split_tokens=0):
    """The whole forward, emulated, with the same tables as the kernels. Returns a dict like
    chunk_gdn_fwd_lowlevel's (o fp32, final_state fp32, and each stage's output)."""
    from qlabench_kernels._common import chunk_table, default_cu_seqlens, segment_table

    T = q.shape[1]
    scale = D**-0.5 if scale is None else scale
    cu = default_cu_seqlens(T, q.device) if cu is None else cu.to(device=q.device, dtype=torch.int64)
    N = cu.numel() - 1
    ctab, cu_chunks = chunk_table(cu, T, N)
    gcs, a_beta = emu_prep(k, g, beta, ctab)
    out = dict(ctab=ctab, gcs=gcs, a_beta=a_beta)
    if split_tokens:
        stab, cu_segs = segment_table(cu, cu_chunks, T, N, split_tokens, split=True)
        e_end, m_tr = emu_seg_state(k, v, gcs, a_beta, stab, cu_segs)
        h_start = emu_fixup(m_tr, e_end, cu_segs, h0)
        o, ht = emu_fwd_o(q, k, v, gcs, a_beta, stab, h_start, scale, N)
        out.update(stab=stab, cu_segs=cu_segs, e_end=e_end, m_tr=m_tr, h_start=h_start)
    else:
        stab, _ = segment_table(cu, cu_chunks, T, N, max(64, (T + 63) // 64 * 64), split=False)
        o, ht = emu_fwd_o(q, k, v, gcs, a_beta, stab, h0, scale, N)
        out.update(stab=stab)
    out.update(o=o, final_state=ht)
    return out


def make_inputs(seqlens, h_qk, h_v, zero_g_frac=0.25, seed=0, device="cpu", with_h0=True):
    """Canonical random inputs: l2-normalised q, k; g = logsigmoid-like decay (< 0) with the
    last ``zero_g_frac`` of v-heads exactly 0; beta = sigmoid; h0 small random."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    T = sum(seqlens)
    N = len(seqlens)

    def rn(*s):
        return torch.randn(*s, generator=gen)

    q = torch.nn.functional.normalize(rn(1, T, h_qk, D), dim=-1).to(bf16)
    k = torch.nn.functional.normalize(rn(1, T, h_qk, D), dim=-1).to(bf16)
    v = rn(1, T, h_v, D).to(bf16)
    g = torch.nn.functional.logsigmoid(rn(1, T, h_v) + 3.0) * 0.5  # mild decay, like trained models
    nz = int(round(h_v * zero_g_frac))
    if nz:
        g[..., h_v - nz :] = 0.0
    beta = torch.sigmoid(rn(1, T, h_v))
    h0 = (rn(N, h_v, D, D) * 0.1) if with_h0 else None
    cu = torch.tensor([0] + list(torch.cumsum(torch.tensor(seqlens), 0).tolist()), dtype=torch.int32)
    out = dict(q=q, k=k, v=v, g=g.float(), beta=beta.float(), h0=h0, cu=cu)
    return {kk: (vv.to(device) if vv is not None else None) for kk, vv in out.items()}


def rel_l2(a, b):
    """‖a − b‖ / ‖b‖ over finite-reference elements, in fp64."""
    a, b = a.double(), b.double()
    return float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b).clamp_min(1e-30))


# --------------------------------------------------------------------------------------
# Mirrors of the speed variants (algorithm-level; checked on CPU against the verified path)
# --------------------------------------------------------------------------------------


def emu_tables_tl(cu, T, N, seg_tokens, split, nt=512):
    """Mirror of tables.py (block scan + per-slot binary search, blocks of ``nt`` sequences).
    Returns (ctab, cu_chunks, stab, cu_segs) as int32 tensors, the first four of run_tables' outputs."""
    cu = [int(x) for x in cu.tolist()]
    ncs, ns = T // C + N, T // seg_tokens + N
    ctab = [[0, 0, -1, 0] for _ in range(ncs)]
    stab = [[0, 0, -1, 0, 0, 0, 0, 0] for _ in range(ns)]
    cu_chunks, cu_segs = [0] * (N + 1), [0] * (N + 1)
    carry_c = carry_s = 0
    for blk in range((N + nt - 1) // nt):
        idx = [blk * nt + t for t in range(nt)]
        bos = [cu[n] if n < N else 0 for n in idx]
        eos = [cu[n + 1] if n < N else 0 for n in idx]
        nc = [(e - b + C - 1) // C if n < N else 0 for n, b, e in zip(idx, bos, eos)]
        nsg = [max(1, (e - b + seg_tokens - 1) // seg_tokens) if n < N else 0 for n, b, e in zip(idx, bos, eos)]
        c_sc, s_sc = list(nc), list(nsg)
        d = 1
        while d < nt:  # Hillis–Steele, as in the kernel
            c_sc = [c_sc[t] + (c_sc[t - d] if t >= d else 0) for t in range(nt)]
            s_sc = [s_sc[t] + (s_sc[t - d] if t >= d else 0) for t in range(nt)]
            d *= 2
        c_st = [carry_c + c_sc[t] - nc[t] for t in range(nt)]
        s_st = [carry_s + s_sc[t] - nsg[t] for t in range(nt)]
        for t, n in enumerate(idx):
            if n < N:
                cu_chunks[n], cu_segs[n] = c_st[t], s_st[t]
        end_c, end_s = carry_c + c_sc[nt - 1], carry_s + s_sc[nt - 1]

        def search(st, sl):
            lo, step = 0, nt >> 1
            while step:
                if st[lo + step] <= sl:
                    lo += step
                step >>= 1
            return lo

        for sl in range(carry_c, end_c):
            lo = search(c_st, sl)
            b = bos[lo] + (sl - c_st[lo]) * C
            ctab[sl] = [b, min(b + C, eos[lo]), blk * nt + lo, 0]
        for sl in range(carry_s, end_s):
            lo = search(s_st, sl)
            loc = sl - s_st[lo]
            b = bos[lo] + loc * seg_tokens
            seq = blk * nt + lo
            stab[sl] = [b, min(b + seg_tokens, eos[lo]), seq, c_st[lo] + loc * (seg_tokens // C),
                        sl if split else seq, int(loc == nsg[lo] - 1), 0, 0]  # fmt: skip
        carry_c, carry_s = end_c, end_s
    cu_chunks[N], cu_segs[N] = carry_c, carry_s
    i32 = dict(dtype=torch.int32)
    return torch.tensor(ctab, **i32), torch.tensor(cu_chunks, **i32), torch.tensor(stab, **i32), torch.tensor(cu_segs, **i32)


def emu_lpt_tl(stab, nt=512):
    """Mirror of tables.py's longest-first order: a histogram of the keys, their starts in
    descending order, then per block of ``nt`` slots each slot's rank from its warp's match group
    and the earlier warps' counts of its key. Returns stab_lpt."""
    from qlabench_kernels._common import LPT_KEYS

    ns = stab.shape[0]
    keys = [min((int(e) - int(b) + C - 1) // C, LPT_KEYS - 1) for b, e in stab[:, :2].tolist()]
    hist, start = [keys.count(k) for k in range(LPT_KEYS)], [0] * LPT_KEYS
    for k in reversed(range(LPT_KEYS)):
        start[k] = sum(hist[k + 1 :])
    out = torch.empty_like(stab)
    for blk in range((ns + nt - 1) // nt):
        idx = [blk * nt + t for t in range(nt)]
        key = [keys[i] if i < ns else LPT_KEYS for i in idx]
        wcnt = [[0] * LPT_KEYS for _ in range(nt // 32)]
        lane_rank = []
        for t in range(nt):  # __match_any_sync: the lanes of t's warp with t's key
            w = t // 32
            group = [u for u in range(32 * w, 32 * w + 32) if key[u] == key[t]]
            lane_rank.append(group.index(t))
            if idx[t] < ns and group[0] == t:
                wcnt[w][key[t]] = len(group)
        for k in range(LPT_KEYS):  # the warps' starts of each key, in warp order
            for w in range(nt // 32):
                wcnt[w][k], start[k] = start[k], start[k] + wcnt[w][k]
        for t, i in enumerate(idx):
            if i < ns:
                out[wcnt[t // 32][key[t]] + lane_rank[t]] = stab[i]
    return out


def solve_blocked_diag(L):
    """The 16x16 diagonal blocks (I + L_bb)⁻¹ (zero elsewhere), by substitution as the aux's 64 threads."""
    B = 16
    A = torch.zeros_like(L)
    eye = torch.eye(B, dtype=L.dtype, device=L.device)
    for b in range(4):
        Lb = L[..., b * B : (b + 1) * B, b * B : (b + 1) * B]
        x = torch.zeros_like(Lb)
        for i in range(B):
            x[..., i, :] = eye[i] - (Lb[..., i, :i, None] * x[..., :i, :]).sum(-2)
        A[..., b * B : (b + 1) * B, b * B : (b + 1) * B] = x
    return A
