"""The score kernel's head sum, chained fused multiply-adds (``heads_chained``) against ``tl.sum``: the scores alone
and the whole layer call, CUDA-graph replays alternating in one process, each variant's picks compared with the
reference's and with each other's (docs/history.md version 38).

    python benchmarks/probe_indexer_head_sum.py [--cases ...] [--out results/]
    python benchmarks/probe_indexer_head_sum.py --lowering sm80     # the sm_80 code on this GPU (lower_as)
"""
from __future__ import annotations

from unittest import mock

import torch

from sparse_mla.indexer import StepTokens, index_topk_reference, prepare_queries
from sparse_mla.ops.triton import indexer as kernels

from bench_indexer import cases, scored_layer, scores_alone
from harness import probe_main
from timing import graphed, timed_rounds

NAMES = ("v4-flash-b32", "v4-flash-b128", "v41-flash-b128", "v32-b32", "prefill-4k-on-32k")


def head_sum(chained: bool):
    """The layer's score launches with the head sum ``chained`` or not, whatever the target's rule (a context)."""
    return mock.patch.object(kernels, "heads_chained", lambda target: chained)


def run(names: list[str]) -> list[dict]:
    dev = torch.device("cuda")
    rows = []
    for case in (c for c in cases(False) if c.name in names):
        scored = scored_layer(case, dev)
        layer, meta, q, w, cache, plan = scored.layer, scored.meta, scored.q, scored.w, scored.cache, scored.plan
        tokens = scored.batch.num_tokens
        step = StepTokens.of(scored.batch, case.kind)
        q_ready, w_ready = prepare_queries(q, w, scored.batch.positions, layer.spec)
        ref = index_topk_reference(q_ready, w_ready, cache, step, case.topk)[:tokens]
        alone = scores_alone(layer, plan, q_ready, w_ready, cache, step)
        got, fns = {}, []
        for chained in (False, True):
            with head_sum(chained):
                got[chained] = layer(meta, q, w, cache)[:tokens].clone()
                fns.append(graphed(lambda: layer(meta, q, w, cache)))
            if alone is not None:  # the scores alone, as the layer launches them
                alone.launch(chained=chained)
                got[("scores", chained)] = alone.scores.clone()
                fns.append(graphed(lambda chained=chained: alone.launch(chained=chained)))
        us = timed_rounds(fns, 60, 3)
        row = dict(case=case.name, layer_us={"sum": us[0], "chained": us[2 if len(fns) == 4 else 1]},
                   rows_equal_reference={str(c): (got[c].sort(1).values == ref.sort(1).values).all(1).float().mean()
                                         .item() for c in (False, True)},
                   picks_equal=(got[False].sort(1).values == got[True].sort(1).values).all(1).float().mean().item())
        if len(fns) == 4:
            a, b = got[("scores", False)], got[("scores", True)]
            row.update(scores_us={"sum": us[1], "chained": us[3]}, words_equal=(a == b).float().mean().item())
        rows.append(row)
        print(row, flush=True)
    return rows


if __name__ == "__main__":
    probe_main(__doc__, "probe_indexer_head_sum", NAMES, run, ("sm80", "sm86", "sm89"))
