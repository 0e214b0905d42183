"""Forward of the TileLang backends (every host function takes the :class:`Arch` its
kernels are built for): the prepare kernel (gate cumsum + per-chunk inverse),
then the recurrence kernel (chunk states, output, final state). Shapes follow
``flash_qla.backend.Kernels.fwd``; :func:`state_output` also serves the backward's
recompute of h."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from flash_qla.offsets import KeptPlans
from flash_qla.utils import cast

from . import layout as chunk_layout
from . import plan
from .arch import Arch
from .kernels import chunk_fwd_ws_kernel, chunk_prepare_kernel
from .kernels.traits import CHUNK
from .launch import launcher
from .layout import (
    DTYPE_NAMES,
    POOL_DTYPE_NAMES,
    ChunkLayout,
    chunks_known,
    cta_order,
    layout_for,
    no_h,
    output_alloc,
    packed,
    state_rows,
    static_flags,
    total_chunks,
    walk_args,
)


class LaunchPlan(NamedTuple):
    """What a call's launches need besides its tensors, the same for every call of one
    signature and offsets tensors (:func:`launch_plan`)."""
    layout: ChunkLayout
    alloc: Callable                      # layout.output_alloc's allocator
    num_chunks: int | None               # layout.total_chunks where it needs no host sync
    order: tuple                         # the launches' last two arguments (cta_order)

    def chunks(self) -> int:
        """Rows of a per-chunk buffer (h, dS1): :func:`layout.total_chunks`, read from
        the device (one sync) where the plan could not count them."""
        return self.num_chunks if self.num_chunks is not None else total_chunks(self.layout,
                                                                                None)


#: Launch plans of eager calls (:func:`launch_plan`): a training step plans its forward
#: and backward with the same offsets, and a model's layers repeat them.
_PLANS = KeptPlans(64)


def launch_plan(arch: Arch, q, Hv: int, cu_seqlens, cu_seqlens_cpu, *,
                static: bool = False) -> LaunchPlan:
    """The chunk layout, output allocator, chunk count and CTA order of a call on ``q``
    ``[B, T, Hk, K]`` with ``Hv`` value heads (:func:`layout.layout_for`,
    ``output_alloc``, ``total_chunks``, ``cta_order``), kept per (arch, shapes, device,
    offsets tensors by identity and version). Built afresh inside a CUDA-graph capture
    (the layout is the graph's) and for offsets without a version counter, as
    ``layout_for`` builds them."""
    B, T = q.shape[:2]
    # the layout module's view of a capture (the layout is built by its rules)
    capturing = chunk_layout.is_capturing(q.device)
    key = None if capturing else _PLANS.key((arch, B, T, Hv, q.device, static),
                                            (cu_seqlens, cu_seqlens_cpu))
    plan_ = _PLANS.get(key, (cu_seqlens, cu_seqlens_cpu))
    if plan_ is None:
        layout = layout_for(q, cu_seqlens, arch, static)
        counted = capturing or chunks_known(layout, cu_seqlens_cpu)    # no sync
        plan_ = LaunchPlan(layout, output_alloc(layout, cu_seqlens_cpu, B * T, arch=arch),
                           total_chunks(layout, cu_seqlens_cpu) if counted else None,
                           # the caller's offsets tensor (not the layout's int32 copy,
                           # new in every call): inside a capture, the copy an eager call
                           # kept of it gives the order
                           cta_order(arch, cu_seqlens_cpu, Hv, q.device, cu_seqlens))
        _PLANS.keep(key, (cu_seqlens, cu_seqlens_cpu), plan_)
    return plan_


def state_output(q, k, v, g_cumsum, beta, A, layout: ChunkLayout, *, arch: Arch, scale,
                 initial_state, num_chunks: int | None, alloc, walks=None,
                 h_in_dtype: bool = False, states_only: bool = False, order: tuple):
    """Run the recurrence kernel (``chunk_fwd_ws_kernel`` built for ``arch``) on packed
    inputs.

    q, k ``[Tt, Hk, K]``; v ``[Tt, Hv, V]``; g_cumsum, beta ``[Tt, Hv]`` fp32;
    A ``[Tt, Hv, C]``. ``num_chunks`` given: also return the chunk-start states h
    ``[NT, Hv, K, V]`` fp32, or (``h_in_dtype``, the backward's states) in q's dtype
    ``[NT * state_rows(arch), Hv, K, V]``, one row per sub-chunk. ``walks``: the bounded
    split's walk rule (``flash_qla.segments.WalkStarts``), which the kernel searches
    itself (the sequences of ``layout`` are the segments). ``states_only`` (the
    backward's recompute of h): o is neither computed nor written (left as allocated).
    ``order``: the launch's CTA order arguments (:func:`layout.cta_order`, kept in
    :class:`LaunchPlan`), the longest sequence first where the host offsets are known.
    Returns ``(o [Tt, Hv, V], final_state [N, Hv, K, V], h)``.
    """
    Tt, Hk, K = q.shape
    Hv, V = v.shape[1:]
    o = alloc(Tt, Hv, V, dtype=q.dtype, device=q.device)
    final_state = torch.empty(layout.num_seqs, Hv, K, V, dtype=torch.float32, device=q.device)
    has_h0 = initial_state is not None
    h0 = initial_state.contiguous() if has_h0 else final_state   # unread when not has_h0
    store_h = num_chunks is not None
    rows = num_chunks * state_rows(arch) if store_h and h_in_dtype else num_chunks
    # at least one row: h in q's dtype leaves by TMA, whose descriptor needs every
    # dimension >= 1 (a varlen batch of empty sequences has no chunk); the extra row is
    # never written, the caller gets the first ``rows``
    h = (torch.empty(max(rows, 1), Hv, K, V, dtype=q.dtype if h_in_dtype else torch.float32,
                     device=q.device)
         if store_h else no_h(q.device, Hv, K, V))
    kernel = launcher(chunk_fwd_ws_kernel, arch, DTYPE_NAMES[q.dtype], K, V, has_h0, store_h,
                      *static_flags(walks is not None, h_in_dtype and store_h,
                                    states_only and store_h))
    kernel(q, k, v, g_cumsum, beta, A, layout.cu_seqlens, layout.chunk_offsets,
           h0, float(scale), o, final_state, h, *walk_args(walks, q.device),
           *order)
    if not store_h:
        return o, final_state, None
    return o, final_state, (h if rows else h[:0])      # a slice is an op: only when needed


def _outputs(q, k_p, v, g_cumsum_p, beta_p, A_p, plan_: LaunchPlan, *, arch: Arch, scale,
             initial_state, cu_seqlens_cpu, output_final_state, output_h, keep_states=False):
    """:func:`state_output` on the packed k, g_cumsum, beta, A, returning ``(o, h,
    final_state)`` in the layout of ``Kernels.fwd`` (o ``[B, T, Hv, V]``; dense h
    ``[B, NT/B, ...]`` fp32). ``keep_states`` (without ``output_h``): h's place holds the
    chunk states the backward reads, ``[NT, Hv, K, V]`` in q's dtype, where
    :func:`plan.keep_states`, else None."""
    B, T, _, K = q.shape
    Hv, V = v.shape[2:]
    keep = keep_states and not output_h and plan.keep_states(plan_.layout, cu_seqlens_cpu,
                                                             bound_ok=True).value
    o, final_state, h = state_output(
        packed(q), k_p, packed(v), g_cumsum_p, beta_p, A_p, plan_.layout, arch=arch,
        scale=scale, initial_state=initial_state, alloc=plan_.alloc, h_in_dtype=keep,
        num_chunks=plan_.chunks() if output_h or keep else None, order=plan_.order)
    if output_h:
        h = h.view(B, -1, Hv, K, V)
    return o.view(B, T, Hv, V), h, final_state if output_final_state else None


def _prepare(arch: Arch, plan_: LaunchPlan, q, k, g, beta):
    """The prepare kernel on the call's layout (:class:`LaunchPlan`): returns ``(k_p
    [Tt, Hk, K], beta_p [Tt, Hv] fp32, g_cumsum [Tt, Hv] fp32, A [Tt, Hv, C])`` (packed)
    for the recurrence. beta in q's dtype is read as it is and converted by the kernel,
    which writes beta_p (no conversion launch before it: ``TileLangKernels.
    fwd_converts_beta``); any other dtype is converted here."""
    k_p, beta_in = packed(k), packed(beta)                       # [Tt, Hk, K], [Tt, Hv]
    Tt, Hv = beta_in.shape
    g_cumsum = plan_.alloc(Tt, Hv, dtype=torch.float32, device=k_p.device)
    A = plan_.alloc(Tt, Hv, CHUNK, dtype=k_p.dtype, device=k_p.device)
    if beta_in.dtype == k_p.dtype and beta_in.dtype != torch.float32:
        beta_p = plan_.alloc(Tt, Hv, dtype=torch.float32, device=k_p.device)
        statics, outs = (DTYPE_NAMES[beta_in.dtype],), (beta_p,)   # the kernel converts
    else:
        beta_in = beta_p = cast(beta_in, torch.float32)          # no copy when fp32
        statics, outs = (), ()
    launcher(chunk_prepare_kernel, arch, DTYPE_NAMES[k_p.dtype], k_p.shape[-1], *statics)(
        k_p, packed(g, torch.float32), beta_in, plan_.layout.cu_seqlens,
        plan_.layout.chunk_idx, g_cumsum, A, *outs)
    return k_p, beta_p, g_cumsum, A


def chunk_fwd(q, k, v, g, beta, *, arch: Arch, scale, initial_state, cu_seqlens,
              cu_seqlens_cpu, output_final_state, output_h, keep_states=False):
    """``Kernels.fwd``: returns (g_cumsum, A, o, h, final_state); with ``keep_states``,
    h's place holds the states the backward reads, or None (:func:`plan.keep_states`)."""
    B, T = q.shape[:2]
    Hv = v.shape[2]
    plan_ = launch_plan(arch, q, v.shape[2], cu_seqlens, cu_seqlens_cpu)
    k_p, beta_p, g_cumsum, A = _prepare(arch, plan_, q, k, g, beta)
    o, h, final_state = _outputs(
        q, k_p, v, g_cumsum, beta_p, A, plan_, arch=arch, scale=scale,
        initial_state=initial_state, cu_seqlens_cpu=cu_seqlens_cpu,
        output_final_state=output_final_state, output_h=output_h, keep_states=keep_states)
    return g_cumsum.view(B, T, Hv), A.view(B, T, Hv, CHUNK), o, h, final_state


def pool_fwd(q, k, v, g, beta, *, arch: Arch, scale, pool, state_indices, v_first,
             cu_seqlens, cu_seqlens_cpu):
    """``Kernels.fwd_pool``: the inference forward reading each sequence's initial state
    from an engine's state pool and writing its final state back there, in place, inside
    ``chunk_fwd_ws`` (no gather or scatter pass). pool ``[P, Hv, K, V]`` (``v_first``:
    ``[P, Hv, V, K]``) contiguous, fp32 / bf16 / fp16; state_indices ``[N]`` int32 / int64
    on the device (negative: zero start, nothing written; nothing read on the host, so a
    CUDA graph may capture the call). Returns o ``[B, T, Hv, V]``."""
    B, T = q.shape[:2]
    Hv, V = v.shape[2:]
    K = q.shape[3]
    plan_ = launch_plan(arch, q, Hv, cu_seqlens, cu_seqlens_cpu)
    k_p, beta_p, g_cumsum, A = _prepare(arch, plan_, q, k, g, beta)
    o = plan_.alloc(B * T, Hv, V, dtype=q.dtype, device=q.device)
    slots = state_indices.to(torch.int32)           # no copy when already int32
    kernel = launcher(chunk_fwd_ws_kernel, arch, DTYPE_NAMES[q.dtype], K, V, True, False,
                      False, False, False, POOL_DTYPE_NAMES[pool.dtype], v_first)
    kernel(packed(q), k_p, packed(v), g_cumsum, beta_p, A, plan_.layout.cu_seqlens,
           plan_.layout.chunk_offsets, pool, float(scale), o, pool, no_h(q.device, Hv, K, V),
           slots, slots, 0.0,                      # seq_start (unread) shares NW = N
           *plan_.order)
    return o.view(B, T, Hv, V)


def prepared_fwd(q, k, v, g_cumsum, beta, A, *, arch: Arch, scale, initial_state, cu_seqlens,
                 cu_seqlens_cpu, output_final_state, output_h):
    """``Kernels.fwd_prepared``: the recurrence alone, from a prepare's outputs
    (g_cumsum ``[B,T,Hv]`` fp32 and A ``[B,T,Hv,C]`` as :func:`chunk_fwd` returned them
    for the same tokens and chunk boundaries; the exact segment split's passes).
    Returns (o, h, final_state)."""
    return _outputs(
        q, packed(k), v, packed(g_cumsum, torch.float32), packed(beta, torch.float32),
        packed(A), launch_plan(arch, q, v.shape[2], cu_seqlens, cu_seqlens_cpu),
        arch=arch, scale=scale, initial_state=initial_state, cu_seqlens_cpu=cu_seqlens_cpu,
        output_final_state=output_final_state, output_h=output_h)


def warmup_fwd(q, k, v, g, beta, *, arch: Arch, scale, initial_state, cu_seqlens,
               cu_seqlens_cpu, starts, keep_states=False):
    """``Kernels.fwd_warmup``: the bounded segment split in one pass
    (``flash_qla.segments.warmup_fwd``). ``cu_seqlens`` / ``cu_seqlens_cpu`` hold the
    segments (``[Nseg + 1]``); ``starts`` is the walk rule
    (``flash_qla.segments.WalkStarts``), searched by the kernel. Returns ``(g_cumsum
    [B,T,Hv], A [B,T,Hv,C], o [B,T,Hv,V], final_state [Nseg,Hv,K,V])``, the final state
    of every segment; with ``keep_states`` (``Kernels.keeps_states``) also the chunk
    states ``chunk_bwd_warmup`` reads (``[NT, Hv, K, V]`` in q's dtype), or None where
    :func:`plan.keep_states` says no."""
    B, T = q.shape[:2]
    Hv, V = v.shape[2:]
    plan_ = launch_plan(arch, q, Hv, cu_seqlens, cu_seqlens_cpu, static=True)
    k_p, beta_p, g_cumsum, A = _prepare(arch, plan_, q, k, g, beta)
    keep = keep_states and plan.keep_states(plan_.layout, cu_seqlens_cpu).value
    o, final_state, h = state_output(
        packed(q), k_p, packed(v), g_cumsum, beta_p, A, plan_.layout, arch=arch, scale=scale,
        initial_state=initial_state, alloc=plan_.alloc, walks=starts,
        num_chunks=plan_.chunks() if keep else None, h_in_dtype=keep, order=plan_.order)
    outs = (g_cumsum.view(B, T, Hv), A.view(B, T, Hv, CHUNK), o.view(B, T, Hv, V),
            final_state)
    return (*outs, h) if keep_states else outs
