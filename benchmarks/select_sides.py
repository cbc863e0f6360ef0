"""The select probes' one measurement (``probe_select_cap.py``, ``probe_select_ptx_store.py``): per case, under each
variant (a context manager the probe makes: patched rules, a patched module constant), the select alone converting
its picks (the layer's launch) and not, the whole layer (one call's graph) and a call's share of a
:data:`bench_indexer.STEP_LAYERS`-layer step's graph; CUDA-graph replays alternating in one process
(:func:`timing.timed_variants`), every variant's picks compared (the select's eager launch, and every layer's)."""
from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Callable, Sequence

import torch

from sparse_mla.ops.triton import indexer as kernels
from sparse_mla.picks import step_picks

from bench_indexer import STEP_LAYERS, layers_step, scored_cases, select_rows
from timing import graphed, timed_variants

SIDES = ("select converting", "select", "layer", "step")


def run_sides(names: Sequence[str], variants: dict[str, Callable[[], AbstractContextManager]]) -> list[dict]:
    """One row a case named in ``names``: ``same`` (every variant's picks equal) and per variant its µs a side
    (``in_step_us``: the step's graph over its layers)."""
    out = []
    for case, s in scored_cases(names):
        rows, picks = select_rows(s)
        conversion = step_picks(s.meta, case.kind)
        into = conversion.select_into(0, s.plan.picks.shape[0]) if conversion.takes_select else None
        step, layer_picks = layers_step(case, s, list(variants))
        fns, got, eager = {}, {}, {}
        for name, variant in variants.items():
            with variant():
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
        first = next(iter(variants))
        same = all(torch.equal(got[first], g) for g in got.values())
        same &= all(torch.equal(a, b) for v in variants for a, b in zip(eager[v], layer_picks[v]))
        same &= all(torch.equal(a, b) for v in variants for a, b in zip(layer_picks[first], layer_picks[v]))
        row = dict(case=case.name, rows=rows.shape[0], cols=rows.shape[1], converts=into is not None, same=same)
        for name in variants:
            row[name] = {f"{side.replace(' ', '_')}_us": us[side, name] for side in SIDES}
            row[name]["in_step_us"] = round(row[name].pop("step_us") / STEP_LAYERS, 2)
        out.append(row)
        print(row, flush=True)
    return out
