"""SparseMLAAttention end to end: StepBatch -> metadata -> layer, against the dense oracle (DESIGN §5, §7.1).

Caches are poisoned (NaN) everywhere no token may look, so reading a wrong slot shows as NaN.
"""
from __future__ import annotations

import math
import pathlib
import random
import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sparse_mla.batch import Request, StepBatchBuilder, blocks_needed
from sparse_mla.cache import PagedCache
from sparse_mla.formats import decode_records, encode_records, get_format
from sparse_mla import workspace as workspace_module
from sparse_mla import plan as plan_module
from sparse_mla.layer import SparseMLAAttention
from sparse_mla.metadata import MetadataSpec, build_step_metadata
from sparse_mla.oracle import DenseOracle
from sparse_mla.scenario import make_scenario, random_picks
from engine import Engine
from helpers import SINK_CHANGES, examples, repoint_sink
from strategies import step_lengths

SIZES = {"swa": 4, "c4a": 4, "c128a": 2}
HEADS = 3
TOL = 1e-2  # relative Frobenius error, bf16 output (DESIGN §7.1)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # backend "auto": Triton on a GPU, the reference here


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double().cpu() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def steps():
    return step_lengths(prefixes=st.sampled_from([0, 3, 7, 130, 260]))


@settings(max_examples=examples(30), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=steps(), kind=st.sampled_from(["swa", "c4a", "c128a"]), fmt=st.sampled_from(["bf16", "fp8_v4"]),
       mode=st.sampled_from(["paged", "workspace"]), window=st.sampled_from([4, 8, 16]),
       padding=st.integers(0, 3), slack=st.integers(0, 40), seed=st.integers(0, 2**31 - 1),
       backend=st.sampled_from(["auto", "triton"]))
def test_layer_matches_dense_oracle(case, kind, fmt, mode, window, padding, slack, seed, backend):
    lengths, threshold = case
    topk = 10
    sc = make_scenario(lengths, window=window, topk=topk, fmt=fmt, decode_threshold=threshold, padding=padding,
                       seed=seed, block_sizes=SIZES, device=DEVICE)
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(sc.batch.token_capacity, HEADS, 512, generator=gen).to(torch.bfloat16).to(DEVICE)
    sink = torch.randn(HEADS, generator=gen).to(DEVICE)
    # workspace: just enough for the neediest token plus `slack` rows, so long prefills get split
    rows = window + max(s for s, _ in lengths) // 4 + slack
    layer = SparseMLAAttention(kind, HEADS, window=window, topk=topk if kind == "c4a" else None, sink=sink,
                               prefill_mode=mode, workspace_bytes=rows * 1024, backend=backend)
    out = torch.full((sc.batch.token_capacity, HEADS, 512), math.nan, dtype=torch.bfloat16, device=DEVICE)
    got = layer(q, sc.meta, sc.caches, sc.topk_local if kind == "c4a" else None, out=out)
    assert got is out
    assert not out.isnan().any()
    assert (out[sc.batch.num_tokens:] == 0).all(), "padding tokens get zeros"
    assert rel_err(out, sc.expected(q, kind, sink=sink, scale=layer.scale)) < TOL


def test_invisible_indexer_picks_are_dropped_never_attended():
    # tokens at positions 38, 39 of a 40-token request (W = 4): position 39 sees entries 0..9, 38 sees 0..8
    picks = torch.tensor([[9, 2, 500, -1, 10], [2, 10, 9, 10**6, 5]], dtype=torch.int32)
    sc = make_scenario([(40, 2)], window=4, topk=5, block_sizes=SIZES, decode_threshold=2, picks=picks)
    q = torch.randn(2, 2, 512).to(torch.bfloat16)
    layer = SparseMLAAttention("c4a", 2, window=4, topk=5, backend="reference")
    out = layer(q, sc.meta, sc.caches, picks).clone()
    idx, lens = sc.meta.c4a_indices(picks)
    assert lens.tolist() == [1, 3]  # token 0 (p=38): 2 only (9 needs p >= 39); token 1: 2, 9, 5 (10 needs p >= 43)
    visible_only = torch.tensor([[2, -1, -1, -1, -1], [2, 9, 5, -1, -1]], dtype=torch.int32)
    assert torch.equal(layer(q, sc.meta, sc.caches, visible_only), out)
    assert rel_err(out, sc.expected(q, "c4a", scale=layer.scale)) < TOL
    # the picked-but-invisible entries 9 and 10 hold real values: attending them would change the output
    assert not torch.isnan(sc.caches["c4a"].read(torch.tensor([int(sc.batch.block_tables["c4a"][0, 2]) * 4 + 1],
                                                              dtype=torch.int32))).any()


@pytest.mark.parametrize("kind", ["swa", "c4a", "c128a"])
def test_decode_calls_take_the_step_s_decode_order(monkeypatch, kind):
    """Decode rows go to the op with the metadata's order (compressed kinds), paged prefill rows without."""
    calls = []
    op = plan_module.sparse_attention_decode
    monkeypatch.setattr(plan_module, "sparse_attention_decode",
                        lambda q, *a, order=None, **kw: calls.append((q.shape[0], order)) or op(q, *a, order=order, **kw))
    sc = make_scenario([(300, 1), (40, 1), (200, 1), (20, 6)], window=8, topk=4, block_sizes=SIZES, decode_threshold=1)
    q = torch.randn(sc.batch.token_capacity, 2, 512).to(torch.bfloat16)
    layer = SparseMLAAttention(kind, 2, window=8, topk=4 if kind == "c4a" else None, backend="reference")
    layer(q, sc.meta, sc.caches, sc.topk_local if kind == "c4a" else None)
    (n_dec, order), (n_pre, no_order) = calls
    assert (n_dec, n_pre, no_order) == (3, 6, None)
    expected = sc.meta.decode_order(kind)
    assert order is None if expected is None else torch.equal(order, expected)
    if kind == "c128a":
        assert order.tolist() == [0, 2, 1]  # c128a entries 2, 0, 1: key blocks (with the window's) 2, 1, 2


def test_sink_semantics():
    sc = make_scenario([(30, 1), (20, 6)], window=8, topk=4, block_sizes=SIZES)
    q = torch.randn(sc.batch.token_capacity, 2, 512).to(torch.bfloat16)
    run = lambda sink: SparseMLAAttention("swa", 2, window=8, sink=sink, backend="reference")(q, sc.meta, sc.caches)
    assert (run(torch.full((2,), math.inf)) == 0).all()  # +inf sink zeroes the rows
    assert torch.equal(run(None), run(torch.full((2,), -math.inf)))  # -inf = no sink
    sink = torch.tensor([0.0, 3.0])
    assert rel_err(run(sink), sc.expected(q, "swa", sink=sink, scale=512 ** -0.5)) < TOL


@pytest.mark.parametrize("fmt,mode", [("fp8_v4", "paged"), ("bf16", "workspace")])
def test_an_engine_loop_reuses_its_buffers_over_steps(fmt, mode):
    eng = Engine(SIZES, fmt, window=8, topk=6)
    layers = {k: SparseMLAAttention(k, HEADS, window=8, topk=6 if k == "c4a" else None, sink=torch.randn(HEADS),
                                    prefill_mode=mode, workspace_bytes=200 * 1024).to(DEVICE)
              for k in SIZES}
    schedule = [
        [(0, 70, 70)],                               # a prefill from scratch
        [(0, 130, 60), (1, 12, 12)],                 # a chunk after a 70-token prefix (crosses 128), a new one
        [(1, 13, 1), (0, 150, 20), (2, 9, 9)],       # a decode, a prefill chunk, a new request
        [(0, 153, 3), (1, 15, 2), (2, 10, 1)],       # decodes with 2 MTP draft tokens, with 1, plain
    ]
    out = torch.empty(eng.builder.max_tokens, HEADS, 512, dtype=torch.bfloat16, device=DEVICE)
    ptr = None
    for work in schedule:
        batch, oracle = eng.step(work)
        if ptr is None:
            ptr = eng.meta.swa_indices.data_ptr()
        assert eng.meta.swa_indices.data_ptr() == ptr
        gen = torch.Generator().manual_seed(len(work))
        q = torch.randn(batch.token_capacity, HEADS, 512, generator=gen).to(torch.bfloat16).to(DEVICE)
        picks = random_picks(batch.positions.cpu(), 6, gen, num_entries=45).to(DEVICE)  # distinct, like a top-k
        for kind, layer in layers.items():
            p = picks if kind == "c4a" else None
            layer(q, eng.meta, eng.caches, p, out=out)
            ref, _ = oracle.attend(q, batch.token_to_req, batch.positions, kind, layer.sink, layer.scale, p)
            assert not out.isnan().any()
            assert rel_err(out, ref) < TOL, (work, kind)


def test_warm_up_without_metadata_writes_zeros_and_reserves_the_workspace():
    out = torch.full((5, 2, 512), 7.0, dtype=torch.bfloat16)
    layer = SparseMLAAttention("c4a", 2, topk=8, prefill_mode="workspace", workspace_bytes=10 * 1024)
    got = layer(torch.zeros(5, 2, 512, dtype=torch.bfloat16), None, {}, out=out)
    assert got is out and (out == 0).all()
    assert workspace_module._WORKSPACES[(torch.device("cpu"), 512)].shape[0] >= 10  # reserved by the warm-up
    other = SparseMLAAttention("swa", 2, prefill_mode="workspace", workspace_bytes=10 * 1024)
    assert layer._workspace_buffer(out.device).shape == (10, 512)
    assert other._workspace_buffer(out.device).data_ptr() == layer._workspace_buffer(out.device).data_ptr()
    assert (SparseMLAAttention("swa", 2)(torch.ones(3, 2, 512, dtype=torch.bfloat16)) == 0).all()


def test_layer_is_a_module_with_its_sink_as_a_buffer():
    layer = SparseMLAAttention("c128a", 4, compress_ratio=128, sink=torch.arange(4.0))
    assert isinstance(layer, torch.nn.Module) and torch.equal(dict(layer.named_buffers())["sink"], torch.arange(4.0))
    assert layer.scale == 512 ** -0.5 and "c128a" in repr(layer)


@pytest.fixture(scope="module")
def small():
    return make_scenario([(40, 1), (20, 5)], window=4, topk=3, block_sizes=SIZES, padding=1)


def call(small, kind="swa", topk=None, caches=None, picks=None, q=None, **kw):
    layer = SparseMLAAttention(kind, 2, window=kw.pop("window", 4), topk=topk, backend="reference", **kw)
    q = torch.zeros(small.batch.token_capacity, 2, 512, dtype=torch.bfloat16) if q is None else q
    return layer(q, small.meta, small.caches if caches is None else caches, picks)


def i32(*shape):
    return torch.zeros(*shape, dtype=torch.int32)


@pytest.mark.parametrize("make,match", [
    (lambda s: call(s, "c4a", 3), r"topk_indices must be given to a c4a layer"),
    (lambda s: call(s, "swa", picks=i32(7, 3)), r"topk_indices must be given only to a layer of the kinds .*, not to this swa"),
    (lambda s: call(s, "c128a", picks=i32(7, 3)), r"only to a layer of the kinds \(.c4a., .c2a., .c1a., .dsa.\)"),
    (lambda s: call(s, "c4a", 3, picks=i32(7, 3).long()), r"topk_indices must have dtype torch.int32, got torch.int64"),
    (lambda s: call(s, "c4a", 3, picks=i32(6, 3)), r"topk_indices must have shape \(7, 3\)"),
    (lambda s: call(s, "c4a", 5, picks=i32(7, 5)), r"the step's metadata has topk 3, this layer 5"),
    (lambda s: call(s, "swa", window=8), r"the step's metadata has window 4, this layer 8"),
    (lambda s: call(s, "c128a", caches={"swa": s.caches["swa"]}), r"caches has no 'c128a' cache"),
    (lambda s: call(s, "swa", caches={}), r"caches has no 'swa' cache"),
    (lambda s: call(s, "swa", kv_format="bf16"), r"caches\['swa'\] holds fp8_v4 data, but the layer's kv_format is 'bf16'"),
    (lambda s: call(s, "c4a", 3, picks=i32(7, 3),
                    caches=dict(s.caches, c4a=PagedCache(4, 4, "bf16"))), r"cache format mismatch"),
    (lambda s: call(s, "c128a", caches=dict(s.caches, c128a=PagedCache(4, 4, "fp8_v4"))),
     r"caches\['c128a'\] has blocks of 4 entries, the step's block tables use 2"),
    (lambda s: call(s, "swa", caches={"swa": s.caches["swa"].data[..., :500].contiguous()}),
     r"caches\['swa'\] is uint8 with 500 bytes per token"),
    (lambda s: call(s, "swa", caches={"swa": PagedCache(4, 4, "bf16", dim=576)}), r"holds 576-d tokens"),
    (lambda s: call(s, "swa", q=torch.zeros(6, 2, 512, dtype=torch.bfloat16)), r"q has 6 tokens, the step's token capacity is 7"),
    (lambda s: call(s, "swa", q=torch.zeros(7, 2, 512)), r"q must have dtype torch.bfloat16"),
    (lambda s: SparseMLAAttention("c4", 2), r"kind must be one of"),
    (lambda s: SparseMLAAttention("c4a", 2), r"topk \(the indexer width\) is required"),
    (lambda s: SparseMLAAttention("c4a", 2, topk=4, compress_ratio=128), r"compress_ratio must be None or the int 4"),
    (lambda s: SparseMLAAttention("swa", 2, compress_ratio=True), r"compress_ratio must be None or the int 1"),
    (lambda s: SparseMLAAttention("swa", 2, 512.0), r"head_dim must be 512"),
    (lambda s: SparseMLAAttention("swa", 2, topk=0), r"topk must be a positive int"),
    (lambda s: SparseMLAAttention("swa", 2, kv_format="fp8_v32"), r"kv_format 'fp8_v32' does not fit this swa layer"),
    (lambda s: SparseMLAAttention("dsa", 2, 576, topk=8, scale=0.1, kv_format="fp8_v4"),
     r"kv_format 'fp8_v4' does not fit this dsa layer"),
    (lambda s: SparseMLAAttention("swa", 2, prefill_mode="chunked"), r"prefill_mode must be one of"),
    (lambda s: SparseMLAAttention("swa", 2, sink=torch.zeros(3)), r"sink must have shape \(2,\)"),
    (lambda s: SparseMLAAttention("swa", 2, sink=torch.tensor([0.0, float("nan")])), r"sink must not be NaN"),
    (lambda s: SparseMLAAttention("swa", 2, scale=-1.0), r"scale must be a positive finite number"),
    (lambda s: SparseMLAAttention("swa", 2, scale=torch.tensor([0.1, 0.2])),
     r"scale must be a positive finite number or a 0-d real tensor, got a torch.float32 tensor of shape \(2,\)"),
    (lambda s: SparseMLAAttention("swa", 2, scale=torch.tensor(-0.1)), r"scale must be a positive finite number"),
    (lambda s: SparseMLAAttention("swa", 2, backend="cuda"), r"backend must be 'auto' or one of"),
    (lambda s: SparseMLAAttention("swa", 2, kv_format="fp8"), r"kv_format must be None or one of"),
    (lambda s: SparseMLAAttention("c4a", 2, topk=2.5), r"topk must be a positive int"),
    (lambda s: SparseMLAAttention("swa", 8.0), r"num_heads and window must be positive ints"),
    (lambda s: SparseMLAAttention("swa", 2, sink=torch.zeros(2, device="meta")), r"sink is on the meta device"),
    (lambda s: SparseMLAAttention("swa", 2, prefill_mode="workspace", workspace_bytes=1e9),
     r"workspace_bytes must be an int"),
])
def test_mismatched_inputs_raise_value_errors_that_name_the_problem(small, make, match):
    with pytest.raises(ValueError, match=match):
        make(small)


def test_metadata_of_another_type_is_a_type_error(small):
    layer = SparseMLAAttention("swa", 2, window=4)
    with pytest.raises(TypeError, match="meta must be the step's StepMetadata"):
        layer(torch.zeros(7, 2, 512, dtype=torch.bfloat16), {"a": 1}, small.caches)


def test_the_step_api_doc_runs_as_written():
    doc = pathlib.Path(__file__).resolve().parent.parent / "docs" / "step_api.md"
    blocks = re.findall(r"```python\n(.*?)```", doc.read_text(), re.S)
    assert len(blocks) >= 2
    for i, block in enumerate(blocks):
        exec(compile(block, f"docs/step_api.md block {i}", "exec"), {})


@pytest.mark.parametrize("change", SINK_CHANGES)
def test_a_sink_changed_under_the_layer_is_checked_on_every_call_path(change):
    """``layer.sink.data = ...`` / ``sink.resize_`` keep the buffer's tensor object but change what the kernels read:
    the remembered path (the layer's last plan), the planned path (a new step) and the Triton launches all see the
    layer's head count checked again, never a read past the sink's end or its first heads silently used."""
    sc = make_scenario([(6, 1), (9, 2)], window=4, topk=4, device=DEVICE, seed=2, block_sizes=SIZES)
    q = torch.randn(sc.batch.token_capacity, 4, 512).to(torch.bfloat16).to(DEVICE)
    layer = SparseMLAAttention("swa", 4, window=4, sink=torch.zeros(4, device=DEVICE), backend="triton")
    first = layer(q, sc.meta, sc.caches)
    assert torch.equal(layer(q, sc.meta, sc.caches), first)  # the remembered plan, the same sink
    repoint_sink(layer, change)
    other = make_scenario([(7, 1)], window=4, topk=4, device=DEVICE, seed=3, block_sizes=SIZES)
    for meta, caches in ((sc.meta, sc.caches), (other.meta, other.caches)):  # remembered, then planned
        with pytest.raises(ValueError, match=r"sink must have shape \(4,\), got \((2|64),\): one float32 logit per "
                                             r"head of the layer's 4 heads"):
            layer(q[: meta.batch.token_capacity], meta, caches)
    layer.sink.data = torch.ones(4, device=DEVICE)  # put right: runs again, with the new values
    assert rel_err(layer(q, sc.meta, sc.caches), sc.expected(q, "swa", sink=torch.ones(4), scale=layer.scale)) < TOL


def test_a_0d_tensor_scale_is_a_scale():
    """``scale=torch.tensor(s)`` (a 0-d tensor, as torch code often holds one) is read as the number it holds, at
    construction and at assignment; the ops take it too."""
    sc = make_scenario([(20, 1), (9, 2)], window=4, topk=4, device=DEVICE, seed=4, block_sizes=SIZES)
    q = torch.randn(sc.batch.token_capacity, 2, 512).to(torch.bfloat16).to(DEVICE)
    layer = SparseMLAAttention("swa", 2, window=4, scale=torch.tensor(0.07), backend="reference")
    assert type(layer.scale) is float and layer.scale == pytest.approx(0.07)
    assert torch.equal(layer(q, sc.meta, sc.caches),
                       SparseMLAAttention("swa", 2, window=4, scale=layer.scale, backend="reference")(q, sc.meta,
                                                                                                      sc.caches))
    layer.scale = torch.tensor(0.05, dtype=torch.float64, device=DEVICE)
    assert layer.scale == pytest.approx(0.05)
    from sparse_mla.ops import sparse_attention_decode

    cache, idx, lens = sc.caches["swa"].data, sc.meta.swa_indices, sc.meta.swa_lens
    got, _ = sparse_attention_decode(q, cache, idx, lens, scale=torch.tensor(0.05), backend="reference")
    want, _ = sparse_attention_decode(q, cache, idx, lens, scale=0.05, backend="reference")
    assert torch.equal(got, want)
