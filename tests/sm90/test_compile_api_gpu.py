"""``torch.compile(fullgraph=True)`` of the public call on the Hopper kernels (the traced
path through ``torch.ops.flash_qla``): outputs and gradients equal the eager call's on
the same inputs (same kernels, states recomputed in the backward) and the fp64
recurrence's within the usual bf16 tolerances."""

from __future__ import annotations

import pytest
import torch

import flash_qla
from tests.helpers import rel_l2
from tests.sm90.test_backward_gpu import TOL as GRAD_TOL
from tests.sm90.test_backward_gpu import _reference_grads
from tests.sm90.test_forward_gpu import TOL, Case, _varlen, make_inputs, reference

pytestmark = pytest.mark.sm90

COMPILE_CASES = [Case(2, 1000, 2, 4), _varlen([700, 0, 1, 1300], 2, 8, pad=5)]


def _step(fn, inp, do, dht):
    leaves = {n: t.detach().clone().requires_grad_(True) for n, t in inp.items()
              if n != "cu_seqlens" and t is not None}
    o, final = fn(leaves, inp["cu_seqlens"])
    torch.autograd.backward([o.float(), final], [do, dht])
    return o, final, {n: t.grad for n, t in leaves.items()}


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("case", COMPILE_CASES, ids=lambda c: c.id)
def test_compiled_training_step_matches_eager(case, backend):
    inp = make_inputs(case, seed=9)

    def call(leaves, cu_seqlens):
        return flash_qla.chunk_gated_delta_rule(**leaves, cu_seqlens=cu_seqlens,
                                                output_final_state=True)

    compiled = torch.compile(call, fullgraph=True, backend=backend)
    gen = torch.Generator(device="cuda").manual_seed(4)
    N = inp["initial_state"].shape[0]
    do = torch.randn(*inp["v"].shape, generator=gen, device="cuda")
    dht = torch.randn(N, case.Hv, 128, 128, generator=gen, device="cuda")
    o_c, final_c, grads_c = _step(compiled, inp, do, dht)
    o_e, final_e, grads_e = _step(call, inp, do, dht)
    assert rel_l2(o_c, o_e) < 1e-3 and rel_l2(final_c, final_e) < 1e-3
    o_ref, final_ref = reference(inp)
    assert rel_l2(o_c, o_ref) < TOL[case.dtype] and rel_l2(final_c, final_ref) < TOL[case.dtype]
    ref = _reference_grads(inp, do, dht)
    for name, tol in GRAD_TOL.items():
        if name in ref:
            assert rel_l2(grads_c[name], ref[name]) < tol, name
            assert rel_l2(grads_c[name], grads_e[name]) < tol, name
