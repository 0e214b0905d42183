"""Backward orchestrator of the Hopper backend (shapes: ``flash_qla.backend.Kernels.bwd``).

1. ``chunk_fwd`` recomputes the chunk-start states h from the saved g_cumsum and A,
   unless the training forward kept them (``states``: ``Kernels.keeps_states``);
2. where :func:`fused_pays`, ``chunk_bwd_fused`` walks each sequence (or segment)
   backwards and computes the state gradient and every per-chunk gradient in one CTA
   (a segment's starting dS from ``chunk_bwd_dh_ws`` over its warm-up chunks only);
3. otherwise the state gradient at every chunk end, dS1, comes from the reverse sweep:
   the ``chunk_bwd_dh_ws`` kernel (``chunk_bwd_dh`` with ``traits.BWD_DH_AUX_WARPGROUP``
   off) when ``traits.BWD_DH_KERNEL`` is on, else the core's batched PyTorch sweep;
   then every per-chunk gradient runs chunk-parallel: the ``chunk_bwd_intra`` kernel
   when ``traits.BWD_INTRA_KERNEL`` is on (with the dh kernel), else PyTorch
   (``flash_qla.chunk_parallel``).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from flash_qla.chunk_parallel import chunk_gated_delta_rule_bwd_parallel

from . import traits
from .chunk_bwd_dh import chunk_bwd_dh_kernel
from .chunk_bwd_dh_ws import chunk_bwd_dh_ws_kernel
from .chunk_layout import ChunkLayout
from .forward import (
    _DTYPE_NAMES,
    _fused,
    _packed,
    _sm_count,
    _walk_args,
    fused_plan,
    fused_tiling,
    host_chunks,
    layout_for,
    static_flags,
    total_chunks,
)
from .launch import launcher


def _kept(states: torch.Tensor | None, dtype: torch.dtype | None) -> torch.Tensor | None:
    """The forward's kept chunk states if they are in the dtype this backward reads h in
    (a bounded forward's, replayed by the unsplit backward inside a CUDA-graph capture,
    may not be; ``dtype`` None: any, for the fused path, which converts them), else None:
    recompute."""
    return states if states is not None and dtype in (None, states.dtype) else None


def _fp32_beta(backward):
    """Run ``backward`` on fp32 beta (``[B, T, Hv]``; a no-op for the autograd Function,
    which hands it fp32 beta already: ``Kernels.beta_dtype``) and return dbeta in the
    caller's beta dtype (the low-level ``chunk_gated_delta_rule_bwd`` contract; the
    PyTorch fallback reads beta in fp32 too)."""
    @functools.wraps(backward)
    def run(q, k, v, g_cumsum, beta, *args, **kwargs):
        dq, dk, dv, dbeta, dg, dh0 = backward(q, k, v, g_cumsum, beta.float(), *args, **kwargs)
        return dq, dk, dv, dbeta.to(beta.dtype), dg, dh0
    return run


class Packed(NamedTuple):
    """A backward's inputs as its kernels read them, made once per backward (each of its
    three launches reads them; packing costs host time per tensor): ``[Tt, ...]``
    contiguous (Tt = B T), g_cumsum and beta fp32, and the call's chunk layout."""
    q: torch.Tensor                      # [Tt, Hk, K]
    k: torch.Tensor                      # [Tt, Hk, K]
    v: torch.Tensor | None               # [Tt, Hv, V]
    g_cumsum: torch.Tensor               # [Tt, Hv] fp32
    beta: torch.Tensor                   # [Tt, Hv] fp32
    A: torch.Tensor                      # [Tt, Hv, C]
    do: torch.Tensor | None              # [Tt, Hv, V]
    layout: ChunkLayout


def pack(q, k, v, g_cumsum, beta, A, do, cu_seqlens, static: bool = False) -> Packed:
    """:class:`Packed` from ``Kernels.bwd``'s ``[B, T, ...]`` tensors (``v`` or ``do``
    None: a launch that does not read it). ``static``: ``cu_seqlens`` never changes
    (``forward.layout_for``)."""
    return Packed(_packed(q), _packed(k), None if v is None else _packed(v),
                  _packed(g_cumsum, torch.float32), _packed(beta, torch.float32), _packed(A),
                  None if do is None else _packed(do), layout_for(q, cu_seqlens, static))


def chunk_states(q, k, v, g_cumsum, beta, A, *, scale, initial_state, cu_seqlens,
                 cu_seqlens_cpu, packed: Packed | None = None, h_in_dtype: bool = False):
    """Chunk-start states h ``[NT, Hv, K, V]`` fp32 (q's dtype with ``h_in_dtype``, where
    :func:`states_in_dtype` says so) from the forward's saved g_cumsum and A (the fused
    kernel alone; ``chunk_fwd_ws`` skips o, the others compute and drop it). ``packed``:
    the same inputs already packed (:func:`pack`)."""
    p = packed or pack(q, k, v, g_cumsum, beta, A, None, cu_seqlens)
    return _fused(p.q, p.k, p.v, p.g_cumsum, p.beta, p.A, p.layout, scale=scale,
                  initial_state=initial_state, alloc=torch.empty,
                  num_chunks=total_chunks(p.layout, cu_seqlens_cpu), h_in_dtype=h_in_dtype,
                  states_only=True)[2]


def states_in_dtype(layout: ChunkLayout, Hv: int, K: int, V: int, device) -> bool:
    """Whether the unsplit backward keeps h and dS1 in q's dtype
    (``traits.BWD_STATES_IN_DTYPE``): where ``chunk_fwd_ws`` recomputes h, the
    warp-specialised sweep writes dS1 and ``chunk_bwd_intra`` reads both (it rounds them
    to its GEMM operands anyway): half the state traffic."""
    return (traits.BWD_STATES_IN_DTYPE and traits.BWD_DH_KERNEL and traits.BWD_INTRA_KERNEL
            and dh_aux_warpgroup(K, V)
            and fused_plan(layout.num_seqs, Hv, K, V, _sm_count(device))[0] == "ws")


def walk_chunks(layout: ChunkLayout, cu_seqlens_cpu) -> tuple[int, int]:
    """``(longest, total)``: the chunks of the longest sequence (or segment) of a call and
    of all of them, without a host sync: exact for dense inputs and host offsets
    (``cu_seqlens_cpu``), else upper bounds from the token count (one sequence holding
    every token: the cost rule below then keeps the two kernels)."""
    if layout.num_chunks is not None:                        # dense: N equal sequences
        return layout.num_chunks // max(layout.num_seqs, 1), layout.num_chunks
    if cu_seqlens_cpu is not None:
        chunks = host_chunks(cu_seqlens_cpu)
        return max(chunks, default=0), sum(chunks)
    bound = layout.num_chunks_max - layout.num_seqs          # ceil(Tt / C)
    return bound, bound


def fused_pays(longest: int, total: int, Hv: int, K: int, V: int, sm_count: int) -> bool:
    """Whether the backward runs ``chunk_bwd_fused`` (``traits.BWD_FUSED``, K = V = 128)
    rather than ``chunk_bwd_dh_ws`` + ``chunk_bwd_intra`` for sequences (or segments)
    whose longest has ``longest`` chunks, ``total`` in all (:func:`walk_chunks`). Both
    the fused kernel and the sweep walk each (sequence, value head) in one CTA, so each
    takes its chunk step times the larger of the longest walk and the chunks per SM; the
    per-chunk kernel adds one CTA per (chunk, value head), one per SM at a time::

        fused_step * spread  <  sweep_step * spread + intra_cta * total * Hv / SMs,
        spread = max(longest, total * Hv / SMs)

    (``traits.BWD_FUSED_STEP_US``, ``BWD_SWEEP_STEP_US``, ``BWD_INTRA_CTA_US``). On the
    H200, with walks of equal length, the fused kernel wins from about 70 CTAs (the
    bounded split's segments at 16 heads, 8 x 4096 at 16 heads); one sequence at 16 heads,
    or one long sequence among many short ones, runs the two kernels."""
    if not traits.BWD_FUSED or not dh_aux_warpgroup(K, V) or total * Hv == 0:
        return False
    per_sm = total * Hv / sm_count
    spread = max(longest, per_sm)
    return (traits.BWD_FUSED_STEP_US * spread
            < traits.BWD_SWEEP_STEP_US * spread + traits.BWD_INTRA_CTA_US * per_sm)


def dh_aux_warpgroup(K: int, V: int) -> bool:
    """Whether the reverse sweep runs ``chunk_bwd_dh_ws`` (``traits.BWD_DH_AUX_WARPGROUP``,
    K = V = 128) rather than ``chunk_bwd_dh``."""
    return traits.BWD_DH_AUX_WARPGROUP and (K, V) == (128, 128)


def state_grads(q, k, do, g_cumsum, beta, A, *, scale, dht, cu_seqlens, cu_seqlens_cpu,
                ends=None, ds1_in_dtype: bool = False, boundary: bool = False,
                packed: Packed | None = None):
    """The reverse sweep on the GPU: ``(dS1 [NT, Hv, K, V], dh0 [N, Hv, K, V])`` fp32.
    With ``ends`` (``flash_qla.segments.WalkEnds``, ``cu_seqlens`` the segments): the
    bounded split's sweep (the sweep kernel with ``warmup``, which searches each walk's
    end itself), dh0 per segment. ``ds1_in_dtype`` stores dS1 in q's dtype instead of
    fp32 (the bounded sweep, or ``chunk_bwd_dh_ws``). The kernel: :func:`dh_aux_warpgroup`.
    ``packed``: the same inputs already packed (:func:`pack`). ``boundary`` (with
    ``ends``, ``chunk_bwd_dh_ws``): only the warm-up walks after each segment; returns
    ``(None, dS at each segment's end [N, Hv, K, V])``, the fused kernel's start states."""
    K, (Hv, V) = q.shape[-1], do.shape[2:]
    p = packed or pack(q, k, None, g_cumsum, beta, A, do, cu_seqlens)
    layout = p.layout
    warmup = ends is not None
    if ds1_in_dtype and not (warmup or dh_aux_warpgroup(K, V)):
        raise ValueError("ds1_in_dtype: only the bounded split's sweep (ends) and "
                         "chunk_bwd_dh_ws store dS1 in q's dtype")
    if boundary and (ds1_in_dtype or not (warmup and dh_aux_warpgroup(K, V))):
        raise ValueError("boundary: only the bounded split's chunk_bwd_dh_ws sweep (ends, "
                         "K = V = 128), dS1 not stored")
    NT = 0 if boundary else total_chunks(layout, cu_seqlens_cpu)
    # at least one row: dS1 in q's dtype leaves by TMA (every descriptor dimension >= 1;
    # a varlen batch of empty sequences has no chunk); the extra row is never written
    dS1 = torch.empty(max(NT, 1), Hv, K, V,
                      dtype=q.dtype if ds1_in_dtype else torch.float32, device=q.device)
    dh0 = torch.empty(layout.num_seqs, Hv, K, V, dtype=torch.float32, device=q.device)
    has_dht = dht is not None
    walks = _walk_args(ends, q.device)
    flags = static_flags(warmup, ds1_in_dtype, boundary)   # the shipped cache's exact keys
    if dh_aux_warpgroup(K, V):
        kernel = launcher(chunk_bwd_dh_ws_kernel, _DTYPE_NAMES[q.dtype], K, V, has_dht, *flags)
    else:
        # the forward's tiling rule, narrow or default (the sweep has no wide variant)
        tiling = fused_tiling(layout.num_seqs, Hv, V, _sm_count(q.device), wide=False)
        statics = (tiling[0] if tiling else traits.BLOCK_V, *flags) if warmup else tiling[:1]
        kernel = launcher(chunk_bwd_dh_kernel, _DTYPE_NAMES[q.dtype], K, V, has_dht, *statics)
    kernel(p.q, p.k, p.do, p.g_cumsum, p.beta, p.A, layout.cu_seqlens, layout.chunk_offsets,
           dht.contiguous() if has_dht else dh0, float(scale), dS1, dh0, *walks)
    return (None if boundary else dS1[:NT]), dh0


@_fp32_beta
def chunk_bwd_warmup(q, k, v, g_cumsum, beta, A, do, *, dht, scale, initial_state,
                     cu_seqlens, cu_seqlens_cpu, starts, ends, states=None):
    """``Kernels.bwd_warmup``: the backward of the bounded segment split
    (``flash_qla.segments.warmup_bwd``). ``cu_seqlens`` / ``cu_seqlens_cpu`` hold the
    segments; ``starts`` is the forward walks' rule (``flash_qla.segments.WalkStarts``,
    searched by the warm-up forward kernel), ``ends`` the reverse walks' rule
    (``flash_qla.segments.WalkEnds``, searched by the warm-up reverse sweep). The chunk
    states come from the warm-up forward (its own chunks per segment), dS1 from the
    warm-up reverse sweep (both in q's dtype when ``traits.BWD_STATES_IN_DTYPE``), then
    ``chunk_bwd_intra`` as in :func:`chunk_bwd`; or, where :func:`fused_pays`, the
    sweep over each segment's warm-up chunks only (dS at its end) and
    ``chunk_bwd_fused`` over the segment. ``states``: the chunk states the forward kept
    (``warmup_fwd(keep_states=True)``), read instead of recomputed.
    Returns ``(dq, dk, dv, dbeta, dg, dh0)`` with dh0 per segment ``[Nseg, Hv, K, V]``
    (None without an initial state)."""
    from .chunk_bwd_intra import chunk_grads

    common = dict(scale=scale, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu)
    p = pack(q, k, v, g_cumsum, beta, A, do, cu_seqlens, static=True)   # segment offsets
    fused = fused_pays(*walk_chunks(p.layout, cu_seqlens_cpu), v.shape[2], q.shape[-1],
                       v.shape[-1], _sm_count(q.device))
    h = _kept(states, None if fused else
              q.dtype if traits.BWD_STATES_IN_DTYPE else torch.float32)
    if h is None:
        _, _, h = _fused(
            p.q, p.k, p.v, p.g_cumsum, p.beta, p.A, p.layout, scale=scale,
            initial_state=initial_state, alloc=torch.empty,     # o: not computed
            num_chunks=total_chunks(p.layout, cu_seqlens_cpu), walks=starts,
            h_in_dtype=traits.BWD_STATES_IN_DTYPE, states_only=True)    # h [NT,Hv,K,V]
    if fused:
        from .chunk_bwd_fused import fused_grads

        _, ends_dS = state_grads(q, k, do, g_cumsum, beta, A, dht=dht, ends=ends,
                                 boundary=True, packed=p, **common)
        *grads, dh0 = fused_grads(q, k, v, g_cumsum, beta, A, do, h.to(q.dtype), dht=ends_dS,
                                  packed=p, **common)
        return (*grads, dh0 if initial_state is not None else None)
    dS1, dh0 = state_grads(q, k, do, g_cumsum, beta, A, dht=dht, ends=ends,
                           ds1_in_dtype=traits.BWD_STATES_IN_DTYPE, packed=p,
                           **common)
    grads = chunk_grads(q, k, v, g_cumsum, beta, A, do, h, dS1, packed=p, **common)
    return (*grads, dh0 if initial_state is not None else None)


@_fp32_beta
def chunk_bwd(q, k, v, g_cumsum, beta, A, do, *, dht, scale, initial_state, cu_seqlens,
              cu_seqlens_cpu, states=None, use_dh_kernel: bool | None = None,
              use_intra_kernel: bool | None = None):
    """Backward; returns (dq, dk, dv, dbeta, dg, dh0) (see Kernels.bwd): ``chunk_bwd_fused``
    where :func:`fused_pays`, else the sweep and the per-chunk kernel (module docstring).
    ``states``: the chunk states the forward kept (``chunk_fwd(keep_states=True)``),
    read instead of recomputed where they are in the dtype this backward reads h in (by
    the fused kernel in any dtype).
    ``use_dh_kernel`` / ``use_intra_kernel`` None follow ``traits.BWD_DH_KERNEL`` /
    ``traits.BWD_INTRA_KERNEL`` (read at every call)."""
    if use_dh_kernel is None:
        use_dh_kernel = traits.BWD_DH_KERNEL
    if use_intra_kernel is None:
        use_intra_kernel = traits.BWD_INTRA_KERNEL
    common = dict(scale=scale, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu)
    p = pack(q, k, v, g_cumsum, beta, A, do, cu_seqlens)
    in_dtype = (use_dh_kernel and use_intra_kernel
                and states_in_dtype(p.layout, v.shape[2], q.shape[-1], v.shape[-1], q.device))
    fused = use_dh_kernel and use_intra_kernel and fused_pays(
        *walk_chunks(p.layout, cu_seqlens_cpu), v.shape[2], q.shape[-1], v.shape[-1],
        _sm_count(q.device))
    h = _kept(states, None if fused else q.dtype if in_dtype else torch.float32)
    if h is None:
        h = chunk_states(q, k, v, g_cumsum, beta, A, initial_state=initial_state, packed=p,
                         h_in_dtype=in_dtype, **common)
    if fused:
        from .chunk_bwd_fused import fused_grads

        *grads, dh0 = fused_grads(q, k, v, g_cumsum, beta, A, do, h.to(q.dtype), dht=dht,
                                  packed=p, **common)
        return (*grads, dh0 if initial_state is not None else None)
    dS1 = dh0 = None
    if use_dh_kernel:
        dS1, dh0 = state_grads(q, k, do, g_cumsum, beta, A, dht=dht, packed=p,
                               ds1_in_dtype=in_dtype, **common)
        if use_intra_kernel:
            from .chunk_bwd_intra import chunk_grads

            grads = chunk_grads(q, k, v, g_cumsum, beta, A, do, h, dS1, packed=p, **common)
            return (*grads, dh0 if initial_state is not None else None)
    return chunk_gated_delta_rule_bwd_parallel(
        q, k, v, g_cumsum, beta, A, do, h, dht=dht, initial_state=initial_state,
        dS1=dS1, dh0=dh0, **common)
