"""Backward kernel 2: the reverse state-gradient recurrence, fused with dv_local (FLA's
``chunk_bwd_dv_local`` + ``chunk_gated_delta_rule_bwd_dhu``).

One CTA (128 threads; 256 with ``stages=2``) per (V block of ``block_v`` columns, segment, v-head);
segments are one per sequence (unsplit table) or cut by ``split`` (below). dH [128, block_v] (the
gradient of the state at the END of the current chunk) stays in fp32 registers, starting from
d(final state) (or 0); chunks in reverse:

    dh[slot] = bf16(dH)
    Pᵀ       = scale · Γᵀ ⊙ K Qᵀ    (i ≥ j, i.e. upper incl. diagonal in [j, i])      wgmma
    dv_new   = Pᵀ dO + e^{g_l − g} ⊙ (K dH)                                        wgmma ×2
    Y        = A_βᵀ dv_new                                                          wgmma
    dH      ← e^{g_l} dH + Qᵀ (scale e^g ⊙ dO) − Kᵀ (e^g ⊙ Y)                    wgmma M = 128
    dh0      = dH after the first chunk (when ``has_dh0``)

Loads of q, k, dO are masked to 0 past the chunk's valid rows (``stages=0``; with ``stages=2`` they
are unmasked TMA loads and the element passes mask instead), so padded rows contribute
nothing and dv_new rows past the end are 0.

Inputs:  q, k [1,T,Hqk,128] bf16, gcs, a_beta (forward prep), do [1,T,Hv,128] bf16,
         dht [N,Hv,128,128] fp32 (read when ``has_dht``), stab int32 [NS,8], scale.
Outputs: dh_all [Hv, NCS, 128, 128] bf16, dvnew [Hv, NCS*64, 128] bf16,
         dh0 [N, Hv, 128, 128] fp32 (written when ``has_dh0``; row = sequence).
"""

import functools
import json

import torch

from ._common import CHUNK, HEAD_DIM, check_heads, compile_program, target_key


def dh_io_macros(split: str, has_dht: bool, has_dh0: bool, D: int, BV: int):
    """The start and the end of one (V block, segment, v-head) walk of the reverse chain, shared by
    bwd_dhu and bwd_dhu_ws: ``dh_start`` loads dH at the segment's end (d(final state), the
    reverse fix-up's d_end, or 0, by ``split`` and ``has_dht``); ``dh_end`` writes dH at its start
    (dh0 by sequence, or F by segment in pass 1). ``is_last`` / ``is_first`` come from the split
    table; unsplit programs pass 0 (not read). The parameter names match the callers' variables,
    which keeps the generated CUDA the same as with the code written inline."""
    import tilelang.language as T

    @T.macro
    def dh_start(dh_frag, dht, s, seq, hv, v0, is_last):
        if split == "carry":
            T.copy(dht[s, hv, 0:D, v0 : v0 + BV], dh_frag)
        elif split == "seg" and has_dht:
            if seq >= 0 and is_last == 1:
                T.copy(dht[seq, hv, 0:D, v0 : v0 + BV], dh_frag)
            else:
                T.clear(dh_frag)
        elif has_dht:
            if seq >= 0:
                T.copy(dht[seq, hv, 0:D, v0 : v0 + BV], dh_frag)
            else:
                T.clear(dh_frag)
        else:
            T.clear(dh_frag)

    @T.macro
    def dh_end(dh_frag, dh0, s, seq, hv, v0, is_first):
        if split == "seg":
            if seq >= 0 and is_first == 0:
                T.copy(dh_frag, dh0[s, hv, 0:D, v0 : v0 + BV])
        elif split == "carry" and has_dh0:
            if seq >= 0 and is_first == 1:
                T.copy(dh_frag, dh0[seq, hv, 0:D, v0 : v0 + BV])
        elif has_dh0:
            if seq >= 0:
                T.copy(dh_frag, dh0[seq, hv, 0:D, v0 : v0 + BV])

    return dh_start, dh_end


def bwd_dhu_program(
    h_qk: int, h_v: int, has_dht: bool, has_dh0: bool, block_v: int = 64, rowexp: bool = False, split: str = "",
    stages: int = 0,
):
    """rowexp (variant ``rowexp=1``): mask·e^{g_l − g} and e^g once per row into row fragments and
    e^{g_l} once per chunk, instead of one exp (and g load) per element of the dv, qdo / ky and
    dH-decay passes (compiled with fast math).

    split (sequences cut into segments, ``stab`` from a split segment table; the adjoint of the
    forward's seg_state / fixup):
      "seg"   pass 1: every segment but the first of its sequence walks its chunks from
              dH_end = d(final state) (the last segment, when ``has_dht``) or 0 and writes the
              gradient reaching its start, F_s, to ``dh0[s]`` (row = segment); nothing else stored.
      "carry" pass 2: every segment starts from ``dht[s]`` (row = segment: the true dH at its end,
              from the reverse fix-up) and stores dh / dv_new; the first segment of each sequence
              writes dh0[seq] when ``has_dh0``.
    stages (variant ``bwd_stages=2``, needs rowexp): the chunk loop is ``T.Pipelined`` — q, k, dO,
      A_β and g of the next chunk arrive by TMA (TileLang's producer warpgroup) while this one is
      computed. Those loads are unmasked (rows past the sequence are finite: the next sequence's,
      or TMA's zero fill past T), so the masks move into the per-element passes: Pᵀ keeps i < ln,
      e^g is 0 on rows past the end (q·dO and K·Y terms), mask·e^{g_l − g} as before.
    """
    assert split in ("", "seg", "carry")
    assert stages in (0, 2) and (rowexp or not stages)
    import tilelang.language as T

    dh_start, dh_end = dh_io_macros(split, has_dht, has_dh0, HEAD_DIM, block_v)

    G = check_heads(h_qk, h_v)
    C, D, BV = CHUNK, HEAD_DIM, block_v
    assert D % BV == 0
    Tn = T.dynamic("T")
    NCS = T.dynamic("NCS")
    NS = T.dynamic("NS")
    ND = T.dynamic("ND")
    N0 = T.dynamic("N0")

    @T.prim_func
    def gdn_bwd_dhu(
        q: T.Tensor((1, Tn, h_qk, D), "bfloat16"),
        k: T.Tensor((1, Tn, h_qk, D), "bfloat16"),
        gcs: T.Tensor((h_v, NCS * C), "float32"),
        a_beta: T.Tensor((h_v, NCS * C, C), "bfloat16"),
        do: T.Tensor((1, Tn, h_v, D), "bfloat16"),
        dht: T.Tensor((ND, h_v, D, D), "float32"),
        stab: T.Tensor((NS, 8), "int32"),
        scale: T.float32,
        dh_all: T.Tensor((h_v, NCS, D, D), "bfloat16"),
        dvnew: T.Tensor((h_v, NCS * C, D), "bfloat16"),
        dh0: T.Tensor((N0, h_v, D, D), "float32"),
    ):
        with T.Kernel(D // BV, NS * h_v, threads=128) as (bv, sh):
            s = sh // h_v
            hv = sh % h_v
            hk = hv // G
            v0 = bv * BV

            q_sh = T.alloc_shared((C, D), "bfloat16")
            k_sh = T.alloc_shared((C, D), "bfloat16")
            do_sh = T.alloc_shared((C, BV), "bfloat16")
            a_sh = T.alloc_shared((C, C), "bfloat16")
            dh_sh = T.alloc_shared((D, BV), "bfloat16")
            pt_sh = T.alloc_shared((C, C), "bfloat16")
            dv_sh = T.alloc_shared((C, BV), "bfloat16")
            qdo_sh = T.alloc_shared((C, BV), "bfloat16")
            ky_sh = T.alloc_shared((C, BV), "bfloat16")
            g_sh = T.alloc_shared((C,), "float32")

            dh_frag = T.alloc_fragment((D, BV), "float32")
            kq_frag = T.alloc_fragment((C, C), "float32")
            dv_frag = T.alloc_fragment((C, BV), "float32")
            kdh_frag = T.alloc_fragment((C, BV), "float32")
            y_frag = T.alloc_fragment((C, BV), "float32")
            glast = T.alloc_var("float32")
            if rowexp:
                el = T.alloc_fragment((C,), "float32")
                eg = T.alloc_fragment((C,), "float32")
                egl = T.alloc_var("float32")

            bos = stab[s, 0]
            eos = stab[s, 1]
            seq = stab[s, 2]
            cslot = stab[s, 3]
            if split:
                is_last = stab[s, 5]
                # first segment of its sequence (segments of a sequence are consecutive rows)
                is_first = T.if_then_else(s == 0, 1, T.if_then_else(stab[T.max(s - 1, 0), 2] != seq, 1, 0))
            if split == "seg":
                nchunks = T.if_then_else(seq >= 0 and is_first == 0, T.ceildiv(eos - bos, C), 0)
            else:
                nchunks = T.if_then_else(seq >= 0, T.ceildiv(eos - bos, C), 0)

            if split:
                dh_start(dh_frag, dht, s, seq, hv, v0, is_last)
            else:
                dh_start(dh_frag, dht, s, seq, hv, v0, 0)

            for cr in T.Pipelined(nchunks, num_stages=stages) if stages else T.serial(nchunks):
                ci = nchunks - 1 - cr
                t0 = bos + ci * C
                ln = T.min(eos - t0, C)
                r0 = (cslot + ci) * C
                if stages:
                    T.copy(q[0, t0 : t0 + C, hk, 0:D], q_sh)
                    T.copy(k[0, t0 : t0 + C, hk, 0:D], k_sh)
                    T.copy(do[0, t0 : t0 + C, hv, v0 : v0 + BV], do_sh)
                else:
                    for i, j in T.Parallel(C, D):
                        q_sh[i, j] = T.if_then_else(i < ln, q[0, t0 + i, hk, j], T.bfloat16(0))
                        k_sh[i, j] = T.if_then_else(i < ln, k[0, t0 + i, hk, j], T.bfloat16(0))
                    for i, j in T.Parallel(C, BV):
                        do_sh[i, j] = T.if_then_else(i < ln, do[0, t0 + i, hv, v0 + j], T.bfloat16(0))
                T.copy(a_beta[hv, r0 : r0 + C, 0:C], a_sh)
                T.copy(gcs[hv, r0 : r0 + C], g_sh)
                T.copy(dh_frag, dh_sh)
                if split != "seg":
                    T.copy(dh_sh, dh_all[hv, cslot + ci, 0:D, v0 : v0 + BV])
                glast = g_sh[ln - 1]

                # Pᵀ[j, i] = scale e^{g_i − g_j} k_j·q_i for i >= j
                T.gemm(k_sh, q_sh, kq_frag, transpose_B=True, clear_accum=True)
                if stages:
                    for j, i in T.Parallel(C, C):
                        pt_sh[j, i] = T.cast(
                            T.if_then_else(
                                i >= j and i < ln, scale * T.exp(g_sh[i] - g_sh[j]) * kq_frag[j, i], T.float32(0)
                            ),
                            "bfloat16",
                        )
                else:
                    for j, i in T.Parallel(C, C):
                        pt_sh[j, i] = T.cast(
                            T.if_then_else(i >= j, scale * T.exp(g_sh[i] - g_sh[j]) * kq_frag[j, i], T.float32(0)),
                            "bfloat16",
                        )
                T.gemm(k_sh, dh_sh, kdh_frag, clear_accum=True)
                T.gemm(pt_sh, do_sh, dv_frag, clear_accum=True)
                if rowexp:
                    egl = T.exp(glast)
                    for i in T.Parallel(C):
                        el[i] = T.if_then_else(i < ln, T.exp(glast - g_sh[i]), T.float32(0))
                    if stages:
                        for i in T.Parallel(C):
                            eg[i] = T.if_then_else(i < ln, T.exp(g_sh[i]), T.float32(0))
                    else:
                        for i in T.Parallel(C):
                            eg[i] = T.exp(g_sh[i])
                    for i, j in T.Parallel(C, BV):
                        dv_frag[i, j] = dv_frag[i, j] + el[i] * kdh_frag[i, j]
                else:
                    for i, j in T.Parallel(C, BV):
                        dv_frag[i, j] = dv_frag[i, j] + T.if_then_else(
                            i < ln, T.exp(glast - g_sh[i]) * kdh_frag[i, j], T.float32(0)
                        )
                T.copy(dv_frag, dv_sh)
                if split != "seg":
                    T.copy(dv_sh, dvnew[hv, r0 : r0 + C, v0 : v0 + BV])

                T.gemm(a_sh, dv_sh, y_frag, transpose_A=True, clear_accum=True)
                if rowexp:
                    for i, j in T.Parallel(C, BV):
                        qdo_sh[i, j] = T.cast(scale * eg[i] * T.cast(do_sh[i, j], "float32"), "bfloat16")
                        ky_sh[i, j] = T.cast(-eg[i] * y_frag[i, j], "bfloat16")
                    for i, j in T.Parallel(D, BV):
                        dh_frag[i, j] = dh_frag[i, j] * egl
                else:
                    for i, j in T.Parallel(C, BV):
                        qdo_sh[i, j] = T.cast(scale * T.exp(g_sh[i]) * T.cast(do_sh[i, j], "float32"), "bfloat16")
                        ky_sh[i, j] = T.cast(-T.exp(g_sh[i]) * y_frag[i, j], "bfloat16")
                    for i, j in T.Parallel(D, BV):
                        dh_frag[i, j] = dh_frag[i, j] * T.exp(glast)
                T.gemm(q_sh, qdo_sh, dh_frag, transpose_A=True)
                T.gemm(k_sh, ky_sh, dh_frag, transpose_A=True)

            if split:
                dh_end(dh_frag, dh0, s, seq, hv, v0, is_first)
            else:
                dh_end(dh_frag, dh0, s, seq, hv, v0, 0)

    return gdn_bwd_dhu


@functools.cache
def get_bwd_dhu_kernel(
    h_qk: int, h_v: int, has_dht: bool, has_dh0: bool, block_v: int = 64, target_k=None, rowexp: bool = False,
    split: str = "", stages: int = 0,
):
    target = json.loads(target_k) if target_k and target_k.startswith("{") else target_k
    if stages:
        return compile_program(
            bwd_dhu_program(h_qk, h_v, has_dht, has_dh0, block_v, rowexp, split, stages), target=target,
            pass_configs={"tl.enable_fast_math": True},
        )  # fmt: skip
    if split:
        return compile_program(
            bwd_dhu_program(h_qk, h_v, has_dht, has_dh0, block_v, rowexp, split), target=target,
            pass_configs={"tl.enable_fast_math": True} if rowexp else None,
        )  # fmt: skip
    if rowexp:
        return compile_program(
            bwd_dhu_program(h_qk, h_v, has_dht, has_dh0, block_v, True), target=target,
            pass_configs={"tl.enable_fast_math": True},
        )  # fmt: skip
    return compile_program(bwd_dhu_program(h_qk, h_v, has_dht, has_dh0, block_v), target=target)


def run_bwd_dhu(
    q, k, gcs, a_beta, do, dht, stab, scale, dh0, dh_all=None, dvnew=None, block_v=64, target=None, rowexp=False,
    split="", stages=0,
):
    """Launch the reverse recurrence. dht: [N,Hv,128,128] fp32 or None; dh0: preallocated
    [N,Hv,128,128] fp32 to fill, or None. Returns dh_all, dvnew, dh0.

    split="seg" (pass 1 over a split ``stab``): dh0 = F [NS,Hv,128,128] fp32 to fill (row =
    segment), dh_all / dvnew are not written. split="carry" (pass 2): dht = d_end [NS,Hv,128,128]
    fp32 (row = segment, from ``fixup.run_rfixup``), dh0 as unsplit (row = sequence) or None."""
    h_qk, h_v = q.shape[2], do.shape[2]
    ncs = gcs.shape[1] // CHUNK
    dev = q.device
    if dh_all is None:
        dh_all = torch.empty(h_v, ncs, HEAD_DIM, HEAD_DIM, device=dev, dtype=torch.bfloat16)
    if dvnew is None:
        dvnew = torch.empty(h_v, ncs * CHUNK, HEAD_DIM, device=dev, dtype=torch.bfloat16)
    has_dht, has_dh0 = dht is not None, dh0 is not None
    if split == "seg" and not has_dh0:
        raise ValueError("run_bwd_dhu(split='seg') needs dh0: the [NS, Hv, 128, 128] fp32 buffer of F")
    if split == "carry" and not has_dht:
        raise ValueError("run_bwd_dhu(split='carry') needs dht: the [NS, Hv, 128, 128] fp32 segment-end gradients")
    kw = {"rowexp": True} if rowexp else {}
    if split:
        kw["split"] = split
    if stages:
        kw["stages"] = stages
    kern = get_bwd_dhu_kernel(h_qk, h_v, has_dht, has_dh0, block_v, target_key(target), **kw)
    dummy = None
    if not (has_dht and has_dh0):
        dummy = torch.empty(1, h_v, HEAD_DIM, HEAD_DIM, device=dev, dtype=torch.float32)
    kern(q, k, gcs, a_beta, do, dht if has_dht else dummy, stab, float(scale), dh_all, dvnew, dh0 if has_dh0 else dummy)
    return dh_all, dvnew, dh0
