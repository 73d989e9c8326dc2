"""Backward kernel 4: dq, dk, dv, dg and dβ from the states, their gradients and the WY form, one
warp-specialised persistent kernel (FLA's ``chunk_bwd_dqkwg`` and WY backward in one pass).

Per (chunk, v-head) tile, with h, dH the state and its gradient at the chunk (bwd_h, bwd_dhu):

  phase A, the state terms:
    dP = dO v_newᵀ;  dS = scale Γ ⊙ dP (causal)          dw = −dv_new hᵀ (bf16, kept in shared memory)
    dq += scale e^g ⊙ (dO hᵀ) + dS K                     dk += dSᵀ Q + e^{g_l − g} ⊙ (v_new dHᵀ)
    dg's state part: row / column sums of dS ⊙ (Q Kᵀ), the q and k terms and e^{g_l} Σ h ⊙ dH
  phase B, through w, u and A (A = I − A_β M rebuilt, M = StrictLower(Γ ⊙ K Kᵀ), no solve):
    dA_β = dw (e^g ⊙ K)ᵀ + dv_new Vᵀ;   dv = A_βᵀ dv_new;   X = Aᵀ dA_β → dβ_j += X_jj
    dL = −X A_βᵀ → dβ, dM = β dL → dk += (dM⊙Γ) K + (dM⊙Γ)ᵀ K, dg;  dk += e^g ⊙ (A_βᵀ dw)
    dg: both parts, then the reverse in-chunk cumsum (raw g)

dq and dk are summed over the G v-heads of a GVA group in fp32 registers and stored once per item;
dw and dg's state part never leave the SM.

A CTA of 384 threads stays on its SM and walks work items (chunk slot, qk head): CTA b takes items
b, b + P, b + 2P, … (P = the grid, at most one CTA per SM); tile t is v-head t % G of item t // G.

    WG0 + WG1 (tx   0..255)  consumers: every GEMM and element pass of a tile, the GEMMs split over
                             the two warpgroups; phase B's issued asynchronously in three groups
                             ({dw Kᵀ, A_β M, A_βᵀ dv_new} then dv_new Vᵀ; {X = Aᵀ dA_β, A_βᵀ dw} then
                             dL = X A_βᵀ, each wait on the oldest). dq and dk of an item stored from
                             the registers after its last tile (valid rows), dg and dβ by row.
    WG2       (tx 256..383)  warp 8, the producer: TMA loads per tile in the order they are freed:
                             group A (dO, v_new, h, dH, g and β into slot t % 2), dv_new, q, k
                             (per item), group V (v, A_β). warp 9, the store warp: dv (staged in v's
                             buffer after its last read) by TMA when the chunk is full, else by rows.

Every buffer but g, β and the row table has one slot; the next tile's copy is loaded as soon as the
consumers are done with it: group A after phase A, dv_new after phase B's first group, q after the
item's last phase A (the next item's q lands during its phase B), k after the item's last GEMM (the
next item's first tile waits for it only after three GEMMs), group V once the tile is done and its dv
stored. 220 KB of shared memory
(the block limit is 227 KB): dS, A and dM ⊙ Γ share one buffer.

Rows past a chunk's valid length: the TMA loads of q, k, v, dO are not masked (the next sequence's
rows, or zeros past T); dS, M and the dk state part are masked to the valid rows, dv_new and A_β are
zero there, and dq, dk, dv, dg, dβ are stored on valid rows only.

mbarriers (parity t % 2 unless named): full_a / empty_a, full_u / empty_u, full_v / empty_v (288: the
consumers and the store warp), full_q / empty_q and full_k / empty_k (parity (t // G) % 2), dv_ready
(the consumers, dv staged). full_* count 32 (the producer warp) + tx bytes, empty_* the 256
consumer threads.
``tools/kernels/dqkwy_protocol.py`` models them over random interleavings.
"""

import functools

import torch

from ._common import CHUNK, FAST_MATH, HEAD_DIM, check_heads, compile_program, parse_target, target_key
from .plan import sm_count

#: setmaxnreg budgets of the consumer warpgroups (WG0, WG1) and the producer warpgroup (WG2)
NREG = (240, 24)
THREADS = 384
#: what each thread starts with (65536 / 384, rounded down to 8): .inc above it, .dec below
NREG_LAUNCH = 65536 // THREADS // 8 * 8
assert 2 * NREG[0] + NREG[1] <= (THREADS // 128) * NREG_LAUNCH  # .inc is served by what .dec released


def bwd_dqkwy_program(h_qk: int, h_v: int):
    """The prim_func ``gdn_bwd_dqkwy_ws``."""
    import tilelang.language as T

    G = check_heads(h_qk, h_v)
    C, D = CHUNK, HEAD_DIM
    Tn = T.dynamic("T")
    NCS = T.dynamic("NCS")
    NP = T.dynamic("NP")
    RC, RP = NREG
    f0 = T.float32(0)

    @T.prim_func
    def gdn_bwd_dqkwy_ws(
        q: T.Tensor((1, Tn, h_qk, D), "bfloat16"),
        k: T.Tensor((1, Tn, h_qk, D), "bfloat16"),
        v: T.Tensor((1, Tn, h_v, D), "bfloat16"),
        beta: T.Tensor((1, Tn, h_v), "float32"),
        do: T.Tensor((1, Tn, h_v, D), "bfloat16"),
        gcs: T.Tensor((h_v, NCS * C), "float32"),
        a_beta: T.Tensor((h_v, NCS * C, C), "bfloat16"),
        ctab: T.Tensor((NCS, 4), "int32"),
        h_all: T.Tensor((h_v, NCS, D, D), "bfloat16"),
        dh_all: T.Tensor((h_v, NCS, D, D), "bfloat16"),
        vnew: T.Tensor((h_v, NCS * C, D), "bfloat16"),
        dvnew: T.Tensor((h_v, NCS * C, D), "bfloat16"),
        scale: T.float32,
        dq: T.Tensor((1, Tn, h_qk, D), "bfloat16"),
        dk: T.Tensor((1, Tn, h_qk, D), "bfloat16"),
        dv: T.Tensor((1, Tn, h_v, D), "bfloat16"),
        dg: T.Tensor((1, Tn, h_v), "float32"),
        dbeta: T.Tensor((1, Tn, h_v), "float32"),
        grid: T.Tensor((NP,), "int32"),
    ):
        with T.Kernel(NP, threads=THREADS) as b:
            # the producer's loads: group A, dv_new, group V, q and k (one slot each; g, β and the
            # row table in slot t % 2)
            do_sh = T.alloc_shared((C, D), "bfloat16")
            vn_sh = T.alloc_shared((C, D), "bfloat16")
            h_sh = T.alloc_shared((D, D), "bfloat16")
            dh_sh = T.alloc_shared((D, D), "bfloat16")
            g_sh = T.alloc_shared((2, C), "float32")
            b_sh = T.alloc_shared((2, C), "float32")
            info_sh = T.alloc_shared((2, 2), "int32")
            du_sh = T.alloc_shared((C, D), "bfloat16")  # dv_new
            v_sh = T.alloc_shared((1, C, D), "bfloat16")  # then dv on its way out
            a_sh = T.alloc_shared((C, C), "bfloat16")
            q_sh = T.alloc_shared((C, D), "bfloat16")
            k_sh = T.alloc_shared((C, D), "bfloat16")
            # the consumers' own
            dw_sh = T.alloc_shared((C, D), "bfloat16")
            ds_sh = T.alloc_shared((C, C), "bfloat16")  # dS, then A, then dM ⊙ Γ
            m_sh = T.alloc_shared((C, C), "bfloat16")  # M, then X
            dab_sh = T.alloc_shared((C, C), "bfloat16")
            diag_sh = T.alloc_shared((C,), "float32")
            r1_sh = T.alloc_shared((C,), "float32")
            r2_sh = T.alloc_shared((C,), "float32")
            zr_sh = T.alloc_shared((C,), "float32")
            zc_sh = T.alloc_shared((C,), "float32")
            tot_sh = T.alloc_shared((1,), "float32")

            zf = T.alloc_fragment((C, C), "float32")  # dS (phase A), then z (phase B)
            mf = T.alloc_fragment((C, C), "float32")  # Q Kᵀ (phase A), then M (phase B)
            gam = T.alloc_fragment((C, C), "float32")  # Γ on the strict lower valid rows
            fa = T.alloc_fragment((C, C), "float32")
            f64 = T.alloc_fragment((C, C), "float32")
            acc1 = T.alloc_fragment((C, D), "float32")
            acc2 = T.alloc_fragment((C, D), "float32")
            dq_acc = T.alloc_fragment((C, D), "float32")
            dk_acc = T.alloc_fragment((C, D), "float32")
            red = T.alloc_fragment((C,), "float32")
            zr = T.alloc_fragment((C,), "float32")
            zc = T.alloc_fragment((C,), "float32")
            hdt = T.alloc_fragment((1,), "float32")
            r2t = T.alloc_fragment((1,), "float32")
            glast = T.alloc_var("float32")
            dga = T.alloc_var("float32")
            sacc = T.alloc_var("float32")
            shf = T.alloc_var("float32")

            full_a = T.alloc_barrier(32)
            empty_a = T.alloc_barrier(256)
            full_u = T.alloc_barrier(32)
            empty_u = T.alloc_barrier(256)
            full_q = T.alloc_barrier(32)
            empty_q = T.alloc_barrier(256)
            full_k = T.alloc_barrier(32)
            empty_k = T.alloc_barrier(256)
            full_v = T.alloc_barrier(32)
            empty_v = T.alloc_barrier(288)  # the consumers and the store warp
            dv_ready = T.alloc_barrier(256)

            ntiles = T.ceildiv(NCS * h_qk - b, NP) * G
            tx = T.get_thread_binding()

            if tx < 256:
                # ---------------- WG0 + WG1: consumers ----------------
                T.set_max_nreg(RC, int(RC > NREG_LAUNCH))
                for it in T.serial(ntiles // G):
                    hk = (b + it * NP) % h_qk
                    T.clear(dq_acc)
                    T.clear(dk_acc)
                    for vi in T.serial(G):
                        t = it * G + vi
                        j = t % 2
                        p = t % 2
                        hv = hk * G + vi
                        T.barrier_wait(full_a, p)
                        bos = info_sh[j, 0]
                        ln = info_sh[j, 1]
                        glast = g_sh[j, T.max(ln - 1, 0)]

                        # ---- phase A ----
                        # dS = scale Γ ⊙ dO v_newᵀ (valid rows, i ≥ j)
                        T.gemm(do_sh, vn_sh, zf, transpose_B=True, clear_accum=True)
                        for i, jj in T.Parallel(C, C):
                            zf[i, jj] = T.if_then_else(i >= jj and i < ln, scale * T.exp(g_sh[j, i] - g_sh[j, jj]), f0) * zf[i, jj]
                            ds_sh[i, jj] = T.cast(zf[i, jj], "bfloat16")
                        # dq += scale e^g ⊙ (dO hᵀ); its row sums with Q
                        T.gemm(do_sh, h_sh, acc1, transpose_B=True, clear_accum=True)
                        if vi == 0:
                            T.barrier_wait(full_q, (t // G) % 2)
                        for i, jj in T.Parallel(C, D):
                            acc1[i, jj] = acc1[i, jj] * (scale * T.exp(g_sh[j, i]))
                            dq_acc[i, jj] = dq_acc[i, jj] + acc1[i, jj]
                            acc1[i, jj] = acc1[i, jj] * T.cast(q_sh[i, jj], "float32")
                        T.reduce_sum(acc1, red, dim=1)
                        T.copy(red, r1_sh)
                        # Σ h ⊙ dH (both 64-row halves in one [64, 128] pass); dk += e^{g_l − g} ⊙ (v_new dHᵀ)
                        for i, jj in T.Parallel(C, D):
                            acc2[i, jj] = T.cast(h_sh[i, jj], "float32") * T.cast(dh_sh[i, jj], "float32") + T.cast(
                                h_sh[C + i, jj], "float32"
                            ) * T.cast(dh_sh[C + i, jj], "float32")
                        T.reduce_sum(acc2, red, dim=1)
                        T.reduce_sum(red, hdt, dim=0)
                        T.gemm(vn_sh, dh_sh, acc2, transpose_B=True, clear_accum=True)
                        if vi == 0:
                            T.barrier_wait(full_k, (t // G) % 2)
                        for i, jj in T.Parallel(C, D):
                            acc2[i, jj] = T.if_then_else(i < ln, T.exp(glast - g_sh[j, i]) * acc2[i, jj], f0)
                            dk_acc[i, jj] = dk_acc[i, jj] + acc2[i, jj]
                            acc2[i, jj] = acc2[i, jj] * T.cast(k_sh[i, jj], "float32")
                        T.reduce_sum(acc2, red, dim=1)
                        T.copy(red, r2_sh)
                        T.reduce_sum(red, r2t, dim=0)
                        # dw = −dv_new hᵀ, kept for phase B; then group A is free
                        T.barrier_wait(full_u, p)
                        T.gemm(du_sh, h_sh, acc1, transpose_B=True, clear_accum=True)
                        for i, jj in T.Parallel(C, D):
                            dw_sh[i, jj] = T.cast(-acc1[i, jj], "bfloat16")
                        T.barrier_arrive(empty_a)
                        # Z = dS ⊙ Q Kᵀ sums; dq += dS K, dk += dSᵀ Q
                        T.gemm(q_sh, k_sh, mf, transpose_B=True, clear_accum=True)
                        for i, jj in T.Parallel(C, C):
                            zf[i, jj] = zf[i, jj] * mf[i, jj]
                        T.reduce_sum(zf, zr, dim=1)
                        T.reduce_sum(zf, zc, dim=0)
                        T.copy(zr, zr_sh)
                        T.copy(zc, zc_sh)
                        T.gemm(ds_sh, k_sh, dq_acc)
                        T.gemm(ds_sh, q_sh, dk_acc, transpose_A=True)
                        if vi == G - 1:  # the item's last read of q
                            T.barrier_arrive(empty_q)
                        if tx < C:  # dg's state part of row tx
                            dga = T.if_then_else(
                                tx < ln,
                                r1_sh[tx] - r2_sh[tx] + zr_sh[tx] - zc_sh[tx]
                                + T.if_then_else(tx == ln - 1, r2t[0] + T.exp(glast) * hdt[0], f0),
                                f0,
                            )  # fmt: skip

                        # ---- phase B ----
                        T.barrier_wait(full_v, p)
                        # Γ, M = StrictLower(Γ ⊙ K Kᵀ) on valid rows
                        T.gemm(k_sh, k_sh, mf, transpose_B=True, clear_accum=True)
                        for i, jj in T.Parallel(C, C):
                            gam[i, jj] = T.if_then_else(i > jj and i < ln, T.exp(g_sh[j, i] - g_sh[j, jj]), f0)
                            mf[i, jj] = gam[i, jj] * mf[i, jj]
                            m_sh[i, jj] = T.cast(mf[i, jj], "bfloat16")
                        # issued together: dw Kᵀ, A_β M, A_βᵀ dv_new (dv)
                        T.wgmma_gemm(dw_sh, k_sh, f64, transpose_B=True, clear_accum=True)
                        T.wgmma_gemm(a_sh, m_sh, fa, clear_accum=True)
                        T.wgmma_gemm(a_sh, du_sh, acc1, transpose_A=True, clear_accum=True)
                        T.wait_wgmma(2)
                        T.warpgroup_fence_operand(f64, num_regs=C * C // 256)
                        # dA_β = dw X_wᵀ + dv_new Vᵀ (lower incl. diagonal); X_w = e^g ⊙ K on valid rows
                        for i, jj in T.Parallel(C, C):
                            f64[i, jj] = f64[i, jj] * T.if_then_else(jj < ln, T.exp(g_sh[j, jj]), f0)
                        T.wgmma_gemm(du_sh, v_sh[0, :, :], f64, transpose_B=True)
                        T.wait_wgmma(2)
                        T.warpgroup_fence_operand(fa, num_regs=C * C // 256)  # A = I − A_β M
                        for i, jj in T.Parallel(C, C):
                            ds_sh[i, jj] = T.cast(
                                T.if_then_else(i >= jj, T.if_then_else(i == jj, T.float32(1), f0) - fa[i, jj], f0), "bfloat16"
                            )
                        T.wait_wgmma(0)
                        T.warpgroup_fence_operand(acc1, num_regs=C * D // 256)
                        T.warpgroup_fence_operand(f64, num_regs=C * C // 256)
                        for i, jj in T.Parallel(C, C):
                            dab_sh[i, jj] = T.cast(T.if_then_else(i >= jj, f64[i, jj], f0), "bfloat16")
                        T.sync_threads(3, 256)  # both warpgroups' reads of v and dv_new are complete
                        T.barrier_arrive(empty_u)
                        for i, jj in T.Parallel(C, D):  # dv staged in v's buffer
                            v_sh[0, i, jj] = T.cast(acc1[i, jj], "bfloat16")
                        T.fence_proxy_async()
                        T.barrier_arrive(dv_ready)

                        # issued together: X = Aᵀ dA_β, A_βᵀ dw
                        T.wgmma_gemm(ds_sh, dab_sh, f64, transpose_A=True, clear_accum=True)
                        T.wgmma_gemm(a_sh, dw_sh, acc1, transpose_A=True, clear_accum=True)
                        T.wait_wgmma(1)
                        T.warpgroup_fence_operand(f64, num_regs=C * C // 256)  # X: dβ_j += X_jj
                        for i, jj in T.Parallel(C, C):
                            m_sh[i, jj] = T.cast(f64[i, jj], "bfloat16")
                            if i == jj:
                                diag_sh[i] = f64[i, jj]
                        # dL = −X A_βᵀ (strictly lower), issued behind A_βᵀ dw; then dk += e^g ⊙ (A_βᵀ dw),
                        # dg += rowsum(e^g (A_βᵀ dw) ⊙ K)
                        T.wgmma_gemm(m_sh, a_sh, f64, transpose_B=True, clear_accum=True)
                        T.wait_wgmma(1)
                        T.warpgroup_fence_operand(acc1, num_regs=C * D // 256)
                        for i, jj in T.Parallel(C, D):
                            acc1[i, jj] = acc1[i, jj] * T.exp(g_sh[j, i])
                            dk_acc[i, jj] = dk_acc[i, jj] + acc1[i, jj]
                            acc1[i, jj] = acc1[i, jj] * T.cast(k_sh[i, jj], "float32")
                        T.reduce_sum(acc1, red, dim=1)
                        T.copy(red, r1_sh)
                        T.wait_wgmma(0)
                        T.warpgroup_fence_operand(f64, num_regs=C * C // 256)
                        # z = dL ⊙ M; dM ⊙ Γ = β_i dL_ij Γ_ij → dk += (dM⊙Γ) K + (dM⊙Γ)ᵀ K
                        for i, jj in T.Parallel(C, C):
                            zf[i, jj] = -f64[i, jj] * mf[i, jj]
                            ds_sh[i, jj] = T.cast(-f64[i, jj] * b_sh[j, i] * gam[i, jj], "bfloat16")
                        T.barrier_arrive(empty_v)
                        T.reduce_sum(zf, zr, dim=1)
                        for i, jj in T.Parallel(C, C):
                            zf[i, jj] = zf[i, jj] * b_sh[j, i]
                        T.reduce_sum(zf, zc, dim=0)
                        T.copy(zr, zr_sh)
                        T.copy(zc, zc_sh)
                        T.gemm(ds_sh, k_sh, dk_acc)
                        T.gemm(ds_sh, k_sh, dk_acc, transpose_A=True)

                        # per row: dβ, dg on the cumsum, then the reverse cumsum (warp shuffles) → dg of the raw g
                        if tx < C:
                            sacc = T.if_then_else(tx < ln, dga + r1_sh[tx] + b_sh[j, tx] * zr_sh[tx] - zc_sh[tx], f0)
                            if tx < ln:
                                dbeta[0, bos + tx, hv] = diag_sh[tx] + zr_sh[tx]
                            for s in (1, 2, 4, 8, 16):  # every lane shuffles (full mask), the top ones add 0
                                shf = T.shfl_down(sacc, s)
                                sacc = sacc + T.if_then_else(tx % 32 + s < 32, shf, f0)
                            if tx == 32:
                                tot_sh[0] = sacc
                        if tx < 32:
                            sacc = sacc + tot_sh[0]
                        if tx < ln:
                            dg[0, bos + tx, hv] = sacc
                    # the item's dq and dk, summed over its v-heads: valid rows from the registers
                    T.barrier_arrive(empty_k)
                    bos = info_sh[(it * G + G - 1) % 2, 0]
                    ln = info_sh[(it * G + G - 1) % 2, 1]
                    for i, jj in T.Parallel(C, D):
                        if i < ln:
                            dq[0, bos + i, hk, jj] = T.cast(dq_acc[i, jj], "bfloat16")
                            dk[0, bos + i, hk, jj] = T.cast(dk_acc[i, jj], "bfloat16")
            else:
                # ---------------- WG2: producer (warp 8) ----------------
                T.set_max_nreg(RP, int(RP > NREG_LAUNCH))
                if tx < 288:
                    for t in T.serial(ntiles):
                        j = t % 2
                        p = t % 2
                        item = b + (t // G) * NP
                        c = item // h_qk
                        hk = item % h_qk
                        gi = t % G
                        hv = hk * G + gi
                        r0 = c * C
                        bos = ctab[c, 0]
                        ln = ctab[c, 1] - bos
                        T.barrier_wait(empty_a, 1 - p)
                        T.tma_copy(do[0, bos : bos + C, hv, 0:D], do_sh, barrier=full_a)
                        T.tma_copy(vnew[hv, r0 : r0 + C, 0:D], vn_sh, barrier=full_a)
                        T.tma_copy(h_all[hv, c, 0:D, 0:D], h_sh, barrier=full_a)
                        T.tma_copy(dh_all[hv, c, 0:D, 0:D], dh_sh, barrier=full_a)
                        T.tma_copy(gcs[hv, r0 : r0 + C], g_sh[j, :], barrier=full_a)
                        for u in T.serial(C // 32):
                            ii = (tx - 256) + u * 32
                            b_sh[j, ii] = T.if_then_else(ii < ln, beta[0, bos + ii, hv], f0)
                        if tx == 256:
                            info_sh[j, 0] = bos
                            info_sh[j, 1] = ln
                        T.barrier_arrive(full_a)
                        T.barrier_wait(empty_u, 1 - p)
                        T.tma_copy(dvnew[hv, r0 : r0 + C, 0:D], du_sh, barrier=full_u)
                        T.barrier_arrive(full_u)
                        if gi == 0:
                            T.barrier_wait(empty_q, 1 - (t // G) % 2)
                            T.tma_copy(q[0, bos : bos + C, hk, 0:D], q_sh, barrier=full_q)
                            T.barrier_arrive(full_q)
                            T.barrier_wait(empty_k, 1 - (t // G) % 2)
                            T.tma_copy(k[0, bos : bos + C, hk, 0:D], k_sh, barrier=full_k)
                            T.barrier_arrive(full_k)
                        T.barrier_wait(empty_v, 1 - p)
                        T.tma_copy(v[0, bos : bos + C, hv, 0:D], v_sh[0, :, :], barrier=full_v)
                        T.tma_copy(a_beta[hv, r0 : r0 + C, 0:C], a_sh, barrier=full_v)
                        T.barrier_arrive(full_v)
                elif tx < 320:
                    # ---------------- warp 9: stores dv from its staging tile ----------------
                    for t in T.serial(ntiles):
                        item = b + (t // G) * NP
                        c = item // h_qk
                        hv = (item % h_qk) * G + t % G
                        bos = ctab[c, 0]
                        ln = ctab[c, 1] - bos
                        T.barrier_wait(dv_ready, t % 2)
                        if ln == C:
                            T.copy(v_sh[0, :, :], dv[0, bos : bos + C, hv, 0:D])
                        else:
                            for i, jj in T.Parallel(C, D):
                                if i < ln:
                                    dv[0, bos + i, hv, jj] = v_sh[0, i, jj]
                        T.barrier_arrive(empty_v)

    return gdn_bwd_dqkwy_ws


@functools.cache
def get_bwd_dqkwy_kernel(h_qk: int, h_v: int, target_k=None):
    return compile_program(bwd_dqkwy_program(h_qk, h_v), target=parse_target(target_k), pass_configs=FAST_MATH)


_GRIDS = {}


def persistent_grid(ncs: int, h_qk: int, dev, num_sms=None):
    """The persistent kernel's grid argument: a kept int32 tensor (never read) whose length
    P = min(#SMs, chunk slots x qk heads) is the launch's grid (a dynamic dimension)."""
    if num_sms is None:
        num_sms = sm_count(dev)
    n = max(1, min(int(num_sms), ncs * h_qk))
    key = (n, str(dev))
    if key not in _GRIDS:
        _GRIDS[key] = torch.empty(n, device=dev, dtype=torch.int32)
    return _GRIDS[key]


def run_bwd_dqkwy(q, k, v, beta, do, gcs, a_beta, ctab, h_all, dh_all, vnew, dvnew, scale, target=None, num_sms=None):
    """Launch the persistent dq / dk / dv / dg / dβ kernel. Returns dq, dk [1,T,Hqk,128] bf16 (summed
    over each GVA group), dv [1,T,Hv,128] bf16, dg (for the raw g) and dbeta [1,T,Hv] fp32."""
    h_qk, h_v = q.shape[2], v.shape[2]
    T_, ncs = q.shape[1], ctab.shape[0]
    dev = q.device
    bf = dict(device=dev, dtype=torch.bfloat16)
    dq = torch.empty(1, T_, h_qk, HEAD_DIM, **bf)
    dk = torch.empty(1, T_, h_qk, HEAD_DIM, **bf)
    dv = torch.empty(1, T_, h_v, HEAD_DIM, **bf)
    dg = torch.empty(1, T_, h_v, device=dev, dtype=torch.float32)
    dbeta = torch.empty(1, T_, h_v, device=dev, dtype=torch.float32)
    kern = get_bwd_dqkwy_kernel(h_qk, h_v, target_key(target))
    kern(q, k, v, beta, do, gcs, a_beta, ctab, h_all, dh_all, vnew, dvnew, float(scale), dq, dk, dv, dg, dbeta,
         persistent_grid(ncs, h_qk, dev, num_sms))  # fmt: skip
    return dq, dk, dv, dg, dbeta
