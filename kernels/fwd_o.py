"""Kernel 3 of the forward: the chunk recurrence fused with the output (FlashQLA-style algebra).

One CTA (128 threads = one warpgroup by default; ``threads=256`` lets TileLang split every GEMM
over two warpgroups) per (V block of ``block_v`` columns, segment, v-head).
A segment is a run of whole chunks of one sequence (``_common.segment_table``); without
sequence splitting a segment is the whole sequence. The CTA keeps its state block
S [128, block_v] in fp32 registers and walks the segment's chunks in order. Per chunk
(C = 64 rows; g = chunk-local cumsum, g_last its last valid value):

    U   = K S                         wgmma  [64,128]x[128,bv]
    W   = V − diag(e^g) U             (bf16 to shared)
    Vd  = A_β W                       wgmma  [64,64]x[64,bv]     (= FLA's v_new)
    O   = scale·diag(e^g) Q S + (scale · Γ ⊙ Q Kᵀ ⊙ causal-with-diagonal) Vd
    S  ← e^{g_last} S + Kᵀ diag(e^{g_last − g}) Vd                wgmma  M = 128

which equals FLA's h / v_new / o computation (v_new = u − w h with u = A diag(β) V and
w = A diag(β e^g) K, so v_new = A_β (V − diag(e^g) K h)).

Rows past the sequence end: their A_β rows and columns are 0 (prep kernel), so Vd is 0 there,
and the Vd rows fed into the state update are also masked explicitly; their o rows are not
stored. Loads of q/k/v may read the next sequence's rows (never past T: guarded), which
only reach masked products.

Inputs:
    q, k [1, T, Hqk, 128] bf16    v [1, T, Hv, 128] bf16
    gcs [Hv, NCS*64] fp32, a_beta [Hv, NCS*64, 64] bf16     (prep kernel)
    stab int32 [NS, 8]            (segment table)
    h_init [R, Hv, 128, 128] fp32 (row stab[s, 4]; only read when ``has_init``)
    scale fp32 scalar
Outputs:
    o [1, T, Hv, 128] bf16
    ht [N, Hv, 128, 128] fp32     (written for segments with is_last when ``has_ht``)
"""

import functools
import json

import torch

from ._common import CHUNK, HEAD_DIM, check_heads, chunk_loop_stages, compile_program, target_key


def fwd_o_program(
    h_qk: int, h_v: int, has_init: bool, has_ht: bool, block_v: int = 64, num_stages: int = 0, threads: int = 128
):
    import tilelang.language as T

    G = check_heads(h_qk, h_v)
    C, D, BV = CHUNK, HEAD_DIM, block_v
    assert D % BV == 0
    Tn = T.dynamic("T")
    NCS = T.dynamic("NCS")
    NS = T.dynamic("NS")
    R = T.dynamic("R")
    N = T.dynamic("N")

    @T.prim_func
    def gdn_fwd_o(
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
        with T.Kernel(D // BV, NS * h_v, threads=threads) as (bv, sh):
            s = sh // h_v
            hv = sh % h_v
            hk = hv // G
            v0 = bv * BV

            q_sh = T.alloc_shared((C, D), "bfloat16")
            k_sh = T.alloc_shared((C, D), "bfloat16")
            v_sh = T.alloc_shared((C, BV), "bfloat16")
            a_sh = T.alloc_shared((C, C), "bfloat16")
            s_sh = T.alloc_shared((D, BV), "bfloat16")
            w_sh = T.alloc_shared((C, BV), "bfloat16")
            vd_sh = T.alloc_shared((C, BV), "bfloat16")
            vp_sh = T.alloc_shared((C, BV), "bfloat16")
            p_sh = T.alloc_shared((C, C), "bfloat16")
            g_sh = T.alloc_shared((C,), "float32")

            s_frag = T.alloc_fragment((D, BV), "float32")
            u_frag = T.alloc_fragment((C, BV), "float32")
            o_frag = T.alloc_fragment((C, BV), "float32")
            vd_frag = T.alloc_fragment((C, BV), "float32")
            p_frag = T.alloc_fragment((C, C), "float32")
            glast = T.alloc_var("float32")

            bos = stab[s, 0]
            eos = stab[s, 1]
            seq = stab[s, 2]
            cslot = stab[s, 3]
            irow = stab[s, 4]
            is_last = stab[s, 5]
            nchunks = T.if_then_else(seq >= 0, T.ceildiv(eos - bos, C), 0)

            if has_init:
                T.copy(h_init[irow, hv, 0:D, v0 : v0 + BV], s_frag)
            else:
                T.clear(s_frag)

            for ci in T.Pipelined(nchunks, num_stages=num_stages) if num_stages else T.serial(nchunks):
                t0 = bos + ci * C
                ln = T.min(eos - t0, C)
                r0 = (cslot + ci) * C
                T.copy(q[0, t0 : t0 + C, hk, 0:D], q_sh)
                T.copy(k[0, t0 : t0 + C, hk, 0:D], k_sh)
                T.copy(v[0, t0 : t0 + C, hv, v0 : v0 + BV], v_sh)
                T.copy(a_beta[hv, r0 : r0 + C, 0:C], a_sh)
                T.copy(gcs[hv, r0 : r0 + C], g_sh)
                T.copy(s_frag, s_sh)

                T.gemm(k_sh, s_sh, u_frag, clear_accum=True)
                T.gemm(q_sh, s_sh, o_frag, clear_accum=True)
                T.gemm(q_sh, k_sh, p_frag, transpose_B=True, clear_accum=True)

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
                for i, j in T.Parallel(C, C):
                    p_sh[i, j] = T.cast(
                        T.if_then_else(i >= j, scale * T.exp(g_sh[i] - g_sh[j]) * p_frag[i, j], T.float32(0)),
                        "bfloat16",
                    )
                for i, j in T.Parallel(C, BV):
                    o_frag[i, j] = o_frag[i, j] * (scale * T.exp(g_sh[i]))
                T.gemm(p_sh, vd_sh, o_frag)

                for i, j in T.Parallel(C, BV):
                    if i < ln:
                        o[0, t0 + i, hv, v0 + j] = T.cast(o_frag[i, j], "bfloat16")

                for i, j in T.Parallel(D, BV):
                    s_frag[i, j] = s_frag[i, j] * T.exp(glast)
                T.gemm(k_sh, vp_sh, s_frag, transpose_A=True)

            if has_ht:
                if is_last == 1:
                    T.copy(s_frag, ht[seq, hv, 0:D, v0 : v0 + BV])

    return gdn_fwd_o


@functools.cache
def get_fwd_o_kernel(
    h_qk: int,
    h_v: int,
    has_init: bool,
    has_ht: bool,
    block_v: int = 64,
    num_stages: int = 0,
    target_k=None,
    threads: int = 128,
    fastmath: bool = False,
):
    target = json.loads(target_k) if target_k and target_k.startswith("{") else target_k
    return compile_program(
        fwd_o_program(h_qk, h_v, has_init, has_ht, block_v, num_stages, threads),
        target=target,
        pass_configs={"tl.enable_fast_math": True} if fastmath else None,
    )


def run_fwd_o(
    q, k, v, gcs, a_beta, stab, h_init, scale, o, ht, block_v=64, num_stages=None, target=None, threads=128,
    fastmath=False, ws=False, ws_stages=2, rowexp=False, p_all=None, uw=False,
):
    """Launch the fused recurrence + output kernel; writes ``o`` (and ``ht`` if given) in place.

    h_init: [R, Hv, 128, 128] fp32 or None.  ht: [N, Hv, 128, 128] fp32 or None.
    ws: the hand warp-specialised kernel (fwd_o_ws.py; same interface; ignores num_stages, threads);
    ws_stages: its input ring depth (2 or 3); rowexp: its per-row exps once per chunk (variant rowexp=1).
    p_all: P = scale·Γ⊙QKᵀ written by prep (variant pprep=1; ws only): the kernel loads it.
    uw: with p_all, the S-independent −W₀ = −A_β diag(e^g) K and U₀ = A_β V off the chain (variant uw=1).
    """
    h_qk, h_v = q.shape[2], v.shape[2]
    has_init, has_ht = h_init is not None, ht is not None
    if p_all is not None:
        if not ws:
            raise ValueError("p_all (variant pprep=1) needs the warp-specialised fwd_o (fwd_ws=1)")
        from .fwd_o_ws import get_fwd_o_ws_p_kernel

        kw = {"uw": True} if uw else {}
        kern = get_fwd_o_ws_p_kernel(
            h_qk, h_v, has_init, has_ht, block_v, target_k=target_key(target), stages=ws_stages, **kw
        )
        dummy = None
        if h_init is None or ht is None:
            dummy = torch.empty(1, h_v, HEAD_DIM, HEAD_DIM, device=q.device, dtype=torch.float32)
        kern(q, k, v, gcs, a_beta, p_all, stab, h_init if has_init else dummy, float(scale), o, ht if has_ht else dummy)
        return o, ht
    if ws:
        from .fwd_o_ws import get_fwd_o_ws_kernel

        kw = {"rowexp": True} if rowexp else {}  # off: the same call (and cache entry) as before the knob
        kern = get_fwd_o_ws_kernel(
            h_qk, h_v, has_init, has_ht, block_v, target_k=target_key(target), fastmath=fastmath, stages=ws_stages, **kw
        )
    else:
        if num_stages is None:
            num_stages = chunk_loop_stages()
        if fastmath:
            kern = get_fwd_o_kernel(h_qk, h_v, has_init, has_ht, block_v, num_stages, target_key(target), threads, True)
        else:  # same cache key as before the variants existed
            kern = get_fwd_o_kernel(h_qk, h_v, has_init, has_ht, block_v, num_stages, target_key(target), threads)
    dummy = None
    if h_init is None or ht is None:
        dummy = torch.empty(1, h_v, HEAD_DIM, HEAD_DIM, device=q.device, dtype=torch.float32)
    kern(q, k, v, gcs, a_beta, stab, h_init if has_init else dummy, float(scale), o, ht if has_ht else dummy)
    return o, ht
