"""Forward kernel 1: chunk-local gate cumsum, P, and A_β on tensor cores.

One CTA (128 threads, one warpgroup) per (q/k head, slice of its group, chunk slot): it loads the
chunk's q and k rows once and walks its nv = G / nslice v-heads (hk·G + slice·nv + v; nslice and
nv are launch arguments, ``plan.prep_slices`` picks them), for each:

    g_cs  = inclusive cumsum of g inside the chunk (natural log; rows past the sequence end
            add 0, so a padded row repeats the last valid value)
    P     = scale · Γ ⊙ Q Kᵀ, causal incl. the diagonal,  Γ_ij = exp(g_cs_i − g_cs_j)  (for fwd_o)
    L     = StrictLower(diag(β) · (Γ ⊙ K Kᵀ))                                      [64, 64]
    A_β   = (I + L)⁻¹ diag(β)                  (FLA's gated A times diag β)

The fused kernel's aux algorithm (``fwd_fused``) per (chunk, v-head): warps 0..3 take the cumsum by
shuffles and write one v-head's gate table each (g_cs, β, the row factors β e^{g − m}, scale e^{g − m},
the column factors e^{m − g}, the flag). Then P for each v-head (Q Kᵀ once for the CTA, in registers,
gated by that v-head's factors or per element; stmatrix, TMA store), q dead after; then L and A_β for
each (K Kᵀ gated alike into L, fp16; the fused kernel's inverse; stmatrix, TMA store). Rows past the
sequence end get q = k = 0, β = 0. Fast math; ``__launch_bounds__``: ``MIN_BLOCKS`` CTAs per SM.

Layouts (chunk-slot space, see ``_common.chunk_table``; slot c covers rows c*64 .. c*64+63):
    q, k  [1, T, Hqk, 128] bf16    g, beta [1, T, Hv] fp32     ctab [NCS, 4] int32
    gcs   [Hv, NCS*64] fp32        (out) chunk-local cumsum of g
    a_beta [Hv, NCS*64, 64] bf16   (out) A · diag(β), row i of slot c at [hv, c*64 + i, :]
    p_all [Hv, NCS*64, 64] bf16    (out) P, same rows
"""

import functools

import torch

from ._common import CHUNK, FAST_MATH, HEAD_DIM, check_heads, compile_program, parse_target, target_key
from .fwd_fused import FACTOR_RANGE
from .plan import PREP_CTAS_PER_SM, prep_slices, sm_count

#: CTAs per SM that ptxas must fit (``__launch_bounds__``); the planner's slicing counts on it
MIN_BLOCKS = PREP_CTAS_PER_SM
#: rows of a v-head's gate table: g cumsum, β, β e^{g − m}, scale e^{g − m}, e^{m − g}, flag
GT_ROWS = 6


def prep_program(h_qk: int, h_v: int):
    """The prim_func ``gdn_prep_p`` for one head config."""
    import tilelang.language as T

    G = check_heads(h_qk, h_v)
    C, D, B = CHUNK, HEAD_DIM, 16
    Tn = T.dynamic("T")
    NCS = T.dynamic("NCS")

    @T.prim_func
    def gdn_prep_p(
        q: T.Tensor((1, Tn, h_qk, D), "bfloat16"),
        k: T.Tensor((1, Tn, h_qk, D), "bfloat16"),
        g: T.Tensor((1, Tn, h_v), "float32"),
        beta: T.Tensor((1, Tn, h_v), "float32"),
        ctab: T.Tensor((NCS, 4), "int32"),
        scale: T.float32,
        nslice: T.int32,
        nv: T.int32,
        gcs: T.Tensor((h_v, NCS * C), "float32"),
        a_beta: T.Tensor((h_v, NCS * C, C), "bfloat16"),
        p_all: T.Tensor((h_v, NCS * C, C), "bfloat16"),
    ):
        with T.Kernel(h_qk, nslice, NCS, threads=128) as (hk, sl, c):
            T.annotate_min_blocks_per_sm(MIN_BLOCKS)
            # gt_sh[v, 0..5, i] for the group's v-head v: g cumsum, β, β e^{g − m}, scale e^{g − m},
            # e^{m − g}, the factored-gating flag (1 / 0, in every column); static, outside the
            # dynamic buffer that TileLang packs by live range
            gt_sh = T.alloc_shared((G, GT_ROWS, C), "float32", scope="shared")
            q_sh = T.alloc_shared((C, D), "bfloat16")
            k_sh = T.alloc_shared((C, D), "bfloat16")
            p_sh = T.alloc_shared((C, C), "bfloat16")
            ab_sh = T.alloc_shared((C, C), "bfloat16")
            # the solve (fp16): L; −D, then −N over it (a buffer used inside a loop lives the whole
            # loop for TileLang's packing: a fifth would take prep to 56 KB, three CTAs per SM); Dβ
            lo_sh = T.alloc_shared((C, C), "float16")
            dn_sh = T.alloc_shared((C, C), "float16")
            db_sh = T.alloc_shared((C, C), "float16")
            a_acc = T.alloc_fragment((C, C), "float32")
            p_acc = T.alloc_fragment((C, C), "float32")
            s_acc = T.alloc_fragment((C, C), "float32")  # Q Kᵀ, once for the CTA's v-heads
            r16 = T.alloc_fragment((C, C), "float16")  # Rₖ, the A operand of the inverse's rounds
            gi = T.alloc_fragment((C,), "float32")
            bi = T.alloc_fragment((C,), "float32")
            cj = T.alloc_fragment((C,), "float32")
            fac = T.alloc_var("float32")
            x16 = T.alloc_local((B,), "float32")
            lrow = T.alloc_local((B,), "float16")
            acc1 = T.alloc_var("float32")
            gv = T.alloc_local((2,), "float32")
            bv2 = T.alloc_local((2,), "float32")
            run = T.alloc_var("float32")
            egl = T.alloc_var("float32")
            gmid = T.alloc_var("float32")
            mono = T.alloc_var("int32")

            tx = T.get_thread_binding()
            lane = tx % 32
            # this CTA's v-heads: hv0 .. hv0 + nv − 1 of q/k head hk's group (nv · nslice = G; both
            # passed, no division on the device)
            hv0 = hk * G + sl * nv
            bos = ctab[c, 0]
            ln = ctab[c, 1] - bos

            for i, j in T.Parallel(C, D):
                q_sh[i, j] = T.if_then_else(i < ln, q[0, bos + i, hk, j], T.bfloat16(0))
                k_sh[i, j] = T.if_then_else(i < ln, k[0, bos + i, hk, j], T.bfloat16(0))
            for w0 in T.serial((nv + 3) // 4):
                if w0 * 4 + tx // 32 < nv:
                    # warp w: the gate table of v-head hv0 + w0·4 + w; lane l holds rows 2l, 2l + 1
                    vr = w0 * 4 + tx // 32
                    for r in T.unroll(2):
                        gv[r] = T.if_then_else(2 * lane + r < ln, g[0, bos + 2 * lane + r, hv0 + vr], T.float32(0))
                        bv2[r] = T.if_then_else(
                            2 * lane + r < ln, beta[0, bos + 2 * lane + r, hv0 + vr], T.float32(0)
                        )
                    # no gate above 0 (NaN fails too): the cumsum does not increase
                    mono = T.all_sync(T.And(gv[0] <= T.float32(0), gv[1] <= T.float32(0)))
                    run = gv[0] + gv[1]
                    for d in T.unroll(5):
                        acc1 = T.shfl_up(run, 1 << d)
                        if lane >= (1 << d):
                            run = run + acc1
                    acc1 = gv[1]
                    gv[1] = run
                    gv[0] = run - acc1
                    # g_l: the cumsum at row ln − 1 (row 0 for an unused slot, whose rows are all 0)
                    egl = T.shfl_sync(T.if_then_else(T.max(ln - 1, 0) % 2 == 0, gv[0], gv[1]), T.max(ln - 1, 0) // 2)
                    run = T.shfl_sync(gv[0], 0)
                    gmid = (run + egl) * T.float32(0.5)
                    mono = T.if_then_else(run - egl < T.float32(FACTOR_RANGE), mono, 0)  # NaN: 0
                    for r in T.unroll(2):
                        gt_sh[vr, 0, 2 * lane + r] = gv[r]
                        gt_sh[vr, 1, 2 * lane + r] = bv2[r]
                        acc1 = T.exp(gv[r] - gmid)
                        gt_sh[vr, 2, 2 * lane + r] = bv2[r] * acc1
                        gt_sh[vr, 3, 2 * lane + r] = scale * acc1
                        gt_sh[vr, 4, 2 * lane + r] = T.exp(gmid - gv[r])
                        gt_sh[vr, 5, 2 * lane + r] = T.if_then_else(mono != 0, T.float32(1), T.float32(0))
            T.fence_proxy_async()
            T.sync_threads()
            # P for every v-head of the group first, each gated from one Q Kᵀ: q dies after this loop
            T.gemm(q_sh, k_sh, s_acc, transpose_B=True, clear_accum=True)
            for v in T.serial(nv):
                # the previous v-head's TMA store has read p_sh (its issuer waited)
                T.sync_threads()
                fac = gt_sh[v, 5, 0]
                # P = scale · Γ ⊙ Q Kᵀ (causal), gated as the fused kernel's aux does
                if fac != T.float32(0):
                    for i in T.Parallel(C):
                        gi[i] = gt_sh[v, 3, i]
                    for j in T.Parallel(C):
                        cj[j] = gt_sh[v, 4, j]
                    for i, j in T.Parallel(C, C):
                        p_acc[i, j] = T.if_then_else(i >= j, gi[i] * cj[j] * s_acc[i, j], T.float32(0))
                else:
                    for i in T.Parallel(C):
                        gi[i] = gt_sh[v, 0, i]
                    for i, j in T.Parallel(C, C):
                        p_acc[i, j] = T.if_then_else(
                            i >= j,
                            scale * T.exp(T.min(gi[i] - gt_sh[v, 0, j], T.float32(0))) * s_acc[i, j],
                            T.float32(0),
                        )
                T.copy(p_acc, p_sh)
                T.copy(p_sh, p_all[hv0 + v, c * C : c * C + C, 0:C])
            # then A_β per v-head; its buffers take q's and P's place
            for v in T.serial(nv):
                T.sync_threads()
                fac = gt_sh[v, 5, 0]
                # L = StrictLower(diag β · Γ ⊙ K Kᵀ), in fp16
                T.gemm(k_sh, k_sh, a_acc, transpose_B=True, clear_accum=True)
                if fac != T.float32(0):
                    for i in T.Parallel(C):
                        bi[i] = gt_sh[v, 2, i]
                    for j in T.Parallel(C):
                        cj[j] = gt_sh[v, 4, j]
                    for i, j in T.Parallel(C, C):
                        a_acc[i, j] = T.if_then_else(i > j, bi[i] * cj[j] * a_acc[i, j], T.float32(0))
                else:
                    for i in T.Parallel(C):
                        gi[i] = gt_sh[v, 0, i]
                        bi[i] = gt_sh[v, 1, i]
                    for i, j in T.Parallel(C, C):
                        a_acc[i, j] = T.if_then_else(
                            i > j,
                            bi[i] * T.exp(T.min(gi[i] - gt_sh[v, 0, j], T.float32(0))) * a_acc[i, j],
                            T.float32(0),
                        )
                T.copy(a_acc, lo_sh)
                for i, j in T.Parallel(C, C):
                    dn_sh[i, j] = T.float16(0)
                    db_sh[i, j] = T.float16(0)
                # D_b = (I + L_bb)⁻¹: thread tx < 64 solves column tx % 16 of block tx // 16
                if tx < C:
                    for i in T.unroll(B):
                        x16[i] = T.float32(0)
                    for i in T.unroll(B):
                        for j in T.vectorized(B):
                            lrow[j] = lo_sh[(tx // B) * B + i, (tx // B) * B + j]
                        acc1 = T.if_then_else(tx % B == i, T.float32(1), T.float32(0))
                        for j in T.unroll(i):
                            acc1 = acc1 - T.cast(lrow[j], "float32") * x16[j]
                        x16[i] = acc1
                    for i in T.vectorized(B):
                        dn_sh[tx, (tx // B) * B + i] = T.cast(-x16[i], "float16")
                        db_sh[tx, (tx // B) * B + i] = T.cast(x16[i] * gt_sh[v, 1, tx], "float16")
                T.fence_proxy_async()
                # −N = −D L off the diagonal blocks (D stored negated, as in fwd_fused); −N then over −D
                T.gemm(dn_sh, lo_sh, a_acc, transpose_A=True, clear_accum=True)
                for i, j in T.Parallel(C, C):
                    a_acc[i, j] = T.if_then_else(i // B > j // B, a_acc[i, j], T.float32(0))
                T.copy(a_acc, dn_sh)
                # (I + N)⁻¹ = R₃, then A_β = R₃ Dβ (fwd_fused's rounds: Rₖ from registers, fp16)
                for i, j in T.Parallel(C, C):
                    r16[i, j] = T.cast(T.if_then_else(i == j, T.float32(1), a_acc[i, j]), "float16")
                T.fence_proxy_async()
                T.gemm(r16, dn_sh, a_acc, clear_accum=True)
                for i, j in T.Parallel(C, C):
                    r16[i, j] = T.cast(T.if_then_else(i == j, T.float32(1), a_acc[i, j]), "float16")
                T.gemm(r16, dn_sh, a_acc, clear_accum=True)
                for i, j in T.Parallel(C, C):
                    r16[i, j] = T.cast(T.if_then_else(i == j, T.float32(1), a_acc[i, j]), "float16")
                T.gemm(r16, db_sh, a_acc, transpose_B=True, clear_accum=True)
                for i, j in T.Parallel(C, C):
                    a_acc[i, j] = T.if_then_else(i >= j, a_acc[i, j], T.float32(0))
                T.copy(a_acc, ab_sh)
                T.copy(ab_sh, a_beta[hv0 + v, c * C : c * C + C, 0:C])
                for i in T.Parallel(C):
                    gcs[hv0 + v, c * C + i] = gt_sh[v, 0, i]

    return gdn_prep_p


@functools.cache
def get_prep_kernel(h_qk: int, h_v: int, target_k=None):
    return compile_program(prep_program(h_qk, h_v), target=parse_target(target_k), pass_configs=FAST_MATH)


def run_prep(q, k, g, beta, ctab, scale, target=None, p_all=None, slices=None, gcs=None, a_beta=None):
    """Launch prep. q, k [1,T,Hqk,128] bf16; g, beta [1,T,Hv] fp32; ctab int32 [NCS,4]; scale float;
    ``p_all``, ``gcs``, ``a_beta`` optionally preallocated; ``slices`` (a divisor of G = Hv / Hqk)
    splits each q/k head's v-heads over that many CTAs (default :func:`plan.prep_slices`). Returns
    gcs [Hv,NCS*64] fp32, a_beta and p_all [Hv,NCS*64,64] bf16."""
    h_qk, h_v = k.shape[2], g.shape[2]
    ncs = ctab.shape[0]
    G = check_heads(h_qk, h_v)
    if slices is None:
        slices = prep_slices(h_qk, h_v, ncs, sm_count(k.device))
    if slices <= 0 or G % slices:
        raise ValueError(f"slices={slices} must divide G = h_v / h_qk = {G}")
    if gcs is None:
        gcs = torch.empty(h_v, ncs * CHUNK, device=k.device, dtype=torch.float32)
    if a_beta is None:
        a_beta = torch.empty(h_v, ncs * CHUNK, CHUNK, device=k.device, dtype=torch.bfloat16)
    if p_all is None:
        p_all = torch.empty(h_v, ncs * CHUNK, CHUNK, device=k.device, dtype=torch.bfloat16)
    kern = get_prep_kernel(h_qk, h_v, target_key(target))
    kern(q, k, g, beta, ctab, float(scale), int(slices), G // int(slices), gcs, a_beta, p_all)
    return gcs, a_beta, p_all
