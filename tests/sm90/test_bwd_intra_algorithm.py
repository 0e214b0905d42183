"""The chunk_bwd_intra kernel's algorithm, step by step in fp64 PyTorch (CPU).

One emulated CTA per (chunk, value head), in the kernel's order of operations: it loads
whole 64-row tiles (a tail chunk sees the next sequence's rows, or zeros past the end
of the tensor), clamps the gate to the chunk's last valid row, works with log2-scaled
gates and ``exp2``, masks the [C, C] factors to ``j <= i < rows``, folds the
``<S0, dS1>`` row sums onto C rows and builds dg as one masked [C, C] row reduction.
It is compared with the reference's per-chunk backward (``_chunk_forward`` +
``_chunk_backward`` on the valid rows only) and, over whole problems, with
``chunk_gated_delta_rule_bwd_parallel``. The kernel itself is checked against the
latter on the GPU (test_backward_gpu.py).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from flash_qla.chunk_parallel import chunk_gated_delta_rule_bwd_parallel
from flash_qla.reference import _chunk_backward, _chunk_forward, _gate_free_inverse
from tests.helpers import rel_l2

C = 64
LOG2E = math.log2(math.e)
TOL = 1e-10


def _rows(x: torch.Tensor, t0: int) -> torch.Tensor:
    """C rows from t0 of a packed tensor, zero past its end (the kernel's guarded loads)."""
    out = x.new_zeros(C, *x.shape[1:])
    part = x[t0:t0 + C]
    out[:part.shape[0]] = part
    return out


def exp2(x: torch.Tensor) -> torch.Tensor:
    return torch.exp2(x)


def emulate_cta(q, k, v, do, g_cumsum, beta, A, S0, dS1, scale, t0, rows, h, hk,
                rnd=lambda t: t, column_sums="reduce"):
    """One CTA: the chunk starting at token t0 with ``rows`` valid rows, value head h.

    Packed inputs (``[Tt, H, D]``), S0 / dS1 ``[K, V]``. Returns the kernel's stores
    (dq, dk ``[rows, K]``; dv ``[rows, V]``; dbeta, dg ``[rows]``). ``rnd`` is applied
    wherever the kernel stores a GEMM operand in shared memory (its q/k/v dtype), so a
    bf16 ``rnd`` models the kernel's operand rounding; the identity gives exact math.
    ``column_sums`` as ``flash_qla_tl.arch.Arch.column_sums``: "transposed" forms dbeta's
    and dGG's column sums as row sums of the transposed products (mma.sync arches).
    """
    K = q.shape[-1]
    i = torch.arange(C)
    q_c, k_c = _rows(q[:, hk], t0), _rows(k[:, hk], t0)                  # [C,K]
    x_c, do_c = _rows(v[:, h], t0), _rows(do[:, h], t0)                  # [C,V]
    a_c = _rows(A[:, h], t0)                                             # [C,C]
    gam = g_cumsum[t0 + torch.clamp(i, max=rows - 1), h] * LOG2E         # [C] log2-scaled
    b = torch.where(i < rows, _rows(beta[:, h], t0), 0.0)                # [C]
    ss = (S0 * dS1).sum(dim=1)                                           # [K]
    s0_s, ds1_s = rnd(S0), rnd(dS1)                                      # operands

    # forward recompute
    qk = q_c @ k_c.T                                                     # [C,C]
    live = (i[:, None] >= i[None, :]) & (i[:, None] < rows)              # [C,C]
    decay = exp2(torch.clamp(gam[:, None] - gam[None, :], max=0.0))      # [C,C]
    p = rnd(torch.where(live, qk * decay, 0.0))
    ag = rnd(torch.where(live, a_c * decay * b[None, :], 0.0))
    g_s = rnd(torch.where(live, decay, 0.0))             # G, masked, in dP * G's slot
    ks0 = k_c @ s0_s                                                     # [C,V]
    x_c = rnd(x_c - exp2(gam)[:, None] * ks0)                            # X
    vec0 = ((q_c @ s0_s) * do_c).sum(dim=1) * scale * exp2(gam)          # [C]
    u = ag @ x_c                                                         # [C,V]
    u_s = rnd(u)

    # dU, dD
    ptdo = p.T @ do_c
    kds = exp2(gam[C - 1] - gam)[:, None] * (k_c @ ds1_s)                # D K dS1
    du = rnd(ptdo * scale + kds)
    vec1 = torch.where(i < rows, (kds * u).sum(dim=1), 0.0)              # dD

    # dAg
    dagg = (du @ x_c.T) * g_s                                            # dAg * G
    m = rnd(dagg * b[None, :])
    if column_sums == "transposed":          # dAg^T = X dU^T; G, A read transposed
        vec2 = ((x_c @ du.T) * g_s.T * a_c.T).sum(dim=1)
    else:
        vec2 = (dagg * a_c).sum(dim=0)                                   # dbeta, 1st
    dgg = dagg * a_c * b[None, :]

    # dX
    dx = ag.T @ du                                                       # [C,V]
    edx = -exp2(gam)[:, None] * dx
    vec3 = (edx * ks0).sum(dim=1)
    edx = rnd(edx)

    # dP
    dpg = (do_c @ u_s.T) * scale * g_s                                   # dP * G
    dgg = dgg + dpg * qk
    dpg = rnd(dpg)
    vec4, vec6 = dgg.sum(dim=1), dgg.sum(dim=0)
    if column_sums == "transposed":          # dP^T = U dO^T times P^T, + beta_j dbeta_j
        vec6 = ((u_s @ do_c.T) * scale * p.T).sum(dim=1) + b * vec2

    # dN
    t1 = rnd(a_c.T @ m)
    strict = (i[:, None] > i[None, :]) & (i[:, None] < rows)
    dn = torch.where(strict, -(t1 @ a_c.T), 0.0)
    bdn = rnd(dn * b[:, None])
    vec5 = (dn * (k_c @ k_c.T)).sum(dim=1)                               # dbeta, 2nd

    dq = (do_c @ s0_s.T) * scale * exp2(gam)[:, None] + dpg @ k_c        # [C,K]
    dk = ((u_s @ ds1_s.T) * exp2(gam[C - 1] - gam)[:, None] + dpg.T @ q_c
          + edx @ s0_s.T + bdn @ k_c + bdn.T @ k_c)                      # [C,K]

    dbeta = vec2 + vec5
    dgam = torch.where(i < rows, vec4 - vec6 + vec0 + vec3 - vec1, 0.0)
    ss_rows = ss.reshape(K // C, C).sum(dim=0)                           # K = 2C in the kernel
    terms = (torch.where(i[None, :] >= i[:, None], dgam[None, :], 0.0)
             + vec1[None, :] + exp2(gam[C - 1]) * ss_rows[None, :])      # [C,C] (i, m)
    dg = terms.sum(dim=1)
    return dq[:rows], dk[:rows], dx[:rows], dbeta[:rows], dg[:rows]


def reverse_sweep(q, k, do, g_cumsum, beta, A, dht, scale, bounds):
    """``(dS1 [NT,Hv,K,V], dh0 [N,Hv,K,V])``: the reverse state-gradient sweep in fp64
    (gdn-math.md, "Backward of one chunk"), one (sequence, value head) at a time, as
    realistic state gradients for the per-chunk algorithm."""
    Hk, Hv = q.shape[1], do.shape[1]
    K, V = q.shape[-1], do.shape[-1]
    N = len(bounds) - 1
    counts = [-(-(bounds[n + 1] - bounds[n]) // C) for n in range(N)]
    offsets = [sum(counts[:n]) for n in range(N + 1)]
    dS1 = q.new_zeros(offsets[-1], Hv, K, V)
    dh0 = q.new_zeros(N, Hv, K, V)
    i = torch.arange(C)
    for n in range(N):
        bos, seq_len = bounds[n], bounds[n + 1] - bounds[n]
        for h in range(Hv):
            hk = h // (Hv // Hk)
            dS = dht[n, h].clone() if dht is not None else q.new_zeros(K, V)
            for c in reversed(range(counts[n])):
                t0, rows = bos + c * C, min(seq_len - c * C, C)
                q_c, k_c = _rows(q[:, hk], t0), _rows(k[:, hk], t0)          # [C,K]
                do_c, A_c = _rows(do[:, h], t0), _rows(A[:, h], t0)          # [C,V], [C,C]
                gam = g_cumsum[t0 + torch.clamp(i, max=rows - 1), h]         # [C]
                b = torch.where(i < rows, _rows(beta[:, h], t0), 0.0)        # [C]
                dS1[offsets[n] + c, h] = dS
                live = (i[:, None] >= i[None, :]) & (i[:, None] < rows)      # [C,C]
                decay = torch.exp(torch.clamp(gam[:, None] - gam[None, :], max=0))
                P = torch.where(live, (q_c @ k_c.T) * decay, 0.0)            # [C,C]
                Ag = torch.where(live, A_c * decay * b[None, :], 0.0)        # [C,C]
                edo = torch.where((i < rows)[:, None], do_c * gam.exp()[:, None] * scale, 0.0)
                du = scale * (P.T @ do_c) + (gam[-1] - gam).exp()[:, None] * (k_c @ dS)
                edx = -gam.exp()[:, None] * (Ag.T @ du)                      # [C,V]
                dS = gam[-1].exp() * dS + q_c.T @ edo + k_c.T @ edx          # [K,V]
            dh0[n, h] = dS
    return dS1, dh0


def emulate_chunk_bwd_intra(q, k, v, do, g_cumsum, beta, A, h, dS1, scale, bounds,
                            rnd=lambda t: t):
    """The whole kernel on packed tensors: per-value-head outputs ``dq, dk [Tt, Hv, K]``,
    ``dv [Tt, Hv, V]``, ``dbeta, dg [Tt, Hv]`` (zeros on rows no CTA writes)."""
    Tt, Hk, K = q.shape
    Hv, V = v.shape[1:]
    dq, dk = q.new_zeros(Tt, Hv, K), q.new_zeros(Tt, Hv, K)
    dv = q.new_zeros(Tt, Hv, V)
    dbeta, dg = q.new_zeros(Tt, Hv), q.new_zeros(Tt, Hv)
    srow = 0
    for n in range(len(bounds) - 1):
        bos, seq_len = bounds[n], bounds[n + 1] - bounds[n]
        for c in range(-(-seq_len // C)):
            t0, rows = bos + c * C, min(seq_len - c * C, C)
            for hh in range(Hv):
                out = emulate_cta(q, k, v, do, g_cumsum, beta, A, h[srow, hh], dS1[srow, hh],
                                  scale, t0, rows, hh, hh // (Hv // Hk), rnd)
                for dst, val in zip((dq, dk, dv, dbeta, dg), out):
                    dst[t0:t0 + rows, hh] = val
            srow += 1
    return dq, dk, dv, dbeta, dg


# --------------------------------------------------------------------------------------
# Random packed problems
# --------------------------------------------------------------------------------------

def _gates(kind: str, L: int, Hv: int, gen) -> torch.Tensor:
    if kind == "zero":
        return torch.zeros(L, Hv, dtype=torch.float64)
    if kind == "strong":                                       # down to -30 per token
        return -30.0 * torch.rand(L, Hv, generator=gen, dtype=torch.float64)
    return F.logsigmoid(torch.randn(L, Hv, generator=gen, dtype=torch.float64))


def _betas(kind: str, L: int, Hv: int, gen) -> torch.Tensor:
    u = torch.rand(L, Hv, generator=gen, dtype=torch.float64)
    if kind == "extreme":                                      # near 0 and near 1
        return torch.where(u < 0.5, 1e-4 * u, 1.0 - 1e-4 * u)
    return torch.sigmoid(torch.randn(L, Hv, generator=gen, dtype=torch.float64))


def make_problem(lens, pad, Hk, Hv, gate, beta_kind, seed, K=128, V=128):
    """Packed fp64 inputs for sequences of ``lens`` plus ``pad`` padding tokens, with the
    chunk-local g_cumsum, the true gate-free inverse A, random states and gradients."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(shape, generator=gen, dtype=torch.float64)

    bounds = [0]
    for L in lens:
        bounds.append(bounds[-1] + L)
    Tt = bounds[-1] + pad
    q = F.normalize(randn(Tt, Hk, K), dim=-1)
    k = F.normalize(randn(Tt, Hk, K), dim=-1)
    v, do = randn(Tt, Hv, V), randn(Tt, Hv, V)
    g = _gates(gate, Tt, Hv, gen)
    beta = _betas(beta_kind, Tt, Hv, gen)
    g_cumsum = randn(Tt, Hv)                      # padding rows: garbage the kernel never reads
    A = randn(Tt, Hv, C)
    k_v = k.repeat_interleave(Hv // Hk, dim=1)                           # [Tt,Hv,K]
    for n in range(len(lens)):
        for s in range(bounds[n], bounds[n + 1], C):
            e = min(s + C, bounds[n + 1])
            g_cumsum[s:e] = g[s:e].cumsum(dim=0)
            kc = k_v[s:e].transpose(0, 1)                                # [Hv,c,K]
            inv = _gate_free_inverse(kc, beta[s:e].T)                    # [Hv,c,c]
            A[s:e] = 0.0
            A[s:e, :, :e - s] = inv.transpose(0, 1)
    NT = sum(-(-L // C) for L in lens)
    h, dS1 = randn(NT, Hv, K, V), randn(NT, Hv, K, V)
    return dict(q=q, k=k, v=v, do=do, g_cumsum=g_cumsum, beta=beta, A=A, h=h, dS1=dS1,
                bounds=bounds)


PROBLEMS = {
    "full-chunks": dict(lens=[128], pad=0, Hk=1, Hv=1, gate="typical", beta_kind="typical"),
    "tails-next-seq": dict(lens=[37, 100, 1, 64, 70], pad=0, Hk=1, Hv=2, gate="typical",
                           beta_kind="typical"),
    "tail-at-end-pad": dict(lens=[150], pad=5, Hk=1, Hv=1, gate="typical",
                            beta_kind="typical"),
    "strong-gates": dict(lens=[64, 90], pad=3, Hk=2, Hv=4, gate="strong",
                         beta_kind="typical"),
    "zero-gates": dict(lens=[80, 48], pad=0, Hk=1, Hv=2, gate="zero", beta_kind="typical"),
    "beta-extreme": dict(lens=[64, 30], pad=0, Hk=1, Hv=1, gate="typical",
                         beta_kind="extreme"),
}


@pytest.mark.parametrize("column_sums", ["reduce", "transposed"])
@pytest.mark.parametrize("name", list(PROBLEMS))
def test_kernel_algorithm_matches_reference_chunk_backward(name, column_sums):
    x = make_problem(**PROBLEMS[name], seed=len(name))
    scale = 128 ** -0.5
    bounds = x["bounds"]
    Hk, Hv = x["q"].shape[1], x["v"].shape[1]
    srow = 0
    for n in range(len(bounds) - 1):
        for s in range(bounds[n], bounds[n + 1], C):
            e = min(s + C, bounds[n + 1])
            c = e - s
            for hh in range(Hv):
                hk = hh // (Hv // Hk)
                S0, dS1 = x["h"][srow, hh], x["dS1"][srow, hh]
                ours = emulate_cta(x["q"], x["k"], x["v"], x["do"], x["g_cumsum"], x["beta"],
                                   x["A"], S0, dS1, scale, s, c, hh, hk,
                                   column_sums=column_sums)
                qc, kc = x["q"][s:e, hk][None, None], x["k"][s:e, hk][None, None]
                vc, doc = x["v"][s:e, hh][None, None], x["do"][s:e, hh][None, None]
                bc, gc = x["beta"][s:e, hh][None, None], x["g_cumsum"][s:e, hh][None, None]
                Ac = x["A"][s:e, hh, :c][None, None]
                f = _chunk_forward(qc, kc, vc, bc, gc, Ac, S0[None, None])
                ref = _chunk_backward(qc, kc, bc, Ac, S0[None, None], f, doc, dS1[None, None],
                                      scale)
                for nm, a, b in zip(("dq", "dk", "dv", "dbeta", "dg"), ours,
                                    (ref.dq, ref.dk, ref.dv, ref.dbeta, ref.dg)):
                    err = rel_l2(a, b[0, 0])
                    assert err < TOL, (nm, n, s, hh, err)
            srow += 1


@pytest.mark.parametrize("name", ["tails-next-seq", "strong-gates", "tail-at-end-pad"])
def test_kernel_algorithm_matches_chunk_parallel_backward(name):
    """The whole contract of ``chunk_grads``: emulated kernel + GVA sum against the
    chunk-parallel PyTorch backward given the same h and dS1."""
    x = make_problem(**PROBLEMS[name], seed=7)
    scale = 0.3
    bounds = x["bounds"]
    Hk, Hv = x["q"].shape[1], x["v"].shape[1]
    Tt, K = x["q"].shape[0], x["q"].shape[2]
    dq, dk, dv, dbeta, dg = emulate_chunk_bwd_intra(
        x["q"], x["k"], x["v"], x["do"], x["g_cumsum"], x["beta"], x["A"], x["h"], x["dS1"],
        scale, bounds)
    G = Hv // Hk
    ours = (dq.view(Tt, Hk, G, K).sum(2), dk.view(Tt, Hk, G, K).sum(2), dv, dbeta, dg)
    cu = torch.tensor(bounds, dtype=torch.int32)
    g_cumsum = x["g_cumsum"].clone()
    g_cumsum[bounds[-1]:] = 0.0
    ref = chunk_gated_delta_rule_bwd_parallel(
        x["q"][None], x["k"][None], x["v"][None], g_cumsum[None], x["beta"][None],
        x["A"][None], x["do"][None], x["h"], dht=None, scale=scale, initial_state=None,
        cu_seqlens=cu, cu_seqlens_cpu=cu, dS1=x["dS1"], dh0=x["h"][:len(bounds) - 1])
    for nm, a, b in zip(("dq", "dk", "dv", "dbeta", "dg"), ours, ref[:5]):
        assert rel_l2(a, b[0]) < TOL, nm


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).to(t.dtype)


#: The GPU test's tolerances (kernel vs the fp32 chunk-parallel backward).
GPU_TOL = {"dq": 1e-2, "dk": 1e-2, "dv": 1e-2, "dbeta": 2e-2, "dg": 2e-2}


@pytest.mark.parametrize("gate", ["typical", "strong", "zero"])
def test_bf16_operand_rounding_within_gpu_tolerance(gate):
    """Precision budget: the algorithm with every shared-memory operand rounded to bf16
    (inputs bf16 too, as on the GPU; accumulation exact) against the exact algorithm on
    the same inputs, with realistic chunk states (the torch forward's h) and state
    gradients (:func:`reverse_sweep`'s dS1). Must stay at half the GPU test's
    tolerances, leaving room for fp32 accumulation and exp2f."""
    from flash_qla.reference import chunk_gated_delta_rule_fwd_torch

    gen = torch.Generator().manual_seed(3)
    lens, Hk, Hv, K, V = [300, 37, 130], 1, 2, 128, 128
    bounds = [0, 300, 337, 467]
    Tt = bounds[-1]

    def randn(*shape):
        return torch.randn(shape, generator=gen, dtype=torch.float64)

    q = _bf16(F.normalize(randn(1, Tt, Hk, K), dim=-1))
    k = _bf16(F.normalize(randn(1, Tt, Hk, K), dim=-1))
    v, do = _bf16(randn(1, Tt, Hv, V)), _bf16(randn(1, Tt, Hv, V))
    beta = torch.sigmoid(randn(1, Tt, Hv)).float().double()
    if gate == "zero":
        g = torch.zeros(1, Tt, Hv, dtype=torch.float64)
    elif gate == "strong":
        g = -30.0 * torch.rand(1, Tt, Hv, generator=gen, dtype=torch.float64)
    else:
        g = F.logsigmoid(randn(1, Tt, Hv) + 3.0)
    h0, dht = 0.1 * randn(len(lens), Hv, K, V), randn(len(lens), Hv, K, V)
    cu = torch.tensor(bounds, dtype=torch.int32)
    scale = K ** -0.5
    g_cumsum, A, _, h, _ = chunk_gated_delta_rule_fwd_torch(
        q, k, v, g, beta, scale=scale, initial_state=h0, cu_seqlens=cu, cu_seqlens_cpu=cu,
        output_final_state=False, output_h=True)
    g_cumsum, A, h = g_cumsum.float().double(), _bf16(A), h[0].float().double()
    packed = [t[0] for t in (q, k, v, do, g_cumsum, beta, A)]
    dS1, _ = reverse_sweep(packed[0], packed[1], packed[3], packed[4], packed[5],
                           packed[6], dht, scale, bounds)
    dS1 = dS1.float().double()
    exact = emulate_chunk_bwd_intra(*packed, h, dS1, scale, bounds)
    rounded = emulate_chunk_bwd_intra(*packed, h, dS1, scale, bounds, rnd=_bf16)
    G = Hv // Hk
    for nm, a, b in zip(GPU_TOL, rounded, exact):
        if nm in ("dq", "dk"):    # per value head in the input dtype, summed in fp32
            a, b = _bf16(a).view(Tt, Hk, G, K).sum(2), b.view(Tt, Hk, G, K).sum(2)
        if nm != "dg":                        # stored in the input dtype
            a = _bf16(a)
        err = rel_l2(a, b)
        assert err < GPU_TOL[nm] / 2, (nm, err)
