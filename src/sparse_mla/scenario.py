"""A synthetic serving step, as an engine would set it up: requests, paged caches filled with random
latents, indexer picks, the step's metadata, and the dense oracle holding the same values.

Used by the demo and the tests. Only SWA positions that some token of this step can see are written;
every other cache slot stays poisoned with NaN, so a kernel that reads outside its keys shows it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .batch import Request, StepBatch, StepBatchBuilder, entries_needed, slots_of
from .cache import PagedCache
from .config import COMPRESS_RATIO, DEFAULT_BLOCK_SIZE
from .metadata import MetadataSpec, StepMetadata, build_step_metadata
from .oracle import DenseOracle
from .ops.validate import D_V


@dataclass
class Scenario:
    batch: StepBatch
    meta: StepMetadata
    caches: dict[str, PagedCache]
    oracle: DenseOracle
    topk_local: torch.Tensor  # (token_capacity, topk) int32 indexer picks, some invisible, some -1

    def expected(self, q: torch.Tensor, kind: str, tokens: list[int], sink: torch.Tensor | None,
                 scale: float) -> torch.Tensor:
        """Oracle outputs ``(len(tokens), H, 512)`` float64 for the given token rows (padding -> 0)."""
        b = self.batch
        rows = []
        for t in tokens:
            r, pos = int(b.token_to_req[t]), int(b.positions[t])
            if r < 0:
                rows.append(torch.zeros(q.shape[1], D_V, dtype=torch.float64))
                continue
            keys = self.oracle.visible_keys(r, pos, kind, self.meta.spec.window, self.topk_local[t].tolist())
            rows.append(self.oracle.attend(q[t].cpu(), keys, None if sink is None else sink.cpu(), scale))
        return torch.stack(rows)


def make_scenario(lengths: list[tuple[int, int]], *, window: int = 128, topk: int = 512, fmt: str = "fp8_v4",
                  dim: int = 512, decode_threshold: int = 1, padding: int = 0, seed: int = 0,
                  device: torch.device | str = "cpu", block_sizes: dict[str, int] | None = None) -> Scenario:
    """lengths: ``(seq_len, query_len)`` per request, decodes first; ``padding`` extra token rows."""
    gen = torch.Generator().manual_seed(seed)
    sizes = {k: (block_sizes or {}).get(k, DEFAULT_BLOCK_SIZE[k]) for k in COMPRESS_RATIO}
    caches, tables = {}, {k: [] for k in COMPRESS_RATIO}
    for kind, bs in sizes.items():
        need = [max(1, math.ceil(entries_needed(s, kind) / bs)) for s, _ in lengths]
        caches[kind] = PagedCache(sum(need) + 2, bs, fmt, dim, device)
        caches[kind].poison()
        blocks = torch.tensor(caches[kind].allocator.allocate(sum(need)))[torch.randperm(sum(need), generator=gen)]
        for n in need:
            tables[kind].append(blocks[:n].tolist())
            blocks = blocks[n:]
    requests = [Request(s, q, {k: tables[k][i] for k in COMPRESS_RATIO}) for i, (s, q) in enumerate(lengths)]
    max_len = max(s for s, _ in lengths)
    num_tokens = sum(q for _, q in lengths)
    builder = StepBatchBuilder(num_tokens + padding, len(lengths), max_len, block_sizes=sizes,
                               decode_threshold=decode_threshold, device=device)
    batch = builder.build(requests)
    oracle = DenseOracle()
    i32 = dict(dtype=torch.int32, device=device)
    for r, (seq_len, q_len) in enumerate(lengths):
        first = max(0, seq_len - q_len - (window - 1))  # earliest position any token of this step sees
        latents = torch.full((seq_len, dim), float("nan"), dtype=torch.float64)
        pos = torch.arange(first, seq_len, **i32)
        slots = slots_of(batch.block_tables["swa"][r][None], torch.zeros((), **i32), pos, sizes["swa"])
        caches["swa"].write(_random_latents(gen, len(pos), dim, device), slots)
        latents[first:] = caches["swa"].read(slots).double().cpu()
        oracle.raw[r] = latents
        for kind in ("c4a", "c128a"):
            n = seq_len // COMPRESS_RATIO[kind]
            entries = slots_of(batch.block_tables[kind][r][None], torch.zeros((), **i32), torch.arange(n, **i32),
                               sizes[kind])
            caches[kind].write(_random_latents(gen, n, dim, device), entries)
            oracle.compressed[kind][r] = caches[kind].read(entries).double().cpu()
    hi = max(1, max_len // 4 + 3)
    picks = torch.randint(-1, hi, (batch.token_capacity, topk), generator=gen, dtype=torch.int32)
    meta = build_step_metadata(batch, MetadataSpec(window=window, topk=topk))
    return Scenario(batch, meta, caches, oracle, picks.to(device))


def _random_latents(gen: torch.Generator, n: int, dim: int, device) -> torch.Tensor:
    return (torch.randn(n, dim, generator=gen) * 0.5).to(torch.bfloat16).to(device)
