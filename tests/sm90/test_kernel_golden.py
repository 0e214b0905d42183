"""The SM90 kernels' generated CUDA is the one recorded before the kernels moved into
``flash_qla_tl`` (``golden/sm90_kernel_sha256.json``: sha256 of the lowered CUDA text of
every ``precompile.variants()`` entry for sm_90a, taken on the tree before the move (the
state-pool variants: when they merged, after it; the decode kernel's: after it took the
prefill's pool dtypes and layouts and beta as given, with its padding rows written; the
prepare's: after its inverse became the register-chained doubling of
``unit_lower_inverse``;
the forward's: after its chain took one WGMMA in flight at a time, at 192 / 120, and
after U^T became two products, V^T Ag^T from shared memory),
reduction workspaces renamed as ``tests.kernel_build.normalised`` does):
moving the kernels and threading :class:`flash_qla_tl.arch.Arch` through them changes
no Hopper kernel (hence no cache entry and no measured figure). Lowering only (TileLang,
no nvcc run), ~5 s per variant on one core."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

tilelang = pytest.importorskip("tilelang", reason="TileLang is not installed")
pytestmark = [pytest.mark.nvcc]

GOLDEN = Path(__file__).parent / "golden" / "sm90_kernel_sha256.json"


def _variants() -> list:
    """(golden name, builder, args) of every SM90 variant: the name without the arch, as
    recorded before the builders took one."""
    from flash_qla_sm90.arch import SM90
    from flash_qla_tl.precompile import variants

    return [(f"{b.__name__}{args[1:]!r}", b, args) for b, args in variants(SM90)]


def test_every_shipped_variant_has_a_golden_entry():
    golden = json.loads(GOLDEN.read_text())
    assert sorted(name for name, _, _ in _variants()) == sorted(golden)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_sm90_kernels_are_unchanged(dtype):
    from tests.kernel_build import lowered_source, source_sha256

    golden = json.loads(GOLDEN.read_text())
    changed = [name for name, builder, args in _variants() if args[1:2] in ((dtype,), ())
               and source_sha256(lowered_source(builder, *args)) != golden[name]]
    assert not changed, changed
