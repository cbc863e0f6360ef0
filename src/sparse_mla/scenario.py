"""A synthetic serving step, as an engine would set it up: requests, paged caches filled with random
latents, indexer picks, the step's metadata, and the dense oracle holding the same values.

Used by the demo and the tests. Caches are poisoned first (every byte 0xFF = NaN) and only the keys
some token of this step may see are written: the SWA tokens inside a window of this step's tokens,
every complete c128a entry, and the entries of a picks kind (V4's c4a, V4.1's c2a and c1a) some token picked; the
raw tokens some token picked (V3.2, ``dim=576``: one ``dsa`` cache). A kernel that reads any other slot turns its
output NaN.

V4.1 (``kinds=V41_KINDS``): one window cache and one compressed cache per kind, as the step's layers of a kind share
their source layer's compressed cache; :meth:`Scenario.own_window` gives a layer its own window cache beside the
shared compressed ones (and the oracle that goes with it).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import torch

from .batch import Request, StepBatch, StepBatchBuilder, blocks_needed, slots_of
from .cache import PagedCache
from ._checks import check_tensor, is_int
from .config import COMPRESS_RATIO, DEFAULT_BLOCK_SIZE, PICKS_KINDS, V4_KINDS, check_scope_formats, complete_entries
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
    topk_local: torch.Tensor  # (token_capacity, topk) int32 indexer picks of the first picks kind: distinct, some
    # invisible, some -1 (c4a / c2a: local compressed entries; V3.2 scenarios: request-local raw positions, for dsa)
    picks: dict[str, torch.Tensor] = field(default_factory=dict)  # every picks kind's picks, topk_local among them
    window_writes: list[tuple[int, torch.Tensor]] = field(default_factory=list, repr=False)  # (request, positions)
    seed: int = 0

    def token_positions(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(request, position) of every token row, from ``lengths`` alone (``-1`` for padding rows)."""
        req, pos = [], []
        for r, (seq_len, q_len) in enumerate(self.lengths):
            req += [r] * q_len
            pos += range(seq_len - q_len, seq_len)
        pad = self.batch.token_capacity - len(req)
        return torch.tensor(req + [-1] * pad), torch.tensor(pos + [-1] * pad)

    def expected(self, q: torch.Tensor, kind: str, tokens: list[int] | None = None, sink: torch.Tensor | None = None,
                 scale: float | None = None, picks: torch.Tensor | None = None) -> torch.Tensor:
        """Oracle outputs ``(len(tokens), H, 512)`` float64 for the given token rows (all by default;
        padding rows -> 0). picks: a picks kind's ``(token_capacity, topk)`` picks (default the scenario's)."""
        req, pos = self.token_positions()
        rows = torch.arange(self.batch.token_capacity) if tokens is None else torch.as_tensor(tokens, dtype=torch.long)
        if kind in PICKS_KINDS:
            picks = (self.picks[kind] if picks is None else picks).cpu()[rows]
        out, _ = self.oracle.attend(q.cpu()[rows], req[rows], pos[rows], kind, sink, scale, picks)
        return out

    def own_window(self, seed: int) -> Scenario:
        """This step as a layer with a window cache of its own sees it (V4.1: every layer writes its window cache,
        the compressed caches are its source layer's): a new poisoned window cache of the same geometry and format,
        fresh random latents (``seed``) at the same positions, and an oracle over them and the shared compressed
        entries. Batch, metadata, compressed caches and picks are this scenario's (shared, not copied)."""
        old = self.caches["swa"]
        cache = PagedCache(old.num_blocks, old.block_size, old.fmt, old.fmt.dim, old.device, kv_scale=old.kv_scale)
        cache.poison()
        gen = torch.Generator().manual_seed(seed)
        raw = {}
        for r, values in _fill(cache, "swa", self.window_writes, self.batch, gen, self.lengths).items():
            raw[r] = (int(self.window_writes[r][1][0]) if len(self.window_writes[r][1]) else 0, values)
        return dataclasses.replace(self, caches={**self.caches, "swa": cache}, oracle=self.oracle.with_raw(raw),
                                   seed=seed)


def dequantized(kv: torch.Tensor, fmt: KVFormat, kv_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``kv (n, d)`` bf16 as a cache of ``fmt`` stores it, dequantised to float32 (the format's codec, no paging;
    ``kv_scale``: an fp8_e4m3 cache's)."""
    return decode_records(encode_records(kv, fmt, kv_scale), fmt, kv_scale) if fmt.quantized else kv.float()


def random_picks(positions: torch.Tensor, topk: int, gen: torch.Generator, num_entries: int,
                 invisible: int = 3, drop: float = 0.1, ratio: int = 4) -> torch.Tensor:
    """Indexer-like picks: per token, ``topk`` distinct entries among ``0 … (pos+1)//ratio - 1 + invisible``
    (so a few are not visible yet), a fraction ``drop`` replaced by ``-1``; ``-1`` rows for padding.
    ratio 4: c4a entries, 2: c2a, 1: c1a entries or V3.2's raw positions."""
    n = positions.shape[0]
    width = max(1, num_entries + invisible)
    limit = torch.where(positions >= 0, complete_entries(positions + 1, ratio) + invisible, 0)
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
                  picks: torch.Tensor | Mapping[str, torch.Tensor] | None = None, kv_scale: float | None = None,
                  kinds: Sequence[str] | None = None, compressed_fmt: str | None = None) -> Scenario:
    """lengths: ``(seq_len, query_len)`` per request, decodes first; ``padding`` extra token rows.

    kinds: the batch's cache kinds (default V4's ``V4_KINDS``, or ``("dsa",)`` for ``dim=576``; V4.1:
    :data:`~sparse_mla.config.V41_KINDS`). fmt: the caches' format; compressed_fmt: the compressed caches' format
    when it differs (V4.1: ``"fp4_v41"`` beside an ``"fp8_v41"`` window cache).

    fmt ``"fp8_e4m3"``: every cache shares one ``(1,)`` float32 ``kv_scale`` tensor (default
    :data:`E4M3_SCENARIO_SCALE`), as a layer's caches must.

    picks: the indexer's ``(token_capacity, topk)`` int32 picks of the first picks kind, or a dict of them per picks
    kind (default: :func:`random_picks` at each kind's ratio); only picked entries are written to a picks kind's
    cache (c4a, c2a, c1a; dsa for V3.2, ``dim=576``).
    """
    if not is_int(seed):
        raise TypeError(f"seed must be an int, got {seed!r}")
    if not (is_int(window) and window >= 1):
        raise ValueError(f"window must be a positive int, got {window!r}")
    if kinds is not None:
        kinds = kinds if isinstance(kinds, str) else tuple(kinds)  # (read once: a generator is empty the second time)
        if isinstance(kinds, str) or any(k not in DEFAULT_BLOCK_SIZE for k in kinds):
            raise ValueError(f"kinds must be a sequence of cache kinds {tuple(DEFAULT_BLOCK_SIZE)}, got {kinds!r}")
    if compressed_fmt is not None:  # the pairs a layer's caches may hold
        check_scope_formats(fmt, compressed_fmt, ("fmt", "compressed_fmt"))
    gen = torch.Generator().manual_seed(seed)
    kinds = kinds if kinds is not None else ("dsa",) if dim == 576 else V4_KINDS
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
        kind_fmt = fmt if kind in ("swa", "dsa") or compressed_fmt is None else compressed_fmt
        caches[kind] = PagedCache(sum(need) + 2, bs, kind_fmt, dim, device, kv_scale=scale)
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
    picks_kinds = [k for k in kinds if k in PICKS_KINDS]
    given = picks if isinstance(picks, Mapping) else {} if picks is None or not picks_kinds else {picks_kinds[0]: picks}
    if (picks is not None and not picks_kinds) or any(k not in picks_kinds for k in given):  # (else random picks)
        raise ValueError(f"picks must be for this scenario's picks kinds {picks_kinds}, got "
                         f"{list(given) if isinstance(picks, Mapping) else 'a tensor'}")
    for kind, t in given.items():
        check_tensor(f"picks[{kind!r}]", t, dtype=(torch.int32, torch.int64), shape=(batch.token_capacity, None))
    all_picks = {}
    for kind in picks_kinds:
        ratio = COMPRESS_RATIO[kind]
        all_picks[kind] = (given[kind] if kind in given else random_picks(
            batch.positions.cpu(), topk, gen, complete_entries(max_len, ratio), ratio=ratio)).cpu()
    token_req = batch.token_to_req.cpu()
    writes: dict[str, list[tuple[int, torch.Tensor]]] = {k: [] for k in kinds}  # (request, entries)
    for r, (seq_len, q_len) in enumerate(lengths):
        first = max(0, seq_len - q_len - (window - 1))  # earliest position any token of this step sees
        for kind in kinds:
            count = complete_entries(seq_len, COMPRESS_RATIO[kind])
            if kind in PICKS_KINDS:
                mine = all_picks[kind][token_req == r]
                writes[kind].append((r, torch.unique(mine[(mine >= 0) & (mine < count)])))
            else:  # the window's raw tokens; every complete c128a entry
                writes[kind].append((r, torch.arange(first, seq_len) if kind == "swa" else torch.arange(count)))
    oracle = DenseOracle(window)
    for kind, items in writes.items():
        for r, mine in _fill(caches[kind], kind, items, batch, gen, lengths).items():
            if kind == "swa":
                oracle.set_raw(r, mine, int(items[r][1][0]) if len(items[r][1]) else 0)
            elif kind == "dsa":  # picked raw tokens; the others stay unknown (NaN) to the oracle
                oracle.set_raw(r, mine)
            else:
                oracle.set_compressed(kind, r, mine)
    meta = build_step_metadata(batch, MetadataSpec(window=window, topk=topk))
    first_picks = all_picks[picks_kinds[0]].to(device) if picks_kinds else \
        torch.full((batch.token_capacity, topk), -1, dtype=torch.int32, device=device)
    return Scenario(list(lengths), batch, meta, caches, oracle, first_picks,
                    {k: (first_picks if i == 0 else p.to(device)) for i, (k, p) in enumerate(all_picks.items())},
                    writes.get("swa", []), seed)


def _fill(cache: PagedCache, kind: str, items: list[tuple[int, torch.Tensor]], batch: StepBatch,
          gen: torch.Generator, lengths: list[tuple[int, int]]) -> dict[int, torch.Tensor]:
    """Write random bf16 latents (``N(0, 0.25)``, from ``gen``) into ``cache`` (of ``kind``) at each request's
    entries ``items`` (``[(request, entries)]``), and return what the cache holds there, computed without the cache:
    per request, the window's latents from its first written position (``swa``), else a float32 row per entry the
    request holds, NaN (unknown to the oracle) where nothing was written."""
    device, dim = cache.device, cache.fmt.dim
    req = torch.cat([torch.full((len(e),), r) for r, e in items]).to(dtype=torch.int32, device=device)
    entries = torch.cat([e for _, e in items]).to(dtype=torch.int32, device=device)
    slots = slots_of(batch.block_tables[kind], req, entries, batch.block_sizes[kind])
    kv = (torch.randn(len(entries), dim, generator=gen) * 0.5).to(torch.bfloat16)
    cache.write(kv.to(device), slots)
    values = dequantized(kv, cache.fmt, None if cache.kv_scale is None else cache.kv_scale.cpu())
    held, start = {}, 0
    for r, e in items:
        mine = values[start:start + len(e)]
        start += len(e)
        if kind == "swa":
            held[r] = mine
        else:  # entries nobody sees stay unknown (NaN) to the oracle
            held[r] = torch.full((complete_entries(lengths[r][0], COMPRESS_RATIO[kind]), dim), math.nan)
            held[r][e.long()] = mine
    return held
