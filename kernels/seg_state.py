"""Sequence splitting, pass 1: each segment's local end state and its state transition.

A segment's chunks map its start state S₀ affinely: S_end = M · S₀ + E, where
E = the end state reached from S₀ = 0 and M [128, 128] = the product of the per-chunk maps
S ↦ e^{g_last} S − Kᵀ diag(e^{g_last − g}) A_β diag(e^g) K S. Both come out of one
recurrence over an augmented state [S | M] of width 256 started from [0 | I], with the
value input [V | 0] (the recurrence is linear in (S₀, V)). This is exact: no warm-up cut-off.

One CTA (128 threads, plus TileLang's TMA producer warpgroup) per (64-column block of ``block_v``, segment, v-head); it runs only for
segments that are not the last of their sequence (the last segment's transition is never
needed). Per chunk: U = K S; W = V − diag(e^g) U; Vd = A_β W; S ← e^{g_last} S + Kᵀ diag(e^{g_last−g}) Vd.

Inputs:  k [1,T,Hqk,128] bf16, v [1,T,Hv,128] bf16, gcs, a_beta (prep kernel), stab int32 [NS, 8].
Outputs: e_end [NS, Hv, 128, 128] fp32 (E), m_tr [NS, Hv, 128, 128] bf16 (M, row = output k index).
"""

import functools

from ._common import CHUNK, FAST_MATH, HEAD_DIM, check_heads, compile_program, parse_target, target_key


def seg_state_program(h_qk: int, h_v: int, block_v: int = 64, num_stages: int = 2):
    """The prim_func ``gdn_seg_state``. e^g and mask·e^{g_last − g} are computed once per row into
    row fragments (the rows of the thread's accumulator fragment) and e^{g_last} once per chunk;
    ``num_stages`` = 2: the chunk loop is ``T.Pipelined`` (TileLang's TMA producer warpgroup)."""
    import tilelang.language as T

    G = check_heads(h_qk, h_v)
    C, D, BV = CHUNK, HEAD_DIM, block_v
    W2 = 2 * D
    Tn = T.dynamic("T")
    NCS = T.dynamic("NCS")
    NS = T.dynamic("NS")

    @T.prim_func
    def gdn_seg_state(
        k: T.Tensor((1, Tn, h_qk, D), "bfloat16"),
        v: T.Tensor((1, Tn, h_v, D), "bfloat16"),
        gcs: T.Tensor((h_v, NCS * C), "float32"),
        a_beta: T.Tensor((h_v, NCS * C, C), "bfloat16"),
        stab: T.Tensor((NS, 8), "int32"),
        e_end: T.Tensor((NS, h_v, D, D), "float32"),
        m_tr: T.Tensor((NS, h_v, D, D), "bfloat16"),
    ):
        with T.Kernel(W2 // BV, NS * h_v, threads=128) as (bv, sh):
            s = sh // h_v
            hv = sh % h_v
            hk = hv // G
            c0 = bv * BV  # first column in the augmented [V | M] space

            k_sh = T.alloc_shared((C, D), "bfloat16")
            v_sh = T.alloc_shared((C, BV), "bfloat16")
            a_sh = T.alloc_shared((C, C), "bfloat16")
            s_sh = T.alloc_shared((D, BV), "bfloat16")
            w_sh = T.alloc_shared((C, BV), "bfloat16")
            vp_sh = T.alloc_shared((C, BV), "bfloat16")
            g_sh = T.alloc_shared((C,), "float32")

            s_frag = T.alloc_fragment((D, BV), "float32")
            u_frag = T.alloc_fragment((C, BV), "float32")
            vd_frag = T.alloc_fragment((C, BV), "float32")
            glast = T.alloc_var("float32")
            eg = T.alloc_fragment((C,), "float32")
            el = T.alloc_fragment((C,), "float32")
            egl = T.alloc_var("float32")

            bos = stab[s, 0]
            eos = stab[s, 1]
            seq = stab[s, 2]
            cslot = stab[s, 3]
            is_last = stab[s, 5]
            nchunks = T.if_then_else(seq >= 0 and is_last == 0, T.ceildiv(eos - bos, C), 0)

            # [0 | I] start: column c0 + j of the augmented state is e_{c0 + j - D} in the M half.
            for i, j in T.Parallel(D, BV):
                s_frag[i, j] = T.if_then_else(c0 + j - D == i, T.float32(1), T.float32(0))

            for ci in T.Pipelined(nchunks, num_stages=num_stages):
                t0 = bos + ci * C
                ln = T.min(eos - t0, C)
                r0 = (cslot + ci) * C
                T.copy(k[0, t0 : t0 + C, hk, 0:D], k_sh)
                for i, j in T.Parallel(C, BV):
                    v_sh[i, j] = T.if_then_else(c0 + j < D, v[0, t0 + i, hv, c0 + j], T.bfloat16(0))
                T.copy(a_beta[hv, r0 : r0 + C, 0:C], a_sh)
                T.copy(gcs[hv, r0 : r0 + C], g_sh)
                T.copy(s_frag, s_sh)

                T.gemm(k_sh, s_sh, u_frag, clear_accum=True)
                glast = g_sh[ln - 1]
                egl = T.exp(glast)
                for i in T.Parallel(C):
                    eg[i] = T.exp(g_sh[i])
                for i in T.Parallel(C):
                    el[i] = T.if_then_else(i < ln, T.exp(glast - g_sh[i]), T.float32(0))
                for i, j in T.Parallel(C, BV):
                    w_sh[i, j] = T.cast(T.cast(v_sh[i, j], "float32") - eg[i] * u_frag[i, j], "bfloat16")
                T.gemm(a_sh, w_sh, vd_frag, clear_accum=True)
                for i, j in T.Parallel(C, BV):
                    vp_sh[i, j] = T.cast(el[i] * vd_frag[i, j], "bfloat16")
                for i, j in T.Parallel(D, BV):
                    s_frag[i, j] = s_frag[i, j] * egl
                T.gemm(k_sh, vp_sh, s_frag, transpose_A=True)

            if seq >= 0 and is_last == 0:
                if c0 < D:
                    T.copy(s_frag, e_end[s, hv, 0:D, c0 : c0 + BV])
                else:
                    T.copy(s_frag, m_tr[s, hv, 0:D, c0 - D : c0 - D + BV])

    return gdn_seg_state


@functools.cache
def get_seg_state_kernel(h_qk: int, h_v: int, target_k=None):
    return compile_program(seg_state_program(h_qk, h_v), target=parse_target(target_k), pass_configs=FAST_MATH)


def run_seg_state(k, v, gcs, a_beta, stab, e_end, m_tr, target=None):
    """Launch pass 1; fills e_end [NS,Hv,128,128] fp32 and m_tr [NS,Hv,128,128] bf16 in place
    (rows of segments that are the last of their sequence are left untouched)."""
    kern = get_seg_state_kernel(k.shape[2], v.shape[2], target_key(target))
    kern(k, v, gcs, a_beta, stab, e_end, m_tr)
    return e_end, m_tr
