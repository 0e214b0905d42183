"""The bounded split's in-kernel walk searches, step by step (CPU).

With ``warmup``, each CTA (segment n, value head h) of ``chunk_fwd_ws`` searches where
its recurrence starts, and each CTA of ``chunk_bwd_dh_ws`` where its reverse sweep
starts, from the rule's ``kernel_args`` (``flash_qla.segments.WalkStarts`` /
``WalkEnds``): ``chunk_fwd_ws`` sums the chunk totals of g_cumsum backwards from the
segment's start, ``chunk_bwd_dh_ws`` (``tile_ops.search_walk_end``) forwards from its
end, WALK_UNROLL chunks a step in fp32. Emulated here
as the kernels run them, both must pick the walks of the reference rules
(``segments.warmup_starts`` / ``warmup_ends``, fp64 on the device) on random gates:
decaying, zero and positive ones, empty, short and ragged sequences. The kernels
themselves are checked on the GPU (test_forward_gpu.py, test_backward_gpu.py).
"""

from __future__ import annotations

import math

import pytest
import torch

from flash_qla import segments
from flash_qla.reference import TORCH_KERNELS
from flash_qla_tl.kernels.traits import WALK_UNROLL
from tests.core.test_segments import _chunk_cumsum_args

C = 64
GATES = ["typical", "weak", "zero", "mixed"]
BOUNDS = [2.0 ** -9, 0.25]


def gated_plan(gate: str, lens: list[int], seed: int, bound: float, rule_type):
    """``(rule, g_cumsum)``: sequences of ``lens`` split into segments of 256, random
    gates of kind ``gate`` (mixed: some above 0) for 3 value heads, their chunk-local
    cumsum as the prepare gives it, and the walk rule ``rule_type`` of ``bound``."""
    gen = torch.Generator().manual_seed(seed)
    bounds = [0, *torch.tensor(lens).cumsum(0).tolist()]
    T, Hv = bounds[-1], 3
    u = torch.rand(1, T, Hv, generator=gen)
    g = {"typical": -0.05 * u, "weak": -0.002 * u, "zero": torch.zeros(1, T, Hv),
         "mixed": 0.02 - 0.08 * u}[gate]
    plan = segments._plan(tuple(bounds), 256, torch.device("cpu"))
    args, kw = _chunk_cumsum_args(g.double(), bounds)
    return rule_type(plan, bound), TORCH_KERNELS.fwd(*args, **kw)[0]


def check_shortcut(gate: str, from_rows: list[list[int]]) -> None:
    """With typical gates some walk takes the shortcut (starts from zero, -1), with zero
    gates none does."""
    if gate == "typical":
        assert any(f < 0 for row in from_rows for f in row)
    if gate == "zero":
        assert all(f >= 0 for row in from_rows for f in row)


def emulate_walks(g_cumsum: torch.Tensor, rule: segments.WalkStarts):
    """``(walk, h0_from)`` ``[Nseg][Hv]`` the way the kernel finds them: the loop of
    ``chunk_fwd_ws`` (fp32 sum, WALK_UNROLL loads a step; h0 row where the walk starts at
    its sequence's start)."""
    gc = g_cumsum.reshape(-1, g_cumsum.shape[-1]).float()                   # [T,Hv]
    cu = (rule.plan.cu if rule.plan.cu_cpu is None else rule.plan.cu_cpu).tolist()
    seq0s, seqs = rule.seq_start.tolist(), rule.seq_index.tolist()
    log_bound = torch.tensor(rule.log_bound, dtype=torch.float32)
    walk, h0_from = [], []
    for n in range(len(cu) - 1):
        out_bos, seq0 = cu[n], seq0s[n]
        prefix = (out_bos - seq0) // C
        row_w, row_f = [], []
        for h in range(gc.shape[1]):
            bos, found, decay = seq0, False, torch.zeros((), dtype=torch.float32)
            for step in range(-(-prefix // WALK_UNROLL)):
                if found:
                    break
                totals = [gc[max(out_bos - (step * WALK_UNROLL + u) * C - 1, 0), h]
                          for u in range(WALK_UNROLL)]
                for u in range(WALK_UNROLL):
                    m = step * WALK_UNROLL + u
                    if not found and m < prefix:
                        decay = decay + torch.clamp(totals[u], max=0.0)
                        if decay <= log_bound:
                            found, bos = True, out_bos - (m + 1) * C
            row_w.append(bos)
            row_f.append(seqs[n] if bos == seq0 else -1)
        walk.append(row_w)
        h0_from.append(row_f)
    return walk, h0_from


def emulate_walk_ends(g_cumsum: torch.Tensor, rule: segments.WalkEnds):
    """``(walk_end, dht_from)`` ``[Nseg][Hv]`` the way the kernel finds them: the loop of
    ``chunk_bwd_dh_ws`` (fp32 sum, WALK_UNROLL clamped loads a step; dht's row where the
    walk starts at its sequence's end, else -1 for a zero start)."""
    gc = g_cumsum.reshape(-1, g_cumsum.shape[-1]).float()                   # [T,Hv]
    cu, eoss, seqs = rule.plan.cu_cpu.tolist(), rule.seq_end.tolist(), rule.seq_index.tolist()
    log_bound = torch.tensor(rule.log_bound, dtype=torch.float32)
    walk_end, dht_from = [], []
    for n in range(len(cu) - 1):
        out_eos, eos = cu[n + 1], eoss[n]
        suffix = -(-(eos - out_eos) // C)
        row_e, row_f = [], []
        for h in range(gc.shape[1]):
            end, found, decay = eos, False, torch.zeros((), dtype=torch.float32)
            for step in range(-(-suffix // WALK_UNROLL)):
                if found:
                    break
                totals = [gc[min(out_eos + (step * WALK_UNROLL + u + 1) * C, eos) - 1, h]
                          for u in range(WALK_UNROLL)]
                for u in range(WALK_UNROLL):
                    m = step * WALK_UNROLL + u
                    if not found and m < suffix:
                        decay = decay + torch.clamp(totals[u], max=0.0)
                        if decay <= log_bound:
                            found, end = True, min(out_eos + (m + 1) * C, eos)
            row_e.append(end)
            row_f.append(seqs[n] if end == eos else -1)
        walk_end.append(row_e)
        dht_from.append(row_f)
    return walk_end, dht_from


@pytest.mark.parametrize("gate", ["typical", "zero"])
def test_kernel_search_on_a_device_plan(gate):
    """On a plan laid out on the device (a captured varlen batch), the kernel's search
    finds the host plan's walks for the batch's segments, and for the empty segments at
    the end a walk that starts where they do: no chunk to re-run (with zero gates a walk
    from the last sequence's start would re-run all of it)."""
    lens = [3000, 0, 1, 700, 64, 2500]
    rule, g_cumsum = gated_plan(gate, lens, 7, 2.0 ** -9, segments.WalkStarts)
    bounds = [0, *torch.tensor(lens).cumsum(0).tolist()]
    device = segments.WalkStarts(segments._device_plan(
        torch.tensor(bounds, dtype=torch.int32), bounds[-1], 256), 2.0 ** -9)
    walk, _ = emulate_walks(g_cumsum, device)
    nseg = rule.plan.num_segments
    assert walk[:nseg] == emulate_walks(g_cumsum, rule)[0]
    assert walk[nseg:] and all(w == [bounds[-1]] * 3 for w in walk[nseg:])


@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("bound", BOUNDS)
def test_kernel_search_picks_the_reference_walks(gate, bound):
    rule, g_cumsum = gated_plan(gate, [3000, 0, 1, 700, 64, 2500], 7, bound,
                                segments.WalkStarts)
    want = tuple(x.tolist() for x in rule(g_cumsum))                      # [Nseg][Hv]
    assert emulate_walks(g_cumsum, rule) == want
    check_shortcut(gate, want[1])


@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("bound", BOUNDS)
def test_kernel_search_picks_the_reference_walk_ends(gate, bound):
    rule, g_cumsum = gated_plan(gate, [3000, 0, 1, 700, 64, 2500, 130], 11, bound,
                                segments.WalkEnds)
    want = tuple(x.tolist() for x in rule(g_cumsum))                      # [Nseg][Hv]
    assert emulate_walk_ends(g_cumsum, rule) == want
    check_shortcut(gate, want[1])


def test_rules_expose_the_kernel_arguments():
    bounds = (0, 300, 300, 1000)
    plan = segments._plan(bounds, 128, torch.device("cpu"))
    starts, ends = segments.WalkStarts(plan, 2.0 ** -9), segments.WalkEnds(plan, 2.0 ** -9)
    # segments: [0,128) [128,256) [256,300) | [300,428) [428,556) ... [940,1000)
    for rule, token, want in ((starts, starts.seq_start, [0, 0, 0] + [300] * 6),
                              (ends, ends.seq_end, [300] * 3 + [1000] * 6)):
        assert token.dtype == rule.seq_index.dtype == torch.int32
        assert token.tolist() == want
        assert rule.seq_index.tolist() == [0, 0, 0] + [2] * 6
        assert rule.log_bound == pytest.approx(-9 * math.log(2))
        assert rule.kernel_args == (token, rule.seq_index, rule.log_bound)   # the order
