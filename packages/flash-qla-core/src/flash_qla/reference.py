"""Reference math of Gated DeltaNet in plain PyTorch, and the ``torch`` backend.

Everything here follows ``docs/gdn-math.md`` (cited below as *gdn-math*) and
uses the shape vocabulary of :mod:`flash_qla.backend` (B, T, Hk, Hv, K, V, N, C, NT).

Three things live in this module:

* :func:`recurrent_gated_delta_rule` -- the token-by-token recurrence ("the
  definition"), written with differentiable torch ops. Run in float64, it is the
  oracle for the outputs *and* (through ``torch.autograd``) for every gradient.
* :func:`chunk_gated_delta_rule_fwd_torch` / :func:`chunk_gated_delta_rule_bwd_torch`
  -- the chunked forward and the manual per-chunk backward ("Chunked form" and
  "Backward of one chunk"), returning exactly what ``Kernels.fwd`` / ``Kernels.bwd``
  return. They are vectorised over batch rows, heads and chunk rows; chunks and
  sequences are Python loops.
* :data:`TORCH_KERNELS` -- an object satisfying the ``Kernels`` protocol by calling
  the two chunked functions (the ``torch`` backend).

Internal layout: tensors are moved to *head-major* ``[Bs, Hv, L, ...]`` (``Bs`` batch
rows processed together, ``L`` tokens of the current span) so that per-chunk
quantities are batched matrix products. q/k are expanded from Hk to Hv heads first
(GVA), and dq/dk are summed back over the value heads sharing a q/k head.

Tail chunks (a sequence length not a multiple of C) are handled by working on the
``c <= C`` valid rows only. That is exactly "missing rows have k = v = beta = 0 and the
last valid gam repeated" of gdn-math: such rows add nothing to any product, and no
out-of-range g ever reaches an ``exp``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .offsets import bounds as sequence_bounds

__all__ = [
    "TORCH_KERNELS",
    "chunk_gated_delta_rule_bwd_torch",
    "chunk_gated_delta_rule_fwd_torch",
    "recurrent_gated_delta_rule",
]


# --------------------------------------------------------------------------------------
# Small helpers
# --------------------------------------------------------------------------------------

def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp64 stays fp64; every other dtype (bf16, fp16, fp32) computes in fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _spans(B: int, T: int, bounds: list[int] | None) -> list[tuple[slice, int, int]]:
    """The independent work items: ``(batch_rows, bos, eos)``.

    Dense: one item covering all B rows and tokens ``[0, T)`` (every row has the same
    length, so they are processed together). Varlen (B == 1): one item per sequence,
    tokens ``[bos, eos)`` of batch row 0. The item index is also the sequence index
    ``n`` of the state tensors for varlen; for dense the batch rows are sequences.
    """
    if bounds is None:
        return [(slice(0, B), 0, T)]
    return [(slice(0, 1), bounds[n], bounds[n + 1]) for n in range(len(bounds) - 1)]


def _states_slice(bounds: list[int] | None, item: int, B: int) -> slice:
    """Rows of an ``[N, Hv, K, V]`` state tensor belonging to work item ``item``."""
    return slice(0, B) if bounds is None else slice(item, item + 1)


def _expand_heads(x: Tensor, Hv: int) -> Tensor:
    """GVA: ``[B, T, Hk, D] -> [B, T, Hv, D]``; value head h reads q/k head h // (Hv // Hk)."""
    return x.repeat_interleave(Hv // x.shape[2], dim=2)


def _reduce_heads(dx: Tensor, Hk: int) -> Tensor:
    """GVA adjoint of :func:`_expand_heads`: ``[B, T, Hv, D] -> [B, T, Hk, D]`` (sum;
    ``dx`` itself when Hv == Hk, no reduction kernel)."""
    B, T, Hv, D = dx.shape
    if Hv == Hk:
        return dx
    return dx.reshape(B, T, Hk, Hv // Hk, D).sum(dim=3)


def _head_major(x: Tensor, rows: slice, bos: int, eos: int, dtype: torch.dtype) -> Tensor:
    """``[B, T, H, ...] -> [Bs, H, L, ...]`` for batch rows ``rows`` and tokens [bos, eos)."""
    return x[rows, bos:eos].transpose(1, 2).to(dtype)


def _chunk_starts(L: int, C: int) -> range:
    """Start offsets of the ``ceil(L / C)`` chunks of a span of L tokens."""
    return range(0, L, C)


# --------------------------------------------------------------------------------------
# The definition: token-by-token recurrence (differentiable)
# --------------------------------------------------------------------------------------

def _recurrence_span(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                     S: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """Run gdn-math "Recurrence" over one span of tokens.

    Args (head-major, already expanded to Hv heads):
        q, k: ``[Bs, Hv, L, K]``;  v: ``[Bs, Hv, L, V]``;  g, beta: ``[Bs, Hv, L]``;
        S: ``[Bs, Hv, K, V]`` state before the first token.

    Per token t::

        S <- exp(g_t) S                                   # decay first
        S <- S + beta_t k_t (v_t - S^T k_t)^T             # = (I - b k k^T) S + b k v^T
        o_t = scale * S^T q_t                             # reads the updated state

    Returns ``(o [Bs, Hv, L, V], S [Bs, Hv, K, V])``. No in-place ops: autograd-safe.
    """
    outputs = []
    for t in range(q.shape[2]):
        S = S * g[:, :, t].exp()[..., None, None]                       # [Bs,Hv,K,V]
        k_t = k[:, :, t]                                                # [Bs,Hv,K]
        predicted = torch.einsum("bhk,bhkv->bhv", k_t, S)               # [Bs,Hv,V]
        delta = beta[:, :, t, None] * (v[:, :, t] - predicted)          # [Bs,Hv,V]
        S = S + torch.einsum("bhk,bhv->bhkv", k_t, delta)               # [Bs,Hv,K,V]
        outputs.append(scale * torch.einsum("bhk,bhkv->bhv", q[:, :, t], S))  # [Bs,Hv,V]
    if outputs:
        o = torch.stack(outputs, dim=2)                                 # [Bs,Hv,L,V]
    else:
        o = S.new_zeros(S.shape[0], S.shape[1], 0, v.shape[-1])         # [Bs,Hv,0,V]
    return o, S


def recurrent_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *,
                               scale: float | None = None,
                               initial_state: Tensor | None = None,
                               cu_seqlens: Tensor | None = None,
                               output_final_state: bool = False) -> tuple[Tensor, Tensor | None]:
    """Gated DeltaNet by its definition, one token at a time (gdn-math "Recurrence").

    Written only with differentiable torch ops: ``torch.autograd`` through it, in
    float64, is the reference for every gradient of the chunked backward.

    Args:
        q, k: ``[B, T, Hk, K]``.  v: ``[B, T, Hv, V]`` with ``Hv = G * Hk`` (GVA: value
            head h reads q/k head ``h // G``).
        g: ``[B, T, Hv]`` raw per-token log decay.  beta: ``[B, T, Hv]``.
        scale: output scale, default ``K ** -0.5``.
        initial_state: ``[N, Hv, K, V]`` or None (zeros).
        cu_seqlens: ``[N + 1]`` offsets of packed sequences (requires B == 1), or None
            for N = B dense rows. Tokens after ``cu_seqlens[-1]`` are padding and get
            ``o = 0`` exactly; zero-length sequences are allowed (their final state is
            their initial state).
        output_final_state: return the final state (else None).

    Computes in q's dtype promoted to at least fp32 (callers pass fp64 to get the
    reference of record). Returns ``o [B, T, Hv, V]`` in q's dtype and
    ``final_state [N, Hv, K, V]`` in the compute dtype, or None.
    """
    B, T, _, K = q.shape
    Hv, V = v.shape[2], v.shape[3]
    dtype = torch.promote_types(q.dtype, torch.float32)
    scale = K ** -0.5 if scale is None else scale
    bounds = sequence_bounds(cu_seqlens, None)
    q_full, k_full = _expand_heads(q, Hv), _expand_heads(k, Hv)        # [B,T,Hv,K]

    o_pieces, finals = [], []
    for item, (rows, bos, eos) in enumerate(_spans(B, T, bounds)):
        sl = _states_slice(bounds, item, B)
        n_rows = sl.stop - sl.start
        if initial_state is None:
            S0 = q.new_zeros(n_rows, Hv, K, V, dtype=dtype)             # [Bs,Hv,K,V]
        else:
            S0 = initial_state[sl].to(dtype)                            # [Bs,Hv,K,V]
        o_span, S = _recurrence_span(
            _head_major(q_full, rows, bos, eos, dtype), _head_major(k_full, rows, bos, eos, dtype),
            _head_major(v, rows, bos, eos, dtype), _head_major(g, rows, bos, eos, dtype),
            _head_major(beta, rows, bos, eos, dtype), S0, scale)
        o_pieces.append(o_span.transpose(1, 2))                         # [Bs,L,Hv,V]
        finals.append(S)
    if bounds is not None and bounds[-1] < T:                           # padding: exact zeros
        o_pieces.append(v.new_zeros(1, T - bounds[-1], Hv, V, dtype=dtype))
    o = torch.cat(o_pieces, dim=1).to(q.dtype)                          # [B,T,Hv,V]
    final_state = torch.cat(finals, dim=0) if output_final_state else None  # [N,Hv,K,V]
    return o, final_state


# --------------------------------------------------------------------------------------
# One chunk, forward (gdn-math "Chunked form")
# --------------------------------------------------------------------------------------

def _causal_mask(c: int, device: torch.device) -> Tensor:
    """``[c, c]`` bool, True where ``i >= j`` (diagonal included)."""
    return torch.ones(c, c, dtype=torch.bool, device=device).tril()


def _gate_free_inverse(k: Tensor, beta: Tensor) -> Tensor:
    """``A = (I + strictly_lower(diag(beta) K K^T))^-1``, unit lower-triangular.

    k: ``[..., c, K]``, beta: ``[..., c]`` -> A ``[..., c, c]`` (gdn-math "Chunked
    form": the inverse depends on k and beta only, never on the gates).
    """
    c = k.shape[-2]
    N = torch.tril(beta[..., :, None] * (k @ k.transpose(-1, -2)), diagonal=-1)  # [...,c,c]
    eye = torch.eye(c, dtype=k.dtype, device=k.device).expand_as(N)              # [...,c,c]
    return torch.linalg.solve_triangular(eye + N, eye, upper=False, unitriangular=True)


def _decay_matrix(gam: Tensor) -> Tensor:
    """``G_ij = exp(gam_i - gam_j)`` for ``i >= j``, else 0.  gam ``[..., c]`` -> ``[..., c, c]``.

    The upper triangle is masked to -inf *before* the exp, so no positive exponent is
    ever evaluated.
    """
    c = gam.shape[-1]
    diff = gam[..., :, None] - gam[..., None, :]                                 # [...,c,c]
    return torch.where(_causal_mask(c, gam.device), diff, -math.inf).exp()      # [...,c,c]


@dataclass
class _ChunkForward:
    """Forward quantities of one chunk (gdn-math "Chunked form"), head-major.

    Shapes: ``[Bs, Hv, c]`` for E, D; ``[Bs, Hv]`` for decay_C; ``[Bs, Hv, c, c]`` for
    G, GA, Ag, QK, P; ``[Bs, Hv, c, V]`` for QS0, KS0, X, U.
    """

    E: Tensor        # exp(gam)
    D: Tensor        # exp(gam_C - gam)
    decay_C: Tensor  # exp(gam_C)
    G: Tensor        # exp(gam_i - gam_j), causal
    GA: Tensor       # G * A
    Ag: Tensor       # (G * A) diag(beta)
    QK: Tensor       # tril(Q K^T), diagonal included
    P: Tensor        # G * QK
    QS0: Tensor      # Q S0
    KS0: Tensor      # K S0
    X: Tensor        # V - E K S0
    U: Tensor        # Ag X  (FLA's v_new)


def _chunk_forward(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, gam: Tensor, A: Tensor,
                   S0: Tensor) -> _ChunkForward:
    """All intermediate products of one chunk given its start state S0.

    q, k ``[Bs, Hv, c, K]``; v ``[Bs, Hv, c, V]``; beta, gam ``[Bs, Hv, c]``;
    A ``[Bs, Hv, c, c]``; S0 ``[Bs, Hv, K, V]``.
    """
    E = gam.exp()                                                   # [Bs,Hv,c]
    D = (gam[..., -1:] - gam).exp()                                 # [Bs,Hv,c]
    decay_C = E[..., -1]                                            # [Bs,Hv]
    G = _decay_matrix(gam)                                          # [Bs,Hv,c,c]
    GA = G * A                                                      # [Bs,Hv,c,c]
    Ag = GA * beta[..., None, :]                                    # [Bs,Hv,c,c]
    QK = torch.tril(q @ k.transpose(-1, -2))                        # [Bs,Hv,c,c]
    P = G * QK                                                      # [Bs,Hv,c,c]
    QS0 = q @ S0                                                    # [Bs,Hv,c,V]
    KS0 = k @ S0                                                    # [Bs,Hv,c,V]
    X = v - E[..., None] * KS0                                      # [Bs,Hv,c,V]
    U = Ag @ X                                                      # [Bs,Hv,c,V]
    return _ChunkForward(E=E, D=D, decay_C=decay_C, G=G, GA=GA, Ag=Ag, QK=QK, P=P,
                         QS0=QS0, KS0=KS0, X=X, U=U)


def _chunk_output(f: _ChunkForward, scale: float) -> Tensor:
    """``O = scale (E Q S0 + P U)``  -> ``[Bs, Hv, c, V]``."""
    return scale * (f.E[..., None] * f.QS0 + f.P @ f.U)             # [Bs,Hv,c,V]


def _chunk_next_state(k: Tensor, f: _ChunkForward, S0: Tensor) -> Tensor:
    """``S1 = exp(gam_C) S0 + K^T D U``  -> ``[Bs, Hv, K, V]``."""
    return f.decay_C[..., None, None] * S0 + k.transpose(-1, -2) @ (f.D[..., None] * f.U)


# --------------------------------------------------------------------------------------
# Chunked forward
# --------------------------------------------------------------------------------------

@dataclass
class _SpanForward:
    """Chunked forward of one span (head-major): per-token tensors and chunk states."""

    gam: Tensor           # [Bs,Hv,L]     chunk-local cumsum of g
    A: Tensor             # [Bs,Hv,L,C]   gate-free inverse, row i of its chunk
    o: Tensor             # [Bs,Hv,L,V]
    h: list[Tensor]       # ceil(L/C) x [Bs,Hv,K,V] chunk-start states
    final_state: Tensor   # [Bs,Hv,K,V]


def _fwd_span(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, S: Tensor,
              scale: float, C: int) -> _SpanForward:
    """Chunked forward of one span of tokens, chunk after chunk.

    q, k ``[Bs, Hv, L, K]``; v ``[Bs, Hv, L, V]``; g, beta ``[Bs, Hv, L]``;
    S ``[Bs, Hv, K, V]`` initial state. All in the compute dtype.
    """
    Bs, Hv, L, _ = q.shape
    gam = torch.zeros_like(g)                                       # [Bs,Hv,L]
    A = q.new_zeros(Bs, Hv, L, C)                                   # [Bs,Hv,L,C]
    o = v.new_zeros(v.shape)                                        # [Bs,Hv,L,V]
    h = []
    for s in _chunk_starts(L, C):
        e = min(s + C, L)
        c = e - s
        gam_c = g[:, :, s:e].cumsum(dim=-1)                         # [Bs,Hv,c]
        A_c = _gate_free_inverse(k[:, :, s:e], beta[:, :, s:e])     # [Bs,Hv,c,c]
        f = _chunk_forward(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], beta[:, :, s:e],
                           gam_c, A_c, S)
        h.append(S)
        gam[:, :, s:e] = gam_c
        A[:, :, s:e, :c] = A_c
        o[:, :, s:e] = _chunk_output(f, scale)
        S = _chunk_next_state(k[:, :, s:e], f, S)
    return _SpanForward(gam=gam, A=A, o=o, h=h, final_state=S)


def chunk_gated_delta_rule_fwd_torch(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *,
                                     scale: float, initial_state: Tensor | None,
                                     cu_seqlens: Tensor | None, cu_seqlens_cpu: Tensor | None,
                                     output_final_state: bool, output_h: bool,
                                     chunk_size: int = 64):
    """Chunked forward (gdn-math "Chunked form"); the contract of ``Kernels.fwd``.

    Args:
        q, k: ``[B, T, Hk, K]``;  v: ``[B, T, Hv, V]``;  g, beta: ``[B, T, Hv]``.
        scale: output scale (no default here: the core resolves it).
        initial_state: ``[N, Hv, K, V]`` or None (zeros).
        cu_seqlens / cu_seqlens_cpu: ``[N + 1]`` offsets (B == 1) or None; the host copy
            is used when given. Chunks restart at every sequence start.
        output_final_state, output_h: what to return.
        chunk_size: C.

    Per chunk: ``gam = cumsum(g)``, ``A = (I + strictly_lower(diag(beta) K K^T))^-1``,
    ``O = scale (E Q S0 + P U)``, ``S1 = exp(gam_C) S0 + K^T D U``.

    Computes in fp32 (fp64 for fp64 inputs). Returns ``(g_cumsum, A, o, h, final_state)``:

    * g_cumsum ``[B, T, Hv]`` compute dtype: chunk-local cumsum of g.
    * A ``[B, T, Hv, C]`` q's dtype: row i of its chunk's gate-free inverse (columns
      past the chunk's valid length are 0).
    * o ``[B, T, Hv, V]`` q's dtype.
    * h ``[B, NT, Hv, K, V]`` compute dtype, chunk-start states (dense: NT =
      ceil(T / C) per row; varlen: B = 1 and all chunks of all sequences in order),
      or None unless ``output_h``.
    * final_state ``[N, Hv, K, V]`` compute dtype, or None unless ``output_final_state``.

    Padding tokens after ``cu_seqlens[-1]`` get zeros in g_cumsum, A and o.
    """
    B, T, _, K = q.shape
    Hv, V = v.shape[2], v.shape[3]
    C = chunk_size
    dtype = _compute_dtype(q.dtype)
    bounds = sequence_bounds(cu_seqlens, cu_seqlens_cpu)
    q_full, k_full = _expand_heads(q, Hv), _expand_heads(k, Hv)    # [B,T,Hv,K]

    g_cumsum = q.new_zeros(B, T, Hv, dtype=dtype)                   # [B,T,Hv]
    A = q.new_zeros(B, T, Hv, C, dtype=dtype)                       # [B,T,Hv,C]
    o = q.new_zeros(B, T, Hv, V, dtype=dtype)                       # [B,T,Hv,V]
    h, finals = [], []
    for item, (rows, bos, eos) in enumerate(_spans(B, T, bounds)):
        sl = _states_slice(bounds, item, B)
        n_rows = sl.stop - sl.start
        S0 = (q.new_zeros(n_rows, Hv, K, V, dtype=dtype) if initial_state is None
              else initial_state[sl].to(dtype))                     # [Bs,Hv,K,V]
        span = _fwd_span(
            _head_major(q_full, rows, bos, eos, dtype), _head_major(k_full, rows, bos, eos, dtype),
            _head_major(v, rows, bos, eos, dtype), _head_major(g, rows, bos, eos, dtype),
            _head_major(beta, rows, bos, eos, dtype), S0, scale, C)
        g_cumsum[rows, bos:eos] = span.gam.transpose(1, 2)          # [Bs,L,Hv]
        A[rows, bos:eos] = span.A.transpose(1, 2)                   # [Bs,L,Hv,C]
        o[rows, bos:eos] = span.o.transpose(1, 2)                   # [Bs,L,Hv,V]
        h.extend(span.h)
        finals.append(span.final_state)

    h_out = None
    if output_h:
        h_out = (torch.stack(h, dim=1) if h                         # [B,NT,Hv,K,V]
                 else q.new_zeros(B, 0, Hv, K, V, dtype=dtype))
    final_state = torch.cat(finals, dim=0) if output_final_state else None  # [N,Hv,K,V]
    return g_cumsum, A.to(q.dtype), o.to(q.dtype), h_out, final_state


# --------------------------------------------------------------------------------------
# One chunk, backward (gdn-math "Backward of one chunk")
# --------------------------------------------------------------------------------------

@dataclass
class _ChunkGrads:
    """Gradients of one chunk, head-major, w.r.t. the chunk inputs and its start state."""

    dq: Tensor     # [Bs,Hv,c,K]
    dk: Tensor     # [Bs,Hv,c,K]
    dv: Tensor     # [Bs,Hv,c,V]
    dbeta: Tensor  # [Bs,Hv,c]
    dg: Tensor     # [Bs,Hv,c]   w.r.t. the raw per-token gate
    dS0: Tensor    # [Bs,Hv,K,V]


def _rowdot(a: Tensor, b: Tensor) -> Tensor:
    """Row-wise dot product over the last dim: ``[..., c, D] x [..., c, D] -> [..., c]``."""
    return (a * b).sum(dim=-1)


def _inverse_backward(dGA: Tensor, f: _ChunkForward, A: Tensor, k: Tensor, beta: Tensor):
    """Through ``A = (I + N)^-1``, ``N = strictly_lower(diag(beta) K K^T)``.

    dGA ``[Bs, Hv, c, c]`` is the gradient w.r.t. ``G * A``. Returns
    ``(dk [Bs,Hv,c,K], dbeta [Bs,Hv,c])``::

        dN       = strictly_lower(-A^T (dGA * G) A^T)
        dbeta_i  = sum_j dN_ij (k_i . k_j)
        dK       = diag(beta) dN K + (diag(beta) dN)^T K
    """
    At = A.transpose(-1, -2)                                        # [Bs,Hv,c,c]
    dN = torch.tril(-(At @ (dGA * f.G) @ At), diagonal=-1)          # [Bs,Hv,c,c]
    kk = k @ k.transpose(-1, -2)                                    # [Bs,Hv,c,c]
    dbeta = (dN * kk).sum(dim=-1)                                   # [Bs,Hv,c]
    bdN = beta[..., None] * dN                                      # [Bs,Hv,c,c]
    dk = bdN @ k + bdN.transpose(-1, -2) @ k                        # [Bs,Hv,c,K]
    return dk, dbeta


def _gate_backward(dP: Tensor, dGA: Tensor, dO: Tensor, dX: Tensor, dS1: Tensor,
                   k: Tensor, A: Tensor, f: _ChunkForward, S0: Tensor, scale: float) -> Tensor:
    """Gradient w.r.t. the raw gate g of one chunk ``[Bs, Hv, c]``.

    First w.r.t. the chunk cumsum gam (gdn-math "Gate gradient")::

        dG      = dP * tril(Q K^T) + dGA * A
        dgam_i  = sum_j (dG*G)_ij - sum_j (dG*G)_ji
        dgam_i += exp(gam_i) (scale <dO_i, (Q S0)_i> - <dX_i, (K S0)_i>)
        dgam_i -= dD_i D_i,            dD_i = <(K dS1)_i, U_i>
        dgam_C += sum_i dD_i D_i + exp(gam_C) <S0, dS1>

    then ``dg = reverse cumsum of dgam`` inside the chunk.
    """
    dGG = (dP * f.QK + dGA * A) * f.G                               # [Bs,Hv,c,c]
    dgam = dGG.sum(dim=-1) - dGG.sum(dim=-2)                        # [Bs,Hv,c]
    dgam = dgam + f.E * (scale * _rowdot(dO, f.QS0) - _rowdot(dX, f.KS0))  # [Bs,Hv,c]
    dDD = _rowdot(k @ dS1, f.U) * f.D                               # [Bs,Hv,c]
    dgam = dgam - dDD                                               # [Bs,Hv,c]
    last = dDD.sum(dim=-1) + f.decay_C * (S0 * dS1).sum(dim=(-2, -1))  # [Bs,Hv]
    dgam[..., -1] += last
    return dgam.flip(-1).cumsum(dim=-1).flip(-1)                    # [Bs,Hv,c]


def _chunk_backward(q: Tensor, k: Tensor, beta: Tensor, A: Tensor, S0: Tensor,
                    f: _ChunkForward, dO: Tensor, dS1: Tensor, scale: float) -> _ChunkGrads:
    """Manual backward of one chunk (gdn-math "Backward of one chunk").

    q, k ``[Bs, Hv, c, K]``; beta ``[Bs, Hv, c]``; A ``[Bs, Hv, c, c]``;
    S0, dS1 ``[Bs, Hv, K, V]``; dO ``[Bs, Hv, c, V]``; f from :func:`_chunk_forward`::

        dU  = scale P^T dO + D K dS1          dP  = scale dO U^T
        dX  = Ag^T dU                         dAg = dU X^T
        dQ  = scale E dO S0^T + (dP * G) K
        dK  = (dP * G)^T Q + D U dS1^T - E dX S0^T  (+ inverse terms)
        dV  = dX
        dS0 = scale (E Q)^T dO + exp(gam_C) dS1 - (E K)^T dX
        dGA = dAg diag(beta),   dbeta_j = sum_i dAg_ij (G*A)_ij  (+ inverse term)
    """
    S0t, dS1t = S0.transpose(-1, -2), dS1.transpose(-1, -2)        # [Bs,Hv,V,K]
    E, D = f.E[..., None], f.D[..., None]                           # [Bs,Hv,c,1]
    dU = scale * f.P.transpose(-1, -2) @ dO + D * (k @ dS1)         # [Bs,Hv,c,V]
    dP = scale * dO @ f.U.transpose(-1, -2)                         # [Bs,Hv,c,c]
    dX = f.Ag.transpose(-1, -2) @ dU                                # [Bs,Hv,c,V]
    dAg = dU @ f.X.transpose(-1, -2)                                # [Bs,Hv,c,c]
    dPG = dP * f.G                                                  # [Bs,Hv,c,c]
    dq = scale * E * (dO @ S0t) + dPG @ k                           # [Bs,Hv,c,K]
    dk = dPG.transpose(-1, -2) @ q + D * (f.U @ dS1t) - E * (dX @ S0t)  # [Bs,Hv,c,K]
    dS0 = (scale * (E * q).transpose(-1, -2) @ dO                   # [Bs,Hv,K,V]
           + f.decay_C[..., None, None] * dS1
           - (E * k).transpose(-1, -2) @ dX)
    dGA = dAg * beta[..., None, :]                                  # [Bs,Hv,c,c]
    dbeta = (dAg * f.GA).sum(dim=-2)                                # [Bs,Hv,c]
    dk_inv, dbeta_inv = _inverse_backward(dGA, f, A, k, beta)
    dg = _gate_backward(dP, dGA, dO, dX, dS1, k, A, f, S0, scale)
    return _ChunkGrads(dq=dq, dk=dk + dk_inv, dv=dX, dbeta=dbeta + dbeta_inv, dg=dg, dS0=dS0)


# --------------------------------------------------------------------------------------
# Chunked backward
# --------------------------------------------------------------------------------------

@dataclass
class _SpanGrads:
    """Backward of one span (head-major)."""

    dq: Tensor     # [Bs,Hv,L,K]  per value head (GVA reduction done by the caller)
    dk: Tensor     # [Bs,Hv,L,K]
    dv: Tensor     # [Bs,Hv,L,V]
    dbeta: Tensor  # [Bs,Hv,L]
    dg: Tensor     # [Bs,Hv,L]
    dS0: Tensor    # [Bs,Hv,K,V]


def _bwd_span(q: Tensor, k: Tensor, v: Tensor, gam: Tensor, beta: Tensor, A: Tensor,
              do: Tensor, S: Tensor, dS: Tensor, scale: float, C: int) -> _SpanGrads:
    """Backward of one span: a forward sweep recomputing the chunk-start states, then a
    reverse sweep carrying dS (each chunk's dS0 is the previous chunk's dS1).

    q, k ``[Bs, Hv, L, K]``; v, do ``[Bs, Hv, L, V]``; gam, beta ``[Bs, Hv, L]``;
    A ``[Bs, Hv, L, C]``; S (initial state), dS (gradient of the final state)
    ``[Bs, Hv, K, V]``.
    """
    L = q.shape[2]
    chunks = [(s, min(s + C, L)) for s in _chunk_starts(L, C)]

    def forward_terms(s: int, e: int, S0: Tensor) -> _ChunkForward:
        return _chunk_forward(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], beta[:, :, s:e],
                              gam[:, :, s:e], A[:, :, s:e, :e - s], S0)

    starts = []                                                     # chunk-start states
    for s, e in chunks:
        starts.append(S)
        S = _chunk_next_state(k[:, :, s:e], forward_terms(s, e, S), S)

    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    dbeta, dg = torch.zeros_like(beta), torch.zeros_like(gam)
    for (s, e), S0 in zip(reversed(chunks), reversed(starts)):
        f = forward_terms(s, e, S0)
        grads = _chunk_backward(q[:, :, s:e], k[:, :, s:e], beta[:, :, s:e],
                                A[:, :, s:e, :e - s], S0, f, do[:, :, s:e], dS, scale)
        dq[:, :, s:e], dk[:, :, s:e], dv[:, :, s:e] = grads.dq, grads.dk, grads.dv
        dbeta[:, :, s:e], dg[:, :, s:e] = grads.dbeta, grads.dg
        dS = grads.dS0
    return _SpanGrads(dq=dq, dk=dk, dv=dv, dbeta=dbeta, dg=dg, dS0=dS)


def chunk_gated_delta_rule_bwd_torch(q: Tensor, k: Tensor, v: Tensor, g_cumsum: Tensor,
                                     beta: Tensor, A: Tensor, do: Tensor, *,
                                     dht: Tensor | None, scale: float,
                                     initial_state: Tensor | None,
                                     cu_seqlens: Tensor | None, cu_seqlens_cpu: Tensor | None,
                                     chunk_size: int = 64):
    """Manual chunked backward (gdn-math "Backward of one chunk"); ``Kernels.bwd``.

    Args:
        q, k: ``[B, T, Hk, K]``;  v, do: ``[B, T, Hv, V]``;  beta: ``[B, T, Hv]``.
        g_cumsum: ``[B, T, Hv]`` chunk-local gate cumsum from the forward.
        A: ``[B, T, Hv, C]`` gate-free inverse from the forward (used as given).
        dht: ``[N, Hv, K, V]`` gradient of the final state, or None (zero).
        scale, initial_state, cu_seqlens, cu_seqlens_cpu, chunk_size: as the forward.

    Not autograd: per chunk the forward products are recomputed from the chunk-start
    state and the closed-form adjoints are applied. With GVA, dq/dk are computed per
    value head and summed over the value heads sharing a q/k head.

    Returns ``(dq, dk, dv, dbeta, dg, dh0)``: dq/dk ``[B, T, Hk, K]`` and dv
    ``[B, T, Hv, V]`` in q/k/v's dtype; dbeta ``[B, T, Hv]`` in beta's dtype; dg
    ``[B, T, Hv]`` w.r.t. the raw per-token gate, in the compute dtype (fp32, or fp64
    for fp64 inputs); dh0 ``[N, Hv, K, V]`` compute dtype, or None when
    ``initial_state`` is None. Padding tokens after ``cu_seqlens[-1]`` get zeros.
    """
    B, T, Hk, K = q.shape
    Hv, V = v.shape[2], v.shape[3]
    C = chunk_size
    dtype = _compute_dtype(q.dtype)
    bounds = sequence_bounds(cu_seqlens, cu_seqlens_cpu)
    q_full, k_full = _expand_heads(q, Hv), _expand_heads(k, Hv)    # [B,T,Hv,K]

    dq = q.new_zeros(B, T, Hv, K, dtype=dtype)                      # [B,T,Hv,K]
    dk = q.new_zeros(B, T, Hv, K, dtype=dtype)                      # [B,T,Hv,K]
    dv = q.new_zeros(B, T, Hv, V, dtype=dtype)                      # [B,T,Hv,V]
    dbeta = q.new_zeros(B, T, Hv, dtype=dtype)                      # [B,T,Hv]
    dg = q.new_zeros(B, T, Hv, dtype=dtype)                         # [B,T,Hv]
    dh0 = []
    for item, (rows, bos, eos) in enumerate(_spans(B, T, bounds)):
        sl = _states_slice(bounds, item, B)
        n_rows = sl.stop - sl.start
        zeros = q.new_zeros(n_rows, Hv, K, V, dtype=dtype)          # [Bs,Hv,K,V]
        S0 = zeros if initial_state is None else initial_state[sl].to(dtype)
        dS = zeros if dht is None else dht[sl].to(dtype)
        span = _bwd_span(
            _head_major(q_full, rows, bos, eos, dtype), _head_major(k_full, rows, bos, eos, dtype),
            _head_major(v, rows, bos, eos, dtype), _head_major(g_cumsum, rows, bos, eos, dtype),
            _head_major(beta, rows, bos, eos, dtype), _head_major(A, rows, bos, eos, dtype),
            _head_major(do, rows, bos, eos, dtype), S0, dS, scale, C)
        dq[rows, bos:eos] = span.dq.transpose(1, 2)                 # [Bs,L,Hv,K]
        dk[rows, bos:eos] = span.dk.transpose(1, 2)                 # [Bs,L,Hv,K]
        dv[rows, bos:eos] = span.dv.transpose(1, 2)                 # [Bs,L,Hv,V]
        dbeta[rows, bos:eos] = span.dbeta.transpose(1, 2)           # [Bs,L,Hv]
        dg[rows, bos:eos] = span.dg.transpose(1, 2)                 # [Bs,L,Hv]
        dh0.append(span.dS0)

    dh0_out = torch.cat(dh0, dim=0) if initial_state is not None else None  # [N,Hv,K,V]
    return (_reduce_heads(dq, Hk).to(q.dtype), _reduce_heads(dk, Hk).to(k.dtype),
            dv.to(v.dtype), dbeta.to(beta.dtype), dg, dh0_out)


# --------------------------------------------------------------------------------------
# The ``torch`` backend
# --------------------------------------------------------------------------------------

class _TorchKernels:
    """:class:`flash_qla.backend.Kernels` implemented by the reference above (C = 64)."""

    chunk_size = 64

    def fwd(self, q, k, v, g, beta, *, scale: float, initial_state, cu_seqlens,
            cu_seqlens_cpu, output_final_state: bool, output_h: bool):
        """See ``Kernels.fwd`` and :func:`chunk_gated_delta_rule_fwd_torch`."""
        return chunk_gated_delta_rule_fwd_torch(
            q, k, v, g, beta, scale=scale, initial_state=initial_state,
            cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
            output_final_state=output_final_state, output_h=output_h,
            chunk_size=self.chunk_size)

    def fwd_pool(self, q, k, v, g, beta, *, scale: float, pool, state_indices,
                 v_first: bool, cu_seqlens, cu_seqlens_cpu):
        """See ``Kernels.fwd_pool`` (:mod:`flash_qla.state_pool`): the pool's rows
        gathered, :meth:`fwd`, and the final states scattered back in the pool's dtype
        (the semantics the kernels' in-place version is checked against)."""
        from flash_qla.state_pool import gather_states, scatter_states  # lazily: cycle

        h0 = gather_states(pool, state_indices, v_first=v_first, dtype=_compute_dtype(q.dtype))
        _, _, o, _, final = self.fwd(q, k, v, g, beta, scale=scale, initial_state=h0,
                                     cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
                                     output_final_state=True, output_h=False)
        scatter_states(pool, state_indices, final, v_first=v_first)
        return o

    def fwd_warmup(self, q, k, v, g, beta, *, scale: float, initial_state, cu_seqlens,
                   cu_seqlens_cpu, starts):
        """See ``Kernels.fwd_warmup`` (the bounded segment split): every (segment,
        value head) run as its own sequence from its walk start, one reference call per
        pair (slow; the semantics the kernels are checked against). Inputs ``[B, T,
        ...]`` taken as ``B * T`` packed tokens; ``cu_seqlens`` the segments."""
        B, T = q.shape[:2]
        if B != 1:                                  # packed [1, B T] views, and back
            g_cumsum, A, o, final = self.fwd_warmup(
                *(x.reshape(1, B * T, *x.shape[2:]) for x in (q, k, v, g, beta)),
                scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens,
                cu_seqlens_cpu=cu_seqlens_cpu, starts=starts)
            return (g_cumsum.view(B, T, *g_cumsum.shape[2:]), A.view(B, T, *A.shape[2:]),
                    o.view(B, T, *o.shape[2:]), final)
        g_cumsum, A = self.fwd(q, k, v, g, beta, scale=scale, initial_state=None,
                               cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
                               output_final_state=False, output_h=False)[:2]
        walk, h0_from = (x.tolist() for x in starts(g_cumsum))       # [Nseg][Hv] each
        bounds = sequence_bounds(cu_seqlens, cu_seqlens_cpu)
        Hk, (Hv, V) = q.shape[2], v.shape[2:]
        o = torch.zeros_like(v)                                      # [1,T,Hv,V]
        final = torch.zeros(len(walk), Hv, q.shape[3], V, dtype=g_cumsum.dtype,
                            device=q.device)                         # [Nseg,Hv,K,V]
        for n, (bos, eos) in enumerate(zip(bounds[:-1], bounds[1:])):
            for h in range(Hv):
                w, hk, src = walk[n][h], h // (Hv // Hk), h0_from[n][h]
                one = slice(w, eos)
                h0 = (initial_state[src, h:h + 1][None]
                      if initial_state is not None and src >= 0 else None)
                _, _, o_nh, _, final_nh = self.fwd(
                    q[:, one, hk:hk + 1], k[:, one, hk:hk + 1], v[:, one, h:h + 1],
                    g[:, one, h:h + 1], beta[:, one, h:h + 1], scale=scale,
                    initial_state=h0, cu_seqlens=None, cu_seqlens_cpu=None,
                    output_final_state=True, output_h=False)
                o[:, bos:eos, h] = o_nh[:, bos - w:, 0]
                final[n, h] = final_nh[0, 0]
        return g_cumsum, A, o, final

    def bwd(self, q, k, v, g_cumsum, beta, A, do, *, dht, scale: float,
            initial_state, cu_seqlens, cu_seqlens_cpu):
        """See ``Kernels.bwd`` and :func:`chunk_gated_delta_rule_bwd_torch`."""
        return chunk_gated_delta_rule_bwd_torch(
            q, k, v, g_cumsum, beta, A, do, dht=dht, scale=scale,
            initial_state=initial_state, cu_seqlens=cu_seqlens,
            cu_seqlens_cpu=cu_seqlens_cpu, chunk_size=self.chunk_size)


#: The ``torch`` backend's kernels (any device, any dtype; slow, exact).
TORCH_KERNELS = _TorchKernels()
