"""Command line: ``sparse-mla demo | verify | bench``, ``sparse-mla --version``.

Subcommands register themselves in :data:`COMMANDS` (name -> (help, add_arguments, run)). A command
rejects a bad combination of options, or sizes this machine's memory cannot hold, by raising
:class:`UsageError`, which :func:`main` turns into argparse's one-line ``error:`` and exit status 2, like a
bad option value. ``bench`` runs ``benchmarks/bench_step.py`` of the source checkout this package is
installed from (the benchmark harness is not part of the package).
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Callable

import torch
from rich.console import Console
from rich.table import Table

from . import __version__
from .batch import blocks_needed
from .config import DEFAULT_BLOCK_SIZE, PRESETS, V4_KINDS, ModelConfig, get_config
from .formats import FORMAT_NAMES, block_bytes, get_format
from .layer import PREFILL_MODES, SparseMLAAttention
from .ops import BACKENDS, attention_kernel
from .ops.validate import D_V
from .scenario import make_scenario
from .verify import (TOLERANCE, kernel_checks, kernel_checks_in_subprocess, flashmla_checks, oracle_checks,
                     run_layer_against_oracle, stack_line, support_line)

COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]] = {}
DEVICES = ("cpu", "cuda")
# where `sparse-mla bench` finds the step benchmark: the checkout's benchmarks/ (src/sparse_mla/cli.py -> the root)
STEP_BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_step.py"
GB = 1e9
# one layer call's working set: the reference backend gathers keys in chunks of 2^25 floats (ops/reference.py) and
# holds a few copies of a chunk (0.6 GB measured on the demo's default step); the GPU kernels need less
LAYER_CALL_BYTES = 750_000_000
PREFILL_SAMPLE = 24  # prefill tokens the demo checks against the oracle (+ the last one), every decode token too


class UsageError(Exception):
    """A bad option or combination of options: reported as ``sparse-mla <command>: error: ...``, exit 2."""


def command(name: str, help: str, add_arguments: Callable[[argparse.ArgumentParser], None]):
    """Register a subcommand: ``run(args) -> exit code``."""
    def register(run: Callable[[argparse.Namespace], int]):
        COMMANDS[name] = (help, add_arguments, run)
        return run
    return register


def _int_in(least: int, most: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if not least <= value <= most:
            raise argparse.ArgumentTypeError(f"must be an integer in [{least}, {most}], got {value}")
        return value
    return parse


# the demo's sizes: one step's requests, and positions that int32 holds (the memory check then says what fits)
MAX_DEMO_DECODES, MAX_DEMO_TOKENS = 2**16, 2**30


SEED_LIMIT = 2**32  # seeds are in [0, 2^32): torch's generators take 64 bits, and the benchmarks add offsets


def parse_seed(text: str) -> int:
    """An argparse ``type`` for ``--seed``: an integer in ``[0, 2^32)``, else a usage error naming the value."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer in [0, 2**32), got {text!r}") from None
    if not 0 <= value < SEED_LIMIT:
        raise argparse.ArgumentTypeError(f"must be an integer in [0, 2**32), got {value}")
    return value


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
    p.add_argument("--decodes", type=_int_in(0, MAX_DEMO_DECODES), default=16,
                   help="decode requests (default 16; every 4th has 1 MTP token)")
    p.add_argument("--max-context", type=_int_in(2, MAX_DEMO_TOKENS), default=8192,
                   help="decode contexts drawn from [min(1024, this), this] (default 8192; at least 2: the first "
                        "request holds an MTP draft token)")
    p.add_argument("--prefill-tokens", type=_int_in(0, MAX_DEMO_TOKENS), default=256,
                   help="tokens of each of the 2 prefill chunks (default 256; 0: decodes only)")
    p.add_argument("--prefill-mode", default="paged", choices=PREFILL_MODES)
    p.add_argument("--format", default=None, choices=FORMAT_NAMES, help="cache format (default: the model's)")
    p.add_argument("--seed", type=parse_seed, default=0)


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


def _demo_requests(args: argparse.Namespace, gen: torch.Generator) -> list[tuple[int, int]]:
    """The demo step's ``(seq_len, query_len)`` requests: ``--decodes`` decodes (contexts drawn from
    ``[min(1024, --max-context), --max-context]``, every 4th with an MTP draft token), then 2 prefill chunks of
    ``--prefill-tokens`` on 3000- and 700-token prefixes (none for 0)."""
    lo = min(1024, args.max_context)
    decodes = [(int(torch.randint(lo, args.max_context + 1, (1,), generator=gen)), 2 if i % 4 == 0 else 1)
               for i in range(args.decodes)]
    n_pre = args.prefill_tokens
    return decodes + ([(3000 + n_pre, n_pre), (700 + n_pre, n_pre)] if n_pre else [])


def demo_bytes(lengths: list[tuple[int, int]], cfg: ModelConfig, fmt: str, padding: int,
               sample_per_request: int) -> dict[str, int]:
    """The peak memory of the demo's step, bytes, by where it lives: ``"device"`` (the paged caches of every V4
    kind, the queries and outputs, a layer call's working set) and ``"host"`` (always the CPU: the scenario's
    indexer picks, then the oracle's float32 keys and its float64 attention of one request). On a CPU device
    the two share one memory: ``"cpu"`` is that peak (the picks, the layer calls and the oracle's attention
    come one after another). ``lengths``: ``(seq_len, query_len)`` per request; ``sample_per_request``: most
    tokens of one request checked against the oracle. Mirrors :func:`~sparse_mla.scenario.make_scenario` and
    :class:`~sparse_mla.oracle.DenseOracle`. Against the peak resident memory of CPU runs (reference backend;
    estimated / measured): 0.96 / 0.90 GB at the defaults, 7.1 / 7.9 with 1000 decodes, 1.3 / 1.1 with 4 decodes
    of up to 200K tokens, 3.0 / 3.0 up to 400K, 1.9 / 2.3 with 4000-token prefills."""
    dim, heads, window = cfg.head_dim, cfg.num_heads, cfg.window
    tokens = sum(q for _, q in lengths) + padding
    max_len = max(s for s, _ in lengths)
    caches = sum((sum(blocks_needed(s, kind) for s, _ in lengths) + 2)
                 * block_bytes(fmt, DEFAULT_BLOCK_SIZE[kind], dim if fmt == "bf16" else None) for kind in V4_KINDS)
    queries = tokens * heads * (dim + D_V) * 2  # bf16 queries and outputs
    # random_picks scores every c4a entry of the longest request for every token: float32 scores, twice, + a mask
    picks = 9 * tokens * (max_len // 4 + 3)
    # the oracle's float32 copy of every key some token may see: the window, every c4a and c128a entry
    oracle = 4 * dim * sum(min(s, window - 1 + q) + s // 4 + s // 128 for s, q in lengths)
    # one request's dense float64 attention: its keys (float32 concatenated, float64, masked) and the
    # (tokens, heads, keys) float64 scores, weights and masked scores
    attend = max((window + q + s // 4) * (20 * dim + 24 * min(q, sample_per_request) * heads) for s, q in lengths)
    return {"device": caches + queries + LAYER_CALL_BYTES, "host": max(picks, oracle + attend),
            "cpu": caches + queries + max(picks, oracle + max(LAYER_CALL_BYTES, attend))}


def available_bytes(device: torch.device) -> int:
    """Memory free for new tensors on ``device``, bytes: the GPU's free memory, or for the CPU the kernel's
    ``MemAvailable``, capped by this process's cgroup (v2) limit when it sets one."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        with open("/proc/meminfo") as f:
            free = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            used = int(f.read())
        if limit != "max":
            free = min(free, int(limit) - used)
    except (OSError, StopIteration, ValueError):
        pass  # no /proc/meminfo or no cgroup v2 files: what sysconf or MemAvailable said
    return free


def _check_demo_memory(args: argparse.Namespace, lengths: list[tuple[int, int]], cfg: ModelConfig, fmt: str,
                       padding: int, device: torch.device) -> None:
    """:class:`UsageError` naming the sizes to lower when the demo's step would not fit this machine's memory
    (it would otherwise be killed without a word, or fail deep inside an allocation)."""
    need = demo_bytes(lengths, cfg, fmt, padding, sample_per_request=PREFILL_SAMPLE + 1)
    where = {"cpu": need["cpu"]} if device.type == "cpu" else {"cpu": need["host"], "cuda": need["device"]}
    for place, needed in where.items():
        free = available_bytes(torch.device(place))
        if needed > free:
            raise UsageError(f"--decodes {args.decodes} --max-context {args.max_context} --prefill-tokens "
                             f"{args.prefill_tokens} need about {needed / GB:.1f} GB of {place} memory, "
                             f"{free / GB:.1f} GB is available: lower them")


@command("demo", "run one V4-shaped serving step (swa, c4a, c128a layers) and check it against the dense oracle",
         _demo_arguments)
def demo(args: argparse.Namespace) -> int:
    """``--decodes`` decode requests (1K-8K context, every 4th with an MTP draft token) + 2 prefill chunks
    on top of cached prefixes; one layer of each kind; a sample of tokens checked against the float64 oracle."""
    device, fmt = _demo_checks(args)
    cfg = get_config(args.model)
    gen = torch.Generator().manual_seed(args.seed)
    lengths = _demo_requests(args, gen)
    num_tokens = sum(q for _, q in lengths)
    padding = -num_tokens % 64
    _check_demo_memory(args, lengths, cfg, fmt, padding, device)
    status = _status()
    status.print(f"set-up: {args.decodes} decode requests + {len(lengths) - args.decodes} prefill chunks "
                 f"({num_tokens} tokens), {fmt} caches on {device}: filling caches, building the step metadata ...")
    t0 = time.perf_counter()
    sc = make_scenario(lengths, window=cfg.window, topk=cfg.index_topk, fmt=fmt, dim=cfg.head_dim,
                       decode_threshold=2, padding=padding, seed=args.seed, device=device)
    setup_s = time.perf_counter() - t0
    b = sc.batch
    q = (torch.randn(b.token_capacity, cfg.num_heads, cfg.head_dim, generator=gen) * 0.5).to(torch.bfloat16).to(device)
    sink = torch.randn(cfg.num_heads, generator=gen).to(device)
    kernel = attention_kernel(args.backend, q, sc.caches["swa"].data)
    status.print(f"set-up done in {setup_s:.1f} s")
    # the oracle is float64 and dense per request: check every decode token and ~24 prefill tokens
    stride = max(1, b.num_prefill_tokens // PREFILL_SAMPLE)
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
    p.add_argument("--seed", type=parse_seed, default=0)


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
    Console(highlight=False).print(f"support on this GPU: {support_line(device)}")
    Console(highlight=False).print(f"torch / Triton: {stack_line()}")
    return 1 if any(c.ok is False for c in checks) else 0


def _bench_arguments(p: argparse.ArgumentParser) -> None:
    """None here: the step benchmark's own parser takes the rest of the line (its --help too)."""


def load_step_benchmark() -> ModuleType:
    """``benchmarks/bench_step.py`` of the source checkout (:data:`STEP_BENCHMARK`), imported as its script runs:
    its folder first on ``sys.path``, where its ``harness`` and ``timing`` modules live. ``FileNotFoundError``
    for an installed package without the checkout."""
    if not STEP_BENCHMARK.is_file():
        raise FileNotFoundError(f"no {STEP_BENCHMARK}: the step benchmark ships with the source, not the package; "
                                "clone the repository and run it there (pip install -e .)")
    folder = str(STEP_BENCHMARK.parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    spec = importlib.util.spec_from_file_location("bench_step", STEP_BENCHMARK)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_step"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@command("bench", "the step benchmark (benchmarks/bench_step.py of a source checkout): whole V4 serving steps, "
                  "ours vs FlashMLA, on a CUDA GPU; --smoke: tiny sizes on the CPU (sparse-mla bench --help)",
         _bench_arguments)
def bench(args: argparse.Namespace) -> int:
    """Parse the rest of the line with the step benchmark's options (a bad one is a usage error before any device
    check), then run it: exit 0, or 2 without a CUDA GPU unless ``--smoke``."""
    try:
        step_benchmark = load_step_benchmark()
    except FileNotFoundError as e:
        print(f"sparse-mla bench: error: {e}", file=sys.stderr)
        return 1
    parser = argparse.ArgumentParser(prog="sparse-mla bench", description=COMMANDS["bench"][0])
    step_benchmark.add_arguments(parser)
    return step_benchmark.run(parser.parse_args(args.rest))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sparse-mla", description="DeepSeek sparse MLA attention for serving.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (help, add_arguments, run) in COMMANDS.items():
        # bench's own options belong to the step benchmark: its --help is passed on too
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
