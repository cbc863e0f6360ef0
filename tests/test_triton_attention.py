"""The Triton attention kernel against the reference op on fresh random inputs.

On a CPU the kernel runs in Triton's interpreter (float32 dots) at small sizes; on a GPU the same
tests run at serving sizes (bf16 dots).
"""
from __future__ import annotations

import pytest
import torch

from helpers import DEVICE, ON_GPU, check_close, needs, random_scope, random_sink, rel_err, sized
from sparse_mla.cache import PagedCache
from sparse_mla.ops import sparse_attention_decode, sparse_attention_prefill

FORMATS = [("fp8_v4", 512), ("bf16", 512), ("fp8_v32", 576), ("bf16", 576)]
# what the tests run at: interpreter-sized on a CPU, serving-sized on a GPU
SIZE = sized(
    cpu=dict(decode=[(1, 2, 20), (3, 3, 37), (17, 2, 16)], swa_width=12, swa_blocks=(3, 8), extra_blocks=(4, 4),
             prefill_heads=[1, 20], prefill=(6, 50, 33), aligned=(3, 20, 2), order=(5, 3, 12, 30, 8),
             order_gluon=[None], order_cases=[("fp8_v4", 512, None), ("bf16", 512, None), ("fp8_v32", 576, None)]),
    cuda=dict(decode=[(1, 64, 640), (7, 128, 2048), (16, 64, 1152), (64, 32, 128), (100, 16, 300), (128, 48, 1152)],
              swa_width=128, swa_blocks=(8, 64), extra_blocks=(64, 64), prefill_heads=[64, 128, 24],
              prefill=(300, 4096, 1152), aligned=(8, 100, 64), order=(150, 72, 128, 700, 64), order_gluon=[None, 0],
              order_cases=[("fp8_v4", 512, None), ("bf16", 512, None), ("fp8_v32", 576, None), ("bf16", 576, None),
                           ("fp8_v4", 512, 0)]),  # the Triton kernel where Gluon is the default
)


def decode_both(q, scopes, sink, splits=None, gluon=None):
    (c0, i0, l0), *rest = scopes
    kw = {}
    if rest:
        c1, i1, l1 = rest[0]
        kw = dict(extra_cache=c1.data, extra_indices=i1, extra_lens=l1)
    ref = sparse_attention_decode(q, c0.data, i0, l0, sink=sink, backend="reference", **kw)
    if splits is None and gluon is None:
        got = sparse_attention_decode(q, c0.data, i0, l0, sink=sink, backend="triton", **kw)
    else:
        from sparse_mla.ops import attention_plan
        from sparse_mla.ops.validate import decode_args

        got = attention_plan.run(decode_args(q, c0.data, i0, l0, sink=sink, **kw), splits=splits, gluon=gluon)
    return got, ref


@pytest.mark.parametrize("fmt,dim", FORMATS)
@pytest.mark.parametrize("num_heads,num_tokens,width", SIZE["decode"])
def test_decode_two_scopes_matches_reference(fmt, dim, num_heads, num_tokens, width):
    gen = torch.Generator().manual_seed(hash((fmt, dim, num_heads, width)) % 2**31)
    swa_width = min(width, SIZE["swa_width"])
    scopes = [random_scope(gen, fmt, dim, num_tokens, swa_width, *SIZE["swa_blocks"]),
              random_scope(gen, fmt, dim, num_tokens, width, *SIZE["extra_blocks"])]
    q = torch.randn(num_tokens, num_heads, dim, generator=gen).to(torch.bfloat16).to(DEVICE)
    check_close(*decode_both(q, scopes, random_sink(gen, num_heads)))


@pytest.mark.parametrize("fmt,dim", [("fp8_v4", 512), ("fp8_v32", 576), ("bf16", 512)])
@pytest.mark.parametrize("splits", [2, 3])
def test_split_key_lists_merge_exactly(splits, fmt, dim):
    gen = torch.Generator().manual_seed(7 + splits)
    scopes = [random_scope(gen, fmt, dim, 5, 24, 4, 8), random_scope(gen, fmt, dim, 5, 40, 4, 16)]
    q = torch.randn(5, 4, dim, generator=gen).to(torch.bfloat16).to(DEVICE)
    check_close(*decode_both(q, scopes, random_sink(gen, 4), splits=splits))


@pytest.mark.parametrize("fmt,dim", [("fp8_v4", 512), ("fp8_v32", 576)])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("form", ["two scopes", "combined"])
def test_lens_shared_by_consecutive_tokens_read_like_expanded_ones(fmt, dim, splits, form):
    """``tokens_per_len``: each group of consecutive tokens reads one length (FlashMLA's per-request topk_length),
    bit for bit what the same lens expanded per token give, and the reference's answer."""
    from sparse_mla.ops import attention_plan
    from sparse_mla.ops.validate import decode_args

    gen = torch.Generator().manual_seed(hash((fmt, splits, form)) % 2**31)
    group, num_tokens, heads = 3, 6, 4
    swa, comp = random_scope(gen, fmt, dim, num_tokens, 12, 4, 8), random_scope(gen, fmt, dim, num_tokens, 30, 4, 16)
    q = torch.randn(num_tokens, heads, dim, generator=gen).to(torch.bfloat16).to(DEVICE)
    sink = random_sink(gen, heads)
    if form == "combined":
        idx = torch.cat([swa[1], comp[1]], 1)
        lens = torch.randint(0, idx.shape[1] + 1, (num_tokens // group,), generator=gen, dtype=torch.int32).to(DEVICE)
        kw, extra_lens = dict(extra_cache=comp[0].data, combined_window=12), {}
    else:
        idx, lens = swa[1], swa[2][::group].contiguous()
        kw, extra_lens = dict(extra_cache=comp[0].data, extra_indices=comp[1]), dict(extra_lens=comp[2][::group])

    def run(per, backend="triton"):
        per_lens = {k: v.repeat_interleave(group // per) for k, v in dict(lens=lens, **extra_lens).items()}
        if backend == "reference":
            return sparse_attention_decode(q, swa[0].data, idx, sink=sink, backend=backend, tokens_per_len=per,
                                           **per_lens, **kw)
        return attention_plan.run(decode_args(q, swa[0].data, idx, sink=sink, tokens_per_len=per, **per_lens,
                                                **kw), splits=splits)

    (out, lse), (out_tok, lse_tok) = run(group), run(1)
    assert torch.equal(out, out_tok) and torch.equal(lse, lse_tok)
    check_close((out, lse), run(group, "reference"))
    check_close((out, lse), run(1, "reference"))


def test_tokens_per_len_is_checked():
    gen = torch.Generator().manual_seed(5)
    cache, idx, lens = random_scope(gen, "bf16", 512, 6, 12, 4, 8)
    q = torch.randn(6, 2, 512, generator=gen).to(torch.bfloat16).to(DEVICE)
    with pytest.raises(ValueError, match="tokens_per_len must be a positive int dividing"):
        sparse_attention_decode(q, cache.data, idx, lens[:2], tokens_per_len=4)
    with pytest.raises(ValueError, match="lens"):
        sparse_attention_decode(q, cache.data, idx, lens, tokens_per_len=2)  # (6,), not (3,)
    indptr = torch.arange(0, 7 * 12, 12, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="ragged"):
        sparse_attention_decode(q, cache.data, idx.reshape(-1), indptr=indptr, tokens_per_len=2)


@pytest.mark.parametrize("view", ["every other head", "every other dim"])
def test_single_scope_no_sink_and_noncontiguous_q(view):
    gen = torch.Generator().manual_seed(3)
    cache, idx, lens = random_scope(gen, "fp8_v4", 512, 4, 30, 4, 16, lens_mode="full")
    if view == "every other head":
        q = torch.randn(4, 10, 512, generator=gen).to(torch.bfloat16).to(DEVICE)[:, ::2]
    else:  # the last dim strided too: the kernels need a unit-stride copy
        q = torch.randn(4, 5, 1024, generator=gen).to(torch.bfloat16).to(DEVICE)[..., ::2]
    assert not q.is_contiguous()
    got = sparse_attention_decode(q, cache.data, idx, lens, backend="triton")
    ref = sparse_attention_decode(q.contiguous(), cache.data, idx, lens, backend="reference")
    check_close(got, ref)


def test_a_q_whose_heads_lie_2_31_elements_apart_reads_like_its_contiguous_copy():
    """The kernels offset q's heads in int32 (head · q.stride(1)): a head-major buffer's transposed view whose heads
    lie 2^30 + 2^20 elements apart put head 2 past 2^31, which wrapped (it read other memory: a zero q's LSE, ln 16).
    Such a q goes to the kernels as its contiguous copy (``validate.kernel_takes_q``). The storage is 2.15 GiB of
    float8 codes, only the heads' rows of it ever touched."""
    from sparse_mla.ops.validate import kernel_takes_q

    gen = torch.Generator().manual_seed(12)
    heads, dim, apart = 3, 512, (1 << 30) + (1 << 20)
    store = torch.empty((heads - 1) * apart + dim, dtype=torch.float8_e4m3fn, device=DEVICE)
    q = store.as_strided((1, heads, dim), (dim, apart, 1))
    q.copy_((torch.randn(1, heads, dim, generator=gen) * 8).to(torch.float8_e4m3fn).to(DEVICE))
    assert not kernel_takes_q(q) and kernel_takes_q(q.contiguous())
    cache = torch.randn(1, 64, dim, generator=gen).to(torch.bfloat16).to(DEVICE)
    idx = torch.arange(16, dtype=torch.int32, device=DEVICE)[None]
    q_scale = torch.tensor([0.05], device=DEVICE)
    got = sparse_attention_decode(q, cache, idx, fmt="bf16", q_scale=q_scale, backend="triton")
    ref = sparse_attention_decode(q.contiguous(), cache, idx, fmt="bf16", q_scale=q_scale, backend="reference")
    check_close(got, ref)
    del q, store


@pytest.mark.parametrize("layout", ["strided", "broadcast"])
def test_strided_indices_lens_and_sink_read_like_contiguous_ones(layout):
    """Index rows, lens and sink with any strides (views, expands) give the contiguous answer."""
    gen = torch.Generator().manual_seed(11)
    cache, idx, lens = random_scope(gen, "bf16", 512, 6, 24, 4, 8)
    sink = random_sink(gen, 4)
    if layout == "strided":
        wide = torch.full((6, 48), -1, dtype=torch.int32, device=DEVICE)
        wide[:, ::2] = idx
        idx_view, lens_view = wide[:, ::2], torch.stack([lens, lens], 1)[:, 1]
        sink_view = torch.stack([sink, sink], 1)[:, 0]
    else:
        idx, lens, sink = idx[:1].expand(6, -1), lens[:1].expand(6), sink[:1].expand(4)
        idx_view, lens_view, sink_view = idx, lens, sink
    assert not (idx_view.is_contiguous() or lens_view.is_contiguous() or sink_view.is_contiguous())
    q = torch.randn(6, 4, 512, generator=gen).to(torch.bfloat16).to(DEVICE)
    got = sparse_attention_decode(q, cache.data, idx_view, lens_view, sink=sink_view, backend="triton")
    ref = sparse_attention_decode(q, cache.data, idx.contiguous(), lens.contiguous(), sink=sink.contiguous(),
                                  backend="reference")
    check_close(got, ref)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_out_aliasing_an_input_is_rejected(backend):
    gen = torch.Generator().manual_seed(12)
    kv = torch.randn(8, 512, generator=gen).to(torch.bfloat16).to(DEVICE)
    idx = torch.arange(8, dtype=torch.int32, device=DEVICE).view(4, 2)
    q = torch.randn(4, 2, 512, generator=gen).to(torch.bfloat16).to(DEVICE)
    with pytest.raises(ValueError, match="out overlaps kv"):
        sparse_attention_prefill(q, kv, idx, backend=backend, out=kv.view(4, 2, 512))
    with pytest.raises(ValueError, match="out overlaps q"):
        sparse_attention_prefill(q, kv, idx, backend=backend, out=q)


@pytest.mark.parametrize("fmt,dim", FORMATS)
def test_out_of_range_indices_are_never_read(monkeypatch, fmt, dim):
    """Outside debug mode an out-of-range slot is treated as -1, so the kernel reads nothing outside the cache."""
    monkeypatch.delenv("SPARSE_MLA_DEBUG", raising=False)
    gen = torch.Generator().manual_seed(11)
    cache, idx, lens = random_scope(gen, fmt, dim, 3, 20, 2, 16, lens_mode="full")
    bad = idx.clone()
    bad[:, ::4] = 10**6
    bad[0, 1] = -5
    q = torch.randn(3, 2, dim, generator=gen).to(torch.bfloat16).to(DEVICE)
    got = sparse_attention_decode(q, cache.data, bad, lens, backend="triton")
    cleaned = torch.where((bad >= cache.num_slots) | (bad < 0), -1, bad)
    check_close(got, sparse_attention_decode(q, cache.data, cleaned, lens, backend="reference"))


def test_debug_mode_rejects_out_of_range(monkeypatch):
    monkeypatch.setenv("SPARSE_MLA_DEBUG", "1")
    gen = torch.Generator().manual_seed(12)
    cache, idx, lens = random_scope(gen, "bf16", 512, 2, 8, 2, 8, lens_mode="full")
    idx[1, 3] = cache.num_slots
    with pytest.raises(ValueError, match="indices"):
        sparse_attention_decode(torch.zeros(2, 1, 512, dtype=torch.bfloat16, device=DEVICE), cache.data, idx, lens,
                                backend="triton")


@pytest.mark.parametrize("num_heads", SIZE["prefill_heads"])
def test_prefill_workspace_matches_reference(num_heads):
    gen = torch.Generator().manual_seed(num_heads)
    num_tokens, rows, width = SIZE["prefill"]
    kv = torch.randn(rows, 512, generator=gen).to(torch.bfloat16).to(DEVICE)
    kv[rows // 2:] = float("nan")  # rows never indexed
    idx = torch.randint(0, rows // 2, (num_tokens, width), generator=gen).int().to(DEVICE)
    idx[torch.rand(num_tokens, width, generator=gen).to(DEVICE) < 0.2] = -1
    lens = torch.randint(0, width + 1, (num_tokens,), generator=gen).int().to(DEVICE)
    q = torch.randn(num_tokens, num_heads, 512, generator=gen).to(torch.bfloat16).to(DEVICE)
    sink = random_sink(gen, num_heads)
    got = sparse_attention_prefill(q, kv, idx, lens, sink=sink, backend="triton")
    ref = sparse_attention_prefill(q, kv, idx, lens, sink=sink, backend="reference")
    check_close(got, ref)


@pytest.mark.skipif(ON_GPU, reason="CPU-only behaviour")
def test_triton_backend_on_cpu_without_interpreter_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    cache = PagedCache(1, 4, "bf16")
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        sparse_attention_decode(torch.zeros(1, 1, 512, dtype=torch.bfloat16), cache.data,
                                torch.zeros(1, 2, dtype=torch.int32), backend="triton")


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_out_is_written_in_place(backend):
    gen = torch.Generator().manual_seed(21)
    cache, idx, lens = random_scope(gen, "fp8_v4", 512, 3, 10, 2, 8)
    q = torch.randn(3, 2, 512, generator=gen).to(torch.bfloat16).to(DEVICE)
    buf = torch.full((5, 2, 512), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    got, _ = sparse_attention_decode(q, cache.data, idx, lens, backend=backend, out=buf[1:4])
    assert got.data_ptr() == buf[1:4].data_ptr()
    assert buf[[0, 4]].isnan().all() and not buf[1:4].isnan().any()
    with pytest.raises(ValueError, match="out must be contiguous"):
        sparse_attention_decode(q, cache.data, idx, lens, backend=backend, out=buf[1:4].transpose(0, 1).contiguous()
                                .transpose(0, 1))


def test_gluon_path_only_on_validated_triton_or_when_asked(monkeypatch):
    from sparse_mla.ops.gluon import host as gluon_attention

    if gluon_attention.gluon is None:
        pytest.skip("this Triton has no Gluon")
    monkeypatch.setattr(gluon_attention.triton, "__version__", "3.6.0")
    monkeypatch.delenv("SPARSE_MLA_GLUON", raising=False)
    assert gluon_attention.enabled()
    monkeypatch.setenv("SPARSE_MLA_GLUON", "0")
    assert not gluon_attention.enabled()
    monkeypatch.setattr(gluon_attention.triton, "__version__", "9.9.0")
    monkeypatch.delenv("SPARSE_MLA_GLUON")
    assert not gluon_attention.enabled()
    monkeypatch.setenv("SPARSE_MLA_GLUON", "1")
    assert gluon_attention.enabled()


@pytest.mark.skipif(not ON_GPU, reason="on a CPU only the Triton kernel exists")
@pytest.mark.parametrize("fmt,dim", FORMATS)
@pytest.mark.parametrize("splits", [1, 3])
def test_triton_kernel_where_gluon_is_the_default(fmt, dim, splits):
    """On Hopper the Gluon kernel serves fp8_v4 / fp8_v32 / bf16 scopes; the Triton kernel stays correct there too."""
    gen = torch.Generator().manual_seed(31 + splits)
    scopes = [random_scope(gen, fmt, dim, 40, 128, 8, 64), random_scope(gen, fmt, dim, 40, 640, 64, 64)]
    q = torch.randn(40, 72, dim, generator=gen).to(torch.bfloat16).to(DEVICE)
    check_close(*decode_both(q, scopes, random_sink(gen, 72), splits=splits, gluon=0))


@needs("gluon")
@pytest.mark.parametrize("fmt,dim", FORMATS)
def test_the_default_kernel_on_hopper_is_gluon_for_every_one_format_call(fmt, dim):
    """Where the Gluon kernel is enabled on a Hopper GPU it is what ``backend="auto"`` runs for V4 and V3.2 scopes
    of one format (so the GPU runs of this file's tests check it), and the Triton kernel for mixed formats."""
    from sparse_mla.ops import attention_kernel, dispatch

    gen = torch.Generator().manual_seed(3)
    cache, _, _ = random_scope(gen, fmt, dim, 2, 8, 2, 64)
    q = torch.zeros(2, 16, dim, dtype=torch.bfloat16, device=DEVICE)
    assert attention_kernel("auto", q, cache.data) == "gluon"
    other = "bf16" if fmt != "bf16" else {512: "fp8_v4", 576: "fp8_v32"}[dim]
    assert dispatch.attention_kernel(q.device, dim, frozenset({fmt, other}), True) == "triton"


@pytest.mark.skipif(not ON_GPU, reason="the GPU kernels' dequantisation (the interpreter runs it in float32)")
@pytest.mark.parametrize("gluon", [None, 0])
@pytest.mark.parametrize("fmt,dim", [("fp8_v4", 512), ("fp8_v32", 576)])
def test_fp8_keys_are_read_exactly_at_any_tile_scale(fmt, dim, gluon):
    """One key per token and no sink: every head's output is the key's dequantised row (its first 512 dims), bit
    for bit, for tile magnitudes 2^-20 … 2^60 (e4m3 subnormals and signed zeros included)."""
    from sparse_mla.ops import attention_plan
    from sparse_mla.ops.validate import decode_args

    gen = torch.Generator().manual_seed(2026)
    num_tokens = 256
    cache = PagedCache(4, 64, fmt, dim, DEVICE)
    cache.poison()
    magnitude = torch.randint(-20, 61, (num_tokens, dim // 64), generator=gen).float().repeat_interleave(64, dim=1)
    kv = torch.randn(num_tokens, dim, generator=gen) * 2.0 ** magnitude
    kv[:, ::17] = 0.0
    kv[:, 5::17] = -0.0
    slots = torch.randperm(cache.num_slots, generator=gen)[:num_tokens].int().to(DEVICE)
    cache.write(kv.to(torch.bfloat16).to(DEVICE), slots)
    q = torch.randn(num_tokens, 64, dim, generator=gen).to(torch.bfloat16).to(DEVICE)
    lens = torch.ones(num_tokens, dtype=torch.int32, device=DEVICE)
    out, _ = attention_plan.run(decode_args(q, cache.data, slots[:, None], lens), gluon=gluon)
    assert torch.equal(out, cache.read(slots)[:, None, :512].expand_as(out))


@pytest.mark.skipif(not ON_GPU, reason="a race between GPU warps")
@pytest.mark.parametrize("fmt,dim", FORMATS)
@pytest.mark.parametrize("splits", [1, 3])
def test_repeated_calls_give_identical_outputs(fmt, dim, splits):
    """Odd block counts (per split too), 128 heads, no sink (the shortest epilogue): twenty calls give
    the same bits and match the reference. A warpgroup that staged its output rows (unsplit rows) in
    shared memory still being read by another one's wgmma would break this."""
    gen = torch.Generator().manual_seed(404)
    scopes = [random_scope(gen, fmt, dim, 96, 128, 8, 64, lens_mode="full"),
              random_scope(gen, fmt, dim, 96, 320, 64, 64, lens_mode="full")]
    q = torch.randn(96, 128, dim, generator=gen).to(torch.bfloat16).to(DEVICE)
    first = decode_both(q, scopes, None, splits=splits)
    check_close(*first)
    for _ in range(20):
        out, lse = decode_both(q, scopes, None, splits=splits)[0]
        assert torch.equal(out, first[0][0]) and torch.equal(lse, first[0][1])


def test_forcing_the_gluon_kernel_where_it_does_not_fit_is_an_error():
    """``gluon=1`` on inputs the Hopper kernel cannot compute (here: scopes of two formats, or no Hopper
    GPU) raises instead of running it on them."""
    from sparse_mla.ops import attention_plan
    from sparse_mla.ops.validate import decode_args

    gen = torch.Generator().manual_seed(5)
    cache, idx, lens = random_scope(gen, "fp8_v32", 576, 2, 8, 2, 8)
    extra, extra_idx, extra_lens = random_scope(gen, "bf16", 576, 2, 8, 2, 8)
    q = torch.randn(2, 2, 576, generator=gen).to(torch.bfloat16).to(DEVICE)
    with pytest.raises(ValueError, match="gluon=1 needs a Hopper GPU"):
        attention_plan.run(decode_args(q, cache.data, idx, lens, extra.data, extra_idx, extra_lens), gluon=1)


def shifted_copy(cache: torch.Tensor, shift: int) -> torch.Tensor:
    """A copy of ``cache`` (same shape and strides) whose storage starts ``shift`` elements into an allocation."""
    buf = torch.empty(cache.untyped_storage().nbytes() // cache.element_size() + shift, dtype=cache.dtype,
                      device=cache.device)
    out = buf.as_strided(cache.shape, cache.stride(), shift)
    out.copy_(cache)
    return out


@pytest.mark.parametrize("fmt,dim", [("fp8_v4", 512), ("fp8_v32", 576)])
def test_fp8_cache_off_a_4_byte_boundary_is_rejected(fmt, dim):
    """The GPU kernels read fp8 caches' rope, scales and (fp8_v4) e4m3 bytes as aligned words: a cache view
    that starts at an odd byte is a clear error on every backend, not a misaligned read."""
    gen = torch.Generator().manual_seed(31)
    cache, idx, lens = random_scope(gen, fmt, dim, 3, 20, 4, 64)
    q = torch.randn(3, 2, dim, generator=gen).to(torch.bfloat16).to(DEVICE)
    for backend in ("reference", "triton"):
        with pytest.raises(ValueError, match="cache: every .* block must start on a 4-byte boundary"):
            sparse_attention_decode(q, shifted_copy(cache.data, 1), idx, lens, backend=backend)


@pytest.mark.parametrize("fmt,shift", [("fp8_v4", 4), ("bf16", 1)])
def test_cache_off_a_16_byte_boundary_gives_the_same_attention(fmt, shift):
    """A cache whose pages start off a 16-byte boundary (on a 4-byte one for fp8) is read correctly: the Hopper
    kernel copies with 16-byte cp.async, so it leaves such caches to the Triton kernel."""
    from sparse_mla.cache_views import pages_16_byte_aligned

    gen = torch.Generator().manual_seed(32)
    num_tokens, width, num_heads = SIZE["aligned"]
    cache, idx, lens = random_scope(gen, fmt, 512, num_tokens, width, 4, 64)
    shifted = shifted_copy(cache.data, shift)
    q = torch.randn(num_tokens, num_heads, 512, generator=gen).to(torch.bfloat16).to(DEVICE)
    assert pages_16_byte_aligned(cache.data) and not pages_16_byte_aligned(shifted)
    ref = sparse_attention_decode(q, cache.data, idx, lens, backend="reference")
    check_close(sparse_attention_decode(q, shifted, idx, lens, backend="triton"), ref)


@pytest.mark.parametrize("fmt,dim,gluon", SIZE["order_cases"])
@pytest.mark.parametrize("splits", [1, 2])
def test_token_order_changes_no_bit(fmt, dim, splits, gluon):
    """Programs taking tokens longest-first, or in any permuted order, compute the same bits."""
    from sparse_mla.ops import longest_first, attention_plan
    from sparse_mla.ops.validate import decode_args

    gen = torch.Generator().manual_seed(100 * splits + dim + len(fmt))
    num_tokens, num_heads, width0, width1, block_size = SIZE["order"]
    (c0, i0, l0), (c1, i1, l1) = (random_scope(gen, fmt, dim, num_tokens, width0, 4, block_size),
                                  random_scope(gen, fmt, dim, num_tokens, width1, 16, block_size))
    q = torch.randn(num_tokens, num_heads, dim, generator=gen).to(torch.bfloat16).to(DEVICE)
    sink = random_sink(gen, num_heads)
    kw = dict(extra_cache=c1.data, extra_indices=i1, extra_lens=l1, sink=sink)
    ref = sparse_attention_decode(q, c0.data, i0, l0, backend="reference", **kw)
    plain = attention_plan.run(decode_args(q, c0.data, i0, l0, **kw), splits=splits, gluon=gluon)
    check_close(plain, ref)
    shuffled = torch.randperm(num_tokens, generator=gen).int().to(DEVICE)
    for order in (longest_first(l0, l1), shuffled):
        out, lse = attention_plan.run(decode_args(q, c0.data, i0, l0, order=order, **kw), splits=splits,
                                        gluon=gluon)
        assert torch.equal(out, plain[0]) and torch.equal(lse, plain[1])


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_bad_token_orders_are_named(monkeypatch, backend):
    monkeypatch.setenv("SPARSE_MLA_DEBUG", "1")  # the permutation check syncs: the fast path makes it in debug mode
    gen = torch.Generator().manual_seed(5)
    cache, idx, lens = random_scope(gen, "bf16", 512, 4, 10, 2, 8)
    q = torch.randn(4, 2, 512, generator=gen).to(torch.bfloat16).to(DEVICE)
    for order, match in ((torch.arange(4, device=DEVICE), "order must have dtype torch.int32"),
                         (torch.arange(5, dtype=torch.int32, device=DEVICE), r"order must have shape \(4,\)"),
                         (torch.tensor([0, 1, 1, 3], dtype=torch.int32, device=DEVICE),
                          "order holds token 1 more than once and misses token 2: it must be a permutation of 0 … 3"),
                         (torch.tensor([0, 1, 9, 3], dtype=torch.int32, device=DEVICE), "order holds 9, out of range")):
        with pytest.raises(ValueError, match=match):
            sparse_attention_decode(q, cache.data, idx, lens, backend=backend, order=order)


@pytest.mark.parametrize("gluon", SIZE["order_gluon"])
def test_programs_take_the_tokens_order_names(gluon):
    """Without debug checks a bad order is not caught. The kernels clamp each entry into range: the tokens it
    names are computed (and right), the others left unwritten, and nothing outside the op's tensors is touched."""
    from sparse_mla.ops import attention_plan
    from sparse_mla.ops.validate import decode_args

    gen = torch.Generator().manual_seed(6)
    cache, idx, lens = random_scope(gen, "fp8_v4", 512, 5, 10, 2, 8)
    q = torch.randn(5, 2, 512, generator=gen).to(torch.bfloat16).to(DEVICE)
    out = torch.full((5, 2, 512), 7.0, dtype=torch.bfloat16, device=DEVICE)
    order = torch.tensor([0, 0, 1 << 30, -(1 << 30), 2], dtype=torch.int32, device=DEVICE)  # 0, 0, 4, 0, 2
    got, _ = attention_plan.run(decode_args(q, cache.data, idx, lens, out=out, order=order, check_ranges=False),
                                  gluon=gluon)
    ref, _ = sparse_attention_decode(q, cache.data, idx, lens, backend="reference")
    named = [0, 2, 4]
    assert rel_err(got[named], ref[named]) < 1e-2
    assert (got[[1, 3]] == 7.0).all()


def test_attention_kernel_names_what_runs():
    """``ops.attention_kernel`` resolves ``backend`` to the kernel that ``sparse_attention_decode`` runs."""
    from sparse_mla.ops import attention_kernel

    cache = PagedCache(1, 64, "fp8_v4", 512, DEVICE)
    q = torch.zeros(2, 64, 512, dtype=torch.bfloat16, device=DEVICE)
    assert attention_kernel("reference", q, cache.data) == "reference"
    assert attention_kernel("triton", q, cache.data) in (("triton", "gluon") if ON_GPU else ("triton",))
    assert attention_kernel("auto", q, cache.data) == (attention_kernel("triton", q, cache.data) if ON_GPU
                                                       else "reference")
    with pytest.raises(ValueError, match="backend must be"):
        attention_kernel("cuda", q, cache.data)


@pytest.mark.parametrize("tokens,heads,blocks,want,want_tails", [
    (148, 16, 32, (4, 148), (8, 16)),  # the docstring's example: 2 waves unsplit, the last nearly empty
    # 296 programs of 128-head tokens: cutting every list costs more in partials than the short last wave does;
    # cutting the last wave's 16 tokens' lists in 4 fills the SMs the whole lists leave idle
    (148, 128, 32, (1, 0), (4, 16)),
    (296, 128, 32, (1, 0), (2, 32)),  # the last of 5 waves half full: every list in 2 gains under 15 %, a tail 7 %
    (128, 64, 32, (1, 0), (1, 0)),  # one whole wave
    (200, 64, 32, (1, 0), (1, 0)),  # the last wave more than half full
    (256, 64, 10, (1, 0), (1, 0)),  # two whole waves
    (4096, 64, 20, (1, 0), (1, 0)),  # large grids stay unsplit
    (40, 64, 32, (3, 40), (3, 40)),  # a third of the SMs: every list split to fill them (132 // 40)
    # V4-Flash decode (2 tokens a request, 64 heads; c4a lists 10 blocks, c128a 6): B 32 stays whole (two pieces
    # and the combine cost what half a list saves), B 24's c4a and B 16's both split (H200, docs/history.md v32)
    (64, 64, 10, (1, 0), (1, 0)),
    (64, 64, 6, (1, 0), (1, 0)),
    (48, 64, 10, (2, 48), (2, 48)),
    (48, 64, 6, (1, 0), (1, 0)),
    (32, 64, 10, (4, 32), (4, 32)),
    (32, 64, 6, (3, 32), (3, 32)),
    (16, 64, 10, (5, 16), (5, 16)),
    (16, 64, 6, (3, 16), (3, 16)),
    (16, 64, 4, (1, 0), (1, 0)),  # 4 blocks: two pieces of 2 and the combine cost more than the 2 blocks saved
    (32, 128, 18, (2, 32), (2, 32)),  # V4-Pro B 16's c4a (64 programs): half of 18 blocks pays for the split
    (40, 64, 1, (1, 0), (1, 0)),  # a one-block list is never split
    (0, 64, 32, (1, 0), (1, 0)),  # no token
])
def test_choose_splits_on_an_h100_sized_gpu(tokens, heads, blocks, want, want_tails):
    from sparse_mla.ops import attention_plan

    head_blocks = -(-heads // 64)
    assert attention_plan.choose_splits(tokens, heads, head_blocks, blocks, 132) == want
    assert attention_plan.choose_splits(tokens, heads, head_blocks, blocks, 132, tails=True) == want_tails


@pytest.mark.parametrize("version, want", [("3.6.0", True), ("3.7.1", False), ("3.8.0", True), ("3.9.0", False)])
def test_persistent_programs_only_on_the_tritons_whose_build_ran_faster_for_them(version, want, monkeypatch):
    from sparse_mla.ops.gluon import host

    if host.triton is None:
        pytest.skip("no Triton")
    monkeypatch.setattr(host.triton, "__version__", version)
    # V4-Pro B 128's c4a launch: 256 tokens x 2 head blocks = 512 items of at most 18 key blocks on 132 SMs
    assert host.persistent(512, 18, 132) is want
    assert not host.persistent(200, 18, 132) and not host.persistent(512, 25, 132)  # too few items / too long


@pytest.mark.parametrize("arch, want", [(("cuda", 90), 22), (("hip", "gfx1201"), 8), (None, 4)])
def test_a_plan_for_a_target_counts_its_sms(arch, want):
    """A plan made on the CPU for a target splits as on that GPU (targets.Target.sms, the portability report's
    plans): one token of 64 heads over a 128 + 4096-key list (66 blocks) is cut into as many pieces as the SMs take
    its programs, at most 32, the fewest that give the shortest piece — an H100's 132 SMs one program of 64 heads (22
    pieces of 3 blocks: 32 would leave 10 empty), an RX 9070 XT's 32 WGPs four of 16 heads (8 each); the interpreter
    (no target) counts 4."""
    from sparse_mla.formats import get_format
    from sparse_mla.ops import attention_plan, targets

    bf16 = get_format("bf16", 512)
    plan = attention_plan.AttentionPlan((1, 64, 512), torch.device("cpu"), [(bf16, 64, 128), (bf16, 64, 4096)],
                                        True, False, target=targets.target_for(*arch) if arch else None)
    assert plan.splits == want


def test_a_tail_split_needs_the_gluon_kernel():
    from sparse_mla.ops import attention_plan
    from sparse_mla.ops.validate import decode_args

    gen = torch.Generator().manual_seed(3)
    cache, idx, lens = random_scope(gen, "bf16", 512, 4, 40, 8, 64)
    args = decode_args(torch.randn(4, 16, 512, generator=gen).to(torch.bfloat16).to(DEVICE), cache.data, idx, lens)
    with pytest.raises(ValueError, match="tail=2 needs the Gluon kernel"):
        attention_plan.run(args, splits=2, tail=2, gluon=0)


@pytest.mark.parametrize("ordered", [False, True])
def test_the_combine_of_a_tail_split_merges_those_tokens_rows_only(ordered):
    """``TAIL``: the combine takes the token slots from ``first_slot`` on (through the order), merges their pieces
    by LSE (an empty piece skipped) with the sink, and leaves every other token's row alone."""
    from sparse_mla.ops.triton import attention as triton_attention

    tokens, heads, splits, first = 6, 3, 2, 4
    gen = torch.Generator().manual_seed(int(ordered))
    order = torch.randperm(tokens, generator=gen).int()  # without HAS_ORDER the kernel must not read it
    part_o = torch.randn(splits, tokens, heads, 512, generator=gen)
    part_lse = torch.randn(splits, tokens, heads, generator=gen)
    part_lse[1, :, 0] = float("-inf")  # an empty piece in each token's head 0
    sink = torch.randn(heads, generator=gen)
    out = torch.full((tokens, heads, 512), 7.0, dtype=torch.bfloat16)
    lse = torch.full((tokens, heads), 7.0)
    t = [x.to(DEVICE) for x in (part_o, part_lse, out, lse, sink, order)]
    triton_attention._combine_kernel[((tokens - first) * heads,)](*t, tokens * heads, heads, first, SPLITS=splits,
                                                                  HAS_SINK=True, TAIL=True, HAS_ORDER=ordered)
    got_out, got_lse = t[2].cpu(), t[3].cpu()
    slots = order if ordered else torch.arange(tokens, dtype=torch.int32)
    cut = slots[first:].long()
    want_lse = torch.logsumexp(part_lse[:, cut], 0)
    weights = torch.exp(part_lse[:, cut] - want_lse) / (1 + torch.exp(sink - want_lse))
    want_out = (weights[..., None] * part_o[:, cut]).sum(0)
    assert rel_err(got_out[cut], want_out) < 1e-2 and torch.allclose(got_lse[cut], want_lse, atol=1e-5)
    rest = slots[:first].long()
    assert (got_out[rest] == 7).all() and (got_lse[rest] == 7).all(), "the whole tokens' rows are not the combine's"


def gluon_decode_case(fmt: str, dim: int, num_tokens: int, heads: int, seed: int):
    """For the Gluon kernel's tests (``needs("gluon")``): q ``(num_tokens, heads, dim)``, two random scopes of
    ``fmt`` (128 and 700 wide) as ``(cache, indices, lens)``, and the keyword arguments that pass the second scope
    and a sink."""
    gen = torch.Generator().manual_seed(seed)
    (c0, i0, l0), (c1, i1, l1) = (random_scope(gen, fmt, dim, num_tokens, 128, 8, 64),
                                  random_scope(gen, fmt, dim, num_tokens, 700, 16, 64))
    q = torch.randn(num_tokens, heads, dim, generator=gen).to(torch.bfloat16).to(DEVICE)
    return q, (c0, i0, l0), (c1, i1, l1), dict(extra_cache=c1.data, extra_indices=i1, extra_lens=l1,
                                               sink=random_sink(gen, heads))


@needs("gluon")
@pytest.mark.parametrize("fmt,dim", [("fp8_v32", 576), ("bf16", 576), ("fp8_v4", 512)])  # both warpgroup layouts
@pytest.mark.parametrize("num_tokens,tail,ordered", [(7, 3, False), (150, 18, True)])
def test_tail_splits_cut_only_the_last_tokens_lists(fmt, dim, num_tokens, tail, ordered):
    """The Gluon kernel with only the last ``tail`` tokens' lists cut (whole lists first, then those tokens'
    pieces, merged by the combine over those tokens alone, through the order when given) matches the reference;
    the whole tokens' rows are bitwise those of an unsplit launch, and persistent programs give the same bits."""
    from sparse_mla.ops import longest_first, attention_plan
    from sparse_mla.ops.validate import decode_args

    q, (c0, i0, l0), (c1, i1, l1), kw = gluon_decode_case(fmt, dim, num_tokens, 128, num_tokens + tail + dim + len(fmt))
    order = longest_first(l0, l1) if ordered else torch.arange(num_tokens, dtype=torch.int32, device=DEVICE)
    args = decode_args(q, c0.data, i0, l0, **kw, order=order if ordered else None)
    plan = attention_plan.plan_for(args, splits=4, tail=tail, gluon=1, persistent=False)
    assert plan.tail == tail and plan.grid == (2 * (num_tokens + 3 * tail),)  # 2 head blocks, 4 pieces
    out, lse = attention_plan.run(args, splits=4, tail=tail, gluon=1, persistent=False)
    check_close((out, lse), sparse_attention_decode(q, c0.data, i0, l0, backend="reference", **kw))
    lists = ((c0.data, c1.data), (i0, i1), (l0, l1), args.order)
    bound = plan.bind(q, out, lse, args.sink, args.scale, *lists)  # a step plan's launch path: the same bits
    bound_out, bound_lse = torch.empty_like(out), torch.empty_like(lse)
    assert bound(q, bound_out, bound_lse, args.sink, *lists)
    assert torch.equal(bound_out, out) and torch.equal(bound_lse, lse)
    whole_out, whole_lse = attention_plan.run(args, splits=1, gluon=1, persistent=False)
    whole = order[: num_tokens - tail].long()
    assert torch.equal(out[whole], whole_out[whole]) and torch.equal(lse[whole], whole_lse[whole])
    if ordered:
        persistent = attention_plan.run(args, splits=4, tail=tail, gluon=1, persistent=True)
        assert torch.equal(persistent[0], out) and torch.equal(persistent[1], lse)


@needs("gluon")
@pytest.mark.parametrize("fmt,dim", FORMATS)
@pytest.mark.parametrize("num_tokens,splits", [(5, 1), (300, 1), (170, 3)])
def test_persistent_programs_compute_the_same_bits(fmt, dim, num_tokens, splits):
    """The Gluon kernel's persistent programs (one per SM, taking work items in turn, here fewer items than
    programs, several rounds, and split rows) give the bits of a program per item, which match the reference."""
    from sparse_mla.ops import attention_plan, longest_first, targets
    from sparse_mla.ops.validate import decode_args

    q, (c0, i0, l0), _, kw = gluon_decode_case(fmt, dim, num_tokens, 64, num_tokens + splits + dim + len(fmt))
    args = decode_args(q, c0.data, i0, l0, **kw, order=longest_first(l0, kw["extra_lens"]))
    per_item = attention_plan.run(args, splits=splits, gluon=1, persistent=False)
    persistent = attention_plan.run(args, splits=splits, gluon=1, persistent=True)
    assert attention_plan.plan_for(args, splits=splits, gluon=1, persistent=True).grid == (
        targets.num_sms(q.device),)
    assert torch.equal(persistent[0], per_item[0]) and torch.equal(persistent[1], per_item[1])
    check_close(persistent, sparse_attention_decode(q, c0.data, i0, l0, backend="reference", **kw))


@needs("gluon")
@pytest.mark.parametrize("fmt,dim", [("fp8_v32", 576), ("fp8_v4", 512)])
@pytest.mark.parametrize("num_heads,heads_n", [(1, 16), (11, 16), (16, 16), (17, 0)])
def test_narrow_items_match_the_reference(fmt, dim, num_heads, heads_n):
    """fp8 launches of at most 16 heads take narrow items (heads as the wgmmas' N, two copy warpgroups): they match
    the reference and the 64-head items, unsplit, split, tail-split and persistent, through a token order, with
    15, 5 and 0 padding heads (past num_heads, up to the narrow width)."""
    from sparse_mla.ops import longest_first, attention_plan
    from sparse_mla.ops.validate import decode_args

    q, (c0, i0, l0), _, kw = gluon_decode_case(fmt, dim, 150, num_heads, 7 * num_heads + dim)
    args = decode_args(q, c0.data, i0, l0, **kw, order=longest_first(l0, kw["extra_lens"]))
    ref = sparse_attention_decode(q, c0.data, i0, l0, backend="reference", **kw)
    assert dict(attention_plan.plan_for(args, gluon=1)._constants)["HEADS_N"] == heads_n
    wide = attention_plan.run(args, gluon=1, narrow=False, splits=1)
    check_close(wide, ref)
    for launch in (dict(splits=1), dict(splits=3), dict(splits=4, tail=18), dict(splits=3, persistent=True),
                   dict(splits=1, persistent=True)):
        got = attention_plan.run(args, gluon=1, **launch)
        check_close(got, ref)
        assert rel_err(got[0], wide[0]) < 5e-3, launch
