"""FlashQLA backend for Blackwell RTX / workstation GPUs (SM120, SM121): no kernels yet.

Registered under the ``flash_qla.backends`` entry point ``sm120`` so that the core can
say, on such a GPU, that this package is installed but ships no kernels (its loader
raises :class:`NotImplementedError`, which the dispatch reports in its error and
``python -m flash_qla info`` shows). When kernels land, this file takes the form of
``flash_qla_sm90/__init__.py`` (loader importing ``flash_qla_sm120.kernels.load``).
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from flash_qla.backend import BackendSpec

__all__ = ["BACKEND", "KERNEL_API_VERSION", "__version__"]

try:
    __version__ = version("flash-qla-sm120")
except PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"

#: The kernel API this package is written for (a literal: see flash_qla_sm90).
KERNEL_API_VERSION = 1


def _load():
    raise NotImplementedError(
        f"flash-qla-sm120 {__version__} ships no kernels yet; on this GPU run the PyTorch "
        f"reference with FLASH_QLA_BACKEND=torch (slow), or upgrade flash-qla-sm120 once a "
        f"release with kernels is out"
    )


BACKEND = BackendSpec(
    name="sm120",
    distribution="flash-qla-sm120",
    version=__version__,
    kernel_api_version=KERNEL_API_VERSION,
    capabilities=((12, 0), (12, 1)),
    head_dims=((128, 128),),
    dtypes=("bfloat16", "float16"),
    loader=_load,
    notes="no kernels yet (planned: TileLang, sm_120a)",
)
