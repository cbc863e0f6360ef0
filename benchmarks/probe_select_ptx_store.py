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

import torch

from sparse_mla.ops.triton import indexer as kernels
from sparse_mla.picks import step_picks

from bench_indexer import STEP_LAYERS, layers_step, scored_cases, select_rows
from harness import probe_main
from timing import graphed, timed_variants

NAMES = ("v4-flash-b32", "v4-flash-b128", "v4-flash-b8-512k", "v41-flash-b128", "v32-b32", "prefill-4k-on-32k")
VARIANTS = {"tl.store": False, "ptx": True}
SIDES = ("select converting", "select", "layer", "step")


def run(names: list[str]) -> list[dict]:
    out = []
    for case, s in scored_cases(names):
        rows, picks = select_rows(s)
        conversion = step_picks(s.meta, case.kind)
        into = conversion.select_into(0, s.plan.picks.shape[0]) if conversion.takes_select else None
        step, layer_picks = layers_step(case, s, list(VARIANTS))
        fns, got, eager = {}, {}, {}
        for name, ptx in VARIANTS.items():
            with mock.patch.object(kernels, "PTX_STORE", ptx):
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
    probe_main(__doc__, "probe_select_ptx_store", NAMES, run, lowerings=("sm80", "sm86", "sm89"))
