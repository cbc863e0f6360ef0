"""No kernel reads or writes outside its tensors, whatever the values it is given (docs/checks.md).

Every tensor a kernel takes is a view into a larger buffer with guard regions of ``GUARD`` elements before and after
it. Inputs' guards hold what shows up if read: NaN in float tensors and caches (0xFF bytes: NaN in e4m3, inf in a
ue8m0 scale, NaN in a float32 scale), a *trap slot* (a slot of a NaN-poisoned cache block no valid index names) in
index lists, so a read past a list attends to NaN; lens / order / indptr guards hold lengths that would change the
result. Values are adversarial: indices out of range and negative, lens past the width and negative, an order that
is not a permutation, an indptr that is not monotone and runs past its list. Each test asserts the outputs' guards are
bitwise untouched, that no NaN reached an output (no guard was read), and that the result is what
docs/checks.md says the fast path makes of such values (the reference on the values clamped as documented).

The kernels run without the value checks (``check_ranges=False``: what the GPU path does without
``SPARSE_MLA_DEBUG=1``); on the CPU in Triton's interpreter, on a GPU the same tests run the GPU kernels: the padded
attention cases on the portable Triton kernel and on the Gluon one (a Hopper GPU; elsewhere skipped). On the GPU box
``GPU_TESTS=guards bash scripts/gpu_check.sh`` runs this file under ``compute-sanitizer --tool memcheck``.
"""
from __future__ import annotations

import pytest
import torch

from helpers import DEVICE, KERNEL_RUNS, needs, random_scope, random_sink, rel_err
from sparse_mla.batch import Request, StepBatchBuilder, blocks_needed
from sparse_mla.index_forms import _ragged_torch
from sparse_mla.picks import compressed_picks_torch
from sparse_mla.ops import attention_plan, reference, sparse_attention_decode
from sparse_mla.ops.triton import cache as triton_cache, index as triton_index
from sparse_mla.ops.order import KEYS_PER_BLOCK, longest_first_torch
from sparse_mla.ops.validate import decode_args, gather_args, insert_args

pytestmark = pytest.mark.skipif(not KERNEL_RUNS, reason="the Triton kernels need a GPU or TRITON_INTERPRET=1")

GUARD = 64  # elements each side: 64 bytes or more, so views keep the 16-byte alignment the GPU kernels want
I32 = dict(dtype=torch.int32, device=DEVICE)
HUGE = [2**30, 2**31 - 1, -(2**31), -2]  # out of range whatever the tensor
# the attention kernel of a padded call (``gluon=`` of attention_plan.plan_for): the portable one, the Hopper one
KERNELS = [pytest.param(0, id="triton"), pytest.param(1, id="gluon", marks=needs("gluon"))]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bits as integers (NaN payloads compare exactly)."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


class Guarded:
    """``t``'s values, with its strides, in the middle of a buffer whose ``GUARD`` elements before and after (and any
    gap between its elements, such as a paged cache's block padding) hold ``guard``."""

    def __init__(self, t: torch.Tensor, guard: float | int) -> None:
        span = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
        self.buf = torch.full((2 * GUARD + span,), guard, dtype=t.dtype, device=t.device)
        self.t = torch.as_strided(self.buf, t.shape, t.stride(), GUARD)
        self.t.copy_(t)
        self._guards = self._guard_bits().clone()

    def _guard_bits(self) -> torch.Tensor:
        return torch.cat([_bits(self.buf[:GUARD]), _bits(self.buf[-GUARD:])])

    def intact(self) -> bool:
        return torch.equal(self._guard_bits(), self._guards)


def trapped_cache(fmt: str, dim: int, num_tokens: int, width: int, seed: int):
    """A scope from ``random_scope`` (full lens; its cache NaN-poisoned where unwritten, its indices naming written
    slots only) in a guarded buffer: ``(cache Guarded, indices, trap slot, num_slots)``; the trap slot is an unwritten
    one (it reads as NaN)."""
    gen = torch.Generator().manual_seed(seed)
    paged, idx, _ = random_scope(gen, fmt, dim, num_tokens, width, 2, 8, lens_mode="full")
    unwritten = paged.read(torch.arange(paged.num_slots, **I32)).isnan().any(-1)
    cache = Guarded(paged.data, float("nan") if paged.data.dtype == torch.bfloat16 else 0xFF)
    return cache, idx, int(unwritten.nonzero()[0]), paged.num_slots


def out_of_range(idx: torch.Tensor, num_slots: int) -> torch.Tensor:
    """``idx`` with every 4th column out of range (past the cache, or negative below -1)."""
    idx = idx.clone()
    bad = [num_slots, num_slots + 3, *HUGE]
    idx[:, ::4] = torch.tensor(bad * idx.shape[1], **I32)[: idx[:, ::4].numel()].view(idx.shape[0], -1)
    return idx


def clean(idx: torch.Tensor, num_slots: int) -> torch.Tensor:
    """``idx`` as the kernels read it: out of range -> -1 (the trap slot is in range: named only past lens)."""
    return torch.where((idx >= 0) & (idx < num_slots), idx, -1)


def adversarial_scope(fmt: str, dim: int, width: int, lens: list[int], seed: int):
    """A padded scope of ``len(lens)`` tokens with out-of-range indices, the given (bad) lens, and the trap slot
    wherever an entry lies past its token's clamped length: ``(cache, indices, lens, clean indices, clean lens)``,
    the clean ones as docs/checks.md says the kernels read the others (out of range -> -1, lens clamped into
    ``[0, width]``)."""
    cache, idx, trap, num_slots = trapped_cache(fmt, dim, len(lens), width, seed)
    idx = out_of_range(idx, num_slots)
    lens = torch.tensor(lens, **I32)
    clean_lens = lens.clamp(0, width)
    idx[torch.arange(width, device=DEVICE)[None, :] >= clean_lens[:, None]] = trap
    return cache, Guarded(idx, trap), Guarded(lens, 1), clean(idx, num_slots), clean_lens


def run_attention(q, sink, scale, cache, indices, lens=None, splits=1, gluon=0, **decode):
    """The attention kernels without value checks (``decode``: more of ``sparse_attention_decode``'s arguments; the
    Gluon kernel with ``gluon=1``, else the Triton one) on guarded ``out`` / ``lse`` (zeros inside):
    ``(out Guarded, lse Guarded)``."""
    num_tokens, heads, _ = q.t.shape
    out = Guarded(torch.zeros(num_tokens, heads, 512, dtype=torch.bfloat16, device=DEVICE), float("nan"))
    lse = Guarded(torch.zeros(num_tokens, heads, dtype=torch.float32, device=DEVICE), float("nan"))
    args = decode_args(q.t, cache, indices, lens, sink=sink.t, scale=scale, check_ranges=False, out=out.t, **decode)
    plan = attention_plan.plan_for(args, splits=splits, gluon=gluon)
    assert plan.kernel == ("gluon" if gluon else "triton")
    plan(args.q, out.t, lse.t, args.sink, args.scale, tuple(s.cache for s in args.scopes),
         tuple(s.indices for s in args.scopes),
         tuple(s.lens if s.indptr is None else s.indptr for s in args.scopes), args.order)
    return out, lse


def assert_rows_match(out, lse, ref_out, ref_lse, rows):
    got, got_lse, want, want_lse = out.t[rows], lse.t[rows], ref_out[rows], ref_lse[rows]
    assert not got.isnan().any() and not got_lse.isnan().any(), "a guard was read: NaN in the output"
    assert rel_err(got, want) < 1e-2
    finite = torch.isfinite(want_lse)
    assert torch.equal(torch.isfinite(got_lse), finite)
    assert torch.allclose(got_lse[finite], want_lse[finite], atol=2e-3, rtol=1e-3)


def guarded_q_sink(gen, num_tokens, heads, dim):
    q = Guarded(torch.randn(num_tokens, heads, dim, generator=gen).to(torch.bfloat16).to(DEVICE), float("nan"))
    return q, Guarded(random_sink(gen, heads), float("nan"))


# with split lists the combine kernel merges the missed tokens' partials, never written (whatever memory held)
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("gluon", KERNELS)
@pytest.mark.parametrize("splits", [1, 2])
@pytest.mark.parametrize("fmt,dim", [("fp8_v4", 512), ("bf16", 512), ("fp8_v32", 576)])
def test_attention_with_a_bad_order(fmt, dim, splits, gluon):
    """Padded scope, bad indices and lens, and an order that names tokens twice, out of range and not at all."""
    num_tokens, width = 6, 20
    cache, idx, lens, clean_idx, clean_lens = adversarial_scope(fmt, dim, width, [25, -3, 2**30, 5, 0, 2**31 - 1], 1)
    q, sink = guarded_q_sink(torch.Generator().manual_seed(2), num_tokens, 3, dim)
    order = Guarded(torch.tensor([0, 0, 2**30, -5, 4, 2], **I32), 3)  # clamped: 0, 0, 5, 0, 4, 2
    out, lse = run_attention(q, sink, 0.07, cache.t, idx.t, lens.t, splits, gluon, order=order.t)
    assert all(g.intact() for g in (out, lse, q, sink, cache, idx, lens, order))
    ref_out, ref_lse = sparse_attention_decode(q.t, cache.t, clean_idx, clean_lens, sink=sink.t, scale=0.07,
                                               backend="reference")
    named = [0, 2, 4, 5]
    assert_rows_match(out, lse, ref_out, ref_lse, named)
    if splits == 1:  # the tokens the order misses are not written (with split lists: merged from stale partials)
        assert (out.t[[1, 3]] == 0).all() and (lse.t[[1, 3]] == 0).all()


@pytest.mark.parametrize("gluon", KERNELS)
def test_attention_two_scopes_split(gluon):
    num_tokens = 6
    c0, i0, l0, clean0, lens0 = adversarial_scope("fp8_v4", 512, 20, [25, -3, 2**30, 5, 0, 2**31 - 1], 3)
    c1, i1, l1, clean1, lens1 = adversarial_scope("fp8_v4", 512, 12, [3, 21, -1, 2**31 - 1, 8, 0], 4)
    q, sink = guarded_q_sink(torch.Generator().manual_seed(5), num_tokens, 2, 512)
    out, lse = run_attention(q, sink, 0.05, c0.t, i0.t, l0.t, 2, gluon, extra_cache=c1.t, extra_indices=i1.t,
                             extra_lens=l1.t)
    assert all(g.intact() for g in (out, lse, q, sink, c0, i0, l0, c1, i1, l1))
    ref = sparse_attention_decode(q.t, c0.t, clean0, lens0, extra_cache=c1.t, extra_indices=clean1, extra_lens=lens1,
                                  sink=sink.t, scale=0.05, backend="reference")
    assert_rows_match(out, lse, *ref, list(range(num_tokens)))


def clamped_rows(flat: torch.Tensor, indptr: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A ragged list as the kernels read it (docs/checks.md): row ``t`` starts at ``indptr[t]`` clamped into
    ``[0, capacity]`` and ends at ``indptr[t+1]`` clamped into ``[start, capacity]``; as padded ``(T, capacity)``
    clean indices and lens."""
    capacity, num_tokens = flat.shape[0], indptr.shape[0] - 1
    rows = torch.full((num_tokens, capacity), -1, **I32)
    lens = torch.zeros(num_tokens, **I32)
    for t in range(num_tokens):
        start = min(max(int(indptr[t]), 0), capacity)
        end = min(max(int(indptr[t + 1]), start), capacity)
        rows[t, : end - start] = flat[start:end]
        lens[t] = end - start
    return torch.where((rows >= 0) & (rows < num_slots), rows, -1), lens


def test_attention_ragged_bad_indptr():
    """A ragged scope whose indptr goes back, below 0 and past the flat list; the flat list's guards and its
    entries no row covers hold the trap slot."""
    num_tokens, capacity = 6, 40
    cache, padded, trap, num_slots = trapped_cache("bf16", 512, 1, capacity, seed=6)
    full = padded[0].clone()
    full[::5] = torch.tensor([num_slots, *HUGE, num_slots + 9, -1, 3], **I32)
    indptr = torch.tensor([2, 9, 5, 14, -7, 6, 30], **I32)  # rows [2,9) [9,9) [5,14) [14,14) [0,6) [6,30)
    flat = full.clone()
    flat[30:] = trap  # covered by no row
    clean_idx, lens = clamped_rows(flat, indptr, num_slots)
    flat_g, indptr_g = Guarded(flat, trap), Guarded(indptr, 0)
    q, sink = guarded_q_sink(torch.Generator().manual_seed(7), num_tokens, 2, 512)
    for splits in (1, 2):
        out, lse = run_attention(q, sink, 0.05, cache.t, flat_g.t, None, splits, indptr=indptr_g.t)
        assert all(g.intact() for g in (out, lse, q, sink, cache, flat_g, indptr_g))
        ref = sparse_attention_decode(q.t, cache.t, clean_idx, lens, sink=sink.t, scale=0.05, backend="reference")
        assert_rows_match(out, lse, *ref, list(range(num_tokens)))
    past_end = torch.tensor([0, 3, 3, 2**30, 2**30, 2**31 - 1, 50], **I32)  # row 2 runs on past the list's end
    clean_idx, lens = clamped_rows(full, past_end, num_slots)
    flat_g, indptr_g = Guarded(full, trap), Guarded(past_end, 0)
    out, lse = run_attention(q, sink, 0.05, cache.t, flat_g.t, indptr=indptr_g.t)
    assert out.intact() and lse.intact() and flat_g.intact() and indptr_g.intact()
    ref = sparse_attention_decode(q.t, cache.t, clean_idx, lens, sink=sink.t, scale=0.05, backend="reference")
    assert_rows_match(out, lse, *ref, list(range(num_tokens)))


def test_attention_combined_index():
    """FlashInfer's combined index: one row over both caches, one length for the whole row."""
    num_tokens, window, comp = 6, 8, 12
    c0, i0, trap0, num_slots = trapped_cache("fp8_v4", 512, num_tokens, window, seed=8)
    c1, i1, trap1, _ = trapped_cache("fp8_v4", 512, num_tokens, comp, seed=9)  # as many slots
    lens = Guarded(torch.tensor([window + comp + 3, -1, 5, 2**30, 0, window + 4], **I32), 1)
    clean_lens = lens.t.clamp(0, window + comp)
    row = out_of_range(torch.cat([i0, i1], 1), num_slots)
    past = torch.arange(window + comp, device=DEVICE)[None, :] >= clean_lens[:, None]
    row[:, :window][past[:, :window]] = trap0
    row[:, window:][past[:, window:]] = trap1
    rows, clean_idx = Guarded(row, trap1), clean(row, num_slots)  # (past the last row: extra_cache's columns)
    q, sink = guarded_q_sink(torch.Generator().manual_seed(10), num_tokens, 2, 512)
    out, lse = run_attention(q, sink, 0.05, c0.t, rows.t, lens.t, extra_cache=c1.t, combined_window=window)
    assert all(g.intact() for g in (out, lse, q, sink, c0, c1, rows, lens))
    ref = sparse_attention_decode(q.t, c0.t, clean_idx, clean_lens, extra_cache=c1.t, sink=sink.t, scale=0.05,
                                  backend="reference", combined_window=window)
    assert_rows_match(out, lse, *ref, list(range(num_tokens)))


@pytest.mark.parametrize("fmt,dim", [("fp8_v4", 512), ("fp8_v32", 576), ("bf16", 512)])
def test_insert_and_gather(fmt, dim):
    """Insert: slots out of range are skipped, nothing outside the cache is written and no guard of ``kv_new`` is
    read. Gather: out-of-range slots read as zeros, nothing outside ``out`` is written."""
    cache, idx, trap, num_slots = trapped_cache(fmt, dim, 2, 8, seed=11)
    gen = torch.Generator().manual_seed(12)
    kv = Guarded(torch.randn(7, dim, generator=gen).to(torch.bfloat16).to(DEVICE), float("nan"))
    slots = Guarded(torch.tensor([3, num_slots + 8, -1, *HUGE[:2], 11, -(2**31)], **I32), 0)
    # slots 3 and 11 written, every other byte as it was (a copy with the cache's strides: fp8_v4 pads its blocks)
    want = torch.empty_strided(cache.t.shape, cache.t.stride(), dtype=cache.t.dtype, device=DEVICE).copy_(cache.t)
    reference.quantize_and_insert(*insert_args(kv.t[[0, 5]], want, torch.tensor([3, 11], **I32)))
    triton_cache.quantize_and_insert(*insert_args(kv.t, cache.t, slots.t, check_values=False))
    assert cache.intact() and kv.intact() and slots.intact()
    assert torch.equal(_bits(cache.t), _bits(want))

    picks = Guarded(torch.tensor([[3, num_slots + 8, -1], [HUGE[0], 11, HUGE[2]]], **I32), trap)
    out = Guarded(torch.zeros(2, 3, dim, dtype=torch.bfloat16, device=DEVICE), float("nan"))
    paged, f, scale = gather_args(cache.t, picks.t, check_ranges=False, out=out.t)
    triton_cache.dequantize_and_gather(paged, f, scale, picks.t, out.t)
    assert out.intact() and picks.intact() and cache.intact()
    assert not out.t.isnan().any()
    assert (out.t[0, 1:] == 0).all() and (out.t[1, ::2] == 0).all()
    want = reference.dequantize_and_gather(paged, f, scale, torch.tensor([3, 11], **I32))
    assert torch.equal(out.t[0, 0], want[0]) and torch.equal(out.t[1, 1], want[1])


def test_token_order_ragged_builder_and_picks():
    """The metadata kernels on adversarial lens and picks: the longest-first order, the ragged form of a padded
    list and the c4a picks conversion (each against its torch twin)."""
    lens = Guarded(torch.tensor([-5, 2**30, 0, 64, 2**31 - 1, -(2**31), 65, 7], **I32), 2**30)
    order = Guarded(torch.full((8,), -77, **I32), -77)
    triton_index.longest_first(lens.t, None, KEYS_PER_BLOCK, order.t)
    assert order.intact() and lens.intact()
    assert torch.equal(order.t, longest_first_torch(lens.t))

    gen = torch.Generator().manual_seed(13)
    idx = Guarded(torch.randint(0, 500, (5, 9), generator=gen, dtype=torch.int32).to(DEVICE), 12345)
    row_lens = Guarded(torch.tensor([9, -4, 2**30, 3, 0], **I32), 9)
    for capacity in (30, 12):  # room for every row's entries, and too little
        outs = []
        for build in (_ragged_torch, triton_index.ragged_from_padded):
            indptr = Guarded(torch.full((6,), 99, **I32), 99)
            flat = Guarded(torch.full((capacity,), 77, **I32), 77)
            build(idx.t, row_lens.t, indptr.t, flat.t)
            assert indptr.intact() and flat.intact() and idx.intact() and row_lens.intact()
            outs.append((indptr.t, flat.t))
        assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
        assert 12345 not in outs[1][1].tolist()

    sizes = {"swa": 4, "c4a": 4, "c128a": 2}
    lengths = [(40, 1), (30, 3)]
    reqs = [Request(s, q, {k: [100 * r + b for b in range(blocks_needed(s, k, sizes[k]))] for k in sizes})
            for r, (s, q) in enumerate(lengths)]
    batch = StepBatchBuilder(6, 2, 64, block_sizes=sizes, device=DEVICE).build(reqs)
    local = torch.tensor([[0, -7, 2**30, 9, 1], [2, -(2**31), 7, -1, 6], [5, 0, 1, 2, 3], [6, 6, -2, 2**31 - 1, 1],
                          [0, 1, 2, 3, 4], [1, 2, 3, 4, 5]], **I32)
    picks = Guarded(local, 0)
    table = Guarded(batch.block_tables["c4a"], 7)
    results = []
    for convert in (compressed_picks_torch, triton_index.compressed_picks):
        outs = [Guarded(torch.full((6, 5), -9, **I32), -9), Guarded(torch.full((6,), -9, **I32), -9),
                Guarded(torch.full((6, 5), -9, **I32), -9)]
        convert(batch.positions, batch.token_to_req, table.t, 4, 4, picks.t, *(o.t for o in outs))
        assert all(o.intact() for o in outs) and picks.intact() and table.intact()
        results.append([o.t for o in outs])
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_select_converting_its_picks():
    """The indexer's select converting its picks in its own launch (``PicksInto``): candidates anywhere in the rows,
    a token of position -1, the padding tokens' programs past the packed rows, a block-table entry of -1; every
    tensor guarded (a packed row's guards hold the best possible key, which a read past the row would pick), against
    the conversion's torch twin of the picks it wrote."""
    from indexer_cases import packed_rows
    from sparse_mla.ops.triton import indexer as triton_indexer

    sizes = {"swa": 64, "c4a": 64, "c128a": 2}
    lengths = [(1200, 2), (700, 2)]
    reqs = [Request(s, q, {k: [40 * r + b for b in range(blocks_needed(s, k, sizes[k]))] for k in sizes})
            for r, (s, q) in enumerate(lengths)]
    batch = StepBatchBuilder(6, 2, 2048, block_sizes=sizes, device=DEVICE).build(reqs)  # 4 tokens, 2 padding
    positions = batch.positions.clone()
    positions[1] = -1  # a token of the chunk without a position: an empty row, whatever its packed row holds
    table = batch.block_tables["c4a"].clone()
    table[1, 2] = -1  # a missing block: its entries are never candidates
    rows, cols, k = 4, 320, 64
    gen = torch.Generator().manual_seed(17)
    visible = (positions[:rows].cpu() + 1).clamp_min(0) // 4
    col = torch.arange(cols)
    present = table.cpu()[batch.token_to_req[:rows].cpu().clamp_min(0)][:, col // 64] >= 0
    scores = torch.randn(rows, cols, generator=gen)
    scores[(col[None, :] >= visible[:, None]) | ~present] = float("nan")
    packed = Guarded(packed_rows(scores).to(DEVICE), 0x7FFFFFFF00000000)
    out = Guarded(torch.full((rows, k), -9, **I32), -9)
    conv = [Guarded(torch.full(shape, -9, **I32), -9) for shape in ((6, k), (6,), (6, k))]
    tensors = [Guarded(t, 7) for t in (positions, batch.token_to_req, table)]
    into = triton_indexer.PicksInto(tensors[0].t, tensors[1].t, tensors[2].t, 64, *(c.t for c in conv), 6)
    triton_indexer.topk_rows(packed.t, k, out.t, into)
    assert all(g.intact() for g in (packed, out, *conv, *tensors))
    picks = torch.full((6, k), -1, **I32)
    picks[:rows] = out.t
    want = [torch.empty_like(c.t) for c in conv]
    compressed_picks_torch(positions, batch.token_to_req, table, 64, 4, picks, *want)
    assert all(torch.equal(c.t, w) for c, w in zip(conv, want))
    expected = triton_indexer.topk_from_packed(packed.t, k)
    expected[1] = -1
    assert torch.equal(out.t.sort(1).values, expected.sort(1).values)


def test_request_indices_past_the_tables_read_a_row_inside_them():
    """``token_to_req`` values past a block table (or negative: the padding tokens' ``-1``, a caller's bad value;
    unchecked, device values) are clamped into it (docs/checks.md): the picks' conversion, the step's window lists
    and the select's own conversion read a row of the table, never its guards (7: a block of slots no clamped row
    names), and write what the clamped requests give."""
    from sparse_mla.ops.triton import indexer as triton_indexer

    sizes = {"swa": 4, "c4a": 4, "c128a": 2}
    lengths = [(40, 1), (30, 3)]
    reqs = [Request(s, q, {k: [100 * r + b for b in range(blocks_needed(s, k, sizes[k]))] for k in sizes})
            for r, (s, q) in enumerate(lengths)]
    batch = StepBatchBuilder(6, 2, 64, block_sizes=sizes, device=DEVICE).build(reqs)  # 4 tokens, 2 padding
    bad = torch.tensor([2**30, -(2**31), 2**31 - 1, 2, -1, 9], **I32)
    clamped = bad.clamp(0, 1)
    local = torch.tensor([[0, 1, 2, 3, 4], [2, 5, 7, 1, 6], [5, 0, 1, 2, 3], [6, 8, 4, 2, 1], [0, 1, 2, 3, 4],
                          [1, 2, 3, 4, 5]], **I32)
    tables = {k: Guarded(batch.block_tables[k], 7) for k in sizes}

    def outputs(shapes):
        return [Guarded(torch.full(shape, -9, **I32), -9) for shape in shapes]

    results = []
    for req in (bad, clamped):
        got = []
        outs = outputs(((6, 5), (6,), (6, 5)))
        triton_index.compressed_picks(batch.positions, req, tables["c4a"].t, 4, 4, local, *(o.t for o in outs))
        got += outs
        valid, swa, c128 = outputs(((6,),)), outputs(((6, 8), (6,))), outputs(((6, 4), (6,)))
        triton_index.step_lists(batch.positions, req, valid[0].t, triton_index.WindowList(tables["swa"].t, 4, *(
            o.t for o in swa)), triton_index.WindowList(tables["c128a"].t, 2, *(o.t for o in c128)), None)
        got += valid + swa + c128
        packed = torch.stack([torch.randperm(64, generator=torch.Generator().manual_seed(r)) for r in range(4)])
        picks = outputs(((4, 8), (6, 8), (6,), (6, 8)))
        into = triton_indexer.PicksInto(batch.positions, req, tables["c4a"].t, 4, *(p.t for p in picks[1:]), 6)
        triton_indexer.topk_rows(packed.to(DEVICE, torch.int64) << 32 | (2**32 - 1 - torch.arange(64, device=DEVICE)),
                                 8, picks[0].t, into)
        got += picks
        assert all(g.intact() for g in (*got, *tables.values()))
        results.append([g.t.clone() for g in got])
    assert all(torch.equal(a, b) for a, b in zip(*results))
    assert all((results[0][i] >= 0).any() for i in (0, 4, 9))  # the picks', the window's, the select's slots


def test_compressor_kernels_clamp_request_indices_into_the_step_s_tensors():
    """The compressor's kernels read each token's request's prefix length, state slot and sequence length: a
    ``token_to_req`` value past those tensors (or negative) reads their last row (first), never their guards, and
    writes what the clamped requests give."""
    import dataclasses

    from compress_feed import Feeder, make_params, make_sequences
    from sparse_mla.compressor import KVCompressor
    from sparse_mla.ops.triton import compress as triton_compress

    lengths, ratio, dim = [9, 6], 4, 128
    kv, score = (torch.cat(parts).to(DEVICE) for parts in zip(*make_sequences(lengths, ratio, dim)))
    results = []
    for bad in (True, False):
        feeder = Feeder(lengths, ratio, device=DEVICE)
        weight, ape = make_params(ratio, dim)
        comp = KVCompressor(feeder.pool, dim, weight, 1e-6, ape=ape, backend="triton")
        order, batch, meta = feeder.step([(0, 9), (1, 6)])
        req = batch.token_to_req.clone()
        req[:15] = torch.where(req[:15] == 1, 2**30 if bad else 1, -(2**31) if bad else 0)
        guarded = [Guarded(t, g) for t, g in ((meta.prefix_lens, 2**30), (meta.state_slots, 2**30),
                                              (batch.seq_lens, -(2**30)))]
        step = dataclasses.replace(batch, token_to_req=req, seq_lens=guarded[2].t)
        meta = dataclasses.replace(meta, batch=step, prefix_lens=guarded[0].t, state_slots=guarded[1].t)
        latent, entries = (torch.zeros(15, dim, dtype=torch.bfloat16, device=DEVICE) for _ in range(2))
        triton_compress.compress(kv, score, comp.ape, comp.norm_weight, comp.eps, comp.inv_freq, meta,
                                 feeder.pool.layers[comp.layer], latent, entries)
        assert all(g.intact() for g in guarded)
        results.append([latent, entries, *feeder.pool.layers[comp.layer]])
    assert all(torch.equal(a, b) for a, b in zip(*results))
    assert results[0][0].abs().sum() > 0  # entries were completed


def test_compressor_reads_no_input_row_outside_the_step_whatever_the_requests():
    """A token named to another request than its own (an in-range bad ``token_to_req`` value: request 0's tokens
    named request 1, whose prefix is 0, not 5) puts its window's new slots before the step's first input row: those
    slots read no row before the input (its guards are NaN: none reaches an output)."""
    import dataclasses

    from compress_feed import Feeder, make_params, make_sequences
    from sparse_mla.compressor import KVCompressor
    from sparse_mla.ops.triton import compress as triton_compress

    lengths, ratio, dim = [9, 6], 4, 128
    feeder = Feeder(lengths, ratio, device=DEVICE)
    weight, ape = make_params(ratio, dim)
    comp = KVCompressor(feeder.pool, dim, weight, 1e-6, ape=ape, backend="triton")
    seqs = [(kv.to(DEVICE), score.to(DEVICE)) for kv, score in make_sequences(lengths, ratio, dim)]
    latent, entries = (torch.zeros(10, dim, dtype=torch.bfloat16, device=DEVICE) for _ in range(2))
    for step, bad in (([(0, 5)], False), ([(0, 4), (1, 6)], True)):
        order, batch, meta = feeder.step(step)
        chunks = {i: (feeder.done[i] - n, n) for i, n in step}
        kv, score = (Guarded(Feeder.rows(order, chunks, seqs, which), float("nan")) for which in (0, 1))
        if bad:
            req = batch.token_to_req.clone()
            req[req == 0] = 1
            meta = dataclasses.replace(meta, batch=dataclasses.replace(batch, token_to_req=req))
        rows = kv.t.shape[0]
        triton_compress.compress(kv.t, score.t, comp.ape, comp.norm_weight, comp.eps, comp.inv_freq, meta,
                                 feeder.pool.layers[comp.layer], latent[:rows], entries[:rows])
        assert not latent.isnan().any() and not entries.isnan().any(), bad
