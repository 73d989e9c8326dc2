"""Backward kernel 1: recompute h at every chunk start (bf16) and v_new, the state in registers.

One CTA of 256 threads per (64-column V block, segment, v-head), two CTAs per SM; seg_state's chain
(``seg_state.chain_step_macro``, its loads ``seg_state.kva_loads_macro``) plus the stores. The block's transposed state Sᵀ [64 V, 128 K]
is fp32 in the registers of one warpgroup and every GEMM takes its A operand from registers (the
accumulator cast to bf16, or Vᵀ by ldmatrix .trans; wgmma M = 64). Per chunk (C = 64 rows; g =
chunk-local cumsum, g_l its last valid value; A_β from prep):

    h    = bf16(Sᵀ)ᵀ                       (stored as h_all[chunk slot], [K, V])
    Xᵀ   = Sᵀ Kᵀ
    Vdᵀ  = (Vᵀ − e^g ⊙ Xᵀ) A_βᵀ            (the difference in fp32, cast to bf16 once)
    v_new = bf16(Vd)                        (stored as vnew rows of the chunk slot)
    Sᵀ ← e^{g_l} Sᵀ + (mask · e^{g_l − g} ⊙ Vd)ᵀ K

Roles (the launch gives each thread 128 registers; the setmaxnreg budgets sum to what two
warpgroups hold):

    WG0 (tx   0..127, setmaxnreg ``NREG[0]`` .inc)  the state, the three GEMMs (issued
            asynchronously: h is staged while Sᵀ Kᵀ runs, v_new while the state update runs), h and
            v_new written transposed from the registers into staging tiles in shared memory (swizzled)
    WG1 (tx 128..255, ``NREG[1]`` .dec)  warp 4: TMA loads of K, the V block and A_β into stage
            c % NST; warp 5: the chunk's gcs rows and the per-token tables e^g,
            mask · e^{g_l − g}, e^{g_l} into the stage (``seg_state.gate_tables_macro``); warp 6:
            h and v_new of each chunk from their staging tiles to HBM by TMA stores; warp 7 exits

mbarriers: full[js] (64: warps 4 and 5 + TMA tx bytes; the state waits parity (c // NST) % 2),
empty[js] (128: the state, done with stage js; the producers wait the other parity, which passes
at once on a fresh barrier); h_staged / v_staged (128: the state, tile written and fenced; warp 6
waits c % 2), h_free / v_free (32: warp 6, its TMA store has read the tile; the state waits 1 − c % 2).

Rows past a sequence's end: k and v are loaded unmasked (TMA zero-fills past T; rows of the next
sequence are finite) and meet only zero columns of A_β (prep), so Vd rows there are 0; the rows
fed into the state update are masked by the table.

Inputs:  k [1,T,Hqk,128] bf16, v [1,T,Hv,128] bf16, gcs, a_beta (prep), stab int32 [NS,8],
         h_init [R,Hv,128,128] fp32 (row stab[s, 4]; read when ``has_init``).
Outputs: h_all [Hv, NCS, 128, 128] bf16 (state at each chunk's start), vnew [Hv, NCS*64, 128] bf16.
"""

import functools

import torch

from ._common import CHUNK, FAST_MATH, HEAD_DIM, check_heads, compile_program, parse_target, target_key
from .seg_state import V_LOAD_SRC, acc_layout, chain_step_macro, gate_tables_macro, kva_loads_macro

#: CTAs per SM that ptxas must fit (``__launch_bounds__``): 256 threads at 128 registers each
MIN_BLOCKS = 2
NREG_LAUNCH = 65536 // (256 * MIN_BLOCKS)
#: setmaxnreg budgets of the state warpgroup (.inc) and the producer warpgroup (.dec); they sum to
#: what the launch gives two warpgroups
NREG = (208, 48)
assert NREG[0] + NREG[1] == 2 * NREG_LAUNCH
#: input ring depth
NST = 2
#: the V block of a CTA (one warpgroup's wgmma M)
BLOCK_V = 64


def bwd_h_program(h_qk: int, h_v: int, has_init: bool):
    """The prim_func ``gdn_bwd_h`` for one head config and initial-state flag."""
    import tilelang.language as T
    from tilelang.layout import make_swizzled_layout

    G = check_heads(h_qk, h_v)
    C, D, BV = CHUNK, HEAD_DIM, BLOCK_V
    Tn = T.dynamic("T")
    NCS = T.dynamic("NCS")
    NS = T.dynamic("NS")
    R = T.dynamic("R")
    RS, RP = NREG
    gate_tables = gate_tables_macro(NST)
    kva_loads = kva_loads_macro(NST, BV)
    chain_issue, chain_update = chain_step_macro(BV)

    @T.prim_func
    def gdn_bwd_h(
        k: T.Tensor((1, Tn, h_qk, D), "bfloat16"),
        v: T.Tensor((1, Tn, h_v, D), "bfloat16"),
        gcs: T.Tensor((h_v, NCS * C), "float32"),
        a_beta: T.Tensor((h_v, NCS * C, C), "bfloat16"),
        stab: T.Tensor((NS, 8), "int32"),
        h_init: T.Tensor((R, h_v, D, D), "float32"),
        h_all: T.Tensor((h_v, NCS, D, D), "bfloat16"),
        vnew: T.Tensor((h_v, NCS * C, D), "bfloat16"),
    ):
        with T.Kernel(D // BV, NS * h_v, threads=256) as (bv, sh):
            T.import_source(V_LOAD_SRC)
            T.annotate_min_blocks_per_sm(MIN_BLOCKS)
            s = sh // h_v
            hv = sh % h_v
            hk = hv // G
            v0 = bv * BV

            k_sh = T.alloc_shared((NST, C, D), "bfloat16")
            v_sh = T.alloc_shared((NST, C, BV), "bfloat16")
            a_sh = T.alloc_shared((NST, C, C), "bfloat16")
            # gt_sh[js, 0..2, i]: e^g, mask · e^{g_l − g}, e^{g_l} (in every column)
            gt_sh = T.alloc_shared((NST, 3, C), "float32", scope="shared")
            # h [K, V block] and v_new [C, V block] of the chunk on their way out: written from the
            # registers (transposed), stored by warp 6's TMA
            hs_sh = T.alloc_shared((D, BV), "bfloat16")
            vs_sh = T.alloc_shared((C, BV), "bfloat16")

            s_acc = T.alloc_fragment((BV, D), "float32")  # Sᵀ [V, K]
            s_bf = T.alloc_fragment((BV, D), "bfloat16")
            x_acc = T.alloc_fragment((BV, C), "float32")  # Sᵀ Kᵀ
            vt_bf = T.alloc_fragment((BV, C), "bfloat16")  # Vᵀ of the stage's V block
            w_bf = T.alloc_fragment((BV, C), "bfloat16")
            vp_bf = T.alloc_fragment((BV, C), "bfloat16")
            gv = T.alloc_local((2,), "float32")
            T.annotate_layout({hs_sh: make_swizzled_layout(hs_sh), vs_sh: make_swizzled_layout(vs_sh),
                               v_sh: make_swizzled_layout(v_sh), vt_bf: acc_layout((BV, C))})  # v_sh, vt_bf: qlb_load_vt's

            full = T.alloc_barrier([64] * NST)
            empty = T.alloc_barrier([128] * NST)
            # h's and v_new's staging tiles: staged by the state (128), stored (warp 6's TMA) and free again (32)
            h_staged = T.alloc_barrier([128])
            h_free = T.alloc_barrier([32])
            v_staged = T.alloc_barrier([128])
            v_free = T.alloc_barrier([32])

            bos = stab[s, 0]
            eos = stab[s, 1]
            seq = stab[s, 2]
            cslot = stab[s, 3]
            irow = stab[s, 4]
            nchunks = T.if_then_else(seq >= 0, T.ceildiv(eos - bos, C), 0)

            tx = T.get_thread_binding()
            if tx < 128:
                T.set_max_nreg(RS, 1)
                if has_init:
                    for i, j in T.Parallel(BV, D):
                        s_acc[i, j] = h_init[irow, hv, j, v0 + i]
                else:
                    T.clear(s_acc)
                for ci in T.serial(nchunks):
                    js = ci % NST
                    pj = (ci // NST) % 2
                    T.barrier_wait(full[js], pj)
                    T.copy(s_acc, s_bf)
                    chain_issue(s_bf, x_acc, vt_bf, k_sh, v_sh, js, True)
                    T.barrier_wait(h_free[0], 1 - ci % 2)
                    for i, j in T.Parallel(BV, D):  # h staged while Sᵀ Kᵀ runs
                        hs_sh[j, i] = T.cast(s_acc[i, j], "bfloat16")
                    T.fence_proxy_async()
                    T.barrier_arrive(h_staged[0])
                    chain_update(s_acc, x_acc, vt_bf, w_bf, vp_bf, k_sh, a_sh, gt_sh, js, True)
                    T.barrier_wait(v_free[0], 1 - ci % 2)
                    for i, j in T.Parallel(BV, C):  # v_new staged while the state update runs
                        vs_sh[j, i] = w_bf[i, j]
                    T.fence_proxy_async()
                    T.barrier_arrive(v_staged[0])
                    T.wait_wgmma(0)
                    T.warpgroup_fence_operand(s_acc, num_regs=BV * D // 128)
                    T.barrier_arrive(empty[js])
            else:
                T.set_max_nreg(RP, 0)
                if tx < 160:  # warp 4: TMA loads (one elected lane issues them)
                    kva_loads(k, v, a_beta, k_sh, v_sh, a_sh, empty, full, hk, hv, v0, bos, cslot, nchunks, True)
                elif tx < 192:
                    gate_tables(gcs, gt_sh, empty, full, gv, hv, bos, eos, cslot, nchunks, tx - 160)
                elif tx < 224:  # warp 6: h and v_new of each chunk from their staging tiles, by TMA
                    for ci in T.serial(nchunks):
                        T.barrier_wait(h_staged[0], ci % 2)
                        T.copy(hs_sh, h_all[hv, cslot + ci, 0:D, v0 : v0 + BV])
                        T.barrier_arrive(h_free[0])
                        T.barrier_wait(v_staged[0], ci % 2)
                        T.copy(vs_sh, vnew[hv, (cslot + ci) * C : (cslot + ci) * C + C, v0 : v0 + BV])
                        T.barrier_arrive(v_free[0])

    return gdn_bwd_h


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
