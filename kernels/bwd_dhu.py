"""Backward kernel 3: the reverse state-gradient chain (FLA's ``chunk_bwd_dv_local`` +
``chunk_gated_delta_rule_bwd_dhu``), warp-specialised, the state gradient in registers.

dH (the gradient of the state at the END of the current chunk) starts from d(final state) (or 0);
chunks in reverse. dh[slot] = bf16(dH) (d state at chunk end); dh0 = dH after the first chunk.
With Pᵀ = scale Γᵀ ⊙ K Qᵀ (i ≥ j, i < ln), el = mask·e^{g_l − g}, eg = mask·e^g:

    Y  = A_βᵀ dv_new = Y₀ + W' dH,   Y₀ = A_βᵀ bf16(Pᵀ dO),   W' = bf16(A_βᵀ bf16(el ⊙ K))
    dH ← e^{g_l} dH + Qᵀ bf16(scale eg ⊙ dO) + Kᵀ bf16(−eg ⊙ Y)
    dv_new = Pᵀ dO + el ⊙ (K dH)

(``tools/kernels/emulate_bwd.emu_bwd_dhu(uw=True)`` mirrors it.) Pᵀ and W' do not depend on dH: each
step builds them first, from the stage's Q, K, A_β and gate tables, into shared buffers the chain's
GEMMs read (no pass writes them to HBM and reads them back).

One CTA of 384 threads per (segment, v-head), full V = 128, one CTA per SM. The transposed
gradient dHᵀ [128 V, 128 K] is fp32 in the registers of two warpgroups (64 V rows each; every GEMM
is split by rows between them) and every GEMM but Pᵀ dO takes its A operand from registers (an
accumulator cast to bf16, or dO read transposed from shared memory, scaled and cast). Per chunk:

    K Qᵀ → Pᵀ = scale e^{g_i − g_j} (K Qᵀ)[j, i] (j ≤ i < ln)       (bf16, into pt_sh)
    W'ᵀ      = bf16(el ⊙ K)ᵀ A_β                                 (bf16, into w_sh, transposed)
               (both issued asynchronously; dh of the step goes out while they run)
    (Pᵀ dO)ᵀ = dOᵀ P                               (both read transposed from shared memory)
    Yᵀ       = bf16(Pᵀ dO)ᵀ A_β + bf16(dHᵀ) W'ᵀ
    dv_newᵀ  = (Pᵀ dO)ᵀ + el ⊙ (bf16(dHᵀ) Kᵀ)       (not in pass 1 of a split)
    dHᵀ     ← e^{g_l} dHᵀ + bf16(scale eg ⊙ dO)ᵀ Q + bf16(−eg ⊙ Y)ᵀ K

and dh and dv_new go to HBM through staging tiles in shared memory (written transposed from the
registers, swizzled), each stored by warp 10's TMA: the state writes no global memory in its walk,
so the proxy fences before its GEMMs (a ``MEMBAR`` each) wait for no global store.

Roles (the launch gives each thread ``NREG_LAUNCH`` registers; the state's .inc is what the
producer's .dec releases):

    WG0-1 (tx   0..255, setmaxnreg ``NREG[0]`` .inc)  dHᵀ, the six GEMMs, dh and dv_new staged
    WG0-1 also build Pᵀ and W' (K Qᵀ split by columns, W'ᵀ by rows between them)
    WG2   (tx 256..383, ``NREG[1]`` .dec)  warp 8: TMA loads of Q, K, dO and A_β of step r (chunk
            nchunks − 1 − r) into stage r % NST; warp 9: the chunk's gcs rows and the per-token
            tables e^g, mask · e^{g_l − g}, e^{g_l} and g into the stage
            (``seg_state.gate_tables_macro``); warp 10: dh and dv_new of each step from their
            staging tiles to HBM by TMA stores (not in pass 1 of a split); warp 11 exits

mbarriers: full[js] (64: warps 8 and 9 + TMA tx bytes; the state waits parity (r // NST) % 2),
empty[js] (256: the state, done with stage js; the producers wait the other parity, which passes
at once on a fresh barrier); dh_staged / dv_staged (256: the state, tile written and fenced; warp 10
waits r % 2), dh_free / dv_free (32: warp 10, its TMA store has read the tile; the state waits 1 − r % 2).

Split modes: "" walks whole sequences (dht by sequence, dh0 by sequence); "seg" (pass 1 over a split
stab) walks every segment but the first of its sequence from dH_end = 0 (the last one from d(final
state)), or only its first chunks from 0 where they decay the rest below e^``WARMUP_LOG_DECAY``
(seg_state.py's warm-up), and writes F (the gradient at its start) into dh0 [NS,...] by segment, no dh / dv_new;
"carry" (pass 2) walks every segment from its true dH_end (dht = d_end [NS,...] by segment, from
``fixup.run_fixup(reverse=True)``) and stores dh, dv_new and dh0 by sequence.

Inputs:  q, k [1,T,Hqk,128] bf16, gcs, a_beta (prep), do [1,T,Hv,128] bf16, dht fp32 (read when
         ``has_dht``), stab int32 [NS,8], scale.
Outputs: dh_all [Hv, NCS, 128, 128] bf16, dvnew [Hv, NCS*64, 128] bf16, dh0 fp32 (``has_dh0``).
"""

import functools

import torch

from ._common import CHUNK, FAST_MATH, HEAD_DIM, check_heads, compile_program, parse_target, target_key
from .seg_state import WARMUP_LOG_DECAY, WARMUP_SRC, gate_tables_macro

#: registers per thread at launch (384 threads, one CTA per SM)
NREG_LAUNCH = 65536 // 384 // 8 * 8
#: setmaxnreg budgets of the two state warpgroups (.inc) and the producer warpgroup (.dec): the
#: .dec releases what the two .inc take
NREG = (232, 40)
assert 2 * NREG[0] + NREG[1] == 3 * NREG_LAUNCH
#: input ring depth
NST = 2


def dh_io_macros(split: str, has_dht: bool, has_dh0: bool, D: int):
    """The start and the end of one (segment, v-head) walk of the reverse chain, on the transposed
    gradient dHᵀ [V, K]: ``dh_start`` loads dH at the segment's end (d(final state), the reverse
    fix-up's d_end, or 0, by ``split`` and ``has_dht``); ``dh_end`` writes dH at its start (dh0
    by sequence, or F by segment in pass 1). ``is_last`` / ``is_first`` come from the split
    table; unsplit programs pass 0 (not read)."""
    import tilelang.language as T

    @T.macro
    def load_t(dh_acc, src, row, hv):
        for i, j in T.Parallel(D, D):
            dh_acc[i, j] = src[row, hv, j, i]

    @T.macro
    def store_t(dh_acc, dst, row, hv):
        for i, j in T.Parallel(D, D):
            dst[row, hv, j, i] = dh_acc[i, j]

    @T.macro
    def dh_start(dh_acc, dht, s, seq, hv, is_last):
        if split == "carry":
            load_t(dh_acc, dht, s, hv)
        elif split == "seg" and has_dht:
            if seq >= 0 and is_last == 1:
                load_t(dh_acc, dht, seq, hv)
            else:
                T.clear(dh_acc)
        elif has_dht:
            if seq >= 0:
                load_t(dh_acc, dht, seq, hv)
            else:
                T.clear(dh_acc)
        else:
            T.clear(dh_acc)

    @T.macro
    def dh_end(dh_acc, dh0, s, seq, hv, is_first):
        if split == "seg":
            if seq >= 0 and is_first == 0:
                store_t(dh_acc, dh0, s, hv)
        elif split == "carry" and has_dh0:
            if seq >= 0 and is_first == 1:
                store_t(dh_acc, dh0, seq, hv)
        elif has_dh0:
            if seq >= 0:
                store_t(dh_acc, dh0, seq, hv)

    return dh_start, dh_end


def bwd_dhu_program(h_qk: int, h_v: int, has_dht: bool, has_dh0: bool, split: str = ""):
    """The prim_func ``gdn_bwd_dhu`` for one head config, state flags and split mode."""
    import tilelang.language as T
    from tilelang.layout import make_swizzled_layout

    assert split in ("", "seg", "carry")
    dh_start, dh_end = dh_io_macros(split, has_dht, has_dh0, HEAD_DIM)
    G = check_heads(h_qk, h_v)
    C, D = CHUNK, HEAD_DIM
    Tn = T.dynamic("T")
    NCS = T.dynamic("NCS")
    NS = T.dynamic("NS")
    ND = T.dynamic("ND")
    N0 = T.dynamic("N0")
    RS, RP = NREG
    FR = T.GemmWarpPolicy.FullRow
    FC = T.GemmWarpPolicy.FullCol
    gate_tables = gate_tables_macro(NST, reverse=True, raw=True)

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
        with T.Kernel(NS * h_v, threads=384) as sh:
            if split == "seg":
                T.import_source(WARMUP_SRC)
            s = sh // h_v
            hv = sh % h_v
            hk = hv // G

            q_sh = T.alloc_shared((NST, C, D), "bfloat16")
            k_sh = T.alloc_shared((NST, C, D), "bfloat16")
            do_sh = T.alloc_shared((NST, C, D), "bfloat16")
            a_sh = T.alloc_shared((NST, C, C), "bfloat16")
            pt_sh = T.alloc_shared((C, C), "bfloat16")  # Pᵀ of the step
            w_sh = T.alloc_shared((C, D), "bfloat16")  # W' of the step
            # gt_sh[js, 0..3, i]: e^g, mask · e^{g_l − g}, e^{g_l} (in every column), g
            gt_sh = T.alloc_shared((NST, 4, C), "float32", scope="shared")
            # dh [K, V] and dv_new [C, V] of the chunk on their way out: written from the registers
            # (transposed), stored by warp 10's TMA
            dhs_sh = T.alloc_shared((D, D), "bfloat16")
            dvs_sh = T.alloc_shared((C, D), "bfloat16")
            T.annotate_layout({dhs_sh: make_swizzled_layout(dhs_sh), dvs_sh: make_swizzled_layout(dvs_sh)})

            dh_acc = T.alloc_fragment((D, D), "float32")  # dHᵀ [V, K]
            kq_acc = T.alloc_fragment((C, C), "float32")  # K Qᵀ
            dh_bf = T.alloc_fragment((D, D), "bfloat16")
            pdo_acc = T.alloc_fragment((D, C), "float32")  # (Pᵀ dO)ᵀ
            y_acc = T.alloc_fragment((D, C), "float32")  # W'ᵀ, then Yᵀ, then (K dH)ᵀ
            x_bf = T.alloc_fragment((D, C), "bfloat16")  # bf16(el ⊙ K)ᵀ, then bf16(Pᵀ dO)ᵀ, then bf16(−eg ⊙ Y)ᵀ
            qdo_bf = T.alloc_fragment((D, C), "bfloat16")  # bf16(scale eg ⊙ dO)ᵀ
            egl = T.alloc_var("float32")
            gv = T.alloc_local((2,), "float32")

            full = T.alloc_barrier([64] * NST)
            empty = T.alloc_barrier([256] * NST)
            # dh's and dv_new's staging tiles: staged by the state (256), stored (warp 10's TMA) and free again (32)
            dh_staged = T.alloc_barrier([256])
            dh_free = T.alloc_barrier([32])
            dv_staged = T.alloc_barrier([256])
            dv_free = T.alloc_barrier([32])

            bos = stab[s, 0]
            eos = stab[s, 1]
            seq = stab[s, 2]
            cslot = stab[s, 3]
            if split:
                is_last = stab[s, 5]
                is_first = T.if_then_else(s == 0, 1, T.if_then_else(stab[T.max(s - 1, 0), 2] != seq, 1, 0))
            if split == "seg":  # F needs only the first chunks where they decay what lies after them (seg_state.py)
                n_seg = T.if_then_else(seq >= 0 and is_first == 0, T.ceildiv(eos - bos, C), 0)
                nchunks = T.alloc_var("int32")
                nchunks = T.call_extern("int32", "qlb_warmup_len", T.access_ptr(gcs[hv, cslot * C], "r"), n_seg,
                                        T.float32(WARMUP_LOG_DECAY), True)  # fmt: skip
            else:
                nchunks = T.if_then_else(seq >= 0, T.ceildiv(eos - bos, C), 0)

            tx = T.get_thread_binding()
            if tx < 256:
                T.set_max_nreg(RS, 1)
                if split == "seg":  # past a warm-up dH starts from 0
                    dh_start(dh_acc, dht, s, seq, hv, T.if_then_else(nchunks < n_seg, 0, is_last))
                elif split:
                    dh_start(dh_acc, dht, s, seq, hv, is_last)
                else:
                    dh_start(dh_acc, dht, s, seq, hv, 0)
                for cr in T.serial(nchunks):
                    js = cr % NST
                    pj = (cr // NST) % 2
                    ci = nchunks - 1 - cr
                    ln = T.min(eos - (bos + ci * C), C)
                    r0 = (cslot + ci) * C
                    T.barrier_wait(full[js], pj)
                    for kk, i in T.Parallel(D, C):  # bf16(el ⊙ K)ᵀ (el is 0 past ln)
                        x_bf[kk, i] = T.cast(gt_sh[js, 1, i] * T.cast(k_sh[js, i, kk], "float32"), "bfloat16")
                    T.wgmma_gemm(k_sh[js, :, :], q_sh[js, :, :], kq_acc, transpose_B=True, clear_accum=True, policy=FC)
                    T.wgmma_gemm(x_bf, a_sh[js, :, :], y_acc, clear_accum=True, policy=FR)
                    T.copy(dh_acc, dh_bf)  # dh goes out while K Qᵀ and W'ᵀ run
                    if split != "seg":
                        T.barrier_wait(dh_free[0], 1 - cr % 2)
                        for i, j in T.Parallel(D, D):
                            dhs_sh[j, i] = dh_bf[i, j]
                        T.fence_proxy_async()
                        T.barrier_arrive(dh_staged[0])
                    T.wait_wgmma(1)
                    T.warpgroup_fence_operand(kq_acc, num_regs=C * C // 256)
                    for j, i in T.Parallel(C, C):
                        pt_sh[j, i] = T.cast(
                            T.if_then_else(
                                i >= j and i < ln, scale * T.exp(gt_sh[js, 3, i] - gt_sh[js, 3, j]) * kq_acc[j, i],
                                T.float32(0),
                            ),
                            "bfloat16",
                        )
                    T.wait_wgmma(0)
                    T.warpgroup_fence_operand(y_acc, num_regs=D * C // 256)
                    for kk, i in T.Parallel(D, C):
                        w_sh[i, kk] = T.cast(y_acc[kk, i], "bfloat16")
                    T.gemm(do_sh[js, :, :], pt_sh, pdo_acc, transpose_A=True, transpose_B=True, clear_accum=True,
                           policy=FR)  # fmt: skip
                    T.copy(pdo_acc, x_bf)
                    T.gemm(x_bf, a_sh[js, :, :], y_acc, clear_accum=True, policy=FR)
                    T.gemm(dh_bf, w_sh, y_acc, transpose_B=True, policy=FR)
                    for i, j in T.Parallel(D, C):
                        x_bf[i, j] = T.cast(T.if_then_else(j < ln, -gt_sh[js, 0, j], T.float32(0)) * y_acc[i, j], "bfloat16")
                    if split != "seg":
                        T.gemm(dh_bf, k_sh[js, :, :], y_acc, transpose_B=True, clear_accum=True, policy=FR)
                        T.barrier_wait(dv_free[0], 1 - cr % 2)
                        for i, j in T.Parallel(D, C):
                            dvs_sh[j, i] = T.cast(pdo_acc[i, j] + gt_sh[js, 1, j] * y_acc[i, j], "bfloat16")
                        T.fence_proxy_async()
                        T.barrier_arrive(dv_staged[0])
                    for i, j in T.Parallel(D, C):
                        qdo_bf[i, j] = T.cast(
                            T.if_then_else(j < ln, scale * gt_sh[js, 0, j], T.float32(0))
                            * T.cast(do_sh[js, j, i], "float32"),
                            "bfloat16",
                        )
                    egl = gt_sh[js, 2, 0]
                    for i, j in T.Parallel(D, D):
                        dh_acc[i, j] = dh_acc[i, j] * egl
                    T.gemm(qdo_bf, q_sh[js, :, :], dh_acc, policy=FR)
                    T.gemm(x_bf, k_sh[js, :, :], dh_acc, policy=FR)
                    T.barrier_arrive(empty[js])
                if split:
                    dh_end(dh_acc, dh0, s, seq, hv, is_first)
                else:
                    dh_end(dh_acc, dh0, s, seq, hv, 0)
            else:
                T.set_max_nreg(RP, 0)
                if tx < 288:
                    # warp 8: TMA loads (one elected lane issues them), chunks in reverse
                    for cr in T.serial(nchunks):
                        js = cr % NST
                        pj = (cr // NST) % 2
                        ci = nchunks - 1 - cr
                        t0 = bos + ci * C
                        r0 = (cslot + ci) * C
                        T.barrier_wait(empty[js], 1 - pj)
                        T.tma_copy(q[0, t0 : t0 + C, hk, 0:D], q_sh[js, :, :], barrier=full[js])
                        T.tma_copy(k[0, t0 : t0 + C, hk, 0:D], k_sh[js, :, :], barrier=full[js])
                        T.tma_copy(do[0, t0 : t0 + C, hv, 0:D], do_sh[js, :, :], barrier=full[js])
                        T.tma_copy(a_beta[hv, r0 : r0 + C, 0:C], a_sh[js, :, :], barrier=full[js])
                        T.barrier_arrive(full[js])
                elif tx < 320:
                    gate_tables(gcs, gt_sh, empty, full, gv, hv, bos, eos, cslot, nchunks, tx - 288)
                elif tx < 352:
                    if split != "seg":
                        # warp 10: dh and dv_new of each step from their staging tiles, by TMA
                        for cr in T.serial(nchunks):
                            ci = nchunks - 1 - cr
                            T.barrier_wait(dh_staged[0], cr % 2)
                            T.copy(dhs_sh, dh_all[hv, cslot + ci, 0:D, 0:D])
                            T.barrier_arrive(dh_free[0])
                            T.barrier_wait(dv_staged[0], cr % 2)
                            T.copy(dvs_sh, dvnew[hv, (cslot + ci) * C : (cslot + ci) * C + C, 0:D])
                            T.barrier_arrive(dv_free[0])

    return gdn_bwd_dhu


@functools.cache
def get_bwd_dhu_kernel(h_qk: int, h_v: int, has_dht: bool, has_dh0: bool, target_k=None, split: str = ""):
    return compile_program(
        bwd_dhu_program(h_qk, h_v, has_dht, has_dh0, split), target=parse_target(target_k), pass_configs=FAST_MATH
    )


def run_bwd_dhu(q, k, gcs, a_beta, do, dht, stab, scale, dh0, dh_all=None, dvnew=None, target=None, split=""):
    """Launch the reverse chain. dht: [N,Hv,128,128] fp32 or None ([NS,...] by segment with
    split="carry"); dh0: preallocated fp32 to fill ([N,...], or F [NS,...] with split="seg") or None.
    Returns dh_all, dvnew, dh0."""
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
    kern = get_bwd_dhu_kernel(h_qk, h_v, has_dht, has_dh0, target_key(target), split=split)
    dummy = None
    if not (has_dht and has_dh0):
        dummy = torch.empty(1, h_v, HEAD_DIM, HEAD_DIM, device=dev, dtype=torch.float32)
    kern(q, k, gcs, a_beta, do, dht if has_dht else dummy, stab, float(scale), dh_all, dvnew, dh0 if has_dh0 else dummy)
    return dh_all, dvnew, dh0
