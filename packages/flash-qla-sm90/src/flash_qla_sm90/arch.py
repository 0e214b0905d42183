"""The Hopper arch (what the shared kernels of ``flash_qla_tl`` are built for here).

No TileLang: the light ``flash_qla_sm90`` entry point and the planner read it.
"""

from __future__ import annotations

from flash_qla_tl.arch import SMEM_SM90, Arch

#: H200 / H100 (sm_90a): WGMMA chains, the setmaxnreg budgets fitted on the H200
#: (``chunk_fwd_ws``: 256 x 208 + 128 x 88 <= 384 x 168, the launch allocation; the
#: sweep's 192 / 120; the fused reverse kernel's four roles, <= 4 x 128), six prepare
#: CTAs per SM, column sums by ``T.reduce_sum(dim=0)``.
SM90 = Arch(
    name="sm90",
    target="sm_90a",
    mma="wgmma",
    smem_limit=SMEM_SM90,
    reg_budgets=(("chunk_fwd_ws", (208, 88)),
                 ("chunk_bwd_dh_ws", (192, 120)),
                 ("chunk_bwd_fused", (160, 160, 168, 24))),
    prepare_min_ctas=6,
)
