"""Reading ``float8_e4m3fn`` bytes (and V4.1's e2m1 codes) inside the Triton kernels, on every target (docs/design.md
§4, "Every GPU").

Triton converts ``fp8e4nv`` with instructions only on CUDA capability 8.9 and later (even a bitcast to it fails to
compile on sm_80/86) and on AMD's CDNA 4 (gfx950, OCP fp8; CDNA 3's instructions read the other e4m3, without negative
zero), so elsewhere the kernels decode the bytes with integer operations:
byte ``b``'s fp16 bits ``((b & 0x7F) << 7) | ((b & 0x80) << 8)`` are the e4m3 number times 2^-8, exactly, for
every finite code (e4m3's 4-bit exponent of bias 7 lands in fp16's 5-bit one of bias 15; e4m3 subnormals land on
fp16 subnormals). The 2^8 is not multiplied back here: each caller folds :func:`e4m3_gain` into a scale it already
multiplies by. Codes 0x7F / 0xFF (NaN) decode to ±480 here where the conversion instructions give NaN: the library's
writers never store them from finite input (the ops reject non-finite ``kv_new``; quantisers saturate at ±448), only a
cache written elsewhere with NaN in it could hold them.
Where the target has the conversion (``NATIVE_FP8``, :attr:`.targets.Target.native_fp8`) it is used instead
(two codes per instruction) and the gain is 1. Encoding stays integer-only on every target (``triton/cache.py``).

Where the tile scale is a power of two (ue8m0: fp8_v4, fp8_v41) a CUDA target without the conversion can instead
build bf16 directly (:func:`e4m3_ue8m0_bf16`, inline PTX): byte ``b``'s bf16 bits ``((b & 0x7F) << 4) | ((b & 0x80)
<< 8)`` are the e4m3 number times 2^-120, exactly (e4m3 subnormals land on bf16 subnormals), and two bf16
multiplies (by 2^120, then by the tile's 2^(e-127)) finish two codes per instruction, exact as the float32 route.

e2m1 codes (fp4_v41: sign bit 3, two exponent bits of bias 1, one mantissa bit) are decoded the same way on every
target (Triton has no portable fp4 type): code ``c``'s fp16 bits ``((c & 7) << 9) | ((c & 8) << 12)`` are its value
times 2^-14, exactly (code 1, 0.5, lands on an fp16 subnormal; code 8 is -0); the caller folds :func:`e2m1_gain` into
the group's scale.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .. import formats


@triton.jit
def e4m3_as_f16(raw):
    """e4m3fn bytes ``raw`` (uint8, any shape) -> float16: the e4m3 numbers over ``e4m3_gain(False)`` (2^8), exactly
    (an e4m3 subnormal lands on an fp16 subnormal), by integer operations on every target."""
    # the fp16 bits above in one shift and one mask: sign-extended, the byte's sign fills bits 7-15, so after the
    # shift exponent and mantissa sit in bits 7-13 and the sign in 14-15; the mask (0xBF80) clears bit 14 (12 %
    # fewer instructions in sm_80's fp8 key loop than two masks, two shifts and an or)
    x = raw.to(tl.int8, bitcast=True).to(tl.int16)
    return ((x << 7) & -16512).to(tl.float16, bitcast=True)


@triton.jit
def e4m3_decode(raw, NATIVE_FP8: tl.constexpr):
    """e4m3fn bytes ``raw`` (uint8, any shape; a float8 tensor's bytes viewed as uint8) -> float32 values: the e4m3
    numbers over ``e4m3_gain(NATIVE_FP8)``."""
    if NATIVE_FP8:
        vals = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        vals = e4m3_as_f16(raw).to(tl.float32)
    return vals


UE8M0_NAN = tl.constexpr(formats.UE8M0_NAN)
BF16_NAN_BITS = tl.constexpr(0x7FC0)
assert formats.UE8M0_BIAS == 127, "e4m3_ue8m0_bf16 reads a ue8m0 byte as bf16's exponent field"
# bf16 pairs for e4m3_ue8m0_bf16: 2^120 (undoes the bit placement's 2^-120) and -0 (the FMAs' addend: x*y + -0 keeps
# the sign of a zero product)
_BF16X2_2POW120 = 0x7B807B80
_BF16X2_NEG_ZERO = 0x80008000
# four e4m3 bytes ($2) and their scales' bf16 bits ($3-$6) -> four bf16 ($0: bytes 0 and 1, $1: bytes 2 and 3): each
# byte moved to the top of a 16-bit lane, its exponent and mantissa shifted down into bf16's (4 bits), then times
# 2^120 and its own scale (the four bytes need not share a tile: a thread's registers follow Triton's layout)
E4M3_UE8M0_BF16_PTX = tl.constexpr("""{
.reg .b32 lo, hi, t, two120, nz, s01, s23;
mov.b32 two120, %d;
mov.b32 nz, %d;
prmt.b32 lo, $2, 0, 0x1404;
prmt.b32 hi, $2, 0, 0x3424;
shr.b32 t, lo, 4;
and.b32 t, t, 0x07F007F0;
and.b32 lo, lo, 0x80008000;
or.b32 lo, lo, t;
shr.b32 t, hi, 4;
and.b32 t, t, 0x07F007F0;
and.b32 hi, hi, 0x80008000;
or.b32 hi, hi, t;
prmt.b32 s01, $3, $4, 0x5410;
prmt.b32 s23, $5, $6, 0x5410;
fma.rn.bf16x2 lo, lo, two120, nz;
fma.rn.bf16x2 hi, hi, two120, nz;
fma.rn.bf16x2 $0, lo, s01, nz;
fma.rn.bf16x2 $1, hi, s23, nz;
}""" % (_BF16X2_2POW120, _BF16X2_NEG_ZERO))


# four e4m3 bytes ($2) -> four float16 ($0: bytes 0 and 1, $1: bytes 2 and 3), e4m3_as_f16's bits: each byte moved to
# the top of a 16-bit lane, its sign kept there and its exponent and mantissa shifted down one bit into fp16's
E4M3_F16_PTX = tl.constexpr("""{
.reg .b32 lo, hi, t;
prmt.b32 lo, $2, 0, 0x1404;
prmt.b32 hi, $2, 0, 0x3424;
shr.b32 t, lo, 1;
and.b32 t, t, 0x3F803F80;
and.b32 lo, lo, 0x80008000;
or.b32 $0, lo, t;
shr.b32 t, hi, 1;
and.b32 t, t, 0x3F803F80;
and.b32 hi, hi, 0x80008000;
or.b32 $1, hi, t;
}""")


@triton.jit
def e4m3_f16_ptx(raw):
    """:func:`e4m3_as_f16` (the same bits) four bytes a few instructions, in inline PTX: CUDA targets (sm_80 / sm_86,
    whose Triton has no e4m3 conversion); not in Triton's CPU interpreter. Impure, as :func:`e4m3_ue8m0_bf16`."""
    return tl.inline_asm_elementwise(E4M3_F16_PTX, "=r,=r,r", [raw], dtype=tl.float16, is_pure=False, pack=4)


@triton.jit
def e4m3_ue8m0_bf16(raw, exps):
    """e4m3fn bytes ``raw`` (uint8, last axis a multiple of 4 in each thread's registers) times ``2^(exps - 127)``
    (ue8m0 bytes broadcast to ``raw``'s shape; ``formats.UE8M0_NAN``: NaN) -> bfloat16, the float32 product rounded.
    CUDA sm_80+ (inline PTX, ``fma.rn.bf16x2``); not in Triton's CPU interpreter. Codes 0x7F / 0xFF read ±480 as in
    :func:`e4m3_decode`'s integer route. Impure, so Triton keeps a dot operand's layout conversion on the bf16 result
    (as ``_decode_fence`` does)."""
    e = exps.to(tl.int32)
    # bf16 bits of 2^(e-127): ue8m0's bias is bf16's, so the byte is the exponent field, but for 2^-127 (subnormal)
    bits = tl.where(e == UE8M0_NAN, BF16_NAN_BITS, tl.where(e == 0, 0x0040, e << 7))
    return tl.inline_asm_elementwise(E4M3_UE8M0_BF16_PTX, "=r,=r,r,r,r,r,r", [raw, bits], dtype=tl.bfloat16,
                                     is_pure=False, pack=4)


@triton.jit
def e4m3_gain(NATIVE_FP8: tl.constexpr):
    """The factor that turns :func:`e4m3_decode`'s values (or a product with one of them as a factor) into the
    e4m3 numbers: 1 with the native conversion, 2^8 with the integer decode."""
    if NATIVE_FP8:
        gain = 1.0
    else:
        gain = 256.0
    return gain


@triton.jit
def e2m1_decode(codes):
    """e2m1 codes (int32 in ``[0, 16)``, any shape) -> float32 values: the e2m1 numbers over :func:`e2m1_gain`."""
    bits = ((codes & 7) << 9) | ((codes & 8) << 12)
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def e2m1_gain():
    """The factor (2^14) that turns :func:`e2m1_decode`'s values into the e2m1 numbers."""
    return 16384.0
