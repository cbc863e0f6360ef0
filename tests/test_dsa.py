"""The V3.2 layer kind ``dsa`` end to end: StepBatch -> metadata -> layer, against the dense oracle.

Caches are poisoned (NaN) everywhere no token may look, so reading a wrong slot shows as NaN.
"""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sparse_mla.batch import Request, StepBatchBuilder
from sparse_mla.cache import PagedCache
from sparse_mla.config import get_config
from sparse_mla.layer import SparseMLAAttention
from sparse_mla.metadata import MetadataSpec, build_step_metadata
from sparse_mla.scenario import make_scenario
from helpers import examples
from strategies import step_lengths

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HEADS = 3
TOPK = 12
SCALE = get_config("deepseek-v3.2").softmax_scale
TOL = 1e-2


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double().cpu() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


@settings(max_examples=examples(18), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=step_lengths(max_context=240, prefixes=st.sampled_from([0, 5, 70, 160])),
       fmt=st.sampled_from(["bf16", "fp8_v32"]), mode=st.sampled_from(["paged", "workspace", "mixed"]),
       padding=st.integers(0, 3), slack=st.integers(0, 40), seed=st.integers(0, 2**31 - 1),
       backend=st.sampled_from(["auto", "triton"]))
def test_dsa_layer_matches_dense_oracle(case, fmt, mode, padding, slack, seed, backend):
    lengths, threshold = case
    sc = make_scenario(lengths, topk=TOPK, fmt=fmt, dim=576, decode_threshold=threshold, padding=padding, seed=seed,
                       block_sizes={"dsa": 8}, device=DEVICE)
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(sc.batch.token_capacity, HEADS, 576, generator=gen).to(torch.bfloat16).to(DEVICE)
    rows = max(s for s, _ in lengths) + slack  # a prefill's workspace holds its whole prefix: long ones are split
    layer = SparseMLAAttention("dsa", HEADS, head_dim=576, topk=TOPK, scale=SCALE, prefill_mode=mode,
                               workspace_bytes=rows * 1152, backend=backend)
    out = torch.full((sc.batch.token_capacity, HEADS, 512), math.nan, dtype=torch.bfloat16, device=DEVICE)
    got = layer(q, sc.meta, sc.caches, sc.topk_local, out=out)
    assert got is out and not out.isnan().any()
    ref = sc.expected(q, "dsa", scale=SCALE)
    assert rel_err(out, ref) < TOL
    assert (out[sc.batch.num_tokens:] == 0).all()


def test_picks_after_the_token_are_dropped_and_slots_follow_the_dsa_table():
    builder = StepBatchBuilder(4, 2, 200, kinds=("dsa",), block_sizes={"dsa": 8}, decode_threshold=1)
    batch = builder.build([Request(20, 1, {"dsa": [5, 2, 7]}), Request(10, 3, {"dsa": [4, 1]})])
    meta = build_step_metadata(batch, MetadataSpec(topk=4))
    picks = torch.tensor([[19, 20, 3, -1], [7, 8, 0, 9], [9, 6, 8, -1], [1, 2, 3, 4]], dtype=torch.int32)
    slots, lens = meta.dsa_indices(picks)
    # token 0 at position 19 (blocks 5, 2, 7); tokens 1-3 at positions 7, 8, 9 of request 1 (blocks 4, 1)
    assert lens.tolist() == [2, 2, 2, 4]
    assert slots[0, :2].tolist() == [7 * 8 + 3, 5 * 8 + 3] and slots[0, 2:].tolist() == [-1, -1]
    assert slots[1, :2].tolist() == [4 * 8 + 7, 4 * 8 + 0]  # 8 and 9 are after position 7
    assert slots[2, :2].tolist() == [4 * 8 + 6, 1 * 8 + 0]
    assert slots[3].tolist() == [4 * 8 + 1, 4 * 8 + 2, 4 * 8 + 3, 4 * 8 + 4]
    assert batch.slot_mapping.tolist() == [7 * 8 + 3, 4 * 8 + 7, 1 * 8, 1 * 8 + 1]  # raw tokens go to the dsa cache


@pytest.fixture(scope="module")
def small():
    return make_scenario([(40, 1), (20, 5)], topk=3, fmt="fp8_v32", dim=576, block_sizes={"dsa": 8}, padding=1)


def layer(**kw):
    return SparseMLAAttention("dsa", 2, head_dim=576, topk=kw.pop("topk", 3), scale=SCALE, **kw)


def q576(s, dim=576):
    return torch.zeros(s.batch.token_capacity, 2, dim, dtype=torch.bfloat16)


@pytest.mark.parametrize("call, match", [
    (lambda s: layer()(q576(s), s.meta, s.caches, torch.zeros(7, 4, dtype=torch.int32)),
     r"topk_indices must have shape \(7, 3\)"),
    (lambda s: layer()(q576(s), s.meta, s.caches, torch.zeros(7, 3, dtype=torch.int64)),
     r"topk_indices must have dtype torch.int32"),
    (lambda s: layer()(q576(s), s.meta, s.caches), r"topk_indices must be given to a dsa layer"),
    (lambda s: layer()(q576(s), s.meta, {"dsa": PagedCache(8, 8, "bf16")}, s.topk_local),
     r"caches\['dsa'\] holds 512-d tokens \(bf16\), the layer's head_dim is 576"),
    (lambda s: layer()(q576(s), s.meta, {"dsa": PagedCache(8, 8, "fp8_v4")}, s.topk_local),
     r"caches\['dsa'\] holds 512-d tokens \(fp8_v4\)"),
    (lambda s: layer(kv_format="bf16")(q576(s), s.meta, s.caches, s.topk_local),
     r"caches\['dsa'\] holds fp8_v32 data, but the layer's kv_format is 'bf16'"),
    (lambda s: layer()(q576(s, 512), s.meta, s.caches, s.topk_local), r"q must have shape \(\*, 2, 576\)"),
    (lambda s: SparseMLAAttention("dsa", 2, head_dim=576, topk=3), r"scale is required for a dsa layer"),
    (lambda s: SparseMLAAttention("dsa", 2, topk=3, scale=0.1), r"head_dim must be 576 for a dsa layer"),
    (lambda s: SparseMLAAttention("swa", 2, head_dim=576), r"head_dim must be 512 for a swa layer"),
    (lambda s: SparseMLAAttention("dsa", 2, head_dim=576, scale=0.1), r"topk \(the indexer width\) is required"),
])
def test_bad_dsa_input_raises_value_errors_naming_it(small, call, match):
    with pytest.raises(ValueError, match=match):
        call(small)


def test_v32_preset_layers_are_dsa_with_the_model_scale():
    cfg = get_config("deepseek-v3.2")
    assert {cfg.layer_kind(i) for i in range(cfg.num_layers)} == {"dsa"}
    assert abs(cfg.softmax_scale - 0.1352) < 1e-4 and abs(cfg.softmax_scale - 576 ** -0.5) > 0.09
