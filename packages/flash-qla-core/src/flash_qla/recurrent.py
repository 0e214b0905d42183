"""Token-by-token Gated DeltaNet for decode and speculative verify (FLA's
``fused_recurrent_gated_delta_rule``), with an optional state pool updated in place.

Per sequence and value head (``docs/gdn-math.md``, "Recurrence"):

    S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,   o_t = scale S_t^T q_t

A decode step has one token per sequence, a verify step a few: the chunked prefill's
per-chunk work would be mostly padding there, so the GPU backend runs one CTA per
(sequence, value head, block of state columns) holding its slice of S in registers
for all the sequence's tokens. Inference only (no autograd).
"""

from __future__ import annotations

import torch

from flash_qla import api, validation
from flash_qla.state_pool import check_state_pool, pool_dtypes

__all__ = ["fused_recurrent_gated_delta_rule"]


def _check_pool(pool, state_indices, q, v, N: int, v_first: bool) -> None:
    """``initial_state`` a pool ``[P, Hv, K, V]`` (``v_first``: ``[P, Hv, V, K]``) in a
    dtype the prefill on a pool takes, and ``state_indices`` ``[N]``
    (:func:`flash_qla.state_pool.check_state_pool`, the prefill's check): one pool
    serves an engine's prefill and its decode."""
    check_state_pool(pool, state_indices, q, v, N, v_first=v_first, dtypes=pool_dtypes(q))


def fused_recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None = None,
    gk: torch.Tensor | None = None,
    gv: torch.Tensor | None = None,
    beta: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    *,
    state_indices: torch.Tensor | None = None,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated DeltaNet one token at a time (decode, speculative verify): FLA's signature.

    Computes ``S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T`` and
    ``o_t = scale * S_t^T q_t`` per sequence and value head, in fp32, without autograd.

    Args:
        q, k: ``[B, T, Hk, K]`` bf16/fp16 (fp32/fp64 on the ``torch`` backend).
        v: ``[B, T, Hv, V]``, q's dtype, ``Hv`` a multiple of ``Hk`` (GVA).
        g: ``[B, T, Hv]`` fp32 or bf16 natural-log decay (<= 0), or None for no decay;
            with ``use_gate_in_kernel`` the raw pre-activation (``A_log``, ``dt_bias``
            as in :func:`flash_qla.chunk_gated_delta_rule`).
        gk, gv: FLA's per-key / per-value gates: must be None (NotImplementedError).
        beta: ``[B, T, Hv]`` in q's dtype or fp32, in [0, 1], or None for ones; with
            ``use_beta_sigmoid_in_kernel`` logits (``sigmoid`` is applied first).
        scale: output scale, None for ``K ** -0.5``.
        initial_state: ``[N, Hv, K, V]`` (``[N, Hv, V, K]`` with ``state_v_first``)
            fp32/bf16/fp16, or None for zeros; with ``state_indices`` the state pool
            ``[P, Hv, K, V]`` (``[P, Hv, V, K]`` with ``state_v_first``) fp32/bf16/fp16,
            read at the indices (in fp32) and updated there in place, in its dtype: the
            pool :func:`flash_qla.chunk_gated_delta_rule` takes with ``state_indices``.
        output_final_state: return the state after each sequence's last token (fp32,
            the caller's layout); with ``state_indices`` the pool is returned.
        use_qk_l2norm_in_kernel: L2-normalise q and k over K first.
        allow_neg_eigval: must be False (NotImplementedError).
        cu_seqlens: ``[N + 1]`` offsets of packed sequences (B = 1), or None for N = B.
        state_indices: ``[N]`` int32/int64 slots of ``initial_state`` (FlashInfer's
            ``state_indices``; an engine's state pool: no gather or scatter pass).
        backend: as :func:`flash_qla.chunk_gated_delta_rule`.

    Returns:
        ``(o [B, T, Hv, V] in q's dtype, final_state or None)``.

    Raises:
        TypeError, ValueError: as :func:`flash_qla.chunk_gated_delta_rule`, and for
            ``state_indices`` / the pool. NotImplementedError: ``gk``, ``gv``,
            ``allow_neg_eigval``, or a call autograd would record (grad mode on and an
            input requiring grad; train with :func:`flash_qla.chunk_gated_delta_rule`).
    """
    for name, kind, x in (("gk", "per-key", gk), ("gv", "per-value", gv)):
        if x is not None:
            raise NotImplementedError(f"{name} (FLA's {kind} gate) is not "
                                      "supported; pass the per-head gate g (and beta by "
                                      "keyword: FLA's signature puts gk, gv before beta)")
    validation.check_bool("allow_neg_eigval", allow_neg_eigval)
    if allow_neg_eigval:
        raise NotImplementedError("allow_neg_eigval=True is not supported; pass False")
    for name, flag in (("output_final_state", output_final_state),
                       ("use_qk_l2norm_in_kernel", use_qk_l2norm_in_kernel),
                       ("use_gate_in_kernel", use_gate_in_kernel),
                       ("use_beta_sigmoid_in_kernel", use_beta_sigmoid_in_kernel),
                       ("state_v_first", state_v_first)):
        validation.check_bool(name, flag)
    validation.check_is_tensor("q", q)
    validation.check_is_tensor("v", v)
    if g is None and not use_gate_in_kernel:
        g = q.new_zeros(q.shape[:2] + (v.shape[2],), dtype=validation.state_dtype(q))
    if beta is None:
        beta = q.new_ones(q.shape[:2] + (v.shape[2],))
    pool = state_indices is not None
    N = validation.validate_forward(q, k, v, g, beta, cu_seqlens=cu_seqlens, cu_seqlens_cpu=None,
                                    initial_state=None if pool else initial_state,
                                    v_first=state_v_first)
    if pool:
        _check_pool(initial_state, state_indices, q, v, N, state_v_first)
    validation.check_gate_params(use_gate_in_kernel, A_log, dt_bias, v)
    if api._needs_grad(q, k, v, g, beta, initial_state, A_log, dt_bias):
        raise NotImplementedError("fused_recurrent_gated_delta_rule has no backward here; "
                                  "train with flash_qla.chunk_gated_delta_rule")
    scale = api._resolve_scale(scale, q.shape[3])
    _, kernels = api._select_kernels(q, v, backend, g, beta, initial_state)

    if use_qk_l2norm_in_kernel:
        q, k = api.l2_normalize(q), api.l2_normalize(k)
    if use_gate_in_kernel:
        g = api.gate_from_params(g, A_log, dt_bias)
    if use_beta_sigmoid_in_kernel:
        beta = torch.sigmoid(beta.float()).to(beta.dtype)
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    step = getattr(kernels, "recurrent", None)
    if step is not None:        # the kernel reads the caller's layout (and a pool's dtype)
        if not pool:        # fp32, contiguous, the caller's layout (v_first: no transpose)
            initial_state = api._kernel_initial_state(initial_state, q, v_first=False)
        o, final = step(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                        cu_seqlens=cu_seqlens, state_indices=state_indices,
                        output_final_state=output_final_state or pool,
                        v_first=state_v_first)
        return o, (final if pool or output_final_state else None)
    # the torch backend: the reference recurrence, canonical layout
    from flash_qla.reference import recurrent_gated_delta_rule  # lazily: light import
    from flash_qla.state_pool import gather_states, scatter_states

    if pool:                                                          # zeros: padding
        start = gather_states(initial_state, state_indices, v_first=state_v_first,
                              dtype=validation.state_dtype(q))
    else:
        start = api._kernel_initial_state(initial_state, q, state_v_first)
    o, final = recurrent_gated_delta_rule(q, k, v, g, beta, scale=scale,
                                          initial_state=start, cu_seqlens=cu_seqlens,
                                          output_final_state=True)
    if pool:                                      # padding rows (slot < 0) write nothing
        scatter_states(initial_state, state_indices, final, v_first=state_v_first)
        return o, initial_state
    if not output_final_state:
        return o, None
    return o, (final.transpose(-1, -2).contiguous() if state_v_first else final)
