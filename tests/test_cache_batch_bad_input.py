"""Bad input to the step batch and the paged caches: a ValueError / TypeError naming the argument, never another
request's blocks, a block order that is not the table's, or an error from inside torch."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from sparse_mla.batch import Request, StepBatchBuilder, blocks_needed, slots_of
from sparse_mla.cache import PagedCache
from sparse_mla.cache_views import cache_view

SIZES = {"swa": 4, "c4a": 4, "c128a": 2}


def tables(seq_len: int, start: int = 0) -> dict[str, list[int]]:
    """Every kind's blocks for ``seq_len`` tokens: even (``start`` 0) or odd (``start`` 1) block numbers."""
    return {k: [start + 2 * i for i in range(blocks_needed(seq_len, k, bs))] for k, bs in SIZES.items()}


def two_request_batch():
    builder = StepBatchBuilder(16, 4, 64, block_sizes=SIZES)
    return builder.build([Request(10, 1, tables(10)), Request(10, 1, tables(10, 1))])


def test_entry_slots_takes_a_request_of_the_batch_and_integer_entries():
    """StepBatch.entry_slots: req -1 would read the last request's table (Python's negative index), req 2 of two
    fail inside torch, float entries be cut to ints."""
    b = two_request_batch()
    entries = torch.tensor([0, 5])
    assert b.entry_slots("swa", 1, entries).tolist() == [4, 13]  # request 1: blocks 1 and 3 of size 4
    for req in (-1, 2):
        with pytest.raises(ValueError, match="req must be request"):
            b.entry_slots("swa", req, entries)
    with pytest.raises(TypeError, match="entries must be an integer tensor"):
        b.entry_slots("swa", 0, torch.tensor([0.9, 5.7]))



@pytest.mark.parametrize("req", [torch.tensor(-1), torch.tensor([0, 2]), torch.tensor([[0], [1], [0]]),
                                 torch.tensor([0, 1, 0]), torch.zeros(0, dtype=torch.int64), 2**70])
def test_entry_slots_checks_a_tensor_of_requests(req):
    """A tensor req is checked like an int: -1 would read the last request's table, 2 of two fail inside torch, and
    a req that does not broadcast to the entries has no slot to give."""
    b = two_request_batch()
    with pytest.raises(ValueError, match=r"req (must|of shape)"):
        b.entry_slots("swa", req, torch.tensor([0, 5]))


def test_entry_slots_takes_requests_per_entry():
    b = two_request_batch()
    # request 1's entry 0 (block 1), request 0's entry 5 (block 2, offset 1)
    assert b.entry_slots("swa", torch.tensor([1, 0]), torch.tensor([0, 5])).tolist() == [4, 9]


@pytest.mark.parametrize("req, entries", [(0.0, torch.tensor([0])), (True, torch.tensor([0])),
                                          (torch.tensor([0.0]), torch.tensor([0])), (0, torch.tensor([True]))])
def test_entry_slots_refuses_floats_and_bools(req, entries):
    """A float or bool request or entry would be taken as an int (True as request 1, entry 1)."""
    with pytest.raises(TypeError, match=r"(req|entries) must be"):
        two_request_batch().entry_slots("swa", req, entries)


def test_entry_slots_of_an_int64_entry_past_int32_is_minus_one():
    """Entry 2^32 + 1 lies past every table: -1, not entry 1's slot (a cast to int32 would wrap it)."""
    b = two_request_batch()
    assert b.entry_slots("swa", 0, torch.tensor([1, 2**32 + 1])).tolist() == [1, -1]

@pytest.mark.parametrize("bad", [None, "2", [2], 0.7, True])
def test_a_block_table_entry_that_is_not_an_int_is_named(bad):
    """A None, a str, a list, a float or a bool among a table's block numbers: named with its request and kind (a
    bool or a float is a number torch would take as block 1 or 0)."""
    builder = StepBatchBuilder(16, 4, 64, block_sizes=SIZES)
    t = tables(10)
    t["swa"] = [0, bad, 4]
    with pytest.raises(TypeError, match=r"request 0: block table for 'swa' must hold int block numbers"):
        builder.build([Request(10, 1, t)])


@pytest.mark.parametrize("table", [torch.tensor([0, 2, 4]), np.array([0, 2, 4], dtype=np.int32), [0, np.int64(2), 4]])
def test_a_block_table_of_numpy_or_torch_ints_is_taken(table):
    """Tables of numpy ints, an int array or an int tensor are block numbers like a list of Python ints."""
    builder = StepBatchBuilder(16, 4, 64, block_sizes=SIZES)
    t = tables(10)
    t["swa"] = table
    batch = builder.build([Request(10, 1, t)])
    assert batch.block_tables["swa"][0, :3].tolist() == [0, 2, 4]


@pytest.mark.parametrize("table", [torch.tensor([0.0, 2.0, 4.0]), torch.tensor([True, False, True]),
                                   np.array([0.5, 2.0, 4.0]), np.array([0, 2, 4], dtype=np.uint64),
                                   np.array([[0], [2], [4]]), {0: 0, 2: 0, 4: 0}.keys(),
                                   torch.tensor([0, 2, 4], device="meta"), np.ma.array([0, 99, 4], mask=[0, 1, 0])])
def test_a_block_table_of_another_dtype_or_shape_is_refused(table):
    """Floats, bools and uint64 (which int64 would wrap) are not block numbers; a 2-D array or a dict's keys is not a
    list of them, nor a meta tensor (no values) or a masked array (its hidden values would be taken as blocks)."""
    builder = StepBatchBuilder(16, 4, 64, block_sizes=SIZES)
    t = tables(10)
    t["swa"] = table
    with pytest.raises(TypeError, match=r"request 0: block_tables\['swa'\] must be a list of block numbers"):
        builder.build([Request(10, 1, t)])


def test_a_block_number_past_int64_is_named():
    builder = StepBatchBuilder(16, 4, 64, block_sizes=SIZES)
    t = tables(10)
    t["swa"] = [0, 2**70, 4]
    with pytest.raises(ValueError, match=r"request 0: block table for 'swa' holds a block number past int64"):
        builder.build([Request(10, 1, t)])


def test_a_block_table_that_is_a_set_is_refused():
    """A set has no order: its blocks would map positions in hash order."""
    builder = StepBatchBuilder(16, 4, 64, block_sizes=SIZES)
    t = tables(10)
    t["swa"] = {30, 2, 17}
    with pytest.raises(TypeError, match=r"block_tables\['swa'\] must be a list of block numbers"):
        builder.build([Request(10, 1, t)])


def test_cache_view_of_a_non_tensor_names_the_argument():
    """cache_view takes a cache tensor (a PagedCache's ``.data``), not the PagedCache or None."""
    for bad in (PagedCache(2, 4, "fp8_v4"), None):
        with pytest.raises(TypeError, match="kv_cache must be a cache tensor"):
            cache_view(bad, None, "kv_cache")


def test_a_gpu_this_machine_does_not_have_is_named():
    """PagedCache and StepBatchBuilder check their device as the other constructors do (a ValueError naming it)."""
    missing = f"cuda:{torch.cuda.device_count()}"
    for bad in (missing, "gpu0"):
        with pytest.raises(ValueError, match="device"):
            PagedCache(2, 4, "bf16", device=bad)
        with pytest.raises(ValueError, match="device"):
            StepBatchBuilder(16, 4, 64, device=bad)


@pytest.mark.parametrize("device", ["mps", "xpu:0", "hpu"])
def test_a_device_type_the_library_does_not_run_on_is_named(device):
    """Every object that keeps its device refuses torch's other backends by name (they raised an AssertionError, a
    NotImplementedError or a ModuleNotFoundError from inside torch, or passed, to fail at the first tensor made)."""
    from sparse_mla.compress_state import CompressorStatePool
    from sparse_mla.indexer_cache import IndexerKeyCache

    for make in (lambda: PagedCache(2, 4, "bf16", device=device), lambda: StepBatchBuilder(16, 4, 64, device=device),
                 lambda: IndexerKeyCache(2, "fp8", device=device), lambda: CompressorStatePool(4, 8, device=device)):
        with pytest.raises(ValueError, match="device must be the CPU or a CUDA / ROCm GPU"):
            make()


def test_slots_of_takes_a_positive_block_size():
    table = torch.tensor([[0, 1], [5, 6]], dtype=torch.int32)
    assert slots_of(table, torch.tensor([1]), torch.tensor([5]), 4).tolist() == [25]  # block 6 · 4 + 1
    with pytest.raises(ValueError, match="block_size"):
        slots_of(table, torch.tensor([0]), torch.tensor([1]), 0)


def test_max_model_len_fits_int32_positions():
    """Positions and lengths are int32: a max_model_len of 2^31 or more is named (it would allocate tables for it)."""
    big = {"swa": 2**30, "c4a": 2**30, "c128a": 2**30}  # tiny tables: the check comes first anyway
    with pytest.raises(ValueError, match="max_model_len must be below 2"):
        StepBatchBuilder(16, 1, 2**40, block_sizes=big)


@pytest.mark.parametrize("make", [lambda t: np.asarray(t, dtype=np.int64),
                                  lambda t: torch.tensor(t, dtype=torch.int32)])
@pytest.mark.parametrize("blocks, message", [([0, -3, 4], "holds a negative block number"),
                                             ([0, 2, 99], r"holds block 99, past the cache's num_blocks\['swa'\]=50"),
                                             ([0, 2, 0], "names block 0 twice"),
                                             ([0, 2**31 // 4, 4], "whose slots .* pass int32")])
def test_bad_blocks_in_array_tables_are_named_as_in_lists(make, blocks, message):
    """Array and tensor tables take the builder's one-concatenation path: their values get the lists' checks."""
    builder = StepBatchBuilder(16, 4, 64, block_sizes=SIZES, num_blocks={"swa": 50} if "99" in message else None)
    t = tables(10, start=10)
    t["swa"] = make(blocks)
    with pytest.raises(ValueError, match=message):
        builder.build([Request(10, 1, t)])


@pytest.mark.parametrize("make", [list, np.array])
def test_a_block_number_whose_slots_pass_int32_is_named_however_large(make):
    """2^62 · 4 wraps int64 to 0: the check compares the block with int32's last slot's block, no product."""
    for big in (2**62, 2**61 + 1, 2**31 // 4):
        t = tables(10, start=10)
        t["swa"] = make([big, 2, 4])
        with pytest.raises(ValueError, match=r"request 0: block table for 'swa' holds a block number whose slots"):
            StepBatchBuilder(16, 4, 64, block_sizes=SIZES).build([Request(10, 1, t)])


def test_a_table_s_entries_past_its_need_are_not_stored():
    """The rows hold the blocks seq_len needs and -1 after them: entries past them are not read, so not checked,
    and their int32 cast (2^40 is 0) could have named a real block."""
    t = tables(10, start=10)
    t["swa"] = [3, 5, 7, 2**40, 9]  # 10 tokens in blocks of 4: 3 blocks
    batch = StepBatchBuilder(16, 4, 64, block_sizes=SIZES).build([Request(10, 1, t)])
    assert batch.block_tables["swa"][0, :6].tolist() == [3, 5, 7, -1, -1, -1]


def test_a_negated_tensor_view_gives_its_values():
    t = tables(10, start=10)
    t["swa"] = torch._neg_view(torch.tensor([-3, -5, -7]))
    batch = StepBatchBuilder(16, 4, 64, block_sizes=SIZES).build([Request(10, 1, t)])
    assert batch.block_tables["swa"][0, :3].tolist() == [3, 5, 7]
