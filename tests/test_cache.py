"""Block allocator and paged cache pools: allocation, insertion by slot, read-back, poisoning."""
from __future__ import annotations

import pytest
import torch

from sparse_mla.cache import BlockAllocator, CacheFullError, PagedCache


def test_allocator_never_hands_out_a_block_twice():
    alloc = BlockAllocator(5)
    a = alloc.allocate(2)
    b = alloc.allocate(3)
    assert sorted(a + b) == list(range(5)) and alloc.num_free == 0
    with pytest.raises(CacheFullError):
        alloc.allocate(1)
    alloc.free(a)
    assert sorted(alloc.allocate(2)) == sorted(a)
    with pytest.raises(ValueError, match="not allocated"):
        alloc.free([a[0], a[0]])


@pytest.mark.parametrize("fmt,dim", [("bf16", 512), ("fp8_v4", 512), ("fp8_v32", 576), ("bf16", 576)])
def test_write_then_read_back(fmt, dim):
    gen = torch.Generator().manual_seed(dim)
    cache = PagedCache(num_blocks=3, block_size=5, fmt=fmt, dim=dim)
    cache.poison()
    kv = torch.randn(7, dim, generator=gen).to(torch.bfloat16)
    slots = torch.tensor([14, 0, 6, -1, 3, 9, 10], dtype=torch.int32)
    cache.write(kv, slots)
    back = cache.read(slots).float()
    keep = slots >= 0
    if fmt == "bf16":
        assert torch.equal(back[keep], kv[keep].float())
    else:
        err = (back[keep] - kv[keep].float()).norm() / kv[keep].float().norm()
        assert err < 0.04
    assert (back[~keep] == 0).all(), "-1 reads as zeros"
    assert cache.read(torch.tensor([1, 2])).isnan().all(), "unwritten slots of a poisoned cache read as NaN"
    # rewriting one slot leaves its neighbours alone, and -1 entries write nothing
    before = cache.read(torch.tensor([0, 6])).clone()
    cache.write(torch.ones(2, dim, dtype=torch.bfloat16), torch.tensor([3, -1]))
    assert torch.equal(cache.read(torch.tensor([0, 6])), before)
    assert (cache.read(torch.tensor([3])).float() == 1).all()


def test_write_rejects_bad_slots_and_values():
    cache = PagedCache(2, 4, "fp8_v4")
    with pytest.raises(ValueError, match="slot_mapping .* out of range"):
        cache.write(torch.zeros(1, 512, dtype=torch.bfloat16), torch.tensor([8]))
    with pytest.raises(ValueError, match="kv_new must be finite"):
        cache.write(torch.full((1, 512), float("nan"), dtype=torch.bfloat16), torch.tensor([1]))
    with pytest.raises(ValueError, match="kv_new must have shape"):
        cache.write(torch.zeros(1, 576, dtype=torch.bfloat16), torch.tensor([1]))
