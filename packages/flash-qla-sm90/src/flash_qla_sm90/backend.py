"""The :class:`flash_qla.backend.Kernels` of the Hopper backend: what the core calls.

Each entry point hands its call to the forward or backward orchestrator; the segment
planner's answer comes from :mod:`flash_qla_sm90.plan`. Imported by
``flash_qla_sm90.BACKEND.loader`` on first use (this module imports TileLang).
"""

from __future__ import annotations

import torch

from . import backward, forward, plan, recurrent
from .layout import sm_count
from .precompile import use_shipped_cache


class Sm90Kernels:
    """The :class:`flash_qla.backend.Kernels` of the Hopper backend."""

    #: every kernel reads beta in fp32 (``flash_qla.backend.Kernels``, optional)
    beta_dtype = torch.float32
    #: the training forward keeps h for the backward, in q's dtype, where
    #: ``plan.keep_states`` says so (``flash_qla.backend.Kernels``, optional)
    keeps_states = True
    #: the forward kernel searches the bounded split's walks itself and needs no host
    #: offsets (``flash_qla.backend.Kernels``, optional): a captured varlen batch can be
    #: split
    searches_walks = True

    def fwd(self, q, k, v, g, beta, *, scale, initial_state, cu_seqlens, cu_seqlens_cpu,
            output_final_state, output_h, keep_states=False):
        return forward.chunk_fwd(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                 cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
                                 output_final_state=output_final_state, output_h=output_h,
                                 keep_states=keep_states)

    def fwd_pool(self, q, k, v, g, beta, *, scale, pool, state_indices, v_first,
                 cu_seqlens, cu_seqlens_cpu):
        """The forward on an engine's state pool (``flash_qla.backend.Kernels``,
        optional): read and written in place by the forward kernel."""
        return forward.pool_fwd(q, k, v, g, beta, scale=scale, pool=pool,
                                state_indices=state_indices, v_first=v_first,
                                cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu)

    def fwd_prepared(self, q, k, v, g_cumsum, beta, A, *, scale, initial_state, cu_seqlens,
                     cu_seqlens_cpu, output_final_state, output_h):
        return forward.prepared_fwd(q, k, v, g_cumsum, beta, A, scale=scale,
                                 initial_state=initial_state, cu_seqlens=cu_seqlens,
                                 cu_seqlens_cpu=cu_seqlens_cpu,
                                 output_final_state=output_final_state, output_h=output_h)

    def fwd_warmup(self, q, k, v, g, beta, *, scale, initial_state, cu_seqlens,
                   cu_seqlens_cpu, starts, keep_states=False):
        return forward.warmup_fwd(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                  cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
                                  starts=starts, keep_states=keep_states)

    def bwd(self, q, k, v, g_cumsum, beta, A, do, *, dht, scale, initial_state, cu_seqlens,
            cu_seqlens_cpu, states=None):
        return backward.chunk_bwd(q, k, v, g_cumsum, beta, A, do, dht=dht, scale=scale,
                                  initial_state=initial_state, cu_seqlens=cu_seqlens,
                                  cu_seqlens_cpu=cu_seqlens_cpu, states=states)

    def bwd_warmup(self, q, k, v, g_cumsum, beta, A, do, *, dht, scale, initial_state,
                   cu_seqlens, cu_seqlens_cpu, starts, ends, states=None):
        return backward.chunk_bwd_warmup(q, k, v, g_cumsum, beta, A, do, dht=dht,
                                         scale=scale, initial_state=initial_state,
                                         cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
                                         starts=starts, ends=ends, states=states)

    def recurrent(self, q, k, v, g, beta, *, scale, initial_state, cu_seqlens, state_indices,
                  output_final_state):
        """Token-by-token recurrence (``flash_qla.backend.Kernels``, optional): decode."""
        return recurrent.recurrent_fwd(q, k, v, g, beta, scale=scale,
                                       initial_state=initial_state, cu_seqlens=cu_seqlens,
                                       state_indices=state_indices,
                                       output_final_state=output_final_state)

    def plan_segment_len(self, bounds, Hv, K, V, device, bounded=False):
        """``plan.segment_len`` (K = V = 128 on this backend: the dispatch checks)."""
        return plan.segment_len(bounds, Hv, sm_count(device), bounded).value


def load() -> Sm90Kernels:
    """Seed TileLang's cache with the shipped kernels, then the backend's kernels."""
    use_shipped_cache()
    return Sm90Kernels()
