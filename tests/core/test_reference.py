"""The PyTorch reference (``flash_qla.reference``) against the definition, in fp64.

* chunked forward: o, final_state and the chunk-start states h against the
  token-by-token recurrence (h recorded by running the recurrence chunk by chunk);
* manual chunked backward: dq, dk, dv, dbeta, dg, dh0 against ``torch.autograd``
  through the recurrence, with a random ``do`` and (where the case says so) ``dht``;
* A against a direct ``torch.linalg.inv`` per chunk;
* padding tokens after ``cu_seqlens[-1]``: exact zeros everywhere;
* the bf16 path of the chunked forward against the fp64 recurrence;
* ``TORCH_KERNELS`` against the ``Kernels`` protocol;
* the shared ``rel_l2`` helper.

All fp64 comparisons use relative L2 < 1e-10 (observed ~1e-15).
"""

from __future__ import annotations

import inspect
import math
import zlib
from dataclasses import dataclass
from functools import cache

import pytest
import torch
import torch.nn.functional as F

from flash_qla.backend import Kernels
from flash_qla.reference import (
    TORCH_KERNELS,
    chunk_gated_delta_rule_bwd_torch,
    chunk_gated_delta_rule_fwd_torch,
    recurrent_gated_delta_rule,
)
from tests.helpers import rel_l2

C = 64
TOL_FP64 = 1e-10
TOL_BF16 = 1e-2


# --------------------------------------------------------------------------------------
# Configuration table
# --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Case:
    """One problem. ``cu`` set means varlen (B must be 1); T may exceed cu[-1] (padding)."""

    id: str
    B: int = 1
    T: int = 64
    Hk: int = 1
    Hv: int = 1
    K: int = 8
    V: int = 8
    cu: tuple[int, ...] | None = None
    gate: str = "typical"          # "zero" | "typical" (logsigmoid(randn)) | "strong" (to -30)
    h0: bool = True                # pass an initial state
    dht: bool = True               # backpropagate a random gradient of the final state
    scale: float | None = None     # None: K ** -0.5

    @property
    def resolved_scale(self) -> float:
        return self.K ** -0.5 if self.scale is None else self.scale

    @property
    def N(self) -> int:
        return self.B if self.cu is None else len(self.cu) - 1

    @property
    def n_padding(self) -> int:
        return 0 if self.cu is None else self.T - self.cu[-1]


DENSE_CASES = [
    Case("B1-T1-Hk1-Hv1"),
    Case("B2-T63-Hk1-Hv2", B=2, T=63, Hv=2),
    Case("B1-T64-Hk1-Hv4-gate0", T=64, Hv=4, gate="zero"),
    Case("B2-T75-Hk2-Hv2-strong-noh0", B=2, T=75, Hk=2, Hv=2, gate="strong", h0=False),
    Case("B1-T75-Hk2-Hv4-noh0-nodht", T=75, Hk=2, Hv=4, K=16, V=8, h0=False, dht=False),
    Case("B2-T64-Hk4-Hv4-scale0.7", B=2, T=64, Hk=4, Hv=4, scale=0.7),
    Case("B1-T63-Hk1-Hv1-gate0-nodht", T=63, gate="zero", dht=False),
    Case("B1-T1000-Hk2-Hv4-K16-V16", T=1000, Hk=2, Hv=4, K=16, V=16),
    Case("B2-T1000-Hk1-Hv2-strong-nodht", B=2, T=1000, Hv=2, gate="strong", dht=False),
    Case("B1-T75-Hk1-Hv2-K128-V128", T=75, Hv=2, K=128, V=128),
]

VARLEN_CASES = [
    Case("cu0-0-64", T=64, cu=(0, 0, 64), Hv=2),
    Case("cu0-64-64", T=64, cu=(0, 64, 64), Hk=2, Hv=2),
    Case("cu0-1-65-130-len1", T=130, cu=(0, 1, 65, 130), Hv=2),
    Case("cu0-37-100-101-250-odd", T=250, cu=(0, 37, 100, 101, 250), Hk=2, Hv=4, V=12),
    Case("cu0-30-97-pad23", T=120, cu=(0, 30, 97), Hv=2),
    Case("cu0-130-131-pad9-strong-noh0", T=140, cu=(0, 130, 131), Hk=1, Hv=4,
         gate="strong", h0=False),
    Case("cu0-65-129-gate0-scale0.3-nodht", T=129, cu=(0, 65, 129), Hv=4, gate="zero",
         dht=False, scale=0.3),
    Case("cu0-333-1000-pad7-Hk2-Hv4", T=1007, cu=(0, 333, 1000), Hk=2, Hv=4),
]

ALL_CASES = DENSE_CASES + VARLEN_CASES
PADDED_CASES = [c for c in ALL_CASES if c.n_padding > 0]


def _params(cases):
    return [pytest.param(c, id=c.id) for c in cases]


# --------------------------------------------------------------------------------------
# Inputs and references (cached per case: the fwd and bwd tests share them)
# --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Inputs:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    h0: torch.Tensor | None
    do: torch.Tensor
    dht: torch.Tensor | None
    cu: torch.Tensor | None


def _gate(case: Case, gen: torch.Generator) -> torch.Tensor:
    shape = (case.B, case.T, case.Hv)
    if case.gate == "zero":
        return torch.zeros(shape, dtype=torch.float64)
    if case.gate == "typical":
        return F.logsigmoid(torch.randn(shape, generator=gen, dtype=torch.float64))
    if case.gate == "strong":
        return -30.0 * torch.rand(shape, generator=gen, dtype=torch.float64)
    raise ValueError(case.gate)


@cache
def make_inputs(case: Case) -> Inputs:
    """Deterministic fp64 inputs; q/k L2-normalised, beta in (0, 1)."""
    gen = torch.Generator().manual_seed(zlib.crc32(case.id.encode()))

    def randn(*shape):
        return torch.randn(shape, generator=gen, dtype=torch.float64)

    B, T, Hk, Hv, K, V, N = case.B, case.T, case.Hk, case.Hv, case.K, case.V, case.N
    return Inputs(
        q=F.normalize(randn(B, T, Hk, K), dim=-1),
        k=F.normalize(randn(B, T, Hk, K), dim=-1),
        v=randn(B, T, Hv, V),
        g=_gate(case, gen),
        beta=torch.sigmoid(randn(B, T, Hv)),
        h0=randn(N, Hv, K, V) if case.h0 else None,
        do=randn(B, T, Hv, V),
        dht=randn(N, Hv, K, V) if case.dht else None,
        cu=None if case.cu is None else torch.tensor(case.cu, dtype=torch.int32),
    )


def _sequences(case: Case):
    """``(batch_rows, bos, eos, state_rows)`` per independent span (dense: all rows)."""
    if case.cu is None:
        return [(slice(0, case.B), 0, case.T, slice(0, case.B))]
    return [(slice(0, 1), case.cu[n], case.cu[n + 1], slice(n, n + 1)) for n in range(case.N)]


def _zero_state(case: Case, rows: slice) -> torch.Tensor:
    return torch.zeros(rows.stop - rows.start, case.Hv, case.K, case.V, dtype=torch.float64)


@cache
def recurrence_chunk_states(case: Case) -> torch.Tensor:
    """Chunk-start states ``[B, NT, Hv, K, V]`` recorded by running the recurrence one
    chunk at a time (each run starting from the previous run's final state)."""
    x = make_inputs(case)
    states = []
    for rows, bos, eos, srows in _sequences(case):
        S = _zero_state(case, srows) if x.h0 is None else x.h0[srows]
        for s in range(bos, eos, C):
            states.append(S)
            e = min(s + C, eos)
            _, S = recurrent_gated_delta_rule(
                x.q[rows, s:e], x.k[rows, s:e], x.v[rows, s:e], x.g[rows, s:e],
                x.beta[rows, s:e], scale=case.resolved_scale, initial_state=S,
                output_final_state=True)
    return torch.stack(states, dim=1)


@dataclass(frozen=True)
class Reference:
    o: torch.Tensor
    final_state: torch.Tensor
    grads: dict[str, torch.Tensor | None]   # dq dk dv dbeta dg dh0


@cache
def recurrence_reference(case: Case) -> Reference:
    """fp64 recurrence output, final state, and autograd gradients through it."""
    x = make_inputs(case)
    named = {"q": x.q, "k": x.k, "v": x.v, "g": x.g, "beta": x.beta, "h0": x.h0}
    leaves = {name: t.clone().requires_grad_(True) for name, t in named.items() if t is not None}
    o, final_state = recurrent_gated_delta_rule(
        leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"],
        scale=case.scale, initial_state=leaves.get("h0"), cu_seqlens=x.cu,
        output_final_state=True)
    loss = (o * x.do).sum()
    if x.dht is not None:
        loss = loss + (final_state * x.dht).sum()
    loss.backward()
    grads = {f"d{name}": t.grad for name, t in leaves.items()}
    grads.setdefault("dh0", None)
    return Reference(o=o.detach(), final_state=final_state.detach(), grads=grads)


@cache
def chunked_forward(case: Case):
    x = make_inputs(case)
    return chunk_gated_delta_rule_fwd_torch(
        x.q, x.k, x.v, x.g, x.beta, scale=case.resolved_scale, initial_state=x.h0,
        cu_seqlens=x.cu, cu_seqlens_cpu=x.cu, output_final_state=True, output_h=True)


@cache
def chunked_backward(case: Case) -> dict[str, torch.Tensor | None]:
    x = make_inputs(case)
    g_cumsum, A, _, _, _ = chunked_forward(case)
    dq, dk, dv, dbeta, dg, dh0 = chunk_gated_delta_rule_bwd_torch(
        x.q, x.k, x.v, g_cumsum, x.beta, A, x.do, dht=x.dht, scale=case.resolved_scale,
        initial_state=x.h0, cu_seqlens=x.cu, cu_seqlens_cpu=x.cu)
    return {"dq": dq, "dk": dk, "dv": dv, "dbeta": dbeta, "dg": dg, "dh0": dh0}


def direct_inverse(case: Case) -> torch.Tensor:
    """Expected A ``[B, T, Hv, C]``: ``torch.linalg.inv(I + strictly_lower(diag(beta) K K^T))``
    per chunk and head (q/k head h // G), zero outside each chunk's valid columns."""
    x = make_inputs(case)
    k = x.k.repeat_interleave(case.Hv // case.Hk, dim=2)                # [B,T,Hv,K]
    A = torch.zeros(case.B, case.T, case.Hv, C, dtype=torch.float64)
    for rows, bos, eos, _ in _sequences(case):
        for s in range(bos, eos, C):
            e = min(s + C, eos)
            kc = k[rows, s:e].transpose(1, 2)                            # [Bs,Hv,c,K]
            bc = x.beta[rows, s:e].transpose(1, 2)                       # [Bs,Hv,c]
            M = torch.eye(e - s, dtype=torch.float64) + torch.tril(
                bc[..., None] * (kc @ kc.transpose(-1, -2)), diagonal=-1)
            A[rows, s:e, :, :e - s] = torch.linalg.inv(M).transpose(1, 2)
    return A


# --------------------------------------------------------------------------------------
# fp64: chunked forward and backward against the definition
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", _params(ALL_CASES))
def test_forward_output(case):
    _, _, o, _, _ = chunked_forward(case)
    assert rel_l2(o, recurrence_reference(case).o) < TOL_FP64


@pytest.mark.parametrize("case", _params(ALL_CASES))
def test_forward_final_state(case):
    _, _, _, _, final_state = chunked_forward(case)
    assert rel_l2(final_state, recurrence_reference(case).final_state) < TOL_FP64


@pytest.mark.parametrize("case", _params(ALL_CASES))
def test_forward_chunk_states(case):
    _, _, _, h, _ = chunked_forward(case)
    assert rel_l2(h, recurrence_chunk_states(case)) < TOL_FP64


@pytest.mark.parametrize("case", _params(ALL_CASES))
def test_forward_gate_cumsum(case):
    """g_cumsum restarts at every chunk and sequence start."""
    x = make_inputs(case)
    expected = torch.zeros_like(x.g)
    for rows, bos, eos, _ in _sequences(case):
        for s in range(bos, eos, C):
            expected[rows, s:min(s + C, eos)] = x.g[rows, s:min(s + C, eos)].cumsum(dim=1)
    g_cumsum, _, _, _, _ = chunked_forward(case)
    assert rel_l2(g_cumsum, expected) < TOL_FP64


@pytest.mark.parametrize("case", _params(ALL_CASES))
def test_forward_A_is_direct_inverse(case):
    _, A, _, _, _ = chunked_forward(case)
    assert rel_l2(A, direct_inverse(case)) < TOL_FP64


@pytest.mark.parametrize("grad", ["dq", "dk", "dv", "dbeta", "dg"])
@pytest.mark.parametrize("case", _params(ALL_CASES))
def test_backward_input_grads(case, grad):
    actual = chunked_backward(case)[grad]
    expected = recurrence_reference(case).grads[grad]
    assert rel_l2(actual, expected) < TOL_FP64


@pytest.mark.parametrize("case", _params([c for c in ALL_CASES if c.h0]))
def test_backward_dh0(case):
    dh0 = chunked_backward(case)["dh0"]
    assert rel_l2(dh0, recurrence_reference(case).grads["dh0"]) < TOL_FP64


@pytest.mark.parametrize("case", _params([c for c in ALL_CASES if not c.h0]))
def test_backward_dh0_none_without_initial_state(case):
    assert chunked_backward(case)["dh0"] is None


# --------------------------------------------------------------------------------------
# Padding tokens after cu_seqlens[-1]: exact zeros
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", _params(PADDED_CASES))
def test_padding_forward_exact_zero(case):
    g_cumsum, A, o, _, _ = chunked_forward(case)
    pad = slice(case.cu[-1], case.T)
    assert torch.count_nonzero(o[:, pad]) == 0
    assert torch.count_nonzero(A[:, pad]) == 0
    assert torch.count_nonzero(g_cumsum[:, pad]) == 0
    assert torch.count_nonzero(recurrence_reference(case).o[:, pad]) == 0


@pytest.mark.parametrize("grad", ["dq", "dk", "dv", "dbeta", "dg"])
@pytest.mark.parametrize("case", _params(PADDED_CASES))
def test_padding_grads_exact_zero(case, grad):
    pad = slice(case.cu[-1], case.T)
    assert torch.count_nonzero(chunked_backward(case)[grad][:, pad]) == 0


# --------------------------------------------------------------------------------------
# Shapes and dtypes of the contract
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", _params(ALL_CASES))
def test_forward_shapes(case):
    g_cumsum, A, o, h, final_state = chunked_forward(case)
    if case.cu is None:
        lengths = [case.T] * case.B
    else:
        lengths = [b - a for a, b in zip(case.cu, case.cu[1:])]
    nt = math.ceil(case.T / C) if case.cu is None else sum(math.ceil(n / C) for n in lengths)
    assert g_cumsum.shape == (case.B, case.T, case.Hv)
    assert A.shape == (case.B, case.T, case.Hv, C)
    assert o.shape == (case.B, case.T, case.Hv, case.V)
    assert h.shape == (case.B, nt, case.Hv, case.K, case.V)
    assert final_state.shape == (case.N, case.Hv, case.K, case.V)


# --------------------------------------------------------------------------------------
# bf16: the fp32-internal path lands near the fp64 definition
# --------------------------------------------------------------------------------------

BF16_CASES = [
    Case("bf16-B2-T200-Hk1-Hv2-K32-V32", B=2, T=200, Hv=2, K=32, V=32),
    Case("bf16-cu0-50-170-pad10-Hk2-Hv4", T=180, cu=(0, 50, 170), Hk=2, Hv=4, K=16, V=16),
]


@cache
def bf16_forward(case: Case):
    """bf16 q/k/v/beta, fp32 g and state: the chunked forward and the fp64 recurrence
    on the same (bf16-rounded) inputs."""
    x = make_inputs(case)
    q, k, v, beta = (t.to(torch.bfloat16) for t in (x.q, x.k, x.v, x.beta))
    g, h0 = x.g.float(), x.h0.float()
    out = chunk_gated_delta_rule_fwd_torch(
        q, k, v, g, beta, scale=case.resolved_scale, initial_state=h0, cu_seqlens=x.cu,
        cu_seqlens_cpu=x.cu, output_final_state=True, output_h=False)
    ref = recurrent_gated_delta_rule(
        q.double(), k.double(), v.double(), g.double(), beta.double(), scale=case.scale,
        initial_state=h0.double(), cu_seqlens=x.cu, output_final_state=True)
    return out, ref


@pytest.mark.parametrize("case", _params(BF16_CASES))
def test_bf16_forward_near_fp64(case):
    (_g_cumsum, _A, o, _h, final_state), (o_ref, final_ref) = bf16_forward(case)
    assert rel_l2(o, o_ref) < TOL_BF16
    assert rel_l2(final_state, final_ref) < TOL_BF16


@pytest.mark.parametrize("case", _params(BF16_CASES))
def test_bf16_forward_dtypes(case):
    (g_cumsum, A, o, h, final_state), _ = bf16_forward(case)
    assert (o.dtype, A.dtype) == (torch.bfloat16, torch.bfloat16)
    assert (g_cumsum.dtype, final_state.dtype) == (torch.float32, torch.float32)
    assert h is None


# --------------------------------------------------------------------------------------
# TORCH_KERNELS satisfies the Kernels protocol
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("method", ["fwd", "bwd"])
def test_torch_kernels_signature_matches_protocol(method):
    ours = inspect.signature(getattr(TORCH_KERNELS, method))
    protocol = inspect.signature(getattr(Kernels, method))
    names = [p.name for p in protocol.parameters.values() if p.name != "self"]
    kinds = [p.kind for p in protocol.parameters.values() if p.name != "self"]
    assert [p.name for p in ours.parameters.values()] == names
    assert [p.kind for p in ours.parameters.values()] == kinds


def test_torch_kernels_round_trip():
    """fwd then bwd through the protocol object, varlen with only the device cu_seqlens."""
    case = VARLEN_CASES[3]
    x = make_inputs(case)
    g_cumsum, A, o, h, final_state = TORCH_KERNELS.fwd(
        x.q, x.k, x.v, x.g, x.beta, scale=case.resolved_scale, initial_state=x.h0,
        cu_seqlens=x.cu, cu_seqlens_cpu=None, output_final_state=True, output_h=False)
    grads = TORCH_KERNELS.bwd(
        x.q, x.k, x.v, g_cumsum, x.beta, A, x.do, dht=x.dht, scale=case.resolved_scale,
        initial_state=x.h0, cu_seqlens=x.cu, cu_seqlens_cpu=None)
    ref = recurrence_reference(case)
    assert h is None
    assert rel_l2(o, ref.o) < TOL_FP64
    assert rel_l2(final_state, ref.final_state) < TOL_FP64
    assert rel_l2(grads[4], ref.grads["dg"]) < TOL_FP64
    assert rel_l2(grads[5], ref.grads["dh0"]) < TOL_FP64


# --------------------------------------------------------------------------------------
# The shared helper
# --------------------------------------------------------------------------------------

REL_L2_CASES = [
    pytest.param([3.0, 4.0], [3.0, 4.0], 0.0, id="equal"),
    pytest.param([3.0, 4.0], [0.0, 0.0], math.inf, id="zero-expected-nonzero-actual"),
    pytest.param([0.0, 0.0], [0.0, 0.0], 0.0, id="both-zero"),
    pytest.param([3.0, 5.0], [3.0, 4.0], 0.2, id="known-value"),
    pytest.param([float("nan"), 4.0], [3.0, 4.0], math.inf, id="nan-in-actual"),
    pytest.param([3.0, 4.0], [float("nan"), 4.0], math.inf, id="nan-in-expected"),
    pytest.param([float("inf"), 4.0], [3.0, 4.0], math.inf, id="inf-in-actual"),
    pytest.param([], [], 0.0, id="empty"),
]


@pytest.mark.parametrize("actual,expected,value", REL_L2_CASES)
def test_rel_l2_values(actual, expected, value):
    result = rel_l2(torch.tensor(actual, dtype=torch.float64),
                    torch.tensor(expected, dtype=torch.float64))
    assert isinstance(result, float)
    assert result == pytest.approx(value, abs=1e-15)


def test_rel_l2_mixed_dtypes():
    expected = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    assert rel_l2(expected.to(torch.bfloat16), expected) == 0.0


def test_rel_l2_rejects_shape_mismatch():
    with pytest.raises(ValueError, match="shape mismatch"):
        rel_l2(torch.zeros(2, 3), torch.zeros(3, 2))
