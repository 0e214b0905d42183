"""Reverse state-gradient sweep of the backward: dS carried on chip across the chunks.

One CTA per (sequence, value head, BLOCK_V columns), walking the chunks of its sequence
from the last to the first with dS (K x BLOCK_V, fp32) in registers. Per chunk
(gdn-math.md, "Backward of one chunk"; rows i, j of the chunk, gam = chunk cumsum):

    store dS as the chunk's dS1
    P   = G * tril(Q K^T)                       Ag = (G * A) diag(beta)
    dU  = scale P^T dO + D K dS1                D = diag(exp(gam_C - gam))
    dX  = Ag^T dU
    dS0 = exp(gam_C) dS1 + Q^T (scale E dO) - K^T (E dX)      E = diag(exp(gam))

and the first chunk's dS0 is dh0. Every other gradient is per chunk given S0 (from the
forward kernel) and dS1 (from here), so it runs chunk-parallel outside this kernel.
Rows past the end of a sequence are masked like in ``chunk_fwd`` (q, k and dO rows
zeroed in shared memory, dU's selected to 0, so NaN in padding never meets a GEMM).

The default sweep is ``chunk_bwd_dh_ws`` (the same math warp-specialised, 2.6x faster
on the H200 at 16/16 1x32768); this one runs with ``traits.BWD_DH_AUX_WARPGROUP`` off
and serves head dims other than 128.
"""

import tilelang
import tilelang.language as T

from .tile_ops import LOG2E, search_walk_end, zero_rows_past
from .traits import BLOCK_V, CHUNK, FWD_STAGES, FWD_THREADS, PASS_CONFIGS, TARGET


@tilelang.jit(target=TARGET, pass_configs=PASS_CONFIGS)
def chunk_bwd_dh_kernel(dtype: str, K: int, V: int, has_dht: bool, block_v: int = BLOCK_V,
                        warmup: bool = False, ds1_in_dtype: bool = False):
    """Build the reverse dS sweep for one static configuration (``block_v`` columns of dS
    per CTA: ``traits.BLOCK_V``, or ``BLOCK_V_NARROW`` for grids far below one wave).

    Kernel arguments (packed token layout, Tt = total tokens, N sequences):
        q, k            [Tt, Hk, K]     dtype
        do              [Tt, Hv, V]     dtype, gradient of o
        g_cumsum, beta  [Tt, Hv]        fp32
        A               [Tt, Hv, C]     dtype, gate-free inverse per chunk row
        cu_seqlens      [N+1]           int32
        chunk_offsets   [N+1]           int32, first chunk of each sequence
        dht             [N, Hv, K, V]   fp32 (ignored unless has_dht)
        scale           fp32 scalar
        dS1             [NT, Hv, K, V]  fp32 (``dtype`` with ``ds1_in_dtype``) out, state
                                        gradient at each chunk's end
        dh0             [N, Hv, K, V]   fp32 out
        seq_end, seq_index  [NW]        int32, read only with ``warmup``
        log_bound       fp32 scalar, read only with ``warmup``

    ``warmup`` (the bounded segment split's backward, ``flash_qla.segments.WalkEnds``):
    the sequences of ``cu_seqlens`` are segments, segment n of sequence
    ``seq_index[n]``, which ends at token ``seq_end[n]``. CTA (n, h) sums the chunk
    totals of g_cumsum over the chunks after its segment (``tile_ops.search_walk_end``)
    and starts its reverse sweep at the
    first chunk boundary where the sum is <= ``log_bound`` (natural log) from a zero
    dS, or at the sequence's end from ``dht[seq_index[n], h]`` (the rule of
    ``flash_qla.segments.warmup_ends``). The chunks after the segment are a warm-up
    that rebuilds dS at its end up to what decayed below the bound; dS1 is stored for
    the segment's own chunks only, dh0[n] is the state gradient at the segment's start.
    """
    C, BV = CHUNK, block_v
    # N0: dht's rows (sequences; with ``warmup`` N counts segments)
    Tt, Hk, Hv, N, N0, N1, NT, NW = T.dynamic("Tt, Hk, Hv, N, N0, N1, NT, NW")
    f32 = "float32"
    ds1_dtype = dtype if ds1_in_dtype else f32

    @T.prim_func
    def chunk_bwd_dh(
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
    ):
        with T.Kernel(N * Hv, V // BV, threads=FWD_THREADS) as (bx, by):
            q_shared = T.alloc_shared((C, K), dtype)
            k_shared = T.alloc_shared((C, K), dtype)
            do_shared = T.alloc_shared((C, BV), dtype)
            a_shared = T.alloc_shared((C, C), dtype)
            gam_shared = T.alloc_shared((C,), f32)            # log2-scaled chunk cumsum
            beta_shared = T.alloc_shared((C,), f32)
            gam_frag = T.alloc_fragment((C,), f32)
            beta_frag = T.alloc_fragment((C,), f32)
            ds_frag = T.alloc_fragment((K, BV), f32)          # dS, fp32
            ds_shared = T.alloc_shared((K, BV), dtype)        # dS as a GEMM operand
            qk_frag = T.alloc_fragment((C, C), f32)
            p_shared = T.alloc_shared((C, C), dtype)
            ag_shared = T.alloc_shared((C, C), dtype)
            kds_frag = T.alloc_fragment((C, BV), f32)
            du_frag = T.alloc_fragment((C, BV), f32)
            du_shared = T.alloc_shared((C, BV), dtype)
            dx_frag = T.alloc_fragment((C, BV), f32)
            edx_shared = T.alloc_shared((C, BV), dtype)       # -E dX
            edo_shared = T.alloc_shared((C, BV), dtype)       # scale E dO

            # Scalars in registers (see chunk_fwd).
            n = T.alloc_var("int32", init=bx // Hv)
            h = T.alloc_var("int32", init=bx % Hv)
            hk = T.alloc_var("int32", init=h // (Hv // Hk))  # GVA: value head -> q/k head
            v0 = by * BV
            bos = T.alloc_var("int32", init=cu_seqlens[n])
            seq_len = T.alloc_var("int32", init=cu_seqlens[n + 1] - bos)
            if warmup:
                out_eos = T.alloc_var("int32", init=bos + seq_len)   # the segment's end
                eos = T.alloc_var("int32", init=seq_end[n])          # the sequence's end
                seq_len = search_walk_end(g_cumsum, h, out_eos, eos, log_bound) - bos
            num_chunks = T.alloc_var("int32", init=T.ceildiv(seq_len, C))
            first_chunk = T.alloc_var("int32", init=chunk_offsets[n])   # row of dS1

            if has_dht and warmup:      # the walk's end state: dht at the sequence's end
                if bos + seq_len == seq_end[n]:
                    T.copy(dht[seq_index[n], h, :, v0:v0 + BV], ds_frag)
                else:
                    T.clear(ds_frag)
            elif has_dht:
                T.copy(dht[n, h, :, v0:v0 + BV], ds_frag)
            else:
                T.clear(ds_frag)

            for r in T.Pipelined(num_chunks, num_stages=FWD_STAGES):
                c = num_chunks - 1 - r                        # walk the chunks backwards
                t0 = bos + c * C
                rows = T.min(seq_len - c * C, C)             # valid rows of this chunk
                T.copy(q[t0:t0 + C, hk, :], q_shared)
                T.copy(k[t0:t0 + C, hk, :], k_shared)
                T.copy(do[t0:t0 + C, h, v0:v0 + BV], do_shared)
                T.copy(A[t0:t0 + C, h, :], a_shared)
                # gates through registers inside the consumer (see chunk_fwd)
                for i in T.Parallel(C):
                    gam_frag[i] = g_cumsum[t0 + T.min(i, rows - 1), h] * LOG2E
                    beta_frag[i] = T.if_then_else(i < rows, beta[t0 + i, h], 0.0)
                for i in T.Parallel(C):
                    gam_shared[i] = gam_frag[i]
                    beta_shared[i] = beta_frag[i]

                if warmup:
                    if t0 < out_eos:                          # not a warm-up chunk
                        T.copy(ds_frag, dS1[first_chunk + c, h, :, v0:v0 + BV])
                else:
                    T.copy(ds_frag, dS1[first_chunk + c, h, :, v0:v0 + BV])
                T.copy(ds_frag, ds_shared)
                T.gemm(q_shared, k_shared, qk_frag, transpose_B=True, clear_accum=True)  # Q K^T
                T.gemm(k_shared, ds_shared, kds_frag, clear_accum=True)                # K dS1
                # Rows past the end may hold NaN/Inf (padding tokens), which the masks below
                # would turn into 0 * NaN: zero q and k rows now (their GEMMs above are
                # done), dO rows after E dO is built, and select dU's rows.
                zero_rows_past(q_shared, rows)
                zero_rows_past(k_shared, rows)

                for i, j in T.Parallel(C, C):
                    live = (i >= j) & (i < rows)
                    decay = T.exp2(T.min(gam_shared[i] - gam_shared[j], 0.0))
                    p_shared[i, j] = T.if_then_else(live, qk_frag[i, j] * decay, 0.0)
                    ag_shared[i, j] = T.if_then_else(
                        live, a_shared[i, j] * decay * beta_shared[j], 0.0)
                for i, j in T.Parallel(C, BV):
                    edo_shared[i, j] = T.if_then_else(
                        i < rows, do_shared[i, j] * T.exp2(gam_shared[i]) * scale, 0.0)
                zero_rows_past(do_shared, rows)
                T.gemm(p_shared, do_shared, du_frag, transpose_A=True, clear_accum=True)  # P^T dO
                for i, j in T.Parallel(C, BV):
                    du_shared[i, j] = T.if_then_else(i < rows, du_frag[i, j] * scale + T.exp2(
                        gam_shared[C - 1] - gam_shared[i]) * kds_frag[i, j], 0.0)
                T.gemm(ag_shared, du_shared, dx_frag, transpose_A=True, clear_accum=True)  # Ag^T dU
                for i, j in T.Parallel(C, BV):
                    edx_shared[i, j] = -T.exp2(gam_shared[i]) * dx_frag[i, j]

                for i, j in T.Parallel(K, BV):
                    ds_frag[i, j] = ds_frag[i, j] * T.exp2(gam_shared[C - 1])
                T.gemm(q_shared, edo_shared, ds_frag, transpose_A=True)              # + Q^T E dO
                T.gemm(k_shared, edx_shared, ds_frag, transpose_A=True)              # - K^T E dX

            T.copy(ds_frag, dh0[n, h, :, v0:v0 + BV])

    return chunk_bwd_dh
