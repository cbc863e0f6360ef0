"""Absorption (V3.2 kv_b_proj split) against an explicit per-head loop."""
import pytest
import torch

from sparse_mla.absorption import Absorption

H, NOPE, V, R, ROPE = 4, 16, 12, 32, 8


def _weight(seed=0):
    return torch.randn(H * (NOPE + V), R, generator=torch.Generator().manual_seed(seed))


def _loop(weight, q_nope, q_pe, o, heads=range(H)):
    w = weight.view(H, NOPE + V, R)
    qa = torch.stack([torch.cat([q_nope[:, i] @ w[h, :NOPE], q_pe[:, i]], -1) for i, h in enumerate(heads)], 1)
    ov = torch.stack([o[:, i] @ w[h, NOPE:].T for i, h in enumerate(heads)], 1)
    return qa, ov


@pytest.mark.parametrize("shard", [None, dict(heads=slice(2, 4)), dict(rank=1, world_size=4)])
def test_matches_per_head_loop(shard):
    weight = _weight()
    heads = range(H) if shard is None else (range(2, 4) if "heads" in shard else range(1, 2))
    gen = torch.Generator().manual_seed(1)
    n = len(heads)
    q_nope, q_pe, o = (torch.randn(5, n, d, generator=gen) for d in (NOPE, ROPE, R))
    ab = Absorption.from_kv_b_proj(weight, H, NOPE, V, R, **(shard or {}))
    assert (ab.num_heads, ab.qk_nope_head_dim, ab.v_head_dim, ab.kv_lora_rank) == (n, NOPE, V, R)
    qa, ov = ab.absorb_query(q_nope, q_pe), ab.expand_output(o)
    ref_q, ref_o = _loop(weight, q_nope, q_pe, o, heads)
    assert qa.dtype == torch.bfloat16 and qa.shape == (5, n, R + ROPE)
    torch.testing.assert_close(qa.float(), ref_q, rtol=1e-2, atol=1e-2)
    assert ov.dtype == o.dtype and ov.shape == (5, n, V)
    torch.testing.assert_close(ov, ref_o, rtol=1e-5, atol=1e-5)


def test_sharded_weight_equals_slice_of_full():
    weight = _weight()
    full = Absorption.from_kv_b_proj(weight, H, NOPE, V, R, heads=slice(2, 4))
    shard = Absorption.from_kv_b_proj(weight.view(H, -1, R)[2:].reshape(-1, R), 2, NOPE, V, R)
    assert torch.equal(full.w_uk, shard.w_uk) and torch.equal(full.w_uv, shard.w_uv)


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_heads=3), "weight must have shape"),
    (dict(v_head_dim=0), "v_head_dim must be a positive int"),
    (dict(heads=slice(0, 4, 2)), "heads must be a non-empty contiguous slice"),
    (dict(heads=[0, 1]), "heads must be a slice"),
    (dict(heads=slice(0, 2), rank=0), "not both"),
    (dict(rank=0, world_size=3), "world_size must be a positive int dividing"),
    (dict(rank=4, world_size=4), "rank must be an int in"),
    (dict(dtype="bfloat16"), "dtype"),  # a string: torch took it for a device
    (dict(dtype=torch.int32), "dtype"),  # the weights truncated to ints
    (dict(dtype=torch.float8_e4m3fn), "dtype"),  # no matmul: absorb_query failed later
    (dict(weight=_weight().to(torch.float8_e4m3fn)), "dequantise an fp8 weight"),
    # cast to bf16 alone it would lose its block scales
    (dict(weight=_weight().to(torch.float8_e4m3fn), dtype=torch.bfloat16), "dequantise an fp8 weight"),
])
def test_bad_arguments(kwargs, match):
    args = dict(weight=_weight(), num_heads=H, qk_nope_head_dim=NOPE, v_head_dim=V, kv_lora_rank=R) | kwargs
    with pytest.raises(ValueError, match=match):
        Absorption.from_kv_b_proj(**args)


def test_bad_inputs():
    ab = Absorption.from_kv_b_proj(_weight(), H, NOPE, V, R)
    with pytest.raises(ValueError, match="q_nope must have shape"):
        ab.absorb_query(torch.randn(2, H, NOPE + 1), torch.randn(2, H, ROPE))
    with pytest.raises(ValueError, match="q_pe must have shape"):
        ab.absorb_query(torch.randn(2, H, NOPE), torch.randn(3, H, ROPE))
    with pytest.raises(ValueError, match="o must have shape"):
        ab.expand_output(torch.randn(2, H - 1, R))
    with pytest.raises(ValueError, match="o must have dtype"):  # an int o came back truncated, a bool meaningless
        ab.expand_output(torch.ones(2, H, R, dtype=torch.int32))
    with pytest.raises(ValueError, match="q_nope must have dtype"):
        ab.absorb_query(torch.ones(2, H, NOPE, dtype=torch.bool), torch.randn(2, H, ROPE))
