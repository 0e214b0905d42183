"""Compile-only tests of every Hopper kernel family: no GPU needed, nvcc and TileLang are.

They lower each kernel for the explicit sm_90a target into a fresh TileLang cache (so a
warm cache cannot hide a broken build) and check that the generated CUDA uses the Hopper
paths the design relies on: WGMMA for the GEMMs and TMA for the tile loads.
"""

from __future__ import annotations

import pytest

tilelang = pytest.importorskip("tilelang", reason="TileLang is not installed")
pytestmark = pytest.mark.nvcc


@pytest.fixture(scope="module", autouse=True)
def fresh_cache(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("TILELANG_CACHE_DIR", str(tmp_path_factory.mktemp("tilelang-cache")))
    mp.setenv("TILELANG_PRINT_ON_COMPILATION", "0")
    yield
    mp.undo()


def _source(builder, *args) -> str:
    return builder(*args).get_kernel_source()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_prepare_kernel_compiles_to_wgmma(dtype):
    # one chunk per CTA and no loop to pipeline: plain vector loads, no TMA ring
    from flash_qla_sm90.kernels.chunk_prepare import chunk_prepare_kernel

    src = _source(chunk_prepare_kernel, dtype, 128)
    assert "wgmma" in src


@pytest.mark.parametrize("dtype, has_h0, store_h", [("bfloat16", True, True),
                                                    ("float16", False, False)],
                         ids=["bf16-h0-h", "fp16"])
def test_fused_forward_compiles_to_wgmma_and_tma(dtype, has_h0, store_h):
    from flash_qla_sm90.kernels.chunk_fwd import chunk_fwd_kernel

    src = _source(chunk_fwd_kernel, dtype, 128, 128, has_h0, store_h)
    assert "wgmma" in src
    assert "tma_load" in src
    assert "mbarrier" in src          # producer/consumer pipeline on transaction barriers


def test_every_variant_is_listed_for_the_shipped_cache():
    from flash_qla_sm90.kernels.kernel_cache import variants

    names = {(builder.__name__ if hasattr(builder, "__name__") else str(builder), args)
             for builder, args in variants()}
    assert len(names) == 16


def test_backward_dh_kernel_compiles_to_wgmma_and_tma():
    from flash_qla_sm90.kernels.chunk_bwd_dh import chunk_bwd_dh_kernel

    src = _source(chunk_bwd_dh_kernel, "bfloat16", 128, 128, True)
    assert "wgmma" in src
    assert "tma_load" in src


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_backward_intra_kernel_compiles_to_wgmma(dtype):
    # one chunk per CTA, no loop to pipeline: plain guarded vector loads, WGMMA GEMMs
    from flash_qla_sm90.kernels.chunk_bwd_intra import chunk_bwd_intra_kernel

    src = _source(chunk_bwd_intra_kernel, dtype, 128, 128)
    assert "wgmma" in src
