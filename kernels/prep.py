"""Forward kernel 1: chunk-local gate cumsum, gated K Kᵀ, the triangular solve and P.

One CTA (128 threads) per (v-head, chunk slot), v-head fastest (the G v-heads of a chunk read its
q and k rows from L2):

    g_cs  = inclusive cumsum of g inside the chunk (natural log; rows past the sequence end
            add 0, so a padded row repeats the last valid value)
    P     = scale · Γ ⊙ Q Kᵀ, causal incl. the diagonal,  Γ_ij = exp(g_cs_i − g_cs_j)  (for fwd_o)
    L     = StrictLower(diag(β) · (Γ ⊙ K Kᵀ))                                      [64, 64]
    A     = (I + L)⁻¹                          (FLA's gated A, unit lower triangular)
    A_β   = A · diag(β)                        (what the recurrence multiplies W by)

Q Kᵀ and K Kᵀ run on wgmma (one accumulator, reused). The solve, in fp32 shared memory: the four
16x16 diagonal blocks by substitution (64 threads), then the off-diagonal blocks level by level,
register-tiled (a warp per 16x16 block, a 2x4 tile per lane). Rows past the sequence end get
q = k = 0 and β = 0, so their rows and columns of A_β and P are 0. Fast math (ex2.approx: rel
2^-22, far below the bf16 rounding of the stored A_β and P).

Layouts (chunk-slot space, see ``_common.chunk_table``; slot c covers rows c*64 .. c*64+63):
    q, k  [1, T, Hqk, 128] bf16    g, beta [1, T, Hv] fp32     ctab [NCS, 4] int32
    gcs   [Hv, NCS*64] fp32        (out) chunk-local cumsum of g
    a_beta [Hv, NCS*64, 64] bf16   (out) A · diag(β), row i of slot c at [hv, c*64 + i, :]
    p_all [Hv, NCS*64, 64] bf16    (out) P, same rows
"""

import functools

import torch

from ._common import CHUNK, FAST_MATH, HEAD_DIM, check_heads, compile_program, parse_target, target_key


def _shared_macros(T):
    """``load_l_p`` (q, k, g, β of one chunk slot → chunk-local g cumsum, P, and L =
    StrictLower(diag β · Γ ⊙ K Kᵀ) in shared memory) and ``diag`` (the 16x16 diagonal blocks
    (I + L_bb)⁻¹: thread tx < 64 solves column tx % 16 of block tx // 16)."""
    C, D, B = CHUNK, HEAD_DIM, 16

    @T.macro
    def load_l_p(q, k, g, beta, scale, bos, ln, hk, hv, c, q_sh, k_sh, g_frag, g_sh, b_sh, kk, l_sh, p_sh, p_all):
        # P = scale·Γ⊙QKᵀ (causal, diagonal included) into p_sh (bf16): q and k are loaded in one
        # pass, and Q Kᵀ uses K Kᵀ's accumulator (a second fragment took prep to 136 registers
        # and 3 CTAs per SM)
        for i, j in T.Parallel(C, D):
            k_sh[i, j] = T.if_then_else(i < ln, k[0, bos + i, hk, j], T.bfloat16(0))
            q_sh[i, j] = T.if_then_else(i < ln, q[0, bos + i, hk, j], T.bfloat16(0))
        for i in T.Parallel(C):
            g_frag[i] = T.if_then_else(i < ln, g[0, bos + i, hv], T.float32(0))
            b_sh[i] = T.if_then_else(i < ln, beta[0, bos + i, hv], T.float32(0))
        T.cumsum(g_frag, dim=0)
        T.copy(g_frag, g_sh)

        # Q Kᵀ and P first, then K Kᵀ and L: q is dead after the first wgmma and k after the
        # second, so P can take q's place and L k's (TileLang reuses dead shared buffers)
        T.gemm(q_sh, k_sh, kk, transpose_B=True, clear_accum=True)
        for i, j in T.Parallel(C, C):
            p_sh[i, j] = T.cast(
                T.if_then_else(i >= j, scale * T.exp(g_sh[i] - g_sh[j]) * kk[i, j], T.float32(0)), "bfloat16"
            )
        T.copy(p_sh, p_all[hv, c * C : c * C + C, 0:C])
        T.gemm(k_sh, k_sh, kk, transpose_B=True, clear_accum=True)
        for i, j in T.Parallel(C, C):
            l_sh[i, j] = T.if_then_else(i > j, b_sh[i] * T.exp(g_sh[i] - g_sh[j]) * kk[i, j], T.float32(0))

    @T.macro
    def diag(l_sh, ainv_sh, x16, acc_l, tx):
        if tx < C:
            for i in T.unroll(B):
                x16[i] = T.float32(0)
            for i in T.unroll(B):
                acc_l[0] = T.if_then_else(tx % B == i, T.float32(1), T.float32(0))
                for j in T.unroll(i):
                    acc_l[0] = acc_l[0] - l_sh[(tx // B) * B + i, (tx // B) * B + j] * x16[j]
                x16[i] = acc_l[0]
            for i in T.unroll(B):
                ainv_sh[(tx // B) * B + i, (tx // B) * B + tx % B] = x16[i]

    return load_l_p, diag


def prep_program(h_qk: int, h_v: int):
    """The prim_func ``gdn_prep_p`` for one head config.

    The off-diagonal levels of the solve: each 16x16 block (bi, bj) of level d = bi − bj belongs
    to ONE warp (warp w: bi = d + w, bj = w), and lane l computes the 2x4 tile rows {rp, rp + 8}
    (rp = l // 4), columns 4·(l % 4) .. +3:

        Y = L[16bi + r, 16bj : 16bi] · A[16bj : 16bi, 16bj + c]     (16·d steps, 8 accumulators)
        A[16bi + r, 16bj + c] = −Σ_m D_bi[r, m] · Y[m, c]            (16 steps)

    Per step a lane loads two L (or D) values and one float4 of A (or Y) for eight FMAs. The fp32
    buffers have rows of 68 words: rows rp and rp + 8 of the eight lanes sharing a column land on
    eight different banks, and row starts stay 16-byte aligned for the float4 loads."""
    import tilelang.language as T

    G = check_heads(h_qk, h_v)
    load_l_p, diag = _shared_macros(T)
    C, D, B, P = CHUNK, HEAD_DIM, 16, 4
    Tn = T.dynamic("T")
    NCS = T.dynamic("NCS")

    @T.macro
    def level(l_sh, ainv_sh, y_sh, acc, lv, dv, tx, d):
        w = tx // 32
        rp = (tx % 32) // 4
        cq = (tx % 32) % 4
        if w < 4 - d:
            bi = w + d
            bj = w
            for v in T.unroll(8):
                acc[v] = T.float32(0)
            for m in T.unroll(B * d):
                for v in T.vectorized(4):
                    lv[v] = ainv_sh[bj * B + m, bj * B + cq * 4 + v]
                dv[0] = l_sh[bi * B + rp, bj * B + m]
                dv[1] = l_sh[bi * B + rp + 8, bj * B + m]
                for v in T.unroll(4):
                    acc[v] = acc[v] + dv[0] * lv[v]
                    acc[4 + v] = acc[4 + v] + dv[1] * lv[v]
            for v in T.vectorized(4):
                y_sh[bi * B + rp, cq * 4 + v] = acc[v]
            for v in T.vectorized(4):
                y_sh[bi * B + rp + 8, cq * 4 + v] = acc[4 + v]
        T.sync_threads()
        if w < 4 - d:
            bi = w + d
            bj = w
            for v in T.unroll(8):
                acc[v] = T.float32(0)
            for m in T.unroll(B):
                for v in T.vectorized(4):
                    lv[v] = y_sh[bi * B + m, cq * 4 + v]
                dv[0] = ainv_sh[bi * B + rp, bi * B + m]
                dv[1] = ainv_sh[bi * B + rp + 8, bi * B + m]
                for v in T.unroll(4):
                    acc[v] = acc[v] - dv[0] * lv[v]
                    acc[4 + v] = acc[4 + v] - dv[1] * lv[v]
            for v in T.vectorized(4):
                ainv_sh[bi * B + rp, bj * B + cq * 4 + v] = acc[v]
            for v in T.vectorized(4):
                ainv_sh[bi * B + rp + 8, bj * B + cq * 4 + v] = acc[4 + v]
        T.sync_threads()

    @T.macro
    def solve_store(l_sh, ainv_sh, y_sh, a_sh, g_sh, b_sh, x16, acc_l, acc, lv, dv, gcs, a_beta, c, hv):
        tx = T.get_thread_binding()
        # diagonal blocks D_b = (I + L_bb)⁻¹: thread tx < 64 solves column tx % 16 of block tx // 16
        diag(l_sh, ainv_sh, x16, acc_l, tx)
        T.sync_threads()
        level(l_sh, ainv_sh, y_sh, acc, lv, dv, tx, 1)
        level(l_sh, ainv_sh, y_sh, acc, lv, dv, tx, 2)
        level(l_sh, ainv_sh, y_sh, acc, lv, dv, tx, 3)
        for i, j in T.Parallel(C, C):
            a_sh[i, j] = T.cast(T.if_then_else(i // B >= j // B, ainv_sh[i, j] * b_sh[j], T.float32(0)), "bfloat16")

        T.copy(a_sh, a_beta[hv, c * C : c * C + C, 0:C])
        T.copy(g_sh, gcs[hv, c * C : c * C + C])

    @T.prim_func
    def gdn_prep_p(
        q: T.Tensor((1, Tn, h_qk, D), "bfloat16"),
        k: T.Tensor((1, Tn, h_qk, D), "bfloat16"),
        g: T.Tensor((1, Tn, h_v), "float32"),
        beta: T.Tensor((1, Tn, h_v), "float32"),
        ctab: T.Tensor((NCS, 4), "int32"),
        scale: T.float32,
        gcs: T.Tensor((h_v, NCS * C), "float32"),
        a_beta: T.Tensor((h_v, NCS * C, C), "bfloat16"),
        p_all: T.Tensor((h_v, NCS * C, C), "bfloat16"),
    ):
        # v-head fastest: the G v-heads of a chunk run together and read its q and k rows from L2
        # (chunk fastest read them from DRAM G times: prep with P moved ~1.6 GB on 16/64 1x32768)
        with T.Kernel(h_v, NCS, threads=128) as (hv, c):
            hk = hv // G
            # g and β in static shared memory: kept out of the dynamic buffer that TileLang packs by
            # live range, where these two long-lived vectors split the space that the short-lived
            # q/k/P and L/A/Y buffers could share
            g_sh = T.alloc_shared((C,), "float32", scope="shared")
            b_sh = T.alloc_shared((C,), "float32", scope="shared")
            ainv_sh = T.alloc_shared((C, C + P), "float32")
            l_sh = T.alloc_shared((C, C + P), "float32")
            y_sh = T.alloc_shared((C, B + P), "float32")
            a_sh = T.alloc_shared((C, C), "bfloat16")
            q_sh = T.alloc_shared((C, D), "bfloat16")
            k_sh = T.alloc_shared((C, D), "bfloat16")
            p_sh = T.alloc_shared((C, C), "bfloat16")
            kk = T.alloc_fragment((C, C), "float32")
            g_frag = T.alloc_fragment((C,), "float32")
            x16 = T.alloc_local((B,), "float32")
            acc_l = T.alloc_local((1,), "float32")
            acc = T.alloc_local((8,), "float32")
            lv = T.alloc_local((4,), "float32")
            dv = T.alloc_local((2,), "float32")

            bos = ctab[c, 0]
            ln = ctab[c, 1] - bos

            # P goes out (TMA store) before the solve; storing it from the registers instead measured
            # slower (scattered 2-byte stores)
            load_l_p(q, k, g, beta, scale, bos, ln, hk, hv, c, q_sh, k_sh, g_frag, g_sh, b_sh, kk, l_sh, p_sh, p_all)
            solve_store(l_sh, ainv_sh, y_sh, a_sh, g_sh, b_sh, x16, acc_l, acc, lv, dv, gcs, a_beta, c, hv)

    return gdn_prep_p


@functools.cache
def get_prep_kernel(h_qk: int, h_v: int, target_k=None):
    return compile_program(prep_program(h_qk, h_v), target=parse_target(target_k), pass_configs=FAST_MATH)


def run_prep(q, k, g, beta, ctab, scale, target=None, p_all=None):
    """Launch prep. q, k [1,T,Hqk,128] bf16; g, beta [1,T,Hv] fp32; ctab int32 [NCS,4]; scale float;
    ``p_all`` optionally preallocated. Returns gcs [Hv,NCS*64] fp32, a_beta and p_all [Hv,NCS*64,64] bf16."""
    h_qk, h_v = k.shape[2], g.shape[2]
    ncs = ctab.shape[0]
    gcs = torch.empty(h_v, ncs * CHUNK, device=k.device, dtype=torch.float32)
    a_beta = torch.empty(h_v, ncs * CHUNK, CHUNK, device=k.device, dtype=torch.bfloat16)
    if p_all is None:
        p_all = torch.empty(h_v, ncs * CHUNK, CHUNK, device=k.device, dtype=torch.bfloat16)
    kern = get_prep_kernel(h_qk, h_v, target_key(target))
    kern(q, k, g, beta, ctab, float(scale), gcs, a_beta, p_all)
    return gcs, a_beta, p_all
