"""Rows longer than the select takes whole (the 512K context's 131,072 entries, V3.2's 32,768 positions) scored as
packed keys (the rule before) or as words, whose first select pass over their segments packs the winners' keys from
the words (half the bytes written and read, 16-byte loads, the lanes as runs): the whole layer, CUDA-graph replays
alternating in one process, the picks compared (docs/history.md version 39).

    python benchmarks/probe_indexer_segment_words.py [--cases ...] [--out results/]
"""
from __future__ import annotations

import contextlib
from unittest import mock

import torch

from sparse_mla.indexer import MAX_SELECT_COLS
from sparse_mla.indexer_layer import SparseMLAIndexer

from bench_indexer import cases, scored_layer
from harness import probe_main
from timing import graphed, timed_variants

NAMES = ("v4-flash-b8-512k", "v32-b32")


def packed_long_rows(on: bool):
    """Layers called inside score rows longer than ``MAX_SELECT_COLS`` as packed keys (``on``), as before; a
    context."""
    rule = SparseMLAIndexer.scores_as_words
    if not on:
        return contextlib.nullcontext()
    return mock.patch.object(SparseMLAIndexer, "scores_as_words", lambda self, plan, two_level=False: (
        rule(self, plan, two_level) and plan.num_cols <= MAX_SELECT_COLS))


def run(names: list[str]) -> list[dict]:
    dev = torch.device("cuda")
    rows = []
    for case in (c for c in cases(False) if c.name in names):
        picks, fns = {}, {}
        for name in ("packed", "words"):
            with packed_long_rows(name == "packed"):
                scored = scored_layer(case, dev)
                layer, meta, q, w, cache = scored.layer, scored.meta, scored.q, scored.w, scored.cache
                picks[name] = layer(meta, q, w, cache)[: scored.batch.num_tokens].sort(1).values
                fns[name] = graphed(lambda layer=layer, meta=meta, q=q, w=w, cache=cache: layer(meta, q, w, cache))
        row = dict(case=case.name, same=bool(torch.equal(picks["packed"], picks["words"])),
                   layer_us=timed_variants(fns))
        rows.append(row)
        print(row, flush=True)
    return rows


if __name__ == "__main__":
    probe_main(__doc__, "probe_indexer_segment_words", NAMES, run)
