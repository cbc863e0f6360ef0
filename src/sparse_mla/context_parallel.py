"""Decode context parallelism (DESIGN §4; docs/context_parallel.md): each of ``world`` ranks holds a share of every
request's cache, attends to its own keys without the sink, and the ranks merge their ``(out, lse)`` partials by
log-sum-exp, applying the sink once (:func:`sparse_mla.ops.merge.merge_partials`).

* Ownership (:class:`RankLayout`): raw token ``p`` lives on rank ``p % world``, compressed entry ``w`` (any ratio)
  on rank ``w % world``, at rank-local position ``p // world`` (entry ``w // world``) of that rank's cache,
  through the rank's own block tables.
* Rank-local step metadata (:func:`build_rank_metadata`, :class:`RankStepMetadata`): the step's index lists
  holding only this rank's cache slots, as valid prefixes in fixed buffers, with the attribute names of
  :class:`~sparse_mla.metadata.StepMetadata` (``swa_indices``, ``c4a_indices(picks)``, ...). The rank's batch is
  built by a :class:`~sparse_mla.batch.StepBatchBuilder` with block sizes ``× world``
  (:meth:`RankLayout.batch_builder`): read that way, a rank's block table maps a request position to a *virtual*
  slot whose remainder mod ``world`` is its owner and whose quotient is the owner's real slot. The metadata
  builders, told the rank (``world``, ``rank``), write the rank's lists directly: a window row's owned entries are
  every ``world``-th (built compact, ``ceil(width / world)`` wide), a layer's picks are filtered by the virtual
  slot's remainder and compacted in the same launch that converts them — each list as long as the rank's share.
* The exchange (:class:`PartialsGather`): one all-gather of every rank's partials over ``torch.distributed``
  into buffers allocated once (NCCL on GPUs — capturable in a CUDA graph — or gloo on the CPU), then the merge;
  or (``comm="reduce_scatter"``) an all-gather of the LSEs, each rank's own partial rescaled, and a reduce-scatter
  over heads (each rank gets its head shard of the merged output).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import torch
import torch.distributed as dist

from ._checks import check_device, check_no_overlap, check_positive_int, check_sink, check_tensor, is_int
from .batch import StepBatch, StepBatchBuilder, blocks_needed, entries_needed
from .config import DEFAULT_BLOCK_SIZE, PICKS_KINDS, V4_KINDS
from .metadata import (ORDERED_KINDS, MetadataSpec, StepMetadata, _fill_decode_orders, build_step_metadata,
                       decode_order_of, window_lists_filler)
from .ops.dispatch import backend_for
from .ops.merge import (PARTIAL_DTYPES, check_merge_args, check_merge_outputs, launch_merge, launch_rescale,
                        merge_partials, rescale_partial)
from .ops.validate import D_V, debug_checks_enabled
from .picks import PicksConversion, check_picks_kind

# torch 2.13 renames all_gather_into_tensor / reduce_scatter_tensor (same arguments); older torch (the GPU box's) has
# only the old names. gloo has both collectives (the CPU tests), NCCL too (capturable in a CUDA graph)
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass(frozen=True)
class RankLayout:
    """Which rank holds what: raw token ``p`` and compressed entry ``w`` (of any ratio) belong to rank
    ``p % world`` / ``w % world``, at rank-local position ``p // world`` / entry ``w // world``."""

    world: int
    rank: int

    def __post_init__(self) -> None:
        check_positive_int("world", self.world)
        if self.world >= 2**31:  # (slots are int32: a world past it wraps in their arithmetic, 2^32 + 2 acting as 2)
            raise ValueError(f"world must be below 2^31, got {self.world}")
        if not (is_int(self.rank) and 0 <= self.rank < self.world):
            raise ValueError(f"rank must be an int in [0, world={self.world}), got {self.rank!r}")

    @classmethod
    def of_group(cls, group: dist.ProcessGroup | None = None) -> RankLayout:
        """The layout of this process in ``group`` (default: the default process group)."""
        return cls(dist.get_world_size(group), dist.get_rank(group))

    def blocks_needed(self, seq_len: int, kind: str, block_size: int | None = None) -> int:
        """Blocks of its ``kind`` cache (``block_size`` entries each, default the kind's) the rank's table of a
        request of ``seq_len`` tokens must list: the same count on every rank (the most any rank needs; a rank
        that owns fewer entries leaves at most the last block unused)."""
        entries_needed(seq_len, kind)  # (names a bad seq_len or kind before the default block size is looked up)
        bs = DEFAULT_BLOCK_SIZE[kind] if block_size is None else check_positive_int("block_size", block_size)
        return blocks_needed(seq_len, kind, bs * self.world)

    def batch_builder(self, max_tokens: int, max_reqs: int, max_model_len: int, kinds: Sequence[str] = V4_KINDS,
                      block_sizes: dict[str, int] | None = None, decode_threshold: int = 1,
                      device: torch.device | str = "cpu", num_blocks: Mapping[str, int] | None = None
                      ) -> RankBatchBuilder:
        """The builder of this rank's steps (:class:`RankBatchBuilder`): :class:`StepBatchBuilder`'s arguments,
        ``block_sizes`` / ``num_blocks`` the rank's caches'."""
        return RankBatchBuilder(self, max_tokens, max_reqs, max_model_len, kinds, block_sizes, decode_threshold,
                                device, num_blocks)

    def local_slots(self, virtual: torch.Tensor) -> torch.Tensor:
        """Virtual slots (a rank batch's, any shape, int32) -> this rank's real cache slots; ``-1`` where another
        rank owns the entry, or the slot is ``-1``."""
        check_tensor("virtual", virtual, dtype=(torch.int32, torch.int64))
        owned = (virtual >= 0) & (virtual % self.world == self.rank)
        return torch.where(owned, virtual // self.world, -1)


class RankBatchBuilder(StepBatchBuilder):
    """A :class:`StepBatchBuilder` of one rank's steps, whose batches :func:`build_rank_metadata` takes: requests
    give their full ``seq_len`` / ``query_len`` and this rank's block tables (:meth:`RankLayout.blocks_needed`
    blocks per request and kind); the batch's block sizes are the caches' × ``world`` (its tables' virtual view,
    module docstring), the rest as :class:`StepBatchBuilder`."""

    def __init__(self, layout: RankLayout, max_tokens: int, max_reqs: int, max_model_len: int,
                 kinds: Sequence[str] = V4_KINDS, block_sizes: Mapping[str, int] | None = None,
                 decode_threshold: int = 1, device: torch.device | str = "cpu",
                 num_blocks: Mapping[str, int] | None = None) -> None:
        if not isinstance(layout, RankLayout):
            raise TypeError(f"layout must be a RankLayout, got {type(layout).__name__}")
        self.layout = layout
        sizes = {k: DEFAULT_BLOCK_SIZE[k] for k in kinds if k in DEFAULT_BLOCK_SIZE}  # bad kinds: the base's error
        if isinstance(block_sizes, Mapping):
            sizes.update(block_sizes)
        elif block_sizes is not None:
            sizes = block_sizes  # not a mapping: the base's error
        if isinstance(sizes, Mapping):
            sizes = {k: v * layout.world if is_int(v) and v >= 1 else v for k, v in sizes.items()}
        super().__init__(max_tokens, max_reqs, max_model_len, kinds, sizes, decode_threshold, device, num_blocks)


@dataclass
class RankStepMetadata:
    """One rank's share of a step's metadata: index lists naming only this rank's cache slots, each row a valid
    prefix, in buffers that :func:`build_rank_metadata` ``(…, out=this)`` refills (CUDA graphs).

    step: the ordinary metadata of the rank's batch (lists in virtual slots; its ``batch`` is the rank's).
    slot_mapping ``(T,)``: where this rank writes each new raw token (``-1``: another rank's token, or padding).
    swa_indices ``(T, ceil(W / world))`` + swa_lens ``(T,)`` (None for V3.2); c128a_indices
    ``(T, ceil(ceil(max_model_len / 128) / world))`` + c128a_lens (None without c128a): the rank's share of the
    width, rows at most that long; picks_indices ``(T, topk)`` + picks_lens ``(T,)``: the last
    :meth:`c4a_indices` / :meth:`dsa_indices` call's (None without a picks kind) — ``topk`` wide, since nothing bounds
    how many of a token's picks one rank owns, but each row holds only the rank's picks (``lens`` about
    ``topk / world``), and the kernels walk a row's length, not its width (``sparse_mla.ops.attention_plan``).

    A :class:`~sparse_mla.layer.SparseMLAAttention` takes it as its ``meta`` in context-parallel mode
    (``layer(q, rank_meta, caches, picks, out=out, context_parallel=gather)``): the step's layer plans are kept
    with it (:meth:`plan`, as :meth:`StepMetadata.plan`), and they convert a layer's picks with this rank's rule.
    """

    layout: RankLayout
    step: StepMetadata
    slot_mapping: torch.Tensor
    swa_indices: torch.Tensor | None
    swa_lens: torch.Tensor | None
    c128a_indices: torch.Tensor | None
    c128a_lens: torch.Tensor | None
    picks_indices: torch.Tensor | None
    picks_lens: torch.Tensor | None
    decode_orders: dict[str, torch.Tensor] = field(default_factory=dict)
    _fill_lists: object = field(default=None, repr=False)  # fill(batch): the window lists' one launch, bound once
    _conversions: dict = field(default_factory=dict, repr=False)  # {picks kind: PicksConversion}, made once
    _plans: dict = field(default_factory=dict, repr=False)  # this step's plans (new with each build)

    @property
    def batch(self) -> StepBatch:
        return self.step.batch

    @property
    def spec(self) -> MetadataSpec:
        return self.step.spec

    @property
    def picks_local(self) -> None:
        """None: a rank keeps no list of kept picks (the workspace prefill, its one reader, is not run on a rank's
        step)."""
        return None

    @property
    def picks_bound(self) -> torch.Tensor | None:
        """``(T,)``: at most this many picks of a token can be kept (the step's bound over all ranks), the decode
        order's estimate of the picks lists."""
        return self.step.picks_bound

    @property
    def world(self) -> int:
        """The ranks the step's caches are split over (a rank's block tables are read with block sizes × world)."""
        return self.layout.world

    def check_current(self) -> None:
        """``ValueError`` if the rank's batch is stale (its builder has built another step since)."""
        self.step.check_current()

    def check_gather(self, gather: object) -> None:
        """A layer call's ``context_parallel`` argument against this metadata: the :class:`PartialsGather` of this
        rank's layout (``ValueError`` / ``TypeError`` naming what is wrong)."""
        if gather is None:
            raise ValueError("meta is a RankStepMetadata (one rank's share of the step): pass context_parallel=, the "
                             "PartialsGather of the rank's group that merges every rank's partials")
        if not isinstance(gather, PartialsGather):
            raise TypeError(f"context_parallel must be a PartialsGather, got {type(gather).__name__}")
        if gather.layout != self.layout:
            raise ValueError(f"context_parallel gathers over {gather.layout}, but meta was built for {self.layout}")

    def c4a_indices(self, topk_local: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's C4A slots of the indexer's picks ``(T, topk)`` int32 (local entry numbers of the whole
        request, ``-1`` none): a visible pick this rank owns becomes its slot, every other is dropped; valid
        prefix. Returns (indices ``(T, topk)``, lens ``(T,)``) int32, views of buffers the next call refills."""
        return self._convert(topk_local, "c4a")

    def dsa_indices(self, topk_positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """V3.2: as :meth:`c4a_indices` for picks that are request-local raw positions."""
        return self._convert(topk_positions, "dsa")

    def picks_for(self, kind: str, picks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's slots of a layer's picks (:meth:`StepMetadata.picks_for`: any picks kind of the batch): the
        visible picks it owns, order kept; the others dropped here (kept on their owners)."""
        return self._convert(picks, kind)

    def _convert(self, picks: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
        self.check_current()
        conversion = self._conversions.get(kind)
        if conversion is None:
            check_picks_kind(self.step, kind)  # the ValueError naming the batch's picks kinds
        conversion(picks)  # checks the picks; one launch: the visible picks this rank owns, as its slots
        return self.picks_indices, self.picks_lens

    def plan(self, key: tuple, make):
        """The step-scoped plan stored under ``key``, made by ``make()`` on first use (as :meth:`StepMetadata.plan`;
        each build starts anew). The conversion of a kind's picks, stored under ``("picks", kind)`` (where
        :func:`~sparse_mla.picks.step_picks` and :mod:`~sparse_mla.index_forms` look it up), is this rank's
        (:meth:`c4a_indices`), put there by the build; a conversion into other lists (the combined index form's)
        is a ``ValueError``."""
        self.check_current()
        plan = self._plans.get(key)
        if plan is None:
            if key[0] == "picks":
                raise ValueError(f"a rank's step converts a layer's picks into its own lists only (index_form "
                                 f"'padded' or 'ragged'), not for {key}: the combined index form is not supported "
                                 f"in context-parallel mode")
            plan = self._plans[key] = make()
        return plan

    def decode_order(self, kind: str) -> torch.Tensor | None:
        """The ops' ``order`` for this rank's decode tokens in layers of ``kind``, longest rank-local lists first
        (as :meth:`StepMetadata.decode_order`); None for SWA layers."""
        return decode_order_of(self.decode_orders, self.batch, kind)

    def new_entries(self, kind: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The entries of ``kind`` this step completes (:meth:`StepBatch.new_entries`): ``(req, entry, slot)``,
        ``slot`` this rank's (``-1`` for an entry another rank owns: the ops' inserts skip it)."""
        req, entry, virtual = self.batch.new_entries(kind)
        return req, entry, self.layout.local_slots(virtual)


def _allocate(step: StepMetadata, layout: RankLayout) -> RankStepMetadata:
    """The rank's buffers, each list its share of the step's width, and what fills them, bound once: the window
    lists' launch and each picks kind's conversion (the builder's buffers are the same every step)."""
    batch, world = step.batch, layout.world
    cap, dev = batch.token_capacity, batch.device
    i32 = dict(dtype=torch.int32, device=dev)
    lists, windows = {}, {}
    for name in ("swa", "c128a", "picks"):
        full = getattr(step, f"{name}_indices")
        if full is None:
            lists[name] = (None, None)
            continue
        span = full.shape[1]
        width = span if name == "picks" else math.ceil(span / world)
        lists[name] = (torch.full((cap, width), -1, **i32), torch.zeros(cap, **i32))
        if name != "picks":
            windows[name] = (*lists[name], span)
    orders = {k: torch.empty(cap, **i32) for k in ORDERED_KINDS if k in batch.block_tables}
    meta = RankStepMetadata(layout, step, torch.empty(cap, **i32), *lists["swa"], *lists["c128a"], *lists["picks"],
                            orders)
    meta._fill_lists = window_lists_filler(batch, windows, torch.empty(cap, **i32), world, layout.rank)
    if meta.picks_indices is not None:
        kept = torch.empty_like(meta.picks_indices)  # the conversion's kept picks: no reader on a rank
        meta._conversions = {kind: PicksConversion(step, kind, meta.picks_indices, meta.picks_lens, kept, world,
                                                   layout.rank)
                             for kind in PICKS_KINDS if kind in batch.block_tables}  # every picks kind (V4.1: two)
    return meta


def build_rank_metadata(batch: StepBatch, layout: RankLayout, spec: MetadataSpec = MetadataSpec(),
                        out: RankStepMetadata | None = None) -> RankStepMetadata:
    """This rank's metadata of a step. batch: the rank's (built by ``layout``'s :meth:`RankLayout.batch_builder`);
    spec: as :func:`build_step_metadata`; out: an earlier step's result of the same builder, layout and capacities,
    whose buffers are refilled in place (CUDA-graph capturable)."""
    if not isinstance(layout, RankLayout):
        raise TypeError(f"layout must be a RankLayout, got {type(layout).__name__}")
    if out is not None and not isinstance(out, RankStepMetadata):
        raise TypeError(f"out must be a RankStepMetadata (an earlier step's) or None, got {type(out).__name__}")
    if out is not None and out.layout != layout:
        raise ValueError(f"out was built for {out.layout}, this step is for {layout}")
    if not isinstance(batch, StepBatch):
        raise TypeError(f"batch must be the rank's StepBatch, got {type(batch).__name__}")
    builder = batch.builder
    if not (isinstance(builder, RankBatchBuilder) and builder.layout == layout):
        made = f"for {builder.layout}" if isinstance(builder, RankBatchBuilder) else "by a plain StepBatchBuilder"
        raise ValueError(f"batch was built {made}: build {layout}'s batches with its batch_builder (block tables "
                         f"read with block sizes × world)")
    step = build_step_metadata(batch, spec, None if out is None else out.step)  # checks spec and staleness
    meta = _allocate(step, layout) if out is None else out
    meta.slot_mapping.copy_(layout.local_slots(batch.slot_mapping))
    meta._fill_lists(batch)  # the rank's window lists, compact: one launch
    meta._plans = {("picks", kind): conversion for kind, conversion in meta._conversions.items()}
    if meta.picks_indices is not None:  # until a layer converts its picks: nothing
        meta.picks_indices.fill_(-1)
        meta.picks_lens.zero_()
    _fill_decode_orders(meta)
    return meta


COMM_FORMS = ("allgather", "reduce_scatter")


class PartialsGather:
    """The exchange of every rank's attention partials ``(out (T, H, D), lse (T, H))`` and their merge, over
    ``torch.distributed`` (the communication is torch's: NCCL on GPUs, gloo on the CPU), in one of two forms:

    * ``comm="allgather"`` (default): one all-gather of every rank's ``[out | lse]`` (packed into one byte buffer,
      16-byte aligned), then the merge (:func:`~sparse_mla.ops.merge.merge_partials`). Every rank ends with every
      head of the merged output, the same bits on every rank. Bytes received per rank: ``world · T · H · (2D + 4)``.
    * ``comm="reduce_scatter"`` (vLLM's DCP form): an all-gather of the LSEs alone, each rank scales its own
      partial by its weight in the merge (:func:`~sparse_mla.ops.merge.rescale_partial`), then a reduce-scatter
      over heads sums the ranks' scaled partials: rank ``r`` ends with heads ``[r·H/world, (r+1)·H/world)`` of the
      merged output only, ``(T, H / world, D)`` (``H`` divisible by ``world``). Bytes per rank: about
      ``T · H · 2D`` sent and received through the ring, ``world`` times fewer than the all-gather form's; the
      engine gives each rank's head shard to a row-parallel output projection (heads split as with tensor
      parallelism), whose own reduction follows.

    Either way a layer's exchange is collectives of fixed shapes on buffers allocated here, once (capturable in a
    CUDA graph on NCCL), and a single kernel beside them; no host sync. Give :attr:`out_partial` to the attention op
    as its ``out=`` and :attr:`lse_partial` as its LSE buffer, and nothing is copied. :attr:`merged_lse` ``(T, H)``
    float32 is a fixed buffer for the merged LSE (every head, in both forms). :attr:`out_heads`: the heads of the
    merged output this rank gets.

    max_tokens: T, the token capacity of the step (the partials' first axis); num_heads: H; dim: D (the ops' 512);
    dtype: the partial outputs' (the ops' bf16); device: this rank's; group: the context-parallel process group
    (default the default group); comm: the form.
    """

    def __init__(self, max_tokens: int, num_heads: int, *, dim: int = D_V, dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | str = "cpu", group: dist.ProcessGroup | None = None,
                 comm: str = "allgather") -> None:
        for name, value in (("max_tokens", max_tokens), ("num_heads", num_heads), ("dim", dim)):
            check_positive_int(name, value)
        if dtype not in PARTIAL_DTYPES:
            raise ValueError(f"dtype must be one of {PARTIAL_DTYPES}, got {dtype}")
        if comm not in COMM_FORMS:
            raise ValueError(f"comm must be one of {COMM_FORMS}, got {comm!r}")
        if group is not None and not isinstance(group, dist.ProcessGroup):
            raise TypeError(f"group must be a torch.distributed ProcessGroup or None, got {type(group).__name__}")
        device = check_device("device", device)
        self.layout = RankLayout.of_group(group)
        self.group, self.comm = group, comm
        world = self.layout.world
        if comm == "reduce_scatter" and num_heads % world:
            raise ValueError(f"comm='reduce_scatter' splits the heads over the ranks: num_heads ({num_heads}) must be "
                             f"divisible by the group's {world} ranks")
        self.out_heads = num_heads if comm == "allgather" else num_heads // world
        rows = max_tokens * num_heads
        if comm == "allgather":
            out_bytes = -(-rows * dim * dtype.itemsize // 16) * 16  # the lse part starts 16-byte aligned
            row_bytes = -(-(out_bytes + rows * 4) // 16) * 16
            self._send = torch.empty(row_bytes, dtype=torch.uint8, device=device)
            self._recv = torch.empty(world * row_bytes, dtype=torch.uint8, device=device)  # flat: gloo's
            per_rank = self._recv.view(world, row_bytes)
            out_part, lse_part = slice(0, rows * dim * dtype.itemsize), slice(out_bytes, out_bytes + rows * 4)
            self.out_partial = self._send[out_part].view(dtype).view(max_tokens, num_heads, dim)
            self.lse_partial = self._send[lse_part].view(torch.float32).view(max_tokens, num_heads)
            self.outs = per_rank[:, out_part].view(dtype).view(world, max_tokens, num_heads, dim)
            self.lses = per_rank[:, lse_part].view(torch.float32).view(world, max_tokens, num_heads)
        else:
            self.out_partial = torch.empty(max_tokens, num_heads, dim, dtype=dtype, device=device)
            self.lse_partial = torch.empty(max_tokens, num_heads, dtype=torch.float32, device=device)
            self.lses = torch.empty(world, max_tokens, num_heads, dtype=torch.float32, device=device)
            # the scaled partial, head shard s (the reduce-scatter's input chunk of rank s) contiguous
            self.scaled = torch.empty(world, max_tokens, num_heads // world, dim, dtype=dtype, device=device)
            # the collectives' views, concatenated along the first axis (gloo takes no stacked shape)
            self._lses_flat = self.lses.view(world * max_tokens, num_heads)
            self._scaled_flat = self.scaled.view(world * max_tokens, num_heads // world, dim)
        self.merged_lse = torch.empty(max_tokens, num_heads, dtype=torch.float32, device=device)

    def __call__(self, out: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor | None = None, *,
                 merged: torch.Tensor | None = None, merged_lse: torch.Tensor | None = None,
                 backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
        """Exchange this rank's partials ``out (T, H, D)`` (the attention op's; :attr:`out_partial` itself for no
        copy) and ``lse (T, H)`` float32 (:attr:`lse_partial` for none) with every rank, and merge them with
        ``sink (H,)`` float32 (or None). merged: where the merged output goes, ``(T, out_heads, D)`` contiguous (this
        rank's head shard in the reduce-scatter form); merged_lse ``(T, H)``: the merged LSE; default new tensors.
        backend: the merge's. Returns ``(merged, merged_lse)``."""
        part, part_lse = self.out_partial, self.lse_partial
        family = backend_for(backend, part, "out_partial")
        check_tensor("out", out, dtype=part.dtype, shape=part.shape, device=part.device)
        check_tensor("lse", lse, dtype=torch.float32, shape=part_lse.shape, device=part.device)
        if out.data_ptr() != part.data_ptr() or out.stride() != part.stride():
            part.copy_(out)
        if lse.data_ptr() != part_lse.data_ptr() or lse.stride() != part_lse.stride():
            part_lse.copy_(lse)
        # shapes and outputs against the gathered buffers; their values (the LSEs) only after the exchange, which
        # fills them: a NaN of one rank is then an error on every rank (before it, that rank would raise alone and
        # leave the others waiting in the collective)
        if self.comm == "allgather":
            merged, merged_lse = check_merge_args(self.outs, self.lses, sink, merged, merged_lse, False,
                                                  ("merged", "merged_lse"))
        else:
            merged, merged_lse = self._checked_shard(merged, merged_lse, sink)
        if family == "reference" or debug_checks_enabled():
            if sink is not None:
                check_sink(sink, part_lse.shape[1], part.device)
        self.exchange(sink, merged, merged_lse, family)  # the reference merge / rescale check the gathered LSEs
        if family != "reference" and debug_checks_enabled() and bool(torch.isnan(self.lses).any()):
            raise ValueError("lse must not hold NaN on any rank (+inf marks a rank with no key)")
        return merged, merged_lse

    def _checked_shard(self, merged: torch.Tensor | None, merged_lse: torch.Tensor | None, sink: torch.Tensor | None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """The reduce-scatter form's outputs, checked (allocated where None): ``merged`` the rank's head shard
        ``(T, out_heads, D)`` contiguous, of the partials' dtype; the rescale's checks for the rest."""
        part = self.out_partial
        shard = (part.shape[0], self.out_heads, part.shape[2])
        if merged is None:
            merged = torch.empty(shard, dtype=part.dtype, device=part.device)
        check_tensor("merged", merged, dtype=part.dtype, shape=shard, device=part.device)
        if not merged.is_contiguous():
            raise ValueError("merged must be contiguous (the reduce-scatter writes it)")
        merged_lse = check_merge_outputs(self.scaled, self.scaled.shape, part.dtype, merged_lse,
                                         {"out_partial": part, "lses": self.lses, "sink": sink}, self.lses, sink,
                                         False, ("scaled", "merged_lse"))[1]
        # the reduce-scatter writes merged last: an LSE or sink under it would be overwritten, and the scaled
        # partials are the collective's input
        check_no_overlap("merged", merged, {"merged_lse": merged_lse, "sink": sink, "scaled": self.scaled})
        return merged, merged_lse

    def exchange(self, sink: torch.Tensor | None, merged: torch.Tensor, merged_lse: torch.Tensor,
                 family: str) -> None:
        """The exchange of :attr:`out_partial` / :attr:`lse_partial` (the attention's partials, written there) into
        ``merged`` / ``merged_lse``, on arguments the caller has checked (as :meth:`__call__` does; the layer's
        context-parallel mode: its own sink and output): the collectives and one kernel, no check, no allocation,
        no host sync. family: the merge's implementation, ``"triton"`` or ``"reference"`` (which checks its values,
        as the reference attention ops do)."""
        if self.comm == "allgather":
            _all_gather(self._recv, self._send, group=self.group)
            if family == "reference":
                merge_partials(self.outs, self.lses, sink, out=merged, lse_out=merged_lse, backend=family)
            else:
                launch_merge(self.outs, self.lses, sink, merged, merged_lse, family)
            return
        _all_gather(self._lses_flat, self.lse_partial, group=self.group)
        if family == "reference":
            rescale_partial(self.out_partial, self.lses, self.layout.rank, sink, shards=self.layout.world,
                            out=self.scaled, lse_out=merged_lse, backend=family)
        else:
            launch_rescale(self.out_partial, self.lses, self.layout.rank, sink, self.scaled, merged_lse, family)
        _reduce_scatter(merged, self._scaled_flat, group=self.group)
