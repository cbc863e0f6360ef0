"""Prefill benchmark on a CUDA GPU (issue 5): three parts, one table each, JSON to --out.

    python benchmarks/bench_prefill.py --out results/

1. Workspace prefill (bf16 kv, FlashMLA's four anchor cases): our Triton kernel vs
   ``flash_mla.flash_mla_sparse_fwd`` on the same inputs, both checked against the reference first.
2. Layer level: a 16K-token prompt prefilled 4096 tokens at a time into a C4A and a C128A layer
   over fp8_v4 caches, (a) gather into a bf16 workspace + workspace prefill vs (b) paged-direct:
   time and peak extra memory.
3. Step metadata: building the step's index lists (once per step; Triton builders on a GPU), the
   C4A pick conversion (once per c4a layer) and the insert kernel (once per layer), for a 148-request
   decode step and a 4096-token prefill chunk, against the attention time of all the step's layers.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton
from common import parse_sweep
from timing import graphed, load_flash_mla, rel, timed, timed_pair, warm_up_gpu

from sparse_mla.config import get_config
from sparse_mla.layer import SparseMLAAttention
from sparse_mla.metadata import build_step_metadata
from sparse_mla.ops import attention_plan, quantize_and_insert, sparse_attention_prefill
from sparse_mla.ops.validate import prefill_args
from sparse_mla.scenario import make_scenario

D = 512


def workspace_cases(flash_mla, rep, configs, heads=(64, 128), topks=(640, 1152)):
    gen = torch.Generator(device="cuda").manual_seed(1)
    rows = []
    for h in heads:
        for topk in topks:
            s_q, s_kv = 4096, 32768
            q = (torch.randn(s_q, h, D, generator=gen, device="cuda") / 10).to(torch.bfloat16)
            kv = (torch.randn(s_kv, D, generator=gen, device="cuda") / 10).to(torch.bfloat16)
            idx = torch.rand(s_q, s_kv, generator=gen, device="cuda").topk(topk, -1).indices.int()
            sink = torch.randn(h, generator=gen, device="cuda")
            scale = D ** -0.5
            args = prefill_args(q, kv, idx, None, sink, scale, check_ranges=False)
            sub = slice(0, 256)
            ref = sparse_attention_prefill(q[sub], kv, idx[sub], None, sink=sink, scale=scale, backend="reference")[0]
            sweep = {}
            for cfg in configs:
                ours = lambda cfg=cfg: attention_plan.run(args, **cfg)
                out = ours()[0]
                err = rel(out[sub], ref)
                assert err < 1e-2 and not out.isnan().any(), f"ours wrong at h {h} topk {topk} {cfg}: {err}"
                sweep[json.dumps(cfg)] = timed(ours, rep)
                print(f"  h {h} topk {topk} {cfg}: {sweep[json.dumps(cfg)]:.0f} us", flush=True)
            best_cfg = min(sweep, key=sweep.get)
            best = lambda: attention_plan.run(args, **json.loads(best_cfg))
            out = best()[0]
            row = dict(h=h, topk=topk, ours_err=rel(out[sub], ref), ours_us=sweep[best_cfg], cfg=best_cfg,
                       sweep=sweep)
            if flash_mla is not None:
                fm = lambda: flash_mla.flash_mla_sparse_fwd(q, kv.view(s_kv, 1, D), idx.view(s_q, 1, topk), scale, 512,
                                                            sink, None, use_legacy=True)
                fout = fm()[0]
                row.update(flashmla_err=rel(fout[sub], ref), ours_vs_flashmla=rel(out, fout))
                row["ours_us"], row["flashmla_us"] = timed_pair(best, fm, rep)  # replaces the sweep's time
                row["ratio"] = row["ours_us"] / row["flashmla_us"]
            row["tflops"] = 2 * s_q * topk * h * (D + D) / (row["ours_us"] * 1e-6) / 1e12
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def layer_cases(rep):
    rows = []
    num_heads, chunk, prompt = 64, 4096, 16384
    for kind in ("c4a", "c128a"):
        for done in range(0, prompt, chunk):
            sc = make_scenario([(done + chunk, chunk)], window=128, topk=512, fmt="fp8_v4", seed=done,
                               device="cuda")
            q = (torch.randn(chunk, num_heads, D, device="cuda") * 0.5).to(torch.bfloat16)
            sink = torch.randn(num_heads, device="cuda")
            picks = sc.topk_local if kind == "c4a" else None
            row = dict(kind=kind, prefix=done, tokens=chunk)
            outs = {}
            for mode in ("workspace", "paged"):
                layer = SparseMLAAttention(kind, num_heads, topk=512 if kind == "c4a" else None, sink=sink,
                                           prefill_mode=mode)
                run = lambda: layer(q, sc.meta, sc.caches, picks)
                outs[mode] = run()
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                run()
                torch.cuda.synchronize()
                row[f"{mode}_extra_mb"] = (torch.cuda.max_memory_allocated() - base) / 2**20
                row[f"{mode}_us"] = timed(run, rep)
            row["paged_vs_workspace_err"] = rel(outs["paged"], outs["workspace"])
            rows.append(row)
            print(json.dumps(row), flush=True)
            del sc
            torch.cuda.empty_cache()
    return rows


def _step_metadata_work(b, m, sc, kv_new, kinds):
    """A step's metadata work: the build once, the C4A conversion per c4a layer, an insert per layer."""
    build_step_metadata(b, m.spec, out=m)
    for kind in kinds:
        if kind == "c4a":
            m.c4a_indices(sc.topk_local)
        quantize_and_insert(kv_new, sc.caches["swa"].data, b.slot_mapping)


def _graph_time(work, rep):
    """GPU time (us) of ``work`` captured in one CUDA graph, as an engine replays a decode step; None if
    it cannot be captured."""
    try:
        replay = graphed(work)
    except RuntimeError as err:
        print(f"metadata work is not capturable in a CUDA graph: {err}", file=sys.stderr)
        return None
    return timed(replay, rep)


def metadata_cases(rep):
    """Per-step and per-layer costs of a DeepSeek-V4-Flash step (layer kinds from the preset)."""
    cfg = get_config("deepseek-v4-flash")
    kinds = [cfg.layer_kind(i) for i in range(cfg.num_layers)]
    rows = []
    for name, lengths in (("decode 148 x 2 tokens", [(8192, 2)] * 148), ("prefill chunk 4096", [(16384, 4096)])):
        sc = make_scenario(lengths, window=128, topk=512, fmt="fp8_v4", decode_threshold=2, seed=3, device="cuda")
        b, m = sc.batch, sc.meta
        kv_new = torch.randn(b.token_capacity, D, device="cuda").to(torch.bfloat16)
        q = torch.randn(b.token_capacity, cfg.num_heads, D, device="cuda").to(torch.bfloat16)
        sink = torch.zeros(cfg.num_heads, device="cuda")
        attention = {}
        for kind in ("swa", "c4a", "c128a"):
            layer = SparseMLAAttention(kind, cfg.num_heads, topk=512 if kind == "c4a" else None, sink=sink)
            picks = sc.topk_local if kind == "c4a" else None
            attention[kind] = timed(lambda: layer(q, m, sc.caches, picks), rep)
        row = dict(step=name, tokens=b.token_capacity,
                   build_us=timed(lambda: build_step_metadata(b, m.spec, out=m), rep),  # once per step
                   c4a_convert_us=timed(lambda: m.c4a_indices(sc.topk_local), rep),  # once per c4a layer
                   insert_us=timed(lambda: quantize_and_insert(kv_new, sc.caches["swa"].data, b.slot_mapping), rep),
                   **{f"{k}_attention_us": v for k, v in attention.items()})
        overhead = row["build_us"] + kinds.count("c4a") * row["c4a_convert_us"] + len(kinds) * row["insert_us"]
        attention_total = sum(attention[k] for k in kinds)
        row["share"] = overhead / attention_total
        row["graph_step_us"] = _graph_time(lambda: _step_metadata_work(b, m, sc, kv_new, kinds), rep)
        row["graph_share"] = row["graph_step_us"] / attention_total if row["graph_step_us"] else None
        rows.append(row)
        print(json.dumps(row), flush=True)
        del sc
        torch.cuda.empty_cache()
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", nargs="+", default=["workspace", "layer", "metadata"])
    ap.add_argument("--rep", type=int, default=100, help="do_bench repetition time per timing, ms")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--sweep", default="", help="workspace part: semicolon-separated launch configs, e.g. 'gluon=0'")
    ap.add_argument("--heads", type=int, nargs="+", default=[64, 128], help="workspace part: h_q values")
    ap.add_argument("--topks", type=int, nargs="+", default=[640, 1152], help="workspace part: keys per token")
    args = ap.parse_args()
    flash_mla = load_flash_mla()
    warm_up_gpu()
    result = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__)
    os.makedirs(args.out, exist_ok=True)
    parts = dict(workspace=lambda: workspace_cases(flash_mla, args.rep, parse_sweep(args.sweep), args.heads, args.topks),
                 layer=lambda: layer_cases(args.rep), metadata=lambda: metadata_cases(args.rep))
    for part in args.parts:
        result[part] = parts[part]()
        with open(os.path.join(args.out, "bench_prefill.json"), "w") as f:  # after each part: keep what ran
            json.dump(result, f, indent=1)
    from rich.console import Console
    from rich.table import Table

    con = Console(width=150)
    if "workspace" in result:
        t = Table(title="workspace prefill, s_q 4096, bf16 kv")
        for c in ("h_q", "keys", "ours us", "FlashMLA us", "ours/FM", "TFLOP/s", "err vs ref", "err vs FM"):
            t.add_column(c, justify="right")
        for r in result["workspace"]:
            fm = r.get("flashmla_us")
            t.add_row(str(r["h"]), str(r["topk"]), f"{r['ours_us']:.0f}", f"{fm:.0f}" if fm else "-",
                      f"{r['ratio']:.2f}" if fm else "-", f"{r['tflops']:.0f}", f"{r['ours_err']:.1e}",
                      f"{r['ours_vs_flashmla']:.1e}" if fm else "-")
        con.print(t)
    if "layer" in result:
        t = Table(title="layer prefill, 16K prompt in 4096-token chunks, fp8_v4, h_q 64")
        for c in ("kind", "prefix", "workspace us", "workspace extra MB", "paged us", "paged extra MB", "diff"):
            t.add_column(c, justify="right")
        for r in result["layer"]:
            t.add_row(r["kind"], str(r["prefix"]), f"{r['workspace_us']:.0f}", f"{r['workspace_extra_mb']:.0f}",
                      f"{r['paged_us']:.0f}", f"{r['paged_extra_mb']:.0f}", f"{r['paged_vs_workspace_err']:.1e}")
        con.print(t)
    if "metadata" in result:
        t = Table(title="metadata + insert vs attention, one DeepSeek-V4-Flash step (all layers)")
        for c in ("step", "tokens", "build us", "c4a convert us", "insert us", "swa / c4a / c128a attention us",
                  "share", "graph us", "graph share"):
            t.add_column(c, justify="right")
        for r in result["metadata"]:
            t.add_row(r["step"], str(r["tokens"]), f"{r['build_us']:.1f}", f"{r['c4a_convert_us']:.1f}",
                      f"{r['insert_us']:.1f}", f"{r['swa_attention_us']:.0f} / {r['c4a_attention_us']:.0f} / "
                      f"{r['c128a_attention_us']:.0f}", f"{100 * r['share']:.1f} %",
                      f"{r['graph_step_us']:.0f}" if r["graph_step_us"] else "-",
                      f"{100 * r['graph_share']:.1f} %" if r["graph_share"] else "-")
        con.print(t)


if __name__ == "__main__":
    main()
