"""Prefill on an engine's state pool: initial states read from, and final states written
into, the rows of one pool tensor that ``state_indices`` names, in place.

A serving engine keeps the recurrent state of every live request in a pool ``[P, Hv, K,
V]`` (or ``[P, Hv, V, K]``) and hands a prefill batch the slot of each of its N
sequences. Per sequence n with slot ``s = state_indices[n]`` and value head h, the call
computes (``docs/gdn-math.md``, "Recurrence")

    S_0 = pool[s, h] (in fp32)  if s >= 0,   else 0
    S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,   o_t = scale S_t^T q_t
    pool[s, h] <- S_L rounded to the pool's dtype   (s >= 0 and output_final_state)

A negative slot is a padding row (vLLM's ``PAD_SLOT_ID = -1``): its sequence starts from
zeros, its o is computed, and no pool row is read or written. This is FlashInfer
0.7.4's ``gdn_prefill`` meaning of ``state_indices`` (sequence i reads row
``state_indices[i]`` and its final state goes back to that row), with ``initial_state``
as the pool and the pool as the final state returned. On the sm90 backend the forward
kernel itself reads and writes the rows (no gather or scatter pass); a call split into
segments (long sequences at few heads, :func:`chunk_forward_on_pool`) and the ``torch``
backend gather and scatter. Nothing is read on the host for the slots: a CUDA graph may
capture the call.

Inference only: a call that autograd would record raises NotImplementedError (train on
gathered states with :func:`flash_qla.chunk_gated_delta_rule` without ``state_indices``).
"""

from __future__ import annotations

import torch

from flash_qla import api, validation
from flash_qla.segments import uses_warmup

__all__ = ["check_state_pool", "chunk_forward_on_pool", "gather_states", "scatter_states"]


def check_state_pool(pool, state_indices, q: torch.Tensor, v: torch.Tensor, N: int, *,
                     v_first: bool, dtypes: tuple[torch.dtype, ...]) -> None:
    """``pool`` a contiguous state pool ``[P, Hv, K, V]`` (``v_first``: ``[P, Hv, V, K]``)
    in one of ``dtypes``, and ``state_indices`` ``[N]`` int32 / int64 on q's device.

    Raises TypeError (not tensors, wrong dtypes) or ValueError (shapes, device, a
    non-contiguous pool, no pool) naming the argument, what was expected and what was
    received. Where the indices are on the host (CPU tensors: reading them costs no
    sync) also ValueError for a slot ``>= P`` or a non-negative slot given twice; on a
    GPU these are preconditions left unchecked (a sync per call otherwise): a slot out
    of range faults, a slot given twice leaves that row and the sequences sharing it
    undefined."""
    validation.check_is_tensor("state_indices", state_indices)
    if state_indices.dtype not in validation.INDEX_DTYPES:
        raise TypeError(f"state_indices must have an integer dtype (int32 or int64); got "
                        f"{state_indices.dtype}")
    if state_indices.shape != (N,):
        raise ValueError(f"state_indices must be [N] = [{N}] (one state slot per sequence); "
                         f"got shape {list(state_indices.shape)}")
    layout = "[P, Hv, V, K] (v-first)" if v_first else "[P, Hv, K, V]"
    if pool is None:
        raise ValueError(f"state_indices needs initial_state: the state pool {layout} the "
                         "slots index; got initial_state=None")
    validation.check_is_tensor("initial_state", pool)
    Hv, K, V = v.shape[2], q.shape[3], v.shape[3]
    dims = (Hv, V, K) if v_first else (Hv, K, V)
    if pool.dim() != 4 or tuple(pool.shape[1:]) != dims:
        raise ValueError(f"initial_state (the state pool) must be {layout} = "
                         f"[P, {', '.join(map(str, dims))}]; got shape {list(pool.shape)}")
    if pool.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"initial_state (the state pool) must have dtype in ({names}) "
                        f"(q/k/v are {q.dtype}; it is updated in place); got {pool.dtype}")
    if not pool.is_contiguous():
        raise ValueError("initial_state (the state pool) must be contiguous (it is updated "
                         f"in place); got strides {list(pool.stride())}")
    validation.check_same_device({"q": q, "initial_state": pool,
                                  "state_indices": state_indices})
    if state_indices.device.type == "cpu":
        _check_slots(state_indices.tolist(), pool.shape[0])


def _check_slots(slots: list[int], P: int) -> None:
    """Host indices: every slot below P, no non-negative slot twice."""
    seen: dict[int, int] = {}
    for n, s in enumerate(slots):
        if s >= P:
            raise ValueError(f"state_indices[{n}] must be a slot of the pool (< P = {P}) or "
                             f"negative (padding); got {s}")
        if s >= 0 and s in seen:
            raise ValueError(f"state_indices must name each slot at most once (two "
                             f"sequences would write one pool row); got slot {s} at "
                             f"positions {seen[s]} and {n}")
        seen.setdefault(s, n)


def gather_states(pool: torch.Tensor, state_indices: torch.Tensor, *, v_first: bool,
                  dtype: torch.dtype) -> torch.Tensor:
    """``[N, Hv, K, V]`` contiguous in ``dtype``: ``pool[state_indices[n]]`` (transposed
    from v-first), zeros where the slot is negative. Device ops only (no host read)."""
    idx = state_indices.long()
    if pool.shape[0] == 0:                      # no rows: every slot must be padding
        rows = pool.new_zeros((idx.numel(), *pool.shape[1:]))
    else:
        rows = pool.index_select(0, idx.clamp(min=0))                # [N, Hv, ., .]
        rows = torch.where((idx >= 0).view(-1, 1, 1, 1), rows, rows.new_zeros(()))
    if v_first:
        rows = rows.transpose(-1, -2)                                 # [N, Hv, K, V]
    return rows.to(dtype, memory_format=torch.contiguous_format).contiguous()


def scatter_states(pool: torch.Tensor, state_indices: torch.Tensor,
                   final_state: torch.Tensor, *, v_first: bool) -> None:
    """``pool[state_indices[n]] = final_state[n]`` (``[N, Hv, K, V]``, converted to the
    pool's dtype and layout) for every non-negative slot, by device ops only (no host
    read: CUDA-graph capturable). One ``index_copy_`` writes N rows: a padding row
    (negative slot) writes the row of the first sequence that has a slot, with that
    sequence's value, so a row written twice gets one value; without any such sequence,
    every write puts pool row 0 back as it was read."""
    N = state_indices.numel()
    if N == 0 or pool.shape[0] == 0:
        return
    idx = state_indices.long()
    keep = idx >= 0                                                    # [N]
    first = torch.argmax(keep.to(torch.int32))                         # 0 if none
    src = torch.where(keep, torch.arange(N, device=idx.device), first)  # row copied
    slots = idx[src].clamp(min=0)
    rows = final_state[src]                                            # [N, Hv, K, V]
    if v_first:
        rows = rows.transpose(-1, -2)
    rows = torch.where(keep.any(), rows.to(pool.dtype), pool[slots])
    pool.index_copy_(0, slots, rows)


def pool_dtypes(q: torch.Tensor) -> tuple[torch.dtype, ...]:
    """The pool dtypes a prefill accepts: fp32 / bf16 / fp16 (fp64, and only fp64, for
    fp64 q/k/v on the ``torch`` backend)."""
    if q.dtype == torch.float64:
        return (torch.float64,)
    return validation.INITIAL_STATE_DTYPES


def chunk_forward_on_pool(q, k, v, g, beta, *, scale, pool, state_indices,
                          output_final_state: bool, use_qk_l2norm_in_kernel: bool,
                          cu_seqlens, cu_seqlens_cpu, v_first: bool, use_gate_in_kernel: bool,
                          A_log, dt_bias, segment_len: int | None, auto_cp: bool | None,
                          shortcut_bound: float, backend):
    """:func:`flash_qla.chunk_gated_delta_rule` with ``state_indices`` (its arguments,
    the split's already resolved). Returns ``(o, pool)`` with ``output_final_state``,
    else ``(o, None)`` and the pool only read.

    The backend's ``fwd_pool`` (sm90: the forward kernel reads and writes the rows)
    runs every call that writes the pool and is not split. A split call (``segment_len``,
    ``force_intra_cp``, or ``auto_cp``'s plan: long sequences at few heads) gathers the
    rows, runs the split, and scatters the final states: its segments of one sequence
    run in separate CTAs, in no fixed order, so a segment reading the slot could see the
    last one's write; the two passes cost little beside such a call's work. Read-only
    calls, and backends without ``fwd_pool``, gather too. Every path is device ops only:
    nothing read on the host for the slots."""
    validation.check_bool("output_final_state", output_final_state)
    validation.check_bool("use_qk_l2norm_in_kernel", use_qk_l2norm_in_kernel)
    validation.check_bool("use_gate_in_kernel", use_gate_in_kernel)
    if torch.compiler.is_compiling():
        raise NotImplementedError(
            "state_indices inside torch.compile is not supported (the pool is updated in "
            "place by the kernel); call it outside the compiled region, or capture it in "
            "a CUDA graph")
    cu_seqlens_cpu, host_read = api._resolve_offsets(cu_seqlens, cu_seqlens_cpu, q)
    N = validation.validate_forward(q, k, v, g, beta, initial_state=None,
                                    cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
                                    host_read=host_read)
    check_state_pool(pool, state_indices, q, v, N, v_first=v_first, dtypes=pool_dtypes(q))
    validation.check_gate_params(use_gate_in_kernel, A_log, dt_bias, v)
    validation.check_same_device({"q": q, "A_log": A_log, "dt_bias": dt_bias})
    if api._needs_grad(q, k, v, g, beta, pool, A_log, dt_bias):
        raise NotImplementedError(
            "state_indices is for inference (the pool is updated in place, no backward): "
            "run under torch.inference_mode() / torch.no_grad(), or train with gathered "
            "states, chunk_gated_delta_rule(..., initial_state=pool[idx])")
    scale = api._resolve_scale(scale, q.shape[3])
    _, kernels = api._select_kernels(q, v, backend, g, beta, pool)
    if segment_len is None and auto_cp is not False:
        segment_len = api._auto_segment_len(kernels, q, v, cu_seqlens, cu_seqlens_cpu,
                                            uses_warmup(kernels, shortcut_bound))

    if use_qk_l2norm_in_kernel:
        q, k = api.l2_normalize(q), api.l2_normalize(k)
    if use_gate_in_kernel:
        g = api.gate_from_params(g, A_log, dt_bias)
    q, k, v, g, beta = api._contiguous(q, k, v, g, beta)
    fwd_pool = getattr(kernels, "fwd_pool", None)
    if output_final_state and segment_len is None and fwd_pool is not None:
        beta = api._inference_beta(kernels, beta, None, shortcut_bound)
        o = fwd_pool(q, k, v, g, beta, scale=scale, pool=pool, state_indices=state_indices,
                     v_first=v_first, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu)
        return o, pool
    h0 = gather_states(pool, state_indices, v_first=v_first, dtype=validation.state_dtype(q))
    o, final = api._inference(q, k, v, g, beta, h0, scale, output_final_state, cu_seqlens,
                              cu_seqlens_cpu, kernels, segment_len, shortcut_bound)
    if not output_final_state:
        return o, None
    scatter_states(pool, state_indices, final, v_first=v_first)
    return o, pool
