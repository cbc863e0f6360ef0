"""What the kernel sweeps (``bench_decode.py``, ``bench_prefill.py``) share besides :mod:`timing`."""
from __future__ import annotations


def parse_sweep(spec: str) -> list[dict]:
    """Kernel launch overrides from ``'block_n=64,num_warps=8;gluon=0'``: one dict per config ([{}] if empty)."""
    if not spec:
        return [{}]
    return [{k: int(v) for k, v in (kv.split("=") for kv in part.split(","))} if part else {}
            for part in spec.split(";")]
