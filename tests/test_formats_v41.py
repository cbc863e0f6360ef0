"""DeepSeek-V4.1 cache formats (docs/design.md §2, docs/formats.md): fp8_v41 (528 B) and fp4_v41 (288 B), each
token-interleaved and page-planar.

Expected bytes come from hand-worked values and from an independent model written here from the quoted rules
(float64 math, the e4m3 / e2m1 grids from their bit definitions, round-half-to-even by an explicit nearest-value
search, pages assembled byte by byte), never from the library's quantisers:

* fp8: ``scale_t = 2^ceil(log2(max(amax_t / 448, 1e-4)))`` per 32 dims, stored as ue8m0 ``127 + log2(scale)``;
  ``q = e4m3(x / scale_t)``, nearest even; a NaN tile: scale ``0xFF``, every code ``0x7F``.
* fp4: ``scale_g = e4m3(clamp(amax_g / 6, 2^-9, 448))`` per 16 dims; codes the nearest e2m1 value of
  ``x / scale_g`` (ties to the even code), saturating at ±6, sign bit kept for -0; a NaN tile: scale ``0x7F``
  (NaN), codes 0.
"""
from __future__ import annotations

import math

import pytest
import torch

from dense import E4M3_TABLE, dense_attention
from test_formats import block_raw
from sparse_mla.cache import PagedCache
from sparse_mla.cache_views import resolve_cache_once
from sparse_mla.formats import (FORMAT_NAMES, allocate_cache, as_paged, block_bytes, bytes_per_token,
                                dequantize_blocks, get_format, infer_format, page_fields, quantize_blocks,
                                resolve_cache, write_tokens)
from sparse_mla.ops import dequantize_and_gather, quantize_and_insert, sparse_attention_decode

V41 = ["fp8_v41", "fp8_v41_planar", "fp4_v41", "fp4_v41_planar"]
KINDS = ["random", "ties", "subnormal", "saturating", "all_zero", "nan"]
E4M3_GRID = E4M3_TABLE[:0x7F]  # the non-negative finite e4m3 values; index = byte, ascending
E2M1_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)  # index = code


# ------------------------------------------------------------------------------ the independent model


def nearest_even(a: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """Index of the grid value nearest each ``a >= 0`` (float64), a tie going to the even index (the even
    mantissa / code); beyond the grid, its last index (saturation). ``(N,)`` -> ``(N,)`` int64."""
    dist = (a.reshape(-1, 1) - grid[None, :]).abs()
    nearest = dist == dist.min(dim=1, keepdim=True).values
    even = torch.arange(grid.numel()) % 2 == 0
    return (nearest.long() * (1 + even.long())).argmax(dim=1).view(a.shape)  # a tie: the even one scores 2


def model_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One token ``x (512,)`` float64 -> (e4m3 bytes (512,), ue8m0 bytes (16,), dequantised values (512,))."""
    tiles = x.view(16, 32)
    nan = tiles.isnan().any(1)
    ratio = torch.clamp_min(tiles.abs().amax(1) / 448.0, 1e-4)
    k = torch.ceil(torch.log2(ratio))  # then made exact: the least k with 2^k >= ratio
    k = torch.where(torch.exp2(k - 1) >= ratio, k - 1, k)
    k = torch.where(torch.exp2(k) < ratio, k + 1, k)
    q = tiles / torch.exp2(k)[:, None]
    idx = nearest_even(q.abs().nan_to_num(), E4M3_GRID)
    codes = torch.where(nan[:, None], 0x7F, idx | torch.signbit(q).long() << 7)
    scales = torch.where(nan, 0xFF, 127 + k.nan_to_num().long())
    values = torch.where(torch.signbit(q), -1.0, 1.0) * E4M3_GRID[idx] * torch.exp2(k)[:, None]
    return codes.view(512), scales, torch.where(nan[:, None], math.nan, values).view(512)


def model_fp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One token ``x (512,)`` float64 -> (e2m1 codes (512,) in [0, 16), e4m3 scale bytes (32,), values (512,))."""
    tiles = x.view(32, 16)
    nan = tiles.isnan().any(1)
    wanted = torch.clamp(tiles.abs().amax(1) / 6.0, 2.0**-9, 448.0)
    scale_bytes = nearest_even(wanted.nan_to_num(), E4M3_GRID)
    scale = E4M3_GRID[scale_bytes]
    y = tiles / scale[:, None]
    idx = nearest_even(y.abs().nan_to_num(), E2M1_GRID)
    codes = torch.where(nan[:, None], 0, idx | torch.signbit(y).long() << 3)
    values = torch.where(torch.signbit(y), -1.0, 1.0) * E2M1_GRID[idx] * scale[:, None]
    return codes.view(512), torch.where(nan, 0x7F, scale_bytes), torch.where(nan[:, None], math.nan, values).view(512)


def model_record(fmt: str, x: torch.Tensor) -> tuple[list[int], torch.Tensor]:
    """A token's record bytes ``[data][scales]`` (fp4: two codes a byte, the even dim in the low nibble) and its
    dequantised values, from the model."""
    if fmt.startswith("fp8"):
        codes, scales, values = model_fp8(x)
        return codes.tolist() + scales.tolist(), values
    codes, scales, values = model_fp4(x)
    c = codes.tolist()
    return [c[2 * i] + 16 * c[2 * i + 1] for i in range(256)] + scales.tolist(), values


def model_page(fmt: str, tokens: list[list[int]], page_bytes: int) -> list[int]:
    """The bytes of one page holding the records ``tokens`` (in slot order), padding zero: token-interleaved,
    rows back to back; page-planar, every token's data, then every token's scales."""
    page = [0] * page_bytes
    split = 512 if fmt.startswith("fp8") else 256
    P = len(tokens)
    for t, rec in enumerate(tokens):
        if fmt.endswith("_planar"):
            page[t * split:(t + 1) * split] = rec[:split]
            tail = len(rec) - split
            page[P * split + t * tail: P * split + (t + 1) * tail] = rec[split:]
        else:
            page[t * len(rec):(t + 1) * len(rec)] = rec
    return page


# --------------------------------------------------------------------------------------- inputs


def bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16)


def tokens_of_kind(kind: str, fmt: str, n: int, gen: torch.Generator) -> torch.Tensor:
    """``n`` bf16 tokens ``(n, 512)`` whose every tile (32 dims for fp8, 16 for fp4) is of ``kind``."""
    fp8 = fmt.startswith("fp8")
    tile = 32 if fp8 else 16
    tiles = n * 512 // tile
    rnd = torch.randn(tiles, tile, generator=gen, dtype=torch.float64)
    mag = torch.exp2(torch.randint(-20, 21, (tiles, 1), generator=gen).double())
    if kind == "random":  # magnitudes over 2^±20, some exact zeros and exact powers of two
        x = rnd * mag
        x[torch.rand(tiles, tile, generator=gen) < 0.1] = 0.0
        x[::3, 0] = mag[::3, 0]
    elif kind == "ties":  # values exactly halfway between two codes (scale pinned by the tile's amax)
        if fp8:  # amax 448 * 2^k; others at midpoints of neighbouring e4m3 values (subnormal ones included)
            pick = torch.randint(0, 0x7E, (tiles, tile), generator=gen)
            mag = mag.clamp_min(2.0**-13)  # above the 1e-4 floor: the scale is mag
            x = (E4M3_GRID[pick] + E4M3_GRID[pick + 1]) / 2 * mag
            x[:, 0] = 448.0 * mag[:, 0]
        else:  # scale an exact e4m3 value s = amax / 6; others at e2m1 midpoints times s
            s = E4M3_GRID[torch.randint(0x08, 0x60, (tiles, 1), generator=gen)]
            mids = (E2M1_GRID[:-1] + E2M1_GRID[1:]) / 2
            x = mids[torch.randint(0, 7, (tiles, tile), generator=gen)] * s
            x[:, 0] = 6.0 * s[:, 0]
        x = x * torch.where(torch.rand(tiles, tile, generator=gen) < 0.5, -1.0, 1.0)
    elif kind == "subnormal":
        if fp8:  # codes in e4m3's subnormal range (|x / scale| < 2^-6) beside a full-scale value
            x = rnd * 2.0**-8 * mag
            x[:, 0] = 448.0 * mag[:, 0]
            x[::4] = rnd[::4] * 2.0**-130  # tiles of bf16 subnormals only
        else:  # scales in e4m3's subnormal range (amax / 6 < 2^-6), some at the 2^-9 floor
            amax = torch.rand(tiles, 1, generator=gen, dtype=torch.float64) * 0.085  # / 6 below e4m3's 2^-6
            amax[::3] = amax[::3] * 2.0**-6
            x = rnd / rnd.abs().amax(1, keepdim=True) * amax
    elif kind == "saturating":
        if fp8:  # amax exactly 448 · 2^k: the largest code 0x7E, at the largest scales bf16 allows too
            mag = mag.clamp_min(2.0**-13)  # above the 1e-4 floor: the scale is mag
            x = rnd * mag
            x[:, 0] = 448.0 * mag[:, 0] * torch.where(rnd[:, 0] < 0, -1.0, 1.0)
            x[::5, 0] = 448.0 * 2.0**119
        else:  # amax / 6 rounded down to e4m3 (codes above 6 saturate), and amax above 6 · 448
            mag = mag.clamp(2.0**-6, 2.0**6)
            x = rnd * mag
            x[:, 0] = 6.25 * mag[:, 0]  # 6.25 / 6 = 1.042 -> e4m3 1.0: 6.25 / 1 saturates at 6
            x[::2] = rnd[::2] * 3000.0
            x[::2, 1] = 3000.0  # 3000 / 6 = 500: the scale clamped to 448
    elif kind == "all_zero":  # zero tiles, some of -0
        x = torch.zeros(tiles, tile, dtype=torch.float64)
        x[1::2, ::3] = -0.0
    else:  # nan: one NaN (some negative) among random values
        x = rnd * mag
        col = torch.randint(0, tile, (tiles,), generator=gen)
        x[torch.arange(tiles), col] = torch.where(torch.arange(tiles) % 2 == 0, math.nan, -math.nan).double()
    return bf16(x.reshape(n, 512))


def raw_pages(cache: torch.Tensor) -> list[list[int]]:
    return [block_raw(cache, b).tolist() for b in range(cache.shape[0])]


# ------------------------------------------------------------------------------------- the table


def test_zero_blocks_of_fp4_dequantise_to_nothing():
    """An fp4 cache of no blocks (a c2a cache before its first entry): the nibble unpacking reshaped 0 elements into
    (0, -1) and failed, in the demo and in make_scenario too."""
    for fmt in ("fp4_v41", "fp8_v41"):
        assert dequantize_blocks(allocate_cache(fmt, 1, 4)[:0]).shape == (0, 4, 512)


def test_a_scale_given_to_a_tiled_format_is_refused():
    """kv_scale is fp8_e4m3's: given with a tiled format it was ignored (the bytes equal to those without it)."""
    kv = torch.randn(1, 4, 512).to(torch.bfloat16)
    with pytest.raises(ValueError, match="kv_scale is only for fp8_e4m3 caches, got a fp8_v41 cache"):
        quantize_blocks(kv, "fp8_v41", 2.0)
    with pytest.raises(ValueError, match="kv_scale is only for fp8_e4m3 caches"):
        dequantize_blocks(quantize_blocks(kv, "fp4_v41"), kv_scale=2.0)
    with pytest.raises(TypeError, match="fmt must be a KVFormat"):
        page_fields("fp8_v41", 4)
    with pytest.raises(ValueError, match="past any device"):  # torch failed to unpack the size
        allocate_cache("fp8_v41", 2**40, 2**20)


def test_sizes_names_and_page_fields():
    assert {"fp8_v41", "fp8_v41_planar", "fp4_v41", "fp4_v41_planar"} <= set(FORMAT_NAMES)
    for name in V41:
        f = get_format(name)
        assert f.dim == 512 and f.rope_dim == 0 and f.quantized and f.encoding == name.removesuffix("_planar")
        assert f.planar == name.endswith("_planar") and f.is_fp8 == name.startswith("fp8")
    assert bytes_per_token("fp8_v41") == bytes_per_token("fp8_v41_planar") == 512 + 16 == 528
    assert bytes_per_token("fp4_v41") == bytes_per_token("fp4_v41_planar") == 256 + 32 == 288
    assert get_format("fp8_v41").record_code == get_format("fp8_v41_planar").record_code == get_format("fp8_v41").code
    assert get_format("fp4_v41_planar").record_code == get_format("fp4_v41").code != get_format("fp8_v41").code
    assert get_format("fp8_v41_planar").code != get_format("fp8_v41").code  # the kernels' code names the layout
    for bs, fp8_planar, fp4_planar in [(1, 1024, 512), (3, 2048, 1024), (16, 8704, 4608), (64, 33792, 18432)]:
        assert fp8_planar == -(-bs * 528 // 512) * 512 and fp4_planar == -(-bs * 288 // 512) * 512  # the rule
        assert block_bytes("fp8_v41_planar", bs) == fp8_planar and block_bytes("fp4_v41_planar", bs) == fp4_planar
        assert block_bytes("fp8_v41", bs) == 528 * bs and block_bytes("fp4_v41", bs) == 288 * bs
    assert page_fields(get_format("fp8_v41"), 64) == (528, 512, 528)
    assert page_fields(get_format("fp8_v41_planar"), 64) == (512, 64 * 512, 16)
    assert page_fields(get_format("fp4_v41"), 3) == (288, 256, 288)
    assert page_fields(get_format("fp4_v41_planar"), 3) == (256, 3 * 256, 32)
    assert page_fields(get_format("fp8_v4"), 5) == (576, 5 * 576, 8)


@pytest.mark.parametrize("fmt", V41)
def test_allocation_strides(fmt):
    cache = allocate_cache(fmt, 3, 5)
    f = get_format(fmt)
    assert cache.dtype == torch.uint8 and cache.shape == (3, 5, f.token_bytes)
    assert cache.stride() == (block_bytes(fmt, 5), f.token_bytes, 1)
    assert cache.untyped_storage().nbytes() == 3 * block_bytes(fmt, 5)
    assert infer_format(cache).name == f.encoding  # a bare tensor reads as token-interleaved
    assert resolve_cache(cache, fmt)[1] is f


# --------------------------------------------------------------------------- hand-made bytes


def test_fp8_v41_bytes_on_hand_made_values():
    kv = torch.zeros(2, 3, 512)
    tok = kv[1, 2]  # page 1, token 2
    tok[0] = 56.0  # tile 0: amax 448 · 2^-3 -> scale 2^-3 (byte 124), code 448 = 0x7E
    tok[1] = -(2.0**-12)  # 2^-9 after scaling: the smallest subnormal, negative: 0x81
    tok[32] = 1.0  # tile 1: 1/448 -> 2^-8 (byte 119); 1 / 2^-8 = 256 = 0x78
    tok[511] = -2.0  # tile 15 (a rope dim): 2/448 -> 2^-7 (byte 120); -256 = 0xF8
    kv[0, 0, 100] = 3.0  # page 0, token 0, tile 3: 3/448 -> 2^-7; 384 = 0x7C
    kv = bf16(kv)
    expected_scales = [124, 119] + [114] * 13 + [120]  # zero tiles: 1e-4 -> 2^-13 (byte 114)
    for fmt in ("fp8_v41", "fp8_v41_planar"):
        page = block_raw(quantize_blocks(kv, fmt), 1)
        if fmt == "fp8_v41":  # page 3 * 528 = 1584 bytes, token 2's row at 2 * 528
            assert page.numel() == 1584
            data, scales = page[1056:1568], page[1568:1584]
        else:  # page rounded up to 2048: data at 2 * 512, scales at 3 * 512 + 2 * 16, padding zero
            assert page.numel() == 2048
            data, scales = page[1024:1536], page[1536 + 32:1536 + 48]
            assert (page[1584:] == 0).all()
        assert data[[0, 1, 32, 511]].tolist() == [0x7E, 0x81, 0x78, 0xF8]
        assert int((data != 0).sum()) == 4
        assert scales.tolist() == expected_scales
        page0 = block_raw(quantize_blocks(kv, fmt), 0)
        assert page0[100] == 0x7C and page0[(512 if fmt == "fp8_v41" else 1536) + 3] == 120
        back = dequantize_blocks(quantize_blocks(kv, fmt), fmt).double()
        assert back[1, 2, [0, 1, 32, 511]].tolist() == [56.0, -(2.0**-12), 1.0, -2.0] and back[0, 0, 100] == 3.0


def test_fp4_v41_bytes_on_hand_made_values():
    kv = torch.zeros(1, 3, 512)
    tok = kv[0, 1]  # token 1
    tok[0:4] = torch.tensor([6.0, -3.0, 0.5, 0.25])  # tile 0: amax 6 -> scale e4m3(1) = 0x38; codes 7, 0xD, 1, 0 (tie
    tok[4] = 0.75  # 0.25 between codes 0 and 1 -> even 0; 0.75 between 1 and 2 -> even 2)
    tok[16] = 1.0  # tile 1: 1/6 -> e4m3 0.171875 (0x23); 1 / 0.171875 = 5.82 -> code 7
    tok[32], tok[33] = 3000.0, 2240.0  # tile 2: 500 -> clamped to 448 (0x7E); 6.7 saturates (7); 5.0 is a tie -> 4
    tok[511] = -0.0  # tile 31: zero, its scale the 2^-9 floor (0x01); -0 keeps the sign bit: code 8
    kv = bf16(kv)
    expected_scales = [0x38, 0x23, 0x7E] + [0x01] * 29
    for fmt in ("fp4_v41", "fp4_v41_planar"):
        page = block_raw(quantize_blocks(kv, fmt), 0)
        if fmt == "fp4_v41":  # rows of 288: token 1 at 288
            assert page.numel() == 864
            data, scales = page[288:544], page[544:576]
        else:  # [3 x 256 data][3 x 32 scales], 864 rounded up to 1024
            assert page.numel() == 1024
            data, scales = page[256:512], page[768 + 32:768 + 64]
            assert (page[864:] == 0).all()
        assert data[[0, 1, 2, 8, 16, 255]].tolist() == [0xD7, 0x01, 0x02, 0x07, 0x67, 0x80]
        assert int((data != 0).sum()) == 6
        assert scales.tolist() == expected_scales
        back = dequantize_blocks(quantize_blocks(kv, fmt), fmt).double()[0, 1]
        assert back[[0, 1, 2, 3, 4, 16, 32, 33]].tolist() == [6.0, -3.0, 0.5, 0.0, 1.0, 6 * 0.171875, 6 * 448.0,
                                                              4 * 448.0]
        assert math.copysign(1.0, back[511]) == -1.0


# ----------------------------------------------------------------- the rules against the model


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fmt", V41)
def test_quantiser_bytes_match_the_model(fmt, kind):
    """Every byte of every page (data, scales, padding) equals the model's, for tiles of one kind."""
    gen = torch.Generator().manual_seed(KINDS.index(kind) * 10 + V41.index(fmt))
    nb, bs = 3, 5
    kv = tokens_of_kind(kind, fmt, nb * bs, gen)
    if kind == "nan":  # the ops reject NaN; the quantiser's rule is checked below them
        cache = allocate_cache(fmt, nb, bs)
        blocks, offsets = torch.arange(nb).repeat_interleave(bs), torch.arange(bs).repeat(nb)
        write_tokens(as_paged(cache, get_format(fmt)), get_format(fmt), blocks, offsets, kv)
    else:
        cache = quantize_blocks(kv.view(nb, bs, 512), fmt)
    records = [model_record(fmt, kv[i].double()) for i in range(nb * bs)]
    token_bytes = 528 if fmt.startswith("fp8") else 288
    page_size = -(-bs * token_bytes // 512) * 512 if fmt.endswith("_planar") else bs * token_bytes
    assert cache.stride(0) == page_size
    for b, got in enumerate(raw_pages(cache)):
        want = model_page(fmt, [rec for rec, _ in records[b * bs:(b + 1) * bs]], page_size)
        bad = [i for i in range(page_size) if got[i] != want[i]]
        assert not bad, f"page {b}: {len(bad)} bytes differ, first at {bad[0]}: {got[bad[0]]:#x} != {want[bad[0]]:#x}"
    values = torch.stack([v for _, v in records]).view(nb, bs, 512)
    back = dequantize_blocks(cache, fmt).double()
    assert torch.equal(back.isnan(), values.isnan())
    assert torch.equal(torch.nan_to_num(back), torch.nan_to_num(values)), "code · scale is exact in bf16"


def test_the_kinds_exercise_their_rule():
    """The inputs hit what their names say (a check of the test's own data, through the model)."""
    gen = torch.Generator().manual_seed(5)

    def codes_and_scales(fmt, kind):
        kv = tokens_of_kind(kind, fmt, 8, gen).double()
        parts = [model_fp8(x) if fmt == "fp8_v41" else model_fp4(x) for x in kv]
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]), kv

    c, _, _ = codes_and_scales("fp8_v41", "subnormal")
    assert int(((c & 0x78) == 0).sum()) > 1000  # e4m3 exponent field 0: subnormal codes
    _, s, _ = codes_and_scales("fp4_v41", "subnormal")
    assert bool(((s & 0x78) == 0).all()) and int((s == 0x01).sum()) > 0  # e4m3 subnormal scales, the floor too
    c, _, _ = codes_and_scales("fp8_v41", "saturating")
    assert int(((c & 0x7F) == 0x7E).sum()) >= 8 * 16
    c, s, _ = codes_and_scales("fp4_v41", "saturating")
    assert int(((c & 7) == 7).sum()) >= 8 * 32 and int((s == 0x7E).sum()) >= 8 * 16
    for fmt, tile in (("fp8_v41", 32), ("fp4_v41", 16)):  # every tie went to the even code (dim 0: the amax)
        c, _, _ = codes_and_scales(fmt, "ties")
        assert bool((c.view(-1, tile)[:, 1:] & 1 == 0).all())
    c, s, _ = codes_and_scales("fp8_v41", "all_zero")
    assert set(c.tolist()) == {0x00, 0x80} and set(s.tolist()) == {114}
    c, s, _ = codes_and_scales("fp4_v41", "nan")
    assert set(c.tolist()) == {0} and set(s.tolist()) == {0x7F}


@pytest.mark.parametrize("fmt", V41)
def test_public_entries_reject_nan(fmt):
    kv = torch.zeros(1, 2, 512, dtype=torch.bfloat16)
    kv[0, 1, 7] = math.nan
    with pytest.raises(ValueError, match="kv must be finite"):
        quantize_blocks(kv, fmt)
    with pytest.raises(ValueError, match="kv_new must be finite"):
        quantize_and_insert(kv[0], allocate_cache(fmt, 1, 2), torch.tensor([0, 1]), fmt=fmt, backend="reference")


# ------------------------------------------------------------------------------ insert -> gather


@pytest.mark.parametrize("kind", [k for k in KINDS if k != "nan"])
@pytest.mark.parametrize("fmt", V41)
def test_gather_returns_what_insert_wrote(fmt, kind):
    """Through the ops and a PagedCache: scattered slots, -1 skipped on insert and read as zeros; the values read
    are the model's dequantised values exactly; slots not written keep their poison."""
    gen = torch.Generator().manual_seed(V41.index(fmt) + 100 * KINDS.index(kind))
    pool = PagedCache(4, 6, fmt)
    pool.poison()
    kv = tokens_of_kind(kind, fmt, 10, gen)
    slots = torch.randperm(24, generator=gen)[:10].int()
    slots[3] = -1
    pool.write(kv, slots)
    want = torch.stack([model_record(fmt, x.double())[1] for x in kv])
    read = torch.cat([slots, torch.tensor([-1], dtype=torch.int32)]).view(1, 11)
    got = pool.read(read).double()
    assert got.shape == (1, 11, 512)
    keep = slots >= 0
    assert torch.equal(got[0, :10][keep], want[keep]), "dequantised values, exactly"
    assert (got[0, 10] == 0).all() and (got[0, 3] == 0).all()
    unwritten = torch.tensor([s for s in range(24) if s not in slots.tolist()], dtype=torch.int32)
    assert bool(dequantize_and_gather(pool.data, unwritten, fmt).isnan().all()), "poisoned slots read as NaN"


@pytest.mark.parametrize("fmt", V41)
def test_padding_after_pages(fmt):
    """Pages with padding after them (token-interleaved: whole rows; page-planar: any bytes past the rounded
    page): written and read in place, the padding never touched."""
    f = get_format(fmt)
    bs, nb = 3, 4
    stride0 = block_bytes(fmt, bs) + (2 * f.token_bytes if not f.planar else 64)
    raw = torch.full((nb * stride0,), 0xAB, dtype=torch.uint8)
    cache = torch.as_strided(raw, (nb, bs, 1, f.token_bytes), (stride0, f.token_bytes, f.token_bytes, 1))  # 4-D
    kv = bf16(torch.randn(nb * bs, 512))
    quantize_and_insert(kv, cache, torch.arange(nb * bs), fmt=fmt, backend="reference")
    dense = quantize_blocks(kv.view(nb, bs, 512), fmt)
    used = bs * f.token_bytes  # then padding: the planar page's rounding, and what the stride adds
    for b in range(nb):
        assert torch.equal(raw[b * stride0: b * stride0 + used], block_raw(dense, b)[:used])
        assert (raw[b * stride0 + used: (b + 1) * stride0] == 0xAB).all()
    assert torch.equal(dequantize_and_gather(cache, torch.arange(nb * bs), fmt), dequantize_blocks(dense, fmt).view(-1,
                                                                                                                512))


def test_the_layout_is_named_by_fmt():
    """The same tensor reads as token-interleaved unless fmt names the page-planar layout; the per-tensor memo
    keeps the two apart."""
    kv = bf16(torch.randn(2, 32, 512))  # 32 tokens: a planar page is exactly 32 rows, no padding
    planar = quantize_blocks(kv, "fp8_v41_planar")
    assert planar.stride() == (32 * 528, 528, 1)
    assert resolve_cache_once(planar)[1].name == "fp8_v41"
    assert resolve_cache_once(planar, "fp8_v41_planar")[1].name == "fp8_v41_planar"
    assert resolve_cache_once(planar, "fp8_v41")[1].name == "fp8_v41"
    assert torch.equal(dequantize_blocks(planar, "fp8_v41_planar"), dequantize_blocks(quantize_blocks(kv, "fp8_v41")))
    assert not torch.equal(dequantize_blocks(planar).nan_to_num(), dequantize_blocks(planar, "fp8_v41_planar"))


# ------------------------------------------------------------------------------------ bad pairings


def strided(token_bytes: int, stride0: int, nb: int = 2, bs: int = 4) -> torch.Tensor:
    raw = torch.zeros(nb * stride0 + bs * token_bytes, dtype=torch.uint8)
    return torch.as_strided(raw, (nb, bs, token_bytes), (stride0, token_bytes, 1))


@pytest.mark.parametrize("cache,fmt,match", [
    (allocate_cache("fp8_v41", 2, 4), "fp8_v4",
     r"my_cache holds fp8_v41 data \(torch.uint8, last axis 528\) but fmt is 'fp8_v4'"),
    (allocate_cache("fp8_v41", 2, 4), "fp4_v41_planar", "my_cache holds fp8_v41 .*'fp4_v41_planar'"),
    (allocate_cache("fp4_v41", 2, 4), "fp8_v41", "my_cache holds fp4_v41 .*'fp8_v41'"),
    (allocate_cache("fp8_v4", 2, 4), "fp8_v41_planar", "my_cache holds fp8_v4 .*'fp8_v41_planar'"),
    (allocate_cache("fp8_v4", 2, 4), "fp8_v41", "my_cache holds fp8_v4 .*'fp8_v41'"),
    (strided(528, 2200), None, r"my_cache stride\(0\) = 2200 is not a whole number of 528-byte rows"),
    (strided(288, 1200), "fp4_v41", r"my_cache stride\(0\) = 1200 is not a whole number of 288-byte rows"),
    (strided(528, 4 * 528 - 4), None, r"my_cache stride\(0\) = 2108 is smaller than one fp8_v41 block \(2112"),
    # 3 rows of 528 are 1584 bytes, a planar page 2048: whole rows are not enough
    (strided(528, 1584, bs=3), "fp8_v41_planar", r"stride\(0\) = 1584 is smaller than one fp8_v41_planar block "
                                                 r"\(2048 bytes\)"),
    (torch.as_strided(torch.zeros(4000, dtype=torch.uint8), (2, 4, 288), (1152, 288, 1), 2), None,
     "my_cache: every fp4_v41 block must start on a 4-byte boundary"),
    (torch.zeros(2, 4, 528, dtype=torch.float8_e4m3fn), None, "my_cache is float8_e4m3fn with last axis 528"),
    (torch.zeros(2, 4, 300, dtype=torch.uint8), None, "expected 584 .*656 .*528 \\(fp8_v41\\) or 288 \\(fp4_v41\\)"),
])
def test_bad_pairings_are_value_errors_naming_the_cache(cache, fmt, match):
    with pytest.raises(ValueError, match=match):
        resolve_cache(cache, fmt, name="my_cache")


def test_bad_pairings_through_the_ops():
    with pytest.raises(ValueError, match="cache holds fp8_v41 .*'fp8_v4'"):
        dequantize_and_gather(allocate_cache("fp8_v41", 2, 4), torch.tensor([0]), fmt="fp8_v4")
    with pytest.raises(ValueError, match="not a whole number of 528-byte rows"):
        quantize_and_insert(bf16(torch.randn(1, 512)), strided(528, 2200), torch.tensor([0]), backend="reference")
    with pytest.raises(ValueError, match="fmt must be one of"):
        resolve_cache(allocate_cache("fp8_v41", 1, 4), "fp8_v41_interleaved")


def test_odd_planar_stride_is_allowed_only_planar():
    """A page-planar cache with the page stride 2048 (not a multiple of 528) is fine named; unnamed it is refused
    rather than read as rows."""
    cache = allocate_cache("fp8_v41_planar", 2, 3)
    assert cache.stride(0) == 2048
    assert resolve_cache(cache, "fp8_v41_planar")[1].name == "fp8_v41_planar"
    with pytest.raises(ValueError, match="not a whole number of 528-byte rows.*fmt='fp8_v41_planar'"):
        resolve_cache(cache)


# --------------------------------------------------------------------------- the reference attention


@pytest.mark.parametrize("layout", ["", "_planar"])
def test_reference_attention_reads_v41_caches(layout):
    """Decode over an fp8 window cache and an fp4 (token-interleaved) or fp8 (page-planar: one fmt names both
    caches) extra cache, against the dense float64 oracle on the model's dequantised keys."""
    gen = torch.Generator().manual_seed(7)
    fmts = ["fp8_v41" + layout, "fp4_v41" if not layout else "fp8_v41_planar"]
    caches, scopes = [], []
    for fmt in fmts:
        pool = PagedCache(3, 4, fmt)
        pool.poison()
        kv = bf16(torch.randn(9, 512, generator=gen))
        slots = torch.randperm(12, generator=gen)[:9].int()
        pool.write(kv, slots)
        table = {int(s): model_record(fmt, x.double())[1] for s, x in zip(slots, kv)}
        idx = slots[torch.randint(0, 9, (3, 6), generator=gen)].view(3, 6)
        idx[1, 4] = -1
        lens = torch.tensor([6, 5, 0], dtype=torch.int32)
        caches.append(pool.data)
        scopes.append((table, idx, lens))
    q = bf16(torch.randn(3, 4, 512, generator=gen))
    sink = torch.randn(4, generator=gen)
    out, lse = sparse_attention_decode(q, caches[0], scopes[0][1], scopes[0][2], extra_cache=caches[1],
                                       extra_indices=scopes[1][1], extra_lens=scopes[1][2], sink=sink,
                                       fmt=fmts[0] if layout else None, backend="reference")
    keys = [[table[int(i)] for table, idx, lens in scopes for i in idx[t, : lens[t]] if i >= 0] for t in range(3)]
    ref_out, ref_lse = dense_attention(q, keys, sink=sink)
    assert torch.isposinf(lse[2]).all() and (out[2] == 0).all()
    assert ((out[:2].double() - ref_out[:2]).norm() / ref_out[:2].norm()) < 1e-2
    assert ((lse[:2].double() - ref_lse[:2]).abs() < 1e-3).all()
