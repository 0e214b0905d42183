"""The fused reverse kernel (``chunk_bwd_fused``: the state-gradient sweep and every
per-chunk gradient in one CTA per (sequence, value head)) against the chunk-parallel
PyTorch gradients given the same states, and, through the public API's autograd, against
the fp64 token-by-token recurrence. Tolerances as the backward's other GPU tests (bf16:
dq, dk, dv, dh0 < 1e-2, dbeta, dg < 2e-2, relative L2); NaN fails every comparison."""

from __future__ import annotations

import pytest
import torch

import flash_qla
from tests.helpers import force_fused_backward, kernel_arch, rel_l2, skip_unless_fused_kernel
from tests.sm90.test_backward_gpu import (
    BOUNDED_BWD_CASES,
    BWD_CASES,
    SAME_HEAD_CASES,
    TOL,
    _grads,
    _reference_grads,
    swept_problem,
)
from tests.sm90.test_forward_gpu import CASES, Case, make_inputs

pytestmark = pytest.mark.sm90


@pytest.fixture(autouse=True)
def _fused_kernel_built():
    """The served arch builds the fused kernel (not SM120: ``Arch.fused_backward``)."""
    skip_unless_fused_kernel()

#: GVA 2/4, strong and zero gates, varlen with an empty sequence, length-1 ones and
#: padding, varlen GVA 4/16, one long and two short sequences without h0, T = 75 at
#: one head (a full chunk and an 11-row tail), fp16, Hv = Hk
FUSED_CASES = [*BWD_CASES, CASES[1], CASES[8], *SAME_HEAD_CASES]


def _force_fused(monkeypatch, on: bool = True) -> list:
    """Both backwards take the fused kernel (``plan.fused_backward`` would leave these
    small grids to the two kernels), or never. Returns the list every run of
    ``fused_grads`` appends to, so a test can check which path ran."""
    from flash_qla_tl import backward

    force_fused_backward(monkeypatch, on)
    runs = []
    real = getattr(backward.fused_grads, "real", backward.fused_grads)

    def spy(*a, **kw):
        runs.append(kw["dht"] is not None)
        return real(*a, **kw)

    spy.real = real
    monkeypatch.setattr(backward, "fused_grads", spy)
    return runs


def _errors(ours, ref, names):
    return {n: rel_l2(a.float(), b.float()) for n, a, b in zip(names, ours, ref)}


@pytest.mark.parametrize("case", FUSED_CASES, ids=lambda c: c.id)
def test_fused_kernel_matches_torch_chunk_grads(case):
    """``fused_grads`` (h in q's dtype, as the backward keeps it) against the
    chunk-parallel PyTorch gradients and sweep given the same states: every gradient and
    dh0, same shapes and dtypes."""
    from flash_qla_tl.backward import fused_grads

    x = swept_problem(case)
    ours = fused_grads(*x.args, x.h, arch=kernel_arch(), dht=x.dht, **x.common)
    ref = (*x.ref[:5], x.dh0)
    names = ("dq", "dk", "dv", "dbeta", "dg", "dh0")
    tol = dict(zip(names, (1e-2, 1e-2, 1e-2, 2e-2, 2e-2, 1e-2)))
    errors = _errors(ours, ref, names)
    for name, a, b in zip(names, ours, ref):
        assert a.dtype == b.dtype and a.shape == b.shape, name
    assert all(errors[n] < tol[n] for n in names), errors


@pytest.mark.parametrize("case", FUSED_CASES, ids=lambda c: c.id)
def test_fused_backward_matches_recurrence(case, monkeypatch):
    """The public API's backward with the fused kernel (no segment split) against
    autograd through the fp64 recurrence."""
    runs = _force_fused(monkeypatch)
    inp = make_inputs(case, seed=2)
    ours, do, dht = _grads(inp, auto_cp=False)
    assert runs == [True]
    ref = _reference_grads(inp, do, dht)
    errors = {n: rel_l2(ours[n], ref[n]) for n in TOL if n in ref}
    assert all(errors[n] < TOL[n] for n in errors), errors


def test_fused_backward_deterministic(monkeypatch):
    _force_fused(monkeypatch)
    inp = make_inputs(CASES[12], seed=4)
    first, _, _ = _grads(inp, auto_cp=False)
    again, _, _ = _grads(inp, auto_cp=False)
    for name in first:
        assert torch.equal(first[name], again[name]), name


def test_fused_backward_long_sequence(monkeypatch):
    """One 32768-token sequence, GVA 4/16 (a walk of 512 chunks per CTA)."""
    _force_fused(monkeypatch)
    case = Case(1, 32768, 4, 16)
    inp = make_inputs(case, seed=3)
    ours, do, dht = _grads(inp, auto_cp=False)
    _force_fused(monkeypatch, False)
    base, _, _ = _grads(inp, auto_cp=False)
    errors = {n: rel_l2(ours[n].float(), base[n].float()) for n in base}
    assert all(e < 1e-2 for e in errors.values()), errors


@pytest.mark.parametrize("case, segment_len", BOUNDED_BWD_CASES,
                         ids=[f"{c.id}-seg{s}" for c, s in BOUNDED_BWD_CASES])
def test_fused_bounded_split_matches_recurrence(case, segment_len, monkeypatch):
    """The bounded split's backward with the fused kernel (the boundary sweep walks only
    the warm-up chunks after each segment, the fused kernel walks the segment from
    there) against the fp64 recurrence and the two-kernel bounded backward."""
    inp = make_inputs(case, seed=4)
    runs = _force_fused(monkeypatch)
    ours, do, dht = _grads(inp, segment_len=segment_len)
    assert runs == [True]                  # dht: the boundary sweep's dS per segment
    _force_fused(monkeypatch, False)
    base, _, _ = _grads(inp, segment_len=segment_len)
    ref = _reference_grads(inp, do, dht)
    errors = {n: (rel_l2(ours[n], ref[n]), rel_l2(ours[n], base[n])) for n in TOL if n in ref}
    assert all(max(e) < TOL[n] for n, e in errors.items()), errors


def test_fused_backward_without_final_state(monkeypatch):
    """A training step that returns no final state (dht None: the kernel variant that
    starts each walk from zero) against the fp64 recurrence; varlen GVA with padding."""
    runs = _force_fused(monkeypatch)
    inp = make_inputs(CASES[12], seed=9)
    leaves = {n: t.detach().clone().requires_grad_(True) for n, t in inp.items()
              if n != "cu_seqlens" and t is not None}
    o, final = flash_qla.chunk_gated_delta_rule(**leaves, cu_seqlens=inp["cu_seqlens"],
                                                auto_cp=False)
    do = torch.randn(o.shape, generator=torch.Generator(device=o.device).manual_seed(5),
                     device=o.device)
    o.float().backward(do)
    assert final is None and runs == [False]
    N, (Hv, V), K = inp["cu_seqlens"].numel() - 1, inp["v"].shape[2:], inp["q"].shape[-1]
    ref = _reference_grads(inp, do, torch.zeros(N, Hv, K, V, device=o.device))
    errors = {n: rel_l2(leaves[n].grad, ref[n]) for n in TOL if n in ref}
    assert all(errors[n] < TOL[n] for n in errors), errors
