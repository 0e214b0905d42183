"""Hopper kernels, loaded on first use by ``flash_qla_sm90.BACKEND.loader``.

One module per quantity computed: ``chunk_prepare`` (gate cumsum + gate-free inverse),
``chunk_fwd`` (the fused chunk recurrence); ``forward`` orchestrates them and
``chunk_layout`` builds the per-call chunk index. The backward recomputes the chunk-start
states with ``chunk_fwd`` (``forward.chunk_states``) and hands them to the core's
chunk-parallel PyTorch backward until TileLang backward kernels exist. ``kernel_cache``
seeds TileLang's cache with the kernels compiled at build time, so the first call does
not compile.
"""

from __future__ import annotations


class Sm90Kernels:
    """The :class:`flash_qla.backend.Kernels` of the Hopper backend."""

    def fwd(self, q, k, v, g, beta, *, scale, initial_state, cu_seqlens, cu_seqlens_cpu,
            output_final_state, output_h):
        from .forward import chunk_fwd

        return chunk_fwd(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                         cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
                         output_final_state=output_final_state, output_h=output_h)

    def bwd(self, q, k, v, g_cumsum, beta, A, do, *, dht, scale, initial_state, cu_seqlens,
            cu_seqlens_cpu):
        # Until the TileLang backward lands (issue "SM90 backward kernels"): the fused
        # forward kernel recomputes the chunk-start states, then the chunk-parallel
        # PyTorch backward runs every chunk at once (only the dS sweep is serial).
        from flash_qla.chunk_parallel import chunk_gated_delta_rule_bwd_parallel

        from .forward import chunk_states

        h = chunk_states(q, k, v, g_cumsum, beta, A, scale=scale, initial_state=initial_state,
                         cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu)
        return chunk_gated_delta_rule_bwd_parallel(
            q, k, v, g_cumsum, beta, A, do, h, dht=dht, scale=scale,
            initial_state=initial_state, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu)


def load() -> Sm90Kernels:
    from .kernel_cache import use_shipped_cache

    use_shipped_cache()
    return Sm90Kernels()
