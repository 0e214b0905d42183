"""Static configuration of the Hopper kernels (what an arch package owns).

Every value here is part of a compiled kernel's identity; everything else (B, T,
Hk, Hv, N, sequence lengths) is dynamic and never triggers a recompilation.
"""

import sys
import types
from types import MappingProxyType


class _Traits(types.ModuleType):
    """This module's type: every assignment to or deletion of one of its attributes
    (tests and tuning patch traits with ``setattr``) increments ``revision``, so caches
    of values derived from traits (the segment planner's) key on one int instead of
    every value. The dict traits are read-only views (``MappingProxyType``): replace
    them, an in-place edit raises."""

    def __setattr__(self, name: str, value) -> None:
        types.ModuleType.__setattr__(self, name, value)
        self._bump(name)

    def __delattr__(self, name: str) -> None:
        types.ModuleType.__delattr__(self, name)
        self._bump(name)

    def _bump(self, name: str) -> None:
        if name not in ("revision", "__class__"):
            types.ModuleType.__setattr__(self, "revision", self.revision + 1)


#: Assignments to this module's attributes since its first import (see ``_Traits``;
#: a reload continues the count, so no cached plan outlives it).
revision = globals().get("revision", -1) + 1
sys.modules[__name__].__class__ = _Traits


#: Explicit target so the kernels compile on a machine without a GPU
#: (plain "sm_90" fails in nvcc for warp-specialised code; tilelang-notes.md).
TARGET = {"kind": "cuda", "arch": "sm_90a"}

#: Chunk length C of the chunked form (gdn-math.md); one WGMMA M-tile.
CHUNK = 64

#: Chunk totals the bounded split's in-kernel walk search (``chunk_fwd_ws`` with
#: ``warmup``) loads per step: independent loads, so a walk back over m chunks waits on
#: ceil(m / WALK_UNROLL) memory round trips instead of m.
WALK_UNROLL = 8

#: Head dims served: (K, V).
HEAD_DIMS = ((128, 128),)

#: q/k/v dtypes served, by torch name.
DTYPES = ("bfloat16", "float16")

#: V columns of the state owned by one CTA of the fused forward (S tile K x BLOCK_V).
BLOCK_V = 64

#: Narrower and wider state tiles, chosen per call by ``forward.fused_tiling``: BLOCK_V 32
#: doubles the CTAs of grids far below one wave; BLOCK_V 128 (one CTA per (sequence,
#: value head), Q K^T / Ag / P computed once) halves the waves of large grids.
BLOCK_V_NARROW = 32
BLOCK_V_WIDE = 128
FWD_NARROW_TILING = True
FWD_WIDE_TILING = True

#: Threads of the fused forward's consumer warpgroups and of the prepare kernel.
FWD_THREADS = 256
PREPARE_THREADS = 128

#: ``chunk_fwd`` tiling arguments (block_v, threads) of the narrow and wide tiles.
FWD_NARROW = (BLOCK_V_NARROW, FWD_THREADS)
FWD_WIDE = (BLOCK_V_WIDE, FWD_THREADS)

#: Cost model of the tiling choice: microseconds per chunk of one CTA (one CTA per SM),
#: by BLOCK_V. Fitted on the H200 (2026-11-30, ``benchmark/tune_chunk_fwd.py``, column
#: "us/chunk": 2/8 and 8/32 at 1x32768, 16/16 4x8192, 16/64 1x32768). A grid of n CTAs
#: costs ceil(n / SMs) * chunks * this.
FWD_CHUNK_US = MappingProxyType({BLOCK_V_NARROW: 4.55, BLOCK_V: 5.4, BLOCK_V_WIDE: 10.0})

#: The transposed-state forwards (one CTA per (sequence, value head), whole 128 x 128
#: state in registers), used where the cost model prefers them to every ``chunk_fwd``
#: tiling. Per-chunk cost by kernel name (``forward.TRANSPOSED_KERNELS``), fitted on the
#: H200 with ``tune_chunk_fwd.py --tilings t,ws,...``: ``chunk_fwd_t`` 5.7-6.0 us (three
#: runs, 2026-11-30); ``chunk_fwd_ws`` (loads, gates, Q K^T, Ag, P on an aux warpgroup)
#: 3.72-3.97 us on 16/16 4x8192, 16/32 8x4096, 2/8 1x2048 with setmaxnreg (2026-11-30,
#: fifth session; 4.82-5.01 before it).
FWD_TRANSPOSED = True
FWD_CHUNK_US_TRANSPOSED = MappingProxyType({"t": 5.8, "ws": 3.85})
#: Which transposed forward runs: ``chunk_fwd_ws`` (True; verified on the H200,
#: 2026-11-30: its 17 tests and every forward test with it on by default) or
#: ``chunk_fwd_t`` (False; verified earlier, kept as the simpler reference kernel).
FWD_AUX_WARPGROUP = True

#: The prepare kernel's inverse: ``chunk_prepare_blocked_kernel`` (True: 16 x 16 diagonal
#: substitutions + four fp16 WGMMA products, small shared tiles, ~5 CTAs per SM; 0.25 ms
#: at 16/32 8x4096 on the H200; verified there 2026-11-30: its 17 GPU tests, and the
#: forward / backward / segment tests with it on by default) or ``chunk_prepare_kernel``
#: (False: one fp32 substitution per column; 0.43 ms, bound by instruction fetch of its
#: unrolled sweep; fp32 throughout, for keys that are not L2-normalised: the blocked
#: kernel's error grows past beta |k|^2 = 1, to 1.1e-2 of A at 1.9 on near-parallel keys).
PREPARE_BLOCKED = True

#: CTAs per SM the blocked prepare kernel's registers leave room for (its launch bound):
#: 6 -> 80 registers, 16 bytes spilled; uncapped it takes 113 (4 CTAs per SM), at 8 it
#: spills 108 bytes (ptxas, sm_90a, bf16; ``tools/sass_report.py``). H200, 2026-12-01
#: (``tune_chunk_fwd.py``, 16/16 1x32768 / 4/16 1x32768 / 16/32 8x4096, ms): 6 CTAs
#: 0.128 / 0.126 / 0.251, uncapped 0.143 / 0.140 / 0.274, 8 CTAs 0.138 / 0.139 / 0.275;
#: the two-accumulator kernel before it (92 registers, 5 CTAs) 0.131 / 0.128 / 0.252.
PREPARE_MIN_CTAS_PER_SM = 6

#: Prepare kernel cost per (chunk, value head), microseconds over the whole GPU (the
#: blocked kernel on the H200, 2026-11-30, tune_chunk_fwd.py: 0.0153-0.0167 us on
#: 16/32 8x4096, 16/16 4x8192, 2/8 1x32768).
PREPARE_US_PER_CHUNK_HEAD = 0.016

#: Automatic segment parallelism (issue 6; ``forward.plan_segment_len``): the segment
#: lengths tried, the cost of one step of the scan over segment positions and of the
#: split's fixed work (host planning, index tensors, launches), and the predicted gain a
#: split must bring. Step and fixed cost: least squares over the 12 split rows of
#: ``tools/h200_session.sh`` stage ``seg`` (H200, 2026-11-30, fifth session, call 3: 2/8,
#: 4/16, 16/16 at 1x32768 and 2/8 at 1x8192, segments of 1024 / 2048 / 4096), residuals
#: up to +-0.76 ms (the split path is host-bound and its times scatter). It then picks
#: 4096 for one long sequence at few heads (measured 14-17% faster than unsplit in
#: that call) and nothing at 1x8192 or on grids that fill the GPU. 1024 and 2048 are
#: not tried: in that call they lost to 4096 on every shape, and to no split on most.
#: Call 4 (plans cached per lengths) measured the split 25-46% faster than unsplit on
#: those rows: the fixed cost fitted before the cache is now an overestimate, which
#: keeps the planner conservative (docs/perf-notes.md, "v5"). Refit with
#: ``benchmark/fit_segment_cost.py --exact <result JSONs>``.
SEGMENT_AUTO = True
SEGMENT_LENS = (4096, 8192)
SEGMENT_SCAN_STEP_US = 45.0
SEGMENT_FIXED_US = 730.0
SEGMENT_MIN_GAIN = 0.05

#: The bounded segment split (``forward.plan_segment_len(bounded=True)``, one pass of
#: ``chunk_fwd_ws`` with ``warmup``; ``flash_qla.segments.warmup_fwd``): the segment
#: lengths tried, shortest first. The planner takes the shortest whose segments x Hv
#: CTAs fit one wave (one CTA per SM), so its worst case, gates that never decay to the
#: bound (every walk back to its sequence start), costs about the unsplit ws pass; and
#: only when its predicted time beats the unsplit one by ``SEGMENT_MIN_GAIN``: the GPU
#: time, ``(segment chunks + WARMUP_CHUNKS)`` ws chunk steps + the prepare, but at
#: least ``WARMUP_HOST_US``, the host time of an eager bounded-split call (the API, a
#: few small torch launches, two TileLang launches). WARMUP_CHUNKS: a
#: typical walk at the benchmark's 'model' gates (Qwen3-Next init: the slowest heads
#: need ~4000 tokens to decay to 2^-9, most far fewer). H200, 2026-11-30 (sixth session,
#: call 3): 2/8 1x8192 split at 512 took 0.588 ms against 0.505 unsplit, the 1x32768
#: rows 0.58-0.67 ms (FLA 0.85-1.31) where the GPU work alone is ~0.3-0.6 ms: host-bound;
#: after the host cuts (call 4) 0.48-0.60 on five rows, median 525 us:
#: ``benchmark/fit_segment_cost.py --bounded <call 4's H200-fla.json>``. Seventh
#: session (call 3): with the walk starts searched in the kernel (no torch launches for
#: them) the eager calls are GPU-bound: eager 0.244-0.550 ms against graph replay
#: 0.206-0.583 on five 1x32768 rows, so the host floor is at most ~250 us (the eager
#: 2/4 row); with 250 the 1x8192 few-head rows and 16/16 4x8192 split.
WARMUP_SEGMENT_LENS = (512, 1024, 2048, 4096, 8192, 16384)
WARMUP_CHUNKS = 16
WARMUP_HOST_US = 250.0

#: Software-pipelining depth of the chunk loop (TMA loads of chunk c+1 overlap chunk c).
FWD_STAGES = 2

PASS_CONFIGS = {}

#: Use the ``chunk_bwd_dh`` kernel for the backward's reverse sweep (verified on an H200,
#: 2026-11-30: tests/sm90/test_backward_gpu.py::test_dh_kernel_matches_torch_sweep, 4 passed);
#: False falls back to the batched PyTorch sweep.
BWD_DH_KERNEL = True

#: Which reverse sweep runs (K = V = 128): ``chunk_bwd_dh_ws`` (True: one CTA per
#: (sequence, value head), dS^T in the registers of two warpgroups, an aux warpgroup
#: loading and preparing each chunk one ahead, the structure of ``chunk_fwd_ws``) or
#: ``chunk_bwd_dh`` (False: K x BLOCK_V of dS per CTA, no warp specialisation; 888 us at
#: 16/16 1x32768 on the H200, ninth session). Predicted ~4 us per chunk for the whole
#: state (the forward's 3.9; the old sweep ~5.5 per V half): NOT yet run on the H200.
BWD_DH_AUX_WARPGROUP = True

#: The backward keeps its chunk states (h from the recompute, dS1 from the reverse sweep)
#: in q's dtype instead of fp32: half of ~2 GB of state traffic at 16/16 1x32768. The
#: per-chunk gradient kernel rounds both to q's dtype GEMM operands anyway; rounding them
#: for every use changes the gradients by ~1e-3 (CPU emulation, docs/perf-notes.md v8).
#: The bounded split's backward: on the H200 since v9 (intra -139 us, ws / dh +33 / +26
#: at 16/16 1x32768). The unsplit backward where chunk_fwd_ws and chunk_bwd_dh_ws write
#: them (``backward.states_in_dtype``): verified on an H200 2026-12-01 (v14 call 1: GPU
#: tests 62 + 8 passed). False restores fp32 states on both paths.
BWD_STATES_IN_DTYPE = True

#: Run the reverse sweep and the per-chunk gradients as one kernel (``chunk_bwd_fused``:
#: one CTA per (sequence or segment, value head), four warpgroups by role) instead of
#: ``chunk_bwd_dh_ws`` + ``chunk_bwd_intra`` where ``backward.fused_pays`` says it is
#: cheaper (K = V = 128). Verified on an H200 2026-12-01 (v19 call 3,
#: tests/sm90/test_bwd_fused_gpu.py: 26 passed; call 6, after the early release, with
#: the captured bounded step: 28 passed; v21 call 4, dv / dk by TMA, with all of
#: tests/sm90/test_backward_gpu.py: 73 passed).
BWD_FUSED = True

#: The cost model of that choice, us (H200, ``benchmark/tune_chunk_bwd.py``):
#: one chunk step of the fused kernel's CTA (11.25-12.3 at 128 CTAs since dv and dk leave
#: by TMA through dU's tile, v21 call 4; 12.1-13.4 in v20 calls 2 and 4; 15.9-16.9 in v19
#: call 6); one chunk step
#: of ``chunk_bwd_dh_ws`` (2.7: 2/8 1x32768, two-kernel 1.92 ms less the intra kernel's
#: share); one ``chunk_bwd_intra`` CTA (one per chunk and value head, one per SM: 16.9,
#: v19 call 1's profile, 1045 us / 62 waves at 4/16 1x32768).
BWD_FUSED_STEP_US = 11.8
BWD_SWEEP_STEP_US = 2.7
BWD_INTRA_CTA_US = 16.9

#: ``chunk_bwd_intra`` writes the per-value-head dq, dk in q's dtype under GVA too (Hv > Hk);
#: the G = Hv / Hk heads of each q/k head are then summed by ``group_sum_kernel`` (one
#: pass, fp32 accumulation, q's dtype out). False: per-head fp32, summed by torch (twice the bytes
#: written and read back, and a cast kernel after the sum: v14 call 2 measured the GVA
#: backward at 16/32 8x4096 3.90 ms against 2 x 1.60 for 16/16). Hv = Hk writes q's
#: dtype either way (no sum follows).
BWD_GVA_GRADS_IN_DTYPE = True

#: Use the ``chunk_bwd_intra`` kernel for the per-chunk gradients (needs BWD_DH_KERNEL);
#: verified on an H200 2026-11-30 (test_intra_kernel_matches_torch_chunk_grads 5/5 and
#: the API gradients vs the fp64 recurrence with it on). False: chunk-parallel PyTorch.
BWD_INTRA_KERNEL = True
