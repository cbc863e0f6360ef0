"""The public attention ops' remembered calls (``sparse_mla.ops.memo``): a Triton-path call of a seen signature skips
the checks and the planning and launches the remembered plan on its own tensors; it gives what the checked path
gives, for new tensors and new values too; any change of signature (a shape, a dtype, strides, alignment, a
format, an optional argument present or absent, a scalar) goes the checked path again, so a bad call after a good
one of the same shapes still raises the checks' error; debug mode checks every call in full.

The Triton path runs on a GPU, or on the CPU in Triton's interpreter (``backend="triton"``)."""
from __future__ import annotations

import gc
import weakref
from collections import OrderedDict

import pytest
import torch

from helpers import DEVICE, KERNEL_RUNS, ON_GPU, check_close, random_scope, random_sink
from sparse_mla import ops
from sparse_mla.cache import PagedCache
from sparse_mla.index_forms import combined_from_padded, ragged_from_padded
from sparse_mla.ops import attention_plan, longest_first, memo, sparse_attention_decode, sparse_attention_prefill

pytestmark = pytest.mark.skipif(not KERNEL_RUNS, reason="the Triton kernels need a GPU or TRITON_INTERPRET=1")
BACKEND = "auto" if ON_GPU else "triton"


@pytest.fixture
def checked(monkeypatch):
    """An empty memo, no debug mode; counts the calls that went the checked path (decode and prefill)."""
    monkeypatch.setattr(memo, "CALLS", OrderedDict())
    monkeypatch.delenv("SPARSE_MLA_DEBUG", raising=False)
    calls = []
    for name in ("checked_decode", "prefill_args"):
        real = getattr(ops, name)
        monkeypatch.setattr(ops, name, lambda *a, real=real, name=name, **k: calls.append(name) or real(*a, **k))
    return calls


def two_scopes(gen, fmt="fp8_v4", tokens=3, heads=2, widths=(16, 32), blocks=4):
    """A two-scope decode call's tensors (``sparse_attention_decode``'s keyword arguments)."""
    (c0, i0, l0), (c1, i1, l1) = [random_scope(gen, fmt, 512, tokens, w, blocks, 16) for w in widths]
    q = torch.randn(tokens, heads, 512, generator=gen).to(torch.bfloat16).to(DEVICE)
    return dict(q=q, cache=c0.data, indices=i0, lens=l0, extra_cache=c1.data, extra_indices=i1, extra_lens=l1,
                sink=random_sink(gen, heads))


def decode(case, backend=BACKEND, **kw):
    return sparse_attention_decode(**{"scale": 0.05, **case, **kw}, backend=backend)


def equal(got, want):
    return all(torch.equal(x, y) for x, y in zip(got, want))


def relocated(cache: torch.Tensor, offset: int) -> torch.Tensor:
    """A copy of a uint8 cache with its strides, ``offset`` bytes into a fresh buffer (another alignment of the same
    bytes)."""
    raw = torch.zeros(offset + cache.shape[0] * cache.stride(0), dtype=torch.uint8, device=cache.device)
    return torch.as_strided(raw, cache.shape, cache.stride(), offset).copy_(cache)


def test_a_repeated_call_is_remembered_and_gives_the_checked_result(checked):
    case = two_scopes(torch.Generator().manual_seed(0))
    first = decode(case)
    assert checked == ["checked_decode"] and len(memo.CALLS) == 1
    for _ in range(2):
        assert equal(decode(case), first)
    assert len(checked) == 1
    check_close(first, decode(case, backend="reference"))


def test_a_remembered_call_reads_its_own_tensors_and_their_new_values(checked):
    gen = torch.Generator().manual_seed(1)
    case = two_scopes(gen)
    first = decode(case)
    other = two_scopes(gen)  # every tensor new (caches too), of the same geometry
    got = decode(other)
    assert len(checked) == 1 and not equal(got, first)
    check_close(got, decode(other, backend="reference"))
    other["q"].copy_(case["q"])  # new values in place: read by the next call
    other["sink"].copy_(case["sink"])
    check_close(decode(other), decode(other, backend="reference"))
    assert len(checked) == 3  # the first call and the two reference calls


def test_each_change_of_signature_goes_the_checked_path(checked):
    gen = torch.Generator().manual_seed(2)
    case = two_scopes(gen)
    base = decode(case)
    seen = len(checked)

    def twice(changed, remembered=True, **kw):
        """The first call of a changed signature is checked; the second is remembered (unless it cannot be)."""
        nonlocal seen
        first = [t.clone() for t in decode(changed, **kw)]  # (out, when given, is written again below)
        assert len(checked) == seen + 1, "a changed signature must be checked"
        again = decode(changed, **kw)
        seen += 2 - remembered
        assert len(checked) == seen and equal(again, first)
        check_close(first, decode(changed, backend="reference", **kw))
        seen += 1  # the reference call is checked too
        return first

    assert not equal(twice(case, scale=0.01), base)  # a scalar
    assert equal(twice(case, fmt="fp8_v4"), base)  # the format named
    twice(dict(case, sink=None))  # an optional argument absent
    twice(dict(case, lens=None))  # full rows: the full lens stand in
    assert equal(twice(case, order=longest_first(case["lens"], case["extra_lens"])), base)
    out = torch.empty(3, 2, 512, dtype=torch.bfloat16, device=DEVICE)
    assert equal(twice(case, out=out), base)
    twice(case, batch_invariant=True)
    one = {k: v for k, v in case.items() if not k.startswith("extra_")}
    twice(one)  # one scope
    twice(dict(case, lens=case["lens"][:1], extra_lens=case["extra_lens"][:1]), tokens_per_len=3)
    # another alignment of the same bytes (on Hopper the 16-byte alignment picks the kernel), more blocks, another
    # format, another shape of q
    twice(dict(case, cache=relocated(case["cache"], 4)))
    twice(two_scopes(gen, blocks=5))
    twice(two_scopes(gen, fmt="bf16"))
    twice(two_scopes(gen, tokens=4, heads=3))
    # strided index rows are copied by the checks: never remembered
    wide = torch.full((3, 32), -1, dtype=torch.int32, device=DEVICE)
    wide[:, ::2] = case["indices"]
    assert equal(twice(dict(case, indices=wide[:, ::2]), remembered=False), base)
    assert equal(decode(case), base) and len(checked) == seen  # the first signature is still remembered
    assert all(len(sig[0]) == 14 for sig in memo.CALLS)


def test_the_ragged_and_combined_forms_are_remembered(checked):
    gen = torch.Generator().manual_seed(3)
    case = two_scopes(gen)
    tokens = case["q"].shape[0]
    for indices, lens, prefix in ((case["indices"], case["lens"], ""), (case["extra_indices"], case["extra_lens"],
                                                                         "extra_")):
        indptr = torch.empty(tokens + 1, dtype=torch.int32, device=DEVICE)
        flat = torch.full((int(lens.sum()) + 3,), -1, dtype=torch.int32, device=DEVICE)
        ragged_from_padded(indices, lens, indptr, flat)
        ragged = dict(case, **{f"{prefix}indices": flat, f"{prefix}lens": None})
        first = decode(ragged, **{f"{prefix}indptr": indptr})
        flat.copy_(flat.flip(0))  # new values in the same flat list: read by the remembered call
        got = decode(ragged, **{f"{prefix}indptr": indptr})
        check_close(got, decode(ragged, backend="reference", **{f"{prefix}indptr": indptr}))
        assert not equal(got, first)
    assert checked.count("checked_decode") == 4  # two forms checked once each, and the two reference calls
    window = case["indices"].shape[1]
    rows = torch.empty(tokens, window + case["extra_indices"].shape[1], dtype=torch.int32, device=DEVICE)
    row_lens = torch.empty(tokens, dtype=torch.int32, device=DEVICE)
    combined_from_padded(case["indices"], case["lens"], case["extra_indices"], case["extra_lens"], rows, row_lens)
    combined = dict(case, indices=rows, lens=row_lens, extra_indices=None, extra_lens=None)
    first = decode(combined, combined_window=window)
    check_close(first, decode(case, backend="reference"))
    assert equal(decode(combined, combined_window=window), first)
    row_lens.copy_(torch.tensor([window] * tokens, dtype=torch.int32))  # the SWA part alone
    check_close(decode(combined, combined_window=window),
                decode(dict(case, extra_lens=torch.zeros_like(case["extra_lens"])), backend="reference"))
    assert checked.count("checked_decode") == 7


def test_a_bad_call_after_a_remembered_one_still_raises(checked, monkeypatch):
    gen = torch.Generator().manual_seed(4)
    case = two_scopes(gen)
    out = torch.empty_like(case["q"])
    decode(case, out=out)
    decode(case, out=out)
    assert len(checked) == 1
    bad = [
        (dict(case), dict(out=case["q"]), "out overlaps q"),  # the remembered signature: only pointers differ
        (dict(case, sink=case["sink"][:1]), {}, "sink"),
        (dict(case, indices=case["indices"].long()), {}, "indices must have dtype"),
        (dict(case, lens=case["lens"][:2]), {}, "lens must have shape"),
        (dict(case, extra_indices=None), {}, "extra_cache and extra_indices"),
        (dict(case, indptr=torch.zeros(4, dtype=torch.int32, device=DEVICE)), {}, "lens must be None when indptr"),
        (case, dict(scale=-1.0), "scale must be a positive finite"),
        (case, dict(fmt="bf16"), "holds fp8_v4 data"),
        (case, dict(tokens_per_len=2), "tokens_per_len must be a positive int dividing"),
        (case, dict(kv_scale=0.5), "kv_scale is only for fp8_e4m3"),
        # the same bytes one byte off a 4-byte boundary; a cache of another format and byte size (fp8_e4m3's 512)
        (dict(case, cache=relocated(case["cache"], 1)), {}, "4-byte boundary"),
        (dict(case, cache=PagedCache(4, 16, "fp8_e4m3", kv_scale=1.0, device=DEVICE).data), {}, "kv_scale is required"),
    ]
    for changed, kw, message in bad:
        with pytest.raises(ValueError, match=message):
            decode(changed, **kw)
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        decode(dict(case, q=case["q"].tolist()))
    with pytest.raises(ValueError, match="backend must be"):
        decode(case, backend="cuda")
    # debug mode: every call checked in full, value checks included, for a remembered signature too
    monkeypatch.setenv("SPARSE_MLA_DEBUG", "1")
    beyond = case["indices"].clone()
    beyond[0, 0] = 4 * 16
    with pytest.raises(ValueError, match="indices holds 64, out of range"):
        decode(dict(case, indices=beyond), out=out)
    with pytest.raises(ValueError, match="sink must not be NaN"):
        decode(dict(case, sink=torch.full_like(case["sink"], float("nan"))), out=out)
    assert len(memo.CALLS) == 1


def test_fp8_e4m3_scales_numbers_and_tensors(checked):
    gen = torch.Generator().manual_seed(5)
    tokens, heads = 3, 2
    cache = PagedCache(4, 16, "fp8_e4m3", kv_scale=0.02, device=DEVICE)
    cache.write((torch.randn(cache.num_slots, 512, generator=gen) * 2).to(torch.bfloat16).to(DEVICE),
                torch.arange(cache.num_slots, dtype=torch.int32, device=DEVICE))
    indices = torch.randint(0, cache.num_slots, (tokens, 16), generator=gen, dtype=torch.int32).to(DEVICE)
    case = dict(q=torch.randn(tokens, heads, 512, generator=gen).to(torch.bfloat16).to(DEVICE), cache=cache.data,
                indices=indices)
    scale = torch.tensor([0.02], device=DEVICE)
    first = decode(case, kv_scale=scale)
    assert equal(decode(case, kv_scale=scale), first) and len(checked) == 1
    scale.fill_(0.03)  # a new value in the engine's scale tensor: read at run time
    check_close(decode(case, kv_scale=scale), decode(case, kv_scale=0.03, backend="reference"))
    check_close(decode(case, kv_scale=torch.tensor([0.04], device=DEVICE)),
                decode(case, kv_scale=0.04, backend="reference"))
    assert len(checked) == 3  # the tensors went the remembered path
    by_number = [decode(case, kv_scale=s) for s in (0.03, 0.04, 0.03)]  # a number's value is in the signature
    assert len(checked) == 5 and equal(by_number[0], by_number[2]) and not equal(by_number[0], by_number[1])


def test_prefill_is_remembered(checked):
    gen = torch.Generator().manual_seed(6)
    tokens, heads, rows = 3, 2, 40

    def case(n=rows):
        kv = torch.randn(n, 512, generator=gen).to(torch.bfloat16).to(DEVICE)
        idx = torch.randint(-1, n, (tokens, 16), generator=gen, dtype=torch.int32).to(DEVICE)
        q = torch.randn(tokens, heads, 512, generator=gen).to(torch.bfloat16).to(DEVICE)
        return q, kv, idx, torch.tensor([16, 0, 9], dtype=torch.int32, device=DEVICE)

    def prefill(args, backend=BACKEND):
        return sparse_attention_prefill(*args, scale=0.05, backend=backend)

    first_case = case()
    first = prefill(first_case)
    assert equal(prefill(first_case), first) and checked == ["prefill_args"]
    other = case()  # a new workspace of the same rows
    check_close(prefill(other), prefill(other, backend="reference"))
    assert len(checked) == 2  # the reference call
    longer = case(rows + 8)
    check_close(prefill(longer), prefill(longer, backend="reference"))
    assert len(checked) == 4


def test_a_new_plan_cache_or_split_size_plans_anew(checked, monkeypatch):
    """Plans follow ``attention_plan``'s plan cache: a test that empties it (to plan under forced launch
    configurations) or changes the batch-invariant split size meets no remembered plan of before."""
    case = two_scopes(torch.Generator().manual_seed(7))
    decode(case)
    decode(case, batch_invariant=True)
    monkeypatch.setattr(attention_plan, "INVARIANT_SPLIT_BLOCKS", 1)
    decode(case, batch_invariant=True)
    decode(case)
    assert len(checked) == 3
    monkeypatch.setattr(attention_plan, "_PLANS", OrderedDict())
    decode(case)
    assert len(checked) == 4


def test_the_memo_is_bounded(checked, monkeypatch):
    monkeypatch.setattr(memo, "MAX_CALLS", 2)
    case = two_scopes(torch.Generator().manual_seed(8), widths=(16,) * 2)
    for scale in (0.1, 0.2, 0.3):
        decode(case, scale=scale)
    assert len(memo.CALLS) == 2
    decode(case, scale=0.1)  # the least recently used went out: checked again
    assert len(checked) == 4


@pytest.mark.skipif(not ON_GPU, reason="the bound launch is the GPU's direct launch path")
@pytest.mark.parametrize("tokens,widths", [(160, (128, 512)), (4, (128, 1024))])
def test_a_bound_launch_equals_the_checked_path_bit_for_bit(checked, monkeypatch, tokens, widths):
    """An unsplit grid or split key lists: from the second remembered call on, the bound launches run on the new
    tensors and give exactly what the checked path gives, keeping none of them."""
    gen = torch.Generator().manual_seed(9)

    def inputs():
        return two_scopes(gen, tokens=tokens, heads=64, widths=widths, blocks=80)

    first = [inputs() for _ in range(2)]
    got = [decode(case) for case in first]  # checked and remembered, then the first remembered call, which binds
    entry = next(iter(memo.CALLS.values()))
    assert len(checked) == 1 and callable(entry.bound.bound)
    refs = [weakref.ref(t) for case in first for t in case.values()] + [weakref.ref(t) for t in got[0]]
    del first, got
    gc.collect()
    assert all(r() is None for r in refs)  # the memo and its bound launch keep none of their calls' tensors
    for _ in range(2):
        case = inputs()
        got = decode(case)
        monkeypatch.setenv("SPARSE_MLA_DEBUG", "1")  # the checked path
        want = decode(case)
        monkeypatch.delenv("SPARSE_MLA_DEBUG")
        assert equal(got, want)


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs")
def test_a_remembered_call_is_captured_in_a_cuda_graph(checked):
    gen = torch.Generator().manual_seed(10)
    case = two_scopes(gen, tokens=32, heads=64, widths=(128, 512), blocks=80)
    out = torch.empty(32, 64, 512, dtype=torch.bfloat16, device=DEVICE)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up off the default stream: checked, remembered, bound
        for _ in range(2):
            decode(case, out=out)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _, lse = decode(case, out=out)
    assert len(checked) == 1
    other = two_scopes(gen, tokens=32, heads=64, widths=(128, 512), blocks=80)
    for name in ("q", "indices", "lens", "extra_indices", "extra_lens", "sink"):
        case[name].copy_(other[name])
    case["cache"].copy_(other["cache"])
    case["extra_cache"].copy_(other["extra_cache"])
    graph.replay()
    torch.cuda.synchronize()
    check_close((out, lse), decode(other, backend="reference"))


@pytest.mark.parametrize("moved", ["q", "cache", "indices", "lens"])
def test_a_meta_tensor_is_not_a_remembered_cpu_signature(moved):
    """``get_device()`` is -1 for the CPU and the meta device alike: a remembered call's signature holds the device
    itself, so a meta tensor where a CPU call was remembered takes the checked path (the device check), never a
    kernel launch on a tensor without data."""
    gen = torch.Generator().manual_seed(0)
    cache, idx, lens = random_scope(gen, "bf16", 512, 2, 4, 2, 4)
    q = torch.randn(2, 2, 512, generator=gen).to(torch.bfloat16).to(DEVICE)
    args = dict(q=q, cache=cache.data, indices=idx, lens=lens)
    for _ in range(2):  # checked, then remembered
        sparse_attention_decode(**args, backend="triton")
    args[moved] = args[moved].to("meta")
    with pytest.raises(ValueError, match=r"must be on .*, got meta|must be on cache's device meta|"
                                         r"needs CUDA tensors \(got meta\)|is on the meta device"):
        sparse_attention_decode(**args, backend="triton")
