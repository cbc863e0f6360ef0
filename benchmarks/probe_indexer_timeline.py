"""Where a layer call's time goes: the kernels of one ``SparseMLAIndexer`` call, replayed as a CUDA graph under the
torch profiler (CUPTI's kernel records), each kernel's start and end taken relative to the replay's first kernel's
start. Launched as programmatic dependents (sm_90+), a kernel's programs may start before the one before it ends and
then wait: its *span* (start to end) holds that wait; its *exposed* time is what it adds to the call's end (its end
less the end of the kernel before it).

    python benchmarks/probe_indexer_timeline.py [--cases v4-flash-b128 ...] [--out results/]

Prints per case and kernel the median start, span and exposed µs over the replays; JSON to
``--out/probe_indexer_timeline.json``. Replays are told apart by their first kernel's name: a call that launches
that kernel more than once (a layer of several token chunks) would be cut into several; the default cases launch it
once.
"""
from __future__ import annotations

import argparse
import os
import statistics

import torch
import triton
from torch.profiler import ProfilerActivity, profile

from bench_indexer import cases, scored_layer
from harness import write_json
from timing import graphed

REPLAYS = 30


def kernel_records(fn, replays: int) -> list[list[tuple[str, float, float]]]:
    """``fn``'s graph replayed ``replays`` times under the profiler: per replay, its kernels' ``(name, start, end)``
    in µs from the replay's first start (a replay: the kernels from one occurrence of the first kernel's name to the
    next)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            fn()
        torch.cuda.synchronize()
    events = sorted((e for e in prof.events() if e.device_type.name == "CUDA" and e.time_range.end > 0),
                    key=lambda e: e.time_range.start)
    kernels = [(e.name, e.time_range.start, e.time_range.end) for e in events if "memcpy" not in e.name.lower()
               and "memset" not in e.name.lower()]
    first = kernels[0][0]
    out: list[list[tuple[str, float, float]]] = []
    for name, start, end in kernels:
        if name == first:
            out.append([])
        out[-1].append((name, start, end))
    return [[(n, s - r[0][1], e - r[0][1]) for n, s, e in r] for r in out if len(r) == len(out[0])]


def summary(replays: list[list[tuple[str, float, float]]]) -> list[dict]:
    rows = []
    for i, (name, _, _) in enumerate(replays[0]):
        starts = [r[i][1] for r in replays]
        ends = [r[i][2] for r in replays]
        exposed = [r[i][2] - (r[i - 1][2] if i else r[i][1]) for r in replays]
        rows.append(dict(kernel=name.split("(")[0][:40], start=statistics.median(starts),
                         span=statistics.median([e - s for s, e in zip(starts, ends)]),
                         exposed=statistics.median(exposed), end=statistics.median(ends)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "results"))
    parser.add_argument("--cases", nargs="+", default=["v4-flash-b32", "v4-flash-b128", "v41-flash-b128"])
    parser.add_argument("--replays", type=int, default=REPLAYS)
    args = parser.parse_args()
    dev = torch.device("cuda")
    result = dict(triton=triton.__version__, torch=torch.__version__, device=torch.cuda.get_device_name(), cases=[])
    for case in (c for c in cases(False) if c.name in args.cases):
        scored = scored_layer(case, dev)
        layer, meta, q, w, cache = scored.layer, scored.meta, scored.q, scored.w, scored.cache
        rows = summary(kernel_records(graphed(lambda: layer(meta, q, w, cache)), args.replays))
        result["cases"].append(dict(case=case.name, kernels=rows))
        print(case.name)
        for r in rows:
            print(f"  {r['kernel']:40} start {r['start']:7.1f}  span {r['span']:7.1f}  exposed {r['exposed']:7.1f}  "
                  f"end {r['end']:7.1f}", flush=True)
    write_json(args.out, "probe_indexer_timeline.json", result)


if __name__ == "__main__":
    main()
