"""The kernels this wheel ships compiled (``kernel_cache/``), and the command that builds
them: ``python -m flash_qla_sm90.precompile DIR [--jobs N] [--arch sm90,proof-sm100,...]``
compiles every variant of ``flash_qla_tl.precompile.variants`` for SM90 (default) or
the proof builds of the Blackwell arches (``FLASH_QLA_PROOF_ARCH``; their packages must
be installed) into the TileLang cache DIR (nvcc, no GPU); the package build copies DIR
into :data:`SHIPPED`."""

from __future__ import annotations

from pathlib import Path

#: The shipped TileLang cache (filled by ``nox -s build``; absent in a source tree).
SHIPPED = Path(__file__).resolve().parent / "kernel_cache"

if __name__ == "__main__":
    from flash_qla_tl.precompile import main

    from .arch import PROOF_ARCHES, SM90, proof_arch

    main({"sm90": lambda: SM90,
          **{f"proof-{name}": (lambda name=name: proof_arch(name)) for name in PROOF_ARCHES}},
         default="sm90")
