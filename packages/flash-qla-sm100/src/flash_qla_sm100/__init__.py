"""FlashQLA backend for Blackwell data-centre GPUs (SM100, SM103): the portable TileLang kernels.

This module is what the ``flash_qla.backends`` entry point ``sm100`` points at; importing it
imports neither TileLang nor the kernels. The kernels are ``flash_qla_tl``'s, built for
``arch.SM100`` / ``arch.SM103`` (mma.sync through ``T.gemm``: no WGMMA, no tcgen05;
SM90's tiles and budgets; docs/blackwell-plan.md), proven on an H200 by their Hopper
twins (``FLASH_QLA_PROOF_ARCH=sm100``, ``flash_qla_sm90.arch``) and compiled for both
targets by the CPU tests (``tests/portable/test_blackwell_compile.py``), never yet run
on Blackwell hardware.

- ``arch``: the arches, by compute capability;
- ``precompile``: the shipped kernel cache (``kernel_cache/``) and the command that
  fills it.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from flash_qla.backend import BackendSpec

from .arch import BY_CAPABILITY
from .precompile import SHIPPED

__all__ = ["BACKEND", "KERNEL_API_VERSION", "__version__"]

try:
    __version__ = version("flash-qla-sm100")
except PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"

#: The kernel API these kernels implement (a literal: see flash_qla_sm90).
KERNEL_API_VERSION = 1


def _load():
    # imported here, not at the top: ``import flash_qla_sm100`` must not import TileLang
    import torch

    from flash_qla_tl.backend import load

    capability = tuple(torch.cuda.get_device_capability())
    if capability not in BY_CAPABILITY:
        raise RuntimeError(f"flash-qla-sm100 serves compute capability "
                           f"{sorted(BY_CAPABILITY)}, not {capability}")
    return load(BY_CAPABILITY[capability], SHIPPED)


BACKEND = BackendSpec(
    name="sm100",
    distribution="flash-qla-sm100",
    version=__version__,
    kernel_api_version=KERNEL_API_VERSION,
    capabilities=((10, 0), (10, 3)),
    head_dims=((128, 128),),
    dtypes=("bfloat16", "float16"),
    loader=_load,
    notes="TileLang 0.1.15 portable kernels (mma.sync; sm_100a / sm_103a): forward, "
          "backward, state pool, decode; proven on Hopper by their sm_90a twins, "
          "not yet run on Blackwell",
)
