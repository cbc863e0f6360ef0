"""DeepSeek-V3.2 (``dsa`` layers) against FlashMLA's V3.2 kernels on a CUDA GPU (issue 16).

    python benchmarks/bench_v32.py --out results/                # ~3 min on an H100; flash_mla optional
    python benchmarks/bench_v32.py --smoke --out /tmp/smoke      # tiny sizes on the CPU, reference backend

Three parts, JSON to ``--out/bench_v32.json``, one table each, printed last:

1. ``decode``: one dsa layer on V3.2's production shapes: 32K-token contexts, ``fp8_v32`` (656 B) paged
   cache (block 64), 576-d absorbed queries, top-k 2048, batch 64/128/148, s_q 1 and 2, h_q 128 and the
   tensor-parallel shards 16 and 32 (FlashMLA takes 64 or 128 heads: its queries are zero-padded to 64
   and it is timed on the padded heads). Ours: ``SparseMLAAttention("dsa")`` (converts the picks with
   ``meta.dsa_indices`` inside); FlashMLA: ``meta.dsa_indices`` + ``flash_mla_with_kvcache`` on the same
   cache and slots, one scheduler object per case. Both as CUDA-graph replays, alternating.
2. ``prefill``: a 4096-token chunk (at the start of a prompt and at the end of a 32K one), ours
   paged-direct and workspace vs FlashMLA's path as vLLM runs it: the request's keys dequantised into
   a bf16 workspace (``dequantize_and_gather``), then ``flash_mla_sparse_fwd`` (d_qk 576) with the
   picks (request-local positions) as workspace rows. Eager, alternating.
3. ``step``: a whole 61-layer V3.2 decode step (``build_step_metadata`` + every layer, one cache and one
   set of picks shared by the layers), B 128 x 2 tokens, h_q 128, eager and as a CUDA graph.

The indexer's picks: per token ``min(topk, pos + 1)`` distinct positions ``<= pos``, then -1.
"""
from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass
from types import ModuleType
from typing import Callable

import torch
from rich.console import Console
from rich.table import Table

from sparse_mla.batch import Request, StepBatchBuilder, blocks_needed, slots_of
from sparse_mla.cache import PagedCache
from sparse_mla.config import DEFAULT_BLOCK_SIZE, get_config
from sparse_mla.layer import SparseMLAAttention
from sparse_mla.metadata import MetadataSpec, build_step_metadata
from sparse_mla.ops import dequantize_and_gather

from harness import Env, Step, fill_random, flash_mla_side, main, positive_int, prepare, report, run_info, save_result
from timing import graphed, host_rounds, load_flash_mla, rel, timed_rounds

D_QK, D_V, BLOCK = 576, 512, DEFAULT_BLOCK_SIZE["dsa"]
CFG = get_config("deepseek-v3.2")
PARTS = ("decode", "prefill", "step")


@dataclass(frozen=True)
class Sizes:
    """Sizes of a run: V3.2's production shapes on a GPU, tiny under ``--smoke``."""

    context: int  # decode contexts (every request)
    topk: int
    prefixes: tuple[int, ...]  # prefill: cached tokens before the chunk
    chunk: int
    step_batch: int
    step_layers: int
    step_heads: int
    kv_format: str  # the smoke run's bf16 keeps the CPU reference fast
    host_calls: int

    @staticmethod
    def of(smoke: bool) -> "Sizes":
        if smoke:
            return Sizes(256, 64, (0, 96), 32, 2, 3, 4, "bf16", 1)
        # the preset's last layer is the MTP layer: a step runs the model's 61
        return Sizes(32768, CFG.index_topk, (0, 32768 - 4096), 4096, 128, CFG.num_layers - 1, CFG.num_heads,
                     CFG.kv_format, 50)


@dataclass
class Pool:
    """A paged dsa cache of ``len(tables)`` requests of ``seq_len`` tokens, random latents, blocks shuffled."""

    cache: PagedCache
    tables: list[list[int]]
    seq_len: int


def make_pool(num_requests: int, seq_len: int, env: Env[Sizes], seed: int) -> Pool:
    """A cache holding ``num_requests`` requests of ``seq_len`` tokens (every slot written)."""
    per_request = blocks_needed(seq_len, "dsa")
    cache = PagedCache(num_requests * per_request, BLOCK, env.sizes.kv_format, D_QK, env.device)
    fill_random(cache, torch.Generator(device=env.device).manual_seed(seed))
    blocks = torch.randperm(cache.num_blocks, generator=torch.Generator().manual_seed(seed))
    return Pool(cache, [b.tolist() for b in blocks.split(per_request)], seq_len)


def dsa_picks(positions: torch.Tensor, topk: int, max_len: int, gen: torch.Generator) -> torch.Tensor:
    """Picks as a V3.2 indexer returns them: per token ``min(topk, pos + 1)`` distinct request-local positions
    ``<= pos``, then -1 (``-1`` rows for padding). positions ``(T,)`` int32; returns ``(T, topk)`` int32."""
    j = torch.arange(max_len, device=positions.device)
    scores = torch.rand(positions.shape[0], max_len, generator=gen, device=positions.device)
    scores.masked_fill_(j[None, :] > positions[:, None], -1.0)
    vals, idx = scores.topk(min(topk, max_len), dim=1)
    picks = torch.where(vals >= 0, idx, -1).to(torch.int32)
    return torch.nn.functional.pad(picks, (0, topk - picks.shape[1]), value=-1)


def make_step(pool: Pool, num_requests: int, query_len: int, env: Env[Sizes], seed: int) -> Step:
    """A step of the pool's first ``num_requests`` requests, ``query_len`` new tokens each (2 or fewer: decode)."""
    requests = [Request(pool.seq_len, query_len, {"dsa": pool.tables[r]}) for r in range(num_requests)]
    builder = StepBatchBuilder(num_requests * query_len, num_requests, pool.seq_len, kinds=("dsa",),
                               decode_threshold=2, device=env.device, num_blocks={"dsa": pool.cache.num_blocks})
    batch = builder.build(requests)
    spec = MetadataSpec(topk=env.sizes.topk)
    gen = torch.Generator(device=env.device).manual_seed(seed)
    picks = dsa_picks(batch.positions, env.sizes.topk, pool.seq_len, gen)
    return Step(batch, spec, build_step_metadata(batch, spec), {"dsa": pool.cache}, picks)


def make_layer(heads: int, env: Env[Sizes], prefill_mode: str = "paged") -> SparseMLAAttention:
    return SparseMLAAttention("dsa", heads, head_dim=D_QK, topk=env.sizes.topk, scale=CFG.softmax_scale,
                              backend=env.backend, prefill_mode=prefill_mode)


def queries(tokens: int, heads: int, env: Env[Sizes], seed: int) -> torch.Tensor:
    """Random absorbed queries ``(tokens, heads, 576)`` bf16."""
    q = torch.randn(tokens, heads, D_QK, generator=torch.Generator().manual_seed(seed)) * 0.5
    return q.to(torch.bfloat16).to(env.device)


# ---------------------------------------------------------------------------------------------- FlashMLA


class FlashMLADecode:
    """FlashMLA's V3.2 sparse decode on a step's slots: ``meta.dsa_indices(picks)`` then
    ``flash_mla_with_kvcache`` with queries ``(B, s_q, H', 576)``, H' = the heads padded to 64 or 128 (zero
    queries, outside the timing), slots ``(B, s_q, topk)``, the 656-B cache ``(blocks, 64, 1, 656)``; no
    sink, no extra cache, no ``topk_length`` (slots past a token's picks are -1); its own scheduler object."""

    def __init__(self, flash_mla: ModuleType, step: Step, q: torch.Tensor, scale: float) -> None:
        batch = step.batch
        self.b, self.heads = batch.num_reqs, q.shape[1]
        self.s_q = batch.token_capacity // self.b
        if batch.num_decode_tokens != batch.token_capacity or self.b * self.s_q != batch.token_capacity:
            raise ValueError("FlashMLA's decode takes (B, s_q) queries: every request must decode s_q tokens")
        padded = 64 if self.heads <= 64 else 128
        pad = torch.zeros(q.shape[0], padded - self.heads, D_QK, dtype=q.dtype, device=q.device)
        self.q = torch.cat([q, pad], 1).view(self.b, self.s_q, padded, D_QK)
        self.fm, self.step, self.scale = flash_mla, step, scale
        self.sched = flash_mla.get_mla_metadata()[0]

    def __call__(self) -> torch.Tensor:
        """One layer; returns ``(B, s_q, H', 512)`` bf16."""
        slots, _ = self.step.meta.dsa_indices(self.step.picks)
        return self.fm.flash_mla_with_kvcache(
            self.q, self.step.caches["dsa"].data.unsqueeze(2), None, None, D_V, self.sched, None, self.scale, False,
            True, slots.view(self.b, self.s_q, -1), None, use_legacy=True)[0]

    def output(self) -> torch.Tensor:
        """The real heads' output as ours returns it: ``(T, H, 512)``."""
        return self()[:, :, : self.heads].reshape(-1, self.heads, D_V)


class FlashMLAPrefill:
    """FlashMLA's V3.2 prefill as vLLM runs it, for a step of one prefill request: its ``seq_len`` keys
    dequantised into a bf16 workspace ``(seq_len, 1, 576)`` (slots computed once per step), then
    ``flash_mla_sparse_fwd`` on ``q (n, H', 576)`` with the picks ``(n, 1, topk)`` as workspace rows."""

    def __init__(self, flash_mla: ModuleType, step: Step, q: torch.Tensor, scale: float) -> None:
        batch = step.batch
        if batch.num_reqs != 1 or batch.num_decodes:
            raise ValueError("the FlashMLA prefill path here takes a step of one prefill request")
        positions = torch.arange(batch.seq_lens_host[0], dtype=torch.int32, device=batch.device)
        self.slots = slots_of(batch.block_tables["dsa"], torch.zeros_like(positions), positions, BLOCK)
        self.heads = q.shape[1]
        padded = 64 if self.heads <= 64 else 128
        self.q = torch.cat([q, q.new_zeros(q.shape[0], padded - self.heads, D_QK)], 1)
        self.idx = step.picks[: batch.num_tokens].unsqueeze(1)
        self.fm, self.step, self.scale = flash_mla, step, scale

    def __call__(self) -> torch.Tensor:
        """The chunk's attention ``(n, H', 512)`` bf16."""
        ws = dequantize_and_gather(self.step.caches["dsa"].data, self.slots)
        return self.fm.flash_mla_sparse_fwd(self.q, ws.unsqueeze(1), self.idx, self.scale, D_V, None, None,
                                            use_legacy=True)[0]


# ---------------------------------------------------------------------------------------------- parts


def _add_flash_mla(fns: dict[str, Callable[[], object]], row: dict, case: str, env: Env[Sizes],
                   set_up: Callable[[], Callable[[], object]]) -> None:
    """``fns["flashmla"]`` from :func:`harness.flash_mla_side` (nothing when it is not timed)."""
    fn = flash_mla_side(row, case, env, set_up)
    if fn is not None:
        fns["flashmla"] = fn


def _alternating(fns: dict[str, Callable[[], object]], env: Env[Sizes], graph: bool) -> dict[str, float]:
    """``{name}_us`` of each function, timed alternating (as CUDA-graph replays when ``graph``)."""
    run = [graphed(fn) if graph else fn for fn in fns.values()]
    return {f"{name}_us": t for name, t in zip(fns, timed_rounds(run, env.rep_ms, env.rounds))}


def decode_part(pool: Pool, batches: list[int], s_qs: list[int], heads_list: list[int], env: Env[Sizes]) -> list[dict]:
    """One dsa layer per (batch, s_q, heads): ours vs FlashMLA, outputs compared, graph replays timed."""
    rows = []
    for heads in heads_list:
        for b in batches:
            for s_q in s_qs:
                env.console.log(f"decode: h_q {heads}, batch {b}, s_q {s_q}")
                step = make_step(pool, b, s_q, env, seed=b * 10 + s_q)
                layer = make_layer(heads, env)
                q = queries(b * s_q, heads, env, seed=heads + b + s_q)
                out = torch.empty(b * s_q, heads, D_V, dtype=torch.bfloat16, device=env.device)
                fns = {"ours": lambda: layer(q, step.meta, step.caches, step.picks, out=out)}
                fns["ours"]()
                row = dict(heads=heads, batch=b, s_q=s_q, topk=env.sizes.topk, context=pool.seq_len)
                def set_up() -> FlashMLADecode:  # called at once, in this iteration
                    fm = FlashMLADecode(env.flash_mla, step, q, CFG.softmax_scale)
                    row.update(flashmla_heads=fm.q.shape[2], rel_err=rel(out, fm.output()))
                    row["ours_host_us"], row["flashmla_host_us"] = host_rounds([fns["ours"], fm],
                                                                               env.sizes.host_calls)
                    return fm

                _add_flash_mla(fns, row, f"decode h_q {heads} b {b} s_q {s_q}", env, set_up)
                if "ours_host_us" not in row:  # no FlashMLA: ours alone
                    row["ours_host_us"], = host_rounds([fns["ours"]], env.sizes.host_calls)
                row.update(_alternating(fns, env, env.graphs))
                if "flashmla_us" in row:
                    row["ratio"] = row["ours_us"] / row["flashmla_us"]
                rows.append(row)
    return rows


def prefill_part(heads: int, env: Env[Sizes]) -> list[dict]:
    """A chunk after each prefix: ours paged-direct and workspace vs FlashMLA's gather + sparse prefill."""
    rows = []
    for prefix in env.sizes.prefixes:
        chunk = env.sizes.chunk
        env.console.log(f"prefill: {chunk} tokens after {prefix}, h_q {heads}")
        pool = make_pool(1, prefix + chunk, env, seed=prefix + 1)
        step = make_step(pool, 1, chunk, env, seed=prefix + 2)
        q = queries(chunk, heads, env, seed=prefix + 3)
        outs, fns = {}, {}
        for mode in ("paged", "workspace"):
            layer = make_layer(heads, env, mode)
            outs[mode] = torch.empty(chunk, heads, D_V, dtype=torch.bfloat16, device=env.device)
            fns[mode] = lambda layer=layer, out=outs[mode]: layer(q, step.meta, step.caches, step.picks, out=out)
            fns[mode]()
        row = dict(heads=heads, prefix=prefix, tokens=chunk, topk=env.sizes.topk,
                   rel_err_paged_vs_workspace=rel(outs["paged"], outs["workspace"]),
                   host_us=dict(zip(fns, host_rounds(list(fns.values()), min(10, env.sizes.host_calls)))))
        def set_up() -> FlashMLAPrefill:  # called at once, in this iteration
            fm = FlashMLAPrefill(env.flash_mla, step, q, CFG.softmax_scale)
            fm_out = fm()[:, :heads]
            row["rel_err"] = {mode: rel(out, fm_out) for mode, out in outs.items()}
            return fm

        _add_flash_mla(fns, row, f"prefill after {prefix}", env, set_up)
        row.update(_alternating(fns, env, graph=False))
        if "flashmla_us" in row:
            row.update({f"ratio_{mode}": row[f"{mode}_us"] / row["flashmla_us"] for mode in ("paged", "workspace")})
        rows.append(row)
    return rows


def step_part(pool: Pool, env: Env[Sizes]) -> list[dict]:
    """The whole V3.2 decode step (metadata build + every layer), ours vs FlashMLA, eager and graph."""
    b, layers, heads = env.sizes.step_batch, env.sizes.step_layers, env.sizes.step_heads
    env.console.log(f"step: {layers} layers, batch {b} x 2 tokens, h_q {heads}")
    step = make_step(pool, b, 2, env, seed=1)
    layer = make_layer(heads, env)
    q = queries(b * 2, heads, env, seed=2)
    out = torch.empty(b * 2, heads, D_V, dtype=torch.bfloat16, device=env.device)

    def ours() -> None:
        step.build()
        for _ in range(layers):
            layer(q, step.meta, step.caches, step.picks, out=out)

    fns = {"ours": ours}
    layer_host, build_host = host_rounds([lambda: layer(q, step.meta, step.caches, step.picks, out=out), step.build],
                                         env.sizes.host_calls)
    row = dict(layers=layers, batch=b, s_q=2, heads=heads, topk=env.sizes.topk, context=pool.seq_len,
               layer_host_us=layer_host, build_step_metadata_host_us=build_host)
    def set_up() -> Callable[[], None]:
        fm = FlashMLADecode(env.flash_mla, step, q, CFG.softmax_scale)
        fm()

        def flash() -> None:
            step.build()
            for _ in range(layers):
                fm()

        return flash

    _add_flash_mla(fns, row, "step", env, set_up)
    for graph in (False, True) if env.graphs else (False,):
        times = _alternating(fns, env, graph)
        mode = "graph" if graph else "eager"
        row.update({k.replace("_us", f"_{mode}_us"): v for k, v in times.items()})
        if "flashmla_us" in times:
            row[f"ratio_{mode}"] = times["ours_us"] / times["flashmla_us"]
    return [row]


# ---------------------------------------------------------------------------------------------- output


def _f(row: dict, key: str, fmt: str = ".1f") -> str:
    return format(row[key], fmt) if key in row else "-"


def tables(result: dict) -> list[Table]:
    """One table per part that ran."""
    out = []
    if result.get("decode"):
        timing = "graph replays" if result["graphs"] else "eager"
        t = Table(title=f"V3.2 decode, one dsa layer, {result['kv_format']}, {timing} — {result['device']}")
        for c in ("h_q", "FM h_q", "batch", "s_q", "ours us", "FlashMLA us", "ours/FM", "host us ours / FM", "rel err"):
            t.add_column(c, justify="right")
        for r in result["decode"]:
            t.add_row(str(r["heads"]), str(r.get("flashmla_heads", "-")), str(r["batch"]), str(r["s_q"]),
                      _f(r, "ours_us"), _f(r, "flashmla_us"), _f(r, "ratio", ".2f"),
                      f"{r['ours_host_us']:.0f} / {_f(r, 'flashmla_host_us', '.0f')}", _f(r, "rel_err", ".1e"))
        out.append(t)
    if result.get("prefill"):
        t = Table(title="V3.2 prefill chunk, one dsa layer, eager (FlashMLA: gather + flash_mla_sparse_fwd)")
        for c in ("h_q", "prefix", "tokens", "paged us", "workspace us", "FlashMLA us", "paged/FM", "workspace/FM",
                  "rel err paged / ws vs FM"):
            t.add_column(c, justify="right")
        for r in result["prefill"]:
            errs = r.get("rel_err")
            t.add_row(str(r["heads"]), str(r["prefix"]), str(r["tokens"]), _f(r, "paged_us", ".0f"),
                      _f(r, "workspace_us", ".0f"), _f(r, "flashmla_us", ".0f"), _f(r, "ratio_paged", ".2f"),
                      _f(r, "ratio_workspace", ".2f"),
                      f"{errs['paged']:.1e} / {errs['workspace']:.1e}" if errs else "-")
        out.append(t)
    if result.get("step"):
        t = Table(title="V3.2 decode step: build_step_metadata + every layer")
        for c in ("layers", "batch", "ours graph ms", "FM graph ms", "graph ours/FM", "ours eager ms", "FM eager ms",
                  "eager ours/FM", "host us / layer", "host us build"):
            t.add_column(c, justify="right")
        for r in result["step"]:
            ms = lambda k: f"{r[k] / 1e3:.2f}" if k in r else "-"  # noqa: E731
            t.add_row(str(r["layers"]), str(r["batch"]), ms("ours_graph_us"), ms("flashmla_graph_us"),
                      _f(r, "ratio_graph", ".2f"), ms("ours_eager_us"), ms("flashmla_eager_us"),
                      _f(r, "ratio_eager", ".2f"), f"{r['layer_host_us']:.0f}",
                      f"{r['build_step_metadata_host_us']:.0f}")
        out.append(t)
    return out


# ---------------------------------------------------------------------------------------------- entry points


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS)
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 128, 148], help="decode batch sizes")
    parser.add_argument("--s-q", type=int, nargs="+", default=[1, 2], help="decode tokens per request (1, 2)")
    parser.add_argument("--heads", type=int, nargs="+", default=[128, 32, 16],
                        help="decode h_q: 128 and the tensor-parallel shards")
    parser.add_argument("--prefill-heads", type=int, default=128)
    parser.add_argument("--rep", type=positive_int, default=60, help="do_bench repetition time per timing, ms")
    parser.add_argument("--rounds", type=positive_int, default=3, help="alternating timing rounds (median)")
    parser.add_argument("--no-flashmla", action="store_true")
    parser.add_argument("--out", default=os.environ.get("OUT", "results"))
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes on the CPU (bf16 cache, 4 and 2 heads, 3-layer step), reference backend, "
                             "no FlashMLA, no graphs")


def _env(args: argparse.Namespace, console: Console) -> Env[Sizes]:
    if args.smoke:
        args.batches, args.s_q, args.heads, args.prefill_heads = [2], [1, 2], [4, 2], 4
        return Env(torch.device("cpu"), "reference", None, False, args.rep, 1, Sizes.of(True), 0, console)
    return Env(torch.device("cuda"), "auto", None if args.no_flashmla else load_flash_mla(), True, args.rep,
               args.rounds, Sizes.of(False), 0, console)


def run(args: argparse.Namespace) -> int:
    """Run ``args.parts``; print the tables, write ``bench_v32.json``. Returns 2 without CUDA (unless --smoke)."""
    console = Console(width=160)
    start = time.perf_counter()
    env = prepare(args, console, "bench_v32 needs a CUDA GPU (FlashMLA's V3.2 kernels: Hopper and the sgl-flash-mla "
                  "wheel, optional).", _env)
    if env is None:
        return 2
    result = dict(run_info(env), kv_format=env.sizes.kv_format, smoke=args.smoke, graphs=env.graphs,
                  scale=CFG.softmax_scale)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "bench_v32.json")
    pool = None
    if {"decode", "step"} & set(args.parts):
        need = max(args.batches + ([env.sizes.step_batch] if "step" in args.parts else []))
        console.log(f"cache: {need} requests x {env.sizes.context} tokens, {env.sizes.kv_format}")
        pool = make_pool(need, env.sizes.context, env, seed=0)
    parts = dict(decode=lambda: decode_part(pool, args.batches, args.s_q, args.heads, env),
                 prefill=lambda: prefill_part(args.prefill_heads, env), step=lambda: step_part(pool, env))
    for part in args.parts:
        result[part] = parts[part]()
        save_result(path, result, start)
    return report(console, path, result, tables(result))


if __name__ == "__main__":
    main(__doc__, add_arguments, run)
