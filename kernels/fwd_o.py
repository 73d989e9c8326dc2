"""fwd_o, hand warp-specialised (variant ``fwd_ws=1``): same inputs, outputs and algebra as fwd_o.py.

One CTA of 512 threads = 4 warpgroups per (V block, segment, v-head), chunks walked in order:

    WG0 (tx   0..127, setmaxnreg 168)  owns the fp32 state S [128, bv] in registers:
            publish bf16 S to s_sh[i%2]; S *= e^{g_last}; wait V'; S += Kᵀ V'  (wgmma M = 128)
    WG1 (tx 128..255, setmaxnreg 160)  U = K S; W = V − e^g ⊙ U (w_sh); Vd = A_β W;
            Vd → vd_sh[i%2] (for WG2); V' = mask · e^{g_last − g} ⊙ Vd → vp_sh (for WG0)
    WG2 (tx 256..383, setmaxnreg 160)  P = Q Kᵀ (needs no S); P ← scale·Γ⊙P (causal incl. diag);
            O = Q S; O *= scale e^g; O += P Vd; store the valid o rows
    WG3 (tx 384..511, setmaxnreg 24)   producer: warp 12 (tx 384..415) waits, one elected lane issues
            expect_tx + TMA loads of Q, K, V, A_β, g of chunk i into stage i%2 (2 stages), all 32 lanes
            arrive (the elected lane's expect_tx precedes its own arrive); warps 13-15 exit

mbarriers (c = chunk index, j = c % 2, n = c // 2; "wait X[j] for c" = parity n % 2, "wait free
X[j] for c" = parity (n + 1) % 2, which passes at once for c = 0, 1 on a fresh barrier):

    full[j]     count 32  producer warp arrive (+ TMA tx bytes)        consumers wait parity n%2
    empty[j]    count 384 every consumer thread, end of chunk     producer waits parity (n+1)%2
    s_ready[j]  count 128 WG0 after writing s_sh[j] (+fence)       WG1, WG2 wait parity n%2
    s_free[j]   count 128 WG2 after its Q S gemm                  WG0 waits parity (n+1)%2
    vd_ready[j] count 128 WG1 after writing vd_sh[j] (+fence)      WG2 waits parity n%2
    vd_free[j]  count 128 WG2 after its P Vd gemm                  WG1 waits parity (n+1)%2
    vp_ready    count 128 WG1 after writing vp_sh (+fence)         WG0 waits parity c%2

No barrier can run two phases ahead of a waiter (see NOTES.md): WG1's read of s_sh[j] (K S) is
ordered before WG0's next write of s_sh[j] by vp_ready; WG0's read of vp_sh (synchronous gemm) is
ordered before WG1's next write of vp_sh by s_ready. Generic-proxy smem writes that a wgmma of
another warpgroup reads are followed by fence.proxy.async before the arrive.
"""

import functools
import json

from ._common import CHUNK, HEAD_DIM, check_heads, compile_program

#: setmaxnreg budgets (registers / thread) of WG0 (state), WG1 (U/W/Vd), WG2 (P/O), WG3 (producer).
NREG = (168, 160, 160, 24)
assert sum(NREG) * 128 <= 65536 and all(r % 8 == 0 and 24 <= r <= 256 for r in NREG)


def fwd_o_ws_program(
    h_qk: int, h_v: int, has_init: bool, has_ht: bool, block_v: int = 64, stages: int = 2, rowexp: bool = False,
    pload: bool = False, uw: bool = False,
):
    """rowexp (variant ``rowexp=1``): the per-row factors e^g, mask·e^{g_last − g} (WG1) and
    scale·e^g (WG2) are computed once per row into row fragments (two values per thread, the
    rows of its wgmma accumulator fragment) before the S hand-off, instead of one exp and one
    shared-memory load of g per element inside the W, V' and O passes on the critical chain.

    pload (variant ``pprep=1``; implies rowexp): P = scale·Γ⊙QKᵀ comes precomputed (by prep,
    p_all [Hv, NCS*64, 64] bf16, an extra argument after a_beta) and is TMA-loaded into the input
    ring with the chunk's other inputs: WG2 no longer computes Q Kᵀ and the per-element P pass
    (the H200 profile found WG2 the busiest role, the one the others waited for). WG2 per chunk:
    O = Q S; O *= scale·e^g; O += P Vd; store. The kernel is then named gdn_fwd_o_ws_p.

    uw (variant ``uw=1``, with pload): WG1 takes the S-independent part off the chain. With
    W₀ = A_β diag(e^g) K and U₀ = A_β V, Vd = A_β (V − e^g ⊙ K S) = U₀ − W₀ S, so per chunk WG1
    computes −W₀ (bf16, [64, 128]) and U₀ (into Vd's accumulator) while WG0 updates S, and after
    the S hand-off runs ONE wgmma (Vd += (−W₀) S) instead of K S, the W pass and A_β W."""
    import tilelang.language as T

    assert not uw or pload, "uw is a mode of the P-loading kernel"
    rowexp = rowexp or pload
    G = check_heads(h_qk, h_v)
    C, D, BV = CHUNK, HEAD_DIM, block_v
    assert D % BV == 0 and BV in ((32, 64) if pload else (32, 64, 128))
    NST = stages  # input ring depth (full/empty barriers); the S / Vd hand-offs stay double-buffered
    assert NST in (2, 3)
    assert not pload or NST == 2 or BV == 32, "a 3-deep ring with the P tiles needs > 227 KB shared memory at block_v 64"
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
            pp_sh = T.alloc_shared((NST, C, C), "bfloat16") if pload else None
            g_sh = T.alloc_shared((NST, C), "float32")
            # consumer <-> consumer hand-offs
            s_sh = T.alloc_shared((2, D, BV), "bfloat16")
            vd_sh = T.alloc_shared((2, C, BV), "bfloat16")
            vp_sh = T.alloc_shared((C, BV), "bfloat16")
            w_sh = T.alloc_shared((C, BV), "bfloat16") if not uw else None
            ae_sh = T.alloc_shared((C, C), "bfloat16") if uw else None  # uw: −A_β diag(e^g)
            w0_sh = T.alloc_shared((C, D), "bfloat16") if uw else None  # uw: −W₀
            p_sh = T.alloc_shared((C, C), "bfloat16") if not pload else None

            s_frag = T.alloc_fragment((D, BV), "float32")
            u_frag = T.alloc_fragment((C, BV), "float32") if not uw else None
            w0_frag = T.alloc_fragment((C, D), "float32") if uw else None
            vd_frag = T.alloc_fragment((C, BV), "float32")
            p_frag = T.alloc_fragment((C, C), "float32") if not pload else None
            o_frag = T.alloc_fragment((C, BV), "float32")
            if rowexp:
                eg1 = T.alloc_fragment((C,), "float32") if not uw else None  # WG1: e^g per row of u_frag
                el1 = T.alloc_fragment((C,), "float32")  # WG1: mask · e^{g_last − g} per row of vd_frag
                eo2 = T.alloc_fragment((C,), "float32")  # WG2: scale · e^g per row of o_frag
                gi2 = T.alloc_fragment((C,), "float32") if not pload else None  # WG2: g per row of p_frag

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
                # ---------------- WG1: U = K S, W, Vd, V' ----------------
                T.set_max_nreg(R1, 1)
                for ci in T.serial(nchunks):
                    j = ci % 2
                    ph = (ci // 2) % 2
                    js = ci % NST
                    ps = (ci // NST) % 2
                    ln = T.min(eos - (bos + ci * C), C)
                    T.barrier_wait(full[js], ps)
                    if uw:
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
                    else:
                        if rowexp:
                            for i in T.Parallel(C):
                                eg1[i] = T.exp(g_sh[js, i])
                            for i in T.Parallel(C):
                                el1[i] = T.if_then_else(i < ln, T.exp(g_sh[js, ln - 1] - g_sh[js, i]), T.float32(0))
                        T.barrier_wait(s_ready[j], ph)
                        T.gemm(k_sh[js, :, :], s_sh[j, :, :], u_frag, clear_accum=True)
                        if rowexp:
                            for i, jj in T.Parallel(C, BV):
                                w_sh[i, jj] = T.cast(
                                    T.cast(v_sh[js, i, jj], "float32") - eg1[i] * u_frag[i, jj], "bfloat16"
                                )
                        else:
                            for i, jj in T.Parallel(C, BV):
                                w_sh[i, jj] = T.cast(
                                    T.cast(v_sh[js, i, jj], "float32") - T.exp(g_sh[js, i]) * u_frag[i, jj], "bfloat16"
                                )
                        T.fence_proxy_async()  # w_sh: generic writes -> wgmma reads
                        T.gemm(a_sh[js, :, :], w_sh, vd_frag, clear_accum=True)
                    T.barrier_wait(vd_free[j], 1 - ph)
                    if rowexp:
                        for i, jj in T.Parallel(C, BV):
                            vd_sh[j, i, jj] = T.cast(vd_frag[i, jj], "bfloat16")
                            vp_sh[i, jj] = T.cast(el1[i] * vd_frag[i, jj], "bfloat16")
                    else:
                        for i, jj in T.Parallel(C, BV):
                            vd_sh[j, i, jj] = T.cast(vd_frag[i, jj], "bfloat16")
                            vp_sh[i, jj] = T.cast(
                                T.if_then_else(
                                    i < ln, T.exp(g_sh[js, ln - 1] - g_sh[js, i]) * vd_frag[i, jj], T.float32(0)
                                ),
                                "bfloat16",
                            )
                    T.fence_proxy_async()
                    T.barrier_arrive(vd_ready[j])
                    T.barrier_arrive(vp_ready[0])
                    T.barrier_arrive(empty[js])
            elif tx < 384:
                # ---------------- WG2: P = Γ⊙QKᵀ, O ----------------
                T.set_max_nreg(R2, 1)
                for ci in T.serial(nchunks):
                    j = ci % 2
                    ph = (ci // 2) % 2
                    js = ci % NST
                    ps = (ci // NST) % 2
                    t0 = bos + ci * C
                    ln = T.min(eos - t0, C)
                    T.barrier_wait(full[js], ps)
                    if pload:
                        for i in T.Parallel(C):
                            eo2[i] = scale * T.exp(g_sh[js, i])
                    else:
                        T.gemm(q_sh[js, :, :], k_sh[js, :, :], p_frag, transpose_B=True, clear_accum=True)
                        if rowexp:
                            for i in T.Parallel(C):
                                gi2[i] = g_sh[js, i]
                            for i in T.Parallel(C):
                                eo2[i] = scale * T.exp(g_sh[js, i])
                            for i, jj in T.Parallel(C, C):
                                p_sh[i, jj] = T.cast(
                                    T.if_then_else(i >= jj, scale * T.exp(gi2[i] - g_sh[js, jj]) * p_frag[i, jj], T.float32(0)),
                                    "bfloat16",
                                )
                        else:
                            for i, jj in T.Parallel(C, C):
                                p_sh[i, jj] = T.cast(
                                    T.if_then_else(
                                        i >= jj, scale * T.exp(g_sh[js, i] - g_sh[js, jj]) * p_frag[i, jj], T.float32(0)
                                    ),
                                    "bfloat16",
                                )
                        T.fence_proxy_async()  # p_sh: generic writes -> wgmma reads
                    T.barrier_wait(s_ready[j], ph)
                    T.gemm(q_sh[js, :, :], s_sh[j, :, :], o_frag, clear_accum=True)
                    T.barrier_arrive(s_free[j])
                    if rowexp:
                        for i, jj in T.Parallel(C, BV):
                            o_frag[i, jj] = o_frag[i, jj] * eo2[i]
                    else:
                        for i, jj in T.Parallel(C, BV):
                            o_frag[i, jj] = o_frag[i, jj] * (scale * T.exp(g_sh[js, i]))
                    T.barrier_wait(vd_ready[j], ph)
                    if pload:
                        T.gemm(pp_sh[js, :, :], vd_sh[j, :, :], o_frag)
                    else:
                        T.gemm(p_sh, vd_sh[j, :, :], o_frag)
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
                        if pload:
                            T.tma_copy(p_all[hv, r0 : r0 + C, 0:C], pp_sh[js, :, :], barrier=full[js])
                        T.tma_copy(gcs[hv, r0 : r0 + C], g_sh[js, :], barrier=full[js])
                        T.barrier_arrive(full[js])

    if pload:

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

    @T.prim_func
    def gdn_fwd_o_ws(
        q: T.Tensor((1, Tn, h_qk, D), "bfloat16"),
        k: T.Tensor((1, Tn, h_qk, D), "bfloat16"),
        v: T.Tensor((1, Tn, h_v, D), "bfloat16"),
        gcs: T.Tensor((h_v, NCS * C), "float32"),
        a_beta: T.Tensor((h_v, NCS * C, C), "bfloat16"),
        stab: T.Tensor((NS, 8), "int32"),
        h_init: T.Tensor((R, h_v, D, D), "float32"),
        scale: T.float32,
        o: T.Tensor((1, Tn, h_v, D), "bfloat16"),
        ht: T.Tensor((N, h_v, D, D), "float32"),
    ):
        body(q, k, v, gcs, a_beta, None, stab, h_init, scale, o, ht)

    return gdn_fwd_o_ws


@functools.cache
def get_fwd_o_ws_kernel(
    h_qk: int, h_v: int, has_init: bool, has_ht: bool, block_v: int = 64, target_k=None, fastmath: bool = False,
    stages: int = 2, rowexp: bool = False,
):
    target = json.loads(target_k) if target_k and target_k.startswith("{") else target_k
    return compile_program(
        fwd_o_ws_program(h_qk, h_v, has_init, has_ht, block_v, stages, rowexp),
        target=target,
        pass_configs={"tl.enable_fast_math": True} if fastmath else None,
    )


def fwd_o_ws_p_program(
    h_qk: int, h_v: int, has_init: bool, has_ht: bool, block_v: int = 64, stages: int = 2, uw: bool = False
):
    """Variant ``pprep=1`` (P loaded, see ``fwd_o_ws_program``'s pload)."""
    return fwd_o_ws_program(h_qk, h_v, has_init, has_ht, block_v, stages, rowexp=True, pload=True, uw=uw)


@functools.cache
def get_fwd_o_ws_p_kernel(
    h_qk: int, h_v: int, has_init: bool, has_ht: bool, block_v: int = 64, target_k=None, stages: int = 2,
    uw: bool = False,
):
    target = json.loads(target_k) if target_k and target_k.startswith("{") else target_k
    return compile_program(
        fwd_o_ws_p_program(h_qk, h_v, has_init, has_ht, block_v, stages, uw),
        target=target,
        pass_configs={"tl.enable_fast_math": True},
    )
