"""Shared test helpers. Import as ``from tests.helpers import rel_l2``.

``tests/`` and ``tests/core/`` are packages (they hold ``__init__.py``), so pytest's
default import mode puts the repository root on ``sys.path`` and the absolute import
works from any test module, with ``pytest`` or ``python -m pytest``.
"""

from __future__ import annotations

import functools
import math

import torch


def rel_l2(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Relative L2 error ``||actual - expected|| / ||expected||`` as a Python float.

    Computed in float64 whatever the input dtypes. NaN-safe and strict:

    * any NaN or inf in either tensor -> ``inf`` (so ``rel_l2(...) < tol`` fails);
    * both all-zero (or both empty) -> ``0.0``;
    * ``expected`` all-zero but ``actual`` not -> ``inf``.

    Raises ``ValueError`` when the shapes differ (no silent broadcasting).
    """
    if actual.shape != expected.shape:
        raise ValueError(f"shape mismatch: actual {tuple(actual.shape)} "
                         f"vs expected {tuple(expected.shape)}")
    a = actual.detach().to(device="cpu", dtype=torch.float64)
    e = expected.detach().to(device="cpu", dtype=torch.float64)
    if not (torch.isfinite(a).all() and torch.isfinite(e).all()):
        return math.inf
    err = torch.linalg.vector_norm(a - e).item()
    ref = torch.linalg.vector_norm(e).item()
    if ref == 0.0:
        return 0.0 if err == 0.0 else math.inf
    return err / ref


def kernel_arch():
    """The arch the sm90 loader serves (``flash_qla_sm90.arch.served_arch``: SM90, or
    under ``FLASH_QLA_PROOF_ARCH`` a Blackwell arch's proof build): the arch of the
    kernels the sm90 tests that call the host code directly launch."""
    from flash_qla_sm90.arch import served_arch

    return served_arch()


def chunk_start_states(h, arch):
    """The chunk-start states of the backward's state tensor ``h`` (``[NT *
    state_rows(arch), Hv, K, V]``: a row per sub-chunk on an arch with sub-chunks, the
    first of each chunk's rows at its start) as the references take them, ``[NT, Hv, K,
    V]``."""
    from flash_qla_tl.layout import state_rows

    return h[::state_rows(arch)]


def skip_unless_fused_kernel() -> None:
    """Skip a GPU test of the fused backward where the served arch does not build it
    (``Arch.fused_backward=False``: ``FLASH_QLA_PROOF_ARCH=sm120``)."""
    import pytest

    if not kernel_arch().fused_backward:
        pytest.skip(f"{kernel_arch().name} builds no fused backward")


def force_fused_backward(monkeypatch, fused: bool) -> None:
    """Both sm90 backwards (unsplit and bounded split) take the fused kernel (True) or
    the sweep and the per-chunk kernel (False), whatever ``plan.fused_backward`` would
    pick (imports the sm90 package: call it from sm90 tests only). Skips the test for
    True where the served arch builds no fused kernel (:func:`skip_unless_fused_kernel`)."""
    from flash_qla_tl import backward

    if fused:
        skip_unless_fused_kernel()

    for name in ("chunk_bwd", "chunk_bwd_warmup"):
        planned = getattr(backward, name)
        planned = getattr(planned, "planned", planned)
        forced = functools.partial(planned, fused=fused)
        forced.planned = planned
        monkeypatch.setattr(backward, name, forced)
