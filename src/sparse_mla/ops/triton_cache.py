"""Triton cache kernels: quantise-and-insert new tokens, dequantise-and-gather rows (DESIGN §4).

Bit-identical to the reference formats (:mod:`sparse_mla.formats`): the tile scale exponent is
computed exactly from the float bits of ``max(amax / 448, 1e-4)``, and e4m3 rounding is to nearest
even. One program handles one token. A slot of ``-1`` (or out of range) is skipped on insert and
reads as zeros on gather, so neither kernel touches memory outside the cache.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import formats
from . import launch_configs, targets
from .fp8 import e4m3_gain
from .triton_attention import (FMT_BF16, FMT_FP8_E4M3, FMT_FP8_V4, ROPE_DIM, UE8M0_BIAS, V4_BODY_BYTES,
                               V4_SCALE_BYTES, V4_TILE, V32_ROPE_OFFSET, V32_SCALE_OFFSET, V32_TILE, V32_TOKEN_BYTES,
                               _load_piece, _load_rope, _token_ptrs, kernel_const, latent_pieces)

E4M3_MAX = kernel_const(formats.E4M3_MAX)
MIN_SCALE = kernel_const(formats.MIN_SCALE)
E4M3_TOKEN_BYTES = kernel_const(formats.E4M3_TOKEN_BYTES)
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
def _round_half_even(y):
    f = tl.floor(y)
    r = y - f
    odd = (f.to(tl.int32) & 1) == 1
    return tl.where((r > 0.5) | ((r == 0.5) & odd), f + 1.0, f)


@triton.jit
def _e4m3_bits(x):
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
    sub = _round_half_even(a * 512.0).to(tl.int32)  # subnormals step by 2^-9; 8 is the smallest normal
    code = tl.where(a < 0.015625, sub, normal)
    return (sign | code).to(tl.uint8)


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
            q = _e4m3_bits(tl.math.div_rn(x, tl.broadcast_to(tl.load(kv_scale_ptr), x.shape)))
            tl.store(block_ptr + off * E4M3_TOKEN_BYTES + cols, q)
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
            q = _e4m3_bits(x * inv_scale[:, None])
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
    row_ptr, scale_ptr = _token_ptrs(cache_ptr, stride0, safe, FMT, BS, ROPE_OFF)
    kv_scale = 1.0
    if FMT == FMT_FP8_E4M3:  # the decode's gain folded in (the tiled formats fold it into their tile scales)
        kv_scale = tl.load(kv_scale_ptr) * e4m3_gain(NATIVE_FP8)
    dst = out_ptr + row_id * (ROPE_OFF + ROPE_DIM)
    _store_gathered(dst, _load_piece(row_ptr, scale_ptr, valid, 0, PA, FMT, tl.float32, 1, NATIVE_FP8), kv_scale,
                    0, PA, FMT)
    _store_gathered(dst, _load_piece(row_ptr, scale_ptr, valid, PA, PB, FMT, tl.float32, 1, NATIVE_FP8), kv_scale,
                    PA, PB, FMT)
    _store_gathered(dst, _load_piece(row_ptr, scale_ptr, valid, PA + PB, PC, FMT, tl.float32, 1, NATIVE_FP8),
                    kv_scale, PA + PB, PC, FMT)
    _store_gathered(dst, _load_rope(row_ptr, valid, FMT, ROPE_OFF, tl.float32, 1, NATIVE_FP8), kv_scale,
                    ROPE_OFF, ROPE_DIM, FMT)


def quantize_and_insert(kv_new: torch.Tensor, cache: torch.Tensor, fmt: formats.KVFormat, slot_mapping: torch.Tensor,
                        kv_scale: torch.Tensor | None = None) -> None:
    """Launch the insert kernel on validated arguments (see :func:`sparse_mla.ops.quantize_and_insert`)."""
    launch_configs.refuse_unread(frozenset({fmt.name}), cache.device)
    n = kv_new.shape[0]
    if n == 0:
        return
    stride0 = cache.stride(0)
    _insert_kernel[(n,)](kv_new, kv_new.stride(0), slot_mapping, cache, stride0, cache.shape[0] * cache.shape[1],
                         slot_mapping if kv_scale is None else kv_scale,
                         FMT=fmt.code, BS=cache.shape[1], DIM=fmt.dim, DIM_P2=triton.next_power_of_2(fmt.dim))


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
        _gather_kernel[(flat.numel(),)](cache, cache.stride(0), cache.shape[0] * cache.shape[1], flat, out,
                                        flat if kv_scale is None else kv_scale,
                                        FMT=fmt.code, BS=cache.shape[1], PA=pa, PB=pb, PC=pc,
                                        NATIVE_FP8=targets.target_of(cache.device).native_fp8 if native_fp8 is None
                                        else native_fp8)
    return out.view(*slots.shape, fmt.dim)
