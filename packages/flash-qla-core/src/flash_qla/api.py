"""Public entry points of Gated DeltaNet chunked prefill.

Gated DeltaNet (Yang, Kautz, Hatamizadeh, "Gated Delta Networks: Improving Mamba2 with
Delta Rule", ICLR 2025) keeps, per sequence and value head, a ``K x V`` state ``S``:

    S_t = exp(g_t) * (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T
    o_t = scale * S_t^T q_t

and computes it chunk by chunk (``docs/gdn-math.md`` has the chunked form and
its backward). Shape vocabulary (see :mod:`flash_qla.backend`):

    B   batch size (1 when ``cu_seqlens`` is given)
    T   tokens per batch row (packed tokens when ``cu_seqlens`` is given)
    N   number of sequences (B, or len(cu_seqlens) - 1)
    Hk  q/k heads;  Hv value heads, Hv = G * Hk (GVA: value head h reads q/k head h // G)
    K   q/k head dim;  V value head dim
    C   chunk size (64 on every backend so far);  NT number of chunks

Layers, top to bottom:

1. :func:`chunk_gated_delta_rule` validates, selects a backend, then runs the
   *pre-passes* (optional q/k L2-norm, optional in-kernel gate, state layout), the
   autograd Function (its forward alone when nothing requires grad), and the
   *post-pass* (state layout back). Pre/post-passes are
   plain differentiable torch ops, so their gradients come from autograd.
2. :class:`_ChunkGatedDeltaRule` (the autograd Function) only calls the backend's
   ``Kernels.fwd`` / ``Kernels.bwd`` in the canonical layout and saves what the
   backward needs (q, k, v, the gate cumsum, beta, A, the initial state): the gate
   cumsum and A are saved, never recomputed.
3. :func:`chunk_gated_delta_rule_fwd` / :func:`chunk_gated_delta_rule_bwd` are the
   validated low-level pair (canonical layout, no pre-passes, no autograd).

A traced call (``torch.compile``, ``torch.export``: ``torch.compiler.is_compiling()``)
takes another path below layer 1, so that the trace holds no lock, no host read and no
branch on tensor values: the public function makes only the checks on metadata and the
pre/post-passes, and calls the custom op ``torch.ops.flash_qla.chunk_gdn_fwd``
(:mod:`flash_qla.custom_ops`; autograd through its registered backward, the op
``chunk_gdn_bwd``), which at run time reads the offsets, checks their values, selects
the backend, plans the split and calls its ``Kernels`` as layer 2 does. Public function
-> custom op (autograd registered on it) -> backend ``Kernels``. Eager calls skip the
op: it would cost about 50 us (inference) to 120 us (training) more host time per call.
"""

from __future__ import annotations

import functools
import numbers
import os
from typing import NamedTuple

import torch
import torch.nn.functional as F

from flash_qla import offsets, validation
from flash_qla.backend import (
    BackendSpec,
    Kernels,
    keeps_states,
    searches_walks,
)
from flash_qla.segments import (
    CHUNK,
    DEFAULT_SEGMENT_LEN,
    DEFAULT_SHORTCUT_BOUND,
    fwd_with_segments,
    host_bounds,
    uses_warmup,
    warmup_bwd,
)
from flash_qla.utils import cast

#: segment_len must keep chunk boundaries in place: a multiple of every backend's C.
SEGMENT_MULTIPLE = CHUNK

__all__ = [
    "chunk_gated_delta_rule",
    "chunk_gated_delta_rule_bwd",
    "chunk_gated_delta_rule_fwd",
]

#: eps of the q/k L2-norm pre-pass: x / sqrt(sum(x^2) + eps), as FLA's l2norm.
L2NORM_EPS = 1e-6


# --------------------------------------------------------------------------------------
# Backend selection and small resolvers
# --------------------------------------------------------------------------------------

def _select_kernels(q: torch.Tensor, v: torch.Tensor, backend: str | None,
                    *others: torch.Tensor | None) -> tuple[BackendSpec, Kernels]:
    """The backend for this call (dispatch is imported lazily: no discovery at import).
    A call without tokens (T = 0) runs the ``torch`` backend unless one is named: empty
    outputs and the initial state as the final one, with no GPU kernel launched (the
    Hopper kernels' TMA descriptors need every dimension >= 1)."""
    from flash_qla.dispatch import get_kernels

    K, V = q.shape[3], v.shape[3]
    if backend is None and q.shape[1] == 0:
        backend = "torch"
    spec, kernels = get_kernels(q.device, K=K, V=V, dtype=q.dtype, backend=backend)
    validation.check_backend(spec, K=K, V=V, dtype=q.dtype,
                             uses_float64=validation.uses_float64(q, *others))
    if (spec.name == validation.FLOAT64_BACKEND and q.shape[1] > 0
            and validation.is_capturing(q.device)):
        raise ValueError(
            f"backend {spec.name!r} cannot run inside a CUDA-graph capture (its reference "
            "math reads sequence bounds on the host); capture the GPU backend's call "
            "instead (backend=None), or run this one eagerly")
    return spec, kernels


def _resolve_offsets(cu_seqlens, cu_seqlens_cpu,
                     q: torch.Tensor) -> tuple[torch.Tensor | None, bool]:
    """``(cu_seqlens_cpu, host_read)`` for the call: the caller's host offsets, else one
    read of a valid device ``cu_seqlens`` (:func:`flash_qla.offsets.host_offsets`: kept
    per tensor, so the other layers of a model and the backward read nothing; none
    during a CUDA-graph capture). ``host_read`` says the copy is the call's own. An
    invalid ``cu_seqlens`` (or one off q's device) is left to validation's error."""
    if (cu_seqlens_cpu is not None or not isinstance(cu_seqlens, torch.Tensor)
            or not isinstance(q, torch.Tensor) or cu_seqlens.device != q.device
            or cu_seqlens.dtype not in validation.INDEX_DTYPES or cu_seqlens.dim() != 1
            or cu_seqlens.numel() < 2):
        return cu_seqlens_cpu, False
    host = offsets.host_offsets(cu_seqlens, None)
    return host, host is not None


def _resolve_scale(scale: float | None, K: int) -> float:
    """``scale`` as a float, ``K ** -0.5`` when None."""
    validation.check_scale(scale)
    return K ** -0.5 if scale is None else float(scale)


def _resolve_v_first(transpose_state_layout: bool | None, state_v_first: bool | None) -> bool:
    """Whether states are ``[N, Hv, V, K]``: FlashQLA's and FLA's names for one option
    (None: not given); both given, they must agree."""
    validation.check_bool("transpose_state_layout", transpose_state_layout, optional=True)
    validation.check_bool("state_v_first", state_v_first, optional=True)
    if state_v_first is None:
        return bool(transpose_state_layout)
    if transpose_state_layout is None or transpose_state_layout == state_v_first:
        return state_v_first
    raise ValueError(
        f"transpose_state_layout={transpose_state_layout} and state_v_first={state_v_first} "
        "contradict each other; pass one of them"
    )


def _reject_unsupported(*, head_first: bool, auto_cp: bool | None,
                        enable_fwd_cp_cache: bool | None, cp_context: object) -> None:
    """Accepted-for-compatibility keywords whose requested behaviour does not exist yet."""
    validation.check_bool("head_first", head_first)
    validation.check_bool("auto_cp", auto_cp, optional=True)
    if head_first:
        raise NotImplementedError(
            "head_first=True ([B, H, T, D] inputs) is not supported (FLA deprecated it); "
            "pass [B, T, H, D] tensors, e.g. q.transpose(1, 2)"
        )
    if cp_context is not None:
        raise NotImplementedError(
            "cp_context (context parallelism across ranks) is not supported; pass None"
        )
    validation.check_bool("enable_fwd_cp_cache", enable_fwd_cp_cache, optional=True)
    if enable_fwd_cp_cache:
        raise NotImplementedError(
            "enable_fwd_cp_cache=True is not supported (segment states are not kept "
            "between calls; the segment split itself is segment_len= / auto_cp); pass "
            "None or False"
        )


def _reject_low_level_compat(*, state_v_first: bool | None, auto_cp: bool | None,
                             enable_fwd_cp_cache: bool | None = None, cp_context: object = None,
                             cp_cache: object = None, is_train: bool | None = None) -> None:
    """FlashQLA 0.1.3's trailing arguments of the low-level pair, taken at its positions:
    ``auto_cp`` and ``is_train`` change nothing here (the pair never splits a sequence,
    and keeps no cache); anything asking for what the pair does not do raises."""
    _reject_unsupported(head_first=False, auto_cp=auto_cp,
                        enable_fwd_cp_cache=enable_fwd_cp_cache, cp_context=cp_context)
    validation.check_bool("is_train", is_train, optional=True)
    validation.check_bool("state_v_first", state_v_first, optional=True)
    if state_v_first:
        raise NotImplementedError(
            "state_v_first=True is not supported by the low-level pair (states are "
            "[N, Hv, K, V]); pass state.transpose(-1, -2).contiguous(), or call "
            "chunk_gated_delta_rule(..., state_v_first=True)"
        )
    if cp_cache is not None:
        raise NotImplementedError(
            "cp_cache (FlashQLA 0.1.3's forward cache) is not supported: "
            "chunk_gated_delta_rule_fwd returns none; pass None"
        )


def _check_shortcut_bound(bound) -> float:
    """``segment_shortcut_bound``: a real number in [0, 1)."""
    if isinstance(bound, bool) or not isinstance(bound, numbers.Real):
        raise TypeError(f"segment_shortcut_bound: expected a float in [0, 1), got "
                        f"{type(bound).__name__} {bound!r}")
    if not 0 <= bound < 1:
        raise ValueError(f"segment_shortcut_bound: expected a float in [0, 1), got {bound}")
    return float(bound)


def _resolve_segment_len(force_intra_cp: bool | None, segment_len: int | None) -> int | None:
    """Tokens per segment of the segment-parallel forward, or None for no split."""
    validation.check_bool("force_intra_cp", force_intra_cp, optional=True)
    if segment_len is None:
        return DEFAULT_SEGMENT_LEN if force_intra_cp else None
    segment_len = validation.check_index("segment_len", segment_len,
                                         "an int (tokens per segment) or None")
    if segment_len <= 0 or segment_len % SEGMENT_MULTIPLE:
        raise ValueError(f"segment_len: expected a positive multiple of the chunk size "
                         f"{SEGMENT_MULTIPLE}, got {segment_len}")
    if force_intra_cp is False:
        raise ValueError(f"force_intra_cp=False contradicts segment_len={segment_len}; "
                         "pass one of them")
    return segment_len


def _contiguous(*tensors: torch.Tensor | None) -> list[torch.Tensor | None]:
    return [None if x is None else x.contiguous() for x in tensors]


def _kernel_beta(kernels, beta: torch.Tensor) -> torch.Tensor:
    """beta ``[B, T, Hv]`` in the dtype the backend's kernels read it in
    (``Kernels.beta_dtype``, optional), for the autograd Function: converted once for
    the forward and the saved tensor the backward reads, instead of once in each (a
    copy launch each); the backward casts dbeta back to the caller's dtype. Only an
    upcast (bf16 / fp16 to fp32: exact, the kernels read the same values); also used by
    the inference path, where the segment split's passes would each convert it."""
    dtype = getattr(kernels, "beta_dtype", None)
    # beta is a validated float dtype: a wider one is an upcast (no torch.promote_types,
    # which is a dispatched op)
    if dtype is None or beta.dtype.itemsize >= dtype.itemsize:
        return beta                                    # nothing to do, or not an upcast
    return beta.to(dtype)


def _inference_beta(kernels, beta: torch.Tensor, segment_len: int | None,
                    shortcut_bound: float) -> torch.Tensor:
    """beta for a forward without autograd: as the caller gave it where the backend's
    forward converts it in its first kernel (``Kernels.fwd_converts_beta``) and the call
    is one pass (no split, or the bounded one), else :func:`_kernel_beta` (the exact
    split's passes would each convert their own copy)."""
    if getattr(kernels, "fwd_converts_beta", False) and (
            segment_len is None or uses_warmup(kernels, shortcut_bound)):
        return beta
    return _kernel_beta(kernels, beta)


# --------------------------------------------------------------------------------------
# Pre- and post-passes (differentiable torch ops around the autograd Function)
# --------------------------------------------------------------------------------------

def l2_normalize(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """``x / sqrt(sum(x^2, -1) + eps)`` over the head dim, computed in fp32 (fp64 for
    fp64), returned in x's dtype. The ``use_qk_l2norm_in_kernel`` pre-pass."""
    work = validation.state_dtype(x)
    xw = x.to(work)                                                   # [B,T,H,D]
    return (xw * torch.rsqrt(xw.square().sum(-1, keepdim=True) + eps)).to(x.dtype)


def gate_from_params(g: torch.Tensor, A_log: torch.Tensor,
                     dt_bias: torch.Tensor | None) -> torch.Tensor:
    """``-exp(A_log) * softplus(g + dt_bias)`` (Mamba2-style decay, FLA's in-kernel gate).

    g ``[B, T, Hv]`` raw pre-activation; A_log, dt_bias ``[Hv]``. Computed and returned
    in fp32 (fp64 when g is fp64): a per-token natural-log decay, <= 0.
    """
    work = torch.float64 if g.dtype == torch.float64 else torch.float32
    x = g.to(work)                                                    # [B,T,Hv]
    if dt_bias is not None:
        x = x + dt_bias.to(work)                                      # [B,T,Hv] + [Hv]
    return -torch.exp(A_log.to(work)) * F.softplus(x)                 # [B,T,Hv]


def _auto_segment_len(kernels, q: torch.Tensor, v: torch.Tensor, cu_seqlens, cu_seqlens_cpu,
                      bounded: bool) -> int | None:
    """The backend's automatic segment split (``auto_cp``), asked only when it has a
    planner. Planned from the lengths on the host (dense input, or ``cu_seqlens_cpu``: the caller's,
    or the call's own read of ``cu_seqlens``, :func:`_resolve_offsets`). A varlen call has none only
    inside a CUDA-graph capture. Inside one: only the bounded split, of a dense input, or of a
    varlen batch on a backend that searches its walks in the kernel (``Kernels.searches_walks``; the
    split is then laid out on the device at every replay), whose segment length is planned from
    ``cu_seqlens_cpu`` (the capture's lengths), else from the host copy an eager call (a
    warm-up) kept of the same unmodified tensor (:func:`flash_qla.offsets.kept_offsets`),
    else as if one of its N sequences held nearly all its tokens (the case a split is for;
    a batch whose sequences x heads fill the GPU stays unsplit). Any segment length is
    exact at every replay: only the speed depends on it.
    ``bounded``: the split will be the one-pass bounded one (``fwd_warmup``), else the
    exact one."""
    plan = getattr(kernels, "plan_segment_len", None)
    if plan is None:
        return None
    B, T = q.shape[:2]
    capturing = validation.is_capturing(q.device)
    # a captured varlen training step runs its backward unsplit (recomputing h), so a
    # batch that fills the GPU gains nothing there from a split forward
    # (passed only when False: a backend's planner may predate the keyword)
    full = {} if not (capturing and cu_seqlens is not None and torch.is_grad_enabled()
                      and (q.requires_grad or v.requires_grad)) else {"dominant": False}
    if capturing:
        if not bounded or (cu_seqlens is not None and not searches_walks(kernels)):
            return None
        if cu_seqlens is not None and cu_seqlens_cpu is None:
            kept = offsets.kept_offsets(cu_seqlens)    # an eager call's read of this tensor
            if kept is not None:                       # (a warm-up): its lengths, no sync
                return plan(host_bounds(B, T, cu_seqlens, kept), v.shape[2], q.shape[3],
                            v.shape[3], q.device, bounded=True, **full)
            N, Tt = cu_seqlens.numel() - 1, B * T      # N known, lengths not
            longest = [0, *range(max(Tt - N + 1, 0), Tt + 1)]   # one long, N - 1 of 1 token
            return plan(longest, v.shape[2], q.shape[3], v.shape[3], q.device, bounded=True,
                        dominant=False)
    elif cu_seqlens is not None and cu_seqlens_cpu is None:
        return None
    bounds = host_bounds(B, T, cu_seqlens, cu_seqlens_cpu)               # [N+1], no sync
    return plan(bounds, v.shape[2], q.shape[3], v.shape[3], q.device, bounded=bounded, **full)


def _split_allowed(q: torch.Tensor, cu_seqlens: torch.Tensor | None) -> bool:
    """Whether the backward of a bounded split (planned on the host) may run now:
    always outside a CUDA-graph capture; inside one only for a dense input, whose
    lengths are its shape at every replay (a varlen backward captured there takes the
    unsplit path; its forward's split, laid out on the device, kept no states)."""
    return cu_seqlens is None or not validation.is_capturing(q.device)


def _swap_state_layout(state: torch.Tensor | None) -> torch.Tensor | None:
    """``[N, Hv, K, V]`` <-> ``[N, Hv, V, K]`` (contiguous copy)."""
    return None if state is None else state.transpose(-1, -2).contiguous()


def _kernel_initial_state(state: torch.Tensor | None, q: torch.Tensor,
                          v_first: bool) -> torch.Tensor | None:
    """The initial state as the kernels read it: contiguous ``[N, Hv, K, V]`` in the state
    dtype (fp32; fp64 for fp64 q), by one copy at most (none when it already is). A bf16
    or fp16 state is converted here, so the recurrence runs in fp32; autograd's rule for
    the conversion hands dh0 back in the caller's dtype (and layout)."""
    if state is None:
        return None
    if v_first:
        state = state.transpose(-1, -2)                               # [N,Hv,K,V] view
    dtype = validation.state_dtype(q)
    if state.dtype == dtype and state.is_contiguous():      # no call: a no-op ``to``
        return state                                        # still costs a dispatch
    return state.to(dtype, memory_format=torch.contiguous_format).contiguous()


# --------------------------------------------------------------------------------------
# The autograd Function (canonical layout only)
# --------------------------------------------------------------------------------------

def _forward(q, k, v, g, beta, initial_state, scale, output_final_state, cu_seqlens,
             cu_seqlens_cpu, kernels, segment_len, shortcut_bound, keep_states=False):
    """The backend's forward on contiguous canonical inputs, split into segments when
    ``segment_len`` is set: ``(g_cumsum, A, o, states, final_state)``. ``keep_states``:
    also the chunk-start states for the backend's backward, where it keeps them
    (``Kernels.keeps_states``); ``states`` is None otherwise."""
    keep = {"keep_states": True} if keep_states and keeps_states(kernels) else {}
    fwd = (kernels.fwd if segment_len is None
           else functools.partial(fwd_with_segments, kernels, segment_len=segment_len,
                                  shortcut_bound=shortcut_bound))
    return fwd(q, k, v, g, beta, scale=scale, initial_state=initial_state,
               cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
               output_final_state=output_final_state, output_h=False, **keep)


def _needs_grad(*tensors: torch.Tensor | None) -> bool:
    """Whether autograd would record the call: grad mode on and an input requires grad,
    or forward-mode AD active (a dual tensor's tangent must reach the Function, which
    then raises for want of a ``jvp`` instead of dropping it)."""
    if getattr(torch.autograd.forward_ad, "_current_level", -1) >= 0:   # private: guarded
        return True
    return torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in tensors)


def _inference(q, k, v, g, beta, initial_state, scale, output_final_state, cu_seqlens,
               cu_seqlens_cpu, kernels, segment_len, shortcut_bound):
    """:class:`_ChunkGatedDeltaRule`'s forward without the autograd Function (nothing
    requires grad: prefill, evaluation), which would cost ~40 us of host time per call
    and keep g_cumsum and A alive. Returns ``(o, final_state)``."""
    q, k, v, g, beta, initial_state = _contiguous(q, k, v, g, beta, initial_state)
    beta = _inference_beta(kernels, beta, segment_len, shortcut_bound)
    _, _, o, _, final_state = _forward(q, k, v, g, beta, initial_state, scale,
                                       output_final_state, cu_seqlens, cu_seqlens_cpu,
                                       kernels, segment_len, shortcut_bound)
    return o, final_state


class _ChunkGatedDeltaRule(torch.autograd.Function):
    """o, final_state = GDN(q, k, v, g, beta, initial_state) on one backend's Kernels.
    The arguments that take no gradient come as one tuple, ``statics``: ``Function.apply``
    costs host time per argument."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, cu_seqlens, statics):
        (scale, output_final_state, cu_seqlens_cpu, kernels, segment_len, shortcut_bound,
         save_chunk_states) = statics
        q, k, v, g, beta, initial_state = _contiguous(q, k, v, g, beta, initial_state)
        beta_dtype, beta = beta.dtype, _kernel_beta(kernels, beta)   # once for both passes
        g_cumsum, A, o, states, final_state = _forward(
            q, k, v, g, beta, initial_state, scale, output_final_state, cu_seqlens,
            cu_seqlens_cpu, kernels, segment_len, shortcut_bound, save_chunk_states)
        ctx.save_for_backward(q, k, v, g_cumsum, beta, A, initial_state, cu_seqlens,
                              states)
        ctx.scale, ctx.kernels, ctx.cu_seqlens_cpu = scale, kernels, cu_seqlens_cpu
        # the bounded split's backward where the backend has one (else the exact one)
        ctx.warmup = ((segment_len, shortcut_bound)
                      if segment_len is not None and uses_warmup(kernels, shortcut_bound)
                      and getattr(kernels, "bwd_warmup", None) is not None else None)
        ctx.g_dtype, ctx.beta_dtype = g.dtype, beta_dtype
        ctx.set_materialize_grads(False)
        return o, final_state

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g_cumsum, beta, A, initial_state, cu_seqlens, states = ctx.saved_tensors
        if do is None:                                                # o unused
            do = torch.zeros_like(v, dtype=q.dtype)                   # [B,T,Hv,V]
        do, dht = _contiguous(do, dht)
        bwd = ctx.kernels.bwd
        if ctx.warmup is not None and _split_allowed(q, cu_seqlens):
            bwd = functools.partial(warmup_bwd, ctx.kernels, segment_len=ctx.warmup[0],
                                    shortcut_bound=ctx.warmup[1])
        kept = {} if states is None else {"states": states}    # else: recomputed
        dq, dk, dv, dbeta, dg, dh0 = bwd(
            q, k, v, g_cumsum, beta, A, do, dht=dht, scale=ctx.scale,
            initial_state=initial_state, cu_seqlens=cu_seqlens,
            cu_seqlens_cpu=ctx.cu_seqlens_cpu, **kept)
        return dq, dk, dv, cast(dg, ctx.g_dtype), cast(dbeta, ctx.beta_dtype), dh0, None, None


# --------------------------------------------------------------------------------------
# Traced calls (torch.compile, torch.export): the custom op
# --------------------------------------------------------------------------------------

def _traced_forward(q, k, v, g, beta, initial_state, scale, output_final_state, cu_seqlens,
                    cu_seqlens_cpu, segment_len, auto_segment, shortcut_bound, backend):
    """The forward of a traced call: ``torch.ops.flash_qla.chunk_gdn_fwd``
    (:mod:`flash_qla.custom_ops`, differentiable through its registered backward), which reads
    the offsets, checks their values, picks the backend and plans the split at run time.
    ``scale`` None (``K ** -0.5``) is resolved there too: K may be symbolic in a trace.
    Returns ``(o, final_state)``, final_state None without ``output_final_state``."""
    if backend is not None and not isinstance(backend, str):       # as dispatch says it
        raise TypeError(f"backend: expected a backend name (str) or None, got "
                        f"{type(backend).__name__}")
    o, final_state, *_ = torch.ops.flash_qla.chunk_gdn_fwd(
        q, k, v, g, beta, initial_state, cu_seqlens, cu_seqlens_cpu,
        None if scale is None else float(scale), output_final_state,
        -1 if segment_len is None else segment_len, auto_segment, shortcut_bound,
        backend or "")
    return o, (final_state if output_final_state else None)


# --------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------

def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    *,
    cu_seqlens_cpu: torch.Tensor | None = None,
    transpose_state_layout: bool | None = None,
    state_v_first: bool | None = None,
    head_first: bool = False,
    use_gate_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    auto_cp: bool | None = None,
    enable_fwd_cp_cache: bool | None = None,
    cp_context: object = None,
    force_intra_cp: bool | None = None,
    segment_len: int | None = None,
    segment_shortcut_bound: float = DEFAULT_SHORTCUT_BOUND,
    save_chunk_states: bool = True,
    backend: str | None = None,
    state_indices: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated DeltaNet over whole sequences, differentiable (FLA/FlashQLA compatible).

    Computes, per sequence and value head, ``S_t = exp(g_t) (I - beta_t k_t k_t^T)
    S_{t-1} + beta_t k_t v_t^T`` and ``o_t = scale * S_t^T q_t`` (Yang et al., Gated
    Delta Networks, ICLR 2025; ``docs/gdn-math.md``), chunk-parallel on the
    selected backend. Differentiable in q, k, v, g, beta, initial_state (and A_log,
    dt_bias with the in-kernel gate).

    Args:
        q, k: ``[B, T, Hk, K]``, bf16 or fp16 (also fp32 and fp64 on the ``torch``
            backend, for reference use).
        v: ``[B, T, Hv, V]``, q's dtype; ``Hv`` a multiple of ``Hk`` (GVA).
        g: ``[B, T, Hv]`` fp32 or bf16 (fp64 on ``torch``): per-token natural-log decay
            (``g <= 0``, before any cumsum; the state is multiplied by ``exp(g_t)``).
            With ``use_gate_in_kernel`` it is instead the raw pre-activation, see below.
        beta: ``[B, T, Hv]`` in q's dtype or fp32: write strength, in [0, 1].
        scale: output scale; None means ``K ** -0.5``.
        initial_state: ``[N, Hv, K, V]`` (``[N, Hv, V, K]`` v-first) in fp32, bf16 or fp16
            (fp64, and only fp64, for fp64 inputs), or None for zeros. A bf16/fp16 state
            is converted to fp32 first (the recurrence always runs in fp32, as in FLA
            and FlashQLA 0.1.3); its gradient comes back in its own dtype.
        output_final_state: also return the state after each sequence's last token.
        use_qk_l2norm_in_kernel: L2-normalise q and k over K first (pre-pass
            ``x / sqrt(sum(x^2) + 1e-6)`` in fp32; its gradient comes from autograd).
        cu_seqlens: ``[N+1]`` int32/int64 on q's device: N packed sequences, B must be
            1. Zero-length sequences are allowed; tokens after ``cu_seqlens[-1]`` are
            padding and get exact zeros in o and in every gradient.
        cu_seqlens_cpu: the same offsets on the host; lets validation and backends plan
            without a host sync. Trusted where ``cu_seqlens`` is on a GPU (comparing would
            cost the read it saves); compared where both are on the host.
            Without it (FLA's call), the offsets are read to the host once per
            ``cu_seqlens`` tensor (kept while the same tensor object is passed and not
            modified in place; inference tensors, which have no version counter, are
            read at every call) and the call plans exactly as with it; the backward
            reads nothing. Nothing is read during a CUDA-graph capture.
        transpose_state_layout, state_v_first: FlashQLA's and FLA's names for the
            v-first state layout ``[N, Hv, V, K]`` of initial and final state (done by
            transposing around the canonical-layout kernels); None: not given (k-first
            unless the other says v-first); both given, they must agree (ValueError).
        head_first: must be False; ``[B, H, T, D]`` inputs are not supported.
        use_gate_in_kernel, A_log, dt_bias: FLA's in-kernel gate; the decay is
            ``g = -exp(A_log) * softplus(g + dt_bias)``, computed in fp32 as a
            differentiable pre-pass. A_log ``[Hv]`` is required, dt_bias ``[Hv]`` is
            optional (None means 0); both are rejected without ``use_gate_in_kernel``.
        auto_cp: None/True (default None): without ``segment_len`` / ``force_intra_cp``,
            the backend may split long sequences on its own (as ``segment_len``) when its cost model
            predicts a gain, planned from the host lengths (see ``cu_seqlens_cpu``); inside a
            CUDA-graph capture only the bounded split: of a dense input, or of a varlen batch on a
            backend that searches its walks in the kernel (sm90), laid out on the device from the
            live ``cu_seqlens`` at every replay, its segment length planned from ``cu_seqlens_cpu``
            when given, else as if one sequence held nearly all its tokens. sm90 splits when
            (sequences x heads) leave SMs idle: the bounded split into as many segments as one wave
            holds, the exact one (bound 0) into segments of 4096 or 8192 (cost model fitted on the
            H200; ``flash_qla_tl.plan``). False: never.
        segment_len: tokens per segment (a positive multiple of 64) of the segment-
            parallel forward (:mod:`flash_qla.segments`). None (default): no split
            (unless ``auto_cp``). With ``segment_shortcut_bound`` > 0 on a backend
            that has it (sm90; the torch backend as its slow reference, one call per
            segment and head), the bounded split: one pass, each segment rebuilding
            its start state by re-walking the chunks before it back to where their
            decay reaches the bound (or to its sequence's start); else the exact split
            (three passes and a scan over segment transitions). After a bounded
            forward the backward splits the same way where the backend has
            ``bwd_warmup`` (sm90), else it is unsplit (and inside a CUDA-graph capture
            of a varlen batch). Inside a capture only the bounded split runs (dense, or
            varlen on sm90 as under ``auto_cp``), ValueError otherwise (the exact
            split is planned from the call's lengths, which a replay may change).
        segment_shortcut_bound: what the bounded split may drop (default 2^-9, below
            bf16's resolution; 0: the exact split): a segment's warm-up starts where
            ``exp(sum of g)`` up to the segment is at most the bound, so the state it
            forgets contributes at most ``bound`` times its norm (valid for g <= 0 and
            ``beta |k|^2 <= 2``, e.g. L2-normalised keys and beta in [0, 1]; pass 0 for
            keys that are not). Where the gates decay less (g = 0) the warm-up reaches
            the sequence start: exact. Decided on the device, no host sync.
        force_intra_cp: FlashQLA's switch: True splits with ``segment_len`` or
            ``DEFAULT_SEGMENT_LEN`` (4096); False with a ``segment_len`` is an error.
        save_chunk_states: when autograd records the call, keep the chunk-start states
            from the forward for the backward instead of recomputing them there (one
            recurrent pass over all chunks fewer per training step; sm90: ~0.25 ms of a
            1.6 ms backward at 8 x 4096 tokens, 16 heads). Costs memory until the
            backward: ``ceil(T / 64) * Hv * K * V`` elements in q's dtype per sequence
            (bf16, K = V = 128: 512 bytes per token and value head), about two thirds
            of what q, k, v themselves keep. False: recompute (FLA's and FlashQLA's
            choice). Backends without kept states (``torch``) always recompute, and so
            do traced calls (``torch.compile``; :mod:`flash_qla.custom_ops`).
        enable_fwd_cp_cache: accepted for compatibility; any value other than
            None/False raises NotImplementedError.
        cp_context: context parallelism across the ranks of a process group, FLA's
            ``FLACPContext`` (or :class:`flash_qla.context_parallel.CPContext`): each
            rank passes its slice of the packed tokens (B = 1) and the context's local
            offsets replace ``cu_seqlens``; states are per local sequence. Fields read,
            state placement and errors: :func:`flash_qla.context_parallel.resolve_cp_context`;
            ``docs/context-parallel.md``. Not with ``segment_len`` / ``force_intra_cp``
            nor inside ``torch.compile`` (NotImplementedError).
        backend: force a backend by name, e.g. ``"torch"`` (the env variable
            ``FLASH_QLA_BACKEND`` does the same); None picks one for q's device.
        state_indices: ``[N]`` int32/int64 on q's device, or None. Given, ``initial_state``
            is an engine's state pool ``[P, Hv, K, V]`` (v-first: ``[P, Hv, V, K]``),
            contiguous, fp32/bf16/fp16: sequence n starts from ``pool[state_indices[n]]``
            (in fp32) and, with ``output_final_state``, its final state is written back
            to that row in place, in the pool's dtype, and the pool itself is returned
            as final_state (without it the pool is only read). A negative index is a
            padding row: zero start, nothing read or written. FlashInfer 0.7.4's
            ``state_indices`` (:mod:`flash_qla.state_pool`). Inference only
            (NotImplementedError when autograd would record the call, with
            ``cp_context``, or inside ``torch.compile``). On sm90 the forward kernel
            reads and writes the rows (no gather or scatter pass); a call split into
            segments gathers and scatters them; no host read of the indices either way
            (CUDA-graph capturable). Slots must be distinct and below P:
            checked (ValueError) when the indices are on the host, else unchecked (a
            duplicated slot leaves its row undefined).

    Returns:
        ``(o, final_state)``: o ``[B, T, Hv, V]`` in q's dtype; final_state ``[N, Hv, K,
        V]`` (v-first: ``[N, Hv, V, K]``) fp32 (fp64 for fp64 inputs) or None. fp32
        whatever the initial state's dtype, as FLA 0.6.0 and FlashQLA 0.1.3 return it:
        a caller keeping bf16 states casts it (``final_state.to(pool.dtype)``).

    Raises:
        TypeError: an argument of the wrong type or dtype.
        ValueError: wrong shapes, devices, ``cu_seqlens`` contents, contradicting
            options, or head dims/dtypes the selected backend does not run.
        NotImplementedError: a compatibility keyword asking for something not built.

        Under ``torch.compile`` the same errors: those on ``cu_seqlens`` contents and
        on the backend come from the custom op when the compiled code runs; the
        others while the call is traced, where ``fullgraph=True`` makes Dynamo raise
        its own error (``torch._dynamo.exc.Unsupported``) quoting them.

    Not checked (would cost a pass over the data or a host sync): finite inputs,
    ``g <= 0``, beta's range, and ``cu_seqlens`` contents during CUDA-graph capture.
    """
    if state_indices is not None:       # an engine's state pool: flash_qla.state_pool
        return _on_state_pool(**locals())
    traced = torch.compiler.is_compiling()      # torch.compile / export: nothing read here
    key = call = None
    host_read = False
    if cp_context is None and not traced:
        # the host offsets first: a kept plan is valid for these very offsets only
        cu_seqlens_cpu, host_read = _resolve_offsets(cu_seqlens, cu_seqlens_cpu, q)
        options = (scale, output_final_state, use_qk_l2norm_in_kernel, transpose_state_layout,
                   state_v_first, head_first, use_gate_in_kernel, auto_cp,
                   enable_fwd_cp_cache, force_intra_cp, segment_len, segment_shortcut_bound,
                   save_chunk_states, backend)
        key = _call_key(options, (q, k, v, g, beta, initial_state, A_log, dt_bias),
                        cu_seqlens, cu_seqlens_cpu)
        call = _CALLS.get(key, (cu_seqlens, cu_seqlens_cpu))
    if call is None:
        call, cu_seqlens, cu_seqlens_cpu = _check_and_plan(
            q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
            cu_seqlens, cu_seqlens_cpu, transpose_state_layout, state_v_first, head_first,
            use_gate_in_kernel, A_log, dt_bias, auto_cp, enable_fwd_cp_cache, cp_context,
            force_intra_cp, segment_len, segment_shortcut_bound, save_chunk_states, backend,
            traced=traced, resolved=cp_context is None and not traced, host_read=host_read)
        _CALLS.keep(key, (cu_seqlens, cu_seqlens_cpu), call)

    # Pre-passes: everything the kernels' canonical contract does not cover.
    if use_qk_l2norm_in_kernel:
        q, k = l2_normalize(q), l2_normalize(k)                       # [B,T,Hk,K]
    if use_gate_in_kernel:
        g = gate_from_params(g, A_log, dt_bias)                       # [B,T,Hv] fp32
    initial_state = _kernel_initial_state(initial_state, q, call.v_first)  # [N,Hv,K,V] fp32

    if traced:
        o, final_state = _traced_forward(
            q, k, v, g, beta, initial_state, call.scale, output_final_state, cu_seqlens,
            cu_seqlens_cpu, call.segment_len, call.segment_len is None and auto_cp is not False,
            call.shortcut_bound, backend)
    elif _needs_grad(q, k, v, g, beta, initial_state):
        o, final_state = _ChunkGatedDeltaRule.apply(
            q, k, v, g, beta, initial_state, cu_seqlens,
            (call.scale, output_final_state, cu_seqlens_cpu, call.kernels, call.segment_len,
             call.shortcut_bound, save_chunk_states))
    else:
        o, final_state = _inference(q, k, v, g, beta, initial_state, call.scale,
                                    output_final_state, cu_seqlens, cu_seqlens_cpu,
                                    call.kernels, call.segment_len, call.shortcut_bound)

    # Post-pass: back to the caller's state layout.
    if call.v_first:
        final_state = _swap_state_layout(final_state)                 # [N,Hv,V,K]
    return o, final_state


class _Call(NamedTuple):
    """What the checks and the planning of :func:`chunk_gated_delta_rule` resolve: the
    same for every call of one :func:`_call_key`. ``scale``: as given under a trace (K
    may be symbolic), else a float; ``kernels``: None under a trace (the custom op
    picks them)."""
    scale: float | None
    kernels: Kernels | None
    segment_len: int | None
    shortcut_bound: float
    v_first: bool


def _check_and_plan(q, k, v, g, beta, scale, initial_state, output_final_state,
                    use_qk_l2norm_in_kernel, cu_seqlens, cu_seqlens_cpu,
                    transpose_state_layout, state_v_first, head_first, use_gate_in_kernel,
                    A_log, dt_bias, auto_cp, enable_fwd_cp_cache, cp_context, force_intra_cp,
                    segment_len, segment_shortcut_bound, save_chunk_states, backend, *,
                    traced: bool, resolved: bool,
                    host_read: bool) -> tuple[_Call, object, object]:
    """Every check of :func:`chunk_gated_delta_rule`'s arguments, the backend's choice and
    the segment split: ``(call, cu_seqlens, cu_seqlens_cpu)``, the offsets replaced by a
    ``cp_context``'s local ones. ``resolved``: ``cu_seqlens_cpu`` is already resolved
    (:func:`_resolve_offsets`; ``host_read`` its second value), else it is resolved here
    where the call is not traced."""
    # >>> context parallelism (issue 35): flash_qla.context_parallel owns the rest
    cp_layout = None
    if cp_context is not None:      # the local offsets replace the call's, as in FLA
        from flash_qla.context_parallel import context_for_call
        cp_layout = context_for_call(cp_context, segment_len=segment_len,
                                     force_intra_cp=force_intra_cp, traced=traced)
        cu_seqlens, cu_seqlens_cpu, cp_context = (cp_layout.cu_seqlens,
                                                  cp_layout.cu_seqlens_cpu, None)
    # <<< context parallelism
    _reject_unsupported(head_first=head_first, auto_cp=auto_cp,
                        enable_fwd_cp_cache=enable_fwd_cp_cache, cp_context=cp_context)
    segment_len = _resolve_segment_len(force_intra_cp, segment_len)
    shortcut_bound = _check_shortcut_bound(segment_shortcut_bound)
    v_first = _resolve_v_first(transpose_state_layout, state_v_first)
    validation.check_bool("output_final_state", output_final_state)
    validation.check_bool("use_qk_l2norm_in_kernel", use_qk_l2norm_in_kernel)
    validation.check_bool("use_gate_in_kernel", use_gate_in_kernel)
    validation.check_bool("save_chunk_states", save_chunk_states)
    if not traced and not resolved:
        cu_seqlens_cpu, host_read = _resolve_offsets(cu_seqlens, cu_seqlens_cpu, q)
    validation.validate_forward(q, k, v, g, beta, initial_state=initial_state,
                                cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
                                v_first=v_first, host_read=host_read, values=not traced)
    validation.check_gate_params(use_gate_in_kernel, A_log, dt_bias, v)
    validation.check_same_device({"q": q, "A_log": A_log, "dt_bias": dt_bias})
    if traced:               # offsets' values, backend, split and scale: in the custom op
        validation.check_scale(scale)
        kernels = None
    else:
        scale = _resolve_scale(scale, q.shape[3])
        _, kernels = _select_kernels(q, v, backend, g, beta, initial_state)
        if cp_layout is not None:   # >>> context parallelism: the exchange around them <<<
            kernels = cp_layout.kernels(kernels)
        if segment_len is None and auto_cp is not False:
            segment_len = _auto_segment_len(kernels, q, v, cu_seqlens, cu_seqlens_cpu,
                                            uses_warmup(kernels, shortcut_bound))
    return _Call(scale, kernels, segment_len, shortcut_bound, v_first), cu_seqlens, cu_seqlens_cpu


#: Plans of eager calls that passed every check, by :func:`_call_key`. A model's layers
#: repeat one signature per step, and the checks and planning skipped cost more host time
#: than the kernels' launches (``docs/perf-notes.md``, host path).
_CALLS = offsets.KeptPlans(64)

#: The tensor types a kept call plan is made for (a model's A_log and dt_bias are
#: parameters); a subclass may carry semantics of its own (a trace's, a distributed one).
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def _call_key(options: tuple, tensors: tuple, cu_seqlens, cu_seqlens_cpu) -> tuple | None:
    """What the checks and the planning of an eager call read, or None where its plan
    may not be kept: each tensor's shape, dtype and device, each option with its type
    (``1 == True``, but only a bool passes), the offsets by identity and in-place
    version (:class:`flash_qla.offsets.KeptPlans`: the host copy's values were checked
    and planned with), and the backend resolver and its environment variable. None
    inside a CUDA-graph capture (a capture plans apart: no host read, its own split
    rules), for a tensor subclass other than a parameter or a non-tensor where a tensor
    belongs (the full checks say what is wrong), and for offsets without a version
    counter."""
    if type(tensors[0]) not in _PLAIN_TENSORS or validation.is_capturing(tensors[0].device):
        return None
    from flash_qla import dispatch

    key = [*map(type, options), *options, dispatch.get_kernels,
           os.environ.get(dispatch.ENV_VAR)]
    for x in tensors:
        if x is None:
            key.append(None)
        elif type(x) in _PLAIN_TENSORS:
            key.append((x.shape, x.dtype, x.device))
        else:
            return None
    return _CALLS.key(tuple(key), (cu_seqlens, cu_seqlens_cpu))


def _on_state_pool(*, q, k, v, g, beta, scale, initial_state, output_final_state,
                   use_qk_l2norm_in_kernel, cu_seqlens, cu_seqlens_cpu, transpose_state_layout,
                   state_v_first, head_first, use_gate_in_kernel, A_log, dt_bias, auto_cp,
                   enable_fwd_cp_cache, cp_context, force_intra_cp, segment_len,
                   segment_shortcut_bound, save_chunk_states, backend, state_indices):
    """:func:`chunk_gated_delta_rule` with ``state_indices``: its keyword checks, then
    :func:`flash_qla.state_pool.chunk_forward_on_pool`."""
    from flash_qla.state_pool import chunk_forward_on_pool

    if cp_context is not None:
        raise NotImplementedError(
            "cp_context with state_indices is not supported (each rank holds a slice of a "
            "sequence; its state pool is the engine's, not the rank's); pass one of them")
    _reject_unsupported(head_first=head_first, auto_cp=auto_cp,
                        enable_fwd_cp_cache=enable_fwd_cp_cache, cp_context=None)
    validation.check_bool("save_chunk_states", save_chunk_states)
    return chunk_forward_on_pool(
        q, k, v, g, beta, scale=scale, pool=initial_state, state_indices=state_indices,
        output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens,
        cu_seqlens_cpu=cu_seqlens_cpu,
        v_first=_resolve_v_first(transpose_state_layout, state_v_first),
        use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias,
        segment_len=_resolve_segment_len(force_intra_cp, segment_len), auto_cp=auto_cp,
        shortcut_bound=_check_shortcut_bound(segment_shortcut_bound), backend=backend)


def chunk_gated_delta_rule_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    output_final_state: bool = True,
    output_h: bool = False,
    auto_cp: bool | None = None,
    state_v_first: bool | None = None,
    enable_fwd_cp_cache: bool | None = None,
    cp_context: object = None,
    is_train: bool | None = None,
    *,
    cu_seqlens_cpu: torch.Tensor | None = None,
    backend: str | None = None,
):
    """Low-level forward: validated inputs straight to the backend's ``Kernels.fwd``.

    Canonical layout only (state ``[N, Hv, K, V]``, raw log gate, no q/k L2-norm); runs
    under ``torch.no_grad()`` (pair it with :func:`chunk_gated_delta_rule_bwd`).
    Arguments, dtypes and errors as :func:`chunk_gated_delta_rule`; a bf16/fp16
    initial_state is converted to fp32 first.

    ``auto_cp`` ... ``is_train`` are FlashQLA 0.1.3's trailing arguments, at its
    positions: ``auto_cp`` and ``is_train`` are accepted and change nothing (this
    forward never splits a sequence and keeps no cache); ``state_v_first=True``,
    ``enable_fwd_cp_cache=True`` and a ``cp_context`` raise NotImplementedError.
    Unlike FlashQLA 0.1.3's, which returned a sixth value (``cp_cache``), it returns
    five: unpack ``g_cumsum, A, o, h, final_state = ...``.

    Returns ``(g_cumsum, A, o, h, final_state)``:

    * g_cumsum ``[B, T, Hv]`` fp32 (fp64 for fp64 inputs): chunk-local cumsum of g.
    * A ``[B, T, Hv, C]`` in q's dtype: per chunk the gate-free inverse
      ``(I + strictly_lower(diag(beta) K K^T))^-1``, row i of the chunk at token i.
    * o ``[B, T, Hv, V]`` in q's dtype.
    * h ``[B, NT_b, Hv, K, V]`` chunk-start states when ``output_h``, else None (dense:
      NT_b = ceil(T / C) chunks per batch row; varlen: B = 1 and NT_b = all chunks of all
      sequences, in order).
    * final_state ``[N, Hv, K, V]`` fp32 when ``output_final_state``, else None.
    """
    _reject_low_level_compat(state_v_first=state_v_first, auto_cp=auto_cp,
                             enable_fwd_cp_cache=enable_fwd_cp_cache, cp_context=cp_context,
                             is_train=is_train)
    validation.check_bool("output_final_state", output_final_state)
    validation.check_bool("output_h", output_h)
    cu_seqlens_cpu, host_read = _resolve_offsets(cu_seqlens, cu_seqlens_cpu, q)
    validation.validate_forward(q, k, v, g, beta, initial_state=initial_state,
                                cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
                                host_read=host_read)
    scale = _resolve_scale(scale, q.shape[3])
    _, kernels = _select_kernels(q, v, backend, g, beta, initial_state)
    initial_state = _kernel_initial_state(initial_state, q, v_first=False)
    q, k, v, g, beta, initial_state = _contiguous(q, k, v, g, beta, initial_state)
    with torch.no_grad():
        return kernels.fwd(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                           cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
                           output_final_state=output_final_state, output_h=output_h)


def chunk_gated_delta_rule_bwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    A: torch.Tensor,
    do: torch.Tensor,
    dht: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    state_v_first: bool | None = None,
    auto_cp: bool | None = None,
    cp_cache: object = None,
    cp_context: object = None,
    *,
    cu_seqlens_cpu: torch.Tensor | None = None,
    backend: str | None = None,
):
    """Low-level backward: validated inputs straight to the backend's ``Kernels.bwd``.

    ``g`` and ``A`` are the forward's ``g_cumsum`` (fp32 ``[B, T, Hv]``) and ``A``
    (``[B, T, Hv, C]``) exactly as :func:`chunk_gated_delta_rule_fwd` returned them
    (same backend). do ``[B, T, Hv, V]`` in q's dtype; dht ``[N, Hv, K, V]`` fp32 or
    None (zero). Other arguments as the forward; runs under ``torch.no_grad()``.

    Returns ``(dq, dk, dv, dbeta, dg, dh0)``: dq, dk ``[B, T, Hk, K]`` and dv in q's
    dtype, dbeta ``[B, T, Hv]`` in beta's dtype, dg ``[B, T, Hv]`` fp32 w.r.t. the
    raw per-token gate (not the cumsum), dh0 ``[N, Hv, K, V]`` fp32 or None without an
    initial state (fp32 also for a bf16/fp16 initial_state: convert it yourself).

    ``state_v_first``, ``auto_cp``, ``cp_cache``, ``cp_context`` are FlashQLA 0.1.3's
    trailing arguments, at its positions: ``auto_cp`` is accepted and changes nothing;
    ``state_v_first=True``, a ``cp_cache`` or a ``cp_context`` raise
    NotImplementedError. The six results are in FlashQLA 0.1.3's order.
    """
    cu_seqlens_cpu, host_read = _resolve_offsets(cu_seqlens, cu_seqlens_cpu, q)
    N = validation.validate_forward(q, k, v, g, beta, initial_state=initial_state,
                                    cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
                                    host_read=host_read)
    validation.validate_backward_extras(q, v, g, A, do, dht, N, CHUNK)
    _reject_low_level_compat(state_v_first=state_v_first, auto_cp=auto_cp,
                             cp_context=cp_context, cp_cache=cp_cache)
    scale = _resolve_scale(scale, q.shape[3])
    _, kernels = _select_kernels(q, v, backend, g, beta, initial_state, dht)
    initial_state = _kernel_initial_state(initial_state, q, v_first=False)
    q, k, v, g, beta, A, do, dht, initial_state = _contiguous(
        q, k, v, g, beta, A, do, dht, initial_state)
    with torch.no_grad():
        return kernels.bwd(q, k, v, g, beta, A, do, dht=dht, scale=scale,
                           initial_state=initial_state, cu_seqlens=cu_seqlens,
                           cu_seqlens_cpu=cu_seqlens_cpu)
