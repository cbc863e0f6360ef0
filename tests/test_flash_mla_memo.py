"""flash_mla_with_kvcache's remembered calls (sparse_mla.flash_mla): a call of a seen signature skips the checks and
launches the remembered plan; it gives what the checked path gives, for new values too, and any change of signature
(cache format, shape or alignment, a strided view, the scale, the sink) goes the checked path again.

The Triton path runs on a GPU, or on the CPU in Triton's interpreter (``BACKEND = "triton"``)."""
from __future__ import annotations

import gc
import weakref

import pytest
import torch

from helpers import DEVICE, KERNEL_RUNS, ON_GPU
from sparse_mla import flash_mla, ops
from sparse_mla.flash_mla import flash_mla_with_kvcache, get_mla_metadata
from test_flash_mla_api import call_decode, paged, reference_decode, slots, v4_case

pytestmark = pytest.mark.skipif(not KERNEL_RUNS, reason="the Triton kernels need a GPU or TRITON_INTERPRET=1")


@pytest.fixture
def checked(monkeypatch):
    """The Triton path with an empty memo; counts the calls that went the checked path."""
    monkeypatch.setattr(flash_mla, "BACKEND", "triton")
    monkeypatch.setattr(flash_mla, "_DECODES", type(flash_mla._DECODES)())
    monkeypatch.delenv("SPARSE_MLA_DEBUG", raising=False)
    calls = []
    real = ops.checked_decode
    monkeypatch.setattr(ops, "checked_decode", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def on_device(case, device=DEVICE):
    """The case's tensors on ``device`` with their strides (``.to`` would pack a cache's padded pages)."""
    return {k: torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=device).copy_(v)
            for k, v in case.items()}


def equal(got, want):
    return all(torch.equal(x, y) for x, y in zip(got, want))


def close(got, want):
    """Equal up to the kernel (on a Hopper GPU an unaligned cache runs the Triton kernel, an aligned one Gluon's)."""
    (out, lse), (ref_out, ref_lse) = got, want
    finite = torch.isfinite(ref_lse)
    return ((out.float() - ref_out.float()).norm() <= 1e-2 * ref_out.float().norm()
            and torch.equal(torch.isfinite(lse), finite) and torch.allclose(lse[finite], ref_lse[finite], atol=2e-3,
                                                                            rtol=1e-3))


def relocated(cache: torch.Tensor, offset: int, extra_blocks: int = 0) -> torch.Tensor:
    """A copy of a uint8 FlashMLA cache with its strides, ``offset`` bytes into a fresh 16-byte aligned buffer,
    with ``extra_blocks`` zero blocks after its own."""
    num_blocks = cache.shape[0] + extra_blocks
    raw = torch.zeros(offset + num_blocks * cache.stride(0), dtype=torch.uint8, device=cache.device)
    out = torch.as_strided(raw, (num_blocks, *cache.shape[1:]), cache.stride(), offset)
    out[: cache.shape[0]] = cache
    return out


def test_a_seen_signature_skips_the_checks_and_gives_the_checked_result(checked, monkeypatch):
    gen = torch.Generator().manual_seed(0)
    case = on_device(v4_case(gen))
    first = call_decode(case, softmax_scale=0.07)
    again = call_decode(case, softmax_scale=0.07)
    assert len(checked) == 1 and len(flash_mla._DECODES) == 1
    assert equal(again, first)
    assert again[1].stride() == first[1].stride()  # lse: FlashMLA's transposed view
    monkeypatch.setenv("SPARSE_MLA_DEBUG", "1")  # every call checked in full (value checks too)
    assert equal(call_decode(case, softmax_scale=0.07), first) and len(checked) == 2
    # new values in the same geometry: the remembered call reads them (nothing but geometry is remembered)
    monkeypatch.delenv("SPARSE_MLA_DEBUG")
    other = dict(case, q=torch.randn(case["q"].shape, generator=gen).to(torch.bfloat16).to(DEVICE),
                 indices=slots(3, 2, 32, 192, gen).to(DEVICE),
                 topk_length=torch.tensor([4, 32, 17], dtype=torch.int32, device=DEVICE),
                 attn_sink=torch.randn(6, generator=gen).to(DEVICE))
    got = call_decode(other, softmax_scale=0.07)
    assert len(checked) == 2
    want = reference_decode(on_device(other, "cpu"), scale=0.07)
    assert close([x.cpu() for x in got], want)


def test_a_changed_signature_goes_the_checked_path(checked):
    gen = torch.Generator().manual_seed(1)
    case = on_device(v4_case(gen))
    base = call_decode(case)
    n = 1

    def fresh(changed, **kw):
        nonlocal n
        got = call_decode(changed, **kw)
        n += 1
        assert len(checked) == n, "a changed signature must be checked"
        return got

    # another format (bf16), another shape (more blocks), another 16-byte alignment of the same bytes
    bf16 = dict(case, k_cache=paged("bf16", 3, 64, 512, gen).to(DEVICE),  # both caches: FlashMLA's pairs share one
                extra_k_cache=paged("bf16", 24, 2, 512, gen).to(DEVICE))
    assert not equal(fresh(bf16), base)
    bigger, shifted = relocated(case["k_cache"], 0, extra_blocks=1), relocated(case["k_cache"], 4)
    assert equal(fresh(dict(case, k_cache=bigger)), base)
    assert shifted.data_ptr() % 16 != case["k_cache"].data_ptr() % 16
    assert close(fresh(dict(case, k_cache=shifted)), base)
    # a strided view of the indices: copied by the checks, so never remembered
    wide = torch.full((3, 2, 64), -1, dtype=torch.int32, device=DEVICE)
    wide[..., ::2] = case["indices"]
    strided = dict(case, indices=wide[..., ::2])
    assert equal(fresh(strided), base) and equal(fresh(strided), base)
    # the scale, the sink's presence
    assert not equal(fresh(case, softmax_scale=0.01), base)
    no_sink = dict(case, attn_sink=None)
    assert not equal(fresh(no_sink), base)
    assert equal(call_decode(no_sink), fresh(no_sink, is_fp8_kvcache=True)) and len(checked) == n
    assert equal(call_decode(case), base) and len(checked) == n  # the first signature is still remembered


def test_errors_keep_flashmla_names_after_a_remembered_call(checked):
    gen = torch.Generator().manual_seed(2)
    case = on_device(v4_case(gen, b=2, s_q=1, h=3))
    call_decode(case)
    call_decode(case)
    with pytest.raises(ValueError, match="topk_length"):
        call_decode(dict(case, topk_length=case["topk_length"].to(torch.int64)))
    with pytest.raises(ValueError, match="attn_sink"):
        call_decode(dict(case, attn_sink=case["attn_sink"][:2]))
    with pytest.raises(ValueError, match="softmax_scale"):
        call_decode(case, softmax_scale=-1.0)
    with pytest.raises(TypeError, match="tile_scheduler_metadata"):
        flash_mla_with_kvcache(case["q"], case["k_cache"], None, None, 512, object(), indices=case["indices"])


@pytest.mark.parametrize("sliced", ["q", "indices", "extra_indices_in_kvcache"])
def test_a_call_whose_rows_needed_a_copy_is_checked_every_time(checked, sliced):
    """A q or index tensor whose batch and token axes do not merge into rows (a slice ``x[:, :s_q]`` of a longer
    buffer) is copied by the checks; such a call is never remembered, so later calls of its signature cannot
    launch on the raw tensor as if it were the copy."""
    gen = torch.Generator().manual_seed(9)
    cases = []
    for _ in range(3):
        case = on_device(v4_case(gen))
        wide = torch.cat([case[sliced], case[sliced]], dim=1)  # (b, 2·s_q, …): [:, :s_q] does not merge
        case[sliced] = wide[:, :2]
        cases.append((case, call_decode(case)))
    assert len(checked) == 3 and not flash_mla._DECODES
    for case, got in cases:
        assert close(got, reference_decode(case))


def test_the_memo_is_bounded(checked, monkeypatch):
    monkeypatch.setattr(flash_mla, "_MAX_DECODES", 2)
    gen = torch.Generator().manual_seed(3)
    case = on_device(v4_case(gen, b=2, s_q=1, h=3))
    sched, _ = get_mla_metadata()
    for scale in (0.1, 0.2, 0.3):
        call_decode(case, sched, softmax_scale=scale)
    assert len(flash_mla._DECODES) == 2
    call_decode(case, sched, softmax_scale=0.1)  # the least recently used went out: checked again
    assert len(checked) == 4


@pytest.mark.skipif(not ON_GPU, reason="the bound launch is the GPU's direct launch path")
@pytest.mark.parametrize("b,topk,split", [(160, 128, False), (4, 1024, True)])
def test_a_bound_launch_equals_the_checked_path_bit_for_bit(checked, monkeypatch, b, topk, split):
    """An unsplit grid (one launch) or split key lists (the attention and the combine): from the second remembered
    call on, the bound launches run on the new tensors and give exactly what the checked path gives; an unaligned q
    is another signature."""
    gen = torch.Generator().manual_seed(4)
    heads = 64
    cache = on_device({"c": paged("fp8_v4", 40, 64, 512, gen)})["c"]
    sched, _ = get_mla_metadata()

    def inputs():
        q = torch.randn(b, 1, heads, 512, generator=gen).to(torch.bfloat16).to(DEVICE)
        idx = slots(b, 1, topk, 40 * 64, gen).to(DEVICE)
        return q, idx, torch.randn(heads, generator=gen).to(DEVICE)

    def call(q, idx, sink):
        return flash_mla_with_kvcache(q, cache, None, None, 512, sched, None, 0.05, indices=idx, attn_sink=sink)

    first = [inputs() for _ in range(2)]
    first += [call(*args) for args in first]  # checked and remembered, then the first remembered call, which binds
    memo = next(iter(flash_mla._DECODES.values()))
    assert len(checked) == 1 and callable(memo.bound.bound) and memo.plan.partial == split
    refs = [weakref.ref(t) for group in first for t in group]
    del first
    gc.collect()
    assert all(r() is None for r in refs)  # the memo and its bound launch keep none of their calls' tensors
    for _ in range(3):
        args = inputs()
        got = call(*args)
        monkeypatch.setenv("SPARSE_MLA_DEBUG", "1")  # the checked path
        want = call(*args)
        monkeypatch.delenv("SPARSE_MLA_DEBUG")
        assert equal(got, want) and got[1].stride() == want[1].stride()
    q, idx, sink = inputs()
    shifted = torch.empty(q.numel() + 4, dtype=q.dtype, device=DEVICE)[4:].view(q.shape).copy_(q)
    before = len(checked)
    assert close(call(shifted, idx, sink), call(q, idx, sink)) and len(checked) == before + 1
