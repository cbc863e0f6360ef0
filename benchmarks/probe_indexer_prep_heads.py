"""The indexer's query prep with 4, 8 (the module's ``PREP_HEADS``), 16 or 32 heads a program: the prep alone and the
whole layer, CUDA-graph replays alternating in one process, on Triton 3.9 (the prep was last swept on 3.6,
docs/history.md version 26); the prepared queries and weights compared (the same bits: each head's values depend on
that head alone).

    python benchmarks/probe_indexer_prep_heads.py [--cases ...] [--out results/]
"""
from __future__ import annotations

from unittest import mock

import torch

from sparse_mla.ops.triton import indexer as kernels

from bench_indexer import cases, scored_layer
from harness import probe_main
from timing import graphed, timed_variants

NAMES = ("v4-flash-b32", "v4-flash-b128", "v41-flash-b128", "prefill-4k-on-32k")
HEADS = (4, 8, 16, 32)


def run(names: list[str]) -> list[dict]:
    rows = []
    for case in (c for c in cases(False) if c.name in names):
        s = scored_layer(case, torch.device("cuda"))
        spec, plan = s.layer.spec, s.plan
        prepared, fns = {}, {}
        for heads in HEADS:
            with mock.patch.object(kernels, "PREP_HEADS", heads):
                def prep() -> None:
                    kernels.launch_prepare_queries(s.q, s.w, plan.cos, plan.sin, case.kind == "dsa",
                                                   spec.q_format == "fp8", spec.weight_scale, plan.q, plan.w)

                prep()
                prepared[heads] = (plan.q.clone(), plan.w.clone())
                fns["prep", heads] = graphed(prep)
                fns["layer", heads] = graphed(lambda: s.layer(s.meta, s.q, s.w, s.cache))
        us = timed_variants(fns)
        base = prepared[8]
        row = dict(case=case.name, same=all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                                             for qw in prepared.values() for a, b in zip(qw, base)),
                   prep_us={h: us["prep", h] for h in HEADS}, layer_us={h: us["layer", h] for h in HEADS})
        rows.append(row)
        print(row, flush=True)
    return rows


if __name__ == "__main__":
    probe_main(__doc__, "probe_indexer_prep_heads", NAMES, run)
