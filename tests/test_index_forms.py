"""The ragged (ROCm AITER) and combined (FlashInfer TRTLLM-gen) index forms: builders and the ops reading them.

Each form must give the padded two-scope form's outputs, on the reference and on the Triton kernel (its CPU
interpreter here), and the dense oracle's.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from dense import dense_attention
from helpers import examples
from sparse_mla.cache import PagedCache
from sparse_mla.index_forms import _ragged_torch, combined_from_padded, combined_from_picks, ragged_from_padded
from sparse_mla.metadata import MetadataSpec, build_step_metadata
from sparse_mla.ops import sparse_attention_decode, sparse_attention_prefill
from sparse_mla.ops.triton.index import ragged_from_padded as ragged_from_padded_kernel
from test_metadata import make_batch

BACKENDS = ["reference", "triton"]
# These tests build CPU tensors for Triton's interpreter; on a GPU machine the same kernels run through the layer
# on CUDA tensors in tests/test_layer_forms.py (run on an H100), so here they run on the CPU only.
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors for the interpreter; on a GPU see "
                                                                  "tests/test_layer_forms.py")
# (on the CPU the Triton kernel reads every form's keys in the same order: bitwise the same results)


def padded_rows(gen: torch.Generator, num_tokens: int, width: int, num_slots: int, lens_kind: str, repeat: bool):
    """Random valid-prefix rows: ``(indices (T, width), lens (T,))``, ``-1`` after each row's length. lens_kind:
    ``random`` (incl. empty rows), ``empty`` (every row empty) or ``invalid`` (full lengths of ``-1`` entries).
    repeat: MTP-like consecutive tokens of one request, rows equal up to their last entry."""
    idx = torch.randint(0, num_slots, (num_tokens, width), generator=gen, dtype=torch.int32)
    lens = torch.randint(0, width + 1, (num_tokens,), generator=gen, dtype=torch.int32)
    if lens_kind == "empty":
        lens.zero_()
    elif lens_kind == "invalid":
        lens.fill_(width)
        idx.fill_(-1)
    if repeat and num_tokens > 1:
        idx[1:] = idx[:1]
        lens = torch.minimum(lens[:1] + torch.arange(num_tokens, dtype=torch.int32), torch.tensor(width)).int()
    j = torch.arange(width)[None, :]
    return torch.where(j < lens[:, None], idx, -1).int(), lens


def to_ragged(indices: torch.Tensor, lens: torch.Tensor, spare: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    indptr = torch.empty(indices.shape[0] + 1, dtype=torch.int32)
    flat = torch.empty(int(lens.clamp(0, indices.shape[1]).sum()) + spare, dtype=torch.int32)
    ragged_from_padded(indices, lens, indptr, flat)
    return indptr, flat


def filled_cache(gen: torch.Generator, num_blocks: int, block_size: int, fmt: str = "bf16"):
    cache = PagedCache(num_blocks, block_size, fmt, kv_scale=0.02 if fmt == "fp8_e4m3" else None)
    kv = torch.randn(cache.num_slots, 512, generator=gen).bfloat16()
    cache.write(kv, torch.arange(cache.num_slots, dtype=torch.int32))
    return cache, cache.read(torch.arange(cache.num_slots)).double()


def assert_same(got, want, exact: bool):
    (out, lse), (ref_out, ref_lse) = got, want
    if exact:
        assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    else:
        assert torch.allclose(out.float(), ref_out.float(), atol=1e-2, rtol=0)
        assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
        assert torch.allclose(lse[torch.isfinite(lse)], ref_lse[torch.isfinite(ref_lse)], atol=1e-4)


# ---------------------------------------------------------------------------------------------------------------
# builders


@settings(max_examples=examples(25), deadline=None)
@given(num_tokens=st.integers(1, 9), width=st.integers(1, 40), spare=st.integers(-5, 6),
       lens_kind=st.sampled_from(["random", "empty", "invalid"]), seed=st.integers(0, 99))
def test_ragged_from_padded_torch_and_triton_agree_and_keep_every_row(num_tokens, width, spare, lens_kind, seed):
    gen = torch.Generator().manual_seed(seed)
    idx, lens = padded_rows(gen, num_tokens, width, 50, lens_kind, repeat=False)
    lens[0] = width + 7  # clamped to the width
    total = int(lens.clamp(0, width).sum())
    capacity = max(0, total + spare)  # spare < 0: too small, the overflow is dropped
    outs = []
    for build in (_ragged_torch, ragged_from_padded_kernel):
        indptr = torch.full((num_tokens + 1,), 99, dtype=torch.int32)
        flat = torch.full((capacity,), 77, dtype=torch.int32)
        build(idx, lens, indptr, flat)
        outs.append((indptr, flat))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    indptr, flat = outs[0]
    assert indptr.tolist() == [0] + torch.cumsum(lens.clamp(0, width), 0).tolist()
    rows = [idx[t, : min(int(lens[t]), width)] for t in range(num_tokens)]
    want = torch.cat(rows + [torch.full((max(spare, 0),), -1)])
    assert flat.tolist() == want[:capacity].int().tolist()


def test_ragged_from_padded_checks_its_buffers():
    idx, lens = torch.zeros(2, 3, dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="out_indptr"):
        ragged_from_padded(idx, lens, torch.zeros(2, dtype=torch.int32), torch.zeros(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="out_flat"):
        ragged_from_padded(idx, lens, torch.zeros(3, dtype=torch.int32), torch.zeros(4, dtype=torch.int64))
    with pytest.raises(ValueError, match="lens"):
        ragged_from_padded(idx, lens[:1], torch.zeros(3, dtype=torch.int32), torch.zeros(4, dtype=torch.int32))
    empty_indptr, empty_flat = torch.ones(1, dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    ragged_from_padded(idx[:0], lens[:0], empty_indptr, empty_flat)
    assert empty_indptr.tolist() == [0] and empty_flat.tolist() == [-1, -1]


def test_combined_from_padded_layout():
    swa = torch.tensor([[5, 6, -1], [7, 8, 9], [-1, -1, -1]], dtype=torch.int32)
    comp = torch.tensor([[1, -1], [-1, -1], [2, 3]], dtype=torch.int32)
    out, lens = torch.full((3, 6), 55, dtype=torch.int32), torch.empty(3, dtype=torch.int32)
    combined_from_padded(swa, torch.tensor([2, 3, 0], dtype=torch.int32), comp,
                         torch.tensor([1, 0, 2], dtype=torch.int32), out, lens)
    assert out.tolist() == [[5, 6, -1, 1, -1, -1], [7, 8, 9, -1, -1, -1], [-1, -1, -1, 2, 3, -1]]
    assert lens.tolist() == [4, 3, 5]
    with pytest.raises(ValueError, match="out_indices"):
        combined_from_padded(swa, lens, comp, lens, out[:, :4], lens.clone())


# ---------------------------------------------------------------------------------------------------------------
# the ops on each form


@st.composite
def two_scopes(draw):
    return dict(num_tokens=draw(st.integers(1, 5)), w0=draw(st.integers(1, 24)), w1=draw(st.integers(0, 20)),
                kind0=draw(st.sampled_from(["random", "random", "empty", "invalid"])),
                kind1=draw(st.sampled_from(["random", "empty", "invalid"])), repeat=draw(st.booleans()),
                seed=draw(st.integers(0, 999)))


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=examples(8), deadline=None,
          phases=(Phase.explicit, Phase.reuse, Phase.generate))  # no slow shrinking
@given(case=two_scopes())
def test_decode_forms_match_the_padded_form_and_the_dense_oracle(backend, case):
    gen = torch.Generator().manual_seed(case["seed"])
    T, heads = case["num_tokens"], 2
    swa, swa_vals = filled_cache(gen, 3, 8)
    comp, comp_vals = filled_cache(gen, 2, 4)
    i0, l0 = padded_rows(gen, T, case["w0"], swa.num_slots, case["kind0"], case["repeat"])
    i1, l1 = padded_rows(gen, T, max(case["w1"], 1), comp.num_slots, case["kind1"], case["repeat"])
    q = torch.randn(T, heads, 512, generator=gen).bfloat16()
    sink = torch.tensor([0.5, float("-inf")])
    # batch-invariant: the splits cut each token's list by its own length, so the forms' different widths (which
    # the default split count depends on) cannot change the rounding: the forms agree bitwise on Triton
    padded = sparse_attention_decode(q, swa.data, i0, l0, extra_cache=comp.data, extra_indices=i1, extra_lens=l1,
                                     sink=sink, backend=backend, batch_invariant=True)

    p0, f0 = to_ragged(i0, l0)
    p1, f1 = to_ragged(i1, l1)
    ragged = sparse_attention_decode(q, swa.data, f0, None, extra_cache=comp.data, extra_indices=f1, extra_lens=None,
                                     sink=sink, backend=backend, indptr=p0, extra_indptr=p1, batch_invariant=True)
    assert_same(ragged, padded, exact=backend == "triton")
    mixed = sparse_attention_decode(q, swa.data, i0, l0, extra_cache=comp.data, extra_indices=f1, extra_lens=None,
                                    sink=sink, backend=backend, extra_indptr=p1, batch_invariant=True)
    assert_same(mixed, padded, exact=backend == "triton")

    width = case["w0"] + i1.shape[1]
    comb, comb_lens = torch.empty(T, width, dtype=torch.int32), torch.empty(T, dtype=torch.int32)
    combined_from_padded(i0, l0, i1, l1, comb, comb_lens)
    combined = sparse_attention_decode(q, swa.data, comb, comb_lens, extra_cache=comp.data, sink=sink,
                                       backend=backend, combined_window=case["w0"])
    assert_same(combined, padded, exact=False)

    keys = [[swa_vals[int(s)] for s in i0[t, : l0[t]] if s >= 0] + [comp_vals[int(s)] for s in i1[t, : l1[t]] if s >= 0]
            for t in range(T)]
    ref_out, ref_lse = dense_attention(q.double(), keys, sink=sink.double())
    assert torch.allclose(ragged[0].double(), ref_out, atol=2e-2, rtol=0)
    assert torch.equal(torch.isinf(ragged[1]), torch.isinf(ref_lse))


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_reads_a_ragged_workspace_list(backend):
    gen = torch.Generator().manual_seed(3)
    kv = torch.randn(40, 512, generator=gen).bfloat16()
    idx, lens = padded_rows(gen, 6, 30, 40, "random", repeat=True)
    q = torch.randn(6, 3, 512, generator=gen).bfloat16()
    padded = sparse_attention_prefill(q, kv, idx, lens, backend=backend)
    indptr, flat = to_ragged(idx, lens)
    assert_same(sparse_attention_prefill(q, kv, flat, backend=backend, indptr=indptr), padded,
                exact=backend == "triton")


@pytest.mark.parametrize("backend", BACKENDS)
def test_step_metadata_through_every_form(backend):
    """A real step (decodes with MTP tokens, a prefill, padding rows): c128a lists (up to 4 entries per token
    here), and c4a picks converted inside the combined builder, against the metadata's padded lists."""
    lengths = [(300, 2), (520, 1), (200, 5)]
    batch, _ = make_batch(lengths, threshold=2, padding=2, seed=1)
    window, topk = 8, 6
    meta = build_step_metadata(batch, MetadataSpec(window=window, topk=topk))
    T = batch.token_capacity
    gen = torch.Generator().manual_seed(0)
    swa, _ = filled_cache(gen, 1000, 4)
    comp, _ = filled_cache(gen, 1000, 2)
    q = torch.randn(T, 2, 512, generator=gen).bfloat16()
    sink = torch.tensor([0.0, 1.0])

    # c128a: ragged and combined
    padded = sparse_attention_decode(q, swa.data, meta.swa_indices, meta.swa_lens, extra_cache=comp.data,
                                     extra_indices=meta.c128a_indices, extra_lens=meta.c128a_lens, sink=sink,
                                     backend=backend)
    p0, f0 = to_ragged(meta.swa_indices, meta.swa_lens)
    p1, f1 = to_ragged(meta.c128a_indices, meta.c128a_lens)
    assert_same(sparse_attention_decode(q, swa.data, f0, None, extra_cache=comp.data, extra_indices=f1,
                                        extra_lens=None, sink=sink, backend=backend, indptr=p0, extra_indptr=p1),
                padded, exact=backend == "triton")
    width = window + meta.c128a_indices.shape[1]
    comb, comb_lens = torch.empty(T, width, dtype=torch.int32), torch.empty(T, dtype=torch.int32)
    combined_from_padded(meta.swa_indices, meta.swa_lens, meta.c128a_indices, meta.c128a_lens, comb, comb_lens)
    assert_same(sparse_attention_decode(q, swa.data, comb, comb_lens, extra_cache=comp.data, sink=sink,
                                        backend=backend, combined_window=window), padded, exact=False)

    # c4a: the indexer's local picks (some invisible, some -1), converted inside the builder
    c4a, _ = filled_cache(gen, 1000, 4)
    local = torch.randint(-1, 140, (T, topk), generator=gen, dtype=torch.int32)
    comb4, lens4 = torch.empty(T, window + topk, dtype=torch.int32), torch.empty(T, dtype=torch.int32)
    kept = torch.empty(T, topk, dtype=torch.int32)
    combined_from_picks(batch.positions, batch.token_to_req, batch.block_tables["c4a"], batch.block_sizes["c4a"], 4,
                        local, meta.swa_indices, meta.swa_lens, comb4, lens4, kept)
    c4a_idx, c4a_lens = meta.c4a_indices(local)
    assert torch.equal(comb4[:, window:], c4a_idx) and torch.equal(kept, meta.picks_local)
    padded4 = sparse_attention_decode(q, swa.data, meta.swa_indices, meta.swa_lens, extra_cache=c4a.data,
                                      extra_indices=c4a_idx, extra_lens=c4a_lens, sink=sink, backend=backend)
    assert_same(sparse_attention_decode(q, swa.data, comb4, lens4, extra_cache=c4a.data, sink=sink, backend=backend,
                                        combined_window=window), padded4, exact=False)


def test_form_argument_checks():
    gen = torch.Generator().manual_seed(0)
    cache, _ = filled_cache(gen, 2, 4)
    q = torch.randn(2, 2, 512, generator=gen).bfloat16()
    idx = torch.zeros(2, 3, dtype=torch.int32)
    flat, indptr = torch.zeros(5, dtype=torch.int32), torch.tensor([0, 2, 5], dtype=torch.int32)

    def call(**kw):
        return sparse_attention_decode(q, cache.data, **{"indices": flat, "indptr": indptr, **kw}, backend="reference")

    with pytest.raises(ValueError, match="lens must be None"):
        call(lens=torch.ones(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="indptr must be nondecreasing"):
        call(indptr=torch.tensor([0, 4, 2], dtype=torch.int32))
    with pytest.raises(ValueError, match="indptr must be nondecreasing"):
        call(indptr=torch.tensor([0, 2, 6], dtype=torch.int32))
    with pytest.raises(ValueError, match="indptr must have shape"):
        call(indptr=indptr[:2])
    with pytest.raises(ValueError, match="indices must be 1-D"):
        call(indices=idx)
    with pytest.raises(ValueError, match="indices holds 8"):
        call(indices=torch.tensor([0, 1, 2, 3, 8], dtype=torch.int32))
    with pytest.raises(ValueError, match="combined_window"):
        sparse_attention_decode(q, cache.data, idx, extra_cache=cache.data, combined_window=4, backend="reference")
    with pytest.raises(ValueError, match="combined_window needs"):
        sparse_attention_decode(q, cache.data, idx, combined_window=1, backend="reference")
    with pytest.raises(ValueError, match="lens must lie"):
        sparse_attention_decode(q, cache.data, idx, torch.tensor([4, 0], dtype=torch.int32), extra_cache=cache.data,
                                combined_window=1, backend="reference")


@pytest.mark.parametrize("table,match", [
    (torch.zeros(0, 4, dtype=torch.int32), "a row and a column"), (torch.zeros(2, 0, dtype=torch.int32),
                                                                    "a row and a column"),
    (torch.zeros(4, 2, dtype=torch.int32).t(), "unit column stride"), (torch.zeros(2, 4), "block_table")])
def test_combined_from_picks_names_a_block_table_it_cannot_read(table, match):
    """A table of no row (the kernel's request clamp would take row -1), of no column, of strided columns (read at
    unit stride: other blocks) or not int32 is named before any launch."""
    i32 = dict(dtype=torch.int32)
    positions, reqs = torch.tensor([5, 9], **i32), torch.tensor([0, 1], **i32)
    local, swa, swa_lens = torch.zeros(2, 3, **i32), torch.zeros(2, 4, **i32), torch.ones(2, **i32)
    out, lens, kept = torch.empty(2, 7, **i32), torch.empty(2, **i32), torch.empty(2, 3, **i32)
    with pytest.raises((ValueError, TypeError), match=match):
        combined_from_picks(positions, reqs, table, 4, 4, local, swa, swa_lens, out, lens, kept)


@pytest.mark.parametrize("change,match", [
    (dict(table=2**32 // 64), r"block_table holds block 67108864, whose slots \(block \* 64 \+ offset\) pass int32"),
    (dict(block_size=2**32 + 64), "block_size and ratio must be positive ints below 2\\^31"),
    (dict(ratio=2**32 + 4), "block_size and ratio must be positive ints below 2\\^31"),
    (dict(position=2**31 - 1), r"positions must be below 2\^31 - 1")])
def test_combined_from_picks_names_values_its_int32_arithmetic_would_wrap(change, match, monkeypatch):
    """A block whose slots pass int32 (block 2^26 of 64 wrapped to slot 3, a real entry's), a block size or ratio
    past it (2^32 + 64 acting as 64), a position whose entry count overflows: named, on the torch path always and
    on the kernels' with SPARSE_MLA_DEBUG=1 (here: the torch path of CPU tensors)."""
    monkeypatch.delenv("SPARSE_MLA_DEBUG", raising=False)
    i32 = dict(dtype=torch.int32)
    positions = torch.tensor([change.get("position", 99)], **i32)
    table = torch.tensor([[change.get("table", 5)]], **i32)
    local, swa, swa_lens = torch.tensor([[3, -1]], **i32), torch.tensor([[7, 8]], **i32), torch.tensor([2], **i32)
    out, lens, kept = torch.empty(1, 4, **i32), torch.empty(1, **i32), torch.empty(1, 2, **i32)
    args = (positions, torch.zeros(1, **i32), table, change.get("block_size", 64), change.get("ratio", 4), local, swa,
            swa_lens, out, lens, kept)
    with pytest.raises(ValueError, match=match):
        combined_from_picks(*args)
    ok = (torch.tensor([99], **i32),) + args[1:2] + (torch.tensor([[5]], **i32), 64, 4) + args[5:]
    combined_from_picks(*ok)
    assert out.tolist() == [[7, 8, 5 * 64 + 3, -1]] and lens.tolist() == [3]


@pytest.mark.parametrize("alias", ["out_flat in indices", "out_indptr in lens", "out_flat in out_indptr"])
def test_ragged_form_refuses_outputs_sharing_memory_with_its_inputs(alias):
    """The kernel's programs write the outputs while others read the inputs: an output over an input is named."""
    i32 = dict(dtype=torch.int32)
    indices, lens = torch.arange(12, **i32).view(3, 4), torch.tensor([4, 2, 0, 0], **i32)
    flat, indptr = torch.empty(12, **i32), torch.empty(4, **i32)
    if alias == "out_flat in indices":
        flat = indices.view(-1)
    elif alias == "out_indptr in lens":
        indptr = lens
    else:
        both = torch.empty(14, **i32)
        flat, indptr = both[:12], both[10:]
    with pytest.raises(ValueError, match=alias.split()[0]):
        ragged_from_padded(indices, lens[:3], indptr, flat)


def test_ragged_form_refuses_padded_rows_whose_sum_could_pass_int32():
    """2^31 padded entries (an expanded view: nothing allocated) could sum past the int32 indptr: named first."""
    i32 = dict(dtype=torch.int32)
    indices = torch.zeros(1, 1, **i32).expand(2**16, 2**15)
    with pytest.raises(ValueError, match=r"indices must hold fewer than 2\^31 entries"):
        ragged_from_padded(indices, torch.zeros(2**16, **i32), torch.empty(2**16 + 1, **i32), torch.empty(8, **i32))


@pytest.mark.parametrize("backend", BACKENDS)
def test_long_c128a_rows_in_ragged_form(backend):
    """C128A lists of 0 … 1024 entries per token (a 128K context): the ragged buffer holds only their sum."""
    gen = torch.Generator().manual_seed(11)
    swa, _ = filled_cache(gen, 2, 64)
    comp, _ = filled_cache(gen, 512, 2)
    lens = torch.tensor([1024, 0, 517], dtype=torch.int32)
    idx = torch.randint(0, comp.num_slots, (3, 1024), generator=gen, dtype=torch.int32)
    idx = torch.where(torch.arange(1024)[None, :] < lens[:, None], idx, -1).int()
    swa_idx, swa_lens = padded_rows(gen, 3, 128, swa.num_slots, "random", repeat=False)
    q = torch.randn(3, 2, 512, generator=gen).bfloat16()
    padded = sparse_attention_decode(q, swa.data, swa_idx, swa_lens, extra_cache=comp.data, extra_indices=idx,
                                     extra_lens=lens, backend=backend)
    indptr, flat = to_ragged(idx, lens, spare=0)
    assert flat.shape == (1541,) and indptr.tolist() == [0, 1024, 1024, 1541]
    ragged = sparse_attention_decode(q, swa.data, swa_idx, swa_lens, extra_cache=comp.data, extra_indices=flat,
                                     extra_lens=None, backend=backend, extra_indptr=indptr)
    assert_same(ragged, padded, exact=backend == "triton")
