"""Static configuration of the Hopper kernels (what an arch package owns).

Every value here is part of a compiled kernel's identity; everything else (B, T, Hk, Hv,
N, sequence lengths) is dynamic and never triggers a recompilation. Plain constants,
read when the kernel modules are imported (the cost model of the per-call choices is
``flash_qla_tl.plan``'s).
"""

#: Explicit target so the kernels compile on a machine without a GPU
#: (plain "sm_90" fails in nvcc for warp-specialised code; tilelang-notes.md).
TARGET = {"kind": "cuda", "arch": "sm_90a"}

#: TileLang pass configs shared by every kernel (the warp-specialised kernels add theirs).
PASS_CONFIGS = {}

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

#: CTAs per SM the prepare kernel's registers leave room for (its launch bound):
#: 6 -> 80 registers, 16 bytes spilled; uncapped it takes 113 (4 CTAs per SM), at 8 it
#: spills 108 bytes (ptxas, sm_90a, bf16; ``tools/sass_report.py``). On the H200
#: (16/16 1x32768 / 4/16 1x32768 / 16/32 8x4096, ms): 6 CTAs 0.128 / 0.126 / 0.251,
#: uncapped 0.143 / 0.140 / 0.274, 8 CTAs 0.138 / 0.139 / 0.275.
PREPARE_MIN_CTAS_PER_SM = 6

#: Chunk totals the bounded split's in-kernel walk searches (``chunk_state_output`` and
#: ``chunk_state_grad`` with ``warmup``) load per step: independent loads, so a walk over
#: m chunks waits on ceil(m / WALK_UNROLL) memory round trips instead of m.
WALK_UNROLL = 8
