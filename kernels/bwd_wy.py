"""Backward kernel 5: the gradients through w, u and A (FLA's WY backward), warp-specialised and persistent.

Per (chunk, v-head) tile (A = I − A_β M rebuilt, M = StrictLower(Γ ⊙ K Kᵀ), no solve):

    dA_β = dw (e^g ⊙ K)ᵀ + dv_new Vᵀ;   dv = A_βᵀ dv_new;   X = Aᵀ dA_β → dβ_j += X_jj
    dL = −X A_βᵀ → dβ, dM = β dL → dk += (dM⊙Γ) K + (dM⊙Γ)ᵀ K, dg;  dk += e^g ⊙ (A_βᵀ dw)
    dg: the partial from bwd_dqkwg plus these terms, then the reverse in-chunk cumsum (raw g)

A CTA of 384 threads stays on its SM and walks a list of work items, items (chunk slot, qk head)
b, b + P, b + 2P, … (P = the grid, at most one CTA per SM); an item's tiles are its G v-heads.
One tile's GEMMs and element passes form a chain of dependent steps (each GEMM's operand is the
previous step's output in shared memory), so the two consumer warpgroups ping-pong: each takes
whole items, its own chain, while the other's runs:

    WG0, WG1 (tx 0..127, 128..255)  consumer w: the items 2m + w of the CTA's list, one tile at a
                             time on stage w, every GEMM M = 64 in its own warpgroup, every sync
                             its own 128 threads (K Kᵀ per tile; the dk terms (dM⊙Γ) K + (dM⊙Γ)ᵀ K
                             per tile, dk in fp32 registers over the item's G tiles, plus
                             bwd_dqkwg's partial read from global memory, stored once). The
                             reverse in-chunk cumsum of dg: warp shuffles.
    WG2       (tx 256..383)  warp 8, the producer: TMA loads of a tile (k, v, dw, dv_new, A_β, g,
                             dg_part) and β (strided: SIMT loads) into stage w of its consumer,
                             the two consumers' tiles interleaved (item pair m: v-head 0 of items
                             2m, 2m + 1, then v-head 1, …).
                             warp 9, the store warp, in the same order: dv (staged by consumer w in
                             dv_new's buffer of stage w, which it no longer reads) and dk (staged in
                             k's buffer after the item's last read of k): one TMA store when the
                             chunk is full, else per-row stores of its valid rows (the next rows
                             are another sequence's)

Shared memory per consumer: stage w (k, v, dw, dv_new 16 KB each, A_β 8 KB, the per-row vectors)
and its own M / X, A / dM⊙Γ and dA_β tiles (8 KB each: M's buffer holds X once the A_β M GEMM
has read it, A's holds dM⊙Γ once the X GEMM has read it). Registers: the largest live set is dk
(64 per thread) with A_βᵀ dv_new or A_βᵀ dw (64), or with dL and M (32 each): no spill at the
launch's 168 (``tools/kernels/res_usage.py``).

Rows past a chunk's valid length: the TMA loads of k and v are not masked (they read the next
sequence's rows, or zeros past T). dw and dv_new rows there are zero (bwd_dqkwg / bwd_dhu store
them so), A_β is zero outside the valid block, and M is masked to the valid rows here, so those
rows reach no stored output (dv, dk, dg, dβ are stored on valid rows only; the dk partial is read
on valid rows only).

mbarriers, one per consumer w (its tile u, its item m = u // G): full[w] (count 32 + tx bytes: the
producer warp; parity u % 2), dv_ready[w] (count 128: consumer w, once the tile's dv is staged;
parity u % 2), dk_ready[w] (count 128, once per item, when its dk is staged; parity m % 2),
empty[w] (count 160: consumer w after its last read of stage w, and the store warp once its
stores have read the staged tiles; the producer waits parity (u + 1) % 2 before loading tile u).
No hand-off can be lapped: consumer w arrives dv_ready[w] (dk_ready[w]) again only after full[w]
of its next tile, which needs the producer's load, so empty[w] of this tile, which the store warp
arrives only after its waits for this tile. ``tools/kernels/wy_protocol.py`` models the four roles
over random interleavings.
"""

import functools

import torch

from ._common import CHUNK, FAST_MATH, HEAD_DIM, check_heads, compile_program, parse_target, target_key
from .plan import sm_count

#: setmaxnreg budgets of the consumer warpgroups (WG0, WG1) and the producer warpgroup (WG2)
NREG = (232, 40)
THREADS = 384
#: what each thread starts with (65536 / 384, rounded down to 8): .inc above it, .dec below
NREG_LAUNCH = 65536 // THREADS // 8 * 8
assert 2 * NREG[0] + NREG[1] <= (THREADS // 128) * NREG_LAUNCH  # .inc is served by what .dec released


def rows_store_macro(C: int, D: int):
    """store_rows(src_sh [2, C, D] bf16, j, dst [1, T, H, D], bos, ln, head): stage j's staged tile's valid rows to
    token rows bos.. of one head, by one warp: a TMA store when the chunk is full (it waits until the
    tile is read), else per-row SIMT stores (only rows < ln: the next rows belong to another
    sequence, written by another CTA)."""
    import tilelang.language as T

    @T.macro
    def store_rows(src_sh, j, dst, bos, ln, head):
        if ln == C:
            T.copy(src_sh[j, :, :], dst[0, bos : bos + C, head, 0:D])
        else:
            for i, jj in T.Parallel(C, D):
                if i < ln:
                    dst[0, bos + i, head, jj] = src_sh[j, i, jj]

    return store_rows


def pair_order(s, G: int):
    """The producer's and the store warp's s-th tile: (item pair m, v-head gi, consumer w); the
    consumer's item is 2m + w of the CTA's list, its tile u = m G + gi."""
    return s // (2 * G), (s % (2 * G)) // 2, s % 2


def bwd_wy_program(h_qk: int, h_v: int):
    """The prim_func ``gdn_bwd_wy_ws``."""
    import tilelang.language as T

    G = check_heads(h_qk, h_v)
    C, D = CHUNK, HEAD_DIM
    Tn = T.dynamic("T")
    NCS = T.dynamic("NCS")
    NP = T.dynamic("NP")
    RC, RP = NREG

    store_rows = rows_store_macro(C, D)

    @T.macro
    def consumer(
        w, tx, b, nitems, k_sh, v_sh, dw_sh, du_sh, a_sh, g_sh, b_sh, dgp_sh, info_sh, mx_sh, aa_sh, dab_sh, diag_sh, r1_sh, zr_sh, zc_sh, tot_sh, f64, mf, acc1, dk_acc, red, zr, zc, sacc, shf, full, empty, dv_ready, dk_ready, dk_v, dbeta, dg
    ):  # fmt: skip
        lt = tx - 128 * w
        for u in T.serial(T.ceildiv(nitems - w, 2) * G):
            gi = u % G
            item = b + (2 * (u // G) + w) * NP
            hk = item % h_qk
            hv = hk * G + gi
            T.barrier_wait(full[w], u % 2)
            bos = info_sh[w, 0]
            ln = info_sh[w, 1]
            if gi == 0:
                T.clear(dk_acc)

            # dA_β = dw X_wᵀ + du Vᵀ (lower incl. diagonal); X_w = e^g ⊙ K on valid rows
            T.gemm(dw_sh[w, :, :], k_sh[w, :, :], f64, transpose_B=True, clear_accum=True)
            for i, jj in T.Parallel(C, C):
                f64[i, jj] = f64[i, jj] * T.if_then_else(jj < ln, T.exp(g_sh[w, jj]), T.float32(0))
            T.gemm(du_sh[w, :, :], v_sh[w, :, :], f64, transpose_B=True)
            for i, jj in T.Parallel(C, C):
                dab_sh[w, i, jj] = T.cast(T.if_then_else(i >= jj, f64[i, jj], T.float32(0)), "bfloat16")

            # dv = A_βᵀ du, staged in du's buffer (read for the last time above)
            T.gemm(a_sh[w, :, :], du_sh[w, :, :], acc1, transpose_A=True, clear_accum=True)
            for i, jj in T.Parallel(C, D):
                du_sh[w, i, jj] = T.cast(acc1[i, jj], "bfloat16")
            T.fence_proxy_async()
            T.barrier_arrive(dv_ready[w])

            # M = StrictLower(Γ ⊙ K Kᵀ) on valid rows;  A = I − A_β M
            T.gemm(k_sh[w, :, :], k_sh[w, :, :], mf, transpose_B=True, clear_accum=True)
            for i, jj in T.Parallel(C, C):
                mf[i, jj] = T.if_then_else(i > jj and i < ln, T.exp(g_sh[w, i] - g_sh[w, jj]) * mf[i, jj], T.float32(0))
                mx_sh[w, i, jj] = T.cast(mf[i, jj], "bfloat16")
            T.gemm(a_sh[w, :, :], mx_sh[w, :, :], f64, clear_accum=True)
            for i, jj in T.Parallel(C, C):
                aa_sh[w, i, jj] = T.cast(
                    T.if_then_else(i >= jj, T.if_then_else(i == jj, T.float32(1), T.float32(0)) - f64[i, jj],
                                   T.float32(0)),
                    "bfloat16",
                )  # fmt: skip

            # X = Aᵀ dA_β (into M's buffer: the A_β M GEMM has read it): dβ_j += X_jj
            T.gemm(aa_sh[w, :, :], dab_sh[w, :, :], f64, transpose_A=True, clear_accum=True)
            for i, jj in T.Parallel(C, C):
                mx_sh[w, i, jj] = T.cast(f64[i, jj], "bfloat16")
                if i == jj:
                    diag_sh[w, i] = f64[i, jj]

            # dL = −X A_βᵀ (strictly lower); dM ⊙ Γ = β_i dL_ij Γ_ij (into A's buffer: the X GEMM has
            # read it); z = dL ⊙ M
            T.gemm(mx_sh[w, :, :], a_sh[w, :, :], f64, transpose_B=True, clear_accum=True)
            for i, jj in T.Parallel(C, C):
                aa_sh[w, i, jj] = T.cast(
                    T.if_then_else(i > jj and i < ln, -f64[i, jj] * b_sh[w, i] * T.exp(g_sh[w, i] - g_sh[w, jj]),
                                   T.float32(0)),
                    "bfloat16",
                )  # fmt: skip
                f64[i, jj] = -f64[i, jj] * mf[i, jj]
            T.reduce_sum(f64, zr, dim=1)
            for i, jj in T.Parallel(C, C):
                f64[i, jj] = f64[i, jj] * b_sh[w, i]
            T.reduce_sum(f64, zc, dim=0)
            T.copy(zr, zr_sh[w, :])
            T.copy(zc, zc_sh[w, :])

            # dk += (dM⊙Γ) K + (dM⊙Γ)ᵀ K + e^g ⊙ (A_βᵀ dw);  dg += rowsum(e^g (A_βᵀ dw) ⊙ K)
            T.gemm(aa_sh[w, :, :], k_sh[w, :, :], dk_acc)
            T.gemm(aa_sh[w, :, :], k_sh[w, :, :], dk_acc, transpose_A=True)
            T.gemm(a_sh[w, :, :], dw_sh[w, :, :], acc1, transpose_A=True, clear_accum=True)
            for i, jj in T.Parallel(C, D):
                acc1[i, jj] = acc1[i, jj] * T.exp(g_sh[w, i])
                dk_acc[i, jj] = dk_acc[i, jj] + acc1[i, jj]
                acc1[i, jj] = acc1[i, jj] * T.cast(k_sh[w, i, jj], "float32")
            T.reduce_sum(acc1, red, dim=1)
            T.copy(red, r1_sh[w, :])

            # per row: dβ, dg on the cumsum, then the reverse cumsum (warp shuffles) → dg of the raw g
            if lt < C:
                sacc[0] = T.if_then_else(
                    lt < ln, r1_sh[w, lt] + b_sh[w, lt] * zr_sh[w, lt] - zc_sh[w, lt] + dgp_sh[w, lt],
                    T.float32(0),
                )
                if lt < ln:
                    dbeta[0, bos + lt, hv] = diag_sh[w, lt] + zr_sh[w, lt]
                for s in (1, 2, 4, 8, 16):  # every lane shuffles (full mask), the top ones add 0
                    shf[0] = T.shfl_down(sacc[0], s)
                    sacc[0] = sacc[0] + T.if_then_else(lt % 32 + s < 32, shf[0], T.float32(0))
                if lt == 32:
                    tot_sh[w, 0] = sacc[0]
            if lt < 32:
                sacc[0] = sacc[0] + tot_sh[w, 0]
            if lt < ln:
                dg[0, bos + lt, hv] = sacc[0]

            if gi == G - 1:
                # dk over the group, plus bwd_dqkwg's partial, staged in k's buffer (read for the last time above)
                for i, jj in T.Parallel(C, D):
                    if i < ln:
                        dk_acc[i, jj] = dk_acc[i, jj] + T.cast(dk_v[0, bos + i, hk, jj], "float32")
                for i, jj in T.Parallel(C, D):
                    k_sh[w, i, jj] = T.cast(dk_acc[i, jj], "bfloat16")
                T.fence_proxy_async()
                T.barrier_arrive(dk_ready[w])
            T.barrier_arrive(empty[w])


    @T.prim_func
    def gdn_bwd_wy_ws(
        k: T.Tensor((1, Tn, h_qk, D), "bfloat16"),
        v: T.Tensor((1, Tn, h_v, D), "bfloat16"),
        beta: T.Tensor((1, Tn, h_v), "float32"),
        gcs: T.Tensor((h_v, NCS * C), "float32"),
        a_beta: T.Tensor((h_v, NCS * C, C), "bfloat16"),
        ctab: T.Tensor((NCS, 4), "int32"),
        dw: T.Tensor((h_v, NCS * C, D), "bfloat16"),
        dvnew: T.Tensor((h_v, NCS * C, D), "bfloat16"),
        dg_part: T.Tensor((h_v, NCS * C), "float32"),
        dk_v: T.Tensor((1, Tn, h_qk, D), "bfloat16"),
        dv: T.Tensor((1, Tn, h_v, D), "bfloat16"),
        dg: T.Tensor((1, Tn, h_v), "float32"),
        dbeta: T.Tensor((1, Tn, h_v), "float32"),
        grid: T.Tensor((NP,), "int32"),
    ):
        with T.Kernel(NP, threads=THREADS) as b:
            # stage w: consumer w's tile, loaded by the producer
            k_sh = T.alloc_shared((2, C, D), "bfloat16")  # k; at the item's end its dk, staged
            v_sh = T.alloc_shared((2, C, D), "bfloat16")
            dw_sh = T.alloc_shared((2, C, D), "bfloat16")
            du_sh = T.alloc_shared((2, C, D), "bfloat16")  # dv_new; then the tile's dv, staged
            a_sh = T.alloc_shared((2, C, C), "bfloat16")
            g_sh = T.alloc_shared((2, C), "float32")
            b_sh = T.alloc_shared((2, C), "float32")
            dgp_sh = T.alloc_shared((2, C), "float32")
            info_sh = T.alloc_shared((2, 2), "int32")
            # consumer w's own
            mx_sh = T.alloc_shared((2, C, C), "bfloat16")  # M, then X
            aa_sh = T.alloc_shared((2, C, C), "bfloat16")  # A, then Σ dM⊙Γ
            dab_sh = T.alloc_shared((2, C, C), "bfloat16")
            diag_sh = T.alloc_shared((2, C), "float32")
            r1_sh = T.alloc_shared((2, C), "float32")
            zr_sh = T.alloc_shared((2, C), "float32")
            zc_sh = T.alloc_shared((2, C), "float32")
            tot_sh = T.alloc_shared((2, 1), "float32")

            # consumer 0's and consumer 1's registers
            f64 = [T.alloc_fragment((C, C), "float32") for _ in range(2)]
            mf = [T.alloc_fragment((C, C), "float32") for _ in range(2)]
            acc1 = [T.alloc_fragment((C, D), "float32") for _ in range(2)]
            dk_acc = [T.alloc_fragment((C, D), "float32") for _ in range(2)]
            red = [T.alloc_fragment((C,), "float32") for _ in range(2)]
            zr = [T.alloc_fragment((C,), "float32") for _ in range(2)]
            zc = [T.alloc_fragment((C,), "float32") for _ in range(2)]
            sacc = T.alloc_local((1,), "float32")
            shf = T.alloc_local((1,), "float32")

            full = T.alloc_barrier([32, 32])
            empty = T.alloc_barrier([160, 160])  # consumer w and the store warp
            dv_ready = T.alloc_barrier([128, 128])
            dk_ready = T.alloc_barrier([128, 128])

            nitems = T.ceildiv(NCS * h_qk - b, NP)  # the CTA's items
            npairs = T.ceildiv(nitems, 2)
            tx = T.get_thread_binding()

            if tx < 256:
                # ---------------- WG0, WG1: the two consumers ----------------
                T.set_max_nreg(RC, int(RC > NREG_LAUNCH))
                if tx < 128:
                    consumer(0, tx, b, nitems, k_sh, v_sh, dw_sh, du_sh, a_sh, g_sh, b_sh, dgp_sh, info_sh, mx_sh, aa_sh,
                             dab_sh, diag_sh, r1_sh, zr_sh, zc_sh, tot_sh, f64[0], mf[0],
                             acc1[0], dk_acc[0], red[0], zr[0], zc[0], sacc, shf, full, empty, dv_ready,
                             dk_ready, dk_v, dbeta, dg)  # fmt: skip
                else:
                    consumer(1, tx, b, nitems, k_sh, v_sh, dw_sh, du_sh, a_sh, g_sh, b_sh, dgp_sh, info_sh, mx_sh, aa_sh,
                             dab_sh, diag_sh, r1_sh, zr_sh, zc_sh, tot_sh, f64[1], mf[1],
                             acc1[1], dk_acc[1], red[1], zr[1], zc[1], sacc, shf, full, empty, dv_ready,
                             dk_ready, dk_v, dbeta, dg)  # fmt: skip
            else:
                # ---------------- WG2: producer (warp 8) ----------------
                T.set_max_nreg(RP, int(RP > NREG_LAUNCH))
                if tx < 288:
                    for s in T.serial(npairs * 2 * G):
                        m, gi, w = pair_order(s, G)
                        ii = 2 * m + w
                        if ii < nitems:
                            u = m * G + gi
                            item = b + ii * NP
                            c = item // h_qk
                            hk = item % h_qk
                            hv = hk * G + gi
                            r0 = c * C
                            T.barrier_wait(empty[w], (u + 1) % 2)
                            bos = ctab[c, 0]
                            ln = ctab[c, 1] - bos
                            T.tma_copy(k[0, bos : bos + C, hk, 0:D], k_sh[w, :, :], barrier=full[w])
                            T.tma_copy(v[0, bos : bos + C, hv, 0:D], v_sh[w, :, :], barrier=full[w])
                            T.tma_copy(dw[hv, r0 : r0 + C, 0:D], dw_sh[w, :, :], barrier=full[w])
                            T.tma_copy(dvnew[hv, r0 : r0 + C, 0:D], du_sh[w, :, :], barrier=full[w])
                            T.tma_copy(a_beta[hv, r0 : r0 + C, 0:C], a_sh[w, :, :], barrier=full[w])
                            T.tma_copy(gcs[hv, r0 : r0 + C], g_sh[w, :], barrier=full[w])
                            T.tma_copy(dg_part[hv, r0 : r0 + C], dgp_sh[w, :], barrier=full[w])
                            for q in T.serial(C // 32):
                                r = (tx - 256) + q * 32
                                b_sh[w, r] = T.if_then_else(r < ln, beta[0, bos + r, hv], T.float32(0))
                            if tx == 256:
                                info_sh[w, 0] = bos
                                info_sh[w, 1] = ln
                            T.barrier_arrive(full[w])
                elif tx < 320:
                    # ---------------- warp 9: stores dv, dk from the staged tiles ----------------
                    for s in T.serial(npairs * 2 * G):
                        m, gi, w = pair_order(s, G)
                        ii = 2 * m + w
                        if ii < nitems:
                            u = m * G + gi
                            item = b + ii * NP
                            hk = item % h_qk
                            hv = hk * G + gi
                            T.barrier_wait(dv_ready[w], u % 2)
                            bos = info_sh[w, 0]
                            ln = info_sh[w, 1]
                            store_rows(du_sh, w, dv, bos, ln, hv)
                            if gi == G - 1:
                                T.barrier_wait(dk_ready[w], m % 2)
                                store_rows(k_sh, w, dk_v, bos, ln, hk)
                            T.barrier_arrive(empty[w])

    return gdn_bwd_wy_ws


@functools.cache
def get_bwd_wy_kernel(h_qk: int, h_v: int, target_k=None):
    return compile_program(bwd_wy_program(h_qk, h_v), target=parse_target(target_k), pass_configs=FAST_MATH)


_GRIDS = {}


def persistent_grid(ncs: int, h_qk: int, dev, num_sms=None):
    """The grid argument of the persistent kernels: a dummy int32 tensor (never read) whose length
    P = min(#SMs, chunk slots x qk heads) is the launch's grid (a dynamic dimension); one per
    (P, device), kept."""
    if num_sms is None:
        num_sms = sm_count(dev)
    n = max(1, min(int(num_sms), ncs * h_qk))
    key = (n, str(dev))
    if key not in _GRIDS:
        _GRIDS[key] = torch.empty(n, device=dev, dtype=torch.int32)
    return _GRIDS[key]


def run_bwd_wy(k, v, beta, gcs, a_beta, ctab, dw, dvnew, dg_part, dk_v, dv=None, dg=None, dbeta=None, target=None,
                  num_sms=None):  # fmt: skip
    """Launch the persistent WY backward (any GVA group size G ≥ 1). dk_v [1,T,Hqk,128] bf16
    (bwd_dqkwg's group-summed partial) is completed in place. Returns dk_v, dv [1,T,Hv,128] bf16, dg, dbeta [1,T,Hv] fp32."""
    h_qk, h_v = k.shape[2], v.shape[2]
    T_, ncs = k.shape[1], ctab.shape[0]
    dev = k.device
    if dk_v.dtype != torch.bfloat16 or tuple(dk_v.shape) != (1, T_, h_qk, HEAD_DIM):
        raise ValueError(f"run_bwd_wy: dk_v must be bf16 [1, {T_}, {h_qk}, {HEAD_DIM}], got "
                         f"{dk_v.dtype} {tuple(dk_v.shape)}")  # fmt: skip
    if dv is None:
        dv = torch.empty(1, T_, h_v, HEAD_DIM, device=dev, dtype=torch.bfloat16)
    if dg is None:
        dg = torch.empty(1, T_, h_v, device=dev, dtype=torch.float32)
    if dbeta is None:
        dbeta = torch.empty(1, T_, h_v, device=dev, dtype=torch.float32)
    kern = get_bwd_wy_kernel(h_qk, h_v, target_key(target))
    kern(k, v, beta, gcs, a_beta, ctab, dw, dvnew, dg_part, dk_v, dv, dg, dbeta, persistent_grid(ncs, h_qk, dev, num_sms))
    return dk_v, dv, dg, dbeta
