"""Whole DeepSeek-V4 serving steps (decode and prefill) through the layer API, ours vs FlashMLA (issue 15).

    python benchmarks/bench_step.py --out results/               # on a CUDA GPU, flash_mla optional (~4 min)
    python benchmarks/bench_step.py --smoke --out /tmp/smoke     # tiny sizes on the CPU

The same as ``sparse-mla bench``: see :mod:`sparse_mla.benchmark`.
"""
from __future__ import annotations

from sparse_mla import benchmark

if __name__ == "__main__":
    benchmark.main(__doc__, benchmark.add_arguments, benchmark.run)
