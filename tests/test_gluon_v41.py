"""The Hopper (Gluon) kernel over DeepSeek-V4.1's caches (fp8_v41 and fp4_v41, token-interleaved and page-planar, the
two scopes in one format or fp8 beside fp4; issue 36) against the reference op, on an sm_90 GPU with the Triton the
kernel is validated on (elsewhere skipped; on a Hopper GPU whose Triton lacks it, a failure: helpers.requirement).

Every launch form the kernel has: 64-head items (one head block, two, a partial one), narrow items (at most 16
heads) and 64-head items forced for them, persistent programs, split key lists (whole and ``TAIL``), over
NaN-poisoned pages with padding after them; and the default dispatch picks the Gluon kernel for V4.1 calls.
"""
from __future__ import annotations

import pytest
import torch

from helpers import DEVICE, check_close, needs, random_sink
from sparse_mla.cache import PagedCache
from test_v41_kernels import padded_scope
from sparse_mla.ops import attention_plan, dispatch, sparse_attention_decode
from sparse_mla.ops.validate import decode_args

# (window scope, compressed scope): one format, or V4.1-Flash's fp8 window beside an fp4 compressed cache
PAIRS = [("fp8_v41", "fp8_v41"), ("fp8_v41_planar", "fp8_v41_planar"), ("fp4_v41", "fp4_v41"),
         ("fp8_v41", "fp4_v41"), ("fp8_v41_planar", "fp4_v41_planar")]
PAIR_IDS = ["+".join(p) for p in PAIRS]


needs_gluon = needs("gluon")  # an NVIDIA sm_90 GPU and a Triton with the validated Gluon kernel


def v41_call(fmts: tuple[str, str], seed: int, num_tokens: int, num_heads: int, width: int):
    """A two-scope decode call over caches of ``fmts`` (the window scope 128 wide, the compressed one ``width``): the
    op's arguments as keywords."""
    gen = torch.Generator().manual_seed(seed)
    c0, i0, l0 = padded_scope(gen, fmts[0], num_tokens, 128, 48, 64)
    c1, i1, l1 = padded_scope(gen, fmts[1], num_tokens, width, 160, 64)
    q = torch.randn(num_tokens, num_heads, 512, generator=gen).to(torch.bfloat16).to(DEVICE)
    return dict(q=q, cache=c0, indices=i0, lens=l0, extra_cache=c1, extra_indices=i1, extra_lens=l1,
                sink=random_sink(gen, num_heads), fmt=fmts[0], extra_fmt=fmts[1])


def checked(kw: dict):
    """The checked arguments of :func:`v41_call`'s call."""
    return decode_args(kw["q"], kw["cache"], kw["indices"], kw["lens"], kw["extra_cache"], kw["extra_indices"],
                       kw["extra_lens"], kw["sink"], fmt=kw["fmt"], extra_fmt=kw["extra_fmt"])


def test_gluon_reads_every_v41_pairing():
    """The dispatch table: V4.1's caches (either format, either layout; the scopes alike or fp8 beside fp4) are
    Gluon's, a V4.1 scope beside a V4 one is not."""
    readable = dispatch.GLUON_FORMATS[512]
    for pair in PAIRS:
        assert frozenset(pair) in readable
    assert frozenset({"fp8_v4", "fp8_v41"}) not in readable and frozenset({"bf16", "fp4_v41"}) not in readable


# (heads, splits, persistent, narrow): 64-head items, two head blocks split in 3, a partial head block as persistent
# programs, narrow items and the same heads as 64-head items, a TAIL split
FORMS = [(64, 1, False, None), (128, 3, False, None), (48, 1, True, None), (16, 1, None, None), (16, 2, None, False),
         (8, 1, True, None)]


@needs_gluon
@pytest.mark.parametrize("heads,splits,persistent,narrow", FORMS)
@pytest.mark.parametrize("fmts", PAIRS, ids=PAIR_IDS)
def test_gluon_kernel_matches_the_reference(fmts, heads, splits, persistent, narrow):
    kw = v41_call(fmts, heads * 7 + splits + len(fmts[1]), 24, heads, 700)
    ref = sparse_attention_decode(**kw, backend="reference")
    got = attention_plan.run(checked(kw), gluon=1, splits=splits, persistent=persistent, narrow=narrow)
    check_close(got, ref)


@needs_gluon
@pytest.mark.parametrize("fmts", PAIRS, ids=PAIR_IDS)
def test_gluon_tail_split_matches_the_reference(fmts):
    """The last tokens' lists cut in pieces (``TAIL``), the others whole."""
    kw = v41_call(fmts, 11, 40, 64, 1500)
    ref = sparse_attention_decode(**kw, backend="reference")
    check_close(attention_plan.run(checked(kw), gluon=1, splits=4, tail=8), ref)


@needs_gluon
@pytest.mark.parametrize("fmts", PAIRS, ids=PAIR_IDS)
def test_default_kernel_for_v41_is_gluon(fmts):
    kw = v41_call(fmts, 3, 4, 64, 256)
    assert attention_plan.plan_for(checked(kw)).kernel == "gluon"
    check_close(sparse_attention_decode(**kw), sparse_attention_decode(**kw, backend="reference"))


@needs_gluon
@pytest.mark.parametrize("fmt", ["fp8_v41", "fp8_v41_planar", "fp4_v41", "fp4_v41_planar"])
def test_keys_are_read_exactly_at_any_tile_scale(fmt):
    """One key per token and no sink: every head's output is the key's dequantised row, bit for bit, for tile
    magnitudes 2^-12 … 2^12 (fp4: its scales' whole range, 2^-9 … 448, every e2m1 code, signed zeros included)."""
    gen = torch.Generator().manual_seed(41)
    num_tokens = 256
    cache = PagedCache(4, 64, fmt, 512, DEVICE)
    cache.poison()
    magnitude = torch.randint(-12, 13, (num_tokens, 512 // 16), generator=gen).float().repeat_interleave(16, dim=1)
    kv = torch.randn(num_tokens, 512, generator=gen) * 2.0 ** magnitude
    kv[:, ::17] = 0.0
    kv[:, 5::17] = -0.0
    slots = torch.randperm(cache.num_slots, generator=gen)[:num_tokens].int().to(DEVICE)
    cache.write(kv.to(torch.bfloat16).to(DEVICE), slots)
    q = torch.randn(num_tokens, 64, 512, generator=gen).to(torch.bfloat16).to(DEVICE)
    lens = torch.ones(num_tokens, dtype=torch.int32, device=DEVICE)
    out, _ = attention_plan.run(decode_args(q, cache.data, slots[:, None], lens, fmt=fmt), gluon=1)
    assert torch.equal(out, cache.read(slots)[:, None, :].expand_as(out))
