"""FlashQLA kernels for NVIDIA Hopper (compute capability 9.0).

This module is what the ``flash_qla.backends`` entry point ``sm90`` points at. It only
declares :data:`BACKEND`; importing it imports neither TileLang nor the kernels, and
compiles nothing. The kernels load on first use, through ``BACKEND.loader``.

The kernels and the host code that launches them live in ``flash_qla_tl`` (the
``flash-qla-tilelang`` distribution, shared by every arch package); this package holds
only what is Hopper's:

- ``arch``: :data:`~flash_qla_sm90.arch.SM90`, the traits the kernels are built for, and
  the proof switch (``FLASH_QLA_PROOF_ARCH=sm100|sm120``: serve that Blackwell arch's
  portable kernels, compiled for sm_90a with WGMMA off, so the GPU tests check them
  on an H200; ``python -m flash_qla info`` shows it in the backend's notes);
- ``precompile``: the shipped kernel cache (``kernel_cache/``) and the command that
  fills it.

To add an arch package, copy this file and the package's ``pyproject.toml``, change the
name, capabilities, head dims and dtypes, and point the loader at
``flash_qla_tl.backend.load`` with the package's arch and shipped cache.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from flash_qla.backend import BackendSpec

from .arch import PROOF_ENV, proof_request, served_arch
from .precompile import SHIPPED

__all__ = ["BACKEND", "KERNEL_API_VERSION", "__version__"]

try:
    __version__ = version("flash-qla-sm90")
except PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"

#: The kernel API these kernels implement (``flash_qla.backend.KERNEL_API_VERSION`` of the
#: core they were written for). A literal on purpose: the core compares it with its own,
#: and refuses a package written for another API with the pip command that fixes it.
KERNEL_API_VERSION = 1


def _load():
    # imported here, not at the top: ``import flash_qla_sm90`` must not import TileLang
    from flash_qla_tl.backend import load

    return load(served_arch(), SHIPPED)


def _notes() -> str:
    notes = "TileLang 0.1.15 kernels for Hopper (sm_90a)"
    try:
        name = proof_request()
    except ValueError as exc:
        return f"{notes}; {exc}"
    if name:
        notes += (f"; {PROOF_ENV}={name}: serving the proof build of {name}'s portable "
                  f"kernels (mma.sync, sm_90a with WGMMA off), not SM90's")
    return notes


BACKEND = BackendSpec(
    name="sm90",
    distribution="flash-qla-sm90",
    version=__version__,
    kernel_api_version=KERNEL_API_VERSION,
    capabilities=((9, 0),),
    head_dims=((128, 128),),
    dtypes=("bfloat16", "float16"),
    loader=_load,
    notes=_notes(),
)
