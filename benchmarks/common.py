"""Helpers shared by the benchmark scripts (run them as ``python benchmarks/<name>.py``)."""
from __future__ import annotations

import statistics
import sys
import time

import torch
import triton


def timed(fn, rep_ms: int = 100) -> float:
    """Median time of ``fn`` in microseconds (``triton.testing.do_bench``: CUDA events, after warm-up)."""
    return triton.testing.do_bench(fn, warmup=max(5, rep_ms // 4), rep=rep_ms, return_mode="median") * 1e3


def graphed(fn):
    """``fn`` captured once in a CUDA graph; returns its replay. Timing the replay measures the GPU work alone:
    a Python launch path slower than the L2 flush that ``do_bench`` runs before each call would otherwise
    leave the GPU idle inside the timed window (short kernels then time host-bound, bimodally). Raises
    ``RuntimeError`` if ``fn`` cannot be captured."""
    fn()  # compile and warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def host_us(fn, calls: int = 50) -> float:
    """Host (CPU) time of one call of ``fn`` in microseconds, GPU queue kept busy: its launch overhead."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def timed_pair(fn_a, fn_b, rep_ms: int = 100, rounds: int = 3) -> tuple[float, float]:
    """Medians over ``rounds`` alternating timings of ``fn_a`` and ``fn_b`` (us): clock or load drift
    during a run then moves both alike instead of skewing their ratio."""
    a, b = [], []
    for _ in range(rounds):
        a.append(timed(fn_a, rep_ms))
        b.append(timed(fn_b, rep_ms))
    return statistics.median(a), statistics.median(b)


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


def load_flash_mla():
    """The ``flash_mla`` module (sgl-flash-mla wheel), or None with a note on stderr."""
    try:
        import flash_mla
    except ImportError:
        print("flash_mla not importable: timing ours only", file=sys.stderr)
        return None
    return flash_mla


def parse_sweep(spec: str) -> list[dict]:
    """Kernel launch overrides from ``'block_n=64,num_warps=8;gluon=0'``: one dict per config ([{}] if empty)."""
    if not spec:
        return [{}]
    return [{k: int(v) for k, v in (kv.split("=") for kv in part.split(","))} if part else {}
            for part in spec.split(";")]
