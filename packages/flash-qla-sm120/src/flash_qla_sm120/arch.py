"""The Blackwell consumer / workstation arches (RTX 50xx, RTX PRO 6000: SM120; DGX Spark:
SM121) the shared kernels of ``flash_qla_tl`` are built for here.

No TileLang: the light ``flash_qla_sm120`` entry point and ``flash_qla_sm90``'s proof
switch (``FLASH_QLA_PROOF_ARCH=sm120``) read it.
"""

from __future__ import annotations

from dataclasses import replace

from flash_qla_tl.arch import SMEM_SM120, Arch

#: CC 12.0 (sm_120a): 101,376 B of shared memory per block. The chunked prefill's
#: kernels do not fit at SM90's tiles (the forward's three slots take ~197 KB, two
#: ~134 KB; the gradient kernels hold S0 and dS1, 32 KB each, beside their tiles) and
#: the sub-chunk-32 forward and half-state gradient kernels (docs/blackwell-plan.md,
#: step 6) are not written yet: only the decode step is built (``chunked=False``; the
#: backend serves the chunked calls nowhere and says so). mma.sync, column sums by
#: transposed products and scalar reductions as SM100's, the prepare's launch bound
#: at 3 CTAs per SM (6 x 25 KB would not fit 100 KB), no setmaxnreg budgets fitted.
SM120 = Arch(
    name="sm120",
    target="sm_120a",
    mma="mma_sync",
    smem_limit=SMEM_SM120,
    slots=2,
    prepare_min_ctas=3,
    chunked=False,
    fused_backward=False,
    column_sums="transposed",
    pass_configs=(("tl.enable_fp32x2_reduction", False),),
)
#: CC 12.1 (DGX Spark, GB10): SM120's kernels for sm_121a.
SM121 = replace(SM120, name="sm121", target="sm_121a")

#: The arches of this package, by target (its wheel ships their kernels); the first is
#: the one ``FLASH_QLA_PROOF_ARCH=sm120`` proves on an H200.
ARCHES = (SM120, SM121)
#: compute capability -> arch
BY_CAPABILITY = {(12, 0): SM120, (12, 1): SM121}
