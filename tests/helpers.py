"""Helpers shared by the test files: the device the tests run on, size tables, error measures, random inputs."""
from __future__ import annotations

import os
from typing import TypeVar

import torch

from sparse_mla import verify

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
# Triton kernels run on a GPU, or on the CPU in Triton's interpreter (tests/conftest.py switches it on)
KERNEL_RUNS = ON_GPU or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
T = TypeVar("T")


def sized(cpu: T, cuda: T) -> T:
    """A size table's entry for this machine: ``cpu`` (interpreter-sized) or ``cuda`` (serving-sized)."""
    return cuda if ON_GPU else cpu


rel_err = verify.rel_err


def random_scope(gen: torch.Generator, fmt: str, dim: int, num_tokens: int, width: int, num_blocks: int,
                 block_size: int, lens_mode: str = "random"):
    """:func:`sparse_mla.verify.random_scope` on :data:`DEVICE`."""
    return verify.random_scope(gen, fmt, dim, num_tokens, width, num_blocks, block_size, DEVICE, lens_mode)


def random_sink(gen: torch.Generator, num_heads: int) -> torch.Tensor:
    """:func:`sparse_mla.verify.random_sink` on :data:`DEVICE`."""
    return verify.random_sink(gen, num_heads, DEVICE)


def check_close(got, ref) -> None:
    """An attention op's ``(out, lse)`` against the reference's: no NaN, rel err < 1e-2, ``+inf`` LSE exactly on
    the rows with no key (whose output is 0), LSE close elsewhere."""
    (out, lse), (ref_out, ref_lse) = got, ref
    assert not out.isnan().any(), "NaN in the kernel's output"
    assert rel_err(out, ref_out) < 1e-2
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isinf(lse) & (lse > 0), ~finite), "+inf LSE exactly on the rows with no key"
    assert torch.allclose(lse[finite], ref_lse[finite], atol=2e-3, rtol=1e-3)
    assert (out[~finite] == 0).all()


SINK_CHANGES = ("data", "resize", "wide")  # how repoint_sink changes a layer's sink under it


def repoint_sink(layer, change: str) -> None:
    """Change a layer's 4-head sink without its setter, keeping the buffer's tensor object: ``"data"`` (2 values,
    ``sink.data = ...``), ``"resize"`` (``sink.resize_(2)``) or ``"wide"`` (64 values, as a whole model's sink on a
    shard)."""
    device = layer.sink.device
    if change == "data":
        layer.sink.data = torch.zeros(2, device=device)
    elif change == "resize":
        layer.sink.resize_(2)
    else:
        layer.sink.data = torch.zeros(64, device=device)
