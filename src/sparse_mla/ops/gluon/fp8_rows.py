"""fp8 key rows into a key buffer, for the copy warpgroups of 64-head (:mod:`.wide`) and narrow (:mod:`.narrow`)
items: a half block's e4m3 bytes gathered into registers as 32-bit words with their scales (:func:`_gather_half`),
dequantised to bf16 (:func:`_dequant`), and stored into a buffer half once its readers are done, the rope dims
(already bf16) by ``cp.async`` (:func:`_store_half`).

fp8_v4 rows: 448 e4m3 dims in tiles of 64, each with a ue8m0 scale byte after the page's bodies, then 64 bf16 rope
dims. fp8_v32 tiles are 128 dims with a float32 scale each, inside the row, dequantised like fp8_v4's (e4m3 → f32,
times the scale, → bf16: the rounding of ``dequantize_and_gather`` and the Triton kernel); their 64 rope dims go to a
buffer of their own (``r_smem``). fp8_v41 rows (V4.1, either page layout): all 512 dims e4m3 (the rope too), in
tiles of 32 with a ue8m0 byte each (16 per row, after the row's bytes or after the page's bodies): no ``cp.async``.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

from ...formats import UE8M0_BIAS, V4_TILE, V32_ROPE_OFFSET, V32_TILE, V41_FP8_TILE
from .compat import reinterpret, thread_barrier
from .common import BLOCK_N, DIM, FP8_V4, FP8_V32, HALF, NOPE, _copy_rope, _wait_free, is_fp4, is_v41, rope_copied
from .host import PARTITION_WARPS

V32_ROPE = gl.constexpr(V32_ROPE_OFFSET)
V4_TILE_DIMS = gl.constexpr(V4_TILE)  # e4m3 dims per scale
V32_TILE_DIMS = gl.constexpr(V32_TILE)
V41_TILE_DIMS = gl.constexpr(V41_FP8_TILE)
V41_GROUP = gl.constexpr(4)  # fp8_v41 tiles a thread holds side by side: their scale bytes are one 4-byte word
FP4_SPAN = gl.constexpr(64)  # fp4_v41 dims whose four e4m3 scales (one per 16 dims) are one 4-byte word
E4M3_ONES = gl.constexpr(0x38383838)  # four e4m3 bytes of 1.0
BIAS_WORD = gl.constexpr(UE8M0_BIAS * 0x01010101)  # four ue8m0 bytes of 2^0
WORDS_SMEM = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2))
# a copy warpgroup's gathered fp8 half block (``_gather_half``) as 4-byte words: fp8_v4 (rows, 4 tiles, 16 words),
# a thread holding 16 consecutive bytes of each of 4 tiles of two rows; fp8_v32 (rows, 2 tiles, 32 words), 32 bytes
# of each of 2 tiles of two rows; fp8_v41 (rows, 2 groups, 4 tiles, 8 words), 16 bytes of each of a group's 4 tiles
# of two rows; fp4_v41 in the same layout, (rows, 2 groups, 2 spans, 8 words), 16 bytes (32 dims) of each of a group's
# 2 spans of 64 dims of two rows (the same rows' layout as fp8_v41's: one copy loop reads both, a scope each)
_WORDS_V4 = gl.BlockedLayout([1, 1, 4], [8, 1, 4], [PARTITION_WARPS, 1, 1], [2, 1, 0])
_WORDS_V32 = gl.BlockedLayout([1, 1, 8], [8, 1, 4], [PARTITION_WARPS, 1, 1], [2, 1, 0])
_WORDS_V41 = gl.BlockedLayout([1, 1, 4, 4], [8, 2, 1, 2], [PARTITION_WARPS, 1, 1, 1], [3, 2, 1, 0])
WORDS_V4 = gl.constexpr(_WORDS_V4)
WORDS_V32 = gl.constexpr(_WORDS_V32)
WORDS_V41 = gl.constexpr(_WORDS_V41)
# the layout of a block's rows (indices, row pointers, validity) that expands into its format's words
ROWS_V4 = gl.constexpr(gl.SliceLayout(1, gl.SliceLayout(2, _WORDS_V4)))
ROWS_V32 = gl.constexpr(gl.SliceLayout(1, gl.SliceLayout(2, _WORDS_V32)))
ROWS_V41 = gl.constexpr(gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, _WORDS_V41))))


@gluon.constexpr_function
def words_layout(fmt):
    """The layout of :func:`_gather_half`'s words for format code ``fmt``."""
    return WORDS_V4 if fmt == FP8_V4 else WORDS_V32 if fmt == FP8_V32 else WORDS_V41  # (V4.1: fp8 and fp4)


@gluon.constexpr_function
def rows_layout(fmt):
    """The layout of the rows (``(BLOCK_N,)`` indices, pointers, validity) :func:`_gather_half` takes for ``fmt``."""
    return ROWS_V4 if fmt == FP8_V4 else ROWS_V32 if fmt == FP8_V32 else ROWS_V41


@gluon.jit
def _gather_half(rows, scales, ok, SIDE: gl.constexpr, FMT: gl.constexpr):
    """The e4m3 bytes of dims ``[256·SIDE, 256·SIDE + 256)`` of the gathered fp8 rows as int32 words (4 bytes
    each, little-endian; laid out as :func:`words_layout` says), with their scales.

    fp8_v4: ``(BLOCK_N, 4 tiles, 16 words)`` (64 dims a tile) and the four ue8m0 exponents as one ``(BLOCK_N,)``
    int32 word (byte t: tile t's; in the second half byte 3 is the pad byte); the fourth tile of the second half is
    the bf16 rope, not read here (zero words). fp8_v32: ``(BLOCK_N, 2 tiles, 32 words)`` (128 dims a tile) and their
    float32 scales, ``(BLOCK_N, 2)``. fp8_v41: ``(BLOCK_N, 2 groups, 4 tiles, 8 words)`` (32 dims a tile) and each
    group's four ue8m0 bytes as one int32 word, ``(BLOCK_N, 2)``. fp4_v41: the e2m1 codes of the half (8 a word),
    ``(BLOCK_N, 2 groups, 2 spans, 8 words)`` (64 dims a span), and each span's four e4m3 scales as one int32 word,
    ``(BLOCK_N, 2, 2)``.
    Invalid rows read nothing. Words, not bytes: the copy warpgroup carries two halves in registers,
    and tensors of bytes would take a register per byte."""
    layout: gl.constexpr = words_layout(FMT)
    if is_v41(FMT):
        NG: gl.constexpr = HALF // V41_TILE_DIMS // V41_GROUP  # groups of tiles per half
        NW: gl.constexpr = V41_TILE_DIMS // 4  # 4-byte words per tile
        per_row: gl.constexpr = gl.SliceLayout(0, layout)  # (groups, tiles, words)
        group = gl.arange(0, NG, layout=gl.SliceLayout(1, gl.SliceLayout(2, per_row)))
        tile = gl.arange(0, V41_GROUP, layout=gl.SliceLayout(0, gl.SliceLayout(2, per_row)))
        word = gl.arange(0, NW, layout=gl.SliceLayout(0, gl.SliceLayout(1, per_row)))
        offs = (((SIDE * NG + group) * V41_GROUP)[:, None, None] + tile[None, :, None]) * NW + word[None, None, :]
        raw = gl.load(rows.to(gl.pointer_type(gl.int32))[:, None, None, None] + offs[None, :, :, :],
                      mask=ok[:, None, None, None], other=0)
        groups_layout: gl.constexpr = gl.SliceLayout(2, gl.SliceLayout(3, layout))  # (rows, groups)
        group_s = gl.arange(0, NG, layout=gl.SliceLayout(0, groups_layout))
        tile_scales = gl.load(scales.to(gl.pointer_type(gl.int32))[:, None] + (SIDE * NG + group_s)[None, :],
                              mask=ok[:, None], other=BIAS_WORD)
    elif is_fp4(FMT):
        NS: gl.constexpr = 2  # spans per group
        NG: gl.constexpr = HALF // FP4_SPAN // NS  # groups per half
        NW: gl.constexpr = FP4_SPAN // 8  # 4-byte words of codes per span
        spans_layout: gl.constexpr = gl.SliceLayout(3, layout)  # (rows, groups, spans)
        per_row: gl.constexpr = gl.SliceLayout(0, layout)  # (groups, spans, words)
        group = gl.arange(0, NG, layout=gl.SliceLayout(1, gl.SliceLayout(2, per_row)))
        span = gl.arange(0, NS, layout=gl.SliceLayout(0, gl.SliceLayout(2, per_row)))
        word = gl.arange(0, NW, layout=gl.SliceLayout(0, gl.SliceLayout(1, per_row)))
        offs = (((SIDE * NG + group) * NS)[:, None, None] + span[None, :, None]) * NW + word[None, None, :]
        raw = gl.load(rows.to(gl.pointer_type(gl.int32))[:, None, None, None] + offs[None, :, :, :],
                      mask=ok[:, None, None, None], other=0)
        group_s = gl.arange(0, NG, layout=gl.SliceLayout(1, gl.SliceLayout(0, spans_layout)))
        span_s = gl.arange(0, NS, layout=gl.SliceLayout(0, gl.SliceLayout(0, spans_layout)))
        spans = (SIDE * NG + group_s)[:, None] * NS + span_s[None, :]  # the half's spans: their scale words
        tile_scales = gl.load(scales.to(gl.pointer_type(gl.int32))[:, None, None] + spans[None, :, :],
                              mask=ok[:, None, None], other=E4M3_ONES)
    else:
        NT: gl.constexpr = HALF // (V4_TILE_DIMS if FMT == FP8_V4 else V32_TILE_DIMS)  # tiles per half
        NW: gl.constexpr = HALF // 4 // NT  # 4-byte words per tile
        tiles_layout: gl.constexpr = gl.SliceLayout(2, layout)
        tile = gl.arange(0, NT, layout=gl.SliceLayout(0, tiles_layout))
        word = gl.arange(0, NW, layout=gl.SliceLayout(0, gl.SliceLayout(1, layout)))
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
    """``_gather_half``'s words times their tiles' scales as int32 words that each hold two bf16 (the dims in
    order), one more axis of 2 than ``raw``. fp8_v4's and fp8_v41's power-of-two factors make the products exact;
    fp8_v32's float32 scales round each product to float32 and then to bf16, as the reference does; fp4_v41's
    products (an e2m1 value times an e4m3 scale) are exact in bf16."""
    if is_fp4(FMT):
        vals = _dequant_fp4(raw, scales)
    else:
        vals = _dequant_fp8(raw, scales, FMT)
    return vals


@gluon.jit
def _dequant_fp8(raw, scales, FMT: gl.constexpr):
    """:func:`_dequant` of e4m3 words: ``(..., 2)`` int32 words of two bf16 each."""
    if FMT == FP8_V4:
        tile = gl.arange(0, raw.shape[1], layout=gl.SliceLayout(0, gl.SliceLayout(2, raw.type.layout)))
        e = (scales[:, None] >> (tile[None, :] * 8)) & 0xFF
        factor = (e << 23).to(gl.float32, bitcast=True)[:, :, None]  # ue8m0 -> 2^(e-127)
    elif is_v41(FMT):
        tiles_layout: gl.constexpr = gl.SliceLayout(3, raw.type.layout)  # (rows, groups, tiles)
        tile = gl.arange(0, raw.shape[2], layout=gl.SliceLayout(0, gl.SliceLayout(1, tiles_layout)))
        e = (scales[:, :, None] >> (tile[None, None, :] * 8)) & 0xFF
        factor = (e << 23).to(gl.float32, bitcast=True)[:, :, :, None]
    else:
        factor = scales[:, :, None]
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
        }""", "=r,=r,r,r", [raw, factor], dtype=(gl.int32, gl.int32), is_pure=True, pack=1)
    return gl.join(lo, hi)


# byte ``b`` of a word of e2m1 codes ($4) -> bf16 pair ``$b``: the two codes as bf16 bits (sign at 15, magnitude at
# 6-8; the high nibble into the high half), which read as the e2m1 value times 2^-126 (0.5: a subnormal), times 2^100
# (k), then times the scale · 2^26 (s2): each product exact
_FP4_BYTE = """
        bfe.u32 t, $4, {shift}, 8;
        and.b32 p, t, 15;
        shl.b32 q, t, 12;
        and.b32 q, q, 983040;
        or.b32 p, p, q;
        and.b32 q, p, 524296;
        shl.b32 q, q, 12;
        and.b32 p, p, 458759;
        shl.b32 p, p, 6;
        or.b32 p, p, q;
        mul.rn.bf16x2 p, p, k;
        mul.rn.bf16x2 ${out}, p, s2;"""
# a word of 8 e2m1 codes ($4) and its e4m3 scale (the low byte of $5) -> four bf16 pairs ($0-$3)
FP4_PTX = gl.constexpr("""{
        .reg .b16 sl, sh, c0, c1;
        .reg .b32 sc, t, p, q, k, s2;
        .reg .f32 s;
        mov.b32 {sl, sh}, $5;
        cvt.rn.f16x2.e4m3x2 sc, sl;
        mov.b32 {c0, c1}, sc;
        cvt.f32.f16 s, c0;
        mul.f32 s, s, 0f4C800000;
        cvt.rn.bf16x2.f32 s2, s, s;
        mov.b32 k, 1904243072;""" + "".join(_FP4_BYTE.format(shift=8 * b, out=b) for b in range(4)) + """
        }""")


@gluon.jit
def _dequant_fp4(raw, scales):
    """fp4_v41 words of 8 e2m1 codes (``_gather_half``) as ``(..., 4)`` int32 words of two bf16 each (the dims in
    order), each code's value times its e4m3 scale. A byte's two codes become a bf16 pair whose bits are the codes'
    sign at bit 15 and magnitude at bits 6-8: the e2m1 value times 2^-126 (``ops.fp8.e2m1_decode``'s trick, in
    bf16's exponent), exact; two bf16 multiplies (by 2^100, then by the scale times 2^26) undo it, exactly (the
    products have at most 6 significant bits)."""
    words_layout: gl.constexpr = raw.type.layout
    word = gl.arange(0, raw.shape[3], layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, words_layout))))
    scale_bytes = (scales[:, :, :, None] >> ((word // 2) * 8)[None, None, None, :]) & 0xFF  # 16 dims a scale
    p0, p1, p2, p3 = gl.inline_asm_elementwise(FP4_PTX, "=r,=r,=r,=r,r,r", [raw, scale_bytes],
                                               dtype=(gl.int32, gl.int32, gl.int32, gl.int32), is_pure=True, pack=1)
    return gl.join(gl.join(p0, p2), gl.join(p1, p3))


@gluon.jit
def _store_half(ring, raw, scales, rows, ok, j, BUF: gl.constexpr, SIDE: gl.constexpr, FMT: gl.constexpr,
                DEQUANT_FIRST: gl.constexpr = False):
    """Once half ``SIDE`` of buffer ``BUF`` of ``ring`` is free of pair j-1's readers, dequantise into it a half
    block gathered by ``_gather_half`` (``rows``/``ok``: the block's rows, for the second half's rope, which
    goes by ``cp.async`` (fp8_v4: into the row's last 64 dims; fp8_v32: into ``r_smem``) and arrives on
    ``ready`` as it lands), and signal the half ready. ``DEQUANT_FIRST``: dequantise before the wait, so that
    only the stores stand between the readers' release and the half's ready signal; the converted half (twice
    the gathered words) then stays in registers through the wait, which the narrow items' copy warpgroups have
    room for (fp8_v32's single copy warpgroup spilled 208 B)."""
    bar: gl.constexpr = 2 * BUF + SIDE
    if DEQUANT_FIRST:
        vals = _dequant(raw, scales, FMT)
    _wait_free(ring.free.index(bar), j)
    if not DEQUANT_FIRST:
        vals = _dequant(raw, scales, FMT)
    words = reinterpret(ring.k_smem.index(BUF), gl.int32, [BLOCK_N, DIM // 2], WORDS_SMEM)  # bf16 pairs
    words.slice(SIDE * HALF // 2, HALF // 2, dim=1).store(gl.reshape(vals, [BLOCK_N, HALF // 2]))
    if (SIDE == 1) and rope_copied(FMT):  # the bf16 rope dims (V4.1's rows have none)
        if FMT == FP8_V4:
            # the rope tile was just written too (zero words times the pad byte's factor: zeros, or NaN for a
            # 0xFF pad byte): every thread's stores land before any rope copy starts, and the copy overwrites
            # them
            thread_barrier()
            _copy_rope(ring.k_smem.index(BUF).slice(NOPE, DIM - NOPE, dim=1), rows, ok, NOPE // 2)
        else:  # (issued before the dequantisation instead, it measured no faster on the H100)
            _copy_rope(ring.r_smem.index(BUF), rows, ok, V32_ROPE // 2)
        async_copy.mbarrier_arrive(ring.ready.index(bar), increment_count=False)
    fence_async_shared()
    thread_barrier()
    mbarrier.arrive(ring.ready.index(bar))
