"""The select's digit search started from a floor of each row's K-th largest word (``select_floor``: the least of
K or more groups' largest, a thread's own) against its start from the row's least valid word (``FLOOR`` 0, the rule
before version 49; its first pass too counted from the largest word, as since): the select alone on the layer's own
scores, the layer's graph alone and a step of :data:`bench_indexer.STEP_LAYERS` layers (µs a layer), CUDA-graph
replays alternating in one process, the picks compared (the same, in the same order).

    python benchmarks/probe_select_floor.py [--cases ...] [--out results/]
"""
from __future__ import annotations

import contextlib
from unittest import mock

import torch

from sparse_mla.ops.triton import indexer as kernels

from bench_indexer import STEP_LAYERS, layers_step, scored_cases, select_rows, select_variants
from harness import probe_main
from timing import graphed, timed_variants

NAMES = ("v4-flash-b32", "v4-flash-b128", "v4-pro-b32-top1024", "v41-flash-b32", "v41-flash-b128", "v32-b32",
         "v4-flash-b8-512k", "prefill-4k-on-32k")
CONTEXTS = {"floor": contextlib.nullcontext,
            "least word": lambda: mock.patch.object(kernels, "select_floor", lambda *rule_args: 0)}


def run(names: list[str]) -> list[dict]:
    out = []
    for case, s in scored_cases(names):
        rows, picks = select_rows(s)
        got, fns = select_variants(rows, case.topk, picks, CONTEXTS)
        fns = {f"{label}, select": fn for label, fn in fns.items()}
        step, step_picks = layers_step(case, s, list(CONTEXTS))
        layer_picks = {}
        for label, context in CONTEXTS.items():
            with context():
                layer_picks[label] = s.layer(s.meta, s.q, s.w, s.cache).clone()
                fns[f"{label}, layer"] = graphed(lambda: s.layer(s.meta, s.q, s.w, s.cache))
                fns[f"{label}, in a step"] = graphed(lambda label=label: step(label, STEP_LAYERS))
        us = timed_variants(fns)
        us.update({k: round(v / STEP_LAYERS, 2) for k, v in us.items() if k.endswith("in a step")})
        same = torch.equal(*got.values()) and torch.equal(*layer_picks.values()) and all(
            torch.equal(a, b) for a, b in zip(*step_picks.values()))
        row = dict(case=case.name, rows=rows.shape[0], cols=rows.shape[1], same=same, us=us)
        out.append(row)
        print(row, flush=True)
    return out


if __name__ == "__main__":
    probe_main(__doc__, "probe_select_floor", NAMES, run)
