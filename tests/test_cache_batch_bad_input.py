"""Bad input to the step batch and the paged caches: a ValueError / TypeError naming the argument, never another
request's blocks, a block order that is not the table's, or an error from inside torch."""
from __future__ import annotations

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
        with pytest.raises(ValueError, match="req must be a request of this batch"):
            b.entry_slots("swa", req, entries)
    with pytest.raises(TypeError, match="entries must be an integer tensor"):
        b.entry_slots("swa", 0, torch.tensor([0.9, 5.7]))


@pytest.mark.parametrize("bad", [None, "2", [2]])
def test_a_block_table_entry_that_is_not_a_number_is_named(bad):
    """A None, a str or a list among a table's block numbers: named with its request and kind."""
    builder = StepBatchBuilder(16, 4, 64, block_sizes=SIZES)
    t = tables(10)
    t["swa"] = [0, bad, 4]
    with pytest.raises(TypeError, match=r"request 0: block table for 'swa' must hold int block numbers"):
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
