"""The call FLA 0.5.2+ makes when it routes to ``flash_qla`` (device ``cu_seqlens`` only,
eager, gradients on; ``state_v_first``) against the same call given ``cu_seqlens_cpu``
and the fp64 recurrence; and that call captured in a CUDA graph (training step
included), which must neither sync nor break the process's CUDA RNG."""

from __future__ import annotations

import pytest
import torch

import flash_qla
from flash_qla import api, offsets
from tests.helpers import rel_l2
from tests.sm90.test_backward_gpu import TOL as GRAD_TOL
from tests.sm90.test_backward_gpu import _reference_grads
from tests.sm90.test_forward_gpu import TOL, _varlen, make_inputs, reference

pytestmark = pytest.mark.sm90

# one long sequence among short ones (the planner splits it), an RL-style batch, and a
# batch with empty / one-token sequences and padding
DROP_IN_CASES = [
    _varlen([20000, 7, 300], 2, 4),
    _varlen([700, 1300, 64, 2100, 5, 900], 4, 8),
    _varlen([0, 1, 130, 0, 3000], 2, 8, pad=11, gate="strong"),
]


def _step(inp, seed=11, **kwargs):
    """One FLA-convention training step: ``(o, final_state, grads)`` under random dO and
    dht (v-first states, as FLA's flash_qla backend passes them)."""
    leaves = {n: t.detach().clone().requires_grad_(True) for n, t in inp.items()
              if n != "cu_seqlens" and t is not None}
    h0 = leaves.get("initial_state")
    if h0 is not None:
        leaves["initial_state"] = h0.detach().transpose(-1, -2).contiguous().requires_grad_()
    o, final = flash_qla.chunk_gated_delta_rule(
        **leaves, output_final_state=True, cu_seqlens=inp["cu_seqlens"], state_v_first=True,
        auto_cp=True, **kwargs)
    gen = torch.Generator(device=o.device).manual_seed(seed)
    do = torch.randn(o.shape, generator=gen, device=o.device, dtype=torch.float32)
    dht = torch.randn(final.shape, generator=gen, device=o.device)
    torch.autograd.backward([o.float(), final], [do, dht])
    grads = {n: t.grad for n, t in leaves.items()}
    if "initial_state" in grads:
        grads["initial_state"] = grads["initial_state"].transpose(-1, -2)
    return o, final.transpose(-1, -2), grads, do, dht.transpose(-1, -2)


@pytest.mark.parametrize("case", DROP_IN_CASES, ids=lambda c: c.id)
def test_device_offsets_plan_and_compute_as_host_offsets(case, monkeypatch):
    """Same segment plan, bitwise the same outputs and gradients as with
    ``cu_seqlens_cpu``, one host read for the whole step, and fp64-accurate."""
    plans, reads = [], []
    real_plan = api._auto_segment_len
    monkeypatch.setattr(api, "_auto_segment_len",
                        lambda *a: (plans.append(real_plan(*a)), plans[-1])[1])
    real_copy = offsets._copy_to_host
    monkeypatch.setattr(offsets, "_copy_to_host", lambda t: (reads.append(1), real_copy(t))[1])
    offsets.clear_cache()
    inp = make_inputs(case, seed=7)
    o, final, grads, do, dht = _step(inp)
    assert len(reads) == 1
    o_host, final_host, grads_host, _, _ = _step(inp, cu_seqlens_cpu=inp["cu_seqlens"].cpu())
    assert len(reads) == 1
    assert plans[0] == plans[1]
    assert torch.equal(o, o_host) and torch.equal(final, final_host)
    for name in grads:
        assert torch.equal(grads[name], grads_host[name]), name
    o_ref, final_ref = reference(inp)
    assert rel_l2(o, o_ref) < TOL[case.dtype] and rel_l2(final, final_ref) < TOL[case.dtype]
    ref = _reference_grads(inp, do, dht)
    for name, tol in GRAD_TOL.items():
        if name in ref:
            assert rel_l2(grads[name], ref[name]) < tol, name


def test_layers_share_one_read(monkeypatch):
    """A model's layers pass the same offsets tensor: one read for all of them; an
    in-place edit of it (a new batch in the same buffer) is read again."""
    reads = []
    real_copy = offsets._copy_to_host
    monkeypatch.setattr(offsets, "_copy_to_host", lambda t: (reads.append(1), real_copy(t))[1])
    offsets.clear_cache()
    inp = make_inputs(_varlen([500, 300, 224], 2, 4), seed=3)
    args = {n: t for n, t in inp.items() if n != "cu_seqlens"}
    with torch.no_grad():
        for _ in range(4):
            flash_qla.chunk_gated_delta_rule(**args, cu_seqlens=inp["cu_seqlens"])
        assert len(reads) == 1
        inp["cu_seqlens"].copy_(torch.tensor([0, 100, 600, 1024], device="cuda"))
        o, _ = flash_qla.chunk_gated_delta_rule(**args, cu_seqlens=inp["cu_seqlens"])
    assert len(reads) == 2
    o_ref, _ = reference(inp)
    assert rel_l2(o, o_ref) < TOL[torch.bfloat16]


def test_inference_offsets_refilled_in_place():
    """An engine's prefill under ``torch.inference_mode`` refilling one offsets tensor in
    place between steps (an inference tensor: no version counter to notice it) gets
    each step computed on the offsets it holds then, state-pool forward included."""
    inp = make_inputs(_varlen([500, 300, 224], 2, 4), seed=5)
    args = {n: t for n, t in inp.items() if n != "cu_seqlens"}
    pool = torch.zeros(3, 4, 128, 128, device="cuda")
    slots = torch.tensor([2, 0, 1], dtype=torch.int32, device="cuda")
    with torch.inference_mode():
        cu = inp["cu_seqlens"].clone()
        for bounds in ([0, 500, 800, 1024], [0, 100, 600, 1024], [0, 1, 1023, 1024]):
            cu.copy_(torch.tensor(bounds, device="cuda"))
            o, final = flash_qla.chunk_gated_delta_rule(**args, cu_seqlens=cu,
                                                        output_final_state=True)
            h0 = args["initial_state"]
            pool[slots.long()] = h0
            o_pool = flash_qla.chunk_gated_delta_rule(
                **{n: t for n, t in args.items() if n != "initial_state"}, cu_seqlens=cu,
                initial_state=pool, state_indices=slots, output_final_state=True)[0]
            ref = reference({**inp, "cu_seqlens": torch.tensor(bounds, device="cuda")})
            assert rel_l2(o, ref[0]) < TOL[torch.bfloat16], bounds
            assert rel_l2(final, ref[1]) < TOL[torch.bfloat16], bounds
            assert rel_l2(o_pool, ref[0]) < TOL[torch.bfloat16], bounds
            assert rel_l2(pool[slots.long()], ref[1]) < TOL[torch.bfloat16], bounds


@pytest.mark.parametrize("warm_copy", [True, False], ids=["warm-up-read", "no-host-copy"])
@pytest.mark.parametrize("case", DROP_IN_CASES[1:], ids=lambda c: c.id)
def test_captured_training_step_with_device_offsets(case, warm_copy):
    """Forward with grad + every gradient, varlen, device ``cu_seqlens`` only, captured as
    one CUDA graph: the capture holds (no host read or sync inside), a replay on fresh
    inputs matches the fp64 recurrence, and the CUDA RNG still works afterwards. The
    split is planned from the warm-up's host copy, or without one (``no-host-copy``)."""
    inp = make_inputs(case, seed=5)
    cu = inp.pop("cu_seqlens")
    leaves = {n: t.detach().clone().requires_grad_(True) for n, t in inp.items() if t is not None}
    gen = torch.Generator(device="cuda").manual_seed(2)
    T, Hv = inp["v"].shape[1:3]
    do = torch.randn(1, T, Hv, 128, generator=gen, device="cuda", dtype=torch.bfloat16)
    dht = torch.randn(cu.numel() - 1, Hv, 128, 128, generator=gen, device="cuda")

    def step():
        o, final = flash_qla.chunk_gated_delta_rule(**leaves, cu_seqlens=cu,
                                                    output_final_state=True)
        return (o, final, *torch.autograd.grad((o, final), list(leaves.values()), (do, dht)))

    stream, graph = torch.cuda.Stream(), torch.cuda.CUDAGraph()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()                                           # warm-up off-graph
        if not warm_copy:
            offsets.clear_cache()
        with torch.cuda.graph(graph):
            captured = step()
    torch.cuda.current_stream().wait_stream(stream)
    fresh = make_inputs(case, seed=6)
    with torch.no_grad():
        for name, t in leaves.items():
            t.copy_(fresh[name])
    graph.replay()
    torch.cuda.synchronize()
    o_ref, final_ref = reference(fresh)
    assert rel_l2(captured[0], o_ref) < TOL[case.dtype]
    assert rel_l2(captured[1], final_ref) < TOL[case.dtype]
    ref = _reference_grads(fresh, do.float(), dht)
    for name, got in zip(leaves, captured[2:]):
        assert rel_l2(got, ref[name]) < GRAD_TOL[name], name
    assert torch.isfinite(torch.randn(8, device="cuda")).all()     # RNG usable


def test_uncapturable_backend_is_refused_before_the_stream():
    """The torch reference backend reads bounds on the host: inside a capture it raises
    a ValueError naming the way out, the capture itself stays valid, and the process
    keeps working (no invalidated capture, usable RNG)."""
    inp = make_inputs(_varlen([100, 60], 1, 2), seed=1)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        with pytest.raises(ValueError, match="cannot run inside a CUDA-graph capture"):
            with torch.cuda.graph(graph):
                flash_qla.chunk_gated_delta_rule(**inp, backend="torch")
    torch.cuda.synchronize()
    assert torch.isfinite(torch.randn(8, device="cuda")).all()
    o, _ = flash_qla.chunk_gated_delta_rule(**inp)
    assert rel_l2(o, reference(inp)[0]) < TOL[torch.bfloat16]
