"""Rows in segments (B 8 at 512K's 131,072 entries; V3.2's 32,768 positions with their whole-row rule turned off):
the last pass over the segments' winners — packed keys, searched a bit a round by the rule (``select_digit_bits``
gives digits to words alone) — against the same pass searching their high words by 8-bit digits at the digit
search's warps (16 where the rows are at most two an SM); the select alone on the layer's own scores, the picks
compared (the same, in the same order), CUDA-graph replays alternating (docs/history.md version 48).

    python benchmarks/probe_select_final_keys.py [--cases ...] [--out results/]
"""
from __future__ import annotations

import contextlib
from unittest import mock

from sparse_mla.ops.triton import indexer as kernels

from bench_indexer import scored_cases, select_rows
from harness import probe_main
from timing import graphed, timed_variants

NAMES = ("v4-flash-b8-512k", "v32-b32")


_OWN_DIGITS = kernels.select_digit_bits


def digits_over_keys(target, words: bool) -> int:
    """``select_digit_bits`` with packed keys searched by digits as words are."""
    return _OWN_DIGITS(target, True)


NO_WHOLE = ("select_takes_whole", lambda *args: False)
VARIANTS = {"rule": (), "segments": (NO_WHOLE,),
            "segments, keys by digits": (NO_WHOLE, ("select_digit_bits", digits_over_keys))}


def patched(changes) -> contextlib.ExitStack:
    stack = contextlib.ExitStack()
    for name, value in changes:
        stack.enter_context(mock.patch.object(kernels, name, value))
    return stack


def run(names: list[str]) -> list[dict]:
    out = []
    for case, scored in scored_cases(names):
        rows, picks = select_rows(scored)
        got, fns = {}, {}
        for name, changes in VARIANTS.items():
            with patched(changes):
                kernels.launch_topk_rows(rows, case.topk, picks)
                got[name] = picks.clone()
                fns[name] = graphed(lambda: kernels.launch_topk_rows(rows, case.topk, picks))
        row = dict(case=case.name, rows=rows.shape[0], cols=rows.shape[1],
                   same=all(bool((got["rule"] == g).all()) for g in got.values()), us=timed_variants(fns))
        out.append(row)
        print(row, flush=True)
    return out


if __name__ == "__main__":
    probe_main(__doc__, "probe_select_final_keys", NAMES, run)
