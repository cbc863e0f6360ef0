"""Command line: ``sparse-mla demo`` runs one DeepSeek-V4-Flash-shaped serving step and checks it.

Subcommands register themselves in :data:`COMMANDS` (name -> (help, add_arguments, run)), so
``bench`` / ``verify`` can be added without touching :func:`main`.
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import Callable

import torch
from rich.console import Console
from rich.table import Table

from .config import PRESETS, get_config
from .layer import PREFILL_MODES, SparseMLAAttention
from .ops.validate import D_V
from .scenario import make_scenario

COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]] = {}
TOLERANCE = 1e-2  # relative Frobenius error against the float64 oracle (bf16 output, DESIGN §7.1)


def command(name: str, help: str, add_arguments: Callable[[argparse.ArgumentParser], None]):
    """Register a subcommand: ``run(args) -> exit code``."""
    def register(run: Callable[[argparse.Namespace], int]):
        COMMANDS[name] = (help, add_arguments, run)
        return run
    return register


def _demo_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available, else cpu)")
    p.add_argument("--backend", default="auto", help="auto, reference or triton (default: auto)")
    p.add_argument("--model", default="deepseek-v4-flash", choices=[n for n in PRESETS if "v4" in n])
    p.add_argument("--decodes", type=int, default=16, help="decode requests (default 16; every 4th has 1 MTP token)")
    p.add_argument("--max-context", type=int, default=8192, help="decode contexts drawn from [1024, this]")
    p.add_argument("--prefill-tokens", type=int, default=256, help="tokens of each of the 2 prefill chunks")
    p.add_argument("--prefill-mode", default="paged", choices=PREFILL_MODES)
    p.add_argument("--format", default=None, help="cache format (default: the model's, fp8_v4)")
    p.add_argument("--seed", type=int, default=0)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


@command("demo", "run one V4-shaped serving step (swa, c4a, c128a layers) and check it against the dense oracle",
         _demo_arguments)
def demo(args: argparse.Namespace) -> int:
    """``--decodes`` decode requests (1K-8K context, every 4th with an MTP draft token) + 2 prefill chunks
    on top of cached prefixes; one layer of each kind; a sample of tokens checked against the float64 oracle."""
    cfg = get_config(args.model)
    fmt = args.format or cfg.kv_format
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    gen = torch.Generator().manual_seed(args.seed)
    lo = min(1024, args.max_context)
    decodes = [(int(torch.randint(lo, args.max_context + 1, (1,), generator=gen)), 2 if i % 4 == 0 else 1)
               for i in range(args.decodes)]
    n_pre = args.prefill_tokens
    prefills = [(3000 + n_pre, n_pre), (700 + n_pre, n_pre)] if n_pre else []
    num_tokens = sum(q for _, q in decodes + prefills)
    t0 = time.perf_counter()
    sc = make_scenario(decodes + prefills, window=cfg.window, topk=cfg.index_topk, fmt=fmt, dim=cfg.head_dim,
                       decode_threshold=2, padding=-num_tokens % 64, seed=args.seed, device=device)
    setup_s = time.perf_counter() - t0
    b = sc.batch
    q = (torch.randn(b.token_capacity, cfg.num_heads, cfg.head_dim, generator=gen) * 0.5).to(torch.bfloat16).to(device)
    sink = torch.randn(cfg.num_heads, generator=gen).to(device)
    # the oracle is float64 and dense per request: check every decode token and ~24 prefill tokens
    stride = max(1, b.num_prefill_tokens // 24)
    sample = sorted(set(range(b.num_decode_tokens)) | set(range(b.num_decode_tokens, b.num_tokens, stride))
                    | ({b.num_tokens - 1} if b.num_prefill_tokens else set()))
    table = Table(title=f"sparse-mla demo: one {cfg.name} step, {fmt} caches, {device}",
                  caption=f"{len(sample)} tokens checked against the float64 dense oracle; a layer passes\n"
                          f"with rel err < {TOLERANCE:g}, no NaN and zero padding rows. Set-up {setup_s:.1f} s.")
    for col in ("kind", "decode", "prefill", "pad", "time", "max err", "rel err", "result"):
        table.add_column(col, justify="right")
    ok_all = True
    for kind in ("swa", "c4a", "c128a"):
        layer = SparseMLAAttention(kind, cfg.num_heads, cfg.head_dim, cfg.window,
                                   topk=cfg.index_topk if kind == "c4a" else None, scale=cfg.softmax_scale,
                                   sink=sink, backend=args.backend, prefill_mode=args.prefill_mode)
        picks = sc.topk_local if kind == "c4a" else None
        out = torch.full((b.token_capacity, cfg.num_heads, D_V), float("nan"), dtype=torch.bfloat16, device=device)
        layer(q, None, sc.caches, out=out)  # warm-up without metadata: zeros
        if device.type == "cuda":  # compile the kernels outside the timed call
            layer(q, sc.meta, sc.caches, picks, out=out)
        _sync(device)
        t = time.perf_counter()
        layer(q, sc.meta, sc.caches, picks, out=out)
        _sync(device)
        elapsed = time.perf_counter() - t
        ref = sc.expected(q, kind, sample, sink, cfg.softmax_scale)
        got = out[sample].double().cpu()
        max_err = (got - ref).abs().max().item()
        rel = ((got - ref).norm() / ref.norm()).item()
        ok = rel < TOLERANCE and not bool(out.isnan().any()) and bool((out[b.num_tokens:] == 0).all())
        ok_all &= ok
        table.add_row(kind, str(b.num_decode_tokens), str(b.num_prefill_tokens), str(b.token_capacity - b.num_tokens),
                      f"{elapsed * 1e3:.2f} ms" if elapsed < 0.01 else f"{elapsed * 1e3:.0f} ms", f"{max_err:.2e}", f"{rel:.2e}",
                      "[green]OK[/green]" if ok else "[red]FAIL[/red]")
    Console().print(table)
    return 0 if ok_all else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sparse-mla", description="DeepSeek sparse MLA attention for serving.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (help, add_arguments, run) in COMMANDS.items():
        p = sub.add_parser(name, help=help, description=help)
        add_arguments(p)
        p.set_defaults(func=run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
