"""Where the eager pipeline's decode step goes in transformers (one-off probe, docs/history.md version 36).

    python benchmarks/probe_hf_profile.py pipeline            # the decode median, ms/token (24 new tokens)
    python benchmarks/probe_hf_profile.py pipeline profile    # + torch.profiler tables over 9 decode steps
    python benchmarks/probe_hf_profile.py eager [profile]     # HF's eager attention, the same model

bench_hf.py's model (3 layers, V4's attention, 64 indexer heads) with an 8,192-token prompt, batch 1, greedy; the
pipeline with fp8 index keys, no CUDA graphs. ``PROBE_GC=freeze`` / ``off``: ``gc.freeze()`` / ``gc.disable()``
after the warm-up (is Python's collector the cost?). Needs a CUDA GPU and transformers >= 5.23.
"""
from __future__ import annotations

import gc
import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from bench_hf import Sizes, make_model
from sparse_mla.integrations.transformers import enable_sparse_mla


class Stamps:
    """``generate``'s streamer: a synchronised stamp per token; starts ``prof`` at the fourth put (three steps in)."""

    def __init__(self, prof: profile | None) -> None:
        self.stamps: list[float] = []
        self.prof = prof

    def put(self, value: torch.Tensor) -> None:
        torch.cuda.synchronize()
        self.stamps.append(time.perf_counter())
        if len(self.stamps) == 4 and self.prof is not None:
            self.prof.start()

    def end(self) -> None:
        if self.prof is not None:
            self.prof.stop()


def main() -> None:
    impl, profiled = sys.argv[1], len(sys.argv) > 2
    dev = torch.device("cuda")
    sizes = Sizes.of(False, 64)
    model, _ = make_model(sizes, 3, 16384, dev, torch.bfloat16, 0)
    if impl == "pipeline":
        enable_sparse_mla(model, kv_format="fp8_v4", pipeline=True, index_format="fp8")
    ids = torch.randint(1, sizes.vocab, (1, 8192), generator=torch.Generator().manual_seed(0)).to(dev)
    mask = torch.ones_like(ids)

    def generate(tokens: int, streamer: Stamps) -> None:
        model.generate(ids, attention_mask=mask, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                       streamer=streamer)

    with torch.inference_mode():
        generate(4, Stamps(None))  # compiles what the lengths specialise
        if os.environ.get("PROBE_GC") == "freeze":
            gc.collect()
            gc.freeze()
        elif os.environ.get("PROBE_GC") == "off":
            gc.disable()
        timed = Stamps(None)
        generate(24, timed)
        gaps = sorted((b - a) * 1e3 for a, b in zip(timed.stamps[2:], timed.stamps[3:]))
        print(f"{impl} (PROBE_GC={os.environ.get('PROBE_GC')}): decode ms median {gaps[len(gaps) // 2]:.2f}",
              flush=True)
        if not profiled:
            return
        prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
        generate(12, Stamps(prof))
    averages = prof.key_averages()
    print(averages.table(sort_by="cpu_time_total", row_limit=40, max_name_column_width=60))
    print(averages.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))


if __name__ == "__main__":
    main()
