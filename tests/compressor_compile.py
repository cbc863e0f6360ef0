"""The sparse-index pipeline's launches, recorded on CPU tensors for one target: the compressor kernels (cross-compiled
by tests/test_compressor_portability.py in a child process: compiling needs the interpreter off) and the indexer's
(:func:`indexer_launches`, tests/test_indexer_triton.py); ``scripts/portability_report.py --variants pipeline``
compiles both.

    python tests/compressor_compile.py --target sm_80

Prints one JSON row per compressor launch (``scripts/portability_report.py``'s ``Row``). The launches are the
library's own: the compressor of each V4 / V4.1 case (V4-Flash's c4a and its indexer, c128a; V4.1's c2a and c1a; bf16
projections), its state update, and the indexer key insert (fp8 and bf16, with and without the rope).
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
from dataclasses import asdict

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

from portability_report import compile_launch, recorded_launches  # noqa: E402  (sets TRITON_INTERPRET=0 first)

import torch  # noqa: E402

from compress_feed import Feeder, make_params  # noqa: E402
from indexer_cases import capped_select_variant, capped_selects  # noqa: E402
from sparse_mla.compressor import KVCompressor  # noqa: E402
from sparse_mla.indexer import StepTokens  # noqa: E402
from sparse_mla.indexer_cache import IndexerKeyCache  # noqa: E402
from sparse_mla.ops import targets  # noqa: E402
from sparse_mla.ops.triton import compress, index_cache, indexer  # noqa: E402

CASES = [(4, 512), (4, 128), (128, 512), (2, 512), (1, 512)]


def launches(target: targets.Target) -> list[tuple[str, list]]:
    out = []
    for ratio, dim in CASES:
        feeder = Feeder([300, 5], ratio, dtype=torch.bfloat16)
        weight, ape = make_params(ratio, dim)
        comp = KVCompressor(feeder.pool, dim, weight, 1e-6, ape=ape, backend="reference")
        _, _, meta = feeder.step([(0, 300), (1, 5)])
        kv = torch.zeros(305, comp.width, dtype=torch.bfloat16)
        latent = torch.zeros(305, dim, dtype=torch.bfloat16)
        with recorded_launches(target) as calls:
            compress.compress(kv, None if ratio == 1 else kv.clone(), comp.ape, comp.norm_weight, comp.eps,
                              comp.inv_freq, meta, feeder.pool.layers[comp.layer], latent, latent.clone())
        out.append((f"compress r{ratio} d{dim}", calls))
    for fp8 in (True, False):
        data = torch.zeros(4, 64, 132 if fp8 else 128, dtype=torch.uint8 if fp8 else torch.bfloat16)
        keys, slots = torch.zeros(16, 128, dtype=torch.bfloat16), torch.zeros(16, dtype=torch.int32)
        for rope in (False, True):
            with recorded_launches(target) as calls:
                index_cache.insert_index_keys(keys, data, fp8, slots, slots if rope else None,
                                              torch.ones(32) if rope else None)
            out.append((f"index keys {'fp8' if fp8 else 'bf16'}{' rope' if rope else ''}", calls))
    return out


def indexer_launches(target: targets.Target, every: bool = True) -> list[tuple[str, list]]:
    """The indexer kernels' launches: the scores over fp8 keys (decode, 64 heads), with ``every`` also bf16 keys and a
    32-head prefill, each as packed keys (V4.1's two-level calls, rows of segments) and as words (the calls whose
    select takes rows whole, ``SparseMLAIndexer.scores_as_words``); where the target converts fp8, e4m3 q against the
    fp8 codes (the layer's dot there), elsewhere float16 q against their integer decode (the float16 dot), packed and
    as words; the query prep (V4, with ``every`` V3.2's half-split rope); the select over packed keys (two launches:
    512 of 32768, then of 2048), the first of 65,536 words, V3.2's few rows of 32,768 words converted (whole where
    ``select_takes_whole``, else the last launch), the last pass over segments' winners of more rows than two an SM,
    and, over packed keys and over words, a row of 9,216 in two
    tiles and the V4 decode's 8,192 converted in its launch; and :func:`capped_selects`."""
    out = []
    # the page loop as a decode runs it: 16 pages a program (the e4m3 dot's: 32, as on sm_90), pipelined (a recorded
    # call of a few pages would compile the loop of one page, which the pipeliner leaves alone: too few registers to
    # show the real loop's spills)
    pipelined = (indexer.MAX_PAGES_PER_PROGRAM, indexer.SCORE_WARPS, indexer.SCORE_STAGES)
    scores = [(fmt, heads, qlen, torch.bfloat16, pipelined, f"indexer {fmt} H{heads} q{qlen}")
              for fmt, heads, qlen in (("fp8", 64, 2), ("bf16", 64, 2), ("fp8", 32, 512))[: 3 if every else 1]]
    if target.native_fp8:
        scores.append(("fp8", 64, 2, torch.float8_e4m3fn, (indexer.WAVE_MAX_PAGES,) + pipelined[1:],
                       "indexer fp8 dot H64 q2"))
    else:  # fp8 q against the fp8 keys' integer decode: the float16 dot
        scores.append(("fp8", 64, 2, torch.float16, pipelined, "indexer fp8 f16 dot H64 q2"))
    for fmt, heads, qlen, dot, launch, name in scores:
        cache = IndexerKeyCache(4, fmt)
        step = StepTokens(torch.zeros(qlen, dtype=torch.int32), torch.zeros(qlen, dtype=torch.int32),
                          torch.tensor([0, qlen], dtype=torch.int32), torch.zeros(1, 4, dtype=torch.int32), 4)
        for rows, form in ((torch.int64, ""), (torch.int32, " words")):
            with recorded_launches(target) as calls:
                indexer.index_scores(torch.zeros(qlen, heads, 128, dtype=dot), torch.zeros(qlen, heads), cache, step,
                                     torch.empty(qlen, 512, dtype=rows), 0, qlen, qlen, dot, target.native_fp8,
                                     launch=launch)
            out.append((name + form, calls))
    for half_split in (False, True)[: 2 if every else 1]:
        q, trig = torch.zeros(2, 64, 128, dtype=torch.bfloat16), torch.zeros(2, 32)
        # the prepared queries in the dot's dtype: bf16 everywhere, e4m3 (the conversion instruction) where the dot is,
        # float16 (fp8 q's e4m3 values) where the target converts no e4m3
        for q_dtype in (torch.bfloat16, torch.float8_e4m3fn if target.native_fp8 else torch.float16):
            q_out = torch.zeros(2, 64, 128, dtype=q_dtype)
            with recorded_launches(target) as calls:
                indexer.prepare_queries(q, torch.zeros(2, 64), trig, trig, half_split, True, 0.01, q_out,
                                        torch.zeros(2, 64))
            out.append((f"indexer q prep {'V3.2' if half_split else 'V4'} into {str(q_dtype)[6:]}", calls))
    def into(rows: int, k: int) -> indexer.PicksInto:
        """The step's conversion buffers, as the indexer layer hands them to its select."""
        z = torch.zeros(rows, dtype=torch.int32)
        return indexer.PicksInto(z, z, torch.zeros(rows, 16, dtype=torch.int32), 64,
                                 torch.zeros(rows, k, dtype=torch.int32), z.clone(),
                                 torch.zeros(rows, k, dtype=torch.int32), rows)

    packed = torch.zeros(4, 32768, dtype=torch.int64)  # four segments' keys, then the row's entries (converted)
    with recorded_launches(target) as calls:
        indexer.topk_rows(packed, 512, torch.zeros(4, 512, dtype=torch.int32), into(4, 512))
    out += [(f"indexer select 512 of {n}", [c]) for n, c in zip((32768, "2048 into slots"), calls)]
    with recorded_launches(target) as calls:  # a row of words in segments: the first pass packs its winners' keys
        indexer.topk_rows(torch.zeros(4, 65536, dtype=torch.int32), 512, torch.zeros(4, 512, dtype=torch.int32))
    out.append(("indexer select 512 of 65536 words", calls[:1]))
    with recorded_launches(target) as calls:  # V3.2's few rows of words: whole where select_takes_whole, else the
        indexer.topk_rows(torch.zeros(4, 32768, dtype=torch.int32), 512,  # segments' winners (as above)
                          torch.zeros(4, 512, dtype=torch.int32), into(4, 512))
    out.append(("indexer select 512 of 32768 words into slots", calls[-1:]))
    rows = 2 * target.sms + 1  # the segments' winners (4 x 2,048) over more rows than two an SM: capped where by digits
    with recorded_launches(target) as calls:
        indexer.topk_rows(torch.zeros(rows, 32768, dtype=torch.int32), 2048, torch.zeros(rows, 2048, dtype=torch.int32))
    out.append((f"indexer select 2048 of 8192 winners, {rows} rows", calls[-1:]))
    for rows, words in ((torch.int64, ""), (torch.int32, " words")):
        with recorded_launches(target) as calls:  # a row in two tiles: 8,192 + 1,024
            indexer.topk_rows(torch.zeros(4, 9216, dtype=rows), 512, torch.zeros(4, 512, dtype=torch.int32))
        out.append((f"indexer select 512 of 9216{words}", calls))
        with recorded_launches(target) as calls:  # the V4 decode's rows, converted in the select's launch
            indexer.topk_rows(torch.zeros(4, 8192, dtype=rows), 512, torch.zeros(4, 512, dtype=torch.int32),
                              into(4, 512))
        out.append((f"indexer select 512 of 8192{words} into slots", calls))
    for cols, rows in capped_selects(target):
        with recorded_launches(target) as calls:
            indexer.topk_rows(torch.zeros(rows, cols, dtype=torch.int32), 512,
                              torch.zeros(rows, 512, dtype=torch.int32), into(rows, 512))
        out.append((capped_select_variant(cols, rows), calls))
    return out


def fused_multiply_adds(target: targets.Target) -> dict[str, int]:
    """The float32 fused multiply-adds (``fma.rn.f32``) in the PTX of the indexer's decode score launch and its V4
    query prep, compiled for ``target`` (CUDA) under the environment's ``TRITON_DEFAULT_FP_FUSION``."""
    import triton

    from portability_report import _source

    wanted = {"indexer fp8 H64 q2": "scores", "indexer q prep V4 into bfloat16": "prep"}
    counts = {}
    for variant, calls in indexer_launches(target, every=False):
        if variant in wanted:
            source, options = _source(calls[0], target)
            ptx = triton.compile(source, target=target.gpu_target(), options=options).asm["ptx"]
            counts[wanted[variant]] = ptx.count("fma.rn.f32")
    return counts


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", required=True, choices=[t.name for t in targets.MATRIX])
    parser.add_argument("--fma", action="store_true", help="print the indexer kernels' fused multiply-adds instead")
    args = parser.parse_args()
    target = next(t for t in targets.MATRIX if t.name == args.target)
    if args.fma:
        print(json.dumps(fused_multiply_adds(target)))
        return
    for variant, calls in launches(target):
        for launched in calls:
            print(json.dumps(asdict(compile_launch(target, variant, launched))), flush=True)


if __name__ == "__main__":
    main()
