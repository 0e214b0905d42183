"""The backward's input gradients on sub-chunks, with the state pair split over V: the
per-chunk gradient kernel of an arch whose shared memory cannot hold S0 and dS1 (32 KB
each in q's dtype) beside a chunk's tiles (SM120 / SM121: 99 KB per block).

One CTA per (sub-chunk, value head) computes the quantities of ``chunk_input_grads``
(whose docstring has the formulas, rows past the end handled the same way) for SC =
``arch.sub_chunk`` tokens. The chunked form holds at any chunk length: a sub-chunk is a
chunk of its own given the state at its start, S0, and the state gradient at its end,
dS1, which the forward (``chunk_state_output``, h in q's dtype) and the sweep
(``chunk_state_grad``) store per sub-chunk on such an arch (row ``SUBS * chunk + s``).
Its inverse is the diagonal SC x SC block of its 64-token chunk's A (A is block lower
triangular), and its gates are rebased to its own start, so dg is the gradient of the
raw per-token gate as in the 64-token kernel.

S0 and dS1 pass through shared memory in ``STATE_BLOCKS`` column blocks over V, ``[K,
V / STATE_BLOCKS]``, with the same columns of v and dO. Everything linear in V per column
(X, U, dU, dX = dV) is computed per block; every product that sums over V accumulates
over the blocks in registers: the [SC, SC] products (dAg = dU X^T and its transpose X
dU^T, dP = dO U^T and U dO^T), dQ's ``scale E dO S0^T``, dK's ``D U dS1^T - E dX S0^T``,
and the element products behind dg's row sums (``<dO, Q S0>``, ``<E dX, K S0>``, ``<D K
dS1, U>``), which are reduced once after the blocks; ``<S0, dS1>``'s [K] row sums are
reduced per block. After the blocks the [SC, SC] factors (M, dP * G, dN) are formed once,
in the blocks' freed tiles (M in X's, dP * G in dU's: a block is SC columns wide), and
the products over the sub-chunk's rows (dP * G with K and Q, diag(beta) dN with K) finish
dq and dk. G is recomputed from the gates where it is read. Column sums are row sums of
transposed products (``arch.column_sums == "transposed"``, as mma.sync fragments need);
the diagonal terms of dGG read the same rounded P in both sums, as in
``chunk_input_grads``.

Plain ``T.gemm`` (mma.sync on every target of such an arch), cp.async loads, TileLang's
automatic synchronisation. Sized for two CTAs per SM (SC = 32, K = V = 128, 256 threads:
~47 KB of shared memory against SM120's 50,176 B per CTA at two, <= 128 registers,
``T.annotate_min_blocks_per_sm(2)``; checked by the compile tests): the kernel is a chain
of ~80 short dependent steps, and a second CTA's warps hide each one's latency.
"""

import functools
import operator

import tilelang.language as T

from ..arch import Arch
from .builder import arch_kernel
from .tile_ops import LOG2E, zero_rows_past
from .traits import CHUNK, GRAD_THREADS

#: column blocks of the state pair over V (V / 4 = SC at V = 128: a block's [SC, V / 4]
#: tiles take the [SC, SC] factors after the blocks)
STATE_BLOCKS = 4
#: CTAs per SM the kernel is built for (``__launch_bounds__``: ptxas keeps <= 128
#: registers a thread at 256 threads)
CTAS_PER_SM = 2


@arch_kernel()
def chunk_bwd_intra_split_kernel(arch: Arch, dtype: str, K: int, V: int):
    """Build the sub-chunk gradient kernel for ``arch`` (``arch.sub_chunk`` < 64, column
    sums "transposed"), q/k/v dtype ``dtype``, head dims K, V (``V / STATE_BLOCKS`` =
    ``arch.sub_chunk``).

    Kernel arguments: those of ``chunk_input_grads.chunk_bwd_intra_kernel``, except that
    h and dS1 hold a row per sub-chunk, ``[NT * SUBS, Hv, K, V]`` in ``dtype`` (SUBS =
    64 / SC; the row of sub-chunk s of chunk ``chunk_offsets[n] + c`` is
    ``(chunk_offsets[n] + c) * SUBS + s``; a sub-chunk past its sequence's end has a row
    that is never read); the grid is ``NTmax * SUBS * Hv``: CTA ``(r, h)`` takes
    sub-chunk ``r % SUBS`` of ``chunk_idx[r // SUBS]`` and exits where that chunk or
    sub-chunk holds no token. Only rows of real tokens are written."""
    C = CHUNK
    SC = arch.sub_chunk
    SUBS = C // SC
    assert SUBS * SC == C and SUBS > 1, SC
    assert arch.column_sums == "transposed"
    BV = V // STATE_BLOCKS                         # the state's columns per block
    assert BV * STATE_BLOCKS == V and BV == SC, (V, SC)
    assert K % SC == 0
    FOLD = K // SC                                 # <S0, dS1>'s K row sums per dg row
    Tt, Hk, Hv, NG, N1, NT, NTmax = T.dynamic("Tt, Hk, Hv, NG, N1, NT, NTmax")
    f32 = "float32"

    @T.prim_func
    def chunk_bwd_intra_split(
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
        with T.Kernel(NTmax * SUBS * Hv, threads=GRAD_THREADS) as bid:
            T.annotate_min_blocks_per_sm(CTAS_PER_SM)
            # the sub-chunk's tiles, for every block
            q_s = T.alloc_shared((SC, K), dtype)
            k_s = T.alloc_shared((SC, K), dtype)
            a_s = T.alloc_shared((SC, SC), dtype)             # A's diagonal block
            p_s = T.alloc_shared((SC, SC), dtype)             # P, then A^T M
            ag_s = T.alloc_shared((SC, SC), dtype)            # Ag, then diag(beta) dN
            # one block's tiles ([SC, BV] = [SC, SC])
            s0_s = T.alloc_shared((K, BV), dtype)
            ds1_s = T.alloc_shared((K, BV), dtype)
            v_s = T.alloc_shared((SC, BV), dtype)             # V, then U, then D U
            do_s = T.alloc_shared((SC, BV), dtype)            # dO, then scale E dO
            x_s = T.alloc_shared((SC, BV), dtype)             # X = V - E K S0; then M
            du_s = T.alloc_shared((SC, BV), dtype)            # dU, then -E dX; then dP * G
            # per-row vectors (fp32)
            gam_s = T.alloc_shared((SC,), f32)                # log2-scaled, rebased
            beta_s = T.alloc_shared((SC,), f32)
            vec_s = T.alloc_shared((7, SC), f32)
            dgam_s = T.alloc_shared((SC,), f32)
            ss_s = T.alloc_shared((K,), f32)                  # row sums of S0 * dS1
            gam_f = T.alloc_fragment((SC,), f32)
            beta_f = T.alloc_fragment((SC,), f32)
            # [SC, SC] fragments; the four accumulators sum over the blocks
            qk = T.alloc_fragment((SC, SC), f32)              # Q K^T, P, then M
            cc = T.alloc_fragment((SC, SC), f32)              # A, Ag, then A^T M (A^T)
            gf = T.alloc_fragment((SC, SC), f32)              # K K^T
            dgg = T.alloc_fragment((SC, SC), f32)
            dag = T.alloc_fragment((SC, SC), f32)             # dU X^T
            dag_t = T.alloc_fragment((SC, SC), f32)           # X dU^T
            dp = T.alloc_fragment((SC, SC), f32)              # dO U^T
            dp_t = T.alloc_fragment((SC, SC), f32)            # U dO^T
            # [SC, BV] per block (acc_*: element products summed over the blocks)
            ks0 = T.alloc_fragment((SC, BV), f32)             # K S0
            cv = T.alloc_fragment((SC, BV), f32)
            u_f = T.alloc_fragment((SC, BV), f32)
            du_f = T.alloc_fragment((SC, BV), f32)
            acc_g = T.alloc_fragment((SC, BV), f32)           # dgam's terms linear in V
            acc_d = T.alloc_fragment((SC, BV), f32)           # D K dS1 * U
            st = T.alloc_fragment((K, BV), f32)               # S0 * dS1
            dq_f = T.alloc_fragment((SC, K), f32)
            dk_f = T.alloc_fragment((SC, K), f32)
            # one fragment per reduction (each takes its source's layout)
            r_ss = T.alloc_fragment((K,), f32)
            ss_f = T.alloc_fragment((K,), f32)
            r_g = T.alloc_fragment((SC,), f32)
            r_d = T.alloc_fragment((SC,), f32)
            c_dba = T.alloc_fragment((SC,), f32)
            c_dgg = T.alloc_fragment((SC,), f32)
            r_dgg = T.alloc_fragment((SC,), f32)
            r_dn = T.alloc_fragment((SC,), f32)
            r_dg = T.alloc_fragment((SC,), f32)

            sub = bid // Hv
            hh = T.alloc_var("int32", init=bid % Hv)
            chunk = T.alloc_var("int32", init=sub // SUBS)
            part = T.alloc_var("int32", init=sub % SUBS)      # sub-chunk within the chunk
            seq = T.alloc_var("int32", init=chunk_idx[chunk, 0])
            if seq >= 0:
                cis = T.alloc_var("int32", init=chunk_idx[chunk, 1])
                t0 = T.alloc_var("int32", init=cu_seqlens[seq] + cis * C + part * SC)
                rows = T.alloc_var("int32", init=T.min(cu_seqlens[seq + 1] - t0, SC))
                if rows > 0:
                    hk = T.alloc_var("int32", init=hh // NG)
                    gv = T.alloc_var("int32", init=hh - hk * NG)
                    srow = T.alloc_var("int32",
                                       init=(chunk_offsets[seq] + cis) * SUBS + part)
                    # A's diagonal block: a column expression (not a var), which lets
                    # its load go by cp.async with the others
                    col = (sub % SUBS) * SC
                    # the chunk cumsum at the sub-chunk's last token before it (0 at a
                    # chunk start): the sub-chunk's own cumsum is g_cumsum - base
                    base = T.alloc_var(f32, init=0.0)
                    if part > 0:
                        base = g_cumsum[t0 - 1, hh]

                    # every load of the sub-chunk's tiles and of the first block in
                    # flight at once (one wait for all of them)
                    T.async_copy(q[t0:t0 + SC, hk, :], q_s)
                    T.async_copy(k[t0:t0 + SC, hk, :], k_s)
                    T.async_copy(A[t0:t0 + SC, hh, col:col + SC], a_s)
                    T.async_copy(v[t0:t0 + SC, hh, 0:BV], v_s)
                    T.async_copy(do[t0:t0 + SC, hh, 0:BV], do_s)
                    T.async_copy(h[srow, hh, :, 0:BV], s0_s)
                    T.async_copy(dS1[srow, hh, :, 0:BV], ds1_s)
                    for i in T.Parallel(SC):
                        gam_f[i] = (g_cumsum[t0 + T.min(i, rows - 1), hh] - base) * LOG2E
                        beta_f[i] = T.if_then_else(i < rows, beta[t0 + i, hh], 0.0)
                    for i in T.Parallel(SC):
                        gam_s[i] = gam_f[i]
                        beta_s[i] = beta_f[i]
                    T.ptx_wait_group(0)
                    T.sync_threads()
                    # rows past the end may hold NaN (padding): zeroed before any GEMM
                    zero_rows_past(q_s, rows)
                    zero_rows_past(k_s, rows)
                    zero_rows_past(a_s, rows)
                    zero_rows_past(v_s, rows)
                    zero_rows_past(do_s, rows)
                    T.sync_threads()

                    # ---- P, Ag (masked to j <= i < rows)
                    T.gemm(q_s, k_s, qk, transpose_B=True, clear_accum=True)         # Q K^T
                    T.copy(a_s, cc)                                                  # A
                    for i, j in T.Parallel(SC, SC):
                        live = (i >= j) & (i < rows)
                        decay = T.exp2(T.min(gam_s[i] - gam_s[j], 0.0))
                        qk[i, j] = T.if_then_else(live, qk[i, j] * decay, 0.0)       # P
                        cc[i, j] = T.if_then_else(live, cc[i, j] * decay * beta_s[j],
                                                  0.0)                               # Ag
                    T.copy(qk, p_s)
                    T.copy(cc, ag_s)
                    T.clear(dag)
                    T.clear(dag_t)
                    T.clear(dp)
                    T.clear(dp_t)
                    T.clear(dq_f)
                    T.clear(dk_f)
                    T.clear(acc_g)
                    T.clear(acc_d)
                    T.clear(ss_f)

                    for blk in T.serial(STATE_BLOCKS):
                        j0 = blk * BV
                        if blk > 0:                      # the first block's came above
                            T.sync_threads()             # the previous block's tiles read
                            T.async_copy(v[t0:t0 + SC, hh, j0:j0 + BV], v_s)
                            T.async_copy(do[t0:t0 + SC, hh, j0:j0 + BV], do_s)
                            T.async_copy(h[srow, hh, :, j0:j0 + BV], s0_s)
                            T.async_copy(dS1[srow, hh, :, j0:j0 + BV], ds1_s)
                            T.ptx_wait_group(0)
                            T.sync_threads()
                            zero_rows_past(v_s, rows)
                            zero_rows_past(do_s, rows)
                            T.sync_threads()

                        # ---- forward recompute: K S0, X, U; <dO, Q S0>
                        T.gemm(k_s, s0_s, ks0, clear_accum=True)                     # K S0
                        T.gemm(q_s, s0_s, cv, clear_accum=True)                      # Q S0
                        for i, j in T.Parallel(SC, BV):
                            acc_g[i, j] = acc_g[i, j] + (cv[i, j] * do_s[i, j]
                                                         * (scale * T.exp2(gam_s[i])))
                        T.copy(v_s, u_f)
                        for i, j in T.Parallel(SC, BV):
                            u_f[i, j] = u_f[i, j] - T.exp2(gam_s[i]) * ks0[i, j]     # X
                        T.copy(u_f, x_s)
                        T.gemm(ag_s, x_s, u_f, clear_accum=True)                     # U
                        T.copy(u_f, v_s)

                        # ---- dU = scale P^T dO + D K dS1; <D K dS1, U>
                        T.gemm(p_s, do_s, du_f, transpose_A=True, clear_accum=True)  # P^T dO
                        T.gemm(k_s, ds1_s, cv, clear_accum=True)                     # K dS1
                        for i, j in T.Parallel(SC, BV):
                            kds = T.exp2(gam_s[SC - 1] - gam_s[i]) * cv[i, j]
                            du_f[i, j] = du_f[i, j] * scale + kds
                            acc_d[i, j] = acc_d[i, j] + kds * u_f[i, j]
                        T.copy(du_f, du_s)

                        # ---- dAg (and its transpose) accumulate; dX = Ag^T dU is dV
                        T.gemm(du_s, x_s, dag, transpose_B=True)                     # dU X^T
                        T.gemm(x_s, du_s, dag_t, transpose_B=True)                   # X dU^T
                        T.gemm(ag_s, du_s, du_f, transpose_A=True, clear_accum=True)  # dX
                        for i, j in T.Parallel(SC, BV):
                            if i < rows:
                                dv[t0 + i, hh, j0 + j] = du_f[i, j]
                        for i, j in T.Parallel(SC, BV):
                            du_f[i, j] = -T.exp2(gam_s[i]) * du_f[i, j]             # -E dX
                            acc_g[i, j] = acc_g[i, j] + du_f[i, j] * ks0[i, j]

                        # ---- dP (and its transpose) accumulate, unscaled
                        T.gemm(do_s, v_s, dp, transpose_B=True)                      # dO U^T
                        T.gemm(v_s, do_s, dp_t, transpose_B=True)                    # U dO^T

                        # ---- this block's share of dQ and dK: the row factors go into
                        # the operands (their last use), then three products
                        T.copy(du_f, du_s)                                           # -E dX
                        for i, j in T.Parallel(SC, BV):
                            u_f[i, j] = u_f[i, j] * T.exp2(gam_s[SC - 1] - gam_s[i])  # D U
                        T.copy(u_f, v_s)
                        T.copy(do_s, cv)
                        for i, j in T.Parallel(SC, BV):
                            cv[i, j] = cv[i, j] * (scale * T.exp2(gam_s[i]))        # scale E dO
                        T.copy(cv, do_s)
                        T.gemm(do_s, s0_s, dq_f, transpose_B=True)
                        T.gemm(v_s, ds1_s, dk_f, transpose_B=True)
                        T.gemm(du_s, s0_s, dk_f, transpose_B=True)
                        for i, j in T.Parallel(K, BV):
                            st[i, j] = T.cast(s0_s[i, j], f32) * T.cast(ds1_s[i, j], f32)
                        T.reduce_sum(st, r_ss, dim=1)
                        for i in T.Parallel(K):
                            ss_f[i] = ss_f[i] + r_ss[i]

                    # ---- dgam's row sums over V, once
                    T.reduce_sum(acc_g, r_g, dim=1)
                    T.reduce_sum(acc_d, r_d, dim=1)
                    for i in T.Parallel(SC):
                        vec_s[0, i] = r_g[i]          # scale E <dO, Q S0> + <-E dX, K S0>
                        vec_s[1, i] = r_d[i]          # <D K dS1, U>
                    for i in T.Parallel(K):
                        ss_s[i] = ss_f[i]

                    # ---- the column sums (dbeta's first term, dGG's columns) from the
                    # transposed products, G and A (then P) read transposed
                    for j, i in T.Parallel(SC, SC):
                        dag_t[j, i] = (dag_t[j, i] * _decay(gam_s, rows, i, j)
                                       * T.cast(a_s[i, j], f32))
                    T.reduce_sum(dag_t, c_dba, dim=1)
                    for j, i in T.Parallel(SC, SC):
                        dp_t[j, i] = dp_t[j, i] * scale * T.cast(p_s[i, j], f32)
                    T.reduce_sum(dp_t, c_dgg, dim=1)
                    for j in T.Parallel(SC):
                        vec_s[2, j] = c_dba[j]                                       # dbeta, 1st
                        vec_s[3, j] = c_dgg[j] + beta_s[j] * c_dba[j]                # dGG cols

                    # ---- M (into X's tile), dP * G (into dU's), dGG's rows
                    T.copy(a_s, cc)                                                  # A
                    for i, j in T.Parallel(SC, SC):
                        decay = _decay(gam_s, rows, i, j)                            # G
                        dagg = dag[i, j] * decay                                     # dAg * G
                        qk[i, j] = dagg * beta_s[j]                                  # M
                        dgg[i, j] = (dagg * cc[i, j] * beta_s[j]
                                     + dp[i, j] * scale * T.cast(p_s[i, j], f32))
                        dp[i, j] = dp[i, j] * scale * decay                          # dP * G
                    T.copy(qk, x_s)
                    T.copy(dp, du_s)
                    T.reduce_sum(dgg, r_dgg, dim=1)
                    for i in T.Parallel(SC):
                        vec_s[4, i] = r_dgg[i]

                    # ---- dN = strictly_lower(-A^T M A^T): dbeta's second term, diag(beta) dN
                    T.gemm(a_s, x_s, cc, transpose_A=True, clear_accum=True)         # A^T M
                    T.copy(cc, p_s)
                    T.gemm(p_s, a_s, cc, transpose_B=True, clear_accum=True)         # .. A^T
                    T.gemm(k_s, k_s, gf, transpose_B=True, clear_accum=True)         # K K^T
                    for i, j in T.Parallel(SC, SC):
                        dn = T.if_then_else((i > j) & (i < rows), -cc[i, j], 0.0)
                        cc[i, j] = dn * beta_s[i]
                        gf[i, j] = dn * gf[i, j]
                    T.copy(cc, ag_s)
                    T.reduce_sum(gf, r_dn, dim=1)
                    for i in T.Parallel(SC):
                        vec_s[5, i] = r_dn[i]

                    # ---- dQ += (dP * G) K; dK += (dP * G)^T Q + bdN K + bdN^T K
                    T.gemm(du_s, k_s, dq_f)
                    T.gemm(du_s, q_s, dk_f, transpose_A=True)
                    T.gemm(ag_s, k_s, dk_f)
                    T.gemm(ag_s, k_s, dk_f, transpose_A=True)
                    for i, j in T.Parallel(SC, K):
                        if i < rows:
                            dq[gv, t0 + i, hk, j] = dq_f[i, j]
                            dk[gv, t0 + i, hk, j] = dk_f[i, j]

                    # ---- dbeta, and dg = reverse cumsum of dgam (+ the gam_SC terms)
                    for i in T.Parallel(SC):
                        dd = T.if_then_else(i < rows, vec_s[1, i], 0.0)
                        if i < rows:
                            dbeta[t0 + i, hh] = vec_s[2, i] + vec_s[5, i]
                        dgam_s[i] = T.if_then_else(
                            i < rows, vec_s[4, i] - vec_s[3, i] + vec_s[0, i] - dd, 0.0)
                        vec_s[1, i] = dd
                        vec_s[6, i] = T.exp2(gam_s[SC - 1]) * functools.reduce(
                            operator.add, [ss_s[i + u * SC] for u in range(FOLD)])
                    for i, m in T.Parallel(SC, SC):
                        cc[i, m] = (T.if_then_else(m >= i, dgam_s[m], 0.0)
                                    + vec_s[1, m] + vec_s[6, m])
                    T.reduce_sum(cc, r_dg, dim=1)
                    for i in T.Parallel(SC):
                        if i < rows:
                            dg[t0 + i, hh] = r_dg[i]

    return chunk_bwd_intra_split


def _decay(gam_s, rows, i, j):
    """G[i, j]: the decay from token j to token i of the sub-chunk, masked to the live
    lower triangle (j <= i < rows); ``gam_s`` holds the log2-scaled rebased cumsum."""
    return T.if_then_else((i >= j) & (i < rows),
                          T.exp2(T.min(gam_s[i] - gam_s[j], 0.0)), 0.0)
