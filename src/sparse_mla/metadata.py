"""Step metadata (DESIGN §3): per-token index lists into the paged caches, built once per step.

Every list is a *valid prefix*: valid slots first, ``-1`` after, ``lens`` = their count. Built with
vectorised torch or one Triton launch on the batch's device (no loop over tokens), into fixed-size int32
buffers that the next step refills (``build_step_metadata(batch, spec, out=last_step_meta)``), so a whole
decode step can be captured in a CUDA graph.

* SWA: token at position ``p`` sees raw tokens ``max(0, p-W+1) … p``.
* C128A: every compressed entry ``w`` with ``(w+1)·128 <= p+1``, i.e. entries ``0 … (p+1)//128 - 1``.
* Picks kinds — V4's C4A, V4.1's C2A and C1A: the indexer's picks (local entry numbers) that are visible,
  ``(w+1)·r <= p+1`` (:func:`~sparse_mla.config.complete_entries`, the one visibility rule), converted to global
  slots per layer by :meth:`StepMetadata.picks_for` (``c4a_indices`` for c4a; the conversion:
  :mod:`sparse_mla.picks`); an invisible pick is dropped, not
  an error (a pick below -1 or past ``max_model_len``'s entries is one, checked under ``SPARSE_MLA_DEBUG=1``).
  Layers that reuse one indexer's picks (V4.1's ``index_source_layer_ids``) each convert the same picks tensor,
  except picks the library's indexer converted in its select (none converts them:
  :meth:`~sparse_mla.picks.PicksConversion.selected`).
* DSA (V3.2): the indexer's picks are request-local raw positions; a pick after the token's own position is
  dropped; converted per layer by :meth:`StepMetadata.dsa_indices` (the same rule with ratio 1).
* Decode order (:meth:`StepMetadata.decode_order`): per kind with long lists, the decode tokens longest key
  lists first, the order the attention kernels take them in (``sparse_mla.ops.order``).
* Step plans (:meth:`StepMetadata.plan`): what is resolved once per step and kept with its metadata — the
  layer plans (:mod:`sparse_mla.plan`), the prefill workspace plans (:mod:`sparse_mla.workspace`), the index
  forms' buffers (:mod:`sparse_mla.index_forms`).

Metadata is only as current as its batch: once the batch's builder builds another step, its buffers hold
that step, and every public read of this metadata — its index lists, :meth:`~StepMetadata.picks_for`,
:meth:`~StepMetadata.c4a_indices`,
:meth:`~StepMetadata.dsa_indices`, :meth:`~StepMetadata.decode_order`, :meth:`~StepMetadata.plan` — is a
``ValueError`` (:meth:`StepBatch.check_current`: an integer compare, no device sync) until
``build_step_metadata(new_batch, spec, out=this)`` refills it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from ._checks import is_int
from .batch import StepBatch, slots_of
from .config import COMPRESS_RATIO, COMPRESSED_KINDS, PICKS_KINDS, complete_entries
from .ops.dispatch import builders_use_triton
from .ops.order import fill_longest_first
from .ops.triton import index as triton_index
from .picks import convert_picks

ORDERED_KINDS = COMPRESSED_KINDS + ("dsa",)  # kinds whose decode tokens get a longest-first order


@dataclass(frozen=True)
class MetadataSpec:
    """What the step's layers need: the SWA window ``W`` (V4, V4.1) and the indexer width (top-k: c4a, c2a, c1a,
    dsa)."""

    window: int = 128
    topk: int = 512


def _step_list(name: str, doc: str) -> property:
    """A read-only attribute of :class:`StepMetadata` holding one of the step's buffers (kept in ``_<name>``):
    reading it checks the metadata is current (an integer compare)."""
    private = "_" + name

    def current(self: StepMetadata):
        self.batch.check_current()
        return getattr(self, private)

    return property(current, doc=doc)


@dataclass
class StepMetadata:
    """Index lists of one step, shared by all layers. Row ``t`` belongs to token ``t`` of the batch
    (``token_capacity`` rows; padding rows have length 0).

    swa_indices ``(T, W)`` + swa_lens ``(T,)`` (``None`` for a V3.2 batch); c128a_indices
    ``(T, ceil(max_model_len/128))`` + c128a_lens (``None`` when the batch has no c128a block table).
    picks_indices / picks_lens / picks_local ``(T, topk)``, ``(T,)``, ``(T, topk)``: the last converted picks
    of a picks kind (c4a, c2a, c1a or dsa), filled per layer by :meth:`picks_for` (:meth:`c4a_indices`,
    :meth:`dsa_indices`); every picks kind of the batch shares them (each layer converts before it attends, but
    for the picks the indexer's select converted itself);
    picks_bound ``(T,)``: ``min(topk, entries visible to the token)`` at the smallest ratio of the batch's picks
    kinds, what any layer's picks count can reach (the decode order's estimate). decode_orders: ``(T,)`` per ordered kind, see
    :meth:`decode_order`.

    The lists are read-only attributes that raise ``ValueError`` once the metadata is stale (its batch's builder
    has built another step): the buffers then hold another step's lists, or are about to.
    """

    batch: StepBatch
    spec: MetadataSpec
    _is_valid_token: torch.Tensor
    _swa_indices: torch.Tensor | None
    _swa_lens: torch.Tensor | None
    _c128a_indices: torch.Tensor | None
    _c128a_lens: torch.Tensor | None
    _picks_indices: torch.Tensor | None
    _picks_lens: torch.Tensor | None
    _picks_local: torch.Tensor | None
    _picks_bound: torch.Tensor | None
    _decode_orders: dict[str, torch.Tensor] = field(default_factory=dict)
    _plans: dict = field(default_factory=dict, repr=False)  # this step's plans (cleared by each build)
    _fill_lists: object = field(default=None, repr=False)  # the bound launch of the step lists (every build)

    is_valid_token = _step_list("is_valid_token", "``(T,)`` int32: 1 for the batch's tokens, 0 for padding rows.")
    swa_indices = _step_list("swa_indices", "``(T, W)`` int32 SWA slots, valid prefix (None for V3.2).")
    swa_lens = _step_list("swa_lens", "``(T,)`` int32 lengths of :attr:`swa_indices`' rows.")
    c128a_indices = _step_list("c128a_indices", "``(T, ceil(max_model_len/128))`` int32 c128a slots, valid prefix.")
    c128a_lens = _step_list("c128a_lens", "``(T,)`` int32 lengths of :attr:`c128a_indices`' rows.")
    picks_indices = _step_list("picks_indices", "``(T, topk)`` int32 slots of the last converted picks.")
    picks_lens = _step_list("picks_lens", "``(T,)`` int32 lengths of :attr:`picks_indices`' rows.")
    picks_local = _step_list("picks_local", "``(T, topk)`` int32 the last converted picks that were kept.")
    picks_bound = _step_list("picks_bound", "``(T,)`` int32 ``min(topk, entries visible to the token)``.")
    decode_orders = _step_list("decode_orders", "``{kind: (T,) int32}`` decode order buffers, see decode_order.")

    @property
    def picks_kind(self) -> str | None:
        """The first kind of the batch whose layers convert indexer picks into :attr:`picks_indices` (``c4a``,
        ``c2a``, ``c1a``, ``dsa``) or None; a V4.1 batch may hold two (c2a and c1a), which share the buffers."""
        return next((k for k in PICKS_KINDS if k in self.batch.block_tables), None)

    @property
    def picks_ratio(self) -> int:
        """The smallest compress ratio of the batch's picks kinds (1 without one): the ratio whose visible entries
        bound every picks layer's count (:attr:`picks_bound`)."""
        return min((COMPRESS_RATIO[k] for k in PICKS_KINDS if k in self.batch.block_tables), default=1)

    world: ClassVar[int] = 1  # the ranks the step's caches are split over: one, this process holds them whole

    def check_current(self) -> None:
        """``ValueError`` if this metadata's batch is stale (its builder has built another step since)."""
        self.batch.check_current()

    def check_gather(self, gather: object) -> None:
        """A layer call's ``context_parallel`` argument against this metadata: None (``ValueError`` otherwise: the
        whole step's metadata is for a process that holds the whole cache)."""
        if gather is not None:
            raise ValueError("context_parallel needs meta to be this rank's RankStepMetadata (build_rank_metadata "
                             "over the rank's caches), got a StepMetadata (a process holding the whole cache)")

    def picks_for(self, kind: str, picks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cache slots of the indexer's picks for a layer of ``kind`` (one of the batch's picks kinds: ``c4a``,
        ``c2a``, ``c1a`` — V4.1's —, or ``dsa``), compacted to a valid prefix.

        picks: ``(T, topk)`` int32, ``-1`` none: local entry numbers of ``kind``'s compressed cache (dsa: request-
        local raw positions). A pick ``w`` is kept only if entry ``w`` is complete before the token
        (``(w+1)·r <= pos+1``, r = ``kind``'s ratio); others are dropped, never attended. Kept picks keep their
        order. Picks are expected to be distinct (a top-k): an entry picked twice is attended twice, as FlashMLA's
        sparse kernels do (``SPARSE_MLA_DEBUG=1`` rejects repeats). Returns (indices ``(T, topk)`` int32, lens
        ``(T,)`` int32), views of this step's buffers (fixed: CUDA-graph capturable): the next call overwrites them.
        """
        return convert_picks(self, picks, kind)[:2]

    def c4a_indices(self, topk_local: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Global C4A slots from the indexer's local picks: :meth:`picks_for` ``("c4a", topk_local)``."""
        return convert_picks(self, topk_local, "c4a")[:2]

    def dsa_indices(self, topk_positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """V3.2: cache slots of the indexer's picks, compacted to a valid prefix.

        topk_positions: ``(T, topk)`` int32 request-local token positions (``-1`` none); a pick after the
        token's own position is dropped. Otherwise as :meth:`picks_for`.
        """
        return convert_picks(self, topk_positions, "dsa")[:2]

    def decode_order(self, kind: str) -> torch.Tensor | None:
        """The attention ops' ``order`` for this step's decode tokens in layers of ``kind``: their
        :func:`~sparse_mla.ops.longest_first` permutation, ``(num_decode_tokens,)`` int32, a view of a buffer
        refilled by each build (so a CUDA graph that reads it stays valid). None for SWA layers, whose
        lists (at most the window) are too short for their order to matter."""
        return decode_order_of(self.decode_orders, self.batch, kind)  # (decode_orders checks the step is current)

    def plan(self, key: tuple, make):
        """The step-scoped plan stored under ``key``, made by ``make()`` on first use (cleared by each build)."""
        self.batch.check_current()
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = make()
        return plan


def visible_entries(batch: StepBatch, ratio: int) -> torch.Tensor:
    """Compressed entries complete before each token: ``complete_entries(pos + 1, ratio)`` (0 for padding); for
    ratio 1 (c1a, dsa) the raw positions ``0 … pos``."""
    return torch.where(batch.positions >= 0, complete_entries(batch.positions + 1, ratio), 0)


def allocate_metadata(batch: StepBatch, spec: MetadataSpec) -> StepMetadata:
    """Fresh buffers sized for ``batch``'s token capacity, ``spec`` and its cache kinds."""
    cap, dev = batch.token_capacity, batch.device
    i32 = dict(dtype=torch.int32, device=dev)
    kinds = batch.block_tables

    def rows(width: int | None, present: bool) -> torch.Tensor | None:
        if not present:
            return None
        return torch.empty(cap, **i32) if width is None else torch.empty(cap, width, **i32)

    has_picks = any(k in kinds for k in PICKS_KINDS)
    n128 = math.ceil(batch.max_model_len / COMPRESS_RATIO["c128a"])
    return StepMetadata(
        batch, spec, torch.empty(cap, **i32), rows(spec.window, "swa" in kinds), rows(None, "swa" in kinds),
        rows(n128, "c128a" in kinds), rows(None, "c128a" in kinds),
        rows(spec.topk, has_picks), rows(None, has_picks), rows(spec.topk, has_picks), rows(None, has_picks),
        {k: torch.empty(cap, **i32) for k in ORDERED_KINDS if k in kinds})


def _check_reusable(out: StepMetadata, batch: StepBatch, spec: MetadataSpec) -> None:
    if out.batch.builder is not batch.builder:
        raise ValueError("out was built from another StepBatchBuilder's batch: metadata buffers (and CUDA graphs "
                         "captured on them) belong to the builder whose batches filled them; build without out= "
                         "for this builder")
    kinds = batch.block_tables
    fresh_shapes = {
        "swa_indices": (batch.token_capacity, spec.window) if "swa" in kinds else None,
        "c128a_indices": (batch.token_capacity, math.ceil(batch.max_model_len / 128)) if "c128a" in kinds else None,
        "picks_indices": (batch.token_capacity, spec.topk) if any(k in kinds for k in PICKS_KINDS) else None,
    }
    for name, shape in fresh_shapes.items():
        buf = getattr(out, "_" + name)  # out's batch is stale (a new batch was built): its buffers, unchecked
        got = None if buf is None else tuple(buf.shape)
        if got != shape or (buf is not None and buf.device != batch.device):
            raise ValueError(f"out's {name} has shape {got} on {None if buf is None else buf.device}, this step needs "
                             f"{shape} on {batch.device}: build without out= when the capacities change")


def _window_indices_torch(batch: StepBatch, kind: str, indices: torch.Tensor, lens: torch.Tensor,
                          span: int | None = None, world: int = 1, rank: int = 0) -> None:
    """Torch twin of the window rows of :func:`sparse_mla.ops.triton.index.step_lists`. SWA: slots of positions
    ``max(0, p-W+1) … p`` (W = ``span``, default the width of ``indices``); c128a: every complete entry
    ``0 … (p+1)//128 - 1``. world / rank: only the entries ``e % world == rank``, as that rank's slots (the
    virtual slot ``// world``: :mod:`sparse_mla.context_parallel`). Written into ``indices`` / ``lens`` as valid
    prefixes."""
    pos, width = batch.positions, indices.shape[1]
    span = width if span is None else span
    valid = pos >= 0
    j = torch.arange(width, device=pos.device, dtype=torch.int32)[None, :]
    if kind == "swa":
        start = (pos - span + 1).clamp_min(0)
        count = torch.where(valid, pos - start + 1, 0)
    else:
        start = torch.zeros_like(pos)
        count = visible_entries(batch, COMPRESS_RATIO[kind])
    count = count.clamp_max(span)
    skip = (rank - start) % world  # entries before the first owned one (floor modulo: never negative)
    count = torch.where(count > skip, (count - skip + world - 1) // world, 0).clamp_max(width)
    entries = torch.where(j < count[:, None], (start + skip)[:, None] + j * world, -1)
    req = batch.token_to_req.clamp_min(0)[:, None]
    slots = slots_of(batch.block_tables[kind], req, entries, batch.block_sizes[kind])
    indices.copy_(slots if world == 1 else torch.where(slots >= 0, slots // world, -1))
    lens.copy_(count)


def _bound_window_list(batch: StepBatch, kind: str, indices: torch.Tensor, lens: torch.Tensor,
                       span: int | None = None) -> triton_index.WindowList:
    """The ``kind`` window list of a launch bound once to ``batch``'s builder: the table as the builder's whole buffer
    (:meth:`StepBatch.table_buffer`: its rows, not this step's, bound a request's in ``table_slots``)."""
    return triton_index.WindowList(batch.table_buffer(kind), batch.block_sizes[kind], indices, lens, span)


def window_lists_filler(batch: StepBatch, lists: dict[str, tuple[torch.Tensor, torch.Tensor, int]],
                        valid: torch.Tensor, world: int, rank: int):
    """``fill(batch)``: one launch (the Triton builders; else the torch twin) writing, per kind of ``lists``
    (``swa``, ``c128a``: ``(indices (T, ceil(span / world)), lens (T,), span)``), the step's window rows of the
    entries rank ``rank`` of ``world`` owns, compact, as its slots; ``valid (T,)`` gets the validity flags. A
    context-parallel rank's lists (:func:`sparse_mla.context_parallel.build_rank_metadata`), bound once to its
    buffers and to ``batch``'s builder's (``fill`` takes each step's batch of that builder)."""
    if builders_use_triton(batch.device):
        window = {k: _bound_window_list(batch, k, idx, ln, span) for k, (idx, ln, span) in lists.items()}
        launch = triton_index.step_lists_launcher(batch.positions, batch.token_to_req, valid, window.get("swa"),
                                                  window.get("c128a"), None, 1, world, rank)
        return lambda current: launch()

    def fill(current: StepBatch) -> None:
        for kind, (idx, ln, span) in lists.items():
            _window_indices_torch(current, kind, idx, ln, span, world, rank)
    return fill


def _picks_buffers(meta: StepMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
    if meta._picks_indices is None:
        return None
    return meta._picks_indices, meta._picks_local, meta._picks_lens, meta._picks_bound


def _step_lists_triton(batch: StepBatch, out: StepMetadata) -> None:
    """Fill ``out``'s shared lists (validity, SWA, C128A, emptied picks buffers) in one launch, bound on the
    first build: every later build reads the same builder buffers (``_check_reusable``) into the same lists."""
    if out._fill_lists is None:
        def window_list(kind: str, indices: torch.Tensor | None, lens: torch.Tensor | None):
            return None if indices is None else _bound_window_list(batch, kind, indices, lens)

        picks = _picks_buffers(out)
        out._fill_lists = triton_index.step_lists_launcher(
            batch.positions, batch.token_to_req, out._is_valid_token,
            window_list("swa", out._swa_indices, out._swa_lens),
            window_list("c128a", out._c128a_indices, out._c128a_lens), picks,
            out.picks_ratio)
    out._fill_lists()


def _step_lists_torch(batch: StepBatch, out: StepMetadata) -> None:
    """Torch twin of :func:`_step_lists_triton`."""
    out._is_valid_token.copy_(batch.positions >= 0)
    if out._swa_indices is not None:
        _window_indices_torch(batch, "swa", out._swa_indices, out._swa_lens)
    if out._c128a_indices is not None:
        _window_indices_torch(batch, "c128a", out._c128a_indices, out._c128a_lens)
    picks = _picks_buffers(out)
    if picks is not None:  # until a layer converts its picks: nothing visible
        for buf, empty in zip(picks, (-1, -1, 0)):
            buf.fill_(empty)
        out._picks_bound.copy_(visible_entries(batch, out.picks_ratio).clamp_max(out.spec.topk))


def decode_order_of(decode_orders: dict[str, torch.Tensor], batch: StepBatch, kind: str) -> torch.Tensor | None:
    """``kind``'s decode order among a step's ``decode_orders`` buffers, cut to its decode tokens; None for a kind of
    the step without one (a kind the step does not have is a ``ValueError``: a typo would read as "no order")."""
    buf = decode_orders.get(kind)
    if buf is None and kind not in batch.kinds:
        raise ValueError(f"kind must be one of this step's kinds {batch.kinds}, got {kind!r}")
    return None if buf is None else buf[: batch.num_decode_tokens]


def build_step_metadata(batch: StepBatch, spec: MetadataSpec = MetadataSpec(),
                        out: StepMetadata | None = None) -> StepMetadata:
    """Build the step's metadata; with ``out`` (an earlier step's metadata of the same builder and
    capacities), refill its buffers in place and return it. CUDA-graph capturable with ``out``."""
    for name, value, cls in (("batch", batch, StepBatch), ("spec", spec, MetadataSpec)):
        if not isinstance(value, cls):
            raise TypeError(f"{name} must be a {cls.__name__}, got {type(value).__name__}")
    if out is not None and not isinstance(out, StepMetadata):
        raise TypeError(f"out must be a StepMetadata (an earlier step's) or None, got {type(out).__name__}")
    if not (is_int(spec.window) and is_int(spec.topk)) or not (0 < spec.window < 2**31 and 0 < spec.topk < 2**31):
        # (int32 positions and entries: a larger one is no window; it reached the allocator)
        raise ValueError(f"spec.window and spec.topk must be positive ints below 2^31, got {spec}")
    batch.check_current()
    if out is None:
        out = allocate_metadata(batch, spec)
    else:
        _check_reusable(out, batch, spec)
    out.batch, out.spec, out._plans = batch, spec, {}
    (_step_lists_triton if builders_use_triton(batch.device) else _step_lists_torch)(batch, out)
    _fill_decode_orders(out)
    return out


def _fill_decode_orders(meta: StepMetadata) -> None:
    """Each ordered kind's decode order, from its lists' lengths: the SWA lens plus the c128a lens, or for the
    picks kinds ``picks_bound``, an upper bound of every layer's picks (not known when the step starts)."""
    rows = slice(0, meta.batch.num_decode_tokens)
    if rows.stop == 0:
        return
    swa = None if meta.swa_lens is None else meta.swa_lens[rows]
    for kind, buf in meta.decode_orders.items():
        extra = (meta.c128a_lens if kind == "c128a" else meta.picks_bound)[rows]
        if swa is None:
            fill_longest_first(extra, None, buf[rows])
        else:
            fill_longest_first(swa, extra, buf[rows])
