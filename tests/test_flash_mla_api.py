"""sparse_mla.flash_mla (FlashMLA's sparse API) against the reference ops, on the CPU."""
from __future__ import annotations

import math
import pathlib

import pytest
import torch

from sparse_mla.flash_mla import FlashMLASchedMeta, flash_mla_sparse_fwd, flash_mla_with_kvcache, get_mla_metadata
from sparse_mla.formats import quantize_blocks
from sparse_mla.ops import sparse_attention_decode, sparse_attention_prefill

FIXTURES = pathlib.Path(__file__).resolve().parent / "fixtures"


def paged(fmt, num_blocks, block_size, dim, gen):
    """A FlashMLA 4-D cache ``(num_blocks, block_size, 1, bytes)`` of random tokens."""
    kv = torch.randn(num_blocks, block_size, dim, generator=gen).to(torch.bfloat16)
    return quantize_blocks(kv, fmt).unsqueeze(2)


def slots(b, s_q, width, num_slots, gen, invalid=0.2):
    """``(b, s_q, width)`` int32 random slots, a fraction ``-1``."""
    idx = torch.randint(0, num_slots, (b, s_q, width), generator=gen, dtype=torch.int32)
    return idx.masked_fill(torch.rand(idx.shape, generator=gen) < invalid, -1)


def v4_case(gen, b=3, s_q=2, h=6):
    """V4 decode inputs: SWA + compressed scope, ragged lengths (one request with no key), sink ±inf."""
    swa, comp = paged("fp8_v4", 3, 64, 512, gen), paged("fp8_v4", 24, 2, 512, gen)
    idx, extra = slots(b, s_q, 32, 192, gen), slots(b, s_q, 20, 48, gen)
    idx[-1] = -1  # the last request: no SWA key and (extra_topk_length 0) no compressed key either
    return dict(
        q=torch.randn(b, s_q, h, 512, generator=gen).to(torch.bfloat16), k_cache=swa, indices=idx,
        extra_k_cache=comp, extra_indices_in_kvcache=extra,
        topk_length=torch.tensor([32, 9, 32], dtype=torch.int32)[:b],
        extra_topk_length=torch.tensor([20, 3, 0][:b - 1] + [0], dtype=torch.int32),
        attn_sink=torch.tensor([0.5, -float("inf"), float("inf"), -1.0, 2.0, 0.0])[:h])


def call_decode(case, sched=None, **kw):
    sched = sched if sched is not None else get_mla_metadata()[0]
    return flash_mla_with_kvcache(case["q"], case["k_cache"], None, None, 512, sched,
                                  indices=case["indices"], attn_sink=case.get("attn_sink"),
                                  extra_k_cache=case.get("extra_k_cache"),
                                  extra_indices_in_kvcache=case.get("extra_indices_in_kvcache"),
                                  topk_length=case.get("topk_length"), extra_topk_length=case.get("extra_topk_length"),
                                  **kw)


def reference_decode(case, scale=None):
    """The reference op on the same inputs, per-token lens expanded from the per-request ones."""
    b, s_q, h, d = case["q"].shape

    def lens(name):
        return None if case.get(name) is None else case[name].repeat_interleave(s_q)

    extra = case.get("extra_indices_in_kvcache")
    out, lse = sparse_attention_decode(case["q"].reshape(b * s_q, h, d), case["k_cache"].squeeze(2),
                                       case["indices"].reshape(b * s_q, -1), lens("topk_length"),
                                       extra_cache=None if extra is None else case["extra_k_cache"].squeeze(2),
                                       extra_indices=None if extra is None else extra.reshape(b * s_q, -1),
                                       extra_lens=lens("extra_topk_length"), sink=case.get("attn_sink"), scale=scale,
                                       backend="reference")
    return out.view(b, s_q, h, 512), lse.view(b, s_q, h).transpose(1, 2)


def check_decode_returns(out, lse, b, s_q, h):
    assert out.shape == (b, s_q, h, 512) and out.dtype == torch.bfloat16
    assert lse.shape == (b, h, s_q) and lse.dtype == torch.float32
    assert lse.stride() == (s_q * h, 1, h)  # FlashMLA's: a (b, s_q, h_q) buffer, transposed


def test_v4_decode_two_scopes_ragged_with_sinks():
    gen = torch.Generator().manual_seed(0)
    case = v4_case(gen)
    out, lse = call_decode(case, softmax_scale=0.07)
    check_decode_returns(out, lse, 3, 2, 6)
    ref_out, ref_lse = reference_decode(case, scale=0.07)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    assert torch.isposinf(lse[2]).all() and not out[2].any()  # no valid key: lse +inf, output 0
    assert not out[:, :, 2].any()  # sink +inf zeroes the head
    assert torch.isfinite(lse[:2]).all()  # the sink never enters the lse


def test_v4_decode_fp8_dtypes_and_kv_format():
    """FlashMLA's cache dtypes (float8_e4m3fn, int8 views of the bytes) and kv_format='V4' give the same result."""
    gen = torch.Generator().manual_seed(1)
    case = v4_case(gen, b=2, s_q=1, h=3)
    want = call_decode(case)
    for dtype in (torch.float8_e4m3fn, torch.int8):
        other = dict(case, k_cache=case["k_cache"].view(dtype), extra_k_cache=case["extra_k_cache"].view(dtype))
        got = call_decode(other, is_fp8_kvcache=True, kv_format="V4", use_legacy=True)
        assert all(torch.equal(x, y) for x, y in zip(got, want))


@pytest.mark.parametrize("fmt", ["fp8_v32", "bf16"])
def test_v32_decode_576(fmt):
    gen = torch.Generator().manual_seed(2)
    b, s_q, h = 2, 1, 5
    case = dict(q=torch.randn(b, s_q, h, 576, generator=gen).to(torch.bfloat16),
                k_cache=paged(fmt, 2, 64, 576, gen), indices=slots(b, s_q, 48, 128, gen),
                topk_length=torch.tensor([48, 30], dtype=torch.int32))
    out, lse = call_decode(case, kv_format="V32" if fmt == "fp8_v32" else None, softmax_scale=0.1352)
    check_decode_returns(out, lse, b, s_q, h)
    ref_out, ref_lse = reference_decode(case, scale=0.1352)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)


def test_a_scale_is_required_where_no_default_is_the_model_s():
    """FlashMLA's prefill has no default sm_scale, so neither has ours; its decode defaults to d ** -0.5, which is
    V4's scale (d = 512) but never V3.2's (d = 576: 0.1352, not 0.0417), so a 576-d decode needs one too."""
    gen = torch.Generator().manual_seed(2)
    case = dict(q=torch.randn(2, 1, 4, 576, generator=gen).to(torch.bfloat16),
                k_cache=paged("fp8_v32", 2, 64, 576, gen), indices=slots(2, 1, 16, 128, gen))
    with pytest.raises(ValueError, match="softmax_scale is required for q of head dim 576"):
        call_decode(case)
    v4 = v4_case(gen)
    assert all(torch.equal(x, y) for x, y in zip(call_decode(v4), call_decode(v4, softmax_scale=512 ** -0.5)))
    for d in (512, 576):
        pre = prefill_case(gen, d)
        with pytest.raises(ValueError, match="sm_scale is required"):
            flash_mla_sparse_fwd(pre["q"], pre["kv"], pre["indices"], None)


def test_scheduler_reuse_across_topk_lengths():
    """One scheduler object serves calls with other topk_length values (and shapes) and gives fresh results."""
    gen = torch.Generator().manual_seed(3)
    case = v4_case(gen)
    sched, num_splits = get_mla_metadata(torch.ones(3, dtype=torch.int32), 12, 1)  # old-interface arguments
    assert isinstance(sched, FlashMLASchedMeta) and num_splits is None
    first = call_decode(case, sched)
    other = dict(case, topk_length=torch.tensor([5, 32, 1], dtype=torch.int32),
                 extra_topk_length=torch.tensor([0, 20, 7], dtype=torch.int32))
    reused, fresh = call_decode(other, sched), call_decode(other)
    assert all(torch.equal(x, y) for x, y in zip(reused, fresh))
    assert not torch.equal(reused[0], first[0])
    smaller = v4_case(gen, b=2, s_q=1, h=4)  # other batch, s_q and heads: FlashMLA's object would refuse
    assert all(torch.equal(x, y) for x, y in zip(call_decode(smaller, sched), call_decode(smaller)))


def prefill_case(gen, d, s_q=7, h=6, s_kv=40, topk=24):
    idx = torch.randint(-1, s_kv + 5, (s_q, 1, topk), generator=gen, dtype=torch.int32)  # >= s_kv: invalid too
    idx[3] = -1  # token 3 has no valid key
    return dict(q=torch.randn(s_q, h, d, generator=gen).to(torch.bfloat16),
                kv=torch.randn(s_kv, 1, d, generator=gen).to(torch.bfloat16), indices=idx,
                attn_sink=torch.tensor([0.3, -float("inf"), float("inf"), 1.0, -2.0, 0.0])[:h],
                topk_length=torch.randint(0, topk + 1, (s_q,), generator=gen, dtype=torch.int32))


def dense_prefill(case, scale):
    """float64 (max_logits, lse) of the valid scores, FlashMLA's conventions (-inf / +inf with no key)."""
    idx = case["indices"][:, 0].long()
    valid = (idx >= 0) & (idx < case["kv"].shape[0])
    valid &= torch.arange(idx.shape[1])[None, :] < case["topk_length"][:, None]
    keys = case["kv"][:, 0].double()[idx.clamp(0, case["kv"].shape[0] - 1)]
    scores = torch.einsum("thd,tkd->thk", case["q"].double(), keys) * scale
    scores = scores.masked_fill(~valid[:, None, :], -math.inf)
    lse = scores.logsumexp(-1)
    return scores.amax(-1), lse.masked_fill(torch.isneginf(lse), math.inf)


@pytest.mark.parametrize("d", [512, 576])
def test_prefill(d):
    gen = torch.Generator().manual_seed(d)
    case = prefill_case(gen, d)
    scale = d ** -0.5 * 1.3
    args = (case["q"], case["kv"], case["indices"], scale, 512, case["attn_sink"], case["topk_length"])
    out, max_logits, lse = flash_mla_sparse_fwd(*args)
    s_q, h = case["q"].shape[:2]
    assert out.shape == (s_q, h, 512) and out.dtype == torch.bfloat16
    assert lse.shape == (s_q, h) and lse.dtype == torch.float32 and max_logits is None
    idx = case["indices"][:, 0]
    idx = idx.masked_fill(idx >= case["kv"].shape[0], -1)
    ref_out, ref_lse = sparse_attention_prefill(case["q"], case["kv"][:, 0], idx, case["topk_length"],
                                                sink=case["attn_sink"], scale=scale, backend="reference")
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    want_max, want_lse = dense_prefill(case, scale)
    assert torch.isposinf(lse[3]).all() and not out[3].any()
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-5)

    _, max_logits, lse2 = flash_mla_sparse_fwd(*args, compute_max_logits=True)
    assert max_logits.shape == (s_q, h) and max_logits.dtype == torch.float32 and torch.equal(lse2, lse)
    assert torch.isneginf(max_logits[3]).all()
    torch.testing.assert_close(max_logits.double(), want_max, rtol=1e-5, atol=1e-5)

    assert flash_mla_sparse_fwd(*args, return_log2_lse=False)[1:] == (None, None)
    _, max2, lse_log2 = flash_mla_sparse_fwd(*args, use_legacy=True, return_log2_lse=True, compute_max_logits=True)
    torch.testing.assert_close(lse_log2, lse * math.log2(math.e))
    torch.testing.assert_close(max2, max_logits * math.log2(math.e))


def test_readme_style_script_runs_with_the_import_swapped():
    text = (FIXTURES / "flashmla_readme_decode.py").read_text()
    line = "from flash_mla import get_mla_metadata, flash_mla_with_kvcache"
    assert text.count(line) == 1
    swapped = text.replace(line, "from sparse_mla.flash_mla import get_mla_metadata, flash_mla_with_kvcache")
    exec(compile(swapped, "flashmla_readme_decode.py", "exec"), {"__name__": "__main__"})


def _bad_decode(**changes):
    case = v4_case(torch.Generator().manual_seed(4))
    kw = {k: changes.pop(k) for k in list(changes) if k not in case}
    return lambda: call_decode({**case, **changes}, **kw)


BAD_DECODE = [
    ("q", ValueError, dict(q=torch.zeros(6, 6, 512, dtype=torch.bfloat16))),
    ("q", ValueError, dict(q=torch.zeros(3, 2, 6, 256, dtype=torch.bfloat16))),
    ("k_cache", ValueError, dict(k_cache=torch.zeros(3, 64, 584, dtype=torch.uint8))),
    ("k_cache", ValueError, dict(k_cache=torch.zeros(3, 64, 2, 584, dtype=torch.uint8))),
    ("k_cache", ValueError, dict(k_cache=torch.zeros(3, 64, 1, 600, dtype=torch.uint8))),
    ("k_cache", ValueError, dict(k_cache=torch.zeros(3, 64, 1, 528, dtype=torch.uint8))),  # fp8_v41 + fp8_v4
    ("extra_k_cache", ValueError, dict(extra_k_cache=torch.zeros(3, 64, 1, 288, dtype=torch.uint8))),  # fp4 + fp8_v4
    ("indices", ValueError, dict(indices=torch.zeros(3, 1, 32, dtype=torch.int32))),
    ("indices", ValueError, dict(indices=torch.zeros(3, 2, 32, dtype=torch.int64))),
    ("indices", ValueError, dict(indices=torch.full((3, 2, 32), 192, dtype=torch.int32))),
    ("indices", NotImplementedError, dict(indices=None)),
    ("extra_indices_in_kvcache", ValueError, dict(extra_indices_in_kvcache=torch.zeros(3, 20, dtype=torch.int32))),
    ("extra_k_cache", ValueError, dict(extra_indices_in_kvcache=None, extra_topk_length=None)),
    ("topk_length", ValueError, dict(topk_length=torch.zeros(6, dtype=torch.int32))),
    ("topk_length", ValueError, dict(topk_length=torch.zeros(3, dtype=torch.int64))),
    ("topk_length", ValueError, dict(topk_length=torch.full((3,), 33, dtype=torch.int32))),
    ("extra_topk_length", ValueError, dict(extra_topk_length=torch.zeros(2, dtype=torch.int32))),
    ("attn_sink", ValueError, dict(attn_sink=torch.zeros(5))),
    ("attn_sink", ValueError, dict(attn_sink=torch.zeros(6, dtype=torch.bfloat16))),
    ("softmax_scale", ValueError, dict(softmax_scale=-1.0)),
    ("causal", ValueError, dict(causal=True)),
    ("num_splits", ValueError, dict(num_splits=torch.zeros(4, dtype=torch.int32))),
    ("is_fp8_kvcache", ValueError, dict(is_fp8_kvcache=False)),
    ("kv_format", ValueError, dict(kv_format="V32")),
    ("kv_format", ValueError, dict(kv_format="V41")),  # a 584-byte k_cache declared 528
    ("kv_format", NotImplementedError, dict(kv_format="V32_NO_ROPE")),
    ("kv_format", ValueError, dict(kv_format="junk")),  # not a FlashMLA format at all: not a missing feature
    ("kv_format", TypeError, dict(kv_format=3)),
    # a bf16 cache beside V4's fp8 bytes: FlashMLA's two caches share a format (it was attended as given)
    ("extra_k_cache", ValueError, dict(extra_k_cache=torch.zeros(3, 64, 1, 512, dtype=torch.bfloat16))),
    ("descale_q", NotImplementedError, dict(descale_q=torch.ones(1))),
]


@pytest.mark.parametrize("name,exc,changes", BAD_DECODE, ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(BAD_DECODE)])
def test_decode_bad_arguments(name, exc, changes):
    with pytest.raises(exc, match=name):
        _bad_decode(**changes)()


def test_decode_rejects_other_schedulers_and_bad_head_dim_v():
    case = v4_case(torch.Generator().manual_seed(5))
    with pytest.raises(TypeError, match="tile_scheduler_metadata"):
        flash_mla_with_kvcache(case["q"], case["k_cache"], None, None, 512, object(), indices=case["indices"])
    with pytest.raises(ValueError, match="head_dim_v"):
        flash_mla_with_kvcache(case["q"], case["k_cache"], None, None, 576, get_mla_metadata()[0],
                               indices=case["indices"])
    bf16_case = dict(case, k_cache=torch.zeros(3, 64, 1, 512, dtype=torch.bfloat16), extra_k_cache=None,
                     extra_indices_in_kvcache=None, extra_topk_length=None)
    with pytest.raises(ValueError, match="is_fp8_kvcache"):
        call_decode(bf16_case, is_fp8_kvcache=True)


BAD_PREFILL = [
    ("q", dict(q=torch.zeros(7, 6, 6, 512, dtype=torch.bfloat16))),
    ("kv", dict(kv=torch.zeros(40, 2, 512, dtype=torch.bfloat16))),
    ("kv", dict(kv=torch.zeros(40, 1, 576, dtype=torch.bfloat16))),
    ("indices", dict(indices=torch.zeros(7, 24, dtype=torch.int32))),
    ("indices", dict(indices=torch.zeros(6, 1, 24, dtype=torch.int32))),
    ("topk_length", dict(topk_length=torch.zeros(3, dtype=torch.int32))),
    ("attn_sink", dict(attn_sink=torch.zeros(2))),
    ("sm_scale", dict(sm_scale=0.0)),
    ("d_v", dict(d_v=576)),
]


@pytest.mark.parametrize("name,changes", BAD_PREFILL, ids=[f"{n}-{i}" for i, (n, _) in enumerate(BAD_PREFILL)])
def test_prefill_bad_arguments(name, changes):
    case = {**prefill_case(torch.Generator().manual_seed(6), 512), "sm_scale": 0.04, **changes}
    with pytest.raises(ValueError, match=name):
        flash_mla_sparse_fwd(case["q"], case["kv"], case["indices"], case["sm_scale"], case.get("d_v", 512),
                             case["attn_sink"], case["topk_length"])
