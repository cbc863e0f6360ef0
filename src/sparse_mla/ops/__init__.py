"""Sparse attention ops (DESIGN §4) with backend selection.

``backend="auto"`` picks the fastest implementation available for the inputs' device; any
backend can be forced by name. All backends share the argument checks of :mod:`.validate`.
"""
from __future__ import annotations

import os

import torch

from .._checks import check_tensor
from . import reference
from .order import longest_first
from .validate import debug_checks_enabled, decode_args, gather_args, insert_args, prefill_args

try:
    from . import triton_attention, triton_cache, triton_index
except ImportError:  # no Triton on this platform: the reference backend still works
    triton_attention = triton_cache = triton_index = None

BACKENDS = ("reference", "triton")


def check_backend_name(name: str) -> None:
    """``name`` is ``"auto"`` or one of :data:`BACKENDS`."""
    if name != "auto" and name not in BACKENDS:
        raise ValueError(f"backend must be 'auto' or one of {BACKENDS}, got {name!r}")


def _backend(name: str, first: torch.Tensor, first_name: str) -> str:
    """The backend to run: ``name`` resolved for the device of the op's first tensor argument."""
    device = check_tensor(first_name, first).device
    check_backend_name(name)
    if name == "auto":
        return "triton" if device.type == "cuda" and triton_attention is not None else "reference"
    if name == "triton" and triton_attention is None:
        raise ValueError("backend 'triton' needs the triton package, which is not installed")
    if name == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        raise ValueError(f"backend 'triton' needs CUDA tensors (got {device}), or TRITON_INTERPRET=1 on the CPU")
    return name


def attention_kernel(backend: str, q: torch.Tensor, cache: torch.Tensor) -> str:
    """What ``sparse_attention_decode(q, cache, ..., backend=backend)`` runs: ``"reference"``, ``"triton"`` or
    ``"gluon"`` (the Hopper kernel, for V4 fp8_v4 / bf16 caches), resolving ``"auto"`` for ``q``'s device."""
    if _backend(backend, q, "q") == "reference":
        return "reference"
    empty = torch.full((q.shape[0], 1), -1, dtype=torch.int32, device=q.device)
    args = decode_args(q, cache, empty, check_ranges=False)
    return "gluon" if triton_attention.gluon_attention.supported(args) else "triton"


def sparse_attention_decode(
    q: torch.Tensor,
    cache: torch.Tensor,
    indices: torch.Tensor,
    lens: torch.Tensor | None = None,
    extra_cache: torch.Tensor | None = None,
    extra_indices: torch.Tensor | None = None,
    extra_lens: torch.Tensor | None = None,
    sink: torch.Tensor | None = None,
    scale: float | None = None,
    fmt: str | None = None,
    backend: str = "auto",
    out: torch.Tensor | None = None,
    order: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA attention of each query token over two index scopes of paged caches.

    q: ``(T, H, d)`` bf16, d = 512 (V4) or 576 (V3.2). cache / extra_cache: paged caches
    ``(num_blocks, block_size, token_bytes)`` in any format of :mod:`sparse_mla.formats`.
    indices / extra_indices: ``(T, width)`` int32 slots, ``-1`` invalid; token ``t`` attends to the
    first ``lens[t]`` entries of each (``lens``: ``(T,)`` int32, default the full width).
    sink: ``(H,)`` float32 logits joining the softmax denominator only. scale defaults to d**-0.5.
    fmt: the caches' format name (``"fp8_v4"``, ``"bf16"``, ``"fp8_v32"``), optional: the format is
    inferred from each cache's dtype and last axis, and a given ``fmt`` is checked against it.
    backend: ``"auto"`` (the Triton kernels on a CUDA device, else the reference), ``"reference"``
    (plain PyTorch) or ``"triton"`` (on the CPU only under ``TRITON_INTERPRET=1``).
    Returns out ``(T, H, 512)`` bf16 (written into ``out`` when given: contiguous, that shape) and
    lse ``(T, H)`` float32 (natural log over real keys, ``+inf`` for a row with no valid key, whose
    output is 0).
    order: ``(T,)`` int32, a permutation of the tokens: the order the GPU kernels start them in, which
    changes their speed, never their results. ``longest_first(lens, extra_lens)``, computed once per step,
    keeps ragged lists from leaving SMs idle at the end (up to 22 % faster on C128A decode).
    """
    if _backend(backend, q, "q") == "reference":
        return reference.run(decode_args(q, cache, indices, lens, extra_cache, extra_indices, extra_lens, sink,
                                         scale, fmt, out=out, order=order))
    args = decode_args(q, cache, indices, lens, extra_cache, extra_indices, extra_lens, sink, scale, fmt,
                       check_ranges=debug_checks_enabled(), out=out, order=order)
    return triton_attention.run(args)


def sparse_attention_prefill(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    lens: torch.Tensor | None = None,
    sink: torch.Tensor | None = None,
    scale: float | None = None,
    backend: str = "auto",
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse attention over a bf16 workspace ``kv (S, d)``: ``indices (T, width)`` int32 rows of kv.

    Same semantics and returns as :func:`sparse_attention_decode`.
    """
    if _backend(backend, q, "q") == "reference":
        return reference.run(prefill_args(q, kv, indices, lens, sink, scale, out=out))
    return triton_attention.run(prefill_args(q, kv, indices, lens, sink, scale, check_ranges=debug_checks_enabled(),
                                             out=out))


def quantize_and_insert(kv_new: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor,
                        fmt: str | None = None, backend: str = "auto") -> None:
    """Quantise ``kv_new (n, d)`` bf16 into the paged ``cache`` at ``slot_mapping (n,)``; ``-1`` is skipped.

    The reference checks slot ranges and finiteness (``ValueError``); the Triton kernel does so under
    ``SPARSE_MLA_DEBUG=1`` and otherwise skips out-of-range slots.
    """
    if _backend(backend, kv_new, "kv_new") == "reference":
        reference.quantize_and_insert(*insert_args(kv_new, cache, slot_mapping, fmt))
    else:
        triton_cache.quantize_and_insert(*insert_args(kv_new, cache, slot_mapping, fmt,
                                                      check_values=debug_checks_enabled()))


def dequantize_and_gather(cache: torch.Tensor, slots: torch.Tensor, fmt: str | None = None,
                          backend: str = "auto") -> torch.Tensor:
    """Dequantised tokens at ``slots`` (any shape; ``-1`` reads as zeros): ``slots.shape + (d,)`` bf16."""
    if _backend(backend, cache, "cache") == "reference":
        return reference.dequantize_and_gather(*gather_args(cache, slots, fmt), slots)
    return triton_cache.dequantize_and_gather(*gather_args(cache, slots, fmt, debug_checks_enabled()), slots)


__all__ = ["sparse_attention_decode", "sparse_attention_prefill", "quantize_and_insert", "dequantize_and_gather",
           "longest_first", "attention_kernel", "BACKENDS"]
