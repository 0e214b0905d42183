"""The backward's per-chunk input gradients dq, dk, dv, dbeta, dg, all chunks in parallel.

One CTA per (chunk, value head). Given the chunk-start state S0 (from the forward
kernel) and the state gradient at the chunk's end dS1 (from ``chunk_state_grad``), every
gradient of gdn-math.md "Backward of one chunk" is local to the chunk. Rows i, j of the
chunk; gam = chunk cumsum of the gate, kept log2-scaled (``gam2 = gam log2(e)``) so
every exponential is an ``exp2`` of a non-positive number (gates g <= 0; G is clamped
and only formed for i >= j):

    E_i = 2^gam2_i     D_i = 2^(gam2_C - gam2_i)     G_ij = 2^min(gam2_i - gam2_j, 0), i >= j
    forward recompute:
        P  = G * tril(Q K^T)        Ag = (G * A) diag(beta)
        X  = V - E K S0             U  = Ag X
    backward:
        dU  = scale P^T dO + D K dS1          dAg = dU X^T
        dX  = Ag^T dU  (= dV)                 dP  = scale dO U^T
        dQ  = scale E dO S0^T + (dP * G) K
        M   = dAg diag(beta) * G              dN  = strictly_lower(-A^T M A^T)
        dK  = D U dS1^T + (dP * G)^T Q - E dX S0^T + diag(beta) dN K + (diag(beta) dN)^T K
        dbeta_j = sum_i dAg_ij (G * A)_ij + sum_m dN_jm (k_j . k_m)
        dGG = dP * G * tril(Q K^T) + M * A
        dgam_i = sum_j dGG_ij - sum_j dGG_ji
                 + E_i (scale <dO_i, (Q S0)_i> - <dX_i, (K S0)_i>) - dD_i
        dD_i = D_i <(K dS1)_i, U_i>
        last = sum_i dD_i + 2^gam2_C <S0, dS1>
        dg_i = sum_{m >= i} dgam_m + last      (reverse cumsum; gam_C's extra term
                                                reaches every row of the chunk)

Rows past the end of a sequence (a tail chunk reads the next sequence's rows, padding
tokens, or the zeros past the tensor end) have q, k, v and dO zeroed in shared memory
(padding may hold NaN, which no mask cancels), and are cancelled exactly: beta
and every [C, C] factor (P, Ag, M, dP * G, dN) is zero outside ``j <= i < rows`` (P,
Ag, G and dN by selects; M and dP * G as products with the masked G, exact zeros while
dAg and dP are finite, which the zeroed rows and finite states make them),
the gate is clamped to the last valid row (so gam2_C is the sequence's last gam), the
per-row gate terms are zeroed and only valid rows are stored.

Order: every input tile goes out by cp.async at the top (q, k, A first; S0 and dS1, in
q's dtype, straight into their operands), P and Ag are formed while
the rest lands, and independent GEMMs are issued in pairs (``T.wgmma_gemm``) and waited
for where their results are read.

Reductions are batched (``T.reduce_sum(..., batch=)``: the row sums a thread owns in
one cross-warpgroup exchange, its column sums in two, one barrier pair per exchange
instead of one per element; Nsight Compute had barrier waits at 1.25 of 8.2 stall cycles
per instruction). Each reduction gets its own shared workspace (threads x batch x 4 B):
a larger batch can push the kernel past the 227 KB limit.

Resources (sm_90a, K = V = 128, 256 threads): 228,608 B of shared memory, 3.8 KB under
sm_90's 232,448 (S0 and dS1 as dtype operands, 32 KB each; TileLang overlaps buffers
whose lifetimes are disjoint), so one CTA per SM; 255 registers, no spills. The
``<S0, dS1>`` row sums (K of them) are folded onto the C rows of the final reduction,
which needs K = 2 C.
"""

import tilelang.language as T

from ..arch import Arch
from .builder import arch_kernel
from .tile_ops import LOG2E, mma, mma_wait, zero_rows_past
from .traits import CHUNK, GRAD_THREADS


@arch_kernel()
def chunk_bwd_intra_kernel(arch: Arch, dtype: str, K: int, V: int):
    """Build the per-chunk gradient kernel for ``arch``, q/k/v dtype ``dtype`` and head
    dims K, V.
    h and dS1 come in ``dtype``, straight into their GEMM operands; only ``<S0, dS1>``
    (for dg) is summed in fp32. dq, dk are written per value head in ``dtype`` (summed
    over each GVA group afterwards by ``group_sum``).

    Kernel arguments (packed token layout, Tt = total tokens, N sequences, NT real
    chunks, NTmax >= NT grid rows):
        q, k            [Tt, Hk, K]     dtype
        v, do           [Tt, Hv, V]     dtype
        g_cumsum, beta  [Tt, Hv]        fp32
        A               [Tt, Hv, C]     dtype, gate-free inverse per chunk row
        h, dS1          [NT, Hv, K, V]  dtype, chunk-start state and chunk-end state
                                        gradient
        cu_seqlens      [N+1]           int32
        chunk_offsets   [N+1]           int32, first chunk of each sequence (row in h, dS1)
        chunk_idx       [NTmax, 2]      int32, (sequence, chunk within it); -1 rows skipped
        scale           fp32 scalar
        dq, dk          [NG, Tt, Hk, K] dtype out, per value head
                                        hv = hk * NG + g at [g, :, hk]: group-major, so
                                        the caller's GVA sum (NG = Hv / Hk) runs over
                                        the outermost dimension
        dv              [Tt, Hv, V]     dtype out
        dbeta, dg       [Tt, Hv]        fp32 out (dg w.r.t. the raw per-token gate)
    Only rows of real tokens are written.

    The two column sums (dbeta's ``sum_i dAg_ij (G * A)_ij`` and dGG's ``sum_i
    dGG_ij``) are ``T.reduce_sum(dim=0)`` with ``arch.column_sums == "reduce"``; with
    "transposed" (mma.sync fragments, where TileLang 0.1.15 cannot lower a column
    sum) they are row sums of transposed products: ``dAg^T = X dU^T`` times G and A read
    transposed from shared memory, and dGG's columns as ``beta_j`` times dbeta's
    first term (the M * A part) plus the rows of ``dP^T = scale U dO^T`` times P read
    transposed (``P = G * tril(Q K^T)`` in q's dtype: the dP * G * Q K^T part). The
    row sums then read the same rounded P (not ``G * Q K^T`` in fp32), so that each
    diagonal term ``dGG_ii``, in both sums, cancels exactly in ``dgam_i``: under strong
    decay dgam is tiny and a diagonal rounded two ways (P's bf16 step, 2^-9) swamped it.
    """
    C = CHUNK
    gemm = mma(arch)                 # products waited for by ``wait`` (WGMMA)
    wait = mma_wait(arch)
    transposed = arch.column_sums == "transposed"
    assert K == 2 * C and V % 32 == 0      # <S0, dS1> row sums folded onto C rows
    Tt, Hk, Hv, NG, N1, NT, NTmax = T.dynamic("Tt, Hk, Hv, NG, N1, NT, NTmax")
    f32 = "float32"
    BV = V // 2                                    # <S0, dS1> summed in two halves
    LATER_GROUPS = 4                               # cp.async groups after q, k, A

    @T.prim_func
    def chunk_bwd_intra(
        q: T.Tensor((Tt, Hk, K), dtype),
        k: T.Tensor((Tt, Hk, K), dtype),
        v: T.Tensor((Tt, Hv, V), dtype),
        do: T.Tensor((Tt, Hv, V), dtype),
        g_cumsum: T.Tensor((Tt, Hv), f32),
        beta: T.Tensor((Tt, Hv), f32),
        A: T.Tensor((Tt, Hv, C), dtype),
        h: T.Tensor((NT, Hv, K, V), dtype),
        dS1: T.Tensor((NT, Hv, K, V), dtype),
        cu_seqlens: T.Tensor((N1,), "int32"),
        chunk_offsets: T.Tensor((N1,), "int32"),
        chunk_idx: T.Tensor((NTmax, 2), "int32"),
        scale: T.float32,
        dq: T.Tensor((NG, Tt, Hk, K), dtype),
        dk: T.Tensor((NG, Tt, Hk, K), dtype),
        dv: T.Tensor((Tt, Hv, V), dtype),
        dbeta: T.Tensor((Tt, Hv), f32),
        dg: T.Tensor((Tt, Hv), f32),
    ):
        with T.Kernel(NTmax * Hv, threads=GRAD_THREADS) as bid:
            # GEMM operands (dtype); some are reused once their first use is over
            q_shared = T.alloc_shared((C, K), dtype)
            k_shared = T.alloc_shared((C, K), dtype)
            x_shared = T.alloc_shared((C, V), dtype)          # X = V - E K S0
            do_shared = T.alloc_shared((C, V), dtype)
            a_shared = T.alloc_shared((C, C), dtype)
            s0_shared = T.alloc_shared((K, V), dtype)
            ds1_shared = T.alloc_shared((K, V), dtype)
            p_shared = T.alloc_shared((C, C), dtype)          # P, then A^T M
            ag_shared = T.alloc_shared((C, C), dtype)         # Ag, then diag(beta) dN
            u_shared = T.alloc_shared((C, V), dtype)          # V, then U
            du_shared = T.alloc_shared((C, V), dtype)         # dU, then -E dX
            m_shared = T.alloc_shared((C, C), dtype)          # M = dAg diag(beta) * G
            dpg_shared = T.alloc_shared((C, C), dtype)        # G (masked), then dP * G
            # per-row vectors (fp32)
            gam_shared = T.alloc_shared((C,), f32)            # log2-scaled chunk cumsum
            beta_shared = T.alloc_shared((C,), f32)
            vec_shared = T.alloc_shared((8, C), f32)          # per-row partial sums
            dgam_shared = T.alloc_shared((C,), f32)
            ss_shared = T.alloc_shared((K,), f32)             # row sums of S0 * dS1
            gam_frag = T.alloc_fragment((C,), f32)
            beta_frag = T.alloc_fragment((C,), f32)
            # fp32 accumulators
            st_frag = T.alloc_fragment((K, BV), f32)          # half of S0 * dS1
            ss_part = T.alloc_fragment((K,), f32)
            ss_acc = T.alloc_fragment((K,), f32)
            qk_frag = T.alloc_fragment((C, C), f32)           # Q K^T
            cc_frag = T.alloc_fragment((C, C), f32)
            kk_frag = T.alloc_fragment((C, C), f32)           # Ag, A, then K K^T
            dgg_frag = T.alloc_fragment((C, C), f32)          # A, G, then dG * G
            am_frag = T.alloc_fragment((C, C), f32)           # G, M, then A^T M
            ks0_frag = T.alloc_fragment((C, V), f32)          # K S0
            cv_frag = T.alloc_fragment((C, V), f32)
            u_frag = T.alloc_fragment((C, V), f32)
            du_frag = T.alloc_fragment((C, V), f32)
            dx_frag = T.alloc_fragment((C, V), f32)
            dq_frag = T.alloc_fragment((C, K), f32)
            dk_frag = T.alloc_fragment((C, K), f32)
            # one fragment per reduction (each takes the layout of its source)
            r_qs = T.alloc_fragment((C,), f32)
            r_dd = T.alloc_fragment((C,), f32)
            c_dba = T.alloc_fragment((C,), f32)
            r_ks = T.alloc_fragment((C,), f32)
            r_dgg = T.alloc_fragment((C,), f32)
            c_dgg = T.alloc_fragment((C,), f32)
            r_dn = T.alloc_fragment((C,), f32)
            r_dg = T.alloc_fragment((C,), f32)

            # Scalars live in registers (T.alloc_var): as plain let-bindings TileLang
            # re-reads them from global memory at every use.
            chunk = bid // Hv
            hh = T.alloc_var("int32", init=bid % Hv)
            seq = T.alloc_var("int32", init=chunk_idx[chunk, 0])
            if seq >= 0:
                cis = T.alloc_var("int32", init=chunk_idx[chunk, 1])
                t0 = T.alloc_var("int32", init=cu_seqlens[seq] + cis * C)
                rows = T.alloc_var("int32", init=T.min(cu_seqlens[seq + 1] - t0, C))  # 1..C
                hk = T.alloc_var("int32", init=hh // NG)     # GVA: value head -> q/k head
                gv = T.alloc_var("int32", init=hh - hk * NG)  # its place in the group
                srow = T.alloc_var("int32", init=chunk_offsets[seq] + cis)  # row in h, dS1

                # Every input tile in flight at once (cp.async, one commit group each,
                # in order of first use); each phase below waits for its own groups.
                T.async_copy(q[t0:t0 + C, hk, :], q_shared)
                T.async_copy(k[t0:t0 + C, hk, :], k_shared)
                T.async_copy(A[t0:t0 + C, hh, :], a_shared)
                T.async_copy(v[t0:t0 + C, hh, :], u_shared)
                T.async_copy(do[t0:t0 + C, hh, :], do_shared)
                T.async_copy(h[srow, hh, :, :], s0_shared)        # S0, dS1 straight into
                T.async_copy(dS1[srow, hh, :, :], ds1_shared)     # their operands
                for i in T.Parallel(C):
                    gam_frag[i] = g_cumsum[t0 + T.min(i, rows - 1), hh] * LOG2E
                    beta_frag[i] = T.if_then_else(i < rows, beta[t0 + i, hh], 0.0)
                for i in T.Parallel(C):
                    gam_shared[i] = gam_frag[i]
                    beta_shared[i] = beta_frag[i]
                # Rows past the end may hold NaN/Inf (padding tokens): zero them, since a
                # masked factor only cancels them if they are finite (0 * NaN = NaN).
                # (each thread waits for its own copies; the barrier makes them every
                # thread's before any row is zeroed or read)
                T.ptx_wait_group(LATER_GROUPS)                       # q, k, A landed
                T.sync_threads()
                zero_rows_past(q_shared, rows)
                zero_rows_past(k_shared, rows)
                T.fence_proxy_async()                    # -> WGMMA operand reads
                T.sync_threads()
                # ---- forward recompute, while v, dO (and S0, dS1) land: P, Ag
                T.gemm(q_shared, k_shared, qk_frag, transpose_B=True, clear_accum=True)  # Q K^T
                T.copy(a_shared, dgg_frag)                                            # A
                for i, j in T.Parallel(C, C):
                    live = (i >= j) & (i < rows)
                    decay = T.exp2(T.min(gam_shared[i] - gam_shared[j], 0.0))
                    am_frag[i, j] = T.if_then_else(live, decay, 0.0)               # G, masked
                    cc_frag[i, j] = T.if_then_else(live, qk_frag[i, j] * decay, 0.0)
                    kk_frag[i, j] = T.if_then_else(
                        live, dgg_frag[i, j] * decay * beta_shared[j], 0.0)
                T.copy(cc_frag, p_shared)
                T.copy(kk_frag, ag_shared)
                T.copy(am_frag, dpg_shared)                   # G until dP * G replaces it
                T.ptx_wait_group(0)                                  # v, dO (S0, dS1)
                T.sync_threads()
                zero_rows_past(u_shared, rows)
                zero_rows_past(do_shared, rows)

                # the <S0, dS1> row sums: below, while U = Ag X runs
                T.clear(ss_acc)
                T.fence_proxy_async()
                T.sync_threads()

                # ---- forward recompute: X, U
                gemm(k_shared, s0_shared, ks0_frag, clear_accum=True)            # K S0
                gemm(q_shared, s0_shared, cv_frag, clear_accum=True)             # Q S0
                wait(1)                                                       # K S0
                T.copy(u_shared, u_frag)                                              # V
                for i, j in T.Parallel(C, V):
                    u_frag[i, j] = u_frag[i, j] - T.exp2(gam_shared[i]) * ks0_frag[i, j]
                T.copy(u_frag, x_shared)
                T.fence_proxy_async()
                T.sync_threads()
                gemm(ag_shared, x_shared, u_frag, clear_accum=True)              # U = Ag X
                wait(1)                                                       # Q S0
                for i, j in T.Parallel(C, V):
                    cv_frag[i, j] = cv_frag[i, j] * do_shared[i, j]
                T.reduce_sum(cv_frag, r_qs, dim=1, batch=2)                       # <dO, QS0>
                for i in T.Parallel(C):
                    vec_shared[0, i] = r_qs[i] * scale * T.exp2(gam_shared[i])
                for half in T.serial(2):                 # <S0, dS1> row sums
                    for i, j in T.Parallel(K, BV):
                        st_frag[i, j] = (T.cast(s0_shared[i, half * BV + j], f32)
                                         * T.cast(ds1_shared[i, half * BV + j], f32))
                    T.reduce_sum(st_frag, ss_part, dim=1, batch=4)
                    for i in T.Parallel(K):
                        ss_acc[i] = ss_acc[i] + ss_part[i]
                for i in T.Parallel(K):
                    ss_shared[i] = ss_acc[i]
                wait(0)                                                       # U
                T.copy(u_frag, u_shared)

                # ---- dU = scale P^T dO + D K dS1, and dD = D <K dS1, U>
                gemm(p_shared, do_shared, du_frag, transpose_A=True,
                             clear_accum=True)                                        # P^T dO
                gemm(k_shared, ds1_shared, cv_frag, clear_accum=True)            # K dS1
                wait(0)
                for i, j in T.Parallel(C, V):
                    kds = T.exp2(gam_shared[C - 1] - gam_shared[i]) * cv_frag[i, j]
                    du_frag[i, j] = du_frag[i, j] * scale + kds
                    cv_frag[i, j] = kds * u_frag[i, j]
                T.copy(du_frag, du_shared)
                T.reduce_sum(cv_frag, r_dd, dim=1, batch=2)
                for i in T.Parallel(C):
                    vec_shared[1, i] = T.if_then_else(i < rows, r_dd[i], 0.0)        # dD

                # ---- dAg = dU X^T: dbeta (first term), M, and dGG's M * A; dX = Ag^T dU
                # (= dV) issued behind it, waited for below
                gemm(du_shared, x_shared, cc_frag, transpose_B=True, clear_accum=True)
                gemm(ag_shared, du_shared, dx_frag, transpose_A=True, clear_accum=True)
                T.copy(a_shared, kk_frag)                                             # A
                T.copy(dpg_shared, dgg_frag)                                          # G
                wait(1)                                                       # dAg
                for i, j in T.Parallel(C, C):
                    dagg = cc_frag[i, j] * dgg_frag[i, j]               # dAg * G (0: masked)
                    am_frag[i, j] = dagg * beta_shared[j]                                # M
                    cc_frag[i, j] = dagg * kk_frag[i, j]                                 # dAg * GA
                    dgg_frag[i, j] = dagg * kk_frag[i, j] * beta_shared[j]               # M * A
                T.copy(am_frag, m_shared)
                if transposed:                   # dAg^T = X dU^T; G, A read transposed
                    T.gemm(x_shared, du_shared, cc_frag, transpose_B=True, clear_accum=True)
                    for j, i in T.Parallel(C, C):
                        cc_frag[j, i] = (cc_frag[j, i] * T.cast(dpg_shared[i, j], f32)
                                         * T.cast(a_shared[i, j], f32))
                    T.reduce_sum(cc_frag, c_dba, dim=1, batch=2)
                else:
                    T.reduce_sum(cc_frag, c_dba, dim=0, batch=4)
                for j in T.Parallel(C):
                    vec_shared[2, j] = c_dba[j]                                       # dbeta, 1st

                # ---- dX = Ag^T dU (= dV); -E dX replaces dU as an operand
                wait(0)                                                       # dX
                for i, j in T.Parallel(C, V):
                    if i < rows:
                        dv[t0 + i, hh, j] = dx_frag[i, j]
                for i, j in T.Parallel(C, V):
                    dx_frag[i, j] = -T.exp2(gam_shared[i]) * dx_frag[i, j]              # -E dX
                    cv_frag[i, j] = dx_frag[i, j] * ks0_frag[i, j]
                T.copy(dx_frag, du_shared)
                T.reduce_sum(cv_frag, r_ks, dim=1, batch=2)                       # -E <dX, KS0>
                for i in T.Parallel(C):
                    vec_shared[3, i] = r_ks[i]

                # ---- dP = scale dO U^T: dP * G, and dGG's dP * G * QK (K K^T, for dN
                # below, issued behind it)
                gemm(do_shared, u_shared, cc_frag, transpose_B=True, clear_accum=True)
                gemm(k_shared, k_shared, kk_frag, transpose_B=True, clear_accum=True)
                gemm(a_shared, m_shared, am_frag, transpose_A=True,
                             clear_accum=True)                                        # A^T M
                wait(2)                                                       # dP
                if transposed:       # dGG reads the P the column sums read (see above)
                    for i, j in T.Parallel(C, C):
                        dp = cc_frag[i, j] * scale
                        cc_frag[i, j] = dp * T.cast(dpg_shared[i, j], f32)             # * G
                        dgg_frag[i, j] = dgg_frag[i, j] + dp * T.cast(p_shared[i, j], f32)
                else:
                    for i, j in T.Parallel(C, C):
                        dpg = cc_frag[i, j] * scale * T.cast(dpg_shared[i, j], f32)     # * G
                        cc_frag[i, j] = dpg
                        dgg_frag[i, j] = dgg_frag[i, j] + dpg * qk_frag[i, j]
                T.copy(cc_frag, dpg_shared)
                T.reduce_sum(dgg_frag, r_dgg, dim=1, batch=2)
                if transposed:                   # dP^T = U dO^T (Q K^T's last use is over)
                    T.gemm(u_shared, do_shared, qk_frag, transpose_B=True, clear_accum=True)
                    for j, i in T.Parallel(C, C):
                        qk_frag[j, i] = qk_frag[j, i] * scale * T.cast(p_shared[i, j], f32)
                    T.reduce_sum(qk_frag, c_dgg, dim=1, batch=2)
                    for j in T.Parallel(C):                     # + the M * A columns
                        c_dgg[j] = c_dgg[j] + beta_shared[j] * c_dba[j]
                else:
                    T.reduce_sum(dgg_frag, c_dgg, dim=0, batch=4)
                for i in T.Parallel(C):
                    vec_shared[4, i] = r_dgg[i]                                          # dGG rows
                for j in T.Parallel(C):
                    vec_shared[6, j] = c_dgg[j]                                       # dGG cols

                # ---- dN = strictly_lower(-A^T M A^T): dbeta (second term), diag(beta) dN
                wait(0)                                                # K K^T, A^T M
                T.copy(am_frag, p_shared)
                T.gemm(p_shared, a_shared, cc_frag, transpose_B=True, clear_accum=True)  # A^T M A^T
                for i, j in T.Parallel(C, C):
                    dn = T.if_then_else((i > j) & (i < rows), -cc_frag[i, j], 0.0)
                    cc_frag[i, j] = dn * beta_shared[i]
                    kk_frag[i, j] = dn * kk_frag[i, j]
                T.copy(cc_frag, ag_shared)
                T.reduce_sum(kk_frag, r_dn, dim=1, batch=2)
                for i in T.Parallel(C):
                    vec_shared[5, i] = r_dn[i]                                       # dbeta, 2nd

                # ---- dQ = (scale E dO) S0^T + (dP * G) K and
                # dK = (D U) dS1^T + (dP * G)^T Q - E dX S0^T + bdN K + bdN^T K: the row
                # factors go into dO and U (their last use), then seven products in flight
                T.copy(do_shared, cv_frag)
                T.copy(u_shared, du_frag)
                for i, j in T.Parallel(C, V):
                    cv_frag[i, j] = cv_frag[i, j] * (scale * T.exp2(gam_shared[i]))
                    du_frag[i, j] = du_frag[i, j] * T.exp2(gam_shared[C - 1] - gam_shared[i])
                T.copy(cv_frag, do_shared)
                T.copy(du_frag, u_shared)
                T.fence_proxy_async()
                T.sync_threads()
                gemm(do_shared, s0_shared, dq_frag, transpose_B=True, clear_accum=True)
                gemm(dpg_shared, k_shared, dq_frag)
                gemm(u_shared, ds1_shared, dk_frag, transpose_B=True, clear_accum=True)
                gemm(dpg_shared, q_shared, dk_frag, transpose_A=True)
                gemm(du_shared, s0_shared, dk_frag, transpose_B=True)
                gemm(ag_shared, k_shared, dk_frag)
                gemm(ag_shared, k_shared, dk_frag, transpose_A=True)
                wait(5)                                                       # dQ
                for i, j in T.Parallel(C, K):
                    if i < rows:
                        dq[gv, t0 + i, hk, j] = dq_frag[i, j]
                wait(0)                                                       # dK
                for i, j in T.Parallel(C, K):
                    if i < rows:
                        dk[gv, t0 + i, hk, j] = dk_frag[i, j]

                # ---- dbeta, and dg = reverse cumsum of dgam (+ the gam_C terms on every row)
                for i in T.Parallel(C):
                    if i < rows:
                        dbeta[t0 + i, hh] = vec_shared[2, i] + vec_shared[5, i]
                    dgam_shared[i] = T.if_then_else(
                        i < rows,
                        (vec_shared[4, i] - vec_shared[6, i] + vec_shared[0, i]
                         + vec_shared[3, i] - vec_shared[1, i]),
                        0.0)
                    vec_shared[7, i] = T.exp2(gam_shared[C - 1]) * (ss_shared[i] + ss_shared[i + C])
                for i, m in T.Parallel(C, C):
                    cc_frag[i, m] = (T.if_then_else(m >= i, dgam_shared[m], 0.0)
                                     + vec_shared[1, m] + vec_shared[7, m])
                T.reduce_sum(cc_frag, r_dg, dim=1, batch=2)
                for i in T.Parallel(C):
                    if i < rows:
                        dg[t0 + i, hh] = r_dg[i]

    return chunk_bwd_intra
