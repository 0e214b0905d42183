"""Hopper backward (through the autograd of the public API) against autograd through the
fp64 token-by-token recurrence. Tolerances in bf16: dq, dk, dv, dh0 < 1e-2 and
dbeta, dg < 2e-2 (relative L2)."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
import torch

import flash_qla
from tests.helpers import chunk_start_states, kernel_arch, rel_l2, skip_unless_fused_kernel
from tests.sm90.test_forward_gpu import (
    CASES,
    POISON_CASES,
    Case,
    _varlen,
    make_inputs,
    reference,
)
from tests.sm90.test_forward_gpu import (
    TOL as FWD_TOL,
)

pytestmark = pytest.mark.sm90

TOL = {"q": 1e-2, "k": 1e-2, "v": 1e-2, "initial_state": 1e-2, "beta": 2e-2, "g": 2e-2}

BWD_CASES = [
    CASES[0],                                   # dense B=2, T=1000, GVA 2/4
    Case(1, 2048, 8, 8, gate="strong"),
    Case(2, 777, 2, 16, gate="zero"),
    CASES[11],                                  # varlen, empty + length-1, padding
    CASES[12],                                  # varlen GVA 4/16, padding
    _varlen([4096, 3, 200], 2, 4, h0=False),
]


def _grads(inp, backend=None, seed=11, do_padding=None, **kwargs):
    """Gradients of every input under random dO and dht; ``do_padding`` fills dO's rows
    after cu_seqlens[-1] (padding tokens) with that value; ``kwargs`` go to the API."""
    leaves = {n: t.detach().clone().requires_grad_(True) for n, t in inp.items()
              if n != "cu_seqlens" and t is not None}
    o, final = flash_qla.chunk_gated_delta_rule(**leaves, cu_seqlens=inp["cu_seqlens"],
                                                output_final_state=True, backend=backend,
                                                **kwargs)
    gen = torch.Generator(device=o.device).manual_seed(seed)
    do = torch.randn(o.shape, generator=gen, device=o.device, dtype=torch.float32)
    dht = torch.randn(final.shape, generator=gen, device=o.device)
    if do_padding is not None:
        do[:, int(inp["cu_seqlens"][-1]):] = do_padding
    torch.autograd.backward([o.float(), final], [do, dht])
    return {n: t.grad for n, t in leaves.items()}, do, dht


def _reference_grads(inp, do, dht):
    leaves = {n: t.detach().double().requires_grad_(True) for n, t in inp.items()
              if n != "cu_seqlens" and t is not None}
    o, final = reference({**leaves, "cu_seqlens": inp["cu_seqlens"],
                          "initial_state": leaves.get("initial_state")})
    torch.autograd.backward([o, final], [do.double(), dht.double()])
    return {n: t.grad for n, t in leaves.items()}


@pytest.mark.parametrize("case", BWD_CASES, ids=lambda c: c.id)
def test_gradients_match_recurrence(case):
    inp = make_inputs(case, seed=2)
    ours, do, dht = _grads(inp)
    ref = _reference_grads(inp, do, dht)
    for name, tol in TOL.items():
        if name in ref:
            assert rel_l2(ours[name], ref[name]) < tol, name


BOUNDED_BWD_CASES = [
    (Case(1, 8192, 2, 4), 1024),                           # typical decay: walks short
    (Case(1, 4096, 4, 4, gate="strong"), 512),
    (_varlen([3000, 7, 300, 1200], 2, 4, gate="zero"), 1024),  # walks to the ends
    (_varlen([0, 3000, 64, 1], 1, 2, pad=3), 512),
    (Case(1, 5000, 2, 4), 960),                            # 15 chunks, T % 64 != 0
]


@pytest.mark.parametrize("case, segment_len", BOUNDED_BWD_CASES,
                         ids=[f"{c.id}-seg{s}" for c, s in BOUNDED_BWD_CASES])
def test_bounded_split_gradients_match_recurrence(case, segment_len):
    """The bounded split's backward (chunk states by the warm-up forward, dS by
    the sweep's reverse warm-up walks) against autograd through the fp64 recurrence,
    and against the unsplit backward on the same inputs."""
    inp = make_inputs(case, seed=4)
    ours, do, dht = _grads(inp, segment_len=segment_len)
    unsplit, _, _ = _grads(inp, auto_cp=False)
    ref = _reference_grads(inp, do, dht)
    for name, tol in TOL.items():
        if name in ref:
            assert rel_l2(ours[name], ref[name]) < tol, name
            assert rel_l2(ours[name], unsplit[name]) < tol, name


def test_dominant_sequence_split_matches_recurrence(monkeypatch):
    """A batch whose (sequence, head) CTAs outnumber the SMs with one sequence far longer
    than the rest (an RL batch's long rollout): the planner cuts that sequence (on 16
    SMs here, so that a small case fills them), and the outputs and every gradient still
    match the fp64 recurrence and the unsplit call."""
    from flash_qla import api
    from flash_qla_tl import backend, plan

    monkeypatch.setattr(backend, "sm_count", lambda device: 16)
    lens = [6000, 64, 64, 64, 64]
    bounds = [sum(lens[:i]) for i in range(len(lens) + 1)]
    assert plan.segment_len(bounds, 4, 16, bounded=True).value == 1600
    plans, real_plan = [], api._auto_segment_len
    monkeypatch.setattr(api, "_auto_segment_len",
                        lambda *a: (plans.append(real_plan(*a)), plans[-1])[1])
    inp = make_inputs(_varlen(lens, 2, 4), seed=6)
    ours, do, dht = _grads(inp)
    assert plans[0] == 1600
    o, final = flash_qla.chunk_gated_delta_rule(**inp, output_final_state=True)
    o_ref, final_ref = reference(inp)
    assert rel_l2(o, o_ref) < FWD_TOL[o.dtype] and rel_l2(final, final_ref) < FWD_TOL[o.dtype]
    unsplit, _, _ = _grads(inp, auto_cp=False)
    ref = _reference_grads(inp, do, dht)
    for name, tol in TOL.items():
        if name in ref:
            assert rel_l2(ours[name], ref[name]) < tol, name
            assert rel_l2(ours[name], unsplit[name]) < tol, name


KEPT_CASES = [
    (CASES[0], None),                           # dense GVA 2/4, unsplit
    (CASES[12], None),                          # varlen GVA 4/16 + padding, host offsets
    (Case(1, 8192, 2, 4), 1024),                # the bounded split
]


@pytest.mark.parametrize("case, segment_len", KEPT_CASES,
                         ids=[f"{c.id}-seg{s}" for c, s in KEPT_CASES])
def test_kept_chunk_states_give_the_recomputed_gradients(case, segment_len, monkeypatch):
    """``save_chunk_states`` (default): the backward reads the h the training forward
    stored (chunk_fwd_ws with o and h in q's dtype) and recomputes nothing; its
    gradients equal, bitwise, those of ``save_chunk_states=False`` (the states-only
    recompute runs the same state chain)."""
    from flash_qla_tl import backward

    recomputes = []
    real = backward.state_output
    monkeypatch.setattr(backward, "state_output",
                        lambda *a, **kw: (recomputes.append(1), real(*a, **kw))[1])
    inp = make_inputs(case, seed=5)
    kwargs = {"auto_cp": False} if segment_len is None else {"segment_len": segment_len}
    if inp["cu_seqlens"] is not None:            # the kept h's size without a sync
        kwargs["cu_seqlens_cpu"] = inp["cu_seqlens"].cpu()
    kept, _, _ = _grads(inp, **kwargs)
    assert recomputes == []
    recomputed, _, _ = _grads(inp, save_chunk_states=False, **kwargs)
    assert recomputes == [1]
    for name in kept:
        assert torch.equal(kept[name], recomputed[name]), name


@pytest.mark.parametrize("fused", [False, True], ids=["two_kernels", "fused"])
def test_bounded_training_step_inside_graph_capture(monkeypatch, fused):
    """The whole training step (forward with grad + every gradient) of a dense input
    captured as one CUDA graph runs the bounded split both ways (the backward's split
    is planned from the shape, the same at every replay); a replay on fresh inputs
    gives the eager step's gradients on them, bitwise, and those match the fp64
    recurrence. ``fused``: the backward's kernels are the boundary sweep and
    ``chunk_bwd_fused`` (forced: at this size the cost model keeps the two kernels)."""
    from flash_qla import api
    from flash_qla_tl import backward

    if fused:
        skip_unless_fused_kernel()
    case = Case(1, 8192, 2, 4)                       # the planner splits it (512 tokens)
    bounded, fused_runs = [], []
    real = api.warmup_bwd
    monkeypatch.setattr(api, "warmup_bwd", lambda *a, **kw: (bounded.append(1),
                                                             real(*a, **kw))[1])
    monkeypatch.setattr(backward, "chunk_bwd_warmup",
                        functools.partial(backward.chunk_bwd_warmup, fused=fused))
    real_fused = backward.fused_grads
    monkeypatch.setattr(backward, "fused_grads", lambda *a, **kw: (
        fused_runs.append(1), real_fused(*a, **kw))[1])
    leaves = {n: t.detach().clone().requires_grad_(True)
              for n, t in make_inputs(case, seed=3).items() if n != "cu_seqlens"}
    gen = torch.Generator(device="cuda").manual_seed(11)
    do = torch.randn(1, 8192, 4, 128, generator=gen, device="cuda", dtype=torch.bfloat16)
    dht = torch.randn(1, 4, 128, 128, generator=gen, device="cuda")

    def step():
        o, final = flash_qla.chunk_gated_delta_rule(**leaves, output_final_state=True)
        return torch.autograd.grad((o, final), list(leaves.values()), (do, dht))

    stream, graph = torch.cuda.Stream(), torch.cuda.CUDAGraph()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()                                       # warm-up off-graph
        with torch.cuda.graph(graph):
            captured = step()
    torch.cuda.current_stream().wait_stream(stream)
    fresh = make_inputs(case, seed=4)
    with torch.no_grad():
        for name, t in leaves.items():
            t.copy_(fresh[name])
    graph.replay()
    torch.cuda.synchronize()
    eager = step()
    assert bounded == [1, 1, 1]                      # warm-up, capture, eager
    assert fused_runs == ([1, 1, 1] if fused else [])
    ref = _reference_grads(fresh, do.float(), dht)
    for name, got, want in zip(leaves, captured, eager):
        assert torch.equal(got, want), name
        assert rel_l2(got, ref[name]) < TOL[name], name


def test_gradients_deterministic():
    inp = make_inputs(CASES[12], seed=4)
    first, _, _ = _grads(inp)
    again, _, _ = _grads(inp)
    for name in first:
        assert torch.equal(first[name], again[name]), name


@pytest.mark.parametrize("case", POISON_CASES, ids=lambda c: c.id)
def test_nan_padding_never_reaches_valid_gradients(case):
    """NaN/Inf in the padding tokens (after cu_seqlens[-1]) of every input, and in dO
    there: the gradients of valid tokens and of the initial state equal those of the
    same call with finite padding, and the padding's gradients are 0."""
    inp = make_inputs(case, seed=8)
    clean, do, dht = _grads(inp)
    pad = slice(case.T - case.pad, case.T)
    for name, bad in (("q", float("nan")), ("k", float("nan")), ("v", float("inf")),
                      ("g", float("nan")), ("beta", float("nan"))):
        inp[name] = inp[name].clone()
        inp[name][:, pad] = bad
    dirty, _, _ = _grads(inp, do_padding=float("nan"))
    for name in clean:
        valid, bad_rows = dirty[name][:, :pad.start], dirty[name][:, pad]
        if name == "initial_state":
            valid, bad_rows = dirty[name], dirty[name][:0]
        assert torch.isfinite(valid).all(), name
        ref = clean[name][:, :pad.start] if name != "initial_state" else clean[name]
        assert rel_l2(valid.float(), ref.float()) < 1e-6, name
        assert torch.equal(bad_rows, torch.zeros_like(bad_rows)), name


@pytest.mark.parametrize("case", [CASES[0], CASES[11], CASES[12], BWD_CASES[1]],
                         ids=lambda c: c.id)
def test_dh_kernel_matches_torch_sweep(case):
    """The reverse-sweep kernel (``chunk_bwd_dh_ws``, through the two-kernel backward)
    against the batched PyTorch sweep of the chunk-parallel backward given the same chunk
    states: every gradient and dh0."""
    from flash_qla.chunk_parallel import chunk_gated_delta_rule_bwd_parallel
    from flash_qla_tl.backward import chunk_bwd, chunk_states

    inp = make_inputs(case, seed=6)
    g_cumsum, A, o, _, final = flash_qla.chunk_gated_delta_rule_fwd(**inp)
    do, dht = torch.randn_like(o), torch.randn_like(final)
    common = dict(scale=128 ** -0.5, cu_seqlens=inp["cu_seqlens"], cu_seqlens_cpu=None)
    args = (inp["q"], inp["k"], inp["v"], g_cumsum, inp["beta"], A, do)
    h0 = inp["initial_state"]
    with_kernel = chunk_bwd(*args, arch=kernel_arch(), dht=dht, initial_state=h0, fused=False,
                            **common)
    h = chunk_states(*args[:6], arch=kernel_arch(), initial_state=h0, **common)
    with_torch = chunk_gated_delta_rule_bwd_parallel(
        *args, chunk_start_states(h, kernel_arch()).float(), dht=dht, initial_state=h0,
        **common)
    for name, a, b in zip(("dq", "dk", "dv", "dbeta", "dg", "dh0"), with_kernel, with_torch):
        if h0 is None and name == "dh0":
            assert a is None, name
        else:
            assert rel_l2(a.float(), b.float()) < 1e-2, name


#: Hv = Hk cases: no GVA sum after chunk_bwd_intra (fp16; varlen with an empty
#: sequence, length-1 ones and padding)
SAME_HEAD_CASES = [Case(2, 1000, 4, 4, dtype=torch.float16),
                   _varlen([1, 63, 0, 75, 130, 1], 2, 2, pad=37)]


_INTRA_CASES = [CASES[0], CASES[11], CASES[12], BWD_CASES[1], CASES[8], *SAME_HEAD_CASES]


def swept_problem(case, seed: int = 6) -> SimpleNamespace:
    """A case after the forward, with random dO and dht, for the kernel-level gradient
    tests: ``args`` (q, k, v, g_cumsum, beta, A, dO), ``common`` (scale, cu_seqlens), the
    chunk states ``h`` (recomputed by the forward kernel) and the sweep kernel's ``dS1``,
    both in q's dtype, its ``dh0``, ``dht``, and ``ref``: the chunk-parallel PyTorch
    gradients given those states (on an arch with sub-chunks, whose states have a row
    per sub-chunk: given the states at the chunk starts, its own sweep's dS1)."""
    from flash_qla.chunk_parallel import chunk_gated_delta_rule_bwd_parallel
    from flash_qla_tl.backward import chunk_states, state_grads
    from flash_qla_tl.layout import state_rows

    inp = make_inputs(case, seed=seed)
    g_cumsum, A, o, _, final = flash_qla.chunk_gated_delta_rule_fwd(**inp)
    do, dht = torch.randn_like(o), torch.randn_like(final)
    q, k, v, beta, h0 = inp["q"], inp["k"], inp["v"], inp["beta"], inp["initial_state"]
    common = dict(scale=128 ** -0.5, cu_seqlens=inp["cu_seqlens"], cu_seqlens_cpu=None)
    arch = kernel_arch()
    h = chunk_states(q, k, v, g_cumsum, beta, A, arch=arch, initial_state=h0, **common)
    dS1, dh0 = state_grads(q, k, do, g_cumsum, beta, A, arch=arch, dht=dht, **common)
    args = (q, k, v, g_cumsum, beta, A, do)
    given = dict(dS1=dS1.float(), dh0=dh0) if state_rows(arch) == 1 else {}
    ref = chunk_gated_delta_rule_bwd_parallel(*args, chunk_start_states(h, arch).float(),
                                              dht=dht, initial_state=h0, **given, **common)
    return SimpleNamespace(args=args, common=common, h=h, dS1=dS1, dh0=dh0, dht=dht,
                           ref=ref)


@pytest.mark.parametrize("case", _INTRA_CASES, ids=lambda c: c.id)
def test_intra_kernel_matches_torch_chunk_grads(case):
    """The chunk_bwd_intra kernel (``chunk_grads``) against the chunk-parallel PyTorch
    gradients given the same h and dS1 (in q's dtype): relative L2 < 1e-2 for dq, dk, dv
    and < 2e-2 for dbeta, dg; same dtypes and shapes."""
    from flash_qla_tl.backward import chunk_grads

    x = swept_problem(case)
    ours = chunk_grads(*x.args, x.h, x.dS1, arch=kernel_arch(), **x.common)
    tol = {"dq": 1e-2, "dk": 1e-2, "dv": 1e-2, "dbeta": 2e-2, "dg": 2e-2}
    for name, a, b in zip(tol, ours, x.ref[:5]):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert rel_l2(a.float(), b.float()) < tol[name], name


@pytest.mark.parametrize("G, M", [(2, 4096), (4, 1000), (8, 33), (3, 1)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_group_sum_kernel_matches_fp64_sum(G, M, dtype):
    """``group_sum_kernel`` (the GVA sum of the per-value-head dq / dk) against the fp64
    sum over the group of the same inputs: within one rounding of the result to
    ``dtype`` (it accumulates in fp32), M not a multiple of its 32-row tile, and
    deterministic."""
    from flash_qla_tl.backward import sum_groups

    gen = torch.Generator(device="cuda").manual_seed(G * 1000 + M)
    x = torch.randn(G, M, 3, 128, device="cuda", generator=gen).to(dtype)   # [G, Tt, Hk, K]
    got = sum_groups(x, arch=kernel_arch())
    want = x.double().sum(dim=0)
    assert got.dtype == dtype and got.shape == (M, 3, 128)
    eps = torch.finfo(dtype).eps
    assert torch.all((got.double() - want).abs() <= eps * want.abs() + 1e-5), \
        (got.double() - want).abs().max()
    assert torch.equal(got, sum_groups(x, arch=kernel_arch()))
