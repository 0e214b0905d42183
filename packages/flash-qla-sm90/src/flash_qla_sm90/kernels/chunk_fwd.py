"""Fused chunk-recurrent forward: the state stays on chip across all chunks of a sequence.

One CTA per (sequence, value head, BLOCK_V columns of the state). It walks the chunks
of its sequence in order, keeping S (K x BLOCK_V, fp32) in registers, and per chunk
computes (gdn-math.md, "Chunked form"; rows i, j of the chunk, gam = chunk cumsum):

    KS  = K S0,  QS = Q S0,  QK = Q K^T                 # [C,BV], [C,BV], [C,C]
    X   = V - E KS                                      # E = diag(exp(gam))
    Ag  = (G * A) diag(beta),  P = G * tril(QK)         # G_ij = exp(gam_i - gam_j), i >= j
    U   = Ag X                                          # FLA's v_new, never stored
    O   = scale * (E QS + P U)
    S1  = exp(gam_C) S0 + K^T (D U),  D = diag(exp(gam_C - gam))

Only o, the final state and (on request) the chunk-start states h reach global memory.
Every exponent is <= 0 and evaluated as exp2 of log2-scaled gates. Rows past the end of
the sequence are masked: they read the last valid gam, get beta = 0, their X and K rows
are zeroed (so NaN/Inf in padding never reaches a GEMM as 0 * NaN), and are not stored.

Schedule (v2). The S chain of a chunk is S0 -> KS -> X -> U -> S1; everything else
hangs off it. GEMMs are issued asynchronously (``T.wgmma_gemm``) where their result is
read later: K S0 and Q K^T run on the tensor cores while the consumer builds Ag, U = Ag X
while it builds P, and P U beside K^T (D U). The per-row factors
exp(gam), exp(gam_C - gam) are computed once per chunk (64 exp2, not one per element),
and the next chunk's gates are loaded into registers while this chunk computes.
"""

import tilelang
import tilelang.language as T

from .tile_ops import fetch_gates, stage_gates, zero_rows_past
from .traits import BLOCK_V, CHUNK, FWD_STAGES, FWD_THREADS, PASS_CONFIGS, TARGET


@tilelang.jit(target=TARGET, pass_configs=PASS_CONFIGS)
def chunk_fwd_kernel(dtype: str, K: int, V: int, has_initial_state: bool, store_h: bool,
                     block_v: int = BLOCK_V, threads: int = FWD_THREADS,
                     stages: int = FWD_STAGES):
    """Build the fused forward for one static configuration.

    Kernel arguments (packed token layout, Tt = total tokens, N sequences):
        q, k            [Tt, Hk, K]     dtype
        v               [Tt, Hv, V]     dtype
        g_cumsum        [Tt, Hv]        fp32, chunk-local cumsum of the log gate
        beta            [Tt, Hv]        fp32
        A               [Tt, Hv, C]     dtype, gate-free inverse per chunk row
        cu_seqlens      [N+1]           int32
        chunk_offsets   [N+1]           int32, first chunk of each sequence (for h)
        initial_state   [N, Hv, K, V]   fp32 (ignored unless has_initial_state)
        scale           fp32 scalar
        o               [Tt, Hv, V]     dtype out (rows of every sequence)
        final_state     [N, Hv, K, V]   fp32 out
        h               [NTh, Hv, K, V] fp32 out, chunk-start states (written if store_h)

    ``block_v``, ``threads`` (consumer threads) and ``stages`` default to ``traits``;
    other values exist for tuning (``benchmark/tune_chunk_fwd.py``).
    """
    C, BV = CHUNK, block_v
    Tt, Hk, Hv, N, N1, NTh = T.dynamic("Tt, Hk, Hv, N, N1, NTh")
    f32 = "float32"

    @T.prim_func
    def chunk_fwd(
        q: T.Tensor((Tt, Hk, K), dtype),
        k: T.Tensor((Tt, Hk, K), dtype),
        v: T.Tensor((Tt, Hv, V), dtype),
        g_cumsum: T.Tensor((Tt, Hv), f32),
        beta: T.Tensor((Tt, Hv), f32),
        A: T.Tensor((Tt, Hv, C), dtype),
        cu_seqlens: T.Tensor((N1,), "int32"),
        chunk_offsets: T.Tensor((N1,), "int32"),
        initial_state: T.Tensor((N, Hv, K, V), f32),
        scale: T.float32,
        o: T.Tensor((Tt, Hv, V), dtype),
        final_state: T.Tensor((N, Hv, K, V), f32),
        h_out: T.Tensor((NTh, Hv, K, V), f32),
    ):
        with T.Kernel(N * Hv, V // BV, threads=threads) as (bx, by):
            q_shared = T.alloc_shared((C, K), dtype)
            k_shared = T.alloc_shared((C, K), dtype)
            v_shared = T.alloc_shared((C, BV), dtype)
            a_shared = T.alloc_shared((C, C), dtype)
            # per-row gate factors of the current chunk (log2-scaled gam):
            gam_shared = T.alloc_shared((C,), f32)            # gam_i
            eg_shared = T.alloc_shared((C,), f32)             # exp(gam_i)
            ed_shared = T.alloc_shared((C,), f32)             # exp(gam_C - gam_i)
            beta_shared = T.alloc_shared((C,), f32)
            # the next chunk's gates, in flight in registers
            g_next = T.alloc_fragment((C,), f32)
            glast_next = T.alloc_fragment((C,), f32)
            beta_next = T.alloc_fragment((C,), f32)
            s_frag = T.alloc_fragment((K, BV), f32)           # the state S, fp32
            s_shared = T.alloc_shared((K, BV), dtype)         # S as a GEMM operand
            ks_frag = T.alloc_fragment((C, BV), f32)
            qk_frag = T.alloc_fragment((C, C), f32)
            x_shared = T.alloc_shared((C, BV), dtype)
            ag_shared = T.alloc_shared((C, C), dtype)
            p_shared = T.alloc_shared((C, C), dtype)
            # BLOCK_V 128 holds S in 64 registers per thread: U then reuses KS's registers
            # (KS is dead once X is built); narrower tiles keep their own fragment.
            u_frag = ks_frag if BV >= 128 else T.alloc_fragment((C, BV), f32)
            u_shared = T.alloc_shared((C, BV), dtype)
            du_shared = T.alloc_shared((C, BV), dtype)
            o_frag = T.alloc_fragment((C, BV), f32)
            o_shared = T.alloc_shared((C, BV), dtype)

            # Scalars in registers (T.alloc_var): let-bound ones are re-derived, integer
            # divisions and global reads included, at every use.
            n = T.alloc_var("int32", init=bx // Hv)
            h = T.alloc_var("int32", init=bx % Hv)
            hk = T.alloc_var("int32", init=h // (Hv // Hk))  # GVA: value head -> q/k head
            v0 = by * BV
            bos = T.alloc_var("int32", init=cu_seqlens[n])
            seq_len = T.alloc_var("int32", init=cu_seqlens[n + 1] - bos)
            last = T.alloc_var("int32", init=bos + seq_len - 1)   # last token (if any)
            # the chunk-start rows of h: a global read per chunk would stall the store
            first_chunk = T.alloc_var("int32", init=chunk_offsets[n])

            if has_initial_state:
                T.copy(initial_state[n, h, :, v0:v0 + BV], s_frag)
            else:
                T.clear(s_frag)
            if seq_len > 0:                                  # gates of chunk 0
                fetch_gates(g_cumsum, beta, h, bos, last, g_next, glast_next, beta_next)

            for c in T.Pipelined(T.ceildiv(seq_len, C), num_stages=stages):
                t0 = bos + c * C
                rows = T.min(seq_len - c * C, C)             # valid rows of this chunk
                T.copy(q[t0:t0 + C, hk, :], q_shared)
                T.copy(k[t0:t0 + C, hk, :], k_shared)
                T.copy(v[t0:t0 + C, h, v0:v0 + BV], v_shared)
                T.copy(A[t0:t0 + C, h, :], a_shared)
                # Gates go global -> registers -> shared inside the consumer: a direct
                # global -> shared copy would join the producer's stage ring and be
                # released (and overwritten) with q, while it is still being read.
                stage_gates(g_next, glast_next, beta_next, gam_shared, eg_shared, ed_shared,
                            beta_shared)
                # prefetch chunk c + 1 (clamped to this sequence; unused after the last)
                fetch_gates(g_cumsum, beta, h, t0 + C, last, g_next, glast_next, beta_next)

                if store_h:
                    T.copy(s_frag, h_out[first_chunk + c, h, :, v0:v0 + BV])
                T.copy(s_frag, s_shared)
                # A TMA stage is handed back to the producer right after its buffer's
                # last GEMM is issued, so each buffer's last GEMM is a synchronous one
                # (q: Q S0, k: K^T D U); the others run asynchronously beside the
                # element-wise work.
                T.wgmma_gemm(k_shared, s_shared, ks_frag, clear_accum=True)              # K S0
                T.wgmma_gemm(q_shared, k_shared, qk_frag, transpose_B=True,
                             clear_accum=True)                                            # Q K^T
                # off the S chain, while the GEMMs run: Ag = (G * A) diag(beta)
                for i, j in T.Parallel(C, C):
                    ag_shared[i, j] = T.if_then_else(
                        (i >= j) & (i < rows),
                        a_shared[i, j] * T.exp2(gam_shared[i] - gam_shared[j]) * beta_shared[j],
                        0.0)
                T.gemm(q_shared, s_shared, o_frag, clear_accum=True)                     # Q S0
                for i, j in T.Parallel(C, BV):
                    x_shared[i, j] = T.if_then_else(
                        i < rows, v_shared[i, j] - eg_shared[i] * ks_frag[i, j], 0.0)
                T.wgmma_gemm(ag_shared, x_shared, u_frag, clear_accum=True)              # U = Ag X
                for i, j in T.Parallel(C, C):
                    p_shared[i, j] = T.if_then_else(
                        (i >= j) & (i < rows),
                        qk_frag[i, j] * T.exp2(gam_shared[i] - gam_shared[j]), 0.0)
                T.wait_wgmma(0)                                                           # U
                # A sequence's last chunk reads rows of the next sequence or of padding,
                # which may hold NaN/Inf: X's rows past the end are selected to 0 above,
                # and K's are zeroed here (K S0 and Q K^T have completed; only their
                # masked rows/columns read them), since K^T (D U) would make 0 * NaN = NaN.
                zero_rows_past(k_shared, rows)
                for i, j in T.Parallel(C, BV):
                    u_shared[i, j] = u_frag[i, j]
                    du_shared[i, j] = ed_shared[i] * u_frag[i, j]
                    o_frag[i, j] = o_frag[i, j] * eg_shared[i]
                for i, j in T.Parallel(K, BV):
                    s_frag[i, j] = s_frag[i, j] * eg_shared[C - 1]
                T.wgmma_gemm(p_shared, u_shared, o_frag)                                  # + P U
                T.gemm(k_shared, du_shared, s_frag, transpose_A=True)                    # + K^T D U
                for i, j in T.Parallel(C, BV):
                    o_shared[i, j] = o_frag[i, j] * scale
                for i, j in T.Parallel(C, BV):
                    if i < rows:
                        o[t0 + i, h, v0 + j] = o_shared[i, j]

            T.copy(s_frag, final_state[n, h, :, v0:v0 + BV])

    return chunk_fwd
