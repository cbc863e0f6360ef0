"""The plan/run split of a layer call (DESIGN §5).

Everything a layer call needs that does not depend on its ``q`` is resolved once per step and layer
configuration, into a :class:`LayerPlan` kept by the step's :class:`~sparse_mla.metadata.StepMetadata`: which
index lists each part of the batch reads, which implementation runs (:mod:`sparse_mla.ops.dispatch`), the
kernels' grids, splits, scratch buffers and decode orders. A call then only checks its tensors' attributes and
launches.

Caches are validated once per cache tensor, not once per call (``formats.resolve_cache_once``).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from .cache import PagedCache
from .formats import IdentityMemo, KVFormat, resolve_cache_once
from .ops import dequantize_and_gather, sparse_attention_decode, sparse_attention_prefill
from .ops.dispatch import resolve_backend

PREFILL_MODES = ("paged", "workspace", "mixed")


class CacheView(NamedTuple):
    """A validated paged cache: the ``(num_blocks, block_size, token_bytes)`` tensor, its format, and whether
    its base and page stride are 16-byte aligned. ``key`` is what a plan depends on."""

    tensor: torch.Tensor
    fmt: KVFormat
    aligned: bool
    key: tuple


_VIEWS = IdentityMemo()  # paged cache view (one per validated cache tensor) -> its CacheView


def resolve_cache_arg(cache: object, name: str) -> CacheView:
    """A :class:`PagedCache` or paged cache tensor, validated (``formats.resolve_cache_once``)."""
    tensor = cache.data if isinstance(cache, PagedCache) else cache
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a PagedCache or a paged cache tensor, got {type(cache).__name__}")
    paged, fmt = resolve_cache_once(tensor, None, name)
    return _VIEWS.get(paged, None, lambda: _view(paged, fmt))


def _view(paged: torch.Tensor, fmt: KVFormat) -> CacheView:
    aligned = paged.data_ptr() % 16 == 0 and paged.stride(0) * paged.element_size() % 16 == 0
    return CacheView(paged, fmt, aligned, (fmt.name, fmt.dim, aligned, paged.shape[0], paged.shape[1], paged.device))


class LayerPlan:
    """One layer configuration's work in one step.

    Rows ``[0, num_decode_tokens)`` (decodes, longest key lists first) and ``[num_decode_tokens, num_tokens)``
    (prefill chunks) are launched separately; ``prefill_mode="mixed"`` launches all rows at once, ``"workspace"``
    gathers each prefill chunk's keys into the shared bf16 workspace first. layer: the
    :class:`~sparse_mla.layer.SparseMLAAttention` whose configuration (kind, heads, head_dim, backend, mode,
    workspace size, batch invariance, whether it has a sink) the plan is for — every layer of the step with
    that configuration shares it, so calls pass their own sink and scale; views: the caches by kind, as
    resolved for this plan.
    """

    def __init__(self, meta, layer, views: dict[str, CacheView]) -> None:
        batch = meta.batch
        self.meta = meta
        self.kind, self.head_dim, self.backend = layer.kind, layer.head_dim, layer.backend
        self.workspace_bytes = layer.workspace_bytes
        self.impl = resolve_backend(layer.backend, batch.device)
        self.n_dec, self.n_tok, self.capacity = batch.num_decode_tokens, batch.num_tokens, batch.token_capacity
        scopes = []  # (kind, indices, lens)
        if "swa" in views:
            scopes.append(("swa", meta.swa_indices, meta.swa_lens))
        if layer.kind in ("c4a", "dsa"):
            scopes.append((layer.kind, meta.picks_indices, meta.picks_lens))
        elif layer.kind == "c128a":
            scopes.append(("c128a", meta.c128a_indices, meta.c128a_lens))
        self.scopes = scopes
        self.cache_kinds = tuple(k for k, _, _ in scopes)
        mode = layer.prefill_mode
        parts = []  # (rows, order)
        if mode == "mixed":
            parts.append((slice(0, self.n_tok), None))
        else:
            if self.n_dec:
                parts.append((slice(0, self.n_dec), meta.decode_order(layer.kind)))
            if self.n_tok > self.n_dec and mode == "paged":  # many waves of programs: their order hardly matters
                parts.append((slice(self.n_dec, self.n_tok), None))
        self.workspace = mode == "workspace" and self.n_tok > self.n_dec
        self.parts = []  # (rows, order, launch or None (reference), index rows per scope, lens per scope)
        for rows, order in parts:
            indices = tuple(idx[rows] for _, idx, _ in scopes)
            lens = tuple(ln[rows] for _, _, ln in scopes)
            launch = None
            if self.impl == "triton":
                from .ops.triton_attention import AttentionPlan  # needs Triton: only this backend gets here

                launch = AttentionPlan(
                    (rows.stop - rows.start, layer.num_heads, layer.head_dim), batch.device,
                    [(views[k].fmt, views[k].tensor.shape[1], idx.shape[1]) for k, idx, _ in scopes],
                    layer.sink is not None, order is not None, batch_invariant=layer.batch_invariant,
                    pages_16_byte_aligned=all(v.aligned for v in views.values()), scratch=True)
            self.parts.append((rows, order, launch, indices, lens))
        # the LSE the kernels write and the layer drops
        self.lse = torch.empty(self.capacity, layer.num_heads, dtype=torch.float32, device=batch.device)

    def __call__(self, q: torch.Tensor, out: torch.Tensor, caches: tuple[torch.Tensor, ...],
                 kept_picks: torch.Tensor | None, sink: torch.Tensor | None, scale: float) -> None:
        """Attention of every token into ``out``; padding rows get zeros. q / out: ``(T, H, d)`` / ``(T, H, 512)``
        with unit-stride rows / contiguous; caches: the scopes' cache tensors in scope order; kept_picks: the
        layer's kept picks (c4a / dsa, for the workspace mode); sink / scale: the calling layer's."""
        for rows, order, launch, indices, lens in self.parts:
            q_rows = q if rows.start == 0 else q[rows]  # row 0 on: the same pointer, and the plan knows the count
            out_rows = out if rows.start == 0 else out[rows]
            if launch is not None:
                launch(q_rows, out_rows, self.lse, sink, scale, caches, indices, lens, order)
            else:
                n = rows.stop - rows.start
                self._reference(q_rows[:n], out_rows[:n], caches, indices, lens, order, sink, scale)
        if self.workspace:
            self._prefill_workspace(q, out, caches, kept_picks, sink, scale)
        if self.n_tok < self.capacity:
            out[self.n_tok:].zero_()

    def _reference(self, q, out, caches, indices, lens, order, sink, scale) -> None:
        extra = {}
        if len(caches) > 1:
            extra = dict(extra_cache=caches[1], extra_indices=indices[1], extra_lens=lens[1])
        sparse_attention_decode(q, caches[0], indices[0], lens[0], sink=sink, scale=scale, backend=self.backend,
                                out=out, order=order, **extra)

    def _prefill_workspace(self, q, out, caches, kept_picks, sink, scale) -> None:
        from .layer import shared_workspace
        from .metadata import workspace_indices

        meta, kind, dim = self.meta, self.kind, self.head_dim
        by_kind = {k: c for c, (k, _, _) in zip(caches, self.scopes)}
        ws_all = shared_workspace(q.device, self.workspace_bytes // (2 * dim), dim)
        for chunk in meta.workspace_plan(kind, self.workspace_bytes, dim):
            ws = ws_all[: chunk.num_rows]
            n_c = chunk.compressed_slots.shape[0]
            if n_c:
                ws[:n_c] = dequantize_and_gather(by_kind[kind], chunk.compressed_slots, backend=self.backend)
            if chunk.swa_slots.shape[0]:
                ws[n_c:] = dequantize_and_gather(by_kind["swa"], chunk.swa_slots, backend=self.backend)
            idx, lens = workspace_indices(meta, chunk, kept_picks)
            sparse_attention_prefill(q[chunk.tokens], ws, idx, lens, sink, scale, backend=self.backend,
                                     out=out[chunk.tokens])
