"""Pure-torch emulation of each TileLang backward kernel's tile-level algorithm (CPU or GPU).

Mirrors kernels/bwd_h.py, bwd_dhu.py, bwd_dqkwy.py: same tables, chunk-slot
layouts, masks and rounding points (bf16 where a kernel stages an operand in shared memory
for wgmma or stores a bf16 intermediate; fp32 accumulation). A check feeds a kernel's real
inputs to its emulation so that a mismatch points at one stage.

Math (per chunk of one v-head; g = chunk-local cumsum, g_l its last valid value,
A_β = A·diag(β) with FLA's gated A, h = state at the chunk start, dH = d(state at its end)):

  forward:  v_new = A_β (V − e^g⊙K h);  o = scale e^g⊙(Q h) + P v_new,  P = scale·Γ⊙QKᵀ (i ≥ j)
            h' = e^{g_l} h + Kᵀ (e^{g_l−g}⊙v_new)
  bwd_h:    recompute h (bf16, per chunk slot) and v_new (bf16)
  bwd_dhu:  reverse: store dH; dv_new = Pᵀ dO + e^{g_l−g}⊙(K dH)
            dH ← e^{g_l} dH + Qᵀ(scale e^g⊙dO) − Kᵀ(e^g⊙(A_βᵀ dv_new));  dh0 = dH at the start
  bwd_dqkwy, phase A: dw = −dv_new hᵀ; dq = scale e^g⊙(dO hᵀ) + dS K; dk = dSᵀ Q + e^{g_l−g}⊙(v_new dHᵀ)
            with dS = scale Γ⊙(dO v_newᵀ) (i ≥ j); dg (on the cumsum) from e^g, Γ and e^{g_l}
  phase B:  dA_β = dw (e^g⊙K)ᵀ + dv_new Vᵀ; dv = A_βᵀ dv_new; dk += e^g⊙(A_βᵀ dw);
            A = I − A_β M (M = StrictLower(Γ⊙KKᵀ), since A(I + diag(β)M) = I);
            X = Aᵀ dA_β: dβ_j += X_jj; dL = −X A_βᵀ (i > j): dβ_i += Σ_j dL_ij M_ij,
            dM = β_i dL: dk += (dM⊙Γ)K + (dM⊙Γ)ᵀK, dg += rowsum − colsum of dM⊙M;
            then dg_raw = reverse cumsum of dg inside the chunk.

Never imported by the kernels; imports nothing from ``qlabench``.
"""

import torch
from qlabench_tools.kernels.emulate import _r, warmup_len

C, D = 64, 128
bf16 = torch.bfloat16


def _chunk_rows(ctab, device):
    ct = ctab.long().to(device)
    ar = torch.arange(C, device=device)
    bos, ln = ct[:, 0], ct[:, 1] - ct[:, 0]
    rows = bos[:, None] + ar[None]
    valid = (ar[None] < ln[:, None]) & (ct[:, 2:3] >= 0)
    return rows, valid, ln.clamp(min=1)


def _gather(x, rows, valid):
    """x [T, H, ...] → [NCS, H, 64, ...] (rows clamped, invalid rows 0)."""
    T = x.shape[0]
    out = x[rows.clamp(0, max(T - 1, 0))].float()
    out = out * valid.reshape(valid.shape + (1,) * (out.dim() - 2)).float()
    return out.transpose(1, 2)  # [NCS, H, 64, ...]


def _slots(t, ncs):
    """[Hv, NCS*64, ...] → [NCS, Hv, 64, ...]."""
    h = t.shape[0]
    return t.reshape(h, ncs, C, *t.shape[2:]).transpose(0, 1).float()


def _unslots(t):
    """[NCS, Hv, 64, ...] → [Hv, NCS*64, ...]."""
    ncs, h = t.shape[0], t.shape[1]
    return t.transpose(0, 1).reshape(h, ncs * C, *t.shape[3:]).contiguous()


def _seq_chunk(x, t0, T, G=1):
    """Rows t0..t0+63 of x [1,T,H,d] → [Hv, 64, d] fp32 (zero past T; expanded over groups)."""
    rows = torch.arange(t0, t0 + C, device=x.device)
    inb = (rows < T)[:, None, None]
    out = x[0, rows.clamp(max=T - 1)].float() * inb
    if G > 1:
        out = out.repeat_interleave(G, dim=1)
    return out.permute(1, 0, 2)


def emu_bwd_h(k, v, gcs, a_beta, stab, h_init, ncs):
    """Mirror of bwd_h.py. Returns h_all [Hv, NCS, K, V] (bf16 values, fp32) and
    vnew [Hv, NCS*64, V] (bf16 values, fp32). Unwritten slots are NaN."""
    T, h_qk, h_v = k.shape[1], k.shape[2], v.shape[2]
    G = h_v // h_qk
    dev = k.device
    h_all = torch.full((h_v, ncs, D, D), float("nan"), device=dev)
    vnew = torch.full((h_v, ncs * C, D), float("nan"), device=dev)
    ar = torch.arange(C, device=dev)
    for row in stab.tolist():
        bos, eos, seq, cslot, irow = row[:5]
        if seq < 0:
            continue
        S = torch.zeros(h_v, D, D, device=dev) if h_init is None else h_init[irow].float().clone()
        for ci in range((eos - bos + C - 1) // C):
            t0 = bos + ci * C
            ln = min(eos - t0, C)
            r0 = (cslot + ci) * C
            m = (ar < ln)[None, :, None].float()
            kc = _seq_chunk(k, t0, T, G) * m
            vc = _seq_chunk(v, t0, T) * m
            gch = gcs[:, r0 : r0 + C].float()
            ab = a_beta[:, r0 : r0 + C].float()
            s_sh = _r(S)
            h_all[:, cslot + ci] = s_sh
            vd = ab @ _r(vc - torch.exp(gch)[..., None] * (kc @ s_sh))
            vnew[:, r0 : r0 + C] = _r(vd)
            gl = gch[:, ln - 1]
            vp = _r(m * torch.exp(gl[:, None, None] - gch[..., None]) * vd)
            S = S * torch.exp(gl)[:, None, None] + kc.transpose(-1, -2) @ vp
    return h_all, vnew


def emu_bwd_dhu(q, k, gcs, a_beta, do, dht, stab, scale, ncs, N, split="", uw=False):
    """Mirror of bwd_dhu.py. Returns dh_all [Hv, NCS, K, V] (bf16 values; d(state at chunk end)),
    dvnew [Hv, NCS*64, V] (bf16 values) and dh0 [N, Hv, K, V] fp32.

    split="seg": segments that are not the first of their sequence, from dht[seq] (last segment)
    or 0, each v-head from 0 past its warm-up (:func:`emulate.warmup_len`, its first chunks);
    returns F [NS, Hv, K, V] as the third value (NaN rows elsewhere), dh_all / dvnew NaN.
    split="carry": every segment from dht[s] (row = segment); dh0 from first segments only.

    uw=True: the algebra of bwd_dhu.py (the dH-independent parts first, Pᵀ and W' included):
    Y = A_βᵀ dv_new = Y₀ + W' dH with Y₀ = A_βᵀ bf16(Pᵀ dO) and W' = bf16(A_βᵀ bf16(e^{g_l − g} ⊙ K)),
    both computable before dH arrives, so the chain per chunk is W' dH and Kᵀ(e^g ⊙ Y); dv_new (an
    output only) is formed as before."""
    T, h_qk, h_v = q.shape[1], q.shape[2], do.shape[2]
    G = h_v // h_qk
    dev = q.device
    dh_all = torch.full((h_v, ncs, D, D), float("nan"), device=dev)
    dvnew = torch.full((h_v, ncs * C, D), float("nan"), device=dev)
    ns = stab.shape[0]
    dh0 = torch.full((ns if split == "seg" else N, h_v, D, D), float("nan"), device=dev)
    ar = torch.arange(C, device=dev)
    upper = ar[:, None] <= ar[None, :]  # [j, i]: i >= j
    rows = stab.tolist()
    for s, row in enumerate(rows):
        bos, eos, seq, cslot, _, is_last = row[:6]
        if seq < 0:
            continue
        is_first = s == 0 or rows[s - 1][2] != seq
        if split == "seg" and is_first:
            continue
        if split == "carry":
            dH = dht[s].float().clone()
        elif dht is None or (split == "seg" and not is_last):
            dH = torch.zeros(h_v, D, D, device=dev)
        else:
            dH = dht[seq].float().clone()
        nch = (eos - bos + C - 1) // C
        # pass 1 walks a segment's first chunks alone where they decay what lies after them (its warm-up)
        wl = warmup_len(gcs, cslot, nch, from_first=True).to(dev) if split == "seg" else None
        for ci in reversed(range(nch)):
            if wl is not None:
                dH[(wl < nch) & (wl == ci + 1)] = 0.0
            t0 = bos + ci * C
            ln = min(eos - t0, C)
            r0 = (cslot + ci) * C
            m = (ar < ln)[None, :, None].float()
            qc = _seq_chunk(q, t0, T, G) * m
            kc = _seq_chunk(k, t0, T, G) * m
            dc = _seq_chunk(do, t0, T) * m
            gch = gcs[:, r0 : r0 + C].float()
            ab = a_beta[:, r0 : r0 + C].float()
            gl = gch[:, ln - 1]
            dh_sh = _r(dH)
            if split != "seg":
                dh_all[:, cslot + ci] = dh_sh
            kq = kc @ qc.transpose(-1, -2)  # [j, i]
            pt = _r(torch.where(upper, scale * torch.exp(gch[:, None, :] - gch[:, :, None]) * kq, 0.0))
            dv = pt @ dc + m * torch.exp(gl[:, None, None] - gch[..., None]) * (kc @ dh_sh)
            dvs = _r(dv)
            if split != "seg":
                dvnew[:, r0 : r0 + C] = dvs
            if uw:
                el = m * torch.exp(gl[:, None, None] - gch[..., None])
                w_p = _r(ab.transpose(-1, -2) @ _r(el * kc))
                y = ab.transpose(-1, -2) @ _r(pt @ dc) + w_p @ dh_sh
            else:
                y = ab.transpose(-1, -2) @ dvs
            eg = torch.exp(gch)[..., None]
            qdo = _r(scale * eg * dc)
            ky = _r(-eg * y)
            dH = dH * torch.exp(gl)[:, None, None] + qc.transpose(-1, -2) @ qdo + kc.transpose(-1, -2) @ ky
        if split == "seg":
            dh0[s] = dH
        elif is_first:
            dh0[seq] = dH
    return dh_all, dvnew, dh0


def emu_rfixup(m_tr, f_start, cu_segs, dht):
    """Mirror of fixup.fixup_program(reverse=True). Returns d_end [NS, Hv, K, V] fp32 (unused rows NaN)."""
    ns, h_v = f_start.shape[0], f_start.shape[1]
    d_end = torch.full((ns, h_v, D, D), float("nan"), device=f_start.device)
    cs = [int(x) for x in cu_segs.tolist()]
    for n in range(len(cs) - 1):
        s0, s1 = cs[n], cs[n + 1]
        G = torch.zeros(h_v, D, D, device=f_start.device) if dht is None else dht[n].float().clone()
        d_end[s1 - 1] = G
        for s in range(s1 - 1, s0, -1):  # G = the gradient at segment s's start
            G = f_start[s].float().clone() if s == s1 - 1 else f_start[s] + m_tr[s].float().transpose(-1, -2) @ _r(G)
            d_end[s - 1] = G
    return d_end


def emu_dqkwy_state(q, k, do, gcs, h_all, dh_all, vnew, dvnew, ctab, scale):
    """Mirror of bwd_dqkwy.py's phase A, the state terms (all chunk slots at once). Returns dq_v
    [1,T,Hv,K] fp32, dk_v [1,T,Hv,K] fp32 (partial), dw [Hv, NCS*64, K] (bf16 values) and dg's
    state part [Hv, NCS*64] fp32, per v-head."""
    T, h_qk, h_v = q.shape[1], q.shape[2], do.shape[2]
    G = h_v // h_qk
    dev = q.device
    ncs = ctab.shape[0]
    rows, valid, ln = _chunk_rows(ctab, dev)
    m = valid[:, None, :, None].float()  # [NCS,1,64,1]
    qc = _gather(q[0].repeat_interleave(G, dim=1), rows, valid)  # [NCS,Hv,64,K]
    kc = _gather(k[0].repeat_interleave(G, dim=1), rows, valid)
    dc = _gather(do[0], rows, valid)
    g = _slots(gcs, ncs)  # [NCS,Hv,64]
    h = h_all.transpose(0, 1).float()  # [NCS,Hv,K,V]
    dh = dh_all.transpose(0, 1).float()
    vn = _slots(vnew, ncs)
    dvn = _slots(dvnew, ncs)
    # unused chunk slots (nothing writes them, and the kernel's items there exit) count as 0; NaN a
    # used slot holds (an element no earlier stage wrote) reaches the outputs
    used = (ctab[:, 2] >= 0).to(dev)[:, None, None, None]
    h, dh, vn, dvn = (torch.where(used, t, 0.0) for t in (h, dh, vn, dvn))
    gl = torch.gather(g, 2, (ln - 1)[:, None, None].expand(-1, h_v, 1))  # [NCS,Hv,1]
    ar = torch.arange(C, device=dev)
    lower = ar[:, None] >= ar[None, :]
    dg = torch.zeros(ncs, h_v, C, device=dev)

    dw = _r(-(dvn @ h.transpose(-1, -2)))
    eg = torch.exp(g)[..., None]
    dq = scale * eg * (dc @ h.transpose(-1, -2))
    dg += (dq * qc).sum(-1)
    dphat = dc @ vn.transpose(-1, -2)
    gam = torch.where(lower, torch.exp(g[..., :, None] - g[..., None, :]), 0.0)
    ds = _r(dphat * scale * gam)
    z = dphat * scale * gam * (qc @ kc.transpose(-1, -2))
    dg += z.sum(-1) - z.sum(-2)
    dq = dq + ds @ kc
    dk = ds.transpose(-1, -2) @ qc
    kst = m * torch.exp(gl[..., None] - g[..., None]) * (vn @ dh.transpose(-1, -2))
    dk = dk + kst
    t = (kst * kc).sum(-1)  # [NCS,Hv,64]
    dg -= t
    last = ar[None, None, :] == (ln - 1)[:, None, None]
    hd = (h * dh).sum((-1, -2))  # [NCS,Hv]
    dg += last * (t.sum(-1, keepdim=True) + torch.exp(gl) * hd[..., None])
    dg = dg * valid[:, None, :]

    dq_v = torch.zeros(1, T, h_v, D, device=dev)
    dk_v = torch.zeros(1, T, h_v, D, device=dev)
    vr = rows[valid]
    dq_v[0, vr] = dq.transpose(1, 2)[valid]
    dk_v[0, vr] = dk.transpose(1, 2)[valid]
    return dq_v, dk_v, _unslots(dw), _unslots(dg)


def emu_dqkwy_wy(k, v, beta, gcs, a_beta, dw, dvnew, dk_part, dg_part, ctab):
    """Mirror of bwd_dqkwy.py's phase B, through w, u and A, fed phase A's per-v-head dk_part and
    dg_part. Returns dk_v [1,T,Hv,K] fp32 (complete), dv [1,T,Hv,V] fp32 (bf16 values), dg
    [1,T,Hv] fp32 (raw g) and dbeta [1,T,Hv] fp32."""
    T, h_qk, h_v = k.shape[1], k.shape[2], v.shape[2]
    G = h_v // h_qk
    dev = k.device
    ncs = ctab.shape[0]
    rows, valid, ln = _chunk_rows(ctab, dev)
    kc = _gather(k[0].repeat_interleave(G, dim=1), rows, valid)
    vc = _gather(v[0], rows, valid)
    bc = _gather(beta[0], rows, valid)  # [NCS,Hv,64]
    g = _slots(gcs, ncs)
    ab = _slots(a_beta, ncs)
    used = (ctab[:, 2] >= 0).to(dev)[:, None, None, None]  # unused slots: 0, used ones as stored
    dws = torch.where(used, _slots(dw, ncs), 0.0)
    du = torch.where(used, _slots(dvnew, ncs), 0.0)
    ar = torch.arange(C, device=dev)
    lower = ar[:, None] >= ar[None, :]
    strict = ar[:, None] > ar[None, :]
    eye = torch.eye(C, device=dev)
    eg = torch.exp(g)[..., None]

    xw = _r(eg * kc)
    dab = torch.where(lower, dws @ xw.transpose(-1, -2) + du @ vc.transpose(-1, -2), 0.0)
    dxw = ab.transpose(-1, -2) @ dws
    dk = eg * dxw
    dg = (dk * kc).sum(-1)
    dv = ab.transpose(-1, -2) @ du
    kk = kc @ kc.transpose(-1, -2)
    gam = torch.where(strict, torch.exp(g[..., :, None] - g[..., None, :]), 0.0)
    mm = gam * kk
    a_full = _r(torch.where(lower, eye - ab @ _r(mm), 0.0))
    x = a_full.transpose(-1, -2) @ _r(dab)
    db = torch.diagonal(x, dim1=-2, dim2=-1).clone()
    dl = torch.where(strict, -(_r(x) @ ab.transpose(-1, -2)), 0.0)
    db += (dl * mm).sum(-1)
    dm = bc[..., None] * dl
    z = dm * mm
    dg += z.sum(-1) - z.sum(-2)
    dkk = _r(dm * gam)
    dk = dk + dkk @ kc + dkk.transpose(-1, -2) @ kc

    dgt = torch.where(valid[:, None, :], dg + _slots(dg_part, ncs), 0.0)  # rows past ln: not stored
    dgr = torch.flip(torch.cumsum(torch.flip(dgt, [-1]), -1), [-1])

    vr = rows[valid]
    dk_add = torch.zeros(1, T, h_v, D, device=dev)
    dk_add[0, vr] = dk.transpose(1, 2)[valid]
    dk_v = dk_part.float() + dk_add
    dv_out = torch.zeros(1, T, h_v, D, device=dev)
    dv_out[0, vr] = _r(dv).transpose(1, 2)[valid]
    dg_out = torch.zeros(1, T, h_v, device=dev)
    db_out = torch.zeros(1, T, h_v, device=dev)
    dg_out[0, vr] = dgr.transpose(1, 2)[valid]
    db_out[0, vr] = db.transpose(1, 2)[valid]
    return dk_v, dv_out, dg_out, db_out


def emu_bwd_dqkwy(q, k, v, beta, do, gcs, a_beta, h_all, dh_all, vnew, dvnew, ctab, scale):
    """Mirror of bwd_dqkwy.py: phase A then phase B per v-head, dq and dk summed over each GVA group
    in fp32. Returns dq, dk [1,T,Hqk,K] fp32, dv [1,T,Hv,V] fp32 (bf16 values), dg and dbeta [1,T,Hv]."""
    dq_v, dk_p, dw, dg_p = emu_dqkwy_state(q, k, do, gcs, h_all, dh_all, vnew, dvnew, ctab, scale)
    dk_v, dv, dg, db = emu_dqkwy_wy(k, v, beta, gcs, a_beta, dw, dvnew, dk_p, dg_p, ctab)
    return group_sum(dq_v, q.shape[2]), group_sum(dk_v, q.shape[2]), dv, dg, db


def group_sum(x_v, h_qk):
    """[1,T,Hv,d] per-v-head gradient → [1,T,Hqk,d] summed over each GVA group."""
    _, T, h_v, d = x_v.shape
    return x_v.reshape(1, T, h_qk, h_v // h_qk, d).sum(3)


def emu_bwd_pipeline(q, k, v, g, beta, do, dht=None, scale=None, h0=None, cu=None, uw=False):
    """The whole backward, emulated (the forward's prep emulated too). Returns a dict with
    dq, dk [1,T,Hqk,K], dv [1,T,Hv,V], dg, dbeta [1,T,Hv], dh0 (or None) and the chains' outputs."""
    from qlabench_kernels._common import chunk_table, default_cu_seqlens, segment_table
    from qlabench_tools.kernels.emulate import emu_prep

    T = q.shape[1]
    scale = D**-0.5 if scale is None else scale
    cu = default_cu_seqlens(T, q.device) if cu is None else cu.to(device=q.device, dtype=torch.int64)
    N = cu.numel() - 1
    ctab, cu_chunks = chunk_table(cu, T, N)
    ncs = ctab.shape[0]
    gcs, a_beta = emu_prep(k, g, beta, ctab)
    stab, _ = segment_table(cu, cu_chunks, T, N, max(64, (T + 63) // 64 * 64), split=False)
    h_all, vnew = emu_bwd_h(k, v, gcs, a_beta, stab, h0, ncs)
    dh_all, dvnew, dh0 = emu_bwd_dhu(q, k, gcs, a_beta, do, dht, stab, scale, ncs, N, uw=uw)
    dq, dk, dv, dg, db = emu_bwd_dqkwy(q, k, v, beta, do, gcs, a_beta, h_all, dh_all, vnew, dvnew, ctab, scale)
    return dict(
        ctab=ctab, stab=stab, gcs=gcs, a_beta=a_beta, h_all=h_all, vnew=vnew, dh_all=dh_all, dvnew=dvnew,
        dq=dq, dk=dk, dv=dv, dg=dg, dbeta=db,
        dh0=dh0 if h0 is not None else None,
    )  # fmt: skip


def _rel(a, b):
    a, b = a.double(), b.double()
    return float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b).clamp_min(1e-30))


def stage_errors(r, q, k, v, beta, do, dht, h0, scale):
    """Each backward kernel's output against its emulation fed the kernel's own inputs.

    ``r`` is ``chunk_gdn_bwd(..., return_intermediates=True)``. Returns {stage_output: rel L2}
    over the used chunk slots (a large value points at that kernel)."""
    gcs, a_beta, ctab, stab = r["gcs"], r["a_beta"], r["ctab"], r["stab"]
    ncs = ctab.shape[0]
    N = int(stab[:, 2].max().item()) + 1
    used = (ctab[:, 2] >= 0).nonzero().flatten()
    rows = (used[:, None] * C + torch.arange(C, device=used.device)[None]).flatten()
    out = {}
    h_e, vn_e = emu_bwd_h(k, v, gcs, a_beta, stab, h0, ncs)
    out["bwd_h.h"] = _rel(r["h_all"][:, used].float(), h_e[:, used])
    out["bwd_h.vnew"] = _rel(r["vnew"][:, rows].float(), vn_e[:, rows])
    dh_e, dvn_e, dh0_e = emu_bwd_dhu(q, k, gcs, a_beta, do, dht, stab, scale, ncs, N)
    out["bwd_dhu.dh"] = _rel(r["dh_all"][:, used].float(), dh_e[:, used])
    out["bwd_dhu.dvnew"] = _rel(r["dvnew"][:, rows].float(), dvn_e[:, rows])
    if r.get("dh0") is not None:
        out["bwd_dhu.dh0"] = _rel(r["dh0"], dh0_e)
    dq_e, dk_e, dv_e, dg_e, db_e = emu_bwd_dqkwy(
        q, k, v, beta, do, gcs, a_beta, r["h_all"], r["dh_all"], r["vnew"], r["dvnew"], ctab, scale
    )  # fmt: skip
    for name, got, want in (("dq", r["dq"], dq_e), ("dk", r["dk"], dk_e), ("dv", r["dv"], dv_e), ("dg", r["dg"], dg_e),
                            ("dbeta", r["dbeta"], db_e)):  # fmt: skip
        out[f"bwd_dqkwy.{name}"] = _rel(got.float(), want)
    return out
