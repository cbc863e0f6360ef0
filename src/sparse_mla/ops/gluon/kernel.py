"""The Gluon kernel's entry point: ``_attention_kernel`` allocates the shared buffers and barriers, bundles its
arguments (:mod:`.common`) and forks into the partitions of its variant: :mod:`.wide` (fp8 rows, 64 heads),
:mod:`.paired` (bf16 rows) or :mod:`.narrow` (fp8 rows of at most 16 heads)."""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from .compat import thread_barrier
from .common import (BF16, BLOCK_N, DIM, FP8_V4, FP8_V32, H_BLOCK, QK_V32, ROPE, WARPS, Caches, KeyRing, Outputs,
                     Query, WorkItems, is_fp4, is_v41, rope_copied)
from .host import LOGITS_REGS, NARROW_COPY_REGS, NARROW_MATH_REGS, PAIRED_REGS, VALUES_REGS
from .narrow import NarrowShared, _copy_buffer_partition, _narrow_partition
from .paired import PairedShared, _paired_copy_partition, _paired_partition
from .wide import WideShared, _copy_partition, _copy_runs_partition, _logits_partition, _values_partition

PAIRED_REGS_BF16 = gl.constexpr(PAIRED_REGS)
LOGITS_REGS_V4 = gl.constexpr(LOGITS_REGS["fp8_v4"])
LOGITS_REGS_V32 = gl.constexpr(LOGITS_REGS["fp8_v32"])
VALUES_WG_REGS = gl.constexpr(VALUES_REGS)
NARROW_COPY_WG_REGS = gl.constexpr(NARROW_COPY_REGS)
NARROW_MATH_WG_REGS = gl.constexpr(NARROW_MATH_REGS)


@gluon.jit
def _attention_kernel(
    q_ptr, stride_qt, stride_qh,
    out_ptr, lse_ptr, part_o_ptr, part_lse_ptr, sink_ptr, order_ptr,
    c0_ptr, c0_stride0, c0_slots, i0_ptr, i0_stride, l0_ptr, w0,
    c1_ptr, c1_stride0, c1_slots, i1_ptr, i1_stride, l1_ptr, w1,
    num_tokens, num_heads, tokens_per_len, qk_scale, tail,
    FMT: gl.constexpr, FMT1: gl.constexpr, BS0: gl.constexpr, BS1: gl.constexpr, HAS_EXTRA: gl.constexpr,
    HAS_SINK: gl.constexpr,
    HAS_ORDER: gl.constexpr, SPLITS: gl.constexpr, SPLIT_BLOCKS: gl.constexpr, D_QK: gl.constexpr,
    PERSISTENT: gl.constexpr = False, TAIL: gl.constexpr = False, HEADS_N: gl.constexpr = 0,
):
    # the copy side branches on FMT, the buffers and the math side on D_QK: only these pairs agree
    gl.static_assert((FMT == BF16) & ((D_QK == DIM) | (D_QK == QK_V32))
                     | ((FMT == FP8_V4) | is_v41(FMT) | is_fp4(FMT)) & (D_QK == DIM)
                     | (FMT == FP8_V32) & (D_QK == QK_V32),
                     "FMT and D_QK must be bf16 (512 or 576), fp8_v4 or a V4.1 format (512) or fp8_v32 (576)")
    # scope 1 in another format than scope 0: V4.1's fp8 and fp4 rows (no rope copies), as 64-head items
    MIXED: gl.constexpr = FMT1 != FMT
    gl.static_assert((not MIXED) or (is_v41(FMT) | is_fp4(FMT)) & (is_v41(FMT1) | is_fp4(FMT1)) & (HEADS_N == 0),
                     "scopes of two formats: V4.1's (fp8_v41, fp4_v41, either layout), as 64-head items")
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
        elif (b % 2 == 0) | (not rope_copied(FMT)):
            mbarrier.init(ready.index(b), count=1)  # the copy warpgroup, after its shared-memory stores
        else:
            mbarrier.init(ready.index(b), count=1 + WARPS * 32)  # and each thread's rope cp.async (fp8_v4, v32)
        mbarrier.init(free.index(b), count=1)
    for b in gl.static_range(2):
        mbarrier.init(m_bar.index(b), count=1)
        mbarrier.init(p_bar.index(b), count=1)
    mbarrier.init(p_free, count=1)
    mbarrier.init(l_bar, count=2 if PAIRED else 1)
    mbarrier.init(q_free, count=1)
    mbarrier.init(q_ready, count=1)
    thread_barrier()

    ring = KeyRing(k_smem, r_smem, ready, free)
    q = Query(q_ptr, stride_qt, stride_qh)
    outs = Outputs(out_ptr, lse_ptr, part_o_ptr, part_lse_ptr, sink_ptr, HAS_SINK, PARTIAL)
    caches = Caches(c0_ptr, c0_stride0, c0_slots, c1_ptr, c1_stride0, c1_slots, FMT, FMT1, BS0, BS1, D_QK)
    items = WorkItems(order_ptr, l0_ptr, w0, i0_ptr, i0_stride, l1_ptr, w1, i1_ptr, i1_stride, num_tokens, num_heads,
                      tokens_per_len, tail, HAS_ORDER, HAS_EXTRA, SPLITS, SPLIT_BLOCKS, TAIL, PERSISTENT)
    # (the partition lists are spelled out: a JIT function cannot be held in a variable)
    if NARROW:
        ex = NarrowShared(q_smem, qr_smem, p_smem, q_free)
        gl.warp_specialize([
            (_copy_buffer_partition, (ring, caches, items, 0)),
            (_copy_buffer_partition, (ring, caches, items, 1)),
            (_narrow_partition, (ring, ex, q, outs, caches, items, qk_scale, HEADS_N)),
        ], [WARPS, WARPS], [NARROW_COPY_WG_REGS, NARROW_MATH_WG_REGS])
    elif PAIRED:
        ex = PairedShared(q_smem, p_smem, m_smem, l_smem, m_bar, p_bar, l_bar, q_free, q_ready)
        gl.warp_specialize([
            (_paired_copy_partition, (ring, caches, items)),
            (_paired_partition, (ring, ex, q, outs, caches, items, qk_scale, 0)),
            (_paired_partition, (ring, ex, q, outs, caches, items, qk_scale, 1)),
        ], [WARPS, WARPS], [PAIRED_REGS_BF16, PAIRED_REGS_BF16])
    elif is_v41(FMT) | is_fp4(FMT):  # V4.1's rows, in one format or two: block by block (``wide._copy_run``)
        ex = WideShared(q_smem, p_smem, a_smem, m_smem.index(0), l_smem.index(0), p_bar.index(0), p_free, l_bar, q_free)
        gl.warp_specialize([
            (_copy_runs_partition, (ring, caches, items)),
            (_logits_partition, (ring, ex, q, outs, caches, items, qk_scale)),
            (_values_partition, (ring, ex, outs, items)),
        ], [WARPS, WARPS], [LOGITS_REGS_V4, VALUES_WG_REGS])
    else:
        logits_regs: gl.constexpr = LOGITS_REGS_V32 if FMT == FP8_V32 else LOGITS_REGS_V4  # (V4.1: 512-d too)
        # (warpgroup 0's maxima and sums and its P's barrier: the first of the paired warpgroups')
        ex = WideShared(q_smem, p_smem, a_smem, m_smem.index(0), l_smem.index(0), p_bar.index(0), p_free, l_bar, q_free)
        gl.warp_specialize([
            (_copy_partition, (ring, caches, items)),
            (_logits_partition, (ring, ex, q, outs, caches, items, qk_scale)),
            (_values_partition, (ring, ex, outs, items)),
        ], [WARPS, WARPS], [logits_regs, VALUES_WG_REGS])
