"""Decode context parallelism (sparse_mla.context_parallel): ownership, rank-local step metadata, and rank-split
attention + all-gather + merge against single-process attention, in one process and over gloo with 2 and 3
processes."""
from __future__ import annotations

import math
import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from helpers import KERNEL_RUNS, rel_err
from sparse_mla.batch import Request, entries_needed, slots_of
from sparse_mla.cache import PagedCache
from sparse_mla.context_parallel import PartialsGather, RankLayout, build_rank_metadata
from sparse_mla.formats import field_views
from sparse_mla.ops import sparse_attention_decode
from sparse_mla.ops.merge import merge_partials
from sparse_mla.scenario import make_scenario

HEADS = 4
V4 = dict(lengths=[(520, 1), (1, 1), (70, 1), (45, 3)], window=32, topk=24, fmt="fp8_v4")
V32 = dict(lengths=[(200, 1), (1, 1), (90, 2)], window=1, topk=40, fmt="fp8_v32", dim=576)  # no window: dsa
DSA_SCALE = 0.1352
V4_KINDS = ("swa", "c4a", "c128a")


def scenario(case: dict, seed: int = 0):
    return make_scenario(case["lengths"], window=case["window"], topk=case["topk"], fmt=case["fmt"],
                         dim=case.get("dim", 512), seed=seed)


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
        idx, lens = meta.c4a_indices(picks) if kind == "c4a" else (meta.c128a_indices, meta.c128a_lens)
        extra = dict(extra_cache=caches[kind], extra_indices=idx, extra_lens=lens)
    return sparse_attention_decode(q, caches["swa"], meta.swa_indices, meta.swa_lens, sink=sink, backend=backend,
                                   out=out, **extra)


def single_process(sc, kind: str, q: torch.Tensor, sink: torch.Tensor):
    """The layer on one process holding the whole cache, sink included."""
    return attend(sc.meta, {k: c.data for k, c in sc.caches.items()}, kind, q, sc.topk_local, sink)


def kinds_of(sc) -> tuple[str, ...]:
    return ("dsa",) if "dsa" in sc.batch.kinds else V4_KINDS


def rank_partials(sc, world: int, q: torch.Tensor, kinds: tuple[str, ...], backend: str = "reference"
                  ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Every rank's partials (no sink), computed in this process: per kind ``(outs (R, T, H, 512), lses (R, T, H))``."""
    parts = {kind: [] for kind in kinds}
    for rank in range(world):
        meta, caches, _ = split(sc, RankLayout(world, rank))
        for kind in kinds:
            parts[kind].append(attend(meta, caches, kind, q, sc.topk_local, None, backend))
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
    with pytest.raises(ValueError, match="built for"):
        build_rank_metadata(batch, RankLayout(2, 0), sc.meta.spec, out=meta)


# ------------------------------------------------------------------------------------- rank-split attention

@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("case", [V4, V32], ids=["v4", "v32"])
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


@pytest.mark.skipif(not KERNEL_RUNS, reason="needs a GPU or TRITON_INTERPRET=1")
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


@pytest.mark.skipif(not KERNEL_RUNS, reason="needs a GPU or TRITON_INTERPRET=1")
def test_gloo_three_ranks_triton(tmp_path):
    """3 processes over gloo, the Triton kernels (CPU interpreter) for the partials and the merge, one kind."""
    cases = [dict(V4, lengths=[(150, 1), (1, 1), (2, 1)])]
    results = run_ranks(tmp_path, 3, "triton", ("c128a",), cases)
    check_distributed(results, 3, cases, "triton")
