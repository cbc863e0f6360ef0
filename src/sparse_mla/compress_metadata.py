"""A step's compression metadata: which tokens complete a compressed entry, and where each new entry goes.

Built once per step and per compressor ratio from the :class:`~sparse_mla.batch.StepBatch` and the requests'
state slots (:class:`~sparse_mla.compress_state.CompressorStatePool`), and shared by every compressor of that
ratio in the step (the layers' attention compressors and, at ratio 4, the indexer's): the engine computes no
compressed slot mapping.

Token ``t`` at position ``p`` completes entry ``w = (p + 1) / r - 1`` when ``(p + 1) mod r = 0``
(:func:`~sparse_mla.config.complete_entries`); the entry's slot is ``table[req, w // bs] · bs + w mod bs`` through
the block table of the ratio's kind (``c4a``, ``c128a``, ``c2a``, ``c1a``; the indexer key cache shares ``c4a``'s
table: 64 entries a page both), and it is roped at position ``w · r``. Buffers have the batch's token capacity and
are refilled in place each step (``out=``), so the compressors that read them can be captured in a CUDA graph;
the build itself checks the requests on the host and runs eagerly, like ``StepBatchBuilder.build``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from .batch import StepBatch, slots_of, upload
from .compress_state import REPEATABLE_STEP_TOKENS, CompressorStatePool
from .config import COMPRESS_RATIO, COMPRESSED_KINDS

KIND_OF_COMPRESS_RATIO = {COMPRESS_RATIO[k]: k for k in COMPRESSED_KINDS}  # 4 c4a, 128 c128a, 2 c2a, 1 c1a


@dataclass
class CompressMetadata:
    """One step's compression lists for the compressors of ``pool`` (ratio ``ratio``, cache kind ``kind``).

    entry_slots ``(token_capacity,)`` int32: the slot in the ``kind`` cache of the entry token ``t`` completes,
    ``-1`` where it completes none (or is padding, or its block table has no block there).
    entry_positions ``(token_capacity,)`` int32: that entry's rope position ``w · r``, ``-1`` where none.
    prefix_lens ``(max_reqs,)`` int32: each request's first position this step (``seq_len - query_len``).
    state_slots ``(max_reqs,)`` int32: each request's slot in ``pool``.
    step: the pool's step number of this metadata; repeatable: whether the step may run again
    (no request adds more than ``REPEATABLE_STEP_TOKENS`` tokens), else a compressor runs it once.
    """

    batch: StepBatch
    pool: CompressorStatePool
    kind: str
    entry_slots: torch.Tensor
    entry_positions: torch.Tensor
    prefix_lens: torch.Tensor
    state_slots: torch.Tensor
    step: int = 0
    repeatable: bool = True
    # set by build_compress_metadata once it has filled the buffers from a checked batch and slots: a compressor
    # refuses metadata made or dataclasses.replace()d by hand (its slots index the state pool and the cache unchecked)
    _filled: bool = field(default=False, init=False, repr=False, compare=False)

    def __setattr__(self, name: str, value: object) -> None:
        # a field set after the build (a buffer swapped, a step renumbered) leaves metadata no build has checked
        object.__setattr__(self, name, value)
        if name != "_filled":
            object.__setattr__(self, "_filled", False)

    @property
    def ratio(self) -> int:
        return self.pool.ratio

    def check_current(self) -> None:
        """``ValueError`` once the batch's builder has built another step (these buffers are then refilled)."""
        self.batch.check_current()


def allocate_compress_metadata(batch: StepBatch, pool: CompressorStatePool) -> CompressMetadata:
    """Empty buffers sized for ``batch``'s builder (token capacity, request capacity)."""
    kind = _kind(batch, pool)
    cap, reqs = batch.token_capacity, batch.builder.max_reqs if batch.builder is not None else batch.num_reqs
    i32 = dict(dtype=torch.int32, device=batch.device)
    return CompressMetadata(batch, pool, kind, torch.full((cap,), -1, **i32), torch.full((cap,), -1, **i32),
                            torch.zeros(reqs, **i32), torch.zeros(reqs, **i32))


def _kind(batch: StepBatch, pool: CompressorStatePool) -> str:
    if not isinstance(batch, StepBatch):
        raise TypeError(f"batch must be a StepBatch (StepBatchBuilder.build), got {type(batch).__name__}")
    if not isinstance(pool, CompressorStatePool):
        raise TypeError(f"pool must be a CompressorStatePool, got {type(pool).__name__}")
    kind = KIND_OF_COMPRESS_RATIO[pool.ratio]
    if kind not in batch.block_tables:
        raise ValueError(f"pool has ratio {pool.ratio} (kind {kind!r}), but batch has no {kind!r} block table "
                         f"(kinds {batch.kinds})")
    if pool.device != batch.device:
        raise ValueError(f"pool is on {pool.device}, batch on {batch.device}")
    return kind


def build_compress_metadata(batch: StepBatch, pool: CompressorStatePool, state_slots: Sequence[int],
                            out: CompressMetadata | None = None) -> CompressMetadata:
    """The compression metadata of ``batch`` for ``pool``'s compressors; ``state_slots[i]``: request ``i``'s slot
    in ``pool`` (from ``pool.allocate()``). Checks each request continues its state (positions neither going
    backwards nor skipping; its slot allocated) and records the step in the pool. ``out``: metadata of the same
    builder and pool to refill in place (what a captured step reads)."""
    if not isinstance(state_slots, (Sequence, torch.Tensor)) or isinstance(state_slots, str):
        raise TypeError(f"state_slots must be a sequence of ints (one slot per request), got "
                        f"{type(state_slots).__name__}")
    kind = _kind(batch, pool)
    batch.check_current()
    if isinstance(state_slots, torch.Tensor):
        if state_slots.dim() != 1:
            raise ValueError(f"state_slots must be 1-D (one slot per request), got shape {tuple(state_slots.shape)}")
        state_slots = state_slots.tolist()
    state_slots = list(state_slots)
    if len(state_slots) != batch.num_reqs:
        raise ValueError(f"state_slots must hold one slot per request ({batch.num_reqs}), got {len(state_slots)}")
    prefix_host = [s - q for s, q in zip(batch.seq_lens_host, batch.query_lens_host)]
    if out is None:
        out = allocate_compress_metadata(batch, pool)
    elif not isinstance(out, CompressMetadata) or out.pool is not pool or out.entry_slots.shape[0] != \
            batch.token_capacity or out.prefix_lens.shape[0] < batch.num_reqs or out.batch.builder is not batch.builder:
        raise ValueError("out must be CompressMetadata of the same pool and batch builder (allocate_compress_metadata)")
    pool.advance(state_slots, prefix_host, batch.seq_lens_host)
    out.step, out.repeatable = pool.steps, max(batch.query_lens_host) <= REPEATABLE_STEP_TOKENS
    n, r = batch.num_reqs, pool.ratio
    out.batch, out.kind = batch, kind
    out.prefix_lens[:n].copy_(batch.seq_lens - batch.query_lens)
    upload(out.state_slots[:n], state_slots)
    pos, req = batch.positions, batch.token_to_req
    completes = (pos >= 0) & ((pos + 1) % r == 0)
    entry = torch.where(completes, (pos + 1) // r - 1, -1).to(torch.int32)
    out.entry_slots.copy_(slots_of(batch.block_tables[kind], req.clamp_min(0), entry, batch.block_sizes[kind]))
    out.entry_positions.copy_(torch.where(completes, entry * r, -1))
    out._filled = True
    return out
