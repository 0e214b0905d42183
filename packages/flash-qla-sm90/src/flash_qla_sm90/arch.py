"""The Hopper arch (what the shared kernels of ``flash_qla_tl`` are built for here),
and the proof switch that serves a Blackwell arch's kernels on Hopper instead.

No TileLang: the light ``flash_qla_sm90`` entry point reads it.
"""

from __future__ import annotations

import importlib
import os

from flash_qla_tl.arch import SMEM_SM90, Arch, proof

#: H200 / H100 (sm_90a): WGMMA chains, the setmaxnreg budgets fitted on the H200
#: (``chunk_fwd_ws`` and the sweep: 256 x 192 + 128 x 120 = 384 x 168, the launch
#: allocation; the forward's chain waits for each product before the next, which 192
#: holds without C7512, and its aux at 120 instead of 88 took 7-9% off the kernel; the
#: fused reverse kernel's four roles, <= 4 x 128), six prepare
#: CTAs per SM (its launch bound: 6 -> 80 registers, 24 bytes spilled; uncapped it takes
#: 113, at 8 it spills 108 bytes; ptxas, sm_90a, bf16. On the H200, 16/16 1x32768 /
#: 4/16 1x32768 / 16/32 8x4096, ms: 6 CTAs 0.128 / 0.126 / 0.251, uncapped 0.143 /
#: 0.140 / 0.274, 8 CTAs 0.138 / 0.139 / 0.275), column sums by ``T.reduce_sum(dim=0)``.
SM90 = Arch(
    name="sm90",
    target="sm_90a",
    mma="wgmma",
    smem_limit=SMEM_SM90,
    reg_budgets=(("chunk_fwd_ws", (192, 120)),
                 ("chunk_bwd_dh_ws", (192, 120)),
                 ("chunk_bwd_fused", (160, 160, 168, 24))),
    prepare_min_ctas=6,
)
#: The arches of this package, by target (its wheel ships their kernels).
ARCHES = (SM90,)

#: ``FLASH_QLA_PROOF_ARCH=sm100|sm120`` on an SM90 device: the loader serves the Hopper
#: proof build (``flash_qla_tl.arch.proof``) of that arch package's portable kernels
#: instead of :data:`SM90`, so that the GPU tests check them on an H200.
PROOF_ENV = "FLASH_QLA_PROOF_ARCH"
PROOF_ARCHES = ("sm100", "sm120")


def proof_request() -> str | None:
    """The arch named by :data:`PROOF_ENV` ("sm100", "sm120"), or None when unset or
    empty; ``ValueError`` for another value."""
    name = os.environ.get(PROOF_ENV, "").strip()
    if name and name not in PROOF_ARCHES:
        raise ValueError(f"{PROOF_ENV}={name!r}: expected one of {', '.join(PROOF_ARCHES)}")
    return name or None


def proof_arch(name: str) -> Arch:
    """The proof twin of ``flash_qla_<name>.arch``'s first arch (``name`` one of
    :data:`PROOF_ARCHES`; that package must be installed)."""
    try:
        module = importlib.import_module(f"flash_qla_{name}.arch")
    except ImportError as exc:
        raise ImportError(f"{PROOF_ENV}={name} needs flash-qla-{name} installed "
                          f"(pip install -e packages/flash-qla-{name})") from exc
    return proof(module.ARCHES[0])


def served_arch() -> Arch:
    """The arch the sm90 loader builds its kernels for: :data:`SM90`, or under
    :data:`PROOF_ENV` the proof twin of that Blackwell arch (:func:`proof_arch`)."""
    name = proof_request()
    return SM90 if name is None else proof_arch(name)
