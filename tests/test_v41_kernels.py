"""The Triton kernels over DeepSeek-V4.1's caches (issue 36; docs/formats.md): fp8_v41 (528 B) and fp4_v41 (288 B),
token-interleaved and page-planar.

* insert (``quantize_and_insert``) writes the bytes of the reference quantisers (``formats.write_tokens``, itself
  checked against an independent model in ``test_formats_v41.py``) for random, tie, subnormal, saturating, all-zero
  and NaN tiles, every byte of the page (padding included) compared;
* gather (``dequantize_and_gather``) of what insert wrote returns the reference's dequantised values exactly, with
  fp8 decoded by conversion instructions or by integer operations (targets without Triton's e4m3 type);
* the portable attention kernel over V4.1 caches (NaN-poisoned unused slots, padding after pages, both layouts, fp8
  and fp4 scopes mixed) equals the reference op; bad pairings are ValueErrors naming the cache.
"""
from __future__ import annotations

import math

import pytest
import torch
import triton
import triton.language as tl

from helpers import DEVICE, check_close, random_scope, random_sink
from launch_strategies import STRATEGIES, STRATEGY_IDS, force_strategy
from test_formats_v41 import KINDS, V41, tokens_of_kind
from sparse_mla.formats import (E2M1_VALUES, allocate_cache, as_paged, block_bytes, get_format, page_fields,
                                write_tokens)
from sparse_mla.ops import dequantize_and_gather, launch_configs, quantize_and_insert, sparse_attention_decode
from sparse_mla.ops.triton import cache as triton_cache
from sparse_mla.ops.fp8 import e2m1_decode, e2m1_gain


def cache_bytes(cache: torch.Tensor) -> torch.Tensor:
    """Every byte of a cache's storage, padding included (on the CPU)."""
    return torch.empty(0, dtype=torch.uint8, device=cache.device).set_(cache.untyped_storage()).cpu()


def padded_cache(fmt: str, num_blocks: int, block_size: int, fill: int = 0xFF) -> torch.Tensor:
    """A ``(num_blocks, block_size, token_bytes)`` cache whose pages are followed by padding (token-interleaved: two
    rows; page-planar: 64 bytes past the page's rounding), every byte ``fill``."""
    f = get_format(fmt)
    stride0 = block_bytes(f, block_size) + (64 if f.planar else 2 * f.token_bytes)
    raw = torch.full((num_blocks * stride0,), fill, dtype=torch.uint8, device=DEVICE)
    return torch.as_strided(raw, (num_blocks, block_size, f.token_bytes), (stride0, f.token_bytes, 1))


def reference_insert(kv: torch.Tensor, cache: torch.Tensor, fmt: str, slots: torch.Tensor) -> None:
    """``formats.write_tokens`` below the ops' checks (which reject NaN): the quantisers' own rules."""
    f = get_format(fmt)
    keep = slots >= 0
    bs = cache.shape[1]
    write_tokens(as_paged(cache, f), f, slots[keep].long() // bs, slots[keep].long() % bs, kv[keep])


def test_the_kernels_read_every_v41_name():
    assert {"fp8_v41", "fp8_v41_planar", "fp4_v41", "fp4_v41_planar"} <= launch_configs.TRITON_FORMATS
    codes = {get_format(f).code for f in V41}
    assert len(codes) == 4, "each page layout has its own kernel code"
    assert {get_format(f).record_code for f in V41} == {get_format("fp8_v41").code, get_format("fp4_v41").code}


# ------------------------------------------------------------------------------------------ insert


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fmt", V41)
def test_insert_writes_the_reference_bytes(monkeypatch, fmt, kind):
    """Every byte of every page, the padding after pages too (it keeps its 0xAB): scattered slots, -1 skipped."""
    monkeypatch.delenv("SPARSE_MLA_DEBUG", raising=False)  # without it the kernel takes non-finite values
    gen = torch.Generator().manual_seed(V41.index(fmt) + 10 * KINDS.index(kind))
    nb, bs = 4, 3
    kv = tokens_of_kind(kind, fmt, 10, gen).to(DEVICE)
    slots = torch.randperm(nb * bs, generator=gen)[:10].int().to(DEVICE)
    slots[4] = -1
    want, got = padded_cache(fmt, nb, bs, 0xAB), padded_cache(fmt, nb, bs, 0xAB)
    reference_insert(kv, want, fmt, slots)
    quantize_and_insert(kv, got, slots, fmt=fmt, backend="triton")
    a, b = cache_bytes(want), cache_bytes(got)
    bad = (a != b).nonzero().flatten().tolist()
    assert not bad, f"{len(bad)} bytes differ, first at {bad[0]}: {int(b[bad[0]]):#x}, want {int(a[bad[0]]):#x}"
    assert int((a != 0xAB).sum()) > 0 and bool((a == 0xAB).any()), "written bytes and padding"


@pytest.mark.parametrize("fmt", ["fp8_v41", "fp4_v41"])
def test_insert_handles_infinities_as_the_reference(monkeypatch, fmt):
    """±inf in a tile (no NaN): fp8, the tile's scale is inf (0xFF), its infinities NaN codes and its finite values
    ±0; fp4, amax clamps the scale to 448 and the infinities saturate at ±6."""
    monkeypatch.delenv("SPARSE_MLA_DEBUG", raising=False)
    gen = torch.Generator().manual_seed(3)
    kv = torch.randn(4, 512, generator=gen).to(torch.bfloat16)
    kv[0, 5], kv[1, 40], kv[2, 511], kv[3, 0:16] = math.inf, -math.inf, math.inf, -math.inf
    kv = kv.to(DEVICE)
    slots = torch.arange(4, dtype=torch.int32, device=DEVICE)
    want, got = allocate_cache(fmt, 2, 2, DEVICE), allocate_cache(fmt, 2, 2, DEVICE)
    reference_insert(kv, want, fmt, slots)
    quantize_and_insert(kv, got, slots, fmt=fmt, backend="triton")
    assert torch.equal(cache_bytes(want), cache_bytes(got))


@pytest.mark.parametrize("fmt", V41)
def test_insert_skips_slots_outside_the_cache(monkeypatch, fmt):
    monkeypatch.delenv("SPARSE_MLA_DEBUG", raising=False)
    cache = padded_cache(fmt, 2, 3, 0xAB)
    before = cache_bytes(cache)
    kv = torch.ones(3, 512, dtype=torch.bfloat16, device=DEVICE)
    quantize_and_insert(kv, cache, torch.tensor([6, 10**6, -1], dtype=torch.int32, device=DEVICE), fmt=fmt,
                        backend="triton")
    assert torch.equal(cache_bytes(cache), before), "nothing written outside the cache"


# ------------------------------------------------------------------------------------------ gather


@pytest.mark.parametrize("native", [False, True])
@pytest.mark.parametrize("kind", [k for k in KINDS if k != "nan"])
@pytest.mark.parametrize("fmt", V41)
def test_gather_returns_what_insert_wrote_exactly(fmt, kind, native):
    """Bit for bit the reference's dequantised values (slot -1: zeros), however the fp8 bytes are decoded."""
    gen = torch.Generator().manual_seed(V41.index(fmt) + 10 * KINDS.index(kind))
    nb, bs = 3, 4
    kv = tokens_of_kind(kind, fmt, nb * bs, gen).to(DEVICE)
    cache = padded_cache(fmt, nb, bs)
    quantize_and_insert(kv, cache, torch.arange(nb * bs, dtype=torch.int32, device=DEVICE), fmt=fmt,
                        backend="triton")
    slots = torch.tensor([5, -1, 0, 11, 3, 3, 7], dtype=torch.int32, device=DEVICE)
    want = dequantize_and_gather(cache, slots, fmt, backend="reference")
    got = triton_cache.dequantize_and_gather(cache, get_format(fmt), None, slots, native_fp8=native)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert (got[1] == 0).all()


@pytest.mark.parametrize("native", [False, True])
@pytest.mark.parametrize("fmt", V41)
def test_gather_of_nan_tiles(monkeypatch, fmt, native):
    """A record written from NaN tiles (the ops reject NaN; a cache written elsewhere may hold one) reads as the
    reference reads it, however fp8 is decoded: NaN where its scale is NaN, the other records exact."""
    monkeypatch.delenv("SPARSE_MLA_DEBUG", raising=False)
    gen = torch.Generator().manual_seed(1)
    kv = torch.cat([tokens_of_kind("nan", fmt, 3, gen), tokens_of_kind("random", fmt, 3, gen)]).to(DEVICE)
    cache = allocate_cache(fmt, 2, 3, DEVICE)
    slots = torch.arange(6, dtype=torch.int32, device=DEVICE)
    quantize_and_insert(kv, cache, slots, fmt=fmt, backend="triton")
    want = dequantize_and_gather(cache, slots, fmt, backend="reference").float()
    got = triton_cache.dequantize_and_gather(cache, get_format(fmt), None, slots, native_fp8=native).float()
    assert torch.equal(got.isnan(), want.isnan()) and bool(want[:3].isnan().all()) and not want[3:].isnan().any()
    assert torch.equal(got.nan_to_num(), want.nan_to_num())


@triton.jit
def _e2m1_kernel(codes_ptr, out_ptr):
    cols = tl.arange(0, 16)
    tl.store(out_ptr + cols, e2m1_decode(tl.load(codes_ptr + cols)) * e2m1_gain())


def test_every_e2m1_code_decodes_to_its_value():
    codes = torch.arange(16, dtype=torch.int32, device=DEVICE)
    out = torch.full((16,), math.nan, device=DEVICE)
    _e2m1_kernel[(1,)](codes, out)
    want = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES))
    assert torch.equal(out.cpu(), want) and torch.equal(out.cpu().signbit(), want.signbit())  # code 8 is -0


# --------------------------------------------------------------------------------------- attention


def padded_scope(gen: torch.Generator, fmt: str, num_tokens: int, width: int, num_blocks: int, block_size: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A NaN-poisoned cache with padding after its pages (:func:`padded_cache`), 3/4 of its slots written, and
    random indices into those (some ``-1``); token 0 the whole width, token 1 none."""
    cache = padded_cache(fmt, num_blocks, block_size)
    num_slots = num_blocks * block_size
    used = torch.randperm(num_slots, generator=gen)[: num_slots * 3 // 4].int().to(DEVICE)
    kv = (torch.randn(used.numel(), 512, generator=gen) * 2).to(torch.bfloat16).to(DEVICE)
    quantize_and_insert(kv, cache, used, fmt=fmt, backend="reference")
    indices = used[torch.randint(0, used.numel(), (num_tokens, width), generator=gen).to(DEVICE)]
    indices[torch.rand(num_tokens, width, generator=gen).to(DEVICE) < 0.1] = -1
    lens = torch.randint(0, width + 1, (num_tokens,), generator=gen).int().to(DEVICE)
    lens[0], lens[1] = width, 0
    return cache, indices, lens


PAIRS = [("fp8_v41", "fp4_v41", None), ("fp4_v41", "fp8_v41", None),
         ("fp8_v41_planar", "fp8_v41_planar", "fp8_v41_planar"), ("fp4_v41_planar", "fp4_v41_planar", "fp4_v41_planar")]


@pytest.mark.parametrize("strategy", STRATEGIES, ids=STRATEGY_IDS)
@pytest.mark.parametrize("window_fmt,extra_fmt,fmt", PAIRS)
def test_attention_over_v41_caches_matches_the_reference(monkeypatch, window_fmt, extra_fmt, fmt, strategy):
    """A window scope and an extra scope over padded, NaN-poisoned pages (a partial head block, a sink), under every
    strategy a target's launch configuration can choose (fp8 decoded natively or by integer operations, ...)."""
    force_strategy(monkeypatch, **strategy)
    _check_two_scopes(torch.Generator().manual_seed(len(window_fmt) + 2 * len(extra_fmt)), 4, (window_fmt, 12, 3, 8),
                      (extra_fmt, 37, 5, 4), fmt)


def _check_two_scopes(gen: torch.Generator, num_tokens: int, window: tuple, extra: tuple, fmt: str | None) -> None:
    """The Triton kernel against the reference on a window and an extra scope, each ``(format, width, blocks, block
    size)`` of :func:`padded_scope`, with 20 heads (a partial head block) and a sink."""
    num_heads = 20
    c0, i0, l0 = padded_scope(gen, window[0], num_tokens, *window[1:])
    c1, i1, l1 = padded_scope(gen, extra[0], num_tokens, *extra[1:])
    q = torch.randn(num_tokens, num_heads, 512, generator=gen).to(torch.bfloat16).to(DEVICE)
    kw = dict(extra_cache=c1, extra_indices=i1, extra_lens=l1, sink=random_sink(gen, num_heads), fmt=fmt)
    check_close(sparse_attention_decode(q, c0, i0, l0, backend="triton", **kw),
                sparse_attention_decode(q, c0, i0, l0, backend="reference", **kw))


# key-block shapes on either side of the fp4 decode's two forms (16-key blocks read a byte per dim, from 32 the nibbles
# are joined), at 4 and 8 warps and 16-64 heads, without the decode fence: CDNA's rows and their neighbours. The
# join form at 16-key blocks computed garbage on an H200 (rel err 12), which the strategy suite, running each
# target's own block sizes, did not reach.
FP4_SHAPES = [(16, 16, 4), (32, 16, 4), (32, 16, 8), (64, 16, 8), (32, 32, 4), (64, 32, 8)]


@pytest.mark.parametrize("h_block,block_n,num_warps", FP4_SHAPES)
@pytest.mark.parametrize("window_fmt,extra_fmt,fmt", [p for p in PAIRS if "fp4" in p[0] + p[1]])
def test_fp4_attention_at_each_block_shape(monkeypatch, window_fmt, extra_fmt, fmt, h_block, block_n, num_warps):
    force_strategy(monkeypatch, num_warps=num_warps, H_BLOCK=h_block, BLOCK_N=block_n, DECODE_FENCE=False,
                   PTX_DECODE=False, PREFETCH=False)
    _check_two_scopes(torch.Generator().manual_seed(h_block + block_n + num_warps), 3, (window_fmt, 40, 3, 16),
                      (extra_fmt, 70, 5, 4), fmt)


@pytest.mark.parametrize("fmt", V41)
def test_attention_one_scope_paged_cache(fmt):
    """One scope of a PagedCache (whole pages, poisoned slots), every token the whole width."""
    gen = torch.Generator().manual_seed(V41.index(fmt))
    pool, idx, lens = random_scope(gen, fmt, 512, 3, 24, 4, 6, lens_mode="full")
    q = torch.randn(3, 16, 512, generator=gen).to(torch.bfloat16).to(DEVICE)
    check_close(sparse_attention_decode(q, pool.data, idx, lens, fmt=fmt, backend="triton"),
                sparse_attention_decode(q, pool.data, idx, lens, fmt=fmt, backend="reference"))


def test_the_kernel_reads_pages_where_page_fields_puts_them():
    """A record moved by hand to where ``page_fields`` says a page-planar token's bytes are is what the kernels
    read for that slot: data and scales are found through the layout table's numbers."""
    gen = torch.Generator().manual_seed(9)
    for fmt in ("fp8_v41_planar", "fp4_v41_planar"):
        f = get_format(fmt)
        kv = torch.randn(1, 512, generator=gen).to(torch.bfloat16).to(DEVICE)
        rows = allocate_cache(f.encoding, 1, 1, DEVICE)  # a token-interleaved page of one row: the record
        quantize_and_insert(kv, rows, torch.tensor([0], device=DEVICE), backend="triton")
        record = rows[0, 0]
        cache = allocate_cache(fmt, 2, 5, DEVICE)
        fields = page_fields(f, 5)
        page = torch.as_strided(cache, (cache.stride(0),), (1,), cache.stride(0))  # page 1, slots 5-9
        t = 3  # slot 8
        page[t * fields.body_stride: t * fields.body_stride + f.scale_offset] = record[: f.scale_offset]
        start = fields.scales_base + t * fields.scales_stride
        page[start: start + f.token_bytes - f.scale_offset] = record[f.scale_offset:]
        got = dequantize_and_gather(cache, torch.tensor([8], device=DEVICE), fmt, backend="triton")
        assert torch.equal(got, dequantize_and_gather(rows, torch.tensor([0], device=DEVICE), backend="triton"))


# ---------------------------------------------------------------------------------------- bad pairings


def test_bad_pairings_reach_no_kernel():
    """A 528-byte cache declared 584 (fp8_v4), a page stride that is not a whole number of rows: ValueErrors naming
    the cache, from the attention op and the cache ops on the Triton path."""
    cache = allocate_cache("fp8_v41", 2, 4, DEVICE)
    q = torch.zeros(1, 16, 512, dtype=torch.bfloat16, device=DEVICE)
    idx, lens = torch.zeros(1, 1, dtype=torch.int32, device=DEVICE), torch.ones(1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=r"cache holds fp8_v41 data \(torch.uint8, last axis 528\) but fmt is "
                                         r"'fp8_v4'"):
        sparse_attention_decode(q, cache, idx, lens, fmt="fp8_v4", backend="triton")
    raw = torch.zeros(2 * 2200 + 4 * 528, dtype=torch.uint8, device=DEVICE)
    odd = torch.as_strided(raw, (2, 4, 528), (2200, 528, 1))
    with pytest.raises(ValueError, match=r"extra_cache stride\(0\) = 2200 is not a whole number of 528-byte rows"):
        sparse_attention_decode(q, cache, idx, lens, extra_cache=odd, extra_indices=idx, extra_lens=lens,
                                backend="triton")
    with pytest.raises(ValueError, match=r"cache stride\(0\) = 2200 is not a whole number of 528-byte rows"):
        quantize_and_insert(torch.zeros(1, 512, dtype=torch.bfloat16, device=DEVICE), odd,
                            torch.zeros(1, dtype=torch.int32, device=DEVICE), backend="triton")
    with pytest.raises(ValueError, match="cache holds fp4_v41 .*'fp8_v41_planar'"):
        dequantize_and_gather(allocate_cache("fp4_v41", 1, 4, DEVICE), idx.view(-1), "fp8_v41_planar",
                              backend="triton")
