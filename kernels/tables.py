"""Forward kernel 0: the work tables in one launch (``_common.chunk_table`` + ``segment_table``
build the same tables with ~60 torch launches; identical output, int32 prefix sums).

One CTA of ``NT`` threads walks the sequences in blocks of NT:

    per block:  len_n = cu[n+1] − cu[n];  nch_n = ceil(len_n / 64);  nseg_n = max(1, ceil(len_n / seg))
                Hillis–Steele inclusive scan of nch and nseg in shared memory (+ carry of earlier blocks)
                → cu_chunks[n], cu_segs[n] (first chunk / segment slot of sequence n)
                every chunk slot and segment slot of the block's sequences is filled by one thread:
                binary search (over the block's NT first-slot values, in shared memory) for its sequence
    finally:    cu_chunks[N], cu_segs[N]; unused slots get (0, 0, −1, 0[, 0 …]) rows.

Output rows equal the torch builders' (``_common``), incl. empty sequences and the unsplit case.

Then, when ``lpt`` (where ``plan.plan_lpt`` orders the final kernel's CTAs), in the same launch once
stab is written: stab_lpt = stab's rows longest first (``_common.lpt_order``): a histogram of the keys
min(chunks, 31), then per block of NT slots each slot's rank among its key's slots from its warp's
match group and the earlier warps' counts, so ties keep slot order.

Inputs:  cu int64 [N+1] (device), seg int32 (segment length in tokens, a multiple of 64), split int32
         (0/1), lpt int32 (0/1)
Outputs: ctab int32 [NCS, 4], stab int32 [NS, 8], stab_lpt int32 [NS, 8] (written when ``lpt``),
         cu_chunks int32 [N+1], cu_segs int32 [N+1]
"""

import functools

import torch

from ._common import CHUNK, LPT_KEYS, SEG_COLS, compile_program, parse_target, target_key

NT = 512
_LOG_NT = 9


def tables_program(nt: int = NT):
    import tilelang.language as T

    assert nt == 1 << (nt.bit_length() - 1)
    N1 = T.dynamic("N1")
    NCS = T.dynamic("NCS")
    NS = T.dynamic("NS")
    C = CHUNK
    K = LPT_KEYS

    def key_of(stab, sl):  # min(chunks, K − 1) of segment slot sl
        return T.min(T.ceildiv(stab[sl, 1] - stab[sl, 0], C), K - 1)

    @T.prim_func
    def gdn_tables(
        cu: T.Tensor((N1,), "int64"),
        seg: T.int32,
        split: T.int32,
        lpt: T.int32,
        ctab: T.Tensor((NCS, 4), "int32"),
        stab: T.Tensor((NS, SEG_COLS), "int32"),
        stab_lpt: T.Tensor((NS, SEG_COLS), "int32"),
        cu_chunks: T.Tensor((N1,), "int32"),
        cu_segs: T.Tensor((N1,), "int32"),
    ):
        with T.Kernel(1, threads=nt) as _bx:
            tx = T.get_thread_binding()
            c_sc = T.alloc_shared((nt,), "int32")  # scan of nch (inclusive)
            s_sc = T.alloc_shared((nt,), "int32")  # scan of nseg (inclusive)
            c_st = T.alloc_shared((nt,), "int32")  # first chunk slot of the block's sequence i
            s_st = T.alloc_shared((nt,), "int32")  # first segment slot
            bos_sh = T.alloc_shared((nt,), "int32")
            eos_sh = T.alloc_shared((nt,), "int32")
            nsg_sh = T.alloc_shared((nt,), "int32")
            carry_c = T.alloc_var("int32")
            carry_s = T.alloc_var("int32")
            my_nc = T.alloc_var("int32")
            my_ns = T.alloc_var("int32")
            a_c = T.alloc_var("int32")
            a_s = T.alloc_var("int32")
            lo = T.alloc_var("int32")
            end_c = T.alloc_var("int32")
            end_s = T.alloc_var("int32")
            hist = T.alloc_shared((K,), "int32")  # lpt: per key, the rank of its next slot
            wcnt = T.alloc_shared((nt,), "int32")  # lpt: [warp, key]: the warp's slots of the key, then their first rank
            key = T.alloc_var("int32")
            run = T.alloc_var("int32")
            cnt = T.alloc_var("int32")

            n_seq = N1 - 1
            carry_c = 0
            carry_s = 0
            for blk in T.serial(T.ceildiv(n_seq, nt)):
                n = blk * nt + tx
                if n < n_seq:
                    b0 = T.cast(cu[n], "int32")
                    e0 = T.cast(cu[n + 1], "int32")
                    my_nc = T.ceildiv(e0 - b0, C)
                    my_ns = T.max(T.ceildiv(e0 - b0, seg), 1)
                    bos_sh[tx] = b0
                    eos_sh[tx] = e0
                else:
                    my_nc = 0
                    my_ns = 0
                    bos_sh[tx] = 0
                    eos_sh[tx] = 0
                nsg_sh[tx] = my_ns
                c_sc[tx] = my_nc
                s_sc[tx] = my_ns
                T.sync_threads()
                for lvl in range(_LOG_NT if nt == NT else nt.bit_length() - 1):
                    d = 1 << lvl
                    a_c = c_sc[tx]
                    a_s = s_sc[tx]
                    if tx >= d:
                        a_c = a_c + c_sc[tx - d]
                        a_s = a_s + s_sc[tx - d]
                    T.sync_threads()
                    c_sc[tx] = a_c
                    s_sc[tx] = a_s
                    T.sync_threads()
                # exclusive starts (slots of padded threads = block end, never searched for)
                c_st[tx] = carry_c + c_sc[tx] - my_nc
                s_st[tx] = carry_s + s_sc[tx] - my_ns
                if n < n_seq:
                    cu_chunks[n] = carry_c + c_sc[tx] - my_nc
                    cu_segs[n] = carry_s + s_sc[tx] - my_ns
                end_c = carry_c + c_sc[nt - 1]
                end_s = carry_s + s_sc[nt - 1]
                T.sync_threads()

                # chunk slots of this block: [carry_c, end_c)
                for it in T.serial(T.ceildiv(end_c - carry_c, nt)):
                    sl = carry_c + it * nt + tx
                    if sl < end_c:
                        lo = 0
                        for lvl in range(_LOG_NT if nt == NT else nt.bit_length() - 1):
                            step = nt >> (lvl + 1)
                            if c_st[lo + step] <= sl:
                                lo = lo + step
                        bos_c = bos_sh[lo] + (sl - c_st[lo]) * C
                        ctab[sl, 0] = bos_c
                        ctab[sl, 1] = T.min(bos_c + C, eos_sh[lo])
                        ctab[sl, 2] = blk * nt + lo
                        ctab[sl, 3] = 0
                # segment slots of this block: [carry_s, end_s)
                for it in T.serial(T.ceildiv(end_s - carry_s, nt)):
                    sl = carry_s + it * nt + tx
                    if sl < end_s:
                        lo = 0
                        for lvl in range(_LOG_NT if nt == NT else nt.bit_length() - 1):
                            step = nt >> (lvl + 1)
                            if s_st[lo + step] <= sl:
                                lo = lo + step
                        loc = sl - s_st[lo]
                        bos_s = bos_sh[lo] + loc * seg
                        stab[sl, 0] = bos_s
                        stab[sl, 1] = T.min(bos_s + seg, eos_sh[lo])
                        stab[sl, 2] = blk * nt + lo
                        stab[sl, 3] = c_st[lo] + loc * (seg // C)
                        stab[sl, 4] = T.if_then_else(split != 0, sl, blk * nt + lo)
                        stab[sl, 5] = T.if_then_else(loc == nsg_sh[lo] - 1, 1, 0)
                        stab[sl, 6] = 0
                        stab[sl, 7] = 0
                carry_c = end_c
                carry_s = end_s
                T.sync_threads()

            if tx == 0:
                cu_chunks[n_seq] = carry_c
                cu_segs[n_seq] = carry_s
            for it in T.serial(T.ceildiv(NCS - carry_c, nt)):
                sl = carry_c + it * nt + tx
                if sl < NCS:
                    ctab[sl, 0] = 0
                    ctab[sl, 1] = 0
                    ctab[sl, 2] = -1
                    ctab[sl, 3] = 0
            for it in T.serial(T.ceildiv(NS - carry_s, nt)):
                sl = carry_s + it * nt + tx
                if sl < NS:
                    stab[sl, 0] = 0
                    stab[sl, 1] = 0
                    stab[sl, 2] = -1
                    for j in T.serial(SEG_COLS - 3):
                        stab[sl, 3 + j] = 0

            if lpt != 0:  # stab's rows longest first, once every row of stab is written
                T.sync_threads()
                if tx < K:
                    hist[tx] = 0
                T.sync_threads()
                for it in T.serial(T.ceildiv(NS, nt)):
                    if it * nt + tx < NS:
                        T.atomic_add(hist[key_of(stab, it * nt + tx)], 1)
                T.sync_threads()
                if tx == 0:  # descending keys
                    run = 0
                    for b in T.serial(K):
                        cnt = hist[K - 1 - b]
                        hist[K - 1 - b] = run
                        run = run + cnt
                for it in T.serial(T.ceildiv(NS, nt)):
                    sl = it * nt + tx
                    key = K  # past NS: a key of its own, never written
                    if sl < NS:
                        key = key_of(stab, sl)
                    wcnt[tx] = 0
                    T.sync_threads()
                    m = T.call_extern("uint32", "__match_any_sync", T.uint32(0xFFFFFFFF), key)
                    lane = T.call_extern("int32", "__popc", m & (T.shift_left(T.uint32(1), T.cast(tx % 32, "uint32")) - T.uint32(1)))
                    if sl < NS and lane == 0:
                        wcnt[(tx // 32) * K + key] = T.call_extern("int32", "__popc", m)
                    T.sync_threads()
                    if tx < K:
                        run = hist[tx]
                        for w in T.serial(nt // 32):
                            cnt = wcnt[w * K + tx]
                            wcnt[w * K + tx] = run
                            run = run + cnt
                        hist[tx] = run
                    T.sync_threads()
                    if sl < NS:
                        for j in T.serial(SEG_COLS):
                            stab_lpt[wcnt[(tx // 32) * K + key] + lane, j] = stab[sl, j]
                    T.sync_threads()

    return gdn_tables


@functools.cache
def get_tables_kernel(nt: int = NT, target_k=None):
    return compile_program(tables_program(nt), target=parse_target(target_k))


def run_tables(cu64, T: int, N: int, seg_tokens: int, split: bool, lpt: bool = False, target=None):
    """One launch: (ctab [T//64+N, 4], cu_chunks int32 [N+1], stab [T//seg+N, 8], cu_segs int32 [N+1],
    stab_lpt: stab's rows longest first when ``lpt``, else stab itself).

    cu64: int64 [N+1] on the device. Same rows as ``chunk_table`` / ``segment_table`` / ``lpt_order``.
    """
    assert seg_tokens % CHUNK == 0 and seg_tokens > 0
    dev = cu64.device
    ncs = T // CHUNK + N
    ns = T // seg_tokens + N
    ctab = torch.empty(ncs, 4, device=dev, dtype=torch.int32)
    stab = torch.empty(ns, SEG_COLS, device=dev, dtype=torch.int32)
    stab_lpt = torch.empty_like(stab) if lpt else stab
    cu_chunks = torch.empty(N + 1, device=dev, dtype=torch.int32)
    cu_segs = torch.empty(N + 1, device=dev, dtype=torch.int32)
    kern = get_tables_kernel(NT, target_key(target))
    kern(cu64, int(seg_tokens), int(bool(split)), int(bool(lpt)), ctab, stab, stab_lpt, cu_chunks, cu_segs)
    return ctab, cu_chunks, stab, cu_segs, stab_lpt
