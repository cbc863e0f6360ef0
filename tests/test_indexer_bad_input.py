"""Bad input to the lightning indexer's reference, its kernels' host wrappers and its layer's plan: a ValueError /
TypeError naming the argument, never a wrong answer, a torch error from deep inside, a read past a tensor or a call
that does not end. CPU: the kernels run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 without a
GPU)."""
from __future__ import annotations

import dataclasses
import signal

import pytest
import torch

from helpers import DEVICE, KERNEL_RUNS
from indexer_cases import make_case
from sparse_mla.indexer import IndexerSpec, index_topk_reference, prepare_queries
from sparse_mla.indexer_layer import SparseMLAIndexer


def small_case(kind: str = "c4a", requests=((300, 1), (200, 3))):
    spec = IndexerSpec(num_heads=8, topk=16, kind=kind)
    return make_case(torch.Generator().manual_seed(1), list(requests), spec, "fp8", device=DEVICE)


@pytest.mark.parametrize("which", ["block_table", "positions"])
def test_index_scores_rejects_column_strided_step_tensors(which):
    """A column-strided view (``wide[:, ::2]``, ``buf[::2]``) of the right dtype, rank, shape and device: the score
    kernel reads the step's tensors at unit stride, so it is refused (else it would read the neighbours' values: other
    blocks, other positions)."""
    from sparse_mla.ops.triton import indexer as kernels

    case = small_case()
    s = case.step
    if which == "block_table":
        wide = torch.zeros(s.block_table.shape[0], 2 * s.block_table.shape[1], dtype=torch.int32, device=DEVICE)
        wide[:, ::2] = s.block_table
        strided = dataclasses.replace(s, block_table=wide[:, ::2])
    else:
        wide = torch.full((2 * s.positions.shape[0],), 5, dtype=torch.int32, device=DEVICE)
        wide[::2] = s.positions
        strided = dataclasses.replace(s, positions=wide[::2])
    assert torch.equal(getattr(strided, which), getattr(s, which))  # the same values, another layout
    out = torch.empty(4, 128, dtype=torch.int64, device=DEVICE)
    kernels.index_scores(case.q, case.w, case.cache, s, out, 0, 4, 3, torch.float32, False)  # the same, unit-strided
    with pytest.raises(ValueError, match=which):
        kernels.index_scores(case.q, case.w, case.cache, strided, out, 0, 4, 3, torch.float32, False)


@pytest.mark.parametrize("max_query_len", [0, -1])
def test_index_scores_rejects_a_non_positive_max_query_len(max_query_len):
    """max_query_len sizes the grid on the host: 0 or less would launch no tile and leave ``out`` as it was (the
    select would then pick from whatever it held)."""
    from sparse_mla.ops.triton import indexer as kernels

    case = small_case()
    out = torch.full((4, 128), 12345, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="max_query_len"):
        kernels.index_scores(case.q, case.w, case.cache, case.step, out, 0, 4, max_query_len, torch.float32, False)


def test_reference_rejects_a_non_monotone_query_start_loc():
    """query_start_loc [0, 3, 1] would give request 0 request 1's tokens, scored through request 0's block table:
    the reference reads it on the host anyway, and refuses it."""
    case = small_case()
    bad = dataclasses.replace(case.step, query_start_loc=torch.tensor([0, 3, 1], dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="query_start_loc"):
        index_topk_reference(case.q, case.w, case.cache, bad, 16)


def test_reference_rejects_a_query_start_loc_past_the_token_capacity():
    """query_start_loc ending past T_cap (6 here) is named, not a torch error from inside the merge."""
    case = small_case()
    bad = dataclasses.replace(case.step, query_start_loc=torch.tensor([0, 1, 40], dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="query_start_loc"):
        index_topk_reference(case.q, case.w, case.cache, bad, 16)


def test_reference_does_not_hang_on_a_position_far_past_the_block_table():
    """A token at position 2^31 - 2 (dsa, ratio 1) whose request's table covers 128 entries: entries past the table
    are never candidates, so the reference stops at the table's end (it scanned all 2^31 'visible' entries in chunks
    of 4,096: hours) and gives the picks of a token at the table's last entry."""
    case = small_case("dsa", [(100, 1)])
    pos = case.step.positions.clone()
    pos[0] = 2 ** 31 - 2
    far = dataclasses.replace(case.step, positions=pos)

    def timeout(*_):
        raise TimeoutError("index_topk_reference still running after 8 s")

    old = signal.signal(signal.SIGALRM, timeout)
    signal.alarm(8)
    try:
        got = index_topk_reference(case.q, case.w, case.cache, far, 16)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    end = dataclasses.replace(case.step, positions=torch.where(pos == 2 ** 31 - 2, 64 * case.step.block_table.shape[1]
                                                                - 1, pos))
    assert torch.equal(got, index_topk_reference(case.q, case.w, case.cache, end, 16))


@pytest.mark.parametrize("token_chunk", [0, -1])
def test_reference_rejects_a_non_positive_token_chunk(token_chunk):
    """token_chunk -1 would score nothing (every row all -1), 0 fail inside range(): both named."""
    case = small_case()
    with pytest.raises(ValueError, match="token_chunk"):
        index_topk_reference(case.q, case.w, case.cache, case.step, 16, token_chunk=token_chunk)


@pytest.mark.parametrize("ratio,num_kept,name", [(0, 4, "ratio"), (-4, 4, "ratio"), (4, -1, "num_kept"),
                                                 (4, 0, "num_kept")])
def test_top_blocks_from_packed_rejects_bad_ratio_and_num_kept(ratio, num_kept, name):
    """ratio 0 (a division by zero), -4 (a wrong pinned block), num_kept -1 (a torch error) and 0 (an empty result)
    are named."""
    from sparse_mla.ops.triton import indexer as kernels

    packed = torch.randint(0, 1 << 40, (4, 128), generator=torch.Generator().manual_seed(0))
    positions = torch.tensor([10, 100, 200, 300], dtype=torch.int32)
    with pytest.raises(ValueError, match=name):
        kernels.top_blocks_from_packed(packed, positions, ratio, num_kept)


def _prep_inputs(T: int = 4, H: int = 8):
    """The query prep's inputs on the test device: spec, q, w, positions, cos, sin (as the layer's plan makes them)."""
    g = torch.Generator().manual_seed(0)
    spec = IndexerSpec(num_heads=H, topk=16, kind="c4a")
    q = torch.randn(T, H, 128, generator=g).to(DEVICE)
    w = torch.randn(T, H, generator=g).to(DEVICE)
    positions = torch.arange(T, dtype=torch.int32, device=DEVICE) + 10
    ang = positions.float()[:, None] * spec.rope_spec.inv_freq(DEVICE)
    return spec, q, w, positions, ang.cos(), ang.sin()


def test_kernel_prepare_queries_rejects_a_non_contiguous_q():
    """q = a (T, H, 256) buffer's first 128 dims: the kernel reads rows of H · 128 at unit stride, so a
    non-contiguous q is refused (it would give other values than the reference's)."""
    from sparse_mla.ops.triton import indexer as kernels

    spec, q, w, positions, cos, sin = _prep_inputs()
    strided = torch.cat((q, torch.randn_like(q)), dim=2)[..., :128]
    q_out, w_out = torch.empty(4, 8, 128, device=DEVICE), torch.empty(4, 8, device=DEVICE)
    kernels.prepare_queries(q, w, cos, sin, False, True, spec.weight_scale, q_out, w_out)  # contiguous: the reference's
    q_ready, w_ready = prepare_queries(q, w, positions, spec)
    assert torch.equal(q_out, q_ready) and torch.equal(w_out, w_ready)
    with pytest.raises(ValueError, match="q must be contiguous"):
        kernels.prepare_queries(strided, w, cos, sin, False, True, spec.weight_scale, q_out, w_out)


@pytest.mark.parametrize("bad", ["q_int32", "q_out_fp64", "cos_short"])
def test_kernel_prepare_queries_rejects_bad_dtypes_and_shapes(bad):
    """An int32 q, a float64 q_out (float32, bf16, float16 or e4m3 only: the dots' operands) or cos / sin of (T, 16)
    (the kernel reads 32 a token: past the tensor) are named before any launch."""
    from sparse_mla.ops.triton import indexer as kernels

    spec, q, w, positions, cos, sin = _prep_inputs()
    q_out, w_out = torch.empty(4, 8, 128, device=DEVICE), torch.empty(4, 8, device=DEVICE)
    if bad == "q_int32":
        q, name = torch.zeros(4, 8, 128, dtype=torch.int32, device=DEVICE), "q"
    elif bad == "q_out_fp64":
        q_out, name = torch.empty(4, 8, 128, dtype=torch.float64, device=DEVICE), "q_out"
    else:
        cos, sin, name = cos[:, :16].contiguous(), sin[:, :16].contiguous(), "cos"
    with pytest.raises(ValueError, match=name):
        kernels.prepare_queries(q, w, cos, sin, False, True, spec.weight_scale, q_out, w_out)


@pytest.mark.parametrize("args,error,name", [(("bogus",), ValueError, "backend"),
                                             (("reference", "fp4"), ValueError, "key_format"),
                                             (None, TypeError, "meta")])
def test_step_plan_rejects_an_unknown_backend_key_format_or_meta(args, error, name):
    """An unknown backend (it would be planned as Triton's), a key format the caches do not have, and a meta that is
    not the step's metadata are named."""
    from sparse_mla.scenario import make_scenario

    sc = make_scenario([(300, 2), (200, 1)], window=4, topk=64, fmt="bf16", decode_threshold=2, padding=2,
                       block_sizes={"swa": 64, "c4a": 64, "c128a": 2}, device=DEVICE)
    layer = SparseMLAIndexer("c4a", 8, 32, backend="reference")
    with pytest.raises(error, match=name):
        if args is None:
            layer.step_plan(None, "reference")
        else:
            layer.step_plan(sc.meta, *args)


def test_kernel_prepare_queries_rejects_a_q_without_heads():
    """q ``(T, 0, 128)`` (and weights ``(T, 0)``): the launch's grid divided the heads by zero heads a program (a
    ZeroDivisionError); an indexer has 1-128 heads, named as the score kernel names them."""
    from sparse_mla.ops.triton import indexer as kernels

    spec, _, _, _, cos, sin = _prep_inputs()
    q, w = torch.zeros(4, 0, 128, device=DEVICE), torch.zeros(4, 0, device=DEVICE)
    with pytest.raises(ValueError, match=r"q must have shape \(T, H, 128\) with H in \[1, 128\]"):
        kernels.prepare_queries(q, w, cos, sin, False, True, spec.weight_scale, torch.empty_like(q),
                                torch.empty_like(w))


def test_index_scores_rejects_an_out_on_another_device():
    """The kernel writes ``out`` through its pointer: an ``out`` off the cache's device (another GPU, the host, a
    meta tensor) is named, not handed to the launch (a meta tensor failed inside the interpreter's copy)."""
    from sparse_mla.ops.triton import indexer as kernels

    case = small_case()
    out = torch.empty(4, 128, dtype=torch.int64, device="meta")
    with pytest.raises(ValueError, match="out must be on"):
        kernels.index_scores(case.q, case.w, case.cache, case.step, out, 0, 4, 3, torch.float32, False)


@pytest.mark.parametrize("t0,t1", [(0.5, 4), (0, 3.5)])
def test_index_scores_rejects_a_token_range_of_floats(t0, t1):
    """t0 and t1 are kernel arguments: a float t0 failed inside the kernel's pointer arithmetic (an interpreter /
    compile error), a float t1 was compiled into the token bound (token 3 scored for t1 = 3.5)."""
    from sparse_mla.ops.triton import indexer as kernels

    case = small_case()
    out = torch.empty(4, 128, dtype=torch.int64, device=DEVICE)
    with pytest.raises(TypeError, match="t0 and t1 must be ints"):
        kernels.index_scores(case.q, case.w, case.cache, case.step, out, t0, t1, 3, torch.float32, False)


@pytest.mark.parametrize("where", ["q", "cache.data", "expanded"])
def test_index_scores_rejects_an_out_that_shares_memory(where):
    """``out`` inside q's storage over token 1's queries (request 0's program overwrote them before request 1's read
    them: other scores than an unaliased out's), inside the key cache (the scores written over the keys), or an
    expanded ``(4, 128)`` view of one row (every token's scores into the same row: the last one's survived)."""
    from sparse_mla.ops.triton import indexer as kernels

    case = small_case()
    q = case.q.clone()
    if where == "q":
        out, match = q.view(torch.int64).reshape(-1)[512:1024].view(4, 128), "out overlaps q"
    elif where == "cache.data":
        out, match = case.cache.data.view(-1)[:4 * 128 * 8].view(torch.int64).view(4, 128), "out overlaps cache.data"
    else:
        out, match = torch.empty(1, 128, dtype=torch.int64, device=DEVICE).expand(4, 128), "rows apart"
    with pytest.raises(ValueError, match=match):
        kernels.index_scores(q, case.w, case.cache, case.step, out, 0, 4, 3, torch.float32, False)


def _packed_rows(rows: int, cols: int = 64) -> torch.Tensor:
    """Packed keys as the score kernel lays them out: column c holds entry c's key, random scores."""
    hi = torch.randint(-(1 << 30), 1 << 30, (rows, cols), generator=torch.Generator().manual_seed(0))
    return ((hi << 32) | (0xFFFFFFFF - torch.arange(cols))).to(DEVICE)


@pytest.mark.parametrize("where", ["packed", "expanded", "into", "into table", "into kept", "into out",
                                   "into expanded"])
def test_topk_rows_rejects_outputs_that_share_memory(where):
    """``out`` inside ``packed``'s storage one row on (row 0's picks overwrote row 1's keys before its program read
    them: other picks than an unaliased out's), an expanded ``(4, 16)`` view of one row (each row's picks over the
    one before), or the conversion's outputs inside ``packed``, over its block table (read by the other rows'
    programs), over one another (the slots and the picks), over ``out`` (whose rows the programs read back) or an
    expanded view of one row."""
    from sparse_mla.ops.triton import indexer as kernels

    buf = _packed_rows(5)
    packed, k = buf[:4], 16
    out = torch.empty(4, k, dtype=torch.int32, device=DEVICE)
    into = None
    if where == "packed":
        out, match = buf.view(torch.int32)[1:5, :k], "out overlaps packed"
    elif where == "expanded":
        out, match = torch.empty(1, k, dtype=torch.int32, device=DEVICE).expand(4, k), "rows must not overlap"
    else:
        ints = lambda *shape: torch.zeros(shape, dtype=torch.int32, device=DEVICE)  # noqa: E731
        slots, kept, table = ints(4, k), ints(4, k), ints(1, 2)
        if where == "into":
            slots, match = buf.view(torch.int32)[1:5, :k], "into.indices overlaps packed"
        elif where == "into table":
            table, match = slots[:1, :2], "into.indices overlaps into.table"
        elif where == "into kept":
            kept, match = slots, "into.indices overlaps into.kept"
        elif where == "into out":
            kept, match = out, "out overlaps into.kept"
        else:
            kept, match = ints(1, k).expand(4, k), "into.kept's rows must not overlap"
        into = kernels.PicksInto(ints(4), ints(4), table, 64, slots, ints(4), kept, 4)
    with pytest.raises(ValueError, match=match):
        kernels.topk_rows(packed, k, out, into)


@pytest.mark.parametrize("bad", ["float", "bool", "meta"])
def test_top_blocks_from_packed_rejects_positions_of_another_dtype_or_device(bad):
    """Positions 10.7 were truncated to 10 and bool ones read as 0 / 1 (the pinned block silently another); a meta
    (another device's) tensor failed inside torch's comparison: named."""
    from sparse_mla.ops.triton import indexer as kernels

    packed = _packed_rows(4, 128)
    positions = {"float": torch.tensor([10.7, 100.0, 200.0, 300.0], device=DEVICE),
                 "bool": torch.ones(4, dtype=torch.bool, device=DEVICE),
                 "meta": torch.zeros(4, dtype=torch.int32, device="meta")}[bad]
    with pytest.raises(ValueError, match="positions must"):
        kernels.top_blocks_from_packed(packed, positions, 4, 8)


def test_restrict_to_blocks_rejects_kept_blocks_on_another_device():
    """kept_blocks off packed's device (meta here) was taken without a word; named."""
    from sparse_mla.ops.triton import indexer as kernels

    with pytest.raises(ValueError, match="kept_blocks must be on"):
        kernels.restrict_to_blocks(_packed_rows(4, 128), torch.zeros(4, 8, dtype=torch.int32, device="meta"))


@pytest.mark.skipif(not KERNEL_RUNS, reason="the Triton indexer needs a GPU or Triton's CPU interpreter")
def test_the_triton_layer_refuses_a_key_cache_of_other_blocks_before_it_launches():
    """The score kernel reads pages of 64 entries: the layer's Triton call over a step and key cache of 32-entry blocks
    is refused by name (the score launch's own check, ``check_kernel_cache``), before the query prep writes its
    plan's buffers."""
    from sparse_mla.indexer_cache import IndexerKeyCache
    from sparse_mla.scenario import make_scenario

    sc = make_scenario([(300, 2), (200, 1)], window=4, topk=64, fmt="bf16", decode_threshold=2, padding=2,
                       block_sizes={"swa": 64, "c4a": 32, "c128a": 2}, device=DEVICE)
    layer = SparseMLAIndexer("c4a", 8, 32, backend="triton")
    cap = sc.meta.batch.token_capacity
    q, w = torch.randn(cap, 8, 128, device=DEVICE), torch.randn(cap, 8, device=DEVICE)
    plan = layer.step_plan(sc.meta, "triton")
    plan.q.fill_(7)
    with pytest.raises(ValueError, match="cache.block_size must be 64"):
        layer(sc.meta, q, w, IndexerKeyCache(64, "fp8", device=DEVICE, block_size=32))
    assert bool((plan.q == 7).all()), "no launch before the refusal"


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_the_layer_refuses_a_key_cache_smaller_than_the_block_tables(backend):
    """A key cache of fewer blocks than the step's c4a tables name: the kernels would read pages past its end and the
    reference drop their entries (every pick of a request with a missing block silently -1)."""
    if backend == "triton" and not KERNEL_RUNS:
        pytest.skip("the Triton indexer needs a GPU or Triton's CPU interpreter")
    from sparse_mla.indexer_cache import IndexerKeyCache
    from sparse_mla.scenario import make_scenario

    sc = make_scenario([(300, 2), (200, 1)], window=4, topk=64, fmt="bf16", decode_threshold=2, padding=2,
                       block_sizes={"swa": 64, "c4a": 64, "c128a": 2}, device=DEVICE)
    largest = sc.meta.batch.max_block["c4a"]
    layer = SparseMLAIndexer("c4a", 8, 32, backend=backend)
    cap = sc.meta.batch.token_capacity
    q, w = torch.randn(cap, 8, 128, device=DEVICE), torch.randn(cap, 8, device=DEVICE)
    with pytest.raises(ValueError, match=rf"cache has {largest} blocks, but the step's 'c4a' block tables name "
                                         rf"block {largest}"):
        layer(sc.meta, q, w, IndexerKeyCache(largest, "fp8", device=DEVICE))
