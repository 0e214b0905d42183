"""The per-call choices of ``flash_qla_tl.plan`` (CPU: the rules, not the kernels).
The planner imports no TileLang."""

from __future__ import annotations

import logging

import pytest
import torch

from flash_qla_tl import plan
from flash_qla_tl.layout import dense_layout, static_flags, varlen_layout, walk_chunks

SMS = 132                         # the H200's SMs, which the cost model was fitted on

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
    """predicted_fwd_us (the recurrence's fitted per-chunk cost + the prepare's per
    (chunk, head) cost) within 8% of the forward measured beside the peers."""
    bounds, Hv, ms = MEASURED_FWD[shape]
    lens = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    assert abs(plan.predicted_fwd_us(lens, Hv, SMS) / 1e3 - ms) < 0.08 * ms


def test_exact_split_only_for_few_head_long_sequences():
    """One long sequence at few heads splits (8 (sequence, head) pairs on 132 SMs),
    predicted cheaper than unsplit; grids that fill the GPU, short sequences and empty
    inputs do not."""
    seg = plan.segment_len([0, 32768], 8, SMS).value
    assert seg in plan.SEGMENT_LENS
    pieces = [seg // 64] * (32768 // seg)                         # chunks per segment
    split_us = (3 * plan.fwd_kernel_us(pieces, 8, SMS) + plan.prepare_us(pieces, 8)
                + (32768 // seg) * plan.SEGMENT_SCAN_STEP_US + plan.SEGMENT_FIXED_US)
    assert split_us < plan.predicted_fwd_us([32768], 8, SMS)


@pytest.mark.parametrize("bounds, Hv", [([b * 4096 for b in range(9)], 32), ([0, 32768], 64),
                                        ([0, 1000], 8), ([0, 8192], 8), ([0, 0], 8), ([0], 8)],
                         ids=["8x4096-32h", "1x32768-64h", "1x1000", "1x8192", "empty", "none"])
def test_exact_split_declined(bounds, Hv):
    choice = plan.segment_len(bounds, Hv, SMS)
    assert choice.value is None and choice.reason


@pytest.mark.parametrize("bounds, Hv, seg", [
    ([0, 32768], 8, 2048),                      # 16 segments x 8 heads = 128 CTAs
    ([0, 32768], 16, 4096),
    ([0, 32768], 4, 1024),
    ([0, 32768], 64, 16384),                    # 64 pairs -> 128 CTAs
    ([0, 16384], 8, 1024),
    ([0, 8192], 8, 512),                        # 16 x 8 = 128 CTAs
    ([0, 60000, 60007, 60307], 4, 1984),        # 31 chunks: 31 + 1 + 1 segments x 4
    ([0, 24576], 64, 12288),                    # two even segments, not 16384 + 8192
    ([0, 20000], 16, 2560),                     # 40 chunks: 8 segments x 16 heads
    ([b * 8192 for b in range(5)], 16, 4096),   # 64 pairs -> 128 CTAs
])
def test_bounded_split_fills_one_wave(bounds, Hv, seg):
    """The bounded split's plan: the shortest segment (whole chunks) whose segments x Hv
    CTAs fit one wave of 132 SMs, for few (sequence, head) pairs: a sequence is cut
    evenly, not into powers of two and a remainder."""
    choice = plan.segment_len(bounds, Hv, SMS, bounded=True)
    assert choice.value == seg, choice


@pytest.mark.parametrize("bounds, Hv", [([b * 4096 for b in range(9)], 32), ([0, 32768], 132),
                                        ([0, 512], 8), ([0, 0], 8), ([0], 8)],
                         ids=["8x4096-32h", "grid-full", "short", "empty", "none"])
def test_bounded_split_declined(bounds, Hv):
    """Nothing where the grid already fills the GPU or no sequence is longer than the
    shortest length."""
    choice = plan.segment_len(bounds, Hv, SMS, bounded=True)
    assert choice.value is None and choice.reason


def test_bounded_split_needs_to_beat_the_host_floor():
    """1 x 8192 at 8 heads (~0.5 ms unsplit) splits at the fitted host floor
    (``WARMUP_HOST_US``), not below a 600 us one."""
    assert plan.plan_bounded([8192], 8, SMS).value == 512
    choice = plan.plan_bounded([8192], 8, SMS, host_us=600.0)
    assert choice.value is None and "gain" in choice.reason


@pytest.mark.parametrize("longest, total, Hv, fused", [
    (512, 512, 16, False),          # one sequence at 16 heads: 16 CTAs, two kernels
    (64, 512, 16, True),            # 8 segments (or 8 x 4096) at 16 heads: 128 CTAs
    (64, 512, 32, True),            # 8 x 4096 at 32 heads: two waves
    (8, 128, 8, True),              # the bounded split of 2/8 1x8192: 128 CTAs
    (469, 1469, 16, False),         # one long sequence among 100 short ones
    (512, 1024, 8, False),          # two sequences at 8 heads
    (64, 384, 16, True),            # 96 CTAs: above the break-even (~71)
    (64, 256, 16, False),           # 64 CTAs: below it
    (0, 0, 16, False),              # no chunk
])
def test_fused_backward_where_its_cost_rule_says(longest, total, Hv, fused):
    """``fused_pays``: the fused reverse kernel for enough (walk, head) CTAs of about
    equal length, the sweep + per-chunk kernel for few CTAs or uneven walks (the fused
    kernel's time is its longest walk's)."""
    assert plan.fused_pays(longest, total, Hv, SMS) is fused


def test_walk_chunks_without_a_host_sync():
    """``layout.walk_chunks``: exact for dense inputs and host offsets, else the token
    count's bound (one sequence holding every token)."""
    assert walk_chunks(dense_layout(4, 1000, torch.device("cpu")), None) == (16, 64)
    cu = torch.tensor([0, 3000, 3007, 3007, 4207], dtype=torch.int32)
    layout = varlen_layout(cu, 4300)
    assert walk_chunks(layout, cu) == (47, 47 + 1 + 0 + 19)
    assert walk_chunks(layout, None) == (68, 68)                    # ceil(4300 / 64)


def test_fused_backward_plans_from_the_walks():
    dense = dense_layout(8, 4096, torch.device("cpu"))              # 8 x 64 chunks
    assert plan.fused_backward(dense, None, 16, SMS).value is True
    one = dense_layout(1, 32768, torch.device("cpu"))
    choice = plan.fused_backward(one, None, 16, SMS)
    assert choice.value is False and "chunk_state_grad" in choice.reason


def test_keep_states_where_the_chunk_count_needs_no_sync(monkeypatch):
    """Dense, host offsets, or inside a capture (h sized by the layout's bound) where
    the backward reads h in the same chunk numbering."""
    cu = torch.tensor([0, 100, 300], dtype=torch.int32)
    assert plan.keep_states(dense_layout(2, 64, torch.device("cpu")), None).value is True
    assert plan.keep_states(varlen_layout(cu, 300), cu).value is True
    choice = plan.keep_states(varlen_layout(cu, 300), None)
    assert choice.value is False and "sync" in choice.reason
    monkeypatch.setattr(plan, "is_capturing", lambda device: True)
    choice = plan.keep_states(varlen_layout(cu, 300), None, bound_ok=True)
    assert choice.value is True and "bound" in choice.reason
    # a varlen split laid out on the device: its backward runs unsplit, h not kept
    assert plan.keep_states(varlen_layout(cu, 300), None).value is False


def test_fused_backward_in_a_capture_follows_the_warm_up_lengths():
    """Without host offsets (a capture) the walks are bounded by the token count, which
    keeps the two kernels for 6 sequences of 16k tokens at 16/32; the host copy an
    eager warm-up kept of the same tensor, passed as ``hint``, plans as eagerly."""
    cu = torch.tensor([0, 5000, 8000, 10500, 12500, 14884, 16384], dtype=torch.int32)
    layout = varlen_layout(cu, 16384)
    assert plan.fused_backward(layout, cu, 32, SMS).value is True
    assert plan.fused_backward(layout, None, 32, SMS).value is False
    assert plan.fused_backward(layout, None, 32, SMS, hint=cu).value is True


def test_each_choice_is_logged_once(caplog):
    """A choice is logged at debug level when first made for its arguments; repeating
    the call (a training loop) logs nothing more."""
    plan._segment_len.cache_clear()
    plan._fused_backward.cache_clear()
    with caplog.at_level(logging.DEBUG, logger="flash_qla_tl.plan"):
        for _ in range(3):
            plan.segment_len([0, 32768], 8, SMS, bounded=True)
            plan.fused_pays(64, 512, 16, SMS)
            plan.fused_backward(dense_layout(8, 4096, torch.device("cpu")), None, 16, SMS)
    messages = [r.getMessage() for r in caplog.records if r.name == "flash_qla_tl.plan"]
    assert len(messages) == 2, messages
    assert messages[0].startswith("bounded segment split: 2048 (")
    assert messages[1].startswith("fused backward: True (chunk_grads_fused")


def test_static_flags_drop_trailing_false():
    """Builder flags at their default (False) are dropped from the end, so a call that
    passes them and one that omits them share a launcher."""
    assert static_flags() == ()
    assert static_flags(False, False) == ()
    assert static_flags(True, False) == (True,)
    assert static_flags(False, True) == (False, True)


@pytest.mark.parametrize("lens, Hv, seg", [
    ([16000] + [1000] * 8, 32, 5888),           # 250 chunks against a spread of 92
    ([16000] + [1000] * 8, 16, 2944),
    ([5000, 3000, 2500, 2000, 2384, 1500], 32, None),   # 79 chunks, spread 63: whole
    ([2048] * 64, 32, None),                    # none longer than the spread
], ids=["dominant-32h", "dominant-16h", "six-comparable", "uniform"])
def test_multi_wave_split_only_for_a_dominant_sequence(lens, Hv, seg):
    """Where the (sequence, head) CTAs outnumber the SMs, only a sequence whose chain
    outlasts Graham's bound of the split is cut, into segments of the spread."""
    choice = plan.plan_bounded(lens, Hv, SMS)
    assert choice.value == seg, choice
    if seg is not None:
        assert seg % 64 == 0 and seg < max(lens)


def test_captured_guess_is_not_split_when_the_grid_is_full():
    """A capture's guess of the lengths (one sequence with nearly every token, N - 1 of
    one token) splits nothing once N x Hv fills the GPU: a replay's real batch is
    likely many short sequences."""
    N, Tt = 64, 16384
    guess = [0, *range(Tt - N + 1, Tt + 1)]
    assert plan.segment_len(guess, 32, SMS, bounded=True).value is not None
    assert plan.segment_len(guess, 32, SMS, bounded=True, dominant=False).value is None


@pytest.mark.parametrize("chunks, Hv, expected", [
    ([24, 38, 32, 40, 47, 79], 32, [5, 4, 3, 1, 2, 0]),   # an RL batch, longest packed last
    ([2, 9, 0, 9, 5], 32, [1, 3, 4, 0, 2]),               # ties keep their packing order
    ([79, 47, 40, 38, 32, 24], 32, None),                 # already longest first
    ([24, 79], 64, None),                                 # 128 CTAs: one wave, no order
    ([], 32, None),
])
def test_longest_first_grid_order(chunks, Hv, expected):
    """The recurrence's grid starts the longest sequences first only where it has
    several waves and the packing is not longest first already; the order is a
    permutation (every sequence once)."""
    from flash_qla_tl.layout import longest_first

    order = longest_first(chunks, Hv, SMS)
    assert order == expected
    if order is not None:
        assert sorted(order) == list(range(len(chunks)))
        assert [chunks[n] for n in order] == sorted(chunks, reverse=True)


def test_grid_order_is_never_asked_for_off_a_cuda_device():
    """Off a CUDA device (the CPU host path), and without host offsets, the launch gets
    the unread placeholder and ``ordered`` 0."""
    from flash_qla_tl.layout import cta_order

    cu = torch.tensor([0, 100, 5000, 5100], dtype=torch.int32)
    from flash_qla_sm90.arch import SM90

    for cu_cpu in (cu, None):
        order, ordered = cta_order(SM90, cu_cpu, 64, torch.device("cpu"))
        assert ordered == 0 and order.numel() == 1


def test_grid_order_on_a_device_is_made_eagerly_and_reused_by_captures(monkeypatch):
    """On a CUDA device (stand-ins here: no GPU): a grid of one wave asks for no order; a
    grid of several waves gets the eager call's order, which a capture then reuses (and
    keeps) instead of making one; a capture with no eager order keeps grid order."""
    from flash_qla_sm90.arch import SM90
    from flash_qla_tl import layout

    cuda = torch.device("cuda")
    made, capturing = [], [False]
    monkeypatch.setattr(layout, "sm_count", lambda device: SMS)
    monkeypatch.setattr(layout, "no_walk", lambda device: "placeholder")
    monkeypatch.setattr(layout, "is_capturing", lambda device: capturing[0])
    monkeypatch.setattr(layout, "_ORDERS", {})
    monkeypatch.setattr(layout, "_GRAPH_ORDERS", {})

    def device_order(key):
        made.append(key)
        layout._ORDERS[key] = order = torch.tensor(
            layout.longest_first(*key[:3]), dtype=torch.int32)
        return order

    monkeypatch.setattr(layout, "_device_order", device_order)
    one_wave = torch.tensor([0, 64, 5000], dtype=torch.int32)           # 2 x 64 CTAs
    assert layout.cta_order(SM90, one_wave, 64, cuda) == ("placeholder", 0)
    late = torch.tensor([0, 64, 128, 5000], dtype=torch.int32)          # 3 x 64, longest last
    order, ordered = layout.cta_order(SM90, late, 64, cuda)
    assert ordered == 1 and order.tolist() == [2, 0, 1] and len(made) == 1
    capturing[0] = True
    assert layout.cta_order(SM90, late, 64, cuda)[0] is order and len(made) == 1
    assert list(layout._GRAPH_ORDERS.values()) == [order]
    other = torch.tensor([0, 1, 64, 5000], dtype=torch.int32)           # not made eagerly
    assert layout.cta_order(SM90, other, 64, cuda) == ("placeholder", 0)
