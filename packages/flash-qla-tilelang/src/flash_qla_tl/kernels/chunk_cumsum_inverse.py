"""The prepare kernel: the chunk cumsum of the gate and the gate-free per-chunk inverse.

For each chunk (rows i, j in [0, C)) and value head (gdn-math.md, "Chunked form"):

    gam = cumsum(g)                                   # [C] fp32, chunk-local
    N   = strictly_lower(diag(beta) K K^T)            # [C, C]
    A   = (I + N)^-1                                  # [C, C] unit lower-triangular

A depends only on k and beta, so no exponent of the gate enters it. One CTA of 128
threads per (chunk, value head): K K^T on the tensor cores (WGMMA on Hopper, mma.sync on
Blackwell: ``T.gemm`` picks by target), the cumsum by one thread per row (the 64 threads
that do not run the substitutions below, while they do), and the inverse
blocked (``chunk_prepare_blocked_kernel``'s docstring): 16 x 16 diagonal blocks by
substitution in fp32, the rest as four fp16 tensor-core products. Rows past the end
of a sequence act as k = beta = 0 and are not written.
"""

import tilelang.language as T

from ..arch import Arch
from .builder import arch_kernel
from .traits import CHUNK, PREPARE_THREADS

#: Side of the diagonal blocks that ``chunk_prepare_blocked_kernel`` inverts by
#: substitution.
BLOCK = 16


@arch_kernel()
def chunk_prepare_blocked_kernel(arch: Arch, dtype: str, K: int):
    """Build the prepare kernel for ``arch``, q/k dtype ``dtype`` and key dim ``K``.

    Kernel arguments (packed token layout, Tt = total tokens, NTmax >= real chunks):
        k           [Tt, Hk, K]  dtype
        g           [Tt, Hv]     fp32, raw per-token log decay
        beta        [Tt, Hv]     fp32
        cu_seqlens  [N+1]        int32
        chunk_idx   [NTmax, 2]   int32, (sequence, chunk within it); -1 rows are skipped
        g_cumsum    [Tt, Hv]     fp32 out
        A           [Tt, Hv, C]  dtype out

    One CTA of 128 threads per (chunk, value head), its registers capped at 65536 /
    (128 x ``arch.prepare_min_ctas``) so that that many CTAs fit on an SM. With
    N = N_d + N_o (N_d: the four 16 x 16 diagonal blocks, N_o: the blocks below them)
    and block lower-triangular algebra:

        D = (I + N_d)^-1             four 16 x 16 substitutions in fp32 (CUDA cores)
        M = D N_o                    strictly block-lower, so M^4 = 0 and
        A = (I + M)^-1 D = (I - M)(I + M^2) D = X - M X,   X = (I + M^2) D

    The four 64 x 64 x 64 products run on the tensor cores with fp16 operands and fp32
    accumulation, all into one accumulator (I + M^2 onto the identity, X - M X onto X's
    fp32 values, with -M as the operand). fp16 keeps 11 mantissa bits: with
    beta |k|^2 <= 1 (L2-normalised keys, beta in (0, 1), the GDN setting) the error of A
    is at or below the bf16 rounding of the stored A, near-parallel keys included
    (tests/sm90/test_prepare_algorithm.py emulates every rounding). Towards the edge of
    stability it grows: 2.9e-3 at beta |k|^2 = 1.5 and 1.1e-2 at 1.9 on near-parallel
    keys (bf16 rounding of A: 1.6e-3); an fp32 substitution kernel for such inputs is
    kept under the git tag ``retired-sm90-variants``. Range: while beta |k|^2 <= 2 (each
    token's I - beta k k^T a contraction) D, M, M^2, X stay below ~4 and
    |A| <= beta |k|^2, far inside fp16; past it the inverse grows without bound in any
    precision (1e11 at 2.5), as does the recurrence. Small shared tiles (fp16 operands,
    only the diagonal blocks of N in fp32) keep several CTAs per SM, so one CTA's chain
    of phases overlaps the others'.
    """
    C, B = CHUNK, BLOCK
    Tt, Hk, Hv, N1, NTmax = T.dynamic("Tt, Hk, Hv, N1, NTmax")
    f32, f16 = "float32", "float16"

    @T.prim_func
    def chunk_prepare_blocked(
        k: T.Tensor((Tt, Hk, K), dtype),
        g: T.Tensor((Tt, Hv), f32),
        beta: T.Tensor((Tt, Hv), f32),
        cu_seqlens: T.Tensor((N1,), "int32"),
        chunk_idx: T.Tensor((NTmax, 2), "int32"),
        g_cumsum: T.Tensor((Tt, Hv), f32),
        A: T.Tensor((Tt, Hv, C), dtype),
    ):
        with T.Kernel(NTmax * Hv, threads=PREPARE_THREADS) as bid:
            T.annotate_min_blocks_per_sm(arch.prepare_min_ctas)
            k_shared = T.alloc_shared((C, K), dtype)
            # the one [C, C] fp32 accumulator: K K^T, M, I + M^2, X, then A = X - M X
            # (with a second live one, X beside M X, the register cap of 6 CTAs per SM
            # spilled 556 bytes; with one: 16)
            acc_frag = T.alloc_fragment((C, C), f32)
            nd_shared = T.alloc_shared((C, B), f32)      # row i: N[i, blk(i) .. blk(i)+B)
            no_shared = T.alloc_shared((C, C), f16)      # N_o
            d_shared = T.alloc_shared((C, C), f16)       # D (block diagonal)
            m_shared = T.alloc_shared((C, C), f16)       # M = D N_o
            m_neg_shared = T.alloc_shared((C, C), f16)   # -M
            m2_shared = T.alloc_shared((C, C), f16)      # I + M^2
            x_shared = T.alloc_shared((C, C), f16)       # X, as the last product's operand
            beta_shared = T.alloc_shared((C,), f32)
            g_shared = T.alloc_shared((C,), f32)
            d_col = T.alloc_local((B,), f32)             # one column of a D block
            acc = T.alloc_local((1,), f32)

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
                    beta_shared[i] = T.if_then_else(i < rows, beta[t0 + i, h], 0.0)
                    g_shared[i] = T.if_then_else(i < rows, g[t0 + i, h], 0.0)
                T.copy(k[t0:t0 + C, hk, :], k_shared)
                T.clear(d_shared)
                T.gemm(k_shared, k_shared, acc_frag, transpose_B=True, clear_accum=True)
                # N by blocks; rows past the end are selected to 0 (NaN-safe)
                for i, j in T.Parallel(C, C):
                    if i // B == j // B:
                        nd_shared[i, j % B] = T.if_then_else(
                            (i > j) & (i < rows), beta_shared[i] * acc_frag[i, j], 0.0)
                    no_shared[i, j] = T.cast(T.if_then_else(
                        (i // B > j // B) & (i < rows), beta_shared[i] * acc_frag[i, j],
                        0.0), f16)

                tx = T.get_thread_binding()
                if tx < C:
                    # column tx % B of diagonal block tx // B of D, right-looking
                    # substitution: d[r] -= N[r, m] d[m] once d[m] is final
                    blk = tx // B * B
                    for i in T.unroll(B):
                        d_col[i] = T.if_then_else(i == tx % B, 1.0, 0.0)
                    for m in T.unroll(B - 1):
                        for r in T.unroll(B - 1 - m):
                            d_col[m + 1 + r] -= nd_shared[blk + m + 1 + r, m] * d_col[m]
                    for i in T.unroll(B):
                        d_shared[blk + i, tx] = T.cast(d_col[i], f16)
                else:
                    # meanwhile the other C threads: the chunk-local cumsum of the gate,
                    # row tx - C
                    acc[0] = 0.0
                    for m in T.unroll(C):
                        acc[0] += T.if_then_else(m <= tx - C, g_shared[m], 0.0)
                    if tx - C < rows:
                        g_cumsum[t0 + tx - C, h] = acc[0]

                T.gemm(d_shared, no_shared, acc_frag, clear_accum=True)           # M = D N_o
                for i, j in T.Parallel(C, C):
                    m_shared[i, j] = T.cast(acc_frag[i, j], f16)
                    m_neg_shared[i, j] = T.cast(-acc_frag[i, j], f16)
                for i, j in T.Parallel(C, C):
                    acc_frag[i, j] = T.if_then_else(i == j, 1.0, 0.0)
                T.gemm(m_shared, m_shared, acc_frag)                              # I + M^2
                T.copy(acc_frag, m2_shared)
                T.gemm(m2_shared, d_shared, acc_frag, clear_accum=True)           # X
                T.copy(acc_frag, x_shared)
                T.gemm(m_neg_shared, x_shared, acc_frag)                          # X - M X
                for i, j in T.Parallel(C, C):
                    if i < rows:
                        A[t0 + i, h, j] = T.cast(acc_frag[i, j], dtype)

    return chunk_prepare_blocked
