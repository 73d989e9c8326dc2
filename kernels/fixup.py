"""Sequence splitting, pass 2: the serial fix-up of every segment's start state.

One CTA (128 threads) per (V block of ``block_v`` columns, sequence, v-head) walks the
sequence's segments in order:

    H₀ = h0[n] (or 0);   h_start[s] = H;   H ← M_s H + E_s   (for every segment but the last)

M_s H runs on wgmma (M = 128, M_s bf16 from global, H rounded to bf16), accumulated onto E_s
in fp32.

Inputs:  m_tr [NS,Hv,128,128] bf16, e_end [NS,Hv,128,128] fp32 (pass 1), cu_segs int32 [N+1],
         h0 [N,Hv,128,128] fp32 (read only when ``has_h0``).
Output:  h_start [NS,Hv,128,128] fp32 (the start state of every used segment).
"""

import functools

import torch

from ._common import HEAD_DIM, compile_program, parse_target, target_key


def fixup_program(h_v: int, has_h0: bool, block_v: int = 32):
    import tilelang.language as T

    D, BV = HEAD_DIM, block_v
    NS = T.dynamic("NS")
    N = T.dynamic("N")
    N1 = T.dynamic("N1")

    @T.prim_func
    def gdn_fixup(
        m_tr: T.Tensor((NS, h_v, D, D), "bfloat16"),
        e_end: T.Tensor((NS, h_v, D, D), "float32"),
        cu_segs: T.Tensor((N1,), "int32"),
        h0: T.Tensor((N, h_v, D, D), "float32"),
        h_start: T.Tensor((NS, h_v, D, D), "float32"),
    ):
        with T.Kernel(D // BV, (N1 - 1) * h_v, threads=128) as (bv, nh):
            n = nh // h_v
            hv = nh % h_v
            v0 = bv * BV
            m_sh = T.alloc_shared((D, D), "bfloat16")
            s_sh = T.alloc_shared((D, BV), "bfloat16")
            s_frag = T.alloc_fragment((D, BV), "float32")

            s0 = cu_segs[n]
            ns = cu_segs[n + 1] - s0
            if has_h0:
                T.copy(h0[n, hv, 0:D, v0 : v0 + BV], s_frag)
            else:
                T.clear(s_frag)
            for si in T.serial(ns - 1):
                T.copy(s_frag, h_start[s0 + si, hv, 0:D, v0 : v0 + BV])
                T.copy(m_tr[s0 + si, hv, 0:D, 0:D], m_sh)
                T.copy(s_frag, s_sh)
                T.copy(e_end[s0 + si, hv, 0:D, v0 : v0 + BV], s_frag)
                T.gemm(m_sh, s_sh, s_frag)
            T.copy(s_frag, h_start[s0 + ns - 1, hv, 0:D, v0 : v0 + BV])

    return gdn_fixup


@functools.cache
def get_fixup_kernel(h_v: int, has_h0: bool, block_v: int = 32, target_k=None):
    return compile_program(fixup_program(h_v, has_h0, block_v), target=parse_target(target_k))


def run_fixup(m_tr, e_end, cu_segs, h0, h_start, block_v=32, target=None):
    """Launch the fix-up; fills h_start in place. cu_segs: int32 [N+1]."""
    h_v = m_tr.shape[1]
    has_h0 = h0 is not None
    kern = get_fixup_kernel(h_v, has_h0, block_v, target_key(target))
    if h0 is None:
        h0 = torch.empty(1, h_v, HEAD_DIM, HEAD_DIM, device=m_tr.device, dtype=torch.float32)
    kern(m_tr, e_end, cu_segs, h0, h_start)
    return h_start


def rfixup_program(h_v: int, has_dht: bool, block_v: int = 32):
    """The backward's serial fix-up (the adjoint of :func:`fixup_program`), per (V block,
    sequence, v-head), over the sequence's segments in reverse:

        G = dht[n] (or 0);  d_end[last] = G;  G = F_last         (pass 1 of the last segment
                                                                   started from dht: exact)
        for s = last-1 … first:  d_end[s] = G;  G ← F_s + M_sᵀ G  (s > first; M_s from seg_state)

    F_s (``f_start``) = the gradient reaching segment s's start when its end gets 0 (bwd_dhu
    split="seg"); M_sᵀ G on wgmma (M = 128, M_s bf16, G rounded to bf16) onto F_s in fp32.

    Inputs:  m_tr [NS,Hv,128,128] bf16, f_start [NS,Hv,128,128] fp32, cu_segs int32 [N+1],
             dht [N,Hv,128,128] fp32 (read only when ``has_dht``).
    Output:  d_end [NS,Hv,128,128] fp32 (d state at the end of every used segment).
    """
    import tilelang.language as T

    D, BV = HEAD_DIM, block_v
    NS = T.dynamic("NS")
    N = T.dynamic("N")
    N1 = T.dynamic("N1")

    @T.prim_func
    def gdn_rfixup(
        m_tr: T.Tensor((NS, h_v, D, D), "bfloat16"),
        f_start: T.Tensor((NS, h_v, D, D), "float32"),
        cu_segs: T.Tensor((N1,), "int32"),
        dht: T.Tensor((N, h_v, D, D), "float32"),
        d_end: T.Tensor((NS, h_v, D, D), "float32"),
    ):
        with T.Kernel(D // BV, (N1 - 1) * h_v, threads=128) as (bv, nh):
            n = nh // h_v
            hv = nh % h_v
            v0 = bv * BV
            m_sh = T.alloc_shared((D, D), "bfloat16")
            s_sh = T.alloc_shared((D, BV), "bfloat16")
            s_frag = T.alloc_fragment((D, BV), "float32")

            s0 = cu_segs[n]
            ns = cu_segs[n + 1] - s0
            if has_dht:
                T.copy(dht[n, hv, 0:D, v0 : v0 + BV], s_frag)
            else:
                T.clear(s_frag)
            T.copy(s_frag, d_end[s0 + ns - 1, hv, 0:D, v0 : v0 + BV])
            if ns > 1:
                T.copy(f_start[s0 + ns - 1, hv, 0:D, v0 : v0 + BV], s_frag)
                T.copy(s_frag, d_end[s0 + ns - 2, hv, 0:D, v0 : v0 + BV])
            for r in T.serial(T.max(ns - 2, 0)):
                si = s0 + ns - 2 - r  # a middle segment: G ← F_s + M_sᵀ G
                T.copy(m_tr[si, hv, 0:D, 0:D], m_sh)
                T.copy(s_frag, s_sh)
                T.copy(f_start[si, hv, 0:D, v0 : v0 + BV], s_frag)
                T.gemm(m_sh, s_sh, s_frag, transpose_A=True)
                T.copy(s_frag, d_end[si - 1, hv, 0:D, v0 : v0 + BV])

    return gdn_rfixup


@functools.cache
def get_rfixup_kernel(h_v: int, has_dht: bool, block_v: int = 32, target_k=None):
    return compile_program(rfixup_program(h_v, has_dht, block_v), target=parse_target(target_k))


def run_rfixup(m_tr, f_start, cu_segs, dht, d_end, block_v=32, target=None):
    """Launch the backward fix-up; fills d_end in place. cu_segs: int32 [N+1]."""
    h_v = m_tr.shape[1]
    has_dht = dht is not None
    kern = get_rfixup_kernel(h_v, has_dht, block_v, target_key(target))
    if dht is None:
        dht = torch.empty(1, h_v, HEAD_DIM, HEAD_DIM, device=m_tr.device, dtype=torch.float32)
    kern(m_tr, f_start, cu_segs, dht, d_end)
    return d_end
