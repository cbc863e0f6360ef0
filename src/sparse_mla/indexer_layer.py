"""SparseMLAIndexer: one layer's lightning indexer over the paged key cache, beside :class:`SparseMLAAttention`.

Per step and layer (the engine loop, docs/indexer.md): the compressors insert the step's new entries into the key
cache, :meth:`SparseMLAIndexer.forward` turns the layer's indexer queries and head weights into picks, and the
attention layer takes them unchanged (``attn(..., topk_indices=picks)``, through :meth:`StepMetadata.picks_for`).

Planned once per step (:meth:`StepMetadata.plan`, shared by the layers of one configuration): the token chunks that
keep the packed scores within ``workspace_bytes``, the workspace and the picks buffer. The Triton path (CUDA, or the
interpreter) makes no host sync and allocates nothing after the plan, so a decode step is CUDA-graph capturable; the
reference path (the CPU default) is plain PyTorch and syncs.

V4.1 (:func:`indexer_role`): the layers of ``index_source_layer_ids`` run their indexer, over the key cache of the
latest kv source; the layers between reuse the latest picks. From the last kv source on, the last kv source selects
the top 2048 blocks of 8 entries (``forward(..., select_blocks=True)``) and it and every later source pick inside
them (``kept_blocks=``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ._checks import check_finite, check_positive_int, check_tensor
from .batch import StepBatch
from .config import COMPRESS_RATIO, PICKS_KINDS, ModelConfig
from .indexer import (KEPT_BLOCKS, MAX_SELECT_COLS, SELECT_SEGMENT, IndexerSpec, StepTokens, check_scores_finite,
                      index_topk_reference, prepare_queries, select_kernel_takes, top_blocks_reference,
                      written_columns)
from .indexer_cache import INDEX_FORMATS, IndexerKeyCache
from .metadata import StepMetadata
from .ops import targets
from .ops.dispatch import check_backend_name, resolve_backend
from .ops.validate import debug_checks_enabled
from .picks import step_picks
from .rope import RopeSpec

DEFAULT_INDEXER_WORKSPACE_BYTES = 256 << 20  # the scores of one token chunk (int64 packed keys, or int32 words)
TOPK_SELECTS = ("auto", "triton", "torch")


@dataclass
class IndexerPlan:
    """One step's indexer plan for one configuration: the token tensors, the column count of the packed scores
    (``num_cols``, a multiple of 64, at least topk), the token chunks ``[(t0, t1, max_query_len)]`` of packed keys and
    (``word_chunks``) of words, twice as long (:meth:`scores`), the workspace ``(rows, num_cols)`` int64, the output
    buffers ``picks (T_cap, topk)`` / ``kept (T_cap, 2048)`` int32, and (Triton) the prepared queries ``q (T_cap, H,
    128)`` in the dot dtype, weights ``w (T_cap, H)`` float32 and the rope's ``cos`` / ``sin`` ``(T_cap, 32)`` at the
    step's positions (once per step, for every layer)."""

    step: StepTokens
    num_cols: int
    chunks: list[tuple[int, int, int]]
    workspace: torch.Tensor | None
    picks: torch.Tensor
    kept: torch.Tensor
    q: torch.Tensor | None = None
    w: torch.Tensor | None = None
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None
    word_chunks: list[tuple[int, int, int]] | None = None

    def replay_mismatch(self, batch: StepBatch) -> str | None:
        """Why a CUDA graph captured with this plan cannot replay ``batch`` (None: it can). Its launches were sized
        on the host from the capturing step: ``num_cols`` from its longest request, each chunk's grid from its
        longest run of one request's tokens; a batch past either would be scored short, silently
        (:meth:`sparse_mla.graphs.StepGraph.replay` asks every plan of the captured step)."""
        ratio = self.step.ratio
        entries = max((s // ratio for s in batch.seq_lens_host), default=0)
        if entries > self.num_cols:
            return (f"a request sees {entries} entries, the captured indexer scores {self.num_cols} a row: capture "
                    f"another graph")
        captured = self.chunks + (self.word_chunks or [])
        if max(batch.query_lens_host, default=0) <= min((longest for _, _, longest in captured), default=0):
            return None  # no request has more tokens than any chunk's grid takes (every decode step of its shape)
        qsl = batch.query_start_loc_host
        for t0, t1, longest in captured:
            if _longest_run(qsl, batch.num_reqs, t0, t1) > longest:
                return (f"tokens [{t0}, {t1}) hold a request's run longer than the captured {longest}: capture "
                        f"another graph")
        return None

    def chunks_for(self, words: bool) -> list[tuple[int, int, int]]:
        """The token chunks of scores as words (:attr:`word_chunks`) or as packed keys (:attr:`chunks`)."""
        return self.word_chunks if words else self.chunks

    def scores(self, rows: int, words: bool) -> torch.Tensor:
        """The workspace's first ``rows`` rows of scores: packed keys ``(rows, num_cols)`` int64, or (``words``)
        the score kernel's words ``(rows, num_cols)`` int32, rows back to back (twice the packed rows fit)."""
        return (self.workspace.view(torch.int32).view(-1, self.num_cols) if words else self.workspace)[:rows]


def _longest_run(qsl: list[int], num_reqs: int, t0: int, t1: int) -> int:
    """The most tokens one request has in ``[t0, t1)`` (``qsl``: the step's query start offsets, host ints)."""
    return max(min(qsl[r + 1], t1) - max(qsl[r], t0) for r in range(num_reqs))


@dataclass(frozen=True)
class IndexerRole:
    """What layer ``layer`` of a model does with the indexer: ``runs`` (its own indexer) or reuses the picks of
    ``index_source``; the key cache it scores is ``kv_source``'s; ``two_level``: ``"off"``, ``"select"`` (V4.1's last
    kv source: choose the kept blocks and pick inside them) or ``"inside"`` (pick inside the kept blocks)."""

    runs: bool
    index_source: int
    kv_source: int
    two_level: str


def indexer_role(config: ModelConfig, layer: int) -> IndexerRole | None:
    """The indexer role of ``layer`` (None: a layer without picks). V4 / V3.2: every picks layer runs its own
    indexer over its own keys. V4.1: :class:`IndexerRole` as the module docstring says."""
    if not isinstance(config, ModelConfig):
        raise TypeError(f"config must be a ModelConfig (get_config), got {type(config).__name__}")
    source = config.index_source_layer(layer)
    if source is None:
        return None
    kv = config.kv_source_layer(source) if config.kv_source_layer_ids else source
    two_level = "off"
    if config.family == "v4.1" and config.kv_source_layer_ids:
        last_kv = max(config.kv_source_layer_ids)
        if source >= last_kv:
            two_level = "select" if source == last_kv else "inside"
    return IndexerRole(runs=source == layer, index_source=source, kv_source=kv, two_level=two_level)


class SparseMLAIndexer(torch.nn.Module):
    """The lightning indexer of one layer kind.

    kind: the layer kind it picks for (``c4a``, ``c2a``, ``c1a``: local entries; ``dsa``: raw positions); num_heads:
    its heads (H_I, 1-128: 64 V4 / V3.2, 32 V4.1); topk: picks per token; rope: its queries' rope (default: the
    kind's, see :class:`IndexerSpec`); q_format: ``"fp8"`` (per (token, head) power-of-two scales folded into the
    weights) or ``"bf16"``; key_format: if given, the key cache must hold it; backend: ``"auto"``, ``"reference"``
    or ``"triton"``; workspace_bytes: the score budget of one token chunk (an int64 packed key per token and entry;
    where the layer scores as words, :meth:`scores_as_words`, an int32 word: twice the tokens a chunk); topk_select
    (Triton backend): ``"triton"`` (the select kernel; picks in entry order) or ``"torch"`` (``torch.topk`` over the
    packed rows; best first); ``"auto"``: the kernel. A topk of a segment or more (``SELECT_SEGMENT``, 8,192) always
    takes ``torch.topk``: the kernel's segments could not shorten a long row.
    """

    def __init__(self, kind: str, num_heads: int, topk: int, *, rope: RopeSpec | None = None, q_format: str = "fp8",
                 key_format: str | None = None, backend: str = "auto",
                 workspace_bytes: int = DEFAULT_INDEXER_WORKSPACE_BYTES, topk_select: str = "auto") -> None:
        super().__init__()
        if kind not in PICKS_KINDS:
            raise ValueError(f"kind must be one of {PICKS_KINDS}, got {kind!r}")
        self.spec = IndexerSpec(num_heads=num_heads, topk=check_positive_int("topk", topk), kind=kind, rope=rope,
                                q_format=q_format)
        if key_format is not None and key_format not in INDEX_FORMATS:
            raise ValueError(f"key_format must be None or one of {INDEX_FORMATS}, got {key_format!r}")
        check_backend_name(backend)
        self.key_format, self.backend = key_format, backend
        self.workspace_bytes = check_positive_int("workspace_bytes", workspace_bytes)
        if topk_select not in TOPK_SELECTS:
            raise ValueError(f"topk_select must be one of {TOPK_SELECTS}, got {topk_select!r}")
        self.topk_select = topk_select

    @property
    def kind(self) -> str:
        return self.spec.kind

    @property
    def topk(self) -> int:
        return self.spec.topk

    def _check(self, meta: StepMetadata, q: torch.Tensor, weights: torch.Tensor, cache: IndexerKeyCache) -> None:
        if not isinstance(meta, StepMetadata):
            raise TypeError(f"meta must be a StepMetadata, got {type(meta).__name__}")
        meta.batch.check_current()
        if self.kind not in meta.batch.block_tables:
            raise ValueError(f"meta's batch has no {self.kind!r} block table (kinds {meta.batch.kinds}): build it "
                             f"with the kind whose cache the key cache shares its blocks with")
        if not isinstance(cache, IndexerKeyCache):
            raise TypeError(f"cache must be an IndexerKeyCache, got {type(cache).__name__}")
        if self.key_format is not None and cache.fmt != self.key_format:
            raise ValueError(f"cache holds {cache.fmt} keys, this indexer was configured for {self.key_format}")
        if cache.block_size != meta.batch.block_sizes[self.kind]:
            raise ValueError(f"cache.block_size ({cache.block_size}) must equal the {self.kind} cache's block size "
                             f"({meta.batch.block_sizes[self.kind]}): the two share their block numbers")
        if meta.batch.device != cache.device:
            raise ValueError(f"cache must be on the step's device {meta.batch.device}, got {cache.device}")
        meta.batch.check_cache_holds_blocks(self.kind, cache.num_blocks, "cache")
        cap, heads = meta.batch.token_capacity, self.spec.num_heads
        floats = (torch.bfloat16, torch.float16, torch.float32)
        check_tensor("q", q, dtype=floats, shape=(cap, heads, 128), device=cache.device)
        check_tensor("weights", weights, dtype=floats, shape=(cap, heads), device=cache.device)

    def step_plan(self, meta: StepMetadata, backend: str, key_format: str = "fp8") -> IndexerPlan:
        """This step's :class:`IndexerPlan` for ``backend`` (``"reference"`` or ``"triton"``) and keys in
        ``key_format``, made on first use and shared by the indexers of this configuration (heads, top-k, kind, rope,
        query format, workspace)."""
        if not isinstance(meta, StepMetadata):
            raise TypeError(f"meta must be a StepMetadata, got {type(meta).__name__}")
        if backend not in ("reference", "triton"):
            raise ValueError(f"backend must be 'reference' or 'triton', got {backend!r}")
        if key_format not in INDEX_FORMATS:
            raise ValueError(f"key_format must be one of {INDEX_FORMATS}, got {key_format!r}")
        key = ("indexer", self.kind, self.topk, self.spec.num_heads, self.spec.rope_spec, self.spec.q_format, backend,
               self.workspace_bytes, key_format)
        return meta.plan(key, lambda: self._plan(meta, backend, key_format))

    def _plan(self, meta: StepMetadata, backend: str, key_format: str) -> IndexerPlan:
        batch = meta.batch
        ratio = COMPRESS_RATIO[self.kind]
        step = StepTokens.of(batch, self.kind)
        most = max((s // ratio for s in batch.seq_lens_host), default=0)
        num_cols = max(-(-most // 64) * 64, -(-self.topk // 64) * 64, 64)
        if num_cols > MAX_SELECT_COLS:  # the Triton select's segments
            num_cols = -(-num_cols // SELECT_SEGMENT) * SELECT_SEGMENT
        cap = batch.token_capacity
        dev = batch.device
        picks = torch.full((cap, self.topk), -1, dtype=torch.int32, device=dev)
        kept = torch.full((cap, KEPT_BLOCKS), -1, dtype=torch.int32, device=dev)
        if backend == "reference":
            return IndexerPlan(step, num_cols, [], None, picks, kept)
        qsl = batch.query_start_loc_host

        rows = max(1, min(batch.num_tokens, self.workspace_bytes // (8 * num_cols)))  # packed keys: 8 B an entry

        def chunks_of(rows: int) -> list[tuple[int, int, int]]:  # the step's tokens, ``rows`` at most a chunk
            chunks = []
            for t0 in range(0, batch.num_tokens, rows):
                t1 = min(batch.num_tokens, t0 + rows)
                chunks.append((t0, t1, max(1, _longest_run(qsl, batch.num_reqs, t0, t1))))
            return chunks

        chunks = chunks_of(rows)
        workspace = torch.empty(rows, num_cols, dtype=torch.int64, device=dev)
        from .ops.triton import indexer as kernels  # Triton is imported only where it runs

        heads = self.spec.num_heads
        dot = kernels.dot_dtype_for(targets.target_of(dev), key_format, self.spec.q_format)
        q = torch.empty(cap, heads, 128, dtype=dot, device=dev)
        w = torch.empty(cap, heads, dtype=torch.float32, device=dev)
        angles = step.positions.clamp_min(0).float()[:, None] * self.spec.rope_spec.inv_freq(dev)  # as cos_sin
        return IndexerPlan(step, num_cols, chunks, workspace, picks, kept, q, w, angles.cos(), angles.sin(),
                           chunks_of(2 * rows))  # words: 4 B an entry, twice the rows in the same workspace

    def forward(self, meta: StepMetadata, q: torch.Tensor, weights: torch.Tensor, cache: IndexerKeyCache, *,
                kept_blocks: torch.Tensor | None = None, select_blocks: bool = False
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """This step's picks: ``(T_cap, topk)`` int32, each token's best visible entries (best first; the Triton
        select lists them in entry order), ``-1`` fill, padding rows all ``-1``, in this step's buffer: the next call
        of an indexer of the same configuration overwrites it (hand it to the attention first).

        meta: the step's :class:`StepMetadata` (its batch has the ``kind`` block table the key cache shares);
        q: ``(T_cap, H, 128)`` the indexer's queries before rope (``W_q^I · qr``); weights: ``(T_cap, H)`` the raw
        head weights (``W_w h``); cache: the layer's :class:`IndexerKeyCache` (V4.1: its kv source's).
        select_blocks (V4.1's last kv source): also return the kept blocks ``(T_cap, 2048)`` int32, picking inside
        them; kept_blocks (later sources): pick only inside these (a block number outside ``[0, blocks)`` selects
        nothing, like ``-1``: its values are not checked, which would sync). q and weights of the step's tokens must
        be finite, and so must the scores they give (a finite q or weight near float32's range can overflow the rope
        or a score): checked on the reference backend, and with ``SPARSE_MLA_DEBUG=1`` on the kernels (a sync;
        without it a token with a NaN or infinite score gets picks the reference would not give).
        """
        self._check(meta, q, weights, cache)
        if not isinstance(select_blocks, bool):
            raise TypeError(f"select_blocks must be a bool, got {type(select_blocks).__name__}")
        if select_blocks and kept_blocks is not None:
            raise ValueError("select_blocks and kept_blocks exclude each other: select the blocks, or pick inside "
                             "given ones")
        backend = resolve_backend(self.backend, cache.device)
        if backend == "reference" or debug_checks_enabled():  # values: a sync (docs/checks.md)
            n = meta.batch.num_tokens  # padding rows may hold anything
            check_finite("q", q[:n])
            check_finite("weights", weights[:n])
        plan = self.step_plan(meta, backend, cache.fmt)
        if kept_blocks is not None:
            check_tensor("kept_blocks", kept_blocks, dtype=torch.int32, shape=(plan.picks.shape[0], None),
                         device=cache.device)
        if backend == "reference":
            q_ready, w_ready = prepare_queries(q, weights, meta.batch.positions, self.spec)
            if select_blocks:
                plan.kept.copy_(top_blocks_reference(q_ready, w_ready, cache, plan.step))
                kept_blocks = plan.kept
            plan.picks.copy_(index_topk_reference(q_ready, w_ready, cache, plan.step, self.topk, kept_blocks))
        else:
            self._triton(meta, plan, q, weights, cache, kept_blocks, select_blocks)
        return (plan.picks, plan.kept) if select_blocks else plan.picks

    def _kernel_select(self) -> bool:
        """Whether the Triton select picks (else ``torch.topk`` over the packed rows)."""
        return self.topk_select != "torch" and select_kernel_takes(self.topk)

    def scores_as_words(self, plan: IndexerPlan, two_level: bool = False) -> bool:
        """Whether a Triton call with ``plan`` scores its tokens as words (``ops.triton.indexer``: half the bytes of
        packed keys, read contiguously by the select) and chunks them by ``plan.word_chunks``: where the Triton select
        picks (rows longer than ``MAX_SELECT_COLS`` too: its first pass over their segments packs the winners' keys
        from the words) and no V4.1 block restriction (``two_level``: ``select_blocks`` or ``kept_blocks``) works on
        the packed keys, whatever the dot. An H200, the two formats alternating in one process, packed -> words, us a
        layer (docs/history.md version 34): V4-Flash B 128 87.8 -> 84.3 on the e4m3 dot, 243.5 -> 240.2 under the
        sm_80 lowering (the bf16 dot); V4.1-Flash B 128 146.1 -> 139.5 and 275.9 -> 272.7; the 4K prefill chunk 1,133
        -> 1,083 and 3,933 -> 3,865; rows of segments (version 39, Triton 3.6): B 8 at 512K 96.9 -> 89.2, V3.2 B 32
        99.0 -> 92.8."""
        triton_plan = plan.q is not None  # the reference's plan has no prepared queries
        return triton_plan and self._kernel_select() and not two_level

    def _triton(self, meta: StepMetadata, plan: IndexerPlan, q: torch.Tensor, w: torch.Tensor,
                cache: IndexerKeyCache, kept_blocks: torch.Tensor | None, select_blocks: bool) -> None:
        from .ops.triton import indexer as kernels  # Triton is imported only where it runs

        kernels.check_kernel_cache(cache)  # before any launch (the rest: _check; the step and buffers: the plan's)
        q, w = q.contiguous(), w.contiguous()  # the prep kernel reads rows of H · 128 and H values (checked: _check)
        kernels.launch_prepare_queries(q, w, plan.cos, plan.sin, self.kind == "dsa", self.spec.q_format == "fp8",
                                       self.spec.weight_scale, plan.q, plan.w)
        q, w = plan.q, plan.w
        dot_dtype = q.dtype
        native_fp8 = targets.target_of(cache.device).native_fp8
        kernel_select = self._kernel_select()
        # the step's conversion of this kind's picks, written by the select in its own launch where it can (the
        # attention's call with these picks then launches no conversion: PicksConversion.selected)
        conversion = step_picks(meta, self.kind) if meta.spec.topk == self.topk else None
        fused = kernel_select and conversion is not None and conversion.takes_select
        words = self.scores_as_words(plan, select_blocks or kept_blocks is not None)
        chunks, capacity = plan.chunks_for(words), plan.picks.shape[0]
        finite = cache.finite_slots() if debug_checks_enabled() else None  # the debug check's written keys: once
        for i, (t0, t1, longest) in enumerate(chunks):
            packed = plan.scores(t1 - t0, words)
            kernels.launch_index_scores(q, w, cache, plan.step, packed, t0, t1, longest, dot_dtype, native_fp8)
            if finite is not None:  # values: a sync (docs/checks.md); the reference refuses these always
                written = written_columns(cache, plan.step, t0, t1, packed.shape[1], finite)  # (never written: not q's)
                check_scores_finite(kernels.scores_finite(packed, words, written))
            # the chunks cover the step's real tokens [0, num_tokens); padding rows keep the plan's -1
            if select_blocks:
                plan.kept[t0:t1] = kernels.top_blocks_from_packed(packed, plan.step.positions[t0:t1],
                                                                  plan.step.ratio, KEPT_BLOCKS)
                kernels.restrict_to_blocks(packed, plan.kept[t0:t1])
            elif kept_blocks is not None:
                kernels.restrict_to_blocks(packed, kept_blocks[t0:t1])
            if not kernel_select:
                plan.picks[t0:t1] = kernels.topk_from_packed(packed, self.topk)
            else:  # the last chunk's launch also writes the padding tokens' empty rows
                into = conversion.select_into(t0, (capacity if i == len(chunks) - 1 else t1) - t0) if fused else None
                # the plan's own buffers and the step conversion's (each made to fit): launched unchecked
                kernels.launch_topk_rows(packed, self.topk, plan.picks[t0:t1], into)
        if conversion is not None:
            conversion.selected(plan.picks if fused and chunks else None)
