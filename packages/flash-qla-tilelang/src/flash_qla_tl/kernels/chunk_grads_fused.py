"""The whole reverse pass in one kernel: the state-gradient sweep and every input gradient.

The fused alternative to ``chunk_state_grad`` (dS1 to global memory) followed by
``chunk_input_grads`` (dS1 back, one CTA per chunk); ``flash_qla_tl.plan`` picks one
of the two per call. One CTA per (sequence or segment, value head) walks its chunks from
the last to the first with the state gradient dS^T ``[V, K]`` in fp32 registers; per
chunk, the math of ``chunk_input_grads`` (its docstring, gdn-math.md "Backward of one
chunk") is split over four warpgroups by role,
which exchange tiles only through shared memory and meet on mbarriers (the plan checked
by ``tests/sm90/test_bwd_fused_algorithm.py``; FlashQLA 0.1.3's backward has the same
structure, docs/perf-notes.md v12):

- warpgroup 3, load: q, k, dO, v, A and S0 (h in q's dtype) by TMA from one thread,
  rows past the sequence's end zeroed, the gate factors (fetched one chunk ahead);
- warpgroup 0, state: dS1 (its registers) to shared memory in q's dtype, and each
  thread's share of ``<S0, dS1>`` (for dg: its own dS1 elements against S0's tile, in
  fp32; 128 partial sums that dg's reduction adds up); then ``dS0^T = exp(gam_C) dS1^T
  + (scale E dO)^T Q + (-E dX)^T K`` once both tiles exist;
- warpgroup 1, chain: Q K^T, Ps = scale G * tril(Q K^T), Ag, G; ``dU = D (K dS1) + Ps^T
  dO``; ``dX = Ag^T dU`` (= dv) and -E dX; ``A^T M``, ``dN``, ``diag(beta) dN``, ``<dN, K
  K^T>``; ``dk = D (U dS1^T) + (dP G)^T Q + (-E dX) S0^T + bdN K + bdN^T K`` and ``dD``;
  a whole chunk's dv and dk leave through dU's tile (free once the intra
  role has read dU, "m") by TMA stores, a tail chunk's by element;
- warpgroup 2, intra: ``X = V - E K S0``, ``U = Ag X``, ``dAg = dU X^T`` (M, dbeta's
  first term, M * A), ``dP = dO U^T`` (dP G, dGG), ``<-E dX, K S0>``, scale E dO,
  ``dq = (scale E dO) S0^T + (dP G) K`` and ``<Q, (scale E dO) S0^T>``, dbeta, dg; a
  whole chunk's dq leaves through U's tile (free once the chain role has read U) by one
  TMA store, a tail chunk's by element.

Row factors are moved onto the products where their tiles are:
``<dO_i, (Q S0)_i> scale E_i = <Q_i, (scale E dO S0^T)_i>`` (dq's first product) and
``dD_i = D_i <(K dS1)_i, U_i> = D_i <K_i, (U dS1^T)_i>`` (dk's first product), so no
Q S0 product is formed. ``dGG``'s ``dP * G * Q K^T`` is ``dP * Ps`` (Ps kept in q's
dtype).

Every tile has one shared slot (no double buffer: 216 KB of slots), so the next chunk's
tiles load once every role has read the chunk's ("free", 384 arrivals): the chain and
intra roles arrive before their last global stores (dk; dq, dbeta, dg), which overlap
the loads, and the load role fetches the next chunk's gates while the chunk runs
(Nsight Compute, docs/perf-notes.md v19: the intra role, which bounds the step, had
waited ~13% of it for the next chunk's tiles after its own end, i.e. the whole load
latency); the hand-offs
within a chunk are one mbarrier each (128 arrivals of the writing role), all of phase
``r % 2`` for the walk's r-th chunk. No barrier is arrived at for chunk r + 1 before
its waiters have passed it for chunk r: every arrival of chunk r + 1 comes after
"ready" of r + 1, i.e. after every role's "free" of r, which each role arrives at after
its waits of chunk r except the intra role's "chain_end", and the chain reaches
"chain_end" of r + 1 only through "m" of r + 1, which the intra role arrives at after
its whole chunk r.
TileLang's automatic synchronisation and shared-memory reuse are off: every barrier is
written out, and no two buffers share bytes (the planner reuses bytes by program order,
which role blocks running at once do not follow; docs/perf-notes.md v17). Cross-warp
reductions (TileLang's column sums: named barriers 1 and 2 and a shared workspace) run
in the intra role only (the chain role's row sums stay within a quad); the roles' own
named barriers are 3 and up.
"""

import functools

import tilelang
import tilelang.language as T

from ..arch import Arch
from .builder import arch_kernel
from .tile_ops import fetch_gates, mma, mma_wait, stage_gates
from .traits import CHUNK

#: named barriers of the roles' own threads (0 is __syncthreads', 1 and 2 TileLang's
#: cross-warp reductions, which only the intra role runs)
CHAIN_BAR, INTRA_BAR, LOAD_BAR = 3, 4, 5


@arch_kernel(pass_configs={tilelang.PassConfigKey.TL_DISABLE_THREAD_STORAGE_SYNC: True,
                           tilelang.PassConfigKey.TL_DISABLE_SHARED_MEMORY_REUSE: True})
def chunk_bwd_fused_kernel(arch: Arch, dtype: str, K: int, V: int, has_dht: bool):
    """Build the fused reverse kernel for ``arch``, q/k/v dtype ``dtype``, K = V = 128.

    ``arch`` gives the GEMMs (``tile_ops.mma``), the roles' setmaxnreg budgets (state,
    chain, intra, load; the launch gives 512 threads 128 registers each, so they sum to
    at most 4 x 128; none: no setmaxnreg) and the column sums of the intra role
    (``arch.column_sums``, as ``chunk_bwd_intra_kernel``: with "transposed", dAg^T = X
    dU^T and dP^T = U dO^T are formed and their rows summed, before the role hands M
    over, since the chain role then reuses dU's tile).

    ``has_dht``: the walk starts from ``dht[n]`` (else from zero). dq, dk are written per
    value head in ``dtype`` (as ``chunk_bwd_intra_kernel``).

    Kernel arguments (packed token layout, Tt = total tokens, N sequences or segments,
    NT chunk rows of h):
        q, k            [Tt, Hk, K]     dtype
        v, do           [Tt, Hv, V]     dtype
        g_cumsum, beta  [Tt, Hv]        fp32
        A               [Tt, Hv, C]     dtype, gate-free inverse per chunk row
        h               [NT, Hv, K, V]  dtype, chunk-start states (rows from
                                        chunk_offsets[n] for sequence n)
        cu_seqlens      [N+1]           int32
        chunk_offsets   [N+1]           int32
        dht             [N0, Hv, K, V]  fp32, state gradient at each sequence's end
        scale           fp32 scalar
        dq, dk          [NG, Tt, Hk, K] dtype out, per value head hv = hk * NG
                                        + g at [g, :, hk] (group-major)
        dv              [Tt, Hv, V]     dtype out
        dbeta, dg       [Tt, Hv]        fp32 out (dg w.r.t. the raw per-token gate)
        dh0             [N, Hv, K, V]   fp32 out, state gradient at each start
        cta_order       [NO]            int32, read only where ``ordered`` != 0
        ordered         int32 scalar: CTA b works on sequence ``cta_order[b // Hv]``
                                        (longest first, ``flash_qla_tl.layout.cta_order``)
                                        instead of ``b // Hv``
    Only rows of real tokens are written."""
    C = CHUNK
    budget = arch.budget("chunk_bwd_fused")
    set_regs = budget is not None
    STATE_REGS, CHAIN_REGS, INTRA_REGS, LOAD_REGS = budget or (0, 0, 0, 0)
    assert sum(budget or ()) <= 4 * 128, budget
    gemm = mma(arch)
    wait = mma_wait(arch)
    transposed = arch.column_sums == "transposed"
    # Every product gives each warp whole rows of its tile: a WGMMA tile does by itself;
    # mma.sync tiles are split by columns too unless asked (``FullRow``). Row sums then
    # stay within a warp: the chain role's (dD, dN's) must (TileLang's cross-warp
    # reductions use named barriers 1 and 2, which the intra role's use at the same
    # time), and the intra role's need no shared workspace (227 KB are all taken).
    row_gemm = T.gemm
    if arch.mma != "wgmma":
        row_gemm = gemm = functools.partial(T.gemm, policy=T.GemmWarpPolicy.FullRow)
    # <S0, dS1>: the state role (warpgroup 0, threads 0..127: its thread index is its
    # slot of ss_s) writes 128 = K partial sums, which the intra role folds as 2 per row
    assert K == V == 2 * C == 128
    Tt, Hk, Hv, NG, N, N0, N1, NT, NO = T.dynamic("Tt, Hk, Hv, NG, N, N0, N1, NT, NO")
    f32 = "float32"

    @T.prim_func
    def chunk_bwd_fused(
        q: T.Tensor((Tt, Hk, K), dtype),
        k: T.Tensor((Tt, Hk, K), dtype),
        v: T.Tensor((Tt, Hv, V), dtype),
        do: T.Tensor((Tt, Hv, V), dtype),
        g_cumsum: T.Tensor((Tt, Hv), f32),
        beta: T.Tensor((Tt, Hv), f32),
        A: T.Tensor((Tt, Hv, C), dtype),
        h: T.Tensor((NT, Hv, K, V), dtype),
        cu_seqlens: T.Tensor((N1,), "int32"),
        chunk_offsets: T.Tensor((N1,), "int32"),
        dht: T.Tensor((N0, Hv, K, V), f32),
        scale: T.float32,
        dq: T.Tensor((NG, Tt, Hk, K), dtype),
        dk: T.Tensor((NG, Tt, Hk, K), dtype),
        dv: T.Tensor((Tt, Hv, V), dtype),
        dbeta: T.Tensor((Tt, Hv), f32),
        dg: T.Tensor((Tt, Hv), f32),
        dh0: T.Tensor((N, Hv, K, V), f32),
        cta_order: T.Tensor((NO,), "int32"),
        ordered: T.int32,
    ):
        with T.Kernel(N * Hv, threads=512) as bx:
            # one slot per tile (several tiles share a slot one after the other)
            q_s = T.alloc_shared((C, K), dtype)
            k_s = T.alloc_shared((C, K), dtype)
            do_s = T.alloc_shared((C, V), dtype)     # dO, then scale E dO
            vx_s = T.alloc_shared((C, V), dtype)     # V, then X = V - E K S0
            s0_s = T.alloc_shared((K, V), dtype)
            ds1_s = T.alloc_shared((K, V), dtype)
            u_s = T.alloc_shared((C, V), dtype)      # U = Ag X, then dq (TMA store)
            du_s = T.alloc_shared((C, V), dtype)     # dU, then dv and dk (TMA stores)
            edx_s = T.alloc_shared((C, V), dtype)    # -E dX
            a_s = T.alloc_shared((C, C), dtype)      # A
            p_s = T.alloc_shared((C, C), dtype)      # Ps = scale P, then dP * G
            ag_s = T.alloc_shared((C, C), dtype)     # Ag, then diag(beta) dN
            m_s = T.alloc_shared((C, C), dtype)      # M, then A^T M
            g_s = T.alloc_shared((C, C), dtype)      # G, masked
            # per-row vectors (fp32)
            gam_s = T.alloc_shared((C,), f32)        # log2-scaled chunk cumsum
            eg_s = T.alloc_shared((C,), f32)         # exp(gam)
            ed_s = T.alloc_shared((C,), f32)         # exp(gam_C - gam)
            beta_s = T.alloc_shared((C,), f32)
            vec_s = T.alloc_shared((8, C), f32)      # per-row terms of dbeta, dg
            ss_s = T.alloc_shared((K,), f32)         # <S0, dS1> per state thread
            dgam_s = T.alloc_shared((C,), f32)
            # load role
            gam_next = T.alloc_fragment((C,), f32)   # the next chunk's gates
            gam_last_next = T.alloc_fragment((C,), f32)
            beta_next = T.alloc_fragment((C,), f32)
            # state role
            dst = T.alloc_fragment((V, K), f32)      # dS^T
            ssp = T.alloc_local((1,), f32)
            # chain role
            qk = T.alloc_fragment((C, C), f32)       # Q K^T, Ps; A^T M; A^T M A^T
            gb = T.alloc_fragment((C, C), f32)       # G; K K^T
            cv = T.alloc_fragment((C, V), f32)       # dU; dX; dk
            cv2 = T.alloc_fragment((C, V), f32)      # -E dX; dk's first product times K
            r_dn = T.alloc_fragment((C,), f32)
            r_dd = T.alloc_fragment((C,), f32)
            # intra role
            ks0 = T.alloc_fragment((C, V), f32)      # K S0
            iv = T.alloc_fragment((C, V), f32)       # X; U; dq
            iv2 = T.alloc_fragment((C, V), f32)      # -E dX * K S0; dq's first times Q
            tb = T.alloc_fragment((C, V), dtype)     # -E dX; Q (read by ldmatrix)
            dag = T.alloc_fragment((C, C), f32)      # dAg; dP
            dgg = T.alloc_fragment((C, C), f32)      # dGG
            cc = T.alloc_fragment((C, C), f32)       # dAg * G * A; dg's sum
            r_ks = T.alloc_fragment((C,), f32)
            c_dba = T.alloc_fragment((C,), f32)
            r_dgg = T.alloc_fragment((C,), f32)
            c_dgg = T.alloc_fragment((C,), f32)
            r_qs = T.alloc_fragment((C,), f32)
            r_dg = T.alloc_fragment((C,), f32)

            n = T.alloc_var("int32", init=bx // Hv)
            if arch.ordered_grid and ordered != 0:     # else never read
                n = cta_order[bx // Hv]
            hh = T.alloc_var("int32", init=bx % Hv)
            hk = T.alloc_var("int32", init=hh // NG)         # GVA: value -> q/k head
            gv = T.alloc_var("int32", init=hh - hk * NG)     # its place in the group
            bos = T.alloc_var("int32", init=cu_seqlens[n])
            seq_len = T.alloc_var("int32", init=cu_seqlens[n + 1] - bos)
            first_chunk = T.alloc_var("int32", init=chunk_offsets[n])
            chunks = T.alloc_var("int32", init=T.ceildiv(seq_len, C))
            last = T.alloc_var("int32", init=bos + seq_len - 1)

            loaded = T.alloc_barrier(128)      # TMA -> load (128 arrivals + bytes)
            ready = T.alloc_barrier(128)       # load -> all: tiles, zeroed rows, gates
            pag = T.alloc_barrier(128)         # chain -> intra: Ag, G (and Ps)
            ds1_b = T.alloc_barrier(128)       # state -> chain: dS1 tile
            du_b = T.alloc_barrier(128)        # chain -> intra: dU
            edx_b = T.alloc_barrier(128)       # chain -> intra, state: -E dX
            m_b = T.alloc_barrier(128)         # intra -> chain: M
            dpg_b = T.alloc_barrier(128)       # intra -> chain: dP * G
            sedo_b = T.alloc_barrier(128)      # intra -> state: scale E dO
            ss_b = T.alloc_barrier(128)        # state -> intra: <S0, dS1> partials
            chain_end = T.alloc_barrier(128)   # chain -> intra: dD, dN rows
            free = T.alloc_barrier(384)        # state, chain, intra -> load: tiles read

            with T.ws(2):                                         # intra
                if set_regs:
                    T.inc_max_nreg(INTRA_REGS)
                for r in T.serial(chunks):
                    c = chunks - 1 - r
                    t0 = bos + c * C
                    rows = T.min(seq_len - c * C, C)
                    ph = r % 2
                    T.barrier_wait(ready, ph)
                    # X = V - E K S0 (K S0 kept for <-E dX, K S0>)
                    row_gemm(k_s, s0_s, ks0, clear_accum=True)                      # K S0
                    T.copy(vx_s, iv)
                    for i, j in T.Parallel(C, V):
                        iv[i, j] = iv[i, j] - eg_s[i] * ks0[i, j]
                    T.copy(iv, vx_s)
                    T.fence_proxy_async()
                    T.sync_threads(INTRA_BAR, 128)
                    # U = Ag X
                    T.barrier_wait(pag, ph)
                    row_gemm(ag_s, vx_s, iv, clear_accum=True)                       # U
                    T.tma_store_wait()              # the last chunk's dq store has read
                    T.sync_threads(INTRA_BAR, 128)  # U's tile (one elected thread's
                    #                                 store; the others pass)
                    T.copy(iv, u_s)
                    T.fence_proxy_async()
                    T.sync_threads(INTRA_BAR, 128)
                    # dAg = dU X^T: M, dbeta's first term, dGG's M * A
                    T.barrier_wait(du_b, ph)
                    row_gemm(du_s, vx_s, dag, transpose_B=True, clear_accum=True)    # dAg
                    for i, j in T.Parallel(C, C):
                        dagg = dag[i, j] * g_s[i, j]                # dAg * G (0: masked)
                        a = T.cast(a_s[i, j], f32)
                        dag[i, j] = dagg * beta_s[j]                                 # M
                        if not transposed:
                            cc[i, j] = dagg * a
                        dgg[i, j] = dagg * a * beta_s[j]                             # M * A
                    T.copy(dag, m_s)
                    if transposed:               # dAg^T = X dU^T (dU's tile goes at m_b)
                        row_gemm(vx_s, du_s, cc, transpose_B=True, clear_accum=True)
                        for j, i in T.Parallel(C, C):
                            cc[j, i] = (cc[j, i] * T.cast(g_s[i, j], f32)
                                        * T.cast(a_s[i, j], f32))
                    T.fence_proxy_async()
                    T.barrier_arrive(m_b)
                    if transposed:
                        T.reduce_sum(cc, c_dba, dim=1, batch=2)
                    else:
                        T.reduce_sum(cc, c_dba, dim=0, batch=4)
                    for j in T.Parallel(C):
                        vec_s[2, j] = c_dba[j]                                    # dbeta
                    # dP = dO U^T: dP * G (in Ps's slot), dGG += dP * Ps
                    row_gemm(do_s, u_s, dag, transpose_B=True, clear_accum=True)     # dP
                    for i, j in T.Parallel(C, C):
                        ps = T.cast(p_s[i, j], f32)
                        dgg[i, j] = dgg[i, j] + dag[i, j] * ps
                        dag[i, j] = dag[i, j] * scale * T.cast(g_s[i, j], f32)   # dP * G
                    if transposed:               # dP^T = U dO^T, times Ps read transposed
                        row_gemm(u_s, do_s, cc, transpose_B=True, clear_accum=True)
                        for j, i in T.Parallel(C, C):
                            cc[j, i] = cc[j, i] * T.cast(p_s[i, j], f32)
                    T.sync_threads(INTRA_BAR, 128)          # every Ps read before it goes
                    T.copy(dag, p_s)
                    T.fence_proxy_async()
                    T.barrier_arrive(dpg_b)
                    T.reduce_sum(dgg, r_dgg, dim=1, batch=2)
                    if transposed:               # + the M * A columns: beta_j dbeta_j
                        T.reduce_sum(cc, c_dgg, dim=1, batch=2)
                        for j in T.Parallel(C):
                            c_dgg[j] = c_dgg[j] + beta_s[j] * c_dba[j]
                    else:
                        T.reduce_sum(dgg, c_dgg, dim=0, batch=4)
                    for i in T.Parallel(C):
                        vec_s[4, i] = r_dgg[i]
                    for j in T.Parallel(C):
                        vec_s[6, j] = c_dgg[j]
                    # <-E dX, K S0>
                    T.barrier_wait(edx_b, ph)
                    T.copy(edx_s, tb)
                    for i, j in T.Parallel(C, V):
                        iv2[i, j] = T.cast(tb[i, j], f32) * ks0[i, j]
                    T.reduce_sum(iv2, r_ks, dim=1, batch=2)
                    for i in T.Parallel(C):
                        vec_s[3, i] = r_ks[i]
                    # scale E dO in place (dO's readers, dU and dP, are done)
                    for i, j in T.Parallel(C, V):
                        do_s[i, j] = do_s[i, j] * (scale * eg_s[i])
                    T.fence_proxy_async()
                    T.sync_threads(INTRA_BAR, 128)
                    T.barrier_arrive(sedo_b)
                    # dq = (scale E dO) S0^T + (dP G) K; <Q, (scale E dO) S0^T> rows
                    row_gemm(do_s, s0_s, iv, transpose_B=True, clear_accum=True)
                    T.copy(q_s, tb)
                    for i, j in T.Parallel(C, K):
                        iv2[i, j] = iv[i, j] * T.cast(tb[i, j], f32)
                    T.reduce_sum(iv2, r_qs, dim=1, batch=2)
                    for i in T.Parallel(C):
                        vec_s[0, i] = r_qs[i]
                    row_gemm(p_s, k_s, iv)                                          # + dPG K
                    # the <S0, dS1> term of dg, the last read of the chunk's tiles and
                    # gates: the next chunk's loads go while dq and dg are finished
                    T.barrier_wait(ss_b, ph)
                    for i in T.Parallel(C):
                        vec_s[7, i] = T.exp2(gam_s[C - 1]) * (ss_s[i] + ss_s[i + C])
                    T.barrier_arrive(free)
                    T.barrier_wait(chain_end, ph)   # the chain's last read of U is done
                    # dq: a whole chunk through U's tile (free until this role's next
                    # U) and one TMA store; a tail chunk by element (TMA would write the
                    # next sequence's rows)
                    if rows == C:
                        T.copy(iv, u_s)
                        T.fence_proxy_async()
                        T.sync_threads(INTRA_BAR, 128)
                        T.tma_copy(u_s, dq[gv, t0:t0 + C, hk, :])
                    else:
                        for i, j in T.Parallel(C, K):
                            if i < rows:
                                dq[gv, t0 + i, hk, j] = iv[i, j]
                    # dbeta, and dg = reverse cumsum of dgam (+ the gam_C terms)
                    T.sync_threads(INTRA_BAR, 128)          # vec_s rows of every thread
                    for i in T.Parallel(C):
                        if i < rows:
                            dbeta[t0 + i, hh] = vec_s[2, i] + vec_s[5, i]
                        dgam_s[i] = T.if_then_else(
                            i < rows,
                            (vec_s[4, i] - vec_s[6, i] + vec_s[0, i] + vec_s[3, i]
                             - vec_s[1, i]),
                            0.0)
                    T.sync_threads(INTRA_BAR, 128)
                    for i, m in T.Parallel(C, C):
                        cc[i, m] = (T.if_then_else(m >= i, dgam_s[m], 0.0)
                                    + vec_s[1, m] + vec_s[7, m])
                    T.reduce_sum(cc, r_dg, dim=1, batch=2)
                    for i in T.Parallel(C):
                        if i < rows:
                            dg[t0 + i, hh] = r_dg[i]
                T.tma_store_wait()                  # shared memory lives until the
                #                                     last dq store has read it

            with T.ws(1):                                         # chain
                if set_regs:
                    T.inc_max_nreg(CHAIN_REGS)
                for r in T.serial(chunks):
                    c = chunks - 1 - r
                    t0 = bos + c * C
                    rows = T.min(seq_len - c * C, C)
                    ph = r % 2
                    T.barrier_wait(ready, ph)
                    # Q K^T -> Ps = scale G * tril(Q K^T), Ag = (G * A) diag(beta), G
                    row_gemm(q_s, k_s, qk, transpose_B=True, clear_accum=True)
                    for i, j in T.Parallel(C, C):
                        live = (i >= j) & (i < rows)
                        e = T.exp2(T.min(gam_s[i] - gam_s[j], 0.0))
                        decay = T.if_then_else(live, e, 0.0)
                        qk[i, j] = qk[i, j] * decay * scale
                        gb[i, j] = decay
                    for i, j in T.Parallel(C, C):
                        p_s[i, j] = qk[i, j]
                        g_s[i, j] = gb[i, j]
                        ag_s[i, j] = T.cast(a_s[i, j], f32) * gb[i, j] * beta_s[j]
                    T.fence_proxy_async()
                    T.sync_threads(CHAIN_BAR, 128)
                    T.barrier_arrive(pag)
                    # dU = D (K dS1) + Ps^T dO
                    T.barrier_wait(ds1_b, ph)
                    row_gemm(k_s, ds1_s, cv, clear_accum=True)                       # K dS1
                    for i, j in T.Parallel(C, V):
                        cv[i, j] = cv[i, j] * ed_s[i]
                    row_gemm(p_s, do_s, cv, transpose_A=True)                       # + Ps^T dO
                    T.tma_store_wait()              # the last chunk's dv / dk stores have
                    T.sync_threads(CHAIN_BAR, 128)  # read dU's tile (one elected thread's)
                    T.copy(cv, du_s)
                    T.fence_proxy_async()
                    T.sync_threads(CHAIN_BAR, 128)
                    T.barrier_arrive(du_b)
                    # dX = Ag^T dU (= dv), -E dX
                    row_gemm(ag_s, du_s, cv, transpose_A=True, clear_accum=True)     # dX
                    if rows < C:                    # a tail chunk's dv by element
                        for i, j in T.Parallel(C, V):
                            if i < rows:
                                dv[t0 + i, hh, j] = cv[i, j]
                    for i, j in T.Parallel(C, V):
                        cv2[i, j] = -eg_s[i] * cv[i, j]
                    T.copy(cv2, edx_s)
                    T.fence_proxy_async()
                    T.sync_threads(CHAIN_BAR, 128)
                    T.barrier_arrive(edx_b)
                    # dN = strictly_lower(-A^T M A^T): diag(beta) dN, <dN, K K^T> rows
                    T.barrier_wait(m_b, ph)         # also: the intra role has read dU
                    if rows == C:                   # a whole chunk's dv through dU's tile
                        T.copy(cv, du_s)
                        T.fence_proxy_async()
                        T.sync_threads(CHAIN_BAR, 128)
                        T.tma_copy(du_s, dv[t0:t0 + C, hh, :])
                    row_gemm(a_s, m_s, qk, transpose_A=True, clear_accum=True)       # A^T M
                    T.sync_threads(CHAIN_BAR, 128)          # M read by every warp
                    T.copy(qk, m_s)
                    T.fence_proxy_async()
                    T.sync_threads(CHAIN_BAR, 128)
                    row_gemm(m_s, a_s, qk, transpose_B=True, clear_accum=True)       # A^T M A^T
                    row_gemm(k_s, k_s, gb, transpose_B=True, clear_accum=True)       # K K^T
                    for i, j in T.Parallel(C, C):
                        dn = T.if_then_else((i > j) & (i < rows), -qk[i, j], 0.0)
                        qk[i, j] = dn * beta_s[i]
                        gb[i, j] = dn * gb[i, j]
                    T.copy(qk, ag_s)                        # Ag's readers are done
                    T.reduce_sum(gb, r_dn, dim=1, batch=2)
                    for i in T.Parallel(C):
                        vec_s[5, i] = r_dn[i]                                   # dbeta, 2nd
                    T.fence_proxy_async()
                    T.sync_threads(CHAIN_BAR, 128)
                    # dk = D (U dS1^T) + (dP G)^T Q + (-E dX) S0^T + bdN K + bdN^T K;
                    # dD = D <K, U dS1^T> rows
                    T.barrier_wait(dpg_b, ph)
                    row_gemm(u_s, ds1_s, cv, transpose_B=True, clear_accum=True)     # U dS1^T
                    for i, j in T.Parallel(C, K):
                        cv2[i, j] = cv[i, j] * T.cast(k_s[i, j], f32)
                        cv[i, j] = cv[i, j] * ed_s[i]
                    T.reduce_sum(cv2, r_dd, dim=1, batch=2)
                    for i in T.Parallel(C):
                        vec_s[1, i] = T.if_then_else(i < rows, r_dd[i] * ed_s[i], 0.0)
                    gemm(p_s, q_s, cv, transpose_A=True)
                    gemm(edx_s, s0_s, cv, transpose_B=True)
                    gemm(ag_s, k_s, cv)
                    gemm(ag_s, k_s, cv, transpose_A=True)
                    wait(0)
                    T.barrier_arrive(chain_end)
                    T.barrier_arrive(free)
                    if rows == C:                           # dk through dU's tile too,
                        T.tma_store_wait()                  # once dv's store has read it
                        T.sync_threads(CHAIN_BAR, 128)
                        T.copy(cv, du_s)
                        T.fence_proxy_async()
                        T.sync_threads(CHAIN_BAR, 128)
                        T.tma_copy(du_s, dk[gv, t0:t0 + C, hk, :])
                    else:
                        for i, j in T.Parallel(C, K):
                            if i < rows:
                                dk[gv, t0 + i, hk, j] = cv[i, j]
                T.tma_store_wait()                  # shared memory lives until then

            with T.ws(0):                                         # state
                if set_regs:
                    T.inc_max_nreg(STATE_REGS)
                if has_dht:
                    for i, j in T.Parallel(V, K):
                        dst[i, j] = dht[n, hh, j, i]
                else:
                    T.clear(dst)
                for r in T.serial(chunks):
                    ph = r % 2
                    T.barrier_wait(ready, ph)      # the slot's readers of the last chunk
                    for i, j in T.Parallel(V, K):  # are done (every role passed "free")
                        ds1_s[j, i] = dst[i, j]
                    T.fence_proxy_async()
                    T.barrier_arrive(ds1_b)
                    ssp[0] = 0.0                   # this thread's share of <S0, dS1>
                    for i, j in T.Parallel(V, K):
                        ssp[0] = ssp[0] + dst[i, j] * T.cast(s0_s[j, i], f32)
                    ss_s[T.get_thread_binding()] = ssp[0]     # ws(0): threads 0..127
                    T.barrier_arrive(ss_b)
                    for i, j in T.Parallel(V, K):
                        dst[i, j] = dst[i, j] * eg_s[C - 1]
                    T.barrier_wait(sedo_b, ph)
                    gemm(do_s, q_s, dst, transpose_A=True)        # + (s E dO)^T Q
                    T.barrier_wait(edx_b, ph)
                    gemm(edx_s, k_s, dst, transpose_A=True)       # + (-E dX)^T K
                    wait(0)
                    T.barrier_arrive(free)
                for i, j in T.Parallel(V, K):
                    dh0[n, hh, j, i] = dst[i, j]

            with T.ws(3):                                         # load
                if set_regs:
                    T.dec_max_nreg(LOAD_REGS)
                if chunks > 0:
                    fetch_gates(g_cumsum, beta, hh, bos + (chunks - 1) * C, last, gam_next,
                                gam_last_next, beta_next)
                for r in T.serial(chunks):
                    c = chunks - 1 - r
                    t0 = bos + c * C
                    rows = T.min(seq_len - c * C, C)
                    ph = r % 2
                    if r > 0:
                        T.barrier_wait(free, ph ^ 1)              # the last chunk is done
                    T.tma_copy(q[t0:t0 + C, hk, :], q_s, barrier=loaded)
                    T.tma_copy(k[t0:t0 + C, hk, :], k_s, barrier=loaded)
                    T.tma_copy(do[t0:t0 + C, hh, :], do_s, barrier=loaded)
                    T.tma_copy(v[t0:t0 + C, hh, :], vx_s, barrier=loaded)
                    T.tma_copy(A[t0:t0 + C, hh, :], a_s, barrier=loaded)
                    T.tma_copy(h[first_chunk + c, hh, :, :], s0_s, barrier=loaded)
                    T.barrier_arrive(loaded)
                    stage_gates(gam_next, gam_last_next, beta_next, gam_s, eg_s, ed_s, beta_s)
                    T.barrier_wait(loaded, ph)
                    if rows < C:                # next sequence / padding rows: zeros
                        for i, j in T.Parallel(C, K):
                            if i >= rows:
                                q_s[i, j] = T.cast(0, dtype)
                                k_s[i, j] = T.cast(0, dtype)
                                do_s[i, j] = T.cast(0, dtype)
                                vx_s[i, j] = T.cast(0, dtype)
                        for i, j in T.Parallel(C, C):
                            if i >= rows:
                                a_s[i, j] = T.cast(0, dtype)
                    T.fence_proxy_async()
                    T.sync_threads(LOAD_BAR, 128)
                    T.barrier_arrive(ready)
                    if c > 0:                   # the next chunk's gates, in flight
                        fetch_gates(g_cumsum, beta, hh, t0 - C, last, gam_next,
                                    gam_last_next, beta_next)

    return chunk_bwd_fused
