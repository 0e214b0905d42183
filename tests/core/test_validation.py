"""Every input check of the public entry points; each message must name the argument.

Cases are tables of (id, edit of a valid call, exception, regex on the message). The
base call is valid (a test checks that), so each case fails for its one reason.
K != V in the base shapes, so the two state layouts are distinguishable.
"""

from __future__ import annotations

import pytest
import torch

import flash_qla
from flash_qla import dispatch, validation
from flash_qla.backend import KERNEL_API_VERSION, BackendSpec
from flash_qla.reference import TORCH_KERNELS

B, T, HK, HV, K, V = 2, 8, 2, 4, 16, 8


def base_call(**shape) -> dict:
    """Valid keyword arguments of chunk_gated_delta_rule (dense, with initial state)."""
    b, t = shape.get("B", B), shape.get("T", T)
    torch.manual_seed(0)
    return dict(
        q=torch.randn(b, t, HK, K), k=torch.randn(b, t, HK, K),
        v=torch.randn(b, t, HV, V), g=-torch.rand(b, t, HV), beta=torch.rand(b, t, HV),
        initial_state=torch.zeros(b, HV, K, V),
    )


def varlen_call() -> dict:
    """Valid packed call: B = 1, T = 8, three sequences (one empty) and 1 padding token."""
    call = base_call(B=1)
    call.update(cu_seqlens=torch.tensor([0, 3, 3, 7]), initial_state=torch.zeros(3, HV, K, V))
    return call


def _with(call: dict, **changes) -> dict:
    call.update(changes)
    return call


def _meta(x: torch.Tensor) -> torch.Tensor:
    """The same tensor on another device (meta: available without a GPU)."""
    return x.to("meta")


# id -> (make kwargs, exception, regex that must name the argument)
FORWARD_CASES = [
    # kinds and ranks
    pytest.param(lambda: _with(base_call(), q=[[1.0]]), TypeError,
                 r"q must be a torch.Tensor; got list", id="q-not-tensor"),
    pytest.param(lambda: _with(base_call(), initial_state=3.0), TypeError,
                 r"initial_state must be a torch.Tensor", id="initial_state-not-tensor"),
    pytest.param(lambda: _with(base_call(), q=torch.randn(B, T, K)), ValueError,
                 r"q must be 4-D \[B, T, Hk, K\]; got 3-D", id="q-rank"),
    pytest.param(lambda: _with(base_call(), k=torch.randn(B, T, HK, 8)), ValueError,
                 r"k must have shape .*got \[2, 8, 2, 8\]", id="k-shape"),
    pytest.param(lambda: _with(base_call(), v=torch.randn(B, T, HV * V)), ValueError,
                 r"v must be 4-D \[B, T, Hv, V\]", id="v-rank"),
    pytest.param(lambda: _with(base_call(), g=torch.rand(B, T, HV, 1)), ValueError,
                 r"g must be 3-D \[B, T, Hv\]", id="g-rank"),
    # heads
    pytest.param(lambda: _with(base_call(), v=torch.randn(B, T, 3, V)), ValueError,
                 r"Hv must be a positive multiple of q/k's Hk; got Hv=3, Hk=2",
                 id="hv-not-multiple-of-hk"),
    pytest.param(lambda: _with(base_call(), beta=torch.rand(B, T, HK)), ValueError,
                 r"beta must have shape \[B, T, Hv\] \(Hv: v's heads\) = \[2, 8, 4\]; "
                 r"got \[2, 8, 2\]",
                 id="beta-heads"),
    # B / T across tensors
    pytest.param(lambda: _with(base_call(), v=torch.randn(1, T, HV, V)), ValueError,
                 r"v must have q's batch and time dims \(B, T\) = \(2, 8\); got \(1, 8\)",
                 id="v-batch-mismatch"),
    pytest.param(lambda: _with(base_call(), g=torch.rand(B, T - 1, HV)), ValueError,
                 r"g must have q's batch and time dims .* got \(2, 7\)", id="g-time-mismatch"),
    pytest.param(lambda: _with(base_call(), beta=torch.rand(1, T, HV)), ValueError,
                 r"beta must have q's batch and time dims", id="beta-batch-mismatch"),
    # dtypes
    pytest.param(lambda: _with(base_call(), q=torch.ones(B, T, HK, K, dtype=torch.int32)),
                 TypeError, r"q must have dtype in \(bfloat16, float16, float32, float64\); "
                 r"got torch.int32", id="q-dtype-int"),
    pytest.param(lambda: _with(base_call(), k=torch.randn(B, T, HK, K).bfloat16()),
                 TypeError, r"q, k, v must share one dtype; got q=torch.float32, "
                 r"k=torch.bfloat16, v=torch.float32", id="k-dtype-mismatch"),
    pytest.param(lambda: _with(base_call(), v=torch.randn(B, T, HV, V).half()),
                 TypeError, r"q, k, v must share one dtype; .*v=torch.float16",
                 id="v-dtype-mismatch"),
    pytest.param(lambda: _with(base_call(), g=-torch.rand(B, T, HV).half()), TypeError,
                 r"g must have dtype in \(float32, bfloat16, float64\); got torch.float16",
                 id="g-dtype-fp16"),
    pytest.param(lambda: _with(base_call(), beta=torch.rand(B, T, HV).bfloat16()), TypeError,
                 r"beta must have dtype torch.float32 \(q's dtype\); got torch.bfloat16",
                 id="beta-dtype"),
    pytest.param(lambda: _with(base_call(), initial_state=torch.zeros(B, HV, K, V).double()),
                 TypeError, r"initial_state must have dtype in \(float32, bfloat16, float16\) "
                 r"\(q/k/v are torch.float32; it is converted to float32\); got torch.float64",
                 id="state-dtype-fp64-with-fp32-inputs"),
    pytest.param(lambda: _with(base_call(), initial_state=torch.zeros(B, HV, K, V).long()),
                 TypeError, r"initial_state must have dtype in .*got torch.int64",
                 id="state-dtype-int"),
    pytest.param(lambda: {**{n: x.double() for n, x in base_call().items()},
                          "initial_state": torch.zeros(B, HV, K, V)},
                 TypeError, r"initial_state must have dtype torch.float64 \(q/k/v are "
                 r"torch.float64\); got torch.float32", id="state-fp32-with-fp64-inputs"),
    # devices
    pytest.param(lambda: _with(base_call(), k=_meta(torch.randn(B, T, HK, K))), ValueError,
                 r"k must be on q's device cpu; got meta", id="k-device"),
    pytest.param(lambda: _with(base_call(), beta=_meta(torch.rand(B, T, HV))), ValueError,
                 r"beta must be on q's device", id="beta-device"),
    # q the odd one out: the message lists every tensor's device
    pytest.param(lambda: _with(base_call(), q=_meta(torch.randn(B, T, HK, K))), ValueError,
                 r"k must be on q's device meta; got cpu \(devices: q meta, k cpu, v cpu, ",
                 id="q-device-odd-one-out"),
    pytest.param(lambda: _with(base_call(), initial_state=_meta(torch.zeros(B, HV, K, V))),
                 ValueError, r"initial_state must be on q's device", id="state-device"),
    pytest.param(lambda: _with(varlen_call(), cu_seqlens=_meta(torch.tensor([0, 3, 3, 7]))),
                 ValueError, r"cu_seqlens must be on q's device", id="cu_seqlens-device"),
    # cu_seqlens
    pytest.param(lambda: _with(varlen_call(), cu_seqlens=torch.tensor([0.0, 3.0, 3.0, 7.0])),
                 TypeError, r"cu_seqlens must have an integer dtype .*got torch.float32",
                 id="cu_seqlens-float"),
    pytest.param(lambda: _with(varlen_call(), cu_seqlens=torch.tensor([[0, 3], [3, 7]])),
                 ValueError, r"cu_seqlens must be 1-D \[N\+1\]", id="cu_seqlens-2d"),
    pytest.param(lambda: _with(varlen_call(), cu_seqlens=torch.tensor([0])),
                 ValueError, r"cu_seqlens must be 1-D \[N\+1\] with N >= 1; got shape \[1\]",
                 id="cu_seqlens-no-sequence"),
    pytest.param(lambda: _with(base_call(), cu_seqlens=torch.tensor([0, 3, 8])), ValueError,
                 r"cu_seqlens requires B == 1 \(packed sequences\); got B=2",
                 id="cu_seqlens-with-B2"),
    pytest.param(lambda: _with(varlen_call(), cu_seqlens=torch.tensor([1, 3, 3, 7])),
                 ValueError, r"cu_seqlens must start at 0; got cu_seqlens\[0\]=1",
                 id="cu_seqlens-not-zero-start"),
    pytest.param(lambda: _with(varlen_call(), cu_seqlens=torch.tensor([0, 5, 3, 7])),
                 ValueError, r"cu_seqlens must be non-decreasing; got cu_seqlens\[1\]=5 > "
                 r"cu_seqlens\[2\]=3", id="cu_seqlens-decreasing"),
    pytest.param(lambda: _with(varlen_call(), cu_seqlens=torch.tensor([0, 3, 3, 9])),
                 ValueError, r"cu_seqlens\[-1\] must be at most T=8 .*got 9",
                 id="cu_seqlens-beyond-T"),
    pytest.param(lambda: _with(varlen_call(), cu_seqlens_cpu=torch.tensor([0, 5, 3, 7])),
                 ValueError, r"cu_seqlens_cpu must be non-decreasing",
                 id="cu_seqlens_cpu-values-checked-first"),
    pytest.param(lambda: _with(varlen_call(), cu_seqlens_cpu=torch.tensor([0, 2, 3, 7])),
                 ValueError, r"cu_seqlens_cpu must hold cu_seqlens' values \[0, 3, 3, 7\]; "
                 r"got \[0, 2, 3, 7\]", id="cu_seqlens_cpu-other-values-on-the-host"),
    pytest.param(lambda: _with(varlen_call(), cu_seqlens_cpu=torch.tensor([0, 3, 7])),
                 ValueError, r"cu_seqlens_cpu must have cu_seqlens' length 4; got 3",
                 id="cu_seqlens_cpu-length"),
    pytest.param(lambda: _with(base_call(B=1), cu_seqlens_cpu=torch.tensor([0, 8]),
                               initial_state=None),
                 ValueError, r"cu_seqlens_cpu was given without cu_seqlens",
                 id="cu_seqlens_cpu-alone"),
    # states
    pytest.param(lambda: _with(base_call(), initial_state=torch.zeros(3, HV, K, V)),
                 ValueError, r"initial_state must hold one state per sequence, N=2 .*got N=3",
                 id="state-wrong-N-dense"),
    pytest.param(lambda: _with(varlen_call(), initial_state=torch.zeros(1, HV, K, V)),
                 ValueError, r"initial_state must hold one state per sequence, N=3 .*got N=1",
                 id="state-wrong-N-varlen"),
    pytest.param(lambda: _with(base_call(), initial_state=torch.zeros(B, HV, V, K)),
                 ValueError, r"initial_state must have shape \[N, Hv, K, V\] = \[2, 4, 16, 8\]",
                 id="state-v-first-given-canonical-expected"),
    pytest.param(lambda: _with(base_call(), state_v_first=True), ValueError,
                 r"initial_state must have shape \[N, Hv, V, K\] \(v-first\) = \[2, 4, 8, 16\]",
                 id="state-canonical-given-v-first-expected"),
    pytest.param(lambda: _with(base_call(), transpose_state_layout=True,
                               initial_state=torch.zeros(B, 2, V, K)), ValueError,
                 r"initial_state must have shape \[N, Hv, V, K\]", id="state-v-first-wrong-heads"),
    pytest.param(lambda: _with(base_call(), initial_state=torch.zeros(B, HV, K)), ValueError,
                 r"initial_state must be 4-D \[N, Hv, K, V\]", id="state-rank"),
    # scalar options
    pytest.param(lambda: _with(base_call(), scale="0.5"), TypeError,
                 r"scale must be a real number \(a float, an int\) or None; got str '0.5'",
                 id="scale-type"),
    pytest.param(lambda: _with(base_call(), scale=True), TypeError,
                 r"scale must be a real number \(a float, an int\) or None; got bool True",
                 id="scale-bool"),
    pytest.param(lambda: _with(base_call(), scale=float("nan")), ValueError,
                 r"scale must be a finite float \(or None for K \*\* -0.5\); got nan",
                 id="scale-nan"),
    pytest.param(lambda: _with(base_call(), scale=float("-inf")), ValueError,
                 r"scale must be a finite float .*got -inf", id="scale-inf"),
    pytest.param(lambda: _with(base_call(), q=torch.randn(B, T, HK, 0), k=torch.randn(B, T, HK, 0),
                               initial_state=None), ValueError,
                 r"q and k need a head dim K >= 1; got K=0", id="head-dim-K-zero"),
    pytest.param(lambda: _with(base_call(), v=torch.randn(B, T, HV, 0), initial_state=None),
                 ValueError, r"v needs a head dim V >= 1; got V=0", id="head-dim-V-zero"),
    pytest.param(lambda: _with(base_call(), transpose_state_layout=True, state_v_first=False),
                 ValueError, r"transpose_state_layout=True and state_v_first=False contradict",
                 id="layout-options-contradict"),
    pytest.param(lambda: _with(base_call(), transpose_state_layout=False, state_v_first=True),
                 ValueError, r"transpose_state_layout=False and state_v_first=True contradict",
                 id="layout-options-contradict-other-way"),
    pytest.param(lambda: _with(base_call(), state_v_first="yes"), TypeError,
                 r"state_v_first: expected a bool or None, got str 'yes'", id="state_v_first-type"),
    pytest.param(lambda: _with(base_call(), auto_cp=1), TypeError,
                 r"auto_cp: expected a bool or None, got int 1", id="auto_cp-type"),
    pytest.param(lambda: _with(base_call(), output_final_state=None), TypeError,
                 r"output_final_state: expected a bool, got NoneType None",
                 id="output_final_state-type"),
    # in-kernel gate parameters
    pytest.param(lambda: _with(base_call(), A_log=torch.zeros(HV)), ValueError,
                 r"A_log is only used with use_gate_in_kernel=True", id="A_log-without-gate"),
    pytest.param(lambda: _with(base_call(), dt_bias=torch.zeros(HV)), ValueError,
                 r"dt_bias is only used with use_gate_in_kernel=True", id="dt_bias-without-gate"),
    pytest.param(lambda: _with(base_call(), use_gate_in_kernel=True), ValueError,
                 r"A_log is required when use_gate_in_kernel=True; got None",
                 id="gate-without-A_log"),
    pytest.param(lambda: _with(base_call(), use_gate_in_kernel=True, A_log=torch.zeros(HK)),
                 ValueError, r"A_log must have shape \[Hv\] = \[4\]; got \[2\]",
                 id="A_log-shape"),
    pytest.param(lambda: _with(base_call(), use_gate_in_kernel=True, A_log=torch.zeros(HV),
                               dt_bias=torch.zeros(HV, dtype=torch.long)),
                 TypeError, r"dt_bias must have a floating dtype; got torch.int64",
                 id="dt_bias-dtype"),
    pytest.param(lambda: _with(base_call(), use_gate_in_kernel=True,
                               A_log=_meta(torch.zeros(HV))),
                 ValueError, r"A_log must be on q's device", id="A_log-device"),
]


def test_base_calls_are_valid():
    flash_qla.chunk_gated_delta_rule(**base_call())
    flash_qla.chunk_gated_delta_rule(**varlen_call())


@pytest.mark.parametrize("make, exc, match", FORWARD_CASES)
def test_chunk_gated_delta_rule_rejects(make, exc, match):
    with pytest.raises(exc, match=match):
        flash_qla.chunk_gated_delta_rule(**make())


LOW_LEVEL_FORWARD_CASES = [
    pytest.param(lambda: _with(base_call(), v=torch.randn(B, T, 3, V)), ValueError,
                 r"Hv must be a positive multiple", id="hv-not-multiple-of-hk"),
    pytest.param(lambda: _with(varlen_call(), cu_seqlens=torch.tensor([0, 3, 3, 9])),
                 ValueError, r"cu_seqlens\[-1\] must be at most T=8", id="cu_seqlens-beyond-T"),
    pytest.param(lambda: _with(base_call(), output_h=1), TypeError,
                 r"output_h: expected a bool, got int 1", id="output_h-type"),
]


@pytest.mark.parametrize("make, exc, match", LOW_LEVEL_FORWARD_CASES)
def test_chunk_gated_delta_rule_fwd_rejects(make, exc, match):
    with pytest.raises(exc, match=match):
        flash_qla.chunk_gated_delta_rule_fwd(**make())


def backward_call(**changes) -> dict:
    """Valid keyword arguments of chunk_gated_delta_rule_bwd (from a real forward)."""
    call = base_call()
    g_cumsum, A, o, _, ht = flash_qla.chunk_gated_delta_rule_fwd(**call)
    call.update(g=g_cumsum, A=A, do=torch.randn_like(o), dht=torch.randn_like(ht))
    call.update(changes)
    return call


BACKWARD_CASES = [
    pytest.param(lambda: backward_call(dht=torch.zeros(3, HV, K, V)), ValueError,
                 r"dht must hold one state per sequence, N=2 .*got N=3", id="dht-wrong-N"),
    pytest.param(lambda: backward_call(dht=torch.zeros(B, HV, V, K)), ValueError,
                 r"dht must have shape \[N, Hv, K, V\] = \[2, 4, 16, 8\]", id="dht-shape"),
    pytest.param(lambda: backward_call(dht=torch.zeros(B, HV, K, V).bfloat16()), TypeError,
                 r"dht must have dtype torch.float32", id="dht-dtype"),
    pytest.param(lambda: backward_call(dht=_meta(torch.zeros(B, HV, K, V))), ValueError,
                 r"dht must be on q's device", id="dht-device"),
    pytest.param(lambda: backward_call(A=torch.zeros(B, T, HK, 64)), ValueError,
                 r"A must have shape \[B, T, Hv, C\]", id="A-shape"),
    pytest.param(lambda: backward_call(A=torch.zeros(B, T, HV)), ValueError,
                 r"A must be 4-D \[B, T, Hv, C\]", id="A-rank"),
    pytest.param(lambda: backward_call(A=torch.zeros(B, T, HV, 32)), ValueError,
                 r"A must have shape \[B, T, Hv, C\] = \[2, 8, 4, 64\]", id="A-chunk"),
    pytest.param(lambda: backward_call(A=torch.zeros(B, T, HV, 64).double()), TypeError,
                 r"A \(the forward's inverse\) must have q's dtype torch.float32; "
                 r"got torch.float64", id="A-dtype"),
    pytest.param(lambda: backward_call(do=torch.zeros(B, T, HV, K)), ValueError,
                 r"do must have shape \[B, T, Hv, V\] \(v's shape\) = \[2, 8, 4, 8\]",
                 id="do-shape"),
    pytest.param(lambda: backward_call(do=torch.zeros(B, T, HV, V).bfloat16()), TypeError,
                 r"do must have q's dtype torch.float32; got torch.bfloat16", id="do-dtype"),
    pytest.param(lambda: backward_call(g=-torch.rand(B, T, HV).bfloat16()), TypeError,
                 r"g \(the forward's gate cumsum\) must have dtype torch.float32",
                 id="g_cumsum-dtype"),
    pytest.param(lambda: backward_call(do=None), TypeError,
                 r"do must be a torch.Tensor; got NoneType", id="do-missing"),
]


def test_backward_base_call_is_valid():
    flash_qla.chunk_gated_delta_rule_bwd(**backward_call())


@pytest.mark.parametrize("make, exc, match", BACKWARD_CASES)
def test_chunk_gated_delta_rule_bwd_rejects(make, exc, match):
    with pytest.raises(exc, match=match):
        flash_qla.chunk_gated_delta_rule_bwd(**make())


# --------------------------------------------------------------------------------------
# Backend-dependent checks (head dims, float64): a fake spec stands in for a GPU backend
# --------------------------------------------------------------------------------------

def _fake_spec(name: str, head_dims=((128, 128),), dtypes=("bfloat16",)) -> BackendSpec:
    return BackendSpec(name=name, distribution=f"flash-qla-{name}", version="0",
                       kernel_api_version=KERNEL_API_VERSION, capabilities=((9, 0),),
                       head_dims=head_dims, dtypes=dtypes, loader=lambda: TORCH_KERNELS)


def _bf16_qkv(call: dict) -> dict:
    return {n: x.bfloat16() if n in ("q", "k", "v") else x for n, x in call.items()}


# id -> (head dims the fake backend serves, make kwargs, exception, regex)
BACKEND_CASES = [
    pytest.param(((128, 128),), lambda: _bf16_qkv(base_call()), ValueError,
                 r"backend 'fake90' cannot run this call \(K=16, V=8\): .*"
                 r"supports head dims \(K=128, V=128\); got K=16, V=8", id="head-dims"),
    pytest.param(((K, V),), base_call, ValueError,
                 r"backend 'fake90' cannot run this call .*supports dtypes \['bfloat16'\]; "
                 r"got float32", id="dtype"),
    pytest.param((), lambda: {n: x.double() for n, x in base_call().items()}, TypeError,
                 r"float64 inputs run only on the 'torch' backend .* selected backend is "
                 r"'fake90'", id="float64-inputs"),
    pytest.param((), lambda: _with(_bf16_qkv(base_call()),
                                   g=-torch.rand(B, T, HV, dtype=torch.float64)),
                 TypeError, r"float64 inputs run only on the 'torch' backend", id="float64-g"),
]


@pytest.mark.parametrize("head_dims, make, exc, match", BACKEND_CASES)
def test_backend_rejections(monkeypatch, head_dims, make, exc, match):
    spec = _fake_spec("fake90", head_dims=head_dims)
    monkeypatch.setattr(dispatch, "get_kernels", lambda device, **kw: (spec, TORCH_KERNELS))
    with pytest.raises(exc, match=match):
        flash_qla.chunk_gated_delta_rule(**make())


def test_fake_backend_accepts_supported_call(monkeypatch):
    spec = _fake_spec("fake90", head_dims=((K, V),))
    monkeypatch.setattr(dispatch, "get_kernels", lambda device, **kw: (spec, TORCH_KERNELS))
    o, _ = flash_qla.chunk_gated_delta_rule(**_bf16_qkv(base_call()))
    assert o.dtype == torch.bfloat16


def test_unknown_backend_on_cpu_is_rejected():
    with pytest.raises(ValueError, match=r"backend: unknown backend 'nope'"):
        flash_qla.chunk_gated_delta_rule(**base_call(), backend="nope")


def test_backend_must_be_a_name():
    with pytest.raises(TypeError, match=r"backend: expected a backend name \(str\) or None, "
                                        r"got int"):
        flash_qla.chunk_gated_delta_rule(**base_call(), backend=1)


def test_compat_cache_flag_must_be_a_bool():
    with pytest.raises(TypeError, match=r"enable_fwd_cp_cache"):
        flash_qla.chunk_gated_delta_rule(**base_call(), enable_fwd_cp_cache="no")


# --------------------------------------------------------------------------------------
# cu_seqlens contents: what is valid, and no host sync during CUDA-graph capture
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("cu, expected_N", [
    pytest.param([0, 0, 8], 2, id="empty-first"),
    pytest.param([0, 8, 8], 2, id="empty-last"),
    pytest.param([0, 2, 2, 2, 5], 4, id="empty-middle-and-padding"),
    pytest.param([0, 0], 1, id="all-padding"),
])
def test_valid_cu_seqlens(cu, expected_N):
    q = torch.zeros(1, T, HK, K)
    assert validation.check_cu_seqlens(torch.tensor(cu), None, q) == expected_N


class _NoHostCopy(torch.Tensor):
    """A tensor whose values must not be read on the host (stands in for a capture)."""

    def tolist(self):
        raise AssertionError("host sync during capture")


def test_cu_seqlens_values_skipped_while_capturing(monkeypatch):
    monkeypatch.setattr(validation, "is_capturing", lambda device: True)
    cu = torch.tensor([0, 5, 3, 99]).as_subclass(_NoHostCopy)
    assert validation.check_cu_seqlens(cu, None, torch.zeros(1, T, HK, K)) == 3


def test_cu_seqlens_cpu_still_checked_while_capturing(monkeypatch):
    monkeypatch.setattr(validation, "is_capturing", lambda device: True)
    cu = torch.tensor([0, 5, 3, 7]).as_subclass(_NoHostCopy)
    with pytest.raises(ValueError, match=r"cu_seqlens_cpu must be non-decreasing"):
        validation.check_cu_seqlens(cu, torch.tensor([0, 5, 3, 7]), torch.zeros(1, T, HK, K))


def test_cu_seqlens_cpu_preferred_over_device_copy():
    cu = torch.tensor([0, 3, 3, 7]).as_subclass(_NoHostCopy)
    q = torch.zeros(1, T, HK, K)
    assert validation.check_cu_seqlens(cu, torch.tensor([0, 3, 3, 7]), q) == 3


def test_cu_seqlens_cpu_must_be_on_host():
    cu = torch.tensor([0, 3, 7])
    with pytest.raises(ValueError, match=r"cu_seqlens_cpu must be on the cpu; got meta"):
        validation.check_cu_seqlens_cpu(cu, _meta(cu))


def test_not_capturing_on_cpu():
    assert validation.is_capturing(torch.device("cpu")) is False


# --------------------------------------------------------------------------------------
# Repeated calls: what a call that passed lets the next one skip
# --------------------------------------------------------------------------------------

def test_a_repeated_signature_still_checks_the_offsets_values():
    """A call whose tensors match an earlier valid call in type, shape, dtype and device
    skips those checks, not the checks of its offsets' values (nor of the initial state
    against the N they give)."""
    flash_qla.chunk_gated_delta_rule(**varlen_call())                  # valid: kept
    with pytest.raises(ValueError, match=r"cu_seqlens must be non-decreasing"):
        flash_qla.chunk_gated_delta_rule(**_with(varlen_call(),
                                                 cu_seqlens=torch.tensor([0, 3, 2, 7])))
    with pytest.raises(ValueError, match=r"cu_seqlens\[-1\] must be at most T=8"):
        flash_qla.chunk_gated_delta_rule(**_with(varlen_call(),
                                                 cu_seqlens=torch.tensor([0, 3, 3, 9])))
    with pytest.raises(ValueError, match=r"initial_state must hold one state per sequence, N=2"):
        flash_qla.chunk_gated_delta_rule(**_with(varlen_call(),
                                                 cu_seqlens=torch.tensor([0, 3, 5, 7][:3])))


def test_a_changed_dtype_or_shape_is_checked_again():
    flash_qla.chunk_gated_delta_rule(**base_call())                    # valid: kept
    with pytest.raises(TypeError, match=r"beta"):
        flash_qla.chunk_gated_delta_rule(**_with(base_call(),
                                                 beta=torch.rand(B, T, HV).to(torch.int32)))
    with pytest.raises(ValueError, match=r"initial_state must hold one state per sequence, N=2"):
        flash_qla.chunk_gated_delta_rule(**_with(base_call(),
                                                 initial_state=torch.zeros(B + 1, HV, K, V)))


def test_the_backend_pick_follows_the_request():
    """The API keeps its backend pick per call signature; another ``backend=`` is another
    signature (on the CPU only ``torch`` runs: a GPU backend's name is refused)."""
    flash_qla.chunk_gated_delta_rule(**base_call())
    with pytest.raises(ValueError, match=r"backend: unknown backend 'nope'"):
        flash_qla.chunk_gated_delta_rule(**base_call(), backend="nope")
    flash_qla.chunk_gated_delta_rule(**base_call(), backend="torch")
