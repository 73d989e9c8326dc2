"""Backward kernel 1: recompute h at every chunk start (bf16) and v_new, with the forward's
warp-specialised chain (before its U₀/W₀ split) without the output warpgroup.

One CTA of 384 threads = 3 warpgroups per (V block of 32 columns, segment, v-head):

    WG0 (tx   0..127)  owns S [128, bv] in fp32 registers: publish bf16 S to s_sh[c%2]; store it
                       as h[slot] (global, from registers, while WG1 works); S *= e^{g_last};
                       wait V'; S += Kᵀ V' (wgmma M = 128)
    WG1 (tx 128..255)  per-row e^g, mask·e^{g_last − g} (row fragments, before the S hand-off);
                       U = K S; W = V − e^g ⊙ U (w_sh); Vd = A_β W; V' → vp_sh; then v_new = bf16(Vd)
                       (global, after the hand-off)
    WG2 (tx 256..383)  producer: warp 8 waits, one elected lane issues the TMA loads of K, V, A_β, g
                       of chunk c into stage c%2; warps 9-11 exit

mbarriers (c = chunk, j = c % 2, n = c // 2): full[j] (count 32 + tx bytes; consumers wait parity
n%2), empty[j] (count 256: WG0 + WG1 after their last read of stage j; producer waits parity
(n+1)%2), s_ready[j] (count 128, WG0 -> WG1, parity n%2), vp_ready (count 128, WG1 -> WG0, parity
c%2). No s_free: WG0 rewrites s_sh[j] (chunk c+2) only after vp_ready(c+1), which WG1 arrives after
its K S of chunk c+1, itself after its K S of chunk c read s_sh[j]. vp_sh (single buffer) is
rewritten by WG1 only after s_ready(c+1), which WG0 arrives after its synchronous Kᵀ V' gemm of
chunk c read it (the forward's argument).

Rows past a sequence's end: k and v are loaded unmasked (TMA zero-fills past T; rows of the next
sequence are finite) and meet only zero columns of A_β, so U, W rows there do not reach Vd
(A_β rows past the end are 0: Vd rows = 0); V' rows there are masked.

Inputs:  k [1,T,Hqk,128] bf16, v [1,T,Hv,128] bf16, gcs, a_beta (prep), stab int32 [NS,8],
         h_init [R,Hv,128,128] fp32 (row stab[s, 4]; read when ``has_init``).
Outputs: h_all [Hv, NCS, 128, 128] bf16 (state at each chunk's start), vnew [Hv, NCS*64, 128] bf16.
"""

import functools

import torch

from ._common import CHUNK, FAST_MATH, HEAD_DIM, check_heads, compile_program, parse_target, target_key

#: setmaxnreg budgets of WG0 (state), WG1 (U/W/Vd), WG2 (producer); 384 threads.
NREG = (216, 216, 40)
assert sum(NREG) * 128 <= 65536 and all(r % 8 == 0 and 24 <= r <= 256 for r in NREG)


def bwd_h_program(h_qk: int, h_v: int, has_init: bool):
    """The prim_func ``gdn_bwd_h_ws`` (V block 32)."""
    import tilelang.language as T

    block_v = 32

    G = check_heads(h_qk, h_v)
    C, D, BV = CHUNK, HEAD_DIM, block_v
    assert D % BV == 0 and BV in (32, 64)
    Tn = T.dynamic("T")
    NCS = T.dynamic("NCS")
    NS = T.dynamic("NS")
    R = T.dynamic("R")
    R0, R1, RP = NREG

    @T.prim_func
    def gdn_bwd_h_ws(
        k: T.Tensor((1, Tn, h_qk, D), "bfloat16"),
        v: T.Tensor((1, Tn, h_v, D), "bfloat16"),
        gcs: T.Tensor((h_v, NCS * C), "float32"),
        a_beta: T.Tensor((h_v, NCS * C, C), "bfloat16"),
        stab: T.Tensor((NS, 8), "int32"),
        h_init: T.Tensor((R, h_v, D, D), "float32"),
        h_all: T.Tensor((h_v, NCS, D, D), "bfloat16"),
        vnew: T.Tensor((h_v, NCS * C, D), "bfloat16"),
    ):
        with T.Kernel(D // BV, NS * h_v, threads=384) as (bv, sh):
            s = sh // h_v
            hv = sh % h_v
            hk = hv // G
            v0 = bv * BV

            k_sh = T.alloc_shared((2, C, D), "bfloat16")
            v_sh = T.alloc_shared((2, C, BV), "bfloat16")
            a_sh = T.alloc_shared((2, C, C), "bfloat16")
            g_sh = T.alloc_shared((2, C), "float32")
            s_sh = T.alloc_shared((2, D, BV), "bfloat16")
            vp_sh = T.alloc_shared((C, BV), "bfloat16")
            w_sh = T.alloc_shared((C, BV), "bfloat16")

            s_frag = T.alloc_fragment((D, BV), "float32")
            u_frag = T.alloc_fragment((C, BV), "float32")
            vd_frag = T.alloc_fragment((C, BV), "float32")
            eg1 = T.alloc_fragment((C,), "float32")
            el1 = T.alloc_fragment((C,), "float32")

            full = T.alloc_barrier([32, 32])
            empty = T.alloc_barrier([256, 256])
            s_ready = T.alloc_barrier([128, 128])
            vp_ready = T.alloc_barrier(128)

            bos = stab[s, 0]
            eos = stab[s, 1]
            seq = stab[s, 2]
            cslot = stab[s, 3]
            irow = stab[s, 4]
            nchunks = T.if_then_else(seq >= 0, T.ceildiv(eos - bos, C), 0)
            egl = T.alloc_var("float32")

            tx = T.get_thread_binding()

            if tx < 128:
                # ---------------- WG0: state owner, h store ----------------
                T.set_max_nreg(R0, 1)
                if has_init:
                    T.copy(h_init[irow, hv, 0:D, v0 : v0 + BV], s_frag)
                else:
                    T.clear(s_frag)
                for ci in T.serial(nchunks):
                    j = ci % 2
                    ph = (ci // 2) % 2
                    ln = T.min(eos - (bos + ci * C), C)
                    T.copy(s_frag, s_sh[j, :, :])
                    T.fence_proxy_async()
                    T.barrier_arrive(s_ready[j])
                    for i, jj in T.Parallel(D, BV):
                        h_all[hv, cslot + ci, i, v0 + jj] = T.cast(s_frag[i, jj], "bfloat16")
                    T.barrier_wait(full[j], ph)
                    egl = T.exp(g_sh[j, ln - 1])
                    for i, jj in T.Parallel(D, BV):
                        s_frag[i, jj] = s_frag[i, jj] * egl
                    T.barrier_wait(vp_ready[0], ci % 2)
                    T.gemm(k_sh[j, :, :], vp_sh, s_frag, transpose_A=True)
                    T.barrier_arrive(empty[j])
            elif tx < 256:
                # ---------------- WG1: U = K S, W, Vd, V', v_new ----------------
                T.set_max_nreg(R1, 1)
                for ci in T.serial(nchunks):
                    j = ci % 2
                    ph = (ci // 2) % 2
                    ln = T.min(eos - (bos + ci * C), C)
                    r0 = (cslot + ci) * C
                    T.barrier_wait(full[j], ph)
                    for i in T.Parallel(C):
                        eg1[i] = T.exp(g_sh[j, i])
                    for i in T.Parallel(C):
                        el1[i] = T.if_then_else(i < ln, T.exp(g_sh[j, ln - 1] - g_sh[j, i]), T.float32(0))
                    T.barrier_wait(s_ready[j], ph)
                    T.gemm(k_sh[j, :, :], s_sh[j, :, :], u_frag, clear_accum=True)
                    for i, jj in T.Parallel(C, BV):
                        w_sh[i, jj] = T.cast(T.cast(v_sh[j, i, jj], "float32") - eg1[i] * u_frag[i, jj], "bfloat16")
                    T.fence_proxy_async()  # w_sh: generic writes -> wgmma reads
                    T.gemm(a_sh[j, :, :], w_sh, vd_frag, clear_accum=True)
                    for i, jj in T.Parallel(C, BV):
                        vp_sh[i, jj] = T.cast(el1[i] * vd_frag[i, jj], "bfloat16")
                    T.fence_proxy_async()
                    T.barrier_arrive(vp_ready[0])
                    T.barrier_arrive(empty[j])
                    for i, jj in T.Parallel(C, BV):
                        vnew[hv, r0 + i, v0 + jj] = T.cast(vd_frag[i, jj], "bfloat16")
            else:
                # ---------------- WG2: producer (warp 8; one elected lane issues the TMA loads) -----
                T.set_max_nreg(RP, 0)
                if tx < 288:
                    for ci in T.serial(nchunks):
                        j = ci % 2
                        ph = (ci // 2) % 2
                        t0 = bos + ci * C
                        r0 = (cslot + ci) * C
                        T.barrier_wait(empty[j], 1 - ph)
                        T.tma_copy(k[0, t0 : t0 + C, hk, 0:D], k_sh[j, :, :], barrier=full[j])
                        T.tma_copy(v[0, t0 : t0 + C, hv, v0 : v0 + BV], v_sh[j, :, :], barrier=full[j])
                        T.tma_copy(a_beta[hv, r0 : r0 + C, 0:C], a_sh[j, :, :], barrier=full[j])
                        T.tma_copy(gcs[hv, r0 : r0 + C], g_sh[j, :], barrier=full[j])
                        T.barrier_arrive(full[j])

    return gdn_bwd_h_ws


@functools.cache
def get_bwd_h_kernel(h_qk: int, h_v: int, has_init: bool, target_k=None):
    return compile_program(bwd_h_program(h_qk, h_v, has_init), target=parse_target(target_k), pass_configs=FAST_MATH)


def run_bwd_h(k, v, gcs, a_beta, stab, h_init, h_all=None, vnew=None, target=None):
    """Launch bwd_h; h_init [R,Hv,128,128] fp32 or None. Returns h_all, vnew (allocated when None)."""
    h_qk, h_v = k.shape[2], v.shape[2]
    ncs = gcs.shape[1] // CHUNK
    if h_all is None:
        h_all = torch.empty(h_v, ncs, HEAD_DIM, HEAD_DIM, device=k.device, dtype=torch.bfloat16)
    if vnew is None:
        vnew = torch.empty(h_v, ncs * CHUNK, HEAD_DIM, device=k.device, dtype=torch.bfloat16)
    has_init = h_init is not None
    kern = get_bwd_h_kernel(h_qk, h_v, has_init, target_key(target))
    if h_init is None:
        h_init = torch.empty(1, h_v, HEAD_DIM, HEAD_DIM, device=k.device, dtype=torch.float32)
    kern(k, v, gcs, a_beta, stab, h_init, h_all, vnew)
    return h_all, vnew
