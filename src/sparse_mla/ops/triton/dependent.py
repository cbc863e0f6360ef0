"""Programmatic dependent launch (PDL, NVIDIA sm_90 and later) for a chain of kernels that each read what the one
before wrote: the indexer's query prep, scores and select.

A kernel launched as a programmatic dependent may start — its programs resident, its prologue issued — while the
kernel before it in the stream is still finishing, instead of after it has drained and the launch has gone through.
Each such kernel calls :func:`wait_for_previous` first: ``griddepcontrol.wait`` blocks until the previous kernel has
completed and its memory is visible, before the kernel reads or writes anything; then
``griddepcontrol.launch_dependents`` lets the next dependent start as early. A previous kernel that is no dependent
itself (any other kernel) completed only after *its* predecessors, so the wait orders a kernel after everything
before it in the stream. A kernel launched plainly after a dependent waits for it as always. CUDA graphs keep the
dependency (stream capture records it as a programmatic edge).

An H200 (docs/history.md version 36, benchmarks/results/probe_group_bound-h200-v36.json), the indexer layer as
CUDA-graph replays, plain against dependent launches alternating in one process: V4-Flash B 32 37.6 -> 36.3 us,
B 128 81.8 -> 80.1, V4-Pro B 32 38.2 -> 36.8, V4.1-Flash B 128 136.2 -> 135.1; a 4K prefill chunk unchanged
(1,060 us). The picks are the same bits.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...env import switch_on
from .. import targets
from ..dispatch import interpreting

try:  # griddepcontrol in Triton's language, with its launch_pdl option: not in every Triton the library takes (3.2 up)
    from triton.language.extra.cuda import gdc_wait  # noqa: F401
    TRITON_HAS_DEPENDENT_LAUNCH = True
except ImportError:  # pragma: no cover - an older Triton: plain launches
    TRITON_HAS_DEPENDENT_LAUNCH = False


@triton.jit
def wait_for_previous(DEPENDENT: tl.constexpr):
    """First in a kernel launched with :func:`launch_options`' ``DEPENDENT``: wait for the previous kernel's completion
    (and its writes), then let the next dependent kernel start. Nothing where ``DEPENDENT`` is off."""
    if DEPENDENT:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


def launch_options(device: torch.device) -> dict[str, bool]:
    """The constexpr and launch option of a kernel that starts with :func:`wait_for_previous`, on ``device``:
    launched as a programmatic dependent where its target has them (:attr:`targets.Target.dependent_launch`), the
    installed Triton can say so, not under the interpreter, and ``SPARSE_MLA_DEPENDENT_LAUNCH`` is not ``0``."""
    if (TRITON_HAS_DEPENDENT_LAUNCH and targets.target_of(device).dependent_launch and not interpreting()
            and switch_on("SPARSE_MLA_DEPENDENT_LAUNCH", default=True)):
        return {"DEPENDENT": True, "launch_pdl": True}
    return {"DEPENDENT": False}
