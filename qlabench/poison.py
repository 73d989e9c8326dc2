"""Poisoning: memory a checked call is about to write holds NaN, so an output element a kernel
forgets to write is NaN (the correctness check fails it), never a stale right answer left by an earlier call.

Three layers, because no single one covers every way an output buffer is obtained:

- :class:`PoisonAllocations`, a ``TorchDispatchMode`` active around a checked call: every
  floating-point tensor created by an ``empty`` factory (``torch.empty``, ``empty_like``,
  ``new_empty``, ``empty_strided``, from Python or from C++ through the dispatcher) is filled
  with NaN before the library sees it, whatever its size and whichever allocator pool serves it.
  Allocations inside a dispatcher operator the mode passes through (a ``torch.library`` custom
  op's own ``empty``) are not seen by it; the next layer covers those on the GPU.
- :func:`poison_cached_memory` (CUDA): every free block the caching allocator holds — the small
  pool (allocations of 1 MiB or less) as well as the large one, and the free parts of segments a
  live tensor keeps cached — is overwritten with NaN bytes, and NaN-filled free segments are left
  in both pools, so even memory taken without the dispatcher (``raw_alloc``) starts poisoned.
- :func:`fill_nan`: outputs a backend preallocates (``Prepared.outputs``).

Only floating-point tensors are filled (integer scratch such as semaphores is the library's).
``0xFF`` bytes are NaN in every float format (fp64, fp32, bf16, fp16).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_EMPTY = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
          "empty_permuted"}

SMALL_BLOCK = 1 << 20  # the caching allocator's small-pool limit


class PoisonAllocations(TorchDispatchMode):
    """While active, floating-point tensors from ``empty`` factories are NaN; ``filled`` counts them."""

    def __init__(self):
        super().__init__()
        self.filled = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ in _EMPTY:
            for t in _tensors(out):
                if t.is_floating_point() and t.numel():
                    t.fill_(float("nan"))
                    self.filled += 1
        return out


def _tensors(obj) -> Iterable[torch.Tensor]:
    """Tensors in a (nested) tuple / list / dict, or the object itself."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for o in obj:
            yield from _tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors(o)


def fill_nan(obj) -> int:
    """Fill every floating-point tensor in ``obj`` (nested tuple/list/dict) with NaN. Returns the
    count."""
    n = 0
    for t in _tensors(obj):
        if t.is_floating_point() and t.numel():
            t.fill_(float("nan"))
            n += 1
    return n


def _nan_block(nbytes: int, device: str = "cuda") -> torch.Tensor:
    return torch.full((max(nbytes, 1),), 0xFF, dtype=torch.uint8, device=device)


def free_cached_blocks() -> list[tuple[int, bool]]:
    """(size, segment pool is small) of every free block of the CUDA caching allocator that an
    allocation on the current stream, outside a graph's private pool, can be served from."""
    out = []
    stream = torch.cuda.current_stream().cuda_stream
    for seg in torch.cuda.memory_snapshot():
        if seg.get("stream", stream) != stream or tuple(seg.get("segment_pool_id", (0, 0))) != (0, 0):
            continue  # another stream's or a CUDA graph's memory: no allocation here takes it
        small = seg.get("segment_type", "small" if seg.get("total_size") == 2 << 20
                        else "large") == "small"
        for b in seg.get("blocks", ()):
            if b.get("state") == "inactive":
                out.append((int(b["size"]), small))
    return out


def poison_cached_memory(nbytes: int, small_bytes: int = 64 << 20, chunk_bytes: int = 2 << 30,
                         cap_bytes: int = 32 << 30) -> None:
    """Overwrite with NaN every free block of the CUDA caching allocator (both pools), then leave
    NaN-filled free segments behind: ``small_bytes`` of 1 MiB blocks in the small pool, and in
    the large pool ``chunk_bytes`` blocks over up to half the free device memory (at least
    ``4 * nbytes``, at most ``cap_bytes``). Allocations a call makes are then carved from NaN."""
    if not torch.cuda.is_available():
        return
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # fully free segments go back to the device; the rest are walked
    hold: list[torch.Tensor] = []
    try:  # each phase stops at the first OOM; the next still runs
        for _ in range(16):
            # every request fits an existing free block, so best fit takes one (no new segment)
            # and the free bytes shrink each round; large-pool blocks of 1 MiB or less are
            # reachable by no allocation (small requests go to the small pool)
            blocks = free_cached_blocks()
            large = sorted((s for s, small in blocks if not small and s > SMALL_BLOCK), reverse=True)
            small = sorted((s for s, small in blocks if small), reverse=True)
            if not large and not small:
                break
            for size in large:  # largest first: each is served by the block of exactly its size
                hold.append(_nan_block(size))
            for size in small:
                hold.append(_nan_block(min(size, SMALL_BLOCK)))
    except torch.OutOfMemoryError:
        pass
    try:
        for _ in range(small_bytes // SMALL_BLOCK):
            hold.append(_nan_block(SMALL_BLOCK))
    except torch.OutOfMemoryError:
        pass
    try:
        free, _ = torch.cuda.mem_get_info()
        left = min(int(free * 0.5), max(4 * nbytes, 4 << 30), cap_bytes)
        while left > SMALL_BLOCK:
            n = min(left, chunk_bytes)
            hold.append(_nan_block(n))
            left -= n
    except torch.OutOfMemoryError:
        pass
    torch.cuda.synchronize()
    del hold  # back into the allocator's pools, NaN-filled
