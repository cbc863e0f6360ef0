"""An independent float64 attention, written from DESIGN §1 with a plain loop over tokens.

Used by the tests as the oracle for the ops; shares no code with ``sparse_mla.ops``.
"""
from __future__ import annotations

import math

import torch


def dense_attention(q: torch.Tensor, keys: list[torch.Tensor], sink: torch.Tensor | None, scale: float):
    """q: (T, H, d); keys[t]: (n_t, d) the keys token t attends to (any n_t >= 0, duplicates allowed).

    Returns out (T, H, 512) float64 and lse (T, H) float64 (+inf for a token with no key).
    """
    num_tokens, num_heads, _ = q.shape
    out = torch.zeros(num_tokens, num_heads, 512, dtype=torch.float64)
    lse = torch.full((num_tokens, num_heads), math.inf, dtype=torch.float64)
    for t in range(num_tokens):
        k = keys[t].double()
        if k.shape[0] == 0:
            continue
        for h in range(num_heads):
            s = (k @ q[t, h].double()) * scale
            m = s.max()
            w = torch.exp(s - m)
            denom = w.sum()
            lse[t, h] = m + torch.log(denom)
            if sink is not None:
                denom = denom + torch.exp(sink[h].double() - m)  # e^{sink} joins the denominator only
            out[t, h] = (w[:, None] * k[:, :512]).sum(0) / denom
    return out, lse
