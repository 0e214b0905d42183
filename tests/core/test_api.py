"""The public API on CPU (torch backend) against the fp64 token-by-token recurrence.

The oracle is ``flash_qla.reference.recurrent_gated_delta_rule`` in float64, with the
options applied by their definitions (written here independently of flash_qla.api),
and ``torch.autograd`` through it gives every reference gradient.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

import flash_qla
from flash_qla import dispatch
from flash_qla.reference import TORCH_KERNELS, recurrent_gated_delta_rule
from tests.helpers import rel_l2

FP64_TOL = 1e-10


@dataclass(frozen=True)
class Config:
    B: int
    T: int
    Hk: int
    Hv: int
    K: int
    V: int
    cu_seqlens: tuple[int, ...] | None = None

    @property
    def N(self) -> int:
        return self.B if self.cu_seqlens is None else len(self.cu_seqlens) - 1


CONFIGS = {
    "B2-T75-Hk2-Hv4-K8-V16": Config(B=2, T=75, Hk=2, Hv=4, K=8, V=16),
    # sequences: empty, 70 tokens, 1 token, 69 tokens; then 10 padding tokens
    "varlen-B1-T150-Hk1-Hv2-K16-V8-empty-len1-padding": Config(
        B=1, T=150, Hk=1, Hv=2, K=16, V=8, cu_seqlens=(0, 0, 70, 71, 140)),
}
BIG = Config(B=1, T=70, Hk=1, Hv=1, K=128, V=128)
VARLEN = CONFIGS["varlen-B1-T150-Hk1-Hv2-K16-V8-empty-len1-padding"]


def make_inputs(cfg: Config, dtype=torch.float64, g_dtype=None, beta_dtype=None,
                *, gate_params: bool = False, v_first: bool = False, seed: int = 0) -> dict:
    """Leaf tensors (requires_grad) of one call; k unit-norm, g typical log decay."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    state_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    h0_shape = (cfg.N, cfg.Hv, cfg.V, cfg.K) if v_first else (cfg.N, cfg.Hv, cfg.K, cfg.V)
    raw = dict(
        q=(randn(cfg.B, cfg.T, cfg.Hk, cfg.K), dtype),
        k=(F.normalize(randn(cfg.B, cfg.T, cfg.Hk, cfg.K), dim=-1), dtype),
        v=(randn(cfg.B, cfg.T, cfg.Hv, cfg.V), dtype),
        g=(F.logsigmoid(randn(cfg.B, cfg.T, cfg.Hv) + 2), g_dtype or dtype),
        beta=(torch.sigmoid(randn(cfg.B, cfg.T, cfg.Hv)), beta_dtype or dtype),
        initial_state=(randn(*h0_shape), state_dtype),
    )
    if gate_params:
        raw["g"] = (randn(cfg.B, cfg.T, cfg.Hv), g_dtype or dtype)    # raw pre-activation
        raw["A_log"] = (randn(cfg.Hv) * 0.5, torch.float32)
        raw["dt_bias"] = (randn(cfg.Hv), torch.float32)
    return {n: x.to(d).requires_grad_() for n, (x, d) in raw.items()}


def cu_tensor(cfg: Config) -> torch.Tensor | None:
    return None if cfg.cu_seqlens is None else torch.tensor(cfg.cu_seqlens, dtype=torch.int32)


def l2_by_definition(x: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt(x.square().sum(-1, keepdim=True) + 1e-6)


def oracle(inputs: dict, cfg: Config, *, scale=None, l2norm=False, v_first=False,
           gate=False) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, final_state) by the fp64 recurrence, options applied by their definitions."""
    x = {n: t.double() for n, t in inputs.items()}
    q, k, g, h0 = x["q"], x["k"], x["g"], x["initial_state"]
    if l2norm:
        q, k = l2_by_definition(q), l2_by_definition(k)
    if gate:
        g = -torch.exp(x["A_log"]) * F.softplus(g + x.get("dt_bias", 0.0))
    if v_first:
        h0 = h0.transpose(-1, -2)
    o, ht = recurrent_gated_delta_rule(q, k, x["v"], g, x["beta"], scale=scale,
                                       initial_state=h0, cu_seqlens=cu_tensor(cfg),
                                       output_final_state=True)
    return o, (ht.transpose(-1, -2) if v_first else ht)


def grads(outputs, inputs: dict, seed: int = 1) -> dict:
    """Gradients of <o, do> + <final_state, dht> (fixed random do, dht, drawn on the CPU
    whatever the outputs' device) w.r.t. inputs."""
    gen = torch.Generator().manual_seed(seed)
    o, ht = outputs

    def weights(x: torch.Tensor) -> torch.Tensor:
        return torch.randn(x.shape, generator=gen, dtype=torch.float64).to(x.device)

    loss = (o.double() * weights(o)).sum()
    if ht is not None:
        loss = loss + (ht.double() * weights(ht)).sum()
    names = list(inputs)
    values = torch.autograd.grad(loss, [inputs[n] for n in names], allow_unused=True)
    return dict(zip(names, values))


def errors(actual: dict, expected: dict) -> dict:
    return {name: rel_l2(actual[name], expected[name]) for name in expected}


def too_large(errs: dict, tol: float) -> dict:
    return {name: e for name, e in errs.items() if not e < tol}


# --------------------------------------------------------------------------------------
# Values and gradients, fp64, every option
# --------------------------------------------------------------------------------------

# id -> (API keyword arguments, oracle options, extra make_inputs options)
OPTIONS = {
    "plain": ({}, {}, {}),
    "custom-scale": ({"scale": 0.3}, {"scale": 0.3}, {}),
    "state_v_first": ({"state_v_first": True}, {"v_first": True}, {"v_first": True}),
    "transpose_state_layout": ({"transpose_state_layout": True}, {"v_first": True},
                               {"v_first": True}),
    "qk-l2norm": ({"use_qk_l2norm_in_kernel": True}, {"l2norm": True}, {}),
    "gate-in-kernel": ({"use_gate_in_kernel": True}, {"gate": True}, {"gate_params": True}),
    "all-options": ({"scale": 0.7, "state_v_first": True, "use_qk_l2norm_in_kernel": True,
                     "use_gate_in_kernel": True},
                    {"scale": 0.7, "v_first": True, "l2norm": True, "gate": True},
                    {"v_first": True, "gate_params": True}),
}


def run_api(inputs: dict, cfg: Config, **kwargs):
    return flash_qla.chunk_gated_delta_rule(**inputs, cu_seqlens=cu_tensor(cfg),
                                            output_final_state=True, **kwargs)


@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("config", list(CONFIGS))
def test_matches_fp64_recurrence(config, option):
    cfg = CONFIGS[config]
    api_kwargs, oracle_kwargs, input_kwargs = OPTIONS[option]
    inputs = make_inputs(cfg, **input_kwargs)
    out, ref = run_api(inputs, cfg, **api_kwargs), oracle(inputs, cfg, **oracle_kwargs)
    actual = {"o": out[0], "final_state": out[1], **grads(out, inputs)}
    expected = {"o": ref[0], "final_state": ref[1], **grads(ref, inputs)}
    assert set(actual) >= {"A_log", "dt_bias"} or "gate" not in oracle_kwargs
    assert too_large(errors(actual, expected), FP64_TOL) == {}


def test_gate_in_kernel_without_dt_bias():
    inputs = make_inputs(VARLEN, gate_params=True)
    del inputs["dt_bias"]
    out = run_api(inputs, VARLEN, use_gate_in_kernel=True)
    ref = oracle(inputs, VARLEN, gate=True)
    actual = {"o": out[0], "final_state": out[1], **grads(out, inputs)}
    expected = {"o": ref[0], "final_state": ref[1], **grads(ref, inputs)}
    assert too_large(errors(actual, expected), FP64_TOL) == {}


def test_head_dims_128():
    inputs = make_inputs(BIG)
    out, ref = run_api(inputs, BIG), oracle(inputs, BIG)
    actual = {"o": out[0], "final_state": out[1], **grads(out, inputs)}
    expected = {"o": ref[0], "final_state": ref[1], **grads(ref, inputs)}
    assert too_large(errors(actual, expected), FP64_TOL) == {}


def test_padding_tokens_get_exact_zeros():
    inputs = make_inputs(VARLEN, gate_params=True)
    out = run_api(inputs, VARLEN, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True)
    pad = slice(VARLEN.cu_seqlens[-1], None)
    g = grads(out, inputs)
    padded = {"o": out[0], **{n: g[n] for n in ("q", "k", "v", "g", "beta")}}
    nonzero = {n: x[:, pad].abs().max().item() for n, x in padded.items() if x[:, pad].any()}
    assert nonzero == {}


def test_empty_sequence_keeps_its_initial_state():
    inputs = make_inputs(VARLEN)
    _, final_state = run_api(inputs, VARLEN)
    assert torch.equal(final_state[0], inputs["initial_state"][0].detach())


def test_no_tokens_run_the_reference_backend(monkeypatch):
    """T = 0: the call asks dispatch for the ``torch`` backend (on a GPU no kernel is
    launched: TMA descriptors need every dimension >= 1); empty o, the initial state as
    the final state, and zero-size / pass-through gradients."""
    asked = []
    real = dispatch.get_kernels
    monkeypatch.setattr(dispatch, "get_kernels", lambda device, **kw: (
        asked.append(kw["backend"]), real(device, **kw))[1])
    q, k = (torch.randn(1, 0, 2, 64, requires_grad=True) for _ in range(2))
    v = torch.randn(1, 0, 4, 32, requires_grad=True)
    g, beta = torch.zeros(1, 0, 4), torch.zeros(1, 0, 4)
    h0 = torch.randn(1, 4, 64, 32, requires_grad=True)
    o, final_state = flash_qla.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0,
                                                      output_final_state=True)
    assert asked and set(asked) == {"torch"}
    assert o.shape == (1, 0, 4, 32) and torch.equal(final_state, h0.detach())
    dht = torch.randn_like(final_state)
    dq, dh0 = torch.autograd.grad(final_state, (q, h0), dht)
    assert dq.shape == q.shape and torch.equal(dh0, dht)


# --------------------------------------------------------------------------------------
# Lower precisions, dtypes of outputs and gradients
# --------------------------------------------------------------------------------------

# id -> (q/k/v dtype, g dtype, beta dtype, tolerance on o and gradients vs fp64)
PRECISIONS = {
    "fp32": (torch.float32, torch.float32, torch.float32, 1e-4),
    "bf16-qkv-fp32-g-beta": (torch.bfloat16, torch.float32, torch.float32, 5e-2),
    "bf16-qkv-g-beta": (torch.bfloat16, torch.bfloat16, torch.bfloat16, 5e-2),
    "fp16-qkv-fp32-g": (torch.float16, torch.float32, torch.float16, 2e-2),
}


@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_lower_precision(precision):
    dtype, g_dtype, beta_dtype, tol = PRECISIONS[precision]
    inputs = make_inputs(VARLEN, dtype, g_dtype, beta_dtype)
    out = run_api(inputs, VARLEN)
    actual = {"o": out[0], "final_state": out[1], **grads(out, inputs)}
    ref = oracle(inputs, VARLEN)
    expected = {"o": ref[0], "final_state": ref[1], **grads(ref, inputs)}
    dtypes = {n: x.dtype for n, x in actual.items()}
    assert dtypes == {"o": dtype, "final_state": torch.float32,
                      **{n: x.dtype for n, x in inputs.items()}}
    assert too_large(errors(actual, expected), tol) == {}


# --------------------------------------------------------------------------------------
# Which outputs are used, and what the autograd Function hands the backend
# --------------------------------------------------------------------------------------

def test_without_final_state():
    inputs = make_inputs(VARLEN)
    o, final_state = flash_qla.chunk_gated_delta_rule(**inputs, cu_seqlens=cu_tensor(VARLEN))
    assert final_state is None
    ref_o, _ = oracle(inputs, VARLEN)
    assert too_large(errors(grads((o, None), inputs), grads((ref_o, None), inputs)),
                     FP64_TOL) == {}


def test_only_final_state_in_loss():
    inputs = make_inputs(VARLEN)
    _, ht = run_api(inputs, VARLEN)
    _, ref_ht = oracle(inputs, VARLEN)
    actual = torch.autograd.grad(ht.sum(), list(inputs.values()), materialize_grads=True)
    expected = torch.autograd.grad(ref_ht.sum(), list(inputs.values()),
                                   materialize_grads=True)  # q: unused, zeros
    assert too_large(errors(dict(enumerate(actual)), dict(enumerate(expected))), FP64_TOL) == {}


class SpyKernels:
    """Wraps the torch backend and records what the core passes to it."""

    def __init__(self):
        self.fwd_calls, self.bwd_calls = [], []

    def fwd(self, *args, **kwargs):
        result = TORCH_KERNELS.fwd(*args, **kwargs)
        self.fwd_calls.append((args, kwargs, result))
        return result

    def bwd(self, *args, **kwargs):
        self.bwd_calls.append((args, kwargs))
        return TORCH_KERNELS.bwd(*args, **kwargs)


@pytest.fixture
def spy(monkeypatch):
    """Every get_kernels call returns the torch spec with a SpyKernels; records kwargs."""
    kernels, requests = SpyKernels(), []

    def fake_get_kernels(device, **kwargs):
        requests.append(kwargs)
        return dispatch.TORCH_BACKEND, kernels

    monkeypatch.setattr(dispatch, "get_kernels", fake_get_kernels)
    kernels.requests = requests
    return kernels


def test_backward_gets_saved_g_cumsum_and_A(spy):
    inputs = make_inputs(VARLEN)
    grads(run_api(inputs, VARLEN), inputs)
    (_, fwd_kwargs, (g_cumsum, A, _, _, _)), = spy.fwd_calls
    (bwd_args, bwd_kwargs), = spy.bwd_calls
    assert fwd_kwargs["output_h"] is False
    assert bwd_args[3] is g_cumsum and bwd_args[5] is A
    assert bwd_kwargs["scale"] == VARLEN.K ** -0.5


class StateKeepingKernels(SpyKernels):
    """A backend with ``keeps_states``: its forward keeps the torch reference's h for
    the backward when asked; the backward records what it is handed."""

    keeps_states = True

    def fwd(self, *args, keep_states=False, **kwargs):
        self.keep_requests = getattr(self, "keep_requests", []) + [keep_states]
        if keep_states:
            kwargs["output_h"] = True                      # h in the states' place
        return super().fwd(*args, **kwargs)

    def bwd(self, *args, states=None, **kwargs):
        self.kept = getattr(self, "kept", []) + [states]
        return super().bwd(*args, **kwargs)


@pytest.mark.parametrize("save", [True, False])
def test_forward_keeps_chunk_states_for_the_backward(monkeypatch, save):
    """``save_chunk_states`` (default True) on a backend with ``keeps_states``: the
    training forward is asked to keep its chunk states and the backward gets exactly
    the tensor it returned; False asks for none and the backward recomputes. The
    gradients are the same either way (and the recurrence's)."""
    kernels = StateKeepingKernels()
    monkeypatch.setattr(dispatch, "get_kernels",
                        lambda device, **kw: (dispatch.TORCH_BACKEND, kernels))
    inputs = make_inputs(VARLEN)
    kwargs = {} if save else {"save_chunk_states": False}
    out = run_api(inputs, VARLEN, **kwargs)
    actual = {"o": out[0], **grads(out, inputs)}
    (_, _, (_, _, _, h, _)), = kernels.fwd_calls
    assert kernels.keep_requests == [save]
    if save:
        assert kernels.kept == [h] and h is not None and h.shape[2:] == (
            VARLEN.Hv, VARLEN.K, VARLEN.V)
    else:
        assert kernels.kept == [None] and h is None
    ref = oracle(inputs, VARLEN)
    expected = {"o": ref[0], **grads(ref, inputs)}
    assert too_large(errors(actual, expected), FP64_TOL) == {}


def test_inference_call_keeps_no_states(monkeypatch):
    """Nothing to differentiate: the forward is not asked to keep states."""
    kernels = StateKeepingKernels()
    monkeypatch.setattr(dispatch, "get_kernels",
                        lambda device, **kw: (dispatch.TORCH_BACKEND, kernels))
    with torch.no_grad():
        run_api(make_inputs(VARLEN), VARLEN)
    assert kernels.keep_requests == [False]


@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_save_chunk_states_is_checked(bad):
    with pytest.raises(TypeError, match="save_chunk_states"):
        run_api(make_inputs(VARLEN), VARLEN, save_chunk_states=bad)


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "no_leaf_requires_grad"])
def test_inference_call_skips_autograd(spy, mode):
    """Without anything to differentiate the forward runs without the autograd Function
    (no graph, nothing saved) and gives the same outputs as with it; the API's
    pre-passes (here the gate from its parameters) keep their own graph rule."""
    inputs = make_inputs(VARLEN, gate_params=True)
    with_grad = run_api(inputs, VARLEN, use_gate_in_kernel=True)
    plain = {n: x.detach() for n, x in inputs.items()}
    if mode == "no_grad":
        with torch.no_grad():
            out = run_api(inputs, VARLEN, use_gate_in_kernel=True)
    elif mode == "inference_mode":
        with torch.inference_mode():
            out = run_api(plain, VARLEN, use_gate_in_kernel=True)
    else:
        out = run_api(plain, VARLEN, use_gate_in_kernel=True)
    assert all(x.grad_fn is None and not x.requires_grad for x in out)
    assert all(torch.equal(a, b.detach()) for a, b in zip(out, with_grad))
    assert [x.requires_grad for x in with_grad] == [True, True]
    assert len(spy.fwd_calls) == 2


def test_gate_parameters_alone_take_the_autograd_path():
    """Only A_log / dt_bias require grad: the gate computed from them does, so the call
    runs the autograd Function and their gradients match the full-grad call's."""
    inputs = make_inputs(VARLEN, gate_params=True)
    plain = {n: (x if n in ("A_log", "dt_bias") else x.detach()) for n, x in inputs.items()}
    out = run_api(plain, VARLEN, use_gate_in_kernel=True)
    assert out[0].requires_grad and out[1].requires_grad
    loss = out[0].sum() + out[1].sum()
    got = torch.autograd.grad(loss, [plain["A_log"], plain["dt_bias"]])
    full = run_api(inputs, VARLEN, use_gate_in_kernel=True)
    want = torch.autograd.grad(full[0].sum() + full[1].sum(),
                               [inputs["A_log"], inputs["dt_bias"]])
    assert all(torch.allclose(a, b) for a, b in zip(got, want))


def test_forward_mode_ad_is_not_silently_dropped():
    """A dual (forward-AD) input goes through the autograd Function, which has no jvp:
    an error, never outputs without their tangent."""
    import torch.autograd.forward_ad as fwAD

    inputs = {n: x.detach() for n, x in make_inputs(VARLEN).items()}
    with fwAD.dual_level(), pytest.raises(RuntimeError, match="jvp"):
        inputs["v"] = fwAD.make_dual(inputs["v"], torch.ones_like(inputs["v"]))
        run_api(inputs, VARLEN)


def test_backend_keyword_is_passed_to_dispatch(spy):
    inputs = make_inputs(VARLEN)
    run_api(inputs, VARLEN, backend="torch")
    assert spy.requests == [{"K": VARLEN.K, "V": VARLEN.V, "dtype": torch.float64,
                             "backend": "torch"}]


def test_backend_torch_forced_on_cpu():
    inputs = make_inputs(VARLEN)
    forced = run_api(inputs, VARLEN, backend="torch")
    default = run_api(inputs, VARLEN)
    assert torch.equal(forced[0], default[0]) and torch.equal(forced[1], default[1])


def test_non_contiguous_inputs_and_expanded_grad():
    inputs = make_inputs(VARLEN)
    v_t = inputs["v"].detach().transpose(2, 3).contiguous().transpose(2, 3).requires_grad_()
    assert not v_t.is_contiguous()
    o, _ = flash_qla.chunk_gated_delta_rule(**{**inputs, "v": v_t},
                                            cu_seqlens=cu_tensor(VARLEN))
    (dv,) = torch.autograd.grad(o.sum(), [v_t])        # do is an expanded (stride-0) tensor
    ref_o, _ = oracle(inputs, VARLEN)
    (ref_dv,) = torch.autograd.grad(ref_o.sum(), [inputs["v"]])
    assert rel_l2(dv, ref_dv) < FP64_TOL


# --------------------------------------------------------------------------------------
# Compatibility keywords
# --------------------------------------------------------------------------------------

NOT_IMPLEMENTED = [
    pytest.param({"head_first": True}, r"head_first=True", id="head_first"),
    pytest.param({"enable_fwd_cp_cache": True}, r"enable_fwd_cp_cache=True",
                 id="enable_fwd_cp_cache"),
]


@pytest.mark.parametrize("kwargs, match", NOT_IMPLEMENTED)
def test_unsupported_compat_keywords_raise(kwargs, match):
    inputs = make_inputs(VARLEN)
    with pytest.raises(NotImplementedError, match=match):
        run_api(inputs, VARLEN, **kwargs)


ACCEPTED = [
    pytest.param({"auto_cp": True}, id="auto_cp-True"),
    pytest.param({"auto_cp": False}, id="auto_cp-False"),
    pytest.param({"auto_cp": None, "enable_fwd_cp_cache": False, "force_intra_cp": False,
                  "segment_len": None, "cp_context": None, "head_first": False},
                 id="all-defaults-explicit"),
    pytest.param({"cu_seqlens_cpu": torch.tensor(VARLEN.cu_seqlens)}, id="cu_seqlens_cpu"),
]


@pytest.mark.parametrize("kwargs", ACCEPTED)
def test_accepted_compat_keywords_do_not_change_result(kwargs):
    inputs = make_inputs(VARLEN)
    with_kwargs = run_api(inputs, VARLEN, **kwargs)
    plain = run_api(inputs, VARLEN)
    assert torch.equal(with_kwargs[0], plain[0]) and torch.equal(with_kwargs[1], plain[1])


SEGMENTED = [
    pytest.param({"segment_len": 64}, id="segment_len-64"),
    pytest.param({"segment_len": 128, "force_intra_cp": True}, id="segment_len-128-forced"),
    pytest.param({"force_intra_cp": True}, id="force_intra_cp-default-length"),
]


@pytest.mark.parametrize("kwargs", SEGMENTED)
def test_segment_parallel_forward_matches_recurrence(kwargs):
    """Exact split: values and every gradient as without it (fp64, torch backend)."""
    inputs = make_inputs(VARLEN)
    o, final = run_api(inputs, VARLEN, **kwargs)
    ref_o, ref_final = oracle(inputs, VARLEN)
    assert rel_l2(o, ref_o) < FP64_TOL
    assert rel_l2(final, ref_final) < FP64_TOL
    names = [n for n, t in inputs.items() if torch.is_tensor(t) and t.requires_grad]
    grads = torch.autograd.grad((o.square().sum() + final.sum()), [inputs[n] for n in names])
    ref = torch.autograd.grad((ref_o.square().sum() + ref_final.sum()),
                              [inputs[n] for n in names])
    for name, a, b in zip(names, grads, ref):
        assert rel_l2(a, b) < FP64_TOL, name


BAD_SEGMENTS = [
    pytest.param({"segment_len": 100}, ValueError, r"segment_len: expected a positive "
                 r"multiple of the chunk size 64, got 100", id="not-multiple"),
    pytest.param({"segment_len": 0}, ValueError, r"segment_len", id="zero"),
    pytest.param({"segment_len": 64.0}, TypeError, r"segment_len: expected an int",
                 id="float"),
    pytest.param({"segment_len": 64, "force_intra_cp": False}, ValueError,
                 r"force_intra_cp=False contradicts segment_len=64", id="contradiction"),
]


@pytest.mark.parametrize("kwargs, error, match", BAD_SEGMENTS)
def test_bad_segment_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        run_api(make_inputs(VARLEN), VARLEN, **kwargs)


def test_positional_order_of_fla_and_flashqla():
    """Both call it as (q, k, v, g, beta, scale, initial_state, output_final_state,
    use_qk_l2norm_in_kernel, cu_seqlens); everything after is keyword-only here."""
    x = make_inputs(VARLEN)
    positional = flash_qla.chunk_gated_delta_rule(
        x["q"], x["k"], x["v"], x["g"], x["beta"], 0.5, x["initial_state"], True, True,
        cu_tensor(VARLEN))
    keywords = flash_qla.chunk_gated_delta_rule(
        **x, scale=0.5, output_final_state=True, use_qk_l2norm_in_kernel=True,
        cu_seqlens=cu_tensor(VARLEN))
    assert torch.equal(positional[0], keywords[0])
    assert torch.equal(positional[1], keywords[1])


def test_unknown_keyword_is_a_type_error():
    inputs = make_inputs(VARLEN)
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'use_cache'"):
        run_api(inputs, VARLEN, use_cache=True)


# --------------------------------------------------------------------------------------
# Low-level pair
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("config", list(CONFIGS))
def test_low_level_pair_matches_recurrence(config):
    cfg = CONFIGS[config]
    inputs = make_inputs(cfg)
    plain = {n: x.detach() for n, x in inputs.items()}
    g_cumsum, A, o, h, ht = flash_qla.chunk_gated_delta_rule_fwd(
        **plain, cu_seqlens=cu_tensor(cfg))
    gen = torch.Generator().manual_seed(1)
    do = torch.randn(o.shape, generator=gen, dtype=torch.float64)
    dht = torch.randn(ht.shape, generator=gen, dtype=torch.float64)
    dq, dk, dv, db, dg, dh0 = flash_qla.chunk_gated_delta_rule_bwd(
        plain["q"], plain["k"], plain["v"], g_cumsum, plain["beta"], A, do, dht,
        initial_state=plain["initial_state"], cu_seqlens=cu_tensor(cfg))
    actual = {"o": o, "final_state": ht, "q": dq, "k": dk, "v": dv, "beta": db, "g": dg,
              "initial_state": dh0}
    ref = oracle(inputs, cfg)
    expected = {"o": ref[0], "final_state": ref[1], **grads(ref, inputs)}
    assert h is None
    assert (g_cumsum.shape, A.shape) == ((cfg.B, cfg.T, cfg.Hv), (cfg.B, cfg.T, cfg.Hv, 64))
    assert too_large(errors(actual, expected), FP64_TOL) == {}


def test_low_level_chunk_states():
    cfg = CONFIGS["B2-T75-Hk2-Hv4-K8-V16"]
    inputs = {n: x.detach() for n, x in make_inputs(cfg).items()}
    _, _, _, h, ht = flash_qla.chunk_gated_delta_rule_fwd(**inputs, output_h=True,
                                                          output_final_state=False)
    first64 = {n: x[:, :64] if n != "initial_state" else x for n, x in inputs.items()}
    _, state64 = oracle(first64, cfg)
    assert ht is None
    assert h.shape == (cfg.B, 2, cfg.Hv, cfg.K, cfg.V)
    assert torch.equal(h[:, 0], inputs["initial_state"])
    assert rel_l2(h[:, 1], state64) < FP64_TOL


def test_low_level_outputs_carry_no_graph():
    inputs = make_inputs(VARLEN)
    outputs = flash_qla.chunk_gated_delta_rule_fwd(**inputs, cu_seqlens=cu_tensor(VARLEN))
    assert [x.requires_grad for x in outputs if x is not None] == [False] * 4


# --------------------------------------------------------------------------------------
# Package surface
# --------------------------------------------------------------------------------------

def test_import_is_light():
    """No backend discovery, reference or TileLang at import (works without a GPU)."""
    code = ("import sys, flash_qla; "
            "loaded = sorted(m for m in ('flash_qla.dispatch', 'flash_qla.reference', "
            "'tilelang') if m in sys.modules); print(loaded, flash_qla.__version__)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env=env, check=True)
    assert result.stdout.startswith("[] ")


def test_public_names():
    assert set(flash_qla.__all__) == {"__version__", "chunk_gated_delta_rule",
                                      "chunk_gated_delta_rule_fwd",
                                      "chunk_gated_delta_rule_bwd",
                                      "fused_recurrent_gated_delta_rule", "utils"}
    assert isinstance(flash_qla.__version__, str) and flash_qla.__version__


class PlanningKernels(SpyKernels):
    """SpyKernels with an automatic segment planner that always splits at 64 tokens."""

    def __init__(self):
        super().__init__()
        self.plans = []

    def plan_segment_len(self, bounds, Hv, K, V, device, bounded):
        self.plans.append((bounds, Hv, K, V))
        self.bounded = bounded
        return 64


@pytest.fixture
def planner(monkeypatch):
    kernels = PlanningKernels()
    monkeypatch.setattr(dispatch, "get_kernels", lambda device, **kw: (dispatch.TORCH_BACKEND,
                                                                        kernels))
    return kernels


@pytest.mark.parametrize("cpu_offsets", [True, False], ids=["host-offsets", "device-offsets"])
def test_auto_split_asks_the_backend_and_stays_exact(planner, cpu_offsets):
    """With host offsets (given, or read by the call from cu_seqlens: FLA's call), the
    backend's planner is asked (auto_cp None or True) and its split (the forward passes
    of flash_qla.segments) gives the fp64 recurrence's result."""
    inputs = make_inputs(VARLEN)
    cu_cpu = cu_tensor(VARLEN) if cpu_offsets else None
    for auto_cp in (None, True):
        planner.fwd_calls.clear()
        o, ht = run_api(inputs, VARLEN, cu_seqlens_cpu=cu_cpu, auto_cp=auto_cp)
        # local states, transitions (one pass per V columns of the K x K identity), output
        assert len(planner.fwd_calls) == 2 + -(-VARLEN.K // VARLEN.V)
        ref_o, ref_ht = oracle(inputs, VARLEN)
        assert too_large(errors({"o": o, "ht": ht}, {"o": ref_o, "ht": ref_ht}), FP64_TOL) == {}
    assert planner.plans[0] == (list(VARLEN.cu_seqlens), VARLEN.Hv, VARLEN.K, VARLEN.V)


@pytest.mark.parametrize("kwargs", [dict(auto_cp=False), dict(segment_len=128),
                                    dict(force_intra_cp=True)],
                         ids=["auto_cp-False", "segment_len", "force_intra_cp"])
def test_auto_split_not_asked(planner, kwargs):
    """auto_cp=False or an explicit split: the planner is not consulted."""
    inputs = make_inputs(VARLEN)
    run_api(inputs, VARLEN, cu_seqlens_cpu=cu_tensor(VARLEN), **kwargs)
    assert planner.plans == []


def test_gradients_through_a_split_forward():
    """The backward reads the g_cumsum and A that the split forward's first pass saved
    (chunk boundaries unchanged by the split): every gradient equals the fp64
    recurrence's, as without a split."""
    inputs = make_inputs(VARLEN)
    out = run_api(inputs, VARLEN, cu_seqlens_cpu=cu_tensor(VARLEN), segment_len=64)
    ref = oracle(inputs, VARLEN)
    actual = {"o": out[0], **grads(out, inputs)}
    expected = {"o": ref[0], **grads(ref, inputs)}
    assert set(actual) >= {"q", "k", "v", "g", "beta"}
    assert too_large(errors(actual, expected), FP64_TOL) == {}


def test_integer_scalar_segment_len_is_accepted():
    """A segment length from numpy or torch arithmetic (np.int64, a 0-d integer tensor)
    splits like the same int; a float tensor or a bool is a TypeError showing it."""
    np = pytest.importorskip("numpy")
    inputs = make_inputs(VARLEN)
    ref = run_api(inputs, VARLEN, segment_len=64)
    for scalar in (np.int64(64), torch.tensor(64)):
        ours = run_api(inputs, VARLEN, segment_len=scalar)
        assert torch.equal(ours[0], ref[0]) and torch.equal(ours[1], ref[1])
    for bad in (torch.tensor(64.0), True):
        with pytest.raises(TypeError, match=r"segment_len: expected an int .* got \w+ "):
            run_api(inputs, VARLEN, segment_len=bad)


@pytest.mark.parametrize("bound, error", [(-0.1, ValueError), (1.0, ValueError),
                                          (True, TypeError), ("2^-9", TypeError)])
def test_segment_shortcut_bound_is_checked(bound, error):
    inputs = make_inputs(VARLEN)
    with pytest.raises(error, match="segment_shortcut_bound"):
        run_api(inputs, VARLEN, segment_shortcut_bound=bound)


def test_planner_is_told_which_split_follows(planner):
    """Backends without ``fwd_warmup`` are asked for the exact split's plan."""
    run_api(make_inputs(VARLEN), VARLEN, cu_seqlens_cpu=cu_tensor(VARLEN))
    assert planner.bounded is False


class _Planner:
    """A backend with a planner that records its keyword arguments, and walks searched in
    its kernel (so a captured varlen batch is planned at all)."""

    searches_walks = True

    def __init__(self):
        self.kwargs = []

    def plan_segment_len(self, bounds, Hv, K, V, device, bounded, **kwargs):
        self.kwargs.append(kwargs)
        return None


@pytest.mark.parametrize("capturing, grad, kept, dominant", [
    (False, True, False, None),      # eager training: the lengths are real, full grids split
    (True, False, True, None),       # captured inference on a warm-up's lengths
    (True, True, True, False),       # captured varlen training: its backward runs unsplit
    (True, False, False, False),     # captured, lengths guessed: one long sequence
], ids=["eager", "captured-inference", "captured-training", "captured-guess"])
def test_planner_told_when_a_full_grid_must_stay_whole(monkeypatch, capturing, grad, kept,
                                                       dominant):
    """``dominant=False`` reaches the backend's planner exactly where splitting a batch
    that fills the GPU cannot pay (a capture's guessed lengths, a captured varlen training
    step), and is left out otherwise (a planner may predate the keyword)."""
    from flash_qla import api, offsets, validation

    monkeypatch.setattr(validation, "is_capturing", lambda device: capturing)
    cu = torch.tensor([0, 300, 400], dtype=torch.int32)
    monkeypatch.setattr(offsets, "kept_offsets", lambda t: cu if kept else None)
    q = torch.zeros(1, 400, 2, 8, requires_grad=grad)
    v = torch.zeros(1, 400, 4, 8)
    kernels = _Planner()
    api._auto_segment_len(kernels, q, v, cu, cu if not capturing else None, bounded=True)
    assert kernels.kwargs == [{} if dominant is None else {"dominant": dominant}]
