"""Reading ``float8_e4m3fn`` bytes (and V4.1's e2m1 codes) inside the Triton kernels, on every target (docs/design.md
§4, "Every GPU").

Triton has the ``fp8e4nv`` type only on CUDA capability 8.9 and later (even a bitcast to it fails to compile on
sm_80/86, and AMD's CDNA has other fp8 types), so elsewhere the kernels decode the bytes with integer operations:
byte ``b``'s fp16 bits ``((b & 0x7F) << 7) | ((b & 0x80) << 8)`` are the e4m3 number times 2^-8, exactly, for
every finite code (e4m3's 4-bit exponent of bias 7 lands in fp16's 5-bit one of bias 15; e4m3 subnormals land on
fp16 subnormals). The 2^8 is not multiplied back here: each caller folds :func:`e4m3_gain` into a scale it already
multiplies by. Codes 0x7F / 0xFF (NaN) decode to ±480 here where the conversion instructions give NaN: the library's
writers never store them from finite input (the ops reject non-finite ``kv_new``; quantisers saturate at ±448), only a
cache written elsewhere with NaN in it could hold them.
Where the target has the conversion (``NATIVE_FP8``, :attr:`.targets.Target.native_fp8`) it is used instead
(two codes per instruction) and the gain is 1. Encoding stays integer-only on every target (``triton_cache``).

e2m1 codes (fp4_v41: sign bit 3, two exponent bits of bias 1, one mantissa bit) are decoded the same way on every
target (Triton has no portable fp4 type): code ``c``'s fp16 bits ``((c & 7) << 9) | ((c & 8) << 12)`` are its value
times 2^-14, exactly (code 1, 0.5, lands on an fp16 subnormal; code 8 is -0); the caller folds :func:`e2m1_gain` into
the group's scale.
"""
from __future__ import annotations

import triton
import triton.language as tl

@triton.jit
def e4m3_decode(raw, NATIVE_FP8: tl.constexpr):
    """e4m3fn bytes ``raw`` (uint8, any shape; a float8 tensor's bytes viewed as uint8) -> float32 values: the e4m3
    numbers over ``e4m3_gain(NATIVE_FP8)``."""
    if NATIVE_FP8:
        vals = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        # the fp16 bits above in one shift and one mask: sign-extended, the byte's sign fills bits 7-15, so after the
        # shift exponent and mantissa sit in bits 7-13 and the sign in 14-15; the mask (0xBF80) clears bit 14 (12 %
        # fewer instructions in sm_80's fp8 key loop than two masks, two shifts and an or)
        x = raw.to(tl.int8, bitcast=True).to(tl.int16)
        vals = ((x << 7) & -16512).to(tl.float16, bitcast=True).to(tl.float32)
    return vals


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
