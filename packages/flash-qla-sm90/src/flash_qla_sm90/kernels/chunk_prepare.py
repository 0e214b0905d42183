"""Per-chunk preparation, all chunks in parallel: the gate cumsum and the gate-free inverse.

For each chunk (rows i, j in [0, C)) and value head (gdn-math.md, "Chunked form"):

    gam = cumsum(g)                                   # [C] fp32, chunk-local
    N   = strictly_lower(diag(beta) K K^T)            # [C, C]
    A   = (I + N)^-1                                  # [C, C] unit lower-triangular

A depends only on k and beta, so no exponent of the gate enters it. The inverse is
blocked over the four 16 x 16 diagonal blocks (block lower-triangular algebra):

    N = N_d + N_o              N_d: the diagonal blocks, N_o: the blocks below them
    D = (I + N_d)^-1           four 16 x 16 forward substitutions in fp32 (CUDA cores)
    M = D N_o                  strictly block-lower, so M^4 = 0 and
    A = (I + M)^-1 D = (I - M)(I + M^2) D = X - M X,   X = (I + M^2) D

four 64 x 64 x 64 products on the tensor cores in TF32 (fp32 accumulation; operands
truncated to 10 mantissa bits, an error of <1e-3 of A that sits below the bf16 rounding of
the stored A: checked on the CPU, tests/sm90/test_prepare_algorithm.py). Rows past the
end of a sequence act as k = beta = 0 (selected, so NaN in padding never enters) and are
not written.
"""

import tilelang
import tilelang.language as T

from .traits import CHUNK, PASS_CONFIGS, PREPARE_THREADS, TARGET

#: Side of the diagonal blocks inverted by substitution.
BLOCK = 16


@tilelang.jit(target=TARGET, pass_configs=PASS_CONFIGS)
def chunk_prepare_kernel(dtype: str, K: int):
    """Build the prepare kernel for q/k dtype ``dtype`` and key dim ``K``.

    Kernel arguments (packed token layout, Tt = total tokens, NTmax >= real chunks):
        k           [Tt, Hk, K]  dtype
        g           [Tt, Hv]     fp32, raw per-token log decay
        beta        [Tt, Hv]     fp32
        cu_seqlens  [N+1]        int32
        chunk_idx   [NTmax, 2]   int32, (sequence, chunk within it); -1 rows are skipped
        g_cumsum    [Tt, Hv]     fp32 out
        A           [Tt, Hv, C]  dtype out
    One CTA (one warpgroup) per (chunk, value head).
    """
    C, B = CHUNK, BLOCK
    Tt, Hk, Hv, N1, NTmax = T.dynamic("Tt, Hk, Hv, N1, NTmax")
    f32 = "float32"

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
        with T.Kernel(NTmax * Hv, threads=PREPARE_THREADS) as bid:
            k_shared = T.alloc_shared((C, K), dtype)
            kkt_frag = T.alloc_fragment((C, C), f32)
            nd_shared = T.alloc_shared((C, C), f32)          # N_d, later I + M^2
            no_shared = T.alloc_shared((C, C), f32)          # N_o, later X
            d_shared = T.alloc_shared((C, C), f32)           # D (block diagonal)
            m_shared = T.alloc_shared((C, C), f32)           # M = D N_o
            prod_frag = T.alloc_fragment((C, C), f32)        # each product in turn
            beta_shared = T.alloc_shared((C,), f32)
            g_shared = T.alloc_shared((C,), f32)
            d_col = T.alloc_local((B,), f32)                 # one column of a D block
            acc = T.alloc_local((1,), f32)
            x_shared = no_shared                             # N_o is dead once M is
            m2_shared = nd_shared                            # N_d is dead once D is

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
                T.gemm(k_shared, k_shared, kkt_frag, transpose_B=True, clear_accum=True)
                # N split by blocks; rows past the end are selected to 0 (NaN-safe)
                for i, j in T.Parallel(C, C):
                    nd_shared[i, j] = T.if_then_else(
                        (i > j) & (i < rows) & (i // B == j // B),
                        beta_shared[i] * kkt_frag[i, j], 0.0)
                    no_shared[i, j] = T.if_then_else(
                        (i // B > j // B) & (i < rows), beta_shared[i] * kkt_frag[i, j], 0.0)

                tx = T.get_thread_binding()
                if tx < C:
                    # chunk-local cumsum of the gate, row tx
                    acc[0] = 0.0
                    for m in T.unroll(C):
                        acc[0] += T.if_then_else(m <= tx, g_shared[m], 0.0)
                    if tx < rows:
                        g_cumsum[t0 + tx, h] = acc[0]
                    # column tx % B of diagonal block tx // B of D, right-looking
                    # substitution: d[r] -= N[r, m] d[m] once d[m] is final
                    blk = tx // B * B
                    for i in T.unroll(B):
                        d_col[i] = T.if_then_else(i == tx % B, 1.0, 0.0)
                    for m in T.unroll(B - 1):
                        for r in T.unroll(B - 1 - m):
                            d_col[m + 1 + r] -= nd_shared[blk + m + 1 + r, blk + m] * d_col[m]
                    for i in T.unroll(B):
                        d_shared[blk + i, tx] = d_col[i]

                T.gemm(d_shared, no_shared, prod_frag, clear_accum=True)          # M = D N_o
                T.copy(prod_frag, m_shared)
                T.gemm(m_shared, m_shared, prod_frag, clear_accum=True)           # M^2
                for i, j in T.Parallel(C, C):
                    m2_shared[i, j] = T.if_then_else(i == j, 1.0, 0.0) + prod_frag[i, j]
                T.gemm(m2_shared, d_shared, prod_frag, clear_accum=True)          # X
                T.copy(prod_frag, x_shared)
                T.gemm(m_shared, x_shared, prod_frag, clear_accum=True)           # M X
                for i, j in T.Parallel(C, C):
                    if i < rows:
                        A[t0 + i, h, j] = T.cast(x_shared[i, j] - prod_frag[i, j], dtype)

    return chunk_prepare
