"""DeepSeek-V3.2 weight absorption (DESIGN §1, §5): queries into the 576-d latent space, outputs out of it.

MLA keeps one ``kv_lora_rank``-wide latent ``c`` per token (512 in the released models) plus a
shared 64-d rope key. ``kv_b_proj`` expands the latent into every head's no-rope key and value:
its weight, viewed as ``(H, qk_nope_head_dim + v_head_dim, kv_lora_rank)``, stacks ``W_UK (H,
qk_nope, r)`` over ``W_UV (H, v, r)``. Since ``q_nope · k_nope = q_nope · (W_UK c) = (q_nope W_UK)
· c``, attention can run over the latents directly (MQA, ``head_dim = r + rope``):

* :meth:`Absorption.absorb_query`: ``[q_nope · W_UK | q_pe]`` → ``(T, H, r + rope)`` bf16, what a
  ``dsa`` :class:`~sparse_mla.layer.SparseMLAAttention` takes;
* :meth:`Absorption.expand_output`: the layer's latent output ``o (T, H, r)`` → ``o · W_UVᵀ (T, H, v)``,
  what the model's ``o_proj`` takes.

Each is one batched matmul over the heads. With tensor parallelism a rank holds a contiguous
shard of the heads: build it from the full weight with ``heads=slice(...)`` or ``rank`` /
``world_size``, or from an already sharded weight (``num_heads`` = the shard's heads).
"""
from __future__ import annotations

import torch

from ._checks import check_tensor, is_int


class Absorption:
    """``W_UK (H, qk_nope, r)`` and ``W_UV (H, v, r)`` of one layer's (shard of) heads.

    Build with :meth:`from_kv_b_proj`. The matmuls run in the weights' dtype (``dtype`` there);
    inputs are cast to it.
    """

    def __init__(self, w_uk: torch.Tensor, w_uv: torch.Tensor) -> None:
        check_tensor("w_uk", w_uk, ndim=3)
        check_tensor("w_uv", w_uv, shape=(w_uk.shape[0], None, w_uk.shape[2]), dtype=w_uk.dtype, device=w_uk.device)
        self.w_uk, self.w_uv = w_uk, w_uv

    @property
    def num_heads(self) -> int:
        return self.w_uk.shape[0]

    @property
    def qk_nope_head_dim(self) -> int:
        return self.w_uk.shape[1]

    @property
    def v_head_dim(self) -> int:
        return self.w_uv.shape[1]

    @property
    def kv_lora_rank(self) -> int:
        return self.w_uk.shape[2]

    @classmethod
    def from_kv_b_proj(cls, weight: torch.Tensor, num_heads: int, qk_nope_head_dim: int, v_head_dim: int,
                       kv_lora_rank: int = 512, *, heads: slice | None = None, rank: int | None = None,
                       world_size: int | None = None, dtype: torch.dtype | None = None) -> "Absorption":
        """Split ``kv_b_proj.weight`` ``(num_heads · (qk_nope_head_dim + v_head_dim), kv_lora_rank)``.

        heads: the shard of heads to keep (a step-1 slice of ``range(num_heads)``); or ``rank`` and
        ``world_size``: the ``rank``-th of ``world_size`` equal contiguous shards. Neither: all heads.
        dtype: the weights' dtype (default: ``weight``'s). The weight is copied, not aliased.
        """
        for name, value in (("num_heads", num_heads), ("qk_nope_head_dim", qk_nope_head_dim),
                            ("v_head_dim", v_head_dim), ("kv_lora_rank", kv_lora_rank)):
            if not is_int(value) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        check_tensor("weight", weight, shape=(num_heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank))
        if not weight.is_floating_point():
            raise ValueError(f"weight must be a floating-point tensor, got {weight.dtype}")
        # (an int dtype truncated the weights; fp8 has no matmul, and an fp8 weight cast alone drops its block scales)
        if weight.dtype not in _WEIGHT_DTYPES:
            raise ValueError(f"weight (kv_b_proj.weight) must be one of {_WEIGHT_DTYPES}, got {weight.dtype}: "
                             f"dequantise an fp8 weight with its scales first")
        if dtype is not None and dtype not in _WEIGHT_DTYPES:
            raise ValueError(f"dtype must be None or one of {_WEIGHT_DTYPES}, got {dtype!r}")
        shard = _head_shard(num_heads, heads, rank, world_size)
        w = weight.detach().view(num_heads, qk_nope_head_dim + v_head_dim, kv_lora_rank)[shard]
        w = w.to(dtype or weight.dtype)
        return cls(w[:, :qk_nope_head_dim].contiguous(), w[:, qk_nope_head_dim:].contiguous())

    def absorb_query(self, q_nope: torch.Tensor, q_pe: torch.Tensor) -> torch.Tensor:
        """``q_nope (T, H, qk_nope)``, ``q_pe (T, H, rope)`` (rope already applied) → ``(T, H, r + rope)``
        bf16: ``[q_nope · W_UK | q_pe]``."""
        check_tensor("q_nope", q_nope, dtype=_WEIGHT_DTYPES, shape=(None, self.num_heads, self.qk_nope_head_dim),
                     device=self.w_uk.device)
        check_tensor("q_pe", q_pe, dtype=_WEIGHT_DTYPES, shape=(q_nope.shape[0], self.num_heads, None),
                     device=self.w_uk.device)
        out = torch.empty(q_nope.shape[0], self.num_heads, self.kv_lora_rank + q_pe.shape[2], dtype=torch.bfloat16,
                          device=q_nope.device)
        latent = torch.bmm(q_nope.transpose(0, 1).to(self.w_uk.dtype), self.w_uk)  # (H, T, r)
        out[..., : self.kv_lora_rank] = latent.transpose(0, 1)
        out[..., self.kv_lora_rank:] = q_pe
        return out

    def expand_output(self, o: torch.Tensor) -> torch.Tensor:
        """The attention's latent output ``o (T, H, r)`` → ``o · W_UVᵀ`` ``(T, H, v)`` in ``o``'s dtype."""
        check_tensor("o", o, dtype=_WEIGHT_DTYPES, shape=(None, self.num_heads, self.kv_lora_rank),
                     device=self.w_uv.device)
        v = torch.bmm(o.transpose(0, 1).to(self.w_uv.dtype), self.w_uv.transpose(1, 2))  # (H, T, v)
        return v.transpose(0, 1).to(o.dtype)


# the dtypes the absorbed weights and their operands may have (torch.bmm's real floating types)
_WEIGHT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def _head_shard(num_heads: int, heads: slice | None, rank: int | None, world_size: int | None) -> slice:
    """The heads a rank keeps, as a slice of ``range(num_heads)``."""
    if heads is not None:
        if rank is not None or world_size is not None:
            raise ValueError("give heads or rank/world_size, not both")
        if not isinstance(heads, slice):
            raise ValueError(f"heads must be a slice of range(num_heads), got {type(heads).__name__}")
        start, stop, step = heads.indices(num_heads)
        if step != 1 or start >= stop:
            raise ValueError(f"heads must be a non-empty contiguous slice of range({num_heads}), got {heads}")
        return slice(start, stop)
    if rank is None and world_size is None:
        return slice(0, num_heads)
    if not (is_int(world_size) and world_size >= 1 and num_heads % world_size == 0):
        raise ValueError(f"world_size must be a positive int dividing num_heads={num_heads}, got {world_size!r}")
    if not (is_int(rank) and 0 <= rank < world_size):
        raise ValueError(f"rank must be an int in [0, world_size={world_size}), got {rank!r}")
    per = num_heads // world_size
    return slice(rank * per, (rank + 1) * per)
