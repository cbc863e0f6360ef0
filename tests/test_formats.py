"""KV formats (DESIGN §2): byte offsets on hand-made values, the scale rule, e4m3 bytes, round trip,
sizes, and the checks of infer_format / resolve_cache / quantize_blocks.

Expected bytes are worked out by hand or by the independent fp8 model of tests/dense.py.
"""
from __future__ import annotations

import struct

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dense import E4M3_TABLE, e4m3_bytes, e4m3_round, fake_quant, scale_exponents
from sparse_mla.formats import (allocate_cache, block_bytes, bytes_per_token, dequantize_blocks, get_format,
                                infer_format, quantize_blocks, resolve_cache)


def storage_bytes(cache: torch.Tensor) -> torch.Tensor:
    """Every byte of the cache's allocation, flat, as uint8 (independent of the cache's shape)."""
    assert cache.device.type == "cpu"
    return torch.empty(0, dtype=torch.uint8).set_(cache.untyped_storage())


def block_raw(cache: torch.Tensor, block: int) -> torch.Tensor:
    """The bytes of one block, read from the allocation at ``block * stride(0)``."""
    flat = storage_bytes(cache)
    start = (cache.storage_offset() + block * cache.stride(0)) * cache.element_size()
    return flat[start: start + cache.stride(0) * cache.element_size()]


def f32_bytes(*values: float) -> list[int]:
    return list(struct.pack("<" + "f" * len(values), *values))


# ---------------------------------------------------------------------------------------------- sizes


@pytest.mark.parametrize("bs,expected", [(1, 1152), (2, 1728), (3, 2304), (63, 36864), (64, 37440), (72, 42048),
                                         (256, 149760)])
def test_fp8_v4_block_bytes_padded_to_576(bs, expected):
    assert expected == -(-bs * 584 // 576) * 576  # the rule, checked against the hand-made numbers
    assert block_bytes("fp8_v4", bs) == expected


@pytest.mark.parametrize("bs", [1, 2, 5, 64])
def test_unpadded_block_bytes(bs):
    assert block_bytes("fp8_v32", bs) == 656 * bs
    assert block_bytes("bf16", bs) == 1024 * bs
    assert block_bytes("bf16", bs, dim=576) == 1152 * bs


def test_bytes_per_token():
    assert bytes_per_token("fp8_v4") == 448 + 128 + 7 + 1 == 584
    assert bytes_per_token("fp8_v32") == 512 + 16 + 128 == 656
    assert bytes_per_token("bf16") == 1024 and bytes_per_token("bf16", 576) == 1152


def test_size_argument_errors():
    with pytest.raises(ValueError, match="block_size"):
        block_bytes("fp8_v4", 0)
    with pytest.raises(ValueError, match="fmt must be one of"):
        bytes_per_token("fp4")
    with pytest.raises(ValueError, match="dim"):
        bytes_per_token("bf16", 500)
    with pytest.raises(ValueError, match="num_blocks"):
        allocate_cache("fp8_v4", 0, 4)
    with pytest.raises(ValueError, match="block_size"):
        allocate_cache("bf16", 2, 0)


# ------------------------------------------------------------------------------------- e4m3 model


def test_independent_e4m3_model_agrees_with_known_bytes():
    # sanity of the test-side model itself, on values worked out by hand
    assert E4M3_TABLE[0x38] == 1.0 and E4M3_TABLE[0x7E] == 448.0 and E4M3_TABLE[0x01] == 2.0**-9
    assert E4M3_TABLE[0xB8] == -1.0 and E4M3_TABLE[0x44] == 3.0 and E4M3_TABLE[0x30] == 0.5
    assert torch.isnan(E4M3_TABLE[0x7F]) and torch.isnan(E4M3_TABLE[0xFF])
    y = torch.tensor([1.0625, 1.1875, 2.0**-10, 3 * 2.0**-11, 225.0, 447.0], dtype=torch.float64)
    assert e4m3_round(y).tolist() == [1.0, 1.25, 0.0, 2.0**-9, 224.0, 448.0]
    assert e4m3_bytes(torch.tensor([1.0, 448.0, 3.0])).tolist() == [0x38, 0x7E, 0x44]


# --------------------------------------------------------------------------------- fp8_v4 layout


def test_fp8_v4_byte_layout_on_hand_made_values():
    nb, bs = 2, 3
    kv = torch.zeros(nb, bs, 512)
    tok = kv[1, 2]  # block 1, token 2
    tok[0:5] = torch.tensor([56.0, 2.0**-3, -(2.0**-3), 3 * 2.0**-3, 2.0**-12])  # tile 0: amax 448*2^-3 -> 2^-3
    # tile 1 (64..127) stays zero -> floor 1e-4 -> 2^ceil(log2 1e-4) = 2^-13
    tok[128] = 1.0  # tile 2: amax 1 -> 2^ceil(log2(1/448)) = 2^-8; 1 / 2^-8 = 256
    tok[192:256] = 900.0  # tile 3: 900/448 -> 2^2; 900/4 = 225 -> e4m3 224
    tok[192] = -900.0
    tok[384] = 448.0  # tile 6: scale 2^0
    tok[385] = 0.5
    tok[448], tok[449], tok[511] = 0.5, 1e-3, -2.0  # rope
    kv[0, 1, 300] = 1.0  # block 0, token 1: tile 4 scale 2^-8
    kv = kv.to(torch.bfloat16)
    cache = quantize_blocks(kv, "fp8_v4")
    assert cache.dtype == torch.uint8 and cache.shape == (nb, bs, 584)
    assert cache.stride() == (2304, 584, 1)  # 3*584 = 1752 padded up to 4*576

    raw = block_raw(cache, 1)
    assert raw.numel() == 2304
    body = raw[1152:1728]  # token 2's body at 2 * 576
    nope = body[:448]
    assert nope[:5].tolist() == [0x7E, 0x38, 0xB8, 0x44, 0x01]
    assert (nope[5:128] == 0).all()
    assert nope[128] == 0x78  # 256 = 2^8: exponent field 15, mantissa 0
    assert nope[192] == 0xF6 and (nope[193:256] == 0x76).all()  # -224 / 224
    assert nope[384] == 0x7E and nope[385] == 0x30
    assert torch.equal(body[448:576], kv[1, 2, 448:].contiguous().view(torch.uint8))  # rope: raw bf16 bytes
    scales = raw[1728 + 16: 1728 + 24]  # token 2's scales at bs*576 + 2*8
    assert scales.tolist() == [127 - 3, 127 - 13, 127 - 8, 127 + 2, 127 - 13, 127 - 13, 127 + 0, 0]
    # the other tokens of block 1 are zeros with floor scales
    assert (raw[:1152] == 0).all()
    assert raw[1728:1744].tolist() == ([114] * 7 + [0]) * 2

    raw0 = block_raw(cache, 0)
    assert raw0[576 + 300] == 0x78  # token 1 body at 576
    assert (raw0[:576 + 300] == 0).all() and (raw0[576 + 301:1728] == 0).all()
    assert raw0[1728 + 8: 1728 + 16].tolist() == [114, 114, 114, 114, 127 - 8, 114, 114, 0]

    # and the library reads back exactly the hand-made dequantised values
    back = dequantize_blocks(cache).double()[1, 2]
    assert back[:5].tolist() == [56.0, 2.0**-3, -(2.0**-3), 3 * 2.0**-3, 2.0**-12]
    assert back[192] == -896.0 and back[193] == 896.0 and back[384] == 448.0
    assert back[449] == kv[1, 2, 449].double()


def test_fp8_v32_byte_layout_on_hand_made_values():
    kv = torch.zeros(2, 2, 576)
    tok = kv[1, 1]
    tok[0] = 3.0  # tile 0: amax 3 -> 2^ceil(log2(3/448)) = 2^-7; 3 / 2^-7 = 384
    # tile 1 zero -> 2^-13
    tok[256], tok[257] = 448.0, 1.0  # tile 2: scale 1
    tok[384] = 1e-3  # tile 3: 1e-3/448 < 1e-4 -> floor -> 2^-13; bf16(1e-3) * 2^13 = 8.19 -> 8
    tok[512], tok[575] = 1.5, -0.25  # rope
    kv = kv.to(torch.bfloat16)
    cache = quantize_blocks(kv, "fp8_v32")
    assert cache.shape == (2, 2, 656) and cache.stride() == (1312, 656, 1)
    raw = block_raw(cache, 1)[656:1312]  # token 1 at 1 * 656
    assert raw[0] == 0x7C  # 384 = 1.5 * 2^8
    assert raw[256] == 0x7E and raw[257] == 0x38 and raw[384] == 0x50  # 8 = 2^3
    assert int((raw[:512] != 0).sum()) == 4
    assert raw[512:528].tolist() == f32_bytes(2.0**-7, 2.0**-13, 1.0, 2.0**-13)
    assert torch.equal(raw[528:656], kv[1, 1, 512:].contiguous().view(torch.uint8))
    zero_tok = block_raw(cache, 0)[:656]
    assert (zero_tok[:512] == 0).all() and zero_tok[512:528].tolist() == f32_bytes(*[2.0**-13] * 4)


def test_bf16_layout_is_plain():
    kv = torch.randn(3, 4, 576).to(torch.bfloat16)
    cache = quantize_blocks(kv, "bf16")
    assert cache.dtype == torch.bfloat16 and cache.shape == (3, 4, 576) and torch.equal(cache, kv)
    assert cache.data_ptr() != kv.data_ptr()


# ------------------------------------------------------------------------------ scale rule, round trip


@given(fmt=st.sampled_from(["fp8_v4", "fp8_v32"]), nb=st.integers(1, 3), bs=st.integers(1, 5),
       log_mag=st.integers(-24, 24), spread=st.integers(0, 12), zero_frac=st.sampled_from([0.0, 0.3]),
       seed=st.integers(0, 2**31 - 1))
def test_bytes_and_values_match_the_independent_model(fmt, nb, bs, log_mag, spread, zero_frac, seed):
    """Scale bytes, e4m3 bytes and dequantised values equal the float64 model, tile by tile."""
    gen = torch.Generator().manual_seed(seed)
    dim, nope, tile = (512, 448, 64) if fmt == "fp8_v4" else (576, 512, 128)
    n = nb * bs
    x = torch.randn(n, dim, generator=gen, dtype=torch.float64)
    tiles = nope // tile
    # each tile gets its own magnitude, some tiles are all zero, some values hit exact powers of two
    mags = torch.exp2(log_mag + torch.randint(-spread, spread + 1, (n, tiles), generator=gen).double())
    x[:, :nope] = (x[:, :nope].view(n, tiles, tile) * mags[..., None]).view(n, nope)
    x[:, :nope].view(n, tiles, tile)[torch.rand(n, tiles, generator=gen) < zero_frac] = 0.0
    x[0, 0] = 448.0 * 2.0**log_mag  # amax exactly on a power-of-two boundary
    kv = x.to(torch.bfloat16)
    cache = quantize_blocks(kv.view(nb, bs, dim), fmt)

    exps = scale_exponents(kv[:, :nope].double(), tile)  # (n, tiles)
    scale = torch.exp2(exps.double())
    q_model = e4m3_round(kv[:, :nope].double().view(n, tiles, tile) / scale[..., None]).view(n, nope)
    for b in range(nb):
        raw = block_raw(cache, b)
        for t in range(bs):
            i = b * bs + t
            if fmt == "fp8_v4":
                nope_b, rope_b = raw[t * 576: t * 576 + 448], raw[t * 576 + 448: t * 576 + 576]
                sc = raw[bs * 576 + t * 8: bs * 576 + t * 8 + 8]
                assert sc.tolist() == (exps[i] + 127).tolist() + [0]
            else:
                rec = raw[t * 656: (t + 1) * 656]
                nope_b, rope_b = rec[:512], rec[528:]
                assert rec[512:528].tolist() == f32_bytes(*scale[i].tolist())
            assert torch.equal(E4M3_TABLE[nope_b.long()], q_model[i]), f"token {i}"
            assert torch.equal(rope_b, kv[i, nope:].contiguous().view(torch.uint8))

    back = dequantize_blocks(cache).double().view(n, dim)
    assert torch.equal(back, fake_quant(kv, fmt))
    # the error bound: half an e4m3 ulp (2^-4 of the value), or half the subnormal step (2^-10 · scale)
    err = (back[:, :nope] - kv[:, :nope].double()).view(n, tiles, tile).abs()
    bound = torch.maximum(kv[:, :nope].double().view(n, tiles, tile).abs() * 2.0**-4, scale[..., None] * 2.0**-10)
    assert bool((err <= bound).all())
    assert torch.equal(back[:, nope:], kv[:, nope:].double()), "rope dims are exact"


def test_all_zero_tile_gets_the_floor_exponent():
    for fmt, nope, tile in (("fp8_v4", 448, 64), ("fp8_v32", 512, 128)):
        kv = torch.zeros(1, 1, 576 if fmt == "fp8_v32" else 512, dtype=torch.bfloat16)
        raw = block_raw(quantize_blocks(kv, fmt), 0)
        if fmt == "fp8_v4":
            assert raw[576:583].tolist() == [127 - 13] * 7
        else:
            assert raw[512:528].tolist() == f32_bytes(*[2.0**-13] * 4)
        assert (dequantize_blocks(quantize_blocks(kv, fmt)) == 0).all()


def test_extreme_magnitudes_round_trip():
    # the largest and smallest normal bf16 magnitudes in one token, in different tiles
    kv = torch.zeros(1, 2, 512)
    kv[0, 0, 0] = 3.0e38
    kv[0, 0, 64] = -1.2e-38
    kv[0, 1, 100] = 1e-30
    kv = kv.to(torch.bfloat16)
    back = dequantize_blocks(quantize_blocks(kv, "fp8_v4")).double()
    assert torch.equal(back, fake_quant(kv.view(2, 512), "fp8_v4").view(1, 2, 512))
    assert back[0, 0, 0] / kv[0, 0, 0].double() == pytest.approx(1, rel=2**-4)


@pytest.mark.parametrize("fmt", ["fp8_v4", "fp8_v32", "bf16"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_input_rejected(fmt, bad):
    kv = torch.zeros(1, 2, 576 if fmt == "fp8_v32" else 512, dtype=torch.bfloat16)
    kv[0, 1, 500] = bad  # a rope dim in fp8_v4 / fp8_v32's rope range is checked too
    with pytest.raises(ValueError, match="kv must be finite"):
        quantize_blocks(kv, fmt)


# --------------------------------------------------------------------------- allocation and views


@pytest.mark.parametrize("fmt,dim,bs", [("fp8_v4", 512, 64), ("fp8_v4", 512, 3), ("fp8_v32", 576, 5),
                                        ("bf16", 512, 4), ("bf16", 576, 2)])
def test_quantize_blocks_is_one_allocation_with_block_stride(fmt, dim, bs):
    nb = 3
    cache = quantize_blocks(torch.randn(nb, bs, dim).to(torch.bfloat16), fmt)
    bb = block_bytes(fmt, bs, dim)
    assert cache.stride(0) * cache.element_size() == bb
    assert cache.storage_offset() == 0
    assert cache.untyped_storage().nbytes() == nb * bb  # one buffer holding every block, padding included
    assert cache.shape == (nb, bs, bytes_per_token(fmt, dim) // cache.element_size())


def test_infer_format():
    assert infer_format(allocate_cache("fp8_v4", 1, 2)).name == "fp8_v4"
    assert infer_format(allocate_cache("fp8_v32", 1, 2)).name == "fp8_v32"
    f = infer_format(torch.zeros(1, 2, 576, dtype=torch.bfloat16))
    assert (f.name, f.dim) == ("bf16", 576)


@pytest.mark.parametrize("cache,fmt,match", [
    (torch.zeros(1, 2, 584), None, "my_cache must have dtype"),
    (torch.zeros(1, 2, 512, dtype=torch.float16), None, "my_cache must have dtype"),
    (torch.zeros(1, 2, 600, dtype=torch.uint8), None, "my_cache .*600.*584 .*656"),
    (torch.zeros(1, 2, 600, dtype=torch.bfloat16), None, "my_cache"),
    (torch.zeros(2, 584, dtype=torch.uint8), None, "my_cache must be 3-D"),
    (torch.zeros((), dtype=torch.uint8), None, "my_cache"),
    (torch.zeros(1, 2, 2, 584, dtype=torch.uint8), None, "my_cache"),
    (allocate_cache("fp8_v4", 2, 4), "fp8_v32", "my_cache holds fp8_v4 .* but fmt is 'fp8_v32'"),
    (allocate_cache("fp8_v4", 2, 4), "bf16", "my_cache holds fp8_v4"),
    (allocate_cache("fp8_v32", 2, 4), "fp8_v4", "my_cache holds fp8_v32"),
    (torch.zeros(2, 4, 512, dtype=torch.bfloat16), "fp8_v4", "my_cache holds bf16"),
    (torch.zeros(2, 4, 576, dtype=torch.bfloat16), get_format("bf16", 512), "my_cache holds bf16"),
    (torch.zeros(2, 4, 512, dtype=torch.bfloat16), "fp4", "fmt must be one of"),
    # fp8_v4 blocks are padded: a plain contiguous (2, 4, 584) tensor has blocks too close together
    (torch.zeros(2, 4, 584, dtype=torch.uint8), None, "my_cache stride"),
    (torch.zeros(2, 584, 4, dtype=torch.uint8).transpose(1, 2), None, "my_cache must have contiguous tokens"),
])
def test_resolve_cache_errors_name_the_argument(cache, fmt, match):
    with pytest.raises(ValueError, match=match):
        resolve_cache(cache, fmt, name="my_cache")


def test_resolve_cache_accepts_matching_fmt_and_larger_block_stride():
    cache = allocate_cache("fp8_v4", 2, 4)
    same, f = resolve_cache(cache, "fp8_v4")
    assert f.name == "fp8_v4" and same.data_ptr() == cache.data_ptr()
    # contiguous (nb, bs, 584) is fine when bs*584 happens to be a multiple of 576 (bs = 72)
    assert resolve_cache(torch.zeros(2, 72, 584, dtype=torch.uint8))[1].name == "fp8_v4"
    # a single block needs no padding after it
    assert resolve_cache(torch.zeros(1, 4, 584, dtype=torch.uint8))[1].name == "fp8_v4"


def test_flashmla_4d_forms_accepted():
    nb, bs = 3, 5
    kv = torch.randn(nb, bs, 512).to(torch.bfloat16)
    ours = quantize_blocks(kv, "fp8_v4")
    same, fmt = resolve_cache(ours.unsqueeze(2))
    assert fmt.name == "fp8_v4" and same.shape == ours.shape and same.data_ptr() == ours.data_ptr()
    assert torch.equal(dequantize_blocks(ours.unsqueeze(2)), dequantize_blocks(ours))

    # built the way FlashMLA's tests build MODEL1 caches: (nb, padded)[:, :bs*584].view(nb, bs, 1, 584)
    padded = -(-bs * 584 // 576) * 576
    flat = torch.full((nb, padded), 0xAB, dtype=torch.uint8)
    for b in range(nb):
        flat[b, : bs * 584] = block_raw(ours, b)[: bs * 584]
    theirs = flat[:, : bs * 584].view(nb, bs, 1, 584)
    assert torch.equal(dequantize_blocks(theirs), dequantize_blocks(ours))

    # FlashMLA's V3.2 caches are (nb, bs+1, 656)[:, :bs]: a block stride larger than the block
    kv32 = torch.randn(nb, bs, 576).to(torch.bfloat16)
    ours32 = quantize_blocks(kv32, "fp8_v32")
    big = torch.full((nb, bs + 1, 656), 0xFF, dtype=torch.uint8)
    big[:, :bs] = ours32
    assert torch.equal(dequantize_blocks(big[:, :bs].unsqueeze(2)), dequantize_blocks(ours32))
    assert torch.equal(dequantize_blocks(ours32).double().view(-1, 576), fake_quant(kv32.view(-1, 576), "fp8_v32"))


def test_quantize_blocks_input_checks_name_kv():
    with pytest.raises(ValueError, match="kv must have dtype"):
        quantize_blocks(torch.zeros(1, 2, 512), "fp8_v4")
    with pytest.raises(ValueError, match="kv must be 3-D"):
        quantize_blocks(torch.zeros(2, 512, dtype=torch.bfloat16), "fp8_v4")
    with pytest.raises(ValueError, match="kv must have shape"):
        quantize_blocks(torch.zeros(1, 2, 576, dtype=torch.bfloat16), "fp8_v4")
    with pytest.raises(ValueError, match="kv must have shape"):
        quantize_blocks(torch.zeros(1, 2, 512, dtype=torch.bfloat16), "fp8_v32")
    with pytest.raises(ValueError, match=r"kv must hold at least one block of at least one token, got shape \(0, 64"):
        quantize_blocks(torch.zeros(0, 64, 512, dtype=torch.bfloat16), "fp8_v4")
    with pytest.raises(ValueError, match="fmt must be one of"):
        quantize_blocks(torch.zeros(1, 2, 512, dtype=torch.bfloat16), "fp4")
    with pytest.raises(TypeError, match="kv must be a torch.Tensor"):
        quantize_blocks([[0.0]], "fp8_v4")
