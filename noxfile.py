"""Sessions of the FlashQLA monorepo (run from the repository root).

    nox -s tests    CPU test suite: core + every kernel package's CPU tests, then every
                    Blackwell kernel variant compiled for its targets (CI runs this)
    nox -s gpu      the whole suite, tests marked `gpu` included; skips without a GPU
    nox -s lint     ruff check
    nox -s build    wheel + sdist of each package into dist/ (one session per package)

Extra arguments after `--` go to pytest (tests, gpu) or ruff (lint).
"""

from __future__ import annotations

import os
import shutil
import xml.etree.ElementTree as ET
from pathlib import Path

import nox

nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = ["tests"]

ROOT = Path(__file__).resolve().parent
PACKAGES = ["flash-qla-core", "flash-qla-tilelang", "flash-qla-sm90", "flash-qla-sm100",
            "flash-qla-sm120"]
# The CPU build of torch that the CI machine keeps on disk for `pip install`; a range
# (or plain "torch") would download a multi-GB CUDA build instead.
CPU_TORCH = "torch==2.13.0"
RUFF = "ruff==0.17.6"


def _install_packages(session: nox.Session, *pip_args: str, extras: str = "test,info") -> None:
    """Every package, editable; the core with ``extras``."""
    args = ["-e", f"packages/flash-qla-core[{extras}]"]
    for package in PACKAGES[1:]:
        args += ["-e", f"packages/{package}"]
    session.install(*pip_args, *args)


def _pytest(session: nox.Session, *args: str, env: dict | None = None) -> None:
    """Run pytest and fail unless at least one test ran (passed or failed, not skipped)."""
    junit = Path(session.create_tmp()) / "junit.xml"
    junit.unlink(missing_ok=True)
    session.run("pytest", f"--junitxml={junit}", *args, *session.posargs,
                env={"FLASH_QLA_REQUIRE_PACKAGES": "1", **(env or {})})
    if not junit.exists():            # --install-only: pytest did not run, nothing to count
        return
    root = ET.parse(junit).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    ran = sum(int(s.get("tests", 0)) - int(s.get("skipped", 0)) for s in suites)
    if ran == 0:
        session.error("no test ran (all were deselected or skipped)")
    session.log(f"{ran} tests ran")


def _has_nvcc() -> bool:
    """nvcc on PATH or under $CUDA_HOME/bin (as tests/conftest.py's `nvcc` marker asks)."""
    home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    return shutil.which("nvcc") is not None or os.access(os.path.join(home, "bin", "nvcc"),
                                                          os.X_OK)


@nox.session
def tests(session: nox.Session) -> None:
    """CPU tests: every test not marked `gpu`; then, where nvcc is and no pytest arguments
    were given, every shipped Blackwell kernel variant compiled for each of its targets
    (tests/portable with FLASH_QLA_FULL_COMPILE=1, one worker per CPU)."""
    session.install(CPU_TORCH)
    _install_packages(session)
    _pytest(session, "-m", "not gpu")
    if _has_nvcc() and not session.posargs:
        _pytest(session, "tests/portable", "-k", "test_compiles_within_the_arch_limits",
                "-n", "auto", "--dist", "loadgroup", "-p", "no:cacheprovider",
                env={"FLASH_QLA_FULL_COMPILE": "1"})


def _has_nvidia_driver() -> bool:
    return Path("/proc/driver/nvidia").exists() or shutil.which("nvidia-smi") is not None


@nox.session(venv_params=["--system-site-packages"])
def gpu(session: nox.Session) -> None:
    """The whole suite on a GPU machine, with the machine's own (CUDA) torch."""
    if not _has_nvidia_driver():
        session.skip("no NVIDIA driver on this machine")
    has_torch = session.run("python", "-c",
                            "import importlib.util as u; print(u.find_spec('torch') is not None)",
                            silent=True).strip().endswith("True")
    if not has_torch:
        session.install("torch>=2.8")  # on Linux, PyPI's default torch is a CUDA build
    # No build isolation and no cuda-python: with the machine's setuptools, torch, TileLang
    # and pytest this also works on an offline GPU host.
    _install_packages(session, "--no-build-isolation", extras="test")
    cuda = session.run("python", "-c", "import torch; print(torch.cuda.is_available())",
                       silent=True).strip()
    if not cuda.endswith("True"):
        session.skip("torch sees no CUDA device")
    _pytest(session)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check (configuration in ruff.toml)."""
    session.install(RUFF)
    session.run("ruff", "check", *(session.posargs or ["."]))


def _fill_kernel_cache(session: nox.Session, package: str) -> None:
    """Compile every kernel variant of an arch package's arches into its kernel_cache/."""
    name = package.removeprefix("flash-qla-")
    if shutil.which("nvcc") is None:
        session.warn(f"nvcc not found: the {name} wheel ships no precompiled kernels")
        return
    session.install(CPU_TORCH)
    session.install("-e", "packages/flash-qla-core", "-e", "packages/flash-qla-tilelang",
                    "-e", f"packages/{package}")
    cache = ROOT / f"packages/{package}/src/flash_qla_{name}/kernel_cache"
    session.run("python", "-m", f"flash_qla_{name}.precompile", str(cache),
                "--jobs", str(os.cpu_count() or 1))


#: The packages whose wheels ship precompiled kernels (nox -s build).
ARCH_PACKAGES = ("flash-qla-sm90", "flash-qla-sm100", "flash-qla-sm120")


@nox.session
@nox.parametrize("package", PACKAGES)
def build(session: nox.Session, package: str) -> None:
    """Wheel and sdist of one package into dist/ (the wheel is built from the sdist).

    For an arch package every kernel variant of its arches is compiled first (nvcc +
    TileLang, no GPU) into the package's ``kernel_cache/``, so the wheel serves its
    first call without JIT.
    """
    session.install("build")
    if package in ARCH_PACKAGES:
        _fill_kernel_cache(session, package)
    session.run("python", "-m", "build", "--outdir", str(ROOT / "dist"),
                str(ROOT / "packages" / package))
