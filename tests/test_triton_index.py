"""Triton index builders equal their torch twins on random batches (on a GPU, build_step_metadata
uses the Triton ones; here they run in the interpreter)."""
from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from helpers import DEVICE
from sparse_mla.batch import Request, StepBatchBuilder, blocks_needed
from sparse_mla.metadata import (MetadataSpec, _step_lists_torch, _step_lists_triton, _window_indices_torch,
                                 allocate_metadata)
from sparse_mla.ops.triton.index import WindowList, compressed_picks, step_lists
from sparse_mla.picks import compressed_picks_torch

SIZES = {"swa": 4, "c4a": 4, "c128a": 2}


@given(lengths=st.lists(st.tuples(st.integers(1, 600), st.integers(1, 6)), min_size=1, max_size=4),
       window=st.sampled_from([1, 5, 8]), topk=st.sampled_from([1, 7, 16]), padding=st.integers(0, 3),
       seed=st.integers(0, 2**31 - 1), kinds=st.sampled_from([("swa", "c4a", "c128a"), ("swa",), ("swa", "c4a"),
                                                              ("swa", "c128a")]),
       world=st.sampled_from([1, 2, 3, 4]))
def test_triton_builders_equal_torch_builders(lengths, window, topk, padding, seed, kinds, world):
    """world > 1: also a context-parallel rank's lists (rank ``seed % world``: its window rows built compact, its
    picks filtered by owner), Triton against the torch twins."""
    gen = torch.Generator().manual_seed(seed)
    lengths = sorted(((max(s, q), q) for s, q in lengths), key=lambda sq: sq[1] > 1)  # decodes first
    sizes = {k: SIZES[k] for k in kinds}
    builder = StepBatchBuilder(sum(q for _, q in lengths) + padding, len(lengths), 600, kinds, block_sizes=sizes,
                               decode_threshold=1, device=DEVICE)
    # each kind's blocks drawn from one permutation, so no two requests share a writable block (build rejects that)
    free = {k: torch.randperm(1000, generator=gen).tolist() for k in kinds}
    reqs = []
    for s, q in lengths:
        tables = {}
        for k in kinds:
            n = blocks_needed(s, k, SIZES[k])
            tables[k], free[k] = free[k][:n], free[k][n:]
        reqs.append(Request(s, q, tables))
    b = builder.build(reqs)
    T = b.token_capacity
    i32 = dict(dtype=torch.int32, device=DEVICE)

    def both(fill_width):
        return [(torch.full((T, fill_width), 7, **i32), torch.full((T,), 7, **i32)) for _ in range(2)]

    metas = [allocate_metadata(b, MetadataSpec(window, topk)) for _ in range(2)]
    for meta in metas:  # garbage everywhere: every value must be written
        for buf in (meta.is_valid_token, meta.swa_indices, meta.swa_lens, meta.c128a_indices, meta.c128a_lens,
                    meta.picks_indices, meta.picks_local, meta.picks_lens, meta.picks_bound):
            if buf is not None:
                buf.fill_(7)
    _step_lists_triton(b, metas[0])
    _step_lists_torch(b, metas[1])
    rank = seed % world
    for kind in (k for k in ("swa", "c128a") if k in kinds):
        span = getattr(metas[0], f"{kind}_indices").shape[1]
        (ti, tl_), (ri, rl) = both(-(-span // world))
        lists = dict(swa=None, c128a=None)
        lists[kind] = WindowList(b.block_tables[kind], SIZES[kind], ti, tl_, span)
        step_lists(b.positions, b.token_to_req, torch.empty(T, **i32), **lists, picks=None, world=world, rank=rank)
        _window_indices_torch(b, kind, ri, rl, span, world, rank)
        assert torch.equal(ti, ri) and torch.equal(tl_, rl), kind
    for name in ("is_valid_token", "swa_indices", "swa_lens", "c128a_indices", "c128a_lens", "picks_indices",
                 "picks_local", "picks_lens", "picks_bound"):
        got, want = getattr(metas[0], name), getattr(metas[1], name)
        assert (got is None) == (want is None) and (got is None or torch.equal(got, want)), name
    if "c4a" not in kinds:
        return

    picks = torch.randint(-1, 160, (T, topk), generator=gen, dtype=torch.int32).to(DEVICE)
    (ti, tl_), (ri, rl) = both(topk)
    tk, rk = torch.full((T, topk), 7, **i32), torch.full((T, topk), 7, **i32)
    args = (b.positions, b.token_to_req, b.block_tables["c4a"], SIZES["c4a"], 4, picks)
    compressed_picks(*args, ti, tl_, tk, world, rank)
    compressed_picks_torch(*args, ri, rl, rk, world, rank)
    assert torch.equal(ti, ri) and torch.equal(tl_, rl) and torch.equal(tk, rk)
