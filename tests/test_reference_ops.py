"""The reference backend of the ops (DESIGN §4) against the independent float64 attention of tests/dense.py.

Keys on the dense side are built per token, in plain Python, from a table of slot values: the bf16
tokens written, or for fp8 caches their dequantised values from the independent fp8 model
(``dense.fake_quant``). Unused slots are poisoned with NaN and must never leak into the output.
"""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dense import dense_attention, fake_quant
from sparse_mla.cache import PagedCache
from sparse_mla.formats import allocate_cache, quantize_blocks
from sparse_mla.ops import (dequantize_and_gather, longest_first, merge_partials, quantize_and_insert,
                            sparse_attention_decode, sparse_attention_prefill)

FORMATS = [("bf16", 512), ("fp8_v4", 512), ("fp8_v32", 576), ("bf16", 576)]
SINKS = ["none", "finite", "+inf", "-inf", "mixed"]


def make_sink(kind: str, num_heads: int, gen: torch.Generator) -> torch.Tensor | None:
    if kind == "none":
        return None
    sink = torch.randn(num_heads, generator=gen) * 3
    if kind == "+inf":
        sink[:] = math.inf
    elif kind == "-inf":
        sink[:] = -math.inf
    elif kind == "mixed":
        sink[0::3] = math.inf
        sink[1::3] = -math.inf
    return sink


def make_indices(gen, choices: torch.Tensor, num_tokens: int, width: int,
                 feats: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """indices (T, width) drawn from ``choices``, with -1 holes, duplicates, empty rows and garbage beyond lens."""
    idx = choices[torch.randint(0, choices.numel(), (num_tokens, width), generator=gen)].int()
    idx[torch.rand(num_tokens, width, generator=gen) < feats["p_invalid"]] = -1
    lens = torch.randint(0, width + 1, (num_tokens,), generator=gen).int()
    if feats["full_lens"]:
        lens[:] = width
    t = int(torch.randint(0, num_tokens, (1,), generator=gen))
    if feats["dup"]:  # duplicates count once per occurrence
        idx[t, : width] = idx[t, 0] if idx[t, 0] >= 0 else choices[0]
        if width > 2:
            idx[t, 1] = choices[-1]
    if feats["empty_row"]:  # a row whose entries within lens are all -1
        idx[(t + 1) % num_tokens] = -1
    if feats["garbage"]:  # beyond lens anything goes, out of range included: never checked, never read
        beyond = torch.arange(width)[None, :] >= lens[:, None]
        junk = torch.randint(-(10**6), 10**6, (num_tokens, width), generator=gen).int()
        idx = torch.where(beyond, junk, idx)
    return idx, lens


def keys_from_tables(scopes, num_tokens: int):
    """Per token: the key vectors its first lens[t] entries name (NaN placeholders for -1) and validity."""
    keys, valid = [], []
    for t in range(num_tokens):
        kt, vt = [], []
        for table, idx, lens in scopes:
            for j in range(int(lens[t])):
                i = int(idx[t, j])
                kt.append(table[i] if i >= 0 else torch.full((table.shape[1],), math.nan, dtype=torch.float64))
                vt.append(i >= 0)
        keys.append(kt)
        valid.append(vt)
    return keys, valid


def check_against_dense(out, lse, ref_out, ref_lse):
    num_tokens, num_heads = ref_lse.shape
    assert out.shape == (num_tokens, num_heads, 512) and out.dtype == torch.bfloat16
    assert lse.shape == (num_tokens, num_heads) and lse.dtype == torch.float32
    assert not out.isnan().any() and not lse.isnan().any()
    o, r = out.double(), ref_out
    assert ((o - r).norm() <= 1e-2 * r.norm()) or (r.norm() == 0 and (o == 0).all())
    # row by row too, so one bad row cannot hide in a large tensor
    row_err = (o - r).norm(dim=-1)
    row_ref = r.norm(dim=-1)
    zero = row_ref == 0
    assert bool((o[zero] == 0).all()), "rows with no valid key or a +inf sink must be exactly 0"
    assert bool((row_err[~zero] <= 1e-2 * row_ref[~zero]).all())
    assert torch.equal(torch.isposinf(lse), torch.isposinf(ref_lse)), "+inf exactly where no key is valid"
    finite = torch.isfinite(ref_lse)
    assert bool(((lse.double()[finite] - ref_lse[finite]).abs() < 1e-3).all())


# --------------------------------------------------------------------------------- decode (paged)


FEATURES = st.fixed_dictionaries({
    "p_invalid": st.sampled_from([0.0, 0.2, 0.6]),
    "full_lens": st.booleans(),
    "dup": st.booleans(),
    "empty_row": st.booleans(),
    "garbage": st.booleans(),
})


@given(fmt_dim=st.sampled_from(FORMATS), num_tokens=st.integers(1, 8), num_heads=st.integers(1, 16),
       widths=st.lists(st.integers(1, 40), min_size=1, max_size=2), block_size=st.sampled_from([1, 2, 4, 16, 64]),
       sink_kind=st.sampled_from(SINKS), scale=st.sampled_from([None, 0.02, 0.2]),
       log_mag=st.integers(-3, 3), use_slot0=st.booleans(), four_d=st.booleans(),
       feats=st.lists(FEATURES, min_size=2, max_size=2), seed=st.integers(0, 2**31 - 1))
def test_decode_matches_dense(fmt_dim, num_tokens, num_heads, widths, block_size, sink_kind, scale, log_mag,
                              use_slot0, four_d, feats, seed):
    fmt, dim = fmt_dim
    gen = torch.Generator().manual_seed(seed)
    caches, scopes = [], []
    for s, width in enumerate(widths):
        num_blocks = max(1, 48 // block_size) if block_size < 64 else 1
        cache = PagedCache(num_blocks, block_size, fmt, dim)
        cache.poison()  # every slot not written below reads as NaN
        n = cache.num_slots
        first = 0 if use_slot0 or n == 1 else 1  # slot 0 unused: -1 entries must not read it
        perm = first + torch.randperm(n - first, generator=gen)
        used = perm[: int(torch.randint(1, n - first + 1, (1,), generator=gen))]
        kv = (torch.randn(used.numel(), dim, generator=gen) * 2.0**log_mag).to(torch.bfloat16)
        # write with a padding row in the middle (-1: written nowhere)
        cache.write(torch.cat([kv[:1], torch.full((1, dim), math.nan, dtype=torch.bfloat16), kv[1:]]),
                    torch.cat([used[:1], torch.tensor([-1]), used[1:]]).int())
        table = torch.full((n, dim), math.nan, dtype=torch.float64)
        table[used] = fake_quant(kv, fmt)
        idx, lens = make_indices(gen, used, num_tokens, width, feats[s])
        caches.append(cache.data.unsqueeze(2) if four_d else cache.data)
        scopes.append((table, idx, lens))
    q = torch.randn(num_tokens, num_heads, dim, generator=gen).to(torch.bfloat16)
    sink = make_sink(sink_kind, num_heads, gen)
    extra = {}
    if len(scopes) == 2:
        extra = dict(extra_cache=caches[1], extra_indices=scopes[1][1], extra_lens=scopes[1][2])

    out, lse = sparse_attention_decode(q, caches[0], scopes[0][1], scopes[0][2], sink=sink, scale=scale,
                                       backend="reference", **extra)
    keys, valid = keys_from_tables(scopes, num_tokens)
    ref_out, ref_lse = dense_attention(q, keys, valid, sink, scale)
    check_against_dense(out, lse, ref_out, ref_lse)


def test_decode_small_hand_checkable_case():
    """Two keys, one head, no sink: softmax of two scores, checked with math.exp by hand."""
    cache = PagedCache(1, 4, "bf16")
    k0 = torch.zeros(512)
    k0[0] = 1.0
    k1 = torch.zeros(512)
    k1[1] = 2.0
    cache.write(torch.stack([k0, k1]).to(torch.bfloat16), torch.tensor([3, 1], dtype=torch.int32))
    q = torch.zeros(1, 1, 512)
    q[0, 0, 0], q[0, 0, 1] = 1.0, 0.5
    idx = torch.tensor([[3, 1, 1]], dtype=torch.int32)  # key 1 twice
    out, lse = sparse_attention_decode(q.to(torch.bfloat16), cache.data, idx, scale=1.0, backend="reference")
    s0, s1 = 1.0, 1.0  # q·k0 = 1, q·k1 = 0.5 * 2
    z = math.exp(s0) + 2 * math.exp(s1)
    assert lse[0, 0].item() == pytest.approx(math.log(z), abs=1e-6)
    assert out[0, 0, 0].item() == pytest.approx(math.exp(s0) / z, rel=1e-2)
    assert out[0, 0, 1].item() == pytest.approx(2 * 2 * math.exp(s1) / z, rel=1e-2)
    sink = torch.tensor([0.7])
    out_s, lse_s = sparse_attention_decode(q.to(torch.bfloat16), cache.data, idx, sink=sink, scale=1.0,
                                           backend="reference")
    assert lse_s[0, 0].item() == pytest.approx(math.log(z), abs=1e-6), "lse ignores the sink"
    assert out_s[0, 0, 0].item() == pytest.approx(math.exp(s0) / (z + math.exp(0.7)), rel=1e-2)


def test_decode_default_scale_is_head_dim_power():
    gen = torch.Generator().manual_seed(3)
    for fmt, dim in (("bf16", 512), ("fp8_v32", 576)):
        cache = PagedCache(2, 4, fmt, dim)
        kv = torch.randn(8, dim, generator=gen).to(torch.bfloat16)
        cache.write(kv, torch.arange(8, dtype=torch.int32))
        q = (torch.randn(2, 4, dim, generator=gen) * 3).to(torch.bfloat16)
        idx = torch.tensor([[0, 1, 2, 3, 4], [5, 6, 7, -1, 2]], dtype=torch.int32)
        out, lse = sparse_attention_decode(q, cache.data, idx, backend="reference")
        table = fake_quant(kv, fmt)
        keys = [[table[i] for i in row if i >= 0] for row in idx.tolist()]
        ref_out, ref_lse = dense_attention(q, keys, scale=dim ** -0.5)
        check_against_dense(out, lse, ref_out, ref_lse)
        wrong_out, _ = dense_attention(q, keys, scale=512 ** -0.5 if dim == 576 else 576 ** -0.5)
        assert (out.double() - wrong_out).norm() > 1e-2 * wrong_out.norm()  # the check can tell them apart


def test_auto_backend_on_cpu_is_the_reference():
    gen = torch.Generator().manual_seed(11)
    cache = PagedCache(2, 4, "fp8_v4")
    cache.write(torch.randn(8, 512, generator=gen).to(torch.bfloat16), torch.arange(8, dtype=torch.int32))
    q = torch.randn(3, 2, 512, generator=gen).to(torch.bfloat16)
    idx = torch.randint(0, 8, (3, 6), generator=gen).int()
    a = sparse_attention_decode(q, cache.data, idx, backend="reference")
    b = sparse_attention_decode(q, cache.data, idx)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_zero_tokens_and_zero_width():
    cache = PagedCache(2, 4, "fp8_v4")
    cache.poison()
    out, lse = sparse_attention_decode(torch.zeros(0, 3, 512, dtype=torch.bfloat16), cache.data,
                                       torch.zeros(0, 5, dtype=torch.int32), backend="reference")
    assert out.shape == (0, 3, 512) and lse.shape == (0, 3)
    out, lse = sparse_attention_decode(torch.ones(2, 3, 512, dtype=torch.bfloat16), cache.data,
                                       torch.zeros(2, 0, dtype=torch.int32), sink=torch.zeros(3),
                                       backend="reference")
    assert (out == 0).all() and torch.isposinf(lse).all()


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_an_empty_cache_reads_as_no_keys(backend):
    q = torch.ones(3, 2, 512, dtype=torch.bfloat16)
    none = torch.full((3, 4), -1, dtype=torch.int32)
    empty = torch.zeros(0, 8, 512, dtype=torch.bfloat16)
    out, lse = sparse_attention_decode(q, empty, none, backend=backend)
    assert (out == 0).all() and torch.isposinf(lse).all()
    out, lse = sparse_attention_prefill(q, empty[:, 0], none, backend=backend)
    assert (out == 0).all() and torch.isposinf(lse).all()
    assert (dequantize_and_gather(empty, none, backend=backend) == 0).all()


def test_entries_beyond_lens_are_ignored_even_out_of_range():
    gen = torch.Generator().manual_seed(2)
    cache = PagedCache(2, 4, "fp8_v4")
    cache.poison()
    cache.write(torch.randn(4, 512, generator=gen).to(torch.bfloat16), torch.tensor([0, 1, 2, 5], dtype=torch.int32))
    q = torch.randn(2, 3, 512, generator=gen).to(torch.bfloat16)
    lens = torch.tensor([1, 3], dtype=torch.int32)
    clean = torch.tensor([[5, -1, -1, -1], [1, 2, 0, -1]], dtype=torch.int32)
    junk = torch.tensor([[5, 999, -7, 3], [1, 2, 0, 8]], dtype=torch.int32)  # 3 is an unwritten (NaN) slot
    a = sparse_attention_decode(q, cache.data, clean, lens, backend="reference")
    b = sparse_attention_decode(q, cache.data, junk, lens, backend="reference")
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and not b[0].isnan().any()
    # the same entries inside lens are rejected
    with pytest.raises(ValueError, match="^indices holds 999"):
        sparse_attention_decode(q, cache.data, junk, torch.tensor([2, 3], dtype=torch.int32), backend="reference")


# ------------------------------------------------------------------------------ prefill (workspace)


@given(dim=st.sampled_from([512, 576]), num_tokens=st.integers(1, 8), num_heads=st.integers(1, 16),
       num_rows=st.integers(1, 40), width=st.integers(1, 40), sink_kind=st.sampled_from(SINKS),
       scale=st.sampled_from([None, 0.05]), feats=FEATURES, seed=st.integers(0, 2**31 - 1))
def test_prefill_matches_dense(dim, num_tokens, num_heads, num_rows, width, sink_kind, scale, feats, seed):
    gen = torch.Generator().manual_seed(seed)
    kv = torch.randn(num_rows, dim, generator=gen).to(torch.bfloat16)
    rows = torch.randperm(num_rows, generator=gen)
    live = rows[: max(1, num_rows // 2)]
    kv[rows[max(1, num_rows // 2):]] = math.nan  # workspace rows no token indexes may hold anything
    idx, lens = make_indices(gen, live, num_tokens, width, feats)
    q = torch.randn(num_tokens, num_heads, dim, generator=gen).to(torch.bfloat16)
    sink = make_sink(sink_kind, num_heads, gen)
    out, lse = sparse_attention_prefill(q, kv, idx, lens, sink=sink, scale=scale, backend="reference")
    keys, valid = keys_from_tables([(kv.double(), idx, lens)], num_tokens)
    ref_out, ref_lse = dense_attention(q, keys, valid, sink, scale)
    check_against_dense(out, lse, ref_out, ref_lse)


def test_prefill_agrees_with_decode_on_the_same_keys():
    gen = torch.Generator().manual_seed(9)
    kv = torch.randn(10, 512, generator=gen).to(torch.bfloat16)
    cache = PagedCache(3, 4, "bf16")
    cache.write(kv, torch.arange(10, dtype=torch.int32))
    q = torch.randn(4, 5, 512, generator=gen).to(torch.bfloat16)
    idx = torch.randint(-1, 10, (4, 7), generator=gen).int()
    sink = torch.randn(5, generator=gen)
    a = sparse_attention_prefill(q, kv, idx, sink=sink, backend="reference")
    b = sparse_attention_decode(q, cache.data, idx, sink=sink, backend="reference")
    assert torch.equal(a[0], b[0]) and torch.allclose(a[1], b[1])


def test_prefill_input_checks():
    q = torch.zeros(2, 3, 512, dtype=torch.bfloat16)
    kv = torch.zeros(6, 512, dtype=torch.bfloat16)
    idx = torch.zeros(2, 4, dtype=torch.int32)
    for kwargs, match in [
        (dict(kv=torch.zeros(6, 512)), "^kv must have dtype"),
        (dict(kv=torch.zeros(6, 576, dtype=torch.bfloat16)), "^kv must have shape"),
        (dict(kv=torch.zeros(6, 1024, dtype=torch.bfloat16)[:, ::2]), "^kv must have contiguous rows"),
        (dict(idx=torch.full((2, 4), 6, dtype=torch.int32)), "^indices holds 6"),
        (dict(idx=torch.zeros(2, 4, dtype=torch.int64)), "^indices must have dtype"),
        (dict(q=torch.zeros(2, 3, 512)), "^q must have dtype"),
        (dict(lens=torch.tensor([5, 0], dtype=torch.int32)), "^lens must lie"),
        (dict(sink=torch.zeros(2)), "^sink must have shape"),
    ]:
        args = dict(q=q, kv=kv, idx=idx, lens=None, sink=None) | kwargs
        with pytest.raises(ValueError, match=match):
            sparse_attention_prefill(args["q"], args["kv"], args["idx"], args["lens"], sink=args["sink"],
                                     backend="reference")


# ------------------------------------------------------------------------------------ input checks


def call(q=None, cache=None, idx=None, lens=None, **kw):
    c = allocate_cache("fp8_v4", 2, 4)
    q = torch.zeros(2, 3, 512, dtype=torch.bfloat16) if q is None else q
    idx = torch.zeros(2, 5, dtype=torch.int32) if idx is None else idx
    return sparse_attention_decode(q, c if cache is None else cache, idx, lens, backend="reference", **kw)


I32 = dict(dtype=torch.int32)


@pytest.mark.parametrize("kwargs,match", [
    (dict(q=torch.zeros(2, 3, 512)), "^q must have dtype"),
    (dict(q=torch.zeros(2, 3, 512, dtype=torch.float16)), "^q must have dtype"),
    (dict(q=torch.zeros(2, 512, dtype=torch.bfloat16)), "^q must be 3-D"),
    (dict(q=torch.zeros(2, 3, 500, dtype=torch.bfloat16)), "^q must have head dim"),
    (dict(q=torch.zeros(2, 3, 576, dtype=torch.bfloat16)), "^q has head dim 576 .* fp8_v4 tokens of dim 512"),
    (dict(q=torch.zeros(2, 3, 512, dtype=torch.bfloat16), cache=allocate_cache("fp8_v32", 2, 4)),
     "^q has head dim 512 .* fp8_v32"),
    (dict(cache=torch.zeros(2, 4, 576, dtype=torch.bfloat16)), "^q has head dim 512 .* bf16 tokens of dim 576"),
    (dict(idx=torch.zeros(2, 5, dtype=torch.int64)), "^indices must have dtype torch.int32"),
    (dict(idx=torch.zeros(2, 5)), "^indices must have dtype"),
    (dict(idx=torch.zeros(10, **I32)), "^indices must be 2-D"),
    (dict(idx=torch.zeros(3, 5, **I32)), "^indices must have shape"),
    (dict(idx=torch.full((2, 5), 8, **I32)), "^indices holds 8, out of range"),
    (dict(idx=torch.full((2, 5), -2, **I32)), "^indices holds -2"),
    (dict(idx=torch.tensor([[0, 1, 2, 3, 4], [5, 6, 7, 8, 0]], **I32)), "^indices holds 8"),
    (dict(lens=torch.tensor([6, 1], **I32)), "^lens must lie in"),
    (dict(lens=torch.tensor([-1, 1], **I32)), "^lens must lie in"),
    (dict(lens=torch.tensor([1, 1])), "^lens must have dtype"),
    (dict(lens=torch.tensor([1, 1, 1], **I32)), "^lens must have shape"),
    (dict(sink=torch.zeros(3, dtype=torch.float64)), "^sink must have dtype"),
    (dict(sink=torch.zeros(3, dtype=torch.bfloat16)), "^sink must have dtype"),
    (dict(sink=torch.zeros(4)), "^sink must have shape"),
    (dict(sink=torch.zeros(1, 3)), "^sink must be 1-D"),
    (dict(scale=-1.0), "^scale must be a positive"),
    (dict(scale=0.0), "^scale must be a positive"),
    (dict(scale=math.inf), "^scale must be a positive"),
    (dict(scale=math.nan), "^scale must be a positive"),
    (dict(fmt="fp8_v32"), "^cache holds fp8_v4 .* fmt is 'fp8_v32'"),
    (dict(fmt="bf16"), "^cache holds fp8_v4"),
    (dict(cache=torch.zeros(2, 4, 100, dtype=torch.uint8)), "^cache .*584 .*656"),
    (dict(cache=torch.zeros(2, 4, 512)), "^cache must have dtype"),
    (dict(cache=torch.zeros(2, 4, 584, dtype=torch.uint8)), "^cache stride"),
    (dict(extra_indices=torch.zeros(2, 1, **I32)), "extra_cache and extra_indices"),
    (dict(extra_cache=allocate_cache("fp8_v4", 1, 4)), "extra_cache and extra_indices"),
    (dict(extra_lens=torch.zeros(2, **I32)), "extra_lens"),
    (dict(extra_cache=allocate_cache("fp8_v4", 1, 4), extra_indices=torch.full((2, 3), 4, **I32)),
     "^extra_indices holds 4"),
    (dict(extra_cache=allocate_cache("fp8_v4", 1, 4), extra_indices=torch.zeros(2, 3, dtype=torch.int64)),
     "^extra_indices must have dtype"),
    (dict(extra_cache=allocate_cache("fp8_v4", 1, 4), extra_indices=torch.zeros(2, 3, **I32),
          extra_lens=torch.tensor([4, 0], **I32)), "^extra_lens must lie"),
    (dict(extra_cache=allocate_cache("fp8_v4", 1, 4), extra_indices=torch.zeros(2, 3, **I32),
          extra_lens=torch.tensor([1, 0])), "^extra_lens must have dtype"),
    (dict(extra_cache=allocate_cache("fp8_v32", 1, 4), extra_indices=torch.zeros(2, 3, **I32)),
     "^q has head dim 512 but extra_cache"),
    (dict(extra_cache=torch.zeros(1, 4, 600, dtype=torch.uint8), extra_indices=torch.zeros(2, 3, **I32)),
     "^extra_cache"),
    (dict(extra_cache=allocate_cache("bf16", 1, 4), extra_indices=torch.zeros(2, 3, **I32), fmt="fp8_v4"),
     "^extra_cache holds bf16"),
])
def test_bad_inputs_raise_value_error_naming_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        call(**kwargs)


def test_non_tensor_arguments_raise_type_error():
    for op, first in ((sparse_attention_decode, "q"), (quantize_and_insert, "kv_new"),
                      (dequantize_and_gather, "cache")):
        with pytest.raises(TypeError, match=f"^{first} must be a torch.Tensor, got NoneType"):
            op(None, None, None)
    with pytest.raises(TypeError, match="^indices must be a torch.Tensor"):
        call(idx=[[0, 1]])


def test_valid_inputs_of_the_check_table_pass():
    """The defaults of ``call`` and the legal corner values are accepted (so the rejections above are specific)."""
    call()
    call(lens=torch.tensor([5, 0], **I32), idx=torch.tensor([[7, -1, 0, 7, 3], [9, 9, 9, 9, 9]], **I32))
    call(sink=torch.tensor([math.inf, -math.inf, 0.0]), scale=3)
    call(fmt="fp8_v4", extra_cache=allocate_cache("fp8_v4", 1, 4), extra_indices=torch.full((2, 3), 3, **I32))
    call(extra_cache=allocate_cache("bf16", 1, 4), extra_indices=torch.full((2, 3), -1, **I32),
         extra_lens=torch.tensor([3, 0], **I32))
    call(cache=allocate_cache("fp8_v4", 2, 4).unsqueeze(2))


# ------------------------------------------------------------- quantize_and_insert / dequantize_and_gather


@pytest.mark.parametrize("fmt,dim", FORMATS)
def test_insert_then_gather(fmt, dim):
    gen = torch.Generator().manual_seed(dim)
    cache = allocate_cache(fmt, 3, 4, dim=dim)
    kv = torch.randn(5, dim, generator=gen).to(torch.bfloat16)
    slots = torch.tensor([11, -1, 0, 6, 5], dtype=torch.int64)
    quantize_and_insert(kv, cache, slots)
    want = fake_quant(kv, fmt)
    got = dequantize_and_gather(cache, torch.tensor([[[11, 0], [6, -1]], [[5, 5], [-1, 0]]], dtype=torch.int32))
    assert got.shape == (2, 2, 2, dim) and got.dtype == torch.bfloat16
    assert torch.equal(got[0, 0, 0].double(), want[0]) and torch.equal(got[0, 0, 1].double(), want[2])
    assert torch.equal(got[0, 1, 0].double(), want[3]) and torch.equal(got[1, 0, 1].double(), want[4])
    assert (got[0, 1, 1] == 0).all() and (got[1, 1, 0] == 0).all()
    untouched = dequantize_and_gather(cache, torch.tensor([1, 2, 3, 4, 7, 8, 9, 10]))
    assert (untouched == 0).all(), "only the named slots were written"
    # the same bytes as building the cache in one go
    if fmt != "bf16":
        full = torch.zeros(3 * 4, dim, dtype=torch.bfloat16)
        full[slots[slots >= 0]] = kv[slots >= 0]
        ref = quantize_blocks(full.view(3, 4, dim), fmt)
        written = [0, 5, 6, 11]
        assert torch.equal(dequantize_and_gather(cache, torch.tensor(written)),
                           dequantize_and_gather(ref, torch.tensor(written)))


def test_insert_into_a_flashmla_4d_cache_writes_the_same_storage():
    cache = allocate_cache("fp8_v4", 2, 3)
    kv = torch.randn(2, 512).to(torch.bfloat16)
    quantize_and_insert(kv, cache.unsqueeze(2), torch.tensor([4, 1], dtype=torch.int32))
    assert torch.equal(dequantize_and_gather(cache, torch.tensor([4, 1])).double(), fake_quant(kv, "fp8_v4"))


def test_insert_and_gather_checks():
    cache = allocate_cache("fp8_v4", 2, 4)
    kv = torch.zeros(2, 512, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="^cache holds fp8_v4 .* fmt is 'fp8_v32'"):
        quantize_and_insert(kv, cache, torch.tensor([0, 1]), "fp8_v32")
    with pytest.raises(ValueError, match="^slot_mapping holds 8"):
        quantize_and_insert(kv, cache, torch.tensor([0, 8]))
    with pytest.raises(ValueError, match="^kv_new must have shape"):
        quantize_and_insert(torch.zeros(2, 576, dtype=torch.bfloat16), cache, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="^slot_mapping must have shape"):
        quantize_and_insert(kv, cache, torch.tensor([0]))
    with pytest.raises(ValueError, match="^slots holds 8"):
        dequantize_and_gather(cache, torch.tensor([[0, 8]]))
    with pytest.raises(ValueError, match="^slots must have dtype"):
        dequantize_and_gather(cache, torch.tensor([0.0]))
    with pytest.raises(ValueError, match="^cache holds fp8_v4"):
        dequantize_and_gather(cache, torch.tensor([0]), "bf16")
    # a padding row may hold NaN: it is not written, so it is not checked
    bad = kv.clone()
    bad[1] = math.nan
    quantize_and_insert(bad, cache, torch.tensor([3, -1]))
    assert not dequantize_and_gather(cache, torch.arange(8)).isnan().any()


def test_nan_sink_and_boolean_scale_are_rejected():
    c = PagedCache(1, 4, "bf16")
    q = torch.zeros(1, 2, 512, dtype=torch.bfloat16)
    idx = torch.zeros(1, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="sink must not be NaN"):
        sparse_attention_decode(q, c.data, idx, sink=torch.tensor([0.0, float("nan")]), backend="reference")
    with pytest.raises(ValueError, match="scale must be a positive"):
        sparse_attention_decode(q, c.data, idx, scale=True, backend="reference")


def test_q_on_another_device_than_the_cache_is_named():
    """q is checked against the cache's device before the index tensors are checked against q's (a meta q is named
    as such: it holds no values, whatever the cache's device)."""
    cache = PagedCache(1, 4, "bf16")
    q = torch.zeros(2, 1, 512, dtype=torch.bfloat16, device="meta")
    with pytest.raises(ValueError, match="q is on the meta device"):
        sparse_attention_decode(q, cache.data, torch.zeros(2, 3, dtype=torch.int32), backend="reference")
    if not torch.cuda.is_available():
        return
    q = torch.zeros(2, 1, 512, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="q must be on cache's device cpu, got cuda"):
        sparse_attention_decode(q, cache.data, torch.zeros(2, 3, dtype=torch.int32), backend="reference")


META_CALLS = {
    "dequantize_and_gather": lambda m: dequantize_and_gather(
        torch.zeros(2, 4, 512, dtype=torch.bfloat16, device=m), torch.tensor([3], device=m), backend="reference"),
    "sparse_attention_decode": lambda m: sparse_attention_decode(
        torch.zeros(2, 4, 512, dtype=torch.bfloat16, device=m), torch.zeros(2, 4, 512, dtype=torch.bfloat16, device=m),
        torch.zeros(2, 3, dtype=torch.int32, device=m), backend="reference"),
    "quantize_and_insert": lambda m: quantize_and_insert(
        torch.zeros(1, 512, dtype=torch.bfloat16, device=m), torch.zeros(2, 4, 512, dtype=torch.bfloat16, device=m),
        torch.tensor([3], device=m), backend="reference"),
    "longest_first": lambda m: longest_first(torch.tensor([3, 4], dtype=torch.int32, device=m)),
    "merge_partials": lambda m: merge_partials(torch.zeros(2, 3, 4, 8, device=m), torch.zeros(2, 3, 4, device=m),
                                               backend="reference"),
}


@pytest.mark.parametrize("op", sorted(META_CALLS))
def test_an_op_on_meta_tensors_alone_is_named(op):
    """Every tensor on the meta device (a model built before its weights): no values to read. It failed inside
    torch's ``.item()`` of a value check, or (every meta tensor has data pointer 0) as an output overlapping an
    input; now the first tensor checked is named."""
    META_CALLS[op]("cpu")  # the same call with values runs
    with pytest.raises(ValueError, match=r"is on the meta device: it holds no values"):
        META_CALLS[op]("meta")
