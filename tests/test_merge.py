"""The merge of attention partials (sparse_mla.ops.merge): the formula in float64, the reference, the Triton kernel
(CPU interpreter), empty ranks, reproducibility, argument checks."""
from __future__ import annotations

import math

import pytest
import torch

from helpers import DEVICE, KERNEL_RUNS, ON_GPU, rel_err
from sparse_mla.ops import sparse_attention_decode
from sparse_mla.ops.merge import merge_partials, rescale_partial

needs_kernels = pytest.mark.skipif(not KERNEL_RUNS, reason="needs a GPU or TRITON_INTERPRET=1")


def partials(ranks: int, tokens: int, heads: int, dim: int, dtype: torch.dtype, seed: int = 0):
    """Random partials with empty ranks: rank 1 holds nothing for token 0, no rank holds anything for token 1
    (``lse = +inf``, out 0), and a sink with a head that has none (``-inf``) and one that zeroes (``+inf``)."""
    gen = torch.Generator().manual_seed(seed)
    outs = torch.randn(ranks, tokens, heads, dim, generator=gen).to(dtype)
    lses = torch.randn(ranks, tokens, heads, generator=gen) * 4
    lses[1 % ranks, 0] = math.inf
    outs[1 % ranks, 0] = 0
    lses[:, 1] = math.inf
    outs[:, 1] = 0
    sink = torch.randn(heads, generator=gen)
    sink[0], sink[-1] = -math.inf, math.inf
    return outs.to(DEVICE), lses.to(DEVICE), sink.to(DEVICE)


def formula_float64(outs: torch.Tensor, lses: torch.Tensor, sink: torch.Tensor | None):
    """``lse = logsumexp_r lse_r``, ``out = Σ_r e^{lse_r − lse} out_r / (1 + e^{sink − lse})`` in float64, empty
    ranks (``+inf``) left out; a row with no key: out 0, lse ``+inf``."""
    lse_r = lses.cpu().double()
    lse_r = torch.where(torch.isinf(lse_r), -math.inf, lse_r)
    lse = torch.logsumexp(lse_r, dim=0)
    empty = torch.isinf(lse)
    weights = torch.where(empty, 0.0, torch.exp(lse_r - torch.where(empty, 0.0, lse)))
    out = (weights[..., None] * outs.cpu().double()).sum(0)
    if sink is not None:
        out = out / (1 + torch.exp(sink.cpu().double() - lse))[..., None]
    return torch.where(empty[..., None], 0.0, out), torch.where(empty, math.inf, lse)


def check_formula(got, want, out_tol: float) -> None:
    (out, lse), (want_out, want_lse) = got, want
    out, lse = out.cpu().double(), lse.cpu().double()
    assert torch.equal(torch.isinf(lse), torch.isinf(want_lse)) and bool((lse[torch.isinf(lse)] > 0).all())
    finite = ~torch.isinf(want_lse)
    assert torch.allclose(lse[finite], want_lse[finite], rtol=1e-6, atol=2e-6)
    assert (out - want_out).abs().max() <= out_tol * want_out.abs().max()
    assert (out[~finite] == 0).all()


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=needs_kernels)])
@pytest.mark.parametrize("ranks", [1, 2, 3, 8])
def test_merge_is_the_formula(backend, ranks):
    """float32 partials and output: the merge is the formula to float32 rounding; the zeroing sink head is 0."""
    outs, lses, sink = partials(ranks, 5, 4, 512, torch.float32, seed=ranks)
    for s in (sink, None):
        got = merge_partials(outs, lses, s, backend=backend)
        assert got[0].dtype == torch.float32
        check_formula(got, formula_float64(outs, lses, s), 1e-6 * (ranks + 1))
    assert (merge_partials(outs, lses, sink, backend=backend)[0][:, -1] == 0).all()


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=needs_kernels)])
def test_bf16_partials(backend):
    """bf16 partials, bf16 output (the ops' dtype): the float32 merge rounded once (bitwise: the same kernel with a
    float32 out), within bf16 rounding of the float64 formula; non-power-of-two width."""
    outs, lses, sink = partials(3, 4, 3, 200, torch.bfloat16)
    out, lse = merge_partials(outs, lses, sink, backend=backend)
    full = torch.empty(out.shape, dtype=torch.float32, device=out.device)
    merge_partials(outs, lses, sink, out=full, backend=backend)
    assert out.dtype == torch.bfloat16
    if backend == "triton" and not ON_GPU:  # the CPU interpreter's float32 -> bf16 store truncates: one ulp
        assert ((out.float() - full).abs() <= full.abs() * 2 ** -7).all()
    else:
        assert torch.equal(out, full.to(torch.bfloat16))
    check_formula((out, lse), formula_float64(outs, lses, sink), 2 ** -7)


@needs_kernels
def test_kernel_matches_reference():
    """The Triton kernel does the reference's arithmetic in the same order: equal but for the last bit of exp."""
    outs, lses, sink = partials(4, 6, 5, 512, torch.bfloat16, seed=3)
    ref = torch.empty(6, 5, 512, device=DEVICE)
    merge_partials(outs, lses, sink, out=ref, backend="reference")
    got, lse = merge_partials(outs, lses, sink, out=torch.empty_like(ref), backend="triton")
    assert torch.allclose(got, ref, rtol=2e-6, atol=1e-7)
    assert torch.allclose(lse, merge_partials(outs, lses, sink, backend="reference")[1], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=needs_kernels)])
def test_reproducible_and_strided(backend):
    """Bitwise the same on every call and from a strided view of a packed buffer (an all-gather's layout); a
    single rank without a sink gives its partial back exactly."""
    outs, lses, sink = partials(3, 4, 2, 512, torch.bfloat16, seed=1)
    packed = torch.zeros(3, 4, 2, 512 + 16, dtype=torch.bfloat16, device=DEVICE)
    packed[..., :512] = outs
    first = merge_partials(outs, lses, sink, backend=backend)
    for again in (merge_partials(outs, lses, sink, backend=backend),
                  merge_partials(packed[..., :512], lses, sink, backend=backend)):
        assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    lone_out, lone_lse = outs[:1].float(), lses[:1]
    out, lse = merge_partials(lone_out, lone_lse, None, backend=backend)
    assert torch.equal(out, lone_out[0]) and torch.equal(lse, lone_lse[0])
    # a strided sink (every other logit of a wider tensor): each head its own (the kernels read heads at unit stride)
    wide = torch.stack([sink, sink + 3.0], 1).flatten()
    strided = wide[::2]
    assert strided.stride() == (2,)
    assert all(torch.equal(a, b) for a, b in zip(merge_partials(outs, lses, strided, backend=backend), first))
    ranks_rescaled = rescale_partial(outs[1], lses, 1, strided, backend=backend)
    assert all(torch.equal(a, b) for a, b in zip(ranks_rescaled, rescale_partial(outs[1], lses, 1, sink,
                                                                                 backend=backend)))


def test_merge_of_key_halves_is_attention_over_all_keys():
    """Two disjoint halves of every token's keys, attended without the sink and merged with it, equal one attention
    over all keys with the sink (the reference op, float32 partials kept as the op's bf16)."""
    gen = torch.Generator().manual_seed(7)
    tokens, heads, width, block = 6, 4, 40, 16
    cache = (torch.randn(8, block, 512, generator=gen) * 0.5).to(torch.bfloat16).to(DEVICE)
    q = (torch.randn(tokens, heads, 512, generator=gen) * 0.5).to(torch.bfloat16).to(DEVICE)
    idx = torch.stack([torch.randperm(8 * block, generator=gen)[:width] for _ in range(tokens)]).to(torch.int32)
    lens = torch.tensor([width, 0, 1, 17, 40, 3], dtype=torch.int32)
    sink = torch.randn(heads, generator=gen).to(DEVICE)
    half = width // 2
    parts = []
    for cols in (slice(0, half), slice(half, width)):
        part_lens = (lens - cols.start).clamp(0, half).to(torch.int32)
        parts.append(sparse_attention_decode(q, cache, idx[:, cols].contiguous().to(DEVICE), part_lens.to(DEVICE),
                                             backend="reference"))
    outs, lses = torch.stack([o for o, _ in parts]), torch.stack([lse for _, lse in parts])
    out, lse = merge_partials(outs, lses, sink)
    want_out, want_lse = sparse_attention_decode(q, cache, idx.to(DEVICE), lens.to(DEVICE), sink=sink,
                                                 backend="reference")
    assert rel_err(out.float(), want_out.float()) < 1e-2
    assert torch.equal(torch.isinf(lse), torch.isinf(want_lse))
    finite = ~torch.isinf(want_lse)
    assert torch.allclose(lse[finite], want_lse[finite], atol=1e-5, rtol=1e-5)


def test_bad_inputs_name_the_argument():
    outs, lses, sink = partials(2, 3, 4, 64, torch.bfloat16)
    cases = [
        (dict(outs=outs[0]), ValueError, "outs must be 4-D"),
        (dict(outs=outs.int()), ValueError, "outs must have dtype"),
        (dict(outs=outs.transpose(2, 3)), ValueError, "outs must have unit stride"),
        (dict(outs=outs[:0]), ValueError, "outs must hold at least one rank"),
        (dict(lses=lses[:1]), ValueError, "lses must have shape"),
        (dict(lses=lses.double()), ValueError, "lses must have dtype"),
        (dict(sink=sink[:2]), ValueError, "sink must have shape"),
        (dict(sink=sink.tolist()), TypeError, "sink must be a torch.Tensor"),
        (dict(out=torch.empty(3, 4, 63, device=DEVICE)), ValueError, "out must have shape"),
        (dict(out=torch.empty(3, 4, 64, dtype=torch.int32, device=DEVICE)), ValueError, "out must have dtype"),
        (dict(out=torch.empty(3, 64, 4, device=DEVICE).transpose(1, 2)), ValueError, "out must be contiguous"),
        (dict(out=outs[0]), ValueError, "out overlaps outs"),
        (dict(lse_out=torch.empty(3, 5, device=DEVICE)), ValueError, "lse_out must have shape"),
        (dict(backend="cuda"), ValueError, "backend must be"),
    ]
    for change, error, message in cases:
        args = dict(outs=outs, lses=lses, sink=sink) | change
        outs_arg, lses_arg, sink_arg = args.pop("outs"), args.pop("lses"), args.pop("sink")
        with pytest.raises(error, match=message):
            merge_partials(outs_arg, lses_arg, sink_arg, **args)


@pytest.mark.parametrize("bad", ["sink", "lses"])
def test_reference_checks_values_always(monkeypatch, bad):
    """The reference merge reads a NaN sink or NaN LSE as the attention ops' reference does: a ``ValueError``
    without ``SPARSE_MLA_DEBUG`` (no NaN rows handed back)."""
    monkeypatch.delenv("SPARSE_MLA_DEBUG", raising=False)
    outs, lses, sink = partials(2, 4, 8, 32, torch.float32)
    if bad == "sink":
        sink[2] = math.nan
    else:
        lses[0, 3, 1] = math.nan
    with pytest.raises(ValueError, match="sink must not be NaN" if bad == "sink" else "lses must not hold NaN"):
        merge_partials(outs, lses, sink, backend="reference")


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=needs_kernels)])
@pytest.mark.parametrize("ranks,shards", [(1, 1), (2, 2), (4, 4), (3, 1)])
def test_rescaled_partials_sum_to_the_formula(backend, ranks, shards):
    """The reduce-scatter form's half: each rank's rescaled partial, summed over the ranks, is the formula (float32
    partials); a head's term lands in its shard at ``[h // (H / shards), t, h % (H / shards)]``; every rank gets the
    merged LSE; a rank with no key for a row contributes 0 there."""
    heads = 4
    outs, lses, sink = partials(ranks, 5, heads, 512, torch.float32, seed=ranks + 10)
    want_out, want_lse = formula_float64(outs, lses, sink)
    terms = [rescale_partial(outs[r], lses, r, sink, shards=shards, backend=backend) for r in range(ranks)]
    total = sum(t.double().cpu() for t, _ in terms)  # (shards, T, per, D)
    whole = total.permute(1, 0, 2, 3).reshape(5, heads, 512)  # back to (T, H, D)
    for _, lse in terms:
        check_formula((whole, lse), (want_out, want_lse), 1e-5)
    if ranks > 1:  # rank 1 holds nothing for token 0: its term is 0 there
        assert (terms[1][0][:, 0] == 0).all()


@needs_kernels
def test_rescale_kernel_matches_reference():
    outs, lses, sink = partials(2, 6, 8, 512, torch.bfloat16, seed=3)
    for rank in range(2):
        got = rescale_partial(outs[rank], lses, rank, sink, shards=2, backend="triton")
        want = rescale_partial(outs[rank], lses, rank, sink, shards=2, backend="reference")
        assert rel_err(got[0], want[0]) <= 1e-2 and torch.allclose(got[1], want[1], rtol=1e-6, atol=1e-6)


def test_rescale_bad_inputs_name_the_argument():
    outs, lses, sink = partials(2, 3, 4, 512, torch.float32)
    with pytest.raises(ValueError, match="rank must be an int in"):
        rescale_partial(outs[0], lses, 2, sink)
    with pytest.raises(ValueError, match="shards must be a positive int dividing the 4 heads"):
        rescale_partial(outs[0], lses, 0, sink, shards=3)
    with pytest.raises(ValueError, match="lses"):
        rescale_partial(outs[0], lses[:, :2], 0, sink)
    with pytest.raises(ValueError, match="out"):
        rescale_partial(outs[0], lses, 0, sink, shards=2, out=torch.empty(3, 4, 512))
