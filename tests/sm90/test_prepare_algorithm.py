"""chunk_prepare_blocked_kernel's blocked inverse, step by step on the CPU.

The kernel inverts ``I + N`` (N = strictly_lower(diag(beta) K K^T)) as
``A = X - M X`` with ``D = (I + N_d)^-1`` (16 x 16 diagonal blocks, fp32 substitution),
``M = D N_o`` and ``X = (I + M^2) D``, the four products on WGMMA with fp16 operands and
fp32 accumulation (X - M X from X's fp32 accumulator). Emulated here in that order with
those roundings and compared in fp64 with the reference inverse
(``flash_qla.reference._gate_free_inverse``); the kernel itself is checked on the GPU
(test_forward_gpu.py::test_blocked_prepare_matches_recurrence).
"""

from __future__ import annotations

import pytest
import torch

from flash_qla.reference import _gate_free_inverse

C, B = 64, 16


def fp16(x: torch.Tensor) -> torch.Tensor:
    """An fp32 tile as the kernel hands it to WGMMA: rounded to fp16 (round to nearest)."""
    return x.half().float()


def _block_of(n: int) -> torch.Tensor:
    return torch.arange(n) // B


def blocked_inverse(k: torch.Tensor, beta: torch.Tensor, rows: int,
                    with_m2: bool = True) -> torch.Tensor:
    """The kernel's A for one chunk: k ``[C, K]`` (rows past ``rows`` may hold anything,
    NaN included), beta ``[C]`` -> A ``[C, C]`` fp32 (the kernel stores it in q's dtype).
    ``with_m2=False`` drops the M^2 term (the doubling step), for the sensitivity test."""
    kkt = k.float() @ k.float().T                                     # [C, C]
    i, j = torch.arange(C)[:, None], torch.arange(C)[None, :]
    valid = (i > j) & (i < rows)
    same = _block_of(C)[:, None] == _block_of(C)[None, :]
    scaled = beta.float()[:, None] * kkt
    zero = torch.zeros(())
    n_d = torch.where(valid & same, scaled, zero)                    # selected, NaN-safe
    n_o = torch.where(valid & ~same, scaled, zero)
    d = torch.zeros(C, C)
    for blk in range(0, C, B):                                        # per thread: a column
        for col in range(B):
            d_col = torch.zeros(B)
            d_col[col] = 1.0
            for m in range(B - 1):                                    # right-looking
                d_col[m + 1:] -= n_d[blk + m + 1:blk + B, blk + m] * d_col[m]
            d[blk:blk + B, blk + col] = d_col
    m_ = fp16(d) @ fp16(n_o)                                          # M = D N_o
    m2 = torch.eye(C) + (fp16(m_) @ fp16(m_) if with_m2 else 0.0)     # I + M^2
    x = fp16(m2) @ fp16(d)                                            # X (fp32 accumulator)
    return x - fp16(m_) @ fp16(x)                                     # A = X - M X


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
def test_blocked_inverse_matches_reference(kind, rows):
    gen = torch.Generator().manual_seed(rows * 7 + len(kind))
    for _ in range(4):
        k, beta = _chunk(kind, gen)
        ref = torch.eye(C, dtype=torch.float64)
        ref[:rows, :rows] = _gate_free_inverse(k[:rows], beta[:rows])
        got = blocked_inverse(k, beta, rows).double()
        err = ((got - ref).norm() / ref.norm()).item()
        # below the bf16 rounding of the stored A (2^-9 per entry)
        assert err < 1.5e-3, (kind, rows, err)


def test_padding_rows_never_enter():
    """NaN / Inf in the rows past the end of a sequence leave the valid block exact."""
    gen = torch.Generator().manual_seed(3)
    k, beta = _chunk("random", gen)
    clean = blocked_inverse(k, beta, 40)
    k[40:] = float("nan")
    beta[40:] = float("inf")
    poisoned = blocked_inverse(k, beta, 40)
    assert torch.isfinite(poisoned).all()
    assert torch.equal(poisoned[:40, :40], clean[:40, :40])


def test_every_step_matters():
    """Dropping the M^2 term (the doubling step) from the emulation breaks the inverse
    beyond tolerance, so the comparison above is sensitive to the algebra, not only to
    rounding."""
    gen = torch.Generator().manual_seed(5)
    k, beta = _chunk("correlated", gen)
    ref = _gate_free_inverse(k, beta)
    truncated = blocked_inverse(k, beta, C, with_m2=False).double()
    assert ((truncated - ref).norm() / ref.norm()).item() > 1e-2
    full = blocked_inverse(k, beta, C).double()
    assert ((full - ref).norm() / ref.norm()).item() < 1.5e-3


@pytest.mark.parametrize("beta_k2, tol", [(1.0, 1.5e-3), (1.9, 2e-2)])
def test_operands_stay_in_fp16_range_while_the_recurrence_is_stable(beta_k2, tol):
    """With beta |k|^2 <= 2 (I - beta k k^T a contraction) every fp16 operand of the
    blocked inverse (D, N_o, M, I + M^2, X) is O(1), on near-parallel keys too, so the
    kernel's fp16 operands cannot overflow there. The error of A stays at the bf16
    rounding up to beta |k|^2 = 1 and grows towards the edge (1.1e-2 measured at 1.9)."""
    gen = torch.Generator().manual_seed(11)
    for kind in ("random", "correlated"):
        for _ in range(8):
            k, _ = _chunk(kind, gen)
            k = k * beta_k2 ** 0.5                                        # |k|^2 = beta_k2
            beta = torch.ones(C, dtype=torch.float64)
            i, j = torch.arange(C)[:, None], torch.arange(C)[None, :]
            same = _block_of(C)[:, None] == _block_of(C)[None, :]
            n = torch.where(i > j, k @ k.T, torch.zeros((), dtype=torch.float64))
            d = torch.linalg.inv(torch.eye(C, dtype=torch.float64)
                                 + torch.where(same, n, torch.zeros((), dtype=torch.float64)))
            m = d @ torch.where(same, torch.zeros((), dtype=torch.float64), n)
            x = (torch.eye(C, dtype=torch.float64) + m @ m) @ d
            biggest = max(t.abs().max().item() for t in (d, n, m, m @ m, x))
            assert biggest < 8.0, (kind, biggest)
            ref = _gate_free_inverse(k, beta)
            got = blocked_inverse(k, beta, C).double()
            assert torch.isfinite(got).all()
            assert ((got - ref).norm() / ref.norm()).item() < tol
