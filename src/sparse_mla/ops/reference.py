"""Plain-PyTorch sparse attention (the reference every other backend is tested against).

Exact up to float32 rounding, any device. It gathers each token's keys from the paged caches,
dequantises them, and runs a masked softmax with the attention sink (DESIGN §1).
"""
from __future__ import annotations

from dataclasses import replace

import torch

from ..formats import KVFormat, read_tokens, write_tokens
from .validate import D_V, AttentionArgs, Scope

_CHUNK_ELEMS = 1 << 25  # gathered key floats per chunk of tokens: bounds the memory of one call


def scope_rows(scope: Scope, tokens: slice) -> tuple[torch.Tensor, torch.Tensor]:
    """The index rows of ``tokens`` in one scope as padded ``(n, width)`` int64 rows and lengths ``(n,)``: a
    ragged scope's rows padded to its longest among them (a sync), a combined index's part its own count."""
    if scope.indptr is None:
        return scope.indices[tokens].long(), scope.lens[tokens] - scope.len_skip
    start = scope.indptr[tokens].long()
    lens = scope.indptr[tokens.start + 1 : tokens.stop + 1].long() - start
    width = int(lens.max()) if lens.numel() else 0
    j = torch.arange(width, device=start.device)[None, :]
    within = j < lens[:, None]
    flat = torch.where(within, start[:, None] + j, 0)
    return torch.where(within, scope.indices.long()[flat], -1), lens


def gather_scope(scope: Scope, tokens: slice, kv_scale: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys of ``tokens`` in one scope: ``(n, width, d)`` float32 (zero where invalid) and validity ``(n, width)``
    (``kv_scale``: the per-tensor scale of an fp8_e4m3 scope)."""
    idx, lens = scope_rows(scope, tokens)
    n, width = idx.shape
    bs = scope.cache.shape[1]
    within = torch.arange(width, device=idx.device)[None, :] < lens[:, None]
    valid = within & (idx >= 0) & (idx < scope.num_slots)
    if scope.num_slots == 0:  # an empty cache: nothing to read, every entry invalid
        return torch.zeros(n, width, scope.fmt.dim, device=idx.device), valid
    # tokens share most keys (overlapping windows, common entries): dequantise each slot once
    slots, inverse = torch.unique(torch.where(valid, idx, 0), return_inverse=True)
    keys = read_tokens(scope.cache, scope.fmt, slots // bs, slots % bs, kv_scale)[inverse]
    keys = torch.where(valid[..., None], keys, 0.0)  # unused slots may hold NaN: never let them in
    return keys, valid


def attend(q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, sink: torch.Tensor | None,
           scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked softmax attention with sink.

    q: ``(n, H, d)``; keys: ``(n, K, d)`` float32, zero where invalid; valid: ``(n, K)`` bool.
    Returns out ``(n, H, 512)`` float32 and lse ``(n, H)`` (``+inf`` where a row has no key).
    """
    scores = torch.einsum("nhd,nkd->nhk", q.float(), keys) * scale
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    empty = ~valid.any(dim=-1)[:, None].expand_as(lse)
    probs = torch.exp(scores - torch.where(empty, 0.0, lse)[..., None])
    out = torch.einsum("nhk,nkd->nhd", probs, keys[..., :D_V])
    if sink is not None:
        out = out / (1.0 + torch.exp(sink[None, :] - lse))[..., None]
    out = torch.where(empty[..., None], 0.0, out)
    return out, torch.where(empty, float("inf"), lse)


def run(args: AttentionArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over all scopes of ``args``: out ``(T, H, 512)`` bf16, lse ``(T, H)`` float32.

    An fp8 q and fp8_e4m3 keys are dequantised (``e4m3 · q_scale``, ``e4m3 · kv_scale``) before the float32
    math: the same numbers as FlashInfer's ``bmm1_scale = scale · q_scale · kv_scale``, ``bmm2_scale = kv_scale``.
    """
    q = args.q if args.q_scale is None else args.q.float() * args.q_scale
    num_tokens, num_heads, dim = q.shape
    scopes = [s if s.indptr is not None else replace(s, lens=args.token_lens(s)) for s in args.scopes]
    out = args.out if args.out is not None else torch.empty(num_tokens, num_heads, D_V, dtype=torch.bfloat16,
                                                                device=q.device)
    lse = torch.empty(num_tokens, num_heads, dtype=torch.float32, device=q.device)
    width = sum(s.width for s in scopes)
    step = max(1, _CHUNK_ELEMS // max(1, width * dim))
    for start in range(0, num_tokens, step):
        rows = slice(start, min(start + step, num_tokens))
        gathered = [gather_scope(s, rows, args.kv_scale) for s in scopes]
        keys = torch.cat([k for k, _ in gathered], dim=1)
        valid = torch.cat([v for _, v in gathered], dim=1)
        rows_out, rows_lse = attend(q[rows], keys, valid, args.sink, args.scale)
        out[rows], lse[rows] = rows_out.to(torch.bfloat16), rows_lse
    return out, lse


def split_slots(cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots ``(n,)`` -> (block, offset) int64 pairs for a paged cache."""
    bs = cache.shape[1]
    slots = slots.long()
    return slots // bs, slots % bs


def quantize_and_insert(kv_new: torch.Tensor, cache: torch.Tensor, fmt: KVFormat, slot_mapping: torch.Tensor,
                        kv_scale: torch.Tensor | None = None) -> None:
    """Quantise ``kv_new (n, d)`` bf16 into a validated ``cache`` at ``slot_mapping (n,)`` (``-1`` skipped);
    ``kv_scale`` ``(1,)`` float32: an fp8_e4m3 cache's."""
    keep = slot_mapping >= 0
    blocks, offsets = split_slots(cache, slot_mapping[keep])
    write_tokens(cache, fmt, blocks, offsets, kv_new[keep], kv_scale)


def dequantize_and_gather(cache: torch.Tensor, fmt: KVFormat, kv_scale: torch.Tensor | None,
                          slots: torch.Tensor) -> torch.Tensor:
    """Tokens at ``slots`` (any shape, ``-1`` -> zeros) of a validated cache: ``slots.shape + (d,)`` bf16."""
    flat = slots.reshape(-1)
    if cache.shape[0] * cache.shape[1] == 0:  # an empty cache: every slot reads as zeros
        return torch.zeros(*slots.shape, fmt.dim, dtype=torch.bfloat16, device=cache.device)
    blocks, offsets = split_slots(cache, flat.clamp_min(0))
    rows = torch.where((flat >= 0)[:, None], read_tokens(cache, fmt, blocks, offsets, kv_scale), 0.0)
    return rows.to(torch.bfloat16).view(*slots.shape, fmt.dim)
