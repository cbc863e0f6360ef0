"""Per-scope cache formats in one attention call (issue 36): ``sparse_attention_decode(..., fmt=, extra_fmt=)`` names
each cache's format, so a V4.1 layer's page-planar pair (an ``fp8_v41_planar`` window cache beside an
``fp4_v41_planar`` compressed cache, vLLM's and SGLang's pages), whose layouts the tensors cannot say, is read in
one call — by the reference and the Triton backend, through the remembered-call path, and by the layers.
"""
from __future__ import annotations

import math

import pytest
import torch

from helpers import DEVICE, check_close, random_scope, random_sink, rel_err
from sparse_mla.config import V41_KINDS
from sparse_mla.formats import get_format
from sparse_mla.layer import SparseMLAAttention
from sparse_mla.ops import memo, sparse_attention_decode
from sparse_mla.scenario import make_scenario

BACKENDS = ("reference", "triton")
PLANAR_PAIR = ("fp8_v41_planar", "fp4_v41_planar")


def twin_scope(seed: int, fmt: str, num_tokens: int, width: int, num_blocks: int, block_size: int):
    """One scope's tokens twice: in a NaN-poisoned page-planar cache of ``fmt`` and in a token-interleaved cache of
    its encoding (the same random draws, so the same values, slots and index lists). Returns (planar cache tensor,
    interleaved cache tensor, indices, lens)."""
    planar, idx, lens = random_scope(torch.Generator().manual_seed(seed), fmt, 512, num_tokens, width, num_blocks,
                                     block_size)
    rows, idx_rows, lens_rows = random_scope(torch.Generator().manual_seed(seed), get_format(fmt).encoding, 512,
                                             num_tokens, width, num_blocks, block_size)
    assert torch.equal(idx, idx_rows) and torch.equal(lens, lens_rows)
    return planar.data, rows.data, idx, lens


def planar_pair_call(seed: int = 0, num_tokens: int = 4, num_heads: int = 5):
    """The op's arguments over a planar fp8_v41 window + planar fp4_v41 extra scope (``planar``) and over
    token-interleaved copies of the same tokens (``rows``, whose formats the tensors say)."""
    c0, r0, i0, l0 = twin_scope(seed, PLANAR_PAIR[0], num_tokens, 12, 3, 8)  # 528·8 = 4,224 B pages -> 4,608
    c1, r1, i1, l1 = twin_scope(seed + 1, PLANAR_PAIR[1], num_tokens, 21, 5, 4)  # 288·4 = 1,152 B -> 1,536
    gen = torch.Generator().manual_seed(seed + 2)
    q = torch.randn(num_tokens, num_heads, 512, generator=gen).to(torch.bfloat16).to(DEVICE)
    common = dict(indices=i0, lens=l0, extra_indices=i1, extra_lens=l1, sink=random_sink(gen, num_heads))
    planar = dict(q=q, cache=c0, extra_cache=c1, fmt=PLANAR_PAIR[0], extra_fmt=PLANAR_PAIR[1], **common)
    rows = dict(q=q, cache=r0, extra_cache=r1, **common)
    return planar, rows


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_planar_fp8_window_and_planar_fp4_extra_cache_in_one_call(backend):
    """Each scope read with its own page-planar format equals the reference over token-interleaved copies of the
    same tokens (the reference: bit for bit, the same dequantised values)."""
    planar, rows = planar_pair_call()
    want = sparse_attention_decode(**rows, backend="reference")
    got = sparse_attention_decode(**planar, backend=backend)
    check_close(got, want)
    if backend == "reference":
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_combined_index_form_reads_each_cache_in_its_format(backend):
    """One ``(T, W + K)`` list over both caches (FlashInfer's form): its second part read as ``extra_fmt`` says."""
    planar, rows = planar_pair_call(seed=5)
    window = planar["indices"].shape[1]
    comb = torch.cat([planar["indices"], planar["extra_indices"]], dim=1)
    form = dict(indices=comb, lens=torch.full_like(planar["lens"], comb.shape[1]), combined_window=window)

    def combined(kw: dict) -> dict:  # the call's arguments with the combined list in place of the two scopes'
        return {k: v for k, v in kw.items() if k not in ("indices", "lens", "extra_indices", "extra_lens")} | form

    got = sparse_attention_decode(**combined(planar), backend=backend)
    want = sparse_attention_decode(**combined(rows), backend="reference")
    check_close(got, want)


def test_a_remembered_call_reads_each_cache_in_its_declared_format():
    """The Triton path's second call of a signature launches the remembered plan on the caches as declared (the same
    answer); ``extra_fmt`` is part of the signature: the same tensors declared otherwise are checked again."""
    planar, rows = planar_pair_call(seed=9)
    first = sparse_attention_decode(**planar, backend="triton")
    remembered = len(memo.CALLS)
    again = sparse_attention_decode(**planar, backend="triton")  # the remembered plan: no new entry
    assert len(memo.CALLS) == remembered
    assert torch.equal(again[0], first[0]) and torch.equal(again[1], first[1])
    check_close(again, sparse_attention_decode(**rows, backend="reference"))
    with pytest.raises(ValueError, match=r"extra_cache holds fp4_v41 data .* but extra_fmt is 'fp8_v41_planar'"):
        sparse_attention_decode(**dict(planar, extra_fmt="fp8_v41_planar"), backend="triton")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("change,error,match", [
    (dict(extra_fmt="fp4"), ValueError, r"extra_fmt must be None or one of \(.*\), got 'fp4'"),
    (dict(extra_fmt=288), TypeError, r"extra_fmt must be None or a format name"),
    # the extra cache holds 288-byte fp4 tokens: an fp8 name contradicts it
    (dict(extra_fmt="fp8_v41_planar"), ValueError,
     r"extra_cache holds fp4_v41 data \(torch.uint8, last axis 288\) but extra_fmt is 'fp8_v41_planar'"),
    (dict(extra_fmt="fp4_v41_planar", no_extra=True), ValueError,
     r"extra_fmt='fp4_v41_planar' names extra_cache's format, but no extra_cache is given"),
])
def test_a_bad_extra_fmt_is_an_error_naming_it(backend, change, error, match):
    planar, _ = planar_pair_call(num_tokens=2, num_heads=2)
    change = dict(change)  # (the parameter's dict is shared by the backends' cases)
    if change.pop("no_extra", False):
        for name in ("extra_cache", "extra_indices", "extra_lens"):
            del planar[name]
    with pytest.raises(error, match=match):
        sparse_attention_decode(**dict(planar, **change), backend=backend)


def test_the_op_reads_any_two_formats_in_either_order():
    """The op is not the layer: an fp4 first cache beside an fp8 extra cache (a pair no V4.1 layer has) is read as
    declared, on the Triton kernels as by the reference (the layer's pairing rule is ``config.check_scope_formats``)."""
    planar, _ = planar_pair_call(num_tokens=3, num_heads=4)
    planar.update(cache=planar["extra_cache"], extra_cache=planar["cache"], indices=planar["extra_indices"],
                  extra_indices=planar["indices"], lens=planar["extra_lens"], extra_lens=planar["lens"],
                  fmt=PLANAR_PAIR[1], extra_fmt=PLANAR_PAIR[0])
    check_close(sparse_attention_decode(**planar, backend="triton"),
                sparse_attention_decode(**planar, backend="reference"))


def test_without_extra_fmt_fmt_declares_both_caches():
    """``extra_fmt=None`` keeps ``fmt``'s meaning for both caches: a planar fp8 window beside a planar fp4 extra cache
    cannot be declared by one ``fmt`` (the fp4 cache contradicts it), and two planar fp8 caches can."""
    planar, _ = planar_pair_call(num_tokens=2, num_heads=2)
    with pytest.raises(ValueError, match=r"extra_cache holds fp4_v41 data \(torch.uint8, last axis 288\) but fmt is "
                                         r"'fp8_v41_planar'"):
        sparse_attention_decode(**dict(planar, extra_fmt=None), backend="reference")
    same = dict(planar, extra_cache=planar["cache"], extra_indices=planar["indices"], extra_lens=planar["lens"])
    assert torch.equal(sparse_attention_decode(**dict(same, extra_fmt=None), backend="reference")[0],
                       sparse_attention_decode(**dict(same, extra_fmt=PLANAR_PAIR[0]), backend="reference")[0])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt,comp_fmt", [PLANAR_PAIR, ("fp8_v41", "fp8_v41_planar")])
@pytest.mark.parametrize("kind", ["c2a", "c1a"])
def test_a_layer_over_caches_of_different_page_planar_formats_matches_the_dense_oracle(kind, fmt, comp_fmt, backend):
    """A V4.1 layer whose window and compressed caches have different page layouts (on the reference backend, whose
    one-``fmt`` call could not name them before ``extra_fmt``: the layer raised), decodes and prefills in every
    prefill mode."""
    sc = make_scenario([(90, 2), (41, 1), (60, 13)], window=8, topk=12, fmt=fmt, compressed_fmt=comp_fmt,
                       decode_threshold=2, padding=2, seed=4, block_sizes={"swa": 4, "c2a": 4, "c1a": 8},
                       device=DEVICE, kinds=V41_KINDS)
    assert (sc.caches["swa"].fmt.name, sc.caches[kind].fmt.name) == (fmt, comp_fmt)
    sink = torch.tensor([0.5, -math.inf, 2.0], device=DEVICE)
    q = torch.randn(sc.batch.token_capacity, 3, 512, generator=torch.Generator().manual_seed(1))
    q = q.to(torch.bfloat16).to(DEVICE)
    for mode in ("paged", "mixed", "workspace"):
        layer = SparseMLAAttention(kind, 3, window=8, topk=12, sink=sink, prefill_mode=mode,
                                   workspace_bytes=200 * 1024, backend=backend)
        out = layer(q, sc.meta, sc.caches, sc.picks[kind])
        assert not out.isnan().any()
        assert rel_err(out, sc.expected(q, kind, sink=sink, scale=layer.scale)) < 1e-2, mode


def test_the_read_capability_table_has_a_row_per_format_and_the_kernel_sets_follow_it(monkeypatch):
    """formats.READERS is the one place that says which kernel reads which scope formats: a row per format name,
    and the Gluon sets (dispatch), the Triton set (launch_configs), the layer's pairs (config) and the narrow rule
    (gluon.host) read it — a format added as one row reaches all of them."""
    from sparse_mla import config, formats
    from sparse_mla.ops import dispatch, launch_configs
    from sparse_mla.ops.gluon import host

    assert tuple(formats.READERS) == formats.FORMAT_NAMES
    assert launch_configs.TRITON_FORMATS == frozenset(formats.FORMAT_NAMES)
    assert frozenset({"fp8_v41", "fp4_v41_planar"}) in dispatch.GLUON_FORMATS[512]  # V4.1's mixed scopes
    assert not any("fp8_e4m3" in s for sets in dispatch.GLUON_FORMATS.values() for s in sets)
    assert frozenset({"fp8_v4", "bf16"}) not in dispatch.GLUON_FORMATS[512]  # alike only
    assert config.MIXED_SCOPE_ENCODINGS == {("fp8_v41", "fp4_v41")}
    assert host.narrow_heads(frozenset({"fp8_v4"}), 16) and not host.narrow_heads(frozenset({"bf16"}), 16)
    # one new row: a 512-d format the Gluon kernel reads beside fp8_v4, in narrow items too
    monkeypatch.setitem(formats.READERS, "fp8_new", formats.Readers(gluon_dims=(512,), gluon_mix="v4",
                                                                      gluon_narrow=True))
    monkeypatch.setitem(formats.READERS, "fp8_v4", formats.READERS["fp8_v4"]._replace(gluon_mix="v4"))
    assert frozenset({"fp8_v4", "fp8_new"}) in dispatch._gluon_formats(512)
    assert frozenset({"fp8_new"}) not in dispatch._gluon_formats(576)
    assert host.narrow_heads(frozenset({"fp8_new"}), 16) == host.NARROW_HEADS
