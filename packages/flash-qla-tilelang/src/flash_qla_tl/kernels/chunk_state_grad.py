"""The backward's reverse sweep: the state gradient dS1 at every chunk's end, and dh0.

One CTA per (sequence, value head) walks the chunks from the last to the first with the
whole 128 x 128 state gradient, transposed (dS^T) in registers; three warpgroups, roles
fixed by ``T.ws`` and meeting only on per-slot mbarriers (the structure of
``chunk_state_output``):

- warpgroups 0, 1 (state, 64 rows of dS^T [V, K] each, in registers): per chunk, walking
  from the last to the first, only the chain that needs dS (gdn-math.md, "Backward of one
  chunk", written for the transposes; rows t of the chunk, gam its chunk cumsum,
  E = diag(exp(gam)), D = diag(exp(gam_C - gam))):

      store dS^T as the chunk's dS1
      dU^T  = (dS1^T K^T) D + dO^T Ps               Ps = scale P
      dX^T  = dU^T Ag
      dS0^T = exp(gam_C) dS1^T + dO^T Qe - (dX^T E) K      Qe = scale E Q

  ``dO^T Qe`` does not need dS: it is issued with the first two products and waited for
  last.
- warpgroup 2 (aux): chunk c's q, k, dO, A tiles by TMA into slot r % SLOTS (r-th
  chunk of the walk) one chunk ahead; rows past the end of the sequence zeroed in shared
  memory (NaN in padding never meets a GEMM); the gate factors; Q K^T on the tensor cores;
  then Ps = scale * G * tril(Q K^T), Ag = (G * A) diag(beta) in place of A, and Qe in
  place of Q.

The first chunk's dS0 is dh0. Every other gradient is per chunk given S0 (from the
forward kernel) and dS1 (from here): ``chunk_input_grads`` computes them chunk-parallel.

Sub-chunks (``arch.sub_chunk`` < 64: SM120) as in ``chunk_state_output``: the walk steps
over 32-token tiles (A's diagonal blocks, gates rebased, the split's walks on chunk
totals), and dS1 has a row per sub-chunk (``flash_qla_tl.layout.state_rows``), stored
from the registers, for ``chunk_input_grads_split``.

Slots and barriers as ``chunk_state_output`` (``arch.slots``, ``AUX_BARRIER``); TileLang's
automatic synchronisation is off: every barrier is written out. ~2.7 us per chunk step
on the H200 (docs/perf-notes.md).
"""

import tilelang
import tilelang.language as T

from ..arch import Arch
from .builder import arch_kernel
from .chunk_state_output import AUX_BARRIER, ROWS, STATE_BARRIER, ws_budgets
from .tile_ops import (
    LOG2E,
    fetch_tile_gates,
    mma,
    mma_wait,
    search_walk_end,
    store_staged,
    store_transposed,
    tma_inverse,
)
from .traits import CHUNK


@arch_kernel(pass_configs={tilelang.PassConfigKey.TL_DISABLE_THREAD_STORAGE_SYNC: True})
def chunk_bwd_dh_ws_kernel(arch: Arch, dtype: str, K: int, V: int, has_dht: bool,
                           warmup: bool = False, ds1_in_dtype: bool = False,
                           boundary: bool = False):
    """Build the sweep for ``arch``, q/k/v dtype ``dtype``, K = V = 128 (the arch's GEMMs,
    slots and budgets as ``chunk_fwd_ws_kernel``; SM90's budgets are 192 / 120: at
    208 / 88 the aux warpgroup spilled 20-40 bytes on sm_90a).

    Kernel arguments (packed token layout, Tt = total tokens, N sequences):
        q, k            [Tt, Hk, K]     dtype
        do              [Tt, Hv, V]     dtype, gradient of o
        g_cumsum, beta  [Tt, Hv]        fp32
        A               [Tt, Hv, C]     dtype, gate-free inverse per chunk row
        cu_seqlens      [N+1]           int32
        chunk_offsets   [N+1]           int32, first chunk of each sequence
        dht             [N0, Hv, K, V]  fp32 (read only with has_dht)
        scale           fp32 scalar
        dS1             [NT, Hv, K, V]  fp32 (``dtype`` with ``ds1_in_dtype``) out, state
                                        gradient at each chunk's end
        dh0             [N, Hv, K, V]   fp32 out
        seq_end, seq_index  [NW]        int32, read only with ``warmup``
        log_bound       fp32 scalar, read only with ``warmup``
        cta_order       [NO]            int32, read only where ``ordered`` != 0
        ordered         int32 scalar: CTA b works on sequence ``cta_order[b // Hv]``
                                        (longest first, ``flash_qla_tl.layout.cta_order``)
                                        instead of ``b // Hv``

    ``warmup`` (the bounded segment split's backward, ``flash_qla.segments.WalkEnds``):
    the sequences of ``cu_seqlens`` are segments, segment n of sequence
    ``seq_index[n]``, which ends at token ``seq_end[n]``. CTA (n, h) sums the chunk
    totals of g_cumsum over the chunks after its segment (``tile_ops.search_walk_end``)
    and starts its reverse sweep at the first chunk boundary where the sum is
    <= ``log_bound`` (natural log) from a zero dS, or at the sequence's end from
    ``dht[seq_index[n], h]`` (the rule of ``flash_qla.segments.warmup_ends``). The chunks
    after the segment are a warm-up that rebuilds dS at its end up to what decayed below
    the bound; dS1 is stored for the segment's own chunks only, dh0[n] is the state
    gradient at the segment's start. ``boundary`` (with ``warmup``): each CTA walks only
    the warm-up chunks after its segment and stores no dS1; ``dh0[n]`` is then the state
    gradient at segment n's end (where ``chunk_grads_fused``'s walk of the segment
    starts)."""
    C = CHUNK                        # A's width, the split's walks: 64-token chunks
    SC = arch.sub_chunk              # the token tile of the walk (C, or C / 2 on SM120)
    SUBS = C // SC
    assert K == V == 2 * C and SC * SUBS == C
    assert warmup or not boundary
    SLOTS = arch.slots
    assert SLOTS >= 2
    budget = ws_budgets(arch, "chunk_bwd_dh_ws")
    set_regs = budget is not None
    STATE_REGS, AUX_REGS = budget or (0, 0)
    gemm = mma(arch)                 # the dS chain's products
    wait = mma_wait(arch)
    Tt, Hk, Hv, N, N0, N1, NT, NW, NO = T.dynamic("Tt, Hk, Hv, N, N0, N1, NT, NW, NO")
    f32 = "float32"
    ds1_dtype = dtype if ds1_in_dtype else f32
    #: dS1 in dtype leaves by TMA from a shared [K, V] tile (``tile_ops.store_staged``);
    #: on sub-chunks (a row per sub-chunk, the 32 KB tile beside SM120's slots would not
    #: fit) it is stored from the registers
    stage = ds1_in_dtype and SUBS == 1

    def ds1_row(first_chunk, c):
        """dS1's row of the sequence's (sub-)chunk c (an expression, not a binding)."""
        return first_chunk * SUBS + c if SUBS > 1 else first_chunk + c

    @T.macro
    def load_chunk(q, k, do, A, empty, loaded, q_s, k_s, do_s, ag_s, t0, hk, h, r, c):
        """TMA the SC-row tiles of the walk's r-th (sub-)chunk, number c of the sequence
        (first token ``t0``), into slot r % SLOTS once the state warpgroups have released
        it; one elected aux thread issues them, every aux thread arrives on ``loaded[s]``
        (128 arrivals plus the tiles' bytes). A sub-chunk's inverse is the diagonal
        block of its chunk's A."""
        s = r % SLOTS
        T.barrier_wait(empty[s], (r // SLOTS) % 2 ^ 1)
        T.tma_copy(q[t0:t0 + SC, hk, :], q_s[s, :, :], barrier=loaded[s])
        T.tma_copy(k[t0:t0 + SC, hk, :], k_s[s, :, :], barrier=loaded[s])
        T.tma_copy(do[t0:t0 + SC, h, :], do_s[s, :, :], barrier=loaded[s])
        tma_inverse(A, ag_s, loaded, s, t0, h, c, SC)
        T.barrier_arrive(loaded[s])

    @T.prim_func
    def chunk_bwd_dh_ws(
        q: T.Tensor((Tt, Hk, K), dtype),
        k: T.Tensor((Tt, Hk, K), dtype),
        do: T.Tensor((Tt, Hv, V), dtype),
        g_cumsum: T.Tensor((Tt, Hv), f32),
        beta: T.Tensor((Tt, Hv), f32),
        A: T.Tensor((Tt, Hv, C), dtype),
        cu_seqlens: T.Tensor((N1,), "int32"),
        chunk_offsets: T.Tensor((N1,), "int32"),
        dht: T.Tensor((N0, Hv, K, V), f32),
        scale: T.float32,
        dS1: T.Tensor((NT, Hv, K, V), ds1_dtype),
        dh0: T.Tensor((N, Hv, K, V), f32),
        seq_end: T.Tensor((NW,), "int32"),
        seq_index: T.Tensor((NW,), "int32"),
        log_bound: T.float32,
        cta_order: T.Tensor((NO,), "int32"),
        ordered: T.int32,
    ):
        with T.Kernel(N * Hv, threads=384) as bx:
            # SLOTS slots of everything the aux warpgroup prepares for one chunk
            q_s = T.alloc_shared((SLOTS, SC, K), dtype)       # Q, then Qe in place
            k_s = T.alloc_shared((SLOTS, SC, K), dtype)
            do_s = T.alloc_shared((SLOTS, SC, V), dtype)
            ag_s = T.alloc_shared((SLOTS, SC, SC), dtype)     # A as loaded, then Ag
            p_s = T.alloc_shared((SLOTS, SC, SC), dtype)      # Ps = scale P
            eg_s = T.alloc_shared((SLOTS, SC), f32)           # exp(gam)
            ed_s = T.alloc_shared((SLOTS, SC), f32)           # exp(gam_C - gam)
            # aux-only
            gam_s = T.alloc_shared((SC,), f32)                # log2-scaled gam
            beta_s = T.alloc_shared((SC,), f32)
            if stage:                                         # state-only
                ds1_s = T.alloc_shared((K, V), dtype)         # dS1 of the chunk, for TMA
            qk = T.alloc_fragment((SC, SC), f32)             # Q K^T, then Ps
            gb = T.alloc_fragment((SC, SC), f32)             # G diag(beta), masked
            gam_next = T.alloc_fragment((SC,), f32)           # gates of the next chunk
            gam_last_next = T.alloc_fragment((SC,), f32)
            beta_next = T.alloc_fragment((SC,), f32)
            # state-only (dS^T [V, K] and the chunk's [V, C] tiles)
            dst = T.alloc_fragment((V, K), f32)
            dst_b = T.alloc_fragment((V, K), dtype)
            du = T.alloc_fragment((V, SC), f32)               # (K dS1)^T, then dX^T
            dup = T.alloc_fragment((V, SC), f32)              # dO^T Ps
            du_b = T.alloc_fragment((V, SC), dtype)           # dU^T, then -(E dX)^T

            n = T.alloc_var("int32", init=bx // Hv)
            if arch.ordered_grid and ordered != 0:     # else never read
                n = cta_order[bx // Hv]
            h = T.alloc_var("int32", init=bx % Hv)
            hk = T.alloc_var("int32", init=h // (Hv // Hk))
            bos = T.alloc_var("int32", init=cu_seqlens[n])
            seq_len = T.alloc_var("int32", init=cu_seqlens[n + 1] - bos)
            if warmup:
                out_eos = T.alloc_var("int32", init=bos + seq_len)   # the segment's end
                eos = T.alloc_var("int32", init=seq_end[n])          # the sequence's end
                seq_len = search_walk_end(g_cumsum, h, out_eos, eos, log_bound) - bos
                if boundary:                         # the warm-up chunks only
                    seq_len = bos + seq_len - out_eos
                    bos = out_eos
            last = T.alloc_var("int32", init=bos + seq_len - 1)
            first_chunk = T.alloc_var("int32", init=chunk_offsets[n])   # row of dS1
            chunks = T.alloc_var("int32", init=T.ceildiv(seq_len, SC))   # (sub-)chunks

            # slot of the walk's r-th chunk: aux -> state "full" (128 arrivals),
            # state -> aux "empty" (256)
            full = T.alloc_barrier([128] * SLOTS)
            empty = T.alloc_barrier([256] * SLOTS)
            loaded = T.alloc_barrier([128] * SLOTS)           # TMA -> aux, per slot

            if stage:                 # own bytes for ds1_s (see chunk_state_output's h_s)
                for i, j in T.Parallel(3, V):
                    ds1_s[i, j] = T.cast(0, dtype)
                T.sync_threads()
            with T.ws(2):                                     # aux
                if set_regs:
                    T.dec_max_nreg(AUX_REGS)
                if chunks > 0:
                    load_chunk(q, k, do, A, empty, loaded, q_s, k_s, do_s, ag_s,
                               bos + (chunks - 1) * SC, hk, h, 0, chunks - 1)
                    fetch_tile_gates(g_cumsum, beta, h, bos + (chunks - 1) * SC, last,
                                     chunks - 1, SC, gam_next, gam_last_next, beta_next)
                for r in T.serial(chunks):
                    c = chunks - 1 - r                        # walk the chunks backwards
                    a0 = bos + c * SC
                    a_rows = T.min(seq_len - c * SC, SC)
                    sa = r % SLOTS
                    # the previous chunk's copies fly while this one is prepared
                    if r + 1 < chunks:
                        load_chunk(q, k, do, A, empty, loaded, q_s, k_s, do_s, ag_s, a0 - SC,
                                   hk, h, r + 1, c - 1)
                    T.barrier_wait(loaded[sa], (r // SLOTS) % 2)  # this chunk's tiles landed
                    # rows past the end (next sequence, padding: maybe NaN) zeroed
                    if a_rows < SC:
                        for i, j in T.Parallel(SC, K):
                            if i >= a_rows:
                                q_s[sa, i, j] = T.cast(0, dtype)
                                k_s[sa, i, j] = T.cast(0, dtype)
                                do_s[sa, i, j] = T.cast(0, dtype)
                    for i in T.Parallel(SC):
                        gam_s[i] = gam_next[i] * LOG2E
                        beta_s[i] = beta_next[i]
                        eg_s[sa, i] = T.exp2(gam_next[i] * LOG2E)
                        ed_s[sa, i] = T.exp2((gam_last_next[i] - gam_next[i]) * LOG2E)
                    if c > 0:                                 # the previous chunk's gates
                        fetch_tile_gates(g_cumsum, beta, h, a0 - SC, last, c - 1, SC,
                                         gam_next, gam_last_next, beta_next)
                    T.fence_proxy_async()
                    T.sync_threads(AUX_BARRIER, 128)
                    T.gemm(q_s[sa, :, :], k_s[sa, :, :], qk, transpose_B=True,
                           clear_accum=True)                                      # Q K^T
                    for i, j in T.Parallel(SC, SC):
                        live = (i >= j) & (i < a_rows)
                        e = T.exp2(T.min(gam_s[i] - gam_s[j], 0.0))
                        decay = T.if_then_else(live, e, 0.0)
                        qk[i, j] = qk[i, j] * decay * scale                       # Ps
                        gb[i, j] = decay * beta_s[j]
                    for i, j in T.Parallel(SC, SC):
                        p_s[sa, i, j] = qk[i, j]
                        ag_s[sa, i, j] = T.if_then_else(
                            i < a_rows, ag_s[sa, i, j] * gb[i, j], 0.0)           # Ag
                    for i, j in T.Parallel(SC, K):                 # Q read by Q K^T: Qe
                        q_s[sa, i, j] = q_s[sa, i, j] * (eg_s[sa, i] * scale)
                    T.fence_proxy_async()            # generic stores -> WGMMA operand reads
                    T.barrier_arrive(full[sa])
                    T.sync_threads(AUX_BARRIER, 128)      # gam_s, beta_s read by all

            with T.ws(0, 1):                                  # state
                if set_regs:
                    T.inc_max_nreg(STATE_REGS)
                if has_dht and warmup:                    # the walk's end state
                    if bos + seq_len == seq_end[n]:       # the sequence's own end: dht
                        src = T.alloc_var("int32", init=seq_index[n])
                        for i, j in T.Parallel(V, K):
                            dst[i, j] = dht[src, h, j, i]
                    else:
                        T.clear(dst)
                elif has_dht:
                    for i, j in T.Parallel(V, K):
                        dst[i, j] = dht[n, h, j, i]
                else:
                    T.clear(dst)
                for r in T.serial(chunks):
                    c = chunks - 1 - r
                    ss = r % SLOTS
                    if warmup and not stage:
                        if bos + c * SC < out_eos:            # not a warm-up chunk
                            store_transposed(dS1, dst, ds1_row(first_chunk, c), h)
                    elif not stage:
                        store_transposed(dS1, dst, ds1_row(first_chunk, c), h)
                    for i, j in T.Parallel(V, K):
                        dst_b[i, j] = dst[i, j]
                    if warmup and stage:
                        if bos + c * SC < out_eos:            # not a warm-up chunk
                            store_staged(dS1, ds1_s, dst_b, first_chunk + c, h,
                                         STATE_BARRIER, 256)
                    elif stage:
                        store_staged(dS1, ds1_s, dst_b, first_chunk + c, h, STATE_BARRIER, 256)
                    T.barrier_wait(full[ss], (r // SLOTS) % 2)
                    gemm(dst_b, k_s[ss, :, :], du, transpose_B=True,
                                 clear_accum=True, policy=ROWS)                   # dS1^T K^T
                    gemm(do_s[ss, :, :], p_s[ss, :, :], dup, transpose_A=True,
                                 clear_accum=True, policy=ROWS)                   # dO^T Ps
                    for i, j in T.Parallel(V, K):
                        dst[i, j] = dst[i, j] * eg_s[ss, SC - 1]
                    gemm(do_s[ss, :, :], q_s[ss, :, :], dst, transpose_A=True,
                                 policy=ROWS)                                     # + dO^T Qe
                    wait(1)
                    for i, t in T.Parallel(V, SC):
                        du_b[i, t] = du[i, t] * ed_s[ss, t] + dup[i, t]          # dU^T
                    gemm(du_b, ag_s[ss, :, :], du, clear_accum=True,
                                 policy=ROWS)                                     # dX^T
                    wait(0)
                    for i, t in T.Parallel(V, SC):
                        du_b[i, t] = -eg_s[ss, t] * du[i, t]                      # -(E dX)^T
                    T.gemm(du_b, k_s[ss, :, :], dst, policy=ROWS)                 # + .. K
                    T.barrier_arrive(empty[ss])
                store_transposed(dh0, dst, n, h)
                if stage:
                    T.tma_store_wait()              # ds1_s read before the CTA's memory goes

    return chunk_bwd_dh_ws
