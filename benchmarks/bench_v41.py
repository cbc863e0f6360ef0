"""DeepSeek-V4.1-Flash serving steps in V4.1's cache formats against the same steps in V4's (issue 36).

    python benchmarks/bench_v41.py --out results/                # on a CUDA GPU (~3 min)
    python benchmarks/bench_v41.py --smoke --out /tmp/smoke      # tiny sizes on the CPU

* Decode steps: every attention layer of V4.1-Flash (40 layers: 2 window-only ``swa``, 18 ``c2a``, 20 ``c1a``; 64
  heads, top-k 512), B requests of 2 tokens (1 + 1 MTP draft) with contexts drawn from 4K-32K. Each layer kind
  reads one window cache and one compressed cache shared by that kind's layers (V4.1 shares a compressed cache
  among the layers after each ``kv_source_layer_ids`` entry, and picks among those after each
  ``index_source_layer_ids`` entry: one cache and one picks tensor per kind stand for them). Cache formats, window /
  compressed: ``fp8_v4`` / ``fp8_v4`` (V4's 584-byte record, what engines keep for V4.1 off SM100), ``fp8_v41`` /
  ``fp8_v41`` (528 B) and ``fp8_v41`` / ``fp4_v41`` (288 B compressed); token-interleaved pages (``--planar``: the
  page-planar layout). A step is ``build_step_metadata`` + every layer; timed eagerly and as CUDA-graph replays
  (``do_bench``, the three formats alternating), after each step's outputs were compared with the V4-format step's
  (the formats quantise differently: the table shows the relative difference).
* Prefill: a 4096-token chunk on an 8192-token prefix, one c2a and one c1a layer (paged), each format.
* Memory: bytes per token of each format, and the longest context an 80 GB GPU's cache holds: V4.1-Flash keeps
  3 c2a caches (layers 2, 8, 14 write them) and 1 c1a cache (layer 20), ``2.5`` compressed entries per raw token,
  and a 128-token window per layer (a fixed ring per request, not per token); weights and the indexer's keys are
  not counted.

No FlashMLA side: its V4.1 kernels run on SM100 only. ``--smoke``: tiny sizes on the CPU, reference backend.
"""
from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass, replace
from typing import Callable

import torch
from rich.console import Console
from rich.table import Table

from sparse_mla.config import COMPRESS_RATIO, V41_KINDS, get_config
from sparse_mla.formats import get_format
from sparse_mla.layer import SparseMLAAttention

import bench_step  # this script's folder is first on sys.path
from harness import Env, Step, main, positive_int, prepare, report, run_info, save_result
from timing import graphed, host_rounds, rel, timed_rounds

MODEL = "deepseek-v4.1-flash"
# (window format, compressed format) per column of the table; the first is the baseline
FORMATS = {"V4 fp8 (584 B)": ("fp8_v4", "fp8_v4"), "fp8_v41 (528 B)": ("fp8_v41", "fp8_v41"),
           "fp8_v41 + fp4_v41 (288 B)": ("fp8_v41", "fp4_v41")}
GPU_BYTES = 80e9


@dataclass(frozen=True)
class Sizes:
    context: tuple[int, int]
    batches: tuple[int, ...]
    heads: int | None
    topk: int | None
    layers: int | None  # None: every layer of the model; else the first of each kind
    prefix: int
    chunk: int

    @staticmethod
    def of(smoke: bool) -> "Sizes":
        if smoke:
            return Sizes((256, 1024), (2,), 4, 64, 1, 160, 32)
        return Sizes((4096, 32768), (32, 128), None, None, None, 8192, 4096)


def _layout(fmt: str, planar: bool) -> str:
    """The format name in the requested page layout (V4's fp8_v4 has one layout)."""
    return f"{fmt}_planar" if planar and fmt.endswith("_v41") else fmt


def make_step(lengths: list[tuple[int, int]], formats: tuple[str, str], topk: int, device: torch.device, seed: int,
              decode_threshold: int = bench_step.MTP_TOKENS) -> tuple[Step, dict[str, torch.Tensor]]:
    """:func:`bench_step.make_step` over V4.1-Flash's kinds in ``formats`` (window cache, compressed caches), and the
    indexer's picks per picks kind (c2a: the step's; c1a: its own), as V4.1's layers reuse one indexer's picks."""
    cfg = replace(get_config(MODEL), index_topk=topk)
    step = bench_step.make_step(lengths, cfg, device, seed, kinds=V41_KINDS, formats=formats,
                                decode_threshold=decode_threshold)
    gen = torch.Generator().manual_seed(seed + 1)
    picks = {"c2a": step.picks, "c1a": bench_step.step_picks(step.batch, topk, "c1a", step.batch.max_model_len, gen)}
    return step, picks


def make_layers(heads: int, topk: int, window: int, scale: float, backend: str, device: torch.device, seed: int,
                **options) -> dict[str, SparseMLAAttention]:
    """One layer per V4.1 kind, random sinks (seeded)."""
    gen = torch.Generator().manual_seed(seed + 7)
    return {kind: SparseMLAAttention(kind, heads, 512, window, topk=topk if kind != "swa" else None, scale=scale,
                                     sink=torch.randn(heads, generator=gen).to(device), backend=backend, **options)
            for kind in V41_KINDS}


def decode_step(step: Step, picks: dict[str, torch.Tensor], layers: dict, kinds: list[str], q: torch.Tensor,
                outs: dict) -> Callable[[], None]:
    """The decode step: the metadata build, then every layer in model order."""
    def run() -> None:
        step.build()
        for kind in kinds:
            layers[kind](q, step.meta, step.caches, picks.get(kind), out=outs[kind])
    return run


def decode_cases(env: Env[Sizes], planar: bool) -> list[dict]:
    """Per batch size: the V4.1-Flash decode step in each of :data:`FORMATS`, compared, then timed alternating."""
    cfg = get_config(MODEL)
    heads, topk = env.sizes.heads or cfg.num_heads, env.sizes.topk or cfg.index_topk
    kinds = [cfg.layer_kind(i) for i in range(cfg.num_layers)]
    if env.sizes.layers is not None:
        kinds = [k for i, k in enumerate(kinds) if kinds[:i].count(k) < env.sizes.layers]
    rows = []
    for batch in env.sizes.batches:
        gen = torch.Generator().manual_seed(env.seed + batch)
        lo, hi = env.sizes.context
        contexts = torch.randint(lo, hi + 1, (batch,), generator=gen).tolist()
        layers = make_layers(heads, topk, cfg.window, cfg.softmax_scale, env.backend, env.device, env.seed)
        runs, outs_by_fmt = [], {}
        for name, formats in FORMATS.items():
            formats = tuple(_layout(f, planar) for f in formats)
            env.console.log(f"V4.1-Flash B {batch}, {name}: {len(kinds)} layers, building caches")
            step, picks = make_step([(c, bench_step.MTP_TOKENS) for c in contexts], formats, topk, env.device, env.seed)
            q_gen = torch.Generator().manual_seed(env.seed + 11)  # the same queries for every format
            q = (torch.randn(step.batch.token_capacity, heads, 512, generator=q_gen) * 0.5).to(torch.bfloat16)
            q = q.to(env.device)
            outs = {kind: torch.empty_like(q) for kind in V41_KINDS}
            run = decode_step(step, picks, layers, kinds, q, outs)
            run()
            runs.append(run)
            outs_by_fmt[name] = (outs, step)
        base = next(iter(FORMATS))
        row = dict(batch=batch, layers=len(kinds), layer_kinds={k: kinds.count(k) for k in V41_KINDS},
                   context=dict(min=min(contexts), max=max(contexts)), formats={})
        for name in FORMATS:
            row["formats"][name] = dict(
                rel_diff_vs_v4={k: rel(outs_by_fmt[name][0][k], outs_by_fmt[base][0][k]) for k in V41_KINDS},
                finite=all(bool(torch.isfinite(o).all()) for o in outs_by_fmt[name][0].values()))
        env.console.log(f"V4.1-Flash B {batch}: timing")
        eager = timed_rounds(runs, env.rep_ms, env.rounds)
        graph = timed_rounds([graphed(r) for r in runs], env.rep_ms, env.rounds) if env.graphs else [None] * len(runs)
        host = host_rounds(runs, 10)
        for name, e, g, h in zip(FORMATS, eager, graph, host):
            row["formats"][name].update(eager_us=e, graph_us=g, step_host_us=h)
        rows.append(row)
        del runs, outs_by_fmt
        if env.device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def prefill_cases(env: Env[Sizes], planar: bool) -> list[dict]:
    """A chunk of ``env.sizes.chunk`` tokens on a prefix of ``env.sizes.prefix``, one c2a and one c1a layer (paged),
    each format: eager time of the layer call (prefill chunks run eagerly)."""
    cfg = get_config(MODEL)
    heads, topk = env.sizes.heads or cfg.num_heads, env.sizes.topk or cfg.index_topk
    layers = make_layers(heads, topk, cfg.window, cfg.softmax_scale, env.backend, env.device, env.seed,
                         prefill_mode="paged")
    rows = []
    seq = env.sizes.prefix + env.sizes.chunk
    for name, formats in FORMATS.items():
        formats = tuple(_layout(f, planar) for f in formats)
        step, picks = make_step([(seq, env.sizes.chunk)], formats, topk, env.device, env.seed, decode_threshold=1)
        gen = torch.Generator().manual_seed(env.seed + 3)
        q = (torch.randn(step.batch.token_capacity, heads, 512, generator=gen) * 0.5).to(torch.bfloat16)
        q = q.to(env.device)
        for kind in ("c2a", "c1a"):
            out = torch.empty_like(q)
            call = lambda kind=kind, out=out: layers[kind](q, step.meta, step.caches, picks[kind], out=out)  # noqa: E731
            call()
            us, = timed_rounds([call], env.rep_ms, env.rounds)
            rows.append(dict(format=name, kind=kind, chunk=env.sizes.chunk, prefix=env.sizes.prefix, us=us,
                             finite=bool(torch.isfinite(out).all())))
    return rows


def memory_rows() -> list[dict]:
    """Bytes per token of each format and the longest context per request (batch 1) an 80 GB cache holds."""
    cfg = get_config(MODEL)
    sources = {cfg.layer_kind(i) for i in cfg.kv_source_layer_ids}
    per_raw = sum(1 / COMPRESS_RATIO[cfg.layer_kind(i)] for i in cfg.kv_source_layer_ids)  # 3 x 1/2 + 1 x 1
    rows = []
    for name, (window, compressed) in FORMATS.items():
        entry = get_format(compressed).token_bytes
        ring = cfg.window * cfg.num_layers * get_format(window).token_bytes  # per request, whatever its length
        per_token = per_raw * entry
        rows.append(dict(format=name, window_bytes=get_format(window).token_bytes, compressed_bytes=entry,
                         compressed_kinds=sorted(sources), bytes_per_raw_token=per_token, window_ring_bytes=ring,
                         longest_context_80gb=int((GPU_BYTES - ring) // per_token)))
    return rows


def results_tables(result: dict) -> list[Table]:
    base = next(iter(FORMATS))
    decode = Table(title=f"V4.1-Flash decode step — {result['device']}",
                   caption="ms per step (graph replay; eager in brackets); diff = rel. difference of the outputs "
                           "from the V4-format step's (quantisation); host = eager step host µs")
    decode.add_column("B", justify="right")
    for name in FORMATS:
        decode.add_column(name, justify="right")
    for r in result["decode"]:
        cells = []
        for name in FORMATS:
            f = r["formats"][name]
            g = f["graph_us"] if f["graph_us"] is not None else f["eager_us"]
            b = r["formats"][base]
            ratio = "" if name == base else f" = {g / (b['graph_us'] or b['eager_us']):.2f}x"
            cells.append(f"{g / 1000:.2f}{ratio} ({f['eager_us'] / 1000:.2f}), diff "
                         f"{max(f['rel_diff_vs_v4'].values()):.1e}")
        decode.add_row(str(r["batch"]), *cells)
    prefill = Table(title="V4.1 prefill chunk, one layer (paged), ms")
    for col in ("layer", *FORMATS):
        prefill.add_column(col, justify="right")
    us = {(p["kind"], p["format"]): p["us"] for p in result["prefill"]}
    for kind in ("c2a", "c1a"):
        prefill.add_row(kind, *[f"{us[kind, n] / 1000:.3f}" for n in FORMATS])
    memory = Table(title="cache bytes per token (V4.1-Flash: 2.5 compressed entries per raw token) and the longest "
                         "context per 80 GB (batch 1)")
    for col in ("format", "window B", "compressed B", "B per raw token", "longest context"):
        memory.add_column(col, justify="right")
    for m in result["memory"]:
        memory.add_row(m["format"], str(m["window_bytes"]), str(m["compressed_bytes"]),
                       f"{m['bytes_per_raw_token']:.0f}", f"{m['longest_context_80gb']:,}")
    return [memory, prefill, decode]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default=os.environ.get("OUT", "results"), help="folder for bench_v41.json")
    parser.add_argument("--rep", type=positive_int, default=60, help="do_bench repetition time per timing, ms")
    parser.add_argument("--rounds", type=positive_int, default=3, help="alternating timing rounds (median)")
    parser.add_argument("--planar", action="store_true", help="V4.1's formats in the page-planar layout")
    parser.add_argument("--no-graphs", action="store_true", help="eager timings only")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU, reference backend, no graphs")


def run(args: argparse.Namespace) -> int:
    console = Console(width=170)
    start = time.perf_counter()

    def make_env(args: argparse.Namespace, console: Console) -> Env[Sizes]:
        if args.smoke:
            return Env(torch.device("cpu"), "reference", None, False, args.rep, 1, Sizes.of(True), args.seed, console)
        return Env(torch.device("cuda"), "auto", None, not args.no_graphs, args.rep, args.rounds, Sizes.of(False),
                   args.seed, console)

    env = prepare(args, console, "The V4.1 benchmark needs a CUDA GPU.", make_env)
    if env is None:
        return 2
    result = dict(run_info(env), smoke=args.smoke, planar=args.planar, graphs=env.graphs, memory=memory_rows())
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "bench_v41.json")
    result["prefill"] = prefill_cases(env, args.planar)
    save_result(path, result, start)
    result["decode"] = decode_cases(env, args.planar)
    save_result(path, result, start)
    return report(console, path, result, results_tables(result))


if __name__ == "__main__":
    main(__doc__, add_arguments, run)
