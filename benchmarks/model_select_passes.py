"""A numpy model of the select's threshold search (``ops/triton/indexer.py``'s ``_digit_search`` over rows of words):
how many histogram passes each row of simulated scores takes before exactly k words lie at or above its threshold,
the search started as the kernel starts it (the largest word and the floor of ``select_floor``'s groups in the runs
layout, the first pass counted from the top), or from a tighter floor (each group's ``--floor-rank``-th largest,
``k / rank`` groups: still k or more words at or above it). The rows are indexer scores of random inputs, as the
benchmark's: ``Σ_h w_h · ReLU(q_h · k_j)`` with ``q``, ``k`` and ``w`` standard normal, float32 (no fp8 rounding). A
launch waits for its slowest row. CPU only; the model checks that each row's threshold leaves the exact top k (or
the words tied with the k-th largest) at or above it. Docs/history.md version 50.

    python benchmarks/model_select_passes.py [--heads 64] [--entries 8192] [--k 512] [--warps 16] [--rows 64]
"""
from __future__ import annotations

import argparse

import numpy as np

from sparse_mla.ops.triton.indexer import SELECT_DIGIT_BITS, SELECT_VECTOR, select_floor

DIM = 128  # an indexer head's q·k length


def score_words(scores: np.ndarray) -> np.ndarray:
    """float32 scores -> the select's words (uint64 holding uint32 order bits: unsigned order = the scores' order)."""
    bits = scores.astype(np.float32).view(np.uint32).astype(np.uint64)
    return np.where(bits >> 31, ~bits & 0xFFFFFFFF, bits | 0x80000000)


def floor_of(words: np.ndarray, k: int, threads: int, rank: int) -> int:
    """The search's floor: with ``rank`` 1, the kernel's (``select_floor``'s groups, a thread's vectors of the same
    index modulo the groups a thread; the least valid word where the rule takes none); else the least of ``k / rank``
    contiguous groups' ``rank``-th largest words."""
    if rank > 1:
        groups = -(-k // rank)
        return int(np.sort(words.reshape(groups, -1), axis=1)[:, -rank].min())
    groups = select_floor(threads, words.size, k, True)
    if not groups:
        return int(words.min())
    per_thread = groups // threads  # each thread's run of vectors, in `per_thread` interleaved groups
    runs = words.reshape(threads, -1, per_thread, SELECT_VECTOR)  # (thread, vector // per_thread, group, lane)
    return int(runs.max(axis=(1, 3)).min())


def search_passes(words: np.ndarray, k: int, floor: int) -> tuple[int, int, int]:
    """``_digit_search`` from the largest word and ``floor`` (at least 1): ``(passes, threshold, count)``, the count
    of words at or above the threshold (``k``, or more where the k-th largest word is tied)."""
    top, floor = int(words.max()), max(floor, 1)
    bit = (top ^ floor).bit_length() - 1
    thr = top & ~((1 << (bit + 1)) - 1)
    passes, count = 0, None
    while bit >= 0 and count != k:
        shift = max(bit + 1 - SELECT_DIGIT_BITS, 0)
        settled = words >> (bit + 1) << (bit + 1)
        in_play = settled == thr
        above = int((settled > thr).sum())  # 0 on the first pass: thr holds the largest word's bits
        digits = (words[in_play] >> shift) & ((1 << (bit + 1 - shift)) - 1)
        at_or_above = np.cumsum(np.bincount(digits.astype(np.int64), minlength=1 << SELECT_DIGIT_BITS)[::-1])[::-1]
        best = int(np.nonzero(above + at_or_above >= k)[0].max())
        thr, count, bit = thr | best << shift, above + int(at_or_above[best]), shift - 1
        passes += 1
    return passes, thr, count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, default=64)
    parser.add_argument("--entries", type=int, default=8192, help="a row's words (a power of two)")
    parser.add_argument("--k", type=int, default=512)
    parser.add_argument("--warps", type=int, default=16, help="the select's warps (select_warps)")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--floor-rank", type=int, nargs="+", default=[1])
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    passes = {rank: [] for rank in args.floor_rank}
    for _ in range(args.rows):
        q = rng.standard_normal((args.heads, DIM), dtype=np.float32)
        keys = rng.standard_normal((args.entries, DIM), dtype=np.float32)
        weights = rng.standard_normal(args.heads, dtype=np.float32)
        words = score_words((np.maximum(q @ keys.T, 0) * weights[:, None]).sum(0))
        kth = int(np.sort(words)[-args.k])
        for rank in args.floor_rank:
            n, thr, count = search_passes(words, args.k, floor_of(words, args.k, 32 * args.warps, rank))
            # the words at or above the threshold: the top k, or (ties) the words at or above the k-th largest
            assert count == int((words >= thr).sum()) and words[words >= thr].min() == kth, (thr, kth, count)
            passes[rank].append(n)
    for rank, counts in passes.items():
        hist = np.bincount(counts)
        print(f"floor rank {rank}: rows by passes " + ", ".join(f"{n}: {c}" for n, c in enumerate(hist) if c))


if __name__ == "__main__":
    main()
