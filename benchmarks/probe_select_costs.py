"""What a select launch costs besides its threshold search. Alone: the converting select (into the step's
conversion buffers, as the layer launches it) over the layer's own scores, against the same rows with every word
outside the row's top k cleared (k candidates: no search, the same compaction, stores and conversion of k picks) or
set to the least candidate word (the search, its first pass enough),
with no candidate at all (the loads, the fill and the conversion of nothing), and over the layer's scores not
converting. In a step (:data:`bench_indexer.STEP_LAYERS` layers, each over its own keys, as
``bench_indexer.layer_parts_in_step_us`` times them): the layers' preps and scores, their whole calls, and their whole
calls with each select reading a copy of its layer's rows made beforehand, as scored, one pass and top-k only —
these read alike (not the words the scores just wrote), so their differences are the search's share of a layer in a
step, and its first pass's (with the reductions before it). Rows in segments (past ``MAX_SELECT_COLS`` columns)
take no single pass on the one-pass rows: each segment's k-th is then the least word, tied by the thousand.
CUDA-graph replays alternating in one process; the top-k rows' picks are checked against the layer's rows' (the same,
in the same order). Docs/history.md version 50.

    python benchmarks/probe_select_costs.py [--cases ...] [--out results/]
"""
from __future__ import annotations

import itertools
from typing import Callable, Sequence
from unittest import mock

import torch

from sparse_mla.ops.triton import indexer as kernels
from sparse_mla.picks import step_picks

from bench_indexer import STEP_LAYERS, Case, ScoredLayer, key_cache, layer_parts, scored_cases, select_rows
from harness import probe_main
from timing import graphed, timed_variants

NAMES = ("v4-flash-b32", "v4-flash-b128", "v4-pro-b32-top1024", "v41-flash-b32", "v41-flash-b128", "v32-b32",
         "v4-flash-b8-512k")


def top_k_only(words: torch.Tensor, k: int, rest: int = 0) -> torch.Tensor:
    """``words`` (the score kernel's int32 rows: unsigned order bits, 0 no candidate) with every candidate outside
    each row's top ``k`` (by unsigned value; ties to the lower column, as the select) set to ``rest``: 0 (no
    candidate: k candidates, no search) or 1 (the least candidate word: the search's first pass, from the sign bit,
    finds the k-th's digit with exactly k at or above it, and stops)."""
    unsigned = words.long() & 0xFFFFFFFF
    cols = torch.arange(words.shape[1], device=words.device)
    order = unsigned * words.shape[1] + (words.shape[1] - 1 - cols)  # distinct: ties to the lower column
    keep = torch.zeros_like(words, dtype=torch.bool).scatter_(1, order.topk(k, dim=1).indices, True)
    return torch.where(keep | (words == 0), words, torch.full_like(words, rest))


def selecting(rows: Sequence[torch.Tensor]):
    """A context in which the i-th select launch (the layer's ``launch_topk_rows``) reads ``rows[i % len(rows)]``
    instead of the rows it is given (the same shape)."""
    launch, calls = kernels.launch_topk_rows, itertools.count()

    def launch_on(packed: torch.Tensor, k: int, out: torch.Tensor, into=None, **options) -> None:
        launch(rows[next(calls) % len(rows)], k, out, into, **options)

    return mock.patch.object(kernels, "launch_topk_rows", launch_on)


def in_step(case: Case, s: ScoredLayer) -> dict[str, Callable[[], None]]:
    """The step's graphs (:func:`bench_indexer.layer_parts`' ``prep``, ``prep_scores`` and ``whole`` over
    :data:`STEP_LAYERS` layers' keys), the whole calls also with each select reading a copy of its layer's rows as
    scored, one pass and top-k only (:func:`selecting`); ``{}`` for a call of more than one token chunk."""
    caches = [s.cache] + [key_cache(case, s.q.device, seed) for seed in range(1, STEP_LAYERS)]
    parts = layer_parts(case, s.layer, s.meta, s.plan, s.q, s.w, caches)
    if not parts:
        return {}
    scored = []
    for cache in caches:  # each layer's rows, as its select reads them
        s.layer(s.meta, s.q, s.w, cache)
        scored.append(select_rows(s)[0])
    top_k = [top_k_only(rows, case.topk) for rows in scored]
    one_pass = [top_k_only(rows, case.topk, 1) for rows in scored]

    def step(part: Callable[[int], None]) -> Callable[[], None]:
        return graphed(lambda: [part(i) for i in range(STEP_LAYERS)])

    fns = {"step: preps": step(parts["prep"]), "step: preps and scores": step(parts["prep_scores"]),
           "step: whole": step(parts["whole"])}
    for label, rows in (("copy as scored", scored), ("copy one pass", one_pass), ("copy top k only", top_k)):
        with selecting(rows):
            fns[f"step: whole, {label}"] = replay = step(parts["whole"])
        replay.rows = rows  # the copies the graph reads live as long as its replay
    return fns


def run(names: list[str]) -> list[dict]:
    out = []
    for case, s in scored_cases(names):
        rows, picks = select_rows(s)
        if rows.dtype != torch.int32:
            continue
        into = step_picks(s.meta, case.kind).select_into(0, s.batch.token_capacity)
        variants = {"as scored": rows, "one pass": top_k_only(rows, case.topk, 1),
                    "top k only": top_k_only(rows, case.topk), "no candidate": torch.zeros_like(rows)}
        fns, got = {}, {}
        for label, words in variants.items():
            kernels.launch_topk_rows(words, case.topk, picks, into)
            got[label] = picks.clone()
            fns[label] = graphed(lambda words=words: kernels.launch_topk_rows(words, case.topk, picks, into))
        fns["as scored, not converting"] = graphed(lambda: kernels.launch_topk_rows(rows, case.topk, picks))
        steps = in_step(case, s)
        us = timed_variants(fns | steps)
        if steps:  # (a call of one token chunk)
            us.update({k: round(v / STEP_LAYERS, 2) for k, v in us.items() if k.startswith("step")})
            us["step: scores added"] = round(us["step: preps and scores"] - us["step: preps"], 2)
            us["step: top-k added"] = round(us["step: whole"] - us["step: preps and scores"], 2)
            us["step: the search"] = round(us["step: whole, copy as scored"] - us["step: whole, copy top k only"], 2)
            us["step: the search's first pass"] = round(us["step: whole, copy one pass"] -
                                                        us["step: whole, copy top k only"], 2)
        row = dict(case=case.name, rows=rows.shape[0], cols=rows.shape[1],
                   same=torch.equal(got["as scored"], got["top k only"]) and torch.equal(got["as scored"],
                                                                                          got["one pass"]),
                   empty=bool((got["no candidate"] == -1).all()), us=us)
        out.append(row)
        print(row, flush=True)
    return out


if __name__ == "__main__":
    probe_main(__doc__, "probe_select_costs", NAMES, run)
