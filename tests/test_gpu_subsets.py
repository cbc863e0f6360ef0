"""Every test runs somewhere: each test that skips on a CPU is named by a GPU subset of ``scripts/gpu_check.sh``
(``scripts/gpu_subsets.txt``), whose ``--help`` and docs/checks.md name every subset; and a GPU run that lacks what a
test needs fails, naming it, unless the run says it expects it (``helpers.requirement``).

The suite is collected in a child process (``pytest --collect-only``, with tests/conftest.py's ``needs`` marks
applied); a test counts as skipped on the CPU when its skip marks say so here or its module skips at collection. A
skip called from inside a test body is invisible to a collection: a file that does so must be named whole.
"""
from __future__ import annotations

import ast
import fnmatch
import json
import pathlib
import subprocess
import sys

import pytest

import helpers
from helpers import ON_GPU

ROOT = pathlib.Path(__file__).resolve().parent.parent
SUBSETS = ROOT / "scripts" / "gpu_subsets.txt"
pytestmark = pytest.mark.skipif(ON_GPU, reason="checks what skips on a CPU (CI's machine)")

# the child: collect the suite; write {"items": {node id: skip reason or None}, "modules": {node id: reason}}
COLLECT = """
import json, sys
import pytest
from _pytest.skipping import evaluate_skip_marks

class Skips:
    def __init__(self):
        self.items, self.modules = {}, {}

    def pytest_collectreport(self, report):
        if report.skipped:
            self.modules[report.nodeid] = str(report.longrepr)

    @pytest.hookimpl(trylast=True)  # after tests/conftest.py's: its `needs` marks become skip marks
    def pytest_collection_modifyitems(self, items):
        for item in items:
            skip = evaluate_skip_marks(item)
            self.items[item.nodeid] = None if skip is None else skip.reason

skips = Skips()
code = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", "tests"], plugins=[skips])
json.dump({"code": int(code), "items": skips.items, "modules": skips.modules}, open(sys.argv[1], "w"))
"""


def subsets() -> dict[str, list[str]]:
    """scripts/gpu_subsets.txt: each subset's tests as written (files, globs of files, node ids)."""
    found: dict[str, list[str]] = {}
    for line in SUBSETS.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, test = line.split()
            found.setdefault(name, []).append(test)
    return found


def covers(entry: str, nodeid: str) -> bool:
    """Whether a subset's ``entry`` names the test ``nodeid`` (or, for a module's node id, the whole module)."""
    path, _, name = entry.partition("::")
    file, _, test = nodeid.partition("::")
    if not fnmatch.fnmatchcase(file, path):
        return False
    return not name or test == name or test.startswith((name + "[", name + "::"))


@pytest.fixture(scope="module")
def collected(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("collect") / "skips.json"
    run = subprocess.run([sys.executable, "-c", COLLECT, str(out)], cwd=ROOT, capture_output=True, text=True,
                         timeout=600)
    assert out.exists(), run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["code"] == 0, run.stdout[-3000:]  # the suite collects without errors
    return result


def test_every_test_skipped_on_the_cpu_is_in_a_gpu_subset(collected):
    entries = [e for tests in subsets().values() for e in tests]
    skipped = {n: why for n, why in collected["items"].items() if why is not None}
    assert skipped, "nothing skips on the CPU: the check sees no skip marks"
    unnamed = [f"{n}  ({why})" for n, why in skipped.items() if not any(covers(e, n) for e in entries)]
    unnamed += [f"{n}  (module skipped: {why[-200:]})" for n, why in collected["modules"].items()
                if not any("::" not in e and covers(e, n) for e in entries)]
    assert not unnamed, "GPU-only tests no subset of scripts/gpu_subsets.txt names:\n" + "\n".join(unnamed)


def test_every_subset_entry_names_collected_tests(collected):
    """No stale entry (a renamed file or test, a mistyped id) passes for coverage."""
    nodeids = list(collected["items"]) + list(collected["modules"])
    stale = [f"{name}: {e}" for name, tests in subsets().items() for e in tests
             if not any(covers(e, n) for n in nodeids)]
    assert not stale, "entries of scripts/gpu_subsets.txt that name no collected test:\n" + "\n".join(stale)


def test_a_file_that_skips_inside_a_test_is_named_whole():
    """``pytest.skip(...)`` / ``importorskip`` inside a function skips where a collection cannot see: such a file must
    be named whole by a subset (or mark its tests: ``helpers.needs``, ``pytest.mark.skipif``)."""
    whole = {e for tests in subsets().values() for e in tests if "::" not in e}
    hidden = []
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and any(
                    isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
                    and call.func.attr in ("skip", "importorskip") and isinstance(call.func.value, ast.Name)
                    and call.func.value.id == "pytest" for call in ast.walk(node)):
                rel = f"tests/{path.name}"
                if not any(fnmatch.fnmatchcase(rel, e) for e in whole):
                    hidden.append(f"{rel}::{node.name}")
    assert not hidden, ("tests that skip from inside (mark them instead: helpers.needs(...), pytest.mark.skipif; or "
                        "name their file whole in scripts/gpu_subsets.txt):\n" + "\n".join(hidden))


def test_the_help_and_the_docs_name_every_subset():
    listing = subprocess.run(["bash", "scripts/gpu_check.sh", "--help"], cwd=ROOT, capture_output=True, text=True,
                             timeout=60)
    assert listing.returncode == 0, listing.stderr
    docs = (ROOT / "docs" / "checks.md").read_text()
    for name, tests in subsets().items():
        assert f"GPU_TESTS={name}\n" in listing.stdout
        assert all(f"      {t}\n" in listing.stdout for t in tests), name
        assert f"GPU_TESTS={name}" in docs, f"docs/checks.md's sequence of GPU calls leaves out {name}"


@pytest.mark.parametrize("on_gpu", [False, True])
def test_missing_software_fails_a_gpu_run_unless_expected(monkeypatch, on_gpu):
    monkeypatch.setattr(helpers, "ON_GPU", on_gpu)
    monkeypatch.setitem(helpers._MISSING, "gpu", lambda: None if on_gpu else "needs a CUDA GPU")
    monkeypatch.setitem(helpers._MISSING, "hopper", lambda: "needs an NVIDIA Hopper GPU (sm_90), found sm_80")
    monkeypatch.setitem(helpers._MISSING, "flash_mla", lambda: "no flash_mla here")
    monkeypatch.setitem(helpers._MISSING, "transformers", lambda: None)
    monkeypatch.delenv("SPARSE_MLA_EXPECT_MISSING", raising=False)
    assert helpers.requirement("transformers") is None
    # hardware: a skip wherever it is missing (a subset runs the test where it is not)
    assert helpers.requirement("hopper")[0] == "skip"
    assert helpers.requirement("gpu", "flash_mla") == (
        ("fail", "no flash_mla here; a GPU run needs it (or lists 'flash_mla' in SPARSE_MLA_EXPECT_MISSING)")
        if on_gpu else ("skip", "needs a CUDA GPU (a subset of scripts/gpu_check.sh runs it)"))
    monkeypatch.setenv("SPARSE_MLA_EXPECT_MISSING", "gluon, flash_mla")
    verdict, why = helpers.requirement("flash_mla")
    assert verdict == "skip" and why.startswith("no flash_mla here")
    with pytest.raises(ValueError, match=r"unknown dependencies \['flashmla'\]"):
        helpers.requirement("flashmla")


@pytest.mark.parametrize("hopper", [False, True])
def test_gluon_skips_without_hopper_and_fails_a_hopper_run_that_lacks_it(monkeypatch, hopper):
    """The Gluon kernel runs on Hopper alone: on another target (an sm_80 lowering of an H200 run too) its tests skip
    as the hardware's do; on Hopper a Gluon that is off or missing fails the run unless it expects that."""
    monkeypatch.setattr(helpers, "ON_GPU", True)
    monkeypatch.setitem(helpers._MISSING, "hopper", lambda: None if hopper else "needs Hopper, the target is sm_80")
    monkeypatch.setitem(helpers._MISSING, "gluon", lambda: "the Gluon kernel: off")
    monkeypatch.delenv("SPARSE_MLA_EXPECT_MISSING", raising=False)
    verdict, why = helpers.requirement("gluon")
    assert (verdict, why.split(" (")[0]) == (("fail", "the Gluon kernel: off; a GPU run needs it") if hopper
                                              else ("skip", "needs Hopper, the target is sm_80"))
    monkeypatch.setenv("SPARSE_MLA_EXPECT_MISSING", "gluon")
    assert helpers.requirement("gluon")[0] == "skip"
