"""The static traits of a GPU target that the kernels are built for (no TileLang here).

An :class:`Arch` is part of every compiled kernel's identity: the builders of
``flash_qla_tl.kernels`` take it first, and read only the fields they need, so two
arches that agree on those fields emit the same kernel text (hence share TileLang's
cache entries). The arch packages own the instances (``flash_qla_sm90.arch.SM90``,
``flash_qla_sm100.arch.SM100``, ``flash_qla_sm120.arch.SM120``).

:func:`proof` turns a Blackwell arch into its Hopper twin: the same tiles, budgets and
limits, compiled for ``sm_90a`` with WGMMA disabled, so that TileLang emits the
mma.sync code it emits for ``sm_100a`` / ``sm_120a`` and an H200 can run (and the GPU
tests check) the portable kernels (docs/blackwell-plan.md, section 0).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

#: Shared memory per block (dynamic + static) that a kernel may opt in to.
SMEM_SM90 = 232_448       # also SM100 / SM103
SMEM_SM120 = 101_376      # SM120 / SM121 (99 KB)

#: The TileLang pass config that makes ``T.gemm`` lower to mma.sync on ``sm_90a``.
DISABLE_WGMMA = "tl.disable_wgmma"


@dataclass(frozen=True)
class Arch:
    """Static traits of a target (hashable: builders and launchers are keyed on it).

    - ``name``: "sm90", "sm100", "sm120", "sm90-proof-sm100", ...;
    - ``target``: the nvcc arch TileLang compiles for ("sm_90a", "sm_100a", ...);
    - ``mma``: the tensor-core instructions of the chunk GEMMs: "wgmma" (Hopper) or
      "mma_sync" (every Blackwell chip, through ``T.gemm``);
    - ``smem_limit``: bytes of shared memory per block (dynamic + static) the kernels
      must fit (checked by the compile tests);
    - ``sub_chunk``: the token tile inside the kernels (the API chunk stays 64);
    - ``slots``: shared-memory ring of the warp-specialised sweeps;
    - ``reg_budgets``: ``(kernel, (regs per role, ...))`` pairs, the setmaxnreg budgets
      of a warp-specialised kernel's roles; a kernel not listed emits no setmaxnreg;
    - ``prepare_min_ctas``: the prepare kernel's launch bound (CTAs per SM);
    - ``fused_backward``: whether the fused reverse kernel may be chosen;
    - ``column_sums``: how the gradient kernels sum a [C, C] fragment over rows:
      "reduce" (``T.reduce_sum(dim=0)``, WGMMA fragments) or "transposed" (row sums of
      the transposed product: ``reduce_sum(dim=0)`` does not lower on mma.sync
      fragments in TileLang 0.1.15);
    - ``pass_configs``: ``(key, value)`` TileLang pass configs of every kernel.
    """

    name: str
    target: str
    mma: str
    smem_limit: int
    sub_chunk: int = 64
    slots: int = 3
    reg_budgets: tuple[tuple[str, tuple[int, ...]], ...] = ()
    prepare_min_ctas: int = 6
    fused_backward: bool = True
    column_sums: str = "reduce"
    pass_configs: tuple[tuple[str, object], ...] = ()

    def __post_init__(self):
        if self.mma not in ("wgmma", "mma_sync"):
            raise ValueError(f"mma: 'wgmma' or 'mma_sync', not {self.mma!r}")
        if self.column_sums not in ("reduce", "transposed"):
            raise ValueError(f"column_sums: 'reduce' or 'transposed', not {self.column_sums!r}")

    @property
    def target_dict(self) -> dict:
        """TileLang's explicit target (compiles without a GPU; plain "sm_90" fails in
        nvcc for warp-specialised code, tilelang-notes.md)."""
        return {"kind": "cuda", "arch": self.target}

    @property
    def ordered_grid(self) -> bool:
        """Whether the sweeps' grids may start the longest sequences first
        (``flash_qla_tl.layout.cta_order``): on the WGMMA builds. On the mma.sync builds,
        at SM90's setmaxnreg budgets, the loaded sequence index cost 20-48 bytes more of
        spills per variant (ptxas, sm_100a / sm_103a; none on sm_90a), so they keep grid
        order until their budgets are re-fit."""
        return self.mma == "wgmma"

    def budget(self, kernel: str) -> tuple[int, ...] | None:
        """The setmaxnreg budgets of ``kernel``'s roles, or None (no setmaxnreg)."""
        return dict(self.reg_budgets).get(kernel)

    def kernel_pass_configs(self, extra: dict | None = None) -> dict:
        """The pass configs of one kernel: the arch's, then the kernel's own."""
        return {**dict(self.pass_configs), **(extra or {})}


def proof(arch: Arch) -> Arch:
    """``arch``'s Hopper twin: the same kernel traits, compiled for ``sm_90a`` with WGMMA
    disabled, so that an H200 runs the mma.sync code of ``arch`` (an arch already on
    mma.sync only; the limits stay ``arch``'s, which the compile tests check)."""
    if arch.mma != "mma_sync":
        raise ValueError(f"{arch.name}: only an mma.sync arch has a Hopper proof twin")
    return replace(arch, name=f"sm90-proof-{arch.name}", target="sm_90a",
                   pass_configs=(*arch.pass_configs, (DISABLE_WGMMA, True)))
