"""What the benchmark scripts share: the run's environment (:class:`Env`), a synthetic step's holder
(:class:`Step`), random cache contents, FlashMLA's optional side of a case, and the scripts' entry, result
file and report. The scripts (``bench_step.py``, ``bench_v32.py``, ``bench_hf.py``) import it as ``harness``:
a script's folder is first on ``sys.path``. Not part of the ``sparse_mla`` package: a serving engine never
imports rich, matplotlib or a benchmark.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Callable, Generic, Iterable, Sequence, TypeVar

import torch
from rich.console import Console

from sparse_mla.batch import StepBatch
from sparse_mla.cache import PagedCache
from sparse_mla.indexer_cache import IndexerKeyCache
from sparse_mla.metadata import MetadataSpec, StepMetadata, build_step_metadata

from timing import warm_up_gpu

SizesT = TypeVar("SizesT")


@dataclass
class Env(Generic[SizesT]):
    """What every case needs: device, backend, FlashMLA (or None), whether to capture graphs, timing reps,
    the run's sizes (each script's own ``Sizes``), seed, console."""

    device: torch.device
    backend: str
    flash_mla: ModuleType | None
    graphs: bool
    rep_ms: int
    rounds: int
    sizes: SizesT
    seed: int
    console: Console


@dataclass
class Step:
    """One synthetic serving step: batch, metadata (refilled in place by each build), caches, indexer picks."""

    batch: StepBatch
    spec: MetadataSpec
    meta: StepMetadata
    caches: dict[str, PagedCache]
    picks: torch.Tensor  # (T, topk) int32 indexer picks (c4a: local entries; dsa: positions), valid prefix, -1 after

    def build(self) -> StepMetadata:
        """The step's metadata work: ``build_step_metadata`` into the step's buffers."""
        return build_step_metadata(self.batch, self.spec, out=self.meta)


def fill_random(cache: PagedCache, gen: torch.Generator, chunk: int = 1 << 18) -> None:
    """Write every slot of ``cache`` with random latents (N(0, 0.25), bf16, quantised to its format)."""
    for start in range(0, cache.num_slots, chunk):
        n = min(chunk, cache.num_slots - start)
        slots = torch.arange(start, start + n, dtype=torch.int32, device=cache.device)
        kv = (torch.randn(n, cache.fmt.dim, generator=gen, device=cache.device) * 0.5).to(torch.bfloat16)
        cache.write(kv, slots)


def fill_random_keys(cache: IndexerKeyCache, gen: torch.Generator, chunk: int = 1024) -> None:
    """Fill an fp8 indexer key cache with random keys: valid e4m3 codes (no NaN: 0x7F / 0xFF) of random signs, and
    power-of-two scales (132 B an entry, as the compressors write them)."""
    codes = cache.codes()
    for b0 in range(0, cache.num_blocks, chunk):
        part = codes[b0:b0 + chunk]
        raw = torch.randint(0, 0x7E, part.shape, dtype=torch.uint8, device=cache.device, generator=gen)
        part.copy_(raw | (torch.randint(0, 2, part.shape, dtype=torch.uint8, device=cache.device, generator=gen) << 7))
    cache.scales().copy_(torch.exp2(torch.randint(-12, -6, cache.scales().shape, device=cache.device,
                                                  generator=gen).float()))


FLASH_MLA_ERRORS = (RuntimeError, AssertionError, TypeError, ValueError)


def flash_mla_side(row: dict, case: str, env: Env, set_up: Callable[[], Callable[[], object]]
                   ) -> Callable[[], object] | None:
    """FlashMLA's side of a case: ``set_up()`` (runs it once, compares outputs, fills ``row``; returns what to
    time), or None when FlashMLA is not timed or rejects the case (its wheel's legacy path may refuse an
    argument): then ``row["flashmla_error"]`` says why, and the case times ours alone."""
    if env.flash_mla is None:
        return None
    try:
        return set_up()
    except FLASH_MLA_ERRORS as err:
        row["flashmla_error"] = f"{type(err).__name__}: {err}"
        env.console.log(f"[red]{case}: FlashMLA failed, timing ours alone: {row['flashmla_error']}[/red]")
        return None


def prepare(args: argparse.Namespace, console: Console, needs: str,
            make_env: Callable[[argparse.Namespace, Console], Env]) -> Env | None:
    """The run's :class:`Env` (``make_env``), the GPU warmed up; None, after printing ``needs`` to stderr, on a
    machine without CUDA unless ``args.smoke``."""
    if not args.smoke and not torch.cuda.is_available():
        print(f"{needs} On a CPU run it with --smoke (tiny sizes).", file=sys.stderr)
        return None
    env = make_env(args, console)
    if env.device.type == "cuda":
        warm_up_gpu()
    return env


def run_info(env: Env) -> dict:
    """What a result was measured on: device, torch, triton and flash_mla versions."""
    fm = env.flash_mla
    out = dict(device=torch.cuda.get_device_name() if env.device.type == "cuda" else f"cpu ({platform.machine()})",
               torch=torch.__version__, flash_mla=getattr(fm, "__version__", "unknown") if fm else None)
    try:
        import triton
        out["triton"] = triton.__version__
    except ImportError:
        out["triton"] = None
    return out


def save_result(path: str, result: dict, start: float) -> None:
    """Write ``result`` as JSON to ``path``, with the seconds since ``start`` (the benchmarks call it after each
    part, so a run cut short keeps what ran)."""
    result["seconds"] = time.perf_counter() - start
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


def write_json(folder: str, name: str, result: object) -> str:
    """``result`` as JSON to ``folder/name``, the folder made if need be (the probes' output); returns the path."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, name)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    return path


def probe_main(doc: str, name: str, names: Sequence[str], run: Callable[[list[str]], list[dict]],
               lowerings: tuple[str, ...] = (), lowering_required: bool = False) -> None:
    """A probe's command line and output: ``--out`` (default ``$OUT`` or ``results``), ``--cases`` (default
    ``names``) and, with ``lowerings``, ``--lowering`` (the whole run lowered as for that target); ``run(cases)``'s
    rows to ``out/name[-lowering].json`` with the Triton version and the GPU's target."""
    import contextlib

    import triton

    from sparse_mla.ops import targets

    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "results"))
    parser.add_argument("--cases", nargs="+", default=list(names))
    if lowerings:
        parser.add_argument("--lowering", choices=lowerings, required=lowering_required)
    args = parser.parse_args()
    lowering = getattr(args, "lowering", None)
    with targets.lower_as(lowering) if lowering else contextlib.nullcontext():
        rows = run(args.cases)
        target = targets.target_of(torch.device("cuda")).name
    write_json(args.out, f"{name}{'-' + lowering if lowering else ''}.json",
               dict(triton=triton.__version__, target=target, rows=rows))


def report(console: Console, path: str, result: dict, tables: Iterable) -> int:
    """Print a finished run's ``tables`` and where :func:`save_result` wrote its JSON; 0, the scripts' exit status."""
    for table in tables:
        console.print(table)
    console.print(f"JSON: {path} ({result['seconds']:.0f} s)")
    return 0


def main(doc: str, add_args: Callable[[argparse.ArgumentParser], None],
         run_args: Callable[[argparse.Namespace], int]) -> None:
    """A benchmark script's entry: its arguments (``add_args``, described by ``doc``'s first line) parsed and run."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    add_args(parser)
    parser.add_argument("--lowering", choices=("sm80", "sm86", "sm89"),
                        help="run our kernels lowered as for this target (sparse_mla.ops.targets.lower_as; "
                             "FlashMLA still runs natively): the portable kernel's code path on this GPU")
    args = parser.parse_args()
    if args.lowering:
        from sparse_mla.ops.targets import lower_as

        with lower_as(args.lowering):  # before any kernel compiles, for the whole run
            raise SystemExit(run_args(args))
    raise SystemExit(run_args(args))


def positive_int(text: str) -> int:
    """An argparse ``type``: a positive integer, else a usage error naming the value (before any device check)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def output_folder(text: str) -> str:
    """An argparse ``type`` for ``--out``: a folder that exists or can be made (its nearest existing ancestor is a
    writable folder), else a usage error naming it, before anything runs. Made only when a result is written."""
    path = Path(text).absolute()
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is an existing file, not a folder")
    parent = path
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{text!r} cannot be made: {str(parent)!r} is not a writable folder")
    return text
