"""Fused chunk-recurrent forward with the transposed state in registers (v3, step 1).

Same math as ``chunk_fwd`` (gdn-math.md, "Chunked form"), written for S^T (V x K) so
that the value dimension is the WGMMA M dimension: each of the two consumer warpgroups
owns 64 rows of S^T, and S^T, (V - E K S)^T and U^T feed the next GEMM as *register*
A operands (``wgmma_rs``): no shared-memory copy, fence or barrier on the state chain.
One CTA per (sequence, value head) holds the whole state. Per chunk (rows i, j / columns
t of the chunk, gam = chunk cumsum, E = diag(exp(gam)), D = diag(exp(gam_C - gam))):

    O^T  = S0^T Q^T                      (K S0)^T = S0^T K^T          # [V, C], RS
    R    = V^T - (K S0)^T E              Ag = (G * A) diag(beta)     # [V, C], [C, C]
    U^T  = R Ag^T                        P  = G * tril(Q K^T)        # [V, C], [C, C]
    O^T  = scale (O^T E + U^T P^T)
    S1^T = exp(gam_C) S0^T + (U^T D) K                                # [V, K], RS

Rows past a sequence's end: R's columns are selected to 0 and K's rows zeroed (NaN in
padding never meets a GEMM), P and Ag are masked, and only valid rows are stored.

Status: verified on an H200 (tests/sm90/test_forward_gpu.py::
test_transposed_kernel_matches_recurrence, and every forward test while it was the
default); 5.8 us per chunk for the whole state. Its successor with the state-independent
work on an aux warpgroup, ``chunk_fwd_ws``, is the default; this kernel runs with
``traits.FWD_AUX_WARPGROUP`` off.
"""

import tilelang
import tilelang.language as T

from .tile_ops import fetch_gates, stage_gates, zero_rows_past
from .traits import CHUNK, FWD_STAGES, FWD_THREADS, PASS_CONFIGS, TARGET

ROWS = T.GemmWarpPolicy.FullRow     # warpgroups split M (= V): the RS operands' layout


@tilelang.jit(target=TARGET, pass_configs=PASS_CONFIGS)
def chunk_fwd_t_kernel(dtype: str, K: int, V: int, has_initial_state: bool, store_h: bool):
    """Build the transposed-state forward; arguments and outputs as ``chunk_fwd_kernel``
    (state layouts stay [.., K, V]: the kernel transposes on load and store).
    (K S0)^T, Q K^T, (Q S0)^T, U^T and O^T += U^T P^T are issued asynchronously
    (``T.wgmma_gemm``) and waited for where a result is read: 2-4% faster than waiting
    for each (H200, docs/perf-notes.md)."""
    C = CHUNK
    Tt, Hk, Hv, N, N1, NTh = T.dynamic("Tt, Hk, Hv, N, N1, NTh")
    f32 = "float32"

    @T.prim_func
    def chunk_fwd_t(
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
        with T.Kernel(N * Hv, threads=FWD_THREADS) as bx:
            # the TMA producer warpgroup needs few registers; the state warpgroups hold
            # S^T (64 fp32 + 32 packed bf16 per thread) and the chunk's [V, C] tiles
            T.annotate_producer_reg_dealloc(24)
            T.annotate_consumer_reg_alloc(240)
            q_shared = T.alloc_shared((C, K), dtype)
            k_shared = T.alloc_shared((C, K), dtype)
            v_shared = T.alloc_shared((C, V), dtype)
            a_shared = T.alloc_shared((C, C), dtype)
            gam_shared = T.alloc_shared((C,), f32)            # log2-scaled gam
            eg_shared = T.alloc_shared((C,), f32)             # exp(gam)
            ed_shared = T.alloc_shared((C,), f32)             # exp(gam_C - gam)
            beta_shared = T.alloc_shared((C,), f32)
            g_next = T.alloc_fragment((C,), f32)
            glast_next = T.alloc_fragment((C,), f32)
            beta_next = T.alloc_fragment((C,), f32)
            st = T.alloc_fragment((V, K), f32)                # S^T, fp32
            st_b = T.alloc_fragment((V, K), dtype)            # S^T as a register operand
            qk_frag = T.alloc_fragment((C, C), f32)
            ag_shared = T.alloc_shared((C, C), dtype)
            p_shared = T.alloc_shared((C, C), dtype)
            ks = T.alloc_fragment((V, C), f32)                # (K S0)^T
            r_b = T.alloc_fragment((V, C), dtype)             # R = V^T - (K S0)^T E
            # U^T reuses (K S0)^T's registers and its dtype copy R's: both are dead by then
            u = ks                                            # U^T
            u_b = r_b
            du_b = T.alloc_fragment((V, C), dtype)            # U^T D
            ot = T.alloc_fragment((V, C), f32)                # O^T
            o_shared = T.alloc_shared((C, V), dtype)

            n = T.alloc_var("int32", init=bx // Hv)
            h = T.alloc_var("int32", init=bx % Hv)
            hk = T.alloc_var("int32", init=h // (Hv // Hk))
            bos = T.alloc_var("int32", init=cu_seqlens[n])
            seq_len = T.alloc_var("int32", init=cu_seqlens[n + 1] - bos)
            last = T.alloc_var("int32", init=bos + seq_len - 1)
            first_chunk = T.alloc_var("int32", init=chunk_offsets[n])

            if has_initial_state:
                for i, j in T.Parallel(V, K):
                    st[i, j] = initial_state[n, h, j, i]
            else:
                T.clear(st)
            if seq_len > 0:                                  # gates of chunk 0
                fetch_gates(g_cumsum, beta, h, bos, last, g_next, glast_next, beta_next)

            for c in T.Pipelined(T.ceildiv(seq_len, C), num_stages=FWD_STAGES):
                t0 = bos + c * C
                rows = T.min(seq_len - c * C, C)
                T.copy(q[t0:t0 + C, hk, :], q_shared)
                T.copy(k[t0:t0 + C, hk, :], k_shared)
                T.copy(v[t0:t0 + C, h, :], v_shared)
                T.copy(A[t0:t0 + C, h, :], a_shared)
                stage_gates(g_next, glast_next, beta_next, gam_shared, eg_shared, ed_shared,
                            beta_shared)
                fetch_gates(g_cumsum, beta, h, t0 + C, last, g_next, glast_next, beta_next)

                if store_h:
                    for i, j in T.Parallel(V, K):
                        h_out[first_chunk + c, h, j, i] = st[i, j]
                for i, j in T.Parallel(V, K):
                    st_b[i, j] = st[i, j]
                T.wgmma_gemm(st_b, k_shared, ks, transpose_B=True, clear_accum=True,
                             policy=ROWS)                                   # (K S0)^T
                T.wgmma_gemm(q_shared, k_shared, qk_frag, transpose_B=True,
                             clear_accum=True)                                # Q K^T
                T.wgmma_gemm(st_b, q_shared, ot, transpose_B=True, clear_accum=True,
                             policy=ROWS)                                   # (Q S0)^T
                for i, j in T.Parallel(C, C):
                    ag_shared[i, j] = T.if_then_else(
                        (i >= j) & (i < rows),
                        a_shared[i, j] * T.exp2(T.min(gam_shared[i] - gam_shared[j], 0.0))
                        * beta_shared[j], 0.0)
                T.wait_wgmma(1)                                           # (K S0)^T, Q K^T
                for i, j in T.Parallel(C, C):
                    p_shared[i, j] = T.if_then_else(
                        (i >= j) & (i < rows),
                        qk_frag[i, j] * T.exp2(T.min(gam_shared[i] - gam_shared[j], 0.0)), 0.0)
                for i, t in T.Parallel(V, C):
                    r_b[i, t] = T.if_then_else(
                        t < rows, v_shared[t, i] - eg_shared[t] * ks[i, t], 0.0)
                # K's rows past the end (NaN in padding): zeroed once K S0 / Q K^T are done
                zero_rows_past(k_shared, rows)
                T.wgmma_gemm(r_b, ag_shared, u, transpose_B=True, clear_accum=True,
                             policy=ROWS)                                   # U^T
                T.wait_wgmma(0)                                           # U^T, (Q S0)^T
                for i, t in T.Parallel(V, C):
                    u_b[i, t] = u[i, t]
                    du_b[i, t] = u[i, t] * ed_shared[t]
                    ot[i, t] = ot[i, t] * eg_shared[t]
                T.wgmma_gemm(u_b, p_shared, ot, transpose_B=True, policy=ROWS)        # + U^T P^T
                for i, j in T.Parallel(V, K):
                    st[i, j] = st[i, j] * eg_shared[C - 1]
                T.gemm(du_b, k_shared, st, policy=ROWS)                               # + (U^T D) K
                for t, i in T.Parallel(C, V):
                    o_shared[t, i] = ot[i, t] * scale
                for t, i in T.Parallel(C, V):
                    if t < rows:
                        o[t0 + t, h, i] = o_shared[t, i]

            for i, j in T.Parallel(V, K):
                final_state[n, h, j, i] = st[i, j]

    return chunk_fwd_t
