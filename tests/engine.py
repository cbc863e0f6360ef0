"""A toy serving engine for the layer tests (V4's and V4.1's kinds): over several steps it grows each request's
block tables, writes the step's new latents and the compressed entries they complete into poisoned caches, refills
one step metadata in place, and keeps every stored value in a :class:`~sparse_mla.oracle.DenseOracle`."""
from __future__ import annotations

import torch

from helpers import DEVICE
from sparse_mla.batch import Request, StepBatchBuilder, blocks_needed
from sparse_mla.cache import PagedCache
from sparse_mla.config import COMPRESS_RATIO
from sparse_mla.metadata import MetadataSpec, build_step_metadata
from sparse_mla.oracle import DenseOracle
from sparse_mla.scenario import dequantized


class Engine:
    """sizes: ``{kind: block size}`` (``swa`` and the compressed kinds); fmt: every cache's format, or the window
    cache's where ``comp_fmt`` gives the compressed caches'."""

    def __init__(self, sizes: dict[str, int], fmt: str, window: int, topk: int, comp_fmt: str | None = None,
                 max_tokens: int = 72, max_len: int = 400) -> None:
        self.sizes, self.window, self.topk = sizes, window, topk
        self.caches = {k: PagedCache(blocks_needed(max_len, k, b) * 3, b, fmt if k == "swa" else comp_fmt or fmt,
                                     device=DEVICE) for k, b in sizes.items()}
        for c in self.caches.values():
            c.poison()
        self.builder = StepBatchBuilder(max_tokens, 4, max_len, kinds=tuple(sizes), block_sizes=sizes,
                                        decode_threshold=3, device=DEVICE)
        self.tables: dict[int, dict[str, list[int]]] = {}
        self.values: dict[str, dict[int, dict[int, torch.Tensor]]] = {k: {} for k in sizes}
        self.meta = None
        self.gen = torch.Generator().manual_seed(0)

    def step(self, work: list[tuple[int, int, int]]):
        """work: (request id, seq_len after the step, new tokens), decodes first. Returns the batch and the oracle
        holding every value the caches hold."""
        requests = []
        for rid, seq_len, q_len in work:
            t = self.tables.setdefault(rid, {k: [] for k in self.sizes})
            for kind, cache in self.caches.items():
                t[kind] += cache.allocator.allocate(blocks_needed(seq_len, kind, self.sizes[kind]) - len(t[kind]))
            requests.append(Request(seq_len, q_len, t))
        batch = self.builder.build(requests)
        rid_of = torch.tensor([w[0] for w in work])
        for kind, cache in self.caches.items():  # the model: new latents and the compressed entries they complete
            req, entry, slots = batch.new_entries(kind)
            kv = torch.randn(len(slots), 512, generator=self.gen).to(torch.bfloat16)
            cache.write(kv.to(DEVICE), slots)
            for r, e, v in zip(rid_of[req.long().cpu()].tolist(), entry.tolist(), dequantized(kv, cache.fmt)):
                self.values[kind].setdefault(r, {})[e] = v
        self.meta = build_step_metadata(batch, MetadataSpec(self.window, self.topk), out=self.meta)
        oracle = DenseOracle(self.window)
        for r, (rid, seq_len, _) in enumerate(work):
            oracle.set_raw(r, torch.stack([self.values["swa"][rid][p] for p in range(seq_len)]))
            for kind in self.sizes:
                if kind != "swa":
                    n = seq_len // COMPRESS_RATIO[kind]
                    oracle.set_compressed(kind, r, torch.stack([self.values[kind][rid][w] for w in range(n)])
                                          if n else torch.zeros(0, 512))
        return batch, oracle
