"""The shipped kernels (CPU): the variants compiled ahead of time, and the seeding of
TileLang's cache with them. That the host path launches exactly these variants is
checked in ``test_host_path.py``."""

from __future__ import annotations

import os

import pytest

precompile = pytest.importorskip("flash_qla_tl.precompile",
                                 reason="TileLang is not installed")


@pytest.fixture
def shipped(tmp_path, monkeypatch):
    src = tmp_path / "shipped"
    (src / "0.1.15" / "kernels").mkdir(parents=True)
    (src / "0.1.15" / "kernels" / "entry.bin").write_bytes(b"compiled")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("TILELANG_CACHE_DIR", raising=False)
    return src


def test_seeds_a_writable_cache_and_points_tilelang_at_it(shipped, tmp_path):
    precompile.use_shipped_cache(shipped)
    target = tmp_path / "xdg" / "flash-qla" / "tilelang"
    assert os.environ["TILELANG_CACHE_DIR"] == str(target)
    assert (target / "0.1.15" / "kernels" / "entry.bin").read_bytes() == b"compiled"


def test_a_cache_dir_chosen_by_the_user_wins(shipped, tmp_path, monkeypatch):
    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path / "mine"))
    precompile.use_shipped_cache(shipped)
    assert os.environ["TILELANG_CACHE_DIR"] == str(tmp_path / "mine")
    assert not (tmp_path / "xdg").exists()


def test_shipped_cache_sits_in_the_arch_package():
    from flash_qla_sm90.precompile import SHIPPED

    assert SHIPPED.parent.name == "flash_qla_sm90"
    assert SHIPPED.name == "kernel_cache"


def _names(arch, dtype="bfloat16") -> list[tuple]:
    """(builder, statics after (arch, dtype, K, V); the prepare's after (arch, dtype,
    K)) of ``arch``'s variants in ``dtype``."""
    return [(builder.__name__, args[3:] if builder.__name__ == "chunk_prepare_kernel"
             else args[4:]) for builder, args in
            precompile.variants(arch) if args[1:2] == (dtype,)]


def test_variants_per_dtype():
    """Per dtype (K = V = 128): the prepare (beta in fp32 or q's dtype), the forward's
    seven variants x initial
    state, the sweep's three x dht, the per-chunk gradients, the GVA sum, the fused
    reverse kernel x dht, the forward on a state pool (3 pool dtypes x 2 layouts), the decode
    step (no start state, or a start state / pool in 3 dtypes; x 2 layouts x beta in fp32 or
    q's dtype): 32 + 16 = 48, none twice; and once, with no dtype, the varlen chunk
    layout and the padding zeros; every one built for the arch asked for."""
    from flash_qla_sm90.arch import SM90

    every = list(precompile.variants(SM90))
    assert len(every) == len({(id(b), args) for b, args in every}) == 2 * 48 + 2
    assert {args[0] for _, args in every} == {SM90}
    for dtype in ("bfloat16", "float16"):
        assert sorted(_names(SM90, dtype)) == sorted(
            [("chunk_prepare_kernel", ()), ("chunk_prepare_kernel", (dtype,))]
            + [("chunk_fwd_ws_kernel", (h0, *flags)) for h0 in (False, True)
               for flags in precompile.FWD_FLAGS]
            + [("chunk_bwd_dh_ws_kernel", (dht, *flags)) for dht in (False, True)
               for flags in precompile.SWEEP_FLAGS]
            + [("chunk_bwd_intra_kernel", ()), ("group_sum_kernel", ())]
            + [("chunk_bwd_fused_kernel", (dht,)) for dht in (False, True)]
            + [("chunk_fwd_ws_kernel", (True, False, False, False, False, pool, v_first))
               for pool in ("float32", "bfloat16", "float16") for v_first in (False, True)]
            + [("recurrent_step_kernel", (h0, state, v_first, beta))
               for h0, state in ((False, "float32"), (True, "float32"), (True, "bfloat16"),
                                 (True, "float16"))
               for v_first in (False, True) for beta in ("float32", dtype)])


def test_sm120_ships_the_sub_chunk_backward_without_the_fused_kernel():
    """SM120 (32-token sub-chunks, no fused backward): the prepares, the forward's seven
    variants x initial state, the forward on a state pool, the sweep without its boundary
    walks (which only feed the fused kernel) x dht, the sub-chunk gradient kernel, the
    GVA sum and the decode steps."""
    from flash_qla_sm120.arch import SM120

    names = _names(SM120)
    assert len(names) == len(set(names)) == 2 + 7 * 2 + 6 + 2 * 2 + 1 + 1 + 16
    assert ("chunk_bwd_intra_split_kernel", ()) in names
    assert not [n for n in names if n[0] in ("chunk_bwd_intra_kernel",
                                             "chunk_bwd_fused_kernel")]
    sweeps = [n for n in names if n[0] == "chunk_bwd_dh_ws_kernel"]
    assert sorted(sweeps) == sorted(("chunk_bwd_dh_ws_kernel", (dht, *flags))
                                    for dht in (False, True)
                                    for flags in precompile.SWEEP_FLAGS[:2])


def test_flags_carry_no_trailing_false():
    """Static flags as ``layout.static_flags`` leaves them: a launch's key is the
    variant's (trailing False arguments are dropped before the launcher sees them)."""
    after_store_h = [flags[1:] for flags in precompile.FWD_FLAGS]
    for flags in after_store_h + list(precompile.SWEEP_FLAGS):
        assert not flags or flags[-1] is True, flags


def test_an_arch_without_the_fused_backward_ships_neither_it_nor_its_boundary_sweep():
    from dataclasses import replace

    from flash_qla_sm90.arch import SM90

    two_kernels = replace(SM90, fused_backward=False)
    names = _names(two_kernels)
    assert len(names) == 48 - 2 - 2
    assert not [n for n in names if n[0] == "chunk_bwd_fused_kernel"]
    assert ("chunk_bwd_dh_ws_kernel", (True, True, False, True)) not in names
