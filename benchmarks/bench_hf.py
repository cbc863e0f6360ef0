"""A Hugging Face DeepSeek-V4 model's ``generate()``: HF eager / sdpa vs sparse-mla (issue 20's H100 acceptance).

    python benchmarks/bench_hf.py --out results/                 # H100: 8K and 32K prompts, ~2-4 min
    python benchmarks/bench_hf.py --smoke --out /tmp/smoke       # tiny on the CPU, reference backend (~10 s)
    python benchmarks/bench_hf.py --impls eager sparse_mla_pipeline --contexts 8192 --index-heads 64 --out results/
    python benchmarks/bench_hf.py --impls eager sparse_mla_graphs --contexts 8192 --index-heads 64 --index-format fp8 \
        --new-tokens 32 --out results/                           # decode steps as CUDA-graph replays
    python benchmarks/bench_hf.py --impls sparse_mla_pipeline --contexts 131072 --index-heads 64 --index-format fp8 \
        --new-tokens 4 --out results/128k                         # a 128K-token prompt on one GPU
    python benchmarks/bench_hf.py ... --profile                  # + each run's prefill and decode steps under cProfile

The model: ``DeepseekV4ForCausalLM`` from a config with random weights (bf16 on CUDA), attention at V4's
sizes (64 heads, head_dim 512, sliding window 128, index top-k 512; ``--layers`` layers cycling
``compressed_sparse_attention``, ``heavily_compressed_attention``, ``sliding_attention``) and everything
else tiny (hidden 512, vocab 1024, 4 experts, 4 indexer heads: HF's indexer scores are a dense fp32
``(S, index_heads, S/4)`` tensor in the prefill, 69 GB at 32K with V4's 64 heads) so the attention dominates.

For each prompt length (``--contexts``) and implementation, batch 1, one greedy ``generate()`` of
``--new-tokens`` tokens (no EOS, so always that many). Implementations:

* ``eager``: HF's ``attn_implementation="eager"`` (dense ``(H, S, S + entries)`` scores).
* ``sdpa``: tried with ``model.set_attn_implementation("sdpa")``; transformers 5.23's V4 sets
  ``_supports_sdpa = False`` (SDPA has no per-head sink), so the row records ``"unsupported"`` and why.
* ``sparse_mla``: ``enable_sparse_mla(model, kv_format="fp8_v4")`` (``--kv-format``), removed after.
  HF's own cache, compressors and indexer still run beside the paged caches (memory counts them).
* ``sparse_mla_pipeline``: ``enable_sparse_mla(model, ..., pipeline=True, index_format=...)``, one row per
  ``--index-format`` (default bf16 and fp8 keys; the row's ``index_format``): the compressors write the library's
  caches and its indexer makes the picks (docs/transformers.md); HF's compressors / indexer do not run, so no dense
  ``(S, heads, S/4)`` scores.
* ``sparse_mla_graphs``: the pipeline with ``cuda_graphs=True``: decode steps replay a CUDA graph of the model's
  layers (the row's ``graph_counts``: captures and replays over the timed run).

Timing: a streamer whose ``put`` (called by ``generate`` with the prompt, then with each new token, after
its ``.cpu()`` copy) synchronises CUDA and stamps ``time.perf_counter()``. ``prefill_s`` = prompt put ->
first token (the prefill forward + its sampling), ``decode_ms`` = the median gap between later tokens
(one decode forward each). Before each timed run, a warm-up ``generate`` of the same prompt length and 2 new
tokens compiles the kernels that length specialises (a first 8K prefill after a 512-token warm-up spent 6-7 s
compiling, 0.09 s on the next run); ``--warmup-context N``: one N-token warm-up per implementation instead.
Peak memory: ``torch.cuda.reset_peak_memory_stats``
before the ``generate``, ``max_memory_allocated`` after (weights included, ``weights_gib`` reported).
A CUDA OOM of a run is caught and recorded as ``"oom"`` (then memory freed and the next run goes on);
any other exception as ``"error"`` with its message. The JSON is rewritten after every run.
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import os
import platform
import pstats
import statistics
import time
import traceback
from dataclasses import asdict, dataclass

import torch
from rich.console import Console
from rich.table import Table

from harness import main, report, save_result


LAYER_CYCLE = ("compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention")
IMPLS = ("eager", "sdpa", "sparse_mla", "sparse_mla_pipeline", "sparse_mla_graphs")
PIPELINE_IMPLS = ("sparse_mla_pipeline", "sparse_mla_graphs")  # a row per --index-format
GIB = 1024**3


@dataclass(frozen=True)
class Sizes:
    """The model's sizes: V4's attention on a GPU, tiny under ``--smoke``."""

    heads: int
    head_dim: int
    window: int
    topk: int
    hidden: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    index_heads: int
    index_head_dim: int
    vocab: int

    @staticmethod
    def of(smoke: bool, index_heads: int | None) -> "Sizes":
        if smoke:  # the integration needs head_dim 512 (and the pipeline 128-d indexer keys); the rest tiny
            return Sizes(2, 512, 16, 4, 64, 32, 2, 16, index_heads or 2, 128, 128)
        return Sizes(64, 512, 128, 512, 512, 128, 8, 128, index_heads or 4, 128, 1024)


def make_model(sizes: Sizes, layers: int, max_len: int, device: torch.device, dtype: torch.dtype, seed: int):
    """A random-weight ``DeepseekV4ForCausalLM`` with ``sizes``, eager attention, in eval mode on ``device``."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.DeepseekV4Config(
        vocab_size=sizes.vocab, hidden_size=sizes.hidden, moe_intermediate_size=sizes.hidden // 2,
        num_hidden_layers=layers, num_attention_heads=sizes.heads, head_dim=sizes.head_dim,
        q_lora_rank=sizes.q_lora_rank, n_routed_experts=4, num_experts_per_tok=2, hc_mult=2, hc_sinkhorn_iters=2,
        layer_types=[LAYER_CYCLE[i % len(LAYER_CYCLE)] for i in range(layers)], mlp_layer_types=["moe"] * layers,
        sliding_window=sizes.window, o_groups=sizes.o_groups, o_lora_rank=sizes.o_lora_rank,
        index_n_heads=sizes.index_heads, index_head_dim=sizes.index_head_dim, index_topk=sizes.topk,
        max_position_embeddings=max_len, pad_token_id=0, eos_token_id=None)
    model = transformers.DeepseekV4ForCausalLM(config).eval()
    model.set_attn_implementation("eager")
    return model.to(device=device, dtype=dtype), config


class StampStreamer:
    """``generate``'s streamer: a (CUDA-synchronised) ``perf_counter`` stamp per ``put`` (prompt, then each token).
    profile: two ``cProfile.Profile`` objects, ``(prefill, decode)``: the first on from the prompt's put to the first
    token's (the prefill), the second from then to the end (the decode steps)."""

    def __init__(self, profile: tuple | None = None) -> None:
        self.stamps: list[float] = []
        self.profile = profile

    def put(self, value: torch.Tensor) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.stamps.append(time.perf_counter())
        if self.profile is not None and len(self.stamps) <= 2:
            if len(self.stamps) == 2:
                self.profile[0].disable()
            self.profile[len(self.stamps) - 1].enable()

    def end(self) -> None:
        if self.profile is not None:
            self.profile[1].disable()


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _mem_gib(device: torch.device, peak: bool) -> float | None:
    if device.type != "cuda":
        return None
    return (torch.cuda.max_memory_allocated(device) if peak else torch.cuda.memory_allocated(device)) / GIB


def timed_generate(model, context: int, new_tokens: int, device: torch.device, vocab: int, seed: int,
                   profile_to: str | None = None) -> dict:
    """One greedy ``generate`` of ``new_tokens`` after a random ``context``-token prompt: times and peak memory.
    profile_to: a file that gets the prefill's and the decode steps' cProfiles (functions by cumulative and by own
    time); the row's times are then the profiled ones."""
    ids = torch.randint(1, vocab, (1, context), generator=torch.Generator().manual_seed(seed)).to(device)
    mask = torch.ones_like(ids)
    streamer = StampStreamer(None if profile_to is None else (cProfile.Profile(), cProfile.Profile()))
    _free()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, streamer=streamer)
    if device.type == "cuda":
        torch.cuda.synchronize()
    total = time.perf_counter() - start
    if profile_to is not None:
        with open(profile_to, "w") as f:
            for part, profile in zip(("prefill", "decode steps"), streamer.profile):
                for order in ("cumulative", "tottime"):
                    f.write(f"===== {part}, by {order} time\n")
                    pstats.Stats(profile, stream=f).sort_stats(order).print_stats(45)
    s = streamer.stamps
    gaps = [b - a for a, b in zip(s[1:], s[2:])]  # s[0]: the prompt; s[1]: first token (prefill)
    row = dict(status="ok", generated=int(out.shape[1] - context), total_s=total, prefill_s=s[1] - s[0],
               decode_ms=statistics.median(gaps) * 1e3 if gaps else None,
               decode_ms_mean=statistics.mean(gaps) * 1e3 if gaps else None,
               decode_ms_all=[g * 1e3 for g in gaps], peak_gib=_mem_gib(device, peak=True))
    del out, ids, mask
    return row


def guarded(fn, console: Console, label: str) -> dict:
    """``fn()``'s row, or ``{"status": "oom"}`` on a CUDA OOM / ``{"status": "error", ...}`` on anything else."""
    row, oom, error = None, False, None
    try:
        row = fn()
    except torch.OutOfMemoryError as e:
        oom, error = True, str(e).splitlines()[0][:300]
    except Exception as e:  # noqa: BLE001 - recorded, the benchmark goes on
        error = f"{type(e).__name__}: {e}"[:600]
        console.log(f"[red]{label}: {error}[/red]")
        console.log(traceback.format_exc(limit=6))
    _free()  # after the except block: the traceback's frames (and their tensors) are gone
    if row is not None:
        return row
    if oom:
        console.log(f"[yellow]{label}: CUDA OOM[/yellow]")
        return dict(status="oom", error=error)
    return dict(status="error", error=error)


def try_sdpa(model) -> str | None:
    """``None`` if the model accepts ``attn_implementation="sdpa"`` (it is then set), else why not (eager kept)."""
    try:
        model.set_attn_implementation("sdpa")
    except Exception as e:  # noqa: BLE001 - transformers raises ValueError for unsupported backends
        model.set_attn_implementation("eager")
        return f"{type(e).__name__}: {str(e).splitlines()[0][:400]}"
    if model.config._attn_implementation != "sdpa":
        got = model.config._attn_implementation
        model.set_attn_implementation("eager")
        return f"set_attn_implementation('sdpa') left {got!r}"
    return None


def run_impl(impl: str, model, args: argparse.Namespace, sizes: Sizes, device: torch.device,
             console: Console, write, index_format: str | None = None) -> list[dict]:
    """Every context for one implementation (set up, warm up, time, restore eager); ``index_format``: the
    pipeline's indexer keys (None for the other implementations)."""
    base = dict(impl=impl, index_format=index_format, new_tokens=args.new_tokens, batch=1)
    label = _label(impl, index_format)
    integration, reason = None, None
    if impl == "sdpa":
        reason = try_sdpa(model)
    elif impl in ("sparse_mla", *PIPELINE_IMPLS):
        from sparse_mla.integrations.transformers import enable_sparse_mla

        try:
            integration = enable_sparse_mla(model, kv_format=args.kv_format, backend=args.backend,
                                            pipeline=index_format is not None, index_format=index_format or "bf16",
                                            cuda_graphs=impl == "sparse_mla_graphs")
        except Exception as e:  # noqa: BLE001
            reason = f"{type(e).__name__}: {e}"[:600]
    if reason is not None:
        console.log(f"{label}: not run ({reason})")
        rows = [dict(base, context=c, status="unsupported", reason=reason) for c in args.contexts]
        for r in rows:
            write(r)
        return rows
    rows = []
    try:
        def warm_up(length: int) -> None:
            console.log(f"{label}: warm-up, {length} tokens + 2")
            w = guarded(lambda: timed_generate(model, length, 2, device, sizes.vocab, args.seed), console,
                        f"{label} warm-up")
            console.log(f"{label}: warm-up {w['status']}" + (f" ({w['total_s']:.1f} s)" if w["status"] == "ok" else ""))

        if args.warmup_context > 0:
            warm_up(args.warmup_context)
        for context in args.contexts:
            if args.warmup_context < 0:  # each prompt length once first: its prefill's kernels compiled before timing
                warm_up(context)
            console.log(f"{label}: context {context}, {args.new_tokens} new tokens")
            row = dict(base, context=context)
            before = dict(integration.graph_counts) if integration is not None else {}
            row.update(guarded(lambda: timed_generate(model, context, args.new_tokens, device, sizes.vocab,
                                                      args.seed + context), console, f"{label} {context}"))
            if integration is not None and integration.cuda_graphs:  # the timed run's own
                row["graph_counts"] = {k: v - before[k] for k, v in integration.graph_counts.items()}
            if args.profile and row["status"] == "ok":
                name = f"profile-{label.replace(' ', '_').replace('(', '').replace(')', '')}-{context}.txt"
                to = os.path.join(args.out, name)
                again = guarded(lambda: timed_generate(model, context, args.new_tokens, device, sizes.vocab,
                                                       args.seed + context, to), console, f"{label} {context} profiled")
                row["profiled"] = {k: again.get(k) for k in ("status", "prefill_s", "decode_ms")}
            if row["status"] == "ok":
                console.log(f"{label} {context}: prefill {row['prefill_s']:.3f} s, decode "
                            f"{_fmt(row['decode_ms'], '.2f')} ms/token, peak {_fmt(row['peak_gib'], '.2f')} GiB")
            rows.append(row)
            write(row)
    finally:
        if integration is not None:
            integration.remove()
        model.set_attn_implementation("eager")
    return rows


def _label(impl: str, index_format: str | None) -> str:
    """A row's implementation as the log and the table name it (the pipeline's with its indexer key format)."""
    return impl if index_format is None else f"{impl} ({index_format} keys)"


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def table(result: dict) -> Table:
    t = Table(title=f"HF DeepSeek-V4 generate(), batch 1, {result['new_tokens']} new tokens, {result['device']}")
    for col in ("context", "impl", "status", "prefill s", "decode ms/token", "peak GiB", "note"):
        t.add_column(col, justify="left" if col in ("impl", "status", "note") else "right")
    ok = {(r["context"], r["impl"]): r for r in result["rows"] if r["status"] == "ok"}
    for r in sorted(result["rows"], key=lambda r: (r["context"], IMPLS.index(r["impl"]), r["index_format"] or "")):
        note = r.get("reason") or r.get("error") or ""
        e = ok.get((r["context"], "eager"))
        if r["status"] == "ok" and r["impl"] != "eager" and e and e["decode_ms"] and r["decode_ms"]:
            # the issue's goals are time ratios: decode <= 0.5x eager's ms/token, prefill <= 1x
            note = (f"time / eager's: decode {r['decode_ms'] / e['decode_ms']:.2f}x, "
                    f"prefill {r['prefill_s'] / e['prefill_s']:.2f}x")
        get = (lambda k: r.get(k)) if r["status"] == "ok" else (lambda k: None)
        t.add_row(str(r["context"]), _label(r["impl"], r["index_format"]), r["status"], _fmt(get("prefill_s"), ".3f"),
                  _fmt(get("decode_ms"), ".2f"), _fmt(get("peak_gib"), ".2f"), note[:70])
    return t


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="results/", help="folder for bench_hf.json")
    parser.add_argument("--contexts", type=int, nargs="+", default=None, help="prompt lengths (default 8192 32768)")
    parser.add_argument("--new-tokens", type=int, default=None, help="tokens generated per run (default 8)")
    parser.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS))
    parser.add_argument("--layers", type=int, default=3, help="decoder layers, cycling CSA, HCA, sliding")
    parser.add_argument("--index-heads", type=int, default=None, help="indexer heads (default 4; V4 has 64)")
    parser.add_argument("--kv-format", default=None, help="sparse-mla cache format (default fp8_v4)")
    parser.add_argument("--backend", default=None, help="sparse-mla backend (default auto)")
    parser.add_argument("--index-format", nargs="+", default=None, choices=("bf16", "fp8"),
                        help="the pipeline rows' indexer key cache formats, a row each (default bf16 fp8; "
                             "--smoke bf16)")
    parser.add_argument("--warmup-context", type=int, default=None,
                        help="warm-up prompt length (0: none; -1, the GPU's default: each timed length first)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", action="store_true",
                        help="after each timed run, one more under cProfile (profile-*.txt: prefill, decode)")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny on the CPU: 2 heads, context 160, 2 new tokens, bf16 cache, reference backend")


def run(args: argparse.Namespace) -> int:
    console = Console(width=160)
    start = time.perf_counter()
    try:
        import transformers
    except ImportError:
        console.print("bench_hf needs transformers 5.23.0 or 5.24.0")
        return 2
    if not args.smoke and not torch.cuda.is_available():
        console.print("bench_hf needs a CUDA GPU (or --smoke)")
        return 2
    if args.smoke:
        defaults = dict(contexts=[160], new_tokens=2, kv_format="bf16", backend="reference", warmup_context=0,
                        index_format=["bf16"])
        device, dtype = torch.device("cpu"), torch.float32
    else:
        defaults = dict(contexts=[8192, 32768], new_tokens=8, kv_format="fp8_v4", backend="auto", warmup_context=-1,
                        index_format=["bf16", "fp8"])
        device, dtype = torch.device("cuda"), torch.bfloat16
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    sizes = Sizes.of(args.smoke, args.index_heads)
    max_len = max(max(args.contexts), args.warmup_context) + args.new_tokens + 8
    console.log(f"model: {args.layers} layers, {sizes}, max length {max_len}, {dtype}, {device}")
    model, config = make_model(sizes, args.layers, max_len, device, dtype, args.seed)
    params = sum(p.numel() for p in model.parameters())
    result = dict(device=torch.cuda.get_device_name() if device.type == "cuda" else f"cpu ({platform.machine()})",
                  torch=torch.__version__, transformers=transformers.__version__, smoke=args.smoke,
                  dtype=str(dtype).removeprefix("torch."), kv_format=args.kv_format, backend=args.backend,
                  index_format=args.index_format,
                  new_tokens=args.new_tokens, contexts=args.contexts, layers=args.layers,
                  layer_types=list(config.layer_types), sizes=asdict(sizes), params=params,
                  weights_gib=_mem_gib(device, peak=False), warmup_context=args.warmup_context, rows=[])
    try:
        import triton
        result["triton"] = triton.__version__
    except ImportError:
        result["triton"] = None
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "bench_hf.json")

    def write(row: dict) -> None:
        result["rows"].append(row)
        save_result(path, result, start)

    console.log(f"{params / 1e6:.1f} M parameters" +
                (f", {result['weights_gib']:.2f} GiB on the GPU" if result["weights_gib"] is not None else ""))
    for impl in args.impls:
        for index_format in args.index_format if impl in PIPELINE_IMPLS else [None]:
            run_impl(impl, model, args, sizes, device, console, write, index_format)
    save_result(path, result, start)
    return report(console, path, result, [table(result)])


if __name__ == "__main__":
    main(__doc__, add_arguments, run)
