"""The select's chosen entries stored by inline PTX from the registers they lie in (``indexer.PTX_STORE``) against
``tl.store``, whose coalescing converts the tile (the 64-bit output addresses, the values, the mask) to its own
layout through shared memory first, the slots being data (sm_90, a converting select over 8,192 words at 16 warps:
27 -> 21 barriers, 1,461 -> 1,360 SASS instructions; a segment pass writing keys over 32,768 packed columns 31 -> 13,
3,297 -> 2,657). Per variant the select alone on the layer's words, converting (the layer's launch) and not, and the
whole layer (one call's graph and a call's share of a four-layer step's graph); CUDA-graph replays alternating in one
process; every variant's picks compared (the select's eager launch, and every layer's picks).

    python benchmarks/probe_select_ptx_store.py [--cases ...] [--out results/] [--lowering sm80|sm86|sm89]
"""
from __future__ import annotations

from unittest import mock

from sparse_mla.ops.triton import indexer as kernels

from harness import probe_main
from select_sides import run_sides

NAMES = ("v4-flash-b32", "v4-flash-b128", "v4-flash-b8-512k", "v41-flash-b128", "v32-b32", "prefill-4k-on-32k")
VARIANTS = {"tl.store": False, "ptx": True}


def run(names: list[str]) -> list[dict]:
    return run_sides(names, {name: (lambda ptx=ptx: mock.patch.object(kernels, "PTX_STORE", ptx))
                             for name, ptx in VARIANTS.items()})


if __name__ == "__main__":
    probe_main(__doc__, "probe_select_ptx_store", NAMES, run, lowerings=("sm80", "sm86", "sm89"))
