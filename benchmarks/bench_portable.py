"""The portable Triton kernel on one GPU under several targets' lowerings, against FlashMLA and the lowering's ceilings.

    python benchmarks/bench_portable.py --out results/                      # on an H100, FlashMLA wheel installed
    python benchmarks/bench_portable.py --lowerings native sm80 --parts ceilings

For each lowering (``native``: Triton's own lowering for the GPU; ``sm80``, ``sm86``, ``sm89``: the kernels lowered as
for that target and assembled for the real GPU, ``sparse_mla.ops.targets.lower_as``), one process each, in turn:

* ``step``: the V4-Flash decode step (B 32 and 128) of ``bench_step.py`` with the Gluon kernel off
  (``SPARSE_MLA_GLUON=0``: every layer through the portable kernel), FlashMLA natively in the same process;
* ``v32``: V3.2 decode, 128 heads, batch 64, s_q 1 (``bench_v32.py --parts decode``), likewise;
* ``call``: one attention call, the portable kernel alone (the issue's yardstick: a lowered call against the native
  lowering's): a c4a-like call (256 tokens x 64 heads, 128 + 512 keys, 512 dims) over bf16, fp8_v4 and fp8_e4m3
  caches, and a V3.2-like one (64 tokens x 128 heads, 2048 keys, 576 dims) over bf16 and fp8_v32 — each checked
  against the reference op (NaN-poisoned unused slots), then timed as CUDA-graph replays;
* ``ceilings``: what the same lowering reaches on the same GPU — a Triton bf16 matmul (TFLOP/s) and a Triton copy
  kernel (GB/s, bytes read + written) — so the table can say which fraction of its own lowering's ceiling the
  attention reaches (the lowering checks code paths on real silicon; it reproduces neither the other GPU's speed
  nor its shared-memory size).

The table prints last; each process's JSON lands in ``--out``.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve().parent
PARTS = ("step", "v32", "call", "ceilings")
# the call part's cases: name -> (tokens, heads, dims, [(keys per token, cache blocks of 64)] per scope, formats)
CALLS = {"c4a-like": (256, 64, 512, [(128, 256), (512, 2048)], ("bf16", "fp8_v4", "fp8_e4m3")),
         "v32-like": (64, 128, 576, [(2048, 256)], ("bf16", "fp8_v32"))}


def ceilings(lowering: str, out: pathlib.Path) -> dict:
    """Median TFLOP/s of an 8192³ bf16 Triton matmul and GB/s of a 1 GiB Triton copy under ``lowering`` (entered by
    :func:`worker`)."""
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def matmul(a, b, c, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr):
        pid = tl.program_id(0)
        grid_n = tl.cdiv(N, BN)
        per_group = GROUP * grid_n
        first_m = (pid // per_group) * GROUP
        pid_m = first_m + (pid % per_group) % GROUP
        pid_n = (pid % per_group) // GROUP
        rm = pid_m * BM + tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        acc = tl.zeros((BM, BN), tl.float32)
        for k in range(0, K, BK):
            x = tl.load(a + rm[:, None] * K + (k + rk)[None, :])
            y = tl.load(b + (k + rk)[:, None] * N + rn[None, :])
            acc = tl.dot(x, y, acc)
        tl.store(c + rm[:, None] * N + rn[None, :], acc.to(tl.bfloat16))

    @triton.jit
    def copy(src, dst, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        tl.store(dst + offs, tl.load(src + offs, mask=offs < n), mask=offs < n)

    dev = torch.device("cuda")
    size = 8192
    a = torch.randn(size, size, device=dev, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=dev, dtype=torch.bfloat16)
    c = torch.empty_like(a)
    best = 0.0
    for bm, bn, bk, warps, stages in ((128, 256, 64, 8, 3), (128, 128, 64, 4, 4), (128, 128, 32, 4, 4)):
        run = lambda: matmul[(triton.cdiv(size, bm) * triton.cdiv(size, bn),)](  # noqa: E731
            a, b, c, size, size, size, bm, bn, bk, 8, num_warps=warps, num_stages=stages)
        try:
            run()
        except Exception as err:  # a tile that does not fit this lowering: try the next
            print(f"  matmul {bm}x{bn}x{bk}: {type(err).__name__}", flush=True)
            continue
        torch.testing.assert_close(c[:256, :256].float(), (a[:256].float() @ b[:, :256].float()), rtol=2e-2, atol=1.0)
        ms = triton.testing.do_bench(run, warmup=50, rep=300, return_mode="median")
        best = max(best, 2 * size ** 3 / ms / 1e9)
    n = 1 << 29  # 1 GiB of bf16
    src = torch.randn(n, device=dev, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    block = 4096
    run = lambda: copy[(triton.cdiv(n, block),)](src, dst, n, block, num_warps=8)  # noqa: E731
    run()
    assert torch.equal(src, dst)
    ms = triton.testing.do_bench(run, warmup=50, rep=300, return_mode="median")
    result = dict(lowering=lowering, gpu=torch.cuda.get_device_name(), matmul_tflops=best,
                  copy_gbs=2 * n * 2 / ms / 1e6)
    (out / f"ceilings-{lowering}.json").write_text(json.dumps(result, indent=1))
    return result


def calls(lowering: str, out: pathlib.Path, rep: int) -> dict:
    """Each case of :data:`CALLS` through the portable kernel under ``lowering``: rel err against the reference op,
    then the median of CUDA-graph replays (µs). ``lowering`` is entered by :func:`worker`."""
    import torch

    from timing import graphed, rel, timed  # benchmarks/ is the script's directory, first on sys.path
    from sparse_mla import verify
    from sparse_mla.ops import attention_plan, sparse_attention_decode
    from sparse_mla.ops.validate import decode_args

    rows = []
    for case, (tokens, heads, dim, scopes, formats) in CALLS.items():
        for fmt in formats:
            gen = torch.Generator().manual_seed(5)
            made = [verify.random_scope(gen, fmt, dim, tokens, keys, blocks, 64, "cuda", "full")
                    for keys, blocks in scopes]
            (cache, idx, lens), extra = made[0], made[1:]
            q = torch.randn(tokens, heads, dim, generator=gen).to(torch.bfloat16).cuda()
            kw = dict(sink=verify.random_sink(gen, heads, "cuda"), scale=dim ** -0.5,
                      kv_scale=cache.kv_scale if fmt == "fp8_e4m3" else None)
            if extra:
                kw.update(extra_cache=extra[0][0].data, extra_indices=extra[0][1], extra_lens=extra[0][2])
            want = sparse_attention_decode(q, cache.data, idx, lens, backend="reference", **kw)
            args = decode_args(q, cache.data, idx, lens, **kw)
            plan = attention_plan.plan_for(args, gluon=0)
            got = attention_plan.run(args, plan=plan)
            err = max(rel(got[0], want[0]), rel(got[1], want[1]))
            if not err < 1e-2:
                raise AssertionError(f"{case} {fmt} under {lowering}: rel err {err}")
            us = timed(graphed(lambda: attention_plan.run(args, plan=plan)), rep)
            rows.append(dict(case=case, fmt=fmt, lowering=lowering, us=us, rel_err=err,
                             config=dict(plan._constants), options=dict(plan._options)))
            print(f"  {case} {fmt}: {us:.1f} us, rel err {err:.1e}", flush=True)
    result = dict(lowering=lowering, gpu=torch.cuda.get_device_name(), calls=rows)
    (out / f"call-{lowering}.json").write_text(json.dumps(result, indent=1, default=str))
    return result


def worker(part: str, lowering: str, out: pathlib.Path, rep: int) -> None:
    """A worker process's part (``ceilings`` or ``call``) under ``lowering``, entered before any kernel compiles."""
    from sparse_mla.ops import targets

    with contextlib.nullcontext() if lowering == "native" else targets.lower_as(lowering):
        if part == "ceilings":
            print(json.dumps(ceilings(lowering, out)))
        else:
            calls(lowering, out, rep)


def run_part(part: str, lowering: str, out: pathlib.Path, rep: int) -> None:
    """One part under one lowering, in a process of its own (a lowering holds for the whole process)."""
    env = dict(os.environ, SPARSE_MLA_GLUON="0", PYTHONUNBUFFERED="1")
    sub = out / f"{part}-{lowering}"
    sub.mkdir(parents=True, exist_ok=True)
    low = [] if lowering == "native" else ["--lowering", lowering]
    if part == "step":
        cmd = [sys.executable, str(HERE / "bench_step.py"), "--cases", "flash-b32", "flash-b128", "--rep", str(rep),
               "--out", str(sub), *low]
    elif part == "v32":
        cmd = [sys.executable, str(HERE / "bench_v32.py"), "--parts", "decode", "--heads", "128", "--batches", "64",
               "--s-q", "1", "--rounds", "1", "--rep", str(rep), "--out", str(sub), *low]
    else:
        cmd = [sys.executable, __file__, f"--worker-{part}", lowering, "--rep", str(rep), "--out", str(sub)]
    print(f"==> {part} under {lowering}: {' '.join(cmd)}", flush=True)
    subprocess.run(cmd, env=env, check=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lowerings", nargs="+", default=["native", "sm80", "sm89"],
                        choices=["native", "sm80", "sm86", "sm89"])
    parser.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS)
    parser.add_argument("--rep", type=int, default=40, help="do_bench repetition time per timing, ms")
    parser.add_argument("--out", default=os.environ.get("OUT", "results"))
    parser.add_argument("--worker-ceilings", help=argparse.SUPPRESS)
    parser.add_argument("--worker-call", help=argparse.SUPPRESS)
    args = parser.parse_args()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.worker_ceilings or args.worker_call:
        worker("ceilings" if args.worker_ceilings else "call", args.worker_ceilings or args.worker_call, out,
               args.rep)
        return
    for part in args.parts:
        for lowering in args.lowerings:
            run_part(part, lowering, out, args.rep)
    summary = summarise(out, args.lowerings)
    (out / "bench_portable.json").write_text(json.dumps(summary, indent=1))
    print_table(summary)


def _load(path: pathlib.Path) -> dict | None:
    return json.loads(path.read_text()) if path.exists() else None


def summarise(out: pathlib.Path, lowerings: list[str]) -> dict:
    """One row per (case, lowering) from the parts' JSON files: our time and FlashMLA's (CUDA graphs), their ratio,
    our time over the native lowering's, and the lowering's ceilings."""
    rows = []
    for lowering in lowerings:
        ceil = _load(out / f"ceilings-{lowering}" / f"ceilings-{lowering}.json") or {}
        step = _load(out / f"step-{lowering}" / "bench_step.json") or {}
        for case in step.get("decode", []):
            rows.append(dict(case=f"V4-Flash step B {case['batch']}", lowering=lowering, ours_us=case["ours_graph_us"],
                             flashmla_us=case["flashmla_graph_us"], ours_eager_us=case["ours_eager_us"],
                             flashmla_eager_us=case["flashmla_eager_us"], rel_err=max(case["rel_err"].values())))
        for call in (_load(out / f"call-{lowering}" / f"call-{lowering}.json") or {}).get("calls", []):
            rows.append(dict(case=f"one {call['case']} call, {call['fmt']}", lowering=lowering, ours_us=call["us"],
                             rel_err=call["rel_err"]))
        v32 = _load(out / f"v32-{lowering}" / "bench_v32.json") or {}
        for case in v32.get("decode", []):
            rows.append(dict(case=f"V3.2 decode h {case['heads']} B {case['batch']} s_q {case['s_q']}",
                             lowering=lowering, ours_us=case["ours_us"], flashmla_us=case.get("flashmla_us"),
                             rel_err=case["rel_err"]))
        for row in rows:
            if row["lowering"] == lowering:
                row.update(matmul_tflops=ceil.get("matmul_tflops"), copy_gbs=ceil.get("copy_gbs"))
    native = {r["case"]: r["ours_us"] for r in rows if r["lowering"] == "native"}
    for row in rows:
        row["over_native"] = row["ours_us"] / native[row["case"]] if row["case"] in native else None
        row["ratio"] = row["ours_us"] / row["flashmla_us"] if row.get("flashmla_us") else None
    return dict(rows=rows)


def print_table(summary: dict) -> None:
    print("| case | lowering | ours (us) | FlashMLA native (us) | ours / FlashMLA | ours / native lowering | "
          "matmul ceiling (TFLOP/s) | copy ceiling (GB/s) |")
    print("|---|---|---|---|---|---|---|---|")
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    for r in summary["rows"]:
        print(f"| {r['case']} | {r['lowering']} | {r['ours_us']:.0f} | {fmt(r.get('flashmla_us'), '.0f')} | "
              f"{fmt(r['ratio'], '.2f')} | {fmt(r['over_native'], '.2f')} | {fmt(r.get('matmul_tflops'), '.0f')} | "
              f"{fmt(r.get('copy_gbs'), '.0f')} |")


if __name__ == "__main__":
    main()
