"""Triton insert of indexer keys into an :class:`~sparse_mla.indexer_cache.IndexerKeyCache` (reference:
``IndexerKeyCache.write``; entry point :func:`sparse_mla.index_keys.insert_index_keys`).

One program per key: optionally ropes it (V4's interleaved tail, at the given position), rounds it to bf16
(integer round-to-nearest-even: the interpreter's bytes are the GPU's) and stores it — as bf16, or as fp8 in the
page-planar layout: the e4m3 codes of ``x̂ · 2^-e`` at ``128·offset`` of the page and the float32 scale ``2^e`` at
``128·block_size + 4·offset``, ``e = ceil(log2(max(amax(x̂), 1e-4) / 448))`` taken exactly from the float's bits.
A slot of ``-1`` or out of range is skipped.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...indexer_cache import INDEX_AMAX_FLOOR, INDEX_HEAD_DIM
from ..launch import cached_launch
from .cache import E4M3_MAX, e4m3_bits
from .rows import E4M3_NAN, UE8M0_BIAS, kernel_const
from .compress import rope_tail, round_bf16

AMAX_FLOOR = kernel_const(INDEX_AMAX_FLOOR)
HEAD_DIM = kernel_const(INDEX_HEAD_DIM)


@triton.jit
def _index_insert_kernel(keys_ptr, key_stride, slot_ptr, pos_ptr, inv_freq_ptr, cache_ptr, page_stride, num_slots,
                         BS: tl.constexpr, FP8: tl.constexpr, ROPE: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if (slot >= 0) & (slot < num_slots):
        cols = tl.arange(0, HEAD_DIM)
        x = tl.load(keys_ptr + t * key_stride + cols).to(tl.float32)
        if ROPE > 0:
            x = rope_tail(x, tl.load(pos_ptr + t), inv_freq_ptr, HEAD_DIM, ROPE)
        x = round_bf16(x)
        block = slot // BS
        off = slot - block * BS
        page = cache_ptr + block * page_stride
        if FP8:
            ratio = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), 0), AMAX_FLOOR), E4M3_MAX)
            bits = ratio.to(tl.int32, bitcast=True)
            e = ((bits >> 23) & 0xFF) - UE8M0_BIAS + ((bits & 0x7FFFFF) != 0).to(tl.int32)
            inv_scale = ((UE8M0_BIAS - e) << 23).to(tl.float32, bitcast=True)  # exact 2^-e
            codes = tl.where(x != x, E4M3_NAN, e4m3_bits(x * inv_scale).to(tl.int32)).to(tl.uint8)
            tl.store(page + off * HEAD_DIM + cols, codes)
            scale = ((e + UE8M0_BIAS) << 23).to(tl.float32, bitcast=True)
            tl.store((page + BS * HEAD_DIM + off * 4).to(tl.pointer_type(tl.float32)), scale)
        else:
            tl.store(page + off * HEAD_DIM + cols, x.to(tl.bfloat16))


def insert_index_keys(keys: torch.Tensor, data: torch.Tensor, fp8: bool, slots: torch.Tensor,
                      positions: torch.Tensor | None, inv_freq: torch.Tensor | None) -> None:
    """Launch the insert on checked arguments: ``keys (n, 128)``, the cache's ``data`` (fp8: uint8
    ``(blocks, bs, 132)``; bf16: ``(blocks, bs, 128)``), ``slots (n,)`` int32, optional rope ``positions (n,)`` and
    its ``inv_freq``."""
    n = keys.shape[0]
    if n == 0:
        return
    if keys.stride(1) != 1:
        keys = keys.contiguous()
    # slot and position t are read at offset t: a strided view (a slice with a step, an expand) is copied
    slots = slots.contiguous()
    positions = None if positions is None else positions.contiguous()
    rope = 0 if positions is None else 2 * inv_freq.shape[0]
    launch = cached_launch(_index_insert_kernel, (("BS", data.shape[1]), ("FP8", fp8), ("ROPE", rope)),
                           (("num_warps", 1),))
    launch((n,), keys, keys.stride(0), slots, slots if positions is None else positions,
           keys if inv_freq is None else inv_freq, data, data.stride(0), data.shape[0] * data.shape[1])
