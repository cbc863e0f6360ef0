"""Command line: ``sparse-mla demo`` runs one DeepSeek-V4-Flash-shaped serving step and checks it."""
from __future__ import annotations

import argparse
import sys
import time

import torch
from rich.console import Console
from rich.table import Table

from .config import get_config
from .layer import SparseMLAAttention
from .ops.validate import D_V
from .scenario import make_scenario


def demo(args: argparse.Namespace) -> int:
    """16 decodes (1-8K context, some with an MTP token) + 2 prefill chunks of 256 tokens over a prefix;
    one layer of each kind; a sample of tokens checked against the float64 dense oracle."""
    cfg = get_config("deepseek-v4-flash")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    gen = torch.Generator().manual_seed(args.seed)
    decodes = [(int(torch.randint(1024, 8193, (1,), generator=gen)), 2 if i % 4 == 0 else 1) for i in range(16)]
    prefills = [(3000 + 256, 256), (700 + 256, 256)]
    t0 = time.perf_counter()
    sc = make_scenario(decodes + prefills, window=cfg.window, topk=cfg.index_topk, fmt=cfg.kv_format,
                       decode_threshold=2, seed=args.seed, device=device)
    setup_s = time.perf_counter() - t0
    b = sc.batch
    q = (torch.randn(b.token_capacity, cfg.num_heads, cfg.head_dim, generator=gen) * 0.5).to(torch.bfloat16).to(device)
    sink = torch.randn(cfg.num_heads, generator=gen).to(device)
    sample = sorted(set(range(b.num_decode_tokens)) | set(range(b.num_decode_tokens, b.num_tokens, 23)))
    table = Table(title=f"sparse-mla demo — DeepSeek-V4-Flash step on {device} (set-up {setup_s:.1f}s)")
    for col in ("kind", "decode tokens", "prefill tokens", "time", "max |err|", "rel err", "result"):
        table.add_column(col, justify="right")
    ok_all = True
    for kind in ("swa", "c4a", "c128a"):
        layer = SparseMLAAttention(kind, cfg.num_heads, cfg.head_dim, cfg.window,
                                   topk=cfg.index_topk if kind == "c4a" else None, scale=cfg.softmax_scale,
                                   sink=sink, backend=args.backend)
        picks = sc.topk_local if kind == "c4a" else None
        out = torch.empty(b.token_capacity, cfg.num_heads, D_V, dtype=torch.bfloat16, device=device)
        layer(q, sc.meta, sc.caches, picks, out=out)  # warm-up (kernel compilation on a GPU)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        layer(q, sc.meta, sc.caches, picks, out=out)
        if device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t
        ref = sc.expected(q, kind, sample, sink, cfg.softmax_scale)
        got = out[sample].double().cpu()
        max_err = (got - ref).abs().max().item()
        rel = ((got - ref).norm() / ref.norm()).item()
        ok = rel < 1e-2 and not out.isnan().any().item()
        ok_all &= ok
        table.add_row(kind, str(b.num_decode_tokens), str(b.num_tokens - b.num_decode_tokens),
                      f"{elapsed * 1e3:.1f} ms", f"{max_err:.2e}", f"{rel:.2e}",
                      "[green]OK[/green]" if ok else "[red]FAIL[/red]")
    Console().print(table)
    return 0 if ok_all else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sparse-mla", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="run one V4-Flash-shaped serving step and check it against the dense oracle")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    p.add_argument("--backend", default="auto", help="auto, reference or triton")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=demo)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
