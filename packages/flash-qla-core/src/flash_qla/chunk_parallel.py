"""Chunk-parallel backward in PyTorch: every chunk at once, only the dS sweep is serial.

Given the chunk-start states h (from a forward kernel that keeps them), the backward of
gdn-math.md ("Backward of one chunk") needs, per chunk, only its own inputs, its start
state S0 and the incoming state gradient dS1. dS1 comes from a reverse sweep that is
affine in the state gradient (gdn-math, "Segment transition", transposed)::

    dS0 = b + exp(gam_C) dS1 - (E K)^T Ag^T (D K dS1)
    b   = scale (E Q)^T dO - (E K)^T Ag^T (scale P^T dO)

so the sweep is one short chain of batched matrix products per chunk position, and
everything else runs over all chunks of all sequences as one batch. This is the
Hopper backend's backward until its TileLang backward kernels land.

Tail chunks are padded to C rows with q = k = v = dO = beta = 0, the last valid gam
repeated and identity rows in A: the padded rows add nothing to any product and the
gate gradient of gam_C lands on the padded last row, from where the in-chunk reverse
cumsum carries it to every valid row, exactly as for an unpadded tail.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .offsets import bounds as sequence_bounds
from .reference import (
    _chunk_backward,
    _chunk_forward,
    _compute_dtype,
    _expand_heads,
    _reduce_heads,
)

__all__ = ["chunk_gated_delta_rule_bwd_parallel"]

#: Bytes of fp32 intermediates one batch of chunks may hold (the per-chunk forward and
#: backward products are ~16 tensors of [chunks, Hv, C, max(C, K, V)]).
SLICE_BYTES = 2 << 30


@dataclass
class _Chunks:
    """Where every chunk lives in the token layout ``[B * T]`` (host-side plan)."""

    rows: Tensor        # [NT, C] long, token index (clamped to the chunk's last valid token)
    valid: Tensor       # [NT, C] bool
    seq: list[int]      # sequence of each chunk
    offsets: list[int]  # [N+1] first chunk of each sequence


def _plan(B: int, T: int, bounds: list[int] | None, C: int, device) -> _Chunks:
    spans = ([(b * T, (b + 1) * T) for b in range(B)] if bounds is None
             else list(zip(bounds[:-1], bounds[1:])))
    starts, ends, seq, offsets = [], [], [], [0]
    for n, (bos, eos) in enumerate(spans):
        for s in range(bos, eos, C):
            starts.append(s)
            ends.append(min(s + C, eos))
            seq.append(n)
        offsets.append(len(starts))
    start = torch.tensor(starts, dtype=torch.long).reshape(-1, 1)        # [NT,1]
    end = torch.tensor(ends, dtype=torch.long).reshape(-1, 1)            # [NT,1]
    pos = start + torch.arange(C).reshape(1, -1)                         # [NT,C]
    rows = torch.minimum(pos, end - 1)                                   # [NT,C]
    return _Chunks(rows=rows.to(device), valid=(pos < end).to(device), seq=seq,
                   offsets=offsets)


def _gather(x: Tensor, plan: _Chunks, dtype, zero_pad: bool = True) -> Tensor:
    """``[B*T, H, ...] -> [NT, H, C, ...]`` (head-major chunks); padded rows zeroed."""
    out = x[plan.rows].to(dtype)                                         # [NT,C,H,...]
    if zero_pad:
        mask = plan.valid.reshape(*plan.valid.shape, *([1] * (out.dim() - 2)))
        out = out * mask
    return out.transpose(1, 2)                                           # [NT,H,C,...]


def _gather_inverse(A: Tensor, plan: _Chunks, dtype) -> Tensor:
    """A rows ``[B*T, Hv, C] -> [NT, Hv, C, C]`` with identity rows on the padding."""
    A_c = _gather(A, plan, dtype)                                        # [NT,Hv,C,C]
    C = A_c.shape[-1]
    pad = ~plan.valid                                                    # [NT,C]
    eye = torch.eye(C, dtype=dtype, device=A_c.device)                   # [C,C]
    return A_c + (pad[:, None, :, None] * eye).to(dtype)                 # [NT,Hv,C,C]


def _slices(n: int, per: int):
    return [slice(s, min(s + per, n)) for s in range(0, n, per)]


@dataclass
class _Sweep:
    """Per-chunk pieces of the affine dS recurrence (all [NT, Hv, ...])."""

    k: Tensor        # [NT,Hv,C,K]
    Ek: Tensor       # [NT,Hv,C,K]  E K
    Ag: Tensor       # [NT,Hv,C,C]
    D: Tensor        # [NT,Hv,C]
    decay_C: Tensor  # [NT,Hv]
    b: Tensor        # [NT,Hv,K,V]  the part of dS0 that does not depend on dS1


def _sweep_terms(q, k, v, beta, gam, A, S0, dO, scale) -> _Sweep:
    f = _chunk_forward(q, k, v, beta, gam, A, S0)
    Ek = f.E[..., None] * k                                              # [n,Hv,C,K]
    dU_o = scale * f.P.transpose(-1, -2) @ dO                            # [n,Hv,C,V]
    b = (scale * (f.E[..., None] * q).transpose(-1, -2) @ dO             # [n,Hv,K,V]
         - Ek.transpose(-1, -2) @ (f.Ag.transpose(-1, -2) @ dU_o))
    return _Sweep(k=k, Ek=Ek, Ag=f.Ag, D=f.D, decay_C=f.decay_C, b=b)


def _reverse_sweep(sw: _Sweep, plan: _Chunks, dS_final: Tensor) -> tuple[Tensor, Tensor]:
    """dS1 of every chunk ``[NT, Hv, K, V]`` and dS0 of every sequence ``[N, Hv, K, V]``.

    Sequences are ordered by chunk count, longest first, so the sequences still active
    at reverse step j are a prefix of that order: one batched chain per step.
    """
    counts = [plan.offsets[n + 1] - plan.offsets[n] for n in range(len(plan.offsets) - 1)]
    order = sorted(range(len(counts)), key=lambda n: -counts[n])
    carry = dS_final[order].clone()                                      # [N,Hv,K,V]
    dS1 = torch.empty_like(sw.b)                                         # [NT,Hv,K,V]
    # chunk of every (step, active sequence), sent to the device in one copy
    steps = [[plan.offsets[n] + counts[n] - 1 - j for n in order if counts[n] > j]
             for j in range(max(counts, default=0))]
    flat = torch.tensor([c for step in steps for c in step], dtype=torch.long)
    flat = flat.to(sw.b.device)                                          # [sum of actives]
    start = 0
    for step in steps:
        active = len(step)
        idx = flat[start:start + active]                                 # [a]
        start += active
        dS = carry[:active]                                              # [a,Hv,K,V]
        dS1[idx] = dS
        KdS = sw.D[idx][..., None] * (sw.k[idx] @ dS)                    # [a,Hv,C,V]
        dX = sw.Ag[idx].transpose(-1, -2) @ KdS                          # [a,Hv,C,V]
        carry[:active] = (sw.b[idx] + sw.decay_C[idx][..., None, None] * dS
                          - sw.Ek[idx].transpose(-1, -2) @ dX)
    dS0 = torch.empty_like(carry)
    dS0[order] = carry
    return dS1, dS0


def chunk_gated_delta_rule_bwd_parallel(q: Tensor, k: Tensor, v: Tensor, g_cumsum: Tensor,
                                        beta: Tensor, A: Tensor, do: Tensor, h: Tensor, *,
                                        dht: Tensor | None, scale: float,
                                        initial_state: Tensor | None,
                                        cu_seqlens: Tensor | None,
                                        cu_seqlens_cpu: Tensor | None,
                                        chunk_size: int = 64,
                                        dS1: Tensor | None = None,
                                        dh0: Tensor | None = None):
    """The ``Kernels.bwd`` contract, given the chunk-start states ``h``.

    Args:
        q, k ``[B, T, Hk, K]``; v, do ``[B, T, Hv, V]``; g_cumsum, beta ``[B, T, Hv]``;
        A ``[B, T, Hv, C]``: as ``Kernels.bwd`` takes them.
        h: ``[NT, Hv, K, V]`` (or ``[B, NT/B, Hv, K, V]``) chunk-start states in chunk
            order (dense: batch row major; varlen: sequences in order), e.g. a forward's
            ``output_h``.
        dht, scale, initial_state, cu_seqlens, cu_seqlens_cpu, chunk_size: as
            ``Kernels.bwd``; ``cu_seqlens`` is read on the host (``cu_seqlens_cpu``
            avoids the sync).
        dS1, dh0: the state gradient at each chunk's end ``[NT, Hv, K, V]`` and at each
            sequence's start ``[N, Hv, K, V]`` when a kernel swept them already (both
            or neither); otherwise the reverse sweep runs here.

    Returns ``(dq, dk, dv, dbeta, dg, dh0)`` with the dtypes of
    :func:`flash_qla.reference.chunk_gated_delta_rule_bwd_torch`. Memory (fp32; the
    fallback and reference path of backends without a per-chunk gradient kernel):
    head-major copies of q, k, v, dO and A per chunk and the sweep terms (k, E k, Ag, b,
    dS1) for all chunks at once, about 6 KB per token and value head (~3 GB at 32k
    tokens x 16 heads), plus at most ``SLICE_BYTES`` of per-slice intermediates.
    """
    B, T, Hk, K = q.shape
    Hv, V = v.shape[2], v.shape[3]
    C = chunk_size
    dtype = _compute_dtype(q.dtype)
    plan = _plan(B, T, sequence_bounds(cu_seqlens, cu_seqlens_cpu), C, q.device)
    NT, N = plan.rows.shape[0], len(plan.offsets) - 1

    def flat(x):                                                         # [B,T,...] -> [B*T,...]
        return x.reshape(B * T, *x.shape[2:])

    q_c = _gather(flat(_expand_heads(q, Hv)), plan, dtype)               # [NT,Hv,C,K]
    k_c = _gather(flat(_expand_heads(k, Hv)), plan, dtype)               # [NT,Hv,C,K]
    v_c = _gather(flat(v), plan, dtype)                                  # [NT,Hv,C,V]
    do_c = _gather(flat(do), plan, dtype)                                # [NT,Hv,C,V]
    beta_c = _gather(flat(beta), plan, dtype)                            # [NT,Hv,C]
    gam_c = _gather(flat(g_cumsum), plan, dtype, zero_pad=False)         # [NT,Hv,C]
    A_c = _gather_inverse(flat(A), plan, dtype)                          # [NT,Hv,C,C]
    S0 = h.reshape(NT, Hv, K, V).to(dtype)                               # [NT,Hv,K,V]
    dS_final = (q.new_zeros(N, Hv, K, V, dtype=dtype) if dht is None
                else dht.to(dtype))                                      # [N,Hv,K,V]

    per = max(1, SLICE_BYTES // (16 * Hv * C * max(C, K, V) * 4))
    if NT == 0:                                   # no sequence holds a token
        dS1, dh0 = S0, dS_final
    elif dS1 is None:
        parts = [_sweep_terms(q_c[s], k_c[s], v_c[s], beta_c[s], gam_c[s], A_c[s], S0[s],
                              do_c[s], scale) for s in _slices(NT, per)]
        sweep = _Sweep(*(torch.cat([getattr(p, name) for p in parts])
                         for name in _Sweep.__dataclass_fields__))
        dS1, dh0 = _reverse_sweep(sweep, plan, dS_final)
    dS1 = dS1.reshape(NT, Hv, K, V).to(dtype)                            # [NT,Hv,K,V]

    dq = q.new_zeros(B * T, Hv, K, dtype=dtype)                          # [B*T,Hv,K]
    dk, dv = torch.zeros_like(dq), q.new_zeros(B * T, Hv, V, dtype=dtype)
    dbeta, dg = q.new_zeros(B * T, Hv, dtype=dtype), q.new_zeros(B * T, Hv, dtype=dtype)
    for s in _slices(NT, per):
        f = _chunk_forward(q_c[s], k_c[s], v_c[s], beta_c[s], gam_c[s], A_c[s], S0[s])
        gr = _chunk_backward(q_c[s], k_c[s], beta_c[s], A_c[s], S0[s], f, do_c[s], dS1[s],
                             scale)
        rows, valid = plan.rows[s][plan.valid[s]], plan.valid[s]        # [n_valid], [n,C]
        pairs = ((dq, gr.dq), (dk, gr.dk), (dv, gr.dv), (dbeta, gr.dbeta), (dg, gr.dg))
        for out, val in pairs:
            out[rows] = val.transpose(1, 2)[valid]                       # [n_valid,Hv,...]

    def unflat(x):
        return x.reshape(B, T, *x.shape[1:])

    return (_reduce_heads(unflat(dq), Hk).to(q.dtype),
            _reduce_heads(unflat(dk), Hk).to(k.dtype), unflat(dv).to(v.dtype),
            unflat(dbeta).to(beta.dtype), unflat(dg),
            dh0.to(dtype) if initial_state is not None else None)
