"""The indexer key cache (DESIGN §6): the fp8 page's bytes against an independent model of the writer (bf16 round,
power-of-two scale from the amax floored at 1e-4, e4m3 round to nearest even), the planar page layout read back from
raw bytes, the bf16 format, and bad input."""
from __future__ import annotations

import math
import struct

import pytest
import torch

from dense import e4m3_bytes, e4m3_round
from sparse_mla.indexer_cache import IndexerKeyCache, quantize_index_keys


def model_entry(key: torch.Tensor) -> tuple[list[int], float]:
    """An fp8 entry worked out independently: the bf16-rounded key's amax, floored at 1e-4, over 448, to the next
    power of two (float64, frexp), then each value / scale rounded onto the e4m3 grid."""
    x = key.to(torch.bfloat16).double()
    ratio = max(float(x.abs().max()), 1e-4) / 448.0
    mant, exp = math.frexp(ratio)
    scale = 2.0 ** (exp - 1 if mant == 0.5 else exp)
    y = e4m3_round(x / scale)
    negative_zero = (y == 0) & (x < 0)  # a negative value rounded to zero keeps its sign bit, as the fp8 cast does
    return (e4m3_bytes(y) | (negative_zero.to(torch.uint8) << 7)).tolist(), scale


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fp8_pages_hold_the_writers_bytes_planar(seed):
    gen = torch.Generator().manual_seed(seed)
    block_size, n = 8, 11
    keys = torch.randn(n, 128, generator=gen) * torch.logspace(-6, 3, n)[:, None]
    keys[3] = 0.0  # the amax floor
    keys[4, :5] = torch.tensor([448.0, -448.0, 2.0**-8, 3.0, 1.0]) * 2.0**-4  # exact powers on the scale
    cache = IndexerKeyCache(3, "fp8", block_size=block_size)
    cache.poison()
    slots = torch.randperm(3 * block_size, generator=gen)[:n]
    cache.write(keys, slots.int())
    raw = cache.data.view(3, -1)  # each page: [block_size x 128 codes][block_size x float32]
    for key, slot in zip(keys, slots.tolist()):
        block, off = divmod(slot, block_size)
        codes, scale = model_entry(key)
        assert raw[block, 128 * off:128 * (off + 1)].tolist() == codes
        at = 128 * block_size + 4 * off
        assert struct.unpack("<f", bytes(raw[block, at:at + 4].tolist()))[0] == scale
    back = cache.read(slots)
    expect = torch.stack([torch.tensor(model_entry(k)[0], dtype=torch.uint8).view(torch.float8_e4m3fn).double()
                          * model_entry(k)[1] for k in keys])
    assert torch.equal(back.double(), expect)


def test_unwritten_slots_stay_poisoned_and_minus_one_reads_zero():
    cache = IndexerKeyCache(2, "fp8", block_size=4)
    cache.poison()
    cache.write(torch.ones(2, 128), torch.tensor([-1, 5]))
    out = cache.read(torch.tensor([[5, -1], [0, 5]]))
    assert torch.equal(out[0, 0], torch.ones(128)) and torch.equal(out[0, 1], torch.zeros(128))
    assert torch.isnan(out[1, 0]).all()


def test_bf16_cache_rounds_to_bf16():
    cache = IndexerKeyCache(2, "bf16", block_size=4)
    keys = torch.randn(3, 128)
    cache.write(keys, torch.tensor([7, 0, 2]))
    assert torch.equal(cache.read(torch.tensor([7, 0, 2])), keys.to(torch.bfloat16).float())
    with pytest.raises(ValueError, match="fp8"):
        cache.codes()


def test_quantiser_round_trip_error_is_within_e4m3_rounding():
    keys = torch.randn(64, 128) * 3
    codes, scales = quantize_index_keys(keys)
    back = codes.view(torch.float8_e4m3fn).float() * scales[:, None]
    ref = keys.to(torch.bfloat16).float()
    assert bool(((back - ref).abs() <= ref.abs() * 2.0**-4 + scales[:, None] * 2.0**-9).all())


@pytest.mark.parametrize("call,match", [
    (lambda c: c.write(torch.ones(2, 64), torch.tensor([0, 1])), "keys must have shape"),
    (lambda c: c.write(torch.ones(2, 128), torch.tensor([0, 8])), "slots"),
    (lambda c: c.write(torch.ones(2, 128), torch.tensor([0])), "slots"),
    (lambda c: c.write(torch.ones(2, 128, dtype=torch.float64), torch.tensor([0, 1])), "keys"),
    (lambda c: c.read(torch.tensor([0.5])), "slots"),
])
def test_bad_input_is_named(call, match):
    cache = IndexerKeyCache(2, "fp8", block_size=4)
    with pytest.raises(ValueError, match=match):
        call(cache)


def test_bad_format_is_named():
    with pytest.raises(ValueError, match="fmt"):
        IndexerKeyCache(2, "fp4")
    with pytest.raises(ValueError, match="device must be a torch.device"):
        IndexerKeyCache(2, "fp8", device="bogus")


@pytest.mark.parametrize("fmt", ["fp8", "bf16"])
def test_finite_slots_tells_the_written_slots_of_a_poisoned_cache(fmt):
    """``finite_slots``: a new cache's zeros are finite keys, a poisoned one's none; after writes, exactly the written
    slots (an fp8 slot with one NaN code byte, or a NaN scale, is not finite)."""
    cache = IndexerKeyCache(3, fmt, block_size=4)
    assert cache.finite_slots().shape == (3, 4) and bool(cache.finite_slots().all())
    cache.poison()
    assert not bool(cache.finite_slots().any())
    slots = torch.tensor([0, 5, 11], dtype=torch.int32)
    cache.write(torch.randn(3, 128), slots)
    want = torch.zeros(12, dtype=torch.bool)
    want[slots.long()] = True
    assert torch.equal(cache.finite_slots().flatten(), want)
    if fmt == "fp8":
        cache.codes()[1, 1, 7] = 0xFF  # slot 5: one NaN code
        want[5] = False
        assert torch.equal(cache.finite_slots().flatten(), want)
