"""Dense oracle (DESIGN §7.1): attention rebuilt from token positions alone, in float64.

It keeps each request's raw latents and compressed entries as plain tensors (the values the caches
hold, dequantised), builds each token's visible keys from its position — the window, the
compressed visibility ``(w+1)·r <= p+1`` and the indexer's picks — and runs a masked softmax with
the sink. It shares no index code with :mod:`sparse_mla.metadata` or :mod:`sparse_mla.ops`.
"""
from __future__ import annotations

import torch


class DenseOracle:
    """raw[r]: ``(seq_len_r, d)`` latents of request r by position; compressed[kind][r]: ``(n, d)`` entries."""

    def __init__(self) -> None:
        self.raw: dict[int, torch.Tensor] = {}
        self.compressed: dict[str, dict[int, torch.Tensor]] = {"c4a": {}, "c128a": {}}

    def visible_keys(self, r: int, pos: int, kind: str, window: int, picks: list[int] | None = None) -> torch.Tensor:
        """Keys of the token at ``pos`` of request r: ``(n, d)`` float64, in no particular order."""
        keys = [self.raw[r][max(0, pos - window + 1): pos + 1]]
        if kind == "c128a":
            keys.append(self.compressed[kind][r][: (pos + 1) // 128])
        elif kind == "c4a":
            ok = [w for w in (picks or []) if w >= 0 and (w + 1) * 4 <= pos + 1]
            keys.append(self.compressed[kind][r][ok])
        return torch.cat(keys).double()

    def attend(self, q: torch.Tensor, keys: torch.Tensor, sink: torch.Tensor | None, scale: float) -> torch.Tensor:
        """q: ``(H, d)``; keys: ``(n, d)``. Returns ``(H, 512)`` float64 (zeros when n = 0)."""
        if keys.shape[0] == 0:
            return torch.zeros(q.shape[0], 512, dtype=torch.float64)
        s = q.double() @ keys.T * scale
        m = s.amax(dim=1, keepdim=True)
        w = torch.exp(s - m)
        denom = w.sum(dim=1, keepdim=True)
        if sink is not None:
            denom = denom + torch.exp(sink.double()[:, None] - m)
        return (w @ keys[:, :512]) / denom
