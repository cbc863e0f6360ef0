"""Decode context parallelism over 2 GPUs (issue 38): a DeepSeek-V4-Flash decode step with every request's context
split over the ranks, against one GPU holding the whole context.

    python benchmarks/bench_context_parallel.py --out results/                 # 2 CUDA GPUs, NCCL (~3 min)
    python benchmarks/bench_context_parallel.py --smoke --out /tmp/smoke       # tiny sizes, 2 CPU processes, gloo

The script spawns one process per rank itself (``torch.multiprocessing``, a free local port; NCCL on GPUs, gloo under
``--smoke``); rank ``r`` runs on GPU ``r``.

* The step: every attention layer of V4-Flash (43: 2 swa, 21 c4a, 20 c128a; 64 heads, top-k 512), B requests
  (default 8) of ``--context`` cached tokens each (default 512K) decoding 2 tokens (1 + 1 MTP draft), fp8_v4
  caches — one cache per layer kind, shared by the layers of that kind (as ``bench_step.py``; the contents are
  random, correctness is ``tests/test_context_parallel_gpu.py``'s). A step is the metadata build and every layer.
* Context parallel (``world`` ranks): each rank holds tokens / entries ``p % world == rank`` of every request; the
  step is ``build_rank_metadata`` + each layer in context-parallel mode (its keys without the sink, then
  ``PartialsGather``: one NCCL all-gather of the partials and the merge, the sink applied once).
* One GPU: the same step on rank 0 holding the whole context (``build_step_metadata`` + the layers), where its
  caches fit the GPU's free memory.

Measured: time per step, eager and replaying a CUDA graph of the whole step (the all-gathers inside it); CUDA
events around ``--iters`` back-to-back steps on every rank at once (not ``do_bench``: its repetition count is
decided per process, and every rank must run the same collectives), the median of ``--rounds``; the
communication share: the step's gathers alone (all-gather + merge of every layer, graph-replayed) over the
step's time, and the merges alone; the cache bytes each GPU holds. The longest context one step can serve on 1
and on ``world`` GPUs is computed, not run: see :func:`longest_context`. JSON to ``--out``, then a short table.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from rich.console import Console
from rich.table import Table

from sparse_mla.batch import Request, StepBatchBuilder
from sparse_mla.cache import PagedCache
from sparse_mla.config import COMPRESS_RATIO, DEFAULT_BLOCK_SIZE, V4_KINDS, ModelConfig, get_config
from sparse_mla.context_parallel import PartialsGather, RankLayout, build_rank_metadata
from sparse_mla.formats import block_bytes, bytes_per_token
from sparse_mla.layer import SparseMLAAttention
from sparse_mla.metadata import MetadataSpec, build_step_metadata
from sparse_mla.ops.merge import merge_partials
from sparse_mla.scenario import random_picks

from bench_step import LEN_ALIGN, MTP_TOKENS, model_layers
from harness import fill_random, positive_int, report, save_result
from timing import warm_up_gpu

GIB = 1 << 30


@dataclass(frozen=True)
class Sizes:
    """A run's sizes: V4-Flash on GPUs, tiny under ``--smoke``."""

    world: int
    batch: int
    context: int  # cached tokens per request before the step
    heads: int | None  # None: the model's
    topk: int | None
    layers_per_kind: int | None  # None: every layer of the model
    kv_format: str | None  # None: the model's (fp8_v4)
    iters: int  # back-to-back steps per timing
    rounds: int

    @staticmethod
    def of(args: argparse.Namespace) -> Sizes:
        if args.smoke:
            return Sizes(2, 2, 600, 4, 64, 1, "bf16", 2, 1)
        return Sizes(args.world, args.batch, args.context, None, None, None, None, args.iters, args.rounds)

    def model(self) -> ModelConfig:
        cfg = get_config("deepseek-v4-flash")
        return replace(cfg, num_heads=self.heads or cfg.num_heads, index_topk=self.topk or cfg.index_topk,
                       kv_format=self.kv_format or cfg.kv_format)


# ---------------------------------------------------------------------------------------------- the step


@dataclass
class Step:
    """One rank's decode step (``layout`` ``RankLayout(1, 0)`` and no gather: one process, the whole context)."""

    run: Callable[[], None]  # the metadata build and every layer
    gathers: Callable[[], None] | None  # every layer's gather alone (all-gather + merge); None without a group
    merges: Callable[[], None] | None  # every layer's merge alone
    outs: dict[str, torch.Tensor]
    cache_bytes: int


def make_step(sizes: Sizes, cfg: ModelConfig, device: torch.device, backend: str, seed: int,
              layout: RankLayout | None) -> Step:
    """The decode step of ``layout``'s rank (context parallel), or with ``layout`` None of one process holding every
    request's whole context. Caches of every kind filled with random latents, block tables in random order."""
    gen = torch.Generator().manual_seed(seed)
    b, ctx = sizes.batch, sizes.context + MTP_TOKENS
    max_len = math.ceil(ctx / LEN_ALIGN) * LEN_ALIGN
    share = layout or RankLayout(1, 0)
    caches, tables = {}, {}
    for i, kind in enumerate(V4_KINDS):
        need = share.blocks_needed(ctx, kind)
        caches[kind] = PagedCache(b * need + 1, DEFAULT_BLOCK_SIZE[kind], cfg.kv_format, cfg.head_dim, device)
        fill_random(caches[kind], torch.Generator(device=device).manual_seed(seed + i))
        tables[kind] = torch.randperm(b * need, generator=gen).view(b, need).tolist()
    requests = [Request(ctx, MTP_TOKENS, {k: tables[k][r] for k in V4_KINDS}) for r in range(b)]
    num_blocks = {k: c.num_blocks for k, c in caches.items()}
    args = (b * MTP_TOKENS, b, max_len, V4_KINDS)
    spec = MetadataSpec(window=cfg.window, topk=cfg.index_topk)
    if layout is None:
        batch = StepBatchBuilder(*args, decode_threshold=MTP_TOKENS, device=device, num_blocks=num_blocks).build(
            requests)
        meta = build_step_metadata(batch, spec)
        build = lambda: build_step_metadata(batch, spec, out=meta)  # noqa: E731
    else:
        batch = layout.batch_builder(*args, decode_threshold=MTP_TOKENS, device=device,
                                     num_blocks=num_blocks).build(requests)
        meta = build_rank_metadata(batch, layout, spec)
        build = lambda: build_rank_metadata(batch, layout, spec, out=meta)  # noqa: E731
    picks = random_picks(batch.positions.cpu(), cfg.index_topk, gen, max_len // COMPRESS_RATIO["c4a"], invisible=0,
                         drop=0.0).to(device)
    heads, tokens = cfg.num_heads, batch.token_capacity
    sinks = {k: torch.randn(heads, generator=gen).to(device) for k in V4_KINDS}
    layers = {k: SparseMLAAttention(k, heads, cfg.head_dim, cfg.window, topk=cfg.index_topk if k == "c4a" else None,
                                    scale=cfg.softmax_scale, sink=sinks[k], backend=backend) for k in V4_KINDS}
    q = {k: (torch.randn(tokens, heads, cfg.head_dim, generator=gen) * 0.5).to(torch.bfloat16).to(device)
         for k in V4_KINDS}
    outs = {k: torch.empty(tokens, heads, 512, dtype=torch.bfloat16, device=device) for k in V4_KINDS}
    kinds = model_layers(cfg, sizes.layers_per_kind)
    gather = None if layout is None else PartialsGather(tokens, heads, device=device)
    options = {} if gather is None else {"context_parallel": gather}

    def run() -> None:
        build()
        for kind in kinds:
            layers[kind](q[kind], meta, caches, picks if kind == "c4a" else None, out=outs[kind], **options)

    gathers = merges = None
    if gather is not None:
        run()  # the partials of the last layer stay in the gather's buffers: the gathers below merge them
        lse = gather.lse_partial.clone()

        def gathers() -> None:
            for kind in kinds:
                gather(gather.out_partial, lse, sinks[kind], merged=outs[kind], merged_lse=gather.merged_lse,
                       backend=backend)

        def merges() -> None:
            for kind in kinds:
                merge_partials(gather.outs, gather.lses, sinks[kind], out=outs[kind], lse_out=gather.merged_lse,
                               backend=backend)
    return Step(run, gathers, merges, outs, sum(c.data.nbytes for c in caches.values()))


# ---------------------------------------------------------------------------------------------- timing


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step_ms(fn: Callable[[], None], sizes: Sizes, device: torch.device, group: bool) -> float:
    """Milliseconds per call of ``fn``: ``sizes.iters`` calls back to back, timed by CUDA events (wall clock on the
    CPU), the median of ``sizes.rounds``. With ``group``, every rank of the default group runs this at once: each
    round starts at a barrier, and every rank makes the same calls (``fn``'s collectives match)."""
    fn()  # warm-up
    samples = []
    for _ in range(sizes.rounds):
        _sync(device)
        if group:
            dist.barrier()
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(sizes.iters):
                fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / sizes.iters)
        else:
            t0 = time.perf_counter()
            for _ in range(sizes.iters):
                fn()
            samples.append((time.perf_counter() - t0) * 1e3 / sizes.iters)
    return statistics.median(samples)


def graphed(fn: Callable[[], None], device: torch.device) -> Callable[[], None]:
    """``fn`` captured in a CUDA graph after a warm-up on a side stream (collectives included); its replay."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def time_step(step: Step, sizes: Sizes, device: torch.device, group: bool) -> dict:
    """The step's (and its gathers' and merges') times, ms: eager, and graph-replayed on a GPU."""
    row = {"eager_ms": step_ms(step.run, sizes, device, group)}
    if device.type == "cuda":
        row["graph_ms"] = step_ms(graphed(step.run, device), sizes, device, group)
    if step.gathers is not None:
        mode = "graph" if device.type == "cuda" else "eager"
        wrap = (lambda fn: graphed(fn, device)) if mode == "graph" else (lambda fn: fn)
        row["gathers_ms"] = step_ms(wrap(step.gathers), sizes, device, group)
        row["merges_ms"] = step_ms(wrap(step.merges), sizes, device, group)
        row["communication_share"] = row["gathers_ms"] / row[f"{mode}_ms"]
    row["finite"] = all(bool(o.isfinite().all()) for o in step.outs.values())
    return row


# ---------------------------------------------------------------------------------------------- memory


def model_bytes_per_token(cfg: ModelConfig) -> dict[str, float]:
    """Cache bytes one context token costs the model (every attention layer but the MTP layer's), in the model's
    format: ``all_raw`` — every layer keeps its window cache of raw tokens for the whole context (the library's
    block tables of the ``swa`` kind span ``seq_len``) plus its compressed cache (1/4 or 1/128 of a token's bytes);
    ``compressed_only`` — an engine that frees window blocks past the last ``W`` tokens pays the compressed caches
    alone per token (its window, ``W`` tokens per layer per request, is a constant)."""
    token = bytes_per_token(cfg.kv_format, cfg.head_dim)
    kinds = model_layers(cfg, None)
    compressed = sum(token / COMPRESS_RATIO[k] for k in kinds if k != "swa")
    return {"all_raw": len(kinds) * token + compressed, "compressed_only": compressed}


def longest_context(budget_bytes: float, per_token: float, batch: int, world: int) -> int:
    """The longest context per request one step of ``batch`` requests can serve on ``world`` GPUs of
    ``budget_bytes`` cache memory each: context parallelism spreads each request's cache evenly, so ``world`` GPUs
    hold ``world ×`` the tokens one GPU does: ``world · budget / (batch · bytes per token)`` (blocks' rounding up
    is left out: at most a block per request and kind)."""
    return int(world * budget_bytes // (batch * per_token))


# ---------------------------------------------------------------------------------------------- ranks


def _rank(rank: int, args: argparse.Namespace, sizes: Sizes, port: int, result_path: str) -> None:
    """One rank: the context-parallel step (every rank), then the one-GPU step (rank 0; the others wait)."""
    gpu = not args.smoke
    device = torch.device("cuda", rank) if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(device)
        warm_up_gpu(1.0)
    dist.init_process_group("nccl" if gpu else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=sizes.world, timeout=timedelta(minutes=10))
    try:
        cfg = sizes.model()
        backend = "auto" if gpu else "reference"
        free_at_start = torch.cuda.mem_get_info(device)[0] if gpu else None
        layout = RankLayout.of_group()
        step = make_step(sizes, cfg, device, backend, args.seed, layout)
        split = time_step(step, sizes, device, group=True)
        split["cache_bytes_per_gpu"] = step.cache_bytes
        if gpu:
            split["peak_bytes"] = torch.cuda.max_memory_allocated(device)
        ranks = [None] * sizes.world
        dist.all_gather_object(ranks, split)
        del step
        if gpu:
            torch.cuda.empty_cache()
        if rank == 0:
            whole = _one_gpu(sizes, cfg, device, backend, args.seed)
            result = dict(sizes=asdict(sizes), model=cfg.name, heads=cfg.num_heads, topk=cfg.index_topk,
                          layers=len(model_layers(cfg, sizes.layers_per_kind)), kv_format=cfg.kv_format,
                          device=torch.cuda.get_device_name(device) if gpu else "cpu", torch=str(torch.__version__),
                          context_parallel=ranks, one_gpu=whole,
                          memory=_memory(cfg, sizes, free_at_start, args.cache_gib, ranks[0]))
            with open(result_path, "w") as f:
                json.dump(result, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _one_gpu(sizes: Sizes, cfg: ModelConfig, device: torch.device, backend: str, seed: int) -> dict:
    """The step on one GPU holding every request's whole context, where its caches fit the free memory."""
    ctx = sizes.context + MTP_TOKENS
    need = sum(sizes.batch * RankLayout(1, 0).blocks_needed(ctx, k) * block_bytes(cfg.kv_format, DEFAULT_BLOCK_SIZE[k],
                                                                                  cfg.head_dim) for k in V4_KINDS)
    if device.type == "cuda" and need > 0.9 * torch.cuda.mem_get_info(device)[0]:
        return {"fits": False, "cache_bytes_per_gpu": need}
    step = make_step(sizes, cfg, device, backend, seed, None)
    row = time_step(step, sizes, device, group=False)
    row.update(fits=True, cache_bytes_per_gpu=step.cache_bytes)
    return row


def _memory(cfg: ModelConfig, sizes: Sizes, free_at_start: int | None, cache_gib: float | None, split: dict) -> dict:
    """The longest context per request on 1 and on ``world`` GPUs, for the run's batch and for one request: the
    cache budget per GPU is ``--cache-gib`` or the GPU's free memory at the start of the run less what the step
    used beside its caches (peak allocated − cache bytes: the metadata, gather and plan buffers); weights and
    activations are not counted. Both bytes-per-token readings of :func:`model_bytes_per_token`."""
    if cache_gib is not None:
        budget = cache_gib * GIB
    elif free_at_start is not None:
        budget = free_at_start - (split["peak_bytes"] - split["cache_bytes_per_gpu"])
    else:
        return {"budget_bytes": None}
    per_token = model_bytes_per_token(cfg)
    longest = {f"{reading}_b{b}_{w}gpu": longest_context(budget, per_token[reading], b, w)
               for reading in per_token for b in (sizes.batch, 1) for w in (1, sizes.world)}
    return dict(budget_bytes=budget, bytes_per_token=per_token, longest_context=longest)


# ---------------------------------------------------------------------------------------------- output


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def results_table(result: dict) -> Table:
    sizes, split, whole, memory = result["sizes"], result["context_parallel"][0], result["one_gpu"], result["memory"]
    world = sizes["world"]
    table = Table(title=f"decode context parallelism — {result['model']}, {result['layers']} layers, B "
                        f"{sizes['batch']} × {sizes['context']} tokens, {result['device']}",
                  caption="ms per step (rank 0); comm share = the step's all-gathers + merges alone / the step "
                          "(graph; eager without a GPU); cache GiB per GPU; longest context per request (tokens) "
                          "from the cache budget, <bytes per token reading>_b<batch>_<GPUs>")
    for col in ("", "eager ms", "graph ms", "gathers ms", "merges ms", "comm share", "cache GiB/GPU"):
        table.add_column(col, justify="right")
    table.add_row(f"{world} GPUs (context parallel)", _ms(split["eager_ms"]), _ms(split.get("graph_ms")),
                  _ms(split["gathers_ms"]), _ms(split["merges_ms"]), f"{split['communication_share']:.1%}",
                  f"{split['cache_bytes_per_gpu'] / GIB:.2f}")
    if whole["fits"]:
        table.add_row("1 GPU (whole context)", _ms(whole["eager_ms"]), _ms(whole.get("graph_ms")), "", "", "",
                      f"{whole['cache_bytes_per_gpu'] / GIB:.2f}")
    else:
        table.add_row("1 GPU (whole context)", "does not fit", "", "", "", "",
                      f"{whole['cache_bytes_per_gpu'] / GIB:.2f}")
    for key, tokens in memory.get("longest_context", {}).items():
        table.add_row(f"longest context, {key}", "", "", "", "", "", f"{tokens:,}")
    return table


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default=os.environ.get("OUT", "results"),
                        help="folder for bench_context_parallel.json")
    parser.add_argument("--world", type=positive_int, default=2, help="GPUs of the context-parallel group (default 2)")
    parser.add_argument("--batch", type=positive_int, default=8, help="requests per step (default 8)")
    parser.add_argument("--context", type=positive_int, default=512 * 1024,
                        help="cached tokens per request (default 524288)")
    parser.add_argument("--iters", type=positive_int, default=20, help="steps per timing (default 20)")
    parser.add_argument("--rounds", type=positive_int, default=3, help="timings per measure, median (default 3)")
    parser.add_argument("--cache-gib", type=float, default=None,
                        help="cache memory per GPU for the longest-context estimate (default: the GPU's free memory "
                             "at the start, less the step's other buffers)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes on the CPU: 2 processes over gloo, reference backend, no graphs")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(args: argparse.Namespace) -> int:
    """Spawn the ranks, write ``bench_context_parallel.json`` to ``args.out``, print the table. Returns 0, or 2
    without ``--world`` CUDA GPUs (unless ``--smoke``)."""
    console = Console(width=150)
    start = time.perf_counter()
    sizes = Sizes.of(args)
    if not args.smoke and torch.cuda.device_count() < sizes.world:
        print(f"The context-parallel benchmark needs {sizes.world} CUDA GPUs (found {torch.cuda.device_count()}). "
              f"On a CPU run it with --smoke (tiny sizes).", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        result_path = os.path.join(tmp, "result.json")
        mp.spawn(_rank, args=(args, sizes, _free_port(), result_path), nprocs=sizes.world)
        with open(result_path) as f:
            result = json.load(f)
    result["smoke"] = args.smoke
    path = os.path.join(args.out, "bench_context_parallel.json")
    save_result(path, result, start)
    return report(console, path, result, [results_table(result)])


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(_parser)
    raise SystemExit(run(_parser.parse_args()))
