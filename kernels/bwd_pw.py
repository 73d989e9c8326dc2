"""Backward kernel 2: the dH-independent matrices of the reverse chain, once per (chunk slot,
v-head) and in parallel, so that bwd_dhu's chain does not rebuild them in each of its V blocks.

With g = chunk-local cumsum, ln = valid rows of the chunk, g_l = g[ln − 1]:

    Pᵀ[j, i] = scale e^{g_i − g_j} (K Qᵀ)[j, i]   for j ≤ i < ln, else 0      wgmma  → pt (bf16)
    W'       = A_βᵀ bf16(e^{g_l − g} ⊙ K)          (rows ≥ ln of the factor 0)   wgmma  → w (bf16)

(bf16 rounding points as ``tools/kernels/emulate_bwd.emu_bwd_dhu(uw=True)``.)
One CTA (128 threads) per (chunk slot, qk head): q, k and K Qᵀ once, then each v-head of the GVA
group (its g and A_β); unused slots (ln ≤ 0) get zeros.

Inputs:  q, k [1,T,Hqk,128] bf16, gcs [Hv,NCS*64] fp32, a_beta [Hv,NCS*64,64] bf16, ctab [NCS,4], scale.
Outputs: pt [Hv,NCS*64,64] bf16, w [Hv,NCS*64,128] bf16 (chunk-slot rows, as a_beta).
"""

import functools

import torch

from ._common import CHUNK, FAST_MATH, HEAD_DIM, check_heads, compile_program, parse_target, target_key


def bwd_pw_program(h_qk: int, h_v: int):
    import tilelang.language as T

    G = check_heads(h_qk, h_v)
    C, D = CHUNK, HEAD_DIM
    Tn = T.dynamic("T")
    NCS = T.dynamic("NCS")

    @T.prim_func
    def gdn_bwd_pw(
        q: T.Tensor((1, Tn, h_qk, D), "bfloat16"),
        k: T.Tensor((1, Tn, h_qk, D), "bfloat16"),
        gcs: T.Tensor((h_v, NCS * C), "float32"),
        a_beta: T.Tensor((h_v, NCS * C, C), "bfloat16"),
        ctab: T.Tensor((NCS, 4), "int32"),
        scale: T.float32,
        pt: T.Tensor((h_v, NCS * C, C), "bfloat16"),
        w: T.Tensor((h_v, NCS * C, D), "bfloat16"),
    ):
        with T.Kernel(NCS, h_qk, threads=128) as (c, hk):
            q_sh = T.alloc_shared((C, D), "bfloat16")
            k_sh = T.alloc_shared((C, D), "bfloat16")
            ek_sh = T.alloc_shared((C, D), "bfloat16")
            a_sh = T.alloc_shared((C, C), "bfloat16")
            pt_sh = T.alloc_shared((C, C), "bfloat16")
            w_sh = T.alloc_shared((C, D), "bfloat16")
            g_sh = T.alloc_shared((C,), "float32")
            kq_frag = T.alloc_fragment((C, C), "float32")
            w_frag = T.alloc_fragment((C, D), "float32")

            bos = ctab[c, 0]
            ln = ctab[c, 1] - bos
            r0 = c * C
            # rows past the chunk's end are masked below (zero factors), so plain loads suffice;
            # the guard keeps unused slots (bos may be anything there) in bounds
            for i, j in T.Parallel(C, D):
                q_sh[i, j] = T.if_then_else(i < ln, q[0, bos + i, hk, j], T.bfloat16(0))
                k_sh[i, j] = T.if_then_else(i < ln, k[0, bos + i, hk, j], T.bfloat16(0))
            T.gemm(k_sh, q_sh, kq_frag, transpose_B=True, clear_accum=True)  # once per GVA group
            for gi in T.serial(G):
                hv = hk * G + gi
                T.copy(a_beta[hv, r0 : r0 + C, 0:C], a_sh)
                T.copy(gcs[hv, r0 : r0 + C], g_sh)
                for jr, i in T.Parallel(C, C):
                    pt_sh[jr, i] = T.cast(
                        T.if_then_else(
                            i >= jr and i < ln, scale * T.exp(g_sh[i] - g_sh[jr]) * kq_frag[jr, i], T.float32(0)
                        ),
                        "bfloat16",
                    )
                for i, kk in T.Parallel(C, D):
                    ek_sh[i, kk] = T.cast(
                        T.if_then_else(i < ln, T.exp(g_sh[T.max(ln - 1, 0)] - g_sh[i]), T.float32(0))
                        * T.cast(k_sh[i, kk], "float32"),
                        "bfloat16",
                    )
                T.gemm(a_sh, ek_sh, w_frag, transpose_A=True, clear_accum=True)
                T.copy(w_frag, w_sh)
                T.copy(pt_sh, pt[hv, r0 : r0 + C, 0:C])
                T.copy(w_sh, w[hv, r0 : r0 + C, 0:D])

    return gdn_bwd_pw


@functools.cache
def get_bwd_pw_kernel(h_qk: int, h_v: int, target_k=None):
    return compile_program(bwd_pw_program(h_qk, h_v), target=parse_target(target_k), pass_configs=FAST_MATH)


def run_bwd_pw(q, k, gcs, a_beta, ctab, scale, target=None):
    """Launch bwd_pw. Returns pt [Hv,NCS*64,64] and w [Hv,NCS*64,128] (bf16)."""
    h_qk, h_v = q.shape[2], gcs.shape[0]
    ncs = ctab.shape[0]
    bf = dict(device=q.device, dtype=torch.bfloat16)
    pt = torch.empty(h_v, ncs * CHUNK, CHUNK, **bf)
    w = torch.empty(h_v, ncs * CHUNK, HEAD_DIM, **bf)
    kern = get_bwd_pw_kernel(h_qk, h_v, target_key(target))
    kern(q, k, gcs, a_beta, ctab, float(scale), pt, w)
    return pt, w
