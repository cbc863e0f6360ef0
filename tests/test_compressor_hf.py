"""The compressors against transformers 5.23's DeepSeek-V4 modules (``DeepseekV4HCACompressor``,
``DeepseekV4CSACompressor`` and its ``DeepseekV4Indexer``'s own compressor) on the same projections, a bf16 model
with float32 ``position_bias`` and norm weights (as its checkpoints load), fed in the same chunks through its cache.

The library follows R's numerics (float32 pooling, one bf16 rounding before the norm); transformers rounds the
softmax weights to bf16 and multiplies and sums in bf16, and rounds cos / sin to bf16. Both are measured against the
float64 oracle of the formulas: the entries agree within bf16 rounding, and the library's are the closer."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from compress_feed import Feeder, feed, oracle_entries
from helpers import needs, optional_import
from sparse_mla.cache import PagedCache
from sparse_mla.compressor import KVCompressor
from sparse_mla.indexer_cache import IndexerKeyCache
from sparse_mla.rope import V4_COMPRESS_ROPE, rope_from_hf_config

tf = optional_import("transformers")
hf = optional_import("transformers.models.deepseek_v4.modeling_deepseek_v4")
pytestmark = needs("transformers")

EPS = 1e-6


def hf_config():
    return tf.DeepseekV4Config(
        hidden_size=64, num_attention_heads=2, head_dim=512, qk_rope_head_dim=64, num_hidden_layers=2,
        q_lora_rank=32, index_n_heads=2, index_head_dim=128, rms_norm_eps=EPS,
        rope_parameters={"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536,
                         "beta_fast": 32, "beta_slow": 1, "rope_theta": 10000.0})


def randomised(module, gen):
    """A bf16 module with random weights; position_bias and the norm weights float32 (transformers keeps them)."""
    for name, p in module.named_parameters():
        with torch.no_grad():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.2 if "proj" in name else 1.0))
            if "norm" in name:
                p.add_(1.0)
    for name, p in module.named_parameters():  # parameters only: the rope's inverse frequencies stay float32
        keep = "position_bias" in name or "norm" in name
        p.data = p.data.to(torch.float32 if keep else torch.bfloat16)
    return module


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def compare(name, ours, theirs, oracle):
    """Entries within bf16 rounding of transformers', and nearer the oracle."""
    assert ours.shape == theirs.shape == oracle.shape and ours.numel()
    worst = ((ours.double() - theirs.double()).abs().amax(1) / theirs.double().abs().amax(1)).max()
    err_ours, err_hf = rel(ours, oracle), rel(theirs, oracle)
    print(f"\n{name}: max |ours - hf| / max|entry| {float(worst):.2e}; vs the float64 oracle: ours {err_ours:.2e}, "
          f"transformers {err_hf:.2e}")
    assert worst <= 4 * 2.0**-8
    assert err_ours <= err_hf and err_ours < 4e-3


CHUNKS = [5, 1, 1, 9, 4, 1, 260, 3]  # prefill pieces that start and end mid-window, decode tokens


def test_compress_rope_is_transformers_config_s():
    assert rope_from_hf_config(hf_config(), "compress") == V4_COMPRESS_ROPE


@pytest.mark.parametrize("ratio", [4, 128])
def test_compressors_match_transformers(ratio):
    cfg = hf_config()
    gen = torch.Generator().manual_seed(ratio)
    module = randomised(hf.DeepseekV4CSACompressor(cfg) if ratio == 4 else hf.DeepseekV4HCACompressor(cfg), gen)
    layer = (hf.DeepseekV4CSACache if ratio == 4 else hf.DeepseekV4HCACache)(cfg)
    pkv = SimpleNamespace(layers=[layer])
    n = sum(CHUNKS)
    h = torch.randn(1, n, cfg.hidden_size, generator=gen).to(torch.bfloat16)
    q_res = torch.randn(1, n, cfg.q_lora_rank, generator=gen).to(torch.bfloat16)
    start = 0
    with torch.no_grad():
        for size in CHUNKS:
            pos = torch.arange(start, start + size)[None]
            module(h[:, start:start + size], q_res[:, start:start + size], pos, pkv, 0)
            start += size
        parts = [("compressor", module, 512)]
        if ratio == 4:
            parts.append(("indexer", module.indexer, 128))
        feeder = Feeder([n], ratio, dtype=torch.bfloat16)
        comps, caches, seqs = [], [], []
        for name, m, dim in parts:
            comps.append(KVCompressor(feeder.pool, dim, m.kv_norm.weight, EPS, ape=m.position_bias))
            nb, bs = feeder.num_blocks[feeder.kind], feeder.block_size
            caches.append(PagedCache(nb, bs, "bf16") if dim == 512 else IndexerKeyCache(nb, "bf16", block_size=bs))
            seqs.append([(m.kv_proj(h[0]), m.gate_proj(h[0]))])
        sched, done = [], 0
        for size in CHUNKS:
            sched.append([(0, size)])
            done += size
        feed(feeder, comps, caches, seqs, sched)
    table = feeder.tables[0][feeder.kind]
    slots = torch.tensor([table[w // feeder.block_size] * feeder.block_size + w % feeder.block_size
                          for w in range(n // ratio)], dtype=torch.int32)
    for (name, m, dim), cache, ((kv, score),) in zip(parts, caches, seqs):
        theirs = layer.compressed_kv[name][0]
        ours = cache.read(slots)
        _, oracle = oracle_entries(kv, score, m.position_bias.detach(), m.kv_norm.weight.detach(), EPS, ratio)
        compare(f"r={ratio} {name} (d={dim})", ours, theirs, oracle)
