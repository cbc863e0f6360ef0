"""The portability matrix (issue 35): the kernel variants the library launches, cross-compiled on this CPU for every
target of ``targets.MATRIX`` (no GPU), compile and fit: shared memory (LDS) within the target's, on sm_100 the
tensor-memory columns within 512 and no ``trap`` body; registers and spills are printed (``pytest -s``, and a table
under the test's tmp dir). A case a target cannot run must instead be a ``ValueError`` when the call is planned.

The variants are the library's own launches for that target (``scripts/portability_report.py`` records them from
the attention plan made for the target, the cache ops, the index builders and the token order), so the matrix
checks what would really launch. Which run here, to keep CI (``make test`` on two cores) short — an attention
variant takes 2-6 CPU seconds to compile for CUDA and 1-13 for AMD (gfx1100's fp8 ones 2-4 minutes), the other
kernels under one:

* one target per code-generation family — sm_80 (mma.sync, no fp8 instructions), sm_89 (mma.sync with fp8),
  sm_90 (wgmma), sm_100 (tensor memory) and gfx942 (AMD; its fp8 bytes are decoded with integer operations on every
  AMD target) — every group: the decode over each cache format (bf16, fp8_v4, fp8_e4m3 at 512 dims; bf16, fp8_v32
  at 576; V4.1's fp8_v41 window with an fp4_v41 compressed scope, and each page-planar V4.1 layout) and fp8 q, the
  bf16-workspace prefill, ragged and combined lists, split lists and the combine kernel, insert / gather per format
  name (V4.1's four too), the step lists, the compressed picks and the token order: every code path of every
  kernel (the index forms, which change addressing only, on sm_80, sm_90 and gfx942);
* the other targets (sm_86, sm_120, gfx90a, gfx950, gfx1100, gfx1201: a family's code with other limits, or
  RDNA's wave32 dots over the same bf16 tiles) the variants that need the most shared memory (LDS) — the bf16
  decodes at 512 and 576 dims and the prefills, pipelined — and the cache kernels (gfx1100, the first wave32 AMD
  target, the index kernels too); so every target's own launch configuration is compiled and checked against its
  limits.

Every plan counts the target's SMs (``targets.Target.sms``), so the decodes are split as on that GPU and the
combine kernel is compiled with them. The whole matrix (every group on every target):
``python scripts/portability_report.py --ranges``.
"""
from __future__ import annotations

import json
import os
import pathlib
import re
import sys

import pytest
import torch
import triton

from helpers import compile_child
from sparse_mla.formats import get_format
from sparse_mla.ops import attention_plan, gluon, launch_configs, targets
from sparse_mla.verify import SUPPORT_FORMATS, support_markdown

ROOT = pathlib.Path(__file__).resolve().parent.parent
FAMILIES = ("sm_80", "sm_89", "sm_90", "sm_100", "gfx942")  # every group compiled here (the index forms: see FORMS)
# the index forms (ragged, combined lists; the most splits; a pool over 2 GiB) change how keys are addressed, not the
# code generation that tells sm_89 from sm_80 (fp8 instructions) or sm_100 from sm_90 (tensor memory): compiled for
# one target of each generation of instructions (mma.sync, wgmma, AMD)
FORMS = ("sm_80", "sm_90", "gfx942")
V41_NAMES = ("fp8_v41", "fp8_v41_planar", "fp4_v41", "fp4_v41_planar")


def _compile_matrix(target: str, groups: tuple[str, ...]) -> list[dict]:
    """The report's rows for ``target`` and ``groups``, from a child process (compiling needs the interpreter off)."""
    done = compile_child("scripts/portability_report.py", "--json", "--target", target,
                         *[arg for group in groups for arg in ("--variants", group)])
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert rows, f"the report printed no rows (exit {done.returncode}): {done.stderr[-2000:]}"
    return rows


@pytest.mark.parametrize("target", [t.name for t in targets.MATRIX])
def test_every_launched_variant_compiles_and_fits(target, tmp_path, monkeypatch):
    # the report module sets TRITON_INTERPRET=0 when imported (it compiles): restored after this test
    monkeypatch.setenv("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET", "0"))
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from portability_report import Row, table
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    groups = (("formats", "shared", "forms", "cache", "index") if target in FORMS
              else ("formats", "shared", "cache", "index") if target in FAMILIES
              else ("shared", "cache", "index") if target == "gfx1100" else ("shared", "cache"))
    rows = _compile_matrix(target, groups)
    text = table([Row(**r) for r in rows])
    (tmp_path / f"portability_{target}.txt").write_text(text + "\n")
    print(f"\n{text}")
    failed = [f"{r['variant']} ({r['kernel']}): {r['error']}" for r in rows if r["status"] == "failed"]
    assert not failed, f"{target}: " + "; ".join(failed)
    assert {r["variant"].split()[0] for r in rows} >= {"decode", "prefill", "insert", "gather"}
    v41 = {r["variant"] for r in rows if "v41" in r["variant"]}
    assert {f"{op} {fmt} d512" for op in ("insert", "gather") for fmt in V41_NAMES} <= v41, "V4.1's cache kernels"
    # planned at the target's SM count (targets.Target.sms), not the CPU's 4: a split attention launch has its combine
    # kernel, and one token's long list is cut into more pieces than 4 SMs would take (2 for its 2-4 programs)
    attention_splits = {r["variant"]: r["splits"] for r in rows if r["kernel"] == "_sparse_mla_kernel"}
    combine_splits = {r["variant"]: r["splits"] for r in rows if r["kernel"] == "_combine_kernel"}
    assert combine_splits == {v: n for v, n in attention_splits.items() if n > 1}
    if "forms" in groups:
        assert attention_splits["decode bf16 d512, 1 token"] >= 5, attention_splits
    if target.startswith("gfx") and "forms" in groups:  # a pool over 2 GiB: no tt.pointer_range 32, still compiles
        assert "decode fp8_v4 d512, pool > 2 GiB" in attention_splits
    # issue 37's bar: no spill inside the attention key loops of the mma.sync targets nor on CDNA 3 / 4, V4.1's
    # formats included, but for the known one (Target.limits): sm_120's 512-d bf16 row (its ptxas reloads 10-20
    # registers per 64-key block; the spill-free rows, 32-key blocks or 16 heads, were 1.4-1.6x slower under the sm_86
    # lowering)
    known = {("sm_120", "decode bf16 d512"), ("sm_120", "prefill bf16 workspace d512")}
    attention = [r for r in rows if r["kernel"] == "_sparse_mla_kernel" and (target, r["variant"]) not in known]
    if target in ("sm_80", "sm_86", "sm_89", "sm_120"):
        assert {r["variant"]: r["loop_spills"] for r in attention if r["loop_spills"]} == {}
    if target in ("gfx942", "gfx950"):
        assert {r["variant"]: r["spill_stores"] for r in attention if r["spill_stores"]} == {}
    if "formats" in groups:  # every V4.1 kernel code in the attention kernel: fp8 and fp4, each page layout
        assert {"decode fp8_v41+fp4_v41 d512", "decode fp8_v41_planar d512", "decode fp4_v41_planar d512"} <= v41


# the Gluon kernel's four partition sets: V4 / V3.2 rows' copy warpgroup (fp8_v4, persistent programs, a TAIL split),
# V4.1's run-by-run copy (an fp8 window beside an fp4 compressed scope), bf16's paired math warpgroups (576-d) and the
# narrow items (fp8_v32, 16 heads)
GLUON_VARIANTS = {"fp8_v4 persistent tail": ["--fmt", "fp8_v4", "--persistent", "--tail"],
                  "fp8_v41+fp4_v41": ["--fmt", "fp8_v41", "--extra-fmt", "fp4_v41"],
                  "bf16 d576": ["--fmt", "bf16", "--dim", "576"],
                  "fp8_v32 narrow": ["--fmt", "fp8_v32", "--narrow"]}


# the Tritons the Gluon kernel is validated on (gluon.VALIDATED_STACKS) besides the installed one: `make test` installs
# each, --no-deps, into .venv/triton-<version> (Makefile: GLUON_TRITONS), and the kernel is built with it first on the
# path, so that a change to the kernel that breaks one of them fails here, not on a user's Hopper GPU
# (the installed one told apart by gluon.host's own rule: a version is a prefix of triton.__version__ before a ".")
OTHER_TRITONS = sorted({version for _, version in gluon.VALIDATED_STACKS
                        if not triton.__version__.startswith(f"{version}.")})


@pytest.mark.skipif(gluon.gluon is None, reason="this Triton has no Gluon")
@pytest.mark.parametrize("version", [None, *OTHER_TRITONS])
@pytest.mark.parametrize("variant", list(GLUON_VARIANTS))
def test_the_gluon_kernel_compiles_for_sm90_with_each_validated_triton(variant, version):
    """The Hopper kernel builds with the installed Triton (``version`` None) and with each other Triton it is validated
    on (3.6 to 3.9: ``ops/gluon/compat.py`` spells the builtins they renamed): Triton compiles it for sm_90a, ptxas
    assembles it (``scripts/sm90_report.py``) and its shared memory fits sm_90's."""
    folder = None
    if version is not None:
        folder = next(iter(sorted((ROOT / ".venv").glob(f"triton-{version}.*"))), None)
        if folder is None:  # CI runs `make test`, which installs it: its absence there is a failure
            (pytest.fail if os.environ.get("CI") else pytest.skip)(
                f"Triton {version} is not installed in .venv/triton-{version}.* (`make test` installs it: Makefile, "
                f"GLUON_TRITONS)")
    done = compile_child("scripts/sm90_report.py", "--kernel", "gluon", *GLUON_VARIANTS[variant], timeout=600,
                         first_on_path=folder)
    found = re.search(r"registers (\d+) .* shared (\d+) B .*\(Triton (\S+)\)", done.stdout)
    assert done.returncode == 0 and found, f"{variant}: {done.stdout[-500:]} {done.stderr[-2000:]}"
    # the Triton asked for: the installed one, or the other version's
    assert found.group(3) == triton.__version__ if version is None else found.group(3).startswith(f"{version}."), \
        found.group(0)
    print(f"\n{variant}: {done.stdout.splitlines()[0]}")
    sm90 = targets.target_for("cuda", 90)
    assert 0 < int(found.group(1)) <= sm90.registers and int(found.group(2)) <= sm90.shared_bytes


@pytest.mark.parametrize("target", [t.name for t in targets.MATRIX])
def test_a_case_a_target_cannot_run_is_a_value_error_naming_it(target):
    """Each cell the support table lists as unsupported is, for a user, the ValueError of that sentence (raised
    when the call is planned, before any kernel is compiled); a supported cell plans."""
    t = targets.target_for(*next((x.backend, x.arch) for x in targets.MATRIX if x.name == target))
    for fmt, dim in (*SUPPORT_FORMATS, ("fp8_v41", 512), ("fp4_v41_planar", 512)):
        for q_fp8 in (False, True):
            why = launch_configs.unsupported(t, dim, frozenset({fmt}), q_fp8)
            assert (why is None) == (fmt in launch_configs.TRITON_FORMATS)
            plan = lambda: attention_plan.AttentionPlan(  # noqa: E731
                (4, 64, dim), torch.device("cpu"), [(get_format(fmt, dim), 64, 128)], True, False, q_fp8=q_fp8,
                target=t)
            if why is None:
                assert plan().target is t
            else:
                assert t.name in why and (fmt in why or "no format" in why or q_fp8)
                with pytest.raises(ValueError, match=re.escape(why)):
                    plan()


def test_readme_support_table_is_the_code_s():
    """README's support table is :func:`sparse_mla.verify.support_markdown`'s (regenerate it with
    ``python scripts/portability_report.py --support``)."""
    readme = (ROOT / "README.md").read_text()
    assert support_markdown() in readme
    # and its torch / Triton statement names every pair the GPU suite passed on (the list verify prints)
    assert all(f"torch {torch_version} + Triton {triton_version}" in readme
               for torch_version, triton_version in gluon.VALIDATED_STACKS)
