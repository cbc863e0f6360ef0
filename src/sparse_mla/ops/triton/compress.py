"""Triton kernels of the KV compressors (DESIGN §6; the reference: :func:`sparse_mla.compressor.compress_reference`).

Two launches per call, then the cache's insert kernel:

* ``_compress_kernel``, one program per token row: a row that completes an entry (``entry_positions[t] >= 0``)
  pools its window per channel with an online softmax over blocks of ``BJ`` slots (each slot read from this step's
  rows when new, else from the request's state ring), rounds the pooled value to bf16, RMS-normalises it (the
  latent) and ropes the last 64 channels at the entry's position (the entry); other rows get zeros. The roundings
  to bf16 are integer round-to-nearest-even (:func:`round_bf16`), so the CPU interpreter (whose float32 -> bf16
  cast truncates) gives the GPU's bytes.
* ``_state_kernel``, one program per token row: rows whose positions are among their request's last ``RING``
  store their raw kv and gate into the ring, after every read of it (a later launch on the same stream).

Both grids are the call's rows, whatever completes: a decode step is the same launches every step (CUDA graphs).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...compress_metadata import CompressMetadata
from ...compress_state import OVERLAP_RATIO
from ..launch import cached_launch
from .index import request_row


@triton.jit
def round_bf16(x):
    """float32 ``x`` rounded to the nearest bf16 (ties to even), as float32: integer operations on the bits."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def rope_tail(x, position, inv_freq_ptr, D: tl.constexpr, ROPE: tl.constexpr):
    """``x (D,)`` float32 with its last ``ROPE`` channels rotated in interleaved pairs ``(2i, 2i+1)`` by the angle
    ``position · inv_freq[i]`` (float32, as :func:`sparse_mla.rope.rotate_interleaved_tail`); the rest unchanged."""
    pairs = tl.reshape(x, [D // 2, 2])
    even, odd = tl.split(pairs)
    k = tl.arange(0, D // 2) - (D - ROPE) // 2  # the rope pair index, negative before the tail
    is_rope = k >= 0
    angle = position.to(tl.float32) * tl.load(inv_freq_ptr + tl.where(is_rope, k, 0), mask=is_rope, other=0.0)
    c, s = tl.cos(angle), tl.sin(angle)
    new_even = tl.where(is_rope, even * c - odd * s, even)
    new_odd = tl.where(is_rope, even * s + odd * c, odd)
    return tl.reshape(tl.join(new_even, new_odd), [D])


@triton.jit
def _window_values(x_ptr, ring_ptr, in_off, ring_off, from_input, from_ring, RING: tl.constexpr):
    """One block of a window's values (float32): this step's rows where new, the state ring where older."""
    x = tl.load(x_ptr + in_off, mask=from_input, other=0.0).to(tl.float32)
    if RING > 0:
        x = tl.where(from_ring, tl.load(ring_ptr + ring_off, mask=from_ring, other=0.0).to(tl.float32), x)
    return x


@triton.jit
def _compress_kernel(kv_ptr, score_ptr, in_stride, ape_ptr, weight_ptr, inv_freq_ptr, eps,
                     pos_ptr, req_ptr, num_reqs, entry_pos_ptr, prefix_ptr, state_slot_ptr,
                     ring_kv_ptr, ring_score_ptr, ring_stride0, ring_stride1, latent_ptr, entry_ptr,
                     R: tl.constexpr, D: tl.constexpr, OVERLAP: tl.constexpr, HAS_APE: tl.constexpr,
                     HAS_SCORE: tl.constexpr, RING: tl.constexpr, BJ: tl.constexpr, ROPE: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, D)
    out = t * D + cols
    entry_pos = tl.load(entry_pos_ptr + t)
    if entry_pos < 0:  # this row completes no entry
        zero = tl.zeros([D], tl.float32).to(tl.bfloat16)
        tl.store(latent_ptr + out, zero)
        tl.store(entry_ptr + out, zero)
    else:
        p = tl.load(pos_ptr + t).to(tl.int64)
        req = request_row(tl.load(req_ptr + t), num_reqs)
        # the window's slots from here on are this step's input rows (before it, the state ring's): at the request's
        # prefix, and never before the step's first row (row t holds position p: a token named to another request
        # than its own, a caller's bad token_to_req value, would put the prefix before it and read outside the input)
        first_new = tl.maximum(tl.load(prefix_ptr + req), p - t)
        state = tl.load(state_slot_ptr + req).to(tl.int64) * ring_stride0
        L: tl.constexpr = 2 * R if OVERLAP else R
        WIDTH: tl.constexpr = 2 * D if OVERLAP else D
        RING_MOD: tl.constexpr = RING if RING > 0 else 1
        first = p + 1 - L  # the window's first slot's position (negative: w = 0's empty first half)
        m = tl.full([D], float("-inf"), tl.float32)
        total = tl.zeros([D], tl.float32)
        acc = tl.zeros([D], tl.float32)
        for jb in range(0, L, BJ):
            j = jb + tl.arange(0, BJ)
            pj = first + j
            exists = pj >= 0
            new = pj >= first_new
            chan = 0
            if OVERLAP:  # slots [0, R): window w-1's first halves; [R, 2R): window w's second halves
                chan = tl.where(jb >= R, D, 0)
            from_input = (exists & new)[:, None]
            from_ring = (exists & ~new)[:, None]
            in_off = (t - (p - pj))[:, None] * in_stride + chan + cols[None, :]
            ring_off = state + (tl.where(exists, pj, 0) % RING_MOD)[:, None] * ring_stride1 + chan + cols[None, :]
            x = _window_values(kv_ptr, ring_kv_ptr, in_off, ring_off, from_input, from_ring, RING)
            s = tl.zeros([BJ, D], tl.float32)
            if HAS_SCORE:
                s = _window_values(score_ptr, ring_score_ptr, in_off, ring_off, from_input, from_ring, RING)
            if HAS_APE:
                s += tl.load(ape_ptr + (j % R)[:, None] * WIDTH + chan + cols[None, :])
            s = tl.where(exists[:, None], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 0))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a block of empty slots before any other
            alpha = tl.exp(m - m_safe)
            weights = tl.exp(s - m_safe[None, :])
            total = total * alpha + tl.sum(weights, 0)
            acc = acc * alpha + tl.sum(weights * x, 0)
            m = m_new
        x = round_bf16(acc / total)
        inv_rms = 1.0 / tl.sqrt_rn(tl.sum(x * x, 0) / D + eps)
        latent = round_bf16(x * inv_rms * tl.load(weight_ptr + cols))
        tl.store(latent_ptr + out, latent.to(tl.bfloat16))
        entry = round_bf16(rope_tail(latent, entry_pos, inv_freq_ptr, D, ROPE))
        tl.store(entry_ptr + out, entry.to(tl.bfloat16))


@triton.jit
def _state_kernel(kv_ptr, score_ptr, in_stride, pos_ptr, req_ptr, num_reqs, seq_ptr, state_slot_ptr,
                  ring_kv_ptr, ring_score_ptr, ring_stride0, ring_stride1,
                  WIDTH: tl.constexpr, RING: tl.constexpr, HAS_SCORE: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    p = tl.load(pos_ptr + t)
    if p >= 0:
        req = request_row(tl.load(req_ptr + t), num_reqs)
        if p >= tl.load(seq_ptr + req) - RING:  # among the request's last RING positions
            cols = tl.arange(0, WIDTH)
            dst = tl.load(state_slot_ptr + req).to(tl.int64) * ring_stride0 + (p % RING) * ring_stride1 + cols
            tl.store(ring_kv_ptr + dst, tl.load(kv_ptr + t * in_stride + cols))
            if HAS_SCORE:
                tl.store(ring_score_ptr + dst, tl.load(score_ptr + t * in_stride + cols))


def block_slots(ratio: int, dim: int) -> int:
    """Window slots pooled per loop step (``BJ``): within one half at the overlapping ratio, ``(BJ, dim)`` tiles of
    about 4K values."""
    return min(ratio, max(1, 4096 // dim))


def compress(kv: torch.Tensor, score: torch.Tensor | None, ape: torch.Tensor | None, weight: torch.Tensor,
             eps: float, inv_freq: torch.Tensor, meta: CompressMetadata, rings: tuple[torch.Tensor, torch.Tensor],
             latent: torch.Tensor, entries: torch.Tensor) -> None:
    """Launch the compressor on checked arguments (:meth:`sparse_mla.compressor.KVCompressor.forward`): fills
    ``latent`` / ``entries`` ``(T, d)`` bf16 and updates ``rings``. kv / score ``(T, coff·d)`` with unit-stride
    rows of one row stride."""
    rows, dim = kv.shape[0], latent.shape[1]
    if rows == 0:
        return
    if kv.stride(1) != 1 or (score is not None and score.stride() != kv.stride()):  # one row stride for both
        kv = kv.contiguous()
        score = None if score is None else score.contiguous()
    ratio, ring = meta.ratio, meta.pool.ring
    batch = meta.batch
    ring_kv, ring_score = rings
    score_arg = kv if score is None else score
    # a token's request is clamped into this step's requests (the per-request tensors' rows: the metadata's are the
    # builder's max_reqs, the batch's seq_lens its num_reqs) in both kernels
    num_reqs = min(batch.seq_lens.shape[0], meta.prefix_lens.shape[0], meta.state_slots.shape[0])
    overlap, has_score = ratio == OVERLAP_RATIO, score is not None
    constexprs = (("R", ratio), ("D", dim), ("OVERLAP", overlap), ("HAS_APE", ape is not None),
                  ("HAS_SCORE", has_score), ("RING", ring), ("BJ", block_slots(ratio, dim)),
                  ("ROPE", 2 * inv_freq.shape[0]))
    cached_launch(_compress_kernel, constexprs, (("num_warps", 4),))(
        (rows,), kv, score_arg, kv.stride(0), weight if ape is None else ape, weight, inv_freq, float(eps),
        batch.positions, batch.token_to_req, num_reqs,
        meta.entry_positions, meta.prefix_lens, meta.state_slots, ring_kv, ring_score, ring_kv.stride(0),
        max(ring_kv.stride(1), 1), latent, entries)
    if ring:
        cached_launch(_state_kernel, (("WIDTH", kv.shape[1]), ("RING", ring), ("HAS_SCORE", has_score)),
                      (("num_warps", 4),))(
            (rows,), kv, score_arg, kv.stride(0), batch.positions, batch.token_to_req,
            num_reqs, batch.seq_lens, meta.state_slots, ring_kv,
            ring_score, ring_kv.stride(0), ring_kv.stride(1))
