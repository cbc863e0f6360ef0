"""Production-safety rules of the public attention ops, on the checked path and the remembered one (:mod:`.memo`):

* ``out`` shares no memory with any tensor the kernels read, ``order`` and the fp8 scale tensors included;
* the default full-width lens are never first made inside a CUDA-graph capture (the capture check is faked here);
* a plan, cached or remembered, follows what decides its kernel besides the call's geometry: ``SPARSE_MLA_GLUON``
  and the architecture Triton lowers for (the Hopper GPU is faked here, as in ``tests/test_targets.py``).
"""
from __future__ import annotations

import types
from collections import OrderedDict

import pytest
import torch

from helpers import DEVICE, KERNEL_RUNS, ON_GPU, check_close
from sparse_mla import ops
from sparse_mla.cache import PagedCache
from sparse_mla.formats import get_format
from sparse_mla.ops import attention_plan, memo, sparse_attention_decode, targets, validate
from sparse_mla.ops.gluon import host as gluon_host
from sparse_mla.ops.validate import AttentionArgs, Scope

GPU = torch.device("cuda", 0)
TRITON = "auto" if ON_GPU else "triton"
needs_kernels = pytest.mark.skipif(not KERNEL_RUNS, reason="the Triton kernels need a GPU or TRITON_INTERPRET=1")


@pytest.fixture
def checked(monkeypatch):
    """An empty memo and plan cache, no debug mode; counts the decode calls that went the checked path."""
    monkeypatch.setattr(memo, "CALLS", OrderedDict())
    monkeypatch.setattr(attention_plan, "_PLANS", OrderedDict())
    monkeypatch.delenv("SPARSE_MLA_DEBUG", raising=False)
    calls = []
    real = ops.checked_decode
    monkeypatch.setattr(ops, "checked_decode", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def fp8_case(gen: torch.Generator, tokens: int = 3, heads: int = 2) -> dict:
    """A decode call of an fp8 q over an fp8_e4m3 cache, with an order and both scales as (1,) float32 tensors."""
    cache = PagedCache(4, 16, "fp8_e4m3", kv_scale=0.02, device=DEVICE)
    cache.write((torch.randn(cache.num_slots, 512, generator=gen) * 2).to(torch.bfloat16).to(DEVICE),
                torch.arange(cache.num_slots, dtype=torch.int32, device=DEVICE))
    q = (torch.randn(tokens, heads, 512, generator=gen) * 4).to(torch.float8_e4m3fn).to(DEVICE)
    return dict(q=q, cache=cache.data, scale=0.05,
                indices=torch.randint(-1, cache.num_slots, (tokens, 16), generator=gen, dtype=torch.int32).to(DEVICE),
                order=torch.arange(tokens, dtype=torch.int32, device=DEVICE).flip(0),
                q_scale=torch.tensor([0.25], device=DEVICE), kv_scale=torch.tensor([0.02], device=DEVICE))


def inside(out: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A tensor of ``like``'s dtype and shape over ``out``'s first bytes, holding ``like``'s values."""
    return out.view(-1).view(like.dtype)[:like.numel()].view(like.shape).copy_(like)


@pytest.mark.parametrize("name", ["order", "q_scale", "kv_scale"])
def test_out_overlapping_order_or_a_scale_tensor_is_refused_on_the_checked_path(name):
    case = fp8_case(torch.Generator().manual_seed(1))
    backends = ["reference"] + ([TRITON] if KERNEL_RUNS else [])
    for backend in backends:
        out = torch.empty(*case["q"].shape[:2], 512, dtype=torch.bfloat16, device=DEVICE)
        with pytest.raises(ValueError, match=f"^out overlaps {name} in memory"):
            sparse_attention_decode(**dict(case, **{name: inside(out, case[name])}), out=out, backend=backend)
    out = torch.empty(*case["q"].shape[:2], 512, dtype=torch.bfloat16, device=DEVICE)
    sparse_attention_decode(**case, out=out, backend="reference")  # apart: accepted


@needs_kernels
@pytest.mark.parametrize("name", ["order", "q_scale", "kv_scale"])
def test_out_overlapping_order_or_a_scale_tensor_is_refused_on_the_remembered_path(checked, name):
    """The second call has the first's signature (only pointers differ), so it skips the checks: the overlap of
    ``out`` with the named tensor is still refused, before any kernel writes ``out``."""
    case = fp8_case(torch.Generator().manual_seed(2))
    out = torch.empty(*case["q"].shape[:2], 512, dtype=torch.bfloat16, device=DEVICE)
    first = sparse_attention_decode(**case, out=out, backend=TRITON)
    assert len(checked) == 1 and len(memo.CALLS) == 1
    check_close(first, sparse_attention_decode(**case, backend="reference"))
    aliased = dict(case, **{name: inside(out, case[name])})
    with pytest.raises(ValueError, match=f"^out overlaps {name} in memory"):
        sparse_attention_decode(**aliased, out=out, backend=TRITON)
    assert len(checked) == 2  # the reference call: the refused one went the remembered path


def decode_full_rows(q, cache, width, **kw):
    """A one-scope bf16 decode of every token over ``width`` slots, ``lens`` left out (the full rows)."""
    indices = torch.arange(width, dtype=torch.int32, device=DEVICE).repeat(q.shape[0], 1)
    return sparse_attention_decode(q, cache, indices, scale=0.05, **kw)


def test_default_lens_are_not_first_made_inside_a_cuda_graph_capture(monkeypatch):
    gen = torch.Generator().manual_seed(3)
    cache = PagedCache(4, 16, "bf16", dim=512, device=DEVICE)
    cache.write(torch.randn(cache.num_slots, 512, generator=gen).to(torch.bfloat16).to(DEVICE),
                torch.arange(cache.num_slots, dtype=torch.int32, device=DEVICE))
    tokens, width = 5, 24
    q = torch.randn(tokens, 2, 512, generator=gen).to(torch.bfloat16).to(DEVICE)
    validate._full_lens.cache_clear()  # none made before this test
    monkeypatch.setattr(validate, "graph_capturing", lambda device: True)
    with pytest.raises(ValueError, match="lens is None .* CUDA graph is being captured.*pass lens"):
        decode_full_rows(q, cache.data, width, backend="reference")
    monkeypatch.setattr(validate, "graph_capturing", lambda device: False)
    warm = decode_full_rows(q, cache.data, width, backend="reference")  # a warm-up call before the capture
    lens = torch.full((tokens,), width, dtype=torch.int32, device=DEVICE)
    check_close(warm, decode_full_rows(q, cache.data, width, lens=lens, backend="reference"))
    monkeypatch.setattr(validate, "graph_capturing", lambda device: True)
    # made before the capture: read, not made, inside it
    assert all(torch.equal(a, b) for a, b in zip(decode_full_rows(q, cache.data, width, backend="reference"), warm))
    with pytest.raises(ValueError, match="extra_lens is None"):
        decode_full_rows(q, cache.data, width, lens=lens, extra_cache=cache.data,
                         extra_indices=torch.zeros(tokens, 8, dtype=torch.int32, device=DEVICE), backend="reference")


@pytest.fixture
def hopper(monkeypatch):
    """Device 0 is an NVIDIA Hopper GPU (capability 9.0, 132 SMs); the plan cache starts empty."""
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    props = types.SimpleNamespace(gcnArchName="", multi_processor_count=132, major=9, minor=0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(attention_plan, "_PLANS", OrderedDict())
    targets._device_target.cache_clear()
    yield
    targets._device_target.cache_clear()


def hopper_args() -> AttentionArgs:
    """Checked arguments of a 4-token, 64-head fp8_v4 decode on the (faked) GPU: the geometry alone (q stands in
    as its shape and device; the plan reads nothing else of it)."""
    fmt = get_format("fp8_v4")
    q = types.SimpleNamespace(shape=torch.Size((4, 64, 512)), device=GPU)
    cache = torch.zeros(4, 64, fmt.token_bytes, dtype=torch.uint8)
    return AttentionArgs(q, (Scope(cache, fmt, torch.zeros(4, 128, dtype=torch.int32), None),), None, 0.05)


@pytest.mark.skipif(ON_GPU, reason="fakes the GPU")
@pytest.mark.skipif(gluon_host.gluon is None, reason="the Gluon kernel needs a Triton with Gluon")
def test_the_plan_cache_follows_sparse_mla_gluon_and_the_lowering(hopper, monkeypatch):
    args = hopper_args()
    monkeypatch.setattr(gluon_host, "VALIDATED_TRITON", (gluon_host.triton.__version__,))
    monkeypatch.delenv("SPARSE_MLA_GLUON", raising=False)
    default = attention_plan.plan_for(args)
    assert default.kernel == "gluon" and attention_plan.plan_for(args) is default
    monkeypatch.setenv("SPARSE_MLA_GLUON", "0")
    off = attention_plan.plan_for(args)
    assert off is not default and off.kernel == "triton"
    monkeypatch.setenv("SPARSE_MLA_GLUON", "1")
    assert attention_plan.plan_for(args).kernel == "gluon"
    with targets.lower_as("sm80"):  # the library plans for the emulated target: no Gluon kernel on sm_80
        lowered = attention_plan.plan_for(args)
        assert lowered.kernel == "triton" and lowered.target.name == "sm_80"
    assert attention_plan.plan_for(args).kernel == "gluon"


@needs_kernels
def test_a_remembered_call_is_planned_again_when_sparse_mla_gluon_or_the_lowering_changes(checked, monkeypatch):
    gen = torch.Generator().manual_seed(4)
    cache = PagedCache(4, 16, "bf16", dim=512, device=DEVICE)
    cache.write(torch.randn(cache.num_slots, 512, generator=gen).to(torch.bfloat16).to(DEVICE),
                torch.arange(cache.num_slots, dtype=torch.int32, device=DEVICE))
    q = torch.randn(3, 2, 512, generator=gen).to(torch.bfloat16).to(DEVICE)
    monkeypatch.setenv("SPARSE_MLA_GLUON", "1")
    first = decode_full_rows(q, cache.data, 16, backend=TRITON)
    assert torch.equal(decode_full_rows(q, cache.data, 16, backend=TRITON)[0], first[0]) and len(checked) == 1
    (entry,) = memo.CALLS.values()
    monkeypatch.setenv("SPARSE_MLA_GLUON", "0")
    check_close(decode_full_rows(q, cache.data, 16, backend=TRITON), first)
    assert len(checked) == 2  # planned again: the remembered plan was made with the Gluon kernel allowed
    (again,) = memo.CALLS.values()
    assert again is not entry and again.plan is not entry.plan
    decode_full_rows(q, cache.data, 16, backend=TRITON)
    assert len(checked) == 2  # remembered under the new setting
    if not ON_GPU:  # lower_as reads the real GPU's capability
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    with targets.lower_as("sm80"):
        check_close(decode_full_rows(q, cache.data, 16, backend=TRITON), first)
    assert len(checked) == 3
