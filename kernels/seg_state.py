"""Sequence splitting, pass 1: each segment's local end state and its state transition.

A segment's chunks map its start state S₀ affinely: S_end = M · S₀ + E, where E = the end state
reached from S₀ = 0 and M [128, 128] = the product of the per-chunk maps S ↦ e^{g_last} S − Kᵀ
diag(e^{g_last − g}) A_β diag(e^g) K S. Both come out of one recurrence over an augmented state
[S | M] of width 256 started from [0 | I], with the value input [V | 0] (the recurrence is linear in
(S₀, V)). Each chunk's map has norm ≤ e^{g_last} (‖I − β k kᵀ‖ ≤ 1 for L2-normalised keys and 0 ≤ β ≤
2, the kernels' input contract): where a segment's chunks from c on decay by e^{Σ g_last} below
e^``WARMUP_LOG_DECAY``, E is walked from 0 from chunk c alone and M stored as 0, both within that
bound (for the forward's fix-up and the backward's reverse one; ``qlb_warmup_len`` finds c); heads
that do not decay (g = 0) walk the whole segment, exactly.

One CTA of 256 threads per (64-column block of the augmented state, segment, v-head) for the
segments that are not the last of their sequence (whose transition is never needed): the grid
walks those alone, non-last segment w at slot w + n for n the last sequence with cu_segs[n] − n ≤
w (a binary search), a segment's v-heads adjacent, so the CTAs that work are the first the SMs
take. The block's transposed state Sᵀ [64 columns, 128 K] is fp32 in the registers of one
warpgroup and every GEMM takes A from registers (bf16; wgmma M = 64), per chunk

    Xᵀ  = Sᵀ Kᵀ
    Vdᵀ = (Vᵀ − e^g ⊙ Xᵀ) A_βᵀ           (Vᵀ by ldmatrix .trans, ``V_LOAD_SRC``; 0 in the M half)
    Sᵀ ← e^{g_last} Sᵀ + (mask · e^{g_last − g} ⊙ Vd)ᵀ K

Roles (two CTAs per SM: the launch gives each thread 128 registers, and the setmaxnreg budgets
sum to what two warpgroups hold):

    WG0 (tx   0..127, setmaxnreg ``NREG[0]`` .inc)  the state and the three GEMMs
    WG1 (tx 128..255, ``NREG[1]`` .dec)  warp 4: TMA loads of K, the V block (V half) and A_β into
            stage c % NST; warp 5: the chunk's gcs rows and the per-token tables e^g,
            mask · e^{g_last − g} and e^{g_last} into the same stage; warps 6-7 exit

mbarriers: full[js] (64: warps 4 and 5 + TMA tx bytes; the state waits parity (c // NST) % 2),
empty[js] (128: the state, done with stage js; the producers wait the other parity, which passes
at once on a fresh barrier).

Inputs:  k [1,T,Hqk,128] bf16, v [1,T,Hv,128] bf16, gcs, a_beta (prep), stab [NS, 8], cu_segs [N+1] int32.
Outputs: e_end [NS, Hv, 128, 128] fp32 (E), m_tr [NS, Hv, 128, 128] bf16 (M, row = output k index).
"""

import functools

from ._common import CHUNK, FAST_MATH, HEAD_DIM, check_heads, compile_program, parse_target, target_key

#: CTAs per SM that ptxas must fit (``__launch_bounds__``): 256 threads at 128 registers each
MIN_BLOCKS = 2
NREG_LAUNCH = 65536 // (256 * MIN_BLOCKS)
#: setmaxnreg budgets of the state warpgroup (.inc) and the producer warpgroup (.dec); they sum to
#: what the launch gives two warpgroups
NREG = (208, 48)
assert NREG[0] + NREG[1] == 2 * NREG_LAUNCH
#: input ring depth
NST = 2
#: a walk starts past a warm-up where the chunks it skips are decayed by less than e^this (< 2^-28)
WARMUP_LOG_DECAY = -20.0
#: the fewest chunks at one end of a segment's n (its last, or its first with from_first) whose total
#: log-decay is below thr, n if none; gl = the segment's gcs row (row 64 c + 63 = chunk c's total). A
#: warp's prefix scan over 32 chunks at a time, four loads in flight; every lane returns the same count
WARMUP_SRC = r"""
__device__ __forceinline__ int qlb_warmup_len(const float* gl, int n, float thr, bool from_first) {
  const int lane = threadIdx.x & 31;
  float acc = 0.f, x[4];
  for (int b = 0; b < n; b += 128) {
    #pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int i = b + 32 * u + lane;
      x[u] = i < n ? gl[64 * (from_first ? i : n - 1 - i) + 63] : 0.f;
    }
    #pragma unroll
    for (int u = 0; u < 4; ++u) {
      #pragma unroll
      for (int o = 1; o < 32; o <<= 1) { const float y = __shfl_up_sync(~0u, x[u], o); x[u] += lane >= o ? y : 0.f; }
      const unsigned hit = __ballot_sync(~0u, (x[u] += acc) < thr);
      if (hit) return b + 32 * u + __ffs(hit);
      acc = __shfl_sync(~0u, x[u], 31);
    }
  }
  return n;
}
"""


#: the inverse of ``fwd_o.O_STAGE_SRC`` (a TMA-loaded V tile in that layout into an ``acc_layout`` fragment of
#: Vᵀ [64 V, 64 tokens] per warpgroup): four ldmatrix .x4.trans per thread, the same addresses and registers
V_LOAD_SRC = r"""
__device__ __forceinline__ void qlb_load_vt(void* frag, const void* stage) {
  const int t = threadIdx.x, q = (t & 31) >> 3, r = t & 7;
  unsigned* v = static_cast<unsigned*>(frag);
  const unsigned short* half = static_cast<const unsigned short*>(stage) + ((t >> 7) & 1) * 4096;
  #pragma unroll
  for (int m = 0; m < 4; ++m) asm volatile("ldmatrix.sync.aligned.x4.trans.m8n8.shared.b16 {%0, %1, %2, %3}, [%4];\n" :
    "=r"(v[4 * m]), "=r"(v[4 * m + 1]), "=r"(v[4 * m + 2]), "=r"(v[4 * m + 3]) :
    "r"(static_cast<unsigned>(__cvta_generic_to_shared(half + (16 * m + 8 * (q >> 1) + r) * 64 + ((2 * ((t >> 5) & 3) + (q & 1)) ^ r) * 8))) : "memory");
}
"""


def acc_layout(shape):
    """TileLang's layout of a [rows, 64] wgmma accumulator, 128 threads per 64 rows (``fwd_o.O_STAGE_SRC``)."""
    import tilelang.language as T

    return T.Fragment(shape, forward_thread_fn=lambda i, j: i // 16 * 32 + i % 8 * 4 + j % 8 // 2,
                      forward_index_fn=lambda i, j: j // 8 * 4 + i % 16 // 8 * 2 + j % 2)


def gate_tables_macro(nst: int, reverse: bool = False, raw: bool = False):
    """The producer warp that writes a chunk's per-token tables into stage r % ``nst`` of
    gt_sh [nst, 3 (4 with ``raw``), 64] (seg_state, fwd_o, bwd_h; bwd_dhu with ``reverse``: step r
    is chunk nchunks − 1 − r): for each step, once the stage is free, its chunk's gcs rows (lane l
    holds rows 2l, 2l + 1) → e^g, mask · e^{g_l − g}, e^{g_l} (in every column) and, with ``raw``,
    g itself, then its arrive on full. ``gv`` (2 floats) is the warp's local."""
    import tilelang.language as T

    C = CHUNK

    @T.macro
    def tables_of_chunk(gcs, gt_sh, empty, full, gv, hv, bos, eos, cslot, lane, ci, js, pj):
        t0 = bos + ci * C
        ln = T.min(eos - t0, C)
        r0 = (cslot + ci) * C
        T.barrier_wait(empty[js], 1 - pj)
        for r in T.unroll(2):
            gv[r] = gcs[hv, r0 + 2 * lane + r]
        gl = T.shfl_sync(T.if_then_else((ln - 1) % 2 == 0, gv[0], gv[1]), (ln - 1) // 2)
        for r in T.unroll(2):
            gt_sh[js, 0, 2 * lane + r] = T.exp(gv[r])
            gt_sh[js, 1, 2 * lane + r] = T.if_then_else(2 * lane + r < ln, T.exp(gl - gv[r]), T.float32(0))
            gt_sh[js, 2, 2 * lane + r] = T.exp(gl)
            if raw:
                gt_sh[js, 3, 2 * lane + r] = gv[r]
        T.barrier_arrive(full[js])

    if reverse:

        @T.macro
        def gate_tables(gcs, gt_sh, empty, full, gv, hv, bos, eos, cslot, nchunks, lane):
            for cr in T.serial(nchunks):
                tables_of_chunk(gcs, gt_sh, empty, full, gv, hv, bos, eos, cslot, lane, nchunks - 1 - cr, cr % nst,
                                (cr // nst) % 2)  # fmt: skip

    else:

        @T.macro
        def gate_tables(gcs, gt_sh, empty, full, gv, hv, bos, eos, cslot, nchunks, lane):
            for ci in T.serial(nchunks):
                tables_of_chunk(gcs, gt_sh, empty, full, gv, hv, bos, eos, cslot, lane, ci, ci % nst, (ci // nst) % 2)

    return gate_tables


def kva_loads_macro(nst: int, bv: int):
    """The producer warp of seg_state and bwd_h: for each chunk, once stage c % ``nst`` is free, the
    elected lane's TMA loads of K (q/k head ``hk``), the ``bv``-column V block at ``c0`` (when
    ``with_v``: a Python bool or a run-time condition) and A_β into the stage, then the warp's
    arrive on full."""
    import tilelang.language as T

    C, D = CHUNK, HEAD_DIM

    @T.macro
    def kva_loads(k, v, a_beta, k_sh, v_sh, a_sh, empty, full, hk, hv, c0, bos, cslot, nchunks, with_v):
        for ci in T.serial(nchunks):
            js = ci % nst
            pj = (ci // nst) % 2
            t0 = bos + ci * C
            r0 = (cslot + ci) * C
            T.barrier_wait(empty[js], 1 - pj)
            T.tma_copy(k[0, t0 : t0 + C, hk, 0:D], k_sh[js, :, :], barrier=full[js])
            if with_v:
                T.tma_copy(v[0, t0 : t0 + C, hv, c0 : c0 + bv], v_sh[js, :, :], barrier=full[js])
            T.tma_copy(a_beta[hv, r0 : r0 + C, 0:C], a_sh[js, :, :], barrier=full[js])
            T.barrier_arrive(full[js])

    return kva_loads


def chain_step_macro(bv: int):
    """One chunk of the recurrence on ``bv`` columns of Sᵀ in one warpgroup's registers (seg_state,
    bwd_h), as two macros: ``chain_issue`` issues Xᵀ = bf16(Sᵀ) Kᵀ (``s_bf`` = bf16(Sᵀ)) and, ``with_v``,
    reads the stage's Vᵀ into ``vt_bf`` while it runs (ldmatrix .trans; without V the caller clears
    ``vt_bf`` once); ``chain_update`` waits, forms Vdᵀ = bf16(Vᵀ − e^g ⊙ Xᵀ) A_βᵀ (one GEMM, into
    ``x_acc``) and issues Sᵀ ← e^{g_l} Sᵀ + bf16(mask e^{g_l − g} ⊙ Vd)ᵀ K, which the caller waits for
    (wait_wgmma(0), a fence of ``s_acc``) before reading Sᵀ or freeing the stage; ``keep_vd`` leaves
    bf16(Vdᵀ) in ``w_bf``."""
    import tilelang.language as T

    C = CHUNK
    FR = T.GemmWarpPolicy.FullRow

    @T.macro
    def chain_issue(s_bf, x_acc, vt_bf, k_sh, v_sh, js, with_v):
        T.wgmma_gemm(s_bf, k_sh[js, :, :], x_acc, transpose_B=True, clear_accum=True, policy=FR)
        if with_v:
            T.call_extern("handle", "qlb_load_vt", T.access_ptr(vt_bf[0, 0], "w"), T.access_ptr(v_sh[js, 0, 0], "r"))

    @T.macro
    def chain_update(s_acc, x_acc, vt_bf, w_bf, vp_bf, k_sh, a_sh, gt_sh, js, keep_vd):
        T.wait_wgmma(0)
        T.warpgroup_fence_operand(x_acc, num_regs=bv * C // 128)
        for i, j in T.Parallel(bv, C):
            w_bf[i, j] = T.cast(T.cast(vt_bf[i, j], "float32") - gt_sh[js, 0, j] * x_acc[i, j], "bfloat16")
        T.wgmma_gemm(w_bf, a_sh[js, :, :], x_acc, transpose_B=True, clear_accum=True, policy=FR)
        T.wait_wgmma(0)
        T.warpgroup_fence_operand(x_acc, num_regs=bv * C // 128)
        for i, j in T.Parallel(bv, C):
            if keep_vd:
                w_bf[i, j] = T.cast(x_acc[i, j], "bfloat16")
            vp_bf[i, j] = T.cast(gt_sh[js, 1, j] * x_acc[i, j], "bfloat16")
        egl = gt_sh[js, 2, 0]
        for i, j in T.Parallel(bv, HEAD_DIM):
            s_acc[i, j] = s_acc[i, j] * egl
        T.wgmma_gemm(vp_bf, k_sh[js, :, :], s_acc, policy=FR)

    return chain_issue, chain_update


def seg_state_program(h_qk: int, h_v: int):
    """The prim_func ``gdn_seg_state`` for one head config."""
    import tilelang.language as T
    from tilelang.layout import make_swizzled_layout

    G = check_heads(h_qk, h_v)
    C, D, BV = CHUNK, HEAD_DIM, 64
    W2 = 2 * D
    Tn = T.dynamic("T")
    NCS = T.dynamic("NCS")
    NS = T.dynamic("NS")
    N1 = T.dynamic("N1")
    RS, RP = NREG
    gate_tables = gate_tables_macro(NST)
    kva_loads = kva_loads_macro(NST, BV)
    chain_issue, chain_update = chain_step_macro(BV)

    @T.prim_func
    def gdn_seg_state(
        k: T.Tensor((1, Tn, h_qk, D), "bfloat16"),
        v: T.Tensor((1, Tn, h_v, D), "bfloat16"),
        gcs: T.Tensor((h_v, NCS * C), "float32"),
        a_beta: T.Tensor((h_v, NCS * C, C), "bfloat16"),
        stab: T.Tensor((NS, 8), "int32"),
        cu_segs: T.Tensor((N1,), "int32"),
        e_end: T.Tensor((NS, h_v, D, D), "float32"),
        m_tr: T.Tensor((NS, h_v, D, D), "bfloat16"),
    ):
        with T.Kernel(W2 // BV, T.max(NS - N1 + 1, 1) * h_v, threads=256) as (bv, wh):
            T.import_source(V_LOAD_SRC + WARMUP_SRC)
            T.annotate_min_blocks_per_sm(MIN_BLOCKS)
            w = wh // h_v
            hv = wh % h_v
            hk = hv // G
            c0 = bv * BV  # first column in the augmented [V | M] space
            lo = T.alloc_var("int32")
            hi = T.alloc_var("int32")
            lo = 0
            hi = N1 - 1
            for _it in T.serial(31):
                if hi - lo > 1:
                    if cu_segs[(lo + hi) // 2] - (lo + hi) // 2 <= w:
                        lo = (lo + hi) // 2
                    else:
                        hi = (lo + hi) // 2
            live = w < cu_segs[N1 - 1] - (N1 - 1)
            s = T.if_then_else(live, w + lo, 0)

            k_sh = T.alloc_shared((NST, C, D), "bfloat16")
            v_sh = T.alloc_shared((NST, C, BV), "bfloat16")
            a_sh = T.alloc_shared((NST, C, C), "bfloat16")
            # gt_sh[js, 0..2, i]: e^g, mask · e^{g_last − g}, e^{g_last} (in every column)
            gt_sh = T.alloc_shared((NST, 3, C), "float32", scope="shared")

            s_acc = T.alloc_fragment((BV, D), "float32")  # Sᵀ [columns, K]
            s_bf = T.alloc_fragment((BV, D), "bfloat16")
            x_acc = T.alloc_fragment((BV, C), "float32")  # Sᵀ Kᵀ
            vt_bf = T.alloc_fragment((BV, C), "bfloat16")  # Vᵀ of the stage's V block (0 in the M half)
            w_bf = T.alloc_fragment((BV, C), "bfloat16")
            vp_bf = T.alloc_fragment((BV, C), "bfloat16")
            gv = T.alloc_local((2,), "float32")
            T.annotate_layout({vt_bf: acc_layout((BV, C)), v_sh: make_swizzled_layout(v_sh)})  # qlb_load_vt's

            full = T.alloc_barrier([64] * NST)
            empty = T.alloc_barrier([128] * NST)

            bos = stab[s, 0]
            eos = stab[s, 1]
            seq = stab[s, 2]
            cslot = stab[s, 3]
            is_last = stab[s, 5]
            works = live and seq >= 0 and is_last == 0
            nchunks = T.if_then_else(works, T.ceildiv(eos - bos, C), 0)
            # the first chunk walked: E's from its warm-up; M's 0, or past the end (M = 0) after a warm-up
            wl = T.alloc_var("int32")
            wl = T.call_extern("int32", "qlb_warmup_len", T.access_ptr(gcs[hv, cslot * C], "r"), nchunks,
                               T.float32(WARMUP_LOG_DECAY), False)  # fmt: skip
            c1 = T.alloc_var("int32")  # a variable, not an expression: the indices below stay simple to prove
            c1 = T.if_then_else(c0 < D, nchunks - wl, T.if_then_else(wl < nchunks, nchunks, 0))
            nwalk = nchunks - c1

            tx = T.get_thread_binding()
            if tx < 128:
                T.set_max_nreg(RS, 1)
                # [0 | I] start: row i of the block is column c0 + i, e_{c0 + i − D} in the M half
                for i, j in T.Parallel(BV, D):
                    s_acc[i, j] = T.if_then_else(T.And(c0 + i - D == j, c1 == 0), T.float32(1), T.float32(0))
                if c0 >= D:
                    T.clear(vt_bf)
                for ci in T.serial(nwalk):
                    js = ci % NST
                    pj = (ci // NST) % 2
                    T.barrier_wait(full[js], pj)
                    T.copy(s_acc, s_bf)
                    chain_issue(s_bf, x_acc, vt_bf, k_sh, v_sh, js, c0 < D)
                    chain_update(s_acc, x_acc, vt_bf, w_bf, vp_bf, k_sh, a_sh, gt_sh, js, False)
                    T.wait_wgmma(0)
                    T.warpgroup_fence_operand(s_acc, num_regs=BV * D // 128)
                    T.barrier_arrive(empty[js])
                if works:
                    if c0 < D:
                        for i, j in T.Parallel(BV, D):
                            e_end[s, hv, j, c0 + i] = s_acc[i, j]
                    else:
                        for i, j in T.Parallel(BV, D):
                            m_tr[s, hv, j, c0 - D + i] = T.cast(s_acc[i, j], "bfloat16")
            else:
                T.set_max_nreg(RP, 0)
                if tx < 160:  # warp 4: TMA loads (one elected lane issues them)
                    kva_loads(k, v, a_beta, k_sh, v_sh, a_sh, empty, full, hk, hv, c0, bos + c1 * C, cslot + c1, nwalk, c0 < D)
                elif tx < 192:
                    gate_tables(gcs, gt_sh, empty, full, gv, hv, bos + c1 * C, eos, cslot + c1, nwalk, tx - 160)

    return gdn_seg_state


@functools.cache
def get_seg_state_kernel(h_qk: int, h_v: int, target_k=None):
    return compile_program(seg_state_program(h_qk, h_v), target=parse_target(target_k), pass_configs=FAST_MATH)


def run_seg_state(k, v, gcs, a_beta, stab, cu_segs, e_end, m_tr, target=None):
    """Launch pass 1 (``cu_segs`` int32 [N+1] from the tables); fills e_end [NS,Hv,128,128] fp32 and
    m_tr [NS,Hv,128,128] bf16 in place (the rows of last segments are left untouched)."""
    kern = get_seg_state_kernel(k.shape[2], v.shape[2], target_key(target))
    kern(k, v, gcs, a_beta, stab, cu_segs, e_end, m_tr)
    return e_end, m_tr
