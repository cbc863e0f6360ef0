"""DeepSeek-V3.2 attention: transformers' DeepseekV32Attention (eager, tiny random config, CPU) against
sparse-mla's ``dsa`` layer fed HF's own absorbed queries, latents and indexer picks (the reference backend on a CPU,
the GPU kernels on a GPU: ``GPU_TESTS=hf bash scripts/gpu_check.sh``).

Steps through HF's own cache: a prefill, a chunk on the cached prefix, then decode steps. Per step,
HF's per-head attention output (the input of ``o_proj``, i.e. after ``W_UV``) must match
``Absorption.expand_output(layer(...))`` within 1e-2 relative Frobenius error (bf16 cache; measured
<= 2.4e-3). An fp8_v32 cache (e4m3 latents, per-128 fp32 scales) is within ``FP8_TOL`` of the same HF run
(unquantised latents; measured <= 2.8e-2) and within 1e-2 of HF's semantics on the dequantised latents.
A float64 dense check (no sparse-mla kernel) first pins HF's semantics: picks after the query and
padding never count; a repeated pick counts once.
"""
import pytest
import torch

from helpers import DEVICE, ON_GPU, needs, optional_import
from sparse_mla.absorption import Absorption
from sparse_mla.oracle import masked_attention
from sparse_mla.scenario import dequantized

transformers = optional_import("transformers")
hf = optional_import("transformers.models.deepseek_v32.modeling_deepseek_v32")
pytestmark = needs("transformers")

TOPK, HEADS, NOPE, V = 8, 4, 16, 16
STEPS = [(0, 40), (40, 25), (65, 1), (66, 1), (67, 1)]  # (cached prefix, new tokens): prefill, chunk, decodes
FP8_TOL = 4e-2


def v32_config(num_layers=1):
    return transformers.DeepseekV32Config(
        vocab_size=64, hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=num_layers,
        num_attention_heads=HEADS, num_key_value_heads=HEADS, kv_lora_rank=512, q_lora_rank=32, qk_rope_head_dim=64,
        qk_nope_head_dim=NOPE, v_head_dim=V, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
        first_k_dense_replace=num_layers, index_topk=TOPK, index_head_dim=96, index_n_heads=2,
        max_position_embeddings=512, pad_token_id=0, eos_token_id=None,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0,
                         "mscale_all_dim": 1.0, "original_max_position_embeddings": 128})


def hf_steps():
    """Run a tiny V3.2 model step by step through its DynamicCache; per step, layer 0's HF tensors."""
    torch.manual_seed(0)
    model = transformers.DeepseekV32ForCausalLM(v32_config()).eval()
    attn = model.model.layers[0].self_attn
    seen = {}
    hooks = [attn.register_forward_pre_hook(lambda m, a, kw: seen.update(kw), with_kwargs=True),
             attn.indexer.register_forward_hook(lambda m, a, out: seen.update(picks=out)),
             attn.o_proj.register_forward_pre_hook(lambda m, a: seen.update(o=a[0]))]
    ids = torch.randint(1, 64, (1, sum(STEPS[-1])), generator=torch.Generator().manual_seed(1))
    cache = transformers.DynamicCache(config=model.config)
    steps = []
    with torch.no_grad():
        for prefix, n in STEPS:
            model(ids[:, prefix:prefix + n], past_key_values=cache, use_cache=True)
            h, (cos, sin) = seen["hidden_states"], seen["position_embeddings"]
            q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(h))).view(1, n, HEADS, -1).transpose(1, 2)
            q_rot, _ = hf.apply_rotary_pos_emb_interleave(q[..., NOPE:], q[..., NOPE:], cos, sin)
            layer = cache.layers[0]
            latents = torch.cat([layer.keys[0, 0], layer.values[0, 0]], dim=-1)  # (prefix + n, 576), rope applied
            steps.append(dict(prefix=prefix, n=n, q_nope=q[0, :, :, :NOPE].transpose(0, 1),
                              q_pe=q_rot[0].transpose(0, 1), latents=latents, picks=seen["picks"][0],
                              out=seen["o"][0].view(n, HEADS, V)))
    for hook in hooks:
        hook.remove()
    return attn, steps


@pytest.fixture(scope="module")
def hf_run():
    return hf_steps()


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def dense(attn, st, latents):
    """HF's semantics in float64: absorbed attention over ``latents (T, 576)``, masked to picks <= position
    (a repeated pick counts once), expanded by W_UV: ``(n, H, V)``."""
    ab = Absorption.from_kv_b_proj(attn.kv_b_proj.weight.double(), HEADS, NOPE, V, 512)
    q = torch.cat([torch.bmm(st["q_nope"].double().transpose(0, 1), ab.w_uk).transpose(0, 1), st["q_pe"]], -1)
    pos = torch.arange(st["prefix"], st["prefix"] + st["n"])
    mask = torch.zeros(st["n"], latents.shape[0], dtype=torch.bool).scatter_(1, st["picks"].long(), True)
    mask &= torch.arange(latents.shape[0])[None, :] <= pos[:, None]
    out, _ = masked_attention(q, latents.double(), mask, None, attn.scaling)
    return ab.expand_output(out)


def test_dense_reference_reproduces_hf(hf_run):
    """The float64 dense attention over the latents is HF's output: HF's semantics, pinned without sparse-mla."""
    attn, steps = hf_run
    for st in steps:
        assert rel(dense(attn, st, st["latents"]), st["out"]) < 1e-5
    assert steps[0]["picks"].shape[1] == TOPK and (steps[-1]["picks"] < steps[-1]["prefix"] + 1).all()


def _ours(attn, steps, kv_format):
    from sparse_mla.batch import Request, StepBatchBuilder, blocks_needed
    from sparse_mla.cache import PagedCache
    from sparse_mla.layer import SparseMLAAttention
    from sparse_mla.metadata import MetadataSpec, build_step_metadata

    total = steps[-1]["prefix"] + steps[-1]["n"]
    cache = PagedCache(blocks_needed(total, "dsa") + 1, 64, kv_format, dim=576, device=DEVICE)
    blocks = list(range(1, cache.num_blocks))  # block 0 unused: slots are not positions
    layer = SparseMLAAttention("dsa", HEADS, head_dim=576, topk=TOPK, scale=attn.scaling,
                               backend="triton" if ON_GPU else "reference").to(DEVICE)
    ab = Absorption.from_kv_b_proj(attn.kv_b_proj.weight, HEADS, NOPE, V, 512)
    errs = []
    for st in steps:
        seq = st["prefix"] + st["n"]
        builder = StepBatchBuilder(st["n"] + 3, 1, total, kinds=("dsa",), decode_threshold=1, device=DEVICE)
        batch = builder.build([Request(seq, st["n"], {"dsa": blocks})])
        latents = torch.zeros(batch.token_capacity, 576, dtype=torch.bfloat16)
        latents[: st["n"]] = st["latents"][st["prefix"]:]
        cache.write(latents.to(DEVICE), batch.slot_mapping)
        meta = build_step_metadata(batch, MetadataSpec(topk=TOPK))
        q = torch.zeros(batch.token_capacity, HEADS, 576, dtype=torch.bfloat16)
        q[: st["n"]] = ab.absorb_query(st["q_nope"], st["q_pe"])
        picks = torch.full((batch.token_capacity, TOPK), -1, dtype=torch.int32)
        picks[: st["n"], : st["picks"].shape[1]] = st["picks"]
        out = layer(q.to(DEVICE), meta, {"dsa": cache}, topk_indices=picks.to(DEVICE)).cpu()
        assert (out[st["n"]:] == 0).all()
        ours = ab.expand_output(out[: st["n"]].float())
        errs.append(rel(ours, st["out"]))
        if kv_format != "bf16":  # against HF's semantics on the latents the cache holds
            held = dequantized(st["latents"][:seq].to(torch.bfloat16), cache.fmt)
            assert rel(ours, dense(attn, st, held)) < 1e-2
    return errs


@pytest.mark.parametrize("kv_format, tol", [("bf16", 1e-2), ("fp8_v32", FP8_TOL)])
def test_dsa_layer_matches_hf(hf_run, kv_format, tol):
    errs = _ours(*hf_run, kv_format)
    assert max(errs) < tol, errs
