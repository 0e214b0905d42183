#!/usr/bin/env python3
"""Which files of an unpacked FlashInfer package the GDN-prefill benchmark peer needs.

Used by ``tools/make_flashinfer_bundle.sh`` to cut FlashInfer 0.7.x (~720 MB unpacked,
mostly CUDA/C++ sources for its nvcc JIT and Python for other operators) down to what
``import flashinfer.gdn_prefill`` and the SM90 CuTe-DSL call can reach:

* every ``.py`` that an ``import`` statement can load, followed transitively from
  ``flashinfer/__init__.py`` and ``flashinfer/gdn_prefill.py`` -- statements inside
  functions and ``try`` blocks included, so lazily imported modules stay too (a superset
  of what one import run loads: ~1300 of ~3600 files);
* all of ``gdn_kernels/`` (the kernels themselves, whatever their imports look like);
* the package metadata of ``flashinfer/`` (version files are ``.py`` and reached anyway).

Everything else goes: ``data/`` (CUDA/C++ sources, CUTLASS/CCCL headers: the SM90 GDN
path of 0.7.x compiles CuTe-DSL in-process and never runs nvcc), non-Python files outside
``gdn_kernels/``, and modules no import statement reaches.

Usage: ``flashinfer_bundle_keep.py PKG_DIR`` prints the kept paths relative to PKG_DIR
(the ``flashinfer`` directory), one per line; ``--drop`` prints the others instead.
"""

from __future__ import annotations

import argparse
import ast
import os
import sys

ROOT_NAME = "flashinfer"
STARTS = ("flashinfer", "flashinfer.gdn_prefill")
KEEP_TREES = ("gdn_kernels",)


def module_file(pkg_dir: str, dotted: str) -> str | None:
    """The file that defines ``dotted`` (a module of the package), or None."""
    parts = dotted.split(".")[1:]
    base = os.path.join(pkg_dir, *parts)
    init = os.path.join(base, "__init__.py")
    if os.path.isfile(init):
        return init
    if os.path.isfile(base + ".py"):
        return base + ".py"
    return None


def imported_names(tree: ast.AST, package: list[str]) -> list[str]:
    """Dotted names of package modules an import statement anywhere in ``tree`` may load;
    ``package`` is the dotted package the module's relative imports start from."""
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names if a.name.split(".")[0] == ROOT_NAME]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                if node.level - 1 > len(package):
                    continue
                base = package[: len(package) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != ROOT_NAME:
                continue
            names.append(target)
            # "from pkg import name" loads pkg.name when it is a submodule
            names += [f"{target}.{a.name}" for a in node.names if a.name != "*"]
    return names


def reachable(pkg_dir: str, starts=STARTS) -> set[str]:
    """Absolute paths of the package's modules reachable from ``starts``."""
    seen: set[str] = set()
    todo = list(starts)
    while todo:
        parts = todo.pop().split(".")
        for i in range(1, len(parts) + 1):    # importing a.b.c runs a and a.b first
            dotted = ".".join(parts[:i])
            path = module_file(pkg_dir, dotted)
            if path is None or path in seen:
                continue
            seen.add(path)
            package = parts[:i] if path.endswith("__init__.py") else parts[: i - 1]
            try:
                with open(path, encoding="utf-8") as f:
                    tree = ast.parse(f.read(), filename=path)
            except (SyntaxError, UnicodeDecodeError):
                continue
            todo += imported_names(tree, package)
    return seen


def kept_files(pkg_dir: str) -> set[str]:
    """Paths (relative to ``pkg_dir``) to keep."""
    keep = {os.path.relpath(p, pkg_dir) for p in reachable(pkg_dir)}
    for sub in KEEP_TREES:
        for d, _, files in os.walk(os.path.join(pkg_dir, sub)):
            keep |= {os.path.relpath(os.path.join(d, f), pkg_dir) for f in files}
    return {p for p in keep if "__pycache__" not in p.split(os.sep)}


def all_files(pkg_dir: str) -> set[str]:
    out = set()
    for d, _, files in os.walk(pkg_dir):
        out |= {os.path.relpath(os.path.join(d, f), pkg_dir) for f in files}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("pkg_dir", help="the unpacked flashinfer/ directory")
    p.add_argument("--drop", action="store_true", help="print the files to delete instead")
    args = p.parse_args(argv)
    if not os.path.isfile(os.path.join(args.pkg_dir, "gdn_prefill.py")):
        print(f"{args.pkg_dir}: no gdn_prefill.py (not a FlashInfer package?)", file=sys.stderr)
        return 2
    keep = kept_files(args.pkg_dir)
    out = (all_files(args.pkg_dir) - keep) if args.drop else keep
    sys.stdout.write("".join(f"{p}\n" for p in sorted(out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
