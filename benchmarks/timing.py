"""Timing helpers shared by the scripts in ``benchmarks/`` (they import it as ``timing``: a script's folder is
first on ``sys.path``).

GPU timings are CUDA-event medians from ``triton.testing.do_bench``, which flushes the L2 cache
before each call; on a machine without CUDA (the benchmarks' ``--smoke`` mode) :func:`timed`
falls back to a wall-clock median, and :func:`host_us` needs no device.
"""
from __future__ import annotations

import statistics
import sys
import time
from types import ModuleType
from typing import Callable, Hashable, Sequence

import torch


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn: Callable[[], object], rep_ms: int = 100) -> float:
    """Median time of ``fn`` in microseconds (``triton.testing.do_bench``: CUDA events, after warm-up).
    Without CUDA: the wall-clock median of a few calls."""
    if not torch.cuda.is_available():
        fn()
        samples = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - start)
        return statistics.median(samples) * 1e6
    import triton.testing

    return triton.testing.do_bench(fn, warmup=max(5, rep_ms // 4), rep=rep_ms, return_mode="median") * 1e3


def graphed(fn: Callable[[], object]) -> Callable[[], None]:
    """``fn`` captured once in a CUDA graph; returns its replay. Timing the replay measures the GPU work alone:
    a Python launch path slower than the L2 flush that ``do_bench`` runs before each call would otherwise
    leave the GPU idle inside the timed window (short kernels then time host-bound, bimodally). Raises
    ``RuntimeError`` if ``fn`` cannot be captured. The replay keeps ``fn`` (and what it holds) alive."""
    fn()  # compile and warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()

    def replay() -> None:
        graph.replay()

    # the replay reads the tensors the capture saw: ``fn`` (often the only holder of them, through its closure or
    # defaults) lives as long as the replay, or their memory could be reused or freed under it
    replay.captured = fn
    return replay


def host_us(fn: Callable[[], object], calls: int = 50) -> float:
    """Host (CPU) time of one call of ``fn`` in microseconds, GPU queue kept busy: its launch overhead."""
    fn()
    _sync()
    if torch.cuda.is_available():  # a spinning kernel ahead of the calls: their launches queue, never wait
        torch.cuda._sleep(int(calls * 1e6))  # ~0.5 ms of GPU clock per call, some 10× a call's host time
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    _sync()
    return elapsed / calls * 1e6


def _alternating(measure: Callable[[Callable[[], object]], float], fns: Sequence[Callable[[], object]],
                 rounds: int) -> list[list[float]]:
    """Each of ``fns`` ``measure``-d once per round, in turn, over ``rounds``: clock or load drift during a run then
    moves all of them alike instead of skewing their ratios. Returns each function's samples, in round order."""
    samples: list[list[float]] = [[] for _ in fns]
    for _ in range(rounds):
        for fn, mine in zip(fns, samples):
            mine.append(measure(fn))
    return samples


def timed_rounds(fns: Sequence[Callable[[], object]], rep_ms: int = 100, rounds: int = 3) -> list[float]:
    """GPU time of each of ``fns`` (us, :func:`timed`), timed in turn over ``rounds``: the median round's."""
    return [statistics.median(s) for s in _alternating(lambda fn: timed(fn, rep_ms), fns, rounds)]


PROBE_REP_MS, PROBE_ROUNDS = 60, 3  # a probe's alternating rounds: short ones, as a probe times many variants


def timed_variants(fns: dict[Hashable, Callable[[], object]], rep_ms: int = PROBE_REP_MS,
                   rounds: int = PROBE_ROUNDS) -> dict[Hashable, float]:
    """:func:`timed_rounds` of labelled ``fns`` (graphs, as the probes time them): each label's µs, to 0.01."""
    return {label: round(t, 2) for label, t in zip(fns, timed_rounds(list(fns.values()), rep_ms, rounds))}


def host_samples(fns: Sequence[Callable[[], object]], calls: int = 50, rounds: int = 5) -> list[list[float]]:
    """Host time of one call of each of ``fns`` (us, :func:`host_us` over ``calls``), timed in turn over ``rounds``:
    every round's (host speed drifts more than GPU clocks, so sides compared must alternate)."""
    return _alternating(lambda fn: host_us(fn, calls), fns, rounds)


def host_rounds(fns: Sequence[Callable[[], object]], calls: int = 50, rounds: int = 5) -> list[float]:
    """:func:`host_samples`' median round of each of ``fns`` (us)."""
    return [statistics.median(s) for s in host_samples(fns, calls, rounds)]


def timed_pair(fn_a: Callable[[], object], fn_b: Callable[[], object], rep_ms: int = 100,
               rounds: int = 3) -> tuple[float, float]:
    """:func:`timed_rounds` of two functions, alternating: ``(us of fn_a, us of fn_b)``."""
    a, b = timed_rounds((fn_a, fn_b), rep_ms, rounds)
    return a, b


def warm_up_gpu(seconds: float = 3.0) -> None:
    """Keep the GPU busy for a while so that the first timed case runs at full clocks."""
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    while True:
        for _ in range(20):
            a @ a
        end.record()
        end.synchronize()
        if start.elapsed_time(end) > seconds * 1e3:
            return


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative Frobenius error of ``a`` against ``b``."""
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def load_flash_mla() -> ModuleType | None:
    """The ``flash_mla`` module (sgl-flash-mla wheel), or None with a note on stderr."""
    try:
        import flash_mla
    except ImportError:
        print("flash_mla not importable: timing ours only", file=sys.stderr)
        return None
    return flash_mla
