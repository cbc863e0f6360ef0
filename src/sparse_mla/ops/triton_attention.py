"""Triton sparse MLA attention over paged caches: the kernel behind decode and prefill.

One program handles one query token, a block of up to 64 heads and one split of the token's key
list; it gathers ``BLOCK_N`` keys at a time from one or two index scopes (SWA + compressed),
dequantises them once for all its heads, and runs an online softmax. When a token's key list is
split across programs, a second kernel merges the partial results by their LSE and applies the
sink; otherwise the first kernel finishes the row itself. So every call is at most two launches.
Programs take the tokens in grid order, or in the caller's ``order`` (:mod:`.order`), a token's head
blocks next to each other.

The 512 (V4) or 576 (V3.2) latent dims are handled as four pieces of power-of-two width,
``[256][128][64 or 128] nope + [64] rope``, so no dot is padded. fp8 tiles are dequantised with
their power-of-two scale in one exact multiply (``e4m3 · 2^k`` is exact in bf16).

Out-of-range and ``-1`` indices are never read: the kernel masks them out, whatever the input.
"""
from __future__ import annotations

from collections import OrderedDict

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from .. import formats
from . import dispatch, gluon_attention
from .dispatch import pages_16_byte_aligned
from .launch import Launch, cached_launch
from .validate import D_V, AttentionArgs


def kernel_const(value: int | float) -> int | float | tl.constexpr:
    """A number of :mod:`sparse_mla.formats`' byte-layout table as a global that jit code can read: a constexpr for
    the compiler (which reads no other globals), the plain number for the CPU interpreter (whose arithmetic
    leaves a constexpr global wrapped around the tensors it touches)."""
    return value if dispatch.interpreting() else tl.constexpr(value)


# the byte-layout table of sparse_mla.formats as Triton constants
FMT_BF16 = kernel_const(formats.FMT_BF16)
FMT_FP8_V4 = kernel_const(formats.FMT_FP8_V4)
FMT_FP8_V32 = kernel_const(formats.FMT_FP8_V32)
FMT_FP8_E4M3 = kernel_const(formats.FMT_FP8_E4M3)
UE8M0_BIAS = kernel_const(formats.UE8M0_BIAS)
ROPE_DIM = kernel_const(formats.ROPE_DIM)
V4_TILE = kernel_const(formats.V4_TILE)
V4_BODY_BYTES = kernel_const(formats.V4_BODY_BYTES)
V4_SCALE_BYTES = kernel_const(formats.V4_SCALE_BYTES)
V4_ROPE_OFFSET = kernel_const(formats.V4_ROPE_OFFSET)
V32_TILE = kernel_const(formats.V32_TILE)
V32_TOKEN_BYTES = kernel_const(formats.V32_TOKEN_BYTES)
V32_SCALE_OFFSET = kernel_const(formats.V32_SCALE_OFFSET)
V32_ROPE_OFFSET = kernel_const(formats.V32_ROPE_OFFSET)
E4M3_TOKEN_BYTES = kernel_const(formats.E4M3_TOKEN_BYTES)
LOG2E = 1.4426950408889634


@triton.jit
def _load_piece(row_ptr, scale_ptr, valid, START: tl.constexpr, WIDTH: tl.constexpr, FMT: tl.constexpr,
                DOT: tl.constexpr, BLOCK_N: tl.constexpr):
    """Dequantised dims ``[START, START+WIDTH)`` of ``BLOCK_N`` gathered tokens: ``(BLOCK_N, WIDTH)``.

    row_ptr: ``(BLOCK_N,)`` pointers to each token's first element (bf16 caches) or byte (fp8 caches).
    scale_ptr: fp8_v4 only, pointers to each token's 8 scale bytes.
    fp8_e4m3 values come back as the plain e4m3 numbers: the per-tensor scale is the caller's (``_scope_pass``).
    """
    if FMT == FMT_BF16:
        vals = tl.load(row_ptr[:, None] + (START + tl.arange(0, WIDTH))[None, :], mask=valid[:, None], other=0.0)
        out = vals.to(DOT)
    elif FMT == FMT_FP8_E4M3:
        raw = tl.load(row_ptr[:, None] + (START + tl.arange(0, WIDTH))[None, :], mask=valid[:, None], other=0)
        out = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32).to(DOT)
    else:
        TILE: tl.constexpr = V4_TILE if FMT == FMT_FP8_V4 else V32_TILE
        NT: tl.constexpr = WIDTH // TILE
        t = tl.arange(0, NT)
        cols = START + t[:, None] * TILE + tl.arange(0, TILE)[None, :]
        raw = tl.load(row_ptr[:, None, None] + cols[None, :, :], mask=valid[:, None, None], other=0)
        if FMT == FMT_FP8_V4:
            exps = tl.load(scale_ptr[:, None] + (START // TILE + t)[None, :], mask=valid[:, None], other=UE8M0_BIAS)
            scale = (exps.to(tl.int32) << 23).to(tl.float32, bitcast=True)  # ue8m0 -> 2^(e-127)
        else:
            sp = (row_ptr[:, None] + (V32_SCALE_OFFSET + 4 * (START // TILE + t))[None, :]).to(
                tl.pointer_type(tl.float32))
            scale = tl.load(sp, mask=valid[:, None], other=1.0)
        vals = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale[:, :, None]
        out = tl.reshape(vals, (BLOCK_N, WIDTH)).to(DOT)
    return out


@triton.jit
def _load_rope(row_ptr, valid, FMT: tl.constexpr, ROPE_OFF: tl.constexpr, DOT: tl.constexpr, BLOCK_N: tl.constexpr):
    """The 64 rope dims of the gathered tokens: ``(BLOCK_N, 64)`` (bf16 in the cache; e4m3 in fp8_e4m3)."""
    if FMT == FMT_FP8_E4M3:
        out = _load_piece(row_ptr, row_ptr, valid, ROPE_OFF, ROPE_DIM, FMT, DOT, BLOCK_N)
    else:
        cols = tl.arange(0, ROPE_DIM)
        if FMT == FMT_BF16:
            ptrs = row_ptr[:, None] + ROPE_OFF + cols[None, :]
        else:
            start: tl.constexpr = V4_ROPE_OFFSET if FMT == FMT_FP8_V4 else V32_ROPE_OFFSET
            ptrs = (row_ptr + start).to(tl.pointer_type(tl.bfloat16))[:, None] + cols[None, :]
        out = tl.load(ptrs, mask=valid[:, None], other=0.0).to(DOT)
    return out


@triton.jit
def _token_ptrs(cache_ptr, stride0, slot, FMT: tl.constexpr, BS: tl.constexpr, ROPE_OFF: tl.constexpr):
    """Pointers to the tokens at ``slot`` of a paged cache: their first element (bf16) or byte (fp8), and
    (fp8_v4) their scale bytes, which sit after every body of the block."""
    # bytes (fp8) or elements (bf16) from a token's first byte to the next token's in its block
    ROW: tl.constexpr = (V4_BODY_BYTES if FMT == FMT_FP8_V4 else V32_TOKEN_BYTES if FMT == FMT_FP8_V32
                         else E4M3_TOKEN_BYTES if FMT == FMT_FP8_E4M3 else ROPE_OFF + ROPE_DIM)
    block = slot // BS
    off = slot - block * BS
    block_ptr = cache_ptr + block.to(tl.int64) * stride0
    return block_ptr + off * ROW, block_ptr + BS * V4_BODY_BYTES + off * V4_SCALE_BYTES


@triton.jit
def _scope_pass(acc_a, acc_b, acc_c, acc_r, m_i, l_i, q_a, q_b, q_c, q_r,
                cache_ptr, stride0, num_slots, idx_row, length, blk_lo, blk_hi, qk_scale, kv_scale,
                FMT: tl.constexpr, BS: tl.constexpr, PA: tl.constexpr, PB: tl.constexpr, PC: tl.constexpr,
                BLOCK_N: tl.constexpr, DOT: tl.constexpr, V_HAS_ROPE: tl.constexpr):
    """Online-softmax update over key blocks ``[blk_lo, blk_hi)`` of one scope (base-2 logits).

    The running max is raised only when a block's max exceeds it by more than ``RESCALE_SLACK``
    (then probabilities stay below 2^8), so the accumulators are rescaled on few blocks only.
    fp8_e4m3 keys stay plain e4m3 numbers: the scores take ``kv_scale`` with ``qk_scale`` (FlashInfer's
    bmm1 scale) and the probabilities take it before the value dots (its bmm2 scale).
    """
    ROPE_OFF: tl.constexpr = PA + PB + PC
    RESCALE_SLACK: tl.constexpr = 8.0
    if FMT == FMT_FP8_E4M3:
        qk_scale = qk_scale * kv_scale
    offs = tl.arange(0, BLOCK_N)
    for blk in range(blk_lo, blk_hi):
        j = blk * BLOCK_N + offs
        idx = tl.load(idx_row + j, mask=j < length, other=-1)
        valid = (idx >= 0) & (idx < num_slots)
        slot = tl.where(valid, idx, 0)
        row_ptr, scale_ptr = _token_ptrs(cache_ptr, stride0, slot, FMT, BS, ROPE_OFF)
        k_a = _load_piece(row_ptr, scale_ptr, valid, 0, PA, FMT, DOT, BLOCK_N)
        k_b = _load_piece(row_ptr, scale_ptr, valid, PA, PB, FMT, DOT, BLOCK_N)
        k_c = _load_piece(row_ptr, scale_ptr, valid, PA + PB, PC, FMT, DOT, BLOCK_N)
        k_r = _load_rope(row_ptr, valid, FMT, ROPE_OFF, DOT, BLOCK_N)
        s = tl.dot(q_a, tl.trans(k_a))
        s += tl.dot(q_b, tl.trans(k_b))
        s += tl.dot(q_c, tl.trans(k_c))
        s += tl.dot(q_r, tl.trans(k_r))
        s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
        m_blk = tl.max(s, 1)
        grow = m_blk > m_i + RESCALE_SLACK
        if tl.max(grow.to(tl.int32), 0) > 0:
            m_new = tl.where(grow, m_blk, m_i)
            alpha = tl.where(m_new == m_i, 1.0, tl.exp2(m_i - m_new))
            l_i = l_i * alpha
            acc_a = acc_a * alpha[:, None]
            acc_b = acc_b * alpha[:, None]
            acc_c = acc_c * alpha[:, None]
            if V_HAS_ROPE:
                acc_r = acc_r * alpha[:, None]
            m_i = m_new
        p = tl.exp2(s - tl.where(m_i == float("-inf"), 0.0, m_i)[:, None])
        l_i += tl.sum(p, 1)
        if FMT == FMT_FP8_E4M3:
            p_dot = (p * kv_scale).to(DOT)
        else:
            p_dot = p.to(DOT)
        acc_a = tl.dot(p_dot, k_a, acc_a)
        acc_b = tl.dot(p_dot, k_b, acc_b)
        acc_c = tl.dot(p_dot, k_c, acc_c)
        if V_HAS_ROPE:  # V3.2: V is the 512 nope dims only
            acc_r = tl.dot(p_dot, k_r, acc_r)
    return acc_a, acc_b, acc_c, acc_r, m_i, l_i


@triton.jit
def _load_q(q_tok, heads, head_mask, stride_qh, START: tl.constexpr, WIDTH: tl.constexpr, DOT: tl.constexpr,
            Q_FP8: tl.constexpr):
    """Dims ``[START, START+WIDTH)`` of the token's query heads: ``(H_BLOCK, WIDTH)`` (an fp8 q's bytes as their
    plain e4m3 numbers: ``q_scale`` joins the score scale)."""
    cols = START + tl.arange(0, WIDTH)
    vals = tl.load(q_tok + heads[:, None] * stride_qh + cols[None, :], mask=head_mask[:, None], other=0.0)
    if Q_FP8:
        vals = vals.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    return vals.to(DOT)


@triton.jit
def _ragged_start(len_ptr, width, tok):
    """A ragged scope's ``indptr[tok]`` (``len_ptr`` is the indptr), clamped into its flat list of ``width``."""
    return tl.minimum(tl.maximum(tl.load(len_ptr + tok), 0), width)


@triton.jit
def _scope_len(len_ptr, width, tok, skip, RAGGED: tl.constexpr, SKIP: tl.constexpr):
    """Token ``tok``'s key count in one scope, clamped so no read leaves the index list.

    Padded: ``lens[tok]`` (minus ``skip`` with ``SKIP``: the compressed part of a combined index, whose first
    ``skip`` columns are the other scope's), at most ``width``. Ragged: ``indptr[tok+1] - indptr[tok]``, within the
    flat list of ``width`` entries.
    """
    if RAGGED:
        start = _ragged_start(len_ptr, width, tok)
        length = tl.minimum(tl.maximum(tl.load(len_ptr + tok + 1) - start, 0), width - start)
    else:
        n = tl.load(len_ptr + tok)
        if SKIP:
            n = n - skip
        length = tl.minimum(tl.maximum(n, 0), width)
    return length


@triton.jit
def _scope_row(idx_ptr, idx_stride, len_ptr, width, tok, RAGGED: tl.constexpr):
    """Token ``tok``'s index row in one scope: row ``tok`` of padded ``(T, width)`` indices, or the ragged
    ``idx_ptr[indptr[tok]:]``."""
    if RAGGED:
        row = idx_ptr + _ragged_start(len_ptr, width, tok).to(tl.int64)
    else:
        row = idx_ptr + tok.to(tl.int64) * idx_stride
    return row


@triton.jit
def _store_piece(ptr, heads, head_mask, acc, factor, START: tl.constexpr, WIDTH: tl.constexpr, stride_h):
    cols = tl.arange(0, WIDTH)
    vals = acc * factor[:, None]
    tl.store(ptr + heads[:, None] * stride_h + START + cols[None, :], vals.to(ptr.dtype.element_ty),
             mask=head_mask[:, None])


@triton.jit
def _ordered_token(order_ptr, i, num_tokens):
    """The token the ``i``-th program takes: ``order[i]``, clamped into range (``validate._order``)."""
    return tl.minimum(tl.maximum(tl.load(order_ptr + i), 0), num_tokens - 1)


@triton.jit
def _sparse_mla_kernel(
    q_ptr, stride_qt, stride_qh,
    out_ptr, lse_ptr, part_o_ptr, part_lse_ptr, sink_ptr, order_ptr,
    c0_ptr, c0_stride0, c0_slots, i0_ptr, i0_stride, l0_ptr, w0,
    c1_ptr, c1_stride0, c1_slots, i1_ptr, i1_stride, l1_ptr, w1,
    num_tokens, num_heads, tokens_per_len, qk_scale, kv_scale_ptr, q_scale_ptr,
    FMT0: tl.constexpr, FMT1: tl.constexpr, BS0: tl.constexpr, BS1: tl.constexpr, HAS_EXTRA: tl.constexpr, HAS_SINK: tl.constexpr,
    HAS_ORDER: tl.constexpr,
    PA: tl.constexpr, PB: tl.constexpr, PC: tl.constexpr, V_HAS_ROPE: tl.constexpr,
    H_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, SPLIT_BLOCKS: tl.constexpr,
    DOT: tl.constexpr, Q_FP8: tl.constexpr, RAGGED0: tl.constexpr, RAGGED1: tl.constexpr, COMBINED: tl.constexpr,
):
    head_blocks = tl.cdiv(num_heads, H_BLOCK)  # a token's head blocks are neighbours in the grid
    tok = tl.program_id(0) // head_blocks
    if HAS_ORDER:
        tok = _ordered_token(order_ptr, tok, num_tokens)
    hb = tl.program_id(0) % head_blocks
    split = tl.program_id(1)
    heads = hb * H_BLOCK + tl.arange(0, H_BLOCK)
    head_mask = heads < num_heads
    ROPE_OFF: tl.constexpr = PA + PB + PC

    q_tok = q_ptr + tok.to(tl.int64) * stride_qt
    q_a = _load_q(q_tok, heads, head_mask, stride_qh, 0, PA, DOT, Q_FP8)
    q_b = _load_q(q_tok, heads, head_mask, stride_qh, PA, PB, DOT, Q_FP8)
    q_c = _load_q(q_tok, heads, head_mask, stride_qh, PA + PB, PC, DOT, Q_FP8)
    q_r = _load_q(q_tok, heads, head_mask, stride_qh, ROPE_OFF, ROPE_DIM, DOT, Q_FP8)
    if Q_FP8:  # FlashInfer's bmm1 scale: scale · q_scale (· kv_scale, per fp8_e4m3 scope)
        qk_scale = qk_scale * tl.load(q_scale_ptr)
    kv_scale = 1.0
    if (FMT0 == FMT_FP8_E4M3) | (FMT1 == FMT_FP8_E4M3):
        kv_scale = tl.load(kv_scale_ptr)

    len_row = tok // tokens_per_len  # the host keeps tokens_per_len 1 with ragged scopes (a row per token)
    len0 = _scope_len(l0_ptr, w0, len_row, 0, RAGGED0, False)
    nblk0 = tl.cdiv(len0, BLOCK_N)
    len1 = 0
    if HAS_EXTRA:
        len1 = _scope_len(l1_ptr, w1, len_row, w0, RAGGED1, COMBINED)
    nblk1 = tl.cdiv(len1, BLOCK_N)
    if SPLIT_BLOCKS > 0:  # batch-invariant: the cut depends on this token's lists alone
        per_split = SPLIT_BLOCKS
    else:
        per_split = tl.cdiv(nblk0 + nblk1, SPLITS)
    lo = split * per_split
    hi = tl.minimum(lo + per_split, nblk0 + nblk1)

    acc_a = tl.zeros((H_BLOCK, PA), tl.float32)
    acc_b = tl.zeros((H_BLOCK, PB), tl.float32)
    acc_c = tl.zeros((H_BLOCK, PC), tl.float32)
    acc_r = tl.zeros((H_BLOCK, ROPE_DIM), tl.float32)
    m_i = tl.full((H_BLOCK,), float("-inf"), tl.float32)
    l_i = tl.zeros((H_BLOCK,), tl.float32)
    acc_a, acc_b, acc_c, acc_r, m_i, l_i = _scope_pass(
        acc_a, acc_b, acc_c, acc_r, m_i, l_i, q_a, q_b, q_c, q_r,
        c0_ptr, c0_stride0, c0_slots, _scope_row(i0_ptr, i0_stride, l0_ptr, w0, tok, RAGGED0), len0,
        tl.minimum(lo, nblk0), tl.minimum(hi, nblk0), qk_scale, kv_scale, FMT0, BS0, PA, PB, PC, BLOCK_N, DOT,
        V_HAS_ROPE)
    if HAS_EXTRA:
        acc_a, acc_b, acc_c, acc_r, m_i, l_i = _scope_pass(
            acc_a, acc_b, acc_c, acc_r, m_i, l_i, q_a, q_b, q_c, q_r,
            c1_ptr, c1_stride0, c1_slots, _scope_row(i1_ptr, i1_stride, l1_ptr, w1, tok, RAGGED1), len1,
            tl.maximum(lo, nblk0) - nblk0, hi - nblk0, qk_scale, kv_scale, FMT1, BS1, PA, PB, PC, BLOCK_N, DOT,
            V_HAS_ROPE)

    empty = l_i == 0.0
    inv_l = tl.where(empty, 0.0, 1.0 / tl.where(empty, 1.0, l_i))
    # natural-log LSE of the real keys; -inf marks an empty partial, +inf an empty final row
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) / 1.4426950408889634)
    if SPLITS == 1 and SPLIT_BLOCKS == 0:
        factor = inv_l
        if HAS_SINK:
            sink = tl.load(sink_ptr + heads, mask=head_mask, other=float("-inf"))
            factor = factor / (1.0 + tl.exp(sink - tl.where(empty, 0.0, lse)))
        row = out_ptr + tok.to(tl.int64) * num_heads * 512
        tl.store(lse_ptr + tok * num_heads + heads, tl.where(empty, float("inf"), lse), mask=head_mask)
    else:
        factor = inv_l
        part = (split * num_tokens + tok).to(tl.int64) * num_heads
        row = part_o_ptr + part * 512
        tl.store(part_lse_ptr + part + heads, lse, mask=head_mask)
    _store_piece(row, heads, head_mask, acc_a, factor, 0, PA, 512)
    _store_piece(row, heads, head_mask, acc_b, factor, PA, PB, 512)
    _store_piece(row, heads, head_mask, acc_c, factor, PA + PB, PC, 512)
    if V_HAS_ROPE:
        _store_piece(row, heads, head_mask, acc_r, factor, ROPE_OFF, 64, 512)


@triton.jit
def _combine_kernel(part_o_ptr, part_lse_ptr, out_ptr, lse_ptr, sink_ptr, order_ptr, num_rows, num_heads, first_slot,
                    SPLITS: tl.constexpr, HAS_SINK: tl.constexpr, TAIL: tl.constexpr, HAS_ORDER: tl.constexpr):
    """Merge the ``SPLITS`` partial rows (normalised outputs + LSE) of one (token, head) and apply the sink: a
    program per row of every token, or with ``TAIL`` of the token slots from ``first_slot`` on (through ``order``
    when given, as the Gluon kernel numbers them), the only ones whose lists were cut.

    The partials are summed one after another in split order, and empty ones (LSE ``-inf``) are skipped
    exactly, so a row's result depends on its own non-empty partials only, not on ``SPLITS`` (batch invariance).
    """
    row = tl.program_id(0).to(tl.int64)
    if TAIL:
        tok = first_slot + row // num_heads
        if HAS_ORDER:  # as the attention kernels read the order
            tok = tl.minimum(tl.maximum(tl.load(order_ptr + tok), 0), num_rows // num_heads - 1)
        row = tok * num_heads + row % num_heads
    m = tl.load(part_lse_ptr + row)
    for s in range(1, SPLITS):
        m = tl.maximum(m, tl.load(part_lse_ptr + s * num_rows + row))
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    total = 0.0
    for s in range(SPLITS):
        lse_s = tl.load(part_lse_ptr + s * num_rows + row)
        total = tl.where(lse_s == float("-inf"), total, total + tl.exp(lse_s - m_safe))
    empty = total == 0.0
    lse = m_safe + tl.log(tl.where(empty, 1.0, total))
    factor = tl.where(empty, 0.0, 1.0 / tl.where(empty, 1.0, total))
    if HAS_SINK:
        sink = tl.load(sink_ptr + row % num_heads)
        factor = factor / (1.0 + tl.exp(sink - lse))
    cols = tl.arange(0, 512)
    out = tl.zeros([512], tl.float32)
    for s in range(SPLITS):
        lse_s = tl.load(part_lse_ptr + s * num_rows + row)
        part = tl.load(part_o_ptr + (s * num_rows + row) * 512 + cols)
        out = tl.where(lse_s == float("-inf"), out, out + part * (tl.exp(lse_s - m_safe) * factor))
    tl.store(out_ptr + row * 512 + cols, out.to(out_ptr.dtype.element_ty))
    tl.store(lse_ptr + row, tl.where(empty, float("inf"), lse))


def latent_pieces(dim: int) -> tuple[int, int, int, bool]:
    """(PA, PB, PC, V_HAS_ROPE): nope split into power-of-two pieces; V4's V includes the rope dims."""
    return (256, 128, 64, True) if dim == 512 else (256, 128, 128, False)


def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_splits(num_tokens: int, num_heads: int, head_blocks: int, max_blocks: int, device: torch.device,
                  tails: bool = False) -> tuple[int, int]:
    """How many pieces key lists are cut into (the pieces merged by the combine kernel), and whose: ``(pieces,
    tokens)``, the tokens being the last ones in the launch's order (``(1, 0)``: nothing is cut).

    num_heads: a token's heads (all its head blocks'); max_blocks: the longest key list the widths allow, in key
    blocks (the scopes' widths summed). A program holds a whole SM (its accumulators fill the register file), so
    the grid runs in waves of one program per SM. A grid that leaves at least half the SMs idle is split to fill
    them. A larger grid is split, into pieces of at least 4 blocks, only where that cuts its estimated time by over
    15 %, counted in key-block times: ``waves × blocks per program``, plus per piece (none when unsplit) one block
    for its prologue and one per 32 heads for its float32 partial rows, written and read again by the combine.
    E.g. 148 tokens of 16 heads and 32 blocks on 132 SMs take 2 waves × 32 = 64 block times unsplit and
    5 × 8 + 4 × 1.5 = 46 with every token in four pieces; grids of whole waves (128 or 256 programs on an H100), and
    large ones, whose last wave is a small part of their time, stay unsplit.

    ``tails`` (the Gluon kernel, which numbers its items so): where the last wave is at most half full, only the
    tokens of that wave may be cut instead; their pieces then fill the SMs the other tokens' whole lists leave idle:
    ``full waves × blocks + the pieces' waves × (blocks per piece + the per-piece costs above)``, kept where it is
    5 % shorter. The 16-head example: the last 16 tokens in 8 pieces, 1 × 32 + 1 × (4 + 1.5) = 37.5; 148 tokens of
    128 heads (296 programs): unsplit 3 × 32 = 96, the last 16 tokens in 4 pieces 2 × 32 + (8 + 5) = 77. (Calibrated
    on the H100: BENCHMARKS.md, version 13.)
    """
    programs = num_tokens * head_blocks
    sms = num_sms(device)
    if max_blocks <= 1 or programs == 0:
        return 1, 0
    if 2 * programs <= sms:
        pieces = max(1, min(sms // programs, max_blocks // 2, 32))
        return (pieces, num_tokens) if pieces > 1 else (1, 0)
    per_piece = 1 + num_heads / 32
    sizes = [p for p in (2, 4, 8) if 4 * p <= max_blocks]
    unsplit = triton.cdiv(programs, sms) * max_blocks
    # (estimated time, pieces, tokens cut), kept where it beats the unsplit grid by 15 % (every token's partials
    # cost more than counted here) or, cutting a tail (the partials of at most half a wave), by 5 %
    options = [(triton.cdiv(programs * p, sms) * triton.cdiv(max_blocks, p) + p * per_piece, p, num_tokens)
               for p in sizes]
    options = [o for o in options if o[0] < 0.85 * unsplit]
    last_wave = programs % sms
    if tails and 0 < 2 * last_wave <= sms:
        cut = triton.cdiv(last_wave, head_blocks)  # the last wave's tokens
        options += [o for o in ((programs // sms * max_blocks + triton.cdiv(cut * head_blocks * p, sms)
                                 * (triton.cdiv(max_blocks, p) + per_piece), p, cut) for p in sizes)
                    if o[0] < 0.95 * unsplit]
    return min(options, default=(unsplit, 1, 0))[1:]


# Batch-invariant mode: every token's key list is cut into splits of this many key blocks, whatever the batch,
# and the splits are always merged by the combine kernel (also a token of one split), so a token's output
# depends on its own lists alone. 32 blocks = 2048 keys: every V4 row (at most 128 + 1024 keys) and V3.2 row (top-k
# 2048) is one split (at 16 blocks V4-Pro's rows were two).
INVARIANT_SPLIT_BLOCKS = 32


def default_stages(formats: frozenset[str]) -> int:
    """Pipeline depth of the key loop: 2 when every scope is bf16, else 1.

    bf16 key tiles go from the gather straight into the dots, so Triton turns their loads into
    asynchronous copies one block ahead (28 % faster prefill on an H100). fp8 tiles pass through
    the dequantisation first; pipelining them only added spills (BENCHMARKS.md, prefetch/stages).
    """
    return 2 if formats == frozenset({"bf16"}) else 1


LAST_COMPILED: dict[str, object] = {}  # the last JIT-launched attention kernel, for register/spill reports


def _launch(kernel_name: str, constexprs: tuple, options: tuple) -> Launch:
    """The shared :class:`Launch` of the ``"triton"``, ``"gluon"`` or ``"combine"`` kernel."""
    kernel = {"triton": _sparse_mla_kernel, "combine": _combine_kernel}.get(kernel_name)
    if kernel is None:
        kernel = gluon_attention._attention_kernel
    return cached_launch(kernel, constexprs, options)


class AttentionPlan:
    """One attention launch decided ahead of its tensors: which kernel, grid, splits, the launches and the
    constexprs. Made once per step and layer kind by the layer's step plan, or by :func:`run` for each new
    geometry of the ops' calls; called with any tensors of the planned shapes, formats and alignment.

    q_shape: ``(T, H, d)``. scopes: per scope ``(fmt, block_size, width)``: the cache's format and block size,
    the index rows' width (a ragged scope's: the longest row it can hold, at most its flat capacity).
    ragged: per scope, whether its index list is ragged (an ``indptr`` where a padded scope has its lens).
    combined: the two scopes are the parts of one combined index (FlashInfer's form): scope 0 its first
    ``width0`` columns, scope 1 the rest, and both calls' lens the whole row's count. q_fp8: q is
    float8_e4m3fn (calls pass its ``q_scale``). tokens_per_len: the calls' lens hold one length per that many
    consecutive tokens (``AttentionArgs.tokens_per_len``). has_sink / has_order: whether calls pass a sink / an order.
    batch_invariant: see
    :data:`INVARIANT_SPLIT_BLOCKS`. pages_16_byte_aligned: whether every cache the calls pass has a 16-byte
    aligned base and page stride. scratch: keep the split partials' buffers in the plan (a plan used on one
    stream, as the layer's are) instead of allocating them per call. The remaining keyword arguments override
    tuned launch choices (benchmarks sweep them; ``splits``: every token's list in that many pieces, or with
    ``tail`` (the Gluon kernel) just the last ``tail`` tokens' (:func:`choose_splits`); ``persistent``: the Gluon
    kernel's persistent programs, ``gluon_attention.persistent``; ``narrow=False``: 64-head items where the Gluon
    kernel would take narrow ones, ``gluon_attention.narrow_heads``).
    """

    def __init__(self, q_shape: tuple[int, int, int], device: torch.device, scopes: list, has_sink: bool,
                 has_order: bool, *, batch_invariant: bool = False, pages_16_byte_aligned: bool = True,
                 scratch: bool = False, ragged: tuple[bool, ...] = (), combined: bool = False, q_fp8: bool = False,
                 tokens_per_len: int = 1, block_n: int | None = None, splits: int | None = None, num_warps: int | None = None,
                 num_stages: int | None = None, h_block: int | None = None, gluon: int | None = None,
                 persistent: bool | None = None, tail: int | None = None, narrow: bool | None = None) -> None:
        num_tokens, num_heads, dim = q_shape
        formats = frozenset(f.name for f, _, _ in scopes)
        interpret = device.type != "cuda"
        ragged = tuple(bool(r) for r in ragged) + (False,) * (len(scopes) - len(ragged))
        if combined and (len(scopes) != 2 or any(ragged)):
            raise ValueError("a combined index has two padded scopes")
        if tokens_per_len != 1 and any(ragged):
            raise ValueError("tokens_per_len must be 1 with ragged scopes (an indptr row per token)")
        self.q_fp8, self.tokens_per_len = q_fp8, tokens_per_len
        self.kernel = dispatch.attention_kernel(device, dim, formats, pages_16_byte_aligned, gluon,
                                                padded=not (any(ragged) or combined), q_fp8=q_fp8)
        if self.kernel == "gluon":
            h_block, block_n = gluon_attention.HEADS_PER_PROGRAM, gluon_attention.KEYS_PER_BLOCK
        h_block = h_block or min(64, max(16, triton.next_power_of_2(num_heads)))
        head_blocks = triton.cdiv(num_heads, h_block)
        block_n = block_n or (16 if interpret else 64)
        max_blocks = sum(triton.cdiv(width, block_n) for _, _, width in scopes)
        split_blocks = 0
        if batch_invariant:
            split_blocks = max(1, INVARIANT_SPLIT_BLOCKS * 64 // block_n)  # the same keys per split on every kernel
            splits, tail = max(1, triton.cdiv(max_blocks, split_blocks)), None
        if tail is not None and (self.kernel != "gluon" or (splits or 0) < 2 or not 0 < tail <= num_tokens):
            raise ValueError(f"tail={tail} needs the Gluon kernel, splits >= 2 and 0 < tail <= {num_tokens} tokens")
        if not splits:
            splits, tail = choose_splits(num_tokens, num_heads, head_blocks, max_blocks, device,
                                         tails=self.kernel == "gluon")
        self.q_shape, self.device, self.splits = q_shape, device, splits
        self.partial = splits > 1 or batch_invariant
        # the tokens whose lists are cut (the last ones in the launch's order); the others' items write the output
        self.tail = (num_tokens if tail is None else tail) if self.partial else 0
        tail_only = 0 < self.tail < num_tokens  # the Gluon kernel's TAIL numbering, and the combine's
        self.has_extra = len(scopes) > 1
        self._scratch = self._partials() if self.partial and scratch else None
        (f0, bs0, _), *rest = scopes
        f1, bs1, _ = rest[0] if rest else scopes[0]
        constants = dict(BS0=bs0, BS1=bs1, HAS_EXTRA=self.has_extra, HAS_SINK=has_sink, HAS_ORDER=has_order,
                         SPLITS=splits, SPLIT_BLOCKS=split_blocks)
        if self.kernel == "gluon":
            # every scope of one format: fp8_v4 or bf16 (512-d), fp8_v32 or bf16 (576-d)
            constants.update(FMT=f0.code, D_QK=dim)
            options = {"num_warps": gluon_attention.PARTITION_WARPS}
            # a program per work item (token × head block × split), or persistent: one per SM, taking items in turn
            items, sms = (num_tokens + self.tail * (splits - 1)) * head_blocks, num_sms(device)
            constants["PERSISTENT"] = (gluon_attention.persistent(items, max_blocks, sms) if persistent is None
                                       else persistent)
            constants["TAIL"] = tail_only
            heads_n = gluon_attention.narrow_heads(f0.name, num_heads)
            constants["HEADS_N"] = heads_n if narrow is None or narrow else 0
            self.grid = (sms if constants["PERSISTENT"] else items,)
        else:
            pa, pb, pc, v_has_rope = latent_pieces(dim)
            constants.update(FMT0=f0.code, FMT1=f1.code, PA=pa, PB=pb, PC=pc,
                             V_HAS_ROPE=v_has_rope, H_BLOCK=h_block, BLOCK_N=block_n,
                             DOT=tl.float32 if interpret else tl.bfloat16,  # the interpreter's bf16 dots are wrong
                             Q_FP8=q_fp8, RAGGED0=ragged[0], RAGGED1=ragged[-1] and self.has_extra,
                             COMBINED=combined)
            options = {} if interpret else {"num_warps": num_warps or 8,
                                            "num_stages": num_stages or default_stages(formats)}
            self.grid = (num_tokens * head_blocks, splits)
        self._constants, self._options = tuple(constants.items()), tuple(options.items())
        self.attention = _launch(self.kernel, self._constants, self._options)
        self.combine = (_launch("combine", (("SPLITS", splits), ("HAS_SINK", has_sink),
                                            ("TAIL", tail_only), ("HAS_ORDER", has_order)), ())
                        if self.partial else None)

    def _partials(self) -> tuple[torch.Tensor, torch.Tensor]:
        num_tokens, num_heads, _ = self.q_shape
        f32 = dict(dtype=torch.float32, device=self.device)
        return (torch.empty(self.splits, num_tokens, num_heads, D_V, **f32),
                torch.empty(self.splits, num_tokens, num_heads, **f32))

    def __call__(self, q: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor | None,
                 scale: float, caches: tuple[torch.Tensor, ...], indices: tuple[torch.Tensor, ...],
                 lens: tuple[torch.Tensor, ...], order: torch.Tensor | None, q_scale: torch.Tensor | None = None,
                 kv_scale: torch.Tensor | None = None) -> None:
        """Launch on ``q (T, H, d)`` with unit-stride rows into ``out (T, H, 512)`` (contiguous) and ``lse (T, H)``
        float32; per scope a paged cache, its index rows ``(T, width)`` (unit stride along a row) and lens
        ``(T,)`` (contiguous) — a ragged scope its flat ``(capacity,)`` list and its ``indptr (T+1,)`` in their
        place, a combined index's two scopes its column ranges ``[:, :W]`` / ``[:, W:]`` and the row lens twice;
        ``order (T,)`` int32 when planned with one; ``q_scale`` (an fp8 q) / ``kv_scale`` (fp8_e4m3 caches):
        ``(1,)`` float32."""
        num_tokens, num_heads, _ = self.q_shape
        if num_tokens == 0 or num_heads == 0:
            return
        tensors = self._tensors(q, out, lse, sink, caches, indices, lens, order, q_scale, kv_scale)
        args = self._args(tensors, scale)
        try:
            compiled = self.attention(self.grid, *args)
        except OutOfResources:
            if self.kernel == "gluon" or dict(self._options).get("num_stages", 1) == 1:
                raise
            # a GPU with less shared memory than an H100's cannot hold two pipelined key tiles
            self._options = tuple({**dict(self._options), "num_stages": 1}.items())
            self.attention = _launch(self.kernel, self._constants, self._options)
            compiled = self.attention(self.grid, *args)
        if compiled is not None:
            LAST_COMPILED["attention"] = compiled
        if self.combine is not None:
            self.combine((self.tail * num_heads,), *self._combine_args(tensors))

    # slots of _tensors' list: what a step plan's bound launch fixes (lists_fixed: lse, order, the scopes' indices and
    # lens; the scratch partials), and the combine's tensors in its argument order (partials, out, lse, sink, order)
    LIST_SLOTS, PARTIAL_SLOTS, COMBINE_SLOTS = (2, 6, 8, 9, 11, 12), (3, 4), (3, 4, 1, 2, 5, 6)

    def _combine_args(self, tensors: list[torch.Tensor]) -> tuple:
        """The combine kernel's arguments for :meth:`_tensors`' list."""
        num_tokens, num_heads, _ = self.q_shape
        return (*[tensors[k] for k in self.COMBINE_SLOTS], num_tokens * num_heads, num_heads, num_tokens - self.tail)

    def _tensors(self, q, out, lse, sink, caches, indices, lens, order, q_scale, kv_scale) -> list[torch.Tensor]:
        """The attention kernel's tensor arguments, in its order (absent optional ones stand in as ``lse``, which the
        kernel then does not read): q, out, lse, the split partials, sink, order, per scope cache / indices / lens,
        and for the Triton kernel the fp8 scales."""
        if self.q_fp8:
            q = q.view(torch.uint8)  # the kernel reads an fp8 q's bytes
        c0, i0, l0 = caches[0], indices[0], lens[0]
        c1, i1, l1 = (caches[1], indices[1], lens[1]) if self.has_extra else (c0, i0, l0)
        part_o, part_lse = (self._scratch or self._partials()) if self.partial else (out, lse)
        tensors = [q, out, lse, part_o, part_lse, lse if sink is None else sink, lse if order is None else order,
                   c0, i0, l0, c1, i1, l1]
        if self.kernel == "triton":  # the Gluon kernel reads neither (dispatch gives it no fp8 q or fp8_e4m3)
            tensors += [lse if kv_scale is None else kv_scale, lse if q_scale is None else q_scale]
        return tensors

    def _args(self, tensors: list[torch.Tensor], scale: float) -> tuple:
        """The attention kernel's arguments: :meth:`_tensors` with the strides, sizes and scale between them."""
        q, out, lse, part_o, part_lse, sink_arg, order_arg, c0, i0, l0, c1, i1, l1, *fp8_scales = tensors
        num_tokens, num_heads, _ = self.q_shape
        return (q, q.stride(0), q.stride(1), out, lse, part_o, part_lse, sink_arg, order_arg,
                c0, c0.stride(0), c0.shape[0] * c0.shape[1], i0, i0.stride(0), l0, i0.shape[-1],
                c1, c1.stride(0), c1.shape[0] * c1.shape[1], i1, i1.stride(0), l1, i1.shape[-1],
                num_tokens, num_heads, self.tokens_per_len, scale * LOG2E,
                *(fp8_scales if self.kernel == "triton" else (self.tail,)))

    def bind(self, q: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor | None, scale: float,
             caches: tuple[torch.Tensor, ...], indices: tuple[torch.Tensor, ...], lens: tuple[torch.Tensor, ...],
             order: torch.Tensor | None = None, q_scale: torch.Tensor | None = None,
             kv_scale: torch.Tensor | None = None, *, lists_fixed: bool = False):
        """After a call with these arguments, a function ``bound(q, out, lse, sink, caches, indices, lens, order,
        q_scale, kv_scale) -> bool`` that launches the same kernel (and, for split key lists, the combine) with
        ``scale`` on new tensors laid out as these (every stride, size, dtype and 16-byte alignment: the caller's
        guarantee), skipping the argument assembly and the fingerprint. It reads only the new tensors' data pointers,
        so a tensor of another rank over the same bytes (a 4-D cache for its 3-D paged view) serves. lists_fixed: every
        later call passes these very ``lse``, ``indices``, ``lens`` and ``order`` (a step plan's buffers), whose
        pointers are then bound too (the plan's scratch partials always are). False means it launched nothing (call
        the plan). None where there is no direct launch path."""
        num_tokens, num_heads, _ = self.q_shape
        if num_tokens == 0 or num_heads == 0:
            return None
        tensors = self._tensors(q, out, lse, sink, caches, indices, lens, order, q_scale, kv_scale)
        fixed = set(self.PARTIAL_SLOTS if self._scratch is not None else ()) | set(self.LIST_SLOTS if lists_fixed else ())
        varying = [k for k in range(len(tensors)) if k not in fixed]
        args = self._args(tensors, scale)
        positions = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]  # the slots' places in args
        launch = self.attention.bind(self.grid, args, frozenset(positions[k] for k in fixed))
        combine = None
        if self.combine is not None:  # split partials: the per-call buffers of a plan without scratch are new each call
            combine_varying = [k for k in self.COMBINE_SLOTS if k not in fixed]
            combine = self.combine.bind((self.tail * num_heads,), self._combine_args(tensors),
                                        frozenset(i for i, k in enumerate(self.COMBINE_SLOTS) if k in fixed))
            if combine is None:
                return None
        if launch is None:
            return None

        def bound(q, out, lse, sink, caches, indices, lens, order=None, q_scale=None, kv_scale=None) -> bool:
            tensors = self._tensors(q, out, lse, sink, caches, indices, lens, order, q_scale, kv_scale)
            if not launch([tensors[k] for k in varying]):
                return False
            if combine is not None:  # it launches: the attention's launch just passed the same device and hook test
                combine([tensors[k] for k in combine_varying])
            return True
        return bound


_PLANS: OrderedDict[tuple, AttentionPlan] = OrderedDict()  # the ops' plans, by geometry (least recently used out)
_MAX_PLANS = 64


def plan_for(args: AttentionArgs, batch_invariant: bool = False, **overrides) -> AttentionPlan:
    """The shared :class:`AttentionPlan` of checked arguments' geometry (made on first sight, least recently used
    out); see :class:`AttentionPlan` for the overrides."""
    q = args.q
    scopes = [(s.fmt, s.cache.shape[1], s.width) for s in args.scopes]
    forms = dict(ragged=tuple([s.indptr is not None for s in args.scopes]), combined=args.scopes[-1].len_skip > 0,
                 q_fp8=args.q_scale is not None, tokens_per_len=args.tokens_per_len)
    aligned = all(pages_16_byte_aligned(s.cache) for s in args.scopes)
    key = (q.shape, q.device, tuple([(f.name, f.dim, bs, w) for f, bs, w in scopes]), args.sink is not None,
           args.order is not None, batch_invariant and INVARIANT_SPLIT_BLOCKS, aligned, tuple(forms.values()),
           tuple(sorted(overrides.items())) if overrides else ())
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS[key] = AttentionPlan(tuple(q.shape), q.device, scopes, args.sink is not None,
                                           args.order is not None, batch_invariant=batch_invariant,
                                           pages_16_byte_aligned=aligned, **forms, **overrides)
        if len(_PLANS) > _MAX_PLANS:
            _PLANS.popitem(last=False)
    else:
        _PLANS.move_to_end(key)
    return plan


def run(args: AttentionArgs, batch_invariant: bool = False, plan: AttentionPlan | None = None,
        **overrides) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the attention kernel (and the combine kernel when the key lists are split) for checked arguments,
    through ``plan``, by default the plan of their geometry (:func:`plan_for`). On Hopper, where
    ``dispatch.gluon_fits`` (scopes of one format of ``dispatch.GLUON_FORMATS``), the kernel is ``gluon_attention``'s
    (``gluon=0`` forces this module's Triton kernel, ``gluon=1`` the Gluon one); see :class:`AttentionPlan` for the
    overrides. Returns out ``(T, H, 512)`` bf16 (``args.out`` when given) and lse ``(T, H)`` float32."""
    q = args.q if args.q.stride(-1) == 1 else args.q.contiguous()
    plan = plan or plan_for(args, batch_invariant, **overrides)
    out = args.out if args.out is not None else torch.empty(*q.shape[:2], D_V, dtype=torch.bfloat16, device=q.device)
    lse = torch.empty(*q.shape[:2], dtype=torch.float32, device=q.device)
    plan(q, out, lse, args.sink, args.scale, tuple(s.cache for s in args.scopes), tuple(s.indices for s in args.scopes),
         tuple(s.lens if s.indptr is None else s.indptr for s in args.scopes), args.order, args.q_scale, args.kv_scale)
    return out, lse
