"""Host side of the token-by-token recurrence (decode, speculative verify): packs the
call's tensors and launches ``kernels.recurrent_step``. Shapes as
``flash_qla.recurrent.fused_recurrent_gated_delta_rule``."""

from __future__ import annotations

import torch

from .arch import Arch
from .kernels import recurrent_step_kernel
from .launch import launcher
from .layout import DTYPE_NAMES, POOL_DTYPE_NAMES, dense_offsets, packed


def step_args(dtype: str, K: int, V: int, has_h0: bool, state_dtype: str = "float32",
              v_first: bool = False, beta_dtype: str = "float32") -> tuple:
    """``recurrent_step_kernel``'s static arguments after the arch, as the launch below
    passes them (every one, defaults included: one spelling per variant)."""
    return (dtype, K, V, has_h0, state_dtype, v_first, beta_dtype)


def recurrent_fwd(q, k, v, g, beta, *, arch: Arch, scale, initial_state, cu_seqlens,
                  state_indices, output_final_state, v_first: bool = False):
    """``(o [B, T, Hv, V], final_state)``. ``cu_seqlens`` None: the B rows are the
    sequences. ``state_indices`` ``[N]`` int: ``initial_state`` is a pool
    ``[P, Hv, K, V]`` (``v_first``: ``[P, Hv, V, K]``) in fp32, bf16 or fp16, read at the
    indices and updated there in place (the final state returned is the pool itself);
    None: ``initial_state`` ``[N, Hv, K, V]`` (``v_first``: ``[N, Hv, V, K]``) fp32 or
    None, and a new final state in that layout, fp32, when ``output_final_state``.
    beta is read as given when fp32 or in q's dtype; g is converted to fp32."""
    B, T, _, K = q.shape
    Hv, V = v.shape[2:]
    device = q.device
    cu = dense_offsets(B, T, device) if cu_seqlens is None else cu_seqlens.to(torch.int32)
    N = cu.numel() - 1
    state_dims = (V, K) if v_first else (K, V)
    if state_indices is not None:
        slots = state_indices.to(torch.int32)
        h0 = ht = initial_state
    else:
        slots = torch.arange(N, dtype=torch.int32, device=device)
        ht = torch.empty(max(N, 1), Hv, *state_dims, dtype=torch.float32, device=device)
        # without a start state the kernel reads no h0, but h0 and ht share the pool size
        h0 = initial_state if initial_state is not None else ht
    launch = N > 0 and B * T > 0
    # the kernel writes every row, padding included (zeros); without a launch: zeros
    o = (torch.empty if launch else torch.zeros)(B * T, Hv, V, dtype=q.dtype, device=device)
    if launch:
        beta_dtype = beta.dtype if beta.dtype in (torch.float32, q.dtype) else torch.float32
        launcher(recurrent_step_kernel, arch, *step_args(
            DTYPE_NAMES[q.dtype], K, V, initial_state is not None, POOL_DTYPE_NAMES[h0.dtype],
            v_first, POOL_DTYPE_NAMES[beta_dtype]))(
            packed(q), packed(k), packed(v), packed(g, torch.float32),
            packed(beta, beta_dtype), cu, slots, h0, float(scale), o, ht)
    elif state_indices is None and initial_state is not None:
        ht = initial_state.clone()
    o = o.view(B, T, Hv, V)
    if state_indices is not None:
        return o, ht
    return o, (ht[:N] if output_final_state else None)
