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
"""
from __future__ import annotations

import math

import torch

from .._checks import check_no_overlap, check_sink, check_tensor
from .dispatch import HAVE_TRITON, backend_for
from .validate import debug_checks_enabled

PARTIAL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

if HAVE_TRITON:
    import triton
    import triton.language as tl

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
        lse = m_safe + tl.log(tl.where(empty, 1.0, total))
        factor = 1.0
        if HAS_SINK:
            factor = 1.0 / (1.0 + tl.exp(tl.load(sink_ptr + head) - lse))
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
    out, lse_out = _checked(outs, lses, sink, out, lse_out, values=family == "reference" or debug_checks_enabled())
    if outs.shape[1] * outs.shape[2] == 0:
        return out, lse_out
    if family == "reference":
        _merge_reference(outs, lses, sink, out, lse_out)
    else:
        num_ranks, num_tokens, num_heads, dim = outs.shape
        block = min(triton.next_power_of_2(dim), 512)
        _merge_kernel[(num_tokens * num_heads, triton.cdiv(dim, block))](
            outs, lses, sink if sink is not None else lses, out, lse_out, num_heads, dim, num_ranks,
            *outs.stride()[:3], *lses.stride(), HAS_SINK=sink is not None, BLOCK_D=block)
    return out, lse_out


def _checked(outs: torch.Tensor, lses: torch.Tensor, sink: torch.Tensor | None, out: torch.Tensor | None,
             lse_out: torch.Tensor | None, values: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`merge_partials`' argument checks (``ValueError`` / ``TypeError`` naming the argument); with ``values``
    also no NaN in ``sink`` or ``lses`` (a sync). Returns the output tensors (allocated where not given)."""
    check_tensor("outs", outs, dtype=PARTIAL_DTYPES, ndim=4)
    num_ranks, num_tokens, num_heads, dim = outs.shape
    if num_ranks < 1 or dim < 1:
        raise ValueError(f"outs must hold at least one rank's partials of at least one column, got shape "
                         f"{tuple(outs.shape)}")
    if outs.stride(3) != 1:
        raise ValueError(f"outs must have unit stride along its last axis (D), got strides {outs.stride()}")
    device = outs.device
    check_tensor("lses", lses, dtype=torch.float32, shape=(num_ranks, num_tokens, num_heads), device=device)
    if sink is not None:
        check_sink(sink, num_heads, device, values=values)
    if out is None:
        out = torch.empty(num_tokens, num_heads, dim, dtype=outs.dtype, device=device)
    check_tensor("out", out, dtype=PARTIAL_DTYPES, shape=(num_tokens, num_heads, dim), device=device)
    if lse_out is None:
        lse_out = torch.empty(num_tokens, num_heads, dtype=torch.float32, device=device)
    check_tensor("lse_out", lse_out, dtype=torch.float32, shape=(num_tokens, num_heads), device=device)
    for name, t in (("out", out), ("lse_out", lse_out)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
        check_no_overlap(name, t, {"outs": outs, "lses": lses, "sink": sink})
    check_no_overlap("out", out, {"lse_out": lse_out})
    if values and bool(torch.isnan(lses).any()):
        raise ValueError("lses must not hold NaN (+inf marks a rank with no key)")
    return out, lse_out


def _merge_reference(outs: torch.Tensor, lses: torch.Tensor, sink: torch.Tensor | None, out: torch.Tensor,
                     lse_out: torch.Tensor) -> None:
    """Plain-PyTorch merge, float32, ranks summed in rank order (the kernel's arithmetic, step for step)."""
    weights = torch.where(lses == math.inf, -math.inf, lses)  # an empty partial weighs e^{-inf} = 0
    m = weights.amax(0)
    empty = m == -math.inf
    m_safe = torch.where(empty, 0.0, m)
    total = torch.zeros_like(m)
    for lse_r in weights:
        total = total + torch.exp(lse_r - m_safe)
    lse = m_safe + torch.log(torch.where(empty, 1.0, total))
    factor = torch.ones_like(lse) if sink is None else 1.0 / (1.0 + torch.exp(sink[None, :] - lse))
    acc = torch.zeros(out.shape, dtype=torch.float32, device=out.device)
    for lse_r, weight_r, part in zip(lses, weights, outs):
        weight = (torch.exp(weight_r - lse) * factor)[..., None]
        acc = torch.where((lse_r == math.inf)[..., None], acc, acc + part.float() * weight)
    out.copy_(acc)
    lse_out.copy_(torch.where(empty, math.inf, lse))
