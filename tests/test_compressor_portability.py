"""The compressor kernels in the cross-target matrix (issue 49): every launch of the compressors, their state update
and the indexer key insert cross-compiled on this CPU for each of the 11 targets of ``targets.MATRIX``
(``tests/compressor_compile.py``, through ``scripts/portability_report.py``'s compiler and checks): each compiles,
fits the target's shared memory (LDS), and spills nothing (CUDA: no spill bytes; AMD: no spilled VGPRs / SGPRs)."""
from __future__ import annotations

import json
import pathlib

import pytest

from helpers import compile_child
from sparse_mla.ops import targets

ROOT = pathlib.Path(__file__).resolve().parent.parent
KERNELS = {"_compress_kernel", "_state_kernel", "_index_insert_kernel"}


@pytest.mark.parametrize("target", [t.name for t in targets.MATRIX])
def test_compressor_kernels_compile_fit_and_do_not_spill(target):
    done = compile_child("tests/compressor_compile.py", "--target", target)
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert rows and done.returncode == 0, f"exit {done.returncode}: {done.stderr[-2000:]}"
    assert {r["kernel"] for r in rows} == KERNELS
    assert {r["variant"].split(" d")[0] for r in rows if r["kernel"] == "_compress_kernel"} == {
        "compress r4", "compress r128", "compress r2", "compress r1"}
    failed = [f"{r['variant']} ({r['kernel']}): {r['error']}" for r in rows if r["status"] != "ok"]
    assert not failed, f"{target}: " + "; ".join(failed)
    spills = {f"{r['variant']} {r['kernel']}": (r["spill_stores"], r["spill_loads"]) for r in rows
              if r["spill_stores"] or r["spill_loads"]}
    assert spills == {}, f"{target}: {spills}"
