"""The select over rows whose threshold ties (the scores' low bits cleared), its tie search started at the entries'
bits against from bit 31 (docs/history.md version 36): one-off probe.

    python benchmarks/probe_select_ties.py [--cases ...] [--out results/]
"""
from __future__ import annotations

import torch

from sparse_mla.ops.triton import indexer as kernels

from bench_indexer import cases, coarsened_words, scored_layer, select_rows
from harness import probe_main
from timing import graphed, timed


NAMES = ("v4-flash-b32", "v4-flash-b128", "v41-flash-b128")


def run(names: list[str]) -> list[dict]:
    dev = torch.device("cuda")
    rows_out = []
    for case in (c for c in cases(False) if c.name in names):
        words, picks = select_rows(scored_layer(case, dev))  # words: these cases' rows are whole
        for cleared in (0, 12, 16, 20):
            tied = coarsened_words(words, cleared) if cleared else words
            got = {}
            for name, entries in (("from bit 31", 2 ** 32), ("from the entries' bits", tied.shape[1])):
                kernels._launch_select(tied, case.topk, picks, False, True, entries)
                got[name] = picks.clone()
                fn = graphed(lambda entries=entries: kernels._launch_select(tied, case.topk, picks, False, True,
                                                                            entries))
                got[name + " us"] = [round(timed(fn, 40), 2) for _ in range(2)]
            row = dict(case=case.name, cleared_bits=cleared, same=bool(torch.equal(got["from bit 31"],
                                                                                   got["from the entries' bits"])),
                       before_us=got["from bit 31 us"], after_us=got["from the entries' bits us"])
            rows_out.append(row)
            print(row, flush=True)
    return rows_out


if __name__ == "__main__":
    probe_main(__doc__, "probe_select_ties", NAMES, run)
