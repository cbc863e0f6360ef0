"""Triton sparse MLA attention over paged caches: the kernel behind decode and prefill.

One program handles one query token, a block of up to 64 heads and one split of the token's key
list; it gathers ``BLOCK_N`` keys at a time from one or two index scopes (SWA + compressed),
dequantises them once for all its heads, and runs an online softmax. When a token's key list is
split across programs, a second kernel merges the partial results by their LSE and applies the
sink; otherwise the first kernel finishes the row itself. So every call is at most two launches
(planned and launched by :mod:`.attention_plan`).
Programs take the tokens in grid order, or in the caller's ``order`` (:mod:`.order`), a token's head
blocks next to each other.

The 512 (V4) or 576 (V3.2) latent dims are handled as four pieces of power-of-two width,
``[256][128][64 or 128] nope + [64] rope``, so no dot is padded. fp8 tiles are dequantised with
their power-of-two scale in one exact multiply (``e4m3 · 2^k`` is exact in bf16).

Out-of-range and ``-1`` indices are never read: the kernel masks them out, whatever the input.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ... import formats
from .. import dispatch, validate
from ..fp8 import e4m3_decode, e4m3_gain
from .rows import FMT_FP8_E4M3, ROPE_DIM, kernel_const, load_piece, load_rope, token_ptrs


LOG2E = kernel_const(validate.LOG2E)  # the softmax is in base 2: the LSE is divided back by it


@triton.jit
def _decode_fence(tile):
    """``tile`` (bf16) unchanged, through an opaque instruction (a PTX register move, which ptxas removes).

    Triton moves a dot operand's layout conversion above the elementwise ops that make the operand, to convert
    fewer bytes: for a dequantised fp8 tile, onto the raw bytes. Where the dots take their operands from registers
    (mma.sync) that conversion goes through shared memory one byte per store (``STS.U8``) and a byte permute per
    element, for the score dots and again for the value dots: two thirds of sm_80's key loop. Triton cannot move
    a conversion above an impure inline-assembly op, so behind this fence the tile is converted once, after the
    decode, as bf16 with 16-byte stores. CUDA only (PTX).
    """
    tl.static_assert(tile.dtype == tl.bfloat16, "the fence moves bf16 pairs")
    return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [tile], dtype=tl.bfloat16, is_pure=False, pack=2)


PAGE_TABLE = formats.PAGE_TABLE  # by format code: (body stride, ...): read by :func:`_row_bytes`
ROPE_BYTES_DIMS = formats.ROPE_DIM
INTERPRETING = kernel_const(dispatch.interpreting())  # the CPU interpreter runs no inline PTX
PREFETCH_PTX = tl.constexpr("{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.b32 $0, 0; }")


@triton.constexpr_function
def _row_bytes(fmt, rope_off):
    """The bytes of a token's record a page keeps at its row pointer (``formats.page_fields``' body stride; bf16: the
    row, 2 bytes a dim)."""
    return PAGE_TABLE[fmt][0] if fmt in PAGE_TABLE else 2 * (rope_off + ROPE_BYTES_DIMS)


@triton.constexpr_function
def _row_lines(fmt, rope_off):
    """128-byte lines a row of :func:`_row_bytes` can touch at any alignment, rounded up to a power of 2."""
    lines = -(-_row_bytes(fmt, rope_off) // 128) + 1
    return 1 << (lines - 1).bit_length()


@triton.jit
def _prefetch_rows(cache_ptr, stride0, num_slots, idx, ask, FMT: tl.constexpr, BS: tl.constexpr,
                   ROPE_OFF: tl.constexpr):
    """Ask L2 for the rows of cache slots ``idx`` (``(BLOCK_N,)``; where ``ask``), a key block before they are
    gathered: the loop's gathers then wait for L2, not HBM. Holds no register past the instruction (CUDA; nothing in
    the CPU interpreter, which runs the rest of the PREFETCH loop: the indices loaded a block ahead)."""
    if not INTERPRETING:
        valid = (idx >= 0) & (idx < num_slots) & ask
        row_ptr, _ = token_ptrs(cache_ptr, stride0, tl.where(valid, idx, 0), FMT, BS, ROPE_OFF)
        BYTES: tl.constexpr = _row_bytes(FMT, ROPE_OFF)
        LINES: tl.constexpr = _row_lines(FMT, ROPE_OFF)
        k = tl.arange(0, LINES)
        addr = row_ptr.to(tl.pointer_type(tl.int8))[:, None] + tl.minimum(k * 128, BYTES - 1)[None, :]
        ok = valid[:, None] & (k * 128 < BYTES + 127)[None, :]
        tl.inline_asm_elementwise(PREFETCH_PTX, "=r,l,r", [addr, ok.to(tl.int32)], dtype=tl.int32, is_pure=False,
                                  pack=1)


@triton.jit
def _block_slots(idx_row, blk, length, offs, BLOCK_N: tl.constexpr):
    """The cache slots of key block ``blk`` of an index row (``-1`` past ``length``)."""
    j = blk * BLOCK_N + offs
    return tl.load(idx_row + j, mask=j < length, other=-1)


@triton.jit
def _scope_pass(acc_a, acc_b, acc_c, acc_r, m_i, l_i, q_a, q_b, q_c, q_r, q_tok, heads, head_mask, stride_qh,
                cache_ptr, stride0, num_slots, idx_row, length, blk_lo, blk_hi, qk_scale, kv_scale,
                FMT: tl.constexpr, BS: tl.constexpr, PA: tl.constexpr, PB: tl.constexpr, PC: tl.constexpr,
                BLOCK_N: tl.constexpr, DOT: tl.constexpr, V_HAS_ROPE: tl.constexpr, Q_FP8: tl.constexpr,
                NATIVE_FP8: tl.constexpr, Q_IN_LOOP: tl.constexpr, Q_ROPE_SCALAR: tl.constexpr,
                DECODE_FENCE: tl.constexpr, PREFETCH: tl.constexpr, PTX_DECODE: tl.constexpr):
    """Online-softmax update over key blocks ``[blk_lo, blk_hi)`` of one scope (base-2 logits).

    The running max is raised only when a block's max exceeds it by more than ``RESCALE_SLACK``
    (then probabilities stay below 2^8), so the accumulators are rescaled on few blocks only.
    fp8_e4m3 keys stay plain e4m3 numbers: the scores take ``kv_scale`` with ``qk_scale`` (FlashInfer's
    bmm1 scale) and the probabilities take it before the value dots (its bmm2 scale), each with the
    decode's gain (:func:`.fp8.e4m3_gain`).

    q: the pieces ``q_a … q_r`` held across the loop, or with ``Q_IN_LOOP`` read again (from L1) for every key
    block through ``q_tok, heads, head_mask, stride_qh`` (see :data:`.launch_configs`: where the dots take q from
    registers, holding it across the loop leaves no room for the accumulators). Q_ROPE_SCALAR: the in-loop q's rope
    piece is read one element per load (:func:`_load_q`'s SCALAR), outside the pipeliner's buffers: its staging in
    shared memory then shares space with the P tile's, 4 KB less at 32 heads (so two 64-key bf16 stages fit a 99 KB
    GPU).
    DECODE_FENCE: the dequantised key tiles pass :func:`_decode_fence` before the dots (mma.sync targets' quantised
    caches: 1.7x faster key loops at sm_80).
    PREFETCH: each block's loop step first asks L2 for the next block's rows (:func:`_prefetch_rows`; the index rows
    are then loaded a block ahead).
    PTX_DECODE: ue8m0-scaled fp8 tiles become bf16 in inline PTX (:func:`load_piece`).
    """
    ROPE_OFF: tl.constexpr = PA + PB + PC
    RESCALE_SLACK: tl.constexpr = 8.0
    if FMT == FMT_FP8_E4M3:
        kv_scale = kv_scale * e4m3_gain(NATIVE_FP8)
        qk_scale = qk_scale * kv_scale
    offs = tl.arange(0, BLOCK_N)
    if PREFETCH:
        idx_cur = _block_slots(idx_row, blk_lo, length, offs, BLOCK_N)
        idx_next = _block_slots(idx_row, blk_lo + 1, length, offs, BLOCK_N)
    for blk in range(blk_lo, blk_hi):
        if PREFETCH:
            idx = idx_cur
            _prefetch_rows(cache_ptr, stride0, num_slots, idx_next, blk + 1 < blk_hi, FMT, BS, ROPE_OFF)
            idx_cur = idx_next
            idx_next = _block_slots(idx_row, blk + 2, length, offs, BLOCK_N)
        else:
            idx = _block_slots(idx_row, blk, length, offs, BLOCK_N)
        valid = (idx >= 0) & (idx < num_slots)
        slot = tl.where(valid, idx, 0)
        row_ptr, scale_ptr = token_ptrs(cache_ptr, stride0, slot, FMT, BS, ROPE_OFF)
        k_a = load_piece(row_ptr, scale_ptr, valid, 0, PA, FMT, DOT, BLOCK_N, NATIVE_FP8, PTX_DECODE)
        k_b = load_piece(row_ptr, scale_ptr, valid, PA, PB, FMT, DOT, BLOCK_N, NATIVE_FP8, PTX_DECODE)
        k_c = load_piece(row_ptr, scale_ptr, valid, PA + PB, PC, FMT, DOT, BLOCK_N, NATIVE_FP8, PTX_DECODE)
        k_r = load_rope(row_ptr, valid, FMT, ROPE_OFF, DOT, BLOCK_N, NATIVE_FP8, scale_ptr, PTX_DECODE)
        if DECODE_FENCE:
            k_a, k_b, k_c, k_r = _decode_fence(k_a), _decode_fence(k_b), _decode_fence(k_c), _decode_fence(k_r)
        if Q_IN_LOOP:
            # the mask's loop-variant term (always true: blk >= 0) keeps Triton's LICM from hoisting the loads out
            live = head_mask & (heads + blk >= 0)
            s = tl.dot(_load_q(q_tok, heads, live, stride_qh, 0, PA, DOT, Q_FP8, NATIVE_FP8), tl.trans(k_a))
            s += tl.dot(_load_q(q_tok, heads, live, stride_qh, PA, PB, DOT, Q_FP8, NATIVE_FP8), tl.trans(k_b))
            s += tl.dot(_load_q(q_tok, heads, live, stride_qh, PA + PB, PC, DOT, Q_FP8, NATIVE_FP8), tl.trans(k_c))
            s += tl.dot(_load_q(q_tok, heads, live, stride_qh, ROPE_OFF, ROPE_DIM, DOT, Q_FP8, NATIVE_FP8, blk,
                                Q_ROPE_SCALAR), tl.trans(k_r))
        else:
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
            Q_FP8: tl.constexpr, NATIVE_FP8: tl.constexpr, step=0, SCALAR: tl.constexpr = False):
    """Dims ``[START, START+WIDTH)`` of the token's query heads: ``(H_BLOCK, WIDTH)`` (an fp8 q's bytes as
    :func:`.fp8.e4m3_decode` gives them: ``q_scale`` and the decode's gain join the score scale).

    SCALAR: read one element per load instruction, through a column mask the compiler cannot prove constant over
    two columns (``step``: any number >= 0, e.g. the key loop's counter), so Triton's pipeliner, which moves at
    least 4 bytes per asynchronous copy, leaves the load out of its shared-memory buffers."""
    cols = START + tl.arange(0, WIDTH)
    mask = head_mask[:, None]
    if SCALAR:
        mask = mask & ((cols + step) >= 0)[None, :]
    vals = tl.load(q_tok + heads[:, None] * stride_qh + cols[None, :], mask=mask, other=0.0)
    if Q_FP8:
        vals = e4m3_decode(vals, NATIVE_FP8)
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
    NATIVE_FP8: tl.constexpr, Q_IN_LOOP: tl.constexpr, Q_ROPE_SCALAR: tl.constexpr, DECODE_FENCE: tl.constexpr,
    PREFETCH: tl.constexpr = False, PTX_DECODE: tl.constexpr = False,
):
    """One (token, head block, split) program. NATIVE_FP8: fp8 bytes decoded by conversion instructions (else by
    integer operations, :mod:`.fp8`); Q_IN_LOOP: q read again for every key block (Q_ROPE_SCALAR: its rope piece
    one element per load), DECODE_FENCE: the dequantised key tiles pass :func:`_decode_fence`, PREFETCH: the next key
    block's rows asked of L2, PTX_DECODE: ue8m0-scaled fp8 tiles become bf16 in inline PTX (:func:`_scope_pass`).
    These and the tile sizes come from the target's row of :mod:`.launch_configs`."""
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
    if Q_IN_LOOP:  # read in the key loop; these stand for the unused pieces
        q_a, q_b, q_c, q_r = 0.0, 0.0, 0.0, 0.0
    else:
        q_a = _load_q(q_tok, heads, head_mask, stride_qh, 0, PA, DOT, Q_FP8, NATIVE_FP8)
        q_b = _load_q(q_tok, heads, head_mask, stride_qh, PA, PB, DOT, Q_FP8, NATIVE_FP8)
        q_c = _load_q(q_tok, heads, head_mask, stride_qh, PA + PB, PC, DOT, Q_FP8, NATIVE_FP8)
        q_r = _load_q(q_tok, heads, head_mask, stride_qh, ROPE_OFF, ROPE_DIM, DOT, Q_FP8, NATIVE_FP8)
    if Q_FP8:  # FlashInfer's bmm1 scale: scale · q_scale (· kv_scale, per fp8_e4m3 scope), with the decode's gain
        qk_scale = qk_scale * tl.load(q_scale_ptr) * e4m3_gain(NATIVE_FP8)
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
        acc_a, acc_b, acc_c, acc_r, m_i, l_i, q_a, q_b, q_c, q_r, q_tok, heads, head_mask, stride_qh,
        c0_ptr, c0_stride0, c0_slots, _scope_row(i0_ptr, i0_stride, l0_ptr, w0, tok, RAGGED0), len0,
        tl.minimum(lo, nblk0), tl.minimum(hi, nblk0), qk_scale, kv_scale, FMT0, BS0, PA, PB, PC, BLOCK_N, DOT,
        V_HAS_ROPE, Q_FP8, NATIVE_FP8, Q_IN_LOOP, Q_ROPE_SCALAR, DECODE_FENCE, PREFETCH, PTX_DECODE)
    if HAS_EXTRA:
        acc_a, acc_b, acc_c, acc_r, m_i, l_i = _scope_pass(
            acc_a, acc_b, acc_c, acc_r, m_i, l_i, q_a, q_b, q_c, q_r, q_tok, heads, head_mask, stride_qh,
            c1_ptr, c1_stride0, c1_slots, _scope_row(i1_ptr, i1_stride, l1_ptr, w1, tok, RAGGED1), len1,
            tl.maximum(lo, nblk0) - nblk0, hi - nblk0, qk_scale, kv_scale, FMT1, BS1, PA, PB, PC, BLOCK_N, DOT,
            V_HAS_ROPE, Q_FP8, NATIVE_FP8, Q_IN_LOOP, Q_ROPE_SCALAR, DECODE_FENCE, PREFETCH, PTX_DECODE)

    empty = l_i == 0.0
    inv_l = tl.where(empty, 0.0, 1.0 / tl.where(empty, 1.0, l_i))
    # natural-log LSE of the real keys; -inf marks an empty partial, +inf an empty final row
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) / LOG2E)
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
