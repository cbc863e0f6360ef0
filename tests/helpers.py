"""Helpers shared by the test files: the device the tests run on, size tables, error measures, random inputs, what a
test needs beyond the CPU (``needs``), property tests' example counts (``examples``)."""
from __future__ import annotations

import importlib
import os
import pathlib
import subprocess
import sys
from typing import TypeVar

import pytest
import torch

from sparse_mla import verify
from sparse_mla.integrations.transformers import SUPPORTED_TRANSFORMERS

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
# Triton kernels run on a GPU, or on the CPU in Triton's interpreter (tests/conftest.py switches it on)
KERNEL_RUNS = ON_GPU or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
T = TypeVar("T")


def sized(cpu: T, cuda: T) -> T:
    """A size table's entry for this machine: ``cpu`` (interpreter-sized) or ``cuda`` (serving-sized)."""
    return cuda if ON_GPU else cpu


rel_err = verify.rel_err


def random_scope(gen: torch.Generator, fmt: str, dim: int, num_tokens: int, width: int, num_blocks: int,
                 block_size: int, lens_mode: str = "random"):
    """:func:`sparse_mla.verify.random_scope` on :data:`DEVICE`."""
    return verify.random_scope(gen, fmt, dim, num_tokens, width, num_blocks, block_size, DEVICE, lens_mode)


def random_sink(gen: torch.Generator, num_heads: int) -> torch.Tensor:
    """:func:`sparse_mla.verify.random_sink` on :data:`DEVICE`."""
    return verify.random_sink(gen, num_heads, DEVICE)


def check_close(got, ref) -> None:
    """An attention op's ``(out, lse)`` against the reference's: no NaN, rel err < 1e-2, ``+inf`` LSE exactly on
    the rows with no key (whose output is 0), LSE close elsewhere."""
    (out, lse), (ref_out, ref_lse) = got, ref
    assert not out.isnan().any(), "NaN in the kernel's output"
    assert rel_err(out, ref_out) < 1e-2
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isinf(lse) & (lse > 0), ~finite), "+inf LSE exactly on the rows with no key"
    assert torch.allclose(lse[finite], ref_lse[finite], atol=2e-3, rtol=1e-3)
    assert (out[~finite] == 0).all()


# ---------------------------------------------------------------------------------------------------------------
# What a test needs beyond the CPU (the ``needs`` mark, ``@needs("gluon")``; tests/conftest.py applies it). Missing
# hardware is a skip: a subset of scripts/gpu_check.sh runs the test on a machine that has it. Missing software on a
# machine with a CUDA GPU is a failure naming it, so that a GPU run cannot go green without having tested it, unless
# the run lists it in SPARSE_MLA_EXPECT_MISSING (comma-separated names, e.g. ``flash_mla,gluon``); on a CPU, a skip.
HARDWARE = ("gpu", "hopper")  # the others (gluon, flash_mla, transformers: _MISSING's keys) are software
# software that runs on some hardware alone: without that hardware (a lowering's target counts) a skip, as for the
# hardware's own tests; with it, missing software fails as any other
RUNS_ON = {"gluon": "hopper"}



def _hopper_missing() -> str | None:
    if not ON_GPU or torch.version.hip is not None:
        return "needs an NVIDIA Hopper GPU (sm_90)"
    from sparse_mla.ops import targets

    target = targets.target_of(torch.device("cuda"))  # a lowering's (SPARSE_MLA_LOWERING) target, not the GPU's
    return None if target.hopper else f"needs an NVIDIA Hopper GPU (sm_90), the kernels' target is {target.name}"


def _gluon_missing() -> str | None:
    import triton

    from sparse_mla.ops import gluon

    if gluon.gluon is None:
        return f"the Gluon kernel: Triton {triton.__version__} has no Gluon"
    if not gluon.enabled():
        return (f"the Gluon kernel: off (Triton {triton.__version__}, validated {gluon.VALIDATED_TRITON}, "
                f"SPARSE_MLA_GLUON={os.environ.get('SPARSE_MLA_GLUON', '')!r})")
    return None


def _flash_mla_missing() -> str | None:
    try:
        import flash_mla  # noqa: F401
    except ImportError as e:
        return f"the FlashMLA wheel (flash_mla) does not import: {e}"
    return None


def _transformers_missing() -> str | None:
    try:
        import transformers
    except ImportError as e:
        return f"transformers does not import: {e}"
    if transformers.__version__ not in SUPPORTED_TRANSFORMERS:  # the releases the integration supports
        return f"transformers {' or '.join(SUPPORTED_TRANSFORMERS)} (found {transformers.__version__})"
    return None


_MISSING = {"gpu": lambda: None if ON_GPU else "needs a CUDA GPU", "hopper": _hopper_missing,
            "gluon": _gluon_missing, "flash_mla": _flash_mla_missing,
            "transformers": _transformers_missing}


def expected_missing() -> frozenset[str]:
    """The software this run accepts as missing: ``SPARSE_MLA_EXPECT_MISSING``'s names."""
    return frozenset(n.strip() for n in os.environ.get("SPARSE_MLA_EXPECT_MISSING", "").split(",") if n.strip())


def _check_names(deps: tuple[str, ...]) -> None:
    unknown = set(deps) - set(_MISSING)
    if unknown:
        raise ValueError(f"needs: unknown dependencies {sorted(unknown)}; known: {sorted(_MISSING)}")


def requirement(*deps: str) -> tuple[str, str] | None:
    """What becomes of a test needing ``deps`` (keys of ``_MISSING``) here: None (it runs), or ``("skip" | "fail",
    why)`` for the first one missing."""
    _check_names(deps)
    for dep in deps:
        why = _MISSING[RUNS_ON[dep]]() if dep in RUNS_ON else None
        if why is not None:
            return "skip", f"{why} (a subset of scripts/gpu_check.sh runs it)"
        why = _MISSING[dep]()
        if why is None:
            continue
        if dep in HARDWARE or not ON_GPU:
            return "skip", f"{why} (a subset of scripts/gpu_check.sh runs it)"
        if dep in expected_missing():
            return "skip", f"{why} (this run expects it: SPARSE_MLA_EXPECT_MISSING)"
        return "fail", f"{why}; a GPU run needs it (or lists {dep!r} in SPARSE_MLA_EXPECT_MISSING)"
    return None


def needs(*deps: str) -> pytest.MarkDecorator:
    """The mark of a test (or, as ``pytestmark``, a module) that needs ``deps``; see :func:`requirement`."""
    _check_names(deps)
    return pytest.mark.needs(*deps)


def optional_import(name: str):
    """Module ``name``, or None where it does not import (a test module's top: the ``needs`` mark reports why)."""
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def examples(n: int) -> int:
    """A property test's example count: ``n`` under the ``ci`` profile, scaled as the loaded Hypothesis profile
    scales ``ci``'s count (tests/conftest.py), so that ``thorough`` runs each test that many times more."""
    from hypothesis import settings

    return max(1, round(n * settings.default.max_examples / settings.get_profile("ci").max_examples))


SINK_CHANGES = ("data", "resize", "wide")  # how repoint_sink changes a layer's sink under it


def repoint_sink(layer, change: str) -> None:
    """Change a layer's 4-head sink without its setter, keeping the buffer's tensor object: ``"data"`` (2 values,
    ``sink.data = ...``), ``"resize"`` (``sink.resize_(2)``) or ``"wide"`` (64 values, as a whole model's sink on a
    shard)."""
    device = layer.sink.device
    if change == "data":
        layer.sink.data = torch.zeros(2, device=device)
    elif change == "resize":
        layer.sink.resize_(2)
    else:
        layer.sink.data = torch.zeros(64, device=device)


ROOT = pathlib.Path(__file__).resolve().parent.parent


def compile_child(script: str, *args: str, timeout: int = 900, first_on_path: pathlib.Path | None = None,
                  env_vars: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``python script args…`` (a path from the repo root) in a child process that compiles kernels: with the
    interpreter off, no lowering (a cross-compile names its own target; ``SPARSE_MLA_LOWERING``'s override of
    Triton's arch, inherited, would turn every target into the lowered one — AMD's then fail to parse it) and the
    repo's ``src`` and ``tests`` first on the path (after ``first_on_path``: another Triton's install folder, say),
    and ``env_vars`` set. Its output captured as text."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("TRITON_INTERPRET", "TRITON_OVERRIDE_ARCH", "SPARSE_MLA_LOWERING")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [first_on_path and str(first_on_path), str(ROOT / "src"),
                                                      str(ROOT / "tests"), env.get("PYTHONPATH")]))
    env.update(env_vars or {})
    return subprocess.run([sys.executable, str(ROOT / script), *args], env=env, capture_output=True, text=True,
                          timeout=timeout)
