"""Decode context parallelism on 2 and 4 GPUs over NCCL (issues 38, 51): a DeepSeek-V4-Flash decode step (64 heads,
top-k 512, window 128; swa, c4a and c128a layers, two of the compressed kinds so layers share a step plan) with each
request's cache split over the ranks, against one GPU holding the whole context — eager, and captured in a CUDA graph
with the NCCL collectives inside it (captured on one step, replayed on the next). fp8_v4 and bf16 caches; both
exchange forms (``PartialsGather(comm=...)``: the all-gather of the partials, every rank every head; the LSEs'
all-gather + reduce-scatter over heads, each rank its head shard).

Each case is skipped unless its GPUs are present (2 for world 2, 4 for world 4). Each rank is a process
(``torch.multiprocessing.spawn``) on its own GPU (``torch.cuda.set_device(rank)``: :data:`helpers.DEVICE` is then
that GPU); the one-GPU reference runs in each rank's process on its own GPU. The parent compares what the ranks
saved.
"""
from __future__ import annotations

import os
import socket
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from helpers import DEVICE, rel_err
from sparse_mla.batch import Request, StepBatchBuilder, entries_needed
from sparse_mla.cache import PagedCache
from sparse_mla.config import COMPRESS_RATIO, DEFAULT_BLOCK_SIZE, V4_KINDS, get_config
from sparse_mla.context_parallel import PartialsGather, RankLayout, build_rank_metadata
from sparse_mla.layer import SparseMLAAttention
from sparse_mla.metadata import MetadataSpec, build_step_metadata
from sparse_mla.scenario import random_picks

COMMS = ("allgather", "reduce_scatter")
CFG = get_config("deepseek-v4-flash")
LAYERS = ("swa", "c4a", "c128a", "c4a", "c128a")  # V4-Flash's kinds; two layers of a kind share the step's plan
MTP = 2  # tokens per decode request (1 + 1 MTP draft), V4-Flash's decode
# cached tokens per request before step 0: long, mid, shorter than the window, one (3 tokens at step 0: no
# compressed entry yet, so its c4a and c128a rows are empty on every rank)
CONTEXTS = (9001, 1400, 70, 1)
MAX_MODEL_LEN = 16384
FORMATS = ("fp8_v4", "bf16")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Model:
    """What every process draws alike (seeded on the CPU): each request's latents for every entry of every kind
    (up to its length after step 2), the layers' sinks and queries, the indexer's picks of each step."""

    def __init__(self, fmt: str) -> None:
        gen = torch.Generator().manual_seed(38)
        self.fmt = fmt
        final = [c + 2 * MTP for c in CONTEXTS]
        self.latents = {k: [(torch.randn(entries_needed(s, k), 512, generator=gen) * 0.5).to(torch.bfloat16)
                            for s in final] for k in V4_KINDS}
        heads = CFG.num_heads
        self.sinks = [torch.randn(heads, generator=gen) for _ in LAYERS]
        self.q = [[(torch.randn(len(CONTEXTS) * MTP, heads, 512, generator=gen) * 0.5).to(torch.bfloat16)
                   for _ in LAYERS] for _ in range(2)]  # per step, per layer
        self.gen = gen

    def lengths(self, step: int) -> list[tuple[int, int]]:
        """(seq_len, query_len) of each request in step 0 or 1."""
        return [(c + (step + 1) * MTP, MTP) for c in CONTEXTS]

    def picks(self, positions: torch.Tensor) -> torch.Tensor:
        return random_picks(positions.cpu(), CFG.index_topk, self.gen, MAX_MODEL_LEN // COMPRESS_RATIO["c4a"],
                            invisible=2, drop=0.05).to(DEVICE)

    def layers(self, sinks: list[torch.Tensor]) -> list[SparseMLAAttention]:
        return [SparseMLAAttention(kind, CFG.num_heads, CFG.head_dim, CFG.window, scale=CFG.softmax_scale,
                                   topk=CFG.index_topk if kind == "c4a" else None, sink=sink.to(DEVICE))
                for kind, sink in zip(LAYERS, sinks)]


def _caches(model: Model, layout: RankLayout) -> tuple[dict[str, PagedCache], list[dict[str, list[int]]], object]:
    """The caches of ``layout``'s rank (``RankLayout(1, 0)``: the whole context) holding every entry it owns of
    every request, its block tables and its batch builder."""
    final = [c + 2 * MTP for c in CONTEXTS]
    need = {k: [layout.blocks_needed(s, k) for s in final] for k in V4_KINDS}
    caches = {k: PagedCache(sum(need[k]) + 1, DEFAULT_BLOCK_SIZE[k], model.fmt, device=DEVICE) for k in V4_KINDS}
    tables = [{k: caches[k].allocator.allocate(need[k][r])[::-1] for k in V4_KINDS} for r in range(len(final))]
    builder = layout.batch_builder(len(final) * MTP, len(final), MAX_MODEL_LEN, V4_KINDS, decode_threshold=MTP,
                                   device=DEVICE, num_blocks={k: c.num_blocks for k, c in caches.items()})
    batch = builder.build([Request(s, MTP, tables[r]) for r, s in enumerate(final)])
    for kind in V4_KINDS:
        for r, latents in enumerate(model.latents[kind]):
            entries = torch.arange(latents.shape[0], dtype=torch.int32, device=DEVICE)
            caches[kind].write(latents.to(DEVICE), layout.local_slots(batch.entry_slots(kind, r, entries)))
    return caches, tables, builder


def _whole_context(model: Model) -> list[list[torch.Tensor]]:
    """Each step's layer outputs on one GPU holding every request's whole cache (sinks in the layers)."""
    caches, tables, _ = _caches(model, RankLayout(1, 0))
    builder = StepBatchBuilder(len(CONTEXTS) * MTP, len(CONTEXTS), MAX_MODEL_LEN, V4_KINDS, decode_threshold=MTP,
                               device=DEVICE, num_blocks={k: c.num_blocks for k, c in caches.items()})
    spec = MetadataSpec(CFG.window, CFG.index_topk)
    layers = model.layers(model.sinks)
    outs = []
    for step in range(2):
        batch = builder.build([Request(s, q, tables[r]) for r, (s, q) in enumerate(model.lengths(step))])
        meta = build_step_metadata(batch, spec)
        picks = model.picks(batch.positions)
        outs.append([layer(q.to(DEVICE), meta, caches, picks if layer.kind == "c4a" else None).cpu()
                     for layer, q in zip(layers, model.q[step])])
    return outs


def _worker(rank: int, world: int, port: int, results: str) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))
    try:
        saved = {}
        for fmt in FORMATS:
            model = Model(fmt)
            saved[fmt, "whole"] = _whole_context(model)
            for comm in COMMS:
                model = Model(fmt)  # the same draws again (picks included) for each rank-split run
                saved[fmt, comm, "eager"], saved[fmt, comm, "graph"] = _rank_split(model, comm)
        torch.save(saved, os.path.join(results, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _captured(step) -> object:
    """``step`` captured in a CUDA graph after a warm-up on a side stream (as capture asks; it also makes the
    step's plans and compiles the kernels); returns the graph's replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def _rank_split(model: Model, comm: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Step 0 eager, then the whole decode step (rank metadata build + every layer, each with its NCCL collectives
    and merge) captured in a CUDA graph on step 0 and replayed for step 1. Returns (step 0 eager outputs, step 1
    replayed outputs): every head (``comm="allgather"``) or the rank's head shard (``"reduce_scatter"``)."""
    layout = RankLayout.of_group()
    caches, tables, builder = _caches(model, layout)
    spec = MetadataSpec(CFG.window, CFG.index_topk)
    layers = model.layers(model.sinks)
    gather = PartialsGather(builder.max_tokens, CFG.num_heads, device=DEVICE, comm=comm)
    q = [t.to(DEVICE) for t in model.q[0]]  # fixed tensors the graph reads: step 1 copies its queries in
    outs = [torch.empty(t.shape[0], gather.out_heads, 512, dtype=torch.bfloat16, device=DEVICE) for t in q]
    current = {"batch": builder.build([Request(s, n, tables[r]) for r, (s, n) in enumerate(model.lengths(0))])}
    meta = build_rank_metadata(current["batch"], layout, spec)
    picks = model.picks(current["batch"].positions)

    def step() -> None:
        build_rank_metadata(current["batch"], layout, spec, out=meta)
        for layer, q_l, out in zip(layers, q, outs):
            layer(q_l, meta, caches, picks if layer.kind == "c4a" else None, out=out, context_parallel=gather)

    step()
    eager = [o.to("cpu", copy=True) for o in outs]
    replay = _captured(step)
    for o in outs:
        o.fill_(float("nan"))  # a replay that wrote nothing shows
    # step 1: the builder refills its buffers (the graph's build reads them), new picks and queries in place
    current["batch"] = builder.build([Request(s, n, tables[r]) for r, (s, n) in enumerate(model.lengths(1))])
    picks.copy_(model.picks(current["batch"].positions))
    for q_l, new in zip(q, model.q[1]):
        q_l.copy_(new)
    replay()
    return eager, [o.cpu() for o in outs]


@pytest.mark.parametrize("world", [2, 4])
def test_multi_gpu_decode_step_matches_one_gpu(tmp_path, world):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA GPUs (NCCL)")
    mp.spawn(_worker, args=(world, _free_port(), str(tmp_path)), nprocs=world)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    shard = CFG.num_heads // world
    for fmt in FORMATS:
        whole = ranks[0][fmt, "whole"]
        for comm in COMMS:
            for mode, step in (("eager", 0), ("graph", 1)):
                for i, kind in enumerate(LAYERS):
                    for r, saved in enumerate(ranks):
                        got = saved[fmt, comm, mode][i]
                        want = whole[step][i] if comm == "allgather" else whole[step][i][:, r * shard:(r + 1) * shard]
                        where = f"{fmt} {comm} {mode} layer {i} ({kind}) rank {r}"
                        if comm == "allgather":  # every rank merged the same gathered partials
                            assert torch.equal(got, ranks[0][fmt, comm, mode][i]), f"{where}: ranks differ"
                        assert got.shape == want.shape and not got.isnan().any(), where
                        err = rel_err(got, want)
                        assert err <= 1e-2, f"{where}: rel err {err:.2e} against one GPU"
            # step 1 (replayed) is another step than step 0: its outputs moved
            assert rel_err(ranks[0][fmt, comm, "graph"][1][:, :shard], whole[0][1][:, :shard]) > 1e-2
