"""The kernels built from instructions every Blackwell chip has (no wgmma, no tcgen05)
compile for each Blackwell target: the first step of the Blackwell packages,
whose kernels are to be proven on the H200 by running the same CUDA there. Today that is
the decode kernel ``recurrent_step`` (plain loads, fp32 register tiles, block
reductions); compile-only, nvcc and TileLang needed, no GPU."""

from __future__ import annotations

import pytest

tilelang = pytest.importorskip("tilelang", reason="TileLang is not installed")
pytestmark = [pytest.mark.nvcc, pytest.mark.usefixtures("fresh_tilelang_cache")]

BLACKWELL = ["sm_100a", "sm_103a", "sm_120a", "sm_121a"]
#: instructions a kernel meant to run on every Blackwell chip must not use (wgmma: Hopper
#: only; tcgen05: SM100-family only; setmaxnreg compiles on every Blackwell target,
#: docs/blackwell-plan.md)
HOPPER_ONLY = ("wgmma", "tcgen05")


@pytest.mark.parametrize("arch", BLACKWELL)
def test_recurrent_step_compiles_for_blackwell(arch):
    from flash_qla_tl.kernels.recurrent_step import recurrent_step_kernel

    prim = recurrent_step_kernel.func.orig_func("bfloat16", 128, 128, True)
    src = tilelang.compile(prim, target={"kind": "cuda", "arch": arch}).get_kernel_source()
    assert "recurrent_step" in src
    assert not [op for op in HOPPER_ONLY if op in src], arch
