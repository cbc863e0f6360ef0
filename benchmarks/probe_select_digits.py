"""The select's threshold search a digit of several bits a pass (one ``tl.histogram`` of the words in play) against a
bit a round, on the layer's own scores (and the same with their low 16 bits cleared: ties at every threshold): picks
compared, CUDA-graph replays alternating (docs/history.md version 37; Triton 3.8 and later lower the histogram to
shared-memory atomics on NVIDIA, 3.6 and 3.7 to a vote a digit bit).

    python benchmarks/probe_select_digits.py [--out results/]
"""
from __future__ import annotations

import argparse
import os

import torch
import triton

from sparse_mla.ops.triton import indexer as kernels

from bench_indexer import cases, coarsened_words, scored_layer, select_rows
from harness import write_json
from timing import graphed, timed_variants

VARIANTS = {"bits": 0, "digit4": 4, "digit6": 6, "digit8": 8, "digit11": 11}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "results"))
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    args = parser.parse_args()
    dev = torch.device("cuda")
    rows_out = []
    names = ("v4-flash-b32", "v4-flash-b128", "v4-flash-b8-512k", "v4-pro-b32-top1024", "v41-flash-b128", "v32-b32")
    for case in (c for c in cases(False) if c.name in names):
        scores, picks = select_rows(scored_layer(case, dev))
        for cleared in ((0, 16) if scores.dtype == torch.int32 else (0,)):
            rows = coarsened_words(scores, cleared) if cleared else scores
            got, fns = {}, {}
            for name in args.variants:
                bits = VARIANTS[name]
                kernels.launch_topk_rows(rows, case.topk, picks, digit_bits=bits)
                got[name] = picks.clone()
                fns[name] = graphed(lambda bits=bits: kernels.launch_topk_rows(rows, case.topk, picks, digit_bits=bits))
            first = args.variants[0]
            row = dict(case=case.name, dtype=str(rows.dtype), cleared_bits=cleared,
                       same={n: bool(torch.equal(got[first], got[n])) for n in args.variants},
                       us=timed_variants(fns))
            rows_out.append(row)
            print(row, flush=True)
    write_json(args.out, "probe_select_digits.json", dict(triton=triton.__version__, rows=rows_out))


if __name__ == "__main__":
    main()
