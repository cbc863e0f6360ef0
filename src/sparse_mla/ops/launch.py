"""Launching compiled Triton / Gluon kernels with little host work.

``kernel[grid](*args, **constexprs)`` re-derives, on every call, what the compiled binary was specialised
for (each argument's type, 16-byte alignment and ``== 1``), builds a cache key from it and the constexprs,
looks the binary up and launches it. A :class:`Launch` does the key part once: it is made for one set of
constexprs and launch options (``num_warps`` …), and keeps each compiled binary under a *fingerprint* of the
runtime arguments that is at least as fine as Triton's own specialisation (tensors: dtype and 16-byte
alignment; ints: ``== 1``, ``% 16 == 0`` and the int32 range; anything else: its type). Equal fingerprints
therefore mean the same binary, which is then called through its launcher directly.

The direct call uses the compiled kernel's launcher interface (``run(grid…, stream, function,
packed_metadata, launch_metadata, enter_hook, exit_hook, *args)``), checked on the Triton versions in
:data:`FAST_TRITON`. Elsewhere, under the CPU interpreter, with launch hooks installed (profilers) or with
``SPARSE_MLA_FAST_LAUNCH=0``, a :class:`Launch` makes the ordinary JIT call.
"""
from __future__ import annotations

import functools
import os

import torch
import triton

FAST_TRITON = ("3.6.",)  # launcher interface read and checked on an H100 (tests/test_launch.py)

try:
    from triton import knobs as _knobs
except ImportError:  # pragma: no cover - older Triton: no fast path
    _knobs = None


def fast_path_enabled() -> bool:
    """Whether :class:`Launch` may call compiled binaries directly on this Triton."""
    return (_knobs is not None and triton.__version__.startswith(FAST_TRITON)
            and os.environ.get("SPARSE_MLA_FAST_LAUNCH", "1") not in ("", "0"))


def fingerprint(args: tuple) -> tuple:
    """What of ``args`` can change the compiled binary (see the module docstring)."""
    return tuple([(a.dtype, a.data_ptr() & 15 == 0) if isinstance(a, torch.Tensor)
                  else (a == 1, a & 15 == 0, -(1 << 31) <= a < (1 << 31), a >= 1 << 63) if type(a) is int
                  else type(a) for a in args])


def _launch_hooks_installed() -> bool:
    """Whether a profiler hooked kernel launches (Triton 3.6 keeps chains of hooks, empty by default)."""
    return any(bool(getattr(hook, "calls", hook))
               for hook in (_knobs.runtime.launch_enter_hook, _knobs.runtime.launch_exit_hook))


class Launch:
    """One kernel with fixed constexprs and launch options, launched as ``launch(grid, *args)``.

    kernel: a ``@triton.jit`` or ``@gluon.jit`` function whose constexpr parameters all come after its
    runtime parameters. constexprs: a value for each constexpr parameter (by name). options: launch options
    such as ``num_warps`` / ``num_stages``. ``args`` are the runtime arguments in order. Returns the compiled
    kernel (the JIT call's return value) or None when the direct path ran.
    """

    def __init__(self, kernel, constexprs: dict, options: dict | None = None) -> None:
        self.kernel = kernel
        self.kwargs = {**constexprs, **(options or {})}
        self._binaries: dict[tuple, object] = {}
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
        if not self._fast or args[0].device.type != "cuda" or _launch_hooks_installed():
            return self.kernel[grid](*args, **self.kwargs)
        device = torch.cuda.current_device()  # where the JIT call compiles, loads and launches
        key = (device, fingerprint(args))
        binary = self._binaries.get(key)
        if binary is None:
            binary = self.kernel[grid](*args, **self.kwargs)  # compiles (or finds) and launches
            self._binaries[key] = binary
            return binary
        stream = torch._C._cuda_getCurrentRawStream(device)
        binary.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1, stream,
                   binary.function, binary.packed_metadata, None, None, None, *args, *self.constexpr_values)
        return None


@functools.lru_cache(maxsize=512)
def cached_launch(kernel, constexprs: tuple, options: tuple = ()) -> Launch:
    """The shared :class:`Launch` of ``kernel`` for ``constexprs`` / ``options`` given as ``(name, value)`` pairs."""
    return Launch(kernel, dict(constexprs), dict(options))
