"""The lightning indexer's Triton kernels: the query prep, the scores over the paged key cache packed for a
deterministic top-k, and the select.

Reference and formulas: :mod:`sparse_mla.indexer`. One program takes a tile of ``QT`` query tokens of one request —
all their heads, ``M = QT · HP`` rows (``HP`` = the heads padded to a power of two, the padding weighted 0) — and
``PAGES`` key pages of 64 entries: per page one ``tl.dot`` of the page's keys ``(64, 128)`` against ``q (M, 128)``
(fp8 codes or bf16 keys), ReLU, the head weights, the sum over each token's heads, then each key's float32 scale
(DeepGEMM's ``ReLU(q·k·sf)``, the same value: the scales are positive powers of two). So a decode request's keys
are read once for all its tokens and heads; the program's block numbers are read once, so the pipeliner keeps
``STAGES - 1`` pages in flight.

Each score is stored *packed* into an int64 with its entry: ``(order-preserving bits of the float32 score) << 32 |
(2^32 - 1 - entry)``, so every key of a row is distinct, larger means a higher score and, among equal scores, a lower
entry; an entry the token may not see (``(w + 1)·r > p + 1``, a block number ``-1`` or past the cache) stores
``INT64_MIN``. The top-k of a row is then a unique set, ties to the lowest entry, whatever the select's order of work:
the Triton select (:func:`topk_rows`) or ``torch.topk`` over the int64 keys (:func:`topk_from_packed`), both CUDA-graph
capturable. -0.0 is stored as +0.0 (ReLU zeros weighted by a negative weight), so the order is the float order. Rows the
Triton select takes (no V4.1 block restriction; rows past :data:`MAX_SELECT_COLS` in segments or whole) may be stored as
*words* instead: int32, the high word's order bits alone as an unsigned value (the sign bit flipped; 0: no candidate, a
candidate at least 1: the one score whose bits would give 0, a NaN of all ones, counts as 1, as ``torch.topk`` keeps it,
where the select over packed keys, reading their high words alone, takes it for none — non-finite scores only), the
entry being the column. Half the bytes written and read; the select's loads of them are contiguous (16 B each), where
the packed rows' high words lie 8 B apart (docs/history.md versions 33-34; the layer decides where:
:meth:`sparse_mla.indexer_layer.SparseMLAIndexer.scores_as_words`).

The query prep (:func:`prepare_queries`) is one launch per layer, bit for bit the reference's. The three kernels
are launched as programmatic dependents where the GPU has them (:mod:`.dependent`: each starts while the one before
it finishes).

The workspace is ``(rows, num_cols)`` int64 (or twice the rows of words) with ``num_cols`` ≥ the step's longest
request's entries (a multiple of 64, at least ``topk``): the layer sizes the row chunk to its workspace budget
(:mod:`sparse_mla.indexer_layer`). V4.1's two-level selection works on the same packed rows
(:func:`top_blocks_from_packed`, :func:`restrict_to_blocks`).
"""
from __future__ import annotations

import inspect
import re
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..._checks import check_no_overlap, check_positive_int, check_rows_apart, check_tensor, is_int
from ...indexer import (BLOCK_ENTRIES, MAX_SELECT_COLS, SELECT_SEGMENT, StepTokens, check_query_shape,
                        check_step_inputs, select_kernel_takes)
from ...indexer_cache import INDEX_HEAD_DIM, IndexerKeyCache
from .. import targets
from ..dispatch import interpreting
from ..fp8 import e4m3_as_f16, e4m3_decode, e4m3_f16_ptx, e4m3_gain
from ..launch import fp_fusion, on_device_of, register_cap
from .cache import round_half_even
from .dependent import launch_options, wait_for_previous
from .index import table_slots

_VERSION_DIGITS = re.match(r"(\d+)\.(\d+)", triton.__version__)
# the installed Triton's (major, minor), by its leading digits ((0, 0) without them): how it lowers a reduction or a
# histogram decides two launch choices below (heads_chained, select_digit_bits)
TRITON_VERSION = tuple(map(int, _VERSION_DIGITS.groups())) if _VERSION_DIGITS else (0, 0)
# Triton 3.8+ reduces a thread's own values in a tree (3.6-3.7: in a chain, which fuses each product into its add)
SUM_BY_TREE = TRITON_VERSION >= (3, 8)
INT64_MIN = -(2 ** 63)  # the packed key of an entry that is not a candidate
_LOW_MASK = 0xFFFFFFFF
ROWS_PER_TILE = 128  # M: query rows (tokens × padded heads) per program's dot
MAX_PAGES_PER_PROGRAM = 16
TARGET_PROGRAMS = 1024  # grid size the pages-per-program choice aims at (several waves on a 132-SM GPU)
# where the GPU's wave is known (the e4m3 dot on sm_90: four programs an SM, the register cap), a grid of full tiles
# (ROWS_PER_TILE rows) just over one wave takes twice the pages, up to 32, and fits one: an H200, alternating with the
# rule above, V4-Flash B 32 38.1 -> 37.0 us a layer (4 -> 8 pages, 1,024 -> 512 programs), B 128 83.4 -> 81.9 (16 ->
# 32); a 4K prefill chunk (18,432 programs) ran 4 % slower at 32 pages, and keeps 16 (docs/history.md version 34)
WAVE_PROGRAMS_PER_SM, WAVE_MAX_PAGES = 4, 32


@triton.jit
def _fma_last2(r, w, acc):
    """``acc + r[..., 0]·w[..., 0] + r[..., 1]·w[..., 1]``, in that order (two fused multiply-adds)."""
    ra, rb = tl.split(r)
    wa, wb = tl.split(w)
    return acc + ra * wa + rb * wb


@triton.jit
def _halves(r, w):
    """``r`` and ``w`` ``(A, B, C, 2N)`` split into their even and odd entries of the last dimension, ``(A, B, C, N)``
    each: ``(r_even, r_odd, w_even, w_odd)``."""
    A: tl.constexpr = r.shape[0]
    B: tl.constexpr = r.shape[1]
    C: tl.constexpr = r.shape[2]
    N: tl.constexpr = r.shape[3] // 2
    r_even, r_odd = tl.split(tl.reshape(r, (A, B, C, N, 2)))
    w_even, w_odd = tl.split(tl.reshape(w, (A, B, C, N, 2)))
    return r_even, r_odd, w_even, w_odd


@triton.jit
def _fma_last4(r, w, acc):
    """:func:`_fma_last2`'s chain over a last dimension of 4: the even entries, then the odd (one function a width:
    Triton's JIT calls no function recursively)."""
    r_even, r_odd, w_even, w_odd = _halves(r, w)
    return _fma_last2(r_odd, w_odd, _fma_last2(r_even, w_even, acc))


@triton.jit
def _fma_last8(r, w, acc):
    """The chain over a last dimension of 8."""
    r_even, r_odd, w_even, w_odd = _halves(r, w)
    return _fma_last4(r_odd, w_odd, _fma_last4(r_even, w_even, acc))


@triton.jit
def _fma_last16(r, w, acc):
    """The chain over a last dimension of 16."""
    r_even, r_odd, w_even, w_odd = _halves(r, w)
    return _fma_last8(r_odd, w_odd, _fma_last8(r_even, w_even, acc))


@triton.jit
def _fma_last32(r, w, acc):
    """The chain over a last dimension of 32 (128 padded heads)."""
    r_even, r_odd, w_even, w_odd = _halves(r, w)
    return _fma_last16(r_odd, w_odd, _fma_last16(r_even, w_even, acc))


@triton.jit
def _lanes_first(tile, PAGE: tl.constexpr, QT: tl.constexpr, J: tl.constexpr):
    """``tile (PAGE, QT · 8J)`` seen as ``(PAGE, QT, J, 4, 2)`` with its lane dimension (a column's bits 1-2) moved
    ahead: ``(PAGE, QT, 4, 2J)``, a thread's columns of a token last."""
    return tl.reshape(tl.permute(tl.reshape(tile, (PAGE, QT, J, 4, 2)), (0, 1, 3, 2, 4)), (PAGE, QT, 4, 2 * J))


@triton.jit
def _head_sum_chained(relu_t, w, PAGE: tl.constexpr, QT: tl.constexpr, HP: tl.constexpr):
    """``Σ_h relu_t[:, (t, h)] · w[(t, h)]`` for ``relu_t (PAGE, QT · HP)`` float32 (the dot's tile, ReLU'd) and
    ``w (QT · HP,)``: ``(PAGE, QT)``, each thread's heads in one chain of fused multiply-adds, then a sum over lanes.

    The NVIDIA dot layouts (mma.sync, wgmma) hold a column's bits 1-2 in the lanes and the rest in registers: seen as
    ``(PAGE, QT, HP / 8, 4, 2)`` and the lane dimension moved ahead of the register ones, a thread's heads are the
    last dimension, which the splits peel off in registers (mma.sync's tile spreads a token's heads over the warps
    too: one layout conversion first). ``tl.sum`` over the heads reduces a thread's as a tree on Triton 3.9 (a multiply
    and an add where the chain fuses both: the wgmma page loop 314 -> 286 SASS instructions; 3.6 chains them itself)
    and, on mma.sync, across the warps by shuffles and shared memory (sm_80 / sm_89 / sm_120 page loops 11-39 %
    shorter chained, Triton 3.6 and 3.9: the most where no integer fp8 decode shares the loop; docs/history.md
    version 38)."""
    J: tl.constexpr = HP // 8
    tl.static_assert(8 <= HP and HP <= 128, "the chained head sum takes 8 to 128 padded heads")
    relu = _lanes_first(relu_t, PAGE, QT, J)
    w_tile = _lanes_first(tl.broadcast_to(w[None, :], (PAGE, QT * HP)), PAGE, QT, J)
    acc = tl.zeros((PAGE, QT, 4), tl.float32)
    if J == 16:
        acc = _fma_last32(relu, w_tile, acc)
    elif J == 8:
        acc = _fma_last16(relu, w_tile, acc)
    elif J == 4:
        acc = _fma_last8(relu, w_tile, acc)
    elif J == 2:
        acc = _fma_last4(relu, w_tile, acc)
    else:
        acc = _fma_last2(relu, w_tile, acc)
    return tl.sum(acc, 2)


@triton.jit
def _packed_key(order, entry):
    """The packed key of a score's ``order`` bits (int32: signed-int order = the scores' order) and its ``entry``:
    ``order`` in the high word, ``2^32 - 1 - entry`` in the low one (int64; the module docstring's layout, which the
    score kernel stores and the select over a long row's segments of words packs again)."""
    return (order.to(tl.int64) << 32) | (4294967295 - entry.to(tl.int64))


@triton.jit
def _index_scores_kernel(
    q_ptr, w_ptr, data_ptr, scale_ptr, positions_ptr, qsl_ptr, table_ptr, out_ptr,
    t0, t1, H, ratio, num_blocks, table_stride, max_pages, out_stride, num_cols,
    HP: tl.constexpr, QT: tl.constexpr, PAGES: tl.constexpr, PAGE: tl.constexpr, D: tl.constexpr,
    FP8: tl.constexpr, NATIVE_FP8: tl.constexpr, DOT_DTYPE: tl.constexpr, FP8_DOT: tl.constexpr,
    STAGES: tl.constexpr, WORDS: tl.constexpr = False, DEPENDENT: tl.constexpr = False,
    CHAINED: tl.constexpr = False, PTX_DECODE: tl.constexpr = False,
):
    """Packed scores (``WORDS``: words) of one request's tile of ``QT`` tokens × ``HP`` heads against ``PAGES`` key
    pages, one dot per page. The page's entries are the dot's rows and the (token, head) pairs its columns, so the
    weighted sum over heads reduces along each thread's own columns (and a few lane shuffles), not across the warps'
    rows through shared memory (the other orientation: 1.4x slower on an H200, docs/history.md version 23)."""
    wait_for_previous(DEPENDENT)  # before any early return: the kernel completes after the one before it
    req = tl.program_id(0)
    tile = tl.program_id(1)
    group = tl.program_id(2)
    lo = tl.maximum(tl.load(qsl_ptr + req), t0)
    hi = tl.minimum(tl.load(qsl_ptr + req + 1), t1)
    tok0 = lo + tile * QT
    if tok0 >= hi:  # this request has no tokens in this tile
        return
    M: tl.constexpr = QT * HP
    rows = tl.arange(0, M)
    d = tl.arange(0, D)
    row_tok = tok0 + rows // HP
    head = rows % HP
    row_ok = (row_tok < hi) & (head < H)
    q_off = (row_tok.to(tl.int64) * H + head) * D
    q = tl.load(q_ptr + q_off[:, None] + d[None, :], mask=row_ok[:, None], other=0.0).to(DOT_DTYPE)
    q_t = tl.trans(q)  # (128, M), the dot's second operand: taken once, outside the page loop
    w = tl.load(w_ptr + row_tok.to(tl.int64) * H + head, mask=row_ok, other=0.0)
    toks = tok0 + tl.arange(0, QT)
    tok_ok = toks < hi
    visible = (tl.load(positions_ptr + toks, mask=tok_ok, other=-1) + 1) // ratio  # entries each token sees
    e = tl.arange(0, PAGE)
    out_rows = (toks - t0).to(tl.int64) * out_stride
    # the program's block numbers in one load: a page's key address then depends on the loop index alone, so the
    # pipeliner keeps STAGES - 1 pages' keys and scales in flight (a block number read per page made each page's
    # keys a dependent load, issued one page ahead at best: 1.5x slower at B 128, docs/history.md version 24)
    program_pages = group * PAGES + tl.arange(0, PAGES)
    blocks = tl.load(table_ptr + req.to(tl.int64) * table_stride + program_pages, mask=program_pages < max_pages,
                     other=-1)
    for j in tl.range(PAGES, num_stages=STAGES):
        page = group * PAGES + j
        block = tl.sum(tl.where(tl.arange(0, PAGES) == j, blocks, 0), 0)
        block_ok = (block >= 0) & (block < num_blocks)
        base = tl.where(block_ok, block, 0).to(tl.int64) * (PAGE * D)
        key_ok = e + tl.where(block_ok, 0, PAGE) < PAGE  # the block's validity as a (PAGE,) mask
        code_base = base * (D + 4) // D  # fp8 page: [PAGE × 128 codes][PAGE × float32 scales]
        if FP8_DOT:  # the codes as they are, (PAGE, 128): dims contiguous; loaded as e4m3, not bitcast after the
            # load, so the dot reads them from shared memory (a bitcast made them a register operand: 18 more
            # registers a thread, and an ldmatrix a page)
            keys = tl.load(data_ptr.to(tl.pointer_type(tl.float8e4nv)) + code_base + e[:, None] * D + d[None, :],
                           mask=key_ok[:, None], other=0.0)
            col_scale = tl.load(scale_ptr + code_base // 4 + PAGE * D // 4 + e, mask=key_ok, other=0.0)
        else:
            if FP8:
                raw = tl.load(data_ptr + code_base + e[:, None] * D + d[None, :], mask=key_ok[:, None], other=0)
                if DOT_DTYPE == tl.float16:  # the integer decode's fp16 values as they are (no float32 between)
                    if PTX_DECODE:
                        keys = e4m3_f16_ptx(raw)
                    else:
                        keys = e4m3_as_f16(raw)
                else:
                    keys = e4m3_decode(raw, NATIVE_FP8)
                col_scale = tl.load(scale_ptr + code_base // 4 + PAGE * D // 4 + e, mask=key_ok,
                                    other=0.0) * e4m3_gain(NATIVE_FP8)
            else:
                keys = tl.load(data_ptr + base + e[:, None] * D + d[None, :], mask=key_ok[:, None], other=0.0)
                keys = keys.to(tl.float32)
                col_scale = tl.full((PAGE,), 1.0, tl.float32)
            keys = keys.to(DOT_DTYPE)
        logits_t = tl.dot(keys, q_t, out_dtype=tl.float32)  # (PAGE, M)
        # ReLU(q·k·s)·w summed over heads, the key's scale s applied after the sum: s is a positive power of two
        # (the cache's ue8m0 scales, e4m3_gain), so s·ReLU(x) = ReLU(s·x) exactly and the product moves out of the
        # (PAGE, M) tile (10 % of the kernel at B 128, docs/history.md version 24)
        if CHAINED:
            score = _head_sum_chained(tl.maximum(logits_t, 0.0), w, PAGE, QT, HP)
        else:
            score = tl.sum(tl.reshape(tl.maximum(logits_t, 0.0) * w[None, :], (PAGE, QT, HP)), axis=2)
        score = tl.trans(score * col_scale[:, None])  # (QT, PAGE)
        score = tl.where(score == 0.0, 0.0, score)  # -0.0 -> +0.0: the packed order is the float order
        cols = page * PAGE + e
        ok = key_ok[None, :] & (cols[None, :] < visible[:, None])
        bits = score.to(tl.int32, bitcast=True)
        ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # signed-int order = float order
        if WORDS:  # the order bits alone, unsigned (sign flipped), 0 for no candidate, a candidate at least 1;
            # formed in int64 and narrowed: Triton (3.6, 3.9) then converts the score tile's layout on the 32-bit
            # order bits before the mask, as for the packed keys (a 32-bit mask stayed in the dot's replicated
            # layout, 8 registers a thread: 5.6 % more instructions a page under the sm_80 lowering,
            # docs/history.md versions 33-34)
            stored = tl.maximum((ordered ^ -2147483648).to(tl.uint32, bitcast=True).to(tl.int64), 1)
            stored = tl.where(ok, stored, 0).to(tl.int32)  # the low 32 bits
        else:
            stored = _packed_key(ordered, cols)  # (QT, PAGE): the entries broadcast over the tokens
            stored = tl.where(ok, stored, -9223372036854775808)
        tl.store(out_ptr + out_rows[:, None] + cols[None, :], stored, mask=tok_ok[:, None] & (cols < num_cols)[None, :])


@triton.jit
def _round_to_bf16(x):
    """float32 -> the nearest bf16 value (ties to even) as float32, by integer operations (the interpreter's cast
    truncates)."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _round_to_e4m3(y):
    """float32 ``y`` (|y| <= 448) -> the nearest e4m3 value (ties to even) as float32: a step of 2^(e-3) at binary
    exponent e, 2^-9 below the normals."""
    e = tl.maximum(((y.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)
    step = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)
    inv = ((127 - e + 3) << 23).to(tl.float32, bitcast=True)
    return round_half_even(y * inv) * step  # both products exact: powers of two


PREP_HEADS = 8  # heads per query-prep program: 8 × 128 values, 8 a thread at 4 warps


@triton.jit
def _prepare_queries_kernel(
    q_ptr, w_ptr, cos_ptr, sin_ptr, q_out_ptr, w_out_ptr, H, weight_scale,
    HB: tl.constexpr, D: tl.constexpr, HALF_SPLIT: tl.constexpr, FP8_Q: tl.constexpr, HW_ROUND: tl.constexpr,
    DEPENDENT: tl.constexpr = False,
):
    """One token's heads ``[HB · j, HB · (j + 1))``: rope (V4: dims 64..127 in pairs (2i, 2i+1); V3.2: dims 0..63, i
    with i + 32), the bf16 round, then (fp8) per head the power-of-two scale and the e4m3 values; the weights times
    the scales. A few heads a program: a whole token's 64 heads in one program held 64 values a thread and the
    launch took 10-15 µs for a few MB (docs/history.md version 26). ``HW_ROUND``: the bf16 and e4m3 rounds by the
    conversion instructions (round to nearest even, the reference's), not integer operations (the interpreter's
    casts truncate): B 128 11.7 -> 9.7 µs on an H200, the same bits (docs/history.md version 28)."""
    wait_for_previous(DEPENDENT)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * HB + tl.arange(0, HB)
    d = tl.arange(0, D)
    ok = (h < H)[:, None] & (d < D)[None, :]
    offs = (t * H + h[:, None]) * D + d[None, :]
    x = tl.load(q_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    if HALF_SPLIT:
        rotated = d < 64
        pair = d % 32
        partner_d = tl.where(d < 32, d + 32, d - 32)
        first = d < 32
    else:
        rotated = d >= 64
        pair = (d - 64) // 2
        partner_d = d ^ 1
        first = (d % 2) == 0
    pair = tl.where(rotated, pair, 0)
    partner = tl.load(q_ptr + (t * H + h[:, None]) * D + partner_d[None, :], mask=ok, other=0.0).to(tl.float32)
    # the angles loaded as the (HB, D) tile they multiply (a head's copies of a row from L1), not as a (D,) row that
    # the multiply then converts to the tile's layout through shared memory: sm_90 5 -> 1 barriers, 40 -> 32
    # registers; the prep alone, H200 graphs, B 128 8.90 -> 8.38 µs, the 4K prefill chunk 49.0 -> 45.8
    # (docs/history.md version 45)
    angle = t * 32 + pair[None, :] + 0 * h[:, None]
    cos = tl.load(cos_ptr + angle)
    sin = tl.load(sin_ptr + angle)
    # the reference's operations, in its order (no FMA: the launch turns fp fusion off)
    turned = tl.where(first[None, :], x * cos - partner * sin, x * cos + partner * sin)
    x = tl.where(rotated[None, :], turned, x)
    if HW_ROUND:  # the conversion instruction rounds to nearest even, as the reference does
        x = x.to(tl.bfloat16).to(tl.float32)
    else:  # the interpreter's cast truncates
        x = _round_to_bf16(x)
    w = tl.load(w_ptr + t * H + h, mask=h < H, other=0.0).to(tl.float32) * weight_scale
    if FP8_Q:
        amax = tl.max(tl.abs(x), 1)
        ratio = tl.math.div_rn(tl.maximum(amax, 1e-4), 448.0)
        bits = ratio.to(tl.int32, bitcast=True)
        e = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)  # ceil(log2(ratio))
        scale = ((e + 127) << 23).to(tl.float32, bitcast=True)
        inv = ((127 - e) << 23).to(tl.float32, bitcast=True)
        x = x * inv[:, None]
        if HW_ROUND and q_out_ptr.dtype.element_ty == tl.float8e4nv:  # the e4m3 codes from the conversion instruction
            x = x.to(tl.float8e4nv)
        else:  # e4m3 values in a wider type (a target without fp8 conversions), or the interpreter
            x = _round_to_e4m3(x)
        w = w * scale
    tl.store(q_out_ptr + offs, x.to(q_out_ptr.dtype.element_ty), mask=ok)
    tl.store(w_out_ptr + t * H + h, w, mask=h < H)


def prepare_queries(q: torch.Tensor, weights: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, half_split: bool,
                    fp8_q: bool, weight_scale: float, q_out: torch.Tensor, w_out: torch.Tensor) -> None:
    """:func:`sparse_mla.indexer.prepare_queries` in one launch, the same values: ``q (T, H, 128)``, ``weights (T, H)``
    (bf16 / fp16 / float32), ``cos`` / ``sin`` ``(T, 32)`` float32 of the tokens' positions (the rope's angles, as
    the reference computes them), into ``q_out (T, H, 128)`` (float32, bf16 or float16 holding the values exactly, or
    float8_e4m3fn the codes) and ``w_out (T, H)`` float32. Each contiguous and on q's device (checked here: the
    kernel reads and writes whole rows at unit stride).
    """
    check_tensor("q", q, dtype=(torch.bfloat16, torch.float16, torch.float32), ndim=3)
    check_query_shape(q)  # H 0 would size the grid by a division by zero
    rows, heads_in = q.shape[0], q.shape[1]
    check_tensor("weights", weights, dtype=(torch.bfloat16, torch.float16, torch.float32), shape=(rows, heads_in),
                 device=q.device)
    for name, t in (("cos", cos), ("sin", sin)):
        check_tensor(name, t, dtype=torch.float32, shape=(rows, 32), device=q.device)  # the rope's 32 frequencies
    check_tensor("q_out", q_out, dtype=(torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn),
                 shape=q.shape, device=q.device)
    check_tensor("w_out", w_out, dtype=torch.float32, shape=(rows, heads_in), device=q.device)
    for name, t in (("q", q), ("weights", weights), ("cos", cos), ("sin", sin), ("q_out", q_out), ("w_out", w_out)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous (the prep kernel reads and writes whole rows), got strides "
                             f"{t.stride()}")
    launch_prepare_queries(q, weights, cos, sin, half_split, fp8_q, weight_scale, q_out, w_out)


def launch_prepare_queries(q: torch.Tensor, weights: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                           half_split: bool, fp8_q: bool, weight_scale: float, q_out: torch.Tensor,
                           w_out: torch.Tensor) -> None:
    """:func:`prepare_queries`' launch alone, for a caller that has checked its arguments (the indexer layer: its own
    q and weights, made contiguous, into its plan's buffers, which the plan made to fit)."""
    heads = min(PREP_HEADS, triton.next_power_of_2(q.shape[1]))
    grid = (q.shape[0], -(-q.shape[1] // heads))
    with on_device_of(q):
        _prepare_queries_kernel[grid](q, weights, cos, sin, q_out, w_out, q.shape[1], weight_scale, HB=heads,
                                      D=INDEX_HEAD_DIM, HALF_SPLIT=half_split, FP8_Q=fp8_q,
                                      HW_ROUND=not interpreting(), num_warps=4, **fp_fusion(False),
                                      **launch_options(q.device))


def launch_shape(num_heads: int, max_query_len: int, num_reqs: int, num_cols: int, wave: int = 0
                 ) -> tuple[int, int, int]:
    """``(HP, QT, PAGES)``: padded heads, tokens per tile, pages per program for one launch. The pages a program
    double from one while the grid keeps at least :data:`TARGET_PROGRAMS` programs, up to
    :data:`MAX_PAGES_PER_PROGRAM`. ``wave``: the programs the GPU runs at once, where known (0: not known); a grid of
    full tiles (:data:`ROWS_PER_TILE` rows) of more than one wave that twice the pages (up to :data:`WAVE_MAX_PAGES`)
    fit in one wave takes them."""
    hp = triton.next_power_of_2(num_heads)
    qt = max(max(1, 16 // hp), min(max(1, ROWS_PER_TILE // hp), triton.next_power_of_2(max_query_len)))
    pages = -(-num_cols // 64)
    tiles = num_reqs * -(-max_query_len // qt)
    work = tiles * pages
    per_program = 1
    while per_program < MAX_PAGES_PER_PROGRAM and work // (2 * per_program) >= TARGET_PROGRAMS:
        per_program *= 2

    def programs(per: int) -> int:
        return tiles * -(-pages // per)

    if (wave and qt * hp >= ROWS_PER_TILE and 2 * per_program <= WAVE_MAX_PAGES
            and programs(per_program) > wave >= programs(2 * per_program)):
        per_program *= 2
    return hp, qt, per_program


_DOT_TYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16,
              torch.float8_e4m3fn: tl.float8e4nv}
# the score kernel's launch (benchmarks/probe_indexer_launch.py sweeps them): 3 stages, two pages in flight, ran
# faster than 4 on every case of the sweep over words on an H200 (V4-Flash B 32 23.0 -> 21.2 us, B 128 53.6 -> 53.2,
# V4.1-Flash B 128 87.0 -> 86.1, the 4K prefill chunk 800 -> 775; docs/history.md version 34)
SCORE_WARPS, SCORE_STAGES = 4, 3
# the fp8 dot's registers on sm_90: at most 128 a thread, so an SM holds four programs (136 uncapped on Triton 3.6; no
# spills at 128, the compile matrix). Not on sm_89, whose 100 KB of shared memory holds two programs whatever their
# registers (capped, its chained head sum spilled 16-22 B in the page loop: docs/history.md version 38), nor on
# sm_100 / sm_120: at 128 their page loops spilled (sm_100 110-122 B a thread inside the loop, sm_120 4-6, Triton 3.6
# and 3.9); uncapped they take 159-168 registers and spill nothing (docs/history.md version 34)
FP8_DOT_MAXNREG, FP8_DOT_CAPPED = 128, ("sm_90",)


def heads_chained(target: targets.Target) -> bool:
    """Whether the score kernel sums a key's weighted heads in chains of fused multiply-adds
    (:func:`_head_sum_chained`) rather than by ``tl.sum``: on the mma.sync targets (sm_80-89, sm_120), and on sm_90's
    wgmma where ``tl.sum`` reduces a thread's heads as a tree (:data:`SUM_BY_TREE`). H200, graphs, scores alone,
    ``tl.sum`` -> chained: Triton 3.9 V4-Flash B 128 51.4 -> 50.3 µs, the 4K prefill chunk 756 -> 712; Triton 3.6
    (which chains them itself) B 128 equal, V4.1 B 128 85.6 -> 86.4, the prefill chunk 768 -> 784; the sm_89 lowering
    (3.6) B 32 50.0 -> 46.4, B 128 152.8 -> 145.1 (docs/history.md version 38). Not on sm_100, whose tile comes from
    tensor memory in another layout (its page loop 7 % longer chained on Triton 3.9), nor AMD's (6-16 % more
    instructions). The interpreter's target, sm_90, chains on the Tritons that do here."""
    if target.backend != "cuda" or target.tmem_columns:
        return False
    return SUM_BY_TREE or not target.hopper


def index_scores(q: torch.Tensor, weights: torch.Tensor, cache: IndexerKeyCache, step: StepTokens, out: torch.Tensor,
                 t0: int, t1: int, max_query_len: int, dot_dtype: torch.dtype, native_fp8: bool,
                 launch: tuple[int, int, int] | None = None, *, chained: bool | None = None) -> None:
    """Scores of tokens ``[t0, t1)`` into ``out[: t1 - t0]`` (``(rows, num_cols)`` int64, or int32 for the words
    the module docstring describes; rows of padding tokens are not written; on the cache's device, rows apart, sharing
    no memory with an input). q ``(T_cap, H, 128)`` (float32, bf16,
    float16 or e4m3: the prepared queries), weights ``(T_cap, H)`` float32, checked here with the cache and step
    (:func:`sparse_mla.indexer.check_step_inputs`), once
    per token chunk; max_query_len: an upper bound on any request's tokens in ``[t0, t1)`` (host int: the grid).
    dot_dtype: ``torch.float32`` (the interpreter), ``torch.bfloat16``, or ``torch.float8_e4m3fn`` (fp8 keys and
    e4m3 q on a target with fp8 tensor cores: the codes straight into the dot; :func:`dot_dtype_for`); native_fp8: the
    target converts e4m3 with instructions. launch: ``(pages per program, warps, stages)`` in place of
    :func:`launch_shape`'s pages and the defaults (a probe's sweep); chained: the head sum's form (None: the
    target's, :func:`heads_chained`)."""
    check_step_inputs(q, weights, cache, step)
    check_positive_int("max_query_len", max_query_len)  # sizes the grid: 0 would launch nothing, leaving out as it was
    if not (is_int(t0) and is_int(t1)):  # kernel arguments: a float would be compiled into the token arithmetic
        raise TypeError(f"t0 and t1 must be ints, got {t0!r} ({type(t0).__name__}), {t1!r} ({type(t1).__name__})")
    t0, t1 = int(t0), int(t1)
    if not 0 <= t0 < t1 <= q.shape[0]:
        raise ValueError(f"the token range must satisfy 0 <= t0 < t1 <= {q.shape[0]} (q's rows), got [{t0}, {t1})")
    check_kernel_cache(cache)
    check_tensor("out", out, device=cache.device)
    if out.dtype not in (torch.int64, torch.int32) or out.dim() != 2 or out.shape[0] < t1 - t0 or out.stride(1) != 1:
        raise ValueError(f"out must be int64 (packed keys) or int32 (words) of shape (>= {t1 - t0}, num_cols) with "
                         f"unit column stride, got {out.dtype} {tuple(out.shape)} strides {out.stride()}")
    check_rows_apart("out", out[: t1 - t0])  # rows sharing memory: each token's scores written over another's
    # programs write out while others read the inputs: an aliased input (or the key cache) would be read overwritten
    check_no_overlap("out", out, {"q": q, "weights": weights, "cache.data": cache.data, "positions": step.positions,
                                  "query_start_loc": step.query_start_loc, "block_table": step.block_table})
    if not (q.is_contiguous() and weights.is_contiguous()):
        raise ValueError("q and weights must be contiguous (the kernel reads rows of H · 128 and of H)")
    if dot_dtype not in _DOT_TYPES:
        raise ValueError(f"dot_dtype must be one of {tuple(_DOT_TYPES)}, got {dot_dtype}")
    fp8 = cache.fmt == "fp8"
    if dot_dtype == torch.float8_e4m3fn and (not fp8 or q.dtype != torch.float8_e4m3fn):
        raise ValueError(f"the fp8 dot needs an fp8 key cache and float8_e4m3fn q, got {cache.fmt} keys, {q.dtype} q")
    if dot_dtype == torch.float16 and (not fp8 or native_fp8 or q.dtype != torch.float16):
        raise ValueError(f"the float16 dot needs an fp8 key cache decoded by integer operations (native_fp8 False) and "
                         f"float16 q (e4m3 values), got {cache.fmt} keys, native_fp8={native_fp8}, {q.dtype} q")
    launch_index_scores(q, weights, cache, step, out, t0, t1, max_query_len, dot_dtype, native_fp8, launch,
                        chained=chained)


def check_kernel_cache(cache: IndexerKeyCache) -> None:
    """The key cache the score kernel reads: blocks of 64 entries (a page, the kernel's dot)."""
    if cache.block_size != 64:
        raise ValueError(f"cache.block_size must be 64 for the Triton indexer, got {cache.block_size}")


def launch_index_scores(q: torch.Tensor, weights: torch.Tensor, cache: IndexerKeyCache, step: StepTokens,
                        out: torch.Tensor, t0: int, t1: int, max_query_len: int, dot_dtype: torch.dtype,
                        native_fp8: bool, launch: tuple[int, int, int] | None = None, *,
                        chained: bool | None = None) -> None:
    """:func:`index_scores`' launch alone, for a caller whose arguments are its own and made to fit (the indexer
    layer: its plan's prepared queries, step and workspace, a key cache its call checked with
    :func:`check_kernel_cache`)."""
    num_reqs = step.query_start_loc.shape[0] - 1
    num_cols = out.shape[1]
    target = targets.target_of(cache.device)
    fp8_dot = dot_dtype == torch.float8_e4m3fn
    wave = WAVE_PROGRAMS_PER_SM * targets.num_sms(cache.device, target) if fp8_dot and target.hopper else 0
    hp, qt, per_program = launch_shape(q.shape[1], max_query_len, num_reqs, num_cols, wave)
    warps, stages = SCORE_WARPS, SCORE_STAGES
    if launch is not None:
        per_program, warps, stages = launch
    fp8 = cache.fmt == "fp8"
    scale_view = cache.data.view(torch.float32) if fp8 else cache.data
    grid = (num_reqs, -(-max_query_len // qt), -(-num_cols // (64 * per_program)))
    dot = _DOT_TYPES[dot_dtype]
    if chained is None:
        chained = heads_chained(target)
    chained = chained and hp >= 8  # fewer padded heads: a token's lie within one lane group, tl.sum's
    with on_device_of(q):
        _index_scores_kernel[grid](
            q, weights, cache.data, scale_view, step.positions, step.query_start_loc, step.block_table, out,
            t0, t1, q.shape[1], step.ratio, cache.num_blocks, step.block_table.stride(0), step.block_table.shape[1],
            out.stride(0), num_cols,
            HP=hp, QT=qt, PAGES=per_program, PAGE=64, D=INDEX_HEAD_DIM, FP8=fp8, NATIVE_FP8=native_fp8,
            DOT_DTYPE=dot, FP8_DOT=fp8_dot, STAGES=stages, WORDS=out.dtype == torch.int32, num_warps=warps,
            CHAINED=chained,
            PTX_DECODE=target.backend == "cuda" and not interpreting(),
            num_stages=stages, **fp_fusion(), **launch_options(q.device),
            **register_cap(FP8_DOT_MAXNREG if fp8_dot and target.name in FP8_DOT_CAPPED else None))


@triton.jit
def _count_at_or_above(words, tail, cand, HAS_TAIL: tl.constexpr):
    """How many of ``words`` and (``HAS_TAIL``) ``tail`` are at or above ``cand``."""
    n = tl.sum((words >= cand).to(tl.int32), 0)
    if HAS_TAIL:
        n += tl.sum((tail >= cand).to(tl.int32), 0)
    return n


@triton.jit
def _bit_search(words, tail, thr, count, bit, k, HAS_TAIL: tl.constexpr):
    """Raise ``thr`` (uint32) bit by bit, from ``bit`` down, to the largest value at or below which ``k`` or more of
    ``words`` and ``tail`` (uint32; those at 0 never count) lie at or above it, stopping as soon as exactly ``k`` do.
    ``count``: how many are at or above ``thr`` on entry. Returns ``(thr, count)``."""
    one = tl.full((), 1, tl.uint32)
    while (bit >= 0) & (count != k):
        cand = thr | (one << bit)
        above = _count_at_or_above(words, tail, cand, HAS_TAIL)
        thr = tl.where(above >= k, cand, thr)
        count = tl.where(above >= k, above, count)
        bit -= 1
    return thr, count


@triton.jit
def _digit_pass(words, tail, thr, count, bit, k, zeros, HAS_TAIL: tl.constexpr, DIGIT: tl.constexpr,
                FROM_TOP: tl.constexpr):
    """One pass of :func:`_digit_search`: the words whose bits above ``bit`` are ``thr``'s (the others are above
    ``thr`` or below it whatever its lower bits) counted by their next ``DIGIT`` bits in one histogram, the highest
    digit at or above which ``k`` or more lie taken. ``count``: how many lie at or above ``thr``; ``FROM_TOP``: none
    lies above the words in play (``thr`` the row's largest word's bits), so the counts are summed from the highest
    digit down and ``count`` is not read. Returns ``(thr, count, bit)`` for the next pass."""
    BINS: tl.constexpr = 1 << DIGIT
    COUNT_BITS: tl.constexpr = 31 - DIGIT  # >= 20: a count is at most the row's lanes (<= 2^15: WHOLE_SELECT_COLS)
    bins = tl.arange(0, BINS)
    shift = tl.maximum(bit + 1 - DIGIT, 0)  # this pass's digit: bits [shift, bit]
    settled = (tl.full((), 4294967295, tl.uint64) << (bit + 1)).to(tl.uint32)  # the bits above it
    digits = (1 << (bit + 1 - shift)) - 1  # the digit's values: fewer than BINS on the last pass
    hist = tl.histogram(((words >> shift) & digits).to(tl.int32), BINS, mask=(words & settled) == thr)
    if HAS_TAIL:
        hist += tl.histogram(((tail >> shift) & digits).to(tl.int32), BINS, mask=(tail & settled) == thr)
    # the zeros (no candidate) are in play while thr is 0, in digit 0, and never count
    if FROM_TOP:  # at or above digit b: the words in play with a digit at or above it
        at_or_above = tl.cumsum(hist, 0, reverse=True) - tl.where((bins == 0) & (thr == 0), zeros, 0)
    else:  # every word counted in count but those in play with a lower digit (no bin past the pass's digits
        # qualifies: fewer than k words lie above the words in play, or the last pass would have taken a higher digit)
        at_or_above = count - (tl.cumsum(hist, 0) - hist) + tl.where((bins > 0) & (thr == 0), zeros, 0)
    # the highest digit at or above which k or more lie, and how many: one maximum of (digit, count) packed in an
    # int32 (a digit below 2^MAX_DIGIT_BITS, a count below 2^COUNT_BITS), not a maximum then a sum (each a cross-warp
    # reduction: two barriers). Digit 0 always qualifies: k or more lie at or above thr.
    packed = tl.max(tl.where(at_or_above >= k, (bins << COUNT_BITS) | at_or_above, 0), 0)
    best = packed >> COUNT_BITS
    return thr | (best.to(tl.uint32) << shift), packed & ((1 << COUNT_BITS) - 1), shift - 1


@triton.jit
def _digit_search(words, tail, thr, bit, k, zeros, HAS_TAIL: tl.constexpr, DIGIT: tl.constexpr):
    """:func:`_bit_search`'s result, ``DIGIT`` bits a pass (:func:`_digit_pass`), from ``thr``: the bits above ``bit``
    of the row's largest word, which ``k`` or more words share or exceed. ``zeros``: how many words are 0 (no
    candidate). Returns ``(thr, count)``, how many lie at or above it."""
    if bit >= 0:  # the first pass counts from the largest word: how many share thr's bits is not asked beforehand
        thr, count, bit = _digit_pass(words, tail, thr, 0, bit, k, zeros, HAS_TAIL, DIGIT, True)
    else:  # every bit common to the largest word and the floor (at least 1: no zero counts): those at or above it
        count = _count_at_or_above(words, tail, thr, HAS_TAIL)
    while (bit >= 0) & (count != k):
        thr, count, bit = _digit_pass(words, tail, thr, count, bit, k, zeros, HAS_TAIL, DIGIT, False)
    return thr, count


@triton.jit
def _high_words(words_ptr, row, stride, cols, num_cols, WORDS: tl.constexpr):
    """The keys' order bits (their high words) with the sign bit flipped, uint32: unsigned order = the scores' order;
    a non-candidate's (``INT64_MIN``, or a column past the row) is 0. ``WORDS``: the rows hold these words already
    (int32, ``stride`` words a row), read contiguously."""
    if WORDS:
        words = tl.load(words_ptr + row * stride + cols, mask=cols < num_cols, other=0).to(tl.uint32, bitcast=True)
    else:
        words = tl.load(words_ptr + 2 * (row * stride + cols) + 1, mask=cols < num_cols, other=-2147483648)
        words = (words ^ -2147483648).to(tl.uint32, bitcast=True)
    return words


@triton.jit
def _entry_words(words_ptr, row, stride, cols, mask, COLUMN_ENTRIES: tl.constexpr):
    """Where ``mask``: the keys' low words, uint32 ``2^32 - 1 - entry`` (larger = lower entry; from the columns where
    ``COLUMN_ENTRIES``), else 0."""
    if COLUMN_ENTRIES:
        low = tl.where(mask, 4294967295 - cols.to(tl.uint32), tl.full((), 0, tl.uint32))
    else:
        low = tl.load(words_ptr + 2 * (row * stride + cols), mask=mask, other=0).to(tl.uint32, bitcast=True)
    return low


@triton.jit
def _scatter(ptrs, values, mask, PTX: tl.constexpr):
    """``tl.store(ptrs, values, mask)`` of int32 or int64 ``values``; ``PTX`` (CUDA, not the interpreter): by inline
    PTX from the registers the values lie in. Addresses that are data (a select's output slots) give Triton's store
    coalescing no contiguity to use, and it converted the tile to its own layout through shared memory first (a
    converting select over 8,192 words at 16 warps, sm_90: four rounds of 128-bit shared stores and loads of the 64-bit
    addresses, 5 barriers); the stores themselves are the same, one a lane."""
    if PTX:
        if values.dtype == tl.int64:
            tl.inline_asm_elementwise(
                "{ .reg .pred p; setp.ne.b32 p, $3, 0; @p st.global.b64 [$1], $2; mov.b32 $0, 0; }", "=r,l,l,r",
                [ptrs, values, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)
        else:
            tl.inline_asm_elementwise(
                "{ .reg .pred p; setp.ne.b32 p, $3, 0; @p st.global.b32 [$1], $2; mov.b32 $0, 0; }", "=r,l,r,r",
                [ptrs, values.to(tl.int32), mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.store(ptrs, values, mask=mask)


@triton.jit
def _store_chosen(packed_ptr, words_ptr, out_ptr, row, stride, out_stride, cols, chosen, slot, KEYS: tl.constexpr,
                  COLUMN_ENTRIES: tl.constexpr, words, first_entry, WORDS: tl.constexpr, PTX_STORE: tl.constexpr):
    """The chosen columns' keys (``KEYS``) or entries into their output slots. ``WORDS`` and ``KEYS``: the keys are
    packed from the chosen ``words`` (uint32) and their entries, ``first_entry`` plus the column."""
    if KEYS:
        if WORDS:  # the score kernel's packing: the order bits (the word's sign bit flipped back), then the entry
            key = _packed_key((words ^ 2147483648).to(tl.int32, bitcast=True), first_entry + cols)
        else:
            key = tl.load(packed_ptr + row * stride + cols, mask=chosen)
        _scatter(out_ptr + row * out_stride + slot, key, chosen, PTX_STORE)
    elif COLUMN_ENTRIES:
        _scatter(out_ptr + row * out_stride + slot, cols, chosen, PTX_STORE)
    else:
        low = _entry_words(words_ptr, row, stride, cols, chosen, COLUMN_ENTRIES)
        _scatter(out_ptr + row * out_stride + slot, (4294967295 - low.to(tl.int64)).to(tl.int32), chosen, PTX_STORE)


@triton.jit
def _finish_row(out_ptr, out_stride, row, count, conv, K: tl.constexpr, KP: tl.constexpr, KEYS: tl.constexpr,
                CONVERT: tl.constexpr, BS: tl.constexpr, OUT_ROW: tl.constexpr):
    """After a row's ``count`` chosen are stored: ``-1`` (``KEYS``: ``INT64_MIN``) after them in the output row
    (``OUT_ROW``: the row exists) and, ``CONVERT``, the conversion's row ``row`` (``conv``: its tensors, as
    :func:`_topk_rows_kernel` bundles them): the picks read back from the output row (this program's own stores,
    visible after the barrier), their cache slots through the request's block-table row (``BS`` entries a block),
    the picks themselves and their count. Converting the ``K`` compacted picks, not the row's masked columns: a
    gather and two stores of ``K / (32 · warps)`` values a thread."""
    fill = tl.arange(0, KP)  # KP: K rounded up to a power of two (an arange's length)
    unfilled = (fill >= count) & (fill < K)
    if OUT_ROW:
        if KEYS:
            tl.store(out_ptr + row * out_stride + fill, tl.full((KP,), -9223372036854775808, tl.int64), mask=unfilled)
        else:
            tl.store(out_ptr + row * out_stride + fill, tl.full((KP,), -1, tl.int32), mask=unfilled)
    if CONVERT:
        (req_ptr, table_ptr, table_stride, table_rows, max_blocks, idx_ptr, idx_stride, len_ptr, kept_ptr,
         kept_stride) = conv
        tl.debug_barrier()  # every thread's stores of the picks done (and visible to the block) before they are read
        picked = fill < count
        entry = tl.load(out_ptr + row * out_stride + fill, mask=picked, other=-1)
        req = tl.load(req_ptr + row)
        slots = table_slots(table_ptr, req, table_stride, table_rows, entry, picked, BS, max_blocks)
        tl.store(idx_ptr + row * idx_stride + fill, slots, mask=fill < K)
        tl.store(kept_ptr + row * kept_stride + fill, entry, mask=fill < K)
        tl.store(len_ptr + row, count)


@triton.jit
def _run_slots(chosen, T: tl.constexpr, V: tl.constexpr):
    """The output slot of each of ``chosen``'s (``(C,)`` int1) set lanes, from 0, in the order of the columns the
    lanes hold where each of ``T`` threads' lanes is a run (:func:`_topk_rows_kernel`'s ``RUNS``): the tile seen as
    ``(C / (T·V), T, V)`` — as the loads lay it out, ``T`` threads of ``V``-lane vectors — numbered by thread, then
    vector, then lane. Every count and scan but one, over the ``T`` threads' totals, stays inside a thread (an
    entry-order ``tl.cumsum`` of a tile in column order shuffles once a vector: a converting select of 8,192 words
    at 8 warps, 3,776 -> 2,664 SASS instructions on sm_90). Whatever layout the compiler gives the view, the slots
    are the same; only their cost moves."""
    R: tl.constexpr = chosen.shape[0] // (T * V)
    flags = tl.reshape(chosen.to(tl.int32), (R, T, V))
    lane = tl.cumsum(flags, 2) - flags
    per_vector = tl.sum(flags, 2)
    vector = tl.cumsum(per_vector, 0) - per_vector
    per_thread = tl.sum(per_vector, 0)
    thread = tl.cumsum(per_thread, 0) - per_thread
    return tl.reshape(thread[None, :, None] + vector[:, :, None] + lane, (R * T * V,))


@triton.jit
def _topk_rows_kernel(packed_ptr, words_ptr, out_ptr, stride, out_stride, num_cols, num_rows, segments,
                      pos_ptr, req_ptr, table_ptr, table_stride, table_rows, max_blocks, idx_ptr, idx_stride, len_ptr,
                      kept_ptr, kept_stride, K: tl.constexpr, KP: tl.constexpr, C: tl.constexpr, TAIL: tl.constexpr,
                      KEYS: tl.constexpr, COLUMN_ENTRIES: tl.constexpr, CONVERT: tl.constexpr, BS: tl.constexpr,
                      ENTRY_BITS: tl.constexpr, WORDS: tl.constexpr = False, DEPENDENT: tl.constexpr = False,
                      DIGIT: tl.constexpr = 0, RUNS: tl.constexpr = 0, V: tl.constexpr = 1,
                      PTX_STORE: tl.constexpr = False, FLOOR: tl.constexpr = 0):
    """One row: the ``K`` largest packed keys' entries (``KEYS``: the keys themselves), in ascending entry order,
    ``-1`` fill (``KEYS``: ``INT64_MIN``). ``words_ptr``: the same rows as int32 (the keys' low and high words);
    ``WORDS``: the rows are the score kernel's words (``stride`` of them a row; ``COLUMN_ENTRIES``), with no packed
    keys beside them; with ``KEYS`` (a long row's segments, ``segments`` a row: each row of the launch one segment of
    ``C`` columns) the chosen keys are packed from the words and their entries.
    The row's columns are held as two tiles, ``C`` and (``TAIL`` > 1) ``TAIL`` more (powers of two: a row of 9,216
    columns is 8,192 + 1,024, not 16,384). ``COLUMN_ENTRIES``: column ``c`` of a row holds a key of entry ``c`` plus
    the row's offset (the score kernel's rows and their segments), so among tied scores the lower column is the lower
    entry and the entry is the column; else (the segments' winners) the entries are read from the keys' low words.
    ``RUNS`` > 0 (:func:`select_runs`): the main tile's lane ``p`` holds column ``c(p)`` such that each of the ``RUNS``
    threads holds a run of consecutive columns in vectors of ``V`` (16-byte loads where the rows' base and stride are
    16-byte multiples, as Triton's specialisation sees them; scalar loads otherwise), so the compaction into entry
    order counts inside each thread and scans across threads once (:func:`_run_slots`).

    The threshold is searched on the keys' high words (the scores' order bits, 32-bit compares: half the work of the
    64-bit keys') bit by bit from the highest bit where the row's valid words differ (the bits above it are common to
    every candidate), stopping as soon as exactly K words are at or above it; ``DIGIT`` > 0: ``DIGIT`` bits a pass,
    one histogram of the words still in play (:func:`select_digit_bits`). ``FLOOR`` > 0 (:func:`select_floor`): the
    search starts instead from the highest bit where the row's largest word and a floor of its K-th largest differ,
    the least of ``FLOOR`` (at least K) groups' largest words: the lanes of the same ``(p // V) % FLOOR``, a thread's
    own (``FLOOR`` a multiple of ``RUNS``), so its groups' maxima need no exchange. Where several keys share the
    threshold's score, their entries are searched bit by bit among them, from bit ``ENTRY_BITS - 1`` (every entry
    the rows hold is below ``2^ENTRY_BITS``). The search loads the high words alone;
    the keys (or their low words) are read again only where the output or a tie needs them.

    ``CONVERT`` (the entries, not ``KEYS``): the picks are converted in the same launch, as
    :class:`sparse_mla.picks.PicksConversion` converts them: row ``r``'s token ``r`` of the conversion's tensors
    (``pos_ptr`` … ``kept_ptr``: views from the chunk's first token, but the block table whole) gets its picks'
    cache slots through its request's block-table row (``table_ptr``, ``BS`` entries a block), their count and the
    picks themselves; the programs past the ``num_rows`` packed rows, and tokens of position ``-1``, write empty
    rows (the padding tokens')."""
    tl.static_assert(not WORDS or COLUMN_ENTRIES, "words rows: the entries are their columns")
    # a floor for the digit search (the bit rounds count from the least), of K or more groups that tile the lanes
    tl.static_assert(FLOOR == 0 or (DIGIT > 0 and FLOOR >= K and C % (FLOOR * V) == 0), "FLOOR: select_floor's")
    HAS_TAIL: tl.constexpr = TAIL > 1
    wait_for_previous(DEPENDENT)  # before any early return: the kernel completes after the one before it
    row = tl.program_id(0).to(tl.int64)
    conv = (req_ptr, table_ptr, table_stride, table_rows, max_blocks, idx_ptr, idx_stride, len_ptr, kept_ptr,
            kept_stride)
    if CONVERT:
        if row >= num_rows:  # a padding token after the chunk: no packed row
            _finish_row(out_ptr, out_stride, row, 0, conv, K, KP, KEYS, CONVERT, BS, False)
            return
        if tl.load(pos_ptr + row) < 0:  # a padding token: no visible entry (its packed row is not written)
            _finish_row(out_ptr, out_stride, row, 0, conv, K, KP, KEYS, CONVERT, BS, True)
            return
    if RUNS > 0:  # lane p of the tile holds column c(p): each of the RUNS threads' lanes a run of C / RUNS columns
        R: tl.constexpr = C // (RUNS * V)
        lane = tl.arange(0, C)
        cols = ((lane // V) % RUNS) * (R * V) + (lane // (RUNS * V)) * V + lane % V
        cols = tl.max_contiguous(tl.multiple_of(cols, V), V)
    else:
        cols = tl.arange(0, C)
    tail_cols = C + tl.arange(0, TAIL)
    hi = _high_words(words_ptr, row, stride, cols, num_cols, WORDS)
    if HAS_TAIL:
        hi_tail = _high_words(words_ptr, row, stride, tail_cols, num_cols, WORDS)
    else:  # a one-column dummy, never read
        hi_tail = tl.zeros((TAIL,), tl.uint32)
    candidates = _count_at_or_above(hi, hi_tail, 1, HAS_TAIL)
    chosen, chosen_tail = hi != 0, hi_tail != 0
    if candidates > K:
        one = tl.full((), 1, tl.uint32)
        most = tl.full((), 4294967295, tl.uint32)
        top = tl.max(hi, 0)
        if HAS_TAIL:
            top = tl.maximum(top, tl.max(hi_tail, 0))
        if FLOOR > 0:  # FLOOR >= K words, each group's largest, lie at or above the least of them, so the K-th
            # largest does too (a group of non-candidates' 0 taken as 1: every candidate); the tail's words only add
            bottom = tl.maximum(tl.min(tl.max(tl.max(tl.reshape(hi, (C // (FLOOR * V), FLOOR, V)), 2), 0), 0), 1)
        else:  # the least valid word
            bottom = tl.min(tl.where(hi != 0, hi, most), 0)
            if HAS_TAIL:
                bottom = tl.minimum(bottom, tl.min(tl.where(hi_tail != 0, hi_tail, most), 0))
        common = top ^ bottom
        bit = 31
        while (bit >= 0) & (((common >> bit) & one) == 0):  # the highest bit where the two differ
            bit -= 1
        below = (tl.full((), 1, tl.uint64) << (bit + 1)) - 1
        thr = (top.to(tl.uint64) & ~below).to(tl.uint32)  # at most bottom: K or more valid words at or above it
        if DIGIT > 0:
            lanes: tl.constexpr = C + TAIL if HAS_TAIL else C
            thr, count = _digit_search(hi, hi_tail, thr, bit, K, lanes - candidates, HAS_TAIL, DIGIT)
        else:  # (no floor: every valid word lies at or above the least's bits)
            thr, count = _bit_search(hi, hi_tail, thr, candidates, bit, K, HAS_TAIL)
        chosen, chosen_tail = hi >= thr, hi_tail >= thr
        if count != K:  # keys tie at the threshold's score: the lowest entries among them
            tied, tied_tail = hi == thr, hi_tail == thr
            tied_count = _count_at_or_above(tied.to(tl.uint32), tied_tail.to(tl.uint32), 1, HAS_TAIL)
            need = K - (count - tied_count)
            low = _entry_words(words_ptr, row, stride, cols, tied, COLUMN_ENTRIES)
            low_tail = _entry_words(words_ptr, row, stride, tail_cols, tied_tail, COLUMN_ENTRIES)
            # every tied entry is below 2^ENTRY_BITS, so its low word has every bit from ENTRY_BITS up set: the
            # search starts there (from bit 31 it spent 32 - ENTRY_BITS rounds, 19 at 8,192 columns, confirming them)
            high_ones: tl.constexpr = (4294967295 >> ENTRY_BITS) << ENTRY_BITS
            low_thr, _ = _bit_search(low, low_tail, tl.full((), high_ones, tl.uint32), tied_count,
                                     tl.full((), ENTRY_BITS - 1, tl.int32), need, HAS_TAIL)
            chosen = (hi > thr) | (tied & (low >= low_thr))
            chosen_tail = (hi_tail > thr) | (tied_tail & (low_tail >= low_thr))
    if RUNS > 0:
        slot = _run_slots(chosen, RUNS, V)
    else:
        slot = tl.cumsum(chosen.to(tl.int32), 0) - 1
    first_entry = (row % segments) * C  # a segment's first entry (rows of segments: C columns each, no tail)
    _store_chosen(packed_ptr, words_ptr, out_ptr, row, stride, out_stride, cols, chosen, slot, KEYS, COLUMN_ENTRIES,
                  hi, first_entry, WORDS, PTX_STORE)
    if HAS_TAIL:
        slot_tail = tl.sum(chosen.to(tl.int32), 0) + tl.cumsum(chosen_tail.to(tl.int32), 0) - 1
        _store_chosen(packed_ptr, words_ptr, out_ptr, row, stride, out_stride, tail_cols, chosen_tail, slot_tail, KEYS,
                      COLUMN_ENTRIES, hi_tail, first_entry, WORDS, PTX_STORE)
    _finish_row(out_ptr, out_stride, row, tl.minimum(candidates, K), conv, K, KP, KEYS, CONVERT, BS, True)


# Triton lowers tl.histogram to shared-memory atomics on NVIDIA from 3.8 (one warp-aggregated increment a word: 648
# SASS instructions for 8,192 words into 256 bins on sm_90, against 352 for one count of them); 3.6-3.7, and AMD's
# backend on every version, to a vote a digit bit and a population count a bin a lane owns (4,008): there a histogram
# pass costs more than the bit rounds it replaces (docs/history.md versions 28, 37)
HISTOGRAM_BY_ATOMICS = TRITON_VERSION >= (3, 8)
# tl.histogram's mask (the words in play), which the digit search needs: not in every Triton the library takes
HISTOGRAM_TAKES_MASK = "mask" in inspect.signature(tl.histogram).parameters
# the select's digit where it searches by digits, measured on sm_90 alone (the other NVIDIA targets compile to the same
# atomics; not timed there): an H200 on Triton 3.9, the select alone on the layer's words (graphs,
# µs, a bit a round -> 6 / 8 / 11 bits a pass): V4-Flash B 32 16.3 -> 15.2 / 14.0 / 15.5, B 128 27.2 -> 25.1 / 23.2 /
# 24.0, V4.1-Flash B 128 46.7 -> 44.5 / 41.1 / 40.2; over packed keys (their high words at a stride of two) slower
# (the 512K segments 41.7 -> 43.8, V3.2 43.6 -> 46.9 at 8 bits; docs/history.md version 37). Again at the warps and
# cap select_warps / select_maxnreg now give (16 warps at most two rows an SM), 8 / 6 / 11 bits: B 32 11.3 / 12.1 /
# 13.7, B 128 17.1 / 18.3 / 21.3, V4.1-Flash B 128 32.6 / 35.2 / 35.1; 8 bits the fastest on every case, ties too
# (docs/history.md version 42)
SELECT_DIGIT_BITS = 8
MAX_DIGIT_BITS = 11  # a histogram of 2,048 bins (8 KB of shared memory a program)


def select_digit_bits(target: targets.Target, words: bool, winners: bool = False) -> int:
    """The select's threshold search for ``target``: ``0``, a bit a round (a count of the row's words at or above a
    candidate), or :data:`SELECT_DIGIT_BITS` bits a pass (one ``tl.histogram`` of the words still in play) — over rows
    of words (``words``), or of segments' winners in the last pass (``winners``: packed keys, the search over their high
    words), on NVIDIA where the installed Triton lowers the histogram to shared-memory atomics
    (:data:`HISTOGRAM_BY_ATOMICS`). The picks are the same either way. The winners by digits, H200, Triton 3.9, the
    select alone on the layer's own scores: B 8 at 512K (16 rows, 16 segments of 8,192 a row) 29.3 -> 27.1 µs, V3.2 B 32
    in segments 34.4 -> 31.5 (docs/history.md version 48); other packed keys (V4.1's two-level rows, a middle pass
    writing keys) keep the bit rounds, not timed by digits since version 37 found digits over packed keys slower at the
    warps of the time."""
    return SELECT_DIGIT_BITS if (words or winners) and target.backend == "cuda" and HISTOGRAM_BY_ATOMICS else 0


def select_search(target: targets.Target, words: bool, winners: bool, digit_bits: int | None
                  ) -> tuple[int, bool]:
    """A select launch's threshold search: ``(bits, own)``, the bits a pass (``digit_bits`` where given, else the
    target's, :func:`select_digit_bits`) and whether they are the target's own digit search (digits where the target
    searches by them; an explicit ``digit_bits`` elsewhere, a test's or a probe's, is not), the one the launch rules
    (:func:`select_warps`, :func:`select_maxnreg`, :func:`select_takes_whole`) were measured on."""
    own_digits = select_digit_bits(target, words, winners)
    bits = own_digits if digit_bits is None else digit_bits
    return bits, bits > 0 and own_digits > 0


# the select stores its chosen entries by inline PTX on CUDA (:func:`_scatter`; not in the interpreter). H200, Triton
# 3.9, graphs alternating in one process, tl.store -> PTX, µs: the converting select V4-Flash B 32 12.2 -> 11.5, B 128
# 17.5 -> 16.3, V4.1-Flash B 128 34.1 -> 31.1, the 4K prefill chunk 205.9 -> 182.0; B 128's layer 69.3 -> 68.1; V3.2's
# segment passes equal (docs/history.md version 43; benchmarks/probe_select_ptx_store.py patches it)
PTX_STORE = True
SELECT_VECTOR = 4  # int32 words a 16-byte load: the select's runs are whole vectors of them


def select_runs(target: targets.Target, warps: int, main: int, words: bool) -> int:
    """The select's ``RUNS`` for rows of ``words`` (the score kernel's; packed keys' high words lie 8 B apart, no
    16-byte vectors) whose main tile of ``main`` columns spreads over ``warps`` warps in whole vectors
    (:data:`SELECT_VECTOR`): the program's threads (each thread's lanes then a run of ``main / threads`` consecutive
    columns, its compaction counted in-thread: :func:`_run_slots`), else 0 (lanes in column order, an entry-order
    ``tl.cumsum``). The same picks in the same order. H200, graphs, the select alone on the layer's words, columns
    -> runs: Triton 3.6 V4-Flash B 32 17.1 -> 16.3 µs, B 128 26.8 -> 24.5, V4-Pro 17.9 -> 17.0, V4.1-Flash B 128
    47.8 -> 44.3, the 4K prefill chunk 294.5 -> 278.3; Triton 3.9 (digits) B 32 13.8 -> 12.9, B 128 22.9 -> 20.9,
    V4.1 B 128 40.8 -> 37.3, the prefill chunk equal (docs/history.md version 38)."""
    threads = target.warp_size * warps
    return threads if words and main % (SELECT_VECTOR * threads) == 0 else 0


def select_floor(runs: int, main: int, k: int, digits: bool) -> int:
    """The select's ``FLOOR`` where its search is by digits (``digits``; the bit rounds count from the least word) and
    starts from a floor of the K-th largest word (the least of ``FLOOR`` groups' largest; :func:`_topk_rows_kernel`):
    the fewest of ``runs · 2^j`` (``runs`` threads of
    :data:`SELECT_VECTOR`-word runs, :func:`select_runs`: each thread ``2^j`` groups of its own) at least ``k``, whose
    groups hold two vectors or more of the main tile's ``main`` words; else 0, the least valid word's. Over the
    scores of a row the least of its groups' largest lies far closer to the K-th largest than the least score does
    (often of the other sign, so the search started at the sign bit): over 200 simulated rows of V4-Flash's decode
    shape a row's digit passes went from 2-4 (mostly 3) to 1-3 (mostly 2), and a launch waits for its slowest row.
    H200, Triton 3.9, graphs, the select alone on the layer's words, the least valid word -> the floor: V4-Flash B 32
    10.9 -> 10.7 µs, B 128 15.7 -> 15.0, V4.1-Flash B 128 27.0 -> 25.0, V3.2 26.3 -> 23.2, the 4K prefill chunk 166.5
    -> 153.6 (docs/history.md version 49)."""
    if not (runs and digits):
        return 0
    groups = runs
    while groups < k:
        groups *= 2
    return groups if main >= 2 * SELECT_VECTOR * groups else 0


def select_warps(rows: int, lanes: int, sms: int, digits: bool = False, keys: bool = False) -> int:
    """The select's warps for ``rows`` rows of ``lanes`` keys (its two tiles' widths summed) on a GPU of ``sms`` SMs.

    A bit a round: the fewest, a power of two and at least 4, that hold at most 72 keys a thread, doubled (to 8 at
    most) where the rows do not fill the SMs (a row's rounds are then the launch's latency), 16 at most. Fewer warps a
    row cost the cross-warp sums of every round less; more keys a thread spill. H200 (docs/history.md version 27):
    8,192 keys 4 at 256 rows, 8 at 64; 9,216 (8,192 + 1,024) 4 at 3,640 rows (8: 1.5x the time); 16,384 8 at 64 and
    at 256.

    ``digits`` (the search by histograms, :func:`select_digit_bits`), rows of at least 8,192 keys, at most two an SM
    (their passes are the launch's latency): 16 (32 from :data:`WIDE_SELECT_LANES`, below), since a pass costs a
    shared-memory increment a key and a few scans of the bins whatever the warps. H200, Triton 3.9, the select alone on
    the layer's words, 4 / 8 / 16 / 32 warps (docs/history.md version 40): V4-Flash B 32 (64 rows of 8,192) 16.4 / 13.1
    / 11.6 / 12.4 µs, B 128 (256 rows) 21.2 / 18.1 / 17.2 / 19.1, V4.1-Flash B 128 (256 of 16,384) 35.6 / 37.2 / 32.6 /
    31.5, V3.2 B 32 (64 rows in segments of 8,192, then 8,192 winners) 43.9 / 38.1 / 36.1 / 41.0; the layer, this rule
    against the bit rounds' one (two runs): B 32 32.6 -> 31.0, B 128 74.2 -> 73.9, V4.1-Flash B 128 127.8 -> 123.0, V3.2
    90.3 -> 86.4. More rows than two an SM, where :func:`select_maxnreg` caps them (``keys`` off, rows of at most 9,216
    keys): 8. The 4K prefill chunk's 4,096 rows of 9,216 alone, not converting their picks, 4 / 8 / 16 / 32 warps: 239.6
    / 194.2 / 252.7 / 297.7 µs, but its layer 1,006 µs at 8 uncapped against 936 at 4 (version 40); capped at 8, 1,009
    -> 923 against 954 at 4 (version 41). Rows of :data:`WIDE_SELECT_LANES` keys or more, at most two an SM: 32 (version
    48, H200, Triton 3.9, 4 / 8 / 16 / 32 warps: V4.1-Flash B 32's 64 rows of 16,384 words 24.1 / 18.2 / 15.9 / 14.7 µs,
    B 128's 256 rows 33.3 / 34.2 / 29.3 / 26.6; V3.2's rows of 32,768 taken whole, :func:`select_takes_whole`: at 16
    warps 64 words a thread spill inside its loops on sm_90, at 32 the 128-136 B spilled lie outside them; version 47).
    Else (a segment pass writing keys, wider rows) the bit rounds' rule, the only one measured there."""
    if digits and lanes >= DIGIT_SELECT_MIN_LANES:
        if rows <= 2 * sms:
            return 16 if lanes < WIDE_SELECT_LANES else 32
        if cap_takes(8, lanes, keys):
            return 8
    warps = max(4, triton.next_power_of_2(-(-lanes // (72 * 32))))
    if rows < sms and warps < 8:
        warps *= 2
    return min(16, warps)


DIGIT_SELECT_MIN_LANES = 8192  # rows the digit search's warps were measured on (shorter: the bit rounds' rule)
WIDE_SELECT_LANES = 16384  # from these, the digit search's few rows take 32 warps (select_warps)
WHOLE_SELECT_COLS = 32768  # the widest rows of words select_takes_whole takes in one program
CAPPED_LANES = {16: 8192, 8: 9216}  # the widest rows the cap takes at each warp count (the prefill chunk's 9,216 at 8)


def select_takes_whole(target: targets.Target, rows: int, cols: int, sms: int, digit_bits: int | None) -> bool:
    """Whether ``rows`` rows of words (the score kernel's) of ``cols`` columns past :data:`MAX_SELECT_COLS` go whole,
    one program a row, not in segments: rows of at most :data:`WHOLE_SELECT_COLS` columns, searched by the target's own
    digits (:func:`select_search`), no more than the SMs of ``sms`` (at 32 warps, 64 registers a thread, a program fills
    an SM's registers: more rows would take a second wave, not measured) — where segments would only add programs the
    SMs have room for, and a second launch. H200, Triton 3.9, V3.2 B 32's 64 rows of 32,768 words, the select alone:
    34.1 µs in segments of 8,192 (then their 8,192 winners), 25.9 whole at 32 warps (docs/history.md version 48); the
    same picks in the same order. B 8 at 512K's rows (131,072) stay in segments: in segments of 32,768 they ran slower
    (35.4 against 29.4)."""
    _, own_search = select_search(target, True, False, digit_bits)
    return own_search and MAX_SELECT_COLS < cols <= WHOLE_SELECT_COLS and rows <= sms


def cap_takes(warps: int, lanes: int, keys: bool) -> bool:
    """Whether :func:`select_maxnreg`'s cap is measured for a select of ``warps`` warps over rows of ``lanes`` keys
    (``keys``: a segment pass writing keys, which keeps no cap)."""
    return not keys and lanes <= CAPPED_LANES.get(warps, 0)


def select_maxnreg(target: targets.Target, warps: int, lanes: int, rows: int, sms: int, *, keys: bool) -> int | None:
    """The digit search's register cap a thread (:func:`select_warps`' 8 or 16 warps over rows of ``lanes`` keys,
    ``rows`` of them on ``sms`` SMs): two programs an SM's registers where the rows outnumber the SMs, else None.

    Why: converting its picks in its own launch, the select takes more registers (sm_90, Triton 3.9: 8,192 words at 16
    warps 82 a thread against 57 without, the prefill chunk's 9,216 at 8 warps 184 against 128), one program an SM, so
    a V4-Flash B 128 step's 256 rows ran in two waves. Capped: 8,192 words at 16 warps 64, no spill on sm_80 -
    sm_120; 9,216 at 8 warps 128, 36-56 B spilled on sm_90 - sm_120 (none in a loop; none on sm_80 - sm_89); wider
    rows (192-632 B) and a segment pass writing keys (12-80 B) keep no cap. Rows no more than the SMs run in one wave
    whatever the registers, and capped (a first cut), V4-Flash B 32's layer ran slower (30.6 -> 34.1 µs). H200,
    Triton 3.9, uncapped -> capped (docs/history.md version 41): B 128's select converting its picks 21.8 -> 17.7
    µs, its layer 73.8 -> 69.5, its share of a step 67.7 -> 64.0; the prefill chunk's layer (at 8 warps) 1,009 -> 923.
    8,192 keys at 8 warps (a decode of more than two rows an SM) capped at 128: no spill, not timed."""
    if target.backend != "cuda" or rows <= sms or not cap_takes(warps, lanes, keys):
        return None
    return target.register_file // (2 * target.warp_size * warps)


def select_tiles(cols: int, k: int) -> tuple[int, int]:
    """The select's two tiles for rows of ``cols`` columns and top ``k``: ``(C, TAIL)``, powers of two, ``C`` the
    largest at most ``max(cols, k)``, ``TAIL`` the rest rounded up, at least 2 (1: no rest), so a row's lanes are at
    most 4/3 of its width (one power of two: up to 2x)."""
    width = max(cols, k)
    main = 1 << (width.bit_length() - 1)
    return main, (max(2, triton.next_power_of_2(width - main)) if width > main else 1)


class PicksInto(NamedTuple):
    """Where the select converts its picks in its own launch (:func:`topk_rows`), as
    :class:`sparse_mla.picks.PicksConversion` would: every tensor but the table a view from the chunk's first token,
    int32, unit column stride. positions / token_to_req ``(rows,)``; table ``(R, max_blocks)`` the kind's block
    table, ``block_size`` entries a block; indices ``(rows, k)`` the picks' slots, lens ``(rows,)`` their count, kept
    ``(rows, k)`` the picks themselves; rows: the tokens written, at least the packed rows (the rest, the step's
    padding tokens after the last chunk, get empty rows)."""

    positions: torch.Tensor
    token_to_req: torch.Tensor
    table: torch.Tensor
    block_size: int
    indices: torch.Tensor
    lens: torch.Tensor
    kept: torch.Tensor
    rows: int


def _check_picks_into(into: PicksInto, rows: int, k: int, device: torch.device) -> None:
    if not isinstance(into, PicksInto):
        raise TypeError(f"into must be a PicksInto, got {type(into).__name__}")
    if not (isinstance(into.rows, int) and into.rows >= rows):
        raise ValueError(f"into.rows must be an int at least the packed rows ({rows}), got {into.rows!r}")
    check_positive_int("into.block_size", into.block_size)
    n = into.rows
    for name, t, shape in (("positions", into.positions, (n,)), ("token_to_req", into.token_to_req, (n,)),
                           ("table", into.table, (None, None)), ("indices", into.indices, (n, k)),
                           ("lens", into.lens, (n,)), ("kept", into.kept, (n, k))):
        check_tensor(f"into.{name}", t, dtype=torch.int32, shape=shape, device=device)
        if t.stride(-1) != 1:
            raise ValueError(f"into.{name} must have unit stride in its last dimension, got {t.stride()}")
        if name in ("indices", "kept"):
            check_rows_apart(f"into.{name}", t)  # a row's picks written over another's
    if 0 in into.table.shape:
        raise ValueError(f"into.table must have a row and a column, got shape {tuple(into.table.shape)}")


def _launch_select(packed: torch.Tensor, k: int, out: torch.Tensor, keys: bool, column_entries: bool,
                   entries: int, into: PicksInto | None = None, digit_bits: int | None = None, segments: int = 1
                   ) -> None:
    """One select launch over ``packed``'s rows; ``entries``: a bound on the entries the rows hold (their columns, or
    for the segments' winners the whole row's); ``digit_bits``: the threshold search's (None: the target's,
    :func:`select_digit_bits`)."""
    rows, cols = packed.shape
    main, tail = select_tiles(cols, k)
    lanes = main + tail if tail > 1 else main
    # the GPU's own SMs; on the CPU (interpreter, the portability matrix's recorded launches) those of its target
    target = targets.target_of(packed.device)
    words_in = packed.dtype == torch.int32  # the score kernel's words: the search's words themselves
    # (winners: the last pass over segments' winners, the one measured by digits; not a middle pass writing keys)
    digit_bits, own_search = select_search(target, words_in, not column_entries and not keys, digit_bits)
    # the digit search's warps and register cap where it is the target's own; elsewhere the bit rounds' warps, the
    # only ones measured there; both by the packed rows (the programs past them, a step's padding tokens, write empty
    # rows)
    sms = targets.num_sms(packed.device, target)
    warps = select_warps(rows, lanes, sms, own_search, keys)
    maxnreg = select_maxnreg(target, warps, lanes, rows, sms, keys=keys) if own_search else None
    runs = select_runs(target, warps, main, words_in)
    # packed keys: (rows, 2 · cols) int32, each key's low, then high word (the kernel takes the int64 row stride)
    words = packed if words_in else packed.view(torch.int32)
    if into is None:  # the conversion's arguments unread (CONVERT off): out stands in for its tensors
        conv, grid, bs = (out, out, out, 0, 1, 0, out, 0, out, out, 0), rows, 1
    else:
        conv = (into.positions, into.token_to_req, into.table, into.table.stride(0), *into.table.shape,
                into.indices, into.indices.stride(0), into.lens, into.kept, into.kept.stride(0))
        grid, bs = into.rows, into.block_size
    with on_device_of(packed):
        _topk_rows_kernel[(grid,)](
            packed, words, out, packed.stride(0), out.stride(0), cols, rows, segments, *conv, K=k,
            KP=triton.next_power_of_2(k), C=main, TAIL=tail, KEYS=keys, COLUMN_ENTRIES=column_entries,
            CONVERT=into is not None, BS=bs, WORDS=words_in, ENTRY_BITS=max(1, (entries - 1).bit_length()),
            DIGIT=digit_bits, RUNS=runs, V=SELECT_VECTOR, FLOOR=select_floor(runs, main, k, digit_bits > 0),
            PTX_STORE=PTX_STORE and target.backend == "cuda" and not interpreting(), num_warps=warps,
            **register_cap(maxnreg), **fp_fusion(), **launch_options(packed.device))


def topk_rows(packed: torch.Tensor, k: int, out: torch.Tensor, into: PicksInto | None = None, *,
              digit_bits: int | None = None) -> None:
    """The Triton select: ``out (rows, k)`` int32 := each row's top-``k`` entries of ``packed (rows, num_cols)``,
    the same set as :func:`topk_from_packed`, listed in entry order, ``-1`` fill. The rows are the score kernel's:
    column ``c`` holds entry ``c``'s key (or ``INT64_MIN``), or (int32) its word (0: none; the module docstring).
    A row longer than :data:`MAX_SELECT_COLS` (``num_cols`` then a multiple of :data:`SELECT_SEGMENT`, ``k`` below
    a segment) is selected in two launches or more: each segment's top ``k`` keys (from words, packed from them and
    their entries), then the top ``k`` of those (the row's top ``k`` are among them); or whole in one, where
    :func:`select_takes_whole` (words, few rows).

    into: also convert the picks into cache slots in the (last) launch (:class:`PicksInto`), the same values as
    :class:`sparse_mla.picks.PicksConversion` writes for ``out``'s picks, provided every candidate of a row is an
    entry its token may see on a present block: true of the score kernel's rows (it packs no other as a candidate),
    so the conversion drops nothing; rows made otherwise must hold no candidate there (``INT64_MIN``; a word 0).

    digit_bits: how the threshold is searched, ``0`` a bit a round or 1-11 bits a pass (a histogram of the words in
    play); None, the target's choice (:func:`select_digit_bits`). The picks do not depend on it."""
    if digit_bits is not None and (type(digit_bits) is not int or not 0 <= digit_bits <= MAX_DIGIT_BITS):
        raise ValueError(f"digit_bits must be None or an int in [0, {MAX_DIGIT_BITS}], got {digit_bits!r}")
    if digit_bits and not HISTOGRAM_TAKES_MASK:
        raise ValueError(f"digit_bits={digit_bits} needs tl.histogram's mask, which Triton {triton.__version__} lacks; "
                         f"pass 0 or None")
    check_tensor("packed", packed, dtype=(torch.int64, torch.int32), ndim=2)
    k = check_positive_int("k", k)
    rows, cols = packed.shape
    check_tensor("out", out, dtype=torch.int32, shape=(rows, k), device=packed.device)
    if packed.stride(1) != 1 or out.stride(1) != 1:  # the kernel reads and writes rows at unit stride
        raise ValueError(f"packed and out must have unit column stride, got strides {packed.stride()} and "
                         f"{out.stride()}")
    check_rows_apart("out", out)  # rows sharing memory: one row's picks overwritten by another's
    # a program writes its row's outputs while others still read their inputs (their packed rows, the conversion's
    # positions, requests and table) and read their own picks back from out: no output may share memory with an
    # input or another output
    outputs, inputs = {"out": out}, {"packed": packed}
    if into is not None:
        _check_picks_into(into, rows, k, packed.device)
        outputs |= {f"into.{name}": getattr(into, name) for name in ("indices", "lens", "kept")}
        inputs |= {f"into.{name}": getattr(into, name) for name in ("positions", "token_to_req", "table")}
    names = list(outputs)
    for i, name in enumerate(names):
        check_no_overlap(name, outputs[name], inputs | {other: outputs[other] for other in names[i + 1:]})
    launch_topk_rows(packed, k, out, into, digit_bits=digit_bits)


def launch_topk_rows(packed: torch.Tensor, k: int, out: torch.Tensor, into: PicksInto | None = None, *,
                     digit_bits: int | None = None) -> None:
    """:func:`topk_rows`' launches alone, for a caller that made its arguments to fit (the indexer layer: its own
    workspace and picks buffer, the step conversion's :class:`PicksInto`)."""
    rows, cols = packed.shape
    column_entries, entries = True, cols  # the row's entries: its columns, below cols
    while cols > MAX_SELECT_COLS:
        # (whole or not, a long row must be one segments could take: the same calls valid on every GPU)
        if cols % SELECT_SEGMENT or not select_kernel_takes(k) or not packed.is_contiguous():
            raise ValueError(f"a row of {cols} columns must be contiguous, a multiple of {SELECT_SEGMENT} columns, and "
                             f"k ({k}) below {SELECT_SEGMENT} (each segment's top k must shorten it)")
        if packed.dtype == torch.int32:  # the score kernel's words (a first pass: the winners are keys)
            target = targets.target_of(packed.device)
            if select_takes_whole(target, rows, cols, targets.num_sms(packed.device, target), digit_bits):
                break
        segments = packed.view(rows * (cols // SELECT_SEGMENT), SELECT_SEGMENT)
        winners = torch.empty(segments.shape[0], k, dtype=torch.int64, device=packed.device)
        # a first pass's entries are its segments' columns (words: the winners' keys are packed from them); a later
        # pass reads the winners' entries from their keys: any of the row's
        # (the segments a row matter to words alone, which carry no entries; packed rows pass 1, which Triton
        # specialises as it did before the argument existed: the same binary for them)
        _launch_select(segments, k, winners, True, column_entries, SELECT_SEGMENT if column_entries else entries,
                       digit_bits=digit_bits, segments=cols // SELECT_SEGMENT if packed.dtype == torch.int32 else 1)
        packed, cols, column_entries = winners.view(rows, -1), winners.numel() // rows, False
    _launch_select(packed, k, out, False, column_entries, entries, into, digit_bits)


def dot_dtype_for(target: targets.Target, key_format: str, q_format: str) -> torch.dtype:
    """The score kernel's dot operands: float32 in the interpreter (its bf16 dot is wrong), e4m3 where the keys and q
    are fp8 and the target has e4m3 tensor-core ops (the targets that convert e4m3 natively: sm_89 and later, gfx950;
    twice bf16's rate: a decode of 64 heads is otherwise bound by the bf16 dot, not the key reads), float16 where
    they are fp8 and it has none (the keys' integer decode yields float16 values: no conversion to bf16 a code; q
    holds e4m3 values in float16), else bf16. Every choice is exact on the operands (e4m3 and bf16 values). The
    float16 dot under the sm_80 lowering on an H200, the layer against the bf16 dot (docs/history.md version 39): B 32
    76.5 -> 63.7 us, B 128 235.2 -> 182.9, the 4K prefill chunk 3,757 -> 2,868; the same picks."""
    if interpreting():
        return torch.float32
    if key_format == "fp8" and q_format == "fp8":
        # e4m3 values are exact in float16 (the integer decode's own type): no conversion to bf16 in the page loop
        return torch.float8_e4m3fn if target.native_fp8 else torch.float16
    return torch.bfloat16


# the words of the scores past float32's range (unsigned): +inf and the positive NaNs from 0xFF800000 up, -inf at
# 0x007FFFFF and the negative NaNs below it (a candidate's word is at least 1); a finite score's lies in between
_WORD_POS_INF, _WORD_NEG_INF = 0xFF800000, 0x007FFFFF
# the packed keys' high words (signed): +inf and the positive NaNs from 0x7F800000 up, -inf (0x807FFFFF) and the
# negative NaNs at or below it (no candidate, INT64_MIN, excluded)
_HIGH_POS_INF, _HIGH_NEG_INF = 0x7F800000, -2139095041


def scores_finite(scores: torch.Tensor, words: bool, written: torch.Tensor | None = None) -> bool:
    """Whether every candidate of a score launch's ``scores`` (int32 words, else packed int64 keys) has a finite score,
    counting only the columns ``written`` (a bool mask like ``scores``: :func:`sparse_mla.indexer.written_columns`)
    where given (a device sync: the layer's debug check, docs/checks.md)."""
    if words:
        bits = scores.to(torch.int64) & 0xFFFFFFFF
        bad = (bits >= _WORD_POS_INF) | ((bits >= 1) & (bits <= _WORD_NEG_INF))
    else:
        high = scores >> 32  # the order bits: float order as signed ints
        bad = (high >= _HIGH_POS_INF) | ((high <= _HIGH_NEG_INF) & (scores != INT64_MIN))
    if written is not None:
        bad &= written
    return not bool(bad.any())


def unpack_entries(packed: torch.Tensor) -> torch.Tensor:
    """Packed keys -> their entries, int32, ``-1`` for ``INT64_MIN`` (no candidate)."""
    entries = _LOW_MASK - (packed & _LOW_MASK)
    return torch.where(packed == INT64_MIN, -1, entries).to(torch.int32)


def topk_from_packed(packed: torch.Tensor, k: int) -> torch.Tensor:
    """``(rows, num_cols)`` packed scores -> ``(rows, k)`` int32 entries, best first, ``-1`` where a row has fewer
    than ``k`` candidates (``k <= num_cols``)."""
    return unpack_entries(torch.topk(packed, k, dim=1, sorted=True).values)


def _block_rows(packed: torch.Tensor) -> tuple[int, int]:
    """``packed``'s ``(rows, num_cols)``, checked: int64 rows of whole blocks of :data:`BLOCK_ENTRIES` entries."""
    check_tensor("packed", packed, dtype=torch.int64, ndim=2)
    if packed.shape[1] % BLOCK_ENTRIES:
        raise ValueError(f"packed must have num_cols a multiple of {BLOCK_ENTRIES}, got {tuple(packed.shape)}")
    return packed.shape


def top_blocks_from_packed(packed: torch.Tensor, positions: torch.Tensor, ratio: int, num_kept: int) -> torch.Tensor:
    """V4.1's first level on packed rows: ``(rows, num_cols)`` (num_cols a multiple of 8) and the rows' positions
    ``(rows,)`` -> ``(rows, num_kept)`` int32 blocks of 8 entries, best block score (its max) first, the block of the
    newest visible entry pinned first, ties to the lower block (the packed max carries its entry), ``-1`` fill."""
    rows, cols = _block_rows(packed)
    check_tensor("positions", positions, dtype=(torch.int32, torch.int64), shape=(rows,), device=packed.device)
    check_positive_int("ratio", ratio)
    check_positive_int("num_kept", num_kept)
    block_max = packed.view(rows, cols // BLOCK_ENTRIES, BLOCK_ENTRIES).amax(-1)
    newest = ((positions.long() + 1).clamp_min(0) // ratio - 1) // BLOCK_ENTRIES  # -1: nothing visible
    pinned = torch.arange(block_max.shape[1], device=packed.device)[None, :] == newest[:, None]
    block_max = torch.where(pinned & (block_max != INT64_MIN), torch.iinfo(torch.int64).max, block_max)
    kept = min(num_kept, block_max.shape[1])
    top = torch.topk(block_max, kept, dim=1, sorted=True)
    blocks = torch.where(top.values == INT64_MIN, -1, top.indices).to(torch.int32)
    if kept < num_kept:
        blocks = torch.nn.functional.pad(blocks, (0, num_kept - kept), value=-1)
    return blocks


def restrict_to_blocks(packed: torch.Tensor, kept_blocks: torch.Tensor) -> None:
    """In place: every entry of ``packed (rows, num_cols)`` outside its row's ``kept_blocks (rows, n)`` (blocks of 8
    entries, ``-1`` none) becomes ``INT64_MIN``."""
    rows, cols = _block_rows(packed)
    check_tensor("kept_blocks", kept_blocks, dtype=(torch.int32, torch.int64), shape=(rows, None),
                 device=packed.device)
    nb = cols // BLOCK_ENTRIES
    allowed = torch.zeros(rows, nb + 1, dtype=torch.bool, device=packed.device)
    allowed.scatter_(1, torch.where((kept_blocks >= 0) & (kept_blocks < nb), kept_blocks, nb).long(), True)
    blocks = packed.view(rows, nb, BLOCK_ENTRIES)
    blocks.masked_fill_(~allowed[:, :nb, None], INT64_MIN)
