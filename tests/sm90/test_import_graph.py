"""The package's import graph (CPU, from the source: nothing of flash_qla_sm90 is imported
to build it): no cycle, counting the imports inside functions too; the device code in
``kernels/`` never imports host code; and ``import flash_qla_sm90`` (what the core's
backend discovery does) imports no TileLang, nor do the planning and layout modules."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = "flash_qla_sm90"
ROOT = Path(__file__).resolve().parents[2] / "packages" / "flash-qla-sm90" / "src" / PACKAGE


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that module ``name`` imports anywhere in its body (top
    level and inside functions), relative imports resolved; ``from pkg import x`` counts
    as importing ``pkg.x`` where that is a module, else ``pkg``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module
            targets = [f"{origin}.{alias.name}" if f"{origin}.{alias.name}" in modules
                       else origin for alias in node.names]
        else:
            continue
        found |= {t for t in targets if t in modules}
    found.discard(name)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` as a path (first module repeated at the end), or
    None."""
    state: dict[str, int] = {}                 # 1: on the current path, 2: finished
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_graph_walks_every_module():
    graph = import_graph()
    for name in ("flash_qla_sm90.forward", "flash_qla_sm90.backward", "flash_qla_sm90.plan",
                 "flash_qla_sm90.layout", "flash_qla_sm90.kernels.chunk_state_output"):
        assert name in graph, sorted(graph)
    # function-level imports count: the loader's import of the backend is one
    assert "flash_qla_sm90.backend" in graph["flash_qla_sm90"]
    assert "flash_qla_sm90.forward" in graph["flash_qla_sm90.backward"]


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, " -> ".join(cycle)


def test_cycle_finder_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_kernels_import_only_kernels():
    """``kernels/`` is device code: it may import its siblings, never the host modules
    that launch it."""
    host = {name: sorted(dep for dep in deps if not dep.startswith(f"{PACKAGE}.kernels"))
            for name, deps in import_graph().items()
            if name.startswith(f"{PACKAGE}.kernels")}
    assert all(not deps for deps in host.values()), host


#: The package's layers, bottom up (``flash_qla_sm90/__init__.py`` lists them): a module
#: imports only modules of layers below its own (``kernels`` modules: also each other).
LAYERS = ("kernels", "layout", "plan", "kernel_index", "launch", "forward", "backward", "recurrent",
          "precompile", "backend")


def _layer(module: str) -> int:
    return LAYERS.index(module.split(".")[1])


def test_modules_import_only_the_layers_below():
    graph = import_graph()
    assert {name.split(".")[1] for name in graph if name != PACKAGE} == set(LAYERS)
    upward = [(name, dep) for name, deps in graph.items() if name != PACKAGE
              for dep in deps if _layer(dep) > _layer(name)
              or (_layer(dep) == _layer(name) and LAYERS[_layer(name)] != "kernels")]
    assert not upward, upward


def test_no_function_level_imports_of_the_package_outside_the_loader():
    """Imports of the package's own modules are at module top, except the loader's in
    ``__init__`` (which keeps ``import flash_qla_sm90`` free of TileLang)."""
    modules = _modules()
    inner = []
    for name, path in modules.items():
        for func in ast.walk(ast.parse(path.read_text())):
            if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(func):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    module = getattr(node, "module", None) or ""
                    if node.__class__ is ast.ImportFrom and (node.level or
                                                             module.startswith(PACKAGE)):
                        inner.append((name, func.name, ast.unparse(node)))
    assert inner == [(PACKAGE, "_load", "from flash_qla_sm90.backend import load")], inner


@pytest.mark.parametrize("modules", [
    ["flash_qla_sm90"],
    ["flash_qla_sm90.plan", "flash_qla_sm90.layout", "flash_qla_sm90.kernels.traits"],
], ids=["package", "plan-layout-traits"])
def test_importing_does_not_import_tilelang(modules):
    code = ("import sys\n"
            + "".join(f"import {m}\n" for m in modules)
            + "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('tilelang', 'tvm'))\n"
            "assert not heavy, heavy[:5]\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
