"""Poisoning on the device: the caching allocator's free blocks — small pool and the free part
of a segment a live tensor keeps cached — come back NaN after ``poison_cached_memory``, and the
dispatch-level mode poisons CUDA allocations of every size. Each case checks its negative control
(without the poisoning the stale answer is what the allocator hands back)."""

import pytest
import torch

from qlabench import poison

pytestmark = pytest.mark.gpu


def _stale_then_poisoned(nbytes: int, neighbour_bytes: int) -> tuple[bool, bool]:
    """Free a tensor of ones beside a live neighbour; (next empty of that size is stale without
    poisoning, is all NaN with it)."""
    n = nbytes // 4
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    a = torch.ones(n, device="cuda")
    keep = torch.ones(neighbour_bytes // 4, device="cuda")  # keeps the segment cached
    del a
    b = torch.empty(n, device="cuda")
    stale = bool((b == 1).all())
    del b
    poison.poison_cached_memory(0, small_bytes=4 << 20, cap_bytes=64 << 20)
    c = torch.empty(n, device="cuda")
    poisoned = bool(torch.isnan(c).all())
    del c, keep
    return stale, poisoned


@pytest.mark.parametrize("nbytes,neighbour", [(128 << 10, 64 << 10), (1 << 20, 4 << 10),
                                              (3 << 20, 3 << 20)])
def test_free_cached_blocks_come_back_nan(nbytes, neighbour):
    stale, poisoned = _stale_then_poisoned(nbytes, neighbour)
    assert stale  # the hole the poisoning closes
    assert poisoned


def test_dispatch_mode_poisons_cuda_allocations_of_every_size():
    for n in (7, 1 << 14, 1 << 20):
        with poison.PoisonAllocations():
            t = torch.empty(n, device="cuda", dtype=torch.bfloat16)
        assert torch.isnan(t.float()).all()
