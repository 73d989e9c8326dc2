"""Sequence splitting, pass 2: the serial fix-up of every segment's start state (forward) or end
gradient (backward, ``reverse``).

One CTA (128 threads) per (V block of ``block_v`` columns, sequence, v-head) walks the
sequence's segments in order (M_s from seg_state):

    H = h0[n] (or 0);   for each segment s but the last:  h_start[s] = H;  H ← E_s + M_s H
    h_start[last] = H

or, ``reverse``, from the last segment back (the adjoint; M of the last segment is never computed):

    G = dht[n] (or 0);  d_end[last] = G;  G ← F_last
    for s = last-1 … first+1:  d_end[s] = G;  G ← F_s + M_sᵀ G
    d_end[first] = G

with E_s = seg_state's end state from 0 and F_s (``f_start``) = the gradient reaching segment s's
start when its end gets 0 (bwd_dhu split="seg"). The M term runs on wgmma (M = 128, M_s bf16 from
global, H rounded to bf16), accumulated onto E_s / F_s in fp32.

Inputs:  m_tr [NS,Hv,128,128] bf16, add = e_end / f_start [NS,Hv,128,128] fp32, cu_segs int32 [N+1],
         init = h0 / dht [N,Hv,128,128] fp32 (read only when ``has_init``).
Output:  out = h_start / d_end [NS,Hv,128,128] fp32 (every used segment's).
"""

import functools

import torch

from ._common import HEAD_DIM, compile_program, parse_target, target_key


def fixup_program(h_v: int, has_init: bool, block_v: int = 32, reverse: bool = False):
    import tilelang.language as T

    D, BV = HEAD_DIM, block_v
    NS = T.dynamic("NS")
    N = T.dynamic("N")
    N1 = T.dynamic("N1")

    @T.prim_func
    def gdn_fixup(
        m_tr: T.Tensor((NS, h_v, D, D), "bfloat16"),
        add: T.Tensor((NS, h_v, D, D), "float32"),
        cu_segs: T.Tensor((N1,), "int32"),
        init: T.Tensor((N, h_v, D, D), "float32"),
        out: T.Tensor((NS, h_v, D, D), "float32"),
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
            if has_init:
                T.copy(init[n, hv, 0:D, v0 : v0 + BV], s_frag)
            else:
                T.clear(s_frag)
            for j in T.serial(ns - 1):
                si = s0 + ns - 1 - j if reverse else s0 + j
                T.copy(s_frag, out[si, hv, 0:D, v0 : v0 + BV])
                T.copy(m_tr[si, hv, 0:D, 0:D], m_sh)
                T.copy(s_frag, s_sh)
                T.copy(add[si, hv, 0:D, v0 : v0 + BV], s_frag)
                if reverse:
                    if j > 0:
                        T.gemm(m_sh, s_sh, s_frag, transpose_A=True)
                else:
                    T.gemm(m_sh, s_sh, s_frag)
            T.copy(s_frag, out[s0 if reverse else s0 + ns - 1, hv, 0:D, v0 : v0 + BV])

    return gdn_fixup


@functools.cache
def get_fixup_kernel(h_v: int, has_init: bool, block_v: int = 32, reverse: bool = False, target_k=None):
    return compile_program(fixup_program(h_v, has_init, block_v, reverse), target=parse_target(target_k))


def run_fixup(m_tr, add, cu_segs, init, out, reverse=False, block_v=32, target=None):
    """Launch the fix-up (``reverse``: the backward's); fills ``out`` in place. cu_segs: int32 [N+1]."""
    h_v = m_tr.shape[1]
    kern = get_fixup_kernel(h_v, init is not None, block_v, reverse, target_key(target))
    if init is None:
        init = torch.empty(1, h_v, HEAD_DIM, HEAD_DIM, device=m_tr.device, dtype=torch.float32)
    kern(m_tr, add, cu_segs, init, out)
    return out
