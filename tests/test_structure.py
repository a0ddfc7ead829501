"""The tree's shape: no import cycle between the package's modules, no module past 400 lines, no
third-party source in the tree, the runtime never importing the benchmarks, and the tests in folders
beside the code with their shared helpers in tests/helpers/. Imports are read from the source (every
import statement, also those inside functions and under ``TYPE_CHECKING``), so a cycle cannot hide
behind a lazy import."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "python" / "stagewise"
MAX_LINES = 400
EXTENSIONS = {"stagewise._C"}
"""Compiled modules of the package (no Python source, no imports of their own)."""
BENCH = "stagewise.bench"
BENCH_ROUTES = {"stagewise.cli.bench", "stagewise.cli.plan"}
"""The commands that hand over to the benchmarks (``stagewise bench``, ``stagewise plan validate``)."""


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """The package's modules that ``path`` imports: ``from pkg import sub`` counts as ``pkg.sub``
    when ``sub`` is a module, as ``pkg`` (its ``__init__``) otherwise."""
    tree = ast.parse(path.read_text(), str(path))
    is_package = path.name == "__init__.py"
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in modules}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in EXTENSIONS:
                    continue
                if sub in modules:
                    out.add(sub)
                elif base in modules:
                    out.add(base)
    out.discard(name)
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
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
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_import_reader_finds_a_cycle(tmp_path):
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    modules = _modules()
    graph = {name: _imports(path, name, modules) for name, path in modules.items()}
    assert graph["stagewise.api"], "the import reader found nothing: it is broken"
    cycles = _cycles(graph)
    details = [" -> ".join(c) + ": " + "; ".join(f"{m} imports {sorted(graph[m] & set(c))}" for m in c)
               for c in cycles]
    assert not cycles, "import cycles:\n" + "\n".join(details)


def test_no_module_is_longer_than_400_lines():
    long = {str(p.relative_to(ROOT)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split them by responsibility): {long}"


def test_the_tree_holds_no_third_party_source():
    vendored = [str(p.relative_to(ROOT)) for top in ("csrc", "include", "python")
                for p in (ROOT / top).rglob("*") if p.is_dir() and p.name in ("third_party", "vendor", "external")]
    assert not vendored, f"third-party source in the tree: {vendored}"


def _in_bench(name: str) -> bool:
    return name == BENCH or name.startswith(BENCH + ".")


def test_the_runtime_never_imports_the_benchmarks():
    """The benchmarks measure the runtime; nothing of the runtime may need them (what both need,
    such as the timers and a node's profile, lives in the runtime: ``stagewise.measure``)."""
    modules = _modules()
    assert BENCH_ROUTES <= set(modules), f"the routing commands moved: {sorted(BENCH_ROUTES - set(modules))}"
    found = {name: sorted(m for m in _imports(path, name, modules) if _in_bench(m))
             for name, path in modules.items() if not _in_bench(name) and name not in BENCH_ROUTES}
    found = {name: bench for name, bench in found.items() if bench}
    assert not found, f"runtime modules importing the benchmarks: {found}"



TESTS = ROOT / "tests"


def test_the_tests_are_a_package_of_folders_beside_the_code():
    """A test file sits in the folder of the package it tests (``tests/<package>/``; ``tests/docs/``
    for the documentation), what tests share sits in ``tests/helpers/``, and a test imports
    ``stagewise`` and ``helpers``, never another test file."""
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and not p.name.startswith("_")}
    misplaced, imports = [], []
    for path in TESTS.rglob("*.py"):
        rel = path.relative_to(TESTS)
        if rel.parts[0] == "helpers" or rel.name in ("conftest.py", "test_structure.py"):
            pass
        elif len(rel.parts) != 2 or rel.parts[0] not in folders | {"docs"} or not rel.name.startswith("test_"):
            misplaced.append(str(rel))
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            imports += [f"{rel}: {n}" for n in names if n.split(".")[0].startswith(("test_", "conftest", "tests"))]
    assert not misplaced, f"test files outside tests/<package>/test_*.py or tests/helpers/: {sorted(misplaced)}"
    assert not imports, f"tests importing other test files (move what they share to tests/helpers/): {imports}"
