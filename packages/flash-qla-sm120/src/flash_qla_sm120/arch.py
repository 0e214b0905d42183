"""The Blackwell consumer / workstation arches (RTX 50xx, RTX PRO 6000: SM120; DGX Spark:
SM121) the shared kernels of ``flash_qla_tl`` are built for here.

No TileLang: the light ``flash_qla_sm120`` entry point and ``flash_qla_sm90``'s proof
switch (``FLASH_QLA_PROOF_ARCH=sm120``) read it.
"""

from __future__ import annotations

from dataclasses import replace

from flash_qla_tl.arch import SMEM_SM120, Arch

#: CC 12.0 (sm_120a): 101,376 B of shared memory per block. The forward and the reverse
#: sweep run on 32-token sub-chunks of the API's 64-token chunks (a sub-chunk's inverse
#: is the diagonal block of its chunk's A, its gates rebased: docs/blackwell-plan.md,
#: 0.5): three slots take 88,064 B (SM90's 64-token tiles would take ~197 KB). The
#: backward's states (h, dS1) have a row per sub-chunk (``flash_qla_tl.layout.state_rows``
#: 2), and its gradient kernel works per sub-chunk with S0 and dS1 in four column
#: blocks over V (``chunk_input_grads_split``: 47 KB, two CTAs per SM); no fused
#: backward (its single CTA holds the state pair and every tile). mma.sync, column
#: sums by transposed products and scalar reductions as SM100's, the prepare's launch
#: bound at 3 CTAs per SM (6 x 25 KB would not fit 100 KB), no setmaxnreg budgets fitted.
SM120 = Arch(
    name="sm120",
    target="sm_120a",
    mma="mma_sync",
    smem_limit=SMEM_SM120,
    sub_chunk=32,
    slots=3,
    prepare_min_ctas=3,
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
