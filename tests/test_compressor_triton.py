"""The compressors' Triton kernels (:mod:`sparse_mla.ops.triton.compress`, :mod:`.index_cache`) against the
reference: in Triton's CPU interpreter here (float32 projections, tiny shapes), natively on a GPU (the same file:
bf16 projections too, the V4-Flash shapes). Entries within a bf16 rounding of the reference's, cache bytes
exactly the reference writer's of the kernel's own entries, the same bytes whichever way a sequence is fed, and
the indexer key insert byte-identical to ``IndexerKeyCache.write``."""
from __future__ import annotations

import pytest
import torch

from helpers import needs
from compress_feed import Feeder, make_params, make_sequences, schedule_chunks, schedule_prefill, schedule_tokens
from sparse_mla.cache import PagedCache
from sparse_mla.compressor import KVCompressor
from sparse_mla.index_keys import insert_index_keys
from sparse_mla.indexer_cache import IndexerKeyCache
from sparse_mla.ops import quantize_and_insert
from sparse_mla.rope import V4_COMPRESS_ROPE, rotate_interleaved_tail

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-6


def run(ratio, dim, lengths, schedule, fmt, backend, dtype=torch.float32):
    """Feed ``schedule`` through one compressor: (cache bytes, twin bytes written from its entries by
    ``PagedCache.write`` / ``IndexerKeyCache.write``, entries by slot, state rings)."""
    feeder = Feeder(lengths, ratio, dtype=dtype, device=DEVICE)
    weight, ape = make_params(ratio, dim)
    comp = KVCompressor(feeder.pool, dim, weight, EPS, ape=ape, backend=backend)
    nb, bs = feeder.num_blocks[feeder.kind], feeder.block_size
    if dim == 128:
        cache, twin = (IndexerKeyCache(nb, fmt, DEVICE, bs) for _ in range(2))
    else:
        cache, twin = (PagedCache(nb, bs, fmt, device=DEVICE) for _ in range(2))
    cache.poison()
    twin.poison()
    seqs = [(kv.to(DEVICE), None if s is None else s.to(DEVICE))
            for kv, s in make_sequences(lengths, ratio, dim, dtype=dtype)]
    entries, latents = {}, {}
    for step in schedule:
        order, batch, meta = feeder.step(step)
        chunks = {i: (feeder.done[i] - n, n) for i, n in step}
        latent = comp.forward(Feeder.rows(order, chunks, seqs, 0), Feeder.rows(order, chunks, seqs, 1), meta, cache)
        slots = meta.entry_slots[:latent.shape[0]]
        if isinstance(twin, PagedCache):
            quantize_and_insert(comp.entries, twin.data, slots, twin.fmt, backend="reference", kv_scale=twin.kv_scale)
        else:
            insert_index_keys(comp.entries, twin, slots, backend="reference")
        for row, slot in enumerate(slots.tolist()):
            if slot >= 0:
                entries[slot], latents[slot] = comp.entries[row].float().cpu(), latent[row].float().cpu()
    rings = [t.cpu() for t in feeder.pool.layers[comp.layer]]
    return cache.data.view(torch.uint8).cpu(), twin.data.view(torch.uint8).cpu(), entries, latents, rings


CASES = [(4, 128, [9, 6], "fp8"), (4, 512, [5, 8], "fp8_v4"), (2, 512, [5, 2], "fp4_v41"),
         (1, 512, [3, 2], "fp8_v41_planar"), (128, 512, [130], "bf16")]


@pytest.mark.parametrize("ratio,dim,lengths,fmt", CASES)
def test_kernel_entries_match_the_reference(ratio, dim, lengths, fmt):
    schedule = schedule_chunks(lengths, [3, 1, 2 * ratio + 1])
    ref = run(ratio, dim, lengths, schedule, fmt, "reference")
    tri = run(ratio, dim, lengths, schedule, fmt, "triton")
    assert sorted(tri[2]) == sorted(ref[2]) and ref[2]
    for slot, expect in ref[2].items():  # a bf16 ulp or two where a rounding falls the other way
        got = tri[2][slot]
        assert (got - expect).abs().max() <= 2.0**-7 * expect.abs().max(), slot
        assert (tri[3][slot] - ref[3][slot]).abs().max() <= 2.0**-7 * ref[3][slot].abs().max(), slot
    assert torch.equal(tri[0], tri[1])  # the kernel's cache bytes: the reference writer's of its entries
    for a, b in zip(tri[4], ref[4]):  # the state: the same raw projections
        assert torch.equal(a, b)


@pytest.mark.parametrize("ratio,dim,lengths,fmt", [(4, 128, [9, 6], "fp8"), (2, 512, [5, 3], "fp4_v41")])
def test_kernel_takes_bf16_projections(ratio, dim, lengths, fmt):
    """bf16 projections and state (what engines pass): the same entries and state as the reference's, the cache
    bytes the reference writer's (in the interpreter bit for bit: only loads of bf16 and exact bf16 stores)."""
    schedule = schedule_chunks(lengths, [3, 1, 5])
    ref = run(ratio, dim, lengths, schedule, fmt, "reference", torch.bfloat16)
    tri = run(ratio, dim, lengths, schedule, fmt, "triton", torch.bfloat16)
    for slot, expect in ref[2].items():
        assert (tri[2][slot] - expect).abs().max() <= 2.0**-7 * expect.abs().max(), slot
    assert torch.equal(tri[0], tri[1])
    for a, b in zip(tri[4], ref[4]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("ratio,dim,lengths,fmt", [(4, 128, [9, 6], "fp8"), (2, 512, [5, 3], "fp8_v41")])
def test_kernel_three_ways_of_feeding_write_the_same_bytes(ratio, dim, lengths, fmt):
    whole = run(ratio, dim, lengths, schedule_prefill(lengths), fmt, "triton")[0]
    for schedule in (schedule_tokens(lengths), schedule_chunks(lengths, [2, 3], 1)):
        assert torch.equal(run(ratio, dim, lengths, schedule, fmt, "triton")[0], whole)


@pytest.mark.parametrize("fmt", ["fp8", "bf16"])
@pytest.mark.parametrize("rope", [False, True])
def test_index_key_insert_kernel_writes_the_writers_bytes(fmt, rope):
    gen = torch.Generator().manual_seed(3)
    n, bs = 12, 8
    keys = (torch.randn(n, 128, generator=gen) * torch.logspace(-7, 2, n)[:, None]).to(DEVICE)
    keys[2] = 0.0
    slots = torch.randperm(3 * bs, generator=gen)[:n].int().to(DEVICE)
    slots[5] = -1
    positions = torch.randint(0, 5000, (n,), generator=gen).int().to(DEVICE) if rope else None
    caches = []
    for backend in ("reference", "triton"):
        cache = IndexerKeyCache(3, fmt, DEVICE, bs)
        cache.poison()
        insert_index_keys(keys, cache, slots, positions, backend=backend)
        caches.append(cache.data.view(torch.uint8).cpu())
    assert torch.equal(caches[0], caches[1])
    if rope:  # the reference ropes as the compress rope does
        twin = IndexerKeyCache(3, fmt, DEVICE, bs)
        twin.poison()
        twin.write(rotate_interleaved_tail(keys, positions, V4_COMPRESS_ROPE), slots)
        assert torch.equal(twin.data.view(torch.uint8).cpu(), caches[0])


@pytest.mark.parametrize("fmt", ["fp8", "bf16"])
def test_index_key_insert_takes_strided_slots_and_positions(fmt):
    """slots and positions as strided views (a slice with a step) write what the reference writes: the kernel reads
    element t at offset t, so it wrote slots [0, 1, 7] for the view [0, 1, 2]."""
    keys = torch.randn(3, 128, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    slots = torch.tensor([0, 7, 1, 6, 2, 5], dtype=torch.int32, device=DEVICE)[::2]
    positions = torch.tensor([4, 100, 8, 200, 12, 300], dtype=torch.int32, device=DEVICE)[::2]
    caches = []
    for backend in ("reference", "triton"):
        cache = IndexerKeyCache(2, fmt, DEVICE, 4)
        cache.poison()
        insert_index_keys(keys, cache, slots, positions, backend=backend)
        caches.append(cache.data.view(torch.uint8).cpu())
    assert torch.equal(caches[0], caches[1])


@pytest.mark.parametrize("backend,debug", [("reference", False), ("triton", True)])
def test_index_key_insert_checks_values_where_values_are_checked(backend, debug, monkeypatch):
    """The rows written (slot >= 0) must hold finite keys and positions >= 0: checked on the reference path always
    and under SPARSE_MLA_DEBUG=1 (the two paths stored a NaN key's row differently, and roped a negative position
    differently); a skipped row may hold anything."""
    if debug:
        monkeypatch.setenv("SPARSE_MLA_DEBUG", "1")
    cache = IndexerKeyCache(2, "fp8", DEVICE, 4)
    keys = torch.ones(3, 128, device=DEVICE)
    slots = torch.tensor([0, -1, 2], dtype=torch.int32, device=DEVICE)
    keys[1, 5] = float("nan")  # a skipped row
    insert_index_keys(keys, cache, slots, torch.tensor([0, -5, 3], dtype=torch.int32, device=DEVICE), backend=backend)
    for bad in (float("nan"), float("inf"), 3.4e38):  # 3.4e38: finite in float32, inf in bf16 (the stored precision)
        k = keys.clone()
        k[2, 7] = bad
        with pytest.raises(ValueError, match="keys must be finite"):
            insert_index_keys(k, cache, slots, backend=backend)
        if backend == "reference":  # the reference writer itself, as docs/indexer.md calls it
            with pytest.raises(ValueError, match="keys must be finite"):
                cache.write(k, slots)
    k = torch.zeros(3, 128, device=DEVICE)  # finite keys, one pair that the rope at position 1 turns to inf
    k[2, 128 - V4_COMPRESS_ROPE.dim:128 - V4_COMPRESS_ROPE.dim + 2] = torch.tensor([3.0e38, -3.0e38])
    with pytest.raises(ValueError, match="keys must be finite"):  # checked as stored: after the rope
        insert_index_keys(k, cache, slots, torch.tensor([0, 0, 1], dtype=torch.int32, device=DEVICE), backend=backend)
    twice = torch.tensor([2, -1, 2], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="slots holds slot 2 more than once"):  # two rows would race for slot 2
        insert_index_keys(keys, cache, twice, backend=backend)
    if backend == "reference":
        with pytest.raises(ValueError, match="slots holds slot 2 more than once"):
            cache.write(torch.ones(3, 128, device=DEVICE), twice)
    with pytest.raises(ValueError, match="positions must be >= 0"):
        insert_index_keys(keys, cache, slots, torch.tensor([0, 1, -3], dtype=torch.int32, device=DEVICE),
                          backend=backend)


def test_index_key_insert_bad_input_is_named():
    cache = IndexerKeyCache(2, "fp8", DEVICE, 4)
    keys = torch.zeros(3, 128, device=DEVICE)
    with pytest.raises(ValueError, match="slots must have dtype"):
        insert_index_keys(keys, cache, torch.zeros(3, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError, match="keys must have shape"):
        insert_index_keys(keys[:, :64], cache, torch.zeros(3, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="positions must have shape"):
        insert_index_keys(keys, cache, torch.zeros(3, dtype=torch.int32, device=DEVICE),
                          torch.zeros(2, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="slots holds 8"):
        insert_index_keys(keys, cache, torch.tensor([0, 8, 1], dtype=torch.int32, device=DEVICE),
                          backend="reference")
    with pytest.raises(TypeError, match="IndexerKeyCache"):
        insert_index_keys(keys, object(), torch.zeros(3, dtype=torch.int32, device=DEVICE))


@needs("gpu")
@pytest.mark.parametrize("ratio,dim,fmt", [(4, 512, "fp8_v4"), (4, 128, "fp8"), (128, 512, "fp8_v4"),
                                           (2, 512, "fp8_v41"), (1, 512, "fp4_v41")])
def test_gpu_bf16_projections_v4_flash_shapes(ratio, dim, fmt):
    """Natively on the GPU with bf16 projections: longer sequences, prefill chunks then decode steps."""
    lengths = [3 * ratio + 5, 700, 2 * ratio + 1, 257]
    schedule = schedule_chunks(lengths, [2 * ratio + 3, 1, 1, 64], 2)
    ref = run(ratio, dim, lengths, schedule, fmt, "reference", torch.bfloat16)
    tri = run(ratio, dim, lengths, schedule, fmt, "triton", torch.bfloat16)
    for slot, expect in ref[2].items():
        assert (tri[2][slot] - expect).abs().max() <= 2.0**-7 * expect.abs().max(), slot
    assert torch.equal(tri[0], tri[1])
    whole = run(ratio, dim, lengths, schedule_prefill(lengths), fmt, "triton", torch.bfloat16)[0]
    assert torch.equal(whole, tri[0])


@needs("gpu")
def test_gpu_decode_steps_replay_in_a_cuda_graph():
    """A c4a layer's decode step (its compressor and its indexer's) captured once and replayed for later steps
    writes the bytes eager steps write."""
    eager, replayed = decode_steps_run(False), decode_steps_run(True)
    for a, b in zip(eager, replayed):
        assert torch.equal(a, b)


def test_decode_steps_with_refilled_metadata_write_the_prefill_s_bytes():
    """Prefill then decode steps whose metadata is refilled in place (``out=``): the bytes of one whole prefill."""
    for a, b in zip(decode_steps_run(False), decode_steps_run(False, decode_steps=0)):
        assert torch.equal(a, b)


def decode_steps_run(use_graph, decode_steps=9):
    """Three requests' prefills, then ``decode_steps`` decode steps of the default backend (eager, or from the
    second on captured once and replayed)."""
    lengths = [37, 70, 12]
    feeder = Feeder(lengths, 4, dtype=torch.bfloat16, device=DEVICE)
    nb = feeder.num_blocks["c4a"]
    comps, caches, seqs = [], [], []
    for dim, cache in ((512, PagedCache(nb, 64, "fp8_v4", device=DEVICE)),
                       (128, IndexerKeyCache(nb, "fp8", DEVICE))):
        weight, ape = make_params(4, dim)
        comps.append(KVCompressor(feeder.pool, dim, weight, EPS, ape=ape))
        cache.poison()
        caches.append(cache)
        seqs.append([(kv.to(DEVICE), s.to(DEVICE))
                     for kv, s in make_sequences(lengths, 4, dim, dtype=torch.bfloat16)])
    bufs = [(torch.zeros(3, c.width, dtype=torch.bfloat16, device=DEVICE),
             torch.zeros(3, c.width, dtype=torch.bfloat16, device=DEVICE)) for c in comps]
    prefill = [(i, n - decode_steps) for i, n in enumerate(lengths)]
    order, _, meta = feeder.step(prefill)
    chunks = {i: (0, n) for i, n in prefill}
    for comp, cache, seq in zip(comps, caches, seqs):
        comp.forward(Feeder.rows(order, chunks, seq, 0), Feeder.rows(order, chunks, seq, 1), meta, cache)
    meta, graph = None, None
    for k in range(decode_steps):
        step = [(i, 1) for i in range(len(lengths))]
        order, _, meta = feeder.step(step, out=meta)
        chunks = {i: (feeder.done[i] - 1, 1) for i in order}
        for (kv_buf, s_buf), seq in zip(bufs, seqs):
            kv_buf.copy_(Feeder.rows(order, chunks, seq, 0))
            s_buf.copy_(Feeder.rows(order, chunks, seq, 1))

        def run_step():
            for comp, cache, (kv_buf, s_buf) in zip(comps, caches, bufs):
                comp.forward(kv_buf, s_buf, meta, cache)

        if not use_graph or k == 0:
            run_step()  # eager (the graph run's first decode step compiles what the decode launches)
            continue
        if graph is None:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                run_step()
        graph.replay()
    return [c.data.view(torch.uint8).cpu() for c in caches]


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_kv_and_gate_as_views_of_one_fused_projection(backend):
    """Engines often compute kv and the gate in one GEMM: the two halves of its output (row stride 2·width) are
    taken as they are and give the bytes of contiguous copies."""
    lengths = [9, 6]
    results = []
    for fused in (False, True):
        feeder = Feeder(lengths, 4, device=DEVICE)
        weight, ape = make_params(4, 128)
        comp = KVCompressor(feeder.pool, 128, weight, EPS, ape=ape, backend=backend)
        cache = IndexerKeyCache(feeder.num_blocks["c4a"], "fp8", DEVICE)
        seqs = [(kv.to(DEVICE), s.to(DEVICE)) for kv, s in make_sequences(lengths, 4, 128)]
        for step in schedule_chunks(lengths, [4, 1]):
            order, _, meta = feeder.step(step)
            chunks = {i: (feeder.done[i] - n, n) for i, n in step}
            kv, score = Feeder.rows(order, chunks, seqs, 0), Feeder.rows(order, chunks, seqs, 1)
            if fused:
                both = torch.cat((kv, score), 1)
                kv, score = both[:, :256], both[:, 256:]
            comp.forward(kv, score, meta, cache)
        results.append(cache.data.cpu())
    assert torch.equal(results[0], results[1])
