"""The plan/run split (DESIGN §5): plans made once per step, caches validated once, stale or foreign metadata
rejected, the fast launcher's fingerprint, and (GPU) a whole decode step captured in one CUDA graph."""
from __future__ import annotations

import math

import pytest
import torch

from helpers import SINK_CHANGES, repoint_sink
from sparse_mla import cache_views
from sparse_mla import plan as plan_module
from sparse_mla.batch import Request, StepBatchBuilder, blocks_needed
from sparse_mla.cache import PagedCache
from sparse_mla.layer import SparseMLAAttention
from sparse_mla.metadata import MetadataSpec, build_step_metadata
from sparse_mla.ops.launch import fingerprint
from sparse_mla.scenario import make_scenario, random_picks

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
SIZES = {"swa": 4, "c4a": 4, "c128a": 2}


def engine(num_blocks=64, max_tokens=16, max_reqs=4, max_model_len=600, threshold=2):
    caches = {k: PagedCache(num_blocks, SIZES[k], "fp8_v4", device=DEVICE) for k in SIZES}
    builder = StepBatchBuilder(max_tokens, max_reqs, max_model_len, block_sizes=SIZES, decode_threshold=threshold,
                               device=DEVICE)
    return caches, builder


def requests(caches, lengths, first_block=0):
    """Requests of ``lengths`` whose blocks are distinct across the step, numbered per kind from ``first_block``."""
    out, next_block = [], dict.fromkeys(SIZES, first_block)
    for s, q in lengths:
        tables = {}
        for k in SIZES:
            n = blocks_needed(s, k, SIZES[k])
            tables[k], next_block[k] = list(range(next_block[k], next_block[k] + n)), next_block[k] + n
        out.append(Request(s, q, tables))
    return out


def test_a_layer_given_stale_metadata_raises():
    caches, builder = engine()
    spec = MetadataSpec(window=8, topk=4)
    meta = build_step_metadata(builder.build(requests(caches, [(100, 1), (50, 2)])), spec)
    layer = SparseMLAAttention("swa", 2, window=8)
    q = torch.zeros(16, 2, 512, dtype=torch.bfloat16, device=DEVICE)
    layer(q, meta, caches)  # current: fine
    newer = builder.build(requests(caches, [(101, 1), (52, 2)]))  # the engine schedules the next step first
    with pytest.raises(ValueError, match="stale step: this batch .* is build 1 of its StepBatchBuilder, which has "
                                         "built step 2"):
        layer(q, meta, caches)
    with pytest.raises(ValueError, match="stale step"):
        build_step_metadata(meta.batch, spec)
    assert build_step_metadata(newer, spec, out=meta) is meta  # refilled from the current batch: usable again
    layer(q, meta, caches)


def test_metadata_buffers_cannot_be_refilled_from_another_builder():
    caches, builder = engine()
    _, other = engine()
    spec = MetadataSpec(window=8, topk=4)
    meta = build_step_metadata(builder.build(requests(caches, [(100, 1)])), spec)
    with pytest.raises(ValueError, match="out was built from another StepBatchBuilder's batch"):
        build_step_metadata(other.build(requests(caches, [(100, 1)])), spec, out=meta)


def test_one_plan_per_step_and_configuration(monkeypatch):
    made = []
    real = plan_module.LayerPlan
    monkeypatch.setattr(plan_module, "LayerPlan", lambda *a: made.append(a[1].kind) or real(*a))
    monkeypatch.setattr("sparse_mla.layer.LayerPlan", plan_module.LayerPlan)
    sc = make_scenario([(300, 1), (40, 2), (20, 6)], window=8, topk=4, block_sizes=SIZES, decode_threshold=2,
                       device=DEVICE)
    q = torch.randn(sc.batch.token_capacity, 2, 512).to(torch.bfloat16).to(DEVICE)
    c4a = [SparseMLAAttention("c4a", 2, window=8, topk=4, sink=torch.randn(2).to(DEVICE)) for _ in range(3)]
    outs = [layer(q, sc.meta, sc.caches, sc.topk_local) for layer in c4a]
    SparseMLAAttention("c128a", 2, window=8)(q, sc.meta, sc.caches)
    SparseMLAAttention("c4a", 2, window=8, topk=4)(q, sc.meta, sc.caches, sc.topk_local)  # no sink: another plan
    assert made == ["c4a", "c128a", "c4a"]
    # layers sharing a plan still use their own sinks
    assert not torch.equal(outs[0], outs[1])
    for layer, out in zip(c4a, outs):
        ref = sc.expected(q, "c4a", sink=layer.sink, scale=512 ** -0.5)
        assert ((out.double().cpu() - ref).norm() / ref.norm()).item() < 1e-2
    build_step_metadata(sc.batch, sc.meta.spec, out=sc.meta)  # a new build: plans are made again
    c4a[0](q, sc.meta, sc.caches, sc.topk_local)
    assert made[-1] == "c4a" and len(made) == 4


def test_caches_are_validated_once_per_tensor(monkeypatch):
    calls = []
    real = cache_views.resolve_cache
    monkeypatch.setattr(cache_views, "resolve_cache", lambda *a: calls.append(a[2]) or real(*a))
    cache = PagedCache(4, 4, "fp8_v4")
    first = plan_module.resolve_cache_arg(cache, "caches['swa']")
    assert plan_module.resolve_cache_arg(cache, "caches['swa']") == first and len(calls) == 1
    cache.data = cache.data[:2]  # another view: validated again
    assert plan_module.resolve_cache_arg(cache, "caches['swa']").tensor.shape[0] == 2 and len(calls) == 2
    # the ops read the same memo: a tensor a layer validated is not validated again, and a declared fmt is compared
    assert cache_views.resolve_cache_once(cache.data, "fp8_v4")[1].name == "fp8_v4" and len(calls) == 2
    with pytest.raises(ValueError, match="holds fp8_v4 data"):
        cache_views.resolve_cache_once(cache.data, "fp8_v32")
    tensor = torch.zeros(2, 4, 512, dtype=torch.bfloat16)
    assert cache_views.resolve_cache_once(tensor)[1].name == "bf16" and len(calls) == 3
    assert plan_module.resolve_cache_arg(tensor, "caches['swa']").fmt.name == "bf16" and len(calls) == 3
    tensor.set_(torch.zeros(3, 4, 512, dtype=torch.bfloat16))  # re-pointed in place: validated again
    assert cache_views.resolve_cache_once(tensor)[0].shape[0] == 3 and len(calls) == 4
    assert plan_module.resolve_cache_arg(tensor, "caches['swa']").tensor.shape[0] == 3 and len(calls) == 4
    with pytest.raises(TypeError, match=r"caches\['swa'\] must be a PagedCache or a paged cache tensor, got str"):
        plan_module.resolve_cache_arg("cache", "caches['swa']")


def test_a_layer_remembers_its_last_plan_but_no_cache(monkeypatch):
    """A layer called again on the same step and caches skips the plan lookup; other caches (or a new step) are
    looked up and read; the layer keeps no cache alive."""
    import gc
    import weakref

    from sparse_mla import layer as layer_module

    def filled(seed):
        gen = torch.Generator().manual_seed(seed)
        caches = {k: PagedCache(64, SIZES[k], "fp8_v4", device=DEVICE) for k in SIZES}
        for c in caches.values():
            c.write(torch.randn(c.num_slots, 512, generator=gen).to(torch.bfloat16).to(DEVICE),
                    torch.arange(c.num_slots, dtype=torch.int32, device=DEVICE))
        return caches

    caches, builder = filled(1), engine()[1]
    spec = MetadataSpec(window=8, topk=4)
    meta = build_step_metadata(builder.build(requests(caches, [(100, 1), (50, 2)])), spec)
    looked_up = []
    resolve = layer_module.resolve_cache_arg
    monkeypatch.setattr(layer_module, "resolve_cache_arg", lambda *a: looked_up.append(a[1]) or resolve(*a))
    layer = SparseMLAAttention("c128a", 2, window=8)
    q = torch.randn(16, 2, 512, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16).to(DEVICE)
    first = layer(q, meta, caches).clone()
    assert len(looked_up) == 2
    assert torch.equal(layer(q, meta, caches), first) and len(looked_up) == 2  # remembered
    other = filled(3)
    second = layer(q, meta, other).clone()
    assert len(looked_up) == 4 and not torch.equal(second, first)  # other caches: looked up, and read
    assert torch.equal(layer(q, meta, caches), first) and len(looked_up) == 6
    old_plan = weakref.ref(next(p for p in meta._plans.values() if isinstance(p, plan_module.LayerPlan)))
    build_step_metadata(builder.build(requests(caches, [(100, 1), (50, 2)])), spec, out=meta)
    gc.collect()
    assert old_plan() is None  # the layer's memory of the last step keeps none of it alive
    assert torch.equal(layer(q, meta, caches), first) and len(looked_up) == 8  # a new step: its own plans
    refs = [weakref.ref(c) for c in caches.values()] + [weakref.ref(c.data) for c in caches.values()]
    del caches
    gc.collect()
    assert all(r() is None for r in refs)


def test_a_cache_smaller_than_the_block_tables_is_named():
    caches, builder = engine(num_blocks=64)
    meta = build_step_metadata(builder.build(requests(caches, [(200, 1)])), MetadataSpec(window=8, topk=4))
    small = dict(caches, swa=PagedCache(10, 4, "fp8_v4", device=DEVICE))  # the tables name blocks up to 49
    q = torch.zeros(16, 2, 512, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match=r"caches\['swa'\] has 10 blocks, but the step's 'swa' block tables name "
                                         r"block 49"):
        SparseMLAAttention("swa", 2, window=8)(q, meta, small)


def test_a_layer_whose_kind_the_batch_lacks_is_named():
    caches, _ = engine()
    builder = StepBatchBuilder(16, 4, 600, kinds=("swa", "c4a"), block_sizes={"swa": 4, "c4a": 4}, device=DEVICE)
    reqs = [Request(100, 1, {k: list(range(blocks_needed(100, k, SIZES[k]))) for k in ("swa", "c4a")})]
    meta = build_step_metadata(builder.build(reqs), MetadataSpec(window=8, topk=4))
    q = torch.zeros(16, 2, 512, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="a c128a layer reads the 'c128a' cache, but the step's batch has no 'c128a' "
                                         "block table"):
        SparseMLAAttention("c128a", 2, window=8)(q, meta, caches)


def test_fingerprint_separates_what_triton_specialises_on():
    base = torch.zeros(64, dtype=torch.uint8)
    aligned, offset = base[:16], base[1:17]
    assert fingerprint((aligned, 32)) == fingerprint((base[16:32], 48))
    assert fingerprint((aligned, 32)) != fingerprint((offset, 32))  # 16-byte alignment
    assert fingerprint((aligned, 1)) != fingerprint((aligned, 3))  # == 1 is a constant
    assert fingerprint((aligned, 16)) != fingerprint((aligned, 17))  # divisibility by 16
    assert fingerprint((aligned, 17)) != fingerprint((aligned, 1 << 33))  # int32 or int64
    assert fingerprint((aligned, 2.0)) != fingerprint((aligned.to(torch.int32), 2.0))  # dtype


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("index_form", ["padded", "ragged", "combined"])
def test_a_whole_decode_step_captured_once_replays_for_other_batches(index_form):
    from sparse_mla.graphs import StepGraph

    spec = MetadataSpec(window=8, topk=4)
    caches, builder = engine(num_blocks=1024, max_tokens=8, max_reqs=4, max_model_len=1000)
    for c in caches.values():
        c.write(torch.randn(c.num_slots, 512).to(torch.bfloat16).to(DEVICE),
                torch.arange(c.num_slots, dtype=torch.int32, device=DEVICE))
    gen = torch.Generator().manual_seed(3)
    layers = [SparseMLAAttention(k, 4, window=8, topk=4 if k == "c4a" else None, sink=torch.randn(4).to(DEVICE),
                                 index_form=index_form)
              for k in ("swa", "c4a", "c128a", "c4a")]
    q = torch.randn(8, 4, 512, generator=gen).to(torch.bfloat16).to(DEVICE)
    picks = torch.zeros(8, 4, dtype=torch.int32, device=DEVICE)
    outs = [torch.empty(8, 4, 512, dtype=torch.bfloat16, device=DEVICE) for _ in layers]
    meta = None

    def step(batch):
        build_step_metadata(batch, spec, out=meta)
        for layer, out in zip(layers, outs):
            layer(q, meta, caches, picks if layer.kind == "c4a" else None, out=out)

    def new_batch(lengths):
        batch = builder.build(requests(caches, lengths))
        picks.copy_(random_picks(batch.positions.cpu(), 4, gen, 250, ratio=4).to(DEVICE))
        return batch

    first = new_batch([(900, 2), (40, 1), (500, 2), (130, 1)])
    meta = build_step_metadata(first, spec)
    graph = StepGraph(step, first, meta)
    for lengths in ([(100, 1), (800, 2), (33, 2), (600, 1)], [(999, 2), (1, 1), (256, 1), (257, 2)]):
        batch = new_batch(lengths)
        with pytest.raises(ValueError, match="stale step"):  # built, not yet replayed: the lists are the last step's
            meta.swa_indices
        graph.replay(batch)
        assert meta.swa_indices is not None and meta.batch is batch  # a replay leaves the metadata current
        replayed = [o.clone() for o in outs]
        step(batch)  # eager, same inputs
        for got, want in zip(replayed, outs):
            assert torch.equal(got, want)
        assert not any(math.isnan(o.float().sum().item()) for o in replayed)
    with pytest.raises(ValueError, match="batch has shape"):
        graph.replay(new_batch([(100, 1), (800, 2), (33, 2)]))
    # a table naming a block past a captured cache: eager calls check it in each step's plan, a replay too
    far = builder.build(requests(caches, [(100, 1), (800, 2), (33, 2), (600, 1)], first_block=1024))
    with pytest.raises(ValueError, match=r"block tables name block \d+, but the captured step reads a 'swa' cache "
                                         r"of 1024 blocks"):
        graph.replay(far)


@pytest.mark.skipif(not ON_GPU, reason="bound launches are the GPU's direct launch path")
@pytest.mark.parametrize("invariant", [False, True], ids=["unsplit", "split"])
def test_bound_layer_launches_equal_the_planned_ones(monkeypatch, invariant):
    """From a plan's second call on, a layer launches through its bound launches (the attention, the combine of
    split key lists, the picks' conversion) on the call's own tensors: the oracle's answer, and the same bits as the
    plan's launches, which a q laid out differently or a new scale still take."""
    from sparse_mla.ops import attention_plan

    sc = make_scenario([(3000, 2)] * 40, window=128, topk=64, decode_threshold=2, device=DEVICE, seed=5)
    gen = torch.Generator().manual_seed(6)
    cap, rows = sc.batch.token_capacity, list(range(0, sc.batch.num_tokens, 7))
    sink = torch.randn(16, generator=gen).to(DEVICE)
    planned = []
    plan_call = attention_plan.AttentionPlan.__call__
    monkeypatch.setattr(attention_plan.AttentionPlan, "__call__",
                        lambda self, *a: planned.append(1) or plan_call(self, *a))
    for kind in ("swa", "c4a", "c128a"):
        topk = 64 if kind == "c4a" else None
        layer = SparseMLAAttention(kind, 16, topk=topk, sink=sink, batch_invariant=invariant)  # split: invariant
        binding_picks = sc.topk_local.clone() if kind == "c4a" else None
        layer(torch.randn(cap, 16, 512, generator=gen).to(torch.bfloat16).to(DEVICE), sc.meta, sc.caches,
              binding_picks)
        if binding_picks is not None:
            binding_picks.fill_(-1)  # a bound conversion reading the binding call's picks would lose every pick
        picks = sc.topk_local.clone() if kind == "c4a" else None
        wide = torch.randn(cap, 32, 512, generator=gen).to(torch.bfloat16).to(DEVICE)
        for q, plan_launches in ((torch.randn(cap, 16, 512, generator=gen).to(torch.bfloat16).to(DEVICE), 0),
                                 (wide[:, ::2], 1)):
            before = len(planned)
            got = layer(q, sc.meta, sc.caches, picks).clone()
            assert len(planned) - before == plan_launches  # the bound launch where q is laid out as when bound
            ref = sc.expected(q, kind, rows, sink, layer.scale)
            assert (got[rows].double().cpu() - ref).norm() / ref.norm() < 1e-2
            # another configuration's plan (the Triton backend named): its first call launches through the plan
            want = SparseMLAAttention(kind, 16, topk=topk, sink=sink, backend="triton", batch_invariant=invariant)(
                q, sc.meta, sc.caches, picks)
            assert torch.equal(got, want)
            scale, before = layer.scale, len(planned)
            layer.scale = scale * 1.5  # the bound launch has the binding call's scale: another goes the plan's way
            got = layer(q, sc.meta, sc.caches, picks).clone()
            assert len(planned) - before == 1
            want = SparseMLAAttention(kind, 16, topk=topk, sink=sink, scale=layer.scale, backend="triton",
                                      batch_invariant=invariant)(q, sc.meta, sc.caches, picks)
            assert torch.equal(got, want)
            layer.scale = scale
        plans = [p for p in sc.meta._plans.values() if isinstance(p, plan_module.LayerPlan) and p.kind == kind
                 and p.backend == "auto" and p.batch_invariant == invariant]
        assert len(plans) == 1 and plans[0]._bound[0].bound and plans[0].parts[0][2].partial == invariant


def test_identity_memo_remakes_on_a_new_stamp_and_forgets_dead_objects():
    import gc

    from sparse_mla.cache_views import IdentityMemo

    memo, made = IdentityMemo(), []
    t = torch.zeros(3)
    make = lambda: made.append(1) or len(made)  # noqa: E731
    assert memo.get(t, "a", make) == 1 and memo.get(t, "a", make) == 1
    assert memo.get(t, "b", make) == 2  # the stamp changed: made again
    del t
    gc.collect()
    assert memo._entries == {}  # the entry left with its object


@pytest.mark.parametrize("fmt,four_d", [("bf16", False), ("fp8_v4", True)])
def test_a_cache_seen_by_a_layer_is_freed_with_its_owner(fmt, four_d):
    """The validation memos hold no strong reference to a cache (or a view of it) beyond its owner's life."""
    import gc
    import weakref

    cache = PagedCache(2, 4, fmt)
    tensor = cache.data.unsqueeze(2) if four_d else cache.data  # FlashMLA's 4-D form: the memo keeps a 3-D view
    plan_module.resolve_cache_arg(tensor, "caches['swa']")
    refs = [weakref.ref(t) for t in (cache, cache.data, tensor)]
    del cache, tensor
    gc.collect()
    assert all(r() is None for r in refs)


@pytest.mark.skipif(not ON_GPU, reason="the Triton launches and CUDA graphs of a GPU (run under compute-sanitizer)")
@pytest.mark.parametrize("change", SINK_CHANGES)
def test_a_sink_changed_after_the_first_call_is_refused_on_the_remembered_planned_and_captured_paths(change):
    """A layer's sink re-pointed under it (``sink.data = ...``, ``resize_``) is refused before any launch reads it:
    on the layer's remembered plan, on a new step's plan, in a capture's warm-up and in the replay of a step captured
    before the change (the graph would read the captured storage). ``compute-sanitizer --tool memcheck``: 0 errors."""
    from sparse_mla.graphs import StepGraph

    spec = MetadataSpec(window=8, topk=4)
    caches, builder = engine(num_blocks=256, max_tokens=8, max_reqs=4)
    for c in caches.values():
        c.write(torch.randn(c.num_slots, 512).to(torch.bfloat16).to(DEVICE),
                torch.arange(c.num_slots, dtype=torch.int32, device=DEVICE))
    layer = SparseMLAAttention("swa", 4, window=8, sink=torch.randn(4).to(DEVICE), backend="triton")
    q = torch.randn(8, 4, 512).to(torch.bfloat16).to(DEVICE)
    out = torch.empty(8, 4, 512, dtype=torch.bfloat16, device=DEVICE)
    meta = build_step_metadata(builder.build(requests(caches, [(300, 2), (40, 1), (120, 1)])), spec)

    def step(batch):
        build_step_metadata(batch, spec, out=meta)
        layer(q, meta, caches, out=out)

    graph = StepGraph(step, meta.batch, meta)
    layer(q, meta, caches)  # eager: its plan is the layer's remembered one
    kept = layer.sink
    repoint_sink(layer, change)
    assert layer.sink is kept
    message = r"sink must have shape \(4,\), got \((2|64),\): one float32 logit per head of the layer's 4 heads"
    with pytest.raises(ValueError, match=message):  # remembered
        layer(q, meta, caches)
    batch = builder.build(requests(caches, [(310, 2), (41, 1), (121, 1)]))
    with pytest.raises(ValueError, match="sink was replaced or resized since the step was captured"):
        graph.replay(batch)
    with pytest.raises(ValueError, match=message):  # a capture's warm-up, on this batch's new plan
        StepGraph(step, batch, meta)
    fresh = build_step_metadata(builder.build(requests(caches, [(90, 1)])), spec)
    with pytest.raises(ValueError, match=message):  # planned: a step the layer has not run
        layer(q, fresh, caches)
    torch.cuda.synchronize()
    # values written in place are read by a replay: no refusal
    layer.sink.data = torch.randn(4, device=DEVICE)
    batch = builder.build(requests(caches, [(300, 2), (40, 1), (120, 1)]))
    meta = build_step_metadata(batch, spec)
    graph = StepGraph(step, batch, meta)
    layer.sink.copy_(torch.randn(4, device=DEVICE))
    batch = builder.build(requests(caches, [(305, 2), (44, 1), (100, 1)]))
    graph.replay(batch)
    replayed = out.clone()
    step(batch)
    assert torch.equal(replayed, out)


def test_the_whole_step_and_a_rank_s_share_are_both_step_lists():
    """What a layer reads of a step (plan.StepLists) is declared once, and both kinds of metadata have all of it: the
    layer tests no type, so a member one of them lacks would be an AttributeError in the middle of a call."""
    import dataclasses

    from sparse_mla.context_parallel import RankStepMetadata
    from sparse_mla.metadata import StepMetadata

    members = {n for n in plan_module.StepLists.__annotations__} | {
        n for n, v in vars(plan_module.StepLists).items() if callable(v) and not n.startswith("__")}
    assert {"batch", "world", "plan", "check_gather", "picks_indices"} <= members
    for cls in (StepMetadata, RankStepMetadata):
        has = {f.name for f in dataclasses.fields(cls)} | set(dir(cls))
        assert members <= has, (cls.__name__, sorted(members - has))
    assert StepMetadata.world == 1

