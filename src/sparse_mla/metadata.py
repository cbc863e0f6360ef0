"""Step metadata (DESIGN §3): per-token index lists into the paged caches, built once per step.

Every list is a *valid prefix*: valid slots first, ``-1`` after, ``lens`` = their count. Built with
vectorised torch or one Triton launch on the batch's device (no loop over tokens), into fixed-size int32
buffers that the next step refills (``build_step_metadata(batch, spec, out=last_step_meta)``), so a whole
decode step can be captured in a CUDA graph.

* SWA: token at position ``p`` sees raw tokens ``max(0, p-W+1) … p``.
* C128A: every compressed entry ``w`` with ``(w+1)·128 <= p+1``, i.e. entries ``0 … (p+1)//128 - 1``.
* C4A: the indexer's picks (local entry numbers) that are visible, ``(w+1)·4 <= p+1``, converted to
  global slots per layer by :meth:`StepMetadata.c4a_indices`; an invisible pick is dropped, not an error
  (a pick below -1 or past ``max_model_len``'s entries is one, checked under ``SPARSE_MLA_DEBUG=1``).
* DSA (V3.2): the indexer's picks are request-local raw positions; a pick after the token's own position is
  dropped; converted per layer by :meth:`StepMetadata.dsa_indices` (the c4a rule with ratio 1).
* Decode order (:meth:`StepMetadata.decode_order`): per kind with long lists, the decode tokens longest key
  lists first, the order the attention kernels take them in (``sparse_mla.ops.order``).
* Prefill workspace plan (:meth:`StepMetadata.workspace_plan`): for backends that gather the keys of
  prefill tokens into a bf16 workspace, chunks of prefill tokens whose keys fit a byte budget.
* Layer plans (:meth:`StepMetadata.layer_plan`): what a layer call needs beyond its own tensors, resolved
  once per step (``sparse_mla.plan``).

Metadata is only as current as its batch: once the batch's builder builds another step, its buffers hold
that step, and using this metadata is a ``ValueError`` (:meth:`StepBatch.check_current`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ._checks import check_index_range, check_tensor
from .batch import StepBatch, entries_needed, slots_of
from .config import COMPRESS_RATIO, PICKS_KINDS
from .ops import triton_index
from .ops.dispatch import builders_use_triton
from .ops.order import fill_longest_first
from .ops.validate import debug_checks_enabled

ORDERED_KINDS = ("c4a", "c128a", "dsa")  # kinds whose decode tokens get a longest-first order


@dataclass(frozen=True)
class MetadataSpec:
    """What the step's layers need: the SWA window ``W`` (V4) and the indexer width (top-k: c4a, dsa)."""

    window: int = 128
    topk: int = 512


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


@dataclass
class StepMetadata:
    """Index lists of one step, shared by all layers. Row ``t`` belongs to token ``t`` of the batch
    (``token_capacity`` rows; padding rows have length 0).

    swa_indices ``(T, W)`` + swa_lens ``(T,)`` (``None`` for a V3.2 batch); c128a_indices
    ``(T, ceil(max_model_len/128))`` + c128a_lens (``None`` when the batch has no c128a block table).
    picks_indices / picks_lens / picks_local ``(T, topk)``, ``(T,)``, ``(T, topk)``: the picks kind's
    (``picks_kind``: c4a or dsa) converted picks, filled per layer by :meth:`c4a_indices` /
    :meth:`dsa_indices`; picks_bound ``(T,)``: ``min(topk, entries visible to the token)``, what any layer's
    picks count can reach (the decode order's estimate). decode_orders: ``(T,)`` per ordered kind, see
    :meth:`decode_order`.
    """

    batch: StepBatch
    spec: MetadataSpec
    is_valid_token: torch.Tensor
    swa_indices: torch.Tensor | None
    swa_lens: torch.Tensor | None
    c128a_indices: torch.Tensor | None
    c128a_lens: torch.Tensor | None
    picks_indices: torch.Tensor | None
    picks_lens: torch.Tensor | None
    picks_local: torch.Tensor | None
    picks_bound: torch.Tensor | None
    decode_orders: dict[str, torch.Tensor] = field(default_factory=dict)
    _plans: dict = field(default_factory=dict, repr=False)  # this step's plans (cleared by each build)
    _fill_lists: object = field(default=None, repr=False)  # the bound launch of the step lists (every build)

    @property
    def picks_kind(self) -> str | None:
        """The kind whose layers convert indexer picks into :attr:`picks_indices`: ``c4a``, ``dsa`` or None."""
        return next((k for k in PICKS_KINDS if k in self.batch.block_tables), None)

    def check_current(self) -> None:
        """``ValueError`` if this metadata's batch is stale (its builder has built another step since)."""
        self.batch.check_current()

    def c4a_indices(self, topk_local: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Global C4A slots from the indexer's local picks, compacted to a valid prefix.

        topk_local: ``(T, topk)`` int32 local entry numbers (``-1`` none). A pick ``w`` is kept only if
        entry ``w`` is complete before the token (``(w+1)·4 <= pos+1``); others are dropped, never
        attended. Kept picks keep their order. Picks are expected to be distinct (a top-k): an entry
        picked twice is attended twice, as FlashMLA's sparse kernels do (``SPARSE_MLA_DEBUG=1`` rejects
        repeats). Returns (indices ``(T, topk)`` int32, lens ``(T,)`` int32), views of this step's buffers:
        the next call overwrites them.
        """
        return convert_picks(self, topk_local, "c4a")[:2]

    def dsa_indices(self, topk_positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """V3.2: cache slots of the indexer's picks, compacted to a valid prefix.

        topk_positions: ``(T, topk)`` int32 request-local token positions (``-1`` none); a pick after the
        token's own position is dropped. Otherwise as :meth:`c4a_indices`.
        """
        return convert_picks(self, topk_positions, "dsa")[:2]

    def decode_order(self, kind: str) -> torch.Tensor | None:
        """The attention ops' ``order`` for this step's decode tokens in layers of ``kind``: their
        :func:`~sparse_mla.ops.longest_first` permutation, ``(num_decode_tokens,)`` int32, a view of a buffer
        refilled by each build (so a CUDA graph that reads it stays valid). None for SWA layers, whose
        lists (at most the window) are too short for their order to matter."""
        buf = self.decode_orders.get(kind)
        return None if buf is None else buf[: self.batch.num_decode_tokens]

    def workspace_plan(self, kind: str, budget_bytes: int, head_dim: int = 512) -> list["WorkspaceChunk"]:
        """The prefill workspace plan of layers of ``kind`` (see :func:`plan_prefill_workspace`),
        built on first use and shared by every layer of the step that asks for the same budget."""
        key = ("workspace", kind, budget_bytes, head_dim)
        if key not in self._plans:
            self._plans[key] = plan_prefill_workspace(self, kind, budget_bytes, head_dim)
        return self._plans[key]

    def plan(self, key: tuple, make):
        """The step-scoped plan stored under ``key``, made by ``make()`` on first use (cleared by each build)."""
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = make()
        return plan


def _visible_entries(batch: StepBatch, ratio: int) -> torch.Tensor:
    """Compressed entries complete before each token: ``(pos + 1) // ratio`` (0 for padding); for ratio 1
    (dsa) the raw positions ``0 … pos``."""
    return torch.where(batch.positions >= 0, (batch.positions + 1) // ratio, 0)


def convert_picks(meta: StepMetadata, local: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor,
                                                                                   torch.Tensor]:
    """The indexer's picks -> (cache slots, lens, the kept picks themselves), each row a valid prefix.

    kind: ``"c4a"`` (picks are local compressed entries) or ``"dsa"`` (request-local raw positions). Written
    into the step's picks buffers, which the returned tensors are views of.
    """
    check_picks_kind(meta, kind)
    meta.plan(("picks", kind), lambda: PicksConverter(meta, kind))(local)
    return meta.picks_indices, meta.picks_lens, meta.picks_local


def check_picks_kind(meta: StepMetadata, kind: str) -> None:
    """``kind`` is a kind of ``meta``'s batch that takes indexer picks (else ``ValueError``)."""
    batch = meta.batch
    if kind not in PICKS_KINDS or kind not in batch.block_tables:
        raise ValueError(f"kind must be a kind of this batch that takes indexer picks "
                         f"{tuple(k for k in PICKS_KINDS if k in batch.block_tables)}, got {kind!r}")


class PicksConverter:
    """One step's conversion of a kind's picks (:func:`convert_picks`): everything but the picks is bound once,
    so a layer call pays one launch and attribute checks."""

    def __init__(self, meta: StepMetadata, kind: str, outs: tuple | None = None) -> None:
        """outs: ``(indices (T, topk), lens (T,), kept (T, topk))`` int32 to write (default the step's picks
        buffers; :mod:`sparse_mla.index_forms` gives the combined rows' compressed columns)."""
        batch = meta.batch
        self.meta, self.kind = meta, kind
        self.shape, self.device = (batch.token_capacity, meta.spec.topk), batch.device
        fixed = (batch.positions, batch.token_to_req, batch.block_tables[kind], batch.block_sizes[kind],
                 COMPRESS_RATIO[kind])
        outs = outs or (meta.picks_indices, meta.picks_lens, meta.picks_local)
        if builders_use_triton(batch.device):
            self._convert = triton_index.picks_converter(*fixed, *outs)
        else:
            self._convert = lambda local: _compressed_picks_torch(*fixed, local, *outs)

    def __call__(self, local: torch.Tensor) -> None:
        if (type(local) is not torch.Tensor or local.dtype is not torch.int32 or local.shape != self.shape
                or local.device != self.device):  # the full check only on a miss: it names what is wrong
            check_tensor("topk_indices", local, dtype=torch.int32, shape=self.shape, device=self.device)
        if debug_checks_enabled():  # device syncs: only in debug mode, like the ops' index checks
            check_picks(self.meta, local, self.kind)
        self._convert(local)


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


def _compressed_picks_torch(positions: torch.Tensor, token_to_req: torch.Tensor, table: torch.Tensor,
                            block_size: int, ratio: int, local: torch.Tensor, out_indices: torch.Tensor,
                            out_lens: torch.Tensor, out_kept: torch.Tensor) -> None:
    """Torch twin of :func:`sparse_mla.ops.triton_index.compressed_picks` (same arguments)."""
    visible = torch.where(positions >= 0, (positions + 1) // ratio, 0)[:, None]
    kept = torch.where((local >= 0) & (local < visible), local, -1)
    _, lens = compact_rows(kept, out=out_kept)
    out_indices.copy_(slots_of(table, token_to_req.clamp_min(0)[:, None], out_kept, block_size))
    out_lens.copy_(lens)


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
        buf = getattr(out, name)
        got = None if buf is None else tuple(buf.shape)
        if got != shape or (buf is not None and buf.device != batch.device):
            raise ValueError(f"out's {name} has shape {got} on {None if buf is None else buf.device}, this step needs "
                             f"{shape} on {batch.device}: build without out= when the capacities change")


def _window_indices_torch(batch: StepBatch, kind: str, indices: torch.Tensor, lens: torch.Tensor) -> None:
    """Torch twin of the window rows of :func:`sparse_mla.ops.triton_index.step_lists`. SWA: slots of positions
    ``max(0, p-W+1) … p`` (W = the width of ``indices``); c128a: every complete entry ``0 … (p+1)//128 - 1``.
    Written into ``indices`` / ``lens`` as valid prefixes."""
    pos, width = batch.positions, indices.shape[1]
    valid = pos >= 0
    j = torch.arange(width, device=pos.device, dtype=torch.int32)[None, :]
    if kind == "swa":
        start = (pos - width + 1).clamp_min(0)
        count = torch.where(valid, pos - start + 1, 0)
        entries = torch.where(j < count[:, None], start[:, None] + j, -1)
    else:
        count = _visible_entries(batch, COMPRESS_RATIO[kind])
        entries = torch.where(j < count[:, None], j, -1)
    req = batch.token_to_req.clamp_min(0)[:, None]
    indices.copy_(slots_of(batch.block_tables[kind], req, entries, batch.block_sizes[kind]))
    lens.copy_(count)


def _picks_buffers(meta: StepMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
    if meta.picks_indices is None:
        return None
    return meta.picks_indices, meta.picks_local, meta.picks_lens, meta.picks_bound


def _step_lists_triton(batch: StepBatch, out: StepMetadata) -> None:
    """Fill ``out``'s shared lists (validity, SWA, C128A, emptied picks buffers) in one launch, bound on the
    first build: every later build reads the same builder buffers (``_check_reusable``) into the same lists."""
    if out._fill_lists is None:
        tables, sizes = batch.block_tables, batch.block_sizes

        def window_list(kind: str, indices: torch.Tensor | None, lens: torch.Tensor | None):
            return None if indices is None else triton_index.WindowList(tables[kind], sizes[kind], indices, lens)

        picks = _picks_buffers(out)
        out._fill_lists = triton_index.step_lists_launcher(
            batch.positions, batch.token_to_req, out.is_valid_token,
            window_list("swa", out.swa_indices, out.swa_lens),
            window_list("c128a", out.c128a_indices, out.c128a_lens), picks,
            COMPRESS_RATIO[out.picks_kind] if picks is not None else 1)
    out._fill_lists()


def _step_lists_torch(batch: StepBatch, out: StepMetadata) -> None:
    """Torch twin of :func:`_step_lists_triton`."""
    out.is_valid_token.copy_(batch.positions >= 0)
    if out.swa_indices is not None:
        _window_indices_torch(batch, "swa", out.swa_indices, out.swa_lens)
    if out.c128a_indices is not None:
        _window_indices_torch(batch, "c128a", out.c128a_indices, out.c128a_lens)
    picks = _picks_buffers(out)
    if picks is not None:  # until a layer converts its picks: nothing visible
        for buf, empty in zip(picks, (-1, -1, 0)):
            buf.fill_(empty)
        out.picks_bound.copy_(_visible_entries(batch, COMPRESS_RATIO[out.picks_kind]).clamp_max(out.spec.topk))


def build_step_metadata(batch: StepBatch, spec: MetadataSpec = MetadataSpec(),
                        out: StepMetadata | None = None) -> StepMetadata:
    """Build the step's metadata; with ``out`` (an earlier step's metadata of the same builder and
    capacities), refill its buffers in place and return it. CUDA-graph capturable with ``out``."""
    for name, value, cls in (("batch", batch, StepBatch), ("spec", spec, MetadataSpec)):
        if not isinstance(value, cls):
            raise TypeError(f"{name} must be a {cls.__name__}, got {type(value).__name__}")
    if out is not None and not isinstance(out, StepMetadata):
        raise TypeError(f"out must be a StepMetadata (an earlier step's) or None, got {type(out).__name__}")
    if spec.window < 1 or spec.topk < 1:
        raise ValueError(f"spec.window and spec.topk must be positive, got {spec}")
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


# ----------------------------------------------------------------------------------------------
# Prefill workspace plan
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class WorkspaceChunk:
    """A run of prefill tokens whose keys are gathered into one bf16 workspace ``(num_rows, head_dim)``.

    Workspace layout: rows ``[0, n_c)`` hold ``compressed_slots`` of the compressed cache (each
    segment's entries ``0 … N-1``, N = the entries complete before its last token), rows
    ``[n_c, n_c + n_s)`` hold ``swa_slots`` of the SWA cache (each segment's raw tokens from its first
    token's window start to its last token). A segment is the part of one request inside the chunk;
    a long prefill is split over several chunks.

    Per token (rows ``tokens`` of the batch): ``swa_rows`` ``(n, W)`` workspace rows of its window
    (valid prefix, ``swa_lens``) and ``comp_base`` ``(n,)``, the workspace row of its segment's entry 0.
    ``indices`` / ``lens``: the token's full workspace index list, valid prefix — precomputed for swa
    and c128a; for c4a it depends on the layer's picks (:func:`workspace_indices`).
    """

    kind: str
    tokens: slice
    num_rows: int
    compressed_slots: torch.Tensor
    swa_slots: torch.Tensor
    swa_rows: torch.Tensor
    swa_lens: torch.Tensor
    comp_base: torch.Tensor
    indices: torch.Tensor | None
    lens: torch.Tensor | None


def _segment_rows(p0: int, p1: int, window: int, ratio: int) -> int:
    """Workspace rows of a segment whose tokens sit at positions ``p0 … p1``: its window's raw tokens
    (``window`` 0: none, V3.2) plus the ``(p1+1) // ratio`` entries its last token can see (``ratio`` 0: none)."""
    return (p1 - max(0, p0 - window + 1) + 1 if window else 0) + ((p1 + 1) // ratio if ratio else 0)


def _workspace_geometry(meta: StepMetadata, kind: str) -> tuple[int, int]:
    """(window, ratio) of ``kind``'s workspace segments: swa = (W, 0), c4a / c128a = (W, r), dsa = (0, 1)
    (every raw position up to the token's, no window part)."""
    if kind == "dsa":
        return 0, 1
    return meta.spec.window, (COMPRESS_RATIO[kind] if kind != "swa" else 0)


def plan_prefill_workspace(meta: StepMetadata, kind: str, budget_bytes: int,
                           head_dim: int = 512) -> list[WorkspaceChunk]:
    """Chunk the step's prefill tokens so each chunk's bf16 workspace fits ``budget_bytes``.

    A request's segment needs ``gather_len = n_tokens + min(prefix, W-1)`` SWA rows (prefix = the
    positions before the segment) plus, for c4a / c128a, the ``(p_last+1) // ratio`` compressed entries
    its last token can see. Chunks are filled greedily in token order; a request that does not fit
    is split between chunks. Planning runs on the host from the batch's host copies (no device sync);
    only the per-chunk index tensors are built on the device, vectorised.
    """
    if kind not in meta.batch.block_tables:
        raise ValueError(f"kind must be one of this batch's kinds {meta.batch.kinds}, got {kind!r}")
    if head_dim not in (512, 576):
        raise ValueError(f"head_dim must be 512 (V4) or 576 (V3.2), got {head_dim!r}")
    batch = meta.batch
    window, ratio = _workspace_geometry(meta, kind)
    budget = budget_bytes // (2 * head_dim)
    chunks: list[list[tuple[int, int, int]]] = []  # per chunk: (request, first position, last position)
    current: list[tuple[int, int, int]] = []
    used = 0
    for r in range(batch.num_decodes, batch.num_reqs):
        seq, qlen = batch.seq_lens_host[r], batch.query_lens_host[r]
        p0 = seq - qlen
        while p0 < seq:
            if _segment_rows(p0, p0, window, ratio) > budget - used:
                if not current:
                    raise ValueError(f"budget_bytes={budget_bytes} ({budget} workspace rows of {head_dim} bf16) cannot "
                                     f"hold the {_segment_rows(p0, p0, window, ratio)} keys of request {r}'s token "
                                     f"at position {p0}")
                chunks.append(current)
                current, used = [], 0
                continue
            lo, hi = p0, seq - 1  # largest p1 whose segment still fits
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if _segment_rows(p0, mid, window, ratio) <= budget - used:
                    lo = mid
                else:
                    hi = mid - 1
            current.append((r, p0, lo))
            used += _segment_rows(p0, lo, window, ratio)
            p0 = lo + 1
            if p0 < seq:
                chunks.append(current)
                current, used = [], 0
    if current:
        chunks.append(current)
    return [_build_chunk(meta, kind, segs) for segs in chunks]


def _build_chunk(meta: StepMetadata, kind: str, segs: list[tuple[int, int, int]]) -> WorkspaceChunk:
    batch, dev = meta.batch, meta.batch.device
    window, ratio = _workspace_geometry(meta, kind)
    i32 = dict(dtype=torch.int32, device=dev)
    qsl, seq, qlen = batch.query_start_loc_host, batch.seq_lens_host, batch.query_lens_host
    n_comp = [(p1 + 1) // ratio if ratio else 0 for _, _, p1 in segs]
    swa_start = [max(0, p0 - window + 1) for _, p0, _ in segs]
    n_swa = [p1 - s + 1 if window else 0 for (_, _, p1), s in zip(segs, swa_start)]
    n_tok = [p1 - p0 + 1 for _, p0, p1 in segs]
    total_c = sum(n_comp)
    comp_base = [sum(n_comp[:i]) for i in range(len(segs))]
    swa_base = [total_c + sum(n_swa[:i]) for i in range(len(segs))]
    reqs = [r for r, _, _ in segs]
    first_row = qsl[segs[0][0]] + segs[0][1] - (seq[segs[0][0]] - qlen[segs[0][0]])
    last = segs[-1]
    last_row = qsl[last[0]] + last[2] - (seq[last[0]] - qlen[last[0]])

    def per_item(values: list[int], counts: list[int]) -> torch.Tensor:
        return torch.repeat_interleave(torch.tensor(values, **i32), torch.tensor(counts, dtype=torch.long, device=dev),
                                       output_size=sum(counts))

    def ramp(counts: list[int]) -> torch.Tensor:  # 0 … counts[i]-1 for each item, concatenated
        total = sum(counts)
        starts = per_item([sum(counts[:i]) for i in range(len(counts))], counts)
        return torch.arange(total, **i32) - starts

    comp_req = per_item(reqs, n_comp)
    compressed_slots = (slots_of(batch.block_tables[kind], comp_req, ramp(n_comp), batch.block_sizes[kind])
                        if total_c else torch.empty(0, **i32))
    tokens = slice(first_row, last_row + 1)
    pos = batch.positions[tokens]
    if not window:  # dsa: no window part
        chunk = WorkspaceChunk(kind, tokens, total_c, compressed_slots, torch.empty(0, **i32),
                               torch.empty(pos.shape[0], 0, **i32), torch.zeros(pos.shape[0], **i32),
                               per_item(comp_base, n_tok), None, None)
        return chunk
    swa_req = per_item(reqs, n_swa)
    swa_pos = per_item(swa_start, n_swa) + ramp(n_swa)
    swa_slots = slots_of(batch.block_tables["swa"], swa_req, swa_pos, batch.block_sizes["swa"])
    lens = meta.swa_lens[tokens]
    # token at p: window keys at positions p-lens+1 … p -> rows swa_base + (position - swa_start)
    first_key_row = per_item(swa_base, n_tok) + pos - lens + 1 - per_item(swa_start, n_tok)
    j = torch.arange(window, **i32)[None, :]
    swa_rows = torch.where(j < lens[:, None], first_key_row[:, None] + j, -1)
    chunk = WorkspaceChunk(kind, tokens, total_c + sum(n_swa), compressed_slots, swa_slots, swa_rows, lens,
                           per_item(comp_base, n_tok), None, None)
    if kind in PICKS_KINDS:  # the lists depend on each layer's picks: workspace_indices
        return chunk
    idx, lens = workspace_indices(meta, chunk)
    return WorkspaceChunk(kind, tokens, chunk.num_rows, compressed_slots, swa_slots, swa_rows, chunk.swa_lens,
                          chunk.comp_base, idx, lens)


def workspace_indices(meta: StepMetadata, chunk: WorkspaceChunk,
                      kept_local: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each chunk token's workspace rows: ``[its window][its visible compressed entries]``, compacted.

    kept_local: c4a / dsa only, ``(T, topk)`` the kept picks of every batch token (the third result of
    :func:`convert_picks`: each row a valid prefix, which a dsa chunk's rows keep as they are). Returns (indices
    ``(n, width)`` int32, lens ``(n,)`` int32).
    """
    if chunk.kind == "swa":
        return chunk.swa_rows, chunk.swa_lens
    base = chunk.comp_base[:, None]
    if chunk.kind == "c128a":
        n = _visible_entries(meta.batch, COMPRESS_RATIO["c128a"])[chunk.tokens]
        e = torch.arange(meta.c128a_indices.shape[1], dtype=torch.int32, device=base.device)[None, :]
        comp = torch.where(e < n[:, None], base + e, -1)
    else:
        if kept_local is None:
            raise ValueError(f"a {chunk.kind} workspace chunk needs the layer's kept picks (kept_local)")
        local = kept_local[chunk.tokens]
        comp = torch.where(local >= 0, base + local, -1)
    if not chunk.swa_rows.shape[1]:
        # no window part (dsa): the kept picks are a valid prefix already, so the rows are too; compacting them
        # anyway cost a 4096-token V3.2 chunk ~0.47 ms on the H100, 10 % of the whole prefill
        return comp, (comp >= 0).sum(1, dtype=torch.int32)
    return compact_rows(torch.cat([chunk.swa_rows, comp], dim=1))
