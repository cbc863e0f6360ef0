"""The select over rows the SMs outnumber: each row whole in one program (rows up to 16,384 columns; longer ones in
segments of 8,192), against every row in segments of 4,096 or 2,048 columns (a first launch of one program a
segment, each keeping its top k, then the row's top k of their winners), so that a step of few rows spreads over more
programs (docs/history.md version 39), and long rows (V3.2's 32,768 positions, 512K's 131,072 entries) in segments of
8,192 (the rule before version 48), 16,384 or 32,768 (fewer first-pass programs and winners; version 47; V3.2's
rows whole by the rule since version 48): the select alone on the layer's own scores, the
picks compared (the same, in the same order), CUDA-graph replays alternating. Segments at most k long are skipped.

    python benchmarks/probe_select_split_rows.py [--cases ...] [--out results/]
"""
from __future__ import annotations

import contextlib
from unittest import mock

import torch

from sparse_mla.ops.triton import indexer as kernels

from bench_indexer import cases, scored_layer, select_rows
from harness import probe_main
from timing import graphed, timed_variants

NAMES = ("v4-flash-b32", "v4-pro-b32-top1024", "v41-flash-b32", "v4-flash-b8-512k", "v32-b32", "v4-flash-b128")
SEGMENTS = (None, 4096, 2048)  # None: the rule's (rows whole up to MAX_SELECT_COLS, or select_takes_whole)
# for rows past MAX_SELECT_COLS: segments of 8,192 (the rule before version 48) and longer (32,768: a V3.2 row whole)
LONG_SEGMENTS = (8192, 16384, 32768)


def segments_of(cols: int | None):
    """Selects launched inside take every row longer than ``cols`` in segments of ``cols`` (None: as the rule does);
    a context."""
    if cols is None:
        return contextlib.nullcontext()
    return mock.patch.multiple(kernels, MAX_SELECT_COLS=max(cols, kernels.MAX_SELECT_COLS), SELECT_SEGMENT=cols,
                               select_takes_whole=lambda *args: False)


def run(names: list[str]) -> list[dict]:
    dev = torch.device("cuda")
    out = []
    for case in (c for c in cases(False) if c.name in names):
        rows, picks = select_rows(scored_layer(case, dev))
        got, fns = {}, {}
        long_rows = rows.shape[1] > kernels.MAX_SELECT_COLS
        for cols, warps in [(c, None) for c in SEGMENTS + (LONG_SEGMENTS if long_rows else ())] + \
                [(c, 32) for c in (LONG_SEGMENTS[-1:] if long_rows else ())]:
            if cols is not None and (cols <= case.topk or rows.shape[1] % cols):
                continue
            # 32 warps: a row of 32,768 at 32 a thread, whose loops spill nothing on sm_90 (at 16: 64 a thread, spills)
            fixed = mock.patch.object(kernels, "select_warps", lambda *a, **kw: warps) if warps else \
                contextlib.nullcontext()
            with segments_of(cols), fixed:
                kernels.launch_topk_rows(rows, case.topk, picks)
                got[(cols, warps)] = picks.clone()
                label = "rule" if cols is None else f"segments of {cols}" + (f", {warps} warps" if warps else "")
                fns[label] = graphed(lambda: kernels.launch_topk_rows(rows, case.topk, picks))
        row = dict(case=case.name, dtype=str(rows.dtype), rows=rows.shape[0], cols=rows.shape[1],
                   same=all(torch.equal(got[(None, None)], g) for g in got.values()),
                   us=timed_variants(fns))
        out.append(row)
        print(row, flush=True)
    return out


if __name__ == "__main__":
    probe_main(__doc__, "probe_select_split_rows", NAMES, run)
