"""FlashMLA-compatible sparse attention API (DESIGN §4): switch an engine by changing one import.

``from flash_mla import get_mla_metadata, flash_mla_with_kvcache, flash_mla_sparse_fwd`` becomes
``from sparse_mla.flash_mla import ...``. Names, argument order, defaults, shapes and returns follow
FlashMLA's Python interface for its **sparse** modes in both of its surfaces: the legacy one, as shipped in the
``sgl-flash-mla==1.0.0`` wheel (V4's 584-byte and V3.2's 656-byte caches, ``use_legacy`` / ``kv_format``), and the
current one, FlashMLA's 2026-09-30 release for DeepSeek-V4.1 (the same functions and argument order, caches
``(num_blocks, P, 1, 528 | 288)`` whose last axis names the format, fp4 only as ``extra_k_cache``, scheduler metadata
made on the first call) — one function serves both, by the caches' bytes per token (:data:`V41_FORMAT_OF_BYTES`).
The work is done by :func:`sparse_mla.ops.sparse_attention_decode`'s checks and kernels
(``ops.checked_decode``, then the reference or the attention plan) and by
:func:`sparse_mla.ops.sparse_attention_prefill` (the reference on the CPU, the Triton / Gluon kernels
on CUDA). Differences from FlashMLA (see docs/flash_mla.md):

* any head count (FlashMLA: 64 or 128), any device, bf16 caches as well as fp8, V4's and V3.2's formats beside
  V4.1's (FlashMLA's current release reads V4.1's only, on SM100);
* the scheduler object holds nothing: reusing it across layers whose ``topk_length`` differ is safe;
* ``flash_mla_sparse_fwd`` returns ``max_logits = None`` unless ``compute_max_logits=True`` (it costs
  a second pass over the keys, which the attention kernels do not make);
* out-of-range decode indices are never read (FlashMLA reads any index but ``-1``).

The wrapper only reshapes (views) and forwards: the ops do the argument checks, and their errors
are re-raised under FlashMLA's argument names. On the Triton path, :func:`flash_mla_with_kvcache` remembers
the checked outcome (the attention plan) per *call signature* — every argument's shape, strides, dtype and
device, the caches' 16-byte alignment, the scalar arguments — so a later call of a seen signature skips the
checks (they depend on nothing else) and launches the plan at once. Nothing read from tensor values is
remembered; ``SPARSE_MLA_DEBUG=1`` checks every call in full.
"""
from __future__ import annotations

import math
import re
from collections import OrderedDict
from typing import TYPE_CHECKING

import torch

from . import ops
from ._checks import check_tensor
from .config import check_scope_formats
from .ops import reference, sparse_attention_prefill
from .ops.memo import Remembered, keep, recall, signature
from .ops.validate import AttentionArgs, debug_checks_enabled, kernel_takes_q

if TYPE_CHECKING:
    from .ops.attention_plan import AttentionPlan

HEAD_DIM_V = 512
_FP8_DTYPES = (torch.uint8, torch.int8, torch.float8_e4m3fn)  # the byte dtypes FlashMLA accepts for caches
# FlashMLA's kv_format names of the layouts we implement, by bytes per token (V4.1's: its current release names them
# by the cache's last axis alone; the legacy surface's kv_format may name them too)
_KV_FORMAT_BYTES = {"V4": 584, "V32": 656, "V41": 528, "V41_FP4": 288}
# FlashMLA's current release (2026-09-30) detects a d_qk = 512 cache's format from its last axis: 528 B is V4.1 fp8,
# 288 B V4.1 fp4, both token-interleaved (a page's rows back to back, whole-row padding after it allowed). 528 B is
# also V3.2-without-RoPE's size (512 e4m3 + 4 fp32 scales, a legacy-surface layout): a 528-byte cache is V4.1 fp8
# unless kv_format says "V32_NO_ROPE", which we do not implement.
V41_FORMAT_OF_BYTES = {528: "fp8_v41", 288: "fp4_v41"}
_UNSUPPORTED_KV_FORMATS = {"V32_NO_ROPE": "V3.2 without RoPE (528 B: 512 e4m3 + 4 fp32 scales)"}
_CHUNK_ELEMS = 1 << 25  # gathered key floats per chunk of compute_max_logits
# the ops' backend the API runs: "auto" (the Triton / Gluon kernels on CUDA, the reference elsewhere); "triton" runs
# the Triton path on the CPU too, under TRITON_INTERPRET=1 (the tests of the remembered calls do)
BACKEND = "auto"


class FlashMLASchedMeta:
    """The scheduler object of :func:`get_mla_metadata`: accepted by :func:`flash_mla_with_kvcache`, holds nothing.

    FlashMLA's object caches split-KV scheduling computed from the first call's ``topk_length``
    values and silently reuses it (stale) when a later call's values differ. Our kernels choose
    their grid per call from shapes alone, so nothing result-affecting is recorded here: one object
    can serve every layer, step and ``topk_length`` pattern.
    """

    __slots__ = ()

    def __repr__(self) -> str:
        return "sparse_mla.flash_mla.FlashMLASchedMeta()"


def get_mla_metadata(*args: object, **kwargs: object) -> tuple[FlashMLASchedMeta, None]:
    """``(scheduler, None)``, like FlashMLA's; arguments (its old interface's) are accepted and unused."""
    return FlashMLASchedMeta(), None


_RENAMES = {  # the ops' argument names -> FlashMLA's (decode, prefill)
    "decode": {"cache": "k_cache", "extra_cache": "extra_k_cache", "extra_indices": "extra_indices_in_kvcache",
               "lens": "topk_length", "extra_lens": "extra_topk_length", "sink": "attn_sink",
               "scale": "softmax_scale"},
    "prefill": {"lens": "topk_length", "sink": "attn_sink", "scale": "sm_scale"},
}
_WORDS = {kind: re.compile(r"\b(" + "|".join(sorted(names, key=len, reverse=True)) + r")\b")
          for kind, names in _RENAMES.items()}


def _renamed(err: ValueError, kind: str) -> ValueError:
    """``err`` with the ops' argument names replaced by FlashMLA's."""
    names = _RENAMES[kind]
    return ValueError(_WORDS[kind].sub(lambda m: names[m.group(1)], str(err)))


def _paged(name: str, cache: torch.Tensor) -> torch.Tensor:
    """A FlashMLA cache ``(num_blocks, block_size, 1, bytes)`` checked for what only this API rejects, as
    :func:`_bytes` makes it."""
    check_tensor(name, cache, ndim=4)
    if cache.shape[2] != 1:
        raise ValueError(f"{name} must be (num_blocks, block_size, 1, bytes_per_token): one KV head, "
                         f"got shape {tuple(cache.shape)}")
    return _bytes(cache)


def _v41_format(cache: torch.Tensor | None) -> str | None:
    """The V4.1 format a byte cache's last axis names (:data:`V41_FORMAT_OF_BYTES`), else None."""
    return None if cache is None or cache.dtype != torch.uint8 else V41_FORMAT_OF_BYTES.get(cache.shape[-1])


def _check_cache_pair(k_cache: torch.Tensor, extra_k_cache: torch.Tensor | None) -> None:
    """FlashMLA's rule for a layer's two caches: V4.1's fp4 only as ``extra_k_cache``, beside an fp8_v41 ``k_cache``;
    otherwise an extra cache in ``k_cache``'s format: its dtype and bytes a token (``ValueError`` naming the pair)."""
    main, extra = _v41_format(k_cache), _v41_format(extra_k_cache)
    if main == "fp4_v41":
        raise ValueError("k_cache holds fp4_v41 (288 B per token): FlashMLA reads the fp4 cache only as "
                         "extra_k_cache, beside an fp8_v41 (528 B) k_cache (sparse_mla.ops.sparse_attention_decode "
                         "reads an fp4 first scope)")
    if extra_k_cache is not None:  # any other pair: one layout (V4's fp8 bytes beside bf16 was attended as given)
        check_scope_formats(main or f"{k_cache.shape[-1]}-byte {k_cache.dtype}",
                            extra or f"{extra_k_cache.shape[-1]}-byte {extra_k_cache.dtype}",
                            ("k_cache", "extra_k_cache"))


def _bytes(cache: torch.Tensor) -> torch.Tensor:
    """An fp8 / int8 cache as a uint8 view (the byte dtype the ops read); a uint8 or bf16 cache as it is."""
    return cache.view(torch.uint8) if cache.dtype in _FP8_DTYPES and cache.dtype != torch.uint8 else cache


def _per_request(name: str, lens: torch.Tensor | None, b: int) -> torch.Tensor | None:
    """A per-request length ``(b,)`` checked: the ops read it as it is, one length per request's ``s_q`` tokens
    (``tokens_per_len``)."""
    if lens is not None:
        check_tensor(name, lens, shape=(b,))
    return lens


def _tokens(name: str, indices: torch.Tensor, b: int, s_q: int) -> torch.Tensor:
    """``(b, s_q, topk)`` indices checked, as :func:`_rows` makes them."""
    check_tensor(name, indices, shape=(b, s_q, None))
    return _rows(indices, b, s_q)


def _rows(indices: torch.Tensor, b: int, s_q: int) -> torch.Tensor:
    """``(b, s_q, topk)`` indices as the ops' ``(b * s_q, topk)`` (a view when the strides allow)."""
    return indices.reshape(b * s_q, indices.shape[2])


# by call signature (ops.memo: the signature, what a remembered call keeps), least recently used out
_DECODES: OrderedDict[tuple, Remembered] = OrderedDict()
_MAX_DECODES = 256


def _remember(sig: tuple, args: AttentionArgs, plan: AttentionPlan, q: torch.Tensor,
              caches: tuple[torch.Tensor, ...], indices: tuple[torch.Tensor, ...],
              lens: tuple[torch.Tensor | None, ...], sink: torch.Tensor | None, raw: tuple[torch.Tensor, ...]) -> None:
    """Remember the checked outcome ``args`` of a Triton-path call (and its ``plan``) under its signature when the
    kernel takes the call's own tensors as they are (``q`` / ``indices`` / ``lens`` / ``sink``: as this module made
    them, views of ``raw``, the caller's q and index tensors; ``caches``: 4-D byte views), so that :func:`_launch`
    on the raw arguments of a later call launches what the checks would have; a call whose tensors needed a copy
    (a reshape of a q or indices whose batch and token axes do not merge, say ``q_all[:, :s_q]``) is not
    remembered: it goes the checked path each time."""
    if args.q is not q or not kernel_takes_q(q) or args.sink is not sink:
        return
    if any(view.data_ptr() != given.data_ptr() for view, given in zip((q, *indices), raw)):
        return  # a copy: a later call's raw tensors are not laid out as the launch the plan would bind
    full = []
    for scope, cache, idx, ln in zip(args.scopes, caches, indices, lens):
        paged = cache.squeeze(2)
        if (scope.indices is not idx or (ln is not None and scope.lens is not ln) or scope.indptr is not None
                or scope.cache.data_ptr() != paged.data_ptr() or scope.cache.shape != paged.shape
                or scope.cache.stride() != paged.stride() or scope.cache.dtype != paged.dtype):
            return
        full.append(scope.lens if ln is None else None)
    keep(_DECODES, sig, Remembered(plan, args.scale, tuple(full)), _MAX_DECODES)


def _launch(memo: Remembered, q: torch.Tensor, k_cache: torch.Tensor, indices: torch.Tensor,
            attn_sink: torch.Tensor | None, extra_k_cache: torch.Tensor | None,
            extra_indices: torch.Tensor | None, topk_length: torch.Tensor | None,
            extra_topk_length: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """A remembered signature's call: out ``(b, s_q, h_q, 512)`` and lse ``(b, s_q, h_q)``. Through the plan's bound
    launch (made by the signature's first remembered call), which reads only the tensors' data (q and the caches go
    as they are: the views the plan takes start at the same bytes); else the plan on the views the checked path
    makes."""
    b, s_q, h_q, d = q.shape
    lens = (memo.full_lens[0] if topk_length is None else topk_length,)
    if extra_k_cache is not None:
        lens += (memo.full_lens[1] if extra_topk_length is None else extra_topk_length,)
    out = torch.empty(b, s_q, h_q, HEAD_DIM_V, dtype=torch.bfloat16, device=q.device)
    lse = torch.empty(b, s_q, h_q, dtype=torch.float32, device=q.device)
    # the bound launch reads only data pointers: the caller's tensors start where the plan's views do
    if memo.bound(None, q, out, lse, attn_sink, (k_cache, extra_k_cache), (indices, extra_indices), lens):
        return out, lse
    caches, rows = (_bytes(k_cache),), (_rows(indices, b, s_q),)
    if extra_k_cache is not None:
        caches += (_bytes(extra_k_cache),)
        rows += (_rows(extra_indices, b, s_q),)
    q_rows, paged = q.reshape(b * s_q, h_q, d), tuple(c.squeeze(2) for c in caches)
    memo.plan(q_rows, out, lse, attn_sink, memo.scale, paged, rows, lens, None)
    memo.bound.settle(None, lambda: memo.plan.bind(q_rows, out, lse, attn_sink, memo.scale, paged, rows, lens))
    return out, lse


def flash_mla_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor | None,
    cache_seqlens: torch.Tensor | None,
    head_dim_v: int,
    tile_scheduler_metadata: FlashMLASchedMeta,
    num_splits: None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    is_fp8_kvcache: bool | None = None,
    indices: torch.Tensor | None = None,
    attn_sink: torch.Tensor | None = None,
    extra_k_cache: torch.Tensor | None = None,
    extra_indices_in_kvcache: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
    extra_topk_length: torch.Tensor | None = None,
    enable_batch_invariant: bool = False,
    use_legacy: bool = False,
    kv_format: str | None = None,
    descale_q: torch.Tensor | None = None,
    descale_k: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashMLA's sparse decoding: each query token attends to the keys its ``indices`` name.

    q: ``(b, s_q, h_q, d)`` bf16, d = 512 (V4, V4.1) or 576 (V3.2), any ``h_q``.
    k_cache / extra_k_cache: ``(num_blocks, block_size, 1, bytes_per_token)``: uint8 / int8 /
    float8_e4m3fn bytes of ``fp8_v4`` (584 B, d 512) or ``fp8_v32`` (656 B, d 576), or bf16 ``(…, 1, d)``; or
    FlashMLA's current V4.1 caches, told apart by the last axis alone (:data:`V41_FORMAT_OF_BYTES`): 528 B ``fp8_v41``
    and 288 B ``fp4_v41``, token-interleaved (``stride(1)`` = the bytes per token; ``stride(0)`` may leave whole-row
    padding after a page). ``extra_k_cache`` has ``k_cache``'s format, or is ``fp4_v41`` beside an ``fp8_v41``
    ``k_cache``; an fp4 ``k_cache`` is a ``ValueError`` (FlashMLA reads fp4 only as the extra cache).
    indices / extra_indices_in_kvcache: ``(b, s_q, topk)`` int32 slots (``block * block_size + offset``),
    ``-1`` invalid. topk_length / extra_topk_length: ``(b,)`` int32: every token of request ``i``
    attends to the first ``topk_length[i]`` entries of its row (default: all).
    attn_sink: ``(h_q,)`` float32 logit joining the softmax denominator only (``-inf``: none; ``+inf``:
    zero output). softmax_scale defaults to ``d ** -0.5`` for d = 512 (V4's scale, FlashMLA's default); for
    d = 576 it is required (``ValueError``): ``576 ** -0.5`` is not V3.2's scale. head_dim_v must be 512.
    block_table, cache_seqlens, use_legacy: accepted and unused (FlashMLA ignores the first two in
    sparse mode; ``use_legacy`` picks one of its kernel sets, we have one). num_splits must be None.
    kv_format: None (inferred from the cache), ``"V4"``, ``"V32"``, ``"V41"`` or ``"V41_FP4"`` (checked against
    ``k_cache``); ``"V32_NO_ROPE"`` (the other 528-byte layout) is not supported. ``is_fp8_kvcache`` defaults to what
    the cache holds (FlashMLA's current release: True, the only value it takes).

    Returns out ``(b, s_q, h_q, 512)`` bf16 and lse ``(b, h_q, s_q)`` float32 (a transposed view of a
    ``(b, s_q, h_q)`` buffer, FlashMLA's strides): natural-log sum of ``exp(scores)`` over valid keys, sink
    excluded; ``+inf`` (and a zero output row) where a token has no valid key.

    ``enable_batch_invariant=True``: each token's output is bitwise independent of the rest of the batch
    (``sparse_attention_decode(batch_invariant=True)``).

    The scheduler object holds nothing (FlashMLA's records its first call's configuration and makes its split-KV
    schedule then, lazily): ours is made per call from shapes, so any call may reuse any scheduler.

    Not supported (``NotImplementedError``): ``indices=None`` (dense decoding), ``descale_q`` / ``descale_k``,
    the V3.2-no-RoPE layout (``kv_format="V32_NO_ROPE"``).
    """
    sig = None
    if (indices is not None and descale_q is None and descale_k is None
            and type(tile_scheduler_metadata) is FlashMLASchedMeta and not debug_checks_enabled()):
        sig = signature((q, indices, attn_sink, extra_indices_in_kvcache, topk_length, extra_topk_length, k_cache,
                         extra_k_cache), (head_dim_v, num_splits, softmax_scale, causal, is_fp8_kvcache,
                                          enable_batch_invariant, kv_format, BACKEND))
        memo = recall(_DECODES, sig)
        if memo is not None:
            out, lse = _launch(memo, q, k_cache, indices, attn_sink, extra_k_cache, extra_indices_in_kvcache,
                               topk_length, extra_topk_length)
            return out, lse.transpose(1, 2)
    if indices is None:
        raise NotImplementedError("indices=None (dense MLA decoding, with block_table / cache_seqlens / causal) is "
                                  "not supported: sparse_mla implements FlashMLA's sparse mode only")
    if not isinstance(tile_scheduler_metadata, FlashMLASchedMeta):
        raise TypeError("tile_scheduler_metadata must come from sparse_mla.flash_mla.get_mla_metadata(), got "
                        f"{type(tile_scheduler_metadata).__name__}")
    if num_splits is not None:
        raise ValueError("num_splits must be None (get_mla_metadata returns None for it)")
    if causal:
        raise ValueError("causal must be False when sparse attention is enabled (indices given)")
    if head_dim_v != HEAD_DIM_V:
        raise ValueError(f"head_dim_v must be {HEAD_DIM_V}, got {head_dim_v!r}")
    if descale_q is not None or descale_k is not None:
        raise NotImplementedError("descale_q / descale_k belong to FlashMLA's dense fp8 decoding, not supported")
    check_tensor("q", q, ndim=4)
    b, s_q, h_q, d = q.shape
    if softmax_scale is None and d != HEAD_DIM_V:
        raise ValueError(f"softmax_scale is required for q of head dim {d}: the default d ** -0.5 is V4's scale "
                         "(d = 512), not V3.2's (qk_head_dim ** -0.5 · mscale², "
                         "sparse_mla.config.get_config('deepseek-v3.2').softmax_scale)")
    k_cache = _paged("k_cache", k_cache)
    is_fp8 = k_cache.dtype == torch.uint8
    if is_fp8_kvcache is not None and bool(is_fp8_kvcache) != is_fp8:
        raise ValueError(f"is_fp8_kvcache={is_fp8_kvcache} but k_cache has dtype {k_cache.dtype}: fp8 caches are "
                         "uint8 / int8 / float8_e4m3fn bytes, bf16 caches bfloat16")
    if kv_format is not None:
        if not isinstance(kv_format, str):
            raise TypeError(f"kv_format must be None or a str, got {type(kv_format).__name__}")
        known = ", ".join(f"{k!r} ({n} B)" for k, n in _KV_FORMAT_BYTES.items())
        if kv_format in _UNSUPPORTED_KV_FORMATS:  # FlashMLA's layout, which we do not read
            raise NotImplementedError(f"kv_format={kv_format!r} ({_UNSUPPORTED_KV_FORMATS[kv_format]}) is not "
                                      f"supported: use None or one of {known}")
        if kv_format not in _KV_FORMAT_BYTES:
            raise ValueError(f"kv_format must be None or one of {known}, got {kv_format!r}")
        if not is_fp8 or k_cache.shape[-1] != _KV_FORMAT_BYTES[kv_format]:
            raise ValueError(f"kv_format={kv_format!r} needs {_KV_FORMAT_BYTES[kv_format]}-byte fp8 tokens, but "
                             f"k_cache is {k_cache.dtype} with last axis {k_cache.shape[-1]}")
    if extra_k_cache is not None:
        extra_k_cache = _paged("extra_k_cache", extra_k_cache)
    _check_cache_pair(k_cache, extra_k_cache)
    extra_idx = None if extra_indices_in_kvcache is None else _tokens(
        "extra_indices_in_kvcache", extra_indices_in_kvcache, b, s_q)
    q_rows = q.reshape(b * s_q, h_q, d)
    try:
        idx, lens = _tokens("indices", indices, b, s_q), _per_request("topk_length", topk_length, b)
        extra_lens = _per_request("extra_topk_length", extra_topk_length, b)
        family, args = ops.checked_decode(BACKEND, q_rows, k_cache, idx, lens, extra_k_cache, extra_idx, extra_lens,
                                          attn_sink, softmax_scale, tokens_per_len=max(s_q, 1))
    except ValueError as err:
        raise _renamed(err, "decode") from err
    if family == "reference":
        out, lse = reference.run(args)
    else:
        plan = ops.attention_plan.plan_for(args, bool(enable_batch_invariant))
        if sig is not None:
            n = len(args.scopes)
            _remember(sig, args, plan, q_rows, (k_cache, extra_k_cache)[:n], (idx, extra_idx)[:n],
                      (lens, extra_lens)[:n], attn_sink, (q, indices, extra_indices_in_kvcache)[:n + 1])
        out, lse = ops.attention_plan.run(args, plan=plan)
    return out.view(b, s_q, h_q, HEAD_DIM_V), lse.view(b, s_q, h_q).transpose(1, 2)


def flash_mla_sparse_fwd(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    d_v: int = 512,
    attn_sink: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
    use_legacy: bool = False,
    return_log2_lse: bool | None = None,
    *,
    compute_max_logits: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """FlashMLA's sparse prefill over a bf16 key buffer (workspace).

    q: ``(s_q, h_q, d_qk)`` bf16, d_qk = 512 or 576, any ``h_q``. kv: ``(s_kv, 1, d_qk)`` bf16.
    indices: ``(s_q, 1, topk)`` int32 rows of kv; ``-1`` and (as in FlashMLA) anything outside
    ``[0, s_kv)`` is invalid. topk_length: ``(s_q,)`` int32, token ``t`` attends to its first
    ``topk_length[t]`` entries. attn_sink: ``(h_q,)`` float32, output only. sm_scale: required, as in
    FlashMLA (``None`` is a ``ValueError``). d_v must be 512.
    use_legacy: accepted and unused.

    Returns ``(out, max_logits, lse)``: out ``(s_q, h_q, 512)`` bf16; lse ``(s_q, h_q)`` float32, the
    natural-log sum of ``exp(sm_scale · q·k)`` over valid keys (sink excluded), ``+inf`` for a token
    with no valid key (its output row is 0). max_logits ``(s_q, h_q)`` float32 ``max(sm_scale · q·k)``
    (``-inf`` with no valid key) only with ``compute_max_logits=True`` — an extra pass over the keys, so
    it is ``None`` by default (FlashMLA always returns it). ``return_log2_lse=True`` gives both in base 2
    (``× log2 e``), ``False`` returns ``(out, None, None)``.
    """
    if sm_scale is None:  # FlashMLA's sm_scale has no default either: none fits both V4 and V3.2
        raise ValueError("sm_scale is required (a positive float): V4's is 512 ** -0.5, V3.2's qk_head_dim ** -0.5 · "
                         "mscale² (sparse_mla.config.get_config(model).softmax_scale)")
    check_tensor("q", q, ndim=3)
    check_tensor("kv", kv, ndim=3)
    if kv.shape[1] != 1:
        raise ValueError(f"kv must be (s_kv, 1, d_qk): one KV head, got shape {tuple(kv.shape)}")
    check_tensor("indices", indices, shape=(q.shape[0], 1, None))
    if d_v != HEAD_DIM_V:
        raise ValueError(f"d_v must be {HEAD_DIM_V}, got {d_v!r}")
    keys, idx = kv[:, 0], indices[:, 0]
    if q.device.type != "cuda":
        # the reference raises on out-of-range rows, the GPU kernels skip them; FlashMLA skips them
        idx = idx.masked_fill((idx < 0) | (idx >= keys.shape[0]), -1)
    try:
        out, lse = sparse_attention_prefill(q, keys, idx, topk_length, sink=attn_sink, scale=sm_scale, backend="auto")
    except ValueError as err:
        raise _renamed(err, "prefill") from err
    if return_log2_lse is False:
        return out, None, None
    max_logits = _max_logits(q, keys, idx, topk_length, sm_scale) if compute_max_logits else None
    if return_log2_lse:
        lse = lse * math.log2(math.e)
        max_logits = None if max_logits is None else max_logits * math.log2(math.e)
    return out, max_logits, lse


def _max_logits(q: torch.Tensor, keys: torch.Tensor, idx: torch.Tensor, lens: torch.Tensor | None,
                scale: float) -> torch.Tensor:
    """``max_k scale · q·keys[idx[t, k]]`` over each token's valid entries: ``(s_q, h_q)`` float32, ``-inf`` if none."""
    num_tokens, width = idx.shape
    result = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    step = max(1, _CHUNK_ELEMS // max(1, width * keys.shape[1]))
    cols = torch.arange(width, device=q.device)
    for start in range(0, num_tokens, step):
        rows = slice(start, min(start + step, num_tokens))
        valid = (idx[rows] >= 0) & (idx[rows] < keys.shape[0])
        if lens is not None:
            valid &= cols[None, :] < lens[rows, None]
        k = keys[torch.where(valid, idx[rows], 0).long()].float()
        scores = torch.einsum("nhd,nkd->nhk", q[rows].float(), k) * scale
        result[rows] = scores.masked_fill(~valid[:, None, :], float("-inf")).amax(-1)
    return result


__all__ = ["get_mla_metadata", "flash_mla_with_kvcache", "flash_mla_sparse_fwd", "FlashMLASchedMeta"]
