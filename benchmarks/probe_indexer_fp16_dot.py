"""fp8 keys and fp8 q where the target converts no e4m3 (sm_80 / sm_86, CDNA 3): the score kernel's bf16 dot (the
keys' integer decode widened to float32, then narrowed to bf16) against the float16 dot (the decode's float16 values
as they are, four codes a few PTX instructions on CUDA): the whole layer, CUDA-graph replays alternating in one
process, the picks compared (exact operands both: the same picks; the tensor cores' float32 accumulation may
differ in a score's last bits). Run it lowered on a newer GPU (docs/history.md version
39).

    python benchmarks/probe_indexer_fp16_dot.py --lowering sm80 [--cases ...] [--out results/]
"""
from __future__ import annotations

import contextlib
from unittest import mock

import torch

from sparse_mla.ops.triton import indexer as kernels

from bench_indexer import cases, scored_layer
from harness import probe_main
from timing import graphed, timed_variants

NAMES = ("v4-flash-b32", "v4-flash-b128", "v41-flash-b128", "prefill-4k-on-32k")


def dot(dtype: torch.dtype | None):
    """Layers planned inside take ``dtype`` for their dot where the rule would take float16 (None: the rule's); a
    context."""
    rule = kernels.dot_dtype_for
    if dtype is None:
        return contextlib.nullcontext()
    return mock.patch.object(kernels, "dot_dtype_for", lambda target, keys, q: (
        dtype if rule(target, keys, q) == torch.float16 else rule(target, keys, q)))


def run(names: list[str]) -> list[dict]:
    dev = torch.device("cuda")
    rows = []
    for case in (c for c in cases(False) if c.name in names):
        picks, fns, dtypes = {}, {}, {}
        for name, dtype in (("bf16", torch.bfloat16), ("float16", None)):
            with dot(dtype):
                scored = scored_layer(case, dev)
                layer, meta, q, w, cache = scored.layer, scored.meta, scored.q, scored.w, scored.cache
                picks[name] = layer(meta, q, w, cache)[: scored.batch.num_tokens].clone()
                dtypes[name] = str(scored.plan.q.dtype)
                fns[name] = graphed(lambda layer=layer, meta=meta, q=q, w=w, cache=cache: layer(meta, q, w, cache))
        row = dict(case=case.name, q_dtypes=dtypes, same=bool(torch.equal(picks["bf16"], picks["float16"])),
                   layer_us=timed_variants(fns))
        rows.append(row)
        print(row, flush=True)
    return rows


if __name__ == "__main__":
    probe_main(__doc__, "probe_indexer_fp16_dot", NAMES, run, ("sm80", "sm86"), lowering_required=True)
