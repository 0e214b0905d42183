"""Tile-level steps shared by the Hopper kernels (TileLang macros, inlined at each use).

- ``fetch_gates`` / ``stage_gates``: a chunk's gates global -> registers (issued one chunk
  ahead, so the loads overlap the current chunk) -> shared memory as the per-row factors
  of the chunked form (gdn-math.md): log2-scaled gam, exp(gam), exp(gam_C - gam), beta.
- ``zero_rows_past``: zero a shared tile's rows past the end of a sequence, so that NaN
  or Inf in padding (or in the next sequence's rows) never meets a GEMM as 0 * NaN.
"""

import math

import tilelang.language as T

#: exp(x) = exp2(x * LOG2E): exponents are evaluated as exp2 of log2-scaled gates.
LOG2E = math.log2(math.e)


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
