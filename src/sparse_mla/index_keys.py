"""Writing the lightning indexer's keys into an :class:`~sparse_mla.indexer_cache.IndexerKeyCache` (DESIGN §6).

One entry point for the three producers of keys:

* V4: the indexer's own compressor (d = 128, ratio 4) writes its roped entries through it
  (:class:`sparse_mla.compressor.KVCompressor` with an ``IndexerKeyCache``);
* V4.1: the engine's ``k_norm(W_k latent)`` of each entry the kv-source layer's compressor completed, roped here at
  the entry's position (``positions=meta.entry_positions``, ``slots=meta.entry_slots``);
* V3.2: the engine's per-raw-token keys (already roped), at the raw token's slot (``batch.slot_mapping``: pages of
  64 raw tokens).

The fp8 bytes are the cache's writer's (:func:`~sparse_mla.indexer_cache.quantize_index_keys`); on a CUDA device a
Triton kernel writes them (:mod:`sparse_mla.ops.triton.index_cache`), elsewhere ``IndexerKeyCache.write``.
"""
from __future__ import annotations

import torch

from ._checks import check_distinct_slots, check_index_range, check_tensor
from .indexer_cache import INDEX_HEAD_DIM, IndexerKeyCache, check_storable_keys
from .ops.dispatch import resolve_backend
from .ops.validate import debug_checks_enabled
from .rope import V4_COMPRESS_ROPE, RopeSpec, rotate_interleaved_tail


def insert_index_keys(keys: torch.Tensor, cache: IndexerKeyCache, slots: torch.Tensor,
                      positions: torch.Tensor | None = None, rope: RopeSpec = V4_COMPRESS_ROPE,
                      backend: str = "auto") -> None:
    """Store ``keys (n, 128)`` (bf16 or float32) at ``slots (n,)`` int32 of ``cache``; ``-1`` skipped. With
    ``positions (n,)`` int32 the keys are first roped (V4's rope: the last ``rope.dim`` channels in interleaved
    pairs) at those positions (rows with slot ``-1`` may hold any position). Values — slots in range and none
    twice, the written rows' keys finite in bf16 and positions >= 0 — are checked on the reference path and under
    ``SPARSE_MLA_DEBUG=1`` (a sync); without them the kernel skips a slot out of range."""
    if not isinstance(cache, IndexerKeyCache):
        raise TypeError(f"cache must be an IndexerKeyCache, got {type(cache).__name__}")
    check_tensor("keys", keys, dtype=(torch.bfloat16, torch.float32), shape=(None, INDEX_HEAD_DIM),
                 device=cache.device)
    check_tensor("slots", slots, dtype=torch.int32, shape=(keys.shape[0],), device=cache.device)
    if positions is not None:
        check_tensor("positions", positions, dtype=torch.int32, shape=(keys.shape[0],), device=cache.device)
        if not isinstance(rope, RopeSpec) or rope.dim > INDEX_HEAD_DIM:
            raise ValueError(f"rope must be a RopeSpec of at most {INDEX_HEAD_DIM} channels, got {rope!r}")
    reference = resolve_backend(backend, keys.device) == "reference"
    checked = reference or debug_checks_enabled()  # values: a sync (docs/checks.md)
    if checked and positions is not None and bool((positions[slots >= 0] < 0).any()):
        raise ValueError("positions must be >= 0 where slots are (the rows written)")
    if reference:  # the reference writer checks the slots and the keys it stores (IndexerKeyCache.write)
        if positions is not None:
            keys = rotate_interleaved_tail(keys, positions.clamp_min(0), rope)
        cache.write(keys, slots)
        return
    if checked:  # the writer's checks, on what the kernel stores: the keys after the rope
        written = slots >= 0
        check_index_range("slots", slots, cache.num_slots)
        check_distinct_slots("slots", slots)
        stored = keys[written] if positions is None else rotate_interleaved_tail(keys[written], positions[written],
                                                                                 rope)
        check_storable_keys("keys", stored)
    from .ops.triton import index_cache

    index_cache.insert_index_keys(keys, cache.data, cache.fmt == "fp8", slots, positions,
                                  None if positions is None else _inv_freq(rope, cache.device))


_INV_FREQ: dict[tuple[RopeSpec, torch.device], torch.Tensor] = {}


def _inv_freq(rope: RopeSpec, device: torch.device) -> torch.Tensor:
    """``rope.inv_freq`` on ``device``, made once (a fixed buffer: CUDA graphs replay it)."""
    key = (rope, device)
    if key not in _INV_FREQ:
        _INV_FREQ[key] = rope.inv_freq(device)
    return _INV_FREQ[key]
