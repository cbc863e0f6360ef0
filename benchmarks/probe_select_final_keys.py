"""Rows in segments (B 8 at 512K's 131,072 entries; V3.2's 32,768 positions with their whole-row rule turned off):
the last pass over the segments' winners (packed keys) searching their high words by 8-bit digits at the digit
search's warps (16 where the rows are at most two an SM: the rule since version 48) against a bit a round (the rule
before: ``select_digit_bits`` gave digits to words alone); the select alone on the layer's own scores, the picks
compared (the same, in the same order), CUDA-graph replays alternating (docs/history.md version 48).

    python benchmarks/probe_select_final_keys.py [--cases ...] [--out results/]
"""
from __future__ import annotations

import contextlib
from unittest import mock

from sparse_mla.ops.triton import indexer as kernels

from bench_indexer import scored_cases, select_rows, select_variants
from harness import probe_main
from timing import timed_variants

NAMES = ("v4-flash-b8-512k", "v32-b32")
_OWN_DIGITS = kernels.select_digit_bits


def winners_by_bits(target, words: bool, winners: bool = False) -> int:
    """``select_digit_bits`` before version 48: digits for words alone, the winners' keys a bit a round."""
    return _OWN_DIGITS(target, words)


NO_WHOLE, BITS = ("select_takes_whole", lambda *args: False), ("select_digit_bits", winners_by_bits)
VARIANTS = {"rule": (), "winners by bits": (BITS,), "segments": (NO_WHOLE,),
            "segments, winners by bits": (NO_WHOLE, BITS)}


def patched(changes) -> contextlib.ExitStack:
    stack = contextlib.ExitStack()
    for name, value in changes:
        stack.enter_context(mock.patch.object(kernels, name, value))
    return stack


def run(names: list[str]) -> list[dict]:
    out = []
    for case, scored in scored_cases(names):
        rows, picks = select_rows(scored)
        contexts = {name: lambda changes=changes: patched(changes) for name, changes in VARIANTS.items()}
        got, fns = select_variants(rows, case.topk, picks, contexts)
        row = dict(case=case.name, rows=rows.shape[0], cols=rows.shape[1],
                   same=all(bool((got["rule"] == g).all()) for g in got.values()), us=timed_variants(fns))
        out.append(row)
        print(row, flush=True)
    return out


if __name__ == "__main__":
    probe_main(__doc__, "probe_select_final_keys", NAMES, run)
