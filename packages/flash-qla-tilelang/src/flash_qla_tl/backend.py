"""The :class:`flash_qla.backend.Kernels` of the TileLang backends: what the core calls.

Each entry point hands its call to the forward or backward orchestrator; the segment
planner's answer comes from :mod:`flash_qla_tl.plan`. Imported by an arch package's
``BACKEND.loader`` on first use (this module imports TileLang).
"""

from __future__ import annotations

from pathlib import Path

import torch

from . import backward, forward, plan, recurrent
from .arch import Arch
from .layout import sm_count
from .precompile import use_shipped_cache


class TileLangKernels:
    """The :class:`flash_qla.backend.Kernels` of a TileLang backend: every entry point
    launches the kernels built for :attr:`arch`."""

    def __init__(self, arch: Arch):
        self.arch = arch

    #: every kernel reads beta in fp32 (``flash_qla.backend.Kernels``, optional)
    beta_dtype = torch.float32
    #: ... but the forward entry points also take it in q's dtype and convert it in
    #: their first kernel (``flash_qla.backend.Kernels``, optional): an inference call
    #: passes it as it is, without a conversion launch
    fwd_converts_beta = True
    #: the training forward keeps h for the backward, in q's dtype, where
    #: ``plan.keep_states`` says so (``flash_qla.backend.Kernels``, optional)
    keeps_states = True
    #: the forward kernel searches the bounded split's walks itself and needs no host
    #: offsets (``flash_qla.backend.Kernels``, optional): a captured varlen batch can be
    #: split
    searches_walks = True

    def fwd(self, q, k, v, g, beta, *, scale, initial_state, cu_seqlens, cu_seqlens_cpu,
            output_final_state, output_h, keep_states=False):
        return forward.chunk_fwd(q, k, v, g, beta, arch=self.arch, scale=scale,
                                 initial_state=initial_state, cu_seqlens=cu_seqlens,
                                 cu_seqlens_cpu=cu_seqlens_cpu,
                                 output_final_state=output_final_state, output_h=output_h,
                                 keep_states=keep_states)

    def fwd_pool(self, q, k, v, g, beta, *, scale, pool, state_indices, v_first,
                 cu_seqlens, cu_seqlens_cpu):
        """The forward on an engine's state pool (``flash_qla.backend.Kernels``,
        optional): read and written in place by the forward kernel."""
        return forward.pool_fwd(q, k, v, g, beta, arch=self.arch, scale=scale, pool=pool,
                                state_indices=state_indices, v_first=v_first,
                                cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu)

    def fwd_prepared(self, q, k, v, g_cumsum, beta, A, *, scale, initial_state, cu_seqlens,
                     cu_seqlens_cpu, output_final_state, output_h):
        return forward.prepared_fwd(q, k, v, g_cumsum, beta, A, arch=self.arch, scale=scale,
                                    initial_state=initial_state, cu_seqlens=cu_seqlens,
                                    cu_seqlens_cpu=cu_seqlens_cpu,
                                    output_final_state=output_final_state, output_h=output_h)

    def fwd_warmup(self, q, k, v, g, beta, *, scale, initial_state, cu_seqlens,
                   cu_seqlens_cpu, starts, keep_states=False):
        return forward.warmup_fwd(q, k, v, g, beta, arch=self.arch, scale=scale,
                                  initial_state=initial_state, cu_seqlens=cu_seqlens,
                                 cu_seqlens_cpu=cu_seqlens_cpu,
                                  starts=starts, keep_states=keep_states)

    def bwd(self, q, k, v, g_cumsum, beta, A, do, *, dht, scale, initial_state, cu_seqlens,
            cu_seqlens_cpu, states=None):
        return backward.chunk_bwd(q, k, v, g_cumsum, beta, A, do, arch=self.arch, dht=dht,
                                  scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens,
                                  cu_seqlens_cpu=cu_seqlens_cpu, states=states)

    def bwd_warmup(self, q, k, v, g_cumsum, beta, A, do, *, dht, scale, initial_state,
                   cu_seqlens, cu_seqlens_cpu, starts, ends, states=None):
        return backward.chunk_bwd_warmup(q, k, v, g_cumsum, beta, A, do, arch=self.arch,
                                         dht=dht, scale=scale, initial_state=initial_state,
                                         cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
                                         starts=starts, ends=ends, states=states)

    def recurrent(self, q, k, v, g, beta, *, scale, initial_state, cu_seqlens, state_indices,
                  output_final_state, v_first=False):
        """Token-by-token recurrence (``flash_qla.backend.Kernels``, optional): decode."""
        return recurrent.recurrent_fwd(q, k, v, g, beta, arch=self.arch, scale=scale,
                                       initial_state=initial_state, cu_seqlens=cu_seqlens,
                                       state_indices=state_indices,
                                       output_final_state=output_final_state,
                                       v_first=v_first)

    def plan_segment_len(self, bounds, Hv, K, V, device, bounded=False, dominant=True):
        """``plan.segment_len`` (K = V = 128 on this backend: the dispatch checks)."""
        return plan.segment_len(bounds, Hv, sm_count(device), bounded, dominant).value


def load(arch: Arch, shipped: Path) -> TileLangKernels:
    """Seed TileLang's cache with the kernels an arch package ships in ``shipped``, then
    the kernels built for ``arch``."""
    use_shipped_cache(shipped)
    return TileLangKernels(arch)
