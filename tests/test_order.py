"""``longest_first``: the token order that balances the GPU kernels' waves (ops/order.py), its torch
version and its Triton kernel (on a CPU under ``TRITON_INTERPRET=1``)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from helpers import DEVICE, KERNEL_RUNS, ON_GPU, sized
from sparse_mla.ops import longest_first
from sparse_mla.ops.order import KEYS_PER_BLOCK, longest_first_torch

KERNEL_TOKENS = sized(cpu=[1, 127, 128, 300], cuda=[1, 127, 128, 300, 4099])


@given(lens=st.lists(st.tuples(st.integers(-3, 700), st.integers(0, 1100)), min_size=1, max_size=40))
def test_tokens_come_most_key_blocks_first_ties_in_token_order(lens):
    l0 = torch.tensor([a for a, _ in lens], dtype=torch.int32)
    l1 = torch.tensor([b for _, b in lens], dtype=torch.int64)
    order = longest_first_torch(l0, l1)
    assert order.dtype == torch.int32
    blocks = [-(-max(a, 0) // 64) - (-b // 64) for a, b in lens]
    keys = [(-blocks[t], t) for t in order.tolist()]
    assert sorted(order.tolist()) == list(range(len(lens))) and keys == sorted(keys)


@pytest.mark.skipif(not KERNEL_RUNS, reason="the Triton kernel needs a GPU or TRITON_INTERPRET=1")
@pytest.mark.parametrize("n", KERNEL_TOKENS)
@pytest.mark.parametrize("two_scopes", [False, True])
def test_kernel_gives_the_torch_order(n, two_scopes):
    from sparse_mla.ops.triton import index as triton_index

    gen = torch.Generator().manual_seed(n)
    l0 = torch.randint(-2, 4 * KEYS_PER_BLOCK, (n,), generator=gen, dtype=torch.int32)
    l1 = None
    if two_scopes:  # int64, strided, one huge entry (clamped alike on both paths)
        l1 = torch.randint(0, 20 * KEYS_PER_BLOCK, (2 * n,), generator=gen)[::2]
        l1[n // 2] = 1 << 40
    want = longest_first_torch(l0, l1)
    got = torch.full((n,), -1, dtype=torch.int32, device=DEVICE)
    triton_index.longest_first(l0.to(DEVICE), None if l1 is None else l1.to(DEVICE), KEYS_PER_BLOCK, got)
    assert torch.equal(got.cpu(), want)
    if ON_GPU:  # the public function takes the kernel there
        assert torch.equal(longest_first(l0.to(DEVICE), None if l1 is None else l1.to(DEVICE)).cpu(), want)


def test_out_is_written_in_place_and_large_batches_are_sorted():
    gen = torch.Generator().manual_seed(1)
    lens = torch.randint(0, 2000, (9000,), generator=gen, dtype=torch.int32)  # past the rank kernel's size
    out = torch.empty(9000, dtype=torch.int32, device=DEVICE)
    assert longest_first(lens.to(DEVICE), out=out) is out
    assert torch.equal(out.cpu(), longest_first_torch(lens))


def test_no_tokens_and_bad_arguments_are_named():
    assert longest_first(torch.zeros(0, dtype=torch.int32, device=DEVICE)).shape == (0,)
    with pytest.raises(ValueError, match=r"out must have shape \(3,\)"):
        longest_first(torch.zeros(3, dtype=torch.int32), out=torch.empty(4, dtype=torch.int32))
    lens = torch.zeros(3, dtype=torch.int32)
    with pytest.raises(ValueError, match="out overlaps lens in memory"):
        longest_first(lens, out=lens)
    with pytest.raises(ValueError, match="out must be contiguous"):
        longest_first(torch.zeros(3, dtype=torch.int32), out=torch.empty(6, dtype=torch.int32)[::2])
    with pytest.raises(ValueError, match=r"extra_lens must have shape \(3,\)"):
        longest_first(torch.zeros(3, dtype=torch.int32), torch.zeros(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="lens must have dtype"):
        longest_first(torch.zeros(3))
    with pytest.raises(TypeError, match="lens must be a torch.Tensor"):
        longest_first([1, 2])
