"""Issue 19's H100 benchmark: the per-tensor ``fp8_e4m3`` cache (512 B/token, FlashInfer TRTLLM-gen's) against
``fp8_v4`` (584 B/token, FlashMLA's) on the decode cases of ``bench_decode.py``, and the ragged C128A lists
(``indptr`` + flat slots, ROCm AITER's) against the padded ``(T, 1024)`` ones: index memory and time.

Everything through the public op ``sparse_attention_decode`` on the same latents and indices, checked against
the reference before timing, timed as CUDA-graph replays (L2 flushed), the variants alternating.

    python3 benchmarks/bench_forms.py --out $OUT      # ~1 min on an H100
    python3 benchmarks/bench_forms.py --smoke         # tiny, on the CPU (reference backend), no timing
"""
from __future__ import annotations

import argparse
import json
import os

import torch
from rich.console import Console
from rich.table import Table

from sparse_mla.formats import quantize_blocks
from sparse_mla.index_forms import ragged_from_padded
from sparse_mla.ops import sparse_attention_decode

from timing import graphed, rel, timed_rounds, warm_up_gpu

SWA_KEYS, SWA_BLOCK = 128, 64
# bench_decode's cases: (name, heads, compressed keys per token, compressed block size, ragged lengths)
CASES = [("c4a", 64, 512, 64, False), ("c4a", 128, 1024, 64, False), ("c128a", 64, 1024, 2, True),
         ("c128a", 128, 1024, 2, True)]


def scope(gen: torch.Generator, tokens: int, keys: int, block_size: int, num_blocks: int, device: str):
    """Random bf16 latents in a paged layout (both formats quantise these) and ``(tokens, keys)`` distinct slots."""
    kv = (torch.randn(num_blocks, block_size, 512, generator=gen) / 4).to(torch.bfloat16).to(device)
    slots = torch.rand(tokens, num_blocks * block_size, generator=gen).topk(keys, -1).indices.int().to(device)
    return kv, slots


def case_inputs(name, heads, keys, block_size, ragged, batch, device, gen):
    tokens = 2 * batch  # s_q 2 (MTP)
    kv0, i0 = scope(gen, tokens, SWA_KEYS, SWA_BLOCK, tokens * 3, device)
    kv1, i1 = scope(gen, tokens, keys, block_size, max(keys * 2 // block_size, tokens * 4), device)
    lens1 = torch.full((tokens,), keys, dtype=torch.int32, device=device)
    if ragged:  # per-request C128A lengths, both tokens of a request alike
        lens1 = torch.randint(0, keys + 1, (batch,), generator=gen, dtype=torch.int32).repeat_interleave(2).to(device)
    q = torch.randn(tokens, heads, 512, generator=gen).to(torch.bfloat16).to(device)
    sink = torch.randn(heads, generator=gen).to(device)
    return q, sink, (kv0, i0), (kv1, i1, lens1)


def run_case(args, name, heads, keys, block_size, ragged, batch, gen):
    device = "cpu" if args.smoke else "cuda"
    q, sink, (kv0, i0), (kv1, i1, lens1) = case_inputs(name, heads, keys, block_size, ragged, batch, device, gen)
    amax = max(kv0.abs().max().item(), kv1.abs().max().item())
    kv_scale = torch.tensor([amax / 448.0], device=device)
    caches = {fmt: (quantize_blocks(kv0, fmt, **kw), quantize_blocks(kv1, fmt, **kw))
              for fmt, kw in (("fp8_v4", {}), ("fp8_e4m3", {"kv_scale": kv_scale}))}
    call = {fmt: (lambda fmt=fmt, kw=kw: sparse_attention_decode(q, caches[fmt][0], i0, None,
                                                                 extra_cache=caches[fmt][1], extra_indices=i1,
                                                                 extra_lens=lens1, sink=sink, backend=args.backend,
                                                                 **kw))
            for fmt, kw in (("fp8_v4", {}), ("fp8_e4m3", {"kv_scale": kv_scale}))}
    row = dict(case=name, heads=heads, batch=batch, tokens=q.shape[0], compressed_keys=keys,
               bytes_per_token={"fp8_v4": 584, "fp8_e4m3": 512})
    ref = {fmt: sparse_attention_decode(q, caches[fmt][0], i0, None, extra_cache=caches[fmt][1], extra_indices=i1,
                                        extra_lens=lens1, sink=sink, backend="reference",
                                        **({"kv_scale": kv_scale} if fmt == "fp8_e4m3" else {}))[0]
           for fmt in call}
    row["rel_err_vs_reference"] = {fmt: rel(fn()[0], ref[fmt]) for fmt, fn in call.items()}
    row["rel_err_e4m3_vs_v4"] = rel(ref["fp8_e4m3"], ref["fp8_v4"])  # the two quantisations' difference
    if ragged:  # the compressed scope as ragged lists over the fp8_v4 caches
        indptr = torch.empty(q.shape[0] + 1, dtype=torch.int32, device=device)
        flat = torch.empty(i1.numel(), dtype=torch.int32, device=device)
        ragged_from_padded(i1, lens1, indptr, flat)
        used = int(indptr[-1])
        call["ragged"] = lambda: sparse_attention_decode(q, caches["fp8_v4"][0], i0, None,
                                                         extra_cache=caches["fp8_v4"][1], extra_indices=flat,
                                                         extra_lens=None, sink=sink, backend=args.backend,
                                                         extra_indptr=indptr)
        row["rel_err_vs_reference"]["ragged"] = rel(call["ragged"]()[0], ref["fp8_v4"])
        row["index_bytes"] = {"padded": (i1.numel() + lens1.numel()) * 4, "ragged_used": (used + indptr.numel()) * 4,
                              "ragged_capacity": (flat.numel() + indptr.numel()) * 4}
    if not args.smoke:
        names = list(call)
        times = timed_rounds([graphed(call[n]) for n in names], args.rep, args.rounds)
        row["us"] = dict(zip(names, times))
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "results"))
    ap.add_argument("--batches", type=int, nargs="+", default=[64, 148])
    ap.add_argument("--rep", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU, reference backend, no timing")
    args = ap.parse_args()
    args.backend = "reference" if args.smoke else "auto"
    if not args.smoke and not torch.cuda.is_available():
        print("bench_forms needs a CUDA GPU (or --smoke)")
        return 2
    console = Console(width=150)
    gen = torch.Generator().manual_seed(0)
    if not args.smoke:
        warm_up_gpu()
    rows = []
    cases = [(n, 4, 32, b, r) for n, _, _, b, r in CASES[::2]] if args.smoke else CASES
    for name, heads, keys, block_size, ragged in cases:
        for batch in ([2] if args.smoke else args.batches):
            console.log(f"{name}: {heads} heads, {keys} compressed keys, batch {batch}")
            rows.append(run_case(args, name, heads, keys, block_size, ragged, batch, gen))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_forms.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", rows=rows), f,
                  indent=1)
    table = Table(title="fp8_e4m3 vs fp8_v4 decode; ragged vs padded C128A (graph replays, us)")
    for col in ("case", "h_q", "b", "fp8_v4", "fp8_e4m3", "e4m3/v4", "ragged", "ragged/padded",
                "index KB padded/ragged", "err vs ref"):
        table.add_column(col, justify="right")
    for r in rows:
        us = r.get("us", {})
        ib = r.get("index_bytes")
        table.add_row(r["case"], str(r["heads"]), str(r["batch"]), f"{us.get('fp8_v4', 0):.1f}",
                      f"{us.get('fp8_e4m3', 0):.1f}", f"{us.get('fp8_e4m3', 0) / max(us.get('fp8_v4', 1), 1e-9):.2f}",
                      f"{us['ragged']:.1f}" if "ragged" in us else "-",
                      f"{us['ragged'] / us['fp8_v4']:.2f}" if "ragged" in us else "-",
                      f"{ib['padded'] / 1024:.0f} / {ib['ragged_used'] / 1024:.0f}" if ib else "-",
                      " ".join(f"{v:.1e}" for v in r["rel_err_vs_reference"].values()))
    console.print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
