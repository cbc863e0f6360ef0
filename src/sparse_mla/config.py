"""Model presets: the attention-relevant numbers of the DeepSeek models we serve, and the layer kinds.

Layer kinds (DESIGN §1), one family: every kind but V3.2's reads a sliding window of raw tokens plus at most one
compressed scope of ratio ``r``:

* V4: ``swa`` (the window alone), ``c4a`` (ratio 4, indexer top-k), ``c128a`` (ratio 128, every complete entry);
* V4.1: ``swa``, ``c2a`` (ratio 2, indexer top-k), ``c1a`` (ratio 1: full-resolution entries, indexer top-k);
* V3.2: ``dsa`` (raw tokens, indexer top-k, no window).

The visibility rule of every compressed scope (and of V3.2's raw picks, ratio 1) is :func:`complete_entries`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TypeVar

from ._checks import check_positive_int, is_int
from .formats import PLANAR_SUFFIX, READERS

V4_KINDS = ("swa", "c4a", "c128a")
V41_KINDS = ("swa", "c2a", "c1a")
WINDOWED_KINDS = V4_KINDS + V41_KINDS[1:]  # the kinds that read the window: a batch of V4 / V4.1 layers
LAYER_KINDS = WINDOWED_KINDS + ("dsa",)
COMPRESS_RATIO = {"swa": 1, "c4a": 4, "c128a": 128, "c2a": 2, "c1a": 1, "dsa": 1}
COMPRESSED_KINDS = ("c4a", "c128a", "c2a", "c1a")  # kinds with a compressed cache (entries of their ratio)
KIND_OF_RATIO = {1: "swa", 4: "c4a", 128: "c128a"}  # V4 layers by their compress ratio
FAMILIES = ("v4", "v4.1", "v3.2")
V41_KIND_OF_RATIO = {0: "swa", 2: "c2a", 1: "c1a"}  # V4.1 layers by their published compress ratio (0: window only)
# Kinds whose layers take the indexer's picks (``topk_indices``): local compressed entries (c4a, c2a, c1a), or dsa
# raw positions.
PICKS_KINDS = ("c4a", "c2a", "c1a", "dsa")
# Tokens per block of each cache (DESIGN §2): 64 raw tokens or entries; c128a's 2 entries cover 256 raw tokens.
DEFAULT_BLOCK_SIZE = {"swa": 64, "c4a": 64, "c128a": 2, "c2a": 64, "c1a": 64, "dsa": 64}
# The cache-format pairs a layer may read beside one another (window cache, compressed cache), by encoding (a format
# name without formats.py's "_planar" layout suffix): one encoding, or a compressed cache beside the window encoding
# its row of formats.READERS names (V4.1's fp4 beside fp8, DESIGN §2)
MIXED_SCOPE_ENCODINGS = frozenset((r.beside, name.removesuffix(PLANAR_SUFFIX)) for name, r in READERS.items()
                                  if r.beside)

Count = TypeVar("Count")  # an int or an integer tensor


def complete_entries(num_tokens: Count, ratio: int) -> Count:
    """Compressed entries of ratio ``ratio`` complete once ``num_tokens`` raw tokens exist: ``num_tokens // ratio``
    (an int or an integer tensor, elementwise).

    The one visibility rule of every compressed scope (DESIGN §1, §3): entry ``w`` covers raw tokens up to
    ``(w+1)·r - 1``, so a token at position ``p`` sees entries ``w`` with ``(w+1)·r <= p+1``, i.e. the first
    ``complete_entries(p + 1, r)``; a request of ``seq_len`` tokens holds ``complete_entries(seq_len, r)`` entries.
    Ratio 1 (V4.1's c1a, V3.2's raw picks): entries ``0 … p``.
    """
    if type(ratio) is not int or ratio < 1:  # (0 divided by zero, a negative ratio counted backwards)
        check_positive_int("ratio", ratio)  # (the test above first: the builder counts entries per request)
    return num_tokens // ratio


def check_scope_formats(window: str, compressed: str, names: tuple[str, str] = ("kv", "extra_kv")) -> None:
    """A layer's two scopes' formats (format names, either page layout): one encoding, or (V4.1) an fp4 compressed
    cache beside an fp8 window cache (:data:`MIXED_SCOPE_ENCODINGS`); else ``ValueError`` naming the pair."""
    if not (isinstance(window, str) and isinstance(compressed, str)):
        raise TypeError(f"the scopes' formats must be format names (str), got {window!r} and {compressed!r}")
    pair = tuple(name.removesuffix(PLANAR_SUFFIX) for name in (window, compressed))
    if pair[0] != pair[1] and pair not in MIXED_SCOPE_ENCODINGS:
        mixed = " or ".join(f"{c} {names[1]} beside {w} {names[0]}" for w, c in sorted(MIXED_SCOPE_ENCODINGS))
        raise ValueError(f"cache format mismatch: {names[0]} holds {window}, {names[1]} {compressed}; a layer's caches "
                         f"hold one format (either page layout), or {mixed}")


@dataclass(frozen=True)
class ModelConfig:
    """Attention numbers of one model. ``compress_ratios[i]`` is layer ``i``'s ratio as its family states it: V4
    presets 1 (window only), 4 or 128; V4.1 as published, 0 (window only), 2 or 1 (:meth:`layer_kind`).

    kv_source_layer_ids (V4.1): the layers that write a compressed cache; a later compressed layer reads the cache of
    the nearest source at or before it (:meth:`kv_source_layer`). Empty: every compressed layer owns its cache (V4).
    index_source_layer_ids (V4.1): the layers whose indexer runs; a later layer reuses the picks of the nearest one
    at or before it (:meth:`index_source_layer`). Empty: every picks layer runs its own indexer.
    """

    name: str
    num_heads: int
    head_dim: int  # latent width per token (q and k), V = the first 512 dims
    rope_dim: int
    window: int  # SWA window W (0 = no sliding window: V3.2)
    index_topk: int
    compress_ratios: tuple[int, ...]
    softmax_scale: float
    kv_format: str  # the cache format the production stacks use for this model
    family: str = "v4"  # one of FAMILIES: how compress_ratios name the layer kinds
    kv_source_layer_ids: tuple[int, ...] = ()
    index_source_layer_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"family must be one of {FAMILIES}, got {self.family!r}")
        ratios = self.compress_ratios
        if not isinstance(ratios, tuple) or not ratios or not all(is_int(r) and r >= 0 for r in ratios):
            raise ValueError(f"compress_ratios must be a non-empty tuple of ints >= 0, got {ratios!r}")
        if not (is_int(self.window) and self.window >= 0):
            raise ValueError(f"window must be an int >= 0 (0: no sliding window, V3.2), got {self.window!r}")
        if self.family != "v3.2" and self.window != 0:  # (V3.2's layers are all dsa whatever their ratio)
            known = V41_KIND_OF_RATIO if self.family == "v4.1" else KIND_OF_RATIO
            bad = [r for r in ratios if r not in known]
            if bad:
                raise ValueError(f"compress_ratios of a {self.family} model must be in {tuple(known)}, got {bad[0]}")
        # a source must be a layer of the kinds it serves: a window-only one would make a later layer read nothing
        for name, kinds in (("kv_source_layer_ids", COMPRESSED_KINDS), ("index_source_layer_ids", PICKS_KINDS)):
            ids = getattr(self, name)
            if not isinstance(ids, tuple) or not all(is_int(i) and 0 <= i < len(ratios) for i in ids):
                raise ValueError(f"{name} must be a tuple of layer ids in [0, {len(ratios)}), got {ids!r}")
            wrong = [i for i in ids if self.layer_kind(i) not in kinds]
            if wrong:
                raise ValueError(f"{name} names layer {wrong[0]}, a {self.layer_kind(wrong[0])} layer: its sources "
                                 f"are {'/'.join(kinds)} layers")

    @property
    def nope_dim(self) -> int:
        return self.head_dim - self.rope_dim

    @property
    def num_layers(self) -> int:
        return len(self.compress_ratios)

    def layer_kind(self, layer: int) -> str:
        """The kind of layer ``layer``, in ``[0, num_layers)``: ``swa``, ``c4a`` or ``c128a`` (V4), ``swa``, ``c2a``
        or ``c1a`` (V4.1), ``dsa`` (V3.2, a model without a sliding window)."""
        self._check_layer(layer)
        if self.family == "v3.2" or self.window == 0:  # V3.2: no sliding window
            return "dsa"
        return (V41_KIND_OF_RATIO if self.family == "v4.1" else KIND_OF_RATIO)[self.compress_ratios[layer]]

    def kv_source_layer(self, layer: int) -> int | None:
        """The layer whose compressed cache layer ``layer`` reads (None for a window-only or dsa layer): the nearest
        of :attr:`kv_source_layer_ids` at or before it, or the layer itself when the model shares no caches (V4)."""
        return self._source(layer, self.kv_source_layer_ids, "kv_source_layer_ids", COMPRESSED_KINDS)

    def index_source_layer(self, layer: int) -> int | None:
        """The layer whose indexer picks layer ``layer`` attends with (None for a layer without picks): the nearest of
        :attr:`index_source_layer_ids` at or before it, or the layer itself when every layer runs its indexer."""
        return self._source(layer, self.index_source_layer_ids, "index_source_layer_ids", PICKS_KINDS)

    def _source(self, layer: int, sources: tuple[int, ...], name: str, kinds: tuple[str, ...]) -> int | None:
        if self.layer_kind(layer) not in kinds:
            return None
        if not sources:
            return layer
        before = [s for s in sources if s <= layer]
        if not before:
            raise ValueError(f"layer {layer} ({self.layer_kind(layer)}) comes before the first of {name} {sources}")
        return max(before)

    def _check_layer(self, layer: object) -> None:
        if not is_int(layer) or not 0 <= layer < self.num_layers:
            raise ValueError(f"layer must be an int in [0, {self.num_layers}), got {layer!r}")


def _ratios(pattern: list[int]) -> tuple[int, ...]:
    """A public V4 ``compress_ratios`` list (0 = window-only layer, last entry = the MTP layer) as ratios 1/4/128."""
    return tuple(1 if r == 0 else r for r in pattern)


PRESETS: dict[str, ModelConfig] = {
    # DeepSeek-V4-Flash config.json (HF deepseek-ai/DeepSeek-V4-Flash; transformers
    # models/deepseek_v4/configuration_deepseek_v4.py defaults): 43 layers + 1 MTP, 64 heads, 1 KV head,
    # head_dim 512 (rope = last 64), sliding_window 128, index_topk 512,
    # compress_ratios [0, 0] + [4, 128] * 20 + [4] + [0]. vLLM models/deepseek_v4.py: scale head_dim ** -0.5.
    "deepseek-v4-flash": ModelConfig("deepseek-v4-flash", num_heads=64, head_dim=512, rope_dim=64, window=128,
                                     index_topk=512, compress_ratios=_ratios([0, 0] + [4, 128] * 20 + [4] + [0]),
                                     softmax_scale=512 ** -0.5, kv_format="fp8_v4"),
    # DeepSeek-V4-Pro config.json: 61 layers + 1 MTP, 128 heads, head_dim 512, sliding_window 128,
    # index_topk 1024, compress_ratios [128] + [128, 4] * 30 + [0] (no window-only layer).
    "deepseek-v4-pro": ModelConfig("deepseek-v4-pro", num_heads=128, head_dim=512, rope_dim=64, window=128,
                                   index_topk=1024, compress_ratios=_ratios([128] + [128, 4] * 30 + [0]),
                                   softmax_scale=512 ** -0.5, kv_format="fp8_v4"),
    # DeepSeek-V4.1-Flash (DESIGN §3; transformers deepseek_v41, not in 5.23.0): 40 layers, 64 heads, one 512-d KV
    # head (rope 64), a 128-token window on every layer, compress_ratios [0, 0] + [2] * 18 + [1] * 20, index_topk 512,
    # compressed caches written by kv_source_layer_ids [2, 8, 14, 20]. index_source_layer_ids
    # [2, 8, 14, 20, 24, 28, 32, 36] as the checkpoint's config.json gives them (not in DESIGN §3: quoted by readers
    # of the released config). Scale head_dim ** -0.5 as V4; window cache fp8_v41 (FlashMLA 2026-09-30).
    "deepseek-v4.1-flash": ModelConfig("deepseek-v4.1-flash", num_heads=64, head_dim=512, rope_dim=64, window=128,
                                       index_topk=512, compress_ratios=tuple([0, 0] + [2] * 18 + [1] * 20),
                                       softmax_scale=512 ** -0.5, kv_format="fp8_v41", family="v4.1",
                                       kv_source_layer_ids=(2, 8, 14, 20),
                                       index_source_layer_ids=(2, 8, 14, 20, 24, 28, 32, 36)),
    # DeepSeek-V3.2 config.json / DeepSeek-V3.2-Exp inference/model.py: 61 layers + 1 MTP, 128 heads,
    # kv_lora_rank 512 + rope 64 = 576-d latent, index_topk 2048, every layer sparse over raw tokens.
    # Scale: qk_head_dim (192) ** -0.5 * mscale ** 2, mscale = 0.1 * ln(yarn factor 40) + 1.
    "deepseek-v3.2": ModelConfig("deepseek-v3.2", num_heads=128, head_dim=576, rope_dim=64, window=0,
                                 index_topk=2048, compress_ratios=(1,) * 62,
                                 softmax_scale=192 ** -0.5 * (0.1 * math.log(40) + 1) ** 2, kv_format="fp8_v32",
                                 family="v3.2"),
}


def get_config(name: str) -> ModelConfig:
    """The preset named ``name`` (one of :data:`PRESETS`)."""
    if not isinstance(name, str) or name not in PRESETS:
        raise ValueError(f"name must be one of {sorted(PRESETS)}, got {name!r}")
    return PRESETS[name]
