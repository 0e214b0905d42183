"""The unit suite FlashQLA documents: ``python -m pytest tests/test_gdr_unit.py -v``.

Forward and backward of ``flash_qla.chunk_gated_delta_rule`` against the fp64
token-by-token recurrence (``flash_qla.reference``, through the helpers of
``tests/core/test_api.py``), over dense, varlen, GVA, initial-state (both state
layouts) and padding cases, bf16 inputs with fp32 gates, relative L2 error below
FlashQLA's 0.02 (``tests.helpers.rel_l2``: NaN never passes).

Where a CUDA GPU is visible it runs there (K = V = 128, the Hopper kernels); without
one it runs on the ``torch`` backend on the CPU, with K = V = 32 to stay fast. Every
test id ends with where it ran (``-cuda`` or ``-torch-cpu``), and the session header
says it too (``tests/conftest.py``).
"""

from __future__ import annotations

import pytest
import torch

import flash_qla
from tests.core.test_api import Config, cu_tensor, errors, grads, make_inputs, oracle, too_large

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
RUNS_ON = "cuda" if ON_GPU else "torch-cpu"
HEAD_DIM = 128 if ON_GPU else 32
DTYPE = torch.bfloat16
RTOL = 0.02

# id -> (B, T, Hk, Hv, cu_seqlens)
CASES = {
    "B1-T300-Hk2-Hv2": (1, 300, 2, 2, None),
    "B2-T129-Hk1-Hv4": (2, 129, 1, 4, None),                        # GVA, odd T
    "B1-T300-Hk2-Hv4-varlen": (1, 300, 2, 4, (0, 67, 67, 131, 300)),  # an empty sequence
    "B1-T65-Hk1-Hv2-varlen-len1": (1, 65, 1, 2, (0, 1, 65)),       # a one-token sequence
    "B1-T300-Hk2-Hv4-padding": (1, 300, 2, 4, (0, 100, 211, 250)),  # 50 padding tokens
}

# id -> (with an initial state, v-first state layout)
STATES = {"no_h0": (False, False), "h0-kv": (True, False), "h0-vk": (True, True)}


def config(case: str) -> Config:
    B, T, Hk, Hv, cu = CASES[case]
    return Config(B=B, T=T, Hk=Hk, Hv=Hv, K=HEAD_DIM, V=HEAD_DIM, cu_seqlens=cu)


def run(case: str, state: str):
    """(ours, the oracle's, our leaves, the oracle's leaves) for one case: ours on DEVICE,
    the oracle on the CPU in fp64 from the same values (zeros standing for no h0)."""
    cfg = config(case)
    use_h0, v_first = STATES[state]
    inputs = make_inputs(cfg, DTYPE, torch.float32, DTYPE, v_first=v_first)
    if not use_h0:
        inputs["initial_state"] = torch.zeros_like(inputs["initial_state"])
    leaves = {n: x.detach().to(DEVICE).requires_grad_()
              for n, x in inputs.items() if use_h0 or n != "initial_state"}
    cu = cu_tensor(cfg)
    out = flash_qla.chunk_gated_delta_rule(
        **leaves, cu_seqlens=None if cu is None else cu.to(DEVICE), output_final_state=True,
        state_v_first=v_first)
    ref = oracle(inputs, cfg, v_first=v_first)
    return out, ref, leaves, {n: inputs[n] for n in leaves}


#: state ids carry where the test ran: ``test_fwd[B1-T300-Hk2-Hv4-varlen-h0-vk-torch-cpu]``
STATE_IDS = [f"{name}-{RUNS_ON}" for name in STATES]


@pytest.mark.parametrize("state", list(STATES), ids=STATE_IDS)
@pytest.mark.parametrize("case", list(CASES))
def test_fwd(case, state):
    out, ref, _, _ = run(case, state)
    assert (out[0].dtype, out[1].dtype) == (DTYPE, torch.float32)
    assert too_large(errors({"o": out[0], "final_state": out[1]},
                            {"o": ref[0], "final_state": ref[1]}), RTOL) == {}


@pytest.mark.parametrize("state", list(STATES), ids=STATE_IDS)
@pytest.mark.parametrize("case", list(CASES))
def test_bwd(case, state):
    """Gradients of every input under fixed random weights on o and the final state."""
    out, ref, leaves, ref_leaves = run(case, state)
    assert too_large(errors(grads(out, leaves), grads(ref, ref_leaves)), RTOL) == {}
