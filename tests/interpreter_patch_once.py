"""Triton's CPU interpreter, without re-patching ``triton.language`` at every helper call inside a kernel.

The interpreter runs a launch by swapping ``triton.language``'s builtins for interpreted ones (``_patch_lang``, undone
when the launch ends). It does the same again each time the kernel calls a ``@triton.jit`` helper
(``InterpretedFunction.__call__``), per program: every call scans the language modules with ``inspect.getmembers``
(about 0.2 ms), and finds nothing left to swap, since the launch's own patch already covers the modules a helper
shares with its kernel. In this library's interpreted tests that scan was about 80 % of the time (a V4.1 layer test:
8 of 10 s, 49,000 scans), which CI's two cores pay on every run.

:func:`install` wraps ``_patch_lang`` so that, while a launch's patch is in force, a helper whose language modules
it covers is not patched again; anything else (the launch itself, a helper reaching a module the launch did not
patch, such as ``triton.language.standard``'s helpers reaching ``triton.language.core``: once per launch) goes
through Triton's own function, unchanged. Tests only: the library never runs the interpreter itself.
"""
from __future__ import annotations

import inspect


class _Unpatched:
    """The scope of a patch not made (nothing to restore)."""

    def restore(self) -> None:
        pass


def install() -> bool:
    """Wrap the interpreter's ``_patch_lang`` (once); whether this Triton has the function the wrapper expects."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:  # pragma: no cover - Triton is a dependency
        return False
    patch = getattr(interpreter, "_patch_lang", None)
    if patch is None or getattr(patch, "patched_once", False):
        return patch is not None
    in_force: list[frozenset[int]] = []  # the language modules of the launch whose patch is in force

    def modules_of(fn) -> frozenset[int]:
        return frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))

    def patch_lang(fn):
        modules = modules_of(fn)
        if in_force:  # a helper called inside a running launch: patched only if it reaches a module not patched yet
            if modules <= in_force[-1]:
                return _Unpatched()
            in_force[-1] |= modules  # (Triton never restores a helper's patch either: it stays for the launch)
            return patch(fn)
        scope = patch(fn)  # a launch: patched until its scope is restored
        in_force.append(modules)
        restore = scope.restore

        def restore_and_leave() -> None:
            try:
                restore()
            finally:
                in_force.pop()

        scope.restore = restore_and_leave
        return scope

    patch_lang.patched_once = True
    interpreter._patch_lang = patch_lang
    return True
