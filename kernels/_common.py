"""Shared constants and helpers for the qlabench TileLang GDN kernels.

Nothing here imports ``qlabench``; the package is self-contained.
"""

from __future__ import annotations

import json
import os

import torch

#: Head dimension of q, k and v (K = V = 128 only).
HEAD_DIM = 128
#: Chunk size of the chunked algorithm (tokens).
CHUNK = 64

#: Default TileLang target: Hopper with the "a" features (wgmma, setmaxnreg).
#: Using one fixed target on the GPU and offline keeps TileLang's disk cache
#: (TILELANG_CACHE_DIR) interchangeable between a CPU build host and the H200.
DEFAULT_TARGET = {"kind": "cuda", "arch": "sm_90a"}


def default_target():
    """Target used for compilation: $QLABENCH_TL_TARGET (JSON or a plain string) or sm_90a."""
    env = os.environ.get("QLABENCH_TL_TARGET")
    if not env:
        return dict(DEFAULT_TARGET)
    try:
        return json.loads(env)
    except json.JSONDecodeError:
        return env


DEFAULT_STAGES = 2


def chunk_loop_stages() -> int:
    """Software-pipelining depth of the chunk loops in fwd_o and seg_state.

    2 (default) = ``T.Pipelined``: TileLang turns the loads into TMA with a producer warpgroup
    (256 threads, auto warp specialisation); 0 = plain loop with synchronous loads. With the
    warp-specialised fwd_o (the default) this sets seg_state's loop only: H200, 2/8 1x32768,
    seg_state 0.305 -> 0.208 ms with 2 (correct in every check case). $QLABENCH_GDN_STAGES
    overrides it, read per call.
    """
    return int(os.environ.get("QLABENCH_GDN_STAGES", str(DEFAULT_STAGES)))


#: Selectable variants (speed experiments). Defaults: the fastest combination that passed every
#: check_fwd case on the H200 (2026-11-29: tables=tl, prep=blocked, fastmath=1, fwd_ws=1;
#: 16/64 1x32768 5.33 -> 2.48 ms, 2/8 8x1024 0.312 -> 0.094 ms vs BASELINE_VARIANT; 2026-11-30:
#: prep=rt, rowexp=1, 1.15x more on every timed case, 16/64 1x32768 2.47 -> 2.15 ms; backward
#: bwd_ws=1 with rowexp=1: 16/32 1x32768 13.0 -> 9.0 ms; session 4: pprep=1 with uw=1, P from prep and
#: the S-independent W0/U0 off fwd_o's chain, 1.025x over the previous default in the check, every case
#: correct; the prep grid was then turned v-head-fastest; autobv=1, the planner choosing fwd_o's V block:
#: 1.039x over the same defaults without it on the 171-point sweep, see kernels/NOTES.md).
#:   tables  torch | tl        work tables by ~60 torch ops (default) or one TileLang launch (tables.py)
#:   prep    subst | blocked | blocked_pad | tc | rt   64-step substitution, 16x16 diagonal blocks + block
#:                             merge (default; blocked_pad: rows padded to 65 words), diagonal blocks +
#:                             (I+N)^-1 = (I-N)(I+N^2) on tf32 tensor cores, or the block merge
#:                             register-tiled (rt: a warp per 16x16 block, 2x4 tiles per lane)
#:   fwd_bv  64 | 32           V columns per fwd_o CTA (32: twice the CTAs, 2 per SM on 16/64)
#:   fwd_threads 128 | 256     fwd_o warps (256: TileLang splits every GEMM over 2 warpgroups)
#:   fastmath 0 | 1            nvcc --use_fast_math for fwd_o and seg_state (expf -> __expf)
#:   stages  0 | 2             chunk-loop pipelining (also $QLABENCH_GDN_STAGES)
#:   fwd_ws  0 | 1             fwd_o hand warp-specialised (fwd_o_ws.py: TMA producer + 3 consumer warpgroups,
#:                             mbarriers, setmaxnreg; 512 threads; ignores fwd_threads and stages)
#:   ws_stages 2 | 3           input ring depth of the warp-specialised fwd_o (3: loads two chunks ahead;
#:                             ~217 KB shared memory at fwd_bv=64 without pprep; with pprep's P ring
#:                             it does not fit, so pprep steps aside for an explicit ws_stages=3)
#:   rowexp  0 | 1             warp-specialised fwd_o: per-row exps once per chunk into row fragments,
#:                             off the S hand-off chain (0: one exp + g load per element); also
#:                             seg_state and the backward's bwd_dhu (with fast math)
#:   bwd_ws  0 | 1             backward: bwd_h warp-specialised (bwd_h_ws.py: the forward's chain
#:                             without its output warpgroup; 384 threads)
#:   pprep   0 | 1             prep (rt) also writes P = scale·Γ⊙QKᵀ per (chunk, v-head) and the
#:                             warp-specialised fwd_o TMA-loads it instead of computing it in its
#:                             output warpgroup (needs prep=rt, fwd_ws=1, ws_stages=2; that fwd_o and
#:                             the P prep always use per-row exps and fast math, so rowexp / fastmath
#:                             then only change seg_state)
#:   autobv  0 | 1             warp-specialised fwd_o: its V block (64 or 32) chosen per shape together
#:                             with the split by the planner's cost model (``plan_fwd``), 32 where the heads
#:                             alone leave SMs idle
#:   bwd_split auto | 0 | 512 .. 8192   backward: the chains (bwd_h, bwd_dhu) walk segments of this many
#:                             tokens (auto = ``plan_bwd_split``'s cost model; 0 = whole sequences)
#:   bwd_threads 128 | 256     backward: threads of bwd_dqkwg / bwd_wy (256: two warpgroups split each GEMM;
#:                             H200 session 5: 16/32 1x32768 dqkwg 2.50 -> 2.14 ms, wy 1.95 -> 1.49 ms)
#:   bwd_stages auto | 0 | 2   backward: bwd_dhu's chunk loop pipelined (2: TMA loads of the next chunk,
#:                             needs rowexp=1; 256 threads, ~106 KB: two CTAs per SM instead of three);
#:                             auto = 2 where the bwd_dhu CTAs fit two per SM (16/32 1x32768 unsplit:
#:                             3.02 -> 2.06 ms), else 0 (split chains: 0.58 vs 0.63 ms)
#:   bwd_streams 1 | 0         backward: the state chain (seg_state, fixup, bwd_h) on a second CUDA stream,
#:                             concurrent with bwd_dhu (which does not depend on it)
#:   bwd_rsum 0 | 1            backward: bwd_dqkwg's row / column sums as fragment reductions (no per-thread
#:                             loops over shared memory, no single-thread tail)
#:   bwd_bf16 0 | 1            backward: the per-v-head dq and dk intermediates (before the GVA group sum)
#:                             in bf16 instead of fp32 (bwd_wy's dk read-modify-write halves)
#:   bwd_dhu_ws 0 | 1          backward: bwd_dhu warp-specialised (bwd_dhu_ws.py; Y = Y0 + W' dH, with Pᵀ and
#:                             W' from the parallel bwd_pw.py and Y0 built by a warpgroup off the chain);
#:                             block_v 32 only (other widths run bwd_dhu)
#:   bwd_grp 0 | 1             backward: bwd_dqkwg and bwd_wy run one CTA per (chunk, qk head) over the G
#:                             v-heads of its GVA group and store dq, dk summed (no group sum in torch)
#:   bwd_wy_ws 0 | 1           backward (with bwd_grp=1, bwd_bf16=1): bwd_wy warp-specialised and persistent
#:                             (bwd_wy_ws.py: a producer warp TMA-loads the next (chunk, v-head) tile while
#:                             two consumer warpgroups compute this one)
#:   bwd_dqkwg_ws 0 | 1        backward (with bwd_grp=1, bwd_rsum=1, bwd_bf16=1): bwd_dqkwg the same way
#:                             (bwd_dqkwg_ws.py)
#:   uw      0 | 1             with pprep=1: the warp-specialised fwd_o's U/W warpgroup computes the
#:                             S-independent −W₀ = −A_β diag(e^g) K and U₀ = A_β V while the state is
#:                             updated, then Vd = U₀ − W₀ S is one wgmma on the chain (needs pprep=1)
VARIANT_DEFAULTS = {
    "tables": "tl", "prep": "rt", "fwd_bv": "64", "fwd_threads": "128", "fastmath": "1", "stages": None,
    "fwd_ws": "1", "ws_stages": "2", "rowexp": "1", "bwd_ws": "1", "pprep": "1", "uw": "1", "autobv": "1",
    "bwd_split": "auto", "bwd_threads": "256", "bwd_stages": "auto",
    "bwd_streams": "1", "bwd_rsum": "1", "bwd_bf16": "1", "bwd_dhu_ws": "1", "bwd_grp": "1",
    "bwd_wy_ws": "1", "bwd_dqkwg_ws": "1",
}  # fmt: skip
#: The first landing's path (the knobs at their oldest values), kept for comparison.
BASELINE_VARIANT = (
    "tables=torch,prep=subst,fastmath=0,fwd_ws=0,stages=0,rowexp=0,bwd_ws=0,pprep=0,uw=0,autobv=0,bwd_split=0,"
    "bwd_threads=128,bwd_stages=0,bwd_streams=0,bwd_rsum=0,bwd_bf16=0,bwd_dhu_ws=0,bwd_grp=0,bwd_wy_ws=0,bwd_dqkwg_ws=0"
)
VARIANT_CHOICES = {
    "tables": ("torch", "tl"),
    "prep": ("subst", "blocked", "blocked_pad", "tc", "rt"),
    "fwd_bv": ("64", "32"),
    "fwd_threads": ("128", "256"),
    "fastmath": ("0", "1"),
    "stages": ("0", "2"),
    "fwd_ws": ("0", "1"),
    "ws_stages": ("2", "3"),
    "rowexp": ("0", "1"),
    "bwd_ws": ("0", "1"),
    "pprep": ("0", "1"),
    "uw": ("0", "1"),
    "autobv": ("1", "0"),
    "bwd_split": ("auto", "0", "512", "1024", "2048", "4096", "8192"),
    "bwd_threads": ("128", "256"),
    "bwd_stages": ("auto", "0", "2"),
    "bwd_streams": ("1", "0"),
    "bwd_rsum": ("0", "1"),
    "bwd_bf16": ("0", "1"),
    "bwd_dhu_ws": ("0", "1"),
    "bwd_grp": ("0", "1"),
    "bwd_wy_ws": ("0", "1"),
    "bwd_dqkwg_ws": ("0", "1"),
}


#: Variants that kernels/dev/check_fwd.py checks and times side by side (and that
#: scripts/precompile_cache.py puts into the carried TileLang cache). "default" = verified path.
CHECK_VARIANTS = [
    "default",
    BASELINE_VARIANT,
    "prep=blocked,rowexp=0",  # the default before 2026-11-30's check
    "prep=blocked",
    "rowexp=0,pprep=0",  # rowexp only changes fwd_o_ws; the P-loading fwd_o always uses row exps
    "fwd_bv=32",
    "pprep=0,uw=0",  # the default before 2026-11-30's session-4 check
    "pprep=1,uw=0",
    "autobv=0",
]


def parse_variant(spec=None) -> dict:
    """Variant settings from ``spec`` (str "k=v,k=v" or dict) over $QLABENCH_GDN_VARIANT over defaults.

    ``stages`` falls back to $QLABENCH_GDN_STAGES (default ``DEFAULT_STAGES``). Returns str values (stages as int).
    """
    out = dict(VARIANT_DEFAULTS)
    explicit = set()
    for src in (os.environ.get("QLABENCH_GDN_VARIANT", ""), spec):
        if not src or src == "default":
            continue
        items = src.items() if isinstance(src, dict) else [kv.split("=", 1) for kv in str(src).split(",") if kv.strip()]
        for item in items:
            if len(item) != 2:
                raise ValueError(f"GDN variant item {item[0].strip()!r} must be knob=value (in {src!r})")
            key, val = item
            key, val = str(key).strip(), str(val).strip()
            if key not in VARIANT_CHOICES:
                raise ValueError(f"unknown GDN variant knob {key!r}; knobs: {sorted(VARIANT_CHOICES)}")
            if val not in VARIANT_CHOICES[key]:
                raise ValueError(f"GDN variant {key}={val!r} not in {VARIANT_CHOICES[key]}")
            out[key] = val
            explicit.add(key)
    # pprep / uw are defaults that yield to an explicitly chosen other prep or fwd_o; asked for
    # explicitly with them, they are an error
    if out["pprep"] == "1" and (out["prep"] != "rt" or out["fwd_ws"] != "1" or out["ws_stages"] != "2"):
        if "pprep" in explicit:
            raise ValueError(
                f"GDN variant pprep=1 needs prep=rt, fwd_ws=1 and ws_stages=2 (got prep={out['prep']}, "
                f"fwd_ws={out['fwd_ws']}, ws_stages={out['ws_stages']})"
            )
        out["pprep"] = "0"
    if out["uw"] == "1" and out["pprep"] != "1":
        if "uw" in explicit:
            raise ValueError("GDN variant uw=1 needs pprep=1 (it is a mode of the P-loading fwd_o)")
        out["uw"] = "0"
    out["stages"] = int(out["stages"]) if out["stages"] is not None else chunk_loop_stages()
    return out


def variant_name(v: dict) -> str:
    """Short label listing only the knobs that differ from the defaults ("default" if none)."""
    # pprep / uw are not named where they cannot apply (another prep or fwd_o; uw without pprep)
    moot = set()
    if v.get("fwd_ws") != "1":
        moot.add("autobv")
    if v.get("prep") != "rt" or v.get("fwd_ws") != "1" or v.get("ws_stages") != "2":
        moot |= {"pprep", "uw"}
    if v.get("pprep") != "1":
        moot.add("uw")
    parts = [f"{k}={v[k]}" for k in VARIANT_CHOICES if k not in ("stages", *moot) and v.get(k) != VARIANT_DEFAULTS[k]]
    if v.get("stages") is not None and int(v["stages"]) != DEFAULT_STAGES:
        parts.append(f"stages={v['stages']}")
    return ",".join(parts) or "default"


def check_seqlens(seqlens, N: int, T: int):
    """Host sequence lengths given for planning, as ints (or None): N non-negative ints summing to T,
    else ValueError naming seqlens, N and T."""
    if seqlens is None:
        return None
    given = list(seqlens)
    seqlens = [int(x) for x in given]
    if seqlens != given or len(seqlens) != N or sum(seqlens) != T or min(seqlens, default=0) < 0:
        raise ValueError(
            f"seqlens (host lengths for planning) must be N={N} non-negative ints summing to T={T}, "
            f"got {len(seqlens)} summing to {sum(seqlens)}"
        )
    return seqlens


def target_key(target) -> str:
    """Hashable form of a target (dict or string) for in-process kernel caches."""
    if target is None:
        target = default_target()
    if isinstance(target, dict):
        return json.dumps(target, sort_keys=True)
    return str(target)


def compile_program(func, target=None, pass_configs=None):
    """Compile a TileLang prim_func with the tvm_ffi backend (works without a GPU)."""
    import tilelang

    if target is None:
        target = default_target()
    return tilelang.compile(
        func,
        target=target,
        execution_backend="tvm_ffi",
        pass_configs=pass_configs or {},
    )


def bwd_ws_forms(var, h_qk: int, h_v: int) -> tuple:
    """(dqkwg_ws, wy_ws): whether the backward runs the persistent warp-specialised dqkwg / wy for
    this parsed variant and head config (else their group or per-v-head forms). Both need
    ``bwd_grp=1`` and bf16 partials (``bwd_bf16=1``); dqkwg_ws also ``bwd_rsum=1``; wy_ws a GVA group
    of 2+ v-heads (its store warp's per-item dk hand-off can be lapped when every tile is an item)."""
    base = var["bwd_grp"] == "1" and var["bwd_bf16"] == "1"
    dq_ws = base and var["bwd_dqkwg_ws"] == "1" and var["bwd_rsum"] == "1"
    wy_ws = base and var["bwd_wy_ws"] == "1" and h_v > h_qk
    return dq_ws, wy_ws


def check_heads(h_qk: int, h_v: int) -> int:
    """Return the GVA group size G = h_v / h_qk, or raise with what is allowed."""
    if h_qk <= 0 or h_v <= 0 or h_v % h_qk != 0:
        raise ValueError(
            f"h_v={h_v} must be a positive multiple of h_qk={h_qk} (GVA: v-head j reads q/k head j // (h_v/h_qk))"
        )
    return h_v // h_qk


# --------------------------------------------------------------------------------------
# Work tables (built on the GPU with torch ops: no host synchronisation, graph-capturable)
# --------------------------------------------------------------------------------------

#: Columns of a segment table row (int32 [NS, 8]).
SEG_BOS, SEG_EOS, SEG_SEQ, SEG_CSLOT, SEG_INIT_ROW, SEG_IS_LAST = 0, 1, 2, 3, 4, 5
SEG_COLS = 8


def default_cu_seqlens(T: int, device) -> torch.Tensor:
    """cu_seqlens [0, T] as int64 on ``device``, built without a host->device copy (capture-safe)."""
    return torch.arange(2, device=device, dtype=torch.int64) * T


def chunk_table(cu: torch.Tensor, T: int, N: int):
    """Chunk slots of a varlen batch.

    Args:
        cu: int64 [N+1] cumulative sequence lengths on the device.
        T, N: total tokens and number of sequences (host ints, known from shapes).

    Returns:
        ctab: int32 [NCS, 4], NCS = T // 64 + N (an upper bound of sum(ceil(len_n / 64))).
              Row c = (bos, eos, seq, 0) of chunk slot c; unused slots are (0, 0, -1, 0).
              The chunks of sequence n occupy slots cu_chunks[n] .. cu_chunks[n+1]-1.
        cu_chunks: int64 [N+1] first chunk slot of each sequence.
    """
    lens = cu[1:] - cu[:-1]
    nch = (lens + (CHUNK - 1)) // CHUNK
    cu_chunks = torch.cat([cu.new_zeros(1), torch.cumsum(nch, 0)])
    ncs = T // CHUNK + N
    slots = torch.arange(ncs, device=cu.device, dtype=torch.int64)
    seq = torch.searchsorted(cu_chunks[1:].contiguous(), slots, right=True).clamp_(max=N - 1)
    valid = slots < cu_chunks[N]
    local = slots - cu_chunks[seq]
    bos = cu[seq] + local * CHUNK
    eos = torch.minimum(bos + CHUNK, cu[seq + 1])
    zero = torch.zeros_like(bos)
    ctab = torch.stack(
        [
            torch.where(valid, bos, zero),
            torch.where(valid, eos, zero),
            torch.where(valid, seq, zero - 1),
            zero,
        ],
        dim=1,
    )
    return ctab.to(torch.int32).contiguous(), cu_chunks


def segment_table(cu: torch.Tensor, cu_chunks: torch.Tensor, T: int, N: int, seg_tokens: int, split: bool):
    """Segments walked by one CTA each (per v-head and V block).

    A sequence of length L gets max(1, ceil(L / seg_tokens)) segments (an empty sequence gets
    one empty segment so that its final state = initial state is still written).

    Returns:
        stab: int32 [NS, 8], NS = T // seg_tokens + N. Columns: bos, eos, seq (-1 = unused slot),
              first chunk slot, init_row (row of the initial-state tensor the kernel reads:
              the segment index when ``split`` else the sequence index), is_last (1 for the last
              segment of its sequence), 0, 0.
        cu_segs: int64 [N+1] first segment of each sequence.
    """
    assert seg_tokens % CHUNK == 0
    lens = cu[1:] - cu[:-1]
    nseg = torch.clamp((lens + (seg_tokens - 1)) // seg_tokens, min=1)
    cu_segs = torch.cat([cu.new_zeros(1), torch.cumsum(nseg, 0)])
    ns = T // seg_tokens + N
    slots = torch.arange(ns, device=cu.device, dtype=torch.int64)
    seq = torch.searchsorted(cu_segs[1:].contiguous(), slots, right=True).clamp_(max=N - 1)
    valid = slots < cu_segs[N]
    local = slots - cu_segs[seq]
    bos = cu[seq] + local * seg_tokens
    eos = torch.minimum(bos + seg_tokens, cu[seq + 1])
    cslot = cu_chunks[seq] + local * (seg_tokens // CHUNK)
    init_row = slots if split else seq
    is_last = (local == nseg[seq] - 1).to(torch.int64)
    zero = torch.zeros_like(bos)
    stab = torch.stack(
        [
            torch.where(valid, bos, zero),
            torch.where(valid, eos, zero),
            torch.where(valid, seq, zero - 1),
            torch.where(valid, cslot, zero),
            torch.where(valid, init_row, zero),
            torch.where(valid, is_last, zero),
            zero,
            zero,
        ],
        dim=1,
    )
    return stab.to(torch.int32).contiguous(), cu_segs
