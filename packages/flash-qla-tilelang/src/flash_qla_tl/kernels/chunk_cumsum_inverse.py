"""The prepare kernel: the chunk cumsum of the gate and the gate-free per-chunk inverse.

For each chunk (rows i, j in [0, C)) and value head (gdn-math.md, "Chunked form"):

    gam = cumsum(g)                                   # [C] fp32, chunk-local
    N   = strictly_lower(diag(beta) K K^T)            # [C, C]
    A   = (I + N)^-1                                  # [C, C] unit lower-triangular

A depends only on k and beta, so no exponent of the gate enters it. One CTA of 128
threads per (chunk, value head): K K^T on the tensor cores (``T.gemm``: WGMMA on Hopper,
mma.sync on Blackwell), then the cumsum and the inverse by one call of
``unit_lower_inverse`` (16 x 16 diagonal blocks by substitution in fp32, the blocks
below them by block doubling on register-chained fp16 ``mma.sync`` products; the same
instructions on every target). Rows past the end of a sequence act as k = beta = 0 and
are not written.
"""

import tilelang.language as T

from ..arch import Arch
from . import unit_lower_inverse
from .builder import arch_kernel
from .traits import CHUNK, PREPARE_THREADS

#: Side of the diagonal blocks that ``unit_lower_inverse`` inverts by substitution.
BLOCK = 16


@arch_kernel()
def chunk_prepare_kernel(arch: Arch, dtype: str, K: int, beta_dtype: str = "float32"):
    """Build the prepare kernel for ``arch``, q/k dtype ``dtype``, key dim ``K`` and
    beta in ``beta_dtype`` (fp32, or q's dtype).

    Kernel arguments (packed token layout, Tt = total tokens, NTmax >= real chunks):
        k           [Tt, Hk, K]  dtype
        g           [Tt, Hv]     fp32, raw per-token log decay
        beta        [Tt, Hv]     beta_dtype
        cu_seqlens  [N+1]        int32
        chunk_idx   [NTmax, 2]   int32, (sequence, chunk within it); -1 rows are skipped
        g_cumsum    [Tt, Hv]     fp32 out
        A           [Tt, Hv, C]  dtype out
        beta_f32    [Tt, Hv]     fp32 out, beta converted (only where ``beta_dtype`` is
                                 not fp32: the copy the recurrence reads, written here
                                 instead of by a conversion launch before the call)

    One CTA of 128 threads per (chunk, value head), its registers capped at 65536 /
    (128 x ``arch.prepare_min_ctas``) so that that many CTAs fit on an SM. K K^T (input
    dtype, fp32 accumulation) is scaled by beta into N: its diagonal 16 x 16 blocks in
    fp32, the rest in fp16 (rows LD halves apart, for ``ldmatrix``); one
    ``unit_lower_inverse`` call (its docstring: three phases, two warpgroup barriers)
    leaves A in fp16 in shared memory and the cumsum beside it; A goes out in ``dtype``.
    Precision (tests/sm90/test_prepare_algorithm.py emulates every rounding): with
    beta |k|^2 <= 1 (L2-normalised keys, beta in (0, 1), the GDN setting) the error of
    A is at or below the bf16 rounding of the stored A, near-parallel keys included;
    towards the edge of stability it grows (7e-3 at beta |k|^2 = 1.9 on near-parallel
    keys); operands stay O(1) while beta |k|^2 <= 2, far inside fp16."""
    C, B = CHUNK, BLOCK
    LD = unit_lower_inverse.LD
    Tt, Hk, Hv, N1, NTmax = T.dynamic("Tt, Hk, Hv, N1, NTmax")
    f32, f16 = "float32", "float16"

    converts = beta_dtype != f32

    @T.macro
    def prepare(k, g, beta, cu_seqlens, chunk_idx, g_cumsum, A, beta_f32):
        """The kernel's body (``beta_f32`` None: beta is fp32, no copy written)."""
        with T.Kernel(NTmax * Hv, threads=PREPARE_THREADS) as bid:
            T.import_source(unit_lower_inverse.CUDA_SOURCE)
            T.annotate_min_blocks_per_sm(arch.prepare_min_ctas)
            k_shared = T.alloc_shared((C, K), dtype)
            acc_frag = T.alloc_fragment((C, C), f32)
            nd_shared = T.alloc_shared((C, B), f32)      # row i: N[i, blk(i) .. blk(i)+B)
            nh_shared = T.alloc_shared((C, LD), f16)     # N, rows LD halves apart
            ah_shared = T.alloc_shared((C, LD), f16)     # A's blocks as fp16 operands
            beta_shared = T.alloc_shared((C,), f32)
            g_shared = T.alloc_shared((C,), f32)
            gc_shared = T.alloc_shared((C,), f32)

            # Scalars in registers (T.alloc_var): let-bindings would be re-read from
            # global memory at every use.
            c = T.alloc_var("int32", init=bid // Hv)
            h = T.alloc_var("int32", init=bid % Hv)
            hk = T.alloc_var("int32", init=h // (Hv // Hk))  # GVA: value head -> q/k head
            seq = T.alloc_var("int32", init=chunk_idx[c, 0])
            t0 = T.alloc_var("int32", init=T.if_then_else(
                seq >= 0, cu_seqlens[T.max(seq, 0)] + chunk_idx[c, 1] * C, 0))
            rows = T.alloc_var("int32", init=T.if_then_else(
                seq >= 0, T.min(cu_seqlens[T.max(seq, 0) + 1] - t0, C), 0))     # 0..C
            if seq >= 0:
                for i in T.Parallel(C):
                    if converts:
                        beta_shared[i] = T.if_then_else(
                            i < rows, T.cast(beta[t0 + i, h], f32), 0.0)
                        if i < rows:
                            beta_f32[t0 + i, h] = beta_shared[i]
                    else:
                        beta_shared[i] = T.if_then_else(i < rows, beta[t0 + i, h], 0.0)
                    g_shared[i] = T.if_then_else(i < rows, g[t0 + i, h], 0.0)
                T.copy(k[t0:t0 + C, hk, :], k_shared)
                T.gemm(k_shared, k_shared, acc_frag, transpose_B=True, clear_accum=True)
                # N by blocks; rows past the end are selected to 0 (NaN-safe)
                for i, j in T.Parallel(C, C):
                    if i // B == j // B:
                        nd_shared[i, j % B] = T.if_then_else(
                            (i > j) & (i < rows), beta_shared[i] * acc_frag[i, j], 0.0)
                    nh_shared[i, j] = T.cast(T.if_then_else(
                        (i // B > j // B) & (i < rows), beta_shared[i] * acc_frag[i, j],
                        0.0), f16)
                T.sync_threads()
                T.evaluate(unit_lower_inverse.call(
                    nd_shared, nh_shared, ah_shared, g_shared, gc_shared,
                    T.get_thread_binding(), 1))
                T.sync_threads()
                for i in T.Parallel(C):
                    if i < rows:
                        g_cumsum[t0 + i, h] = gc_shared[i]
                for i, j in T.Parallel(C, C):
                    if i < rows:
                        A[t0 + i, h, j] = T.cast(T.if_then_else(
                            j // B > i // B, 0.0, T.cast(ah_shared[i, j], f32)), dtype)

    if converts:
        @T.prim_func
        def chunk_prepare(
            k: T.Tensor((Tt, Hk, K), dtype),
            g: T.Tensor((Tt, Hv), f32),
            beta: T.Tensor((Tt, Hv), beta_dtype),
            cu_seqlens: T.Tensor((N1,), "int32"),
            chunk_idx: T.Tensor((NTmax, 2), "int32"),
            g_cumsum: T.Tensor((Tt, Hv), f32),
            A: T.Tensor((Tt, Hv, C), dtype),
            beta_f32: T.Tensor((Tt, Hv), f32),
        ):
            prepare(k, g, beta, cu_seqlens, chunk_idx, g_cumsum, A, beta_f32)
    else:
        @T.prim_func
        def chunk_prepare(
            k: T.Tensor((Tt, Hk, K), dtype),
            g: T.Tensor((Tt, Hv), f32),
            beta: T.Tensor((Tt, Hv), f32),
            cu_seqlens: T.Tensor((N1,), "int32"),
            chunk_idx: T.Tensor((NTmax, 2), "int32"),
            g_cumsum: T.Tensor((Tt, Hv), f32),
            A: T.Tensor((Tt, Hv, C), dtype),
        ):
            prepare(k, g, beta, cu_seqlens, chunk_idx, g_cumsum, A, None)

    return chunk_prepare
