"""The select's register cap (:func:`sparse_mla.ops.triton.indexer.select_maxnreg`): version 40's rule (16 warps where
the rows are at most two an SM, else the bit rounds' rule; no cap) against this version's (8 warps past two rows an SM)
without the cap and with it. Converting its picks in its launch, the 16-warp select took 82 registers a thread on
sm_90, one program an SM: in version 40 the layer's B 128 select ran in two waves, the probe's (not converting) in one.
Per variant the select alone on the layer's words, converting (the layer's launch) and not, and the whole layer (one
call's graph and a call's share of a four-layer step's graph); CUDA-graph replays alternating in one process. Compared:
each variant's select (an eager launch, not converting) and every layer's picks (eager, and each graph's after the
replays); the converting selects' graphs share one set of buffers, so their picks are not compared apart.

    python benchmarks/probe_select_cap.py [--cases ...] [--out results/]
"""
from __future__ import annotations

from contextlib import ExitStack
from unittest import mock

import torch

from sparse_mla.ops.triton import indexer as kernels
from sparse_mla.picks import step_picks

from bench_indexer import STEP_LAYERS, layers_step, scored_cases, select_rows
from harness import probe_main
from probe_select_warps import v39_rule
from timing import graphed, timed_variants

NAMES = ("v4-flash-b128", "v4-flash-b32", "prefill-4k-on-32k", "v41-flash-b128", "v4-flash-b8-512k", "v32-b32")


def v40_rule(rows: int, lanes: int, sms: int, digits: bool = False, keys: bool = False) -> int:
    """Version 40's ``select_warps``: 16 for the digit search over rows of 8,192 keys or more, at most two an SM."""
    return 16 if digits and lanes >= 8192 and rows <= 2 * sms else v39_rule(rows, lanes, sms)


VARIANTS = {"v40": (v40_rule, False), "rule, no cap": (kernels.select_warps, False),
            "rule": (kernels.select_warps, True)}
SIDES = ("select converting", "select", "layer", "step")


def variant(name: str) -> ExitStack:
    rule, capped = VARIANTS[name]
    stack = ExitStack()
    stack.enter_context(mock.patch.object(kernels, "select_warps", rule))
    if not capped:
        stack.enter_context(mock.patch.object(kernels, "select_maxnreg", lambda *args, **kwargs: None))
    return stack


def run(names: list[str]) -> list[dict]:
    out = []
    for case, s in scored_cases(names):
        rows, picks = select_rows(s)
        conversion = step_picks(s.meta, case.kind)
        into = conversion.select_into(0, s.plan.picks.shape[0]) if conversion.takes_select else None
        step, layer_picks = layers_step(case, s, list(VARIANTS))
        fns, got, eager = {}, {}, {}
        for name in VARIANTS:
            with variant(name):
                kernels.launch_topk_rows(rows, case.topk, picks)
                got[name] = picks.clone()
                fns["select converting", name] = graphed(lambda: kernels.launch_topk_rows(rows, case.topk, picks,
                                                                                          into))
                fns["select", name] = graphed(lambda: kernels.launch_topk_rows(rows, case.topk, picks))
                step(name, STEP_LAYERS)
                eager[name] = [p.clone() for p in layer_picks[name]]
                fns["layer", name] = graphed(lambda name=name: step(name, 1))
                fns["step", name] = graphed(lambda name=name: step(name, STEP_LAYERS))
        us = timed_variants(fns)
        for fn in fns.values():  # every graph's own picks, after all the replays
            fn()
        torch.cuda.synchronize()
        first = next(iter(VARIANTS))
        same = all(torch.equal(got[first], g) for g in got.values())
        same &= all(torch.equal(a, b) for v in VARIANTS for a, b in zip(eager[v], layer_picks[v]))
        same &= all(torch.equal(a, b) for v in VARIANTS for a, b in zip(layer_picks[first], layer_picks[v]))
        row = dict(case=case.name, rows=rows.shape[0], cols=rows.shape[1], converts=into is not None, same=same)
        for name in VARIANTS:
            row[name] = {f"{side.replace(' ', '_')}_us": us[side, name] for side in SIDES}
            row[name]["in_step_us"] = round(row[name].pop("step_us") / STEP_LAYERS, 2)
        out.append(row)
        print(row, flush=True)
    return out


if __name__ == "__main__":
    probe_main(__doc__, "probe_select_cap", NAMES, run)
