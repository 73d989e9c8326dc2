"""Backward kernel 3: the reverse state-gradient chain (FLA's ``chunk_bwd_dv_local`` +
``chunk_gated_delta_rule_bwd_dhu``), warp-specialised, with the dH-independent work off the chain.

dH [128, 32] (the gradient of the state at the END of the current chunk) stays in fp32 registers,
starting from d(final state) (or 0); chunks in reverse. dh[slot] = bf16(dH) (d state at chunk end);
dh0 = dH after the first chunk. With Pᵀ = scale Γᵀ ⊙ K Qᵀ (i ≥ j, i < ln), el = mask·e^{g_l − g}, eg = mask·e^g:

    Y  = A_βᵀ dv_new = Y₀ + W' dH,   Y₀ = A_βᵀ bf16(Pᵀ dO),   W' = bf16(A_βᵀ bf16(el ⊙ K))
    dH ← e^{g_l} dH + Qᵀ bf16(scale eg ⊙ dO) + Kᵀ bf16(−eg ⊙ Y)
    dv_new = Pᵀ dO + el ⊙ (K dH)                          (an output only, after the hand-off)

(``tools/kernels/emulate_bwd.emu_bwd_dhu(uw=True)`` mirrors it.)

Pᵀ and W' are the same for every V block, so bwd_pw.py computes them once per (chunk, v-head), in
parallel, before this kernel; its producer loads them with q, k, dO, A_β and g.

One CTA of 512 threads = 4 warpgroups per (V block of 32 columns, segment, v-head):

    WG0 (tx   0..127)  owns dH [128, 32] in fp32 registers: publish bf16 dH to dh_sh[j]; dH *= e^{g_l};
                       += Qᵀ qdo (once built); wait ky; += Kᵀ ky
    WG1 (tx 128..255)  the chain step: Y = Y₀ + W' dH → ky (hand back); then K dH and dv_new (to
                       dvn_sh[j] for the store warp)
    WG2 (tx 256..383)  builder, up to a stage ahead: qdo, Pᵀ dO (fp32 for dv_new), Y₀ = A_βᵀ bf16(Pᵀ dO)
    WG3 (tx 384..511)  warp 12 TMA-loads the next chunk (reverse order); warp 13 TMA-stores each
                       published dH as dh, warp 14 each dv_new (stores off the chain: 1.33 → 1.11 ms
                       on 16/32 1×32768 for the dH store alone)

Measured on the H200 (16/32 1×32768, kernel alone): the one-warpgroup chain 2.02 ms (3.9 µs per
chunk step); three warpgroups that built Pᵀ and W' in the chain's warpgroup 2.44 ms; four with the
builder doing Pᵀ and W' 2.71 ms (ablations: Pᵀ 1.9 µs and W' 0.9 µs per step); with bwd_pw (0.41 ms)
1.33 ms (2.6 µs per step), 1.11 ms with the dH store warp, 1.06 ms with dv_new formed in registers.

mbarriers (r = step in reverse order, j = r % 2, n = r // 2): full[j] (count 32 + tx bytes),
built[j] (count 128, WG2 → WG0 and WG1, parity n % 2), empty[j] (count 384: WG0, WG1, WG2 after
their last read of stage j, which includes everything the builder wrote for it), dh_ready[j]
(count 128, WG0 → WG1 and the dh store warp, parity n % 2), ky_ready (count 128, WG1 → WG0, parity
r % 2), dh_stored[j] / dvn_stored[j] (count 32, store warp → WG0 / WG1 once its TMA store has read
the buffer; waited with parity (n + 1) % 2 before rewriting it), dvn_ready[j] (count 128, WG1 → dv
store warp). The builder rewrites stage j (step r + 2) only after full[j](r + 2), i.e. after
empty[j](r). dh_sh[j] is rewritten by WG0 (step r + 2) only after ky_ready(r + 1), which WG1
arrives after all of step r (its K dH read of dh_sh[j] included), and after dh_stored[j](r); ky_sh
(single) is written by WG1 after dh_ready(r), which WG0 arrives after its gemms of step r − 1.

Split modes: "" walks whole sequences (dht by sequence, dh0 by sequence); "seg" (pass 1 over a split
stab) walks every segment but the first of its sequence from dH_end = 0 (the last one from d(final
state)) and writes F (the gradient at its start) into dh0 [NS,...] by segment, no dh / dv_new;
"carry" (pass 2) walks every segment from its true dH_end (dht = d_end [NS,...] by segment, from
``fixup.run_rfixup``) and stores dh, dv_new and dh0 by sequence.

Inputs:  q, k [1,T,Hqk,128] bf16, gcs, a_beta (prep), do [1,T,Hv,128] bf16, dht fp32 (read when
         ``has_dht``), stab int32 [NS,8], scale, pt and w [Hv, NCS*64, ...] bf16 (bwd_pw).
Outputs: dh_all [Hv, NCS, 128, 128] bf16, dvnew [Hv, NCS*64, 128] bf16, dh0 fp32 (``has_dh0``).
"""

import functools

import torch

from ._common import CHUNK, FAST_MATH, HEAD_DIM, check_heads, compile_program, parse_target, target_key

#: setmaxnreg budgets of WG0 (dH owner), WG1 (the chain's Y, dv_new), WG2 (builder: P, qdo, Y₀, W'),
#: WG3 (producer); 512 threads, so they may sum to 512.
NREG = (168, 152, 152, 40)
#: what each thread starts with (65536 / 512): setmaxnreg.inc above it, .dec below (a .dec to a larger
#: count is an illegal instruction on the GPU, which the offline compile does not catch)
NREG_LAUNCH = 65536 // 512
assert sum(NREG) * 128 <= 65536 and all(r % 8 == 0 and 24 <= r <= 256 for r in NREG)


def dh_io_macros(split: str, has_dht: bool, has_dh0: bool, D: int, BV: int):
    """The start and the end of one (V block, segment, v-head) walk of the reverse chain:
    ``dh_start`` loads dH at the segment's end (d(final state), the
    reverse fix-up's d_end, or 0, by ``split`` and ``has_dht``); ``dh_end`` writes dH at its start
    (dh0 by sequence, or F by segment in pass 1). ``is_last`` / ``is_first`` come from the split
    table; unsplit programs pass 0 (not read)."""
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


def bwd_dhu_program(h_qk: int, h_v: int, has_dht: bool, has_dh0: bool, split: str = ""):
    """The prim_func ``gdn_bwd_dhu_ws`` (V block 32)."""
    import tilelang.language as T

    block_v = 32

    assert split in ("", "seg", "carry")
    dh_start, dh_end = dh_io_macros(split, has_dht, has_dh0, HEAD_DIM, block_v)
    G = check_heads(h_qk, h_v)
    C, D, BV = CHUNK, HEAD_DIM, block_v
    Tn = T.dynamic("T")
    NCS = T.dynamic("NCS")
    NS = T.dynamic("NS")
    ND = T.dynamic("ND")
    N0 = T.dynamic("N0")
    R0, R1, R2, RP = NREG

    @T.prim_func
    def gdn_bwd_dhu_ws(
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
        pt: T.Tensor((h_v, NCS * C, C), "bfloat16"),
        w: T.Tensor((h_v, NCS * C, D), "bfloat16"),
    ):
        with T.Kernel(D // BV, NS * h_v, threads=512) as (bv, sh):
            s = sh // h_v
            hv = sh % h_v
            hk = hv // G
            v0 = bv * BV

            # stage j (two): the producer's loads, and what the builder hands on for that chunk
            q_sh = T.alloc_shared((2, C, D), "bfloat16")
            k_sh = T.alloc_shared((2, C, D), "bfloat16")
            do_sh = T.alloc_shared((2, C, BV), "bfloat16")
            a_sh = T.alloc_shared((2, C, C), "bfloat16")
            g_sh = T.alloc_shared((2, C), "float32")
            pt_sh = T.alloc_shared((2, C, C), "bfloat16")
            w_sh = T.alloc_shared((2, C, D), "bfloat16")
            qdo_sh = T.alloc_shared((2, C, BV), "bfloat16")
            y0_sh = T.alloc_shared((2, C, BV), "float32")
            pdo_sh = T.alloc_shared((2, C, BV), "float32")
            dh_sh = T.alloc_shared((2, D, BV), "bfloat16")
            ky_sh = T.alloc_shared((C, BV), "bfloat16")
            dvn_sh = T.alloc_shared((2, C, BV), "bfloat16")  # dv_new on its way out
            pdob_sh = T.alloc_shared((C, BV), "bfloat16")  # the builder's own

            dh_frag = T.alloc_fragment((D, BV), "float32")
            y_frag = T.alloc_fragment((C, BV), "float32")
            kdh_frag = T.alloc_fragment((C, BV), "float32")
            pdo_frag = T.alloc_fragment((C, BV), "float32")
            y0_frag = T.alloc_fragment((C, BV), "float32")
            egl = T.alloc_var("float32")

            full = T.alloc_barrier([32, 32])
            empty = T.alloc_barrier([384, 384])
            built = T.alloc_barrier([128, 128])
            dh_ready = T.alloc_barrier([128, 128])
            ky_ready = T.alloc_barrier(128)
            dh_stored = T.alloc_barrier([32, 32])
            dvn_ready = T.alloc_barrier([128, 128])
            dvn_stored = T.alloc_barrier([32, 32])

            bos = stab[s, 0]
            eos = stab[s, 1]
            seq = stab[s, 2]
            cslot = stab[s, 3]
            if split:
                is_last = stab[s, 5]
                is_first = T.if_then_else(s == 0, 1, T.if_then_else(stab[T.max(s - 1, 0), 2] != seq, 1, 0))
            if split == "seg":
                nchunks = T.if_then_else(seq >= 0 and is_first == 0, T.ceildiv(eos - bos, C), 0)
            else:
                nchunks = T.if_then_else(seq >= 0, T.ceildiv(eos - bos, C), 0)

            tx = T.get_thread_binding()

            if tx < 128:
                # ---------------- WG0: dH owner ----------------
                T.set_max_nreg(R0, int(R0 > NREG_LAUNCH))
                if split:
                    dh_start(dh_frag, dht, s, seq, hv, v0, is_last)
                else:
                    dh_start(dh_frag, dht, s, seq, hv, v0, 0)
                for cr in T.serial(nchunks):
                    j = cr % 2
                    ph = (cr // 2) % 2
                    ci = nchunks - 1 - cr
                    ln = T.min(eos - (bos + ci * C), C)
                    if split != "seg":  # the storer warp has written dh_sh[j] (step r - 2) out
                        T.barrier_wait(dh_stored[j], 1 - ph)
                    T.copy(dh_frag, dh_sh[j, :, :])
                    T.fence_proxy_async()
                    T.barrier_arrive(dh_ready[j])
                    T.barrier_wait(full[j], ph)
                    egl = T.exp(g_sh[j, ln - 1])
                    for i, jj in T.Parallel(D, BV):
                        dh_frag[i, jj] = dh_frag[i, jj] * egl
                    T.barrier_wait(built[j], ph)  # qdo of this chunk
                    T.gemm(q_sh[j, :, :], qdo_sh[j, :, :], dh_frag, transpose_A=True)
                    T.barrier_wait(ky_ready[0], cr % 2)
                    T.gemm(k_sh[j, :, :], ky_sh, dh_frag, transpose_A=True)
                    T.barrier_arrive(empty[j])
                if split:
                    dh_end(dh_frag, dh0, s, seq, hv, v0, is_first)
                else:
                    dh_end(dh_frag, dh0, s, seq, hv, v0, 0)
            elif tx < 256:
                # ---------------- WG1: the chain's Y = Y₀ + W' dH → ky; then dv_new ----------------
                T.set_max_nreg(R1, int(R1 > NREG_LAUNCH))
                for cr in T.serial(nchunks):
                    j = cr % 2
                    ph = (cr // 2) % 2
                    ci = nchunks - 1 - cr
                    ln = T.min(eos - (bos + ci * C), C)
                    T.barrier_wait(built[j], ph)
                    T.copy(y0_sh[j, :, :], y_frag)
                    T.barrier_wait(dh_ready[j], ph)
                    T.gemm(w_sh[j, :, :], dh_sh[j, :, :], y_frag)
                    for i, jj in T.Parallel(C, BV):
                        ky_sh[i, jj] = T.cast(
                            T.if_then_else(i < ln, -T.exp(g_sh[j, i]), T.float32(0)) * y_frag[i, jj], "bfloat16"
                        )
                    T.fence_proxy_async()
                    T.barrier_arrive(ky_ready[0])
                    # off the chain: dv_new = Pᵀ dO + el ⊙ (K dH), formed in registers, then staged
                    # (one copy: no named barriers inside the element pass); pass 1 ("seg") has none
                    if split != "seg":
                        T.gemm(k_sh[j, :, :], dh_sh[j, :, :], kdh_frag, clear_accum=True)
                        for i, jj in T.Parallel(C, BV):
                            kdh_frag[i, jj] = pdo_sh[j, i, jj] + T.if_then_else(
                                i < ln, T.exp(g_sh[j, ln - 1] - g_sh[j, i]), T.float32(0)
                            ) * kdh_frag[i, jj]
                        T.barrier_wait(dvn_stored[j], 1 - ph)
                        T.copy(kdh_frag, dvn_sh[j, :, :])
                        T.fence_proxy_async()
                        T.barrier_arrive(dvn_ready[j])
                    T.barrier_arrive(empty[j])
            elif tx < 384:
                # ---------------- WG2: builder (everything without dH), a stage ahead ----------------
                T.set_max_nreg(R2, int(R2 > NREG_LAUNCH))
                for cr in T.serial(nchunks):
                    j = cr % 2
                    ph = (cr // 2) % 2
                    ci = nchunks - 1 - cr
                    ln = T.min(eos - (bos + ci * C), C)
                    T.barrier_wait(full[j], ph)
                    for i, jj in T.Parallel(C, BV):
                        qdo_sh[j, i, jj] = T.cast(
                            T.if_then_else(i < ln, scale * T.exp(g_sh[j, i]), T.float32(0))
                            * T.cast(do_sh[j, i, jj], "float32"),
                            "bfloat16",
                        )
                    T.gemm(pt_sh[j, :, :], do_sh[j, :, :], pdo_frag, clear_accum=True)
                    T.copy(pdo_frag, pdob_sh)
                    T.copy(pdo_frag, pdo_sh[j, :, :])
                    T.fence_proxy_async()
                    T.gemm(a_sh[j, :, :], pdob_sh, y0_frag, transpose_A=True, clear_accum=True)
                    T.copy(y0_frag, y0_sh[j, :, :])
                    T.fence_proxy_async()
                    T.barrier_arrive(built[j])
                    T.barrier_arrive(empty[j])
            else:
                # ---------------- WG3: producer (warp 12) ----------------
                T.set_max_nreg(RP, int(RP > NREG_LAUNCH))
                if tx < 416:
                    for cr in T.serial(nchunks):
                        j = cr % 2
                        ph = (cr // 2) % 2
                        ci = nchunks - 1 - cr
                        t0 = bos + ci * C
                        r0 = (cslot + ci) * C
                        T.barrier_wait(empty[j], 1 - ph)
                        T.tma_copy(q[0, t0 : t0 + C, hk, 0:D], q_sh[j, :, :], barrier=full[j])
                        T.tma_copy(k[0, t0 : t0 + C, hk, 0:D], k_sh[j, :, :], barrier=full[j])
                        T.tma_copy(do[0, t0 : t0 + C, hv, v0 : v0 + BV], do_sh[j, :, :], barrier=full[j])
                        T.tma_copy(a_beta[hv, r0 : r0 + C, 0:C], a_sh[j, :, :], barrier=full[j])
                        T.tma_copy(gcs[hv, r0 : r0 + C], g_sh[j, :], barrier=full[j])
                        T.tma_copy(pt[hv, r0 : r0 + C, 0:C], pt_sh[j, :, :], barrier=full[j])
                        T.tma_copy(w[hv, r0 : r0 + C, 0:D], w_sh[j, :, :], barrier=full[j])
                        T.barrier_arrive(full[j])
                elif tx < 448:  # warp 13: TMA-stores each published dH as dh (off WG0's path)
                    if split != "seg":
                        for cr in T.serial(nchunks):
                            j = cr % 2
                            ph = (cr // 2) % 2
                            ci = nchunks - 1 - cr
                            T.barrier_wait(dh_ready[j], ph)
                            T.copy(dh_sh[j, :, :], dh_all[hv, cslot + ci, 0:D, v0 : v0 + BV])
                            T.barrier_arrive(dh_stored[j])
                elif tx < 480:  # warp 14: TMA-stores dv_new
                    if split != "seg":
                        for cr in T.serial(nchunks):
                            j = cr % 2
                            ph = (cr // 2) % 2
                            ci = nchunks - 1 - cr
                            r0 = (cslot + ci) * C
                            T.barrier_wait(dvn_ready[j], ph)
                            T.copy(dvn_sh[j, :, :], dvnew[hv, r0 : r0 + C, v0 : v0 + BV])
                            T.barrier_arrive(dvn_stored[j])

    return gdn_bwd_dhu_ws


@functools.cache
def get_bwd_dhu_kernel(h_qk: int, h_v: int, has_dht: bool, has_dh0: bool, target_k=None, split: str = ""):
    return compile_program(
        bwd_dhu_program(h_qk, h_v, has_dht, has_dh0, split), target=parse_target(target_k), pass_configs=FAST_MATH
    )


def run_bwd_dhu(q, k, gcs, a_beta, do, dht, stab, scale, dh0, pt, w, dh_all=None, dvnew=None, target=None, split=""):
    """Launch the reverse chain. dht: [N,Hv,128,128] fp32 or None ([NS,...] by segment with
    split="carry"); dh0: preallocated fp32 to fill ([N,...], or F [NS,...] with split="seg") or None;
    pt, w: bwd_pw's outputs. Returns dh_all, dvnew, dh0."""
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
    kern(q, k, gcs, a_beta, do, dht if has_dht else dummy, stab, float(scale), dh_all, dvnew, dh0 if has_dh0 else dummy,
         pt, w)  # fmt: skip
    return dh_all, dvnew, dh0
