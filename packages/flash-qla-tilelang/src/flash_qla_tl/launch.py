"""Compiled kernels by static configuration, as launchers with the least host work.

Every call of an eager forward or backward launches two to five TileLang kernels, and at
8192 tokens a training step is bound by the host's time (``docs/perf-notes.md``, v11,
v12). Two layers of TileLang's per-launch Python are the same on every call of one
configuration and are paid once here:

- the builder call (``chunk_fwd_ws_kernel("bfloat16", 128, 128, ...)``), which looks the
  compiled kernel up by its arguments on every call: a launcher is kept per (builder,
  static arguments);
- the tvm-ffi adapter around the compiled module, which re-derives for every launch
  which of the arguments are outputs to allocate (our kernels allocate none: every
  output is an argument) before calling the module: the launcher calls the module
  directly when the kernel has no outputs to allocate.

The module's host code converts the tensors (DLPack), takes torch's current stream, sets
the device from the tensors and launches; it is what a launch costs from here on (the
same in both paths: the adapter sets no device or stream itself, TileLang 0.1.15).

A fresh process gets each launcher from :mod:`flash_qla_tl.kernel_index` when the
kernel was built before (the shipped cache, or an earlier process): the cached module
is loaded without TileLang's front end, and TileLang is imported only for a kernel the
index does not have (which is then built, or loaded from TileLang's cache, and indexed).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from . import kernel_index

#: The TileLang release whose adapter :func:`_direct` was read against (the sm90 pin).
_TILELANG = "0.1.15"

#: (id(builder), static arguments) -> (builder, launcher); the builder is kept so that
#: its id cannot be reused by another object while the entry lives.
_LAUNCHERS: dict[tuple, tuple[Any, Callable]] = {}


def launcher(builder: Callable, *static: Any) -> Callable:
    """``builder(*static)``'s compiled kernel as a callable taking the kernel arguments.

    ``builder``: a ``tilelang.jit`` kernel builder (or any callable returning a launcher,
    e.g. a test's stub); ``static``: its static arguments (dtype name, dims, flags).
    The launcher is built once per (builder, arguments), as TileLang keys its own
    in-memory kernels: from the kernel index when ``builder`` is a shipped builder
    (:class:`flash_qla_tl.kernels.Builder`) whose variant it holds, else by calling
    the builder (and indexing what it built)."""
    key = (id(builder), static)
    entry = _LAUNCHERS.get(key)
    if entry is None:
        name = getattr(builder, "index_name", None)
        module = kernel_index.load(name, static) if name else None
        if module is None:
            kernel = builder(*static)
            if name:
                kernel_index.record(name, static, kernel)
            module = _direct(kernel)
        entry = _LAUNCHERS[key] = (builder, module)
    return entry[1]


def _direct(kernel: Any) -> Callable:
    """The compiled module of a TileLang kernel run by TileLang 0.1.15's tvm-ffi adapter
    whose outputs are all arguments, else ``kernel`` itself (another adapter or
    TileLang version, a kernel that allocates outputs, a stub)."""
    adapter = getattr(kernel, "adapter", None)
    if adapter is None or getattr(adapter, "result_idx", None):
        return kernel
    import tilelang  # a TileLang kernel: its adapter is checked
    from tilelang.jit.adapter.tvm_ffi import TVMFFIKernelAdapter

    if tilelang.__version__ != _TILELANG or not isinstance(adapter, TVMFFIKernelAdapter):
        return kernel
    return adapter._get_executable()
