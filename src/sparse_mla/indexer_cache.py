"""The lightning indexer's key cache: paged 128-d keys, in vLLM's / DeepGEMM's fp8 layout or in bf16.

Layout (DESIGN §6; byte-identical to vLLM's indexer cache, so caches move between engines). A page holds
``block_size`` entries (64: V4's 256 raw tokens at ratio 4, V3.2's 64 raw tokens); ``slot = block · block_size +
offset``, ``-1`` invalid.

| format | ``data`` | a page's bytes |
|---|---|---|
| ``fp8``  | ``(num_blocks, block_size, 132)`` uint8 | ``[block_size × 128 e4m3 codes][block_size × float32]`` |
| ``bf16`` | ``(num_blocks, block_size, 128)`` bfloat16 | ``block_size`` rows of 128 bf16 |

So in an fp8 page entry ``j``'s codes are bytes ``128·j … 128·j + 127`` and its scale the float32 at byte
``128·block_size + 4·j`` — the tensor's ``(block_size, 132)`` shape is vLLM's, not a per-entry record.

Quantiser (fp8; DeepGEMM's / vLLM's writer): the key is rounded to bf16 first, ``x̂ = bf16(x)``; its scale is
``2^e``, ``e = ceil(log2(max(amax(x̂), 1e-4) / 448))`` (note: the floor is on the amax, not on ``amax / 448`` as in
the attention caches); codes are ``e4m3(x̂ / 2^e)`` (round to nearest even). The dequantised key is
``code · scale``, exact in float32.
"""
from __future__ import annotations

import torch

from ._checks import check_device, check_distinct_slots, check_index_range, check_positive_int, check_tensor
from .cache import BlockAllocator, PagePool
from .formats import E4M3_MAX, E4M3_NAN, ceil_pow2

INDEX_HEAD_DIM = 128  # width of an indexer key (V4, V4.1, V3.2)
INDEX_BLOCK_SIZE = 64  # entries per page (DeepGEMM's paged logits kernels take 64)
INDEX_AMAX_FLOOR = 1e-4  # the key's amax floor before the division by 448
FP8_ENTRY_BYTES = INDEX_HEAD_DIM + 4  # 128 e4m3 codes + one float32 scale
INDEX_FORMATS = ("fp8", "bf16")


def index_key_scales(keys: torch.Tensor) -> torch.Tensor:
    """The fp8 scale of each key: ``keys (n, 128)`` (any float dtype) -> ``(n,)`` float32 powers of two,
    ``2^ceil(log2(max(amax(bf16(key)), 1e-4) / 448))`` (exact: :func:`formats.ceil_pow2`)."""
    amax = keys.to(torch.bfloat16).float().abs().amax(-1)
    return ceil_pow2(torch.clamp_min(amax, INDEX_AMAX_FLOOR) / E4M3_MAX)


def quantize_index_keys(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 keys: ``keys (n, 128)`` -> ``codes (n, 128)`` uint8 (e4m3 of ``bf16(key) / scale``; NaN as 0x7F) and
    ``scales (n,)`` float32 (:func:`index_key_scales`)."""
    scales = index_key_scales(keys)
    q = keys.to(torch.bfloat16).float() / scales[:, None]
    codes = q.to(torch.float8_e4m3fn).view(torch.uint8)
    return torch.where(torch.isnan(q), E4M3_NAN, codes), scales


def check_storable_keys(name: str, keys: torch.Tensor) -> None:
    """Keys about to be stored must be finite once rounded to bf16, the precision both formats store (fp8 quantises
    ``bf16(key)``): a float32 key past bf16's range would be stored as inf, or as NaN codes under an inf scale."""
    if not bool(torch.isfinite(keys.to(torch.bfloat16)).all()):
        raise ValueError(f"{name} must be finite (no NaN or inf) once rounded to bf16 (|key| < 3.39e38)")


def dequantize_index_keys(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``codes (..., 128)`` uint8, ``scales (...)`` float32 -> keys ``(..., 128)`` float32 (``code · scale``)."""
    return codes.view(torch.float8_e4m3fn).float() * scales[..., None]


class IndexerKeyCache(PagePool):
    """A pool of ``num_blocks`` pages of ``block_size`` indexer keys in format ``fmt`` (``"fp8"`` or ``"bf16"``).

    ``data`` is the tensor the indexer kernels read (layout in the module docstring); :meth:`codes` and
    :meth:`scales` are the fp8 pages' two planes as views. ``write`` / ``read`` are the plain-PyTorch reference
    insert and gather (any device); the compressors write through their own kernels into the same bytes.
    """

    def __init__(self, num_blocks: int, fmt: str = "fp8", device: torch.device | str = "cpu",
                 block_size: int = INDEX_BLOCK_SIZE) -> None:
        if fmt not in INDEX_FORMATS:
            raise ValueError(f"fmt must be one of {INDEX_FORMATS}, got {fmt!r}")
        self.fmt = fmt
        self.block_size = check_positive_int("block_size", block_size)
        self.allocator = BlockAllocator(num_blocks)
        device = check_device("device", device)
        if fmt == "fp8":
            self.data = torch.zeros(num_blocks, block_size, FP8_ENTRY_BYTES, dtype=torch.uint8, device=device)
        else:
            self.data = torch.zeros(num_blocks, block_size, INDEX_HEAD_DIM, dtype=torch.bfloat16, device=device)

    def codes(self) -> torch.Tensor:
        """fp8 only: ``(num_blocks, block_size, 128)`` uint8 view of each page's code plane."""
        self._need_fp8("codes")
        pages = self.data.view(self.num_blocks, -1)
        return pages[:, :self.block_size * INDEX_HEAD_DIM].view(self.num_blocks, self.block_size, INDEX_HEAD_DIM)

    def scales(self) -> torch.Tensor:
        """fp8 only: ``(num_blocks, block_size)`` float32 view of each page's scale plane."""
        self._need_fp8("scales")
        pages = self.data.view(self.num_blocks, -1)
        return pages[:, self.block_size * INDEX_HEAD_DIM:].view(torch.float32)

    def _need_fp8(self, what: str) -> None:
        if self.fmt != "fp8":
            raise ValueError(f"{what}() is for fp8 indexer caches, this one is {self.fmt}")

    def poison(self) -> None:
        """Every byte 0xFF (NaN in bf16, e4m3 and float32), so unwritten slots read as NaN."""
        self.data.view(torch.uint8).fill_(0xFF)

    def finite_slots(self) -> torch.Tensor:
        """``(num_blocks, block_size)`` bool: whether each slot holds a finite key (fp8: a finite scale and no NaN
        code; bf16: every value finite). :meth:`write` stores finite keys only, so a slot that is not is one never
        written (an allocation's zeros are finite; a poisoned slot, :meth:`poison`, is not)."""
        if self.fmt == "bf16":
            return torch.isfinite(self.data).all(-1)
        codes = self.codes()
        return torch.isfinite(self.scales()) & ~((codes & 0x7F) == E4M3_NAN).any(-1)

    def _check_slots(self, slots: torch.Tensor) -> torch.Tensor:
        check_tensor("slots", slots, dtype=(torch.int32, torch.int64), device=self.device)
        check_index_range("slots", slots, self.num_slots)
        return slots.long()

    def write(self, keys: torch.Tensor, slots: torch.Tensor) -> None:
        """Store ``keys (n, 128)`` (float32 / bf16) at ``slots (n,)``; ``-1`` entries skipped (reference writer)."""
        check_tensor("keys", keys, dtype=(torch.float32, torch.bfloat16), ndim=2, device=self.device)
        if keys.shape[1] != INDEX_HEAD_DIM:
            raise ValueError(f"keys must have shape (n, {INDEX_HEAD_DIM}), got {tuple(keys.shape)}")
        check_tensor("slots", slots, shape=(keys.shape[0],))
        slots = self._check_slots(slots)
        keep = slots >= 0
        keys, slots = keys[keep], slots[keep]
        check_storable_keys("keys", keys)
        check_distinct_slots("slots", slots)
        blocks, offsets = slots // self.block_size, slots % self.block_size
        if self.fmt == "bf16":
            self.data[blocks, offsets] = keys.to(torch.bfloat16)
            return
        codes, scales = quantize_index_keys(keys)
        self.codes()[blocks, offsets] = codes
        self.scales()[blocks, offsets] = scales

    def read(self, slots: torch.Tensor) -> torch.Tensor:
        """Dequantised keys at ``slots (...)``: ``slots.shape + (128,)`` float32, zeros for ``-1``."""
        slots = self._check_slots(slots)
        safe = slots.clamp_min(0)
        blocks, offsets = safe // self.block_size, safe % self.block_size
        if self.fmt == "bf16":
            keys = self.data[blocks, offsets].float()
        else:
            keys = dequantize_index_keys(self.codes()[blocks, offsets], self.scales()[blocks, offsets])
        return torch.where((slots >= 0)[..., None], keys, 0.0)
