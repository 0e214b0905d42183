"""Hopper kernels, loaded on first use by ``flash_qla_sm90.BACKEND.loader``.

One module per quantity computed: ``chunk_prepare`` (gate cumsum + gate-free inverse:
the blocked fp16-WGMMA kernel by default, the fp32 substitution kernel as fallback),
``chunk_fwd`` (the fused chunk recurrence, state columns split over CTAs),
``chunk_fwd_t`` (the same with the whole state transposed in registers) and
``chunk_fwd_ws`` (that with an aux warpgroup; the default transposed kernel);
``forward`` orchestrates them and ``chunk_layout`` builds the per-call chunk index;
``chunk_bwd_dh`` (the reverse state-gradient sweep), ``chunk_bwd_intra`` (every
per-chunk gradient) and ``backward`` (their orchestration) are the backward's. ``tile_ops``
holds the tile steps they share, ``traits`` the static configuration. ``kernel_cache``
seeds TileLang's cache with the kernels compiled at build time, so the first call does
not compile; ``launch`` keeps one launcher per compiled configuration (the least host
work per launch).
"""

from __future__ import annotations

import torch


class Sm90Kernels:
    """The :class:`flash_qla.backend.Kernels` of the Hopper backend."""

    #: every kernel reads beta in fp32 (``flash_qla.backend.Kernels``, optional)
    beta_dtype = torch.float32
    #: the training forward keeps h for the backward where it is chunk_fwd_ws's, in q's
    #: dtype (``forward._keeps_states``; ``flash_qla.backend.Kernels``, optional)
    keeps_states = True
    #: chunk_fwd_ws searches the bounded split's walks itself and needs no host offsets
    #: (``flash_qla.backend.Kernels``, optional): a captured varlen batch can be split
    searches_walks = True

    def fwd(self, q, k, v, g, beta, *, scale, initial_state, cu_seqlens, cu_seqlens_cpu,
            output_final_state, output_h, keep_states=False):
        from .forward import chunk_fwd

        return chunk_fwd(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                         cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
                         output_final_state=output_final_state, output_h=output_h,
                         keep_states=keep_states)

    def fwd_prepared(self, q, k, v, g_cumsum, beta, A, *, scale, initial_state, cu_seqlens,
                     cu_seqlens_cpu, output_final_state, output_h):
        from .forward import fused_fwd

        return fused_fwd(q, k, v, g_cumsum, beta, A, scale=scale, initial_state=initial_state,
                         cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
                         output_final_state=output_final_state, output_h=output_h)

    def fwd_warmup(self, q, k, v, g, beta, *, scale, initial_state, cu_seqlens,
                   cu_seqlens_cpu, starts, keep_states=False):
        from .forward import warmup_fwd

        return warmup_fwd(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                          cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
                          starts=starts, keep_states=keep_states)

    def bwd(self, q, k, v, g_cumsum, beta, A, do, *, dht, scale, initial_state, cu_seqlens,
            cu_seqlens_cpu, states=None):
        from .backward import chunk_bwd

        return chunk_bwd(q, k, v, g_cumsum, beta, A, do, dht=dht, scale=scale,
                         initial_state=initial_state, cu_seqlens=cu_seqlens,
                         cu_seqlens_cpu=cu_seqlens_cpu, states=states)

    def bwd_warmup(self, q, k, v, g_cumsum, beta, A, do, *, dht, scale, initial_state,
                   cu_seqlens, cu_seqlens_cpu, starts, ends, states=None):
        from .backward import chunk_bwd_warmup

        return chunk_bwd_warmup(q, k, v, g_cumsum, beta, A, do, dht=dht, scale=scale,
                                initial_state=initial_state, cu_seqlens=cu_seqlens,
                                cu_seqlens_cpu=cu_seqlens_cpu, starts=starts, ends=ends,
                                states=states)

    def plan_segment_len(self, bounds, Hv, K, V, device, bounded=False):
        from .forward import _sm_count, plan_segment_len

        return plan_segment_len(bounds, Hv, K, V, _sm_count(device), bounded)


def load() -> Sm90Kernels:
    from .kernel_cache import use_shipped_cache

    use_shipped_cache()
    return Sm90Kernels()
