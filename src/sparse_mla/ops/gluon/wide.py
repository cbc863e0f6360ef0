"""64-head items of fp8 rows (decode: bound by the copy warpgroup): its three partitions.

* The copy warpgroup (:func:`_copy_partition`) fills the two key buffers half by half, each half as soon as its last
  reader of the block two back is done: fp8 rows gathered into registers as 32-bit words, then dequantised into the
  half once it is free (:mod:`.fp8_rows`). The loop is software-pipelined so that two halves' gathers are in
  flight: the next half's loads are issued before the current one is dequantised.
* Math warpgroup 0 (:func:`_logits_partition`) loads q into shared memory itself, while the copy warpgroup already
  gathers the first block (version 11: 1-3 % faster), then computes each block's logits over every dim (one N = 64
  wgmma chain from Q in shared memory), its online softmax, and the output dims [0, 256) with P from its registers.
  It hands P (bf16) and the rows' rescale factors to math warpgroup 1 through shared memory.
* Math warpgroup 1 (:func:`_values_partition`) rescales its accumulator and adds P times output dims [256, 512),
  overlapping warpgroup 0's next logits.

The copy warpgroup runs a block ahead of the math, and warpgroup 1 needs no logits or softmax registers, which leaves
the copy warpgroup enough to hold two gathered halves without spilling. (Until version 10 fp8 rows went to the paired
warpgroups of :mod:`.paired`. Both then read both buffers at once, so the copy warpgroup could not run a block ahead,
and fp8_v32's, left 88 registers, spilled: V3.2 decode ran 1.3-1.4x slower. BENCHMARKS.md, version 10.)
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                              warpgroup_mma_wait)

from triton.language.core import _aggregate as aggregate

from .compat import thread_barrier
from .common import (HALF, KEYS_LAYOUT, O_LAYOUT, O_ROWS, P_OPERAND, QK_V32, H_BLOCK, _block_keys_valid,
                     _load_query, _opaque, _rope_query, _softmax_start, _phase, _store_rows, _wait_free)
from .fp8_rows import _gather_half, _store_half, rows_layout


@aggregate
class WideShared:
    """The math warpgroups' shared memory besides the key ring: q's rows ``q_smem (1, 64, DIM)`` (also the output's
    staging), warpgroup 0's P ``p_smem (1, 64, 64)``, the rows' rescale factors ``a_smem (64,)`` for each block and
    their maxima and sums ``m_smem``/``l_smem (64,)`` for the item's output; the barriers: P and the factors
    published (``p_bar``) and read (``p_free``), the maxima and sums published (``l_bar``), q's buffer free
    (``q_free``)."""
    q_smem: gl.shared_memory_descriptor
    p_smem: gl.shared_memory_descriptor
    a_smem: gl.shared_memory_descriptor
    m_smem: gl.shared_memory_descriptor
    l_smem: gl.shared_memory_descriptor
    p_bar: gl.shared_memory_descriptor
    p_free: gl.shared_memory_descriptor
    l_bar: gl.shared_memory_descriptor
    q_free: gl.shared_memory_descriptor

    @gluon.constexpr_function
    def __init__(self, q_smem, p_smem, a_smem, m_smem, l_smem, p_bar, p_free, l_bar, q_free):
        self.q_smem = q_smem
        self.p_smem = p_smem
        self.a_smem = a_smem
        self.m_smem = m_smem
        self.l_smem = l_smem
        self.p_bar = p_bar
        self.p_free = p_free
        self.l_bar = l_bar
        self.q_free = q_free


@gluon.jit
def _copy_partition(ring, caches, items):
    """Gather each pair of key blocks of each of the program's work items into buffers 0 and 1, half by half
    (rows past ``hi`` or invalid: zeros), block after block, as the math warpgroups read them, dequantised. The next
    item's first blocks go in as soon as the math warpgroups free the buffers, while they still store the last
    item's output. The ring's phases count the pairs of every item so far (``g``)."""
    FMT: gl.constexpr = caches.FMT
    words_rows: gl.constexpr = rows_layout(FMT)
    g = 0
    for r in range(items.rounds()):
        item = items.item(r)
        lo = item.lo
        hi = item.hi
        nblk0 = item.nblk0
        pairs = item.pairs()
        # software-pipelined: each half's gathers are issued before the previous half is dequantised, so
        # two halves' loads are in flight (the next pair's indices are loaded one pair ahead for that)
        idx0 = item.indices(lo, words_rows)
        idx1 = item.indices(lo + 1, words_rows)
        row0, scales0, valid0 = caches.rows(idx0, lo, nblk0)
        raw_a, sc_a = _gather_half(row0, scales0, valid0, 0, FMT)
        for j in range(pairs):
            blk0 = lo + 2 * j
            gj = g + j
            # row addresses are recomputed from the carried indices rather than carried (registers)
            row0, scales0, valid0 = caches.rows(idx0, blk0, nblk0)
            row1, scales1, valid1 = caches.rows(idx1, blk0 + 1, nblk0)
            valid1 = valid1 & (blk0 + 1 < hi)
            idx0 = item.indices(blk0 + 2, words_rows)
            idx1 = item.indices(blk0 + 3, words_rows)
            raw_b, sc_b = _gather_half(row0, scales0, valid0, 1, FMT)
            _store_half(ring, raw_a, sc_a, row0, valid0, gj, 0, 0, FMT)
            raw_a, sc_a = _gather_half(row1, scales1, valid1, 0, FMT)
            _store_half(ring, raw_b, sc_b, row0, valid0, gj, 0, 1, FMT)
            raw_b, sc_b = _gather_half(row1, scales1, valid1, 1, FMT)
            _store_half(ring, raw_a, sc_a, row1, valid1, gj, 1, 0, FMT)
            row0, scales0, valid0 = caches.rows(idx0, blk0 + 2, nblk0)
            raw_a, sc_a = _gather_half(row0, scales0, valid0 & (blk0 + 2 < hi), 0, FMT)
            _store_half(ring, raw_b, sc_b, row1, valid1, gj, 1, 1, FMT)
        g += pairs


@gluon.jit
def _copy_runs_partition(ring, caches, items):
    """:func:`_copy_partition` for V4.1's rows, the scopes in one format or two (an fp8 window, an fp4 compressed
    cache): an item's blocks in runs of one format, each software-pipelined as :func:`_copy_run` says; two formats
    make two runs, scope 0's blocks and then scope 1's (and the last pair's block past ``hi``, zeros): gathered words
    of two formats cannot be carried from one run into the next, so the pipeline restarts at the scopes' boundary.
    (With one block's halves, not a pair's, in the loop body, fp8_v41's copy warpgroup does not spill: 28-40 B in
    :func:`_copy_partition`'s pair loop.)"""
    words_rows: gl.constexpr = rows_layout(caches.FMT)  # (fp8_v41's and fp4_v41's words share it)
    g = 0
    for r in range(items.rounds()):
        item = items.item(r)
        end = item.lo + 2 * item.pairs()
        if caches.FMT1 == caches.FMT:
            _copy_run(ring, caches, item, item.lo, end, g, words_rows, caches.FMT)
        else:
            boundary = gl.minimum(gl.maximum(item.nblk0, item.lo), item.hi)  # the item's first block of scope 1
            _copy_run(ring, caches, item, item.lo, boundary, g, words_rows, caches.FMT)
            _copy_run(ring, caches, item, boundary, end, g, words_rows, caches.FMT1)
        g += item.pairs()


@gluon.jit
def _copy_run(ring, caches, item, k0, k1, g, words_rows: gl.constexpr, FMT: gl.constexpr):
    """Blocks ``[k0, k1)`` of ``item``, all of one format ``FMT``, into the ring: block k into buffer ``(k - lo) % 2``
    for pair ``g + (k - lo) // 2`` (rows past ``hi``: zeros), half by half, each half's gathers issued before the
    previous half is dequantised (two halves in flight), as :func:`_copy_partition` does a pair's."""
    lo = item.lo
    hi = item.hi
    nblk0 = item.nblk0
    idx = item.indices(k0, words_rows)
    row, scales, valid = caches.rows(idx, k0, nblk0)
    raw_a, sc_a = _gather_half(row, scales, valid & (k0 < hi) & (k0 < k1), 0, FMT)
    for k in range(k0, k1):
        row, scales, valid = caches.rows(idx, k, nblk0)
        valid = valid & (k < hi)
        idx = item.indices(k + 1, words_rows)
        raw_b, sc_b = _gather_half(row, scales, valid, 1, FMT)
        j = g + (k - lo) // 2
        odd = (k - lo) % 2
        _store_in(ring, raw_a, sc_a, row, valid, j, odd, 0, FMT)
        row_next, scales_next, valid_next = caches.rows(idx, k + 1, nblk0)
        raw_a, sc_a = _gather_half(row_next, scales_next, valid_next & (k + 1 < hi) & (k + 1 < k1), 0, FMT)
        _store_in(ring, raw_b, sc_b, row, valid, j, odd, 1, FMT)


@gluon.jit
def _store_in(ring, raw, scales, rows, ok, j, odd, SIDE: gl.constexpr, FMT: gl.constexpr):
    """:func:`.fp8_rows._store_half` into buffer ``odd`` (0 or 1, known at run time)."""
    if odd == 0:
        _store_half(ring, raw, scales, rows, ok, j, 0, SIDE, FMT)
    else:
        _store_half(ring, raw, scales, rows, ok, j, 1, SIDE, FMT)


@gluon.jit
def _logits_partition(ring, ex, q, outs, caches, items, qk_scale):
    """Math warpgroup 0, per work item: loads its q, then each block's logits over every dim and its softmax;
    hands P and the rows' rescale factors to warpgroup 1 (``p_smem``, ``a_smem``), then multiplies P (from
    registers) by output dims [0, 256) of the block's values. 576-d (V3.2): the logits add q's rope dims (held in
    registers) times ``r_smem``'s."""
    q_smem = ex.q_smem
    p_smem = ex.p_smem
    g = 0  # key-block pairs of the items before: the uses of the ring's and the hand-over's barriers
    for r in range(items.rounds()):
        item = items.item(r)
        q_tok = q.q_ptr + item.tok.to(gl.int64) * q.stride_qt
        _load_query(q_smem, ex.q_free, r, q_tok, q.stride_qh, item.hb, items.num_heads)  # as the copy wg gathers
        m_i, l_i, acc, s_zero = _softmax_start()
        if caches.D_QK == QK_V32:
            q_rope = _rope_query(q_tok, q.stride_qh, item.hb, items.num_heads)
        pairs = item.pairs()
        for j in range(pairs):
            phase = _phase(g + j)
            for BUF in gl.static_range(2):  # the pair's blocks, one after the other
                blk = item.lo + 2 * j + BUF
                n = 2 * (g + j) + BUF  # blocks handed to warpgroup 1 before this one
                # the index rows' addresses and the wgmma operands' shared-memory descriptors are rebuilt each
                # block from an opaque zero: hoisted out of the loop, they were spilled
                zero = _opaque(0)
                q_all = q_smem.index(zero)
                k_blk = ring.k_smem.index(BUF + zero)
                valid = _block_keys_valid(item, blk, caches, zero, KEYS_LAYOUT)
                # both halves first: the copy warpgroup works a block ahead, and a barrier wait between two
                # wgmmas made ptxas move the logits' registers around it (spills)
                mbarrier.wait(ring.ready.index(2 * BUF), phase)
                mbarrier.wait(ring.ready.index(2 * BUF + 1), phase)
                fence_async_shared()  # rows copied through the generic proxy feed a wgmma
                s = warpgroup_mma(q_all.slice(0, HALF, dim=1), k_blk.slice(0, HALF, dim=1).permute((1, 0)),
                                  s_zero, use_acc=False, is_async=True)
                s = warpgroup_mma(q_all.slice(HALF, HALF, dim=1), k_blk.slice(HALF, HALF, dim=1).permute((1, 0)),
                                  s, is_async=True)
                if caches.D_QK == QK_V32:  # the rope dims arrived with half 1
                    s = warpgroup_mma(q_rope, ring.r_smem.index(BUF + zero).permute((1, 0)), s, is_async=True)
                s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))

                s = gl.where(valid[None, :], s * qk_scale, float("-inf"))
                m_new = gl.maximum(m_i, gl.max(s, 1))
                alpha = gl.where(m_new == m_i, 1.0, gl.exp2(m_i - m_new))
                p = gl.exp2(s - gl.where(m_new == float("-inf"), 0.0, m_new)[:, None])
                l_i = l_i * alpha + gl.sum(p, 1)
                m_i = m_new
                p16 = p.to(gl.bfloat16)
                # hand over once warpgroup 1 has read the previous block's P and factors
                _wait_free(ex.p_free, n)
                p_smem.index(zero).store(p16)
                ex.a_smem.store(alpha)
                fence_async_shared()
                thread_barrier()
                mbarrier.arrive(ex.p_bar)
                acc = acc * gl.convert_layout(alpha, O_ROWS)[:, None]
                acc = warpgroup_mma(gl.convert_layout(p16, P_OPERAND), k_blk.slice(0, HALF, dim=1), acc,
                                    is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                thread_barrier()
                mbarrier.arrive(ring.free.index(2 * BUF))  # half 0: its last reader was this P·V
        g += pairs

        # (warpgroup 1 read the last item's m and l before it freed q's buffer)
        ex.m_smem.store(m_i)
        ex.l_smem.store(l_i)
        thread_barrier()
        mbarrier.arrive(ex.l_bar)
        _store_rows(acc, m_i, l_i, q_smem, outs, items, item, 0)


@gluon.jit
def _values_partition(ring, ex, outs, items):
    """Math warpgroup 1, per work item: output dims [256, 512), from warpgroup 0's P (``p_smem``) and rescale
    factors; frees q's buffer once its output has left it."""
    g = 0
    for r in range(items.rounds()):
        item = items.item(r)
        acc = gl.zeros([H_BLOCK, HALF], gl.float32, layout=O_LAYOUT)
        pairs = item.pairs()
        for j in range(pairs):
            for BUF in gl.static_range(2):
                n = 2 * (g + j) + BUF
                zero = _opaque(0)
                mbarrier.wait(ex.p_bar, _phase(n))
                # the block's rows were fenced for the async proxy by warpgroup 0 before it published P
                acc = acc * ex.a_smem.load(O_ROWS)[:, None]
                acc = warpgroup_mma(ex.p_smem.index(zero), ring.k_smem.index(BUF + zero).slice(HALF, HALF, dim=1),
                                    acc, is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                thread_barrier()
                mbarrier.arrive(ring.free.index(2 * BUF + 1))  # half 1: its last reader was this P·V
                mbarrier.arrive(ex.p_free)
        g += pairs

        mbarrier.wait(ex.l_bar, _phase(r))
        _store_rows(acc, ex.m_smem.load(O_ROWS), ex.l_smem.load(O_ROWS), ex.q_smem, outs, items,
                    item, 1)
        thread_barrier()
        mbarrier.arrive(ex.q_free)
