"""Other index forms of a step's key lists (DESIGN §3), built from the step metadata's padded lists.

The attention ops read three forms of the same key lists (:func:`sparse_mla.ops.sparse_attention_decode`):

* **padded** (the metadata's own, FlashMLA's): per scope ``indices (T, width)`` + ``lens (T,)``, valid prefix.
* **ragged** (vLLM's ROCm AITER DeepSeek-V4 backend): per scope ``indptr (T+1,)`` int32 + flat slots
  ``(capacity,)`` int32, row ``t`` = ``flat[indptr[t]:indptr[t+1]]``; ops: ``indptr=`` / ``extra_indptr=``
  (prefill: ``indptr=``, e.g. over a workspace chunk's combined rows).
* **combined** (vLLM's FlashInfer TRTLLM-gen DeepSeek-V4 backend): one row per token over both caches,
  ``(T, W + K)`` int32: columns ``[0, W)`` the token's SWA slots (its window, ``-1`` after ``swa_lens[t]``),
  columns ``[W, W + K)`` its compressed slots (valid prefix), and one length per token: ``W + n`` when it has
  ``n > 0`` compressed entries, else its SWA length; ops: ``combined_window=W``.

Every builder writes into caller-owned, fixed-capacity buffers (allocate them once, refill them each step) with
no host sync, so a CUDA graph that reads them stays valid. On a CUDA device the Triton twins run (one launch
each); elsewhere the torch versions, which compute the same values.
"""
from __future__ import annotations

import torch

from ._checks import check_no_overlap, check_tensor, is_int
from .metadata import StepMetadata
from .ops.triton import index as triton_index
from .ops.validate import debug_checks_enabled
from .picks import PicksConversion, check_picks_kind, compressed_picks_torch, step_picks


def _on_triton(t: torch.Tensor) -> bool:
    return t.device.type == "cuda"


def _check_padded(indices: torch.Tensor, lens: torch.Tensor, prefix: str = "") -> tuple[int, int]:
    check_tensor(f"{prefix}indices", indices, dtype=torch.int32, ndim=2)
    check_tensor(f"{prefix}lens", lens, dtype=torch.int32, shape=(indices.shape[0],), device=indices.device)
    return indices.shape


# ----------------------------------------------------------------------------------------------------------------
# ragged

def ragged_from_padded(indices: torch.Tensor, lens: torch.Tensor, out_indptr: torch.Tensor,
                       out_flat: torch.Tensor) -> None:
    """The ragged form of a padded scope, written into ``out_indptr`` / ``out_flat``.

    indices: ``(T, width)`` int32, lens: ``(T,)`` int32 (clamped into ``[0, width]``), e.g. a step's
    ``swa_indices`` / ``swa_lens``, ``c128a_indices`` / ``c128a_lens``, a layer's converted c4a picks, or a
    prefill workspace chunk's ``indices`` / ``lens``. out_indptr: ``(T+1,)`` int32 receives ``[0, cumsum(lens)]``;
    out_flat: ``(capacity,)`` int32 receives each row's first ``lens[t]`` entries (``-1`` entries kept: the ops
    skip them) and ``-1`` after the last row. ``capacity`` must hold the sum of the lens (size it by the step's
    largest: ``T · width`` always does); entries past it are dropped, never written outside the buffer.
    """
    num_tokens, width = _check_padded(indices, lens)
    if num_tokens * width >= 2**31:  # the lens' sum, at most this, must fit the int32 indptr (else it wraps)
        raise ValueError(f"indices must hold fewer than 2^31 entries (out_indptr is int32), got shape "
                         f"{tuple(indices.shape)}")
    check_tensor("out_indptr", out_indptr, dtype=torch.int32, shape=(num_tokens + 1,), device=indices.device)
    check_tensor("out_flat", out_flat, dtype=torch.int32, ndim=1, device=indices.device)
    if out_flat.stride(0) != 1 or out_indptr.stride(0) != 1:
        raise ValueError("out_flat and out_indptr must be contiguous")
    # the kernel's programs write the outputs while others still read the inputs
    check_no_overlap("out_flat", out_flat, {"indices": indices, "lens": lens, "out_indptr": out_indptr})
    check_no_overlap("out_indptr", out_indptr, {"indices": indices, "lens": lens})
    if num_tokens == 0:
        out_indptr.zero_()
        out_flat.fill_(-1)
        return
    if indices.stride(1) != 1:
        indices = indices.contiguous()
    _ragged_fill(indices, lens.contiguous(), out_indptr, out_flat)


def _ragged_fill(indices: torch.Tensor, lens: torch.Tensor, out_indptr: torch.Tensor, out_flat: torch.Tensor) -> None:
    """:func:`ragged_from_padded` on checked arguments (at least one row; unit-stride rows, contiguous lens)."""
    (triton_index.ragged_from_padded if _on_triton(indices) else _ragged_torch)(indices, lens, out_indptr, out_flat)


def _ragged_torch(indices: torch.Tensor, lens: torch.Tensor, out_indptr: torch.Tensor, out_flat: torch.Tensor) -> None:
    """Torch twin of :func:`sparse_mla.ops.triton.index.ragged_from_padded` (same arguments): a cumulative sum and
    one scatter."""
    width, capacity = indices.shape[1], out_flat.shape[0]
    n = lens.clamp(0, width)
    out_indptr[0] = 0
    torch.cumsum(n, 0, dtype=torch.int32, out=out_indptr[1:])
    j = torch.arange(width, device=indices.device)[None, :]
    keep = j < n[:, None]
    dest = torch.where(keep, out_indptr[:-1, None].long() + j, capacity).clamp_max(capacity)
    staged = torch.full((capacity + 1,), -1, dtype=torch.int32, device=indices.device)  # slot `capacity`: discards
    staged.scatter_(0, dest.reshape(-1), torch.where(keep, indices, -1).reshape(-1))
    out_flat.copy_(staged[:capacity])


# ----------------------------------------------------------------------------------------------------------------
# combined (one row per token over both caches)

def _check_combined(swa_indices: torch.Tensor, swa_lens: torch.Tensor, comp_width: int, out_indices: torch.Tensor,
                    out_lens: torch.Tensor) -> int:
    num_tokens, window = _check_padded(swa_indices, swa_lens, "swa_")
    check_tensor("out_indices", out_indices, dtype=torch.int32, shape=(num_tokens, None), device=swa_indices.device)
    check_tensor("out_lens", out_lens, dtype=torch.int32, shape=(num_tokens,), device=swa_indices.device)
    if out_indices.shape[1] < window + comp_width:
        raise ValueError(f"out_indices must have at least {window} + {comp_width} columns (the SWA window, then the "
                         f"compressed list), got {out_indices.shape[1]}")
    return window


def _fill_window_columns(swa_indices: torch.Tensor, swa_lens: torch.Tensor, out_indices: torch.Tensor,
                         comp_width: int) -> None:
    """Columns ``[0, W)`` = each token's SWA slots (``-1`` past its length), columns past ``W + comp_width`` = -1."""
    window = swa_indices.shape[1]
    j = torch.arange(window, device=swa_indices.device)[None, :]
    out_indices[:, :window].copy_(torch.where(j < swa_lens[:, None], swa_indices, -1))
    out_indices[:, window + comp_width:] = -1


def _combined_lens(swa_lens: torch.Tensor, window: int, out_lens: torch.Tensor) -> None:
    """``out_lens`` holds each token's compressed count ``n``: make it ``W + n`` (``n > 0``), else the SWA length."""
    torch.where(out_lens > 0, out_lens + window, swa_lens.clamp(0, window), out=out_lens)


def combined_from_padded(swa_indices: torch.Tensor, swa_lens: torch.Tensor, comp_indices: torch.Tensor,
                         comp_lens: torch.Tensor, out_indices: torch.Tensor, out_lens: torch.Tensor) -> None:
    """The combined index of a step's SWA list and a compressed list (c128a, or a layer's converted c4a picks).

    swa_indices ``(T, W)`` + swa_lens, comp_indices ``(T, K)`` + comp_lens: the metadata's padded lists (valid
    prefixes). Writes out_indices ``(T, >= W + K)`` int32 (``[SWA row, -1 padded to W][compressed row, -1 padded]``)
    and out_lens ``(T,)`` int32 (``W + n``, or the SWA length when ``n = 0``). Read it with
    ``sparse_attention_decode(q, swa_cache, out_indices, out_lens, extra_cache=comp_cache, combined_window=W)``.
    """
    num_tokens, comp_width = _check_padded(comp_indices, comp_lens, "comp_")
    window = _check_combined(swa_indices, swa_lens, comp_width, out_indices, out_lens)
    if comp_indices.shape[0] != swa_indices.shape[0]:
        raise ValueError(f"comp_indices has {comp_indices.shape[0]} rows, swa_indices {swa_indices.shape[0]}")
    _fill_window_columns(swa_indices, swa_lens, out_indices, comp_width)
    k = torch.arange(comp_width, device=comp_indices.device)[None, :]
    n = comp_lens.clamp(0, comp_width)
    out_indices[:, window:window + comp_width].copy_(torch.where(k < n[:, None], comp_indices, -1))
    out_lens.copy_(n)
    _combined_lens(swa_lens, window, out_lens)


def combined_from_picks(positions: torch.Tensor, token_to_req: torch.Tensor, block_table: torch.Tensor,
                        block_size: int, ratio: int, topk_local: torch.Tensor, swa_indices: torch.Tensor,
                        swa_lens: torch.Tensor, out_indices: torch.Tensor, out_lens: torch.Tensor,
                        out_kept: torch.Tensor) -> None:
    """The combined index of a C4A layer straight from its indexer's local picks (FlashInfer TRTLLM-gen's decode
    form): the picks are converted to compressed-cache slots inside the builder, into columns ``[W, W + topk)``.

    positions / token_to_req: the batch's ``(T,)`` int32; block_table / block_size: the compressed kind's (e.g.
    ``batch.block_tables["c4a"]``, ``batch.block_sizes["c4a"]``); ratio: its compress ratio (4). topk_local
    ``(T, topk)`` int32 local entry numbers (``-1`` none): a pick is kept only if complete before the token
    (``(w+1)·ratio <= pos+1``), in order, as :meth:`StepMetadata.c4a_indices` does. swa_indices ``(T, W)`` +
    swa_lens: the step's SWA list. out_kept ``(T, topk)`` int32 receives the kept local picks (the metadata's
    ``picks_local`` serves). Writes out_indices ``(T, >= W + topk)`` and out_lens as
    :func:`combined_from_padded`.
    """
    check_tensor("topk_local", topk_local, dtype=torch.int32, ndim=2, device=swa_indices.device)
    num_tokens, topk = topk_local.shape
    for name, t in (("positions", positions), ("token_to_req", token_to_req)):
        check_tensor(name, t, dtype=torch.int32, shape=(num_tokens,), device=swa_indices.device)
    _check_combined(swa_indices, swa_lens, topk, out_indices, out_lens)
    check_tensor("out_kept", out_kept, dtype=torch.int32, shape=(num_tokens, topk), device=swa_indices.device)
    # the kernel reads a request's row at unit column stride, its request and block column clamped into the table
    check_tensor("block_table", block_table, dtype=torch.int32, ndim=2, device=swa_indices.device)
    if 0 in block_table.shape or block_table.stride(1) != 1:
        raise ValueError(f"block_table must have a row and a column, at unit column stride, got shape "
                         f"{tuple(block_table.shape)} strides {block_table.stride()}")
    if not (is_int(block_size) and 0 < block_size < 2**31 and is_int(ratio) and 0 < ratio < 2**31):
        # (int32 arithmetic: a larger one would wrap, 2^32 + 64 acting as 64)
        raise ValueError(f"block_size and ratio must be positive ints below 2^31, got {block_size!r}, {ratio!r}")
    if not _on_triton(topk_local) or debug_checks_enabled():  # values: a sync (docs/checks.md)
        # the slots and visibility are int32 arithmetic: a block past 2^31 // block_size would wrap to a real slot
        largest = int(block_table.max())
        if largest > 2**31 // block_size - 1:
            raise ValueError(f"block_table holds block {largest}, whose slots (block * {block_size} + offset) pass "
                             f"int32")
        if num_tokens and int(positions.max()) >= 2**31 - 1:
            raise ValueError(f"positions must be below 2^31 - 1 (a token's entries count position + 1 in int32), got "
                             f"{int(positions.max())}")
    _combined_picks(positions, token_to_req, block_table, block_size, ratio, topk_local, swa_indices, swa_lens,
                    out_indices, out_lens, out_kept)


def _combined_picks(positions, token_to_req, block_table, block_size, ratio, topk_local, swa_indices, swa_lens,
                    out_indices, out_lens, out_kept) -> None:
    """:func:`combined_from_picks` on checked arguments."""
    window, topk = swa_indices.shape[1], topk_local.shape[1]
    _fill_window_columns(swa_indices, swa_lens, out_indices, topk)
    comp = out_indices[:, window:window + topk]
    build = triton_index.compressed_picks if _on_triton(topk_local) else compressed_picks_torch
    build(positions, token_to_req, block_table, block_size, ratio, topk_local, comp, out_lens, out_kept)
    _combined_lens(swa_lens, window, out_lens)


# ----------------------------------------------------------------------------------------------------------------
# a step's lists in a layer's form (sparse_mla.plan.LayerPlan)

INDEX_FORMS = ("padded", "ragged", "combined")


def check_index_form(index_form: object) -> str:
    """``index_form`` is one of :data:`INDEX_FORMS` (else ``ValueError``)."""
    if index_form not in INDEX_FORMS:
        raise ValueError(f"index_form must be one of {INDEX_FORMS}, got {index_form!r}")
    return index_form


def step_ragged(meta: StepMetadata, kind: str, indices: torch.Tensor, lens: torch.Tensor,
                fill: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The ragged form ``(flat (T·width,), indptr (T+1,))`` of one of the step's padded lists (``kind``'s),
    in buffers kept with the step's plans, so every layer of the step shares them and a CUDA graph captured
    with them stays valid. fill: convert now (a list fixed for the step); the picks kinds' lists change per
    layer call and are converted by :func:`picks_conversion`'s object."""
    def make() -> tuple[torch.Tensor, torch.Tensor]:
        num_tokens, width = indices.shape
        flat = torch.full((num_tokens * width,), -1, dtype=torch.int32, device=indices.device)
        indptr = torch.zeros(num_tokens + 1, dtype=torch.int32, device=indices.device)
        if fill and num_tokens:
            _ragged_fill(indices if indices.stride(1) == 1 else indices.contiguous(), lens.contiguous(), indptr,
                         flat)
        return flat, indptr

    return meta.plan(("index_form", "ragged", kind), make)


def step_combined(meta: StepMetadata, kind: str, comp_indices: torch.Tensor, comp_lens: torch.Tensor,
                  fill: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The combined form ``(indices (T, W + K), lens (T,))`` of the step's SWA list and ``kind``'s compressed
    list (``comp_indices (T, K)`` + ``comp_lens``), in buffers kept with the step's plans (see
    :func:`step_ragged`); fill: build now (c128a), else per layer call by :func:`picks_conversion`'s object (c4a)."""
    def make() -> tuple[torch.Tensor, torch.Tensor]:
        num_tokens, window = meta.swa_indices.shape
        out = torch.full((num_tokens, window + comp_indices.shape[1]), -1, dtype=torch.int32,
                         device=comp_indices.device)
        out_lens = torch.zeros(num_tokens, dtype=torch.int32, device=comp_indices.device)
        if fill:
            combined_from_padded(meta.swa_indices, meta.swa_lens, comp_indices, comp_lens, out, out_lens)
        else:  # the window columns are the step's; the picks columns and the lens come per call
            _fill_window_columns(meta.swa_indices, meta.swa_lens, out, comp_indices.shape[1])
        return out, out_lens

    return meta.plan(("index_form", "combined", kind), make)


class RaggedPicks:
    """A picks layer's conversion in the ragged form: the step's :class:`~sparse_mla.picks.PicksConversion`
    (``padded``), then the ragged form of the lists it wrote. indices ``(T·topk,)`` / lens ``(T+1,)``: the flat
    list and its indptr (:func:`step_ragged`'s buffers of the picks kind); kept: ``padded.kept``."""

    def __init__(self, padded: PicksConversion, flat: torch.Tensor, indptr: torch.Tensor) -> None:
        self.padded, self.indices, self.lens, self.kept = padded, flat, indptr, padded.kept

    def __call__(self, local: torch.Tensor) -> torch.Tensor | None:
        self.padded(local)
        if local.shape[0]:
            _ragged_fill(self.padded.indices, self.padded.lens, self.lens, self.indices)
        return self.kept


class CombinedPicks:
    """A picks layer's conversion in the combined form: one launch converts the picks into the combined rows'
    compressed columns (``columns``, a :class:`~sparse_mla.picks.PicksConversion`), then each row's length adds the
    window's. indices ``(T, W + topk)`` / lens ``(T,)``: the combined rows (:func:`step_combined`'s buffers, their
    window columns the step's); kept: the step's kept picks."""

    def __init__(self, meta: StepMetadata, kind: str, rows: torch.Tensor, rows_lens: torch.Tensor) -> None:
        window, topk = meta.swa_indices.shape[1], meta.spec.topk
        self.columns = meta.plan(("picks", kind, "combined"), lambda: PicksConversion(
            meta, kind, rows[:, window:window + topk], rows_lens, meta.picks_local))
        self.indices, self.lens, self.kept = rows, rows_lens, self.columns.kept
        self.swa_lens, self.window = meta.swa_lens, window

    def __call__(self, local: torch.Tensor) -> torch.Tensor:
        self.columns(local)
        _combined_lens(self.swa_lens, self.window, self.lens)
        return self.kept


def picks_conversion(meta: StepMetadata, kind: str, index_form: str,
                     lists: tuple[torch.Tensor, torch.Tensor] | None) -> PicksConversion | RaggedPicks | CombinedPicks:
    """How a picks layer's calls convert their picks in this step (made once per step plan): called with a call's
    picks, it writes the step's picks buffers and, for the ragged and combined forms, that form's ``lists``
    (:func:`step_ragged` / :func:`step_combined`'s buffers of the picks kind: ``(flat, indptr)`` /
    ``(rows, lens)``), and returns the kept picks (``meta.picks_local``, for the workspace prefill). No host sync.
    Its ``indices`` / ``lens`` / ``kept`` name the buffers it writes."""
    check_picks_kind(meta, kind)
    if index_form == "ragged":
        return RaggedPicks(step_picks(meta, kind), *lists)
    if index_form == "combined":
        return CombinedPicks(meta, kind, *lists)
    return step_picks(meta, kind)


__all__ = ["ragged_from_padded", "combined_from_padded", "combined_from_picks", "INDEX_FORMS", "check_index_form",
           "step_ragged", "step_combined", "picks_conversion"]
