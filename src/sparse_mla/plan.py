"""The plan/run split of a layer call (DESIGN §5).

Everything a layer call needs that does not depend on its ``q`` is resolved once per step and layer
configuration, into a :class:`LayerPlan` kept by the step's :class:`~sparse_mla.metadata.StepMetadata`: which
index lists each part of the batch reads, which implementation runs (:mod:`sparse_mla.ops.dispatch`), the
kernels' grids, splits, scratch buffers and decode orders. A call then only checks its tensors' attributes and
launches.

Caches are validated once per cache tensor, not once per call (:mod:`sparse_mla.cache_views`).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from . import index_forms
from ._checks import check_kv_scale, check_sink
from .batch import StepBatch
from .cache import PagedCache
from .cache_views import CacheView, IdentityMemo, cache_view, named_layout
from .config import PICKS_KINDS
from .metadata import MetadataSpec
from .ops import sparse_attention_decode, sparse_attention_prefill
from .ops.dispatch import resolve_backend
from .ops.launch import BindOnce
from .ops.validate import debug_checks_enabled, graph_capturing
from .picks import step_picks
from .workspace import fill_workspace, shared_workspace, workspace_indices, workspace_plan

PREFILL_MODES = ("paged", "workspace", "mixed")


def resolve_cache_arg(cache: object, name: str) -> CacheView:
    """A :class:`PagedCache` or paged cache tensor, validated once per tensor (:func:`.cache_views.cache_view`; seen
    again with the same :func:`~sparse_mla.cache_views.cache_stamp`, it costs one memo lookup), with a PagedCache's
    kv_scale (fp8_e4m3). A PagedCache's format names its page layout (a page-planar V4.1 pool's bytes do not read as
    its tensor's rows)."""
    tensor = cache.data if isinstance(cache, PagedCache) else cache
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a PagedCache or a paged cache tensor, got {type(cache).__name__}")
    view = cache_view(tensor, named_layout(cache.fmt) if isinstance(cache, PagedCache) else None, name)
    if view.fmt.per_tensor:  # the pool's scale, read per call (PagedCache.kv_scale may be replaced)
        kv_scale = getattr(cache, "kv_scale", None)
        if kv_scale is None:
            raise ValueError(f"{name} is an fp8_e4m3 cache tensor: pass its PagedCache, which keeps the cache's "
                             f"kv_scale (PagedCache(..., 'fp8_e4m3', kv_scale=...))")
        if not isinstance(kv_scale, torch.Tensor):
            raise TypeError(f"{name}.kv_scale must be a (1,) float32 tensor on the cache's device, got "
                            f"{type(kv_scale).__name__}")
        return view._replace(kv_scale=kv_scale)
    return view


_CHECKED_SCALES = IdentityMemo()  # kv_scale tensor -> checked, under (device, whether its values were skipped)


def check_cache_kv_scale(kv_scale: torch.Tensor, device: torch.device, name: str) -> None:
    """A cache's ``kv_scale`` as a layer reads it, checked once per tensor: one float32 value on the cache's
    ``device``, positive and finite. The value check syncs once, on a GPU; it is skipped while a CUDA graph is being
    captured (no sync is allowed then; ``StepGraph`` warms up before capturing, so a step's scales are met first
    outside the capture) and made at the next check outside it. Values written into it in place later are checked
    only with ``SPARSE_MLA_DEBUG=1`` (per call: :class:`LayerPlan`)."""
    capturing = graph_capturing(device)
    # the memo keeps True, not what check_kv_scale returns (the tensor itself, which the entry must not hold)
    _CHECKED_SCALES.get(kv_scale, (device, capturing),
                        lambda: check_kv_scale(kv_scale, device, name, values=not capturing) is not None)


def layer_kv_scale(views: dict[str, CacheView]) -> torch.Tensor | None:
    """The one ``kv_scale`` tensor a layer call's fp8_e4m3 caches share (None for the other formats); caches
    with different scale tensors are a ``ValueError`` (the kernels take one scale per call, as FlashInfer's
    ``bmm2_scale``: give every cache of a layer the same tensor, or views of it)."""
    scales = [v.kv_scale for v in views.values()]
    if any(s is None for s in scales) and any(s is not None for s in scales):
        raise ValueError(f"the layer's caches mix fp8_e4m3 with other formats "
                         f"{ {k: v.fmt.name for k, v in views.items()} }: every cache of a layer has one format")
    if scales[0] is not None and any(s.data_ptr() != scales[0].data_ptr() for s in scales[1:]):
        raise ValueError(f"the layer's fp8_e4m3 caches {sorted(views)} hold different kv_scale tensors: a layer call "
                         f"reads its caches with one scale, so give them one shared (1,) float32 tensor")
    return scales[0]


class StepLists(Protocol):
    """What a layer and its :class:`LayerPlan` read of a step's metadata: the whole step's
    (:class:`~sparse_mla.metadata.StepMetadata`) and one rank's share of it
    (:class:`~sparse_mla.context_parallel.RankStepMetadata`) are both one.

    The index lists (``None`` where the batch has no such kind), the step's plans (:meth:`plan`: kept with the
    metadata, made anew by each build), the decode orders, ``world`` (the ranks the step's caches are split over: a
    rank's block tables are read with block sizes × world) and :meth:`check_gather` (which ``context_parallel``
    argument a layer call over this metadata takes)."""

    batch: StepBatch
    spec: MetadataSpec
    world: int
    swa_indices: torch.Tensor | None
    swa_lens: torch.Tensor | None
    c128a_indices: torch.Tensor | None
    c128a_lens: torch.Tensor | None
    picks_indices: torch.Tensor | None
    picks_lens: torch.Tensor | None
    picks_local: torch.Tensor | None
    picks_bound: torch.Tensor | None
    _plans: dict

    def check_current(self) -> None: ...

    def check_gather(self, gather: object) -> None: ...

    def plan(self, key: tuple, make: Callable[[], object]) -> object: ...

    def decode_order(self, kind: str) -> torch.Tensor | None: ...


def check_step_caches(meta: StepLists, views: dict[str, CacheView], layer_kind: str) -> None:
    """A layer's caches (``views``, by kind) against the step they are read in: each kind has a block table in the
    step's batch, blocks of the step's block size (a rank's: ÷ world), at least the blocks its tables name, and the
    step's device (``ValueError`` naming the cache)."""
    batch, world = meta.batch, meta.world
    for kind, view in views.items():
        name = f"caches[{kind!r}]"
        if kind not in batch.block_tables:
            raise ValueError(f"a {layer_kind} layer reads the {kind!r} cache, but the step's batch has no {kind!r} "
                             f"block table (its kinds: {batch.kinds}); build the batch with kinds including {kind!r}")
        if view.tensor.shape[1] * world != batch.block_sizes[kind]:
            raise ValueError(f"{name} has blocks of {view.tensor.shape[1]} entries, the step's block tables use "
                             f"{batch.block_sizes[kind] // world}")
        batch.check_cache_holds_blocks(kind, view.tensor.shape[0], name)
        if view.tensor.device != batch.device:
            raise ValueError(f"{name} is on {view.tensor.device}, the step's metadata on {batch.device}")


class LayerPlan:
    """One layer configuration's work in one step.

    Rows ``[0, num_decode_tokens)`` (decodes, longest key lists first) and ``[num_decode_tokens, num_tokens)``
    (prefill chunks) are launched separately; ``prefill_mode="mixed"`` launches all rows at once, ``"workspace"``
    gathers each prefill chunk's keys into the shared bf16 workspace first. layer: the
    :class:`~sparse_mla.layer.SparseMLAAttention` whose configuration (kind, heads, head_dim, backend, mode,
    workspace size, batch invariance, index form) the plan is for — every layer of the step with that configuration
    shares it, so calls pass their own sink and scale; views: the caches by kind, as resolved for this plan; q_fp8:
    the calls' q is float8_e4m3fn; has_sink: the calls pass a sink (default: the layer has one; a context-parallel
    call passes none, the merge applies it: :mod:`sparse_mla.context_parallel`); lse: the ``(T, H)`` float32 buffer
    the calls' LSEs go to (default a new one; context parallel: the gather's send buffer, whose padding rows are
    set to ``+inf`` here).

    The layer's ``index_form`` picks the lists the paged launches read (:mod:`sparse_mla.index_forms`):
    ``"padded"`` the metadata's own; ``"ragged"`` their ragged form, converted once per step for the SWA and
    c128a lists and per call for the picks; ``"combined"`` one list over the SWA and compressed caches (built once
    per step for c128a, per call from the picks for c4a; a one-scope layer's combined list is its padded list).
    The form's buffers are kept with the step's plans: fixed for the step, refilled without a host sync.
    """

    def __init__(self, meta: StepLists, layer, views: dict[str, CacheView], q_fp8: bool = False,
                 has_sink: bool | None = None, lse: torch.Tensor | None = None) -> None:
        batch = meta.batch
        has_sink = layer.sink is not None if has_sink is None else has_sink
        self.meta = meta
        # SPARSE_MLA_DEBUG=1 when the step's plan is made: each call also checks the values of the tensors a caller
        # may write in place (sink, kv_scale, q_scale: they sync); read once per plan, not per call
        self.debug = debug_checks_enabled()
        self.step_plans = meta._plans  # the step's plans, this one among them (a layer's memo tells steps apart by it)
        self.kind, self.head_dim, self.backend = layer.kind, layer.head_dim, layer.backend
        self.workspace_bytes, self.batch_invariant = layer.workspace_bytes, layer.batch_invariant
        self.impl = resolve_backend(layer.backend, batch.device)
        # the block count of each cache: what a replayed CUDA graph of this plan may index (replay_mismatch)
        self.num_blocks = {kind: view.tensor.shape[0] for kind, view in views.items()}
        self.n_dec, self.n_tok, self.capacity = batch.num_decode_tokens, batch.num_tokens, batch.token_capacity
        scopes = []  # (kind, indices, lens)
        if "swa" in views:
            scopes.append(("swa", meta.swa_indices, meta.swa_lens))
        if layer.kind in PICKS_KINDS:  # the lists each call's picks are converted into (the step's, shared)
            picks = step_picks(meta, layer.kind)
            scopes.append((layer.kind, picks.indices, picks.lens))
        elif layer.kind == "c128a":
            scopes.append(("c128a", meta.c128a_indices, meta.c128a_lens))
        self.scopes = scopes
        self.cache_kinds = tuple(k for k, _, _ in scopes)
        # the kernels read an fp8_e4m3 cache's bytes (the resolved uint8 view); the public ops take its fp8 tensor
        self.per_tensor = any(v.fmt.per_tensor for v in views.values())
        # each cache's format name by kind, as the ops (the reference attention, the workspace's gathers) are told it:
        # a page-planar V4.1 layout is not in the tensor
        self.fmts = {k: v.fmt.name for k, v in views.items()}
        self.form = "padded" if layer.index_form == "combined" and len(scopes) == 1 else layer.index_form
        self.lists = self._form_lists(meta)
        # a picks layer's conversion of each call's picks (into the form's lists), resolved once per step
        self._convert_picks = None if layer.kind not in PICKS_KINDS else index_forms.picks_conversion(
            meta, layer.kind, self.form,
            None if self.lists is None else self.lists[-1] if self.form == "ragged" else self.lists)
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
        self.parts = []  # (rows, order, launch or None (reference), index rows per scope, lens per scope, ref kwargs)
        for rows, order in parts:
            indices, lens, geometry, forms, ref = self._part_lists(rows, views)
            launch = None
            if self.impl == "triton":
                from .ops.attention_plan import AttentionPlan  # needs Triton: only this backend gets here

                launch = AttentionPlan(
                    (rows.stop - rows.start, layer.num_heads, layer.head_dim), batch.device, geometry,
                    has_sink, order is not None, batch_invariant=layer.batch_invariant,
                    pages_16_byte_aligned=all(v.aligned for v in views.values()), scratch=True, q_fp8=q_fp8,
                    **forms)
            self.parts.append((rows, order, launch, indices, lens, ref))
        # per part, its launch bound by the first call whose tensors are all 16-byte aligned (AttentionPlan.bind),
        # under that call's q strides and scale
        self._bound = [BindOnce() for _ in self.parts]
        # ``(T, H)`` float32: the last call's LSE of each row, ``+inf`` on padding rows (never written) and rows with
        # no key; the layer drops it, or in context-parallel mode hands it to the merge (a workspace prefill's rows
        # are not written: that mode is not run there)
        if lse is None:
            lse = torch.empty(self.capacity, layer.num_heads, dtype=torch.float32, device=batch.device)
        self.lse = lse.fill_(float("inf"))
        self._part_lse = [self.lse[rows] for rows, *_ in self.parts]  # each part's rows (its launch writes from row 0)

    def replay_mismatch(self, batch) -> str | None:
        """Why a CUDA graph captured with this plan cannot replay ``batch`` (None: it can): a block its tables name
        past a cache the plan read (eager calls check this when they plan; a replay plans nothing:
        :meth:`sparse_mla.graphs.StepGraph.mismatch`)."""
        for kind, n in self.num_blocks.items():
            if batch.max_block.get(kind, -1) >= n:
                return (f"batch's {kind!r} block tables name block {batch.max_block[kind]}, but the captured step "
                        f"reads a {kind!r} cache of {n} blocks")
        return None

    def _form_lists(self, meta) -> list | tuple | None:
        """The index form's step buffers: ragged, per scope ``(flat, indptr)``; combined, ``(indices, lens)``."""
        if self.form == "ragged":
            return [index_forms.step_ragged(meta, kind, idx, ln, fill=kind not in PICKS_KINDS)
                    for kind, idx, ln in self.scopes]
        if self.form == "combined":
            kind, idx, ln = self.scopes[1]
            return index_forms.step_combined(meta, kind, idx, ln, fill=kind not in PICKS_KINDS)
        return None

    def _part_lists(self, rows: slice, views: dict[str, CacheView]) -> tuple:
        """What the launch of ``rows`` reads in the layer's form: (index tensors per scope, lens per scope — a
        ragged scope's indptr —, the scopes' geometry, the attention plan's form arguments, the reference op's
        index arguments)."""
        geometry = [(views[k].fmt, views[k].tensor.shape[1], idx.shape[1]) for k, idx, _ in self.scopes]
        if self.form == "ragged":
            indices = tuple(flat for flat, _ in self.lists)
            lens = tuple(indptr[rows.start : rows.stop + 1] for _, indptr in self.lists)
            ref = dict(indices=indices[0], indptr=lens[0])
            if len(indices) > 1:
                ref.update(extra_indices=indices[1], extra_indptr=lens[1])
            return indices, lens, geometry, dict(ragged=(True,) * len(indices)), ref
        if self.form == "combined":
            comb, comb_lens = self.lists
            window = self.scopes[0][1].shape[1]
            indices = (comb[rows, :window], comb[rows, window:])
            lens = (comb_lens[rows], comb_lens[rows])
            return indices, lens, geometry, dict(combined=True), dict(indices=comb[rows], lens=comb_lens[rows],
                                                                     combined_window=window)
        indices = tuple(idx[rows] for _, idx, _ in self.scopes)
        lens = tuple(ln[rows] for _, _, ln in self.scopes)
        ref = dict(indices=indices[0], lens=lens[0])
        if len(indices) > 1:
            ref.update(extra_indices=indices[1], extra_lens=lens[1])
        return indices, lens, geometry, {}, ref

    def __call__(self, q: torch.Tensor, out: torch.Tensor, caches: tuple[torch.Tensor, ...],
                 picks: torch.Tensor | None, sink: torch.Tensor | None, scale: float,
                 q_scale: torch.Tensor | None = None, kv_scale: torch.Tensor | None = None) -> None:
        """Attention of every token into ``out``; padding rows get zeros. q / out: ``(T, H, d)`` / ``(T, H, 512)``
        with unit-stride rows / contiguous; caches: the scopes' cache tensors in scope order; picks: a c4a / dsa
        layer's indexer picks ``(T, topk)`` int32 (converted here, into the layer's index form); sink / scale: the
        calling layer's; q_scale / kv_scale: ``(1,)`` float32, an fp8 q's and the fp8_e4m3 caches' scales."""
        if self.debug:
            _check_values(sink, q_scale, kv_scale)
        kept = None if picks is None else self._convert_picks(picks)
        op_caches = tuple(c.view(torch.float8_e4m3fn) for c in caches) if self.per_tensor else caches
        for i, (rows, order, launch, indices, lens, ref) in enumerate(self.parts):
            q_rows = q if rows.start == 0 else q[rows]  # row 0 on: the same pointer, and the plan knows the count
            out_rows = out if rows.start == 0 else out[rows]
            if launch is not None:
                self._launch(i, launch, q_rows, out_rows, self._part_lse[i], sink, scale, caches, indices, lens, order,
                             q_scale, kv_scale)
            else:
                n = rows.stop - rows.start
                self._reference(q_rows[:n], out_rows[:n], self._part_lse[i], op_caches, ref, order, sink, scale,
                                q_scale, kv_scale)
        if self.workspace:
            self._prefill_workspace(q, out, op_caches, kept, sink, scale, kv_scale)
        if self.n_tok < self.capacity:
            out[self.n_tok:].zero_()

    def _launch(self, part: int, launch, q, out, lse, sink, scale, caches, indices, lens, order, q_scale,
                kv_scale) -> None:
        """One part's attention launch: through its bound launch when this call's tensors are laid out as the binding
        call's and on q's device (the plan fixes every other tensor and the caches' geometry: ``CacheView.key``),
        else the plan's."""
        ptrs, device, same_device = q.data_ptr() | out.data_ptr(), q.get_device(), True
        for t in (sink, q_scale, kv_scale, *caches):
            if t is not None:
                ptrs |= t.data_ptr()
                same_device &= t.get_device() == device  # (a bound launch skips the launcher's pointer checks)
        bindable, key, slot = same_device and ptrs & 15 == 0, (q.stride(0), q.stride(1), scale), self._bound[part]
        if bindable and slot(key, q, out, lse, sink, caches, indices, lens, order, q_scale, kv_scale):
            return
        launch(q, out, lse, sink, scale, caches, indices, lens, order, q_scale, kv_scale)
        if bindable:
            slot.settle(key, lambda: launch.bind(q, out, lse, sink, scale, caches, indices, lens, order, q_scale,
                                                 kv_scale, lists_fixed=True))

    def _reference(self, q, out, lse, caches, ref, order, sink, scale, q_scale, kv_scale) -> None:
        kinds = self.cache_kinds
        extra = dict(extra_cache=caches[1], extra_fmt=self.fmts[kinds[1]]) if len(caches) > 1 else {}
        lse.copy_(sparse_attention_decode(q, caches[0], **ref, sink=sink, scale=scale, fmt=self.fmts[kinds[0]],
                                          backend=self.backend, out=out, order=order, q_scale=q_scale,
                                          kv_scale=kv_scale, **extra)[1])

    def _prefill_workspace(self, q, out, caches, kept_picks, sink, scale, kv_scale) -> None:
        meta, kind, dim = self.meta, self.kind, self.head_dim
        by_kind = {k: c for c, (k, _, _) in zip(caches, self.scopes)}
        ws_all = shared_workspace(q.device, self.workspace_bytes, dim)
        for chunk in workspace_plan(meta, kind, self.workspace_bytes, dim):
            ws = fill_workspace(ws_all, chunk, by_kind, self.backend, kv_scale, self.fmts)
            idx, lens = workspace_indices(meta, chunk, kept_picks)
            sparse_attention_prefill(q[chunk.tokens], ws, idx, lens, sink=sink, scale=scale, backend=self.backend,
                                     out=out[chunk.tokens], batch_invariant=self.batch_invariant)


def _check_values(sink: torch.Tensor | None, q_scale: torch.Tensor | None, kv_scale: torch.Tensor | None) -> None:
    """The debug-mode checks of a layer call's sink and scales (they sync): no NaN sink, positive finite scales."""
    if sink is not None:
        check_sink(sink, sink.shape[0])
    for name, value in (("q_scale", q_scale), ("kv_scale", kv_scale)):
        if value is not None:
            check_kv_scale(value, value.device, name)
