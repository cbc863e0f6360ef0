"""Triton insert / gather kernels are bit-identical to the reference formats (V4.1: also test_v41_kernels.py)."""
from __future__ import annotations

import pytest
import torch

from helpers import DEVICE
from sparse_mla.formats import allocate_cache
from sparse_mla.ops import dequantize_and_gather, quantize_and_insert

FORMATS = [("fp8_v4", 512), ("fp8_v32", 576), ("bf16", 512), ("bf16", 576), ("fp8_v41", 512), ("fp8_v41_planar", 512),
           ("fp4_v41", 512), ("fp4_v41_planar", 512)]


def storage(cache: torch.Tensor) -> torch.Tensor:
    nbytes = cache.untyped_storage().nbytes()
    return torch.frombuffer(bytearray(cache.cpu().untyped_storage()), dtype=torch.uint8)[:nbytes]


def hard_values(gen, n, dim):
    """Random rows at many magnitudes, plus tiles whose amax/448 is exactly a power of two, zeros, tiny values."""
    x = torch.randn(n, dim, generator=gen) * torch.exp2(torch.randint(-20, 12, (n, 1), generator=gen).float())
    x[0] = 0.0
    x[1, :64] = 448 * 2.0**-5
    x[2, 64:128] = torch.linspace(-1e-7, 1e-7, 64)
    x[3] = 448 * 2.0**-5 * (1 + 2.0**-7)
    return x.to(torch.bfloat16)


@pytest.mark.parametrize("fmt,dim", FORMATS)
@pytest.mark.parametrize("block_size", [1, 3, 64])
def test_insert_is_bit_identical_to_reference(fmt, dim, block_size):
    gen = torch.Generator().manual_seed(block_size + dim)
    num_blocks = max(3, 12 // block_size)
    n = min(9, num_blocks * block_size)
    kv = hard_values(gen, n, dim).to(DEVICE)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:n].int().to(DEVICE)
    slots[-1] = -1
    a = allocate_cache(fmt, num_blocks, block_size, DEVICE, dim)
    b = allocate_cache(fmt, num_blocks, block_size, DEVICE, dim)
    quantize_and_insert(kv, a, slots, fmt, backend="reference")
    quantize_and_insert(kv, b, slots, fmt, backend="triton")
    assert torch.equal(storage(a), storage(b))
    idx = torch.cat([slots, torch.tensor([-1], dtype=torch.int32, device=DEVICE)]).view(2, -1)
    ref = dequantize_and_gather(a, idx, fmt, backend="reference")
    got = dequantize_and_gather(a, idx, fmt, backend="triton")
    assert torch.equal(ref.view(torch.int16), got.view(torch.int16))


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("fmt,dim", [("fp8_v32", 576), ("bf16", 512)])
def test_gather_into_out_writes_those_rows_only(fmt, dim, backend):
    gen = torch.Generator().manual_seed(dim)
    cache = allocate_cache(fmt, 3, 4, DEVICE, dim)
    quantize_and_insert(hard_values(gen, 12, dim).to(DEVICE), cache, torch.arange(12, device=DEVICE))
    slots = torch.tensor([[7, -1, 0], [11, 3, 3]], dtype=torch.int32, device=DEVICE)
    want = dequantize_and_gather(cache, slots, backend=backend)
    workspace = torch.full((9, dim), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    got = dequantize_and_gather(cache, slots.view(-1), backend=backend, out=workspace[2:8])
    assert got.data_ptr() == workspace[2].data_ptr()
    assert torch.equal(workspace[2:8].view(torch.int16), want.view(-1, dim).view(torch.int16))
    assert workspace[:2].isnan().all() and workspace[8:].isnan().all(), "nothing written outside out"


def test_gather_into_out_checks_it():
    cache = allocate_cache("bf16", 2, 4, DEVICE)
    slots = torch.tensor([0, 5], dtype=torch.int32, device=DEVICE)
    ws = torch.empty(4, 512, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="^out must have shape"):
        dequantize_and_gather(cache, slots, out=ws)
    with pytest.raises(ValueError, match="^out must have dtype"):
        dequantize_and_gather(cache, slots, out=ws[:2].float())
    with pytest.raises(ValueError, match="^out must be contiguous"):
        dequantize_and_gather(cache, slots, out=ws.view(2, 1024)[:, :512])
    with pytest.raises(ValueError, match="^out overlaps cache"):
        dequantize_and_gather(cache, slots, out=cache.view(8, 512)[6:])


def test_out_of_range_slots_are_skipped_or_rejected(monkeypatch):
    kv = torch.ones(2, 512, dtype=torch.bfloat16, device=DEVICE)
    cache = allocate_cache("fp8_v4", 1, 4, DEVICE)
    before = storage(cache).clone()
    monkeypatch.delenv("SPARSE_MLA_DEBUG", raising=False)
    quantize_and_insert(kv, cache, torch.tensor([4, 10**6], dtype=torch.int32, device=DEVICE), backend="triton")
    assert torch.equal(storage(cache), before), "nothing written outside the cache"
    assert (dequantize_and_gather(cache, torch.tensor([7, 10**6], device=DEVICE), backend="triton") == 0).all()
    monkeypatch.setenv("SPARSE_MLA_DEBUG", "1")
    with pytest.raises(ValueError, match="slot_mapping holds 4"):
        quantize_and_insert(kv, cache, torch.tensor([4, 0], dtype=torch.int32, device=DEVICE), backend="triton")
    with pytest.raises(ValueError, match="slot_mapping holds slot 2 more than once"):  # rows racing for one slot
        quantize_and_insert(kv, cache, torch.tensor([2, 2], dtype=torch.int32, device=DEVICE), backend="triton")


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_insert_with_strided_slot_mapping_and_rows_writes_the_named_slots(backend):
    gen = torch.Generator().manual_seed(5)
    kv = hard_values(gen, 4, 1024).to(DEVICE)[:, ::2]  # rows with a stride in the last dim
    slots = torch.tensor([3, 0, 5, 1, 7, 2, 9, 4], dtype=torch.int32, device=DEVICE)[::2]  # 3, 5, 7, 9
    a = allocate_cache("fp8_v4", 3, 4, DEVICE)
    b = allocate_cache("fp8_v4", 3, 4, DEVICE)
    quantize_and_insert(kv, a, slots, backend=backend)
    quantize_and_insert(kv.contiguous(), b, slots.contiguous(), backend="reference")
    assert torch.equal(storage(a), storage(b))


def test_insert_into_memory_it_reads_is_rejected():
    cache = allocate_cache("bf16", 2, 4, DEVICE)
    with pytest.raises(ValueError, match="cache overlaps kv_new"):
        quantize_and_insert(cache.view(-1, 512)[:2], cache, torch.tensor([4, 5], dtype=torch.int32, device=DEVICE))


@pytest.mark.parametrize("fmt,dim,kv_scale", [("fp8_v4", 512, None), ("fp8_v32", 576, None),
                                            ("fp8_e4m3", 512, 2.0 ** -6), ("fp8_e4m3", 512, 0.0173),
                                            ("fp8_v41_planar", 512, None), ("fp4_v41", 512, None)])
def test_gather_decodes_fp8_alike_with_or_without_fp8_instructions(fmt, dim, kv_scale):
    """The gather kernel's fp8 reads by integer operations (CUDA < 8.9, AMD) give the bits of its reads by conversion
    instructions, and the reference's (slot -1: zeros) where that is exact (an fp8_e4m3 ``kv_scale`` that is not a
    power of two rounds its product once in float32 there, the reference otherwise)."""
    from sparse_mla.formats import get_format
    from sparse_mla.ops.triton import cache as triton_cache

    gen = torch.Generator().manual_seed(dim + (kv_scale is not None))
    scale = None if kv_scale is None else torch.tensor([kv_scale], device=DEVICE)
    cache = allocate_cache(fmt, 3, 4, DEVICE, dim)
    quantize_and_insert(hard_values(gen, 12, dim).to(DEVICE), cache, torch.arange(12, device=DEVICE), fmt,
                        kv_scale=scale)
    slots = torch.tensor([7, -1, 0, 11, 3, 5], dtype=torch.int32, device=DEVICE)
    raw = cache.view(torch.uint8)  # as the ops pass it (validate.as_paged)
    integer, native = (triton_cache.dequantize_and_gather(raw, get_format(fmt, dim), scale, slots, native_fp8=n)
                       for n in (False, True))
    assert torch.equal(integer.view(torch.int16), native.view(torch.int16))
    want = dequantize_and_gather(cache, slots, fmt, backend="reference", kv_scale=scale)
    if kv_scale in (None, 2.0 ** -6):
        assert torch.equal(integer.view(torch.int16), want.view(torch.int16))
    else:
        assert torch.allclose(integer.float(), want.float(), rtol=2.0 ** -7, atol=0)  # within a bf16 rounding


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the interpreter's 256 · 2^120
@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("fmt,dim", [("fp8_v4", 512), ("fp8_v32", 576), ("fp8_v41", 512)])
def test_fp8_saturation_reads_back_as_inf(backend, fmt, dim):
    """FlashMLA's rule on a tile of amax > 448 · 2^119: scale 2^120, and ``|x| >= 248 · 2^120`` (FP8_TILE_INF_FROM)
    gives x / 2^120 >= 248, which e4m3 rounds to 256: the cache reads ±inf back (docs/formats.md), in every tiled fp8
    format; just below the bound, and beside it in the same tile, values read back exactly."""
    from sparse_mla.formats import FP8_TILE_INF_FROM, encode_records, get_format

    big = torch.tensor(FP8_TILE_INF_FROM, dtype=torch.bfloat16)
    assert big.item() == FP8_TILE_INF_FROM == 1.9375 * 2.0**127  # a bf16 value: the smallest that saturates
    below = torch.tensor(1.875 * 2.0**127, dtype=torch.bfloat16)  # 240 · 2^120: the largest e4m3 code below 256
    kv = torch.zeros(3, dim, dtype=torch.bfloat16)
    kv[0, 0], kv[0, 1], kv[0, 2] = big, -torch.finfo(torch.bfloat16).max, 1.0
    kv[1, 0], kv[1, 1] = below, -below
    kv[2, 0] = 247 * 2.0**120  # the bf16 value just below (bf16's step there is 2^120)
    cache = allocate_cache(fmt, 1, 4, DEVICE, dim)
    slots = torch.arange(3, dtype=torch.int32, device=DEVICE)
    quantize_and_insert(kv.to(DEVICE), cache, slots, fmt, backend=backend)
    back = dequantize_and_gather(cache, slots.view(1, 3), fmt, backend=backend)[0].float().cpu()
    assert back[0, 0] == float("inf") and back[0, 1] == -float("inf")
    assert back[0, 2] == 0  # 1.0 / 2^120 is below e4m3's smallest subnormal: the rest of the tile reads 0
    assert back[1, 0] == below.float() and back[1, 1] == -below.float()
    assert back[2, 0] == 1.875 * 2.0**127  # 247 rounds to 240
    f = get_format(fmt)
    record = encode_records(kv[:1], f)[0]  # the first tile's scale: ue8m0 127 + 120, or fp8_v32's float32 2^120
    scale = record[f.scale_offset: f.scale_offset + 4].view(torch.float32).item() if fmt == "fp8_v32" else \
        record[f.scale_offset].item()
    assert scale == (2.0**120 if fmt == "fp8_v32" else 247)
