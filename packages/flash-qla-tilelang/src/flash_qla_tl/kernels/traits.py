"""Static configuration of the kernels shared by every arch.

Every value here, and the :class:`flash_qla_tl.arch.Arch` a builder takes (target,
GEMM flavour, budgets, tiles), is part of a compiled kernel's identity; everything else
(B, T, Hk, Hv, N, sequence lengths) is dynamic and never triggers a recompilation. Plain
constants, read when the kernel modules are imported (the cost model of the per-call
choices is ``flash_qla_tl.plan``'s).
"""

#: Chunk length C of the chunked form (gdn-math.md); one WGMMA M-tile.
CHUNK = 64

#: Head dims served: (K, V).
HEAD_DIMS = ((128, 128),)

#: q/k/v dtypes served, by torch name.
DTYPES = ("bfloat16", "float16")

#: Threads of the per-chunk gradient kernel (``chunk_input_grads``: two warpgroups).
GRAD_THREADS = 256

#: Threads of the prepare kernel (``chunk_cumsum_inverse``: one warpgroup per chunk).
PREPARE_THREADS = 128

#: Chunk totals the bounded split's in-kernel walk searches (``chunk_state_output`` and
#: ``chunk_state_grad`` with ``warmup``) load per step: independent loads, so a walk over
#: m chunks waits on ceil(m / WALK_UNROLL) memory round trips instead of m.
WALK_UNROLL = 8
