"""The select's warps a row where it searches by digits (Triton 3.8+ on NVIDIA: ``select_warps``' ``digits``): the
select alone on the layer's own scores at 4, 8, 16 and 32 warps, the version-39 rule (bit rounds' choice for both
searches) and the current one, then the whole layer under each rule (one call's graph, and a call's share of a graph of
four layers' calls, each layer its own keys, queries and weights); CUDA-graph replays alternating in one process, the
picks compared (the same, in the same order, whatever the warps; the layer's graphs after their replays against its
eager calls). Docs/history.md version 40; since version 41 the current rule's warps come with ``select_maxnreg``'s
cap where the rows outnumber the SMs (the fixed warps' variants: at 16 and 8, the same cap).

    python benchmarks/probe_select_warps.py [--cases ...] [--out results/]
"""
from __future__ import annotations

from unittest import mock

import torch
import triton

from sparse_mla.ops.triton import indexer as kernels

from bench_indexer import STEP_LAYERS, layers_step, scored_cases, select_rows, select_variants
from harness import probe_main
from timing import graphed, timed_variants

NAMES = ("v4-flash-b32", "v4-flash-b128", "v4-flash-b8-512k", "v4-pro-b32-top1024", "v41-flash-b32",
         "v41-flash-b128", "v32-b32", "prefill-4k-on-32k")
FIXED = (4, 8, 16, 32)


def v39_rule(rows: int, lanes: int, sms: int, digits: bool = False, keys: bool = False) -> int:
    """Version 39's ``select_warps`` (measured on bit rounds, taken by both searches)."""
    warps = max(4, triton.next_power_of_2(-(-lanes // (72 * 32))))
    return min(16, warps * 2 if rows < sms and warps < 8 else warps)


RULES = {"v39 rule": v39_rule, "rule": kernels.select_warps}
VARIANTS = {**RULES, **{f"{w} warps": (lambda *rule_args, w=w: w) for w in FIXED}}


def run(names: list[str]) -> list[dict]:
    out = []
    for case, scored in scored_cases(names):
        rows, picks = select_rows(scored)
        contexts = {name: lambda rule=rule: mock.patch.object(kernels, "select_warps", rule)
                    for name, rule in VARIANTS.items()}
        got, selects = select_variants(rows, case.topk, picks, contexts)
        fns = {("select", name): fn for name, fn in selects.items()}
        # the layer under each rule: one call, and a step of STEP_LAYERS calls over their own keys and queries
        step, layer_picks = layers_step(case, scored, list(RULES))
        eager = {}
        for name, rule in RULES.items():
            with mock.patch.object(kernels, "select_warps", rule):
                step(name, STEP_LAYERS)
                eager[name] = [p.clone() for p in layer_picks[name]]
                fns["layer", name] = graphed(lambda name=name: step(name, 1))
                fns["step", name] = graphed(lambda name=name: step(name, STEP_LAYERS))
        us = timed_variants(fns)
        for fn in fns.values():  # the layers' graphs' own picks, after all the replays
            fn()
        torch.cuda.synchronize()
        same = all(torch.equal(got["v39 rule"], g) for g in got.values())
        same &= all(torch.equal(a, b) for r in RULES for a, b in zip(eager[r], layer_picks[r]))
        same &= all(torch.equal(a, b) for a, b in zip(*layer_picks.values()))
        row = dict(case=case.name, rows=rows.shape[0], cols=rows.shape[1], same=same,
                   select_us={name: us["select", name] for name in VARIANTS},
                   layer_us={r: us["layer", r] for r in RULES},
                   in_step_us={r: round(us["step", r] / STEP_LAYERS, 2) for r in RULES})
        out.append(row)
        print(row, flush=True)
    return out


if __name__ == "__main__":
    probe_main(__doc__, "probe_select_warps", NAMES, run)
