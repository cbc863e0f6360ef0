"""Triton index builders equal the torch metadata builders on random batches."""
from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparse_mla.batch import Request, StepBatchBuilder
from sparse_mla.metadata import MetadataSpec, build_step_metadata
from sparse_mla.ops.triton_index import compressed_picks, window_indices

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SIZES = {"swa": 4, "c4a": 4, "c128a": 2}


@settings(max_examples=15, deadline=None)
@given(lengths=st.lists(st.tuples(st.integers(1, 600), st.integers(1, 6)), min_size=1, max_size=4),
       window=st.sampled_from([1, 5, 8]), topk=st.sampled_from([1, 7, 16]), padding=st.integers(0, 3),
       seed=st.integers(0, 2**31 - 1))
def test_triton_builders_equal_torch_builders(lengths, window, topk, padding, seed):
    gen = torch.Generator().manual_seed(seed)
    lengths = sorted(((max(s, q), q) for s, q in lengths), key=lambda sq: sq[1] > 1)  # decodes first
    builder = StepBatchBuilder(sum(q for _, q in lengths) + padding, len(lengths), 600, block_sizes=SIZES,
                               decode_threshold=1, device=DEVICE)
    reqs = []
    for s, q in lengths:
        tables = {k: torch.randperm(1000, generator=gen)[: -(-(s if k == "swa" else s // (4 if k == "c4a" else 128))
                                                         // SIZES[k]) or 1].tolist() for k in SIZES}
        reqs.append(Request(s, q, tables))
    batch = builder.build(reqs)
    meta = build_step_metadata(batch, MetadataSpec(window=window, topk=topk))
    T = batch.token_capacity
    i32 = dict(dtype=torch.int32, device=DEVICE)

    idx, lens = torch.full((T, window), 7, **i32), torch.full((T,), 7, **i32)
    window_indices(batch.positions, batch.token_to_req, batch.block_tables["swa"], SIZES["swa"], 1, idx, lens)
    assert torch.equal(idx, meta.swa_indices) and torch.equal(lens, meta.swa_lens)

    width = meta.c128a_indices.shape[1]
    idx, lens = torch.full((T, width), 7, **i32), torch.full((T,), 7, **i32)
    window_indices(batch.positions, batch.token_to_req, batch.block_tables["c128a"], SIZES["c128a"], 128, idx, lens)
    assert torch.equal(idx, meta.c128a_indices) and torch.equal(lens, meta.c128a_lens)

    picks = torch.randint(-1, 160, (T, topk), generator=gen, dtype=torch.int32).to(DEVICE)
    ref_idx, ref_lens = meta.c4a_indices(picks)
    idx, lens = torch.full((T, topk), 7, **i32), torch.full((T,), 7, **i32)
    compressed_picks(batch.positions, batch.token_to_req, batch.block_tables["c4a"], SIZES["c4a"], 4, picks, idx, lens)
    assert torch.equal(idx, ref_idx) and torch.equal(lens, ref_lens)
