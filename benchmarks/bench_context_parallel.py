"""Decode context parallelism on 1, 2 and 4 GPUs (issues 38, 51): a DeepSeek-V4-Flash decode step with every
request's context split over the ranks, against one GPU holding the whole context; the step's attention part and
its communication part, in both exchange forms.

    python benchmarks/bench_context_parallel.py --out results/               # every GPU of the host (2 or 4), ~3 min
    python benchmarks/bench_context_parallel.py --worlds 1 2 --out results/  # 1 and 2 GPUs only
    python benchmarks/bench_context_parallel.py --smoke --out /tmp/smoke     # tiny sizes, 2 CPU processes, gloo

The script spawns one process per GPU itself (``torch.multiprocessing``, a free local port; NCCL on GPUs, gloo under
``--smoke``); rank ``r`` runs on GPU ``r``. A ``w``-GPU measurement runs on ranks ``0 … w-1`` (their own NCCL
group), the other ranks waiting.

* The cases (``--cases``, ``B×context``): B 8 × 512K and B 32 × 128K tokens per request, every request decoding 2
  tokens (1 + 1 MTP draft). One GPU holds either (the caches below are about 3 GiB).
* The step: every attention layer of V4-Flash (43: 2 swa, 21 c4a, 20 c128a; 64 heads, top-k 512; ``--layers-per-kind``
  fewer), fp8_v4 caches — one cache per layer kind, shared by the layers of that kind (as ``bench_step.py``; the
  contents are random, correctness is ``tests/test_context_parallel_gpu.py``'s). A step is the metadata build and
  every layer.
* ``w`` GPUs, context parallel: each rank holds tokens / entries ``p % w == rank`` of every request; the step is
  ``build_rank_metadata`` + each layer in context-parallel mode, with ``PartialsGather(comm=...)`` of each form
  (``allgather``: every rank's partials gathered and merged; ``reduce_scatter``: the LSEs gathered, each rank's
  partial rescaled, a reduce-scatter over heads).
* 1 GPU: the same step on rank 0 holding the whole context (``build_step_metadata`` + the layers).

Measured per step, rank by rank (CUDA events around ``--iters`` back-to-back steps on every rank of the group at
once, after a barrier; the median of ``--rounds``): ``eager_ms``; ``graph_ms``, a CUDA graph of the whole step
replayed (collectives inside); ``attention_ms``, a graph of the step with every layer's exchange left out (the
metadata build and the rank's attention of its share); ``communication_ms``, a graph of every layer's exchange alone
(the collectives and the merge or the rescale). Attention and communication are timed apart, so they need not add
up to the step (the step may overlap them, or wait on the slowest rank). The table shows rank 0's times but the
attention of the slowest rank, and the ratios the issue's goals name: each rank's attention over one GPU's, the step
over one GPU's, eager over graph. JSON to ``--out``, then the table.
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
from sparse_mla.context_parallel import COMM_FORMS, PartialsGather, RankLayout, build_rank_metadata
from sparse_mla.formats import block_bytes, bytes_per_token
from sparse_mla.layer import SparseMLAAttention
from sparse_mla.metadata import MetadataSpec, build_step_metadata
from sparse_mla.scenario import random_picks

from bench_step import LEN_ALIGN, MTP_TOKENS, model_layers
from harness import fill_random, positive_int, report, save_result
from timing import warm_up_gpu

GIB = 1 << 30
CASES = ((8, 512 * 1024), (32, 128 * 1024))  # (requests, cached tokens per request)


@dataclass(frozen=True)
class Sizes:
    """A run's sizes: V4-Flash on GPUs, tiny under ``--smoke``."""

    procs: int  # processes spawned: the largest world
    worlds: tuple[int, ...]
    cases: tuple[tuple[int, int], ...]  # (batch, context)
    comms: tuple[str, ...]
    heads: int | None  # None: the model's
    topk: int | None
    layers_per_kind: int | None  # None: every layer of the model
    kv_format: str | None  # None: the model's (fp8_v4)
    iters: int  # back-to-back steps per timing
    rounds: int

    @staticmethod
    def of(args: argparse.Namespace) -> Sizes:
        if args.smoke:
            return Sizes(2, (1, 2), ((2, 600),), COMM_FORMS, 4, 64, 1, "bf16", 2, 1)
        worlds = tuple(sorted(set(args.worlds or [w for w in (1, 2, 4) if w <= max(torch.cuda.device_count(), 1)])))
        return Sizes(max(worlds), worlds, tuple(args.cases or CASES), tuple(args.comm or COMM_FORMS), None, None,
                     args.layers_per_kind, None, args.iters, args.rounds)

    def model(self) -> ModelConfig:
        cfg = get_config("deepseek-v4-flash")
        return replace(cfg, num_heads=self.heads or cfg.num_heads, index_topk=self.topk or cfg.index_topk,
                       kv_format=self.kv_format or cfg.kv_format)


# ---------------------------------------------------------------------------------------------- the step


class _NoExchange(PartialsGather):
    """A gather that exchanges nothing: the layers in context-parallel mode then run their rank's attention alone
    (the step's attention part). Its output is not the layer's (nothing is merged). The layer calls a gather's
    ``exchange`` (its checks are the layer's own), so that is what is left out."""

    def exchange(self, sink, merged, merged_lse, family) -> None:
        pass


@dataclass
class Step:
    """One rank's decode step (``layout`` None and no gather: one process, the whole context)."""

    run: Callable[[], None]  # the metadata build and every layer
    attention: Callable[[], None] | None  # the same with every layer's exchange left out (None without a group)
    exchanges: Callable[[], None] | None  # every layer's exchange alone (collectives + merge / rescale)
    outs: dict[str, torch.Tensor]
    cache_bytes: int


def make_step(sizes: Sizes, case: tuple[int, int], cfg: ModelConfig, device: torch.device, backend: str, seed: int,
              layout: RankLayout | None, group: dist.ProcessGroup | None = None, comm: str = "allgather") -> Step:
    """The decode step of ``layout``'s rank in ``group`` (context parallel, exchange form ``comm``), or with
    ``layout`` None of one process holding every request's whole context. Caches of every kind filled with random
    latents, block tables in random order."""
    gen = torch.Generator().manual_seed(seed)
    b, ctx = case[0], case[1] + MTP_TOKENS
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
    kinds = model_layers(cfg, sizes.layers_per_kind)
    gather = silent = None
    if layout is not None:
        gather = PartialsGather(tokens, heads, device=device, group=group, comm=comm)
        silent = _NoExchange(tokens, heads, device=device, group=group, comm=comm)
    out_heads = heads if gather is None else gather.out_heads
    outs = {k: torch.empty(tokens, out_heads, 512, dtype=torch.bfloat16, device=device) for k in V4_KINDS}

    def layers_with(exchange: PartialsGather | None) -> Callable[[], None]:
        options = {} if exchange is None else {"context_parallel": exchange}

        def step() -> None:
            build()
            for kind in kinds:
                layers[kind](q[kind], meta, caches, picks if kind == "c4a" else None, out=outs[kind], **options)
        return step

    exchanges = None
    if gather is not None:
        layers_with(gather)()  # the partials of the last layer stay in the gather's buffers: the exchanges reuse them

        def exchanges() -> None:
            for kind in kinds:
                gather(gather.out_partial, gather.lse_partial, sinks[kind], merged=outs[kind],
                       merged_lse=gather.merged_lse, backend=backend)
    return Step(layers_with(gather), None if silent is None else layers_with(silent), exchanges, outs,
                sum(c.data.nbytes for c in caches.values()))


# ---------------------------------------------------------------------------------------------- timing


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step_ms(fn: Callable[[], None], sizes: Sizes, device: torch.device, group: dist.ProcessGroup | None) -> float:
    """Milliseconds per call of ``fn``: ``sizes.iters`` calls back to back, timed by CUDA events (wall clock on the
    CPU), the median of ``sizes.rounds``. With ``group``, every rank of it runs this at once: each round starts at
    a barrier, and every rank makes the same calls (``fn``'s collectives match)."""
    fn()  # warm-up
    samples = []
    for _ in range(sizes.rounds):
        _sync(device)
        if group is not None:
            dist.barrier(group=group)
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


def time_step(step: Step, sizes: Sizes, device: torch.device, group: dist.ProcessGroup | None) -> dict:
    """The step's times, ms: eager, and on a GPU graph-replayed; its attention part and communication part (graphs
    on a GPU, eager on the CPU; the one-GPU step's attention is the whole step)."""
    gpu = device.type == "cuda"
    wrap = (lambda fn: graphed(fn, device)) if gpu else (lambda fn: fn)
    row = {"eager_ms": step_ms(step.run, sizes, device, group)}
    whole = step_ms(wrap(step.run), sizes, device, group) if gpu else row["eager_ms"]
    if gpu:
        row["graph_ms"] = whole
    if step.exchanges is None:
        row["attention_ms"], row["communication_ms"] = whole, 0.0
    else:
        row["attention_ms"] = step_ms(wrap(step.attention), sizes, device, group)
        row["communication_ms"] = step_ms(wrap(step.exchanges), sizes, device, group)
    step.run()
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


def _memory(cfg: ModelConfig, sizes: Sizes, budget: float | None) -> dict:
    """The longest context per request on each world of the run, for each case's batch and for one request, from
    the cache budget per GPU (``--cache-gib``, or the GPU's free memory at the start of the run less what the first
    context-parallel step used beside its caches); weights and activations are not counted. Both bytes-per-token
    readings of :func:`model_bytes_per_token`."""
    if budget is None:
        return {"budget_bytes": None}
    per_token = model_bytes_per_token(cfg)
    batches = sorted({b for b, _ in sizes.cases} | {1})
    longest = {f"{reading}_b{b}_{w}gpu": longest_context(budget, per_token[reading], b, w)
               for reading in per_token for b in batches for w in sizes.worlds}
    return dict(budget_bytes=budget, bytes_per_token=per_token, longest_context=longest)


# ---------------------------------------------------------------------------------------------- ranks


def _one_gpu(sizes: Sizes, case: tuple[int, int], cfg: ModelConfig, device: torch.device, backend: str,
             seed: int) -> dict:
    """The step on one GPU holding every request's whole context, where its caches fit the free memory."""
    ctx = case[1] + MTP_TOKENS
    need = sum(case[0] * RankLayout(1, 0).blocks_needed(ctx, k) * block_bytes(cfg.kv_format, DEFAULT_BLOCK_SIZE[k],
                                                                              cfg.head_dim) for k in V4_KINDS)
    if device.type == "cuda" and need > 0.9 * torch.cuda.mem_get_info(device)[0]:
        return {"fits": False, "cache_bytes_per_gpu": need}
    step = make_step(sizes, case, cfg, device, backend, seed, None)
    row = time_step(step, sizes, device, None)
    row.update(fits=True, cache_bytes_per_gpu=step.cache_bytes)
    return row


def _rank(rank: int, args: argparse.Namespace, sizes: Sizes, port: int, result_path: str) -> None:
    """One process: for each case, the one-GPU step (rank 0), then each world's context-parallel step in each
    exchange form (ranks below the world; the others wait at the barrier)."""
    gpu = not args.smoke
    device = torch.device("cuda", rank) if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(device)
        warm_up_gpu(1.0)
    dist.init_process_group("nccl" if gpu else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=sizes.procs, timeout=timedelta(minutes=10))
    try:
        cfg = sizes.model()
        backend = "auto" if gpu else "reference"
        free_at_start = torch.cuda.mem_get_info(device)[0] if gpu else None
        # every process takes part in making every group (torch.distributed's rule), members or not
        groups = {w: dist.new_group(list(range(w))) for w in sizes.worlds if w > 1}
        rows, budget = [], args.cache_gib * GIB if args.cache_gib is not None else None
        for case in sizes.cases:
            if 1 in sizes.worlds and rank == 0:
                rows.append(dict(batch=case[0], context=case[1], world=1, comm=None,
                                 ranks=[_one_gpu(sizes, case, cfg, device, backend, args.seed)]))
                _release(gpu)
            dist.barrier()
            for world, group in groups.items():
                for comm in sizes.comms:
                    if rank < world:
                        if gpu:
                            torch.cuda.reset_peak_memory_stats(device)  # the budget below: this step's peak
                        step = make_step(sizes, case, cfg, device, backend, args.seed,
                                         RankLayout.of_group(group), group, comm)
                        row = time_step(step, sizes, device, group)
                        row["cache_bytes_per_gpu"] = step.cache_bytes
                        if gpu and budget is None:
                            budget = free_at_start - (torch.cuda.max_memory_allocated(device) - step.cache_bytes)
                        per_rank = [None] * world
                        dist.all_gather_object(per_rank, row, group=group)
                        if rank == 0:
                            rows.append(dict(batch=case[0], context=case[1], world=world, comm=comm, ranks=per_rank))
                        del step
                        _release(gpu)
                    dist.barrier()
        if rank == 0:
            result = dict(sizes=asdict(sizes), model=cfg.name, heads=cfg.num_heads, topk=cfg.index_topk,
                          layers=len(model_layers(cfg, sizes.layers_per_kind)), kv_format=cfg.kv_format,
                          device=torch.cuda.get_device_name(device) if gpu else "cpu", torch=str(torch.__version__),
                          rows=rows, memory=_memory(cfg, sizes, budget))
            with open(result_path, "w") as f:
                json.dump(result, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _release(gpu: bool) -> None:
    """Give a finished measurement's caches and graphs back (the next one allocates its own)."""
    if gpu:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------- output


def summarize(result: dict) -> list[dict]:
    """Each row of the result with what the table shows: rank 0's eager / graph / communication times, the slowest
    rank's attention, and the ratios to the one-GPU step of the same case (attention, step; graph where measured,
    eager on the CPU) and of eager to graph."""
    one = {(r["batch"], r["context"]): r["ranks"][0] for r in result["rows"] if r["world"] == 1}
    out = []
    for r in result["rows"]:
        first = r["ranks"][0]
        if not first.get("fits", True):  # one GPU cannot hold the case: nothing timed
            out.append(dict(batch=r["batch"], context=r["context"], world=r["world"], comm=r["comm"], fits=False))
            continue
        step = first.get("graph_ms", first["eager_ms"])
        attention = max(rank["attention_ms"] for rank in r["ranks"])
        base = one.get((r["batch"], r["context"]))
        fits = base is not None and base.get("fits", True)
        base_step = base.get("graph_ms", base.get("eager_ms")) if fits else None
        out.append(dict(batch=r["batch"], context=r["context"], world=r["world"], comm=r["comm"],
                        eager_ms=first["eager_ms"], graph_ms=first.get("graph_ms"), attention_ms=attention,
                        communication_ms=first["communication_ms"],
                        attention_vs_1gpu=attention / base["attention_ms"] if fits else None,
                        step_vs_1gpu=step / base_step if fits else None,
                        eager_vs_graph=first["eager_ms"] / first["graph_ms"] if "graph_ms" in first else None,
                        finite=all(rank["finite"] for rank in r["ranks"]), fits=True))
    return out


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def results_table(result: dict) -> Table:
    table = Table(title=f"decode context parallelism — {result['model']}, {result['layers']} layers, "
                        f"{result['device']}",
                  caption="ms per step; attention = the slowest rank's step with every exchange left out; comm = "
                          "every layer's exchange alone (collectives + merge / rescale); ratios to one GPU's step "
                          "of the same case (graph; eager without a GPU)")
    for col in ("case", "GPUs", "exchange", "eager ms", "graph ms", "attention ms", "comm ms", "attention / 1 GPU",
                "step / 1 GPU", "eager / graph"):
        table.add_column(col, justify="right")
    for s in summarize(result):
        if not s["fits"]:
            table.add_row(f"B {s['batch']} × {s['context']:,}", str(s["world"]), "-", "does not fit")
            continue
        table.add_row(f"B {s['batch']} × {s['context']:,}", str(s["world"]), s["comm"] or "-", _ms(s["eager_ms"]),
                      _ms(s["graph_ms"]), _ms(s["attention_ms"]), _ms(s["communication_ms"]),
                      _ratio(s["attention_vs_1gpu"]), _ratio(s["step_vs_1gpu"]), _ratio(s["eager_vs_graph"]))
    return table


def _case(text: str) -> tuple[int, int]:
    """``B×context`` or ``BxCONTEXT`` (a ``K`` suffix: × 1024) -> (batch, context)."""
    try:
        batch, context = text.lower().replace("×", "x").split("x")
        scale = 1024 if context.endswith("k") else 1
        value = (int(batch), int(context.rstrip("k")) * scale)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a case is BATCHxCONTEXT (e.g. 8x512K), got {text!r}") from None
    if min(value) < 1:
        raise argparse.ArgumentTypeError(f"a case's batch and context must be positive, got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default=os.environ.get("OUT", "results"),
                        help="folder for bench_context_parallel.json")
    parser.add_argument("--worlds", type=positive_int, nargs="+", default=None,
                        help="GPU counts to measure (default: 1, 2 and 4, those the host has)")
    parser.add_argument("--cases", type=_case, nargs="+", default=None,
                        help="BATCHxCONTEXT cases (default: 8x512K 32x128K)")
    parser.add_argument("--comm", choices=COMM_FORMS, nargs="+", default=None,
                        help="exchange forms (default: both)")
    parser.add_argument("--layers-per-kind", type=positive_int, default=None,
                        help="the first N layers of each kind (default: every layer of V4-Flash, 43)")
    parser.add_argument("--iters", type=positive_int, default=10, help="steps per timing (default 10)")
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
    without the GPUs the largest world needs (unless ``--smoke``)."""
    console = Console(width=170)
    start = time.perf_counter()
    sizes = Sizes.of(args)
    if not args.smoke and torch.cuda.device_count() < sizes.procs:
        print(f"The context-parallel benchmark needs {sizes.procs} CUDA GPUs (found {torch.cuda.device_count()}). "
              f"On a CPU run it with --smoke (tiny sizes).", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        result_path = os.path.join(tmp, "result.json")
        mp.spawn(_rank, args=(args, sizes, _free_port(), result_path), nprocs=sizes.procs)
        with open(result_path) as f:
            result = json.load(f)
    result["smoke"] = args.smoke
    result["summary"] = summarize(result)
    path = os.path.join(args.out, "bench_context_parallel.json")
    save_result(path, result, start)
    return report(console, path, result, [results_table(result)])


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(_parser)
    raise SystemExit(run(_parser.parse_args()))
