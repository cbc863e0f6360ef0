"""The library's compressors and indexers inside a transformers DeepSeek model (``enable_sparse_mla(pipeline=True)``).

One :class:`Pipeline` per HF cache object (one ``generate`` call), beside the paged attention caches of
:mod:`sparse_mla.integrations.transformers`: per compressed V4 layer a :class:`KVCompressor` over a
:class:`CompressorStatePool` of its ratio (one state slot per HF batch row), the c4a layers' indexer compressor and
:class:`IndexerKeyCache`, V3.2's per-token indexer keys; and per picks layer a :class:`SparseMLAIndexer`.

What runs where, per layer and step (the HF modules' weights, the library's kernels):

* V4 compressors (``DeepseekV4{CSA,HCA}Compressor``): HF's ``kv_proj`` / ``gate_proj`` on the step's real tokens,
  then :class:`KVCompressor` (ape = ``position_bias``, norm = ``kv_norm``, the compress rope) writes the completed
  entries straight into the paged cache; HF's buffers / overlap state / entry lists are never filled.
* V4 indexer (``DeepseekV4Indexer``): its own ``kv_proj`` / ``gate_proj`` into a 128-d :class:`KVCompressor` writing
  the :class:`IndexerKeyCache` (sharing the c4a block table), its queries ``q_b_proj(q_residual)`` and head weights
  ``scorer.weights_proj(h)`` into :class:`SparseMLAIndexer` (rope, scores, top-k over the paged keys): no dense
  ``(B, S, heads, entries)`` score tensor.
* V3.2 indexer (``DeepseekV32Indexer``): keys ``k_norm(wk(h))`` roped (half-split, the model's rope) into the key
  cache per raw token (the ``dsa`` block table), queries ``wq_b(q_resid)``, weights ``weights_proj(h)``.

Rows are request-aligned (a row's pads never enter a window), so a left-padded row's entries are those of the same
prompt alone — unlike HF's eager compressors, which pool pad tokens into a padded row's windows.
"""
from __future__ import annotations

import torch

from ..batch import StepBatch
from ..compress_metadata import CompressMetadata, build_compress_metadata
from ..compress_state import CompressorStatePool
from ..compressor import KVCompressor
from ..index_keys import insert_index_keys
from ..indexer_cache import INDEX_HEAD_DIM, IndexerKeyCache
from ..indexer_layer import SparseMLAIndexer
from ..metadata import StepMetadata
from ..rope import RopeSpec, rope_from_hf_config, rotate_half_split_head

INDEX_KEY_FORMATS = ("bf16", "fp8")


def check_pipeline_config(config: object) -> None:
    """``ValueError`` naming the config field the library's indexer cannot take (its keys are 128-d)."""
    if config.index_head_dim != INDEX_HEAD_DIM:
        raise ValueError(f"config.index_head_dim must be {INDEX_HEAD_DIM} for pipeline=True (the library's indexer "
                         f"keys), got {config.index_head_dim}")


class Pipeline:
    """The compressors, indexer key caches and state of one generation (``num_rows`` HF batch rows).

    attentions: the model's attention modules; kinds: each layer's sparse-mla kind; dtype: the projections' dtype
    (the model's; the state pools keep it); index_format: the key caches' format (``"bf16"`` or ``"fp8"``).
    """

    def __init__(self, config: object, family: str, attentions: list[torch.nn.Module], kinds: list[str],
                 num_rows: int, device: torch.device, dtype: torch.dtype, index_format: str, backend: str) -> None:
        self.device, self.index_format, self.family = device, index_format, family
        self.pools: dict[int, CompressorStatePool] = {}
        self.compressors: dict[int, dict[str, KVCompressor]] = {}  # layer -> "kv" / "index" -> its compressor
        self.index_caches: dict[int, IndexerKeyCache] = {}  # layer -> its key cache (grown with its block table)
        self.indexers: dict[int, SparseMLAIndexer] = {}
        # V4: the compress rope (compressors and indexer); V3.2: its one rope (no nested rope types)
        self.rope: RopeSpec = rope_from_hf_config(config, "compress" if family == "v4" else "main")
        dtype = dtype if dtype in (torch.float32, torch.bfloat16) else torch.float32  # the pools' dtypes
        for i, (attn, kind) in enumerate(zip(attentions, kinds)):
            if kind in ("c4a", "c128a"):
                comp = attn.compressor
                pool = self._pool(4 if kind == "c4a" else 128, num_rows, dtype)
                self.compressors[i] = {"kv": self._compressor(pool, 512, comp, backend)}
                if kind == "c4a":
                    self.compressors[i]["index"] = self._compressor(pool, INDEX_HEAD_DIM, comp.indexer, backend)
            if kind in ("c4a", "dsa"):
                heads = config.index_n_heads
                self.indexers[i] = SparseMLAIndexer(kind, heads, config.index_topk, rope=self.rope, q_format="bf16",
                                                    key_format=index_format, backend=backend)
        # each pool gives every batch row one state slot (the rows are this generation's requests)
        self.slots = {r: [pool.allocate() for _ in range(num_rows)] for r, pool in self.pools.items()}
        self.metas: dict[int, CompressMetadata] = {}
        # V3.2: the step's key positions and their rope angles (cos, sin), made once a step for every layer
        self.key_rope: tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]] | None = None

    def _pool(self, ratio: int, num_rows: int, dtype: torch.dtype) -> CompressorStatePool:
        if ratio not in self.pools:
            self.pools[ratio] = CompressorStatePool(ratio, num_rows, self.device, dtype)
        return self.pools[ratio]

    def _compressor(self, pool: CompressorStatePool, dim: int, module: torch.nn.Module, backend: str
                    ) -> KVCompressor:
        return KVCompressor(pool, dim, module.kv_norm.weight.detach(), module.kv_norm.variance_epsilon,
                            ape=module.position_bias.detach(), rope=self.rope, backend=backend)

    def grow(self, layer: int, num_blocks: int) -> bool:
        """Layer ``layer``'s key cache enlarged to ``num_blocks`` pages (contents kept), as its block table grew;
        whether a new cache replaced it."""
        old = self.index_caches.get(layer)
        if old is not None and old.num_blocks >= num_blocks:
            return False
        new = IndexerKeyCache(num_blocks, self.index_format, self.device)
        if old is not None:
            new.data[: old.num_blocks].copy_(old.data)
        self.index_caches[layer] = new
        return True

    def begin_step(self, batch: StepBatch, req_rows: list[int]) -> None:
        """This step's compression metadata of every pool (request ``i`` is HF batch row ``req_rows[i]``), refilling
        the last step's buffers where it was built by the same builder; V3.2: its keys' rope angles."""
        for r, pool in self.pools.items():
            old = self.metas.get(r)
            out = old if old is not None and old.batch.builder is batch.builder else None
            self.metas[r] = build_compress_metadata(batch, pool, [self.slots[r][b] for b in req_rows], out=out)
        if self.family == "v32":
            positions = batch.positions.clamp_min(0)
            self.key_rope = positions, self.rope.cos_sin(positions)

    def replayed(self) -> None:
        """A captured decode step replayed this step: every compressor records it as run
        (:meth:`KVCompressor.replayed`)."""
        for comps in self.compressors.values():
            for comp in comps.values():
                comp.replayed(self.metas[comp.pool.ratio])

    def compress_v4(self, layer: int, module: torch.nn.Module, h: torch.Tensor, q_residual: torch.Tensor,
                    caches: dict, meta: StepMetadata) -> torch.Tensor | None:
        """V4 layer ``layer``'s compressor step: ``h (T_cap, hidden)`` and ``q_residual (T_cap, q_lora)`` the step's
        token rows. Writes the layer's compressed cache (and for c4a its key cache); returns c4a's picks
        ``(T_cap, topk)`` int32, else None: the indexer's step buffer, which the next layer's indexer call overwrites
        (HF runs a layer's compressor right before its attention, which reads the picks first)."""
        comps, kind = self.compressors[layer], self.indexers[layer].kind if layer in self.indexers else "c128a"
        ratio = 4 if kind == "c4a" else 128
        dtype = self.pools[ratio].dtype
        comps["kv"](module.kv_proj(h).to(dtype), module.gate_proj(h).to(dtype), self.metas[ratio], caches[kind])
        if kind != "c4a":
            return None
        indexer = module.indexer
        keys = self.index_caches[layer]
        comps["index"](indexer.kv_proj(h).to(dtype), indexer.gate_proj(h).to(dtype), self.metas[4], keys)
        q = indexer.q_b_proj(q_residual).view(h.shape[0], -1, INDEX_HEAD_DIM)
        weights = indexer.scorer.weights_proj(h)
        return self.indexers[layer](meta, q, weights, keys)

    def index_v32(self, layer: int, module: torch.nn.Module, h: torch.Tensor, q_resid: torch.Tensor,
                  meta: StepMetadata) -> torch.Tensor:
        """V3.2 layer ``layer``'s indexer step: the keys of the step's tokens into its key cache (roped at their
        positions), then its picks ``(T_cap, topk)`` int32 (raw request-local positions; the step buffer, as
        :meth:`compress_v4`'s)."""
        positions, cos_sin = self.key_rope
        keys = rotate_half_split_head(module.k_norm(module.wk(h)).float(), positions, self.rope, cos_sin)
        cache = self.index_caches[layer]
        insert_index_keys(keys, cache, meta.batch.slot_mapping[: h.shape[0]])
        q = module.wq_b(q_resid).view(h.shape[0], -1, INDEX_HEAD_DIM)
        return self.indexers[layer](meta, q, module.weights_proj(h), cache)
