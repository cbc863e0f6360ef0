"""This machine's correctness check (``sparse-mla verify``): small random inputs, three groups of checks.

* ``kernel``: the Triton kernels against the reference ops (attention, cache insert / gather, token
  order). On a CPU they run only in Triton's interpreter, which must be switched on before the kernels
  are imported: :func:`kernel_checks_in_subprocess` runs them in a child with ``TRITON_INTERPRET=1``.
* ``oracle``: a V4 and a V4.1 layer of each kind over caches of their formats (V4.1's fp4 compressed caches beside
  fp8 windows), and V3.2's dsa layer, against the float64 dense oracle.
* ``flashmla``: FlashMLA reads our fp8_v4 caches and agrees with our kernels (CUDA and ``flash_mla`` only).

It also says what this GPU supports: :func:`support_row`, the row of the support table (README's, made by
:func:`support_markdown`) for the GPU's :class:`~sparse_mla.ops.targets.Target`; and what this torch / Triton pair
gets (:func:`stack_line`).

``python -m sparse_mla.verify`` prints the kernel checks as JSON lines (what the subprocess runs).
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch

from ._checks import check_device, check_positive_int
from .cache import PagedCache
from .config import PICKS_KINDS, V4_KINDS, V41_KINDS, get_config
from .formats import quantize_blocks
from .layer import SparseMLAAttention
from .ops import (dequantize_and_gather, longest_first, quantize_and_insert, sparse_attention_decode,
                  sparse_attention_prefill)
from .ops import targets
from .ops.dispatch import resolve_backend
from .ops.order import longest_first_torch
from .ops.validate import D_V
from .scenario import Scenario, make_scenario

TOLERANCE = 1e-2  # relative Frobenius error of a bf16 output (DESIGN §7.1)
FORMATS = (("fp8_v4", 512), ("bf16", 512), ("fp8_v32", 576), ("bf16", 576))
Progress = Callable[[str], None]


# the support table's columns: per cache format (its q·k width; V4.1's in either page layout), then an fp8 query (over
# fp8_e4m3 caches)
SUPPORT_FORMATS = (("bf16", 512), ("fp8_v4", 512), ("fp8_v32", 576), ("fp8_e4m3", 512), ("fp8_v41", 512),
                   ("fp4_v41", 512))


def support_row(target: targets.Target) -> dict[str, str]:
    """The support table's row of ``target``: the GPUs, then per cache format (and an fp8 q) what runs —
    ``"decode, prefill, cache ops"`` or why not (:func:`.ops.launch_configs.unsupported`, the sentence a user's
    ``ValueError`` carries) — and how that is verified (``Target.verified``)."""
    from .ops import launch_configs

    row = {"GPU": f"{target.gpus} ({target.name})"}
    for fmt, dim in SUPPORT_FORMATS:
        why = launch_configs.unsupported(target, dim, frozenset({fmt}), False)
        row[fmt] = "decode, prefill, cache ops" if why is None else f"no: {why}"
    why = launch_configs.unsupported(target, 512, frozenset({"fp8_e4m3"}), True)
    row["fp8 q"] = "yes" if why is None else f"no: {why}"
    row["verified"] = target.verified
    row["known limits"] = target.limits
    return row


def support_markdown() -> str:
    """README's support table: :func:`support_row` of every target of :data:`.ops.targets.MATRIX`, as Markdown."""
    rows = [support_row(t) for t in targets.MATRIX]
    lines = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    lines += ["| " + " | ".join(r.values()) + " |" for r in rows]
    return "\n".join(lines)


def support_line(device: torch.device) -> str:
    """What ``sparse-mla verify`` prints about the GPU it runs on: its support row, one line."""
    if not isinstance(device, torch.device):  # (a string: the device it names, checked)
        device = check_device("device", device)
    if device.type != "cuda":
        return "no GPU: the reference ops run here (and the Triton kernels in Triton's CPU interpreter)"
    row = support_row(targets.target_of(device))
    return "; ".join(f"{k}: {v}" for k, v in row.items())


def stack_line() -> str:
    """The support statement for this machine's torch / Triton (``sparse-mla verify`` prints it, README's Support says
    the same): the pairs the GPU suite passed on (``ops.gluon.VALIDATED_STACKS``), then what this pair gets: which
    attention kernel a Hopper GPU runs (and why not the Gluon kernel, ``ops.gluon.off_reason``) and whether kernels
    are launched directly (``ops.launch.FAST_TRITON``) or through Triton's JIT, some 5-8x the host time per call."""
    from .ops import gluon
    from .ops.dispatch import HAVE_TRITON

    tested = ", ".join(f"torch {torch_version} + Triton {triton_version}"
                       for torch_version, triton_version in gluon.VALIDATED_STACKS)
    statement = (f"GPU-tested: {tested} (the Gluon kernel on Hopper GPUs, the portable Triton kernel on every other "
                 f"GPU); here torch {torch.__version__}")
    if not HAVE_TRITON:
        return f"{statement}, no Triton: the reference ops only"
    import triton

    from .ops import launch

    reason = gluon.off_reason()
    hopper = ("Hopper GPUs run the Gluon kernel" if reason is None
              else f"Hopper GPUs run the portable Triton kernel ({reason})")
    launches = ("kernels launched directly" if launch.fast_path_enabled()
                else "kernels launched through Triton's JIT (more host time per call)")
    return f"{statement}, Triton {triton.__version__}: {hopper}; {launches}"


@dataclass(frozen=True)
class Check:
    """One line of the report: ``ok`` is None for a check that could not run here (``detail`` says why)."""

    group: str
    name: str
    ok: bool | None
    detail: str


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative Frobenius error of ``out`` against ``ref`` (on the CPU: an oracle's reference lives there)."""
    if out.shape != ref.shape:
        raise ValueError(f"out must have ref's shape {tuple(ref.shape)}, got {tuple(out.shape)}")
    out, ref = out.float().cpu(), ref.float().cpu()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-20)).item()


def random_scope(gen: torch.Generator, fmt: str, dim: int, num_tokens: int, width: int, num_blocks: int,
                 block_size: int, device: torch.device | str, lens_mode: str = "random"
                 ) -> tuple[PagedCache, torch.Tensor, torch.Tensor]:
    """A NaN-poisoned paged cache with a random 3/4 of its slots written, and random indices into those
    (10 % ``-1``). ``lens_mode="random"``: random lengths with token 0 full, token 1 empty and every entry
    of token 2 invalid; ``"full"``: every token the whole width."""
    if lens_mode not in ("random", "full"):
        raise ValueError(f"lens_mode must be 'random' or 'full', got {lens_mode!r}")
    check_positive_int("num_tokens", num_tokens)
    check_positive_int("width", width)
    cache = PagedCache(num_blocks, block_size, fmt, dim, device)
    cache.poison()
    num_slots = num_blocks * block_size
    used = torch.randperm(num_slots, generator=gen)[: max(1, num_slots * 3 // 4)].to(device)
    cache.write((torch.randn(used.numel(), dim, generator=gen) * 2).to(torch.bfloat16).to(device), used.int())
    pick = torch.randint(0, used.numel(), (num_tokens, width), generator=gen).to(device)
    indices = used[pick].int()
    indices[torch.rand(num_tokens, width, generator=gen).to(device) < 0.1] = -1
    if lens_mode == "full":
        lens = torch.full((num_tokens,), width, dtype=torch.int32, device=device)
    else:
        lens = torch.randint(0, width + 1, (num_tokens,), generator=gen).int().to(device)
        lens[0] = width
        if num_tokens > 2:
            lens[1] = 0
            indices[2] = -1  # a row whose every entry is invalid
    return cache, indices, lens


def random_sink(gen: torch.Generator, num_heads: int, device: torch.device | str) -> torch.Tensor:
    """Random per-head sinks with every third head ``-inf`` (no sink) and head 1 ``+inf`` (zeroed)."""
    check_positive_int("num_heads", num_heads)
    sink = torch.randn(num_heads, generator=gen)
    sink[::3] = float("-inf")
    if num_heads > 1:
        sink[1] = float("inf")
    return sink.to(device)


def _attention_check(name: str, got: tuple[torch.Tensor, torch.Tensor],
                     ref: tuple[torch.Tensor, torch.Tensor]) -> Check:
    (out, lse), (ref_out, ref_lse) = got, ref
    finite = torch.isfinite(ref_lse)
    err = rel_err(out, ref_out)
    ok = (not bool(out.isnan().any()) and err < TOLERANCE
          and torch.equal(torch.isinf(lse) & (lse > 0), ~finite)
          and torch.allclose(lse[finite], ref_lse[finite], atol=2e-3, rtol=1e-3) and bool((out[~finite] == 0).all()))
    return Check("kernel", name, ok, f"rel err {err:.1e}")


def kernel_checks(device: torch.device, seed: int = 0, progress: Progress = lambda _: None) -> list[Check]:
    """The Triton kernels against the reference ops on ``device`` (a CPU needs ``TRITON_INTERPRET=1``)."""
    gen = torch.Generator().manual_seed(seed)
    checks = []
    for fmt, dim in FORMATS:
        progress(f"kernel: decode over two {fmt} scopes, d={dim}")
        (c0, i0, l0), (c1, i1, l1) = (random_scope(gen, fmt, dim, 3, 12, 3, 8, device),
                                      random_scope(gen, fmt, dim, 3, 20, 4, 4, device))
        q = torch.randn(3, 2, dim, generator=gen).to(torch.bfloat16).to(device)
        kw = dict(extra_cache=c1.data, extra_indices=i1, extra_lens=l1, sink=random_sink(gen, 2, device))
        ref = sparse_attention_decode(q, c0.data, i0, l0, backend="reference", **kw)
        order = longest_first(l0, l1)
        got = sparse_attention_decode(q, c0.data, i0, l0, backend="triton", order=order, **kw)
        checks.append(_attention_check(f"decode, two {fmt} scopes, d={dim}", got, ref))

        progress(f"kernel: insert and gather, {fmt} d={dim}")
        kv = (torch.randn(10, dim, generator=gen) * 3).to(torch.bfloat16).to(device)
        slots = torch.randperm(16, generator=gen)[:10].int().to(device)
        slots[3] = -1
        caches = []
        for backend in ("reference", "triton"):
            cache = PagedCache(2, 8, fmt, dim, device)
            quantize_and_insert(kv, cache.data, slots, backend=backend)
            caches.append(cache.data)
        read = [dequantize_and_gather(caches[0], slots.view(2, 5), backend=b) for b in ("reference", "triton")]
        same = torch.equal(caches[0], caches[1]) and torch.equal(read[0], read[1])
        checks.append(Check("kernel", f"insert + gather, {fmt} d={dim}", same, "bit-identical" if same else "differ"))

    progress("kernel: prefill over a bf16 workspace")
    kv = torch.randn(40, 512, generator=gen).to(torch.bfloat16).to(device)
    idx = torch.randint(0, 40, (5, 24), generator=gen).int().to(device)
    idx[torch.rand(5, 24, generator=gen).to(device) < 0.2] = -1
    lens = torch.randint(0, 25, (5,), generator=gen).int().to(device)
    q = torch.randn(5, 3, 512, generator=gen).to(torch.bfloat16).to(device)
    sink = random_sink(gen, 3, device)
    checks.append(_attention_check("prefill, bf16 workspace",
                                   sparse_attention_prefill(q, kv, idx, lens, sink=sink, backend="triton"),
                                   sparse_attention_prefill(q, kv, idx, lens, sink=sink, backend="reference")))

    progress("kernel: token order")
    from .ops.triton import index as triton_index

    l0, l1 = (torch.randint(0, 700, (300,), generator=gen).int().to(device) for _ in range(2))
    got = torch.empty(300, dtype=torch.int32, device=device)
    triton_index.longest_first(l0, l1, 64, got)
    same = torch.equal(got.cpu(), longest_first_torch(l0.cpu(), l1.cpu()))
    checks.append(Check("kernel", "token order (longest first)", same, "equal" if same else "differ"))
    return checks


def kernel_checks_in_subprocess(seed: int = 0, progress: Progress = lambda _: None) -> list[Check]:
    """:func:`kernel_checks` on the CPU, in a child process with Triton's interpreter on."""
    progress("kernel: running the Triton kernels on the CPU in Triton's interpreter (a subprocess, TRITON_INTERPRET=1)")
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-m", __name__, "--seed", str(seed)], env=env, capture_output=True,
                          text=True)
    checks = [Check(**json.loads(line)) for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not checks:
        tail = done.stderr.strip().splitlines()[-1:] or ["no output"]
        checks.append(Check("kernel", "interpreter subprocess", False, f"exit {done.returncode}: {tail[0]}"))
    return checks


@dataclass(frozen=True)
class LayerResult:
    elapsed_s: float
    max_err: float
    rel_err: float
    ok: bool


def run_layer_against_oracle(sc: Scenario, layer: SparseMLAAttention, q: torch.Tensor, sample: list[int],
                             sink: torch.Tensor | None) -> LayerResult:
    """Run ``layer`` on the scenario's step (a warm-up call without metadata first, and on a GPU a compiling
    call), time one call, and compare the ``sample`` token rows with the float64 dense oracle. It passes
    with rel err < :data:`TOLERANCE`, no NaN, and zero padding rows."""
    b = sc.batch
    picks = sc.picks[layer.kind] if layer.kind in PICKS_KINDS else None
    out = torch.full((b.token_capacity, layer.num_heads, D_V), float("nan"), dtype=torch.bfloat16, device=q.device)
    layer(q, None, sc.caches, out=out)  # warm-up without metadata: zeros
    if q.is_cuda:  # compile the kernels outside the timed call
        layer(q, sc.meta, sc.caches, picks, out=out)
        torch.cuda.synchronize(q.device)
    t = time.perf_counter()
    layer(q, sc.meta, sc.caches, picks, out=out)
    if q.is_cuda:
        torch.cuda.synchronize(q.device)
    elapsed = time.perf_counter() - t
    ref = sc.expected(q, layer.kind, sample, sink, layer.scale)
    got = out[sample].double().cpu()
    err = rel_err(got, ref)
    ok = err < TOLERANCE and not bool(out.isnan().any()) and bool((out[b.num_tokens:] == 0).all())
    return LayerResult(elapsed, (got - ref).abs().max().item(), err, ok)


# the oracle checks' models: (preset, layer kinds, (window cache format, compressed caches' format or None) pairs)
ORACLE_MODELS = (("deepseek-v4-flash", V4_KINDS, (("bf16", None), ("fp8_v4", None))),
                 ("deepseek-v4.1-flash", V41_KINDS, (("bf16", None), ("fp8_v41", "fp4_v41"))),
                 ("deepseek-v3.2", ("dsa",), (("bf16", None), ("fp8_v32", None))))


def oracle_checks(device: torch.device, backend: str = "auto", seed: int = 0,
                  progress: Progress = lambda _: None) -> list[Check]:
    """A small step (two decodes, one with an MTP token, and a prefill chunk): each V4 and V4.1 layer kind over caches
    of each of its model's formats, and V3.2's dsa layer over bf16 and fp8_v32 caches, against the dense oracle,
    every token checked. A format the Triton kernels do not read on this device runs on the reference backend (the
    check's name says so)."""
    from .ops import launch_configs

    num_heads = 8
    checks = []
    for model, kinds, formats in ORACLE_MODELS:
        cfg = get_config(model)
        for fmt, comp_fmt in formats:
            sc = make_scenario([(1400, 1), (700, 2), (300, 24)], window=cfg.window or 128, topk=cfg.index_topk,
                               fmt=fmt, dim=cfg.head_dim, decode_threshold=2, padding=3, seed=seed, device=device,
                               kinds=kinds, compressed_fmt=comp_fmt)
            gen = torch.Generator().manual_seed(seed)
            q = (torch.randn(sc.batch.token_capacity, num_heads, cfg.head_dim, generator=gen) * 0.5).to(torch.bfloat16)
            sink = torch.randn(num_heads, generator=gen).to(device) if cfg.window else None
            unread = resolve_backend(backend, device) == "triton" and launch_configs.unsupported(
                targets.target_of(device), cfg.head_dim, frozenset({fmt, comp_fmt or fmt}), False)
            formats_name = fmt if comp_fmt is None else f"{fmt} + {comp_fmt}"
            for kind in kinds:
                progress(f"oracle: {kind} layer, {formats_name} caches")
                layer = SparseMLAAttention(kind, num_heads, cfg.head_dim, cfg.window or 128,
                                           topk=cfg.index_topk if kind in PICKS_KINDS else None,
                                           scale=cfg.softmax_scale, sink=sink,
                                           backend="reference" if unread else backend)
                res = run_layer_against_oracle(sc, layer, q.to(device), list(range(sc.batch.num_tokens)), sink)
                name = f"{model} {kind} layer, {formats_name} caches" + (" (reference backend)" if unread else "")
                checks.append(Check("oracle", name, res.ok, f"rel err {res.rel_err:.1e}"))
    return checks


def flashmla_case(num_heads: int, extra_topk: int, extra_block: int, ragged: bool
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashMLA's sparse decode over our fp8_v4 caches (two scopes, 4 requests x 2 tokens) and ours:
    ``(flash_mla's out, the reference's, the Triton / Gluon kernel's)``, each ``(8, num_heads, 512)``."""
    import flash_mla

    gen = torch.Generator(device="cuda").manual_seed(num_heads + extra_topk)
    b, s_q, d = 4, 2, 512

    def scope(num_blocks: int, block_size: int, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
        kv = torch.randn(num_blocks, block_size, d, generator=gen, device="cuda").to(torch.bfloat16)
        cache = quantize_blocks(kv, "fp8_v4")
        slots = torch.rand(b * s_q, num_blocks * block_size, generator=gen, device="cuda").topk(topk, -1).indices
        return cache, slots.int()

    cache0, idx0 = scope(8, 64, 128)
    cache1, idx1 = scope(1024 // extra_block * 2, extra_block, extra_topk)
    lens1 = torch.full((b,), extra_topk, dtype=torch.int32, device="cuda")
    if ragged:
        lens1 = torch.randint(0, extra_topk + 1, (b,), generator=gen, device="cuda").int()
        idx1[torch.arange(extra_topk, device="cuda")[None] >= lens1.repeat_interleave(s_q)[:, None]] = -1
    q = torch.randn(b * s_q, num_heads, d, generator=gen, device="cuda").to(torch.bfloat16)
    sink = torch.randn(num_heads, generator=gen, device="cuda")
    scale = d ** -0.5
    meta, _ = flash_mla.get_mla_metadata()
    fm_out, _ = flash_mla.flash_mla_with_kvcache(
        q.view(b, s_q, num_heads, d), cache0.unsqueeze(2), None, None, 512, meta, None, scale, False, True,
        idx0.view(b, s_q, -1), sink, cache1.unsqueeze(2), idx1.view(b, s_q, -1), None,
        lens1 if ragged else None, use_legacy=True)
    lens_tok = lens1.repeat_interleave(s_q)
    ref, _ = sparse_attention_decode(q, cache0, idx0, None, extra_cache=cache1, extra_indices=idx1, extra_lens=lens_tok,
                                     sink=sink, scale=scale, backend="reference")
    ours, _ = sparse_attention_decode(q, cache0, idx0, None, extra_cache=cache1, extra_indices=idx1,
                                      extra_lens=lens_tok, sink=sink, scale=scale, backend="triton")
    return fm_out.reshape(b * s_q, num_heads, 512), ref, ours


FLASHMLA_CASES = ((64, 512, 64, False), (128, 1024, 2, True))  # (heads, extra topk, extra block size, ragged)


def flashmla_checks(progress: Progress = lambda _: None) -> list[Check]:
    """FlashMLA interop on the GPU; one skipped line where it cannot run."""
    if not torch.cuda.is_available() or importlib.util.find_spec("flash_mla") is None:
        return [Check("flashmla", "FlashMLA reads our fp8_v4 caches", None, "needs CUDA and flash_mla")]
    checks = []
    for case in FLASHMLA_CASES:
        progress(f"flashmla: {case[0]} heads, extra topk {case[1]}")
        fm, ref, ours = flashmla_case(*case)
        errs = rel_err(fm, ref), rel_err(ours, fm)
        checks.append(Check("flashmla", f"{case[0]} heads, extra topk {case[1]}, block {case[2]}",
                            max(errs) < TOLERANCE, f"vs reference {errs[0]:.1e}, ours vs FlashMLA {errs[1]:.1e}"))
    return checks


def main(argv: list[str] | None = None) -> int:
    """The subprocess of :func:`kernel_checks_in_subprocess`: kernel checks on the CPU as JSON lines."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m sparse_mla.verify")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for check in kernel_checks(torch.device("cpu"), args.seed):
        print(json.dumps(asdict(check)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
