"""Compiled kernels found by their static arguments, loaded without TileLang's front end.

TileLang finds a cached kernel by hashing the kernel's program, so every process first
builds that program in Python (0.1-0.8 s per kernel on the GPU hosts) after importing
TileLang itself (1.5-3 s): most of a fresh process's first forward and training step.
This index maps (builder, static arguments) straight to the cache entry TileLang wrote
for them, and loads the entry's host module with tvm-ffi and TileLang's native runtime
(``libtilelang.so``, which registers the CUDA module loader and the TMA descriptor
helpers the host code calls), without importing the ``tilelang`` package.

An entry is one small file, ``<cache>/flash-qla-index/<digest>/<variant>``, holding the
entry's folder relative to the cache root. ``<digest>`` hashes what a kernel's program
depends on besides its arguments: the kernel sources (``flash_qla_tl/kernels/*.py``),
TileLang's version and the ``TILELANG_*`` settings TileLang folds into its key; editing
a kernel or upgrading TileLang starts a new, empty index. Entries are written when a
kernel is built (:func:`record`, called by the launcher and by ``precompile``), one file
each (atomic rename; parallel compiler processes never share a file).
``FLASH_QLA_KERNEL_INDEX=0`` turns the index off (every kernel through TileLang).
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.metadata
import importlib.util
import os
from pathlib import Path
from typing import Any

#: Folder of the index inside a TileLang cache directory.
INDEX_DIR = "flash-qla-index"

#: TileLang settings that do not change a compiled kernel (not part of the digest).
_NEUTRAL_SETTINGS = ("TILELANG_CACHE_DIR", "TILELANG_PRINT_ON_COMPILATION",
                     "TILELANG_VERBOSE", "TILELANG_TMP_DIR")

#: Host-module file names of a TileLang 0.1.15 cache entry, by execution backend.
_LIBRARIES = ("executable.so", "kernel_lib.so")

_digest: str | None = None
_runtime_loaded = False


def enabled() -> bool:
    """Whether the index is used (``FLASH_QLA_KERNEL_INDEX`` unset or not ``0``)."""
    return os.environ.get("FLASH_QLA_KERNEL_INDEX", "1") != "0"


def cache_root() -> Path:
    """The TileLang cache directory in use: ``TILELANG_CACHE_DIR`` (set by
    ``precompile.use_shipped_cache`` when the wheel ships kernels), else TileLang
    0.1.15's default."""
    return Path(os.environ.get("TILELANG_CACHE_DIR")
                or os.path.expanduser("~/.tilelang/cache"))


def digest() -> str:
    """Hash of what a kernel's compiled code depends on besides its static arguments."""
    global _digest
    if _digest is None:
        h = hashlib.sha256()
        h.update(importlib.metadata.version("tilelang").encode())
        kernels = Path(__file__).resolve().parent / "kernels"
        for path in sorted(kernels.glob("*.py")):
            h.update(path.name.encode())
            h.update(path.read_bytes())
        for name in sorted(os.environ):
            if name.startswith("TILELANG_") and name not in _NEUTRAL_SETTINGS:
                h.update(f"{name}={os.environ[name]}".encode())
        _digest = h.hexdigest()[:32]
    return _digest


def variant_name(builder_name: str, static: tuple) -> str:
    """File name of a variant's entry: a hash of the builder's name and its arguments."""
    return hashlib.sha256(f"{builder_name}{static!r}".encode()).hexdigest()[:32]


def _entry_file(root: Path, builder_name: str, static: tuple) -> Path:
    return root / INDEX_DIR / digest() / variant_name(builder_name, static)


def record(builder_name: str, static: tuple, kernel: Any, root: Path | None = None) -> bool:
    """Write the index entry of ``kernel`` (a TileLang kernel that came through its disk
    cache, which tags it with its entry's folder) under ``root`` (default: the cache in
    use). Returns whether an entry was written."""
    root = root or cache_root()
    folder = getattr(kernel, "_tilelang_cache_path", None)
    if folder is None or not enabled():
        return False
    try:
        relative = Path(folder).resolve().relative_to(root.resolve())
    except ValueError:                                 # an entry outside this cache
        return False
    entry = _entry_file(root, builder_name, static)
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = entry.with_name(f"{entry.name}.{os.getpid()}.tmp")
    tmp.write_text(str(relative))
    os.replace(tmp, entry)
    return True


def _load_runtime() -> None:
    """TileLang's native runtime, loaded once into the process's global symbol table
    (the cached host modules resolve ``TVMBackendGetFuncFromEnv`` and the functions it
    looks up there) without importing the ``tilelang`` Python package."""
    global _runtime_loaded
    if _runtime_loaded:
        return
    import tvm_ffi  # noqa: F401  (loads libtvm_ffi, which libtilelang links against)

    spec = importlib.util.find_spec("tilelang")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("TileLang is not installed")
    lib = Path(next(iter(spec.submodule_search_locations))) / "lib" / "libtilelang.so"
    ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)
    _runtime_loaded = True


def load(builder_name: str, static: tuple):
    """The host module of the indexed variant, callable with the kernel's arguments as
    TileLang's tvm-ffi adapter calls it, or None (no index, no entry, entry gone or
    unloadable: the launcher then builds the kernel through TileLang)."""
    if not enabled():
        return None
    root = cache_root()
    try:
        relative = _entry_file(root, builder_name, static).read_text()
    except OSError:
        return None
    folder = root / relative
    if not (folder / "manifest.json").is_file():      # TileLang writes it last
        return None
    for name in _LIBRARIES:
        library = folder / name
        if library.is_file():
            break
    else:
        return None
    try:                                   # a broken entry: TileLang's path decides
        _load_runtime()
        import tvm_ffi

        return tvm_ffi.load_module(str(library))
    except (ImportError, OSError, RuntimeError):
        return None
