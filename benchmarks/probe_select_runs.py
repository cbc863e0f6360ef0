"""The select over rows of words with each thread's lanes a run of consecutive columns (``select_runs``: the
compaction's slots counted inside each thread, one scan across threads) against lanes in column order (an
entry-order ``tl.cumsum`` of the tile), on the layer's own scores: picks compared (the same, in the same order),
CUDA-graph replays alternating (docs/history.md version 38).

    python benchmarks/probe_select_runs.py [--cases ...] [--out results/]
"""
from __future__ import annotations

import contextlib
from unittest import mock

import torch

from sparse_mla.ops.triton import indexer as kernels

from bench_indexer import cases, scored_layer, select_rows
from harness import probe_main
from timing import graphed, timed_variants


NAMES = ("v4-flash-b32", "v4-flash-b128", "v4-pro-b32-top1024", "v41-flash-b128", "prefill-4k-on-32k")


def launch(rows: torch.Tensor, k: int, picks: torch.Tensor, runs: bool) -> None:
    """The select's launch, with its lanes as runs of columns where the rule takes them (``runs``) or never."""
    with contextlib.nullcontext() if runs else mock.patch.object(kernels, "select_runs", lambda *args: 0):
        kernels.launch_topk_rows(rows, k, picks)


def run(names: list[str]) -> list[dict]:
    dev = torch.device("cuda")
    rows_out = []
    for case in (c for c in cases(False) if c.name in names):
        rows, picks = select_rows(scored_layer(case, dev))
        got, fns = {}, {}
        for runs in (False, True):
            launch(rows, case.topk, picks, runs)
            got[runs] = picks.clone()
            fns["runs" if runs else "columns"] = graphed(lambda runs=runs: launch(rows, case.topk, picks, runs))
        row = dict(case=case.name, dtype=str(rows.dtype), cols=rows.shape[1],
                   same=bool(torch.equal(got[False], got[True])),
                   us=timed_variants(fns))
        rows_out.append(row)
        print(row, flush=True)
    return rows_out


if __name__ == "__main__":
    probe_main(__doc__, "probe_select_runs", NAMES, run)
