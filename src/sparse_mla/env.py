"""The environment variables the library reads, each parsed here: a value outside the documented set is a
``ValueError`` naming the variable and the values it takes (never silently read as unset).

Read at each use (tests and users may change them mid-process), so a read costs an ``os.environ`` lookup and a
tuple compare (~0.3 us).
"""
from __future__ import annotations

import os

# variable -> the values it takes ("" is the same as unset), and what each means (the error message quotes it)
VARIABLES: dict[str, tuple[tuple[str, ...], str]] = {
    "SPARSE_MLA_DEBUG": (("", "0", "1"), "1: the fast kernels also check the values of device tensors (a sync); "
                                         "0 or unset: not"),
    "SPARSE_MLA_GLUON": (("", "0", "1"), "1: force the Hopper Gluon kernel; 0: never use it; unset: where "
                                         "validated"),
    "SPARSE_MLA_FAST_LAUNCH": (("", "0", "1"), "0: launch through Triton's launcher only; 1 or unset: call "
                                               "compiled binaries directly"),
    "SPARSE_MLA_DEPENDENT_LAUNCH": (("", "0", "1"), "0: launch the indexer's kernels plainly; 1 or unset: as "
                                                    "programmatic dependents where the GPU has them (sm_90 and later)"),
    "SPARSE_MLA_LOWERING": (("", "sm80", "sm86", "sm89"), "the GPU tests: lower every kernel as for this NVIDIA "
                                                          "target; unset: natively"),
}


def env_value(name: str) -> str:
    """The value of the library's environment variable ``name`` (``""`` when unset), one of :data:`VARIABLES`'."""
    value = os.environ.get(name, "")
    values, meaning = VARIABLES[name]
    if value not in values:
        shown = ", ".join(repr(v) for v in values if v)
        raise ValueError(f"environment variable {name}={value!r} is not one of {shown} (or unset): {meaning}")
    return value


def switch_on(name: str, default: bool = False) -> bool:
    """An on/off variable of :data:`VARIABLES` (``"0"`` / ``"1"``): whether it is on, ``default`` when unset."""
    value = env_value(name)
    return default if value == "" else value == "1"
