"""The per-tensor fp8 format ``fp8_e4m3`` (FlashInfer TRTLLM-gen's V4 cache) and the FP8 query.

Quantiser against the first-principles e4m3 model of ``dense.py``; the Triton insert kernel bit-identical to the
reference quantiser; attention with an FP8 query and the scale algebra against the dense oracle.
"""
from __future__ import annotations

import pytest
import torch

from dense import dense_attention, e4m3_bytes, e4m3_round
from launch_strategies import STRATEGIES, STRATEGY_IDS, force_strategy
from sparse_mla.cache import PagedCache
from sparse_mla.formats import (FP8_E4M3, allocate_cache, block_bytes, bytes_per_token, dequantize_blocks,
                                get_format, infer_format, quantize_blocks, quantize_per_tensor)
from sparse_mla.ops import dequantize_and_gather, quantize_and_insert, sparse_attention_decode

BACKENDS = ["reference", "triton"]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the kernels' tests run where the kernels run


def model_quant(x: torch.Tensor, kv_scale: float) -> torch.Tensor:
    """Independent model: ``e4m3(x / kv_scale)`` saturated to ±448, as float64 values on the e4m3 grid."""
    return e4m3_round((x.double() / kv_scale).clamp(-448, 448))


def awkward_values(gen: torch.Generator, n: int) -> torch.Tensor:
    """bf16 tokens spanning e4m3's subnormals, normals and (for small scales) saturation, with exact zeros."""
    mag = torch.exp2(torch.randint(-14, 12, (n, 512), generator=gen).float())
    x = torch.randn(n, 512, generator=gen) * mag
    x[:, :7] = 0.0
    return x.bfloat16()


@pytest.mark.parametrize("kv_scale", [1.0, 2.0 ** -3, 2.0 ** 4])
def test_quantiser_matches_the_e4m3_model_bytes(kv_scale):
    x = awkward_values(torch.Generator().manual_seed(1), 6)
    got = quantize_per_tensor(x, torch.tensor([kv_scale]))
    want = model_quant(x, kv_scale)
    assert torch.equal(got.view(torch.float8_e4m3fn).double(), want)  # the model writes no -0: compare values
    nonzero = want != 0
    assert torch.equal(got[nonzero], e4m3_bytes(want)[nonzero])


def test_quantiser_saturates_like_torch():
    x = torch.tensor([[447.0, 448.0, 449.0, 464.0, 465.0, 480.0, 1e4, -1e4, -470.0]]).bfloat16()
    got = quantize_per_tensor(x, torch.tensor([1.0]))
    assert got.tolist() == [[0x7E, 0x7E, 0x7E, 0x7E, 0x7E, 0x7E, 0x7E, 0xFE, 0xFE]]


@pytest.mark.parametrize("kv_scale", [1.0, 0.0173, 3e-5, 7.5])
def test_triton_insert_is_bit_identical_to_the_reference_quantiser(kv_scale):
    gen = torch.Generator().manual_seed(2)
    kv = awkward_values(gen, 9)
    slots = torch.tensor([3, -1, 0, 17, 9, 23, 5, 1000, 12], dtype=torch.int32)  # -1 and out of range: skipped
    caches = [PagedCache(3, 8, "fp8_e4m3", kv_scale=kv_scale, device=DEVICE) for _ in BACKENDS]
    for cache in caches:
        cache.poison()
    in_range = torch.where(slots < 24, slots, -1)  # the reference rejects an out-of-range slot
    quantize_and_insert(kv.to(DEVICE), caches[0].data, in_range.to(DEVICE), backend="reference",
                        kv_scale=caches[0].kv_scale)
    quantize_and_insert(kv.to(DEVICE), caches[1].data, slots.to(DEVICE), backend="triton", kv_scale=caches[1].kv_scale)
    assert torch.equal(caches[0].data.view(torch.uint8), caches[1].data.view(torch.uint8))
    kept = in_range >= 0
    written = caches[0].data.view(torch.uint8).reshape(-1, 512).cpu()[in_range[kept].long()]
    assert torch.equal(written, quantize_per_tensor(kv[kept], torch.tensor([kv_scale])))


@pytest.mark.parametrize("backend", BACKENDS)
def test_gather_dequantises_with_the_scale(backend):
    gen = torch.Generator().manual_seed(3)
    cache = PagedCache(2, 4, "fp8_e4m3", kv_scale=0.03, device=DEVICE)
    kv = awkward_values(gen, 8)
    cache.write(kv.to(DEVICE), torch.arange(8, dtype=torch.int32, device=DEVICE))
    slots = torch.tensor([[7, -1], [0, 3]])
    got = dequantize_and_gather(cache.data, slots.to(DEVICE), backend=backend, kv_scale=cache.kv_scale).cpu()
    want = (model_quant(kv, 0.03) * 0.03)[slots.clamp_min(0)] * (slots >= 0)[..., None]
    # bf16 rounding of e4m3 · kv_scale (the CPU interpreter's float32 -> bf16 cast truncates: one ulp)
    assert torch.allclose(got.double(), want, rtol=2 ** -7, atol=0)
    assert (got[0, 1] == 0).all()


def test_format_table_and_cache_layout():
    assert get_format("fp8_e4m3") is FP8_E4M3 and FP8_E4M3.per_tensor and FP8_E4M3.num_tiles == 0
    assert bytes_per_token("fp8_e4m3") == 512 and block_bytes("fp8_e4m3", 64) == 64 * 512
    cache = allocate_cache("fp8_e4m3", 3, 64)
    # FlashInfer's layout: (num_blocks, block_size, 512) float8_e4m3fn, contiguous
    assert cache.dtype == torch.float8_e4m3fn and cache.shape == (3, 64, 512) and cache.is_contiguous()
    assert infer_format(cache) is FP8_E4M3
    with pytest.raises(ValueError, match="expected 512"):
        infer_format(torch.zeros(2, 4, 576, dtype=torch.float8_e4m3fn))
    kv = awkward_values(torch.Generator().manual_seed(4), 8).view(2, 4, 512)
    blocks = quantize_blocks(kv, "fp8_e4m3", kv_scale=0.5)
    want = (model_quant(kv, 0.5) * 0.5).bfloat16().double()
    assert torch.equal(dequantize_blocks(blocks, kv_scale=0.5).double(), want)
    with pytest.raises(ValueError, match="kv_scale is required"):
        quantize_blocks(kv, "fp8_e4m3")


def test_paged_cache_keeps_its_scale_and_poisons_to_nan():
    cache = PagedCache(2, 4, "fp8_e4m3")
    assert cache.kv_scale.tolist() == [1.0]
    cache.poison()
    assert torch.isnan(cache.data.float()).all()
    cache.kv_scale.fill_(0.25)
    cache.write(torch.full((1, 512), 3.0).bfloat16(), torch.tensor([2], dtype=torch.int32))
    assert cache.read(torch.tensor([2])).float().unique().tolist() == [3.0]
    with pytest.raises(ValueError, match="kv_scale is only for fp8_e4m3"):
        PagedCache(2, 4, "bf16", kv_scale=1.0)


def make_case(gen, num_tokens=4, heads=3, kv_scale=0.02, device="cpu"):
    """Two fp8_e4m3 scopes on ``device`` and each token's key values (float64, CPU); indices stay on the CPU."""
    swa = PagedCache(3, 8, "fp8_e4m3", kv_scale=kv_scale, device=device)
    comp = PagedCache(2, 4, "fp8_e4m3", kv_scale=kv_scale, device=device)
    vals = []
    for cache in (swa, comp):
        kv = (torch.randn(cache.num_slots, 512, generator=gen) * 2).bfloat16()
        cache.write(kv.to(device), torch.arange(cache.num_slots, dtype=torch.int32, device=device))
        vals.append(model_quant(kv, kv_scale) * kv_scale)
    i0 = torch.randint(0, swa.num_slots, (num_tokens, 12), generator=gen, dtype=torch.int32)
    i0[1, 3:] = -1
    i1 = torch.randint(0, comp.num_slots, (num_tokens, 5), generator=gen, dtype=torch.int32)
    l0 = torch.tensor([12, 7, 0, 4][:num_tokens], dtype=torch.int32)
    l1 = torch.tensor([5, 0, 0, 2][:num_tokens], dtype=torch.int32)
    keys = [[vals[0][int(s)] for s in i0[t, : l0[t]] if s >= 0] + [vals[1][int(s)] for s in i1[t, : l1[t]]]
            for t in range(num_tokens)]
    return swa, comp, (i0, l0, i1, l1), keys


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fp8_q", [True, False])
def test_attention_matches_the_dense_oracle(backend, fp8_q):
    check_against_the_dense_oracle(backend, fp8_q)


ORACLE_STRATEGIES = ("int", "int-q", "native-q")


@pytest.mark.parametrize("strategy", [s for s, name in zip(STRATEGIES, STRATEGY_IDS) if name in ORACLE_STRATEGIES],
                         ids=ORACLE_STRATEGIES)
@pytest.mark.parametrize("fp8_q", [True, False])
def test_attention_without_fp8_instructions_matches_the_dense_oracle(monkeypatch, fp8_q, strategy):
    """The kernel's fp8 q and cache reads by integer operations (CUDA < 8.9, AMD; ``ops.fp8``), and the other
    strategies a target's launch configuration can choose."""
    force_strategy(monkeypatch, **strategy)
    check_against_the_dense_oracle("triton", fp8_q)


def check_against_the_dense_oracle(backend: str, fp8_q: bool) -> None:
    gen = torch.Generator().manual_seed(5)
    swa, comp, (i0, l0, i1, l1), keys = make_case(gen, device=DEVICE)
    q = torch.randn(4, 3, 512, generator=gen) * 3
    sink = torch.tensor([0.3, float("-inf"), 2.0])
    q_scale = 0.01
    if fp8_q:
        q_in = (q / q_scale).clamp(-448, 448).to(torch.float8_e4m3fn)  # in range: casts above 448 differ by torch
        q_val = q_in.double() * q_scale
        kw = dict(q_scale=torch.tensor([q_scale], device=DEVICE))
    else:
        q_in, kw = q.bfloat16(), {}
        q_val = q_in.double()
    d = [t.to(DEVICE) for t in (q_in, i0, l0, i1, l1, sink)]
    out, lse = sparse_attention_decode(d[0], swa.data, d[1], d[2], extra_cache=comp.data, extra_indices=d[3],
                                       extra_lens=d[4], sink=d[5], backend=backend, kv_scale=swa.kv_scale, **kw)
    out, lse = out.cpu(), lse.cpu()
    ref_out, ref_lse = dense_attention(q_val, keys, sink=sink.double())
    assert out.dtype == torch.bfloat16 and not out.isnan().any()
    rel = (out.double() - ref_out).norm() / ref_out.norm()
    assert rel < 1e-2
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite) and (out[2] == 0).all()
    assert torch.allclose(lse[finite].double(), ref_lse[finite], atol=2e-3, rtol=1e-3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_scale_algebra(backend):
    """bmm1 = scale · q_scale · kv_scale and bmm2 = kv_scale: with the same bytes, doubling q_scale equals doubling
    the softmax scale, and doubling kv_scale while halving the softmax scale doubles the output (exactly: powers
    of two), the logits and so the LSE unchanged."""
    gen = torch.Generator().manual_seed(6)
    swa, comp, indices, _ = make_case(gen, kv_scale=0.05, device=DEVICE)
    i0, l0, i1, l1 = (t.to(DEVICE) for t in indices)
    q8 = (torch.randn(4, 3, 512, generator=gen) * 40).to(torch.float8_e4m3fn).to(DEVICE)

    def run(scale, q_scale, kv_scale):
        return sparse_attention_decode(q8, swa.data, i0, l0, extra_cache=comp.data, extra_indices=i1, extra_lens=l1,
                                       backend=backend, scale=scale, q_scale=q_scale, kv_scale=kv_scale)

    base_out, base_lse = run(0.07, 0.125, 0.05)
    out, lse = run(0.035, 0.25, 0.05)
    assert torch.equal(out, base_out) and torch.equal(lse, base_lse)
    out, lse = run(0.035, 0.125, 0.1)
    assert torch.equal(out, 2 * base_out) and torch.equal(lse, base_lse)


def test_scale_argument_checks():
    gen = torch.Generator().manual_seed(7)
    swa, comp, (i0, l0, i1, l1), _ = make_case(gen)
    q = torch.randn(4, 3, 512, generator=gen).bfloat16()

    def call(q=q, **kw):
        return sparse_attention_decode(q, swa.data, i0, l0, backend="reference", **kw)

    with pytest.raises(ValueError, match="kv_scale is required"):
        call()
    with pytest.raises(ValueError, match="kv_scale must be a positive"):
        call(kv_scale=-1.0)
    with pytest.raises(ValueError, match="kv_scale must hold one value"):
        call(kv_scale=torch.ones(2))
    with pytest.raises(ValueError, match="kv_scale must have dtype"):
        call(kv_scale=torch.ones(1, dtype=torch.float64))
    with pytest.raises(ValueError, match="q_scale must be given exactly when"):
        call(q=q.to(torch.float8_e4m3fn), kv_scale=1.0)
    with pytest.raises(ValueError, match="q_scale must be given exactly when"):
        call(kv_scale=1.0, q_scale=1.0)
    bf16 = PagedCache(3, 8, "bf16")
    with pytest.raises(ValueError, match="kv_scale is only for fp8_e4m3"):
        sparse_attention_decode(q, bf16.data, i0, l0, backend="reference", kv_scale=1.0)
    with pytest.raises(ValueError, match="kv_scale is only for fp8_e4m3"):
        quantize_and_insert(q[0], bf16.data, torch.tensor([0, 1, 2]), kv_scale=1.0)
    with pytest.raises(ValueError, match="kv_scale is required"):
        dequantize_and_gather(swa.data, torch.tensor([0]))
