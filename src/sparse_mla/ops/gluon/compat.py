"""The Gluon builtins the kernel calls whose names changed between Triton 3.6 and 3.9, each bound here once to the
installed Triton's spelling, so that the kernel's modules are one text for every version (issue 47).

* :func:`thread_barrier` — a barrier of the CTA's threads: ``gl.thread_barrier`` in 3.6, ``gl.barrier`` from 3.7
  (3.9 has no ``thread_barrier``). Both lower to the same ``gpu.barrier``.
* :func:`async_load` ``(smem, pointers, mask=)`` — a ``cp.async`` gather into shared memory:
  ``async_copy.async_copy_global_to_shared`` through 3.7, ``async_copy.async_load`` from 3.8 (3.9's old name
  raises "call async_load instead").
* :func:`reinterpret` ``(smem, dtype, shape, layout)`` — shared memory viewed as another type:
  ``shared_memory_descriptor._reinterpret`` through 3.8, ``.reinterpret`` in 3.9.

``gl.warp_specialize`` needs no entry: every version takes ``(partitions, worker warps, worker registers)``, 3.7
made the register list optional, and the kernel always passes it. The new spelling wins where a Triton has both.
Each name is a Gluon builtin, which a JIT function may call as a module global. Importing this module raises
``ImportError`` on a Triton that has neither spelling: :mod:`.host`'s guard then turns the Gluon path off.
"""
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.language.core import builtin


def _first(module, *names: str):
    """``module``'s builtin of the first of ``names`` it has (the newest spelling first)."""
    for name in names:
        builtin = getattr(module, name, None)
        if builtin is not None:
            return builtin
    raise ImportError(f"{module.__name__} has none of {', '.join(names)}: a Gluon API this kernel does not know")


thread_barrier = _first(gl, "barrier", "thread_barrier")
async_load = _first(async_copy, "async_load", "async_copy_global_to_shared")
_reinterpret = _first(gl.shared_memory_descriptor, "reinterpret", "_reinterpret")


@builtin
def reinterpret(smem, dtype, shape, layout, _semantic=None):
    """``smem`` (a shared memory descriptor) viewed as ``dtype`` elements of ``shape`` in ``layout``."""
    return _reinterpret(smem, dtype, shape, layout, _semantic=_semantic)


__all__ = ["async_load", "reinterpret", "thread_barrier"]
