"""Backward kernel 2, warp-specialised (variant ``bwd_dhu_ws=1``; DRAFT: compiled for sm_90a and its
algebra emulated on CPU, NOT yet run on a GPU): the outputs of bwd_dhu.py (dh per chunk, dv_new,
dh0 / the split passes' F) with the dH-independent work taken off the chain.

With Pᵀ = scale Γᵀ ⊙ K Qᵀ (i ≥ j, i < ln), el = mask·e^{g_l − g}, eg = mask·e^g:

    Y  = A_βᵀ dv_new = Y₀ + W' dH,   Y₀ = A_βᵀ bf16(Pᵀ dO),   W' = bf16(A_βᵀ bf16(el ⊙ K))
    dH ← e^{g_l} dH + Qᵀ bf16(scale eg ⊙ dO) + Kᵀ bf16(−eg ⊙ Y)
    dv_new = Pᵀ dO + el ⊙ (K dH)                          (an output only, after the hand-off)

(``emulate_bwd.emu_bwd_dhu(uw=True)``: gradients within bf16 noise of bwd_dhu's algebra.)

One CTA of 384 threads = 3 warpgroups per (V block of ``block_v`` columns, segment, v-head):

    WG0 (tx   0..127)  owns dH [128, bv] in fp32 registers: publish bf16 dH to dh_sh[c%2] (and store
                       it as dh from registers); dH *= e^{g_l}; wait Y; dH += Qᵀ qdo + Kᵀ ky
    WG1 (tx 128..255)  per chunk before the hand-off: row exps, Pᵀ, Pᵀ dO, qdo, Y₀, W'; then
                       Y = Y₀ + W' dH → ky (hand back); then K dH and dv_new (store)
    WG2 (tx 256..383)  producer: warp 8 TMA-loads q, k, dO, A_β, g of the next chunk (reverse order)

mbarriers (r = step in reverse order, j = r % 2, n = r // 2): full[j] (count 32 + tx bytes),
empty[j] (count 256: WG0 and WG1 after their last read of stage j), dh_ready[j] (count 128,
WG0 → WG1, parity n % 2), ky_ready (count 128, WG1 → WG0, parity r % 2). dh_sh[j] is rewritten by
WG0 (step r + 2) only after ky_ready(r + 1), which WG1 arrives after all of step r (its K dH read
of dh_sh[j] included). qdo_sh[j] is rewritten by WG1 (step r + 2) only after dh_ready(r + 1), which
WG0 arrives after its gemms of step r read it; ky_sh (single) is written by WG1 after dh_ready(r),
which WG0 arrives after its gemms of step r − 1.

Split modes and inputs / outputs as bwd_dhu.run_bwd_dhu (split "", "seg", "carry").
"""

import functools
import json

import torch

from ._common import CHUNK, HEAD_DIM, check_heads, compile_program, target_key
from .bwd_dhu import dh_io_macros

#: setmaxnreg budgets of WG0 (dH owner), WG1 (P, W', Y, dv_new), WG2 (producer); 384 threads.
NREG = (168, 240, 40)
assert sum(NREG) * 128 <= 65536 and all(r % 8 == 0 and 24 <= r <= 256 for r in NREG)


def bwd_dhu_ws_program(h_qk: int, h_v: int, has_dht: bool, has_dh0: bool, block_v: int = 32, split: str = ""):
    import tilelang.language as T

    assert split in ("", "seg", "carry")
    dh_start, dh_end = dh_io_macros(split, has_dht, has_dh0, HEAD_DIM, block_v)
    G = check_heads(h_qk, h_v)
    C, D, BV = CHUNK, HEAD_DIM, block_v
    assert D % BV == 0 and BV in (32, 64)
    Tn = T.dynamic("T")
    NCS = T.dynamic("NCS")
    NS = T.dynamic("NS")
    ND = T.dynamic("ND")
    N0 = T.dynamic("N0")
    R0, R1, RP = NREG

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
    ):
        with T.Kernel(D // BV, NS * h_v, threads=384) as (bv, sh):
            s = sh // h_v
            hv = sh % h_v
            hk = hv // G
            v0 = bv * BV

            q_sh = T.alloc_shared((2, C, D), "bfloat16")
            k_sh = T.alloc_shared((2, C, D), "bfloat16")
            do_sh = T.alloc_shared((2, C, BV), "bfloat16")
            a_sh = T.alloc_shared((2, C, C), "bfloat16")
            g_sh = T.alloc_shared((2, C), "float32")
            dh_sh = T.alloc_shared((2, D, BV), "bfloat16")
            qdo_sh = T.alloc_shared((2, C, BV), "bfloat16")
            pt_sh = T.alloc_shared((C, C), "bfloat16")
            pdo_sh = T.alloc_shared((C, BV), "bfloat16")
            ek_sh = T.alloc_shared((C, D), "bfloat16")
            w_sh = T.alloc_shared((C, D), "bfloat16")
            ky_sh = T.alloc_shared((C, BV), "bfloat16")

            dh_frag = T.alloc_fragment((D, BV), "float32")
            kq_frag = T.alloc_fragment((C, C), "float32")
            pdo_frag = T.alloc_fragment((C, BV), "float32")
            y_frag = T.alloc_fragment((C, BV), "float32")
            w_frag = T.alloc_fragment((C, D), "float32")
            kdh_frag = T.alloc_fragment((C, BV), "float32")
            eg1 = T.alloc_fragment((C,), "float32")
            el1 = T.alloc_fragment((C,), "float32")
            egl = T.alloc_var("float32")

            full = T.alloc_barrier([32, 32])
            empty = T.alloc_barrier([256, 256])
            dh_ready = T.alloc_barrier([128, 128])
            ky_ready = T.alloc_barrier(128)

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
                T.set_max_nreg(R0, 1)
                if split:
                    dh_start(dh_frag, dht, s, seq, hv, v0, is_last)
                else:
                    dh_start(dh_frag, dht, s, seq, hv, v0, 0)
                for cr in T.serial(nchunks):
                    j = cr % 2
                    ph = (cr // 2) % 2
                    ci = nchunks - 1 - cr
                    ln = T.min(eos - (bos + ci * C), C)
                    T.copy(dh_frag, dh_sh[j, :, :])
                    T.fence_proxy_async()
                    T.barrier_arrive(dh_ready[j])
                    if split != "seg":
                        for i, jj in T.Parallel(D, BV):
                            dh_all[hv, cslot + ci, i, v0 + jj] = T.cast(dh_frag[i, jj], "bfloat16")
                    T.barrier_wait(full[j], ph)
                    egl = T.exp(g_sh[j, ln - 1])
                    for i, jj in T.Parallel(D, BV):
                        dh_frag[i, jj] = dh_frag[i, jj] * egl
                    T.barrier_wait(ky_ready[0], cr % 2)
                    T.gemm(q_sh[j, :, :], qdo_sh[j, :, :], dh_frag, transpose_A=True)
                    T.gemm(k_sh[j, :, :], ky_sh, dh_frag, transpose_A=True)
                    T.barrier_arrive(empty[j])
                if split:
                    dh_end(dh_frag, dh0, s, seq, hv, v0, is_first)
                else:
                    dh_end(dh_frag, dh0, s, seq, hv, v0, 0)
            elif tx < 256:
                # ---------------- WG1: Pᵀ, Pᵀ dO, qdo, Y₀, W' (before dH); Y → ky; dv_new ----------------
                T.set_max_nreg(R1, 1)
                for cr in T.serial(nchunks):
                    j = cr % 2
                    ph = (cr // 2) % 2
                    ci = nchunks - 1 - cr
                    ln = T.min(eos - (bos + ci * C), C)
                    r0 = (cslot + ci) * C
                    T.barrier_wait(full[j], ph)
                    for i in T.Parallel(C):
                        eg1[i] = T.if_then_else(i < ln, T.exp(g_sh[j, i]), T.float32(0))
                    for i in T.Parallel(C):
                        el1[i] = T.if_then_else(i < ln, T.exp(g_sh[j, ln - 1] - g_sh[j, i]), T.float32(0))
                    T.gemm(k_sh[j, :, :], q_sh[j, :, :], kq_frag, transpose_B=True, clear_accum=True)
                    for jr, i in T.Parallel(C, C):
                        pt_sh[jr, i] = T.cast(
                            T.if_then_else(
                                i >= jr and i < ln, scale * T.exp(g_sh[j, i] - g_sh[j, jr]) * kq_frag[jr, i],
                                T.float32(0),
                            ),
                            "bfloat16",
                        )  # fmt: skip
                    # shared-to-shared passes: exps per element (the row fragments' replicated layout
                    # would leave these loops to one thread in four)
                    for i, jj in T.Parallel(C, BV):
                        qdo_sh[j, i, jj] = T.cast(
                            T.if_then_else(i < ln, scale * T.exp(g_sh[j, i]), T.float32(0))
                            * T.cast(do_sh[j, i, jj], "float32"),
                            "bfloat16",
                        )
                    for i, kk in T.Parallel(C, D):
                        ek_sh[i, kk] = T.cast(
                            T.if_then_else(i < ln, T.exp(g_sh[j, ln - 1] - g_sh[j, i]), T.float32(0))
                            * T.cast(k_sh[j, i, kk], "float32"),
                            "bfloat16",
                        )
                    T.fence_proxy_async()  # pt_sh, ek_sh: generic writes -> wgmma reads
                    T.gemm(pt_sh, do_sh[j, :, :], pdo_frag, clear_accum=True)
                    T.gemm(a_sh[j, :, :], ek_sh, w_frag, transpose_A=True, clear_accum=True)
                    T.copy(pdo_frag, pdo_sh)
                    T.copy(w_frag, w_sh)
                    T.fence_proxy_async()
                    T.gemm(a_sh[j, :, :], pdo_sh, y_frag, transpose_A=True, clear_accum=True)
                    # the chain: Y = Y₀ + W' dH, ky = −eg ⊙ Y
                    T.barrier_wait(dh_ready[j], ph)
                    T.gemm(w_sh, dh_sh[j, :, :], y_frag)
                    for i, jj in T.Parallel(C, BV):
                        ky_sh[i, jj] = T.cast(-eg1[i] * y_frag[i, jj], "bfloat16")
                    T.fence_proxy_async()
                    T.barrier_arrive(ky_ready[0])
                    # off the chain: dv_new = Pᵀ dO + el ⊙ (K dH)
                    T.gemm(k_sh[j, :, :], dh_sh[j, :, :], kdh_frag, clear_accum=True)
                    if split != "seg":
                        for i, jj in T.Parallel(C, BV):
                            dvnew[hv, r0 + i, v0 + jj] = T.cast(pdo_frag[i, jj] + el1[i] * kdh_frag[i, jj], "bfloat16")
                    T.barrier_arrive(empty[j])
            else:
                # ---------------- WG2: producer (warp 8) ----------------
                T.set_max_nreg(RP, 0)
                if tx < 288:
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
                        T.barrier_arrive(full[j])

    return gdn_bwd_dhu_ws


@functools.cache
def get_bwd_dhu_ws_kernel(
    h_qk: int, h_v: int, has_dht: bool, has_dh0: bool, block_v: int = 32, target_k=None, split: str = ""
):
    target = json.loads(target_k) if target_k and target_k.startswith("{") else target_k
    return compile_program(
        bwd_dhu_ws_program(h_qk, h_v, has_dht, has_dh0, block_v, split), target=target,
        pass_configs={"tl.enable_fast_math": True},
    )  # fmt: skip


def run_bwd_dhu_ws(q, k, gcs, a_beta, do, dht, stab, scale, dh0, dh_all=None, dvnew=None, block_v=32, target=None,
                   split=""):  # fmt: skip
    """Same call and outputs as ``bwd_dhu.run_bwd_dhu`` (DRAFT kernel, not yet run on a GPU)."""
    h_qk, h_v = q.shape[2], do.shape[2]
    ncs = gcs.shape[1] // CHUNK
    dev = q.device
    if dh_all is None:
        dh_all = torch.empty(h_v, ncs, HEAD_DIM, HEAD_DIM, device=dev, dtype=torch.bfloat16)
    if dvnew is None:
        dvnew = torch.empty(h_v, ncs * CHUNK, HEAD_DIM, device=dev, dtype=torch.bfloat16)
    has_dht, has_dh0 = dht is not None, dh0 is not None
    kern = get_bwd_dhu_ws_kernel(h_qk, h_v, has_dht, has_dh0, block_v, target_key(target), split=split)
    dummy = None
    if not (has_dht and has_dh0):
        dummy = torch.empty(1, h_v, HEAD_DIM, HEAD_DIM, device=dev, dtype=torch.float32)
    kern(q, k, gcs, a_beta, do, dht if has_dht else dummy, stab, float(scale), dh_all, dvnew, dh0 if has_dh0 else dummy)
    return dh_all, dvnew, dh0
