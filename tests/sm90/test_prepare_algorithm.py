"""The prepare's per-chunk inverse (``unit_lower_inverse``), step by step on the CPU.

The kernel inverts ``I + N`` (N = strictly_lower(diag(beta) K K^T)) blockwise: the four
16 x 16 diagonal blocks D_w = (I + N_ww)^-1 by substitution in fp32, then block doubling
(A_10, A_21, A_32 from D and N; A_20, A_30, A_31 from those), every product with fp16
operands (each block of A held in fp16, as the kernel's shared array is) and fp32
accumulation. Emulated here in that order with those roundings and compared in fp64 with
the reference inverse (``flash_qla.reference._gate_free_inverse``); the kernel itself is
checked on the GPU (test_forward_gpu.py::test_prepare_matches_recurrence).
"""

from __future__ import annotations

import pytest
import torch

from flash_qla.reference import _gate_free_inverse

C, B = 64, 16


def fp16(x: torch.Tensor) -> torch.Tensor:
    """An fp32 tile as the kernel hands it to mma.sync: rounded to fp16 (round to nearest)."""
    return x.half().float()


def _block_of(n: int) -> torch.Tensor:
    return torch.arange(n) // B


def doubling_inverse(k: torch.Tensor, beta: torch.Tensor, rows: int,
                     with_second_level: bool = True) -> torch.Tensor:
    """The kernel's A for one chunk: k ``[C, K]`` (rows past ``rows`` may hold anything,
    NaN included), beta ``[C]`` -> A ``[C, C]`` fp32 (the kernel holds it in fp16 and
    stores it in q's dtype). ``with_second_level=False`` leaves the three blocks of the
    second doubling step (A_20, A_30, A_31) at zero, for the sensitivity test."""
    kkt = k.float() @ k.float().T                                     # [C, C]
    i, j = torch.arange(C)[:, None], torch.arange(C)[None, :]
    valid = (i > j) & (i < rows)
    same = _block_of(C)[:, None] == _block_of(C)[None, :]
    scaled = beta.float()[:, None] * kkt
    zero = torch.zeros(())
    n_d = torch.where(valid & same, scaled, zero)                    # selected, NaN-safe
    n = fp16(torch.where(valid & ~same, scaled, zero))               # N's other blocks
    a = torch.zeros(C, C)
    for blk in range(0, C, B):                                        # per lane: a column
        for col in range(B):
            d_col = torch.zeros(B)
            d_col[col] = 1.0
            for m in range(B - 1):                                    # right-looking
                d_col[m + 1:] -= n_d[blk + m + 1:blk + B, blk + m] * d_col[m]
            a[blk:blk + B, blk + col] = d_col
    a = fp16(a)

    def tile(t, r, c):
        return t[B * r:B * r + B, B * c:B * c + B]

    for r in (1, 2, 3):                                               # A_r,r-1 (one warp each)
        tile(a, r, r - 1)[:] = fp16(-(fp16(tile(a, r, r) @ tile(n, r, r - 1))
                                      @ tile(a, r - 1, r - 1)))
    if not with_second_level:
        return a
    d2, a32, d3 = tile(a, 2, 2), tile(a, 3, 2), tile(a, 3, 3)
    a20 = -(fp16(d2 @ tile(n, 2, 0)) @ tile(a, 0, 0) + fp16(d2 @ tile(n, 2, 1)) @ tile(a, 1, 0))
    l1 = fp16(a32 @ tile(n, 2, 1) + d3 @ tile(n, 3, 1))
    l0 = fp16(a32 @ tile(n, 2, 0) + d3 @ tile(n, 3, 0))
    a30 = -(l1 @ tile(a, 1, 0) + l0 @ tile(a, 0, 0))
    a31 = -(l1 @ tile(a, 1, 1))
    for (r, c), x in (((2, 0), a20), ((3, 0), a30), ((3, 1), a31)):
        tile(a, r, c)[:] = fp16(x)
    return a


def _chunk(kind: str, gen: torch.Generator):
    k = torch.randn(C, 128, generator=gen, dtype=torch.float64)
    if kind == "correlated":            # near-parallel keys: the worst-conditioned case
        k = torch.randn(1, 128, generator=gen, dtype=torch.float64) + 0.05 * k
    k = k / k.norm(dim=-1, keepdim=True)
    k = k.to(torch.bfloat16).double()                                 # what the kernel reads
    beta = torch.rand(C, generator=gen, dtype=torch.float64)
    if kind == "beta_one":
        beta = torch.ones(C, dtype=torch.float64)
    return k, beta


@pytest.mark.parametrize("kind", ["random", "correlated", "beta_one"])
@pytest.mark.parametrize("rows", [64, 37, 1])
def test_inverse_matches_reference(kind, rows):
    gen = torch.Generator().manual_seed(rows * 7 + len(kind))
    for _ in range(4):
        k, beta = _chunk(kind, gen)
        ref = torch.eye(C, dtype=torch.float64)
        ref[:rows, :rows] = _gate_free_inverse(k[:rows], beta[:rows])
        got = doubling_inverse(k, beta, rows).double()
        err = ((got - ref).norm() / ref.norm()).item()
        # below the bf16 rounding of the stored A (2^-9 per entry)
        assert err < 1.5e-3, (kind, rows, err)


def test_padding_rows_never_enter():
    """NaN / Inf in the rows past the end of a sequence leave the valid block exact."""
    gen = torch.Generator().manual_seed(3)
    k, beta = _chunk("random", gen)
    clean = doubling_inverse(k, beta, 40)
    k[40:] = float("nan")
    beta[40:] = float("inf")
    poisoned = doubling_inverse(k, beta, 40)
    assert torch.isfinite(poisoned).all()
    assert torch.equal(poisoned[:40, :40], clean[:40, :40])


def test_every_step_matters():
    """The whole-matrix error above is dominated by the blocks near the diagonal (A
    decays away from it), so the second doubling step's three blocks are checked on
    their own: within 2e-3 of the reference there, and far off without that step, so the
    comparison is sensitive to the algebra, not only to rounding."""
    gen = torch.Generator().manual_seed(5)
    far = torch.zeros(C, C, dtype=torch.bool)
    for r, c in ((2, 0), (3, 0), (3, 1)):
        far[B * r:B * r + B, B * c:B * c + B] = True
    for _ in range(4):
        k, beta = _chunk("random", gen)
        ref = _gate_free_inverse(k, beta)[far]
        full = doubling_inverse(k, beta, C).double()[far]
        truncated = doubling_inverse(k, beta, C, with_second_level=False).double()[far]
        assert ((full - ref).norm() / ref.norm()).item() < 2e-3
        assert ((truncated - ref).norm() / ref.norm()).item() > 0.5


@pytest.mark.parametrize("beta_k2, tol", [(1.0, 1.5e-3), (1.9, 2e-2)])
def test_operands_stay_in_fp16_range_while_the_recurrence_is_stable(beta_k2, tol):
    """With beta |k|^2 <= 2 (I - beta k k^T a contraction) every fp16 operand of the
    inverse (N, each block of A, the left factors D_r N_r,r-1 and A_32 N_2c + D_3 N_3c)
    is O(1), on near-parallel keys too, so the kernel's fp16 operands cannot overflow
    there. The error of A stays at the bf16 rounding up to beta |k|^2 = 1 and grows
    towards the edge (7e-3 measured at 1.9)."""
    gen = torch.Generator().manual_seed(11)
    f64 = torch.float64

    def tile(t, r, c):
        return t[B * r:B * r + B, B * c:B * c + B]

    for kind in ("random", "correlated"):
        for _ in range(8):
            k, _ = _chunk(kind, gen)
            k = k * beta_k2 ** 0.5                                        # |k|^2 = beta_k2
            beta = torch.ones(C, dtype=f64)
            i, j = torch.arange(C)[:, None], torch.arange(C)[None, :]
            n = torch.where(i > j, k @ k.T, torch.zeros((), dtype=f64))
            a = torch.linalg.inv(torch.eye(C, dtype=f64) + n)
            lefts = [tile(a, r, r) @ tile(n, r, r - 1) for r in (1, 2, 3)]
            lefts += [tile(a, 3, 2) @ tile(n, 2, c) + tile(a, 3, 3) @ tile(n, 3, c)
                      for c in (0, 1)]
            biggest = max(t.abs().max().item() for t in (n, a, *lefts))
            assert biggest < 8.0, (kind, biggest)
            ref = _gate_free_inverse(k, beta)
            got = doubling_inverse(k, beta, C).double()
            assert torch.isfinite(got).all()
            assert ((got - ref).norm() / ref.norm()).item() < tol
