"""The intra-chunk output matrix P = scale · Γ ⊙ Q Kᵀ (causal, diagonal included), per chunk slot
and v-head, for the warp-specialised fwd_o's variant ``pmat=1``.

The H200 profile of fwd_o_ws (16/64 1×32768, ncu source counters) found its output warpgroup
(WG2) the busiest role: half of the kernel's issued instructions, almost never waiting on a
barrier, while the state and U/W/Vd warpgroups waited for stages that WG2 had not yet released.
Most of WG2's instructions are Q Kᵀ and the P pass (one exp per element) — the same for both V
blocks of a head and independent of the state. This kernel computes P once per (chunk, v-head),
off the recurrence; fwd_o_ws then loads it with the chunk's other inputs.

One CTA (128 threads) per (chunk slot, v-head), like prep:
    P[i, j] = scale · exp(g_i − g_j) · q_i · k_j   for j ≤ i, else 0         (bf16)
with g = gcs (prep's chunk-local cumsum; rows past the sequence end repeat the last value) and
q, k rows past the end loaded as 0 (so those rows and columns of P are 0).

Layouts: q, k [1, T, Hqk, 128] bf16; gcs [Hv, NCS*64] fp32; ctab [NCS, 4] int32;
p_all [Hv, NCS*64, 64] bf16 (row i of slot c at [hv, c*64 + i, :], as a_beta).
"""

import functools
import json

import torch

from ._common import CHUNK, HEAD_DIM, check_heads, compile_program, target_key


def pmat_program(h_qk: int, h_v: int):
    import tilelang.language as T

    G = check_heads(h_qk, h_v)
    C, D = CHUNK, HEAD_DIM
    Tn = T.dynamic("T")
    NCS = T.dynamic("NCS")

    @T.prim_func
    def gdn_pmat(
        q: T.Tensor((1, Tn, h_qk, D), "bfloat16"),
        k: T.Tensor((1, Tn, h_qk, D), "bfloat16"),
        gcs: T.Tensor((h_v, NCS * C), "float32"),
        ctab: T.Tensor((NCS, 4), "int32"),
        scale: T.float32,
        p_all: T.Tensor((h_v, NCS * C, C), "bfloat16"),
    ):
        with T.Kernel(NCS, h_v, threads=128) as (c, hv):
            hk = hv // G
            q_sh = T.alloc_shared((C, D), "bfloat16")
            k_sh = T.alloc_shared((C, D), "bfloat16")
            p_sh = T.alloc_shared((C, C), "bfloat16")
            g_sh = T.alloc_shared((C,), "float32")
            qk = T.alloc_fragment((C, C), "float32")
            gi = T.alloc_fragment((C,), "float32")

            bos = ctab[c, 0]
            ln = ctab[c, 1] - bos

            for i, j in T.Parallel(C, D):
                q_sh[i, j] = T.if_then_else(i < ln, q[0, bos + i, hk, j], T.bfloat16(0))
                k_sh[i, j] = T.if_then_else(i < ln, k[0, bos + i, hk, j], T.bfloat16(0))
            T.copy(gcs[hv, c * C : c * C + C], g_sh)
            T.gemm(q_sh, k_sh, qk, transpose_B=True, clear_accum=True)
            for i in T.Parallel(C):
                gi[i] = g_sh[i]
            for i, j in T.Parallel(C, C):
                p_sh[i, j] = T.cast(
                    T.if_then_else(i >= j, scale * T.exp(gi[i] - g_sh[j]) * qk[i, j], T.float32(0)), "bfloat16"
                )
            T.copy(p_sh, p_all[hv, c * C : c * C + C, 0:C])

    return gdn_pmat


@functools.cache
def get_pmat_kernel(h_qk: int, h_v: int, target_k=None):
    target = json.loads(target_k) if target_k and target_k.startswith("{") else target_k
    return compile_program(pmat_program(h_qk, h_v), target=target, pass_configs={"tl.enable_fast_math": True})


def run_pmat(q, k, gcs, ctab, scale, p_all=None, target=None):
    """P = scale·Γ⊙QKᵀ (causal) per chunk slot and v-head -> p_all [Hv, NCS*64, 64] bf16."""
    h_qk, h_v = q.shape[2], gcs.shape[0]
    ncs = ctab.shape[0]
    if p_all is None:
        p_all = torch.empty(h_v, ncs * CHUNK, CHUNK, device=q.device, dtype=torch.bfloat16)
    get_pmat_kernel(h_qk, h_v, target_key(target))(q, k, gcs, ctab, float(scale), p_all)
    return p_all


