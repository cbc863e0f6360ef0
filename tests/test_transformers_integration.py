"""sparse-mla inside transformers' DeepseekV4 / DeepseekV32 models: generate() against HF eager, on the CPU (the
reference ops) and, on a GPU, the GPU kernels (``GPU_TESTS=hf bash scripts/gpu_check.sh``).

Tiny random configs; prompts long enough that the window (16) and the indexer's top-k bind and a
c128a entry exists. The c4a layer comes first: an indexer's top-k is discontinuous, so behind other
layers bf16 rounding upstream can flip a near-tied pick (seen: one flip in 8 steps, 0.26 relative
logits error at that step), which says nothing about the attention itself.
"""
import copy

import pytest
import torch

from helpers import DEVICE, needs, optional_import
from sparse_mla.integrations.transformers import check_transformers_version, enable_sparse_mla

transformers = optional_import("transformers")
pytestmark = needs("transformers")
# the model's cache keyword: 5.24 renamed past_key_values (kept as a deprecated alias) to cache
CACHE = "cache" if getattr(transformers, "__version__", None) == "5.24.0" else "past_key_values"

PROMPT, PADS, STEPS = 150, 13, 8


def _v4_model(index_head_dim=64, index_heads=2, device=DEVICE):
    torch.manual_seed(0)
    cfg = transformers.DeepseekV4Config(
        vocab_size=128, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=2,
        head_dim=512, q_lora_rank=32, n_routed_experts=4, num_experts_per_tok=2, hc_mult=2, hc_sinkhorn_iters=2,
        layer_types=["compressed_sparse_attention", "sliding_attention", "heavily_compressed_attention"],
        mlp_layer_types=["moe"] * 3, sliding_window=16, o_groups=2, o_lora_rank=16, index_n_heads=index_heads,
        index_head_dim=index_head_dim, index_topk=4, max_position_embeddings=1024, pad_token_id=0, eos_token_id=None)
    model = transformers.DeepseekV4ForCausalLM(cfg).eval()
    for module in model.modules():  # HF initialises these to zero; random values exercise them
        for name in ("sinks", "position_bias"):
            if isinstance(getattr(module, name, None), torch.nn.Parameter):
                torch.nn.init.normal_(getattr(module, name))
    return model.to(device)


def _inputs():
    ids = torch.randint(1, 128, (2, PROMPT), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :PADS] = 0  # row 1: a shorter prompt, left-padded as generate() expects
    return ids.to(DEVICE), mask.to(DEVICE)


def _generate(model, ids, mask):
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=STEPS, do_sample=False, output_logits=True,
                              return_dict_in_generate=True)


@pytest.fixture(scope="module")
def v4():
    model = _v4_model()
    ids, mask = _inputs()
    return model, ids, mask, _generate(model, ids, mask)


def _compare(ref, out, tol):
    assert torch.equal(ref.sequences, out.sequences)
    errs = [((a[b] - o[b]).norm() / a[b].norm()).item() for a, o in zip(ref.logits, out.logits) for b in range(2)]
    assert max(errs) < tol, errs
    return max(errs)


def _error_against_eager(model, run) -> float:
    """Relative error of ``run()``'s logits (a callable of forwards, no gradient) with sparse-mla enabled on ``model``
    against the same calls in HF eager."""
    with torch.no_grad():
        ref = run().float()
        integration = enable_sparse_mla(model)
        try:
            ours = run().float()
        finally:
            integration.remove()
    return ((ours - ref).norm() / ref.norm()).item()


def test_v4_generate_matches_eager(v4):
    model, ids, mask, ref = v4
    integration = enable_sparse_mla(model, kv_format="bf16")
    try:
        assert model.config._attn_implementation == "sparse_mla"
        out = _generate(model, ids, mask)
    finally:
        integration.remove()
    assert model.config._attn_implementation == "eager"
    _compare(ref, out, 1e-2)


def test_decode_steps_refill_one_builder_and_metadata(v4, monkeypatch):
    """generate()'s decode steps (one token a row, every length within one multiple of 128, the caches not grown)
    refill the first decode step's StepBatchBuilder and StepMetadata (``out=``) instead of allocating new ones; the
    prefill has its own. Tokens and logits as eager's."""
    import sparse_mla.integrations.transformers as module

    model, ids, mask, ref = v4
    steps, build = [], module.build_step_metadata

    def spy(batch, spec, out=None):
        steps.append((batch.builder, out))
        return build(batch, spec, out=out)

    monkeypatch.setattr(module, "build_step_metadata", spy)
    integration = enable_sparse_mla(model)
    try:
        out = _generate(model, ids, mask)
        session = integration._sessions[getattr(out, CACHE)]
    finally:
        integration.remove()
    _compare(ref, out, 1e-2)
    assert len(steps) == STEPS and steps[0][1] is None and steps[1][1] is None  # the prefill's, the first decode's
    assert steps[1][0] is not steps[0][0]
    assert all(builder is steps[1][0] and meta is session.meta for builder, meta in steps[2:])


def test_v4_fp8_cache_prefill(v4):
    """fp8_v4 caches (e4m3 nope dims, per-64 power-of-two scales): logits of a batched prefill against HF
    eager on the unquantised latents: measured 3.5e-2 / 3.8e-2 relative Frobenius error per row."""
    model, ids, mask, _ = v4
    positions = (mask.cumsum(-1) - 1).clamp_min(0)  # as generate() makes them
    with torch.no_grad():
        ref = model(ids, attention_mask=mask, position_ids=positions).logits
        integration = enable_sparse_mla(model, kv_format="fp8_v4")
        try:
            with pytest.raises(ValueError, match="needs position_ids"):
                model(ids, attention_mask=mask)
            out = model(ids, attention_mask=mask, position_ids=positions).logits
        finally:
            integration.remove()
    for b in range(2):
        real = mask[b].bool()
        err = ((out[b, real] - ref[b, real]).norm() / ref[b, real].norm()).item()
        assert err < 5e-2, (b, err)


def test_v4_chunked_prefill(v4):
    """Plain forwards (the model makes its own cache): a 100-token chunk, then 50 on top of it, as HF eager
    does the same two calls. (HF's own two-chunk logits differ from its one-pass ones by up to 0.13 in the
    first chunk, through MoE routing on different matmul shapes, so the reference makes the same calls.)"""
    model, ids, _, _ = v4

    def two_chunks():
        first = model(ids[:1, :100], use_cache=True)
        rest = model(ids[:1, 100:], **{CACHE: getattr(first, CACHE)}).logits
        return torch.cat([first.logits, rest], dim=1)

    assert _error_against_eager(model, two_chunks) < 1e-2


def test_errors(v4):
    model = v4[0]
    with pytest.raises(ValueError, match="kv_format must be one of"):
        enable_sparse_mla(model, kv_format="fp8_v32")
    with pytest.raises(ValueError, match="model must be a DeepseekV4ForCausalLM"):
        enable_sparse_mla(torch.nn.Linear(2, 2))
    with pytest.raises(RuntimeError, match=r"supports transformers 5.23.0 and 5.24.0, found 5.22.0: .* install "
                                           r"transformers==5.24.0"):
        check_transformers_version("5.22.0")
    assert [check_transformers_version(v) for v in ("5.23.0", "5.24.0")] == ["5.23.0", "5.24.0"]
    assert check_transformers_version() == transformers.__version__
    ids, mask = _inputs()
    integration = enable_sparse_mla(model)
    try:
        with torch.no_grad():
            right = mask.flip(1)
            with pytest.raises(ValueError, match="0 only on left padding"):
                model(ids, attention_mask=right, position_ids=(right.cumsum(-1) - 1).clamp_min(0))
            with pytest.raises(ValueError, match="position_ids must count the real tokens"):
                model(ids, attention_mask=mask, position_ids=torch.arange(PROMPT, device=DEVICE)[None].expand(2, -1))
            with pytest.raises(ValueError, match="never saw"):
                cache = transformers.DynamicCache(config=model.config)
                integration.remove()
                model(ids[:1, :4], **{CACHE: cache})
                integration = enable_sparse_mla(model)
                model(ids[:1, 4:8], **{CACHE: cache})
    finally:
        integration.remove()
    assert model.config._attn_implementation == "eager"


def test_beam_search_is_refused_and_remove_gives_the_cache_its_reorder_back(v4):
    """Beam search reorders HF's cache rows each step; the paged caches would stay in their order and the tokens
    differ from eager's without an error (seen: 0.67 relative logit error at 8 tokens): refused at the first reorder.
    remove() gives the caches their own reorder_cache again."""
    model, ids, mask, _ = v4
    integration = enable_sparse_mla(model)
    try:
        with torch.no_grad():
            with pytest.raises(ValueError, match=r"beam search \(num_beams > 1\)"):
                model.generate(ids, attention_mask=mask, max_new_tokens=3, num_beams=2, do_sample=False)
            cache = getattr(model(ids[:1, :8]), CACHE)
            with pytest.raises(ValueError, match="beam search"):
                cache.reorder_cache(torch.zeros(1, dtype=torch.long, device=DEVICE))
            copy.deepcopy(cache).reorder_cache(torch.zeros(1, dtype=torch.long, device=DEVICE))  # a copy: not served
    finally:
        integration.remove()
    cache.reorder_cache(torch.zeros(1, dtype=torch.long, device=DEVICE))  # HF's own again


def test_a_backward_through_the_attention_is_refused(v4):
    """The library's attention runs without gradients: a backward through a forward with gradients enabled raises
    (the projections' and sinks' gradients came back None, the output projections' wrong, with no error); the forward
    itself runs (an eval forward without torch.no_grad())."""
    model, ids, _, _ = v4
    integration = enable_sparse_mla(model)
    trainable = {name: p.requires_grad for name, p in model.named_parameters()}
    try:
        loss = model(ids[:1, :20]).logits.float().square().mean()
        with pytest.raises(RuntimeError, match="computes no gradients"):
            loss.backward()
        for name, p in model.named_parameters():  # only the sinks train (and lm_head): q and k need no gradient
            p.requires_grad_(name.endswith("sinks") or name.startswith("lm_head"))
        loss = model(ids[:1, :20]).logits.float().square().mean()
        with pytest.raises(RuntimeError, match="computes no gradients"):  # the sinks' gradients were left None
            loss.backward()
    finally:
        integration.remove()
        for name, p in model.named_parameters():
            p.requires_grad_(trainable[name])
        model.zero_grad(set_to_none=True)


def test_a_reset_cache_starts_a_new_generation_of_any_batch(v4):
    """cache.reset() then a forward of another batch size: a new generation on that cache (its old rows' tables gave
    an IndexError); the logits are eager's."""
    model, ids, _, _ = v4

    def run():
        cache = getattr(model(ids[:1, :20]), CACHE)
        cache.reset()
        return model(ids[:, :10], attention_mask=torch.ones(2, 10, dtype=torch.long, device=DEVICE),
                     **{CACHE: cache}).logits

    assert _error_against_eager(model, run) < 2e-2


def test_a_model_on_the_meta_device_is_refused():
    """A model built before its weights (``torch.device("meta")``): its sinks and weights have no values to copy into
    the library's layers (torch failed on ``.item()`` or the copy); named with the first such weight."""
    with torch.device("meta"):
        model = _v4_model(device="meta")
    with pytest.raises(ValueError, match=r"model has weights on the meta device \(model\."):
        enable_sparse_mla(model)


def test_enabling_twice_is_refused_and_a_second_remove_does_nothing(v4):
    """A second enable_sparse_mla on an enabled model is a ValueError (two sets of hooks would undo each other); a
    second remove() leaves a later integration of the model as it is (it detached that one before)."""
    model = v4[0]
    for device in ("nonsense", f"cuda:{torch.cuda.device_count()}"):
        with pytest.raises(ValueError, match="device"):
            enable_sparse_mla(model, device=device)
    old = enable_sparse_mla(model)
    try:
        with pytest.raises(ValueError, match="already runs sparse-mla"):
            enable_sparse_mla(model)
    finally:
        old.remove()
    new = enable_sparse_mla(model)
    try:
        old.remove()
        assert model.config._attn_implementation == "sparse_mla"
        ids, _ = _inputs()
        with torch.no_grad():
            model(ids[:1, :4])  # still runs on sparse-mla's layers
    finally:
        new.remove()
    assert model.config._attn_implementation == "eager"


def test_sinks_are_copied_not_shared(v4):
    """The layers' sinks are the model's values in memory of their own (a float32 model on the same device would
    otherwise share them): writing either leaves the other as it was, while enabled and after ``remove()``."""
    model = v4[0]
    attns = [layer.self_attn for layer in model.model.layers]
    saved = [a.sinks.detach().clone() for a in attns]
    integration = enable_sparse_mla(model)
    try:
        for attn, layer, before in zip(attns, integration.layers, saved):
            assert layer.sink.dtype == torch.float32 and torch.equal(layer.sink, before)
            assert layer.sink.untyped_storage().data_ptr() != attn.sinks.untyped_storage().data_ptr()
            with torch.no_grad():
                attn.sinks.add_(1.0)
            assert torch.equal(layer.sink, before)
            layer.sink.fill_(-5.0)
            assert torch.equal(attn.sinks.detach(), before + 1.0)
        integration.remove()
        for attn, layer, before in zip(attns, integration.layers, saved):
            layer.sink.fill_(3.0)
            assert torch.equal(attn.sinks.detach(), before + 1.0)
    finally:
        integration.remove()
        with torch.no_grad():
            for attn, before in zip(attns, saved):
                attn.sinks.copy_(before)  # the module's model is shared by the other tests


def test_v32_latent_sizes_are_blamed_on_the_config():
    """A V3.2 model whose latent is not 512 + 64 dims: the error names the config field, not a layer argument."""
    from test_hf_v32_parity import v32_config

    cfg = v32_config(1)
    cfg.kv_lora_rank = 256
    model = transformers.DeepseekV32ForCausalLM(cfg).eval()
    with pytest.raises(ValueError, match=r"config.kv_lora_rank must be 512 \(sparse-mla's V3.2 latent: 512 dims \+ 64 "
                                         r"rope dims\), got 256"):
        enable_sparse_mla(model)
    assert model.config._attn_implementation != "sparse_mla"


@pytest.mark.parametrize("kv_format, num_layers, tol", [("bf16", 2, 1e-2), ("fp8_v32", 1, 5e-2)])
def test_v32_generate_matches_eager(kv_format, num_layers, tol):
    """Tiny V3.2 (index_topk 8 of up to 48 keys): a batch of a 40- and a 30-token prompt, 8 greedy steps.
    fp8_v32 (e4m3 latents, measured <= 3.3e-2) runs one layer: behind a first layer's fp8 rounding, the
    second layer's indexer flips near-tied picks (measured: tokens differ from step 2 on)."""
    from test_hf_v32_parity import v32_config

    torch.manual_seed(0)
    model = transformers.DeepseekV32ForCausalLM(v32_config(num_layers)).eval().to(DEVICE)
    ids = torch.randint(1, 64, (2, 40), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    mask = torch.ones_like(ids)
    mask[1, :10] = 0
    ref = _generate(model, ids, mask)
    integration = enable_sparse_mla(model, kv_format=kv_format)
    try:
        out = _generate(model, ids, mask)
    finally:
        integration.remove()
    _compare(ref, out, tol)


# ---------------------------------------------------------------- pipeline=True: the library's compressors + indexer

def _no_dense_paths(monkeypatch, family):
    """HF's own compressors / indexers / scorer raise if called: pipeline=True must not run them (no dense
    (S, heads, entries) score tensor is made)."""
    if family == "v4":
        mod = optional_import("transformers.models.deepseek_v4.modeling_deepseek_v4")
        names = ("DeepseekV4IndexerScorer", "DeepseekV4Indexer", "DeepseekV4CSACompressor", "DeepseekV4HCACompressor")
    else:
        mod = optional_import("transformers.models.deepseek_v32.modeling_deepseek_v32")
        names = ("DeepseekV32Indexer",)

    def refuse(*args, **kwargs):
        raise AssertionError("HF's dense compressor / indexer ran under pipeline=True")

    for name in names:
        monkeypatch.setattr(getattr(mod, name), "forward", refuse)


def _pipeline_agreement(model, ids, mask, ref, family, index_format):
    """generate() with pipeline=True (HF's dense paths refusing to run): the fraction of its greedy tokens equal to
    ``ref``'s; checks remove() gave the replaced modules their class forwards back."""
    replaced = [m for layer in model.model.layers
                for m in ((layer.self_attn.indexer,) if family == "v32" else (layer.self_attn.compressor,)) if m]
    integration = enable_sparse_mla(model, pipeline=True, index_format=index_format)
    try:
        with pytest.MonkeyPatch.context() as patch:
            _no_dense_paths(patch, family)
            out = _generate(model, ids, mask).sequences[:, -STEPS:]
    finally:
        integration.remove()
    assert all("forward" not in m.__dict__ for m in replaced)
    agreement = (ref == out).float().mean().item()
    print(f"{family} pipeline, {index_format} keys: {agreement:.3f} of the greedy tokens equal eager's")
    return agreement


@pytest.fixture(scope="module")
def v4_pipeline():
    """The V4 model with 128-d indexer keys (the library's) and 16 indexer heads (with 2, many scores tie at exactly
    0 through the ReLU and negative head weights, and HF's topk orders ties unlike ours), its left-padded batch, and
    eager's tokens of each prompt alone: HF's eager compressors pool a left-padded row's pad tokens into its windows
    (the padded row's entries differ from its prompt's), the library's are request-aligned, so eager's reference is
    the unpadded prompt."""
    torch.manual_seed(0)
    model = _v4_model(index_head_dim=128, index_heads=16)
    ids, mask = _inputs()
    alone = [_generate(model, ids[b:b + 1, PADS * b:], mask[b:b + 1, PADS * b:]).sequences[0, -STEPS:]
             for b in range(2)]
    return model, ids, mask, torch.stack(alone)


@pytest.mark.parametrize("index_format, least", [("bf16", 1.0), ("fp8", 0.75)])
def test_v4_pipeline_generate_matches_eager(v4_pipeline, index_format, least):
    """generate() with the library's compressors and indexer: greedy tokens equal eager's with bf16 keys;
    fp8 keys measured 16 of 16 tokens equal on the CPU (asserted >= 75 %)."""
    model, ids, mask, ref = v4_pipeline
    assert _pipeline_agreement(model, ids, mask, ref, "v4", index_format) >= least


def test_pipeline_errors(v4):
    with pytest.raises(ValueError, match=r"config.index_head_dim must be 128 for pipeline=True"):
        enable_sparse_mla(v4[0], pipeline=True)
    with pytest.raises(ValueError, match="index_format must be one of"):
        enable_sparse_mla(v4[0], index_format="fp4")
    assert v4[0].config._attn_implementation == "eager"


@pytest.mark.parametrize("index_format, least", [("bf16", 1.0), ("fp8", 0.3)])
def test_v32_pipeline_generate_matches_eager(index_format, least):
    """V3.2 with the library's indexer (keys per raw token in its key cache): a left-padded batch (V3.2's eager
    masks pads, so its padded batch is the reference), 8 greedy steps. 16 indexer heads: with 2, many scores tie at
    exactly 0 (ReLU) and HF's and our tie order differ. fp8 keys measured 12 of 16 tokens equal on the CPU (a pick
    flips at step 5 of row 1) and 6 of 16 on an H200 (an earlier flip; greedy decoding diverges from a flipped
    token on): asserted >= 30 %, far above chance (1/63 a token) — a broken indexer gives none."""
    from test_hf_v32_parity import v32_config

    torch.manual_seed(0)
    cfg = v32_config(2)
    cfg.index_head_dim, cfg.index_n_heads = 128, 16
    model = transformers.DeepseekV32ForCausalLM(cfg).eval().to(DEVICE)
    ids = torch.randint(1, 64, (2, 40), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    mask = torch.ones_like(ids)
    mask[1, :10] = 0
    ref = _generate(model, ids, mask).sequences[:, -STEPS:]
    assert _pipeline_agreement(model, ids, mask, ref, "v32", index_format) >= least



def test_v4_pipeline_chunked_prefill_picks_equal_hf(v4_pipeline):
    """Plain forwards through the model's own cache with pipeline=True: a 100-token chunk, then 50 on top of it (the
    compressor state carries the open windows across the calls). The first layer's picks (its input, the embeddings,
    is the same in both runs) equal HF's indexer's on the same two calls wherever HF's scores of the differing
    entries are more than 1e-2 (relative) from the k-th best: our keys are bf16, HF's float32 (measured: one flip,
    at a 1.5e-3 gap). Logits are not compared: a flipped near-tie changes them by up to 0.26 downstream."""
    model, ids, _, _ = v4_pipeline
    indexer = model.model.layers[0].self_attn.compressor.indexer
    hf_picks, hf_scores, ours = [], [], []

    def two_chunks():
        first = model(ids[:1, :100], use_cache=True)
        model(ids[:1, 100:], **{CACHE: getattr(first, CACHE)})

    hooks = [indexer.register_forward_hook(lambda m, a, out: hf_picks.append(out[0])),
             indexer.scorer.register_forward_hook(lambda m, a, out: hf_scores.append(out[0]))]
    with torch.no_grad():
        try:
            two_chunks()
        finally:
            for hook in hooks:
                hook.remove()
        integration = enable_sparse_mla(model, pipeline=True)
        spy = integration.layers[0].register_forward_pre_hook(
            lambda m, args, kwargs: ours.append(kwargs["topk_indices"].clone()), with_kwargs=True)
        try:
            two_chunks()
        finally:
            spy.remove()
            integration.remove()
    assert len(ours) == 2 and len(hf_picks) == 2
    flips = 0
    for theirs, scores, mine in zip(hf_picks, hf_scores, ours):
        for t in range(theirs.shape[0]):
            a = {v for v in theirs[t].tolist() if v >= 0}
            b = {v for v in mine[t].tolist() if v >= 0}
            assert len(a) == len(b), t
            if a != b:
                flips += 1
                kth = min(scores[t, v].item() for v in a)
                gaps = [abs(scores[t, v].item() - kth) / max(abs(kth), 1e-6) for v in a ^ b]
                assert max(gaps) < 1e-2, (t, sorted(a), sorted(b), gaps)
    print(f"V4 pipeline, two chunks: {flips} near-tied picks differ from HF's")
    assert flips <= 2, flips


# ---------------------------------------------------------------- cuda_graphs=True: decode steps replayed

def test_cuda_graphs_errors(v4, v4_pipeline):
    """cuda_graphs=True names what it needs (pipeline=True, a CUDA device, V4) before it changes the model."""
    with pytest.raises(ValueError, match="cuda_graphs=True needs pipeline=True"):
        enable_sparse_mla(v4[0], cuda_graphs=True)
    if DEVICE.type != "cuda":
        with pytest.raises(ValueError, match="cuda_graphs=True needs a CUDA device, got cpu"):
            enable_sparse_mla(v4_pipeline[0], pipeline=True, cuda_graphs=True)
    from test_hf_v32_parity import v32_config

    cfg = v32_config(1)
    cfg.index_head_dim = 128  # what pipeline=True needs
    v32 = transformers.DeepseekV32ForCausalLM(cfg).eval()
    with pytest.raises(ValueError, match="cuda_graphs=True supports DeepseekV4 models"):
        enable_sparse_mla(v32, pipeline=True, cuda_graphs=True)
    assert v4[0].config._attn_implementation == "eager" and "forward" not in v4[0].model.__dict__


def test_remove_leaves_an_instance_forward_it_did_not_set(v4):
    """Without cuda_graphs the base model's forward is not touched: a wrapper someone set on the instance stays."""
    model = v4[0]
    wrapper = model.model.forward
    model.model.forward = wrapper
    try:
        enable_sparse_mla(model).remove()
        assert model.model.__dict__["forward"] is wrapper
    finally:
        del model.model.forward


@pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA graphs need a GPU")
def test_v4_pipeline_decode_steps_replay_a_cuda_graph():
    """generate() with cuda_graphs=True: a left-padded batch of bf16 prompts whose decode steps cross a builder's
    length (256: a new builder, so an eager step, then a capture) and the indexer's captured columns (260 tokens: 65
    c4a entries past the 64 it scores, the same); tokens, logits and each step's hidden states (the graph's tensors,
    handed out as copies: a replay rewrites them) equal those of the same pipeline run eagerly."""
    model = _v4_model(index_head_dim=128, index_heads=16).to(torch.bfloat16)
    ids = torch.randint(1, 128, (2, 252), generator=torch.Generator().manual_seed(5)).to(DEVICE)
    mask = torch.ones_like(ids)
    mask[1, :PADS] = 0
    runs, counts = [], []
    wrapper = model.model.forward  # an instance forward of someone else's: run, and given back by remove()
    model.model.forward = wrapper
    for graphs in (False, True):
        integration = enable_sparse_mla(model, pipeline=True, cuda_graphs=graphs)
        try:
            with torch.no_grad():
                runs.append(model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                                           output_logits=True, output_hidden_states=True,
                                           return_dict_in_generate=True))
        finally:
            integration.remove()
        counts.append(dict(integration.graph_counts))
        assert model.model.__dict__["forward"] is wrapper
    del model.model.forward
    eager, replayed = runs
    # HF's cache counts the tokens it was fed (252 + 11) through the replays as through eager steps
    assert getattr(eager, CACHE).get_seq_length() == getattr(replayed, CACHE).get_seq_length() == 263
    assert torch.equal(eager.sequences, replayed.sequences)
    for a, b in zip(eager.logits, replayed.logits):
        assert torch.equal(a, b)
    assert len(replayed.hidden_states) == 12
    for a, b in zip(eager.hidden_states, replayed.hidden_states):  # a tuple a step: the embeddings, each layer's
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    # 11 decode steps: 252 -> 253 a new builder (eager), capture at 254, 256 -> 257 a new builder (eager), capture
    # at 258, 259 -> 260 the indexer's columns (eager), capture at 261; the rest replays
    assert counts[0] == {"captures": 0, "replays": 0}
    assert counts[1] == {"captures": 3, "replays": 8}, counts
    # the last eager step's: row 0's 65th entry needs a c4a block past the cache (grown), with the indexer's columns
    assert integration.graph_miss == "a new builder or cache, or other forward arguments"
