"""The shared e4m3 decode of :mod:`sparse_mla.ops.fp8`: integer operations (targets without Triton's e4m3 type)
and the native conversion give torch's ``float8_e4m3fn`` values for every finite code, once times their gain."""
from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from helpers import DEVICE
from sparse_mla.ops.fp8 import e4m3_decode, e4m3_gain

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
