"""The indexer's Triton kernels (Triton's interpreter on the CPU, natively on a GPU) against the reference: the same
picks on NaN-poisoned caches (fp8 and bf16 keys, 8-64 heads, decode and prefill, blocks missing or past the cache),
the layer's chunking to its workspace, V4.1's two-level selection on packed scores, a decode step captured in a CUDA
graph (GPU), and the kernels compiled for every target of the portability matrix (on this CPU, no GPU).

Run as a script (``python tests/test_indexer_triton.py TARGET``) it prints the compile rows of one target as JSON.
"""
from __future__ import annotations

import json
import os
import pathlib
import re
import sys

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

sys.path.insert(0, os.path.dirname(__file__))
from helpers import DEVICE, KERNEL_RUNS, ON_GPU, compile_child, needs, sized  # noqa: E402
from indexer_cases import (capped_select_variant, capped_selects, check_picks, layer_step, make_case,  # noqa: E402
                           packed_rows, write_step_keys)
from sparse_mla.indexer import (MAX_SELECT_COLS, SELECT_SEGMENT, IndexerSpec, StepTokens, index_topk_reference,  # noqa: E402
                                prepare_queries, top_blocks_reference)
from sparse_mla.indexer_cache import IndexerKeyCache  # noqa: E402
from sparse_mla.indexer_layer import SparseMLAIndexer  # noqa: E402
from sparse_mla.ops import targets  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
needs_kernels = pytest.mark.skipif(not KERNEL_RUNS, reason="needs a GPU or TRITON_INTERPRET=1")
needs_gpu = needs("gpu")


def words_of(packed: torch.Tensor) -> torch.Tensor:
    """The score kernel's words of packed keys, computed apart from it: the high word with its sign bit flipped (an
    unsigned order), 0 for ``INT64_MIN``, a candidate's at least 1; int32 bits."""
    high = (packed >> 32) + 2 ** 31  # int64: the high word's unsigned order, 0 .. 2^32 - 1
    word = torch.where(packed == torch.iinfo(torch.int64).min, 0, high.clamp_min(1))
    return torch.where(word >= 2 ** 31, word - 2 ** 32, word).to(torch.int32)


def scores_of_words(words: torch.Tensor) -> torch.Tensor:
    """The float32 scores the score kernel's words order (:func:`words_of`'s inverse, up to the clamp to 1); NaN for
    0 (no candidate)."""
    u = words.to(torch.int64) % 2 ** 32  # the unsigned order
    bits = torch.where(u >= 2 ** 31, u - 2 ** 31, 2 ** 32 - 1 - u)  # a non-negative score's bits, else ~bits
    scores = torch.where(bits >= 2 ** 31, bits - 2 ** 32, bits).to(torch.int32).view(torch.float32)
    return torch.where(words == 0, float("nan"), scores)


def kernel_picks(case, topk: int, kept=None, select=False, rows=None, num_kept=2048, words=False):
    """Picks through the kernels: packed scores of every token (``rows`` tokens per launch), then the select
    (``words``: the score kernel's words, then the Triton select)."""
    from sparse_mla.ops.triton import indexer as kernels

    target = targets.target_of(case.cache.device)
    native = target.native_fp8
    dot = kernels.dot_dtype_for(target, case.cache.fmt, case.spec.q_format)
    step = case.step
    most = max(int(p) + 1 for p in step.positions.tolist()) // step.ratio
    cols = max(-(-most // 64) * 64, topk)
    rows = rows or case.num_tokens
    picks = torch.full((case.q.shape[0], topk), -1, dtype=torch.int32, device=DEVICE)
    blocks = torch.full((case.q.shape[0], num_kept), -1, dtype=torch.int32, device=DEVICE)
    qsl = step.query_start_loc.tolist()
    for t0 in range(0, case.num_tokens, rows):
        t1 = min(case.num_tokens, t0 + rows)
        longest = max(min(qsl[r + 1], t1) - max(qsl[r], t0) for r in range(len(qsl) - 1))
        packed = torch.empty(t1 - t0, cols, dtype=torch.int32 if words else torch.int64, device=DEVICE)
        kernels.index_scores(case.q.to(dot), case.w, case.cache, step, packed, t0, t1, max(1, longest), dot, native)
        if words:
            kernels.topk_rows(packed, topk, picks[t0:t1])
            continue
        if select:
            blocks[t0:t1] = kernels.top_blocks_from_packed(packed, step.positions[t0:t1], step.ratio, num_kept)
            kernels.restrict_to_blocks(packed, blocks[t0:t1])
        elif kept is not None:
            kernels.restrict_to_blocks(packed, kept[t0:t1])
        picks[t0:t1] = kernels.topk_from_packed(packed, topk)
    return picks, blocks


def same_sets(got: torch.Tensor, want: torch.Tensor, rows: int) -> None:
    """Row for row the same picks (as sets: the two sum in other orders, so exact ties may list in either order)."""
    got, want = got[:rows].sort(1).values.cpu(), want[:rows].sort(1).values.cpu()
    bad = (got != want).any(1).nonzero().flatten().tolist()
    assert not bad, f"rows {bad[:8]} differ"


CASES = [  # (kind, heads, topk, key format, q format, requests (seq_len, query_len), decodes first)
    ("c4a", 64, 64, "fp8", "fp8", [(1100, 2), (700, 2), (260, 1)]),
    ("c4a", 12, 64, "bf16", "bf16", [(900, 1), (500, 7)]),
    ("c2a", 32, 128, "fp8", "fp8", [(600, 2), (333, 9)]),
    ("dsa", 8, 128, "fp8", "bf16", [(300, 1), (200, 13)]),
]


@needs_kernels
@pytest.mark.parametrize("kind,heads,topk,fmt,q_format,requests", CASES)
def test_kernel_picks_equal_the_reference_on_poisoned_caches(kind, heads, topk, fmt, q_format, requests):
    spec = IndexerSpec(num_heads=heads, topk=topk, kind=kind, q_format=q_format)
    gen = torch.Generator().manual_seed(heads + topk)
    scale = sized(1, 8)
    case = make_case(gen, [(s * scale, q) for s, q in requests], spec, fmt, DEVICE, bad_block=True)
    case.step.block_table[0, 1] = -1  # a missing page: its entries are not candidates, never read
    ref = index_topk_reference(case.q, case.w, case.cache, case.step, topk)
    got, _ = kernel_picks(case, topk)
    check_picks(got, ref, case.q, case.w, case.cache, case.step, case.num_tokens)
    got, _ = kernel_picks(case, topk, rows=3)  # three tokens per launch: chunks that split requests
    check_picks(got, ref, case.q, case.w, case.cache, case.step, case.num_tokens)
    got, _ = kernel_picks(case, topk, rows=3, words=True)  # scored as words, the Triton select on them
    check_picks(got, ref, case.q, case.w, case.cache, case.step, case.num_tokens)


@needs_kernels
@pytest.mark.parametrize("kind,heads", [("c4a", 64), ("c2a", 12)])
def test_the_float16_dot_scores_fp8_keys_as_the_float32_dot_does(kind, heads):
    """Where the target converts no e4m3 (sm_80 / sm_86, CDNA 3), fp8 keys and fp8 q meet in a float16 dot: the
    keys' integer decode as it is, q's e4m3 values in float16. Every operand and product is exact, so its words equal
    the float32 dot's bit for bit in the interpreter; on a GPU the bf16 dot's scores within float32 rounding (the
    tensor cores' float32 accumulation is not the same for float16 and bf16 operands: 2-ulp differences seen under
    the sm_80 lowering on an H200). The float16 dot refuses bf16 keys, a native decode and q of another dtype."""
    from sparse_mla.ops.triton import indexer as kernels

    spec = IndexerSpec(num_heads=heads, topk=64, kind=kind, q_format="fp8")
    case = make_case(torch.Generator().manual_seed(heads + 16), [(700, 2), (300, 5)], spec, "fp8", DEVICE,
                     bad_block=True)
    n, cols = case.num_tokens, 768
    want = torch.zeros(n, cols, dtype=torch.int32, device=DEVICE)
    exact = torch.bfloat16 if ON_GPU else torch.float32
    kernels.index_scores(case.q.to(exact), case.w, case.cache, case.step, want, 0, n, 5, exact, False)
    got = torch.full((n, cols), 5, dtype=torch.int32, device=DEVICE)
    kernels.index_scores(case.q.to(torch.float16), case.w, case.cache, case.step, got, 0, n, 5, torch.float16, False)
    got, want = got.cpu(), want.cpu()
    assert torch.equal(got == 0, want == 0) and (got != 0).any()
    if ON_GPU:
        got_s, want_s = scores_of_words(got), scores_of_words(want)
        scale = want_s.abs().nan_to_num().amax(1, keepdim=True)  # a row's scores, summed in float32 over its heads
        assert ((got_s - want_s).abs() <= 1e-5 * scale).logical_or(want == 0).all()
    else:
        assert torch.equal(got, want)
    out = torch.zeros(n, cols, dtype=torch.int32, device=DEVICE)  # (got is on the host now: out must be on DEVICE)
    with pytest.raises(ValueError, match="float16 dot"):
        kernels.index_scores(case.q.to(torch.float16), case.w, case.cache, case.step, out, 0, n, 5, torch.float16,
                             True)
    with pytest.raises(ValueError, match="float16 dot"):
        kernels.index_scores(case.q.to(torch.bfloat16), case.w, case.cache, case.step, out, 0, n, 5, torch.float16,
                             False)


@needs_kernels
@pytest.mark.parametrize("chained", [False, True])
@pytest.mark.parametrize("kind,heads,fmt,q_format", [("c4a", 64, "fp8", "fp8"), ("c2a", 32, "fp8", "fp8"),
                                                     ("c4a", 12, "bf16", "bf16"), ("dsa", 8, "fp8", "bf16"),
                                                     ("c4a", 3, "fp8", "fp8"), ("c4a", 100, "fp8", "fp8")])
def test_either_head_sum_picks_the_reference_s_keys(chained, kind, heads, fmt, q_format, monkeypatch):
    """The score kernel's weighted head sum in chains of fused multiply-adds or by ``tl.sum`` (``heads_chained``
    forced either way): the picks of each equal the reference's, over 128, 64, 32, 16, 8 and 4 padded heads (under
    8, the sum)."""
    from sparse_mla.ops.triton import indexer as kernels

    monkeypatch.setattr(kernels, "heads_chained", lambda target: chained)
    spec = IndexerSpec(num_heads=heads, topk=64, kind=kind, q_format=q_format)
    case = make_case(torch.Generator().manual_seed(heads + chained), [(600, 2), (250, 3)], spec, fmt, DEVICE,
                     bad_block=True)
    ref = index_topk_reference(case.q, case.w, case.cache, case.step, 64)
    got, _ = kernel_picks(case, 64, words=True)
    check_picks(got, ref, case.q, case.w, case.cache, case.step, case.num_tokens)


@pytest.mark.parametrize("tree", [False, True])
def test_the_head_sum_is_chained_on_mma_sync_and_on_wgmma_where_tl_sum_is_a_tree(tree, monkeypatch):
    from sparse_mla.ops.triton import indexer as kernels

    monkeypatch.setattr(kernels, "SUM_BY_TREE", tree)
    chained = {t.name for t in targets.MATRIX if kernels.heads_chained(t)}
    assert chained == {"sm_80", "sm_86", "sm_89", "sm_120"} | ({"sm_90"} if tree else set())


@needs_kernels
@pytest.mark.parametrize("kind,heads,fmt,q_format", [("c4a", 64, "fp8", "fp8"), ("dsa", 8, "bf16", "bf16")])
def test_the_score_kernel_s_words_are_its_packed_keys_order_bits(kind, heads, fmt, q_format):
    """The words a score launch writes equal those of the packed keys it writes, bit for bit: the order bits, 0 for
    every non-candidate (a missing page, entries the token does not see), the entry being the column."""
    from sparse_mla.ops.triton import indexer as kernels

    spec = IndexerSpec(num_heads=heads, topk=64, kind=kind, q_format=q_format)
    case = make_case(torch.Generator().manual_seed(heads), [(700, 2), (300, 5)], spec, fmt, DEVICE, bad_block=True)
    case.step.block_table[0, 1] = -1
    target = targets.target_of(case.cache.device)
    dot = kernels.dot_dtype_for(target, fmt, q_format)
    n, cols = case.num_tokens, 768
    packed = torch.full((n, cols), 5, dtype=torch.int64, device=DEVICE)
    words = torch.full((n, cols), 5, dtype=torch.int32, device=DEVICE)
    for out in (packed, words):
        kernels.index_scores(case.q.to(dot), case.w, case.cache, case.step, out, 0, n, 5, dot, target.native_fp8)
    assert torch.equal(words.cpu(), words_of(packed).cpu())
    assert (words == 0).any() and (words != 0).any()


@needs_kernels
@pytest.mark.parametrize("kind,heads,q_format", [("c4a", 64, "fp8"), ("c2a", 12, "fp8"), ("dsa", 8, "fp8"),
                                                 ("c4a", 32, "bf16"), ("dsa", 5, "bf16")])
def test_query_prep_kernel_equals_the_reference_bit_for_bit(kind, heads, q_format):
    from sparse_mla.ops.triton import indexer as kernels

    spec = IndexerSpec(num_heads=heads, topk=64, kind=kind, q_format=q_format)
    gen = torch.Generator().manual_seed(heads)
    t = 37
    q = (torch.randn(t, heads, 128, generator=gen) * torch.rand(t, heads, 1, generator=gen) * 30).to(DEVICE)
    q[3, 0] = 0.0  # a zero head: the amax floor
    q[5, :, :9] *= 1e-5  # values that round to e4m3 subnormals (and to zero)
    q = q.to(torch.bfloat16)
    w = torch.randn(t, heads, generator=gen).to(DEVICE)
    positions = torch.randint(-1, 300000, (t,), generator=gen, dtype=torch.int32).to(DEVICE)
    want_q, want_w = prepare_queries(q, w, positions, spec)
    angles = positions.clamp_min(0).float()[:, None] * spec.rope_spec.inv_freq(DEVICE)
    dot = torch.bfloat16 if ON_GPU else torch.float32
    got_q = torch.empty(t, heads, 128, dtype=dot, device=DEVICE)
    got_w = torch.empty(t, heads, device=DEVICE)
    kernels.prepare_queries(q, w, angles.cos(), angles.sin(), kind == "dsa", q_format == "fp8", spec.weight_scale,
                            got_q, got_w)
    assert torch.equal(got_q.float(), want_q) and torch.equal(got_w, want_w)
    if q_format == "fp8" and ON_GPU and targets.target_of(DEVICE).native_fp8:  # the e4m3 dot's buffer
        got_q = torch.empty(t, heads, 128, dtype=torch.float8_e4m3fn, device=DEVICE)
        kernels.prepare_queries(q, w, angles.cos(), angles.sin(), kind == "dsa", True, spec.weight_scale, got_q,
                                got_w)
        assert torch.equal(got_q.float(), want_q)
    if q_format == "fp8":  # the float16 dot's buffer (fp8 keys where the target converts no e4m3): the same values
        got_q = torch.empty(t, heads, 128, dtype=torch.float16, device=DEVICE)
        kernels.prepare_queries(q, w, angles.cos(), angles.sin(), kind == "dsa", True, spec.weight_scale, got_q,
                                got_w)
        assert torch.equal(got_q.float(), want_q)


@needs_kernels
def test_kernel_two_level_selection_equals_the_reference():
    spec = IndexerSpec(num_heads=32, topk=64, kind="c2a", q_format="bf16")  # a bf16 dot: exact, so exact sets
    gen = torch.Generator().manual_seed(11)
    case = make_case(gen, [(sized(600, 40000), 2), (sized(300, 9000), 5)], spec, "fp8", DEVICE)
    kept_count = sized(12, 2048)  # fewer than the blocks there are, so the selection binds
    ref_kept = top_blocks_reference(case.q, case.w, case.cache, case.step, num_kept=kept_count)
    ref = index_topk_reference(case.q, case.w, case.cache, case.step, 64, kept_blocks=ref_kept)
    got, kept = kernel_picks(case, 64, select=True, num_kept=kept_count)
    n = case.num_tokens
    assert torch.equal(kept[:n, :1].cpu(), ref_kept[:n, :1].cpu()), "the pinned newest block"
    same_sets(kept, ref_kept, n)
    same_sets(got, ref, n)
    later, _ = kernel_picks(case, 64, kept=ref_kept)  # a later source: only inside the kept blocks
    same_sets(later, index_topk_reference(case.q, case.w, case.cache, case.step, 64, kept_blocks=ref_kept), n)


def test_select_kernel_refuses_a_segmented_row_whose_k_would_not_shorten_it():
    """A row past MAX_SELECT_COLS goes in segments, each keeping its top k: with k a whole segment the candidates
    would be as many as the columns, round after round (it looped forever); refused before any launch."""
    from sparse_mla.indexer import SELECT_SEGMENT, select_kernel_takes
    from sparse_mla.ops.triton import indexer as kernels

    assert select_kernel_takes(SELECT_SEGMENT - 1) and not select_kernel_takes(SELECT_SEGMENT)
    packed = torch.zeros(1, 3 * SELECT_SEGMENT, dtype=torch.int64)
    out = torch.zeros(1, SELECT_SEGMENT, dtype=torch.int32)
    with pytest.raises(ValueError, match=f"below {SELECT_SEGMENT}"):
        kernels.topk_rows(packed, SELECT_SEGMENT, out)


def test_rows_of_words_go_whole_only_where_the_digit_search_serves_few_of_them():
    """``select_takes_whole``: rows of words past MAX_SELECT_COLS go whole only up to 32,768 columns, searched by the
    target's own digits (NVIDIA on a Triton that counts histograms by shared-memory atomics; an explicit bit search
    keeps segments), no more rows than the SMs; the digit search's warps for few rows of 16,384 keys or more: 32."""
    from sparse_mla.ops.triton import indexer as kernels

    cuda, hip = targets.DEFAULT, next(t for t in targets.MATRIX if t.backend == "hip")
    digits = kernels.select_digit_bits(cuda, True) > 0
    assert kernels.select_takes_whole(cuda, 132, 32768, 132, None) == digits
    assert kernels.select_takes_whole(cuda, 132, 24576, 132, 8) == digits
    for rows, cols, digit_bits in ((133, 32768, None), (64, 32768 + 8192, None), (64, 16384, None), (64, 32768, 0)):
        assert not kernels.select_takes_whole(cuda, rows, cols, 132, digit_bits)
    assert not kernels.select_takes_whole(hip, 8, 32768, 304, None)
    assert kernels.select_warps(264, 32768, 132, True) == 32 and kernels.select_warps(264, 16384, 132, True) == 32
    assert kernels.select_warps(264, 12288, 132, True) == 16 and kernels.select_warps(265, 16384, 132, True) < 32


def test_each_select_pass_searches_and_spreads_as_its_rule_says(monkeypatch):
    """The launches of a select, recorded, not run, on a target that searches by digits (sm_90, 132 SMs; histograms by
    shared-memory atomics): a long row of words in segments (131,072 columns, k 2,048) searches its words by digits,
    the middle pass over the first winners' keys a bit a round (untimed by digits), the last pass over the winners by
    digits at 16 warps; a row of 32,768 words goes whole at 32 warps; rows of 16,384 at 32 warps, 8,192 at 16."""
    from sparse_mla.ops.triton import indexer as kernels

    launches = []

    floors = []  # the searches' floors (FLOOR), each launch's

    class Recorded:
        def __getitem__(self, grid):
            def record(*args, **kw):
                launches.append((args[0].shape, args[0].dtype, kw["DIGIT"], kw["num_warps"]))
                floors.append(kw["FLOOR"])
            return record

    monkeypatch.setattr(kernels, "HISTOGRAM_BY_ATOMICS", True)
    monkeypatch.setattr(kernels, "_topk_rows_kernel", Recorded())
    monkeypatch.setattr(targets, "target_of", lambda device: targets.DEFAULT)
    monkeypatch.setattr(targets, "num_sms", lambda device, target=None: 132)
    words, keys, bits = torch.int32, torch.int64, kernels.SELECT_DIGIT_BITS
    kernels.topk_rows(torch.zeros(1, 131072, dtype=words), 2048, torch.zeros(1, 2048, dtype=torch.int32))
    assert [(shape, dtype, digit) for shape, dtype, digit, _ in launches] == [
        ((16, 8192), words, bits), ((4, 8192), keys, 0), ((1, 8192), keys, bits)]
    assert launches[-1][3] == 16
    floors.clear()
    for cols, warps in ((32768, 32), (16384, 32), (8192, 16)):
        launches.clear()
        kernels.topk_rows(torch.zeros(2, cols, dtype=words), 512, torch.zeros(2, 512, dtype=torch.int32))
        assert launches == [((2, cols), words, bits, warps)], cols
        assert floors == [kernels.select_floor(warps * 32, cols, 512, True)] and floors[0], cols
        floors.clear()


@pytest.mark.parametrize("runs,main,k,floor", [
    (512, 8192, 512, 512),      # V4-Flash's decode rows at 16 warps: a thread's 16 words a group
    (512, 8192, 1024, 1024),    # V4-Pro's top 1,024: two groups of 8 words a thread
    (1024, 32768, 2048, 2048),  # V3.2's rows whole at 32 warps: two groups of 16 a thread
    (256, 8192, 512, 512),      # 8 warps (rows past two an SM)
    (512, 8192, 2048, 0),       # groups of 4 words: the least valid word's start
    (0, 8192, 512, 0),          # no runs (packed keys): the lanes in column order
])
def test_the_digit_search_starts_from_a_floor_of_groups_a_thread_owns(runs, main, k, floor):
    """``select_floor``: for the digit search, at least k groups, a multiple of the threads (each thread's runs its
    own groups), of two vectors or more; none for the bit rounds."""
    from sparse_mla.ops.triton import indexer as kernels

    assert kernels.select_floor(runs, main, k, True) == floor
    assert kernels.select_floor(runs, main, k, False) == 0  # the bit rounds: from the least word


@needs_kernels
@pytest.mark.parametrize("rows", ["scores of both signs", "a short request", "k + 1 candidates", "ties at the floor",
                                  "a short request's K-th at -inf", "a long row's segments"])
def test_the_search_from_a_floor_picks_what_the_search_from_the_least_word_picks(rows, monkeypatch):
    """Rows of words whose digit search starts from the least of its groups' largest words (``FLOOR``, checked to
    reach the launch) and from the least valid word (``FLOOR`` 0): torch.topk's picks in the same order either way;
    rows whose scores take both signs, a request whose entries fill a quarter of the row (the other groups' largest
    0: no candidate), k + 1 candidates, every group's largest tied with the K-th, a short request whose K-th is -inf
    (the first pass's lowest digit, where the zeros in play must not count), and a row of 65,536 words (its segments'
    pass, packing their winners' keys, from a floor)."""
    from sparse_mla.ops.triton import indexer as kernels

    gen = torch.Generator().manual_seed(len(rows))
    cols, k = 65536 if rows == "a long row's segments" else 8192, 512
    scores = torch.randn(3, cols, generator=gen) * 5.0
    if rows == "a short request":
        scores[:, cols // 4:] = float("nan")  # (no candidate)
    elif rows == "k + 1 candidates":
        scores[:, torch.randperm(cols, generator=gen)[k + 1:]] = float("nan")
    elif rows == "a short request's K-th at -inf":
        scores[:, cols // 4:] = float("nan")
        finite = scores[:, : k - 50].clone()  # k - 50 finite scores a row among -inf: the K-th is -inf
        scores[:, : cols // 4] = -float("inf")
        scores[:, torch.randperm(cols // 4, generator=gen)[: k - 50]] = finite
    elif rows == "ties at the floor":
        scores = torch.where(torch.rand(3, cols, generator=gen) < 0.5, 1.0, -scores.abs())
    packed = packed_rows(scores).to(DEVICE)
    want = kernels.topk_from_packed(packed, k).cpu()
    rule, floors, got = kernels.select_floor, [], {}
    for floor in (True, False):
        monkeypatch.setattr(kernels, "select_floor", lambda runs, main, k, digits, floor=floor: floors.append(
            rule(runs, main, k, digits) if floor else 0) or floors[-1])
        out = torch.full((3, k), 7, dtype=torch.int32, device=DEVICE)
        kernels.topk_rows(words_of(packed), k, out, digit_bits=kernels.SELECT_DIGIT_BITS)
        got[floor] = out.cpu()
        if floor:
            assert floors[0] >= k, floors  # the first launch, over the words, from a floor
    assert torch.equal(got[True], got[False])
    assert torch.equal(got[True].sort(1).values, want.sort(1).values)


@needs_gpu  # the register cap and the warps change the compiled code alone: the interpreter runs none
def test_segments_winners_over_more_rows_than_two_an_sm_pick_the_top_k(monkeypatch):
    """Rows of words in 8 segments over more rows than two an SM (ties, rows of few candidates): the last pass over
    the winners' keys (8,192 a row; by digits at 8 warps under select_maxnreg's cap where the target searches by
    digits) gives torch.topk's set, in entry order."""
    from sparse_mla.ops.triton import indexer as kernels

    device = torch.device(DEVICE)
    target = targets.target_of(device)
    rows, cols, k = 2 * targets.num_sms(device, target) + 1, 8 * SELECT_SEGMENT, 1024
    gen = torch.Generator().manual_seed(rows)
    scores = torch.randn(rows, cols, generator=gen)
    scores[0, 5000:60000:7] = 3.0  # ties at the threshold in every segment
    scores[1, torch.rand(cols, generator=gen) < 0.99] = float("nan")  # fewer candidates than k
    packed = packed_rows(scores)
    asked = []
    cap = kernels.select_maxnreg
    monkeypatch.setattr(kernels, "select_maxnreg", lambda *a, **kw: asked.append(cap(*a, **kw)) or asked[-1])
    out = torch.full((rows, k), 7, dtype=torch.int32, device=DEVICE)
    kernels.topk_rows(words_of(packed).to(DEVICE), k, out)
    if kernels.select_digit_bits(target, False, winners=True):  # the winners' pass ran at 8 warps, capped
        assert asked[-1] == target.register_file // (2 * target.warp_size * 8)
    got = out.cpu()
    want = kernels.topk_from_packed(packed, k)
    same_sets(got, want, rows)
    for r in (0, 1, 2):
        chosen = [x for x in got[r].tolist() if x >= 0]
        assert chosen == sorted(chosen) and len(chosen) == min(k, int((packed[r] != kernels.INT64_MIN).sum()))


@needs_kernels
@pytest.mark.parametrize("cols", [3 * SELECT_SEGMENT, 4 * SELECT_SEGMENT])
def test_a_row_of_words_whole_picks_as_its_segments_do(cols, monkeypatch):
    """Few rows of words past MAX_SELECT_COLS (ties across segments, a row of few candidates), converting their
    picks: selected whole in one launch where ``select_takes_whole``, the same picks in the same order and the same
    slots as in segments (two launches) and as torch.topk's set."""
    from sparse_mla.ops.triton import indexer as kernels

    gen = torch.Generator().manual_seed(cols)
    scores = torch.randn(2, cols, generator=gen)
    scores[0, 8000:8400] = scores[0, cols - 400:] = 2.5  # ties at the threshold, in the first and last segments
    assert (scores[0] > 2.5).sum() < 512 < (scores[0] >= 2.5).sum()
    scores[1, torch.rand(cols, generator=gen) < 0.99] = float("nan")  # fewer candidates than k
    packed = packed_rows(scores)
    words = words_of(packed).to(DEVICE)
    target = targets.target_of(words.device)
    took_whole = kernels.select_takes_whole(target, 2, cols, targets.num_sms(words.device, target), None)
    launch = kernels._launch_select
    launches = {True: [], False: []}  # the rows each launch took, by way
    table = torch.arange(2 * cols // 64, dtype=torch.int32, device=DEVICE).view(2, -1)
    lists = {}
    for whole in (True, False):
        if not whole:
            monkeypatch.setattr(kernels, "select_takes_whole", lambda *args: False)
        monkeypatch.setattr(kernels, "_launch_select", lambda rows, *a, **kw: launches[whole].append(tuple(rows.shape))
                            or launch(rows, *a, **kw))
        bufs = [torch.full(shape, 7, dtype=torch.int32, device=DEVICE) for shape in ((2, 512), (2, 512), (2,),
                                                                                      (2, 512))]
        into = kernels.PicksInto(torch.full((2,), 4 * cols, dtype=torch.int32, device=DEVICE),
                                 torch.arange(2, dtype=torch.int32, device=DEVICE), table, 64, *bufs[1:], 2)
        kernels.topk_rows(words, 512, bufs[0], into)
        lists[whole] = [b.cpu() for b in bufs]
    segmented = [(2 * cols // SELECT_SEGMENT, SELECT_SEGMENT), (2, 512 * cols // SELECT_SEGMENT)]
    assert launches[False] == segmented
    assert launches[True] == ([(2, cols)] if took_whole else segmented)
    for got, want in zip(lists[True], lists[False]):
        assert torch.equal(got, want)
    picks = lists[True][0]
    assert torch.equal(picks[0], torch.topk(packed[0], 512).indices.sort().values.int())
    candidates = (packed[1] != torch.iinfo(torch.int64).min).nonzero().flatten().int()
    assert torch.equal(picks[1, :candidates.numel()], candidates) and (picks[1, candidates.numel():] == -1).all()


@needs_kernels
@pytest.mark.parametrize("rows,cols,k,valid", [(5, 512, 64, 300), (3, 1024, 512, 1024), (4, 640, 512, 100),
                                               (2, 2048, 128, 2048), (3, 256, 256, 256), (2, 32768, 512, 30000),
                                               (1, 16384 + 8192, 2048, 20000), (3, 9216, 512, 9100),
                                               (2, 513, 64, 513), (3, 1024, 100, 900), (2, 9216, 1000, 9000),
                                               (2, 32768, 500, 30000)])
def test_select_kernel_picks_the_same_set_as_torch_topk(rows, cols, k, valid):
    """Rows in one program (9,216 columns: two tiles, 8,192 + 1,024; 513: 512 + 2), and long rows by segments (two
    launches), against torch.topk's set; k of any size, not only powers of two (100, 500, 1,000). The same rows as
    words give the same picks in the same order (long rows' segments: the winners' keys packed from the words; where
    the target searches by digits, the words' long rows whole: select_takes_whole)."""
    from sparse_mla.ops.triton import indexer as kernels

    gen = torch.Generator().manual_seed(cols + k)
    scores = torch.randn(rows, cols, generator=gen)
    scores[0, :50] = 0.5  # exact ties: the lowest entries win
    scores[-1, : cols // 2] = 0.0
    scores[-1, valid - 1] = 50.0  # the last candidate column is a pick (513 columns: the second tile's last lane)
    if cols > 16384:  # segments: the best entries crowd into one of them
        scores[0, 9000:9000 + k] += 10.0
    scores[:, valid:] = float("nan")  # not candidates
    packed = packed_rows(scores).to(DEVICE)
    want = kernels.topk_from_packed(packed, k)
    for digit_bits in DIGIT_BITS:
        out = torch.full((rows, k), 7, dtype=torch.int32, device=DEVICE)
        kernels.topk_rows(packed, k, out, digit_bits=digit_bits)
        same_sets(out, want, rows)
        got = out.cpu()
        for r in range(rows):
            chosen = [x for x in got[r].tolist() if x >= 0]
            assert chosen == sorted(chosen) and len(chosen) == min(k, valid)  # entry order, then -1
            assert (got[r, len(chosen):] == -1).all()
        from_words = torch.full((rows, k), 7, dtype=torch.int32, device=DEVICE)  # the score kernel's words
        kernels.topk_rows(words_of(packed), k, from_words, digit_bits=digit_bits)
        assert torch.equal(from_words.cpu(), got), digit_bits


# the select's threshold searches: a bit a round, and digits of 3, 8 and 11 bits a pass (a last pass narrower than
# the digit: 3 and 8 do not divide the bits below a row's common prefix in general); the target's choice is one of
# them (select_digit_bits, its own test; the layer's tests run it)
DIGIT_BITS = (0, 3, 8, 11)


@pytest.mark.parametrize("target", targets.MATRIX, ids=lambda t: t.name)
@pytest.mark.parametrize("atomics", [False, True])
def test_the_select_searches_by_digits_on_nvidia_rows_of_words_where_the_histogram_is_atomics(target, atomics,
                                                                                            monkeypatch):
    """The rule (:func:`select_digit_bits`): digits where Triton lowers ``tl.histogram`` to shared-memory atomics
    (NVIDIA, Triton 3.8 and later) over rows of words and over segments' winners; a bit a round over other packed
    keys, on AMD, and on a Triton whose histogram is a vote a digit bit (slower than the rounds it replaces:
    docs/history.md versions 28 and 37)."""
    from sparse_mla.ops.triton import indexer as kernels

    monkeypatch.setattr(kernels, "HISTOGRAM_BY_ATOMICS", atomics)
    digits = kernels.SELECT_DIGIT_BITS if atomics and target.backend == "cuda" else 0
    assert kernels.select_digit_bits(target, True) == digits
    assert kernels.select_digit_bits(target, False, winners=True) == digits
    assert kernels.select_digit_bits(target, False) == 0


def test_forced_digits_are_refused_where_the_histogram_takes_no_mask(monkeypatch):
    """A Triton whose ``tl.histogram`` has no mask cannot build the digit search: forcing it is a ValueError naming
    ``digit_bits``, not a compile error; a bit a round still runs."""
    from sparse_mla.ops.triton import indexer as kernels

    monkeypatch.setattr(kernels, "HISTOGRAM_TAKES_MASK", False)
    words = torch.randint(1, 1 << 30, (2, 64), dtype=torch.int32, device=DEVICE)
    out = torch.empty(2, 8, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="digit_bits=8 needs tl.histogram's mask"):
        kernels.topk_rows(words, 8, out, digit_bits=8)
    if KERNEL_RUNS:
        kernels.topk_rows(words, 8, out, digit_bits=0)
        assert torch.equal(out.sort(1).values.cpu(), words.cpu().topk(8, 1).indices.sort(1).values.int())


def test_the_select_holds_runs_of_columns_a_thread_over_rows_of_words_in_whole_vectors():
    """The rule (:func:`select_runs`): a run of columns a thread (``RUNS``: the program's threads) over rows of words
    whose main tile fills every thread with whole 16-byte vectors; lanes in column order over packed keys (no
    vectors) and narrower tiles. A wave of 64 on AMD."""
    from sparse_mla.ops.triton import indexer as kernels

    sm90, gfx942 = (next(t for t in targets.MATRIX if t.name == n) for n in ("sm_90", "gfx942"))
    assert kernels.select_runs(sm90, 4, 8192, True) == 128
    assert kernels.select_runs(sm90, 8, 8192, True) == 256
    assert kernels.select_runs(gfx942, 4, 8192, True) == 256
    assert kernels.select_runs(sm90, 4, 8192, False) == 0
    assert kernels.select_runs(sm90, 4, 256, True) == 0


@needs_kernels
def test_the_select_lists_the_same_picks_with_lanes_as_runs_or_in_column_order(monkeypatch):
    """Rows of words (a main tile of 2,048 columns that runs take, a tail of 512, ties, rows of few candidates): the
    select with each thread's lanes a run of columns and with lanes in column order lists the same picks in the same
    (entry) order."""
    from sparse_mla.ops.triton import indexer as kernels

    gen = torch.Generator().manual_seed(2048)
    scores = torch.randn(3, 2560, generator=gen)
    scores[0, 100:700] = 1.5  # ties at the threshold (145 scores above it), across threads' runs
    scores[2, torch.rand(2560, generator=gen) < 0.9] = float("nan")  # few candidates
    words = words_of(packed_rows(scores)).to(DEVICE)
    warps = kernels.select_warps(3, 2560, targets.num_sms(DEVICE, targets.target_of(DEVICE)))
    assert kernels.select_runs(targets.target_of(DEVICE), warps, 2048, True) > 0
    listed = []
    for runs in (True, False):
        if not runs:
            monkeypatch.setattr(kernels, "select_runs", lambda target, warps, main, words: 0)
        out = torch.full((3, 256), 7, dtype=torch.int32, device=DEVICE)
        kernels.topk_rows(words, 256, out)
        listed.append(out.cpu())
    assert torch.equal(listed[0], listed[1])
    assert torch.equal(listed[0][:2].sort(1).values, torch.topk(packed_rows(scores)[:2], 256, 1).indices.sort(1)
                       .values.int())


@needs_gpu  # the warps change the compiled layouts alone: the interpreter runs none
@pytest.mark.parametrize("warps", [4, 8, 16, 32])
def test_the_select_lists_the_same_picks_at_any_warps(monkeypatch, warps):
    """Rows of 8,192 words (ties across threads, a row of few candidates), the target's search (digits on Triton
    3.8+): the select's picks are the top k's, listed in entry order, whatever the warps a row — ``select_warps``
    chooses them for speed alone (16 over few rows searched by digits)."""
    from sparse_mla.ops.triton import indexer as kernels

    gen = torch.Generator().manual_seed(8192 + warps)
    scores = torch.randn(5, 8192, generator=gen)
    scores[0, 1000:3000] = 2.25  # ties at the threshold, across many threads' runs
    assert (scores[0] > 2.25).sum() < 512 < (scores[0] >= 2.25).sum()
    scores[3, torch.rand(8192, generator=gen) < 0.97] = float("nan")  # fewer candidates than k
    packed = packed_rows(scores)
    asked = []
    monkeypatch.setattr(kernels, "select_warps", lambda rows, *rule_args: asked.append(rows) or warps)
    out = torch.full((5, 512), 7, dtype=torch.int32, device=DEVICE)
    kernels.topk_rows(words_of(packed).to(DEVICE), 512, out)
    assert asked == [5]  # one launch, at the patched warps
    got = out.cpu()
    for r in (0, 1, 2, 4):
        assert torch.equal(got[r], torch.topk(packed[r], 512).indices.sort().values.int()), f"row {r}"
    candidates = (packed[3] != torch.iinfo(torch.int64).min).nonzero().flatten().int()  # every one, in entry order
    assert candidates.numel() < 512
    assert torch.equal(got[3, :candidates.numel()], candidates) and (got[3, candidates.numel():] == -1).all()


SELECT_VALUES = {  # rows far from random scores: ties by the thousand, one value, the float range's ends
    "few distinct values": lambda g, n: torch.randint(-3, 4, (n,), generator=g).float(),
    "one value": lambda g, n: torch.full((n,), 2.5),
    "the extremes": lambda g, n: torch.tensor([-3.4e38, 3.4e38, float("inf"), -float("inf"), 1e-45, -1e-45, 0.0,
                                               1.0])[torch.randint(0, 8, (n,), generator=g)],
    "a cluster and outliers": lambda g, n: torch.where(torch.rand(n, generator=g) < 0.02, 1e30,
                                                       1.0 + torch.rand(n, generator=g) * 1e-6),
    "wide exponents": lambda g, n: torch.randn(n, generator=g) * 10.0 ** torch.randint(-30, 30, (n,), generator=g),
    # the threshold's ties among entries past the first segment (8,192; in rows over 16,384, past 16,384): entries
    # before it all score lower
    "ties past the first segments": lambda g, n: torch.where(torch.arange(n) < (8192 if n <= 16384 else 16384), -1.0,
                                                             torch.randint(0, 2, (n,), generator=g).float()),
    "mostly no candidate": lambda g, n: torch.where(torch.rand(n, generator=g) < 0.9, float("nan"),
                                                    torch.randn(n, generator=g)),
}


@needs_kernels
@pytest.mark.parametrize("values", sorted(SELECT_VALUES))
@pytest.mark.parametrize("cols,k", [(8192, 512), (9216, 1000), (300, 64), (16384 + 8192, 512), (6 * 8192, 4096)])
def test_select_kernel_is_exact_on_rows_of_ties_and_extreme_scores(values, cols, k):
    """The select's threshold search on the scores' order words, and its search among tied entries: heavy ties, a
    single value, ±inf and the largest and smallest floats, a tight cluster beside outliers, exponents 60 decades
    apart and rows of few candidates give torch.topk's set (ties to the lowest entry), in entry order, ``-1`` fill
    (the rows a search that guesses its thresholds from the scores' values must get right too: docs/history.md,
    version 30); rows of three segments (24,576 columns: ties among the segments' winners, entries read from their
    keys) and of six whose winners (24,576) are selected in segments again, a pass whose entries are the whole row's
    (up to 49,151). The same rows as words give the same picks in the same order (a long row's first pass packs its
    segments' winners' keys from their words; where the target searches by digits, the 24,576 columns go whole)."""
    from sparse_mla.ops.triton import indexer as kernels

    gen = torch.Generator().manual_seed(cols + k + len(values))
    scores = torch.stack([SELECT_VALUES[values](gen, cols) for _ in range(3)])
    packed = packed_rows(scores).to(DEVICE)
    want = kernels.topk_from_packed(packed, k).cpu()
    for digit_bits in DIGIT_BITS:
        out = torch.full((3, k), 7, dtype=torch.int32, device=DEVICE)
        kernels.topk_rows(packed, k, out, digit_bits=digit_bits)
        got = out.cpu()
        assert torch.equal(got.sort(1).values, want.sort(1).values), digit_bits
        from_words = torch.full((3, k), 7, dtype=torch.int32, device=DEVICE)
        kernels.topk_rows(words_of(packed), k, from_words, digit_bits=digit_bits)  # the score kernel's words
        assert torch.equal(from_words.cpu(), got), digit_bits
        for r in range(3):
            chosen = [x for x in got[r].tolist() if x >= 0]
            assert chosen == sorted(chosen)


@needs_kernels
@pytest.mark.parametrize("cols,k,first,ratio,sms_over", [
    (640, 64, 0, 4, None), (16384 + 8192, 512, 3, 1, None), (9216, 100, 2, 2, None),
    # more rows than the SMs (a B 128 decode's 8,192 words at 16 warps), than two an SM (a prefill chunk's 9,216 at 8):
    # the digit search's registers capped (select_maxnreg), which the interpreter does not compile
    pytest.param(8192, 512, 1, 4, 1, marks=needs_gpu), pytest.param(9216, 512, 0, 2, 2, marks=needs_gpu)])
def test_select_converts_its_picks_in_its_launch_as_the_conversion_does(cols, k, first, ratio, sms_over, monkeypatch):
    """``topk_rows(..., into=PicksInto)`` writes the same picks as without it and, for tokens ``[first, first +
    into.rows)``, their slots, counts and kept picks exactly as the step's conversion (the torch twin) converts those
    picks: a token of position -1 and the tokens past the packed rows (the step's padding) get empty rows, the tokens
    before ``first`` nothing; rows of three segments (24,576 columns) convert in the last launch; rows of words
    convert alike, over more rows than ``sms_over`` an SM too."""
    from sparse_mla.ops.triton import indexer as kernels
    from sparse_mla.picks import compressed_picks_torch

    gen = torch.Generator().manual_seed(cols + k + first)
    rows, pad, reqs, bs = 5, 2, 3, 64
    caps = []  # the register caps the launches asked (where the rows outnumber the SMs and the search is by digits)
    if sms_over:
        device = torch.device(DEVICE)
        rows = sms_over * targets.num_sms(device, targets.target_of(device)) + 1
        select_maxnreg = kernels.select_maxnreg

        def recorded_cap(*args, **kwargs) -> int | None:
            caps.append(select_maxnreg(*args, **kwargs))
            return caps[-1]

        monkeypatch.setattr(kernels, "select_maxnreg", recorded_cap)
    tokens = first + rows + pad
    blocks = -(-cols // bs)
    table = torch.randperm(reqs * blocks + 4, generator=gen)[: reqs * blocks].view(reqs, blocks).int()
    table[1, blocks // 2] = -1  # a missing block: its entries are never candidates
    positions = torch.randint(cols * ratio // 2, cols * ratio, (tokens,), generator=gen, dtype=torch.int32)
    token_to_req = torch.randint(0, reqs, (tokens,), generator=gen, dtype=torch.int32)
    positions[first + 1] = -1  # a padding token inside the chunk
    positions[first + rows:], token_to_req[first + rows:] = -1, -1
    chunk = slice(first, first + rows)
    visible = torch.where(positions[chunk] >= 0, (positions[chunk] + 1) // ratio, 0)
    col = torch.arange(cols)
    present = table[token_to_req[chunk].clamp_min(0)][:, col // bs] >= 0
    scores = torch.randn(rows, cols, generator=gen)
    scores[0, :40] = 0.25  # exact ties
    scores[(col[None, :] >= visible[:, None]) | ~present] = float("nan")  # what the score kernel packs as no candidate
    packed = packed_rows(scores).to(DEVICE)
    plain = torch.full((rows, k), 7, dtype=torch.int32, device=DEVICE)
    kernels.topk_rows(packed, k, plain)
    step = [t.to(DEVICE) for t in (positions, token_to_req, table)]
    bufs = [torch.full(shape, 99, dtype=torch.int32, device=DEVICE) for shape in ((tokens, k), (tokens,), (tokens, k))]
    out = torch.full((rows, k), 7, dtype=torch.int32, device=DEVICE)
    into = kernels.PicksInto(step[0][first:], step[1][first:], step[2], bs, bufs[0][first:], bufs[1][first:],
                             bufs[2][first:], tokens - first)
    kernels.topk_rows(packed, k, out, into)
    assert torch.equal(out, plain)
    picks = torch.full((tokens, k), -1, dtype=torch.int32, device=DEVICE)
    picks[chunk] = plain
    want = [torch.empty_like(b) for b in bufs]
    compressed_picks_torch(*step[:2], step[2], bs, ratio, picks, *want)
    for got, expected in zip(bufs, want):
        assert torch.equal(got[first:].cpu(), expected[first:].cpu())
        assert (got[:first] == 99).all()
    # the same rows as the score kernel's words (9,216 columns: the lanes as runs; 24,576: segments)
    from_words = [torch.full_like(b, 99) for b in bufs]
    into_words = kernels.PicksInto(step[0][first:], step[1][first:], step[2], bs, from_words[0][first:],
                                   from_words[1][first:], from_words[2][first:], tokens - first)
    kernels.topk_rows(words_of(packed), k, out, into_words)
    assert torch.equal(out, plain)
    for got, expected in zip(from_words, bufs):
        assert torch.equal(got.cpu(), expected.cpu())
    assert int(bufs[1][first + 1]) == 0 and (bufs[1][first + rows:] == 0).all()
    if sms_over and kernels.select_digit_bits(targets.target_of(torch.device(DEVICE)), True):
        assert caps and None not in caps  # the words' launch ran capped (the packed keys' searches bit by bit)
    with pytest.raises(ValueError, match="into.rows must be"):
        kernels.topk_rows(packed, k, out, into._replace(rows=rows - 1))
    with pytest.raises(ValueError, match=r"into.kept must have shape"):
        kernels.topk_rows(packed, k, out, into._replace(kept=bufs[2][first:, : k - 1]))


@needs_kernels
@pytest.mark.parametrize("words", [False, True])
def test_the_indexer_layer_converts_its_picks_and_the_attention_launches_no_conversion(words, monkeypatch):
    """The Triton indexer's select writes the step's conversion of its picks (every token's row, padding included,
    over several chunks) as the conversion would; the attention's call with those picks converts nothing (the
    buffers poisoned after the select stay), until the picks change in place or another write replaces the
    buffers; the attention's outputs are the same either way, in each index form (the ragged form reads the
    padded conversion, the combined form converts into its own rows)."""
    from sparse_mla.layer import SparseMLAAttention
    from sparse_mla.picks import step_picks

    packed_keys_unless(monkeypatch, words)
    lengths = [(sized(700, 9000), 2), (sized(300, 4000), 1), (sized(500, 5000), 6)]
    tokens = sum(n for _, n in lengths) + 2
    every = torch.arange(lengths[0][0] // 4, dtype=torch.int32).expand(tokens, -1).contiguous()  # every entry written
    ls = layer_step(lengths, 21, DEVICE, picks=every)
    sc, cache, q, w = ls.scenario, ls.cache, ls.q, ls.w
    batch, meta = sc.batch, sc.meta
    gen = torch.Generator().manual_seed(21)  # the attention's queries
    indexer = SparseMLAIndexer("c4a", 16, 64, backend="triton", workspace_bytes=3 * 8 * 64 * (lengths[0][0] // 256 + 1))
    picks = indexer(meta, q, w, cache)
    plan = indexer.step_plan(meta, "triton", "fp8")
    assert indexer.scores_as_words(plan) == words
    assert len(plan.chunks_for(words)) > 1  # the chunks it took
    conversion = step_picks(meta, "c4a")
    want = _converted(meta, "c4a", picks)
    for got, expected in zip((conversion.indices, conversion.lens, conversion.kept), want):
        assert torch.equal(got.cpu(), expected)
    q_attn = torch.randn(batch.token_capacity, 4, 512, generator=gen).to(torch.bfloat16).to(DEVICE)
    for form in ("padded", "ragged", "combined"):  # the index forms read the padded conversion, or convert anew
        attn = SparseMLAAttention("c4a", 4, window=4, topk=64, backend="reference", index_form=form)
        indexer(meta, q, w, cache)
        fused = attn(q_attn, meta, sc.caches, picks).clone()
        assert not fused[: batch.num_tokens].isnan().any()
        assert torch.equal(fused, attn(q_attn, meta, sc.caches, picks.clone()))  # another tensor: converted again
        assert torch.equal(conversion.indices.cpu(), want[0])
    indexer(meta, q, w, cache)  # the select writes the conversion again
    conversion.indices[0, 0] = 12345
    conversion(picks)  # its own picks: no launch
    assert int(conversion.indices[0, 0]) == 12345
    picks.add_(0)  # changed in place (its version counter moves): converted again
    conversion(picks)
    assert torch.equal(conversion.indices.cpu(), want[0])
    SparseMLAIndexer("c4a", 16, 64, backend="triton", topk_select="torch")(meta, q, w, cache)  # no conversion
    conversion.indices[0, 0] = 12345
    conversion(picks)
    assert int(conversion.indices[0, 0]) != 12345


def _v41_step_and_keys(gen: torch.Generator):
    """A small V4.1 step (c2a and c1a beside the window) and each picks kind's key cache, every entry written."""
    from sparse_mla.config import V41_KINDS
    from sparse_mla.scenario import make_scenario

    lengths = [(300, 2), (150, 3)]
    sc = make_scenario(lengths, window=4, topk=32, fmt="bf16", decode_threshold=2, kinds=V41_KINDS, padding=2,
                       block_sizes={"swa": 64, "c2a": 64, "c1a": 64}, device=DEVICE)
    keys = {}
    for kind, ratio in (("c2a", 2), ("c1a", 1)):
        keys[kind] = IndexerKeyCache(sc.caches[kind].num_blocks, "fp8", device=DEVICE)
        keys[kind].poison()
        for r, (seq, _) in enumerate(lengths):
            entries = torch.arange(seq // ratio, dtype=torch.int32, device=DEVICE)
            keys[kind].write(torch.randn(len(entries), 128, generator=gen).to(DEVICE),
                             sc.batch.entry_slots(kind, r, entries))
    return sc, keys


def _converted(meta, kind: str, picks: torch.Tensor) -> list[torch.Tensor]:
    """The step's conversion of ``picks`` for ``kind`` by the torch twin: (indices, lens, kept), on the CPU."""
    from sparse_mla.config import COMPRESS_RATIO
    from sparse_mla.picks import compressed_picks_torch

    b = meta.batch
    out = [torch.empty_like(t) for t in (meta.picks_indices, meta.picks_lens, meta.picks_local)]
    compressed_picks_torch(b.positions, b.token_to_req, b.block_tables[kind], b.block_sizes[kind],
                           COMPRESS_RATIO[kind], picks, *out)
    return [t.cpu() for t in out]


@needs_kernels
@pytest.mark.parametrize("between", ["the other kind's indexer", "the other kind's conversion", "the combined form",
                                     "inference mode"])
def test_picks_converted_by_the_select_are_not_reused_once_the_step_s_buffers_hold_others(between):
    """The step's picks buffers are shared by V4.1's two picks kinds (and their kept picks by the combined form's
    conversion): after c2a's select converted its picks, a c1a indexer, a c1a conversion or a combined-form conversion
    of other picks rewrites them, and the c2a picks handed on afterwards are converted again, not skipped; under
    ``torch.inference_mode`` (no version counters: an engine's usual mode) the select's picks still convert nothing
    and give the conversion's values."""
    import contextlib

    from sparse_mla.index_forms import CombinedPicks, step_combined

    gen = torch.Generator().manual_seed(3)
    mode = torch.inference_mode() if between == "inference mode" else contextlib.nullcontext()
    with mode:
        sc, keys = _v41_step_and_keys(gen)
        meta, cap = sc.meta, sc.batch.token_capacity

        def index(kind):
            return SparseMLAIndexer(kind, 8, 32, q_format="bf16", backend="triton")(
                meta, torch.randn(cap, 8, 128, generator=gen).to(DEVICE), torch.randn(cap, 8, generator=gen).to(DEVICE),
                keys[kind])

        picks = index("c2a")
        other = torch.full((cap, 32), -1, dtype=torch.int32, device=DEVICE)
        other[:, 0] = 0
        if between == "the other kind's indexer":
            index("c1a")
        elif between == "the other kind's conversion":
            meta.picks_for("c1a", other)
        elif between == "the combined form":
            rows = step_combined(meta, "c2a", meta.picks_indices, meta.picks_lens, fill=False)
            CombinedPicks(meta, "c2a", *rows)(other)
        idx, lens = meta.picks_for("c2a", picks)
        want = _converted(meta, "c2a", picks)
        assert torch.equal(idx.cpu(), want[0]) and torch.equal(lens.cpu(), want[1])
        assert torch.equal(meta.picks_local.cpu(), want[2])


@needs_kernels
@pytest.mark.parametrize("backend,debug", [("reference", False), ("triton", True)])
def test_non_finite_queries_or_weights_are_refused_where_values_are_checked(backend, debug, monkeypatch):
    """q and weights of the step's tokens must be finite: the reference checks it always, the kernels with
    SPARSE_MLA_DEBUG=1 (a sync); padding rows may hold anything (here NaN)."""
    from sparse_mla.scenario import make_scenario

    if debug:
        monkeypatch.setenv("SPARSE_MLA_DEBUG", "1")
    sc = make_scenario([(300, 2), (200, 1)], window=4, topk=64, fmt="bf16", decode_threshold=2, padding=2,
                       block_sizes={"swa": 64, "c4a": 64, "c128a": 2}, device=DEVICE)
    cache = IndexerKeyCache(sc.caches["c4a"].num_blocks, "fp8", device=DEVICE)
    n = sc.batch.num_tokens
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(sc.batch.token_capacity, 8, 128, generator=gen).to(DEVICE)
    w = torch.randn(sc.batch.token_capacity, 8, generator=gen).to(DEVICE)
    q[n:], w[n:] = float("nan"), float("nan")
    layer = SparseMLAIndexer("c4a", 8, 32, backend=backend)
    assert (layer(sc.meta, q, w, cache)[n:] == -1).all()
    for name, bad_q, bad_w, value in [("q", True, False, float("nan")), ("weights", False, True, float("inf"))]:
        q2, w2 = q.clone(), w.clone()
        (q2[1, 3, 7] if bad_q else w2[2, 5]).fill_(value)
        with pytest.raises(ValueError, match=f"{name} must be finite"):
            layer(sc.meta, q2, w2, cache)



@needs_kernels
@pytest.mark.parametrize("backend,debug", [("reference", False), ("triton", True)])
@pytest.mark.parametrize("bad", ["weights 3e38", "q 3e38"])
def test_finite_inputs_whose_scores_overflow_are_refused_where_values_are_checked(backend, debug, bad, monkeypatch):
    """Finite q and weights so large that a score overflows float32 (weights of 3e38: |w|·|q·k| past 3.4e38; q of
    3e38: the rope's sums past it, which the fp8 prep turns into infinite weights and NaN codes) are refused with the
    scores' message on the reference and, with SPARSE_MLA_DEBUG=1, on the kernels (whose picks among such scores
    differed from the reference's: a helper's probe, docs/history.md version 46); the same call with ordinary values
    passes."""
    from sparse_mla.indexer import SCORES_OVERFLOW
    from sparse_mla.scenario import make_scenario

    if debug:
        monkeypatch.setenv("SPARSE_MLA_DEBUG", "1")
    sc = make_scenario([(300, 2), (200, 1)], window=4, topk=64, fmt="bf16", decode_threshold=2, padding=2,
                       block_sizes={"swa": 64, "c4a": 64, "c128a": 2}, device=DEVICE)
    cache = IndexerKeyCache(sc.caches["c4a"].num_blocks, "fp8", device=DEVICE)
    gen = torch.Generator().manual_seed(5)
    for r, seq_len in enumerate((300, 200)):
        entries = torch.arange(seq_len // 4, dtype=torch.int32)
        cache.write(torch.randn(len(entries), 128, generator=gen).to(DEVICE), sc.batch.entry_slots("c4a", r, entries))
    q = torch.randn(sc.batch.token_capacity, 8, 128, generator=gen).to(DEVICE)
    w = torch.randn(sc.batch.token_capacity, 8, generator=gen).abs().to(DEVICE)
    layer = SparseMLAIndexer("c4a", 8, 32, backend=backend)
    layer(sc.meta, q, w, cache)
    if bad == "weights 3e38":
        w[1] = 3e38
    else:
        q[1, :, 64:] = 3e38  # the rotated dims: each a sum of two products of 3e38
    with pytest.raises(ValueError, match=re.escape(SCORES_OVERFLOW)):
        layer(sc.meta, q, w, cache)



@needs_kernels
@pytest.mark.parametrize("fmt", ["fp8", "bf16"])
@pytest.mark.parametrize("words", [True, False])
def test_the_debug_score_check_passes_entries_never_written(fmt, words, monkeypatch):
    """With SPARSE_MLA_DEBUG=1 the kernels' score check, like the reference's, counts only written keys: visible
    entries whose slots were never written (here the poisoned cache's NaN) give no error on either backend, in
    either score format (their picks are unspecified, as they always were); ordinary q and weights."""
    from sparse_mla.scenario import make_scenario

    monkeypatch.setenv("SPARSE_MLA_DEBUG", "1")
    packed_keys_unless(monkeypatch, words)
    sc = make_scenario([(300, 2), (200, 1)], window=4, topk=64, fmt="bf16", decode_threshold=2, padding=2,
                       block_sizes={"swa": 64, "c4a": 64, "c128a": 2}, device=DEVICE)
    cache = IndexerKeyCache(sc.caches["c4a"].num_blocks, fmt, device=DEVICE)
    cache.poison()
    gen = torch.Generator().manual_seed(6)
    for r, seq_len in enumerate((300, 200)):
        entries = torch.arange(seq_len // 4 - 5, dtype=torch.int32)  # the last 5 visible entries never written
        cache.write(torch.randn(len(entries), 128, generator=gen).to(DEVICE), sc.batch.entry_slots("c4a", r, entries))
    assert not bool(cache.finite_slots().all())
    q = torch.randn(sc.batch.token_capacity, 8, 128, generator=gen).to(DEVICE)
    w = torch.randn(sc.batch.token_capacity, 8, generator=gen).to(DEVICE)
    for backend in ("reference", "triton"):
        picks = SparseMLAIndexer("c4a", 8, 32, backend=backend)(sc.meta, q, w, cache)
        assert picks.shape == (sc.batch.token_capacity, 32)


def test_scores_finite_reads_both_score_formats():
    """``scores_finite`` over words and packed keys: a candidate of score +inf, -inf or NaN is not finite; a finite
    score and no candidate (word 0, packed ``INT64_MIN``) are."""
    from sparse_mla.ops.triton import indexer as kernels

    def from_bits(bits: int) -> float:
        return torch.tensor([bits - (1 << 32 if bits >= 1 << 31 else 0)], dtype=torch.int32).view(torch.float32).item()

    tiny, most = from_bits(0x00000001), from_bits(0x7F7FFFFF)  # the smallest subnormal, the largest finite
    # NaNs of either sign and payload (x86's inf - inf is 0xFFC00000; a poisoned scale 0xFFFFFFFF)
    nans = [from_bits(b) for b in (0x7FC00000, 0x7F800001, 0x7FFFFFFF, 0xFFC00000, 0xFF800001, 0xFFFFFFFF)]
    cases = [(x, True) for x in (1.5, -2.0, 0.0, -0.0, tiny, -tiny, most, -most)]
    cases += [(float("inf"), False), (float("-inf"), False)] + [(x, False) for x in nans]
    for score, finite in cases:
        bits = torch.tensor([score], dtype=torch.float32).view(torch.int32).item()
        order = bits ^ ((bits >> 31) & 0x7FFFFFFF)
        word = max((order ^ -2147483648) & 0xFFFFFFFF, 1)  # a candidate's word: at least 1
        words = torch.tensor([[0, word - (1 << 32 if word >= 1 << 31 else 0)]], dtype=torch.int32)
        packed = torch.tensor([[kernels.INT64_MIN, (order << 32) | 0xFFFFFFF0]], dtype=torch.int64)
        assert kernels.scores_finite(words, True) is finite, (score, hex(bits))
        assert kernels.scores_finite(packed, False) is finite, (score, hex(bits))
        # a column not written (a key the cache never stored): not counted
        unwritten = torch.tensor([[True, False]])
        assert kernels.scores_finite(words, True, unwritten) and kernels.scores_finite(packed, False, unwritten)


def packed_keys_unless(monkeypatch, words: bool) -> None:
    """Scores as the layer's rule chooses them (``words``: words where it takes them), or packed keys forced (``not
    words``), so that a test runs both score formats on any target."""
    if not words:
        monkeypatch.setattr(SparseMLAIndexer, "scores_as_words", lambda self, plan, two_level=False: False)


@needs_kernels
def test_the_layer_on_the_float16_dot_gives_the_reference_s_picks(monkeypatch):
    """A layer planned where its target converts no e4m3 (``dot_dtype_for`` answering float16, as on sm_80 / sm_86 and
    AMD's targets before CDNA 4): its queries prepared into float16, scored by the float16 dot, the reference's
    picks."""
    from sparse_mla.ops.triton import indexer as kernels

    sm80 = next(t for t in targets.MATRIX if t.name == "sm_80")
    monkeypatch.setattr(targets, "target_of", lambda device: sm80)  # no e4m3 conversion: the integer decode
    rule = kernels.dot_dtype_for
    monkeypatch.setattr(kernels, "dot_dtype_for", lambda target, keys, q: (  # (the interpreter's rule: float32)
        torch.float16 if (keys, q) == ("fp8", "fp8") else rule(target, keys, q)))
    ls = layer_step([(sized(700, 9000), 2), (sized(300, 4000), 1)], 16, DEVICE)
    sc, cache, q, w = ls.scenario, ls.cache, ls.q, ls.w
    batch = sc.batch
    layer = SparseMLAIndexer("c4a", 16, 64, backend="triton")
    got = layer(sc.meta, q, w, cache)
    assert layer.step_plan(sc.meta, "triton", "fp8").q.dtype == torch.float16
    ref = SparseMLAIndexer("c4a", 16, 64, backend="reference")(sc.meta, q, w, cache)
    q_ready, w_ready = prepare_queries(q, w, batch.positions, layer.spec)
    check_picks(got, ref, q_ready, w_ready, cache, StepTokens.of(batch, "c4a"), batch.num_tokens)


@needs_kernels
@pytest.mark.parametrize("words", [False, True])
@pytest.mark.parametrize("fmt,select,k", [("fp8", "triton", 64), ("bf16", "torch", 64), ("fp8", "triton", 100)])
def test_layer_triton_equals_layer_reference_with_a_small_workspace(fmt, select, k, words, monkeypatch):
    """Several chunks of a small workspace (of packed keys, and of words twice as long where the layer takes them)
    give the reference's picks."""

    packed_keys_unless(monkeypatch, words)

    lengths = [(sized(700, 9000), 2), (sized(300, 4000), 1), (sized(500, 5000), 9)]
    ls = layer_step(lengths, 12, DEVICE, fmt)
    sc, cache, q, w = ls.scenario, ls.cache, ls.q, ls.w
    batch = sc.batch
    ref = SparseMLAIndexer("c4a", 16, k, backend="reference")(sc.meta, q, w, cache).clone()
    small = SparseMLAIndexer("c4a", 16, k, backend="triton", workspace_bytes=3 * 8 * 64 * (lengths[0][0] // 256 + 1),
                             topk_select=select)
    got = small(sc.meta, q, w, cache)
    plan = small.step_plan(sc.meta, "triton", fmt)
    assert small.scores_as_words(plan) == (words and select == "triton")
    assert len(plan.chunks) > 1 and len(plan.word_chunks) > 1  # (the words: twice the tokens a chunk)
    q_ready, w_ready = prepare_queries(q, w, batch.positions, small.spec)
    check_picks(got, ref, q_ready, w_ready, cache, StepTokens.of(batch, "c4a"), batch.num_tokens)
    assert (got[batch.num_tokens:] == -1).all()
    (picks, kept) = SparseMLAIndexer("c4a", 16, 64, backend="triton")(sc.meta, q, w, cache, select_blocks=True)
    assert kept.shape == (batch.token_capacity, 2048) and (kept[batch.num_tokens:] == -1).all()
    # picking inside kept blocks: packed keys, even where the layer would score its plain calls as words
    kept = kept.clone()
    kept[:, 1:] = -1  # one block a token: the restriction decides the picks
    inside = SparseMLAIndexer("c4a", 16, 8, backend="triton")(sc.meta, q, w, cache, kept_blocks=kept)
    want = index_topk_reference(q_ready, w_ready, cache, StepTokens.of(batch, "c4a"), 8, kept)
    check_picks(inside, want, q_ready, w_ready, cache, StepTokens.of(batch, "c4a"), batch.num_tokens)


def test_the_layer_scores_as_words_where_the_triton_select_picks():
    """``scores_as_words``: the Triton select, no V4.1 block restriction, on every dot, rows of segments too (their
    first pass packs the winners' keys from the words); any other call (and the reference's plan) keeps packed
    keys."""
    import dataclasses

    from sparse_mla.indexer_layer import IndexerPlan

    def plan(dot: torch.dtype, cols: int = 8192) -> IndexerPlan:
        return IndexerPlan(None, cols, [], None, torch.empty(0), torch.empty(0), torch.empty(1, 1, 1, dtype=dot))

    layer = SparseMLAIndexer("c4a", 8, 512)
    for dot in (torch.float8_e4m3fn, torch.bfloat16, torch.float32):
        assert layer.scores_as_words(plan(dot))
        assert layer.scores_as_words(plan(dot, MAX_SELECT_COLS))
        assert not layer.scores_as_words(plan(dot), two_level=True)
        assert layer.scores_as_words(plan(dot, MAX_SELECT_COLS + SELECT_SEGMENT))
        assert not SparseMLAIndexer("c4a", 8, 512, topk_select="torch").scores_as_words(plan(dot))
        assert not SparseMLAIndexer("c4a", 8, SELECT_SEGMENT).scores_as_words(plan(dot))
    assert not layer.scores_as_words(dataclasses.replace(plan(torch.bfloat16), q=None))  # the reference's plan


@pytest.mark.parametrize("shape,wave,pages,programs", [
    ((64, 2, 32, 8192), 0, 4, 1024),          # V4-Flash B 32, no known wave: 1024 programs at least
    ((64, 2, 32, 8192), 528, 8, 512),         # an H200's wave (the e4m3 dot: 4 an SM): two waves become one
    ((64, 2, 128, 8192), 0, 16, 1024),        # B 128: 16 pages at most ...
    ((64, 2, 128, 8192), 528, 32, 512),       # ... but 32 where they fit one wave
    ((64, 2, 96, 8192), 528, 8, 1536),        # B 96: 16 pages would leave 768, more than a wave
    ((64, 2, 128, 8256), 528, 16, 1152),      # columns not a multiple of 2,048: 32 pages would leave 640
    ((64, 1, 128, 8192), 528, 16, 1024),      # one token a request: 64-row tiles keep the rule
    ((32, 2, 32, 16384), 528, 8, 1024),       # V4.1's 64-row tiles keep the rule
    ((64, 4096, 1, 9216), 528, 16, 18432),    # a 4K prefill chunk: many waves
    ((64, 1, 1, 64), 528, 1, 1),              # one page
])
def test_the_score_launch_takes_pages_by_its_grid_and_the_gpu_s_wave(shape, wave, pages, programs):
    """``launch_shape``: the pages a program double while the grid keeps 1024 programs, up to 16; where the wave is
    known (the e4m3 dot on sm_90), a grid of full tiles (128 rows) over one wave that twice the pages fit in one takes
    them (up to 32). ``programs``: the launch's grid, as ``index_scores`` makes it."""
    from sparse_mla.ops.triton import indexer as kernels

    heads, query_len, reqs, cols = shape
    hp, qt, got = kernels.launch_shape(heads, query_len, reqs, cols, wave)
    assert got == pages
    assert reqs * -(-query_len // qt) * -(-cols // (64 * got)) == programs


@pytest.mark.parametrize("target", [t.name for t in targets.MATRIX])
def test_the_indexer_s_kernels_launch_as_dependents_on_sm90_and_later_only(target, monkeypatch):
    """``dependent.launch_options``: programmatic dependent launch (``griddepcontrol``) on NVIDIA sm_90 and later, not
    on sm_80-89 (their PTX has no such instruction) nor AMD, not under the interpreter, and off with
    ``SPARSE_MLA_DEPENDENT_LAUNCH=0``."""
    from sparse_mla.ops.triton import dependent

    chosen = next(t for t in targets.MATRIX if t.name == target)
    monkeypatch.setattr(targets, "target_of", lambda device: chosen)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.delenv("SPARSE_MLA_DEPENDENT_LAUNCH", raising=False)
    on = target in ("sm_90", "sm_100", "sm_120") and dependent.TRITON_HAS_DEPENDENT_LAUNCH
    assert dependent.launch_options(torch.device("cpu")) == (
        {"DEPENDENT": True, "launch_pdl": True} if on else {"DEPENDENT": False})
    monkeypatch.setenv("SPARSE_MLA_DEPENDENT_LAUNCH", "0")
    assert dependent.launch_options(torch.device("cpu")) == {"DEPENDENT": False}
    monkeypatch.setenv("SPARSE_MLA_DEPENDENT_LAUNCH", "1")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert dependent.launch_options(torch.device("cpu")) == {"DEPENDENT": False}


@needs_kernels
def test_kernel_helpers_name_their_bad_arguments():
    """The kernels' entry points check what they are handed before any launch: an ``out`` too small for the select (it
    wrote past it), k of 0, float rows (neither packed keys nor words), q of another dtype or weights of another shape
    (read as garbage, or past the tensor), a dot dtype it does not know, kept blocks or positions of other rows, rows
    not of whole blocks."""
    from sparse_mla.ops.triton import indexer as kernels

    packed = torch.randint(0, 1 << 40, (4, 64), device=DEVICE)
    bad_select = [(packed, 8, torch.empty(2, 8, dtype=torch.int32, device=DEVICE), "out must have shape"),
                  (packed, 0, torch.empty(4, 0, dtype=torch.int32, device=DEVICE), "k must be"),
                  (packed.float(), 8, torch.empty(4, 8, dtype=torch.int32, device=DEVICE), "packed must have dtype")]
    for rows, k, out, message in bad_select:
        with pytest.raises(ValueError, match=message):
            kernels.topk_rows(rows, k, out)
    for digit_bits in (12, -1, 8.0, True):
        with pytest.raises(ValueError, match="digit_bits must be None or an int in"):
            kernels.topk_rows(packed, 8, torch.empty(4, 8, dtype=torch.int32, device=DEVICE), digit_bits=digit_bits)
    spec = IndexerSpec(num_heads=8, topk=64, kind="c4a")
    case = make_case(torch.Generator().manual_seed(1), [(300, 1)], spec, "fp8", DEVICE)
    out = torch.empty(1, 128, dtype=torch.int64, device=DEVICE)
    for q, w, dot, message in [(case.q.double(), case.w, torch.float32, "q must have dtype"),
                               (case.q, case.w[:, :4].contiguous(), torch.float32, "weights must have shape"),
                               (case.q, case.w, torch.float64, "dot_dtype must be"),
                               (case.q, case.w, torch.float16, "the float16 dot needs")]:  # float32 q
        with pytest.raises(ValueError, match=message):
            kernels.index_scores(q, w, case.cache, case.step, out, 0, 1, 1, dot, False)
    with pytest.raises(ValueError, match="kept_blocks must have shape"):
        kernels.restrict_to_blocks(packed, torch.zeros(2, 3, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="multiple of 8"):
        kernels.top_blocks_from_packed(packed[:, :60], torch.zeros(4, dtype=torch.int32, device=DEVICE), 4, 4)
    with pytest.raises(ValueError, match="positions must have shape"):
        kernels.top_blocks_from_packed(packed, torch.zeros(3, dtype=torch.int32, device=DEVICE), 4, 4)


@needs_kernels
def test_kernel_rejects_a_workspace_of_the_wrong_kind():
    from sparse_mla.ops.triton import indexer as kernels

    spec = IndexerSpec(num_heads=8, topk=64, kind="c4a")
    case = make_case(torch.Generator().manual_seed(1), [(300, 1)], spec, "fp8", DEVICE)
    with pytest.raises(ValueError, match="a multiple of 8192 columns"):  # words or packed keys alike
        kernels.topk_rows(torch.zeros(1, 16384 + 64, dtype=torch.int32, device=DEVICE), 64,
                          torch.empty(1, 64, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="out must be int64"):
        kernels.index_scores(case.q, case.w, case.cache, case.step, torch.empty(1, 128, device=DEVICE), 0, 1, 1,
                             torch.float32, False)
    odd = IndexerKeyCache(4, "fp8", device=DEVICE, block_size=32)
    with pytest.raises(ValueError, match="cache.block_size must be 64"):
        kernels.index_scores(case.q, case.w, odd, case.step, torch.empty(1, 128, dtype=torch.int64, device=DEVICE),
                             0, 1, 1, torch.float32, False)


def v4_step(lengths: list[tuple[int, int]], seed: int
            ) -> tuple[object, IndexerKeyCache, torch.Tensor, torch.Tensor]:
    """A V4 step of ``lengths`` ((seq_len, new tokens) a request) with its fp8 indexer key cache written and random
    64-head queries and weights: ``(scenario, cache, q, w)``."""
    from sparse_mla.scenario import make_scenario

    sc = make_scenario(lengths, window=4, topk=512, fmt="bf16", decode_threshold=2,
                       block_sizes={"swa": 64, "c4a": 64, "c128a": 2}, device=DEVICE)
    cache = IndexerKeyCache(sc.caches["c4a"].num_blocks, "fp8", device=DEVICE)
    gen = torch.Generator().manual_seed(seed)
    write_step_keys(cache, sc.batch, lengths, gen)
    cap = sc.batch.token_capacity
    q = torch.randn(cap, 64, 128, generator=gen).to(DEVICE, torch.bfloat16)
    return sc, cache, q, torch.randn(cap, 64, generator=gen).to(DEVICE)


def eager_and_replayed(layer: SparseMLAIndexer, sc, q: torch.Tensor, w: torch.Tensor, cache: IndexerKeyCache
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's picks for the step eagerly, and from a CUDA graph of the call (captured after a warm-up on a side
    stream, its output poisoned before the replay)."""
    eager = layer(sc.meta, q, w, cache).clone()  # plans the step (outside the capture)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        layer(sc.meta, q, w, cache)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        picks = layer(sc.meta, q, w, cache)
    picks.fill_(-7)
    graph.replay()
    torch.cuda.synchronize()
    return eager, picks.clone()


def check_against_reference(picks: torch.Tensor, sc, q: torch.Tensor, w: torch.Tensor, cache: IndexerKeyCache
                            ) -> None:
    """``picks`` of :func:`v4_step`'s layer (c4a, 64 heads, top 512) against the reference backend's on the step
    (:func:`indexer_cases.check_picks`)."""
    layer = SparseMLAIndexer("c4a", 64, 512, backend="reference")
    ref = layer(sc.meta, q, w, cache)
    q_ready, w_ready = prepare_queries(q, w, sc.batch.positions, layer.spec)
    check_picks(picks, ref, q_ready, w_ready, cache, StepTokens.of(sc.batch, "c4a"), sc.batch.num_tokens)


@needs_gpu
def test_a_decode_step_is_captured_in_a_cuda_graph_and_replays_the_same_picks():
    sc, cache, q, w = v4_step([(8000 + 97 * r, 2) for r in range(16)], 13)
    eager, replayed = eager_and_replayed(SparseMLAIndexer("c4a", 64, 512), sc, q, w, cache)
    assert torch.equal(replayed, eager)
    check_against_reference(replayed, sc, q, w, cache)


@needs_gpu
@pytest.mark.parametrize("words", [True, False])
def test_dependent_launches_give_the_plain_launches_picks_eager_and_in_a_graph(words, monkeypatch):
    """The indexer's three kernels launched as programmatic dependents (sm_90 and later; elsewhere both runs are plain)
    give the picks of plain launches, eagerly and as a CUDA-graph replay: with the Triton select (the scores as words,
    three dependent kernels) and with ``torch.topk`` (packed keys, read by a plain launch after the dependent scores);
    a step of decodes and a prefill chunk."""
    sc, cache, q, w = v4_step([(6000 + 131 * r, 2) for r in range(24)] + [(700, 37)], 29)
    from sparse_mla.ops.triton import dependent

    runs = {}
    for setting in ("0", "1"):
        monkeypatch.setenv("SPARSE_MLA_DEPENDENT_LAUNCH", setting)
        # on sm_90 and later the second run's launches are dependents indeed
        on = setting == "1" and targets.target_of(DEVICE).dependent_launch and dependent.TRITON_HAS_DEPENDENT_LAUNCH
        assert dependent.launch_options(DEVICE)["DEPENDENT"] == on
        layer = SparseMLAIndexer("c4a", 64, 512, topk_select="triton" if words else "torch")
        runs[setting] = eager_and_replayed(layer, sc, q, w, cache)
    plain = runs["0"][0]
    assert all(torch.equal(picks, plain) for picks in (runs["0"][1], *runs["1"]))
    if words:
        check_against_reference(runs["1"][1], sc, q, w, cache)


@needs_gpu
def test_a_captured_step_replays_later_decodes_and_refuses_one_past_its_columns():
    """A decode step with an indexer captured once (``StepGraph``): a later step of the same builder whose rows fit
    the captured columns replays the eager picks; one whose longest row sees more entries than the capture scored
    is refused, naming why (a replay would have scored it short)."""
    from sparse_mla.batch import Request, StepBatchBuilder, blocks_needed
    from sparse_mla.graphs import StepGraph
    from sparse_mla.metadata import MetadataSpec, build_step_metadata

    sizes = {"swa": 64, "c4a": 64, "c128a": 2}
    builder = StepBatchBuilder(2, 2, 1152, block_sizes=sizes, device=DEVICE)
    tables = [{k: list(range(r * 40, r * 40 + blocks_needed(1152, k, sizes[k]))) for k in sizes} for r in range(2)]
    cache = IndexerKeyCache(80, "fp8", DEVICE)
    gen = torch.Generator().manual_seed(21)
    write_step_keys(cache, builder.build([Request(1152, 1, t) for t in tables]), [(1152, 1)] * 2, gen)
    q = torch.randn(2, 64, 128, generator=gen).to(DEVICE, torch.bfloat16)
    w = torch.randn(2, 64, generator=gen).to(DEVICE)
    layer, spec, picks = SparseMLAIndexer("c4a", 64, 64), MetadataSpec(window=64, topk=64), torch.empty(
        2, 64, dtype=torch.int32, device=DEVICE)
    meta = None

    def step(batch):
        build_step_metadata(batch, spec, out=meta)
        picks.copy_(layer(meta, q, w, cache))

    first = builder.build([Request(1000, 1, tables[0]), Request(700, 1, tables[1])])  # 250 entries: 256 columns
    meta = build_step_metadata(first, spec)
    graph = StepGraph(step, first, meta)
    later = builder.build([Request(1020, 1, tables[0]), Request(900, 1, tables[1])])  # 255: within them
    assert graph.mismatch(later) is None
    graph.replay(later)
    replayed = picks.clone()
    step(later)
    assert torch.equal(replayed, picks)
    past = builder.build([Request(1030, 1, tables[0]), Request(900, 1, tables[1])])  # 257
    reason = "a request sees 257 entries, the captured indexer scores 256 a row: capture another graph"
    assert graph.mismatch(past) == reason
    with pytest.raises(ValueError, match=reason):
        graph.replay(past)


# ---- every target of the portability matrix ------------------------------------------------------------------------


FAMILIES = ("sm_80", "sm_89", "sm_90", "sm_100", "gfx942")  # every variant compiled; elsewhere the two main ones


def compile_rows(target_name: str) -> list[dict]:
    """The indexer kernels' launches (``compressor_compile.indexer_launches``: scores over fp8 and bf16 keys, decode
    64 heads and prefill 32 heads, as packed keys and as words; the query prep, V4 and V3.2, into bf16 and where the
    dot takes e4m3 into e4m3; the select over both, plain and converting its picks in its launch) recorded on CPU
    tensors and compiled for ``target_name`` (``scripts/portability_report.py``'s compile check)."""
    from dataclasses import asdict

    from compressor_compile import compile_launch, indexer_launches

    target = next(t for t in targets.MATRIX if t.name == target_name)
    return [asdict(compile_launch(target, variant, c))
            for variant, calls in indexer_launches(target, target_name in FAMILIES) for c in calls]


@pytest.mark.parametrize("target", [t.name for t in targets.MATRIX])
def test_indexer_kernel_compiles_and_fits_on_every_target(target):
    from sparse_mla.ops.triton import indexer as kernels

    done = compile_child("tests/test_indexer_triton.py", target)
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    family = target in FAMILIES  # the V3.2 query prep too
    # the score launches packed and as words (fp8 keys; with the family bf16 keys and a prefill), the V4 prep (and
    # V3.2's), the selects (two of a segmented row, the first of a longer one as words, V3.2's rows of words whole,
    # the winners of many rows; over packed keys and words, two each; two converting words over more rows than the
    # SMs);
    # where the dot takes e4m3, its score launch packed and as words and the prep into e4m3 (V4, and V3.2); elsewhere
    # the float16 dot's, and the prep into float16
    assert len(rows) == (19 if family else 14) + (4 if family else 3), \
        f"exit {done.returncode}: {done.stderr[-2000:]}"
    for r in rows:
        print(f"{r['target']:8} {r['variant']:28} regs {r['registers']} spills {r['spill_stores']}/{r['spill_loads']} "
              f"in loop {r['loop_spills']} shared {r['shared']}/{r['shared_limit']}")
    failed = [f"{r['variant']}: {r['error']}" for r in rows if r["status"] != "ok"]
    assert not failed, f"{target}: " + "; ".join(failed)
    if target.startswith("sm_") or target in ("gfx942", "gfx950"):  # (AMD's compiles attribute no spill to a loop)
        assert all(not r["loop_spills"] for r in rows), "no spills inside the key loop"
    # the digit search's selects over more rows than the SMs: capped at two programs an SM (ptxas keeps a cap, so this
    # checks that the launch passed it; what the cap costs in spills, the loop check above and the report's columns)
    t = next(t for t in targets.MATRIX if t.name == target)
    if target.startswith("sm_") and kernels.HISTOGRAM_BY_ATOMICS:
        by_variant = {r["variant"]: r for r in rows}
        for lanes, n in capped_selects(t):  # (8,192 and 9,216 columns: their tiles' lanes as many)
            cap = kernels.select_maxnreg(t, kernels.select_warps(n, lanes, t.sms, True), lanes, n, t.sms, keys=False)
            assert cap and by_variant[capped_select_variant(lanes, n)]["registers"] <= cap, (lanes, n)
    # every indexer kernel waits for the one before it where it launches as a programmatic dependent (sm_90 and
    # later, a Triton with griddepcontrol), and nowhere else (sm_80-89's PTX has no such instruction)
    from sparse_mla.ops.triton.dependent import TRITON_HAS_DEPENDENT_LAUNCH

    on = target in ("sm_90", "sm_100", "sm_120") and TRITON_HAS_DEPENDENT_LAUNCH
    assert {r["dependent"] for r in rows} == ({on} if target.startswith("sm_") else {None})


@pytest.mark.parametrize("default", ["0", "1"])
def test_the_score_kernel_fuses_its_head_sum_whatever_triton_s_default(default):
    """Compiled for sm_90 under ``TRITON_DEFAULT_FP_FUSION`` 0 (Triton 3.10's default) or 1 (3.6-3.9's): the decode
    score kernel's PTX holds its fused multiply-adds (the chained head sum, measured fused: its launch asks for
    fusion) and the query prep's none (it rounds each step as the reference does)."""
    done = compile_child("tests/compressor_compile.py", "--target", "sm_90", "--fma",
                         env_vars={"TRITON_DEFAULT_FP_FUSION": default})
    assert done.returncode == 0, done.stderr[-2000:]
    counts = json.loads(done.stdout.splitlines()[-1])
    assert counts["scores"] > 0 and counts["prep"] == 0, counts  # (unfused, the scores hold none: 64 fused)


if __name__ == "__main__":
    for row in compile_rows(sys.argv[1]):
        print(json.dumps(row), flush=True)


@pytest.mark.skipif(ON_GPU or not KERNEL_RUNS, reason="--smoke is the CPU interpreter's run (a GPU box runs the "
                    "benchmark itself)")
def test_benchmark_smoke_writes_the_expected_json(tmp_path, monkeypatch):
    import argparse
    import importlib.util

    bench = ROOT / "benchmarks"
    monkeypatch.syspath_prepend(str(bench))
    spec = importlib.util.spec_from_file_location("bench_indexer", bench / "bench_indexer.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_indexer", module)
    spec.loader.exec_module(module)
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    args = parser.parse_args(["--smoke", "--rep", "1", "--cases", "v4-flash-b2", "v32-b2", "--out", str(tmp_path)])
    assert module.run(args) == 0
    result = json.loads((tmp_path / "bench_indexer.json").read_text())
    assert [r["case"] for r in result["cases"]] == ["v4-flash-b2", "v32-b2"] and result["copy_gbs"] > 0
    for r in result["cases"]:
        assert r["rows_equal_reference"] == 1.0
        assert all(r[k] > 0 for k in ("layer_us", "prep_us", "scores_us", "topk_us", "topk_torch_us", "torch_us",
                                      "key_read_us"))
        # a layer's parts in a step (one chunk of words: both cases): the preps, the preps and scores, whole layers
        assert all(r[k] > 0 for k in ("prep_in_step_us", "prep_scores_in_step_us", "whole_in_step_us"))
        assert r["scores_added_us"] == r["prep_scores_in_step_us"] - r["prep_in_step_us"]
        assert r["topk_added_us"] == r["whole_in_step_us"] - r["prep_scores_in_step_us"]


def test_the_plan_bounds_the_workspace_for_a_16k_chunk_on_a_1m_context():
    """Planning only (no launch): the packed scores of each token chunk fit the layer's budget, and every token of
    the step is in exactly one chunk, whatever the context."""
    from sparse_mla.batch import Request, StepBatchBuilder, blocks_needed
    from sparse_mla.metadata import MetadataSpec, build_step_metadata

    seq, chunk = 1 << 20, 16384
    kinds = ("swa", "c4a")  # the indexer's step needs no c128a lists
    builder = StepBatchBuilder(chunk + 2, 2, seq, kinds, decode_threshold=2)
    batch = builder.build([Request(seq, q, {k: list(range(r * blocks_needed(seq, k), (r + 1) * blocks_needed(seq, k)))
                                            for k in kinds}) for r, q in enumerate((2, chunk))])
    meta = build_step_metadata(batch, MetadataSpec(128, 512))
    layer = SparseMLAIndexer("c4a", 64, 512, workspace_bytes=256 << 20)
    plan = layer.step_plan(meta, "triton")
    assert plan.num_cols == seq // 4 and plan.workspace.numel() * 8 <= 256 << 20
    for chunks, most in ((plan.chunks, plan.workspace.shape[0]), (plan.word_chunks, 2 * plan.workspace.shape[0])):
        covered = [t for t0, t1, _ in chunks for t in range(t0, t1)]
        assert covered == list(range(batch.num_tokens))
        assert all(longest <= t1 - t0 <= most for t0, t1, longest in chunks)


@needs_gpu
@pytest.mark.parametrize("lengths", [[(1 << 20, 2), ((1 << 20) - 777, 2)], [(32768, 16384)]],
                         ids=["decode-1m", "prefill-16k"])
def test_a_1m_context_and_a_16k_prefill_chunk_run_and_match_the_reference(lengths):
    from sparse_mla.batch import Request, StepBatchBuilder, blocks_needed
    from sparse_mla.metadata import MetadataSpec, build_step_metadata

    kinds = ("swa", "c4a")  # the indexer's step needs no c128a lists
    seq = max(s for s, _ in lengths)
    builder = StepBatchBuilder(sum(q for _, q in lengths), len(lengths), seq, kinds, decode_threshold=2,
                               device=DEVICE)
    requests = [Request(s, q, {k: [r * blocks_needed(seq, k) + b for b in range(blocks_needed(s, k))] for k in kinds})
                for r, (s, q) in enumerate(lengths)]
    first = len(lengths) * blocks_needed(seq, "c4a")
    batch = builder.build(requests)
    meta = build_step_metadata(batch, MetadataSpec(128, 512))
    cache = IndexerKeyCache(first, "fp8", device=DEVICE)
    cache.poison()
    gen = torch.Generator(device=DEVICE).manual_seed(3)
    for r, (s, _) in enumerate(lengths):
        entries = torch.arange(s // 4, dtype=torch.int32, device=DEVICE)
        cache.write(torch.randn(len(entries), 128, device=DEVICE, generator=gen), batch.entry_slots("c4a", r, entries))
    cap = batch.token_capacity
    q = torch.randn(cap, 64, 128, device=DEVICE, generator=gen).to(torch.bfloat16)
    w = torch.randn(cap, 64, device=DEVICE, generator=gen)
    layer = SparseMLAIndexer("c4a", 64, 512, workspace_bytes=128 << 20)
    got = layer(meta, q, w, cache)
    ref = SparseMLAIndexer("c4a", 64, 512, backend="reference")(meta, q, w, cache)
    q_ready, w_ready = prepare_queries(q, w, batch.positions, layer.spec)
    check_picks(got, ref, q_ready, w_ready, cache, StepTokens.of(batch, "c4a"), batch.num_tokens)


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=needs_kernels)])
def test_v41_layers_20_to_27_select_blocks_once_and_pick_inside_them(backend):
    """V4.1-Flash's layers 20-27 (c1a): 20 is the last kv source (its keys, its blocks), 24 an index source that
    rescores 20's keys with its own queries inside 20's blocks, the others reuse the latest picks."""
    from sparse_mla.config import V41_KINDS, get_config
    from sparse_mla.indexer_layer import indexer_role
    from sparse_mla.scenario import make_scenario

    cfg = get_config("deepseek-v4.1-flash")
    lengths = [(sized(3000, 40000), 2), (sized(1500, 20000), 3)]
    sc = make_scenario(lengths, window=4, topk=32, fmt="bf16", decode_threshold=2, kinds=V41_KINDS,
                       block_sizes={"swa": 64, "c2a": 64, "c1a": 64}, device=DEVICE)
    batch = sc.batch
    keys = IndexerKeyCache(sc.caches["c1a"].num_blocks, "fp8", device=DEVICE)
    keys.poison()
    gen = torch.Generator().manual_seed(21)
    for r, (seq, _) in enumerate(lengths):
        entries = torch.arange(seq, dtype=torch.int32, device=DEVICE)
        keys.write(torch.randn(seq, 128, generator=gen).to(DEVICE), batch.entry_slots("c1a", r, entries))
    indexer = SparseMLAIndexer("c1a", 32, 32, q_format="bf16", backend=backend)  # a bf16 dot: exact sets
    cap = batch.token_capacity
    picks, kept, used = {}, None, {}
    for layer in range(20, 28):
        role = indexer_role(cfg, layer)
        assert role.kv_source == 20
        if not role.runs:
            picks[layer] = picks[role.index_source]
            continue
        q = torch.randn(cap, 32, 128, generator=gen).to(DEVICE)
        w = torch.randn(cap, 32, generator=gen).to(DEVICE)
        used[layer] = (q, w)
        if role.two_level == "select":
            got, kept = indexer(sc.meta, q, w, keys, select_blocks=True)
            kept = kept.clone()
        else:
            got = indexer(sc.meta, q, w, keys, kept_blocks=kept)
        picks[layer] = got.clone()
    assert set(used) == {20, 24} and all(torch.equal(picks[i], picks[20]) for i in (21, 22, 23))
    step = StepTokens.of(batch, "c1a")
    for layer, (q, w) in used.items():
        q_ready, w_ready = prepare_queries(q, w, batch.positions, indexer.spec)
        want_kept = top_blocks_reference(q_ready, w_ready, keys, step) if layer == 20 else None
        if layer == 20:
            same_sets(kept, want_kept, batch.num_tokens)
        want = index_topk_reference(q_ready, w_ready, keys, step, 32, kept_blocks=kept)
        same_sets(picks[layer], want, batch.num_tokens)
        for t in range(batch.num_tokens):  # every pick inside the kept blocks, the newest block kept
            inside = set(kept[t].tolist()) - {-1}
            assert {int(x) // 8 for x in picks[layer][t].tolist() if x >= 0} <= inside
            assert (int(batch.positions[t])) // 8 in inside


@needs_kernels
@given(kind=st.sampled_from(["c4a", "c2a", "c1a", "dsa"]), heads=st.integers(1, 20),
       fmt=st.sampled_from(["fp8", "bf16"]),
       q_format=st.sampled_from(["fp8", "bf16"]), topk=st.sampled_from([8, 64, 128]),
       requests=st.lists(st.tuples(st.integers(1, 700), st.integers(1, 9)), min_size=1, max_size=4),
       seed=st.integers(0, 2**31 - 1))
def test_kernels_equal_the_reference_on_random_steps(kind, heads, fmt, q_format, topk, requests, seed):
    """Any head count, top-k, kind, key and query format, decodes and prefills (query_len <= seq_len) mixed."""
    spec = IndexerSpec(num_heads=heads, topk=topk, kind=kind, q_format=q_format)
    requests = [(max(s, q), q) for s, q in requests]
    case = make_case(torch.Generator().manual_seed(seed), requests, spec, fmt, DEVICE)
    ref = index_topk_reference(case.q, case.w, case.cache, case.step, topk)
    got, _ = kernel_picks(case, topk, rows=1 + seed % 7)
    check_picks(got, ref, case.q, case.w, case.cache, case.step, case.num_tokens)


@needs_kernels
@pytest.mark.parametrize("kind,heads,seed", [("c4a", 64, 21), ("c2a", 32, 22)])
def test_fp8_picks_recall_the_float64_top_k_of_the_values_they_read(kind, heads, seed):
    """fp8 keys and e4m3 q: the kernels' picks hold at least 0.99 of the float64 top-k computed from the values the
    kernels read (the cache's dequantised keys, the prepared q and weights), on i.i.d. Gaussian keys (the densest
    top-k boundary); on a GPU the e4m3 tensor-core dot's narrower accumulation is what can swap a near-tie. Against
    the keys before quantisation, e4m3's rounding itself swaps near-ties (test_indexer.py's float64 oracle test)."""
    spec = IndexerSpec(num_heads=heads, topk=128, kind=kind, q_format="fp8")
    gen = torch.Generator().manual_seed(seed)
    scale = 4 // spec.ratio
    case = make_case(gen, [(2400 // scale, 2), (1500 // scale, 1), (700 // scale, 3)], spec, "fp8", DEVICE)
    picks, _ = kernel_picks(case, spec.topk)
    picks = picks.cpu()
    bs = case.cache.block_size
    hits = size = 0
    for t in range(case.num_tokens):
        r, n = int(case.step.token_to_req[t]), (int(case.step.positions[t]) + 1) // spec.ratio
        table = case.step.block_table[r].long().cpu()
        slots = torch.tensor([int(table[e // bs]) * bs + e % bs for e in range(n)], device=case.cache.device)
        keys = case.cache.read(slots).double()
        scores = (case.w[t].double()[:, None] * torch.relu(case.q[t].double() @ keys.T)).sum(0).cpu()
        k = min(spec.topk, n)
        top = set(torch.topk(scores, k).indices.tolist())
        hits += len(top & set(picks[t, :k].tolist()))
        size += k
    assert hits / size >= 0.99, f"recall {hits / size:.4f}"
