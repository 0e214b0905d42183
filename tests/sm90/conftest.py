"""Fixtures of the sm90 tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def fresh_tilelang_cache(tmp_path_factory):
    """A fresh TileLang cache for the module's compile-only tests, so that a warm cache
    cannot hide a broken build; compile log lines off."""
    mp = pytest.MonkeyPatch()
    mp.setenv("TILELANG_CACHE_DIR", str(tmp_path_factory.mktemp("tilelang-cache")))
    mp.setenv("TILELANG_PRINT_ON_COMPILATION", "0")
    yield
    mp.undo()
