"""The portable kernels' row helpers, shared by :mod:`.attention` and :mod:`.cache`: the byte-layout table of
:mod:`sparse_mla.formats` as Triton constants, a paged cache's token pointers (:func:`token_ptrs`) and the
dequantised pieces of gathered rows (:func:`load_piece`, :func:`load_rope`) in every cache format, and how the
latent dims split into those pieces (:func:`latent_pieces`)."""
from __future__ import annotations

import triton
import triton.language as tl

from ... import formats
from .. import dispatch
from ..fp8 import e2m1_decode, e2m1_gain, e4m3_decode, e4m3_gain, e4m3_ue8m0_bf16


def kernel_const(value: int | float) -> int | float | tl.constexpr:
    """A number of :mod:`sparse_mla.formats`' byte-layout table as a global that jit code can read: a constexpr for
    the compiler (which reads no other globals), the plain number for the CPU interpreter (whose arithmetic
    leaves a constexpr global wrapped around the tensors it touches)."""
    return value if dispatch.interpreting() else tl.constexpr(value)


# the byte-layout table of sparse_mla.formats as Triton constants
FMT_BF16 = kernel_const(formats.FMT_BF16)
FMT_FP8_V4 = kernel_const(formats.FMT_FP8_V4)
FMT_FP8_V32 = kernel_const(formats.FMT_FP8_V32)
FMT_FP8_E4M3 = kernel_const(formats.FMT_FP8_E4M3)
FMT_FP8_V41 = kernel_const(formats.FMT_FP8_V41)
FMT_FP4_V41 = kernel_const(formats.FMT_FP4_V41)
FMT_FP8_V41_PLANAR = kernel_const(formats.FMT_FP8_V41_PLANAR)
FMT_FP4_V41_PLANAR = kernel_const(formats.FMT_FP4_V41_PLANAR)
UE8M0_BIAS = kernel_const(formats.UE8M0_BIAS)
UE8M0_NAN = kernel_const(formats.UE8M0_NAN)
E4M3_NAN = kernel_const(formats.E4M3_NAN)
ROPE_DIM = kernel_const(formats.ROPE_DIM)
V4_TILE = kernel_const(formats.V4_TILE)
V4_TOKEN_BYTES = kernel_const(formats.V4_TOKEN_BYTES)
V4_BODY_BYTES = kernel_const(formats.V4_BODY_BYTES)
V4_SCALE_BYTES = kernel_const(formats.V4_SCALE_BYTES)
V4_ROPE_OFFSET = kernel_const(formats.V4_ROPE_OFFSET)
V32_TILE = kernel_const(formats.V32_TILE)
V32_TOKEN_BYTES = kernel_const(formats.V32_TOKEN_BYTES)
V32_SCALE_OFFSET = kernel_const(formats.V32_SCALE_OFFSET)
V32_ROPE_OFFSET = kernel_const(formats.V32_ROPE_OFFSET)
E4M3_TOKEN_BYTES = kernel_const(formats.E4M3_TOKEN_BYTES)
V41_FP8_TILE = kernel_const(formats.V41_FP8_TILE)
V41_FP8_TOKEN_BYTES = kernel_const(formats.V41_FP8_TOKEN_BYTES)
V41_FP8_SCALE_OFFSET = kernel_const(formats.V41_FP8_SCALE_OFFSET)
V41_FP4_TILE = kernel_const(formats.V41_FP4_TILE)
V41_FP4_TOKEN_BYTES = kernel_const(formats.V41_FP4_TOKEN_BYTES)
V41_FP4_SCALE_OFFSET = kernel_const(formats.V41_FP4_SCALE_OFFSET)


@triton.jit
def load_piece(row_ptr, scale_ptr, valid, START: tl.constexpr, WIDTH: tl.constexpr, FMT: tl.constexpr,
                DOT: tl.constexpr, BLOCK_N: tl.constexpr, NATIVE_FP8: tl.constexpr, PTX_DECODE: tl.constexpr = False):
    """Dequantised dims ``[START, START+WIDTH)`` of ``BLOCK_N`` gathered tokens: ``(BLOCK_N, WIDTH)``.

    row_ptr: ``(BLOCK_N,)`` pointers to each token's first element (bf16 caches) or byte (the others).
    scale_ptr: fp8_v4 and the V4.1 formats, pointers to each token's scale bytes (:func:`token_ptrs`).
    fp8_e4m3 values come back as :func:`.fp8.e4m3_decode` gives them, the plain e4m3 numbers over
    ``e4m3_gain(NATIVE_FP8)``: the per-tensor scale and the gain are the caller's (``_scope_pass``). The tiled
    formats' gain is folded into their tile scales (fp4_v41's e2m1 gain too).
    PTX_DECODE: ue8m0-scaled fp8 tiles (fp8_v4, fp8_v41) go to bf16 in inline PTX (:func:`.fp8.e4m3_ue8m0_bf16`;
    CUDA targets without the e4m3 conversion, bf16 dots): the same values in fewer instructions.
    """
    if FMT == FMT_BF16:
        vals = tl.load(row_ptr[:, None] + (START + tl.arange(0, WIDTH))[None, :], mask=valid[:, None], other=0.0)
        out = vals.to(DOT)
    elif FMT == FMT_FP8_E4M3:
        raw = tl.load(row_ptr[:, None] + (START + tl.arange(0, WIDTH))[None, :], mask=valid[:, None], other=0)
        out = e4m3_decode(raw, NATIVE_FP8).to(DOT)
    elif (FMT == FMT_FP4_V41) | (FMT == FMT_FP4_V41_PLANAR):
        # a group of 16 dims is 8 bytes, dim 2i in the low nibble of byte i; one e4m3 scale per group. From 32-key
        # blocks the nibbles are decoded apart and joined into dim order (sm_80's fenced key loop: no spills, against
        # 379 reloads per block reading each dim's byte per lane). Below, each dim reads its own byte: Triton 3.6
        # compiles the join wrongly at 16-key blocks without the decode fence (rel err 12 on an H200, 4 or 8 warps,
        # 16-64 heads; likely as the operand layout it propagates back is replicated across warps), and 16-key
        # blocks are CDNA's rows, which have no fence
        NG: tl.constexpr = WIDTH // V41_FP4_TILE
        g = tl.arange(0, NG)
        raw_scale = tl.load(scale_ptr[:, None] + (START // V41_FP4_TILE + g)[None, :], mask=valid[:, None], other=0)
        scale = e4m3_decode(raw_scale, NATIVE_FP8) * (e4m3_gain(NATIVE_FP8) * e2m1_gain())
        scale = tl.where((raw_scale & 0x7F) == E4M3_NAN, float("nan"), scale)[:, :, None]  # as the native decode
        if BLOCK_N < 32:
            j = tl.arange(0, V41_FP4_TILE)
            cols = START // 2 + g[:, None] * (V41_FP4_TILE // 2) + (j // 2)[None, :]
            packed = tl.load(row_ptr[:, None, None] + cols[None, :, :], mask=valid[:, None, None], other=0).to(tl.int32)
            vals = e2m1_decode((packed >> ((j & 1) * 4)[None, None, :]) & 15) * scale
        else:
            cols = START // 2 + g[:, None] * (V41_FP4_TILE // 2) + tl.arange(0, V41_FP4_TILE // 2)[None, :]
            packed = tl.load(row_ptr[:, None, None] + cols[None, :, :], mask=valid[:, None, None], other=0).to(tl.int32)
            vals = tl.join(e2m1_decode(packed & 15) * scale, e2m1_decode(packed >> 4) * scale)  # (..., byte, nibble)
        out = tl.reshape(vals, (BLOCK_N, WIDTH)).to(DOT)
    else:  # tiled fp8: fp8_v4, fp8_v32, fp8_v41
        TILE: tl.constexpr = V4_TILE if FMT == FMT_FP8_V4 else V32_TILE if FMT == FMT_FP8_V32 else V41_FP8_TILE
        NT: tl.constexpr = WIDTH // TILE
        t = tl.arange(0, NT)
        cols = START + t[:, None] * TILE + tl.arange(0, TILE)[None, :]
        raw = tl.load(row_ptr[:, None, None] + cols[None, :, :], mask=valid[:, None, None], other=0)
        if FMT == FMT_FP8_V32:
            sp = (row_ptr[:, None] + (V32_SCALE_OFFSET + 4 * (START // TILE + t))[None, :]).to(
                tl.pointer_type(tl.float32))
            scale = tl.load(sp, mask=valid[:, None], other=1.0) * e4m3_gain(NATIVE_FP8)
            out = tl.reshape(e4m3_decode(raw, NATIVE_FP8) * scale[:, :, None], (BLOCK_N, WIDTH)).to(DOT)
        else:  # ue8m0 bytes
            exps = tl.load(scale_ptr[:, None] + (START // TILE + t)[None, :], mask=valid[:, None], other=UE8M0_BIAS)
            if PTX_DECODE:
                tl.static_assert(DOT == tl.bfloat16, "PTX_DECODE makes bf16 tiles")
                out = e4m3_ue8m0_bf16(raw, tl.broadcast_to(exps[:, :, None], raw.shape))
            else:
                scale = (exps.to(tl.int32) << 23).to(tl.float32, bitcast=True) * e4m3_gain(NATIVE_FP8)  # 2^(e-127)
                scale = tl.where(exps == UE8M0_NAN, float("nan"), scale)
                out = (e4m3_decode(raw, NATIVE_FP8) * scale[:, :, None]).to(DOT)
            out = tl.reshape(out, (BLOCK_N, WIDTH))
    return out


@triton.jit
def load_rope(row_ptr, valid, FMT: tl.constexpr, ROPE_OFF: tl.constexpr, DOT: tl.constexpr, BLOCK_N: tl.constexpr,
               NATIVE_FP8: tl.constexpr, scale_ptr, PTX_DECODE: tl.constexpr = False):
    """The 64 rope dims of the gathered tokens: ``(BLOCK_N, 64)``: bf16 in the cache (bf16, fp8_v4, fp8_v32), or
    quantised as the other dims (fp8_e4m3; the V4.1 formats, with the tile scales at ``scale_ptr``), as
    :func:`load_piece` gives them."""
    if (FMT == FMT_BF16) | (FMT == FMT_FP8_V4) | (FMT == FMT_FP8_V32):
        cols = tl.arange(0, ROPE_DIM)
        if FMT == FMT_BF16:
            ptrs = row_ptr[:, None] + ROPE_OFF + cols[None, :]
        else:
            start: tl.constexpr = V4_ROPE_OFFSET if FMT == FMT_FP8_V4 else V32_ROPE_OFFSET
            ptrs = (row_ptr + start).to(tl.pointer_type(tl.bfloat16))[:, None] + cols[None, :]
        out = tl.load(ptrs, mask=valid[:, None], other=0.0).to(DOT)
    else:
        out = load_piece(row_ptr, scale_ptr, valid, ROPE_OFF, ROPE_DIM, FMT, DOT, BLOCK_N, NATIVE_FP8, PTX_DECODE)
    return out


@triton.jit
def token_ptrs(cache_ptr, stride0, slot, FMT: tl.constexpr, BS: tl.constexpr, ROPE_OFF: tl.constexpr):
    """Pointers to the tokens at ``slot`` of a paged cache (``stride0``: the page stride): their first element
    (bf16) or byte (the others), and their tile scales (fp8_v4, the V4.1 formats: :func:`formats.page_fields`). A
    page-planar page (fp8_v4, fp8_v41_planar, fp4_v41_planar) holds every token's bytes before the scales, then
    every token's scales; a token-interleaved one (the others) its tokens' records back to back."""
    FP8_V41: tl.constexpr = (FMT == FMT_FP8_V41) | (FMT == FMT_FP8_V41_PLANAR)
    FP4_V41: tl.constexpr = (FMT == FMT_FP4_V41) | (FMT == FMT_FP4_V41_PLANAR)
    PLANAR: tl.constexpr = (FMT == FMT_FP8_V4) | (FMT == FMT_FP8_V41_PLANAR) | (FMT == FMT_FP4_V41_PLANAR)
    # a token's record: its bytes (elements: bf16), and where its scales start in it (the record's end: no scales)
    TOKEN: tl.constexpr = (V4_TOKEN_BYTES if FMT == FMT_FP8_V4 else V32_TOKEN_BYTES if FMT == FMT_FP8_V32
                           else E4M3_TOKEN_BYTES if FMT == FMT_FP8_E4M3 else V41_FP8_TOKEN_BYTES if FP8_V41
                           else V41_FP4_TOKEN_BYTES if FP4_V41 else ROPE_OFF + ROPE_DIM)
    SCALES: tl.constexpr = (V4_BODY_BYTES if FMT == FMT_FP8_V4 else V41_FP8_SCALE_OFFSET if FP8_V41
                            else V41_FP4_SCALE_OFFSET if FP4_V41 else TOKEN)
    block = slot // BS
    off = slot - block * BS
    block_ptr = cache_ptr + block.to(tl.int64) * stride0
    if PLANAR:
        row = block_ptr + off * SCALES
        scales = block_ptr + BS * SCALES + off * (TOKEN - SCALES)
    else:
        row = block_ptr + off * TOKEN
        scales = row + SCALES
    return row, scales


def latent_pieces(dim: int) -> tuple[int, int, int, bool]:
    """(PA, PB, PC, V_HAS_ROPE): nope split into power-of-two pieces; V4's V includes the rope dims."""
    return (256, 128, 64, True) if dim == 512 else (256, 128, 128, False)
