"""Which GPU a device is (:mod:`sparse_mla.ops.targets`), and what the dispatch and the launch plan make of it: on the
CPU, with the device's vendor and properties faked (``torch.version.hip``, the capability, ROCm's ``gcnArchName``).
"""
from __future__ import annotations

import re
import types

import pytest
import torch
import triton

from helpers import ON_GPU
from sparse_mla.formats import get_format
from sparse_mla.ops import attention_plan, dispatch, launch_configs, targets

GPU = torch.device("cuda", 0)


@pytest.fixture
def fake_gpu(monkeypatch):
    """``fake_gpu(capability, gcn_arch=None)``: device 0 reports ``capability``; with ``gcn_arch`` it is an AMD GPU
    under ROCm's PyTorch (``torch.version.hip`` set). Returns a list that counts the capability reads."""
    reads = []

    def install(capability: tuple[int, int], gcn_arch: str | None = None) -> list:
        monkeypatch.setattr(torch.version, "hip", "6.2.41133" if gcn_arch else None)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: reads.append(1) or capability)
        props = types.SimpleNamespace(gcnArchName=f"{gcn_arch}:sramecc+:xnack-" if gcn_arch else "",
                                      multi_processor_count=132, major=capability[0], minor=capability[1])
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: reads.append(1) or props)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        targets._device_target.cache_clear()
        return reads

    yield install
    targets._device_target.cache_clear()


def test_target_for_known_and_nearest_architectures():
    assert targets.target_for("cuda", 80).name == "sm_80"
    assert targets.target_for("cuda", 87).name == "sm_86"  # Orin: the nearest row below
    assert targets.target_for("cuda", 103).name == "sm_100"
    assert targets.target_for("hip", "gfx1101").name == "gfx1100"
    assert targets.target_for("hip", "gfx1200").name == "gfx1201"
    with pytest.raises(ValueError, match="no known GPU target for cuda 75"):
        targets.target_for("cuda", 75)
    with pytest.raises(ValueError, match="gfx803"):
        targets.target_for("hip", "gfx803")
    assert [t.name for t in targets.MATRIX if t.native_fp8] == ["sm_89", "sm_90", "sm_100", "sm_120", "gfx950"]
    assert [t.name for t in targets.MATRIX if t.hopper] == ["sm_90"]


def test_cpu_stands_for_the_default_target():
    assert targets.target_of(torch.device("cpu")) is targets.DEFAULT
    assert targets.DEFAULT.name == "sm_90"


@pytest.mark.skipif(ON_GPU, reason="fakes the GPU")
def test_amd_gpu_reporting_capability_9_is_never_hopper(fake_gpu):
    """ROCm's PyTorch reports an MI300X as capability (9, 4): the vendor decides first, so it is gfx942 — no Gluon
    kernel, and the plan takes gfx942's launch configuration."""
    fake_gpu((9, 4), "gfx942")
    target = targets.target_of(GPU)
    assert target.name == "gfx942" and not target.hopper and target.warp_size == 64
    fp8_v4 = get_format("fp8_v4")
    assert not dispatch.gluon_fits(GPU, 512, frozenset({"fp8_v4"}), True)
    assert dispatch.attention_kernel(GPU, 512, frozenset({"fp8_v4"}), True) == "triton"
    with pytest.raises(ValueError, match="gluon=1 needs a Hopper GPU"):
        dispatch.attention_kernel(GPU, 512, frozenset({"fp8_v4"}), True, gluon=1)
    plan = attention_plan.AttentionPlan((4, 64, 512), GPU, [(fp8_v4, 64, 128)], False, False)
    config = launch_configs.attention_config(target, 512, frozenset({"fp8_v4"}), 64, False, False)
    constexprs = dict(plan.kernels()[0][2])
    assert plan.kernel == "triton" and plan.target is target
    assert {k: constexprs[k] for k in config.constexprs} == config.constexprs
    assert plan.kernels()[0][3] == {"num_warps": config.num_warps, "num_stages": config.num_stages}


@pytest.mark.skipif(ON_GPU, reason="fakes the GPU")
def test_nvidia_capability_9_is_hopper_and_targets_are_cached(fake_gpu):
    reads = fake_gpu((9, 0))
    assert targets.target_of(GPU).hopper
    assert targets.target_of(torch.device("cuda")) is targets.target_of(GPU)
    assert len(reads) == 1  # read once per device
    fake_gpu((8, 9))
    assert targets.target_of(GPU).name == "sm_89"


@pytest.mark.skipif(ON_GPU, reason="fakes the GPU")
def test_lower_as_compiles_as_the_target_and_assembles_for_the_real_gpu(fake_gpu):
    from triton.backends.nvidia import compiler

    fake_gpu((9, 0))
    original = compiler.sm_arch_from_capability
    with targets.lower_as("sm80") as target:
        assert target.name == "sm_80"
        assert triton.knobs.runtime.override_arch == "sm80"
        assert compiler.sm_arch_from_capability(80) == "sm_90a"  # ptxas assembles for the H100
        assert targets.target_of(GPU).name == "sm_80"  # the library's choices see the emulated target
        assert not dispatch.gluon_fits(GPU, 512, frozenset({"bf16"}), True)
    assert triton.knobs.runtime.override_arch is None and compiler.sm_arch_from_capability is original
    assert targets.target_of(GPU).name == "sm_90"
    with pytest.raises(ValueError, match="NVIDIA target such as 'sm80'"):
        with targets.lower_as("gfx942"):
            pass


@pytest.mark.skipif(ON_GPU, reason="a machine without a GPU")
def test_lower_as_without_an_nvidia_gpu_says_it_needs_one(fake_gpu):
    with pytest.raises(ValueError, match=r"lower_as\('sm80'\) needs an NVIDIA GPU .* sees none"):
        with targets.lower_as("sm80"):
            pass
    fake_gpu((9, 4), "gfx942")
    with pytest.raises(ValueError, match=r"lower_as\('sm80'\) needs an NVIDIA GPU .* is ROCm's"):
        with targets.lower_as("sm80"):
            pass


def _bf16_plan(**kw) -> attention_plan.AttentionPlan:
    return attention_plan.AttentionPlan((1, 2, 512), torch.device("cpu"), [(get_format("bf16"), 4, 4)], False, False,
                                        **kw)


def test_overrides_win_over_the_target_row():
    target = targets.target_for("hip", "gfx942")
    plan = _bf16_plan(target=target, block_n=32, h_block=16, num_warps=4, num_stages=3)
    _, _, constexprs, options = plan.kernels()[0]
    assert (constexprs["BLOCK_N"], constexprs["H_BLOCK"], options) == (32, 16, {"num_warps": 4, "num_stages": 3})
    plain = _bf16_plan(target=target)
    config = launch_configs.attention_config(target, 512, frozenset({"bf16"}), 2, False, False)
    assert plain.kernels()[0][3] == {"num_warps": config.num_warps, "num_stages": config.num_stages}


def test_a_case_the_target_cannot_run_is_a_value_error(monkeypatch):
    said = "sm_80 cannot read fp8_v4 caches here; use bf16 caches"
    monkeypatch.setattr(launch_configs, "unsupported",
                        lambda target, dim, formats, q_fp8: said if target.name == "sm_80" else None)
    with pytest.raises(ValueError, match=said):
        _bf16_plan(target=targets.target_for("cuda", 80))
    _bf16_plan(target=targets.target_for("cuda", 89))


@pytest.mark.skipif(ON_GPU, reason="replaces the kernel launch with a stub")
@pytest.mark.parametrize("failing", ["attention", "combine"])
def test_a_triton_error_reaches_the_user_as_a_value_error(monkeypatch, failing):
    """The last line of defence: Triton's compile / resource errors from either launch become a ValueError naming
    the target, the formats and the shapes, chained to Triton's; PyTorch's own errors pass unchanged."""
    from triton.runtime.errors import OutOfResources

    raised = {"error": OutOfResources(197632, 101376, "shared memory")}

    def stub_launch(kernel_name, constexprs, options):
        def launch(grid, *args):
            if (kernel_name == "combine") == (failing == "combine"):
                raise raised["error"]
        launch.kernel, launch.kwargs = kernel_name, dict(constexprs)
        return launch

    monkeypatch.setattr(attention_plan, "_launch", stub_launch)
    plan = _bf16_plan(splits=2)
    q = torch.zeros(1, 2, 512, dtype=torch.bfloat16)
    out, lse = torch.empty(1, 2, 512, dtype=torch.bfloat16), torch.empty(1, 2)
    cache = torch.zeros(1, 4, 576, dtype=torch.bfloat16)
    indices, lens = torch.zeros(1, 4, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    call = (q, out, lse, None, 1.0, (cache,), (indices,), (lens,), None)
    with pytest.raises(ValueError, match=r"on sm_90 \(triton kernel, bf16 caches, bf16 q of 1 tokens x 2 heads x 512 "
                                         r"dims, 2 split\(s\).*OutOfResources") as info:
        plan(*call)
    assert info.value.__cause__ is raised["error"]
    raised["error"] = torch.OutOfMemoryError("CUDA out of memory")
    with pytest.raises(torch.OutOfMemoryError):
        plan(*call)


@pytest.mark.skipif(ON_GPU, reason="fakes the GPU")
def test_verify_prints_the_support_row_of_its_gpu(fake_gpu):
    from sparse_mla.verify import SUPPORT_FORMATS, support_line, support_row

    assert "no GPU" in support_line(torch.device("cpu"))
    fake_gpu((9, 4), "gfx942")
    line = support_line(GPU)
    assert line.startswith("GPU: MI300X, MI325X (gfx942)")
    row = support_row(targets.target_for("hip", "gfx942"))
    assert all(row[fmt] in line for fmt, _ in SUPPORT_FORMATS)


@pytest.mark.skipif(ON_GPU, reason="fakes the GPU")
def test_a_hopper_with_an_unvalidated_triton_runs_the_portable_kernel_and_says_so_once(fake_gpu, monkeypatch):
    """Issue 47: on a Triton the Gluon kernel did not pass the GPU tests on, a Hopper GPU gets the portable kernel
    and one warning per process (none where the user turned Gluon off, none on another GPU); ``sparse-mla verify``'s
    support statement says the same."""
    import warnings

    from sparse_mla.ops.gluon import host
    from sparse_mla.verify import stack_line

    fp8_v4 = frozenset({"fp8_v4"})
    monkeypatch.delenv("SPARSE_MLA_GLUON", raising=False)
    monkeypatch.setattr(host, "_warned", False)
    monkeypatch.setattr(host.triton, "__version__", "9.9.0")
    fake_gpu((8, 0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert dispatch.attention_kernel(GPU, 512, fp8_v4, True) == "triton"  # not a Hopper: nothing to say
    fake_gpu((9, 0))
    monkeypatch.setenv("SPARSE_MLA_GLUON", "0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert dispatch.attention_kernel(GPU, 512, fp8_v4, True) == "triton"  # the user's choice: no warning
    monkeypatch.delenv("SPARSE_MLA_GLUON")
    tested = re.escape(", ".join(version for _, version in host.VALIDATED_STACKS))
    with pytest.warns(RuntimeWarning, match=rf"Triton 9\.9\.0 .*Triton {tested} only.*runs the portable Triton kernel"):
        assert dispatch.attention_kernel(GPU, 512, fp8_v4, True) == "triton"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert dispatch.attention_kernel(GPU, 512, frozenset({"bf16"}), True) == "triton"  # once per process
    assert "torch 2.11 + Triton 3.6" in stack_line() and "Hopper GPUs run the portable Triton kernel" in stack_line()
    if host.gluon is not None:  # a validated Triton: the Gluon kernel, no warning
        monkeypatch.setattr(host.triton, "__version__", "3.6.0")
        monkeypatch.setattr(host, "_warned", False)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert dispatch.attention_kernel(GPU, 512, fp8_v4, True) == "gluon"
        assert "Hopper GPUs run the Gluon kernel" in stack_line()


def test_the_gluon_refusal_names_every_scope_pairing_it_reads():
    """gluon=1 where the kernel cannot run says which scope formats it reads, from dispatch.GLUON_FORMATS itself:
    V4.1's mixed fp8 / fp4 scopes included (the text once said "scopes of one format")."""
    with pytest.raises(ValueError) as refused:
        dispatch.attention_kernel(torch.device("cpu"), 512, frozenset({"fp8_v41", "fp4_v41"}), True, gluon=1)
    message = str(refused.value)
    assert "one format" not in message
    for dim, sets in dispatch.GLUON_FORMATS.items():
        assert f"{dim}-d" in message and all(f in message for s in sets for f in s)
