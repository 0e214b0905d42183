"""Token-by-token Gated DeltaNet for decode and speculative verify: a few tokens per
sequence, where the chunked prefill's per-chunk work would be mostly padding.

Per sequence n, value head h and token t (gdn-math "Recurrence"; q/k head h // G):

    S = exp(g_t) S;   u = beta_t (v_t - S^T k_t);   S = S + k_t u^T;   o_t = scale S^T q_t

One CTA (one warp) per (sequence, value head, block of ``BV`` state columns) keeps its
``K x BV`` slice of S in fp32 registers for all of the sequence's tokens: the columns are
independent (every product above is column-wise in S), so no CTA waits for another.
The start state is read from ``h0[state_idx[n]]`` and the final state written to
``ht[state_idx[n]]``: with ``h0`` and ``ht`` the same pool tensor an engine's state
slots are updated in place, with no gather or scatter pass around the call, in the
pool's own dtype (fp32, bf16, fp16) and layout (k-first or v-first), the ones the
prefill on a pool takes (``chunk_state_output``), so one pool serves both. A v-first
slice (``[BV, K]``, rows of K contiguous) goes through shared memory with the lanes
along K: read straight into the registers' layout (lanes along the 16 columns) each
warp access touched 16 rows, and the v-first pool step took 2.3x the k-first one
(H100, 32 sequences, 16/32).
"""

import tilelang.language as T

from ..arch import Arch
from .builder import arch_kernel

#: State columns per CTA and threads per CTA: one warp holds a ``K x 16`` fp32 slice (64
#: registers per thread at K = 128), so the two reductions over K per token are warp
#: shuffles, no block barrier (``benchmark/tune_decode.py``, H100, 16/32, graphed: 1.17-1.40x
#: the former 32 columns x 128 threads; 8 x 32 and 16 x 64 in between).
STEP_BLOCK_V = 16
STEP_THREADS = 32


@arch_kernel()
def recurrent_step_kernel(arch: Arch, dtype: str, K: int, V: int, has_h0: bool,
                          state_dtype: str = "float32", v_first: bool = False,
                          beta_dtype: str = "float32"):
    """Build the token-by-token recurrence over packed sequences (no MMA: the same code
    on every arch but for its target).

    Kernel arguments: q, k ``[Tt, Hk, K]`` dtype; v ``[Tt, Hv, V]`` dtype; g ``[Tt, Hv]``
    fp32 (the per-token natural-log decay); beta ``[Tt, Hv]`` ``beta_dtype`` (fp32 or
    q's dtype: read as given, converted per token); cu_seqlens ``[N + 1]`` int32;
    state_idx ``[N]`` int32 (the state slot of each sequence; negative: a padding row,
    started from zeros and never written back); h0 ``[P, Hv, K, V]`` (``v_first``:
    ``[P, Hv, V, K]``) in ``state_dtype`` (fp32, bf16 or fp16; read at ``state_idx``
    when ``has_h0``, else zeros; converted to fp32); scale fp32; o ``[Tt, Hv, V]``
    dtype; ht like h0 (written at ``state_idx``, rounded to ``state_dtype``). Tokens
    after ``cu_seqlens[N]`` (padding) get zeros in o, written by the last sequence's
    CTAs, so o needs no zeroing pass."""
    Tt, Hk, Hv, N, P = T.dynamic("Tt, Hk, Hv, N, P")
    BV = STEP_BLOCK_V
    accum = "float32"
    state_dims = (V, K) if v_first else (K, V)

    @T.prim_func
    def recurrent_step(
        q: T.Tensor((Tt, Hk, K), dtype),
        k: T.Tensor((Tt, Hk, K), dtype),
        v: T.Tensor((Tt, Hv, V), dtype),
        g: T.Tensor((Tt, Hv), accum),
        beta: T.Tensor((Tt, Hv), beta_dtype),
        cu_seqlens: T.Tensor((N + 1,), "int32"),
        state_idx: T.Tensor((N,), "int32"),
        h0: T.Tensor((P, Hv, *state_dims), state_dtype),
        scale: T.float32,
        o: T.Tensor((Tt, Hv, V), dtype),
        ht: T.Tensor((P, Hv, *state_dims), state_dtype),
    ):
        with T.Kernel(T.ceildiv(V, BV), N * Hv, threads=STEP_THREADS) as (bv, bnh):
            n = bnh // Hv
            h = bnh % Hv
            hk = h // (Hv // Hk)
            slot = T.alloc_var("int32", init=state_idx[n])
            bos = cu_seqlens[n]
            eos = cu_seqlens[n + 1]
            S = T.alloc_fragment((K, BV), accum)
            prod = T.alloc_fragment((K, BV), accum)
            col = T.alloc_fragment((BV,), accum)
            q_s = T.alloc_shared((K,), accum)
            k_s = T.alloc_shared((K,), accum)
            v_s = T.alloc_shared((BV,), accum)
            if v_first:     # the [BV, K] slab, staged; rows padded by 16 B: 2-way bank
                slab = T.alloc_shared((BV, K + 4), accum)   # conflicts, aligned vectors
            T.clear(S)
            if has_h0:
                if slot >= 0:
                    if v_first:     # lanes along K: coalesced reads of the slab's rows
                        for j, i in T.Parallel(BV, K):
                            slab[j, i] = T.cast(h0[slot, h, bv * BV + j, i], accum)
                        for i, j in T.Parallel(K, BV):
                            S[i, j] = slab[j, i]
                    else:
                        for i, j in T.Parallel(K, BV):
                            S[i, j] = T.cast(h0[slot, h, i, bv * BV + j], accum)
            for t in T.serial(eos - bos):
                tok = bos + t
                for i in T.Parallel(K):
                    q_s[i] = T.cast(q[tok, hk, i], accum)
                    k_s[i] = T.cast(k[tok, hk, i], accum)
                for j in T.Parallel(BV):
                    v_s[j] = T.cast(v[tok, h, bv * BV + j], accum)
                decay = T.exp(g[tok, h])
                b = T.cast(beta[tok, h], accum)
                for i, j in T.Parallel(K, BV):                      # S <- exp(g) S
                    S[i, j] = S[i, j] * decay
                    prod[i, j] = S[i, j] * k_s[i]
                T.reduce_sum(prod, col, dim=0)                      # S^T k
                for j in T.Parallel(BV):
                    col[j] = b * (v_s[j] - col[j])                  # u
                for i, j in T.Parallel(K, BV):                      # S <- S + k u^T
                    S[i, j] = S[i, j] + k_s[i] * col[j]
                    prod[i, j] = S[i, j] * q_s[i]
                T.reduce_sum(prod, col, dim=0)                      # S^T q
                for j in T.Parallel(BV):
                    o[tok, h, bv * BV + j] = T.cast(col[j] * scale, dtype)
            if slot >= 0:
                if v_first:
                    for i, j in T.Parallel(K, BV):
                        slab[j, i] = S[i, j]
                    for j, i in T.Parallel(BV, K):
                        ht[slot, h, bv * BV + j, i] = T.cast(slab[j, i], state_dtype)
                else:
                    for i, j in T.Parallel(K, BV):
                        ht[slot, h, i, bv * BV + j] = T.cast(S[i, j], state_dtype)
            if n == N - 1:                  # padding tokens after the last sequence: zeros
                for t in T.serial(Tt - eos):
                    for j in T.Parallel(BV):
                        o[eos + t, h, bv * BV + j] = T.cast(0, dtype)

    return recurrent_step
