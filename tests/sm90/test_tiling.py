"""The fused forward's per-call tiling choice (CPU: the rule, not the kernels)."""

from __future__ import annotations

import pytest

pytest.importorskip("tilelang", reason="TileLang is not installed")


def test_narrow_tiling_only_while_the_grid_fits_one_wave():
    from flash_qla_sm90.kernels import traits
    from flash_qla_sm90.kernels.forward import fused_tiling

    narrow = (traits.BLOCK_V_NARROW, traits.FWD_THREADS)
    # 1 x 8 heads x 4 tiles = 32 CTAs; 33 x 1 x 4 = 132 (exactly one wave); 264: two waves
    assert fused_tiling(1, 8, 128, 132, narrow=True, wide=False) == narrow
    assert fused_tiling(33, 1, 128, 132, narrow=True, wide=False) == narrow
    assert fused_tiling(66, 1, 128, 132, narrow=True, wide=False) == ()
    assert fused_tiling(1, 8, 128, 132, narrow=False, wide=False) == ()


def test_wide_tiling_only_past_one_wave_of_default_tiles():
    from flash_qla_sm90.kernels import traits
    from flash_qla_sm90.kernels.forward import fused_tiling

    wide = (traits.BLOCK_V_WIDE, traits.FWD_THREADS)
    # BLOCK_V 64: 66 x 2 = 132 CTAs is one wave (default), 67 x 2 = 134 is two (wide)
    assert fused_tiling(66, 1, 128, 132, narrow=True, wide=True) == ()
    assert fused_tiling(67, 1, 128, 132, narrow=True, wide=True) == wide
    assert fused_tiling(8, 32, 128, 132, narrow=True, wide=True) == wide
    assert fused_tiling(8, 32, 128, 132, narrow=True, wide=False) == ()
    assert fused_tiling(1, 8, 128, 132, narrow=True, wide=True) == (traits.BLOCK_V_NARROW,
                                                                     traits.FWD_THREADS)


def test_defaults_follow_traits():
    from flash_qla_sm90.kernels import traits
    from flash_qla_sm90.kernels.forward import fused_tiling

    assert fused_tiling(1, 8, 128, 132) == fused_tiling(
        1, 8, 128, 132, traits.FWD_NARROW_TILING, traits.FWD_WIDE_TILING)
    assert fused_tiling(8, 32, 128, 132) == fused_tiling(
        8, 32, 128, 132, traits.FWD_NARROW_TILING, traits.FWD_WIDE_TILING)


@pytest.mark.parametrize("flag, tiling", [("FWD_NARROW_TILING", "FWD_NARROW"),
                                          ("FWD_WIDE_TILING", "FWD_WIDE")])
def test_tiling_variants_ship_only_when_enabled(monkeypatch, flag, tiling):
    from flash_qla_sm90.kernels import kernel_cache, traits
    from flash_qla_sm90.kernels.chunk_bwd_dh import chunk_bwd_dh_kernel
    from flash_qla_sm90.kernels.chunk_fwd import chunk_fwd_kernel

    monkeypatch.setattr(traits, flag, False)
    off = list(kernel_cache.variants())
    monkeypatch.setattr(traits, flag, True)
    on = list(kernel_cache.variants())
    extra = [(b, args) for b, args in on if (b, args) not in off]
    fwd = [args for b, args in extra if b is chunk_fwd_kernel]
    assert len(fwd) == 8                            # 2 dtypes x has_h0 x store_h
    assert all(args[-2:] == getattr(traits, tiling) for args in fwd)
    # the narrow tiling also has the tiled reverse sweep (2 dtypes x has_dht) when it
    # is the one that runs (the warp-specialised sweep has no tilings)
    dh = [args for b, args in extra if b is chunk_bwd_dh_kernel]
    tiled_dh = flag == "FWD_NARROW_TILING" and not traits.BWD_DH_AUX_WARPGROUP
    assert len(dh) == (4 if tiled_dh else 0)
    assert len(extra) == len(fwd) + len(dh)


@pytest.mark.parametrize("cases, which", [("NARROW_CASES", "narrow"), ("WIDE_CASES", "wide")])
def test_gpu_tiling_cases_take_their_tiling(cases, which):
    """The GPU tests of each tiling only hold cases that select it (132 SMs)."""
    from flash_qla_sm90.kernels import traits
    from flash_qla_sm90.kernels.forward import fused_tiling
    from tests.sm90 import test_forward_gpu

    expected = traits.FWD_NARROW if which == "narrow" else traits.FWD_WIDE
    for case in getattr(test_forward_gpu, cases):
        n = len(case.lens) if case.lens else case.B
        assert fused_tiling(n, case.Hv, 128, 132, narrow=True, wide=True) == expected, case.id


def test_transposed_kernel_only_when_on_and_cheaper(monkeypatch):
    from flash_qla_sm90.kernels import forward, traits

    monkeypatch.setattr(traits, "FWD_TRANSPOSED", False)
    assert not forward.use_transposed(8, 32, 128, 128, 132)
    monkeypatch.setattr(traits, "FWD_TRANSPOSED", True)
    monkeypatch.setattr(traits, "FWD_CHUNK_US_TRANSPOSED", {"t": 5.5, "ws": 5.5})
    # 256 (sequence, head) pairs: 2 rounds x 5.5 us beat the wide tile's 2 x 10.0
    assert forward.use_transposed(8, 32, 128, 128, 132)
    # 8 pairs: one round either way, and the narrow tile's 4.55 us is cheaper
    assert not forward.use_transposed(1, 8, 128, 128, 132)
    assert not forward.use_transposed(8, 32, 64, 128, 132)          # K = 64: not served


# Same-run forward rows on the H200 (benchmark/results/H200-v5-2026-11-30/call2: H200.md,
# and H200-seg-off.md for 2/8, never split; eager ms): shape -> (bounds, Hv, measured ms).
MEASURED_FWD = {
    "16/32 8x4096": ([b * 4096 for b in range(9)], 32, 0.750),
    "16/64 2x16384": ([0, 16384, 32768], 64, 1.485),
    "16/64 1x32768": ([0, 32768], 64, 2.386),
    "16/16 4x8192": ([b * 8192 for b in range(5)], 16, 0.614),
    "2/8 1x32768": ([0, 32768], 8, 1.922),
    "2/8 1x8192": ([0, 8192], 8, 0.506),
}


@pytest.mark.parametrize("shape", list(MEASURED_FWD))
def test_forward_cost_model_reproduces_the_measured_rows(shape):
    """predicted_fwd_us (the fused kernels' fitted per-chunk costs + the prepare's per
    (chunk, head) cost) within 8% of the forward measured beside the peers."""
    from flash_qla_sm90.kernels.forward import predicted_fwd_us

    bounds, Hv, ms = MEASURED_FWD[shape]
    lens = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    assert abs(predicted_fwd_us(lens, Hv, 128, 128, 132) / 1e3 - ms) < 0.08 * ms


def test_segment_plan_can_be_switched_off(monkeypatch):
    from flash_qla_sm90.kernels import forward, traits

    monkeypatch.setattr(traits, "SEGMENT_AUTO", False)
    assert forward.plan_segment_len([0, 32768], 8, 128, 128, 132) is None


def test_segment_plan_splits_only_few_head_long_sequences(monkeypatch):
    """With the model on: one long sequence at few heads splits (8 (sequence, head)
    pairs on 132 SMs); grids that fill the GPU, short sequences and empty inputs do
    not; the chosen split is predicted cheaper than the unsplit forward."""
    from flash_qla_sm90.kernels import forward, traits

    monkeypatch.setattr(traits, "SEGMENT_AUTO", True)
    seg = forward.plan_segment_len([0, 32768], 8, 128, 128, 132)
    assert seg in traits.SEGMENT_LENS
    pieces = [seg // 64] * (32768 // seg)                         # chunks per segment
    split_us = (3 * forward._fused_us(pieces, 8, 128, 128, 132) + forward._prepare_us(pieces, 8)
                + (32768 // seg) * traits.SEGMENT_SCAN_STEP_US + traits.SEGMENT_FIXED_US)
    assert split_us < forward.predicted_fwd_us([32768], 8, 128, 128, 132)
    for bounds, Hv in (([b * 4096 for b in range(9)], 32), ([0, 32768], 64),
                       ([0, 1000], 8), ([0, 8192], 8), ([0, 0], 8), ([0], 8)):
        assert forward.plan_segment_len(bounds, Hv, 128, 128, 132) is None, (bounds, Hv)


def test_bounded_plan_fills_one_wave(monkeypatch):
    """The bounded split's plan: the shortest segment length whose segments x Hv CTAs
    fit one wave of 132 SMs, for few (sequence, head) pairs; nothing where the grid
    already fills the GPU, no sequence is longer than the shortest length, or the
    unsplit forward is about as fast as the split's host floor (traits.WARMUP_HOST_US)."""
    from flash_qla_sm90.kernels import forward, traits

    monkeypatch.setattr(traits, "SEGMENT_AUTO", True)

    def plan(bounds, Hv):
        return forward.plan_segment_len(bounds, Hv, 128, 128, 132, bounded=True)

    assert plan([0, 32768], 8) == 2048                 # 16 segments x 8 heads = 128 CTAs
    assert plan([0, 32768], 16) == 4096
    assert plan([0, 32768], 4) == 1024
    assert plan([0, 32768], 64) == 16384               # 64 pairs -> 128 CTAs
    assert plan([0, 16384], 8) == 1024
    assert plan([0, 8192], 8) == 512                   # 16 x 8 = 128 CTAs
    monkeypatch.setattr(traits, "WARMUP_HOST_US", 600.0)
    assert plan([0, 8192], 8) is None                  # ~0.5 ms: below that host floor
    monkeypatch.undo()
    monkeypatch.setattr(traits, "SEGMENT_AUTO", True)
    assert plan([0, 60000, 60007, 60307], 4) == 2048   # 30 + 1 + 1 segments x 4
    assert plan([b * 8192 for b in range(5)], 16) == 4096  # 64 pairs -> 128 CTAs
    for bounds, Hv in (([b * 4096 for b in range(9)], 32), ([0, 32768], 132),
                       ([0, 512], 8), ([0, 0], 8), ([0], 8)):
        assert plan(bounds, Hv) is None, (bounds, Hv)
    monkeypatch.setattr(traits, "SEGMENT_AUTO", False)
    assert plan([0, 32768], 8) is None


def test_traits_revision_counts_assignments(monkeypatch):
    """Every assignment to a trait (and its undo) moves ``traits.revision``, the key by
    which the segment planner's cache notices patched traits."""
    from flash_qla_sm90.kernels import traits

    start = traits.revision
    monkeypatch.setattr(traits, "WARMUP_HOST_US", traits.WARMUP_HOST_US + 1.0)
    assert traits.revision == start + 1
    monkeypatch.undo()
    assert traits.revision == start + 2


def test_static_flags_keep_the_shipped_cache_keys():
    """Builder flags at their default (False) are dropped from the end, so a call that
    passes them hits the cache entry of one that omits them."""
    from flash_qla_sm90.kernels.forward import static_flags

    assert static_flags() == ()
    assert static_flags(False, False) == ()
    assert static_flags(True, False) == (True,)
    assert static_flags(False, True) == (False, True)


@pytest.mark.parametrize("longest, total, Hv, fused", [
    (512, 512, 16, False),          # one sequence at 16 heads: 16 CTAs, two kernels
    (64, 512, 16, True),            # 8 segments (or 8 x 4096) at 16 heads: 128 CTAs
    (64, 512, 32, True),            # 8 x 4096 at 32 heads: two waves
    (8, 128, 8, True),              # the bounded split of 2/8 1x8192: 128 CTAs
    (469, 1469, 16, False),         # one long sequence among 100 short ones
    (512, 1024, 8, False),          # two sequences at 8 heads
    (64, 384, 16, True),            # 96 CTAs: above the break-even (~71)
    (64, 256, 16, False),           # 64 CTAs: below it
])
def test_fused_backward_where_its_cost_rule_says(longest, total, Hv, fused):
    """``backward.fused_pays``: the fused reverse kernel for enough (walk, head) CTAs of
    about equal length, the sweep + per-chunk kernel for few CTAs or uneven walks (the
    fused kernel's time is its longest walk's)."""
    from flash_qla_sm90.kernels.backward import fused_pays

    assert fused_pays(longest, total, Hv, 128, 128, 132) is fused
    assert not fused_pays(longest, total, Hv, 64, 64, 132)          # K = V = 128 only


def test_fused_backward_can_be_switched_off(monkeypatch):
    from flash_qla_sm90.kernels import traits
    from flash_qla_sm90.kernels.backward import fused_pays

    monkeypatch.setattr(traits, "BWD_FUSED", False)
    assert not fused_pays(64, 512, 16, 128, 128, 132)


def test_walk_chunks_without_a_host_sync():
    """``backward.walk_chunks``: exact for dense inputs and host offsets, else the token
    count's bound (one sequence holding every token)."""
    import torch

    from flash_qla_sm90.kernels.backward import walk_chunks
    from flash_qla_sm90.kernels.chunk_layout import dense_layout, varlen_layout

    assert walk_chunks(dense_layout(4, 1000, torch.device("cpu")), None) == (16, 64)
    cu = torch.tensor([0, 3000, 3007, 3007, 4207], dtype=torch.int32)
    layout = varlen_layout(cu, 4300)
    assert walk_chunks(layout, cu) == (47, 47 + 1 + 0 + 19)
    assert walk_chunks(layout, None) == (68, 68)                    # ceil(4300 / 64)
