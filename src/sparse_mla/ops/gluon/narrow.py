"""Narrow items: fp8 rows of at most 16 heads (tensor-parallel shards, ``host.narrow_heads``): two copy warpgroups
and one math warpgroup.

The math warpgroup (:func:`_narrow_partition`) takes the keys and the output dims as the wgmmas' M and the heads as N
(logits ``(64 keys, 16)`` = K·Qᵀ, output ``(512 dims, 16)`` += Vᵀ·Pᵀ, V read transposed from the key rows), whose
accumulators take 80 registers per thread; that leaves the registers for two copy warpgroups
(:func:`_copy_buffer_partition`), one per buffer, each with two halves in flight (version 15: V3.2 shards 7-12 %
faster, V4's 6 %), which dequantise a half before they wait for its buffer to be free (version 16: V4's 16-head shard
6 % faster, V3.2's level).
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                              warpgroup_mma_wait)

from triton.language.core import _aggregate as aggregate

from .compat import thread_barrier
from .common import (BLOCK_N, DIM, QK_V32, ROPE, WARPS, _block_keys_valid, _load_query, _opaque,
                     _phase, _store_rows)
from .fp8_rows import _gather_half, _store_half, rows_layout


@aggregate
class NarrowShared:
    """The math warpgroup's shared memory besides the key ring: q's rows ``q_smem (1, HEADS_N, DIM)`` (also the
    output's staging), q's rope dims ``qr_smem (HEADS_N, 64)`` at 576-d (else ``p_smem`` again, unused), Pᵀ
    ``p_smem (HEADS_N, 64)``, and its own barrier ``q_free`` (q's buffer free again)."""
    q_smem: gl.shared_memory_descriptor
    qr_smem: gl.shared_memory_descriptor
    p_smem: gl.shared_memory_descriptor
    q_free: gl.shared_memory_descriptor

    @gluon.constexpr_function
    def __init__(self, q_smem, qr_smem, p_smem, q_free):
        self.q_smem = q_smem
        self.qr_smem = qr_smem
        self.p_smem = p_smem
        self.q_free = q_free


@gluon.jit
def _copy_buffer_partition(ring, caches, items, BUF: gl.constexpr):
    """One of two copy warpgroups, each with a buffer of its own: block 2j + ``BUF`` of each pair of each work item
    into buffer ``BUF``, dequantised half by half as :mod:`.wide`'s copy warpgroup does both buffers' (the next
    half's gathers issued before the current half is stored: two halves in flight), each half dequantised before its
    buffer is free (``_store_half``'s ``DEQUANT_FIRST``)."""
    FMT: gl.constexpr = caches.FMT
    words_rows: gl.constexpr = rows_layout(FMT)
    g = 0
    for r in range(items.rounds()):
        item = items.item(r)
        lo = item.lo
        hi = item.hi
        nblk0 = item.nblk0
        pairs = item.pairs()
        idx = item.indices(lo + BUF, words_rows)
        row, scales, valid = caches.rows(idx, lo + BUF, nblk0)
        raw_a, sc_a = _gather_half(row, scales, valid & (lo + BUF < hi), 0, FMT)
        for j in range(pairs):
            blk = lo + 2 * j + BUF
            row, scales, valid = caches.rows(idx, blk, nblk0)
            valid = valid & (blk < hi)
            idx = item.indices(blk + 2, words_rows)
            raw_b, sc_b = _gather_half(row, scales, valid, 1, FMT)
            _store_half(ring, raw_a, sc_a, row, valid, g + j, BUF, 0, FMT, True)
            row2, scales2, valid2 = caches.rows(idx, blk + 2, nblk0)
            raw_a, sc_a = _gather_half(row2, scales2, valid2 & (blk + 2 < hi), 0, FMT)
            _store_half(ring, raw_b, sc_b, row, valid, g + j, BUF, 1, FMT, True)
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
def _narrow_partition(ring, ex, q, outs, caches, items, qk_scale, HEADS_N: gl.constexpr):
    """The one math warpgroup of narrow items (at most ``HEADS_N`` heads, the wgmmas' N), per work item,
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
    q_smem = ex.q_smem
    qr_smem = ex.qr_smem
    p_smem = ex.p_smem
    g = 0
    for r in range(items.rounds()):
        item = items.item(r)
        q_tok = q.q_ptr + item.tok.to(gl.int64) * q.stride_qt
        _load_query(q_smem, ex.q_free, r, q_tok, q.stride_qh, item.hb, items.num_heads)
        if caches.D_QK == QK_V32:
            qr_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [WARPS, 1], [1, 0])
            heads_r = gl.arange(0, HEADS_N, layout=gl.SliceLayout(1, qr_layout))
            cols_r = DIM + gl.arange(0, ROPE, layout=gl.SliceLayout(0, qr_layout))
            qr_smem.store(gl.load(q_tok + heads_r[:, None] * q.stride_qh + cols_r[None, :],
                                  mask=(heads_r < items.num_heads)[:, None], other=0.0))
            fence_async_shared()
            thread_barrier()
        m_i = gl.full([HEADS_N], float("-inf"), gl.float32, layout=heads_layout)
        # each thread's share of the sums of P, reduced over the keys (across the warps) once per item
        l_parts = gl.zeros([BLOCK_N, HEADS_N], gl.float32, layout=nt_layout)
        acc = gl.zeros([DIM, HEADS_N], gl.float32, layout=nt_layout)
        s_zero = gl.zeros([BLOCK_N, HEADS_N], gl.float32, layout=nt_layout)
        pairs = item.pairs()
        for j in range(pairs):
            phase = _phase(g + j)
            for BUF in gl.static_range(2):
                blk = item.lo + 2 * j + BUF
                zero = _opaque(0)
                k_blk = ring.k_smem.index(BUF + zero)
                valid = _block_keys_valid(item, blk, caches, zero, keys_layout)
                mbarrier.wait(ring.ready.index(2 * BUF), phase)
                mbarrier.wait(ring.ready.index(2 * BUF + 1), phase)
                fence_async_shared()  # rows dequantised through the generic proxy feed a wgmma
                s = warpgroup_mma(k_blk, q_smem.index(zero).permute((1, 0)), s_zero, use_acc=False,
                                  is_async=True)
                if caches.D_QK == QK_V32:
                    s = warpgroup_mma(ring.r_smem.index(BUF + zero), qr_smem.permute((1, 0)), s, is_async=True)
                s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))

                s = gl.where(valid[:, None], s * qk_scale, float("-inf"))
                m_new = gl.maximum(m_i, _keys_max(s))
                alpha = gl.where(m_new == m_i, 1.0, gl.exp2(m_i - m_new))
                p = gl.exp2(s - gl.where(m_new == float("-inf"), 0.0, m_new)[None, :])
                l_parts = l_parts * alpha[None, :] + p
                m_i = m_new
                p_smem.store(gl.permute(p.to(gl.bfloat16), (1, 0)))
                fence_async_shared()
                thread_barrier()
                acc = acc * alpha[None, :]
                acc = warpgroup_mma(k_blk.permute((1, 0)), p_smem.permute((1, 0)), acc, is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                thread_barrier()
                mbarrier.arrive(ring.free.index(2 * BUF))
                mbarrier.arrive(ring.free.index(2 * BUF + 1))
        g += pairs
        _store_rows(acc, m_i, gl.sum(l_parts, 0), q_smem, outs, items, item, -1)
        thread_barrier()
        mbarrier.arrive(ex.q_free)  # (its own: the next item's q overwrites the staged output)
