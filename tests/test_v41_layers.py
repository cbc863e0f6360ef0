"""DeepSeek-V4.1 layers end to end (DESIGN §1, §3; design notes §3): the 128-token window on every layer, compressed
scopes of ratio 2 (``c2a``) and ratio 1 (``c1a``) with indexer picks, sinks; StepBatch -> metadata -> layer against
the float64 dense oracle (relative error <= 1e-2).

Caches are poisoned (NaN) everywhere no token may look, so reading a wrong slot shows as NaN. V4's formats run on
every backend; V4.1's own formats (fp8_v41 / fp4_v41, both page layouts) on the reference backend, and on the Triton
backend once its kernels read them (the ``triton`` cases skip with ``launch_configs.unsupported``'s reason until
then, and run from the day they land).
"""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import DEVICE, examples, rel_err
from sparse_mla.batch import Request, StepBatchBuilder, blocks_needed
from sparse_mla.cache import PagedCache
from sparse_mla.config import V41_KINDS
from sparse_mla.layer import SparseMLAAttention
from sparse_mla.metadata import MetadataSpec, build_step_metadata
from sparse_mla.scenario import make_scenario, random_picks
from engine import Engine
from strategies import step_lengths

SIZES = {"swa": 4, "c2a": 4, "c1a": 8}
HEADS = 3
TOL = 1e-2  # relative Frobenius error, bf16 output (DESIGN §7.1)
PICKS = ("c2a", "c1a")
# (window cache format, compressed caches' format): V4.1's own, in both page layouts, and fp4 beside fp8
V41_PAIRS = [("fp8_v41", "fp8_v41"), ("fp8_v41", "fp4_v41"), ("fp8_v41_planar", "fp8_v41_planar"),
             ("fp4_v41", "fp4_v41")]


def run_layer(sc, kind, window, topk, backend, mode="paged", sink=None, picks=None, seed=0, workspace_rows=4096):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(sc.batch.token_capacity, HEADS, 512, generator=gen).to(torch.bfloat16).to(DEVICE)
    layer = SparseMLAAttention(kind, HEADS, window=window, topk=topk if kind in PICKS else None, sink=sink,
                               prefill_mode=mode, workspace_bytes=workspace_rows * 1024, backend=backend)
    out = torch.full((sc.batch.token_capacity, HEADS, 512), math.nan, dtype=torch.bfloat16, device=DEVICE)
    if kind in PICKS and picks is None:
        picks = sc.picks[kind]
    got = layer(q, sc.meta, sc.caches, picks if kind in PICKS else None, out=out)
    assert got is out and not out.isnan().any()
    assert (out[sc.batch.num_tokens:] == 0).all(), "padding tokens get zeros"
    return q, out, layer


@settings(max_examples=examples(30), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=step_lengths(prefixes=st.sampled_from([0, 3, 7, 130, 260])), kind=st.sampled_from(V41_KINDS),
       fmt=st.sampled_from(["bf16", "fp8_v4"]), mode=st.sampled_from(["paged", "workspace"]),
       window=st.sampled_from([4, 8, 16]), padding=st.integers(0, 3), slack=st.integers(0, 40),
       seed=st.integers(0, 2**31 - 1), backend=st.sampled_from(["auto", "triton"]))
def test_v41_kinds_in_v4_formats_match_the_dense_oracle_on_every_backend(case, kind, fmt, mode, window, padding,
                                                                          slack, seed, backend):
    """MTP decodes (1-4 tokens), chunked prefills after short and long prefixes, padding rows; V4's formats, which
    every backend reads."""
    lengths, threshold = case
    topk = 10
    sc = make_scenario(lengths, window=window, topk=topk, fmt=fmt, decode_threshold=threshold, padding=padding,
                       seed=seed, block_sizes=SIZES, device=DEVICE, kinds=V41_KINDS)
    sink = torch.randn(HEADS, generator=torch.Generator().manual_seed(seed)).to(DEVICE)
    # workspace: just enough for the neediest token plus `slack` rows (ratio 1 keeps every position), so long
    # prefills get split
    rows = window + max(s for s, _ in lengths) + slack
    q, out, layer = run_layer(sc, kind, window, topk, backend, mode, sink, seed=seed, workspace_rows=rows)
    assert rel_err(out, sc.expected(q, kind, sink=sink, scale=layer.scale)) < TOL


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("fmt,comp_fmt", V41_PAIRS, ids=[f"{a}+{b}" for a, b in V41_PAIRS])
@pytest.mark.parametrize("kind", V41_KINDS)
def test_v41_formats_match_the_dense_oracle(kind, fmt, comp_fmt, backend):
    """V4.1's own formats: both page layouts, an fp4 compressed cache beside an fp8 window cache; two MTP decodes,
    a chunked prefill after a prefix longer than the window, a fresh prefill, padding rows."""
    lengths = [(300, 2), (41, 1), (150, 20), (13, 13)]
    sc = make_scenario(lengths, window=8, topk=12, fmt=fmt, compressed_fmt=comp_fmt, decode_threshold=2, padding=3,
                       seed=7, block_sizes=SIZES, device=DEVICE, kinds=V41_KINDS)
    assert sc.caches["swa"].fmt.name == fmt and sc.caches["c2a"].fmt.name == sc.caches["c1a"].fmt.name == comp_fmt
    sink = torch.tensor([0.5, -math.inf, 2.0], device=DEVICE)
    for mode in ("paged", "mixed", "workspace"):  # the workspace gathers a page-planar pool by its format's name
        q, out, layer = run_layer(sc, kind, 8, 12, backend, mode, sink, workspace_rows=200)
        assert rel_err(out, sc.expected(q, kind, sink=sink, scale=layer.scale)) < TOL, mode


@pytest.mark.parametrize("index_form", ["ragged", "combined"])
@pytest.mark.parametrize("fmt,comp_fmt,backend", [("bf16", "bf16", "triton"), ("fp8_v41", "fp4_v41", "reference")])
def test_v41_kinds_in_the_other_index_forms(index_form, fmt, comp_fmt, backend):
    sc = make_scenario([(120, 2), (30, 1), (70, 12)], window=8, topk=10, fmt=fmt, compressed_fmt=comp_fmt,
                       decode_threshold=2, padding=1, seed=3, block_sizes=SIZES, device=DEVICE, kinds=V41_KINDS)
    sink = torch.randn(HEADS, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    q = torch.randn(sc.batch.token_capacity, HEADS, 512, generator=torch.Generator().manual_seed(5))
    q = q.to(torch.bfloat16).to(DEVICE)
    for kind in PICKS:
        layer = SparseMLAAttention(kind, HEADS, window=8, topk=10, sink=sink, backend=backend, index_form=index_form)
        out = layer(q, sc.meta, sc.caches, sc.picks[kind])
        assert rel_err(out, sc.expected(q, kind, sink=sink, scale=layer.scale)) < TOL


def test_compressed_visibility_of_ratios_2_and_1():
    """Entry w is visible to position p iff (w+1)·r <= p+1: c2a entry 4 (tokens 8, 9) from p = 9, c1a entry 9 (token
    9) from p = 9; picks a token cannot see are dropped, never attended."""
    picks = {"c2a": torch.tensor([[4, 3, 5, -1], [4, 5, 0, 9]], dtype=torch.int32, device=DEVICE),
             "c1a": torch.tensor([[9, 8, 10, -1], [9, 10, 11, 3]], dtype=torch.int32, device=DEVICE)}
    sc = make_scenario([(10, 2)], window=4, topk=4, fmt="bf16", decode_threshold=2, picks=picks, block_sizes=SIZES,
                       kinds=V41_KINDS, device=DEVICE)
    assert sc.meta.picks_for("c2a", picks["c2a"])[1].tolist() == [1, 2]  # p=8: 3 only; p=9: 4 and 0
    assert sc.meta.picks_for("c1a", picks["c1a"])[1].tolist() == [1, 2]  # p=8: 8; p=9: 9 and 3
    visible_only = {"c2a": [[3, -1, -1, -1], [4, 0, -1, -1]], "c1a": [[8, -1, -1, -1], [9, 3, -1, -1]]}
    for kind in PICKS:
        q, out, layer = run_layer(sc, kind, 4, 4, "reference")
        assert rel_err(out, sc.expected(q, kind, scale=layer.scale)) < TOL
        # the invisible picks (c2a entry 4 at p = 8, c1a entry 9 at p = 8) hold real values: attending them would show
        visible = torch.tensor(visible_only[kind], dtype=torch.int32, device=DEVICE)
        assert torch.equal(layer(q, sc.meta, sc.caches, visible), out)


def test_layers_share_a_source_layer_s_compressed_cache_and_reuse_picks():
    """V4.1's wiring: layers read the compressed cache their kv source layer wrote (one PagedCache object per source)
    beside windows of their own, and attend with the picks of their index source (one picks tensor, converted by each
    layer). Every layer matches its own oracle; two layers with one source's cache and picks but their own windows
    give different outputs; two index sources over one compressed cache give each its own answer."""
    sc = make_scenario([(200, 1), (90, 2), (64, 30)], window=8, topk=16, fmt="fp8_v41", compressed_fmt="fp4_v41",
                       decode_threshold=2, padding=2, seed=11, block_sizes=SIZES, device=DEVICE, kinds=V41_KINDS)
    sink = torch.randn(HEADS, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    layers = [sc, sc.own_window(21), sc.own_window(22)]  # a source layer and two later layers with their windows
    assert len({id(s.caches["c1a"]) for s in layers}) == 1 and len({id(s.caches["swa"]) for s in layers}) == 3
    picks = sc.picks["c1a"]
    # a second index source over the same compressed cache: other picks among the entries the first one wrote
    drop = torch.rand(picks.shape, generator=torch.Generator().manual_seed(2)) < 0.4
    other = torch.where(drop.to(picks.device), -1, picks.flip(1))
    outs = []
    for i, view in enumerate(layers):
        for p in (picks, other):
            q, out, layer = run_layer(view, "c1a", 8, 16, "auto", sink=sink, picks=p, seed=i)
            assert rel_err(out, view.expected(q, "c1a", sink=sink, scale=layer.scale, picks=p)) < TOL
            outs.append(out.clone())
        assert torch.equal(sc.meta.picks_for("c1a", picks)[1], sc.meta.picks_for("c1a", picks.clone())[1])
    assert not torch.equal(outs[0], outs[1]) and not torch.equal(outs[0], outs[2])


@pytest.mark.parametrize("fmt,comp_fmt,backend", [("bf16", "bf16", "auto"), ("fp8_v4", "fp8_v4", "triton"),
                                                  ("fp8_v41", "fp4_v41", "reference")])
def test_an_engine_loop_over_steps_reuses_its_buffers(fmt, comp_fmt, backend):
    """Prefill from scratch, a chunk crossing the window, decodes with MTP drafts; the metadata refilled in place
    (fixed buffers, as a CUDA graph needs), c2a / c1a entries completed by each step's tokens."""
    eng = Engine(SIZES, fmt, window=8, topk=6, comp_fmt=comp_fmt, max_len=300)
    layers = {k: SparseMLAAttention(k, HEADS, window=8, topk=6 if k in PICKS else None, sink=torch.randn(HEADS),
                                    backend=backend).to(DEVICE) for k in V41_KINDS}
    schedule = [[(0, 24, 24)], [(0, 60, 36), (1, 12, 12)], [(1, 13, 1), (0, 72, 12), (2, 9, 9)],
                [(0, 75, 3), (1, 15, 2), (2, 10, 1)]]
    out = torch.empty(eng.builder.max_tokens, HEADS, 512, dtype=torch.bfloat16, device=DEVICE)
    ptrs = None
    for work in schedule:
        batch, oracle = eng.step(work)
        gen = torch.Generator().manual_seed(len(work))
        q = torch.randn(batch.token_capacity, HEADS, 512, generator=gen).to(torch.bfloat16).to(DEVICE)
        picks = {"c2a": random_picks(batch.positions.cpu(), 6, gen, 62, ratio=2).to(DEVICE),
                 "c1a": random_picks(batch.positions.cpu(), 6, gen, 125, ratio=1).to(DEVICE)}
        bufs = (eng.meta.swa_indices.data_ptr(), eng.meta.picks_for("c2a", picks["c2a"])[0].data_ptr(),
                eng.meta.decode_orders["c1a"].data_ptr())
        ptrs = ptrs or bufs
        assert bufs == ptrs
        for kind, layer in layers.items():
            p = picks.get(kind)
            layer(q, eng.meta, eng.caches, p, out=out)
            ref, _ = oracle.attend(q, batch.token_to_req, batch.positions, kind, layer.sink, layer.scale, p)
            assert not out.isnan().any()
            assert rel_err(out, ref) < TOL, (work, kind)


@pytest.mark.parametrize("caches,match", [
    (lambda sc: dict(sc.caches, swa=PagedCache(8, 4, "fp4_v41"), c2a=PagedCache(8, 4, "fp8_v41")),
     r"cache format mismatch: caches\['swa'\] holds fp4_v41, caches\['c2a'\] fp8_v41"),
    (lambda sc: dict(sc.caches, c2a=PagedCache(8, 4, "bf16")), r"cache format mismatch"),
])
def test_bad_format_pairs_are_value_errors_naming_them(caches, match):
    sc = make_scenario([(20, 1)], window=4, topk=4, fmt="fp8_v41", block_sizes=SIZES, kinds=V41_KINDS)
    layer = SparseMLAAttention("c2a", 2, window=4, topk=4, backend="reference")
    with pytest.raises(ValueError, match=match):
        layer(torch.zeros(1, 2, 512, dtype=torch.bfloat16), sc.meta, caches(sc), sc.picks["c2a"])


def test_v41_kinds_need_their_block_tables_and_their_picks():
    v4 = make_scenario([(20, 1)], window=4, topk=4, block_sizes={"swa": 4, "c4a": 4, "c128a": 2})
    with pytest.raises(ValueError, match=r"the step's batch has no 'c2a' block table"):
        SparseMLAAttention("c2a", 2, window=4, topk=4)(torch.zeros(1, 2, 512, dtype=torch.bfloat16), v4.meta,
                                                       dict(v4.caches, c2a=PagedCache(4, 4)), v4.topk_local)
    with pytest.raises(ValueError, match=r"topk \(the indexer width\) is required for a c1a layer"):
        SparseMLAAttention("c1a", 2)
    with pytest.raises(ValueError, match=r"compress_ratio must be None or the int 2 \(a c2a layer's ratio\), got 4"):
        SparseMLAAttention("c2a", 2, topk=4, compress_ratio=4)
    sc = make_scenario([(20, 1)], window=4, topk=4, fmt="bf16", block_sizes=SIZES, kinds=V41_KINDS)
    with pytest.raises(ValueError, match=r"topk_indices must be given to a c2a layer"):
        SparseMLAAttention("c2a", 2, window=4, topk=4)(torch.zeros(1, 2, 512, dtype=torch.bfloat16), sc.meta,
                                                       sc.caches)
    with pytest.raises(ValueError, match=r"kind must be a kind of this batch that takes indexer picks"):
        v4.meta.picks_for("c1a", v4.topk_local)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA graphs need a GPU")
def test_a_v41_decode_step_captured_once_replays_for_other_batches():
    """swa, c2a, c1a and a second c2a layer reusing the first's cache and picks, in one CUDA graph (bf16 caches,
    which the kernels read today)."""
    from sparse_mla.graphs import StepGraph

    spec = MetadataSpec(window=8, topk=4)
    caches = {k: PagedCache(1024, SIZES[k], "bf16", device=DEVICE) for k in SIZES}
    for c in caches.values():
        c.write(torch.randn(c.num_slots, 512).to(torch.bfloat16).to(DEVICE),
                torch.arange(c.num_slots, dtype=torch.int32, device=DEVICE))
    builder = StepBatchBuilder(8, 4, 1000, kinds=V41_KINDS, block_sizes=SIZES, decode_threshold=2, device=DEVICE)
    gen = torch.Generator().manual_seed(3)
    layers = [SparseMLAAttention(k, 4, window=8, topk=4 if k in PICKS else None, sink=torch.randn(4).to(DEVICE))
              for k in ("swa", "c2a", "c1a", "c2a")]
    q = torch.randn(8, 4, 512, generator=gen).to(torch.bfloat16).to(DEVICE)
    picks = {k: torch.zeros(8, 4, dtype=torch.int32, device=DEVICE) for k in PICKS}
    outs = [torch.empty(8, 4, 512, dtype=torch.bfloat16, device=DEVICE) for _ in layers]
    meta = None

    def step(batch):
        build_step_metadata(batch, spec, out=meta)
        for layer, out in zip(layers, outs):
            layer(q, meta, caches, picks.get(layer.kind), out=out)

    def new_batch(lengths):
        start = [0]

        def table(kind, seq_len):  # distinct blocks per request
            n = blocks_needed(seq_len, kind, SIZES[kind])
            first = start[0]
            return list(range(first, first + n))

        requests = []
        for seq_len, q_len in lengths:
            requests.append(Request(seq_len, q_len, {k: table(k, seq_len) for k in SIZES}))
            start[0] += 250
        batch = builder.build(requests)
        for kind, ratio in (("c2a", 2), ("c1a", 1)):
            picks[kind].copy_(random_picks(batch.positions.cpu(), 4, gen, 990 // ratio, ratio=ratio).to(DEVICE))
        return batch

    first = new_batch([(900, 2), (40, 1), (500, 2), (130, 1)])
    meta = build_step_metadata(first, spec)
    graph = StepGraph(step, first, meta)
    for lengths in ([(100, 1), (800, 2), (33, 2), (600, 1)], [(999, 2), (1, 1), (256, 1), (257, 2)]):
        batch = new_batch(lengths)
        graph.replay(batch)
        replayed = [o.clone() for o in outs]
        step(batch)  # eager, same inputs
        for got, want in zip(replayed, outs):
            assert torch.equal(got, want)
        assert not any(math.isnan(o.float().sum().item()) for o in replayed)
