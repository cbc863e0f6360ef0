"""Hopper sparse MLA attention for V4 (512 latent dims), written in Gluon (Triton's explicit dialect).

Same contract and arguments as ``triton_attention``'s kernel, for the cases that dominate serving
on an sm_90 GPU: every scope ``fp8_v4`` (decode, paged-direct prefill) or every scope ``bf16``
(workspace prefill, bf16 caches). The Triton kernel runs each key block as one serial chain
(gather → dequantise → shared memory → QK wgmma, waited → softmax → PV wgmma, waited) with nothing
else on the SM to fill the gaps. Here the chain is software-pipelined by hand over two shared key
buffers: block i+1's gathers are issued right after block i's QK wgmma, land while it and the
softmax run, and are dequantised (fp8) or copied asynchronously (bf16) into the other buffer
while block i's PV wgmma runs. On decode-sized grids the rows of block i+2 are prefetched into L2
meanwhile (``prefetch_pays``), so that block i+1's gathers do not wait for HBM.

One program = one query token × 64 heads × one split of the key list, 8 warps: two warpgroups,
each computing the logits of half the keys and owning 256 of the 512 output dims. A token's head
blocks are launched next to each other so the second one's gathers hit L2. The split merge and
the sink of split rows are ``triton_attention``'s combine kernel.

Gluon's API is experimental: the kernel is used with the Triton versions it was validated on
(``VALIDATED_TRITON``) unless ``SPARSE_MLA_GLUON=1`` asks for it anyway (``=0`` turns it off).
"""
from __future__ import annotations

import functools
import os

import torch
import triton

from .validate import D_V, AttentionArgs

try:  # Gluon ships with Triton >= 3.5; its API is experimental, so any mismatch disables this path
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        async_copy,
        warpgroup_mma,
        warpgroup_mma_init,
        warpgroup_mma_wait,
    )
except ImportError:  # pragma: no cover - depends on the installed Triton
    gluon = None

NUM_WARPS = 8
HEADS_PER_PROGRAM = 64
KEYS_PER_BLOCK = 64
PREFETCH_MAX_WAVES = 8  # grids of up to this many programs per SM prefetch their key rows (``prefetch_pays``)
VALIDATED_TRITON = ("3.6.",)  # checked on an H100 against the reference ops (tests/test_triton_attention.py)


def enabled() -> bool:
    """Whether the Gluon path may be used at all: Gluon importable and a validated Triton (or forced)."""
    choice = os.environ.get("SPARSE_MLA_GLUON", "")
    if gluon is None or choice == "0":
        return False
    return choice == "1" or triton.__version__.startswith(VALIDATED_TRITON)


@functools.lru_cache(maxsize=None)
def _is_hopper(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] == 9


def supported(args: AttentionArgs) -> bool:
    """Whether this kernel can run ``args``: Hopper, V4 dims, every scope fp8_v4 or every scope bf16."""
    q = args.q
    fmts = {s.fmt.name for s in args.scopes}
    return (q.is_cuda and q.shape[-1] == 512 and fmts in ({"fp8_v4"}, {"bf16"}) and enabled()
            and _is_hopper(q.device))


if gluon is not None:
    H_BLOCK = gl.constexpr(HEADS_PER_PROGRAM)
    BLOCK_N = gl.constexpr(KEYS_PER_BLOCK)
    NOPE = gl.constexpr(448)  # e4m3 dims of a V4 row; the other 64 are bf16 rope
    DIM = gl.constexpr(512)
    D_OUT = gl.constexpr(D_V)

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
    def _block_rows(c0_ptr, c0_stride0, c0_slots, c1_ptr, c1_stride0, c1_slots, idx, blk, nblk0,
                    FMT: gl.constexpr, BS0: gl.constexpr, BS1: gl.constexpr):
        """Pointers to the rows of block ``blk``'s slots ``idx`` (bytes for fp8_v4, elements for bf16),
        to their scale bytes (fp8_v4), and the rows' validity."""
        ROW: gl.constexpr = 576 if FMT == 1 else 512
        if blk < nblk0:
            valid = (idx >= 0) & (idx < c0_slots)
            slot = gl.where(valid, idx, 0)
            page = c0_ptr + (slot // BS0).to(gl.int64) * c0_stride0
            row = page + (slot % BS0) * ROW
            scales = page + BS0 * ROW + (slot % BS0) * 8
        else:
            valid = (idx >= 0) & (idx < c1_slots)
            slot = gl.where(valid, idx, 0)
            page = c1_ptr + (slot // BS1).to(gl.int64) * c1_stride0
            row = page + (slot % BS1) * ROW
            scales = page + BS1 * ROW + (slot % BS1) * 8
        return row, scales, valid

    @gluon.jit
    def _prefetch_block(c0_ptr, c0_stride0, c0_slots, c1_ptr, c1_stride0, c1_slots, idx, blk, nblk0, hi,
                        FMT: gl.constexpr, BS0: gl.constexpr, BS1: gl.constexpr):
        """Ask L2 for the rows of key block ``blk`` (slots ``idx``) a block before they are gathered.

        The gathers of block i+1 are issued during block i and waited for one softmax later, too
        short a time for HBM. A prefetch holds no register and no shared memory. Each of the
        threads that hold a row asks for different 128-byte lines of it (and the line of its scale
        bytes); per-thread ``prefetch.global.L2``, since the bulk prefetch takes one address per warp.
        The row addresses are computed again for the gathers a block later: carried across the loop
        they would be spilled (see the index rows in the kernel).
        """
        row, scales, valid = _block_rows(c0_ptr, c0_stride0, c0_slots, c1_ptr, c1_stride0, c1_slots, idx, blk, nblk0,
                                         FMT, BS0, BS1)
        valid = valid & (blk < hi)
        # (rows, 8 lines); each row's threads (4 for fp8_v4, 8 for bf16) split its lines between them
        if FMT == 1:
            lines_layout: gl.constexpr = gl.BlockedLayout([1, 2], [8, 4], [8, 1], [1, 0])
        else:
            lines_layout: gl.constexpr = gl.BlockedLayout([1, 1], [4, 8], [8, 1], [1, 0])
        line = gl.arange(0, 8, layout=gl.SliceLayout(0, lines_layout))
        rows_l: gl.constexpr = gl.SliceLayout(1, lines_layout)
        row = gl.convert_layout(row, rows_l).to(gl.pointer_type(gl.int8))
        ok = gl.convert_layout(valid, rows_l)
        if FMT == 1:
            # a 576-byte row starts 0 or 64 bytes into a line (pages from ``allocate_cache``: 128-byte
            # aligned, strides a multiple of 576): 5 lines, then the scale bytes' line
            scales = gl.convert_layout(scales, rows_l).to(gl.pointer_type(gl.int8))
            addr = gl.where((line == 5)[None, :], scales[:, None], row[:, None] + (line * 128)[None, :])
            ask = ok[:, None] & (line < 6)[None, :]
        else:
            addr = row[:, None] + (line * 128)[None, :]
            ask = ok[:, None] & (line < 8)[None, :]
        gl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.b32 $0, 0; }",
            "=r,l,r", [addr, ask.to(gl.int32)], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _copy_block(kbuf, row, valid, copy_layout: gl.constexpr):
        """Start asynchronous copies of one bf16 key block into ``kbuf`` ``(BLOCK_N, 512)`` (invalid rows: zeros)."""
        rows = gl.convert_layout(row, gl.SliceLayout(1, copy_layout))
        ok = gl.convert_layout(valid, gl.SliceLayout(1, copy_layout))
        cols = gl.arange(0, DIM, layout=gl.SliceLayout(0, copy_layout))
        async_copy.async_copy_global_to_shared(kbuf, rows[:, None] + cols[None, :], mask=ok[:, None])
        async_copy.commit_group()

    @gluon.jit
    def _gather_half(rows, scales, ok, HALF: gl.constexpr, tiles_layout: gl.constexpr):
        """Raw bytes of dims ``[256·HALF, 256·HALF + 256)`` of the gathered rows: ``(BLOCK_N, 4, 64)`` e4m3
        and ``(BLOCK_N, 4)`` ue8m0 exponents. The last tile of the second half is the bf16 rope, not
        read here. Invalid rows read nothing."""
        tile = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, tiles_layout)))
        col = gl.arange(0, 64, layout=gl.SliceLayout(0, gl.SliceLayout(1, tiles_layout)))
        is_rope = (tile == 3) & (HALF == 1)
        byte_off = (HALF * 4 + tile)[None, :, None] * 64 + col[None, None, :]
        raw = gl.load(rows[:, None, None] + byte_off, mask=ok[:, None, None] & ~is_rope[None, :, None], other=0)
        exps = gl.load(scales[:, None] + HALF * 4 + tile[None, :], mask=ok[:, None] & ~is_rope[None, :], other=127)
        return raw, exps

    @gluon.jit
    def _gather_block(row, scales, valid, tiles_layout: gl.constexpr):
        """Issue every global load of one key block (e4m3 halves, exponents, rope); nothing is converted yet."""
        rows_l: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, tiles_layout))
        rows = gl.convert_layout(row, rows_l)
        ok = gl.convert_layout(valid, rows_l)
        scales = gl.convert_layout(scales, rows_l)
        raw_lo, exps_lo = _gather_half(rows, scales, ok, 0, tiles_layout)
        raw_hi, exps_hi = _gather_half(rows, scales, ok, 1, tiles_layout)
        col = gl.arange(0, 64, layout=gl.SliceLayout(0, gl.SliceLayout(1, tiles_layout)))
        rope_ptr = (rows + NOPE).to(gl.pointer_type(gl.bfloat16))
        rope = gl.load(rope_ptr[:, None, None] + col[None, None, :], mask=ok[:, None, None], other=0.0)
        return raw_lo, exps_lo, raw_hi, exps_hi, rope

    @gluon.jit
    def _dequant(raw, exps):
        """e4m3 bytes times their power-of-two ue8m0 factor: exact in bf16."""
        factor = (exps.to(gl.int32) << 23).to(gl.float32, bitcast=True)  # ue8m0 -> 2^(e-127)
        return raw.to(gl.float8e4nv, bitcast=True).to(gl.float32) * factor[:, :, None]

    @gluon.jit
    def _store_block(kbuf, raw_lo, exps_lo, raw_hi, exps_hi, rope):
        """Write a gathered block dequantised into ``kbuf`` ``(BLOCK_N, 512)`` bf16 (invalid rows: zeros)."""
        tile = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, rope.type.layout)))
        lo = _dequant(raw_lo, exps_lo).to(gl.bfloat16)
        kbuf.slice(0, 256, dim=1).store(gl.reshape(lo, [BLOCK_N, 256]))
        hi = gl.where((tile == 3)[None, :, None], rope, _dequant(raw_hi, exps_hi).to(gl.bfloat16))
        kbuf.slice(256, 256, dim=1).store(gl.reshape(hi, [BLOCK_N, 256]))

    @gluon.jit
    def _epilogue(acc_f, m_i, l_i, o_layout: gl.constexpr, out_ptr, lse_ptr, part_o_ptr, part_lse_ptr, sink_ptr,
                  tok, hb, split, num_tokens, num_heads, HAS_SINK: gl.constexpr, SPLITS: gl.constexpr):
        """Normalise the accumulator and store the row (with the sink) or the split's partial row and LSE."""
        heads = hb * H_BLOCK + gl.arange(0, H_BLOCK, layout=gl.SliceLayout(1, o_layout))
        head_mask = heads < num_heads
        l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
        m_o = gl.convert_layout(m_i, gl.SliceLayout(1, o_layout))
        empty = l_o == 0.0
        inv_l = gl.where(empty, 0.0, 1.0 / gl.where(empty, 1.0, l_o))
        lse = gl.where(empty, float("-inf"), (m_o + gl.log2(gl.where(empty, 1.0, l_o))) / 1.4426950408889634)
        factor = inv_l
        if SPLITS == 1:
            if HAS_SINK:
                sink = gl.load(sink_ptr + heads, mask=head_mask, other=float("-inf"))
                factor = factor / (1.0 + gl.exp(sink - gl.where(empty, 0.0, lse)))
            dst = out_ptr + tok.to(gl.int64) * num_heads * D_OUT
            gl.store(lse_ptr + tok * num_heads + heads, gl.where(empty, float("inf"), lse), mask=head_mask)
        else:
            part = (split * num_tokens + tok).to(gl.int64) * num_heads
            dst = part_o_ptr + part * D_OUT
            gl.store(part_lse_ptr + part + heads, lse, mask=head_mask)
        # the wgmma layout gives each thread pairs of outputs; through shared memory (the dead key
        # buffers) each thread stores 8 consecutive ones instead (coalesced 16-byte stores: -2 to -8 %)
        store_layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [8, 1], [1, 0])
        vals = gl.convert_layout((acc_f * factor[:, None]).to(dst.dtype.element_ty), store_layout)
        heads = gl.convert_layout(heads, gl.SliceLayout(1, store_layout))
        cols = gl.arange(0, DIM, layout=gl.SliceLayout(0, store_layout))
        gl.store(dst + heads[:, None] * D_OUT + cols[None, :], vals, mask=(heads < num_heads)[:, None])

    @gluon.jit
    def _attention_kernel(
        q_ptr, stride_qt, stride_qh,
        out_ptr, lse_ptr, part_o_ptr, part_lse_ptr, sink_ptr,
        c0_ptr, c0_stride0, c0_slots, i0_ptr, i0_stride, l0_ptr, w0,
        c1_ptr, c1_stride0, c1_slots, i1_ptr, i1_stride, l1_ptr, w1,
        num_tokens, num_heads, qk_scale,
        FMT: gl.constexpr, BS0: gl.constexpr, BS1: gl.constexpr, HAS_EXTRA: gl.constexpr, HAS_SINK: gl.constexpr,
        SPLITS: gl.constexpr, PREFETCH: gl.constexpr,
    ):
        RESCALE_SLACK: gl.constexpr = 8.0
        # each warpgroup computes the logits of half the keys (the softmax reduces across the two)
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                          instr_shape=[16, 32, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                          instr_shape=[16, 256, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        # (rows, 4 tiles, 64): a thread holds 16 consecutive bytes of each of 4 tiles of one row
        tiles_layout: gl.constexpr = gl.BlockedLayout([1, 1, 16], [8, 1, 4], [8, 1, 1], [2, 1, 0])
        copy_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])  # (64, 512) bf16, 16 B each
        if FMT == 1:
            rows_layout: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, tiles_layout))
        else:
            rows_layout: gl.constexpr = gl.SliceLayout(1, copy_layout)
        q_layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [8, 1], [1, 0])
        smem_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)

        # a token's head blocks are neighbours in launch order, so they run together and the second
        # one's gathers hit L2
        head_blocks = gl.cdiv(num_heads, H_BLOCK)
        tok = gl.program_id(0) // head_blocks
        hb = gl.program_id(0) % head_blocks
        split = gl.program_id(1)

        q_smem = gl.allocate_shared_memory(gl.bfloat16, [H_BLOCK, DIM], smem_layout)
        k_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, DIM], smem_layout)

        heads_q = hb * H_BLOCK + gl.arange(0, H_BLOCK, layout=gl.SliceLayout(1, q_layout))
        cols_q = gl.arange(0, DIM, layout=gl.SliceLayout(0, q_layout))
        q_tok = q_ptr + tok.to(gl.int64) * stride_qt
        q = gl.load(q_tok + heads_q[:, None] * stride_qh + cols_q[None, :], mask=(heads_q < num_heads)[:, None],
                    other=0.0)
        q_smem.store(q)

        len0 = gl.minimum(gl.maximum(gl.load(l0_ptr + tok), 0), w0)
        nblk0 = gl.cdiv(len0, BLOCK_N)
        len1 = len0 * 0
        if HAS_EXTRA:
            len1 = gl.minimum(gl.maximum(gl.load(l1_ptr + tok), 0), w1)
        nblk1 = gl.cdiv(len1, BLOCK_N)
        per_split = gl.cdiv(nblk0 + nblk1, SPLITS)
        lo = split * per_split
        hi = gl.minimum(lo + per_split, nblk0 + nblk1)
        i0_row = i0_ptr + tok.to(gl.int64) * i0_stride
        i1_row = i1_ptr + tok.to(gl.int64) * i1_stride

        m_i = gl.full([H_BLOCK], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
        l_i = gl.zeros([H_BLOCK], gl.float32, layout=gl.SliceLayout(1, s_layout))
        acc = warpgroup_mma_init(gl.zeros([H_BLOCK, DIM], gl.float32, layout=o_layout))
        s_zero = gl.zeros([H_BLOCK, BLOCK_N], gl.float32, layout=s_layout)

        idx = _block_indices(i0_row, len0, nblk0, i1_row, len1, lo, rows_layout)
        row, scales, valid = _block_rows(c0_ptr, c0_stride0, c0_slots, c1_ptr, c1_stride0, c1_slots, idx, lo, nblk0,
                                         FMT, BS0, BS1)
        # the index list runs one block ahead of the gathers, so no gather waits on an index load
        idx_next = _block_indices(i0_row, len0, nblk0, i1_row, len1, lo + 1, rows_layout)
        if FMT == 1:
            if lo < hi:
                raw_lo, exps_lo, raw_hi, exps_hi, rope = _gather_block(row, scales, valid, tiles_layout)
                if PREFETCH:
                    _prefetch_block(c0_ptr, c0_stride0, c0_slots, c1_ptr, c1_stride0, c1_slots, idx_next, lo + 1,
                                    nblk0, hi, FMT, BS0, BS1)
                _store_block(k_smem.index(0), raw_lo, exps_lo, raw_hi, exps_hi, rope)
        else:
            _copy_block(k_smem.index(0), row, valid, copy_layout)
            if PREFETCH:
                _prefetch_block(c0_ptr, c0_stride0, c0_slots, c1_ptr, c1_stride0, c1_slots, idx_next, lo + 1, nblk0,
                                hi, FMT, BS0, BS1)
            async_copy.wait_group(0)
        valid_cur = gl.convert_layout(valid, gl.SliceLayout(0, s_layout))
        fence_async_shared()
        gl.thread_barrier()

        for blk in range(lo, hi):
            buf = (blk - lo) % 2
            k_cur = k_smem.index(buf)
            qk = warpgroup_mma(q_smem, k_cur.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            # the next block's gathers (past the last block every row is masked off: no memory access)
            row, scales, valid = _block_rows(c0_ptr, c0_stride0, c0_slots, c1_ptr, c1_stride0, c1_slots,
                                             idx_next, blk + 1, nblk0, FMT, BS0, BS1)
            if FMT == 1:
                raw_lo, exps_lo, raw_hi, exps_hi, rope = _gather_block(row, scales, valid, tiles_layout)
            # the index rows' addresses are rebuilt from the token each block (the asm hides that the
            # token is loop-invariant): kept across the loop they were spilled at 255 registers, and
            # Nsight put 18 % of the stall samples on their reloads (-2 to -4 %)
            tok_now = gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [tok], dtype=gl.int32, is_pure=False,
                                                pack=1)
            idx_next = _block_indices(i0_ptr + tok_now.to(gl.int64) * i0_stride, len0, nblk0,
                                      i1_ptr + tok_now.to(gl.int64) * i1_stride, len1, blk + 2, rows_layout)
            valid_next = gl.convert_layout(valid, gl.SliceLayout(0, s_layout))
            s = warpgroup_mma_wait(num_outstanding=0, deps=(qk,))
            acc_now = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            if FMT == 0:  # bf16 rows go straight to shared memory while the softmax and PV run
                gl.thread_barrier()  # both warpgroups are past the previous PV: the other buffer is free
                _copy_block(k_smem.index(1 - buf), row, valid, copy_layout)
            s = gl.where(valid_cur[None, :], s * qk_scale, float("-inf"))
            m_blk = gl.max(s, 1)
            grow = m_blk > m_i + RESCALE_SLACK
            if gl.max(grow.to(gl.int32), 0) > 0:
                m_new = gl.where(grow, m_blk, m_i)
                alpha = gl.where(m_new == m_i, 1.0, gl.exp2(m_i - m_new))
                l_i = l_i * alpha
                acc_now = acc_now * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
                m_i = m_new
            p = gl.exp2(s - gl.where(m_i == float("-inf"), 0.0, m_i)[:, None])
            l_i += gl.sum(p, 1)
            p_op = gl.convert_layout(p.to(gl.bfloat16), p_layout)
            acc = warpgroup_mma(p_op, k_cur, acc_now, is_async=True)
            if PREFETCH:  # block blk+2, gathered in the next block; its indices were loaded before the softmax
                _prefetch_block(c0_ptr, c0_stride0, c0_slots, c1_ptr, c1_stride0, c1_slots, idx_next, blk + 2, nblk0,
                                hi, FMT, BS0, BS1)
            if FMT == 1:
                if blk + 1 < hi:
                    # the gathers had the QK wgmma and the softmax to land; the dequantisation overlaps
                    # this block's PV wgmma. Both warpgroups are past the previous PV (waited above).
                    gl.thread_barrier()
                    _store_block(k_smem.index(1 - buf), raw_lo, exps_lo, raw_hi, exps_hi, rope)
            else:
                async_copy.wait_group(0)
            fence_async_shared()
            gl.thread_barrier()  # every warp's writes to the next buffer land before its QK wgmma
            valid_cur = valid_next
        acc_f = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        # the epilogue's layout change stages rows in shared memory that aliases the key buffers: wait
        # until the other warpgroup's last PV wgmma has read them too
        gl.thread_barrier()

        _epilogue(acc_f, m_i, l_i, o_layout, out_ptr, lse_ptr, part_o_ptr, part_lse_ptr, sink_ptr,
                  tok, hb, split, num_tokens, num_heads, HAS_SINK, SPLITS)


def prefetch_pays(programs: int, sms: int) -> bool:
    """Whether to prefetch key rows into L2 a block ahead: on decode-sized grids (a few waves of programs).

    A decode batch's tokens each read their own request's keys, from HBM: the prefetch hides that
    latency (-6 to -12 % at h_q 64 on an H100). A prefill chunk's tokens share most of their keys,
    which neighbouring programs have already brought into L2: there the prefetch only adds
    instructions (+2 to +12 %). Thousands of programs mean a prefill chunk.
    """
    return programs <= PREFETCH_MAX_WAVES * sms


def launch(programs: int, kernel_args: tuple, fmt: str, constants: dict, prefetch: bool):
    """Run the kernel on ``triton_attention.run``'s argument tuple and shared constants (``BS0``,
    ``BS1``, ``HAS_EXTRA``, ``HAS_SINK``, ``SPLITS``); ``programs`` = tokens × head blocks.

    Returns the compiled kernel (for register reports).
    """
    return _attention_kernel[(programs, constants["SPLITS"])](
        *kernel_args, FMT=1 if fmt == "fp8_v4" else 0, PREFETCH=prefetch, num_warps=NUM_WARPS, **constants)
