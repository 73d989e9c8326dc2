"""Backward kernel 3: dq, the P / state parts of dk, dw and the dq/dk/state parts of dg
(FLA's ``chunk_bwd_dqkwg``), one CTA (128 or 256 threads) per (chunk slot, v-head), V = 128 whole;
with ``grp`` (variant ``bwd_grp=1``, the default) per (chunk slot, qk head) over its GVA group.

With h = state at the chunk start, dH = d(state at its end) (bwd_dhu), g = chunk-local cumsum,
g_l = g at the last valid row, Γ_ij = e^{g_i − g_j} (i ≥ j):

    dw   = −dv_new hᵀ                                  wgmma   → dw (bf16, chunk-slot rows)
    dq   = scale e^g ⊙ (dO hᵀ) + dS K                  wgmma ×2, dS = bf16(scale Γ ⊙ dO v_newᵀ)
    dk   = dSᵀ Q + e^{g_l − g} ⊙ (v_new dHᵀ)           wgmma ×2 (partial: bwd_wy adds the rest)
    dg_i = Σ_k (dq_inter ⊙ q)_ik + Σ_j Z_ij − Σ_j Z_ji − Σ_k (dk_state ⊙ k)_ik
           + [i = last] (Σ_i Σ_k (dk_state ⊙ k)_ik + e^{g_l} Σ h ⊙ dH),   Z = dO v_newᵀ ⊙ P

(dg here is for the cumsummed g; bwd_wy adds its part and takes the reverse cumsum.)
Loads of q, k, dO are masked to 0 past the valid rows; dq, dk rows are stored only there.
Row sums over 128 columns use ``T.reduce_sum``; the [64,64] row/column sums and the
Σ h ⊙ dH sum run per thread from shared memory.

Inputs:  q, k [1,T,Hqk,128] bf16, do [1,T,Hv,128] bf16, gcs [Hv,NCS*64] fp32, ctab [NCS,4],
         h_all, dh_all [Hv,NCS,128,128] bf16, vnew, dvnew [Hv,NCS*64,128] bf16, scale.
Outputs: dq_v, dk_v [1,T,Hv,128] fp32, or bf16 with ``bwd_bf16=1`` (per v-head; dk partial;
         [1,T,Hqk,128] summed over each GVA group with ``grp``),
         dw [Hv,NCS*64,128] bf16,
         dg_part [Hv,NCS*64] fp32 (0 on rows past the end).
"""

import functools
import json

import torch

from ._common import CHUNK, HEAD_DIM, check_heads, compile_program, target_key


def bwd_dqkwg_program(
    h_qk: int, h_v: int, threads: int = 128, rsum: bool = False, bf16_out: bool = False, grp: bool = False
):
    """threads 128 (one warpgroup) or 256 (TileLang splits every GEMM over two warpgroups).

    rsum (variant ``bwd_rsum=1``): Z's row / column sums, Σ h ⊙ dH and the last row's totals are
    fragment reductions (warp shuffles) instead of per-thread loops over shared memory (Z no
    longer goes through shared memory; the single-thread 192-step tail is gone).
    bf16_out (variant ``bwd_bf16=1``): dq_v and the dk partial are stored in bf16 (half the bytes
    of the per-v-head intermediates; one more bf16 rounding before the group sum).
    grp (variant ``bwd_grp=1``): one CTA per (chunk slot, qk head) walks the G v-heads of its GVA
    group (q and k loaded once), dq and the dk partial summed over the group in fp32 registers and
    stored once per qk head ([1,T,Hqk,128]; dq is final: no group sum after the kernels)."""
    odt = "bfloat16" if bf16_out else "float32"
    import tilelang.language as T

    HO = h_qk if grp else h_v  # heads of dq / the dk partial

    G = check_heads(h_qk, h_v)
    C, D = CHUNK, HEAD_DIM
    Tn = T.dynamic("T")
    NCS = T.dynamic("NCS")

    @T.prim_func
    def gdn_bwd_dqkwg(
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
        dq_v: T.Tensor((1, Tn, HO, D), odt),
        dk_v: T.Tensor((1, Tn, HO, D), odt),
        dw: T.Tensor((h_v, NCS * C, D), "bfloat16"),
        dg_part: T.Tensor((h_v, NCS * C), "float32"),
    ):
        with T.Kernel(NCS, HO, threads=threads) as (c, hx):
            hk = hx if grp else hx // G
            q_sh = T.alloc_shared((C, D), "bfloat16")
            k_sh = T.alloc_shared((C, D), "bfloat16")
            do_sh = T.alloc_shared((C, D), "bfloat16")
            vn_sh = T.alloc_shared((C, D), "bfloat16")
            dvn_sh = T.alloc_shared((C, D), "bfloat16")
            h_sh = T.alloc_shared((D, D), "bfloat16")
            dh_sh = T.alloc_shared((D, D), "bfloat16")
            ds_sh = T.alloc_shared((C, C), "bfloat16")
            if rsum:
                zr_sh = T.alloc_shared((C,), "float32")
                zc_sh = T.alloc_shared((C,), "float32")
                zf = T.alloc_fragment((C, C), "float32")
                zr = T.alloc_fragment((C,), "float32")
                zc = T.alloc_fragment((C,), "float32")
                hdt = T.alloc_fragment((1,), "float32")
                r2t = T.alloc_fragment((1,), "float32")
            else:
                z_sh = T.alloc_shared((C, C), "float32")
                hd_sh = T.alloc_shared((D,), "float32")
            g_sh = T.alloc_shared((C,), "float32")
            r1_sh = T.alloc_shared((C,), "float32")
            r2_sh = T.alloc_shared((C,), "float32")

            acc1 = T.alloc_fragment((C, D), "float32")
            acc2 = T.alloc_fragment((C, D), "float32")
            red = T.alloc_fragment((C,), "float32")
            dp_frag = T.alloc_fragment((C, C), "float32")
            qk_frag = T.alloc_fragment((C, C), "float32")
            glast = T.alloc_var("float32")
            sacc = T.alloc_var("float32")
            tsum = T.alloc_var("float32")
            if grp:
                dq_acc = T.alloc_fragment((C, D), "float32")
                dk_acc = T.alloc_fragment((C, D), "float32")

            bos = ctab[c, 0]
            ln = ctab[c, 1] - bos
            r0 = c * C
            tx = T.get_thread_binding()

            for i, j in T.Parallel(C, D):
                q_sh[i, j] = T.if_then_else(i < ln, q[0, bos + i, hk, j], T.bfloat16(0))
                k_sh[i, j] = T.if_then_else(i < ln, k[0, bos + i, hk, j], T.bfloat16(0))
            if grp:
                T.clear(dq_acc)
                T.clear(dk_acc)
            for gi in T.serial(G if grp else 1):
                hv = hk * G + gi if grp else hx
                for i, j in T.Parallel(C, D):
                    do_sh[i, j] = T.if_then_else(i < ln, do[0, bos + i, hv, j], T.bfloat16(0))
                T.copy(vnew[hv, r0 : r0 + C, 0:D], vn_sh)
                T.copy(dvnew[hv, r0 : r0 + C, 0:D], dvn_sh)
                T.copy(h_all[hv, c, 0:D, 0:D], h_sh)
                T.copy(dh_all[hv, c, 0:D, 0:D], dh_sh)
                T.copy(gcs[hv, r0 : r0 + C], g_sh)
                glast = g_sh[T.max(ln - 1, 0)]

                # intra-chunk attention part: dS = scale Γ ⊙ dO v_newᵀ, Z = dO v_newᵀ ⊙ P
                T.gemm(do_sh, vn_sh, dp_frag, transpose_B=True, clear_accum=True)
                T.gemm(q_sh, k_sh, qk_frag, transpose_B=True, clear_accum=True)
                if rsum:
                    for i, j in T.Parallel(C, C):
                        zf[i, j] = T.if_then_else(i >= j, scale * T.exp(g_sh[i] - g_sh[j]), T.float32(0)) * dp_frag[i, j]
                        ds_sh[i, j] = T.cast(zf[i, j], "bfloat16")
                        zf[i, j] = zf[i, j] * qk_frag[i, j]
                    T.reduce_sum(zf, zr, dim=1)
                    T.reduce_sum(zf, zc, dim=0)
                else:
                    for i, j in T.Parallel(C, C):
                        ds_sh[i, j] = T.cast(
                            T.if_then_else(i >= j, scale * T.exp(g_sh[i] - g_sh[j]) * dp_frag[i, j], T.float32(0)),
                            "bfloat16",
                        )
                        z_sh[i, j] = T.if_then_else(
                            i >= j, scale * T.exp(g_sh[i] - g_sh[j]) * dp_frag[i, j] * qk_frag[i, j], T.float32(0)
                        )

                # dw = −dv_new hᵀ
                T.gemm(dvn_sh, h_sh, acc1, transpose_B=True, clear_accum=True)
                for i, j in T.Parallel(C, D):
                    dw[hv, r0 + i, j] = T.cast(-acc1[i, j], "bfloat16")

                # dq = scale e^g ⊙ (dO hᵀ) + dS K;  dg += rowsum(dq_inter ⊙ q)
                T.gemm(do_sh, h_sh, acc1, transpose_B=True, clear_accum=True)
                for i, j in T.Parallel(C, D):
                    acc1[i, j] = acc1[i, j] * (scale * T.exp(g_sh[i]))
                    acc2[i, j] = acc1[i, j] * T.cast(q_sh[i, j], "float32")
                T.reduce_sum(acc2, red, dim=1)
                T.copy(red, r1_sh)
                T.gemm(ds_sh, k_sh, acc1)
                if grp:
                    for i, j in T.Parallel(C, D):
                        dq_acc[i, j] = dq_acc[i, j] + acc1[i, j]
                else:
                    for i, j in T.Parallel(C, D):
                        if i < ln:
                            dq_v[0, bos + i, hv, j] = T.cast(acc1[i, j], odt)

                # dk = dSᵀ Q + e^{g_l − g} ⊙ (v_new dHᵀ);  dg −= rowsum(dk_state ⊙ k)
                T.gemm(ds_sh, q_sh, acc1, transpose_A=True, clear_accum=True)
                T.gemm(vn_sh, dh_sh, acc2, transpose_B=True, clear_accum=True)
                for i, j in T.Parallel(C, D):
                    acc2[i, j] = T.if_then_else(i < ln, T.exp(glast - g_sh[i]) * acc2[i, j], T.float32(0))
                    acc1[i, j] = acc1[i, j] + acc2[i, j]
                for i, j in T.Parallel(C, D):
                    acc2[i, j] = acc2[i, j] * T.cast(k_sh[i, j], "float32")
                T.reduce_sum(acc2, red, dim=1)
                T.copy(red, r2_sh)
                if rsum:
                    T.reduce_sum(red, r2t, dim=0)
                if grp:
                    for i, j in T.Parallel(C, D):
                        dk_acc[i, j] = dk_acc[i, j] + acc1[i, j]
                else:
                    for i, j in T.Parallel(C, D):
                        if i < ln:
                            dk_v[0, bos + i, hv, j] = T.cast(acc1[i, j], odt)

                if rsum:
                    # Σ h ⊙ dH: both 64-row halves in one pass over a [64, 128] fragment, then reduced
                    for i, j in T.Parallel(C, D):
                        acc2[i, j] = T.cast(h_sh[i, j], "float32") * T.cast(dh_sh[i, j], "float32") + T.cast(
                            h_sh[C + i, j], "float32"
                        ) * T.cast(dh_sh[C + i, j], "float32")
                    T.reduce_sum(acc2, red, dim=1)
                    T.reduce_sum(red, hdt, dim=0)
                    T.copy(zr, zr_sh)
                    T.copy(zc, zc_sh)
                    if tx < C:
                        dg_part[hv, r0 + tx] = T.if_then_else(
                            tx < ln,
                            r1_sh[tx] - r2_sh[tx] + zr_sh[tx] - zc_sh[tx]
                            + T.if_then_else(tx == ln - 1, r2t[0] + T.exp(glast) * hdt[0], T.float32(0)),
                            T.float32(0),
                        )  # fmt: skip
                else:
                    # Σ h ⊙ dH: thread t sums row t (rotated columns against bank conflicts)
                    if tx < D:
                        sacc = T.float32(0)
                        for jj in T.serial(D):
                            sacc = sacc + T.cast(h_sh[tx, (jj + tx) % D], "float32") * T.cast(dh_sh[tx, (jj + tx) % D], "float32")
                        hd_sh[tx] = sacc

                    if tx < C:
                        sacc = r1_sh[tx] - r2_sh[tx]
                        for jj in T.serial(C):
                            sacc = sacc + z_sh[tx, (jj + tx) % C] - z_sh[jj, tx]
                        if tx == ln - 1:
                            tsum = T.float32(0)
                            for jj in T.serial(C):
                                tsum = tsum + r2_sh[jj]
                            sacc = sacc + tsum
                            tsum = T.float32(0)
                            for jj in T.serial(D):
                                tsum = tsum + hd_sh[jj]
                            sacc = sacc + T.exp(glast) * tsum
                        dg_part[hv, r0 + tx] = T.if_then_else(tx < ln, sacc, T.float32(0))
            if grp:
                for i, j in T.Parallel(C, D):
                    if i < ln:
                        dq_v[0, bos + i, hk, j] = T.cast(dq_acc[i, j], odt)
                        dk_v[0, bos + i, hk, j] = T.cast(dk_acc[i, j], odt)

    return gdn_bwd_dqkwg


@functools.cache
def get_bwd_dqkwg_kernel(
    h_qk: int, h_v: int, target_k=None, threads: int = 128, rsum: bool = False, bf16_out: bool = False,
    grp: bool = False,
):  # fmt: skip
    target = json.loads(target_k) if target_k and target_k.startswith("{") else target_k
    if grp:
        return compile_program(
            bwd_dqkwg_program(h_qk, h_v, threads, rsum, bf16_out, True), target=target,
            pass_configs={"tl.enable_fast_math": True} if rsum else None,
        )  # fmt: skip
    if rsum or bf16_out:
        return compile_program(
            bwd_dqkwg_program(h_qk, h_v, threads, rsum, bf16_out), target=target,
            pass_configs={"tl.enable_fast_math": True} if rsum else None,
        )  # fmt: skip
    if threads != 128:
        return compile_program(bwd_dqkwg_program(h_qk, h_v, threads), target=target)
    return compile_program(bwd_dqkwg_program(h_qk, h_v), target=target)


def run_bwd_dqkwg(
    q, k, do, gcs, ctab, h_all, dh_all, vnew, dvnew, scale, target=None, threads=128, rsum=False, bf16_out=False,
    grp=False,
):  # fmt: skip
    """Launch dqkwg. Returns dq_v, dk_v [1,T,Hv,128] fp32 (bf16 with ``bf16_out``; per v-head; dk partial;
    with ``grp`` [1,T,Hqk,128], summed over each GVA group), dw [Hv,NCS*64,128] bf16,
    dg_part [Hv,NCS*64] fp32."""
    h_qk, h_v = q.shape[2], do.shape[2]
    T_, ncs = q.shape[1], ctab.shape[0]
    dev = q.device
    odt = torch.bfloat16 if bf16_out else torch.float32
    ho = h_qk if grp else h_v
    dq_v = torch.empty(1, T_, ho, HEAD_DIM, device=dev, dtype=odt)
    dk_v = torch.empty(1, T_, ho, HEAD_DIM, device=dev, dtype=odt)
    dw = torch.empty(h_v, ncs * CHUNK, HEAD_DIM, device=dev, dtype=torch.bfloat16)
    dg_part = torch.empty(h_v, ncs * CHUNK, device=dev, dtype=torch.float32)
    kw = {"threads": threads} if threads != 128 else {}
    if rsum or bf16_out:
        kw.update(rsum=bool(rsum), bf16_out=bool(bf16_out))
    if grp:
        kw["grp"] = True
    kern = get_bwd_dqkwg_kernel(h_qk, h_v, target_key(target), **kw)
    kern(q, k, do, gcs, ctab, h_all, dh_all, vnew, dvnew, float(scale), dq_v, dk_v, dw, dg_part)
    return dq_v, dk_v, dw, dg_part
