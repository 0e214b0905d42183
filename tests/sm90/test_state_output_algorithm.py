"""The forward kernel's algorithm (``kernels/chunk_state_output.py``, chunk_fwd_ws), step
by step in fp64 (CPU).

One emulated CTA per (sequence, value head), in the kernel's order of operations and
with its loads: whole 64-row tiles (a tail chunk sees the next sequence's rows, padding
that may hold NaN, or zeros past the tensor end), the q, k, v rows past the end zeroed
in shared memory (by the aux warpgroup), gates read clamped to the sequence's last
token, log2-scaled exponents, the [C, C] factors selected to ``j <= i < rows``.
Compared with the fp64 token-by-token recurrence; the roles' synchronisation is not
emulated. The kernel itself is checked on the GPU (test_forward_gpu.py).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import flash_qla
from flash_qla.reference import recurrent_gated_delta_rule
from tests.helpers import rel_l2

C = 64
LOG2E = math.log2(math.e)


def _rows(x: torch.Tensor, t0: int) -> torch.Tensor:
    """C rows from t0 of a packed tensor, zero past its end (TMA's out-of-bounds fill)."""
    out = x.new_zeros(C, *x.shape[1:])
    part = x[t0:t0 + C]
    out[:part.shape[0]] = part
    return out


def emulate_cta(q, k, v, g_cumsum, beta, A, h0, scale, bos, seq_len, h, hk):
    """One CTA of chunk_fwd_ws: packed q, k ``[Tt, Hk, K]``, v ``[Tt, Hv, V]``, g_cumsum /
    beta ``[Tt, Hv]``, A ``[Tt, Hv, C]``, h0 ``[K, V]``. Returns (o rows ``[seq_len, V]``,
    final state ``[K, V]``, chunk-start states ``[chunks, K, V]``)."""
    st = h0.T.clone()                                                 # S^T [V, K]
    last = bos + seq_len - 1
    i = torch.arange(C)
    lower = i[:, None] >= i[None, :]
    outs, hs = [], []
    for c in range(-(-seq_len // C)):
        t0 = bos + c * C
        rows = min(seq_len - c * C, C)
        q_c, k_c = _rows(q[:, hk], t0), _rows(k[:, hk], t0).clone()    # [C, K]
        v_c, a_c = _rows(v[:, h], t0), _rows(A[:, h], t0)              # [C, V], [C, C]
        q_c[rows:], k_c[rows:], v_c[rows:] = 0.0, 0.0, 0.0            # the aux's zeroing
        gam = g_cumsum[torch.clamp(t0 + i, max=last), h] * LOG2E      # [C] log2-scaled
        gam_c = g_cumsum[min(t0 + C - 1, last), h] * LOG2E
        eg, ed = torch.exp2(gam), torch.exp2(gam_c - gam)             # [C]
        b = torch.where(t0 + i <= last, _rows(beta[:, h], t0), 0.0)   # [C]
        hs.append(st.T.clone())
        qk = q_c @ k_c.T                                              # [C, C]
        ks = st @ k_c.T                                               # (K S0)^T [V, C]
        ot = st @ q_c.T                                               # (Q S0)^T [V, C]
        live = lower & (i[:, None] < rows)
        decay = torch.exp2(torch.clamp(gam[:, None] - gam[None, :], max=0.0))
        ag = torch.where(live, a_c * decay * b[None, :], 0.0)
        p = torch.where(live, qk * decay, 0.0)
        r = v_c.T - eg[None, :] * ks                                  # R [V, C]
        u = r @ ag.T                                                  # U^T [V, C]
        ot = ot * eg[None, :] + u @ p.T
        st = st * eg[C - 1] + (u * ed[None, :]) @ k_c
        outs.append((ot * scale).T[:rows])
    o = torch.cat(outs) if outs else v.new_zeros(0, v.shape[-1])
    return o, st.T, (torch.stack(hs) if hs else h0.new_zeros(0, *h0.shape))


def _problem(lens, Hk, Hv, pad, gate, seed):
    gen = torch.Generator().manual_seed(seed)
    Tt = sum(lens) + pad
    q = F.normalize(torch.randn(1, Tt, Hk, 128, generator=gen, dtype=torch.float64), dim=-1)
    k = F.normalize(torch.randn(1, Tt, Hk, 128, generator=gen, dtype=torch.float64), dim=-1)
    v = torch.randn(1, Tt, Hv, 128, generator=gen, dtype=torch.float64)
    beta = torch.sigmoid(torch.randn(1, Tt, Hv, generator=gen, dtype=torch.float64))
    g = {"typical": F.logsigmoid(torch.randn(1, Tt, Hv, generator=gen, dtype=torch.float64) + 3),
         "zero": torch.zeros(1, Tt, Hv, dtype=torch.float64),
         "strong": -30 * torch.rand(1, Tt, Hv, generator=gen, dtype=torch.float64)}[gate]
    h0 = 0.1 * torch.randn(len(lens), Hv, 128, 128, generator=gen, dtype=torch.float64)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=h0, cu_seqlens=cu)


def _emulate(inp, poison: bool):
    """Every CTA of a problem; ``poison`` fills the padding tokens with NaN / Inf first."""
    g_cumsum, A = flash_qla.chunk_gated_delta_rule_fwd(**inp, backend="torch")[:2]
    q, k, v, beta = (inp[n][0].clone() for n in ("q", "k", "v", "beta"))
    g_cumsum, A = g_cumsum[0].clone(), A[0].clone()
    cu = inp["cu_seqlens"].tolist()
    if poison:
        for x, bad in ((q, math.nan), (k, math.nan), (v, math.inf), (beta, math.nan),
                       (g_cumsum, math.nan), (A, math.nan)):
            x[cu[-1]:] = bad
    Hk, Hv = q.shape[1], v.shape[1]
    o = torch.zeros_like(v)
    final = torch.empty_like(inp["initial_state"])
    scale = 128 ** -0.5
    for n in range(len(cu) - 1):
        for h in range(Hv):
            o_n, final[n, h], _ = emulate_cta(
                q, k, v, g_cumsum, beta, A, inp["initial_state"][n, h], scale, cu[n],
                cu[n + 1] - cu[n], h, h // (Hv // Hk))
            o[cu[n]:cu[n + 1], h] = o_n
    return o, final


CASES = [
    ([1000, 24], 2, 4, 0, "typical"),                 # GVA, a tail chunk of 40 rows
    ([1, 63, 0, 75, 130, 1], 1, 2, 37, "typical"),   # empty / length-1, padding
    ([200, 64, 129], 2, 2, 5, "strong"),              # exp underflow, exact chunk
    ([300, 77], 1, 1, 11, "zero"),                    # no decay at all
]


@pytest.mark.parametrize("lens, Hk, Hv, pad, gate", CASES)
def test_emulated_kernel_matches_recurrence(lens, Hk, Hv, pad, gate):
    inp = _problem(lens, Hk, Hv, pad, gate, seed=len(lens))
    o, final = _emulate(inp, poison=False)
    o_ref, final_ref = recurrent_gated_delta_rule(**inp, output_final_state=True)
    valid = sum(lens)
    assert rel_l2(o[:valid], o_ref[0, :valid]) < 1e-10
    assert rel_l2(final, final_ref) < 1e-10


@pytest.mark.parametrize("lens, Hk, Hv, pad, gate", [c for c in CASES if c[3]])
def test_emulated_kernel_ignores_nan_padding(lens, Hk, Hv, pad, gate):
    """NaN / Inf in every input's padding tokens leaves the valid outputs unchanged."""
    inp = _problem(lens, Hk, Hv, pad, gate, seed=7)
    clean, final_clean = _emulate(inp, poison=False)
    dirty, final_dirty = _emulate(inp, poison=True)
    valid = sum(lens)
    assert torch.isfinite(dirty[:valid]).all() and torch.isfinite(final_dirty).all()
    assert torch.equal(dirty[:valid], clean[:valid])
    assert torch.equal(final_dirty, final_clean)
