"""The kernels this wheel ships compiled (``kernel_cache/``), and the command that builds
them: ``python -m flash_qla_sm120.precompile DIR [--jobs N] [--arch ...]`` compiles every
variant of ``flash_qla_tl.precompile.variants`` for this package's arches (default: all
of them, one entry per target; nvcc, no GPU) into the TileLang cache DIR; the package
build copies DIR into :data:`SHIPPED`."""

from __future__ import annotations

from pathlib import Path

#: The shipped TileLang cache (filled by ``nox -s build``; absent in a source tree).
SHIPPED = Path(__file__).resolve().parent / "kernel_cache"

if __name__ == "__main__":
    from flash_qla_tl.precompile import package_main

    from .arch import ARCHES

    package_main(ARCHES)
