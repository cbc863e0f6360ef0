"""No import cycles among the modules of ``src/sparse_mla``, every module importable on its own, and no serving
module pulling in the command line's or the benchmarks' libraries (rich, matplotlib).

Two checks, because each misses what the other sees:

* Static: the graph of the package's own imports, read with ``ast``, has no cycle. Every import statement that
  can run is an edge, a lazy one inside a function included: a cycle through a function-level import still
  means two modules each need the other (one job split over two files), and it is how this package's cycles
  hid (``ops/dispatch -> gluon_attention -> order -> dispatch`` and ``layer <-> plan`` went through imports
  inside functions; on the tree of commit c42a3cb this test names both). Not edges: imports under
  ``if TYPE_CHECKING:`` (they never run; annotations may name each other's types), the lazy
  ``importlib.import_module`` of ``sparse_mla.__getattr__``, and a submodule's implicit import of the packages
  above it (``from . import x`` naming a package's own attribute, not a submodule, is an edge to the package).
  ``from .x import y`` is an edge to ``x``, to ``x.y`` when that is a module, and to the packages between.
* Dynamic: each module imported first, alone, in a process where no ``sparse_mla`` module has been imported
  (a child forked from an interpreter that imported only torch, triton and numpy, so ~45 modules take seconds,
  not a torch import each): catches what the static graph cannot, e.g. a name used before its module defined it,
  and which modules pull in rich or matplotlib (only the command line may: a serving engine never needs them).
"""
from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src"
PACKAGE = SRC / "sparse_mla"
# modules that may import these at import time: the command line prints rich tables
MAY_IMPORT = {"rich": {"sparse_mla.cli"}, "matplotlib": set()}


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _running_imports(body: list[ast.stmt], at_import: bool = False):
    """The import statements of ``body`` that can run: all but those under ``if TYPE_CHECKING:`` (at_import: only
    those that run when the module is imported, not those inside functions)."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from _running_imports(node.orelse, at_import)
        elif at_import and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        else:
            for field in ("body", "orelse", "finalbody", "handlers", "cases"):
                for child in getattr(node, field, None) or []:
                    yield from _running_imports(getattr(child, "body", None) if not isinstance(child, ast.stmt)
                                                else [child], at_import)


def _nearest_module(dotted: str, modules: set[str]) -> str:
    """``dotted`` if it is one of ``modules``, else its nearest enclosing package that is ('' if none)."""
    while dotted and dotted not in modules:
        dotted = dotted.rpartition(".")[0]
    return dotted


def import_edges(name: str, path: Path, modules: set[str], at_import: bool = False) -> set[str]:
    """The modules among ``modules`` that importing ``name`` (source ``path``) imports directly: each imported
    module and the packages above it (Python imports those first), except the packages above ``name`` itself
    (they are being imported already) unless a statement names them (``from . import x`` where ``x`` is a name
    of the package, not a submodule: it needs the package's ``__init__`` to have run that far). at_import: only the
    imports that run when ``name`` is imported (not those inside its functions)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets = []
    for node in _running_imports(ast.parse(path.read_text(), str(path)).body, at_import):
        if isinstance(node, ast.Import):
            targets += [alias.name for alias in node.names]
            continue
        stem = node.module or ""
        if node.level:
            base = package.split(".")
            stem = ".".join(base[:len(base) - (node.level - 1)] + ([node.module] if node.module else []))
        targets += [f"{stem}.{alias.name}" if f"{stem}.{alias.name}" in modules else stem for alias in node.names]
    edges = set()
    for target in targets:
        target = _nearest_module(target, modules)
        chain = [target]
        while chain[-1]:
            chain.append(_nearest_module(chain[-1].rpartition(".")[0], modules))
        for i, module in enumerate(chain[:-1]):
            implicit_ancestor = i > 0 and name.startswith(module + ".")
            if module != name and not implicit_ancestor:
                edges.add(module)
    return edges


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (as a path that returns to its start) per strongly connected component with more than one module
    or a self-edge (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph.get(v, ()):
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_cycle_through(graph, set(c)) for c in components]


def _cycle_through(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A path ``a -> ... -> a`` inside ``component`` (breadth first from its first module: a shortest one)."""
    start = min(component)
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & component):
                if w == start:
                    path = [v]  # back from v to start, then reversed
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return [*reversed(path), start]
                if w not in parents:
                    parents[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle in {component}")


def test_the_cycle_finder_finds_cycles_and_only_cycles():
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": {"a"}}) == [["a", "a"]]


def test_the_import_graph_reads_relative_imports(tmp_path):
    """The edges of a known file: every relative import that can run (a function's too), not a type-only one."""
    source = textwrap.dedent("""
        from typing import TYPE_CHECKING
        from . import config
        from .ops import dispatch
        from .formats import get_format
        try:
            from .cache import PagedCache
        except ImportError:
            pass
        if TYPE_CHECKING:
            from .layer import SparseMLAAttention
        def later():
            from .plan import fill_workspace
        """)
    path = tmp_path / "probe.py"
    path.write_text(source)
    modules = {"sparse_mla", "sparse_mla.probe", "sparse_mla.config", "sparse_mla.ops", "sparse_mla.ops.dispatch",
               "sparse_mla.formats", "sparse_mla.cache", "sparse_mla.layer", "sparse_mla.plan"}
    assert import_edges("sparse_mla.probe", path, modules) == {"sparse_mla.config", "sparse_mla.ops",
                                                               "sparse_mla.ops.dispatch", "sparse_mla.formats",
                                                               "sparse_mla.cache", "sparse_mla.plan"}
    # inside a subpackage: a sibling submodule is an edge, the package above only when a name is taken from it
    inner = tmp_path / "inner.py"
    inner.write_text("from . import dispatch\nfrom .. import config\n")
    assert import_edges("sparse_mla.ops.inner", inner, modules | {"sparse_mla.ops.inner"}) == {
        "sparse_mla.ops.dispatch", "sparse_mla.config"}
    inner.write_text("from . import sparse_attention_decode\n")
    assert import_edges("sparse_mla.ops.inner", inner, modules | {"sparse_mla.ops.inner"}) == {"sparse_mla.ops"}


def test_no_import_cycles():
    graph = {name: import_edges(name, path, set(MODULES)) for name, path in MODULES.items()}
    cycles = find_cycles(graph)
    assert not cycles, "import cycles (module-level imports):\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_token_order_loads_no_attention_or_gluon_kernel_module():
    """``ops/order.py`` needs the GPU kernels' key block and its own rank kernel: what it imports at import time, and
    what those import in turn, holds no module that defines a kernel but ``ops/triton/index.py`` (the rank kernel's)
    — not the Gluon package's kernel modules, which it once loaded all of for one constant."""
    modules = set(MODULES)
    seen, todo = set(), ["sparse_mla.ops.order"]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo += import_edges(name, MODULES[name], modules, at_import=True)
    kernels = {name for name in seen if re.search(r"^\s*@(triton|gluon)\.jit", MODULES[name].read_text(), re.M)}
    assert kernels == {"sparse_mla.ops.triton.index"}, sorted(seen)
    assert "sparse_mla.ops.gluon.host" in seen  # the key block's module is reached: the walk follows the imports


IMPORT_EACH = """
import json, os, sys, tempfile, traceback
import numpy, torch
try:
    import triton  # noqa: F401  (a CPU torch without Triton still imports the package)
except ImportError:
    pass
assert not [m for m in sys.modules if m.split(".")[0] in ("sparse_mla", "rich", "matplotlib")], "preloaded"
modules, out = json.loads(sys.argv[1]), tempfile.mkdtemp()
results = {}


def child(name):
    try:
        import importlib
        importlib.import_module(name)
        loaded = sorted({m.split(".")[0] for m in sys.modules} & {"rich", "matplotlib"})
        result = {"error": None, "loaded": loaded}
    except BaseException:
        result = {"error": traceback.format_exc(), "loaded": []}
    with open(os.path.join(out, name), "w") as f:
        json.dump(result, f)
    os._exit(0)


running = {}
for name in modules + [None] * os.cpu_count():
    while running and (name is None or len(running) >= os.cpu_count()):
        pid, _ = os.wait()
        running.pop(pid, None)
    if name is None:
        continue
    pid = os.fork()
    if pid == 0:
        child(name)
    running[pid] = name
for name in modules:
    path = os.path.join(out, name)
    results[name] = json.load(open(path)) if os.path.exists(path) else {"error": "child died", "loaded": []}
print(json.dumps(results))
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="forks a child per module")
def test_each_module_imports_alone_and_serving_modules_load_no_cli_libraries():
    done = subprocess.run([sys.executable, "-c", IMPORT_EACH, json.dumps(sorted(MODULES))], capture_output=True,
                          text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(SRC)})
    assert done.returncode == 0, done.stderr
    results = json.loads(done.stdout.strip().splitlines()[-1])
    failed = {name: r["error"] for name, r in results.items() if r["error"]}
    assert not failed, "modules that fail to import alone:\n" + "\n".join(f"{n}:\n{e}" for n, e in failed.items())
    for library, allowed in MAY_IMPORT.items():
        offenders = sorted(name for name, r in results.items() if library in r["loaded"] and name not in allowed)
        assert not offenders, f"{library} imported at import time by {offenders}"
