"""KV formats: byte layout on hand-made values, scale rule, round-trip bound, input checks."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparse_mla.formats import (allocate_cache, block_bytes, bytes_per_token, dequantize_blocks, quantize_blocks,
                                resolve_cache)


def test_sizes():
    assert bytes_per_token("fp8_v4") == 584
    assert bytes_per_token("fp8_v32") == 656
    assert bytes_per_token("bf16") == 1024 and bytes_per_token("bf16", 576) == 1152
    for bs in (1, 2, 64, 256):
        assert block_bytes("fp8_v4", bs) == math.ceil(bs * 584 / 576) * 576
        assert block_bytes("fp8_v4", bs) % 576 == 0 and block_bytes("fp8_v4", bs) >= bs * 584
    assert block_bytes("fp8_v4", 64) == 37440
    assert block_bytes("fp8_v32", 64) == 64 * 656


def block_bytes_of(cache: torch.Tensor, block: int) -> torch.Tensor:
    """The raw bytes of one block of a paged cache, read through its storage (not the 584-wide view)."""
    return torch.as_strided(cache, (cache.stride(0),), (1,), cache.storage_offset() + block * cache.stride(0))


def test_fp8_v4_byte_layout_on_hand_made_values():
    bs = 3
    kv = torch.zeros(2, bs, 512)
    # block 1, token 2: nope tile 0 holds 1.0 (amax 1 -> scale 2^ceil(log2(1/448)) = 2^-8), tile 1 holds
    # 448 * 2^-3 (scale exactly 2^-3), the rest zero (scale floor 1e-4 -> 2^-13); rope = 0.5, -2
    kv[1, 2, 0:64] = 1.0
    kv[1, 2, 64] = 448 * 2.0**-3
    kv[1, 2, 448] = 0.5
    kv[1, 2, 511] = -2.0
    cache = quantize_blocks(kv.to(torch.bfloat16), "fp8_v4")
    assert cache.shape == (2, bs, 584) and cache.stride() == (block_bytes("fp8_v4", bs), 584, 1)
    raw = block_bytes_of(cache, 1)
    body = raw[2 * 576: 3 * 576]
    assert body[0] == torch.tensor(256.0).to(torch.float8_e4m3fn).view(torch.uint8)  # 1.0 / 2^-8
    assert body[64] == torch.tensor(448.0).to(torch.float8_e4m3fn).view(torch.uint8)
    assert (body[65:448] == 0).all()
    rope = body[448:576].view(torch.bfloat16)
    assert rope[0] == 0.5 and rope[63] == -2.0 and (rope[1:63] == 0).all()
    scales = raw[bs * 576 + 2 * 8: bs * 576 + 3 * 8]
    assert scales.tolist() == [127 - 8, 127 - 3, 127 - 13, 127 - 13, 127 - 13, 127 - 13, 127 - 13, 0]
    # every other token of both blocks is all-zero data with floor scales
    assert (block_bytes_of(cache, 0)[: bs * 576] == 0).all()
    assert block_bytes_of(cache, 0)[bs * 576: bs * 576 + 8].tolist() == [114] * 7 + [0]


def test_fp8_v32_byte_layout_on_hand_made_values():
    kv = torch.zeros(1, 2, 576)
    kv[0, 1, 0] = 3.0  # tile 0 amax 3 -> scale 2^ceil(log2(3/448)) = 2^-7
    kv[0, 1, 130] = 448.0  # tile 1 -> scale 1
    kv[0, 1, 512] = 1.5  # rope
    cache = quantize_blocks(kv.to(torch.bfloat16), "fp8_v32")
    tok = cache[0, 1]
    assert tok[0] == torch.tensor(384.0).to(torch.float8_e4m3fn).view(torch.uint8)
    assert tok[130] == torch.tensor(448.0).to(torch.float8_e4m3fn).view(torch.uint8)
    assert tok[512:528].view(torch.float32).tolist() == [2.0**-7, 1.0, 2.0**-13, 2.0**-13]
    assert tok[528:656].view(torch.bfloat16)[0] == 1.5


@settings(max_examples=30, deadline=None)
@given(fmt=st.sampled_from(["fp8_v4", "fp8_v32", "bf16"]), nb=st.integers(1, 3), bs=st.integers(1, 9),
       log_mag=st.floats(-6, 6), seed=st.integers(0, 2**31 - 1))
def test_round_trip_error_bound(fmt, nb, bs, log_mag, seed):
    dim = 576 if fmt == "fp8_v32" else 512
    kv = (torch.randn(nb, bs, dim, generator=torch.Generator().manual_seed(seed)) * 2.0**log_mag).to(torch.bfloat16)
    back = dequantize_blocks(quantize_blocks(kv, fmt)).float()
    x = kv.float()
    if fmt == "bf16":
        assert torch.equal(back, x)
        return
    nope = 448 if fmt == "fp8_v4" else 512
    tile = 64 if fmt == "fp8_v4" else 128
    assert torch.equal(back[..., nope:], x[..., nope:]), "rope dims are stored exactly"
    tiles = x[..., :nope].reshape(nb, bs, -1, tile)
    scale = torch.exp2(torch.ceil(torch.log2(torch.clamp_min(tiles.abs().amax(-1) / 448, 1e-4))))
    err = (back[..., :nope].reshape(tiles.shape) - tiles).abs()
    # e4m3 keeps 3 mantissa bits: half an ulp is 2^-4 of the value, and subnormals step by 2^-9 * scale
    bound = torch.maximum(tiles.abs() * 2.0**-4, scale[..., None] * 2.0**-10)
    assert (err <= bound * 1.0001).all()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_input_rejected(bad):
    kv = torch.zeros(1, 2, 512, dtype=torch.bfloat16)
    kv[0, 1, 7] = bad
    with pytest.raises(ValueError, match="kv must be finite"):
        quantize_blocks(kv, "fp8_v4")


def test_input_checks_name_the_argument():
    with pytest.raises(ValueError, match="kv must have dtype"):
        quantize_blocks(torch.zeros(1, 2, 512), "fp8_v4")
    with pytest.raises(ValueError, match="kv must have shape"):
        quantize_blocks(torch.zeros(1, 2, 500, dtype=torch.bfloat16), "fp8_v4")
    with pytest.raises(ValueError, match="fmt must be one of"):
        quantize_blocks(torch.zeros(1, 2, 512, dtype=torch.bfloat16), "fp4")
    with pytest.raises(ValueError, match="584 .*656"):
        resolve_cache(torch.zeros(1, 2, 600, dtype=torch.uint8))
    with pytest.raises(ValueError, match="holds fp8_v4 .* but fmt is 'fp8_v32'"):
        resolve_cache(allocate_cache("fp8_v4", 1, 4), "fp8_v32")
    with pytest.raises(ValueError, match="stride"):
        resolve_cache(torch.zeros(2, 4, 584, dtype=torch.uint8)[:, :, :].as_strided((2, 4, 584), (584, 584, 1)))


def test_flashmla_4d_view_accepted():
    cache = quantize_blocks(torch.randn(2, 4, 512).to(torch.bfloat16), "fp8_v4")
    same, fmt = resolve_cache(cache.unsqueeze(2))
    assert fmt.name == "fp8_v4" and same.shape == cache.shape and same.data_ptr() == cache.data_ptr()
