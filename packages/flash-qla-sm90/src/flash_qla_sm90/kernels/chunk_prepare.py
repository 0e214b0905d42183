"""Per-chunk preparation, all chunks in parallel: the gate cumsum and the gate-free inverse.

For each chunk (rows i, j in [0, C)) and value head (gdn-math.md, "Chunked form"):

    gam = cumsum(g)                                   # [C] fp32, chunk-local
    N   = strictly_lower(diag(beta) K K^T)            # [C, C]
    A   = (I + N)^-1                                  # [C, C] unit lower-triangular

A depends only on k and beta, so no exponent of the gate enters it. Two kernels compute
it (``traits.PREPARE_BLOCKED`` picks, ``forward.prepare_kernel``):
``chunk_prepare_blocked_kernel`` (the default; 16 x 16 blocks by substitution, the rest
as four fp16 WGMMA products, see its docstring) and ``chunk_prepare_kernel``, described
here (fp32 throughout; the fallback). Its inverse is a forward substitution done in
fp32: thread j owns column j of A,
``A[i, j] = delta_ij - sum_{m<i} N[i, m] A[m, j]``, evaluated right-looking (row m,
once final, is subtracted from all later rows) so the dependent chain is C steps; N^T
lives in shared memory and is read by broadcast, so the sweep needs no barrier. Rows
past the end of a sequence act as k = beta = 0 and are not written.

In ``chunk_prepare_kernel`` one CTA (one warpgroup) takes two consecutive chunks of the
grid, so that the 128 threads run two substitutions at once (one column per thread)
instead of leaving half of them idle.
"""

import functools

import tilelang
import tilelang.language as T

from .traits import CHUNK, PASS_CONFIGS, PREPARE_MIN_CTAS_PER_SM, PREPARE_THREADS, TARGET


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

    @T.macro
    def build_nt(kkt_frag, nt_shared, beta_shared, slot, rows):
        """N^T of pair slot ``slot`` from its K K^T (rows past the end: zero)."""
        for i, j in T.Parallel(C, C):
            nt_shared[slot, j, i] = T.if_then_else(
                (i > j) & (i < rows), beta_shared[slot, i] * kkt_frag[i, j], 0.0)

    @T.macro
    def substitute(a_col, nt_shared, slot, col):
        """Column ``col`` of A = (I + N)^-1 by forward substitution, right-looking: once
        a_col[m] is final it is pushed into every later row, so the dependent chain is C
        steps long (each with ~C - m independent FMAs) instead of the C (C - 1) / 2 of a
        row-by-row dot product. Column m of N is row m of N^T: contiguous, read 4 floats
        per load from the aligned row lo = 4 floor((m + 1) / 4) (N[r, m] = 0, r <= m)."""
        for i in T.unroll(C):
            a_col[i] = T.if_then_else(i == col, 1.0, 0.0)
        for m in T.unroll(C - 1):
            for r in T.unroll(C - (m + 1) // 4 * 4):
                a_col[(m + 1) // 4 * 4 + r] -= (
                    nt_shared[slot, m, (m + 1) // 4 * 4 + r] * a_col[m])

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
        # Two chunks per CTA (slots 0, 1), so that all four warps run a substitution.
        with T.Kernel(T.ceildiv(NTmax, 2) * Hv, threads=PREPARE_THREADS) as bid:
            k0_shared = T.alloc_shared((C, K), dtype)
            k1_shared = T.alloc_shared((C, K), dtype)
            kkt0_frag = T.alloc_fragment((C, C), f32)
            kkt1_frag = T.alloc_fragment((C, C), f32)
            nt_shared = T.alloc_shared((2, C, C), f32)        # N^T per slot (N: see above)
            beta_shared = T.alloc_shared((2, C), f32)
            g_shared = T.alloc_shared((2, C), f32)
            a_col = T.alloc_local((C,), f32)                  # one column of A per thread
            acc = T.alloc_local((1,), f32)

            # Scalars live in registers (T.alloc_var): as plain let-bindings TileLang
            # re-reads them from global memory at every use, inside unrolled loops too.
            c0 = T.alloc_var("int32", init=bid // Hv * 2)    # the pair's first chunk
            h = T.alloc_var("int32", init=bid % Hv)
            hk = T.alloc_var("int32", init=h // (Hv // Hk))  # GVA: value head -> q/k head
            seq0 = T.alloc_var("int32", init=chunk_idx[c0, 0])
            seq1 = T.alloc_var("int32", init=T.if_then_else(
                c0 + 1 < NTmax, chunk_idx[T.min(c0 + 1, NTmax - 1), 0], -1))
            # Every global load of both chunks is issued before the first wait: the
            # token offsets, then k, g and beta of both slots together (a slot without a
            # chunk reads rows 0.. of its head and keeps rows = 0, so all is masked).
            t00 = T.alloc_var("int32", init=T.if_then_else(
                seq0 >= 0, cu_seqlens[T.max(seq0, 0)] + chunk_idx[c0, 1] * C, 0))
            t01 = T.alloc_var("int32", init=T.if_then_else(
                seq1 >= 0, cu_seqlens[T.max(seq1, 0)]
                + chunk_idx[T.min(c0 + 1, NTmax - 1), 1] * C, 0))
            rows0 = T.alloc_var("int32", init=T.if_then_else(
                seq0 >= 0, T.min(cu_seqlens[T.max(seq0, 0) + 1] - t00, C), 0))   # 0..C
            rows1 = T.alloc_var("int32", init=T.if_then_else(
                seq1 >= 0, T.min(cu_seqlens[T.max(seq1, 0) + 1] - t01, C), 0))
            for sl, i in T.Parallel(2, C):
                beta_shared[sl, i] = T.if_then_else(
                    i < T.if_then_else(sl == 0, rows0, rows1),
                    beta[T.if_then_else(sl == 0, t00, t01) + i, h], 0.0)
                g_shared[sl, i] = T.if_then_else(
                    i < T.if_then_else(sl == 0, rows0, rows1),
                    g[T.if_then_else(sl == 0, t00, t01) + i, h], 0.0)
            T.copy(k[t00:t00 + C, hk, :], k0_shared)
            T.copy(k[t01:t01 + C, hk, :], k1_shared)
            T.wgmma_gemm(k0_shared, k0_shared, kkt0_frag, transpose_B=True, clear_accum=True)
            T.wgmma_gemm(k1_shared, k1_shared, kkt1_frag, transpose_B=True, clear_accum=True)
            T.wait_wgmma(0)
            build_nt(kkt0_frag, nt_shared, beta_shared, 0, rows0)
            build_nt(kkt1_frag, nt_shared, beta_shared, 1, rows1)

            tx = T.get_thread_binding()
            slot = T.alloc_var("int32", init=tx // C)        # warps 0-1: slot 0, 2-3: slot 1
            col = T.alloc_var("int32", init=tx % C)
            mine = T.alloc_var("int32", init=T.if_then_else(slot == 0, seq0, seq1))
            t0 = T.alloc_var("int32", init=T.if_then_else(slot == 0, t00, t01))
            rows = T.alloc_var("int32", init=T.if_then_else(slot == 0, rows0, rows1))
            if mine >= 0:
                # chunk-local cumsum of the gate, row col (unrolled: the loads issue
                # back to back instead of one shared-memory round trip per step)
                acc[0] = 0.0
                for m in T.unroll(C):
                    acc[0] += T.if_then_else(m <= col, g_shared[slot, m], 0.0)
                if col < rows:
                    g_cumsum[t0 + col, h] = acc[0]
                # one copy of the unrolled sweep per slot: a constant N^T base keeps
                # the 2016 loads as shared-memory immediates (a runtime slot index
                # made nvcc keep 64-bit addresses live: 255 registers and spills)
                if slot == 0:
                    substitute(a_col, nt_shared, 0, col)
                else:
                    substitute(a_col, nt_shared, 1, col)
                for i in T.unroll(C):
                    if i < rows:
                        A[t0 + i, h, col] = T.cast(a_col[i], dtype)

    return chunk_prepare


#: Side of the diagonal blocks that ``chunk_prepare_blocked_kernel`` inverts by
#: substitution.
BLOCK = 16


@tilelang.jit(target=TARGET, pass_configs=PASS_CONFIGS)
def chunk_prepare_blocked_kernel(dtype: str, K: int,
                                 min_ctas_per_sm: int = PREPARE_MIN_CTAS_PER_SM):
    """The prepare kernel with a blocked inverse on the tensor cores (same arguments and
    outputs as :func:`chunk_prepare_kernel`; one CTA of 128 threads per (chunk, value
    head); ``min_ctas_per_sm`` caps its registers at 65536 / (128 x min_ctas_per_sm)
    so that that many CTAs fit on an SM). With N = N_d + N_o (N_d: the four 16 x 16
    diagonal blocks, N_o: the blocks below them) and block lower-triangular algebra:

        D = (I + N_d)^-1             four 16 x 16 substitutions in fp32 (CUDA cores)
        M = D N_o                    strictly block-lower, so M^4 = 0 and
        A = (I + M)^-1 D = (I - M)(I + M^2) D = X - M X,   X = (I + M^2) D

    The four 64 x 64 x 64 products run on WGMMA with fp16 operands and fp32
    accumulation, all into one accumulator (I + M^2 onto the identity, X - M X onto X's
    fp32 values, with -M as the operand). fp16 keeps 11 mantissa
    bits: with beta |k|^2 <= 1 (L2-normalised keys, beta in (0, 1), the GDN setting) the
    error of A is at or below the bf16 rounding of the stored A, near-parallel keys
    included (tests/sm90/test_prepare_algorithm.py emulates every rounding). Towards the
    edge of stability it grows: 2.9e-3 at beta |k|^2 = 1.5 and 1.1e-2 at 1.9 on
    near-parallel keys (bf16 rounding of A: 1.6e-3); ``chunk_prepare_kernel`` (fp32)
    serves such inputs. Range: while beta |k|^2 <= 2 (each token's I - beta k k^T a
    contraction) D, M, M^2, X stay below ~4 and |A| <= beta |k|^2, far inside fp16;
    past it the inverse grows without bound in any precision (1e11 at 2.5), as does the
    recurrence. Small shared tiles (fp16 operands,
    only the diagonal blocks of N in fp32) keep several CTAs per SM, so one CTA's chain of
    phases overlaps the others'.
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
            T.annotate_min_blocks_per_sm(min_ctas_per_sm)
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
                            d_col[m + 1 + r] -= nd_shared[blk + m + 1 + r, m] * d_col[m]
                    for i in T.unroll(B):
                        d_shared[blk + i, tx] = T.cast(d_col[i], f16)

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


#: The prepare kernels by name (tuning: ``benchmark/tune_chunk_fwd.py`` times each);
#: ``forward.prepare_kernel_name`` says which one ``traits.PREPARE_BLOCKED`` selects.
PREPARE_KERNELS = {
    "prepare": chunk_prepare_kernel,
    "prepare-blocked": chunk_prepare_blocked_kernel,
    # the blocked kernel under other register caps (tuning only)
    "prepare-blocked-uncapped": functools.partial(chunk_prepare_blocked_kernel, min_ctas_per_sm=1),
    "prepare-blocked-8ctas": functools.partial(chunk_prepare_blocked_kernel, min_ctas_per_sm=8),
}
