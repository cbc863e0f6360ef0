"""The fast launcher (ops.launch): the generated per-type-pattern fingerprint functions tell apart exactly what
the plain per-argument walk did (what Triton specialises a compiled binary on)."""
from __future__ import annotations

import contextlib

import inspect
import pathlib
import random
import re
import types

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from helpers import ON_GPU
from sparse_mla.ops import launch
from sparse_mla.ops.launch import BindOnce, BoundLaunch, fingerprint, fingerprint_function


def walk_fingerprint(args: tuple) -> tuple:
    """The fingerprint as one walk over the arguments (the launcher's former, slower form): the oracle."""
    return tuple([(a.dtype, a.data_ptr() & 15 == 0) if isinstance(a, torch.Tensor)
                  else (a == 1, a & 15 == 0, -(1 << 31) <= a < (1 << 31), a >= 1 << 63) if type(a) is int
                  else type(a) for a in args])


BYTES, WORDS = torch.zeros(256, dtype=torch.uint8), torch.zeros(64, dtype=torch.int32)
INTS = [v + d for v in (0, 1, 16, 1 << 31, 1 << 63, -(1 << 31)) for d in (-1, 0, 1)] + [32, 48, 1 << 33, -16]


def random_arg(rng: random.Random) -> object:
    """A tensor of one of three dtypes at one of four alignments, an int near an edge Triton specialises on, a float,
    None or a bool."""
    kind = rng.randrange(5)
    if kind == 0:
        if rng.random() < 0.5:
            return BYTES[rng.choice((0, 1, 8, 16)):][:32].view(rng.choice((torch.uint8, torch.int8)))
        return WORDS[rng.choice((0, 1, 2, 4)):][:8]
    if kind == 1:
        return rng.choice(INTS)
    return rng.choice((2.0, 0.5, None, True, False)) if kind == 2 else rng.choice(INTS + [3.0, None])


def test_generated_fingerprints_separate_exactly_what_the_walk_did():
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randrange(0, 8)
        first = tuple(random_arg(rng) for _ in range(n))
        # a second tuple mostly of the same pattern: same types, values near the first's
        second = tuple(random_arg(rng) if rng.random() < 0.4 else a for a in first)
        if rng.random() < 0.2:
            second = tuple(random_arg(rng) for _ in range(n))
        assert (fingerprint(first) == fingerprint(second)) == (walk_fingerprint(first) == walk_fingerprint(second)), \
            (first, second)


def test_the_fingerprint_of_a_launch_like_argument_list():
    q, out = torch.zeros(4, 8, dtype=torch.bfloat16), torch.zeros(4, 8, dtype=torch.bfloat16)
    args = (q, 8, 1, out, 2 ** 31, 0.5, None, True)
    types = tuple(map(type, args))
    assert fingerprint_function(types) is fingerprint_function(types)  # made once per type pattern
    assert fingerprint(args) == (types, (torch.bfloat16, True,  # q: dtype, 16-byte aligned
                                         False, False, True, False,  # 8: == 1, % 16 == 0, int32, >= 2^63
                                         True, False, True, False,  # 1
                                         torch.bfloat16, True,  # out
                                         False, True, False, False))  # 2^31: int64
    assert fingerprint(()) == ((), ())
    assert fingerprint((q[:, 1:], *args[1:])) != fingerprint(args)  # 2-byte offset: not 16-byte aligned
    assert fingerprint((*args[:-1], 1)) != fingerprint(args)  # a bool became an int


def test_bind_once_binds_on_the_first_settle_and_launches_only_under_its_key():
    launched, binds = [], []

    def bind(result):
        binds.append(result)
        return result

    def bound(*args):
        launched.append(args)
        return True

    slot = BindOnce()
    assert not slot("k", 1) and not launched  # nothing bound yet: the caller launches the ordinary way
    slot.settle("k", lambda: bind(bound))
    slot.settle("other", lambda: bind(bound))  # bound once: later settles change nothing
    assert binds == [bound] and slot.key == "k"
    assert slot("k", 1, 2) and launched == [(1, 2)]
    assert not slot("other", 3) and launched == [(1, 2)]  # another key: the bound launch does not run

    refused = BindOnce()
    refused.settle("k", lambda: bind(None))  # no direct path: never asked again
    refused.settle("k", lambda: bind(bound))
    assert refused.bound is False and binds == [bound, None] and not refused("k", 1)


def test_a_bound_launch_passes_the_binding_calls_values_with_each_calls_varying_tensors():
    """The generated call of a :class:`BoundLaunch`: grid, stream, the launcher's leading values, then the arguments
    in order — fixed tensors and non-tensors as bound, the other tensors from the call, as data pointers — and the
    constexprs."""
    calls = []
    a, b, c, d = (torch.zeros(4, dtype=torch.int32) for _ in range(4))
    args = (a, 7, b, None, 2.5, c, d, 1 << 40)
    bound = BoundLaunch((lambda *xs: calls.append(xs), ("fn", None), False), (3, 2, 1), args, ("C0", True), 0,
                        fixed=frozenset({2, 6}))
    x, y = torch.zeros(2, dtype=torch.int32), torch.zeros(3, dtype=torch.int32)
    bound._call(bound._launch, bound._values, "stream", [x, y])  # (the device test of __call__ needs a GPU)
    assert calls == [(3, 2, 1, "stream", "fn", None, x.data_ptr(), 7, b.data_ptr(), None, 2.5, y.data_ptr(),
                      d.data_ptr(), 1 << 40, "C0", True)]
    assert bound._held == [b, d]  # the fixed tensors stay alive with their bound pointers
    again = BoundLaunch((lambda *xs: calls.append(xs), ("fn", None), False), (1, 1, 1), args, ("C0", True), 0,
                        fixed=frozenset({2, 6}))
    assert again._call is bound._call  # one generated function per pattern of arguments, not per binding
    with pytest.raises(ValueError):  # another number of tensors than bound: refused, never launched half-stale
        bound._call(bound._launch, bound._values, "stream", [x])
    assert len(calls) == 1
    # a launcher taking the kernel's arguments as one tuple (Triton 3.7 on): the same values, packed after the leading
    packed = BoundLaunch((lambda *xs: calls.append(xs), ("fn", None), True), (3, 2, 1), args, ("C0", True), 0,
                         fixed=frozenset({2, 6}))
    packed._call(packed._launch, packed._values, "stream", [x, y])
    assert calls[-1] == (3, 2, 1, "stream", "fn", None, (x.data_ptr(), 7, b.data_ptr(), None, 2.5, y.data_ptr(),
                                                         d.data_ptr(), 1 << 40, "C0", True))


# --- the direct path on the installed Triton (issue 47: on 3.9 every call went through the JIT, 5-8x the host time) ---

def _c_launcher_slots() -> list[str]:
    """The positional parameters of the installed Triton's CUDA C launcher, read from its own source (3.6: the
    launcher it generates per signature; 3.7 on: the one in ``driver.c``): one name per ``PyArg_ParseTuple`` unit,
    ``kernel_metadata`` for the packed metadata (3.7 on parses it in place as ``(iii)``), up to the kernel's own
    arguments (3.6: one parameter each after these; 3.7 on: the last, ``kernel_args``, a tuple)."""
    from triton.backends.nvidia import driver

    if hasattr(driver, "make_launcher"):
        source = driver.make_launcher({}, {0: "*fp32", 1: "i32"}, None)
    else:
        source = pathlib.Path(driver.__file__).with_name("driver.c").read_text()
        source = source[source.index("launchKernel(PyObject *self"):]
    fmt, targets = re.search(r'PyArg_ParseTuple\(args,\s*"([^"]*)",(.*?)\)\)', source, re.S).groups()
    names = iter(re.findall(r"&(\w+)", targets))
    slots = []
    for unit in re.findall(r"\([^)]*\)|y\*|\w", fmt):
        if unit.startswith("("):
            slots.append("kernel_metadata")
            for _ in range(len(unit) - 2):
                next(names)
        else:
            slots.append(next(names))
    if "_arg0" in slots:  # 3.6: the kernel's own arguments follow, one parameter each
        slots = slots[:slots.index("_arg0")]
    return [{"_stream": "stream", "_function": "function", "signature": "kernel_signature"}.get(s, s) for s in slots]


class _Param:
    def __init__(self, name: str, is_constexpr: bool = False, default: object = None) -> None:
        self.name, self.is_constexpr, self.default = name, is_constexpr, default


class _CudaArg:
    """A stand-in first argument on a CUDA device (the direct path is for CUDA tensors): GPU ``device``."""
    is_cuda = True

    def __init__(self, device: int = 0) -> None:
        self.device = device

    def get_device(self) -> int:
        return self.device


def _fake_cuda_binary(calls: list, **launcher_values):
    """A compiled kernel whose launcher is the installed Triton's ``CudaLauncher`` with every attribute its
    ``__init__`` sets (sentinels; no scratch, no sanitizer) and a C ``launch`` that records its arguments."""
    from triton.backends.nvidia.driver import CudaLauncher

    launcher = object.__new__(CudaLauncher)
    for name in dict.fromkeys(re.findall(r"self\.(\w+)\s*=", inspect.getsource(CudaLauncher.__init__))):
        setattr(launcher, name, f"<{name}>")
    values = {**dict(global_scratch_size=0, profile_scratch_size=0, gsan_enabled=False, launch_cooperative_grid=False,
                     launch_pdl=True), **launcher_values}
    for name, value in values.items():
        setattr(launcher, name, value)
    launcher.launch = lambda *args: calls.append(args)
    return types.SimpleNamespace(run=launcher, function=0xF00, packed_metadata=(4, 1, 1024))


def _by_slot(call: tuple) -> tuple[dict, tuple]:
    """A recorded C launcher call as {parameter: value} and the kernel's arguments (a tuple or the trailing ones)."""
    slots = _c_launcher_slots()
    named = dict(zip(slots, call))
    kernel_args = named.pop("kernel_args") if "kernel_args" in slots else call[len(slots):]
    return named, tuple(kernel_args)


def test_the_installed_triton_takes_the_direct_path():
    """``make test``'s Triton is one whose launchers :func:`launch._direct_call` was written for: a newer one fails
    here, not silently slow (its launcher forms are to be read and added to ``FAST_TRITON``)."""
    assert launch.fast_path_enabled()
    jit_call = "kernel.run(grid_0, grid_1, grid_2, stream, kernel.function, kernel.packed_metadata, launch_metadata,"
    assert jit_call in inspect.getsource(JITFunction.run)  # the Python launcher's form, as the fallback makes it


def test_a_launch_runs_on_its_first_tensor_s_gpu_where_another_is_current(monkeypatch):
    """Triton compiles, loads and launches on the current device: a launch whose tensors live on another GPU makes
    theirs current for the call (the JIT call, then the direct one, each under it), and the caller's back after."""
    current = [0]
    switches = []

    @contextlib.contextmanager
    def device(index):
        switches.append(index)
        before, current[0] = current[0], index
        yield
        current[0] = before

    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: current[0], raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 0x5EA + device, raising=False)
    monkeypatch.setattr(torch.cuda, "device", device)
    calls, jit_devices = [], []
    binary = _fake_cuda_binary(calls)

    class Kernel:
        params = [_Param("x"), _Param("n"), _Param("BLOCK", True)]
        __name__ = "kernel"

        def __getitem__(self, grid):
            return lambda *args, **kwargs: jit_devices.append(current[0]) or binary

    run = launch.Launch(Kernel(), {"BLOCK": 64})
    on_1 = _CudaArg(1)
    assert run((1,), on_1, 7) is binary and jit_devices == [1] and switches == [1] and current[0] == 0
    assert run((1,), on_1, 7) is binary and jit_devices == [1] and switches == [1, 1] and current[0] == 0
    assert _by_slot(calls[0])[0]["stream"] == 0x5EA + 1  # the direct call: on GPU 1's stream
    assert run((1,), _CudaArg(0), 7) is binary and switches == [1, 1]  # a tensor on the current GPU: no switch
    bound = run.bind((1,), (on_1, 7))  # bound to GPU 1's binary: launched only while GPU 1 is current
    launched = len(calls)
    assert bound is not None and not bound([]) and len(calls) == launched
    with device(1):
        assert bound([]) and len(calls) == launched + 1 and _by_slot(calls[-1])[0]["stream"] == 0x5EA + 1
    assert launch.on_device_of(torch.zeros(1)).__class__ is contextlib.nullcontext  # a CPU tensor: nothing


def test_a_launch_goes_direct_after_its_first_call_with_the_installed_launchers_arguments(monkeypatch):
    """The first call of a fingerprint goes through the JIT (it compiles); the next ones call CUDA's C launcher with
    every parameter where the installed Triton's launcher reads it: grid, stream, function, flags, packed metadata,
    no hooks or scratch, then the runtime arguments and constexprs."""
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)  # (CPU torch has none)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 0x5EA, raising=False)
    calls, jit_calls = [], []
    binary = _fake_cuda_binary(calls)

    class Kernel:
        params = [_Param("x"), _Param("n"), _Param("BLOCK", True), _Param("FLAG", True, default=False)]
        __name__ = "kernel"

        def __getitem__(self, grid):
            return lambda *args, **kwargs: jit_calls.append((grid, args, kwargs)) or binary

    kernel = Kernel()
    run = launch.Launch(kernel, {"BLOCK": 64}, {"num_warps": 4})
    x = _CudaArg()
    assert run((4, 2), x, 7) is binary and len(jit_calls) == 1 and not calls  # compiled through the JIT
    assert run((4, 2), x, 7) is binary and len(jit_calls) == 1  # then direct (returning the binary it launched)
    named, kernel_args = _by_slot(calls[0])
    assert (named["gridX"], named["gridY"], named["gridZ"], named["stream"]) == (4, 2, 1, 0x5EA)
    assert (named["function"], named["kernel_metadata"]) == (0xF00, (4, 1, 1024))
    assert (named["launch_cooperative_grid"], named["launch_pdl"]) == (False, True)
    for absent in ("launch_metadata", "launch_enter_hook", "launch_exit_hook", "global_scratch_obj",
                   "profile_scratch_obj"):
        assert named[absent] is None, absent
    if "kernel_signature" in named:  # 3.7 on: the launcher's own annotations of the signature
        assert (named["arg_annotations"], named["kernel_signature"]) == ("<arg_annotations>", "<kernel_signature>")
    assert kernel_args == (x, 7, 64, False)
    assert run((4, 2), x, 1) is binary and len(jit_calls) == 2  # another fingerprint (1 is specialised): the JIT

    # a bound launch fills the same parameters, its varying tensors as data pointers
    t, u = torch.zeros(4), torch.zeros(8)
    bound = launch.BoundLaunch(launch._direct_call(binary), (3, 1, 1), (t, 7), run.constexpr_values, 0)
    bound._call(bound._launch, bound._values, 0x5EA, [u])
    named, kernel_args = _by_slot(calls[-1])
    assert (named["gridX"], named["stream"], named["function"], named["kernel_metadata"]) == (3, 0x5EA, 0xF00,
                                                                                              (4, 1, 1024))
    assert kernel_args == (u.data_ptr(), 7, 64, False)


def test_kernels_with_scratch_memory_or_another_launcher_go_through_its_python_call():
    """Scratch buffers (allocated per launch), or a launcher whose C form this module does not spell (AMD's), go
    through the launcher's Python call, in the form the JIT calls it."""
    calls = []
    binary = _fake_cuda_binary(calls, global_scratch_size=64)
    assert launch._direct_call(binary) == (binary.run, (0xF00, (4, 1, 1024), None, None, None), False)
    amd = types.SimpleNamespace(run=type("HIPLauncher", (), {})(), function=0xF00, packed_metadata=(4, 1, 1024))
    assert launch._direct_call(amd) == (amd.run, (0xF00, (4, 1, 1024), None, None, None), False)


@triton.jit
def _scaled_copy(src, dst, n, factor, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst + offs, tl.load(src + offs, mask=offs < n) * factor, mask=offs < n)


@pytest.mark.skipif(not ON_GPU, reason="launches on the GPU")
def test_a_kernel_goes_direct_and_bound_on_this_gpu_s_triton():
    """On the GPU's Triton (3.6, or another put first on PYTHONPATH): after the compiling JIT call, the direct call
    and a bound launch run and compute what the JIT call does, on new tensors and values."""
    run = launch.Launch(_scaled_copy, {"BLOCK": 128})
    src = torch.arange(300, dtype=torch.float32, device="cuda")
    dst, dst2, dst3 = (torch.empty_like(src) for _ in range(3))
    grid = (triton.cdiv(300, 128),)
    binary = run(grid, src, dst, 300, 2.0)
    assert binary is not None  # compiled through the JIT
    src2 = src + 1
    jit, run.kernel = run.kernel, None  # the direct path launches without the JIT function
    assert run(grid, src2, dst2, 300, 3.0) is binary  # ... and returns the binary the JIT call compiled
    run.kernel = jit
    bound = run.bind(grid, (src, dst, 300, 0.5))
    assert bound is not None and bound([src2, dst3])
    torch.cuda.synchronize()
    assert torch.equal(dst, src * 2) and torch.equal(dst2, src2 * 3) and torch.equal(dst3, src2 * 0.5)
