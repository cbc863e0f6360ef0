"""Model presets: the attention-relevant numbers of the DeepSeek models we serve.

Layer kinds (DESIGN §1): V4's ``swa`` (compress ratio 1), ``c4a`` (ratio 4, indexer top-k), ``c128a``
(ratio 128, every complete entry), and V3.2's ``dsa`` (raw tokens, indexer top-k, no window).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ._checks import is_int

V4_KINDS = ("swa", "c4a", "c128a")
LAYER_KINDS = V4_KINDS + ("dsa",)
COMPRESS_RATIO = {"swa": 1, "c4a": 4, "c128a": 128, "dsa": 1}
KIND_OF_RATIO = {1: "swa", 4: "c4a", 128: "c128a"}  # V4 layers by their compress ratio
# Kinds whose layers take the indexer's picks (``topk_indices``): local c4a entries, or dsa raw positions.
PICKS_KINDS = ("c4a", "dsa")
# Tokens per block of each cache (DESIGN §2): 64 raw tokens; compressed blocks cover 256 raw tokens.
DEFAULT_BLOCK_SIZE = {"swa": 64, "c4a": 64, "c128a": 2, "dsa": 64}


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
        """The kind of layer ``layer``, in ``[0, num_layers)``: ``swa``, ``c4a`` or ``c128a`` (V4), ``dsa``
        (V3.2, a model without a sliding window)."""
        if not is_int(layer) or not 0 <= layer < self.num_layers:
            raise ValueError(f"layer must be an int in [0, {self.num_layers}), got {layer!r}")
        return "dsa" if self.window == 0 else KIND_OF_RATIO[self.compress_ratios[layer]]


def _ratios(pattern: list[int]) -> tuple[int, ...]:
    """A public ``compress_ratios`` list (0 = window-only layer, last entry = the MTP layer) as ratios 1/4/128."""
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
    # DeepSeek-V3.2 config.json / DeepSeek-V3.2-Exp inference/model.py: 61 layers + 1 MTP, 128 heads,
    # kv_lora_rank 512 + rope 64 = 576-d latent, index_topk 2048, every layer sparse over raw tokens.
    # Scale: qk_head_dim (192) ** -0.5 * mscale ** 2, mscale = 0.1 * ln(yarn factor 40) + 1.
    "deepseek-v3.2": ModelConfig("deepseek-v3.2", num_heads=128, head_dim=576, rope_dim=64, window=0,
                                 index_topk=2048, compress_ratios=(1,) * 62,
                                 softmax_scale=192 ** -0.5 * (0.1 * math.log(40) + 1) ** 2, kv_format="fp8_v32"),
}


def get_config(name: str) -> ModelConfig:
    """The preset named ``name`` (one of :data:`PRESETS`)."""
    if not isinstance(name, str) or name not in PRESETS:
        raise ValueError(f"name must be one of {sorted(PRESETS)}, got {name!r}")
    return PRESETS[name]
