"""The Blackwell data-centre arches (B200 / B300 / GB200 / GB300) the shared kernels of
``flash_qla_tl`` are built for here: the portable set (mma.sync through ``T.gemm``, no
WGMMA, no tcgen05), with SM90's tiles and budgets (docs/blackwell-plan.md, steps 2-5).

No TileLang: the light ``flash_qla_sm100`` entry point and ``flash_qla_sm90``'s proof
switch (``FLASH_QLA_PROOF_ARCH=sm100``) read it.
"""

from __future__ import annotations

from dataclasses import replace

from flash_qla_tl.arch import SMEM_SM90, Arch

#: CC 10.0 (sm_100a): the same 227 KB per block as SM90, so SM90's tiles (C = 64, three
#: slots) and setmaxnreg budgets (fitted for WGMMA on the H200; ptxas spills recorded by
#: tests/portable/test_blackwell_compile.py); column sums as row sums of transposed
#: products (``T.reduce_sum(dim=0)`` does not lower on mma.sync fragments); TileLang's
#: packed fp32x2 reductions off, so that the reduction order is the one the H200 proof
#: build runs. Proven on Hopper by its twin (``FLASH_QLA_PROOF_ARCH=sm100``, H100): the
#: backward, fused and two-kernel, and the drop-in step pass every GPU test of their files
#: (75, strong decay included, after the gradient kernel's dGG diagonal fix), the
#: forward every test that ran; so it trains as well as serves.
SM100 = Arch(
    name="sm100",
    target="sm_100a",
    mma="mma_sync",
    smem_limit=SMEM_SM90,
    reg_budgets=(("chunk_fwd_ws", (208, 88)),
                 ("chunk_bwd_dh_ws", (192, 120)),
                 ("chunk_bwd_fused", (160, 160, 168, 24))),
    prepare_min_ctas=6,
    column_sums="transposed",
    pass_configs=(("tl.enable_fp32x2_reduction", False),),
)
#: CC 10.3 (B300, GB300): SM100's kernels for sm_103a (the CUDA text is the same).
SM103 = replace(SM100, name="sm103", target="sm_103a")

#: The arches of this package, by target (its wheel ships their kernels); the first is
#: the one ``FLASH_QLA_PROOF_ARCH=sm100`` proves on an H200.
ARCHES = (SM100, SM103)
#: compute capability -> arch
BY_CAPABILITY = {(10, 0): SM100, (10, 3): SM103}
