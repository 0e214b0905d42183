"""Compiled kernels by static configuration, as launchers with the least host work.

Every call of an eager forward or backward launches two to five TileLang kernels, and at
8192 tokens a training step is bound by the host's time (``docs/perf-notes.md``, v11,
v12). Two layers of TileLang's per-launch Python are the same on every call of one
configuration and are paid once here:

- the builder call (``chunk_fwd_ws_kernel("bfloat16", 128, 128, ...)``), which looks the
  compiled kernel up by its arguments on every call: a launcher is kept per
  (builder, static arguments, ``traits.revision``);
- the adapter around the compiled module, which re-derives for every launch which of the
  arguments are outputs to allocate (our kernels allocate none: every output is an
  argument) before calling the tvm-ffi function: the launcher calls that function
  directly when the kernel has no outputs to allocate.

The tvm-ffi function itself converts the tensors (DLPack), takes torch's current stream
and launches; it is what a launch costs from here on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from . import traits

#: (id(builder), static arguments, traits.revision) -> (builder, launcher); the builder is
#: kept so that its id cannot be reused by another object while the entry lives.
_LAUNCHERS: dict[tuple, tuple[Any, Callable]] = {}


def launcher(builder: Callable, *static: Any) -> Callable:
    """``builder(*static)``'s compiled kernel as a callable taking the kernel arguments.

    ``builder``: a ``tilelang.jit`` kernel builder (or any callable returning a launcher,
    e.g. a test's stub); ``static``: its static arguments (dtype name, dims, flags).
    The launcher is built once per (builder, arguments, ``traits.revision``)."""
    key = (id(builder), static, traits.revision)
    entry = _LAUNCHERS.get(key)
    if entry is None or entry[0] is not builder:
        entry = _LAUNCHERS[key] = (builder, _direct(builder(*static)))
    return entry[1]


def _direct(kernel: Any) -> Callable:
    """The tvm-ffi function of a compiled TileLang kernel whose outputs are all
    arguments (TileLang 0.1.15's ``TVMFFIKernelAdapter``), else ``kernel`` itself."""
    adapter = getattr(kernel, "adapter", None)
    executable = getattr(adapter, "_get_executable", None)
    if executable is None or getattr(adapter, "result_idx", None):
        return kernel
    return executable()
