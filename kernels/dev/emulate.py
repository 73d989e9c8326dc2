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


def emu_prep(k, g, beta, ctab):
    """Mirror of prep.py. Returns gcs [Hv, NCS*64] fp32 and a_beta [Hv, NCS*64, 64] bf16."""
    h_qk, h_v = k.shape[2], g.shape[2]
    G = h_v // h_qk
    ct = ctab.long()
    ncs = ct.shape[0]
    ar = torch.arange(C, device=k.device)
    bos, ln = ct[:, 0], ct[:, 1] - ct[:, 0]
    rows = bos[:, None] + ar[None]
    valid = ar[None] < ln[:, None]  # [NCS, 64]
    kc = _gather_rows(k[0].float(), rows, valid)  # [NCS, 64, Hqk, K]
    gc = _gather_rows(g[0].float(), rows, valid)  # [NCS, 64, Hv]
    bc = _gather_rows(beta[0].float(), rows, valid)
    gcs = torch.cumsum(gc, dim=1)  # [NCS, 64, Hv]
    kk = torch.einsum("cihk,cjhk->chij", kc, kc).repeat_interleave(G, dim=1)  # [NCS, Hv, 64, 64]
    gh = gcs.permute(0, 2, 1)  # [NCS, Hv, 64]
    bh = bc.permute(0, 2, 1)
    tril = torch.tril(torch.ones(C, C, dtype=torch.bool, device=k.device), -1)
    gam = torch.exp(torch.where(tril, gh[..., :, None] - gh[..., None, :], torch.zeros((), device=k.device)))
    L = torch.where(tril, bh[..., :, None] * gam * kk, torch.zeros((), device=k.device))
    eye = torch.eye(C, dtype=torch.float64, device=k.device)
    A = torch.linalg.solve_triangular(eye + L.double(), eye.expand_as(L).contiguous(), upper=False).float()
    a_beta = (A * bh[..., None, :]).to(bf16)  # [NCS, Hv, 64, 64]
    gcs_out = gh.permute(1, 0, 2).reshape(h_v, ncs * C).contiguous()
    a_out = a_beta.permute(1, 0, 2, 3).reshape(h_v, ncs * C, C).contiguous()
    return gcs_out, a_out


def _chunk_step(S, qc, kc, vc, gch, ab, ln, scale, want_o):
    """One chunk of fwd_o / seg_state for all heads. S [H,K,W] fp32; qc,kc [H,64,K]; vc [H,64,W];
    gch [H,64]; ab [H,64,64] (bf16 values). Returns (S_new, o [H,64,W] or None)."""
    s_sh = _r(S)
    u = kc @ s_sh
    eg = torch.exp(gch)[..., None]
    w = _r(vc - eg * u)
    vd = ab.float() @ w
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
    """Mirror of fwd_o.py. Returns o [1,T,Hv,128] fp32 (unwritten rows NaN) and ht [N,Hv,128,128] fp32."""
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


def emu_seg_state(k, v, gcs, a_beta, stab):
    """Mirror of seg_state.py. Returns e_end [NS,Hv,K,V] fp32 and m_tr [NS,Hv,K,K] fp32 (bf16 values);
    rows of unused / last segments are NaN."""
    h_qk, h_v = k.shape[2], v.shape[2]
    G = h_v // h_qk
    ns = stab.shape[0]
    e_end = torch.full((ns, h_v, D, D), float("nan"), device=k.device)
    m_tr = torch.full((ns, h_v, D, D), float("nan"), device=k.device)
    eye = torch.eye(D, device=k.device)
    for s, row in enumerate(stab.tolist()):
        bos, eos, seq, cslot, _, is_last = row[:6]
        if seq < 0 or is_last == 1:
            continue
        S = torch.cat([torch.zeros(h_v, D, D, device=k.device), eye.expand(h_v, D, D)], dim=2)
        for ci in range((eos - bos + C - 1) // C):
            t0 = bos + ci * C
            ln = min(eos - t0, C)
            _, kc, vc, gch, ab = _load_chunk(None, k, v, gcs, a_beta, G, t0, ln, (cslot + ci) * C)
            vc = torch.cat([vc, torch.zeros_like(vc)], dim=2)
            S, _ = _chunk_step(S, None, kc, vc, gch, ab, ln, 1.0, False)
        e_end[s] = S[..., :D]
        m_tr[s] = _r(S[..., D:])
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
    from .._common import chunk_table, default_cu_seqlens, segment_table

    T = q.shape[1]
    scale = D**-0.5 if scale is None else scale
    cu = default_cu_seqlens(T, q.device) if cu is None else cu.to(device=q.device, dtype=torch.int64)
    N = cu.numel() - 1
    ctab, cu_chunks = chunk_table(cu, T, N)
    gcs, a_beta = emu_prep(k, g, beta, ctab)
    out = dict(ctab=ctab, gcs=gcs, a_beta=a_beta)
    if split_tokens:
        stab, cu_segs = segment_table(cu, cu_chunks, T, N, split_tokens, split=True)
        e_end, m_tr = emu_seg_state(k, v, gcs, a_beta, stab)
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
