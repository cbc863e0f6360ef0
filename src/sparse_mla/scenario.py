"""A synthetic serving step, as an engine would set it up: requests, paged caches filled with random
latents, indexer picks, the step's metadata, and the dense oracle holding the same values.

Used by the demo and the tests. Caches are poisoned first (every byte 0xFF = NaN) and only the keys
some token of this step may see are written: the SWA tokens inside a window of this step's tokens,
every complete c128a entry, and the c4a entries some token picked (V4); the raw tokens some token picked
(V3.2, ``dim=576``: one ``dsa`` cache). A kernel that reads any other slot turns its output NaN.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .batch import Request, StepBatch, StepBatchBuilder, blocks_needed, slots_of
from .cache import PagedCache
from .config import COMPRESS_RATIO, DEFAULT_BLOCK_SIZE, V4_KINDS
from .formats import KVFormat, decode_records, encode_records
from .metadata import MetadataSpec, StepMetadata, build_step_metadata
from .oracle import DenseOracle

E4M3_SCENARIO_SCALE = 0.006  # fp8_e4m3 scenarios' kv_scale: the latents (N(0, 0.25)) use e4m3's range up to ~400


@dataclass
class Scenario:
    lengths: list[tuple[int, int]]
    batch: StepBatch
    meta: StepMetadata
    caches: dict[str, PagedCache]
    oracle: DenseOracle
    topk_local: torch.Tensor  # (token_capacity, topk) int32 indexer picks: distinct, some invisible, some -1
    # (c4a: local compressed entries; V3.2 scenarios: request-local raw positions, for the dsa layer)

    def token_positions(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(request, position) of every token row, from ``lengths`` alone (``-1`` for padding rows)."""
        req, pos = [], []
        for r, (seq_len, q_len) in enumerate(self.lengths):
            req += [r] * q_len
            pos += range(seq_len - q_len, seq_len)
        pad = self.batch.token_capacity - len(req)
        return torch.tensor(req + [-1] * pad), torch.tensor(pos + [-1] * pad)

    def expected(self, q: torch.Tensor, kind: str, tokens: list[int] | None = None, sink: torch.Tensor | None = None,
                 scale: float | None = None) -> torch.Tensor:
        """Oracle outputs ``(len(tokens), H, 512)`` float64 for the given token rows (all by default;
        padding rows -> 0)."""
        req, pos = self.token_positions()
        rows = torch.arange(self.batch.token_capacity) if tokens is None else torch.as_tensor(tokens, dtype=torch.long)
        picks = self.topk_local.cpu()[rows] if kind in ("c4a", "dsa") else None
        out, _ = self.oracle.attend(q.cpu()[rows], req[rows], pos[rows], kind, sink, scale, picks)
        return out


def dequantized(kv: torch.Tensor, fmt: KVFormat, kv_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``kv (n, d)`` bf16 as a cache of ``fmt`` stores it, dequantised to float32 (the format's codec, no paging;
    ``kv_scale``: an fp8_e4m3 cache's)."""
    return decode_records(encode_records(kv, fmt, kv_scale), fmt, kv_scale) if fmt.is_fp8 else kv.float()


def random_picks(positions: torch.Tensor, topk: int, gen: torch.Generator, num_entries: int,
                 invisible: int = 3, drop: float = 0.1, ratio: int = 4) -> torch.Tensor:
    """Indexer-like picks: per token, ``topk`` distinct entries among ``0 … (pos+1)//ratio - 1 + invisible``
    (so a few are not visible yet), a fraction ``drop`` replaced by ``-1``; ``-1`` rows for padding.
    ratio 4: c4a entries; ratio 1: V3.2's raw positions."""
    n = positions.shape[0]
    width = max(1, num_entries + invisible)
    limit = torch.where(positions >= 0, (positions + 1) // ratio + invisible, 0)
    scores = torch.rand(n, width, generator=gen)
    scores = scores.masked_fill(torch.arange(width)[None, :] >= limit[:, None], -1.0)
    k = min(topk, width)
    vals, idx = scores.topk(k, dim=1)
    idx = torch.where(vals >= 0, idx, -1)
    idx = torch.where(torch.rand(n, k, generator=gen) < drop, -1, idx)
    if k < topk:
        idx = torch.cat([idx, torch.full((n, topk - k), -1, dtype=idx.dtype)], dim=1)
    return idx.to(torch.int32)


def make_scenario(lengths: list[tuple[int, int]], *, window: int = 128, topk: int = 512, fmt: str = "fp8_v4",
                  dim: int = 512, decode_threshold: int = 1, padding: int = 0, seed: int = 0,
                  device: torch.device | str = "cpu", block_sizes: dict[str, int] | None = None,
                  picks: torch.Tensor | None = None, kv_scale: float | None = None) -> Scenario:
    """lengths: ``(seq_len, query_len)`` per request, decodes first; ``padding`` extra token rows.

    fmt ``"fp8_e4m3"``: every cache shares one ``(1,)`` float32 ``kv_scale`` tensor (default
    :data:`E4M3_SCENARIO_SCALE`), as a layer's caches must.

    picks: the indexer's ``(token_capacity, topk)`` int32 picks (default: :func:`random_picks`); only picked
    entries are written to the c4a (V4) or dsa (V3.2, ``dim=576``) cache.
    """
    gen = torch.Generator().manual_seed(seed)
    kinds = ("dsa",) if dim == 576 else V4_KINDS
    sizes = {k: (block_sizes or {}).get(k, DEFAULT_BLOCK_SIZE[k]) for k in kinds}
    caches, tables = {}, {k: [] for k in kinds}
    scale = None
    if fmt == "fp8_e4m3":
        scale = torch.full((1,), E4M3_SCENARIO_SCALE if kv_scale is None else kv_scale, dtype=torch.float32,
                           device=device)
    elif kv_scale is not None:
        raise ValueError(f"kv_scale is only for fp8_e4m3 scenarios, got fmt {fmt!r}")
    for kind, bs in sizes.items():
        need = [blocks_needed(s, kind, bs) for s, _ in lengths]
        caches[kind] = PagedCache(sum(need) + 2, bs, fmt, dim, device, kv_scale=scale)
        caches[kind].poison()
        blocks = torch.tensor(caches[kind].allocator.allocate(sum(need)), dtype=torch.long)
        blocks = blocks[torch.randperm(sum(need), generator=gen)]
        for n in need:
            tables[kind].append(blocks[:n].tolist())
            blocks = blocks[n:]
    requests = [Request(s, q, {k: tables[k][i] for k in kinds}) for i, (s, q) in enumerate(lengths)]
    max_len = max(s for s, _ in lengths)
    num_tokens = sum(q for _, q in lengths)
    builder = StepBatchBuilder(num_tokens + padding, len(lengths), max_len, kinds=kinds, block_sizes=sizes,
                               decode_threshold=decode_threshold, device=device,
                               num_blocks={k: c.num_blocks for k, c in caches.items()})
    batch = builder.build(requests)
    oracle = DenseOracle(window)
    picks_kind = "dsa" if "dsa" in kinds else "c4a"
    ratio = COMPRESS_RATIO[picks_kind]
    if picks is None:
        picks = random_picks(batch.positions.cpu(), topk, gen, max_len // ratio, ratio=ratio)
    picks = picks.cpu()
    token_req = batch.token_to_req.cpu()
    i32 = dict(dtype=torch.int32, device=device)
    writes: dict[str, list[tuple[int, torch.Tensor]]] = {k: [] for k in kinds}  # (request, entries)
    for r, (seq_len, q_len) in enumerate(lengths):
        mine = picks[token_req == r]
        picked = torch.unique(mine[(mine >= 0) & (mine < seq_len // ratio)])
        if picks_kind == "dsa":
            writes["dsa"].append((r, picked))
            continue
        first = max(0, seq_len - q_len - (window - 1))  # earliest position any token of this step sees
        writes["swa"].append((r, torch.arange(first, seq_len)))
        writes["c128a"].append((r, torch.arange(seq_len // 128)))
        writes["c4a"].append((r, picked))
    for kind, items in writes.items():
        req = torch.cat([torch.full((len(e),), r) for r, e in items]).to(**i32)
        entries = torch.cat([e for _, e in items]).to(**i32)
        slots = slots_of(batch.block_tables[kind], req, entries, sizes[kind])
        kv = (torch.randn(len(entries), dim, generator=gen) * 0.5).to(torch.bfloat16)
        caches[kind].write(kv.to(device), slots)
        # what the cache holds, computed without the cache
        values = dequantized(kv, caches[kind].fmt, None if scale is None else scale.cpu())
        start = 0
        for r, e in items:
            mine = values[start:start + len(e)]
            start += len(e)
            if kind == "swa":
                oracle.set_raw(r, mine, int(e[0]) if len(e) else 0)
            elif kind == "dsa":  # picked raw tokens; the others stay unknown (NaN) to the oracle
                full = torch.full((lengths[r][0], dim), math.nan)
                full[e.long()] = mine
                oracle.set_raw(r, full)
            else:
                full = torch.full((lengths[r][0] // COMPRESS_RATIO[kind], dim), math.nan)
                full[e.long()] = mine  # entries nobody sees stay unknown (NaN) to the oracle too
                oracle.set_compressed(kind, r, full)
    meta = build_step_metadata(batch, MetadataSpec(window=window, topk=topk))
    return Scenario(list(lengths), batch, meta, caches, oracle, picks.to(device))
