"""StepBatch: the scheduler's requests of one step as fixed-capacity int32 tensors (DESIGN §3).

Requests come decodes first. Token ``i`` of request ``r`` sits at
``pos = (seq_len[r] - query_len[r]) + (i - query_start_loc[r])``. Buffers are allocated once by a
:class:`StepBatchBuilder` and refilled every step, so their addresses never change (CUDA graphs).
"""
from __future__ import annotations

import functools
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import chain

import numpy as np
import torch

from ._checks import check_device, check_positive_int, is_int
from .config import COMPRESS_RATIO, DEFAULT_BLOCK_SIZE, V4_KINDS, WINDOWED_KINDS, complete_entries


@dataclass
class Request:
    """One request of a step.

    seq_len: tokens cached after this step (prefix + new); query_len: new tokens this step.
    block_tables: physical block numbers per cache kind (``"swa"``, ``"c4a"``, ``"c128a"``, V4.1's ``"c2a"``,
    ``"c1a"``, or V3.2's ``"dsa"``): a list of ints, or a 1-D integer numpy array or CPU tensor (a row view of an
    engine's own ``(requests, blocks)`` table: where every table of a kind is one, the build copies them in one
    concatenation rather than entry by entry, 128 requests at 32K 1.3 against 4.0 ms on two cores); each must cover
    the request's ``seq_len`` tokens (:func:`blocks_needed`), and entries past those are neither checked nor stored
    (the step's rows hold ``-1`` there). A block holds one range
    of entries: the blocks a request's ``seq_len`` needs are distinct, and no two requests of a step share one,
    except a shared prefix (below).
    shared_prefix_blocks: per kind, how many leading blocks of the table are a read-only prefix that other requests
    of the step may list too (prefix caching: a common prompt's full blocks); default 0. The step must not write
    them: they end at or before the block holding the first entry this request writes (its first new token, or
    for a compressed kind the first entry this step completes). A block two requests share must lie in both
    requests' shared prefixes.
    """

    seq_len: int
    query_len: int
    block_tables: dict[str, Sequence[int]] = field(default_factory=dict)
    shared_prefix_blocks: dict[str, int] = field(default_factory=dict)


@dataclass
class StepBatch:
    """One step's batch. Token tensors have ``token_capacity`` rows; rows from ``num_tokens`` on are padding.

    Device tensors (views of the builder's buffers):
    seq_lens, query_lens: ``(num_reqs,)``; query_start_loc: ``(num_reqs + 1,)``;
    positions, token_to_req, slot_mapping: ``(token_capacity,)``, ``-1`` on padding rows (slot_mapping
    is the raw-token cache's slot of each new token — ``swa``, or ``dsa`` for V3.2 — where the engine
    writes its latent);
    block_tables[kind]: ``(num_reqs, max_blocks)``, ``-1`` padded.
    Host copies (``*_host``, Python lists) let planners avoid a device sync.
    builder / build_number: the :class:`StepBatchBuilder` that owns the buffers and which of its builds this
    is; the buffers hold this batch only while ``is_current`` (the builder's next build refills them).
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
    decode_threshold: int
    seq_lens_host: list[int]
    query_lens_host: list[int]
    query_start_loc_host: list[int]
    builder: StepBatchBuilder | None = None
    build_number: int = 0
    max_block: dict[str, int] = field(default_factory=dict)  # per kind, the largest block number the tables use

    @property
    def is_current(self) -> bool:
        """Whether the builder's buffers still hold this batch (no later ``build`` has refilled them)."""
        return self.builder is None or self.builder.builds == self.build_number

    def check_current(self) -> None:
        """``ValueError`` if a later build of the same builder has refilled this batch's buffers."""
        if not self.is_current:
            raise ValueError(f"stale step: this batch (and any metadata built from it) is build {self.build_number} "
                             f"of its StepBatchBuilder, which has built step {self.builder.builds} since and refilled "
                             f"the buffers; build the metadata again from the new batch")

    def table_buffer(self, kind: str) -> torch.Tensor:
        """The ``kind`` block table as its builder's whole buffer, ``(max_reqs, max_blocks)`` (rows past
        ``num_reqs`` hold other steps' tables or ``-1``); without a builder, :attr:`block_tables`' own. What a launch
        bound once to the builder's buffers reads through: the :attr:`block_tables` views' rows change from step to
        step, the buffer's stay, and they bound the request a kernel may look up (``ops.triton.index.table_slots``).
        ``kind``: one of :attr:`kinds` (the library's bound launches name their own)."""
        return self.block_tables[kind] if self.builder is None else self.builder.table_buffer(kind)

    @property
    def raw_kind(self) -> str:
        """The raw-token cache kind: ``"swa"`` (V4) or ``"dsa"`` (V3.2)."""
        return "dsa" if "dsa" in self.block_tables else "swa"

    @property
    def token_capacity(self) -> int:
        return self.positions.shape[0]

    @property
    def device(self) -> torch.device:
        return self.positions.device

    @property
    def num_prefills(self) -> int:
        return self.num_reqs - self.num_decodes

    @property
    def num_prefill_tokens(self) -> int:
        return self.num_tokens - self.num_decode_tokens

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(self.block_tables)

    def check_cache_holds_blocks(self, kind: str, num_blocks: int, name: str) -> None:
        """The ``kind`` cache ``name`` of ``num_blocks`` blocks holds every block this step's ``kind`` tables name: a
        smaller one would have its blocks past the end read and written by the kernels, or their entries dropped."""
        if self.max_block.get(kind, -1) >= num_blocks:
            raise ValueError(f"{name} has {num_blocks} blocks, but the step's {kind!r} block tables name block "
                             f"{self.max_block[kind]}: the cache is smaller than the block tables")

    def entry_slots(self, kind: str, req: int | torch.Tensor, entries: torch.Tensor) -> torch.Tensor:
        """Slots in the ``kind`` cache of entries (positions for ``swa``) of request(s) ``req``; ``-1`` where an entry
        is negative, lies past the request's table or in a block the table holds as ``-1``.

        req: an int request of this batch, or an integer tensor of them broadcastable to ``entries`` (its values are
        checked: one host sync for a GPU tensor). entries: an integer tensor. Returns int32 slots of entries' shape.
        A batch whose builder has built a later step is refused (its tables are that step's now).
        """
        self.check_current()
        if kind not in self.block_tables:
            raise ValueError(f"kind {kind!r} has no block table in this batch (has {self.kinds})")
        for name, value in (("req", req), ("entries", entries)):
            if not (is_int(value) and name == "req") and not _is_int_tensor(value):
                raise TypeError(f"{name} must be {'an int or ' if name == 'req' else 'an '}integer tensor, got "
                                f"{value.dtype if isinstance(value, torch.Tensor) else type(value).__name__}")
        in_batch = f"req must be request(s) of this batch, in [0, {self.num_reqs})"
        if is_int(req) and not 0 <= req < self.num_reqs:  # (also one past int64, which no tensor holds)
            raise ValueError(f"{in_batch}, got {req}")
        req_t = torch.as_tensor(req, device=self.device)
        try:
            fits = torch.broadcast_shapes(req_t.shape, entries.shape) == entries.shape
        except RuntimeError:
            fits = False
        if not fits:
            raise ValueError(f"req of shape {tuple(req_t.shape)} must broadcast to entries' {tuple(entries.shape)}")
        # a negative request is not an index from the end: it would read another request's table (an int req was
        # checked above; a tensor's values cost one sync)
        lo, hi = torch.stack(torch.aminmax(req_t)).tolist() if req_t.numel() and not is_int(req) else (0, 0)
        if not (0 <= lo and hi < self.num_reqs):
            raise ValueError(f"{in_batch}, got {req_t.flatten()[:8].tolist()}")
        # int64 entries are taken as they are: one past int32 lies past every table (-1), not on a wrapped entry
        return slots_of(self.block_tables[kind], req_t, entries.to(device=self.device, dtype=torch.int64),
                        self.block_sizes[kind])

    def new_entries(self, kind: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Compressed entries that become complete this step, where the engine's compressor writes them.

        Request ``r`` completes entries ``complete_entries(prefix_len) … complete_entries(seq_len) - 1`` (of the
        ratio of ``kind``, :func:`~sparse_mla.config.complete_entries`; for ``"swa"`` and ``"c1a"`` these are the new
        tokens' positions). Returns ``(req, entry, slot)``, three ``(n,)`` int32 tensors ordered by request then entry.
        A batch whose builder has built a later step is refused (its lengths and tables are that step's now).
        """
        self.check_current()
        if kind not in self.block_tables:
            raise ValueError(f"kind must be one of this batch's kinds {tuple(self.block_tables)}, got {kind!r}")
        ratio = COMPRESS_RATIO[kind]
        first = complete_entries(self.seq_lens - self.query_lens, ratio)
        count = complete_entries(self.seq_lens, ratio) - first
        n = sum(complete_entries(s, ratio) - complete_entries(s - q, ratio)
                for s, q in zip(self.seq_lens_host, self.query_lens_host))
        req = torch.repeat_interleave(torch.arange(self.num_reqs, dtype=torch.int32, device=self.device),
                                      count.long(), output_size=n)
        start = torch.cumsum(count, 0) - count  # first output row of each request
        entry = first[req.long()] + torch.arange(n, dtype=torch.int32, device=self.device) - start[req.long()]
        entry = entry.to(torch.int32)
        return req, entry, slots_of(self.block_tables[kind], req, entry, self.block_sizes[kind])


def entries_needed(seq_len: int, kind: str) -> int:
    """Cache entries a request of ``seq_len`` tokens occupies in the cache of ``kind``."""
    if kind not in COMPRESS_RATIO:
        raise ValueError(f"kind must be one of {tuple(COMPRESS_RATIO)}, got {kind!r}")
    if not is_int(seq_len):
        raise TypeError(f"seq_len must be an int, got {seq_len!r}")
    if seq_len < 0:
        raise ValueError(f"seq_len must be >= 0, got {seq_len}")
    return complete_entries(seq_len, COMPRESS_RATIO[kind])


def blocks_needed(seq_len: int, kind: str, block_size: int | None = None) -> int:
    """Blocks of the ``kind`` cache a request of ``seq_len`` tokens needs (its block table's minimum length)."""
    entries = entries_needed(seq_len, kind)
    bs = DEFAULT_BLOCK_SIZE[kind] if block_size is None else check_positive_int("block_size", block_size)
    return _blocks_of(entries, bs)


def _blocks_for(seq_len: int, ratio: int, block_size: int) -> int:
    """:func:`blocks_needed` of arguments known good (a builder's own kinds and block sizes, a request's checked
    seq_len): the builder asks it of every request and kind each step, and the checks cost 4x the arithmetic."""
    return _blocks_of(complete_entries(seq_len, ratio), block_size)


def _blocks_of(entries: int, block_size: int) -> int:
    """Blocks of ``block_size`` entries that hold ``entries``."""
    return -(-entries // block_size)


class StepBatchBuilder:
    """Owns the fixed-size buffers of :class:`StepBatch` and fills them from a list of requests.

    max_tokens: token capacity (new tokens per step, incl. room for padding); max_reqs: requests per
    step; max_model_len: the longest ``seq_len``. decode_threshold: ``1 + speculative tokens``; a
    request with ``query_len <= decode_threshold`` is a decode. num_blocks: each kind's cache size in
    blocks (``cache.shape[0]``), optional; when given, a block table that names a block past it is
    a ``ValueError`` here, on the host (the kernels would otherwise skip such keys, unread).
    """

    def __init__(self, max_tokens: int, max_reqs: int, max_model_len: int,
                 kinds: Sequence[str] = V4_KINDS, block_sizes: dict[str, int] | None = None,
                 decode_threshold: int = 1, device: torch.device | str = "cpu",
                 num_blocks: Mapping[str, int] | None = None) -> None:
        if not is_int(decode_threshold):
            raise TypeError(f"decode_threshold must be an int (1 + speculative tokens), got {decode_threshold!r}")
        if decode_threshold < 1:
            raise ValueError(f"decode_threshold must be >= 1 (1 + speculative tokens), got {decode_threshold}")
        max_tokens, max_reqs, max_model_len = (check_positive_int(name, v) for name, v in (
            ("max_tokens", max_tokens), ("max_reqs", max_reqs), ("max_model_len", max_model_len)))
        if max_model_len >= 2**31:  # positions and lengths are int32
            raise ValueError(f"max_model_len must be below 2^31 (positions are int32), got {max_model_len}")
        if isinstance(kinds, str) or not (tuple(kinds) == ("dsa",) or ("swa" in kinds and set(kinds) <= set(WINDOWED_KINDS))):
            raise ValueError(f"kinds must be V4 kinds including 'swa' (or V4.1's: from {WINDOWED_KINDS}) or V3.2's "
                             f"('dsa',), got {kinds!r}")
        _check_per_kind("block_sizes", block_sizes, kinds, 1)
        _check_per_kind("num_blocks", num_blocks, kinds, 0)
        self.num_blocks = dict(num_blocks or {})
        self.max_tokens, self.max_reqs, self.max_model_len = max_tokens, max_reqs, max_model_len
        self.kinds = tuple(kinds)
        self.block_sizes = {k: (block_sizes or {}).get(k, DEFAULT_BLOCK_SIZE[k]) for k in self.kinds}
        self.decode_threshold = decode_threshold
        self.device = check_device("device", device)
        i32 = dict(dtype=torch.int32, device=self.device)
        self._seq_lens = torch.zeros(max_reqs, **i32)
        self._query_lens = torch.zeros(max_reqs, **i32)
        self._query_start_loc = torch.zeros(max_reqs + 1, **i32)
        self._positions = torch.full((max_tokens,), -1, **i32)
        self._token_to_req = torch.full((max_tokens,), -1, **i32)
        self._slot_mapping = torch.full((max_tokens,), -1, **i32)
        self.max_blocks = {k: blocks_needed(max_model_len, k, self.block_sizes[k]) for k in self.kinds}
        self._tables = {k: torch.full((max_reqs, max(1, self.max_blocks[k])), -1, **i32) for k in self.kinds}
        self.builds = 0  # how many steps build() has filled the buffers with (StepBatch.build_number)

    def _check(self, requests: Sequence[Request]) -> tuple[int, dict[str, tuple[torch.Tensor, int]]]:
        if not isinstance(requests, Sequence) or isinstance(requests, (str, bytes)):
            raise TypeError(f"requests must be a list (or tuple) of Request, decodes first, got "
                            f"{type(requests).__name__}: pass list(...) of it")
        if not 0 < len(requests) <= self.max_reqs:
            raise ValueError(f"requests must hold 1 to {self.max_reqs} requests, got {len(requests)}")
        num_decodes, seen_prefill = 0, False
        needs = {kind: [] for kind in self.kinds}  # each request's blocks a kind, for _table_rows
        for r, req in enumerate(requests):
            if not isinstance(req, Request):
                raise TypeError(f"requests[{r}] must be a Request, got {type(req).__name__}")
            if not isinstance(req.block_tables, Mapping):
                raise TypeError(f"request {r}: block_tables must be a dict of cache kind -> block numbers, got "
                                f"{req.block_tables!r}")
            if not (is_int(req.seq_len) and is_int(req.query_len)):
                raise ValueError(f"request {r}: seq_len and query_len must be ints, got {req.seq_len!r}, "
                                 f"{req.query_len!r}")
            if not 1 <= req.query_len <= req.seq_len:
                raise ValueError(f"request {r}: query_len {req.query_len} must be in [1, seq_len={req.seq_len}]")
            if req.seq_len > self.max_model_len:
                raise ValueError(f"request {r}: seq_len {req.seq_len} exceeds max_model_len {self.max_model_len}")
            is_decode = req.query_len <= self.decode_threshold
            if is_decode and seen_prefill:
                raise ValueError(f"request {r} (query_len {req.query_len} <= decode_threshold {self.decode_threshold}) "
                                 f"is a decode after a prefill: decodes must come first")
            seen_prefill |= not is_decode
            num_decodes += is_decode
            for kind in self.kinds:
                table = req.block_tables.get(kind)
                need = _blocks_for(req.seq_len, COMPRESS_RATIO[kind], self.block_sizes[kind])
                needs[kind].append(need)
                if table is None:
                    raise ValueError(f"request {r}: block_tables has no {kind!r} table (keys: {sorted(req.block_tables)}); "
                                     f"every kind in {self.kinds} needs one, empty while seq_len needs no block")
                if not _is_table_container(table):  # a set or dict view has no order: blocks in hash order
                    raise TypeError(f"request {r}: block_tables[{kind!r}] must be a list of block numbers, got "
                                    f"{table!r} (or a 1-D array / tensor of an integer dtype int64 holds)")
                if len(table) < need:
                    raise ValueError(f"request {r}: block table for {kind!r} has {len(table)} "
                                     f"blocks, seq_len {req.seq_len} needs {need}")
                if len(table) > self._tables[kind].shape[1]:
                    raise ValueError(f"request {r}: block table for {kind!r} has {len(table)} blocks, more than "
                                     f"max_model_len {self.max_model_len} needs ({self._tables[kind].shape[1]})")
            self._check_shared_prefix(r, req)
        total = sum(req.query_len for req in requests)
        if total > self.max_tokens:
            raise ValueError(f"requests hold {total} new tokens, more than max_tokens={self.max_tokens}")
        return num_decodes, {kind: self._table_rows(kind, requests, needs[kind]) for kind in self.kinds}

    def _check_shared_prefix(self, r: int, req: Request) -> None:
        """Request ``r``'s ``shared_prefix_blocks``: known kinds, each an int from 0 to the blocks its table holds
        before the first entry the step writes (all its ``seq_len`` needs when it writes none)."""
        shared = req.shared_prefix_blocks
        if not isinstance(shared, Mapping):
            raise TypeError(f"request {r}: shared_prefix_blocks must be a dict of cache kind -> int, got {shared!r}")
        for kind, count in shared.items():
            if kind not in self.kinds:
                raise ValueError(f"request {r}: shared_prefix_blocks has {kind!r}, not among kinds {self.kinds}")
            ratio, bs = COMPRESS_RATIO[kind], self.block_sizes[kind]
            first, end = (complete_entries(n, ratio) for n in (req.seq_len - req.query_len, req.seq_len))  # written
            most = first // bs if end > first else blocks_needed(req.seq_len, kind, bs)
            if not (is_int(count) and 0 <= count <= most):
                written = f"; this step writes its entry {first}, in block {first // bs}" if end > first else ""
                raise ValueError(f"request {r}: shared_prefix_blocks[{kind!r}] must be an int in [0, {most}] (shared "
                                 f"blocks are read-only{written}), got {count!r}")

    def _table_rows(self, kind: str, requests: Sequence[Request], needs: list[int]) -> tuple[torch.Tensor, int]:
        """The requests' ``kind`` block tables as ``(n, width)`` int32 rows padded with -1, checked in one
        pass over the whole step: the blocks a request's ``seq_len`` needs (``needs``) must be ints >= 0 whose slots
        fit int32 and, with ``num_blocks``, lie inside the cache; no block may hold two ranges of entries
        (:func:`_check_aliasing`)."""
        width, bs = self._tables[kind].shape[1], self.block_sizes[kind]
        tables = [r.block_tables[kind] for r in requests]
        lens = np.fromiter(map(len, tables), dtype=np.int64, count=len(tables))
        arrays = _host_arrays(tables)
        if arrays is not None:  # integer arrays (their dtype checked: _is_table_container): one concatenation
            values = np.concatenate(arrays).astype(np.int64, copy=False) if arrays else np.empty(0, np.int64)
        else:  # lists (arrays among them as lists): one pass over the entries' types, one numpy copy of them all
            # (3-4x faster than torch.tensor of the padded rows)
            tables = [t.tolist() if isinstance(t, (np.ndarray, torch.Tensor)) else t for t in tables]
            if not all(_is_int_type(t) for t in set(map(type, chain.from_iterable(tables)))):
                r = next(i for i, t in enumerate(tables) if not all(_is_int_type(e) for e in set(map(type, t))))
                raise TypeError(f"request {r}: block table for {kind!r} must hold int block numbers (a bool or float "
                                f"would be taken as one; a tensor's entries: .tolist()), got {list(tables[r])[:8]}")
            try:
                values = np.fromiter(chain.from_iterable(tables), dtype=np.int64, count=int(lens.sum()))
            except OverflowError:  # past int64: surely past int32's slots
                r = next(i for i, t in enumerate(tables) if any(not -2**63 <= b < 2**63 for b in t))
                raise ValueError(f"request {r}: block table for {kind!r} holds a block number past int64") from None
        rows_np = np.full((len(tables), width), -1, dtype=np.int64)
        rows_np[np.arange(width)[None, :] < lens[:, None]] = values  # row-major: the tables' entries in order
        rows = torch.from_numpy(rows_np)
        need = torch.tensor(needs)
        used = torch.arange(width)[None, :] < need[:, None]
        checks = [(rows < 0, "holds a negative block number"),
                  (rows > 2**31 // bs - 1, f"holds a block number whose slots (block * {bs} + offset) pass int32")]
        limit = self.num_blocks.get(kind)
        if limit is not None:
            checks.append((rows >= limit, f"holds block {{b}}, past the cache's num_blocks[{kind!r}]={limit}"))
        for bad, what in checks:
            bad &= used
            if bool(bad.any()):
                r, c = (int(i) for i in bad.nonzero()[0])
                raise ValueError(f"request {r}: block table for {kind!r} " + what.format(b=int(rows[r, c])))
        # the rows hold the blocks each seq_len needs, -1 after them: a longer table's other entries are not read
        # (nor checked: their int32 cast could have made any of them a real block)
        used_rows = torch.where(used, rows, -1)
        largest = int(used_rows.max()) if rows.numel() else -1
        _check_aliasing(kind, used_rows, [r.shared_prefix_blocks.get(kind, 0) for r in requests], largest)
        return used_rows.to(torch.int32), largest

    def table_buffer(self, kind: str) -> torch.Tensor:
        """The ``kind`` block table's buffer, ``(max_reqs, max_blocks)``: every build's tables are its first rows."""
        return self._tables[kind]

    def build(self, requests: Sequence[Request]) -> StepBatch:
        """Fill the buffers from ``requests`` (decodes first) and return views of them."""
        num_decodes, table_rows = self._check(requests)
        self.builds += 1
        n = len(requests)
        seq_host = [int(r.seq_len) for r in requests]
        qlen_host = [int(r.query_len) for r in requests]
        qsl_host = [0]
        for q in qlen_host:
            qsl_host.append(qsl_host[-1] + q)
        num_tokens = qsl_host[-1]
        upload(self._seq_lens[:n], seq_host)
        upload(self._query_lens[:n], qlen_host)
        upload(self._query_start_loc[: n + 1], qsl_host)
        for kind, (rows, _) in table_rows.items():
            upload(self._tables[kind][:n], rows)
        dev_qsl, dev_seq, dev_q = self._query_start_loc[: n + 1], self._seq_lens[:n], self._query_lens[:n]
        tok = torch.arange(num_tokens, device=self.device, dtype=torch.int32)
        req_of_tok = torch.repeat_interleave(torch.arange(n, device=self.device, dtype=torch.int32), dev_q.long(),
                                             output_size=num_tokens)
        r64 = req_of_tok.long()
        pos = (dev_seq - dev_q)[r64] + tok - dev_qsl[r64]
        for buf in (self._positions, self._token_to_req, self._slot_mapping):
            buf[num_tokens:].fill_(-1)
        self._positions[:num_tokens] = pos
        self._token_to_req[:num_tokens] = req_of_tok
        raw = "dsa" if "dsa" in self.kinds else "swa"
        self._slot_mapping[:num_tokens] = slots_of(self._tables[raw], req_of_tok, pos, self.block_sizes[raw])
        return StepBatch(
            num_reqs=n, num_decodes=num_decodes, num_decode_tokens=qsl_host[num_decodes], num_tokens=num_tokens,
            seq_lens=dev_seq, query_lens=dev_q, query_start_loc=dev_qsl, positions=self._positions,
            token_to_req=self._token_to_req, slot_mapping=self._slot_mapping,
            block_tables={k: self._tables[k][:n] for k in self.kinds}, block_sizes=dict(self.block_sizes),
            max_model_len=self.max_model_len, decode_threshold=self.decode_threshold,
            seq_lens_host=seq_host, query_lens_host=qlen_host, query_start_loc_host=qsl_host,
            builder=self, build_number=self.builds, max_block={k: m for k, (_, m) in table_rows.items()})


def _check_aliasing(kind: str, rows: torch.Tensor, shared: list[int], largest: int) -> None:
    """No block of the ``kind`` cache holds two ranges of entries: within a request every used block is distinct,
    and a block two requests use lies in both requests' shared (read-only) prefixes. Every block used once (the
    step without shared prefixes) is one count of the used blocks; else one sort of them by ``(block, request)``,
    which puts a block's uses side by side.

    rows: ``(n, width)`` int64 block numbers of the entries each request's seq_len needs, ``-1`` elsewhere; shared:
    each request's ``shared_prefix_blocks`` count of this kind; largest: the largest block number in ``rows``.
    """
    # a count per block number costs memory in proportion to the largest: only where that stays near the table size
    if largest < 4 * rows.numel() + 65536 and int(torch.bincount(rows.flatten() + 1, minlength=2)[1:].max()) < 2:
        return
    used = rows >= 0
    blocks, num_reqs = rows[used], rows.shape[0]
    req = torch.arange(num_reqs)[:, None].expand_as(rows)[used]
    shared = (torch.arange(rows.shape[1])[None, :] < torch.tensor(shared)[:, None])[used]
    order = torch.argsort(blocks * num_reqs + req)
    blocks, req, shared = blocks[order], req[order], shared[order]
    same = blocks[1:] == blocks[:-1]
    twice = same & (req[1:] == req[:-1])
    if bool(twice.any()):
        i = int(twice.nonzero()[0])
        raise ValueError(f"request {int(req[i])}: block table for {kind!r} names block {int(blocks[i])} twice: two "
                         f"ranges of its entries would share that block's slots (the later write overwrites the "
                         f"earlier)")
    clash = same & ~(shared[1:] & shared[:-1])
    if bool(clash.any()):
        i = int(clash.nonzero()[0])
        first, second = int(req[i]), int(req[i + 1])
        writer = first if not bool(shared[i]) else second
        raise ValueError(f"requests {first} and {second} both use block {int(blocks[i])} of the {kind!r} cache, "
                         f"outside request {writer}'s shared_prefix_blocks: requests may share only read-only "
                         f"prefix blocks that each declares in shared_prefix_blocks")


def _check_per_kind(name: str, values: Mapping[str, int] | None, kinds: Sequence[str], least: int) -> None:
    """``values`` (optional) maps some of ``kinds`` to ints of at least ``least``."""
    if values is None:
        return
    if not isinstance(values, Mapping):
        raise TypeError(f"{name} must be a dict of cache kind -> int, got {type(values).__name__}")
    for kind, value in values.items():
        if kind not in kinds:
            raise ValueError(f"{name} has a value for {kind!r}, which is not among kinds {tuple(kinds)}")
        if not is_int(value) or value < least:
            raise ValueError(f"{name}[{kind!r}] must be an int >= {least}, got {value!r}")


def _is_int_tensor(value: object) -> bool:
    """An integer tensor (not bool, float or complex)."""
    return (isinstance(value, torch.Tensor) and value.dtype != torch.bool and not value.is_floating_point()
            and not value.is_complex())


def _host_arrays(tables: list) -> list[np.ndarray] | None:
    """``tables`` as numpy arrays where every one is a numpy array or a CPU tensor (views, no copy), else None (a
    list among them, or a tensor on a device: read as lists)."""
    arrays = []
    for t in tables:
        if isinstance(t, np.ndarray):
            arrays.append(t)
        elif isinstance(t, torch.Tensor) and t.device.type == "cpu":
            arrays.append(t.resolve_neg().numpy())  # (a negated view's values, not its stored ones)
        else:
            return None
    return arrays


def _is_table_container(table: object) -> bool:
    """A block table holds its blocks in order: a sequence (list, tuple, range), or a 1-D array / tensor of an integer
    dtype that int64 holds (uint64 would wrap)."""
    if type(table) in (list, tuple, range):  # (the usual tables, before the Sequence ABC's slower test)
        return True
    if isinstance(table, np.ndarray):  # (a masked array's hidden values are no blocks)
        return table.ndim == 1 and _is_block_dtype(table.dtype) and not isinstance(table, np.ma.MaskedArray)
    if isinstance(table, torch.Tensor):  # (a meta tensor has no values to read)
        return (table.dim() == 1 and _is_int_tensor(table) and table.dtype != torch.uint64
                and table.device.type != "meta")
    return isinstance(table, Sequence) and not isinstance(table, (str, bytes))


@functools.cache
def _is_block_dtype(dtype: np.dtype) -> bool:
    """A numpy integer dtype int64 holds (a cache: the test costs microseconds, a step asks it of every table)."""
    return np.issubdtype(dtype, np.integer) and np.can_cast(dtype, np.int64)


@functools.cache
def _is_int_type(t: type) -> bool:
    return issubclass(t, numbers.Integral) and not issubclass(t, bool)


def upload(dst: torch.Tensor, values: list[int] | torch.Tensor) -> None:
    """``dst`` (int32, on the step's device) := ``values`` (host ints, or a CPU tensor of dst's shape) without a host
    sync: on a GPU through pinned memory and a copy queued on the stream (a blocking copy from pageable memory is a
    ``cudaStreamSynchronize``: an engine could not queue a step's host work while the GPU ran the one before). The
    caching host allocator keeps the pinned block until its copy has run. A CPU tensor already pinned is copied from
    as it is: the caller must not change it before the copy has run."""
    if not dst.is_cuda:
        dst.copy_(values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=torch.int32))
    elif isinstance(values, torch.Tensor):
        dst.copy_(values.pin_memory(), non_blocking=True)
    else:
        dst.copy_(torch.tensor(values, dtype=torch.int32, pin_memory=True), non_blocking=True)


def slots_of(table: torch.Tensor, req: torch.Tensor, entry: torch.Tensor, block_size: int) -> torch.Tensor:
    """Slots of cache entries: ``table[req, entry // bs] * bs + entry % bs``; ``-1`` where ``entry < 0``,
    where the entry lies past the table, or where the table holds ``-1``.

    table: ``(num_reqs, max_blocks)`` int32; req, entry: int32 or int64 tensors (req broadcastable to entry).
    """
    check_positive_int("block_size", block_size)
    ok = entry >= 0
    e = torch.where(ok, entry, 0).long()
    r = req.long().expand_as(e)
    col = e // block_size
    inside = col < table.shape[1]
    phys = table[r, col.clamp_max(table.shape[1] - 1)]
    slot = phys * block_size + (e % block_size).to(torch.int32)
    return torch.where(ok & inside & (phys >= 0), slot, -1).to(torch.int32)
