"""A validated paged cache, remembered per cache tensor (DESIGN §2, §5).

Every op and layer call takes its caches as tensors (or :class:`~sparse_mla.cache.PagedCache` pools holding them),
and caches live for the whole serving run: each tensor is validated (:func:`sparse_mla.formats.resolve_cache`) the
first time it is seen and remembered in one memo, :data:`_CACHES`, under its :func:`cache_stamp` and the page layout
its caller names. A tensor seen again with the same stamp costs one dictionary lookup; one re-pointed or resized in
place (``cache.data = ...``, ``resize_``) has another stamp and is validated again.

Two readings of an entry: :func:`resolve_cache_once` (the ops: the paged view and the format, checked against a
declared ``fmt`` on every call) and :func:`cache_view` (the layer's plans: a :class:`CacheView`, which also says
whether the pages are 16-byte aligned and what a plan depends on).
"""
from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import NamedTuple

import torch

from .formats import KVFormat, declared_format, get_format, resolve_cache


class IdentityMemo:
    """Values derived from objects, remembered per live object (by identity) and made again when the object's
    ``stamp`` changes: a cheap lookup (an ``id``, a dict, a weak reference) for what is checked once per object."""

    def __init__(self) -> None:
        self._entries: dict[int, tuple] = {}

    def get(self, obj: object, stamp: object, make: Callable[[], object]):
        """The value remembered for ``obj`` under ``stamp``, else ``make()`` (remembered if it returns). The value
        must not hold ``obj`` itself: the entry would then keep ``obj`` alive."""
        key = id(obj)
        hit = self._entries.get(key)
        if hit is not None and hit[1] == stamp and hit[0]() is obj:
            return hit[2]
        value = make()
        entries = self._entries
        # the entry leaves with its object (the callback runs before the id can be reused)
        self._entries[key] = (weakref.ref(obj, lambda _, key=key: entries.pop(key, None)), stamp, value)
        return value


def cache_stamp(cache: torch.Tensor) -> tuple:
    """What a cache tensor's validation depends on besides its identity: data pointer, shape, strides and dtype
    (the stamp of :data:`_CACHES`, and of the layer's memo of its last caches)."""
    return cache.data_ptr(), cache.shape, cache.stride(), cache.dtype


def named_layout(fmt: str | KVFormat | None) -> KVFormat | None:
    """``fmt``'s format when it names a page layout other than the one its cache tensors read as (the page-planar
    V4.1 formats), else None: what, besides the tensor, the validation of a cache depends on."""
    if fmt is None:
        return None
    f = get_format(fmt)
    return f if f.name != f.encoding else None


def pages_16_byte_aligned(cache: torch.Tensor) -> bool:
    """Whether a paged cache's base and page stride are multiples of 16 bytes (the Gluon kernel's condition)."""
    return cache.data_ptr() % 16 == 0 and cache.stride(0) * cache.element_size() % 16 == 0


class CacheView(NamedTuple):
    """A validated paged cache: the ``(num_blocks, block_size, token_bytes)`` tensor, its format, and whether
    its base and page stride are 16-byte aligned. ``key`` is what a plan depends on. kv_scale: an fp8_e4m3
    :class:`~sparse_mla.cache.PagedCache`'s ``(1,)`` float32 scale (None for the other formats; set by the layer's
    ``plan.resolve_cache_arg``, never remembered)."""

    tensor: torch.Tensor
    fmt: KVFormat
    aligned: bool
    key: tuple
    kv_scale: torch.Tensor | None = None


# cache tensor -> (its paged view, None when that is the tensor itself: an entry must not hold its key; format;
# aligned; plan key), under (cache_stamp, named_layout): the one memo of validated caches
_CACHES = IdentityMemo()


def _entry(cache: torch.Tensor, layout: KVFormat | None, name: str, fmt_name: str
           ) -> tuple[torch.Tensor | None, KVFormat, bool, tuple]:
    """``cache``'s entry of :data:`_CACHES` (made when the tensor is new or its stamp changed): validated by
    :func:`~sparse_mla.formats.resolve_cache` under the named page ``layout``, its errors naming ``name`` /
    ``fmt_name``."""
    paged, fmt = resolve_cache(cache, layout, name, fmt_name)
    aligned = pages_16_byte_aligned(paged)
    # a plan's launches may be bound to one cache's geometry (LayerPlan): every layer whose plan it shares has it
    key = (fmt.name, fmt.dim, aligned, paged.shape, paged.stride(), paged.device)
    return None if paged is cache else paged, fmt, aligned, key


def resolve_cache_once(cache: torch.Tensor, fmt: str | KVFormat | None = None,
                       name: str = "cache", fmt_name: str = "fmt") -> tuple[torch.Tensor, KVFormat]:
    """:func:`~sparse_mla.formats.resolve_cache`, remembered per cache tensor (:data:`_CACHES`): a tensor seen before
    with the same :func:`cache_stamp` (and the same named page layout, :func:`named_layout`) is not validated again.
    A given ``fmt`` is compared every time."""
    if not isinstance(cache, torch.Tensor):
        return resolve_cache(cache, fmt, name, fmt_name)  # raises the TypeError naming it
    layout = named_layout(fmt)
    paged, found, _, _ = _CACHES.get(cache, (cache_stamp(cache), layout),
                                     lambda: _entry(cache, layout, name, fmt_name))
    return (cache if paged is None else paged), declared_format(cache, found, fmt, name, fmt_name)


def cache_view(cache: torch.Tensor, layout: KVFormat | None, name: str) -> CacheView:
    """The :class:`CacheView` of a cache tensor whose page layout is ``layout`` (:func:`named_layout` of its pool's
    format; None: as the tensor reads), from :data:`_CACHES` (``ValueError`` / ``TypeError`` naming ``name``)."""
    if not isinstance(cache, torch.Tensor):
        raise TypeError(f"{name} must be a cache tensor, got {type(cache).__name__}")
    paged, fmt, aligned, key = _CACHES.get(cache, (cache_stamp(cache), layout),
                                           lambda: _entry(cache, layout, name, "fmt"))
    return CacheView(cache if paged is None else paged, fmt, aligned, key)
