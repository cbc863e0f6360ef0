"""The value checks that run only with ``SPARSE_MLA_DEBUG=1`` (docs/checks.md): each documented behaviour of
the fast path without them, and the ``ValueError`` with them. The Triton kernels run on the CPU under
``TRITON_INTERPRET=1`` (tests/conftest.py), at small sizes."""
from __future__ import annotations

import pytest
import torch

from helpers import DEVICE, random_scope, rel_err
from sparse_mla.cache import PagedCache
from sparse_mla.ops import dequantize_and_gather, quantize_and_insert, sparse_attention_decode
from sparse_mla.scenario import make_scenario


@pytest.fixture(params=["without", "with"])
def debug(request, monkeypatch) -> bool:
    """Each test runs twice: without ``SPARSE_MLA_DEBUG`` (the fast path) and with ``SPARSE_MLA_DEBUG=1``."""
    if request.param == "with":
        monkeypatch.setenv("SPARSE_MLA_DEBUG", "1")
    else:
        monkeypatch.delenv("SPARSE_MLA_DEBUG", raising=False)
    return request.param == "with"


def small_case(seed: int, fmt: str = "fp8_v4", lens_mode: str = "random"):
    gen = torch.Generator().manual_seed(seed)
    cache, idx, lens = random_scope(gen, fmt, 512, 4, 12, 2, 8, lens_mode=lens_mode)
    q = torch.randn(4, 3, 512, generator=gen).to(torch.bfloat16).to(DEVICE)
    return cache, idx, lens, q


def test_checks_without_a_sync_run_in_both_modes(debug):
    """Shapes, dtypes and other checks that read no device values raise on the fast path with or without
    ``SPARSE_MLA_DEBUG`` (docs/checks.md, "Always")."""
    cache, idx, lens, q = small_case(8)
    i32 = dict(dtype=torch.int32, device=DEVICE)
    for kwargs, match in ((dict(sink=torch.zeros(2, device=DEVICE)), r"sink must have shape \(3,\)"),
                          (dict(order=torch.arange(4, device=DEVICE)), "order must have dtype torch.int32"),
                          (dict(lens=lens.long()), "lens must have dtype torch.int32"),
                          (dict(indices=idx.reshape(-1), lens=None, indptr=torch.zeros(4, **i32)),
                           r"indptr must have shape \(5,\)"),
                          (dict(scale=float("nan")), "scale must be a positive finite number"),
                          (dict(out=torch.empty(4, 3, 512, dtype=torch.bfloat16, device=DEVICE)[:, :, :256]),
                           "out must have shape")):
        with pytest.raises(ValueError, match=match):
            sparse_attention_decode(q, cache.data, **{"indices": idx, "lens": lens, **kwargs}, backend="triton")


def test_nan_sink(debug):
    """Without the check a NaN sink turns that head's rows NaN; the other heads are right."""
    cache, idx, lens, q = small_case(1, lens_mode="full")
    sink = torch.tensor([float("nan"), 0.5, -1.0], device=DEVICE)
    if debug:
        with pytest.raises(ValueError, match="sink must not be NaN"):
            sparse_attention_decode(q, cache.data, idx, lens, sink=sink, backend="triton")
        return
    out, _ = sparse_attention_decode(q, cache.data, idx, lens, sink=sink, backend="triton")
    ref, _ = sparse_attention_decode(q, cache.data, idx, lens, sink=torch.where(sink.isnan(), 0.0, sink),
                                     backend="reference")
    assert out[:, 0].isnan().all()
    assert rel_err(out[:, 1:], ref[:, 1:]) < 1e-2


def test_order_that_is_not_a_permutation(debug):
    """Without the check the tokens an order names are computed (and right); the others are left unwritten.
    Entries out of range are clamped into it: nothing outside the op's tensors is read or written."""
    cache, idx, lens, q = small_case(2)
    order = torch.tensor([0, 0, 1 << 30, -5], dtype=torch.int32, device=DEVICE)  # 0, 0, 3, 0
    out = torch.full((4, 3, 512), 7.0, dtype=torch.bfloat16, device=DEVICE)
    if debug:
        with pytest.raises(ValueError, match="order holds 1073741824, out of range"):
            sparse_attention_decode(q, cache.data, idx, lens, backend="triton", out=out, order=order)
        return
    sparse_attention_decode(q, cache.data, idx, lens, backend="triton", out=out, order=order)
    ref, _ = sparse_attention_decode(q, cache.data, idx, lens, backend="reference")
    named = [0, 3]
    assert rel_err(out[named], ref[named]) < 1e-2
    assert (out[[1, 2]] == 7.0).all()


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's numpy
@pytest.mark.parametrize("fmt,dim", [("fp8_v4", 512), ("fp8_v32", 576)])
def test_non_finite_latents_into_fp8_caches(debug, fmt, dim):
    """Without the check a NaN / inf latent spoils the scale tile it falls in (what the tile then reads as is
    undefined); the token's other tiles, its bf16 rope and every other token are stored as usual."""
    gen = torch.Generator().manual_seed(3)
    kv = torch.randn(3, dim, generator=gen).to(torch.bfloat16).to(DEVICE)
    bad = kv.clone()
    bad[0, 5], bad[1, 70] = float("nan"), float("inf")  # token 0's tile 0, token 1's tile 1 (fp8_v4) / 0 (fp8_v32)
    slots = torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE)
    cache = PagedCache(1, 4, fmt, dim, DEVICE)
    if debug:
        with pytest.raises(ValueError, match="kv_new must be finite"):
            quantize_and_insert(bad, cache.data, slots, backend="triton")
        return
    quantize_and_insert(bad, cache.data, slots, backend="triton")
    clean = PagedCache(1, 4, fmt, dim, DEVICE)
    quantize_and_insert(kv, clean.data, slots, backend="reference")
    got, want = cache.read(slots), clean.read(slots)
    tile = cache.fmt.tile
    spoilt = {(0, 5 // tile), (1, 70 // tile)}
    for token in range(3):
        for t in range(cache.fmt.num_tiles):
            if (token, t) not in spoilt:
                assert torch.equal(got[token, t * tile:(t + 1) * tile], want[token, t * tile:(t + 1) * tile])
        assert torch.equal(got[token, cache.fmt.nope_dim:], want[token, cache.fmt.nope_dim:])  # the bf16 rope


def test_lens_out_of_range(debug):
    """Without the check each length is clamped into [0, width]."""
    cache, idx, lens, q = small_case(4, lens_mode="full")
    width = idx.shape[1]
    wild = torch.tensor([width + 5, -3, 1 << 30, 5], dtype=torch.int32, device=DEVICE)
    if debug:
        with pytest.raises(ValueError, match=r"lens must lie in \[0, 12\]"):
            sparse_attention_decode(q, cache.data, idx, wild, backend="triton")
        return
    out, lse = sparse_attention_decode(q, cache.data, idx, wild, backend="triton")
    ref, ref_lse = sparse_attention_decode(q, cache.data, idx, wild.clamp(0, width), backend="reference")
    assert (out[1] == 0).all() and torch.isinf(lse[1]).all()  # length -3 reads as 0: no key
    keep = [0, 2, 3]
    assert rel_err(out[keep], ref[keep]) < 1e-2
    assert torch.allclose(lse[keep], ref_lse[keep], atol=2e-3, rtol=1e-3)


def test_indptr_that_is_not_monotone(debug):
    """Without the check each ragged row starts at ``indptr[t]`` clamped into ``[0, capacity]`` and ends at
    ``indptr[t+1]`` clamped into ``[start, capacity]``: a row that goes back is empty, one past the list is cut."""
    cache, idx, _, q = small_case(7, fmt="bf16", lens_mode="full")
    flat = idx.reshape(-1)[:30].contiguous()
    indptr = torch.tensor([4, 9, 2, 1 << 30, -3], dtype=torch.int32, device=DEVICE)  # rows [4,9) [9,9) [2,30) [30,30)
    if debug:
        with pytest.raises(ValueError, match=r"indptr must be nondecreasing from >= 0 to <= 30"):
            sparse_attention_decode(q, cache.data, flat, backend="triton", indptr=indptr)
        return
    out, lse = sparse_attention_decode(q, cache.data, flat, backend="triton", indptr=indptr)
    rows = torch.full((4, 30), -1, dtype=torch.int32, device=DEVICE)
    rows[0, :5], rows[2, :28] = flat[4:9], flat[2:30]
    ref, ref_lse = sparse_attention_decode(q, cache.data, rows, torch.tensor([5, 0, 28, 0], dtype=torch.int32,
                                                                             device=DEVICE), backend="reference")
    assert rel_err(out, ref) < 1e-2 and (out[[1, 3]] == 0).all() and torch.isinf(lse[[1, 3]]).all()
    assert torch.allclose(lse[[0, 2]], ref_lse[[0, 2]], atol=2e-3, rtol=1e-3)


def test_indices_and_slots_out_of_range(debug):
    """Without the check an out-of-range index is a ``-1`` (never read), an out-of-range slot_mapping entry
    is skipped on insert and an out-of-range slot gathers zeros."""
    cache, idx, lens, q = small_case(5, fmt="bf16", lens_mode="full")
    wild = idx.clone()
    wild[:, ::3] = cache.num_slots + 7
    wild[0, 1] = -9
    kv = torch.ones(2, 512, dtype=torch.bfloat16, device=DEVICE)
    slots = torch.tensor([cache.num_slots, 1], dtype=torch.int32, device=DEVICE)
    if debug:
        for call, name in ((lambda: sparse_attention_decode(q, cache.data, wild, lens, backend="triton"), "indices"),
                           (lambda: quantize_and_insert(kv, cache.data, slots, backend="triton"), "slot_mapping"),
                           (lambda: dequantize_and_gather(cache.data, slots, backend="triton"), "slots")):
            with pytest.raises(ValueError, match=f"{name} holds"):
                call()
        return
    out, _ = sparse_attention_decode(q, cache.data, wild, lens, backend="triton")
    cleaned = torch.where((wild >= cache.num_slots) | (wild < 0), -1, wild)
    ref, _ = sparse_attention_decode(q, cache.data, cleaned, lens, backend="reference")
    assert rel_err(out, ref) < 1e-2
    before = cache.data.clone()
    quantize_and_insert(kv, cache.data, slots, backend="triton")
    others = [0, *range(2, cache.num_slots)]  # only slot 1 is written (bits compared: the cache holds NaNs)
    bits, bits_before = cache.data.view(torch.int16).view(-1, 512), before.view(torch.int16).view(-1, 512)
    assert torch.equal(bits[others], bits_before[others])
    assert (cache.read(slots[1:]) == 1).all()
    gathered = dequantize_and_gather(cache.data, slots, backend="triton")
    assert (gathered[0] == 0).all() and (gathered[1] == 1).all()


def test_c4a_picks_below_minus_one_or_past_the_model_length(debug):
    """Without the check the step metadata drops such picks, like the picks a token cannot see yet."""
    sc = make_scenario([(600, 1), (300, 3)], topk=8, decode_threshold=1, seed=6, device=DEVICE)
    picks = sc.topk_local.clone()
    wild = picks.clone()
    wild[0, 0], wild[1, 1] = -7, sc.batch.max_model_len  # past max_model_len // 4 entries
    if debug:
        with pytest.raises(ValueError, match="topk_indices holds"):
            sc.meta.c4a_indices(wild)
        return
    got_idx, got_lens = (t.clone() for t in sc.meta.c4a_indices(wild))
    dropped = picks.clone()
    dropped[0, 0], dropped[1, 1] = -1, -1
    want_idx, want_lens = sc.meta.c4a_indices(dropped)
    assert torch.equal(got_lens, want_lens) and torch.equal(got_idx, want_idx)


def test_checks_md_covers_every_public_name():
    """docs/checks.md says what each public function and class checks: every name the package, its ops and its
    FlashMLA API export, and the public entry points of other modules, appears there (in a code span)."""
    import re
    from pathlib import Path

    import sparse_mla
    import sparse_mla.flash_mla
    import sparse_mla.ops

    text = (Path(__file__).parents[1] / "docs" / "checks.md").read_text()
    spans = " ".join(re.findall(r"`([^`]+)`", text))
    elsewhere = ["enable_sparse_mla", "lower_as", "StepGraph", "BlockAllocator", "allocate_cache"]
    names = [n for n in sparse_mla.__all__ if n != "__version__"] + list(sparse_mla.ops.__all__) + \
        list(sparse_mla.flash_mla.__all__) + elsewhere
    missing = [n for n in names if not re.search(rf"\b{n}\b", spans)]
    assert not missing, f"docs/checks.md does not list {missing}"
