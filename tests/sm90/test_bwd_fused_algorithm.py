"""The chunk_bwd_fused kernel's algorithm in fp64 PyTorch (CPU), in its order of
operations: one emulated CTA per (sequence, value head) walks the chunks from the last
to the first with dS in fp32, every per-chunk gradient from the same tiles, the row
factors moved onto products as the kernel does (``<Q, (scale E dO) S0^T>`` for the
``<dO, Q S0>`` term, ``D <K, U dS1^T>`` for dD, ``dP * Ps`` for dGG's ``dP * G * Q
K^T``) and ``<S0, dS1>`` from S0's tile and the fp32 state gradient. Compared with the
chunk-parallel backward (exact math, 1e-10) and, with every shared-memory operand
rounded to bf16, within half the GPU tests' tolerances. The kernel itself is checked on the GPU
(test_bwd_fused_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from flash_qla.chunk_parallel import chunk_gated_delta_rule_bwd_parallel
from tests.helpers import rel_l2
from tests.sm90.test_bwd_intra_algorithm import (
    GPU_TOL,
    LOG2E,
    PROBLEMS,
    TOL,
    C,
    _bf16,
    _rows,
    make_problem,
)


def emulate_chunk(x, S0, dS, scale, t0, rows, h, hk, rnd):
    """One chunk of the walk: returns ``(dq, dk, dv, dbeta, dg)`` for its ``rows`` rows
    and the chunk-start state gradient (fp32 in the kernel: not rounded)."""
    i = torch.arange(C)
    # load role: tiles (rows past the end zeroed), gates
    valid = (i < rows)[:, None]
    q_c = torch.where(valid, _rows(x["q"][:, hk], t0), 0.0)
    k_c = torch.where(valid, _rows(x["k"][:, hk], t0), 0.0)
    v_c = torch.where(valid, _rows(x["v"][:, h], t0), 0.0)
    do_c = torch.where(valid, _rows(x["do"][:, h], t0), 0.0)
    a_c = torch.where(valid, _rows(x["A"][:, h], t0), 0.0)
    gam = x["g_cumsum"][t0 + torch.clamp(i, max=rows - 1), h] * LOG2E
    eg, ed = torch.exp2(gam), torch.exp2(gam[C - 1] - gam)
    b = torch.where(i < rows, _rows(x["beta"][:, h], t0), 0.0)
    s0_s, ds1_s = rnd(S0), rnd(dS)                              # state role: dS1 tile
    ss = (s0_s * dS).sum(dim=1)               # state role: its fp32 dS1 against S0's tile
    # chain: Ps, G, Ag
    live = (i[:, None] >= i[None, :]) & (i[:, None] < rows)
    decay = torch.where(live, torch.exp2(torch.clamp(gam[:, None] - gam[None, :], max=0.0)),
                        0.0)
    ps = rnd(q_c @ k_c.T * decay * scale)
    g_s = rnd(decay)
    ag = rnd(a_c * decay * b[None, :])
    # intra: X, U
    ks0 = k_c @ s0_s
    x_s = rnd(v_c - eg[:, None] * ks0)
    u_s = rnd(ag @ x_s)
    # chain: dU, dX = dv, -E dX
    du_s = rnd((k_c @ ds1_s) * ed[:, None] + ps.T @ do_c)
    dx = ag.T @ du_s
    edx_s = rnd(-eg[:, None] * dx)
    # intra: dAg (M, dbeta's first term, M * A), dP (dP * G, dGG), <-E dX, K S0>
    dagg = (du_s @ x_s.T) * g_s
    m_s = rnd(dagg * b[None, :])
    vec2 = (dagg * a_c).sum(dim=0)
    dp = do_c @ u_s.T
    dgg = dagg * a_c * b[None, :] + dp * ps
    dpg = rnd(dp * scale * g_s)
    vec4, vec6 = dgg.sum(dim=1), dgg.sum(dim=0)
    vec3 = (edx_s * ks0).sum(dim=1)
    sedo = rnd(do_c * (scale * eg)[:, None])
    # intra: dq and <Q, (scale E dO) S0^T>
    dq1 = sedo @ s0_s.T
    vec0 = (dq1 * q_c).sum(dim=1)
    dq = dq1 + dpg @ k_c
    # chain: dN, dk and dD
    atm = rnd(a_c.T @ m_s)
    strict = (i[:, None] > i[None, :]) & (i[:, None] < rows)
    dn = torch.where(strict, -(atm @ a_c.T), 0.0)
    bdn = rnd(dn * b[:, None])
    vec5 = (dn * (k_c @ k_c.T)).sum(dim=1)
    dk1 = u_s @ ds1_s.T
    vec1 = torch.where(i < rows, (dk1 * k_c).sum(dim=1) * ed, 0.0)
    dk = dk1 * ed[:, None] + dpg.T @ q_c + edx_s @ s0_s.T + bdn @ k_c + bdn.T @ k_c
    # intra: dbeta, dg
    dbeta = vec2 + vec5
    dgam = torch.where(i < rows, vec4 - vec6 + vec0 + vec3 - vec1, 0.0)
    last = vec1.sum() + torch.exp2(gam[C - 1]) * ss.sum()
    dg = torch.flip(torch.cumsum(torch.flip(dgam, (0,)), 0), (0,)) + last
    # state: the chunk-start gradient
    dS0 = torch.exp2(gam[C - 1]) * dS + q_c.T @ sedo + k_c.T @ edx_s
    return (dq[:rows], dk[:rows], dx[:rows], dbeta[:rows], dg[:rows]), dS0


def emulate_chunk_bwd_fused(x, dht, scale, rnd=lambda t: t):
    """The whole kernel on a packed problem (``make_problem``): per-value-head ``dq, dk
    [Tt, Hv, K]``, ``dv [Tt, Hv, V]``, ``dbeta, dg [Tt, Hv]`` and ``dh0 [N, Hv, K, V]``."""
    q, v, bounds = x["q"], x["v"], x["bounds"]
    Tt, Hk, K = q.shape
    Hv, V = v.shape[1:]
    out = [q.new_zeros(Tt, Hv, K), q.new_zeros(Tt, Hv, K), q.new_zeros(Tt, Hv, V),
           q.new_zeros(Tt, Hv), q.new_zeros(Tt, Hv)]
    dh0 = q.new_zeros(len(bounds) - 1, Hv, K, V)
    first = 0
    for n in range(len(bounds) - 1):
        bos, seq_len = bounds[n], bounds[n + 1] - bounds[n]
        chunks = -(-seq_len // C)
        for hh in range(Hv):
            dS = dht[n, hh].clone() if dht is not None else q.new_zeros(K, V)
            for c in reversed(range(chunks)):
                t0, rows = bos + c * C, min(seq_len - c * C, C)
                grads, dS = emulate_chunk(x, x["h"][first + c, hh], dS, scale, t0, rows, hh,
                                          hh // (Hv // Hk), rnd)
                for dst, val in zip(out, grads):
                    dst[t0:t0 + rows, hh] = val
            dh0[n, hh] = dS
        first += chunks
    return (*out, dh0)


def _reference(x, dht, scale):
    bounds = x["bounds"]
    cu = torch.tensor(bounds, dtype=torch.int32)
    g_cumsum = x["g_cumsum"].clone()
    g_cumsum[bounds[-1]:] = 0.0
    return chunk_gated_delta_rule_bwd_parallel(
        x["q"][None], x["k"][None], x["v"][None], g_cumsum[None], x["beta"][None],
        x["A"][None], x["do"][None], x["h"], dht=dht, scale=scale,
        initial_state=torch.zeros_like(x["h"][:len(bounds) - 1]), cu_seqlens=cu,
        cu_seqlens_cpu=cu)


def _ours(x, dht, scale, rnd=lambda t: t):
    Tt, Hk, K = x["q"].shape
    Hv = x["v"].shape[1]
    dq, dk, dv, dbeta, dg, dh0 = emulate_chunk_bwd_fused(x, dht, scale, rnd)
    G = Hv // Hk
    return dq.view(Tt, Hk, G, K).sum(2), dk.view(Tt, Hk, G, K).sum(2), dv, dbeta, dg, dh0


NAMES = ("dq", "dk", "dv", "dbeta", "dg", "dh0")


@pytest.mark.parametrize("name", list(PROBLEMS))
def test_fused_algorithm_matches_chunk_parallel_backward(name):
    x = make_problem(**PROBLEMS[name], seed=len(name) + 1)
    dht = torch.randn(len(x["bounds"]) - 1, *x["h"].shape[1:], dtype=torch.float64)
    ours = _ours(x, dht, 0.3)
    ref = _reference(x, dht, 0.3)
    for nm, a, b in zip(NAMES, ours, (*[r[0] for r in ref[:5]], ref[5])):
        assert rel_l2(a, b) < TOL, nm


@pytest.mark.parametrize("name", ["tails-next-seq", "strong-gates", "zero-gates"])
def test_fused_bf16_operands_within_half_the_gpu_tolerance(name):
    """Every shared-memory operand (and the state tiles) rounded to bf16, dS in fp32:
    within half the GPU tests' tolerances of the exact algorithm (inputs bf16 too)."""
    x = make_problem(**PROBLEMS[name], seed=5)
    for key in ("q", "k", "v", "do", "A"):
        x[key] = _bf16(x[key])
    x["h"] = 0.1 * x["h"]
    dht = torch.randn(len(x["bounds"]) - 1, *x["h"].shape[1:], dtype=torch.float64)
    exact = _ours(x, dht, 128 ** -0.5)
    rounded = _ours(x, dht, 128 ** -0.5, _bf16)
    tol = {**GPU_TOL, "dh0": 1e-2}
    for nm, a, b in zip(NAMES, rounded, exact):
        assert rel_l2(a, b) < tol[nm] / 2, (nm, rel_l2(a, b))
