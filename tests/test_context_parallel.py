"""Decode context parallelism (sparse_mla.context_parallel): ownership, rank-local step metadata, and rank-split
attention + all-gather + merge against single-process attention, in one process and over gloo with 2 and 3
processes."""
from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import re
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from helpers import KERNEL_RUNS, ON_GPU, rel_err
from sparse_mla.batch import Request, entries_needed, slots_of
from sparse_mla.cache import PagedCache
from sparse_mla.context_parallel import PartialsGather, RankLayout, build_rank_metadata
from sparse_mla.formats import field_views
from sparse_mla.layer import SparseMLAAttention
from sparse_mla.ops import sparse_attention_decode
from sparse_mla.ops.merge import merge_partials
from sparse_mla.scenario import make_scenario

HEADS = 4
V4 = dict(lengths=[(520, 1), (1, 1), (70, 1), (45, 3)], window=32, topk=24, fmt="fp8_v4")
V32 = dict(lengths=[(200, 1), (1, 1), (90, 2)], window=1, topk=40, fmt="fp8_v32", dim=576)  # no window: dsa
V41 = dict(lengths=[(300, 1), (1, 1), (64, 2)], window=16, topk=20, fmt="fp8_v41", kinds=("swa", "c2a", "c1a"))
DSA_SCALE = 0.1352
V4_KINDS = ("swa", "c4a", "c128a")
# this file's tensors live on the CPU: its Triton runs need the interpreter (GPUs: tests/test_context_parallel_gpu.py)
CPU_KERNELS = KERNEL_RUNS and not ON_GPU
cpu_kernels = pytest.mark.skipif(not CPU_KERNELS, reason="Triton on CPU tensors: needs TRITON_INTERPRET=1, no GPU")


def scenario(case: dict, seed: int = 0):
    return make_scenario(case["lengths"], window=case["window"], topk=case["topk"], fmt=case["fmt"],
                         dim=case.get("dim", 512), seed=seed, kinds=case.get("kinds"))


def inputs(capacity: int, dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q ``(T, H, dim)`` bf16 and a sink ``(H,)`` with one head that has none (``-inf``)."""
    gen = torch.Generator().manual_seed(seed)
    q = (torch.randn(capacity, HEADS, dim, generator=gen) * 0.5).to(torch.bfloat16)
    sink = torch.randn(HEADS, generator=gen)
    sink[0] = -math.inf
    return q, sink


def split(sc, layout: RankLayout):
    """One rank's share of a scenario: its caches hold the entries it owns (raw bytes copied from the scenario's
    caches, poison included, so a read of anything else still turns NaN) at rank-local positions through its own
    block tables. Returns (rank metadata, {kind: cache tensor}, {kind: [block table per request]})."""
    batch = sc.batch
    kinds = batch.kinds
    sizes = {k: batch.block_sizes[k] for k in kinds}
    tables: dict[str, list[list[int]]] = {k: [] for k in kinds}
    caches = {}
    for kind in kinds:
        src, bs = sc.caches[kind], sizes[kind]
        need = [layout.blocks_needed(s, kind, bs) for s, _ in sc.lengths]
        dst = PagedCache(sum(need) + 1, bs, src.fmt)
        dst.poison()
        blocks = dst.allocator.allocate(sum(need))[::-1]  # not in order: block numbers are the table's business
        for r, n in enumerate(need):
            tables[kind].append(blocks[:n])
            blocks = blocks[n:]
            count = entries_needed(sc.lengths[r][0], kind)
            owned = torch.arange(layout.rank, max(count, layout.rank), layout.world, dtype=torch.int32)
            src_slots = batch.entry_slots(kind, r, owned).long()
            dst_table = torch.tensor([tables[kind][r] or [-1]], dtype=torch.int32)
            dst_slots = slots_of(dst_table, torch.zeros(1, dtype=torch.int32), owned // layout.world, bs).long()
            for (s_view, _, _), (d_view, _, _) in zip(field_views(src.data, src.fmt), field_views(dst.data, dst.fmt)):
                d_view[dst_slots // bs, dst_slots % bs] = s_view[src_slots // bs, src_slots % bs]
        caches[kind] = dst.data
    builder = layout.batch_builder(batch.token_capacity, batch.num_reqs, batch.max_model_len, kinds, sizes,
                                   batch.decode_threshold, num_blocks={k: c.shape[0] for k, c in caches.items()})
    rank_batch = builder.build([Request(s, q, {k: tables[k][r] for k in kinds}) for r, (s, q) in enumerate(sc.lengths)])
    return build_rank_metadata(rank_batch, layout, sc.meta.spec), caches, tables


def attend(meta, caches: dict, kind: str, q: torch.Tensor, picks: torch.Tensor, sink, backend: str = "reference",
           out: torch.Tensor | None = None):
    """One layer of ``kind`` through the ops, from a StepMetadata or a RankStepMetadata (the same attributes)."""
    if kind == "dsa":
        idx, lens = meta.dsa_indices(picks)
        return sparse_attention_decode(q, caches["dsa"], idx, lens, sink=sink, scale=DSA_SCALE, backend=backend,
                                       out=out)
    extra = {}
    if kind != "swa":
        idx, lens = (meta.c128a_indices, meta.c128a_lens) if kind == "c128a" else meta.picks_for(kind, picks)
        extra = dict(extra_cache=caches[kind], extra_indices=idx, extra_lens=lens)
    return sparse_attention_decode(q, caches["swa"], meta.swa_indices, meta.swa_lens, sink=sink, backend=backend,
                                   out=out, **extra)


def single_process(sc, kind: str, q: torch.Tensor, sink: torch.Tensor):
    """The layer on one process holding the whole cache, sink included."""
    return attend(sc.meta, {k: c.data for k, c in sc.caches.items()}, kind, q, picks_of(sc, kind), sink)


def kinds_of(sc) -> tuple[str, ...]:
    return sc.batch.kinds


def picks_of(sc, kind: str) -> torch.Tensor:
    """The scenario's picks for a layer of ``kind`` (V4.1 has two picks kinds)."""
    return sc.picks.get(kind, sc.topk_local)


def rank_partials(sc, world: int, q: torch.Tensor, kinds: tuple[str, ...], backend: str = "reference"
                  ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Every rank's partials (no sink), computed in this process: per kind ``(outs (R, T, H, 512), lses (R, T, H))``."""
    parts = {kind: [] for kind in kinds}
    for rank in range(world):
        meta, caches, _ = split(sc, RankLayout(world, rank))
        for kind in kinds:
            parts[kind].append(attend(meta, caches, kind, q, picks_of(sc, kind), None, backend))
    return {kind: (torch.stack([o for o, _ in p]), torch.stack([lse for _, lse in p])) for kind, p in parts.items()}


def check_matches(got, want) -> None:
    """Rank-split ``(out, lse)`` against single-process attention: rel err <= 1e-2, ``+inf`` LSE on exactly the
    same rows (output 0 there), LSE close elsewhere."""
    (out, lse), (ref_out, ref_lse) = got, want
    assert not out.isnan().any()
    assert rel_err(out, ref_out) <= 1e-2
    empty = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), empty) and bool((lse[empty] > 0).all())
    assert (out[empty] == 0).all()
    assert torch.allclose(lse[~empty], ref_lse[~empty], atol=1e-3, rtol=1e-4)


# ------------------------------------------------------------------------------------------------ ownership

def test_layout_rules():
    layout = RankLayout(3, 1)
    # every rank lists as many blocks as the rank owning the most: of 200 c4a entries rank 0 owns 67 (two blocks of
    # 64), rank 2 owns 66 and lists two blocks too
    assert RankLayout(3, 2).blocks_needed(4 * 200, "c4a") == math.ceil(math.ceil(200 / 3) / 64) == 2
    virtual = torch.tensor([-1, 0, 1, 2, 3, 4, 5, 7], dtype=torch.int32)
    assert layout.local_slots(virtual).tolist() == [-1, -1, 0, -1, -1, 1, -1, 2]
    with pytest.raises(ValueError, match="rank"):
        RankLayout(2, 2)
    with pytest.raises(TypeError, match="world"):
        RankLayout(2.0, 0)
    with pytest.raises(ValueError, match="world"):
        RankLayout(0, 0)
    with pytest.raises(ValueError, match=r"world must be below 2\^31"):  # (int32 slots: 2^32 + 2 acted as 2)
        RankLayout(2**32 + 2, 1)
    # a kind, seq_len and block size named (a KeyError, and -5 or 5.5 tokens taken as a count)
    for args, error, match in ((("100", "c4a"), TypeError, "seq_len"), ((100, "zz"), ValueError, "kind"),
                               ((-5, "swa"), ValueError, "seq_len"), ((5.5, "swa"), TypeError, "seq_len"),
                               ((100, "swa", 0), ValueError, "block_size")):
        with pytest.raises(error, match=match):
            layout.blocks_needed(*args)
    with pytest.raises(ValueError, match="virtual must have dtype"):  # floats were divided into float "slots"
        layout.local_slots(virtual.float())
    with pytest.raises(TypeError, match="virtual must be a torch.Tensor"):
        layout.local_slots([0, 1])


def test_rank_metadata_needs_the_ranks_batch():
    """Only a batch of the layout's own builder (block sizes × world) reads as that rank's tables."""
    sc = scenario(V4)
    with pytest.raises(ValueError, match="plain StepBatchBuilder"):
        build_rank_metadata(sc.batch, RankLayout(2, 0), sc.meta.spec)
    meta, _, _ = split(sc, RankLayout(2, 0))
    assert meta.batch.block_sizes == {"swa": 128, "c4a": 128, "c128a": 4}
    with pytest.raises(ValueError, match=r"for RankLayout\(world=2, rank=0\)"):
        build_rank_metadata(meta.batch, RankLayout(2, 1), sc.meta.spec)
    with pytest.raises(TypeError, match="layout"):
        build_rank_metadata(meta.batch, (2, 0), sc.meta.spec)
    with pytest.raises(ValueError, match="block_sizes"):
        RankLayout(2, 0).batch_builder(4, 2, 100, block_sizes={"swa": 0})


def entries_of(slots: torch.Tensor, lens: torch.Tensor, token_req: torch.Tensor, tables: list[list[int]], bs: int,
               layout: RankLayout = RankLayout(1, 0)) -> list[list[int]]:
    """Index rows of cache slots -> each row's global entry numbers (positions for raw tokens), through the block
    tables that made them (checked to be the token's request's)."""
    where = {b: (r, i) for r, table in enumerate(tables) for i, b in enumerate(table)}
    rows = []
    for t in range(slots.shape[0]):
        row = []
        for s in slots[t, : int(lens[t])].tolist():
            r, i = where[s // bs]
            assert r == int(token_req[t])
            row.append((i * bs + s % bs) * layout.world + layout.rank)
        rows.append(row)
    return rows


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("case", [V4, V32], ids=["v4", "v32"])
def test_rank_lists_are_the_step_lists_owned_entries(case, world):
    """Rank ``r``'s list of every kind names exactly the step's entries ``e`` with ``e % world == r``, in the step
    list's order, as valid prefixes; the new tokens' slot mapping sends each token to its owner only."""
    sc = scenario(case)
    batch = sc.batch
    global_tables = {k: [list(map(int, row[row >= 0])) for row in batch.block_tables[k]] for k in batch.kinds}
    req = batch.token_to_req

    def lists(meta, kind: str):
        if kind in ("c4a", "dsa"):
            return (meta.c4a_indices if kind == "c4a" else meta.dsa_indices)(sc.topk_local)
        return getattr(meta, f"{kind}_indices"), getattr(meta, f"{kind}_lens")

    list_kinds = ("dsa",) if "dsa" in batch.kinds else V4_KINDS
    for rank in range(world):
        layout = RankLayout(world, rank)
        meta, caches, tables = split(sc, layout)
        for kind in list_kinds:
            bs = batch.block_sizes[kind]
            want = [[e for e in row if e % world == rank]
                    for row in entries_of(*lists(sc.meta, kind), req, global_tables[kind], bs)]
            idx, lens = lists(meta, kind)
            assert entries_of(idx, lens, req, tables[kind], bs, layout) == want, kind
            assert bool((idx[torch.arange(idx.shape[1])[None, :] >= lens[:, None]] == -1).all())
        raw = batch.raw_kind
        pos = batch.positions
        owner = (pos >= 0) & (pos % world == rank)
        mapped = meta.slot_mapping
        assert torch.equal(mapped >= 0, owner)
        got = entries_of(mapped[owner][:, None], torch.ones(int(owner.sum()), dtype=torch.int32), req[owner],
                         tables[raw], batch.block_sizes[raw], layout)
        assert [g[0] for g in got] == pos[owner].tolist()


def test_rank_metadata_refills_in_place():
    """The next step built with ``out=`` refills the same buffers (CUDA graphs read them) with what a fresh build
    of that step holds; the old step's metadata is stale."""
    sc = scenario(V4)
    layout = RankLayout(2, 1)
    meta, _, tables = split(sc, layout)
    names = ("swa_indices", "swa_lens", "c128a_indices", "c128a_lens", "picks_indices", "picks_lens", "slot_mapping")
    buffers = {n: getattr(meta, n) for n in names}
    later = [Request(s, q, {k: tables[k][r] for k in sc.batch.kinds})  # other lengths, the same tables
             for r, (s, q) in enumerate([(519, 1), (1, 1), (71, 1), (48, 3)])]
    batch = meta.batch.builder.build(later)
    with pytest.raises(ValueError, match="stale"):
        meta.c4a_indices(sc.topk_local)
    assert build_rank_metadata(batch, layout, sc.meta.spec, out=meta) is meta
    fresh_builder = layout.batch_builder(batch.token_capacity, batch.num_reqs, batch.max_model_len, batch.kinds,
                                         {k: v // 2 for k, v in batch.block_sizes.items()})
    fresh = build_rank_metadata(fresh_builder.build(later), layout, sc.meta.spec)
    for n in names:
        assert getattr(meta, n) is buffers[n] and torch.equal(buffers[n], getattr(fresh, n)), n
    assert torch.equal(meta.c4a_indices(sc.topk_local)[0], fresh.c4a_indices(sc.topk_local)[0])
    assert torch.equal(meta.decode_order("c128a"), fresh.decode_order("c128a"))
    with pytest.raises(ValueError, match="kind must be one of this step's kinds"):
        meta.decode_order("c128")
    with pytest.raises(ValueError, match="built for"):
        build_rank_metadata(batch, RankLayout(2, 0), sc.meta.spec, out=meta)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_rank_lists_are_the_shares_width_and_length(world):
    """Each rank's lists are its share, not the step's: the window lists are built ``ceil(width / world)`` wide
    (the kernels' planned width), every row as long as the entries the rank owns — ``floor`` or ``ceil`` of the
    whole row's length over ``world`` — and the ranks' lengths add up to the whole list's; a layer's picks keep the
    top-k width (nothing bounds how many one rank owns) but hold only the rank's picks, their counts adding up to
    the whole conversion's. The conversions are made once, with the rank's buffers, and kept across builds."""
    sc = scenario(V4, seed=world)
    whole = {k: getattr(sc.meta, f"{k}_lens").clone() for k in ("swa", "c128a")}
    whole_picks = sc.meta.c4a_indices(sc.topk_local)[1].clone()
    totals = {k: torch.zeros_like(v) for k, v in whole.items()}
    picks_total = torch.zeros_like(whole_picks)
    for rank in range(world):
        meta, _, tables = split(sc, RankLayout(world, rank))
        for kind, lens in whole.items():
            width = getattr(sc.meta, f"{kind}_indices").shape[1]
            idx, got = getattr(meta, f"{kind}_indices"), getattr(meta, f"{kind}_lens")
            assert idx.shape[1] == math.ceil(width / world), kind
            assert bool(((got == lens // world) | (got == -(-lens // world))).all()), kind
            totals[kind] += got
        conversion = meta.plan(("picks", "c4a"), None)
        idx, got = meta.c4a_indices(sc.topk_local)
        assert idx.shape[1] == sc.meta.spec.topk and idx is conversion.indices and got is conversion.lens
        picks_total += got
        batch = meta.batch.builder.build([Request(s, q, {k: tables[k][r] for k in tables})
                                          for r, (s, q) in enumerate(sc.lengths)])
        again = build_rank_metadata(batch, RankLayout(world, rank), sc.meta.spec, out=meta)
        assert again.plan(("picks", "c4a"), None) is conversion  # not made again by the next step's build
    for kind, lens in whole.items():
        assert torch.equal(totals[kind], lens), kind
    assert torch.equal(picks_total, whole_picks)


@cpu_kernels
@pytest.mark.parametrize("world", [2, 3])
def test_rank_lists_of_the_triton_builders(monkeypatch, world):
    """The rank's lists as a GPU builds them — its window lists' one Triton launch, its picks conversion's (run here
    in the interpreter) — equal the torch builders' (the CPU's), over two steps (the second refilling the first's
    buffers with the launches bound on the first)."""
    import sparse_mla.metadata as metadata_module
    import sparse_mla.picks as picks_module

    sc = scenario(V4, seed=world)
    names = ("swa_indices", "swa_lens", "c128a_indices", "c128a_lens")
    for rank in range(world):
        layout = RankLayout(world, rank)
        want, _, tables = split(sc, layout)
        want_picks = [t.clone() for t in want.c4a_indices(sc.topk_local)]
        with monkeypatch.context() as patch:
            for module in (metadata_module, picks_module):
                patch.setattr(module, "builders_use_triton", lambda device: True)
            got, _, _ = split(sc, layout)
            assert got._conversions["c4a"]._launch is not None  # the Triton conversion, not the torch twin
            for step in range(2):
                for name in names:
                    assert torch.equal(getattr(got, name), getattr(want, name)), (rank, step, name)
                assert all(torch.equal(a, b) for a, b in zip(got.c4a_indices(sc.topk_local), want_picks)), (rank, step)
                batch = got.batch.builder.build([Request(s, q, {k: tables[k][r] for k in tables})
                                                 for r, (s, q) in enumerate(sc.lengths)])
                build_rank_metadata(batch, layout, sc.meta.spec, out=got)


# ------------------------------------------------------------------------------------- rank-split attention

@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("case", [V4, V32, V41], ids=["v4", "v32", "v41"])
def test_rank_split_attention_equals_single_process(case, world):
    """Each rank attends to its own share without the sink; merging the partials with the sink equals attention
    on one process holding the whole cache (rel err <= 1e-2; bf16 partials), for every kind, with ranks that own
    no key of a row (the 1-token request: every rank but 0; SWA rows of rank > 0 in short windows)."""
    sc = scenario(case, seed=world)
    q, sink = inputs(sc.batch.token_capacity, sc.caches[sc.batch.raw_kind].fmt.dim, seed=world)
    short = sc.batch.query_start_loc_host[1]  # the 1-token request's row: empty on every rank but 0
    for kind, (outs, lses) in rank_partials(sc, world, q, kinds_of(sc)).items():
        assert torch.isinf(lses[1:, short]).all() and (outs[1:, short] == 0).all()
        check_matches(merge_partials(outs, lses, sink), single_process(sc, kind, q, sink))


@cpu_kernels
def test_rank_split_triton_kernels():
    """The Triton attention kernel (partials) and the merge kernel, one small case."""
    case = dict(V4, lengths=[(150, 1), (1, 1)])
    sc = scenario(case, seed=5)
    q, sink = inputs(sc.batch.token_capacity, 512, seed=5)
    outs, lses = rank_partials(sc, 2, q, ("c4a",), backend="triton")["c4a"]
    ref_outs, ref_lses = rank_partials(sc, 2, q, ("c4a",))["c4a"]
    check_matches((outs[0], lses[0]), (ref_outs[0], ref_lses[0]))
    check_matches((outs[1], lses[1]), (ref_outs[1], ref_lses[1]))
    check_matches(merge_partials(outs, lses, sink, backend="triton"), single_process(sc, "c4a", q, sink))


# ------------------------------------------------------------------------------- over torch.distributed (gloo)

def _worker(rank: int, world: int, store: str, results: str, backend: str, kinds: tuple[str, ...],
            cases: list[dict]) -> None:
    """One rank: its cache share, rank-local metadata, the ops without the sink into the exchange's send buffer,
    then the all-gather and the merge with the sink. Saves the merged ``(out, lse)`` per case and kind."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        layout = RankLayout.of_group()
        saved = {}
        for c, case in enumerate(cases):
            sc = scenario(case, seed=c)
            q, sink = inputs(sc.batch.token_capacity, sc.caches[sc.batch.raw_kind].fmt.dim, seed=c)
            meta, caches, _ = split(sc, layout)
            gather = PartialsGather(sc.batch.token_capacity, HEADS)
            with pytest.raises(ValueError, match="lse must have shape"):
                gather(gather.out_partial, torch.zeros(1, HEADS), sink)
            for kind in kinds:
                if kind not in kinds_of(sc):
                    continue
                out, lse = attend(meta, caches, kind, q, sc.topk_local, None, backend, out=gather.out_partial)
                assert out.data_ptr() == gather.out_partial.data_ptr()  # written in place: no copy
                copied = out.clone()
                saved[c, kind] = gather(out, lse, sink, backend=backend)
                again = gather(copied, lse, sink, backend=backend)  # a partial elsewhere is copied in first
                assert all(torch.equal(a, b) for a, b in zip(again, saved[c, kind]))
        torch.save(saved, os.path.join(results, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_ranks(tmp_path, world: int, backend: str, kinds: tuple[str, ...], cases: list[dict]) -> list[dict]:
    mp.spawn(_worker, args=(world, str(tmp_path / "store"), str(tmp_path), backend, kinds, cases), nprocs=world)
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]


def check_distributed(results: list[dict], world: int, cases: list[dict], backend: str) -> None:
    """Every rank got the same bits, which are the in-process merge of the in-process partials (bitwise: the same
    partials merged in the same rank order), and match single-process attention."""
    for c, case in enumerate(cases):
        sc = scenario(case, seed=c)
        q, sink = inputs(sc.batch.token_capacity, sc.caches[sc.batch.raw_kind].fmt.dim, seed=c)
        kinds = tuple(kind for cc, kind in results[0] if cc == c)
        for kind, (outs, lses) in rank_partials(sc, world, q, kinds, backend).items():
            out, lse = results[0][c, kind]
            for other in results[1:]:
                assert torch.equal(other[c, kind][0], out) and torch.equal(other[c, kind][1], lse)
            local = merge_partials(outs, lses, sink, backend=backend)
            assert torch.equal(out, local[0]) and torch.equal(lse, local[1]), (c, kind)
            check_matches((out, lse), single_process(sc, kind, q, sink))


def test_gloo_two_ranks_every_kind(tmp_path):
    """2 processes over gloo: V4 swa / c4a / c128a and V3.2 dsa, a request shorter than the world included."""
    cases = [V4, V32]
    results = run_ranks(tmp_path, 2, "reference", V4_KINDS + ("dsa",), cases)
    assert len(results[0]) == 4
    check_distributed(results, 2, cases, "reference")


@cpu_kernels
def test_gloo_three_ranks_triton(tmp_path):
    """3 processes over gloo, the Triton kernels (CPU interpreter) for the partials and the merge, one kind."""
    cases = [dict(V4, lengths=[(150, 1), (1, 1), (2, 1)])]
    results = run_ranks(tmp_path, 3, "triton", ("c128a",), cases)
    check_distributed(results, 3, cases, "triton")


# ------------------------------------------------------------------------ the layer in context-parallel mode

def layer_of(kind: str, sink: torch.Tensor, case: dict, backend: str = "reference", **options) -> SparseMLAAttention:
    """A layer of ``kind`` for a test case (dsa: V3.2's 576-d queries and a model scale)."""
    if kind == "dsa":
        return SparseMLAAttention("dsa", HEADS, 576, topk=case["topk"], scale=DSA_SCALE, sink=sink, backend=backend,
                                  **options)
    return SparseMLAAttention(kind, HEADS, 512, case["window"], topk=case["topk"] if kind == "c4a" else None,
                              sink=sink, backend=backend, **options)


def picks_for(sc, kind: str) -> torch.Tensor | None:
    return sc.topk_local if kind in ("c4a", "dsa") else None


@pytest.fixture
def one_rank_group(tmp_path):
    """A process group of this process alone (gloo), for the layer's context-parallel checks."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1,
                            timeout=timedelta(seconds=60))
    yield
    dist.destroy_process_group()


def test_layer_context_parallel_one_rank_and_bad_input(one_rank_group):
    """A group of one: the layer without its sink, then the merge applying it, is the layer with it (the reference
    and, where kernels run, the Triton kernels: the plan's no-sink launches and their LSE); bad context-parallel input
    is a ValueError / TypeError naming what is wrong."""
    sc = scenario(V4)
    q, sink = inputs(sc.batch.token_capacity, 512, seed=1)
    meta, caches, _ = split(sc, RankLayout(1, 0))
    gather = PartialsGather(sc.batch.token_capacity, HEADS)
    for backend in ("reference", "triton") if CPU_KERNELS else ("reference",):
        for kind in V4_KINDS:
            layer = layer_of(kind, sink, V4, backend)
            out = torch.full((sc.batch.token_capacity, HEADS, 512), math.nan, dtype=torch.bfloat16)
            assert layer(q, meta, caches, picks_for(sc, kind), out=out, context_parallel=gather) is out
            check_matches((out, gather.merged_lse), single_process(sc, kind, q, sink))
            assert (out[sc.batch.num_tokens:] == 0).all()
            assert torch.isinf(gather.merged_lse[sc.batch.num_tokens:]).all()
    layer = layer_of("c4a", sink, V4)
    with pytest.raises(ValueError, match="pass context_parallel="):
        layer(q, meta, caches, sc.topk_local)
    with pytest.raises(ValueError, match="context_parallel needs meta to be this rank's RankStepMetadata"):
        layer(q, sc.meta, sc.caches, sc.topk_local, context_parallel=gather)
    with pytest.raises(TypeError, match="context_parallel must be a PartialsGather"):
        layer(q, meta, caches, sc.topk_local, context_parallel=(gather.out_partial, gather.lse_partial))
    with pytest.raises(ValueError, match=r"context_parallel holds .* shape \(9, 5, 512\)"):
        layer(q, meta, caches, sc.topk_local, context_parallel=PartialsGather(9, HEADS + 1))
    with pytest.raises(ValueError, match=r"context_parallel gathers over RankLayout\(world=1, rank=0\), but meta was"):
        layer(q, split(sc, RankLayout(2, 1))[0], caches, sc.topk_local, context_parallel=gather)
    with pytest.raises(ValueError, match="combined"):
        layer_of("c4a", sink, V4, index_form="combined")(q, meta, caches, sc.topk_local, context_parallel=gather)
    with pytest.raises(ValueError, match="prefill_mode 'workspace'"):  # the step has a 3-token prefill
        layer_of("c4a", sink, V4, prefill_mode="workspace")(q, meta, caches, sc.topk_local, context_parallel=gather)
    bad = dict(caches, c4a=PagedCache(caches["c4a"].shape[0] * 2, 32, "fp8_v4").data)
    with pytest.raises(ValueError, match="blocks of 32 entries, the step's block tables use 64"):
        layer(q, meta, bad, sc.topk_local, context_parallel=gather)


@pytest.mark.parametrize("comm", ["allgather", "reduce_scatter"])
def test_gather_output_sharing_memory_is_a_value_error(one_rank_group, comm):
    """A call's merged output may share no memory with its merged LSE, the sink or the exchange's own buffers, in
    either form: the reduce-scatter writes ``merged`` last, so an LSE or a sink under it would be overwritten
    silently, and a scaled partial under it is the collective's own input."""
    tokens, heads, dim = 3, 4, 16
    gather = PartialsGather(tokens, heads, dim=dim, comm=comm)
    gen = torch.Generator().manual_seed(4)
    out = torch.randn(tokens, heads, dim, generator=gen).to(torch.bfloat16)
    lse, sink = torch.randn(tokens, heads, generator=gen), torch.randn(heads, generator=gen)
    raw = torch.zeros(tokens * heads * dim * 2, dtype=torch.uint8)  # zeros: a float32 view of it is a valid sink
    merged = raw.view(torch.bfloat16).view(tokens, gather.out_heads, dim)
    under_merged = {"merged_lse": dict(merged_lse=raw[: tokens * heads * 4].view(torch.float32).view(tokens, heads)),
                    "sink": dict(sink=raw[: heads * 4].view(torch.float32))}
    for name, change in under_merged.items():
        args = dict(sink=sink, merged=merged) | change
        with pytest.raises(ValueError, match=f"^merged overlaps {name}"):
            gather(out, lse, args.pop("sink"), **args)
        assert torch.equal(raw, torch.zeros_like(raw)), name  # rejected before anything was written
    own = gather.outs[0] if comm == "allgather" else gather.scaled[0]  # the exchange's buffer of this rank
    with pytest.raises(ValueError, match="^merged overlaps"):
        gather(out, lse, sink, merged=own)


def test_gather_group_and_device_are_named(one_rank_group):
    """A group that is not a ProcessGroup, and a device torch does not know or this machine lacks."""
    with pytest.raises(TypeError, match="group must be a torch.distributed ProcessGroup"):
        PartialsGather(4, 2, group=3)
    for device in ("bogus", f"cuda:{torch.cuda.device_count()}"):
        with pytest.raises(ValueError, match="device"):
            PartialsGather(4, 2, device=device)


@pytest.mark.parametrize("comm", ["allgather", "reduce_scatter"])
def test_gather_bad_outputs_name_the_argument(one_rank_group, comm):
    """A gather call's bad ``merged`` / ``merged_lse`` is a ValueError naming that argument (not ``out``, which is
    the call's partial, nor the merge's ``lse_out``)."""
    tokens, heads, dim = 3, 4, 16
    gather = PartialsGather(tokens, heads, dim=dim, comm=comm)
    out, lse = torch.zeros(tokens, heads, dim, dtype=torch.bfloat16), torch.zeros(tokens, heads)
    merged = torch.zeros(tokens, gather.out_heads, dim, dtype=torch.bfloat16)
    cases = [(dict(merged=merged[..., :-1]), r"^merged must have shape"),
             (dict(merged=merged.transpose(0, 1)), r"^merged must (have shape|be contiguous)"),
             (dict(merged_lse=torch.zeros(tokens, heads + 1)), r"^merged_lse must have shape"),
             (dict(merged_lse=torch.zeros(tokens, heads, dtype=torch.float64)), r"^merged_lse must have dtype"),
             (dict(merged_lse=torch.zeros(heads, tokens).t()), r"^merged_lse must be contiguous"),
             (dict(merged=merged, merged_lse=merged.view(-1)[: 2 * tokens * heads].view(torch.float32)
                   .view(tokens, heads)), r"^merged overlaps merged_lse")]
    for change, message in cases:
        with pytest.raises(ValueError, match=message):
            gather(out, lse, None, **change)


def test_reduce_scatter_needs_heads_divisible_by_world(monkeypatch):
    """The reduce-scatter form splits the heads over the ranks: a head count the group's size does not divide is a
    ValueError naming num_heads (made before any collective: a 3-rank group is stood in for)."""
    import sparse_mla.context_parallel as cp

    monkeypatch.setattr(cp.RankLayout, "of_group", classmethod(lambda cls, group=None: cls(3, 1)))
    with pytest.raises(ValueError, match=r"num_heads \(4\) must be divisible by the group's 3 ranks"):
        PartialsGather(2, 4, dim=16, comm="reduce_scatter")
    assert PartialsGather(2, 4, dim=16).out_heads == 4  # the all-gather form: every head on every rank
    assert PartialsGather(2, 6, dim=16, comm="reduce_scatter").out_heads == 2


def _nan_worker(rank: int, world: int, store: str, results: str, comm: str, backend: str) -> None:
    """One rank's gather call, rank 1's LSE holding a NaN; saves what the call raised (or None)."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=10))
    try:
        gather = PartialsGather(3, 4, dim=16, comm=comm)
        lse = torch.zeros(3, 4)
        if rank == 1:
            lse[1, 2] = math.nan
        try:
            gather(torch.zeros(3, 4, 16, dtype=torch.bfloat16), lse, None, backend=backend)
            raised = None
        except Exception as error:  # noqa: BLE001 - the test reads which error each rank got
            raised = (type(error).__name__, str(error))
        torch.save(raised, os.path.join(results, f"nan{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=cpu_kernels)])
@pytest.mark.parametrize("comm", ["allgather", "reduce_scatter"])
def test_a_ranks_nan_lse_is_a_value_error_on_every_rank(tmp_path, monkeypatch, comm, backend):
    """A NaN in one rank's LSE is a ValueError on every rank of the group (checked in the gathered LSEs; the Triton
    merge under SPARSE_MLA_DEBUG=1), not an error on that rank alone while the others wait for it in the
    collective."""
    monkeypatch.setenv("SPARSE_MLA_DEBUG", "1")  # the Triton merge's value checks (the reference always checks)
    mp.spawn(_nan_worker, args=(2, str(tmp_path / "store"), str(tmp_path), comm, backend), nprocs=2)
    for rank in range(2):
        raised = torch.load(tmp_path / f"nan{rank}.pt")
        assert raised is not None and raised[0] == "ValueError" and "NaN" in raised[1], (rank, raised)


def _layer_worker(rank: int, world: int, store: str, results: str, backend: str, kinds: tuple[str, ...],
                  cases: list[dict], index_form: str, comm: str = "allgather") -> None:
    """One rank: its cache share and metadata, each kind's layer in context-parallel mode over the group. Saves the
    layers' outputs per case and kind."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        saved = {}
        for c, case in enumerate(cases):
            sc = scenario(case, seed=c)
            q, sink = inputs(sc.batch.token_capacity, sc.caches[sc.batch.raw_kind].fmt.dim, seed=c)
            meta, caches, _ = split(sc, RankLayout.of_group())
            gather = PartialsGather(sc.batch.token_capacity, HEADS, comm=comm)
            for kind in (k for k in kinds if k in kinds_of(sc)):
                # the step has prefill tokens: the workspace prefill (V3.2's default) is not run on a rank's step
                layer = layer_of(kind, sink, case, backend, prefill_mode="paged", index_form=index_form)
                saved[c, kind] = layer(q, meta, caches, picks_for(sc, kind), context_parallel=gather)
        torch.save(saved, os.path.join(results, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def check_layer_ranks(tmp_path, world: int, backend: str, kinds: tuple[str, ...], cases: list[dict],
                      index_form: str = "padded", comm: str = "allgather") -> None:
    """The layer in context-parallel mode on ``world`` processes against the layer on one process holding the whole
    cache (its default prefill mode; rel err <= 1e-2), padding rows 0: with the all-gather form every rank's output
    is every head, the same bits on every rank; with the reduce-scatter form rank ``r``'s output is heads
    ``[r·H/world, (r+1)·H/world)``."""
    mp.spawn(_layer_worker, args=(world, str(tmp_path / "store"), str(tmp_path), backend, kinds, cases, index_form,
                                  comm), nprocs=world)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    assert len(results[0]) == sum(len([k for k in kinds if k in kinds_of(scenario(case))]) for case in cases)
    shard = HEADS // world if comm == "reduce_scatter" else HEADS
    for (c, kind), out in results[0].items():
        sc = scenario(cases[c], seed=c)
        q, sink = inputs(sc.batch.token_capacity, sc.caches[sc.batch.raw_kind].fmt.dim, seed=c)
        whole = layer_of(kind, sink, cases[c])(q, sc.meta, sc.caches, picks_for(sc, kind))
        for rank, result in enumerate(results):
            got = result[c, kind]
            if comm == "allgather":
                assert torch.equal(got, out), (c, kind)
            want = whole if comm == "allgather" else whole[:, rank * shard:(rank + 1) * shard]
            assert got.shape == want.shape and not got.isnan().any(), (c, kind, rank)
            assert rel_err(got, want) <= 1e-2, (c, kind, rank)
            assert (got[sc.batch.num_tokens:] == 0).all()


def test_layer_context_parallel_two_ranks_every_kind(tmp_path):
    """2 processes over gloo, the layer of every V4 kind and V3.2's dsa against the single-process layer."""
    check_layer_ranks(tmp_path, 2, "reference", V4_KINDS + ("dsa",), [V4, V32])


@pytest.mark.parametrize("world", [2, 4])
def test_layer_context_parallel_reduce_scatter(tmp_path, world):
    """The reduce-scatter form (LSEs all-gathered, each rank's partial rescaled, a reduce-scatter over heads) on 2
    and 4 processes over gloo: each rank's head shard is the single-process layer's heads of that shard."""
    check_layer_ranks(tmp_path, world, "reference", V4_KINDS, [V4], comm="reduce_scatter")


@pytest.mark.parametrize("comm", ["allgather", "reduce_scatter"])
def test_layer_call_is_one_exchange_and_no_replanning(one_rank_group, monkeypatch, comm):
    """A layer call in context-parallel mode makes the form's collectives and nothing more — one all-gather
    (``allgather``), or the LSEs' all-gather and one reduce-scatter (``reduce_scatter``) — and, after the step's
    first calls, no new plan: the step's plans, picks conversions and buffers are reused, and each plan writes its
    LSE straight into the gather's send buffer (no copy)."""
    import sparse_mla.context_parallel as cp

    sc = scenario(V4)
    q, sink = inputs(sc.batch.token_capacity, 512, seed=2)
    meta, caches, _ = split(sc, RankLayout(1, 0))
    gather = PartialsGather(sc.batch.token_capacity, HEADS, comm=comm)
    calls = []
    for name in ("_all_gather", "_reduce_scatter"):
        real = getattr(cp, name)
        monkeypatch.setattr(cp, name, lambda *a, _real=real, _name=name, **k: (calls.append(_name), _real(*a, **k))[1])
    layers = [layer_of(kind, sink, V4) for kind in V4_KINDS]
    out = torch.empty(sc.batch.token_capacity, HEADS, 512, dtype=torch.bfloat16)

    def run() -> None:
        for layer in layers:
            layer(q, meta, caches, picks_for(sc, layer.kind), out=out, context_parallel=gather)

    run()  # the step's plans are made here
    plans = dict(meta._plans)
    calls.clear()
    run()
    run()
    per_call = ["_all_gather"] if comm == "allgather" else ["_all_gather", "_reduce_scatter"]
    assert calls == per_call * 2 * len(layers)
    assert meta._plans.keys() == plans.keys() and all(meta._plans[k] is v for k, v in plans.items())
    layer_plans = [p for k, p in plans.items() if k[0] != "picks"]
    assert len(layer_plans) == len(V4_KINDS)
    assert all(p.lse.data_ptr() == gather.lse_partial.data_ptr() for p in layer_plans)
    check_matches((out, gather.merged_lse), single_process(sc, "c128a", q, sink))


@cpu_kernels
def test_layer_context_parallel_triton_ragged(tmp_path):
    """3 processes over gloo, the layer's Triton kernels (CPU interpreter; the merge's too) with ragged lists; rows
    that most ranks hold no key of (a 1-token and a 2-token request)."""
    check_layer_ranks(tmp_path, 3, "triton", ("c4a",), [dict(V4, lengths=[(150, 1), (1, 1), (2, 1)])],
                      index_form="ragged")


def test_benchmark_smoke(tmp_path, monkeypatch):
    """``benchmarks/bench_context_parallel.py --smoke``: 2 CPU processes over gloo (1 and 2 ranks, both exchange
    forms) write the JSON the GPU run is read from; the longest contexts follow the stated rule; the arguments of
    the GPU run parse."""
    from test_benchmark_smoke import load_script

    bench = load_script("bench_context_parallel", monkeypatch)
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--worlds", "1", "2", "4", "--cases", "8x512K", "32x131072", "--comm", "reduce_scatter"])
    assert args.cases == [(8, 512 * 1024), (32, 128 * 1024)] and args.worlds == [1, 2, 4]
    with pytest.raises(SystemExit):
        parser.parse_args(["--cases", "8by512"])
    assert bench.run(parser.parse_args(["--smoke", "--cache-gib", "1", "--out", str(tmp_path)])) == 0
    result = json.loads((tmp_path / "bench_context_parallel.json").read_text())
    rows = {(r["world"], r["comm"]): r for r in result["rows"]}
    assert set(rows) == {(1, None), (2, "allgather"), (2, "reduce_scatter")}
    one = rows[1, None]["ranks"][0]
    assert one["fits"] and one["attention_ms"] == one["eager_ms"] > 0 and one["communication_ms"] == 0
    for comm in ("allgather", "reduce_scatter"):
        ranks = rows[2, comm]["ranks"]
        assert len(ranks) == 2
        for rank in ranks:
            assert rank["finite"] and min(rank["eager_ms"], rank["attention_ms"], rank["communication_ms"]) > 0
            assert rank["cache_bytes_per_gpu"] < one["cache_bytes_per_gpu"]
    summary = {(s["world"], s["comm"]): s for s in result["summary"]}
    s = summary[2, "allgather"]
    assert s["attention_vs_1gpu"] == pytest.approx(max(r["attention_ms"] for r in rows[2, "allgather"]["ranks"])
                                                   / one["attention_ms"])
    memory = result["memory"]
    per_token = memory["bytes_per_token"]["all_raw"]
    assert memory["longest_context"]["all_raw_b2_1gpu"] == (1 << 30) // (2 * per_token)
    assert memory["longest_context"]["all_raw_b2_2gpu"] == (2 << 30) // (2 * per_token)


@pytest.mark.parametrize("comm", ["allgather", "reduce_scatter"])
def test_benchmark_attention_part_exchanges_nothing(one_rank_group, monkeypatch, comm):
    """The benchmark's attention part (its layers given a gather that exchanges nothing) runs no collective and no
    merge: a layer call in context-parallel mode goes through the gather's ``exchange``, not its ``__call__``."""
    import sparse_mla.context_parallel as cp
    from test_benchmark_smoke import load_script

    bench = load_script("bench_context_parallel", monkeypatch)
    sc = scenario(V4)
    q, sink = inputs(sc.batch.token_capacity, 512, seed=3)
    meta, caches, _ = split(sc, RankLayout(1, 0))
    silent = bench._NoExchange(sc.batch.token_capacity, HEADS, comm=comm)
    calls = []
    for name in ("_all_gather", "_reduce_scatter", "launch_merge", "launch_rescale", "merge_partials",
                 "rescale_partial"):
        monkeypatch.setattr(cp, name, lambda *a, _name=name, **k: calls.append(_name))
    for kind in V4_KINDS:
        layer_of(kind, sink, V4)(q, meta, caches, picks_for(sc, kind), context_parallel=silent)
    assert calls == []


STEP_API = pathlib.Path(__file__).resolve().parent.parent / "docs" / "step_api.md"
# the doc's two steps, shorter: a prefill past the first c128a entries (so each rank holds one), then decodes (MTP)
SERVE_STEPS = [[(0, 260, 260), (1, 8, 8)], [(0, 262, 2), (1, 9, 1)]]


def step_api_serve() -> dict:
    """The context-parallel engine loop of docs/step_api.md (its ``py`` block defining ``serve``), executed; with 4
    heads and top-k 64 instead of V4-Flash's (the CPU reference's time)."""
    block = next(b for b in re.findall(r"```py\n(.*?)```", STEP_API.read_text(), re.S) if "def serve(" in b)
    namespace: dict = {}
    exec(compile(block, "docs/step_api.md serve", "exec"), namespace)
    namespace.update(HEADS=4, TOPK=64)  # serve reads them as globals
    return namespace


def _serve_worker(rank: int, world: int, store: str, results: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        doc = step_api_serve()
        torch.save(doc["serve"](SERVE_STEPS, device="cpu", backend="reference"),
                   os.path.join(results, f"serve{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_step_api_context_parallel_loop_runs(tmp_path, one_rank_group):
    """docs/step_api.md's engine loop on 2 processes: both ranks end with the same outputs, which are the loop's on
    one process (a group of one: the whole cache)."""
    mp.spawn(_serve_worker, args=(2, str(tmp_path / "store2"), str(tmp_path)), nprocs=2)
    ranks = [torch.load(tmp_path / f"serve{r}.pt") for r in range(2)]
    doc = step_api_serve()
    whole = doc["serve"](SERVE_STEPS, device="cpu", backend="reference")
    for i, out in enumerate(ranks[0]):
        assert torch.equal(out, ranks[1][i]) and not out.isnan().any()
        assert rel_err(out, whole[i]) <= 1e-2, i
        assert (out[3:] == 0).all()  # the last step's 3 tokens, then padding
