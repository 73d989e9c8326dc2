"""Backward kernel 4, persistent with role-split consumers (variant ``bwd_wy_ws=2``): bwd_wy_ws.py's
kernel (same items, producer, store warp, algebra and outputs) with its two consumer warpgroups
given different halves of each tile instead of splitting every GEMM between them.

In bwd_wy_ws both warpgroups run every GEMM and element pass of a tile in lockstep (each GEMM split
by columns), so the tile is one long chain with ~20 named barriers over 256 threads. Here:

    WG0 (tx   0..127)  the [64, 64] chain: (once per item) K Kᵀ; dA_β = dw X_wᵀ + du Vᵀ; M; A = I − A_β M;
                       X = Aᵀ dA_β (dβ diagonal); dL = −X A_βᵀ → the z sums and Σ over the group of
                       dM⊙Γ; then the per-row dβ / dg (with WG1's row sums) and the reverse cumsum
    WG1 (tx 128..255)  the [64, 128] products: dv = A_βᵀ du (staged for the store warp once WG0 has
                       read du), e^g ⊙ (A_βᵀ dw) into dk and its row sums with K; on an item's last
                       tile (ΣdM⊙Γ) K + (ΣdM⊙Γ)ᵀ K and the partial, staged for the store warp
    WG2 (tx 256..383)  warp 8 producer (TMA, two stages), warp 9 store warp (as bwd_wy_ws)

Each warpgroup runs whole GEMMs (one warpgroup's wgmma already uses all four tensor-core
quadrants), syncs only within itself, and WG1 runs up to a stage ahead of WG0.

mbarriers (t = tile, j = t % 2, ph = (t // 2) % 2, n = t // G): full[j] (32 + tx), empty[j] (256
consumers + 32 store warp), du_free[j] (WG0 after du Vᵀ → WG1 may stage dv over du), r1_ready[j]
(WG1 → WG0: the row sums), dkk_ready (WG0 → WG1, parity n % 2), dkk_free (WG1 → WG0 after its
(ΣdM⊙Γ) GEMMs, parity n % 2, waited before the next item's dkk is written), dv_ready[j], dk_ready
(parity n % 2): the consumers → the store warp.
"""

import functools
import json

import torch

from ._common import CHUNK, HEAD_DIM, check_heads, compile_program, target_key
from .bwd_wy_ws import THREADS, _grid, rows_store_macro

#: setmaxnreg budgets of WG0 (the [64, 64] chain), WG1 (the [64, 128] products), WG2 (producer,
#: store warp). The .inc requests are served only from what the CTA's .dec released, so the budgets
#: may sum to 3 x the launch count (504), not to 65536 / 128 = 512: a first version with 512 hung
#: every CTA at its first setmaxnreg.inc on the H200 (the offline compile cannot catch it).
NREG = (240, 200, 64)
NREG_LAUNCH = 65536 // THREADS // 8 * 8
assert sum(NREG) <= (THREADS // 128) * NREG_LAUNCH


def bwd_wy_ws2_program(h_qk: int, h_v: int):
    import tilelang.language as T

    G = check_heads(h_qk, h_v)
    C, D = CHUNK, HEAD_DIM
    Tn = T.dynamic("T")
    NCS = T.dynamic("NCS")
    NP = T.dynamic("NP")
    R0, R1, RP = NREG
    store_rows = rows_store_macro(C, D)

    @T.prim_func
    def gdn_bwd_wy_ws2(
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
            k_sh = T.alloc_shared((2, C, D), "bfloat16")
            v_sh = T.alloc_shared((2, C, D), "bfloat16")
            dw_sh = T.alloc_shared((2, C, D), "bfloat16")
            du_sh = T.alloc_shared((2, C, D), "bfloat16")  # then dv on its way out
            dkp_sh = T.alloc_shared((2, C, D), "bfloat16")  # then dk on its way out
            a_sh = T.alloc_shared((2, C, C), "bfloat16")
            g_sh = T.alloc_shared((2, C), "float32")
            b_sh = T.alloc_shared((2, C), "float32")
            dgp_sh = T.alloc_shared((2, C), "float32")
            info_sh = T.alloc_shared((2, 2), "int32")
            r1_sh = T.alloc_shared((2, C), "float32")  # WG1's row sums for WG0
            # WG0's own
            m_sh = T.alloc_shared((C, C), "bfloat16")
            aa_sh = T.alloc_shared((C, C), "bfloat16")
            dab_sh = T.alloc_shared((C, C), "bfloat16")
            x_sh = T.alloc_shared((C, C), "bfloat16")
            diag_sh = T.alloc_shared((C,), "float32")
            zr_sh = T.alloc_shared((C,), "float32")
            zc_sh = T.alloc_shared((C,), "float32")
            tot_sh = T.alloc_shared((1,), "float32")
            dkk_sh = T.alloc_shared((C, C), "bfloat16")  # WG0 → WG1, once per item

            f64 = T.alloc_fragment((C, C), "float32")
            mf = T.alloc_fragment((C, C), "float32")
            zf = T.alloc_fragment((C, C), "float32")
            kk = T.alloc_fragment((C, C), "float32")
            dkk_acc = T.alloc_fragment((C, C), "float32")
            zr = T.alloc_fragment((C,), "float32")
            zc = T.alloc_fragment((C,), "float32")
            acc1 = T.alloc_fragment((C, D), "float32")
            dk_acc = T.alloc_fragment((C, D), "float32")
            red = T.alloc_fragment((C,), "float32")
            sacc = T.alloc_var("float32")
            shf = T.alloc_var("float32")

            full = T.alloc_barrier([32, 32])
            empty = T.alloc_barrier([288, 288])
            du_free = T.alloc_barrier([128, 128])
            r1_ready = T.alloc_barrier([128, 128])
            dkk_ready = T.alloc_barrier(128)
            dkk_free = T.alloc_barrier(128)
            dv_ready = T.alloc_barrier([128, 128])
            dk_ready = T.alloc_barrier(128)

            ntiles = T.ceildiv(NCS * h_qk - b, NP) * G
            tx = T.get_thread_binding()

            if tx < 128:
                # ---------------- WG0: the [64, 64] chain, dβ and dg ----------------
                T.set_max_nreg(R0, int(R0 > NREG_LAUNCH))
                for t in T.serial(ntiles):
                    j = t % 2
                    ph = (t // 2) % 2
                    n = t // G
                    item = b + n * NP
                    hk = item % h_qk
                    gi = t % G
                    hv = hk * G + gi
                    T.barrier_wait(full[j], ph)
                    bos = info_sh[j, 0]
                    ln = info_sh[j, 1]
                    if gi == 0:
                        T.clear(dkk_acc)
                        T.gemm(k_sh[j, :, :], k_sh[j, :, :], kk, transpose_B=True, clear_accum=True)

                    # dA_β = dw X_wᵀ + du Vᵀ (lower incl. diagonal); X_w = e^g ⊙ K on valid rows
                    T.gemm(dw_sh[j, :, :], k_sh[j, :, :], f64, transpose_B=True, clear_accum=True)
                    for i, jj in T.Parallel(C, C):
                        f64[i, jj] = f64[i, jj] * T.if_then_else(jj < ln, T.exp(g_sh[j, jj]), T.float32(0))
                    T.gemm(du_sh[j, :, :], v_sh[j, :, :], f64, transpose_B=True)
                    T.barrier_arrive(du_free[j])
                    for i, jj in T.Parallel(C, C):
                        dab_sh[i, jj] = T.cast(T.if_then_else(i >= jj, f64[i, jj], T.float32(0)), "bfloat16")
                        mf[i, jj] = T.if_then_else(
                            i > jj and i < ln, T.exp(g_sh[j, i] - g_sh[j, jj]) * kk[i, jj], T.float32(0)
                        )
                        m_sh[i, jj] = T.cast(mf[i, jj], "bfloat16")

                    # A = I − A_β M
                    T.gemm(a_sh[j, :, :], m_sh, f64, clear_accum=True)
                    for i, jj in T.Parallel(C, C):
                        aa_sh[i, jj] = T.cast(
                            T.if_then_else(i >= jj, T.if_then_else(i == jj, T.float32(1), T.float32(0)) - f64[i, jj],
                                           T.float32(0)),
                            "bfloat16",
                        )  # fmt: skip

                    # X = Aᵀ dA_β: dβ_j += X_jj
                    T.gemm(aa_sh, dab_sh, f64, transpose_A=True, clear_accum=True)
                    for i, jj in T.Parallel(C, C):
                        x_sh[i, jj] = T.cast(f64[i, jj], "bfloat16")
                        if i == jj:
                            diag_sh[i] = f64[i, jj]

                    # dL = −X A_βᵀ (strictly lower); z = dL ⊙ M; Σ_group dM ⊙ Γ (β_i dL_ij Γ_ij)
                    T.gemm(x_sh, a_sh[j, :, :], f64, transpose_B=True, clear_accum=True)
                    for i, jj in T.Parallel(C, C):
                        zf[i, jj] = -f64[i, jj] * mf[i, jj]
                        dkk_acc[i, jj] = dkk_acc[i, jj] + T.if_then_else(
                            i > jj and i < ln, -f64[i, jj] * b_sh[j, i] * T.exp(g_sh[j, i] - g_sh[j, jj]), T.float32(0)
                        )
                    T.reduce_sum(zf, zr, dim=1)
                    for i, jj in T.Parallel(C, C):
                        zf[i, jj] = zf[i, jj] * b_sh[j, i]
                    T.reduce_sum(zf, zc, dim=0)
                    T.copy(zr, zr_sh)
                    T.copy(zc, zc_sh)
                    if gi == G - 1:  # hand ΣdM⊙Γ to WG1 (after it is done with the previous item's)
                        T.barrier_wait(dkk_free[0], 1 - n % 2)
                        for i, jj in T.Parallel(C, C):
                            dkk_sh[i, jj] = T.cast(dkk_acc[i, jj], "bfloat16")
                        T.fence_proxy_async()
                        T.barrier_arrive(dkk_ready[0])

                    # per row: dβ, dg on the cumsum, then the reverse cumsum (warp shuffles)
                    T.barrier_wait(r1_ready[j], ph)
                    if tx < C:
                        sacc = T.if_then_else(
                            tx < ln, r1_sh[j, tx] + b_sh[j, tx] * zr_sh[tx] - zc_sh[tx] + dgp_sh[j, tx], T.float32(0)
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
                    T.barrier_arrive(empty[j])
            elif tx < 256:
                # ---------------- WG1: dv, dk ----------------
                T.set_max_nreg(R1, int(R1 > NREG_LAUNCH))
                for t in T.serial(ntiles):
                    j = t % 2
                    ph = (t // 2) % 2
                    n = t // G
                    gi = t % G
                    T.barrier_wait(full[j], ph)
                    if gi == 0:
                        T.clear(dk_acc)
                    # dv = A_βᵀ du, staged over du once WG0 has read it
                    T.gemm(a_sh[j, :, :], du_sh[j, :, :], acc1, transpose_A=True, clear_accum=True)
                    T.barrier_wait(du_free[j], ph)
                    T.copy(acc1, du_sh[j, :, :])
                    T.fence_proxy_async()
                    T.barrier_arrive(dv_ready[j])
                    # dk += e^g ⊙ (A_βᵀ dw);  r1 = rowsum(e^g (A_βᵀ dw) ⊙ K)
                    T.gemm(a_sh[j, :, :], dw_sh[j, :, :], acc1, transpose_A=True, clear_accum=True)
                    for i, jj in T.Parallel(C, D):
                        acc1[i, jj] = acc1[i, jj] * T.exp(g_sh[j, i])
                        dk_acc[i, jj] = dk_acc[i, jj] + acc1[i, jj]
                        acc1[i, jj] = acc1[i, jj] * T.cast(k_sh[j, i, jj], "float32")
                    T.reduce_sum(acc1, red, dim=1)
                    T.copy(red, r1_sh[j, :])
                    T.barrier_arrive(r1_ready[j])
                    if gi == G - 1:
                        # dk += (ΣdM⊙Γ) K + (ΣdM⊙Γ)ᵀ K, then the partial; staged in the partial's buffer
                        T.barrier_wait(dkk_ready[0], n % 2)
                        T.gemm(dkk_sh, k_sh[j, :, :], dk_acc)
                        T.gemm(dkk_sh, k_sh[j, :, :], dk_acc, transpose_A=True)
                        T.barrier_arrive(dkk_free[0])
                        for i, jj in T.Parallel(C, D):
                            acc1[i, jj] = T.cast(dkp_sh[j, i, jj], "float32") + dk_acc[i, jj]
                        T.copy(acc1, dkp_sh[j, :, :])
                        T.fence_proxy_async()
                        T.barrier_arrive(dk_ready[0])
                    T.barrier_arrive(empty[j])
            else:
                T.set_max_nreg(RP, int(RP > NREG_LAUNCH))
                if tx < 288:
                    # ---------------- warp 8: producer ----------------
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
                            T.barrier_wait(dk_ready[0], (t // G) % 2)
                            store_rows(dkp_sh, j, dk_v, bos, ln, hk)
                        T.barrier_arrive(empty[j])

    return gdn_bwd_wy_ws2


@functools.cache
def get_bwd_wy_ws2_kernel(h_qk: int, h_v: int, target_k=None):
    target = json.loads(target_k) if target_k and target_k.startswith("{") else target_k
    return compile_program(bwd_wy_ws2_program(h_qk, h_v), target=target)


def run_bwd_wy_ws2(k, v, beta, gcs, a_beta, ctab, dw, dvnew, dg_part, dk_v, dv=None, dg=None, dbeta=None, target=None,
                   num_sms=None):  # fmt: skip
    """As ``bwd_wy_ws.run_bwd_wy_ws`` (same arguments and outputs)."""
    h_qk, h_v = k.shape[2], v.shape[2]
    T_, ncs = k.shape[1], ctab.shape[0]
    dev = k.device
    if dk_v.dtype != torch.bfloat16 or tuple(dk_v.shape) != (1, T_, h_qk, HEAD_DIM):
        raise ValueError(f"run_bwd_wy_ws2: dk_v must be bf16 [1, {T_}, {h_qk}, {HEAD_DIM}], got "
                         f"{dk_v.dtype} {tuple(dk_v.shape)}")  # fmt: skip
    if dv is None:
        dv = torch.empty(1, T_, h_v, HEAD_DIM, device=dev, dtype=torch.bfloat16)
    if dg is None:
        dg = torch.empty(1, T_, h_v, device=dev, dtype=torch.float32)
    if dbeta is None:
        dbeta = torch.empty(1, T_, h_v, device=dev, dtype=torch.float32)
    if num_sms is None:
        from . import _num_sms

        num_sms = _num_sms(dev)
    nprog = max(1, min(int(num_sms), ncs * h_qk))
    kern = get_bwd_wy_ws2_kernel(h_qk, h_v, target_key(target))
    kern(k, v, beta, gcs, a_beta, ctab, dw, dvnew, dg_part, dk_v, dv, dg, dbeta, _grid(nprog, dev))
    return dk_v, dv, dg, dbeta
