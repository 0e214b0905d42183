"""Chunk-parallel backward vs the chunk-serial reference backward (fp64, CPU).

Same cases as ``test_reference.py``: dense and varlen (empty, length-1, odd, padded),
GVA, zero / typical / strong gates, with and without initial state and dht.
"""

from __future__ import annotations

import pytest
import torch

from flash_qla.chunk_parallel import chunk_gated_delta_rule_bwd_parallel
from tests.core.test_reference import (
    ALL_CASES,
    _params,
    chunked_backward,
    chunked_forward,
    make_inputs,
)
from tests.helpers import rel_l2

GRADS = ("dq", "dk", "dv", "dbeta", "dg", "dh0")


def parallel_backward(case) -> dict:
    x = make_inputs(case)
    g_cumsum, A, _, h, _ = chunked_forward(case)
    grads = chunk_gated_delta_rule_bwd_parallel(
        x.q, x.k, x.v, g_cumsum, x.beta, A, x.do, h, dht=x.dht, scale=case.resolved_scale,
        initial_state=x.h0, cu_seqlens=x.cu, cu_seqlens_cpu=x.cu)
    return dict(zip(GRADS, grads))


@pytest.mark.parametrize("case", _params(ALL_CASES))
def test_matches_the_chunk_serial_backward(case):
    ours, ref = parallel_backward(case), chunked_backward(case)
    for name in GRADS:
        if ref[name] is None:
            assert ours[name] is None, name
        else:
            assert ours[name].dtype == ref[name].dtype, name
            assert rel_l2(ours[name], ref[name]) < 1e-12, name


@pytest.mark.parametrize("case", _params([c for c in ALL_CASES if c.n_padding]))
def test_padding_gradients_are_exact_zeros(case):
    grads = parallel_backward(case)
    pad = slice(case.cu[-1], case.T)
    for name in ("dq", "dk", "dv", "dbeta", "dg"):
        assert torch.count_nonzero(grads[name][:, pad]) == 0, name


@pytest.mark.parametrize("case", _params(ALL_CASES[::3]))
def test_precomputed_state_gradients_replace_the_sweep(case, monkeypatch):
    """A kernel's dS1/dh0 (here: the sweep's own, recorded) are used as given."""
    from flash_qla import chunk_parallel

    recorded = {}
    sweep = chunk_parallel._reverse_sweep

    def record(*args):
        recorded["dS1"], recorded["dh0"] = sweep(*args)
        return recorded["dS1"], recorded["dh0"]

    monkeypatch.setattr(chunk_parallel, "_reverse_sweep", record)
    first = parallel_backward(case)

    def refuse(*args):
        raise AssertionError("the sweep ran although dS1/dh0 were given")

    monkeypatch.setattr(chunk_parallel, "_reverse_sweep", refuse)
    x = make_inputs(case)
    g_cumsum, A, _, h, _ = chunked_forward(case)
    again = chunk_gated_delta_rule_bwd_parallel(
        x.q, x.k, x.v, g_cumsum, x.beta, A, x.do, h, dht=x.dht, scale=case.resolved_scale,
        initial_state=x.h0, cu_seqlens=x.cu, cu_seqlens_cpu=x.cu, **recorded)
    for name, value in zip(GRADS, again):
        if first[name] is None:
            assert value is None
        else:
            assert torch.equal(value, first[name]), name


def test_a_batch_without_tokens():
    """cu_seqlens = [0, 0]: no chunk at all; zero gradients, dh0 = dht."""
    gen = torch.Generator().manual_seed(3)
    q, k = torch.randn(2, 1, 5, 1, 8, generator=gen, dtype=torch.float64)
    v, do = torch.randn(2, 1, 5, 2, 8, generator=gen, dtype=torch.float64)
    g, beta = torch.zeros(1, 5, 2, dtype=torch.float64), torch.rand(1, 5, 2, dtype=torch.float64)
    A = torch.zeros(1, 5, 2, 64, dtype=torch.float64)
    h0, dht = torch.randn(2, 1, 2, 8, 8, generator=gen, dtype=torch.float64)
    cu = torch.tensor([0, 0])
    dq, dk, dv, dbeta, dg, dh0 = chunk_gated_delta_rule_bwd_parallel(
        q, k, v, g, beta, A, do, torch.zeros(0, 2, 8, 8, dtype=torch.float64), dht=dht,
        scale=0.3, initial_state=h0, cu_seqlens=cu, cu_seqlens_cpu=cu)
    for grad in (dq, dk, dv, dbeta, dg):
        assert torch.count_nonzero(grad) == 0
    assert torch.equal(dh0, dht)
