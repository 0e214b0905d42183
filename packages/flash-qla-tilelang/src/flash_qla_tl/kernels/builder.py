"""How a kernel module turns its program into a compiled kernel per :class:`Arch`.

``@tilelang.jit`` binds its target and pass configs when the builder is decorated; our
builders take the arch as their first argument instead, so :func:`arch_kernel` wraps a
*program* ``program(arch, *static) -> T.prim_func`` into a builder
``builder(arch, *static) -> compiled kernel`` that compiles for ``arch.target`` with
``arch``'s pass configs and the kernel's own. TileLang's disk cache keys the compile on
the kernel text, the target and the pass configs, as it did under ``tilelang.jit`` (the
same call), so the shipped caches keep serving; the compiled kernels are kept per
(arch, static arguments) in memory.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import tilelang

from ..arch import Arch


def arch_kernel(pass_configs: dict | None = None) -> Callable:
    """Decorator: ``program(arch, *static)`` (returning a ``T.prim_func``) -> a builder
    ``builder(arch, *static)`` returning the compiled kernel, built once per arguments.
    ``pass_configs``: the kernel's own TileLang pass configs, on top of the arch's.
    ``builder.program`` is the undecorated program (for compile-only checks that lower
    the same function for other targets)."""

    def wrap(program: Callable) -> Callable:
        @functools.cache
        def builder(arch: Arch, *static):
            return tilelang.compile(program(arch, *static), target=arch.target_dict,
                                    pass_configs=arch.kernel_pass_configs(pass_configs))

        functools.update_wrapper(builder, program)
        builder.program = program
        builder.pass_configs = dict(pass_configs or {})
        return builder

    return wrap
