"""Triton step-metadata builders (DESIGN §3), one launch per call.

The index builders (one program per token) write a valid-prefix row of cache slots (valid first,
``-1`` after) and its length, into caller-owned buffers, exactly as the torch builders of
:mod:`sparse_mla.metadata` do. Padding tokens (``positions < 0``) get empty rows. The ragged form of a
padded list (:func:`ragged_from_padded`, for :mod:`sparse_mla.index_forms`) sums the lengths before each row in
the row's own program. The token order of :mod:`sparse_mla.ops.order` ranks every token against every other.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..launch import BindOnce, cached_launch


@triton.jit
def request_row(req, rows):
    """Request ``req`` clamped into ``[0, rows)``, the rows of a per-request tensor: a padding token's ``-1``, or a
    request index past them (a caller's bad ``token_to_req`` value, unchecked: a device value), reads one of its rows,
    never past it."""
    return tl.minimum(tl.maximum(req, 0), rows - 1)


@triton.jit
def table_slots(table_ptr, req, table_stride, table_rows, entry, valid, BS: tl.constexpr, MAX_BLOCKS):
    """Slots of ``entry`` numbers (at least 0 where ``valid``) through request ``req``'s row of the block table
    (``table_rows`` rows of ``MAX_BLOCKS`` columns; ``-1`` where invalid). The row and the block column are clamped
    into the table (:func:`request_row`)."""
    row = request_row(req, table_rows).to(tl.int64)
    col = tl.minimum(tl.where(valid, entry, 0) // BS, MAX_BLOCKS - 1)
    phys = tl.load(table_ptr + row * table_stride + col, mask=valid, other=-1)
    return tl.where(valid & (phys >= 0), phys * BS + entry % BS, -1)


@triton.jit
def _window_row(t, pos, req, table_ptr, table_stride, table_rows, max_blocks, idx_ptr, idx_stride, len_ptr, width,
                span, world, rank, RATIO: tl.constexpr, BS: tl.constexpr, WIDTH_P2: tl.constexpr):
    """Token ``t``'s row of the entries rank ``rank`` of ``world`` owns (``e % world == rank``; world 1: every
    entry), as that rank's slots (the table's virtual slot ``// world``: module ``sparse_mla.context_parallel``).
    RATIO 1: of the SWA window ``max(0, pos-span+1) … pos``; otherwise of every entry complete before pos (at most
    ``span``). The owned entries are every ``world``-th from the first owned one: the row is built compact, at most
    ``width`` = ``ceil(span / world)`` wide."""
    j = tl.arange(0, WIDTH_P2)
    if RATIO == 1:
        start = tl.maximum(pos - span + 1, 0)
        count = tl.where(pos >= 0, pos - start + 1, 0)
    else:
        start = pos * 0
        count = tl.where(pos >= 0, (pos + 1) // RATIO, 0)
    count = tl.minimum(count, span)
    skip = (rank - start % world + world) % world  # window entries before the first owned one
    count = tl.minimum(tl.where(count > skip, (count - skip + world - 1) // world, 0), width)
    entry = start + skip + j * world
    valid = j < count
    slots = table_slots(table_ptr, req, table_stride, table_rows, entry, valid, BS, max_blocks)
    slots = tl.where(slots >= 0, slots // world, -1)
    tl.store(idx_ptr + t.to(tl.int64) * idx_stride + j, slots, mask=j < width)
    tl.store(len_ptr + t, count)


@triton.jit
def _step_kernel(pos_ptr, req_ptr, valid_ptr,
                 swa_table, swa_table_stride, swa_table_rows, swa_max_blocks, swa_idx, swa_idx_stride, swa_len,
                 swa_width, c128_table, c128_table_stride, c128_table_rows, c128_max_blocks, c128_idx, c128_idx_stride,
                 c128_len, c128_width,
                 c4_idx, c4_idx_stride, c4_local, c4_local_stride, c4_len, c4_bound, topk, swa_span, c128_span,
                 world, rank, SWA_BS: tl.constexpr, SWA_P2: tl.constexpr, C128_BS: tl.constexpr, C128_P2: tl.constexpr,
                 TOPK_P2: tl.constexpr, HAS_SWA: tl.constexpr, HAS_C128A: tl.constexpr, HAS_C4A: tl.constexpr,
                 PICKS_RATIO: tl.constexpr):
    """Everything ``build_step_metadata`` writes for token ``t``: validity, SWA row, C128A row, the picks
    buffers (c4a or dsa) emptied until a layer converts its picks, and the bound of any layer's picks count,
    ``min(topk, entries visible)``. The window rows hold the entries rank ``rank`` of ``world`` owns (world 1: all:
    :func:`_window_row`)."""
    t = tl.program_id(0)
    pos = tl.load(pos_ptr + t)
    req = tl.load(req_ptr + t)  # clamped into the table by table_slots
    tl.store(valid_ptr + t, (pos >= 0).to(tl.int32))
    if HAS_SWA:
        _window_row(t, pos, req, swa_table, swa_table_stride, swa_table_rows, swa_max_blocks, swa_idx,
                    swa_idx_stride, swa_len, swa_width, swa_span, world, rank, 1, SWA_BS, SWA_P2)
    if HAS_C128A:
        _window_row(t, pos, req, c128_table, c128_table_stride, c128_table_rows, c128_max_blocks, c128_idx,
                    c128_idx_stride, c128_len, c128_width, c128_span, world, rank, 128, C128_BS, C128_P2)
    if HAS_C4A:
        j = tl.arange(0, TOPK_P2)
        none = tl.full((TOPK_P2,), -1, tl.int32)
        tl.store(c4_idx + t.to(tl.int64) * c4_idx_stride + j, none, mask=j < topk)
        tl.store(c4_local + t.to(tl.int64) * c4_local_stride + j, none, mask=j < topk)
        tl.store(c4_len + t, 0)
        tl.store(c4_bound + t, tl.minimum(tl.where(pos >= 0, (pos + 1) // PICKS_RATIO, 0), topk))


@triton.jit
def _picks_kernel(pos_ptr, req_ptr, table_ptr, table_stride, table_rows, max_blocks, local_ptr, local_stride,
                  idx_ptr, idx_stride, len_ptr, kept_ptr, kept_stride, topk, world, rank,
                  RATIO: tl.constexpr, BS: tl.constexpr, TOPK_P2: tl.constexpr):
    """Indexer picks -> slots of the visible ones that rank ``rank`` of ``world`` owns (and the kept picks
    themselves), compacted in order. world 1: every visible pick, its slot; world > 1: the table's virtual slot
    ``v`` names its owner ``v % world`` and the owner's slot ``v // world`` (``sparse_mla.context_parallel``)."""
    t = tl.program_id(0)
    pos = tl.load(pos_ptr + t)
    req = tl.load(req_ptr + t)  # clamped into the table by table_slots
    j = tl.arange(0, TOPK_P2)
    local = tl.load(local_ptr + t.to(tl.int64) * local_stride + j, mask=j < topk, other=-1)
    visible = tl.where(pos >= 0, (pos + 1) // RATIO, 0)
    keep = (local >= 0) & (local < visible)
    slots = table_slots(table_ptr, req, table_stride, table_rows, local, keep, BS, max_blocks)
    if world > 1:  # (a slot of -1, a missing block, is nobody's)
        keep = keep & (slots >= 0) & (slots % world == rank)
        slots = slots // world
    dest = tl.cumsum(keep.to(tl.int32), 0) - 1
    count = tl.sum(keep.to(tl.int32), 0)
    row = idx_ptr + t.to(tl.int64) * idx_stride
    kept_row = kept_ptr + t.to(tl.int64) * kept_stride
    tail = (j >= count) & (j < topk)
    tl.store(row + dest, slots, mask=keep)  # kept picks fill positions 0 … count-1, each exactly once
    tl.store(row + j, tl.full((TOPK_P2,), -1, tl.int32), mask=tail)
    tl.store(kept_row + dest, local, mask=keep)
    tl.store(kept_row + j, tl.full((TOPK_P2,), -1, tl.int32), mask=tail)
    tl.store(len_ptr + t, count)


class WindowList(NamedTuple):
    """A window-shaped index list to fill: the kind's block table and block size, the
    ``indices (T, width)`` / ``lens (T,)`` buffers, and ``span``: the most entries a row names over every rank
    (the SWA window; c128a's entries of ``max_model_len``), None for ``width`` (one rank: they are equal)."""

    table: torch.Tensor
    block_size: int
    indices: torch.Tensor
    lens: torch.Tensor
    span: int | None = None


def step_lists(positions: torch.Tensor, token_to_req: torch.Tensor, out_valid: torch.Tensor,
               swa: WindowList | None, c128a: WindowList | None,
               picks: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None, picks_ratio: int = 1,
               world: int = 1, rank: int = 0) -> None:
    """The step's shared index lists in one launch: ``out_valid (T,)`` (position >= 0), the SWA window
    rows (when ``swa``), every complete C128A entry (when ``c128a``), and the picks buffers
    ``(indices, local, lens, bound)`` (when ``picks``): reset to empty, and ``bound`` = ``min(topk,
    (pos + 1) // picks_ratio)``. world / rank: the window rows hold only the entries that rank owns, as its slots
    (a context-parallel rank's lists, built compact: :func:`_window_row`)."""
    step_lists_launcher(positions, token_to_req, out_valid, swa, c128a, picks, picks_ratio, world, rank)()


def step_lists_launcher(positions: torch.Tensor, token_to_req: torch.Tensor, out_valid: torch.Tensor,
                        swa: WindowList | None, c128a: WindowList | None,
                        picks: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None,
                        picks_ratio: int = 1, world: int = 1, rank: int = 0):
    """:func:`step_lists` with every argument bound: returns ``fill()``, one launch per call (the step metadata
    keeps it: its buffers and the builder's are the same every step)."""
    num_tokens = positions.shape[0]
    # an absent list is never touched (HAS_*): the valid flags fill its arguments
    stand_in = WindowList(out_valid[None, :], 1, out_valid[None, :], out_valid)
    lists = [swa or stand_in, c128a or stand_in]
    p_idx, p_local, p_len, p_bound = picks if picks is not None else (stand_in.indices, stand_in.indices,
                                                                        out_valid, out_valid)
    topk = p_idx.shape[1]
    args = [a for lst in lists for a in (lst.table, lst.table.stride(0), lst.table.shape[0], lst.table.shape[1],
                                        lst.indices, lst.indices.stride(0), lst.lens, lst.indices.shape[1])]
    constexprs = dict(SWA_BS=lists[0].block_size, SWA_P2=triton.next_power_of_2(lists[0].indices.shape[1]),
                      C128_BS=lists[1].block_size, C128_P2=triton.next_power_of_2(lists[1].indices.shape[1]),
                      TOPK_P2=triton.next_power_of_2(topk), HAS_SWA=swa is not None, HAS_C128A=c128a is not None,
                      HAS_C4A=picks is not None, PICKS_RATIO=picks_ratio)
    launch = cached_launch(_step_kernel, tuple(constexprs.items()))
    spans = [lst.indices.shape[1] if lst.span is None else lst.span for lst in lists]
    all_args = (positions, token_to_req, out_valid, *args, p_idx, p_idx.stride(0), p_local, p_local.stride(0),
                p_len, p_bound, topk, *spans, world, rank)
    grid = (num_tokens,)

    def fill() -> None:
        if num_tokens:
            launch(grid, *all_args)
    return fill


def compressed_picks(positions: torch.Tensor, token_to_req: torch.Tensor, table: torch.Tensor, block_size: int,
                     ratio: int, local: torch.Tensor, out_indices: torch.Tensor, out_lens: torch.Tensor,
                     out_kept: torch.Tensor, world: int = 1, rank: int = 0) -> None:
    """Fill ``out_indices (T, topk)`` / ``out_lens`` from the indexer's local picks ``local (T, topk)``;
    ``out_kept (T, topk)`` receives the kept picks themselves, compacted the same way. world / rank: keep only the
    picks that rank owns, as its slots (a context-parallel rank's lists)."""
    picks_converter(positions, token_to_req, table, block_size, ratio, out_indices, out_lens, out_kept, world,
                    rank)(local)


def picks_converter(positions: torch.Tensor, token_to_req: torch.Tensor, table: torch.Tensor, block_size: int,
                    ratio: int, out_indices: torch.Tensor, out_lens: torch.Tensor, out_kept: torch.Tensor,
                    world: int = 1, rank: int = 0):
    """:func:`compressed_picks` with everything but the picks bound once (a step's layers convert their picks
    into the same buffers): returns ``convert(local)``, one launch per call. From the second call on, picks with the
    first call's row stride and 16-byte alignment go through the launch bound then (:meth:`Launch.bind`)."""
    num_tokens, topk = out_indices.shape
    launch = cached_launch(_picks_kernel, (("RATIO", ratio), ("BS", block_size),
                                           ("TOPK_P2", triton.next_power_of_2(topk))))
    head = (positions, token_to_req, table, table.stride(0), table.shape[0], table.shape[1])
    tail = (out_indices, out_indices.stride(0), out_lens, out_kept, out_kept.stride(0), topk, world, rank)
    # every tensor but the picks is the step's: bound with the launch (the step plan that holds this converter holds
    # them too); the picks and their row stride sit between head and tail
    fixed = frozenset(i for i, a in enumerate((*head, None, None, *tail)) if isinstance(a, torch.Tensor))
    grid = (num_tokens,)
    slot = BindOnce()  # the launch bound to the first call's picks, under their row stride and alignment

    def convert(local: torch.Tensor) -> None:
        if not num_tokens:
            return
        key = (local.stride(0), local.data_ptr() & 15 == 0)
        if slot(key, [local]):
            return
        args = (*head, local, local.stride(0), *tail)
        launch(grid, *args)
        slot.settle(key, lambda: launch.bind(grid, args, fixed))
    return convert


@triton.jit
def _ragged_kernel(idx_ptr, idx_stride, len_ptr, indptr_ptr, flat_ptr, num_rows, width, capacity,
                   ROWS_BLOCK: tl.constexpr, COLS_BLOCK: tl.constexpr):
    """Row ``t`` of the padded list into ``flat[indptr[t] : indptr[t+1]]``; ``indptr[t+1]`` = the sum of the
    clamped lens of rows ``0 … t`` (summed by each program: no second launch); program ``t`` also fills its
    share of the flat tail past the last row with ``-1``."""
    t = tl.program_id(0)
    start = t * 0
    for r0 in range(0, t, ROWS_BLOCK):
        r = r0 + tl.arange(0, ROWS_BLOCK)
        n = tl.load(len_ptr + r, mask=r < t, other=0)
        start += tl.sum(tl.minimum(tl.maximum(n, 0), width), 0)
    n_t = tl.minimum(tl.maximum(tl.load(len_ptr + t), 0), width)
    if t == 0:
        tl.store(indptr_ptr, 0)
    tl.store(indptr_ptr + t + 1, start + n_t)
    row = idx_ptr + t.to(tl.int64) * idx_stride
    for c0 in range(0, n_t, COLS_BLOCK):
        j = c0 + tl.arange(0, COLS_BLOCK)
        keep = (j < n_t) & (start + j < capacity)
        tl.store(flat_ptr + start + j, tl.load(row + j, mask=keep, other=-1), mask=keep)
    if t == num_rows - 1:  # the last row knows the total: it clears the tail
        for c0 in range(start + n_t, capacity, COLS_BLOCK):
            j = c0 + tl.arange(0, COLS_BLOCK)
            tl.store(flat_ptr + j, tl.full((COLS_BLOCK,), -1, tl.int32), mask=j < capacity)


def ragged_from_padded(indices: torch.Tensor, lens: torch.Tensor, out_indptr: torch.Tensor,
                       out_flat: torch.Tensor) -> None:
    """:func:`sparse_mla.index_forms.ragged_from_padded` in one launch (arguments checked there, at least one row).

    indices: ``(T, width)`` int32 with unit-stride rows; lens: ``(T,)`` int32, contiguous; out_indptr: ``(T+1,)``
    int32; out_flat: ``(capacity,)`` int32."""
    num_tokens, width = indices.shape
    cached_launch(_ragged_kernel, (("ROWS_BLOCK", 1024), ("COLS_BLOCK", 256)))(
        (num_tokens,), indices, indices.stride(0), lens, out_indptr, out_flat, num_tokens, width, out_flat.shape[0])


@triton.jit
def _key_blocks(lens_ptr, t, valid, KEYS_PER_BLOCK: tl.constexpr):
    lens = tl.load(lens_ptr + t, mask=valid, other=0)
    lens = tl.minimum(tl.maximum(lens, 0), 1 << 30).to(tl.int32)  # int64 lens too: no overflow below
    return (lens + KEYS_PER_BLOCK - 1) // KEYS_PER_BLOCK


@triton.jit
def _order_kernel(l0_ptr, l1_ptr, order_ptr, n, HAS_L1: tl.constexpr, KEYS_PER_BLOCK: tl.constexpr,
                  BLOCK: tl.constexpr):
    """Each token's rank, ``#{u: blocks(u) > blocks(t)} + #{u < t: blocks(u) == blocks(t)}``, counted
    against every other token, BLOCK × BLOCK at a time; ``order[rank] = t``."""
    t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mine = t < n
    b_t = _key_blocks(l0_ptr, t, mine, KEYS_PER_BLOCK)
    if HAS_L1:
        b_t += _key_blocks(l1_ptr, t, mine, KEYS_PER_BLOCK)
    rank = tl.zeros([BLOCK], tl.int32)
    for start in range(0, n, BLOCK):
        u = start + tl.arange(0, BLOCK)
        b_u = _key_blocks(l0_ptr, u, u < n, KEYS_PER_BLOCK)
        if HAS_L1:
            b_u += _key_blocks(l1_ptr, u, u < n, KEYS_PER_BLOCK)
        ahead = (b_u[None, :] > b_t[:, None]) | ((b_u[None, :] == b_t[:, None]) & (u[None, :] < t[:, None]))
        rank += tl.sum((ahead & (u < n)[None, :]).to(tl.int32), axis=1)
    tl.store(order_ptr + rank, t, mask=mine)


def longest_first(lens: torch.Tensor, extra_lens: torch.Tensor | None, keys_per_block: int,
                  order: torch.Tensor) -> None:
    """:func:`sparse_mla.ops.order.longest_first` into ``order`` in one launch (arguments checked there).
    Every token is ranked against every other: meant for decode-sized batches (the caller sorts larger ones)."""
    n = lens.shape[0]
    if n:
        lens = lens.contiguous()
        second = lens if extra_lens is None else extra_lens.contiguous()
        block = 128
        constexprs = (("HAS_L1", extra_lens is not None), ("KEYS_PER_BLOCK", keys_per_block), ("BLOCK", block))
        # (-(-n // block): on Triton 3.6 triton.cdiv is a constexpr function, slow to call from the host)
        cached_launch(_order_kernel, constexprs)((-(-n // block),), lens, second, order, n)
