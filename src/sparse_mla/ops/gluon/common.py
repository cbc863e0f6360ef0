"""What every variant of the Gluon kernel shares: its compile-time constants and wgmma layouts, the argument bundles
its warpgroups take (``gl.aggregate``, in Triton 3.6 ``triton.language.core._aggregate``), the barrier phases, the
work items (:class:`WorkItems`), the key blocks' indices, rows and validity, q's loads and the output stores.

Argument bundles: ``gl.warp_specialize`` flattens each partition's arguments into the warp-specialised region's
captures and rebuilds them inside, the bundles' constexpr fields included (unlike a tuple variable, whose constexprs
would become tensors); captures a partition does not read are dropped. A runtime scalar field is typed
:data:`Scalar`: Triton passes an integer argument equal to 1 (and a ``None`` pointer) as a constexpr.
"""
# (no ``from __future__ import annotations``: Triton 3.6's aggregates check their fields against the annotations'
# values)
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier
from triton.language.core import _aggregate as aggregate

from ...formats import (FMT_BF16, FMT_FP4_V41, FMT_FP4_V41_PLANAR, FMT_FP8_V4, FMT_FP8_V32, FMT_FP8_V41,
                        FMT_FP8_V41_PLANAR, PAGE_TABLE as PAGE_ROWS, ROPE_DIM, V4_DIM, V4_NOPE_DIM, V32_DIM)
from .. import validate
from ..validate import D_V
from .compat import async_load, thread_barrier
from .host import HEADS_PER_PROGRAM, KEYS_PER_BLOCK, PARTITION_WARPS

H_BLOCK = gl.constexpr(HEADS_PER_PROGRAM)
BLOCK_N = gl.constexpr(KEYS_PER_BLOCK)
NOPE = gl.constexpr(V4_NOPE_DIM)  # e4m3 dims of a V4 row; the other 64 are bf16 rope
DIM = gl.constexpr(V4_DIM)  # the width of the q / key rows in shared memory: V4's whole latent, V3.2's V part
ROPE = gl.constexpr(ROPE_DIM)
QK_V32 = gl.constexpr(V32_DIM)  # V3.2's scores also read 64 rope dims past DIM, kept apart (r_smem)
BF16 = gl.constexpr(FMT_BF16)
FP8_V4 = gl.constexpr(FMT_FP8_V4)
FP8_V32 = gl.constexpr(FMT_FP8_V32)
FP8_V41 = gl.constexpr(FMT_FP8_V41)  # V4.1's 528-byte rows, token-interleaved pages
FP8_V41_PLANAR = gl.constexpr(FMT_FP8_V41_PLANAR)  # the same rows, page-planar
FP4_V41 = gl.constexpr(FMT_FP4_V41)  # V4.1's 288-byte rows, token-interleaved pages
FP4_V41_PLANAR = gl.constexpr(FMT_FP4_V41_PLANAR)
D_OUT = gl.constexpr(D_V)
LOG2E = gl.constexpr(validate.LOG2E)  # the softmax is in base 2: the LSE is divided back by it
HALF = gl.constexpr(256)
WARPS = gl.constexpr(PARTITION_WARPS)
# the wgmma accumulators of a math warpgroup: logits (64 heads × 64 keys) and output (64 heads × 256 dims)
S_LAYOUT = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[PARTITION_WARPS, 1],
                                                  instr_shape=[16, 64, 16]))
O_LAYOUT = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[PARTITION_WARPS, 1],
                                                  instr_shape=[16, 256, 16]))
P_OPERAND = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=O_LAYOUT, k_width=2))  # P, from registers
KEYS_LAYOUT = gl.constexpr(gl.SliceLayout(0, S_LAYOUT))
ROWS_LAYOUT = gl.constexpr(gl.SliceLayout(1, S_LAYOUT))
O_ROWS = gl.constexpr(gl.SliceLayout(1, O_LAYOUT))

Scalar = gl.tensor | gl.constexpr  # a runtime scalar argument, or the constexpr Triton made of it


@gluon.constexpr_function
def is_v41(fmt):
    """Whether kernel format code ``fmt`` is V4.1's fp8 rows (either page layout): 512 e4m3 dims, 16 ue8m0 scales,
    no bf16 rope."""
    return fmt == FMT_FP8_V41 or fmt == FMT_FP8_V41_PLANAR


@gluon.constexpr_function
def is_fp4(fmt):
    """Whether kernel format code ``fmt`` is V4.1's fp4 rows (either page layout): 512 e2m1 dims, 32 e4m3 scales."""
    return fmt == FMT_FP4_V41 or fmt == FMT_FP4_V41_PLANAR


@gluon.constexpr_function
def rope_copied(fmt):
    """Whether rows of ``fmt`` keep bf16 rope dims, which the copy warpgroup moves by ``cp.async`` (fp8_v4,
    fp8_v32; V4.1's rows quantise every dim)."""
    return fmt == FMT_FP8_V4 or fmt == FMT_FP8_V32


# where a token's body and scales sit in its page, by format code: ``formats.PAGE_TABLE`` (held as a constexpr: a JIT
# function's globals may not be plain objects)
PAGE_TABLE = gl.constexpr(PAGE_ROWS)


@gluon.constexpr_function
def _body_stride(fmt):
    return PAGE_TABLE.value[fmt][0]


@gluon.constexpr_function
def _scales_base(fmt, block_size):
    return PAGE_TABLE.value[fmt][1] + block_size * PAGE_TABLE.value[fmt][2]


@gluon.constexpr_function
def _scales_stride(fmt):
    return PAGE_TABLE.value[fmt][3]


@gluon.constexpr_function
def _field(value):
    """A bundle's field from a constructor argument (``gluon.constexpr_function`` unwraps constexprs)."""
    return value if isinstance(value, gl.base_value) else gl.constexpr(value)


@gluon.jit
def _opaque(x):
    """``x`` (int32), through an asm move LLVM cannot see through: what is computed from it inside a
    loop stays there instead of being hoisted (and spilled) across the loop."""
    return gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=gl.int32, is_pure=False, pack=1)


# Barrier phases. An mbarrier completes its phases in turn, one per use of what it guards (a buffer filled, a value
# published), counted from 0 here; a wait names the phase it waits for.
@gluon.jit
def _phase(k):
    """The phase whose completion ends use ``k`` of what a barrier signals: ``mbarrier.wait(bar, _phase(k))`` waits
    for use ``k``."""
    return k & 1


@gluon.jit
def _wait_free(bar, k):
    """Before use ``k`` of a buffer whose readers release it on ``bar``, wait until they have released use ``k - 1``
    (use 0 finds it free)."""
    mbarrier.wait(bar, _phase(k) ^ 1, pred=k >= 1)


@aggregate
class KeyRing:
    """The two key buffers and their barriers: ``k_smem (2, BLOCK_N, DIM)`` bf16 rows, ``r_smem (2, BLOCK_N, 64)``
    the keys' rope dims at 576-d (else ``k_smem`` again, unused), and ``ready``/``free``, indexed
    ``2·buffer + half`` (a half: 256 dims of a buffer's rows), whose uses count the pairs of key blocks."""
    k_smem: gl.shared_memory_descriptor
    r_smem: gl.shared_memory_descriptor
    ready: gl.shared_memory_descriptor
    free: gl.shared_memory_descriptor

    @gluon.constexpr_function
    def __init__(self, k_smem, r_smem, ready, free):
        self.k_smem = k_smem
        self.r_smem = r_smem
        self.ready = ready
        self.free = free


@aggregate
class Query:
    """q ``(tokens, heads, D_QK)`` bf16 and its token and head strides."""
    q_ptr: Scalar
    stride_qt: Scalar
    stride_qh: Scalar

    @gluon.constexpr_function
    def __init__(self, q_ptr, stride_qt, stride_qh):
        self.q_ptr = _field(q_ptr)
        self.stride_qt = _field(stride_qt)
        self.stride_qh = _field(stride_qh)


@aggregate
class Outputs:
    """Where the rows go: ``out``/``lse`` (a whole list's rows, with the sink when ``HAS_SINK``) or a split's partial
    rows ``part_o``/``part_lse`` (``PARTIAL``: every item is a split's, but see ``WorkItems.TAIL``)."""
    out_ptr: Scalar
    lse_ptr: Scalar
    part_o_ptr: Scalar
    part_lse_ptr: Scalar
    sink_ptr: Scalar
    HAS_SINK: gl.constexpr
    PARTIAL: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, out_ptr, lse_ptr, part_o_ptr, part_lse_ptr, sink_ptr, HAS_SINK, PARTIAL):
        self.out_ptr = _field(out_ptr)
        self.lse_ptr = _field(lse_ptr)
        self.part_o_ptr = _field(part_o_ptr)
        self.part_lse_ptr = _field(part_lse_ptr)
        self.sink_ptr = _field(sink_ptr)
        self.HAS_SINK = _field(HAS_SINK)
        self.PARTIAL = _field(PARTIAL)


@aggregate
class Caches:
    """The two scopes' paged caches (base, page stride, slots; ``BS0``/``BS1`` slots a page) of formats ``FMT`` and
    ``FMT1`` (the same but for V4.1's fp8 window beside an fp4 compressed cache), read for q·k widths ``D_QK``."""
    c0_ptr: Scalar
    c0_stride0: Scalar
    c0_slots: Scalar
    c1_ptr: Scalar
    c1_stride0: Scalar
    c1_slots: Scalar
    FMT: gl.constexpr
    FMT1: gl.constexpr
    BS0: gl.constexpr
    BS1: gl.constexpr
    D_QK: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, c0_ptr, c0_stride0, c0_slots, c1_ptr, c1_stride0, c1_slots, FMT, FMT1, BS0, BS1, D_QK):
        self.c0_ptr = _field(c0_ptr)
        self.c0_stride0 = _field(c0_stride0)
        self.c0_slots = _field(c0_slots)
        self.c1_ptr = _field(c1_ptr)
        self.c1_stride0 = _field(c1_stride0)
        self.c1_slots = _field(c1_slots)
        self.FMT = _field(FMT)
        self.FMT1 = _field(FMT1)
        self.BS0 = _field(BS0)
        self.BS1 = _field(BS1)
        self.D_QK = _field(D_QK)

    @gluon.jit
    def rows(self, idx, blk, nblk0):
        """Pointers to the rows of block ``blk``'s slots ``idx`` (bytes for fp8 and fp4, elements for bf16), to
        their scales (:func:`_row_and_scales`), and the rows' validity."""
        if blk < nblk0:
            valid = (idx >= 0) & (idx < self.c0_slots)
            slot = gl.where(valid, idx, 0)
            page = self.c0_ptr + (slot // self.BS0).to(gl.int64) * self.c0_stride0
            row, scales = _row_and_scales(page, slot % self.BS0, self.FMT, self.BS0, self.D_QK)
        else:
            valid = (idx >= 0) & (idx < self.c1_slots)
            slot = gl.where(valid, idx, 0)
            page = self.c1_ptr + (slot // self.BS1).to(gl.int64) * self.c1_stride0
            row, scales = _row_and_scales(page, slot % self.BS1, self.FMT1, self.BS1, self.D_QK)
        return row, scales, valid


@gluon.jit
def _row_and_scales(page, off, FMT: gl.constexpr, BS: gl.constexpr, D_QK: gl.constexpr):
    """Pointers to the rows at ``off`` in pages ``page`` of ``FMT`` (``BS`` rows a page) and to their scales
    (``formats.page_fields``: fp8_v4's ue8m0 bytes and the page-planar V4.1 scales after the page's bodies,
    fp8_v32's float32s and the token-interleaved V4.1 scales inside the row; bf16: the row again, unused)."""
    if FMT == BF16:
        row = page + off * D_QK
        scales = row
    else:
        row = page + off * _body_stride(FMT)
        scales = page + _scales_base(FMT, BS) + off * _scales_stride(FMT)
    return row, scales


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


@aggregate
class WorkItem:
    """One query token (``tok``) × a head block (``hb``) × one split of its key list (``split``; -1: a whole list of
    a ``TAIL`` launch): the scopes' lengths and blocks (``len0``, ``nblk0``, ``len1``), the item's key blocks
    ``[lo, hi)`` (the two scopes' blocks in sequence) and the scopes' index rows."""
    tok: Scalar
    hb: Scalar
    split: Scalar
    len0: Scalar
    nblk0: Scalar
    len1: Scalar
    lo: Scalar
    hi: Scalar
    i0_row: Scalar
    i1_row: Scalar

    @gluon.constexpr_function
    def __init__(self, tok, hb, split, len0, nblk0, len1, lo, hi, i0_row, i1_row):
        self.tok = _field(tok)
        self.hb = _field(hb)
        self.split = _field(split)
        self.len0 = _field(len0)
        self.nblk0 = _field(nblk0)
        self.len1 = _field(len1)
        self.lo = _field(lo)
        self.hi = _field(hi)
        self.i0_row = _field(i0_row)
        self.i1_row = _field(i1_row)

    @gluon.jit
    def pairs(self):
        """The pairs of key blocks the item's blocks fill (the last one may be half past ``hi``)."""
        return gl.cdiv(self.hi - self.lo, 2)

    @gluon.jit
    def indices(self, blk, rows_layout: gl.constexpr):
        """:func:`_block_indices` of this item's block ``blk``."""
        return _block_indices(self.i0_row, self.len0, self.nblk0, self.i1_row, self.len1, blk, rows_layout)


@aggregate
class WorkItems:
    """The launch's work items and the key lists they read: the token order (``HAS_ORDER``), the index lists of
    scope 0 (``l0``: lengths, ``w0``: its width, ``i0``: rows of ``i0_stride``) and of scope 1 (``HAS_EXTRA``), the
    launch's tokens and heads (``tokens_per_len`` tokens share a length), how lists are split (``SPLITS`` pieces, or
    ``SPLIT_BLOCKS`` blocks each; with ``TAIL`` only the last ``tail`` tokens'), and whether programs are
    ``PERSISTENT``."""
    order_ptr: Scalar
    l0_ptr: Scalar
    w0: Scalar
    i0_ptr: Scalar
    i0_stride: Scalar
    l1_ptr: Scalar
    w1: Scalar
    i1_ptr: Scalar
    i1_stride: Scalar
    num_tokens: Scalar
    num_heads: Scalar
    tokens_per_len: Scalar
    tail: Scalar
    HAS_ORDER: gl.constexpr
    HAS_EXTRA: gl.constexpr
    SPLITS: gl.constexpr
    SPLIT_BLOCKS: gl.constexpr
    TAIL: gl.constexpr
    PERSISTENT: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, order_ptr, l0_ptr, w0, i0_ptr, i0_stride, l1_ptr, w1, i1_ptr, i1_stride, num_tokens,
                 num_heads, tokens_per_len, tail, HAS_ORDER, HAS_EXTRA, SPLITS, SPLIT_BLOCKS, TAIL, PERSISTENT):
        self.order_ptr = _field(order_ptr)
        self.l0_ptr = _field(l0_ptr)
        self.w0 = _field(w0)
        self.i0_ptr = _field(i0_ptr)
        self.i0_stride = _field(i0_stride)
        self.l1_ptr = _field(l1_ptr)
        self.w1 = _field(w1)
        self.i1_ptr = _field(i1_ptr)
        self.i1_stride = _field(i1_stride)
        self.num_tokens = _field(num_tokens)
        self.num_heads = _field(num_heads)
        self.tokens_per_len = _field(tokens_per_len)
        self.tail = _field(tail)
        self.HAS_ORDER = _field(HAS_ORDER)
        self.HAS_EXTRA = _field(HAS_EXTRA)
        self.SPLITS = _field(SPLITS)
        self.SPLIT_BLOCKS = _field(SPLIT_BLOCKS)
        self.TAIL = _field(TAIL)
        self.PERSISTENT = _field(PERSISTENT)

    @gluon.jit
    def rounds(self):
        """How many work items this program takes (:meth:`item`): one per round, in rounds of one item per
        program, the last one partial; one without ``PERSISTENT`` (a program per item: the item loop folds away,
        and with it its cost, some 5 % of a V3.2 item on the H100)."""
        if self.PERSISTENT:
            if self.TAIL:
                items = (self.num_tokens + self.tail * (self.SPLITS - 1)) * gl.cdiv(self.num_heads, H_BLOCK)
            else:
                items = self.num_tokens * gl.cdiv(self.num_heads, H_BLOCK) * self.SPLITS
            programs = gl.num_programs(0)
            full = items // programs
            rest = items % programs
            pid = gl.program_id(0)
            in_last = gl.where(full % 2 == 0, pid < rest, pid >= programs - rest)  # as item() numbers them
            return full + in_last.to(gl.int32)
        else:
            return 1

    @gluon.jit
    def item(self, r):
        """This program's :class:`WorkItem` of round ``r``. Items are numbered split-major, then token slot
        (through ``order``), then head block (a token's head blocks, which read the same keys, run side by side);
        round r gives item ``r·P + p`` to program p of P, every odd round in reverse, so that longest-first
        tokens even out over the programs. With ``TAIL`` only the last ``tail`` token slots are split: the other
        tokens' whole lists come first, as items of split -1 (they write the output, not a partial row), then the
        pieces of the last tokens, split-major, which fill the SMs that the whole items leave idle at the end."""
        head_blocks = gl.cdiv(self.num_heads, H_BLOCK)
        programs = gl.num_programs(0)
        pid = gl.program_id(0)
        item = r * programs + gl.where(r % 2 == 0, pid, programs - 1 - pid)
        if self.TAIL:
            whole = (self.num_tokens - self.tail) * head_blocks
            cut = self.tail * head_blocks
            piece = gl.maximum(item - whole, 0)
            split = gl.where(item >= whole, piece // cut, -1)
            row = gl.where(item >= whole, whole + piece % cut, item)
        else:
            rows = self.num_tokens * head_blocks
            split = item // rows
            row = item % rows
        tok = row // head_blocks
        hb = row % head_blocks
        if self.HAS_ORDER:  # as triton.attention._ordered_token
            tok = gl.minimum(gl.maximum(gl.load(self.order_ptr + tok), 0), self.num_tokens - 1)
        len_row = tok // self.tokens_per_len  # as triton.attention's kernel
        len0 = gl.minimum(gl.maximum(gl.load(self.l0_ptr + len_row), 0), self.w0)
        nblk0 = gl.cdiv(len0, BLOCK_N)
        len1 = len0 * 0
        if self.HAS_EXTRA:
            len1 = gl.minimum(gl.maximum(gl.load(self.l1_ptr + len_row), 0), self.w1)
        nblk1 = gl.cdiv(len1, BLOCK_N)
        if self.SPLIT_BLOCKS > 0:  # batch-invariant: as triton.attention's kernel
            per_split = self.SPLIT_BLOCKS
        elif self.TAIL:
            per_split = gl.where(split >= 0, gl.cdiv(nblk0 + nblk1, self.SPLITS), nblk0 + nblk1)
        else:
            per_split = gl.cdiv(nblk0 + nblk1, self.SPLITS)
        lo = gl.maximum(split, 0) * per_split
        hi = gl.maximum(gl.minimum(lo + per_split, nblk0 + nblk1), lo)  # a split past the list's end: no blocks
        return WorkItem(tok, hb, split, len0, nblk0, len1, lo, hi, self.i0_ptr + tok.to(gl.int64) * self.i0_stride,
                        self.i1_ptr + tok.to(gl.int64) * self.i1_stride)


@gluon.jit
def _block_keys_valid(item, blk, caches, zero, keys_layout: gl.constexpr):
    """Which keys of ``item``'s block ``blk`` the math warpgroups attend: within the list and the item's blocks
    (``< hi``), and a slot inside its cache (the copy side reads the others as zeros). The index rows' addresses are
    rebuilt from the opaque ``zero`` (:func:`_opaque`): hoisted out of the key loop, they were spilled."""
    idx = _block_indices(item.i0_row + zero, item.len0, item.nblk0, item.i1_row + zero, item.len1, blk, keys_layout)
    return (idx >= 0) & (idx < gl.where(blk < item.nblk0, caches.c0_slots, caches.c1_slots)) & (blk < item.hi)


@gluon.jit
def _copy_rope(dst, rows, ok, START: gl.constexpr):
    """``cp.async`` the 64 bf16 rope dims of each gathered row (``rows``: pointers to the rows' first byte or
    element; the rope starts ``START`` bf16 elements in) into ``dst (BLOCK_N, 64)``; invalid rows: zeros."""
    rope_layout: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [WARPS, 1], [1, 0])
    col = gl.arange(0, ROPE, layout=gl.SliceLayout(0, rope_layout))
    row = gl.convert_layout(rows, gl.SliceLayout(1, rope_layout)).to(gl.pointer_type(gl.bfloat16))
    okr = gl.convert_layout(ok, gl.SliceLayout(1, rope_layout))
    async_load(dst, (row + START)[:, None] + col[None, :], mask=okr[:, None])


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
    _wait_free(q_free, r)
    thread_barrier()
    q_layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [WARPS, 1], [1, 0])
    heads_q = hb * H_BLOCK + gl.arange(0, q_smem.shape[1], layout=gl.SliceLayout(1, q_layout))
    for SIDE in gl.static_range(2):
        cols_q = SIDE * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(0, q_layout))
        q = gl.load(q_tok + heads_q[:, None] * stride_qh + cols_q[None, :], mask=(heads_q < num_heads)[:, None],
                    other=0.0)
        q_smem.index(0).slice(SIDE * HALF, HALF, dim=1).store(q)
    fence_async_shared()
    thread_barrier()


@gluon.jit
def _row_outputs(m_i, l_i, rows_layout: gl.constexpr, outs, items, tok, hb, split, PARTIAL: gl.constexpr,
                 STORE_LSE: gl.constexpr = True):
    """The rows' heads, output factor (1/l, with the sink unless the row is a split's partial) and
    destination row block (``out`` or the split's partial rows); with ``STORE_LSE``, stores the LSE."""
    num_heads = items.num_heads
    heads = hb * H_BLOCK + gl.arange(0, m_i.shape[0], layout=rows_layout)  # a head block, or a narrow item's
    head_mask = heads < num_heads
    l_o = gl.convert_layout(l_i, rows_layout)
    m_o = gl.convert_layout(m_i, rows_layout)
    empty = l_o == 0.0
    inv_l = gl.where(empty, 0.0, 1.0 / gl.where(empty, 1.0, l_o))
    lse = gl.where(empty, float("-inf"), (m_o + gl.log2(gl.where(empty, 1.0, l_o))) / LOG2E)
    factor = inv_l
    if not PARTIAL:
        if outs.HAS_SINK:
            sink = gl.load(outs.sink_ptr + heads, mask=head_mask, other=float("-inf"))
            factor = factor / (1.0 + gl.exp(sink - gl.where(empty, 0.0, lse)))
        dst = outs.out_ptr + tok.to(gl.int64) * num_heads * D_OUT
        if STORE_LSE:
            gl.store(outs.lse_ptr + tok * num_heads + heads, gl.where(empty, float("inf"), lse), mask=head_mask)
    else:
        part = (split * items.num_tokens + tok).to(gl.int64) * num_heads
        dst = outs.part_o_ptr + part * D_OUT
        if STORE_LSE:
            gl.store(outs.part_lse_ptr + part + heads, lse, mask=head_mask)
    return heads, factor, dst


@gluon.jit
def _store_rows(acc, m_i, l_i, q_smem, outs, items, item, WG: gl.constexpr):
    """:func:`_store_item` for this item: with ``TAIL``, a whole item (split -1) writes the output and a piece of
    the last tokens its partial rows; else every item as ``PARTIAL`` says."""
    if items.TAIL:
        if item.split >= 0:
            _store_item(acc, m_i, l_i, q_smem, outs, items, item.tok, item.hb, item.split, True, WG)
        else:
            _store_item(acc, m_i, l_i, q_smem, outs, items, item.tok, item.hb, 0, False, WG)
    else:
        _store_item(acc, m_i, l_i, q_smem, outs, items, item.tok, item.hb, item.split, outs.PARTIAL, WG)


@gluon.jit
def _store_item(acc, m_i, l_i, q_smem, outs, items, tok, hb, split, PARTIAL: gl.constexpr, WG: gl.constexpr):
    """Warpgroup ``WG``'s output dims [256·WG, 256·WG + 256): ``acc`` normalised, into ``out`` or the split's
    partial rows; warpgroup 0 also stores the LSE. Q is dead by now (warpgroup 0's logits are all done):
    bf16 rows are staged in this warpgroup's half of it, so that each thread stores 16 consecutive bytes.
    ``WG`` -1: the narrow warpgroup's whole output (:func:`_store_narrow`)."""
    if WG < 0:
        _store_narrow(acc, m_i, l_i, q_smem, outs, items, tok, hb, split, PARTIAL)
    else:
        o_layout: gl.constexpr = acc.type.layout
        o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
        heads, factor, dst = _row_outputs(m_i, l_i, o_rows, outs, items, tok, hb, split, PARTIAL, WG == 0)
        vals = acc * factor[:, None]
        if not PARTIAL:
            _staged_store(vals.to(gl.bfloat16), q_smem.index(0).slice(WG * HALF, HALF, dim=1), dst, heads,
                          WG * HALF, items.num_heads)
        else:
            cols = WG * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(0, o_layout))
            gl.store(dst + heads[:, None] * D_OUT + cols[None, :], vals, mask=(heads < items.num_heads)[:, None])


@gluon.jit
def _staged_store(vals, stage, dst, heads, col0, num_heads):
    """Output rows ``vals (heads, cols)`` bf16 into ``dst``'s rows ``heads`` (dims ``col0 + cols``), staged
    through ``stage`` (shared memory of their shape, dead by now) so that each thread stores 16 consecutive
    bytes."""
    stage.store(vals)
    thread_barrier()
    store_layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [WARPS, 1], [1, 0])
    vals_s = stage.load(store_layout)
    heads_s = gl.convert_layout(heads, gl.SliceLayout(1, store_layout))
    cols = col0 + gl.arange(0, vals.shape[1], layout=gl.SliceLayout(0, store_layout))
    gl.store(dst + heads_s[:, None] * D_OUT + cols[None, :], vals_s, mask=(heads_s < num_heads)[:, None])


@gluon.jit
def _store_narrow(acc, m_i, l_i, q_smem, outs, items, tok, hb, split, PARTIAL: gl.constexpr):
    """The narrow warpgroup's ``acc (512 dims, heads)`` normalised, into ``out`` (staged, transposed, in q's
    buffer, which holds exactly the item's rows) or the split's partial rows; stores the LSE."""
    heads, factor, dst = _row_outputs(m_i, l_i, gl.SliceLayout(0, acc.type.layout), outs, items, tok, hb, split,
                                      PARTIAL)
    vals = acc * factor[None, :]
    if not PARTIAL:
        _staged_store(gl.permute(vals.to(gl.bfloat16), (1, 0)), q_smem.index(0), dst, heads, 0, items.num_heads)
    else:
        dims = gl.arange(0, DIM, layout=gl.SliceLayout(1, acc.type.layout))
        gl.store(dst + heads[None, :] * D_OUT + dims[:, None], vals, mask=(heads < items.num_heads)[None, :])
