"""Command line: ``sparse-mla demo | verify | bench``, ``sparse-mla --version``.

Subcommands register themselves in :data:`COMMANDS` (name -> (help, add_arguments, run)). A command
rejects a bad combination of options by raising :class:`UsageError`, which :func:`main` turns into
argparse's one-line ``error:`` and exit status 2, like a bad option value.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Callable

import torch
from rich.console import Console
from rich.table import Table

from . import __version__
from .config import PRESETS, get_config
from .formats import FORMAT_NAMES, get_format
from .layer import PREFILL_MODES, SparseMLAAttention
from .ops import BACKENDS, attention_kernel
from .scenario import make_scenario
from .verify import (TOLERANCE, kernel_checks, kernel_checks_in_subprocess, flashmla_checks, oracle_checks,
                     run_layer_against_oracle)

COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]] = {}
DEVICES = ("cpu", "cuda")


class UsageError(Exception):
    """A bad option or combination of options: reported as ``sparse-mla <command>: error: ...``, exit 2."""


def command(name: str, help: str, add_arguments: Callable[[argparse.ArgumentParser], None]):
    """Register a subcommand: ``run(args) -> exit code``."""
    def register(run: Callable[[argparse.Namespace], int]):
        COMMANDS[name] = (help, add_arguments, run)
        return run
    return register


def _int_at_least(least: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"must be an integer >= {least}, got {value}")
        return value
    return parse


def _status() -> Console:
    """Progress lines go to stderr, so stdout holds only the result."""
    return Console(stderr=True, highlight=False)


def _device(args: argparse.Namespace) -> torch.device:
    """``--device`` (default: cuda if this torch sees a GPU, else cpu), checked against this machine."""
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device cuda: this torch ({torch.__version__}) sees no CUDA device; use --device cpu")
    return torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _device_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", choices=DEVICES, default=None, help="default: cuda if available, else cpu")


def _demo_arguments(p: argparse.ArgumentParser) -> None:
    _device_argument(p)
    p.add_argument("--backend", choices=("auto", *BACKENDS), default="auto",
                   help="auto: Triton (Gluon on Hopper) on cuda, the reference on cpu; triton on cpu needs "
                        "TRITON_INTERPRET=1 (default: auto)")
    p.add_argument("--model", default="deepseek-v4-flash", choices=[n for n in PRESETS if "v4" in n])
    p.add_argument("--decodes", type=_int_at_least(0), default=16,
                   help="decode requests (default 16; every 4th has 1 MTP token)")
    p.add_argument("--max-context", type=_int_at_least(1), default=8192,
                   help="decode contexts drawn from [min(1024, this), this] (default 8192)")
    p.add_argument("--prefill-tokens", type=_int_at_least(0), default=256,
                   help="tokens of each of the 2 prefill chunks (default 256; 0: decodes only)")
    p.add_argument("--prefill-mode", default="paged", choices=PREFILL_MODES)
    p.add_argument("--format", default=None, choices=FORMAT_NAMES, help="cache format (default: the model's)")
    p.add_argument("--seed", type=int, default=0)


def _demo_checks(args: argparse.Namespace) -> tuple[torch.device, str]:
    """The demo's device and cache format, or :class:`UsageError` for options that cannot run together."""
    cfg = get_config(args.model)
    fmt = args.format or cfg.kv_format
    if get_format(fmt, cfg.head_dim if fmt == "bf16" else None).dim != cfg.head_dim:
        raise UsageError(f"--format {fmt} holds {get_format(fmt).dim}-d (V3.2) tokens; {cfg.name} needs "
                         f"{cfg.head_dim}-d caches: use bf16 or fp8_v4")
    if args.decodes == 0 and args.prefill_tokens == 0:
        raise UsageError("--decodes 0 with --prefill-tokens 0 leaves no token to run")
    device = _device(args)
    if args.backend == "triton" and device.type == "cpu" and not _interpreting():
        raise UsageError("--backend triton on the cpu needs TRITON_INTERPRET=1 (Triton's interpreter, slow); "
                         "use --backend reference or auto")
    return device, fmt


@command("demo", "run one V4-shaped serving step (swa, c4a, c128a layers) and check it against the dense oracle",
         _demo_arguments)
def demo(args: argparse.Namespace) -> int:
    """``--decodes`` decode requests (1K-8K context, every 4th with an MTP draft token) + 2 prefill chunks
    on top of cached prefixes; one layer of each kind; a sample of tokens checked against the float64 oracle."""
    device, fmt = _demo_checks(args)
    cfg = get_config(args.model)
    status = _status()
    gen = torch.Generator().manual_seed(args.seed)
    lo = min(1024, args.max_context)
    decodes = [(int(torch.randint(lo, args.max_context + 1, (1,), generator=gen)), 2 if i % 4 == 0 else 1)
               for i in range(args.decodes)]
    n_pre = args.prefill_tokens
    prefills = [(3000 + n_pre, n_pre), (700 + n_pre, n_pre)] if n_pre else []
    num_tokens = sum(q for _, q in decodes + prefills)
    status.print(f"set-up: {len(decodes)} decode requests + {len(prefills)} prefill chunks ({num_tokens} tokens), "
                 f"{fmt} caches on {device}: filling caches, building the step metadata ...")
    t0 = time.perf_counter()
    sc = make_scenario(decodes + prefills, window=cfg.window, topk=cfg.index_topk, fmt=fmt, dim=cfg.head_dim,
                       decode_threshold=2, padding=-num_tokens % 64, seed=args.seed, device=device)
    setup_s = time.perf_counter() - t0
    b = sc.batch
    q = (torch.randn(b.token_capacity, cfg.num_heads, cfg.head_dim, generator=gen) * 0.5).to(torch.bfloat16).to(device)
    sink = torch.randn(cfg.num_heads, generator=gen).to(device)
    kernel = attention_kernel(args.backend, q, sc.caches["swa"].data)
    status.print(f"set-up done in {setup_s:.1f} s")
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
        status.print(f"layer {kind}: running on {kernel}, checking against the oracle ...")
        layer = SparseMLAAttention(kind, cfg.num_heads, cfg.head_dim, cfg.window,
                                   topk=cfg.index_topk if kind == "c4a" else None, scale=cfg.softmax_scale,
                                   sink=sink, backend=args.backend, prefill_mode=args.prefill_mode)
        res = run_layer_against_oracle(sc, layer, q, sample, sink)
        ok_all &= res.ok
        ms = res.elapsed_s * 1e3
        table.add_row(kind, str(b.num_decode_tokens), str(b.num_prefill_tokens), str(b.token_capacity - b.num_tokens),
                      f"{ms:.2f} ms" if ms < 10 else f"{ms:.0f} ms", f"{res.max_err:.2e}", f"{res.rel_err:.2e}",
                      "[green]OK[/green]" if res.ok else "[red]FAIL[/red]")
    out = Console(highlight=False)
    out.print(f"ran: backend {args.backend} -> {kernel} on {device}")
    out.print(table)
    return 0 if ok_all else 1


def _verify_arguments(p: argparse.ArgumentParser) -> None:
    _device_argument(p)
    p.add_argument("--seed", type=int, default=0)


@command("verify", "check this machine: Triton kernels vs the reference, each layer kind and format vs the dense "
                   "oracle, FlashMLA interop (when flash_mla is installed)", _verify_arguments)
def verify(args: argparse.Namespace) -> int:
    device = _device(args)
    status = _status()
    progress = status.print
    if device.type == "cuda" or _interpreting():
        checks = kernel_checks(device, args.seed, progress)
    else:
        checks = kernel_checks_in_subprocess(args.seed, progress)
    checks += oracle_checks(device, seed=args.seed, progress=progress)
    checks += flashmla_checks(progress)
    table = Table(title=f"sparse-mla verify {__version__}: torch {torch.__version__}, {device}")
    for col in ("group", "check", "detail", "result"):
        table.add_column(col)
    for c in checks:
        result = "[yellow]skipped[/yellow]" if c.ok is None else "[green]OK[/green]" if c.ok else "[red]FAIL[/red]"
        table.add_row(c.group, c.name, c.detail, result)
    Console(highlight=False).print(table)
    return 1 if any(c.ok is False for c in checks) else 0


def _bench_arguments(p: argparse.ArgumentParser) -> None:
    """None here: ``sparse_mla.benchmark`` parses the rest of the line, imported only when bench runs."""


@command("bench", "time the attention kernels against FlashMLA on a CUDA GPU (options: sparse-mla bench --help)",
         _bench_arguments)
def bench(args: argparse.Namespace) -> int:
    rest = args.rest
    wants_help = "-h" in rest or "--help" in rest
    if not torch.cuda.is_available() and not wants_help:
        print(f"sparse-mla bench: needs a CUDA GPU (this torch {torch.__version__} sees none); run it on a GPU "
              "machine, e.g. through scripts/gpu_check.sh", file=sys.stderr)
        return 1
    try:
        from . import benchmark
    except ImportError as e:
        print(f"sparse-mla bench: sparse_mla.benchmark is not available ({e})", file=sys.stderr)
        return 1
    parser = argparse.ArgumentParser(prog="sparse-mla bench", description=COMMANDS["bench"][0])
    benchmark.add_arguments(parser)
    return benchmark.run(parser.parse_args(rest))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sparse-mla", description="DeepSeek sparse MLA attention for serving.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (help, add_arguments, run) in COMMANDS.items():
        # bench's own options belong to sparse_mla.benchmark: its --help is passed on too
        p = sub.add_parser(name, help=help, description=help, add_help=name != "bench")
        add_arguments(p)
        p.set_defaults(func=run, parser=p)
    return parser


def main(argv: list[str] | None = None) -> int:
    args, rest = build_parser().parse_known_args(argv)
    if rest and args.command != "bench":
        args.parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.rest = rest
    try:
        return args.func(args)
    except UsageError as e:
        args.parser.error(str(e))


if __name__ == "__main__":
    sys.exit(main())
