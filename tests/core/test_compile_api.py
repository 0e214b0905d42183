"""The traced path on CPU (torch backend): ``torch.compile(fullgraph=True)`` of
``flash_qla.chunk_gated_delta_rule`` and ``torch.library.opcheck`` of its custom ops
(:mod:`flash_qla.custom_ops`).

A compiled call must give the eager call's outputs and gradients (and so the fp64
recurrence's, ``tests/core/test_api.py``), with the whole call in one graph whose only
opaque parts are the two ops; the ops' fakes must match their real outputs (opcheck).
"""

from __future__ import annotations

import pytest
import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

import flash_qla
from flash_qla import api, custom_ops, dispatch
from flash_qla.reference import TORCH_KERNELS
from flash_qla.segments import DEFAULT_SHORTCUT_BOUND
from tests.core.test_api import (
    CONFIGS,
    FP64_TOL,
    VARLEN,
    PlanningKernels,
    SpyKernels,
    cu_tensor,
    errors,
    grads,
    make_inputs,
    oracle,
    too_large,
)
from tests.helpers import rel_l2

DENSE = CONFIGS["B2-T75-Hk2-Hv4-K8-V16"]
#: compiled vs eager call, fp64: the same kernels on the same inputs; the pre-passes
#: may be traced into another op order
EAGER_TOL = 1e-12


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles from scratch (no cache hits, no automatic dynamic shapes
    carried over from another test's shapes)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def caller(**kwargs):
    """``(inputs, cu) -> chunk_gated_delta_rule(**inputs, cu_seqlens=cu,
    output_final_state=True, **kwargs)``."""
    def call(inputs, cu):
        return flash_qla.chunk_gated_delta_rule(**inputs, cu_seqlens=cu,
                                                output_final_state=True, **kwargs)
    return call


def compiled(compiler: str = "aot_eager", *, fullgraph: bool = True, **kwargs):
    """:func:`caller` compiled by ``torch.compile`` with the backend ``compiler``."""
    return torch.compile(caller(**kwargs), backend=compiler, fullgraph=fullgraph)


def eager(inputs, cfg, **kwargs):
    return flash_qla.chunk_gated_delta_rule(**inputs, cu_seqlens=cu_tensor(cfg),
                                            output_final_state=True, **kwargs)


def outputs_and_grads(out, inputs) -> dict:
    return {"o": out[0], "final_state": out[1], **grads(out, inputs)}


# --------------------------------------------------------------------------------------
# Compiled calls: values and gradients
# --------------------------------------------------------------------------------------

# id -> (config, API keyword arguments, oracle options, make_inputs options, drop h0)
CASES = {
    "dense": (DENSE, {}, {}, {}, False),
    "dense-no-h0": (DENSE, {}, {}, {}, True),
    "varlen": (VARLEN, {}, {}, {}, False),
    "varlen-all-options": (
        VARLEN,
        {"scale": 0.7, "state_v_first": True, "use_qk_l2norm_in_kernel": True,
         "use_gate_in_kernel": True},
        {"scale": 0.7, "v_first": True, "l2norm": True, "gate": True},
        {"v_first": True, "gate_params": True}, False),
}


def case_inputs(case: str) -> tuple:
    cfg, api_kwargs, oracle_kwargs, input_kwargs, drop_h0 = CASES[case]
    inputs = make_inputs(cfg, **input_kwargs)
    if drop_h0:
        del inputs["initial_state"]
    return cfg, api_kwargs, oracle_kwargs, inputs


@pytest.mark.parametrize("compiler", ["eager", "aot_eager"])
@pytest.mark.parametrize("case", list(CASES))
def test_compiled_matches_eager_and_recurrence(case, compiler):
    cfg, api_kwargs, oracle_kwargs, inputs = case_inputs(case)
    out = compiled(compiler, **api_kwargs)(inputs, cu_tensor(cfg))
    actual = outputs_and_grads(out, inputs)
    expected = outputs_and_grads(eager(inputs, cfg, **api_kwargs), inputs)
    reference = oracle({"initial_state": torch.zeros(cfg.N, cfg.Hv, cfg.K, cfg.V,
                                                     dtype=torch.float64), **inputs},
                       cfg, **oracle_kwargs)
    exact = outputs_and_grads(reference, inputs)
    assert set(actual) == set(expected) == set(exact)
    assert too_large(errors(actual, expected), EAGER_TOL) == {}
    assert too_large(errors(actual, exact), FP64_TOL) == {}


def test_inductor_matches_eager():
    """Inductor compiles the pre-pass around the ops (a CPU C++ build)."""
    inputs = make_inputs(VARLEN)
    out = compiled("inductor", use_qk_l2norm_in_kernel=True)(inputs, cu_tensor(VARLEN))
    actual = outputs_and_grads(out, inputs)
    expected = outputs_and_grads(eager(inputs, VARLEN, use_qk_l2norm_in_kernel=True), inputs)
    assert too_large(errors(actual, expected), 1e-10) == {}


# id -> (q/k/v dtype, g dtype, beta dtype)
PRECISIONS = {
    "fp32": (torch.float32, torch.float32, torch.float32),
    "bf16-qkv-fp32-g-beta": (torch.bfloat16, torch.float32, torch.float32),
    "bf16-qkv-g-beta": (torch.bfloat16, torch.bfloat16, torch.bfloat16),
}


@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_compiled_lower_precision_equals_eager(precision):
    """Outputs and gradients in the caller's dtypes (dbeta in beta's, dg in g's), the
    eager call's values."""
    inputs = make_inputs(VARLEN, *PRECISIONS[precision])
    out = compiled()(inputs, cu_tensor(VARLEN))
    actual = outputs_and_grads(out, inputs)
    expected = outputs_and_grads(eager(inputs, VARLEN), inputs)
    assert {n: x.dtype for n, x in actual.items()} == {n: x.dtype for n, x in expected.items()}
    assert {n: x.dtype for n, x in actual.items() if n in inputs} == {
        n: x.dtype for n, x in inputs.items()}
    assert too_large(errors(actual, expected), 1e-6) == {}


def test_compiled_without_final_state():
    """final_state None (an empty output of the op, no gradient flows into it)."""
    inputs = make_inputs(VARLEN)

    def call(inputs, cu):
        return flash_qla.chunk_gated_delta_rule(**inputs, cu_seqlens=cu)

    o, final_state = torch.compile(call, backend="aot_eager", fullgraph=True)(
        inputs, cu_tensor(VARLEN))
    assert final_state is None
    ref_o, _ = call(inputs, cu_tensor(VARLEN))
    assert too_large(errors(grads((o, None), inputs), grads((ref_o, None), inputs)),
                     EAGER_TOL) == {}


def test_compiled_only_final_state_in_loss():
    """o unused: its gradient is zero (materialised by the compiled graph)."""
    inputs = make_inputs(VARLEN)
    _, ht = compiled()(inputs, cu_tensor(VARLEN))
    _, ref_ht = eager(inputs, VARLEN)
    actual = torch.autograd.grad(ht.sum(), list(inputs.values()), materialize_grads=True)
    expected = torch.autograd.grad(ref_ht.sum(), list(inputs.values()),
                                   materialize_grads=True)
    assert too_large(errors(dict(enumerate(actual)), dict(enumerate(expected))),
                     EAGER_TOL) == {}


@pytest.mark.parametrize("mode", ["no_grad", "no_leaf_requires_grad"])
def test_compiled_inference_call(mode):
    inputs = make_inputs(VARLEN)
    plain = {n: x.detach() for n, x in inputs.items()}
    fn = compiled()
    if mode == "no_grad":
        with torch.no_grad():
            out = fn(inputs, cu_tensor(VARLEN))
    else:
        out = fn(plain, cu_tensor(VARLEN))
    ref = eager(plain, VARLEN)
    assert all(not x.requires_grad for x in out)
    assert rel_l2(out[0], ref[0]) < EAGER_TOL and rel_l2(out[1], ref[1]) < EAGER_TOL


def test_compiled_with_dynamic_shapes():
    """dynamic=True: symbolic T, N (and head dims); two packings, one compiled graph
    family, each call the eager call's values (the op reads its own offsets)."""
    fn = torch.compile(caller(), backend="aot_eager", fullgraph=True, dynamic=True)
    second = type(VARLEN)(B=1, T=200, Hk=1, Hv=2, K=16, V=8, cu_seqlens=(0, 130, 190))
    for cfg in (VARLEN, second):
        inputs = make_inputs(cfg)
        actual = outputs_and_grads(fn(inputs, cu_tensor(cfg)), inputs)
        expected = outputs_and_grads(eager(inputs, cfg), inputs)
        assert too_large(errors(actual, expected), EAGER_TOL) == {}, cfg


def test_compiled_call_with_host_offsets():
    """cu_seqlens_cpu as a graph input: the op plans and checks with it."""
    def call(inputs, cu, cu_cpu):
        return flash_qla.chunk_gated_delta_rule(**inputs, cu_seqlens=cu, cu_seqlens_cpu=cu_cpu,
                                                output_final_state=True)

    inputs = make_inputs(VARLEN)
    fn = torch.compile(call, backend="aot_eager", fullgraph=True)
    actual = outputs_and_grads(fn(inputs, cu_tensor(VARLEN), cu_tensor(VARLEN)), inputs)
    expected = outputs_and_grads(eager(inputs, VARLEN), inputs)
    assert too_large(errors(actual, expected), EAGER_TOL) == {}


def test_compiled_call_without_tokens():
    """T = 0 (the op picks the torch backend): empty o, the initial state as the final
    state, and its gradient passed through."""
    q, k = (torch.randn(1, 0, 2, 16, requires_grad=True) for _ in range(2))
    v = torch.randn(1, 0, 4, 8, requires_grad=True)
    g, beta = torch.zeros(1, 0, 4), torch.zeros(1, 0, 4)
    h0 = torch.randn(1, 4, 16, 8, dtype=torch.float32, requires_grad=True)
    inputs = dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=h0)
    o, final_state = compiled()(inputs, None)
    assert o.shape == (1, 0, 4, 8) and torch.equal(final_state, h0.detach())
    dht = torch.randn_like(final_state)
    (dh0,) = torch.autograd.grad(final_state, (h0,), dht)
    assert torch.equal(dh0, dht)


# --------------------------------------------------------------------------------------
# The trace: one graph, the two ops, no value read
# --------------------------------------------------------------------------------------

def recording_backend(graphs: dict):
    """An aot_eager-like backend keeping the forward and backward graphs it compiles."""
    def keep(name):
        def compiler(gm, example_inputs):
            graphs.setdefault(name, []).append(gm)
            return make_boxed_func(gm.forward)
        return compiler
    return aot_autograd(fw_compiler=keep("forward"), bw_compiler=keep("backward"))


def call_targets(gm) -> set[str]:
    return {str(node.target) for node in gm.graph.nodes if node.op == "call_function"}


@pytest.mark.parametrize("case", ["dense", "varlen-all-options"])
def test_one_graph_holding_the_ops_and_no_value_read(case):
    """Without fullgraph too: one graph, no break (explain); its forward holds the
    forward op, its backward the backward op, neither reads a tensor's value."""
    cfg, api_kwargs, _, inputs = case_inputs(case)
    explained = torch._dynamo.explain(caller(**api_kwargs))(inputs, cu_tensor(cfg))
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)
    graphs: dict = {}
    fn = torch.compile(caller(**api_kwargs), backend=recording_backend(graphs),
                       fullgraph=True)
    grads(fn(inputs, cu_tensor(cfg)), inputs)
    (fwd,), (bwd,) = graphs["forward"], graphs["backward"]
    assert "flash_qla.chunk_gdn_fwd.default" in call_targets(fwd)
    assert "flash_qla.chunk_gdn_bwd.default" in call_targets(bwd)
    reads = {"aten._local_scalar_dense.default", "aten.item.default", "aten.equal.default"}
    assert (call_targets(fwd) | call_targets(bwd)) & reads == set()


def test_eager_calls_never_take_the_traced_path(monkeypatch):
    def traced(*args, **kwargs):
        raise AssertionError("eager call reached the custom op")

    monkeypatch.setattr(api, "_traced_forward", traced)
    inputs = make_inputs(VARLEN)
    grads(eager(inputs, VARLEN), inputs)
    with torch.no_grad():
        eager(inputs, VARLEN)


# --------------------------------------------------------------------------------------
# Backends' options under compile: the split, kept states
# --------------------------------------------------------------------------------------

def test_compiled_auto_split_is_planned_in_the_op(monkeypatch):
    """The backend's planner is asked inside the op, with the host offsets the op read
    from cu_seqlens; the split forward gives the recurrence's values and gradients."""
    planner = PlanningKernels()
    monkeypatch.setattr(dispatch, "get_kernels",
                        lambda device, **kw: (dispatch.TORCH_BACKEND, planner))
    inputs = make_inputs(VARLEN)
    out = compiled()(inputs, cu_tensor(VARLEN))
    assert planner.plans[0] == (list(VARLEN.cu_seqlens), VARLEN.Hv, VARLEN.K, VARLEN.V)
    assert len(planner.fwd_calls) == 2 + -(-VARLEN.K // VARLEN.V)     # the exact split
    actual = outputs_and_grads(out, inputs)
    expected = outputs_and_grads(oracle(inputs, VARLEN), inputs)
    assert too_large(errors(actual, expected), FP64_TOL) == {}


@pytest.mark.parametrize("config", ["dense", "varlen"])
def test_compiled_segment_len(config):
    cfg = DENSE if config == "dense" else VARLEN
    inputs = make_inputs(cfg)
    actual = outputs_and_grads(compiled(segment_len=64)(inputs, cu_tensor(cfg)), inputs)
    expected = outputs_and_grads(oracle(inputs, cfg), inputs)
    assert too_large(errors(actual, expected), FP64_TOL) == {}


class WarmupKernels(PlanningKernels):
    """The torch backend's bounded split forward (``fwd_warmup``), a planner splitting
    at 64 tokens, and a ``bwd_warmup`` recording the segments it is handed (zero
    gradients, dh0 zero: only which backward runs on which split is checked here)."""

    def __init__(self):
        super().__init__()
        self.bwd_segments = []

    def fwd_warmup(self, *args, **kwargs):
        return TORCH_KERNELS.fwd_warmup(*args, **kwargs)

    def bwd_warmup(self, q, k, v, g_cumsum, beta, A, do, *, dht, scale, initial_state,
                   cu_seqlens, cu_seqlens_cpu, starts, ends):
        self.bwd_segments.append((cu_seqlens_cpu.tolist(), starts.bound, ends.bound))
        nseg = len(cu_seqlens_cpu) - 1
        dh0 = None if initial_state is None else initial_state.new_zeros(
            nseg, *initial_state.shape[1:])
        return (torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v),
                torch.zeros_like(beta), torch.zeros_like(g_cumsum), dh0)


@pytest.mark.parametrize("kwargs", [{}, {"segment_len": 64}], ids=["auto", "segment_len"])
def test_compiled_bounded_split_runs_its_backward(monkeypatch, kwargs):
    """A bounded split forward (planned, or by segment_len) is followed by the
    backend's bounded backward on the same segments, as in the eager call."""
    kernels = WarmupKernels()
    monkeypatch.setattr(dispatch, "get_kernels",
                        lambda device, **kw: (dispatch.TORCH_BACKEND, kernels))
    inputs = make_inputs(VARLEN)
    grads(eager(inputs, VARLEN, **kwargs), inputs)
    grads(compiled(**kwargs)(inputs, cu_tensor(VARLEN)), inputs)
    (eager_split, compiled_split) = kernels.bwd_segments
    assert compiled_split == eager_split
    assert eager_split[0] == [0, 64, 70, 71, 135, 140]            # segments of 64


class KeepingKernels(SpyKernels):
    """A backend with ``keeps_states`` recording whether its forward is asked to keep
    its chunk states and what its backward is handed."""

    keeps_states = True

    def __init__(self):
        super().__init__()
        self.keep_requests, self.kept = [], []

    def fwd(self, *args, keep_states=False, **kwargs):
        self.keep_requests.append(keep_states)
        return super().fwd(*args, **kwargs)

    def bwd(self, *args, states=None, **kwargs):
        self.kept.append(states)
        return super().bwd(*args, **kwargs)


def test_compiled_call_recomputes_chunk_states(monkeypatch):
    """save_chunk_states (default True) has no effect on the traced path: the states'
    count is data-dependent (an output of such a size breaks a graph without
    fullgraph=True), so the backward recomputes them, with the same gradients."""
    kernels = KeepingKernels()
    monkeypatch.setattr(dispatch, "get_kernels",
                        lambda device, **kw: (dispatch.TORCH_BACKEND, kernels))
    inputs = make_inputs(VARLEN)
    actual = outputs_and_grads(compiled()(inputs, cu_tensor(VARLEN)), inputs)
    assert kernels.keep_requests == [False] and kernels.kept == [None]
    expected = outputs_and_grads(oracle(inputs, VARLEN), inputs)
    assert too_large(errors(actual, expected), FP64_TOL) == {}


# --------------------------------------------------------------------------------------
# Errors of compiled calls
# --------------------------------------------------------------------------------------

BAD_OFFSETS = [
    pytest.param((0, 0, 80, 70, 140), None, r"cu_seqlens must be non-decreasing; got "
                 r"cu_seqlens\[2\]=80 > cu_seqlens\[3\]=70", id="decreasing"),
    pytest.param((0, 0, 70, 71, 151), None, r"cu_seqlens\[-1\] must be at most T=150",
                 id="past-T"),
    pytest.param((0, 0, 70, 71, 140), (0, 0, 70, 72, 140), r"cu_seqlens_cpu must hold "
                 r"cu_seqlens' values", id="host-copy-differs"),
]


@pytest.mark.parametrize("cu, cu_cpu, match", BAD_OFFSETS)
def test_compiled_call_checks_offset_values_in_the_op(cu, cu_cpu, match):
    """The values are read at run time by the op, which raises the eager call's
    ValueError before any kernel runs."""
    inputs = make_inputs(VARLEN)
    kwargs = {} if cu_cpu is None else {"cu_seqlens_cpu": torch.tensor(cu_cpu)}
    cu_t = torch.tensor(cu, dtype=torch.int32)
    with pytest.raises(ValueError, match=match):
        flash_qla.chunk_gated_delta_rule(**inputs, cu_seqlens=cu_t, **kwargs)
    with pytest.raises(ValueError, match=match):
        compiled(**kwargs)(inputs, cu_t)


def test_compiled_call_unknown_backend():
    inputs = make_inputs(VARLEN)
    match = r"backend: unknown backend 'nope'"
    with pytest.raises(ValueError, match=match):
        eager(inputs, VARLEN, backend="nope")
    with pytest.raises(ValueError, match=match):
        compiled(backend="nope")(inputs, cu_tensor(VARLEN))


@pytest.mark.parametrize("fullgraph", [False, True])
def test_compiled_call_static_errors(fullgraph):
    """A static check fails while the call is traced: without fullgraph, Dynamo runs
    the call eagerly and the eager ValueError is raised; with fullgraph=True, Dynamo
    raises its own error quoting it (``Unsupported``, a RuntimeError)."""
    inputs = make_inputs(VARLEN)
    bad = {**inputs, "beta": inputs["beta"][..., :1]}
    error = torch._dynamo.exc.Unsupported if fullgraph else ValueError
    with pytest.raises(error, match=r"beta must have shape \[B, T, Hv\]"):
        compiled(fullgraph=fullgraph)(bad, cu_tensor(VARLEN))


# --------------------------------------------------------------------------------------
# opcheck of the ops (fakes, schema, autograd registration, AOT dispatch)
# --------------------------------------------------------------------------------------

# id -> (config, q/k/v dtype, g/beta dtype, with an initial state, output_final_state)
OPCHECK = {
    "dense-fp32-h0": (DENSE, torch.float32, torch.float32, True, True),
    "dense-bf16-fp32-g-beta": (DENSE, torch.bfloat16, torch.float32, False, True),
    "varlen-fp32": (VARLEN, torch.float32, torch.float32, False, True),
    "varlen-bf16-h0": (VARLEN, torch.bfloat16, torch.bfloat16, True, True),
    "varlen-fp64-h0-no-final-state": (VARLEN, torch.float64, torch.float64, True, False),
}


def fwd_args(cfg, dtype, gate_dtype, with_h0: bool, output_final_state: bool, *,
             segment_len: int = -1) -> tuple:
    """Arguments of ``chunk_gdn_fwd`` (tensors: leaves requiring grad)."""
    x = make_inputs(cfg, dtype, gate_dtype, gate_dtype)
    return (x["q"], x["k"], x["v"], x["g"], x["beta"],
            x["initial_state"] if with_h0 else None, cu_tensor(cfg), None, None,
            output_final_state, segment_len, False, DEFAULT_SHORTCUT_BOUND, "")


@pytest.mark.parametrize("case", list(OPCHECK))
def test_opcheck_forward(case):
    torch.library.opcheck(custom_ops.chunk_gdn_fwd, fwd_args(*OPCHECK[case]))


@pytest.mark.parametrize("case", list(OPCHECK))
def test_opcheck_backward(case):
    args = [a.detach() if isinstance(a, torch.Tensor) else a for a in fwd_args(*OPCHECK[case])]
    output_final_state = args[9]
    q, k, v, _, beta, h0, cu = args[:7]
    o, final_state, g_cumsum, A = custom_ops.chunk_gdn_fwd(*args)
    gen = torch.Generator().manual_seed(2)
    do = torch.randn(o.shape, generator=gen).to(o.dtype)
    dht = torch.randn(final_state.shape, generator=gen).to(final_state.dtype)
    torch.library.opcheck(custom_ops.chunk_gdn_bwd, (
        q, k, v, g_cumsum, beta, A, do, dht if output_final_state else None, h0, cu, None,
        None, -1, False, DEFAULT_SHORTCUT_BOUND, ""))


def test_opcheck_forward_with_a_split():
    args = fwd_args(DENSE, torch.float32, torch.float32, True, True, segment_len=64)
    torch.library.opcheck(custom_ops.chunk_gdn_fwd, args)


def test_ops_return_the_torch_backends_values():
    """The op's forward and backward are the backend's Kernels.fwd / bwd (plus the
    empty placeholders)."""
    args = [a.detach() if isinstance(a, torch.Tensor) else a
            for a in fwd_args(VARLEN, torch.float64, torch.float64, True, True)]
    q, k, v, g, beta, h0, cu = args[:7]
    o, final_state, g_cumsum, A = custom_ops.chunk_gdn_fwd(*args)
    ref = TORCH_KERNELS.fwd(q, k, v, g, beta, scale=VARLEN.K ** -0.5, initial_state=h0,
                            cu_seqlens=cu, cu_seqlens_cpu=None, output_final_state=True,
                            output_h=False)
    assert all(torch.equal(a, b) for a, b in zip((g_cumsum, A, o, final_state),
                                                  (ref[0], ref[1], ref[2], ref[4])))


@pytest.mark.parametrize("strict", [False, True], ids=["non-strict", "strict"])
def test_export(strict):
    """torch.export traces the same path: one op call, the eager call's values."""
    class Module(torch.nn.Module):
        def forward(self, q, k, v, g, beta, initial_state, cu_seqlens):
            return flash_qla.chunk_gated_delta_rule(
                q, k, v, g, beta, initial_state=initial_state, cu_seqlens=cu_seqlens,
                output_final_state=True)

    x = {n: t.detach() for n, t in make_inputs(VARLEN).items()}
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], x["initial_state"], cu_tensor(VARLEN))
    program = torch.export.export(Module(), args, strict=strict)
    targets = [str(n.target) for n in program.graph.nodes if n.op == "call_function"]
    assert targets.count("flash_qla.chunk_gdn_fwd.default") == 1
    out, ref = program.module()(*args), Module()(*args)
    assert all(torch.equal(a, b) for a, b in zip(out, ref))
