"""The select's register cap (:func:`sparse_mla.ops.triton.indexer.select_maxnreg`): version 40's rule (16 warps where
the rows are at most two an SM, else the bit rounds' rule; no cap) against this version's (8 warps past two rows an SM)
without the cap and with it. Converting its picks in its launch, the 16-warp select took 82 registers a thread on
sm_90, one program an SM: in version 40 the layer's B 128 select ran in two waves, the probe's (not converting) in one.
Per variant the select alone on the layer's words, converting (the layer's launch) and not, and the whole layer (one
call's graph and a call's share of a four-layer step's graph); CUDA-graph replays alternating in one process. Compared:
each variant's select (an eager launch, not converting) and every layer's picks (eager, and each graph's after the
replays); the converting selects' graphs share one set of buffers, so their picks are not compared apart.

    python benchmarks/probe_select_cap.py [--cases ...] [--out results/]
"""
from __future__ import annotations

from contextlib import ExitStack
from unittest import mock

from sparse_mla.ops.triton import indexer as kernels

from harness import probe_main
from probe_select_warps import v39_rule
from select_sides import run_sides

NAMES = ("v4-flash-b128", "v4-flash-b32", "prefill-4k-on-32k", "v41-flash-b128", "v4-flash-b8-512k", "v32-b32")


def v40_rule(rows: int, lanes: int, sms: int, digits: bool = False, keys: bool = False) -> int:
    """Version 40's ``select_warps``: 16 for the digit search over rows of 8,192 keys or more, at most two an SM."""
    return 16 if digits and lanes >= 8192 and rows <= 2 * sms else v39_rule(rows, lanes, sms)


VARIANTS = {"v40": (v40_rule, False), "rule, no cap": (kernels.select_warps, False),
            "rule": (kernels.select_warps, True)}


def variant(name: str) -> ExitStack:
    rule, capped = VARIANTS[name]
    stack = ExitStack()
    stack.enter_context(mock.patch.object(kernels, "select_warps", rule))
    if not capped:
        stack.enter_context(mock.patch.object(kernels, "select_maxnreg", lambda *args, **kwargs: None))
    return stack


def run(names: list[str]) -> list[dict]:
    return run_sides(names, {name: (lambda name=name: variant(name)) for name in VARIANTS})


if __name__ == "__main__":
    probe_main(__doc__, "probe_select_cap", NAMES, run)
