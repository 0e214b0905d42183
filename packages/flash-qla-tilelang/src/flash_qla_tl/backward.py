"""Backward of the TileLang backends (shapes: ``flash_qla.backend.Kernels.bwd``; every
host function takes the :class:`Arch` its kernels are built for).

1. The chunk-start states h, in q's dtype: the ones the training forward kept
   (``states``: ``Kernels.keeps_states``), else recomputed by the forward's kernel
   (:func:`chunk_states`, o skipped);
2. where :func:`plan.fused_backward` says so, ``chunk_bwd_fused`` walks each sequence (or
   segment) backwards and computes the state gradient and every input gradient in one
   CTA (a segment's starting dS from the sweep over its warm-up chunks only);
3. otherwise the reverse sweep ``chunk_bwd_dh_ws`` stores the state gradient at every
   chunk end, dS1, in q's dtype (:func:`state_grads`), and ``chunk_bwd_intra`` computes
   every input gradient chunk-parallel (:func:`chunk_grads`);
4. under GVA, ``group_sum_kernel`` sums the per-value-head dq, dk of each q/k head.

This module imports the forward (for the recompute of h); the forward never imports it.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from flash_qla.offsets import kept_offsets
from flash_qla.utils import cast

from . import plan
from .arch import Arch
from .forward import LaunchPlan, launch_plan, state_output
from .kernels import (
    chunk_bwd_dh_ws_kernel,
    chunk_bwd_fused_kernel,
    chunk_bwd_intra_kernel,
    chunk_bwd_intra_split_kernel,
    group_sum_kernel,
)
from .launch import launcher
from .layout import (
    DTYPE_NAMES,
    ChunkLayout,
    packed,
    sm_count,
    state_rows,
    static_flags,
    walk_args,
)


def _fp32_beta(backward):
    """Run ``backward`` on fp32 beta (``[B, T, Hv]``; a no-op for the autograd Function,
    which hands it fp32 beta already: ``Kernels.beta_dtype``) and return dbeta in the
    caller's beta dtype (the low-level ``chunk_gated_delta_rule_bwd`` contract)."""
    @functools.wraps(backward)
    def run(q, k, v, g_cumsum, beta, *args, **kwargs):
        dq, dk, dv, dbeta, dg, dh0 = backward(q, k, v, g_cumsum, cast(beta, torch.float32),
                                              *args, **kwargs)
        return dq, dk, dv, cast(dbeta, beta.dtype), dg, dh0
    return run


class Packed(NamedTuple):
    """A backward's inputs as its kernels read them, made once per backward (each of its
    launches reads them; packing costs host time per tensor): ``[Tt, ...]`` contiguous
    (Tt = B T), g_cumsum and beta fp32, and the call's launch plan (chunk layout, output
    allocator, chunk count, CTA order)."""
    q: torch.Tensor                      # [Tt, Hk, K]
    k: torch.Tensor                      # [Tt, Hk, K]
    v: torch.Tensor | None               # [Tt, Hv, V]
    g_cumsum: torch.Tensor               # [Tt, Hv] fp32
    beta: torch.Tensor                   # [Tt, Hv] fp32
    A: torch.Tensor                      # [Tt, Hv, C]
    do: torch.Tensor | None              # [Tt, Hv, V]
    plan: LaunchPlan

    @property
    def layout(self) -> ChunkLayout:
        return self.plan.layout


def pack(q, k, v, g_cumsum, beta, A, do, cu_seqlens, *, arch: Arch, static: bool = False,
         cu_seqlens_cpu=None) -> Packed:
    """:class:`Packed` from ``Kernels.bwd``'s ``[B, T, ...]`` tensors (``v`` or ``do``
    None: a launch that does not read it); the layout built by ``arch``'s kernel.
    ``static``: ``cu_seqlens`` never changes (``layout.layout_for``); ``cu_seqlens_cpu``:
    its host copy, if known (``forward.launch_plan``)."""
    return Packed(packed(q), packed(k), None if v is None else packed(v),
                  packed(g_cumsum, torch.float32), packed(beta, torch.float32), packed(A),
                  None if do is None else packed(do),
                  launch_plan(arch, q, beta.shape[2], cu_seqlens, cu_seqlens_cpu,
                              static=static))


def chunk_states(q, k, v, g_cumsum, beta, A, *, arch: Arch, scale, initial_state, cu_seqlens,
                 cu_seqlens_cpu, packed: Packed | None = None, walks=None):
    """Chunk-start states h ``[NT, Hv, K, V]`` in q's dtype, recomputed from the
    forward's saved g_cumsum and A by the forward's kernel (o skipped). ``walks``: the
    bounded split's forward walk rule (``flash_qla.segments.WalkStarts``; ``cu_seqlens``
    the segments). ``packed``: the same inputs already packed (:func:`pack`)."""
    p = packed or pack(q, k, v, g_cumsum, beta, A, None, cu_seqlens, arch=arch,
                       cu_seqlens_cpu=cu_seqlens_cpu)
    return state_output(p.q, p.k, p.v, p.g_cumsum, p.beta, p.A, p.layout, arch=arch,
                        scale=scale, initial_state=initial_state, alloc=torch.empty,
                        num_chunks=p.plan.chunks(), walks=walks, h_in_dtype=True,
                        states_only=True, order=p.plan.order)[2]


def state_grads(q, k, do, g_cumsum, beta, A, *, arch: Arch, scale, dht, cu_seqlens,
                cu_seqlens_cpu, ends=None, boundary: bool = False,
                packed: Packed | None = None):
    """The reverse sweep (``chunk_bwd_dh_ws_kernel``): ``(dS1 [NT, Hv, K, V]`` in q's
    dtype, ``dh0 [N, Hv, K, V]`` fp32). With ``ends`` (``flash_qla.segments.WalkEnds``,
    ``cu_seqlens`` the segments): the bounded split's sweep, which searches each walk's
    end itself, dh0 per segment. ``boundary`` (with ``ends``): only the warm-up walks
    after each segment; returns ``(None, dS at each segment's end [N, Hv, K, V])``, the
    fused kernel's start states. ``packed``: the same inputs already packed
    (:func:`pack`)."""
    K, (Hv, V) = q.shape[-1], do.shape[2:]
    p = packed or pack(q, k, None, g_cumsum, beta, A, do, cu_seqlens, arch=arch,
                       cu_seqlens_cpu=cu_seqlens_cpu)
    layout = p.layout
    warmup = ends is not None
    if boundary and not warmup:
        raise ValueError("boundary: only the bounded split's sweep (ends) walks the "
                         "segments' warm-up chunks alone")
    NT = 0 if boundary else p.plan.chunks() * state_rows(arch)
    # at least one row: dS1 leaves by TMA (every descriptor dimension >= 1; a varlen
    # batch of empty sequences has no chunk); the extra row is never written
    # the boundary sweep stores no dS1: its variant takes an fp32 placeholder
    dS1 = torch.empty(max(NT, 1), Hv, K, V, dtype=torch.float32 if boundary else q.dtype,
                      device=q.device)
    dh0 = torch.empty(layout.num_seqs, Hv, K, V, dtype=torch.float32, device=q.device)
    has_dht = dht is not None
    kernel = launcher(chunk_bwd_dh_ws_kernel, arch, DTYPE_NAMES[q.dtype], K, V, has_dht,
                      *static_flags(warmup, not boundary, boundary))
    kernel(p.q, p.k, p.do, p.g_cumsum, p.beta, p.A, layout.cu_seqlens, layout.chunk_offsets,
           dht.contiguous() if has_dht else dh0, float(scale), dS1, dh0,
           *walk_args(ends, q.device), *p.plan.order)
    return (None if boundary else dS1[:NT]), dh0


def gradient_kernel(arch: Arch):
    """The per-chunk gradient kernel's builder on ``arch``: ``chunk_bwd_intra_kernel``
    (a state row per 64-token chunk), or ``chunk_bwd_intra_split_kernel`` where the
    states have a row per sub-chunk (``layout.state_rows``: SM120)."""
    return chunk_bwd_intra_kernel if state_rows(arch) == 1 else chunk_bwd_intra_split_kernel


def grad_buffers(q, v, alloc) -> tuple:
    """The outputs the gradient kernels write (``chunk_bwd_intra``, ``chunk_bwd_fused``)
    for ``Kernels.bwd``'s q ``[B, T, Hk, K]`` and v ``[B, T, Hv, V]``: dq, dk
    ``[G, Tt, Hk, K]`` per value head, group-major (hv = hk * G + g at ``[g, :, hk]``),
    dv ``[Tt, Hv, V]``, all in q's dtype; dbeta, dg ``[Tt, Hv]`` fp32. The rows of
    padding tokens (after ``cu_seqlens[-1]``: ``layout.output_alloc``) are zeroed: every
    row of a call without a chunk (all its sequences empty, so ``cu_seqlens[-1]`` is
    0), by ``alloc``, the call's ``layout.output_alloc`` (:class:`Packed`'s plan)."""
    B, T, Hk, K = q.shape
    Hv, V = v.shape[2:]
    Tt, dt = B * T, q.dtype
    G = Hv // Hk
    return (alloc(G, Tt, Hk, K, dtype=dt, device=q.device, token_dim=1),
            alloc(G, Tt, Hk, K, dtype=dt, device=q.device, token_dim=1),
            alloc(Tt, Hv, V, dtype=dt, device=q.device),
            alloc(Tt, Hv, dtype=torch.float32, device=q.device),
            alloc(Tt, Hv, dtype=torch.float32, device=q.device))


def sum_groups(dx: torch.Tensor, *, arch: Arch) -> torch.Tensor:
    """``[G, Tt, Hk, K]`` -> ``[Tt, Hk, K]`` in dx's dtype: the GVA sum over the value
    heads of each q/k head (``group_sum_kernel``: deterministic, accumulated in fp32)."""
    G, Tt, Hk, K = dx.shape
    if G == 1:
        return dx[0]
    if Tt * Hk == 0:
        return dx.sum(dim=0)
    out = torch.empty(Tt, Hk, K, dtype=dx.dtype, device=dx.device)
    launcher(group_sum_kernel, arch, DTYPE_NAMES[dx.dtype], K)(dx.view(G, Tt * Hk, K),
                                                                out.view(Tt * Hk, K))
    return out


def finish_grads(dq, dk, dv, dbeta, dg, q, k, v, beta, *, arch: Arch) -> tuple:
    """:func:`grad_buffers` filled by a kernel -> ``(dq, dk, dv, dbeta, dg)`` as
    ``Kernels.bwd`` returns them: the GVA sum of dq, dk (:func:`sum_groups`), ``[B, T,
    ...]`` views in the inputs' dtypes, dg fp32."""
    B, T, Hk, K = q.shape
    Hv, V = v.shape[2:]
    return (cast(sum_groups(dq, arch=arch).view(B, T, Hk, K), q.dtype),
            cast(sum_groups(dk, arch=arch).view(B, T, Hk, K), k.dtype),
            cast(dv.view(B, T, Hv, V), v.dtype),
            cast(dbeta.view(B, T, Hv), beta.dtype),
            dg.view(B, T, Hv))


def chunk_grads(q, k, v, g_cumsum, beta, A, do, h, dS1, *, arch: Arch, scale, cu_seqlens,
                cu_seqlens_cpu, packed: Packed | None = None):
    """Every input gradient, chunk-parallel (``chunk_bwd_intra_kernel``), given the chunk
    states.

    Args (``Kernels.bwd`` shapes): q, k ``[B, T, Hk, K]``; v, do ``[B, T, Hv, V]``;
    g_cumsum, beta ``[B, T, Hv]``; A ``[B, T, Hv, C]``; h (chunk-start states) and dS1
    (state gradient at each chunk's end) ``[NT * state_rows(arch), Hv, K, V]`` in chunk
    order (a row per sub-chunk on an arch with sub-chunks: ``chunk_bwd_intra_split``), in
    q's dtype (other dtypes are converted); cu_seqlens / cu_seqlens_cpu ``[N + 1]`` or None
    (dense); ``packed``: the same inputs already packed (:class:`Packed`; q, k, v, do, A
    in q's dtype).

    Returns ``(dq, dk, dv, dbeta, dg)`` like
    :func:`flash_qla.chunk_parallel.chunk_gated_delta_rule_bwd_parallel`: dq, dk
    ``[B, T, Hk, K]`` in q's / k's dtype; dv ``[B, T, Hv, V]`` in v's dtype; dbeta
    ``[B, T, Hv]`` in beta's dtype; dg ``[B, T, Hv]`` fp32. Padding tokens after
    ``cu_seqlens[-1]`` get zeros.
    """
    Hv, K, V = v.shape[2], q.shape[-1], v.shape[-1]
    dt = q.dtype
    p = packed or pack(q, k.to(dt), v.to(dt), g_cumsum, beta, A.to(dt), do.to(dt),
                       cu_seqlens, arch=arch, cu_seqlens_cpu=cu_seqlens_cpu)
    NT = h.numel() // (Hv * K * V)
    dq, dk, dv, dbeta, dg = grad_buffers(q, v, p.plan.alloc)
    if NT > 0:
        launcher(gradient_kernel(arch), arch, DTYPE_NAMES[dt], K, V)(
            p.q, p.k, p.v, p.do, p.g_cumsum, p.beta, p.A,
            h.reshape(NT, Hv, K, V).to(dt).contiguous(),
            dS1.reshape(NT, Hv, K, V).to(dt).contiguous(),
            p.layout.cu_seqlens, p.layout.chunk_offsets, p.layout.chunk_idx, float(scale),
            dq, dk, dv, dbeta, dg)
    return finish_grads(dq, dk, dv, dbeta, dg, q, k, v, beta, arch=arch)


def fused_grads(q, k, v, g_cumsum, beta, A, do, h, *, arch: Arch, dht, scale, cu_seqlens,
                cu_seqlens_cpu, packed: Packed | None = None):
    """The reverse sweep and every input gradient in one launch
    (``chunk_bwd_fused_kernel``), given the chunk-start states in q's dtype.

    Args (``Kernels.bwd`` shapes): q, k ``[B, T, Hk, K]``; v, do ``[B, T, Hv, V]``;
    g_cumsum, beta ``[B, T, Hv]``; A ``[B, T, Hv, C]``; h ``[NT, Hv, K, V]`` in q's dtype
    (chunk order); dht ``[N, Hv, K, V]`` fp32 or None; cu_seqlens / cu_seqlens_cpu
    ``[N + 1]`` or None (dense); ``packed``: the same inputs already packed
    (:class:`Packed`). K = V = 128.

    Returns ``(dq, dk, dv, dbeta, dg, dh0)`` as :func:`chunk_grads` plus dh0
    ``[N, Hv, K, V]`` fp32 (the state gradient at each sequence's start). Needs at least
    one token (the TMA descriptors need every dimension >= 1; the API runs a call without
    tokens on the ``torch`` backend); ``cu_seqlens_cpu`` may be None (no host sync).
    Raises ``ValueError`` if ``arch`` builds no fused kernel (``Arch.fused_backward``), h
    is not in q's dtype, K, V are not 128, or dht has fewer rows than there are
    sequences."""
    Hv, K, V = v.shape[2], q.shape[-1], v.shape[-1]
    if not arch.fused_backward:
        raise ValueError(f"fused_grads: {arch.name} builds no fused backward "
                         f"(Arch.fused_backward=False); use fused=False")
    if (K, V) != (128, 128):
        raise ValueError(f"fused_grads: K, V must be (128, 128), got {(K, V)}")
    if h.dtype != q.dtype:
        raise ValueError(f"fused_grads: h must be in q's dtype {q.dtype}, got {h.dtype}")
    dt = q.dtype
    p = packed or pack(q, k.to(dt), v.to(dt), g_cumsum, beta, A.to(dt), do.to(dt),
                       cu_seqlens, arch=arch, cu_seqlens_cpu=cu_seqlens_cpu)
    N = p.layout.num_seqs
    if dht is not None and dht.shape[0] < N:
        raise ValueError(f"fused_grads: dht needs a row per sequence, [{N}, Hv, K, V]; "
                         f"got {tuple(dht.shape)}")
    NT = h.numel() // (Hv * K * V)
    dq, dk, dv, dbeta, dg = grad_buffers(q, v, p.plan.alloc)
    dh0 = torch.empty(N, Hv, K, V, dtype=torch.float32, device=q.device)
    has_dht = dht is not None
    launcher(chunk_bwd_fused_kernel, arch, DTYPE_NAMES[dt], K, V, has_dht)(
        p.q, p.k, p.v, p.do, p.g_cumsum, p.beta, p.A,
        h.reshape(max(NT, 1), Hv, K, V) if NT else h.new_zeros(1, Hv, K, V),
        p.layout.cu_seqlens, p.layout.chunk_offsets,
        dht.contiguous() if has_dht else dh0, float(scale),
        dq, dk, dv, dbeta, dg, dh0, *p.plan.order)
    return (*finish_grads(dq, dk, dv, dbeta, dg, q, k, v, beta, arch=arch), dh0)


@_fp32_beta
def chunk_bwd(q, k, v, g_cumsum, beta, A, do, *, arch: Arch, dht, scale, initial_state,
              cu_seqlens, cu_seqlens_cpu, states=None, fused: bool | None = None):
    """``Kernels.bwd``: returns (dq, dk, dv, dbeta, dg, dh0), dh0 None without an initial
    state (module docstring). ``states``: the chunk states the forward kept
    (``chunk_fwd(keep_states=True)``), read instead of recomputed. ``fused``: the fused
    reverse kernel (True) or the two kernels (False); None: :func:`plan.fused_backward`
    decides, where ``arch.fused_backward`` allows the fused kernel."""
    common = dict(arch=arch, scale=scale, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu)
    p = pack(q, k, v, g_cumsum, beta, A, do, cu_seqlens, arch=arch,
             cu_seqlens_cpu=cu_seqlens_cpu)
    if fused is None:
        hint = None if cu_seqlens is None or cu_seqlens_cpu is not None else \
            kept_offsets(cu_seqlens)                   # a capture's eager warm-up, if any
        fused = arch.fused_backward and plan.fused_backward(
            p.layout, cu_seqlens_cpu, v.shape[2], sm_count(q.device), hint).value
    h = states if states is not None else chunk_states(
        q, k, v, g_cumsum, beta, A, initial_state=initial_state, packed=p, **common)
    if fused:
        *grads, dh0 = fused_grads(q, k, v, g_cumsum, beta, A, do, cast(h, q.dtype), dht=dht,
                                  packed=p, **common)
    else:
        dS1, dh0 = state_grads(q, k, do, g_cumsum, beta, A, dht=dht, packed=p, **common)
        grads = chunk_grads(q, k, v, g_cumsum, beta, A, do, h, dS1, packed=p, **common)
    return (*grads, dh0 if initial_state is not None else None)


@_fp32_beta
def chunk_bwd_warmup(q, k, v, g_cumsum, beta, A, do, *, arch: Arch, dht, scale,
                     initial_state, cu_seqlens, cu_seqlens_cpu, starts, ends, states=None,
                     fused: bool | None = None):
    """``Kernels.bwd_warmup``: the backward of the bounded segment split
    (``flash_qla.segments.warmup_bwd``). ``cu_seqlens`` / ``cu_seqlens_cpu`` hold the
    segments; ``starts`` is the forward walks' rule (``flash_qla.segments.WalkStarts``,
    searched by the forward kernel), ``ends`` the reverse walks' rule
    (``flash_qla.segments.WalkEnds``, searched by the sweep). The chunk states come from
    the warm-up forward (its own chunks per segment), or ``states``, the ones the forward
    kept (``warmup_fwd(keep_states=True)``); then as :func:`chunk_bwd`, with the
    bounded sweep (dS1 per segment), or, where fused, the sweep over each segment's
    warm-up chunks only (dS at its end) and ``chunk_bwd_fused`` over the segment.
    Returns ``(dq, dk, dv, dbeta, dg, dh0)`` with dh0 per segment ``[Nseg, Hv, K, V]``
    (None without an initial state)."""
    common = dict(arch=arch, scale=scale, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu)
    p = pack(q, k, v, g_cumsum, beta, A, do, cu_seqlens, arch=arch, static=True,
             cu_seqlens_cpu=cu_seqlens_cpu)                      # segment offsets
    if fused is None:
        fused = arch.fused_backward and plan.fused_backward(
            p.layout, cu_seqlens_cpu, v.shape[2], sm_count(q.device)).value
    h = states if states is not None else chunk_states(
        q, k, v, g_cumsum, beta, A, initial_state=initial_state, packed=p, walks=starts,
        **common)
    if fused:
        _, ends_dS = state_grads(q, k, do, g_cumsum, beta, A, dht=dht, ends=ends,
                                 boundary=True, packed=p, **common)
        *grads, dh0 = fused_grads(q, k, v, g_cumsum, beta, A, do, cast(h, q.dtype), dht=ends_dS,
                                  packed=p, **common)
    else:
        dS1, dh0 = state_grads(q, k, do, g_cumsum, beta, A, dht=dht, ends=ends, packed=p,
                               **common)
        grads = chunk_grads(q, k, v, g_cumsum, beta, A, do, h, dS1, packed=p, **common)
    return (*grads, dh0 if initial_state is not None else None)
