"""Backward kernel 4: dq, dk (P and state parts), dw and dg's partial, warp-specialised and persistent.

Per (chunk, v-head) tile, with h, dH the state and its gradient at the chunk (bwd_h, bwd_dhu):

    dP = dO v_newᵀ;  dS = scale Γ ⊙ dP (causal)          dw = −dv_new hᵀ
    dq = scale e^g ⊙ (dO hᵀ) + dS K                      dk = dSᵀ Q + e^{g_l − g} ⊙ (v_new dHᵀ)
    dg (partial, on the chunk-local cumsum) from the row / column sums of dS ⊙ (Q Kᵀ), the q / k
    terms and e^{g_l} Σ h ⊙ dH (fragment reductions)

dq and dk are summed over the G v-heads of each GVA group (stored [1,T,Hqk,128] bf16).

A CTA of 384 threads stays on its SM and walks work items (chunk slot, qk head): CTA b takes items
b, b + P, b + 2P, … (P = the grid, at most one CTA per SM); tile t is v-head t % G of item t // G.

    WG0 + WG1 (tx   0..255)  consumers: every GEMM and element pass of a tile (GEMMs split over the
                             two warpgroups); dq and dk summed over the item's G v-heads in fp32
                             registers, dS summed over them too (one dS K / dSᵀ Q pair per item)
    WG2       (tx 256..383)  warp 8, the producer, TMA loads in this order per tile: dO, v_new,
                             dv_new and g (two stages), h, dH (one buffer each, reloaded as soon as
                             the consumers are done with them), then q, k (one buffer, per item).
                             warp 9, the store warp: dw (staged in dv_new's buffer after its last
                             read) by TMA; dq, dk (staged in q's and k's buffers after the item's last
                             read) by TMA when the chunk is full, else per-row stores of valid rows

The consumers order a tile so that what arrives last is needed last: dP = dO v_newᵀ → dS; h: dw,
dO hᵀ; h and dH: Σ h ⊙ dH; dH: v_new dHᵀ (h and dH released here); then q, k: Q Kᵀ (once per item),
the Z sums, and on the item's last tile (Σ dS) K, (Σ dS)ᵀ Q.

Rows past a chunk's valid length: the TMA loads of q, k, dO are not masked (the next sequence's
rows, or zeros past T); dS and the dk state part are masked to the valid rows, and dq, dk, dg rows
are stored only there, so those rows reach no output (dw's rows there are −dv_new hᵀ = 0: dv_new
is zero past the valid rows).

mbarriers: full_t[j] / empty_t[j] (stage j = t % 2, parity (t // 2) % 2; empty_t counts the 256
consumer threads and the store warp), full_h / empty_h and full_dh / empty_dh (parity t % 2),
full_qk / empty_qk (parity (t // G) % 2; empty_qk: the store warp, once dq / dk are out),
dw_ready[j], dqk_ready (the consumers, once staged). full_* count 32 (the producer warp) + tx bytes.

dqk_ready, the per-item dq / dk hand-off, cannot be lapped: the consumers need the next item's q, k,
which wait on empty_qk, which the store warp arrives after its dq / dk stores.
"""

import functools

import torch

from ._common import CHUNK, FAST_MATH, HEAD_DIM, check_heads, compile_program, parse_target, target_key
from .bwd_wy import NREG, NREG_LAUNCH, THREADS, persistent_grid, rows_store_macro


def bwd_dqkwg_program(h_qk: int, h_v: int):
    """The prim_func ``gdn_bwd_dqkwg_ws``."""
    import tilelang.language as T

    G = check_heads(h_qk, h_v)
    C, D = CHUNK, HEAD_DIM
    Tn = T.dynamic("T")
    NCS = T.dynamic("NCS")
    NP = T.dynamic("NP")
    RC, RP = NREG
    store_rows = rows_store_macro(C, D)

    @T.prim_func
    def gdn_bwd_dqkwg_ws(
        q: T.Tensor((1, Tn, h_qk, D), "bfloat16"),
        k: T.Tensor((1, Tn, h_qk, D), "bfloat16"),
        do: T.Tensor((1, Tn, h_v, D), "bfloat16"),
        gcs: T.Tensor((h_v, NCS * C), "float32"),
        ctab: T.Tensor((NCS, 4), "int32"),
        h_all: T.Tensor((h_v, NCS, D, D), "bfloat16"),
        dh_all: T.Tensor((h_v, NCS, D, D), "bfloat16"),
        vnew: T.Tensor((h_v, NCS * C, D), "bfloat16"),
        dvnew: T.Tensor((h_v, NCS * C, D), "bfloat16"),
        scale: T.float32,
        dq_v: T.Tensor((1, Tn, h_qk, D), "bfloat16"),
        dk_v: T.Tensor((1, Tn, h_qk, D), "bfloat16"),
        dw: T.Tensor((h_v, NCS * C, D), "bfloat16"),
        dg_part: T.Tensor((h_v, NCS * C), "float32"),
        grid: T.Tensor((NP,), "int32"),
    ):
        with T.Kernel(NP, threads=THREADS) as b:
            do_sh = T.alloc_shared((2, C, D), "bfloat16")
            vn_sh = T.alloc_shared((2, C, D), "bfloat16")
            dvn_sh = T.alloc_shared((2, C, D), "bfloat16")
            g_sh = T.alloc_shared((2, C), "float32")
            info_sh = T.alloc_shared((2, 2), "int32")
            h_sh = T.alloc_shared((D, D), "bfloat16")
            dh_sh = T.alloc_shared((D, D), "bfloat16")
            q_sh = T.alloc_shared((1, C, D), "bfloat16")  # then dq on its way out
            k_sh = T.alloc_shared((1, C, D), "bfloat16")  # then dk on its way out
            ds_sh = T.alloc_shared((C, C), "bfloat16")
            r1_sh = T.alloc_shared((C,), "float32")
            r2_sh = T.alloc_shared((C,), "float32")
            zr_sh = T.alloc_shared((C,), "float32")
            zc_sh = T.alloc_shared((C,), "float32")

            zf = T.alloc_fragment((C, C), "float32")
            qk_frag = T.alloc_fragment((C, C), "float32")  # Q Kᵀ, once per item
            ds_acc = T.alloc_fragment((C, C), "float32")  # Σ over the group of dS
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

            full_t = T.alloc_barrier([32, 32])
            empty_t = T.alloc_barrier([288, 288])  # the consumers and the store warp
            full_h = T.alloc_barrier(32)
            empty_h = T.alloc_barrier(256)
            full_dh = T.alloc_barrier(32)
            empty_dh = T.alloc_barrier(256)
            full_qk = T.alloc_barrier(32)
            empty_qk = T.alloc_barrier(32)  # the store warp, once dq and dk (staged there) are out
            dw_ready = T.alloc_barrier([256, 256])
            dqk_ready = T.alloc_barrier(256)

            ntiles = T.ceildiv(NCS * h_qk - b, NP) * G
            tx = T.get_thread_binding()

            if tx < 256:
                # ---------------- WG0 + WG1: consumers ----------------
                T.set_max_nreg(RC, int(RC > NREG_LAUNCH))
                for t in T.serial(ntiles):
                    j = t % 2
                    item = b + (t // G) * NP
                    c = item // h_qk
                    hk = item % h_qk
                    gi = t % G
                    hv = hk * G + gi
                    r0 = c * C
                    T.barrier_wait(full_t[j], (t // 2) % 2)
                    bos = info_sh[j, 0]
                    ln = info_sh[j, 1]
                    glast = g_sh[j, T.max(ln - 1, 0)]
                    if gi == 0:
                        T.clear(dq_acc)
                        T.clear(dk_acc)
                        T.clear(ds_acc)

                    # dS = scale Γ ⊙ dO v_newᵀ (valid rows, i ≥ j)
                    T.gemm(do_sh[j, :, :], vn_sh[j, :, :], zf, transpose_B=True, clear_accum=True)
                    for i, jj in T.Parallel(C, C):
                        zf[i, jj] = T.if_then_else(
                            i >= jj and i < ln, scale * T.exp(g_sh[j, i] - g_sh[j, jj]), T.float32(0)
                        ) * zf[i, jj]
                        ds_acc[i, jj] = ds_acc[i, jj] + zf[i, jj]

                    # h: dw = −dv_new hᵀ;  dq_inter = scale e^g ⊙ (dO hᵀ)
                    T.barrier_wait(full_h, t % 2)
                    T.gemm(dvn_sh[j, :, :], h_sh, acc1, transpose_B=True, clear_accum=True)
                    for i, jj in T.Parallel(C, D):  # staged in dv_new's buffer (read for the last time above)
                        dvn_sh[j, i, jj] = T.cast(-acc1[i, jj], "bfloat16")
                    T.fence_proxy_async()
                    T.barrier_arrive(dw_ready[j])
                    T.gemm(do_sh[j, :, :], h_sh, acc1, transpose_B=True, clear_accum=True)
                    for i, jj in T.Parallel(C, D):
                        acc1[i, jj] = acc1[i, jj] * (scale * T.exp(g_sh[j, i]))

                    # h and dH: Σ h ⊙ dH (both 64-row halves in one [64, 128] pass); dH: v_new dHᵀ
                    T.barrier_wait(full_dh, t % 2)
                    for i, jj in T.Parallel(C, D):
                        acc2[i, jj] = T.cast(h_sh[i, jj], "float32") * T.cast(dh_sh[i, jj], "float32") + T.cast(
                            h_sh[C + i, jj], "float32"
                        ) * T.cast(dh_sh[C + i, jj], "float32")
                    T.reduce_sum(acc2, red, dim=1)
                    T.reduce_sum(red, hdt, dim=0)
                    T.barrier_arrive(empty_h)
                    T.gemm(vn_sh[j, :, :], dh_sh, acc2, transpose_B=True, clear_accum=True)
                    T.barrier_arrive(empty_dh)
                    for i, jj in T.Parallel(C, D):
                        acc2[i, jj] = T.if_then_else(i < ln, T.exp(glast - g_sh[j, i]) * acc2[i, jj], T.float32(0))

                    # q, k: Z = dS ⊙ Q Kᵀ sums; dq += dq_inter;  dk += dk_state;  after the group's last
                    # v-head dq += (Σ dS) K, dk += (Σ dS)ᵀ Q
                    if gi == 0:
                        T.barrier_wait(full_qk, (t // G) % 2)
                        T.gemm(q_sh[0, :, :], k_sh[0, :, :], qk_frag, transpose_B=True, clear_accum=True)
                    for i, jj in T.Parallel(C, C):
                        zf[i, jj] = zf[i, jj] * qk_frag[i, jj]
                    T.reduce_sum(zf, zr, dim=1)
                    T.reduce_sum(zf, zc, dim=0)
                    for i, jj in T.Parallel(C, D):
                        dq_acc[i, jj] = dq_acc[i, jj] + acc1[i, jj]
                        acc1[i, jj] = acc1[i, jj] * T.cast(q_sh[0, i, jj], "float32")
                    T.reduce_sum(acc1, red, dim=1)
                    T.copy(red, r1_sh)
                    for i, jj in T.Parallel(C, D):
                        dk_acc[i, jj] = dk_acc[i, jj] + acc2[i, jj]
                        acc2[i, jj] = acc2[i, jj] * T.cast(k_sh[0, i, jj], "float32")
                    T.reduce_sum(acc2, red, dim=1)
                    T.copy(red, r2_sh)
                    T.reduce_sum(red, r2t, dim=0)
                    if gi == G - 1:
                        for i, jj in T.Parallel(C, C):
                            ds_sh[i, jj] = T.cast(ds_acc[i, jj], "bfloat16")
                        T.gemm(ds_sh, k_sh[0, :, :], dq_acc)
                        T.gemm(ds_sh, q_sh[0, :, :], dk_acc, transpose_A=True)
                        for i, jj in T.Parallel(C, D):  # staged in q's and k's buffers
                            q_sh[0, i, jj] = T.cast(dq_acc[i, jj], "bfloat16")
                            k_sh[0, i, jj] = T.cast(dk_acc[i, jj], "bfloat16")
                        T.fence_proxy_async()
                        T.barrier_arrive(dqk_ready[0])

                    T.copy(zr, zr_sh)
                    T.copy(zc, zc_sh)
                    if tx < C:
                        dg_part[hv, r0 + tx] = T.if_then_else(
                            tx < ln,
                            r1_sh[tx] - r2_sh[tx] + zr_sh[tx] - zc_sh[tx]
                            + T.if_then_else(tx == ln - 1, r2t[0] + T.exp(glast) * hdt[0], T.float32(0)),
                            T.float32(0),
                        )  # fmt: skip
                    T.barrier_arrive(empty_t[j])
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
                        bos = ctab[c, 0]
                        T.barrier_wait(empty_t[j], 1 - (t // 2) % 2)
                        T.tma_copy(do[0, bos : bos + C, hv, 0:D], do_sh[j, :, :], barrier=full_t[j])
                        T.tma_copy(vnew[hv, r0 : r0 + C, 0:D], vn_sh[j, :, :], barrier=full_t[j])
                        T.tma_copy(dvnew[hv, r0 : r0 + C, 0:D], dvn_sh[j, :, :], barrier=full_t[j])
                        T.tma_copy(gcs[hv, r0 : r0 + C], g_sh[j, :], barrier=full_t[j])
                        if tx == 256:
                            info_sh[j, 0] = bos
                            info_sh[j, 1] = ctab[c, 1] - bos
                        T.barrier_arrive(full_t[j])
                        T.barrier_wait(empty_h, 1 - t % 2)
                        T.tma_copy(h_all[hv, c, 0:D, 0:D], h_sh, barrier=full_h)
                        T.barrier_arrive(full_h)
                        T.barrier_wait(empty_dh, 1 - t % 2)
                        T.tma_copy(dh_all[hv, c, 0:D, 0:D], dh_sh, barrier=full_dh)
                        T.barrier_arrive(full_dh)
                        if gi == 0:
                            T.barrier_wait(empty_qk, 1 - (t // G) % 2)
                            T.tma_copy(q[0, bos : bos + C, hk, 0:D], q_sh[0, :, :], barrier=full_qk)
                            T.tma_copy(k[0, bos : bos + C, hk, 0:D], k_sh[0, :, :], barrier=full_qk)
                            T.barrier_arrive(full_qk)
                elif tx < 320:
                    # ---------------- warp 9: stores dw, dq, dk from the staged tiles ----------------
                    for t in T.serial(ntiles):
                        j = t % 2
                        item = b + (t // G) * NP
                        c = item // h_qk
                        hk = item % h_qk
                        gi = t % G
                        hv = hk * G + gi
                        r0 = c * C
                        T.barrier_wait(dw_ready[j], (t // 2) % 2)
                        T.copy(dvn_sh[j, :, :], dw[hv, r0 : r0 + C, 0:D])  # a slot's rows are its own
                        if gi == G - 1:
                            T.barrier_wait(dqk_ready[0], (t // G) % 2)
                            bos = info_sh[j, 0]
                            ln = info_sh[j, 1]
                            store_rows(q_sh, 0, dq_v, bos, ln, hk)
                            store_rows(k_sh, 0, dk_v, bos, ln, hk)
                            T.barrier_arrive(empty_qk)
                        T.barrier_arrive(empty_t[j])

    return gdn_bwd_dqkwg_ws


@functools.cache
def get_bwd_dqkwg_kernel(h_qk: int, h_v: int, target_k=None):
    return compile_program(bwd_dqkwg_program(h_qk, h_v), target=parse_target(target_k), pass_configs=FAST_MATH)


def run_bwd_dqkwg(q, k, do, gcs, ctab, h_all, dh_all, vnew, dvnew, scale, target=None, num_sms=None):
    """Launch the persistent dqkwg. Returns dq_v, dk_v [1,T,Hqk,128] bf16 (summed over each GVA group;
    dk_v is the partial bwd_wy completes), dw [Hv,NCS*64,128] bf16, dg_part [Hv,NCS*64] fp32."""
    h_qk, h_v = q.shape[2], do.shape[2]
    T_, ncs = q.shape[1], ctab.shape[0]
    dev = q.device
    dq_v = torch.empty(1, T_, h_qk, HEAD_DIM, device=dev, dtype=torch.bfloat16)
    dk_v = torch.empty(1, T_, h_qk, HEAD_DIM, device=dev, dtype=torch.bfloat16)
    dw = torch.empty(h_v, ncs * CHUNK, HEAD_DIM, device=dev, dtype=torch.bfloat16)
    dg_part = torch.empty(h_v, ncs * CHUNK, device=dev, dtype=torch.float32)
    kern = get_bwd_dqkwg_kernel(h_qk, h_v, target_key(target))
    kern(q, k, do, gcs, ctab, h_all, dh_all, vnew, dvnew, float(scale), dq_v, dk_v, dw, dg_part,
         persistent_grid(ncs, h_qk, dev, num_sms))  # fmt: skip
    return dq_v, dk_v, dw, dg_part
