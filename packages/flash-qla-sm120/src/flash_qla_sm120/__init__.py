"""FlashQLA backend for Blackwell RTX / workstation GPUs (SM120, SM121).

This module is what the ``flash_qla.backends`` entry point ``sm120`` points at; importing it
imports neither TileLang nor the kernels. The kernels are ``flash_qla_tl``'s, built for
``arch.SM120`` / ``arch.SM121`` within 99 KB of shared memory per block: the chunked
prefill's forward and backward on 32-token sub-chunks (varlen, states, state pools, the
bounded segment split; the gradient kernel takes S0 and dS1 in four column blocks over
V, two CTAs per SM, and there is no fused backward) and the token-by-token decode step
(``flash_qla.recurrent``) (docs/blackwell-plan.md, step 6).

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
    __version__ = version("flash-qla-sm120")
except PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"

#: The kernel API these kernels implement (a literal: see flash_qla_sm90).
KERNEL_API_VERSION = 1


def _load():
    # imported here, not at the top: ``import flash_qla_sm120`` must not import TileLang
    import torch

    from flash_qla_tl.backend import load

    capability = tuple(torch.cuda.get_device_capability())
    if capability not in BY_CAPABILITY:
        raise RuntimeError(f"flash-qla-sm120 serves compute capability "
                           f"{sorted(BY_CAPABILITY)}, not {capability}")
    return load(BY_CAPABILITY[capability], SHIPPED)


BACKEND = BackendSpec(
    name="sm120",
    distribution="flash-qla-sm120",
    version=__version__,
    kernel_api_version=KERNEL_API_VERSION,
    capabilities=((12, 0), (12, 1)),
    head_dims=((128, 128),),
    dtypes=("bfloat16", "float16"),
    loader=_load,
    notes="TileLang 0.1.15 kernels (sm_120a / sm_121a): forward, backward (32-token "
          "sub-chunks) and decode, proven on Hopper by their sm_90a twins, not yet run "
          "on Blackwell",
)
