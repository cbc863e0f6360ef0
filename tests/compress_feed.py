"""Shared by the compressor tests: random projections of a few requests, fed to a compressor through real step
batches in any schedule (one prefill, chunks, token by token, requests in any order), and a float64 oracle of the
compressor's formulas (DESIGN §6) written independently of the library."""
from __future__ import annotations

import math

import torch

from sparse_mla.batch import Request, StepBatchBuilder, blocks_needed
from sparse_mla.compress_metadata import KIND_OF_COMPRESS_RATIO, build_compress_metadata
from sparse_mla.compress_state import CompressorStatePool
from sparse_mla.rope import V4_COMPRESS_ROPE, RopeSpec

V4_RATIOS = (4, 128)


def coff(ratio: int) -> int:
    return 2 if ratio == 4 else 1


def make_params(ratio: int, dim: int, seed: int = 0):
    """Random ``(norm_weight (dim,), ape (r, coff·dim) or None)``."""
    gen = torch.Generator().manual_seed(seed)
    weight = 1 + 0.3 * torch.randn(dim, generator=gen)
    ape = torch.randn(ratio, coff(ratio) * dim, generator=gen) if ratio in V4_RATIOS else None
    return weight, ape


def make_sequences(lengths: list[int], ratio: int, dim: int, seed: int = 1, dtype: torch.dtype = torch.float32):
    """Per request ``(kv (n, coff·dim), score (n, coff·dim) or None)`` in ``dtype`` (bf16-exact values)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        kv = torch.randn(n, coff(ratio) * dim, generator=gen).to(torch.bfloat16).to(dtype)
        score = torch.randn(n, coff(ratio) * dim, generator=gen).mul(2).to(torch.bfloat16).to(dtype)
        if ratio == 1:
            score = None
        out.append((kv, score))
    return out


class Feeder:
    """Requests of given lengths with their own blocks in a ``kind`` cache, fed in steps to compressors."""

    def __init__(self, lengths: list[int], ratio: int, block_size: int | None = None, dtype=torch.float32,
                 device="cpu", max_tokens: int | None = None):
        self.kind = KIND_OF_COMPRESS_RATIO[ratio]
        self.ratio, self.lengths = ratio, lengths
        bs = {"swa": 64, self.kind: block_size or (2 if ratio == 128 else 64)}
        self.block_size = bs[self.kind]
        self.builder = StepBatchBuilder(max_tokens or sum(lengths), len(lengths), max(lengths) + 1,
                                        kinds=("swa", self.kind), block_sizes=bs, decode_threshold=1, device=device)
        self.tables, first = {}, {k: 0 for k in bs}
        for i, n in enumerate(lengths):
            self.tables[i] = {}
            for k in bs:
                need = blocks_needed(n, k, bs[k])
                # blocks of the requests interleaved in reverse, so a slot is not simply a position
                self.tables[i][k] = [first[k] + need - 1 - b for b in range(need)]
                first[k] += need
        self.num_blocks = {k: max(first[k], 1) for k in bs}
        self.pool = CompressorStatePool(ratio, len(lengths), device=device, dtype=dtype)
        self.state = {i: self.pool.allocate() for i in range(len(lengths))}
        self.done = [0] * len(lengths)

    def step(self, chunks: list[tuple[int, int]], out=None):
        """One step: ``(request, new tokens)`` pairs (reordered decodes first); returns the batch's request order,
        the batch and the compress metadata (refilled into ``out`` when given)."""
        chunks = sorted(chunks, key=lambda c: c[1] > 1)
        reqs = []
        for i, n in chunks:
            self.done[i] += n
            reqs.append(Request(self.done[i], n, self.tables[i]))
        batch = self.builder.build(reqs)
        meta = build_compress_metadata(batch, self.pool, [self.state[i] for i, _ in chunks], out=out)
        return [i for i, _ in chunks], batch, meta

    @staticmethod
    def rows(order, chunks_by_req, seqs, which):
        """This step's rows of projection ``which`` (0 kv, 1 score) for the requests in ``order``."""
        if seqs[order[0]][which] is None:
            return None
        return torch.cat([seqs[i][which][chunks_by_req[i][0]:sum(chunks_by_req[i])] for i in order])


def feed(feeder: Feeder, compressors, caches, seqs, schedule):
    """Run ``schedule`` (a list of steps, each a list of ``(request, new tokens)``) through ``compressors`` (each
    writing its cache of ``caches``; all share ``feeder.pool``'s ratio and take ``seqs[c]``)."""
    for step in schedule:
        order, batch, meta = feeder.step(step)
        start = {i: feeder.done[i] - n for i, n in step}
        chunks = {i: (start[i], n) for i, n in step}
        for comp, cache, seq in zip(compressors, caches, seqs):
            comp.forward(Feeder.rows(order, chunks, seq, 0), Feeder.rows(order, chunks, seq, 1), meta, cache)


def schedule_prefill(lengths):
    return [[(i, n) for i, n in enumerate(lengths)]]


def schedule_tokens(lengths):
    steps = []
    for t in range(max(lengths)):
        steps.append([(i, 1) for i, n in enumerate(lengths) if t < n])
    return steps


def schedule_chunks(lengths, sizes, seed=0):
    """Each request fed in chunks cycling through ``sizes``; requests joined per step in a shuffled order."""
    gen = torch.Generator().manual_seed(seed)
    left = list(lengths)
    k = [0] * len(lengths)
    steps = []
    while any(left):
        step = []
        for i in torch.randperm(len(lengths), generator=gen).tolist():
            if left[i]:
                n = min(left[i], sizes[(k[i] + i) % len(sizes)])
                k[i] += 1
                left[i] -= n
                step.append((i, n))
        steps.append(step)
    return steps


def oracle_entries(kv, score, ape, weight, eps, ratio, rope: RopeSpec = V4_COMPRESS_ROPE, prenorm_bf16=False):
    """float64 entries (n // r, d) of one request's whole sequence, from DESIGN §6's formulas, plus the latents.
    prenorm_bf16: round the pooled value to bf16 before the norm (R's numerics) to isolate later roundings."""
    kv, d = kv.double(), weight.shape[0]
    score = torch.zeros_like(kv) if score is None else score.double()
    n = kv.shape[0] // ratio
    latents, entries = [], []
    for w in range(n):
        if ratio == 4:
            s_parts, kv_parts = [], []
            for j in range(4):
                p = 4 * (w - 1) + j
                if p >= 0:
                    s_parts.append(score[p, :d] + ape[j, :d].double())
                    kv_parts.append(kv[p, :d])
            for j in range(4):
                p = 4 * w + j
                s_parts.append(score[p, d:] + ape[j, d:].double())
                kv_parts.append(kv[p, d:])
            s, v = torch.stack(s_parts), torch.stack(kv_parts)
        else:
            s = score[w * ratio:(w + 1) * ratio]
            if ape is not None:
                s = s + ape.double()
            v = kv[w * ratio:(w + 1) * ratio]
        pooled = (torch.softmax(s, 0) * v).sum(0)
        if prenorm_bf16:
            pooled = pooled.to(torch.bfloat16).double()
        lat = pooled / torch.sqrt(pooled.square().mean() + eps) * weight.double()
        latents.append(lat)
        ent = lat.clone()
        angles = torch.tensor(float(w * ratio)) * rope.inv_freq()  # float32 angles, as every implementation
        for i, angle in enumerate(angles.tolist()):
            a = 2 * i + d - rope.dim
            c, sn = math.cos(angle), math.sin(angle)
            e, o = lat[a].item(), lat[a + 1].item()
            ent[a], ent[a + 1] = e * c - o * sn, e * sn + o * c
        entries.append(ent)
    if not entries:
        return torch.zeros(0, d, dtype=torch.float64), torch.zeros(0, d, dtype=torch.float64)
    return torch.stack(latents), torch.stack(entries)
