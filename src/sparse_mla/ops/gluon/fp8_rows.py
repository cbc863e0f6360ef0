"""fp8 key rows into a key buffer, for the copy warpgroups of 64-head (:mod:`.wide`) and narrow (:mod:`.narrow`)
items: a half block's e4m3 bytes gathered into registers as 32-bit words with their scales (:func:`_gather_half`),
dequantised to bf16 (:func:`_dequant`), and stored into a buffer half once its readers are done, the rope dims
(already bf16) by ``cp.async`` (:func:`_store_half`).

fp8_v4 rows: 448 e4m3 dims in tiles of 64, each with a ue8m0 scale byte after the page's bodies, then 64 bf16 rope
dims. fp8_v32 tiles are 128 dims with a float32 scale each, inside the row, dequantised like fp8_v4's (e4m3 → f32,
times the scale, → bf16: the rounding of ``dequantize_and_gather`` and the Triton kernel); their 64 rope dims go to a
buffer of their own (``r_smem``).
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

from ...formats import UE8M0_BIAS, V4_TILE, V32_ROPE_OFFSET, V32_TILE
from .common import BLOCK_N, DIM, FP8_V4, HALF, NOPE, _copy_rope, _wait_free
from .host import PARTITION_WARPS

V32_ROPE = gl.constexpr(V32_ROPE_OFFSET)
V4_TILE_DIMS = gl.constexpr(V4_TILE)  # e4m3 dims per scale
V32_TILE_DIMS = gl.constexpr(V32_TILE)
BIAS_WORD = gl.constexpr(UE8M0_BIAS * 0x01010101)  # four ue8m0 bytes of 2^0
WORDS_SMEM = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2))
# a copy warpgroup's gathered fp8 half block (``_gather_half``) as 4-byte words: fp8_v4 (rows, 4 tiles, 16 words),
# a thread holding 16 consecutive bytes of each of 4 tiles of two rows; fp8_v32 (rows, 2 tiles, 32 words), 32 bytes
# of each of 2 tiles of two rows
WORDS_V4 = gl.constexpr(gl.BlockedLayout([1, 1, 4], [8, 1, 4], [PARTITION_WARPS, 1, 1], [2, 1, 0]))
WORDS_V32 = gl.constexpr(gl.BlockedLayout([1, 1, 8], [8, 1, 4], [PARTITION_WARPS, 1, 1], [2, 1, 0]))


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
    words = ring.k_smem.index(BUF)._reinterpret(gl.int32, [BLOCK_N, DIM // 2], WORDS_SMEM)  # bf16 pairs
    words.slice(SIDE * HALF // 2, HALF // 2, dim=1).store(gl.reshape(vals, [BLOCK_N, HALF // 2]))
    if SIDE == 1:
        if FMT == FP8_V4:
            # the rope tile was just written too (zero words times the pad byte's factor: zeros, or NaN for a
            # 0xFF pad byte): every thread's stores land before any rope copy starts, and the copy overwrites
            # them
            gl.thread_barrier()
            _copy_rope(ring.k_smem.index(BUF).slice(NOPE, DIM - NOPE, dim=1), rows, ok, NOPE // 2)
        else:  # (issued before the dequantisation instead, it measured no faster on the H100)
            _copy_rope(ring.r_smem.index(BUF), rows, ok, V32_ROPE // 2)
        async_copy.mbarrier_arrive(ring.ready.index(bar), increment_count=False)
    fence_async_shared()
    gl.thread_barrier()
    mbarrier.arrive(ring.ready.index(bar))
