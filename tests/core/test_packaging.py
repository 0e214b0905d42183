"""Packaging: light imports, the real entry points, and ``python -m flash_qla info``.

The tests about installed kernel packages skip when a package is not installed, except
under ``FLASH_QLA_REQUIRE_PACKAGES=1`` (set by ``nox -s tests``), where a missing
registration fails.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

from flash_qla import dispatch
from flash_qla.backend import KERNEL_API_VERSION, BackendSpec
from flash_qla.info import DeviceInfo, DeviceQuery, query_devices, report

ROOT = Path(__file__).resolve().parents[2]
KERNEL_PACKAGES = {
    # name: (distribution, capabilities)
    "sm90": ("flash-qla-sm90", ((9, 0),)),
    "sm100": ("flash-qla-sm100", ((10, 0), (10, 3))),
    "sm120": ("flash-qla-sm120", ((12, 0), (12, 1))),
}


def require(distribution: str) -> str:
    """The installed version of ``distribution``, or skip (fail under nox)."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        if os.environ.get("FLASH_QLA_REQUIRE_PACKAGES") == "1":
            pytest.fail(f"{distribution} is not installed in the test environment")
        pytest.skip(f"{distribution} is not installed")


def run_python(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **(env or {})}
    full_env.pop(dispatch.ENV_VAR, None)
    return subprocess.run([sys.executable, *args], capture_output=True, text=True,
                          timeout=300, env=full_env, cwd=ROOT)


@pytest.fixture(autouse=True)
def _fresh_discovery(monkeypatch):
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    dispatch.clear_cache()
    yield
    dispatch.clear_cache()


# --------------------------------------------------------------------------------------
# Imports stay light
# --------------------------------------------------------------------------------------

def test_import_flash_qla_is_light():
    code = (
        "import sys, flash_qla, flash_qla.dispatch\n"
        "assert flash_qla.dispatch._discovery is None, 'discovery ran at import'\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('tilelang', 'tvm', 'flash_qla_tl', 'flash_qla_sm90', 'flash_qla_sm100', "
        "'flash_qla_sm120'))\n"
        "assert not heavy, heavy\n"
    )
    proc = run_python("-c", code)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("name", sorted(KERNEL_PACKAGES))
def test_import_kernel_package_does_not_import_tilelang(name):
    distribution, _ = KERNEL_PACKAGES[name]
    require(distribution)
    code = (
        f"import sys, flash_qla_{name}\n"
        f"assert isinstance(flash_qla_{name}.BACKEND, __import__('flash_qla.backend').backend"
        f".BackendSpec)\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('tilelang', 'tvm') "
        f"or m.startswith('flash_qla_{name}.kernels'))\n"
        "assert not heavy, heavy\n"
    )
    proc = run_python("-c", code)
    assert proc.returncode == 0, proc.stderr


# --------------------------------------------------------------------------------------
# The real entry points
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(KERNEL_PACKAGES))
def test_kernel_package_registers_its_backend(name):
    distribution, capabilities = KERNEL_PACKAGES[name]
    version = require(distribution)
    (ep,) = [ep for ep in importlib.metadata.entry_points(group=dispatch.ENTRY_POINT_GROUP)
             if ep.name == name]
    assert ep.value == f"flash_qla_{name}:BACKEND"
    specs, failures = dispatch.discover()
    assert [f for f in failures if f.name == name] == []
    spec = specs[name]
    assert isinstance(spec, BackendSpec)
    assert (spec.distribution, spec.version) == (distribution, version)
    assert spec.capabilities == capabilities
    assert spec.kernel_api_version == KERNEL_API_VERSION
    assert spec.head_dims == ((128, 128),)
    assert spec.dtypes == ("bfloat16", "float16")


@pytest.mark.parametrize("name", ["sm100", "sm120"])
def test_blackwell_packages_serve_their_arches(name):
    """The Blackwell packages' capabilities are their arches' (one per compute
    capability, each for its own target), and their notes say what they serve."""
    distribution, capabilities = KERNEL_PACKAGES[name]
    require(distribution)
    arch = importlib.import_module(f"flash_qla_{name}.arch")
    spec = dispatch.discover()[0][name]
    assert tuple(sorted(arch.BY_CAPABILITY)) == capabilities == spec.capabilities
    assert [a.target for a in arch.ARCHES] == [f"sm_{m}{n}a" for m, n in capabilities]
    assert "wgmma" not in {a.mma for a in arch.ARCHES}
    assert all(a.target in spec.notes for a in arch.ARCHES), spec.notes


def test_sm90_spec_matches_its_kernel_traits():
    """The light spec repeats the traits of the shared kernels; they must agree."""
    require("flash-qla-sm90")
    require("flash-qla-tilelang")
    import flash_qla_sm90
    import flash_qla_tl

    traits = Path(flash_qla_tl.__file__).parent / "kernels" / "traits.py"
    values = runpy.run_path(str(traits))
    assert flash_qla_sm90.BACKEND.head_dims == tuple(values["HEAD_DIMS"])
    assert flash_qla_sm90.BACKEND.dtypes == tuple(values["DTYPES"])


@pytest.mark.parametrize("name", sorted(KERNEL_PACKAGES))
def test_kernel_package_depends_on_the_shared_kernels(name):
    """Every arch package pulls the shared TileLang kernels (``flash-qla-tilelang``,
    which pins TileLang) in the version of its own minor release line."""
    distribution, _ = KERNEL_PACKAGES[name]
    require(distribution)
    requires = importlib.metadata.requires(distribution) or []
    shared = [r for r in requires if r.startswith("flash-qla-tilelang")]
    assert shared, requires
    require("flash-qla-tilelang")
    assert "tilelang==0.1.15" in importlib.metadata.requires("flash-qla-tilelang")


def test_core_extras_pin_the_kernel_packages():
    require("flash-qla")
    assert dispatch._pinned_requirement("flash-qla-sm90") == "flash-qla-sm90==0.2.*"
    assert dispatch._pinned_requirement("flash-qla-sm100") == "flash-qla-sm100==0.0.*"
    extras = set(importlib.metadata.metadata("flash-qla").get_all("Provides-Extra"))
    assert {"sm90", "sm100", "sm120", "all", "test", "bench", "info"} <= extras
    assert set(dispatch.CAPABILITY_EXTRAS.values()) <= extras


# --------------------------------------------------------------------------------------
# python -m flash_qla info
# --------------------------------------------------------------------------------------

def test_info_command_runs():
    proc = run_python("-m", "flash_qla", "info")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    for heading in ("Environment", "GPUs (asked through", "Backends", "What to install"):
        assert heading in out
    assert "TileLang" in out and "torch" in out
    if "sm90" in dispatch.discover()[0]:
        assert "flash-qla-sm90 " in out


def test_info_without_arguments_prints_usage():
    proc = run_python("-m", "flash_qla")
    assert proc.returncode == 2
    assert "info" in proc.stderr


def test_info_does_not_import_tilelang_or_kernels():
    code = (
        "import sys, io, contextlib\n"
        "from flash_qla.__main__ import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    main(['info'])\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('tilelang', 'tvm') "
        "or '.kernels' in m)\n"
        "assert not heavy, heavy\n"
        "import torch\n"
        "assert not torch.cuda.is_initialized()\n"
    )
    proc = run_python("-c", code)
    assert proc.returncode == 0, proc.stderr


def test_info_maps_gpus_to_backends_and_fixes():
    require("flash-qla-sm90")
    require("flash-qla-sm100")
    query = DeviceQuery(method="test", driver_cuda=(13, 0), devices=[
        DeviceInfo(0, "NVIDIA H200", (9, 0), 141 * 2**30),
        DeviceInfo(1, "NVIDIA B200", (10, 0), 180 * 2**30),
        DeviceInfo(2, "NVIDIA A100", (8, 0), 80 * 2**30),
    ])
    text, status = report(query=query)
    assert status == 0
    version = importlib.metadata.version("flash-qla-sm90").replace(".", r"\.")
    assert re.search(r"cuda:0\s+NVIDIA H200\s+compute capability 9\.0\s+141 GiB\s+"
                     rf"-> sm90 \(flash-qla-sm90 {version}\)", text), text
    assert re.search(r'cuda:0 \(9\.0\): pip install -e \S*flash-qla-tilelang '
                     r'-e \S*flash-qla-sm90 .*pip install "flash-qla\[sm90\]".*  \[installed\]',
                     text), text
    assert re.search(r'cuda:1 \(10\.0\): pip install -e .*"flash-qla\[sm100\]".*  \[installed\]',
                     text)
    assert "no backend installed" in text
    assert "cuda:2 (8.0): no FlashQLA kernel package serves compute capability 8.0" in text


def test_info_flags_a_backend_variable_naming_no_backend(monkeypatch):
    """FLASH_QLA_BACKEND naming nothing installed: said in the environment table, status 1
    (every CUDA call would raise); a real backend's name passes."""
    query = DeviceQuery(method="test", driver_cuda=(13, 0))
    monkeypatch.setenv("FLASH_QLA_BACKEND", "bogus")
    text, status = report(query=query)
    assert status == 1
    assert re.search(r"FLASH_QLA_BACKEND\s+bogus  -- no such backend here \(installed: torch",
                     text), text
    monkeypatch.setenv("FLASH_QLA_BACKEND", "torch")
    text, status = report(query=query)
    assert status == 0 and re.search(r"FLASH_QLA_BACKEND\s+torch\n", text), text


def test_info_flags_an_old_driver():
    text, _ = report(query=DeviceQuery(method="test", driver_cuda=(12, 4)))
    assert "driver supports CUDA 12.4  -- too old: FlashQLA needs CUDA >= 12.8" in text
    assert "the driver lists no GPU" in text


def test_info_without_cuda_python(monkeypatch):
    hide = {"cuda", "cuda.bindings", "cuda.bindings.driver", "cuda.cuda"}
    hide |= {m for m in sys.modules if m.startswith("cuda.")}
    for module in hide:  # None in sys.modules makes `import cuda...` fail
        monkeypatch.setitem(sys.modules, module, None)
    query = query_devices()
    assert query.method.startswith("ctypes")
    assert query.devices or "driver" in query.problem
    # the supported query is recommended where there is a driver to ask, not on a
    # machine without one (nothing to install there)
    hint = any('pip install "flash-qla[info]"' in note for note in query.notes)
    assert hint == (query.problem is None)
    text, _ = report(query=query)
    assert "cuda-python is not installed" in text


def test_info_with_cuda_python():
    pytest.importorskip("cuda.bindings.driver")
    query = query_devices()
    assert query.method.startswith("cuda-python")
    assert query.devices or query.problem  # no driver here: a clear line, no exception
    if query.problem:
        assert "driver" in query.problem or "GPU" in query.problem
