"""The import graph of the shared kernel package ``flash_qla_tl`` (CPU, from the source:
nothing of it is imported to build it): no cycle, counting the imports inside functions
too; the device code in ``kernels/`` never imports host code; ``import flash_qla_sm90``
(what the core's backend discovery does) imports no TileLang, nor do the arch, planning
and layout modules; the arch package reaches the kernels only through its loader."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = "flash_qla_tl"
PACKAGES = Path(__file__).resolve().parents[2] / "packages"
ROOT = PACKAGES / "flash-qla-tilelang" / "src" / PACKAGE


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
    for name in ("flash_qla_tl.forward", "flash_qla_tl.backward", "flash_qla_tl.plan",
                 "flash_qla_tl.layout", "flash_qla_tl.arch",
                 "flash_qla_tl.kernels.chunk_state_output"):
        assert name in graph, sorted(graph)
    assert "flash_qla_tl.forward" in graph["flash_qla_tl.backward"]


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, " -> ".join(cycle)


def test_cycle_finder_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_kernels_import_only_kernels():
    """``kernels/`` is device code: it may import its siblings and the arch traits
    (``arch``), never the host modules that launch it."""
    host = {name: sorted(dep for dep in deps if not dep.startswith(f"{PACKAGE}.kernels")
                         and dep != f"{PACKAGE}.arch")
            for name, deps in import_graph().items()
            if name.startswith(f"{PACKAGE}.kernels")}
    assert all(not deps for deps in host.values()), host


#: The package's layers, bottom up (``flash_qla_tl/__init__.py`` lists them): a module
#: imports only modules of layers below its own (``kernels`` modules: also each other).
LAYERS = ("arch", "kernels", "kernel_index", "launch", "layout", "plan", "forward", "backward",
          "recurrent", "precompile", "backend")


def _layer(module: str) -> int:
    return LAYERS.index(module.split(".")[1])


def test_modules_import_only_the_layers_below():
    graph = import_graph()
    assert {name.split(".")[1] for name in graph if name != PACKAGE} == set(LAYERS)
    upward = [(name, dep) for name, deps in graph.items() if name != PACKAGE
              for dep in deps if _layer(dep) > _layer(name)
              or (_layer(dep) == _layer(name) and LAYERS[_layer(name)] != "kernels")]
    assert not upward, upward


def _function_level_imports(root: Path, prefixes: tuple[str, ...]) -> list:
    """(module, function, import) of every import inside a function of the package at
    ``root`` that is relative or of a module starting with one of ``prefixes``."""
    inner = []
    for path in sorted(root.rglob("*.py")):
        name = ".".join(path.relative_to(root.parent).with_suffix("").parts)
        for func in ast.walk(ast.parse(path.read_text())):
            if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(func):
                if isinstance(node, ast.ImportFrom):
                    module = node.module or ""
                    if node.level or module.startswith(prefixes):
                        inner.append((name, func.name, ast.unparse(node)))
    return inner


def test_no_function_level_imports_of_the_package():
    """Imports of the shared package's own modules are at module top."""
    assert _function_level_imports(ROOT, (PACKAGE,)) == []


@pytest.mark.parametrize("name", ["sm90", "sm100", "sm120"])
def test_arch_package_reaches_the_kernels_only_through_its_loader(name):
    """An arch package imports ``flash_qla_tl``'s TileLang modules only inside the
    loader (which keeps ``import flash_qla_<name>`` free of TileLang); at module top it
    imports only the TileLang-free ``flash_qla_tl.arch``."""
    package = f"flash_qla_{name}"
    root = PACKAGES / f"flash-qla-{name}" / "src" / package
    inner = _function_level_imports(root, ("flash_qla_tl", package))
    assert inner == [(f"{package}.__init__", "_load",
                      "from flash_qla_tl.backend import load")], inner
    top = sorted({node.module for path in root.rglob("*.py")
                  for node in ast.parse(path.read_text()).body
                  if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                      "flash_qla_tl")})
    assert top == ["flash_qla_tl.arch"], top


@pytest.mark.parametrize("modules", [
    ["flash_qla_sm90"], ["flash_qla_sm100"], ["flash_qla_sm120"],
    ["flash_qla_tl", "flash_qla_tl.arch", "flash_qla_tl.plan", "flash_qla_tl.layout",
     "flash_qla_tl.kernels.traits", "flash_qla_sm90.arch"],
], ids=["sm90", "sm100", "sm120", "arch-plan-layout-traits"])
def test_importing_does_not_import_tilelang(modules):
    code = ("import sys\n"
            + "".join(f"import {m}\n" for m in modules)
            + "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('tilelang', 'tvm'))\n"
            "assert not heavy, heavy[:5]\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
