"""The GVA sum of the per-value-head dq, dk: each q/k head's gradient over its value heads.

Under GVA (Hv = G Hk) the gradient kernels write dq, dk per value head, group-major
``[G, Tt, Hk, K]`` (value head hv = hk * G + g at ``[g, :, hk]``); this kernel sums the
G of each q/k head in one pass, deterministic, accumulated in fp32.
"""

import tilelang.language as T

from ..arch import Arch
from .builder import arch_kernel

#: Rows of ``[Tt * Hk, K]`` per CTA of :func:`group_sum_kernel` (128 threads, 32 elements
#: each: four 16-byte loads per value head of the group).
GROUP_SUM_ROWS = 32


@arch_kernel()
def group_sum_kernel(arch: Arch, dtype: str, K: int):
    """Build (for any arch: no MMA) the GVA sum of the per-value-head dq / dk:
    ``out[m, :] = sum_g x[g, m, :]`` over the ``G`` value heads of each q/k head (rows
    m = token * Hk + q/k head), read once and accumulated in fp32, written once in
    ``dtype``: one pass at the DRAM rate (torch's reduction over this outer dimension
    ran at ~1.5 TB/s, docs/perf-notes.md v18).

    Kernel arguments: x ``[G, M, K]`` dtype (the gradient kernels' group-major
    dq or dk, M = Tt * Hk); out ``[M, K]`` dtype."""
    G, M = T.dynamic("G, M")
    BM = GROUP_SUM_ROWS

    @T.prim_func
    def group_sum(x: T.Tensor((G, M, K), dtype), out: T.Tensor((M, K), dtype)):
        with T.Kernel(T.ceildiv(M, BM), threads=128) as bx:
            acc = T.alloc_fragment((BM, K), "float32")
            T.clear(acc)
            for g in T.serial(G):
                for i, j in T.Parallel(BM, K):
                    if bx * BM + i < M:
                        acc[i, j] += x[g, bx * BM + i, j]
            for i, j in T.Parallel(BM, K):
                if bx * BM + i < M:
                    out[bx * BM + i, j] = acc[i, j]

    return group_sum

