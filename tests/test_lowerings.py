"""The kernels as another GPU would run them, on this one (issue 35): with ``SPARSE_MLA_LOWERING=sm80`` (or sm86,
sm89) ``conftest.py`` makes Triton lower every kernel of the process as for that target (``mma.sync``,
``cp.async``, its fp8 rules) and ptxas assemble it for the real GPU (``targets.lower_as``); the library then plans
for that target too (its launch configuration, never the Gluon kernel). The essentials of the layer suite run so
against the references (relative error ≤ 1e-2): every kernel over every cache format (NaN-poisoned unused slots,
``-1`` and out-of-range indices), every layer kind over its formats with MTP decodes, a prefill chunk and padding
rows, the other index forms, fp8_e4m3 caches with fp8 queries.

    SPARSE_MLA_LOWERING=sm80 python -m pytest -q tests/test_lowerings.py     # one process per lowering

(``scripts/gpu_check.sh`` runs sm80 and sm89 in its default subset, and sm80, sm86, sm89 with
``GPU_TESTS=lowerings``.) This checks the other targets' code paths on real silicon, not their speed or shared
memory (``tests/test_portability.py`` compiles for each target and checks what fits). Skipped without an NVIDIA GPU
or without the variable. Small shapes, few compiles: the checks are ``sparse_mla.verify``'s and
``tests/test_layer_forms.py``'s, run here under the lowering.
"""
from __future__ import annotations

import os

import pytest
import torch

from helpers import DEVICE, ON_GPU
from sparse_mla import verify
from sparse_mla.ops import targets
from test_layer_forms import (HEADS, MTP_STEP, SIZES, TOL, rel_err, run_layer,  # noqa: F401  (the last two
                              test_dsa_layer_in_every_index_form_matches_dense_oracle,  # tests run here too)
                              test_fp8_query_with_fp8_e4m3_caches_matches_dense_oracle)

LOWERING = os.environ.get("SPARSE_MLA_LOWERING")
pytestmark = pytest.mark.skipif(not (ON_GPU and LOWERING and not torch.version.hip),
                                reason="needs an NVIDIA GPU and SPARSE_MLA_LOWERING=sm80 (or sm86, sm89)")


def test_the_library_plans_for_the_lowered_target():
    from sparse_mla.ops import dispatch

    target = targets.target_of(DEVICE)
    assert target.name == f"sm_{LOWERING.removeprefix('sm')}" and not target.hopper
    assert dispatch.attention_kernel(DEVICE, 512, frozenset({"fp8_v4"}), True) == "triton"


def test_kernels_match_the_references():
    """Decode over two NaN-poisoned scopes of each format (with an order, a sink, ``-1`` indices), insert and gather
    bit-identical to the reference, the bf16-workspace prefill, the token order."""
    failed = [f"{c.name}: {c.detail}" for c in verify.kernel_checks(DEVICE) if not c.ok]
    assert not failed, failed


def test_layers_match_the_dense_oracle():
    """swa, c4a, c128a over bf16 and fp8_v4 caches, dsa over bf16 and fp8_v32: a step of MTP decodes and a prefill
    chunk with padding rows, every token against the float64 oracle."""
    failed = [f"{c.name}: {c.detail}" for c in verify.oracle_checks(DEVICE, backend="triton") if not c.ok]
    assert not failed, failed


@pytest.mark.parametrize("index_form", ["ragged", "combined"])
def test_v4_layers_in_the_other_index_forms(index_form):
    from sparse_mla.scenario import make_scenario

    sc = make_scenario(MTP_STEP, window=4, topk=6, fmt="fp8_v4", decode_threshold=3, padding=2, seed=7,
                       block_sizes=SIZES, device=DEVICE)
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(sc.batch.token_capacity, HEADS, 512, generator=gen).to(torch.bfloat16).to(DEVICE)
    sink = torch.randn(HEADS, generator=gen).to(DEVICE)
    for kind in ("swa", "c4a", "c128a"):
        layer, out = run_layer(sc, kind, q, index_form=index_form, sink=sink)
        assert not out.isnan().any() and (out[sc.batch.num_tokens:] == 0).all(), kind
        assert rel_err(out, sc.expected(q, kind, sink=sink, scale=layer.scale)) < TOL, kind


@pytest.mark.parametrize("fmt", ["fp8_v4", "bf16"])
def test_serving_sized_decode_reports_its_registers(fmt):
    """A V4-Flash-like decode call (64 heads, 128 + 512 keys) under the lowering matches the reference; prints the
    attention kernel's registers and spills (the issue's acceptance: none in the key loop)."""
    from sparse_mla.ops import attention_plan, sparse_attention_decode
    from sparse_mla.ops.validate import decode_args

    gen = torch.Generator().manual_seed(3)
    (c0, i0, l0), (c1, i1, l1) = (verify.random_scope(gen, fmt, 512, 32, width, blocks, 64, DEVICE, "full")
                                  for width, blocks in ((128, 8), (512, 16)))
    q = torch.randn(32, 64, 512, generator=gen).to(torch.bfloat16).to(DEVICE)
    args = decode_args(q, c0.data, i0, l0, c1.data, i1, l1)
    call = attention_plan.call_arguments(args)
    compiled = attention_plan.plan_for(args)(*call)
    got = call[1]
    ref, _ = sparse_attention_decode(q, c0.data, i0, l0, extra_cache=c1.data, extra_indices=i1, extra_lens=l1,
                                     backend="reference")
    assert verify.rel_err(got, ref) < TOL
    assert compiled is not None  # the GPU's launch returns the binary it ran
    print(f"\n{targets.target_of(DEVICE).name} {fmt} decode: {compiled.n_regs} registers, "
          f"{compiled.n_spills} spills")
