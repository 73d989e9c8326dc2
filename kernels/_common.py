"""Shared constants and helpers of the TileLang GDN kernels: head and chunk sizes, the compile
target, input checks and the work tables built with torch ops.

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


def parse_target(target_k):
    """A target back from its :func:`target_key` form (JSON dict or plain string; None = default)."""
    return json.loads(target_k) if target_k and target_k.startswith("{") else target_k


#: TileLang pass configs of the kernels compiled with nvcc --use_fast_math (exp -> ex2.approx)
FAST_MATH = {"tl.enable_fast_math": True}


def compile_program(func, target=None, pass_configs=None):
    """Compile a TileLang prim_func with the tvm_ffi backend (works without a GPU)."""
    import tilelang

    if target is None:
        target = default_target()
    return tilelang.compile(func, target=target, execution_backend="tvm_ffi", pass_configs=pass_configs or {})


def check_heads(h_qk: int, h_v: int) -> int:
    """Return the GVA group size G = h_v / h_qk, or raise with what is allowed."""
    if h_qk <= 0 or h_v <= 0 or h_v % h_qk != 0:
        raise ValueError(
            f"h_v={h_v} must be a positive multiple of h_qk={h_qk} (GVA: v-head j reads q/k head j // (h_v/h_qk))"
        )
    return h_v // h_qk


# --------------------------------------------------------------------------------------
# Work tables by torch ops (the tables kernel's reference; the CPU path of chunk_gdn_bwd)
# --------------------------------------------------------------------------------------

#: Columns of a segment table row (int32 [NS, 8]).
SEG_BOS, SEG_EOS, SEG_SEQ, SEG_CSLOT, SEG_INIT_ROW, SEG_IS_LAST = 0, 1, 2, 3, 4, 5
SEG_COLS = 8
#: Keys of the longest-first order: a segment's chunk count, the last key for that many or more.
LPT_KEYS = 32


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


def lpt_order(stab: torch.Tensor) -> torch.Tensor:
    """stab's rows by descending min(chunks, LPT_KEYS − 1), ties in slot order: the final kernels'
    CTAs start in this order, longest walks first (the block scheduler takes CTAs in index order)."""
    key = torch.clamp((stab[:, SEG_EOS] - stab[:, SEG_BOS] + CHUNK - 1) // CHUNK, max=LPT_KEYS - 1)
    return stab[torch.argsort(-key, stable=True)]
