"""The package's modules import without circles: the library at the top
never imports a tool, and no two modules need each other, not even through
an import inside a function.

The graph is read from the sources (every ``import`` statement, at any
depth), so a circle that only a late import would close counts too; and
every module is imported first in a fresh interpreter, where a circle of
module-level imports would fail."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import FRESH_PYTHON_S, PYTHON_DIR, subprocess_env

PACKAGE = "ecmooncake"
# The library: what vLLM and users import. It must not reach the tools.
LIBRARY = {"ecmooncake", "ecmooncake._ffi", "ecmooncake.native", "ecmooncake.ec_config", "ecmooncake.plugin",
           "ecmooncake.tokens", "ecmooncake.proxy", "ecmooncake.schema",
           "ecmooncake.errors", "ecmooncake.buffers", "ecmooncake.environment", "ecmooncake.auth",
           "ecmooncake.packed", "ecmooncake.store", "ecmooncake.trace"}


def modules(root: Path) -> dict[str, Path]:
    """Dotted name -> file, for every module of the package under root."""
    out = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports anywhere in its source.

    A module's own parent packages are left out: importing a submodule
    always imports them first, which is no circle of the code's making."""
    known = modules(root)
    graph: dict[str, set[str]] = {name: set() for name in known}
    for name, path in known.items():
        is_package = path.name == "__init__.py"
        parents = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = name.split(".") if is_package else name.split(".")[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module or ""
                targets = [module] + [f"{module}.{alias.name}" for alias in node.names]
            for target in targets:
                # "from pkg import mod" names a module; "from mod import x" the module alone.
                while target and target not in known:
                    target = target.rpartition(".")[0]
                if target and target != name and target not in parents:
                    graph[name].add(target)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_reader_sees_a_circle_closed_inside_a_function(tmp_path):
    pkg = tmp_path / PACKAGE
    (pkg / "tools").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "tools" / "__init__.py").write_text("")
    (pkg / "tools" / "a.py").write_text("from . import b\n")
    (pkg / "tools" / "b.py").write_text("def f():\n    from .a import g\n")
    (pkg / "tools" / "c.py").write_text("from .. import tools\nfrom ..tools.a import b\n")
    graph = import_graph(tmp_path)
    assert graph[f"{PACKAGE}.tools.c"] == {f"{PACKAGE}.tools.a"}
    assert circles(graph) == [[f"{PACKAGE}.tools.a", f"{PACKAGE}.tools.b"]]


def test_no_module_of_the_package_is_in_an_import_circle():
    assert circles(import_graph(PYTHON_DIR)) == []


def test_the_library_imports_no_tool():
    graph = import_graph(PYTHON_DIR)
    library = {m for m in graph if m in LIBRARY or m.startswith(f"{PACKAGE}.connector")}
    assert {f"{PACKAGE}.connector", f"{PACKAGE}.native"} <= library
    reach = {m: sorted(t for t in graph[m] if t not in library) for m in library}
    assert {m: ts for m, ts in reach.items() if ts} == {}


@pytest.mark.parametrize("module", sorted(modules(PYTHON_DIR)))
def test_each_module_imports_first_in_a_fresh_interpreter(module):
    done = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True, timeout=FRESH_PYTHON_S,
                          env=subprocess_env())
    assert done.returncode == 0, done.stderr[-3000:]
