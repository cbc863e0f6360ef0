"""``batch_invariant=True``: a token's output is bitwise the same alone or in any batch (split and unsplit
key lists), on the Triton kernel (CPU: interpreter) and, on Hopper, the Gluon kernel."""
from __future__ import annotations

import pytest
import torch

from helpers import needs
from sparse_mla.cache import PagedCache
from sparse_mla.ops import sparse_attention_decode, attention_plan
from sparse_mla.ops.validate import decode_args

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
# (heads, batch sizes, compressed list width, keys per split): both with splits short enough that long lists
# are cut into several (production's split holds any V4 list whole); the CPU interpreter runs small sizes
SIZES = dict(gpu=(64, (64, 148), 1024, 512), cpu=(4, (5, 9), 96, 64))
HEADS, BATCHES, WIDTH, SPLIT_KEYS = SIZES["gpu" if ON_GPU else "cpu"]


def scopes(num_tokens, gen, fmt):
    swa = PagedCache(16, 64, fmt, device=DEVICE)
    comp = PagedCache(WIDTH // 2 + 8, 2, fmt, device=DEVICE)
    for c in (swa, comp):
        c.write(torch.randn(c.num_slots, 512, generator=gen).to(torch.bfloat16).to(DEVICE),
                torch.arange(c.num_slots, dtype=torch.int32, device=DEVICE))
    i0 = torch.randint(0, swa.num_slots, (num_tokens, 128), generator=gen, dtype=torch.int32).to(DEVICE)
    i1 = torch.randint(0, comp.num_slots, (num_tokens, WIDTH), generator=gen, dtype=torch.int32).to(DEVICE)
    # short (one split) and long (several) lists, some empty
    l1 = torch.randint(0, WIDTH + 1, (num_tokens,), generator=gen, dtype=torch.int32)
    l1[::4] = torch.randint(0, 40, (len(l1[::4]),), generator=gen, dtype=torch.int32)
    return swa, comp, i0, i1, torch.full((num_tokens,), 128, dtype=torch.int32).to(DEVICE), l1.to(DEVICE)


KERNELS = [0, pytest.param(1, marks=needs("gluon"))]  # the Triton kernel; the Gluon one (Hopper)


@pytest.mark.parametrize("gluon", KERNELS)
@pytest.mark.parametrize("fmt", ["fp8_v4", "bf16"])
def test_a_token_alone_equals_the_same_token_in_any_batch(monkeypatch, gluon, fmt):
    monkeypatch.setattr(attention_plan, "INVARIANT_SPLIT_BLOCKS", SPLIT_KEYS // 64)
    gen = torch.Generator().manual_seed(7 + gluon)
    big = max(BATCHES)
    swa, comp, i0, i1, l0, l1 = scopes(big, gen, fmt)
    q = torch.randn(big, HEADS, 512, generator=gen).to(torch.bfloat16).to(DEVICE)
    sink = torch.randn(HEADS, generator=gen).to(DEVICE)

    def run(rows):
        args = decode_args(q[rows], swa.data, i0[rows], l0[rows], comp.data, i1[rows], l1[rows], sink,
                           check_ranges=False)
        return attention_plan.run(args, batch_invariant=True, gluon=gluon)

    alone = [run(slice(t, t + 1)) for t in range(0, big, max(1, big // 6))]
    for n in BATCHES:
        out, lse = run(slice(0, n))
        for (o, lse_t), t in zip(alone, range(0, big, max(1, big // 6))):
            if t < n:
                assert torch.equal(out[t], o[0]) and torch.equal(lse[t], lse_t[0]), (n, t)
    # and it is the attention: the reference agrees
    ref, _ = sparse_attention_decode(q, swa.data, i0, l0, extra_cache=comp.data, extra_indices=i1, extra_lens=l1,
                                     sink=sink, backend="reference")
    got = run(slice(0, big))[0]
    assert ((got.float() - ref.float()).norm() / ref.float().norm()).item() < 1e-2


def test_the_default_splits_by_batch_size_and_invariance_does_not():
    plan = attention_plan.AttentionPlan
    fmt = PagedCache(1, 2, "bf16").fmt
    device = torch.device("cuda" if ON_GPU else "cpu")
    few = plan((1, 64, 512), device, [(fmt, 2, 1024)], False, False)
    invariant = plan((1, 64, 512), device, [(fmt, 2, 1024)], False, False, batch_invariant=True)
    many = plan((4096, 64, 512), device, [(fmt, 2, 1024)], False, False, batch_invariant=True)
    assert invariant.splits == many.splits and invariant.partial and many.partial
    assert few.partial == (few.splits > 1)
