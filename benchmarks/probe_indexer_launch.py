"""Sweep the indexer score kernel's launch (pages per program, warps, pipeline stages) on a GPU: one-off tuning.

    python benchmarks/probe_indexer_launch.py [--cases v4-flash-b128 v4-flash-b32] [--out results/]

For each case of bench_indexer.py, the score kernel alone (CUDA-graph replays) at every launch of the sweep, writing
the scores as the layer does (words or packed keys, ``SparseMLAIndexer.scores_as_words``), against the key bytes at
the copy rate of the same run; the scores of every launch are checked equal to the first launch's (the launch changes
no arithmetic). JSON to ``--out/probe_indexer_launch.json``.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os

import torch

from sparse_mla.indexer import StepTokens, prepare_queries
from sparse_mla.ops import targets
from sparse_mla.ops.triton import indexer as kernels

from bench_indexer import KEY_BYTES, cases, copy_gbs, scored_layer
from timing import graphed, timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=["v4-flash-b128", "v4-flash-b32"])
    parser.add_argument("--out", default=os.environ.get("OUT", "results"))
    args = parser.parse_args()
    dev = torch.device("cuda")
    rate = copy_gbs(dev, 50)
    results = []
    for case in (c for c in cases(False) if c.name in args.cases):
        batch, meta, cache, q, w, layer, plan = scored_layer(case, dev)
        words = layer.scores_as_words(plan)
        (t0, t1, longest), = plan.chunks_for(words)
        step = StepTokens.of(batch, case.kind)
        q_ready, w_ready = prepare_queries(q, w, batch.positions, layer.spec)
        q_dot, native = q_ready.to(plan.q.dtype), targets.target_of(dev).native_fp8
        scores = plan.scores(t1 - t0, words)
        key_us = case.batch * (case.context // 4) * KEY_BYTES[cache.fmt] / rate / 1e3
        expect = None
        for pages, warps, stages in itertools.product((4, 8, 16, 32), (4, 8), (2, 3, 4)):
            def run(launch=(pages, warps, stages)):
                kernels.index_scores(q_dot, w_ready, cache, step, scores, t0, t1, longest, plan.q.dtype, native,
                                     launch=launch)
            try:
                run()
                if expect is None:
                    expect = scores.clone()
                same = bool(torch.equal(scores, expect))
                us = timed(graphed(run), 50)
            except Exception as err:  # a launch that does not fit (shared memory, registers): noted, not fatal
                results.append(dict(case=case.name, words=words, pages=pages, warps=warps, stages=stages,
                                    error=str(err)[:200]))
                continue
            results.append(dict(case=case.name, words=words, pages=pages, warps=warps, stages=stages, us=us,
                                same=same, over_key_read=us / key_us))
            print(f"{case.name:16s} pages {pages:2d} warps {warps} stages {stages}: {us:7.1f} us "
                  f"({us / key_us:.2f}x key read){'' if same else '  DIFFERENT BITS'}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "probe_indexer_launch.json"), "w") as f:
        json.dump(dict(copy_gbs=rate, rows=results), f, indent=1)


if __name__ == "__main__":
    main()
