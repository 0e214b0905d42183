"""FlashQLA kernels for NVIDIA Hopper (compute capability 9.0).

This module is what the ``flash_qla.backends`` entry point ``sm90`` points at. It only
declares :data:`BACKEND`; importing it imports neither TileLang nor the kernels, and
compiles nothing. The kernels load on first use, through ``BACKEND.loader``.

The package, by role (each module imports only those above it):

- ``kernels/``: TileLang device code, one module per quantity computed (its
  ``__init__`` lists them), and ``traits``, their static configuration;
- ``layout``: shared host helpers (chunk layout, packing, dtype names, chunk counts);
- ``plan``: every per-call choice (state keeping, segment split, fused or two-kernel
  backward), returned with its reason;
- ``kernel_index``: compiled kernels by builder and static arguments, loaded without
  TileLang's front end (a fresh process's first call);
- ``launch``: one launcher per compiled kernel configuration;
- ``forward``, ``backward``: the orchestrators that launch the kernels;
- ``recurrent``: the token-by-token decode step (``flash_qla.recurrent``);
- ``precompile``: the kernels the wheel ships compiled, and the shipped cache;
- ``backend``: the :class:`flash_qla.backend.Kernels` the core calls (``load()``).

To add an arch package, copy this file and the package's ``pyproject.toml``, change the
name, capabilities, head dims and dtypes, and write a ``load()`` returning a
:class:`flash_qla.backend.Kernels`.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from flash_qla.backend import BackendSpec

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
    from flash_qla_sm90.backend import load

    return load()


BACKEND = BackendSpec(
    name="sm90",
    distribution="flash-qla-sm90",
    version=__version__,
    kernel_api_version=KERNEL_API_VERSION,
    capabilities=((9, 0),),
    head_dims=((128, 128),),
    dtypes=("bfloat16", "float16"),
    loader=_load,
    notes="TileLang 0.1.15 kernels for Hopper (sm_90a)",
)
