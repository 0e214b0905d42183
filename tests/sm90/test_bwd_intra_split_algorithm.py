"""The sub-chunk gradient kernel's algorithm (``chunk_input_grads_split``: SM120's
backward), step by step in fp64 PyTorch (CPU).

One emulated CTA per (32-token sub-chunk, value head), in the kernel's order: the
sub-chunk's tiles loaded whole (rows past the end zeroed), its gates rebased to its own
start (``g_cumsum`` minus its value at the token before, inside the 64-token chunk), its
inverse read as the diagonal block of the chunk's A, S0 / dS1 / v / dO taken in
``PARTS`` column blocks over V (the kernel's four; two checked as well) with every
product over V accumulated across them (dg's terms linear in V as element products,
reduced once after the blocks), the column sums as row sums of transposed products, and
dg as one masked row reduction with the ``<S0, dS1>`` row sums folded onto the
sub-chunk's rows.

Checked against the reference's per-chunk backward on the sub-chunk (random S0, dS1),
and over whole problems against the reference's 64-token backward
(``chunk_gated_delta_rule_bwd_torch``), with S0 and dS1 at every sub-chunk boundary from
fp64 sweeps: the sub-chunk decomposition of SM120 computes the same gradients. The kernel
itself runs on the GPU under ``FLASH_QLA_PROOF_ARCH=sm120`` (test_backward_gpu.py).
"""

from __future__ import annotations

import math

import pytest
import torch

from flash_qla.reference import (
    _chunk_backward,
    _chunk_forward,
    _chunk_next_state,
    chunk_gated_delta_rule_bwd_torch,
)
from tests.helpers import rel_l2
from tests.sm90.test_bwd_intra_algorithm import PROBLEMS, make_problem

C, SC = 64, 32
PARTS = 4          # the kernel's column blocks over V (STATE_BLOCKS)
LOG2E = math.log2(math.e)
TOL = 1e-10


def _rows(x: torch.Tensor, t0: int) -> torch.Tensor:
    """SC rows from t0 of a packed tensor, zero past its end (the guarded loads)."""
    out = x.new_zeros(SC, *x.shape[1:])
    part = x[t0:t0 + SC]
    out[:part.shape[0]] = part
    return out


def _zero_past(x: torch.Tensor, rows: int) -> torch.Tensor:
    x = x.clone()
    x[rows:] = 0.0
    return x


def emulate_sub_cta(q, k, v, do, g_cumsum, beta, A, S0, dS1, scale, t0, part, rows, h, hk,
                    parts=PARTS):
    """One CTA: sub-chunk ``part`` (0 or 1) of its chunk, first token t0, ``rows`` valid
    rows, value head h, the state pair in ``parts`` column blocks. Returns (dq, dk
    ``[rows, K]``, dv ``[rows, V]``, dbeta, dg ``[rows]``)."""
    K, V = q.shape[-1], v.shape[-1]
    BV = V // parts
    i = torch.arange(SC)
    q_c = _zero_past(_rows(q[:, hk], t0), rows)
    k_c = _zero_past(_rows(k[:, hk], t0), rows)
    a_c = _zero_past(_rows(A[:, h, part * SC:(part + 1) * SC], t0), rows)   # diagonal block
    base = g_cumsum[t0 - 1, h] if part else 0.0
    gam = (g_cumsum[t0 + torch.clamp(i, max=rows - 1), h] - base) * LOG2E   # rebased, log2
    b = torch.where(i < rows, _rows(beta[:, h], t0), 0.0)
    live = (i[:, None] >= i[None, :]) & (i[:, None] < rows)
    decay = torch.exp2(torch.clamp(gam[:, None] - gam[None, :], max=0.0))
    G = torch.where(live, decay, 0.0)
    P = torch.where(live, (q_c @ k_c.T) * decay, 0.0)
    Ag = torch.where(live, a_c * decay * b[None, :], 0.0)
    E, D = torch.exp2(gam)[:, None], torch.exp2(gam[-1] - gam)[:, None]

    dag, dag_t, dp, dp_t = (torch.zeros(SC, SC, dtype=q.dtype) for _ in range(4))
    dq, dk = torch.zeros(SC, K, dtype=q.dtype), torch.zeros(SC, K, dtype=q.dtype)
    dv = torch.zeros(SC, V, dtype=q.dtype)
    acc_g = torch.zeros(SC, V // parts, dtype=q.dtype)   # dgam's terms linear in V
    acc_d = torch.zeros_like(acc_g)                      # D K dS1 * U
    ss = []
    for blk in range(parts):
        cols = slice(blk * BV, (blk + 1) * BV)
        s0, ds1 = S0[:, cols], dS1[:, cols]
        v_h = _zero_past(_rows(v[:, h, cols], t0), rows)
        do_h = _zero_past(_rows(do[:, h, cols], t0), rows)
        ks0 = k_c @ s0
        acc_g = acc_g + (q_c @ s0) * do_h * (scale * E)
        x = v_h - E * ks0
        u = Ag @ x
        kds = D * (k_c @ ds1)
        du = scale * P.T @ do_h + kds
        acc_d = acc_d + kds * u
        dag, dag_t = dag + du @ x.T, dag_t + x @ du.T
        dx = Ag.T @ du
        dv[:, cols] = dx
        ndx = -E * dx
        acc_g = acc_g + ndx * ks0
        dp, dp_t = dp + do_h @ u.T, dp_t + u @ do_h.T
        dq = dq + (scale * E * do_h) @ s0.T
        dk = dk + (D * u) @ ds1.T + ndx @ s0.T
        ss.append((s0 * ds1).sum(dim=1))

    c_dba = (dag_t * G.T * a_c.T).sum(dim=1)                         # dbeta, 1st
    c_dgg = (dp_t * scale * P.T).sum(dim=1) + b * c_dba              # dGG's columns
    dagg = dag * G
    M = dagg * b[None, :]
    r_dgg = (dagg * a_c * b[None, :] + dp * scale * P).sum(dim=1)    # dGG's rows
    dpg = dp * scale * G
    strict = (i[:, None] > i[None, :]) & (i[:, None] < rows)
    dn = torch.where(strict, -((a_c.T @ M) @ a_c.T), 0.0)
    bdn = dn * b[:, None]
    r_dn = (dn * (k_c @ k_c.T)).sum(dim=1)                           # dbeta, 2nd
    dq = dq + dpg @ k_c
    dk = dk + dpg.T @ q_c + bdn @ k_c + bdn.T @ k_c

    ddv = torch.where(i < rows, acc_d.sum(dim=1), 0.0)
    dgam = torch.where(i < rows, r_dgg - c_dgg + acc_g.sum(dim=1) - ddv, 0.0)
    ss_rows = sum(ss).reshape(K // SC, SC).sum(dim=0)
    terms = (torch.where(i[None, :] >= i[:, None], dgam[None, :], 0.0) + ddv[None, :]
             + torch.exp2(gam[-1]) * ss_rows[None, :])
    dg = terms.sum(dim=1)
    return dq[:rows], dk[:rows], dv[:rows], (c_dba + r_dn)[:rows], dg[:rows]


def _sub_chunks(bounds):
    """(sequence, t0, part, rows) of every non-empty sub-chunk, in state-row order."""
    out = []
    for n in range(len(bounds) - 1):
        bos, eos = bounds[n], bounds[n + 1]
        for s in range(bos, eos, C):
            for part in range(C // SC):
                t0 = s + part * SC
                if t0 < eos:
                    out.append((n, t0, part, min(eos - t0, SC)))
    return out


def _reference_sub_chunk(x, S0, dS1, scale, t0, part, rows, hh, hk):
    """The reference's backward of the sub-chunk as a chunk of its own."""
    e = t0 + rows
    base = x["g_cumsum"][t0 - 1, hh] if part else 0.0
    qc, kc = x["q"][t0:e, hk][None, None], x["k"][t0:e, hk][None, None]
    vc, doc = x["v"][t0:e, hh][None, None], x["do"][t0:e, hh][None, None]
    bc = x["beta"][t0:e, hh][None, None]
    gc = (x["g_cumsum"][t0:e, hh] - base)[None, None]
    Ac = x["A"][t0:e, hh, part * SC:part * SC + rows][None, None]
    f = _chunk_forward(qc, kc, vc, bc, gc, Ac, S0[None, None])
    return f, _chunk_backward(qc, kc, bc, Ac, S0[None, None], f, doc, dS1[None, None], scale)


@pytest.mark.parametrize("parts", [PARTS, 2])
@pytest.mark.parametrize("name", list(PROBLEMS))
def test_sub_chunk_cta_matches_reference_chunk_backward(name, parts):
    """Each emulated CTA against the reference backward of its sub-chunk (random S0,
    dS1): tails into the next sequence, padding, strong / zero gates, extreme beta."""
    x = make_problem(**PROBLEMS[name], seed=len(name) + 1)
    gen = torch.Generator().manual_seed(11)
    K, V = x["q"].shape[-1], x["v"].shape[-1]
    Hk, Hv = x["q"].shape[1], x["v"].shape[1]
    scale = 128 ** -0.5
    for n, t0, part, rows in _sub_chunks(x["bounds"]):
        for hh in range(Hv):
            hk = hh // (Hv // Hk)
            S0 = torch.randn(K, V, generator=gen, dtype=torch.float64)
            dS1 = torch.randn(K, V, generator=gen, dtype=torch.float64)
            ours = emulate_sub_cta(x["q"], x["k"], x["v"], x["do"], x["g_cumsum"],
                                   x["beta"], x["A"], S0, dS1, scale, t0, part, rows, hh, hk,
                                   parts)
            _, ref = _reference_sub_chunk(x, S0, dS1, scale, t0, part, rows, hh, hk)
            for nm, a, b in zip(("dq", "dk", "dv", "dbeta", "dg"), ours,
                                (ref.dq, ref.dk, ref.dv, ref.dbeta, ref.dg)):
                err = rel_l2(a, b[0, 0])
                assert err < TOL, (nm, n, t0, hh, err)


def _sub_chunk_states(x, h0, dht, scale):
    """fp64 S0 and dS1 at every sub-chunk, ``[rows, Hv, K, V]`` in the order of
    :func:`_sub_chunks` (the rows the forward and the sweep store on SM120), from a
    forward and a reverse sweep over the sub-chunks."""
    subs = _sub_chunks(x["bounds"])
    Hk, Hv = x["q"].shape[1], x["v"].shape[1]
    K, V = x["q"].shape[-1], x["v"].shape[-1]
    S0 = torch.zeros(len(subs), Hv, K, V, dtype=torch.float64)
    dS1 = torch.zeros_like(S0)
    for hh in range(Hv):
        hk = hh // (Hv // Hk)
        for n in range(len(x["bounds"]) - 1):
            mine = [r for r, sub in enumerate(subs) if sub[0] == n]
            S = h0[n, hh]
            for r in mine:
                _, t0, part, rows = subs[r]
                S0[r, hh] = S
                f, _ = _reference_sub_chunk(x, S, torch.zeros_like(S), scale, t0, part, rows,
                                            hh, hk)
                S = _chunk_next_state(x["k"][t0:t0 + rows, hk][None, None], f, S[None, None])[0, 0]
            dS = dht[n, hh]
            for r in reversed(mine):
                _, t0, part, rows = subs[r]
                dS1[r, hh] = dS
                _, grads = _reference_sub_chunk(x, S0[r, hh], dS, scale, t0, part, rows, hh, hk)
                dS = grads.dS0[0, 0]
    return S0, dS1


@pytest.mark.parametrize("name", ["tails-next-seq", "strong-gates", "tail-at-end-pad"])
def test_sub_chunk_kernel_matches_64_token_backward(name):
    """The whole kernel (every sub-chunk CTA, GVA sum) given the sub-chunk states equals
    the reference's 64-token chunked backward of the same problem."""
    x = make_problem(**PROBLEMS[name], seed=5)
    gen = torch.Generator().manual_seed(2)
    bounds = x["bounds"]
    Tt, Hk, K = x["q"].shape
    Hv, V = x["v"].shape[1:]
    N = len(bounds) - 1
    scale = 0.3
    h0 = 0.5 * torch.randn(N, Hv, K, V, generator=gen, dtype=torch.float64)
    dht = torch.randn(N, Hv, K, V, generator=gen, dtype=torch.float64)
    g_cumsum = x["g_cumsum"].clone()
    g_cumsum[bounds[-1]:] = 0.0
    x["g_cumsum"] = g_cumsum
    S0, dS1 = _sub_chunk_states(x, h0, dht, scale)
    f64 = dict(dtype=torch.float64)
    dq, dk = torch.zeros(Tt, Hv, K, **f64), torch.zeros(Tt, Hv, K, **f64)
    dv = torch.zeros(Tt, Hv, V, **f64)
    dbeta, dg = torch.zeros(Tt, Hv, **f64), torch.zeros(Tt, Hv, **f64)
    for r, (_, t0, part, rows) in enumerate(_sub_chunks(bounds)):
        for hh in range(Hv):
            out = emulate_sub_cta(x["q"], x["k"], x["v"], x["do"], g_cumsum, x["beta"],
                                  x["A"], S0[r, hh], dS1[r, hh], scale, t0, part, rows, hh,
                                  hh // (Hv // Hk))
            for dst, val in zip((dq, dk, dv, dbeta, dg), out):
                dst[t0:t0 + rows, hh] = val
    G = Hv // Hk
    ours = (dq.view(Tt, Hk, G, K).sum(2), dk.view(Tt, Hk, G, K).sum(2), dv, dbeta, dg)
    cu = torch.tensor(bounds, dtype=torch.int32)
    ref = chunk_gated_delta_rule_bwd_torch(
        x["q"][None], x["k"][None], x["v"][None], g_cumsum[None], x["beta"][None],
        x["A"][None], x["do"][None], dht=dht, scale=scale, initial_state=h0, cu_seqlens=cu,
        cu_seqlens_cpu=cu)
    for nm, a, b in zip(("dq", "dk", "dv", "dbeta", "dg"), ours, ref[:5]):
        assert rel_l2(a, b[0]) < TOL, (nm, rel_l2(a, b[0]))
