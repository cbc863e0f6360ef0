"""StepBatch: the scheduler's requests of one step as fixed-capacity int32 tensors (DESIGN §3).

Requests come decodes first. Token ``i`` of request ``r`` sits at
``pos = (seq_len[r] - query_len[r]) + (i - query_start_loc[r])``. Buffers are allocated once by a
:class:`StepBatchBuilder` and refilled every step, so their addresses never change (CUDA graphs).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .config import COMPRESS_RATIO, DEFAULT_BLOCK_SIZE


@dataclass
class Request:
    """One request of a step.

    seq_len: tokens cached after this step (prefix + new); query_len: new tokens this step.
    block_tables: physical block numbers per cache kind (``"swa"``, ``"c4a"``, ``"c128a"``).
    """

    seq_len: int
    query_len: int
    block_tables: dict[str, list[int]] = field(default_factory=dict)


@dataclass
class StepBatch:
    """One step's batch. Token tensors have ``token_capacity`` rows; rows past ``num_tokens`` are padding.

    seq_lens, query_lens: ``(num_reqs,)``; query_start_loc: ``(num_reqs + 1,)``;
    positions, token_to_req, slot_mapping: ``(token_capacity,)`` (``-1`` on padding rows; slot_mapping
    is the SWA slot of each new token); block_tables[kind]: ``(num_reqs, max_blocks)`` (``-1`` padded).
    """

    num_reqs: int
    num_decodes: int
    num_decode_tokens: int
    num_tokens: int
    seq_lens: torch.Tensor
    query_lens: torch.Tensor
    query_start_loc: torch.Tensor
    positions: torch.Tensor
    token_to_req: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: dict[str, torch.Tensor]
    block_sizes: dict[str, int]
    max_model_len: int

    @property
    def token_capacity(self) -> int:
        return self.positions.shape[0]

    @property
    def device(self) -> torch.device:
        return self.positions.device


def entries_needed(seq_len: int, kind: str) -> int:
    """Cache entries a request of ``seq_len`` tokens occupies in the cache of ``kind``."""
    return seq_len if kind == "swa" else seq_len // COMPRESS_RATIO[kind]


class StepBatchBuilder:
    """Owns the fixed-size buffers of :class:`StepBatch` and fills them from a list of requests."""

    def __init__(self, max_tokens: int, max_reqs: int, max_model_len: int, kinds=("swa", "c4a", "c128a"),
                 block_sizes: dict[str, int] | None = None, decode_threshold: int = 1,
                 device: torch.device | str = "cpu") -> None:
        if decode_threshold < 1:
            raise ValueError(f"decode_threshold must be >= 1 (1 + speculative tokens), got {decode_threshold}")
        self.max_tokens, self.max_reqs, self.max_model_len = max_tokens, max_reqs, max_model_len
        self.kinds = tuple(kinds)
        self.block_sizes = {k: (block_sizes or {}).get(k, DEFAULT_BLOCK_SIZE[k]) for k in self.kinds}
        self.decode_threshold = decode_threshold
        self.device = torch.device(device)
        i32 = dict(dtype=torch.int32, device=self.device)
        self._seq_lens = torch.zeros(max_reqs, **i32)
        self._query_lens = torch.zeros(max_reqs, **i32)
        self._query_start_loc = torch.zeros(max_reqs + 1, **i32)
        self._positions = torch.full((max_tokens,), -1, **i32)
        self._token_to_req = torch.full((max_tokens,), -1, **i32)
        self._slot_mapping = torch.full((max_tokens,), -1, **i32)
        self._tables = {k: torch.full((max_reqs, math.ceil(entries_needed(max_model_len, k) / self.block_sizes[k])
                                       + 1), -1, **i32) for k in self.kinds}

    def _check(self, requests: list[Request]) -> int:
        if not 0 < len(requests) <= self.max_reqs:
            raise ValueError(f"requests must hold 1 to {self.max_reqs} requests, got {len(requests)}")
        num_decodes, seen_prefill = 0, False
        for r, req in enumerate(requests):
            if not 1 <= req.query_len <= req.seq_len:
                raise ValueError(f"request {r}: query_len {req.query_len} must be in [1, seq_len={req.seq_len}]")
            if req.seq_len > self.max_model_len:
                raise ValueError(f"request {r}: seq_len {req.seq_len} exceeds max_model_len {self.max_model_len}")
            is_decode = req.query_len <= self.decode_threshold
            if is_decode and seen_prefill:
                raise ValueError(f"request {r} is a decode after a prefill: decodes must come first")
            seen_prefill |= not is_decode
            num_decodes += is_decode
            for kind in self.kinds:
                table = req.block_tables.get(kind)
                need = math.ceil(entries_needed(req.seq_len, kind) / self.block_sizes[kind])
                if table is None or len(table) < need:
                    raise ValueError(f"request {r}: block table for {kind!r} has {0 if table is None else len(table)} "
                                     f"blocks, seq_len {req.seq_len} needs {need}")
                if len(table) > self._tables[kind].shape[1]:
                    raise ValueError(f"request {r}: block table for {kind!r} is longer than max_model_len allows")
        if sum(req.query_len for req in requests) > self.max_tokens:
            raise ValueError(f"requests hold more than max_tokens={self.max_tokens} new tokens")
        return num_decodes

    def build(self, requests: list[Request]) -> StepBatch:
        """Fill the buffers from ``requests`` (decodes first) and return views of them."""
        num_decodes = self._check(requests)
        n = len(requests)
        cpu = dict(dtype=torch.int32)
        seq_lens = torch.tensor([r.seq_len for r in requests], **cpu)
        query_lens = torch.tensor([r.query_len for r in requests], **cpu)
        qsl = torch.zeros(n + 1, **cpu)
        qsl[1:] = torch.cumsum(query_lens, 0)
        num_tokens = int(qsl[-1])
        self._seq_lens[:n].copy_(seq_lens)
        self._query_lens[:n].copy_(query_lens)
        self._query_start_loc[: n + 1].copy_(qsl)
        for kind in self.kinds:
            rows = torch.full((n, self._tables[kind].shape[1]), -1, **cpu)
            for r, req in enumerate(requests):
                rows[r, : len(req.block_tables[kind])] = torch.tensor(req.block_tables[kind], **cpu)
            self._tables[kind][:n].copy_(rows)
        dev_qsl, dev_seq, dev_q = self._query_start_loc[: n + 1], self._seq_lens[:n], self._query_lens[:n]
        tok = torch.arange(num_tokens, device=self.device, dtype=torch.int32)
        req_of_tok = torch.repeat_interleave(torch.arange(n, device=self.device, dtype=torch.int32), dev_q.long(),
                                             output_size=num_tokens)
        pos = (dev_seq - dev_q)[req_of_tok.long()] + tok - dev_qsl[req_of_tok.long()]
        self._positions.fill_(-1)
        self._token_to_req.fill_(-1)
        self._slot_mapping.fill_(-1)
        self._positions[:num_tokens] = pos
        self._token_to_req[:num_tokens] = req_of_tok
        self._slot_mapping[:num_tokens] = slots_of(self._tables["swa"], req_of_tok, pos, self.block_sizes["swa"]) \
            if "swa" in self.kinds else -1
        return StepBatch(
            num_reqs=n, num_decodes=num_decodes, num_decode_tokens=int(qsl[num_decodes]), num_tokens=num_tokens,
            seq_lens=dev_seq, query_lens=dev_q, query_start_loc=dev_qsl, positions=self._positions,
            token_to_req=self._token_to_req, slot_mapping=self._slot_mapping,
            block_tables={k: self._tables[k][:n] for k in self.kinds}, block_sizes=dict(self.block_sizes),
            max_model_len=self.max_model_len)


def slots_of(table: torch.Tensor, req: torch.Tensor, entry: torch.Tensor, block_size: int) -> torch.Tensor:
    """Slots of cache entries: ``table[req, entry // bs] * bs + entry % bs``, ``-1`` where ``entry < 0``.

    table: ``(num_reqs, max_blocks)`` int32; req, entry: int32 tensors of one shape (req broadcastable).
    """
    ok = entry >= 0
    e = torch.where(ok, entry, 0).long()
    r = req.long().expand_as(e)
    col = (e // block_size).clamp_max(table.shape[1] - 1)
    phys = table[r, col]
    slot = phys * block_size + (e % block_size).to(torch.int32)
    return torch.where(ok & (phys >= 0), slot, -1).to(torch.int32)
