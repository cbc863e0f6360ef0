"""Block allocator and paged cache pools (DESIGN §2): allocation, insertion by slot, read-back, poisoning.

Read-back values are checked against the independent fp8 model of tests/dense.py.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dense import fake_quant
from sparse_mla.cache import BlockAllocator, CacheFullError, PagedCache
from sparse_mla.formats import block_bytes

FORMATS = [("bf16", 512), ("fp8_v4", 512), ("fp8_v32", 576), ("bf16", 576)]


def bits(x: torch.Tensor) -> torch.Tensor:
    """Bit patterns of a bf16 tensor, so NaNs compare equal to themselves."""
    return x.contiguous().view(torch.int16)


# ---------------------------------------------------------------------------------------- allocator


def test_allocator_basics():
    alloc = BlockAllocator(5)
    assert alloc.num_free == 5
    a = alloc.allocate(2)
    assert a == [0, 1], "lowest numbers first"
    assert alloc.allocate(0) == []
    b = alloc.allocate(3)
    assert sorted(a + b) == list(range(5)) and alloc.num_free == 0
    with pytest.raises(CacheFullError):
        alloc.allocate(1)
    alloc.free([1])
    with pytest.raises(CacheFullError):
        alloc.allocate(2)
    assert alloc.num_free == 1, "a failed allocation takes nothing"
    assert alloc.allocate(1) == [1]


def test_allocator_errors():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockAllocator(0)
    alloc = BlockAllocator(4)
    with pytest.raises(ValueError, match="n must be"):
        alloc.allocate(-1)
    got = alloc.allocate(2)
    alloc.free([got[0]])
    with pytest.raises(ValueError, match="not allocated"):
        alloc.free([got[0]])  # double free
    with pytest.raises(ValueError, match="not allocated"):
        alloc.free([3])  # never handed out
    with pytest.raises(ValueError, match="not allocated"):
        alloc.free([7])  # not a block of this pool
    with pytest.raises(ValueError, match=f"block {got[1]} is given twice"):
        alloc.free([got[1], got[1]])
    for bad in ([0.0], [True]):
        with pytest.raises(ValueError, match="blocks must be ints"):
            alloc.free(bad)
    for bad in (got[1], "1", None):  # one block, not a list of them
        with pytest.raises(TypeError, match=r"blocks must be a list of block numbers \(as allocate returns them\), "
                                            f"got {bad!r}"):
            alloc.free(bad)
    with pytest.raises(TypeError, match=r"blocks must be a list of block numbers \(as allocate returns them\), got a "
                                        r"tensor of shape \(2,\): pass blocks.tolist\(\)"):
        alloc.free(torch.tensor(got[:2]))
    with pytest.raises(ValueError, match="n must be an int"):
        alloc.allocate(True)
    with pytest.raises(TypeError, match="num_blocks must be a positive int"):
        BlockAllocator(2.5)
    with pytest.raises(ValueError, match="num_blocks must be a positive int"):
        BlockAllocator(0)
    assert alloc.num_free == 3
    alloc.free([np.int64(got[1])])  # numpy integers are block numbers too
    assert alloc.num_free == 4


@given(num_blocks=st.integers(1, 12),
       ops=st.lists(st.tuples(st.booleans(), st.integers(0, 6), st.integers(0, 2**16)), max_size=30))
def test_allocator_never_hands_out_a_block_twice(num_blocks, ops):
    """Random allocate / free sequences against a model: handed-out blocks are distinct and in range."""
    alloc = BlockAllocator(num_blocks)
    held: list[int] = []
    for is_alloc, n, pick in ops:
        if is_alloc:
            free_before = num_blocks - len(held)
            if n > free_before:
                with pytest.raises(CacheFullError):
                    alloc.allocate(n)
                continue
            got = alloc.allocate(n)
            assert len(got) == n and len(set(got)) == n
            assert all(0 <= b < num_blocks for b in got)
            assert not set(got) & set(held), "a block handed out twice"
            held += got
        elif held:
            k = min(len(held), 1 + n % 3)
            start = pick % len(held)
            give = (held + held)[start: start + k]
            alloc.free(give)
            held = [b for b in held if b not in give]
        assert alloc.num_free == num_blocks - len(held)
    assert sorted(held + alloc.allocate(alloc.num_free)) == list(range(num_blocks))


# -------------------------------------------------------------------------------------- paged cache


def test_paged_cache_shape_and_properties():
    c = PagedCache(num_blocks=3, block_size=5, fmt="fp8_v4")
    assert c.data.shape == (3, 5, 584) and c.data.dtype == torch.uint8
    assert c.data.stride(0) == block_bytes("fp8_v4", 5)
    assert c.num_blocks == 3 and c.num_slots == 15 and c.device == torch.device("cpu")
    assert c.allocator.num_free == 3
    c32 = PagedCache(2, 4, "fp8_v32", dim=576)
    assert c32.data.shape == (2, 4, 656)
    cb = PagedCache(2, 4, "bf16", dim=576)
    assert cb.data.shape == (2, 4, 576) and cb.data.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="block_size"):
        PagedCache(2, 0, "bf16")
    with pytest.raises(ValueError, match="num_blocks"):
        PagedCache(0, 4, "fp8_v4")
    assert PagedCache(2, 4, "fp8_v32").data.shape == (2, 4, 656)  # an fp8 format fixes its width
    for fmt, dim in (("fp8_v4", 576), ("fp8_v32", 512)):
        with pytest.raises(ValueError, match=f"dim {dim} does not match format {fmt}"):
            PagedCache(2, 4, fmt, dim=dim)


@pytest.mark.parametrize("args,error,match", [
    ((4, 64.0), TypeError, "block_size must be a positive int, got 64.0"),
    ((2.5, 64), TypeError, "num_blocks must be a positive int, got 2.5"),
    ((0, 64), ValueError, "num_blocks must be a positive int, got 0"),
    ((4, -1), ValueError, "block_size must be a positive int, got -1"),
    ((4, 64, "fp4"), ValueError, "fmt must be one of"),
    ((4, 64, 8), TypeError, "fmt must be a format name"),
    ((4, 64, "bf16", 500), ValueError, "dim must be 512 .* or 576"),
    ((4, 64, "bf16", "512"), TypeError, "dim must be an int"),
    ((4, 64, "fp8_v4", 576), ValueError, "dim 576 does not match format fp8_v4"),
])
def test_paged_cache_arguments_are_named(args, error, match):
    with pytest.raises(error, match=match):
        PagedCache(*args)


@given(fmt_dim=st.sampled_from(FORMATS), nb=st.integers(1, 4), bs=st.integers(1, 6), n=st.integers(1, 12),
       pad_frac=st.sampled_from([0.0, 0.3]), log_mag=st.integers(-8, 8), seed=st.integers(0, 2**31 - 1))
def test_write_then_read_round_trip(fmt_dim, nb, bs, n, pad_frac, log_mag, seed):
    fmt, dim = fmt_dim
    gen = torch.Generator().manual_seed(seed)
    cache = PagedCache(nb, bs, fmt, dim)
    num_slots = nb * bs
    n = min(n, num_slots)
    slots = torch.randperm(num_slots, generator=gen)[:n].int()
    pad = torch.rand(n, generator=gen) < pad_frac
    slots[pad] = -1
    kv = (torch.randn(n, dim, generator=gen) * 2.0**log_mag).to(torch.bfloat16)
    kv[pad] = float("nan")  # padding tokens may hold anything: they are not written
    cache.poison()
    cache.write(kv, slots)

    every = torch.arange(num_slots, dtype=torch.int32)
    back = cache.read(every)
    assert back.dtype == torch.bfloat16 and back.shape == (num_slots, dim)
    written = slots[~pad].long()
    expected = fake_quant(kv[~pad], fmt)  # exact: bf16 stores kv, fp8 stores e4m3 · 2^k
    assert torch.equal(back[written].double(), expected)
    if fmt != "bf16":
        nope = 448 if fmt == "fp8_v4" else 512
        x = kv[~pad].double()
        err = (back[written].double() - x).abs()
        assert bool((err[:, nope:] == 0).all())
        tile = 64 if fmt == "fp8_v4" else 128
        tile_amax = x[:, :nope].view(len(written), nope // tile, tile).abs().amax(-1)
        scale_bound = torch.clamp_min(tile_amax / 448, 1e-4) * 2  # scale < 2 · max(amax/448, 1e-4)
        bound = torch.maximum(x[:, :nope].abs() * 2.0**-4,
                              scale_bound.repeat_interleave(tile, 1) * 2.0**-10)
        assert bool((err[:, :nope] <= bound).all())
    unwritten = torch.ones(num_slots, dtype=torch.bool)
    unwritten[written] = False
    assert bool(back[unwritten].isnan().all()), "poisoned, never-written slots read as NaN"
    assert not back[written].isnan().any()


@pytest.mark.parametrize("fmt,dim", FORMATS)
def test_minus_one_slots_and_other_slots_keep_their_content(fmt, dim):
    gen = torch.Generator().manual_seed(dim + len(fmt))
    nb, bs = 3, 4
    cache = PagedCache(nb, bs, fmt, dim)
    every = torch.arange(nb * bs, dtype=torch.int32)
    first = torch.randn(nb * bs, dim, generator=gen).to(torch.bfloat16)
    cache.write(first, every)
    before = cache.read(every)
    raw_before = cache.data.clone()

    second = torch.randn(3, dim, generator=gen).to(torch.bfloat16) * 3
    cache.write(second, torch.tensor([5, -1, 11], dtype=torch.int64))
    after = cache.read(every)
    assert torch.equal(after[5].double(), fake_quant(second[0:1], fmt)[0])
    assert torch.equal(after[11].double(), fake_quant(second[2:3], fmt)[0])
    others = [s for s in range(nb * bs) if s not in (5, 11)]
    assert torch.equal(bits(after[others]), bits(before[others])), "untargeted slots changed"
    # the -1 row was written nowhere: no slot holds it
    ghost = fake_quant(second[1:2], fmt)[0]
    assert not any(torch.equal(after[s].double(), ghost) for s in range(nb * bs))
    # at the byte level only slots 5 and 11 changed (fp8_v4: body and scale bytes of those tokens)
    changed = (cache.data != raw_before).any(-1).reshape(-1) if fmt != "fp8_v4" else None
    if changed is not None:
        assert changed.nonzero().reshape(-1).tolist() == [5, 11]


def test_fp8_v4_write_touches_only_its_own_bytes():
    nb, bs = 2, 3
    cache = PagedCache(nb, bs, "fp8_v4")
    cache.poison()
    cache.write(torch.ones(1, 512, dtype=torch.bfloat16), torch.tensor([4]))  # block 1, offset 1
    flat = torch.empty(0, dtype=torch.uint8).set_(cache.data.untyped_storage())
    stride = cache.data.stride(0)
    used = flat[: (nb - 1) * stride + bs * 584]  # the padding after the last block holds no data
    touched = (used != 0xFF).nonzero().reshape(-1)
    body = range(stride + 576, stride + 2 * 576)
    scales = range(stride + bs * 576 + 8, stride + bs * 576 + 16)
    assert set(touched.tolist()) == set(body) | set(scales)  # every byte of the record changed (1.0 -> 0x78)
    assert flat[stride + bs * 576 + 8: stride + bs * 576 + 16].tolist() == [127 - 8] * 7 + [0]


def test_read_shapes_and_minus_one():
    cache = PagedCache(2, 4, "fp8_v32", dim=576)
    cache.poison()
    kv = torch.randn(2, 576).to(torch.bfloat16)
    cache.write(kv, torch.tensor([0, 7], dtype=torch.int32))
    got = cache.read(torch.tensor([[7, -1, 0], [-1, -1, 7]], dtype=torch.int32))
    assert got.shape == (2, 3, 576) and got.dtype == torch.bfloat16
    assert (got[0, 1] == 0).all() and (got[1, :2] == 0).all(), "-1 reads as zeros, even in a poisoned cache"
    assert torch.equal(got[0, 0].double(), fake_quant(kv[1:], "fp8_v32")[0])
    assert torch.equal(got[0, 2], got[0, 2]) and torch.equal(got[1, 2], got[0, 0])


def test_poison_makes_every_unwritten_value_nan_in_every_format():
    for fmt, dim in FORMATS:
        cache = PagedCache(2, 3, fmt, dim)
        cache.poison()
        back = cache.read(torch.arange(6))
        assert back.isnan().all(), fmt


@pytest.mark.parametrize("fmt,dim", FORMATS)
def test_write_rejects_bad_slots_and_values(fmt, dim):
    cache = PagedCache(2, 4, fmt, dim)
    ok = torch.zeros(1, dim, dtype=torch.bfloat16)
    raw = cache.data.clone()
    for bad in (8, 100, -2):
        with pytest.raises(ValueError, match=f"slot_mapping holds {bad}, out of range"):
            cache.write(ok, torch.tensor([bad]))
    with pytest.raises(ValueError, match="slot_mapping must have dtype"):
        cache.write(ok, torch.tensor([1.0]))
    with pytest.raises(ValueError, match="slot_mapping must have shape"):
        cache.write(ok, torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="slot_mapping holds slot 3 more than once"):  # -1 twice is fine
        cache.write(ok.expand(4, dim), torch.tensor([3, -1, -1, 3]))
    with pytest.raises(ValueError, match="kv_new must be finite"):
        cache.write(torch.full((1, dim), float("nan"), dtype=torch.bfloat16), torch.tensor([1]))
    with pytest.raises(ValueError, match="kv_new must have shape"):
        cache.write(torch.zeros(1, 1088 - dim, dtype=torch.bfloat16), torch.tensor([1]))
    with pytest.raises(ValueError, match="kv_new must have dtype"):
        cache.write(torch.zeros(1, dim), torch.tensor([1]))
    assert torch.equal(cache.data, raw), "a rejected write changes nothing"
    with pytest.raises(ValueError, match="slots holds 8"):
        cache.read(torch.tensor([8]))


def test_failed_free_changes_nothing():
    alloc = BlockAllocator(4)
    got = alloc.allocate(2)
    with pytest.raises(ValueError, match="not allocated"):
        alloc.free([got[0], 3])
    assert alloc.num_free == 2
    alloc.free(got)
    assert alloc.num_free == 4
