"""Tensors on a GPU that is not the current one (a process that never called ``torch.cuda.set_device``, a notebook
working on ``cuda:1``): every kernel runs on its tensors' device, as torch's own ops do. Triton compiles, loads and
launches on the current device whatever its arguments' device: before, the first launch raised Triton's misleading
"Pointer argument (at 0) cannot be accessed from Triton (cpu tensor?)" (an H200 pair, version 46), and a step captured
in a CUDA graph would have been captured on the current device's stream while the kernels ran on the other.

Needs two CUDA GPUs (``GPU_TESTS=cp`` on ``nvidia-h200-x2``); each test makes GPU 0 current and works on GPU 1.
"""
from __future__ import annotations

import pytest
import torch

from indexer_cases import layer_step
from sparse_mla._checks import check_device
from sparse_mla.graphs import StepGraph
from sparse_mla.indexer_layer import SparseMLAIndexer
from sparse_mla.metadata import MetadataSpec, build_step_metadata
from sparse_mla.verify import kernel_checks, oracle_checks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                reason="needs two CUDA GPUs (scripts/gpu_check.sh's cp subset)")
OTHER = torch.device("cuda:1")


@pytest.fixture(autouse=True)
def first_gpu_current():
    """GPU 0 current for the test (GPU 1 holds its tensors); the caller's current device back after it."""
    before = torch.cuda.current_device()
    torch.cuda.set_device(0)
    yield
    torch.cuda.set_device(before)


def failures(checks) -> list[str]:
    return [f"{c.group}: {c.name}: {c.detail}" for c in checks if c.ok is False]


def test_the_kernels_match_the_reference_ops_on_a_gpu_that_is_not_current():
    """The attention kernels over every cache format, the insert and gather, the merge (``verify.kernel_checks``)."""
    checks = kernel_checks(OTHER)
    assert checks and not failures(checks)
    assert torch.cuda.current_device() == 0  # left as it was


def test_every_layer_kind_matches_the_dense_oracle_on_a_gpu_that_is_not_current():
    """V4, V4.1 and V3.2's layers on the device's own kernels (Gluon's on Hopper), every cache format of each model,
    against the float64 oracle (``verify.oracle_checks``: the demo's checks)."""
    checks = oracle_checks(OTHER)
    assert checks and not failures(checks)


def test_the_indexer_and_a_captured_step_give_the_picks_of_the_tensors_own_gpu():
    """The indexer layer (query prep, scores, select converting its picks) gives with GPU 0 current the bits it gives
    with GPU 1 current, eagerly and from a step captured in a CUDA graph while GPU 0 was current."""
    made = layer_step([(3000, 2), (900, 1), (640, 2), (70, 1)], 11, OTHER)
    sc, cache, q, w = made.scenario, made.cache, made.q, made.w
    layer = SparseMLAIndexer("c4a", q.shape[1], 64)
    with torch.cuda.device(OTHER):
        want = layer(sc.meta, q, w, cache).clone()
    assert torch.equal(layer(sc.meta, q, w, cache), want)
    picks = torch.empty_like(want)
    spec, meta = MetadataSpec(window=4, topk=64), sc.meta

    def step(batch):
        build_step_metadata(batch, spec, out=meta)
        picks.copy_(layer(meta, q, w, cache))

    graph = StepGraph(step, sc.batch, meta)
    picks.fill_(-7)
    graph.replay(sc.batch)
    torch.cuda.synchronize(OTHER)
    assert torch.equal(picks, want)
    assert torch.cuda.current_device() == 0


def test_a_gpu_named_without_its_index_is_the_one_current_when_named():
    """``"cuda"`` given to an object that keeps its device (a builder, a cache, a compressor pool) is the GPU current
    then, for good: its later tensors land there, whichever GPU is current by then."""
    with torch.cuda.device(OTHER):
        assert check_device("device", "cuda") == OTHER
    assert check_device("device", "cuda") == torch.device("cuda:0")
