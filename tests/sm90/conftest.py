"""Fixtures of the sm90 tests, and their collection: every module here imports
``flash_qla_tl`` (flash-qla-tilelang), so a core-only install (``pip install -e
packages/flash-qla-core[test]``) collects none of them instead of failing to import."""

from __future__ import annotations

import importlib.util

import pytest

collect_ignore_glob = [] if importlib.util.find_spec("flash_qla_tl") else ["test_*.py"]


@pytest.fixture(scope="module")
def fresh_tilelang_cache(tmp_path_factory):
    """A fresh TileLang cache for the module's compile-only tests, so that a warm cache
    cannot hide a broken build; compile log lines off."""
    mp = pytest.MonkeyPatch()
    mp.setenv("TILELANG_CACHE_DIR", str(tmp_path_factory.mktemp("tilelang-cache")))
    mp.setenv("TILELANG_PRINT_ON_COMPILATION", "0")
    yield
    mp.undo()
