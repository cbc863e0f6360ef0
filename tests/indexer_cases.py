"""Random indexer steps for the indexer tests: requests, a poisoned paged key cache written through the reference
writer, the step's token tensors, queries and head weights."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from sparse_mla.batch import StepBatch
from sparse_mla.indexer import IndexerSpec, StepTokens, prepare_queries
from sparse_mla.indexer_cache import IndexerKeyCache
from sparse_mla.ops import targets
from sparse_mla.scenario import Scenario, make_scenario


@dataclass
class Case:
    cache: IndexerKeyCache
    step: StepTokens
    keys: list[torch.Tensor]  # per request, its entries' keys (n_r, 128) float32 as written
    q: torch.Tensor  # (T_cap, H, 128) float32, prepared
    w: torch.Tensor  # (T_cap, H) float32, prepared
    num_tokens: int
    spec: IndexerSpec


def make_case(gen: torch.Generator, requests: list[tuple[int, int]], spec: IndexerSpec, fmt: str = "fp8",
              device: torch.device | str = "cpu", padding: int = 2, spare_blocks: int = 3, bad_block: bool = False,
              spread: float = 0.0) -> Case:
    """``requests``: ``(seq_len, query_len)`` each; their entries' keys in shuffled pages of a poisoned cache (unused
    slots NaN); ``padding`` padding token rows; ``bad_block``: the last request's table lists a block past the cache
    after its own (never read: its entries are not visible); ``spread``: the keys' norms
    log-normal with this sigma (heavy-tailed scores, as a trained indexer's; 0: norms in [0.5, 1.5))."""
    ratio = spec.ratio
    counts = [seq // ratio for seq, _ in requests]
    pages = [-(-n // 64) for n in counts]
    num_blocks = sum(pages) + spare_blocks
    order = torch.randperm(num_blocks, generator=gen).tolist()
    cache = IndexerKeyCache(num_blocks, fmt, device=device)
    cache.poison()
    width = max(pages) + 1
    table = torch.full((len(requests), width), -1, dtype=torch.int32)
    keys, used = [], 0
    for r, (n, p) in enumerate(zip(counts, pages)):
        blocks = order[used:used + p]
        used += p
        table[r, :p] = torch.tensor(blocks, dtype=torch.int32)
        norms = (0.5 + torch.rand(n, 1, generator=gen)) * torch.exp(spread * torch.randn(n, 1, generator=gen))
        k = torch.randn(n, 128, generator=gen) * norms
        slots = torch.tensor([blocks[e // 64] * 64 + e % 64 for e in range(n)], dtype=torch.int64)
        cache.write(k.to(device), slots.to(device))
        keys.append(k)
    if bad_block:
        table[-1, pages[-1]] = num_blocks + 5
    num_tokens = sum(q for _, q in requests)
    cap = num_tokens + padding
    positions = torch.full((cap,), -1, dtype=torch.int32)
    token_to_req = torch.full((cap,), -1, dtype=torch.int32)
    qsl = [0]
    for r, (seq, qlen) in enumerate(requests):
        positions[qsl[-1]:qsl[-1] + qlen] = torch.arange(seq - qlen, seq, dtype=torch.int32)
        token_to_req[qsl[-1]:qsl[-1] + qlen] = r
        qsl.append(qsl[-1] + qlen)
    qsl_t = torch.tensor(qsl, dtype=torch.int32, device=device)
    step = StepTokens(positions.to(device), token_to_req.to(device), qsl_t, table.to(device), ratio)
    q_raw = torch.randn(cap, spec.num_heads, 128, generator=gen)
    w_raw = torch.randn(cap, spec.num_heads, generator=gen)
    q, w = prepare_queries(q_raw.to(device), w_raw.to(device), step.positions, spec)
    return Case(cache, step, keys, q, w, num_tokens, spec)


def write_step_keys(cache: IndexerKeyCache, batch: StepBatch, lengths: list[tuple[int, int]],
                    gen: torch.Generator) -> None:
    """Random keys (``gen``: a CPU generator) for every complete c4a entry of each request ``(seq_len, query_len)`` of
    ``batch``, into the key cache that shares the c4a cache's blocks."""
    for r, (seq, _) in enumerate(lengths):
        entries = torch.arange(seq // 4, dtype=torch.int32, device=cache.device)
        keys = torch.randn(len(entries), 128, generator=gen).to(cache.device)
        cache.write(keys, batch.entry_slots("c4a", r, entries))


@dataclass
class LayerStep:
    """A decode step for the indexer layer (:func:`layer_step`)."""

    scenario: Scenario
    cache: IndexerKeyCache  # poisoned, every complete c4a entry of the step's requests written
    q: torch.Tensor  # (T_cap, H, 128) float32, raw: the layer prepares it
    w: torch.Tensor  # (T_cap, H) float32, raw


def layer_step(lengths: list[tuple[int, int]], seed: int, device: torch.device | str, fmt: str = "fp8",
               heads: int = 16, picks: torch.Tensor | None = None) -> LayerStep:
    """A V4 step of ``lengths`` (``(seq_len, query_len)`` each; decodes of at most 2 tokens first, two padding tokens)
    for the indexer layer: its scenario (window 4, top-k 64, c4a blocks of 64; ``picks``: the c4a picks it converts),
    a poisoned key cache of ``fmt`` with random keys (:func:`write_step_keys`), then random queries and head weights
    of ``heads`` heads, all from one CPU generator seeded ``seed``."""
    extra = {} if picks is None else {"picks": {"c4a": picks}}
    sc = make_scenario(lengths, window=4, topk=64, fmt="bf16", decode_threshold=2, padding=2,
                       block_sizes={"swa": 64, "c4a": 64, "c128a": 2}, device=device, **extra)
    cache = IndexerKeyCache(sc.caches["c4a"].num_blocks, fmt, device=device)
    cache.poison()
    gen = torch.Generator().manual_seed(seed)
    write_step_keys(cache, sc.batch, lengths, gen)
    q = torch.randn(sc.batch.token_capacity, heads, 128, generator=gen).to(device)
    w = torch.randn(sc.batch.token_capacity, heads, generator=gen).to(device)
    return LayerStep(sc, cache, q, w)


def packed_rows(scores: torch.Tensor) -> torch.Tensor:
    """Packed keys of float32 ``scores (rows, cols)`` as the score kernel stores them (NaN: not a candidate)."""
    scores = torch.where(scores == 0, 0.0, scores)  # -0.0 is stored as +0.0
    bits = scores.view(torch.int32).long()
    packed = ((bits ^ ((bits >> 31) & 0x7FFFFFFF)) << 32) | (0xFFFFFFFF - torch.arange(scores.shape[1]))
    return torch.where(scores.isnan(), -(2 ** 63), packed)  # INT64_MIN: not a candidate


def check_picks(got: torch.Tensor, want: torch.Tensor, q: torch.Tensor, w: torch.Tensor, cache: IndexerKeyCache,
                step: StepTokens, rows: int, rel: float = 2e-3) -> None:
    """Row for row the same picks as sets, except entries whose scores (float64 from the prepared ``q``, ``w`` and
    the cache's keys) lie within ``rel`` of the row's largest score from the reference's k-th: near-ties that an
    e4m3 tensor-core dot (whose accumulation is narrower than float32) may order either way."""
    got, want = got[:rows].cpu(), want[:rows].cpu()
    bs = cache.block_size
    for t in range(rows):
        a, b = set(got[t].tolist()) - {-1}, set(want[t].tolist()) - {-1}
        if a == b:
            continue
        assert len(a) == len(b), f"row {t}: {len(a)} picks, the reference {len(b)}"
        r = int(step.token_to_req[t])
        entries = sorted(a | b)
        table = step.block_table[r].long().cpu()
        slots = torch.tensor([int(table[e // bs]) * bs + e % bs for e in entries], device=cache.device)
        keys = cache.read(slots).double()
        s = (w[t].double()[:, None] * torch.relu(q[t].double() @ keys.T)).sum(0).cpu()
        score = dict(zip(entries, s.tolist()))
        kth = min(score[e] for e in b)
        scale = max(abs(x) for x in score.values())
        far = [e for e in a ^ b if abs(score[e] - kth) > rel * scale]
        assert not far, f"row {t}: picks {sorted(a - b)[:5]} / reference {sorted(b - a)[:5]} differ beyond near-ties"


def capped_selects(target: targets.Target) -> tuple[tuple[int, int], ...]:
    """``(columns, rows)`` of the compile matrix's selects converting words over more rows than ``target``'s SMs,
    whose registers the digit search caps (``select_maxnreg``; NVIDIA, Triton 3.8+): a B 128 decode's 8,192 at 16
    warps, a prefill chunk's 9,216 past two rows an SM at 8."""
    return (8192, target.sms + 1), (9216, 2 * target.sms + 1)


def capped_select_variant(cols: int, rows: int) -> str:
    """The compile report's name of a :func:`capped_selects` launch."""
    return f"indexer select 512 of {cols} words into slots, {rows} rows"
