"""The pipeline's ropes (DESIGN §6): V4's compress rope against transformers' DeepSeek-V4 rotary embedding (inverse
frequencies bit for bit, rotation within float32 rounding), the YaRN ramp against the formula written out, and V3.2's
half-split rotation against a complex-number model."""
from __future__ import annotations

import math

import pytest
import torch

from helpers import needs
from sparse_mla.rope import (V4_COMPRESS_ROPE, RopeSpec, rope_from_hf_config, rotate_half_split_head,
                             rotate_interleaved_tail)


def test_compress_rope_inverse_frequencies_follow_the_written_ramp():
    i = torch.arange(32, dtype=torch.float64)
    gamma = ((i - 15) / 10).clamp(0, 1)  # DESIGN §6: the truncated correction range is [15, 25]
    expect = 160000.0 ** (-2 * i / 64) * ((1 - gamma) + gamma / 16)
    assert torch.allclose(V4_COMPRESS_ROPE.inv_freq().double(), expect, rtol=1e-6, atol=0)


@needs("transformers")
def test_compress_rope_matches_transformers_v4():
    import transformers as tf
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import (DeepseekV4RotaryEmbedding,
                                                                       apply_rotary_pos_emb)
    cfg = tf.DeepseekV4Config(hidden_size=64, num_attention_heads=2, head_dim=128, qk_rope_head_dim=64,
                              num_hidden_layers=2, rope_parameters={
                                  "rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536,
                                  "beta_fast": 32, "beta_slow": 1, "rope_theta": 10000.0})
    spec = rope_from_hf_config(cfg, "compress")
    assert spec == V4_COMPRESS_ROPE
    emb = DeepseekV4RotaryEmbedding(cfg)
    assert torch.equal(emb.compress_inv_freq, spec.inv_freq())
    x = torch.randn(2, 6, 128)
    pos = torch.tensor([[0, 3, 100, 5000, 70000, 1 << 20], [1, 2, 3, 4, 5, 6]])
    cos, sin = emb(x, pos, layer_type="compress")
    ref = apply_rotary_pos_emb(x.unsqueeze(1), cos, sin).squeeze(1)
    assert torch.allclose(rotate_interleaved_tail(x, pos, spec), ref, rtol=0, atol=1e-6)
    plain = rope_from_hf_config(cfg, "main")
    assert plain == RopeSpec(theta=10000.0, dim=64)


def test_interleaved_tail_is_a_complex_rotation_of_the_last_pairs():
    x = torch.randn(5, 3, 96, dtype=torch.float64)
    pos = torch.tensor([0, 1, 7, 1000, 123456])
    out = rotate_interleaved_tail(x, pos, V4_COMPRESS_ROPE)
    assert torch.equal(out[..., :32], x[..., :32])
    z = torch.view_as_complex(x[..., 32:].reshape(5, 3, 32, 2).contiguous())
    angle = (pos.float()[:, None, None] * V4_COMPRESS_ROPE.inv_freq()).double()  # the angles are float32's
    expect = torch.view_as_real(z * torch.polar(torch.ones_like(angle), angle)).flatten(-2)
    assert torch.allclose(out[..., 32:], expect, atol=1e-4)  # float32 angles and rotation


def test_half_split_head_rotates_channel_i_with_i_plus_half():
    spec = RopeSpec(theta=10000.0, dim=64, factor=40.0, original_max_position=4096)
    x = torch.randn(4, 2, 128, dtype=torch.float64)
    pos = torch.tensor([0, 5, 4096, 163839])
    out = rotate_half_split_head(x, pos, spec)
    assert torch.equal(out[..., 64:], x[..., 64:])
    z = torch.complex(x[..., :32], x[..., 32:64])
    angle = (pos.float()[:, None, None] * spec.inv_freq()).double()
    rot = z * torch.polar(torch.ones_like(angle), angle)
    assert torch.allclose(out[..., :32], rot.real, atol=1e-4) and torch.allclose(out[..., 32:64], rot.imag, atol=1e-4)
    assert not math.isclose(float(spec.inv_freq()[-1]), float(RopeSpec(10000.0).inv_freq()[-1]))


@pytest.mark.parametrize("kwargs,match", [({"theta": 1.0}, "theta"), ({"theta": 1e4, "dim": 63}, "dim"),
                                          ({"theta": 1e4, "factor": 0.5}, "factor"),
                                          ({"theta": math.inf}, "theta and factor must be finite"),
                                          ({"theta": 1e4, "factor": True}, "factor"),
                                          # YaRN's ramp divided by zero or took the log of 0 / NaN unnamed
                                          ({"theta": 1e4, "factor": 4, "beta_fast": 0}, "beta_fast"),
                                          ({"theta": 1e4, "factor": 4, "beta_slow": math.nan}, "beta_slow"),
                                          ({"theta": 1e4, "factor": 4, "original_max_position": 0},
                                           "original_max_position")])
def test_bad_spec_is_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RopeSpec(**kwargs)


def test_bad_positions_are_named():
    with pytest.raises(ValueError, match="positions"):
        rotate_interleaved_tail(torch.randn(3, 64), torch.arange(4))
    with pytest.raises(ValueError, match="x must have a last dimension"):
        rotate_interleaved_tail(torch.randn(3, 32), torch.arange(3))
    with pytest.raises(ValueError, match="positions must have fewer dims than x"):  # a position per channel too
        rotate_interleaved_tail(torch.randn(1, 64), torch.zeros(1, 64, dtype=torch.int64))
    with pytest.raises(ValueError, match="x must have a last dimension"):  # a 0-d x: not the positions' fault
        rotate_interleaved_tail(torch.tensor(1.0), torch.tensor(0))
    with pytest.raises(TypeError, match="spec must be a RopeSpec"):
        rotate_interleaved_tail(torch.randn(3, 64), torch.arange(3), None)
    spec, pos = RopeSpec(10000.0), torch.arange(5)
    for cos_sin, error, match in (((torch.zeros(3, 32), torch.zeros(3, 32)), ValueError, r"cos_sin's cos must have "),
                                  ([1, 2], TypeError, "cos_sin must be the pair")):
        with pytest.raises(error, match=match):
            rotate_half_split_head(torch.randn(5, 64), pos, spec, cos_sin)


def test_a_yarn_config_without_its_numbers_is_named():
    class Config:
        rope_parameters = {"compress": {"rope_type": "yarn", "rope_theta": 1e4}}

    with pytest.raises(ValueError, match=r"lacks \['factor', 'original_max_position_embeddings'\]"):
        rope_from_hf_config(Config())
    Config.rope_parameters = "yarn"
    with pytest.raises(ValueError, match="rope_parameters must be a dict"):
        rope_from_hf_config(Config())
