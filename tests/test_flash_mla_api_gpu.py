"""sparse_mla.flash_mla against the real FlashMLA (sgl-flash-mla 1.0.0, legacy SM90 kernels) on the same inputs.

Same calls, one import apart: outputs within bf16 tolerance, lse in the same layout, the same values
(finite entries) and the same infinities. Each FlashMLA call gets its own scheduler object (FlashMLA's
caches the first call's topk_length schedule); ours uses one for everything.
Needs CUDA and the ``flash_mla`` package (on a GPU without it: a failure unless SPARSE_MLA_EXPECT_MISSING=flash_mla).
"""
from __future__ import annotations

import pytest
import torch

from helpers import needs, optional_import
from sparse_mla import flash_mla as ours
from sparse_mla.formats import quantize_blocks

flash_mla = optional_import("flash_mla")
pytestmark = needs("gpu", "flash_mla")

OUR_SCHED, _ = ours.get_mla_metadata()  # one for every call: it holds nothing


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def assert_same_stats(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Same shape and strides, same ±inf positions, finite entries within 1e-3 (relative)."""
    assert got.shape == want.shape and got.dtype == want.dtype, what
    assert got.stride() == want.stride(), what
    assert torch.equal(torch.isposinf(got), torch.isposinf(want)), what
    assert torch.equal(torch.isneginf(got), torch.isneginf(want)), what
    finite = torch.isfinite(want)
    assert rel_err(got[finite], want[finite]) < 1e-3, what


def scope(gen, fmt, dim, num_blocks, block_size, b, s_q, topk, max_len=None):
    """A 4-D cache of random tokens, ``(b, s_q, topk)`` distinct in-range slots, and ``(b,)`` lengths
    (``max_len`` given: ragged in ``[0, max_len]``, one request 0; entries past a length stay valid slots)."""
    kv = (torch.randn(num_blocks, block_size, dim, generator=gen, device="cuda") / 4).to(torch.bfloat16)
    cache = quantize_blocks(kv, fmt).unsqueeze(2)
    picks = torch.rand(b * s_q, num_blocks * block_size, generator=gen, device="cuda").topk(topk, -1).indices
    idx = picks.int().view(b, s_q, topk)
    idx[torch.rand(idx.shape, generator=gen, device="cuda") < 0.1] = -1
    lens = None
    if max_len is not None:
        lens = torch.randint(0, max_len + 1, (b,), generator=gen, device="cuda", dtype=torch.int32)
        lens[1] = 0
    return cache, idx, lens


def v4_inputs(seed, b, s_q, h_q, comp_blocks, comp_block_size, comp_topk, swa_blocks=16):
    """V4 decode inputs: q, an SWA scope (topk 128) and a compressed scope, both with ragged lengths
    (request 1: none), and a sink with +inf at head 0 and -inf at head 1."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    swa = scope(gen, "fp8_v4", 512, swa_blocks, 64, b, s_q, 128, max_len=128)
    comp = scope(gen, "fp8_v4", 512, comp_blocks, comp_block_size, b, s_q, comp_topk, max_len=comp_topk)
    q = torch.randn(b, s_q, h_q, 512, generator=gen, device="cuda").to(torch.bfloat16)
    sink = torch.randn(h_q, generator=gen, device="cuda")
    sink[0], sink[1] = float("inf"), -float("inf")
    return q, swa, comp, sink


def both_decode(q, cache, idx, **kw):
    """FlashMLA (fresh scheduler, legacy kernels) and ours on the same arguments."""
    fm_sched, _ = flash_mla.get_mla_metadata()
    fm = flash_mla.flash_mla_with_kvcache(q, cache, None, None, 512, fm_sched, None, indices=idx, is_fp8_kvcache=True,
                                          use_legacy=True, **kw)
    mine = ours.flash_mla_with_kvcache(q, cache, None, None, 512, OUR_SCHED, None, indices=idx, is_fp8_kvcache=True,
                                       use_legacy=True, **kw)
    return fm, mine


def check_decode(fm, mine):
    (fm_out, fm_lse), (out, lse) = fm, mine
    assert out.shape == fm_out.shape and out.dtype == fm_out.dtype
    assert rel_err(out, fm_out) < 1e-2
    assert_same_stats(lse, fm_lse, "lse")


@pytest.mark.parametrize("h_q,extra_topk,extra_block", [(64, 512, 64), (128, 1024, 2)])
def test_v4_decode_matches_flashmla(h_q, extra_topk, extra_block):
    q, (swa, swa_idx, swa_lens), (comp, comp_idx, comp_lens), sink = v4_inputs(
        h_q + extra_topk, 6, 2, h_q, 2 * extra_topk // extra_block, extra_block, extra_topk)
    for kw in (dict(topk_length=swa_lens, extra_topk_length=comp_lens),  # ragged: request 1 has no key at all
               dict(extra_topk_length=comp_lens),
               dict()):
        fm, mine = both_decode(q, swa, swa_idx, attn_sink=sink, extra_k_cache=comp, extra_indices_in_kvcache=comp_idx,
                               softmax_scale=512 ** -0.5, **kw)
        check_decode(fm, mine)


def test_v4_decode_ragged_empty_rows_and_sink_inf():
    q, (swa, swa_idx, swa_lens), (comp, comp_idx, comp_lens), sink = v4_inputs(7, 4, 2, 64, 16, 64, 512, swa_blocks=8)
    fm, mine = both_decode(q, swa, swa_idx, attn_sink=sink, extra_k_cache=comp, extra_indices_in_kvcache=comp_idx,
                           topk_length=swa_lens, extra_topk_length=comp_lens)
    check_decode(fm, mine)
    assert torch.isposinf(mine[1][1]).all() and not mine[0][1].any()  # request 1: no key
    assert not mine[0][:, :, 0].any()  # sink +inf


def test_v4_decode_any_head_count_matches_flashmla_heads():
    """16 heads (a tensor-parallel shard) give FlashMLA's first 16 heads of a 64-head call."""
    gen = torch.Generator(device="cuda").manual_seed(11)
    b, s_q = 5, 1
    swa, swa_idx, _ = scope(gen, "fp8_v4", 512, 8, 64, b, s_q, 128)
    comp, comp_idx, comp_lens = scope(gen, "fp8_v4", 512, 64, 2, b, s_q, 64, max_len=64)
    q = torch.randn(b, s_q, 64, 512, generator=gen, device="cuda").to(torch.bfloat16)
    sink = torch.randn(64, generator=gen, device="cuda")
    kw = dict(extra_k_cache=comp, extra_indices_in_kvcache=comp_idx, extra_topk_length=comp_lens)
    fm_sched, _ = flash_mla.get_mla_metadata()
    fm = flash_mla.flash_mla_with_kvcache(q, swa, None, None, 512, fm_sched, None, None, False, True, swa_idx, sink,
                                          use_legacy=True, **kw)
    mine = ours.flash_mla_with_kvcache(q[:, :, :16], swa, None, None, 512, OUR_SCHED, None, None, False, True, swa_idx,
                                       sink[:16], use_legacy=True, **kw)
    assert rel_err(mine[0], fm[0][:, :, :16]) < 1e-2
    assert mine[1].shape == (b, 16, s_q)
    assert rel_err(mine[1], fm[1][:, :16]) < 1e-3


@pytest.mark.parametrize("h_q", [64, 128])
def test_v32_decode_matches_flashmla(h_q):
    gen = torch.Generator(device="cuda").manual_seed(32 + h_q)
    b, s_q, topk = 4, 1, 2048
    cache, idx, lens = scope(gen, "fp8_v32", 576, 40, 64, b, s_q, topk, max_len=topk)
    q = torch.randn(b, s_q, h_q, 576, generator=gen, device="cuda").to(torch.bfloat16)
    fm, mine = both_decode(q, cache, idx, softmax_scale=0.1352)
    check_decode(fm, mine)
    # FlashMLA's V3.2 kernels take no topk_length ("V3.2 does not support dynamic topk length": the -1 padding
    # carries the lengths); ours also honours one
    past = torch.arange(topk, device="cuda")[None, None, :] >= lens[:, None, None]
    fm_cut, _ = both_decode(q, cache, idx.masked_fill(past, -1), softmax_scale=0.1352)
    check_decode(fm_cut, ours.flash_mla_with_kvcache(q, cache, None, None, 512, OUR_SCHED, None, softmax_scale=0.1352,
                                                     indices=idx, is_fp8_kvcache=True, topk_length=lens))


@pytest.mark.parametrize("d_qk,h_q", [(512, 64), (512, 128), (576, 64), (576, 128)])
def test_prefill_matches_flashmla(d_qk, h_q):
    gen = torch.Generator(device="cuda").manual_seed(d_qk + h_q)
    s_q, s_kv, topk = 256, 4096, 512
    q = torch.randn(s_q, h_q, d_qk, generator=gen, device="cuda").to(torch.bfloat16)
    kv = (torch.randn(s_kv, 1, d_qk, generator=gen, device="cuda") / 4).to(torch.bfloat16)
    idx = torch.rand(s_q, s_kv, generator=gen, device="cuda").topk(topk, -1).indices.int().view(s_q, 1, topk)
    idx[torch.rand(idx.shape, generator=gen, device="cuda") < 0.1] = -1
    idx[torch.rand(idx.shape, generator=gen, device="cuda") < 0.05] = s_kv + 7  # >= s_kv: invalid in FlashMLA
    idx[5] = -1  # token 5: no key
    lens = torch.randint(0, topk + 1, (s_q,), generator=gen, device="cuda", dtype=torch.int32)
    lens[9] = 0  # token 9: no key
    sink = None
    if d_qk == 512:
        sink = torch.randn(h_q, generator=gen, device="cuda")
        sink[0], sink[1] = float("inf"), -float("inf")
    scale = d_qk ** -0.5
    for topk_length in (lens, None):
        fm_out, fm_max, fm_lse = flash_mla.flash_mla_sparse_fwd(q, kv, idx, scale, 512, sink, topk_length,
                                                               use_legacy=True)
        out, max_logits, lse = ours.flash_mla_sparse_fwd(q, kv, idx, scale, 512, sink, topk_length, use_legacy=True,
                                                         compute_max_logits=True)
        assert out.shape == fm_out.shape and rel_err(out, fm_out) < 1e-2
        assert_same_stats(lse, fm_lse, "lse")
        assert_same_stats(max_logits, fm_max, "max_logits")
        assert torch.isposinf(lse[5]).all() and not out[5].any()
    _, fm_max2, fm_lse2 = flash_mla.flash_mla_sparse_fwd(q, kv, idx, scale, 512, sink, lens, use_legacy=True,
                                                         return_log2_lse=True)
    _, max2, lse2 = ours.flash_mla_sparse_fwd(q, kv, idx, scale, 512, sink, lens, use_legacy=True, return_log2_lse=True,
                                              compute_max_logits=True)
    assert_same_stats(lse2, fm_lse2, "log2 lse")
    assert_same_stats(max2, fm_max2, "log2 max_logits")
