"""The compressors' state across steps: each request's open window, kept in library-managed memory (DESIGN §6).

A compressed entry of ratio ``r`` pools ``r`` raw tokens (at ``r = 4``, the overlapping scheme, ``2r``: the last
closed window's first halves too), and a window spans steps and prefill chunks. Rather than the open window's
running sums, the state holds the *raw* projections of the request's last :func:`state_tokens` positions (a window
and a few more: :data:`REPEATABLE_STEP_TOKENS`), the kv and the gate (``ape`` is added when a window is pooled), in
a ring indexed by ``position mod S``: an entry is
then pooled from the same values in the same order however its tokens were split into steps, so the three ways of
feeding a sequence (one prefill, chunks, token by token) write the same bytes.

A :class:`CompressorStatePool` serves the compressors of one ratio: one slot per request (``allocate`` /
``free``, like a :class:`~sparse_mla.cache.BlockAllocator`), and per compressor layer (:meth:`add_layer`) two
ring buffers ``(max_requests, S, width)`` allocated once (fixed addresses: CUDA graphs). On the host it keeps each
slot's token count, so a step whose positions do not continue the request (going backwards, skipping, a freed
slot) is a ``ValueError`` when its compress metadata is built (:mod:`sparse_mla.compress_metadata`).
"""
from __future__ import annotations

from typing import Sequence

import torch

from ._checks import check_device, check_positive_int, is_int
from .cache import CacheFullError

OVERLAP_RATIO = 4  # V4's c4a compressor pools window w-1's first halves with window w's second halves
STATE_DTYPES = (torch.bfloat16, torch.float32)
# A step in which no request adds more tokens than this may run again with the same metadata and write the same
# bytes (a CUDA graph's warm-up and capture, then its replays; benchmarks): its state writes land on ring slots
# its reads do not use. Decode steps (1 + speculative tokens) are; a longer step must run once per compressor.
REPEATABLE_STEP_TOKENS = 8


def window_slots(ratio: int) -> int:
    """Tokens pooled into one entry: ``2r`` at the overlapping ratio 4, else ``r``."""
    return 2 * ratio if ratio == OVERLAP_RATIO else ratio


def state_tokens(ratio: int) -> int:
    """Raw positions a request's state keeps at ratio ``ratio`` (its ring): an entry's window
    (:func:`window_slots`: the open window, and at ratio 4 the last closed one too) plus
    ``REPEATABLE_STEP_TOKENS - 1``, so that a step of that many new tokens a request overwrites no position it
    reads; 0 at ratio 1 (nothing pooled: no state)."""
    return 0 if ratio == 1 else window_slots(ratio) + REPEATABLE_STEP_TOKENS - 1


class CompressorStatePool:
    """Per-request compressor state of one ratio ``ratio`` (1, 2, 4 or 128) for up to ``max_requests`` requests.

    dtype: the projections' dtype (bf16 or float32); the compressors take kv and gate in this dtype, so a value
    read back from the state is the value the engine gave. ``layers[i]`` is layer ``i``'s ``(kv, score)`` rings,
    each ``(max_requests, S, width)`` (``S = state_tokens(ratio)``; a ``(max_requests, 0, width)`` empty tensor at
    ratio 1). ``seen(slot)``: the tokens the request has fed so far (its next position). ``steps``: the steps
    recorded so far. Every compressor of the pool must run every step (its rings hold what its own calls stored).
    """

    def __init__(self, ratio: int, max_requests: int, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.bfloat16) -> None:
        if not is_int(ratio) or ratio not in (1, 2, 4, 128):
            raise ValueError(f"ratio must be 1, 2, 4 or 128, got {ratio!r}")
        if dtype not in STATE_DTYPES:
            raise ValueError(f"dtype must be torch.bfloat16 or torch.float32, got {dtype}")
        self.ratio = int(ratio)
        self.max_requests = check_positive_int("max_requests", max_requests)
        self.device = check_device("device", device)  # "cuda" -> the current GPU's: compared with tensors' devices
        self.dtype = dtype
        self.ring = state_tokens(self.ratio)
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._seen: list[int | None] = [None] * self.max_requests  # None: a free slot
        self.steps = 0  # steps recorded by advance (a CompressMetadata's step number)
        self._free = list(range(self.max_requests - 1, -1, -1))

    def add_layer(self, width: int) -> int:
        """Rings for one more compressor of ``width`` (``coff · d``) channels; returns its layer index."""
        width = check_positive_int("width", width)
        shape = (self.max_requests, self.ring, width)
        self.layers.append((torch.zeros(shape, dtype=self.dtype, device=self.device),
                            torch.zeros(shape, dtype=self.dtype, device=self.device)))
        return len(self.layers) - 1

    def allocate(self) -> int:
        """A free slot for a new request (it starts at position 0); :class:`CacheFullError` if none is free."""
        if not self._free:
            raise CacheFullError(f"all {self.max_requests} compressor state slots are in use")
        slot = self._free.pop()
        self._seen[slot] = 0
        return slot

    def free(self, slot: int) -> None:
        """Return a request's slot (its state is dropped); freeing a slot that is not allocated is a ValueError."""
        self._check_slot("slot", slot)
        self._seen[slot] = None
        self._free.append(slot)
        self._free.sort(reverse=True)

    def holds_tokens(self) -> bool:
        """Whether a request in the pool has fed tokens (a compressor added now would lack their state)."""
        return any(self._seen)

    def seen(self, slot: int) -> int:
        """Tokens request ``slot`` has fed (the position its next token must have)."""
        self._check_slot("slot", slot)
        return self._seen[slot]

    def _check_slot(self, name: str, slot: object) -> None:
        if not is_int(slot) or not 0 <= slot < self.max_requests:
            raise ValueError(f"{name} must be an int in [0, {self.max_requests}), got {slot!r}")
        if self._seen[slot] is None:
            raise ValueError(f"{name} {slot} is not allocated (a freed request's compressor state)")

    def advance(self, slots: Sequence[int], prefix_lens: Sequence[int], seq_lens: Sequence[int]) -> None:
        """One step's requests, checked then recorded: request ``i`` (state slot ``slots[i]``) feeds positions
        ``prefix_lens[i] … seq_lens[i] - 1``, which must start where its state stopped (and end no earlier). Nothing
        is recorded unless every request passes."""
        if not len(slots) == len(prefix_lens) == len(seq_lens):
            raise ValueError(f"state_slots, prefix_lens and seq_lens must have one entry per request, got "
                             f"{len(slots)}, {len(prefix_lens)} and {len(seq_lens)}")
        for i, slot in enumerate(slots):
            self._check_slot(f"state_slots[{i}]", slot)
        if len(set(slots)) != len(slots):
            raise ValueError(f"state_slots names a slot twice: {list(slots)}")
        for i, (slot, start, end) in enumerate(zip(slots, prefix_lens, seq_lens)):
            if not (is_int(end) and end >= start):
                raise ValueError(f"request {i}: seq_lens[{i}] must be an int at least its prefix length {start}, "
                                 f"got {end!r}")
            seen = self._seen[slot]
            if start != seen:
                what = "go backwards" if start < seen else "skip positions"
                raise ValueError(f"request {i}: its positions {what}: the step starts at position {start}, its "
                                 f"compressor state (slot {slot}) holds {seen} tokens")
        for slot, end in zip(slots, seq_lens):
            self._seen[slot] = int(end)
        self.steps += 1
