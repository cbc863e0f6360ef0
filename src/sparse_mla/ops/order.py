"""Token order for the attention kernels (the ops' ``order`` argument): longest key lists first.

A program of the fast kernels holds an SM for a time proportional to its token's key blocks, and
the GPU starts programs in grid order as SMs come free. With ragged lists (C128A, mixed context
lengths) in token order, the last wave runs long programs on a few SMs while the rest idle;
starting the longest first (greedy longest-processing-time scheduling) keeps that tail short.
The order changes which SM computes a token, never what is computed: outputs are bitwise the same.
"""
from __future__ import annotations

import torch

from .._checks import check_no_overlap, check_tensor
from .dispatch import HAVE_TRITON, builders_use_triton
from .gluon.host import KEYS_PER_BLOCK  # the GPU kernels' key block: a program's time goes by these

if HAVE_TRITON:
    from .triton import index as triton_index

RANK_KERNEL_MAX_TOKENS = 8192  # the rank kernel's work grows as T²: past this a sort is cheaper (H100)


def longest_first(lens: torch.Tensor, extra_lens: torch.Tensor | None = None,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """Token numbers sorted by their count of 64-key blocks over both index scopes, most first (ties in
    token order): the ``order`` to give the attention ops, built once per step and shared by its layers.

    lens, extra_lens: ``(T,)`` int32 or int64, as given to the ops (negative entries count as 0).
    Returns ``(T,)`` int32 on their device (written into ``out`` when given: contiguous, that shape): one
    Triton launch on a GPU for up to 8192 tokens (no sync), a torch sort otherwise.
    """
    check_tensor("lens", lens, dtype=(torch.int32, torch.int64), ndim=1)
    num_tokens = lens.shape[0]
    if extra_lens is not None:
        check_tensor("extra_lens", extra_lens, dtype=(torch.int32, torch.int64), shape=(num_tokens,),
                     device=lens.device)
    if out is None:
        out = torch.empty(num_tokens, dtype=torch.int32, device=lens.device)
    check_tensor("out", out, dtype=torch.int32, shape=(num_tokens,), device=lens.device)
    if not out.is_contiguous():
        raise ValueError("out must be contiguous")
    check_no_overlap("out", out, {"lens": lens} if extra_lens is None else {"lens": lens, "extra_lens": extra_lens})
    fill_longest_first(lens, extra_lens, out)
    return out


def fill_longest_first(lens: torch.Tensor, extra_lens: torch.Tensor | None, out: torch.Tensor) -> None:
    """:func:`longest_first` into ``out`` without its argument checks, for callers whose buffers are known
    good (the step metadata, once per step)."""
    if builders_use_triton(lens.device) and lens.shape[0] <= RANK_KERNEL_MAX_TOKENS:
        triton_index.longest_first(lens, extra_lens, KEYS_PER_BLOCK, out)
    else:
        out.copy_(longest_first_torch(lens, extra_lens))


def key_blocks(lens: torch.Tensor) -> torch.Tensor:
    """``ceil(max(lens, 0) / 64)``: the key blocks of lists of these lengths."""
    return (lens.clamp(0, 1 << 30) + KEYS_PER_BLOCK - 1) // KEYS_PER_BLOCK


def longest_first_torch(lens: torch.Tensor, extra_lens: torch.Tensor | None = None) -> torch.Tensor:
    """Torch version of :func:`longest_first` (same arguments, checked there): a stable sort."""
    blocks = key_blocks(lens) + (0 if extra_lens is None else key_blocks(extra_lens))
    return torch.sort(blocks, descending=True, stable=True).indices.to(torch.int32)
