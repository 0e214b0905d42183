"""Index kernels of a varlen call, made on the device from ``cu_seqlens`` with no host
sync: the chunk layout (which sequence and chunk each grid row takes) and the zeros of
the padding tokens after ``cu_seqlens[-1]``.

Both replace torch ops that a CUDA graph would otherwise record on every captured call:
the layout's ~15 small index ops, and a memset of every output (the padding is unknown
while capturing, so every output was allocated zeroed: ~0.6 GB per training step at
16k tokens and 32 value heads). No MMA: the same text for every arch.
"""

import tilelang.language as T

from ..arch import Arch
from .builder import arch_kernel
from .traits import CHUNK

#: Threads of the one CTA of :func:`chunk_layout_kernel` (one prefix-sum slot each).
LAYOUT_THREADS = 512
#: Threads and token rows per CTA of :func:`zero_tail_kernel`.
ZERO_THREADS = 256
ZERO_ROWS = 16
#: Bits of the sequence search: up to 2^31 - 1 sequences.
SEARCH_BITS = 31


@arch_kernel()
def chunk_layout_kernel(arch: Arch):
    """Build (for any arch) the chunk layout of ``flash_qla_tl.layout.ChunkLayout`` from
    the offsets, in one CTA.

    Kernel arguments: cu_seqlens ``[N + 1]`` int32 (N >= 0 sequences, non-decreasing);
    chunk_offsets ``[N + 1]`` int32, out: ``chunk_offsets[n] = sum_{m < n}
    ceil((cu[m + 1] - cu[m]) / C)`` (C = 64); chunk_idx ``[NTmax, 2]`` int32, out: row r
    < ``chunk_offsets[N]`` is ``(n, r - chunk_offsets[n])`` for the sequence n with
    ``chunk_offsets[n] <= r < chunk_offsets[n + 1]``, every later row ``(-1, -1)``.

    Each thread sums the chunk counts of a contiguous run of sequences; a Hillis-Steele
    scan of the per-thread sums in shared memory gives each run its base; the rows of
    chunk_idx then find their sequence by a binary search over chunk_offsets (written
    by this CTA, read back after a barrier)."""
    N1, NTmax = T.dynamic("N1, NTmax")
    P = LAYOUT_THREADS
    LOG_P = P.bit_length() - 1
    assert 1 << LOG_P == P, P
    i32 = "int32"

    @T.prim_func
    def chunk_layout(
        cu_seqlens: T.Tensor((N1,), i32),
        chunk_offsets: T.Tensor((N1,), i32),
        chunk_idx: T.Tensor((NTmax, 2), i32),
    ):
        with T.Kernel(1, threads=P):
            tx = T.get_thread_binding()
            sums = T.alloc_shared((P,), i32)
            n = T.alloc_var(i32, init=N1 - 1)                  # sequences
            per = T.alloc_var(i32, init=T.ceildiv(N1 - 1, P))  # sequences per thread
            run = T.alloc_var(i32, init=0)
            carry = T.alloc_var(i32, init=0)
            pos = T.alloc_var(i32, init=0)
            for s in T.serial(per):
                m = tx * per + s
                if m < n:
                    run += T.ceildiv(cu_seqlens[m + 1] - cu_seqlens[m], CHUNK)
            sums[tx] = run
            T.sync_threads()
            for lvl in T.unroll(LOG_P):                        # inclusive scan of sums
                carry = 0
                if tx >= (1 << lvl):
                    carry = sums[tx - (1 << lvl)]
                T.sync_threads()
                sums[tx] = sums[tx] + carry
                T.sync_threads()
            run = 0
            if tx > 0:
                run = sums[tx - 1]                             # chunks before the run
            for s in T.serial(per):
                m = tx * per + s
                if m < n:
                    run += T.ceildiv(cu_seqlens[m + 1] - cu_seqlens[m], CHUNK)
                    chunk_offsets[m + 1] = run
            if tx == 0:
                chunk_offsets[0] = 0
            T.sync_threads()                                   # chunk_offsets visible
            carry = chunk_offsets[n]                           # the real chunk count
            for it in T.serial(T.ceildiv(NTmax, P)):
                r = it * P + tx
                if r < NTmax:
                    if r < carry:
                        # the last sequence n' < N with chunk_offsets[n'] <= r (an empty
                        # sequence shares its offset with the next, which is taken)
                        pos = 0
                        for b in T.unroll(SEARCH_BITS):
                            step = 1 << (SEARCH_BITS - 1 - b)
                            if pos + step < n:
                                if chunk_offsets[pos + step] <= r:
                                    pos += step
                        chunk_idx[r, 0] = pos
                        chunk_idx[r, 1] = r - chunk_offsets[pos]
                    else:
                        chunk_idx[r, 0] = -1
                        chunk_idx[r, 1] = -1

    return chunk_layout


@arch_kernel()
def zero_tail_kernel(arch: Arch):
    """Build (for any arch) the zeroing of the padding tokens of an output: ``x[:, t, :]
    = 0`` for every token ``t >= cu_seqlens[N]``, nothing else touched.

    Kernel arguments: x ``[G, M, W]`` int32 (an output viewed as 32-bit words: G leading
    blocks, M tokens, W words per token); cu_seqlens ``[N + 1]`` int32. One CTA per
    ``ZERO_ROWS`` tokens of a block; a CTA whose tokens are all real exits after one
    read of ``cu_seqlens[N]`` (no padding: a launch and nothing else)."""
    G, M, W, N1 = T.dynamic("G, M, W, N1")
    R, P = ZERO_ROWS, ZERO_THREADS

    @T.prim_func
    def zero_tail(x: T.Tensor((G, M, W), "int32"), cu_seqlens: T.Tensor((N1,), "int32")):
        with T.Kernel(T.ceildiv(M, R), G, threads=P) as (bx, bg):
            tx = T.get_thread_binding()
            end = T.alloc_var("int32", init=cu_seqlens[N1 - 1])
            if (bx + 1) * R > end:
                for r in T.serial(R):
                    t = bx * R + r
                    if t >= end and t < M:
                        for it in T.serial(T.ceildiv(W, P)):
                            if it * P + tx < W:
                                x[bg, t, it * P + tx] = 0

    return zero_tail
