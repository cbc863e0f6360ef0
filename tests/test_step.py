"""A serving step end to end: batch -> metadata -> layer, against the dense oracle (DESIGN §7.1)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sparse_mla.batch import Request, StepBatchBuilder
from sparse_mla.layer import SparseMLAAttention
from sparse_mla.metadata import MetadataSpec, build_step_metadata
from sparse_mla.scenario import make_scenario

WINDOW, TOPK, HEADS = 8, 12, 3
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@st.composite
def step_lengths(draw):
    """Requests decodes first: decodes of 1-3 tokens (MTP), prefills with prefixes shorter or longer than W."""
    threshold = draw(st.integers(1, 3))
    decodes = draw(st.lists(st.tuples(st.integers(1, 400), st.integers(1, threshold)), max_size=4))
    prefills = draw(st.lists(st.tuples(st.integers(0, 300), st.integers(threshold + 1, 40)), max_size=2))
    lengths = [(max(s, q), q) for s, q in decodes] + [(p + q, q) for p, q in prefills]
    if not lengths:
        lengths = [(1, 1)]
    return lengths, threshold


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=step_lengths(), kind=st.sampled_from(["swa", "c4a", "c128a"]), fmt=st.sampled_from(["bf16", "fp8_v4"]),
       mode=st.sampled_from(["paged", "workspace"]), padding=st.integers(0, 3), seed=st.integers(0, 2**31 - 1),
       backend=st.sampled_from(["reference", "triton"]))
def test_layer_matches_dense_oracle(case, kind, fmt, mode, padding, seed, backend):
    lengths, threshold = case
    sc = make_scenario(lengths, window=WINDOW, topk=TOPK, fmt=fmt, decode_threshold=threshold, padding=padding,
                       seed=seed, block_sizes={"swa": 4, "c4a": 4, "c128a": 2}, device=DEVICE)
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(sc.batch.token_capacity, HEADS, 512, generator=gen).to(torch.bfloat16).to(DEVICE)
    sink = torch.randn(HEADS, generator=gen).to(DEVICE)
    layer = SparseMLAAttention(kind, HEADS, window=WINDOW, topk=TOPK if kind == "c4a" else None, sink=sink,
                               backend=backend, prefill_mode=mode, workspace_bytes=300 * 1024)
    out = layer(q, sc.meta, sc.caches, sc.topk_local if kind == "c4a" else None)
    ref = sc.expected(q, kind, list(range(sc.batch.token_capacity)), sink, layer.scale)
    assert not out.isnan().any()
    out = out.cpu()
    err = ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    assert err < 1e-2
    assert (out[sc.batch.num_tokens:] == 0).all(), "padding tokens get zeros"


def test_invisible_indexer_picks_are_dropped_not_errors():
    # token at position 39 sees entries 0..9; 10 and 500 are beyond it, -1 is none
    picks = torch.tensor([[10, 2, 500]], dtype=torch.int32)
    sc = make_scenario([(40, 1)], window=4, topk=3, block_sizes={"swa": 4, "c4a": 4, "c128a": 2}, picks=picks)
    idx, lens = sc.meta.c4a_indices(picks)
    assert int(lens[0]) == 1 and (idx[0, 1:] == -1).all()
    assert int(idx[0, 0]) == int(sc.batch.block_tables["c4a"][0, 0]) * 4 + 2
    q = torch.randn(1, 2, 512).to(torch.bfloat16)
    layer = SparseMLAAttention("c4a", 2, window=4, topk=3, backend="reference")
    out = layer(q, sc.meta, sc.caches, picks)
    ref = sc.expected(q, "c4a", [0], None, layer.scale)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-2


def test_metadata_index_lists():
    sc = make_scenario([(130, 1), (6, 6)], window=8, topk=4, block_sizes={"swa": 4, "c4a": 4, "c128a": 2})
    m, b = sc.meta, sc.batch
    table = b.block_tables["swa"]
    slot = lambda r, p: int(table[r, p // 4]) * 4 + p % 4
    assert m.swa_lens.tolist() == [8, 1, 2, 3, 4, 5, 6]
    assert m.swa_indices[0].tolist() == [slot(0, p) for p in range(122, 130)]
    assert m.swa_indices[1].tolist() == [slot(1, 0)] + [-1] * 7
    assert m.c128a_lens.tolist() == [1, 0, 0, 0, 0, 0, 0]  # (129+1)//128 = 1 complete entry
    assert b.positions[:7].tolist() == [129, 0, 1, 2, 3, 4, 5]
    assert b.slot_mapping[:7].tolist() == [slot(0, 129)] + [slot(1, p) for p in range(6)]


def test_metadata_reuses_buffers_across_steps():
    sc = make_scenario([(50, 1), (20, 1)], window=8, topk=4, block_sizes={"swa": 4, "c4a": 4, "c128a": 2})
    ptr = sc.meta.swa_indices.data_ptr()
    again = build_step_metadata(sc.batch, MetadataSpec(window=8, topk=4), out=sc.meta)
    assert again.swa_indices.data_ptr() == ptr


def table(n):
    return {"swa": list(range(n)), "c4a": [0], "c128a": [0]}


@pytest.mark.parametrize("requests,match", [
    ([Request(200, 1, table(2))], "block table for 'swa' has 2 blocks, seq_len 200 needs 4"),
    ([Request(5, 6, table(1))], "query_len 6 must be in"),
    ([Request(70, 5, table(2)), Request(70, 1, table(2))], "decode after a prefill"),
    ([Request(70, 1, {"swa": [0, 1]})], "block table for 'c4a'"),
])
def test_bad_batches_raise_value_error(requests, match):
    builder = StepBatchBuilder(16, 4, 256)
    with pytest.raises(ValueError, match=match):
        builder.build(requests)


def test_layer_rejects_mismatched_inputs():
    sc = make_scenario([(40, 1)], window=4, topk=3, block_sizes={"swa": 4, "c4a": 4, "c128a": 2})
    q = torch.zeros(1, 2, 512, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="topk_indices must be given"):
        SparseMLAAttention("c4a", 2, window=4, topk=3)(q, sc.meta, sc.caches)
    with pytest.raises(ValueError, match="topk_indices must be given"):
        SparseMLAAttention("swa", 2, window=4)(q, sc.meta, sc.caches, torch.zeros(1, 3, dtype=torch.int32))
    with pytest.raises(ValueError, match="topk_indices must have dtype torch.int32"):
        SparseMLAAttention("c4a", 2, window=4, topk=3)(q, sc.meta, sc.caches, torch.zeros(1, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match="caches has no 'c128a' cache"):
        SparseMLAAttention("c128a", 2, window=4)(q, sc.meta, {"swa": sc.caches["swa"]})
    bad = dict(sc.caches, swa=sc.caches["swa"].data[..., :500].contiguous())
    with pytest.raises(ValueError, match="584 .*656"):
        SparseMLAAttention("swa", 2, window=4)(q, sc.meta, bad)


def test_warm_up_without_metadata_writes_zeros():
    out = torch.full((5, 2, 512), 7.0, dtype=torch.bfloat16)
    got = SparseMLAAttention("swa", 2)(torch.zeros(5, 2, 512, dtype=torch.bfloat16), None, {}, out=out)
    assert got is out and (out == 0).all()
