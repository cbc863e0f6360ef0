"""The lightning indexer's reference and layer (DESIGN §6): picks against a float64 oracle written from the formulas
(exact key sets where the scores are separated beyond the quantisation bound, recall with fp8 keys), against
transformers' DeepseekV4Indexer and DeepseekV32Indexer on the same inputs, V4.1's two-level selection, the
bounded-memory chunking, the layer feeding SparseMLAAttention unchanged, and bad input."""
from __future__ import annotations

import math

import pytest
import torch

from helpers import DEVICE, needs
from indexer_cases import make_case, write_step_keys
from sparse_mla.config import get_config
from sparse_mla.indexer import (IndexerSpec, StepTokens, index_topk_reference, prepare_queries, top_blocks_reference,
                                written_columns)
from sparse_mla.indexer_cache import IndexerKeyCache
from sparse_mla.indexer_layer import SparseMLAIndexer, indexer_role
from sparse_mla.layer import SparseMLAAttention
from sparse_mla.scenario import make_scenario

# ---- the float64 oracle, from the formulas -------------------------------------------------------------------------


def oracle_rope(q: torch.Tensor, positions: torch.Tensor, spec: IndexerSpec) -> torch.Tensor:
    """``q (T, H, 128)`` float64 roped: V4 the last 64 dims in pairs (2i, 2i+1), V3.2 the first 64 half-split."""
    inv = spec.rope_spec.inv_freq(positions.device).double()
    ang = positions.clamp_min(0).double()[:, None, None] * inv  # (T, 1, 32)
    cos, sin = ang.cos(), ang.sin()
    q = q.double().clone()
    if spec.kind == "dsa":
        a, b = q[..., :32].clone(), q[..., 32:64].clone()
        q[..., :32], q[..., 32:64] = a * cos - b * sin, b * cos + a * sin
    else:
        a, b = q[..., 64::2].clone(), q[..., 65::2].clone()
        q[..., 64::2], q[..., 65::2] = a * cos - b * sin, a * sin + b * cos
    return q


def oracle_scores(q_raw, w_raw, positions, keys: torch.Tensor, spec: IndexerSpec) -> torch.Tensor:
    """``I[t, w] = Σ_h ω_t[h]·128^-0.5·H^-0.5·ReLU(q_t[h]·k_w)`` in float64 for one token's row: ``(n,)``."""
    q = oracle_rope(q_raw[None], positions[None], spec)[0]  # (H, 128)
    w = w_raw.double() * 128 ** -0.5 * spec.num_heads ** -0.5
    return (w[:, None] * torch.relu(q @ keys.double().T)).sum(0)


def oracle_bound(q_raw, w_raw, keys: torch.Tensor, spec: IndexerSpec, rel: float) -> torch.Tensor:
    """A bound on each score's error when q and k are each rounded to a relative precision ``rel`` (and a tiny
    absolute term for e4m3's subnormals): ``Σ_h |ω_h| · Σ_d |q_hd||k_d| · (2·rel + rel²) + ...``."""
    w = w_raw.double().abs() * 128 ** -0.5 * spec.num_heads ** -0.5
    mags = q_raw.double().abs() @ keys.double().abs().T  # rope keeps magnitudes pairwise: bound via the pair norms
    return 1.5 * (w[:, None] * mags).sum(0) * (2 * rel + rel * rel) + 1e-6


def oracle_check(case, q_raw, w_raw, spec, topk, got, rel):
    """Per token: the oracle's top set; entries certainly in (above every outsider by more than the bound) must be
    picked, entries certainly out must not; returns (hits, size) of the oracle sets for recall and the oracle score
    mass of the picks over the oracle's top-k's (how much of the top-k's score a miss costs)."""
    hits = size = 0
    mass = [0.0, 0.0]
    qsl = case.step.query_start_loc.tolist()
    positions = case.step.positions.cpu()  # the oracle runs on the CPU, in float64
    for r in range(len(qsl) - 1):
        keys = case.keys[r].cpu()
        for t in range(qsl[r], qsl[r + 1]):
            p = int(positions[t])
            n = (p + 1) // spec.ratio
            picks = got[t].tolist()
            k = min(topk, n)
            assert all(x == -1 for x in picks[k:]), "the row past min(topk, n) is -1"
            mine = set(picks[:k])
            assert -1 not in mine and len(mine) == k and all(0 <= x < n for x in mine)
            if n == 0:
                continue
            s = oracle_scores(q_raw[t], w_raw[t], positions[t], keys[:n], spec)
            b = oracle_bound(q_raw[t], w_raw[t], keys[:n], spec, rel)
            order = torch.sort(s, descending=True, stable=True).indices
            top, rest = order[:k], order[k:]
            hits += len(mine & set(top.tolist()))
            size += k
            mass[0] += float(s[torch.tensor(sorted(mine))].sum())
            mass[1] += float(s[top].sum())
            if len(rest):
                floor = (s[rest] + b[rest]).max()
                assert set(top[(s[top] - b[top]) > floor].tolist()) <= mine
                ceil = (s[top] - b[top]).min()
                assert not set(rest[(s[rest] + b[rest]) < ceil].tolist()) & mine
    return hits, size, mass[0] / mass[1]


def raw_inputs(case, spec, seed):
    gen = torch.Generator().manual_seed(seed)
    cap = case.q.shape[0]
    q_raw = torch.randn(cap, spec.num_heads, 128, generator=gen)
    w_raw = torch.randn(cap, spec.num_heads, generator=gen)
    q, w = prepare_queries(q_raw.to(DEVICE), w_raw.to(DEVICE), case.step.positions, spec)
    return q_raw, w_raw, q, w


@pytest.mark.parametrize("kind,heads,topk,fmt,q_format,seed", [
    ("c4a", 64, 512, "fp8", "fp8", 0), ("c4a", 8, 16, "bf16", "bf16", 1), ("c2a", 32, 64, "fp8", "fp8", 2),
    ("c1a", 12, 32, "bf16", "fp8", 3), ("dsa", 16, 64, "fp8", "bf16", 4)])
def test_picks_match_the_float64_oracle(kind, heads, topk, fmt, q_format, seed):
    spec = IndexerSpec(num_heads=heads, topk=topk, kind=kind, q_format=q_format)
    gen = torch.Generator().manual_seed(seed)
    ratio = spec.ratio
    case = make_case(gen, [(2500 * ratio // 4, 2), (300 * ratio // 4 + 3, 1), (900 * ratio // 4, 6)], spec, fmt,
                     DEVICE)
    q_raw, w_raw, q, w = raw_inputs(case, spec, seed)
    got = index_topk_reference(q, w, case.cache, case.step, topk, token_chunk=4, entry_chunk=192).cpu()
    assert (got[case.num_tokens:] == -1).all()
    # e4m3: 3 mantissa bits (rel 2^-4) after a bf16 round (2^-8); bf16: 2^-8 (q and bf16 keys)
    rel = (2 ** -4 + 2 ** -8) if "fp8" in (fmt, q_format) else 2 ** -8
    hits, size, mass = oracle_check(case, q_raw, w_raw, spec, topk, got, rel)
    # bf16: near-exact sets; fp8 on i.i.d. Gaussian keys (a dense top-k boundary): e4m3's rounding swaps near-ties,
    # 0.95-0.98 of the oracle's entries (issue 50's 0.99 needs better-separated scores), at no cost in score mass
    assert hits / size >= (0.95 if "fp8" in (fmt, q_format) else 0.995), f"recall {hits / size:.4f}"
    assert mass >= 0.998, f"score mass {mass:.5f}"


def test_ties_go_to_the_lowest_entry_and_chunking_does_not_change_the_picks():
    spec = IndexerSpec(num_heads=8, topk=16, kind="c4a", q_format="bf16")
    gen = torch.Generator().manual_seed(5)
    case = make_case(gen, [(400, 3), (200, 1)], spec, "bf16", DEVICE)
    # every key equal: all scores tie, so the picks are the lowest visible entries, in order
    for r, keys in enumerate(case.keys):
        n = keys.shape[0]
        table = case.step.block_table[r].long().cpu()
        slots = torch.tensor([int(table[e // 64]) * 64 + e % 64 for e in range(n)])
        case.cache.write(torch.ones(n, 128, device=DEVICE), slots.to(DEVICE))
    got = index_topk_reference(case.q, case.w, case.cache, case.step, 16, token_chunk=2, entry_chunk=8).cpu()
    for t in range(case.num_tokens):
        n = (int(case.step.positions[t]) + 1) // 4
        assert got[t].tolist() == list(range(min(16, n))) + [-1] * (16 - min(16, n))
    # random keys: the picks do not depend on the chunk sizes (the workspace bound)
    case = make_case(gen, [(900, 5), (700, 1)], spec, "fp8", DEVICE)
    a = index_topk_reference(case.q, case.w, case.cache, case.step, 16, token_chunk=1, entry_chunk=8)
    b = index_topk_reference(case.q, case.w, case.cache, case.step, 16, token_chunk=64, entry_chunk=100000)
    assert torch.equal(a, b)


def test_out_of_range_blocks_are_not_candidates_and_are_never_read():
    spec = IndexerSpec(num_heads=8, topk=64, kind="c4a")
    gen = torch.Generator().manual_seed(6)
    case = make_case(gen, [(300, 1), (500, 2)], spec, "fp8", DEVICE, bad_block=True)
    table = case.step.block_table.clone()
    table[0, 0] = -1  # request 0's first page missing: its entries 0..63 are not candidates
    step = StepTokens(case.step.positions, case.step.token_to_req, case.step.query_start_loc, table, 4)
    got = index_topk_reference(case.q, case.w, case.cache, step, 64).cpu()
    assert ((got[0] < 0) | (got[0] >= 64)).all() and (got[0] >= 0).sum() == 75 - 64
    # request 1's table names a block past the cache after its own pages: its picks are its own visible entries
    for t in (1, 2):
        n = (int(case.step.positions[t]) + 1) // 4
        assert ((got[t] >= 0) & (got[t] < n)).sum() == 64


def test_v41_two_level_keeps_the_newest_block_and_picks_inside_the_kept_blocks():
    spec = IndexerSpec(num_heads=32, topk=16, kind="c2a")
    gen = torch.Generator().manual_seed(7)
    case = make_case(gen, [(1200, 2), (333, 1)], spec, "fp8", DEVICE)
    kept = top_blocks_reference(case.q, case.w, case.cache, case.step, num_kept=5, entry_chunk=40)
    full = index_topk_reference(case.q, case.w, case.cache, case.step, 16)
    for t in range(case.num_tokens):
        n = (int(case.step.positions[t]) + 1) // 2
        blocks = kept[t].tolist()
        assert blocks[0] == (n - 1) // 8, "the newest visible entry's block is pinned first"
        # the other kept blocks are the best by block max (float64 over the dequantised keys, as scored)
        r = int(case.step.token_to_req[t])
        keys = case.cache.read(torch.tensor([int(case.step.block_table[r, e // 64]) * 64 + e % 64 for e in range(n)],
                                            device=DEVICE))
        s = (case.w[t, :, None].double() * torch.relu(case.q[t].double() @ keys.double().T)).sum(0).cpu()
        block_max = torch.nn.functional.pad(s, (0, -n % 8), value=-math.inf).view(-1, 8).amax(1)
        block_max[(n - 1) // 8] = math.inf
        want = torch.sort(block_max, descending=True, stable=True).indices[:5].tolist()
        assert blocks == want
    picks = index_topk_reference(case.q, case.w, case.cache, case.step, 16, kept_blocks=kept).cpu()
    for t in range(case.num_tokens):
        inside = {b * 8 + i for b in kept[t].tolist() if b >= 0 for i in range(8)}
        chosen = [x for x in picks[t].tolist() if x >= 0]
        assert set(chosen) <= inside
        # the best of the full top-k that lie inside the kept blocks are all picked (the kept set is a subset)
        assert {x for x in full[t].tolist() if x in inside} <= set(chosen) or len(chosen) == 16


def test_v41_roles_follow_the_config():
    cfg = get_config("deepseek-v4.1-flash")
    roles = {layer: indexer_role(cfg, layer) for layer in range(cfg.num_layers)}
    assert roles[0] is None and roles[1] is None
    assert roles[2].runs and roles[2].kv_source == 2 and roles[2].two_level == "off"
    assert not roles[5].runs and roles[5].index_source == 2
    assert roles[14].runs and roles[14].kv_source == 14
    assert roles[20].runs and roles[20].two_level == "select"
    assert roles[24].runs and roles[24].kv_source == 20 and roles[24].two_level == "inside"
    assert not roles[39].runs and roles[39].index_source == 36 and roles[39].two_level == "inside"
    v4 = get_config("deepseek-v4-flash")
    assert indexer_role(v4, 0) is None and indexer_role(v4, 2) == indexer_role(v4, 2)
    assert indexer_role(v4, 2).runs and indexer_role(v4, 2).kv_source == 2


# ---- the layer: indexer -> attention, one step ----------------------------------------------------------------------


def test_layer_picks_feed_the_attention_layer_unchanged():
    lengths = [(290, 1), (130, 2), (200, 6)]  # decodes first
    topk = 8
    every = torch.arange(300 // 4, dtype=torch.int32).expand(sum(q for _, q in lengths) + 1, -1).contiguous()
    sc = make_scenario(lengths, window=4, topk=topk, fmt="bf16", decode_threshold=2, padding=1,
                       picks={"c4a": every}, block_sizes={"swa": 64, "c4a": 64, "c128a": 2}, device=DEVICE)
    batch = sc.batch
    keys_cache = IndexerKeyCache(sc.caches["c4a"].num_blocks, "fp8", device=DEVICE)
    keys_cache.poison()
    gen = torch.Generator().manual_seed(8)
    write_step_keys(keys_cache, batch, lengths, gen)
    indexer = SparseMLAIndexer("c4a", 16, topk, backend="reference")
    q_i = torch.randn(batch.token_capacity, 16, 128, generator=gen).to(DEVICE)
    w_i = torch.randn(batch.token_capacity, 16, generator=gen).to(DEVICE)
    picks = indexer(sc.meta, q_i, w_i, keys_cache)
    assert picks.shape == (batch.token_capacity, topk) and picks.dtype == torch.int32
    q_ready, w_ready = prepare_queries(q_i, w_i, batch.positions, indexer.spec)
    assert torch.equal(picks, index_topk_reference(q_ready, w_ready, keys_cache, StepTokens.of(batch, "c4a"), topk))
    attn = SparseMLAAttention("c4a", 4, window=4, topk=topk, backend="reference")
    q = torch.randn(batch.token_capacity, 4, 512, generator=gen).to(torch.bfloat16).to(DEVICE)
    out = attn(q, sc.meta, sc.caches, picks)
    ref = sc.expected(q, "c4a", picks=picks, scale=attn.scale)
    assert (out.cpu().double() - ref).abs().max() < 2e-2


def test_layer_rejects_bad_input_by_name():
    sc = make_scenario([(100, 1)], window=4, topk=8, fmt="bf16", device=DEVICE)
    cache = IndexerKeyCache(sc.caches["c4a"].num_blocks, "fp8", device=DEVICE)
    cap = sc.batch.token_capacity
    q, w = torch.zeros(cap, 8, 128, device=DEVICE), torch.zeros(cap, 8, device=DEVICE)
    layer = SparseMLAIndexer("c4a", 8, 8, backend="reference")
    with pytest.raises(ValueError, match="kind must be one of"):
        SparseMLAIndexer("swa", 8, 8)
    with pytest.raises(ValueError, match="num_heads must be in"):
        SparseMLAIndexer("c4a", 200, 8)
    with pytest.raises(ValueError, match="q_format must be one of"):
        SparseMLAIndexer("c4a", 8, 8, q_format="fp4")
    with pytest.raises(ValueError, match=r"q must have shape \(1, 8, 128\)"):
        layer(sc.meta, q[:, :4], w, cache)
    with pytest.raises(ValueError, match=r"weights must have shape"):
        layer(sc.meta, q, w[:, :3], cache)
    with pytest.raises(TypeError, match="cache must be an IndexerKeyCache"):
        layer(sc.meta, q, w, sc.caches["c4a"])
    with pytest.raises(ValueError, match="configured for bf16"):
        SparseMLAIndexer("c4a", 8, 8, key_format="bf16")(sc.meta, q, w, cache)
    with pytest.raises(ValueError, match="no 'dsa' block table"):
        SparseMLAIndexer("dsa", 8, 8)(sc.meta, q, w, cache)
    with pytest.raises(ValueError, match="exclude each other"):
        layer(sc.meta, q, w, cache, select_blocks=True, kept_blocks=torch.zeros(cap, 4, dtype=torch.int32))
    with pytest.raises(TypeError, match="select_blocks must be a bool"):
        layer(sc.meta, q, w, cache, select_blocks="no")
    elsewhere = IndexerKeyCache(sc.caches["c4a"].num_blocks, "fp8", device="meta")  # named as the cache, not as q
    with pytest.raises(ValueError, match="cache must be on the step's device"):
        layer(sc.meta, q, w, elsewhere)


# ---- transformers' indexer on the same inputs ----------------------------------------------------------------------


@needs("transformers")
def test_picks_match_transformers_deepseek_v4_indexer():
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf
    from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config

    from sparse_mla.rope import rope_from_hf_config

    heads, seq, topk = 8, 400, 32
    cfg = DeepseekV4Config(hidden_size=64, q_lora_rank=32, index_n_heads=heads, index_head_dim=128,
                           index_topk=topk, num_hidden_layers=1, num_attention_heads=4)
    torch.manual_seed(9)
    indexer = hf.DeepseekV4Indexer(cfg).to(torch.bfloat16).eval()
    for p in indexer.parameters():
        torch.nn.init.normal_(p, std=0.2)
    indexer.rotary_emb = hf.DeepseekV4RotaryEmbedding(cfg)  # float32 inv_freq, as a loaded model keeps it
    seen = {}
    indexer.q_b_proj.register_forward_hook(lambda m, a, out: seen.__setitem__("q", out))
    indexer.scorer.register_forward_hook(lambda m, a, out: seen.update(q_roped=a[0], keys=a[1]))
    indexer.scorer.weights_proj.register_forward_hook(lambda m, a, out: seen.__setitem__("w", out))
    hidden = torch.randn(1, seq, 64).to(torch.bfloat16)
    positions = torch.arange(seq)[None]
    with torch.no_grad():
        want = indexer(hidden, torch.randn(1, seq, 32).to(torch.bfloat16), positions, None, 0)[0]
    keys = seen["keys"][0]  # (seq // 4, 128) bf16, roped
    n = keys.shape[0]
    cache = IndexerKeyCache(-(-n // 64), "bf16")
    cache.write(keys, torch.arange(n))
    spec = IndexerSpec(heads, topk, "c4a", rope=rope_from_hf_config(cfg, "compress"), q_format="bf16")
    q, w = prepare_queries(seen["q"][0].view(seq, heads, 128), seen["w"][0], positions[0], spec)
    # the rope: ours against HF's roped q (HF rounds cos / sin to bf16 first: within a few bf16 ulps)
    hf_q = seen["q_roped"][0].float()  # (seq, heads, 128)
    assert (q - hf_q).abs().max() <= 0.02 * hf_q.abs().max()
    # scores and top-k on HF's own q, keys and weights
    one_request = torch.tensor([0, seq], dtype=torch.int32)
    step = StepTokens(positions[0].int(), torch.zeros(seq, dtype=torch.int32), one_request,
                      torch.arange(cache.num_blocks, dtype=torch.int32)[None], 4)
    got = index_topk_reference(hf_q, w, cache, step, topk)
    # HF's row is min(topk, n) wide with -1 past each token's visible entries; ours topk wide
    assert want.shape[-1] == min(topk, n)
    assert (got[:, want.shape[-1]:] == -1).all()
    differ = sum(len({x for x in got[t].tolist() if x >= 0} ^ {x for x in want[t].tolist() if x >= 0})
                 for t in range(seq))
    assert differ == 0, f"{differ} picks differ"


@needs("transformers")
def test_picks_match_transformers_deepseek_v32_indexer():
    from transformers.models.deepseek_v32 import modeling_deepseek_v32 as hf
    from transformers.models.deepseek_v32.configuration_deepseek_v32 import DeepseekV32Config

    from sparse_mla.rope import rope_from_hf_config

    heads, seq, topk = 8, 300, 32
    cfg = DeepseekV32Config(hidden_size=64, q_lora_rank=32, index_n_heads=heads, index_head_dim=128,
                            index_topk=topk, num_hidden_layers=1, num_attention_heads=4)
    torch.manual_seed(10)
    indexer = hf.DeepseekV32Indexer(cfg, 0).to(torch.bfloat16).eval()
    for p in indexer.parameters():
        torch.nn.init.normal_(p, std=0.2)
    hidden = torch.randn(1, seq, 64).to(torch.bfloat16)
    q_resid = torch.randn(1, seq, 32).to(torch.bfloat16)
    positions = torch.arange(seq)[None]
    cos, sin = hf.DeepseekV32RotaryEmbedding(cfg)(hidden, positions)  # float32 inv_freq, bf16 cos / sin
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()[None]
    with torch.no_grad():
        want = indexer(hidden, q_resid, (cos, sin), causal, positions, None)[0]  # (seq, topk) int32
        q_pre = indexer.wq_b(q_resid).view(1, seq, heads, 128)
        k = indexer.k_norm(indexer.wk(hidden)).unsqueeze(2)
        q_rot, k_rot = hf.apply_rotary_pos_emb(q_pre[..., :64], k[..., :64], cos, sin, unsqueeze_dim=2)
        hf_q = torch.cat((q_rot, q_pre[..., 64:]), -1)[0].float()  # HF's roped q and keys, as its forward makes them
        keys = torch.cat((k_rot, k[..., 64:]), -1)[0, :, 0]
        raw_w = indexer.weights_proj(hidden)[0]
    cache = IndexerKeyCache(-(-seq // 64), "bf16")
    cache.write(keys, torch.arange(seq))
    spec = IndexerSpec(heads, topk, "dsa", rope=rope_from_hf_config(cfg), q_format="bf16")
    q, w = prepare_queries(q_pre[0], raw_w, positions[0], spec)
    assert (q - hf_q).abs().max() <= 0.02 * hf_q.abs().max()  # our half-split rope against HF's
    one_request = torch.tensor([0, seq], dtype=torch.int32)
    step = StepTokens(positions[0].int(), torch.zeros(seq, dtype=torch.int32), one_request,
                      torch.arange(cache.num_blocks, dtype=torch.int32)[None], 1)
    got = index_topk_reference(hf_q, w, cache, step, topk)
    # HF fills a row with fewer than topk visible positions with masked future ones: only positions <= t count
    differ = sum(len({x for x in got[t].tolist() if x >= 0} ^ {x for x in want[t].tolist() if x <= t})
                 for t in range(seq))
    assert differ == 0, f"{differ} picks differ"


def test_a_captured_plan_names_the_batches_it_cannot_replay():
    """A Triton plan's launches are sized on the host from the planning step (its columns from the longest request,
    each chunk's grid from its longest run of one request's tokens): ``replay_mismatch`` says when a later batch
    exceeds them (a CUDA graph replaying it would score that batch short) and is None while it fits."""
    plan = SparseMLAIndexer("c4a", 4, 64).step_plan(make_scenario([(300, 1), (200, 1)], topk=64).meta, "triton")
    assert plan.num_cols == 128 and plan.chunks == [(0, 2, 1)]
    for lengths in ([(512, 1), (200, 1)], [(1, 1), (4, 1)]):  # at most 128 entries, one token a request
        assert plan.replay_mismatch(make_scenario(lengths, topk=64).batch) is None
    longer = make_scenario([(516, 1), (200, 1)], topk=64).batch
    assert plan.replay_mismatch(longer) == ("a request sees 129 entries, the captured indexer scores 128 a row: "
                                            "capture another graph")
    two_tokens = make_scenario([(300, 2)], topk=64, decode_threshold=2).batch
    assert "tokens [0, 2) hold a request's run longer than the captured 1" in plan.replay_mismatch(two_tokens)


def test_written_columns_maps_a_chunk_s_columns_to_its_requests_written_slots():
    """``written_columns``: token rows of two requests (one with a missing block and a column past its table), each
    column true where its slot holds a finite key or there is no key to read, false where the slot was never written
    (a poisoned cache's NaN)."""
    cache = IndexerKeyCache(4, "fp8", block_size=4)
    cache.poison()
    cache.write(torch.randn(3, 128), torch.tensor([0, 1, 9], dtype=torch.int32))  # block 0 slots 0-1, block 2 slot 1
    table = torch.tensor([[0, -1], [2, 3]], dtype=torch.int32)  # request 0: block 0, then none; request 1: 2, 3
    step = StepTokens(torch.tensor([8, 8, 8], dtype=torch.int32), torch.tensor([0, 1, 1], dtype=torch.int32),
                      torch.tensor([0, 1, 3], dtype=torch.int32), table, 1)
    got = written_columns(cache, step, 0, 3, 12)  # columns 8-11: past both tables (two pages of 4)
    want = torch.tensor([[1, 1, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1],
                         [0, 1, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1],
                         [0, 1, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(got, want)
    assert torch.equal(written_columns(cache, step, 1, 2, 12), want[1:2])
