"""Step metadata (DESIGN §3) against a plain loop over tokens, and the prefill workspace plan."""
from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparse_mla.batch import Request, StepBatchBuilder, blocks_needed
from helpers import DEVICE, examples
from strategies import step_lengths
from sparse_mla.metadata import MetadataSpec, build_step_metadata
from sparse_mla.picks import compact_rows, convert_picks
from sparse_mla.workspace import plan_prefill_workspace, workspace_indices, workspace_plan

SIZES = {"swa": 4, "c4a": 4, "c128a": 2}
V41_SIZES = {"swa": 4, "c2a": 4, "c1a": 8}
RATIO = {"swa": 1, "c4a": 4, "c128a": 128}


def make_batch(lengths, threshold=1, padding=0, seed=0, max_model_len=None, builder=None, sizes=SIZES, device="cpu"):
    """A batch whose block tables are random physical blocks, distinct over the whole step (from ``builder``, or a
    new one on ``device``); ``sizes``: block size per kind, its keys the batch's kinds (V4's by default)."""
    rng = random.Random(seed)
    need = {k: [blocks_needed(s, k, sizes[k]) for s, _ in lengths] for k in sizes}
    blocks = {k: rng.sample(range(max(1000, 2 * sum(n))), sum(n)) for k, n in need.items()}
    requests = []
    for r, (s, q) in enumerate(lengths):
        tables = {k: blocks[k][sum(need[k][:r]):sum(need[k][:r + 1])] for k in sizes}
        requests.append(Request(s, q, tables))
    n_tok = sum(q for _, q in lengths)
    if builder is None:
        builder = StepBatchBuilder(n_tok + padding, len(lengths), max_model_len or max(s for s, _ in lengths),
                                   kinds=tuple(sizes), block_sizes=sizes, decode_threshold=threshold, device=device)
    return builder.build(requests), requests


def slot(req: Request, kind: str, entry: int) -> int:
    bs = {**SIZES, **V41_SIZES}[kind]
    return req.block_tables[kind][entry // bs] * bs + entry % bs


def token_list(lengths):
    return [(r, s - q + i) for r, (s, q) in enumerate(lengths) for i in range(q)]


@st.composite
def steps(draw):
    lengths, threshold = draw(step_lengths(max_context=400, max_query=20))
    return lengths, threshold, draw(st.integers(0, 4)), draw(st.integers(1, 12)), draw(st.integers(0, 99))


@settings(max_examples=examples(40), deadline=None)
@given(case=steps())
def test_swa_and_c128a_lists_match_a_loop_over_tokens(case):
    lengths, threshold, padding, window, seed = case
    batch, requests = make_batch(lengths, threshold, padding, seed)
    meta = build_step_metadata(batch, MetadataSpec(window=window, topk=5))
    n128 = -(-batch.max_model_len // 128)
    assert meta.swa_indices.shape == (batch.token_capacity, window)
    assert meta.c128a_indices.shape == (batch.token_capacity, n128)
    for t, (r, p) in enumerate(token_list(lengths)):
        want = [slot(requests[r], "swa", x) for x in range(max(0, p - window + 1), p + 1)]
        assert meta.swa_indices[t].tolist() == want + [-1] * (window - len(want))
        assert int(meta.swa_lens[t]) == len(want)
        n = (p + 1) // 128
        assert meta.c128a_indices[t].tolist() == [slot(requests[r], "c128a", w) for w in range(n)] + [-1] * (n128 - n)
        assert int(meta.c128a_lens[t]) == n
    pad = slice(batch.num_tokens, None)
    assert meta.swa_lens[pad].eq(0).all() and meta.swa_indices[pad].eq(-1).all()
    assert meta.c128a_lens[pad].eq(0).all() and meta.c128a_indices[pad].eq(-1).all()
    assert meta.is_valid_token.tolist() == [1] * batch.num_tokens + [0] * padding
    for t in (meta.swa_indices, meta.swa_lens, meta.c128a_indices, meta.c128a_lens, meta.is_valid_token):
        assert t.dtype == torch.int32


@settings(max_examples=examples(40), deadline=None)
@given(case=steps(), topk=st.integers(1, 10))
def test_c4a_picks_become_a_valid_prefix_of_visible_global_slots(case, topk):
    lengths, threshold, padding, window, seed = case
    batch, requests = make_batch(lengths, threshold, padding, seed)
    meta = build_step_metadata(batch, MetadataSpec(window=window, topk=topk))
    gen = torch.Generator().manual_seed(seed)
    # local picks: -1, visible, just invisible, far beyond the request's entries
    picks = torch.randint(-1, max(s for s, _ in lengths) // 4 + 3, (batch.token_capacity, topk), generator=gen)
    picks[:, 0] = 10**6
    picks = picks.to(torch.int32)
    idx, lens, kept = convert_picks(meta, picks, "c4a")
    for t, (r, p) in enumerate(token_list(lengths)):
        visible = [w for w in picks[t].tolist() if w >= 0 and (w + 1) * 4 <= p + 1]  # order kept
        assert kept[t].tolist() == visible + [-1] * (topk - len(visible))
        assert idx[t].tolist() == [slot(requests[r], "c4a", w) for w in visible] + [-1] * (topk - len(visible))
        assert int(lens[t]) == len(visible)
    assert lens[batch.num_tokens:].eq(0).all() and idx[batch.num_tokens:].eq(-1).all()
    again, lens2 = meta.c4a_indices(picks)  # the layer-facing method: same buffers, same answer
    assert again.data_ptr() == idx.data_ptr() and torch.equal(lens2, lens)


def test_hand_checked_lists():
    # request 0: decode at position 129; request 1: prefill of positions 0..5
    batch, req = make_batch([(130, 1), (6, 6)], padding=1)
    m = build_step_metadata(batch, MetadataSpec(window=8, topk=3))
    assert m.swa_lens.tolist() == [8, 1, 2, 3, 4, 5, 6, 0]
    assert m.swa_indices[0].tolist() == [slot(req[0], "swa", p) for p in range(122, 130)]
    assert m.swa_indices[1].tolist() == [slot(req[1], "swa", 0)] + [-1] * 7
    assert m.c128a_lens.tolist() == [1, 0, 0, 0, 0, 0, 0, 0]  # (129+1)//128 = 1 complete entry
    # position 129 sees c4a entries 0..31 ((31+1)*4 = 128 <= 130), not 32 ((32+1)*4 = 132 > 130)
    picks = torch.full((8, 3), -1, dtype=torch.int32)
    picks[0] = torch.tensor([32, 31, 0])
    idx, lens = m.c4a_indices(picks)
    assert lens[0] == 2 and idx[0].tolist() == [slot(req[0], "c4a", 31), slot(req[0], "c4a", 0), -1]


def test_decode_orders_put_the_tokens_with_most_key_blocks_first_refilled_each_step():
    # decode rows at contexts 900, 70, 520, 300 (c4a counts capped at topk 100), then a 140-token prefill
    lengths = [(900, 1), (70, 1), (520, 1), (300, 1), (140, 140)]
    batch, _ = make_batch(lengths, threshold=1, padding=3)
    spec = MetadataSpec(window=128, topk=100)
    meta = build_step_metadata(batch, spec)
    assert meta.decode_order("swa") is None
    for typo in ("c4", 3):  # not "no order": a kind this step does not have
        with pytest.raises(ValueError, match="kind must be one of this step's kinds"):
            meta.decode_order(typo)
    positions = [p for _, p in token_list(lengths)][:4]
    extra = {"c4a": lambda p: min(100, (p + 1) // 4), "c128a": lambda p: (p + 1) // 128}
    for kind, count in extra.items():
        order = meta.decode_order(kind)
        assert order.dtype == torch.int32 and order.shape == (4,)
        blocks = [-(-min(128, p + 1) // 64) - (-count(p) // 64) for p in positions]
        keys = [(-blocks[t], t) for t in order.tolist()]
        assert sorted(order.tolist()) == [0, 1, 2, 3] and keys == sorted(keys)
        assert order.tolist() == [0, 2, 3, 1]  # 4, 3, 4, 4 blocks (c128a: 3, 2, 3, 3)
    # the next step, same capacities, other decode lengths: the same buffers, refilled
    ptrs = {k: meta.decode_order(k).data_ptr() for k in extra}
    nxt = build_step_metadata(make_batch([(70, 1), (64, 1), (900, 1), (530, 1), (140, 140)],
                                         builder=batch.builder)[0], spec, out=meta)
    for kind in extra:
        assert nxt.decode_order(kind).data_ptr() == ptrs[kind]
        assert nxt.decode_order(kind).tolist() == [2, 3, 0, 1]  # 900 and 530 first; 70 (2 swa blocks) before 64
    # c4a counts stop at topk: 150 and 225 visible entries both count as 100 (a tie: token order)
    capped = build_step_metadata(make_batch([(600, 1), (900, 1)])[0], spec)
    assert capped.decode_order("c4a").tolist() == [0, 1]  # uncapped: 3 and 4 blocks, [1, 0]
    # no decode tokens: empty orders
    assert build_step_metadata(make_batch([(140, 140)], threshold=1)[0], spec).decode_order("c4a").shape == (0,)


def test_compact_rows():
    rows = torch.tensor([[-1, 5, -1, 7], [1, 2, 3, 4], [-1, -1, -1, -1]], dtype=torch.int32)
    out, lens = compact_rows(rows)
    assert out.tolist() == [[5, 7, -1, -1], [1, 2, 3, 4], [-1, -1, -1, -1]] and lens.tolist() == [2, 4, 0]


def test_buffers_are_refilled_in_place_across_steps():
    spec = MetadataSpec(window=8, topk=4)
    builder = StepBatchBuilder(16, 4, 512, block_sizes=SIZES)

    def step(lengths):
        return make_batch(lengths, builder=builder)[0]

    first = build_step_metadata(step([(300, 10), (40, 5)]), spec)
    ptrs = [t.data_ptr() for t in (first.swa_indices, first.swa_lens, first.c128a_indices, first.picks_indices)]
    second = build_step_metadata(step([(301, 1)]), spec, out=first)
    assert second is first
    assert [t.data_ptr() for t in (second.swa_indices, second.swa_lens, second.c128a_indices,
                                   second.picks_indices)] == ptrs
    assert second.swa_lens.tolist() == [8] + [0] * 15 and second.c128a_lens.tolist() == [2] + [0] * 15
    with pytest.raises(ValueError, match="out's swa_indices has shape"):
        build_step_metadata(step([(301, 1)]), MetadataSpec(window=16, topk=4), out=first)


def test_bad_picks_and_specs_raise_value_error():
    batch, _ = make_batch([(40, 1)], padding=1)
    meta = build_step_metadata(batch, MetadataSpec(window=4, topk=3))
    with pytest.raises(ValueError, match="topk_indices must have dtype torch.int32"):
        meta.c4a_indices(torch.zeros(2, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"topk_indices must have shape \(2, 3\)"):
        meta.c4a_indices(torch.zeros(2, 4, dtype=torch.int32))
    for spec in (MetadataSpec(window=0, topk=3), MetadataSpec(window="8", topk=3), MetadataSpec(window=8, topk=2.5),
                 MetadataSpec(window=10**12, topk=3)):  # (10^12 reached the allocator: 64 TB of window lists)
        with pytest.raises(ValueError, match="spec.window and spec.topk must be positive ints"):
            build_step_metadata(batch, spec)
    with pytest.raises(TypeError, match="spec must be a MetadataSpec, got NoneType"):
        build_step_metadata(batch, None)
    with pytest.raises(TypeError, match="out must be a StepMetadata"):
        build_step_metadata(batch, MetadataSpec(window=4, topk=3), out=5)
    with pytest.raises(ValueError, match="kind must be a kind of this batch that takes indexer picks"):
        convert_picks(meta, torch.zeros(2, 3, dtype=torch.int32), "swa")
    with pytest.raises(ValueError, match="kind must be one of this batch's kinds"):
        batch.new_entries("c8a")
    with pytest.raises(ValueError, match="head_dim must be 512"):
        workspace_plan(meta, "swa", 1 << 20, head_dim=0)


def test_picks_out_of_any_range_are_an_error_in_debug_mode(monkeypatch):
    batch, _ = make_batch([(40, 1)], padding=1)  # max_model_len 40: c4a entries 0 … 9
    meta = build_step_metadata(batch, MetadataSpec(window=4, topk=3))
    picks = torch.tensor([[9, -2, 10], [-1, -1, -1]], dtype=torch.int32)
    assert meta.c4a_indices(picks)[1].tolist() == [1, 0]  # -2 and 10 dropped like invisible picks
    monkeypatch.setenv("SPARSE_MLA_DEBUG", "1")
    with pytest.raises(ValueError, match=r"topk_indices holds -2, out of range: entries must be -1 or in \[0, 10\)"):
        meta.c4a_indices(picks)
    with pytest.raises(ValueError, match="topk_indices holds 10, out of range"):
        meta.c4a_indices(torch.tensor([[9, 10, -1], [-1, -1, -1]], dtype=torch.int32))
    assert meta.c4a_indices(torch.tensor([[9, 3, -1], [-1, -1, -1]], dtype=torch.int32))[1].tolist() == [2, 0]
    # the padding token's row is never read: whatever the indexer left there is not checked
    assert meta.c4a_indices(torch.tensor([[9, 3, -1], [-7, 99, 5]], dtype=torch.int32))[1].tolist() == [2, 0]


# ----------------------------------------------------------------------------------- workspace plan

@settings(max_examples=examples(30), deadline=None)
@given(case=steps(), kind=st.sampled_from(["swa", "c4a", "c128a"]), budget_rows=st.integers(0, 200))
def test_workspace_plan_covers_every_prefill_token_with_the_same_keys(case, kind, budget_rows):
    lengths, threshold, padding, window, seed = case
    batch, requests = make_batch(lengths, threshold, padding, seed)
    topk = 6
    meta = build_step_metadata(batch, MetadataSpec(window=window, topk=topk))
    gen = torch.Generator().manual_seed(seed)
    picks = torch.randint(-1, 80, (batch.token_capacity, topk), generator=gen, dtype=torch.int32)
    _, _, kept = convert_picks(meta, picks, "c4a")
    tokens = token_list(lengths)
    need = max([min(window, p + 1) + (p + 1) // RATIO[kind] * (RATIO[kind] > 1)
                for t, (_, p) in enumerate(tokens) if t >= batch.num_decode_tokens], default=0)
    budget_rows = need + budget_rows  # from just enough for the neediest token to plenty
    chunks = plan_prefill_workspace(meta, kind, budget_rows * 1024, head_dim=512)
    covered = []
    for c in chunks:
        assert 0 < c.num_rows <= budget_rows
        assert c.compressed_slots.shape[0] + c.swa_slots.shape[0] == c.num_rows
        covered += range(c.tokens.start, c.tokens.stop)
        idx, lens = workspace_indices(meta, c, kept)
        row_slot = [("c", s) for s in c.compressed_slots.tolist()] + [("s", s) for s in c.swa_slots.tolist()]
        for i, t in enumerate(range(c.tokens.start, c.tokens.stop)):
            n = int(lens[i])
            assert (idx[i, :n] >= 0).all() and (idx[i, n:] == -1).all()
            got = sorted(row_slot[j] for j in idx[i, :n].tolist())
            want = [("s", s) for s in meta.swa_indices[t, : meta.swa_lens[t]].tolist()]
            if kind == "c128a":
                want += [("c", s) for s in meta.c128a_indices[t, : meta.c128a_lens[t]].tolist()]
            elif kind == "c4a":
                want += [("c", s) for s in meta.picks_indices[t, : meta.picks_lens[t]].tolist()]
            assert got == sorted(want), f"token {t}"
    assert covered == list(range(batch.num_decode_tokens, batch.num_tokens))


def test_workspace_plan_splits_a_long_prefill_and_names_a_budget_too_small():
    batch, _ = make_batch([(50, 1), (1000, 300)], padding=2)
    meta = build_step_metadata(batch, MetadataSpec(window=16, topk=4))
    chunks = plan_prefill_workspace(meta, "c128a", 200 * 1024)  # 200 rows of 512 bf16
    assert [c.tokens for c in chunks][0].start == 1 and chunks[-1].tokens.stop == 301
    assert len(chunks) == 2 and all(c.num_rows <= 200 for c in chunks)
    # first chunk: positions 700..878: 15 earlier window tokens + 179 tokens + (878+1)//128 = 6 entries = 200
    assert chunks[0].tokens == slice(1, 180) and chunks[0].num_rows == 15 + 179 + 6
    assert workspace_plan(meta, "c128a", 200 * 1024) is workspace_plan(meta, "c128a", 200 * 1024)  # built once
    with pytest.raises(ValueError, match=r"cannot hold the 16 keys of request 1's token at position 700"):
        plan_prefill_workspace(meta, "swa", 15 * 1024)


def test_repeated_picks_are_an_error_in_debug_mode(monkeypatch):
    """The model counts a pick once (HF builds a mask); the kernels would attend to a repeat twice. Repeats are
    rejected under SPARSE_MLA_DEBUG=1 (a sort: a sync), in c4a and dsa rows alike; padding rows are not read."""
    batch, _ = make_batch([(40, 1)], padding=1)
    meta = build_step_metadata(batch, MetadataSpec(window=4, topk=3))
    picks = torch.tensor([[3, 5, 3], [7, 7, 7]], dtype=torch.int32)  # row 1 is padding
    assert meta.c4a_indices(picks)[1].tolist() == [3, 0]  # without the check: attended twice
    monkeypatch.setenv("SPARSE_MLA_DEBUG", "1")
    with pytest.raises(ValueError, match="topk_indices row 0 picks entry 3 more than once"):
        meta.c4a_indices(picks)
    assert meta.c4a_indices(torch.tensor([[3, 5, -1], [7, 7, 7]], dtype=torch.int32))[1].tolist() == [2, 0]
    builder = StepBatchBuilder(2, 1, 64, kinds=("dsa",), block_sizes={"dsa": 8})
    dsa = build_step_metadata(builder.build([Request(30, 2, {"dsa": [0, 1, 2, 3]})]), MetadataSpec(topk=3))
    with pytest.raises(ValueError, match="topk_indices row 1 picks entry 9 more than once"):
        dsa.dsa_indices(torch.tensor([[1, 2, -1], [9, 4, 9]], dtype=torch.int32))


@settings(max_examples=examples(40), deadline=None)
@given(case=steps(), topk=st.integers(1, 10))
def test_v41_picks_of_ratios_2_and_1_become_valid_prefixes_of_visible_global_slots(case, topk):
    """V4.1's c2a and c1a picks through the general per-kind method; the bound of every picks layer's count is at the
    smallest ratio (1), and both kinds get a decode order."""
    lengths, threshold, padding, window, seed = case
    batch, requests = make_batch(lengths, threshold, padding, seed, sizes=V41_SIZES)
    meta = build_step_metadata(batch, MetadataSpec(window=window, topk=topk))
    gen = torch.Generator().manual_seed(seed)
    for kind, ratio in (("c2a", 2), ("c1a", 1)):
        picks = torch.randint(-1, max(s for s, _ in lengths) // ratio + 3, (batch.token_capacity, topk), generator=gen)
        picks[:, 0] = 10**6
        idx, lens = meta.picks_for(kind, picks.to(torch.int32))
        for t, (r, p) in enumerate(token_list(lengths)):
            visible = [w for w in picks[t].tolist() if w >= 0 and (w + 1) * ratio <= p + 1]  # order kept
            assert idx[t].tolist() == [slot(requests[r], kind, w) for w in visible] + [-1] * (topk - len(visible))
            assert int(lens[t]) == len(visible)
        assert lens[batch.num_tokens:].eq(0).all() and idx[batch.num_tokens:].eq(-1).all()
        order = meta.decode_order(kind)
        assert sorted(order.tolist()) == list(range(batch.num_decode_tokens))
    assert meta.picks_ratio == 1 and meta.picks_kind == "c2a"
    bound = [min(topk, p + 1) for _, p in token_list(lengths)]
    assert meta.picks_bound[:batch.num_tokens].tolist() == bound


def test_picks_of_any_strides_convert_as_their_values_on_the_triton_builders(monkeypatch):
    """The Triton conversion (a GPU's; here in the interpreter) reads a row's picks at unit stride: a transposed view
    or a strided slice is copied first, so it converts as its values do (it read other numbers, silently)."""
    import sparse_mla.picks as picks_module

    monkeypatch.setattr(picks_module, "builders_use_triton", lambda device: True)
    batch, _ = make_batch([(37, 1), (20, 3), (9, 9)], threshold=3, padding=2, sizes=V41_SIZES, device=DEVICE)
    meta = build_step_metadata(batch, MetadataSpec(window=4, topk=6))
    gen = torch.Generator().manual_seed(2)
    for kind, ratio in (("c2a", 2), ("c1a", 1)):
        picks = torch.randint(-1, 40 // ratio, (batch.token_capacity, 6), generator=gen, dtype=torch.int32).to(DEVICE)
        want = [t.clone() for t in meta.picks_for(kind, picks)]
        assert picks_module.step_picks(meta, kind)._launch is not None  # the Triton conversion, not the torch twin
        wide = torch.full((batch.token_capacity, 12), 7, dtype=torch.int32, device=DEVICE)
        wide[:, ::2] = picks
        for view in (picks.t().contiguous().t(), wide[:, ::2]):
            assert all(torch.equal(a, b) for a, b in zip(meta.picks_for(kind, view), want)), kind


def test_triton_builders_bound_on_a_small_step_look_up_every_request_of_a_larger_one(monkeypatch):
    """The Triton builders bind their launches to the builder's buffers on the first build (``out=``: the step's
    lists, the picks' conversion, the select's ``PicksInto``); a later step of more requests looks up rows of the
    block tables past the first step's: every step's window lists and converted picks equal the torch twins' (a
    launch bound to the first step's table view clamped the later requests into its one row)."""
    import sparse_mla.metadata as metadata_module
    import sparse_mla.picks as picks_module
    from sparse_mla.picks import step_picks

    spec = MetadataSpec(window=4, topk=6)
    builder = StepBatchBuilder(16, 3, 40, kinds=tuple(SIZES), block_sizes=SIZES, decode_threshold=3, device=DEVICE)
    gen = torch.Generator().manual_seed(5)
    bound = None
    for lengths in ([(37, 1)], [(37, 1), (20, 3), (39, 9)]):
        batch, _ = make_batch(lengths, threshold=3, builder=builder)  # on the builder's device
        picks = torch.randint(-1, 10, (batch.token_capacity, 6), generator=gen, dtype=torch.int32).to(DEVICE)
        results = []
        for triton_builders in (True, False):
            for module in (metadata_module, picks_module):
                monkeypatch.setattr(module, "builders_use_triton", lambda device, on=triton_builders: on)
            meta = build_step_metadata(batch, spec, out=bound if triton_builders else None)
            conversion = step_picks(meta, "c4a")
            assert (conversion._launch is not None) == triton_builders
            results.append([t.clone() for t in (meta.swa_indices, meta.swa_lens, meta.c128a_indices, meta.c128a_lens,
                                                *meta.picks_for("c4a", picks))])
            if triton_builders:
                bound = meta
                into = conversion.select_into(0, batch.num_tokens)
                assert into.table.shape[0] == 3  # the builder's rows, whatever this step's requests
        assert all(torch.equal(a, b) for a, b in zip(*results)), lengths
        assert (results[0][0][batch.num_tokens - 1] >= 0).any()  # the last request's window was looked up


def test_v41_picks_conversion_kernel_matches_its_torch_twin():
    """The Triton picks conversion (the CUDA builders; here in the interpreter) at ratios 2 and 1."""
    from sparse_mla.picks import compressed_picks_torch
    from sparse_mla.ops.triton import index as triton_index

    batch, _ = make_batch([(37, 1), (20, 3), (9, 9)], threshold=3, padding=2, sizes=V41_SIZES, device=DEVICE)
    gen = torch.Generator().manual_seed(0)
    i32 = dict(dtype=torch.int32, device=DEVICE)
    for kind, ratio in (("c2a", 2), ("c1a", 1)):
        picks = torch.randint(-3, 45 // ratio, (batch.token_capacity, 6), generator=gen, dtype=torch.int32).to(DEVICE)
        outs = [(torch.empty(batch.token_capacity, 6, **i32), torch.empty(batch.token_capacity, **i32),
                 torch.empty(batch.token_capacity, 6, **i32)) for _ in range(2)]
        fixed = (batch.positions, batch.token_to_req, batch.block_tables[kind], batch.block_sizes[kind], ratio, picks)
        compressed_picks_torch(*fixed, *outs[0])
        triton_index.compressed_picks(*fixed, *outs[1])
        for want, got in zip(*outs):
            assert torch.equal(got, want)
