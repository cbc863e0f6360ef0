"""Sparse attention ops (DESIGN §4) with backend selection.

``backend="auto"`` picks the fastest implementation available for the inputs' device; any
backend can be forced by name. All backends share the argument checks of :mod:`.validate`. On the Triton path a
call of a signature checked before (every tensor's shape, strides, dtype, device and alignment, every other
argument) skips the checks and the planning and launches the remembered plan at once (:mod:`.memo`).
"""
from __future__ import annotations

import torch

from . import reference
from ..cache_views import pages_16_byte_aligned, resolve_cache_once
from ..formats import resolve_cache
from . import dispatch
from .dispatch import BACKENDS, backend_for, check_backend_name
from .merge import merge_partials
from .order import longest_first
from .validate import (AttentionArgs, debug_checks_enabled, declared_formats, decode_args, gather_args, insert_args,
                       out_inputs, prefill_args)

try:
    from . import attention_plan, memo
    from .triton import cache as triton_cache, index as triton_index
except ImportError:  # no Triton on this platform: the reference backend still works
    attention_plan = memo = triton_cache = triton_index = None


def attention_kernel(backend: str, q: torch.Tensor, cache: torch.Tensor) -> str:
    """What ``sparse_attention_decode(q, cache, ..., backend=backend)`` runs: ``"reference"``, ``"triton"`` or
    ``"gluon"`` (the Hopper kernel, for fp8_v4 / fp8_v32 / bf16 caches), resolving ``"auto"`` for ``q``'s device."""
    if backend_for(backend, q, "q") == "reference":
        return "reference"
    paged, fmt = resolve_cache(cache)
    return dispatch.attention_kernel(q.device, q.shape[-1], frozenset({fmt.name}),
                                     pages_16_byte_aligned(paged),
                                     q_fp8=q.dtype == torch.float8_e4m3fn)


def sparse_attention_decode(
    q: torch.Tensor,
    cache: torch.Tensor,
    indices: torch.Tensor,
    lens: torch.Tensor | None = None,
    *,
    extra_cache: torch.Tensor | None = None,
    extra_indices: torch.Tensor | None = None,
    extra_lens: torch.Tensor | None = None,
    sink: torch.Tensor | None = None,
    scale: float | None = None,
    fmt: str | None = None,
    backend: str = "auto",
    out: torch.Tensor | None = None,
    order: torch.Tensor | None = None,
    batch_invariant: bool = False,
    indptr: torch.Tensor | None = None,
    extra_indptr: torch.Tensor | None = None,
    combined_window: int | None = None,
    q_scale: float | torch.Tensor | None = None,
    kv_scale: float | torch.Tensor | None = None,
    tokens_per_len: int = 1,
    extra_fmt: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA attention of each query token over two index scopes of paged caches.

    q: ``(T, H, d)`` bf16, d = 512 (V4) or 576 (V3.2); or float8_e4m3fn with ``q_scale`` (its values are
    ``e4m3 · q_scale``). cache / extra_cache: paged caches ``(num_blocks, block_size, token_bytes)`` in any
    format of :mod:`sparse_mla.formats`; fp8_e4m3 caches need ``kv_scale`` (one for both caches of the call:
    the scores use ``scale · q_scale · kv_scale``, the output ``kv_scale``, as FlashInfer's bmm1/bmm2 scales).
    indices / extra_indices: ``(T, width)`` int32 slots, ``-1`` invalid; token ``t`` attends to the
    first ``lens[t]`` entries of each (``lens``: ``(T,)`` int32, default the full width).
    sink: ``(H,)`` float32 logits joining the softmax denominator only. scale defaults to d**-0.5.
    fmt: the caches' format name (``"fp8_v4"``, ``"bf16"``, ``"fp8_v32"``, ``"fp8_e4m3"``, ``"fp8_v41"``, ...),
    optional: the format is inferred from each cache's dtype and last axis, and a given ``fmt`` is checked against it.
    A page-planar V4.1 cache (``"fp8_v41_planar"``, ``"fp4_v41_planar"``) reads as token-interleaved unless named.
    extra_fmt: ``extra_cache``'s format name alone; ``fmt`` then names ``cache``'s alone. None (the
    default): ``fmt`` declares both caches (or neither). Needed where the caches' page-planar formats differ, e.g.
    ``fmt="fp8_v41_planar", extra_fmt="fp4_v41_planar"`` (a V4.1 layer's window and fp4 compressed caches as vLLM
    pages them). Any two formats of one width are read (a layer's pairs are fewer: ``config.check_scope_formats``);
    an unknown name or a name the extra cache's tensor contradicts is a ``ValueError`` naming ``extra_fmt``.
    backend: ``"auto"`` (the Triton kernels on a CUDA device, else the reference), ``"reference"``
    (plain PyTorch) or ``"triton"`` (on the CPU only under ``TRITON_INTERPRET=1``).
    Returns out ``(T, H, 512)`` bf16 (written into ``out`` when given: contiguous, that shape) and
    lse ``(T, H)`` float32 (natural log over real keys, ``+inf`` for a row with no valid key, whose
    output is 0).
    order: ``(T,)`` int32, a permutation of the tokens: the order the GPU kernels start them in, which
    changes their speed, never their results. ``longest_first(lens, extra_lens)``, computed once per step,
    keeps ragged lists from leaving SMs idle at the end (up to 22 % faster on C128A decode).
    batch_invariant: a token's output is bitwise the same whatever else is in the batch (its key list is
    split by its own length alone, see ``attention_plan.INVARIANT_SPLIT_BLOCKS``); the reference is
    batch-invariant anyway.

    Other index forms (:mod:`sparse_mla.index_forms` builds them):

    * ragged (ROCm AITER's): ``indptr`` / ``extra_indptr`` ``(T+1,)`` int32 make that scope's ``indices`` flat
      ``(capacity,)`` int32, token ``t`` reading ``indices[indptr[t]:indptr[t+1]]``; its lens must be None.
    * combined (FlashInfer TRTLLM-gen's): ``combined_window=W`` makes ``indices (T, W + K)`` one list over both
      caches, columns ``< W`` slots of ``cache``, the rest slots of ``extra_cache``; token ``t`` reads the first
      ``lens[t]`` entries of its row; ``extra_indices`` / ``extra_lens`` must be None.

    ``q_scale`` / ``kv_scale``: a positive number or a one-element float32 tensor on q's device (read at run
    time: no sync, CUDA graphs see updates).

    tokens_per_len: consecutive tokens sharing one length: ``lens`` / ``extra_lens`` are then
    ``(T // tokens_per_len,)``, token ``t`` reading ``lens[t // tokens_per_len]`` (FlashMLA's per-request
    ``topk_length`` for requests of ``s_q`` query tokens each, read as it is: no expanding launch). Not with
    ragged scopes.

    Host time: a Triton-path call of a signature seen before (no ``SPARSE_MLA_DEBUG``) launches its remembered
    plan, bound to the signature, without checking or planning again (:mod:`.memo`); only ``out``'s overlap with
    the inputs is checked again.
    """
    caches = (cache,) if extra_cache is None else (cache, extra_cache)
    if combined_window is None:  # per scope its index list and lens (or indptr), as the memo takes them
        lists = (indices, extra_indices)[:len(caches)]
        counts = (lens if indptr is None else indptr, extra_lens if extra_indptr is None else extra_indptr)
    else:
        lists, counts = (indices,), (lens,)
    sig = None
    if memo is not None and not debug_checks_enabled():
        # q_scale / kv_scale: numbers or tensors (each in its place: a number's value, a tensor's geometry)
        q_tensor = q_scale if isinstance(q_scale, torch.Tensor) else None
        kv_tensor = kv_scale if isinstance(kv_scale, torch.Tensor) else None
        sig = memo.signature((q, cache, indices, lens, extra_cache, extra_indices, extra_lens, sink, out, order, indptr,
                              extra_indptr, q_tensor, kv_tensor),
                             ("decode", scale, fmt, extra_fmt, backend, attention_plan.invariant_split(batch_invariant),
                              combined_window, tokens_per_len, None if q_tensor is not None else q_scale,
                              None if kv_tensor is not None else kv_scale))
        entry = memo.recall_call(sig, out, lambda: out_inputs(q, cache, indices, lens, extra_cache, extra_indices,
                                                              extra_lens, sink, order, indptr, extra_indptr,
                                                              q_tensor, kv_tensor))
        if entry is not None:
            def paged() -> tuple[torch.Tensor, ...]:  # each cache's paged view, under its declared format
                fmts = declared_formats(fmt, extra_fmt, extra_cache)[0]
                return tuple([resolve_cache_once(c, f)[0] for c, f in zip(caches, fmts)])

            return memo.launch_call(entry, q, caches, paged, lists, counts[:len(lists)], sink, out, order, q_scale,
                                    kv_scale)
    family, args = checked_decode(backend, q, cache, indices, lens, extra_cache, extra_indices, extra_lens, sink,
                                  scale, fmt, out=out, order=order, indptr=indptr, extra_indptr=extra_indptr,
                                  combined_window=combined_window, q_scale=q_scale, kv_scale=kv_scale,
                                  tokens_per_len=tokens_per_len, extra_fmt=extra_fmt)
    if family == "reference":
        return reference.run(args)
    plan = attention_plan.plan_for(args, batch_invariant)
    if sig is not None:
        memo.remember_call(sig, args, plan, q, caches, lists, counts[:len(lists)], sink, out, order, q_scale,
                           kv_scale, combined_window)
    return attention_plan.run(args, plan=plan)


def checked_decode(backend: str, q: torch.Tensor, *args, **kwargs) -> tuple[str, AttentionArgs]:
    """The op family ``backend`` resolves to for ``q``'s device (``"reference"`` or ``"triton"``) and
    :func:`sparse_attention_decode`'s arguments checked for it (``validate.decode_args``: index ranges always for
    the reference, under ``SPARSE_MLA_DEBUG=1`` for the Triton family)."""
    family = backend_for(backend, q, "q")
    return family, decode_args(q, *args, check_ranges=family == "reference" or debug_checks_enabled(), **kwargs)


def sparse_attention_prefill(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    lens: torch.Tensor | None = None,
    *,
    sink: torch.Tensor | None = None,
    scale: float | None = None,
    backend: str = "auto",
    out: torch.Tensor | None = None,
    indptr: torch.Tensor | None = None,
    batch_invariant: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse attention over a bf16 workspace ``kv (S, d)``: ``indices (T, width)`` int32 rows of kv, or with
    ``indptr (T+1,)`` int32 a flat ``(capacity,)`` ragged list (row ``t``: ``indices[indptr[t]:indptr[t+1]]``,
    ``lens`` None).

    Same semantics, returns and remembered calls as :func:`sparse_attention_decode` (``batch_invariant`` too: a
    token's output depends on its own key list, not on the rest of the call).
    """
    counts = (lens if indptr is None else indptr,)
    sig = None
    if memo is not None and not debug_checks_enabled():
        sig = memo.signature((q, kv, indices, lens, sink, out, indptr),
                             ("prefill", scale, backend, attention_plan.invariant_split(batch_invariant)))
        entry = memo.recall_call(sig, out, lambda: out_inputs(q, kv, indices, lens, sink=sink, indptr=indptr,
                                                              cache_name="kv"))
        if entry is not None:
            return memo.launch_call(entry, q, (kv,), lambda: (kv.unsqueeze(1),), (indices,), counts, sink, out,
                                    None, None, None)
    if backend_for(backend, q, "q") == "reference":
        return reference.run(prefill_args(q, kv, indices, lens, sink, scale, out=out, indptr=indptr))
    args = prefill_args(q, kv, indices, lens, sink, scale, check_ranges=debug_checks_enabled(), out=out, indptr=indptr)
    plan = attention_plan.plan_for(args, batch_invariant)
    if sig is not None:
        memo.remember_call(sig, args, plan, q, (kv,), (indices,), counts, sink, out, None, None, None)
    return attention_plan.run(args, plan=plan)


def quantize_and_insert(kv_new: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor,
                        fmt: str | None = None, backend: str = "auto",
                        kv_scale: float | torch.Tensor | None = None) -> None:
    """Quantise ``kv_new (n, d)`` bf16 into the paged ``cache`` at ``slot_mapping (n,)``; ``-1`` is skipped.
    An fp8_e4m3 cache needs its ``kv_scale`` (a ``(1,)`` float32 tensor, or a number).

    The reference checks slot ranges and finiteness (``ValueError``); the Triton kernel does so under
    ``SPARSE_MLA_DEBUG=1`` and otherwise skips out-of-range slots.
    """
    if backend_for(backend, kv_new, "kv_new") == "reference":
        reference.quantize_and_insert(*insert_args(kv_new, cache, slot_mapping, fmt, kv_scale=kv_scale))
    else:
        triton_cache.quantize_and_insert(*insert_args(kv_new, cache, slot_mapping, fmt,
                                                      check_values=debug_checks_enabled(), kv_scale=kv_scale))


def dequantize_and_gather(cache: torch.Tensor, slots: torch.Tensor, fmt: str | None = None,
                          backend: str = "auto", kv_scale: float | torch.Tensor | None = None,
                          out: torch.Tensor | None = None) -> torch.Tensor:
    """Dequantised tokens at ``slots`` (any shape; ``-1`` reads as zeros): ``slots.shape + (d,)`` bf16
    (an fp8_e4m3 cache needs its ``kv_scale``), written into ``out`` when given (that shape, contiguous: e.g.
    rows of a prefill workspace)."""
    if backend_for(backend, cache, "cache") == "reference":
        rows = reference.dequantize_and_gather(*gather_args(cache, slots, fmt, kv_scale=kv_scale, out=out), slots)
        return rows if out is None else out.copy_(rows)
    return triton_cache.dequantize_and_gather(*gather_args(cache, slots, fmt, debug_checks_enabled(), kv_scale, out),
                                              slots, out)


__all__ = ["sparse_attention_decode", "sparse_attention_prefill", "quantize_and_insert", "dequantize_and_gather",
           "longest_first", "merge_partials", "attention_kernel", "check_backend_name", "BACKENDS"]
