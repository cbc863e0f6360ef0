"""The prefill workspace (DESIGN §5): prefill tokens whose keys are gathered into one bf16 workspace first, then
attended by the dense-row prefill kernel (FlashMLA's prefill path; ``prefill_mode="workspace"``).

* Its budget: one bf16 buffer per ``(device, head_dim)``, shared by every layer (:func:`shared_workspace`).
* Its plan: the step's prefill tokens in chunks whose keys fit the budget (:func:`plan_prefill_workspace`; per
  step, kind and budget once: :func:`workspace_plan`).
* Its indices: each chunk token's key list in workspace rows (:func:`workspace_indices`), and the gather of a
  chunk's keys into the workspace (:func:`fill_workspace`).

Planning reads the step metadata (:mod:`sparse_mla.metadata`); the layer plans (:mod:`sparse_mla.plan`) run it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ._checks import is_int
from .batch import slots_of
from .config import COMPRESS_RATIO, PICKS_KINDS
from .metadata import StepMetadata, visible_entries
from .picks import compact_rows
from .ops import dequantize_and_gather

DEFAULT_WORKSPACE_BYTES = 64 << 20
# One bf16 workspace per (device, head_dim), shared by every layer: layers of a step run one after
# another on one stream, so a model needs a single workspace, not one per layer.
_WORKSPACES: dict[tuple[torch.device, int], torch.Tensor] = {}


def shared_workspace(device: torch.device, budget_bytes: int, head_dim: int) -> torch.Tensor:
    """The ``(budget_bytes // (2 · head_dim), head_dim)`` bf16 view of the workspace shared by all layers on
    ``device`` (grown on demand)."""
    rows = budget_bytes // (2 * head_dim)
    key = (torch.device(device), head_dim)
    buf = _WORKSPACES.get(key)
    if buf is None or buf.shape[0] < rows:
        buf = _WORKSPACES[key] = torch.empty(rows, head_dim, dtype=torch.bfloat16, device=device)
    return buf[:rows]



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


def workspace_plan(meta: StepMetadata, kind: str, budget_bytes: int, head_dim: int = 512) -> list[WorkspaceChunk]:
    """The prefill workspace plan of ``meta``'s step for layers of ``kind`` (:func:`plan_prefill_workspace`), made on
    first use and kept with the step's plans, so every layer of the step that asks for the same budget shares it.
    Stale metadata (its batch's builder has built another step since) is a ``ValueError``."""
    return meta.plan(("workspace", kind, budget_bytes, head_dim),
                     lambda: plan_prefill_workspace(meta, kind, budget_bytes, head_dim))


def plan_prefill_workspace(meta: StepMetadata, kind: str, budget_bytes: int,
                           head_dim: int = 512) -> list[WorkspaceChunk]:
    """Chunk the step's prefill tokens so each chunk's bf16 workspace fits ``budget_bytes``.

    A request's segment needs ``gather_len = n_tokens + min(prefix, W-1)`` SWA rows (prefix = the
    positions before the segment) plus, for c4a / c128a, the ``(p_last+1) // ratio`` compressed entries
    its last token can see. Chunks are filled greedily in token order; a request that does not fit
    is split between chunks. Planning runs on the host from the batch's host copies (no device sync);
    only the per-chunk index tensors are built on the device, vectorised. Stale metadata is a ``ValueError``.
    """
    if not isinstance(meta, StepMetadata):
        raise TypeError(f"meta must be the step's StepMetadata, got {type(meta).__name__}")
    if not is_int(budget_bytes):
        raise TypeError(f"budget_bytes must be an int, got {budget_bytes!r}")
    if budget_bytes < 0:  # (0 plans a step without prefill tokens; one with them fails as too small)
        raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
    meta.check_current()
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
    :func:`~sparse_mla.picks.convert_picks`: each row a valid prefix, which a dsa chunk's rows keep as they
    are). Returns (indices ``(n, width)`` int32, lens ``(n,)`` int32). Stale metadata is a ``ValueError``.
    """
    meta.check_current()
    if chunk.kind == "swa":
        return chunk.swa_rows, chunk.swa_lens
    base = chunk.comp_base[:, None]
    if chunk.kind == "c128a":
        n = visible_entries(meta.batch, COMPRESS_RATIO["c128a"])[chunk.tokens]
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


def fill_workspace(ws_all: torch.Tensor, chunk: WorkspaceChunk, caches: dict[str, torch.Tensor],
                   backend: str = "auto", kv_scale: torch.Tensor | None = None,
                   fmts: dict[str, str | None] | None = None) -> torch.Tensor:
    """A prefill chunk's keys dequantised into the first ``chunk.num_rows`` rows of the bf16 workspace ``ws_all``
    (``(rows, d)``): its compressed entries, then its window's raw tokens (the layout of :class:`WorkspaceChunk`),
    from ``caches`` by kind (``fmts``: a cache's format where its tensor does not name it, V4.1's page-planar
    layouts). Returns that ``(num_rows, d)`` view."""
    fmts = fmts or {}
    ws = ws_all[: chunk.num_rows]
    n_c = chunk.compressed_slots.shape[0]
    if n_c:
        dequantize_and_gather(caches[chunk.kind], chunk.compressed_slots, fmts.get(chunk.kind), backend=backend,
                              kv_scale=kv_scale, out=ws[:n_c])
    if chunk.swa_slots.shape[0]:
        dequantize_and_gather(caches["swa"], chunk.swa_slots, fmts.get("swa"), backend=backend, kv_scale=kv_scale,
                              out=ws[n_c:])
    return ws
