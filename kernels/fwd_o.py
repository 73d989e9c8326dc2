"""Forward kernel 3: the chunk recurrence fused with the output, hand warp-specialised.

One CTA of 512 threads = 4 warpgroups per (V block of ``block_v`` = 64 or 32 columns, segment,
v-head); a segment is a run of whole chunks of one sequence (the whole sequence unless split,
``_common.segment_table``). Per chunk (C = 64 rows; g = chunk-local cumsum, g_last its last
valid value), FlashQLA's algebra with FLA's gated A_β (prep):

    Vd  = A_β (V − e^g ⊙ K S) = U₀ − W₀ S,   U₀ = A_β V,  W₀ = A_β diag(e^g) K   (= FLA's v_new)
    O   = scale·e^g ⊙ (Q S) + P Vd,           P = scale·Γ⊙QKᵀ, causal incl. diagonal (from prep)
    S  ← e^{g_last} S + Kᵀ (mask · e^{g_last − g} ⊙ Vd)

Roles:

    WG0 (tx   0..127, setmaxnreg 168)  owns the fp32 state S [128, bv] in registers:
            publish bf16 S to s_sh[c%2]; S *= e^{g_last}; wait V'; S += Kᵀ V'  (wgmma M = 128)
    WG1 (tx 128..255, setmaxnreg 160)  before S is ready: −W₀ (bf16 [64,128], w0_sh) and U₀ (in Vd's
            accumulator); then one wgmma Vd += (−W₀) S; Vd → vd_sh[c%2] (for WG2);
            V' = mask · e^{g_last − g} ⊙ Vd → vp_sh (for WG0)
    WG2 (tx 256..383, setmaxnreg 160)  O = Q S; O *= scale e^g; O += P Vd; store the valid o rows
    WG3 (tx 384..511, setmaxnreg 24)   producer: warp 12 (tx 384..415) waits, one elected lane issues
            expect_tx + TMA loads of Q, K, V, A_β, P, g of chunk c into stage c%2 (2 stages), all 32
            lanes arrive (the elected lane's expect_tx precedes its own arrive); warps 13-15 exit

Per-row factors (e^{g_last − g}, scale·e^g) are computed once per row into row fragments (the rows
of the thread's accumulator fragment); fast math (exp → ex2.approx).

Rows past the sequence end: their A_β rows and columns are 0 (prep), so Vd is 0 there; the Vd rows
fed into the state update are masked too, and their o rows are not stored. TMA loads of q/k/v may
read the next sequence's rows (zero-filled past T), which only meet masked products.

Inputs:  q, k [1,T,Hqk,128] bf16; v [1,T,Hv,128] bf16; gcs [Hv,NCS*64] fp32; a_beta, p_all
         [Hv,NCS*64,64] bf16 (prep); stab int32 [NS,8]; h_init [R,Hv,128,128] fp32 (row stab[s,4],
         read when ``has_init``); scale fp32.
Outputs: o [1,T,Hv,128] bf16; ht [N,Hv,128,128] fp32 (last segment of each sequence, ``has_ht``).

mbarriers (c = chunk index, j = c % 2, n = c // 2; "wait X[j] for c" = parity n % 2, "wait free
X[j] for c" = parity (n + 1) % 2, which passes at once for c = 0, 1 on a fresh barrier):

    full[j]     count 32  producer warp arrive (+ TMA tx bytes)        consumers wait parity n%2
    empty[j]    count 384 every consumer thread, end of chunk     producer waits parity (n+1)%2
    s_ready[j]  count 128 WG0 after writing s_sh[j] (+fence)       WG1, WG2 wait parity n%2
    s_free[j]   count 128 WG2 after its Q S gemm                  WG0 waits parity (n+1)%2
    vd_ready[j] count 128 WG1 after writing vd_sh[j] (+fence)      WG2 waits parity n%2
    vd_free[j]  count 128 WG2 after its P Vd gemm                  WG1 waits parity (n+1)%2
    vp_ready    count 128 WG1 after writing vp_sh (+fence)         WG0 waits parity c%2

No barrier can run two phases ahead of a waiter (docs/kernels.md): WG1's read of s_sh[j] is
ordered before WG0's next write of s_sh[j] by vp_ready; WG0's read of vp_sh (synchronous gemm) is
ordered before WG1's next write of vp_sh by s_ready. Generic-proxy smem writes that a wgmma of
another warpgroup reads are followed by fence.proxy.async before the arrive.
"""

import functools

import torch

from ._common import CHUNK, FAST_MATH, HEAD_DIM, check_heads, compile_program, parse_target, target_key

#: setmaxnreg budgets (registers / thread) of WG0 (state), WG1 (Vd), WG2 (O), WG3 (producer).
NREG = (168, 160, 160, 24)
assert sum(NREG) * 128 <= 65536 and all(r % 8 == 0 and 24 <= r <= 256 for r in NREG)


def fwd_o_program(h_qk: int, h_v: int, has_init: bool, has_ht: bool, block_v: int = 64):
    """The prim_func ``gdn_fwd_o_ws_p`` for one head config, state flags and V block (64 or 32)."""
    import tilelang.language as T

    G = check_heads(h_qk, h_v)
    C, D, BV = CHUNK, HEAD_DIM, block_v
    assert BV in (32, 64)
    NST = 2  # input ring depth (full/empty barriers); the S / Vd hand-offs are double-buffered too
    Tn = T.dynamic("T")
    NCS = T.dynamic("NCS")
    NS = T.dynamic("NS")
    R = T.dynamic("R")
    N = T.dynamic("N")
    R0, R1, R2, RP = NREG

    @T.macro
    def body(q, k, v, gcs, a_beta, p_all, stab, h_init, scale, o, ht):
        with T.Kernel(D // BV, NS * h_v, threads=512) as (bv, sh):
            s = sh // h_v
            hv = sh % h_v
            hk = hv // G
            v0 = bv * BV

            # NST-stage input ring (producer -> consumers)
            q_sh = T.alloc_shared((NST, C, D), "bfloat16")
            k_sh = T.alloc_shared((NST, C, D), "bfloat16")
            v_sh = T.alloc_shared((NST, C, BV), "bfloat16")
            a_sh = T.alloc_shared((NST, C, C), "bfloat16")
            pp_sh = T.alloc_shared((NST, C, C), "bfloat16")
            g_sh = T.alloc_shared((NST, C), "float32")
            # consumer <-> consumer hand-offs
            s_sh = T.alloc_shared((2, D, BV), "bfloat16")
            vd_sh = T.alloc_shared((2, C, BV), "bfloat16")
            vp_sh = T.alloc_shared((C, BV), "bfloat16")
            ae_sh = T.alloc_shared((C, C), "bfloat16")  # −A_β diag(e^g)
            w0_sh = T.alloc_shared((C, D), "bfloat16")  # −W₀

            s_frag = T.alloc_fragment((D, BV), "float32")
            w0_frag = T.alloc_fragment((C, D), "float32")
            vd_frag = T.alloc_fragment((C, BV), "float32")
            o_frag = T.alloc_fragment((C, BV), "float32")
            el1 = T.alloc_fragment((C,), "float32")  # WG1: mask · e^{g_last − g} per row of vd_frag
            eo2 = T.alloc_fragment((C,), "float32")  # WG2: scale · e^g per row of o_frag

            full = T.alloc_barrier([32] * NST)
            empty = T.alloc_barrier([384] * NST)
            s_ready = T.alloc_barrier([128, 128])
            s_free = T.alloc_barrier([128, 128])
            vd_ready = T.alloc_barrier([128, 128])
            vd_free = T.alloc_barrier([128, 128])
            vp_ready = T.alloc_barrier(128)

            bos = stab[s, 0]
            eos = stab[s, 1]
            seq = stab[s, 2]
            cslot = stab[s, 3]
            irow = stab[s, 4]
            is_last = stab[s, 5]
            nchunks = T.if_then_else(seq >= 0, T.ceildiv(eos - bos, C), 0)
            egl = T.alloc_var("float32")  # per thread: e^{g_last} (WG0)

            tx = T.get_thread_binding()

            if tx < 128:
                # ---------------- WG0: state owner ----------------
                T.set_max_nreg(R0, 1)
                if has_init:
                    T.copy(h_init[irow, hv, 0:D, v0 : v0 + BV], s_frag)
                else:
                    T.clear(s_frag)
                for ci in T.serial(nchunks):
                    j = ci % 2
                    ph = (ci // 2) % 2
                    js = ci % NST
                    ps = (ci // NST) % 2
                    ln = T.min(eos - (bos + ci * C), C)
                    T.barrier_wait(s_free[j], 1 - ph)
                    T.copy(s_frag, s_sh[j, :, :])
                    T.fence_proxy_async()
                    T.barrier_arrive(s_ready[j])
                    T.barrier_wait(full[js], ps)
                    egl = T.exp(g_sh[js, ln - 1])
                    for i, jj in T.Parallel(D, BV):
                        s_frag[i, jj] = s_frag[i, jj] * egl
                    T.barrier_wait(vp_ready[0], ci % 2)
                    T.gemm(k_sh[js, :, :], vp_sh, s_frag, transpose_A=True)
                    T.barrier_arrive(empty[js])
                if has_ht:
                    if is_last == 1:
                        T.copy(s_frag, ht[seq, hv, 0:D, v0 : v0 + BV])
            elif tx < 256:
                # ---------------- WG1: Vd = U₀ − W₀ S, V' ----------------
                T.set_max_nreg(R1, 1)
                for ci in T.serial(nchunks):
                    j = ci % 2
                    ph = (ci // 2) % 2
                    js = ci % NST
                    ps = (ci // NST) % 2
                    ln = T.min(eos - (bos + ci * C), C)
                    T.barrier_wait(full[js], ps)
                    # off the chain (S not needed): −W₀ = −A_β diag(e^g) K and U₀ = A_β V
                    for i in T.Parallel(C):
                        el1[i] = T.if_then_else(i < ln, T.exp(g_sh[js, ln - 1] - g_sh[js, i]), T.float32(0))
                    for i, jj in T.Parallel(C, C):
                        ae_sh[i, jj] = T.cast(-T.cast(a_sh[js, i, jj], "float32") * T.exp(g_sh[js, jj]), "bfloat16")
                    T.fence_proxy_async()
                    T.gemm(ae_sh, k_sh[js, :, :], w0_frag, clear_accum=True)
                    for i, jj in T.Parallel(C, D):
                        w0_sh[i, jj] = T.cast(w0_frag[i, jj], "bfloat16")
                    T.fence_proxy_async()
                    T.gemm(a_sh[js, :, :], v_sh[js, :, :], vd_frag, clear_accum=True)
                    # on the chain: Vd = U₀ − W₀ S
                    T.barrier_wait(s_ready[j], ph)
                    T.gemm(w0_sh, s_sh[j, :, :], vd_frag)
                    T.barrier_wait(vd_free[j], 1 - ph)
                    for i, jj in T.Parallel(C, BV):
                        vd_sh[j, i, jj] = T.cast(vd_frag[i, jj], "bfloat16")
                        vp_sh[i, jj] = T.cast(el1[i] * vd_frag[i, jj], "bfloat16")
                    T.fence_proxy_async()
                    T.barrier_arrive(vd_ready[j])
                    T.barrier_arrive(vp_ready[0])
                    T.barrier_arrive(empty[js])
            elif tx < 384:
                # ---------------- WG2: O = scale e^g ⊙ (Q S) + P Vd ----------------
                T.set_max_nreg(R2, 1)
                for ci in T.serial(nchunks):
                    j = ci % 2
                    ph = (ci // 2) % 2
                    js = ci % NST
                    ps = (ci // NST) % 2
                    t0 = bos + ci * C
                    ln = T.min(eos - t0, C)
                    T.barrier_wait(full[js], ps)
                    for i in T.Parallel(C):
                        eo2[i] = scale * T.exp(g_sh[js, i])
                    T.barrier_wait(s_ready[j], ph)
                    T.gemm(q_sh[js, :, :], s_sh[j, :, :], o_frag, clear_accum=True)
                    T.barrier_arrive(s_free[j])
                    for i, jj in T.Parallel(C, BV):
                        o_frag[i, jj] = o_frag[i, jj] * eo2[i]
                    T.barrier_wait(vd_ready[j], ph)
                    T.gemm(pp_sh[js, :, :], vd_sh[j, :, :], o_frag)
                    T.barrier_arrive(vd_free[j])
                    T.barrier_arrive(empty[js])
                    for i, jj in T.Parallel(C, BV):
                        if i < ln:
                            o[0, t0 + i, hv, v0 + jj] = T.cast(o_frag[i, jj], "bfloat16")
            else:
                # ---------------- WG3: producer (warp 12; one elected lane issues the TMA loads) -----
                T.set_max_nreg(RP, 0)
                if tx < 416:
                    for ci in T.serial(nchunks):
                        js = ci % NST
                        ps = (ci // NST) % 2
                        t0 = bos + ci * C
                        r0 = (cslot + ci) * C
                        T.barrier_wait(empty[js], 1 - ps)
                        T.tma_copy(q[0, t0 : t0 + C, hk, 0:D], q_sh[js, :, :], barrier=full[js])
                        T.tma_copy(k[0, t0 : t0 + C, hk, 0:D], k_sh[js, :, :], barrier=full[js])
                        T.tma_copy(v[0, t0 : t0 + C, hv, v0 : v0 + BV], v_sh[js, :, :], barrier=full[js])
                        T.tma_copy(a_beta[hv, r0 : r0 + C, 0:C], a_sh[js, :, :], barrier=full[js])
                        T.tma_copy(p_all[hv, r0 : r0 + C, 0:C], pp_sh[js, :, :], barrier=full[js])
                        T.tma_copy(gcs[hv, r0 : r0 + C], g_sh[js, :], barrier=full[js])
                        T.barrier_arrive(full[js])

    @T.prim_func
    def gdn_fwd_o_ws_p(
        q: T.Tensor((1, Tn, h_qk, D), "bfloat16"),
        k: T.Tensor((1, Tn, h_qk, D), "bfloat16"),
        v: T.Tensor((1, Tn, h_v, D), "bfloat16"),
        gcs: T.Tensor((h_v, NCS * C), "float32"),
        a_beta: T.Tensor((h_v, NCS * C, C), "bfloat16"),
        p_all: T.Tensor((h_v, NCS * C, C), "bfloat16"),
        stab: T.Tensor((NS, 8), "int32"),
        h_init: T.Tensor((R, h_v, D, D), "float32"),
        scale: T.float32,
        o: T.Tensor((1, Tn, h_v, D), "bfloat16"),
        ht: T.Tensor((N, h_v, D, D), "float32"),
    ):
        body(q, k, v, gcs, a_beta, p_all, stab, h_init, scale, o, ht)

    return gdn_fwd_o_ws_p


@functools.cache
def get_fwd_o_kernel(h_qk: int, h_v: int, has_init: bool, has_ht: bool, block_v: int = 64, target_k=None):
    return compile_program(
        fwd_o_program(h_qk, h_v, has_init, has_ht, block_v), target=parse_target(target_k), pass_configs=FAST_MATH
    )


def run_fwd_o(q, k, v, gcs, a_beta, p_all, stab, h_init, scale, o, ht, block_v=64, target=None):
    """Launch fwd_o; writes ``o`` (and ``ht`` if given) in place.

    q, k [1,T,Hqk,128] bf16; v [1,T,Hv,128] bf16; gcs [Hv,NCS*64] fp32, a_beta and p_all
    [Hv,NCS*64,64] bf16 (prep); stab int32 [NS,8]; h_init [R,Hv,128,128] fp32 (row stab[s, 4]) or
    None; o [1,T,Hv,128] bf16; ht [N,Hv,128,128] fp32 or None (written by each sequence's last segment).
    """
    h_qk, h_v = q.shape[2], v.shape[2]
    has_init, has_ht = h_init is not None, ht is not None
    kern = get_fwd_o_kernel(h_qk, h_v, has_init, has_ht, block_v, target_key(target))
    dummy = None
    if not (has_init and has_ht):
        dummy = torch.empty(1, h_v, HEAD_DIM, HEAD_DIM, device=q.device, dtype=torch.float32)
    kern(q, k, v, gcs, a_beta, p_all, stab, h_init if has_init else dummy, float(scale), o, ht if has_ht else dummy)
    return o, ht
