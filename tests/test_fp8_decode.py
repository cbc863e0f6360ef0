"""The shared e4m3 decode of :mod:`sparse_mla.ops.fp8`: integer operations (targets without Triton's e4m3 type)
and the native conversion give torch's ``float8_e4m3fn`` values for every finite code, once times their gain."""
from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from helpers import DEVICE
from sparse_mla.ops.fp8 import e4m3_decode, e4m3_gain, e4m3_ue8m0_bf16

NAN_CODES = (0x7F, 0xFF)


@triton.jit
def _decode_kernel(raw_ptr, out_ptr, NATIVE_FP8: tl.constexpr):
    cols = tl.arange(0, 256)
    vals = e4m3_decode(tl.load(raw_ptr + cols), NATIVE_FP8)
    tl.store(out_ptr + cols, vals * e4m3_gain(NATIVE_FP8))


def decode_all(native: bool) -> torch.Tensor:
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).to(DEVICE)
    out = torch.full((256,), float("nan"), dtype=torch.float32, device=DEVICE)
    _decode_kernel[(1,)](codes, out, NATIVE_FP8=native)
    return out.cpu()


@pytest.mark.parametrize("native", [False, True])
def test_every_finite_code_decodes_to_torchs_value(native):
    want = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    got = decode_all(native)
    finite = torch.ones(256, dtype=torch.bool)
    finite[list(NAN_CODES)] = False
    assert torch.equal(got[finite], want[finite])
    # signed zeros too: 0x80 is -0
    assert torch.equal(torch.signbit(got[finite]), torch.signbit(want[finite]))


def test_the_integer_decode_reads_the_nan_codes_as_480():
    """The caches never hold them (the quantisers saturate at ±448); the integer decode makes them ±480."""
    got = decode_all(False)
    assert got[0x7F].item() == 480.0 and got[0xFF].item() == -480.0


def test_the_integer_decode_is_the_value_over_its_gain():
    """Without the gain the integer decode's values are the e4m3 numbers times 2^-8 (the callers fold the 2^8 into
    a scale they multiply by anyway)."""
    codes = torch.tensor([0x01, 0x08, 0x38, 0x7E, 0x81], dtype=torch.uint8)  # min subnormal, min normal, 1, 448, -sub

    @triton.jit
    def raw_decode(raw_ptr, out_ptr):
        cols = tl.arange(0, 8)
        tl.store(out_ptr + cols, e4m3_decode(tl.load(raw_ptr + cols, mask=cols < 5, other=0), False), mask=cols < 5)

    out = torch.zeros(5, dtype=torch.float32, device=DEVICE)
    raw_decode[(1,)](codes.to(DEVICE), out)
    assert torch.equal(out.cpu(), codes.view(torch.float8_e4m3fn).float() * 2.0 ** -8)


@triton.jit
def _ue8m0_bf16_kernel(raw_ptr, out_ptr):
    """Element ``i = 256 a + c``: code ``c`` times ``2^(e-127)``, ``e = (a + c) % 256``, as bf16 through the inline
    PTX: every (code, exponent) pair once, and neighbours (which share a thread's packed registers) of other scales."""
    i = tl.arange(0, 65536)
    code = i % 256
    tl.store(out_ptr + i, e4m3_ue8m0_bf16(tl.load(raw_ptr + code), ((i // 256 + code) % 256).to(tl.uint8)))


@pytest.mark.skipif(DEVICE.type != "cuda" or torch.version.hip is not None, reason="inline PTX: an NVIDIA GPU")
def test_the_ptx_bf16_decode_is_the_float32_product_rounded_for_every_code_and_scale():
    """e4m3_ue8m0_bf16 (the PTX_DECODE route of sm_80 / sm_86) against the float32 route of the other targets, bit
    for bit: every code, every ue8m0 exponent (2^-127, a bf16 subnormal, up to 2^127; 255 is NaN), so subnormal
    codes, tiny and huge scales, signed zeros and products that leave bf16's range (inf, or rounded subnormals)."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    out = torch.empty(65536, dtype=torch.bfloat16, device=DEVICE)
    _ue8m0_bf16_kernel[(1,)](codes.to(DEVICE), out)
    i = torch.arange(65536)
    exps = (i // 256 + i % 256) % 256
    values = decode_all(False)[i % 256]  # the integer route's e4m3 numbers: ±480 for the NaN codes, as the PTX reads
    scale = torch.where(exps == 255, float("nan"), torch.exp2(exps.double() - 127))
    want = (values.double() * scale).float().to(torch.bfloat16)
    got = out.cpu()
    assert torch.equal(got.isnan(), want.isnan())
    same = ~want.isnan()
    assert torch.equal(got[same].view(torch.int16), want[same].view(torch.int16))
