"""Triton step-metadata index builders (DESIGN §3), one program per token.

Each writes a valid-prefix row of cache slots (valid first, ``-1`` after) and its length, into
caller-owned buffers, exactly as the torch builders of :mod:`sparse_mla.metadata` do. Padding
tokens (``positions < 0``) get empty rows.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _slots(table_row, entry, valid, BS: tl.constexpr, MAX_BLOCKS):
    """Slots of ``entry`` numbers through one request's block table row (``-1`` where invalid)."""
    col = tl.minimum(tl.where(valid, entry, 0) // BS, MAX_BLOCKS - 1)
    phys = tl.load(table_row + col, mask=valid, other=-1)
    return tl.where(valid & (phys >= 0), phys * BS + entry % BS, -1)


@triton.jit
def _window_kernel(pos_ptr, req_ptr, table_ptr, table_stride, max_blocks, idx_ptr, idx_stride, len_ptr, width,
                   RATIO: tl.constexpr, BS: tl.constexpr, WIDTH_P2: tl.constexpr):
    """RATIO 1: the SWA window ``max(0, pos-W+1) … pos``; otherwise every entry complete before pos."""
    t = tl.program_id(0)
    pos = tl.load(pos_ptr + t)
    req = tl.maximum(tl.load(req_ptr + t), 0)
    j = tl.arange(0, WIDTH_P2)
    if RATIO == 1:
        start = tl.maximum(pos - width + 1, 0)
        count = tl.where(pos >= 0, pos - start + 1, 0)
        entry = start + j
    else:
        count = tl.where(pos >= 0, (pos + 1) // RATIO, 0)
        entry = j
    count = tl.minimum(count, width)
    valid = j < count
    slots = _slots(table_ptr + req.to(tl.int64) * table_stride, entry, valid, BS, max_blocks)
    tl.store(idx_ptr + t.to(tl.int64) * idx_stride + j, slots, mask=j < width)
    tl.store(len_ptr + t, count)


@triton.jit
def _picks_kernel(pos_ptr, req_ptr, table_ptr, table_stride, max_blocks, local_ptr, local_stride,
                  idx_ptr, idx_stride, len_ptr, kept_ptr, kept_stride, topk,
                  RATIO: tl.constexpr, BS: tl.constexpr, TOPK_P2: tl.constexpr):
    """Indexer picks -> slots of the visible ones (and the kept picks themselves), compacted in order."""
    t = tl.program_id(0)
    pos = tl.load(pos_ptr + t)
    req = tl.maximum(tl.load(req_ptr + t), 0)
    j = tl.arange(0, TOPK_P2)
    local = tl.load(local_ptr + t.to(tl.int64) * local_stride + j, mask=j < topk, other=-1)
    visible = tl.where(pos >= 0, (pos + 1) // RATIO, 0)
    keep = (local >= 0) & (local < visible)
    slots = _slots(table_ptr + req.to(tl.int64) * table_stride, local, keep, BS, max_blocks)
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


def window_indices(positions: torch.Tensor, token_to_req: torch.Tensor, table: torch.Tensor, block_size: int,
                   ratio: int, out_indices: torch.Tensor, out_lens: torch.Tensor) -> None:
    """Fill ``out_indices (T, width)`` / ``out_lens (T,)``: the SWA window (ratio 1) or all complete entries."""
    num_tokens, width = out_indices.shape
    if num_tokens:
        _window_kernel[(num_tokens,)](positions, token_to_req, table, table.stride(0), table.shape[1], out_indices,
                                      out_indices.stride(0), out_lens, width, RATIO=ratio, BS=block_size,
                                      WIDTH_P2=triton.next_power_of_2(width))


def compressed_picks(positions: torch.Tensor, token_to_req: torch.Tensor, table: torch.Tensor, block_size: int,
                     ratio: int, local: torch.Tensor, out_indices: torch.Tensor, out_lens: torch.Tensor,
                     out_kept: torch.Tensor) -> None:
    """Fill ``out_indices (T, topk)`` / ``out_lens`` from the indexer's local picks ``local (T, topk)``;
    ``out_kept (T, topk)`` receives the kept picks themselves, compacted the same way."""
    num_tokens, topk = local.shape
    if num_tokens:
        _picks_kernel[(num_tokens,)](positions, token_to_req, table, table.stride(0), table.shape[1], local,
                                     local.stride(0), out_indices, out_indices.stride(0), out_lens, out_kept,
                                     out_kept.stride(0), topk,
                                     RATIO=ratio, BS=block_size, TOPK_P2=triton.next_power_of_2(topk))
