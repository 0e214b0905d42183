"""The shipped-kernel cache seeding (CPU only; no TileLang import)."""

from __future__ import annotations

import os

import pytest

from flash_qla_sm90.kernels import kernel_cache


@pytest.fixture
def shipped(tmp_path, monkeypatch):
    src = tmp_path / "shipped"
    (src / "0.1.15" / "kernels").mkdir(parents=True)
    (src / "0.1.15" / "kernels" / "entry.bin").write_bytes(b"compiled")
    monkeypatch.setattr(kernel_cache, "SHIPPED", src)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("TILELANG_CACHE_DIR", raising=False)
    return src


def test_seeds_a_writable_cache_and_points_tilelang_at_it(shipped, tmp_path):
    kernel_cache.use_shipped_cache()
    target = tmp_path / "xdg" / "flash-qla" / "tilelang"
    assert os.environ["TILELANG_CACHE_DIR"] == str(target)
    assert (target / "0.1.15" / "kernels" / "entry.bin").read_bytes() == b"compiled"


def test_a_cache_dir_chosen_by_the_user_wins(shipped, tmp_path, monkeypatch):
    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path / "mine"))
    kernel_cache.use_shipped_cache()
    assert os.environ["TILELANG_CACHE_DIR"] == str(tmp_path / "mine")
    assert not (tmp_path / "xdg").exists()
