"""The portable attention kernel's per-target launch configurations (``ops.launch_configs``): every target's row is
well formed and keeps the rules its reason gives, and every strategy a row can choose computes the reference's
attention in the interpreter (NaN-poisoned caches, unused slots, -1 indices, empty rows)."""
from __future__ import annotations

import pytest
import torch

from helpers import DEVICE, check_close, random_scope, random_sink
from launch_strategies import STRATEGIES, STRATEGY_IDS, force_strategy
from sparse_mla.ops import attention_plan, launch_configs, sparse_attention_decode
from sparse_mla.ops.targets import MATRIX
from sparse_mla.ops.validate import decode_args

CASES = [(frozenset({"bf16"}), 512), (frozenset({"fp8_v4"}), 512), (frozenset({"fp8_v32"}), 576),
         (frozenset({"bf16"}), 576), (frozenset({"fp8_e4m3"}), 512)]


@pytest.mark.parametrize("target", MATRIX, ids=[t.name for t in MATRIX])
@pytest.mark.parametrize("formats,dim", CASES)
@pytest.mark.parametrize("num_heads", [1, 16, 64, 128])
def test_every_target_has_a_row(target, formats, dim, num_heads):
    assert launch_configs.unsupported(target, dim, formats, False) is None
    row = launch_configs.attention_config(target, dim, formats, num_heads, False, interpret=False)
    c = row.constexprs
    assert {"H_BLOCK", "BLOCK_N", "NATIVE_FP8", "Q_IN_LOOP", "Q_ROPE_SCALAR", "DECODE_FENCE"} <= set(c)
    assert c["Q_IN_LOOP"] or not c["Q_ROPE_SCALAR"]  # it changes how the in-loop q is read, nothing else
    for n in (c["H_BLOCK"], c["BLOCK_N"]):
        assert n >= 16 and n & (n - 1) == 0  # tl.dot's smallest tile, tl.arange's powers of two
    assert c["NATIVE_FP8"] == target.native_fp8  # fp8 instructions only where Triton has the e4m3 type
    # the fence is inline PTX, and only mma.sync's register operands need it
    assert not c["DECODE_FENCE"] or (target.backend == "cuda" and target.arch != 90 and formats != {"bf16"})
    assert row.num_warps in (4, 8) and row.num_stages in (1, 2) and row.reason
    if target.backend == "cuda" and target.arch != 90:
        # mma.sync (sm_100 too: a dot of M < 64 stays out of tensor memory): at most 32 heads, where Triton puts
        # the warps along the key / value columns, not the heads (at 64 the accumulators spill)
        assert c["H_BLOCK"] <= 32


@pytest.mark.parametrize("target", MATRIX, ids=[t.name for t in MATRIX])
def test_a_format_no_kernel_reads_is_refused_naming_the_gpu_and_the_format(target, monkeypatch):
    # every format of the layout table is read today: the refusal's wording, for a format the kernels lose
    monkeypatch.setattr(launch_configs, "TRITON_FORMATS", launch_configs.TRITON_FORMATS - {"fp4_v41_planar"})
    why = launch_configs.unsupported(target, 512, frozenset({"fp4_v41_planar", "fp8_v4"}), False)
    assert why and target.name in why and "fp4_v41_planar" in why and "backend='reference'" in why
    assert launch_configs.unsupported(target, 512, frozenset({"fp8_v41", "fp4_v41"}), False) is None


def test_the_interpreter_row_keeps_blocks_small():
    row = launch_configs.attention_config(MATRIX[0], 512, frozenset({"bf16"}), 20, False, interpret=True)
    assert row.constexprs["BLOCK_N"] == 16 and row.constexprs["H_BLOCK"] == 32


@pytest.mark.parametrize("strategy", STRATEGIES, ids=STRATEGY_IDS)
@pytest.mark.parametrize("fmt,dim", [("fp8_v4", 512), ("fp8_v32", 576), ("bf16", 576)])
def test_every_strategy_matches_the_reference(monkeypatch, strategy, fmt, dim):
    force_strategy(monkeypatch, **strategy)
    gen = torch.Generator().manual_seed(11 + dim)
    num_tokens, num_heads = 4, 20  # a partial head block
    scopes = [random_scope(gen, fmt, dim, num_tokens, 12, 3, 8), random_scope(gen, fmt, dim, num_tokens, 37, 4, 4)]
    (c0, i0, l0), (c1, i1, l1) = scopes
    q = torch.randn(num_tokens, num_heads, dim, generator=gen).to(torch.bfloat16).to(DEVICE)
    kw = dict(extra_cache=c1.data, extra_indices=i1, extra_lens=l1, sink=random_sink(gen, num_heads))
    check_close(sparse_attention_decode(q, c0.data, i0, l0, backend="triton", **kw),
                sparse_attention_decode(q, c0.data, i0, l0, backend="reference", **kw))


@pytest.mark.skipif(DEVICE.type != "cuda", reason="other targets' rows compiled for this GPU (the interpreter runs its "
                    "own row)")
@pytest.mark.parametrize("fmt,dim", [("fp8_v4", 512), ("fp4_v41", 512), ("bf16", 512), ("fp8_v32", 576)])
def test_every_target_s_row_computes_the_reference_on_this_gpu(fmt, dim):
    """Each distinct row the matrix's targets launch (block shapes, warps, stages, strategy constexprs: as planned for
    that target), compiled for and run on this GPU. A row only its own GPU family reaches (CDNA's 16-key blocks
    without the decode fence) is so checked on silicon where Triton lowers it alike: the fp4 decode's join was
    compiled wrongly there (docs/history.md, version 22) while every NVIDIA row passed."""
    gen = torch.Generator().manual_seed(23 + dim)
    num_tokens, num_heads = 4, 40  # 40: a partial head block at 16, 32 and 64 heads per program
    scopes = [random_scope(gen, fmt, dim, num_tokens, 40, 3, 16), random_scope(gen, fmt, dim, num_tokens, 70, 5, 4)]
    (c0, i0, l0), (c1, i1, l1) = scopes
    q = torch.randn(num_tokens, num_heads, dim, generator=gen).to(torch.bfloat16).to(DEVICE)
    kw = dict(extra_cache=c1.data, extra_indices=i1, extra_lens=l1, sink=random_sink(gen, num_heads))
    want = sparse_attention_decode(q, c0.data, i0, l0, backend="reference", **kw)
    args = decode_args(q, c0.data, i0, l0, **kw)
    positional, keywords = attention_plan.plan_geometry(args)
    rows = {}
    for target in MATRIX:
        plan = attention_plan.AttentionPlan(*positional, **keywords, gluon=0, target=target)
        _, _, constexprs, options = plan.kernels()[0]
        rows.setdefault(repr((sorted(constexprs.items()), sorted(options.items()))), (target.name, plan))
    assert len(rows) >= 3  # mma.sync's, CDNA's and RDNA's rows differ from sm_90's at least
    failed = []
    for name, plan in rows.values():
        try:
            check_close(attention_plan.run(args, plan=plan), want)
        except AssertionError as err:
            failed.append(f"{name}'s row: {err}")
    assert not failed, failed
