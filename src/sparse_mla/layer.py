"""SparseMLAAttention: one DeepSeek-V4 attention layer over paged caches (DESIGN §5)."""
from __future__ import annotations

import torch

from ._checks import check_scale, check_sink, check_tensor, is_int
from .cache import PagedCache
from .config import COMPRESS_RATIO, LAYER_KINDS
from .formats import FORMAT_NAMES, infer_format
from .metadata import StepMetadata, convert_compressed_picks, workspace_indices
from .ops import check_backend_name, dequantize_and_gather, sparse_attention_decode, sparse_attention_prefill
from .ops.validate import D_V

PREFILL_MODES = ("paged", "workspace")
DEFAULT_WORKSPACE_BYTES = 64 << 20
# One bf16 workspace per (device, head_dim), shared by every layer: layers of a step run one after
# another on one stream, so a model needs a single workspace, not one per layer.
_WORKSPACES: dict[tuple[torch.device, int], torch.Tensor] = {}


def shared_workspace(device: torch.device, rows: int, head_dim: int) -> torch.Tensor:
    """A ``(rows, head_dim)`` bf16 view of the workspace shared by all layers on ``device`` (grown on demand)."""
    key = (torch.device(device), head_dim)
    buf = _WORKSPACES.get(key)
    if buf is None or buf.shape[0] < rows:
        buf = _WORKSPACES[key] = torch.empty(rows, head_dim, dtype=torch.bfloat16, device=device)
    return buf[:rows]


class SparseMLAAttention(torch.nn.Module):
    """Sparse MLA attention of one layer kind: ``swa``, ``c4a`` (indexer top-k) or ``c128a``.

    kind / compress_ratio: the layer kind (ratio 1, 4 or 128; give either). window: the SWA window W
    (the step metadata must be built with the same). topk: the indexer width (c4a only). scale:
    softmax scale, default ``head_dim ** -0.5``. sink: ``(num_heads,)`` float32 per-head sink logits
    (None: no sink), registered as a buffer. backend: ``"auto"``, ``"reference"`` or ``"triton"``.
    kv_format: if given, every cache the layer reads must hold this format.

    Decode tokens (the batch's first ``num_decode_tokens``) read the paged caches directly. Prefill
    tokens do too by default (``prefill_mode="paged"``); ``"workspace"`` gathers each chunk's keys
    into a bf16 workspace of at most ``workspace_bytes`` first (FlashMLA's prefill path; one workspace
    per device is shared by all layers, see :func:`shared_workspace`). The layer
    reads caches only: the engine inserts the step's new KV and compressed entries before ``forward``.
    """

    def __init__(self, kind: str, num_heads: int, head_dim: int = 512, window: int = 128, *,
                 compress_ratio: int | None = None, topk: int | None = None, scale: float | None = None,
                 sink: torch.Tensor | None = None, backend: str = "auto", prefill_mode: str = "paged",
                 workspace_bytes: int = DEFAULT_WORKSPACE_BYTES, kv_format: str | None = None) -> None:
        super().__init__()
        if kind not in LAYER_KINDS:
            raise ValueError(f"kind must be one of {LAYER_KINDS}, got {kind!r}")
        if compress_ratio is not None and compress_ratio != COMPRESS_RATIO[kind]:
            raise ValueError(f"compress_ratio {compress_ratio} does not match kind {kind!r} "
                             f"(ratio {COMPRESS_RATIO[kind]})")
        if prefill_mode not in PREFILL_MODES:
            raise ValueError(f"prefill_mode must be one of {PREFILL_MODES}, got {prefill_mode!r}")
        if kind == "c4a" and not topk:
            raise ValueError("topk (the indexer width) is required for a c4a layer")
        if not all(is_int(v) and v >= 1 for v in (num_heads, window)):
            raise ValueError(f"num_heads and window must be positive ints, got {num_heads!r}, {window!r}")
        if head_dim not in (512, 576):
            raise ValueError(f"head_dim must be 512 (V4) or 576 (V3.2), got {head_dim}")
        if workspace_bytes < 2 * head_dim:
            raise ValueError(f"workspace_bytes must hold at least one {head_dim}-d bf16 row, got {workspace_bytes}")
        if kind == "c4a" and not (is_int(topk) and topk >= 1):
            raise ValueError(f"topk must be a positive int, got {topk!r}")
        if sink is not None:
            check_sink(sink, num_heads)  # its values once here, not on every step
        check_backend_name(backend)
        if kv_format is not None and kv_format not in FORMAT_NAMES:
            raise ValueError(f"kv_format must be None or one of {FORMAT_NAMES}, got {kv_format!r}")
        self.kind, self.num_heads, self.head_dim, self.window = kind, num_heads, head_dim, window
        self.topk = topk if kind == "c4a" else None
        self.compress_ratio = COMPRESS_RATIO[kind]
        self.scale = check_scale(head_dim ** -0.5 if scale is None else scale)
        self.register_buffer("sink", sink)
        self.backend, self.prefill_mode, self.workspace_bytes = backend, prefill_mode, workspace_bytes
        self.kv_format = kv_format

    def extra_repr(self) -> str:
        return (f"kind={self.kind}, num_heads={self.num_heads}, head_dim={self.head_dim}, window={self.window}, "
                f"topk={self.topk}, prefill_mode={self.prefill_mode}, backend={self.backend}")

    # ------------------------------------------------------------------ forward

    def forward(self, q: torch.Tensor, meta: StepMetadata | None = None, caches: dict | None = None,
                topk_indices: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of the step's tokens.

        q: ``(T, num_heads, head_dim)`` bf16, T = the batch's token capacity. meta: the step's
        :class:`~sparse_mla.metadata.StepMetadata` (None: warm-up, which only reserves the workspace
        and zeroes ``out``). caches: ``{"swa": ..., kind: ...}``, each a :class:`PagedCache` or its
        tensor. topk_indices: ``(T, topk)`` int32 local C4A entry numbers from the indexer (c4a
        layers only; picks a token cannot see yet are dropped). Returns ``out (T, num_heads, 512)``
        bf16 (written in place when given); padding tokens get zeros.
        """
        check_tensor("q", q, dtype=torch.bfloat16, shape=(None, self.num_heads, self.head_dim))
        if out is None:
            out = torch.empty(q.shape[0], self.num_heads, D_V, dtype=torch.bfloat16, device=q.device)
        check_tensor("out", out, dtype=torch.bfloat16, shape=(q.shape[0], self.num_heads, D_V), device=q.device)
        if meta is None:
            if self.prefill_mode == "workspace":
                self._workspace_buffer(q.device)
            return out.zero_()
        if not isinstance(meta, StepMetadata):
            raise TypeError(f"meta must be the step's StepMetadata (or None), got {type(meta).__name__}")
        batch = meta.batch
        if q.shape[0] != batch.token_capacity:
            raise ValueError(f"q has {q.shape[0]} tokens, the step's token capacity is {batch.token_capacity}")
        if meta.spec.window != self.window:
            raise ValueError(f"the step's metadata has window {meta.spec.window}, this layer {self.window}")
        data = self._caches(meta, caches)
        scopes = [(data["swa"], meta.swa_indices, meta.swa_lens)]
        local = None
        if self.kind == "c4a":
            if topk_indices is None:
                raise ValueError("topk_indices must be given to a c4a layer: the indexer's local picks, (T, topk) int32")
            if meta.spec.topk != self.topk:
                raise ValueError(f"the step's metadata has topk {meta.spec.topk}, this layer {self.topk}")
            idx, lens, local = convert_compressed_picks(meta, topk_indices, "c4a")
            scopes.append((data["c4a"], idx, lens))
        elif topk_indices is not None:
            raise ValueError(f"topk_indices must be given only to a c4a layer, not to this {self.kind} layer")
        elif self.kind == "c128a":
            if meta.c128a_indices is None:
                raise ValueError("the step's metadata was built from a batch without a 'c128a' block table")
            scopes.append((data["c128a"], meta.c128a_indices, meta.c128a_lens))
        n_dec, n_tok = batch.num_decode_tokens, batch.num_tokens
        if n_dec:
            self._paged(q, scopes, slice(0, n_dec), out, meta.decode_order(self.kind))
        if n_tok > n_dec:
            if self.prefill_mode == "paged":  # many waves of programs: their order hardly matters
                self._paged(q, scopes, slice(n_dec, n_tok), out)
            else:
                self._prefill_workspace(q, meta, data, local, out)
        out[n_tok:].zero_()
        return out

    # ------------------------------------------------------------------ helpers

    def _caches(self, meta: StepMetadata, caches: dict | None) -> dict[str, torch.Tensor]:
        """The cache tensors this layer reads, checked against the layer and the step's block tables."""
        needed = ("swa",) if self.kind == "swa" else ("swa", self.kind)
        if not isinstance(caches, dict):
            raise ValueError(f"caches must be a dict of kind -> PagedCache or tensor, got {type(caches).__name__}")
        data, formats = {}, {}
        for kind in needed:
            if kind not in caches:
                raise ValueError(f"caches has no {kind!r} cache, which a {self.kind} layer reads "
                                 f"(got {sorted(caches)})")
            c = caches[kind]
            t = c.data if isinstance(c, PagedCache) else c
            name = f"caches[{kind!r}]"
            fmt = infer_format(t, name)
            if self.kv_format is not None and fmt.name != self.kv_format:
                raise ValueError(f"{name} holds {fmt.name} data, but the layer's kv_format is {self.kv_format!r}")
            if fmt.dim != self.head_dim:
                raise ValueError(f"{name} holds {fmt.dim}-d tokens, the layer's head_dim is {self.head_dim}")
            if t.dim() not in (3, 4) or t.shape[1] != meta.batch.block_sizes[kind]:
                raise ValueError(f"{name} has blocks of {t.shape[1] if t.dim() > 1 else '?'} entries, the step's "
                                 f"block tables use {meta.batch.block_sizes[kind]}")
            if t.device != meta.batch.device:
                raise ValueError(f"{name} is on {t.device}, the step's metadata on {meta.batch.device}")
            data[kind], formats[kind] = t, fmt.name
        if len(set(formats.values())) > 1:
            raise ValueError(f"cache format mismatch: the layer's caches hold different formats {formats}")
        return data

    def _paged(self, q: torch.Tensor, scopes, rows: slice, out: torch.Tensor,
               order: torch.Tensor | None = None) -> None:
        (cache, idx, lens), *rest = scopes
        extra = {}
        if rest:
            extra = dict(extra_cache=rest[0][0], extra_indices=rest[0][1][rows], extra_lens=rest[0][2][rows])
        sparse_attention_decode(q[rows], cache, idx[rows], lens[rows], sink=self.sink, scale=self.scale,
                                backend=self.backend, out=out[rows], order=order, **extra)

    def _workspace_buffer(self, device: torch.device) -> torch.Tensor:
        return shared_workspace(device, self.workspace_bytes // (2 * self.head_dim), self.head_dim)

    def _prefill_workspace(self, q, meta: StepMetadata, data: dict, local, out: torch.Tensor) -> None:
        ws_all = self._workspace_buffer(q.device)
        for chunk in meta.workspace_plan(self.kind, self.workspace_bytes, self.head_dim):
            ws = ws_all[: chunk.num_rows]
            n_c = chunk.compressed_slots.shape[0]
            if n_c:
                ws[:n_c] = dequantize_and_gather(data[self.kind], chunk.compressed_slots, backend=self.backend)
            ws[n_c:] = dequantize_and_gather(data["swa"], chunk.swa_slots, backend=self.backend)
            idx, lens = workspace_indices(meta, chunk, local)
            sparse_attention_prefill(q[chunk.tokens], ws, idx, lens, self.sink, self.scale, backend=self.backend,
                                     out=out[chunk.tokens])
