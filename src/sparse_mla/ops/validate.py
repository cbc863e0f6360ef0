"""Entry checks shared by every backend of the attention ops (DESIGN §4).

Every backend calls :func:`decode_args` / :func:`prefill_args` first, so all of them reject the
same bad inputs with the same ``ValueError`` and see the same normalised arguments.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch

from .._checks import (check_distinct_slots, check_finite, check_index_range, check_kv_scale, check_no_overlap,
                       check_scale, check_sink, check_tensor, is_int)
from ..env import switch_on
from ..cache_views import resolve_cache_once
from ..formats import FORMAT_NAMES, KVFormat, cache_scale

D_V = 512  # output width: the 512-d latent (V4: all of it; V3.2: the nope part of 576)
# log2(e): the kernels' softmax is in base 2 (exp2 of the scores times scale · LOG2E; the LSE divided back by it)
LOG2E = 1.4426950408889634


# the attention kernels (Triton's _load_q, Gluon's query loads) offset q's tokens in int64 and its heads in int32
# (head · q.stride(-2)): the heads must lie less than 2^31 elements apart in all
Q_HEAD_SPAN = 2 ** 31


def kernel_takes_q(q: torch.Tensor) -> bool:
    """Whether the attention kernels read ``q (..., H, d)`` as it is: rows at unit stride, and its ``H`` heads
    less than :data:`Q_HEAD_SPAN` elements apart in all. Else they take its contiguous copy (a head-major buffer's
    transposed view of 128 heads over 33K tokens wrapped its high heads' offsets: they read other memory)."""
    return q.stride(-1) == 1 and q.stride(-2) * q.shape[-2] < Q_HEAD_SPAN


def debug_checks_enabled() -> bool:
    """Whether fast kernels also check index ranges on entry (``SPARSE_MLA_DEBUG=1``)."""
    return switch_on("SPARSE_MLA_DEBUG")


@dataclass(frozen=True)
class Scope:
    """One index scope: the first ``lens[t]`` entries of ``indices[t]`` are slots of ``cache``.

    cache: ``(num_blocks, block_size, token_bytes)`` paged cache of format ``fmt``.
    indices: ``(T, width)`` int32 slots (``block * block_size + offset``), ``-1`` = invalid.
    lens: ``(T // tokens_per_len,)`` int32 in ``[0, width]`` (see :class:`AttentionArgs`).
    indptr: a ragged scope's ``(T+1,)`` int32 row offsets (then ``indices`` is flat ``(capacity,)``, row ``t``
    is ``indices[indptr[t]:indptr[t+1]]``, and ``lens`` is None).
    len_skip: the compressed part of a combined index: row ``t`` has ``lens[t] - len_skip`` entries
    (``lens`` counts the whole combined row, whose first ``len_skip`` columns are another scope's).
    """

    cache: torch.Tensor
    fmt: KVFormat
    indices: torch.Tensor
    lens: torch.Tensor | None
    indptr: torch.Tensor | None = None
    len_skip: int = 0

    @property
    def num_slots(self) -> int:
        return self.cache.shape[0] * self.cache.shape[1]

    @property
    def width(self) -> int:
        """The longest row any token can have: the padded width, or a ragged scope's flat capacity."""
        return self.indices.shape[-1]


@dataclass(frozen=True)
class AttentionArgs:
    """Normalised arguments: q ``(T, H, d)`` bf16 or float8_e4m3fn, one or two scopes, sink ``(H,)`` f32 or None."""

    q: torch.Tensor
    scopes: tuple[Scope, ...]
    sink: torch.Tensor | None
    scale: float
    out: torch.Tensor | None = None  # (T, H, 512) bf16, contiguous: written in place when given
    order: torch.Tensor | None = None  # (T,) int32 permutation: the order programs take tokens in (ops.order)
    q_scale: torch.Tensor | None = None  # (1,) float32 when q is float8_e4m3fn: q's values are e4m3 · q_scale
    kv_scale: torch.Tensor | None = None  # (1,) float32, every fp8_e4m3 scope's per-tensor scale
    # each padded scope's lens[t // tokens_per_len] is token t's count: FlashMLA's per-request topk_length, shared by
    # a request's s_q consecutive query tokens, read as it is (1: one length per token)
    tokens_per_len: int = 1

    def token_lens(self, scope: Scope) -> torch.Tensor:
        """A padded scope's lens per token ``(T,)`` (expanded from its groups: for the reference)."""
        return scope.lens if self.tokens_per_len == 1 else scope.lens.repeat_interleave(self.tokens_per_len)


def graph_capturing(device: torch.device) -> bool:
    """Whether work for ``device`` is being captured into a CUDA graph (recorded to run at each replay, not now):
    its current stream's, which is the one asked where ``device`` is the current GPU (torch asks the current one)."""
    if device.type != "cuda":
        return False
    if device.index is None or device.index == torch.cuda.current_device():
        return torch.cuda.is_current_stream_capturing()
    with torch.cuda.device(device):
        return torch.cuda.is_current_stream_capturing()


@functools.lru_cache(maxsize=64)
def _full_lens(name: str, num_tokens: int, width: int, device: torch.device) -> torch.Tensor:
    """``(num_tokens,)`` int32 lens of ``width`` standing in for an absent ``name`` (the full rows), made once per
    argument and shape and only read: every later call of the shape, and the ops' memo, share it.

    Never made during a CUDA-graph capture, which would only record its fill (run at each replay, not now) in
    memory of the graph's pool: the tensor, unfilled until the graph replays and recycled with its pool, would then
    serve every later call of the shape. Engines warm up each shape before capturing it, which makes it; a capture
    that meets a shape first fails at capture time, naming the remedy, instead of reading garbage later."""
    if graph_capturing(device):
        raise ValueError(f"{name} is None (the full rows) while a CUDA graph is being captured, and no call before "
                         f"made the full-width {name} of {num_tokens} rows of width {width}: pass {name} explicitly, "
                         f"or make one call of this shape before capturing (a warm-up)")
    return torch.full((num_tokens,), width, dtype=torch.int32, device=device)


def _scope(prefix: str, q: torch.Tensor, cache: torch.Tensor, indices: torch.Tensor, lens: torch.Tensor | None,
           fmt: str | KVFormat | None, check_ranges: bool, cache_name: str,
           indptr: torch.Tensor | None = None, tokens_per_len: int = 1, fmt_arg: str = "fmt") -> Scope:
    """One scope checked (``fmt_arg``: the argument that declared ``fmt``, named by the errors of a cache that
    does not hold it)."""
    cache, f = resolve_cache_once(cache, fmt, cache_name, fmt_arg)
    if f.dim != q.shape[-1]:
        raise ValueError(f"q has head dim {q.shape[-1]} but {cache_name} holds {f.name} tokens of dim {f.dim}")
    num_tokens = q.shape[0]
    if indptr is not None:
        return _ragged_scope(prefix, q, cache, f, indices, lens, indptr, check_ranges, cache_name)
    check_tensor(f"{prefix}indices", indices, dtype=torch.int32, shape=(num_tokens, None), device=q.device)
    check_tensor(cache_name, cache, device=q.device)
    width = indices.shape[1]
    lens = _lens(f"{prefix}lens", lens, num_tokens, width, tokens_per_len, q.device)
    if indices.stride(1) != 1:  # the kernels read each index row at unit stride
        indices = indices.contiguous()
    if check_ranges:
        _check_lens(f"{prefix}lens", lens, width, f"{prefix}indices")
        within = torch.arange(width, device=q.device)[None, :] < lens.repeat_interleave(tokens_per_len)[:, None]
        check_index_range(f"{prefix}indices", indices, cache.shape[0] * cache.shape[1], within)
    return Scope(cache, f, indices, lens)


def _lens(name: str, lens: torch.Tensor | None, num_tokens: int, width: int, tokens_per_len: int,
          device: torch.device) -> torch.Tensor:
    """``lens`` checked as ``(num_tokens // tokens_per_len,)`` int32, contiguous (the kernels read it at unit stride);
    None: the full width for every token."""
    rows = num_tokens // tokens_per_len
    if lens is None:
        return _full_lens(name, rows, width, device)
    check_tensor(name, lens, dtype=torch.int32, shape=(rows,), device=device)
    return lens.contiguous()


def _check_lens(name: str, lens: torch.Tensor, width: int, indices_name: str) -> None:
    """Every length in ``[0, width]`` (a sync: the reference and debug mode only)."""
    if lens.numel() and bool(((lens < 0) | (lens > width)).any()):
        raise ValueError(f"{name} must lie in [0, {width}] (the width of {indices_name})")


def _ragged_scope(prefix: str, q: torch.Tensor, cache: torch.Tensor, f: KVFormat, indices: torch.Tensor,
                  lens: torch.Tensor | None, indptr: torch.Tensor, check_ranges: bool, cache_name: str) -> Scope:
    """A ragged scope (the ROCm AITER form): ``indices`` flat ``(capacity,)`` int32, ``indptr (T+1,)`` int32."""
    if lens is not None:
        raise ValueError(f"{prefix}lens must be None when {prefix}indptr is given: row t's length is "
                         f"{prefix}indptr[t+1] - {prefix}indptr[t]")
    check_tensor(cache_name, cache, device=q.device)
    check_tensor(f"{prefix}indices", indices, dtype=torch.int32, ndim=1, device=q.device)
    check_tensor(f"{prefix}indptr", indptr, dtype=torch.int32, shape=(q.shape[0] + 1,), device=q.device)
    indices, indptr = indices.contiguous(), indptr.contiguous()
    if check_ranges:
        capacity = indices.shape[0]
        if bool((indptr[0] < 0) | (indptr[-1] > capacity)) or bool((indptr[1:] < indptr[:-1]).any()):
            raise ValueError(f"{prefix}indptr must be nondecreasing from >= 0 to <= {capacity} (the length of "
                             f"{prefix}indices), got {indptr[:8].tolist()} …")
        check_index_range(f"{prefix}indices", indices[int(indptr[0]):int(indptr[-1])],
                          cache.shape[0] * cache.shape[1])
    return Scope(cache, f, indices, None, indptr)


def _combined_scopes(q: torch.Tensor, cache: torch.Tensor, extra_cache: torch.Tensor, indices: torch.Tensor,
                     lens: torch.Tensor | None, window: int, fmts: tuple[str | KVFormat | None, ...],
                     check_ranges: bool, tokens_per_len: int = 1, extra_fmt_arg: str = "fmt") -> list[Scope]:
    """The combined index (FlashInfer TRTLLM-gen's form) as two scopes over one list: ``indices (T, W + K)``,
    columns ``[0, W)`` slots of ``cache``, columns ``[W, W + K)`` slots of ``extra_cache``; token ``t`` reads
    the first ``lens[t]`` entries of the whole row (``-1`` entries skipped). fmts: the two caches' declared formats
    (``extra_fmt_arg``: the argument that declared the second)."""
    check_tensor("indices", indices, dtype=torch.int32, shape=(q.shape[0], None), device=q.device)
    width = indices.shape[1]
    if not is_int(window) or not 0 <= window <= width:
        raise ValueError(f"combined_window must be an int in [0, {width}] (the width of indices), got {window!r}")
    lens = _lens("lens", lens, q.shape[0], width, tokens_per_len, q.device)
    swa = _scope("", q, cache, indices[:, :window], lens, fmts[0], False, "cache", tokens_per_len=tokens_per_len)
    comp = replace(_scope("", q, extra_cache, indices[:, window:], lens, fmts[1], False, "extra_cache",
                          tokens_per_len=tokens_per_len, fmt_arg=extra_fmt_arg), len_skip=window)
    if check_ranges:
        _check_lens("lens", lens, width, "indices")
        within = torch.arange(width, device=q.device)[None, :] < lens.repeat_interleave(tokens_per_len)[:, None]
        check_index_range("indices", indices[:, :window], swa.num_slots, within[:, :window])
        check_index_range("indices", indices[:, window:], comp.num_slots, within[:, window:])
    return [swa, comp]


def _sink_and_scale(q: torch.Tensor, sink: torch.Tensor | None, scale: float | None,
                    check_values: bool) -> tuple[torch.Tensor | None, float]:
    if sink is not None:
        # its values only in the reference / debug mode: the check syncs
        sink = check_sink(sink, q.shape[1], q.device, values=check_values).contiguous()
    return sink, check_scale(q.shape[-1] ** -0.5 if scale is None else scale)


def decode_args(q, cache, indices, lens=None, extra_cache=None, extra_indices=None, extra_lens=None,
                sink=None, scale=None, fmt=None, check_ranges: bool = True, out=None,
                cache_name: str = "cache", order=None, indptr=None, extra_indptr=None, combined_window=None,
                q_scale=None, kv_scale=None, tokens_per_len: int = 1, extra_fmt=None) -> AttentionArgs:
    """Check and normalise the arguments of ``sparse_attention_decode`` (``cache_name``: what errors
    call the first scope's cache; prefill's is its workspace ``kv``). ``fmt`` declares both caches' format, or with
    ``extra_fmt`` given the first cache's alone (:func:`declared_formats`)."""
    check_tensor("q", q, dtype=(torch.bfloat16, torch.float8_e4m3fn), ndim=3)
    if q.shape[-1] not in (512, 576):
        raise ValueError(f"q must have head dim 512 (V4) or 576 (V3.2), got {q.shape[-1]}")
    if not (is_int(tokens_per_len) and tokens_per_len >= 1 and q.shape[0] % tokens_per_len == 0):
        raise ValueError(f"tokens_per_len must be a positive int dividing q's {q.shape[0]} tokens, got "
                         f"{tokens_per_len!r}")
    if tokens_per_len > 1 and (indptr is not None or extra_indptr is not None):
        raise ValueError("tokens_per_len > 1 shares one length among consecutive tokens: ragged scopes (indptr / "
                         "extra_indptr) have a row per token, so it must be 1 with them")
    if isinstance(cache, torch.Tensor) and cache.device != q.device:  # before the indices are checked against q
        raise ValueError(f"q must be on {cache_name}'s device {cache.device}, got {q.device}")
    fmts, extra_fmt_arg = declared_formats(fmt, extra_fmt, extra_cache)
    if combined_window is not None:
        if extra_cache is None or extra_indices is not None or extra_lens is not None or indptr is not None \
                or extra_indptr is not None:
            raise ValueError("combined_window needs extra_cache and one (T, W + K) indices with lens; extra_indices, "
                             "extra_lens, indptr and extra_indptr must be None")
        scopes = _combined_scopes(q, cache, extra_cache, indices, lens, combined_window, fmts, check_ranges,
                                  tokens_per_len, extra_fmt_arg)
    else:
        scopes = [_scope("", q, cache, indices, lens, fmts[0], check_ranges, cache_name, indptr, tokens_per_len)]
        if (extra_cache is None) != (extra_indices is None):
            raise ValueError("extra_cache and extra_indices must be given together")
        if extra_cache is not None:
            scopes.append(_scope("extra_", q, extra_cache, extra_indices, extra_lens, fmts[1], check_ranges,
                                 "extra_cache", extra_indptr, tokens_per_len, extra_fmt_arg))
        elif extra_lens is not None or extra_indptr is not None:
            raise ValueError("extra_lens / extra_indptr given without extra_cache / extra_indices")
    sink, scale = _sink_and_scale(q, sink, scale, check_ranges)
    q_scale, kv_scale = _fp8_scales(q, scopes, q_scale, kv_scale, check_ranges)
    order = _order(order, q, check_ranges)
    if out is not None:
        check_tensor("out", out, dtype=torch.bfloat16, shape=(q.shape[0], q.shape[1], D_V), device=q.device)
        if not out.is_contiguous():
            raise ValueError("out must be contiguous")
        check_no_overlap("out", out, out_inputs(q, cache, indices, lens, extra_cache, extra_indices, extra_lens, sink,
                                                order, indptr, extra_indptr, q_scale, kv_scale, cache_name))
    return AttentionArgs(q, tuple(scopes), sink, scale, out, order, q_scale, kv_scale, tokens_per_len)


def out_inputs(q, cache, indices, lens=None, extra_cache=None, extra_indices=None, extra_lens=None, sink=None,
               order=None, indptr=None, extra_indptr=None, q_scale=None, kv_scale=None,
               cache_name: str = "cache") -> dict[str, torch.Tensor | None]:
    """What a given ``out`` must share no memory with (a kernel would read what it wrote): every tensor argument of an
    attention call that the kernels read, by the name ``sparse_attention_decode`` gives it (``cache_name``: the first
    cache's, prefill's ``"kv"``; ``q_scale`` / ``kv_scale``: as tensors, None where absent or numbers). The one list
    for the checked path (:func:`decode_args`) and the ops' remembered calls (``memo.recall_call``)."""
    return {"q": q, cache_name: cache, "indices": indices, "lens": lens, "indptr": indptr, "extra_cache": extra_cache,
            "extra_indices": extra_indices, "extra_lens": extra_lens, "extra_indptr": extra_indptr, "sink": sink,
            "order": order, "q_scale": q_scale, "kv_scale": kv_scale}


def declared_formats(fmt: str | KVFormat | None, extra_fmt: str | KVFormat | None, extra_cache: object
                      ) -> tuple[tuple[str | KVFormat | None, str | KVFormat | None], str]:
    """The formats declared for ``(cache, extra_cache)`` and the argument that declared the second. ``extra_fmt``
    None: ``fmt`` for both (None: each cache's format read from its tensor, as before ``extra_fmt`` existed); a given
    ``extra_fmt``: the extra cache's alone, ``fmt`` then the first cache's alone — how two caches of different
    page-planar formats (which their tensors cannot say) are named in one call."""
    if extra_fmt is None:
        return (fmt, fmt), "fmt"
    if not isinstance(extra_fmt, (str, KVFormat)):
        raise TypeError(f"extra_fmt must be None or a format name, one of {FORMAT_NAMES}; got "
                        f"{type(extra_fmt).__name__}")
    if isinstance(extra_fmt, str) and extra_fmt not in FORMAT_NAMES:
        raise ValueError(f"extra_fmt must be None or one of {FORMAT_NAMES}, got {extra_fmt!r}")
    if extra_cache is None:
        raise ValueError(f"extra_fmt={extra_fmt!r} names extra_cache's format, but no extra_cache is given")
    return (fmt, extra_fmt), "extra_fmt"


def _fp8_scales(q: torch.Tensor, scopes: list[Scope], q_scale, kv_scale, check_values: bool
                ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``q_scale`` (required exactly when q is float8_e4m3fn) and ``kv_scale`` (required exactly when a scope is
    fp8_e4m3; both fp8_e4m3 caches of a call share it, as FlashInfer's one ``bmm2_scale`` does), each ``(1,)``
    float32 on q's device."""
    q_fp8 = q.dtype == torch.float8_e4m3fn
    if (q_scale is not None) != q_fp8:
        raise ValueError("q_scale must be given exactly when q is float8_e4m3fn (q's values are e4m3 · q_scale), "
                         f"got q {q.dtype} and q_scale {'None' if q_scale is None else 'given'}")
    per_tensor = any(s.fmt.per_tensor for s in scopes)
    if kv_scale is not None and not per_tensor:
        raise ValueError(f"kv_scale is only for fp8_e4m3 caches, got {[s.fmt.name for s in scopes]}")
    return (check_kv_scale(q_scale, q.device, "q_scale", check_values) if q_fp8 else None,
            check_kv_scale(kv_scale, q.device, "kv_scale", check_values) if per_tensor else None)


def _order(order: torch.Tensor | None, q: torch.Tensor, check_values: bool) -> torch.Tensor | None:
    """``order`` checked: ``(T,)`` int32 on q's device, and (a sync: with the index checks) a permutation of
    ``0 … T-1``. Without that check the kernels clamp each entry into range, so a bad order never touches
    memory outside the op's tensors, but the rows it misses are wrong: unwritten, or (split key lists)
    merged from unwritten partials."""
    if order is None:
        return None
    num_tokens = q.shape[0]
    check_tensor("order", order, dtype=torch.int32, shape=(num_tokens,), device=q.device)
    if check_values and num_tokens:
        hint = f"a permutation of 0 … {num_tokens - 1}, e.g. sparse_mla.ops.longest_first(lens, extra_lens)"
        outside = (order < 0) | (order >= num_tokens)
        if bool(outside.any()):
            raise ValueError(f"order holds {int(order[outside][0])}, out of range: it must be {hint}")
        counts = torch.bincount(order.long(), minlength=num_tokens)
        if bool((counts != 1).any()):
            twice, missing = int((counts > 1).nonzero()[0]), int((counts == 0).nonzero()[0])
            raise ValueError(f"order holds token {twice} more than once and misses token {missing}: it must be {hint}")
    return order.contiguous()


def prefill_args(q, kv, indices, lens=None, sink=None, scale=None, check_ranges: bool = True,
                 out=None, indptr=None) -> AttentionArgs:
    """Check and normalise ``sparse_attention_prefill``'s arguments; ``kv (S, d)`` becomes a
    one-token-per-block bf16 cache so every backend reads it like a paged scope."""
    check_tensor("q", q, dtype=torch.bfloat16, ndim=3)
    check_tensor("kv", kv, dtype=torch.bfloat16, shape=(None, q.shape[-1]), device=q.device)
    if kv.stride(-1) != 1:
        raise ValueError("kv must have contiguous rows (stride(-1) == 1)")
    return decode_args(q, kv.unsqueeze(1), indices, lens, sink=sink, scale=scale, check_ranges=check_ranges,
                       out=out, cache_name="kv", indptr=indptr)


def insert_args(kv_new, cache, slot_mapping, fmt=None, check_values: bool = True, kv_scale=None
                ) -> tuple[torch.Tensor, torch.Tensor, KVFormat, torch.Tensor, torch.Tensor | None]:
    """Check ``quantize_and_insert``'s arguments; returns ``kv_new`` with unit-stride rows, the paged
    cache view, its format, ``slot_mapping`` contiguous (the kernel reads both at unit stride) and the
    fp8_e4m3 cache's ``kv_scale`` ``(1,)`` float32 (None for the other formats).

    With ``check_values`` (the reference, or ``SPARSE_MLA_DEBUG=1``) also slot ranges, no slot twice and finiteness.
    """
    cache, f = resolve_cache_once(cache, fmt)
    check_tensor("kv_new", kv_new, dtype=torch.bfloat16, shape=(None, f.dim), device=cache.device)
    check_tensor("slot_mapping", slot_mapping, dtype=(torch.int32, torch.int64), shape=(kv_new.shape[0],),
                 device=cache.device)
    check_no_overlap("cache", cache, {"kv_new": kv_new, "slot_mapping": slot_mapping})
    if check_values:
        check_index_range("slot_mapping", slot_mapping, cache.shape[0] * cache.shape[1])
        check_distinct_slots("slot_mapping", slot_mapping)
        check_finite("kv_new", kv_new[slot_mapping >= 0])
    if kv_new.stride(1) != 1:
        kv_new = kv_new.contiguous()
    return kv_new, cache, f, slot_mapping.contiguous(), cache_scale(f, kv_scale, cache.device, check_values)


def gather_args(cache, slots, fmt=None, check_ranges: bool = True, kv_scale=None, out=None
                ) -> tuple[torch.Tensor, KVFormat, torch.Tensor | None]:
    """Check ``dequantize_and_gather``'s arguments (``out``, when given: ``slots.shape + (d,)`` bf16, contiguous,
    apart from the cache and slots); returns the paged cache view, its format and the fp8_e4m3 cache's
    ``kv_scale`` ``(1,)`` float32 (None for the other formats)."""
    cache, f = resolve_cache_once(cache, fmt)
    check_tensor("slots", slots, dtype=(torch.int32, torch.int64), device=cache.device)
    if out is not None:
        check_tensor("out", out, dtype=torch.bfloat16, shape=(*slots.shape, f.dim), device=cache.device)
        if not out.is_contiguous():
            raise ValueError("out must be contiguous")
        check_no_overlap("out", out, {"cache": cache, "slots": slots})
    if check_ranges:
        check_index_range("slots", slots, cache.shape[0] * cache.shape[1])
    return cache, f, cache_scale(f, kv_scale, cache.device, check_ranges)
