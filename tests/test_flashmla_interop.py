"""Caches built by ``quantize_blocks`` are read by FlashMLA exactly as by our ops (H100 + sgl-flash-mla).

Skipped where CUDA or the ``flash_mla`` package is missing.
"""
from __future__ import annotations

import pytest
import torch

from sparse_mla.formats import quantize_blocks
from sparse_mla.ops import sparse_attention_decode

flash_mla = pytest.importorskip("flash_mla") if torch.cuda.is_available() else None
pytestmark = pytest.mark.skipif(flash_mla is None, reason="needs CUDA and flash_mla")


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("num_heads,extra_topk,extra_block,ragged", [(64, 512, 64, False), (128, 1024, 2, True)])
def test_flashmla_reads_our_fp8_v4_cache(num_heads, extra_topk, extra_block, ragged):
    gen = torch.Generator(device="cuda").manual_seed(num_heads + extra_topk)
    b, s_q, d = 4, 2, 512

    def scope(num_blocks, block_size, topk):
        kv = torch.randn(num_blocks, block_size, d, generator=gen, device="cuda").to(torch.bfloat16)
        cache = quantize_blocks(kv, "fp8_v4")
        slots = torch.rand(b * s_q, num_blocks * block_size, generator=gen, device="cuda").topk(topk, -1).indices
        return cache, slots.int()

    cache0, idx0 = scope(8, 64, 128)
    cache1, idx1 = scope(1024 // extra_block * 2, extra_block, extra_topk)
    lens1 = torch.full((b,), extra_topk, dtype=torch.int32, device="cuda")
    if ragged:
        lens1 = torch.randint(0, extra_topk + 1, (b,), generator=gen, device="cuda").int()
        idx1[torch.arange(extra_topk, device="cuda")[None] >= lens1.repeat_interleave(s_q)[:, None]] = -1
    q = torch.randn(b * s_q, num_heads, d, generator=gen, device="cuda").to(torch.bfloat16)
    sink = torch.randn(num_heads, generator=gen, device="cuda")
    scale = d ** -0.5
    meta, _ = flash_mla.get_mla_metadata()
    fm_out, _ = flash_mla.flash_mla_with_kvcache(
        q.view(b, s_q, num_heads, d), cache0.unsqueeze(2), None, None, 512, meta, None, scale, False, True,
        idx0.view(b, s_q, -1), sink, cache1.unsqueeze(2), idx1.view(b, s_q, -1), None,
        lens1 if ragged else None, use_legacy=True)
    lens_tok = lens1.repeat_interleave(s_q)
    ref, _ = sparse_attention_decode(q, cache0, idx0, None, cache1, idx1, lens_tok, sink, scale, backend="reference")
    ours, _ = sparse_attention_decode(q, cache0, idx0, None, cache1, idx1, lens_tok, sink, scale, backend="triton")
    fm = fm_out.reshape(b * s_q, num_heads, 512)
    assert rel_err(fm, ref) < 1e-2
    assert rel_err(ours, fm) < 1e-2
