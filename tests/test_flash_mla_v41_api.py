"""sparse_mla.flash_mla for FlashMLA's current (2026-09-30, DeepSeek-V4.1) call surface, on the CPU (the reference
backend): 4-D caches whose last axis names the format (528 B fp8_v41, 288 B fp4_v41), token-interleaved with page
padding, fp4 only as the extra cache, a scheduler object made once and reused; against a float64 computation from
the dequantised caches (no code of the ops')."""
from __future__ import annotations

import math

import pytest
import torch

from sparse_mla.flash_mla import V41_FORMAT_OF_BYTES, flash_mla_with_kvcache, get_mla_metadata
from sparse_mla.formats import dequantize_blocks, quantize_blocks
from sparse_mla.ops import sparse_attention_decode
from sparse_mla.oracle import masked_attention

B, S_Q, H = 3, 2, 5


def interleaved(fmt: str, num_blocks: int, block_size: int, gen: torch.Generator, pad_rows: int = 0,
                dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """A FlashMLA V4.1 cache ``(num_blocks, block_size, 1, bytes)``: each page its tokens' rows back to back, then
    ``pad_rows`` rows of padding (poisoned: 0xFF), as FlashMLA's current release allows."""
    kv = (torch.randn(num_blocks, block_size, 512, generator=gen) * 0.5).to(torch.bfloat16)
    records = quantize_blocks(kv, fmt)  # (num_blocks, block_size, bytes)
    width = records.shape[-1]
    pages = torch.full((num_blocks, (block_size + pad_rows) * width), 0xFF, dtype=torch.uint8)
    view = pages[:, : block_size * width].view(num_blocks, block_size, width)
    view.copy_(records)
    return view.unsqueeze(2).view(dtype)


def slots(width: int, num_slots: int, gen: torch.Generator) -> torch.Tensor:
    """``(B, S_Q, width)`` distinct slots per row, a few ``-1``."""
    idx = torch.rand(B * S_Q, num_slots, generator=gen).topk(width, dim=1).indices.to(torch.int32)
    idx = idx.masked_fill(torch.rand(idx.shape, generator=gen) < 0.2, -1)
    return idx.view(B, S_Q, width)


def case(extra_fmt: str | None = "fp4_v41", pad_rows: int = 3, seed: int = 0, dtype=torch.uint8) -> dict:
    gen = torch.Generator().manual_seed(seed)
    out = dict(q=torch.randn(B, S_Q, H, 512, generator=gen).to(torch.bfloat16),
               k_cache=interleaved("fp8_v41", 4, 16, gen, pad_rows, dtype), indices=slots(24, 64, gen),
               topk_length=torch.tensor([24, 7, 0], dtype=torch.int32),
               attn_sink=torch.tensor([0.5, -math.inf, math.inf, -1.0, 2.0]))
    if extra_fmt is not None:
        out.update(extra_k_cache=interleaved(extra_fmt, 8, 4, gen, pad_rows, dtype),
                   extra_indices_in_kvcache=slots(12, 32, gen),
                   extra_topk_length=torch.tensor([12, 0, 5], dtype=torch.int32))
    return out


def call(c: dict, sched=None, **kw):
    return flash_mla_with_kvcache(c["q"], c["k_cache"], None, None, 512, sched or get_mla_metadata()[0],
                                  indices=c["indices"], attn_sink=c.get("attn_sink"),
                                  extra_k_cache=c.get("extra_k_cache"),
                                  extra_indices_in_kvcache=c.get("extra_indices_in_kvcache"),
                                  topk_length=c.get("topk_length"), extra_topk_length=c.get("extra_topk_length"), **kw)


def dense(c: dict, scale: float = 512 ** -0.5) -> torch.Tensor:
    """float64 attention of every token over the dequantised keys its indices name (first topk_length of each row)."""
    scopes = [("k_cache", "indices", "topk_length"), ("extra_k_cache", "extra_indices_in_kvcache", "extra_topk_length")]
    out = torch.zeros(B, S_Q, H, 512, dtype=torch.float64)
    for b in range(B):
        for s in range(S_Q):
            keys, mask = [], []
            for cache_name, idx_name, len_name in scopes:
                if c.get(cache_name) is None:
                    continue
                cache = c[cache_name].view(torch.uint8).squeeze(2)
                values = dequantize_blocks(cache, V41_FORMAT_OF_BYTES[cache.shape[-1]]).reshape(-1, 512).double()
                row = c[idx_name][b, s].long()
                valid = (row >= 0) & (torch.arange(row.shape[0]) < int(c[len_name][b]))
                keys.append(values[row.clamp_min(0)])
                mask.append(valid)
            o, _ = masked_attention(c["q"][b, s][None].double(), torch.cat(keys), torch.cat(mask)[None],
                                    c["attn_sink"], scale)
            out[b, s] = o[0]
    return out


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b).norm() / b.norm()).item()


@pytest.mark.parametrize("extra_fmt", ["fp4_v41", "fp8_v41", None])
@pytest.mark.parametrize("pad_rows", [0, 3])
def test_v41_caches_named_by_their_last_axis_match_a_dense_computation(extra_fmt, pad_rows):
    c = case(extra_fmt, pad_rows)
    assert c["k_cache"].stride(0) == (16 + pad_rows) * 528  # page padding in whole rows, as FlashMLA allows
    out, lse = call(c)
    assert out.shape == (B, S_Q, H, 512) and lse.shape == (B, H, S_Q) and lse.stride() == (S_Q * H, 1, H)
    assert not out.isnan().any()
    assert rel(out, dense(c)) < 1e-2
    assert (out[:, :, 2] == 0).all()  # sink +inf
    if extra_fmt is not None:  # request 1's tokens: 7 main keys, no extra; request 2: none of the main scope
        assert torch.isfinite(lse[1]).all()


def test_the_api_is_the_reference_op_on_the_same_bytes():
    c = case()
    out, lse = call(c, softmax_scale=0.05)
    n = B * S_Q
    ref, ref_lse = sparse_attention_decode(c["q"].reshape(n, H, 512), c["k_cache"].squeeze(2),
                                           c["indices"].reshape(n, -1), c["topk_length"].repeat_interleave(S_Q),
                                           extra_cache=c["extra_k_cache"].squeeze(2),
                                           extra_indices=c["extra_indices_in_kvcache"].reshape(n, -1),
                                           extra_lens=c["extra_topk_length"].repeat_interleave(S_Q),
                                           sink=c["attn_sink"], scale=0.05, backend="reference")
    assert torch.equal(out, ref.view(B, S_Q, H, 512)) and torch.equal(lse, ref_lse.view(B, S_Q, H).transpose(1, 2))


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn])
def test_fp8_and_int8_byte_dtypes_read_as_bytes(dtype):
    assert torch.equal(call(case(dtype=dtype))[0], call(case())[0])


def test_positional_arguments_of_the_current_signature():
    """FlashMLA 2026-09-30: (q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata,
    num_splits, softmax_scale, causal, is_fp8_kvcache, indices, attn_sink, extra_k_cache, extra_indices_in_kvcache,
    topk_length, extra_topk_length, enable_batch_invariant)."""
    c = case()
    sched, num_splits = get_mla_metadata()
    got = flash_mla_with_kvcache(c["q"], c["k_cache"], None, None, 512, sched, num_splits, None, False, True,
                                 c["indices"], c["attn_sink"], c["extra_k_cache"], c["extra_indices_in_kvcache"],
                                 c["topk_length"], c["extra_topk_length"], True)
    assert torch.equal(got[0], call(c)[0])


def test_one_scheduler_made_once_serves_calls_of_other_shapes_and_lengths():
    """FlashMLA makes its schedule on the first call and reuses it only for the same shapes and lengths; ours holds
    nothing, so reusing it anywhere gives what a fresh one gives."""
    sched, _ = get_mla_metadata()
    first = case(seed=1)
    other = case("fp8_v41", seed=2)
    other["topk_length"] = torch.tensor([3, 24, 11], dtype=torch.int32)
    for c in (first, other, first):
        assert torch.equal(call(c, sched)[0], call(c)[0])


BAD = [
    ("k_cache holds fp4_v41", ValueError, lambda c: dict(c, k_cache=c["extra_k_cache"],
                                                          extra_k_cache=c["k_cache"])),
    ("k_cache holds fp4_v41", ValueError, lambda c: dict(c, k_cache=c["extra_k_cache"], extra_k_cache=None,
                                                          extra_indices_in_kvcache=None, extra_topk_length=None)),
    (r"cache format mismatch: k_cache holds fp8_v41, extra_k_cache 584-byte", ValueError,
     lambda c: dict(c, extra_k_cache=quantize_blocks(torch.zeros(8, 4, 512).to(torch.bfloat16), "fp8_v4")[:, :, None])),
    (r"cache format mismatch: k_cache holds fp8_v41, extra_k_cache 512-byte torch.bfloat16", ValueError,
     lambda c: dict(c, extra_k_cache=torch.zeros(8, 4, 1, 512, dtype=torch.bfloat16))),
    (r"k_cache stride\(0\) = 8500 is not a whole number of 528-byte rows", ValueError,
     lambda c: dict(c, k_cache=torch.zeros(4 * 8500, dtype=torch.uint8).as_strided((4, 16, 1, 528),
                                                                                    (8500, 528, 528, 1)))),
    (r"q has head dim 576 but k_cache holds fp8_v41 tokens of dim 512", ValueError,
     lambda c: dict(c, q=torch.zeros(B, S_Q, H, 576, dtype=torch.bfloat16))),
]


@pytest.mark.parametrize("match,exc,change", BAD, ids=[f"bad-{i}" for i in range(len(BAD))])
def test_bad_format_pairings_are_errors_naming_them(match, exc, change):
    with pytest.raises(exc, match=match):
        call(change(case()), softmax_scale=0.1)


def test_kv_format_names_are_checked_against_the_528_and_288_byte_caches():
    c = case()
    assert torch.equal(call(c, kv_format="V41")[0], call(c)[0])
    with pytest.raises(ValueError, match=r"kv_format='V4' needs 584-byte fp8 tokens, but k_cache is torch.uint8 with "
                                         r"last axis 528"):
        call(c, kv_format="V4")  # a 528-byte cache declared 584
    with pytest.raises(NotImplementedError, match=r"kv_format='V32_NO_ROPE' \(V3.2 without RoPE \(528 B"):
        call(c, kv_format="V32_NO_ROPE")  # the other 528-byte layout: named, never guessed
    with pytest.raises(ValueError, match="is_fp8_kvcache=False"):
        call(c, is_fp8_kvcache=False)
