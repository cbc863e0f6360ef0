"""The KV compressors of a DeepSeek-V4-Flash layer (issue 49): decode steps and a prefill chunk, per layer.

    python benchmarks/bench_compressor.py --out results/             # on a CUDA GPU (~1 min)
    python benchmarks/bench_compressor.py --smoke --out /tmp/smoke   # tiny sizes on the CPU

Cases, per layer (``KVCompressor.forward``: the compressor kernel, the cache insert, the state update):

* decode: B = 32 and 128 requests of 2 tokens (1 + 1 MTP draft) at contexts drawn from 4K-32K; a c4a layer (its
  512-d compressor into an ``fp8_v4`` cache and its indexer's 128-d compressor into the fp8 indexer key cache) and a
  c128a layer (512-d, ``fp8_v4``);
* prefill: one 4096-token chunk on a 8192-token prefix, the same layers.

Columns: GPU µs per layer (CUDA-graph replays, ``do_bench``; eager with ``--no-graphs``), host µs per call (the
Python launch path, GPU queue kept busy), at decode the share of the layer's attention time (one V4-Flash c4a /
c128a layer over the same batch, 64 heads, bench_step.py's step; goal: a step's compressors <= 10 %), the bytes
the call must move (each completed entry's window read once — kv and gate of its slots —, the latent and entry rows
written and read back by the insert, the cache records, the state rows) over the device-to-device copy rate measured
in the same run (the floor a memory-bound kernel can reach), and the plain-PyTorch path (the reference backend on
the same GPU tensors, eager).
"""
from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass

import torch
from rich.console import Console
from rich.table import Table

from sparse_mla.batch import Request, StepBatchBuilder, blocks_needed
from sparse_mla.cache import PagedCache
from sparse_mla.config import get_config
from sparse_mla.compress_metadata import build_compress_metadata
from sparse_mla.compress_state import CompressorStatePool
from sparse_mla.compress_state import window_slots
from sparse_mla.compressor import KVCompressor
from sparse_mla.formats import get_format
from sparse_mla.indexer_cache import FP8_ENTRY_BYTES, IndexerKeyCache

import bench_step  # this script's folder is first on sys.path
from harness import Env, main, positive_int, prepare, report, run_info, save_result
from timing import graphed, host_us, timed

# (name, ratio, [(part, dim)]) per V4-Flash compressed layer kind
LAYERS = [("c4a", 4, [("attention", 512), ("indexer", 128)]), ("c128a", 128, [("attention", 512)])]
ATTENTION_FORMAT = "fp8_v4"


@dataclass(frozen=True)
class Sizes:
    context: tuple[int, int]
    batches: tuple[int, ...]
    prefix: int
    chunk: int

    @staticmethod
    def of(smoke: bool) -> "Sizes":
        if smoke:
            return Sizes((130, 300), (2,), 256, 64)
        return Sizes((4096, 32768), (32, 128), 8192, 4096)


def copy_rate(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Device-to-device copy rate in bytes per second (read + written), from a ``nbytes`` copy."""
    if device.type != "cuda":
        nbytes = 1 << 24
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / (timed(lambda: dst.copy_(src)) * 1e-6)


class LayerStep:
    """One layer kind's compressors over one step: ``contexts[i]`` tokens of request i after the step, ``new``
    tokens each this step (the state holds the tokens before, random)."""

    def __init__(self, ratio: int, parts: list[tuple[str, int]], contexts: list[int], new: int, device, seed: int,
                 backend: str) -> None:
        gen = torch.Generator(device=device).manual_seed(seed)
        kind = {4: "c4a", 128: "c128a"}[ratio]
        bs = {"swa": 64, kind: 64 if ratio == 4 else 2}
        builder = StepBatchBuilder(new * len(contexts), len(contexts), max(contexts) + 1, kinds=("swa", kind),
                                   block_sizes=bs, decode_threshold=2, device=device)
        tables, first = [], {k: 0 for k in bs}
        for n in contexts:
            tables.append({k: list(range(first[k], first[k] + blocks_needed(n, k, bs[k]))) for k in bs})
            for k in bs:
                first[k] += blocks_needed(n, k, bs[k])
        self.pool = CompressorStatePool(ratio, len(contexts), device=device)
        slots = [self.pool.allocate() for _ in contexts]
        self.batch = builder.build([Request(n, new, t) for n, t in zip(contexts, tables)])
        self.parts = []
        for part, dim in parts:
            coff = 2 if ratio == 4 else 1
            weight = 1 + 0.1 * torch.randn(dim, generator=gen, device=device)
            ape = torch.randn(ratio, coff * dim, generator=gen, device=device)
            comps = {b: KVCompressor(self.pool, dim, weight, 1e-6, ape=ape, backend=b) for b in (backend, "reference")}
            for b, comp in comps.items():
                for ring in self.pool.layers[comp.layer]:
                    ring.copy_(torch.randn(ring.shape, generator=gen, device=device))
            cache = (PagedCache(first[kind], bs[kind], ATTENTION_FORMAT, device=device) if dim == 512
                     else IndexerKeyCache(first[kind], "fp8", device, bs[kind]))
            kv, score = (torch.randn(self.batch.num_tokens, coff * dim, generator=gen, device=device)
                         .to(torch.bfloat16) for _ in range(2))
            self.parts.append((part, dim, comps, cache, kv, score))
        # the prefixes, fed before (every compressor made first: their state is the random rings above)
        self.pool.advance(slots, [0] * len(contexts), [n - new for n in contexts])
        self.meta = build_compress_metadata(self.batch, self.pool, slots)
        self.ratio, self.kind = ratio, kind
        self.entries = int((self.meta.entry_positions >= 0).sum())

    def call(self, part: int, backend: str):
        """One call of part ``part``'s compressor, to be timed again and again: a step longer than
        ``REPEATABLE_STEP_TOKENS`` a request runs once (its state writes overwrite positions it reads), so each
        call first marks the step not run yet (the repeats' entries are not checked, their work is the same)."""
        _, _, comps, cache, kv, score = self.parts[part]
        comp, meta = comps[backend], self.meta

        def run() -> None:
            comp._last_step = meta.step - 1
            comp.forward(kv, score, meta, cache)

        return run

    def bytes_moved(self, part: int) -> int:
        """What one call must read and write (see the module docstring)."""
        _, dim, comps, cache, kv, _ = self.parts[part]
        rows, width = kv.shape
        record = get_format(ATTENTION_FORMAT).token_bytes if dim == 512 else FP8_ENTRY_BYTES
        window = self.entries * window_slots(self.ratio) * dim * 2 * 2  # kv and gate of each slot, bf16
        rows_out = rows * dim * 2 * 2 + self.entries * dim * 2  # latent and entry rows; the insert reads entries
        state = min(rows, len(self.batch.seq_lens_host) * self.pool.ring) * width * 2 * 2  # kv and gate rows kept
        return window + rows_out + self.entries * record + state


def attention_us(env: Env[Sizes], contexts: list[int]) -> dict[str, float]:
    """GPU µs of one V4-Flash c4a and one c128a attention layer over the same decode batch (2 tokens a request):
    what the issue's goal compares the compressors with (bench_step.py's step, its layers and picks)."""
    cfg = get_config("deepseek-v4-flash")
    step = bench_step.make_step([(c, 2) for c in contexts], cfg, env.device, env.seed)
    layers = bench_step.make_layers(cfg, env)
    q = bench_step._queries(step, cfg.num_heads, env)
    out = {}
    for kind in ("c4a", "c128a"):
        dest = torch.empty_like(q[kind])

        def run(kind=kind, dest=dest) -> None:
            layers[kind](q[kind], step.meta, step.caches, step.picks if kind == "c4a" else None, out=dest)

        out[kind] = timed(graphed(run) if env.graphs else run, env.rep_ms)
    return out


def cases(env: Env[Sizes], rate: float) -> list[dict]:
    sizes, rows = env.sizes, []
    gen = torch.Generator().manual_seed(env.seed)
    shapes = [(f"decode B={b}", torch.randint(*sizes.context, (b,), generator=gen).tolist(), 2) for b in sizes.batches]
    shapes.append((f"prefill {sizes.chunk} on {sizes.prefix}", [sizes.prefix + sizes.chunk], sizes.chunk))
    for case, contexts, new in shapes:
        attention = attention_us(env, contexts) if new == 2 else {}
        for kind, ratio, parts in LAYERS:
            step = LayerStep(ratio, parts, contexts, new, env.device, env.seed, env.backend)
            for i, (part, dim, *_) in enumerate(step.parts):
                fast, plain = step.call(i, env.backend), step.call(i, "reference")
                gpu_us = timed(graphed(fast) if env.graphs else fast, env.rep_ms)
                nbytes = step.bytes_moved(i)
                row = dict(case=case, layer=kind, part=part, dim=dim, tokens=step.batch.num_tokens,
                           entries=step.entries, gpu_us=gpu_us, host_us=host_us(fast), bytes=nbytes,
                           copy_floor_us=nbytes / rate * 1e6, reference_us=timed(plain, env.rep_ms),
                           attention_us=attention.get(kind))
                env.console.log(f"{case} {kind} {part}: {gpu_us:.1f} us (copy floor {row['copy_floor_us']:.1f} us, "
                                f"plain PyTorch {row['reference_us']:.0f} us, host {row['host_us']:.0f} us, "
                                f"the layer's attention {row['attention_us'] or 0:.0f} us)")
                rows.append(row)
    return rows


def results_table(result: dict) -> Table:
    t = Table(title=f"Compressors per layer on {result['device']} (copy rate {result['copy_gbps']:.0f} GB/s)")
    for col in ("case", "layer", "part", "tokens", "entries", "GPU µs", "host µs", "MB moved", "copy floor µs",
                "× floor", "plain PyTorch µs", "speed-up", "% of attention"):
        t.add_column(col, justify="left" if col in ("case", "layer", "part") else "right")
    for r in result["rows"]:
        t.add_row(r["case"], r["layer"], r["part"], str(r["tokens"]), str(r["entries"]), f"{r['gpu_us']:.1f}",
                  f"{r['host_us']:.0f}", f"{r['bytes'] / 1e6:.2f}", f"{r['copy_floor_us']:.1f}",
                  f"{r['gpu_us'] / r['copy_floor_us']:.1f}", f"{r['reference_us']:.0f}",
                  f"{r['reference_us'] / r['gpu_us']:.0f}x",
                  f"{100 * r['gpu_us'] / r['attention_us']:.1f}" if r["attention_us"] else "")
    return t


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default=os.environ.get("OUT", "results"), help="folder for bench_compressor.json")
    parser.add_argument("--rep", type=positive_int, default=60, help="do_bench repetition time per timing, ms")
    parser.add_argument("--no-graphs", action="store_true", help="eager timings only")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU, reference backend, no graphs")


def make_env(args: argparse.Namespace, console: Console) -> Env[Sizes]:
    """The run's environment: the GPU with the default backend (graphs unless --no-graphs), or --smoke's CPU."""
    device, backend, graphs = (("cpu", "reference", False) if args.smoke else ("cuda", "auto", not args.no_graphs))
    return Env(torch.device(device), backend, None, graphs, args.rep, 1, Sizes.of(args.smoke), args.seed, console)


def run(args: argparse.Namespace) -> int:
    console, start = Console(width=170), time.perf_counter()
    env = prepare(args, console, "The compressor benchmark needs a CUDA GPU.", make_env)
    if env is None:
        return 2
    rate = copy_rate(env.device)
    result = dict(run_info(env), smoke=args.smoke, graphs=env.graphs, copy_gbps=rate / 1e9)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "bench_compressor.json")
    result["rows"] = cases(env, rate)
    save_result(path, result, start)
    return report(console, path, result, [results_table(result)])


if __name__ == "__main__":
    main(__doc__, add_arguments, run)
