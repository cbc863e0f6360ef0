"""Paged KV cache pools: one buffer of blocks in one format, a block allocator, insertion by slot."""
from __future__ import annotations

import torch

from ._checks import check_kv_scale, check_positive_int, is_int
from .formats import KVFormat, allocate_cache, get_format
from .ops import dequantize_and_gather, quantize_and_insert


class CacheFullError(RuntimeError):
    """Raised when a pool has fewer free blocks than requested."""


class BlockAllocator:
    """Hands out physical block numbers ``0 … num_blocks-1``; never gives one block out twice."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = check_positive_int("num_blocks", num_blocks)
        self._free = list(range(num_blocks - 1, -1, -1))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        """``n`` free blocks, lowest numbers first; :class:`CacheFullError` if fewer are free."""
        if not is_int(n) or n < 0:
            raise ValueError(f"n must be an int >= 0, got {n!r}")
        if n > len(self._free):
            raise CacheFullError(f"asked for {n} blocks, only {len(self._free)} of {self.num_blocks} free")
        got = [self._free.pop() for _ in range(n)]
        self._used.update(got)
        return got

    def free(self, blocks: list[int]) -> None:
        """Return blocks to the pool; freeing a block that is not allocated (or twice) is an error,
        and then no block of the call is freed."""
        if isinstance(blocks, torch.Tensor):
            raise TypeError(f"blocks must be a list of block numbers (as allocate returns them), got a tensor of "
                            f"shape {tuple(blocks.shape)}: pass blocks.tolist()")
        if isinstance(blocks, (str, bytes)) or not hasattr(blocks, "__iter__"):
            raise TypeError(f"blocks must be a list of block numbers (as allocate returns them), got {blocks!r}")
        blocks = list(blocks)
        if not all(is_int(b) for b in blocks):
            raise ValueError(f"blocks must be ints, got {blocks!r}")
        for i, b in enumerate(blocks):
            if b in blocks[:i]:
                raise ValueError(f"block {b} is given twice")
            if b not in self._used:
                raise ValueError(f"block {b} is not allocated")
        for b in blocks:
            self._used.remove(b)
            self._free.append(b)
        self._free.sort(reverse=True)


class PagePool:
    """What every paged pool shares (:class:`PagedCache`, the indexer's
    :class:`~sparse_mla.indexer_cache.IndexerKeyCache`): ``data`` ``(num_blocks, block_size, ...)``, the
    ``block_size`` entries a page holds and the pool's :class:`BlockAllocator`."""

    data: torch.Tensor
    block_size: int
    allocator: BlockAllocator

    @property
    def num_blocks(self) -> int:
        return self.data.shape[0]

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def device(self) -> torch.device:
        return self.data.device


class PagedCache(PagePool):
    """A pool of ``num_blocks`` blocks of ``block_size`` tokens in one :class:`KVFormat`.

    ``data`` is the cache tensor the ops take: ``(num_blocks, block_size, token_bytes)``.
    ``kv_scale``: an fp8_e4m3 pool's per-tensor scale, a ``(1,)`` float32 tensor on the pool's device (default
    1.0; a given tensor is kept, not copied: ``kv_scale.fill_(s)`` changes it in place, so graphs that read it
    stay valid), passed to every op on ``data``; None for the other formats.
    """

    def __init__(self, num_blocks: int, block_size: int, fmt: str | KVFormat = "fp8_v4", dim: int | None = None,
                 device: torch.device | str = "cpu", kv_scale: float | torch.Tensor | None = None) -> None:
        self.fmt = get_format(fmt, dim)
        self.data = allocate_cache(self.fmt, num_blocks, block_size, device, self.fmt.dim)  # checks the sizes
        self.block_size = int(block_size)
        self.allocator = BlockAllocator(num_blocks)
        if not self.fmt.per_tensor and kv_scale is not None:
            raise ValueError(f"kv_scale is only for fp8_e4m3 caches, got a {self.fmt.name} cache")
        self.kv_scale = (check_kv_scale(1.0 if kv_scale is None else kv_scale, self.data.device)
                         if self.fmt.per_tensor else None)

    def poison(self) -> None:
        """Fill every byte with 0xFF (NaN in bf16, e4m3 and ue8m0), so unwritten slots read as NaN."""
        if self.fmt.name == "bf16":
            self.data.fill_(float("nan"))
        else:
            self._storage().fill_(0xFF)

    def _storage(self) -> torch.Tensor:
        nbytes = (self.num_blocks - 1) * self.data.stride(0) + self.block_size * self.fmt.token_bytes
        return torch.as_strided(self.data.view(torch.uint8), (nbytes,), (1,), self.data.storage_offset())

    def write(self, kv_new: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Quantise and store ``kv_new (n, d)`` bf16 at ``slot_mapping (n,)``; ``-1`` entries skipped."""
        quantize_and_insert(kv_new, self.data, slot_mapping, self.fmt, kv_scale=self.kv_scale)

    def read(self, slots: torch.Tensor) -> torch.Tensor:
        """Dequantised tokens at ``slots``: ``slots.shape + (d,)`` bf16 (zeros for ``-1``)."""
        return dequantize_and_gather(self.data, slots, self.fmt, kv_scale=self.kv_scale)
