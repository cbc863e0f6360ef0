"""Rotary position embeddings of the sparse-index pipeline: the compressors' and the indexer's rope.

Two rotations (DESIGN §6):

* **V4 / V4.1** rotate the *last* ``dim`` (64) channels in interleaved pairs ``(2i, 2i+1)``
  (:func:`rotate_interleaved_tail`). Compressors and indexers use the *compress* rope — θ = 160000 with YaRN
  (factor 16 over 65536 original positions, beta_fast 32, beta_slow 1) and **no** mscale on cos / sin; the
  attention's q and window keys in c4a / c128a layers use it too, sliding-only layers θ = 10000 without YaRN.
* **V3.2's indexer** rotates the *first* ``dim`` (64) channels, half-split (channel ``i`` with ``i + dim/2``:
  :func:`rotate_half_split_head`), with the model's main rope (θ 10000, YaRN factor 40; its cos/sin scale is
  mscale(40, 1) / mscale(40, 1) = 1).

A :class:`RopeSpec` holds one rope's numbers; its :meth:`RopeSpec.inv_freq` is the one place the YaRN ramp is
written. Angles are ``position · inv_freq`` in float32 (as transformers computes them) and the rotation runs in
float32, the result cast back to the input's dtype. Kernels take ``inv_freq`` (``(dim // 2,)`` float32) and compute
the same angles.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ._checks import check_tensor, is_int


@dataclass(frozen=True)
class RopeSpec:
    """One rope: base ``theta``, rotated width ``dim`` (even), and YaRN's numbers (``factor`` 1: plain rope).

    ``inv_freq()`` is ``theta^(-2i/dim) · ((1 - γ_i) + γ_i / factor)`` with YaRN's ramp
    ``γ_i = clamp((i - low) / (high - low), 0, 1)`` over the pair index ``i``, ``low`` / ``high`` the truncated
    correction range of ``beta_fast`` / ``beta_slow`` at ``original_max_position`` (transformers'
    ``_compute_yarn_parameters``, ``truncate=True``). No mscale: cos / sin are not scaled.
    """

    theta: float
    dim: int = 64
    factor: float = 1.0
    original_max_position: int = 65536
    beta_fast: float = 32.0
    beta_slow: float = 1.0

    def __post_init__(self) -> None:
        if not (is_int(self.dim) and self.dim > 0 and self.dim % 2 == 0):
            raise ValueError(f"dim must be a positive even int, got {self.dim!r}")
        if not (isinstance(self.theta, (int, float)) and self.theta > 1):
            raise ValueError(f"theta must be a number > 1, got {self.theta!r}")
        if isinstance(self.factor, bool) or not (isinstance(self.factor, (int, float)) and self.factor >= 1):
            raise ValueError(f"factor must be a number >= 1, got {self.factor!r}")
        if not math.isfinite(self.theta) or not math.isfinite(self.factor):
            raise ValueError(f"theta and factor must be finite, got {self.theta!r} and {self.factor!r}")
        # YaRN's ramp: the correction range's logs and its division need a positive context and positive turns
        if not (is_int(self.original_max_position) and self.original_max_position >= 1):
            raise ValueError(f"original_max_position must be a positive int, got {self.original_max_position!r}")
        for name in ("beta_fast", "beta_slow"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0 < value < math.inf):
                raise ValueError(f"{name} must be a positive finite number, got {value!r}")

    def _correction_dim(self, rotations: float) -> float:
        """The pair index whose wavelength fits ``rotations`` turns in the original context."""
        return (self.dim * math.log(self.original_max_position / (rotations * 2 * math.pi))) / (
            2 * math.log(self.theta))

    def inv_freq(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """``(dim // 2,)`` float32: the angle per position of each rotated pair."""
        pairs = torch.arange(0, self.dim, 2, dtype=torch.float32, device=device)
        base = 1.0 / (self.theta ** (pairs / self.dim))
        if self.factor == 1:
            return base
        low = max(math.floor(self._correction_dim(self.beta_fast)), 0)
        high = min(math.ceil(self._correction_dim(self.beta_slow)), self.dim - 1)
        if low == high:
            high += 0.001  # transformers' guard against a zero-width ramp
        ramp = torch.clamp((torch.arange(self.dim // 2, dtype=torch.float32, device=device) - low) / (high - low),
                           0, 1)
        return base * (1 - ramp) + (base / self.factor) * ramp

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions (...)`` integer -> ``cos, sin`` of shape ``(..., dim // 2)`` float32."""
        angles = positions.to(torch.float32)[..., None] * self.inv_freq(positions.device)
        return angles.cos(), angles.sin()


# DeepSeek-V4's compress rope (DESIGN §6: config.json's rope_scaling for the compress rope type)
V4_COMPRESS_ROPE = RopeSpec(theta=160000.0, dim=64, factor=16.0, original_max_position=65536, beta_fast=32.0,
                            beta_slow=1.0)
# DeepSeek-V3.2's main rope (its indexer's): θ 10000, YaRN factor 40 over 4096 positions
V32_ROPE = RopeSpec(theta=10000.0, dim=64, factor=40.0, original_max_position=4096, beta_fast=32.0, beta_slow=1.0)


def rope_from_hf_config(config: Any, rope_type: str = "compress") -> RopeSpec:
    """The :class:`RopeSpec` of a transformers DeepSeek config's rope ``rope_type`` (V4: ``"main"`` or
    ``"compress"``, nested in ``config.rope_parameters``; V3.2: its one ``rope_parameters`` / ``rope_scaling``).
    A config without YaRN numbers gives the plain rope of its θ (as transformers does)."""
    source = "rope_parameters" if getattr(config, "rope_parameters", None) else "rope_scaling"
    params = getattr(config, source, None) or {}
    if not isinstance(params, dict):
        raise ValueError(f"config.{source} must be a dict, got {type(params).__name__}")
    if isinstance(params.get(rope_type), dict):
        params = params[rope_type]
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    if theta is None:
        raise ValueError(f"config has no rope_theta for rope type {rope_type!r}")
    dim = int(getattr(config, "qk_rope_head_dim", None) or 64)
    if params.get("rope_type", params.get("type", "default")) != "yarn":
        return RopeSpec(theta=float(theta), dim=dim)
    missing = [k for k in ("factor", "original_max_position_embeddings") if params.get(k) is None]
    if missing:
        raise ValueError(f"config's yarn rope {rope_type!r} lacks {missing}")
    return RopeSpec(theta=float(theta), dim=dim, factor=float(params["factor"]),
                    original_max_position=int(params["original_max_position_embeddings"]),
                    beta_fast=float(params.get("beta_fast", 32.0)), beta_slow=float(params.get("beta_slow", 1.0)))


def _check(x: torch.Tensor, positions: torch.Tensor, spec: RopeSpec) -> None:
    if not isinstance(spec, RopeSpec):
        raise TypeError(f"spec must be a RopeSpec, got {type(spec).__name__}")
    check_tensor("x", x, dtype=(torch.bfloat16, torch.float16, torch.float32, torch.float64))
    check_tensor("positions", positions, dtype=(torch.int32, torch.int64), device=x.device)
    if x.dim() < 1 or x.shape[-1] < spec.dim:
        raise ValueError(f"x must have a last dimension of at least {spec.dim} (the rope width), got {tuple(x.shape)}")
    if positions.dim() >= x.dim():  # the last dim of x holds the channels
        raise ValueError(f"positions must have fewer dims than x {tuple(x.shape)}, got {tuple(positions.shape)}")
    if tuple(positions.shape) != tuple(x.shape[:positions.dim()]):
        raise ValueError(f"positions must have shape {tuple(x.shape[:positions.dim()])} (x's leading dims), "
                         f"got {tuple(positions.shape)}")


def _broadcast(t: torch.Tensor, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``(*positions.shape, n)`` -> broadcastable over x's dims between the positions' and the last."""
    return t.view(*positions.shape, *([1] * (x.dim() - positions.dim() - 1)), t.shape[-1])


def rotate_interleaved_tail(x: torch.Tensor, positions: torch.Tensor, spec: RopeSpec = V4_COMPRESS_ROPE
                            ) -> torch.Tensor:
    """V4's rope: the last ``spec.dim`` channels of ``x (*P, ..., d)`` rotated in pairs ``(2i, 2i+1)`` by
    ``positions (*P)`` (its leading dims); the other channels unchanged. Returns a new tensor of x's dtype."""
    _check(x, positions, spec)
    cos, sin = (_broadcast(t, x, positions) for t in spec.cos_sin(positions))
    tail = x[..., -spec.dim:].float()
    even, odd = tail[..., 0::2], tail[..., 1::2]
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)
    return torch.cat((x[..., :-spec.dim], rotated.to(x.dtype)), dim=-1)


def rotate_half_split_head(x: torch.Tensor, positions: torch.Tensor, spec: RopeSpec = V32_ROPE,
                           cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """V3.2's indexer rope: the first ``spec.dim`` channels of ``x (*P, ..., d)``, channel ``i`` paired with
    ``i + dim/2``, rotated by ``positions (*P)``; the other channels unchanged. Returns x's dtype. cos_sin:
    ``spec.cos_sin(positions)`` when the caller made it already (a step's, shared by its layers)."""
    _check(x, positions, spec)
    if cos_sin is not None:
        if not (isinstance(cos_sin, tuple) and len(cos_sin) == 2):
            raise TypeError(f"cos_sin must be the pair spec.cos_sin(positions), got {type(cos_sin).__name__}")
        for name, t in zip(("cos", "sin"), cos_sin):
            check_tensor(f"cos_sin's {name}", t, dtype=torch.float32, shape=(*positions.shape, spec.dim // 2),
                         device=x.device)
    cos, sin = (_broadcast(t, x, positions) for t in (cos_sin or spec.cos_sin(positions)))
    head = x[..., :spec.dim].float()
    first, second = head[..., :spec.dim // 2], head[..., spec.dim // 2:]
    rotated = torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)
    return torch.cat((rotated.to(x.dtype), x[..., spec.dim:]), dim=-1)
