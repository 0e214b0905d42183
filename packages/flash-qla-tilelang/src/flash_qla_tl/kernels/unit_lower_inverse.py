"""The per-chunk inverse A = (I + N)^-1 (N strictly lower-triangular, 64 x 64) by one
warpgroup, as a CUDA device function for ``T.import_source`` / ``T.call_extern``.

TileLang's tile GEMMs pass every operand through shared memory with a CTA-wide barrier
between products; this inverse keeps each product's result in registers when it is the
next product's left operand (an m16n8k16 accumulator is, packed to fp16, the A fragment
of the next ``mma.sync``), so its chain is short. Block doubling over 16 x 16 blocks
(gdn-math.md's unit lower-triangular inverse, written blockwise; D_w = (I + N_ww)^-1):

    phase 1  (warp w)       D_w by substitution in fp32 (lanes 0-15, one column each);
                            lanes 16-31: the gate's chunk cumsum, row 16 w + lane - 16
    phase 2  (warps 1-3)    A_10 = -(D_1 N_10) D_0,  A_32 = -(D_3 N_32) D_2,
                            A_21 = -(D_2 N_21) D_1
    phase 3  (warps 0-2)    A_20 = -(D_2 N_20 D_0 + D_2 N_21 A_10)
                            A_30 = -((A_32 N_20 + D_3 N_30) D_0 + (A_32 N_21 + D_3 N_31) A_10)
                            A_31 = -(A_32 N_21 + D_3 N_31) D_1

Products take fp16 operands and accumulate in fp32; the diagonal blocks are exact
fp32. Operand tiles are read with ``ldmatrix`` (``.trans`` for right operands) from
row-major fp16 arrays whose rows are ``LD`` halves apart (LD = 72: 144-byte rows, no
bank conflicts across ldmatrix's eight row addresses).

Arguments (shared memory, generic pointers): ``nd`` fp32 [64, 16], row r holding N's
diagonal block entries N[r, 16 (r / 16) + c]; ``nh`` fp16 [64, LD], N (its blocks below
the diagonal are read); ``ah`` fp16 [64, LD], A's blocks as later products' operands
(blocks on and below the diagonal written, A in fp16 there: the caller selects zero
above); ``g`` fp32 [64] the raw gate, ``gc`` fp32 [64] its chunk
cumsum (written); ``tid`` 0..127 within the warpgroup; ``bar_id``: the named barrier the
warpgroup's 128 threads meet on between phases.
"""

CUDA_SOURCE = r"""
#include <cuda_fp16.h>

namespace fqla_inverse {

__device__ __forceinline__ unsigned smem_addr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// a 16 x 16 fp16 tile at `p` (row-major, rows LD apart) as an m16n8k16 left operand
template <int LD>
__device__ __forceinline__ void load_left(unsigned (&r)[4], const half* p, int lane) {
  const half* row = p + ((lane & 7) + ((lane >> 3) & 1) * 8) * LD + (lane >> 4) * 8;
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(row)));
}

// a 16 (k) x 16 (n) fp16 tile at `p` (row-major over k) as the right operands of two
// m16n8k16 (n 0-7: r[0], r[1]; n 8-15: r[2], r[3])
template <int LD>
__device__ __forceinline__ void load_right(unsigned (&r)[4], const half* p, int lane) {
  const half* row = p + ((lane & 7) + ((lane >> 3) & 1) * 8) * LD + (lane >> 4) * 8;
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(row)));
}

// c[0..3] (n 0-7), c[4..7] (n 8-15) += a b, a 16 x 16 by 16 x 16 product
__device__ __forceinline__ void mma16(float (&c)[8], const unsigned (&a)[4],
                                      const unsigned (&b)[4]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[4]), "+f"(c[5]), "+f"(c[6]), "+f"(c[7])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[2]), "r"(b[3]));
}

__device__ __forceinline__ unsigned pack_half2(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<unsigned*>(&h);
}

// an accumulator (row g, g + 8; columns 2t, 2t + 1 of each n half) as a left operand
__device__ __forceinline__ void acc_to_left(unsigned (&a)[4], const float (&c)[8]) {
  a[0] = pack_half2(c[0], c[1]);
  a[1] = pack_half2(c[2], c[3]);
  a[2] = pack_half2(c[4], c[5]);
  a[3] = pack_half2(c[6], c[7]);
}

// c += (left tile) (right tile at p)
template <int LD>
__device__ __forceinline__ void mul_add(float (&c)[8], const unsigned (&left)[4],
                                        const half* p, int lane) {
  unsigned b[4];
  load_right<LD>(b, p, lane);
  mma16(c, left, b);
}

// the block -c at row r0, column c0 of ah
template <int LD>
__device__ __forceinline__ void store_negated(half* ah, int r0, int c0, const float (&c)[8],
                                              int lane) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int n = 0; n < 2; ++n) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = r0 + g + 8 * h, col = c0 + 8 * n + 2 * t;
      *reinterpret_cast<__half2*>(ah + row * LD + col) =
          __floats2half2_rn(-c[4 * n + 2 * h], -c[4 * n + 2 * h + 1]);
    }
  }
}

__device__ __forceinline__ void warpgroup_sync(int bar_id) {
  asm volatile("bar.sync %0, 128;\n" ::"r"(bar_id) : "memory");
}

template <int LD>
__device__ __forceinline__ void inverse64(const float* nd, const void* nh_, void* ah_,
                                          const float* g, float* gc, int tid, int bar_id) {
  // TileLang passes its own 16-bit type (cutlass::half_t): the same bits as half
  const half* nh = static_cast<const half*>(nh_);
  half* ah = static_cast<half*>(ah_);
  const int w = tid >> 5, lane = tid & 31;
  if (lane < 16) {
    // column `lane` of D_w, right-looking: d[r] -= N[r, m] d[m] once d[m] is final
    float d[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) d[i] = (i == lane) ? 1.f : 0.f;
    const float* nb = nd + 16 * 16 * w;
#pragma unroll
    for (int m = 0; m < 15; ++m) {
#pragma unroll
      for (int r = m + 1; r < 16; ++r) d[r] -= nb[16 * r + m] * d[m];
    }
    const int col = 16 * w + lane;
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      ah[(16 * w + i) * LD + col] = __float2half_rn(d[i]);
    }
  } else {
    const int row = 16 * w + lane - 16;
    float s = 0.f;
#pragma unroll
    for (int m = 0; m < 64; ++m) s += (m <= row) ? g[m] : 0.f;
    gc[row] = s;
  }
  warpgroup_sync(bar_id);
  if (w >= 1) {
    // (i, j) = (1, 0), (2, 1), (3, 2): A_ij = -(D_i N_ij) D_j
    const int i = w, j = w - 1;
    unsigned a[4];
    float p[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    float z[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    load_left<LD>(a, ah + 16 * i * LD + 16 * i, lane);
    mul_add<LD>(p, a, nh + 16 * i * LD + 16 * j, lane);
    acc_to_left(a, p);
    mul_add<LD>(z, a, ah + 16 * j * LD + 16 * j, lane);
    store_negated<LD>(ah, 16 * i, 16 * j, z, lane);
  }
  warpgroup_sync(bar_id);
  if (w == 2) {
    // A_20 = -(D_2 N_20 D_0 + D_2 N_21 A_10)
    unsigned d2[4], a[4];
    float p0[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    float p1[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    float z[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    load_left<LD>(d2, ah + 32 * LD + 32, lane);
    mul_add<LD>(p0, d2, nh + 32 * LD + 0, lane);
    mul_add<LD>(p1, d2, nh + 32 * LD + 16, lane);
    acc_to_left(a, p0);
    mul_add<LD>(z, a, ah + 0 * LD + 0, lane);
    acc_to_left(a, p1);
    mul_add<LD>(z, a, ah + 16 * LD + 0, lane);
    store_negated<LD>(ah, 32, 0, z, lane);
  } else if (w < 2) {
    // L1 = A_32 N_21 + D_3 N_31; w 1: A_31 = -L1 D_1;
    // w 0: A_30 = -(L0 D_0 + L1 A_10), L0 = A_32 N_20 + D_3 N_30
    unsigned a32[4], d3[4], a[4];
    float l[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    float z[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    load_left<LD>(a32, ah + 48 * LD + 32, lane);
    load_left<LD>(d3, ah + 48 * LD + 48, lane);
    mul_add<LD>(l, a32, nh + 32 * LD + 16, lane);
    mul_add<LD>(l, d3, nh + 48 * LD + 16, lane);
    acc_to_left(a, l);
    if (w == 1) {
      mul_add<LD>(z, a, ah + 16 * LD + 16, lane);
      store_negated<LD>(ah, 48, 16, z, lane);
    } else {
      mul_add<LD>(z, a, ah + 16 * LD + 0, lane);
#pragma unroll
      for (int e = 0; e < 8; ++e) l[e] = 0.f;
      mul_add<LD>(l, a32, nh + 32 * LD + 0, lane);
      mul_add<LD>(l, d3, nh + 48 * LD + 0, lane);
      acc_to_left(a, l);
      mul_add<LD>(z, a, ah + 0 * LD + 0, lane);
      store_negated<LD>(ah, 48, 0, z, lane);
    }
  }
}

}  // namespace fqla_inverse
"""

#: Row pitch (halves) of the fp16 arrays N and A.
LD = 72


def call(nd, nh, ah, g, gc, tid, bar_id):
    """``T.call_extern`` of the inverse on the given shared buffers (TileLang side)."""
    import tilelang.language as T

    return T.call_extern(
        "handle", f"fqla_inverse::inverse64<{LD}>",
        T.access_ptr(nd, "r"), T.access_ptr(nh, "r"), T.access_ptr(ah, "w"),
        T.access_ptr(g, "r"), T.access_ptr(gc, "w"), tid, bar_id)
