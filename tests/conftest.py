"""Skips for the markers declared in pytest.ini, applied here and nowhere else.

* ``gpu``: skipped unless ``torch.cuda.is_available()``.
* ``sm90`` / ``sm100`` / ``sm120``: also need a device of that compute capability; they
  imply ``gpu``, so ``-m "not gpu"`` deselects them too.
* ``nvcc``: skipped unless ``nvcc`` is on PATH or under ``$CUDA_HOME/bin``.

The session header (``pytest_report_header``) says whether a CUDA device is visible.
"""

from __future__ import annotations

import functools
import os
import shutil

import pytest
import torch

ARCH_CAPABILITIES = {
    "sm90": ((9, 0),),
    "sm100": ((10, 0), (10, 3)),
    "sm120": ((12, 0), (12, 1)),
}


# The CPU tests run many small ops: extra threads only contend (a 2-core CI box ran the
# core suite ~5x slower with torch's default thread count).
torch.set_num_threads(1)


@functools.cache
def _cuda_available() -> bool:
    return torch.cuda.is_available()


@functools.cache
def _capability() -> tuple[int, int] | None:
    return tuple(torch.cuda.get_device_capability(0)) if _cuda_available() else None


@functools.cache
def _nvcc() -> str | None:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    candidate = os.path.join(home, "bin", "nvcc")
    return shutil.which("nvcc") or (candidate if os.access(candidate, os.X_OK) else None)


def pytest_report_header(config):
    """Where the device-dependent suites run (without initialising CUDA)."""
    if _cuda_available():
        return "flash_qla: CUDA available; tests/test_gdr_unit.py runs on the GPU"
    return ("flash_qla: no CUDA device: gpu/sm90/sm100/sm120 tests skip, and "
            "tests/test_gdr_unit.py runs on the torch backend (CPU reference)")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    # tryfirst: the arch markers must add ``gpu`` before ``-m`` deselects.
    for item in items:
        if any(item.get_closest_marker(arch) for arch in ARCH_CAPABILITIES):
            if item.get_closest_marker("gpu") is None:
                item.add_marker(pytest.mark.gpu)


def pytest_runtest_setup(item):
    if item.get_closest_marker("gpu") and not _cuda_available():
        pytest.skip("needs a CUDA device (torch.cuda.is_available() is False)")
    for arch, caps in ARCH_CAPABILITIES.items():
        if item.get_closest_marker(arch) and _capability() not in caps:
            pytest.skip(f"needs an {arch} GPU (compute capability "
                        f"{' or '.join(f'{a}.{b}' for a, b in caps)}); this one is "
                        f"{_capability()}")
    if item.get_closest_marker("nvcc") and _nvcc() is None:
        pytest.skip("needs nvcc (CUDA toolkit) on PATH or in $CUDA_HOME/bin")
