"""The bounded backward's in-kernel walk-end search of chunk_bwd_dh, step by step (CPU).

With ``warmup``, each CTA (segment n, value head h) searches where its reverse sweep
starts from ``seq_end`` / ``seq_index`` / ``log_bound`` (``flash_qla.segments.WalkEnds``),
summing the chunk totals of g_cumsum over the chunks after its segment WALK_UNROLL chunks
a step in fp32. Emulated here as the kernel runs it, it must pick the walk ends of the
reference rule (``segments.warmup_ends``, fp64 on the device) on random gates: decaying,
zero and positive ones, empty, short and ragged sequences. The kernel itself is checked
on the GPU by the bounded split's gradient tests (test_backward_gpu.py).
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


def emulate_walk_ends(g_cumsum: torch.Tensor, rule: segments.WalkEnds):
    """``(walk_end, dht_from)`` ``[Nseg][Hv]`` the way the kernel finds them: the loop of
    ``chunk_bwd_dh`` (fp32 sum, WALK_UNROLL clamped loads a step; dht's row where the
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


@pytest.mark.parametrize("gate", ["typical", "weak", "zero", "mixed"])
@pytest.mark.parametrize("bound", [2.0 ** -9, 0.25])
def test_kernel_search_picks_the_reference_walk_ends(gate, bound):
    gen = torch.Generator().manual_seed(11)
    lens = [3000, 0, 1, 700, 64, 2500, 130]
    bounds = [0, *torch.tensor(lens).cumsum(0).tolist()]
    T, Hv = bounds[-1], 3
    u = torch.rand(1, T, Hv, generator=gen)
    g = {"typical": -0.05 * u, "weak": -0.002 * u, "zero": torch.zeros(1, T, Hv),
         "mixed": 0.02 - 0.08 * u}[gate]                 # mixed: some gates above 0
    plan = segments._plan(tuple(bounds), 256, torch.device("cpu"))
    rule = segments.WalkEnds(plan, bound)
    args, kw = _chunk_cumsum_args(g.double(), bounds)         # the prepare's g_cumsum
    g_cumsum = TORCH_KERNELS.fwd(*args, **kw)[0]
    want = [x.tolist() for x in rule(g_cumsum)]                                # [Nseg][Hv]
    assert emulate_walk_ends(g_cumsum, rule) == tuple(want)
    if gate == "typical":                              # the shortcut is taken somewhere
        assert any(f < 0 for row in want[1] for f in row)
    if gate == "zero":                                 # and never without decay
        assert all(f >= 0 for row in want[1] for f in row)


def test_rule_exposes_the_kernel_arguments():
    bounds = (0, 300, 300, 1000)
    plan = segments._plan(bounds, 128, torch.device("cpu"))
    rule = segments.WalkEnds(plan, 2.0 ** -9)
    # segments: [0,128) [128,256) [256,300) | [300,428) [428,556) ... [940,1000)
    assert rule.seq_end.dtype == rule.seq_index.dtype == torch.int32
    assert rule.seq_end.tolist() == [300] * 3 + [1000] * 6
    assert rule.seq_index.tolist() == [0, 0, 0] + [2] * 6
    assert rule.log_bound == pytest.approx(-9 * math.log(2))
