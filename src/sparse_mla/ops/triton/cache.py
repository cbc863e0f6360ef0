"""Triton cache kernels: quantise-and-insert new tokens, dequantise-and-gather rows (DESIGN §4).

Bit-identical to the reference formats (:mod:`sparse_mla.formats`), in integer and exact float operations only (no
fp8 type: the same bytes on every target and in the interpreter): the tile scale exponent is computed exactly from
the float bits of ``max(amax / 448, 1e-4)``, e4m3 and e2m1 rounding is to nearest even, fp4_v41's divisions are
IEEE-rounded (``div_rn``). One program handles one token. A slot of ``-1`` (or out of range) is skipped on insert and
reads as zeros on gather, so neither kernel touches memory outside the cache.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ... import formats
from .. import launch_configs, targets
from ..fp8 import e4m3_decode, e4m3_gain
from ..launch import cached_launch, fp_fusion, on_device_of
from .rows import (E4M3_NAN, E4M3_TOKEN_BYTES, FMT_BF16, FMT_FP4_V41, FMT_FP4_V41_PLANAR, FMT_FP8_E4M3, FMT_FP8_V4,
                   FMT_FP8_V41, FMT_FP8_V41_PLANAR, ROPE_DIM, UE8M0_BIAS, UE8M0_NAN, V4_BODY_BYTES, V4_SCALE_BYTES,
                   V4_TILE, V32_ROPE_OFFSET, V32_SCALE_OFFSET, V32_TILE, V32_TOKEN_BYTES, V41_FP4_TILE, V41_FP8_TILE,
                   kernel_const, latent_pieces, load_piece, load_rope, token_ptrs)

E4M3_MAX = kernel_const(formats.E4M3_MAX)
MIN_SCALE = kernel_const(formats.MIN_SCALE)
V4_DIM = kernel_const(formats.V4_DIM)
V41_FP8_NUM_TILES = kernel_const(formats.V41_FP8_NUM_TILES)
V41_FP4_NUM_TILES = kernel_const(formats.V41_FP4_NUM_TILES)
E2M1_MAX = kernel_const(formats.E2M1_MAX)
E2M1_MIN_SCALE = kernel_const(formats.E2M1_MIN_SCALE)
V4_NOPE_DIM = kernel_const(formats.V4_NOPE_DIM)
V4_NUM_TILES = kernel_const(formats.V4_NUM_TILES)
V32_NOPE_DIM = kernel_const(formats.V32_NOPE_DIM)
V32_NUM_TILES = kernel_const(formats.V32_NUM_TILES)


@triton.jit
def _tile_exponents(x, MIN_RATIO: tl.constexpr):
    """ceil(log2(max(amax / 448, 1e-4))) of each row of ``x`` (tiles, TILE) float32, from the float bits."""
    amax = tl.max(tl.abs(x), 1)
    ratio = tl.maximum(tl.math.div_rn(amax, E4M3_MAX), MIN_RATIO)
    bits = ratio.to(tl.int32, bitcast=True)
    return ((bits >> 23) & 0xFF) - UE8M0_BIAS + ((bits & 0x7FFFFF) != 0).to(tl.int32)


@triton.jit
def round_half_even(y):
    f = tl.floor(y)
    r = y - f
    odd = (f.to(tl.int32) & 1) == 1
    return tl.where((r > 0.5) | ((r == 0.5) & odd), f + 1.0, f)


@triton.jit
def e4m3_bits(x):
    """float32 ``x`` -> e4m3fn byte, round half to even, saturating at ±448 (±inf too), as the reference
    quantisers do (``formats.quantize_per_tensor`` clamps before torch's cast). NaN is not handled: the values are
    finite (checked in the reference and under ``SPARSE_MLA_DEBUG=1``).

    Written with integer arithmetic instead of a cast so that the CPU interpreter (whose float8
    cast rounds wrongly) and the GPU produce the same bytes as torch's ``.to(torch.float8_e4m3fn)``.
    """
    bits = x.to(tl.int32, bitcast=True)
    sign = ((bits >> 24) & 0x80).to(tl.int32)
    a = tl.abs(x)
    e = ((bits >> 23) & 0xFF) - 127
    mant = bits & 0x7FFFFF
    m3 = mant >> 20
    rem = mant & 0xFFFFF
    up = (rem > 0x80000) | ((rem == 0x80000) & ((m3 & 1) == 1))
    normal = ((e + 7) << 3) + m3 + up.to(tl.int32)  # a carry out of the mantissa bumps the exponent
    normal = tl.minimum(normal, 0x7E)  # 448: the largest finite e4m3fn
    sub = round_half_even(a * 512.0).to(tl.int32)  # subnormals step by 2^-9; 8 is the smallest normal
    code = tl.where(a < 0.015625, sub, normal)
    return (sign | code).to(tl.uint8)


@triton.jit
def _e2m1_codes(y):
    """float32 ``y`` -> e2m1 codes (int32 in ``[0, 16)``), as ``formats.e2m1_codes``: the nearest of ±[0, 0.5, 1,
    1.5, 2, 3, 4, 6], a tie going to the even code, beyond ±6 saturating at ±6; the sign bit (8) set for negative
    values and -0 (a negative value that rounds to zero keeps it). NaN is not handled: the values are finite."""
    a = tl.abs(y)
    # the magnitude code counts the midpoints below a: a tie at a midpoint rounds down to an even code (0.25, 1.25,
    # 2.5, 5: strictly above) or up to one (0.75, 1.75, 3.5: from the midpoint on)
    code = ((a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32) + (a >= 1.75).to(tl.int32)
            + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32) + (a > 5.0).to(tl.int32))
    return code | ((y.to(tl.int32, bitcast=True) >> 28) & 8)


@triton.jit
def _insert_e4m3_tiles(src, row, scales):
    """fp8_v41: the token's 512 dims at ``src`` as e4m3 bytes at ``row``, one ue8m0 scale per 32 dims at ``scales``.

    Non-finite tiles as ``formats.quantize_e4m3_tiles`` (IEEE arithmetic on a NaN or infinite scale, ue8m0 0xFF):
    a tile holding NaN is all 0x7F; one holding ±inf (no NaN) has 0x7F for them and ±0 for its finite values."""
    t = tl.arange(0, V41_FP8_NUM_TILES)
    cols = t[:, None] * V41_FP8_TILE + tl.arange(0, V41_FP8_TILE)[None, :]
    x = tl.load(src + cols).to(tl.float32)
    has_nan = tl.max((x != x).to(tl.int32), 1) > 0  # explicit: a max reduction may skip NaN
    exps = _tile_exponents(x, MIN_SCALE)
    finite = (exps <= UE8M0_BIAS) & ~has_nan  # an infinite amax gives exponent 128
    inv_scale = tl.where(finite, ((UE8M0_BIAS - exps) << 23), UE8M0_BIAS << 23).to(tl.float32, bitcast=True)  # 2^-e
    nan_code = has_nan[:, None] | (tl.abs(x) == float("inf"))
    special = tl.where(nan_code, E4M3_NAN, (x.to(tl.int32, bitcast=True) >> 24) & 0x80).to(tl.uint8)
    tl.store(row + cols, tl.where(finite[:, None], e4m3_bits(x * inv_scale[:, None]), special))
    tl.store(scales + t, tl.where(finite, exps + UE8M0_BIAS, UE8M0_NAN).to(tl.uint8))


@triton.jit
def _insert_e2m1_tiles(src, row, scales):
    """fp4_v41: the token's 512 dims at ``src`` as e2m1 codes at ``row`` (dim 2i in the low nibble of byte i), one
    e4m3 scale per 16 dims at ``scales``: ``scale = e4m3(clamp(amax / 6, 2^-9, 448))``, codes of ``x / scale``
    (±inf: amax clamped to 448, codes ±6). A group holding NaN: scale 0x7F (NaN), codes 0 (``formats.e2m1_codes``)."""
    g = tl.arange(0, V41_FP4_NUM_TILES)
    HALF: tl.constexpr = V41_FP4_TILE // 2
    byte = g[:, None] * HALF + tl.arange(0, HALF)[None, :]  # (group, byte): the dims 2·byte (+1)
    lo = tl.load(src + 2 * byte).to(tl.float32)
    hi = tl.load(src + 2 * byte + 1).to(tl.float32)
    has_nan = tl.max(((lo != lo) | (hi != hi)).to(tl.int32), 1) > 0  # explicit: a max reduction may skip NaN
    amax = tl.maximum(tl.max(tl.abs(lo), 1), tl.max(tl.abs(hi), 1))
    ratio = tl.minimum(tl.maximum(tl.math.div_rn(amax, E2M1_MAX), E2M1_MIN_SCALE), E4M3_MAX)
    scale_bits = e4m3_bits(ratio)
    scale = tl.broadcast_to((e4m3_decode(scale_bits, False) * e4m3_gain(False))[:, None], lo.shape)  # exact
    codes = _e2m1_codes(tl.math.div_rn(lo, scale)) | (_e2m1_codes(tl.math.div_rn(hi, scale)) << 4)
    tl.store(row + byte, tl.where(has_nan[:, None], 0, codes).to(tl.uint8))
    tl.store(scales + g, tl.where(has_nan, E4M3_NAN, scale_bits).to(tl.uint8))


@triton.jit
def _insert_kernel(kv_ptr, kv_stride, slot_ptr, cache_ptr, stride0, num_slots, kv_scale_ptr,
                   FMT: tl.constexpr, BS: tl.constexpr, DIM: tl.constexpr, DIM_P2: tl.constexpr):
    tok = tl.program_id(0)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if (slot >= 0) & (slot < num_slots):
        block = slot // BS
        off = slot - block * BS
        src = kv_ptr + tok.to(tl.int64) * kv_stride
        block_ptr = cache_ptr + block * stride0
        if FMT == FMT_BF16:
            cols = tl.arange(0, DIM_P2)
            tl.store(block_ptr + off * DIM + cols, tl.load(src + cols, mask=cols < DIM), mask=cols < DIM)
        elif FMT == FMT_FP8_E4M3:  # e4m3(x / kv_scale), the division rounded as torch's
            cols = tl.arange(0, E4M3_TOKEN_BYTES)
            x = tl.load(src + cols).to(tl.float32)
            q = e4m3_bits(tl.math.div_rn(x, tl.broadcast_to(tl.load(kv_scale_ptr), x.shape)))
            tl.store(block_ptr + off * E4M3_TOKEN_BYTES + cols, q)
        elif (FMT == FMT_FP8_V41) | (FMT == FMT_FP8_V41_PLANAR) | (FMT == FMT_FP4_V41) | (FMT == FMT_FP4_V41_PLANAR):
            row, scales = token_ptrs(cache_ptr, stride0, slot, FMT, BS, V4_DIM - ROPE_DIM)  # either page layout
            if (FMT == FMT_FP4_V41) | (FMT == FMT_FP4_V41_PLANAR):
                _insert_e2m1_tiles(src, row, scales)
            else:
                _insert_e4m3_tiles(src, row, scales)
        else:
            TILE: tl.constexpr = V4_TILE if FMT == FMT_FP8_V4 else V32_TILE
            # fp8_v4: 7 nope tiles + 1 masked (one lane per scale byte); fp8_v32: 4 tiles
            NT: tl.constexpr = V4_SCALE_BYTES if FMT == FMT_FP8_V4 else V32_NUM_TILES
            NOPE: tl.constexpr = V4_NOPE_DIM if FMT == FMT_FP8_V4 else V32_NOPE_DIM
            ROW: tl.constexpr = V4_BODY_BYTES if FMT == FMT_FP8_V4 else V32_TOKEN_BYTES
            t = tl.arange(0, NT)
            cols = t[:, None] * TILE + tl.arange(0, TILE)[None, :]
            in_nope = cols < NOPE
            x = tl.load(src + cols, mask=in_nope, other=0.0).to(tl.float32)
            exps = _tile_exponents(x, MIN_SCALE)
            inv_scale = ((UE8M0_BIAS - exps) << 23).to(tl.float32, bitcast=True)  # exact 2^-e
            q = e4m3_bits(x * inv_scale[:, None])
            row = block_ptr + off * ROW
            tl.store(row + cols, q, mask=in_nope)
            rope_cols = tl.arange(0, ROPE_DIM)
            rope = tl.load(src + NOPE + rope_cols)
            if FMT == FMT_FP8_V4:
                tl.store((row + NOPE).to(tl.pointer_type(tl.bfloat16)) + rope_cols, rope)
                scale_bytes = tl.where(t < V4_NUM_TILES, exps + UE8M0_BIAS, 0).to(tl.uint8)  # 7 ue8m0 + 1 zero pad
                tl.store(block_ptr + BS * V4_BODY_BYTES + off * V4_SCALE_BYTES + t, scale_bytes)
            else:
                scale = ((exps + UE8M0_BIAS) << 23).to(tl.float32, bitcast=True)
                tl.store((row + V32_SCALE_OFFSET).to(tl.pointer_type(tl.float32)) + t, scale)
                tl.store((row + V32_ROPE_OFFSET).to(tl.pointer_type(tl.bfloat16)) + rope_cols, rope)


@triton.jit
def _store_gathered(dst, vals, kv_scale, START: tl.constexpr, WIDTH: tl.constexpr, FMT: tl.constexpr):
    """Store dims ``[START, START+WIDTH)`` of a gathered row as bf16 (fp8_e4m3 values times ``kv_scale``)."""
    if FMT == FMT_FP8_E4M3:
        vals = vals * kv_scale
    tl.store(dst + START + tl.arange(0, WIDTH)[None, :], vals.to(tl.bfloat16))


@triton.jit
def _gather_kernel(cache_ptr, stride0, num_slots, slot_ptr, out_ptr, kv_scale_ptr,
                   FMT: tl.constexpr, BS: tl.constexpr, PA: tl.constexpr, PB: tl.constexpr, PC: tl.constexpr,
                   NATIVE_FP8: tl.constexpr):
    """One output row per program: the dequantised token at ``slots[row]`` (zeros when invalid). NATIVE_FP8: fp8
    bytes decoded by conversion instructions, else by integer operations (:mod:`.fp8`)."""
    row_id = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + row_id + tl.arange(0, 1)).to(tl.int64)  # a (1,) tensor: a block of one token
    valid = (slot >= 0) & (slot < num_slots)
    safe = tl.where(valid, slot, 0).to(tl.int64)
    ROPE_OFF: tl.constexpr = PA + PB + PC
    row_ptr, scale_ptr = token_ptrs(cache_ptr, stride0, safe, FMT, BS, ROPE_OFF)
    kv_scale = 1.0
    if FMT == FMT_FP8_E4M3:  # the decode's gain folded in (the tiled formats fold it into their tile scales)
        kv_scale = tl.load(kv_scale_ptr) * e4m3_gain(NATIVE_FP8)
    dst = out_ptr + row_id * (ROPE_OFF + ROPE_DIM)
    _store_gathered(dst, load_piece(row_ptr, scale_ptr, valid, 0, PA, FMT, tl.float32, 1, NATIVE_FP8), kv_scale,
                    0, PA, FMT)
    _store_gathered(dst, load_piece(row_ptr, scale_ptr, valid, PA, PB, FMT, tl.float32, 1, NATIVE_FP8), kv_scale,
                    PA, PB, FMT)
    _store_gathered(dst, load_piece(row_ptr, scale_ptr, valid, PA + PB, PC, FMT, tl.float32, 1, NATIVE_FP8),
                    kv_scale, PA + PB, PC, FMT)
    _store_gathered(dst, load_rope(row_ptr, valid, FMT, ROPE_OFF, tl.float32, 1, NATIVE_FP8, scale_ptr), kv_scale,
                    ROPE_OFF, ROPE_DIM, FMT)


def quantize_and_insert(kv_new: torch.Tensor, cache: torch.Tensor, fmt: formats.KVFormat, slot_mapping: torch.Tensor,
                        kv_scale: torch.Tensor | None = None) -> None:
    """Launch the insert kernel on validated arguments (see :func:`sparse_mla.ops.quantize_and_insert`)."""
    launch_configs.refuse_unread(frozenset({fmt.name}), cache.device)
    n = kv_new.shape[0]
    if n == 0:
        return
    launch = cached_launch(_insert_kernel, (("FMT", fmt.code), ("BS", cache.shape[1]), ("DIM", fmt.dim),
                                            ("DIM_P2", triton.next_power_of_2(fmt.dim))))
    launch((n,), kv_new, kv_new.stride(0), slot_mapping, cache, cache.stride(0), cache.shape[0] * cache.shape[1],
           slot_mapping if kv_scale is None else kv_scale)


def dequantize_and_gather(cache: torch.Tensor, fmt: formats.KVFormat, kv_scale: torch.Tensor | None,
                          slots: torch.Tensor, out: torch.Tensor | None = None,
                          native_fp8: bool | None = None) -> torch.Tensor:
    """Launch the gather kernel: ``slots`` (any shape) -> ``slots.shape + (d,)`` bf16 (into ``out``, checked by
    ``gather_args``, when given). native_fp8: decode fp8 bytes with conversion instructions (default: where the
    device's target has them, :attr:`.targets.Target.native_fp8`) or with integer operations."""
    launch_configs.refuse_unread(frozenset({fmt.name}), cache.device)
    flat = slots.reshape(-1).contiguous()
    if out is None:
        out = torch.empty(flat.numel(), fmt.dim, dtype=torch.bfloat16, device=cache.device)
    if flat.numel():
        pa, pb, pc, _ = latent_pieces(fmt.dim)
        with on_device_of(cache):
            _gather_kernel[(flat.numel(),)](cache, cache.stride(0), cache.shape[0] * cache.shape[1], flat, out,
                                            flat if kv_scale is None else kv_scale,
                                            FMT=fmt.code, BS=cache.shape[1], PA=pa, PB=pb, PC=pc,
                                            NATIVE_FP8=targets.target_of(cache.device).native_fp8 if native_fp8 is None
                                            else native_fp8, **fp_fusion())
    return out.view(*slots.shape, fmt.dim)
