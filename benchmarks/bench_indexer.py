"""The lightning indexer per layer (issue 50): query prep + scores + top-k against the key bytes at the copy rate.

    python benchmarks/bench_indexer.py --out results/                # on a CUDA GPU (~2 min on an H200)
    python benchmarks/bench_indexer.py --smoke --out /tmp/smoke      # tiny sizes on the CPU (Triton's interpreter)

Cases (``--cases`` picks some): V4-Flash decode B 32 and 128 × 2 tokens (1 + 1 MTP) at 32K-token contexts (8,192
c4a entries, 64 heads, top-k 512, fp8 keys: 132 B each), B 8 × 2 at 512K; V4-Pro's top-k 1024; V4.1-Flash (32
heads, ratio 2: 16,384 entries at 32K, top-k 512); V3.2 (raw keys: 32,768 at 32K, 64 heads, top-k 2048); a
4096-token prefill chunk on a 32K prefix (V4-Flash).

Per case, after a correctness check (the picks of :class:`SparseMLAIndexer` against the reference's, as sets per
token: the share of rows equal), CUDA-graph replays of: the whole layer call (``prep + scores + top-k``), the query
prep alone, the score kernel alone, the top-k alone (the Triton select, the layer's, and ``torch.topk`` over the
packed rows), a layer's share of one graph of :data:`STEP_LAYERS` layers' calls over their own key caches (*in a
step*: a decode step's graph launches once for all its layers, a replay of one layer pays that launch, 6-11 µs on an
H200, each time), the score kernel's and the select's shares of graphs of :data:`STEP_LAYERS` launches each (*scores
in step*, *top-k in step*: the kernels' own times, the launch paid once; their ratio the top-k's share of the
scoring time without the replay's launch, which a one-launch replay adds to both), and a plain PyTorch path (the
keys gathered and dequantised, one einsum, ReLU, the weighted head sum, the causal mask, ``torch.topk``; what an
engine without kernels runs).
Against (a) the time to read the case's key bytes at the copy rate measured in the same run (a device-to-device
copy of 1 GiB: bytes read + written over time; the decode goal: at most 2×), the q·k flops at the bf16 matmul rate of
the same run (the prefill's tensor-core ceiling; goal: within 2×) and (b) the PyTorch path. JSON to
``--out/bench_indexer.json``; the table printed last.
"""
from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass
from typing import Callable, ContextManager, Hashable, Iterator, NamedTuple, Sequence

import torch
from rich.console import Console
from rich.table import Table

from sparse_mla.batch import Request, StepBatch, StepBatchBuilder, blocks_needed
from sparse_mla.config import COMPRESS_RATIO, V4_KINDS, V41_KINDS
from sparse_mla.indexer import StepTokens, index_topk_reference, prepare_queries
from sparse_mla.indexer_cache import IndexerKeyCache
from sparse_mla.indexer_layer import IndexerPlan, SparseMLAIndexer
from sparse_mla.metadata import MetadataSpec, StepMetadata, build_step_metadata
from sparse_mla.ops import targets
from sparse_mla.ops.dispatch import interpreting

from harness import Env, fill_random_keys, main, positive_int, prepare, report, run_info, save_result
from timing import graphed, timed

KEY_BYTES = {"fp8": 132, "bf16": 256}
STEP_LAYERS = 4  # the indexer calls of one CUDA graph in the "in a step" column (:func:`in_step_us`)


@dataclass(frozen=True)
class Case:
    name: str
    kind: str
    heads: int
    topk: int
    batch: int
    query_len: int
    context: int  # tokens cached after the step, per request


def cases(smoke: bool) -> list[Case]:
    if smoke:
        return [Case("v4-flash-b2", "c4a", 8, 64, 2, 2, 1024), Case("v41-flash-b2", "c2a", 8, 64, 2, 2, 512),
                Case("v32-b2", "dsa", 8, 128, 2, 2, 300), Case("prefill-v4-flash", "c4a", 8, 64, 1, 24, 700)]
    k32 = 32768
    return [Case("v4-flash-b32", "c4a", 64, 512, 32, 2, k32), Case("v4-flash-b128", "c4a", 64, 512, 128, 2, k32),
            Case("v4-flash-b8-512k", "c4a", 64, 512, 8, 2, 512 * 1024),
            Case("v4-pro-b32-top1024", "c4a", 64, 1024, 32, 2, k32),
            Case("v41-flash-b32", "c2a", 32, 512, 32, 2, k32), Case("v41-flash-b128", "c2a", 32, 512, 128, 2, k32),
            Case("v32-b32", "dsa", 64, 2048, 32, 2, k32),
            Case("prefill-4k-on-32k", "c4a", 64, 512, 1, 4096, k32 + 4096)]


def make_step(case: Case, device: torch.device):
    """The case's batch and metadata (every request alike, its blocks numbered in order) and its key cache (random
    e4m3 codes with power-of-two scales: 132 B per entry)."""
    kinds = ("dsa",) if case.kind == "dsa" else V41_KINDS if case.kind in ("c2a", "c1a") else V4_KINDS
    need = {k: blocks_needed(case.context, k) for k in kinds}
    requests = [Request(case.context, case.query_len, {k: list(range(r * n, (r + 1) * n)) for k, n in need.items()})
                for r in range(case.batch)]
    builder = StepBatchBuilder(case.batch * case.query_len, case.batch, case.context, kinds,
                               decode_threshold=max(2, 1 if case.query_len > 2 else case.query_len), device=device)
    batch = builder.build(requests)
    meta = build_step_metadata(batch, MetadataSpec(window=128, topk=case.topk))
    return batch, meta, key_cache(case, device)


def key_cache(case: Case, device: torch.device, seed: int = 0) -> IndexerKeyCache:
    """The case's key cache (its requests' blocks numbered in order, as :func:`make_step` lays them out): random e4m3
    codes with power-of-two scales, 132 B per entry."""
    cache = IndexerKeyCache(case.batch * blocks_needed(case.context, case.kind), "fp8", device=device)
    fill_random_keys(cache, torch.Generator(device=device).manual_seed(seed))
    return cache


def case_queries(case: Case, capacity: int, device: torch.device, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random indexer queries ``(capacity, heads, 128)`` bf16 and head weights ``(capacity, heads)`` float32."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(capacity, case.heads, 128, generator=gen).to(device, torch.bfloat16)
    return q, torch.randn(capacity, case.heads, generator=gen).to(device)


class ScoredLayer(NamedTuple):
    """A case's step, its queries and a Triton indexer called once on them (:func:`scored_layer`)."""

    batch: StepBatch
    meta: StepMetadata
    cache: IndexerKeyCache
    q: torch.Tensor
    w: torch.Tensor
    layer: SparseMLAIndexer
    plan: IndexerPlan


def scored_layer(case: Case, device: torch.device, seed: int = 0) -> ScoredLayer:
    """The case's step (:func:`make_step`), queries (:func:`case_queries`) and a Triton ``SparseMLAIndexer`` called
    once on them, with its step plan (the probes' common start)."""
    batch, meta, cache = make_step(case, device)
    q, w = case_queries(case, batch.token_capacity, device, seed)
    layer = SparseMLAIndexer(case.kind, case.heads, case.topk)
    layer(meta, q, w, cache)
    return ScoredLayer(batch, meta, cache, q, w, layer, layer.step_plan(meta, "triton"))


class ScoresAlone(NamedTuple):
    """The score launch of a layer call of one token chunk, on its own (:func:`scores_alone`)."""

    scores: torch.Tensor  # (tokens, num_cols): the plan's workspace rows it writes, words or packed keys
    launch: Callable[..., None]  # launch(out=scores, cache=the layer's, **index_scores options)


def scores_alone(layer: SparseMLAIndexer, plan: IndexerPlan, q_ready: torch.Tensor, w_ready: torch.Tensor,
                 cache: IndexerKeyCache, step: StepTokens) -> ScoresAlone | None:
    """The layer's score launch as its call makes it (its dot, its words or packed keys into the plan's workspace),
    from the prepared queries ``q_ready`` / ``w_ready``; None where the call takes several token chunks."""
    from sparse_mla.ops.triton import indexer as kernels

    words = layer.scores_as_words(plan)
    chunks = plan.chunks_for(words)
    if len(chunks) != 1:
        return None
    (t0, t1, longest), = chunks
    scores, dot = plan.scores(t1 - t0, words), plan.q.dtype
    q_dot, native = q_ready.to(dot), targets.target_of(cache.device).native_fp8

    def launch(out: torch.Tensor = scores, keys: IndexerKeyCache = cache, **options) -> None:
        kernels.index_scores(q_dot, w_ready, keys, step, out, t0, t1, longest, dot, native, **options)

    return ScoresAlone(scores, launch)


def select_rows(scored: ScoredLayer) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's scores of its first token chunk as its select reads them (words or packed keys, cloned) and the
    picks rows they fill (the select probes' rows)."""
    words = scored.layer.scores_as_words(scored.plan)
    (t0, t1, _), *_ = scored.plan.chunks_for(words)
    return scored.plan.scores(t1 - t0, words).clone(), scored.plan.picks[t0:t1]


def select_variants(rows: torch.Tensor, k: int, picks: torch.Tensor,
                    contexts: dict[Hashable, Callable[[], ContextManager]]) -> tuple[dict, dict]:
    """The select over ``rows`` (top ``k`` into ``picks``) under each of ``contexts`` (a label -> a context factory:
    the launch rules patched, say): each label's picks (cloned) and its launch's CUDA-graph replay, captured inside
    the context (the select probes' variants)."""
    from sparse_mla.ops.triton import indexer as kernels

    got, fns = {}, {}
    for label, context in contexts.items():
        with context():
            kernels.launch_topk_rows(rows, k, picks)
            got[label] = picks.clone()
            fns[label] = graphed(lambda: kernels.launch_topk_rows(rows, k, picks))
    return got, fns


def scored_cases(names: Sequence[str]) -> Iterator[tuple[Case, ScoredLayer]]:
    """The probes' cases: each of the benchmark's cases named in ``names`` (in the benchmark's order), with its layer
    scored on the GPU (:func:`scored_layer`)."""
    for case in cases(False):
        if case.name in names:
            yield case, scored_layer(case, torch.device("cuda"))


def layers_step(case: Case, scored: ScoredLayer, labels: Sequence[str]
                ) -> tuple[Callable[[str, int], None], dict[str, list[torch.Tensor]]]:
    """The probes' step of :data:`STEP_LAYERS` indexer layers, the first over ``scored``'s keys and queries, the others
    over their own: ``step(label, count)`` runs the first ``count`` layers (under whatever variant the caller set)
    into ``picks[label]``, each layer's ``(token capacity, topk)`` int32 picks."""
    dev, cap = scored.q.device, scored.batch.token_capacity
    caches = [scored.cache] + [key_cache(case, dev, seed) for seed in range(1, STEP_LAYERS)]
    inputs = [(scored.q, scored.w)] + [case_queries(case, cap, dev, seed) for seed in range(1, STEP_LAYERS)]
    layers = [SparseMLAIndexer(case.kind, case.heads, case.topk) for _ in caches]
    picks = {label: [torch.empty(cap, case.topk, dtype=torch.int32, device=dev) for _ in layers] for label in labels}

    def step(label: str, count: int) -> None:
        for layer, cache, (q, w), out in list(zip(layers, caches, inputs, picks[label]))[:count]:
            out.copy_(layer(scored.meta, q, w, cache))

    return step, picks


def coarsened_words(words: torch.Tensor, bits: int) -> torch.Tensor:
    """Score words (the select's int32 rows: unsigned order bits, 0 no candidate) with their low ``bits`` cleared, a
    candidate's kept at least 1: rows that tie at every threshold (the probes of the select's tie search). Cleared on
    the unsigned value: a non-negative score's word is at least 2^31, negative as int32."""
    unsigned = words.long() & 0xFFFFFFFF
    cleared = torch.where(unsigned != 0, torch.clamp_min(unsigned & -(1 << bits), 1), 0)
    return torch.where(cleared >= 2 ** 31, cleared - 2 ** 32, cleared).to(torch.int32)


def torch_path(q: torch.Tensor, w: torch.Tensor, cache: IndexerKeyCache, step: StepTokens, case: Case,
               token_chunk: int = 512) -> torch.Tensor:
    """Plain PyTorch, every request alike (``case``): keys gathered through the block table and dequantised, one
    einsum per request group / token chunk, ReLU, the head sum, the mask, ``torch.topk``; ``(T, topk)`` int64."""
    ratio, entries = step.ratio, case.context // step.ratio
    pages = -(-entries // cache.block_size)
    blocks = step.block_table[:, :pages].long()  # (R, P)
    keys = (cache.codes()[blocks].view(torch.float8_e4m3fn).float() * cache.scales()[blocks][..., None])
    keys = keys.flatten(1, 2)[:, :entries]  # (R, E, 128)
    q = q.view(case.batch, case.query_len, case.heads, 128)
    w = w.view(case.batch, case.query_len, case.heads)
    pos = step.positions[: case.batch * case.query_len].view(case.batch, case.query_len).long()
    cols = torch.arange(entries, device=q.device)
    out = []
    for t0 in range(0, case.query_len, token_chunk):
        t1 = min(case.query_len, t0 + token_chunk)
        scores = torch.einsum("rthd,red->rthe", q[:, t0:t1], keys).relu_()
        scores = torch.einsum("rthe,rth->rte", scores, w[:, t0:t1])
        scores = scores.masked_fill(cols >= ((pos[:, t0:t1, None] + 1) // ratio), float("-inf"))
        out.append(scores.topk(min(case.topk, entries), dim=-1).indices)
    return torch.cat(out, 1).flatten(0, 1)


def copy_gbs(device: torch.device, rep_ms: int) -> float:
    """The device-to-device copy rate, GB/s (bytes read + written)."""
    n = (1 << 30) if device.type == "cuda" else (1 << 20)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    us = timed(lambda: dst.copy_(src), rep_ms)
    return 2 * n / us / 1e3


def matmul_tflops(device: torch.device, rep_ms: int) -> float:
    """The bf16 tensor-core rate of a large matmul, TFLOP/s (the prefill's ceiling)."""
    n = 8192 if device.type == "cuda" else 256
    a = torch.randn(n, n, device=device).to(torch.bfloat16)
    b = torch.randn(n, n, device=device).to(torch.bfloat16)
    us = timed(lambda: a @ b, rep_ms)
    return 2 * n ** 3 / us / 1e6


def _recall(picks: torch.Tensor, ref: torch.Tensor) -> float:
    """The share of the reference's picks (``-1``: none) that ``picks`` hold, over all rows: ``(T, k)`` each."""
    k = ref.shape[1]
    chunk = max(1, (1 << 26) // (k * k))  # rows whose (rows, k, k) compare takes at most 64 MB
    held = 0
    for r in range(0, ref.shape[0], chunk):
        want, got = ref[r:r + chunk], picks[r:r + chunk]
        held += ((want[:, :, None] == got[:, None, :]).any(-1) & (want >= 0)).sum().item()
    return held / max(1, int((ref >= 0).sum()))


def in_step_us(case: Case, env: Env, meta: StepMetadata, q: torch.Tensor, w: torch.Tensor, cache: IndexerKeyCache,
               layers: int = STEP_LAYERS) -> float | None:
    """One layer's share of a CUDA graph of ``layers`` indexer calls of one step, each its own layer over its own key
    cache (as a decode step's graph holds its c4a layers, their attention between): the graph's own launch, which a
    replay of one layer pays each time, is paid once for them (without graphs: the calls one after another). None
    where the caches do not fit. Every layer takes the same queries (the probes' :func:`layers_step` gives each its
    own: B 128's share 61.9 µs here, 64.0 there, docs/history.md version 41)."""
    try:
        caches = [cache] + [key_cache(case, env.device, seed) for seed in range(1, layers)]
        indexers = [SparseMLAIndexer(case.kind, case.heads, case.topk, backend=env.backend) for _ in caches]

        def step() -> None:
            for indexer, layer_cache in zip(indexers, caches):
                indexer(meta, q, w, layer_cache)

        return timed(graphed(step) if env.graphs else step, env.rep_ms) / layers
    except torch.OutOfMemoryError:
        return None


def parts_in_step_us(case: Case, env: Env, parts: dict[str, Callable[[int], object]], layers: int = STEP_LAYERS
                     ) -> dict[str, float | None]:
    """Each part's share of a CUDA graph of ``layers`` launches of it, the ``i``-th ``parts[name](i)`` (its own inputs
    and outputs: layer ``i``'s), as :func:`in_step_us` times whole layers: the graph's launch, which a one-launch
    replay pays each time (4-5 µs on an H200, about a third of a B 128 select's replay), is paid once for them, so
    the shares compare the kernels' own times. ``do_bench`` flushes L2 before each replay: every launch reads its
    inputs from DRAM, where a layer's select reads words the score kernel has just written. µs by name (``None``
    where its buffers do not fit)."""
    out: dict[str, float | None] = {}
    for name, part in parts.items():
        def step(part: Callable[[int], object] = part) -> None:
            for i in range(layers):
                part(i)

        env.console.log(f"{case.name}: {name}, {layers} launches in one graph")
        try:
            out[name] = timed(graphed(step) if env.graphs else step, env.rep_ms) / layers
        except torch.OutOfMemoryError:
            out[name] = None
        if env.device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def layer_parts(case: Case, layer: SparseMLAIndexer, meta: StepMetadata, plan: IndexerPlan, q: torch.Tensor,
                w: torch.Tensor, caches: Sequence[IndexerKeyCache]) -> dict[str, Callable[[int], None]]:
    """Layer ``i``'s parts as the layer launches them, over ``caches[i]``: its query prep (``prep``), its prep and
    score launch (``prep_scores``: the score kernel a programmatic dependent of the prep) and its whole call
    (``whole``: the select a dependent of the scores, reading the words they just wrote to L2, converting its
    picks); ``layer``'s calls of one configuration share the step's ``plan``. For a call of one token chunk of
    words; ``{}`` otherwise."""
    from sparse_mla.ops.triton import indexer as kernels

    words = layer.scores_as_words(plan)
    chunks = plan.chunks_for(words)
    if not words or len(chunks) != 1:
        return {}
    (t0, t1, longest), = chunks
    scores = plan.scores(t1 - t0, words)
    native = targets.target_of(q.device).native_fp8

    def prep(i: int) -> None:
        kernels.launch_prepare_queries(q, w, plan.cos, plan.sin, case.kind == "dsa", layer.spec.q_format == "fp8",
                                       layer.spec.weight_scale, plan.q, plan.w)

    def prep_scores(i: int) -> None:
        prep(i)
        kernels.launch_index_scores(plan.q, plan.w, caches[i], plan.step, scores, t0, t1, longest, plan.q.dtype,
                                    native)

    def whole(i: int) -> None:
        layer(meta, q, w, caches[i])

    return {"prep": prep, "prep_scores": prep_scores, "whole": whole}


def layer_parts_in_step_us(case: Case, env: Env, layer: SparseMLAIndexer, meta: StepMetadata, plan: IndexerPlan,
                           q: torch.Tensor, w: torch.Tensor, caches: Sequence[IndexerKeyCache]
                           ) -> dict[str, float | None]:
    """What each part adds to a layer in a step: graphs of :data:`STEP_LAYERS` layers' query preps, of their preps
    and score launches, and of their whole calls (:func:`layer_parts`), each launched as the layer launches them:
    the prep's share, then the scores' and the top-k's as the differences (``scores_added_us``,
    ``topk_added_us``), which count what overlaps the part before it as the layer does. For a call of one token
    chunk of words; ``{}`` otherwise."""
    parts = layer_parts(case, layer, meta, plan, q, w, caches)
    if not parts:
        return {}
    out = parts_in_step_us(case, env, {f"{name}_in_step_us": part for name, part in parts.items()})
    if None in out.values():
        return out
    out["scores_added_us"] = out["prep_scores_in_step_us"] - out["prep_in_step_us"]
    out["topk_added_us"] = out["whole_in_step_us"] - out["prep_scores_in_step_us"]
    out["topk_share_of_scores_added"] = out["topk_added_us"] / out["scores_added_us"]
    return out


def run_case(case: Case, env: Env, rate_gbs: float, tflops: float) -> dict:
    from sparse_mla.ops.triton import indexer as kernels

    dev = env.device
    batch, meta, cache = make_step(case, dev)
    q, w = case_queries(case, batch.token_capacity, dev, env.seed)
    layer = SparseMLAIndexer(case.kind, case.heads, case.topk, backend=env.backend)
    picks = layer(meta, q, w, cache).clone()
    step = StepTokens.of(batch, case.kind)
    q_ready, w_ready = prepare_queries(q, w, batch.positions, layer.spec)
    ref = index_topk_reference(q_ready, w_ready, cache, step, case.topk)
    same = (picks.sort(1).values == ref.sort(1).values).all(1)[: batch.num_tokens].float().mean().item()
    recall = _recall(picks[: batch.num_tokens], ref[: batch.num_tokens])
    entries = case.context // COMPRESS_RATIO[case.kind]
    key_bytes = case.batch * entries * KEY_BYTES[cache.fmt]
    flops = 2 * 128 * case.heads * case.batch * sum(  # q·k over each token's visible entries
        (case.context - case.query_len + i + 1) // COMPRESS_RATIO[case.kind] for i in range(case.query_len))
    row = dict(case=case.name, kind=case.kind, heads=case.heads, topk=case.topk, batch=case.batch,
               query_len=case.query_len, context=case.context, entries=entries, key_mb=key_bytes / 1e6,
               key_read_us=key_bytes / rate_gbs / 1e3, tensor_core_us=flops / tflops / 1e6,
               rows_equal_reference=same, recall_of_reference=recall)
    del ref
    plan = layer.step_plan(meta, "triton")
    parts = {"layer_us": lambda: layer(meta, q, w, cache),
             "prep_us": lambda: kernels.prepare_queries(q, w, plan.cos, plan.sin, case.kind == "dsa", True,
                                                        layer.spec.weight_scale, plan.q, plan.w)}
    alone = scores_alone(layer, plan, q_ready, w_ready, cache, step)
    if alone is not None:  # the parts of a one-chunk call, as the layer scores and selects
        parts["scores_us"] = alone.launch
        # the select, without the conversion the layer's launch adds
        parts["topk_us"] = lambda: kernels.topk_rows(alone.scores, case.topk, plan.picks[: alone.scores.shape[0]])
        packed = torch.empty(alone.scores.shape, dtype=torch.int64, device=dev)  # torch.topk's: packed keys
        alone.launch(packed)
        parts["topk_torch_us"] = lambda: kernels.topk_from_packed(packed, case.topk)
    parts["torch_us"] = lambda: torch_path(q_ready, w_ready, cache, step, case)
    env.console.log(f"{case.name}: {STEP_LAYERS} layers in one graph")
    row["layer_in_step_us"] = in_step_us(case, env, meta, q, w, cache)
    if alone is not None:
        try:  # layer i's own keys, scores and picks (layer 0: this call's)
            caches = [cache] + [key_cache(case, dev, seed) for seed in range(1, STEP_LAYERS)]
            scores = [alone.scores] + [alone.scores.clone() for _ in range(1, STEP_LAYERS)]
            picks = [plan.picks[: alone.scores.shape[0]]] + [plan.picks[: alone.scores.shape[0]].clone()
                                                             for _ in range(1, STEP_LAYERS)]
            row.update(parts_in_step_us(case, env, {
                "scores_in_step_us": lambda i: alone.launch(scores[i], caches[i]),
                "topk_in_step_us": lambda i: kernels.topk_rows(scores[i], case.topk, picks[i])}))
            row.update(layer_parts_in_step_us(case, env, layer, meta, plan, q, w, caches))
            del caches, scores, picks
        except torch.OutOfMemoryError:
            pass
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    for name, fn in parts.items():
        env.console.log(f"{case.name}: {name}")
        try:
            run = graphed(fn) if env.graphs else fn
            row[name] = timed(run, env.rep_ms)
        except torch.OutOfMemoryError:
            row[name] = None
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    row["layer_over_key_read"] = row["layer_us"] / row["key_read_us"]
    if row.get("layer_in_step_us"):
        row["in_step_over_key_read"] = row["layer_in_step_us"] / row["key_read_us"]
    row["layer_over_tensor_core"] = row["layer_us"] / row["tensor_core_us"]
    select_us = row.get("topk_us") or row.get("topk_torch_us")
    if row.get("scores_us") and select_us:
        row["topk_share_of_scores"] = select_us / row["scores_us"]
    if row.get("scores_in_step_us") and row.get("topk_in_step_us"):
        row["topk_share_of_scores_in_step"] = row["topk_in_step_us"] / row["scores_in_step_us"]
    if row.get("torch_us"):
        row["speedup_vs_torch"] = row["torch_us"] / row["layer_us"]
    return row


def results_table(result: dict) -> Table:
    table = Table(title=f"Lightning indexer per layer (prep + scores + top-k) — {result['device']}",
                  caption=f"µs, CUDA-graph replays; key read = the keys' bytes at the copy rate "
                          f"({result['copy_gbs']:.0f} GB/s, same run); in step = a layer's share of a graph of "
                          f"{STEP_LAYERS} layers' calls (its launch paid once), scores / top-k in step: of "
                          f"{STEP_LAYERS} launches of each; added: what the scores and the top-k add to "
                          f"{STEP_LAYERS} layers' preps in one graph, launched as the layer does; TC = the q·k flops "
                          f"at the bf16 "
                          f"matmul rate ({result['matmul_tflops']:.0f} TFLOP/s, same run); = ref: rows whose picks "
                          f"equal the reference's; recall: the share of the reference's picks the layer's hold")
    for col in ("case", "keys MB", "key read", "layer", "× key read", "in step", "× key read", "× TC", "prep", "scores",
                "top-k", "torch.topk", "top-k / scores", "scores in step", "top-k in step", "top-k / scores in step",
                "prep in layers", "scores added", "top-k added", "top-k / scores added", "PyTorch", "speed-up", "= ref",
                "recall"):
        table.add_column(col, justify="left" if col == "case" else "right")

    def f(v, spec=".1f"):
        return "—" if v is None else format(v, spec)

    for r in result["cases"]:
        table.add_row(r["case"], f(r["key_mb"]), f(r["key_read_us"]), f(r["layer_us"]),
                      f(r["layer_over_key_read"], ".2f"), f(r.get("layer_in_step_us")),
                      f(r.get("in_step_over_key_read"), ".2f"), f(r["layer_over_tensor_core"], ".2f"),
                      f(r.get("prep_us")), f(r.get("scores_us")), f(r.get("topk_us")), f(r.get("topk_torch_us")),
                      f(r.get("topk_share_of_scores"), ".0%"), f(r.get("scores_in_step_us")),
                      f(r.get("topk_in_step_us")), f(r.get("topk_share_of_scores_in_step"), ".0%"),
                      f(r.get("prep_in_step_us")), f(r.get("scores_added_us")), f(r.get("topk_added_us")),
                      f(r.get("topk_share_of_scores_added"), ".0%"), f(r.get("torch_us")),
                      f(r.get("speedup_vs_torch"), ".1f"), f(r["rows_equal_reference"], ".3f"),
                      f(r.get("recall_of_reference"), ".4f"))
    return table


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default=os.environ.get("OUT", "results"), help="folder for bench_indexer.json")
    parser.add_argument("--cases", nargs="*", help="case names (default: all)")
    parser.add_argument("--rep", type=positive_int, default=50, help="do_bench repetition time per timing, ms")
    parser.add_argument("--no-graphs", action="store_true", help="eager timings only")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU (Triton's interpreter), no graphs")


def run(args: argparse.Namespace) -> int:
    console = Console(width=170)
    start = time.perf_counter()

    def make_env(args: argparse.Namespace, console: Console) -> Env:
        if args.smoke:
            backend = "triton" if interpreting() else "reference"
            return Env(torch.device("cpu"), backend, None, False, args.rep, 1, None, args.seed, console)
        return Env(torch.device("cuda"), "auto", None, not args.no_graphs, args.rep, 1, None, args.seed, console)

    env = prepare(args, console, "The indexer benchmark needs a CUDA GPU.", make_env)
    if env is None:
        return 2
    chosen = [c for c in cases(args.smoke) if not args.cases or c.name in args.cases]
    result = dict(run_info(env), smoke=args.smoke, graphs=env.graphs, copy_gbs=copy_gbs(env.device, env.rep_ms),
                  matmul_tflops=matmul_tflops(env.device, env.rep_ms), cases=[])
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "bench_indexer.json")
    for case in chosen:
        console.log(f"{case.name}: building the step")
        result["cases"].append(run_case(case, env, result["copy_gbs"], result["matmul_tflops"]))
        save_result(path, result, start)
    return report(console, path, result, [results_table(result)])


if __name__ == "__main__":
    main(__doc__, add_arguments, run)
