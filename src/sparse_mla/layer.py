"""SparseMLAAttention: one DeepSeek-V4 or V3.2 sparse attention layer over paged caches (DESIGN §5)."""
from __future__ import annotations

import contextlib
import weakref
from typing import Iterator

import torch

from ._checks import check_kv_scale, check_scale, check_sink, check_tensor, is_int
from .cache import PagedCache
from .config import COMPRESS_RATIO, LAYER_KINDS, PICKS_KINDS, check_scope_formats
from .context_parallel import PartialsGather, RankStepMetadata
from .cache_views import cache_stamp
from .formats import FORMAT_NAMES, get_format
from .index_forms import check_index_form
from .metadata import StepMetadata
from .ops.dispatch import check_backend_name
from .ops.validate import D_V, kernel_takes_q
from .plan import (PREFILL_MODES, LayerPlan, StepLists, check_cache_kv_scale, check_step_caches, layer_kv_scale,
                   resolve_cache_arg)
from .workspace import DEFAULT_WORKSPACE_BYTES, shared_workspace

# What a layer's plans and checks are made for, fixed at construction: layers of one configuration share a step's
# plan, so a layer changed afterwards would launch with another configuration's heads, mode or lists.
FIXED_CONFIGURATION = frozenset(("kind", "num_heads", "head_dim", "window", "topk", "compress_ratio", "backend",
                                 "prefill_mode", "workspace_bytes", "kv_format", "batch_invariant", "index_form",
                                 "cache_kinds"))


class SparseMLAAttention(torch.nn.Module):
    """Sparse MLA attention of one layer kind: V4's ``swa``, ``c4a`` (indexer top-k) or ``c128a``, V4.1's ``c2a`` or
    ``c1a`` (indexer top-k among entries of ratio 2 or 1, beside the window), or V3.2's ``dsa`` (indexer top-k over
    raw tokens, 576-d absorbed queries).

    kind / compress_ratio: the layer kind (ratio 1, 4 or 128 for V4, 2 or 1 for V4.1's compressed kinds; give
    either). window: the SWA window W
    (the step metadata must be built with the same; unused by dsa). topk: the indexer width (c4a, c2a, c1a, dsa).
    scale: softmax scale; V4 defaults to ``head_dim ** -0.5``; a dsa layer must be given its model's
    (``qk_head_dim ** -0.5 · mscale²``, :func:`sparse_mla.config.get_config` ``("deepseek-v3.2").softmax_scale``),
    never ``576 ** -0.5``. sink: ``(num_heads,)`` float32 per-head sink logits (None: no sink), registered as a
    buffer. backend: ``"auto"``, ``"reference"`` or ``"triton"``. kv_format: if given, every cache the layer
    reads must hold this format. batch_invariant: each token's output is bitwise independent of the rest of the
    batch (GPU kernels; see ``sparse_attention_decode``). index_form: the form of the index lists the attention
    launches read, ``"padded"`` (the step metadata's), ``"ragged"`` (flat lists + ``indptr``) or ``"combined"``
    (one list over the SWA and compressed caches per token): the same results, see :mod:`sparse_mla.index_forms`.

    fp8_e4m3 caches (one float32 ``kv_scale`` per cache) are passed as their :class:`~sparse_mla.cache.PagedCache`,
    whose ``kv_scale`` the layer reads (every cache of a layer must share one scale tensor); with them the query
    may be fp8 too (``forward(q_fp8, ..., q_scale=...)``).

    Decode tokens (the batch's first ``num_decode_tokens``) read the paged caches directly, longest key lists
    first. Prefill tokens do too with ``prefill_mode="paged"`` (V4's default); ``"mixed"`` runs every token in
    one launch (no decode order); ``"workspace"`` (V3.2's default) gathers each chunk's keys into a bf16
    workspace of at most ``workspace_bytes`` first (FlashMLA's prefill path; one workspace per device is shared
    by all layers, see :func:`~sparse_mla.workspace.shared_workspace`). The defaults are the faster modes on an H100
    (BENCHMARKS.md). The layer reads caches only: the engine inserts the step's new KV and compressed entries before
    ``forward``.

    After construction, ``sink`` and ``scale`` may be replaced (``layer.sink = new``: checked at once — shape,
    dtype, contiguity, no NaN, which syncs once for a GPU tensor —, and its device at the next call; an
    ``nn.Parameter`` is held as the buffer too; a sink whose
    storage, shape or dtype is changed under it, ``layer.sink.data = ...`` or ``resize_``, is checked again at the
    next call, whatever path it takes: a host compare of well under a microsecond) and so may
    a cache's ``kv_scale`` (checked the first time a call reads it); the rest of the configuration is fixed
    (assigning it is a ``ValueError``). Values written into the sink or a scale tensor in place are checked only
    with ``SPARSE_MLA_DEBUG=1`` (a NaN there gives NaN rows, never a read outside a tensor).
    """

    def __init__(self, kind: str, num_heads: int, head_dim: int = 512, window: int = 128, *,
                 compress_ratio: int | None = None, topk: int | None = None, scale: float | None = None,
                 sink: torch.Tensor | None = None, backend: str = "auto", prefill_mode: str | None = None,
                 workspace_bytes: int = DEFAULT_WORKSPACE_BYTES, kv_format: str | None = None,
                 batch_invariant: bool = False, index_form: str = "padded") -> None:
        super().__init__()
        if kind not in LAYER_KINDS:
            raise ValueError(f"kind must be one of {LAYER_KINDS}, got {kind!r}")
        if compress_ratio is not None and (not is_int(compress_ratio) or compress_ratio != COMPRESS_RATIO[kind]):
            raise ValueError(f"compress_ratio must be None or the int {COMPRESS_RATIO[kind]} (a {kind} layer's "
                             f"ratio), got {compress_ratio!r}")
        if prefill_mode is None:  # measured on an H100 (BENCHMARKS.md): V4 paged-direct, V3.2 the workspace
            prefill_mode = "workspace" if kind == "dsa" else "paged"
        if prefill_mode not in PREFILL_MODES:
            raise ValueError(f"prefill_mode must be one of {PREFILL_MODES}, got {prefill_mode!r}")
        if kind in PICKS_KINDS and not topk:
            raise ValueError(f"topk (the indexer width) is required for a {kind} layer")
        if not all(is_int(v) and v >= 1 for v in (num_heads, window)):
            raise ValueError(f"num_heads and window must be positive ints, got {num_heads!r}, {window!r}")
        want_dim = 576 if kind == "dsa" else 512
        if not is_int(head_dim) or head_dim != want_dim:
            raise ValueError(f"head_dim must be {want_dim} for a {kind} layer "
                             f"({'V3.2: 512 latent + 64 rope' if kind == 'dsa' else 'V4'}), got {head_dim!r}")
        if kind == "dsa" and scale is None:
            raise ValueError("scale is required for a dsa layer: V3.2's is qk_head_dim ** -0.5 * mscale ** 2 "
                             "(get_config('deepseek-v3.2').softmax_scale), not 576 ** -0.5")
        if not is_int(workspace_bytes) or workspace_bytes < 2 * head_dim:  # (a float failed in the first call's empty())
            raise ValueError(f"workspace_bytes must be an int holding at least one {head_dim}-d bf16 row, got "
                             f"{workspace_bytes!r}")
        if (kind in PICKS_KINDS or topk is not None) and not (is_int(topk) and topk >= 1):
            # (a kind without picks ignores a valid one: callers may pass one top-k to every compressed kind)
            raise ValueError(f"topk must be a positive int, got {topk!r}")
        if sink is not None:
            _check_layer_sink(sink, num_heads)  # its values once here, not on every step
        check_backend_name(backend)
        if kv_format is not None:
            if kv_format not in FORMAT_NAMES:
                raise ValueError(f"kv_format must be None or one of {FORMAT_NAMES}, got {kv_format!r}")
            try:  # a format of the other latent width: no cache could ever serve the layer
                get_format(kv_format, head_dim)
            except ValueError as error:
                raise ValueError(f"kv_format {kv_format!r} does not fit this {kind} layer: {error}") from None
        self.kind, self.num_heads, self.head_dim, self.window = kind, num_heads, head_dim, window
        self.topk = topk if kind in PICKS_KINDS else None
        self.compress_ratio = COMPRESS_RATIO[kind]
        self.scale = check_scale(head_dim ** -0.5 if scale is None else scale)
        self.register_buffer("sink", sink)
        self.backend, self.prefill_mode, self.workspace_bytes = backend, prefill_mode, workspace_bytes
        self.kv_format, self.batch_invariant = kv_format, bool(batch_invariant)
        self.index_form = check_index_form(index_form)
        self.cache_kinds = ("dsa",) if kind == "dsa" else ("swa",) if kind == "swa" else ("swa", kind)
        self._cache_names = tuple((k, f"caches[{k!r}]") for k in self.cache_kinds)  # (kind, the name errors use)
        # what a step plan depends on besides the sink's presence and the caches (layers sharing it share a plan)
        self._config = (kind, num_heads, backend, prefill_mode, workspace_bytes, self.batch_invariant, kv_format,
                        self.index_form)
        # what _plan found on the last call, all weakly held (a layer keeps neither a step nor a cache alive): (the
        # plan, (has_sink, q_fp8), the caches given, their tensors' stamps)
        self._last_plan: tuple | None = None
        # the sink last checked against a call's device, that device and the sink's layout (_sink_layout): a sink
        # replaced, moved or re-pointed since (the setter, register_buffer, .to()/.half(), ``sink.data = ...``,
        # ``sink.resize_(...)``) is checked again at the next call, without a sync
        self._sink_seen: tuple[torch.Tensor, torch.device, tuple] | None = None

    def __setattr__(self, name: str, value: object) -> None:
        """``sink`` and ``scale`` are checked when assigned; the configuration is fixed (``ValueError``)."""
        if name == "sink":
            if value is not None:
                _check_layer_sink(value, self.num_heads)  # values: a sync for a GPU tensor, once per assignment
            if isinstance(value, torch.nn.Parameter):  # a buffer still, as the constructor holds one (Module's
                self.register_buffer("sink", value)     # assignment would move it to the parameters, unread)
                return
        elif name == "scale":
            value = check_scale(value)
        elif name in FIXED_CONFIGURATION and name in self.__dict__:
            raise ValueError(f"{name} is fixed when a SparseMLAAttention is made (the step plans it shares with "
                             f"layers of its configuration depend on it), got an assignment of {value!r}: make "
                             f"another layer")
        super().__setattr__(name, value)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        """``load_state_dict`` copies a sink into the buffer in place: its values are checked first."""
        sink = state_dict.get(prefix + "sink")
        if sink is not None and isinstance(sink, torch.Tensor) and self._buffers.get("sink") is not None:
            check_sink(sink.detach().to(torch.float32), self.num_heads)  # copy_ converts the dtype
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def extra_repr(self) -> str:
        return (f"kind={self.kind}, num_heads={self.num_heads}, head_dim={self.head_dim}, window={self.window}, "
                f"topk={self.topk}, prefill_mode={self.prefill_mode}, backend={self.backend}"
                + ("" if self.index_form == "padded" else f", index_form={self.index_form}"))

    # ------------------------------------------------------------------ forward

    def forward(self, q: torch.Tensor, meta: StepMetadata | RankStepMetadata | None = None, caches: dict | None = None,
                topk_indices: torch.Tensor | None = None, out: torch.Tensor | None = None,
                q_scale: float | torch.Tensor | None = None, *,
                context_parallel: PartialsGather | None = None) -> torch.Tensor:
        """Attention of the step's tokens.

        q: ``(T, num_heads, head_dim)`` bf16, T = the batch's token capacity (dsa: absorbed queries
        ``[q_nope · W_UK | q_pe]``). meta: the step's :class:`~sparse_mla.metadata.StepMetadata` (None: warm-up,
        which only reserves the workspace and zeroes ``out``); metadata whose batch's builder has built another
        step since is stale: ``ValueError``. caches: ``{kind: cache}`` for the kinds this layer reads
        (``swa`` and its own kind; dsa: ``dsa``), each a :class:`PagedCache` or its tensor. topk_indices: the
        indexer's picks, ``(T, topk)`` int32 (c4a: local compressed entry numbers; dsa: request-local token
        positions; ``-1`` none; picks a token cannot see yet are dropped). Returns ``out (T, num_heads, 512)``
        bf16 (written in place when given), before V4's inverse rope on the output's rope dims; padding tokens
        get zeros. q_scale: with fp8_e4m3 caches, q may be float8_e4m3fn, its values ``e4m3 · q_scale`` (a positive
        number or a one-element float32 tensor on q's device, read at run time); not with ``prefill_mode="workspace"``.

        Context-parallel mode (docs/context_parallel.md): meta is this rank's
        :class:`~sparse_mla.context_parallel.RankStepMetadata` (``build_rank_metadata``), caches hold the rank's
        share, and context_parallel is the :class:`~sparse_mla.context_parallel.PartialsGather` of the rank's group
        (made for the step's token capacity and this layer's heads). The layer attends to the rank's keys without
        the sink, writing its partial into the gather's send buffer, then gathers every rank's partials and merges
        them, applying the sink once: ``out`` is the whole attention (the same bits on every rank); with a gather of
        ``comm="reduce_scatter"``, ``out`` is this rank's head shard ``(T, num_heads / world, 512)``. No host sync:
        a decode step in this mode can be captured in a CUDA graph on NCCL. Not with the combined index form, nor
        with the workspace prefill (``prefill_mode="workspace"`` and prefill tokens in the step).
        """
        dim = self.head_dim
        q_dtype = torch.bfloat16 if q_scale is None else torch.float8_e4m3fn
        if meta is None:
            check_tensor("q", q, dtype=q_dtype, shape=(None, self.num_heads, dim))
            out = self._out(q, out, q.shape[0])
            if self.prefill_mode == "workspace":
                self._workspace_buffer(q.device)
            return out.zero_()
        try:  # a step's metadata (plan.StepLists) says which context_parallel argument it takes
            check_gather = meta.check_gather
        except AttributeError:
            raise TypeError(f"meta must be the step's StepMetadata, a rank's RankStepMetadata (context parallel) or "
                            f"None, got {type(meta).__name__}") from None
        check_gather(context_parallel)
        if context_parallel is not None:
            self._check_context_parallel(meta, context_parallel)
        batch = meta.batch
        batch.check_current()
        capacity, device = batch.token_capacity, batch.device
        if (type(q) is not torch.Tensor or q.dtype is not q_dtype or q.shape != (capacity, self.num_heads, dim)
                or q.device != device):  # the full check only on a miss: it names what is wrong
            if q_scale is None and isinstance(q, torch.Tensor) and q.dtype == torch.float8_e4m3fn:
                raise ValueError("q is float8_e4m3fn: pass its q_scale (q's values are e4m3 · q_scale)")
            check_tensor("q", q, dtype=q_dtype, shape=(None, self.num_heads, dim))
            self._check_family(batch)  # metadata of the other model family: said before its token capacity
            if q.shape[0] != capacity:
                raise ValueError(f"q has {q.shape[0]} tokens, the step's token capacity is {capacity}")
            check_tensor("q", q, device=device)
        if not kernel_takes_q(q):
            q = q.contiguous()
        out = self._out(q, out, capacity, self.num_heads if context_parallel is None else context_parallel.out_heads)
        sink = self._buffers["sink"]
        if sink is not None:
            seen = self._sink_seen
            if seen is None or seen[0] is not sink or seen[1] != device or seen[2] != _sink_layout(sink):
                _check_layer_sink(sink, self.num_heads, device, values=False)
                self._sink_seen = seen = (sink, device, _sink_layout(sink))
            if _CAPTURED_SINKS is not None:
                _CAPTURED_SINKS.append((self, seen))
        # context parallel: the partial has no sink (the merge applies it once) and goes straight into the send buffer
        has_sink = sink is not None and context_parallel is None
        plan, caches_t, kv_scale = self._plan(meta, caches, has_sink, q_scale is not None,
                                              None if context_parallel is None else context_parallel.lse_partial)
        if q_scale is not None:
            if self.prefill_mode == "workspace":
                raise ValueError("an fp8 q (q_scale) needs prefill_mode 'paged' or 'mixed': the workspace prefill "
                                 "reads a bf16 q")
            q_scale = check_kv_scale(q_scale, device, "q_scale", values=False)
        if self.kind in PICKS_KINDS:
            if topk_indices is None:
                raise ValueError(f"topk_indices must be given to a {self.kind} layer: the indexer's picks, "
                                 f"(T, topk) int32")
        elif topk_indices is not None:
            raise ValueError(f"topk_indices must be given only to a layer of the kinds {PICKS_KINDS}, not to this "
                             f"{self.kind} layer")
        if context_parallel is None:
            plan(q, out, caches_t, topk_indices, sink, self.scale, q_scale, kv_scale)
            return out
        plan(q, context_parallel.out_partial, caches_t, topk_indices, None, self.scale, q_scale, kv_scale)
        if plan.lse is not context_parallel.lse_partial:  # a plan made with another gather of the step
            context_parallel.lse_partial.copy_(plan.lse)
        # out and the sink are checked above, the gather's buffers against this step (_check_context_parallel)
        context_parallel.exchange(sink, out, context_parallel.merged_lse, plan.impl)
        return out

    # ------------------------------------------------------------------ helpers

    def _check_context_parallel(self, meta: StepLists, gather: PartialsGather) -> None:
        """A context-parallel call's gather (checked against the rank's metadata: ``meta.check_gather``) against
        this layer (``ValueError`` naming what is wrong; attribute compares only)."""
        batch, part = meta.batch, gather.out_partial
        want = (batch.token_capacity, self.num_heads, D_V)
        if tuple(part.shape) != want or part.dtype != torch.bfloat16 or part.device != batch.device:
            raise ValueError(f"context_parallel holds {part.dtype} partials of shape {tuple(part.shape)} on "
                             f"{part.device}; this layer's step needs bf16 {want} on {batch.device}: make the "
                             f"PartialsGather with max_tokens = the step's token capacity and num_heads = the "
                             f"layer's, on the step's device")
        if self.index_form == "combined":
            raise ValueError("index_form 'combined' is not supported in context-parallel mode (use 'padded' or "
                             "'ragged')")
        if self.prefill_mode == "workspace" and batch.num_tokens > batch.num_decode_tokens:
            raise ValueError("prefill_mode 'workspace' does not run in context-parallel mode: the step has prefill "
                             "tokens; make the layer with prefill_mode 'paged' or 'mixed'")

    def _workspace_buffer(self, device: torch.device) -> torch.Tensor:
        """This layer's view of the shared workspace (``workspace_bytes`` of ``head_dim``-wide bf16 rows)."""
        return shared_workspace(device, self.workspace_bytes, self.head_dim)

    def _out(self, q: torch.Tensor, out: torch.Tensor | None, rows: int, heads: int | None = None) -> torch.Tensor:
        """The call's output ``(rows, heads, 512)`` bf16 (heads: the layer's, or a context-parallel rank's head
        shard): ``out`` checked, or a new tensor."""
        heads = self.num_heads if heads is None else heads
        if out is None:
            return torch.empty(rows, heads, D_V, dtype=torch.bfloat16, device=q.device)
        if (type(out) is not torch.Tensor or out.dtype is not torch.bfloat16 or out.shape != (rows, heads, D_V)
                or out.device != q.device):
            check_tensor("out", out, dtype=torch.bfloat16, shape=(rows, heads, D_V), device=q.device)
        if not out.is_contiguous():
            raise ValueError("out must be contiguous")
        return out

    def _plan(self, meta: StepLists, caches: dict | None, has_sink: bool, q_fp8: bool = False,
              lse: torch.Tensor | None = None) -> tuple[LayerPlan, tuple[torch.Tensor, ...], torch.Tensor | None]:
        """This step's plan for this layer's configuration and caches (made on the first call of the step), the
        cache tensors in its scope order, and their shared kv_scale (fp8_e4m3; else None). lse: where a plan made
        now writes its LSE (context parallel: the gather's send buffer, so nothing is copied)."""
        if not isinstance(caches, dict):
            raise ValueError(f"caches must be a dict of kind -> PagedCache or tensor, got {type(caches).__name__}")
        # the same step and caches as this layer's last call (the common case): its plan, after a stamp compare
        objs = [caches.get(k) for k in self.cache_kinds]
        tensors = tuple([c.data if isinstance(c, PagedCache) else c for c in objs])
        last = self._last_plan
        plan = None if last is None else last[0]()
        if (plan is not None and plan.step_plans is meta._plans and last[1] == (has_sink, q_fp8)
                and all([obj is not None and ref() is obj for ref, obj in zip(last[2], objs)])
                and last[3] == [cache_stamp(t) for t in tensors]):
            return plan, tensors, None
        self._check_step(meta)
        views = {}
        for kind, name in self._cache_names:
            c = caches.get(kind)
            if c is None:
                raise ValueError(f"caches has no {kind!r} cache, which a {self.kind} layer reads (got {sorted(caches)})")
            views[kind] = resolve_cache_arg(c, name)
        key = (self._config, has_sink, q_fp8, tuple([v.key for v in views.values()]))
        kv_scale = layer_kv_scale(views)
        if kv_scale is not None:  # values checked once per tensor (and again after a CUDA-graph capture skipped them)
            kind = next(iter(views))
            check_cache_kv_scale(kv_scale, views[kind].tensor.device, f"caches[{kind!r}].kv_scale")
        if q_fp8 and kv_scale is None:
            raise ValueError(f"q_scale (an fp8 q) needs fp8_e4m3 caches, got "
                             f"{ {k: v.fmt.name for k, v in views.items()} }")
        plan = meta.plan(key, lambda: self._make_plan(meta, views, has_sink, q_fp8, lse))
        paged = tuple([views[k].tensor for k in plan.cache_kinds])
        # kept for the next call where the caches are the paged tensors themselves (no 4-D views) and no kv_scale
        # is read per call; weak references: the layer keeps no cache alive
        self._last_plan = None if kv_scale is not None or any(p is not t for p, t in zip(paged, tensors)) else (
            weakref.ref(plan), (has_sink, q_fp8), [weakref.ref(obj) for obj in objs], [cache_stamp(t) for t in tensors])
        return plan, paged, kv_scale

    def _check_step(self, meta: StepLists) -> None:
        """This layer against the step's metadata: its model family, window and top-k. On every plan lookup, so once
        per step at least (a layer's remembered plan is of the step it was checked against)."""
        batch, spec = meta.batch, meta.spec
        self._check_family(batch)
        if self.kind != "dsa" and spec.window != self.window:
            raise ValueError(f"the step's metadata has window {spec.window}, this layer {self.window}")
        if self.kind in PICKS_KINDS and spec.topk != self.topk:
            raise ValueError(f"the step's metadata has topk {spec.topk}, this layer {self.topk}")

    def _check_family(self, batch) -> None:
        """The step's batch is of this layer's model family: V3.2's ``dsa`` cache for a dsa layer, V4's for the rest."""
        if (self.kind == "dsa") != ("dsa" in batch.block_tables):
            want = ("V3.2 step metadata (a batch of kinds ('dsa',))" if self.kind == "dsa" else
                    "V4 step metadata (a batch whose kinds include 'swa')")
            raise ValueError(f"meta was built from a batch of kinds {batch.kinds}, but a {self.kind} layer reads "
                             f"{want}")

    def _make_plan(self, meta: StepLists, views: dict, has_sink: bool, q_fp8: bool = False,
                   lse: torch.Tensor | None = None) -> LayerPlan:
        """Check this layer against its caches and the caches against the step (once per step and configuration:
        :func:`~sparse_mla.plan.check_step_caches`), then plan."""
        formats = {kind: v.fmt.name for kind, v in views.items()}
        if len(formats) > 1:  # one format, or V4.1's fp4 compressed cache beside an fp8 window cache
            check_scope_formats(*formats.values(), names=tuple(f"caches[{k!r}]" for k in formats))
        for kind, view in views.items():
            name = f"caches[{kind!r}]"
            if self.kv_format is not None and view.fmt.name != self.kv_format:
                raise ValueError(f"{name} holds {view.fmt.name} data, but the layer's kv_format is {self.kv_format!r}")
            if view.fmt.dim != self.head_dim:
                raise ValueError(f"{name} holds {view.fmt.dim}-d tokens ({view.fmt.name}), the layer's head_dim is "
                                 f"{self.head_dim}")
        check_step_caches(meta, views, self.kind)
        return LayerPlan(meta, self, views, q_fp8, has_sink, lse)


def _check_layer_sink(sink: object, num_heads: int, device: torch.device | None = None, values: bool = True) -> None:
    """A layer's sink: :func:`~sparse_mla._checks.check_sink` (with ``values``, no NaN: a sync for a GPU tensor), and
    contiguous (the kernels read it as ``num_heads`` packed floats)."""
    if isinstance(sink, torch.Tensor) and tuple(sink.shape) != (num_heads,):
        raise ValueError(f"sink must have shape ({num_heads},), got {tuple(sink.shape)}: one float32 logit per head of "
                         f"the layer's {num_heads} heads")
    check_sink(sink, num_heads, device, values)
    if not sink.is_contiguous():
        raise ValueError(f"sink must be contiguous (the kernels read {num_heads} packed float32), got strides "
                         f"{sink.stride()}")


def _sink_layout(sink: torch.Tensor) -> tuple:
    """What the kernels' reads of a sink depend on: its storage address, shape, strides and dtype (a few hundred ns
    to read; ``sink.data = ...`` or ``sink.resize_(...)`` keep the tensor object but change them)."""
    return sink.data_ptr(), sink.shape, sink.stride(), sink.dtype


# while a StepGraph captures a step: (layer, the sink it read as _sink_seen holds it) of each layer call, so that a
# replay can refuse a sink replaced since (the graph reads the captured storage); None otherwise
_CAPTURED_SINKS: list | None = None


@contextlib.contextmanager
def record_sinks() -> Iterator[list]:
    """Collect ``(layer, seen)`` of each layer call with a sink inside the ``with`` (see :func:`check_sinks_kept`)."""
    global _CAPTURED_SINKS
    _CAPTURED_SINKS = recorded = []
    try:
        yield recorded
    finally:
        _CAPTURED_SINKS = None


def check_sinks_kept(recorded: list) -> None:
    """``ValueError`` if a layer recorded by :func:`record_sinks` has had its sink replaced, moved or re-pointed since:
    a captured graph would read the old storage (possibly freed) with the old head count."""
    for layer, (sink, _, layout) in recorded:
        now = layer._buffers.get("sink")
        if now is not sink or _sink_layout(now) != layout:
            raise ValueError(f"a {layer.kind} layer's sink was replaced or resized since the step was captured "
                             f"(the graph reads the captured tensor, {layer.num_heads} float32 values): write new "
                             f"values into it in place (sink.copy_(...)) or capture the step again")
