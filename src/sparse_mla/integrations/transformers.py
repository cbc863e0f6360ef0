"""Run a Hugging Face ``DeepseekV4ForCausalLM`` / ``DeepseekV32ForCausalLM`` through sparse-mla.

``enable_sparse_mla(model, kv_format=..., device=...)`` registers the attention function
``"sparse_mla"`` in transformers' ``AttentionInterface`` and switches the model to it
(``set_attn_implementation``). The model keeps its own cache (it drives the compressors and the
indexers); sparse-mla keeps paged caches beside it, one per layer, filled each step from the
model's own latents and compressor outputs, and attends through :class:`SparseMLAAttention` over
index lists built from the indexer's picks (no dense mask). Everything is set up once per forward
(one :class:`StepBatch` + :class:`StepMetadata` shared by all layers, like an engine's step; decode steps refill
the last step's builder and metadata in place);
``generate()`` works as usual: a prefill step, then decode steps, for a batch of prompts of
different lengths (left-padded). Supported: transformers 5.23.0 and 5.24.0 (:data:`SUPPORTED_TRANSFORMERS`,
checked by :func:`enable_sparse_mla`: another version is a ``RuntimeError`` naming the supported ones).

5.24.0 renames the model's cache keyword and output field ``past_key_values`` to ``cache`` (the old name stays a
deprecated alias until 5.40) in ``deepseek_v4`` and ``deepseek_v32``; its DeepSeek attention, compressors, indexers
and masks are 5.23's otherwise (a few norms kept in float32). We read the cache under either name.

What HF does, read in transformers 5.23.0 (``models/deepseek_v4/modeling_deepseek_v4.py`` = V4,
``models/deepseek_v32/modeling_deepseek_v32.py`` = V3.2), and how it maps to sparse-mla:

* Extension points: ``DeepseekV4Attention.forward`` (V4 l. 857) and ``DeepseekV32Attention.forward``
  (V3.2 l. 460) call ``ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, eager)``; we
  register ours there. HF builds masks only for implementations registered in
  ``AttentionMaskInterface`` (``masking_utils.py`` l. 733, 841) and V3.2's indexer needs one (l. 439),
  so ``"sparse_mla"`` is registered there too: eager's additive mask for V3.2, none for V4 (our layer never
  reads it; HF's V4 attention takes ``None``).
  V4 hands the function ``q (B, H, S, 512)`` and ``kv`` = ``[the sliding-window cache's keys + the new
  ones | every compressed entry so far]`` (l. 836-843) with a dense mask; the compressed entries come
  from ``DeepseekV4{CSA,HCA}Compressor.forward`` and the picks from ``DeepseekV4Indexer.forward``, which
  we read with forward hooks (their outputs, untouched). V3.2 passes the indexer's picks itself as
  ``indices=`` to any implementation other than eager/sdpa (l. 444-458), with q and keys already
  expanded per head (``expand_kv``): we take the latents from ``kv_a_layernorm``'s output (a forward
  hook) and the rope half of the keys, and absorb q with :class:`Absorption`.
* Inverse rope (V4): HF rotates the rope dims of the attention output back by the query position
  (``apply_rotary_pos_emb(..., cos, -sin)``, l. 879) *after* the attention function returns; the
  sparse-mla layer returns the output before that rotation, so HF's module does it, here and in
  eager alike. We apply nothing.
* Repeated picks: HF turns picks into a mask (V4 ``block_bias.scatter_``, l. 712; V3.2
  ``index_mask ... .scatter``, l. 447-449), so an entry picked twice counts once. HF's own picks are a
  ``topk`` (distinct), so our layer (which attends to a repeated pick twice) sees the same keys.
* Invisible picks: V4's indexer replaces picks of entries not complete before the query with ``-1``
  (``(pos+1)//4`` threshold, l. 589-595), our ``c4a`` rule; V3.2's indexer takes
  ``min(index_topk, keys)`` over masked scores (l. 240), so while a row has fewer keys than
  ``index_topk`` it also picks future or padding keys, which the causal mask then drops; our ``dsa``
  layer drops picks after the query.
* Batched ``generate`` left-pads: the 2-D ``attention_mask`` is 0 on the pads and
  ``position_ids = cumsum(mask) - 1`` (``generation/utils.py`` l. 894-916), so a real token's
  position counts only real tokens. We build one request per batch row with ``seq_len`` = real
  tokens so far (``mask[b].sum()``) and ``query_len`` = real tokens this step (``mask[b, -S:].sum()``):
  our positions equal HF's ``position_ids`` (checked; a padded batch without ``position_ids`` is a
  ``ValueError``, since HF then gives the pads positions). Pad tokens are not in the batch (their
  output is 0, as HF's fully masked rows with a sink give). V3.2's picks index HF's padded key axis:
  we subtract the row's pads. V4's compressors pool *padded* token windows (entry ``w`` of a row with
  ``p`` pads covers its real positions ``4w-p …``; ``entry_count`` is shared by the batch, l. 216): we
  take HF's entries as they are and apply visibility ``(w+1)·r <= pos+1`` on the real position, as
  HF's prefill masks do (l. 446-453, 589). One HF quirk we do not copy: HCA in a decode step
  (``S == 1``) returns no mask (l. 443), so a left-padded row sees the entries of the *padded* length,
  ``(padded_pos+1)//128``; we keep ``(pos+1)//128``. The two differ only while a row's pads push its
  padded length across a multiple of 128 ahead of its real length.
* Caches: HF's ``DynamicCache`` (V4: ``DeepseekV4HCACache`` / ``DeepseekV4CSACache`` layers) still
  runs; our paged caches live in a state tied to that cache object (a new ``generate`` = a new cache
  = fresh blocks). The HF model is unchanged except for its attention implementation and hooks;
  :meth:`SparseMLAIntegration.remove` restores it.
"""
from __future__ import annotations

import types
import weakref
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import torch

from .._checks import check_device
from ..absorption import Absorption
from ..batch import Request, StepBatch, StepBatchBuilder, blocks_needed
from ..cache import PagedCache
from ..config import DEFAULT_BLOCK_SIZE
from ..graphs import StepGraph, sized_plans
from ..layer import SparseMLAAttention
from ..metadata import MetadataSpec, StepMetadata, build_step_metadata
from .hf_pipeline import INDEX_KEY_FORMATS, Pipeline, check_pipeline_config

# the releases whose DeepSeek V4 / V3.2 code this module was read against and is tested with (CI runs the tests on each)
SUPPORTED_TRANSFORMERS = ("5.23.0", "5.24.0")
# the names the model's cache goes by, the current one first: 5.24 renamed past_key_values (a deprecated alias)
CACHE_KEYWORDS = ("cache", "past_key_values")
ATTENTION_NAME = "sparse_mla"
V4_KINDS = {"sliding_attention": "swa", "compressed_sparse_attention": "c4a", "heavily_compressed_attention": "c128a"}
KV_FORMATS = {"v4": ("bf16", "fp8_v4"), "v32": ("bf16", "fp8_v32")}
# a generation's StepBatchBuilder holds sequences up to the next multiple of this (rebuilt when one grows past it), so
# decode steps refill one builder's buffers and one StepMetadata (``out=``) instead of allocating them every step;
# 128, the c128a ratio: the c128a lists keep the width the exact length gives them (the reference's sums, bit for bit)
MODEL_LEN_STEP = 128
# the module each attention function call belongs to -> (its integration, its sparse-mla layer)
_ATTACHED: "weakref.WeakKeyDictionary[torch.nn.Module, tuple[SparseMLAIntegration, SparseMLAAttention]]" = \
    weakref.WeakKeyDictionary()


def check_transformers_version(version: str | None = None) -> str:
    """``version`` (default: the installed transformers') if this module was tested with it, else ``RuntimeError``."""
    if version is None:
        import transformers

        version = transformers.__version__
    if version not in SUPPORTED_TRANSFORMERS:
        raise RuntimeError(f"sparse_mla.integrations.transformers supports transformers "
                           f"{' and '.join(SUPPORTED_TRANSFORMERS)}, found {version}: its DeepSeek attention code may "
                           f"differ; install transformers=={SUPPORTED_TRANSFORMERS[-1]}")
    return version


def _model_cache(found: object) -> object:
    """The model's cache among a forward's keyword arguments (a dict) or in its output, under either name
    (:data:`CACHE_KEYWORDS`); None if absent."""
    for name in CACHE_KEYWORDS:
        cache = found.get(name) if isinstance(found, dict) else getattr(found, name, None)
        if cache is not None:
            return cache
    return None


@dataclass
class _Session:
    """sparse-mla's paged caches of one HF cache (one ``generate`` call): blocks per HF batch row."""

    tables: list[dict[str, list[int]]]
    caches: dict[int, dict[str, PagedCache]] = field(default_factory=dict)  # layer index -> kind -> cache
    next_block: dict[str, int] = field(default_factory=dict)
    pipeline: Pipeline | None = None  # pipeline=True: the library's compressors and indexers of this generation
    builder: StepBatchBuilder | None = None  # the last step's builder, reused while its capacities fit
    meta: StepMetadata | None = None  # the last step's metadata, refilled in place by steps of the same builder
    # cuda_graphs=True: bumped whenever a new builder or a new cache replaces one a captured step reads
    version: int = 0
    graph: "_DecodeGraph | None" = None  # the captured decode step
    warm: tuple | None = None  # the key of the last eager decode step (a capture follows one of the same key)
    warm_plans: list = field(default_factory=list)  # its size-bound plans (graphs.sized_plans)


@dataclass
class _Step:
    """One forward of the model: the batch and metadata every layer of it shares."""

    session: _Session
    batch: StepBatch
    meta: StepMetadata
    rows: torch.Tensor | None  # (num_tokens,) int64: the flat HF index b * S + s of each batch token; None when
    # that is every HF token in order (no pads this step, requests in row order: every decode step)
    req_rows: list[int]  # the HF batch row of each request
    pads: torch.Tensor  # (B,) int64: left pads of each HF row (tokens before its first real one)
    captured: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> compressor / latent output
    picks: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> HF's V4 picks (B, S, k) / ours (T, k)
    _req_rows_t: torch.Tensor | None = None

    def req_rows_tensor(self, device: torch.device) -> torch.Tensor:
        """:attr:`req_rows` as a ``(num_reqs,)`` int64 tensor on ``device``, made once per step."""
        if self._req_rows_t is None:
            self._req_rows_t = torch.tensor(self.req_rows, device=device)
        return self._req_rows_t


class SparseMLAIntegration:
    """What :func:`enable_sparse_mla` set up on a model; :meth:`remove` undoes it."""

    def __init__(self, model: torch.nn.Module, kv_format: str, device: torch.device | str | None,
                 backend: str, pipeline: bool = False, index_format: str = "bf16", cuda_graphs: bool = False) -> None:
        check_transformers_version()
        name = type(model).__name__
        if name in ("DeepseekV4ForCausalLM", "DeepseekV4Model"):
            self.family = "v4"
        elif name in ("DeepseekV32ForCausalLM", "DeepseekV32Model"):
            self.family = "v32"
        else:
            raise ValueError(f"model must be a DeepseekV4ForCausalLM or DeepseekV32ForCausalLM (or its base model), "
                             f"got {name}")
        if kv_format not in KV_FORMATS[self.family]:
            raise ValueError(f"kv_format must be one of {KV_FORMATS[self.family]} for {name}, got {kv_format!r}")
        if index_format not in INDEX_KEY_FORMATS:
            raise ValueError(f"index_format must be one of {INDEX_KEY_FORMATS}, got {index_format!r}")
        base = model.model if hasattr(model, "model") else model
        if any(layer.self_attn in _ATTACHED for layer in base.layers):
            raise ValueError("model already runs sparse-mla: remove() the integration enable_sparse_mla returned "
                             "before enabling it again")
        meta = next((name for name, t in chain(model.named_parameters(), model.named_buffers()) if t.is_meta), None)
        if meta is not None:  # sinks, compressor weights and absorbed projections are copied from the model's values
            raise ValueError(f"model has weights on the meta device ({meta}): the layers copy their values, so "
                             f"materialise them (load or move the model onto a device) before enabling sparse-mla")
        self.model, self.kv_format, self.backend = model, kv_format, backend
        self.pipeline, self.index_format = bool(pipeline), index_format
        self.config = model.config
        if self.pipeline:
            check_pipeline_config(self.config)
        self.device = check_device("device", device) if device is not None else next(model.parameters()).device
        self.cuda_graphs = bool(cuda_graphs)
        if self.cuda_graphs:
            _check_graph_config(self.family, self.pipeline, self.device)
        # captures and replays of decode steps (cuda_graphs=True): how many ran, for a caller to see they do; and why
        # the last decode step that ran eagerly was not replayed
        self.graph_counts = {"captures": 0, "replays": 0}
        self.graph_miss: str | None = None
        self.attentions = [layer.self_attn for layer in base.layers]
        self.kinds = self._kinds()
        self.window = self.config.sliding_window if self.family == "v4" else 1
        self.topk = self.config.index_topk
        self.absorption: dict[int, Absorption] = {}  # V3.2: layer index -> its kv_b_proj split
        self.layers = [self._make_layer(a) for a in self.attentions]
        self._sessions: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
        self._step: _Step | None = None
        self._previous_impl = self.config._attn_implementation
        self._removed = False
        self._hooks = [base.register_forward_pre_hook(self._begin_step, with_kwargs=True),
                       base.register_forward_hook(self._end_step, with_kwargs=True)]
        self._replaced: list[torch.nn.Module] = []  # modules whose forward pipeline=True replaced
        self._base = base
        # the base model's forward as it stands (the class's, or a wrapper someone set on the instance): what a step
        # that is not replayed runs, and what remove() puts back where cuda_graphs=True put its own in front
        self._base_forward = base.forward
        self._previous_forward = base.__dict__.get("forward")
        self._own_forward = self._graph_forward  # one bound method object: remove() recognises it
        if self.cuda_graphs:
            base.forward = self._own_forward
        for i, attn in enumerate(self.attentions):
            _ATTACHED[attn] = (self, self.layers[i])
            if self.pipeline:
                self._replace_forwards(i, attn)
            if self.family == "v32":
                self._hooks.append(attn.kv_a_layernorm.register_forward_hook(self._capture(i)))
            elif attn.compressor is not None and not self.pipeline:
                self._hooks.append(attn.compressor.register_forward_hook(self._capture(i)))
                if hasattr(attn.compressor, "indexer"):
                    self._hooks.append(attn.compressor.indexer.register_forward_hook(self._capture_picks(i)))
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface

        AttentionInterface.register(ATTENTION_NAME, _attention)
        # HF builds masks only for implementations with a mask function; V3.2's indexer needs one
        AttentionMaskInterface.register(ATTENTION_NAME, _mask)
        model.set_attn_implementation(ATTENTION_NAME)

    def remove(self) -> None:
        """Give the model back its previous attention implementation and drop the hooks; again, nothing (a later
        integration of the model stays as it is)."""
        if self._removed:
            return
        self._removed = True
        for hook in self._hooks:
            hook.remove()
        if self._base.__dict__.get("forward") is self._own_forward:  # cuda_graphs=True's, still in place
            if self._previous_forward is None:
                del self._base.forward
            else:
                self._base.forward = self._previous_forward
        for module in self._replaced:
            module.__dict__.pop("forward", None)  # the class's forward again
        self._replaced = []
        for attn in self.attentions:
            _ATTACHED.pop(attn, None)
        for cache in list(self._sessions):  # the caches' own reorder_cache again (_end_step's refusal)
            cache.__dict__.pop("reorder_cache", None)
            _SERVED.discard(cache)
        self.model.set_attn_implementation(self._previous_impl)

    # ------------------------------------------------------------------ set-up

    def _kinds(self) -> tuple[str, ...]:
        if self.family == "v32":
            return ("dsa",)
        kinds = {V4_KINDS[t] for t in self.config.layer_types}
        rates = self.config.compress_rates
        if rates.get("compressed_sparse_attention") != 4 or rates.get("heavily_compressed_attention") != 128:
            raise ValueError(f"config.compress_rates must be CSA 4 and HCA 128 (the c4a / c128a kinds), got {rates}")
        return tuple(k for k in ("swa", "c4a", "c128a") if k in kinds | {"swa"})

    def _make_layer(self, attn: torch.nn.Module) -> SparseMLAAttention:
        if self.family == "v32":
            # the layer's 576-d latent is kv_lora_rank + qk_rope_head_dim: blame the config, not a head_dim
            for name, want in (("kv_lora_rank", 512), ("qk_rope_head_dim", 64)):
                if getattr(attn, name) != want:
                    raise ValueError(f"config.{name} must be {want} (sparse-mla's V3.2 latent: 512 dims + 64 rope "
                                     f"dims), got {getattr(attn, name)}")
            self.absorption[attn.layer_idx] = Absorption.from_kv_b_proj(
                attn.kv_b_proj.weight.to(self.device), attn.num_heads, attn.qk_nope_head_dim, attn.v_head_dim,
                attn.kv_lora_rank)
            return SparseMLAAttention("dsa", attn.num_heads, head_dim=attn.kv_lora_rank + attn.qk_rope_head_dim,
                                      topk=self.topk, scale=attn.scaling, backend=self.backend,
                                      kv_format=self.kv_format).to(self.device)
        if attn.head_dim != 512:
            raise ValueError(f"config.head_dim must be 512 (sparse-mla's V4 latent), got {attn.head_dim}")
        kind = V4_KINDS[attn.layer_type]
        # a copy: a float32 model's sinks on the layer's device would be shared otherwise (a write to one, the other)
        sink = attn.sinks.detach().to(self.device, torch.float32, copy=True)
        return SparseMLAAttention(kind, attn.num_heads, 512, self.window, topk=self.topk if kind == "c4a" else None,
                                  scale=attn.scaling, sink=sink, backend=self.backend, kv_format=self.kv_format)

    def _replace_forwards(self, layer: int, attn: torch.nn.Module) -> None:
        """pipeline=True: the layer's compressor (V4) / indexer (V3.2) forward runs the library instead of HF."""
        module = attn.indexer if self.family == "v32" else attn.compressor
        if module is None:
            return
        if self.family == "v32":
            def forward(hidden_states, q_resid, position_embeddings, attention_mask, position_ids=None,
                        past_key_values=None, **kwargs):
                return self._index_v32(layer, module, hidden_states, q_resid)
        else:
            def forward(hidden_states, q_residual, position_ids, past_key_values, layer_idx):
                return self._compress_v4(layer, module, hidden_states, q_residual)
        module.forward = forward
        self._replaced.append(module)

    def _capture(self, layer: int):
        def hook(module, args, output):
            if self._step is not None:
                self._step.captured[layer] = output[0] if isinstance(output, tuple) else output
        return hook

    def _capture_picks(self, layer: int):
        def hook(module, args, output):
            if self._step is not None:
                self._step.picks[layer] = output
        return hook

    # ------------------------------------------------------------------ a step

    def _begin_step(self, module, args, kwargs) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        x = ids if ids is not None else kwargs["inputs_embeds"]
        num_rows, seq = x.shape[0], x.shape[1]
        cache = _model_cache(kwargs)
        session = self._sessions.get(cache) if cache is not None else None
        past = cache.get_seq_length() if cache is not None else 0
        if session is not None and past == 0:  # the cache was reset(): a new generation on it, new paged caches
            session = None
        if session is not None and len(session.tables) != num_rows:
            raise ValueError(f"the cache (past_key_values) holds a generation of {len(session.tables)} rows, this "
                             f"forward has {num_rows}: a cache serves one batch (reset() it, or pass a new one)")
        mask = kwargs.get("attention_mask")
        if isinstance(mask, dict) or (mask is not None and mask.dim() != 2):
            raise ValueError("sparse-mla needs the 2-D attention_mask (or none), as generate() passes with a "
                             "DynamicCache; a prebuilt 4-D mask / mask dict cannot tell padding from masking")
        if mask is None:
            mask = torch.ones(num_rows, past + seq, dtype=torch.long)
        mask = mask.to("cpu", torch.long)  # one copy; the checks and the step's lengths are read on the host
        if mask.shape != (num_rows, past + seq):
            raise ValueError(f"attention_mask has shape {tuple(mask.shape)}, expected ({num_rows}, {past + seq}) "
                             f"(past {past} + new {seq} tokens)")
        if not bool((mask[:, 1:] >= mask[:, :-1]).all()) or not bool(((mask == 0) | (mask == 1)).all()):
            raise ValueError("attention_mask must be 0 only on left padding (each row: zeros, then ones)")
        positions = kwargs.get("position_ids")
        ours = (torch.cumsum(mask, 1) - 1)[:, -seq:]
        real = mask[:, -seq:].bool()
        if positions is None and not bool(mask.all()):
            raise ValueError("a left-padded batch needs position_ids = attention_mask.cumsum(-1) - 1 (as generate() "
                             "passes); without them HF gives the pads positions and the real tokens shifted ones")
        if positions is not None and not bool((positions.cpu().expand_as(ours) == ours)[real].all()):
            raise ValueError("position_ids must count the real tokens of each row (attention_mask.cumsum(-1) - 1), "
                             "the positions of sparse-mla's requests")
        if session is None:
            if past:
                raise ValueError("the model's cache (cache / past_key_values) holds tokens sparse-mla's caches never "
                                 "saw: enable sparse-mla before the first forward of a generation")
            session = _Session([{k: [] for k in self.kinds} for _ in range(num_rows)])
            if self.pipeline:
                dtype = next(self.model.parameters()).dtype
                session.pipeline = Pipeline(self.config, self.family, self.attentions, [la.kind for la in self.layers],
                                            num_rows, self.device, dtype, self.index_format, self.backend)
        self._step = self._build_step(session, mask, seq)

    def _end_step(self, module, args, kwargs, output) -> None:
        cache = _model_cache(output)
        if cache is not None and self._step is not None:
            if cache not in self._sessions:  # beam search would reorder HF's rows, not the paged caches: refused
                cache.reorder_cache = types.MethodType(_refuse_reorder, cache)  # (a deep copy binds to the copy)
                _SERVED.add(cache)
            self._sessions[cache] = self._step.session
        self._step = None

    def _build_step(self, session: _Session, mask: torch.Tensor, seq: int) -> _Step:
        """The step of HF's 2-D ``mask (B, past + seq)`` (on the host)."""
        seq_lens = mask.sum(1).tolist()
        query_lens = mask[:, -seq:].sum(1).tolist()
        for b, (s, q) in enumerate(zip(seq_lens, query_lens)):
            if q == 0:
                raise ValueError(f"batch row {b} has no real token this step (attention_mask is 0 on all {seq})")
            for kind in self.kinds:
                self._grow(session, b, kind, blocks_needed(s, kind))
        num_blocks = self._pools(session)
        order = sorted(range(len(seq_lens)), key=lambda b: query_lens[b] > 1)  # decodes first
        requests = [Request(seq_lens[b], query_lens[b], session.tables[b]) for b in order]
        batch = self._builder(session, sum(query_lens), len(order), max(seq_lens), num_blocks).build(requests)
        same = session.meta is not None and session.meta.batch.builder is batch.builder
        meta = session.meta = build_step_metadata(batch, MetadataSpec(window=self.window, topk=self.topk),
                                                  out=session.meta if same else None)
        rows = None
        if order != list(range(len(order))) or any(q != seq for q in query_lens):
            rows = torch.cat([b * seq + torch.arange(seq - query_lens[b], seq) for b in order]).to(self.device)
        pads = (mask.shape[1] - mask.sum(1)).to(self.device)
        if session.pipeline is not None:
            session.pipeline.begin_step(batch, order)
        return _Step(session, batch, meta, rows, order, pads)

    def _builder(self, session: _Session, tokens: int, reqs: int, longest: int, num_blocks: dict[str, int]
                 ) -> StepBatchBuilder:
        """The session's builder if its capacities fit this step (``tokens`` new tokens of ``reqs`` requests, the
        longest ``longest`` tokens, caches of ``num_blocks`` blocks per kind), else a new one kept for the next."""
        old = session.builder
        if (old is not None and old.max_tokens == tokens and old.max_reqs == reqs and old.max_model_len >= longest
                and old.num_blocks == num_blocks):
            return old
        max_len = -(-longest // MODEL_LEN_STEP) * MODEL_LEN_STEP
        session.version += 1
        session.builder = StepBatchBuilder(tokens, reqs, max_len, kinds=self.kinds, device=self.device,
                                           num_blocks=num_blocks)
        return session.builder

    def _grow(self, session: _Session, row: int, kind: str, blocks: int) -> None:
        """Give batch row ``row`` ``blocks`` blocks of ``kind`` (numbered in order of need)."""
        table = session.tables[row][kind]
        first = session.next_block.get(kind, 0)
        need = max(0, blocks - len(table))
        table.extend(range(first, first + need))
        session.next_block[kind] = first + need

    def _pools(self, session: _Session) -> dict[str, int]:
        """Every layer's caches, enlarged (doubling, contents kept) to hold the blocks handed out so far; returns
        their sizes in blocks per kind (every layer's cache of a kind has the same)."""
        sizes = {}
        for layer in range(len(self.attentions)):
            caches = session.caches.setdefault(layer, {})
            for kind in self._layer_kinds(layer):
                old, used = caches.get(kind), max(1, session.next_block.get(kind, 0))
                if old is not None and old.num_blocks >= used:
                    continue
                size = max(used, 2 * old.num_blocks if old is not None else used)
                new = PagedCache(size, DEFAULT_BLOCK_SIZE[kind], self.kv_format, 576 if kind == "dsa" else 512,
                                 self.device)
                if old is not None:
                    new.data[: old.num_blocks].copy_(old.data)
                caches[kind] = new
                session.version += 1
            sizes.update({kind: c.num_blocks for kind, c in caches.items()})
            if session.pipeline is not None and self.layers[layer].kind in ("c4a", "dsa"):
                # the layer's indexer keys share its c4a / dsa block table
                if session.pipeline.grow(layer, caches[self.layers[layer].kind].num_blocks):
                    session.version += 1
        return sizes

    def _layer_kinds(self, layer: int) -> tuple[str, ...]:
        kind = self.layers[layer].kind
        return (kind,) if kind in ("swa", "dsa") else ("swa", kind)

    # ------------------------------------------------------------------ a layer

    def attend(self, module: torch.nn.Module, layer: SparseMLAAttention, query: torch.Tensor, key: torch.Tensor,
               indices: torch.Tensor | None) -> torch.Tensor:
        """One layer's attention of the current step; returns ``(B, S, H, d_out)`` in ``query``'s dtype."""
        step = self._step
        if step is None:
            raise RuntimeError("the sparse_mla attention ran outside a forward of the model it was enabled on")
        idx = module.layer_idx
        num_rows, heads, seq, _ = query.shape
        batch = step.batch
        caches = step.session.caches[idx]

        def tokens(x: torch.Tensor) -> torch.Tensor:
            return self._tokens(step, x)

        q = tokens(query.transpose(1, 2))  # (T, H, d)
        if self.family == "v32":
            nope = module.qk_nope_head_dim
            q = self.absorption[idx].absorb_query(q[..., :nope], q[..., nope:])
            latents = torch.cat([step.captured[idx], key[:, 0, -seq:, nope:]], dim=-1)
            caches["dsa"].write(tokens(latents).to(torch.bfloat16), batch.slot_mapping)
            if self.pipeline:  # the library's indexer ran: its picks are request-local already
                picks = step.picks[idx]
            else:
                local = indices - step.pads[:, None, None].to(indices.device)  # padded key axis -> request-local
                local = torch.where((indices >= 0) & (local >= 0), local, -1)
                picks = _pad_picks(tokens(local.to(torch.int32)), self.topk)
            out = layer(q, step.meta, caches, topk_indices=picks)
            out = self.absorption[idx].expand_output(out.float())
        else:
            n_comp = step.captured[idx].shape[2] if idx in step.captured else 0
            swa_new = key[:, 0, key.shape[2] - n_comp - seq: key.shape[2] - n_comp]
            caches["swa"].write(tokens(swa_new).to(torch.bfloat16), batch.slot_mapping)
            picks = None
            if layer.kind != "swa" and not self.pipeline:  # (pipeline: the library's compressor wrote them)
                req, entry, slots = batch.new_entries(layer.kind)
                hf_row = step.req_rows_tensor(self.device)[req.long()]
                entries = step.captured[idx][:, 0].to(self.device)[hf_row, entry.long()]
                caches[layer.kind].write(entries.to(torch.bfloat16), slots)
            if layer.kind == "c4a":
                picks = step.picks[idx] if self.pipeline else _pad_picks(tokens(step.picks[idx].to(torch.int32)),
                                                                         self.topk)
            out = layer(q.to(torch.bfloat16), step.meta, caches, topk_indices=picks)
        if step.rows is None:  # the step's tokens are the HF batch's, in order (capacity = num_tokens)
            full = out
        else:
            full = out.new_zeros(num_rows * seq, heads, out.shape[-1])
            full[step.rows] = out[: batch.num_tokens]
        return full.view(num_rows, seq, heads, -1).to(query.device, query.dtype)

    def _tokens(self, step: _Step, x: torch.Tensor) -> torch.Tensor:
        """``x (B, S, ...)`` of the HF batch -> ``(token_capacity, ...)`` on our device: the step's real tokens in
        request order, padding rows 0."""
        flat = x.reshape(x.shape[0] * x.shape[1], *x.shape[2:]).to(self.device)
        if step.rows is None:  # every HF token, in order, and no padding rows: the ops' dense rows, copied only
            return flat.contiguous()  # where HF's are not (a batch-1 prefill's queries: a view across heads)
        out = flat.new_zeros(step.batch.token_capacity, *flat.shape[1:])
        out[: step.batch.num_tokens] = flat[step.rows]
        return out

    # ------------------------------------------------------------------ cuda_graphs=True

    def _graph_forward(self, *args: Any, **kwargs: Any) -> Any:
        """The base model's forward under ``cuda_graphs=True`` (our pre-hook has built the step). A decode step
        (:func:`_replayable`) replays the session's captured graph of the layers where it fits; where it does not, the
        step runs eagerly the first time and is captured the next time the same key comes back (the eager step
        compiled its kernels and sized its plans); any other forward runs eagerly."""
        step = self._step
        if step is None or not _replayable(step, args, kwargs):
            return self._base_forward(*args, **kwargs)
        session, batch = step.session, step.batch
        key = _graph_key(session, kwargs)
        graph, miss = session.graph, None
        if graph is not None:
            miss = ("a new builder or cache, or other forward arguments" if graph.key != key
                    else graph.steps.mismatch(batch))
            if miss is not None:
                session.graph = graph = None  # its memory freed before the next capture
        captured = graph is None
        if captured:
            warm_miss = "no eager step of this builder, these caches and arguments yet" if session.warm != key else \
                next(filter(None, (plan.replay_mismatch(batch) for plan in session.warm_plans)), None)
            if warm_miss is not None:
                self.graph_miss = miss or warm_miss
                out = self._base_forward(*args, **kwargs)
                session.warm, session.warm_plans = key, sized_plans(step.meta)
                return out
            graph = session.graph = _DecodeGraph.capture(self._base_forward, step, key, kwargs)
            session.warm, session.warm_plans = None, []  # a later capture follows its own eager step
            self.graph_counts["captures"] += 1
        self.graph_counts["replays"] += 1
        out = graph.replay(batch, kwargs, count_tokens=not captured)
        session.pipeline.replayed()
        return out

    def _current_step(self) -> _Step:
        if self._step is None:
            raise RuntimeError("a sparse-mla compressor / indexer ran outside a forward of the model it was enabled on")
        return self._step

    def _compress_v4(self, layer: int, module: torch.nn.Module, hidden_states: torch.Tensor,
                     q_residual: torch.Tensor) -> tuple[torch.Tensor, None]:
        """The replaced ``DeepseekV4{CSA,HCA}Compressor.forward``: the library writes the layer's entries (and c4a's
        picks); HF's attention gets no compressed entries to concatenate (ours attends over the paged caches)."""
        step = self._current_step()
        with torch.no_grad():
            picks = step.session.pipeline.compress_v4(
                layer, module, self._tokens(step, hidden_states), self._tokens(step, q_residual),
                step.session.caches[layer], step.meta)
        if picks is not None:
            step.picks[layer] = picks
        batch = hidden_states.shape[0]
        return hidden_states.new_zeros(batch, 1, 0, self.attentions[layer].head_dim), None

    def _index_v32(self, layer: int, module: torch.nn.Module, hidden_states: torch.Tensor,
                   q_resid: torch.Tensor) -> torch.Tensor:
        """The replaced ``DeepseekV32Indexer.forward``: keys into the library's key cache and its picks; HF's
        attention passes on an empty ``(B, S, 0)`` indices tensor (ours reads the picks of the step)."""
        step = self._current_step()
        with torch.no_grad():
            step.picks[layer] = step.session.pipeline.index_v32(
                layer, module, self._tokens(step, hidden_states), self._tokens(step, q_resid), step.meta)
        return torch.zeros(*hidden_states.shape[:2], 0, dtype=torch.int32, device=hidden_states.device)


# the forward keywords a captured decode step takes as tensors: copied into its own before each replay (the ids and
# positions), handed over as they are (the cache) or not read (the 2-D mask: the step is built from it on the host)
_GRAPH_TENSORS = ("input_ids", "position_ids", "attention_mask", *CACHE_KEYWORDS)


def _check_graph_config(family: str, pipeline: bool, device: torch.device) -> None:
    """``ValueError`` naming what ``cuda_graphs=True`` needs: V4, ``pipeline=True`` (HF's own compressors keep their
    windows in Python lists a replay would not advance), a CUDA device."""
    if family != "v4":
        raise ValueError("cuda_graphs=True supports DeepseekV4 models (V3.2's attention reads a mask HF builds in "
                         "each forward)")
    if not pipeline:
        raise ValueError("cuda_graphs=True needs pipeline=True: HF's own compressors and indexer keep their state in "
                         "Python, which a replayed step would not advance")
    if device.type != "cuda":
        raise ValueError(f"cuda_graphs=True needs a CUDA device, got {device}")


def _replayable(step: _Step, args: tuple, kwargs: dict) -> bool:
    """Whether a forward can run as a captured decode step: no gradient, keywords only, ids and positions of one
    token a row, every row a real decode token (the step's tokens are the HF batch's, in order), no other tensor."""
    ids, positions = kwargs.get("input_ids"), kwargs.get("position_ids")
    return (not torch.is_grad_enabled() and not args and isinstance(ids, torch.Tensor) and ids.dim() == 2
            and ids.shape[1] == 1 and isinstance(positions, torch.Tensor) and positions.shape == ids.shape
            and step.rows is None and step.batch.num_prefills == 0
            and not any(isinstance(v, torch.Tensor) for k, v in kwargs.items() if k not in _GRAPH_TENSORS))


def _graph_key(session: _Session, kwargs: dict) -> tuple:
    """What a captured decode step is bound to beside its plans: the session's builder and caches (its version),
    the batch rows and the forward's other keywords."""
    rest = tuple(sorted((k, repr(v)) for k, v in kwargs.items() if k not in _GRAPH_TENSORS))
    return session.version, kwargs["input_ids"].shape[0], rest


class _DecodeGraph:
    """One captured decode step of the base model: its layers (HF's code and the library's, one CUDA graph,
    :class:`~sparse_mla.graphs.StepGraph`) read the ids and positions from its own tensors and the step from the
    session's builder, metadata and caches, which each step refills on the host before the replay (the pre-hook).

    It keeps no reference to the model's cache (the session's key), only the tensors HF's sliding-window cache
    layers held when captured: the graph reads them (the window's old keys, which our attention never uses) and
    their memory must stay allocated."""

    def __init__(self, steps: StepGraph, key: tuple, ids: torch.Tensor, positions: torch.Tensor, output_type: type,
                 fields: dict, cache_field: str, kept: list[torch.Tensor]) -> None:
        self.steps, self.key, self.ids, self.positions = steps, key, ids, positions
        # the output's fields but the cache: the graph's tensors (its last hidden states, and any hidden states or
        # router logits the forward was asked for), which each replay rewrites: handed out as copies
        self.output_type, self.fields, self.cache_field, self.kept = output_type, fields, cache_field, kept

    @classmethod
    def capture(cls, forward, step: _Step, key: tuple, kwargs: dict) -> "_DecodeGraph":
        """Capture ``forward`` (the base model's class forward, hooks not run: the step is built) for ``step``."""
        cache = _model_cache(kwargs)
        ids, positions = kwargs["input_ids"].clone(), kwargs["position_ids"].clone()
        # a mask dict is taken as built: HF makes none (ours is None for V4) and reads no mask on the host
        static = dict(kwargs, input_ids=ids, position_ids=positions, attention_mask={"sliding_attention": None})
        kept = [t for layer in getattr(cache, "layers", ()) for t in vars(layer).values()
                if isinstance(t, torch.Tensor)]
        held = {}

        def run(batch: StepBatch) -> None:
            held["out"] = forward(**static)

        try:
            steps = StepGraph(run, step.batch, step.meta, warmup=0)  # the eager step before it warmed it up
        except Exception as e:
            raise RuntimeError(f"cuda_graphs=True: the decode step could not be captured in a CUDA graph ({e}). "
                               f"This generation's caches are not usable after it: remove() the integration and "
                               f"start the generation again with enable_sparse_mla(..., cuda_graphs=False), or make "
                               f"the model's code capturable (HF's experts: not experts_implementation='eager')") from e
        finally:
            static.clear()  # the model's cache: not kept
        out = held.pop("out")
        field_name = next((n for n in CACHE_KEYWORDS if getattr(out, n, None) is cache), None)
        if field_name is None:
            raise RuntimeError("cuda_graphs=True: the base model's output does not hold the model's cache (use_cache "
                               "off?): a decode step is replayed only within a cached generation")
        fields = {name: value for name, value in out.items() if name != field_name}
        return cls(steps, key, ids, positions, type(out), fields, field_name, kept)

    def replay(self, batch: StepBatch, kwargs: dict, count_tokens: bool) -> Any:
        """This step (its batch refilled on the host, ``kwargs`` its forward's): ids and positions copied in, the
        graph replayed; the base model's output: the graph's tensors and the model's cache. ``count_tokens``: the
        step's tokens added to the cache layers' counts (``get_seq_length``), as HF's cache code, which a replay
        does not run, would (not for the step just captured: the capture ran it)."""
        self.ids.copy_(kwargs["input_ids"])
        self.positions.copy_(kwargs["position_ids"])
        self.steps.replay(batch)
        cache = _model_cache(kwargs)
        if count_tokens:
            for layer in getattr(cache, "layers", ()):
                if isinstance(getattr(layer, "cumulative_length", None), int):
                    layer.cumulative_length += self.ids.shape[1]
        fields = {name: _copied(value) for name, value in self.fields.items()}
        return self.output_type(**fields, **{self.cache_field: cache})


def _copied(value: Any) -> Any:
    """A tensor, or a tuple of them (HF's per-layer hidden states), copied; anything else as it is."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, tuple):
        return tuple(_copied(v) for v in value)
    return value


def _pad_picks(picks: torch.Tensor, topk: int) -> torch.Tensor:
    """``(T, k)`` picks, ``k <= topk`` (HF takes ``min(index_topk, keys)``), as ``(T, topk)`` with ``-1`` after."""
    if picks.shape[1] > topk:
        raise ValueError(f"the indexer returned {picks.shape[1]} picks per token, more than index_topk={topk}")
    return torch.nn.functional.pad(picks, (0, topk - picks.shape[1]), value=-1)


def _mask(*args, config: object = None, **kwargs) -> torch.Tensor | None:
    """The mask function registered as ``"sparse_mla"``: none for V4 (our layer never reads one, and HF's eager mask
    is a dense ``(B, 1, S, S)`` tensor: 64 GiB at a 128K-token prompt); eager's for V3.2 (its attention slices it for
    the indexer)."""
    if getattr(config, "model_type", None) == "deepseek_v4":
        return None
    from transformers.masking_utils import eager_mask

    return eager_mask(*args, config=config, **kwargs)


def _attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, indices: torch.Tensor | None = None, **kwargs) -> tuple:
    """The function registered as ``"sparse_mla"`` in transformers' ``AttentionInterface``."""
    attached = _ATTACHED.get(module)
    if attached is None:
        raise RuntimeError("attn_implementation 'sparse_mla' is set on a model sparse-mla was not enabled on: "
                           "call sparse_mla.integrations.transformers.enable_sparse_mla(model)")
    integration, layer = attached
    with torch.no_grad():
        out = integration.attend(module, layer, query, key, indices)
    if torch.is_grad_enabled():
        # what would need gradients through the attention: q and k, the layer's own parameters (the sinks, and with
        # pipeline=True the compressor's and indexer's): a backward through the output raises, never leaves them unset
        trained = [t for t in (query, key, *module.parameters()) if t.requires_grad]
        if trained:
            out = _InferenceOnly.apply(out, *trained)
    return out, None


class _InferenceOnly(torch.autograd.Function):
    """The attention's output as autograd sees it where its inputs need gradients: the library computed it without
    any, so a backward through it raises (the projections' and sinks' gradients would be missing or wrong)."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
        return out.clone()  # (not a view: HF code or a hook may change the output in place)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor) -> None:
        raise RuntimeError("sparse-mla's attention computes no gradients (inference only): remove() the integration "
                           "to train the model")


# the HF caches an integration serves now (each given _refuse_reorder as its reorder_cache; remove() takes them out)
_SERVED: "weakref.WeakSet[object]" = weakref.WeakSet()


def _refuse_reorder(cache: object, beam_idx: torch.Tensor) -> None:
    """A served cache's ``reorder_cache`` (bound to it): beam search reorders HF's rows each step; the paged caches and
    the rows' compressor states would stay in their order (tokens different from eager's, no error). A cache no
    integration serves (after ``remove()``, or a deep copy) reorders as its class does."""
    if cache not in _SERVED:
        return type(cache).reorder_cache(cache, beam_idx)
    raise ValueError("beam search (num_beams > 1) reorders the cache's rows, which sparse-mla's paged caches do not "
                     "follow: generate with num_beams=1, or remove() the integration")


def enable_sparse_mla(model: torch.nn.Module, kv_format: str = "bf16", device: torch.device | str | None = None,
                      backend: str = "auto", pipeline: bool = False, index_format: str = "bf16",
                      cuda_graphs: bool = False) -> SparseMLAIntegration:
    """Make a ``DeepseekV4ForCausalLM`` / ``DeepseekV32ForCausalLM`` attend through sparse-mla (transformers 5.23.0 or
    5.24.0; another version: ``RuntimeError`` naming those).

    kv_format: the paged caches' format, ``"bf16"`` or ``"fp8_v4"`` (V4) / ``"fp8_v32"`` (V3.2).
    device: where the caches live and the layer runs (default: the model's); ``backend`` as for
    :class:`SparseMLAAttention` (``"auto"``: the CUDA kernels on a GPU, the reference elsewhere).
    pipeline: also run the model's compressors and indexers through the library (:mod:`.hf_pipeline`: keys in
    the library's caches, scores and top-k by :class:`SparseMLAIndexer`; HF's own compressor / indexer forwards do
    not run); index_format: its indexer key caches' format, ``"bf16"`` or ``"fp8"``.
    cuda_graphs: decode steps (one token a row, no gradient) replay a CUDA graph of the model's layers — HF's code
    and the library's —, the step's batch and metadata refilled on the host before each replay (V4 with
    ``pipeline=True`` on a CUDA device; else ``ValueError``). A step the captured graph does not fit (a new builder:
    a row past the next multiple of 128 tokens; a grown cache; the indexer's captured columns passed) runs eagerly
    and the next is captured; ``graph_counts`` counts the captures and replays, ``graph_miss`` says why the last
    eager decode step was not replayed.
    Call it after the weights are loaded (the sinks and ``kv_b_proj`` are read here). Returns the
    integration; its ``remove()`` restores the model's previous attention and modules.
    """
    return SparseMLAIntegration(model, kv_format, device, backend, pipeline, index_format, cuda_graphs)
