"""Per-chunk preparation, all chunks in parallel: the gate cumsum and the gate-free inverse.

For each chunk (rows i, j in [0, C)) and value head (gdn-math.md, "Chunked form"):

    gam = cumsum(g)                                   # [C] fp32, chunk-local
    N   = strictly_lower(diag(beta) K K^T)            # [C, C]
    A   = (I + N)^-1                                  # [C, C] unit lower-triangular

A depends only on k and beta, so no exponent of the gate enters it. The inverse is a
forward substitution done in fp32: thread j owns column j of A,
``A[i, j] = delta_ij - sum_{m<i} N[i, m] A[m, j]``, evaluated right-looking (row m,
once final, is subtracted from all later rows) so the dependent chain is C steps; N^T
lives in shared memory and is read by broadcast, so the sweep needs no barrier. Rows
past the end of a sequence act as k = beta = 0 and are not written.
"""

import tilelang
import tilelang.language as T

from .traits import CHUNK, PASS_CONFIGS, PREPARE_THREADS, TARGET


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
    """
    C = CHUNK
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
            nt_shared = T.alloc_shared((C, C), f32)           # N^T (N: see above)
            beta_shared = T.alloc_shared((C,), f32)
            g_shared = T.alloc_shared((C,), f32)
            a_col = T.alloc_local((C,), f32)                  # one column of A per thread
            acc = T.alloc_local((1,), f32)

            # Scalars live in registers (T.alloc_var): as plain let-bindings TileLang
            # re-reads them from global memory at every use, inside unrolled loops too.
            chunk = bid // Hv
            h = T.alloc_var("int32", init=bid % Hv)
            seq = T.alloc_var("int32", init=chunk_idx[chunk, 0])
            if seq >= 0:
                t0 = T.alloc_var("int32", init=cu_seqlens[seq] + chunk_idx[chunk, 1] * C)
                rows = T.alloc_var("int32", init=T.min(cu_seqlens[seq + 1] - t0, C))  # 1..C
                hk = T.alloc_var("int32", init=h // (Hv // Hk))  # GVA: value head -> q/k head

                T.copy(k[t0:t0 + C, hk, :], k_shared)
                T.gemm(k_shared, k_shared, kkt_frag, transpose_B=True, clear_accum=True)
                for i in T.Parallel(C):
                    beta_shared[i] = T.if_then_else(i < rows, beta[t0 + i, h], 0.0)
                    g_shared[i] = T.if_then_else(i < rows, g[t0 + i, h], 0.0)
                for i, j in T.Parallel(C, C):
                    nt_shared[j, i] = T.if_then_else(
                        (i > j) & (i < rows), beta_shared[i] * kkt_frag[i, j], 0.0)

                tx = T.get_thread_binding()
                if tx < C:
                    T.clear(a_col)
                    # chunk-local cumsum of the gate, row tx (unrolled: the loads issue
                    # back to back instead of one shared-memory round trip per step)
                    acc[0] = 0.0
                    for m in T.unroll(C):
                        acc[0] += T.if_then_else(m <= tx, g_shared[m], 0.0)
                    if tx < rows:
                        g_cumsum[t0 + tx, h] = acc[0]
                    # forward substitution for column tx of A, right-looking: once
                    # a_col[m] is final it is pushed into every later row, so the
                    # dependent chain is C steps long (each with ~C - m independent
                    # FMAs) instead of the C (C - 1) / 2 of a row-by-row dot product.
                    # Column m of N is row m of N^T: contiguous, read 4 floats per load
                    # from the aligned row lo = 4 floor((m + 1) / 4) (N[r, m] = 0, r <= m).
                    for i in T.unroll(C):
                        a_col[i] = T.if_then_else(i == tx, 1.0, 0.0)
                    for m in T.unroll(C - 1):
                        for r in T.unroll(C - (m + 1) // 4 * 4):
                            a_col[(m + 1) // 4 * 4 + r] -= (
                                nt_shared[m, (m + 1) // 4 * 4 + r] * a_col[m])
                    for i in T.unroll(C):
                        if i < rows:
                            A[t0 + i, h, tx] = T.cast(a_col[i], dtype)

    return chunk_prepare
