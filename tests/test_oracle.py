"""The dense oracle itself (DESIGN §7.1): visibility from positions, float64 masked softmax with sink."""
from __future__ import annotations

import math

import pytest
import torch
from dense import dense_attention

from sparse_mla.oracle import DenseOracle


def oracle_with(seq_len: int, window: int, seed: int = 0, start: int = 0) -> DenseOracle:
    gen = torch.Generator().manual_seed(seed)
    o = DenseOracle(window)
    o.set_raw(0, torch.randn(seq_len - start, 512, generator=gen, dtype=torch.float64), start)
    o.set_compressed("c4a", 0, torch.randn(seq_len // 4, 512, generator=gen, dtype=torch.float64))
    o.set_compressed("c128a", 0, torch.randn(seq_len // 128, 512, generator=gen, dtype=torch.float64))
    o.set_compressed("c2a", 0, torch.randn(seq_len // 2, 512, generator=gen, dtype=torch.float64))  # V4.1
    o.set_compressed("c1a", 0, torch.randn(seq_len, 512, generator=gen, dtype=torch.float64))
    return o


@pytest.mark.parametrize("kind", ["swa", "c4a", "c128a", "c2a", "c1a"])
def test_matches_a_loop_over_tokens_and_heads(kind):
    """Against tests/dense.py, an independent per-token, per-head loop fed the keys DESIGN §1 names."""
    window, seq = 6, 300
    o = oracle_with(seq, window)
    positions = torch.tensor([0, 3, 5, 126, 127, 128, 255, 299])
    picks = torch.tensor([[0, 1, 40, -1, 74, 10**6]] * len(positions), dtype=torch.int32)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(len(positions), 3, 512, generator=gen, dtype=torch.float64)
    sink = torch.tensor([0.5, -math.inf, 2.0], dtype=torch.float32)
    keys = []
    raw = o.raw[0][1]
    for p in positions.tolist():
        k = [raw[max(0, p - window + 1): p + 1]]
        if kind == "c128a":
            k.append(o.compressed["c128a"][0][: (p + 1) // 128])
        ratio = {"c4a": 4, "c2a": 2, "c1a": 1}.get(kind)
        if ratio:  # the picks kinds: the picked entries complete before p
            k.append(o.compressed[kind][0][[w for w in (0, 1, 40, 74) if (w + 1) * ratio <= p + 1]])
        keys.append(torch.cat(k))
    want, want_lse = dense_attention(q, keys, sink=sink, scale=0.05)
    got, lse = o.attend(q, torch.zeros(len(positions), dtype=torch.long), positions, kind, sink, 0.05,
                        picks if ratio else None)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, want_lse, rtol=1e-12, atol=1e-12)


def test_visibility_boundaries():
    o = oracle_with(300, 4)
    p = torch.tensor([2, 3, 126, 127])
    picks = torch.tensor([[0, 0, 1]] * 4)  # duplicate picks count once
    keys, mask = o.visibility(0, p, "c4a", picks)
    assert keys.shape == (300 + 75, 512)
    assert mask[:, :300].sum(1).tolist() == [3, 4, 4, 4]  # window max(0, p-3) .. p
    assert mask[1, :300].nonzero().squeeze(1).tolist() == [0, 1, 2, 3]
    # entry 0 (tokens 0..3) becomes visible at p = 3, entry 1 at p = 7
    assert mask[:, 300:].sum(1).tolist() == [0, 1, 2, 2]
    _, mask = o.visibility(0, p, "c128a")
    assert mask[:, 300:].sum(1).tolist() == [0, 0, 0, 1]  # entry 0 complete at p = 127


def test_padding_rows_sink_and_empty_rows():
    o = oracle_with(20, 4)
    q = torch.randn(3, 2, 512, dtype=torch.float64)
    out, lse = o.attend(q, torch.tensor([0, -1, 0]), torch.tensor([5, -1, 19]), "swa",
                        torch.tensor([math.inf, 0.0]), 0.1)
    assert (out[1] == 0).all() and torch.isinf(lse[1]).all()  # padding
    assert (out[:, 0] == 0).all()  # sink +inf zeroes the head
    assert out[0, 1].abs().sum() > 0 and torch.isfinite(lse[0]).all()
    no_sink, _ = o.attend(q, torch.tensor([0]), torch.tensor([5]), "swa", None, 0.1)
    minus_inf, _ = o.attend(q, torch.tensor([0]), torch.tensor([5]), "swa", torch.tensor([-math.inf] * 2), 0.1)
    assert torch.equal(no_sink, minus_inf)
    # c4a without picks: only the window
    swa, _ = o.attend(q[:1], torch.tensor([0]), torch.tensor([5]), "swa")
    c4a, _ = o.attend(q[:1], torch.tensor([0]), torch.tensor([5]), "c4a")
    assert torch.equal(swa, c4a)


def test_unknown_keys_are_an_error_only_when_visible():
    o = oracle_with(100, 4, start=60)  # positions 0..59 unknown
    q = torch.randn(2, 1, 512, dtype=torch.float64)
    o.attend(q, torch.tensor([0, 0]), torch.tensor([63, 99]), "swa")  # windows 60..63 and 96..99: known
    with pytest.raises(ValueError, match="raw positions the oracle was not given"):
        o.attend(q, torch.tensor([0, 0]), torch.tensor([62, 99]), "swa")
    comp = torch.randn(25, 512, dtype=torch.float64)
    comp[3] = math.nan
    o.set_compressed("c4a", 0, comp)
    o.attend(q, torch.tensor([0, 0]), torch.tensor([70, 99]), "c4a", picks=torch.tensor([[1, 2], [5, -1]]))
    with pytest.raises(ValueError, match="sees a c4a key the oracle holds as unknown"):
        o.attend(q, torch.tensor([0, 0]), torch.tensor([70, 99]), "c4a", picks=torch.tensor([[1, 3], [5, -1]]))


def test_v41_visibility_boundaries_and_a_shared_compressed_cache():
    """c2a entry w (tokens 2w, 2w+1) is visible from p = 2w+1, c1a entry w from p = w; an oracle over other raw
    latents (a layer's own window) keeps the compressed entries it shares."""
    o = oracle_with(300, 4)
    p = torch.tensor([0, 1, 2, 3])
    picks = torch.tensor([[0, 1, 2, 3]] * 4)
    assert o.visibility(0, p, "c2a", picks)[1][:, 300:].sum(1).tolist() == [0, 1, 1, 2]
    assert o.visibility(0, p, "c1a", picks)[1][:, 300:].sum(1).tolist() == [1, 2, 3, 4]
    mine = o.with_raw({0: (0, torch.zeros(300, 512, dtype=torch.float64))})
    assert mine.compressed is o.compressed
    keys, _ = mine.visibility(0, p, "c1a", picks)
    assert (keys[:300] == 0).all() and torch.equal(keys[300:], o.compressed["c1a"][0])
    with pytest.raises(ValueError, match="kind must be one of"):
        o.set_compressed("c3a", 0, torch.zeros(1, 512))
