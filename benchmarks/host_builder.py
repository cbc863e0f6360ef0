"""Host µs of a step batch's build (``StepBatchBuilder.build``, the engine's per-step host work before any layer)
from the requests' block tables as Python lists and as rows of an engine's int32 ``(requests, blocks)`` table (numpy
views), and of ``StepBatch.new_entries``: on the CPU or a GPU (its queue kept busy), for a few batch shapes, V4's
kinds at their default block sizes.

``--base DIR``: also time another tree's package (``…/src/sparse_mla``, e.g. a ``git archive`` of the commit a change
starts from), alternating with ours in the same rounds, and print ours / base.

    python3 benchmarks/host_builder.py [--device cpu|cuda] [--rounds N] [--base DIR]
"""
from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
from types import ModuleType

import numpy as np
import torch

from timing import host_samples

# (requests, tokens of context each): many short decodes, V4-Flash's B 128 at 32K, a few medium ones
CASES = ((256, 200), (128, 32768), (64, 500))


def load_package(folder: str, name: str) -> ModuleType:
    """The package at ``folder`` imported as ``name`` (its modules import each other relatively)."""
    spec = importlib.util.spec_from_file_location(name, f"{folder}/__init__.py", submodule_search_locations=[folder])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def step_build(batch_mod: ModuleType, lengths: list[tuple[int, int]], kinds: tuple[str, ...],
               block_sizes: dict[str, int], device: torch.device | str, token_capacity: int | None = None,
               arrays: bool = False):
    """``build`` of ``lengths``' ``(seq_len, query_len)`` requests by a builder of their own (tables of distinct
    blocks in every kind) and the builder: ``(call, builder)``. ``batch_mod``: a package's ``batch`` module;
    ``arrays``: each table a row view of one int32 numpy ``(requests, blocks)`` array a kind, else a list."""
    capacity = token_capacity or sum(q for _, q in lengths)
    builder = batch_mod.StepBatchBuilder(capacity, len(lengths), max(s for s, _ in lengths), kinds=kinds,
                                         block_sizes=block_sizes, decode_threshold=2, device=device)
    first, requests = dict.fromkeys(block_sizes, 0), []
    for seq_len, query_len in lengths:
        tables = {}
        for kind, bs in block_sizes.items():
            n = batch_mod.blocks_needed(seq_len, kind, bs)
            tables[kind], first[kind] = list(range(first[kind], first[kind] + n)), first[kind] + n
        requests.append(batch_mod.Request(seq_len, query_len, tables))
    if arrays:  # the tables as an engine keeps them: one array a kind, a request's blocks the start of its row
        for kind in block_sizes:
            grid = np.full((len(requests), max(len(r.block_tables[kind]) for r in requests)), -1, dtype=np.int32)
            for r, req in enumerate(requests):
                grid[r, : len(req.block_tables[kind])] = req.block_tables[kind]
                req.block_tables[kind] = grid[r, : len(req.block_tables[kind])]
    return (lambda: builder.build(requests)), builder


def probes(pkg: ModuleType, device: str) -> dict:
    """Name -> call of ``pkg``'s build and new_entries for every case (new_entries on a second builder's batch, built
    once: a build would make the first builder's batch stale)."""
    from importlib import import_module

    batch_mod, config = (import_module(f"{pkg.__name__}.{m}") for m in ("batch", "config"))
    sizes = {k: config.DEFAULT_BLOCK_SIZE[k] for k in config.V4_KINDS}
    out = {}
    for n, seq in CASES:
        lengths = [(seq, 1)] * n
        out[f"build, {n} requests of {seq}"] = step_build(batch_mod, lengths, config.V4_KINDS, sizes, device)[0]
        out[f"build, {n} requests of {seq}, array rows"] = step_build(batch_mod, lengths, config.V4_KINDS, sizes,
                                                                      device, arrays=True)[0]
        batch = step_build(batch_mod, lengths, config.V4_KINDS, sizes, device)[0]()
        out[f"new_entries('c4a'), {n} requests of {seq}"] = lambda batch=batch: batch.new_entries("c4a")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--base", help="another tree's package folder (…/src/sparse_mla), timed alongside")
    cli = parser.parse_args()
    import sparse_mla

    ours = probes(sparse_mla, cli.device)
    base = probes(load_package(cli.base, "sparse_mla_base"), cli.device) if cli.base else {}
    names = list(ours)
    fns = [f for name in names for f in ([ours[name]] + ([base[name]] if name in base else []))]
    samples = iter(host_samples(fns, calls=20, rounds=cli.rounds))
    for name in names:
        mine = statistics.median(next(samples))
        line = f"{name:44s} {mine:9.1f} µs"
        if name in base:
            theirs = statistics.median(next(samples))
            line += f"   base {theirs:9.1f} µs   ours / base {mine / theirs:.3f}"
        print(line)


if __name__ == "__main__":
    main()
