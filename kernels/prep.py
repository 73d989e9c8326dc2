"""Kernel 1 of the forward: chunk-local gate cumsum, gated K Kᵀ and the triangular solve.

One CTA (128 threads) per (chunk slot, v-head):

    g_cs  = inclusive cumsum of g inside the chunk (natural log; rows past the sequence end
            add 0, so a padded row repeats the last valid value)
    L     = StrictLower(diag(β) · (Γ ⊙ K Kᵀ)),  Γ_ij = exp(g_cs_i − g_cs_j)      [64, 64]
    A     = (I + L)⁻¹                          (FLA's gated A, unit lower triangular)
    A_β   = A · diag(β)                        (what the recurrence multiplies W by)

K Kᵀ runs on wgmma (M = 64, K from shared memory). The solve is forward substitution in
fp32: thread t < 64 owns column t of A in registers (A's column t solves (I + L) a = e_t).
Rows past the sequence end get β = 0 and k = 0, so their rows and columns of A_β are 0.

Layouts (chunk-slot space, see ``_common.chunk_table``; slot c covers rows c*64 .. c*64+63):
    k     [1, T, Hqk, 128] bf16    g, beta [1, T, Hv] fp32     ctab [NCS, 4] int32
    gcs   [Hv, NCS*64] fp32        (out) chunk-local cumsum of g
    a_beta [Hv, NCS*64, 64] bf16   (out) A · diag(β), row i of slot c at [hv, c*64 + i, :]
"""

import functools

import torch

from ._common import CHUNK, HEAD_DIM, check_heads, compile_program, target_key


def prep_program(h_qk: int, h_v: int):
    import tilelang.language as T

    G = check_heads(h_qk, h_v)
    C, D = CHUNK, HEAD_DIM
    Tn = T.dynamic("T")
    NCS = T.dynamic("NCS")

    @T.prim_func
    def gdn_prep(
        k: T.Tensor((1, Tn, h_qk, D), "bfloat16"),
        g: T.Tensor((1, Tn, h_v), "float32"),
        beta: T.Tensor((1, Tn, h_v), "float32"),
        ctab: T.Tensor((NCS, 4), "int32"),
        gcs: T.Tensor((h_v, NCS * C), "float32"),
        a_beta: T.Tensor((h_v, NCS * C, C), "bfloat16"),
    ):
        with T.Kernel(NCS, h_v, threads=128) as (c, hv):
            hk = hv // G
            k_sh = T.alloc_shared((C, D), "bfloat16")
            kk = T.alloc_fragment((C, C), "float32")
            l_sh = T.alloc_shared((C, C), "float32")
            a_sh = T.alloc_shared((C, C), "bfloat16")
            g_sh = T.alloc_shared((C,), "float32")
            b_sh = T.alloc_shared((C,), "float32")
            g_frag = T.alloc_fragment((C,), "float32")
            col = T.alloc_local((C,), "float32")
            acc = T.alloc_var("float32")

            bos = ctab[c, 0]
            ln = ctab[c, 1] - bos

            for i, j in T.Parallel(C, D):
                k_sh[i, j] = T.if_then_else(i < ln, k[0, bos + i, hk, j], T.bfloat16(0))
            for i in T.Parallel(C):
                g_frag[i] = T.if_then_else(i < ln, g[0, bos + i, hv], T.float32(0))
                b_sh[i] = T.if_then_else(i < ln, beta[0, bos + i, hv], T.float32(0))
            T.cumsum(g_frag, dim=0)
            T.copy(g_frag, g_sh)

            T.gemm(k_sh, k_sh, kk, transpose_B=True, clear_accum=True)

            for i, j in T.Parallel(C, C):
                l_sh[i, j] = T.if_then_else(i > j, b_sh[i] * T.exp(g_sh[i] - g_sh[j]) * kk[i, j], T.float32(0))

            tx = T.get_thread_binding()
            if tx < C:
                for i in T.unroll(C):
                    col[i] = T.float32(0)
                for i in T.unroll(C):
                    acc = T.if_then_else(tx == i, T.float32(1), T.float32(0))
                    for j in T.unroll(i):
                        acc = acc - l_sh[i, j] * col[j]
                    col[i] = acc
                for i in T.unroll(C):
                    a_sh[i, tx] = T.cast(col[i] * b_sh[tx], "bfloat16")

            T.copy(a_sh, a_beta[hv, c * C : c * C + C, 0:C])
            T.copy(g_sh, gcs[hv, c * C : c * C + C])

    return gdn_prep


@functools.cache
def get_prep_kernel(h_qk: int, h_v: int, target_k=None):
    import json

    target = json.loads(target_k) if target_k and target_k.startswith("{") else target_k
    return compile_program(prep_program(h_qk, h_v), target=target)


def run_prep(k, g, beta, ctab, target=None):
    """Launch the prep kernel.

    Args:
        k: [1, T, Hqk, 128] bf16.  g, beta: [1, T, Hv] fp32.  ctab: int32 [NCS, 4].
    Returns:
        gcs [Hv, NCS*64] fp32, a_beta [Hv, NCS*64, 64] bf16.
    """
    h_qk, h_v = k.shape[2], g.shape[2]
    ncs = ctab.shape[0]
    gcs = torch.empty(h_v, ncs * CHUNK, device=k.device, dtype=torch.float32)
    a_beta = torch.empty(h_v, ncs * CHUNK, CHUNK, device=k.device, dtype=torch.bfloat16)
    kern = get_prep_kernel(h_qk, h_v, target_key(target))
    kern(k, g, beta, ctab, gcs, a_beta)
    return gcs, a_beta
