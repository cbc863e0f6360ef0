"""Entry checks shared by every backend of the attention ops (DESIGN §4).

Every backend calls :func:`decode_args` / :func:`prefill_args` first, so all of them reject the
same bad inputs with the same ``ValueError`` and see the same normalised arguments.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

from .._checks import check_finite, check_index_range, check_no_overlap, check_scale, check_sink, check_tensor
from ..formats import KVFormat, resolve_cache, resolve_cache_once

D_V = 512  # output width: the 512-d latent (V4: all of it; V3.2: the nope part of 576)


def debug_checks_enabled() -> bool:
    """Whether fast kernels also check index ranges on entry (``SPARSE_MLA_DEBUG=1``)."""
    return os.environ.get("SPARSE_MLA_DEBUG", "0") not in ("", "0")


@dataclass(frozen=True)
class Scope:
    """One index scope: the first ``lens[t]`` entries of ``indices[t]`` are slots of ``cache``.

    cache: ``(num_blocks, block_size, token_bytes)`` paged cache of format ``fmt``.
    indices: ``(T, width)`` int32 slots (``block * block_size + offset``), ``-1`` = invalid.
    lens: ``(T,)`` int32 in ``[0, width]``.
    """

    cache: torch.Tensor
    fmt: KVFormat
    indices: torch.Tensor
    lens: torch.Tensor

    @property
    def num_slots(self) -> int:
        return self.cache.shape[0] * self.cache.shape[1]


@dataclass(frozen=True)
class AttentionArgs:
    """Normalised arguments: q ``(T, H, d)`` bf16, one or two scopes, sink ``(H,)`` f32 or None."""

    q: torch.Tensor
    scopes: tuple[Scope, ...]
    sink: torch.Tensor | None
    scale: float
    out: torch.Tensor | None = None  # (T, H, 512) bf16, contiguous: written in place when given
    order: torch.Tensor | None = None  # (T,) int32 permutation: the order programs take tokens in (ops.order)


@functools.lru_cache(maxsize=64)
def _full_lens(num_tokens: int, width: int, device: torch.device) -> torch.Tensor:
    """``(num_tokens,)`` int32 lens of ``width`` (no lens given: the full rows), made once per shape: only read."""
    return torch.full((num_tokens,), width, dtype=torch.int32, device=device)


def _scope(prefix: str, q: torch.Tensor, cache: torch.Tensor, indices: torch.Tensor, lens: torch.Tensor | None,
           fmt: str | KVFormat | None, check_ranges: bool, cache_name: str) -> Scope:
    cache, f = resolve_cache_once(cache, fmt, cache_name)
    if f.dim != q.shape[-1]:
        raise ValueError(f"q has head dim {q.shape[-1]} but {cache_name} holds {f.name} tokens of dim {f.dim}")
    num_tokens = q.shape[0]
    check_tensor(f"{prefix}indices", indices, dtype=torch.int32, shape=(num_tokens, None), device=q.device)
    check_tensor(cache_name, cache, device=q.device)
    width = indices.shape[1]
    if lens is None:
        lens = _full_lens(num_tokens, width, q.device)
    check_tensor(f"{prefix}lens", lens, dtype=torch.int32, shape=(num_tokens,), device=q.device)
    # the kernels read lens and each index row at unit stride
    lens = lens.contiguous()
    if indices.stride(1) != 1:
        indices = indices.contiguous()
    if check_ranges:
        if num_tokens and bool(((lens < 0) | (lens > width)).any()):
            raise ValueError(f"{prefix}lens must lie in [0, {width}] (the width of {prefix}indices)")
        within = torch.arange(width, device=q.device)[None, :] < lens[:, None]
        check_index_range(f"{prefix}indices", indices, cache.shape[0] * cache.shape[1], within)
    return Scope(cache, f, indices, lens)


def _sink_and_scale(q: torch.Tensor, sink: torch.Tensor | None, scale: float | None,
                    check_values: bool) -> tuple[torch.Tensor | None, float]:
    if sink is not None:
        # its values only in the reference / debug mode: the check syncs
        sink = check_sink(sink, q.shape[1], q.device, values=check_values).contiguous()
    return sink, check_scale(q.shape[-1] ** -0.5 if scale is None else scale)


def decode_args(q, cache, indices, lens=None, extra_cache=None, extra_indices=None, extra_lens=None,
                sink=None, scale=None, fmt=None, check_ranges: bool = True, out=None,
                cache_name: str = "cache", order=None) -> AttentionArgs:
    """Check and normalise the arguments of ``sparse_attention_decode`` (``cache_name``: what errors
    call the first scope's cache; prefill's is its workspace ``kv``)."""
    check_tensor("q", q, dtype=torch.bfloat16, ndim=3)
    if q.shape[-1] not in (512, 576):
        raise ValueError(f"q must have head dim 512 (V4) or 576 (V3.2), got {q.shape[-1]}")
    if isinstance(cache, torch.Tensor) and cache.device != q.device:  # before the indices are checked against q
        raise ValueError(f"q must be on {cache_name}'s device {cache.device}, got {q.device}")
    scopes = [_scope("", q, cache, indices, lens, fmt, check_ranges, cache_name)]
    if (extra_cache is None) != (extra_indices is None):
        raise ValueError("extra_cache and extra_indices must be given together")
    if extra_cache is not None:
        scopes.append(_scope("extra_", q, extra_cache, extra_indices, extra_lens, fmt, check_ranges, "extra_cache"))
    elif extra_lens is not None:
        raise ValueError("extra_lens given without extra_cache / extra_indices")
    sink, scale = _sink_and_scale(q, sink, scale, check_ranges)
    if out is not None:
        check_tensor("out", out, dtype=torch.bfloat16, shape=(q.shape[0], q.shape[1], D_V), device=q.device)
        if not out.is_contiguous():
            raise ValueError("out must be contiguous")
        inputs = {"q": q, "sink": sink}
        for scope, prefix, name in zip(scopes, ("", "extra_"), (cache_name, "extra_cache")):
            inputs.update({name: scope.cache, f"{prefix}indices": scope.indices, f"{prefix}lens": scope.lens})
        check_no_overlap("out", out, inputs)
    return AttentionArgs(q, tuple(scopes), sink, scale, out, _order(order, q, check_ranges))


def _order(order: torch.Tensor | None, q: torch.Tensor, check_values: bool) -> torch.Tensor | None:
    """``order`` checked: ``(T,)`` int32 on q's device, and (a sync: with the index checks) a permutation of
    ``0 … T-1``. Without that check the kernels clamp each entry into range, so a bad order never touches
    memory outside the op's tensors, but the rows it misses are wrong: unwritten, or (split key lists)
    merged from unwritten partials."""
    if order is None:
        return None
    num_tokens = q.shape[0]
    check_tensor("order", order, dtype=torch.int32, shape=(num_tokens,), device=q.device)
    if check_values and num_tokens:
        hint = f"a permutation of 0 … {num_tokens - 1}, e.g. sparse_mla.ops.longest_first(lens, extra_lens)"
        outside = (order < 0) | (order >= num_tokens)
        if bool(outside.any()):
            raise ValueError(f"order holds {int(order[outside][0])}, out of range: it must be {hint}")
        counts = torch.bincount(order.long(), minlength=num_tokens)
        if bool((counts != 1).any()):
            twice, missing = int((counts > 1).nonzero()[0]), int((counts == 0).nonzero()[0])
            raise ValueError(f"order holds token {twice} more than once and misses token {missing}: it must be {hint}")
    return order.contiguous()


def prefill_args(q, kv, indices, lens=None, sink=None, scale=None, check_ranges: bool = True,
                 out=None) -> AttentionArgs:
    """Check and normalise ``sparse_attention_prefill``'s arguments; ``kv (S, d)`` becomes a
    one-token-per-block bf16 cache so every backend reads it like a paged scope."""
    check_tensor("q", q, dtype=torch.bfloat16, ndim=3)
    check_tensor("kv", kv, dtype=torch.bfloat16, shape=(None, q.shape[-1]), device=q.device)
    if kv.stride(-1) != 1:
        raise ValueError("kv must have contiguous rows (stride(-1) == 1)")
    return decode_args(q, kv.unsqueeze(1), indices, lens, sink=sink, scale=scale, check_ranges=check_ranges,
                       out=out, cache_name="kv")


def insert_args(kv_new, cache, slot_mapping, fmt=None,
                check_values: bool = True) -> tuple[torch.Tensor, torch.Tensor, KVFormat, torch.Tensor]:
    """Check ``quantize_and_insert``'s arguments; returns ``kv_new`` with unit-stride rows, the paged
    cache view, its format and ``slot_mapping`` contiguous (the kernel reads both at unit stride).

    With ``check_values`` (the reference, or ``SPARSE_MLA_DEBUG=1``) also slot ranges and finiteness.
    """
    cache, f = resolve_cache(cache, fmt)
    check_tensor("kv_new", kv_new, dtype=torch.bfloat16, shape=(None, f.dim), device=cache.device)
    check_tensor("slot_mapping", slot_mapping, dtype=(torch.int32, torch.int64), shape=(kv_new.shape[0],),
                 device=cache.device)
    check_no_overlap("cache", cache, {"kv_new": kv_new, "slot_mapping": slot_mapping})
    if check_values:
        check_index_range("slot_mapping", slot_mapping, cache.shape[0] * cache.shape[1])
        check_finite("kv_new", kv_new[slot_mapping >= 0])
    if kv_new.stride(1) != 1:
        kv_new = kv_new.contiguous()
    return kv_new, cache, f, slot_mapping.contiguous()


def gather_args(cache, slots, fmt=None, check_ranges: bool = True) -> tuple[torch.Tensor, KVFormat]:
    """Check ``dequantize_and_gather``'s arguments; returns the paged cache view and its format."""
    cache, f = resolve_cache(cache, fmt)
    check_tensor("slots", slots, dtype=(torch.int32, torch.int64), device=cache.device)
    if check_ranges:
        check_index_range("slots", slots, cache.shape[0] * cache.shape[1])
    return cache, f
