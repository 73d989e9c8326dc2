"""Forward kernel 3: the chunk recurrence fused with the output from prep's A_β and P, the state in registers.

One CTA of 256 threads per (64-column V block, segment, v-head), two CTAs per SM; a segment is
a run of whole chunks of one sequence (the whole sequence unless split, ``_common.segment_table``).
The block's transposed state Sᵀ [64 V, 128 K] is fp32 in the registers of one warpgroup, and
every GEMM takes its A operand from registers (the accumulator cast to bf16, or Vᵀ loaded by
ldmatrix .trans, ``V_LOAD_SRC``; wgmma M = 64). Per chunk (C = 64 rows; g = chunk-local cumsum,
g_l its last valid value; A_β and P = scale·Γ⊙QKᵀ, causal incl. the diagonal, from prep):

    Oᵀ  = Sᵀ Qᵀ
    Xᵀ  = Sᵀ Kᵀ
    Vdᵀ = (Vᵀ − e^g ⊙ Xᵀ) A_βᵀ            (= FLA's v_newᵀ; the difference in fp32, cast to bf16)
    Oᵀ  = scale · e^g ⊙ Oᵀ + Vdᵀ Pᵀ
    Sᵀ ← e^{g_l} Sᵀ + (mask · e^{g_l − g} ⊙ Vd)ᵀ K

Roles (128 registers a thread at launch; the setmaxnreg budgets sum to what two warpgroups hold):

    WG0 (tx   0..127, setmaxnreg ``NREG[0]`` .inc)  the state, the five GEMMs; o
            staged in the stage's P buffer after the last GEMM by stmatrix .trans between two syncs
            (``O_STAGE_SRC``; a partial last chunk's rows stored from there)
    WG1 (tx 128..255, ``NREG[1]`` .dec)  warp 4: TMA loads of K, the V block, A_β, P into stage
            c % NST, and of Q into its one buffer once the state is done with the last; warp 5: gcs
            rows → e^g, mask · e^{g_l − g}, e^{g_l} into the stage; warp 6: full chunks' o by TMA; 7 exits

mbarriers full[js], empty[js], o_staged[js], q_full, q_empty (counts and parities: docs/kernels.md,
fwd_o). Q has one buffer (two CTAs per SM must fit): the state takes its Q GEMM first, warp 4 loads the next.

Rows past the sequence end: A_β and P are 0 there (prep), the state update's rows masked, o not
stored; TMA loads of q/k/v past the end (the next sequence's rows) only meet those zeros.

Inputs:  q, k [1,T,Hqk,128] bf16; v [1,T,Hv,128] bf16; gcs [Hv,NCS*64] fp32; a_beta, p_all
         [Hv,NCS*64,64] bf16 (prep); stab int32 [NS,8]; h_init [R,Hv,128,128] fp32 (row stab[s,4],
         read when ``has_init``); scale fp32.
Outputs: o [1,T,Hv,128] bf16; ht [N,Hv,128,128] fp32 (last segment of each sequence, ``has_ht``).
"""

import functools

import torch

from ._common import CHUNK, FAST_MATH, HEAD_DIM, check_heads, compile_program, parse_target, target_key
from .seg_state import V_LOAD_SRC, acc_layout, gate_tables_macro

#: CTAs per SM that ptxas must fit (``__launch_bounds__``): 256 threads at 128 registers each
MIN_BLOCKS = 2
NREG_LAUNCH = 65536 // (256 * MIN_BLOCKS)
#: setmaxnreg budgets of the state warpgroup (.inc) and the producer warpgroup (.dec); they sum to
#: what the launch gives two warpgroups
NREG = (208, 48)
assert NREG[0] + NREG[1] == 2 * NREG_LAUNCH
#: ring depth of K, V, A_β, P and the per-token tables (Q: one buffer)
NST = 2
#: the V block of a CTA (one warpgroup's wgmma M)
BLOCK_V = 64


O_SYNC_BAR = 12  #: the named barrier around o's staging in fwd_o and the fused kernel (TileLang's start at 1)
#: o (bf16, ``acc_layout``: thread t holds V row 16 (t/32 % 4) + t % 32 / 4 + 8h of its warpgroup's 64,
#: tokens 8n + 2 (t % 4) + {0, 1}, as pair 2n + h) into [64 tokens, 64 V] per warpgroup (TileLang's
#: 128-byte swizzle: 16-byte chunk c of row r at c ^ (r % 8)) by four stmatrix .x4.trans per thread
O_STAGE_SRC = r"""
__device__ __forceinline__ void qlb_stage_o_trans(void* stage, const void* frag) {
  const int t = threadIdx.x, q = (t & 31) >> 3, r = t & 7;
  const unsigned* v = static_cast<const unsigned*>(frag);
  unsigned short* half = static_cast<unsigned short*>(stage) + ((t >> 7) & 1) * 4096;
  #pragma unroll
  for (int m = 0; m < 4; ++m) asm volatile("stmatrix.sync.aligned.x4.trans.m8n8.shared.b16 [%0], {%1, %2, %3, %4};\n" ::
    "r"(static_cast<unsigned>(__cvta_generic_to_shared(half + (16 * m + 8 * (q >> 1) + r) * 64 + ((2 * ((t >> 5) & 3) + (q & 1)) ^ r) * 8))),
    "r"(v[4 * m]), "r"(v[4 * m + 1]), "r"(v[4 * m + 2]), "r"(v[4 * m + 3]) : "memory");
}
"""
def fwd_o_program(h_qk: int, h_v: int, has_init: bool, has_ht: bool):
    """The prim_func ``gdn_fwd_o`` for one head config and state flags."""
    import tilelang.language as T
    from tilelang.layout import make_swizzled_layout

    G = check_heads(h_qk, h_v)
    C, D, BV = CHUNK, HEAD_DIM, BLOCK_V
    Tn = T.dynamic("T")
    NCS = T.dynamic("NCS")
    NS = T.dynamic("NS")
    R = T.dynamic("R")
    N = T.dynamic("N")
    RS, RP = NREG
    FR = T.GemmWarpPolicy.FullRow
    gate_tables = gate_tables_macro(NST)

    @T.prim_func
    def gdn_fwd_o(
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
        with T.Kernel(D // BV, NS * h_v, threads=256) as (bv, sh):
            T.import_source(O_STAGE_SRC + V_LOAD_SRC)
            T.annotate_min_blocks_per_sm(MIN_BLOCKS)
            s = sh // h_v
            hv = sh % h_v
            hk = hv // G
            v0 = bv * BV

            q_sh = T.alloc_shared((C, D), "bfloat16")
            k_sh = T.alloc_shared((NST, C, D), "bfloat16")
            v_sh = T.alloc_shared((NST, C, BV), "bfloat16")
            a_sh = T.alloc_shared((NST, C, C), "bfloat16")
            pp_sh = T.alloc_shared((NST, C, C), "bfloat16")
            # gt_sh[js, 0..2, i]: e^g, mask · e^{g_l − g}, e^{g_l} (in every column)
            gt_sh = T.alloc_shared((NST, 3, C), "float32", scope="shared")

            s_acc = T.alloc_fragment((BV, D), "float32")  # Sᵀ [V, K]
            s_bf = T.alloc_fragment((BV, D), "bfloat16")
            x_acc = T.alloc_fragment((BV, C), "float32")  # Sᵀ Kᵀ, then Vdᵀ
            o_acc = T.alloc_fragment((BV, C), "float32")
            w_bf = T.alloc_fragment((BV, C), "bfloat16")
            vt_bf = T.alloc_fragment((BV, C), "bfloat16")  # Vᵀ of the stage's V block
            vd_bf = T.alloc_fragment((BV, C), "bfloat16")
            vp_bf = T.alloc_fragment((BV, C), "bfloat16")
            o_bf = T.alloc_fragment((BV, C), "bfloat16")
            T.annotate_layout({o_bf: acc_layout((BV, C)), vt_bf: acc_layout((BV, C))})  # x_acc's and o_acc's
            T.annotate_layout({v_sh: make_swizzled_layout(v_sh)})  # 128-byte swizzle (qlb_load_vt)
            egl = T.alloc_var("float32")
            gv = T.alloc_local((2,), "float32")

            full = T.alloc_barrier([64] * NST)
            empty = T.alloc_barrier([160] * NST)  # the state and warp 6 (o stored from the stage's P buffer)
            o_staged = T.alloc_barrier([128] * NST)
            q_full = T.alloc_barrier([32])
            q_empty = T.alloc_barrier([128])

            bos = stab[s, 0]
            eos = stab[s, 1]
            seq = stab[s, 2]
            cslot = stab[s, 3]
            irow = stab[s, 4]
            is_last = stab[s, 5]
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
                    T.barrier_wait(q_full[0], ci % 2)
                    T.copy(s_acc, s_bf)
                    T.gemm(s_bf, q_sh, o_acc, transpose_B=True, clear_accum=True, policy=FR)
                    T.barrier_arrive(q_empty[0])
                    T.call_extern("handle", "qlb_load_vt", T.access_ptr(vt_bf[0, 0], "w"), T.access_ptr(v_sh[js, 0, 0], "r"))
                    T.gemm(s_bf, k_sh[js, :, :], x_acc, transpose_B=True, clear_accum=True, policy=FR)
                    for i, j in T.Parallel(BV, C):
                        w_bf[i, j] = T.cast(T.cast(vt_bf[i, j], "float32") - gt_sh[js, 0, j] * x_acc[i, j], "bfloat16")
                    T.gemm(w_bf, a_sh[js, :, :], x_acc, transpose_B=True, clear_accum=True, policy=FR)
                    for i, j in T.Parallel(BV, C):
                        vd_bf[i, j] = T.cast(x_acc[i, j], "bfloat16")
                        vp_bf[i, j] = T.cast(gt_sh[js, 1, j] * x_acc[i, j], "bfloat16")
                        o_acc[i, j] = o_acc[i, j] * (scale * gt_sh[js, 0, j])
                    egl = gt_sh[js, 2, 0]
                    for i, j in T.Parallel(BV, D):
                        s_acc[i, j] = s_acc[i, j] * egl
                    T.gemm(vp_bf, k_sh[js, :, :], s_acc, policy=FR)
                    T.gemm(vd_bf, pp_sh[js, :, :], o_acc, transpose_B=True, policy=FR)
                    for i, j in T.Parallel(BV, C):
                        o_bf[i, j] = T.cast(o_acc[i, j], "bfloat16")
                    T.sync_threads(O_SYNC_BAR, 128)  # o into the P buffer (BV = C): every warp's last GEMM has read P
                    T.call_extern("handle", "qlb_stage_o_trans", T.access_ptr(pp_sh[js, 0, 0], "w"), T.access_ptr(o_bf[0, 0], "r"))
                    T.sync_threads(O_SYNC_BAR, 128)  # a partial chunk's rows read the others' stores
                    ln = T.min(eos - bos - ci * C, C)
                    if ln < C:  # a partial (last) chunk's rows from here, full ones by warp 6
                        for j, i in T.Parallel(C, BV):
                            if j < ln:
                                o[0, bos + ci * C + j, hv, v0 + i] = pp_sh[js, j, i]
                    T.fence_proxy_async()  # warp 6's TMA store and the stage's next load (async proxy)
                    T.barrier_arrive(o_staged[js])
                    T.barrier_arrive(empty[js])
                if has_ht:
                    if is_last == 1:
                        for i, j in T.Parallel(BV, D):
                            ht[seq, hv, j, v0 + i] = s_acc[i, j]
            else:
                T.set_max_nreg(RP, 0)
                if tx < 160:
                    # warp 4: TMA loads (one elected lane issues them)
                    for ci in T.serial(nchunks):
                        js = ci % NST
                        pj = (ci // NST) % 2
                        t0 = bos + ci * C
                        r0 = (cslot + ci) * C
                        T.barrier_wait(empty[js], 1 - pj)
                        T.tma_copy(k[0, t0 : t0 + C, hk, 0:D], k_sh[js, :, :], barrier=full[js])
                        T.tma_copy(v[0, t0 : t0 + C, hv, v0 : v0 + BV], v_sh[js, :, :], barrier=full[js])
                        T.tma_copy(a_beta[hv, r0 : r0 + C, 0:C], a_sh[js, :, :], barrier=full[js])
                        T.tma_copy(p_all[hv, r0 : r0 + C, 0:C], pp_sh[js, :, :], barrier=full[js])
                        T.barrier_arrive(full[js])
                        T.barrier_wait(q_empty[0], 1 - ci % 2)
                        T.tma_copy(q[0, t0 : t0 + C, hk, 0:D], q_sh, barrier=q_full[0])
                        T.barrier_arrive(q_full[0])
                elif tx < 192:
                    gate_tables(gcs, gt_sh, empty, full, gv, hv, bos, eos, cslot, nchunks, tx - 160)
                elif tx < 224:  # warp 6: a full chunk's o out of the P buffer by TMA, then frees the stage
                    for ci in T.serial(nchunks):
                        js = ci % NST
                        T.barrier_wait(o_staged[js], (ci // NST) % 2)
                        if eos - bos - ci * C >= C:
                            T.copy(pp_sh[js, :, :], o[0, bos + ci * C : bos + ci * C + C, hv, v0 : v0 + BV])
                        T.barrier_arrive(empty[js])

    return gdn_fwd_o


@functools.cache
def get_fwd_o_kernel(h_qk: int, h_v: int, has_init: bool, has_ht: bool, target_k=None):
    return compile_program(
        fwd_o_program(h_qk, h_v, has_init, has_ht), target=parse_target(target_k), pass_configs=FAST_MATH
    )


def run_fwd_o(q, k, v, gcs, a_beta, p_all, stab, h_init, scale, o, ht, target=None):
    """Launch fwd_o; writes ``o`` (and ``ht`` if given) in place.

    q, k [1,T,Hqk,128] bf16; v [1,T,Hv,128] bf16; gcs [Hv,NCS*64] fp32, a_beta and p_all
    [Hv,NCS*64,64] bf16 (prep); stab int32 [NS,8]; h_init [R,Hv,128,128] fp32 (row stab[s, 4]) or
    None; o [1,T,Hv,128] bf16; ht [N,Hv,128,128] fp32 or None (written by each sequence's last segment).
    """
    h_qk, h_v = q.shape[2], v.shape[2]
    has_init, has_ht = h_init is not None, ht is not None
    kern = get_fwd_o_kernel(h_qk, h_v, has_init, has_ht, target_key(target))
    dummy = None
    if not (has_init and has_ht):
        dummy = torch.empty(1, h_v, HEAD_DIM, HEAD_DIM, device=q.device, dtype=torch.float32)
    kern(q, k, v, gcs, a_beta, p_all, stab, h_init if has_init else dummy, float(scale), o, ht if has_ht else dummy)
    return o, ht
