"""Backward kernel 1: recompute the per-chunk states h and v_new (FLA's ``chunk_fwd_h``).

One CTA (128 threads, one warpgroup) per (V block of ``block_v`` columns, segment, v-head),
the segments of ``_common.segment_table`` (unsplit: one segment per sequence). It walks the
segment's chunks in order with the state block S [128, block_v] in fp32 registers, the same
algebra as the forward's fwd_o (g = chunk-local cumsum, g_l = its last valid value):

    h[slot]  = bf16(S)                               (state at the chunk START)
    U  = K S;  W = V − e^g ⊙ U;  Vd = A_β W           wgmma
    v_new[slot rows] = bf16(Vd)
    S ← e^{g_l} S + Kᵀ (e^{g_l − g} ⊙ Vd)   (rows past the sequence end masked)

Loads of k and v are masked to 0 past the chunk's valid rows.

Inputs:  k [1,T,Hqk,128] bf16, v [1,T,Hv,128] bf16, gcs [Hv,NCS*64] fp32, a_beta [Hv,NCS*64,64]
         bf16 (the forward's prep), stab int32 [NS,8], h_init [R,Hv,128,128] fp32 (row stab[s,4];
         read only when ``has_init``).
Outputs: h_all [Hv, NCS, 128, 128] bf16 (chunk-slot index), vnew [Hv, NCS*64, 128] bf16.
"""

import functools
import json

import torch

from ._common import CHUNK, HEAD_DIM, check_heads, compile_program, target_key


def bwd_h_program(h_qk: int, h_v: int, has_init: bool, block_v: int = 64):
    import tilelang.language as T

    G = check_heads(h_qk, h_v)
    C, D, BV = CHUNK, HEAD_DIM, block_v
    assert D % BV == 0
    Tn = T.dynamic("T")
    NCS = T.dynamic("NCS")
    NS = T.dynamic("NS")
    R = T.dynamic("R")

    @T.prim_func
    def gdn_bwd_h(
        k: T.Tensor((1, Tn, h_qk, D), "bfloat16"),
        v: T.Tensor((1, Tn, h_v, D), "bfloat16"),
        gcs: T.Tensor((h_v, NCS * C), "float32"),
        a_beta: T.Tensor((h_v, NCS * C, C), "bfloat16"),
        stab: T.Tensor((NS, 8), "int32"),
        h_init: T.Tensor((R, h_v, D, D), "float32"),
        h_all: T.Tensor((h_v, NCS, D, D), "bfloat16"),
        vnew: T.Tensor((h_v, NCS * C, D), "bfloat16"),
    ):
        with T.Kernel(D // BV, NS * h_v, threads=128) as (bv, sh):
            s = sh // h_v
            hv = sh % h_v
            hk = hv // G
            v0 = bv * BV

            k_sh = T.alloc_shared((C, D), "bfloat16")
            v_sh = T.alloc_shared((C, BV), "bfloat16")
            a_sh = T.alloc_shared((C, C), "bfloat16")
            s_sh = T.alloc_shared((D, BV), "bfloat16")
            w_sh = T.alloc_shared((C, BV), "bfloat16")
            vd_sh = T.alloc_shared((C, BV), "bfloat16")
            vp_sh = T.alloc_shared((C, BV), "bfloat16")
            g_sh = T.alloc_shared((C,), "float32")

            s_frag = T.alloc_fragment((D, BV), "float32")
            u_frag = T.alloc_fragment((C, BV), "float32")
            vd_frag = T.alloc_fragment((C, BV), "float32")
            glast = T.alloc_var("float32")

            bos = stab[s, 0]
            eos = stab[s, 1]
            seq = stab[s, 2]
            cslot = stab[s, 3]
            irow = stab[s, 4]
            nchunks = T.if_then_else(seq >= 0, T.ceildiv(eos - bos, C), 0)

            if has_init:
                T.copy(h_init[irow, hv, 0:D, v0 : v0 + BV], s_frag)
            else:
                T.clear(s_frag)

            for ci in T.serial(nchunks):
                t0 = bos + ci * C
                ln = T.min(eos - t0, C)
                r0 = (cslot + ci) * C
                for i, j in T.Parallel(C, D):
                    k_sh[i, j] = T.if_then_else(i < ln, k[0, t0 + i, hk, j], T.bfloat16(0))
                for i, j in T.Parallel(C, BV):
                    v_sh[i, j] = T.if_then_else(i < ln, v[0, t0 + i, hv, v0 + j], T.bfloat16(0))
                T.copy(a_beta[hv, r0 : r0 + C, 0:C], a_sh)
                T.copy(gcs[hv, r0 : r0 + C], g_sh)
                T.copy(s_frag, s_sh)
                T.copy(s_sh, h_all[hv, cslot + ci, 0:D, v0 : v0 + BV])

                T.gemm(k_sh, s_sh, u_frag, clear_accum=True)
                for i, j in T.Parallel(C, BV):
                    w_sh[i, j] = T.cast(T.cast(v_sh[i, j], "float32") - T.exp(g_sh[i]) * u_frag[i, j], "bfloat16")
                T.gemm(a_sh, w_sh, vd_frag, clear_accum=True)

                glast = g_sh[ln - 1]
                for i, j in T.Parallel(C, BV):
                    vd_sh[i, j] = T.cast(vd_frag[i, j], "bfloat16")
                    vp_sh[i, j] = T.cast(
                        T.if_then_else(i < ln, T.exp(glast - g_sh[i]) * vd_frag[i, j], T.float32(0)),
                        "bfloat16",
                    )
                T.copy(vd_sh, vnew[hv, r0 : r0 + C, v0 : v0 + BV])
                for i, j in T.Parallel(D, BV):
                    s_frag[i, j] = s_frag[i, j] * T.exp(glast)
                T.gemm(k_sh, vp_sh, s_frag, transpose_A=True)

    return gdn_bwd_h


@functools.cache
def get_bwd_h_kernel(h_qk: int, h_v: int, has_init: bool, block_v: int = 64, target_k=None):
    target = json.loads(target_k) if target_k and target_k.startswith("{") else target_k
    return compile_program(bwd_h_program(h_qk, h_v, has_init, block_v), target=target)


def run_bwd_h(k, v, gcs, a_beta, stab, h_init, h_all=None, vnew=None, block_v=64, target=None):
    """Launch the state recomputation. h_init: [R,Hv,128,128] fp32 or None.

    Returns h_all [Hv, NCS, 128, 128] bf16 and vnew [Hv, NCS*64, 128] bf16 (slots of unused
    chunk slots are left unwritten)."""
    h_qk, h_v = k.shape[2], v.shape[2]
    ncs = gcs.shape[1] // CHUNK
    if h_all is None:
        h_all = torch.empty(h_v, ncs, HEAD_DIM, HEAD_DIM, device=k.device, dtype=torch.bfloat16)
    if vnew is None:
        vnew = torch.empty(h_v, ncs * CHUNK, HEAD_DIM, device=k.device, dtype=torch.bfloat16)
    has_init = h_init is not None
    kern = get_bwd_h_kernel(h_qk, h_v, has_init, block_v, target_key(target))
    if h_init is None:
        h_init = torch.empty(1, h_v, HEAD_DIM, HEAD_DIM, device=k.device, dtype=torch.float32)
    kern(k, v, gcs, a_beta, stab, h_init, h_all, vnew)
    return h_all, vnew
