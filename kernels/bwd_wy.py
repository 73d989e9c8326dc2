"""Backward kernel 4: back-propagation through w, u and A (FLA's ``prepare_wy_repr_bwd``),
finishing dk, dv, dβ and dg (with the reverse in-chunk cumsum). One CTA (128 or 256 threads) per
(chunk slot, v-head), or with ``grp`` (variant ``bwd_grp=1``, the default) per (chunk slot, qk head)
over its GVA group. With X_w = e^g ⊙ K, w = A_β X_w, u = A_β V, A_β = A diag(β),
A = (I + diag(β) M)⁻¹, M = StrictLower(Γ ⊙ K Kᵀ):

    dA_β = dw X_wᵀ + du Vᵀ   (lower incl. diagonal)                  wgmma ×2   (du = dv_new)
    dv   = A_βᵀ du                                                   wgmma      → dv (bf16)
    A    = I − A_β M          (A (I + diag(β) M) = I; A not saved)   wgmma
    X    = Aᵀ dA_β:  dβ_j += X_jj                                    wgmma
    dL   = −X A_βᵀ (i > j):  dβ_i += Σ_j dL_ij M_ij;  dM = β_i dL     wgmma
    dk   = e^g ⊙ (A_βᵀ dw) + (dM⊙Γ) K + (dM⊙Γ)ᵀ K + dk_part          wgmma ×3
    dg   = rowsum(e^g ⊙ (A_βᵀ dw) ⊙ K) + rowsum(dM⊙M) − colsum(dM⊙M) + dg_part,
           then the reverse cumsum inside the chunk (→ dg of the raw g)

Inputs:  k [1,T,Hqk,128], v [1,T,Hv,128] bf16, beta [1,T,Hv] fp32, gcs, a_beta (forward prep),
         dw [Hv,NCS*64,128] bf16, dvnew [Hv,NCS*64,128] bf16, dg_part [Hv,NCS*64] fp32, ctab.
In/out:  dk_v [1,T,Hv,128] fp32, or bf16 with ``bwd_bf16=1`` (partial from bwd_dqkwg in, complete
         out; valid rows; [1,T,Hqk,128] summed over each GVA group with ``grp``).
Outputs: dv [1,T,Hv,128] bf16, dg [1,T,Hv] fp32, dbeta [1,T,Hv] fp32 (valid rows).
"""

import functools
import json

import torch

from ._common import CHUNK, HEAD_DIM, check_heads, compile_program, target_key


def bwd_wy_program(h_qk: int, h_v: int, threads: int = 128, bf16_dk: bool = False, grp: bool = False):
    """threads 128 (one warpgroup) or 256 (TileLang splits every GEMM over two warpgroups).
    bf16_dk (variant ``bwd_bf16=1``): the per-v-head dk it completes in place is bf16 (from
    bwd_dqkwg's bf16 partial; the sum with this kernel's part is formed in fp32 and rounded to bf16,
    the GVA group sum then adds those in fp32).
    grp (variant ``bwd_grp=1``): one CTA per (chunk slot, qk head) walks the G v-heads of its group
    (k loaded once); dk_v is [1,T,Hqk,128], bwd_dqkwg's group-summed partial in, the complete dk out
    (this kernel's parts summed over the group in fp32 registers, added to the partial in fp32, the sum
    rounded to dk_v's dtype once)."""
    kdt = "bfloat16" if bf16_dk else "float32"
    import tilelang.language as T

    HO = h_qk if grp else h_v  # heads of dk_v

    G = check_heads(h_qk, h_v)
    C, D = CHUNK, HEAD_DIM
    Tn = T.dynamic("T")
    NCS = T.dynamic("NCS")

    @T.prim_func
    def gdn_bwd_wy(
        k: T.Tensor((1, Tn, h_qk, D), "bfloat16"),
        v: T.Tensor((1, Tn, h_v, D), "bfloat16"),
        beta: T.Tensor((1, Tn, h_v), "float32"),
        gcs: T.Tensor((h_v, NCS * C), "float32"),
        a_beta: T.Tensor((h_v, NCS * C, C), "bfloat16"),
        ctab: T.Tensor((NCS, 4), "int32"),
        dw: T.Tensor((h_v, NCS * C, D), "bfloat16"),
        dvnew: T.Tensor((h_v, NCS * C, D), "bfloat16"),
        dg_part: T.Tensor((h_v, NCS * C), "float32"),
        dk_v: T.Tensor((1, Tn, HO, D), kdt),
        dv: T.Tensor((1, Tn, h_v, D), "bfloat16"),
        dg: T.Tensor((1, Tn, h_v), "float32"),
        dbeta: T.Tensor((1, Tn, h_v), "float32"),
    ):
        with T.Kernel(NCS, HO, threads=threads) as (c, hx):
            hk = hx if grp else hx // G
            k_sh = T.alloc_shared((C, D), "bfloat16")
            v_sh = T.alloc_shared((C, D), "bfloat16")
            xw_sh = T.alloc_shared((C, D), "bfloat16")
            dw_sh = T.alloc_shared((C, D), "bfloat16")
            du_sh = T.alloc_shared((C, D), "bfloat16")
            a_sh = T.alloc_shared((C, C), "bfloat16")
            m_sh = T.alloc_shared((C, C), "bfloat16")
            aa_sh = T.alloc_shared((C, C), "bfloat16")
            dab_sh = T.alloc_shared((C, C), "bfloat16")
            x_sh = T.alloc_shared((C, C), "bfloat16")
            dkk_sh = T.alloc_shared((C, C), "bfloat16")
            mf_sh = T.alloc_shared((C, C), "float32")
            z_sh = T.alloc_shared((C, C), "float32")
            g_sh = T.alloc_shared((C,), "float32")
            b_sh = T.alloc_shared((C,), "float32")
            diag_sh = T.alloc_shared((C,), "float32")
            r1_sh = T.alloc_shared((C,), "float32")
            dgc_sh = T.alloc_shared((C,), "float32")

            acc1 = T.alloc_fragment((C, D), "float32")
            acc2 = T.alloc_fragment((C, D), "float32")
            red = T.alloc_fragment((C,), "float32")
            f64 = T.alloc_fragment((C, C), "float32")
            sacc = T.alloc_var("float32")
            bsum = T.alloc_var("float32")
            if grp:
                dk_acc = T.alloc_fragment((C, D), "float32")

            bos = ctab[c, 0]
            ln = ctab[c, 1] - bos
            r0 = c * C
            tx = T.get_thread_binding()

            for i, j in T.Parallel(C, D):
                k_sh[i, j] = T.if_then_else(i < ln, k[0, bos + i, hk, j], T.bfloat16(0))
            if grp:
                T.clear(dk_acc)
            for gi in T.serial(G if grp else 1):
                hv = hk * G + gi if grp else hx
                for i, j in T.Parallel(C, D):
                    v_sh[i, j] = T.if_then_else(i < ln, v[0, bos + i, hv, j], T.bfloat16(0))
                for i in T.Parallel(C):
                    b_sh[i] = T.if_then_else(i < ln, beta[0, bos + i, hv], T.float32(0))
                T.copy(dw[hv, r0 : r0 + C, 0:D], dw_sh)
                T.copy(dvnew[hv, r0 : r0 + C, 0:D], du_sh)
                T.copy(a_beta[hv, r0 : r0 + C, 0:C], a_sh)
                T.copy(gcs[hv, r0 : r0 + C], g_sh)
                for i, j in T.Parallel(C, D):
                    xw_sh[i, j] = T.cast(T.exp(g_sh[i]) * T.cast(k_sh[i, j], "float32"), "bfloat16")

                # dA_β = dw X_wᵀ + du Vᵀ (lower incl. diagonal)
                T.gemm(dw_sh, xw_sh, f64, transpose_B=True, clear_accum=True)
                T.gemm(du_sh, v_sh, f64, transpose_B=True)
                for i, j in T.Parallel(C, C):
                    dab_sh[i, j] = T.cast(T.if_then_else(i >= j, f64[i, j], T.float32(0)), "bfloat16")

                # dv = A_βᵀ du
                T.gemm(a_sh, du_sh, acc1, transpose_A=True, clear_accum=True)
                for i, j in T.Parallel(C, D):
                    if i < ln:
                        dv[0, bos + i, hv, j] = T.cast(acc1[i, j], "bfloat16")

                # M = StrictLower(Γ ⊙ K Kᵀ);  A = I − A_β M
                T.gemm(k_sh, k_sh, f64, transpose_B=True, clear_accum=True)
                for i, j in T.Parallel(C, C):
                    mf_sh[i, j] = T.if_then_else(i > j, T.exp(g_sh[i] - g_sh[j]) * f64[i, j], T.float32(0))
                    m_sh[i, j] = T.cast(mf_sh[i, j], "bfloat16")
                T.gemm(a_sh, m_sh, f64, clear_accum=True)
                for i, j in T.Parallel(C, C):
                    eye = T.if_then_else(i == j, T.float32(1), T.float32(0))
                    aa_sh[i, j] = T.cast(T.if_then_else(i >= j, eye - f64[i, j], T.float32(0)), "bfloat16")

                # X = Aᵀ dA_β: dβ_j += X_jj
                T.gemm(aa_sh, dab_sh, f64, transpose_A=True, clear_accum=True)
                for i, j in T.Parallel(C, C):
                    x_sh[i, j] = T.cast(f64[i, j], "bfloat16")
                    if i == j:
                        diag_sh[i] = f64[i, j]

                # dL = −X A_βᵀ (strictly lower); z = dL ⊙ M; dM ⊙ Γ = β_i dL_ij Γ_ij
                T.gemm(x_sh, a_sh, f64, transpose_B=True, clear_accum=True)
                for i, j in T.Parallel(C, C):
                    z_sh[i, j] = T.if_then_else(i > j, -f64[i, j] * mf_sh[i, j], T.float32(0))
                    dkk_sh[i, j] = T.cast(
                        T.if_then_else(i > j, -f64[i, j] * b_sh[i] * T.exp(g_sh[i] - g_sh[j]), T.float32(0)),
                        "bfloat16",
                    )

                # dk = e^g ⊙ (A_βᵀ dw) + (dM⊙Γ) K + (dM⊙Γ)ᵀ K + dk_part;  dg += rowsum(e^g (A_βᵀ dw) ⊙ K)
                T.gemm(a_sh, dw_sh, acc1, transpose_A=True, clear_accum=True)
                for i, j in T.Parallel(C, D):
                    acc1[i, j] = acc1[i, j] * T.exp(g_sh[i])
                    acc2[i, j] = acc1[i, j] * T.cast(k_sh[i, j], "float32")
                T.reduce_sum(acc2, red, dim=1)
                T.copy(red, r1_sh)
                T.gemm(dkk_sh, k_sh, acc1)
                T.gemm(dkk_sh, k_sh, acc1, transpose_A=True)
                if grp:
                    for i, j in T.Parallel(C, D):
                        dk_acc[i, j] = dk_acc[i, j] + acc1[i, j]
                else:
                    for i, j in T.Parallel(C, D):
                        if i < ln:
                            dk_v[0, bos + i, hv, j] = T.cast(T.cast(dk_v[0, bos + i, hv, j], "float32") + acc1[i, j], kdt)

                # per row: dβ, dg on the cumsum, then reverse cumsum → dg of the raw g
                if tx < C:
                    sacc = T.float32(0)
                    bsum = T.float32(0)
                    for jj in T.serial(C):
                        sacc = sacc + z_sh[tx, (jj + tx) % C]
                        bsum = bsum + b_sh[jj] * z_sh[jj, tx]
                    dgc_sh[tx] = T.if_then_else(
                        tx < ln, r1_sh[tx] + b_sh[tx] * sacc - bsum + dg_part[hv, r0 + tx], T.float32(0)
                    )
                    if tx < ln:
                        dbeta[0, bos + tx, hv] = diag_sh[tx] + sacc
                if tx < C:
                    sacc = T.float32(0)
                    for jj in T.serial(C):
                        sacc = sacc + T.if_then_else(jj >= tx, dgc_sh[jj], T.float32(0))
                    if tx < ln:
                        dg[0, bos + tx, hv] = sacc
            if grp:
                for i, j in T.Parallel(C, D):
                    if i < ln:
                        dk_v[0, bos + i, hk, j] = T.cast(T.cast(dk_v[0, bos + i, hk, j], "float32") + dk_acc[i, j], kdt)

    return gdn_bwd_wy


@functools.cache
def get_bwd_wy_kernel(h_qk: int, h_v: int, target_k=None, threads: int = 128, bf16_dk: bool = False, grp: bool = False):
    target = json.loads(target_k) if target_k and target_k.startswith("{") else target_k
    if grp:
        return compile_program(bwd_wy_program(h_qk, h_v, threads, bf16_dk, True), target=target)
    if bf16_dk:
        return compile_program(bwd_wy_program(h_qk, h_v, threads, True), target=target)
    if threads != 128:
        return compile_program(bwd_wy_program(h_qk, h_v, threads), target=target)
    return compile_program(bwd_wy_program(h_qk, h_v), target=target)


def run_bwd_wy(
    k, v, beta, gcs, a_beta, ctab, dw, dvnew, dg_part, dk_v, dv=None, dg=None, dbeta=None, target=None, threads=128,
    grp=False,
):  # fmt: skip
    """Launch the WY backward. dk_v is updated in place (partial → complete; [1,T,Hqk,128] summed over
    each GVA group with ``grp``, else per v-head).
    Returns dk_v, dv [1,T,Hv,128] bf16, dg, dbeta [1,T,Hv] fp32."""
    h_qk, h_v = k.shape[2], v.shape[2]
    T_ = k.shape[1]
    dev = k.device
    if dv is None:
        dv = torch.empty(1, T_, h_v, HEAD_DIM, device=dev, dtype=torch.bfloat16)
    if dg is None:
        dg = torch.empty(1, T_, h_v, device=dev, dtype=torch.float32)
    if dbeta is None:
        dbeta = torch.empty(1, T_, h_v, device=dev, dtype=torch.float32)
    kw = {"threads": threads} if threads != 128 else {}
    if dk_v.dtype == torch.bfloat16:
        kw["bf16_dk"] = True
    if grp:
        kw["grp"] = True
    kern = get_bwd_wy_kernel(h_qk, h_v, target_key(target), **kw)
    kern(k, v, beta, gcs, a_beta, ctab, dw, dvnew, dg_part, dk_v, dv, dg, dbeta)
    return dk_v, dv, dg, dbeta
