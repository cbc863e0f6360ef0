"""Host µs of one call, GPU queue kept busy (V4-Flash decode, B requests of 2 tokens, 64 heads): the step batch's
build from the requests' block tables (Python lists), each layer kind
(default and batch-invariant; c4a also with the library indexer's picks, which its select converts in its own
launch), build_step_metadata, our FlashMLA-compatible API and, when the sgl-flash-mla wheel
is installed, FlashMLA's own call on the same inputs (one SWA scope; and two scopes, SWA + C128A, with per-request
lengths), and the public op ``sparse_attention_decode`` on the same two calls: remembered (a repeated call of one
signature, ``sparse_mla.ops.memo``) and, for the two scopes, checked and planned anew each call (the memo emptied).
Every probe is timed in each of several rounds, the probes alternating, and the median round is reported: host
speed drifts over a run, so probes timed far apart are not comparable.

``--base DIR``: also load the package at DIR (another tree's ``src/sparse_mla``, e.g. a ``git archive`` of the
commit a change starts from) under the name ``sparse_mla_base`` and time its probes on the same inputs in the same
rounds, alternating with ours: a host-time A/B free of the drift between processes; the table then gives each
probe's ratio ours / base (median of the rounds' ratios).

    python3 benchmarks/host_probe.py [B] [--rounds N] [--base DIR] [--profile] [--json PATH]
"""
import argparse
import json
import statistics
from collections import OrderedDict
from types import ModuleType

import torch

import sparse_mla

from harness import fill_random_keys  # benchmarks/ (this script's folder is first on sys.path)
from host_builder import load_package, step_build
from timing import host_samples

parser = argparse.ArgumentParser()
parser.add_argument("b", nargs="?", type=int, default=128)
parser.add_argument("--rounds", type=int, default=5)
parser.add_argument("--base", help="another tree's package folder (…/src/sparse_mla), timed alongside as the base")
parser.add_argument("--profile", action="store_true")
parser.add_argument("--json")
cli = parser.parse_args()
b, h = cli.b, 64


def package_probes(pkg: ModuleType, flash_mla: ModuleType | None) -> tuple[dict, dict]:
    """``pkg``'s probes (name -> call) and their outputs' relative errors, on inputs made from the same seed for
    every package; FlashMLA's own calls when ``flash_mla`` is given."""
    from importlib import import_module

    scenario, layer_mod, metadata, ops = (import_module(f"{pkg.__name__}.{m}")
                                          for m in ("scenario", "layer", "metadata", "ops"))
    ours_fm, memo = import_module(f"{pkg.__name__}.flash_mla"), import_module(f"{pkg.__name__}.ops.memo")
    gen = torch.Generator().manual_seed(0)
    lengths = [(int(torch.randint(4096, 32768, (1,), generator=gen)), 2) for _ in range(b)]
    sc = scenario.make_scenario(lengths, window=128, topk=512, fmt="fp8_v4", decode_threshold=2, device="cuda")
    q = torch.randn(sc.batch.token_capacity, h, 512, generator=gen).to(torch.bfloat16).cuda()
    sink = torch.randn(h, generator=gen).cuda()
    out = torch.empty(sc.batch.token_capacity, h, 512, dtype=torch.bfloat16, device="cuda")
    probes = {"build_step_metadata": lambda: metadata.build_step_metadata(sc.batch, sc.meta.spec, out=sc.meta),
              "StepBatchBuilder.build": step_build(import_module(f"{pkg.__name__}.batch"), lengths, sc.batch.kinds,
                                                   dict(sc.batch.block_sizes), "cuda", sc.batch.token_capacity)[0]}
    errors = {}
    rows = list(range(0, 2 * b, 17))
    for kind in ("swa", "c4a", "c128a"):
        for inv in (False, True):
            layer = layer_mod.SparseMLAAttention(kind, h, topk=512 if kind == "c4a" else None, sink=sink,
                                                 batch_invariant=inv)
            picks = sc.topk_local if kind == "c4a" else None
            name = f"{kind}{' invariant' if inv else ''}"
            probes[name] = lambda layer=layer, picks=picks: layer(q, sc.meta, sc.caches, picks, out=out)
            ref = sc.expected(q, kind, rows, sink, 512 ** -0.5)
            got = layer(q, sc.meta, sc.caches, picks, out=out)[rows].double().cpu()
            errors[name] = ((got - ref).norm() / ref.norm()).item()
    # a c4a call with the library indexer's picks (its select converts them in its launch where the package does):
    # on a second, identical step, so that its picks' conversion and the first step's alternate without meeting
    twin = scenario.make_scenario(lengths, window=128, topk=512, fmt="fp8_v4", decode_threshold=2, device="cuda")
    keys = import_module(f"{pkg.__name__}.indexer_cache").IndexerKeyCache(twin.caches["c4a"].num_blocks, "fp8",
                                                                           device="cuda")
    fill_random_keys(keys, torch.Generator(device="cuda").manual_seed(1))
    indexer = import_module(f"{pkg.__name__}.indexer_layer").SparseMLAIndexer("c4a", 64, 512)
    cap = twin.batch.token_capacity
    indexer_picks = indexer(twin.meta, torch.randn(cap, 64, 128, generator=gen).to(torch.bfloat16).cuda(),
                            torch.randn(cap, 64, generator=gen).cuda(), keys)
    layer = layer_mod.SparseMLAAttention("c4a", h, topk=512, sink=sink)
    probes["c4a, the indexer's picks"] = lambda: layer(q, twin.meta, twin.caches, indexer_picks, out=out)

    # the FlashMLA calling convention: q (b, s_q, h, d), 4-D caches, (b, s_q, topk) indices; two scopes with
    # per-request lengths as vLLM's V4 backend passes them
    qf = q.view(b, 2, h, 512)
    swa_cache, c128_cache = sc.caches["swa"].data.unsqueeze(2), sc.caches["c128a"].data.unsqueeze(2)
    swa_idx = sc.meta.swa_indices.view(b, 2, -1)
    c128_idx = sc.meta.c128a_indices.view(b, 2, -1)
    swa_len = sc.meta.swa_lens.view(b, 2)[:, 0].contiguous()
    c128_len = sc.meta.c128a_lens.view(b, 2)[:, 0].contiguous()
    api_calls = {
        "swa": lambda fm, sched, **kw: fm.flash_mla_with_kvcache(qf, swa_cache, None, None, 512, sched, None,
                                                                 512 ** -0.5, False, True, swa_idx, sink, **kw),
        "two scopes": lambda fm, sched, **kw: fm.flash_mla_with_kvcache(
            qf, swa_cache, None, None, 512, sched, None, 512 ** -0.5, False, True, swa_idx, sink, c128_cache,
            c128_idx, swa_len, c128_len, **kw),
    }
    for case, call in api_calls.items():
        sched, _ = ours_fm.get_mla_metadata()
        probes[f"sparse_mla.flash_mla ({case})"] = lambda call=call, sched=sched: call(ours_fm, sched)
    if flash_mla is not None:
        try:
            for case, call in api_calls.items():
                sched, _ = flash_mla.get_mla_metadata()  # one scheduler object per call pattern
                probes[f"FlashMLA ({case})"] = lambda call=call, sched=sched: call(flash_mla, sched, use_legacy=True)
                ours = api_calls[case](ours_fm, ours_fm.get_mla_metadata()[0])[0].float()
                theirs = call(flash_mla, flash_mla.get_mla_metadata()[0], use_legacy=True)[0].float()
                errors[f"API vs FlashMLA ({case})"] = ((ours - theirs).norm() / theirs.norm()).item()
        except Exception as err:  # noqa: BLE001 - FlashMLA refusing a shape leaves our probes to run
            print(f"FlashMLA probes skipped: {err}")
            probes = {k: v for k, v in probes.items() if not k.startswith("FlashMLA")}
    # the public op on FlashMLA's two calls: (T, H, d) q, 3-D caches, (T, width) indices, per-request lengths
    decode = ops.sparse_attention_decode
    op_calls = {
        "swa": lambda: decode(q, sc.caches["swa"].data, sc.meta.swa_indices, None, sink=sink, scale=512 ** -0.5),
        "two scopes": lambda: decode(q, sc.caches["swa"].data, sc.meta.swa_indices, swa_len,
                                     extra_cache=sc.caches["c128a"].data, extra_indices=sc.meta.c128a_indices,
                                     extra_lens=c128_len, sink=sink, scale=512 ** -0.5, tokens_per_len=2),
    }
    for case, call in op_calls.items():
        probes[f"sparse_attention_decode ({case})"] = call

    def checked_call():
        """The two-scope call as on its signature's first sight (checked, planned, remembered): against an empty
        memo."""
        kept, memo.CALLS = memo.CALLS, OrderedDict()
        try:
            return op_calls["two scopes"]()
        finally:
            memo.CALLS = kept

    probes["sparse_attention_decode (two scopes, checked)"] = checked_call
    api = api_calls["two scopes"](ours_fm, ours_fm.get_mla_metadata()[0])[0].reshape(2 * b, h, 512).float()
    errors["sparse_attention_decode vs API (two scopes)"] = ((op_calls["two scopes"]()[0].float() - api).norm()
                                                             / api.norm()).item()
    return probes, errors


try:
    import flash_mla
except ImportError:
    flash_mla = None
probes, errors = package_probes(sparse_mla, flash_mla)
base = {}
if cli.base:
    base_probes, base_errors = package_probes(load_package(cli.base, "sparse_mla_base"), None)
    base = {name: fn for name, fn in base_probes.items() if name in probes}
    errors.update({f"base: {name}": err for name, err in base_errors.items()})
# ours and the base's copy of each probe back to back, the pair's order flipped every round (the first of a pair
# follows another probe, whose host state it may pay for)
rounds = {}
for r in range(cli.rounds):
    timed = {}
    for name, fn in probes.items():
        pair = [(name, fn)] + ([(f"base: {name}", base[name])] if name in base else [])
        timed.update(pair[::-1] if r % 2 else pair)
    for name, (us,) in zip(timed, host_samples(list(timed.values()), calls=200, rounds=1)):
        rounds.setdefault(name, []).append(us)
rounds = {name: rounds[name] for name in sorted(rounds, key=lambda n: list(probes).index(n.removeprefix("base: ")))}
result = {name: statistics.median(t) for name, t in rounds.items()}
ratios = {name: statistics.median(o / r for o, r in zip(rounds[name], rounds[f"base: {name}"])) for name in base}
for name, us in result.items():
    spread = f"{min(rounds[name]):.0f}–{max(rounds[name]):.0f}"
    ratio = f"   ours / base {ratios[name]:.3f}" if name in ratios else ""
    print(f"{name:46s} {us:8.1f} µs   (rounds {spread}){ratio}")
for name, err in errors.items():
    print(f"{name + ' rel err':46s} {err:8.2e}")
if cli.json:
    with open(cli.json, "w") as f:
        json.dump({"b": b, "base": cli.base, "host_us_median": result, "ratio_to_base": ratios, "rounds": rounds,
                   "rel_err": errors}, f, indent=1)

if cli.profile:
    import cProfile
    import pstats

    # ours, then (with --base) the base's copy of the same probe: their call trees side by side
    for name in ("c4a", "sparse_mla.flash_mla (two scopes)", "sparse_attention_decode (two scopes)",
                 "build_step_metadata"):
        for label, fn in [(name, probes[name])] + ([(f"base: {name}", base[name])] if name in base else []):
            fn()
            torch.cuda.synchronize()
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(300):
                fn()
            prof.disable()
            torch.cuda.synchronize()
            print("=====", label)
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)
