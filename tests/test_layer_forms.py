"""The layer with the other index forms (``index_form="ragged" | "combined"``) and fp8_e4m3 caches (with bf16 or
fp8 queries), end to end against the dense oracle, on the reference and the Triton backends (issue 19).

Caches are poisoned (NaN) everywhere no token may look, so a wrong slot shows as NaN.
"""
from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparse_mla import index_forms
from sparse_mla.cache import PagedCache
from sparse_mla.layer import SparseMLAAttention
from sparse_mla.scenario import make_scenario
from helpers import examples
from strategies import step_lengths

SIZES = {"swa": 4, "c4a": 4, "c128a": 2}
HEADS = 2
TOL = 1e-2  # relative Frobenius error, bf16 output (DESIGN §7.1)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FORMS = ("padded", "ragged", "combined")


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double().cpu() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def run_layer(sc, kind, q, *, index_form, mode="paged", backend="triton", topk=6, window=4, q_scale=None,
              sink=None):
    layer = SparseMLAAttention(kind, HEADS, window=window, topk=topk if kind == "c4a" else None, sink=sink,
                               prefill_mode=mode, workspace_bytes=64 * 1024, backend=backend, index_form=index_form)
    out = torch.full((sc.batch.token_capacity, HEADS, 512), math.nan, dtype=torch.bfloat16, device=DEVICE)
    got = layer(q, sc.meta, sc.caches, sc.topk_local if kind == "c4a" else None, out=out, q_scale=q_scale)
    assert got is out
    return layer, out


# every combination in every run (162 tests); Hypothesis draws the steps
COMBINATIONS = list(itertools.product(["swa", "c4a", "c128a"], FORMS, ["bf16", "fp8_v4", "fp8_e4m3"],
                                      ["paged", "mixed", "workspace"], ["reference", "triton"]))


@pytest.mark.parametrize("kind,index_form,fmt,mode,backend", COMBINATIONS)
@settings(max_examples=examples(2))  # the simplest step Hypothesis draws first, then a random one
@given(case=step_lengths(max_context=300, max_query=10, prefixes=st.sampled_from([0, 3, 130])),
       padding=st.integers(0, 2), seed=st.integers(0, 2**31 - 1))
def test_layer_in_every_index_form_and_format_matches_dense_oracle(kind, index_form, fmt, mode, backend, case,
                                                                    padding, seed):
    lengths, threshold = case  # decodes of 1 to threshold tokens (MTP), prefills, padding rows
    sc = make_scenario(lengths, window=4, topk=6, fmt=fmt, decode_threshold=threshold, padding=padding, seed=seed,
                       block_sizes=SIZES, device=DEVICE)
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(sc.batch.token_capacity, HEADS, 512, generator=gen).to(torch.bfloat16).to(DEVICE)
    sink = torch.randn(HEADS, generator=gen).to(DEVICE)
    layer, out = run_layer(sc, kind, q, index_form=index_form, mode=mode, backend=backend, sink=sink)
    assert not out.isnan().any()
    assert (out[sc.batch.num_tokens:] == 0).all(), "padding tokens get zeros"
    assert rel_err(out, sc.expected(q, kind, sink=sink, scale=layer.scale)) < TOL


MTP_STEP = [(137, 2), (9, 1), (260, 3), (40, 1), (12, 7)]  # MTP decodes (threshold 3), one prefill chunk


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("index_form", FORMS)
def test_fp8_query_with_fp8_e4m3_caches_matches_dense_oracle(index_form, backend):
    sc = make_scenario(MTP_STEP, window=4, topk=6, fmt="fp8_e4m3", decode_threshold=3, padding=2, seed=5,
                       block_sizes=SIZES, device=DEVICE, kv_scale=0.0075)
    gen = torch.Generator().manual_seed(5)
    q_scale = torch.full((1,), 1 / 64, device=DEVICE)
    q8 = (torch.randn(sc.batch.token_capacity, HEADS, 512, generator=gen) * 64).to(torch.float8_e4m3fn).to(DEVICE)
    q_values = q8.float() * q_scale  # what the fp8 q stands for
    for kind in ("c4a", "c128a"):
        layer, out = run_layer(sc, kind, q8, index_form=index_form, backend=backend, q_scale=q_scale)
        assert not out.isnan().any() and (out[sc.batch.num_tokens:] == 0).all()
        assert rel_err(out, sc.expected(q_values, kind, scale=layer.scale)) < TOL, kind


@pytest.mark.parametrize("index_form", ["padded", "ragged", "combined"])
def test_dsa_layer_in_every_index_form_matches_dense_oracle(index_form):
    sc = make_scenario([(50, 2), (9, 1), (30, 6)], topk=8, fmt="bf16", dim=576, decode_threshold=2, padding=1,
                       seed=2, block_sizes={"dsa": 4}, device=DEVICE)
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(sc.batch.token_capacity, HEADS, 576, generator=gen).to(torch.bfloat16).to(DEVICE)
    layer = SparseMLAAttention("dsa", HEADS, 576, topk=8, scale=0.1, backend="triton", index_form=index_form)
    out = layer(q, sc.meta, sc.caches, sc.topk_local)
    assert rel_err(out, sc.expected(q, "dsa", scale=0.1)) < TOL


def test_layers_of_a_step_share_the_form_s_buffers_and_results_agree_across_forms():
    sc = make_scenario(MTP_STEP, window=4, topk=6, fmt="fp8_v4", decode_threshold=3, seed=1, block_sizes=SIZES,
                       device=DEVICE)
    q = torch.randn(sc.batch.token_capacity, HEADS, 512, generator=torch.Generator().manual_seed(1)).bfloat16()
    q = q.to(DEVICE)
    outs = {f: run_layer(sc, "c128a", q, index_form=f, backend="reference")[1] for f in FORMS}
    assert max(rel_err(outs[f], outs["padded"].double().cpu()) for f in FORMS) < 1e-3
    first = sc.meta._plans[("index_form", "ragged", "swa")][0].data_ptr()
    run_layer(sc, "swa", q, index_form="ragged", backend="reference")
    assert sc.meta._plans[("index_form", "ragged", "swa")][0].data_ptr() == first  # one per step, shared
    flat, indptr = sc.meta._plans[("index_form", "ragged", "swa")]
    lens = sc.meta.swa_lens.clamp(0, sc.meta.swa_indices.shape[1])
    assert torch.equal(indptr[1:].cpu(), torch.cumsum(lens, 0).int().cpu())


@pytest.mark.parametrize("index_form,kind,want", [
    ("ragged", "c4a", dict(RAGGED0=True, RAGGED1=True, COMBINED=False, Q_FP8=False)),
    ("combined", "c128a", dict(RAGGED0=False, RAGGED1=False, COMBINED=True, Q_FP8=False)),
    ("combined", "swa", None),  # one scope: its padded list
])
def test_the_triton_launch_reads_the_layer_s_form(index_form, kind, want):
    from sparse_mla.plan import LayerPlan

    sc = make_scenario(MTP_STEP, window=4, topk=6, fmt="bf16", decode_threshold=3, seed=3, block_sizes=SIZES,
                       device=DEVICE)
    q = torch.randn(sc.batch.token_capacity, HEADS, 512, generator=torch.Generator().manual_seed(3)).bfloat16()
    run_layer(sc, kind, q.to(DEVICE), index_form=index_form, backend="triton")
    plan = next(p for p in sc.meta._plans.values() if isinstance(p, LayerPlan))
    assert plan.form == ("padded" if want is None else index_form)
    for _, _, launch, *_ in plan.parts:
        if want is not None:
            assert launch.kernel == "triton"  # ragged and combined lists: never the Gluon kernel
            constants = dict(launch._constants)
            assert {k: constants[k] for k in want} == want


def test_index_form_and_fp8_arguments_are_checked():
    sc = make_scenario([(20, 1), (9, 4)], window=4, topk=6, fmt="fp8_e4m3", decode_threshold=1, seed=0,
                       block_sizes=SIZES, device=DEVICE)
    q = torch.zeros(sc.batch.token_capacity, HEADS, 512, dtype=torch.bfloat16, device=DEVICE)
    q8 = q.to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="index_form must be one of"):
        SparseMLAAttention("swa", HEADS, window=4, index_form="csr")
    layer = SparseMLAAttention("swa", HEADS, window=4, backend="reference")
    with pytest.raises(ValueError, match="pass its q_scale"):
        layer(q8, sc.meta, sc.caches)
    with pytest.raises(ValueError, match="pass its PagedCache"):
        layer(q, sc.meta, {"swa": sc.caches["swa"].data})
    c128a = SparseMLAAttention("c128a", HEADS, window=4, backend="reference")
    other = PagedCache(sc.caches["c128a"].num_blocks, SIZES["c128a"], "fp8_e4m3", device=DEVICE, kv_scale=0.5)
    with pytest.raises(ValueError, match="different kv_scale tensors"):
        c128a(q, sc.meta, {"swa": sc.caches["swa"], "c128a": other})
    with pytest.raises(ValueError, match="workspace"):
        SparseMLAAttention("swa", HEADS, window=4, prefill_mode="workspace")(q8, sc.meta, sc.caches, q_scale=0.5)
    bf16 = make_scenario([(20, 1)], window=4, topk=6, fmt="bf16", seed=0, block_sizes=SIZES, device=DEVICE)
    with pytest.raises(ValueError, match="needs fp8_e4m3 caches"):
        layer(q8[: bf16.batch.token_capacity], bf16.meta, bf16.caches, q_scale=0.5)
    with pytest.raises(ValueError, match="kv_scale is only for fp8_e4m3"):
        make_scenario([(20, 1)], fmt="bf16", kv_scale=0.5)
    assert index_forms.check_index_form("ragged") == "ragged"
