"""Test set-up: without a CUDA device, Triton kernels run in Triton's CPU interpreter; Hypothesis profiles.

The variable must be set before any module defining a ``@triton.jit`` kernel is imported. The interpreter is made to
patch ``triton.language`` once per launch, not again at each helper call (``interpreter_patch_once.py``: most of an
interpreted test's time).

Hypothesis profiles, chosen by ``HYPOTHESIS_PROFILE``: ``ci`` (the default: few examples, for CI's two cores) and
``thorough`` (many examples; nightly, before a release, or after changing a kernel: ``HYPOTHESIS_PROFILE=thorough
make test``). Property tests take their example counts from the profile; one that needs more than the profile's
count scales it (``helpers.examples(n)``).

``@needs("gpu" | "hopper" | "gluon" | "flash_mla" | "transformers")`` (helpers.py): what a test needs. Missing
hardware skips it; missing software on a machine with a CUDA GPU fails it, naming what is missing, unless
``SPARSE_MLA_EXPECT_MISSING`` lists it (``helpers.requirement`` decides).

``SPARSE_MLA_LOWERING=sm80`` (or sm86, sm89; on an NVIDIA GPU): every kernel of the session is lowered as for that
target and assembled for the real GPU (``targets.lower_as``), and the library plans for that target — how
``tests/test_lowerings.py`` runs the other targets' code on the H100 (``GPU_TESTS=lowerings``, gpu_check.sh).
"""
import os
import sys

import pytest
import torch
from hypothesis import HealthCheck, settings

sys.path.insert(0, os.path.dirname(__file__))  # tests import their helpers (helpers.py, dense.py) by name

from sparse_mla.env import env_value  # noqa: E402  (imports no kernel module)

LOWERING_ARCH = env_value("SPARSE_MLA_LOWERING")  # a ValueError naming it for a value outside sm80 / sm86 / sm89
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    import interpreter_patch_once  # noqa: E402

    interpreter_patch_once.install()  # a helper call inside a kernel skips the interpreter's redundant re-patch
elif LOWERING_ARCH:
    from sparse_mla.ops.targets import lower_as

    # for the whole session, before any kernel is compiled (plans and launches keep what they compiled); the context
    # manager is kept alive: a dropped generator closes, and its exit would undo the lowering
    LOWERING = lower_as(LOWERING_ARCH)
    LOWERED_AS = LOWERING.__enter__()

settings.register_profile("ci", max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(autouse=True)
def _interpreter_setting_kept(request):
    """A test that leaves ``TRITON_INTERPRET`` changed would send every later test of its worker down another path
    (the ops read it per call): fail the test that did it, by name."""
    before = os.environ.get("TRITON_INTERPRET")
    yield
    after = os.environ.get("TRITON_INTERPRET")
    assert after == before, f"{request.node.nodeid} changed TRITON_INTERPRET {before!r} -> {after!r}"


# the longest tests on the CPU (each a child compiling kernels for a target, 10-90 s), run first: with `make test`'s
# `--dist worksteal` a worker that runs out steals queued tests from the other, so a long test started last would
# leave the other worker idle until it ends
LONGEST_FIRST = ("tests/test_portability.py::test_every_launched_variant_compiles_and_fits",
                 "tests/test_compressor_portability.py::", "tests/test_indexer_triton.py::test_indexer_kernel_compiles",
                 "tests/test_portability.py::test_the_gluon_kernel_compiles")


def _run_rank(item) -> int:
    """Where ``item`` runs: the position of its prefix in :data:`LONGEST_FIRST`, after them the rest."""
    return next((i for i, prefix in enumerate(LONGEST_FIRST) if item.nodeid.startswith(prefix)), len(LONGEST_FIRST))


def pytest_collection_modifyitems(items):
    """A test whose ``needs`` cannot be met here and may be skipped gets a skip mark (so that a collection sees it:
    tests/test_gpu_subsets.py); one that must fail fails at its set-up. The longest tests go first
    (:data:`LONGEST_FIRST`; the sort is stable, so the others keep their order)."""
    from helpers import requirement  # after the interpreter's setting above: helpers imports the kernels

    items.sort(key=_run_rank)
    for item in items:
        for mark in item.iter_markers("needs"):
            verdict = requirement(*mark.args)
            if verdict is not None and verdict[0] == "skip":
                item.add_marker(pytest.mark.skip(reason=verdict[1]))


def pytest_runtest_setup(item):
    from helpers import requirement

    for mark in item.iter_markers("needs"):
        verdict = requirement(*mark.args)
        if verdict is not None and verdict[0] == "fail":
            pytest.fail(f"missing: {verdict[1]}", pytrace=False)
