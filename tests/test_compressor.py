"""The KV compressors' reference (DESIGN §6): against a float64 oracle of the formulas, the same bytes whichever way
a sequence is fed (one prefill, chunks at every boundary, token by token; requests batched in any order), every
cache format written byte for byte as ``PagedCache.write`` writes the same entries, the indexer key cache, the state
pool and compress metadata, and bad input named."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from test_benchmark_smoke import _args, load_script

from compress_feed import (Feeder, coff, feed, make_params, make_sequences, oracle_entries, schedule_chunks,
                           schedule_prefill, schedule_tokens)
from sparse_mla.batch import Request, StepBatchBuilder
from sparse_mla.cache import CacheFullError, PagedCache
from sparse_mla.compress_metadata import allocate_compress_metadata, build_compress_metadata
from sparse_mla.compress_state import CompressorStatePool, state_tokens
from sparse_mla.compressor import KVCompressor
from sparse_mla.index_keys import insert_index_keys
from sparse_mla.indexer_cache import IndexerKeyCache
from sparse_mla.rope import rotate_interleaved_tail

EPS = 1e-6
CASES = [(4, 512), (4, 128), (128, 512), (2, 512), (1, 512)]  # V4 c4a, its indexer, c128a; V4.1 c2a, c1a


def lengths_for(ratio):
    return [3 * ratio + 1, 2 * ratio, ratio - 1 if ratio > 1 else 2, 5 * ratio + 3]


def make(ratio, dim, lengths, fmt="bf16", dtype=torch.float32, backend="reference", max_tokens=None):
    feeder = Feeder(lengths, ratio, dtype=dtype, max_tokens=max_tokens)
    weight, ape = make_params(ratio, dim)
    comp = KVCompressor(feeder.pool, dim, weight, EPS, ape=ape, backend=backend)
    if dim == 128:
        cache = IndexerKeyCache(feeder.num_blocks[feeder.kind], fmt, block_size=feeder.block_size)
    else:
        cache = PagedCache(feeder.num_blocks[feeder.kind], feeder.block_size, fmt)
    cache.poison()
    return feeder, comp, cache, weight, ape


def entry_slots(feeder, i):
    """Slots of request i's entries, in entry order."""
    n = feeder.lengths[i] // feeder.ratio
    table = feeder.tables[i][feeder.kind]
    return torch.tensor([table[w // feeder.block_size] * feeder.block_size + w % feeder.block_size for w in range(n)],
                        dtype=torch.int32)


@pytest.mark.parametrize("ratio,dim", CASES)
def test_reference_entries_match_the_float64_oracle(ratio, dim):
    lengths = lengths_for(ratio)
    feeder, comp, cache, weight, ape = make(ratio, dim, lengths)
    seqs = make_sequences(lengths, ratio, dim)
    feed(feeder, [comp], [cache], [seqs], schedule_chunks(lengths, [ratio + 1, 1, 2 * ratio - 1]))
    for i, (kv, score) in enumerate(seqs):
        _, expect = oracle_entries(kv, score, ape, weight, EPS, ratio)
        got = cache.read(entry_slots(feeder, i)).double()
        assert got.shape == expect.shape
        if expect.numel():  # bf16 rounding of the pooled value, the latent and the entry: a few bf16 ulps
            assert (got - expect).abs().max() <= 3 * 2.0**-8 * expect.abs().max(), (i, (got - expect).abs().max())
    # only the completed entries were written: every other slot still holds the poison
    written = torch.cat([entry_slots(feeder, i) for i in range(len(lengths))])
    others = torch.ones(cache.num_slots, dtype=torch.bool)
    others[written.long()] = False
    rest = cache.read(others.nonzero().squeeze(1).int())
    assert bool(torch.isnan(rest).all())


def test_r4_window_zero_has_an_empty_first_half():
    """Entry 0 at ratio 4 pools only window 0's second halves: the first halves of tokens 0-3 do not matter."""
    feeder, comp, cache, weight, ape = make(4, 512, [8])
    (kv, score), = make_sequences([8], 4, 512)
    feed(feeder, [comp], [cache], [[(kv, score)]], schedule_prefill([8]))
    before = cache.data.clone()
    feeder2, comp2, cache2, _, _ = make(4, 512, [8])
    kv2, score2 = kv.clone(), score.clone()
    kv2[:4, :512] = 100.0
    score2[:4, :512] = 50.0
    feed(feeder2, [comp2], [cache2], [[(kv2, score2)]], schedule_prefill([8]))
    slot0, slot1 = entry_slots(feeder, 0).tolist()
    assert torch.equal(cache2.data[slot0 // 64, slot0 % 64], before[slot0 // 64, slot0 % 64])
    assert not torch.equal(cache2.data[slot1 // 64, slot1 % 64], before[slot1 // 64, slot1 % 64])


def run_schedule(ratio, dim, lengths, schedule, fmt, backend="reference", dtype=torch.float32):
    feeder, comp, cache, _, _ = make(ratio, dim, lengths, fmt, dtype=dtype, backend=backend)
    seqs = make_sequences(lengths, ratio, dim, dtype=dtype)
    feed(feeder, [comp], [cache], [seqs], schedule)
    return cache.data.view(torch.uint8).clone(), feeder.pool.layers[comp.layer]


@pytest.mark.parametrize("ratio,dim,fmt", [(4, 512, "fp8_v4"), (4, 128, "fp8"), (128, 512, "bf16"),
                                           (2, 512, "fp8_v41"), (1, 512, "fp4_v41")])
def test_three_ways_of_feeding_write_the_same_bytes(ratio, dim, fmt):
    lengths = lengths_for(ratio)
    one, state = run_schedule(ratio, dim, lengths, schedule_prefill(lengths), fmt)
    ways = [schedule_tokens(lengths)] if ratio < 128 else []
    ways += [schedule_chunks(lengths, sizes, seed) for seed, sizes in
             enumerate([[1, 2, 3], [ratio - 1 or 1, ratio + 1], [2 * ratio + 1, 1]])]
    for schedule in ways:
        data, other_state = run_schedule(ratio, dim, lengths, schedule, fmt)
        assert torch.equal(data, one)
        for a, b in zip(state, other_state):  # the open windows too
            assert torch.equal(a, b)


def test_chunks_at_every_boundary_write_the_same_bytes():
    """One request at ratio 4 split in two at each position (a chunk may start mid-window, or on one)."""
    n = 13
    whole, _ = run_schedule(4, 128, [n], schedule_prefill([n]), "fp8")
    for cut in range(1, n):
        data, _ = run_schedule(4, 128, [n], [[(0, cut)], [(0, n - cut)]], "fp8")
        assert torch.equal(data, whole), cut


@pytest.mark.parametrize("fmt", ["bf16", "fp8_v4", "fp8_e4m3", "fp8_v41", "fp8_v41_planar", "fp4_v41",
                                 "fp4_v41_planar"])
def test_every_format_is_written_as_paged_cache_write_writes_the_entries(fmt):
    lengths = [9, 17]
    feeder, comp, cache, _, _ = make(4, 512, lengths, fmt)
    twin = PagedCache(cache.num_blocks, cache.block_size, fmt)
    twin.poison()
    seqs = make_sequences(lengths, 4, 512)
    for step in schedule_chunks(lengths, [3, 5]):
        order, batch, meta = feeder.step(step)
        chunks = {i: (feeder.done[i] - n, n) for i, n in step}
        comp.forward(Feeder.rows(order, chunks, seqs, 0), Feeder.rows(order, chunks, seqs, 1), meta, cache)
        twin.write(comp.entries, meta.entry_slots[:comp.entries.shape[0]])
    assert torch.equal(cache.data.view(torch.uint8), twin.data.view(torch.uint8))


@pytest.mark.parametrize("fmt", ["fp8", "bf16"])
def test_indexer_compressor_writes_the_key_caches_writer_bytes(fmt):
    lengths = [11, 6]
    feeder, comp, cache, weight, ape = make(4, 128, lengths, fmt)
    twin = IndexerKeyCache(cache.num_blocks, fmt, block_size=cache.block_size)
    twin.poison()
    seqs = make_sequences(lengths, 4, 128)
    for step in schedule_chunks(lengths, [2, 7]):
        order, batch, meta = feeder.step(step)
        chunks = {i: (feeder.done[i] - n, n) for i, n in step}
        latent = comp.forward(Feeder.rows(order, chunks, seqs, 0), Feeder.rows(order, chunks, seqs, 1), meta, cache)
        twin.write(comp.entries, meta.entry_slots[:comp.entries.shape[0]])
        done = meta.entry_positions[:latent.shape[0]] < 0
        assert bool((latent[done] == 0).all())
    assert torch.equal(cache.data.view(torch.uint8), twin.data.view(torch.uint8))


def test_state_pool_slots_and_positions_are_checked():
    pool = CompressorStatePool(4, 2)
    assert [state_tokens(r) for r in (4, 128, 2, 1)] == [8 + 7, 128 + 7, 2 + 7, 0]  # a window + repeatable steps
    a, b = pool.allocate(), pool.allocate()
    with pytest.raises(CacheFullError):
        pool.allocate()
    pool.advance([a, b], [0, 0], [5, 3])
    with pytest.raises(ValueError, match="go backwards"):
        pool.advance([a], [4], [6])
    with pytest.raises(ValueError, match="skip positions"):
        pool.advance([b], [4], [6])
    with pytest.raises(ValueError, match="twice"):
        pool.advance([a, a], [5, 5], [6, 6])
    pool.free(b)
    with pytest.raises(ValueError, match="not allocated"):
        pool.advance([b], [3], [4])
    with pytest.raises(ValueError, match="not allocated"):
        pool.free(b)
    assert pool.seen(a) == 5 and pool.allocate() == b and pool.seen(b) == 0


def test_metadata_names_the_completing_tokens_and_their_slots():
    feeder = Feeder([9, 4], 4)
    order, batch, meta = feeder.step([(0, 9), (1, 4)])
    pos = batch.positions[:13].tolist()
    completes = [(p + 1) % 4 == 0 for p in pos]
    assert [e >= 0 for e in meta.entry_positions[:13].tolist()] == completes
    assert meta.entry_positions[:13][torch.tensor(completes)].tolist() == [0, 4, 0]
    got = meta.entry_slots[:13][torch.tensor(completes)].tolist()
    assert got == entry_slots(feeder, 0).tolist() + entry_slots(feeder, 1).tolist()
    assert (meta.entry_slots[13:] == -1).all()


def bad_call(case):
    feeder, comp, cache, _, _ = make(4, 512, [6, 6])
    seqs = make_sequences([6, 6], 4, 512)
    kv, score = torch.cat([seqs[0][0], seqs[1][0]]), torch.cat([seqs[0][1], seqs[1][1]])
    order, batch, meta = feeder.step([(0, 6), (1, 6)])
    args = dict(kv=kv, score=score, meta=meta, cache=cache)
    if case == "kv shape":
        args["kv"] = kv[:, :512]
    elif case == "kv dtype":
        args["kv"] = kv.to(torch.bfloat16)
    elif case == "score shape":
        args["score"] = score[:5]
    elif case == "kv rows":
        args["kv"], args["score"] = kv[:5], score[:5]
    elif case == "cache dim":
        args["cache"] = IndexerKeyCache(4, "fp8")
    elif case == "block size":
        args["cache"] = PagedCache(4, 32, "bf16")
    elif case == "few blocks":  # the tables name block 1: a slot outside a one-block cache
        args["cache"] = PagedCache(1, 64, "bf16")
    elif case == "stale":
        feeder.builder.build([Request(1, 1, feeder.tables[0])])
    elif case == "other pool":
        args["meta"] = Feeder([6], 4).step([(0, 6)])[2]
    elif case == "hand-made meta":  # its slots would index the state pool and the cache unchecked
        args["meta"] = dataclasses.replace(meta, state_slots=torch.full_like(meta.state_slots, 7))
    elif case == "unfilled meta":
        args["meta"] = allocate_compress_metadata(batch, comp.pool)
    elif case == "meta assigned to":  # a buffer swapped after the build
        meta.state_slots = torch.full_like(meta.state_slots, 7)
    return comp, args


@pytest.mark.parametrize("case,match", [("kv shape", "kv must have shape"), ("kv dtype", "kv must have dtype"),
                                        ("score shape", "score must have shape"), ("kv rows", "kv must have between"),
                                        ("cache dim", "IndexerKeyCache takes"), ("block size", "block_size"),
                                        ("few blocks", "cache is smaller than the block tables"), ("stale", "stale"),
                                        ("other pool", "another CompressorStatePool"),
                                        ("hand-made meta", "filled by build_compress_metadata"),
                                        ("unfilled meta", "filled by build_compress_metadata"),
                                        ("meta assigned to", "filled by build_compress_metadata")])
def test_bad_forward_input_is_named(case, match):
    comp, args = bad_call(case)
    before = args["cache"].data.clone()
    rings = [t.clone() for t in comp.pool.layers[comp.layer]]
    with pytest.raises(ValueError, match=match):
        comp.forward(**args)
    assert torch.equal(args["cache"].data.view(torch.uint8), before.view(torch.uint8))  # nothing written
    assert all(torch.equal(a, b) for a, b in zip(rings, comp.pool.layers[comp.layer]))


def test_bad_construction_is_named():
    pool = CompressorStatePool(4, 2)
    w, ape = make_params(4, 512)
    with pytest.raises(ValueError, match="ape is required"):
        KVCompressor(pool, 512, w, EPS)
    with pytest.raises(ValueError, match="ape must have shape"):
        KVCompressor(pool, 512, w, EPS, ape=ape[:, :512])
    with pytest.raises(ValueError, match="dim must be"):
        KVCompressor(pool, 256, w, EPS, ape=ape)
    with pytest.raises(ValueError, match="ape must be None"):
        KVCompressor(CompressorStatePool(2, 2), 512, w, EPS, ape=torch.zeros(2, 512))
    with pytest.raises(ValueError, match="ratio must be"):
        CompressorStatePool(3, 2)
    with pytest.raises(ValueError, match="eps"):
        KVCompressor(pool, 512, w, 0.0, ape=ape)
    with pytest.raises(ValueError, match="eps must be a positive finite"):  # every latent would be 0
        KVCompressor(pool, 512, w, float("inf"), ape=ape)
    with pytest.raises(ValueError, match="dim must be the int"):  # a float dim was cast silently
        KVCompressor(pool, 512.0, w, EPS, ape=ape)
    with pytest.raises(ValueError, match="device must be a torch.device"):
        CompressorStatePool(4, 2, device="bogus")
    with pytest.raises(ValueError, match="norm_weight must be below 1.06e\\+37 in magnitude"):  # entries past bf16
        KVCompressor(pool, 512, torch.full_like(w, 3e38), EPS, ape=ape)
    KVCompressor(pool, 512, torch.full_like(w, 1e37), EPS, ape=ape)  # under the bound
    with pytest.raises(ValueError, match="norm_weight is on the meta device"):  # a model built before its weights
        KVCompressor(pool, 512, w.to("meta"), EPS, ape=ape)
    with pytest.raises(ValueError, match="ape is on the meta device"):
        KVCompressor(pool, 512, w, EPS, ape=ape.to("meta"))


def test_a_compressor_that_missed_a_step_of_its_pool_is_refused():
    """Every compressor of a pool runs every step: one that skipped a step would pool from ring slots it never
    wrote (the skipped step's tokens); refused on the host, nothing written."""
    feeder, comp, cache, _, _ = make(4, 512, [6, 6])
    seqs = make_sequences([6, 6], 4, 512)
    feeder.step([(0, 3), (1, 3)])  # the compressor does not run this step
    _, _, meta = feeder.step([(0, 3), (1, 3)])
    kv = torch.cat([seqs[0][0][3:], seqs[1][0][3:]])
    score = torch.cat([seqs[0][1][3:], seqs[1][1][3:]])
    before = cache.data.clone()
    with pytest.raises(ValueError, match="every compressor of a pool runs every step"):
        comp.forward(kv, score, meta, cache)
    assert torch.equal(cache.data.view(torch.uint8), before.view(torch.uint8))


def test_a_step_a_cuda_graph_replayed_counts_as_run():
    """A replay runs no Python: ``replayed(meta)`` records the step as run, so the eager call of the step after it
    is taken (without it: refused as a missed step); another pool's metadata is refused."""
    feeder, comp, cache, _, _ = make(4, 512, [6, 6])
    seqs = make_sequences([6, 6], 4, 512)
    _, _, replayed = feeder.step([(0, 3), (1, 3)])  # as a captured step's replay would run it: no Python
    comp.replayed(replayed)
    _, _, meta = feeder.step([(0, 3), (1, 3)])
    comp.forward(torch.cat([seqs[0][0][3:], seqs[1][0][3:]]), torch.cat([seqs[0][1][3:], seqs[1][1][3:]]), meta, cache)
    other = make(4, 512, [6, 6])[0].step([(0, 3), (1, 3)])[2]
    with pytest.raises(ValueError, match="meta must be CompressMetadata of this compressor's pool"):
        comp.replayed(other)


def test_compress_metadata_names_bad_arguments():
    feeder = Feeder([6], 4)
    order, batch, meta = feeder.step([(0, 3)])
    with pytest.raises(TypeError, match="batch must be a StepBatch"):
        build_compress_metadata(None, feeder.pool, [0])
    with pytest.raises(TypeError, match="state_slots must be a sequence"):
        build_compress_metadata(batch, feeder.pool, 0)


def test_metadata_refuses_a_freed_request_and_positions_going_backwards():
    feeder = Feeder([6, 6], 4)
    feeder.step([(0, 3), (1, 3)])
    feeder.pool.free(feeder.state[1])
    with pytest.raises(ValueError, match="not allocated"):
        feeder.step([(0, 1), (1, 1)])
    feeder.done = [3, 3]
    batch = feeder.builder.build([Request(2, 1, feeder.tables[0])])
    with pytest.raises(ValueError, match="go backwards"):
        build_compress_metadata(batch, feeder.pool, [feeder.state[0]])
    with pytest.raises(ValueError, match="one slot per request"):
        build_compress_metadata(batch, feeder.pool, [])


def test_ratio_one_takes_no_score_and_coff():
    assert coff(4) == 2 and coff(1) == 1
    feeder, comp, cache, _, _ = make(1, 512, [3])
    (kv, _), = make_sequences([3], 1, 512)
    order, batch, meta = feeder.step([(0, 3)])
    with pytest.raises(ValueError, match="score must be None"):
        comp.forward(kv, kv, meta, cache)


def test_v41_engine_keys_go_to_the_index_cache_roped_at_their_entry_positions():
    """V4.1: the c2a compressor returns latents; the engine's ``k_norm(W_k latent)`` keys are roped at ``w · r`` and
    quantised into the indexer key cache at the entries' slots (the c2a block table: 64 entries a page)."""
    lengths = [7, 4]
    feeder, comp, cache, weight, _ = make(2, 512, lengths, "fp8_v41")
    keys_cache = IndexerKeyCache(feeder.num_blocks["c2a"], "fp8")
    keys_cache.poison()
    w_k = torch.randn(512, 128, generator=torch.Generator().manual_seed(5)) / 512**0.5
    seqs = make_sequences(lengths, 2, 512)
    for step in schedule_chunks(lengths, [3, 1]):
        order, batch, meta = feeder.step(step)
        chunks = {i: (feeder.done[i] - n, n) for i, n in step}
        latent = comp.forward(Feeder.rows(order, chunks, seqs, 0), Feeder.rows(order, chunks, seqs, 1), meta, cache)
        k = latent.float() @ w_k
        k = k * torch.rsqrt(k.square().mean(-1, keepdim=True) + 1e-6)  # the engine's k_norm
        insert_index_keys(k, keys_cache, meta.entry_slots[:k.shape[0]], meta.entry_positions[:k.shape[0]])
    for i, (kv, score) in enumerate(seqs):
        latents, _ = oracle_entries(kv, score, None, weight, EPS, 2)
        k = latents @ w_k.double()
        k = k / torch.sqrt(k.square().mean(-1, keepdim=True) + 1e-6)
        positions = torch.arange(k.shape[0]) * 2
        expect = rotate_interleaved_tail(k, positions)
        got = keys_cache.read(entry_slots(feeder, i)).double()
        assert (got - expect).abs().max() <= 2.0**-3 * expect.abs().max()  # e4m3: 3 mantissa bits


def test_v32_raw_token_keys_go_to_the_index_cache_at_the_raw_slots():
    """V3.2: keys per raw token at the dsa slot mapping (pages of 64 raw tokens)."""
    builder = StepBatchBuilder(16, 2, 200, kinds=("dsa",))
    batch = builder.build([Request(70, 10, {"dsa": [3, 0]}), Request(5, 5, {"dsa": [1]})])
    cache = IndexerKeyCache(4, "bf16")
    cache.poison()
    keys = torch.randn(15, 128)
    insert_index_keys(keys, cache, batch.slot_mapping[:15])
    slots = batch.entry_slots("dsa", batch.token_to_req[:15], batch.positions[:15])
    assert torch.equal(cache.read(slots), keys.to(torch.bfloat16).float())
    assert slots[:10].tolist() == [64 * 3 + 60 + j for j in range(4)] + list(range(6)) and slots[10] == 64


def test_benchmark_smoke_writes_its_json(tmp_path, monkeypatch):
    bench = load_script("bench_compressor", monkeypatch)
    assert bench.run(_args(bench, ["--smoke", "--rep", "1", "--out", str(tmp_path)])) == 0
    rows = json.loads((tmp_path / "bench_compressor.json").read_text())["rows"]
    assert {(r["layer"], r["part"]) for r in rows} == {("c4a", "attention"), ("c4a", "indexer"),
                                                         ("c128a", "attention")}
    assert all(r["bytes"] > 0 and r["gpu_us"] > 0 for r in rows)
    assert all(r["attention_us"] > 0 for r in rows if r["case"].startswith("decode"))


@pytest.mark.parametrize("ratio,dim", [(4, 512), (128, 512), (2, 512)])
def test_a_decode_step_run_again_writes_the_same_bytes(ratio, dim):
    """A step of at most REPEATABLE_STEP_TOKENS new tokens a request runs again with the same metadata (a CUDA
    graph's warm-up, capture and replays) and writes the same bytes; a longer step, or an older one, is refused."""
    first = [ratio * -(-14 // ratio) - 5, ratio + 9]  # prefills of more than 8 tokens; 5 short of a window end
    lengths = [n + 9 for n in first]  # then steps of 1 and 8 tokens a request
    feeder, comp, cache, _, _ = make(ratio, dim, lengths, "fp8_v4")
    seqs = make_sequences(lengths, ratio, dim)
    chunks = {0: (0, first[0]), 1: (0, first[1])}
    order, _, prefill_meta = feeder.step([(0, first[0]), (1, first[1])])
    prefill = (Feeder.rows(order, chunks, seqs, 0), Feeder.rows(order, chunks, seqs, 1))
    comp.forward(*prefill, prefill_meta, cache)
    with pytest.raises(ValueError, match="a step runs once"):
        comp.forward(*prefill, prefill_meta, cache)
    completed = 0
    for size in (1, 8):  # decode steps of 1 and 8 tokens a request: a window of request 0 ends in the second
        order, _, meta = feeder.step([(0, size), (1, size)])
        completed += int(meta.entry_positions.ge(0).sum())
        chunks = {i: (feeder.done[i] - size, size) for i in order}
        rows = (Feeder.rows(order, chunks, seqs, 0), Feeder.rows(order, chunks, seqs, 1))
        comp.forward(*rows, meta, cache)
        once = cache.data.view(torch.uint8).clone(), [t.clone() for t in comp.pool.layers[comp.layer]]
        comp.forward(*rows, meta, cache)
        assert torch.equal(cache.data.view(torch.uint8), once[0])
        assert all(torch.equal(a, b) for a, b in zip(comp.pool.layers[comp.layer], once[1]))
    assert completed


@given(ratio=st.sampled_from([4, 2, 128]), lengths=st.lists(st.integers(1, 300), min_size=1, max_size=3),
       sizes=st.lists(st.integers(1, 140), min_size=1, max_size=4), seed=st.integers(0, 99))
def test_any_chunking_in_any_order_writes_the_prefill_s_bytes(ratio, lengths, sizes, seed):
    whole, state = run_schedule(ratio, 128, lengths, schedule_prefill(lengths), "fp8")
    data, other = run_schedule(ratio, 128, lengths, schedule_chunks(lengths, sizes, seed), "fp8")
    assert torch.equal(data, whole)
    assert all(torch.equal(a, b) for a, b in zip(state, other))


@pytest.mark.needs("gpu")
def test_a_step_s_host_build_does_not_sync_with_the_gpu():
    """``StepBatchBuilder.build``, ``build_compress_metadata`` and ``build_step_metadata`` on a GPU queue their
    uploads (pinned memory, non-blocking copies) instead of synchronising the stream (a blocking copy from pageable
    memory is one): under ``torch.cuda.set_sync_debug_mode("error")`` a decode step and a prefill chunk build; the
    values are the blocking copies' (the same step built with the debug mode off, compared)."""
    from sparse_mla.metadata import MetadataSpec, build_step_metadata

    def build(feeder: Feeder):
        order, batch, meta = feeder.step([(0, 5), (1, 1), (2, 1)])
        return batch, meta, build_step_metadata(batch, MetadataSpec(window=4, topk=8))

    lengths = [40, 33, 70]
    plain = build(Feeder(lengths, 4, device="cuda"))
    torch.cuda.synchronize()
    torch.cuda._sleep(50_000_000)  # the GPU busy: a synchronising call would wait for it
    torch.cuda.set_sync_debug_mode("error")
    try:
        queued = build(Feeder(lengths, 4, device="cuda"))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for name in ("seq_lens", "query_lens", "query_start_loc", "positions", "token_to_req"):
        assert torch.equal(getattr(queued[0], name), getattr(plain[0], name)), name
    assert all(torch.equal(queued[0].block_tables[k], plain[0].block_tables[k]) for k in plain[0].block_tables)
    assert torch.equal(queued[1].state_slots, plain[1].state_slots)
    assert torch.equal(queued[1].entry_slots, plain[1].entry_slots)
