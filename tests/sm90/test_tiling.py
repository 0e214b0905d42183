"""The fused forward's per-call tiling choice (CPU: the rule, not the kernels)."""

from __future__ import annotations

import pytest

pytest.importorskip("tilelang", reason="TileLang is not installed")


def test_narrow_tiling_only_while_the_grid_fits_one_wave():
    from flash_qla_sm90.kernels import traits
    from flash_qla_sm90.kernels.forward import fused_tiling

    narrow = (traits.BLOCK_V_NARROW, traits.FWD_THREADS)
    # 1 x 8 heads x 4 tiles = 32 CTAs; 33 x 1 x 4 = 132 (exactly one wave); 264: two waves
    assert fused_tiling(1, 8, 128, 132, narrow=True) == narrow
    assert fused_tiling(33, 1, 128, 132, narrow=True) == narrow
    assert fused_tiling(66, 1, 128, 132, narrow=True) == ()
    assert fused_tiling(1, 8, 128, 132, narrow=False) == ()
    assert fused_tiling(1, 8, 128, 132) == (narrow if traits.FWD_NARROW_TILING else ())


def test_narrow_variants_ship_only_when_enabled(monkeypatch):
    from flash_qla_sm90.kernels import kernel_cache, traits

    monkeypatch.setattr(traits, "FWD_NARROW_TILING", False)
    off = list(kernel_cache.variants())
    monkeypatch.setattr(traits, "FWD_NARROW_TILING", True)
    on = list(kernel_cache.variants())
    extra = [args for _, args in on if (_, args) not in off]
    assert len(on) == len(off) + 8                  # 2 dtypes x has_h0 x store_h
    assert all(args[-2:] == (traits.BLOCK_V_NARROW, traits.FWD_THREADS) for args in extra)


def test_narrow_gpu_cases_take_the_narrow_tiling():
    """The GPU test of the narrow tiling only holds cases that select it (132 SMs)."""
    from flash_qla_sm90.kernels.forward import fused_tiling
    from tests.sm90.test_forward_gpu import NARROW_CASES

    for case in NARROW_CASES:
        n = len(case.lens) if case.lens else case.B
        assert fused_tiling(n, case.Hv, 128, 132, narrow=True) != (), case.id
