"""Merge of attention partials over disjoint key sets (decode context parallelism, DESIGN §4).

Each of ``R`` ranks attends to its own share of a token's keys without the sink and returns the attention ops'
``(out_r, lse_r)``: ``out_r`` normalised over its keys, ``lse_r`` their natural-log sum of exponentials (``+inf``
and ``out_r = 0`` where it holds none). The merged row is attention over the union of the keys, with the sink
applied once, after the merge::

    lse = logsumexp_r lse_r
    out = Σ_r e^{lse_r − lse} · out_r · 1 / (1 + e^{sink − lse})

An empty partial (``lse_r = +inf``) is skipped exactly; a row empty on every rank gives ``out = 0``,
``lse = +inf`` (the ops' convention). Both implementations sum the ranks one after another in rank order, in
float32, so a merge is bitwise reproducible (every rank that merges the same gathered partials gets the same bits).

:func:`rescale_partial` is the other form's half (vLLM's DCP): a rank that has every rank's LSEs but only its own
output scales it by its weight in the sum above, ``e^{lse_r − lse} / (1 + e^{sink − lse})``; the ranks' scaled
outputs then add up to the merge (a reduce-scatter over heads: :class:`sparse_mla.context_parallel.PartialsGather`).
"""
from __future__ import annotations

import math

import torch

from .._checks import check_no_overlap, check_sink, check_tensor, is_int
from .dispatch import HAVE_TRITON, backend_for
from .launch import cached_launch
from .validate import debug_checks_enabled

PARTIAL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _merged_lse(lse_row, stride_lr, ranks):
        """One (token, head) row's merged LSE over the ``ranks`` partial LSEs at ``lse_row + r · stride_lr``
        (``+inf``: an empty partial, skipped), and whether every partial is empty (the LSE is then 0)."""
        m = tl.full([], float("-inf"), tl.float32)
        for r in range(ranks):
            lse_r = tl.load(lse_row + r * stride_lr)
            m = tl.maximum(m, tl.where(lse_r == float("inf"), float("-inf"), lse_r))
        empty = m == float("-inf")
        m_safe = tl.where(empty, 0.0, m)
        total = tl.zeros([], tl.float32)
        for r in range(ranks):
            lse_r = tl.load(lse_row + r * stride_lr)
            total += tl.exp(tl.where(lse_r == float("inf"), float("-inf"), lse_r) - m_safe)
        return m_safe + tl.log(tl.where(empty, 1.0, total)), empty

    @triton.jit
    def _sink_factor(sink_ptr, head, lse, HAS_SINK: tl.constexpr):
        """``1 / (1 + e^{sink − lse})``: the share of a row's weight its keys keep beside the head's sink."""
        factor = 1.0
        if HAS_SINK:
            factor = 1.0 / (1.0 + tl.exp(tl.load(sink_ptr + head) - lse))
        return factor

    @triton.jit
    def _merge_kernel(outs_ptr, lses_ptr, sink_ptr, out_ptr, lse_ptr, num_heads, dim, ranks,
                      stride_or, stride_ot, stride_oh, stride_lr, stride_lt, stride_lh,
                      HAS_SINK: tl.constexpr, BLOCK_D: tl.constexpr):
        """One program per (token, head) row and block of ``BLOCK_D`` output columns: the row's merged LSE from
        the ``ranks`` partial LSEs, then its columns summed over the ranks in rank order (no dot: the dtype rules
        of the CPU interpreter do not arise; every number is float32)."""
        row = tl.program_id(0).to(tl.int64)
        tok, head = row // num_heads, row % num_heads
        lse_row = lses_ptr + tok * stride_lt + head * stride_lh
        lse, empty = _merged_lse(lse_row, stride_lr, ranks)
        factor = _sink_factor(sink_ptr, head, lse, HAS_SINK)
        cols = tl.program_id(1).to(tl.int64) * BLOCK_D + tl.arange(0, BLOCK_D)
        in_row = cols < dim
        acc = tl.zeros([BLOCK_D], tl.float32)
        part_row = outs_ptr + tok * stride_ot + head * stride_oh  # stepped by stride_or: no int32 rank offset
        for r in range(ranks):
            lse_r = tl.load(lse_row + r * stride_lr)
            empty_r = lse_r == float("inf")
            part = tl.load(part_row + cols, mask=in_row, other=0.0).to(tl.float32)
            part_row += stride_or
            weight = tl.exp(tl.where(empty_r, float("-inf"), lse_r) - lse) * factor
            acc = tl.where(empty_r, acc, acc + part * weight)
        tl.store(out_ptr + row * dim + cols, acc.to(out_ptr.dtype.element_ty), mask=in_row)
        tl.store(lse_ptr + row, tl.where(empty, float("inf"), lse))

    @triton.jit
    def _rescale_kernel(part_ptr, lses_ptr, sink_ptr, out_ptr, lse_ptr, num_tokens, num_heads, dim, ranks, rank,
                        shard_heads, stride_pt, stride_ph, stride_lr, stride_lt, stride_lh,
                        HAS_SINK: tl.constexpr, BLOCK_D: tl.constexpr):
        """One program per (token, head) row and block of columns: the row's merged LSE (as :func:`_merge_kernel`),
        then rank ``rank``'s partial times its weight, into ``out (shards, T, shard_heads, dim)`` at the head's
        shard (``head // shard_heads``)."""
        row = tl.program_id(0).to(tl.int64)
        tok, head = row // num_heads, row % num_heads
        lse_row = lses_ptr + tok * stride_lt + head * stride_lh
        lse, empty = _merged_lse(lse_row, stride_lr, ranks)
        lse_own = tl.load(lse_row + rank * stride_lr)
        empty_own = lse_own == float("inf")
        weight = tl.exp(tl.where(empty_own, float("-inf"), lse_own) - lse) * _sink_factor(sink_ptr, head, lse,
                                                                                          HAS_SINK)
        cols = tl.program_id(1).to(tl.int64) * BLOCK_D + tl.arange(0, BLOCK_D)
        in_row = cols < dim
        part = tl.load(part_ptr + tok * stride_pt + head * stride_ph + cols, mask=in_row, other=0.0).to(tl.float32)
        term = tl.where(empty_own, 0.0, part * weight)  # an empty partial's out is not read: exactly 0
        dest = ((head // shard_heads) * num_tokens + tok) * shard_heads + head % shard_heads
        tl.store(out_ptr + dest * dim + cols, term.to(out_ptr.dtype.element_ty), mask=in_row)
        tl.store(lse_ptr + row, tl.where(empty, float("inf"), lse))


def merge_partials(outs: torch.Tensor, lses: torch.Tensor, sink: torch.Tensor | None = None, *,
                   out: torch.Tensor | None = None, lse_out: torch.Tensor | None = None,
                   backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Merge ``R`` ranks' attention partials over disjoint key sets and apply the sink once (module docstring).

    outs: ``(R, T, H, D)`` bf16, float16 or float32, unit stride along D (e.g. a view of an all-gather buffer);
    lses: ``(R, T, H)`` float32 natural-log LSEs, ``+inf`` for a rank with no key for that row (its ``out`` is not
    read). sink: ``(H,)`` float32 per-head sink logits, or None (``-inf`` means none for that head, ``+inf``
    zeroes it). out / lse_out: where to write (contiguous ``(T, H, D)`` of a partial dtype, contiguous ``(T, H)``
    float32), e.g. buffers a CUDA graph reads; default new tensors (out of ``outs``' dtype). backend:
    ``"auto"`` (the Triton kernel on a CUDA device, else the reference), ``"reference"`` or ``"triton"``.
    Returns ``(out (T, H, D), lse (T, H) float32)``: ``lse`` over the union of the ranks' keys (``+inf`` where
    no rank has one, with ``out`` 0), the ops' convention.
    """
    family = backend_for(backend, outs, "outs")
    # the values (a NaN sink or LSE) sync: always on the reference backend, as the attention ops; debug-only on Triton
    values = family == "reference" or debug_checks_enabled()
    out, lse_out = check_merge_args(outs, lses, sink, out, lse_out, values)
    launch_merge(outs, lses, sink, out, lse_out, family)
    return out, lse_out


def launch_merge(outs: torch.Tensor, lses: torch.Tensor, sink: torch.Tensor | None, out: torch.Tensor,
                 lse_out: torch.Tensor, family: str) -> None:
    """:func:`merge_partials`' work on arguments it has checked (or that a caller owns and checked once: the
    context-parallel exchange's fixed buffers); family: ``"reference"`` or ``"triton"``. One launch on Triton."""
    if outs.shape[1] * outs.shape[2] == 0:
        return
    if family == "reference":
        _merge_reference(outs, lses, sink, out, lse_out)
        return
    num_ranks, num_tokens, num_heads, dim = outs.shape
    block = min(triton.next_power_of_2(dim), 512)
    launch = cached_launch(_merge_kernel, (("HAS_SINK", sink is not None), ("BLOCK_D", block)))
    launch((num_tokens * num_heads, triton.cdiv(dim, block)), outs, lses, _unit_stride(sink, lses), out,
           lse_out, num_heads, dim, num_ranks, *outs.stride()[:3], *lses.stride())


def rescale_partial(part: torch.Tensor, lses: torch.Tensor, rank: int, sink: torch.Tensor | None = None, *,
                    shards: int = 1, out: torch.Tensor | None = None, lse_out: torch.Tensor | None = None,
                    backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s term of :func:`merge_partials`: its partial ``part (T, H, D)`` (unit stride along D) times
    ``e^{lse_rank − lse} / (1 + e^{sink − lse})``, ``lse`` merged from every rank's ``lses (R, T, H)`` float32
    (``+inf``: no key; the term is then 0). The ranks' terms sum to the merge. shards: the output's head shards
    (the reduce-scatter's: ``H`` divisible by it): ``out (shards, T, H / shards, D)`` contiguous, of a partial dtype
    (default new, ``part``'s dtype), head ``h`` at ``[h // (H / shards), :, h % (H / shards)]``; lse_out ``(T, H)``
    float32 gets the merged LSE (``+inf`` where no rank has a key). backend: as :func:`merge_partials`'. Returns
    ``(out, lse_out)``."""
    family = backend_for(backend, part, "part")
    check_tensor("part", part, dtype=PARTIAL_DTYPES, ndim=3)
    num_tokens, num_heads, dim = part.shape
    if part.stride(2) != 1:
        raise ValueError(f"part must have unit stride along its last axis (D), got strides {part.stride()}")
    device = part.device
    check_tensor("lses", lses, dtype=torch.float32, ndim=3, device=device)
    num_ranks = lses.shape[0]
    check_tensor("lses", lses, shape=(num_ranks, num_tokens, num_heads))
    if not (is_int(rank) and 0 <= rank < num_ranks):
        raise ValueError(f"rank must be an int in [0, {num_ranks}) (the ranks of lses), got {rank!r}")
    if not (is_int(shards) and shards >= 1 and num_heads % shards == 0):
        raise ValueError(f"shards must be a positive int dividing the {num_heads} heads, got {shards!r}")
    out, lse_out = check_merge_outputs(out, (shards, num_tokens, num_heads // shards, dim), part.dtype, lse_out,
                                       {"part": part, "lses": lses, "sink": sink}, lses, sink,
                                       family == "reference" or debug_checks_enabled())
    launch_rescale(part, lses, rank, sink, out, lse_out, family)
    return out, lse_out


def launch_rescale(part: torch.Tensor, lses: torch.Tensor, rank: int, sink: torch.Tensor | None, out: torch.Tensor,
                   lse_out: torch.Tensor, family: str) -> None:
    """:func:`rescale_partial`'s work on checked arguments (as :func:`launch_merge`); the shards are ``out``'s first
    axis. One launch on Triton."""
    num_tokens, num_heads, dim = part.shape
    shards = out.shape[0]
    if num_tokens * num_heads == 0:
        return
    if family == "reference":
        lse, empty, weights, factor = _merged_reference(lses, sink)
        own = torch.exp(weights[rank] - lse) * factor
        scaled = torch.where((lses[rank] == math.inf)[..., None], 0.0, part.float() * own[..., None])
        out.copy_(scaled.view(num_tokens, shards, num_heads // shards, dim).transpose(0, 1))
        lse_out.copy_(torch.where(empty, math.inf, lse))
        return
    block = min(triton.next_power_of_2(dim), 512)
    launch = cached_launch(_rescale_kernel, (("HAS_SINK", sink is not None), ("BLOCK_D", block)))
    launch((num_tokens * num_heads, triton.cdiv(dim, block)), part, lses, _unit_stride(sink, lses), out,
           lse_out, num_tokens, num_heads, dim, lses.shape[0], rank, num_heads // shards, part.stride(0),
           part.stride(1), *lses.stride())


def _unit_stride(sink: torch.Tensor | None, stand_in: torch.Tensor) -> torch.Tensor:
    """The kernels' sink argument: ``sink`` at unit stride (they read head ``h`` at ``sink + h``: a strided sink, e.g.
    ``x[::2]``, gave each head another's logit), or ``stand_in`` where there is none (never read)."""
    return stand_in if sink is None else sink.contiguous()


def check_merge_args(outs: torch.Tensor, lses: torch.Tensor, sink: torch.Tensor | None, out: torch.Tensor | None,
                     lse_out: torch.Tensor | None, values: bool, names: tuple[str, str] = ("out", "lse_out")
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`merge_partials`' argument checks (``ValueError`` / ``TypeError`` naming the argument); with ``values``
    also no NaN in ``sink`` or ``lses`` (a sync). names: what the errors call ``out`` and ``lse_out`` (a caller's
    own argument names). Returns the output tensors (allocated where not given)."""
    check_tensor("outs", outs, dtype=PARTIAL_DTYPES, ndim=4)
    num_ranks, num_tokens, num_heads, dim = outs.shape
    if num_ranks < 1 or dim < 1:
        raise ValueError(f"outs must hold at least one rank's partials of at least one column, got shape "
                         f"{tuple(outs.shape)}")
    if outs.stride(3) != 1:
        raise ValueError(f"outs must have unit stride along its last axis (D), got strides {outs.stride()}")
    check_tensor("lses", lses, dtype=torch.float32, shape=(num_ranks, num_tokens, num_heads), device=outs.device)
    return check_merge_outputs(out, (num_tokens, num_heads, dim), outs.dtype, lse_out,
                               {"outs": outs, "lses": lses, "sink": sink}, lses, sink, values, names)


def check_merge_outputs(out: torch.Tensor | None, out_shape: tuple[int, ...], out_dtype: torch.dtype,
                        lse_out: torch.Tensor | None, inputs: dict, lses: torch.Tensor, sink: torch.Tensor | None,
                        values: bool, names: tuple[str, str] = ("out", "lse_out")) -> tuple[torch.Tensor, torch.Tensor]:
    """The checks both ops share, after their inputs': ``sink`` (``(H,)``, H = ``lses``' last axis), ``out`` of
    ``out_shape`` (allocated as ``out_dtype`` where None) and ``lse_out`` ``(T, H)`` float32 (allocated where None),
    contiguous, on ``lses``' device, sharing no memory with ``inputs`` or each other; with ``values`` no NaN in
    ``sink`` or ``lses`` (a sync); names: what the errors call ``out`` and ``lse_out``. Returns the output tensors."""
    device, (num_tokens, num_heads) = lses.device, lses.shape[1:]
    out_name, lse_name = names
    if sink is not None:
        check_sink(sink, num_heads, device, values=values)
    if out is None:
        out = torch.empty(out_shape, dtype=out_dtype, device=device)
    check_tensor(out_name, out, dtype=PARTIAL_DTYPES, shape=out_shape, device=device)
    if lse_out is None:
        lse_out = torch.empty(num_tokens, num_heads, dtype=torch.float32, device=device)
    check_tensor(lse_name, lse_out, dtype=torch.float32, shape=(num_tokens, num_heads), device=device)
    for name, t in ((out_name, out), (lse_name, lse_out)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
        check_no_overlap(name, t, inputs)
    check_no_overlap(out_name, out, {lse_name: lse_out})
    if values and bool(torch.isnan(lses).any()):
        raise ValueError("lses must not hold NaN (+inf marks a rank with no key)")
    return out, lse_out


def _merged_reference(lses: torch.Tensor, sink: torch.Tensor | None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The merge's row quantities, float32, ranks summed in rank order (the kernels' arithmetic, step for step):
    the merged LSE ``(T, H)`` (0 where every partial is empty), those rows, each rank's LSE with empties as
    ``-inf`` ``(R, T, H)``, and the sink factor ``(T, H)``."""
    weights = torch.where(lses == math.inf, -math.inf, lses)  # an empty partial weighs e^{-inf} = 0
    m = weights.amax(0)
    empty = m == -math.inf
    m_safe = torch.where(empty, 0.0, m)
    total = torch.zeros_like(m)
    for lse_r in weights:
        total = total + torch.exp(lse_r - m_safe)
    lse = m_safe + torch.log(torch.where(empty, 1.0, total))
    factor = torch.ones_like(lse) if sink is None else 1.0 / (1.0 + torch.exp(sink[None, :] - lse))
    return lse, empty, weights, factor


def _merge_reference(outs: torch.Tensor, lses: torch.Tensor, sink: torch.Tensor | None, out: torch.Tensor,
                     lse_out: torch.Tensor) -> None:
    """Plain-PyTorch merge, float32, ranks summed in rank order (the kernel's arithmetic, step for step)."""
    lse, empty, weights, factor = _merged_reference(lses, sink)
    acc = torch.zeros(out.shape, dtype=torch.float32, device=out.device)
    for lse_r, weight_r, part in zip(lses, weights, outs):
        weight = (torch.exp(weight_r - lse) * factor)[..., None]
        acc = torch.where((lse_r == math.inf)[..., None], acc, acc + part.float() * weight)
    out.copy_(acc)
    lse_out.copy_(torch.where(empty, math.inf, lse))
