"""The indexer's picks -> cache slots (DESIGN §3): a picks layer's (c4a, c2a, c1a, dsa) per-call index list.

A pick ``w`` of a token at position ``p`` is kept only if entry ``w`` is complete before the token
(``(w+1)·r <= p+1``, r the kind's compress ratio, 1 for dsa: :func:`~sparse_mla.config.complete_entries`); the kept
picks keep their order, compacted to a valid prefix, and become slots through the kind's block table. One step's
conversion of one kind is a :class:`PicksConversion`, made once per step (:func:`step_picks`) and called per layer:
it writes the buffers it names (``indices``, ``lens``, ``kept``), by default the step metadata's picks buffers, so
that every layer of the step, and a CUDA graph captured with them, reads the same tensors — unless the indexer's
select already wrote them for those picks (:meth:`PicksConversion.selected`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ._checks import check_index_range, check_tensor
from .batch import entries_needed, slots_of
from .config import COMPRESS_RATIO, PICKS_KINDS, complete_entries
from .ops.dispatch import builders_use_triton
from .ops.triton import index as triton_index
from .ops.validate import debug_checks_enabled

if TYPE_CHECKING:
    from .metadata import StepMetadata
    from .ops.triton.indexer import PicksInto


def compact_rows(rows: torch.Tensor, out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Move each row's entries ``>= 0`` to its front, keeping their order; ``-1`` fills the rest.

    rows: ``(n, width)`` int32. Returns (compacted ``(n, width)`` int32, counts ``(n,)`` int32).
    Vectorised (a cumulative sum and one scatter), so it is also CUDA-graph capturable.
    """
    keep = rows >= 0
    lens = keep.sum(1, dtype=torch.int32)
    kept_before = torch.cumsum(keep, 1, dtype=torch.int32)
    dropped_before = torch.cumsum(~keep, 1, dtype=torch.int32)
    dest = torch.where(keep, kept_before - 1, lens[:, None] + dropped_before - 1).long()
    if out is None:
        out = torch.empty_like(rows)
    out.scatter_(1, dest, torch.where(keep, rows, -1))
    return out, lens


def check_picks_kind(meta: StepMetadata, kind: str) -> None:
    """``kind`` is a kind of ``meta``'s batch that takes indexer picks (else ``ValueError``)."""
    batch = meta.batch
    if kind not in PICKS_KINDS or kind not in batch.block_tables:
        raise ValueError(f"kind must be a kind of this batch that takes indexer picks "
                         f"{tuple(k for k in PICKS_KINDS if k in batch.block_tables)}, got {kind!r}")


def check_picks(meta: StepMetadata, local: torch.Tensor, kind: str) -> None:
    """The debug-mode checks of a layer's picks (they sync): every pick of a real token is ``-1`` or an entry
    the model can hold (``[0, max_model_len // ratio)``), and no entry is picked twice in a row (the model
    counts a pick once; the kernels would attend to a repeat twice)."""
    valid = meta.is_valid_token.bool()  # padding rows are never read
    check_index_range("topk_indices", local, entries_needed(meta.batch.max_model_len, kind),
                      valid=valid[:, None].expand_as(local))
    rows = torch.sort(torch.where(valid[:, None], local, -1), dim=1).values
    repeated = (rows[:, 1:] == rows[:, :-1]) & (rows[:, 1:] >= 0)
    if bool(repeated.any()):
        t, j = (int(i) for i in repeated.nonzero()[0])
        raise ValueError(f"topk_indices row {t} picks entry {int(rows[t, j])} more than once: picks must be "
                         f"distinct (a top-k), the model attends to each entry once")


def compressed_picks_torch(positions: torch.Tensor, token_to_req: torch.Tensor, table: torch.Tensor,
                           block_size: int, ratio: int, local: torch.Tensor, out_indices: torch.Tensor,
                           out_lens: torch.Tensor, out_kept: torch.Tensor, world: int = 1, rank: int = 0) -> None:
    """Torch twin of :func:`sparse_mla.ops.triton.index.compressed_picks` (same arguments)."""
    visible = torch.where(positions >= 0, complete_entries(positions + 1, ratio), 0)[:, None]
    kept = torch.where((local >= 0) & (local < visible), local, -1)
    req = token_to_req.clamp_min(0)[:, None]
    if world > 1:  # the picks rank ``rank`` owns: the virtual slot's remainder (a missing block's -1 is nobody's)
        virtual = slots_of(table, req, kept, block_size)
        kept = torch.where((virtual >= 0) & (virtual % world == rank), kept, -1)
    _, lens = compact_rows(kept, out=out_kept)
    slots = slots_of(table, req, out_kept, block_size)
    out_indices.copy_(slots if world == 1 else torch.where(slots >= 0, slots // world, -1))
    out_lens.copy_(lens)


class PicksConversion:
    """One step's conversion of a picks kind's picks: everything but the picks is bound once, so a layer call pays
    one launch (the Triton builders) or a few torch ops, and attribute checks; none where the indexer's select
    already wrote the conversion of those picks (:meth:`selected`).

    indices ``(T, topk)`` / lens ``(T,)`` / kept ``(T, topk)`` int32: the buffers each call writes (the picks'
    slots, their count, the kept picks themselves; each row a valid prefix): by default the step's picks buffers
    (``meta.picks_indices`` / ``picks_lens`` / ``picks_local``); :mod:`sparse_mla.index_forms` gives the combined
    rows' compressed columns and lens instead. world / rank: keep only the picks that rank of a context-parallel
    group owns, as its own slots (``meta`` is then the rank's step: :mod:`sparse_mla.context_parallel`), in the
    same one launch.
    """

    def __init__(self, meta: StepMetadata, kind: str, indices: torch.Tensor | None = None,
                 lens: torch.Tensor | None = None, kept: torch.Tensor | None = None, world: int = 1,
                 rank: int = 0) -> None:
        check_picks_kind(meta, kind)
        batch = meta.batch
        self.meta, self.kind = meta, kind
        self.shape, self.device = (batch.token_capacity, meta.spec.topk), batch.device
        self.indices = meta.picks_indices if indices is None else indices
        self.lens = meta.picks_lens if lens is None else lens
        self.kept = meta.picks_local if kept is None else kept
        self._share = (world, rank)
        outs = (self.indices, self.lens, self.kept)
        # the Triton builders bind their launch once (ops.triton.index) to the builder's buffers, the same every
        # step (a context-parallel rank keeps its conversions across steps); None: the torch twin, per call
        self._launch = (triton_index.picks_converter(*self._batch_args(batch, bound=True), *outs, world, rank)
                        if builders_use_triton(batch.device) else None)
        # the step's picks buffers are shared by every picks kind's conversion (V4.1's c2a and c1a) and, for the kept
        # picks, by the combined form's: which picks they hold converted by the indexer's select is one record of
        # the step (``[(kind, picks, version counter or None)]`` or ``[None]``), which every conversion that writes
        # any of them clears, and only the conversion writing exactly them (the kind's default) may skip on
        shared = (meta.picks_indices, meta.picks_lens, meta.picks_local)
        self._owns_shared = all(a is b for a, b in zip(outs, shared))
        self._writes_shared = any(a is b for a, b in zip(outs, shared))
        self._selected: list = meta.plan(("picks", "selected"), lambda: [None])
        self._into: dict[tuple[int, int], PicksInto] = {}  # select_into's views, by (first token, rows)

    def _batch_args(self, batch, bound: bool = False) -> tuple:
        """What the conversion reads of the step's batch: positions, requests, the kind's block table and block size,
        and its compress ratio. ``bound``: for a launch (or the select's :class:`PicksInto`) kept across the builder's
        steps, the block table as the builder's whole buffer (:meth:`StepBatch.table_buffer`: its rows, not one
        step's, bound a request's); else the current batch's view, the step's rows (the torch twin's, per call)."""
        kind = self.kind
        table = batch.table_buffer(kind) if bound else batch.block_tables[kind]
        return batch.positions, batch.token_to_req, table, batch.block_sizes[kind], COMPRESS_RATIO[kind]

    @property
    def takes_select(self) -> bool:
        """Whether the indexer's select can write this conversion in its own launch (:meth:`select_into`): the
        kind's conversion into the step's picks buffers, not a context-parallel rank's (it keeps the rank's share of
        the picks) nor the combined form's."""
        return self._share == (1, 0) and self._owns_shared

    def select_into(self, first: int, rows: int) -> PicksInto:
        """Where the indexer's select converts tokens ``[first, first + rows)`` in its own launch
        (:class:`sparse_mla.ops.triton.indexer.PicksInto`: this conversion's buffers and the step's tensors from
        ``first``; only where :attr:`takes_select`)."""
        into = self._into.get((first, rows))
        if into is None:  # the step's chunks: the same views for every layer of the step
            from .ops.triton.indexer import PicksInto  # Triton is imported only where it runs

            positions, token_to_req, table, block_size, _ = self._batch_args(self.meta.batch, bound=True)
            end = first + rows
            into = self._into[first, rows] = PicksInto(
                positions[first:end], token_to_req[first:end], table, block_size, self.indices[first:end],
                self.lens[first:end], self.kept[first:end], rows)
        return into

    def selected(self, picks: torch.Tensor | None) -> None:
        """The indexer's select has just written ``picks`` and, through :meth:`select_into`, their conversion into
        the step's picks buffers for every token (None: it wrote picks without converting them). Until another
        conversion writes those buffers, or ``picks`` changes in place (a torch op moves its version counter;
        inside ``torch.inference_mode`` tensors keep none, so there a write into the indexer's buffer goes unseen:
        change a copy), a call of this kind with them launches nothing."""
        self._selected[0] = None if picks is None else (
            self.kind, picks, None if picks.is_inference() else picks._version)

    def _holds(self, local: torch.Tensor) -> bool:
        """Whether the step's picks buffers hold this kind's conversion of ``local``, written by the select."""
        done = self._selected[0]
        return (done is not None and done[1] is local and done[0] == self.kind and self._owns_shared
                and (done[2] is None or local._version == done[2]))

    def __call__(self, local: torch.Tensor) -> torch.Tensor:
        """Convert ``local`` ``(T, topk)`` int32 (``-1`` none) into :attr:`indices` / :attr:`lens` / :attr:`kept`;
        returns :attr:`kept`. No host sync (but under ``SPARSE_MLA_DEBUG=1``: :func:`check_picks`). Picks whose
        conversion the indexer's select already wrote here (:meth:`selected`) launch nothing."""
        if self._holds(local):
            if debug_checks_enabled():
                check_picks(self.meta, local, self.kind)
            return self.kept
        if self._writes_shared:  # the step's picks buffers now hold another conversion
            self._selected[0] = None
        if (type(local) is not torch.Tensor or local.dtype is not torch.int32 or local.shape != self.shape
                or local.device != self.device):  # the full check only on a miss: it names what is wrong
            check_tensor("topk_indices", local, dtype=torch.int32, shape=self.shape, device=self.device)
        if debug_checks_enabled():  # device syncs: only in debug mode, like the ops' index checks
            check_picks(self.meta, local, self.kind)
        if local.stride(1) != 1:  # the kernel reads a row's picks at unit stride (a transposed view, a strided slice)
            local = local.contiguous()
        if self._launch is not None:
            self._launch(local)
        else:
            compressed_picks_torch(*self._batch_args(self.meta.batch), local, self.indices, self.lens, self.kept,
                                   *self._share)
        return self.kept


def step_picks(meta: StepMetadata, kind: str) -> PicksConversion:
    """The step's conversion of ``kind``'s picks into its picks buffers (made on first use, kept with the step's
    plans: every layer of the step and :func:`convert_picks` share it)."""
    check_picks_kind(meta, kind)
    return meta.plan(("picks", kind), lambda: PicksConversion(meta, kind))


def convert_picks(meta: StepMetadata, local: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor,
                                                                                   torch.Tensor]:
    """The indexer's picks -> (cache slots, lens, the kept picks themselves), each row a valid prefix.

    kind: a picks kind, ``"c4a"`` / ``"c2a"`` / ``"c1a"`` (picks are local compressed entries) or ``"dsa"``
    (request-local raw positions). Written into the step's picks buffers, which the returned tensors are.
    """
    conversion = step_picks(meta, kind)
    conversion(local)
    return conversion.indices, conversion.lens, conversion.kept
