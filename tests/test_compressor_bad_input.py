"""Bad input to the KV compressors, their state pool and metadata: a ValueError / TypeError naming the argument,
before anything is written (a failed call writes nothing: docs/checks.md), never silently wrong entries or an error
from inside Python or torch. The reference backend on the CPU; the kernel path on the GPU, or in Triton's interpreter
on the CPU (tests/conftest.py sets TRITON_INTERPRET=1 without a GPU)."""
from __future__ import annotations

import pytest
import torch

from compress_feed import Feeder, make_params, make_sequences
from helpers import DEVICE, KERNEL_RUNS
from sparse_mla.batch import Request
from sparse_mla.cache import PagedCache
from sparse_mla.compress_metadata import allocate_compress_metadata, build_compress_metadata
from sparse_mla.compress_state import CompressorStatePool
from sparse_mla.compressor import KVCompressor
from sparse_mla.indexer_cache import IndexerKeyCache

EPS = 1e-6


def _setup(dim: int, backend: str = "reference", device: str | torch.device = "cpu"):
    """A request of 8 tokens at ratio 4, a compressor of ``dim`` channels and its cache (fp8)."""
    feeder = Feeder([8], 4, device=device)
    weight, ape = make_params(4, dim)
    comp = KVCompressor(feeder.pool, dim, weight, EPS, ape=ape, backend=backend)
    nb, bs = feeder.num_blocks[feeder.kind], feeder.block_size
    cache = (PagedCache(nb, bs, "fp8_v4", device=device) if dim == 512 else
             IndexerKeyCache(nb, "fp8", device=device, block_size=bs))
    return feeder, comp, cache


@pytest.mark.parametrize("dim", [512, 128])
@pytest.mark.parametrize("which", ["kv", "score"])
def test_a_non_finite_projection_is_named_and_writes_nothing(dim, which):
    """A NaN in kv or score (the reference backend checks values: it syncs anyway) is refused before the state rings
    or the cache are touched, naming the caller's argument; the same step then runs with the input mended."""
    feeder, comp, cache = _setup(dim)
    (kv, score), = make_sequences([8], 4, dim)
    bad_kv, bad_score = kv.clone(), score.clone()
    (bad_kv if which == "kv" else bad_score)[2, 1] = float("nan")
    _, _, meta = feeder.step([(0, 8)])
    rings = [t.clone() for t in feeder.pool.layers[comp.layer]]
    cache_before = cache.data.view(torch.uint8).clone()
    with pytest.raises(ValueError, match=f"^{which} must be finite"):
        comp.forward(bad_kv, bad_score, meta, cache)
    assert all(torch.equal(a, b) for a, b in zip(rings, feeder.pool.layers[comp.layer]))
    assert torch.equal(cache.data.view(torch.uint8), cache_before)
    comp.forward(kv, score, meta, cache)  # not recorded as run: the step is still this compressor's to run


@pytest.mark.skipif(not KERNEL_RUNS, reason="needs a GPU or TRITON_INTERPRET=1")
@pytest.mark.parametrize("dim", [512, 128])
def test_a_non_finite_projection_is_refused_on_the_kernels_under_debug(dim, monkeypatch):
    """With SPARSE_MLA_DEBUG=1 the kernel path checks values too (a sync), as the reference does."""
    monkeypatch.setenv("SPARSE_MLA_DEBUG", "1")
    feeder, comp, cache = _setup(dim, backend="triton", device=DEVICE)
    (kv, score), = make_sequences([8], 4, dim)
    kv = kv.to(DEVICE)
    kv[2, 1] = float("nan")
    _, _, meta = feeder.step([(0, 8)])
    with pytest.raises(ValueError, match="kv must be finite"):
        comp.forward(kv, score.to(DEVICE), meta, cache)


def test_a_compressor_made_after_the_pool_s_first_step_is_refused():
    """A compressor added to a pool whose requests have fed tokens would start with empty rings for their open
    windows (its entries would pool zeros for the earlier positions): refused when made."""
    feeder = Feeder([8], 4)
    weight, ape = make_params(4, 512)
    first = KVCompressor(feeder.pool, 512, weight, EPS, ape=ape)
    (kv, score), = make_sequences([8], 4, 512)
    _, _, meta = feeder.step([(0, 3)])
    first.forward(kv[:3], score[:3], meta, PagedCache(feeder.num_blocks[feeder.kind], feeder.block_size, "bf16"))
    with pytest.raises(ValueError, match="before its first step"):
        KVCompressor(feeder.pool, 512, weight, EPS, ape=ape)


@pytest.mark.parametrize("case", ["a missing prefix length", "an end before the start", "a slot not allocated"])
def test_the_state_pool_records_a_step_only_when_every_request_passes(case):
    """advance checks each request's slot, prefix and end (not only the pairs zip() lines up) before it records."""
    pool = CompressorStatePool(4, 3)
    a, b = pool.allocate(), pool.allocate()
    pool.advance([a, b], [0, 0], [4, 4])
    steps = pool.steps
    with pytest.raises(ValueError, match="one entry per request|seq_lens|state_slots"):
        if case == "a missing prefix length":
            pool.advance([a, b], [4], [6, 6])
        elif case == "an end before the start":
            pool.advance([a], [4], [1])
        else:
            pool.advance([a, [b]], [4, 4], [6, 6])
    assert (pool.seen(a), pool.seen(b), pool.steps) == (4, 4, steps)


@pytest.mark.parametrize("which", ["norm_weight", "ape"])
def test_non_finite_weights_are_refused_when_the_compressor_is_made(which):
    """A NaN or inf weight would make every entry non-finite: checked once, when the compressor is made."""
    pool = CompressorStatePool(4, 2)
    weight, ape = make_params(4, 512)
    (weight if which == "norm_weight" else ape)[0, ...] = float("nan") if which == "norm_weight" else float("inf")
    with pytest.raises(ValueError, match=f"{which} must be finite"):
        KVCompressor(pool, 512, weight, EPS, ape=ape)


def test_a_gpu_this_machine_does_not_have_is_named():
    """A device string torch parses but this machine cannot use: a ValueError naming ``device``."""
    with pytest.raises(ValueError, match="device"):
        CompressorStatePool(4, 2, device=f"cuda:{torch.cuda.device_count()}")


@pytest.mark.parametrize("case", ["0-d tensor", "2-d tensor", "nested list", "no batch"])
def test_metadata_arguments_of_the_wrong_kind_are_named(case):
    """state_slots must be a flat sequence of ints (or a 1-D tensor), batch a StepBatch."""
    feeder = Feeder([8], 4)
    batch = feeder.builder.build([Request(3, 3, feeder.tables[0])])
    slot = feeder.state[0]
    with pytest.raises((TypeError, ValueError), match="state_slots|batch"):
        if case == "0-d tensor":
            build_compress_metadata(batch, feeder.pool, torch.tensor(slot))
        elif case == "2-d tensor":
            build_compress_metadata(batch, feeder.pool, torch.tensor([[slot]]))
        elif case == "nested list":
            build_compress_metadata(batch, feeder.pool, [[slot]])
        else:
            allocate_compress_metadata(None, feeder.pool)
