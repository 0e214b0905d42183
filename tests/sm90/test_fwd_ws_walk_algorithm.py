"""The bounded split's in-kernel walk search of chunk_fwd_ws, step by step (CPU).

With ``warmup``, each CTA (segment n, value head h) searches its own walk start from
``seq_start`` / ``seq_index`` / ``log_bound`` (``flash_qla.segments.WalkStarts``), summing
the chunk totals of g_cumsum backwards WALK_UNROLL chunks a step in fp32. Emulated here
as the kernel runs it, it must pick the walks of the reference rule
(``segments.warmup_starts``, fp64 on the device) on random gates: decaying, zero and
positive ones, empty and short sequences. The kernel itself is checked against the
torch backend on the GPU (test_forward_gpu.py).
"""

from __future__ import annotations

import math

import pytest
import torch

from flash_qla import segments
from flash_qla.reference import TORCH_KERNELS
from flash_qla_sm90.kernels.traits import WALK_UNROLL
from tests.core.test_segments import _chunk_cumsum_args

C = 64


def emulate_walks(g_cumsum: torch.Tensor, rule: segments.WalkStarts):
    """``(walk, h0_from)`` ``[Nseg][Hv]`` the way the kernel finds them: the loop of
    ``chunk_fwd_ws`` (fp32 sum, WALK_UNROLL loads a step; h0 row where the walk starts at
    its sequence's start)."""
    gc = g_cumsum.reshape(-1, g_cumsum.shape[-1]).float()                   # [T,Hv]
    cu, seq0s, seqs = rule.plan.cu_cpu.tolist(), rule.seq_start.tolist(), rule.seq_index.tolist()
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


@pytest.mark.parametrize("gate", ["typical", "weak", "zero", "mixed"])
@pytest.mark.parametrize("bound", [2.0 ** -9, 0.25])
def test_kernel_search_picks_the_reference_walks(gate, bound):
    gen = torch.Generator().manual_seed(7)
    lens = [3000, 0, 1, 700, 64, 2500]
    bounds = [0, *torch.tensor(lens).cumsum(0).tolist()]
    T, Hv = bounds[-1], 3
    u = torch.rand(1, T, Hv, generator=gen)
    g = {"typical": -0.05 * u, "weak": -0.002 * u, "zero": torch.zeros(1, T, Hv),
         "mixed": 0.02 - 0.08 * u}[gate]                 # mixed: some gates above 0
    plan = segments._plan(tuple(bounds), 256, torch.device("cpu"))
    rule = segments.WalkStarts(plan, bound)
    args, kw = _chunk_cumsum_args(g.double(), bounds)         # the prepare's g_cumsum
    g_cumsum = TORCH_KERNELS.fwd(*args, **kw)[0]
    walk, h0_from = (x.t().tolist() for x in rule(g_cumsum))              # [Hv][Nseg]
    want = ([list(r) for r in zip(*walk)], [list(r) for r in zip(*h0_from)])  # [Nseg][Hv]
    assert emulate_walks(g_cumsum, rule) == want
    if gate == "typical":                              # the shortcut is taken somewhere
        assert any(f < 0 for row in want[1] for f in row)
    if gate == "zero":                                 # and never without decay
        assert all(f >= 0 for row in want[1] for f in row)


def test_rule_exposes_the_kernel_arguments():
    bounds = (0, 300, 300, 1000)
    plan = segments._plan(bounds, 128, torch.device("cpu"))
    rule = segments.WalkStarts(plan, 2.0 ** -9)
    # segments: [0,128) [128,256) [256,300) | [300,428) [428,556) ... [940,1000)
    assert rule.seq_start.dtype == rule.seq_index.dtype == torch.int32
    assert rule.seq_start.tolist() == [0, 0, 0] + [300] * 6
    assert rule.seq_index.tolist() == [0, 0, 0] + [2] * 6
    assert rule.log_bound == pytest.approx(-9 * math.log(2))
