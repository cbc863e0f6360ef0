"""The KV compressors (DESIGN §6): pooled, normed, roped entries written straight into the compressed caches.

Per token the engine gives its projections ``kv`` and gate ``score`` (``(T, coff·d)``, ``coff = 2`` at ratio 4);
the library adds the layer's ``ape`` and, for each window that completes this step (:mod:`.compress_metadata`),

* pools it per channel: ``C[c] = Σ_j softmax_j(s_j[c] + ape[j][c]) · kv_j[c]`` over the window's ``r`` tokens
  (V4 r = 128; V4.1 r = 2 without ape), or at r = 4 over 8 slots: window ``w-1``'s tokens with their first halves
  (channels ``[0, d)``, ``ape[j, :d]``) and window ``w``'s with their second halves (``[d, 2d)``, ``ape[j, d:]``),
  the first four slots empty at ``w = 0``; at r = 1 (V4.1) the entry is the token's kv;
* RMS-normalises it (``weight``, ``eps``), which is the *latent* (returned: V4.1's indexer keys are the engine's
  ``k_norm(W_k latent)``, written by :func:`sparse_mla.index_keys.insert_index_keys`);
* ropes the last 64 channels at position ``w · r`` (the compress rope, :mod:`.rope`) and writes the result into
  the cache at the entry's slot, in the cache's own format (a :class:`~sparse_mla.cache.PagedCache`: every
  :mod:`~sparse_mla.formats` format, byte-identical to ``PagedCache.write`` of the same bf16 entry) or into an
  :class:`~sparse_mla.indexer_cache.IndexerKeyCache` (V4's d = 128 indexer compressor).

Numerics (one rule, both backends): the softmax and the weighted sum in float32; the pooled value rounded to bf16
(DeepSeek's reference, R), the norm in float32 with a float32 weight and one bf16 rounding (the latent), the rope in
float32 on the bf16 latent with one bf16 rounding (the entry). transformers instead rounds the softmax weights to
bf16 and multiplies and sums in bf16 (and rounds cos / sin to bf16); tests/test_compressor_hf.py measures both
against a float64 oracle.

The open windows live in a :class:`~sparse_mla.compress_state.CompressorStatePool` (raw kv and gate of the
request's last positions), read and updated inside the call; nothing else is written but the cache and the state.
On a CUDA device the work runs in Triton kernels (:mod:`sparse_mla.ops.triton.compress`, then the cache's insert
kernel); elsewhere in the plain-PyTorch reference below (:func:`compress_reference`).
"""
from __future__ import annotations

import math

import torch

from ._checks import check_finite, check_tensor, is_int
from .cache import PagedCache
from .compress_metadata import CompressMetadata
from .compress_state import OVERLAP_RATIO, REPEATABLE_STEP_TOKENS, CompressorStatePool, window_slots
from .cache_views import resolve_cache_once
from .index_keys import insert_index_keys
from .indexer_cache import INDEX_HEAD_DIM, IndexerKeyCache
from .ops import quantize_and_insert
from .ops.dispatch import resolve_backend
from .ops.validate import debug_checks_enabled
from .rope import V4_COMPRESS_ROPE, RopeSpec, rotate_interleaved_tail

APE_RATIOS = (4, 128)  # V4's compressors add a learned position bias; V4.1's (2, 1) do not


def round_bf16(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to bf16 (nearest even), kept in float32."""
    return x.to(torch.bfloat16).float()


def norm_latent(pooled: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The latent of pooled entries ``(n, d)`` float32: RMSNorm of ``bf16(pooled)`` in float32 with the float32
    ``weight (d,)``, rounded once to bf16."""
    x = round_bf16(pooled)
    return (x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * weight).to(torch.bfloat16)


def _pool_windows(kv: torch.Tensor, score: torch.Tensor | None, ape: torch.Tensor | None, rows: torch.Tensor,
                  meta: CompressMetadata, rings: tuple[torch.Tensor, torch.Tensor], dim: int) -> torch.Tensor:
    """The pooled (pre-norm) entries completed by tokens ``rows (n,)``: ``(n, dim)`` float32. Each window token
    comes from this step's ``kv`` / ``score`` rows when it is new, else from the request's state ring."""
    r, batch = meta.ratio, meta.batch
    slots_per_entry, ring = window_slots(r), meta.pool.ring
    pos = batch.positions[rows].long()
    req = batch.token_to_req[rows].long()
    j = torch.arange(slots_per_entry, device=kv.device)
    first = pos + 1 - slots_per_entry  # position of the window's first slot (negative: an empty slot at w = 0)
    pj = first[:, None] + j[None, :]
    exists = pj >= 0
    new = pj >= meta.prefix_lens[req].long()[:, None]
    in_rows = (rows[:, None] - (pos[:, None] - pj)).clamp_min(0)
    state_slot = meta.state_slots[req].long()[:, None]

    def window(x: torch.Tensor | None, ring_values: torch.Tensor) -> torch.Tensor:
        """``(n, L, coff·d)`` values of the window's slots in the projections' dtype."""
        if x is None:
            return torch.zeros(pj.shape + (kv.shape[1],), dtype=kv.dtype, device=kv.device)
        from_state = ring_values[state_slot, torch.where(exists, pj, 0) % ring] if ring else x[in_rows]
        return torch.where(new[..., None], x[in_rows], from_state)

    kv_w, s_w = window(kv, rings[0]), window(score, rings[1])
    if r == OVERLAP_RATIO:  # slot j < r: window w-1's first half; j >= r: window w's second half
        kv_w = torch.cat((kv_w[:, :r, :dim], kv_w[:, r:, dim:]), 1)
        s_w = torch.cat((s_w[:, :r, :dim], s_w[:, r:, dim:]), 1)
    s = s_w.float()
    if ape is not None:
        ape_w = torch.cat((ape[:, :dim], ape[:, dim:]), 0) if r == OVERLAP_RATIO else ape
        s = s + ape_w.float()
    s = torch.where(exists[..., None], s, float("-inf"))
    return (torch.softmax(s, 1) * kv_w.float()).sum(1)


def compress_reference(kv: torch.Tensor, score: torch.Tensor | None, ape: torch.Tensor | None, weight: torch.Tensor,
                       eps: float, rope: RopeSpec, meta: CompressMetadata, layer: int, dim: int
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of one compressor in plain PyTorch, on checked arguments: ``(latent, entries)``, both
    ``(T, dim)`` bf16, row ``t`` the entry token ``t`` completes (zeros elsewhere). Updates the state rings of
    ``layer`` after reading them (the rows fed this step that stay in the ring)."""
    rings = meta.pool.layers[layer]
    rows = (meta.entry_positions[:kv.shape[0]] >= 0).nonzero().squeeze(1)
    latent = torch.zeros(kv.shape[0], dim, dtype=torch.bfloat16, device=kv.device)
    entries = torch.zeros_like(latent)
    if rows.numel():
        pooled = _pool_windows(kv, score, ape, rows, meta, rings, dim)
        latent[rows] = norm_latent(pooled, weight, eps)
        entries[rows] = rotate_interleaved_tail(latent[rows], meta.entry_positions[rows], rope)
    _update_state_reference(kv, score, meta, rings)
    return latent, entries


def _update_state_reference(kv: torch.Tensor, score: torch.Tensor | None, meta: CompressMetadata,
                            rings: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Store the step's rows whose positions are among their request's last ``ring`` into the state rings."""
    ring = meta.pool.ring
    if not ring:
        return
    batch = meta.batch
    pos = batch.positions[:kv.shape[0]].long()
    req = batch.token_to_req[:kv.shape[0]].long().clamp_min(0)
    keep = (pos >= 0) & (pos >= batch.seq_lens[req].long() - ring)
    slot, at = meta.state_slots[req[keep]].long(), pos[keep] % ring
    rings[0][slot, at] = kv[keep]
    if score is not None:
        rings[1][slot, at] = score[keep]


class KVCompressor:
    """One layer's compressor: ratio from ``pool`` (4 or 128: V4; 2 or 1: V4.1), ``dim`` output channels (512 for
    the attention's compressed caches, 128 for V4's indexer compressor), RMSNorm ``norm_weight (dim,)`` and
    ``eps``, ``ape (r, coff·dim)`` (V4 only), the compress ``rope``.

    ``forward(kv, score, meta, cache)`` (see :meth:`forward`) writes the entries completed this step into
    ``cache`` and returns their latents. ``entries`` is the last call's roped bf16 entries ``(T, dim)`` (a
    workspace, rows of tokens that completed one). The weights are kept as float32 copies on the pool's device.
    """

    def __init__(self, pool: CompressorStatePool, dim: int, norm_weight: torch.Tensor, eps: float,
                 ape: torch.Tensor | None = None, rope: RopeSpec = V4_COMPRESS_ROPE, backend: str = "auto") -> None:
        if not isinstance(pool, CompressorStatePool):
            raise TypeError(f"pool must be a CompressorStatePool, got {type(pool).__name__}")
        if pool.holds_tokens():  # this layer's rings would lack those requests' open windows: wrong entries
            raise ValueError("pool holds requests that have fed tokens already: make every compressor of a pool "
                             "before its first step")
        if not is_int(dim) or dim not in (INDEX_HEAD_DIM, 512):
            raise ValueError(f"dim must be the int 512 (attention) or {INDEX_HEAD_DIM} (indexer), got {dim!r}")
        if not isinstance(rope, RopeSpec) or rope.dim > dim:
            raise ValueError(f"rope must be a RopeSpec of at most dim={dim} channels, got {rope!r}")
        if not (isinstance(eps, (int, float)) and not isinstance(eps, bool) and 0 < eps < math.inf):
            raise ValueError(f"eps must be a positive finite number, got {eps!r}")
        self.pool, self.dim, self.eps, self.rope = pool, int(dim), float(eps), rope
        self.ratio = pool.ratio
        self.coff = 2 if self.ratio == OVERLAP_RATIO else 1
        self.width = self.coff * self.dim
        check_tensor("norm_weight", norm_weight, shape=(self.dim,),
                     dtype=(torch.float32, torch.bfloat16, torch.float16))
        check_finite("norm_weight", norm_weight)  # once (a sync): a NaN weight would make every entry NaN
        # a normalised latent's channel is at most sqrt(dim) times its weight (x / rms(x) <= sqrt(dim)), its rope pair
        # sqrt(2) times that: a weight under this bound keeps every entry finite in bf16 on both backends (at 3e38 the
        # reference refused the entries after its state ring moved, naming keys, and the kernels wrote inf entries)
        bound = torch.finfo(torch.bfloat16).max / math.sqrt(2 * self.dim)
        largest = float(norm_weight.detach().abs().max()) if norm_weight.numel() else 0.0
        if largest >= bound:
            raise ValueError(f"norm_weight must be below {bound:.3g} in magnitude (an entry's channel can reach "
                             f"sqrt(2 · dim) times its weight, past bf16's range), got {largest:.3g}")
        self.norm_weight = norm_weight.detach().to(device=pool.device, dtype=torch.float32).contiguous()
        if self.ratio in APE_RATIOS:
            if ape is None:
                raise ValueError(f"ape is required at ratio {self.ratio} (V4): shape ({self.ratio}, {self.width})")
            check_tensor("ape", ape, shape=(self.ratio, self.width),
                         dtype=(torch.float32, torch.bfloat16, torch.float16))
            check_finite("ape", ape)
            self.ape = ape.detach().to(device=pool.device, dtype=torch.float32).contiguous()
        elif ape is not None:
            raise ValueError(f"ape must be None at ratio {self.ratio} (V4.1's compressors have no position bias)")
        else:
            self.ape = None
        resolve_backend(backend, pool.device)
        self.backend = backend
        self.layer = pool.add_layer(self.width)
        self.inv_freq = rope.inv_freq(pool.device)
        self.entries: torch.Tensor | None = None
        self._latent: torch.Tensor | None = None
        self._last_step = pool.steps  # the pool step this compressor last ran

    def _check(self, kv: torch.Tensor, score: torch.Tensor | None, meta: CompressMetadata, cache: object) -> None:
        dev = self.pool.device
        if not isinstance(meta, CompressMetadata):
            raise TypeError(f"meta must be CompressMetadata (build_compress_metadata), got {type(meta).__name__}")
        if not meta._filled:
            raise ValueError("meta must be filled by build_compress_metadata: a CompressMetadata made or replaced by "
                             "hand is not checked against its pool and batch")
        if meta.pool is not self.pool:
            raise ValueError("meta was built for another CompressorStatePool than this compressor's")
        meta.check_current()
        if meta.step < self._last_step or (meta.step == self._last_step and not meta.repeatable):
            raise ValueError(f"meta is step {meta.step} of the pool and this compressor has run step "
                             f"{self._last_step}: a step runs once (again only where no request adds more than "
                             f"{REPEATABLE_STEP_TOKENS} tokens)")
        if meta.step > self._last_step + 1:  # its state ring would lack the skipped steps' tokens
            raise ValueError(f"meta is step {meta.step} of the pool and this compressor last ran step "
                             f"{self._last_step}: every compressor of a pool runs every step")
        check_tensor("kv", kv, dtype=self.pool.dtype, shape=(None, self.width), device=dev)
        lo, hi = meta.batch.num_tokens, meta.batch.token_capacity
        if not lo <= kv.shape[0] <= hi:
            raise ValueError(f"kv must have between num_tokens={lo} and token_capacity={hi} rows, got {kv.shape[0]}")
        if self.ratio == 1:
            if score is not None:
                raise ValueError("score must be None at ratio 1 (the entry is the normed kv: nothing is pooled)")
        else:
            check_tensor("score", score, dtype=self.pool.dtype, shape=tuple(kv.shape), device=dev)
        if isinstance(cache, PagedCache):
            if cache.fmt.dim != self.dim:
                raise ValueError(f"cache holds {cache.fmt.dim}-d entries, this compressor makes {self.dim}-d ones")
            ok = cache.block_size == meta.batch.block_sizes[meta.kind]
        elif isinstance(cache, IndexerKeyCache):
            if self.dim != INDEX_HEAD_DIM:
                raise ValueError(f"an IndexerKeyCache takes {INDEX_HEAD_DIM}-d keys, this compressor makes "
                                 f"{self.dim}-d entries")
            ok = cache.block_size == meta.batch.block_sizes[meta.kind]
        else:
            raise TypeError(f"cache must be a PagedCache or an IndexerKeyCache, got {type(cache).__name__}")
        if not ok:
            raise ValueError(f"cache has block_size {cache.block_size}, the batch's {meta.kind!r} block tables "
                             f"{meta.batch.block_sizes[meta.kind]}")
        if cache.device != dev:
            raise ValueError(f"cache must be on {dev}, got {cache.device}")
        meta.batch.check_cache_holds_blocks(meta.kind, cache.num_blocks, "cache")
        if resolve_backend(self.backend, dev) == "reference" or debug_checks_enabled():  # values: a sync
            # before the state is touched: a failed call writes nothing (padding rows may hold anything)
            check_finite("kv", kv[:lo])
            if score is not None:
                check_finite("score", score[:lo])

    def replayed(self, meta: CompressMetadata) -> None:
        """A CUDA graph holding one of this compressor's calls replayed for ``meta``'s step: record the step as
        run, as the call would (a replay runs no Python), so an eager call after it checks its step against it."""
        if not isinstance(meta, CompressMetadata) or meta.pool is not self.pool:
            raise ValueError("meta must be CompressMetadata of this compressor's pool")
        if meta.step < self._last_step:
            raise ValueError(f"meta is step {meta.step} of the pool and this compressor has run step "
                             f"{self._last_step}")
        self._last_step = meta.step

    def forward(self, kv: torch.Tensor, score: torch.Tensor | None, meta: CompressMetadata,
                cache: PagedCache | IndexerKeyCache) -> torch.Tensor:
        """Compress one step: ``kv``, ``score`` ``(T, coff·dim)`` in the pool's dtype, rows the batch's tokens
        (``num_tokens <= T <= token_capacity``; ``score`` None at ratio 1), ``meta`` this step's
        :class:`CompressMetadata` of the pool. Writes each completed entry into ``cache`` at its slot and the open
        windows into the state. Returns the latents ``(T, dim)`` bf16 (before the rope), row ``t`` the entry
        token ``t`` completes, zeros elsewhere (a workspace reused by the next call)."""
        self._check(kv, score, meta, cache)
        self._last_step = meta.step
        slots = meta.entry_slots[:kv.shape[0]]
        if resolve_backend(self.backend, kv.device) == "reference":
            latent, self.entries = compress_reference(kv, score, self.ape, self.norm_weight, self.eps, self.rope,
                                                      meta, self.layer, self.dim)
            if isinstance(cache, PagedCache):
                quantize_and_insert(self.entries, cache.data, slots, cache.fmt, backend="reference",
                                    kv_scale=cache.kv_scale)
            else:
                insert_index_keys(self.entries, cache, slots, backend="reference")
            return latent
        # the kernels take arguments checked above (the entries and slots are this call's own buffers)
        from .ops.triton import cache as triton_cache
        from .ops.triton import compress as triton_compress
        from .ops.triton import index_cache

        latent, entries = self._workspace(kv.shape[0])
        triton_compress.compress(kv, score, self.ape, self.norm_weight, self.eps, self.inv_freq, meta,
                                 self.pool.layers[self.layer], latent, entries)
        if isinstance(cache, PagedCache):
            paged, fmt = resolve_cache_once(cache.data, cache.fmt)  # validated once per cache tensor
            triton_cache.quantize_and_insert(entries, paged, fmt, slots, cache.kv_scale)
        else:
            index_cache.insert_index_keys(entries, cache.data, cache.fmt == "fp8", slots, None, None)
        return latent

    __call__ = forward

    def _workspace(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The latent and entry buffers of ``rows`` rows (kept while the row count stays: fixed addresses)."""
        if self._latent is None or self._latent.shape[0] != rows:
            self._latent = torch.empty(rows, self.dim, dtype=torch.bfloat16, device=self.pool.device)
            self.entries = torch.empty_like(self._latent)
        return self._latent, self.entries
