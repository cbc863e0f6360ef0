"""What a layer's kernels read besides q and the caches — its sink, its scale, a cache's kv_scale — is checked
wherever it can change after construction (issue 33 item 1), and the rest of a layer's configuration is fixed.
A bad value is a ValueError (TypeError for a non-tensor) naming it, raised before any kernel runs."""
from __future__ import annotations

import math

import pytest
import torch

from sparse_mla.layer import SparseMLAAttention
from sparse_mla.metadata import build_step_metadata
from sparse_mla.scenario import make_scenario

from helpers import DEVICE

SIZES = {"swa": 4, "c4a": 4, "c128a": 2}
HEADS = 4


@pytest.fixture(scope="module")
def sc():
    return make_scenario([(30, 1), (20, 3)], window=8, topk=4, block_sizes=SIZES, padding=1, device=DEVICE)


def q_of(sc, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(sc.batch.token_capacity, HEADS, 512, generator=gen).to(DEVICE, torch.bfloat16)


def swa_layer(backend="triton", **kw):
    return SparseMLAAttention("swa", HEADS, window=8, sink=torch.zeros(HEADS, device=DEVICE), backend=backend, **kw)


@pytest.mark.parametrize("value,match", [
    (torch.zeros(2), r"sink must have shape \(4,\), got \(2,\)"),  # short: the kernel would read past it
    (torch.zeros(8), r"sink must have shape \(4,\), got \(8,\)"),  # long (a whole model's on a TP shard)
    (torch.zeros(HEADS, dtype=torch.float64), r"sink must have dtype torch.float32"),
    (torch.tensor([0.0, math.nan, 0.0, 0.0]), r"sink must not be NaN"),
    (torch.zeros(2 * HEADS)[::2], r"sink must be contiguous"),
])
@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_a_sink_assigned_after_construction_is_checked_at_once(value, match, backend):
    layer = swa_layer(backend)
    with pytest.raises(ValueError, match=match):
        layer.sink = value
    assert torch.equal(layer.sink.cpu(), torch.zeros(HEADS))  # the bad value was not kept


def test_a_sink_assigned_that_is_not_a_tensor_is_a_type_error():
    with pytest.raises(TypeError, match="sink must be a torch.Tensor, got list"):
        swa_layer().sink = [0.0] * HEADS


def test_a_sink_changed_without_the_setter_is_checked_at_the_next_call(sc):
    q = q_of(sc)
    layer = swa_layer()
    layer.half()  # nn.Module conversions replace the buffer without an assignment
    with pytest.raises(ValueError, match="sink must have dtype torch.float32, got torch.float16"):
        layer(q, sc.meta, sc.caches)
    layer = swa_layer()
    layer.register_buffer("sink", torch.zeros(2, device=DEVICE))
    with pytest.raises(ValueError, match=r"sink must have shape \(4,\)"):
        layer(q, sc.meta, sc.caches)


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_a_valid_sink_or_scale_assigned_later_is_the_one_used(sc, backend):
    q = q_of(sc)
    sink = torch.tensor([0.5, -1.0, 2.0, -math.inf], device=DEVICE)
    layer = SparseMLAAttention("swa", HEADS, window=8, backend=backend)  # no sink yet
    before = layer(q, sc.meta, sc.caches).clone()
    layer.sink = sink
    layer.scale = 0.03
    got = layer(q, sc.meta, sc.caches)
    want = SparseMLAAttention("swa", HEADS, window=8, sink=sink, scale=0.03, backend=backend)(q, sc.meta, sc.caches)
    assert torch.equal(got, want) and not torch.equal(got, before)
    ref = sc.expected(q, "swa", sink=sink, scale=0.03)
    ref = ref.to(got.device)
    assert ((got.double() - ref).norm() / ref.norm()).item() < 1e-2
    layer.sink = None  # no sink again
    assert torch.equal(layer(q, sc.meta, sc.caches), SparseMLAAttention(
        "swa", HEADS, window=8, scale=0.03, backend=backend)(q, sc.meta, sc.caches))
    # an nn.Parameter stays the layer's sink buffer (Module's assignment made it a parameter, and the call a KeyError)
    layer.sink = torch.nn.Parameter(sink.clone(), requires_grad=False)
    assert "sink" in layer._buffers and "sink" not in layer._parameters
    assert torch.equal(layer(q, sc.meta, sc.caches), got)


@pytest.mark.parametrize("value", [math.nan, math.inf, -1.0, 0, True, torch.tensor([0.1]), "0.1"])  # 0-d: a scale
def test_a_bad_scale_assigned_later_is_a_value_error(value):
    layer = swa_layer()
    with pytest.raises(ValueError, match="scale must be a positive finite number"):
        layer.scale = value
    assert layer.scale == 512 ** -0.5


@pytest.mark.parametrize("name,value", [("num_heads", 2), ("window", 4), ("kind", "c128a"), ("backend", "reference"),
                                        ("prefill_mode", "mixed"), ("topk", 8), ("index_form", "ragged")])
def test_the_configuration_is_fixed_at_construction(name, value):
    layer = swa_layer()
    with pytest.raises(ValueError, match=f"{name} is fixed when a SparseMLAAttention is made"):
        setattr(layer, name, value)


def test_a_state_dict_with_a_nan_sink_is_rejected_before_it_is_copied():
    layer = swa_layer()
    state = layer.state_dict()
    state["sink"] = torch.tensor([0.0, math.nan, 0.0, 0.0])
    with pytest.raises(ValueError, match="sink must not be NaN"):
        layer.load_state_dict(state)
    assert torch.equal(layer.sink.cpu(), torch.zeros(HEADS))
    state["sink"] = torch.arange(4.0, dtype=torch.bfloat16)  # another dtype: copied into the float32 buffer
    layer.load_state_dict(state)
    assert torch.equal(layer.sink.cpu(), torch.arange(4.0)) and layer.sink.dtype == torch.float32


@pytest.fixture(scope="module")
def e4m3():
    return make_scenario([(30, 1), (20, 3)], window=8, topk=4, fmt="fp8_e4m3", block_sizes=SIZES, padding=1,
                         device=DEVICE)


@pytest.mark.parametrize("value,error,match", [
    (torch.tensor([math.nan]), ValueError, r"caches\['swa'\]\.kv_scale must be positive and finite, got nan"),
    (torch.tensor([-2.0]), ValueError, r"caches\['swa'\]\.kv_scale must be positive and finite"),
    (torch.tensor([0.006], dtype=torch.float64), ValueError,
     r"caches\['swa'\]\.kv_scale must have dtype torch.float32"),
    (torch.full((2,), 0.006), ValueError, r"caches\['swa'\]\.kv_scale must hold one value"),
    (0.006, TypeError, r"caches\['swa'\]\.kv_scale must be a \(1,\) float32 tensor"),
])
@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_a_cache_kv_scale_replaced_later_is_checked_at_the_next_call(e4m3, value, error, match, backend):
    value = value.to(DEVICE) if isinstance(value, torch.Tensor) else value
    q = q_of(e4m3)
    layer = swa_layer(backend)
    first = layer(q, e4m3.meta, e4m3.caches).clone()
    good = e4m3.caches["swa"].kv_scale
    try:
        e4m3.caches["swa"].kv_scale = value
        with pytest.raises(error, match=match):
            layer(q, e4m3.meta, e4m3.caches)
    finally:
        e4m3.caches["swa"].kv_scale = good
    assert torch.equal(layer(q, e4m3.meta, e4m3.caches), first)


def test_values_written_in_place_are_checked_in_debug_mode(sc, e4m3, monkeypatch):
    """Writes into the sink or a scale tensor cannot be seen without a device sync per call: with SPARSE_MLA_DEBUG=1
    when the step's plans are made, each call checks them."""
    q = q_of(sc)
    layer = swa_layer()
    layer(q, sc.meta, sc.caches)
    with torch.no_grad():
        layer.sink[1] = math.nan
    assert torch.isnan(layer(q, sc.meta, sc.caches)).any()  # not debug: accepted (NaN rows, no read outside)
    monkeypatch.setenv("SPARSE_MLA_DEBUG", "1")
    build_step_metadata(sc.batch, sc.meta.spec, out=sc.meta)  # a new step's plans: made in debug mode
    with pytest.raises(ValueError, match="sink must not be NaN"):
        layer(q, sc.meta, sc.caches)
    layer = swa_layer()
    scale = e4m3.caches["swa"].kv_scale
    build_step_metadata(e4m3.batch, e4m3.meta.spec, out=e4m3.meta)
    layer(q, e4m3.meta, e4m3.caches)
    saved = scale.clone()
    try:
        scale.fill_(math.nan)
        with pytest.raises(ValueError, match="kv_scale must be positive and finite"):
            layer(q, e4m3.meta, e4m3.caches)
    finally:
        scale.copy_(saved)
