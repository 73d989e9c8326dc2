"""Backward kernel 5: the gradients through w, u and A (FLA's WY backward), warp-specialised and persistent.

Per (chunk, v-head) tile (A = I − A_β M rebuilt, M = StrictLower(Γ ⊙ K Kᵀ), no solve):

    dA_β = dw (e^g ⊙ K)ᵀ + dv_new Vᵀ;   dv = A_βᵀ dv_new;   X = Aᵀ dA_β → dβ_j += X_jj
    dL = −X A_βᵀ → dβ, dM = β dL → dk += (dM⊙Γ) K + (dM⊙Γ)ᵀ K, dg;  dk += e^g ⊙ (A_βᵀ dw)
    dg: the partial from bwd_dqkwg plus these terms, then the reverse in-chunk cumsum (raw g)

A CTA of 384 threads stays on its SM (so that loads overlap compute) and walks a list of work items:

    WG0 + WG1 (tx   0..255)  consumers: every GEMM and element pass of one (chunk, v-head) tile,
                             the GEMMs split over the two warpgroups and issued asynchronously in
                             three groups so that the independent ones overlap the chain: {dw Kᵀ,
                             A_β M, A_βᵀ dv_new} then dv_new Vᵀ; {X = Aᵀ dA_β, A_βᵀ dw} then
                             dL = X A_βᵀ, each wait on the oldest. Γ once per tile. Once per item
                             (chunk, qk head): K Kᵀ; (Σ_G dM⊙Γ) K + (Σ_G dM⊙Γ)ᵀ K; dk (fp32 over
                             the group) + the partial, stored once; dg's reverse cumsum by shuffles.
    WG2       (tx 256..383)  warp 8, the producer: TMA loads of the next tile (k, v, dw, dv_new, A_β,
                             g, dg_part, and the dk partial on the group's last v-head) and β
                             (strided: SIMT loads) into stage t % 2, one tile ahead.
                             warp 9, the store warp: dv (staged in dv_new's buffer once both
                             warpgroups' reads of it completed) and dk (in the partial's buffer):
                             a TMA store when the chunk is full, else per-row stores of valid rows

Items are (chunk slot, qk head) pairs, CTA b taking items b, b + P, b + 2P, … (P = the grid, at
most one CTA per SM); tile t of a CTA is v-head t % G of its item t // G.

Rows past a chunk's valid length: the TMA loads of k and v are not masked (they read the next
sequence's rows, or zeros past T). dw and dv_new rows there are zero (bwd_dqkwg / bwd_dhu store
them so), A_β is zero outside the valid block, and M is masked to the valid rows here, so those
rows reach no stored output (dv, dk, dg, dβ are stored on valid rows only).

mbarriers (t = tile, j = t % 2, parity (t // 2) % 2; item i = t // G): full[j] (the producer warp,
32 + tx bytes), dv_ready[j] (the 256 consumers: dv staged), dk_ready[i % 2] (256, parity (i // 2) %
2: the item's dk staged), empty[j] (288: the consumers after their last read of stage j and the
store warp after its stores).
No hand-off can be lapped: dv_ready[j] is arrived again at tile t + 2 and dk_ready[i % 2] at item
i + 2 (tile ≥ t + 2), which needs full[j], so empty[j] of tile t, which the store warp arrives only
after its waits for tile t. (One dk_ready barrier, parity i % 2, could be lapped for G = 1.)
``tools/kernels/wy_protocol.py`` models both over random interleavings.
"""

import functools

import torch

from ._common import CHUNK, HEAD_DIM, check_heads, compile_program, parse_target, target_key
from .plan import sm_count

#: setmaxnreg budgets of the consumer warpgroups (WG0, WG1) and the producer warpgroup (WG2)
NREG = (232, 40)
THREADS = 384
#: what each thread starts with (65536 / 384, rounded down to 8): .inc above it, .dec below
NREG_LAUNCH = 65536 // THREADS // 8 * 8
assert 2 * NREG[0] + NREG[1] <= (THREADS // 128) * NREG_LAUNCH  # .inc is served by what .dec released


def rows_store_macro(C: int, D: int):
    """store_rows(src_sh [2, C, D] bf16, j, dst [1, T, H, D], bos, ln, head), by one warp: stage j's
    valid rows to token rows bos.. of one head (a TMA store when the chunk is full, else per-row
    stores of rows < ln: the next rows are another sequence's)."""
    import tilelang.language as T

    @T.macro
    def store_rows(src_sh, j, dst, bos, ln, head):
        if ln == C:
            T.copy(src_sh[j, :, :], dst[0, bos : bos + C, head, 0:D])
        else:
            for i, jj in T.Parallel(C, D):
                if i < ln:
                    dst[0, bos + i, head, jj] = src_sh[j, i, jj]

    return store_rows


def bwd_wy_program(h_qk: int, h_v: int):
    """The prim_func ``gdn_bwd_wy_ws``."""
    import tilelang.language as T

    G = check_heads(h_qk, h_v)
    C, D = CHUNK, HEAD_DIM
    Tn = T.dynamic("T")
    NCS = T.dynamic("NCS")
    NP = T.dynamic("NP")
    RC, RP = NREG

    store_rows = rows_store_macro(C, D)

    @T.prim_func
    def gdn_bwd_wy_ws(
        k: T.Tensor((1, Tn, h_qk, D), "bfloat16"),
        v: T.Tensor((1, Tn, h_v, D), "bfloat16"),
        beta: T.Tensor((1, Tn, h_v), "float32"),
        gcs: T.Tensor((h_v, NCS * C), "float32"),
        a_beta: T.Tensor((h_v, NCS * C, C), "bfloat16"),
        ctab: T.Tensor((NCS, 4), "int32"),
        dw: T.Tensor((h_v, NCS * C, D), "bfloat16"),
        dvnew: T.Tensor((h_v, NCS * C, D), "bfloat16"),
        dg_part: T.Tensor((h_v, NCS * C), "float32"),
        dk_v: T.Tensor((1, Tn, h_qk, D), "bfloat16"),
        dv: T.Tensor((1, Tn, h_v, D), "bfloat16"),
        dg: T.Tensor((1, Tn, h_v), "float32"),
        dbeta: T.Tensor((1, Tn, h_v), "float32"),
        grid: T.Tensor((NP,), "int32"),
    ):
        with T.Kernel(NP, threads=THREADS) as b:
            # stage j (two): the producer's loads
            k_sh = T.alloc_shared((2, C, D), "bfloat16")
            v_sh = T.alloc_shared((2, C, D), "bfloat16")
            dw_sh = T.alloc_shared((2, C, D), "bfloat16")
            du_sh = T.alloc_shared((2, C, D), "bfloat16")
            dkp_sh = T.alloc_shared((2, C, D), "bfloat16")
            a_sh = T.alloc_shared((2, C, C), "bfloat16")
            g_sh = T.alloc_shared((2, C), "float32")
            b_sh = T.alloc_shared((2, C), "float32")
            dgp_sh = T.alloc_shared((2, C), "float32")
            info_sh = T.alloc_shared((2, 2), "int32")
            # the consumers' own
            m_sh = T.alloc_shared((C, C), "bfloat16")
            aa_sh = T.alloc_shared((C, C), "bfloat16")
            dab_sh = T.alloc_shared((C, C), "bfloat16")
            x_sh = T.alloc_shared((C, C), "bfloat16")
            dkk_sh = T.alloc_shared((C, C), "bfloat16")
            diag_sh = T.alloc_shared((C,), "float32")
            r1_sh = T.alloc_shared((C,), "float32")
            zr_sh = T.alloc_shared((C,), "float32")
            zc_sh = T.alloc_shared((C,), "float32")
            tot_sh = T.alloc_shared((1,), "float32")

            f64 = T.alloc_fragment((C, C), "float32")
            mf = T.alloc_fragment((C, C), "float32")
            gam = T.alloc_fragment((C, C), "float32")  # Γ on the strict lower valid rows
            fa = T.alloc_fragment((C, C), "float32")
            zf = T.alloc_fragment((C, C), "float32")
            kk = T.alloc_fragment((C, C), "float32")  # K Kᵀ, once per item
            dkk_acc = T.alloc_fragment((C, C), "float32")  # Σ over the group of dM ⊙ Γ
            acc1 = T.alloc_fragment((C, D), "float32")
            dk_acc = T.alloc_fragment((C, D), "float32")
            red = T.alloc_fragment((C,), "float32")
            zr = T.alloc_fragment((C,), "float32")
            zc = T.alloc_fragment((C,), "float32")
            sacc = T.alloc_var("float32")
            shf = T.alloc_var("float32")

            full = T.alloc_barrier([32, 32])
            empty = T.alloc_barrier([288, 288])  # the consumers and the store warp
            dv_ready = T.alloc_barrier([256, 256])
            dk_ready = T.alloc_barrier([256, 256])  # item i = t // G: dk_ready[i % 2], parity (i // 2) % 2

            ntiles = T.ceildiv(NCS * h_qk - b, NP) * G
            tx = T.get_thread_binding()

            if tx < 256:
                # ---------------- WG0 + WG1: consumers ----------------
                T.set_max_nreg(RC, int(RC > NREG_LAUNCH))
                for t in T.serial(ntiles):
                    j = t % 2
                    item = b + (t // G) * NP
                    hk = item % h_qk
                    gi = t % G
                    hv = hk * G + gi
                    T.barrier_wait(full[j], (t // 2) % 2)
                    bos = info_sh[j, 0]
                    ln = info_sh[j, 1]
                    if gi == 0:
                        T.clear(dk_acc)
                        T.clear(dkk_acc)
                        T.gemm(k_sh[j, :, :], k_sh[j, :, :], kk, transpose_B=True, clear_accum=True)

                    # Γ, M = StrictLower(Γ ⊙ K Kᵀ) on valid rows
                    for i, jj in T.Parallel(C, C):
                        gam[i, jj] = T.if_then_else(i > jj and i < ln, T.exp(g_sh[j, i] - g_sh[j, jj]), T.float32(0))
                        mf[i, jj] = gam[i, jj] * kk[i, jj]
                        m_sh[i, jj] = T.cast(mf[i, jj], "bfloat16")
                    # issued together: dw Kᵀ, A_β M, A_βᵀ du (dv)
                    T.wgmma_gemm(dw_sh[j, :, :], k_sh[j, :, :], f64, transpose_B=True, clear_accum=True)
                    T.wgmma_gemm(a_sh[j, :, :], m_sh, fa, clear_accum=True)
                    T.wgmma_gemm(a_sh[j, :, :], du_sh[j, :, :], acc1, transpose_A=True, clear_accum=True)
                    T.wait_wgmma(2)
                    T.warpgroup_fence_operand(f64, num_regs=C * C // 256)
                    # dA_β = dw X_wᵀ + du Vᵀ (lower incl. diagonal); X_w = e^g ⊙ K on valid rows
                    for i, jj in T.Parallel(C, C):
                        f64[i, jj] = f64[i, jj] * T.if_then_else(jj < ln, T.exp(g_sh[j, jj]), T.float32(0))
                    T.wgmma_gemm(du_sh[j, :, :], v_sh[j, :, :], f64, transpose_B=True)
                    T.wait_wgmma(2)
                    T.warpgroup_fence_operand(fa, num_regs=C * C // 256)  # A = I − A_β M
                    for i, jj in T.Parallel(C, C):
                        aa_sh[i, jj] = T.cast(
                            T.if_then_else(i >= jj, T.if_then_else(i == jj, T.float32(1), T.float32(0)) - fa[i, jj],
                                           T.float32(0)),
                            "bfloat16",
                        )  # fmt: skip
                    T.wait_wgmma(0)
                    T.warpgroup_fence_operand(acc1, num_regs=C * D // 256)
                    T.warpgroup_fence_operand(f64, num_regs=C * C // 256)
                    for i, jj in T.Parallel(C, C):
                        dab_sh[i, jj] = T.cast(T.if_then_else(i >= jj, f64[i, jj], T.float32(0)), "bfloat16")
                    T.sync_threads(3, 256)  # both warpgroups' du Vᵀ and A_βᵀ du are complete
                    for i, jj in T.Parallel(C, D):  # dv staged in du's buffer (read for the last time above)
                        du_sh[j, i, jj] = T.cast(acc1[i, jj], "bfloat16")
                    T.fence_proxy_async()
                    T.barrier_arrive(dv_ready[j])

                    # issued together: X = Aᵀ dA_β, A_βᵀ dw
                    T.wgmma_gemm(aa_sh, dab_sh, f64, transpose_A=True, clear_accum=True)
                    T.wgmma_gemm(a_sh[j, :, :], dw_sh[j, :, :], acc1, transpose_A=True, clear_accum=True)
                    T.wait_wgmma(1)
                    T.warpgroup_fence_operand(f64, num_regs=C * C // 256)  # X: dβ_j += X_jj
                    for i, jj in T.Parallel(C, C):
                        x_sh[i, jj] = T.cast(f64[i, jj], "bfloat16")
                        if i == jj:
                            diag_sh[i] = f64[i, jj]
                    # dL = −X A_βᵀ (strictly lower), issued behind A_βᵀ dw; then dk += e^g ⊙ (A_βᵀ dw),
                    # dg += rowsum(e^g (A_βᵀ dw) ⊙ K)
                    T.wgmma_gemm(x_sh, a_sh[j, :, :], f64, transpose_B=True, clear_accum=True)
                    T.wait_wgmma(1)
                    T.warpgroup_fence_operand(acc1, num_regs=C * D // 256)
                    for i, jj in T.Parallel(C, D):
                        acc1[i, jj] = acc1[i, jj] * T.exp(g_sh[j, i])
                        dk_acc[i, jj] = dk_acc[i, jj] + acc1[i, jj]
                        acc1[i, jj] = acc1[i, jj] * T.cast(k_sh[j, i, jj], "float32")
                    T.reduce_sum(acc1, red, dim=1)
                    T.copy(red, r1_sh)
                    T.wait_wgmma(0)
                    T.warpgroup_fence_operand(f64, num_regs=C * C // 256)
                    # z = dL ⊙ M; dM ⊙ Γ = β_i dL_ij Γ_ij
                    for i, jj in T.Parallel(C, C):
                        zf[i, jj] = -f64[i, jj] * mf[i, jj]
                        dkk_acc[i, jj] = dkk_acc[i, jj] - f64[i, jj] * b_sh[j, i] * gam[i, jj]
                    T.reduce_sum(zf, zr, dim=1)
                    for i, jj in T.Parallel(C, C):
                        zf[i, jj] = zf[i, jj] * b_sh[j, i]
                    T.reduce_sum(zf, zc, dim=0)
                    T.copy(zr, zr_sh)
                    T.copy(zc, zc_sh)

                    # per row: dβ, dg on the cumsum, then the reverse cumsum (warp shuffles) → dg of the raw g
                    if tx < C:
                        sacc = T.if_then_else(
                            tx < ln, r1_sh[tx] + b_sh[j, tx] * zr_sh[tx] - zc_sh[tx] + dgp_sh[j, tx], T.float32(0)
                        )
                        if tx < ln:
                            dbeta[0, bos + tx, hv] = diag_sh[tx] + zr_sh[tx]
                        for s in (1, 2, 4, 8, 16):  # every lane shuffles (full mask), the top ones add 0
                            shf = T.shfl_down(sacc, s)
                            sacc = sacc + T.if_then_else(tx % 32 + s < 32, shf, T.float32(0))
                        if tx == 32:
                            tot_sh[0] = sacc
                    if tx < 32:
                        sacc = sacc + tot_sh[0]
                    if tx < ln:
                        dg[0, bos + tx, hv] = sacc

                    if gi == G - 1:
                        # dk += (Σ dM⊙Γ) K + (Σ dM⊙Γ)ᵀ K over the group, then the partial; store once
                        for i, jj in T.Parallel(C, C):
                            dkk_sh[i, jj] = T.cast(dkk_acc[i, jj], "bfloat16")
                        T.gemm(dkk_sh, k_sh[j, :, :], dk_acc)
                        T.gemm(dkk_sh, k_sh[j, :, :], dk_acc, transpose_A=True)
                        for i, jj in T.Parallel(C, D):
                            acc1[i, jj] = T.cast(dkp_sh[j, i, jj], "float32") + dk_acc[i, jj]
                        for i, jj in T.Parallel(C, D):  # staged in the partial's buffer
                            dkp_sh[j, i, jj] = T.cast(acc1[i, jj], "bfloat16")
                        T.fence_proxy_async()
                        T.barrier_arrive(dk_ready[(t // G) % 2])
                    T.barrier_arrive(empty[j])
            else:
                # ---------------- WG2: producer (warp 8) ----------------
                T.set_max_nreg(RP, int(RP > NREG_LAUNCH))
                if tx < 288:
                    for t in T.serial(ntiles):
                        j = t % 2
                        item = b + (t // G) * NP
                        c = item // h_qk
                        hk = item % h_qk
                        gi = t % G
                        hv = hk * G + gi
                        r0 = c * C
                        T.barrier_wait(empty[j], 1 - (t // 2) % 2)
                        bos = ctab[c, 0]
                        ln = ctab[c, 1] - bos
                        T.tma_copy(k[0, bos : bos + C, hk, 0:D], k_sh[j, :, :], barrier=full[j])
                        T.tma_copy(v[0, bos : bos + C, hv, 0:D], v_sh[j, :, :], barrier=full[j])
                        T.tma_copy(dw[hv, r0 : r0 + C, 0:D], dw_sh[j, :, :], barrier=full[j])
                        T.tma_copy(dvnew[hv, r0 : r0 + C, 0:D], du_sh[j, :, :], barrier=full[j])
                        T.tma_copy(a_beta[hv, r0 : r0 + C, 0:C], a_sh[j, :, :], barrier=full[j])
                        T.tma_copy(gcs[hv, r0 : r0 + C], g_sh[j, :], barrier=full[j])
                        T.tma_copy(dg_part[hv, r0 : r0 + C], dgp_sh[j, :], barrier=full[j])
                        if gi == G - 1:
                            T.tma_copy(dk_v[0, bos : bos + C, hk, 0:D], dkp_sh[j, :, :], barrier=full[j])
                        for u in T.serial(C // 32):
                            ii = (tx - 256) + u * 32
                            b_sh[j, ii] = T.if_then_else(ii < ln, beta[0, bos + ii, hv], T.float32(0))
                        if tx == 256:
                            info_sh[j, 0] = bos
                            info_sh[j, 1] = ln
                        T.barrier_arrive(full[j])
                elif tx < 320:
                    # ---------------- warp 9: stores dv, dk from the staged tiles ----------------
                    for t in T.serial(ntiles):
                        j = t % 2
                        ph = (t // 2) % 2
                        item = b + (t // G) * NP
                        hk = item % h_qk
                        gi = t % G
                        hv = hk * G + gi
                        T.barrier_wait(dv_ready[j], ph)
                        bos = info_sh[j, 0]
                        ln = info_sh[j, 1]
                        store_rows(du_sh, j, dv, bos, ln, hv)
                        if gi == G - 1:
                            T.barrier_wait(dk_ready[(t // G) % 2], (t // (2 * G)) % 2)
                            store_rows(dkp_sh, j, dk_v, bos, ln, hk)
                        T.barrier_arrive(empty[j])

    return gdn_bwd_wy_ws


@functools.cache
def get_bwd_wy_kernel(h_qk: int, h_v: int, target_k=None):
    return compile_program(bwd_wy_program(h_qk, h_v), target=parse_target(target_k))


_GRIDS = {}


def persistent_grid(ncs: int, h_qk: int, dev, num_sms=None):
    """The persistent kernels' grid argument: a kept int32 tensor (never read) whose length
    P = min(#SMs, chunk slots x qk heads) is the launch's grid (a dynamic dimension)."""
    if num_sms is None:
        num_sms = sm_count(dev)
    n = max(1, min(int(num_sms), ncs * h_qk))
    key = (n, str(dev))
    if key not in _GRIDS:
        _GRIDS[key] = torch.empty(n, device=dev, dtype=torch.int32)
    return _GRIDS[key]


def run_bwd_wy(k, v, beta, gcs, a_beta, ctab, dw, dvnew, dg_part, dk_v, dv=None, dg=None, dbeta=None, target=None,
                  num_sms=None):  # fmt: skip
    """Launch the persistent WY backward (any GVA group size G ≥ 1). dk_v [1,T,Hqk,128] bf16
    (bwd_dqkwg's group-summed partial) is completed in place. Returns dk_v, dv [1,T,Hv,128] bf16, dg, dbeta [1,T,Hv] fp32."""
    h_qk, h_v = k.shape[2], v.shape[2]
    T_, ncs = k.shape[1], ctab.shape[0]
    dev = k.device
    if dk_v.dtype != torch.bfloat16 or tuple(dk_v.shape) != (1, T_, h_qk, HEAD_DIM):
        raise ValueError(f"run_bwd_wy: dk_v must be bf16 [1, {T_}, {h_qk}, {HEAD_DIM}], got "
                         f"{dk_v.dtype} {tuple(dk_v.shape)}")  # fmt: skip
    if dv is None:
        dv = torch.empty(1, T_, h_v, HEAD_DIM, device=dev, dtype=torch.bfloat16)
    if dg is None:
        dg = torch.empty(1, T_, h_v, device=dev, dtype=torch.float32)
    if dbeta is None:
        dbeta = torch.empty(1, T_, h_v, device=dev, dtype=torch.float32)
    kern = get_bwd_wy_kernel(h_qk, h_v, target_key(target))
    kern(k, v, beta, gcs, a_beta, ctab, dw, dvnew, dg_part, dk_v, dv, dg, dbeta, persistent_grid(ncs, h_qk, dev, num_sms))
    return dk_v, dv, dg, dbeta
