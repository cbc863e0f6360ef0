"""The lightning indexer, plain PyTorch (any device): query preparation, scores over the paged key cache, top-k.

Formulas (DESIGN §6). Token ``t`` at position ``p`` of request ``r`` with prepared queries ``q_t (H, 128)`` and head
weights ``ω̃_t (H,)`` scores the entries it may see,

    ``I[t, w] = Σ_h ω̃_t[h] · ReLU(q_t[h] · k_w)``,   entry ``w`` visible iff ``(w + 1) · r ≤ p + 1``

(ratio ``r`` of the layer's kind; V3.2's ``dsa`` entries are raw positions, ``r = 1``: ``w ≤ p``), and keeps the top
``min(topk, n)`` of its ``n = ⌊(p + 1) / r⌋`` visible entries, the row padded with ``-1``. Ties go to the lowest entry
(the picks are a deterministic function of the scores); a row lists its picks best first. The picks are the
``(T, topk)`` int32 tensor :meth:`StepMetadata.picks_for` takes: request-local entries (c4a / c2a / c1a) or raw
positions (dsa).

Query preparation (:func:`prepare_queries`): rope on each head at the token's position (V4 / V4.1: the last 64
dims, interleaved pairs, the compress rope; V3.2: the first 64 dims, half-split), then either bf16 queries or fp8
ones — per (token, head) a power-of-two scale ``s_q`` by the key cache's rule, codes ``e4m3(bf16(q) / s_q)`` — with
``s_q`` folded into the head weights: ``ω̃ = ω · s_q · 128^-0.5 · H^-0.5``.

V4.1's two-level selection (:func:`top_blocks_reference`): from its last kv-source layer on, block score = the max
of the scores of each run of 8 entries, the block holding the token's newest visible entry pinned, the top 2048 blocks
kept; the picks of that layer and of every later index source come from the entries inside the kept blocks only.

Bounded memory: the reference scores ``token_chunk`` tokens of one request against ``entry_chunk`` entries at a time
and merges each chunk into the running top-k, so its workspace is
``token_chunk · (H + 2) · entry_chunk · 4 B`` plus ``token_chunk · entry_chunk · 128 · 4 B`` of dequantised keys
(64 MiB and 128 MiB at the defaults), whatever the context or chunk length.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ._checks import check_positive_int, check_tensor
from .config import COMPRESS_RATIO, PICKS_KINDS
from .indexer_cache import INDEX_HEAD_DIM, IndexerKeyCache, index_key_scales
from .rope import V4_COMPRESS_ROPE, V32_ROPE, RopeSpec, rotate_half_split_head, rotate_interleaved_tail

INDEX_TOPKS = (512, 1024, 2048)  # the top-k widths the models use
Q_FORMATS = ("fp8", "bf16")
BLOCK_ENTRIES = 8  # V4.1's two-level selection: entries per block
KEPT_BLOCKS = 2048  # V4.1's two-level selection: blocks kept
MIN_HEADS, MAX_HEADS = 1, 128
# the Triton select (ops/triton/indexer.py): a row of up to MAX_SELECT_COLS entries in one program's registers;
# longer rows in segments of SELECT_SEGMENT entries, whose top k are the candidates (planning pads rows to segments)
MAX_SELECT_COLS, SELECT_SEGMENT = 16384, 8192
ROPE_DIM = 64  # rotated dims of an indexer query (V4 / V4.1: the last 64, V3.2: the first 64)


def select_kernel_takes(topk: int) -> bool:
    """Whether the Triton select takes a top-``topk`` of rows of any length: its segments keep ``topk`` of every
    :data:`SELECT_SEGMENT` entries, which shortens a row only when ``topk`` is below a segment (else ``torch.topk``)."""
    return topk < SELECT_SEGMENT


@dataclass(frozen=True)
class IndexerSpec:
    """One layer's indexer: ``num_heads`` (H_I), ``topk``, the layer ``kind`` whose picks it makes (``c4a``, ``c2a``,
    ``c1a`` or ``dsa``), the ``rope`` of its queries and the query format ``q_format`` (``"fp8"`` or ``"bf16"``)."""

    num_heads: int
    topk: int
    kind: str = "c4a"
    rope: RopeSpec | None = None  # None: the kind's default (V4's compress rope, V3.2's main rope)
    q_format: str = "fp8"

    def __post_init__(self) -> None:
        check_positive_int("num_heads", self.num_heads)
        if not MIN_HEADS <= self.num_heads <= MAX_HEADS:
            raise ValueError(f"num_heads must be in [{MIN_HEADS}, {MAX_HEADS}], got {self.num_heads}")
        check_positive_int("topk", self.topk)
        if self.kind not in PICKS_KINDS:
            raise ValueError(f"kind must be one of {PICKS_KINDS} (a layer that takes picks), got {self.kind!r}")
        if self.q_format not in Q_FORMATS:
            raise ValueError(f"q_format must be one of {Q_FORMATS}, got {self.q_format!r}")
        if self.rope is not None and not isinstance(self.rope, RopeSpec):
            raise TypeError(f"rope must be a RopeSpec or None, got {type(self.rope).__name__}")
        if self.rope is not None and self.rope.dim != ROPE_DIM:
            raise ValueError(f"rope.dim must be {ROPE_DIM} (the indexers rotate 64 of their 128 dims), "
                             f"got {self.rope.dim}")

    @property
    def ratio(self) -> int:
        return COMPRESS_RATIO[self.kind]

    @property
    def rope_spec(self) -> RopeSpec:
        if self.rope is not None:
            return self.rope
        return V32_ROPE if self.kind == "dsa" else V4_COMPRESS_ROPE

    @property
    def weight_scale(self) -> float:
        """``128^-0.5 · H^-0.5``: the constant folded into the head weights."""
        return INDEX_HEAD_DIM ** -0.5 * self.num_heads ** -0.5


def prepare_queries(q: torch.Tensor, weights: torch.Tensor, positions: torch.Tensor, spec: IndexerSpec
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The indexer's queries and head weights as the scorers take them.

    q: ``(T, H, 128)`` (bf16 / fp16 / float32), the heads before rope; weights: ``(T, H)``, the raw ``ω_t = W_w h_t``;
    positions: ``(T,)`` int32 / int64 (``-1`` padding rows: rotated at 0, their picks are ``-1`` anyway).
    Returns ``q_ready (T, H, 128)`` float32 — the e4m3 values (fp8) or the bf16 values (bf16) — and
    ``w_ready (T, H)`` float32 ``ω · s_q · 128^-0.5 · H^-0.5`` (``s_q = 1`` for bf16).
    """
    check_tensor("q", q, dtype=(torch.bfloat16, torch.float16, torch.float32), ndim=3)
    if q.shape[1:] != (spec.num_heads, INDEX_HEAD_DIM):
        raise ValueError(f"q must have shape (T, {spec.num_heads}, {INDEX_HEAD_DIM}), got {tuple(q.shape)}")
    check_tensor("weights", weights, dtype=(torch.bfloat16, torch.float16, torch.float32),
                 shape=(q.shape[0], spec.num_heads), device=q.device)
    check_tensor("positions", positions, dtype=(torch.int32, torch.int64), shape=(q.shape[0],), device=q.device)
    pos = positions.clamp_min(0)
    rotate = rotate_half_split_head if spec.kind == "dsa" else rotate_interleaved_tail
    roped = rotate(q.float(), pos, spec.rope_spec).to(torch.bfloat16).float()  # as the model's bf16 q
    w = weights.float() * spec.weight_scale
    if spec.q_format == "bf16":
        return roped, w
    flat = roped.reshape(-1, INDEX_HEAD_DIM)
    scales = index_key_scales(flat)  # the key cache's power-of-two rule, per (token, head)
    codes = (flat / scales[:, None]).to(torch.float8_e4m3fn).float()
    return codes.view_as(roped), w * scales.view(w.shape)


@dataclass(frozen=True)
class StepTokens:
    """The token side of one step, as the scorers read it (views of a :class:`StepBatch`'s buffers).

    positions, token_to_req: ``(T_cap,)`` int32 (``-1`` padding); query_start_loc: ``(R + 1,)`` int32;
    block_table: ``(R, max_blocks)`` int32 of the key cache (``-1`` padded); ratio: the kind's compress ratio.
    """

    positions: torch.Tensor
    token_to_req: torch.Tensor
    query_start_loc: torch.Tensor
    block_table: torch.Tensor
    ratio: int

    @classmethod
    def of(cls, batch, kind: str) -> StepTokens:
        """From a :class:`~sparse_mla.batch.StepBatch` for layers of ``kind`` (its block table; dsa: raw tokens)."""
        if kind not in PICKS_KINDS or kind not in batch.block_tables:
            raise ValueError(f"kind must be a picks kind of this batch ({[k for k in batch.kinds if k in PICKS_KINDS]})"
                             f", got {kind!r}")
        return cls(batch.positions, batch.token_to_req, batch.query_start_loc, batch.block_tables[kind],
                   COMPRESS_RATIO[kind])


def check_query_shape(q: torch.Tensor) -> None:
    """``q`` (3-D) is ``(T, H, 128)`` with ``H`` in ``[MIN_HEADS, MAX_HEADS]``: an indexer's queries, as the query
    prep and the score kernel take them."""
    if q.shape[2] != INDEX_HEAD_DIM or not MIN_HEADS <= q.shape[1] <= MAX_HEADS:
        raise ValueError(f"q must have shape (T, H, {INDEX_HEAD_DIM}) with H in [{MIN_HEADS}, {MAX_HEADS}], "
                         f"got {tuple(q.shape)}")


def check_step_inputs(q: torch.Tensor, weights: torch.Tensor, cache: IndexerKeyCache, step: StepTokens,
                      topk: int | None = None) -> None:
    """The scorers' shared checks: prepared ``q (T_cap, H, 128)`` float32 / bf16 / float16 / e4m3, ``weights
    (T_cap, H)`` float32, an :class:`IndexerKeyCache` on q's device, the step's int32 tensors and (selecting scorers)
    ``topk``; ``ValueError`` naming the argument."""
    if not isinstance(cache, IndexerKeyCache):
        raise TypeError(f"cache must be an IndexerKeyCache, got {type(cache).__name__}")
    check_tensor("q", q, dtype=(torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn), ndim=3,
                 device=cache.device)
    check_query_shape(q)
    cap = q.shape[0]
    check_tensor("weights", weights, dtype=torch.float32, shape=(cap, q.shape[1]), device=cache.device)
    check_tensor("positions", step.positions, dtype=torch.int32, shape=(cap,), device=cache.device)
    check_tensor("token_to_req", step.token_to_req, dtype=torch.int32, shape=(cap,), device=cache.device)
    check_tensor("query_start_loc", step.query_start_loc, dtype=torch.int32, ndim=1, device=cache.device)
    check_tensor("block_table", step.block_table, dtype=torch.int32, shape=(step.query_start_loc.shape[0] - 1, None),
                 device=cache.device)
    # the score kernel reads them at unit stride (a column-strided view would be read as its neighbours' values)
    for name, t in (("positions", step.positions), ("token_to_req", step.token_to_req),
                    ("query_start_loc", step.query_start_loc), ("block_table", step.block_table)):
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(f"{name} must have unit stride along its last axis, got strides {t.stride()}")
    if topk is not None:
        check_positive_int("topk", topk)
    check_positive_int("ratio", step.ratio)


def _entry_slots(cache: IndexerKeyCache, table: torch.Tensor, entries: torch.Tensor) -> torch.Tensor:
    """Cache slots of request-local ``entries (E,)`` through block-table rows ``table (..., pages)``: ``(..., E)``
    int64, ``-1`` where the entry's page is past the row or its block is ``-1`` or past the cache (never read)."""
    bs = cache.block_size
    page = entries // bs
    block = torch.where(page < table.shape[-1], table[..., page.clamp_max(table.shape[-1] - 1)].long(), -1)
    valid = (block >= 0) & (block < cache.num_blocks)
    return torch.where(valid, block * bs + entries % bs, -1)


def _page_keys(cache: IndexerKeyCache, table_row: torch.Tensor, entries: torch.Tensor) -> tuple[torch.Tensor,
                                                                                                  torch.Tensor]:
    """Dequantised keys of request-local ``entries (E,)`` through one request's ``table_row``: ``(E, 128)`` float32
    (zeros where the entry's block is missing or out of range) and ``(E,)`` bool, whether the block is valid."""
    slots = _entry_slots(cache, table_row, entries)
    return cache.read(slots), slots >= 0


def _merge_topk(best_val: torch.Tensor, best_idx: torch.Tensor, val: torch.Tensor, idx: torch.Tensor, k: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge a chunk's ``(t, E)`` scores into the running ``(t, k)`` best, ties to the lower index: the running best
    always holds lower indices than the chunk, and a stable sort keeps that order among equal scores."""
    vals, order = torch.sort(torch.cat((best_val, val), 1), dim=1, descending=True, stable=True)
    return vals[:, :k], torch.gather(torch.cat((best_idx, idx), 1), 1, order[:, :k])


# what a score past float32's range means: the inputs, not the keys (the caches hold bounded values)
SCORES_OVERFLOW = ("q and weights must give finite scores: a token's Σ_h w·ReLU(q·k) overflowed float32 (q or weights "
                   "too large in magnitude); the backends' picks among such scores are unspecified")


def check_scores_finite(finite: bool) -> None:
    """``ValueError`` (:data:`SCORES_OVERFLOW`) unless ``finite``: whether every visible score of a call was finite."""
    if not finite:
        raise ValueError(SCORES_OVERFLOW)


def written_columns(cache: IndexerKeyCache, step: StepTokens, t0: int, t1: int, num_cols: int,
                    finite: torch.Tensor | None = None) -> torch.Tensor:
    """``(t1 - t0, num_cols)`` bool: for the tokens ``[t0, t1)``, whether column (entry) ``c`` of the token's request
    holds a finite key in the cache, or is no key at all (a block ``-1`` or past the cache or the table: never read).
    ``finite``: the cache's :meth:`IndexerKeyCache.finite_slots`, where the caller has it (one pass over the cache for
    all its chunks). The debug check of the kernels' scores reads it, as the reference checks its scores over written
    keys only."""
    finite = (cache.finite_slots() if finite is None else finite).flatten()
    cols = torch.arange(num_cols, device=cache.device)
    # per request, then its tokens' rows (a 16K-token chunk is one request's: its rows share one mask)
    reqs, row_of = torch.unique(step.token_to_req[t0:t1].long().clamp_min(0), return_inverse=True)
    slots = _entry_slots(cache, step.block_table[reqs], cols)  # (requests, num_cols)
    return ((slots < 0) | finite[slots.clamp_min(0)])[row_of]


def _chunk_scores(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """``q (t, H, 128)``, ``w (t, H)``, ``keys (E, 128)`` -> ``(t, E)`` ``Σ_h w·ReLU(q·k)`` in float32."""
    return torch.einsum("th,the->te", w, torch.relu(torch.einsum("thd,ed->the", q, keys)))


def _request_ranges(step: StepTokens, capacity: int) -> list[tuple[int, int, int]]:
    """``(request, first token, end token)`` per request (a host copy of query_start_loc: the reference syncs, so
    its values are checked here: from 0, non-decreasing, at most the token ``capacity``)."""
    qsl = step.query_start_loc.tolist()
    if qsl and (qsl[0] < 0 or qsl[-1] > capacity or any(b < a for a, b in zip(qsl, qsl[1:]))):
        raise ValueError(f"query_start_loc must rise from >= 0 to at most the token capacity {capacity}, got {qsl}")
    return [(r, qsl[r], qsl[r + 1]) for r in range(len(qsl) - 1) if qsl[r + 1] > qsl[r]]


def _stream_topk(q: torch.Tensor, w: torch.Tensor, cache: IndexerKeyCache, step: StepTokens, k: int, group: int,
                 allowed: torch.Tensor | None, token_chunk: int, entry_chunk: int) -> torch.Tensor:
    """The top ``k`` of each token's visible scores, over entries (``group`` 1) or over blocks of ``group`` entries
    (score: the block's max; the block of the newest visible entry pinned first). allowed: ``(T_cap, nb)`` bool over
    blocks of :data:`BLOCK_ENTRIES` entries, or None. Returns ``(T_cap, k)`` int64 indices, ``-1`` fill."""
    cap = q.shape[0]
    out = torch.full((cap, k), -1, dtype=torch.int64, device=q.device)
    entry_chunk = max(group, entry_chunk // group * group)
    held = step.block_table.shape[1] * cache.block_size  # entries a request's table can hold: no candidate past them
    for r, start, end in _request_ranges(step, cap):
        table_row = step.block_table[r]
        for t0 in range(start, end, token_chunk):
            t1 = min(end, t0 + token_chunk)
            nvis = (step.positions[t0:t1].long() + 1).clamp_min(0) // step.ratio  # (t,) visible entries
            n_max = min(int(nvis.max()), held)  # a position past the table: its entries there are never read
            best_val = torch.full((t1 - t0, k), float("-inf"), device=q.device)
            best_idx = torch.full((t1 - t0, k), -1, dtype=torch.int64, device=q.device)
            for e0 in range(0, n_max, entry_chunk):
                entries = torch.arange(e0, min(n_max, e0 + entry_chunk), device=q.device)
                keys, block_ok = _page_keys(cache, table_row, entries)
                scores = _chunk_scores(q[t0:t1].float(), w[t0:t1], keys)
                visible = block_ok[None, :] & (entries[None, :] < nvis[:, None])
                # finite q and weights can still overflow (|w|·|q·k| past 3.4e38): refused, as the kernels' debug
                # check does, rather than ranked (a NaN would sort first; the kernels' ReLU drops it). Only over
                # finite keys: the cache refuses non-finite keys on write, so a non-finite one is a slot never
                # written (a visible entry the engine has not compressed yet), whose picks are unspecified anyway
                written = torch.isfinite(keys).all(1)
                check_scores_finite(bool(torch.isfinite(scores[visible & written[None, :]]).all()))
                if allowed is not None:
                    visible &= allowed[t0:t1, entries // BLOCK_ENTRIES]
                scores = torch.where(visible, scores, float("-inf"))
                if group > 1:  # block scores: the max over each run of `group` entries (chunks start on a block)
                    pad = -scores.shape[1] % group
                    scores = torch.nn.functional.pad(scores, (0, pad), value=float("-inf"))
                    scores = scores.view(t1 - t0, -1, group).amax(-1)
                    ids = torch.arange(scores.shape[1], device=q.device) + e0 // group
                    newest = ((nvis - 1) // group)[:, None]
                    scores = torch.where((ids[None, :] == newest) & (nvis[:, None] > 0), float("inf"), scores)
                else:
                    ids = entries
                best_val, best_idx = _merge_topk(best_val, best_idx, scores, ids.expand(t1 - t0, -1), k)
            out[t0:t1] = torch.where(best_val > float("-inf"), best_idx, -1)
    return out


def _check_chunks(token_chunk: int, entry_chunk: int) -> None:
    """The reference's workspace chunks (module docstring): positive ints."""
    check_positive_int("token_chunk", token_chunk)
    check_positive_int("entry_chunk", entry_chunk)


def index_topk_reference(q: torch.Tensor, weights: torch.Tensor, cache: IndexerKeyCache, step: StepTokens,
                         topk: int, kept_blocks: torch.Tensor | None = None, token_chunk: int = 64,
                         entry_chunk: int = 4096) -> torch.Tensor:
    """The indexer's picks: ``(T_cap, topk)`` int32, each token's best visible entries, best first, ``-1`` fill
    (padding rows all ``-1``).

    q, weights: from :func:`prepare_queries` (float32). cache: the layer's :class:`IndexerKeyCache`, read through
    ``step.block_table``; entries whose block number is ``-1`` or past the cache are not candidates (never read).
    kept_blocks: V4.1's two-level selection, ``(T_cap, n)`` int32 blocks of :data:`BLOCK_ENTRIES` entries
    (:func:`top_blocks_reference`), ``-1`` none: only entries inside them are candidates. Workspace: module docstring.
    """
    check_step_inputs(q, weights, cache, step, topk)
    _check_chunks(token_chunk, entry_chunk)
    allowed = None
    if kept_blocks is not None:
        check_tensor("kept_blocks", kept_blocks, dtype=torch.int32, ndim=2, device=cache.device)
        if kept_blocks.shape[0] != q.shape[0]:
            raise ValueError(f"kept_blocks must have {q.shape[0]} rows (q's), got {tuple(kept_blocks.shape)}")
        nb = -(-step.block_table.shape[1] * cache.block_size // BLOCK_ENTRIES)
        allowed = torch.zeros(q.shape[0], nb + 1, dtype=torch.bool, device=cache.device)
        allowed.scatter_(1, torch.where(kept_blocks >= 0, kept_blocks, nb).long().clamp_max(nb), True)
        allowed = allowed[:, :nb]
    return _stream_topk(q, weights, cache, step, topk, 1, allowed, token_chunk, entry_chunk).to(torch.int32)


def top_blocks_reference(q: torch.Tensor, weights: torch.Tensor, cache: IndexerKeyCache, step: StepTokens,
                         num_kept: int = KEPT_BLOCKS, token_chunk: int = 64, entry_chunk: int = 4096) -> torch.Tensor:
    """V4.1's first level: per token the ``num_kept`` blocks of :data:`BLOCK_ENTRIES` entries with the highest block
    score (the max of the block's visible scores), the block of the newest visible entry first; ``(T_cap, num_kept)``
    int32 block numbers (block ``b`` = entries ``8b … 8b + 7``), ``-1`` fill, ties to the lower block."""
    check_step_inputs(q, weights, cache, step, num_kept)
    _check_chunks(token_chunk, entry_chunk)
    return _stream_topk(q, weights, cache, step, num_kept, BLOCK_ENTRIES, None, token_chunk,
                        entry_chunk).to(torch.int32)
