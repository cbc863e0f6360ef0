"""Hopper sparse MLA attention for V4 (512 latent dims) and V3.2 (576), written in Gluon (Triton's explicit dialect).

Same contract and arguments as ``triton_attention``'s kernel, for the cases that dominate serving
on an sm_90 GPU: every scope ``fp8_v4`` / ``fp8_v32`` (decode, paged-direct prefill) or every scope ``bf16``
(workspace prefill, bf16 caches). A work item is one query token × 64 heads × one split of the key list (every
token's list cut alike, or with ``TAIL`` just the last tokens', whose pieces fill the SMs the others' whole lists
leave idle: ``triton_attention.choose_splits``); a program takes one item, or, launched persistent
(``persistent``: many short items), one program per SM takes items in turn, so that an item's q load and output
store overlap the next item's first gathers. A program is
three warpgroups that run out of step, synchronised by mbarriers only:

* A copy warpgroup fills two shared buffers of 64 keys, one 256-dim half of a block at a time, each half as
  soon as its last reader of the block two back is done: bf16 rows with ``cp.async`` (the copies signal the
  half ready as they land); fp8 rows gathered into registers as 32-bit words, then dequantised into the half
  once it is free. The fp8 loop is software-pipelined so that two halves' gathers are in flight: the next
  half's loads are issued before the current one is dequantised. The rope dims, already bf16, go by
  ``cp.async``.
* fp8 rows (decode: bound by the copy warpgroup): math warpgroup 0 loads q into shared memory itself, while
  the copy warpgroup already gathers the first block (version 11: 1-3 % faster), then computes each block's
  logits over every dim (one N = 64 wgmma chain from Q in shared memory), its online softmax, and the output
  dims [0, 256) with P from its registers. It hands P (bf16) and the rows' rescale factors to math warpgroup 1
  through shared memory, which rescales its accumulator and adds P times output dims [256, 512), overlapping
  warpgroup 0's next logits. The copy warpgroup runs a block ahead of the math, and warpgroup 1 needs no logits
  or softmax registers, which leaves the copy warpgroup enough to hold two gathered halves without spilling.
* fp8 rows of at most 16 heads (tensor-parallel shards: ``narrow_heads``), "narrow items": one math warpgroup with
  the keys and the output dims as the wgmmas' M and the heads as N (logits ``(64 keys, 16)`` = K·Qᵀ, output
  ``(512 dims, 16)`` += Vᵀ·Pᵀ, V read transposed from the key rows), whose accumulators take 80 registers per
  thread; that leaves the registers for two copy warpgroups, one per buffer, each with two halves in flight
  (version 15: V3.2 shards 7-12 % faster, V4's 6 %), which dequantise a half before they wait for its buffer to be
  free (version 16: V4's 16-head shard 6 % faster, V3.2's level).
* bf16 rows (workspace prefill: bound by the math): the two math warpgroups are paired. Warpgroup w computes
  the logits of block 2j + w of each pair and owns output dims [256·w, 256·w + 256); they trade row maxima and
  P through shared memory, so both issue logits wgmmas and one's softmax overlaps the other's wgmmas.

(Until version 10 fp8 rows went to the paired warpgroups too. Both then read both buffers at once, so the copy
warpgroup could not run a block ahead, and fp8_v32's, left 88 registers, spilled: V3.2 decode ran 1.3-1.4x
slower. bf16 rows through the fp8 layout ran up to 33 % slower. BENCHMARKS.md, version 10.)

V3.2 (``D_QK = 576``): the shared rows hold the 512 V dims as V4's do; the 64 rope dims of the keys go
by ``cp.async`` into a buffer of their own (``r_smem``) with the second half, and the query's rope dims
stay in registers (the A operand of one more wgmma per block; bf16 576-d blocks take 226.1 KiB of shared memory,
of the 227 KiB an H100 block may). fp8_v32 tiles are 128 dims with a float32 scale each, dequantised like
fp8_v4's (e4m3 → f32, times the scale, → bf16: the rounding of ``dequantize_and_gather`` and the Triton kernel).

The split merge and the sink of split rows are ``triton_attention``'s combine kernel.

Gluon's API is experimental: the kernel is used with the Triton versions it was validated on
(``VALIDATED_TRITON``) unless ``SPARSE_MLA_GLUON=1`` asks for it anyway (``=0`` turns it off).
"""
from __future__ import annotations

import os

import triton

from ..formats import (FMT_BF16, FMT_FP8_V4, FMT_FP8_V32, ROPE_DIM, UE8M0_BIAS, V4_BODY_BYTES, V4_DIM, V4_NOPE_DIM,
                       V4_SCALE_BYTES, V4_TILE, V32_DIM, V32_ROPE_OFFSET, V32_SCALE_OFFSET, V32_TILE, V32_TOKEN_BYTES)
from .order import KEYS_PER_BLOCK
from .validate import D_V

try:  # Gluon ships with Triton >= 3.5; its API is experimental, so any mismatch disables this path
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
except ImportError:  # pragma: no cover - depends on the installed Triton
    gluon = None

PARTITION_WARPS = 4  # each of the three warpgroups
# registers per thread of the fp8 formats' logits warpgroup (its 64 × 256 fp32 accumulator, the 64 × 64 logits and P;
# 576-d: q's rope dims, 16 more) and values warpgroup (the accumulator), and of each of bf16's paired math warpgroups
# (32 B of spills at 576-d, outside the key loop); the copy warpgroup, the default partition, gets what is left: 128
# for fp8_v32 and 144 for fp8_v4, where two gathered half blocks at once need about 100; 72 for bf16 (cp.async holds
# nothing in registers). No fp8 spills (scripts/sm90_report.py). fp8_v32's logits warpgroup spilled 28 B at 208 once
# it loaded q itself (version 11), and 216 made V3.2 decode 3 % faster; with 152 for the values warpgroup its epilogue
# did not fit, and ptxas then ignored every partition's register budget and serialised the wgmmas
LOGITS_REGS = {"fp8_v4": 200, "fp8_v32": 216}
VALUES_REGS = 160
PAIRED_REGS = 216
HEADS_PER_PROGRAM = 64
# Narrow items: fp8 rows of at most NARROW_HEADS heads (tensor-parallel shards), the heads as the wgmmas' N, so that
# one math warpgroup's accumulators leave the registers for two copy warpgroups: the second copy warpgroup's and the
# math warpgroup's registers per thread (the first copy warpgroup, the default partition, gets what is left: 176).
# On the H100, V3.2 16-head shards ran 7-12 % faster than as 64-head items, V4's 6 %; 32 heads stay 64-head items:
# as narrow items of N = 32 (copy warpgroups at 136 registers) V3.2 ran up to 12 % slower (version 15), and with a
# math warpgroup per 16 heads (four warpgroups of 128 registers) 8-9 % slower (docs/history.md, version 17)
NARROW_HEADS = 16
NARROW_COPY_REGS, NARROW_MATH_REGS = 168, 160
VALIDATED_TRITON = ("3.6.",)  # checked on an H100 against the reference ops (tests/test_triton_attention.py)


# Persistent programs (one per SM, each taking work items in turn: an item's q load and output store then overlap the
# next item's first gathers) pay for their item loop, some 5 % of a V3.2 item's time, even where a program gets one
# item; they win where items are short and many: on the H100, 4 rounds of fp8_v4 items of 1, 4, 8 and 16 key blocks
# ran 13, 7, 4 and 2 % faster, the V4-Pro decode step at B 128 2 % (BENCHMARKS.md, version 12)
PERSISTENT_MIN_ROUNDS = 2
PERSISTENT_MAX_BLOCKS = 24


def persistent(items: int, max_blocks: int, sms: int) -> bool:
    """Whether a launch of ``items`` work items whose key lists span at most ``max_blocks`` key blocks runs as
    persistent programs on ``sms`` SMs (else a program per item)."""
    return items >= PERSISTENT_MIN_ROUNDS * sms and max_blocks <= PERSISTENT_MAX_BLOCKS


def narrow_heads(fmt: str, num_heads: int) -> int:
    """The head width (the wgmmas' N) of narrow items for ``num_heads`` heads of ``fmt`` rows, or 0 for 64-head
    items: fp8 rows (decode, bound by the copy warpgroups) of at most ``NARROW_HEADS`` heads."""
    return NARROW_HEADS if fmt != "bf16" and num_heads <= NARROW_HEADS else 0


def enabled() -> bool:
    """Whether the Gluon path may be used at all: Gluon importable and a validated Triton (or forced)."""
    choice = os.environ.get("SPARSE_MLA_GLUON", "")
    if gluon is None or choice == "0":
        return False
    return choice == "1" or triton.__version__.startswith(VALIDATED_TRITON)


if gluon is not None:
    H_BLOCK = gl.constexpr(HEADS_PER_PROGRAM)
    BLOCK_N = gl.constexpr(KEYS_PER_BLOCK)
    NOPE = gl.constexpr(V4_NOPE_DIM)  # e4m3 dims of a V4 row; the other 64 are bf16 rope
    DIM = gl.constexpr(V4_DIM)  # the width of the q / key rows in shared memory: V4's whole latent, V3.2's V part
    ROPE = gl.constexpr(ROPE_DIM)
    QK_V32 = gl.constexpr(V32_DIM)  # V3.2's scores also read 64 rope dims past DIM, kept apart (r_smem)
    V32_ROW = gl.constexpr(V32_TOKEN_BYTES)
    V32_SCALES = gl.constexpr(V32_SCALE_OFFSET)  # four float32, one per 128 e4m3 dims
    V32_ROPE = gl.constexpr(V32_ROPE_OFFSET)
    V4_TILE_DIMS = gl.constexpr(V4_TILE)  # e4m3 dims per scale
    V32_TILE_DIMS = gl.constexpr(V32_TILE)
    BODY_BYTES = gl.constexpr(V4_BODY_BYTES)
    SCALE_BYTES = gl.constexpr(V4_SCALE_BYTES)
    BIAS_WORD = gl.constexpr(UE8M0_BIAS * 0x01010101)  # four ue8m0 bytes of 2^0
    BF16 = gl.constexpr(FMT_BF16)
    FP8_V4 = gl.constexpr(FMT_FP8_V4)
    FP8_V32 = gl.constexpr(FMT_FP8_V32)
    D_OUT = gl.constexpr(D_V)
    HALF = gl.constexpr(256)
    # the wgmma accumulators of a math warpgroup: logits (64 heads × 64 keys) and output (64 heads × 256 dims)
    S_LAYOUT = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[PARTITION_WARPS, 1],
                                                      instr_shape=[16, 64, 16]))
    O_LAYOUT = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[PARTITION_WARPS, 1],
                                                      instr_shape=[16, 256, 16]))
    P_OPERAND = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=O_LAYOUT, k_width=2))  # P, from registers
    KEYS_LAYOUT = gl.constexpr(gl.SliceLayout(0, S_LAYOUT))
    ROWS_LAYOUT = gl.constexpr(gl.SliceLayout(1, S_LAYOUT))
    O_ROWS = gl.constexpr(gl.SliceLayout(1, O_LAYOUT))
    WORDS_SMEM = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2))
    # a copy warpgroup's gathered fp8 half block (``_gather_half``) as 4-byte words: fp8_v4 (rows, 4 tiles, 16 words),
    # a thread holding 16 consecutive bytes of each of 4 tiles of two rows; fp8_v32 (rows, 2 tiles, 32 words), 32 bytes
    # of each of 2 tiles of two rows
    WORDS_V4 = gl.constexpr(gl.BlockedLayout([1, 1, 4], [8, 1, 4], [PARTITION_WARPS, 1, 1], [2, 1, 0]))
    WORDS_V32 = gl.constexpr(gl.BlockedLayout([1, 1, 8], [8, 1, 4], [PARTITION_WARPS, 1, 1], [2, 1, 0]))
    WARPS = gl.constexpr(PARTITION_WARPS)
    PAIRED_REGS_BF16 = gl.constexpr(PAIRED_REGS)
    LOGITS_REGS_V4 = gl.constexpr(LOGITS_REGS["fp8_v4"])
    LOGITS_REGS_V32 = gl.constexpr(LOGITS_REGS["fp8_v32"])
    VALUES_WG_REGS = gl.constexpr(VALUES_REGS)
    NARROW_COPY_WG_REGS = gl.constexpr(NARROW_COPY_REGS)
    NARROW_MATH_WG_REGS = gl.constexpr(NARROW_MATH_REGS)

    @gluon.jit
    def _opaque(x):
        """``x`` (int32), through an asm move LLVM cannot see through: what is computed from it inside a
        loop stays there instead of being hoisted (and spilled) across the loop."""
        return gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _block_indices(i0_row, len0, nblk0, i1_row, len1, blk, rows_layout: gl.constexpr):
        """Cache slots of key block ``blk`` (the two scopes' blocks in sequence); -1 past a list's length."""
        offs = gl.arange(0, BLOCK_N, layout=rows_layout)
        if blk < nblk0:
            j = blk * BLOCK_N + offs
            idx = gl.load(i0_row + j, mask=j < len0, other=-1)
        else:
            j = (blk - nblk0) * BLOCK_N + offs
            idx = gl.load(i1_row + j, mask=j < len1, other=-1)
        return idx

    @gluon.jit
    def _block_keys_valid(i0_row, len0, nblk0, i1_row, len1, blk, hi, c0_slots, c1_slots, keys_layout: gl.constexpr):
        """Which keys of block ``blk`` the math warpgroups attend: within the list and the item's blocks (``< hi``),
        and a slot inside its cache (the copy side reads the others as zeros)."""
        idx = _block_indices(i0_row, len0, nblk0, i1_row, len1, blk, keys_layout)
        return (idx >= 0) & (idx < gl.where(blk < nblk0, c0_slots, c1_slots)) & (blk < hi)

    @gluon.jit
    def _block_rows(c0_ptr, c0_stride0, c0_slots, c1_ptr, c1_stride0, c1_slots, idx, blk, nblk0,
                    FMT: gl.constexpr, BS0: gl.constexpr, BS1: gl.constexpr, D_QK: gl.constexpr):
        """Pointers to the rows of block ``blk``'s slots ``idx`` (bytes for fp8, elements for bf16), to their
        scales (fp8_v4: the ue8m0 bytes after the page's bodies; fp8_v32: the float32s inside the row), and the
        rows' validity."""
        ROW: gl.constexpr = BODY_BYTES if FMT == FP8_V4 else V32_ROW if FMT == FP8_V32 else D_QK
        if blk < nblk0:
            valid = (idx >= 0) & (idx < c0_slots)
            slot = gl.where(valid, idx, 0)
            page = c0_ptr + (slot // BS0).to(gl.int64) * c0_stride0
            off = slot % BS0
            page_scales = page + BS0 * ROW
        else:
            valid = (idx >= 0) & (idx < c1_slots)
            slot = gl.where(valid, idx, 0)
            page = c1_ptr + (slot // BS1).to(gl.int64) * c1_stride0
            off = slot % BS1
            page_scales = page + BS1 * ROW
        row = page + off * ROW
        if FMT == FP8_V32:
            scales = row + V32_SCALES
        else:
            scales = page_scales + off * SCALE_BYTES
        return row, scales, valid

    @gluon.jit
    def _gather_half(rows, scales, ok, SIDE: gl.constexpr, words_layout: gl.constexpr, FMT: gl.constexpr):
        """The e4m3 bytes of dims ``[256·SIDE, 256·SIDE + 256)`` of the gathered fp8 rows as ``(BLOCK_N, tiles,
        words)`` int32 words (4 bytes each, little-endian; ``words_layout`` gives the shape), with their scales.

        fp8_v4: 4 tiles of 16 words (64 dims each) and the four ue8m0 exponents as one ``(BLOCK_N,)`` int32 word
        (byte t: tile t's; in the second half byte 3 is the pad byte); the fourth tile of the second half is the
        bf16 rope, not read here (zero words). fp8_v32: 2 tiles of 32 words (128 dims each) and their float32
        scales, ``(BLOCK_N, 2)``.
        Invalid rows read nothing. Words, not bytes: the copy warpgroup carries two halves in registers,
        and tensors of bytes would take a register per byte."""
        NT: gl.constexpr = HALF // (V4_TILE_DIMS if FMT == FP8_V4 else V32_TILE_DIMS)  # tiles per half
        NW: gl.constexpr = HALF // 4 // NT  # 4-byte words per tile
        tiles_layout: gl.constexpr = gl.SliceLayout(2, words_layout)
        tile = gl.arange(0, NT, layout=gl.SliceLayout(0, tiles_layout))
        word = gl.arange(0, NW, layout=gl.SliceLayout(0, gl.SliceLayout(1, words_layout)))
        offs = (SIDE * NT + tile)[None, :, None] * NW + word[None, None, :]
        if FMT == FP8_V4:
            is_rope = (tile == 3) & (SIDE == 1)
            raw = gl.load(rows.to(gl.pointer_type(gl.int32))[:, None, None] + offs,
                          mask=ok[:, None, None] & ~is_rope[None, :, None], other=0)
            exps = gl.load(scales.to(gl.pointer_type(gl.int32)) + SIDE, mask=ok, other=BIAS_WORD)
            tile_scales = gl.convert_layout(exps, gl.SliceLayout(1, tiles_layout))
        else:
            raw = gl.load(rows.to(gl.pointer_type(gl.int32))[:, None, None] + offs, mask=ok[:, None, None], other=0)
            tile_scales = gl.load(scales.to(gl.pointer_type(gl.float32))[:, None] + (SIDE * NT + tile)[None, :],
                                  mask=ok[:, None], other=1.0)
        return raw, tile_scales

    @gluon.jit
    def _dequant(raw, scales, FMT: gl.constexpr):
        """``_gather_half``'s words times their tiles' scales as ``(BLOCK_N, tiles, words, 2)`` int32 words that each
        hold two bf16 (the dims in order). fp8_v4's power-of-two factors make the products exact; fp8_v32's float32
        scales round each product to float32 and then to bf16, as the reference does."""
        if FMT == FP8_V4:
            tile = gl.arange(0, raw.shape[1], layout=gl.SliceLayout(0, gl.SliceLayout(2, raw.type.layout)))
            e = (scales[:, None] >> (tile[None, :] * 8)) & 0xFF
            factor = (e << 23).to(gl.float32, bitcast=True)  # ue8m0 -> 2^(e-127)
        else:
            factor = scales
        # per word: e4m3 pairs -> f16 pairs (exact) -> f32, times the factor, -> bf16 pairs
        lo, hi = gl.inline_asm_elementwise(
            """{
            .reg .b16 l, h, x0, x1, x2, x3;
            .reg .b32 a, b;
            .reg .f32 f0, f1, f2, f3;
            mov.b32 {l, h}, $2;
            cvt.rn.f16x2.e4m3x2 a, l;
            cvt.rn.f16x2.e4m3x2 b, h;
            mov.b32 {x0, x1}, a;
            mov.b32 {x2, x3}, b;
            cvt.f32.f16 f0, x0;
            cvt.f32.f16 f1, x1;
            cvt.f32.f16 f2, x2;
            cvt.f32.f16 f3, x3;
            mul.f32 f0, f0, $3;
            mul.f32 f1, f1, $3;
            mul.f32 f2, f2, $3;
            mul.f32 f3, f3, $3;
            cvt.rn.bf16x2.f32 $0, f1, f0;
            cvt.rn.bf16x2.f32 $1, f3, f2;
            }""", "=r,=r,r,r", [raw, factor[:, :, None]], dtype=(gl.int32, gl.int32), is_pure=True, pack=1)
        return gl.join(lo, hi)

    @gluon.jit
    def _row_outputs(m_i, l_i, rows_layout: gl.constexpr, out_ptr, lse_ptr, part_o_ptr, part_lse_ptr, sink_ptr,
                     tok, hb, split, num_tokens, num_heads, HAS_SINK: gl.constexpr, PARTIAL: gl.constexpr,
                     STORE_LSE: gl.constexpr = True):
        """The rows' heads, output factor (1/l, with the sink unless the row is a split's partial) and
        destination row block (``out`` or the split's partial rows); with ``STORE_LSE``, stores the LSE."""
        heads = hb * H_BLOCK + gl.arange(0, m_i.shape[0], layout=rows_layout)  # a head block, or a narrow item's
        head_mask = heads < num_heads
        l_o = gl.convert_layout(l_i, rows_layout)
        m_o = gl.convert_layout(m_i, rows_layout)
        empty = l_o == 0.0
        inv_l = gl.where(empty, 0.0, 1.0 / gl.where(empty, 1.0, l_o))
        lse = gl.where(empty, float("-inf"), (m_o + gl.log2(gl.where(empty, 1.0, l_o))) / 1.4426950408889634)
        factor = inv_l
        if not PARTIAL:
            if HAS_SINK:
                sink = gl.load(sink_ptr + heads, mask=head_mask, other=float("-inf"))
                factor = factor / (1.0 + gl.exp(sink - gl.where(empty, 0.0, lse)))
            dst = out_ptr + tok.to(gl.int64) * num_heads * D_OUT
            if STORE_LSE:
                gl.store(lse_ptr + tok * num_heads + heads, gl.where(empty, float("inf"), lse), mask=head_mask)
        else:
            part = (split * num_tokens + tok).to(gl.int64) * num_heads
            dst = part_o_ptr + part * D_OUT
            if STORE_LSE:
                gl.store(part_lse_ptr + part + heads, lse, mask=head_mask)
        return heads, factor, dst

    @gluon.jit
    def _rounds(num_tokens, num_heads, tail, SPLITS: gl.constexpr, TAIL: gl.constexpr, PERSISTENT: gl.constexpr):
        """How many work items this program takes (:func:`_work_item`): one per round, in rounds of one item per
        program, the last one partial; one without ``PERSISTENT`` (a program per item: the item loop folds away,
        and with it its cost, some 5 % of a V3.2 item on the H100)."""
        if PERSISTENT:
            if TAIL:
                items = (num_tokens + tail * (SPLITS - 1)) * gl.cdiv(num_heads, H_BLOCK)
            else:
                items = num_tokens * gl.cdiv(num_heads, H_BLOCK) * SPLITS
            programs = gl.num_programs(0)
            full = items // programs
            rest = items % programs
            pid = gl.program_id(0)
            in_last = gl.where(full % 2 == 0, pid < rest, pid >= programs - rest)  # as _work_item numbers them
            return full + in_last.to(gl.int32)
        else:
            return 1

    @gluon.jit
    def _work_item(r, order_ptr, l0_ptr, w0, i0_ptr, i0_stride, l1_ptr, w1, i1_ptr, i1_stride, num_tokens,
                   num_heads, tokens_per_len, tail, HAS_ORDER: gl.constexpr, HAS_EXTRA: gl.constexpr,
                   SPLITS: gl.constexpr, SPLIT_BLOCKS: gl.constexpr, TAIL: gl.constexpr):
        """This program's work item of round ``r``: one query token × 64 heads × one split of its key list, as
        ``(tok, hb, split, len0, nblk0, len1, lo, hi, i0_row, i1_row)`` (``[lo, hi)``: its key blocks, the two
        scopes' blocks in sequence; the scopes' index rows). Items are numbered split-major, then token slot
        (through ``order``), then head block (a token's head blocks, which read the same keys, run side by side);
        round r gives item ``r·P + p`` to program p of P, every odd round in reverse, so that longest-first
        tokens even out over the programs. With ``TAIL`` only the last ``tail`` token slots are split: the other
        tokens' whole lists come first, as items of split -1 (they write the output, not a partial row), then the
        pieces of the last tokens, split-major, which fill the SMs that the whole items leave idle at the end."""
        head_blocks = gl.cdiv(num_heads, H_BLOCK)
        programs = gl.num_programs(0)
        pid = gl.program_id(0)
        item = r * programs + gl.where(r % 2 == 0, pid, programs - 1 - pid)
        if TAIL:
            whole = (num_tokens - tail) * head_blocks
            cut = tail * head_blocks
            piece = gl.maximum(item - whole, 0)
            split = gl.where(item >= whole, piece // cut, -1)
            row = gl.where(item >= whole, whole + piece % cut, item)
        else:
            rows = num_tokens * head_blocks
            split = item // rows
            row = item % rows
        tok = row // head_blocks
        hb = row % head_blocks
        if HAS_ORDER:  # as triton_attention._ordered_token
            tok = gl.minimum(gl.maximum(gl.load(order_ptr + tok), 0), num_tokens - 1)
        len_row = tok // tokens_per_len  # as triton_attention's kernel
        len0 = gl.minimum(gl.maximum(gl.load(l0_ptr + len_row), 0), w0)
        nblk0 = gl.cdiv(len0, BLOCK_N)
        len1 = len0 * 0
        if HAS_EXTRA:
            len1 = gl.minimum(gl.maximum(gl.load(l1_ptr + len_row), 0), w1)
        nblk1 = gl.cdiv(len1, BLOCK_N)
        if SPLIT_BLOCKS > 0:  # batch-invariant: as triton_attention's kernel
            per_split = SPLIT_BLOCKS
        elif TAIL:
            per_split = gl.where(split >= 0, gl.cdiv(nblk0 + nblk1, SPLITS), nblk0 + nblk1)
        else:
            per_split = gl.cdiv(nblk0 + nblk1, SPLITS)
        lo = gl.maximum(split, 0) * per_split
        hi = gl.maximum(gl.minimum(lo + per_split, nblk0 + nblk1), lo)  # a split past the list's end: no blocks
        return (tok, hb, split, len0, nblk0, len1, lo, hi, i0_ptr + tok.to(gl.int64) * i0_stride,
                i1_ptr + tok.to(gl.int64) * i1_stride)

    @gluon.jit
    def _copy_rope(dst, rows, ok, START: gl.constexpr):
        """``cp.async`` the 64 bf16 rope dims of each gathered row (``rows``: pointers to the rows' first byte or
        element; the rope starts ``START`` bf16 elements in) into ``dst (BLOCK_N, 64)``; invalid rows: zeros."""
        rope_layout: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [WARPS, 1], [1, 0])
        col = gl.arange(0, ROPE, layout=gl.SliceLayout(0, rope_layout))
        row = gl.convert_layout(rows, gl.SliceLayout(1, rope_layout)).to(gl.pointer_type(gl.bfloat16))
        okr = gl.convert_layout(ok, gl.SliceLayout(1, rope_layout))
        async_copy.async_copy_global_to_shared(dst, (row + START)[:, None] + col[None, :], mask=okr[:, None])

    @gluon.jit
    def _copy_half(k_smem, r_smem, ready, free, row, valid, cols, j, BUF: gl.constexpr, SIDE: gl.constexpr,
                   D_QK: gl.constexpr):
        """Copy dims [256·SIDE, 256·SIDE + 256) of pair j's block (bf16 rows) into buffer ``BUF`` once its readers
        of pair j-1 are done, and with the second half a 576-d row's rope into ``r_smem``; the copies arrive on
        the half's ``ready`` barrier as they land."""
        bar: gl.constexpr = 2 * BUF + SIDE
        mbarrier.wait(free.index(bar), (j & 1) ^ 1, pred=j >= 1)
        async_copy.async_copy_global_to_shared(k_smem.index(BUF).slice(SIDE * HALF, HALF, dim=1),
                                               row[:, None] + (SIDE * HALF + cols)[None, :], mask=valid[:, None])
        if (SIDE == 1) & (D_QK == QK_V32):
            _copy_rope(r_smem.index(BUF), row, valid, DIM)
        async_copy.mbarrier_arrive(ready.index(bar), increment_count=False)

    @gluon.jit
    def _store_half(k_smem, r_smem, ready, free, raw, scales, rows, ok, j, BUF: gl.constexpr, SIDE: gl.constexpr,
                    FMT: gl.constexpr, DEQUANT_FIRST: gl.constexpr = False):
        """fp8: once half ``SIDE`` of buffer ``BUF`` is free of pair j-1's readers, dequantise into it a half
        block gathered by ``_gather_half`` (``rows``/``ok``: the block's rows, for the second half's rope, which
        goes by ``cp.async`` (fp8_v4: into the row's last 64 dims; fp8_v32: into ``r_smem``) and arrives on
        ``ready`` as it lands), and signal the half ready. ``DEQUANT_FIRST``: dequantise before the wait, so that
        only the stores stand between the readers' release and the half's ready signal; the converted half (twice
        the gathered words) then stays in registers through the wait, which the narrow items' copy warpgroups have
        room for (fp8_v32's single copy warpgroup spilled 208 B)."""
        bar: gl.constexpr = 2 * BUF + SIDE
        if DEQUANT_FIRST:
            vals = _dequant(raw, scales, FMT)
        mbarrier.wait(free.index(bar), (j & 1) ^ 1, pred=j >= 1)
        if not DEQUANT_FIRST:
            vals = _dequant(raw, scales, FMT)
        words = k_smem.index(BUF)._reinterpret(gl.int32, [BLOCK_N, DIM // 2], WORDS_SMEM)  # bf16 pairs
        words.slice(SIDE * HALF // 2, HALF // 2, dim=1).store(gl.reshape(vals, [BLOCK_N, HALF // 2]))
        if SIDE == 1:
            if FMT == FP8_V4:
                # the rope tile was just written too (zero words times the pad byte's factor: zeros, or NaN for a
                # 0xFF pad byte): every thread's stores land before any rope copy starts, and the copy overwrites
                # them
                gl.thread_barrier()
                _copy_rope(k_smem.index(BUF).slice(NOPE, DIM - NOPE, dim=1), rows, ok, NOPE // 2)
            else:  # (issued before the dequantisation instead, it measured no faster on the H100)
                _copy_rope(r_smem.index(BUF), rows, ok, V32_ROPE // 2)
            async_copy.mbarrier_arrive(ready.index(bar), increment_count=False)
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(ready.index(bar))

    @gluon.jit
    def _copy_partition(k_smem, r_smem, ready, free, c0_ptr, c0_stride0, c0_slots, c1_ptr, c1_stride0, c1_slots,
                        order_ptr, l0_ptr, w0, i0_ptr, i0_stride, l1_ptr, w1, i1_ptr, i1_stride, num_tokens, num_heads,
                        tokens_per_len, tail, FMT: gl.constexpr, BS0: gl.constexpr, BS1: gl.constexpr,
                        D_QK: gl.constexpr, HAS_ORDER: gl.constexpr, HAS_EXTRA: gl.constexpr, SPLITS: gl.constexpr,
                        SPLIT_BLOCKS: gl.constexpr, TAIL: gl.constexpr, PERSISTENT: gl.constexpr):
        """Gather each pair of key blocks of each of the program's work items into buffers 0 and 1, half by half
        (rows past ``hi`` or invalid: zeros), block after block, as the math warpgroups read them; bf16 rows by
        ``cp.async``, fp8 rows dequantised. The next item's first blocks go in as soon as the math warpgroups free
        the buffers, while they still store the last item's output.

        ``ready``/``free`` are indexed ``2·buffer + half``; their phases count the pairs of every item so far (``g``).
        """
        words_layout: gl.constexpr = WORDS_V4 if FMT == FP8_V4 else WORDS_V32
        words_rows: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, words_layout))
        copy_layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [WARPS, 1], [1, 0])  # bf16: (64, 256), 16 B each
        copy_rows: gl.constexpr = gl.SliceLayout(1, copy_layout)
        g = 0
        for r in range(_rounds(num_tokens, num_heads, tail, SPLITS, TAIL, PERSISTENT)):
            tok, hb, split, len0, nblk0, len1, lo, hi, i0_row, i1_row = _work_item(
                r, order_ptr, l0_ptr, w0, i0_ptr, i0_stride, l1_ptr, w1, i1_ptr, i1_stride, num_tokens, num_heads,
                tokens_per_len, tail, HAS_ORDER, HAS_EXTRA, SPLITS, SPLIT_BLOCKS, TAIL)
            pairs = gl.cdiv(hi - lo, 2)
            if FMT != BF16:
                # software-pipelined: each half's gathers are issued before the previous half is dequantised, so
                # two halves' loads are in flight (the next pair's indices are loaded one pair ahead for that)
                idx0 = _block_indices(i0_row, len0, nblk0, i1_row, len1, lo, words_rows)
                idx1 = _block_indices(i0_row, len0, nblk0, i1_row, len1, lo + 1, words_rows)
                row0, scales0, valid0 = _block_rows(c0_ptr, c0_stride0, c0_slots, c1_ptr, c1_stride0, c1_slots,
                                                    idx0, lo, nblk0, FMT, BS0, BS1, D_QK)
                raw_a, sc_a = _gather_half(row0, scales0, valid0, 0, words_layout, FMT)
                for j in range(pairs):
                    blk0 = lo + 2 * j
                    gj = g + j
                    # row addresses are recomputed from the carried indices rather than carried (registers)
                    row0, scales0, valid0 = _block_rows(c0_ptr, c0_stride0, c0_slots, c1_ptr, c1_stride0, c1_slots,
                                                        idx0, blk0, nblk0, FMT, BS0, BS1, D_QK)
                    row1, scales1, valid1 = _block_rows(c0_ptr, c0_stride0, c0_slots, c1_ptr, c1_stride0, c1_slots,
                                                        idx1, blk0 + 1, nblk0, FMT, BS0, BS1, D_QK)
                    valid1 = valid1 & (blk0 + 1 < hi)
                    idx0 = _block_indices(i0_row, len0, nblk0, i1_row, len1, blk0 + 2, words_rows)
                    idx1 = _block_indices(i0_row, len0, nblk0, i1_row, len1, blk0 + 3, words_rows)
                    raw_b, sc_b = _gather_half(row0, scales0, valid0, 1, words_layout, FMT)
                    _store_half(k_smem, r_smem, ready, free, raw_a, sc_a, row0, valid0, gj, 0, 0, FMT)
                    raw_a, sc_a = _gather_half(row1, scales1, valid1, 0, words_layout, FMT)
                    _store_half(k_smem, r_smem, ready, free, raw_b, sc_b, row0, valid0, gj, 0, 1, FMT)
                    raw_b, sc_b = _gather_half(row1, scales1, valid1, 1, words_layout, FMT)
                    _store_half(k_smem, r_smem, ready, free, raw_a, sc_a, row1, valid1, gj, 1, 0, FMT)
                    row0, scales0, valid0 = _block_rows(c0_ptr, c0_stride0, c0_slots, c1_ptr, c1_stride0, c1_slots,
                                                        idx0, blk0 + 2, nblk0, FMT, BS0, BS1, D_QK)
                    raw_a, sc_a = _gather_half(row0, scales0, valid0 & (blk0 + 2 < hi), 0, words_layout, FMT)
                    _store_half(k_smem, r_smem, ready, free, raw_b, sc_b, row1, valid1, gj, 1, 1, FMT)
            else:
                cols = gl.arange(0, HALF, layout=gl.SliceLayout(0, copy_layout))
                for j in range(pairs):
                    blk0 = lo + 2 * j
                    gj = g + j
                    idx0 = _block_indices(i0_row, len0, nblk0, i1_row, len1, blk0, copy_rows)
                    idx1 = _block_indices(i0_row, len0, nblk0, i1_row, len1, blk0 + 1, copy_rows)
                    row0, _, valid0 = _block_rows(c0_ptr, c0_stride0, c0_slots, c1_ptr, c1_stride0, c1_slots, idx0,
                                                  blk0, nblk0, FMT, BS0, BS1, D_QK)
                    row1, _, valid1 = _block_rows(c0_ptr, c0_stride0, c0_slots, c1_ptr, c1_stride0, c1_slots, idx1,
                                                  blk0 + 1, nblk0, FMT, BS0, BS1, D_QK)
                    valid1 = valid1 & (blk0 + 1 < hi)
                    # in the paired warpgroups' order (``_paired_partition``)
                    _copy_half(k_smem, r_smem, ready, free, row0, valid0, cols, gj, 0, 0, D_QK)
                    _copy_half(k_smem, r_smem, ready, free, row1, valid1, cols, gj, 1, 1, D_QK)
                    _copy_half(k_smem, r_smem, ready, free, row0, valid0, cols, gj, 0, 1, D_QK)
                    _copy_half(k_smem, r_smem, ready, free, row1, valid1, cols, gj, 1, 0, D_QK)
            g += pairs

    @gluon.jit
    def _softmax_start():
        """A math warpgroup's starting state: row maxima (-inf) and sums, output accumulator, zero logits."""
        return (gl.full([H_BLOCK], float("-inf"), gl.float32, layout=ROWS_LAYOUT),
                gl.zeros([H_BLOCK], gl.float32, layout=ROWS_LAYOUT),
                gl.zeros([H_BLOCK, HALF], gl.float32, layout=O_LAYOUT),
                gl.zeros([H_BLOCK, BLOCK_N], gl.float32, layout=S_LAYOUT))

    @gluon.jit
    def _rope_query(q_tok, stride_qh, hb, num_heads):
        """q's 64 rope dims of this head block, ``(64, 64)`` bf16 in registers: the A operand of the rope logits
        (576-d). Kept out of shared memory, which has no room left for them beside bf16 576-d rows."""
        qr_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=S_LAYOUT, k_width=2)
        heads_r = hb * H_BLOCK + gl.arange(0, H_BLOCK, layout=gl.SliceLayout(1, qr_layout))
        cols_r = DIM + gl.arange(0, ROPE, layout=gl.SliceLayout(0, qr_layout))
        return gl.load(q_tok + heads_r[:, None] * stride_qh + cols_r[None, :], mask=(heads_r < num_heads)[:, None],
                       other=0.0)

    @gluon.jit
    def _load_query(q_smem, q_free, r, q_tok, stride_qh, hb, num_heads):
        """Round ``r``'s q rows of this head block (their first 512 dims) into ``q_smem``, fenced for the wgmmas, once
        the buffer is free: it holds the previous item's output on its way out (``_store_rows``) until warpgroup 1
        arrives on ``q_free`` (and this warpgroup's own, until the barrier)."""
        mbarrier.wait(q_free, (r & 1) ^ 1, pred=r >= 1)
        gl.thread_barrier()
        q_layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [WARPS, 1], [1, 0])
        heads_q = hb * H_BLOCK + gl.arange(0, q_smem.shape[1], layout=gl.SliceLayout(1, q_layout))
        for SIDE in gl.static_range(2):
            cols_q = SIDE * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(0, q_layout))
            q = gl.load(q_tok + heads_q[:, None] * stride_qh + cols_q[None, :], mask=(heads_q < num_heads)[:, None],
                        other=0.0)
            q_smem.index(0).slice(SIDE * HALF, HALF, dim=1).store(q)
        fence_async_shared()
        gl.thread_barrier()

    @gluon.jit
    def _logits_partition(q_smem, k_smem, r_smem, p_smem, a_smem, m_smem, l_smem, ready, free, p_bar, p_free, l_bar,
                          q_free, q_ptr, stride_qt, stride_qh, out_ptr, lse_ptr, part_o_ptr, part_lse_ptr, sink_ptr,
                          c0_slots, c1_slots, order_ptr, l0_ptr, w0, i0_ptr, i0_stride, l1_ptr, w1, i1_ptr, i1_stride,
                          num_tokens, num_heads, tokens_per_len, qk_scale, tail, HAS_SINK: gl.constexpr,
                          PARTIAL: gl.constexpr, D_QK: gl.constexpr, HAS_ORDER: gl.constexpr, HAS_EXTRA: gl.constexpr,
                          SPLITS: gl.constexpr, SPLIT_BLOCKS: gl.constexpr, TAIL: gl.constexpr,
                          PERSISTENT: gl.constexpr):
        """Math warpgroup 0, per work item: loads its q, then each block's logits over every dim and its softmax;
        hands P and the rows' rescale factors to warpgroup 1 (``p_smem``, ``a_smem``), then multiplies P (from
        registers) by output dims [0, 256) of the block's values. 576-d (V3.2): the logits add q's rope dims (held in
        registers) times ``r_smem``'s."""
        g = 0  # key-block pairs of the items before: the phases of the ring's and the hand-over's barriers
        for r in range(_rounds(num_tokens, num_heads, tail, SPLITS, TAIL, PERSISTENT)):
            tok, hb, split, len0, nblk0, len1, lo, hi, i0_row, i1_row = _work_item(
                r, order_ptr, l0_ptr, w0, i0_ptr, i0_stride, l1_ptr, w1, i1_ptr, i1_stride, num_tokens, num_heads,
                tokens_per_len, tail, HAS_ORDER, HAS_EXTRA, SPLITS, SPLIT_BLOCKS, TAIL)
            q_tok = q_ptr + tok.to(gl.int64) * stride_qt
            _load_query(q_smem, q_free, r, q_tok, stride_qh, hb, num_heads)  # as the copy warpgroup gathers
            m_i, l_i, acc, s_zero = _softmax_start()
            if D_QK == QK_V32:
                q_rope = _rope_query(q_tok, stride_qh, hb, num_heads)
            pairs = gl.cdiv(hi - lo, 2)
            for j in range(pairs):
                phase = (g + j) & 1
                for BUF in gl.static_range(2):  # the pair's blocks, one after the other
                    blk = lo + 2 * j + BUF
                    n = 2 * (g + j) + BUF  # blocks handed to warpgroup 1 before this one
                    # the index rows' addresses and the wgmma operands' shared-memory descriptors are rebuilt each
                    # block from an opaque zero: hoisted out of the loop, they were spilled
                    zero = _opaque(0)
                    q_all = q_smem.index(zero)
                    k_blk = k_smem.index(BUF + zero)
                    valid = _block_keys_valid(i0_row + zero, len0, nblk0, i1_row + zero, len1, blk, hi, c0_slots,
                                              c1_slots, KEYS_LAYOUT)
                    # both halves first: the copy warpgroup works a block ahead, and a barrier wait between two
                    # wgmmas made ptxas move the logits' registers around it (spills)
                    mbarrier.wait(ready.index(2 * BUF), phase)
                    mbarrier.wait(ready.index(2 * BUF + 1), phase)
                    fence_async_shared()  # rows copied through the generic proxy feed a wgmma
                    s = warpgroup_mma(q_all.slice(0, HALF, dim=1), k_blk.slice(0, HALF, dim=1).permute((1, 0)),
                                      s_zero, use_acc=False, is_async=True)
                    s = warpgroup_mma(q_all.slice(HALF, HALF, dim=1), k_blk.slice(HALF, HALF, dim=1).permute((1, 0)),
                                      s, is_async=True)
                    if D_QK == QK_V32:  # the rope dims arrived with half 1
                        s = warpgroup_mma(q_rope, r_smem.index(BUF + zero).permute((1, 0)), s, is_async=True)
                    s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))

                    s = gl.where(valid[None, :], s * qk_scale, float("-inf"))
                    m_new = gl.maximum(m_i, gl.max(s, 1))
                    alpha = gl.where(m_new == m_i, 1.0, gl.exp2(m_i - m_new))
                    p = gl.exp2(s - gl.where(m_new == float("-inf"), 0.0, m_new)[:, None])
                    l_i = l_i * alpha + gl.sum(p, 1)
                    m_i = m_new
                    p16 = p.to(gl.bfloat16)
                    # hand over once warpgroup 1 has read the previous block's P and factors
                    mbarrier.wait(p_free, (n & 1) ^ 1, pred=n >= 1)
                    p_smem.index(zero).store(p16)
                    a_smem.store(alpha)
                    fence_async_shared()
                    gl.thread_barrier()
                    mbarrier.arrive(p_bar)
                    acc = acc * gl.convert_layout(alpha, O_ROWS)[:, None]
                    acc = warpgroup_mma(gl.convert_layout(p16, P_OPERAND), k_blk.slice(0, HALF, dim=1), acc,
                                        is_async=True)
                    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                    gl.thread_barrier()
                    mbarrier.arrive(free.index(2 * BUF))  # half 0: its last reader was this P·V
            g += pairs

            # (warpgroup 1 read the last item's m and l before it freed q's buffer)
            m_smem.store(m_i)
            l_smem.store(l_i)
            gl.thread_barrier()
            mbarrier.arrive(l_bar)
            _store_rows(acc, m_i, l_i, q_smem, out_ptr, lse_ptr, part_o_ptr, part_lse_ptr, sink_ptr,
                        tok, hb, split, num_tokens, num_heads, HAS_SINK, PARTIAL, TAIL, 0)

    @gluon.jit
    def _values_partition(q_smem, k_smem, p_smem, a_smem, m_smem, l_smem, free, p_bar, p_free, l_bar, q_free,
                          out_ptr, lse_ptr, part_o_ptr, part_lse_ptr, sink_ptr, order_ptr, l0_ptr, w0, i0_ptr,
                          i0_stride, l1_ptr, w1, i1_ptr, i1_stride, num_tokens, num_heads, tokens_per_len, tail,
                          HAS_SINK: gl.constexpr, PARTIAL: gl.constexpr, HAS_ORDER: gl.constexpr,
                          HAS_EXTRA: gl.constexpr, SPLITS: gl.constexpr, SPLIT_BLOCKS: gl.constexpr, TAIL: gl.constexpr,
                          PERSISTENT: gl.constexpr):
        """Math warpgroup 1, per work item: output dims [256, 512), from warpgroup 0's P (``p_smem``) and rescale
        factors; frees q's buffer once its output has left it."""
        g = 0
        for r in range(_rounds(num_tokens, num_heads, tail, SPLITS, TAIL, PERSISTENT)):
            tok, hb, split, len0, nblk0, len1, lo, hi, i0_row, i1_row = _work_item(
                r, order_ptr, l0_ptr, w0, i0_ptr, i0_stride, l1_ptr, w1, i1_ptr, i1_stride, num_tokens, num_heads,
                tokens_per_len, tail, HAS_ORDER, HAS_EXTRA, SPLITS, SPLIT_BLOCKS, TAIL)
            acc = gl.zeros([H_BLOCK, HALF], gl.float32, layout=O_LAYOUT)
            pairs = gl.cdiv(hi - lo, 2)
            for j in range(pairs):
                for BUF in gl.static_range(2):
                    n = 2 * (g + j) + BUF
                    zero = _opaque(0)
                    mbarrier.wait(p_bar, n & 1)
                    # the block's rows were fenced for the async proxy by warpgroup 0 before it published P
                    acc = acc * a_smem.load(O_ROWS)[:, None]
                    acc = warpgroup_mma(p_smem.index(zero), k_smem.index(BUF + zero).slice(HALF, HALF, dim=1), acc,
                                        is_async=True)
                    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                    gl.thread_barrier()
                    mbarrier.arrive(free.index(2 * BUF + 1))  # half 1: its last reader was this P·V
                    mbarrier.arrive(p_free)
            g += pairs

            mbarrier.wait(l_bar, r & 1)
            _store_rows(acc, m_smem.load(O_ROWS), l_smem.load(O_ROWS), q_smem, out_ptr, lse_ptr, part_o_ptr,
                        part_lse_ptr, sink_ptr, tok, hb, split, num_tokens, num_heads, HAS_SINK, PARTIAL, TAIL, 1)
            gl.thread_barrier()
            mbarrier.arrive(q_free)

    @gluon.jit
    def _paired_partition(q_smem, k_smem, r_smem, p_smem, m_smem, l_smem, ready, free, m_bar, p_bar, l_bar, q_free,
                          q_ready, q_ptr, stride_qt, stride_qh, out_ptr, lse_ptr, part_o_ptr, part_lse_ptr, sink_ptr,
                          c0_slots, c1_slots, order_ptr, l0_ptr, w0, i0_ptr, i0_stride, l1_ptr, w1, i1_ptr, i1_stride,
                          num_tokens, num_heads, tokens_per_len, qk_scale, tail, HAS_SINK: gl.constexpr,
                          PARTIAL: gl.constexpr, WG: gl.constexpr, D_QK: gl.constexpr, HAS_ORDER: gl.constexpr,
                          HAS_EXTRA: gl.constexpr, SPLITS: gl.constexpr, SPLIT_BLOCKS: gl.constexpr, TAIL: gl.constexpr,
                          PERSISTENT: gl.constexpr):
        """bf16 rows, math warpgroup ``WG``, per work item: the logits of block 2j+WG of each pair, output dims
        [256·WG, 256·WG + 256). The warpgroups trade their row maxima (``m_smem``: 0's to 1, the pair's back to 0,
        so both compute P on the pair's maximum; until version 13 warpgroup 0 computed P on its own and rescaled P
        and its accumulator afterwards, 1-3 % slower) and each publishes its P for the other; each multiplies its
        own P (from registers), then the other's (from ``p_smem``), by its half of the two blocks' values, so one's
        softmax overlaps the other's wgmmas. Warpgroup 0 loads each item's q
        (``q_ready``) once warpgroup 1's output of the item before has left q's buffer (``q_free``). 576-d (V3.2):
        the scores add q's rope dims (held in registers) times ``r_smem``'s."""
        OTHER: gl.constexpr = 1 - WG
        g = 0  # key-block pairs of the items before: the phases of the ring's and the maxima's barriers
        for r in range(_rounds(num_tokens, num_heads, tail, SPLITS, TAIL, PERSISTENT)):
            tok, hb, split, len0, nblk0, len1, lo, hi, i0_row, i1_row = _work_item(
                r, order_ptr, l0_ptr, w0, i0_ptr, i0_stride, l1_ptr, w1, i1_ptr, i1_stride, num_tokens, num_heads,
                tokens_per_len, tail, HAS_ORDER, HAS_EXTRA, SPLITS, SPLIT_BLOCKS, TAIL)
            q_tok = q_ptr + tok.to(gl.int64) * stride_qt
            if WG == 0:
                _load_query(q_smem, q_free, r, q_tok, stride_qh, hb, num_heads)
                mbarrier.arrive(q_ready)
            else:
                mbarrier.wait(q_ready, r & 1)
            m_i, l_i, acc, s_zero = _softmax_start()
            if D_QK == QK_V32:
                q_rope = _rope_query(q_tok, stride_qh, hb, num_heads)
            pairs = gl.cdiv(hi - lo, 2)
            for j in range(pairs):
                phase = (g + j) & 1
                blk = lo + 2 * j + WG
                # the index rows' addresses and the wgmma operands' shared-memory descriptors are rebuilt each
                # pair from an opaque zero: hoisted out of the loop, they were spilled
                zero = _opaque(0)
                q_all = q_smem.index(zero)
                k_own = k_smem.index(WG + zero)
                k_other = k_smem.index(OTHER + zero)
                valid = _block_keys_valid(i0_row + zero, len0, nblk0, i1_row + zero, len1, blk, hi, c0_slots,
                                          c1_slots, KEYS_LAYOUT)
                # the logits, over the half this warpgroup's PV reads first, then the other half
                mbarrier.wait(ready.index(2 * WG + WG), phase)
                fence_async_shared()  # rows copied through the generic proxy feed a wgmma
                s = warpgroup_mma(q_all.slice(WG * HALF, HALF, dim=1),
                                  k_own.slice(WG * HALF, HALF, dim=1).permute((1, 0)), s_zero, use_acc=False,
                                  is_async=True)
                mbarrier.wait(ready.index(2 * WG + OTHER), phase)
                fence_async_shared()
                s = warpgroup_mma(q_all.slice(OTHER * HALF, HALF, dim=1),
                                  k_own.slice(OTHER * HALF, HALF, dim=1).permute((1, 0)), s, is_async=True)
                if D_QK == QK_V32:  # the rope dims arrived with half 1
                    s = warpgroup_mma(q_rope, r_smem.index(WG + zero).permute((1, 0)), s, is_async=True)
                s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))

                s = gl.where(valid[None, :], s * qk_scale, float("-inf"))
                m_prev = m_i
                if WG == 1:  # start from warpgroup 0's maximum of this pair
                    mbarrier.wait(m_bar.index(0), phase)
                    m_prev = m_smem.index(0).load(ROWS_LAYOUT)
                m_new = gl.maximum(m_prev, gl.max(s, 1))
                if WG == 0:  # hand its maximum to warpgroup 1, take back the pair's
                    m_smem.index(0).store(m_new)
                    gl.thread_barrier()
                    mbarrier.arrive(m_bar.index(0))
                    mbarrier.wait(m_bar.index(1), phase)
                    m_new = m_smem.index(1).load(ROWS_LAYOUT)
                alpha = gl.where(m_new == m_i, 1.0, gl.exp2(m_i - m_new))
                acc = acc * gl.convert_layout(alpha, O_ROWS)[:, None]
                l_i = l_i * alpha
                m_i = m_new
                p = gl.exp2(s - gl.where(m_new == float("-inf"), 0.0, m_new)[:, None])
                l_i += gl.sum(p, 1)
                if WG == 1:
                    m_smem.index(1).store(m_new)
                    gl.thread_barrier()
                    mbarrier.arrive(m_bar.index(1))
                p16 = p.to(gl.bfloat16)
                acc = warpgroup_mma(gl.convert_layout(p16, P_OPERAND), k_own.slice(WG * HALF, HALF, dim=1), acc,
                                    is_async=True)
                if WG == 0:
                    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                    gl.thread_barrier()
                    mbarrier.arrive(free.index(0))  # half 0L: its last reader was this PV
                p_smem.index(WG).store(p16)
                fence_async_shared()
                gl.thread_barrier()
                mbarrier.arrive(p_bar.index(WG))
                # the other block's half: its rows (cp.async or dequantised) were fenced for the async proxy by
                # the warpgroup that owns the block, before it published its P
                mbarrier.wait(p_bar.index(OTHER), phase)
                acc = warpgroup_mma(p_smem.index(OTHER + zero), k_other.slice(WG * HALF, HALF, dim=1), acc,
                                    is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                gl.thread_barrier()
                mbarrier.arrive(free.index(2 * OTHER + WG))  # this warpgroup's half of the other block
                if WG == 1:
                    mbarrier.arrive(free.index(2 * WG + WG))  # half 1R, read by this warpgroup alone

            # both sums are relative to the pair's common maximum; add them up
            l_smem.index(WG).store(l_i)
            gl.thread_barrier()
            mbarrier.arrive(l_bar)
            mbarrier.wait(l_bar, r & 1)
            l_all = l_smem.index(0).load(ROWS_LAYOUT) + l_smem.index(1).load(ROWS_LAYOUT)
            _store_rows(acc, m_i, l_all, q_smem, out_ptr, lse_ptr, part_o_ptr, part_lse_ptr, sink_ptr,
                        tok, hb, split, num_tokens, num_heads, HAS_SINK, PARTIAL, TAIL, WG)
            g += pairs
            if WG == 1:
                gl.thread_barrier()
                mbarrier.arrive(q_free)

    @gluon.jit
    def _copy_buffer_partition(k_smem, r_smem, ready, free, c0_ptr, c0_stride0, c0_slots, c1_ptr, c1_stride0,
                               c1_slots, order_ptr, l0_ptr, w0, i0_ptr, i0_stride, l1_ptr, w1, i1_ptr, i1_stride,
                               num_tokens, num_heads, tokens_per_len, tail, FMT: gl.constexpr, BS0: gl.constexpr,
                               BS1: gl.constexpr, D_QK: gl.constexpr, HAS_ORDER: gl.constexpr,
                               HAS_EXTRA: gl.constexpr, SPLITS: gl.constexpr, SPLIT_BLOCKS: gl.constexpr,
                               TAIL: gl.constexpr, PERSISTENT: gl.constexpr, BUF: gl.constexpr):
        """fp8 rows, narrow items: one of two copy warpgroups, each with a buffer of its own: block 2j + ``BUF`` of
        each pair of each work item into buffer ``BUF``, dequantised half by half as ``_copy_partition`` does both
        buffers' (the next half's gathers issued before the current half is stored: two halves in flight), each
        half dequantised before its buffer is free (``_store_half``'s ``DEQUANT_FIRST``)."""
        words_layout: gl.constexpr = WORDS_V4 if FMT == FP8_V4 else WORDS_V32
        words_rows: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, words_layout))
        g = 0
        for r in range(_rounds(num_tokens, num_heads, tail, SPLITS, TAIL, PERSISTENT)):
            tok, hb, split, len0, nblk0, len1, lo, hi, i0_row, i1_row = _work_item(
                r, order_ptr, l0_ptr, w0, i0_ptr, i0_stride, l1_ptr, w1, i1_ptr, i1_stride, num_tokens, num_heads,
                tokens_per_len, tail, HAS_ORDER, HAS_EXTRA, SPLITS, SPLIT_BLOCKS, TAIL)
            pairs = gl.cdiv(hi - lo, 2)
            idx = _block_indices(i0_row, len0, nblk0, i1_row, len1, lo + BUF, words_rows)
            row, scales, valid = _block_rows(c0_ptr, c0_stride0, c0_slots, c1_ptr, c1_stride0, c1_slots, idx,
                                             lo + BUF, nblk0, FMT, BS0, BS1, D_QK)
            raw_a, sc_a = _gather_half(row, scales, valid & (lo + BUF < hi), 0, words_layout, FMT)
            for j in range(pairs):
                blk = lo + 2 * j + BUF
                row, scales, valid = _block_rows(c0_ptr, c0_stride0, c0_slots, c1_ptr, c1_stride0, c1_slots, idx,
                                                 blk, nblk0, FMT, BS0, BS1, D_QK)
                valid = valid & (blk < hi)
                idx = _block_indices(i0_row, len0, nblk0, i1_row, len1, blk + 2, words_rows)
                raw_b, sc_b = _gather_half(row, scales, valid, 1, words_layout, FMT)
                _store_half(k_smem, r_smem, ready, free, raw_a, sc_a, row, valid, g + j, BUF, 0, FMT, True)
                row2, scales2, valid2 = _block_rows(c0_ptr, c0_stride0, c0_slots, c1_ptr, c1_stride0, c1_slots, idx,
                                                    blk + 2, nblk0, FMT, BS0, BS1, D_QK)
                raw_a, sc_a = _gather_half(row2, scales2, valid2 & (blk + 2 < hi), 0, words_layout, FMT)
                _store_half(k_smem, r_smem, ready, free, raw_b, sc_b, row, valid, g + j, BUF, 1, FMT, True)
            g += pairs

    @gluon.jit
    def _keys_max(s):
        """The maximum over the keys (rows) of narrow logits ``s (BLOCK_N, 16)`` in their wgmma layout, per head, in
        the layout of its columns: each warp's 16 rows by shuffles, then every warp's maxima to every thread through
        one shared-memory round trip (``gl.max`` over the rows takes two, with a barrier each)."""
        gl.static_assert((s.shape[1] == 16) & (WARPS == 4), "the layout below spells out 16 heads, 4 warps")
        per_warp = gl.max(gl.reshape(s, [WARPS, BLOCK_N // WARPS, 16]), 1)  # (warps, heads)
        # each thread: every warp's maxima of its heads (head bits: 1 and 8 in registers, 2 and 4 in lanes, as the
        # wgmma layout's columns)
        every: gl.constexpr = gl.DistributedLinearLayout(reg_bases=[[1, 0], [2, 0], [0, 1], [0, 8]],
                                                         lane_bases=[[0, 2], [0, 4], [0, 0], [0, 0], [0, 0]],
                                                         warp_bases=[[0, 0], [0, 0]], block_bases=[],
                                                         shape=[WARPS, 16])
        return gl.convert_layout(gl.max(gl.convert_layout(per_warp, every), 0), gl.SliceLayout(0, s.type.layout))

    @gluon.jit
    def _narrow_partition(q_smem, qr_smem, k_smem, r_smem, p_smem, ready, free, q_free, q_ptr, stride_qt, stride_qh,
                          out_ptr, lse_ptr, part_o_ptr, part_lse_ptr, sink_ptr, c0_slots, c1_slots, order_ptr, l0_ptr,
                          w0, i0_ptr, i0_stride, l1_ptr, w1, i1_ptr, i1_stride, num_tokens, num_heads, tokens_per_len,
                          qk_scale, tail, HAS_SINK: gl.constexpr, PARTIAL: gl.constexpr, D_QK: gl.constexpr,
                          HAS_ORDER: gl.constexpr, HAS_EXTRA: gl.constexpr, SPLITS: gl.constexpr,
                          SPLIT_BLOCKS: gl.constexpr, TAIL: gl.constexpr, PERSISTENT: gl.constexpr,
                          HEADS_N: gl.constexpr):
        """fp8 rows, narrow items (at most ``HEADS_N`` heads, the wgmmas' N): the one math warpgroup, per work item,
        with keys and output dims as the wgmmas' M: each block's logits transposed, ``(64 keys, heads)`` = K·Qᵀ
        (576-d: plus the keys' rope dims times q's, ``qr_smem``), their online softmax over the keys, Pᵀ into
        ``p_smem``, and the output transposed, ``(512 dims, heads)`` += Vᵀ·Pᵀ, V read transposed from the key
        rows. Its accumulators (with its share of P's sums: ``l_parts``, reduced across the warps once per item)
        take 5·``HEADS_N`` registers per thread, against 64 heads' 128 + 32 per math warpgroup, which leaves the
        registers for two copy warpgroups."""
        nt_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                            instr_shape=[16, HEADS_N, 16])
        keys_layout: gl.constexpr = gl.SliceLayout(1, nt_layout)
        heads_layout: gl.constexpr = gl.SliceLayout(0, nt_layout)
        g = 0
        for r in range(_rounds(num_tokens, num_heads, tail, SPLITS, TAIL, PERSISTENT)):
            tok, hb, split, len0, nblk0, len1, lo, hi, i0_row, i1_row = _work_item(
                r, order_ptr, l0_ptr, w0, i0_ptr, i0_stride, l1_ptr, w1, i1_ptr, i1_stride, num_tokens, num_heads,
                tokens_per_len, tail, HAS_ORDER, HAS_EXTRA, SPLITS, SPLIT_BLOCKS, TAIL)
            q_tok = q_ptr + tok.to(gl.int64) * stride_qt
            _load_query(q_smem, q_free, r, q_tok, stride_qh, hb, num_heads)
            if D_QK == QK_V32:
                qr_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [WARPS, 1], [1, 0])
                heads_r = gl.arange(0, HEADS_N, layout=gl.SliceLayout(1, qr_layout))
                cols_r = DIM + gl.arange(0, ROPE, layout=gl.SliceLayout(0, qr_layout))
                qr_smem.store(gl.load(q_tok + heads_r[:, None] * stride_qh + cols_r[None, :],
                                      mask=(heads_r < num_heads)[:, None], other=0.0))
                fence_async_shared()
                gl.thread_barrier()
            m_i = gl.full([HEADS_N], float("-inf"), gl.float32, layout=heads_layout)
            # each thread's share of the sums of P, reduced over the keys (across the warps) once per item
            l_parts = gl.zeros([BLOCK_N, HEADS_N], gl.float32, layout=nt_layout)
            acc = gl.zeros([DIM, HEADS_N], gl.float32, layout=nt_layout)
            s_zero = gl.zeros([BLOCK_N, HEADS_N], gl.float32, layout=nt_layout)
            pairs = gl.cdiv(hi - lo, 2)
            for j in range(pairs):
                phase = (g + j) & 1
                for BUF in gl.static_range(2):
                    blk = lo + 2 * j + BUF
                    zero = _opaque(0)
                    k_blk = k_smem.index(BUF + zero)
                    valid = _block_keys_valid(i0_row + zero, len0, nblk0, i1_row + zero, len1, blk, hi, c0_slots,
                                              c1_slots, keys_layout)
                    mbarrier.wait(ready.index(2 * BUF), phase)
                    mbarrier.wait(ready.index(2 * BUF + 1), phase)
                    fence_async_shared()  # rows dequantised through the generic proxy feed a wgmma
                    s = warpgroup_mma(k_blk, q_smem.index(zero).permute((1, 0)), s_zero, use_acc=False,
                                      is_async=True)
                    if D_QK == QK_V32:
                        s = warpgroup_mma(r_smem.index(BUF + zero), qr_smem.permute((1, 0)), s, is_async=True)
                    s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))

                    s = gl.where(valid[:, None], s * qk_scale, float("-inf"))
                    m_new = gl.maximum(m_i, _keys_max(s))
                    alpha = gl.where(m_new == m_i, 1.0, gl.exp2(m_i - m_new))
                    p = gl.exp2(s - gl.where(m_new == float("-inf"), 0.0, m_new)[None, :])
                    l_parts = l_parts * alpha[None, :] + p
                    m_i = m_new
                    p_smem.store(gl.permute(p.to(gl.bfloat16), (1, 0)))
                    fence_async_shared()
                    gl.thread_barrier()
                    acc = acc * alpha[None, :]
                    acc = warpgroup_mma(k_blk.permute((1, 0)), p_smem.permute((1, 0)), acc, is_async=True)
                    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                    gl.thread_barrier()
                    mbarrier.arrive(free.index(2 * BUF))
                    mbarrier.arrive(free.index(2 * BUF + 1))
            g += pairs
            _store_rows(acc, m_i, gl.sum(l_parts, 0), q_smem, out_ptr, lse_ptr, part_o_ptr, part_lse_ptr, sink_ptr,
                        tok, hb, split, num_tokens, num_heads, HAS_SINK, PARTIAL, TAIL, -1)
            gl.thread_barrier()
            mbarrier.arrive(q_free)  # (its own: the next item's q overwrites the staged output)

    @gluon.jit
    def _store_rows(acc, m_i, l_i, q_smem, out_ptr, lse_ptr, part_o_ptr, part_lse_ptr, sink_ptr,
                    tok, hb, split, num_tokens, num_heads, HAS_SINK: gl.constexpr, PARTIAL: gl.constexpr,
                    TAIL: gl.constexpr, WG: gl.constexpr):
        """:func:`_store_item` for this item: with ``TAIL``, a whole item (split -1) writes the output and a piece of
        the last tokens its partial rows; else every item as ``PARTIAL`` says."""
        if TAIL:
            if split >= 0:
                _store_item(acc, m_i, l_i, q_smem, out_ptr, lse_ptr, part_o_ptr, part_lse_ptr, sink_ptr,
                            tok, hb, split, num_tokens, num_heads, HAS_SINK, True, WG)
            else:
                _store_item(acc, m_i, l_i, q_smem, out_ptr, lse_ptr, part_o_ptr, part_lse_ptr, sink_ptr,
                            tok, hb, 0, num_tokens, num_heads, HAS_SINK, False, WG)
        else:
            _store_item(acc, m_i, l_i, q_smem, out_ptr, lse_ptr, part_o_ptr, part_lse_ptr, sink_ptr,
                        tok, hb, split, num_tokens, num_heads, HAS_SINK, PARTIAL, WG)

    @gluon.jit
    def _store_item(acc, m_i, l_i, q_smem, out_ptr, lse_ptr, part_o_ptr, part_lse_ptr, sink_ptr,
                    tok, hb, split, num_tokens, num_heads, HAS_SINK: gl.constexpr, PARTIAL: gl.constexpr,
                    WG: gl.constexpr):
        """Warpgroup ``WG``'s output dims [256·WG, 256·WG + 256): ``acc`` normalised, into ``out`` or the split's
        partial rows; warpgroup 0 also stores the LSE. Q is dead by now (warpgroup 0's logits are all done):
        bf16 rows are staged in this warpgroup's half of it, so that each thread stores 16 consecutive bytes.
        ``WG`` -1: the narrow warpgroup's whole output (:func:`_store_narrow`)."""
        if WG < 0:
            _store_narrow(acc, m_i, l_i, q_smem, out_ptr, lse_ptr, part_o_ptr, part_lse_ptr, sink_ptr,
                          tok, hb, split, num_tokens, num_heads, HAS_SINK, PARTIAL)
        else:
            o_layout: gl.constexpr = acc.type.layout
            o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
            heads, factor, dst = _row_outputs(m_i, l_i, o_rows, out_ptr, lse_ptr, part_o_ptr, part_lse_ptr,
                                              sink_ptr, tok, hb, split, num_tokens, num_heads, HAS_SINK, PARTIAL,
                                              WG == 0)
            vals = acc * factor[:, None]
            if not PARTIAL:
                _staged_store(vals.to(gl.bfloat16), q_smem.index(0).slice(WG * HALF, HALF, dim=1), dst, heads,
                              WG * HALF, num_heads)
            else:
                cols = WG * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(0, o_layout))
                gl.store(dst + heads[:, None] * D_OUT + cols[None, :], vals, mask=(heads < num_heads)[:, None])

    @gluon.jit
    def _staged_store(vals, stage, dst, heads, col0, num_heads):
        """Output rows ``vals (heads, cols)`` bf16 into ``dst``'s rows ``heads`` (dims ``col0 + cols``), staged
        through ``stage`` (shared memory of their shape, dead by now) so that each thread stores 16 consecutive
        bytes."""
        stage.store(vals)
        gl.thread_barrier()
        store_layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [WARPS, 1], [1, 0])
        vals_s = stage.load(store_layout)
        heads_s = gl.convert_layout(heads, gl.SliceLayout(1, store_layout))
        cols = col0 + gl.arange(0, vals.shape[1], layout=gl.SliceLayout(0, store_layout))
        gl.store(dst + heads_s[:, None] * D_OUT + cols[None, :], vals_s, mask=(heads_s < num_heads)[:, None])

    @gluon.jit
    def _store_narrow(acc, m_i, l_i, q_smem, out_ptr, lse_ptr, part_o_ptr, part_lse_ptr, sink_ptr,
                      tok, hb, split, num_tokens, num_heads, HAS_SINK: gl.constexpr, PARTIAL: gl.constexpr):
        """The narrow warpgroup's ``acc (512 dims, heads)`` normalised, into ``out`` (staged, transposed, in q's
        buffer, which holds exactly the item's rows) or the split's partial rows; stores the LSE."""
        heads, factor, dst = _row_outputs(m_i, l_i, gl.SliceLayout(0, acc.type.layout), out_ptr, lse_ptr, part_o_ptr,
                                          part_lse_ptr, sink_ptr, tok, hb, split, num_tokens, num_heads, HAS_SINK,
                                          PARTIAL)
        vals = acc * factor[None, :]
        if not PARTIAL:
            _staged_store(gl.permute(vals.to(gl.bfloat16), (1, 0)), q_smem.index(0), dst, heads, 0, num_heads)
        else:
            dims = gl.arange(0, DIM, layout=gl.SliceLayout(1, acc.type.layout))
            gl.store(dst + heads[None, :] * D_OUT + dims[:, None], vals, mask=(heads < num_heads)[None, :])

    @gluon.jit
    def _attention_kernel(
        q_ptr, stride_qt, stride_qh,
        out_ptr, lse_ptr, part_o_ptr, part_lse_ptr, sink_ptr, order_ptr,
        c0_ptr, c0_stride0, c0_slots, i0_ptr, i0_stride, l0_ptr, w0,
        c1_ptr, c1_stride0, c1_slots, i1_ptr, i1_stride, l1_ptr, w1,
        num_tokens, num_heads, tokens_per_len, qk_scale, tail,
        FMT: gl.constexpr, BS0: gl.constexpr, BS1: gl.constexpr, HAS_EXTRA: gl.constexpr, HAS_SINK: gl.constexpr,
        HAS_ORDER: gl.constexpr, SPLITS: gl.constexpr, SPLIT_BLOCKS: gl.constexpr, D_QK: gl.constexpr,
        PERSISTENT: gl.constexpr = False, TAIL: gl.constexpr = False, HEADS_N: gl.constexpr = 0,
    ):
        # the copy side branches on FMT, the buffers and the math side on D_QK: only these pairs agree
        gl.static_assert((FMT == BF16) & ((D_QK == DIM) | (D_QK == QK_V32)) | (FMT == FP8_V4) & (D_QK == DIM)
                         | (FMT == FP8_V32) & (D_QK == QK_V32),
                         "FMT and D_QK must be bf16 (512 or 576), fp8_v4 (512) or fp8_v32 (576)")
        smem_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        vec_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
        # bf16 rows (cp.async: math-bound) go to two paired math warpgroups that share the logits, fp8 rows (bound
        # by the copy warpgroup's gathers and dequantisation) to a logits warpgroup and a values warpgroup
        PAIRED: gl.constexpr = FMT == BF16
        PARTIAL: gl.constexpr = (SPLITS > 1) | (SPLIT_BLOCKS > 0)  # write a split's partial row, not the output

        NARROW: gl.constexpr = HEADS_N > 0  # fp8 rows of at most HEADS_N heads: narrow items (``narrow_heads``)
        q_smem = gl.allocate_shared_memory(gl.bfloat16, [1, HEADS_N if NARROW else H_BLOCK, DIM],
                                           smem_layout)  # indexed: see the loop
        k_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, DIM], smem_layout)
        if D_QK == QK_V32:
            r_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, ROPE], smem_layout)  # the keys' rope dims
        else:
            r_smem = k_smem  # unused: V4's rope dims are the last 64 of its rows
        if NARROW:
            p_smem = gl.allocate_shared_memory(gl.bfloat16, [HEADS_N, BLOCK_N], smem_layout)  # Pᵀ's rows
            if D_QK == QK_V32:
                qr_smem = gl.allocate_shared_memory(gl.bfloat16, [HEADS_N, ROPE], smem_layout)  # q's rope dims
            else:
                qr_smem = p_smem  # unused
        else:
            p_smem = gl.allocate_shared_memory(gl.bfloat16, [2 if PAIRED else 1, H_BLOCK, BLOCK_N], smem_layout)
        a_smem = gl.allocate_shared_memory(gl.float32, [H_BLOCK], vec_layout)  # the rows' rescale factors
        m_smem = gl.allocate_shared_memory(gl.float32, [2, H_BLOCK], vec_layout)
        l_smem = gl.allocate_shared_memory(gl.float32, [2, H_BLOCK], vec_layout)
        ready = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
        free = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
        m_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        p_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        p_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        l_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        q_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        for b in gl.static_range(4):
            if FMT == BF16:
                mbarrier.init(ready.index(b), count=WARPS * 32)  # every copying thread's cp.async arrival
            elif b % 2 == 0:
                mbarrier.init(ready.index(b), count=1)  # the copy warpgroup, after its shared-memory stores
            else:
                mbarrier.init(ready.index(b), count=1 + WARPS * 32)  # and each thread's rope cp.async
            mbarrier.init(free.index(b), count=1)
        for b in gl.static_range(2):
            mbarrier.init(m_bar.index(b), count=1)
            mbarrier.init(p_bar.index(b), count=1)
        mbarrier.init(p_free, count=1)
        mbarrier.init(l_bar, count=2 if PAIRED else 1)
        mbarrier.init(q_free, count=1)
        mbarrier.init(q_ready, count=1)
        gl.thread_barrier()

        # (the partition lists are spelled out: a JIT function cannot be held in a variable, and a tuple variable
        # would turn the constexprs in it into tensors)
        if NARROW:
            gl.warp_specialize([
                (_copy_buffer_partition, (k_smem, r_smem, ready, free, c0_ptr, c0_stride0, c0_slots, c1_ptr,
                                          c1_stride0, c1_slots, order_ptr, l0_ptr, w0, i0_ptr, i0_stride, l1_ptr, w1,
                                          i1_ptr, i1_stride, num_tokens, num_heads, tokens_per_len, tail, FMT, BS0,
                                          BS1, D_QK, HAS_ORDER, HAS_EXTRA, SPLITS, SPLIT_BLOCKS, TAIL, PERSISTENT, 0)),
                (_copy_buffer_partition, (k_smem, r_smem, ready, free, c0_ptr, c0_stride0, c0_slots, c1_ptr,
                                          c1_stride0, c1_slots, order_ptr, l0_ptr, w0, i0_ptr, i0_stride, l1_ptr, w1,
                                          i1_ptr, i1_stride, num_tokens, num_heads, tokens_per_len, tail, FMT, BS0,
                                          BS1, D_QK, HAS_ORDER, HAS_EXTRA, SPLITS, SPLIT_BLOCKS, TAIL, PERSISTENT, 1)),
                (_narrow_partition, (q_smem, qr_smem, k_smem, r_smem, p_smem, ready, free, q_free, q_ptr, stride_qt,
                                     stride_qh, out_ptr, lse_ptr, part_o_ptr, part_lse_ptr, sink_ptr, c0_slots,
                                     c1_slots, order_ptr, l0_ptr, w0, i0_ptr, i0_stride, l1_ptr, w1, i1_ptr,
                                     i1_stride, num_tokens, num_heads, tokens_per_len, qk_scale, tail, HAS_SINK,
                                     PARTIAL, D_QK, HAS_ORDER, HAS_EXTRA, SPLITS, SPLIT_BLOCKS, TAIL, PERSISTENT,
                                     HEADS_N)),
            ], [WARPS, WARPS], [NARROW_COPY_WG_REGS, NARROW_MATH_WG_REGS])
        elif PAIRED:
            gl.warp_specialize([
                (_copy_partition, (k_smem, r_smem, ready, free, c0_ptr, c0_stride0, c0_slots, c1_ptr, c1_stride0,
                                   c1_slots, order_ptr, l0_ptr, w0, i0_ptr, i0_stride, l1_ptr, w1, i1_ptr, i1_stride,
                                   num_tokens, num_heads, tokens_per_len, tail, FMT, BS0, BS1, D_QK, HAS_ORDER,
                                   HAS_EXTRA, SPLITS, SPLIT_BLOCKS, TAIL, PERSISTENT)),
                (_paired_partition, (q_smem, k_smem, r_smem, p_smem, m_smem, l_smem, ready, free, m_bar, p_bar, l_bar,
                                     q_free, q_ready, q_ptr, stride_qt, stride_qh, out_ptr, lse_ptr, part_o_ptr,
                                     part_lse_ptr, sink_ptr, c0_slots, c1_slots, order_ptr, l0_ptr, w0, i0_ptr,
                                     i0_stride, l1_ptr, w1, i1_ptr, i1_stride, num_tokens, num_heads, tokens_per_len,
                                     qk_scale, tail, HAS_SINK, PARTIAL, 0, D_QK, HAS_ORDER, HAS_EXTRA, SPLITS,
                                     SPLIT_BLOCKS, TAIL, PERSISTENT)),
                (_paired_partition, (q_smem, k_smem, r_smem, p_smem, m_smem, l_smem, ready, free, m_bar, p_bar, l_bar,
                                     q_free, q_ready, q_ptr, stride_qt, stride_qh, out_ptr, lse_ptr, part_o_ptr,
                                     part_lse_ptr, sink_ptr, c0_slots, c1_slots, order_ptr, l0_ptr, w0, i0_ptr,
                                     i0_stride, l1_ptr, w1, i1_ptr, i1_stride, num_tokens, num_heads, tokens_per_len,
                                     qk_scale, tail, HAS_SINK, PARTIAL, 1, D_QK, HAS_ORDER, HAS_EXTRA, SPLITS,
                                     SPLIT_BLOCKS, TAIL, PERSISTENT)),
            ], [WARPS, WARPS], [PAIRED_REGS_BF16, PAIRED_REGS_BF16])
        else:
            logits_regs: gl.constexpr = LOGITS_REGS_V4 if FMT == FP8_V4 else LOGITS_REGS_V32
            gl.warp_specialize([
                (_copy_partition, (k_smem, r_smem, ready, free, c0_ptr, c0_stride0, c0_slots, c1_ptr, c1_stride0,
                                   c1_slots, order_ptr, l0_ptr, w0, i0_ptr, i0_stride, l1_ptr, w1, i1_ptr, i1_stride,
                                   num_tokens, num_heads, tokens_per_len, tail, FMT, BS0, BS1, D_QK, HAS_ORDER,
                                   HAS_EXTRA, SPLITS, SPLIT_BLOCKS, TAIL, PERSISTENT)),
                (_logits_partition, (q_smem, k_smem, r_smem, p_smem, a_smem, m_smem.index(0), l_smem.index(0), ready,
                                     free, p_bar.index(0), p_free, l_bar, q_free, q_ptr, stride_qt, stride_qh, out_ptr,
                                     lse_ptr, part_o_ptr, part_lse_ptr, sink_ptr, c0_slots, c1_slots, order_ptr,
                                     l0_ptr, w0, i0_ptr, i0_stride, l1_ptr, w1, i1_ptr, i1_stride, num_tokens,
                                     num_heads, tokens_per_len, qk_scale, tail, HAS_SINK, PARTIAL, D_QK, HAS_ORDER,
                                     HAS_EXTRA, SPLITS, SPLIT_BLOCKS, TAIL, PERSISTENT)),
                (_values_partition, (q_smem, k_smem, p_smem, a_smem, m_smem.index(0), l_smem.index(0), free,
                                     p_bar.index(0), p_free, l_bar, q_free, out_ptr, lse_ptr, part_o_ptr,
                                     part_lse_ptr, sink_ptr, order_ptr, l0_ptr, w0, i0_ptr, i0_stride, l1_ptr, w1,
                                     i1_ptr, i1_stride, num_tokens, num_heads, tokens_per_len, tail, HAS_SINK, PARTIAL,
                                     HAS_ORDER, HAS_EXTRA, SPLITS, SPLIT_BLOCKS, TAIL, PERSISTENT)),
            ], [WARPS, WARPS], [logits_regs, VALUES_WG_REGS])
