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


def _v4_ratios(num_layers: int) -> tuple[int, ...]:
    """Ratios of ``num_layers`` layers plus the MTP layer.

    Megatron-LM's DeepSeek-V4-Flash recipe (``csa_compress_ratios``) is ``[0, 0, 4] + [128, 4] * 20 + [0]``
    for 43 layers + 1 MTP layer, 0 marking a window-only layer (ratio 1 here); the same alternation is
    assumed for V4-Pro (not confirmed from a public config).
    """
    body = [128, 4] * ((num_layers - 3) // 2)
    return tuple(1 if r == 0 else r for r in [0, 0, 4] + body + [0])


PRESETS: dict[str, ModelConfig] = {
    # DeepSeek-V4-Flash: 43 layers, MQA over a 512-d latent (448 nope + 64 rope), 128-token window,
    # indexer top-k 512 (HF config: head_dim 512, qk_rope_head_dim 64, sliding_window 128, index_topk 512).
    "deepseek-v4-flash": ModelConfig("deepseek-v4-flash", num_heads=64, head_dim=512, rope_dim=64, window=128,
                                     index_topk=512, compress_ratios=_v4_ratios(43), softmax_scale=512 ** -0.5,
                                     kv_format="fp8_v4"),
    # DeepSeek-V4-Pro: same attention geometry with 128 query heads and top-k 1024 (DESIGN §1; FlashMLA's
    # MODEL1 decode cases use h_q 128 with 1024-wide compressed lists). Layer count 61 as in the V3 family.
    "deepseek-v4-pro": ModelConfig("deepseek-v4-pro", num_heads=128, head_dim=512, rope_dim=64, window=128,
                                   index_topk=1024, compress_ratios=_v4_ratios(61), softmax_scale=512 ** -0.5,
                                   kv_format="fp8_v4"),
    # DeepSeek-V3.2(-Exp) DSA: 61 layers, 128 heads, kv_lora_rank 512 + rope 64 = 576-d latent, index_topk 2048,
    # every layer sparse over raw tokens (no window, no compression); scale from qk_head_dim 192 (128 + 64).
    "deepseek-v3.2": ModelConfig("deepseek-v3.2", num_heads=128, head_dim=576, rope_dim=64, window=0,
                                 index_topk=2048, compress_ratios=(1,) * 61, softmax_scale=192 ** -0.5,
                                 kv_format="fp8_v32"),
}


def get_config(name: str) -> ModelConfig:
    """The preset named ``name`` (one of :data:`PRESETS`)."""
    if name not in PRESETS:
        raise ValueError(f"name must be one of {sorted(PRESETS)}, got {name!r}")
    return PRESETS[name]
