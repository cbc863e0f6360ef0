"""Helpers shared by the benchmark scripts (run them as ``python benchmarks/<name>.py``)."""
from __future__ import annotations

from sparse_mla.timing import (graphed, host_rounds, host_us, load_flash_mla, rel, timed, timed_pair,  # noqa: F401
                               timed_rounds, warm_up_gpu)


def parse_sweep(spec: str) -> list[dict]:
    """Kernel launch overrides from ``'block_n=64,num_warps=8;gluon=0'``: one dict per config ([{}] if empty)."""
    if not spec:
        return [{}]
    return [{k: int(v) for k, v in (kv.split("=") for kv in part.split(","))} if part else {}
            for part in spec.split(";")]
