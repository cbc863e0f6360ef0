"""Model presets: the attention-relevant numbers of the DeepSeek models we serve.

Layer kinds (DESIGN §1): ``swa`` (compress ratio 1), ``c4a`` (ratio 4, indexer top-k), ``c128a``
(ratio 128, every complete entry).
"""
from __future__ import annotations

from dataclasses import dataclass

LAYER_KINDS = ("swa", "c4a", "c128a")
COMPRESS_RATIO = {"swa": 1, "c4a": 4, "c128a": 128}
KIND_OF_RATIO = {ratio: kind for kind, ratio in COMPRESS_RATIO.items()}
# Tokens per block of each cache (DESIGN §2): 64 raw tokens; compressed blocks cover 256 raw tokens.
DEFAULT_BLOCK_SIZE = {"swa": 64, "c4a": 64, "c128a": 2}


@dataclass(frozen=True)
class ModelConfig:
    """Attention numbers of one model. ``compress_ratios[i]`` is layer ``i``'s ratio (1, 4 or 128)."""

    name: str
    num_heads: int
    head_dim: int  # latent width per token (q and k), V = the first 512 dims
    rope_dim: int
    window: int  # SWA window W (0 = no sliding window: V3.2)
    index_topk: int
    compress_ratios: tuple[int, ...]
    softmax_scale: float
    kv_format: str  # the cache format the production stacks use for this model

    @property
    def nope_dim(self) -> int:
        return self.head_dim - self.rope_dim

    @property
    def num_layers(self) -> int:
        return len(self.compress_ratios)

    def layer_kind(self, layer: int) -> str:
        return KIND_OF_RATIO[self.compress_ratios[layer]]
