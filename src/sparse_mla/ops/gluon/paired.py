"""64-head items of bf16 rows (workspace prefill, bf16 caches: bound by the math): the copy warpgroup and the two
paired math warpgroups.

* The copy warpgroup (:func:`_paired_copy_partition`) fills the two key buffers half by half with ``cp.async``,
  each half as soon as its last reader of the pair before is done; the copies signal the half ready as they land.
* The two math warpgroups (:func:`_paired_partition`) are paired: warpgroup w computes the logits of block 2j + w of
  each pair and owns output dims [256·w, 256·w + 256); they trade row maxima and P through shared memory, so both
  issue logits wgmmas and one's softmax overlaps the other's wgmmas. (bf16 rows through :mod:`.wide`'s layout ran up
  to 33 % slower, BENCHMARKS.md, version 10.)

576-d (V3.2) rows: the 64 rope dims of the keys go with the second half into a buffer of their own (``r_smem``), and
the query's rope dims stay in registers (the A operand of one more wgmma per block): 576-d blocks take 226.1 KiB of
shared memory, of the 227 KiB an H100 block may.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                              warpgroup_mma_wait)

from triton.language.core import _aggregate as aggregate

from .compat import async_load, thread_barrier
from .common import (DIM, HALF, KEYS_LAYOUT, O_ROWS, P_OPERAND, QK_V32, ROWS_LAYOUT, WARPS, _block_keys_valid,
                     _copy_rope, _load_query, _opaque, _phase, _rope_query, _softmax_start, _store_rows,
                     _wait_free)


@aggregate
class PairedShared:
    """The math warpgroups' shared memory besides the key ring: q's rows ``q_smem (1, 64, DIM)`` (also the output's
    staging), each warpgroup's P ``p_smem (2, 64, 64)``, maxima ``m_smem (2, 64)`` (0's, then the pair's) and sums
    ``l_smem (2, 64)``; the barriers: the maxima published (``m_bar``, one a direction), each warpgroup's P published
    (``p_bar``), both sums published (``l_bar``), q's buffer free (``q_free``) and q loaded (``q_ready``)."""
    q_smem: gl.shared_memory_descriptor
    p_smem: gl.shared_memory_descriptor
    m_smem: gl.shared_memory_descriptor
    l_smem: gl.shared_memory_descriptor
    m_bar: gl.shared_memory_descriptor
    p_bar: gl.shared_memory_descriptor
    l_bar: gl.shared_memory_descriptor
    q_free: gl.shared_memory_descriptor
    q_ready: gl.shared_memory_descriptor

    @gluon.constexpr_function
    def __init__(self, q_smem, p_smem, m_smem, l_smem, m_bar, p_bar, l_bar, q_free, q_ready):
        self.q_smem = q_smem
        self.p_smem = p_smem
        self.m_smem = m_smem
        self.l_smem = l_smem
        self.m_bar = m_bar
        self.p_bar = p_bar
        self.l_bar = l_bar
        self.q_free = q_free
        self.q_ready = q_ready


@gluon.jit
def _copy_half(ring, row, valid, cols, j, BUF: gl.constexpr, SIDE: gl.constexpr, D_QK: gl.constexpr):
    """Copy dims [256·SIDE, 256·SIDE + 256) of pair j's block (bf16 rows) into buffer ``BUF`` once its readers
    of pair j-1 are done, and with the second half a 576-d row's rope into ``r_smem``; the copies arrive on
    the half's ``ready`` barrier as they land."""
    bar: gl.constexpr = 2 * BUF + SIDE
    _wait_free(ring.free.index(bar), j)
    async_load(ring.k_smem.index(BUF).slice(SIDE * HALF, HALF, dim=1),
                                           row[:, None] + (SIDE * HALF + cols)[None, :], mask=valid[:, None])
    if (SIDE == 1) & (D_QK == QK_V32):
        _copy_rope(ring.r_smem.index(BUF), row, valid, DIM)
    async_copy.mbarrier_arrive(ring.ready.index(bar), increment_count=False)


@gluon.jit
def _paired_copy_partition(ring, caches, items):
    """Copy each pair of key blocks of each of the program's work items into buffers 0 and 1, half by half (rows
    past ``hi`` or invalid: zeros), in the order the paired warpgroups read them. The next item's first blocks go in
    as soon as the math warpgroups free the buffers, while they still store the last item's output. The ring's
    phases count the pairs of every item so far (``g``)."""
    copy_layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [WARPS, 1], [1, 0])  # (64, 256), 16 B each
    copy_rows: gl.constexpr = gl.SliceLayout(1, copy_layout)
    D_QK: gl.constexpr = caches.D_QK
    g = 0
    for r in range(items.rounds()):
        item = items.item(r)
        pairs = item.pairs()
        cols = gl.arange(0, HALF, layout=gl.SliceLayout(0, copy_layout))
        for j in range(pairs):
            blk0 = item.lo + 2 * j
            gj = g + j
            idx0 = item.indices(blk0, copy_rows)
            idx1 = item.indices(blk0 + 1, copy_rows)
            row0, _, valid0 = caches.rows(idx0, blk0, item.nblk0)
            row1, _, valid1 = caches.rows(idx1, blk0 + 1, item.nblk0)
            valid1 = valid1 & (blk0 + 1 < item.hi)
            # in the paired warpgroups' order
            _copy_half(ring, row0, valid0, cols, gj, 0, 0, D_QK)
            _copy_half(ring, row1, valid1, cols, gj, 1, 1, D_QK)
            _copy_half(ring, row0, valid0, cols, gj, 0, 1, D_QK)
            _copy_half(ring, row1, valid1, cols, gj, 1, 0, D_QK)
        g += pairs


@gluon.jit
def _paired_partition(ring, ex, q, outs, caches, items, qk_scale, WG: gl.constexpr):
    """Math warpgroup ``WG``, per work item: the logits of block 2j+WG of each pair, output dims
    [256·WG, 256·WG + 256). The warpgroups trade their row maxima (``m_smem``: 0's to 1, the pair's back to 0,
    so both compute P on the pair's maximum; until version 13 warpgroup 0 computed P on its own and rescaled P
    and its accumulator afterwards, 1-3 % slower) and each publishes its P for the other; each multiplies its
    own P (from registers), then the other's (from ``p_smem``), by its half of the two blocks' values, so one's
    softmax overlaps the other's wgmmas. Warpgroup 0 loads each item's q
    (``q_ready``) once warpgroup 1's output of the item before has left q's buffer (``q_free``). 576-d (V3.2):
    the scores add q's rope dims (held in registers) times ``r_smem``'s."""
    OTHER: gl.constexpr = 1 - WG
    q_smem = ex.q_smem
    m_smem = ex.m_smem
    g = 0  # key-block pairs of the items before: the uses of the ring's and the maxima's barriers
    for r in range(items.rounds()):
        item = items.item(r)
        q_tok = q.q_ptr + item.tok.to(gl.int64) * q.stride_qt
        if WG == 0:
            _load_query(q_smem, ex.q_free, r, q_tok, q.stride_qh, item.hb, items.num_heads)
            mbarrier.arrive(ex.q_ready)
        else:
            mbarrier.wait(ex.q_ready, _phase(r))
        m_i, l_i, acc, s_zero = _softmax_start()
        if caches.D_QK == QK_V32:
            q_rope = _rope_query(q_tok, q.stride_qh, item.hb, items.num_heads)
        pairs = item.pairs()
        for j in range(pairs):
            phase = _phase(g + j)
            blk = item.lo + 2 * j + WG
            # the index rows' addresses and the wgmma operands' shared-memory descriptors are rebuilt each
            # pair from an opaque zero: hoisted out of the loop, they were spilled
            zero = _opaque(0)
            q_all = q_smem.index(zero)
            k_own = ring.k_smem.index(WG + zero)
            k_other = ring.k_smem.index(OTHER + zero)
            valid = _block_keys_valid(item, blk, caches, zero, KEYS_LAYOUT)
            # the logits, over the half this warpgroup's PV reads first, then the other half
            mbarrier.wait(ring.ready.index(2 * WG + WG), phase)
            fence_async_shared()  # rows copied through the generic proxy feed a wgmma
            s = warpgroup_mma(q_all.slice(WG * HALF, HALF, dim=1),
                              k_own.slice(WG * HALF, HALF, dim=1).permute((1, 0)), s_zero, use_acc=False,
                              is_async=True)
            mbarrier.wait(ring.ready.index(2 * WG + OTHER), phase)
            fence_async_shared()
            s = warpgroup_mma(q_all.slice(OTHER * HALF, HALF, dim=1),
                              k_own.slice(OTHER * HALF, HALF, dim=1).permute((1, 0)), s, is_async=True)
            if caches.D_QK == QK_V32:  # the rope dims arrived with half 1
                s = warpgroup_mma(q_rope, ring.r_smem.index(WG + zero).permute((1, 0)), s, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))

            s = gl.where(valid[None, :], s * qk_scale, float("-inf"))
            m_prev = m_i
            if WG == 1:  # start from warpgroup 0's maximum of this pair
                mbarrier.wait(ex.m_bar.index(0), phase)
                m_prev = m_smem.index(0).load(ROWS_LAYOUT)
            m_new = gl.maximum(m_prev, gl.max(s, 1))
            if WG == 0:  # hand its maximum to warpgroup 1, take back the pair's
                m_smem.index(0).store(m_new)
                thread_barrier()
                mbarrier.arrive(ex.m_bar.index(0))
                mbarrier.wait(ex.m_bar.index(1), phase)
                m_new = m_smem.index(1).load(ROWS_LAYOUT)
            alpha = gl.where(m_new == m_i, 1.0, gl.exp2(m_i - m_new))
            acc = acc * gl.convert_layout(alpha, O_ROWS)[:, None]
            l_i = l_i * alpha
            m_i = m_new
            p = gl.exp2(s - gl.where(m_new == float("-inf"), 0.0, m_new)[:, None])
            l_i += gl.sum(p, 1)
            if WG == 1:
                m_smem.index(1).store(m_new)
                thread_barrier()
                mbarrier.arrive(ex.m_bar.index(1))
            p16 = p.to(gl.bfloat16)
            acc = warpgroup_mma(gl.convert_layout(p16, P_OPERAND), k_own.slice(WG * HALF, HALF, dim=1), acc,
                                is_async=True)
            if WG == 0:
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                thread_barrier()
                mbarrier.arrive(ring.free.index(0))  # half 0L: its last reader was this PV
            ex.p_smem.index(WG).store(p16)
            fence_async_shared()
            thread_barrier()
            mbarrier.arrive(ex.p_bar.index(WG))
            # the other block's half: its rows (cp.async) were fenced for the async proxy by the warpgroup that
            # owns the block, before it published its P
            mbarrier.wait(ex.p_bar.index(OTHER), phase)
            acc = warpgroup_mma(ex.p_smem.index(OTHER + zero), k_other.slice(WG * HALF, HALF, dim=1), acc,
                                is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            thread_barrier()
            mbarrier.arrive(ring.free.index(2 * OTHER + WG))  # this warpgroup's half of the other block
            if WG == 1:
                mbarrier.arrive(ring.free.index(2 * WG + WG))  # half 1R, read by this warpgroup alone

        # both sums are relative to the pair's common maximum; add them up
        ex.l_smem.index(WG).store(l_i)
        thread_barrier()
        mbarrier.arrive(ex.l_bar)
        mbarrier.wait(ex.l_bar, _phase(r))
        l_all = ex.l_smem.index(0).load(ROWS_LAYOUT) + ex.l_smem.index(1).load(ROWS_LAYOUT)
        _store_rows(acc, m_i, l_all, q_smem, outs, items, item, WG)
        g += pairs
        if WG == 1:
            thread_barrier()
            mbarrier.arrive(ex.q_free)
