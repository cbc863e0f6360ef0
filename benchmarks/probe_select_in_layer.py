"""Why the layer's select takes longer after the scores than the select alone (docs/history.md version 40: at
V4-Flash B 128 it ends 17.9 µs after the scores at 16 warps, 18.0 at 4 in version 39, though alone it gained 4 µs
at 16): the layer
with its select at the rule's warps or at 4, launched as a programmatic dependent (its programs resident early,
waiting for the scores) or plainly (after the scores have completed), and at the rule's warps as a dependent with
no step conversion to write (the select converting nothing in its launch); per variant the layer's graph time (replays
alternating in one process) and its kernels' timeline (``probe_indexer_timeline``'s CUPTI records: the select's
start, and what it adds after the scores end), the picks compared. Since version 41 the rule's warps come with
``select_maxnreg``'s cap (B 128's rows: 64 registers a thread): its version-41 run was of version 40's code.

    python benchmarks/probe_select_in_layer.py [--cases ...] [--out results/]
"""
from __future__ import annotations

import itertools
from contextlib import ExitStack
from unittest import mock

import torch

from sparse_mla import indexer_layer
from sparse_mla.ops.triton import indexer as kernels

from bench_indexer import scored_cases
from harness import probe_main
from probe_indexer_timeline import kernel_records, summary
from timing import graphed, timed_variants

NAMES = ("v4-flash-b128", "v4-flash-b32", "prefill-4k-on-32k")


class PlainLaunch:
    """A JIT kernel whose launches go out plainly: not as programmatic dependents, its ``DEPENDENT`` off."""

    def __init__(self, kernel) -> None:
        self.kernel = kernel

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            kwargs.pop("launch_pdl", None)
            return launch(*args, **{**kwargs, "DEPENDENT": False})

        return run


def variant(warps: str, dependent: bool, converts: bool = True) -> ExitStack:
    """Inside, the layer's select at ``warps`` ("rule" or a count), launched as a dependent or plainly, and
    converting the step's picks in its launch or (``converts`` off: no step conversion) not."""
    stack = ExitStack()
    if not converts:
        stack.enter_context(mock.patch.object(indexer_layer, "step_picks", lambda meta, kind: None))
    if warps != "rule":
        stack.enter_context(mock.patch.object(kernels, "select_warps",
                                              lambda *rule_args: int(warps)))
    if not dependent:
        stack.enter_context(mock.patch.object(kernels, "_topk_rows_kernel", PlainLaunch(kernels._topk_rows_kernel)))
    return stack


def run(names: list[str]) -> list[dict]:
    out = []
    for case, s in scored_cases(names):
        variants = [(w, d, True) for w, d in itertools.product(("rule", "4"), (True, False))] + [("rule", True, False)]
        fns, picks, timelines = {}, {}, {}
        for warps, dependent, converts in variants:
            key = f"{warps} warps, {'dependent' if dependent else 'plain'}{'' if converts else ', unconverted'}"
            with variant(warps, dependent, converts):
                picks[key] = s.layer(s.meta, s.q, s.w, s.cache).clone()
                fn = graphed(lambda: s.layer(s.meta, s.q, s.w, s.cache))
            fns[key] = fn
            timelines[key] = summary(kernel_records(fn, 30))
        first = next(iter(picks.values()))
        row = dict(case=case.name, same=all(torch.equal(first, p) for p in picks.values()),
                   layer_us=timed_variants(fns),
                   select={k: {f: round(tl[-1][f], 2) for f in ("start", "span", "exposed")}
                           for k, tl in timelines.items()},
                   scores_end={k: round(tl[-2]["end"], 2) for k, tl in timelines.items()})
        out.append(row)
        print(row, flush=True)
    return out


if __name__ == "__main__":
    probe_main(__doc__, "probe_select_in_layer", NAMES, run)
