"""Tile-level steps shared by the Hopper kernels (TileLang macros, inlined at each use).

- ``fetch_gates`` / ``stage_gates``: a chunk's gates global -> registers (issued one chunk
  ahead, so the loads overlap the current chunk) -> shared memory as the per-row factors
  of the chunked form (gdn-math.md): log2-scaled gam, exp(gam), exp(gam_C - gam), beta;
  ``rebase_gates``: a sub-chunk's own cumsum from its chunk's; ``fetch_tile_gates``:
  ``fetch_gates`` of a walk's (sub-)chunk, rebased where it starts inside its chunk.
- ``tma_inverse``: the TMA box of a (sub-)chunk's inverse in A.
- ``zero_rows_past``: zero a shared tile's rows past the end of a sequence, so that NaN
  or Inf in padding (or in the next sequence's rows) never meets a GEMM as 0 * NaN.
- ``search_walk_end``: where a bounded split's reverse walk ends (the dS sweeps).
- ``store_transposed``: a [K, V] state (or state gradient) held transposed in registers
  to its row of a ``[rows, H, K, V]`` tensor (the warp-specialised sweeps).
- ``store_staged``: the same in q's dtype through a shared [K, V] tile and one TMA store.
- ``mma`` / ``mma_wait``: the GEMM of a chain step and its wait, by the arch's flavour.
"""

import math

import tilelang.language as T

from .traits import CHUNK, WALK_UNROLL

#: exp(x) = exp2(x * LOG2E): exponents are evaluated as exp2 of log2-scaled gates.
LOG2E = math.log2(math.e)


def mma(arch):
    """The GEMM of the kernels' chains on ``arch`` (same arguments as ``T.gemm``):
    ``T.wgmma_gemm`` on WGMMA (asynchronous: results are read after :func:`mma_wait`),
    else ``T.gemm``, which lowers to mma.sync on every Blackwell target (and on
    ``sm_90a`` under ``tl.disable_wgmma``) and is complete when it returns: what
    overlapped two WGMMAs becomes instruction-level parallelism within a warp."""
    return T.wgmma_gemm if arch.mma == "wgmma" else T.gemm


def _complete(pending):
    """``mma_wait`` without WGMMA: every ``T.gemm`` has completed already."""


def mma_wait(arch):
    """``wait(pending)``: until at most ``pending`` of the :func:`mma` GEMMs issued are
    in flight (``T.wait_wgmma``); nothing to wait for on mma.sync."""
    return T.wait_wgmma if arch.mma == "wgmma" else _complete


@T.macro
def fetch_gates(g_cumsum, beta, h, start, last, gam_next, gam_last_next, beta_next):
    """Gates of the chunk whose first token is ``start`` (value head ``h``) into the
    register fragments ``gam_next``, ``gam_last_next``, ``beta_next`` ``[C]``: the
    chunk cumsum per row and at the chunk's last row, and beta. Rows past the sequence's
    ``last`` token repeat gam[last] and get beta = 0 (``last >= start`` is the caller's:
    an empty sequence has no chunk to fetch)."""
    C = gam_next.shape[0]
    for i in T.Parallel(C):
        gam_next[i] = g_cumsum[T.min(start + i, last), h]
        gam_last_next[i] = g_cumsum[T.min(start + C - 1, last), h]
        beta_next[i] = T.if_then_else(start + i <= last, beta[start + i, h], 0.0)


@T.macro
def rebase_gates(g_cumsum, h, start, last, gam_next, gam_last_next):
    """Gates fetched by :func:`fetch_gates` for a sub-chunk that starts inside its chunk
    (at token ``start``, not a chunk boundary): ``g_cumsum`` is the cumsum from the
    chunk's first token, so subtract its value at ``start - 1`` (clamped to ``last``)
    to get the sub-chunk's own cumsum, the gam its recurrence step takes."""
    base = g_cumsum[T.min(start - 1, last), h]
    for i in T.Parallel(gam_next.shape[0]):
        gam_next[i] = gam_next[i] - base
        gam_last_next[i] = gam_last_next[i] - base


@T.macro
def fetch_tile_gates(g_cumsum, beta, h, start, last, c, sub_chunk, gam_next, gam_last_next,
                     beta_next):
    """:func:`fetch_gates` for the walk's tile number ``c`` of its sequence (first token
    ``start``), ``sub_chunk`` tokens a tile: where tiles are sub-chunks (``sub_chunk`` <
    64) and tile ``c`` is not its chunk's first, :func:`rebase_gates` too."""
    fetch_gates(g_cumsum, beta, h, start, last, gam_next, gam_last_next, beta_next)
    if sub_chunk < CHUNK:
        if c % (CHUNK // sub_chunk) != 0:
            rebase_gates(g_cumsum, h, start, last, gam_next, gam_last_next)


@T.macro
def tma_inverse(A, ag_s, barriers, slot, t0, h, c, sub_chunk):
    """TMA the inverse of the walk's tile number ``c`` (first token ``t0``, value head
    ``h``) from ``A`` ``[Tt, H, 64]`` into ``ag_s[slot]``, arriving on
    ``barriers[slot]``: the chunk's whole ``[64, 64]`` block, or for a sub-chunk of
    ``sub_chunk`` tokens the diagonal ``[sub_chunk, sub_chunk]`` block of its chunk's (A
    is block lower triangular)."""
    if sub_chunk == CHUNK:
        T.tma_copy(A[t0:t0 + CHUNK, h, :], ag_s[slot, :, :], barrier=barriers[slot])
    else:
        col = (c % (CHUNK // sub_chunk)) * sub_chunk
        T.tma_copy(A[t0:t0 + sub_chunk, h, col:col + sub_chunk], ag_s[slot, :, :],
                   barrier=barriers[slot])


@T.macro
def stage_gates(gam_next, gam_last_next, beta_next, gam_shared, eg_shared, ed_shared,
                beta_shared):
    """Fetched gates -> shared per-row factors ``[C]``: gam * log2(e), exp(gam),
    exp(gam_C - gam) (every exponent <= 0), beta."""
    for i in T.Parallel(gam_next.shape[0]):
        gam_shared[i] = gam_next[i] * LOG2E
        eg_shared[i] = T.exp2(gam_next[i] * LOG2E)
        ed_shared[i] = T.exp2((gam_last_next[i] - gam_next[i]) * LOG2E)
        beta_shared[i] = beta_next[i]


@T.macro
def zero_rows_past(tile, rows):
    """Zero the rows ``rows..`` of the shared tile ``tile`` ``[C, n]`` (a chunk's rows
    past the end of its sequence); nothing to do for a full chunk."""
    if rows < tile.shape[0]:
        for i, j in T.Parallel(tile.shape[0], tile.shape[1]):
            if i >= rows:
                tile[i, j] = T.cast(0, tile.dtype)


@T.macro
def search_walk_end(g_cumsum, h, out_eos, eos, log_bound):
    """The bounded split's reverse walk end (``flash_qla.segments.WalkEnds``), returned
    as an int32 var: sum the chunk totals of ``g_cumsum`` (value head ``h``) over the
    whole chunks after a segment ending at token ``out_eos`` of a sequence ending at
    ``eos``; the walk ends at the first chunk boundary where the sum is <= ``log_bound``
    (natural log), else at ``eos``. WALK_UNROLL independent (clamped) loads a step, so
    m chunks cost ceil(m / WALK_UNROLL) memory round trips."""
    C = CHUNK
    walk_end = T.alloc_var("int32", init=eos)
    suffix = T.alloc_var("int32", init=T.ceildiv(eos - out_eos, C))     # chunks after
    found = T.alloc_var("int32", init=0)
    decay = T.alloc_var("float32", init=0.0)
    totals = T.alloc_local((WALK_UNROLL,), "float32")                 # a step's totals
    for step in T.serial(T.ceildiv(suffix, WALK_UNROLL)):
        if found == 0:
            for u in T.unroll(WALK_UNROLL):
                totals[u] = g_cumsum[T.min(out_eos + (step * WALK_UNROLL + u + 1) * C, eos) - 1, h]
            for u in T.unroll(WALK_UNROLL):        # chunk m ends m + 1 chunks after
                if (found == 0) & (step * WALK_UNROLL + u < suffix):
                    decay = decay + T.min(totals[u], 0.0)
                    if decay <= log_bound:
                        found = 1
                        walk_end = T.min(out_eos + (step * WALK_UNROLL + u + 1) * C, eos)
    return walk_end


@T.macro
def store_transposed(out, src_t, row, h):
    """``out[row, h] = src_t^T``: ``src_t`` ``[V, K]`` (a state or state gradient kept
    transposed in registers, as the warp-specialised sweeps hold it) to ``out``
    ``[rows, H, K, V]``, casting to ``out``'s dtype."""
    V, K = src_t.shape
    for i, j in T.Parallel(V, K):
        out[row, h, j, i] = src_t[i, j]


@T.macro
def store_staged(out, stage, src_t, row, h, barrier, threads):
    """``out[row, h] = src_t^T`` through the shared tile ``stage`` ``[K, V]`` (``out``'s
    dtype) and one TMA store: ``src_t`` ``[V, K]`` in ``out``'s dtype, held by the
    ``threads`` threads that meet on the named ``barrier``. Each thread writes its own
    elements transposed into the tile (swizzled, no bank conflicts), and one elected
    thread stores the tile. Before the tile is overwritten, that thread waits until its
    previous store has read it. ``store_transposed``'s register-to-global stores (64
    two-byte scattered stores per thread for a 128 x 128 tile) cost ~1.6-2 us per chunk
    on the forward's state chain (docs/perf-notes.md, v18). The caller waits for
    the last store (``T.tma_store_wait()``) before its threads exit."""
    V, K = src_t.shape
    T.tma_store_wait()                      # the previous store has read the tile
    T.sync_threads(barrier, threads)
    for i, j in T.Parallel(V, K):
        stage[j, i] = src_t[i, j]
    T.fence_proxy_async()                   # generic stores -> the TMA engine's reads
    T.sync_threads(barrier, threads)
    T.tma_copy(stage, out[row, h, :, :])    # one elected thread, waited for above
