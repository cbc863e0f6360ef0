"""Launching compiled Triton / Gluon kernels with little host work.

``kernel[grid](*args, **constexprs)`` re-derives, on every call, what the compiled binary was specialised
for (each argument's type, 16-byte alignment and ``== 1``), builds a cache key from it and the constexprs,
looks the binary up and launches it. A :class:`Launch` does the key part once: it is made for one set of
constexprs and launch options (``num_warps`` …), and keeps each compiled binary under a *fingerprint* of the
runtime arguments that is at least as fine as Triton's own specialisation (tensors: dtype and 16-byte
alignment; ints: ``== 1``, ``% 16 == 0``, the int32 range and ``>= 2^63``; anything else: its type). Equal
fingerprints therefore mean the same binary, which is then called through its launcher directly. The fingerprint
is computed by a function generated once per *type pattern* of the arguments (:func:`fingerprint_function`), so
a call reads only each tensor's dtype and pointer and each int's value, with no per-argument type test.

The direct call uses the compiled kernel's launchers (the Python ``run(grid…, stream, function,
packed_metadata, launch_metadata, enter_hook, exit_hook, *args)``, the same on every version and backend, and under
it CUDA's C ``launch``, which also takes the launch flags and scratch buffers: called straight when the kernel needs
no scratch, in the form of the installed Triton, :func:`_direct_call`), read on the Triton versions in
:data:`FAST_TRITON` and exercised by every GPU test after a kernel's first launch. Elsewhere, under the CPU
interpreter, with launch hooks installed (profilers) or with ``SPARSE_MLA_FAST_LAUNCH=0``, a :class:`Launch` makes
the ordinary JIT call — on Triton 3.9 some 5-8 times the host time of a direct call (issue 47).
"""
from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

import torch
import triton

from ..env import switch_on
from .targets import override_arch

# Triton versions whose launcher interfaces were read (triton/backends/{nvidia,amd}/driver.py, compiler.py's
# CompiledKernel): 3.6's generated C launcher per signature (run on H100 / H200), 3.7-3.9's one generic C launcher
FAST_TRITON = ("3.6.", "3.7.", "3.8.", "3.9.")

try:
    from triton import knobs as _knobs
except ImportError:  # pragma: no cover - older Triton: no fast path
    _knobs = None


def fast_path_enabled() -> bool:
    """Whether :class:`Launch` may call compiled binaries directly on this Triton."""
    return (_knobs is not None and triton.__version__.startswith(FAST_TRITON)
            and switch_on("SPARSE_MLA_FAST_LAUNCH", default=True))


def _fingerprint_terms(name: str, kind: type) -> str:
    """The expressions of one runtime argument named ``name`` of type ``kind`` in a fingerprint: a tensor's dtype
    and 16-byte alignment; an int's ``== 1``, ``% 16 == 0``, int32 range and ``>= 2^63`` (u64); nothing for any
    other type (the type pattern the fingerprint is made for tells those apart)."""
    if issubclass(kind, torch.Tensor):
        return f"{name}.dtype, not {name}.data_ptr() & 15, "
    if issubclass(kind, int) and kind is not bool:
        return (f"{name} == 1, not {name} & 15, {-(1 << 31)} <= {name} < {1 << 31}, {name} >= {1 << 63}, ")
    return ""


@functools.lru_cache(maxsize=256)
def fingerprint_function(types: tuple[type, ...]) -> Callable[[tuple], tuple]:
    """The fingerprint of runtime arguments of the type pattern ``types`` (see the module docstring), as one
    generated function ``args -> tuple`` that reads only what matters at each position (no per-argument type
    test: the caller keys on the types). Two argument tuples of the same types have equal fingerprints exactly
    when Triton's specialisation cannot tell them apart (or finer)."""
    names = [f"a{i}" for i in range(len(types))]
    unpack = f"    {', '.join(names)}, = args\n" if names else ""
    body = "".join(_fingerprint_terms(n, t) for n, t in zip(names, types))
    namespace: dict = {}
    exec(f"def fingerprint(args):\n{unpack}    return ({body})\n", namespace)  # code made above, from types
    return namespace["fingerprint"]


def fingerprint(args: tuple) -> tuple:
    """What of ``args`` can change the compiled binary: their types and :func:`fingerprint_function`'s terms."""
    types = tuple(map(type, args))
    return types, fingerprint_function(types)(args)


def on_device_of(tensor: torch.Tensor) -> contextlib.AbstractContextManager:
    """``tensor``'s CUDA device made the current one for the launches inside, where it is not (else nothing). Triton
    compiles, loads and launches on the current device whatever device the arguments live on: a tensor on another
    GPU was refused with a misleading "Pointer argument cannot be accessed from Triton (cpu tensor?)", and a binary
    launched directly (:class:`Launch`) would have run in the wrong device's context. Torch's own ops follow their
    tensors; the library's launches now do too."""
    if tensor.is_cuda:
        index = tensor.get_device()
        if index != torch._C._cuda_getDevice():
            return torch.cuda.device(index)
    return contextlib.nullcontext()


def _launch_hooks_installed() -> bool:
    """Whether a profiler hooked kernel launches (Triton 3.6 keeps chains of hooks, empty by default)."""
    runtime = _knobs.runtime
    enter, leave = runtime.launch_enter_hook, runtime.launch_exit_hook
    return bool(getattr(enter, "calls", enter)) or bool(getattr(leave, "calls", leave))


class Launch:
    """One kernel with fixed constexprs and launch options, launched as ``launch(grid, *args)``.

    kernel: a ``@triton.jit`` or ``@gluon.jit`` function whose constexpr parameters all come after its
    runtime parameters. constexprs: a value for each constexpr parameter (by name). options: launch options
    such as ``num_warps`` / ``num_stages``. ``args`` are the runtime arguments in order. Returns the compiled
    kernel it launched (the JIT call's return value, or on the direct path the binary that call returned; under the
    CPU interpreter, None).
    """

    def __init__(self, kernel, constexprs: dict, options: dict | None = None) -> None:
        self.kernel = kernel
        self.kwargs = {**constexprs, **fp_fusion(), **(options or {})}
        # per type pattern of the runtime arguments: its fingerprint function and, by (device, fingerprint), how to
        # launch the binary directly (_direct_call) and the binary itself
        self._binaries: dict[tuple[type, ...], tuple[Callable[[tuple], tuple], dict[tuple, tuple]]] = {}
        params = getattr(kernel, "params", None)  # None under the CPU interpreter: always the JIT call
        self._fast = params is not None and fast_path_enabled()
        if not self._fast:
            return
        names = [p.name for p in params if p.is_constexpr]
        first = next(i for i, p in enumerate(params) if p.is_constexpr) if names else len(params)
        if any(not p.is_constexpr for p in params[first:]):  # the direct call passes runtime args, then constexprs
            raise ValueError(f"{kernel.__name__}: constexpr parameters must come after the runtime ones")
        if set(constexprs) - set(names):
            raise ValueError(f"{kernel.__name__} has no constexpr parameter(s) {sorted(set(constexprs) - set(names))}")
        # defaults of constexprs not given travel as their declared default
        self.constexpr_values = tuple(constexprs[n] if n in constexprs else p.default
                                      for n, p in zip(names, [p for p in params if p.is_constexpr]))

    def __call__(self, grid: tuple, *args):
        if not args[0].is_cuda:  # the CPU interpreter
            return self.kernel[grid](*args, **self.kwargs)
        # where the JIT call compiles, loads and launches (torch.cuda.current_device() without its lazy-init test:
        # CUDA is initialised), which must be where the tensors live (args[0] among them): else switched to it
        device = torch._C._cuda_getDevice()
        if args[0].get_device() != device:
            with torch.cuda.device(args[0].get_device()):
                return self(grid, *args)
        if not self._fast or _launch_hooks_installed():
            return self.kernel[grid](*args, **self.kwargs)
        types = tuple(map(type, args))
        by_types = self._binaries.get(types)
        if by_types is None:
            by_types = self._binaries[types] = (fingerprint_function(types), {})
        fingerprint_of, binaries = by_types
        key = (device, fingerprint_of(args))
        direct = binaries.get(key)
        if direct is None:
            binary = self.kernel[grid](*args, **self.kwargs)  # compiles (or finds) and launches
            binaries[key] = (*_direct_call(binary), binary)
            return binary
        launch, leading, packed, binary = direct
        stream = torch._C._cuda_getCurrentRawStream(device)
        if packed:
            launch(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1, stream, *leading,
                   (*args, *self.constexpr_values))
        else:
            launch(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1, stream, *leading, *args,
                   *self.constexpr_values)
        return binary


    def bind(self, grid: tuple, args: tuple, fixed: frozenset[int] = frozenset()) -> BoundLaunch | None:
        """This launch with ``grid`` and ``args``' non-tensor arguments fixed, for later calls whose tensors have the
        dtypes and 16-byte alignments of ``args``' (the caller's guarantee): a :class:`BoundLaunch` once a call with
        ``args``' fingerprint has compiled the binary, else None (and None off the direct path). ``fixed``: positions
        in ``args`` of tensors that every later call passes again (buffers the caller owns for as long as the bound
        launch): their pointers are read now, and later calls pass only the other tensors."""
        if not self._fast or not args[0].is_cuda or _launch_hooks_installed():
            return None
        by_types = self._binaries.get(tuple(map(type, args)))
        device = args[0].get_device()  # where the call compiled it (Launch.__call__ runs it there)
        direct = None if by_types is None else by_types[1].get((device, by_types[0](args)))
        if direct is None:
            return None
        grid3 = (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)
        return BoundLaunch(direct[:3], grid3, args, self.constexpr_values, device, fixed)  # (less the binary)


@functools.lru_cache(maxsize=256)
def bound_caller(varying: tuple[bool, ...], packed_from: int | None = None) -> Callable:
    """The call of a :class:`BoundLaunch` whose launcher arguments after the stream are ``varying`` (True: a tensor each
    call passes, as its data pointer; False: a value bound once), as one generated function ``call(launch, values,
    stream, tensors)``: the grid from ``values``, the stream, then the other arguments in order, those from position
    ``packed_from`` on as one tuple (the kernel's arguments, for a launcher that takes them so; None: none). Made once
    per such pattern (generating it per binding cost more than the calls saved: a step's plans bind anew each step)."""
    terms, k, v = [], 0, 3
    for is_tensor in varying:
        if is_tensor:
            terms.append(f"t{k}.data_ptr()")
            k += 1
        else:
            terms.append(f"values[{v}]")
            v += 1
    if packed_from is not None:
        terms[packed_from:] = [f"({''.join(f'{term}, ' for term in terms[packed_from:])})"]
    unpack = f"    {', '.join(f't{i}' for i in range(k))}, = tensors\n" if k else ""
    source = (f"def call(launch, values, stream, tensors):\n{unpack}"
              f"    launch(values[0], values[1], values[2], stream, {', '.join(terms)})\n")
    namespace: dict = {}
    exec(source, namespace)  # code made above from the pattern alone
    return namespace["call"]


class BoundLaunch:
    """A compiled binary with its grid, every non-tensor argument and the ``fixed`` tensors bound (:meth:`Launch.bind`):
    ``bound(tensors)`` launches it with ``tensors`` in the places of the binding call's other tensors, in order,
    skipping the fingerprint. Returns False, launching nothing, where the direct path does not apply (launch hooks
    installed since, or another current device): the caller then launches the ordinary way.

    The tensors go to the launcher as their data pointers: it then skips its own check of each pointer (a driver
    query per tensor, some 15 per attention launch), so the caller vouches that every tensor lives on the bound
    device, as its checks of the first call established. The call is :func:`bound_caller`'s function for the
    arguments' pattern, with the bound values in one tuple (no per-argument loop)."""

    def __init__(self, direct: tuple[Callable, tuple, bool], grid: tuple[int, int, int], args: tuple,
                 constexprs: tuple, device: int, fixed: frozenset[int] = frozenset()) -> None:
        self._launch, leading, packed = direct
        self._device = device
        # the fixed tensors are held (their pointers are bound); the binding call's other tensors are not: each call
        # passes its own, and holding them would keep them alive
        self._held = [a for i, a in enumerate(args) if i in fixed]
        varying = [isinstance(a, torch.Tensor) and i not in fixed for i, a in enumerate(args)]
        self._values = (*grid, *leading, *[a.data_ptr() if isinstance(a, torch.Tensor) else a
                                           for a, v in zip(args, varying) if not v], *constexprs)
        self._call = bound_caller((False,) * len(leading) + tuple(varying) + (False,) * len(constexprs),
                                  len(leading) if packed else None)

    def __call__(self, tensors: list[torch.Tensor]) -> bool:
        if torch._C._cuda_getDevice() != self._device or _launch_hooks_installed():
            return False
        self._call(self._launch, self._values, torch._C._cuda_getCurrentRawStream(self._device), tensors)
        return True


class BindOnce:
    """A launch bound by its first ordinary call, reused while later calls match that call's ``key``.

    ``bound`` is None until tried, then the bound launch (a callable returning whether it launched, such as a
    :class:`BoundLaunch`), or False where binding is impossible (no direct path: never asked again); ``key`` holds
    what the caller's guard compares (strides, alignment, a scale: whatever the bound launch fixed but the call may
    change). A call site goes ``if slot(key, *args): return``, else launches the ordinary way and then
    ``slot.settle(key, lambda: ....bind(...))``."""

    __slots__ = ("bound", "key")

    def __init__(self) -> None:
        self.bound: Callable[..., bool] | None | bool = None
        self.key: object = None

    def __call__(self, key: object, *args) -> bool:
        """Launch through the bound launch when it exists and ``key`` is the binding call's; whether it launched."""
        return bool(self.bound) and key == self.key and self.bound(*args)

    def settle(self, key: object, bind: Callable[[], Callable[..., bool] | None]) -> None:
        """After an ordinary launch: the first time only, bind (``bind()``; None means it cannot) under ``key``."""
        if self.bound is None:
            self.bound, self.key = bind() or False, key


def _direct_call(binary) -> tuple[Callable, tuple, bool]:
    """How to launch a compiled kernel without the JIT call: a function, the arguments that go between the grid and
    stream and the kernel's own, and whether the kernel's arguments (runtime ones, then constexprs) go as one tuple.

    CUDA's C launcher itself where the kernel needs no scratch memory (Triton's Python launcher then only passes two
    ``None`` scratch buffers on; with no hooks and no launch metadata: None each), in the installed Triton's form:
    3.7-3.9's one generic launcher takes ``(…, function, cooperative, pdl, packed_metadata, launch_metadata,
    enter_hook, exit_hook, global_scratch, profile_scratch, arg_annotations, kernel_signature, kernel_args)``,
    3.6's launcher generated per signature ``(…, function, cooperative, pdl, global_scratch, profile_scratch,
    packed_metadata, launch_metadata, enter_hook, exit_hook, *kernel_args)``. Otherwise (scratch memory, 3.9's
    sanitizer, AMD's launchers, whose C forms differ again) the Python launcher, whose form every version and backend
    shares."""
    launcher = binary.run
    if (type(launcher).__name__ == "CudaLauncher" and launcher.global_scratch_size == 0
            and launcher.profile_scratch_size == 0 and not getattr(launcher, "gsan_enabled", False)):
        flags = (binary.function, launcher.launch_cooperative_grid, launcher.launch_pdl)
        if hasattr(launcher, "kernel_signature"):
            return launcher.launch, (*flags, binary.packed_metadata, None, None, None, None, None,
                                     launcher.arg_annotations, launcher.kernel_signature), True
        return launcher.launch, (*flags, None, None, binary.packed_metadata, None, None, None), False
    return launcher, (binary.function, binary.packed_metadata, None, None, None), False


_LAUNCHES: dict[tuple, Launch] = {}


def fp_fusion(on: bool = True) -> dict[str, bool]:
    """The launch option fixing a kernel's floating-point contraction (``a * b + c`` as one fused multiply-add): on,
    as every kernel was measured (Triton's default through 3.9, which warns that 3.10 turns it off where a launch
    does not say: ``TRITON_DEFAULT_FP_FUSION``); off only where a kernel rounds each step as its reference does (the
    indexer's query prep). ``TRITON_FORCE_DISABLE_FP_FUSION`` still turns it off everywhere."""
    return {"enable_fp_fusion": on}


def register_cap(maxnreg: int | None) -> dict[str, int]:
    """The launch option capping a kernel's registers a thread at ``maxnreg``; None: no option at all (Triton's HIP
    backend has no ``maxnreg`` and rejects the keyword, None included, before it compiles)."""
    return {} if maxnreg is None else {"maxnreg": maxnreg}


def cached_launch(kernel, constexprs: tuple, options: tuple = ()) -> Launch:
    """The shared :class:`Launch` of ``kernel`` for ``constexprs`` / ``options`` given as ``(name, value)`` pairs.
    Keyed by the kernel's identity (kernels are module-level functions, alive for the whole run): hashing a JIT
    function hashes its source under a lock, a cost per call where a launch is looked up per call; and by the
    lowering (``targets.lower_as``), whose binaries differ for the same constexprs."""
    key = (id(kernel), constexprs, options, override_arch())
    launch = _LAUNCHES.get(key)
    if launch is None or launch.kernel is not kernel:
        launch = _LAUNCHES[key] = Launch(kernel, dict(constexprs), dict(options))
    return launch
