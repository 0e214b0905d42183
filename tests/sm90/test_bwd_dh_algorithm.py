"""The chunk_bwd_dh kernel's algorithm, step by step in fp64 PyTorch (CPU).

The kernel loads whole 64-row chunks, so a tail chunk sees the next sequence's rows (or
zeros past the end of the tensor) and masks them exactly as emulated here. Its dS1/dh0,
fed to the chunk-parallel backward, must give the gradients of the PyTorch sweep. The
kernel itself is checked against the sweep on the GPU (test_backward_gpu.py).
"""

from __future__ import annotations

import pytest
import torch

from flash_qla.chunk_parallel import chunk_gated_delta_rule_bwd_parallel
from tests.core.test_reference import ALL_CASES, _params, chunked_forward, make_inputs
from tests.helpers import rel_l2

C = 64


def _rows(x: torch.Tensor, t0: int) -> torch.Tensor:
    """C rows from t0 of a packed tensor, zero past its end (TMA's out-of-bounds fill)."""
    out = x.new_zeros(C, *x.shape[1:])
    part = x[t0:t0 + C]
    out[:part.shape[0]] = part
    return out


def emulate_bwd_dh(q, k, do, g_cumsum, beta, A, dht, scale, bounds):
    """(dS1 [NT,Hv,K,V], dh0 [N,Hv,K,V]) the way chunk_bwd_dh computes them."""
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


@pytest.mark.parametrize("case", _params(ALL_CASES[::2]))
def test_kernel_algorithm_gives_the_sweeps_gradients(case):
    x = make_inputs(case)
    g_cumsum, A, _, h, _ = chunked_forward(case)
    T = case.T
    bounds = (list(case.cu) if case.cu is not None else None)
    packed = {n: t.reshape(case.B * T, *t.shape[2:]) for n, t in
              dict(q=x.q, k=x.k, do=x.do, g=g_cumsum, beta=x.beta, A=A).items()}
    if bounds is None:
        bounds = [b * T for b in range(case.B + 1)]
    dS1, dh0 = emulate_bwd_dh(packed["q"], packed["k"], packed["do"], packed["g"],
                              packed["beta"], packed["A"], x.dht, case.resolved_scale, bounds)
    kw = dict(dht=x.dht, scale=case.resolved_scale, initial_state=x.h0, cu_seqlens=x.cu,
              cu_seqlens_cpu=x.cu)
    args = (x.q, x.k, x.v, g_cumsum, x.beta, A, x.do, h)
    ours = chunk_gated_delta_rule_bwd_parallel(*args, **kw, dS1=dS1, dh0=dh0)
    ref = chunk_gated_delta_rule_bwd_parallel(*args, **kw)
    for name, a, b in zip(("dq", "dk", "dv", "dbeta", "dg", "dh0"), ours, ref):
        if b is None:
            assert a is None, name
        else:
            assert rel_l2(a, b) < 1e-12, name
