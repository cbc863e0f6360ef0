"""Dense oracle (DESIGN §7.1): attention rebuilt from token positions alone, in float64.

It keeps each request's raw latents and compressed entries as plain tensors (the values the caches
hold, dequantised), builds a visibility mask over all of a request's keys from each token's position
— the window ``max(0, p-W+1) … p``, compressed visibility ``(w+1)·r <= p+1`` and, for the picks kinds
(V4's c4a, V4.1's c2a and c1a), the indexer's picks; for V3.2's dsa, the picked raw positions ``<= p`` — and
runs a dense masked softmax with the sink (a repeated pick counts once, as the model's mask does). It shares no
index code with :mod:`sparse_mla.metadata` or :mod:`sparse_mla.ops`: no slots, no block tables, no index lists,
and it states the visibility rule itself (``config.complete_entries`` is the library's statement of it).

One oracle holds one window cache's values and one compressed cache per kind: a V4.1 compressed cache that several
layers share (the source layer's) is set once and seen by every layer of its kind; layers that own their window
caches take an oracle each (:meth:`DenseOracle.with_raw`).
"""
from __future__ import annotations

import math

import torch

from .config import COMPRESS_RATIO, COMPRESSED_KINDS, LAYER_KINDS, PICKS_KINDS

D_OUT = 512


class DenseOracle:
    """Keys per request: raw latents by position and compressed entries by entry number.

    ``set_raw(r, latents, start)``: latents of positions ``start …`` (a request's oldest tokens may be
    omitted when no token of interest can see them); rows that are NaN are unknown keys. A key that
    some token sees but the oracle does not know is an error, never a silent zero.
    """

    def __init__(self, window: int) -> None:
        if window < 1:
            raise ValueError(f"window must be positive, got {window}")
        self.window = window
        self.raw: dict[int, tuple[int, torch.Tensor]] = {}
        self.compressed: dict[str, dict[int, torch.Tensor]] = {kind: {} for kind in COMPRESSED_KINDS}

    def set_raw(self, r: int, latents: torch.Tensor, start: int = 0) -> None:
        """Request ``r``'s raw latents ``(n, d)`` for positions ``start … start+n-1`` (V4's SWA keys, or V3.2's
        dsa keys)."""
        self.raw[r] = (start, latents.detach().cpu())

    def set_compressed(self, kind: str, r: int, entries: torch.Tensor) -> None:
        """Request ``r``'s compressed entries ``(n, d)`` of ``kind`` (one of :data:`~sparse_mla.config.COMPRESSED_KINDS`:
        c4a, c128a, c2a, c1a), entry ``w`` in row ``w``."""
        if kind not in self.compressed:
            raise ValueError(f"kind must be one of {COMPRESSED_KINDS}, got {kind!r}")
        self.compressed[kind][r] = entries.detach().cpu()

    def with_raw(self, raw: dict[int, tuple[int, torch.Tensor]]) -> DenseOracle:
        """Another oracle over the same compressed entries (shared, not copied) with other raw latents ``raw``
        (``{request: (start, latents)}``, as :meth:`set_raw` keeps them): a layer with its own window cache that
        reads a shared compressed cache (V4.1)."""
        other = DenseOracle(self.window)
        other.compressed, other.raw = self.compressed, dict(raw)
        return other

    def visibility(self, r: int, positions: torch.Tensor, kind: str,
                   picks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys of request ``r`` and which of them each token sees.

        positions: ``(n,)`` token positions; picks: picks kinds only (c4a, c2a, c1a, dsa), ``(n, k)`` local entry
        numbers or raw positions (dsa) (``-1`` none, any value allowed: invisible or out-of-range picks are simply not
        visible; None: none picked).
        Returns keys ``(K, d)`` float64 (raw latents, then compressed entries) and mask ``(n, K)`` bool.
        """
        if kind not in LAYER_KINDS:
            raise ValueError(f"kind must be one of {LAYER_KINDS}, got {kind!r}")
        start, raw = self.raw[r]
        p = positions.detach().cpu().long()[:, None]
        key_pos = torch.arange(start, start + raw.shape[0])[None, :]
        if kind == "dsa":
            return self._checked(r, kind, raw.double(), _picked(picks, p.shape[0], raw.shape[0], start) & (key_pos <= p))
        lo = (p - self.window + 1).clamp_min(0)
        if p.numel() and (bool((lo < start).any()) or bool((p >= start + raw.shape[0]).any())):
            raise ValueError(f"request {r}: a token sees raw positions the oracle was not given "
                             f"(it holds {start} … {start + raw.shape[0] - 1})")
        masks = [(key_pos >= lo) & (key_pos <= p)]
        keys = [raw]
        if kind != "swa":
            ratio = COMPRESS_RATIO[kind]
            comp = self.compressed[kind].get(r, raw.new_zeros(0, raw.shape[1]))
            w = torch.arange(comp.shape[0])[None, :]
            visible = (w + 1) * ratio <= p + 1
            if kind in PICKS_KINDS:
                visible &= _picked(picks, p.shape[0], comp.shape[0])
            masks.append(visible)
            keys.append(comp)
        return self._checked(r, kind, torch.cat(keys).double(), torch.cat(masks, dim=1))

    @staticmethod
    def _checked(r: int, kind: str, keys: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        unknown = keys.isnan().any(dim=1)  # entries the caller never filled in: fine while nobody sees them
        if bool((mask & unknown[None, :]).any()):
            raise ValueError(f"request {r}: a token sees a {kind} key the oracle holds as unknown (NaN)")
        return torch.where(unknown[:, None], 0.0, keys), mask

    def attend(self, q: torch.Tensor, token_to_req: torch.Tensor, positions: torch.Tensor, kind: str,
               sink: torch.Tensor | None = None, scale: float | None = None,
               picks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Dense float64 attention for tokens ``q (n, H, d)`` of requests ``token_to_req (n,)`` (``-1``:
        padding, output 0) at ``positions (n,)``. picks: ``(n, k)`` (picks kinds). sink: ``(H,)`` or None.

        Returns out ``(n, H, 512)`` and lse ``(n, H)`` (natural log over real keys; ``+inf`` and out 0
        for a token with no visible key), both float64 on the CPU.
        """
        q = q.detach().cpu().double()
        n, num_heads, dim = q.shape
        scale = dim ** -0.5 if scale is None else scale
        reqs = token_to_req.detach().cpu().long()
        positions = positions.detach().cpu()
        picks = None if picks is None else picks.detach().cpu()
        out = torch.zeros(n, num_heads, D_OUT, dtype=torch.float64)
        lse = torch.full((n, num_heads), math.inf, dtype=torch.float64)
        for r in sorted(set(reqs.tolist()) - {-1}):
            rows = (reqs == r).nonzero().squeeze(1)
            keys, mask = self.visibility(r, positions[rows], kind, None if picks is None else picks[rows])
            o, l = masked_attention(q[rows], keys, mask, sink, scale)
            out[rows], lse[rows] = o, l
        return out, lse


def _picked(picks: torch.Tensor | None, n: int, num_keys: int, first: int = 0) -> torch.Tensor:
    """``(n, num_keys)`` bool: which of keys ``first … first+num_keys-1`` each token's ``picks (n, k)`` name
    (any value allowed: ``-1`` and picks outside that range name nothing; a repeat names its key once)."""
    picked = torch.zeros(n, num_keys + 1, dtype=torch.bool)
    if picks is not None:
        pk = picks.detach().cpu().long() - first
        pk = torch.where((pk >= 0) & (pk < num_keys) & (picks.detach().cpu() >= 0), pk, num_keys)  # others -> dump
        picked.scatter_(1, pk, True)
    return picked[:, :num_keys]


def masked_attention(q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor, sink: torch.Tensor | None,
                     scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 softmax attention of ``q (n, H, d)`` over ``keys (K, d)`` where ``mask (n, K)``, K = V.

    The sink joins the denominator only: ``out = Σ e^{s_k} v_k / (e^{sink} + Σ e^{s_k})``.
    """
    s = torch.einsum("nhd,kd->nhk", q.double(), keys.double()) * scale
    s = s.masked_fill(~mask[:, None, :], -math.inf)
    any_key = mask.any(dim=1)[:, None]
    lse = torch.logsumexp(s, dim=-1)
    m = torch.where(any_key, s.amax(dim=-1), 0.0)
    w = torch.exp(s - m[..., None])
    denom = w.sum(-1)
    if sink is not None:
        denom = denom + torch.exp(sink.detach().cpu().double()[None, :] - m)
    out = torch.einsum("nhk,kd->nhd", w, keys[:, :D_OUT].double()) / denom[..., None]
    out = torch.where(any_key[..., None], out, 0.0)
    return out, torch.where(any_key, lse, math.inf)
