"""Remembered calls of the attention ops: a call whose *signature* was checked before launches at once (DESIGN §4).

A signature (:func:`signature`) is every tensor argument's type, shape, strides, dtype, device and 16-byte
alignment and every other argument's value with its type. The always-on checks of the Triton family read nothing
else of a call (the value checks — index ranges, NaN sinks, scale values in tensors, the order's permutation — run
for the reference and under ``SPARSE_MLA_DEBUG=1`` only; the output's overlap with the inputs depends on pointers and
is checked again on every remembered call, :func:`recall_call`), so a call of a seen signature passes them as its
first call did. What they
decided is kept (:class:`Remembered`: the attention plan, the softmax scale, the full-width lens standing in for
absent ones) and launched on the new call's tensors: from its second call on through the plan's launch bound to the
signature (``AttentionPlan.bind``), which reads only the tensors' data pointers. A call is remembered only where the
checked path launched the caller's own tensors as they are (:func:`remember_call`; a strided index row, say, is
copied by the checks, and such a call goes the checked path every time), so those pointers are the launch's.

Used by the public ops (:func:`sparse_mla.ops.sparse_attention_decode` / ``sparse_attention_prefill``: :data:`CALLS`)
and the FlashMLA-compatible API (``sparse_mla.flash_mla``, its own memo of 4-D calls).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch

from .._checks import check_kv_scale, check_no_overlap
from . import attention_plan
from .launch import BindOnce
from .validate import D_V, AttentionArgs, kernel_takes_q

_PLAIN = frozenset((type(None), bool, int, float, str))


def signature(tensors: tuple, scalars: tuple) -> tuple | None:
    """A call's signature: each tensor's type, shape, strides, dtype, device and 16-byte alignment (the checks, the
    kernel choice and the compiled binary depend on nothing else of them), each scalar with its type; None when a
    scalar is not a plain value or a tensor argument not a strided tensor (the checked path names it)."""
    kinds = tuple(map(type, scalars))
    if not _PLAIN.issuperset(kinds):
        return None
    try:
        # the device itself, not get_device(): that is -1 for the CPU and the meta device alike
        return (tuple([None if t is None else (type(t), t.shape, t.stride(), t.dtype, t.device, t.data_ptr() & 15)
                       for t in tensors]), kinds, scalars)
    except (AttributeError, TypeError, RuntimeError):  # RuntimeError: a tensor without strides (sparse)
        return None


class Remembered:
    """What the checked path of one call signature leaves for its later calls: the attention plan, the softmax scale,
    per scope the full-width lens standing in for absent ones (None where the calls pass lens or an ``indptr``),
    ``window``: a combined index's first scope's width (None: a list per scope), and once a remembered call has run,
    the plan's launch bound to the signature's strides and sizes (``AttentionPlan.bind``; the signature is its whole
    guard: key None)."""

    __slots__ = ("plan", "scale", "full_lens", "window", "bound", "_plans", "switches")

    def __init__(self, plan: attention_plan.AttentionPlan, scale: float, full_lens: tuple[torch.Tensor | None, ...],
                 window: int | None = None) -> None:
        self.plan, self.scale, self.full_lens, self.window = plan, scale, full_lens, window
        self.bound = BindOnce()
        # the plan cache the plan came from: a test that replaces it (to plan anew under changed launch
        # configurations) must not meet plans of the old one here (recall)
        self._plans = attention_plan._PLANS
        # what decided the plan besides the signature (SPARSE_MLA_GLUON, the lowering): a change plans anew (recall)
        self.switches = attention_plan.plan_switches()

    def lists(self, indices: tuple[torch.Tensor, ...], lens: tuple[torch.Tensor | None, ...]
              ) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """The plan call's index rows and lens per scope for a call's own: per scope given its ``indices`` and its
        lens or ``indptr`` (None: absent, the full lens stand in); a combined index's one ``(T, W + K)`` tensor cut
        at ``window``, its lens read by both scopes."""
        if self.window is not None:
            (rows,), w = indices, self.window
            indices, lens = (rows[:, :w], rows[:, w:]), lens * 2
        return indices, tuple([full if given is None else given for given, full in zip(lens, self.full_lens)])


def recall(memo: OrderedDict[tuple, Remembered], sig: tuple | None) -> Remembered | None:
    """The call remembered in ``memo`` under ``sig`` (now the most recently used), if any and planned under the
    current plan cache of :mod:`.attention_plan` and its current ``plan_switches``."""
    entry = None if sig is None else memo.get(sig)
    if entry is None or entry._plans is not attention_plan._PLANS or entry.switches != attention_plan.plan_switches():
        return None
    memo.move_to_end(sig)
    return entry


def keep(memo: OrderedDict[tuple, Remembered], sig: tuple, entry: Remembered, limit: int) -> None:
    """Remember ``entry`` under ``sig``; the least recently used entry goes out past ``limit``."""
    memo[sig] = entry
    if len(memo) > limit:
        memo.popitem(last=False)


CALLS: OrderedDict[tuple, Remembered] = OrderedDict()  # the public ops' remembered calls, by signature
MAX_CALLS = 256


def recall_call(sig: tuple | None, out: torch.Tensor | None,
                inputs: Callable[[], dict[str, torch.Tensor | None]]) -> Remembered | None:
    """The public ops' call remembered under ``sig`` (:func:`recall` in :data:`CALLS`). A given ``out`` is checked
    again to share no memory with the call's inputs (``inputs()``, by argument name), which its signature cannot
    tell (``ValueError``)."""
    entry = recall(CALLS, sig)
    if entry is not None and out is not None:
        check_no_overlap("out", out, inputs())
    return entry


def _same(checked: object, given: object) -> bool:
    """Whether the checked path launches ``given`` as it is: the same object, or a tensor over the same elements."""
    return checked is given or (isinstance(checked, torch.Tensor) and isinstance(given, torch.Tensor)
                                and checked.data_ptr() == given.data_ptr() and checked.dtype == given.dtype
                                and checked.shape == given.shape and checked.stride() == given.stride())


def remember_call(sig: tuple, args: AttentionArgs, plan: attention_plan.AttentionPlan, q: torch.Tensor,
                  caches: tuple[torch.Tensor, ...], indices: tuple[torch.Tensor, ...],
                  lens: tuple[torch.Tensor | None, ...], sink: torch.Tensor | None, out: torch.Tensor | None,
                  order: torch.Tensor | None, q_scale: object, kv_scale: object, window: int | None = None) -> None:
    """Remember a Triton-family call's checked outcome ``args`` (and its ``plan``) in :data:`CALLS` under ``sig`` when
    the launch takes the call's own tensors as they are (per scope its cache, ``indices`` and lens or ``indptr``,
    None where absent; a combined index's one tensor and lens with its ``window``; ``q_scale`` / ``kv_scale`` as
    given, numbers or tensors), so that :func:`launch_call` on a later call's tensors launches what the checks
    would have."""
    per_scope = lens * 2 if window is not None else lens  # a combined index's lens count for both scopes
    full = tuple([s.lens if given is None else None for s, given in zip(args.scopes, per_scope)])
    entry = Remembered(plan, args.scale, full, window)
    rows, row_lens = entry.lists(indices, lens)
    pairs = [(args.q, q), (args.sink, sink), (args.out, out), (args.order, order)]
    pairs += [(checked, given) for checked, given in ((args.q_scale, q_scale), (args.kv_scale, kv_scale))
              if isinstance(given, torch.Tensor)]
    for scope, cache, idx, ln in zip(args.scopes, caches, rows, row_lens):
        pairs += [(scope.indices, idx), (scope.lens if scope.indptr is None else scope.indptr, ln)]
        if scope.cache.data_ptr() != cache.data_ptr():
            return
    if kernel_takes_q(q) and all(_same(checked, given) for checked, given in pairs):
        keep(CALLS, sig, entry, MAX_CALLS)


def launch_call(entry: Remembered, q: torch.Tensor, caches: tuple[torch.Tensor, ...],
                paged: Callable[[], tuple[torch.Tensor, ...]], indices: tuple[torch.Tensor, ...],
                lens: tuple[torch.Tensor | None, ...], sink: torch.Tensor | None, out: torch.Tensor | None,
                order: torch.Tensor | None, q_scale: object, kv_scale: object) -> tuple[torch.Tensor, torch.Tensor]:
    """A remembered call (arguments as :func:`remember_call` takes them): out ``(T, H, 512)`` bf16 (``out`` when given)
    and lse ``(T, H)`` float32. Through the entry's bound launch, which reads only the tensors' data (the caches go as
    given: their paged views start at the same bytes); else the plan on the paged caches ``paged()`` makes (then
    bound, the first time)."""
    rows, row_lens = entry.lists(indices, lens)
    if out is None:
        out = torch.empty(*q.shape[:2], D_V, dtype=torch.bfloat16, device=q.device)
    lse = torch.empty(*q.shape[:2], dtype=torch.float32, device=q.device)
    # numbers become (1,) float32 tensors per call, as on the checked path (their values are in the signature)
    if q_scale is not None and not isinstance(q_scale, torch.Tensor):
        q_scale = check_kv_scale(q_scale, q.device, "q_scale", False)
    if kv_scale is not None and not isinstance(kv_scale, torch.Tensor):
        kv_scale = check_kv_scale(kv_scale, q.device, "kv_scale", False)
    if entry.bound(None, q, out, lse, sink, caches, rows, row_lens, order, q_scale, kv_scale):
        return out, lse
    views, plan, scale = paged(), entry.plan, entry.scale
    plan(q, out, lse, sink, scale, views, rows, row_lens, order, q_scale, kv_scale)
    entry.bound.settle(None, lambda: plan.bind(q, out, lse, sink, scale, views, rows, row_lens, order, q_scale,
                                               kv_scale))
    return out, lse
