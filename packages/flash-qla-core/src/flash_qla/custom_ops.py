"""The custom ops under :func:`flash_qla.chunk_gated_delta_rule` when it is traced
(``torch.compile``, ``torch.export``): ``torch.ops.flash_qla.chunk_gdn_fwd`` and
``torch.ops.flash_qla.chunk_gdn_bwd``, each with its fake (shapes and dtypes only), the
forward's autograd formula calling the backward op.

A trace sees only what the public function does on tensor metadata (static checks,
pre-passes) and these two opaque ops; everything that reads tensor values or host
state runs inside them, at run time, as in an eager call: the host copy of
``cu_seqlens`` (:func:`flash_qla.offsets.host_offsets`) and the checks of its values,
the backend's choice (:mod:`flash_qla.dispatch`, which takes a lock on first use), the
segment split's plan, and the kernels. Their errors are the eager call's (same types and
messages), raised by the op before any kernel runs.

The ops take tensors and static scalars only (a backend by name, ``""`` for the
automatic choice; ``segment_len`` -1 for none) and return no None: an absent state is an
empty tensor. The forward returns, besides ``o`` and ``final_state``, what its backward
reads: the gate cumsum and A, so that a compiled graph saves them like any tensor.

Differences from the eager autograd Function, each costing a little on the compiled
path only:

* no chunk states are kept for the backward (``save_chunk_states``,
  ``Kernels.keeps_states``): how many a backend keeps depends on the lengths, and an
  output of data-dependent size breaks a graph unless ``fullgraph=True``; the backward
  recomputes them (FLA's way; on sm90 ~0.25 ms of a 1.6 ms backward at 8 x 4096 tokens);
* the backward makes its saved inputs contiguous and converts beta to the kernels'
  dtype again (the Function saves the forward's copies);
* it plans an automatic segment split again from the same lengths, where the backend
  has the bounded split's backward (the same plan, except where the forward ran inside
  a CUDA-graph capture and the backward does not).

Eager calls never take this path: through the op, an eager call would cost about
50 us more host time without autograd and 120 us more with it (CPU, kernels stubbed
out: 33 us and 55 us per dense call by the eager path).
"""

import functools

import torch
from torch import Tensor

from flash_qla import api, validation
from flash_qla.segments import CHUNK, uses_warmup, warmup_bwd

__all__ = ["chunk_gdn_bwd", "chunk_gdn_fwd"]


# --------------------------------------------------------------------------------------
# Shared by the ops: the backend, the host offsets, the split
# --------------------------------------------------------------------------------------

def _kernels_and_offsets(q, v, backend: str, cu_seqlens, cu_seqlens_cpu, *others,
                         check_values: bool):
    """``(kernels, cu_seqlens_cpu)`` of one op call: the host offsets as the eager call
    has them (the caller's, else one kept read of ``cu_seqlens``), their values checked
    with the eager call's messages when ``check_values``, then the backend by name (the
    automatic choice for ``""``, ``torch`` for a call without tokens)."""
    if cu_seqlens is not None:
        cu_seqlens_cpu, host_read = api._resolve_offsets(cu_seqlens, cu_seqlens_cpu, q)
        if check_values:
            validation.check_cu_seqlens(cu_seqlens, cu_seqlens_cpu, q, host_read=host_read)
    _, kernels = api._select_kernels(q, v, backend or None, *others)
    return kernels, cu_seqlens_cpu


def _segment_len(kernels, q, v, cu_seqlens, cu_seqlens_cpu, segment_len: int,
                 auto_segment: bool, shortcut_bound: float) -> int | None:
    """The split the eager call would run: ``segment_len`` (-1: none), else the
    backend's automatic one when ``auto_segment``."""
    if segment_len > 0:
        return segment_len
    if not auto_segment:
        return None
    return api._auto_segment_len(kernels, q, v, cu_seqlens, cu_seqlens_cpu,
                                 uses_warmup(kernels, shortcut_bound))


# --------------------------------------------------------------------------------------
# Forward op
# --------------------------------------------------------------------------------------

@torch.library.custom_op("flash_qla::chunk_gdn_fwd", mutates_args=())
def chunk_gdn_fwd(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
    initial_state: Tensor | None, cu_seqlens: Tensor | None,
    cu_seqlens_cpu: Tensor | None, scale: float | None, output_final_state: bool,
    segment_len: int, auto_segment: bool, shortcut_bound: float, backend: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Gated DeltaNet forward in the canonical layout (inputs as
    ``chunk_gated_delta_rule`` after its pre-passes and static checks).

    ``scale`` None: ``K ** -0.5``. ``segment_len``: tokens per segment, -1 for no
    split; ``auto_segment``: without one, let the backend plan it (``auto_cp``).

    Returns ``(o, final_state, g_cumsum, A)``: o ``[B, T, Hv, V]`` in q's dtype;
    final_state ``[N, Hv, K, V]`` fp32 (fp64 for fp64 inputs), ``[0]`` without
    ``output_final_state``; g_cumsum ``[B, T, Hv]`` fp32 (fp64); A ``[B, T, Hv, C]`` in
    q's dtype.
    """
    kernels, cu_seqlens_cpu = _kernels_and_offsets(q, v, backend, cu_seqlens,
                                                   cu_seqlens_cpu, g, beta, initial_state,
                                                   check_values=True)
    scale = q.shape[3] ** -0.5 if scale is None else scale
    split = _segment_len(kernels, q, v, cu_seqlens, cu_seqlens_cpu, segment_len,
                         auto_segment, shortcut_bound)
    q, k, v, g, beta, initial_state = api._contiguous(q, k, v, g, beta, initial_state)
    g_cumsum, A, o, _, final_state = api._forward(
        q, k, v, g, api._kernel_beta(kernels, beta), initial_state, scale,
        output_final_state, cu_seqlens, cu_seqlens_cpu, kernels, split, shortcut_bound)
    if final_state is None:
        final_state = q.new_empty(0, dtype=validation.state_dtype(q))
    return o.contiguous(), final_state.contiguous(), g_cumsum.contiguous(), A.contiguous()


@chunk_gdn_fwd.register_fake
def _chunk_gdn_fwd_fake(q, k, v, g, beta, initial_state, cu_seqlens, cu_seqlens_cpu, scale,
                        output_final_state, segment_len, auto_segment, shortcut_bound,
                        backend):
    B, T, Hv, V = v.shape
    K = q.shape[3]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    work = validation.state_dtype(q)
    final_state = (q.new_empty(N, Hv, K, V, dtype=work) if output_final_state
                   else q.new_empty(0, dtype=work))
    return (q.new_empty(B, T, Hv, V), final_state, q.new_empty(B, T, Hv, dtype=work),
            q.new_empty(B, T, Hv, CHUNK))


# --------------------------------------------------------------------------------------
# Backward op
# --------------------------------------------------------------------------------------

@torch.library.custom_op("flash_qla::chunk_gdn_bwd", mutates_args=())
def chunk_gdn_bwd(
    q: Tensor, k: Tensor, v: Tensor, g_cumsum: Tensor, beta: Tensor, A: Tensor, do: Tensor,
    dht: Tensor | None, initial_state: Tensor | None, cu_seqlens: Tensor | None,
    cu_seqlens_cpu: Tensor | None, scale: float | None, segment_len: int,
    auto_segment: bool, shortcut_bound: float, backend: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Backward of :func:`chunk_gdn_fwd` from its saved inputs and outputs (g_cumsum,
    A) and the gradients ``do`` ``[B, T, Hv, V]`` and ``dht`` (None: zero); the chunk
    states are recomputed.

    Returns ``(dq, dk, dv, dbeta, dg, dh0)``: dq, dk ``[B, T, Hk, K]``, dv in q's dtype;
    dbeta in beta's dtype; dg ``[B, T, Hv]`` fp32 (fp64 for fp64 inputs) w.r.t. the raw
    gate; dh0 ``[N, Hv, K, V]`` fp32 (fp64), ``[0]`` without an initial state.
    """
    kernels, cu_seqlens_cpu = _kernels_and_offsets(q, v, backend, cu_seqlens,
                                                   cu_seqlens_cpu, g_cumsum, beta,
                                                   initial_state, dht, check_values=False)
    scale = q.shape[3] ** -0.5 if scale is None else scale
    bwd = kernels.bwd
    # the bounded split's backward where the backend has one (else the unsplit one)
    if (uses_warmup(kernels, shortcut_bound) and getattr(kernels, "bwd_warmup", None)
            is not None and api._split_allowed(q, cu_seqlens)):
        split = _segment_len(kernels, q, v, cu_seqlens, cu_seqlens_cpu, segment_len,
                             auto_segment, shortcut_bound)
        if split is not None:
            bwd = functools.partial(warmup_bwd, kernels, segment_len=split,
                                    shortcut_bound=shortcut_bound)
    beta_dtype = beta.dtype
    q, k, v, g_cumsum, beta, A, do, dht, initial_state = api._contiguous(
        q, k, v, g_cumsum, beta, A, do, dht, initial_state)
    dq, dk, dv, dbeta, dg, dh0 = bwd(
        q, k, v, g_cumsum, api._kernel_beta(kernels, beta), A, do, dht=dht, scale=scale,
        initial_state=initial_state, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu)
    if dh0 is None:
        dh0 = q.new_empty(0, dtype=validation.state_dtype(q))
    return (dq.contiguous(), dk.contiguous(), dv.contiguous(),
            dbeta.to(beta_dtype).contiguous(), dg.contiguous(), dh0.contiguous())


@chunk_gdn_bwd.register_fake
def _chunk_gdn_bwd_fake(q, k, v, g_cumsum, beta, A, do, dht, initial_state, cu_seqlens,
                        cu_seqlens_cpu, scale, segment_len, auto_segment, shortcut_bound,
                        backend):
    work = validation.state_dtype(q)
    dh0 = (q.new_empty(initial_state.shape, dtype=work) if initial_state is not None
           else q.new_empty(0, dtype=work))
    return (q.new_empty(q.shape), q.new_empty(k.shape), q.new_empty(v.shape),
            beta.new_empty(beta.shape), q.new_empty(beta.shape, dtype=work), dh0)


# --------------------------------------------------------------------------------------
# Autograd of the forward op
# --------------------------------------------------------------------------------------

def _setup_context(ctx, inputs, output):
    """Saves what :func:`_backward` reads: the inputs, the forward's g_cumsum and A
    (outputs without a gradient, as is an absent final state)."""
    (q, k, v, g, beta, initial_state, cu_seqlens, cu_seqlens_cpu, scale, output_final_state,
     segment_len, auto_segment, shortcut_bound, backend) = inputs
    _, final_state, g_cumsum, A = output
    ctx.save_for_backward(q, k, v, g_cumsum, beta, A, initial_state, cu_seqlens,
                          cu_seqlens_cpu)
    ctx.statics = (scale, segment_len, auto_segment, shortcut_bound, backend)
    ctx.g_dtype, ctx.output_final_state = g.dtype, output_final_state
    ctx.mark_non_differentiable(g_cumsum, A, *(() if output_final_state else (final_state,)))
    ctx.set_materialize_grads(False)


def _backward(ctx, do, dht, *_):
    """Gradients of q, k, v, g, beta, initial_state by :func:`chunk_gdn_bwd`: dg in g's
    dtype, None for an absent initial state and for the static arguments. ``do`` or
    ``dht`` None (unused outputs, eager autograd): zero."""
    q, k, v, g_cumsum, beta, A, initial_state, cu_seqlens, cu_seqlens_cpu = ctx.saved_tensors
    if do is None:                                                    # o unused
        do = torch.zeros_like(v, dtype=q.dtype)                       # [B,T,Hv,V]
    if not ctx.output_final_state:                # an empty final state: no gradient
        dht = None
    dq, dk, dv, dbeta, dg, dh0 = chunk_gdn_bwd(
        q, k, v, g_cumsum, beta, A, do, dht, initial_state, cu_seqlens, cu_seqlens_cpu,
        *ctx.statics)
    return (dq, dk, dv, dg.to(ctx.g_dtype), dbeta, None if initial_state is None else dh0,
            None, None, None, None, None, None, None, None)


chunk_gdn_fwd.register_autograd(_backward, setup_context=_setup_context)
