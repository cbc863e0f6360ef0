"""SparseMLAAttention: one DeepSeek-V4 attention layer over paged caches (DESIGN §5)."""
from __future__ import annotations

import torch

from ._checks import check_tensor
from .cache import PagedCache
from .config import COMPRESS_RATIO, LAYER_KINDS
from .metadata import StepMetadata, convert_compressed_picks, plan_prefill_workspace
from .ops import dequantize_and_gather, sparse_attention_decode, sparse_attention_prefill
from .ops.validate import D_V

PREFILL_MODES = ("paged", "workspace")


class SparseMLAAttention:
    """Sparse MLA attention of one layer kind (``swa``, ``c4a`` or ``c128a``).

    Decode tokens and prefill tokens both read the paged caches; prefill tokens either directly
    (``prefill_mode="paged"``, default) or through a bf16 workspace gathered per chunk
    (``"workspace"``, FlashMLA's prefill path). The engine inserts new KV before calling forward.
    """

    def __init__(self, kind: str, num_heads: int, head_dim: int = 512, window: int = 128,
                 topk: int | None = None, scale: float | None = None, sink: torch.Tensor | None = None,
                 backend: str = "auto", prefill_mode: str = "paged", workspace_rows: int = 65536) -> None:
        if kind not in LAYER_KINDS:
            raise ValueError(f"kind must be one of {LAYER_KINDS}, got {kind!r}")
        if prefill_mode not in PREFILL_MODES:
            raise ValueError(f"prefill_mode must be one of {PREFILL_MODES}, got {prefill_mode!r}")
        if kind == "c4a" and not topk:
            raise ValueError("topk (the indexer width) is required for a c4a layer")
        if sink is not None:
            check_tensor("sink", sink, dtype=torch.float32, shape=(num_heads,))
        self.kind, self.num_heads, self.head_dim, self.window, self.topk = kind, num_heads, head_dim, window, topk
        self.compress_ratio = COMPRESS_RATIO[kind]
        self.scale = scale if scale is not None else head_dim ** -0.5
        self.sink, self.backend, self.prefill_mode, self.workspace_rows = sink, backend, prefill_mode, workspace_rows

    def _cache(self, caches: dict, kind: str) -> torch.Tensor:
        if kind not in caches:
            raise ValueError(f"caches has no {kind!r} cache, which a {self.kind} layer reads (got {sorted(caches)})")
        c = caches[kind]
        return c.data if isinstance(c, PagedCache) else c

    def forward(self, q: torch.Tensor, meta: StepMetadata | None, caches: dict,
                topk_indices: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """q: ``(T, H, d)`` bf16 (T = the batch's token capacity); caches: kind -> PagedCache or tensor.

        topk_indices: ``(T, topk)`` int32 local C4A picks (c4a layers only). Returns ``out (T, H, 512)``
        bf16; padding tokens get zeros. Without metadata (warm-up) it only zeroes ``out``.
        """
        check_tensor("q", q, dtype=torch.bfloat16, shape=(None, self.num_heads, self.head_dim))
        if out is None:
            out = torch.empty(q.shape[0], self.num_heads, D_V, dtype=torch.bfloat16, device=q.device)
        check_tensor("out", out, dtype=torch.bfloat16, shape=(q.shape[0], self.num_heads, D_V), device=q.device)
        out.zero_()
        if meta is None:
            return out
        if q.shape[0] != meta.batch.token_capacity:
            raise ValueError(f"q has {q.shape[0]} tokens, the step's metadata {meta.batch.token_capacity}")
        if (topk_indices is not None) != (self.kind == "c4a"):
            raise ValueError("topk_indices must be given for a c4a layer and only for it")
        scopes = self._scopes(meta, caches, topk_indices)
        n_dec, n_tok = meta.batch.num_decode_tokens, meta.batch.num_tokens
        if n_dec:
            out[:n_dec] = self._attend(q, scopes, slice(0, n_dec))
        if n_tok > n_dec:
            if self.prefill_mode == "paged":
                out[n_dec:n_tok] = self._attend(q, scopes, slice(n_dec, n_tok))
            else:
                self._prefill_workspace(q, meta, caches, scopes, out)
        return out

    __call__ = forward

    def _scopes(self, meta, caches, topk_indices):
        scopes = [(self._cache(caches, "swa"), meta.swa_indices, meta.swa_lens, None)]
        if self.kind == "c128a":
            scopes.append((self._cache(caches, "c128a"), meta.c128a_indices, meta.c128a_lens, None))
        elif self.kind == "c4a":
            if meta.c4a_buffer is None:
                raise ValueError("the step's metadata was built without a c4a block table")
            idx, lens, local = convert_compressed_picks(meta, topk_indices, "c4a")
            scopes.append((self._cache(caches, "c4a"), idx, lens, local))
        return scopes

    def _attend(self, q, scopes, rows):
        (c0, i0, l0, _), *rest = scopes
        extra = dict(extra_cache=rest[0][0], extra_indices=rest[0][1][rows], extra_lens=rest[0][2][rows]) if rest else {}
        o, _ = sparse_attention_decode(q[rows], c0, i0[rows], l0[rows], sink=self.sink, scale=self.scale,
                                       backend=self.backend, **extra)
        return o

    def _prefill_workspace(self, q, meta, caches, scopes, out):
        swa_cache = scopes[0][0]
        comp_cache = scopes[1][0] if len(scopes) > 1 else None
        local = scopes[1][3] if self.kind == "c4a" else None
        for chunk in plan_prefill_workspace(meta, self.kind, self.workspace_rows, local):
            ws = torch.empty(chunk.row_is_swa.shape[0], self.head_dim, dtype=torch.bfloat16, device=q.device)
            ws[chunk.row_is_swa] = dequantize_and_gather(swa_cache, chunk.swa_slots)
            if comp_cache is not None and chunk.compressed_slots.numel():
                ws[~chunk.row_is_swa] = dequantize_and_gather(comp_cache, chunk.compressed_slots)
            o, _ = sparse_attention_prefill(q[chunk.tokens], ws, chunk.indices, chunk.lens, self.sink, self.scale,
                                            backend=self.backend)
            out[chunk.tokens] = o
