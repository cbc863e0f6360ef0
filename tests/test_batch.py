"""StepBatch: requests -> query_start_loc, positions, token_to_req, slot mapping, block tables (DESIGN §3)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from strategies import step_lengths
from sparse_mla.batch import Request, StepBatchBuilder, blocks_needed, slots_of

SIZES = {"swa": 4, "c4a": 4, "c128a": 2}  # small blocks: contexts cross many block boundaries


def tables_for(seq_len: int, start: int = 0, reverse: bool = True) -> dict[str, list[int]]:
    """Block tables of distinct, non-consecutive physical blocks (reversed), for every kind: ``start``, ``start + 2``,
    … (requests of one step take starts whose ranges do not meet)."""
    out = {}
    for kind, bs in SIZES.items():
        n = blocks_needed(seq_len, kind, bs)
        blocks = [start + 2 * i for i in range(n)]
        out[kind] = blocks[::-1] if reverse else blocks
    return out


def expected_tokens(requests, block_size=4):
    """(positions, token_to_req, slot_mapping) by a plain loop over tokens."""
    pos, req, slot = [], [], []
    for r, rq in enumerate(requests):
        for i in range(rq.query_len):
            p = rq.seq_len - rq.query_len + i
            pos.append(p)
            req.append(r)
            slot.append(rq.block_tables["swa"][p // block_size] * block_size + p % block_size)
    return pos, req, slot


def test_hand_checked_batch():
    requests = [Request(10, 1, tables_for(10)), Request(7, 2, tables_for(7, 1)), Request(20, 5, tables_for(20, 5))]
    b = StepBatchBuilder(16, 4, 64, block_sizes=SIZES, decode_threshold=2).build(requests)
    assert (b.num_reqs, b.num_decodes, b.num_decode_tokens, b.num_tokens, b.token_capacity) == (3, 2, 3, 8, 16)
    assert (b.num_prefills, b.num_prefill_tokens) == (1, 5)
    assert b.query_start_loc.tolist() == [0, 1, 3, 8]
    assert b.seq_lens.tolist() == [10, 7, 20] and b.query_lens.tolist() == [1, 2, 5]
    assert b.positions.tolist() == [9, 5, 6, 15, 16, 17, 18, 19] + [-1] * 8
    assert b.token_to_req.tolist() == [0, 1, 1, 2, 2, 2, 2, 2] + [-1] * 8
    # request 0's swa table is [4, 2, 0] (3 blocks of 4 for 10 tokens): position 9 -> block 0, offset 1
    assert b.block_tables["swa"][0].tolist()[:3] == [4, 2, 0]
    assert b.slot_mapping[0] == 0 * 4 + 1
    # request 1: table [3, 1]; positions 5, 6 -> logical block 1 = physical 1, offsets 1, 2
    assert b.block_tables["swa"][1].tolist()[:2] == [3, 1]
    assert b.slot_mapping[1:3].tolist() == [5, 6]
    assert b.slot_mapping[8:].tolist() == [-1] * 8
    assert b.block_tables["swa"].shape == (3, 16) and b.block_tables["swa"][0, 3:].eq(-1).all()
    for t in (b.positions, b.token_to_req, b.slot_mapping, b.query_start_loc, b.block_tables["c4a"]):
        assert t.dtype == torch.int32


@st.composite
def request_lists(draw):
    lengths, threshold = draw(step_lengths(max_context=300, max_query=30))
    return lengths, threshold, draw(st.integers(0, 5))


@given(case=request_lists())
def test_tokens_match_a_loop_over_tokens(case):
    lengths, threshold, padding = case
    requests = [Request(s, q, tables_for(s, start=1000 * r, reverse=r % 2 == 0)) for r, (s, q) in enumerate(lengths)]
    n_tok = sum(q for _, q in lengths)
    b = StepBatchBuilder(n_tok + padding, len(lengths), 330, block_sizes=SIZES,
                         decode_threshold=threshold).build(requests)
    pos, req, slot = expected_tokens(requests)
    pad = [-1] * padding
    assert b.positions.tolist() == pos + pad
    assert b.token_to_req.tolist() == req + pad
    assert b.slot_mapping.tolist() == slot + pad
    num_decodes = sum(q <= threshold for _, q in lengths)
    assert b.num_decodes == num_decodes
    assert b.num_decode_tokens == sum(q for _, q in lengths[:num_decodes])
    assert b.query_start_loc.tolist() == [sum(q for _, q in lengths[:i]) for i in range(len(lengths) + 1)]
    for kind in SIZES:
        for r, rq in enumerate(requests):
            row = b.block_tables[kind][r].tolist()
            assert row[: len(rq.block_tables[kind])] == rq.block_tables[kind]
            assert all(x == -1 for x in row[len(rq.block_tables[kind]):])


def test_mtp_decodes_of_two_to_four_tokens():
    """decode_threshold = 1 + speculative tokens: query_len 2-4 are decodes with 3 draft tokens, 5 is a prefill."""
    lengths = [(50, 4), (60, 2), (70, 3), (80, 1), (90, 5)]
    requests = [Request(s, q, tables_for(s, 100 * r)) for r, (s, q) in enumerate(lengths)]
    b = StepBatchBuilder(32, 8, 128, block_sizes=SIZES, decode_threshold=4).build(requests)
    assert (b.num_decodes, b.num_decode_tokens, b.num_tokens) == (4, 10, 15)
    assert b.positions[:4].tolist() == [46, 47, 48, 49]
    with pytest.raises(ValueError, match="decode after a prefill"):
        StepBatchBuilder(32, 8, 128, block_sizes=SIZES, decode_threshold=3).build(requests)


def test_buffers_are_reused_and_stale_rows_cleared():
    builder = StepBatchBuilder(16, 4, 64, block_sizes=SIZES)
    big = builder.build([Request(20, 10, tables_for(20)), Request(9, 3, tables_for(9, 1))])
    ptrs = [t.data_ptr() for t in (big.positions, big.token_to_req, big.slot_mapping, big.block_tables["swa"])]
    small = builder.build([Request(5, 1, tables_for(5))])
    assert [t.data_ptr() for t in (small.positions, small.token_to_req, small.slot_mapping,
                                   small.block_tables["swa"])] == ptrs
    assert small.positions.tolist() == [4] + [-1] * 15
    assert small.slot_mapping[1:].eq(-1).all() and small.token_to_req[1:].eq(-1).all()
    assert small.block_tables["swa"].shape[0] == 1


def test_new_entries_are_those_completed_this_step():
    # request 0: prefix 6, 8 new -> seq 14: c4a entries 1, 2 (6//4 = 1, 14//4 = 3); no c128a entry
    # request 1: prefix 250, 10 new -> seq 260: c4a entries 62..64, c128a entry 1 (250//128 = 1, 260//128 = 2)
    requests = [Request(14, 8, tables_for(14)), Request(260, 10, tables_for(260, 1))]
    b = StepBatchBuilder(32, 4, 300, block_sizes=SIZES).build(requests)
    req, entry, slots = b.new_entries("c4a")
    assert req.tolist() == [0, 0, 1, 1, 1] and entry.tolist() == [1, 2, 62, 63, 64]
    table = [requests[r].block_tables["c4a"] for r in req.tolist()]
    assert slots.tolist() == [t[e // 4] * 4 + e % 4 for t, e in zip(table, entry.tolist())]
    req, entry, slots = b.new_entries("c128a")
    assert req.tolist() == [1] and entry.tolist() == [1]
    assert slots.tolist() == [requests[1].block_tables["c128a"][0] * 2 + 1]
    req, entry, slots = b.new_entries("swa")  # the new tokens themselves
    assert slots.tolist() == b.slot_mapping[: b.num_tokens].tolist()


def test_slots_of_marks_invalid_entries():
    table = torch.tensor([[3, 1, -1]], dtype=torch.int32)
    entries = torch.tensor([0, 5, -1, 9, 12], dtype=torch.int32)  # 9: block 2 is -1; 12: past the table
    assert slots_of(table, torch.zeros((), dtype=torch.int32), entries, 4).tolist() == [12, 5, -1, -1, -1]


def table(n):
    return {"swa": list(range(n)), "c4a": [0], "c128a": [0]}


@pytest.mark.parametrize("requests,match", [
    ([Request(200, 1, table(2))], r"request 0: block table for 'swa' has 2 blocks, seq_len 200 needs 4"),
    ([Request(5, 6, table(1))], r"request 0: query_len 6 must be in \[1, seq_len=5\]"),
    ([Request(5, 0, table(1))], r"query_len 0 must be in"),
    ([Request(70, 5, table(2)), Request(70, 1, table(2))], r"request 1 .* is a decode after a prefill"),
    ([Request(70, 1, {"swa": [0, 1]})], r"request 0: block_tables has no 'c4a' table"),
    ([Request(300, 1, table(5))], r"seq_len 300 exceeds max_model_len 256"),
    ([Request(70, 1, {"swa": [0, -1], "c4a": [0], "c128a": [0]})], r"negative block number"),
    ([Request(64, 12, table(1)), Request(64, 12, table(1))], r"24 new tokens, more than max_tokens=16"),
    ([Request(8, 1, table(1))] * 5, r"1 to 4 requests, got 5"),
    ([Request(10.5, 1, table(1))], r"request 0: seq_len and query_len must be ints"),
    ([Request(8, 1, {"swa": [2**26], "c4a": [0], "c128a": [0]})], r"pass int32"),
    ([], r"1 to 4 requests, got 0"),
])
def test_bad_batches_raise_value_error(requests, match):
    builder = StepBatchBuilder(16, 4, 256)
    with pytest.raises(ValueError, match=match):
        builder.build(requests)


def test_block_numbers_past_a_cache_are_rejected_when_its_size_is_given():
    requests = [Request(70, 1, {"swa": [3, 4], "c4a": [0], "c128a": [0]})]
    assert StepBatchBuilder(16, 4, 256).build(requests).block_tables["swa"][0, 1] == 4  # size unknown: kept
    sized = StepBatchBuilder(16, 4, 256, num_blocks={"swa": 5, "c4a": 1})
    assert sized.build(requests).block_tables["swa"][0].tolist()[:2] == [3, 4]
    with pytest.raises(ValueError, match=r"request 0: block table for 'swa' holds block 4, past the cache's "
                                         r"num_blocks\['swa'\]=4"):
        StepBatchBuilder(16, 4, 256, num_blocks={"swa": 4}).build(requests)
    with pytest.raises(ValueError, match=r"num_blocks\['c4a'\] must be an int >= 0, got 2.5"):
        StepBatchBuilder(16, 4, 256, num_blocks={"c4a": 2.5})
    with pytest.raises(TypeError, match="num_blocks must be a dict of cache kind -> int, got list"):
        StepBatchBuilder(16, 4, 256, num_blocks=[4])
    with pytest.raises(ValueError, match="num_blocks has a value for 'c8a'"):
        StepBatchBuilder(16, 4, 256, num_blocks={"c8a": 2})


def test_bad_builder_arguments():
    with pytest.raises(ValueError, match="decode_threshold must be >= 1"):
        StepBatchBuilder(16, 4, 256, decode_threshold=0)
    with pytest.raises(TypeError, match=r"max_tokens must be a positive int, got 2.5 \(float\)"):
        StepBatchBuilder(max_tokens=2.5, max_reqs=4, max_model_len=256)
    for name, args in (("max_reqs", (16, 0, 256)), ("max_model_len", (16, 4, -3))):
        with pytest.raises(ValueError, match=f"{name} must be a positive int"):
            StepBatchBuilder(*args)
    with pytest.raises(TypeError, match="decode_threshold must be an int"):
        StepBatchBuilder(16, 4, 256, decode_threshold=1.5)
    with pytest.raises(ValueError, match="kinds must be V4 kinds including 'swa'"):
        StepBatchBuilder(16, 4, 256, kinds=("c4a",))
    with pytest.raises(ValueError, match=r"block_sizes\['swa'\] must be an int >= 1, got 0"):
        StepBatchBuilder(16, 4, 256, block_sizes={"swa": 0})
    with pytest.raises(ValueError, match="block_sizes has a value for 'c4', which is not among kinds"):
        StepBatchBuilder(16, 4, 256, block_sizes={"c4": 64})
    with pytest.raises(ValueError, match="kind must be one of"):
        blocks_needed(100, "c8a")


def test_requests_of_the_wrong_types_are_named():
    builder = StepBatchBuilder(16, 4, 512)
    with pytest.raises(TypeError, match=r"request 0: block_tables must be a dict of cache kind -> block numbers, "
                                        r"got None"):
        builder.build([Request(300, 1, None)])
    with pytest.raises(TypeError, match=r"request 0: block_tables\['swa'\] must be a list of block numbers, got 3 "):
        builder.build([Request(3, 1, {"swa": 3, "c4a": [], "c128a": []})])
    with pytest.raises(TypeError, match=r"requests\[1\] must be a Request, got tuple"):
        builder.build([Request(3, 1, table(1)), (3, 1, table(1))])
    with pytest.raises(TypeError, match="request 0: shared_prefix_blocks must be a dict"):
        builder.build([Request(3, 1, table(1), None)])
    with pytest.raises(TypeError, match=r"requests must be a list \(or tuple\) of Request, decodes first, got "
                                        r"generator: pass list\(\.\.\.\) of it"):
        builder.build(Request(3, 1, table(1)) for _ in range(2))
    assert builder.build((Request(3, 1, table(1)),)).num_reqs == 1  # a tuple is a sequence too


ALIAS_SIZES = {"swa": 16, "c4a": 4, "c128a": 2}


def alias_tables(swa, c4a=(), c128a=()):
    return {"swa": list(swa), "c4a": list(c4a), "c128a": list(c128a)}


@pytest.mark.parametrize("requests,match", [
    # two token ranges of one request on one block: the second write would overwrite the first
    ([Request(48, 48, alias_tables([0, 1, 1], range(3)))], r"request 0: block table for 'swa' names block 1 twice"),
    ([Request(40, 1, alias_tables([0, 1, 2], [5, 6, 5]))], r"request 0: block table for 'c4a' names block 5 twice"),
    # two requests on one writable block (request 1 writes its block 3 this step, request 0 reads it)
    ([Request(20, 1, alias_tables([3, 4], [0, 1])), Request(30, 2, alias_tables([7, 3], [2, 3]))],
     r"requests 0 and 1 both use block 3 of the 'swa' cache, outside request 0's shared_prefix_blocks"),
    # shared on one side only: request 1 did not declare it read-only
    ([Request(40, 1, alias_tables([3, 4, 5], [0, 1, 2]), {"swa": 1}),
      Request(40, 1, alias_tables([3, 6, 7], [3, 4, 5]))],
     r"requests 0 and 1 both use block 3 of the 'swa' cache, outside request 1's shared_prefix_blocks"),
    # a repeated block inside a shared prefix is still two ranges of one request on one block
    ([Request(40, 1, alias_tables([3, 3, 5], [0, 1, 2]), {"swa": 2})],
     r"request 0: block table for 'swa' names block 3 twice"),
])
def test_aliased_block_tables_are_rejected(requests, match):
    builder = StepBatchBuilder(64, 4, 256, block_sizes=ALIAS_SIZES)
    with pytest.raises(ValueError, match=match):
        builder.build(requests)


def test_read_only_shared_prefix_blocks_are_allowed():
    """Prefix caching: requests list a common prompt's full blocks, each declaring them read-only."""
    builder = StepBatchBuilder(64, 4, 256, block_sizes=ALIAS_SIZES)
    prefix = {"swa": [10, 11], "c4a": [20, 21, 22, 23, 24, 25, 26, 27]}  # 32 tokens: 2 swa blocks, 8 c4a entries
    shared = {"swa": 2, "c4a": 2}
    requests = [Request(40, 1, alias_tables(prefix["swa"] + [1], prefix["c4a"][:2] + [2, 3, 4]), shared),
                Request(36, 4, alias_tables(prefix["swa"] + [5], prefix["c4a"][:2] + [6, 7, 8]), shared)]
    b = builder.build(requests)
    assert b.block_tables["swa"][:, :3].tolist() == [[10, 11, 1], [10, 11, 5]]
    # the new tokens land in each request's own block: positions 39 and 32…35 -> block 2 of its table
    assert b.slot_mapping[:5].tolist() == [1 * 16 + 7] + [5 * 16 + i for i in range(4)]
    req, entry, slots = b.new_entries("c4a")
    assert req.tolist() == [0, 1] and entry.tolist() == [9, 8]  # 40 // 4 - 1 = 9; 32 // 4 = 8
    assert slots.tolist() == [2 * 4 + 1, 6 * 4 + 0]


@pytest.mark.parametrize("shared,match", [
    ({"swa": 3}, r"shared_prefix_blocks\['swa'\] must be an int in \[0, 2\] \(shared blocks are read-only; this "
                 r"step writes its entry 39, in block 2\), got 3"),
    ({"c4a": 3}, r"shared_prefix_blocks\['c4a'\] must be an int in \[0, 2\]"),  # entry 9 (block 2) is completed
    ({"c128a": 1}, r"shared_prefix_blocks\['c128a'\] must be an int in \[0, 0\]"),  # needs no block
    ({"swa": -1}, r"must be an int in \[0, 2\]"),
    ({"swa": 1.0}, r"must be an int in \[0, 2\]"),
    ({"dsa": 1}, r"shared_prefix_blocks has 'dsa', not among kinds"),
])
def test_shared_prefixes_must_be_read_only(shared, match):
    builder = StepBatchBuilder(64, 4, 256, block_sizes=ALIAS_SIZES)
    with pytest.raises(ValueError, match=match):
        builder.build([Request(40, 1, alias_tables([1, 2, 3], [4, 5, 6]), shared)])


def test_aliasing_check_with_large_block_numbers():
    """Block numbers far above the step's table size (a large cache) take the sorting path: same verdicts."""
    builder = StepBatchBuilder(64, 4, 256, block_sizes=ALIAS_SIZES)
    big = 2**24
    ok = builder.build([Request(40, 1, alias_tables([big, big + 1, 7], [0, 1, 2])),
                        Request(20, 1, alias_tables([big + 2, 8], [3, 4]))])
    assert ok.max_block["swa"] == big + 2
    with pytest.raises(ValueError, match=f"requests 0 and 1 both use block {big + 1}"):
        builder.build([Request(40, 1, alias_tables([big, big + 1, 7], [0, 1, 2])),
                       Request(20, 1, alias_tables([big + 1, 8], [3, 4]))])


@pytest.mark.parametrize("form", ["numpy int32", "numpy int64", "torch int32", "torch int64", "rows of a 2-D table",
                                  "arrays and a list"])
def test_tables_as_arrays_or_tensors_build_what_lists_build(form):
    """Tables an engine keeps as arrays (numpy, CPU tensors, row views of one ``(reqs, blocks)`` table) are copied
    in one concatenation, not read entry by entry: the batch is the lists' bit for bit, and a mix takes the lists'
    path."""
    import numpy as np

    lengths = [(200, 1), (7, 2), (1, 1), (90, 5)]  # (1 token: no c128a block)
    requests = [Request(s, q, tables_for(s, 1000 * r)) for r, (s, q) in enumerate(lengths)]
    width = max(len(t) for rq in requests for t in rq.block_tables.values())
    grid = {k: np.full((len(requests), width + 3), -1, dtype=np.int64) for k in SIZES}
    for r, rq in enumerate(requests):
        for k, t in rq.block_tables.items():
            grid[k][r, : len(t)] = t

    def array(r: int, kind: str, t: list[int]):
        if form == "rows of a 2-D table":
            return grid[kind][r, : len(t)]  # a view into the engine's table
        if form == "arrays and a list":
            return t if r == 3 else np.asarray(t, dtype=np.int32)
        lib, bits = form.split()
        dtype = getattr(np if lib == "numpy" else torch, bits)
        return np.asarray(t, dtype=dtype) if lib == "numpy" else torch.tensor(t, dtype=dtype)

    as_arrays = [Request(rq.seq_len, rq.query_len, {k: array(r, k, t) for k, t in rq.block_tables.items()})
                 for r, rq in enumerate(requests)]
    want = StepBatchBuilder(16, 4, 256, block_sizes=SIZES, decode_threshold=2).build(requests)
    got = StepBatchBuilder(16, 4, 256, block_sizes=SIZES, decode_threshold=2).build(as_arrays)
    for kind in SIZES:
        assert torch.equal(got.block_tables[kind], want.block_tables[kind]), kind
    assert torch.equal(got.slot_mapping, want.slot_mapping)
