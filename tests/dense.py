"""Independent float64 models used as oracles by the tests; they share no code with ``sparse_mla``.

* :func:`dense_attention` — masked attention with sink and LSE, written from DESIGN §1 with a plain
  loop over tokens. Keys are given per token as a list of vectors built straight from token values
  (never through the library's gather), with a validity flag per key: an invalid key is never
  read, so it may hold NaN.
* :func:`e4m3_round`, :func:`e4m3_value`, :func:`scale_exponents`, :func:`fake_quant` — the fp8
  quantisation of DESIGN §2 from first principles (bit patterns of e4m3fn / ue8m0, round half to
  even, the scale rule ``2^ceil(log2(max(amax/448, 1e-4)))``), in float64.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

D_V = 512  # value width: the first 512 dims of a key (DESIGN §1)


def dense_attention(q: torch.Tensor, keys: Sequence[Sequence[torch.Tensor]],
                    valid: Sequence[Sequence[bool]] | None = None, sink: torch.Tensor | None = None,
                    scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q: ``(T, H, d)``; ``keys[t]``: the ``n_t`` key vectors (each ``(d,)``) token ``t`` attends to,
    duplicates counted once per occurrence; ``valid[t][j]`` False drops key ``j`` (default: all valid).
    sink: ``(H,)`` logits joining the denominator only (``-inf`` = no sink, ``+inf`` zeroes the row);
    scale defaults to ``d ** -0.5``.

    Returns out ``(T, H, 512)`` float64 and lse ``(T, H)`` float64 (natural log over the real keys,
    ``+inf`` with a zero output for a row with no valid key).
    """
    num_tokens, num_heads, dim = q.shape
    if scale is None:
        scale = dim ** -0.5
    out = torch.zeros(num_tokens, num_heads, D_V, dtype=torch.float64)
    lse = torch.full((num_tokens, num_heads), math.inf, dtype=torch.float64)
    for t in range(num_tokens):
        flags = [True] * len(keys[t]) if valid is None else list(valid[t])
        assert len(flags) == len(keys[t])
        kept = [k.double().reshape(-1) for k, ok in zip(keys[t], flags) if ok]
        if not kept:
            continue  # no valid key: output 0, lse +inf
        k = torch.stack(kept)  # (n, d)
        assert k.shape[1] == dim and bool(torch.isfinite(k).all())
        for h in range(num_heads):
            s = (k @ q[t, h].double()) * scale  # (n,)
            m = s.max()
            w = torch.exp(s - m)
            total = w.sum()
            lse[t, h] = m + torch.log(total)
            denom = total
            if sink is not None:
                denom = denom + torch.exp(sink[h].double() - m)  # +inf sink -> denominator inf -> 0
            out[t, h] = (w[:, None] * k[:, :D_V]).sum(0) / denom
    return out, lse


# ---------------------------------------------------------------------------------------------
# fp8 model


def e4m3_value(byte: int) -> float:
    """The value of one float8_e4m3fn bit pattern (1 sign, 4 exponent bits biased 7, 3 mantissa bits;
    no infinities, S.1111.111 is NaN)."""
    sign = -1.0 if byte & 0x80 else 1.0
    exp, man = (byte >> 3) & 0xF, byte & 0x7
    if exp == 0xF and man == 0x7:
        return math.nan
    if exp == 0:
        return sign * man * 2.0**-9
    return sign * (1 + man / 8) * 2.0 ** (exp - 7)


E4M3_TABLE = torch.tensor([e4m3_value(b) for b in range(256)], dtype=torch.float64)


def e4m3_round(y: torch.Tensor) -> torch.Tensor:
    """Round float64 values with ``|y| <= 448`` to the nearest e4m3 value, ties to even mantissa."""
    y = y.double()
    assert bool((y.abs() <= 448).all())
    a = y.abs()
    exp = torch.floor(torch.log2(torch.where(a > 0, a, 1.0))).clamp_min(-6)  # below 2^-6: subnormal grid
    step = torch.exp2(exp - 3)
    return torch.sign(y) * torch.round(a / step) * step  # torch.round: half to even


def e4m3_bytes(y: torch.Tensor) -> torch.Tensor:
    """e4m3 bit patterns of float64 values already on the e4m3 grid (``+0`` for zeros)."""
    table = E4M3_TABLE.clone()
    table[torch.isnan(table)] = math.inf
    table[0x80] = math.inf  # -0: never produced for a zero input here
    hit = (y.double().reshape(-1, 1) == table[None, :])
    assert bool((hit.sum(1) == 1).all()), "value not on the e4m3 grid"
    return hit.int().argmax(1).to(torch.uint8).view(y.shape)


def scale_exponents(nope: torch.Tensor, tile: int) -> torch.Tensor:
    """``ceil(log2(max(amax/448, 1e-4)))`` per tile, exactly (frexp, no log rounding): ``(n, tiles)`` int64."""
    x = nope.double()
    amax = x.view(x.shape[0], x.shape[1] // tile, tile).abs().amax(-1)
    r = torch.clamp_min(amax / 448.0, 1e-4)
    mant, exp = torch.frexp(r)  # r = mant * 2^exp, mant in [0.5, 1)
    return torch.where(mant == 0.5, exp - 1, exp).long()


FP8_LAYOUTS = {"fp8_v4": (448, 64), "fp8_v32": (512, 128)}  # nope dims, tile


def fake_quant(kv: torch.Tensor, fmt: str) -> torch.Tensor:
    """What a cache of ``fmt`` returns for bf16 tokens ``kv (n, d)``: ``(n, d)`` float64."""
    x = kv.double()
    if fmt == "bf16":
        return x.clone()
    nope_dim, tile = FP8_LAYOUTS[fmt]
    n = x.shape[0]
    scale = torch.exp2(scale_exponents(x[:, :nope_dim], tile).double())  # (n, tiles)
    y = x[:, :nope_dim].reshape(n, nope_dim // tile, tile) / scale[..., None]
    deq = (e4m3_round(y) * scale[..., None]).reshape(n, nope_dim)
    return torch.cat([deq, x[:, nope_dim:]], dim=1)
