"""The forward's chunk recurrence: chunk states h, output o and final state in one pass.

One CTA per (sequence, value head) holds the whole state, transposed (S^T, V x K) so that
the value dimension is the WGMMA M dimension and S^T, R and U^T feed the next GEMM as
register A operands (``wgmma_rs``): no shared-memory copy, fence or barrier on the state
chain. Per chunk (gdn-math.md, "Chunked form", written for S^T; rows i, j / columns t of
the chunk, gam = chunk cumsum, E = diag(exp(gam)), D = diag(exp(gam_C - gam)),
G_ij = exp(gam_i - gam_j) for i >= j):

    O^T  = S0^T Q^T                      (K S0)^T = S0^T K^T          # [V, C]
    R    = V^T - (K S0)^T E              Ag = (G * A) diag(beta)     # [V, C], [C, C]
    U^T  = R Ag^T                        P  = G * tril(Q K^T)        # [V, C], [C, C]
    O^T  = scale (O^T E + U^T P^T)
    S1^T = exp(gam_C) S0^T + (U^T D) K                                # [V, K]

On WGMMA, U^T is two products: -((K S0)^T E) Ag^T from registers, then V^T Ag^T
accumulated from the slot's v tile in shared memory (``v_by_mma``), so the state
warpgroups never read v element by element.

Every exponent is <= 0 and evaluated as exp2 of log2-scaled gates. Three warpgroups per
CTA, roles fixed by ``T.ws``:

- warpgroups 0, 1 (state, 64 rows of S^T each, in registers): per chunk only the
  WGMMA chain above (register A but for V^T Ag^T) and its element-wise steps;
- warpgroup 2 (aux): prepares chunk c into slot c % SLOTS while the state warpgroups
  work on an earlier chunk: its q, k, v, A tiles arrive by TMA issued one chunk ahead
  by one elected thread (rows past the sequence's end are zeroed in shared memory once
  they land, so NaN in padding never enters a GEMM), then Q K^T on the tensor cores,
  the masked, gated Ag (in place of A) and P, and the per-row factors exp(gam),
  exp(gam_C - gam).

The roles meet only on per-slot mbarriers: "full" (aux -> state, 128 arrivals) and
"empty" (state -> aux, 256); "loaded" (TMA -> aux, 128 arrivals and the tiles' bytes).
TMA loads instead of per-thread cp.async took ~260 address and predicate instructions
per chunk off the aux warpgroup, the role the state waited for (3.71 -> 3.33 us per
chunk, docs/perf-notes.md v18). Nothing state-independent (loads, gate exponentials,
masks, Q K^T) is left on the state chain, and the two state warpgroups meet only
where they hand a staged tile (o, or h) to one TMA store. TileLang's automatic
synchronisation is off for this kernel: it would put CTA-wide barriers between the role
blocks and serialise them.

o leaves by TMA: the state warpgroups write a whole chunk's O^T transposed into a shared
[C, V] tile and one elected thread stores it (``store_o_staged``; the per-thread
stores it replaced were 32% of the state's stall samples, and it took 6-10% off the
kernel on the H100, docs/perf-notes.md). A chunk cut by its sequence's end, the
variant that stages h and the mma.sync builds store o per thread (``store_o``).

Sub-chunks (``arch.sub_chunk`` < 64: SM120, whose 99 KB of shared memory do not hold
three slots of 64-token tiles): the loop walks 32-token tiles; a sub-chunk's inverse is
the diagonal block of its chunk's A, its gates are rebased to its own start
(``tile_ops.rebase_gates``), and the split's walks stay on chunk totals. fp32 h for a
caller (``output_h``) stays per 64-token chunk (stored at each chunk's first half); h in
q's dtype, the backward's states, has a row per sub-chunk
(``flash_qla_tl.layout.state_rows``), stored from the registers (no 32 KB staging tile
beside SM120's slots).

Registers (SM90): setmaxnreg gives the state warpgroups 192 and the aux one 120 (at the
plain 168, ptxas serialised every WGMMA k-step). The chain has one WGMMA in flight at a
time ((Q S0)^T waited for before (K S0)^T is issued): with both in flight it needed 208,
which left the aux 88, and the aux bounded the step; at 192 / 120 the kernel is 7-9%
faster (H100, docs/perf-notes.md). The aux's mask pass runs in two loops, the
gate factors into registers first and the P / Ag stores after, so the few gate values
each thread needs are loaded once, not after every store; it computes exp2 for every
element and selects (a branch per element was 2.4% slower). The state's element-wise
steps that need no pending product run under the one in flight (``decay_under_qs``,
``o_scale_under_ks`` below). 2.93 us per chunk for the whole state at 16/16 1x32768 on
the H100 (docs/perf-notes.md).
"""

import tilelang
import tilelang.language as T

from ..arch import Arch
from .builder import arch_kernel
from .tile_ops import (
    LOG2E,
    fetch_gates,
    fetch_tile_gates,
    mma,
    mma_wait,
    store_staged,
    store_transposed,
    tma_inverse,
)
from .traits import CHUNK, WALK_UNROLL

ROWS = T.GemmWarpPolicy.FullRow     # the state warpgroups split M (= V): RS operand layout


def ws_budgets(arch: Arch, kernel: str) -> tuple[int, int] | None:
    """``arch``'s setmaxnreg budgets (state, aux) of a three-warpgroup sweep (this kernel,
    ``chunk_state_grad``), or None (no setmaxnreg). They move registers within the CTA's
    launch allocation (384 threads x 168, ptxas's bound for 384 threads), so 256 x state
    + 128 x aux must not exceed 64,512: an increase that the decreases cannot cover
    blocks forever (208 / 96 asks for 1,024 registers more than there are, and hangs).
    At 168 the state warpgroups' WGMMAs were serialised by ptxas (C7512, "insufficient
    register resources"): each 16-deep step waited for the previous one."""
    budget = arch.budget(kernel)
    if budget is not None:
        state, aux = budget
        assert 256 * state + 128 * aux <= 384 * 168, (kernel, budget)
    return budget

#: Named barriers (0 is __syncthreads'): the aux warpgroup's, and the two state
#: warpgroups' around the staged h store. TileLang's cross-warp reductions
#: (``T.reduce_*``, ``tl::AllReduce``) also use ids 1 and 2: these kernels have no
#: reduction across warps; adding one means new ids here.
AUX_BARRIER, STATE_BARRIER = 1, 2


# Every synchronisation is written out (see the module docstring).
@arch_kernel(pass_configs={tilelang.PassConfigKey.TL_DISABLE_THREAD_STORAGE_SYNC: True})
def chunk_fwd_ws_kernel(arch: Arch, dtype: str, K: int, V: int, has_initial_state: bool,
                        store_h: bool, warmup: bool = False, h_in_dtype: bool = False,
                        states_only: bool = False, pool_dtype: str | None = None,
                        pool_v_first: bool = False):
    """Build the forward for ``arch``, q/k/v dtype ``dtype``, K = V = 128.

    ``arch`` gives the chain's GEMMs (WGMMA, or mma.sync through ``T.gemm``: the same
    register-A chain), the ring of ``arch.slots`` shared-memory slots (the state works
    on chunk c - 1 while the aux warpgroup prepares chunk c and chunk c + 1's tiles are
    in flight; at least 2: the aux loads chunk c + 1 before it hands chunk c over) and
    the roles' setmaxnreg budgets (:func:`ws_budgets`).

    Kernel arguments (packed token layout, Tt = total tokens, N sequences; state layouts
    ``[.., K, V]``, transposed on load and store):
        q, k            [Tt, Hk, K]     dtype
        v               [Tt, Hv, V]     dtype
        g_cumsum        [Tt, Hv]        fp32, chunk-local cumsum of the log gate
        beta            [Tt, Hv]        fp32
        A               [Tt, Hv, C]     dtype, gate-free inverse per chunk row
        cu_seqlens      [N+1]           int32
        chunk_offsets   [N+1]           int32, first chunk of each sequence (row in h)
        initial_state   [N0, Hv, K, V]  fp32 (read only with has_initial_state)
        scale           fp32 scalar
        o               [Tt, Hv, V]     dtype out (rows of every sequence)
        final_state     [N, Hv, K, V]   fp32 out
        h_out           [NTh, Hv, K, V] fp32 (``dtype`` with ``h_in_dtype``) out,
                                        chunk-start states (written if store_h)
        seq_start, seq_index  [NW]      int32, read only with ``warmup`` (seq_index
                                        also with ``pool_dtype``: the slots)
        log_bound       fp32 scalar, read only with ``warmup``
        cta_order       [NO]            int32, read only where ``ordered`` != 0
        ordered         int32 scalar

    ``ordered`` != 0: CTA ``b`` works on sequence ``cta_order[b // Hv]`` (a permutation
    of the N sequences, longest first: ``flash_qla_tl.layout.cta_order``), else on
    sequence ``b // Hv``. The block scheduler hands CTAs to free SMs in index order, so
    where the grid takes several waves the longest chains start first (list scheduling,
    longest first) instead of wherever the batch packed them.

    ``warmup`` (the bounded segment split, the rule of ``flash_qla.segments.
    warmup_starts``, searched here): the "sequences" of ``cu_seqlens`` are segments;
    segment n belongs to sequence ``seq_index[n]``, which starts at token
    ``seq_start[n]``. CTA (n, h) walks back over the whole chunks before its segment,
    summing their decays (g_cumsum at each chunk's last token, clamped at 0), and starts
    its recurrence at the first chunk boundary where the sum is <= ``log_bound`` (natural
    log) from a zero state, or at the sequence's start from ``initial_state[seq_index[n],
    h]``; it stores o only from ``cu_seqlens[n]`` on: the chunks before are a warm-up,
    which rebuilds the segment's start state up to what decayed below the bound. The
    search loads WALK_UNROLL chunk totals per step (independent loads), so a walk back
    over m chunks waits on ceil(m / WALK_UNROLL) memory round trips.
    ``final_state[n]`` is the segment's final state; with ``store_h``, h is stored for
    the segment's own chunks only (rows from ``chunk_offsets[n]``, the segment's first
    chunk in the sequences' chunk numbering), not for the warm-up.

    ``h_in_dtype``: h is stored in ``dtype`` instead of fp32 (the chunk states the
    backward reads: half the bytes; its gradient kernels round them to ``dtype`` GEMM
    operands anyway). fp32 h is what a caller asking for h (``output_h``) gets.

    ``states_only`` (the backward's recompute of h): o is neither computed nor stored
    (``o`` is not touched): no q tiles, no Q K^T or P on the aux warpgroup, and the
    state chain is three WGMMAs per chunk ((K S0)^T, U^T, (U^T D) K) instead of five.

    ``pool_dtype`` (an engine's state pool, ``flash_qla.chunk_gated_delta_rule(...,
    state_indices=)``; not with ``warmup``): ``initial_state`` and ``final_state`` are one
    pool ``[P, Hv, K, V]`` (``pool_v_first``: ``[P, Hv, V, K]``) in ``pool_dtype``, passed
    twice and read and written through ``final_state`` only; ``seq_index[n]`` is sequence
    n's slot. CTA (n, h) starts from ``pool[slot, h]`` (converted to fp32) and writes its
    final state there, rounded to ``pool_dtype``; a negative slot starts from zeros and
    writes nothing. Each element is read and later written by the same thread: slots
    must be distinct (not checked here). The grid is taken from ``cu_seqlens``."""
    assert pool_dtype is None or not warmup, "the state pool is not read by a split"
    C = CHUNK                        # A's width, h's rows, the split's walks: 64-token chunks
    SC = arch.sub_chunk              # the token tile of the loop (C, or C / 2 on SM120)
    SUBS = C // SC                   # sub-chunks per chunk
    assert SC * SUBS == C, SC
    SLOTS = arch.slots
    assert SLOTS >= 2
    budget = ws_budgets(arch, "chunk_fwd_ws")
    set_regs = budget is not None
    STATE_REGS, AUX_REGS = budget or (0, 0)
    gemm = mma(arch)                 # the state chain's products
    wait = mma_wait(arch)
    # N0: initial_state's rows (sequences; with ``warmup`` N counts segments)
    Tt, Hk, Hv, N, N0, N1, NTh, NW, NO = T.dynamic("Tt, Hk, Hv, N, N0, N1, NTh, NW, NO")
    f32 = "float32"
    h_dtype = dtype if h_in_dtype else f32
    #: h in dtype leaves by TMA from a shared [K, V] tile (32 KB: fits beside the slots);
    #: fp32 h (64 KB) is stored from the registers, and so is h in dtype on sub-chunks
    #: (the 32 KB tile does not fit beside SM120's slots)
    stage_h = store_h and h_in_dtype and SUBS == 1
    #: o of a whole chunk leaves by TMA from a shared [C, V] tile (16 KB) on the WGMMA
    #: builds: the state warpgroups write it transposed in shared memory instead of 32
    #: scattered two-byte global stores per thread (the largest block of the state's
    #: issue, 32% of its stall samples: docs/perf-notes.md); a chunk cut by its
    #: sequence's end keeps the per-thread stores (a box would write the next
    #: sequence's rows). Not beside h's 32 KB tile (no room) nor on mma.sync builds
    #: (their code, and the proof builds' GPU tests, stay as they were).
    stage_o = (arch.mma == "wgmma") and not states_only and not stage_h \
        and SUBS == 1
    #: the backward's states on sub-chunks: one row per sub-chunk (its gradient kernel
    #: works per sub-chunk); fp32 h for the caller stays per 64-token chunk
    sub_rows = store_h and h_in_dtype and SUBS > 1
    pool = pool_dtype is not None
    state_dtype = pool_dtype if pool else f32
    state_dims = (V, K) if pool_v_first else (K, V)
    h0_shape = (N0, Hv, *state_dims)
    final_shape = (N0 if pool else N, Hv, *state_dims)    # the pool's rows, or N
    grid = (N1 - 1) * Hv if pool else N * Hv
    #: element-wise steps that need no pending product run under an asynchronous one
    #: (WGMMA; on mma.sync ``T.gemm`` has completed when it returns): st (not an operand:
    #: st_b is) takes its decay to the chunk's end under (Q S0)^T and O^T its E under
    #: (K S0)^T: -4% / -10% per chunk at 16/32 six sequences / 16/16 1x32768
    #: (docs/perf-notes.md). The decay stays beside (U^T D) K on a state pool (under
    #: (Q S0)^T the bf16 pool's k-first variant spilled 152 B) and in the states-only
    #: variant (under (K S0)^T, its only product before U^T, ptxas serialised the chain:
    #: C7512).
    under = arch.mma == "wgmma"
    decay_under_qs = under and not states_only and not pool
    o_scale_under_ks = under and not states_only
    #: U^T = R Ag^T with R's V^T term taken by the tensor cores from shared memory (an SS
    #: WGMMA, V^T Ag^T, after the RS one of -((K S0)^T E) Ag^T; in the other order ptxas
    #: spilled): the state warpgroups no longer read v's tile transposed element by
    #: element. Not on mma.sync: there it raised SM100's spills.
    v_by_mma = under

    @T.macro
    def load_chunk(q, k, v, A, empty, loaded, q_s, k_s, v_s, ag_s, t0, hk, h, c):
        """TMA the SC-row tiles of (sub-)chunk ``c`` (first token ``t0``) into slot c % SLOTS
        once the state warpgroups have released it (chunk c - SLOTS); one elected aux
        thread issues them, every aux thread arrives on ``loaded[s]`` (128 arrivals plus
        the tiles' bytes), which the aux waits on before it prepares the chunk. A
        sub-chunk's inverse is the diagonal SC x SC block of its chunk's A (A is block
        lower triangular: docs/blackwell-plan.md, 0.5)."""
        s = c % SLOTS
        T.barrier_wait(empty[s], (c // SLOTS) % 2 ^ 1)
        if not states_only:
            T.tma_copy(q[t0:t0 + SC, hk, :], q_s[s, :, :], barrier=loaded[s])
        T.tma_copy(k[t0:t0 + SC, hk, :], k_s[s, :, :], barrier=loaded[s])
        T.tma_copy(v[t0:t0 + SC, h, :], v_s[s, :, :], barrier=loaded[s])
        tma_inverse(A, ag_s, loaded, s, t0, h, c, SC)
        T.barrier_arrive(loaded[s])

    @T.macro
    def store_o(o, ot, scale, t0, rows, h):
        """o[t0 + t, h, :] = scale * O^T[:, t] for the chunk's ``rows`` rows."""
        for i, t in T.Parallel(V, SC):
            if t < rows:
                o[t0 + t, h, i] = T.cast(ot[i, t] * scale, dtype)

    @T.macro
    def store_o_staged(o, o_s, ot, scale, t0, h):
        """o[t0:t0 + SC, h, :] = scale * (O^T)^T through the shared tile ``o_s`` ``[SC,
        V]`` and one TMA store (a whole chunk): the state warpgroups write their rows of
        O^T transposed into the tile and one elected thread stores it, after its
        previous store has read the tile (long done: a chunk earlier)."""
        T.tma_store_wait()
        T.sync_threads(STATE_BARRIER, 256)
        for i, t in T.Parallel(V, SC):
            o_s[t, i] = T.cast(ot[i, t] * scale, dtype)
        T.fence_proxy_async()                 # generic stores -> the TMA engine's reads
        T.sync_threads(STATE_BARRIER, 256)
        T.tma_copy(o_s, o[t0:t0 + SC, h, :])

    @T.macro
    def store_o_chunk(o, o_s, ot, scale, t0, rows, h):
        """The chunk's o: staged when it is whole and the build stages o, else per
        thread (a cut chunk's box would write the next sequence's rows)."""
        if stage_o:
            if rows == SC:
                store_o_staged(o, o_s, ot, scale, t0, h)
            else:
                store_o(o, ot, scale, t0, rows, h)
        else:
            store_o(o, ot, scale, t0, rows, h)

    @T.prim_func
    def chunk_fwd_ws(
        q: T.Tensor((Tt, Hk, K), dtype),
        k: T.Tensor((Tt, Hk, K), dtype),
        v: T.Tensor((Tt, Hv, V), dtype),
        g_cumsum: T.Tensor((Tt, Hv), f32),
        beta: T.Tensor((Tt, Hv), f32),
        A: T.Tensor((Tt, Hv, C), dtype),
        cu_seqlens: T.Tensor((N1,), "int32"),
        chunk_offsets: T.Tensor((N1,), "int32"),
        initial_state: T.Tensor(h0_shape, state_dtype),
        scale: T.float32,
        o: T.Tensor((Tt, Hv, V), dtype),
        final_state: T.Tensor(final_shape, state_dtype),
        h_out: T.Tensor((NTh, Hv, K, V), h_dtype),
        seq_start: T.Tensor((NW,), "int32"),
        seq_index: T.Tensor((NW,), "int32"),
        log_bound: T.float32,
        cta_order: T.Tensor((NO,), "int32"),
        ordered: T.int32,
    ):
        with T.Kernel(grid, threads=384) as bx:
            # SLOTS slots of everything the aux warpgroup prepares for one chunk
            q_s = T.alloc_shared((SLOTS, SC, K), dtype)
            k_s = T.alloc_shared((SLOTS, SC, K), dtype)
            v_s = T.alloc_shared((SLOTS, SC, V), dtype)
            ag_s = T.alloc_shared((SLOTS, SC, SC), dtype)     # A as loaded, then Ag in place
            p_s = T.alloc_shared((SLOTS, SC, SC), dtype)
            eg_s = T.alloc_shared((SLOTS, SC), f32)           # exp(gam)
            ed_s = T.alloc_shared((SLOTS, SC), f32)           # exp(gam_C - gam)
            # aux-only
            gam_s = T.alloc_shared((SC,), f32)                # log2-scaled gam
            beta_s = T.alloc_shared((SC,), f32)
            o_s = None                                        # state-only, for TMA:
            if stage_h:
                h_s = T.alloc_shared((K, V), dtype)           # S0 of the chunk
            if stage_o:                                       # (never both)
                o_s = T.alloc_shared((SC, V), dtype)          # o of the chunk
            qk = T.alloc_fragment((SC, SC), f32)             # Q K^T, then P
            gb = T.alloc_fragment((SC, SC), f32)             # G diag(beta), masked
            gam_next = T.alloc_fragment((SC,), f32)           # gates of the next chunk
            gam_last_next = T.alloc_fragment((SC,), f32)
            beta_next = T.alloc_fragment((SC,), f32)
            # state-only (S^T [V, K] and the chunk's [V, C] tiles)
            st = T.alloc_fragment((V, K), f32)
            st_b = T.alloc_fragment((V, K), dtype)
            ks = T.alloc_fragment((V, SC), f32)               # (K S0)^T, then U^T
            r_b = T.alloc_fragment((V, SC), dtype)            # R, then U^T in dtype
            du_b = T.alloc_fragment((V, SC), dtype)           # U^T D
            ot = T.alloc_fragment((V, SC), f32)               # O^T

            n = T.alloc_var("int32", init=bx // Hv)
            if arch.ordered_grid and ordered != 0:     # else never read
                n = cta_order[bx // Hv]
            h = T.alloc_var("int32", init=bx % Hv)
            hk = T.alloc_var("int32", init=h // (Hv // Hk))
            bos = T.alloc_var("int32", init=cu_seqlens[n])        # first token walked
            if warmup:
                out_bos = T.alloc_var("int32", init=bos)           # first token of o
                # the walk's start: the latest chunk boundary >= seq0 whose whole
                # chunks up to the segment decay by <= log_bound, else seq0
                seq0 = T.alloc_var("int32", init=seq_start[n])
                prefix = T.alloc_var("int32", init=(out_bos - seq0) // C)   # chunks
                found = T.alloc_var("int32", init=0)
                decay = T.alloc_var(f32, init=0.0)
                totals = T.alloc_local((WALK_UNROLL,), f32)   # a step's chunk totals
                bos = seq0
                for step in T.serial(T.ceildiv(prefix, WALK_UNROLL)):
                    if found == 0:
                        for u in T.unroll(WALK_UNROLL):    # independent (clamped) loads
                            totals[u] = g_cumsum[
                                T.max(out_bos - (step * WALK_UNROLL + u) * C - 1, 0), h]
                        for u in T.unroll(WALK_UNROLL):    # chunk m ends m chunks back
                            if (found == 0) & (step * WALK_UNROLL + u < prefix):
                                decay = decay + T.min(totals[u], 0.0)
                                if decay <= log_bound:
                                    found = 1
                                    bos = out_bos - (step * WALK_UNROLL + u + 1) * C
            seq_len = T.alloc_var("int32", init=cu_seqlens[n + 1] - bos)
            last = T.alloc_var("int32", init=bos + seq_len - 1)
            first_chunk = T.alloc_var("int32", init=chunk_offsets[n])
            chunks = T.alloc_var("int32", init=T.ceildiv(seq_len, SC))   # (sub-)chunks

            # slot s of chunk c: aux -> state "full" (128 arrivals), state -> aux "empty"
            full = T.alloc_barrier([128] * SLOTS)
            empty = T.alloc_barrier([256] * SLOTS)
            loaded = T.alloc_barrier([128] * SLOTS)           # TMA -> aux, per slot

            if stage_h or stage_o:
                # h_s / o_s is written only by the state warpgroups, but TileLang's
                # planner reuses the bytes of buffers whose last use comes earlier in
                # program order (the aux block's): a use by every thread before the
                # roles split keeps it in bytes of its own (else a race:
                # docs/perf-notes.md v17); a few rows suffice (one element per thread),
                # the sync orders them before the state's first staged store
                for i, j in T.Parallel(3, V):
                    if stage_h:
                        h_s[i, j] = T.cast(0, dtype)
                    else:
                        o_s[i, j] = T.cast(0, dtype)
                T.sync_threads()
            with T.ws(2):                                     # aux: chunk c into slot c % SLOTS
                if set_regs:
                    T.dec_max_nreg(AUX_REGS)
                if chunks > 0:
                    load_chunk(q, k, v, A, empty, loaded, q_s, k_s, v_s, ag_s, bos, hk, h,
                               0)
                    fetch_gates(g_cumsum, beta, h, bos, last, gam_next, gam_last_next,
                                beta_next)
                for c in T.serial(chunks):
                    a0 = bos + c * SC
                    a_rows = T.min(seq_len - c * SC, SC)
                    sa = c % SLOTS
                    # chunk c + 1's copies fly while chunk c is prepared
                    if c + 1 < chunks:
                        load_chunk(q, k, v, A, empty, loaded, q_s, k_s, v_s, ag_s, a0 + SC,
                                   hk, h, c + 1)
                    T.barrier_wait(loaded[sa], (c // SLOTS) % 2)  # chunk c's tiles landed
                    # rows past the end (next sequence, padding: maybe NaN) zeroed
                    if a_rows < SC:
                        for i, j in T.Parallel(SC, K):
                            if i >= a_rows:
                                if not states_only:
                                    q_s[sa, i, j] = T.cast(0, dtype)
                                k_s[sa, i, j] = T.cast(0, dtype)
                                v_s[sa, i, j] = T.cast(0, dtype)
                    # gates (fetched one chunk ahead; rows past the end repeat the last
                    # gam and have beta = 0), then the next chunk's fetch
                    for i in T.Parallel(SC):
                        gam_s[i] = gam_next[i] * LOG2E
                        beta_s[i] = beta_next[i]
                        eg_s[sa, i] = T.exp2(gam_next[i] * LOG2E)
                        ed_s[sa, i] = T.exp2((gam_last_next[i] - gam_next[i]) * LOG2E)
                    fetch_tile_gates(g_cumsum, beta, h, a0 + SC, last, c + 1, SC, gam_next,
                                     gam_last_next, beta_next)
                    T.fence_proxy_async()
                    T.sync_threads(AUX_BARRIER, 128)
                    if not states_only:
                        T.gemm(q_s[sa, :, :], k_s[sa, :, :], qk, transpose_B=True,
                               clear_accum=True)                                  # Q K^T
                    # two passes: the gate factors into registers first (only shared
                    # loads, so nvcc keeps each thread's few distinct gam / beta values
                    # in registers instead of reloading them after every store), then
                    # the stores of P and Ag
                    for i, j in T.Parallel(SC, SC):
                        live = (i >= j) & (i < a_rows)
                        e = T.exp2(T.min(gam_s[i] - gam_s[j], 0.0))   # no branch:
                        decay = T.if_then_else(live, e, 0.0)          # exp2, then select
                        if not states_only:
                            qk[i, j] = qk[i, j] * decay                           # P
                        gb[i, j] = decay * beta_s[j]
                    for i, j in T.Parallel(SC, SC):              # (A's rows past the
                        if not states_only:                          # end are selected
                            p_s[sa, i, j] = qk[i, j]
                        ag_s[sa, i, j] = T.if_then_else(             # away, not scaled)
                            i < a_rows, ag_s[sa, i, j] * gb[i, j], 0.0)           # Ag
                    T.fence_proxy_async()            # generic stores -> WGMMA operand reads
                    T.barrier_arrive(full[sa])
                    T.sync_threads(AUX_BARRIER, 128)      # gam_s, beta_s read by all

            with T.ws(0, 1):                                  # state: chunk c from its slot
                if set_regs:
                    T.inc_max_nreg(STATE_REGS)
                if pool:                                  # the sequence's pool slot
                    src = T.alloc_var("int32", init=seq_index[n])
                    if src >= 0:
                        for i, j in T.Parallel(V, K):
                            if pool_v_first:
                                st[i, j] = T.cast(final_state[src, h, i, j], f32)
                            else:
                                st[i, j] = T.cast(final_state[src, h, j, i], f32)
                    else:
                        T.clear(st)
                elif has_initial_state and not warmup:
                    for i, j in T.Parallel(V, K):
                        st[i, j] = initial_state[n, h, j, i]
                elif has_initial_state:                   # the walk's start state
                    # seq_start / seq_index reloaded here rather than kept from the
                    # search: a register live into this branch makes ptxas serialise
                    # the WGMMA chain (C7512)
                    if bos == seq_start[n]:               # the sequence's own start
                        src = T.alloc_var("int32", init=seq_index[n])
                        for i, j in T.Parallel(V, K):
                            st[i, j] = initial_state[src, h, j, i]
                    else:
                        T.clear(st)
                else:
                    T.clear(st)
                for c in T.serial(chunks):
                    t0 = bos + c * SC
                    rows = T.min(seq_len - c * SC, SC)
                    ss = c % SLOTS
                    if sub_rows and warmup:           # h in dtype at every sub-chunk
                        if t0 >= out_bos:
                            store_transposed(h_out, st,
                                             first_chunk * SUBS + (t0 - out_bos) // SC, h)
                    elif sub_rows:
                        store_transposed(h_out, st, first_chunk * SUBS + c, h)
                    elif SUBS > 1 and store_h:        # fp32 h at each chunk's first half
                        if c % SUBS == 0:
                            if warmup:
                                if t0 >= out_bos:
                                    store_transposed(h_out, st,
                                                     first_chunk + (t0 - out_bos) // C, h)
                            else:
                                store_transposed(h_out, st, first_chunk + c // SUBS, h)
                    elif store_h and not stage_h and warmup:
                        if t0 >= out_bos:                     # the segment's own chunks
                            store_transposed(h_out, st, first_chunk + (t0 - out_bos) // C, h)
                    elif store_h and not stage_h:
                        for i, j in T.Parallel(V, K):
                            h_out[first_chunk + c, h, j, i] = st[i, j]
                    for i, j in T.Parallel(V, K):
                        st_b[i, j] = st[i, j]
                    if stage_h and warmup:
                        if t0 >= out_bos:                     # the segment's own chunks
                            store_staged(h_out, h_s, st_b, first_chunk + (t0 - out_bos) // C, h,
                                         STATE_BARRIER, 256)
                    elif stage_h:
                        store_staged(h_out, h_s, st_b, first_chunk + c, h, STATE_BARRIER, 256)
                    T.barrier_wait(full[ss], (c // SLOTS) % 2)
                    # one product in flight at a time: with both, 192 registers make
                    # ptxas serialise every WGMMA (C7512), and the aux needs its 120
                    if not states_only:
                        gemm(st_b, q_s[ss, :, :], ot, transpose_B=True,
                                     clear_accum=True, policy=ROWS)               # (Q S0)^T
                        if decay_under_qs:
                            for i, j in T.Parallel(V, K):
                                st[i, j] = st[i, j] * eg_s[ss, SC - 1]
                        wait(0)
                    gemm(st_b, k_s[ss, :, :], ks, transpose_B=True,
                                 clear_accum=True, policy=ROWS)                   # (K S0)^T
                    if o_scale_under_ks:
                        for i, t in T.Parallel(V, SC):
                            ot[i, t] = ot[i, t] * eg_s[ss, t]
                    wait(0)
                    if v_by_mma:
                        for i, t in T.Parallel(V, SC):
                            r_b[i, t] = -eg_s[ss, t] * ks[i, t]
                        gemm(r_b, ag_s[ss, :, :], ks, transpose_B=True,
                                     clear_accum=True, policy=ROWS)     # -((K S0)^T E) Ag^T
                        gemm(v_s[ss, :, :], ag_s[ss, :, :], ks, transpose_A=True,
                                     transpose_B=True, policy=ROWS)     # U^T += V^T Ag^T
                    else:
                        for i, t in T.Parallel(V, SC):
                            r_b[i, t] = v_s[ss, t, i] - eg_s[ss, t] * ks[i, t]
                        gemm(r_b, ag_s[ss, :, :], ks, transpose_B=True,
                                     clear_accum=True, policy=ROWS)               # U^T
                    wait(0)
                    if states_only:
                        for i, t in T.Parallel(V, SC):
                            du_b[i, t] = ks[i, t] * ed_s[ss, t]
                    else:
                        for i, t in T.Parallel(V, SC):
                            r_b[i, t] = ks[i, t]
                            du_b[i, t] = ks[i, t] * ed_s[ss, t]
                            if not o_scale_under_ks:
                                ot[i, t] = ot[i, t] * eg_s[ss, t]
                        gemm(r_b, p_s[ss, :, :], ot, transpose_B=True,
                                     policy=ROWS)                                 # + U^T P^T
                    if not decay_under_qs:
                        for i, j in T.Parallel(V, K):
                            st[i, j] = st[i, j] * eg_s[ss, SC - 1]
                    T.gemm(du_b, k_s[ss, :, :], st, policy=ROWS)                 # + (U^T D) K
                    T.barrier_arrive(empty[ss])
                    if warmup and not states_only:
                        if t0 >= out_bos:                     # not a warm-up chunk
                            store_o_chunk(o, o_s, ot, scale, t0, rows, h)
                    elif not states_only:
                        store_o_chunk(o, o_s, ot, scale, t0, rows, h)
                if pool:               # the slot reloaded: no register live in the chain
                    dst = T.alloc_var("int32", init=seq_index[n])
                    if dst >= 0:
                        for i, j in T.Parallel(V, K):
                            if pool_v_first:
                                final_state[dst, h, i, j] = T.cast(st[i, j], state_dtype)
                            else:
                                final_state[dst, h, j, i] = T.cast(st[i, j], state_dtype)
                else:
                    for i, j in T.Parallel(V, K):
                        final_state[n, h, j, i] = st[i, j]
                if stage_h or stage_o:
                    T.tma_store_wait()    # h_s / o_s read before the CTA's memory goes

    return chunk_fwd_ws
