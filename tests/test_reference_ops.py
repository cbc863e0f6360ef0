"""The reference ops against the independent dense attention of tests/dense.py."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dense import dense_attention
from sparse_mla.cache import PagedCache
from sparse_mla.ops import dequantize_and_gather, sparse_attention_decode, sparse_attention_prefill


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def make_scope(gen, fmt, dim, num_tokens, width, num_blocks, block_size):
    cache = PagedCache(num_blocks, block_size, fmt, dim)
    cache.poison()
    n = num_blocks * block_size
    used = torch.randperm(n, generator=gen)[: max(1, n // 2)]
    cache.write(torch.randn(used.numel(), dim, generator=gen).to(torch.bfloat16), used.int())
    idx = used[torch.randint(0, used.numel(), (num_tokens, width), generator=gen)].int()
    idx[torch.rand(num_tokens, width, generator=gen) < 0.2] = -1
    lens = torch.randint(0, width + 1, (num_tokens,), generator=gen).int()
    return cache, idx, lens


def keys_of(scopes, t):
    rows = []
    for cache, idx, lens in scopes:
        picked = idx[t, : int(lens[t])]
        picked = picked[picked >= 0]
        rows.append(cache.read(picked).float())
    return torch.cat(rows)


SINKS = st.sampled_from(["none", "finite", "+inf", "-inf", "mixed"])


def make_sink(kind, num_heads, gen):
    if kind == "none":
        return None
    sink = torch.randn(num_heads, generator=gen) * 2
    if kind == "+inf":
        sink[:] = float("inf")
    elif kind == "-inf":
        sink[:] = -float("inf")
    elif kind == "mixed":
        sink[::2] = float("inf")
        sink[1::3] = -float("inf")
    return sink


@settings(max_examples=40, deadline=None)
@given(fmt_dim=st.sampled_from([("bf16", 512), ("fp8_v4", 512), ("fp8_v32", 576), ("bf16", 576)]),
       num_tokens=st.integers(1, 6), num_heads=st.integers(1, 9), w0=st.integers(1, 24), w1=st.integers(0, 30),
       block_size=st.sampled_from([1, 2, 4, 16]), sink_kind=SINKS, scale=st.sampled_from([None, 0.01, 0.1]),
       seed=st.integers(0, 2**31 - 1))
def test_decode_matches_dense(fmt_dim, num_tokens, num_heads, w0, w1, block_size, sink_kind, scale, seed):
    fmt, dim = fmt_dim
    gen = torch.Generator().manual_seed(seed)
    scopes = [make_scope(gen, fmt, dim, num_tokens, w0, 4, block_size)]
    if w1:
        scopes.append(make_scope(gen, fmt, dim, num_tokens, w1, 3, block_size * 2))
    if num_tokens > 1:  # duplicate picks count once per occurrence
        scopes[0][1][1, :] = scopes[0][1][1, 0]
    q = torch.randn(num_tokens, num_heads, dim, generator=gen).to(torch.bfloat16)
    sink = make_sink(sink_kind, num_heads, gen)
    (c0, i0, l0), *rest = scopes
    extra = dict(extra_cache=rest[0][0].data, extra_indices=rest[0][1], extra_lens=rest[0][2]) if rest else {}
    out, lse = sparse_attention_decode(q, c0.data, i0, l0, sink=sink, scale=scale, backend="reference", **extra)
    ref_out, ref_lse = dense_attention(q.float(), [keys_of(scopes, t) for t in range(num_tokens)], sink,
                                       scale if scale is not None else dim ** -0.5)
    assert out.shape == (num_tokens, num_heads, 512) and out.dtype == torch.bfloat16
    assert not out.isnan().any()
    if ref_out.norm() > 0:
        assert rel_err(out, ref_out) < 1e-2
    else:
        assert (out == 0).all()
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    finite = torch.isfinite(ref_lse)
    assert torch.allclose(lse[finite].double(), ref_lse[finite], atol=1e-4, rtol=1e-5)


def test_prefill_matches_dense_and_ignores_unindexed_nan_rows():
    gen = torch.Generator().manual_seed(5)
    kv = torch.randn(40, 512, generator=gen).to(torch.bfloat16)
    kv[20:] = float("nan")
    idx = torch.randint(0, 20, (5, 12), generator=gen).int()
    idx[0, :] = -1
    lens = torch.tensor([12, 0, 7, 12, 3], dtype=torch.int32)
    q = torch.randn(5, 3, 512, generator=gen).to(torch.bfloat16)
    sink = torch.tensor([0.3, -float("inf"), float("inf")])
    out, lse = sparse_attention_prefill(q, kv, idx, lens, sink, backend="reference")
    keys = [kv[idx[t, : lens[t]][idx[t, : lens[t]] >= 0].long()].float() for t in range(5)]
    ref, ref_lse = dense_attention(q.float(), keys, sink, 512 ** -0.5)
    assert rel_err(out, ref) < 1e-2 and not out.isnan().any()
    assert torch.isinf(lse[0]).all() and torch.isinf(lse[1]).all() and (out[:2] == 0).all()
    assert (out[:, 2] == 0).all(), "+inf sink zeroes the head"


def call(q=None, cache=None, idx=None, lens=None, **kw):
    c = PagedCache(2, 4, "fp8_v4")
    q = torch.zeros(2, 3, 512, dtype=torch.bfloat16) if q is None else q
    idx = torch.zeros(2, 5, dtype=torch.int32) if idx is None else idx
    return sparse_attention_decode(q, c.data if cache is None else cache, idx, lens, backend="reference", **kw)


@pytest.mark.parametrize("kwargs,match", [
    (dict(q=torch.zeros(2, 3, 512)), "q must have dtype"),
    (dict(q=torch.zeros(2, 512, dtype=torch.bfloat16)), "q must be 3-D"),
    (dict(q=torch.zeros(2, 3, 576, dtype=torch.bfloat16)), "head dim 576 .* fp8_v4 tokens of dim 512"),
    (dict(idx=torch.zeros(2, 5, dtype=torch.int64)), "indices must have dtype torch.int32"),
    (dict(idx=torch.zeros(3, 5, dtype=torch.int32)), "indices must have shape"),
    (dict(idx=torch.full((2, 5), 8, dtype=torch.int32)), "indices holds 8, out of range"),
    (dict(idx=torch.full((2, 5), -2, dtype=torch.int32)), "indices holds -2"),
    (dict(lens=torch.tensor([6, 1], dtype=torch.int32)), "lens must lie in"),
    (dict(lens=torch.tensor([1, 1])), "lens must have dtype"),
    (dict(sink=torch.zeros(3, dtype=torch.float64)), "sink must have dtype"),
    (dict(sink=torch.zeros(4)), "sink must have shape"),
    (dict(scale=-1.0), "scale must be a positive"),
    (dict(fmt="fp8_v32"), "cache holds fp8_v4 .* fmt is 'fp8_v32'"),
    (dict(cache=torch.zeros(2, 4, 100, dtype=torch.uint8)), "584 .*656"),
    (dict(extra_indices=torch.zeros(2, 1, dtype=torch.int32)), "extra_cache and extra_indices"),
])
def test_bad_inputs_raise_value_error_naming_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        call(**kwargs)


def test_entries_beyond_lens_are_not_checked_or_read():
    idx = torch.tensor([[0, 999, -7], [1, 2, 3]], dtype=torch.int32)
    out, _ = call(idx=idx, lens=torch.tensor([1, 3], dtype=torch.int32))
    assert out.shape == (2, 3, 512)


def test_dequantize_and_gather_shapes_and_invalid_rows():
    c = PagedCache(2, 4, "fp8_v4")
    kv = torch.randn(8, 512).to(torch.bfloat16)
    c.write(kv, torch.arange(8, dtype=torch.int32))
    got = dequantize_and_gather(c.data, torch.tensor([[7, -1], [0, 3]], dtype=torch.int32))
    assert got.shape == (2, 2, 512) and (got[0, 1] == 0).all()
    assert rel_err(got[1, 0], kv[0]) < 0.04 and rel_err(got[0, 0], kv[7]) < 0.04
