"""Whole DeepSeek-V4 serving steps (decode and prefill) through the layer API, ours vs FlashMLA (issue 15).

    python benchmarks/bench_step.py --out results/               # on a CUDA GPU, flash_mla optional (~4 min)
    python benchmarks/bench_step.py --smoke --out /tmp/smoke     # tiny sizes on the CPU
    sparse-mla bench [same options]                              # the same, from a source checkout

* Decode steps: every attention layer of V4-Flash (43 layers, 64 heads, top-k 512) or V4-Pro (61 layers,
  128 heads, top-k 1024), B requests of 2 tokens (1 + 1 MTP draft, ``decode_threshold=2``), contexts
  drawn from 4K-32K, fp8_v4 caches (one set per layer kind, shared by the layers of that kind), the
  indexer's c4a picks (``min(topk, visible)`` distinct visible entries per token, then -1). A step is
  ``build_step_metadata`` + every layer. Ours: :class:`SparseMLAAttention`. FlashMLA:
  ``flash_mla_with_kvcache`` fed the same metadata (SWA lists, c4a picks converted per layer by
  ``meta.c4a_indices``, c128a lists; per-request ``extra_topk_length`` = the max of its tokens' lengths;
  one scheduler object per layer kind, as it goes stale with other lengths).
* Prefill step: a 4096-token chunk on an 8192-token prefix, one c4a and one c128a layer; ours paged-direct
  and workspace; FlashMLA's path as vLLM runs it: ``dequantize_and_gather`` into the bf16 workspace,
  then ``flash_mla_sparse_fwd``.

Outputs are compared (ours vs FlashMLA, per layer kind) before anything is timed. Then eager and
CUDA-graph-replay times (``do_bench``, L2 flushed before each call), ours and FlashMLA alternating;
host time per layer call (GPU queue kept busy) and of ``build_step_metadata``; the step with
``batch_invariant=True`` layers when the layer takes that argument. One table, JSON and a PNG to ``--out``.
``--smoke``: tiny sizes on the CPU, reference backend, no FlashMLA, no graphs.
"""
from __future__ import annotations

import argparse
import inspect
import math
import os
import time
from dataclasses import dataclass, replace
from types import ModuleType
from typing import Callable

import torch
from rich.console import Console
from rich.table import Table

from sparse_mla.batch import Request, StepBatch, StepBatchBuilder, blocks_needed
from sparse_mla.cache import PagedCache
from sparse_mla.cli import parse_seed
from sparse_mla.config import COMPRESS_RATIO, DEFAULT_BLOCK_SIZE, PICKS_KINDS, V4_KINDS, ModelConfig, get_config
from sparse_mla.layer import SparseMLAAttention
from sparse_mla.indexer_cache import IndexerKeyCache
from sparse_mla.indexer_layer import SparseMLAIndexer
from sparse_mla.metadata import MetadataSpec, build_step_metadata
from sparse_mla.picks import convert_picks
from sparse_mla.scenario import random_picks
from sparse_mla.workspace import fill_workspace, shared_workspace, workspace_indices, workspace_plan

from harness import (Env, Step, fill_random, fill_random_keys, flash_mla_side, main, output_folder, positive_int,
                     prepare, report, run_info, save_result)
from timing import graphed, host_rounds, load_flash_mla, rel, timed_rounds

D_V = 512
MTP_TOKENS = 2  # tokens per decode request: 1 + 1 speculative (MTP) draft
INDEXER_HEADS = 64  # V4's indexer heads (index_n_heads)
MODELS = {"flash": "deepseek-v4-flash", "pro": "deepseek-v4-pro"}
DECODE_CASES = {f"{m}-b{b}": (m, b) for m in MODELS for b in (32, 128)}
PREFILL_CASES = {f"prefill-{m}": m for m in MODELS}
CASES = (*DECODE_CASES, *PREFILL_CASES)
# FlashMLA's sparse kernels take index widths in multiples of 64: max_model_len is rounded up so the
# c128a width ceil(max_model_len / 128) is one.
LEN_ALIGN = 128 * 64


@dataclass(frozen=True)
class Sizes:
    """The sizes a run uses: production on a GPU, tiny under ``--smoke``."""

    context: tuple[int, int]  # decode contexts drawn uniformly from [lo, hi]
    batch_div: int  # decode batch = case batch // batch_div
    prefix: int
    chunk: int
    heads: int | None  # None: the model's
    topk: int | None  # None: the model's
    layers_per_kind: int | None  # None: every layer of the model
    host_calls: int  # calls per host-time measurement
    kv_format: str | None  # None: the model's (fp8_v4); the smoke run's bf16 keeps the CPU reference fast

    @staticmethod
    def of(smoke: bool) -> "Sizes":
        if smoke:
            return Sizes((256, 1024), 16, 160, 32, 4, 64, 2, 1, "bf16")
        return Sizes((4096, 32768), 1, 8192, 4096, None, None, None, 50, None)

    def model(self, name: str) -> ModelConfig:
        """The preset ``name`` with this run's head count, top-k and cache format."""
        cfg = get_config(name)
        return replace(cfg, num_heads=self.heads or cfg.num_heads, index_topk=self.topk or cfg.index_topk,
                       kv_format=self.kv_format or cfg.kv_format)

# ---------------------------------------------------------------------------------------------- set-up


def model_layers(cfg: ModelConfig, per_kind: int | None) -> list[str]:
    """Kinds of the model's attention layers in order (the preset's last entry, the MTP layer, left out);
    with ``per_kind``, only the first ``per_kind`` layers of each kind."""
    kinds = [cfg.layer_kind(i) for i in range(cfg.num_layers - 1)]
    if per_kind is None:
        return kinds
    return [k for i, k in enumerate(kinds) if kinds[:i].count(k) < per_kind]

def make_step(lengths: list[tuple[int, int]], cfg: ModelConfig, device: torch.device, seed: int, *,
              kinds: tuple[str, ...] = V4_KINDS, formats: tuple[str, str] | None = None,
              decode_threshold: int = MTP_TOKENS) -> Step:
    """A step of requests ``(seq_len, query_len)`` (decodes first) over one cache per kind of ``kinds`` (V4's, or
    V4.1's), in ``cfg``'s format or ``formats`` (the window cache's, the compressed caches'), every slot written with
    random latents, blocks in random order; the indexer's picks of the first picks kind and the step's metadata.
    ``max_model_len`` is the longest request rounded up to :data:`LEN_ALIGN`."""
    gen = torch.Generator().manual_seed(seed)
    max_len = math.ceil(max(s for s, _ in lengths) / LEN_ALIGN) * LEN_ALIGN
    window_fmt, compressed_fmt = formats or (cfg.kv_format, cfg.kv_format)
    caches, tables = {}, {}
    for kind in kinds:
        need = [blocks_needed(s, kind) for s, _ in lengths]
        caches[kind] = PagedCache(sum(need) + 1, DEFAULT_BLOCK_SIZE[kind],
                                  window_fmt if kind == "swa" else compressed_fmt, cfg.head_dim, device)
        fill_random(caches[kind], torch.Generator(device=device).manual_seed(seed + len(tables)))
        blocks = torch.randperm(sum(need), generator=gen).split(need)
        tables[kind] = [b.tolist() for b in blocks]
    requests = [Request(s, q, {k: tables[k][i] for k in kinds}) for i, (s, q) in enumerate(lengths)]
    builder = StepBatchBuilder(sum(q for _, q in lengths), len(lengths), max_len, kinds=kinds,
                               decode_threshold=decode_threshold, device=device,
                               num_blocks={k: c.num_blocks for k, c in caches.items()})
    batch = builder.build(requests)
    spec = MetadataSpec(window=cfg.window, topk=cfg.index_topk)
    picks = step_picks(batch, cfg.index_topk, next(k for k in kinds if k in PICKS_KINDS), max_len, gen)
    return Step(batch, spec, build_step_metadata(batch, spec), caches, picks)


def step_picks(batch: StepBatch, topk: int, kind: str, max_len: int, gen: torch.Generator) -> torch.Tensor:
    """Indexer picks for the layers of picks kind ``kind``: ``min(topk, visible)`` distinct visible entries per token
    (on the batch's device)."""
    ratio = COMPRESS_RATIO[kind]
    return random_picks(batch.positions.cpu(), topk, gen, max_len // ratio, invisible=0, drop=0.0,
                        ratio=ratio).to(batch.device)


def make_layers(cfg: ModelConfig, env: Env[Sizes], **options) -> dict[str, SparseMLAAttention]:
    """One :class:`SparseMLAAttention` per V4 kind (random sinks, seeded), with extra layer ``options``."""
    gen = torch.Generator().manual_seed(env.seed + 7)
    heads = cfg.num_heads
    return {kind: SparseMLAAttention(kind, heads, cfg.head_dim, cfg.window,
                                     topk=cfg.index_topk if kind == "c4a" else None, scale=cfg.softmax_scale,
                                     sink=torch.randn(heads, generator=gen).to(env.device), backend=env.backend,
                                     **options)
            for kind in V4_KINDS}


def batch_invariant_supported() -> bool:
    """Whether :class:`SparseMLAAttention` takes ``batch_invariant`` (being added on main)."""
    return "batch_invariant" in inspect.signature(SparseMLAAttention.__init__).parameters


# ---------------------------------------------------------------------------------------------- FlashMLA


class FlashMLADecode:
    """FlashMLA's sparse decode fed a step's metadata: ``flash_mla_with_kvcache`` per layer, queries
    ``(B, s_q, H, 512)``, one scheduler object per layer kind (it is built by its first call and goes stale
    with other ``topk_length`` values), per-request ``extra_topk_length`` = the max of its tokens' lengths."""

    def __init__(self, flash_mla: ModuleType, step: Step, layers: dict[str, SparseMLAAttention]) -> None:
        batch = step.batch
        if batch.num_decode_tokens != batch.token_capacity or batch.num_tokens != batch.num_reqs * MTP_TOKENS:
            raise ValueError("FlashMLA's decode takes (B, s_q) queries: every request must decode "
                             f"{MTP_TOKENS} tokens and the batch must have no padding")
        self.fm, self.step, self.layers = flash_mla, step, layers
        self.b = batch.num_reqs
        self.sched = {kind: flash_mla.get_mla_metadata()[0] for kind in V4_KINDS}
        self.lengths = {kind: torch.empty(self.b, dtype=torch.int32, device=batch.device) for kind in ("c4a", "c128a")}

    def _per_request(self, rows: torch.Tensor) -> torch.Tensor:
        """``(T, ...)`` token rows as ``(B, s_q, ...)``."""
        return rows.view(self.b, MTP_TOKENS, *rows.shape[1:])

    def prepare(self) -> None:
        """Once per step, after the metadata build: the c128a lengths per request (shared by its layers)."""
        torch.amax(self._per_request(self.step.meta.c128a_lens), 1, out=self.lengths["c128a"])

    def call(self, kind: str, q: torch.Tensor, picks: torch.Tensor | None = None) -> torch.Tensor:
        """One layer of ``kind`` on ``q (T, H, 512)`` (c4a: with ``picks``, default the step's); returns
        ``(B, s_q, H, 512)`` bf16."""
        meta, caches, layer = self.step.meta, self.step.caches, self.layers[kind]
        extra = (None, None, None)
        if kind == "c4a":
            # per layer, as our c4a layer converts its picks (nothing to launch for the indexer's: indexer_picks)
            idx, lens = meta.c4a_indices(self.step.picks if picks is None else picks)
            torch.amax(self._per_request(lens), 1, out=self.lengths["c4a"])
            extra = (caches["c4a"].data.unsqueeze(2), self._per_request(idx), self.lengths["c4a"])
        elif kind == "c128a":
            extra = (caches["c128a"].data.unsqueeze(2), self._per_request(meta.c128a_indices), self.lengths["c128a"])
        return self.fm.flash_mla_with_kvcache(
            self._per_request(q), caches["swa"].data.unsqueeze(2), None, None, D_V, self.sched[kind], None,
            layer.scale, False, True, self._per_request(meta.swa_indices), layer.sink, extra[0], extra[1], None,
            extra[2], use_legacy=True)[0]


def flash_mla_prefill(flash_mla: ModuleType, step: Step, layer: SparseMLAAttention, q: torch.Tensor,
                      out: torch.Tensor) -> None:
    """FlashMLA's prefill path for the step's prefill tokens, as vLLM runs it: per workspace chunk (the plan
    our workspace mode uses), ``dequantize_and_gather`` into the shared bf16 workspace, then
    ``flash_mla_sparse_fwd`` on ``q (n, H, 512)``, workspace ``(rows, 1, 512)``, indices ``(n, 1, width)``."""
    meta, data = step.meta, {k: c.data for k, c in step.caches.items()}
    local = convert_picks(meta, step.picks, "c4a")[2] if layer.kind == "c4a" else None
    ws_all = shared_workspace(q.device, layer.workspace_bytes, layer.head_dim)
    for chunk in workspace_plan(meta, layer.kind, layer.workspace_bytes, layer.head_dim):
        ws = fill_workspace(ws_all, chunk, data)
        idx, _ = workspace_indices(meta, chunk, local)
        out[chunk.tokens] = flash_mla.flash_mla_sparse_fwd(
            q[chunk.tokens], ws.unsqueeze(1), idx.unsqueeze(1), layer.scale, D_V, layer.sink, None,
            use_legacy=True)[0]


# ---------------------------------------------------------------------------------------------- decode


def _contexts(batch: int, env: Env[Sizes]) -> list[int]:
    lo, hi = env.sizes.context
    gen = torch.Generator().manual_seed(env.seed + batch)
    return torch.randint(lo, hi + 1, (batch,), generator=gen).tolist()


def _queries(step: Step, heads: int, env: Env[Sizes]) -> dict[str, torch.Tensor]:
    """One random ``(T, heads, 512)`` bf16 query per kind (shared by the layers of that kind)."""
    gen = torch.Generator().manual_seed(env.seed + 11)
    t = step.batch.token_capacity
    return {kind: (torch.randn(t, heads, D_V, generator=gen) * 0.5).to(torch.bfloat16).to(env.device)
            for kind in V4_KINDS}


def our_step(step: Step, layers: dict[str, SparseMLAAttention], kinds: list[str], q: dict[str, torch.Tensor],
             outs: dict[str, torch.Tensor]) -> Callable[[], None]:
    """The decode step through our layers: the metadata build, then every layer in model order."""
    def run() -> None:
        step.build()
        for kind in kinds:
            layers[kind](q[kind], step.meta, step.caches, step.picks if kind == "c4a" else None, out=outs[kind])
    return run


def flash_mla_step(step: Step, fm: FlashMLADecode, kinds: list[str], q: dict[str, torch.Tensor]) -> Callable[[], None]:
    """The decode step through FlashMLA: the same metadata build, then every layer in model order."""
    def run() -> None:
        step.build()
        fm.prepare()
        for kind in kinds:
            fm.call(kind, q[kind])
    return run


def _step_times(fns: list[Callable[[], None]], env: Env[Sizes]) -> dict[str, list[float]]:
    """Eager and (with ``env.graphs``) graph-replay times, us, of ``fns`` timed alternating."""
    times = {"eager": timed_rounds(fns, env.rep_ms, env.rounds)}
    if env.graphs:
        times["graph"] = timed_rounds([graphed(fn) for fn in fns], env.rep_ms, env.rounds)
    return times


def indexer_picks(step: Step, cfg: ModelConfig, env: Env[Sizes]) -> torch.Tensor:
    """The c4a picks of the library's indexer on the step's current metadata (64 heads, random fp8 keys in a key cache
    that shares the c4a cache's blocks, random queries and weights). Its select also writes their conversion into
    the step's picks buffers, so a layer call with them launches no conversion (``PicksConversion.selected``) until
    the next metadata build."""
    dev = env.device
    cache = IndexerKeyCache(step.caches["c4a"].num_blocks, "fp8", device=dev)
    fill_random_keys(cache, torch.Generator(device=dev).manual_seed(env.seed + 13))
    gen = torch.Generator().manual_seed(env.seed + 17)
    t, heads = step.batch.token_capacity, INDEXER_HEADS
    q = torch.randn(t, heads, 128, generator=gen).to(dev, torch.bfloat16)
    w = torch.randn(t, heads, generator=gen).to(dev)
    return SparseMLAIndexer("c4a", heads, cfg.index_topk, backend=env.backend)(step.meta, q, w, cache)


def _host_times(step: Step, layers: dict[str, SparseMLAAttention], kinds: list[str], q: dict[str, torch.Tensor],
                outs: dict[str, torch.Tensor], calls: int, fm: FlashMLADecode | None,
                from_indexer: Callable[[], torch.Tensor] | None) -> tuple[dict[str, float], dict[str, float]]:
    """Host us of one call of each kind's layer and of the step's metadata build, and of FlashMLA's call of each
    kind (``fm``: None without FlashMLA), each kind's two sides timed alternating (:func:`host_rounds`); with
    ``from_indexer`` (it runs the library's indexer on the step's metadata and returns its picks), also a c4a call
    with those picks (``c4a_indexer_picks``: converted in the indexer's select, nothing converted per call)."""
    def call(kind: str, picks: torch.Tensor | None = None) -> list[Callable[[], object]]:
        picks = step.picks if picks is None else picks

        def ours() -> torch.Tensor:
            return layers[kind](q[kind], step.meta, step.caches, picks if kind == "c4a" else None, out=outs[kind])
        return [ours] + ([lambda: fm.call(kind, q[kind], picks)] if fm is not None else [])

    ours, theirs = {}, {}
    for kind in sorted(set(kinds)):
        ours[kind], *other = host_rounds(call(kind), calls)
        if other:
            theirs[kind] = other[0]
    if "c4a" in kinds and from_indexer is not None:
        ours["c4a_indexer_picks"], *other = host_rounds(call("c4a", from_indexer()), calls)
        if other:
            theirs["c4a_indexer_picks"] = other[0]
    ours["build_step_metadata"], = host_rounds([step.build], calls)  # (the last: a build ends the indexer's picks)
    return ours, theirs


def _batch_invariant(step: Step, cfg: ModelConfig, kinds: list[str], q: dict[str, torch.Tensor],
                     outs: dict[str, torch.Tensor], env: Env[Sizes]) -> dict | None:
    """The step with ``batch_invariant=True`` layers: times and each kind's rel err against the default
    layers' outputs ``outs`` (None when the layer does not take the argument)."""
    if not batch_invariant_supported():
        return None
    layers = make_layers(cfg, env, batch_invariant=True)
    bi_outs = {kind: torch.empty_like(o) for kind, o in outs.items()}
    run = our_step(step, layers, kinds, q, bi_outs)
    run()
    row = {"rel_err_vs_default": {k: rel(bi_outs[k], outs[k]) for k in sorted(set(kinds))}}
    row.update({f"{mode}_us": t[0] for mode, t in _step_times([run], env).items()})
    return row

def _warn_if_apart(errors: dict[str, float], case: str, env: Env[Sizes], tolerance: float = 1e-2) -> None:
    """Say so when ours and FlashMLA disagree past bf16 noise (the timings then compare different work)."""
    apart = {k: e for k, e in errors.items() if not e < tolerance}
    if apart:
        env.console.log(f"[red]{case}: ours and FlashMLA disagree: rel err {apart} (>= {tolerance:g})[/red]")


def decode_case(name: str, env: Env[Sizes]) -> dict:
    """One decode case (a model, a batch size): outputs compared, then timed. Returns its JSON row."""
    model, full_batch = DECODE_CASES[name]
    cfg = env.sizes.model(MODELS[model])
    heads = cfg.num_heads
    kinds = model_layers(cfg, env.sizes.layers_per_kind)
    contexts = _contexts(full_batch // env.sizes.batch_div, env)
    env.console.log(f"{name}: {len(kinds)} layers, {heads} heads, B {len(contexts)}, building caches")
    step = make_step([(c, MTP_TOKENS) for c in contexts], cfg, env.device, env.seed)
    layers = make_layers(cfg, env)
    q = _queries(step, heads, env)
    outs = {kind: torch.empty_like(q[kind]) for kind in V4_KINDS}
    ours = our_step(step, layers, kinds, q, outs)
    ours()
    row = dict(case=name, model=cfg.name, layers=len(kinds),
               layer_kinds={k: kinds.count(k) for k in sorted(set(kinds))},
               heads=heads, topk=cfg.index_topk, batch=len(contexts), tokens=step.batch.num_tokens,
               context=dict(min=min(contexts), max=max(contexts), mean=sum(contexts) / len(contexts)))

    fm_side: list[FlashMLADecode] = []  # FlashMLA's layer calls, when it runs

    def set_up() -> Callable[[], None]:
        fm = FlashMLADecode(env.flash_mla, step, layers)
        fm.prepare()
        row["rel_err"] = {k: rel(outs[k], fm.call(k, q[k]).reshape_as(outs[k])) for k in sorted(set(kinds))}
        _warn_if_apart(row["rel_err"], name, env)
        fm_side.append(fm)
        return flash_mla_step(step, fm, kinds, q)

    fns = [ours] + [fn for fn in (flash_mla_side(row, name, env, set_up),) if fn is not None]
    env.console.log(f"{name}: timing")
    row["host_us"], fm_host = _host_times(step, layers, kinds, q, outs, env.sizes.host_calls,
                                          fm_side[0] if fm_side else None, lambda: indexer_picks(step, cfg, env))
    if fm_host:
        row["flashmla_host_us"] = fm_host
    step_calls = max(1, env.sizes.host_calls // 5)  # an eager step launches every layer: fewer calls
    row["step_host_us"] = dict(zip(("ours", "flashmla"), host_rounds(fns, step_calls)))
    for mode, times in _step_times(fns, env).items():
        row[f"ours_{mode}_us"] = times[0]
        if len(times) > 1:
            row[f"flashmla_{mode}_us"] = times[1]
            row[f"ratio_{mode}"] = times[0] / times[1]
    row["batch_invariant"] = _batch_invariant(step, cfg, kinds, q, outs, env)
    return row


# ---------------------------------------------------------------------------------------------- prefill


def prefill_case(name: str, env: Env[Sizes]) -> list[dict]:
    """A prefill chunk on a cached prefix, one c4a and one c128a layer: ours paged-direct and workspace, and
    FlashMLA's gather + ``flash_mla_sparse_fwd``. Returns one JSON row per layer kind."""
    cfg = env.sizes.model(MODELS[PREFILL_CASES[name]])
    heads = cfg.num_heads
    prefix, chunk = env.sizes.prefix, env.sizes.chunk
    env.console.log(f"{name}: {chunk}-token chunk on a {prefix}-token prefix, {heads} heads")
    step = make_step([(prefix + chunk, chunk)], cfg, env.device, env.seed)
    q = (torch.randn(chunk, heads, cfg.head_dim, generator=torch.Generator().manual_seed(env.seed)) * 0.5)
    q = q.to(torch.bfloat16).to(env.device)
    rows = []
    for kind in ("c4a", "c128a"):
        modes = {mode: make_layers(cfg, env, prefill_mode=mode)[kind] for mode in ("paged", "workspace")}
        picks = step.picks if kind == "c4a" else None
        outs = {mode: torch.empty(chunk, heads, D_V, dtype=torch.bfloat16, device=env.device) for mode in modes}
        fns = {mode: (lambda layer=layer, out=outs[mode]: layer(q, step.meta, step.caches, picks, out=out))
               for mode, layer in modes.items()}
        for fn in fns.values():
            fn()
        row = dict(case=name, model=cfg.name, kind=kind, heads=heads, prefix=prefix, tokens=chunk,
                   host_us=dict(zip(modes, host_rounds([fns[mode] for mode in modes], min(10, env.sizes.host_calls)))),
                   rel_err_paged_vs_workspace=rel(outs["paged"], outs["workspace"]))

        def set_up() -> Callable[[], None]:  # called at once, in this iteration
            out, layer = torch.empty_like(outs["paged"]), modes["paged"]
            run = lambda: flash_mla_prefill(env.flash_mla, step, layer, q, out)  # noqa: E731
            run()
            row["rel_err"] = {mode: rel(outs[mode], out) for mode in modes}
            _warn_if_apart(row["rel_err"], f"{name} {kind}", env)
            return run

        fm = flash_mla_side(row, f"{name} {kind}", env, set_up)
        if fm is not None:
            fns["flashmla"] = fm
        row.update({f"{mode}_us": t for mode, t in zip(fns, timed_rounds(list(fns.values()), env.rep_ms, env.rounds))})
        if "flashmla_us" in row:
            row.update({f"ratio_{mode}": row[f"{mode}_us"] / row["flashmla_us"] for mode in modes})
        rows.append(row)
    row_build, = host_rounds([step.build], min(10, env.sizes.host_calls))
    for row in rows:
        row["build_step_metadata_host_us"] = row_build
    return rows


# ---------------------------------------------------------------------------------------------- output


def _ms(us: float | None) -> str:
    return "-" if us is None else f"{us / 1e3:.2f}"


def _pairs(values: dict[str, float] | None, fmt: str) -> str:
    return "-" if not values else " · ".join(f"{k} {format(v, fmt)}" for k, v in values.items())


def results_table(result: dict) -> Table:
    """One table: a row per decode case (whole step) and per prefill layer kind."""
    table = Table(title=f"sparse-mla step benchmark — {result['device']}",
                  caption="ms; decode: graph replay (eager in its own column); ratio = ours / FlashMLA; host µs "
                          "per layer call, meta = build_step_metadata")
    for col in ("case", "ours ms", "FlashMLA ms", "ours/FM", "eager ours / FM ms", "batch-inv ms", "host µs",
                "rel err vs FM"):
        table.add_column(col, justify="right")
    for r in result["decode"]:
        mode = "graph" if "ours_graph_us" in r else "eager"
        bi = r["batch_invariant"]
        host = dict(r["host_us"])
        host["meta"] = host.pop("build_step_metadata")
        table.add_row(f"{r['case']} ({r['layers']} layers, B {r['batch']})", _ms(r[f"ours_{mode}_us"]),
                      _ms(r.get(f"flashmla_{mode}_us")), f"{r[f'ratio_{mode}']:.2f}" if f"ratio_{mode}" in r else "-",
                      f"{_ms(r['ours_eager_us'])} / {_ms(r.get('flashmla_eager_us'))}",
                      _ms(bi.get(f"{mode}_us")) if bi else "n/a", _pairs(host, ".0f"), _pairs(r.get("rel_err"), ".1e"))
    for r in result["prefill"]:
        for mode in ("paged", "workspace"):
            table.add_row(f"{r['case']} {r['kind']} {mode}", _ms(r[f"{mode}_us"]), _ms(r.get("flashmla_us")),
                          f"{r[f'ratio_{mode}']:.2f}" if f"ratio_{mode}" in r else "-", "", "",
                          f"{r['host_us'][mode]:.0f}", f"{r['rel_err'][mode]:.1e}" if "rel_err" in r else "-")
    return table


def write_plot(result: dict, path: str, console: Console) -> None:
    """Bars of ours vs FlashMLA: decode step times (graph and eager) on the left, prefill layer times on the right."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        console.log("matplotlib is not installed: no plot (pip install matplotlib)")
        return
    decode = [(f"{r['case']}\n{mode}", r[f"ours_{mode}_us"], r.get(f"flashmla_{mode}_us"))
              for r in result["decode"] for mode in ("graph", "eager") if f"ours_{mode}_us" in r]
    prefill = [(f"{r['case']}\n{r['kind']} {mode}", r[f"{mode}_us"], r.get("flashmla_us"))
               for r in result["prefill"] for mode in ("paged", "workspace")]
    panels = [(title, bars) for title, bars in (("decode step", decode), ("prefill layer", prefill)) if bars]
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(max(6, 1.2 * (len(decode) + len(prefill))), 4.5),
                             squeeze=False)
    for ax, (title, bars) in zip(axes[0], panels):
        x = range(len(bars))
        ax.bar([i - 0.2 for i in x], [b[1] / 1e3 for b in bars], 0.4, label="sparse-mla")
        ax.bar([i + 0.2 for i in x], [(b[2] or 0) / 1e3 for b in bars], 0.4, label="FlashMLA")
        ax.set_xticks(list(x), [b[0] for b in bars], fontsize=7)
        ax.set_ylabel("ms")
        ax.set_title(f"{title}, {result['device']}")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------- entry points


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark's command-line options."""
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES,
                        help="cases to run (default: all): decode steps <model>-b<batch>, prefill-<model>")
    parser.add_argument("--out", type=output_folder, default=os.environ.get("OUT", "results"),
                        help="folder for bench_step.json/.png")
    parser.add_argument("--rep", type=positive_int, default=60,
                        help="do_bench repetition time per timing, ms (default 60)")
    parser.add_argument("--rounds", type=positive_int, default=3, help="alternating timing rounds (median), default 3")
    parser.add_argument("--no-flashmla", action="store_true", help="time ours only, even if flash_mla imports")
    parser.add_argument("--no-graphs", action="store_true", help="eager timings only")
    parser.add_argument("--seed", type=parse_seed, default=0)
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes on the CPU: 2 layers per kind, 4 heads, short contexts, reference backend, "
                             "no FlashMLA, no graphs")


def _env(args: argparse.Namespace, console: Console) -> Env[Sizes]:
    if args.smoke:
        return Env(torch.device("cpu"), "reference", None, False, args.rep, 1, Sizes.of(True), args.seed, console)
    flash_mla = None if args.no_flashmla else load_flash_mla()
    return Env(torch.device("cuda"), "auto", flash_mla, not args.no_graphs, args.rep, args.rounds, Sizes.of(False),
               args.seed, console)


def run(args: argparse.Namespace) -> int:
    """Run the cases in ``args.cases``; print the table, write ``bench_step.json`` (+ ``.png``) to ``args.out``.
    Returns 0, or 2 without a CUDA GPU (unless ``--smoke``)."""
    console = Console(width=170)
    start = time.perf_counter()
    env = prepare(args, console, "The step benchmark needs a CUDA GPU (Hopper for the fast kernels; FlashMLA, the "
                  "sgl-flash-mla wheel, optional: without it ours is timed alone).", _env)
    if env is None:
        return 2
    result = dict(run_info(env), smoke=args.smoke, graphs=env.graphs, rep_ms=env.rep_ms, rounds=env.rounds,
                  batch_invariant_supported=batch_invariant_supported(), cases=list(args.cases),
                  decode=[], prefill=[])
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "bench_step.json")
    for name in args.cases:
        if name in DECODE_CASES:
            result["decode"].append(decode_case(name, env))
        else:
            result["prefill"] += prefill_case(name, env)
        if env.device.type == "cuda":  # the case's caches and graphs are gone: give their memory back
            torch.cuda.empty_cache()
        save_result(path, result, start)
    write_plot(result, os.path.join(args.out, "bench_step.png"), console)
    return report(console, path, result, [results_table(result)])


if __name__ == "__main__":
    main(__doc__, add_arguments, run)
