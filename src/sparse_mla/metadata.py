"""Step metadata (DESIGN §3): per-token index lists into the paged caches, built once per step.

Every list is a *valid prefix*: valid slots first, ``-1`` after, ``lens`` = their count. Built with
vectorised torch on the batch's device, into tensors that a caller may pass back (``out=``) to
reuse across steps.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ._checks import check_tensor
from .batch import StepBatch, slots_of
from .config import COMPRESS_RATIO


@dataclass(frozen=True)
class MetadataSpec:
    """What the step's layers need: SWA window, C4A indexer width (top-k)."""

    window: int = 128
    topk: int = 512


@dataclass
class StepMetadata:
    """Index lists of one step, shared by all layers. Row ``t`` belongs to token ``t`` of the batch.

    swa_indices: ``(T, window)`` slots of positions ``max(0, pos-W+1) … pos``; swa_lens ``(T,)``.
    c128a_indices: ``(T, ceil(max_model_len / 128))`` slots of entries ``0 … (pos+1)//128 - 1``.
    c4a buffers are filled per layer by :meth:`c4a_indices` from the indexer's picks.
    """

    batch: StepBatch
    spec: MetadataSpec
    is_valid_token: torch.Tensor
    swa_indices: torch.Tensor
    swa_lens: torch.Tensor
    c128a_indices: torch.Tensor | None
    c128a_lens: torch.Tensor | None
    c4a_buffer: torch.Tensor | None
    c4a_lens_buffer: torch.Tensor | None

    def c4a_indices(self, topk_local: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Global C4A slots from the indexer's local picks, compacted to a valid prefix.

        topk_local: ``(T, topk)`` int32 local entry numbers (``-1`` none). A pick ``w`` is kept only if
        entry ``w`` is complete before the token (``(w+1)·4 <= pos+1``); others are dropped, never attended.
        Returns (indices ``(T, topk)`` int32, lens ``(T,)`` int32), views of this step's buffers.
        """
        return convert_compressed_picks(self, topk_local, "c4a")[:2]


def _visible_entries(batch: StepBatch, ratio: int) -> torch.Tensor:
    """Compressed entries complete before each token: ``(pos + 1) // ratio`` (0 for padding)."""
    return torch.where(batch.positions >= 0, (batch.positions + 1) // ratio, 0)


def convert_compressed_picks(meta: StepMetadata, local: torch.Tensor, kind: str
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Local picks -> (global slots, lens, the kept local numbers), each row a valid prefix."""
    batch = meta.batch
    check_tensor("topk_indices", local, dtype=torch.int32, shape=(batch.token_capacity, meta.spec.topk),
                 device=batch.device)
    ratio = COMPRESS_RATIO[kind]
    visible = _visible_entries(batch, ratio)[:, None]
    keep = (local >= 0) & (local < visible)
    order = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)
    kept_local = torch.where(keep, local, -1).gather(1, order)
    req = batch.token_to_req.clamp_min(0)[:, None]
    meta.c4a_buffer.copy_(slots_of(batch.block_tables[kind], req, kept_local, batch.block_sizes[kind]))
    torch.sum(keep, dim=1, dtype=torch.int32, out=meta.c4a_lens_buffer)
    return meta.c4a_buffer, meta.c4a_lens_buffer, kept_local


def build_step_metadata(batch: StepBatch, spec: MetadataSpec = MetadataSpec(),
                        out: StepMetadata | None = None) -> StepMetadata:
    """Build the step's metadata; with ``out`` (last step's metadata), refill its tensors in place."""
    if spec.window < 1 or spec.topk < 1:
        raise ValueError(f"spec.window and spec.topk must be positive, got {spec}")
    dev, cap = batch.device, batch.token_capacity
    pos = batch.positions
    valid = pos >= 0
    req = batch.token_to_req.clamp_min(0)
    if out is None or out.swa_indices.shape != (cap, spec.window) or out.swa_indices.device != dev:
        i32 = dict(dtype=torch.int32, device=dev)
        has_c4a, has_c128a = "c4a" in batch.block_tables, "c128a" in batch.block_tables
        n128 = math.ceil(batch.max_model_len / 128)
        out = StepMetadata(
            batch, spec, torch.empty(cap, **i32), torch.empty(cap, spec.window, **i32), torch.empty(cap, **i32),
            torch.empty(cap, n128, **i32) if has_c128a else None, torch.empty(cap, **i32) if has_c128a else None,
            torch.empty(cap, spec.topk, **i32) if has_c4a else None, torch.empty(cap, **i32) if has_c4a else None)
    out.batch, out.spec = batch, spec
    out.is_valid_token.copy_(valid)
    start = (pos - spec.window + 1).clamp_min(0)
    count = torch.where(valid, pos - start + 1, 0)
    j = torch.arange(spec.window, device=dev, dtype=torch.int32)[None, :]
    swa_pos = torch.where(j < count[:, None], start[:, None] + j, -1)
    out.swa_indices.copy_(slots_of(batch.block_tables["swa"], req[:, None], swa_pos, batch.block_sizes["swa"]))
    out.swa_lens.copy_(count)
    if out.c128a_indices is not None:
        n = _visible_entries(batch, 128)
        e = torch.arange(out.c128a_indices.shape[1], device=dev, dtype=torch.int32)[None, :]
        entries = torch.where(e < n[:, None], e, -1)
        out.c128a_indices.copy_(slots_of(batch.block_tables["c128a"], req[:, None], entries,
                                         batch.block_sizes["c128a"]))
        out.c128a_lens.copy_(n)
    return out


@dataclass(frozen=True)
class WorkspaceChunk:
    """One chunk of prefill tokens whose keys are gathered into a bf16 workspace.

    tokens: the chunk's token rows. swa_slots / compressed_slots: cache slots copied into workspace
    rows (each request's rows: ``[its compressed entries][its SWA tokens]``, compressed part first).
    indices / lens: ``(n_tokens, width)`` int32 workspace rows per token, a valid prefix.
    """

    tokens: slice
    compressed_slots: torch.Tensor
    swa_slots: torch.Tensor
    row_is_swa: torch.Tensor
    indices: torch.Tensor
    lens: torch.Tensor


def plan_prefill_workspace(meta: StepMetadata, kind: str, budget_rows: int,
                           compressed_local: torch.Tensor | None = None) -> list[WorkspaceChunk]:
    """Chunk the prefill requests so each chunk's workspace holds at most ``budget_rows`` rows.

    Per request: ``gather_len = query_len + min(prefix_len, W-1)`` SWA tokens and ``seq_len // ratio``
    compressed entries. ``compressed_local``: for C4A, the kept local picks of every token
    (from :func:`convert_compressed_picks`); C128A sees every complete entry.
    """
    batch, spec = meta.batch, meta.spec
    seq = batch.seq_lens.tolist()
    qlen = batch.query_lens.tolist()
    qsl = batch.query_start_loc.tolist()
    ratio = COMPRESS_RATIO[kind]
    chunks, r = [], batch.num_decodes
    while r < batch.num_reqs:
        rows, first = 0, r
        while r < batch.num_reqs:
            prefix = seq[r] - qlen[r]
            need = qlen[r] + min(prefix, spec.window - 1) + (seq[r] // ratio if ratio > 1 else 0)
            if rows and rows + need > budget_rows:
                break
            if need > budget_rows:
                raise ValueError(f"budget_rows={budget_rows} cannot hold request {r}'s {need} workspace rows")
            rows += need
            r += 1
        chunks.append(_chunk(meta, kind, range(first, r), seq, qlen, qsl, compressed_local))
    return chunks


def _chunk(meta, kind, reqs, seq, qlen, qsl, compressed_local) -> WorkspaceChunk:
    batch, spec, dev = meta.batch, meta.spec, meta.batch.device
    ratio = COMPRESS_RATIO[kind]
    comp_slots, swa_slots, is_swa, idx_rows, len_rows = [], [], [], [], []
    base = 0
    i32 = dict(dtype=torch.int32, device=dev)
    for r in reqs:
        n_comp = seq[r] // ratio if ratio > 1 else 0
        swa_start = max(0, seq[r] - qlen[r] - (spec.window - 1))
        n_swa = seq[r] - swa_start
        table_c = batch.block_tables[kind][r] if ratio > 1 else None
        if n_comp:
            comp_slots.append(slots_of(table_c[None], torch.zeros((), **i32),
                                       torch.arange(n_comp, **i32), batch.block_sizes[kind]))
        swa_slots.append(slots_of(batch.block_tables["swa"][r][None], torch.zeros((), **i32),
                                  torch.arange(swa_start, seq[r], **i32), batch.block_sizes["swa"]))
        is_swa.append(torch.cat([torch.zeros(n_comp, dtype=torch.bool, device=dev),
                                 torch.ones(n_swa, dtype=torch.bool, device=dev)]))
        toks = slice(qsl[r], qsl[r + 1])
        swa_rows = torch.where(meta.swa_indices[toks] >= 0,
                               base + n_comp + (meta.batch.positions[toks, None] - meta.swa_lens[toks, None] + 1
                                                - swa_start + torch.arange(spec.window, **i32)[None]), -1)
        if ratio == 1:
            comp = torch.empty(toks.stop - toks.start, 0, **i32)
        elif ratio == 128:
            comp = torch.where(meta.c128a_indices[toks] >= 0,
                               base + torch.arange(meta.c128a_indices.shape[1], **i32)[None], -1)
        else:
            comp = torch.where(compressed_local[toks] >= 0, base + compressed_local[toks], -1)
        rows = torch.cat([swa_rows, comp], dim=1)
        order = torch.argsort((rows < 0).to(torch.int8), dim=1, stable=True)
        idx_rows.append(rows.gather(1, order))
        len_rows.append((rows >= 0).sum(1, dtype=torch.int32))
        base += n_comp + n_swa
    empty = torch.empty(0, **i32)
    return WorkspaceChunk(slice(qsl[reqs[0]], qsl[reqs[-1] + 1]), torch.cat(comp_slots) if comp_slots else empty,
                          torch.cat(swa_slots), torch.cat(is_swa), torch.cat(idx_rows), torch.cat(len_rows))
